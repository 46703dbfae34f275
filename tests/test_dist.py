"""make dist (tests/release/dist.py): the release artifacts, built for real and checked here
again on their own bytes, not on the script's word.

The script runs once (about 40 s with a warm pip cache: the wheel's isolated build and the
fresh venv fetch from PyPI). Then: the wheel, installed apart from the work tree, runs
`check --from` on a saved bundle; the packaged chart passes `helm lint --strict` (and a
broken copy of it does not); the krew archive's sha256 is the manifest's; LICENSE, the
Apache License 2.0 text, is inside the wheel, the sdist, the chart and the krew archive;
the SBOM lists pyproject's runtime dependencies at requirements.lock's versions. The
script's own checks are shown to refuse broken artifacts too, and the release workflow
to build with make dist.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.release import dist as release

REPO = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
BUNDLE = REPO / "tests" / "data" / "bundles" / "tke-etp-local"
# The Apache Software Foundation's LICENSE-2.0.txt, appendix included (11,358 bytes; the
# same bytes as Debian's /usr/share/common-licenses/Apache-2.0)
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
CHECKS = ("version", "wheel", "sdist", "wheel runs", "sbom", "image recipe", "chart", "krew",
          "dist")


@dataclass(frozen=True)
class Dist:
    out: Path
    stdout: str

    def one(self, pattern: str) -> Path:
        found = sorted(self.out.glob(pattern))
        assert len(found) == 1, f"{pattern} in {self.out}: {found}\n{self.stdout}"
        return found[0]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "release" / "dist.py"),
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"make dist failed:\n{proc.stdout}\n{proc.stderr}"
    return Dist(out, proc.stdout)


def helm(*args: str | Path, home: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "helm"
    assert exe.is_file(), f"{exe}: no helm (make puts it there: charts/install_helm.py)"
    env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


def license_bytes() -> bytes:
    return (REPO / "LICENSE").read_bytes()


# -- the run -------------------------------------------------------------------------------


def test_every_check_says_ok(dist: Dist) -> None:
    said = [m.group(1) for m in re.finditer(r"(?m)^ok   ([a-z ]+): ", dist.stdout)]
    assert said == list(CHECKS), dist.stdout
    assert "FAIL" not in dist.stdout
    sums = dict(reversed(line.split("  ", 1))
                for line in (dist.out / "SHA256SUMS").read_text().splitlines())
    assert len(sums) == 5, sums
    for name, digest in sums.items():
        assert hashlib.sha256((dist.out / name).read_bytes()).hexdigest() == digest, name


def test_license_is_the_apache_2_text() -> None:
    data = license_bytes()
    assert hashlib.sha256(data).hexdigest() == APACHE_2_SHA256
    debian = Path("/usr/share/common-licenses/Apache-2.0")  # base-files: every Debian has it
    assert data == debian.read_bytes()
    assert b"END OF TERMS AND CONDITIONS" in data and b"APPENDIX" in data
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license-files"] \
        == ["LICENSE"]


def test_license_inside_each_artifact(dist: Dist) -> None:
    with zipfile.ZipFile(dist.one("loopback_agent-*.whl")) as z:
        assert z.read(f"loopback_agent-{VERSION}.dist-info/licenses/LICENSE") \
            == license_bytes()
        metadata = z.read(f"loopback_agent-{VERSION}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    for pattern, member in (("loopback_agent-*.tar.gz", f"loopback_agent-{VERSION}/LICENSE"),
                            ("loopback-agent-*.tgz", "loopback-agent/LICENSE"),
                            ("kubectl-loopback-*.tar.gz", "LICENSE")):
        with tarfile.open(dist.one(pattern), "r:gz") as tar:
            f = tar.extractfile(member)
            assert f is not None and f.read() == license_bytes(), (pattern, member)


def test_wheel_installs_and_runs(dist: Dist, tmp_path: Path) -> None:
    """Installed apart from the work tree (its own directory first on the path), the
    wheel's agent is the one imported and diagnoses the bundle tests/test_cli.py does."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(dist.one("loopback_agent-*.whl"))], check=True,
                   capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import agent; print(agent.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout
    assert not (site / "lab").exists() and not (site / "tests").exists()
    assert (site / "bin" / "loopback-agent").is_file()
    r = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(BUNDLE)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 1, r.stderr  # at risk, as in tests/test_cli.py
    assert "AT RISK" in r.stdout and "kube-proxy mode: ipvs" in r.stdout
    assert f"loopback-agent {VERSION}" in r.stdout


def test_chart_tgz_lints_and_a_broken_one_does_not(dist: Dist, tmp_path: Path) -> None:
    tgz = dist.one(f"loopback-agent-{VERSION}.tgz")
    good = helm("lint", "--strict", tgz, home=tmp_path / "helm")
    assert good.returncode == 0, good.stdout + good.stderr
    with tarfile.open(tgz, "r:gz") as tar:
        chart = yaml.safe_load(tar.extractfile("loopback-agent/Chart.yaml").read())  # type: ignore[union-attr]
        members = [(m, tar.extractfile(m).read() if m.isfile() else None)  # type: ignore[union-attr]
                   for m in tar.getmembers()]
    assert chart["version"] == VERSION and chart["appVersion"] == VERSION
    broken = tmp_path / "broken.tgz"
    with tarfile.open(broken, "w:gz") as out:
        for m, data in members:
            if m.name == "loopback-agent/Chart.yaml":
                data = yaml.safe_dump({**chart, "version": "not-a-version"}).encode()
                m = copy.copy(m)
                m.size = len(data)
            out.addfile(m, io.BytesIO(data) if data is not None else None)
    bad = helm("lint", "--strict", broken, home=tmp_path / "helm")
    assert bad.returncode != 0, bad.stdout


def test_krew_archive_sha256_is_the_manifests(dist: Dist) -> None:
    archive = dist.one("kubectl-loopback-*.tar.gz")
    (platform,) = yaml.safe_load((REPO / "plugins" / "loopback.yaml").read_text()
                                 )["spec"]["platforms"]
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == platform["sha256"]
    assert platform["uri"].endswith(f"/v{VERSION}/{archive.name}")
    assert {"from": "LICENSE", "to": "."} in platform["files"]


def test_sbom_lists_pyprojects_dependencies(dist: Dist) -> None:
    doc = json.loads(dist.one("loopback-agent-*.cdx.json").read_text())
    assert doc["bomFormat"] == "CycloneDX"
    listed = {release.canonical(c["name"]): c["version"] for c in doc["components"]}
    pins = release.lock_pins()
    deps = [re.match(r"[A-Za-z0-9._-]+", d).group(0)  # type: ignore[union-attr]
            for d in tomllib.loads((REPO / "pyproject.toml").read_text()
                                   )["project"]["dependencies"]]
    assert len(deps) >= 8
    for dep in map(release.canonical, deps):
        assert listed.get(dep) == pins[dep], dep
    assert doc["metadata"]["component"]["name"] == "loopback-agent"
    assert doc["metadata"]["component"]["version"] == VERSION


# -- the script's checks refuse what is broken ---------------------------------------------


def test_krew_check_refuses_a_stale_manifest_and_a_missing_license(dist: Dist,
                                                                   tmp_path: Path) -> None:
    archive = dist.one("kubectl-loopback-*.tar.gz")
    manifest = yaml.safe_load((REPO / "plugins" / "loopback.yaml").read_text())
    release.check_krew(archive, manifest)
    stale = copy.deepcopy(manifest)
    stale["spec"]["platforms"][0]["sha256"] = "0" * 64
    with pytest.raises(release.CheckFailed, match="sha256"):
        release.check_krew(archive, stale)
    without = tmp_path / archive.name
    with tarfile.open(archive, "r:gz") as tar, tarfile.open(without, "w:gz") as out:
        for m in tar.getmembers():
            if m.name != "LICENSE":
                out.addfile(m, tar.extractfile(m))
    fixed = copy.deepcopy(manifest)
    fixed["spec"]["platforms"][0]["sha256"] = hashlib.sha256(without.read_bytes()).hexdigest()
    with pytest.raises(release.CheckFailed, match="LICENSE"):
        release.check_krew(without, fixed)


def test_wheel_check_refuses_a_wheel_without_license(dist: Dist, tmp_path: Path) -> None:
    wheel = dist.one("loopback_agent-*.whl")
    setuptools = release.lock_pins(release.BUILD_LOCK)["setuptools"]
    release.check_wheel(wheel, VERSION, setuptools)
    without = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as z, zipfile.ZipFile(without, "w") as out:
        for info in z.infolist():
            if not info.filename.endswith("/licenses/LICENSE"):
                out.writestr(info, z.read(info))
    with pytest.raises(release.CheckFailed, match="LICENSE"):
        release.check_wheel(without, VERSION, setuptools)


def test_sbom_check_refuses_a_missing_dependency(dist: Dist, tmp_path: Path) -> None:
    sbom = dist.one("loopback-agent-*.cdx.json")
    release.check_sbom(sbom, VERSION)
    doc: dict[str, Any] = json.loads(sbom.read_text())
    doc["components"] = [c for c in doc["components"]
                         if release.canonical(c["name"]) != "pyroute2"]
    cut = tmp_path / sbom.name
    cut.write_text(json.dumps(doc))
    with pytest.raises(release.CheckFailed, match="pyroute2"):
        release.check_sbom(cut, VERSION)


def test_exit_codes_are_read_from_the_help() -> None:
    from agent.cli import EPILOG

    codes = release.documented_exit_codes(EPILOG)
    assert set(codes) == {0, 1, 2, 3, 64, 65, 66, 70, 73}
    assert codes[1].startswith("at risk")


# -- where it is called from ---------------------------------------------------------------


def test_make_dist_runs_the_script() -> None:
    text = (REPO / "Makefile").read_text()
    assert re.search(r"(?m)^\.PHONY:.*\bdist\b", text)
    target = re.search(r"(?m)^dist: (.*)\n\t(.*)$", text)
    assert target is not None
    assert target.group(1).split() == ["deps", "venv", "$(VENV)/bin/helm"]
    assert target.group(2) == "$(PY) tests/release/dist.py --out $(DIST)"


def test_release_workflow_builds_with_make_dist() -> None:
    path = REPO / ".github" / "workflows" / "release.yml"
    text = path.read_text()
    assert text.startswith("# NOT RUN FROM THIS ENVIRONMENT")
    wf = yaml.safe_load(text)
    assert wf[True]["push"]["tags"] == ["v*.*.*"]  # YAML 1.1 reads the key `on` as true
    jobs = wf["jobs"]
    steps = {job: [s.get("run", "") + s.get("uses", "") for s in spec["steps"]]
             for job, spec in jobs.items()}
    assert any(s.strip() == "make dist" for s in steps["dist"])
    assert any(s.startswith("pypa/gh-action-pypi-publish") for s in steps["pypi"])
    assert jobs["pypi"]["permissions"]["id-token"] == "write"
    assert any("helm push" in s for s in steps["chart"])
    assert any("cosign attest" in s and ".python.cdx.json" in s for s in steps["image"])
    assert any(s.startswith("rajatjindal/krew-release-bot") for s in steps["krew"])
    # the suite runs on the tag; nothing is published before it and make dist passed, and
    # the release page comes last
    assert any(s.strip() == ".ci/run" for s in steps["test"])
    publishing = set(jobs) - {"dist", "test"}
    for job in publishing - {"krew"}:
        assert {"dist", "test"} <= set(jobs[job]["needs"]), job
    assert {"pypi", "image", "chart"} <= set(jobs["release"]["needs"])
    assert jobs["krew"]["needs"] == "release"
    assert "github.repository_owner }}/" not in text  # (lower-cased first: registries)


def test_changelog_names_the_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and VERSION in text
    assert len(text.splitlines()) <= 90


def test_image_recipe_check_refuses_a_build_context_without_license(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image builds its wheel from the Docker build context, an allow-list: LICENSE
    must be let in (.dockerignore) and copied (Dockerfile), or the image's wheel lacks it."""
    for name in (".dockerignore", "Dockerfile"):
        (tmp_path / name).write_text((REPO / name).read_text())
    monkeypatch.setattr(release, "REPO", tmp_path)
    release.check_image_recipe()
    ignore = tmp_path / ".dockerignore"
    ignore.write_text(ignore.read_text().replace("!LICENSE\n", ""))
    with pytest.raises(release.CheckFailed, match="LICENSE"):
        release.check_image_recipe()
