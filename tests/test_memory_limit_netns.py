"""The agent in a memory-limited container, for real: a memory cgroup made here (lab.cgroup)
with a limit, around a live `check` in a namespace made here, whose nftables ruleset nft
cannot list within that limit. On a node that is a kube-proxy nftables table of 10k
Services (nft's own peak: 370 MB for the text listing, 834 MB for `nft -j`) in the
DaemonSet's container. Here: CONSTRUCTED, a `table ip kube-proxy` holding one set of
300,000 addresses, which nft takes ~200 MB to list and the kernel loads in 2 s.

What must hold: the kernel kills nft, not the agent (run_command makes every child the
first victim); the verdict says it was the out-of-memory killer and what the container
may use; the daemon does not run the same listing into the same kill every cycle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.probes import memory_limit
from agent.probes.base import (
    CommandKilled,
    ProbeResult,
    ReadCache,
    run_command,
)
from agent.snapshot import Unknown
from agent.verdict_doc import expand_targets
from lab import cgroup
from lab.netns import Netns, netns

ROOT = Path(__file__).resolve().parent.parent
needs_cgroup = pytest.mark.skipif(cgroup.why_not() is not None,
                                  reason=f"no memory cgroup: {cgroup.why_not()}")
pytestmark = [pytest.mark.netns, needs_cgroup]


def _big_set(n: int = 300_000) -> str:
    lines = ["add table ip kube-proxy", "add set ip kube-proxy big { type ipv4_addr ; }"]
    for i in range(0, n, 10_000):
        lines.append("add element ip kube-proxy big { " + ", ".join(
            f"10.{j >> 16 & 255}.{j >> 8 & 255}.{j & 255}" for j in range(i, i + 10_000))
            + " }")
    return "\n".join(lines) + "\n"


def _in(cg: cgroup.MemoryCgroup, *cmd: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cg.prefix(), *cmd], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize(("proc_cgroup", "want"), [
    # cgroup v1 (this machine): the memory hierarchy's path, then its mount's root
    ("4:memory:/kubepods/pod1/c1\n0::/\n",
     [("memory/kubepods/pod1/c1", False), ("memory", False), ("", True), ("", True)]),
    # cgroup v2, the container's own cgroup namespace: "/" is its cgroup
    ("0::/\n", [("", True), ("", True)]),
    # cgroup v2 without one: the host's path, else the mount's root (the runtime mounts
    # the container's cgroup there)
    ("0::/kubepods.slice/cri-c1.scope\n",
     [("kubepods.slice/cri-c1.scope", True), ("", True)]),
    # v1 with memory mounted beside another controller: looked for under "memory" (the
    # link systemd makes to a joint mount); where there is none, no number is invented
    ("3:cpu,memory:/c1\n", [("memory/c1", False), ("memory", False)]),
])
def test_where_the_agent_looks_for_its_memory_cgroup(
        proc_cgroup: str, want: list[tuple[str, bool]]) -> None:
    """/proc/self/cgroup as the kernel writes it in the layouts a node may have
    (constructed: one line per hierarchy, "ID:CONTROLLERS:PATH")."""
    got = [("" if d == memory_limit.ROOT else str(d.relative_to(memory_limit.ROOT)), v2)
           for d, v2 in memory_limit.own_dirs(proc_cgroup)]
    assert got == want


def test_the_agent_reads_its_own_cgroups_limit_and_kill_count() -> None:
    with cgroup.memory_cgroup() as cg:
        cg.set_limit(300 << 20)
        r = _in(cg, sys.executable, "-c",
                "from agent.probes import memory_limit as m; "
                "print(m.limit_bytes(), m.oom_kills())", env={**os.environ,
                                                              "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(300 << 20), "0"]
    # and here, in a cgroup without a limit of its own (or in none): no number invented
    outside = memory_limit.limit_bytes()
    assert outside is None or outside > 300 << 20


_CHECK = (sys.executable, "-m", "agent", "check", "--json", "--no-kube-api",
          "--node-name", "n1")


def _check_past_the_limit(ns: Netns, load: Callable[[], object], listing: tuple[str, ...]
                          ) -> tuple[subprocess.CompletedProcess[str], int, int]:
    """The agent's live check in ``ns`` in a container (memory cgroup) that it fits in
    and ``listing`` of the state ``load`` makes does not: each peak measured first, in a
    cgroup of its own (the agent's before the state is loaded). (its run, the limit, the
    cgroup's OOM kills)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ns_cmd = ("ip", "netns", "exec", ns.name)
    with cgroup.memory_cgroup() as cg:
        r = _in(cg, *ns_cmd, *_CHECK, env=env)
        agent_peak = cg.peak()
    assert r.returncode in (0, 1, 2, 3), r.stderr[-2000:]
    load()
    with cgroup.memory_cgroup() as cg:
        assert _in(cg, *ns_cmd, *listing).returncode == 0
        listing_peak = cg.peak()
    assert listing_peak > agent_peak // 2, (listing_peak, agent_peak)
    limit = agent_peak + listing_peak // 2
    with cgroup.memory_cgroup() as cg:
        cg.set_limit(limit)
        # (`ip netns exec` mounts a sysfs of the namespace's: the cgroup hierarchy is
        # mounted again there, as the runtime mounts it in the agent's container)
        r = _in(cg, *ns_cmd, "sh", "-c", f'{cg.mount()} && exec "$@"', "sh", *_CHECK,
                env=env)
        kills = cg.oom_kills()
    assert r.returncode in (0, 1, 2, 3), (r.returncode, limit, r.stderr[-2000:])  # it lived
    return r, limit, kills


def test_a_listing_that_outgrows_the_container_is_killed_and_the_verdict_says_so() -> None:
    with netns("lboom") as ns:
        r, limit, kills = _check_past_the_limit(
            ns, lambda: ns.run("nft", "-f", "-", input=_big_set()), ("nft", "list", "ruleset"))
    assert kills == 1  # nft, the first victim
    v = json.loads(r.stdout)
    why = [u["reason"] for u in v["unknowns"] if u["source"] == "nft rules"]
    assert len(why) == 1, v["unknowns"]
    assert why[0].startswith("nft list ruleset was killed (SIGKILL) after "), why
    assert ("by the kernel's out-of-memory killer: this container may use "
            f"{memory_limit.mib(limit)} (its cgroup's memory limit)") in why[0], why
    assert "raise the agent's memory limit" in why[0]


def test_an_iptables_dump_killed_for_memory_is_read_chain_by_chain_instead() -> None:
    """iptables mode on the nft backend: `iptables-nft-save` of a 10k-service node peaked
    at 157 MB here, with the agent 195 MiB in its cgroup, past the DaemonSet's former
    192Mi limit. Here 4,000 Services (the lab's kube-proxy state, restored into a
    namespace made here) and a limit the agent fits in and the dump does not: the dump
    is killed, and kube-proxy's chains are read one at a time instead, as after a dump
    that overran its time budget; the verdict says both."""
    from lab import kube_proxy_rules as kpr

    state = kpr.synthetic(4000, "iptables")["iptables-save.txt"]
    with netns("lboomi") as ns:
        r, limit, kills = _check_past_the_limit(
            ns, lambda: ns.run("iptables-nft-restore", input=state), ("iptables-nft-save",))
    assert kills >= 1
    v = json.loads(r.stdout)
    why = [u["reason"] for u in v["unknowns"] if u["source"] == "nat rules"]
    assert len(why) == 1, v["unknowns"]
    assert why[0].startswith("iptables-nft-save was killed (SIGKILL) after "), why
    assert f"this container may use {memory_limit.mib(limit)}" in why[0], why
    assert "read instead, one chain at a time: nat PREROUTING" in why[0], why
    assert v["kube_proxy_mode"] == "iptables", v["kube_proxy_mode"]
    lb_ips = {f["lb_ip"] for f in v["findings"] if f["id"].startswith("pod-to-lb-")} | {
        ip for g in v["ok"] if g["id"].startswith("pod-to-lb-")
        for ip, _ in expand_targets(g["targets"])}  # (the summary counts the fine ones)
    assert len(lb_ips) == 4000, len(lb_ips)


def test_every_child_is_the_first_victim_and_the_agent_is_not() -> None:
    """What makes the kernel pick the listing, whatever the sizes at the time of the kill:
    the child's own oom_score_adj, read by itself."""
    assert run_command(["cat", "/proc/self/oom_score_adj"], 10).strip() == "1000"
    assert Path("/proc/self/oom_score_adj").read_text().strip() != "1000"


def test_a_read_only_proc_does_not_stop_the_commands() -> None:
    """Where the score cannot be written (/proc mounted read-only, in a mount and PID
    namespace of this test's), the command still runs, with the score it had."""
    from agent.probes.base import first_victim

    inner = ["sh", "-c", 'mount -t proc -o ro proc /proc && exec "$@"', "sh",
             *first_victim(["cat", "/proc/self/oom_score_adj"])]
    r = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--propagation", "private",
                        *inner], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_without_a_shell_the_commands_run_as_they_are(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An image without `sh` (a PATH that holds only the command): the command runs."""
    (tmp_path / "cat").symlink_to(subprocess.run(
        ["sh", "-c", "command -v cat"], capture_output=True, text=True).stdout.strip())
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run_command(["cat", "/proc/self/oom_score_adj"], 10).strip() == \
        Path("/proc/self/oom_score_adj").read_text().strip()


def test_a_child_killed_by_another_signal_is_named() -> None:
    """A real process dying of SIGTERM (sent by itself): the message names the signal and
    claims no memory cause."""
    with pytest.raises(CommandKilled) as e:
        run_command(["sh", "-c", "kill -TERM $$"], 10)
    assert str(e.value).startswith("sh -c kill -TERM $$ was killed (SIGTERM) after "), e.value
    assert "memory" not in str(e.value)
    assert not e.value.oom  # (so a daemon tries it again next cycle: not "repeats")


def test_the_daemon_keeps_a_kill_while_the_rules_are_unchanged() -> None:
    """A kill repeats for the same ruleset: the daemon's cache keeps it, like a partial
    read, ``retry_after`` cycles; a changed marker reads again at once. An ordinary
    failure (value None, not ``repeats``) is read again every cycle, as before."""
    cache = ReadCache(retry_after=3)
    calls = []

    def killed() -> ProbeResult:
        calls.append("k")
        return ProbeResult(None, (Unknown("nft rules", "nft list ruleset was killed"),),
                           repeats=True)

    for _ in range(5):
        r = cache.read("nft rules", lambda: "gen 7", killed)
        assert r.value is None and r.unknowns
    assert calls == ["k", "k"]  # read, kept 3 cycles, read again
    cache.read("nft rules", lambda: "gen 8", killed)
    assert calls == ["k", "k", "k"]

    plain = []

    def failed() -> ProbeResult:
        plain.append("f")
        return ProbeResult(None, (Unknown("x", "exited 1"),))

    for _ in range(3):
        cache.read("x", lambda: "gen 7", failed)
    assert plain == ["f", "f", "f"]
