"""`check --jobs 2`: a forked child walks half of a big node's LB IPs; the verdict must be
the one a single process gives, byte for byte, also when the child dies or a rule fails
in its half (agent/diagnose/parallel.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import EXIT_USAGE
from agent.diagnose import parallel
from lab.kube_proxy_rules import synthetic

ROOT = Path(__file__).resolve().parents[1]


def _bundle(tmp: Path, n: int, mode: str, without: tuple[str, ...]) -> Path:
    d = tmp / f"{mode}-{n}"
    d.mkdir()
    for name, text in synthetic(n, mode).items():
        if name not in without:
            (d / name).write_text(text)
    return d


# without the node's addresses an IPVS node's walks report an unknown per LB IP: the
# child's half has its own, which must come after the parent's
@pytest.fixture(scope="module", params=[("iptables", ()), ("ipvs", ()),
                                        ("ipvs", ("addr.txt", "route-local.txt"))],
                ids=["iptables", "ipvs", "ipvs-no-addresses"])
def big(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _bundle(tmp_path_factory.mktemp("par"), 1200, *request.param)


def _run(d: Path, jobs: int, fault: str = "none") -> dict:  # type: ignore[type-arg]
    """tests/parallel_run.py in a fresh, one-thread process (pytest's may have more: the
    split is refused there, rightly)."""
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "parallel_run.py"), str(d),
                        str(jobs), fault], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def test_two_processes_give_the_single_process_verdict(big: Path
                                                       ) -> None:
    d = big
    one, two = _run(d, 1), _run(d, 2, "any-mode")
    assert one["lb_ips"] == 1200 and one["parent_walked"] == 1200
    assert len(json.loads(one["doc"])["findings"]) >= 1200  # every LB IP walked
    assert two["doc"] == one["doc"]
    # the split really happened: this process walked only the first half itself
    assert two["threads"] == 1 and two["parent_walked"] == 600
    # by default only an iptables-mode node is split (IPVS mode: it did not pay)
    default = _run(d, 2)
    assert default["doc"] == one["doc"]
    assert default["parent_walked"] == (600 if "iptables" in d.name else 1200)


def test_a_killed_child_costs_time_not_findings(big: Path) -> None:
    """The child is SIGKILLed in its first walk (a real signal, a real process): the
    parent walks the tail itself and the verdict is the single-process one."""
    d = big
    got = _run(d, 2, "kill-child")
    assert got["doc"] == _run(d, 1)["doc"] and got["parent_walked"] == 1200


def test_a_hung_child_is_killed_and_its_half_walked_here(big: Path
                                                        ) -> None:
    d = big
    got = _run(d, 2, "hang-child")  # its wait cut to at least 1 s
    assert got["doc"] == _run(d, 1)["doc"] and got["parent_walked"] == 1200
    assert got["seconds"] < 60  # not the child's hour


def test_a_rule_failing_in_the_childs_half_is_reported_as_one_process_would(
        big: Path) -> None:
    d = big
    one, two = _run(d, 1, "fail-last"), _run(d, 2, "fail-last")
    assert two["doc"] == one["doc"] and two["parent_walked"] == 600
    doc = json.loads(two["doc"])
    assert any(f["id"] == "diagnosis-incomplete" and "failed" in f["evidence"][0]
               for f in doc["findings"])
    assert not any(f["id"].startswith("pod-to-lb") for f in doc["findings"])


def test_small_nodes_and_threads_stay_in_one_process(big: Path) -> None:
    d = big
    got = _run(d, 2, "usable")
    # a fork copies one thread only: with another running, one process
    assert got == {"small": 1, "one": 1, "big": 2, "threaded": 1}
    assert parallel.usable_jobs(2, parallel.MIN_TARGETS - 1) == 1  # here too


def test_check_cli_jobs(big: Path) -> None:
    """`check --from --json --jobs 1|2`: the same document but for the time stamp; a
    bad --jobs is a usage error naming the value."""
    d = big
    docs = []
    for jobs in ("1", "2"):
        p = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(d), "--json",
                            "--all", "--jobs", jobs], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, check=False)
        assert p.returncode in (0, 1, 2, 3), p.stderr
        doc = json.loads(p.stdout)
        doc.pop("time")
        docs.append(doc)
    assert docs[0] == docs[1]
    p = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(d), "--jobs",
                        "3"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == EXIT_USAGE and "--jobs" in p.stderr and "3" in p.stderr


def test_jobs_is_one_unless_asked_and_the_cpus_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli import _jobs_for, build_parser

    parse = build_parser().parse_args
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert _jobs_for(parse(["check", "--from", "x"])) == 1  # opt-in
    assert _jobs_for(parse(["check", "--from", "x", "--npd"])) == 1
    assert _jobs_for(parse(["check", "--from", "x", "--jobs", "2"])) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})  # a one-CPU cpuset
    assert _jobs_for(parse(["check", "--from", "x", "--jobs", "2"])) == 1
