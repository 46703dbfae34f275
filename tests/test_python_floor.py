"""The oldest Python the project supports is a promise: a call it lacks fails here, whatever
Python the suite happens to run on (a development machine's is newer than Debian 12's).

- The package and everything that runs on the suite's Python: 3.11 (pyproject's
  requires-python; Debian 12, the oldest machine the project runs on, has 3.11.2).
- The krew archive of `kubectl loopback` (agent/__init__.py, agent/kubectl_plugin.py and
  agent/terminal.py, run by a workstation's own python3): 3.10, as plugins/loopback.yaml
  says.

vermin reads which version each call, module and keyword needs; it knows minor versions, not
patch releases, so `make test` also runs the suite on Debian's own /usr/bin/python3 where the
machine has one (the Makefile's PYTHON), which is 3.11.2 on Debian 12.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests import tarsafe

REPO = Path(__file__).resolve().parents[1]
VERMIN = Path(sys.executable).parent / "vermin"


def floor() -> str:
    text = (REPO / "pyproject.toml").read_text()
    m = re.search(r'^requires-python = ">=(\d+\.\d+)"$', text, re.M)
    assert m, "pyproject.toml: requires-python is not '>=X.Y'"
    return m.group(1)


def plugin_floor() -> str:
    text = (REPO / "plugins" / "loopback.yaml").read_text()
    m = re.search(r"python3 \((\d+\.\d+) or newer\)", text)
    assert m, "plugins/loopback.yaml no longer says which python3 it needs"
    return m.group(1)


def vermin(target: str, paths: list[Path]) -> subprocess.CompletedProcess[str]:
    # --eval-annotations: `from __future__ import annotations` hides newer syntax in hints
    # from the interpreter, not from a type checker a user may run
    return subprocess.run(
        [str(VERMIN), "--no-tips", "--violations", "--eval-annotations", "--no-parse-comments",
         "--backport", "typing_extensions", f"-t={target}-", *map(str, paths)],
        capture_output=True, text=True, timeout=300)


def test_everything_runs_on_the_supported_floor() -> None:
    proc = vermin(floor(), [REPO / d for d in ("agent", "lab", "tests", "plugins", "charts")])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_krew_archive_runs_on_the_plugins_floor() -> None:
    files = [REPO / "agent" / n for n in ("__init__.py", "kubectl_plugin.py", "terminal.py")]
    proc = vermin(plugin_floor(), files)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vermin_catches_a_call_newer_than_the_floor(tmp_path: Path) -> None:
    """The check is not blind: datetime.UTC (3.11) and tomllib fail at 3.10."""
    (tmp_path / "new.py").write_text("import tomllib\nfrom datetime import UTC\n")
    proc = vermin("3.10", [tmp_path / "new.py"])
    assert proc.returncode != 0 and "tomllib" in proc.stdout and "UTC" in proc.stdout


def test_the_floors_agree_with_what_is_documented() -> None:
    readme = (REPO / "README.md").read_text()
    assert f"Python {floor()} or newer" in readme
    launcher = (REPO / "plugins" / "build_krew.py").read_text()
    assert f"python3 ({plugin_floor()} or newer)" in launcher
    ruff_target = f'target-version = "py{floor().replace(".", "")}"'
    assert ruff_target in (REPO / "pyproject.toml").read_text()


def _tar(*members: tarfile.TarInfo, data: bytes = b"x") -> tarfile.TarFile:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for m in members:
            if m.isreg():
                m.size = len(data)
                tar.addfile(m, io.BytesIO(data))
            else:
                tar.addfile(m)
    raw.seek(0)
    return tarfile.open(fileobj=raw, mode="r")


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "",
            mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


@pytest.mark.parametrize("member", [
    _member("../escape"), _member("/abs/file"), _member("a/../../escape"),
    _member("link", tarfile.SYMTYPE, "/etc/passwd"), _member("hard", tarfile.LNKTYPE, "x"),
    _member("dev", tarfile.CHRTYPE), _member("fifo", tarfile.FIFOTYPE),
], ids=lambda m: m.name)
def test_tar_extraction_refuses_unsafe_members(tmp_path: Path, member: tarfile.TarInfo) -> None:
    with _tar(_member("ok"), member) as tar, pytest.raises(tarsafe.UnsafeMember):
        tarsafe.extract(tar, tmp_path / "out")
    assert not (tmp_path / "out" / "ok").exists()  # nothing written before the refusal
    assert not (tmp_path / "escape").exists()


def test_tar_extraction_keeps_files_and_strips_special_modes(tmp_path: Path) -> None:
    with _tar(_member("d", tarfile.DIRTYPE, mode=0o755), _member("d/run", mode=0o4777),
              _member("d/plain", mode=0o644), data=b"hello") as tar:
        written = tarsafe.extract(tar, tmp_path)
    assert sorted(p.name for p in written) == ["plain", "run"]
    assert (tmp_path / "d" / "run").read_bytes() == b"hello"
    assert (tmp_path / "d" / "run").stat().st_mode & 0o7777 == 0o755
    assert (tmp_path / "d" / "plain").stat().st_mode & 0o7777 == 0o644
