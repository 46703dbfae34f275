"""A daemon that captures every cycle diagnoses every cycle; on an unchanged node it
reuses what the rules that do not read the capture found (Prepared.memo) and runs only
the capture's. Before, it walked every LB IP again each cycle: 12 % of a core on an
unchanged 10k-service node (tests/bench/daemon_cost.py --capture).

What must hold: the verdict is the one a fresh diagnosis gives, byte for byte, whatever
the capture; no rule walks again; a diagnosis where a rule failed leaves nothing to reuse.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from agent.bundle import load_bundle
from agent.diagnose import diagnose, prepare
from agent.netfilter.walk import TableWalker
from agent.snapshot import NodeSnapshot
from tests.test_capture_findings import POD, RANGE, VIP, captured

DATA = Path(__file__).parent / "data"
TKE = DATA / "bundles" / "tke-etp-local"  # a real TKE node's state (its SOURCE says where)
DUAL = DATA / "constructed" / "ipvs6-dual-stack-kube-6-sets"  # IPv4 and IPv6 walks
NOW = dt.datetime(2026, 11, 27, 3, 0, tzinfo=dt.UTC)


def _walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = TableWalker.walk

    def counted(self: TableWalker, chain: str, pkt: object) -> object:
        calls.append(chain)
        return real(self, chain, pkt)  # type: ignore[arg-type]

    monkeypatch.setattr(TableWalker, "walk", counted)
    return calls


def _json(v: object) -> str:
    return json.dumps(v.to_dict("all"), sort_keys=True)  # type: ignore[attr-defined]


@pytest.mark.parametrize("bundle", [TKE, DUAL], ids=["tke", "dual-stack"])
def test_the_same_snapshot_again_reuses_the_walks_and_gives_the_same_verdict(
        bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap: NodeSnapshot = load_bundle(bundle)
    walks = _walks(monkeypatch)
    prepared = prepare(snap)
    quiet = captured([])
    burst = captured([(VIP, p) for p in RANGE[:50]] + [(POD, 30080)])
    first = diagnose(snap, "n", NOW, capture=quiet, prepared=prepared)
    assert walks, "nothing walked: the test would prove nothing"
    assert prepared.memo
    walks.clear()
    for cap in (burst, quiet, None):
        again = diagnose(snap, "n", NOW, capture=cap, prepared=prepared)
        assert walks == [], f"walked again: {walks[:5]}"
        fresh = diagnose(snap, "n", NOW, capture=cap)  # its own Prepared: walks
        assert walks, "the fresh diagnosis did not walk"
        walks.clear()
        assert _json(again) == _json(fresh)
    assert _json(diagnose(snap, "n", NOW, capture=quiet, prepared=prepared)) == _json(first)
    # the capture's findings are the capture's of this cycle, not the first one's
    v = diagnose(snap, "n", NOW, capture=burst, prepared=prepared).to_dict("all")
    assert {f["id"] for f in v["findings"]} - {f["id"] for f in first.to_dict("all")["findings"]}


def test_a_rule_that_failed_leaves_nothing_to_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.diagnose import rules

    snap = load_bundle(TKE)
    prepared = prepare(snap)

    def broken(ctx: object) -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(rules, "RULES", (broken, *rules.RULES))
    v = diagnose(snap, "n", NOW, capture=captured([]), prepared=prepared).to_dict("all")
    assert "diagnosis-incomplete" in {f["id"] for f in v["findings"]}
    assert prepared.memo == {}
    # a failing capture rule does not stop the others' from being kept
    monkeypatch.setattr(rules, "RULES", rules.RULES[1:])
    monkeypatch.setattr(rules, "CAPTURE_RULES", frozenset({broken, *rules.CAPTURE_RULES}))
    monkeypatch.setattr(rules, "RULES", (*rules.RULES, broken))
    diagnose(snap, "n", NOW, capture=captured([]), prepared=prepared)
    assert prepared.memo


def test_the_daemon_gives_a_cycles_freed_heap_back() -> None:
    """After a cycle the daemon calls glibc's malloc_trim: what a diagnosis freed leaves
    the process (RSS) instead of waiting for the next cycle. Here, in a child process of
    its own: a diagnosis-like heap (many 1-4 KiB strings, one in a hundred kept), freed."""
    import subprocess
    import sys

    code = (
        "from agent import daemon\n"
        "rss = lambda: int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])\n"
        "a = [('x' * (1024 + i % 3072)) for i in range(100_000)]\n"
        "kept = a[::100]\n"
        "del a\n"
        "before = rss()\n"
        "daemon.release_free_heap()\n"
        "print(daemon._TRIM is not None, before, rss())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent).stdout.split()
    found, before, after = out[0] == "True", int(out[1]), int(out[2])
    assert found, "no malloc_trim in this libc"
    assert before - after > 50_000, (before, after)  # KiB: most of the ~250 MB freed
