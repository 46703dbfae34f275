"""What `make lint` checks, run by `make test` too (CI runs make test): ruff over the code,
and mypy --strict over the walk engine and the diagnosis (pyproject's [tool.mypy]: the
types are the contract the backends and the rules keep); and that every bench `make bench`
runs can start."""

from __future__ import annotations

import re
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


def test_every_bench_of_make_bench_starts() -> None:
    """Each script `make bench` runs imports what it needs from any working directory
    (capture_rate.py imported the lab without putting the checkout on its path, and `make
    bench` reported its miss only at the end of an hour): its --help exits 0."""
    makefile = (REPO / "Makefile").read_text()
    names = sorted(set(re.findall(r'"([a-z_0-9]+\.py)\b', makefile)))
    assert "check_from.py" in names and "capture_rate.py" in names, names
    procs = {n: subprocess.Popen([sys.executable, str(REPO / "tests" / "bench" / n), "--help"],
                                 cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for n in names}
    failed = {}
    try:
        for n, p in procs.items():
            out, err = p.communicate(timeout=120)
            if p.returncode != 0 or "usage:" not in out:
                failed[n] = (p.returncode, err[-400:])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not failed, failed
