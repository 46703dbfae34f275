"""`check --jobs 2`: a forked child walks half of a big node's LB IPs; the verdict must be
the one a single process gives, byte for byte, also when the child dies or a rule fails
in its half (agent/diagnose/parallel.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from agent.bundle import load_bundle
from agent.cli import EXIT_USAGE
from agent.diagnose import diagnose, parallel
from agent.diagnose.rules import pod_to_lb
from agent.snapshot import NodeSnapshot
from lab.kube_proxy_rules import synthetic

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
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
def big(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[Path, NodeSnapshot]]:
    d = _bundle(tmp_path_factory.mktemp("par"), 1200, *request.param)
    yield d, load_bundle(str(d))


def _doc(snap: NodeSnapshot, jobs: int) -> str:
    return json.dumps(diagnose(snap, "node-a", now=NOW, jobs=jobs).to_dict())


def test_two_processes_give_the_single_process_verdict(big: tuple[Path, NodeSnapshot]
                                                       ) -> None:
    _, snap = big
    one = _doc(snap, 1)
    assert len(json.loads(one)["findings"]) >= 1200  # every LB IP walked
    assert _doc(snap, 2) == one


def test_the_child_really_walks_the_second_half(big: tuple[Path, NodeSnapshot],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The findings of the tail come from another process (the split is not a no-op)."""
    _, snap = big
    parent = os.getpid()
    real = pod_to_lb.check
    walked_by: dict[str, int] = {}

    def check(ctx):  # type: ignore[no-untyped-def]
        out = real(ctx)
        for f in out:  # (a finding carries its pid only through this test's map)
            walked_by.setdefault(f.lb_ip or "", os.getpid())
        return out

    _patch_rules(monkeypatch, real, check)
    seen = diagnose(snap, "node-a", now=NOW, jobs=2)
    # the child's map is its own: the parent only saw its half being walked
    lb_ips = [r.ip for r in seen.lb_ips]
    assert set(walked_by.values()) == {parent}
    assert 0 < len(walked_by) < len(lb_ips)
    assert {f.lb_ip for f in seen.findings if f.id.startswith("pod-to-lb")} >= set(lb_ips)


def _patch_rules(monkeypatch: pytest.MonkeyPatch, real, new) -> None:  # type: ignore[no-untyped-def]
    import agent.diagnose as d
    import agent.diagnose.rules as rules

    monkeypatch.setattr(rules, "RULES", tuple(new if r is real else r for r in rules.RULES))
    monkeypatch.setattr(d, "FAMILY_RULES",
                        tuple(new if r is real else r for r in d.FAMILY_RULES))


def test_a_killed_child_costs_time_not_findings(big: tuple[Path, NodeSnapshot],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The child is SIGKILLed mid-walk (a real signal, a real process): the parent walks
    the tail itself and the verdict is the single-process one."""
    _, snap = big
    one = _doc(snap, 1)
    parent = os.getpid()
    real = pod_to_lb.check

    def check(ctx):  # type: ignore[no-untyped-def]
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(ctx)

    _patch_rules(monkeypatch, real, check)
    assert _doc(snap, 2) == one


def test_a_rule_failing_in_the_childs_half_is_reported_as_one_process_would(
        big: tuple[Path, NodeSnapshot], monkeypatch: pytest.MonkeyPatch) -> None:
    _, snap = big
    real = pod_to_lb.check
    tail_ip = diagnose(snap, "n", now=NOW).lb_ips[-1].ip  # in the child's half

    def check(ctx):  # type: ignore[no-untyped-def]
        # as a bug would: the targets before it walked (their unknowns recorded), then
        # an exception out of the rule
        at = next((i for i, t in enumerate(ctx.targets) if t.ip == tail_ip), None)
        if at is None:
            return real(ctx)
        real(replace(ctx, targets=ctx.targets[:at]))
        raise RuntimeError(f"walking {tail_ip} failed")

    _patch_rules(monkeypatch, real, check)
    one, two = _doc(snap, 1), _doc(snap, 2)
    assert two == one
    doc = json.loads(two)
    assert any(f["id"] == "diagnosis-incomplete" and tail_ip in f["evidence"][0]
               for f in doc["findings"])
    assert not any(f["id"].startswith("pod-to-lb") for f in doc["findings"])


def test_small_nodes_and_threads_stay_in_one_process() -> None:
    assert parallel.usable_jobs(2, parallel.MIN_TARGETS - 1) == 1
    assert parallel.usable_jobs(1, 10_000) == 1
    assert parallel.usable_jobs(2, 10_000) == 2
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert parallel.usable_jobs(2, 10_000) == 1  # a fork would copy one thread only
    finally:
        stop.set()
        t.join()


def test_check_cli_jobs(big: tuple[Path, NodeSnapshot]) -> None:
    """`check --from --json --jobs 1|2`: the same document but for the time stamp; a
    bad --jobs is a usage error naming the value."""
    d, _ = big
    docs = []
    for jobs in ("1", "2"):
        p = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(d), "--json",
                            "--jobs", jobs], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, check=False)
        assert p.returncode in (0, 1, 2), p.stderr
        doc = json.loads(p.stdout)
        doc.pop("time")
        docs.append(doc)
    assert docs[0] == docs[1]
    p = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(d), "--jobs",
                        "3"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == EXIT_USAGE and "--jobs" in p.stderr and "3" in p.stderr


def test_jobs_default_is_one_for_npd_and_the_cpus_for_a_person(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    from agent.cli import _jobs_for, build_parser

    parse = build_parser().parse_args
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert _jobs_for(parse(["check", "--from", "x"])) == 2
    assert _jobs_for(parse(["check", "--from", "x", "--npd"])) == 1  # background work
    assert _jobs_for(parse(["check", "--from", "x", "--npd", "--jobs", "2"])) == 2
    assert _jobs_for(parse(["check", "--from", "x", "--jobs", "1"])) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})  # a one-CPU cpuset
    assert _jobs_for(parse(["check", "--from", "x"])) == 1
