"""Change detection on real rules and ipsets (issue 14 item 2): a process in a throwaway
namespace keeps one ReadCache, as the daemon does, and reads after each step. A rule or
ipset change is read again; reads, checks, counters and `ipset add -exist` of a member
already there are not. A dump that overruns its budget says so and falls back to an
excerpt, and none of it changes the node (the nft generation id, the legacy blobs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lab.netns import Netns, netns
from tests.daemon_output import log_line, spooled

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")]

PY = sys.executable

RULES = """\
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A OUTPUT -p udp -j ACCEPT
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-EXT-ABC - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SERVICES -d 10.0.32.1/32 -p tcp -m comment --comment "ns/web:http loadbalancer IP" \
-m tcp --dport 80 -j KUBE-EXT-ABC
-A KUBE-EXT-ABC -j KUBE-MARK-MASQ
COMMIT
"""

# what kube-proxy's iptables-restore writes on a sync: its own chains, whole
KUBE_CHAINS = "*nat\n" + "".join(
    f"{line}\n" for line in RULES.split("*nat\n", 1)[1].splitlines()
    if line.startswith((":KUBE-", "-A KUBE-"))) + "COMMIT\n"

# one process, one ReadCache, like the daemon: each input line is one cycle
DRIVER = r"""
import json, sys
from agent.probes import ipsets, markers, nat_rules
from agent.probes.base import ProbeContext, ReadCache
if len(sys.argv) > 1:  # a budget no dump can meet
    nat_rules.BUDGET_FLOOR = float(sys.argv[1])
    nat_rules.NFT_SECONDS_PER_CHAIN = nat_rules.NFT_SECONDS_PER_CHAIN_SQUARED = 0
    nat_rules.LEGACY_SECONDS_PER_RULE = 0
cache = ReadCache()
ctx = ProbeContext(use_kube_api=False, cache=cache, timeout=float(sys.argv[1])
                   if len(sys.argv) > 1 else 5.0)
for _ in sys.stdin:
    nat = nat_rules.collect(ctx)
    sets = ipsets.collect(ctx)
    t = nat.value.table("nat") if nat.value else None
    c = t.chain("KUBE-SERVICES") if t else None
    print(json.dumps({
        "reads": cache.read_count, "reused": cache.reused,
        "services": list(c.rules.texts) if c else None,
        "partial": nat.value.partial if nat.value else None,
        "backend": nat.value.backend if nat.value else None,
        "nat_unknowns": [u.reason for u in nat.unknowns],
        "sets": {s.name: list(s.members) for s in sets.value or ()},
        "gen": markers.nft_generation(),
    }), flush=True)
"""


class Cycles:
    def __init__(self, ns: Netns, *args: str) -> None:
        self.proc = ns.popen([PY, "-c", DRIVER, *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def cycle(self) -> dict:  # type: ignore[type-arg]
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else "driver died"
        return json.loads(line)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


# enough chains that no dump finishes within 1 ms (a tiny one may: the timeout is
# checked when the output is read)
MANY_CHAINS = "*nat\n" + "".join(f":X-{i} - [0:0]\n" for i in range(3000)) + "COMMIT\n"


@contextmanager
def node(backend: str, slow: bool = False) -> Iterator[tuple[Netns, Cycles]]:
    if not shutil.which(f"iptables-{backend}-restore") or not shutil.which("ipset"):
        pytest.skip(f"needs iptables-{backend} and ipset")
    with netns("lblr") as ns:
        ns.run("ip", "link", "set", "lo", "up")
        ns.run(f"iptables-{backend}-restore", input=RULES)
        if slow:
            ns.run(f"iptables-{backend}-restore", "--noflush", input=MANY_CHAINS)
        ns.run("ipset", "create", "KUBE-LOAD-BALANCER", "hash:ip,port")
        ns.run("ipset", "add", "KUBE-LOAD-BALANCER", "10.0.32.1,tcp:80")
        ns.run("ipset", "add", "KUBE-LOAD-BALANCER", "10.0.32.2,tcp:80")
        cycles = Cycles(ns)
        try:
            yield ns, cycles
        finally:
            cycles.close()


@pytest.mark.parametrize("backend", ["nft", "legacy"])
def test_changes_are_read_again_and_no_ops_are_not(backend: str) -> None:
    ipt = f"iptables-{backend}"
    with node(backend) as (ns, cycles):
        first = cycles.cycle()
        assert first["backend"] == backend
        assert first["reads"] == {"nat rules": 1, "ipsets": 1}
        assert first["sets"]["KUBE-LOAD-BALANCER"] == ["10.0.32.1,tcp:80", "10.0.32.2,tcp:80"]
        assert len(first["services"]) == 1

        # no-ops: reads, a rule check, traffic moving counters, a member added again
        ns.run(ipt, "-t", "nat", "-S")
        ns.run(f"{ipt}-save")
        ns.run(ipt, "-t", "nat", "-C", "KUBE-EXT-ABC", "-j", "KUBE-MARK-MASQ")
        ns.run(PY, "-c", "import socket; s = socket.socket(socket.AF_INET, "
               "socket.SOCK_DGRAM); [s.sendto(b'x', ('127.0.0.1', 9)) for _ in range(3)]")
        counted = ns.run(ipt, "-L", "OUTPUT", "-v", "-n", "-x").stdout
        assert counted.splitlines()[2].split()[0] == "3", counted  # counters moved
        ns.run("ipset", "list")
        ns.run("ipset", "test", "KUBE-LOAD-BALANCER", "10.0.32.1,tcp:80")
        ns.run("ipset", "add", "-exist", "KUBE-LOAD-BALANCER", "10.0.32.1,tcp:80")
        if shutil.which("nft"):
            ns.run("nft", "list", "ruleset")
        same = cycles.cycle()
        assert same["reads"] == first["reads"], "a no-op was taken for a change"
        assert same["reused"] == {"nat rules": 1, "ipsets": 1}
        assert same["gen"] == first["gen"]

        # commits that write what is there again: kube-proxy's sync, its chains flushed
        # and written as they were (new rule handles), and another tool's table (nft:
        # the generation moves, what iptables shows does not)
        ns.run(f"{ipt}-restore", "--noflush", input=KUBE_CHAINS)
        if backend == "nft" and shutil.which("nft"):
            ns.run("nft", "add", "table", "inet", "another-tool")
        rewritten = cycles.cycle()
        assert rewritten["reads"] == first["reads"], "the same rules written again were read"
        assert rewritten["services"] == first["services"]
        if backend == "nft":
            assert rewritten["gen"] != first["gen"]  # the content digest told them apart

        # a rule change: read again, the new rule is there; the ipsets are not re-read
        ns.run(ipt, "-t", "nat", "-A", "KUBE-SERVICES", "-d", "10.0.32.2/32", "-p", "tcp",
               "-m", "tcp", "--dport", "80", "-j", "KUBE-EXT-ABC")
        changed = cycles.cycle()
        assert changed["reads"] == {"nat rules": 2, "ipsets": 1}
        assert changed["services"][-1].startswith("-A KUBE-SERVICES -d 10.0.32.2/32")

        # the same number of rules, the same sizes, one address changed (a rescheduled
        # endpoint): legacy's entry count and blob size stay, the content does not
        if backend == "legacy":
            from_info = ns.run(PY, "-c", "from agent.probes.markers import legacy_info;"
                               "print(legacy_info('nat'))").stdout
        ns.run(ipt, "-t", "nat", "-R", "KUBE-SERVICES", "2", "-d", "10.0.32.3/32", "-p",
               "tcp", "-m", "tcp", "--dport", "80", "-j", "KUBE-EXT-ABC")
        if backend == "legacy":
            assert ns.run(PY, "-c", "from agent.probes.markers import legacy_info;"
                          "print(legacy_info('nat'))").stdout == from_info
        replaced = cycles.cycle()
        assert replaced["reads"] == {"nat rules": 3, "ipsets": 1}
        assert replaced["services"][-1].startswith("-A KUBE-SERVICES -d 10.0.32.3/32")

        # an ipset change that keeps the count: one member out, another in
        ns.run("ipset", "del", "KUBE-LOAD-BALANCER", "10.0.32.2,tcp:80")
        ns.run("ipset", "add", "KUBE-LOAD-BALANCER", "10.0.32.3,tcp:80")
        swapped = cycles.cycle()
        assert swapped["reads"] == {"nat rules": 3, "ipsets": 2}
        assert swapped["sets"]["KUBE-LOAD-BALANCER"] == ["10.0.32.1,tcp:80",
                                                         "10.0.32.3,tcp:80"]
        # and a new set
        ns.run("ipset", "create", "KUBE-LOAD-BALANCER-LOCAL", "hash:ip,port")
        assert set(cycles.cycle()["sets"]) == {"KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-LOCAL"}


def test_reading_changes_nothing_not_even_the_nft_generation() -> None:
    """The generation id moves on every nft commit: the agent's reads (the marker, the
    dump, the chain-by-chain excerpt) commit nothing."""
    with node("nft", slow=True) as (ns, cycles):
        before = ns.run("iptables-nft-save").stdout.split("\n", 1)[1]
        gen = cycles.cycle()["gen"]
        overrun = Cycles(ns, "0.001")
        try:
            overrun.cycle()
        finally:
            overrun.close()
        assert cycles.cycle()["gen"] == gen
        assert ns.run("cat", "/proc/net/ip_tables_names").stdout.strip() == ""
        after = ns.run("iptables-nft-save").stdout.split("\n", 1)[1]
        strip = [line for line in before.splitlines() if not line.startswith("#")]
        assert strip == [line for line in after.splitlines() if not line.startswith("#")]


# a counter expression's bytes (its name attribute, a data header, bytes and packets)
_COUNTER_LOOKALIKE = "|0c000100636f756e7465720041414141" + "0c000100{0}{0}{0}{0}{0}{0}{0}{0}" \
    "0c000200{1}{1}{1}{1}{1}{1}{1}{1}|"
DIGEST = ("from agent.probes import markers; "
          "print(markers.nft_generation(), markers.nft_rules_digest())")


def test_the_nft_content_digest_tells_changes_from_rewrites() -> None:
    """nft_rules_digest on real nf_tables state: the same after kube-proxy's rewrite of
    its chains, traffic (counters) and other families' or tools' tables; not the same
    after a changed address, a changed policy, a rule added, two rules in the other
    order, a match's data that looks like a counter's values, or a table of its family."""
    if not shutil.which("nft"):
        pytest.skip("needs nft")
    with node("nft") as (ns, _):
        def digest() -> tuple[int, str]:
            gen, d = ns.run(PY, "-c", DIGEST).stdout.split()
            return int(gen), d

        gen, first = digest()
        steps_same = [
            ("iptables-nft-restore", "--noflush"),  # kube-proxy's sync, as it was
            ("nft", "add", "table", "inet", "another-tool"),
            ("ip6tables-nft", "-t", "nat", "-A", "OUTPUT", "-j", "ACCEPT"),  # IPv6's
        ]
        for step in steps_same:
            ns.run(*step, input=KUBE_CHAINS if "restore" in step[0] else None)
            moved, now = digest()
            assert moved > gen and now == first, step
            gen = moved
        ns.run(PY, "-c", "import socket; s = socket.socket(socket.AF_INET, "
               "socket.SOCK_DGRAM); [s.sendto(b'x', ('127.0.0.1', 9)) for _ in range(3)]")
        assert ns.run("iptables-nft", "-L", "OUTPUT", "-v", "-n", "-x").stdout \
            .splitlines()[2].split()[0] == "3"  # the counters moved
        assert digest() == (gen, first)

        changes = [
            ("iptables-nft", "-t", "nat", "-R", "KUBE-SERVICES", "1", "-d", "10.0.32.9/32",
             "-p", "tcp", "-m", "tcp", "--dport", "80", "-j", "KUBE-EXT-ABC"),
            ("iptables-nft", "-P", "FORWARD", "DROP"),
            ("iptables-nft", "-t", "nat", "-I", "KUBE-EXT-ABC", "1", "-j", "RETURN"),
            # the same two rules in the other order
            ("iptables-nft", "-t", "nat", "-D", "KUBE-EXT-ABC", "1"),
            ("iptables-nft", "-t", "nat", "-A", "KUBE-EXT-ABC", "-j", "RETURN"),
            # a match whose data holds what a counter's values look like: what it
            # matches changes, not a count
            ("iptables-nft", "-A", "INPUT", "-m", "string", "--algo", "bm", "--hex-string",
             _COUNTER_LOOKALIKE.format("11", "22"), "-j", "ACCEPT"),
            ("iptables-nft", "-R", "INPUT", "1", "-m", "string", "--algo", "bm",
             "--hex-string", _COUNTER_LOOKALIKE.format("33", "44"), "-j", "ACCEPT"),
            ("nft", "add", "table", "ip", "another-tool"),
        ]
        seen = [first]
        for step in changes:
            ns.run(*step)
            now = digest()[1]
            if step[3] == "-D":  # the chain as it was: the digest of the -P step's state
                assert now == seen[2]
            else:
                assert now not in seen, step
            seen.append(now)
        ns.run("nft", "delete", "table", "ip", "another-tool")
        assert digest()[1] == seen[-2]  # the table gone again: as before it


def test_an_overrun_names_the_dump_and_falls_back_to_an_excerpt() -> None:
    with node("nft", slow=True) as (ns, _):
        overrun = Cycles(ns, "0.001")
        try:
            got = overrun.cycle()
        finally:
            overrun.close()
        (reason,) = got["nat_unknowns"]
        assert reason.startswith("iptables-nft-save (nft backend) was stopped after 0.001 s, "
                                 "its time budget for ")
        chains = int(reason.split("budget for ", 1)[1].split()[0].replace(",", ""))
        assert chains >= 3006  # the nat and filter chains
        assert "read instead, one chain at a time: nat PREROUTING, OUTPUT" in reason
        # the excerpt still shows the LB IP's rule, marked partial
        assert got["partial"] is True
        assert got["services"] == [
            '-A KUBE-SERVICES -d 10.0.32.1/32 -p tcp -m comment --comment '
            '"ns/web:http loadbalancer IP" -m tcp --dport 80 -j KUBE-EXT-ABC']


def test_legacy_overrun_says_so_without_an_excerpt() -> None:
    with node("legacy", slow=True) as (ns, _):
        overrun = Cycles(ns, "0.001")
        try:
            got = overrun.cycle()
        finally:
            overrun.close()
        assert got["services"] is None
        assert any(r.startswith("iptables-legacy-save (legacy backend) was stopped after "
                                "0.001 s, its time budget for ") and "rules in the legacy "
                   "tables" in r for r in got["nat_unknowns"]), got


def test_big_ipsets_are_read_whole() -> None:
    """A set of thousands of members comes over netlink in several messages, only the
    first with the set's type: every member must be read (at 10k IPVS services the
    probe once kept 1,005 of KUBE-CLUSTER-IP's 10,000)."""
    if not shutil.which("ipset"):
        pytest.skip("needs ipset")
    lines = ["create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 4096 maxelem 65536",
             "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535"]
    lines += [f"add KUBE-CLUSTER-IP 10.96.{i // 250}.{i % 250 + 1},tcp:80"
              for i in range(6000)]
    lines += [f"add KUBE-NODE-PORT-TCP {30000 + i}" for i in range(3000)]
    script = ("import json\nfrom agent.probes import ipsets\n"
              "print(json.dumps({s.name: list(s.members) for s in ipsets._via_netlink()}))")
    with netns("lbls") as ns:
        ns.run("ipset", "restore", input="\n".join(lines) + "\n")
        got = json.loads(ns.run(PY, "-c", script).stdout)
        from agent.probes.ipsets import parse_ipset_save
        saved = {s.name: list(s.members) for s in parse_ipset_save(ns.run("ipset", "save").stdout)}
    assert len(got["KUBE-CLUSTER-IP"]) == 6000 and len(got["KUBE-NODE-PORT-TCP"]) == 3000
    assert got == saved


@pytest.mark.parametrize("backend", ["nft", "legacy"])
def test_the_daemon_sees_a_change_made_between_its_cycles(backend: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """End to end: `run` reuses its reads while nothing changes, and the verdict after a
    new LoadBalancer rule names the new address."""
    with node(backend) as (ns, _):
        # every verdict spooled (no collector): the full ones, by the lines' keys
        # (every change read at once: what --reread-cpu puts off is the next test's)
        agent = ns.popen([PY, "-m", "agent", "run", "--no-capture", "--no-kube-api",
                          "--listen", "", "--interval", "1", "--spool", str(tmp_path),
                          "--heartbeat-every", "1", "--reread-cpu", "100"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert agent.stdout is not None

            def lb_ips() -> set[str]:
                line = agent.stdout.readline()  # type: ignore[union-attr]
                assert line, agent.stderr.read() if agent.stderr else "agent died"
                return {r["ip"] for r in spooled(log_line(line), tmp_path)["lb_ips"]}

            assert lb_ips() == {"10.0.32.1", "10.0.32.2"}  # the rule and the ipset
            assert lb_ips() == {"10.0.32.1", "10.0.32.2"}  # the rule and the ipset
            ns.run(f"iptables-{backend}", "-t", "nat", "-A", "KUBE-SERVICES", "-d",
                   "10.0.32.9/32", "-p", "tcp", "-m", "comment", "--comment",
                   "ns/new:http loadbalancer IP", "-m", "tcp", "--dport", "80", "-j",
                   "KUBE-EXT-ABC")
            seen = [lb_ips() for _ in range(2)]  # a cycle may have been under way
            assert seen[-1] == {"10.0.32.1", "10.0.32.2", "10.0.32.9"}, seen
        finally:
            agent.terminate()
            agent.wait(timeout=30)


_V6_MARKER = """
import json
from agent.probes import markers, nat_rules
from agent.probes.base import ProbeContext, ReadCache
cache = ReadCache()
ctx = ProbeContext(cache=cache)
reads = []
for _ in range(2):
    nat_rules.collect6(ctx)
    reads.append(cache.read_count.get(nat_rules.SOURCE6, 0))
info = markers.legacy_info("nat", 6)
print(json.dumps({"digest": {t: markers.legacy_digest(t, 6)
                             for t in markers.legacy_table_names(6)},
                  "entries": info.entries,
                  "reads": reads, "budget": nat_rules.read_budget("legacy", 5.0, 6).sized_on}))
"""


def test_legacy_ip6tables_have_a_change_marker_too() -> None:
    """The IPv6 legacy tables are digested as the IPv4 ones (IP6T_SO_GET_INFO/ENTRIES,
    struct ip6t_entry's own offsets): an unchanged dual-stack legacy node reads its
    ip6tables once, counters moving change nothing, a rewritten address does."""
    with netns("lbm6") as ns:
        ns.sh("ip link set lo up; ip -6 addr add fd00::1/128 dev lo nodad")
        ns.sh("ip6tables-legacy -t nat -N KUBE-SERVICES; "
              "ip6tables-legacy -t nat -A OUTPUT -j KUBE-SERVICES; "
              "ip6tables-legacy -t nat -A KUBE-SERVICES -d 2001:db8::7/128 -p tcp "
              "--dport 80 -j RETURN; ip6tables-legacy -A OUTPUT -j ACCEPT")

        def marker() -> dict:  # type: ignore[type-arg]
            return json.loads(ns.run(PY, "-c", _V6_MARKER).stdout)

        first = marker()
        assert first["reads"] == [1, 1]  # the second cycle reused the first read
        # 5 built-in chains' policies, KUBE-SERVICES' head and RETURN, 2 rules, the end
        assert first["entries"] == 9, first
        # sized on both tables' entries (nat 9, filter 3 policies + a rule + the end)
        assert first["budget"] == "14 rules in the legacy ip6tables tables", first
        # traffic moves the counters (filter OUTPUT's rule counts it), not the digest
        ns.run(PY, "-c", "import socket; s = socket.socket(socket.AF_INET6, "
               "socket.SOCK_DGRAM); [s.sendto(b'x', ('fd00::1', 9)) for _ in range(3)]")
        counted = ns.run("ip6tables-legacy", "-L", "OUTPUT", "-v", "-n", "-x").stdout
        # (the 3 datagrams and the ICMPv6 port unreachable answers)
        assert int(counted.splitlines()[2].split()[0]) >= 3, counted
        assert marker()["digest"] == first["digest"]
        # the same size, one address rewritten: another digest
        ns.run("ip6tables-legacy", "-t", "nat", "-R", "KUBE-SERVICES", "1", "-d",
               "2001:db8::8/128", "-p", "tcp", "--dport", "80", "-j", "RETURN")
        again = marker()
        assert again["entries"] == first["entries"]
        assert again["digest"]["nat"] != first["digest"]["nat"]
        assert again["digest"]["filter"] == first["digest"]["filter"]


def _services(*ips: str) -> str:
    """`kubectl get services -A -o json` of one LoadBalancer Service per address."""
    return json.dumps({"kind": "List", "apiVersion": "v1", "items": [
        {"metadata": {"name": f"web{i}", "namespace": "ns"},
         "spec": {"type": "LoadBalancer", "clusterIP": f"10.96.0.{10 + i}",
                  "ports": [{"port": 80, "protocol": "TCP", "nodePort": 30080 + i}]},
         "status": {"loadBalancer": {"ingress": [{"ip": ip}]}}}
        for i, ip in enumerate(ips)]})


def test_a_change_too_soon_after_a_costly_read_waits_with_the_services_of_that_read(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--reread-cpu: a read that would take more than the share of a CPU is put off.
    Until it is made, the verdict is the node as the last read saw it, Services too: a
    new Service's LB IP beside rules read before kube-proxy wrote it would look like a
    loop. The verdict says so; nothing is re-read meanwhile."""
    with node("nft") as (ns, _):
        kube = tmp_path / "kube"
        kube.mkdir()
        (kube / "services.json").write_text(_services("10.0.32.1"))
        spool = tmp_path / "spool"
        # 0.001 % of a CPU: the first read (some 10 ms of CPU) spaces the next by 1,000 s
        agent = ns.popen([PY, "-m", "agent", "run", "--no-capture", "--kube-json", str(kube),
                          "--listen", "", "--interval", "1", "--spool", str(spool),
                          "--heartbeat-every", "1", "--reread-cpu", "0.001"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert agent.stdout is not None

            def verdict() -> dict:  # type: ignore[type-arg]
                line = agent.stdout.readline()  # type: ignore[union-attr]
                assert line, agent.stderr.read() if agent.stderr else "agent died"
                return spooled(log_line(line), spool)  # type: ignore[no-any-return]

            def put_off(v: dict) -> list[str]:  # type: ignore[type-arg]
                return [u["reason"] for u in v["unknowns"]
                        if "changed since it was read at" in u["reason"]]

            first = verdict()
            assert {r["ip"] for r in first["lb_ips"]} == {"10.0.32.1", "10.0.32.2"}
            assert not put_off(first)
            # a new LoadBalancer Service (written whole: a rename), and kube-proxy's rule
            (tmp_path / "new.json").write_text(_services("10.0.32.1", "10.0.32.9"))
            (tmp_path / "new.json").rename(kube / "services.json")
            ns.run("iptables-nft", "-t", "nat", "-A", "KUBE-SERVICES", "-d", "10.0.32.9/32",
                   "-p", "tcp", "-m", "comment", "--comment", "ns/web1:http loadbalancer IP",
                   "-m", "tcp", "--dport", "80", "-j", "KUBE-EXT-ABC")
            later = [verdict() for _ in range(3)]
            for v in later[1:]:  # (the first may have been read before the change)
                assert {r["ip"] for r in v["lb_ips"]} == {"10.0.32.1", "10.0.32.2"}, v["lb_ips"]
                said = {u["source"] for u in v["unknowns"] if u["reason"] in put_off(v)}
                # (ip6tables-nft's rules share the nftables generation: put off too)
                assert "nat rules" in said and said <= {"nat rules", "ip6tables", "ipsets"}, \
                    v["unknowns"]
                assert all(f.get("lb_ip") != "10.0.32.9" for f in v["findings"])
            assert put_off(later[1]) == put_off(later[2])  # the same words: the same verdict
        finally:
            agent.terminate()
            agent.wait(timeout=30)
