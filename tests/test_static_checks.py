"""What `make lint` checks, run by `make test` too (CI runs make test): ruff over the code,
and mypy --strict over the walk engine and the diagnosis (pyproject's [tool.mypy]: the
types are the contract the backends and the rules keep)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / cmd[0]), *cmd[1:]], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_ruff() -> None:
    proc = _run("ruff", "check", "--no-cache", "agent", "lab", "tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_on_the_engine_and_the_diagnosis() -> None:
    proc = _run("mypy", "--cache-dir", "/dev/null")  # (files and strict: pyproject.toml)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout


def test_mypy_sees_a_type_error(tmp_path: Path) -> None:
    """The check is not blind: strict mode refuses an untyped function."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    return x + 1\n")
    proc = _run("mypy", "--strict", "--cache-dir", "/dev/null", "--config-file", "/dev/null",
                str(bad))
    assert proc.returncode == 1 and "no-untyped-def" in proc.stdout, proc.stdout
