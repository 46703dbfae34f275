"""The daemon's read cache and the nat dump's budget, without a namespace (the netns tests
in test_live_read_netns.py run them against real rules and ipsets)."""

from __future__ import annotations

import os

import pytest

from agent.probes import markers, nat_rules
from agent.probes.base import ProbeContext, ProbeResult, ReadCache, cached
from agent.snapshot import Unknown


class Source:
    """A marker and a reader whose answers the test sets."""

    def __init__(self) -> None:
        self.mark: object = 1
        self.value: object = "v1"
        self.unknowns: tuple[Unknown, ...] = ()
        self.reads = 0

    def marker(self) -> object:
        if isinstance(self.mark, Exception):
            raise self.mark
        return self.mark

    def collect(self) -> ProbeResult:
        self.reads += 1
        return ProbeResult(self.value, self.unknowns)


def test_an_unchanged_marker_reuses_the_last_read() -> None:
    cache, src = ReadCache(), Source()
    ctx = ProbeContext(cache=cache)
    first = cached(ctx, "s", src.marker, src.collect)
    assert cached(ctx, "s", src.marker, src.collect) is first
    assert (src.reads, cache.read_count["s"], cache.reused["s"]) == (1, 1, 1)
    src.mark, src.value = 2, "v2"
    assert cached(ctx, "s", src.marker, src.collect).value == "v2"
    assert src.reads == 2


def test_without_a_cache_every_call_reads() -> None:
    src = Source()
    for _ in range(3):
        cached(ProbeContext(), "s", src.marker, src.collect)
    assert src.reads == 3


def test_failures_are_not_kept_and_a_broken_marker_means_read() -> None:
    cache, src = ReadCache(), Source()
    src.value = None  # the source could not be read: try again next time
    cache.read("s", src.marker, src.collect)
    cache.read("s", src.marker, src.collect)
    assert src.reads == 2
    src.value = "v"
    src.mark = OSError("netlink: EPERM")
    cache.read("s", src.marker, src.collect)
    cache.read("s", src.marker, src.collect)
    assert src.reads == 4 and "s" not in cache.reused


def test_a_result_with_unknowns_is_reused_a_bounded_number_of_times() -> None:
    # e.g. a dump that overran its budget: reusing it saves its cost, but a node that was
    # only busy gets another try after retry_after cycles
    cache, src = ReadCache(retry_after=2), Source()
    src.unknowns = (Unknown("nat rules", "stopped after 106 s"),)
    for _ in range(7):
        cache.read("s", src.marker, src.collect)
    assert src.reads == 3  # read, reused twice, read, reused twice, read


def test_the_old_read_is_freed_before_the_new_one_is_made() -> None:
    """A changed marker: the last read (a 10k-service node's listing is tens of MB) is
    not held while the next one is read."""
    import gc
    import weakref

    class Listing:  # (a value a weak reference can follow)
        pass

    cache, seen = ReadCache(), []
    old = weakref.ref(cache.read("rules", lambda: 1, lambda: ProbeResult(Listing())).value)

    def read_again() -> ProbeResult:
        gc.collect()
        seen.append(old() is None)
        return ProbeResult(Listing())

    cache.read("rules", lambda: 2, read_again)
    assert seen == [True]


def test_budget_scales_with_the_nft_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(markers, "nft_table_uses",
                        lambda family=2: {"nat": 47_412, "filter": 10})
    b = nat_rules.read_budget("nft")
    # 1e-8 x 47422^2 + 2e-4 x 47422 = 31.97 s expected, x3 + 10
    assert b.seconds == pytest.approx(10 + 3 * (1e-8 * 47_422 ** 2 + 2e-4 * 47_422))
    assert b.sized_on == "47,422 chains and sets in the nft ip tables"
    monkeypatch.setattr(markers, "nft_table_uses", lambda family=2: {"nat": 10})
    assert nat_rules.read_budget("nft").seconds == pytest.approx(10 + 3 * 2e-3, abs=1e-3)
    monkeypatch.setattr(markers, "nft_table_uses", lambda family=2: {"nat": 10_000_000})
    assert nat_rules.read_budget("nft").seconds == nat_rules.BUDGET_CEILING


def test_budget_scales_with_the_legacy_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(markers, "legacy_table_names", lambda family=4: ("filter", "nat"))
    monkeypatch.setattr(markers, "legacy_info", lambda t, family=4: markers.LegacyInfo(
        t, {"nat": 239_571, "filter": 10_099}[t], 0))
    b = nat_rules.read_budget("legacy", floor=5.0)
    assert b.seconds == pytest.approx(5 + 3 * 5e-6 * 249_670)
    assert b.sized_on == "249,670 rules in the legacy tables"


def test_budget_without_counts_is_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(family: int = 2) -> dict[str, int]:
        raise markers.MarkerError("EPERM")
    monkeypatch.setattr(markers, "nft_table_uses", fail)
    assert nat_rules.read_budget("nft", floor=12) == nat_rules.Budget(
        12, "the default (the tables' sizes could not be read)")


def test_overrun_says_which_dump_how_long_and_sized_on_what() -> None:
    o = nat_rules.Overrun("nft", "iptables-nft-save", nat_rules.Budget(
        105.9, "47,422 chains and sets in the nft ip tables"), background=True)
    assert str(o) == ("iptables-nft-save (nft backend) was stopped after 106 s, its time "
                      "budget for 47,422 chains and sets in the nft ip tables (at the lowest "
                      "CPU priority: a busy node slows it)")
    o = nat_rules.Overrun("legacy", "iptables-legacy-save", nat_rules.Budget(12.5, "x"))
    assert str(o) == ("iptables-legacy-save (legacy backend) was stopped after 12.5 s, its "
                      "time budget for x")


def test_ipvs_digest_ignores_connection_counts(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    proc = tmp_path / "ip_vs"
    head = ("IP Virtual Server version 1.2.1 (size=4096)\n"
            "Prot LocalAddress:Port Scheduler Flags\n"
            "  -> RemoteAddress:Port Forward Weight ActiveConn InActConn\n"
            "TCP  0A002001:0050 rr\n")
    monkeypatch.setattr(markers, "PROC_IP_VS", proc)
    proc.write_text(head + "  -> AC100102:1F90      Masq    1      0          0         \n")
    a = markers.ipvs_digest()
    proc.write_text(head + "  -> AC100102:1F90      Masq    1      7          31        \n")
    assert markers.ipvs_digest() == a  # traffic
    proc.write_text(head + "  -> AC100102:1F90      Masq    0      7          31        \n")
    assert markers.ipvs_digest() != a  # weight 0: a real change
    proc.write_text(head + "  -> AC100103:1F90      Masq    1      0          0         \n")
    assert markers.ipvs_digest() != a  # another endpoint
    proc.unlink()
    assert markers.ipvs_digest() is None  # ip_vs not loaded


def test_a_background_read_runs_at_the_lowest_priorities() -> None:
    import shutil

    from agent.probes.base import run_command
    if not (shutil.which("nice") and shutil.which("ionice")):
        pytest.skip("needs nice (coreutils) and ionice (util-linux)")
    script = "cut -d' ' -f19 /proc/$$/stat; ionice -p $$"
    assert run_command(["sh", "-c", script], 10, background=True).split("\n")[:2] == [
        "19", "best-effort: prio 7"]
    own = run_command(["sh", "-c", script], 10).split("\n")[0]
    assert own == str(os.getpriority(os.PRIO_PROCESS, 0))  # a `check`: as it is


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU."""
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Node:
    """Cycles over a ReadCache with a share, a clock the test moves and reads that cost
    real CPU."""

    def __init__(self, share: float | None = 0.1, *sources: str) -> None:
        self.now = 1000.0
        self.cache = ReadCache(cpu_share=share, clock=lambda: self.now)
        self.src = {name: Source() for name in sources or ("s",)}

    def cycle(self, cost: float = 0.02) -> dict[str, ProbeResult]:
        self.cache.begin_cycle()

        def reader(src: Source):  # type: ignore[no-untyped-def]
            return lambda: (_burn(cost), src.collect())[1]

        return {name: self.cache.read(name, src.marker, reader(src))
                for name, src in self.src.items()}


def test_a_changed_source_is_read_again_within_its_share_of_a_cpu() -> None:
    """A cycle's reads' CPU, their commands' included, and the diagnosis charged to it,
    space the next reads of changed sources: until they are due the last read stands,
    said to be out of date in the same words every time (the daemon does not diagnose
    an unchanged snapshot again)."""
    import subprocess
    import sys

    node = Node(0.1)
    cache, src = node.cache, node.src["s"]

    def costly() -> ProbeResult:  # a command that works 0.2 s, then a parse of 0.05 s
        subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.2\n"
                        "while time.process_time() < end: pass"], check=True)
        _burn(0.05)
        return src.collect()

    cache.begin_cycle()
    assert cache.read("s", src.marker, costly).value == "v1"
    assert 0.25 <= cache.read_cpu["s"] < 2.0  # the child's CPU is counted
    cache.charge(1.0)  # the diagnosis of what was read
    cost = cache.read_cpu["s"] + 1.0
    src.mark, src.value = 2, "v2"
    node.now += 0.9 * cost / 0.1  # not due yet: 10 % of a CPU allows a read per cost/0.1 s
    put_off = []
    for _ in range(2):
        cache.begin_cycle()
        put_off.append(cache.read("s", src.marker, costly))
    assert src.reads == 1 and [p.value for p in put_off] == ["v1", "v1"]
    assert put_off[0].unknowns == put_off[1].unknowns
    why = put_off[0].unknowns[-1]
    assert why.source == "s" and "changed since it was read at" in why.reason
    assert f"reads and diagnosis took {cost:.3g} s of CPU" in why.reason
    assert "10 % of one CPU" in why.reason
    assert "s" in cache.stale and cache.deferred["s"] == 2
    cache.charge(0.5)  # the diagnosis of the first verdict put off: the due time moves...
    cache.begin_cycle()
    assert cache.read("s", src.marker, costly).unknowns == put_off[0].unknowns  # ...not the words
    node.now += 0.2 * cost / 0.1 + 0.5 / 0.1  # due: read
    cache.begin_cycle()
    assert cache.read("s", src.marker, costly).value == "v2"
    assert src.reads == 2 and not cache.stale


def test_a_cycle_reads_every_changed_source_or_none() -> None:
    """Sources that change together (the nat rules and ip6tables share the nftables
    generation) are one picture: a cycle that reads one reads the others that changed,
    and one that puts one off puts off all."""
    node = Node(0.1, "nat rules", "ip6tables")
    node.cycle()
    for src in node.src.values():
        src.mark = 2
    node.now += 0.01  # (reads of 0.02 s each: due 0.4 s after the first cycle began)
    got = node.cycle()
    assert all(r.unknowns for r in got.values()) and set(node.cache.stale) == set(got)
    node.now += 1.0
    got = node.cycle()
    assert not any(r.unknowns for r in got.values()) and not node.cache.stale
    assert [s.reads for s in node.src.values()] == [2, 2]


def test_a_source_that_keeps_failing_does_not_make_the_others_read() -> None:
    """IPVS not loaded (no read kept, retried each cycle) must neither open a new window
    nor count as this cycle's reads."""
    node = Node(0.01, "ipvs", "nat rules")
    node.src["ipvs"].value = None
    node.cycle()
    node.src["nat rules"].mark = 2
    node.now += 1.0  # (due 2 s on: 0.02 s reads at 1 %)
    got = node.cycle()
    assert node.src["ipvs"].reads == 2 and node.src["nat rules"].reads == 1
    assert got["nat rules"].unknowns and set(node.cache.stale) == {"nat rules"}


def test_a_put_off_source_that_changes_back_is_current_again() -> None:
    node = Node(0.01)
    node.cycle()
    node.src["s"].mark = 2  # (a rule added...)
    assert node.cycle()["s"].unknowns and "s" in node.cache.stale
    node.src["s"].mark = 1  # (...and deleted: the generation moves on in nftables, a digest not)
    assert node.cycle()["s"].unknowns == ()
    assert node.src["s"].reads == 1 and not node.cache.stale


def test_what_stands_for_a_changed_source() -> None:
    """A failed read is no picture of the node: the next one is not put off. A failure
    that repeats (an out-of-memory kill) is, and so is a read whose marker could not be
    taken; without a share (a one-off check) nothing is."""
    node = Node(0.0001)
    src = node.src["s"]
    src.value = None
    for mark in (1, 2, 3):
        src.mark = mark
        node.cycle()
    assert src.reads == 3 and not node.cache.stale
    src.value, src.mark = "v", OSError("netlink: EPERM")
    node.cycle()
    assert src.reads == 4
    got = node.cycle()["s"]  # still no marker: a change, put off
    assert src.reads == 4 and got.value == "v" and "s" in node.cache.stale
    assert got.unknowns[-1].reason.startswith("may have changed (its change marker could not")

    killed = Node(0.0001)
    src = killed.src["s"]
    src.value = None
    collect = src.collect
    src.collect = lambda: ProbeResult(collect().value, (Unknown("s", "killed"),),  # type: ignore[method-assign]
                                      repeats=True)
    killed.cycle()
    src.mark = 2
    assert killed.cycle()["s"].repeats and src.reads == 1 and "s" in killed.cache.stale

    plain = Node(None)
    for mark in (1, 2, 3):
        plain.src["s"].mark = mark
        plain.cycle()
    assert plain.src["s"].reads == 3 and not plain.cache.stale


def test_the_diagnosis_is_charged_to_the_cycle_that_read() -> None:
    node = Node(0.1, "a")
    node.cycle()
    node.cache.charge(3.0)  # the walk after reading "a": the next read 30 s after
    node.src["a"].mark = 2
    node.now += 29.0
    assert node.cycle()["a"].unknowns and node.src["a"].reads == 1
    node.now += 1.5
    assert not node.cycle()["a"].unknowns and node.src["a"].reads == 2


def test_a_cycle_that_crosses_the_due_time_still_puts_off_all_or_none() -> None:
    node = Node(0.1, "ipsets", "nat rules")
    node.cycle()
    for src in node.src.values():
        src.mark = 2
    ticks = iter([1000.1, 1000.9, 1001.0, 1002.0, 1003.0])  # due at 1000.4: crossed mid-cycle
    node.cache._clock = lambda: next(ticks)
    got = node.cycle()
    assert all(r.unknowns for r in got.values()), got
    assert set(node.cache.stale) == {"ipsets", "nat rules"}


def test_a_moved_marker_with_the_same_content_keeps_the_read_fresh() -> None:
    """The nft generation moves on every commit; where the content digest says the rules
    are those of the last read, that read stands as the node's, not put off and not out
    of date, and nothing is read. A changed content is read (within the share)."""
    node = Node(0.1)
    cache, src = node.cache, node.src["s"]
    content = ["rules-a"]
    taken = []

    def digest(_: object) -> object:
        taken.append(content[0])
        return content[0]

    def cycle() -> ProbeResult:
        cache.begin_cycle()
        return cache.read("s", src.marker, src.collect, digest)

    first = cycle()
    assert (src.reads, taken) == (1, ["rules-a"])  # the digest of the first read, taken too
    cache.charge(40.0)  # its diagnosis: changes are read from 400 s on
    src.mark = 2  # a commit of the same rules (kube-proxy's sync)
    node.now += 1.0  # long before a read of changes would be due
    again = cycle()
    assert again is first and not again.unknowns and not cache.stale
    assert (src.reads, cache.same_content["s"], cache.reused["s"]) == (1, 1, 1)
    assert cycle() is first and taken == ["rules-a", "rules-a"]  # the marker still: no digest
    src.mark, content[0], src.value = 3, "rules-b", "v2"  # a change, not due yet
    node.now += 1.0
    late = cycle()
    assert late.value == "v1" and "s" in cache.stale  # put off, as without a digest
    node.now += 3600
    assert cycle().value == "v2" and src.reads == 2
    src.mark = 4  # the same rules committed again after that read
    node.now += 3600
    assert cycle().value == "v2" and src.reads == 2 and cache.same_content["s"] == 2


def test_the_content_digest_is_taken_within_the_share_too(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A digest costs CPU (2 s at 155k nft rules): the next is not taken before that CPU
    fits the share; until then a moved marker is put off as before."""
    from agent.probes import base

    cpu = [0.0]
    monkeypatch.setattr(base, "_cpu_seconds", lambda: cpu[0])
    node = Node(0.1)
    cache, src = node.cache, node.src["s"]

    def digest(_: object) -> object:
        cpu[0] += 2.0
        return "same"

    cache.begin_cycle()
    cache.read("s", src.marker, src.collect, digest)
    cache.charge(40.0)  # the read's diagnosis: changes are read from 400 s on
    src.mark = 2
    node.now += 30.0  # 20 s after the first digest's were due
    cache.begin_cycle()
    assert not cache.read("s", src.marker, src.collect, digest).unknowns
    assert cache.same_content["s"] == 1
    src.mark = 3
    node.now += 10.0  # 2 s at 10 %: the next digest from 20 s on
    cache.begin_cycle()
    assert cache.read("s", src.marker, src.collect, digest).unknowns  # put off, out of date
    assert cache.same_content["s"] == 1 and src.reads == 1
    node.now += 10.0
    cache.begin_cycle()
    assert not cache.read("s", src.marker, src.collect, digest).unknowns
    assert cache.same_content["s"] == 2 and src.reads == 1


def test_a_change_during_the_read_is_not_kept_by_a_digest_from_before_it() -> None:
    """kube-proxy commits while iptables-nft-save runs, and undoes it later (a readiness
    flap): the read holds the change, the digest taken before it does not. Were that
    pair kept, the digest of the undone state would match it and the read would stand
    for good; the marker moved during the read, so the digest is not kept."""
    cache, src = ReadCache(), Source()
    content = ["A"]

    def collect() -> ProbeResult:
        src.mark, content[0], src.value = 2, "B", "B"  # committed during the read
        return src.collect()

    assert cache.read("s", src.marker, collect, lambda _: content[0]).value == "B"
    src.mark, content[0], src.value = 3, "A", "A"  # undone
    assert cache.read("s", src.marker, src.collect, lambda _: content[0]).value == "A"
    assert src.reads == 2 and not cache.same_content


def test_digests_count_in_the_share_and_stop_once_one_found_a_change(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A digest's CPU is charged to the last read, as a diagnosis is: the next read of a
    change waits for it too. One that found a change is the last until the read (more
    would only say so again, each costing its CPU)."""
    from agent.probes import base

    cpu = [0.0]
    monkeypatch.setattr(base, "_cpu_seconds", lambda: cpu[0])
    node = Node(0.1)
    cache, src = node.cache, node.src["s"]
    taken = []

    def digest(_: object) -> object:
        cpu[0] += 2.0
        taken.append(src.mark)
        return src.mark  # every commit a change

    cache.begin_cycle()
    cache.read("s", src.marker, src.collect, digest)
    cache.charge(10.0)  # its diagnosis: with its digest's 2 s, the next read from 120 s on
    for step, mark in ((30.0, 2), (30.0, 3), (50.0, 4)):
        node.now += step
        src.mark = mark
        cache.begin_cycle()
        assert cache.read("s", src.marker, src.collect, digest).unknowns  # put off
    assert taken == [1, 2] and src.reads == 1  # the first read's, then one that found it
    cache.begin_cycle()  # 110 s, then 130 s: not due, that digest's 2 s counted (140 s)
    node.now += 20.0
    assert cache.read("s", src.marker, src.collect, digest).unknowns
    node.now += 15.0
    cache.begin_cycle()
    assert not cache.read("s", src.marker, src.collect, digest).unknowns
    assert src.reads == 2 and taken == [1, 2, 4]  # (a digest before the read, as the marker)
