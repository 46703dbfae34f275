"""kube-proxy's nftables mode beyond one whole IPv4 table: excerpts of its table pasted
without the table line, and its `ip6 kube-proxy` table walked with IPv6 packets (saved
text; tests/test_nft_netns.py proves the same rulesets on a kernel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose
from agent.netfilter.nft_model import NftError
from agent.netfilter.nft_text import read_nft_text
from agent.netfilter.nft_walk import NftWalker
from agent.netfilter.packet import Packet
from lab.nft_node import V6_ADDRESSES, ipv6_of

REAL = Path(__file__).parent / "data" / "realworld"
EXCERPT = REAL / "k8s-issue-131765-nft-list-map-no-endpoint-services-excerpt" / "paste.txt"

# the constructed Service whose address kube-proxy's table does not hold (9.9.9.9,
# 2001:db8:9999::9) is one it has not synced, and the verdict says so too
UNSYNCED = "lb-ip-without-kube-proxy-rule"


def verdict(*files: tuple[str, str]) -> dict:
    snap = load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


def by_ip(v: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in v["findings"]:
        if f["lb_ip"]:
            out.setdefault(f["lb_ip"], set()).add(f["id"])
    return out


def test_a_pasted_map_without_its_table_line_is_kube_proxys() -> None:
    rs = read_nft_text(EXCERPT.read_text(), "paste.txt")
    t = rs.kube_proxy
    assert t is not None
    m = t.set("no-endpoint-services")
    assert m is not None and m.elements == ((("10.88.1.2", "tcp", "80"), "drop"),)
    assert m.comments == ("sys-ingress-priv/internal-ingress-controller-v2:web",)
    assert any(n.startswith("paste.txt:1: no 'table' line") for n in rs.notes), rs.notes
    assert any("ends inside 2 '{'" in n for n in rs.notes), rs.notes


def test_another_tables_headless_block_is_not_taken_for_kube_proxys() -> None:
    # flannel's chain (kubernetes-sigs/kube-network-policies#54) without its table line
    text = "chain postrtg {\n\ttype nat hook postrouting priority srcnat; policy accept;\n}\n"
    with pytest.raises(NftError, match="no nft ruleset"):
        read_nft_text(text, "p")


def test_a_rule_cut_by_the_end_of_the_input_is_not_read() -> None:
    text = ("chain services {\n\tip daddr . meta l4proto . th dport vmap @service-ips\n"
            "\tfib daddr type local ip daddr != { 127.0.0.0/8")
    rs = read_nft_text(text, "p")
    rules = rs.kube_proxy.chain("services").rules
    assert [r.text for r in rules] == ["ip daddr . meta l4proto . th dport vmap @service-ips"]
    assert any("p:3: unterminated rule" in n for n in rs.notes), rs.notes


def test_an_excerpt_naming_an_lb_ip_is_undecided_not_a_loop() -> None:
    # constructed: kube-proxy's @service-ips block alone, as `nft list map ip kube-proxy
    # service-ips` prints it: the LB IP is known, the chains that DNAT it are not
    text = ("map service-ips {\n\ttype ipv4_addr . inet_proto . inet_service : verdict\n"
            '\tcomment "ClusterIP, ExternalIP and LoadBalancer IP traffic"\n'
            "\telements = { 1.2.3.4 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }\n"
            "}\n")
    v = verdict(("paste.txt", text))
    assert v["kube_proxy_mode"] == "nftables"
    assert by_ip(v) == {"1.2.3.4": {"pod-to-lb-undetermined"}}
    f = next(f for f in v["findings"] if f["id"] == "pod-to-lb-undetermined")
    assert "no nat prerouting chain" in " ".join([f["summary"], *f["evidence"]])


OVERALL = REAL / "k8s-nftables-overall-rules-lb-etp-local-sourceranges"


def test_the_ip6_table_of_the_same_services_gives_the_ip_tables_verdict() -> None:
    want4 = json.loads((OVERALL / "case.json").read_text())["expected"]["per_ip"]
    script = (OVERALL / "nft-transaction.txt").read_text()
    v = verdict(("nft-transaction.txt", ipv6_of(script)))
    assert v["kube_proxy_mode"] == "nftables"
    assert by_ip(v) == {V6_ADDRESSES[ip]: set(ids) for ip, ids in want4.items()}
    # both tables in one input (a dual-stack node): each family walked through its own
    both = verdict(("nft-transaction.txt", script + ipv6_of(script)))
    assert by_ip(both) == {**{ip: set(ids) for ip, ids in want4.items()},
                           **{V6_ADDRESSES[ip]: set(ids) for ip, ids in want4.items()}}


class _Remote:
    def addr_type(self, addr: str) -> str | None:
        return "UNICAST"


def test_the_packets_family_decides_which_tables_and_keys_it_meets() -> None:
    text = """table ip four {
\tchain pre {
\t\ttype filter hook prerouting priority 0; policy drop;
\t}
}
table inet both {
\tchain pre {
\t\ttype filter hook prerouting priority 10; policy accept;
\t\tmeta nfproto ipv4 ip daddr 192.0.2.1 accept
\t\tip saddr != 192.0.2.0/24 drop
\t\tip6 daddr 2001:db8::5 tcp dport 80 drop
\t}
}
table ip6 six {
\tchain nat {
\t\ttype nat hook prerouting priority -100; policy accept;
\t\tip6 daddr 2001:db8::6 dnat to [fd00::6]:8080
\t}
}
"""
    w = NftWalker(read_nft_text(text, "t"), _Remote())
    six = Packet(src="2001:db8::9", dst="2001:db8::6")
    r = w.walk_hook("prerouting", six)
    # not the ip table's drop policy, not the inet table's IPv4 rules (`ip saddr !=` is
    # never an IPv6 packet's), the ip6 table's DNAT
    assert [(x.verdict, x.packet.dnat_to) for x in r] == [("DNAT", "[fd00::6]:8080")]
    assert [s.where for s in r[0].steps] == ["nft ip6 six nat"]
    r = w.walk_hook("prerouting", Packet(src="2001:db8::9", dst="2001:db8::5"))
    assert [x.verdict for x in r] == ["DROP"]
    r = w.walk_hook("prerouting", Packet(src="198.51.100.1", dst="198.51.100.2"))
    assert [x.verdict for x in r] == ["DROP"]  # the ip table's policy: IPv4 meets it


def test_meta_protocol_is_the_packets_ethertype() -> None:
    text = """table inet t {
\tchain pre {
\t\ttype filter hook prerouting priority 0; policy accept;
\t\tmeta protocol ip6 drop
\t}
}
"""
    w = NftWalker(read_nft_text(text, "t"), _Remote())
    assert [r.verdict for r in w.walk_hook("prerouting", Packet(
        src="2001:db8::9", dst="2001:db8::6"))] == ["DROP"]
    assert [r.verdict for r in w.walk_hook("prerouting", Packet(
        src="198.51.100.1", dst="198.51.100.2"))] == ["ACCEPT"]


# constructed: the dual-stack lab node (lab.nft_node) as `ip addr` and its local table
ADDR6 = """1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN group default
    inet 127.0.0.1/8 scope host lo
    inet6 ::1/128 scope host
2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP group default
    inet 192.168.0.2/24 brd 192.168.0.255 scope global eth0
    inet6 2001:db8::1/64 scope global
3: cni0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP group default
    inet 10.0.1.1/24 brd 10.0.1.255 scope global cni0
    inet6 fd00:10::1/64 scope global
"""
# constructed: a CNI masquerading its IPv6 pods in a table of its own (flannel's
# nftables mode writes `table ip6 flannel-ipv6` with such a chain)
CNI6 = """table ip6 flannel-ipv6 {
\tchain postrtg {
\t\ttype nat hook postrouting priority srcnat; policy accept;
\t\tip6 saddr fd00:10::/64 ip6 daddr != fd00:10::/64 masquerade fully-random
\t}
}
"""
UNSYNCED6 = json.dumps({"kind": "List", "items": [{
    "kind": "Service", "metadata": {"namespace": "ns9", "name": "new6"},
    "spec": {"type": "LoadBalancer", "clusterIP": "fd00:10:96::99",
             "ports": [{"port": 80, "protocol": "TCP", "nodePort": 3009}]},
    "status": {"loadBalancer": {"ingress": [{"ip": "2001:db8:9999::9"}]}}}]})


def test_an_ipv6_cni_masquerade_beside_kube_proxys_ip6_table() -> None:
    script = ipv6_of((OVERALL / "nft-transaction.txt").read_text())
    files = [("nft-transaction.txt", script), ("addr.txt", ADDR6),
             ("services.json", UNSYNCED6)]
    bare = verdict(*files)
    assert by_ip(bare)["2001:db8:9999::9"] == {"pod-to-lb-not-masqueraded", UNSYNCED}, by_ip(bare)
    v = verdict(*files, ("nft-cni.txt", CNI6))
    assert by_ip(v)["2001:db8:9999::9"] == {"pod-to-lb-masqueraded", UNSYNCED}, by_ip(v)
    f = next(f for f in v["findings"]
             if f["lb_ip"] == "2001:db8:9999::9" and f["id"].startswith("pod-to-lb"))
    ev = "\n".join(f["evidence"])
    assert "nft ip6 flannel-ipv6 postrtg: ip6 saddr fd00:10::/64" in ev, ev
    assert "the node's address 2001:db8::1 (masquerade)" in ev, ev


def test_no_lb_ip_in_nftables_mode_names_the_nftables_place_it_looked() -> None:
    case = REAL / "knftables-fakedump-ip6-kube-proxy-nodeport-only"
    v = verdict(("nft-transaction.txt", (case / "nft-transaction.txt").read_text()))
    assert v["kube_proxy_mode"] == "nftables"
    (unknown,) = [f for f in v["findings"] if f["id"] == "lb-ips-unknown"]
    assert "service-ips" in unknown["evidence"][0]
    assert "KUBE-LOAD-BALANCER" not in " ".join(unknown["evidence"])


def test_an_ipv6_lb_ip_without_the_ip6_table_names_the_nft_command() -> None:
    # nftables mode, only `ip kube-proxy` given: the IPv6 LB IP is undecided, and the
    # verdict asks for the ip6 table, not for ip6tables-save (not read in this mode)
    script = (OVERALL / "nft-transaction.txt").read_text()
    v = verdict(("nft-transaction.txt", script), ("services.json", UNSYNCED6))
    # (no ip6 kube-proxy table in the input: nothing says kube-proxy has not synced it)
    assert by_ip(v)["2001:db8:9999::9"] == {"pod-to-lb-undetermined"}, by_ip(v)
    f = next(f for f in v["findings"]
             if f["lb_ip"] == "2001:db8:9999::9" and f["id"].startswith("pod-to-lb"))
    said = " ".join([f["summary"], f["remedy"], *f["evidence"]])
    assert "`nft list table ip6 kube-proxy`" in said, said
    assert "ip6tables" not in said, said


def test_an_ipv4_local_table_says_nothing_of_ipv6_addresses() -> None:
    # `ip route show table local` pasted (IPv4 only): whether the unserved IPv6 LB IP is
    # bound here (then the pod's SYN stays on the node) is not shown: undecided, naming
    # the IPv6 table, never "not a local address" and a loop
    script = (OVERALL / "nft-transaction.txt").read_text()
    local4 = ("local 192.168.0.2 dev eth0 proto kernel scope host src 192.168.0.2\n"
              "local 127.0.0.1 dev lo proto kernel scope host src 127.0.0.1\n")
    v = verdict(("nft-transaction.txt", script + ipv6_of(script)),
                ("services.json", UNSYNCED6), ("route-local.txt", local4))
    assert by_ip(v)["2001:db8:9999::9"] == {"pod-to-lb-undetermined", UNSYNCED}, by_ip(v)
    f = next(f for f in v["findings"]
             if f["lb_ip"] == "2001:db8:9999::9" and f["id"].startswith("pod-to-lb"))
    assert "`ip -6 route show table local`" in f["summary"], f["summary"]
    # the IPv6 local table given: decided (not local here, unmasqueraded: a loop)
    v = verdict(("nft-transaction.txt", script + ipv6_of(script)),
                ("services.json", UNSYNCED6),
                ("route-local.txt", local4 + "local ::1 dev lo proto kernel metric 0 pref "
                 "medium\nlocal 2001:db8::1 dev eth0 proto kernel metric 0 pref medium\n"))
    assert by_ip(v)["2001:db8:9999::9"] == {"pod-to-lb-not-masqueraded", UNSYNCED}, by_ip(v)


def test_an_ipv6_only_node_leaves_by_the_interface_of_its_ipv6_address() -> None:
    # no IPv4 address at all (no IPv4 uplink): a CNI masquerading what leaves eth0 is
    # decided for the IPv6 walk, which leaves by eth0 (it holds the node's IPv6 address)
    addr = "\n".join(ln for ln in ADDR6.splitlines() if " inet " not in ln) + "\n"
    cni = CNI6.replace("ip6 saddr fd00:10::/64 ip6 daddr != fd00:10::/64", 'oifname "eth0"')
    script = ipv6_of((OVERALL / "nft-transaction.txt").read_text())
    v = verdict(("nft-transaction.txt", script), ("addr.txt", addr),
                ("services.json", UNSYNCED6), ("nft-cni.txt", cni))
    assert by_ip(v)["2001:db8:9999::9"] == {"pod-to-lb-masqueraded", UNSYNCED}, by_ip(v)


def test_a_snat_to_another_address_is_not_the_nodes_masquerade() -> None:
    # a CNI's `snat to` an address that is not the node's (an egress address): the load
    # balancer may pick this node for that source, as the iptables walk decides; it was
    # called masqueraded "with the node's address" (healthy) for any snat
    script = ipv6_of((OVERALL / "nft-transaction.txt").read_text())
    files = [("nft-transaction.txt", script), ("addr.txt", ADDR6),
             ("services.json", UNSYNCED6)]
    other = CNI6.replace("masquerade fully-random", "snat to 2001:db8:e::99")
    v = verdict(*files, ("nft-cni.txt", other))
    assert by_ip(v)["2001:db8:9999::9"] == {"pod-to-lb-not-masqueraded", UNSYNCED}, by_ip(v)
    own = CNI6.replace("masquerade fully-random", "snat to 2001:db8::1")
    v = verdict(*files, ("nft-cni.txt", own))
    assert by_ip(v)["2001:db8:9999::9"] == {"pod-to-lb-masqueraded", UNSYNCED}, by_ip(v)


def test_an_old_ip6_table_without_cluster_ips_keeps_its_clusterips_out() -> None:
    # kube-proxy's v1.29-alpha generation has no @cluster-ips: an element going straight
    # to its service- chain is a ClusterIP. Given Service objects (whose clusterIP is
    # IPv4), the IPv6 ClusterIPs of the ip6 table were taken for LB or external IPs
    alpha = REAL / "k8s-nftables-1.29alpha-overall-firewall-set-lbsourceranges"
    script = ipv6_of((alpha / "nft-transaction.txt").read_text())
    svc = json.dumps({"kind": "List", "items": [{
        "kind": "Service", "metadata": {"namespace": "x", "name": "y"},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.1",
                 "ports": [{"port": 443, "protocol": "TCP"}]}}]})
    alone = {r["ip"] for r in verdict(("nft.txt", script))["lb_ips"]}
    given = {r["ip"] for r in verdict(("nft.txt", script), ("services.json", svc))["lb_ips"]}
    assert given == alone and not any(ip.startswith("fd00:10:96::") for ip in given), given
