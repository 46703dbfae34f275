"""Adversarial node states for kube-proxy's nftables mode (tests/data/constructed/nft-*,
labelled constructed in its README): shapes kube-proxy or its neighbours write that the
walk once got wrong. Each is checked offline here; tests/test_nft_netns.py proves the
kernel's answer for the ones it names.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from agent.netfilter.nft_text import read_nft_text
from agent.netfilter.nft_walk import NftWalker
from agent.netfilter.packet import MAX_PATHS, Packet
from tests.test_nft import OVERALL, ids_by_ip, verdict_of

CONSTRUCTED = Path(__file__).parent / "data" / "constructed"

SVC_9 = json.dumps({"kind": "List", "items": [{
    "kind": "Service", "metadata": {"namespace": "ns9", "name": "new"},
    "spec": {"type": "LoadBalancer", "clusterIP": "172.30.0.99",
             "ports": [{"port": 80, "protocol": "TCP", "nodePort": 3009}]},
    "status": {"loadBalancer": {"ingress": [{"ip": "9.9.9.9"}]}}}]})
ADDR = ("2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 state UP\n"
        "    inet 192.168.0.2/24 brd 192.168.0.255 scope global eth0\n"
        "3: cni0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 state UP\n"
        "    inet 10.0.1.1/24 brd 10.0.1.255 scope global cni0\n")
ROUTES = ("default via 192.168.0.1 dev eth0\n"
          "10.0.1.0/24 dev cni0 proto kernel scope link src 10.0.1.1\n"
          "192.168.0.0/24 dev eth0 proto kernel scope link src 192.168.0.2\n")

# the constructed Service whose address kube-proxy's table does not hold (9.9.9.9,
# 2001:db8:9999::9) is one it has not synced, and the verdict says so too
UNSYNCED = "lb-ip-without-kube-proxy-rule"


class _View:
    def addr_type(self, addr: str) -> str | None:
        return "LOCAL" if addr == "192.168.0.2" else "UNICAST"


def test_ip6_rules_of_an_inet_table_never_match_an_ipv4_packet() -> None:
    """firewalld's `table inet firewalld` holds ip6-only rules (`ip6 daddr {...} reject`,
    `meta nfproto ipv6 ...`); nft gives each an implicit `meta nfproto ipv6`, so an IPv4
    packet never matches them. The walk said "not evaluated" and every LB IP kube-proxy
    does not DNAT came out undetermined on such a node."""
    fw = (CONSTRUCTED / "nft-inet-firewalld-ip6-rules" / "nft-firewalld.txt").read_text()
    v = verdict_of(("nft.txt", (OVERALL / "nft-transaction.txt").read_text()),
                   ("nft-firewalld.txt", fw), ("services.json", SVC_9),
                   ("addr.txt", ADDR), ("routes.txt", ROUTES))
    assert ids_by_ip(v)["9.9.9.9"] == {"pod-to-lb-not-masqueraded", UNSYNCED}, ids_by_ip(v)
    rs = read_nft_text(fw, "fw")
    w = NftWalker(rs, _View())
    pkt = Packet(src="10.0.1.5", dst="9.9.9.9", in_iface="cni0", out_iface="eth0")
    [r] = w.walk_hook("forward", pkt)
    assert r.verdict == "ACCEPT", r
    # negated ip6 matches are false too (the implicit nfproto dependency), and nfproto
    # itself is ipv4
    rs2 = read_nft_text("table inet t {\n chain f {\n  type filter hook forward priority 0;\n"
                        "  ip6 saddr != ::1 drop\n  meta nfproto ipv4 accept\n  drop\n }\n}\n",
                        "t")
    [r2] = NftWalker(rs2, _View()).walk_hook("forward", pkt)
    assert r2.verdict == "ACCEPT" and "meta nfproto ipv4 accept" in r2.steps[-1].text, r2


def test_source_ranges_nft_lists_as_an_address_range() -> None:
    """loadBalancerSourceRanges 203.0.113.0/25 and 203.0.113.128/26: kube-proxy writes
    `ip saddr != { 203.0.113.0/25, 203.0.113.128/26 } drop`, nft merges them and lists
    `{ 203.0.113.0-203.0.113.191 }` (nft 1.0.6 output, in the case's file). The walk read
    no address ranges: the pod's packet to 5.6.7.8 forked on an 'assumed' match and came
    out undetermined; the kernel drops it (pod 10.0.1.5 is out of both ranges)."""
    listing = (CONSTRUCTED / "nft-sourceranges-merged-to-a-range" /
               "nft-list-table.txt").read_text()
    assert "ip saddr != { 203.0.113.0-203.0.113.191 } drop" in listing
    v = verdict_of(("nft-list-table.txt", listing))
    assert ids_by_ip(v)["5.6.7.8"] == {"pod-to-lb-dropped"}, ids_by_ip(v)
    w = NftWalker(read_nft_text(listing, "l"), _View())
    for src, want in (("203.0.113.150", {"DNAT"}), ("203.0.113.200", {"DROP"}),
                      ("10.0.1.5", {"DROP"})):
        got = {r.verdict for r in w.walk_hook("prerouting", Packet(
            src=src, dst="5.6.7.8", in_iface="eth0"))}
        assert got == want, (src, got)


def test_a_concatenation_matched_against_a_set() -> None:
    """The LoadBalancerSourceRanges shape of kube-proxy's first nftables code (as
    knftables' tests keep it): `ip daddr . meta l4proto . th dport . ip saddr
    @firewall-allow return`, then `drop`, behind `ip daddr . meta l4proto . th dport
    @firewall jump firewall-allow-check`. The walk answered 'assumed' for any
    concatenation compared to a set, so every packet forked into dropped and not."""
    text = (CONSTRUCTED / "nft-concat-set-firewall-allow" / "nft-transaction.txt").read_text()
    w = NftWalker(read_nft_text(text, "t"), _View())
    for src, dst, want in (("203.0.113.2", "5.6.7.8", "ACCEPT"),
                           ("203.0.113.130", "5.6.7.8", "DROP"),
                           ("10.0.1.5", "5.6.7.8", "DROP"),
                           ("203.0.113.130", "1.2.3.4", "ACCEPT")):
        got = [(r.verdict, bool(r.assumed)) for r in w.walk_hook("prerouting", Packet(
            src=src, dst=dst, in_iface="eth0"))]
        assert got == [(want, False)], (src, dst, got)
    # a pod inside the cluster CIDR, its exact address unknown: decided by the prefix
    pod = Packet(src="10.0.0.1", dst="5.6.7.8", src_known=False, src_within="10.0.0.0/8",
                    src_is_pod=True)
    assert [r.verdict for r in w.walk_hook("prerouting", pod)] == ["DROP"]


def _big_listing(n: int) -> str:
    """kube-proxy's listing (tests/data/nft/overall-list.txt) with ``n`` more ClusterIP
    service ports in @service-ips, printed as nft prints a map: one element a line."""
    t = (Path(__file__).parent / "data" / "nft" / "overall-list.txt").read_text()
    extra = "".join(f"\n\t\t\t     10.96.{i // 256}.{i % 256} . tcp . 80 : goto "
                    f"service-ABCDEFGH-ns{i}/svc{i}/tcp/p80," for i in range(n))
    head = "elements = { 1.2.3.4 . tcp . 80 : goto external-42NFTM6N"
    cips = "elements = { 172.30.0.41,"
    assert head in t and cips in t
    more = "".join(f"\n\t\t\t     10.96.{i // 256}.{i % 256}," for i in range(n))
    return t.replace(head, "elements = {" + extra + head[12:], 1).replace(
        cips, "elements = {" + more + cips[12:], 1)


def test_a_big_clusters_service_map_is_read_whole() -> None:
    """A cluster of 1500 service ports: nft lists @service-ips as one statement over
    1500 lines, > 4096 tokens. The reader refused the statement as one 'rule' too long:
    the map came out empty, and every LB IP was 'not DNATed' (a false loop once the
    Services name them)."""
    t = _big_listing(1500)
    rs = read_nft_text(t, "big.txt")
    assert not rs.notes, rs.notes
    small = read_nft_text(_big_listing(0), "small.txt").kube_proxy.set("service-ips")
    assert len(rs.kube_proxy.set("service-ips").elements) == 1500 + len(small.elements)
    v = verdict_of(("big.txt", t))
    assert ids_by_ip(v)["1.2.3.4"] == {"pod-to-lb-captured", "etp-local-no-local-endpoint"}
    assert v["status"] == "healthy" and "10.96.0.1" not in ids_by_ip(v)


def test_reading_a_long_element_list_is_linear() -> None:
    """The statement continued over lines was joined again at every line: quadratic
    (8000 elements took 1.5 s, 16000 four times that). Baseline in the same process:
    1/8 of the elements; 8 times the elements must cost < 20 times the time."""
    import time

    def cost(n: int) -> float:
        t = _big_listing(n)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            read_nft_text(t, "big.txt")
            best = min(best, time.perf_counter() - t0)
        return best

    small, big = cost(2000), cost(16000)
    print(f"2000 elements {small:.3f}s, 16000 elements {big:.3f}s, ratio {big / small:.1f}")
    assert big / small < 20, (small, big)


def _fake_nft(tmp_path: Path, monkeypatch, body: str) -> Path:  # type: ignore[no-untyped-def]
    """An `nft` on PATH that logs its arguments and runs ``body`` (python)."""
    import os
    import sys
    exe = tmp_path / "bin" / "nft"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\nimport sys, time\n"
                   f"open({str(tmp_path / 'calls')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                   + body)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    from agent.probes import nft_rules
    monkeypatch.setattr(nft_rules, "kernel_module_present", lambda name: True)
    # netlink cannot say (this process's namespace is not the node under test): ask nft
    monkeypatch.setattr(nft_rules, "kube_proxy_table", lambda: None)
    return tmp_path / "calls"


def test_the_probe_reads_the_whole_ruleset_only_in_nftables_mode(tmp_path: Path,
                                                                 monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from agent.probes import nft_rules
    from agent.probes.base import ProbeContext
    calls = _fake_nft(tmp_path, monkeypatch, (
        "if sys.argv[-1] == 'tables':\n"
        "    print('{\"nftables\": [{\"metainfo\": {}}, {\"table\": {\"family\": \"ip\", "
        "\"name\": \"nat\", \"handle\": 1}}]}')\n"
        "else:\n    print('{\"nftables\": []}')\n"))
    assert nft_rules.collect(ProbeContext()).value is None
    assert calls.read_text() == "-j list tables\n"  # an iptables node's ruleset: not read
    (tmp_path / "2").mkdir()
    calls = _fake_nft(tmp_path / "2", monkeypatch, (
        "if sys.argv[-1] == 'tables':\n"
        "    print('{\"nftables\": [{\"table\": {\"family\": \"ip\", \"name\": \"kube-proxy\", "
        "\"handle\": 3}}]}')\n"
        "else:\n    print('table ip flannel-ipv4 {\\n}')\n"))
    r = nft_rules.collect(ProbeContext())
    assert calls.read_text() == "-j list tables\nlist ruleset\n"
    assert r.value and "flannel-ipv4" in r.value[0].text


def test_the_probe_says_when_nft_hangs(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A huge table or a stuck nft: the probe gives up at its timeout and says so."""
    from agent.probes import nft_rules
    from agent.probes.base import ProbeContext
    _fake_nft(tmp_path, monkeypatch, "time.sleep(60)\n")
    monkeypatch.setattr(nft_rules, "read_table", lambda timeout, has_table=None,
                        background=False, f=nft_rules.read_table:
                        f(min(timeout, 1.0), has_table, background))
    import time
    t0 = time.monotonic()
    r = nft_rules.collect(ProbeContext())
    assert time.monotonic() - t0 < 10
    why = r.unknowns[0].reason
    assert r.value is None, r
    assert why.startswith("nft -j list tables (nft backend) was stopped after "), why
    assert "its time budget for " in why and "chains and sets in the nft ip and ip6" in why


def test_iptables_nft_tables_in_the_json_ruleset_are_the_iptables_dumps() -> None:
    """The live probe read `nft -j list ruleset` (it now reads the text listing; bundles
    and pastes still carry the JSON): iptables-nft's own tables come with
    it, their extensions as bare `xt` objects (tests/data/constructed/nft-iptables-nft-
    mangle-xt: nft 1.0.6's JSON of two iptables-nft mangle rules). Walked as nft rules
    they were 'not evaluated' and every walk undetermined; with the iptables dump given
    they are the iptables walker's (nat, filter) or, as in the iptables modes, not
    walked (mangle, raw)."""
    js = (CONSTRUCTED / "nft-iptables-nft-mangle-xt" / "nft-ruleset.json").read_text()
    assert '"xt": {"type": "match", "name": "addrtype"}' in js
    ipt = ("# Generated by iptables-nft-save v1.8.9 (nf_tables)\n*nat\n"
           ":PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
           ":POSTROUTING ACCEPT [0:0]\nCOMMIT\n")
    v = verdict_of(("nft.txt", (OVERALL / "nft-transaction.txt").read_text()),
                   ("nft-ruleset.json", js), ("iptables-save.txt", ipt),
                   ("services.json", SVC_9), ("addr.txt", ADDR), ("routes.txt", ROUTES))
    assert ids_by_ip(v)["9.9.9.9"] == {"pod-to-lb-not-masqueraded", UNSYNCED}, ids_by_ip(v)


def test_a_brace_in_a_quoted_comment_does_not_swallow_the_tables_after_it() -> None:
    """Another table's rule with a `{` in its comment (nft accepts any text there): the
    reader counted braces in quoted text, took the rule for the start of a statement
    over many lines and swallowed everything after it, kube-proxy's table too."""
    other = ('table inet filter {\n\tchain forward {\n\t\ttype filter hook forward priority '
             'filter; policy accept;\n\t\tip daddr 192.0.2.1 accept comment "allow {legacy"\n'
             '\t}\n}\n')
    listing = other + (Path(__file__).parent / "data" / "nft" / "overall-list.txt").read_text()
    rs = read_nft_text(listing, "paste.txt")
    assert not rs.notes, rs.notes
    assert rs.kube_proxy is not None and len(rs.kube_proxy.set("service-ips").elements) == 9
    assert rs.table("inet", "filter").chain("forward").rules[0].text.endswith(
        'comment "allow {legacy"')


def test_set_elements_with_counters() -> None:
    """A set with the `counter` flag (nft 1.0.6 lists each element as `198.51.100.0/24
    counter packets 0 bytes 0`): the counter words were read as part of the address, so
    no element could be compared and every packet forked on an assumed match."""
    text = (CONSTRUCTED / "nft-set-elements-with-counters" / "nft-list-ruleset.txt").read_text()
    w = NftWalker(read_nft_text(text, "t"), _View())
    for dst, want in (("9.9.9.9", "ACCEPT"), ("203.0.113.7", "DROP"), ("198.51.100.9", "DROP")):
        got = [(r.verdict, bool(r.assumed)) for r in w.walk_hook("forward", Packet(
            src="10.0.1.5", dst=dst, in_iface="cni0", out_iface="eth0"))]
        assert got == [(want, False)], (dst, got)


def test_notrack_before_kube_proxy_means_no_dnat() -> None:
    """`notrack` at raw priority (tests/data/constructed/nft-notrack-before-kube-proxy):
    an untracked packet skips every nat chain, kube-proxy's DNAT too; the walk took
    notrack for a no-op and said captured (a false healthy). The kernel (test_nft_netns)
    lets the pod's SYN leave with the pod's address."""
    raw = (CONSTRUCTED / "nft-notrack-before-kube-proxy" / "nft-raw.txt").read_text()
    v = verdict_of(("nft.txt", (OVERALL / "nft-transaction.txt").read_text()),
                   ("nft-raw.txt", raw), ("addr.txt", ADDR), ("routes.txt", ROUTES))
    assert ids_by_ip(v)["192.168.99.33"] == {"pod-to-lb-not-masqueraded"}, ids_by_ip(v)
    assert "pod-to-lb-captured" in ids_by_ip(v)["1.2.3.4"]


def test_hostile_goto_loops_end_in_unknown_not_an_exception() -> None:
    """nft refuses chain loops, a hand-edited or corrupted paste need not: `goto` does not
    grow the return stack, so the depth bound never hit and the walk died in a
    RecursionError (an 'internal error' finding, or worse where nothing catches it)."""
    for body in ("chain b {\n goto a\n}\n", "chain b {\n ip saddr 10.0.0.0/8 accept\n goto b\n}\n"):
        rs = read_nft_text("table ip t {\n" + body + "chain a {\n type filter hook prerouting"
                           " priority 0; policy accept;\n goto b\n}\n}\n", "t")
        res = NftWalker(rs, _View()).walk_hook("prerouting", Packet(
            src="10.0.1.5", dst="9.9.9.9", src_known=False))
        assert res and all(r.verdict in ("UNKNOWN", "ACCEPT") for r in res), res
        assert any(r.verdict == "UNKNOWN" for r in res)


@pytest.mark.parametrize("name", ["overall-list-handles.txt", "overall-list-numeric.txt"])
def test_listing_with_handles_or_numeric_gives_the_plain_listings_verdict(name: str) -> None:
    """`nft -a list ...` puts `# handle N` after every table/chain/set line: the reader
    matched no table header and read nothing. `nft -n list ...` prints protocols and ct
    states as numbers (`1.2.3.4 . 6 . 80`, `ct state 0x8`): no map element matched a tcp
    packet (no DNAT), the firewall jump never ran, and a finding's protocol came out as
    '6' (a verdict the schema refuses)."""
    data = Path(__file__).parent / "data" / "nft"
    plain = verdict_of(("overall-list.txt", (data / "overall-list.txt").read_text()))
    other = verdict_of((name, (data / name).read_text()))  # schema-validated there
    assert ids_by_ip(other) == ids_by_ip(plain), (ids_by_ip(other), ids_by_ip(plain))
    assert other["status"] == plain["status"]


def test_ct_state_flag_lists() -> None:
    """`ct state new,established` (how nft lists iptables-nft's --ctstate NEW,ESTABLISHED
    and how people write it) holds a new packet: the walk compared the whole list with
    the packet's one state and said no."""
    rs = read_nft_text("table ip t {\n chain f {\n  type filter hook forward priority 0;\n"
                       "  ct state new,established drop\n }\n}\n", "t")
    pkt = Packet(src="10.0.1.5", dst="9.9.9.9", in_iface="cni0", out_iface="eth0")
    assert [r.verdict for r in NftWalker(rs, _View()).walk_hook("forward", pkt)] == ["DROP"]


def test_paths_past_the_bound_are_said_not_dropped() -> None:
    """Undecided matches fork the walk; past the bound (then 256 paths) the walk kept the
    first ones and said nothing of the others: here the one path the kernel may take to
    DROP (every mark set) was among those thrown away, and every result said ACCEPT."""
    n = MAX_PATHS.bit_length()  # 2**n paths: past the bound
    rules = "".join(f"  ip saddr 10.0.{k}.0/24 meta mark set meta mark | {1 << k:#x}\n"
                    for k in range(n))
    rs = read_nft_text("table ip t {\n chain p {\n  type filter hook prerouting priority 0;\n"
                       + rules + " }\n chain q {\n  type filter hook prerouting priority 10;\n"
                       f"  meta mark {(1 << n) - 1:#x} drop\n }}\n}}\n", "t")
    res = NftWalker(rs, _View()).walk_hook("prerouting", Packet(
        src="10.0.0.1", dst="9.9.9.9", src_known=False))
    assert {r.verdict for r in res} & {"DROP", "UNKNOWN"}, {r.verdict for r in res}


def test_a_native_table_named_like_an_iptables_one_is_walked() -> None:
    """`table ip filter` written by hand (nft's own examples name it so, its chains in
    lower case) beside an iptables dump: it is not iptables-nft's table (whose chains are
    INPUT/FORWARD/...), so it is walked; it was skipped because of its name."""
    native = ("table ip filter {\n\tchain forward {\n\t\ttype filter hook forward priority "
              "filter; policy accept;\n\t\tip daddr 9.9.9.9 drop\n\t}\n}\n")
    ipt = ("# Generated by iptables-save v1.8.9\n*nat\n:PREROUTING ACCEPT [0:0]\n"
           ":INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n"
           "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
           "COMMIT\n")
    v = verdict_of(("nft.txt", (OVERALL / "nft-transaction.txt").read_text()),
                   ("nft-filter.txt", native), ("iptables-save.txt", ipt),
                   ("services.json", SVC_9), ("addr.txt", ADDR), ("routes.txt", ROUTES))
    assert ids_by_ip(v)["9.9.9.9"] == {"pod-to-lb-dropped", UNSYNCED}, ids_by_ip(v)


def test_an_unreadable_line_never_yields_a_certain_loop() -> None:
    """One element line of @service-ips garbled (an unterminated quote: a paste cut by a
    terminal): the reader skips the statement and says so in a note; the walk then
    found no DNAT for 192.168.99.33 and said pod-to-lb-not-masqueraded, a certain loop built
    on a map it could not read."""
    listing = (Path(__file__).parent / "data" / "nft" / "overall-list.txt").read_text()
    bad = listing.replace("elements = { 1.2.3.4 . tcp . 80 : goto external-42NFTM6N",
                          'elements = { 1.2.3.4 . tcp . 80 : goto "external-42NFTM6N', 1)
    assert bad != listing
    svc = json.dumps({"kind": "List", "items": [{
        "kind": "Service", "metadata": {"namespace": "ns4", "name": "svc4"},
        "spec": {"type": "LoadBalancer", "clusterIP": "172.30.0.44",
                 "ports": [{"name": "p80", "port": 80, "protocol": "TCP"}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "192.168.99.33"}]}}}]})
    v = verdict_of(("nft.txt", bad), ("services.json", svc), ("addr.txt", ADDR),
                   ("routes.txt", ROUTES))
    assert "pod-to-lb-not-masqueraded" not in ids_by_ip(v)["192.168.99.33"], ids_by_ip(v)
    f = next(f for f in v["findings"] if f["lb_ip"] == "192.168.99.33"
             and f["id"] == "pod-to-lb-undetermined")
    assert "could not be read" in f["summary"] and "nft.txt:" in f["summary"], f["summary"]


def test_one_line_blocks_of_a_config_file() -> None:
    """/etc/nftables.conf style (tests/data/constructed/nft-config-file-one-line-blocks,
    `nft -f` loads it): `set pods { type ...; elements = { ... } }` on one line was taken
    for the opening of a block, everything after it swallowed, the CNI-style masquerade
    in chain post2 lost: pod-to-lb-not-masqueraded, a false loop."""
    conf = (CONSTRUCTED / "nft-config-file-one-line-blocks" / "nftables.conf").read_text()
    rs = read_nft_text(conf, "nftables.conf")
    assert not rs.notes, rs.notes
    t = rs.table("ip", "nat2")
    assert t.set("pods").elements == ((("10.0.1.0/24",), None),)
    assert (t.chain("post").hook, t.chain("post").priority) == ("postrouting", 100)
    assert [r.text for r in t.chain("post2").rules] == [
        "ip saddr @pods ip daddr != 10.0.0.0/8 masquerade"]
    v = verdict_of(("nft.txt", (OVERALL / "nft-transaction.txt").read_text()),
                   ("nftables.conf", conf), ("services.json", SVC_9), ("addr.txt", ADDR),
                   ("routes.txt", ROUTES))
    assert ids_by_ip(v)["9.9.9.9"] == {"pod-to-lb-masqueraded", UNSYNCED}, ids_by_ip(v)


_PROBE_IN_NS = """
import json, sys
from agent.probes import nft_rules
from agent.probes.base import ProbeContext
r = nft_rules.collect(ProbeContext())
print(json.dumps([nft_rules.kube_proxy_table(), r.value is not None,
                  [u.reason for u in r.unknowns]]))
"""


def test_netlink_says_whether_kube_proxys_table_exists_without_running_nft(
        tmp_path: Path) -> None:
    """`nft -j list tables` fetches the whole ruleset (over 10 s on an iptables-nft node
    of 10k services, every cycle): the probe asks netlink for the table names and runs
    nft only for an ip or ip6 kube-proxy table. Real tables in a namespace made here; a
    recording nft first on PATH."""
    import sys

    from lab.netns import netns
    real_nft = subprocess.run(["sh", "-c", "command -v nft"], capture_output=True,
                              text=True, check=True).stdout.strip()
    calls = tmp_path / "calls"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nft").write_text(
        f"#!/bin/sh\necho \"$*\" >> {calls}\nexec {real_nft} \"$@\"\n")
    (tmp_path / "bin" / "nft").chmod(0o755)
    env_path = f"PATH={tmp_path / 'bin'}:{os.environ['PATH']}"
    root = str(Path(__file__).resolve().parent.parent)
    with netns("lbnl") as ns:
        def probe() -> list:  # type: ignore[type-arg]
            out = ns.run("env", env_path, f"PYTHONPATH={root}", sys.executable, "-c",
                         _PROBE_IN_NS).stdout
            return json.loads(out)

        # iptables mode on the nft backend: a nat table of iptables-nft, no kube-proxy's
        ns.run("nft", "add table ip nat")
        ns.run("nft", "add chain ip nat POSTROUTING "
               "{ type nat hook postrouting priority srcnat; }")
        assert probe() == [False, False, []]
        assert not calls.exists()  # nft never ran
        ns.run("nft", "add table ip6 kube-proxy")  # an IPv6-only nftables-mode node
        assert probe() == [True, True, []]
        assert calls.read_text() == "list ruleset\n"


def test_a_postrouting_rule_the_walk_cannot_follow_leaves_the_source_undecided() -> None:
    """As in the iptables walk: a served LB IP whose postrouting walk ends UNKNOWN (here a
    CNI table jumping to a chain the input lacks, constructed beside kube-proxy's real
    ruleset) is undecided, not 'client source kept'."""
    from agent.bundle import load_texts
    from agent.diagnose import prepare
    from agent.diagnose.nft_paths import nft_paths

    case = CONSTRUCTED.parent / "realworld" / "k8s-nftables-overall-rules-lb-etp-local-sourceranges"
    script = (case / "nft-transaction.txt").read_text() + (
        "\ntable ip cni {\n\tchain post {\n\t\ttype nat hook postrouting priority srcnat - 10; "
        "policy accept;\n\t\tjump not-in-the-paste\n\t}\n}\n")
    prep = prepare(load_texts([("nft.txt", script, "unknown")], origin="bundle:t"))
    target = next(t for t in prep.all_targets if t.ip == "5.6.7.8")
    served = nft_paths(prep.facts).outside_to_lb(target)
    assert served.served is None and served.source_kept is None, served
    assert "not-in-the-paste" in served.how, served


def test_a_rule_of_many_undecided_matches_is_no_recursion_error() -> None:
    """Each undecided match of a rule forked by a recursive call: a rule of 1,300 `ip
    saddr` matches on a pod whose address the input lacks ended the check in "internal
    error walking it: RecursionError". Every branch where one of them fails is a path."""
    n = 1300
    rule = " ".join(f"ip saddr != 10.{k // 250}.{k % 250}.0/24" for k in range(n)) + " drop"
    rs = read_nft_text("table ip t {\n chain p {\n  type filter hook prerouting priority 0;\n"
                       f"  {rule}\n }}\n}}\n", "t")
    res = NftWalker(rs, _View()).walk_hook("prerouting", Packet(
        src="10.0.0.1", dst="9.9.9.9", src_known=False))
    assert len(res) == n + 1 and {r.verdict for r in res} == {"ACCEPT", "DROP"}
    drop = next(r for r in res if r.verdict == "DROP")
    assert len(drop.assumed) == n  # every match taken as true, each said


_PORT_RULES = ("table inet t {\n chain f {\n  type filter hook forward priority 0;\n"
               "  udp dport != 53 drop\n  udp dport 53 accept\n  tcp dport 80 accept\n"
               "  tcp sport != 1 drop\n }\n}\n")


@pytest.mark.netns
def test_a_protocols_port_match_holds_only_for_that_protocol() -> None:
    """`udp dport 53` never matched a UDP packet (the walk read every protocol's port but
    TCP's as -1), and `udp dport != 53` matched a TCP one. nft compiles a protocol's port
    match with `meta l4proto` before it (its bytecode, read from nft in a namespace made
    here), so a packet of another protocol matches neither form."""
    from lab.netns import netns
    with netns("lbport") as ns:
        debug = ns.run("nft", "--debug=netlink", "-f", "-", input=_PORT_RULES).stdout
    # each rule's bytecode: the protocol (0x11 UDP, 0x06 TCP) compared before the port
    udp_ne, tcp_eq = (next(b for b in debug.split("\n\n") if port in b)
                      for port in ("cmp neq reg 1 0x00003500", "cmp eq reg 1 0x00005000"))
    assert udp_ne.index("meta load l4proto") < udp_ne.index("cmp eq reg 1 0x00000011") \
        < udp_ne.index("transport header"), udp_ne
    assert "cmp eq reg 1 0x00000006" in tcp_eq, tcp_eq
    w = NftWalker(read_nft_text(_PORT_RULES, "t"), _View())
    udp = Packet(src="10.0.1.5", dst="9.9.9.9", proto="udp", dport=53, in_iface="cni0")
    [r] = w.walk_hook("forward", udp)
    assert r.verdict == "ACCEPT" and r.steps[-1].text == "udp dport 53 accept", r
    for dport in (80, 53):  # neither UDP rule holds for TCP, whatever the port
        tcp = udp._replace(proto="tcp", dport=dport)
        [r] = w.walk_hook("forward", tcp)
        want = "tcp dport 80 accept" if dport == 80 else "tcp sport != 1 drop"
        assert r.steps[-1].text == want, (dport, r)


# forward-hook rules that tell some endpoint addresses apart (constructed): each is added
# to kube-proxy's own filter-forward of the overall dump
_TELLING_APART = [
    "ip daddr 10.0.1.7 drop",
    "ip daddr != 10.0.1.7 accept",
    "ip daddr 10.0.1.0/28 drop",
    "ip daddr 10.0.1.6-10.0.1.8 reject",
    "ip daddr { 10.0.1.7, 10.9.9.9 } drop",
    "ip daddr . tcp dport { 10.0.1.7 . 8080 } drop",
    "ip daddr @blocked drop",
    "ip daddr vmap @by-endpoint",
    "ip daddr & 255.255.255.0 == 10.0.1.0 drop",
    "fib daddr type local drop",
    "tcp dport 8080 drop",
    "meta mark 0x4000 drop",
    "jump side",
]
_SIDE = ("  set blocked {\n   type ipv4_addr\n   elements = { 10.0.1.7 }\n  }\n"
         "  map by-endpoint {\n   type ipv4_addr : verdict\n"
         "   elements = { 10.0.1.8 : drop, 10.0.1.9 : goto side }\n  }\n"
         "  chain side {\n   ip daddr 10.0.1.9 reject\n  }\n")


@pytest.mark.parametrize("rule", _TELLING_APART)
@pytest.mark.parametrize("iptables_forward", [False, True], ids=["no-iptables", "iptables"])
def test_a_dnated_packets_forward_walk_is_shared_only_where_no_rule_tells_it_apart(
        rule: str, iptables_forward: bool) -> None:
    """A pod's packet DNATed to an endpoint crosses the forward hook once per endpoint of
    every LB IP (40k walks at 10k services); where no rule there can tell one endpoint
    address from another, the walk is made once and shared (NftWalker.walk_hook). For
    each rule that tells some apart (an address, prefix, range, anonymous or named set,
    verdict map, concatenation, mask, fib lookup, an iptables FORWARD rule), every
    endpoint's paths are what a walk of its own packet gives."""
    from agent.netfilter.walk import TableWalker
    from tests.test_walk import View, parse_iptables_save

    text = (OVERALL / "nft-transaction.txt").read_text() + (
        "table ip extra {\n" + _SIDE + "  chain fwd {\n"
        "   type filter hook forward priority 10; policy accept;\n"
        f"   {rule}\n  }}\n}}\n")
    rs = read_nft_text(text, "t")
    walkers, quiet = {}, frozenset({("filter", "forward")})
    if iptables_forward:
        table = parse_iptables_save("*filter\n:FORWARD ACCEPT [0:0]\n"
                                    "-A FORWARD -d 10.0.1.8/32 -j DROP\nCOMMIT\n",
                                    source="ipt").table("filter")
        assert table is not None
        walkers["filter"] = TableWalker(table, View()).walk
        quiet = frozenset()
    shared = NftWalker(rs, _View(), walkers, quiet)
    each = NftWalker(rs, _View(), walkers, quiet)
    for n in range(5, 12):
        for mark in (0, 0x4000):
            addr = f"10.0.1.{n}"
            pkt = Packet(src="10.0.1.5", dst=addr, proto="tcp", dport=8080, in_iface="cni0",
                         mark=mark, src_is_pod=True, dnat_to=f"{addr}:8080")
            assert shared.walk_hook("forward", pkt) == each._walk_hook("forward", pkt), \
                (rule, addr, mark)
    # the plainest rule shares the walk; one naming an endpoint or any iptables rule
    # leaves that endpoint its own
    told = shared._told_apart[False]
    if iptables_forward or rule.startswith("fib"):
        assert told is None
    elif rule.startswith(("tcp dport", "meta mark", "ip daddr &")):
        # (an address mask is a statement the walk does not evaluate, for any address)
        assert told is not None and not told.holds("10.0.1.7")
    else:
        assert told is not None and any(told.holds(f"10.0.1.{n}") for n in (7, 8, 9))
        assert not told.holds("10.0.2.11")


@pytest.mark.parametrize("forward,quiet", [
    ("", True),  # filter FORWARD with no rule: its policy answers every packet alike
    ("-A FORWARD -d 10.0.1.8/32 -j DROP\n", False),
    ("-A FORWARD -j KUBE-FORWARD\n-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n",
     False),
])
def test_the_forward_walk_is_shared_only_beside_an_empty_iptables_forward(
        forward: str, quiet: bool) -> None:
    """The backend tells the walker which iptables stage on the forward hook answers every
    packet alike (filter FORWARD without a rule); with any rule there, each endpoint's
    packet is walked on its own, and its verdict is the same either way."""
    from agent.bundle import load_texts
    from agent.bundle.sections import name_format
    from agent.diagnose import prepare
    from agent.diagnose.nft_paths import NftBackend

    ipt = ("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
           + (":KUBE-FORWARD - [0:0]\n" if "KUBE-FORWARD" in forward else "") + forward
           + "COMMIT\n")
    files = [("nft.txt", (OVERALL / "nft-transaction.txt").read_text()),
             ("iptables-save.txt", ipt), ("addr.txt", ADDR), ("routes.txt", ROUTES)]
    snap = load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")
    walker = NftBackend(prepare(snap).facts).walker
    assert "filter" in walker.iptables
    assert walker.quiet == (frozenset({("filter", "forward")}) if quiet else frozenset())
    pkt = Packet(src="10.0.1.5", dst="10.0.1.8", proto="tcp", dport=80, in_iface="cni0",
                 src_is_pod=True, dnat_to="10.0.1.8:80")
    [r] = walker.walk_hook("forward", pkt)
    assert r == walker._walk_hook("forward", pkt)[0]
    assert r.verdict == ("DROP" if "10.0.1.8" in forward else "ACCEPT"), r
    assert (walker._told_apart[False] is None) == (not quiet)


def test_a_shared_forward_walk_is_kept_only_when_it_is_small() -> None:
    """Each undecided match on the forward hook forks the walk (12 of them: 4,096 paths a
    packet); a walk of more than a few paths is not kept for the next packet (4,096 kept
    packets of 4,096 paths each would be gigabytes), and is the same all the same."""
    rules = "".join(f"  ct direction original counter comment \"r{k}\"\n" for k in range(5))
    rs = read_nft_text("table ip t {\n chain f {\n  type filter hook forward priority 0;\n"
                       + rules + " }\n}\n", "t")
    w = NftWalker(rs, _View())
    pkt = Packet(src="10.0.1.5", dst="10.0.1.8", proto="tcp", dport=80, in_iface="cni0",
                 src_is_pod=True, dnat_to="10.0.1.8:80")
    got = w.walk_hook("forward", pkt)
    assert len(got) == 32 and got == w._walk_hook("forward", pkt)
    assert w._forwarded == {}
    small = NftWalker(read_nft_text("table ip t {\n chain f {\n  type filter hook forward "
                                    "priority 0;\n" + rules.split("\n")[0] + "\n }\n}\n", "t"),
                      _View())
    assert len(small.walk_hook("forward", pkt)) == 2 and len(small._forwarded) == 1


def test_a_walker_keeps_a_bounded_number_of_compiled_rules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A walker compiles each rule it reaches once and keeps at most _COMPILED_KEPT of
    them (all 126k rules of a 10k-service node kept were 66 MB): walked with room for
    only a few, every packet's paths are what a walker keeping all of them gives."""
    import agent.netfilter.nft_walk as nft_walk

    rs = read_nft_text((OVERALL / "nft-transaction.txt").read_text(), "t")
    addresses = ["172.30.0.41", "172.30.0.42", "192.168.99.22", "1.2.3.4", "172.30.0.43",
                 "172.30.0.44", "172.30.0.45", "192.168.0.2", "9.9.9.9"]
    packets = [Packet(src="10.0.1.5", dst=dst, dport=port, in_iface="cni0")
               for dst in addresses for port in (80, 443)]
    keeping_all = NftWalker(rs, _View())
    expected = [keeping_all.walk_hook(hook, p) for hook in ("prerouting", "output")
                for p in packets]
    assert len(keeping_all._compiled) > 12
    monkeypatch.setattr(nft_walk, "_COMPILED_KEPT", 4)
    bounded = NftWalker(rs, _View())
    for _ in range(2):
        assert [bounded.walk_hook(hook, p) for hook in ("prerouting", "output")
                for p in packets] == expected
        assert len(bounded._compiled) <= 4 and len(bounded._by_tokens) <= 4


def test_a_forward_hook_naming_many_prefixes_is_walked_for_each_packet() -> None:
    """Past MAX_TOLD_SPANS prefixes on the forward hook (each tested against every
    packet), a DNATed packet's forward walk is its own, and what a walk of it gives."""
    from agent.netfilter.packet import MAX_TOLD_SPANS

    rules = "".join(f"  ip daddr 10.{n}.0.0/16 drop\n" for n in range(MAX_TOLD_SPANS + 1))
    rs = read_nft_text("table ip t {\n chain f {\n  type filter hook forward priority 0;\n"
                       f"{rules} }}\n}}\n", "t")
    w = NftWalker(rs, _View())
    for dst in ("10.0.1.5", "10.64.0.9", "10.200.0.1", "192.0.2.4"):
        pkt = Packet(src="10.0.1.5", dst=dst, dport=8080, in_iface="cni0",
                     dnat_to=f"{dst}:8080")
        assert w.walk_hook("forward", pkt) == NftWalker(rs, _View())._walk_hook("forward", pkt)
    assert w._told_apart[False] is None and not w._forwarded
