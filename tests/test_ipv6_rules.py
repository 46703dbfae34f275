"""IPv6 rules offline: ip6tables-save / ip6tables -S text goes to the snapshot's ip6tables
(by content, like every input), IPv6 LB IPs are walked through it, kube-proxy's IPVS-mode
IPv6 ipsets (KUBE-6-*) and [addr]:port virtual servers are read; old snapshots load."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from agent.bundle import load_texts
from agent.diagnose import diagnose
from agent.report import render
from agent.snapshot import NodeSnapshot, Unknown
from lab.dual_stack import kube_files, rules


def _load(*texts: tuple[str, str]) -> NodeSnapshot:
    return load_texts([(name, text, "unknown") for name, text in texts], origin="bundle:t")


def _findings(snap: NodeSnapshot) -> dict[tuple[str, str | None], dict]:  # type: ignore[type-arg]
    v = diagnose(snap, "n").to_dict("all")
    return {(f["id"], f["lb_ip"]): f for f in v["findings"]}


V4, V6 = rules()


def test_both_dumps_in_one_paste_go_to_their_family() -> None:
    text = V4 + "\n" + V6
    snap = _load(("paste.txt", text))
    assert snap.netfilter is not None and snap.ip6tables is not None
    v4_rules = [r.text for c in snap.netfilter.table("nat").chains for r in c.rules]  # type: ignore[union-attr]
    v6_rules = [r for c in snap.ip6tables.table("nat").chains for r in c.rules]  # type: ignore[union-attr]
    assert any("10.0.1.100/32" in t for t in v4_rules) and not any("2001:" in t for t in v4_rules)
    assert any("2001:db8:ff::7/128" in r.text for r in v6_rules)
    # a rule's source names its line in the paste
    rule = next(r for r in v6_rules if "2001:db8:ff::7/128" in r.text)
    line = int(rule.source.rsplit(":", 1)[1])
    assert text.splitlines()[line - 1] == rule.text


def test_prompted_and_headerless_ipv6_rules() -> None:
    chain = [ln for ln in V6.splitlines() if ln.startswith("-A KUBE-SERVICES ")]
    prompted = "$ sudo ip6tables -t nat -S KUBE-SERVICES\n" + "\n".join(chain) + "\n"
    headerless = "\n".join(chain) + "\n"  # IPv6 -d addresses, no IPv4 one
    for text in (prompted, headerless):
        snap = _load(("paste.txt", text))
        assert snap.netfilter is None and snap.ip6tables is not None, text[:40]
        assert snap.ip6tables.table("nat").chain("KUBE-SERVICES") is not None  # type: ignore[union-attr]


def test_ip6tables_save_alone_gives_a_verdict() -> None:
    v = diagnose(_load(("ip6tables-save.txt", V6)), "n").to_dict("all")
    assert v["kube_proxy_mode"] == "iptables" and "IPv6 rules" in \
        v["context"]["kube_proxy_mode_from"]
    got = {(f["id"], f["lb_ip"]) for f in v["findings"]}
    assert ("pod-to-lb-captured", "2001:db8:ff::7") in got
    assert ("pod-to-lb-dropped", "2001:db8:ff::a") in got
    assert ("etp-local-no-local-endpoint", "2001:db8:ff::9") in got
    # unsynced6's VIP is in no rule: without the Service objects it is not known at all
    assert not any(ip == "2001:db8:ff::c" for _, ip in got)
    assert any("IPv4 rules not given" in u["reason"] for u in v["unknowns"])
    assert v["context"]["pod_network6"] == "fd00:10:244::/56"  # the rules name it


def test_ipv6_lb_ip_without_ipv6_rules_names_what_is_needed() -> None:
    files = kube_files()
    snap = _load(("iptables-save.txt", V4), ("services.json", files["services.json"]))
    got = _findings(snap)
    f = got[("pod-to-lb-undetermined", "2001:db8:ff::7")]
    assert "ip6tables-save" in f["summary"] and "ip6tables-save" in f["remedy"]
    assert ("pod-to-lb-captured", "10.0.1.100") in got


def test_ipv6_findings_rest_on_no_ipv4_sysctl() -> None:
    files = kube_files()
    sysctl = ("net.ipv4.conf.all.rp_filter = 1\nnet.ipv4.conf.eth0.rp_filter = 1\n"
              "net.ipv4.conf.eth0.accept_local = 0\n")
    addr = ("2: eth0: <BROADCAST,UP,LOWER_UP> mtu 1500 state UP\n"
            "    inet 10.0.0.10/24 scope global eth0\n"
            "    inet6 2001:db8:1::10/64 scope global\n"
            "3: cni0: <BROADCAST,UP,LOWER_UP> mtu 1500 state UP\n"
            "    inet 172.16.1.1/24 scope global cni0\n"
            "    inet6 fd00:10:244:1::1/64 scope global\n")
    snap = _load(("iptables-save.txt", V4), ("ip6tables-save.txt", V6),
                 ("services.json", files["services.json"]), ("sysctl.txt", sysctl),
                 ("addr.txt", addr))
    f = _findings(snap)[("pod-to-lb-not-masqueraded", "2001:db8:ff::c")]
    assert not any("rp_filter" in e and "IPv6 has no" not in e for e in f["evidence"])
    assert any("pod fd00:10:244:1::2 stands for the pods" in e for e in f["evidence"])


def test_old_snapshot_without_ip6tables_loads_and_the_field_round_trips() -> None:
    snap = _load(("ip6tables-save.txt", V6))
    data = json.loads(snap.to_json())
    again = NodeSnapshot.from_json(json.dumps(data))
    assert again.ip6tables == snap.ip6tables
    del data["ip6tables"]  # a snapshot written before the field existed
    assert NodeSnapshot.from_json(json.dumps(data)).ip6tables is None


# kube-proxy's IPVS mode on the IPv6 side of a dual-stack node (constructed: see
# tests/data/constructed/README.md)
IPVS6 = Path(__file__).parent / "data" / "constructed" / "ipvs6-dual-stack-kube-6-sets"


def test_ipvs_mode_ipv6_sets_and_virtual_servers() -> None:
    snap = _load(*((f.name, f.read_text()) for f in sorted(IPVS6.iterdir())),
                 ("sysctl.txt", "net.ipv4.conf.eth0.accept_local = 0\n"
                                "net.ipv4.conf.all.rp_filter = 1\n"))
    v = diagnose(snap, "n").to_dict("all")
    assert v["kube_proxy_mode"] == "ipvs"
    got = {(f["id"], f["lb_ip"]): f for f in v["findings"]}
    served = got[("pod-to-lb-captured", "2001:db8:ff::7")]
    assert any("IPVS virtual server TCP [2001:db8:ff::7]:80 (1 real servers)" in e
               for e in served["evidence"])
    # eTP=Local (KUBE-6-LOAD-BALANCER-LOCAL lists it) and no real server: health checks
    # fail here by design
    etp = got[("etp-local-no-local-endpoint", "2001:db8:ff::8")]
    assert any("has no real servers" in e for e in etp["evidence"])
    assert ("lb-ip-local", "2001:db8:ff::7") in got  # bound on kube-ipvs0, as IPVS does
    # the IPv6 fate, never the IPv4 martian one
    local = got[("lb-ip-local", "2001:db8:ff::7")]["evidence"]
    assert any("IPv6 has no martian-source check" in e for e in local)
    assert not any("sysctl" in e for e in local)
    # with the VIP not bound, IPVS does not take it: the pod's SYN leaves the node, marked
    # by KUBE-LOAD-BALANCER (KUBE-6-LOAD-BALANCER lists it) and masqueraded
    unbound = replace(snap, local_routes=tuple(r for r in snap.local_routes or ()
                                               if "ff::7" not in r.dst))
    f = _findings(unbound)
    assert ("pod-to-lb-captured", "2001:db8:ff::7") not in f
    masq = f[("pod-to-lb-masqueraded", "2001:db8:ff::7")]["evidence"]
    assert any("--match-set KUBE-6-LOAD-BALANCER dst,dst -j KUBE-LOAD-BALANCER" in e
               for e in masq)


def test_kube_proxys_ipv6_restore_input_is_told_by_its_addresses() -> None:
    """kube-proxy's own IPv6 restore input (realworld case): no header, bare addresses."""
    case = Path(__file__).parent / "data" / "realworld" / \
        "k8s-1.26era-iptables-ipv6-nodeport-restore-input" / "restore-input.txt"
    snap = _load(("restore-input.txt", case.read_text()))
    assert snap.netfilter is None and snap.ip6tables is not None
    nat = snap.ip6tables.table("nat")
    assert nat is not None and nat.chain("KUBE-SEP-LIGRYQQLSZN4UWQ5") is not None


def test_a_big_ipv6_chain_is_indexed_by_its_ipv6_destinations() -> None:
    """KUBE-SERVICES of 40 IPv6 Services is indexed by destination (-d addr/128) as an IPv4
    one is by -d addr/32: the walk reaches the LB IP's own rule, not a scan's guess."""
    from agent.netfilter.walk import _ChainIndex
    from lab.kube_proxy_rules import LbService, iptables_mode

    svcs = [LbService(namespace="default", name=f"s{i}", cluster_ip=f"fd00:96::{i + 1:x}",
                      lb_ip=f"2001:db8:ff::{i + 1:x}", node_port=30000 + i,
                      local_endpoints=(f"fd00:10:244:1::{i + 1:x}",)) for i in range(40)]
    text = iptables_mode(svcs, cluster_cidr="fd00:10:244::/56", node_ip="2001:db8:1::10",
                         family=6)
    snap = _load(("ip6tables-save.txt", text))
    chain = snap.ip6tables.table("nat").chain("KUBE-SERVICES")  # type: ignore[union-attr]
    index = _ChainIndex(chain)  # type: ignore[arg-type]
    assert "2001:db8:ff::27" in index.by_dst and "fd00:96::27" in index.by_dst
    got = _findings(snap)
    f = got[("pod-to-lb-captured", "2001:db8:ff::27")]
    assert any("--to-destination [fd00:10:244:1::27]:8080" in e for e in f["evidence"])
    assert sum(1 for k, _ in got if k == "pod-to-lb-captured") == 40


def test_an_undecided_ipv6_walk_names_the_ipv6_commands() -> None:
    """Only the KUBE-SERVICES excerpt: the unseen KUBE-FW chain decides, and the verdict
    names the ip6tables command that shows it."""
    chain = [ln for ln in V6.splitlines() if ln.startswith("-A KUBE-SERVICES ")]
    snap = _load(("paste.txt", "$ ip6tables -t nat -S KUBE-SERVICES\n" + "\n".join(chain)))
    f = _findings(snap)
    texts = [e for (fid, _), v in f.items() for e in (v["summary"], *v["evidence"])]
    assert any("ip6tables -t nat -S KUBE-" in t for t in texts), texts
    assert not any("`iptables -t nat" in t for t in texts)


def test_etp_local_walks_of_ipv6_name_the_ipv6_commands() -> None:
    # `ip6tables -t nat -S KUBE-SERVICES` alone: the load balancer's walk to an
    # eTP=Local NodePort meets KUBE-NODEPORTS, not in the excerpt; what shows it is
    # ip6tables, and the address is written [addr]:port
    chain = [ln for ln in V6.splitlines() if ln.startswith("-A KUBE-SERVICES ")]
    text = "$ sudo ip6tables -t nat -S KUBE-SERVICES\n" + "\n".join(chain) + "\n"
    v = diagnose(_load(("paste.txt", text),
                       ("services.json", kube_files()["services.json"])), "n").to_dict("all")
    said = [u["reason"] for u in v["unknowns"] if u["source"] == "etp-local-no-local-endpoint"]
    assert any(r.startswith("[2001:db8:ff::8]:80: ") for r in said), said
    assert any("`ip6tables -t nat -S KUBE-NODEPORTS`" in r for r in said), said
    assert not any("`iptables -t" in r for r in said), said


def test_a_dumps_family_is_told_by_its_rules_not_its_comments() -> None:
    # an IPv4 dump whose only IPv6-looking "-d" is inside a comment stays IPv4; an
    # IPv6 one told only by kube-proxy's KUBE-6- sets (IPVS mode) or a DNAT to [addr]
    # is IPv6; one with no address at all stays IPv4 (the default)
    v4 = ("*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n"
          '-A PREROUTING -m comment --comment "see -d fd00::1 in the docs" -j KUBE-SERVICES\n'
          "COMMIT\n")
    bare = "*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n"
    sets6 = ("-A KUBE-SERVICES -m set --match-set KUBE-6-LOAD-BALANCER dst,dst "
             "-j KUBE-LOAD-BALANCER\n")
    dnat6 = "-A KUBE-SEP-X -p tcp -m tcp -j DNAT --to-destination [fd00::5]:80\n"
    for text, six in ((v4, False), (bare, False), (sets6, True), (dnat6, True)):
        snap = _load(("paste.txt", text))
        assert (snap.ip6tables is not None, snap.netfilter is None) == (six, six), text


def test_a_node_without_ipv6_rules_says_what_it_could_not_read() -> None:
    # an empty ip6tables-save.txt (no IPv6 table: IPv6 disabled or unused): IPv6 LB IPs
    # are undecided with that reason, and no finding claims anything of their endpoints
    # (loc6 has a local endpoint; nothing in the input says otherwise); IPv4 unaffected
    files = kube_files()
    snap = _load(("iptables-save.txt", V4), ("ip6tables-save.txt", ""),
                 ("services.json", files["services.json"]), ("node.json", files["node.json"]))
    v = diagnose(snap, "n").to_dict("all")
    six = [f for f in v["findings"] if f["lb_ip"] and ":" in f["lb_ip"]]
    assert {f["id"] for f in six} == {"pod-to-lb-undetermined"}, six
    assert all("the IPv6 rules hold no table" in f["summary"] for f in six), six
    assert ("pod-to-lb-captured", "10.0.1.100") in {(f["id"], f["lb_ip"]) for f in v["findings"]}
    # ip6tables-save missing on a live node: its reason is in the finding
    missing = replace(_load(("iptables-save.txt", V4),
                            ("services.json", files["services.json"])),
                      ip6tables=None)
    missing = replace(missing, unknowns=(*missing.unknowns, Unknown(
        "ip6tables", "unavailable: no ip6tables-save binary (install iptables)")))
    f = _findings(missing)[("pod-to-lb-undetermined", "2001:db8:ff::7")]
    assert "no ip6tables-save binary" in f["summary"], f["summary"]


def test_what_the_ipv6_walk_assumed_is_in_the_verdict() -> None:
    # `ip6tables -t nat -S KUBE-SERVICES` alone: the IPv6 walk assumes kube-proxy's jump
    # from PREROUTING; the verdict and the text report say so, as they do for IPv4
    chain = [ln for ln in V6.splitlines() if ln.startswith("-A KUBE-SERVICES ")]
    text = "$ sudo ip6tables -t nat -S KUBE-SERVICES\n" + "\n".join(chain) + "\n"
    v = diagnose(_load(("paste.txt", text)), "n")
    assumed = v.to_dict()["context"]["assumed_rules"]
    assert "IPv6 rules: nat PREROUTING -> KUBE-SERVICES: assumed: kube-proxy's jump; the " \
           "excerpt does not show this chain" in assumed, assumed
    assert "IPv6 rules: nat PREROUTING -> KUBE-SERVICES" in render(v, width=200)


def test_an_ipv4_mapped_lb_ip_is_the_ipv4_one_kube_proxy_serves() -> None:
    # kube-proxy reads ::ffff:10.0.1.100 as IPv4 (GetIPFamilyFromIP: To4() != nil) and
    # writes its IPv4 rules for 10.0.1.100: the verdict walks that address, not an IPv6 one
    files = kube_files()
    svcs = files["services.json"].replace('"ip": "10.0.1.100"', '"ip": "::ffff:10.0.1.100"')
    assert "::ffff:10.0.1.100" in svcs
    snap = _load(("iptables-save.txt", V4), ("ip6tables-save.txt", V6), ("services.json", svcs))
    v = diagnose(snap, "n").to_dict("all")
    got = {(f["id"], f["lb_ip"]) for f in v["findings"]}
    assert ("pod-to-lb-captured", "10.0.1.100") in got, got
    assert not any(ip and ip.startswith("::ffff") for _, ip in got), got
    assert {r["ip"] for r in v["lb_ips"]} >= {"10.0.1.100"}
    assert not any(r["ip"].startswith("::ffff") for r in v["lb_ips"])


def test_an_ipv4_local_table_leaves_ipv6_lb_ips_local_unknown() -> None:
    # `ip route show table local` pasted (IPv4 only): the verdict's table of LB IPs says
    # "local?" for the IPv6 ones, not "not local"; the IPv4 one is decided
    local4 = ("local 10.0.0.10 dev eth0 proto kernel scope host src 10.0.0.10\n"
              "local 127.0.0.1 dev lo proto kernel scope host src 127.0.0.1\n")
    snap = _load(("iptables-save.txt", V4), ("ip6tables-save.txt", V6),
                 ("services.json", kube_files()["services.json"]), ("route-local.txt", local4))
    local = {r["ip"]: r["local"] for r in diagnose(snap, "n").to_dict("all")["lb_ips"]}
    assert local["10.0.1.100"] is False
    assert local["2001:db8:ff::7"] is None, local


def test_a_headerless_ip6tables_listing_is_ipv6() -> None:
    # `ip6tables -t nat -L KUBE-SERVICES -n` pasted without its prompt: IPv6 by its
    # "::/0" columns, or by its addresses where no column is a wildcard
    head = ("Chain KUBE-SERVICES (2 references)\n"
            "target     prot opt source               destination\n")
    lb = ("KUBE-EXT-X  tcp  --  fd00:10:244::/56      2001:db8:ff::7       "
          "/* default/web6:http loadbalancer IP */ tcp dpt:80\n")
    wild = ("KUBE-NODEPORTS  all  --  ::/0                 ::/0                 "
            "/* kubernetes service nodeports */ ADDRTYPE match dst-type LOCAL\n")
    for text in (head + lb + wild, head + lb):
        snap = _load(("paste.txt", text))
        assert snap.netfilter is None and snap.ip6tables is not None, text
        assert snap.ip6tables.table("nat").chain("KUBE-SERVICES") is not None  # type: ignore[union-attr]
    v4 = head + ("KUBE-EXT-Y  tcp  --  0.0.0.0/0            10.0.1.100           "
                 "/* default/web4:http loadbalancer IP */ tcp dpt:80\n")
    snap = _load(("paste.txt", v4))
    assert snap.netfilter is not None and snap.ip6tables is None


def test_an_ipv6_address_on_kube_ipvs0_inside_the_nodes_subnet_is_an_lb_ip() -> None:
    # as for IPv4 (MetalLB, internal LBs): service ranges lie apart from node subnets, so
    # a ULA on kube-ipvs0 inside eth0's IPv6 subnet is an LB or external IP; one outside
    # it (the service range's) is a ClusterIP
    addr = ("2: eth0: <BROADCAST,UP,LOWER_UP> mtu 1500 state UP\n"
            "    inet6 fd00:1::10/64 scope global\n"
            "7: kube-ipvs0: <BROADCAST,NOARP> mtu 1500 qdisc noop state DOWN\n"
            "    inet6 fd00:1::50/128 scope global\n"
            "    inet6 fd00:96::1/128 scope global\n")
    v = diagnose(_load(("addr.txt", addr)), "n").to_dict("all")
    assert {r["ip"] for r in v["lb_ips"]} == {"fd00:1::50"}, v["lb_ips"]
    assert v["status"] != "healthy"


def test_a_dump_without_its_completed_line_ends_where_its_lines_end() -> None:
    # an ip6tables-save pasted without its "# Completed" lines, then the IPv6 local table:
    # the table is read as routes (it was swallowed as "not an iptables rule line")
    cut = "\n".join(ln for ln in V6.splitlines() if not ln.startswith("# Completed"))
    route = ("$ ip -6 route show table local\n"
             "local ::1 dev lo proto kernel metric 0 pref medium\n"
             "local 2001:db8:1::10 dev eth0 proto kernel metric 0 pref medium\n")
    snap = _load(("paste.txt", cut + "\n" + route))
    assert snap.local_routes is not None and {r.dst for r in snap.local_routes} == \
        {"::1", "2001:db8:1::10"}
    whole = _load(("paste.txt", V6)).ip6tables
    assert snap.ip6tables is not None and whole is not None
    assert [r.text for t in snap.ip6tables.tables for c in t.chains for r in c.rules] == \
        [r.text for t in whole.tables for c in t.chains for r in c.rules]


def test_a_snat_with_the_nodes_address_unknown_is_undecided_not_a_loop() -> None:
    # the IPv6 local table given (so routing is decided) but no `ip addr`: the node's IPv6
    # address is unknown, so a CNI's SNAT of the pods to some address is not "not this
    # node's address" (it said: "..., which is not this node's address None": critical)
    files = kube_files()
    snat = "-A POSTROUTING -s fd00:10:244::/56 ! -d fd00:10:244::/56 -j SNAT " \
           "--to-source 2001:db8:1::10\n"
    v6 = V6.replace("-A POSTROUTING -m comment", snat + "-A POSTROUTING -m comment", 1)
    assert snat in v6
    local6 = ("local ::1 dev lo proto kernel metric 0 pref medium\n"
              "local 2001:db8:1::10 dev eth0 proto kernel metric 0 pref medium\n")
    snap = _load(("ip6tables-save.txt", v6), ("services.json", files["services.json"]),
                 ("node.json", files["node.json"]), ("route-local.txt", local6))
    got = _findings(snap)
    assert ("pod-to-lb-not-masqueraded", "2001:db8:ff::c") not in got, list(got)
    f = got[("pod-to-lb-undetermined", "2001:db8:ff::c")]
    assert "2001:db8:1::10" in f["summary"], f["summary"]


def test_ipv6_cluster_ips_on_kube_ipvs0_are_not_lb_ips() -> None:
    # a global IPv6 service range (no ULA): kube-proxy lists its IPv6 ClusterIPs in
    # KUBE-6-CLUSTER-IP, which says they are no LB IP (only KUBE-CLUSTER-IP was read)
    addr = ("7: kube-ipvs0: <BROADCAST,NOARP> mtu 1500 qdisc noop state DOWN\n"
            "    inet6 2600:1f00::5/128 scope global\n"
            "    inet6 2600:1f00:ff::7/128 scope global\n")
    sets = ("create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536\n"
            "add KUBE-6-CLUSTER-IP 2600:1f00::5,tcp:80\n")
    v = diagnose(_load(("addr.txt", addr), ("ipset.txt", sets)), "n").to_dict("all")
    assert {r["ip"] for r in v["lb_ips"]} == {"2600:1f00:ff::7"}, v["lb_ips"]


def test_ipv6_lb_ips_are_listed_in_address_order_after_ipv4() -> None:
    snap = _load(("iptables-save.txt", V4), ("ip6tables-save.txt", V6),
                 ("services.json", kube_files()["services.json"]))
    ips = [r["ip"] for r in diagnose(snap, "n").to_dict("all")["lb_ips"]]
    assert ips == ["10.0.1.100", *(f"2001:db8:ff::{x}" for x in "789abc")], ips


@pytest.mark.parametrize(("real_server", "no_local"), [
    ("[fd00:10:244:2::10]:8080", True),  # another node's pod: kubernetes#97081's fallback
    ("[fd00:10:244:1::11]:8080", False),  # a pod of this node
])
def test_ipvs_etp_local_counts_only_real_servers_on_this_node(real_server: str,
                                                             no_local: bool) -> None:
    # kube-proxy (1.21+) gives an eTP=Local virtual server the cluster's endpoints when
    # the node has none (so its own pods still reach the VIP): a real server elsewhere is
    # not a local endpoint, and the load balancer's health checks fail here
    files = {f.name: f.read_text() for f in sorted(IPVS6.iterdir())}
    files["ipvsadm.txt"] += f"  -> {real_server}     Masq    1      0          0\n"
    # which pods are this node's: its podCIDRs (the rules name only the cluster's /56)
    files["node.json"] = json.dumps({"kind": "Node", "apiVersion": "v1",
                                     "metadata": {"name": "n"},
                                     "spec": {"podCIDRs": ["10.244.1.0/24",
                                                           "fd00:10:244:1::/64"]}})
    snap = _load(*files.items(), ("sysctl.txt", "net.ipv4.conf.all.rp_filter = 1\n"))
    v = diagnose(snap, "n").to_dict("all")
    assert v["context"]["pod_network6"] == "fd00:10:244:1::/64"
    got = {(f["id"], f["lb_ip"]): f for f in v["findings"]}
    etp = got.get(("etp-local-no-local-endpoint", "2001:db8:ff::8"))
    assert (etp is not None) == no_local, v["findings"]
    if etp:
        assert any(real_server.split("]")[0][1:] in e and "none in this node's pod network "
                   "fd00:10:244:1::/64" in e for e in etp["evidence"]), etp["evidence"]
