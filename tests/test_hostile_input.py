"""Inputs built to hurt the readers, as real files through the real command: JSON and YAML
nested past what their parsers follow, and lines padded with long runs of blanks.

Each case failed before its fix: the nesting as an internal error (exit 70, "please
report this"), not a refusal naming the file; the padding in time quadratic in the run
(a rule line padded with 32k blanks took 34 s, a megabyte would take hours). The
padding tests give the readers a run a quadratic reader would need hours for (minutes
for the continuations), under a limit a linear one meets a hundred times over: they
cannot pass by luck nor fail on a slow machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.bundle import load_texts
from agent.bundle import sections as fmt
from agent.errors import InputError
from agent.netfilter.rules_text import RulesText, read_rules_text, settle
from agent.probes.kube_api import RawResponse, _parse
from agent.probes.kube_proxy import read_config

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "tests" / "data" / "bundles" / "tke-etp-local"
DEEP_JSON = "[" * 20_000 + "]" * 20_000  # (the recursion limit is 1000 levels)
DEEP_YAML = "spec: " + "[" * 5_000 + "]" * 5_000 + "\n"
EXIT_DATAERR, EXIT_SOFTWARE = 65, 70


def agent(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LOOPBACK_AGENT_DEBUG", None)  # (it turns an internal error into a traceback)
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, timeout=120, env=env, check=False)


# -- nesting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["paste.txt", "services.json", "svc.yaml"])
def test_a_pasted_file_nested_too_deep_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_text(DEEP_YAML if name.endswith(".yaml") else DEEP_JSON)
    proc = agent("check", "--from", str(f))
    assert proc.returncode == EXIT_DATAERR, proc.stderr
    assert str(f) in proc.stderr and "internal error" not in proc.stderr


@pytest.mark.parametrize("text", [DEEP_JSON, DEEP_YAML])
def test_a_bundle_file_nested_too_deep_costs_that_file_only(tmp_path: Path, text: str) -> None:
    for f in BUNDLE.iterdir():
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "services.json").write_text(text)
    proc = agent("check", "--from", str(tmp_path))
    assert proc.returncode in (0, 1), proc.stderr  # a verdict from the rest of the bundle
    assert "services.json:1: not valid YAML/JSON: nested deeper than its parser can follow" \
        in proc.stderr
    assert "internal error" not in proc.stderr


def test_a_snapshot_nested_too_deep_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "snap.json"
    f.write_text(DEEP_JSON)
    proc = agent("check", "--snapshot", str(f))
    assert proc.returncode == EXIT_DATAERR, proc.stderr
    assert f"{f}: not a loopback-agent snapshot: JSON nested deeper" in proc.stderr


def test_an_api_answer_nested_too_deep_is_an_input_error() -> None:
    with pytest.raises(InputError, match="bad JSON"):
        _parse(RawResponse("services", body=DEEP_JSON.encode()))


def test_a_kube_proxy_config_nested_too_deep_reads_as_nothing() -> None:
    assert read_config(DEEP_JSON) == {}


# -- long runs of blanks ---------------------------------------------------------------------


class _TooSlow(Exception):
    pass


@pytest.fixture
def within_20s() -> Iterator[None]:
    """SIGALRM after 20 s: a reader quadratic in these runs needs hours."""
    def fire(*_: object) -> None:
        raise _TooSlow("quadratic in the blank run")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


BLANKS = " " * 500_000  # quadratic: 34 s at 32k, so hours here; linear: tenths


@pytest.mark.parametrize("text", [
    # a terminal's padding inside one rule (what the unwrapping looks for)
    f"*nat\n-A KUBE-SERVICES{BLANKS}-j KUBE-NODEPORTS\nCOMMIT\n",
    f"-A KUBE-SERVICES -s 10.0.0.1/32{BLANKS}5 -j RETURN\n",
    f"-A KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-SVC-X{BLANKS}\n-A KUBE-SVC-X -j DROP\n",
    # backslash continuations joined into one line of blanks
    "*nat\n" + "\\\n" * 200_000 + "COMMIT\n",
], ids=["padded-rule", "padded-before-a-number", "trailing-padding", "continuations"])
def test_rule_text_with_a_long_blank_run_is_read_in_linear_time(text: str,
                                                                within_20s: None) -> None:
    into = RulesText()
    read_rules_text(text, "paste.txt", into)
    settle(into)


@pytest.mark.parametrize("name", ["iptables-save.txt", "iptables-L.txt", "ipset.txt",
                                  "ipvsadm.txt", "addr.txt", "route-local.txt", "sysctl.txt",
                                  "services.yaml", "nft.txt", "paste.txt"])
def test_every_reader_takes_a_long_blank_run_in_linear_time(name: str,
                                                            within_20s: None) -> None:
    for text in (f"-A X{BLANKS}-j Y\n", f"x{BLANKS}x\n", f"{BLANKS}\n" * 2,
                 f"- {BLANKS}A\n", f"1.2.3.4{BLANKS}5\n"):
        # (refused, naming the file: what a reader may do with it)
        with contextlib.suppress(InputError):
            load_texts([(name, text, fmt.name_format(name))], origin="paste")
