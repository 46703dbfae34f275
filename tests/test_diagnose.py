"""diagnose() on snapshots: pure rules, severities, remedies, service mapping."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agent.bundle import load_bundle
from agent.diagnose import diagnose
from agent.diagnose.lb_ip import chain_hash, infer_service, service_of_chains
from agent.snapshot import (
    Address,
    Ingress,
    IngressBackend,
    LoadBalancerIngress,
    LocalRoute,
    NodeSnapshot,
)

TKE = Path(__file__).parent / "data" / "bundles" / "tke-etp-local"


@pytest.fixture(scope="module")
def tke() -> NodeSnapshot:
    return load_bundle(TKE)


def findings(snap: NodeSnapshot) -> dict[tuple[str, str | None], dict]:
    v = diagnose(snap, "n").to_dict("all")
    return {(f["id"], f["lb_ip"]): f for f in v["findings"]}


@pytest.mark.parametrize(("name", "expected"), [
    # kube-proxy's own test vectors (pkg/proxy/iptables/proxier_test.go)
    ("ns1/svc1:p80", "XPGD46QRK7WJZT7O"),
    ("ns2/svc2:p80", "GNZBNJ2PO5MGZ6GT"),
    ("ns5/svc5:p80", "NUKIZ6OKUXPJNT4C"),
])
def test_chain_hash_is_kube_proxys(name: str, expected: str) -> None:
    assert chain_hash(name, "TCP") == expected


def test_service_from_comment_then_from_chain_hash(tke: NodeSnapshot) -> None:
    hashed = service_of_chains(tke)
    h = chain_hash("default/web:http", "TCP")
    assert hashed[f"KUBE-EXT-{h}"] == "default/web"
    assert infer_service((f"nat KUBE-SERVICES: -A KUBE-SERVICES -j KUBE-EXT-{h}",),
                         hashed) == "default/web"
    assert infer_service(('nat X: -A X -m comment --comment "pod traffic for ns1/svc1:p80 '
                          'external destinations" -j KUBE-SVC-AAAAAAAAAAAAAAAA',), {}) == "ns1/svc1"
    assert infer_service(('-A X -m comment --comment "Kubernetes service lb portal"',), {}) is None


TKE_ANNOTATION = {"service.kubernetes.io/qcloud-loadbalancer-internal-subnetid": "subnet-1"}


def test_lb_ip_bound_locally_is_critical_with_route_as_evidence(tke: NodeSnapshot) -> None:
    services = tuple(replace(s, annotations=TKE_ANNOTATION) for s in tke.services or ())
    snap = replace(
        tke, services=services,
        addresses=(*(tke.addresses or ()), Address("kube-ipvs0", "10.0.1.100", 32, "global",
                                                   False)),
        local_routes=(*(tke.local_routes or ()), LocalRoute(
            "local", "10.0.1.100", "kube-ipvs0", "10.0.1.100",
            "local 10.0.1.100 dev kube-ipvs0 proto kernel scope host src 10.0.1.100")))
    got = findings(snap)
    f = got[("lb-ip-local", "10.0.1.100")]
    assert f["severity"] == "critical" and f["service"] == "default/web"
    assert f["evidence"][0] == ("local table: local 10.0.1.100 dev kube-ipvs0 proto kernel "
                                "scope host src 10.0.1.100")
    assert any("interface DOWN" in e for e in f["evidence"])
    assert any("accept_local = 0" in e for e in f["evidence"])
    assert "prevent-loopback" in f["remedy"]
    # bound now: the pod's packet is served inside the node, no loop through the CLB
    assert ("pod-to-lb-captured", "10.0.1.100") in got
    assert ("pod-to-lb-not-masqueraded", "10.0.1.100") not in got


def test_prevent_loopback_annotation_makes_the_bound_vip_expected(tke: NodeSnapshot) -> None:
    services = tuple(
        replace(s, annotations={"service.cloud.tencent.com/prevent-loopback": "true"})
        if s.name == "web" else s for s in tke.services or ())
    snap = replace(
        tke, services=services,
        local_routes=(*(tke.local_routes or ()), LocalRoute(
            "local", "10.0.1.100", "kube-ipvs0", "10.0.1.100", "local 10.0.1.100 dev kube-ipvs0")))
    v = diagnose(snap, "n").to_dict("all")
    f = next(f for f in v["findings"] if f["id"] == "lb-ip-local")
    assert f["severity"] == "info" and "100.64.0.0/10" in f["summary"]
    assert v["status"] == "healthy"


def test_ip_mode_proxy_but_bound_points_at_kube_proxy_version(tke: NodeSnapshot) -> None:
    services = tuple(
        replace(s, lb_ingress=(LoadBalancerIngress(ip="10.0.1.100", ip_mode="Proxy"),))
        if s.name == "web" else s for s in tke.services or ())
    snap = replace(tke, services=services, local_routes=(*(tke.local_routes or ()), LocalRoute(
        "local", "10.0.1.100", "kube-ipvs0", "10.0.1.100", "local 10.0.1.100 dev kube-ipvs0")))
    f = findings(snap)[("lb-ip-local", "10.0.1.100")]
    assert "ipMode" in f["remedy"] and "1.30" in f["remedy"]


def test_ingress_address_loop_names_dns_and_coredns(tke: NodeSnapshot) -> None:
    snap = replace(tke, ingresses=(Ingress(
        "shop", "front", ips=("10.0.2.50",),
        backends=(IngressBackend("shop/front-svc", 80),)),))
    f = findings(snap)[("pod-to-lb-not-masqueraded", "10.0.2.50")]
    assert f["service"] == "shop/front-svc"
    assert "front-svc.shop.svc.cluster.local" in f["remedy"] and "CoreDNS" in f["remedy"]
    assert "Ingress shop/front" in f["summary"]


def _without_cni0(tke: NodeSnapshot) -> NodeSnapshot:
    return replace(tke, addresses=tuple(a for a in tke.addresses or () if a.ifname != "cni0"),
                   local_routes=tuple(r for r in tke.local_routes or () if r.dev != "cni0"))


def test_pod_cidr_named_by_the_rules_when_no_bridge(tke: NodeSnapshot) -> None:
    """No podCIDR, no pod bridge: kube-proxy's own `! -s CIDR -j KUBE-MARK-MASQ` names
    the pod network, and the walk decides from it."""
    v = diagnose(_without_cni0(tke), "n").to_dict("all")
    assert v["context"]["pod_network"] == "172.16.0.0/16"
    assert ("pod-to-lb-not-masqueraded", "10.0.1.100") in {(f["id"], f["lb_ip"])
                                                          for f in v["findings"]}
    loop = next(f for f in v["findings"] if f["id"] == "pod-to-lb-not-masqueraded")
    assert any("kube-proxy's rules name" in e for e in loop["evidence"])


def test_no_pod_network_is_undetermined_not_healthy(tke: NodeSnapshot) -> None:
    snap = _without_cni0(tke)
    nat = snap.netfilter.table("nat") if snap.netfilter else None
    assert nat is not None and snap.netfilter is not None
    chains = tuple(replace(c, rules=tuple(r for r in c.rules if "-s 172.16." not in r.text))
                   for c in nat.chains)
    tables = tuple(replace(t, chains=chains) if t.name == "nat" else t
                   for t in snap.netfilter.tables)
    snap = replace(snap, netfilter=replace(snap.netfilter, tables=tables))
    v = diagnose(snap, "n").to_dict("all")
    assert v["status"] == "unknown"  # only an undecided path: not at risk, not healthy
    got = {(f["id"], f["lb_ip"]): f for f in v["findings"]}
    # eTP=Local: whether the pod is masqueraded depends on its address: undecided, and
    # the verdict names the one fact that decides it
    undecided = got[("pod-to-lb-undetermined", "10.0.1.100")]
    assert "pod CIDR" in undecided["summary"] and "--pod-cidr" in undecided["summary"]
    assert undecided["summary"].count("pod CIDR") == 1
    # eTP=Cluster: KUBE-LOAD-BALANCER marks every source for masquerade: decided all the
    # same, and the evidence says it was decided without the pod's address
    masq = got[("pod-to-lb-masqueraded", "10.0.1.101")]
    assert any("either way" in e and "pod CIDR" in e for e in masq["evidence"])
    assert set(got) == {("pod-to-lb-undetermined", "10.0.1.100"),
                        ("pod-to-lb-masqueraded", "10.0.1.101")}


def test_node_pod_cidr_wins_over_bridge_guess(tke: NodeSnapshot) -> None:
    from agent.snapshot import NodeInfo

    snap = replace(tke, node_info=NodeInfo("n", pod_cidrs=("172.16.1.0/24",),
                                           internal_ips=("10.0.0.10",)))
    v = diagnose(snap, "n").to_dict("all")
    assert v["context"]["pod_network"] == "172.16.1.0/24"
    assert v["context"]["pod_interface"] == "cni0"
    assert v["context"]["uplink"] == "eth0"


def test_no_rules_at_all_is_undetermined(tke: NodeSnapshot) -> None:
    v = diagnose(replace(tke, netfilter=None), "n").to_dict("all")
    assert {f["id"] for f in v["findings"]} == {"pod-to-lb-undetermined"}


def test_observed_loopback_and_dropped_health_checks_set_status_loopback(
        tke: NodeSnapshot) -> None:
    from agent.capture.model import (
        BYPASSED,
        SRC_LOCAL,
        SRC_OTHER,
        SRC_POD,
        UNANSWERED,
        CaptureResult,
        Corroboration,
        HandshakeSample,
        NodePortStats,
    )

    port = NodePortStats(
        30080, syns=9,
        counts={BYPASSED: {SRC_POD: 4}, UNANSWERED: {SRC_LOCAL: 3, SRC_OTHER: 2}},
        samples=(
            HandshakeSample("172.16.1.2", 40000, "10.0.0.10", 30080, "eth0", BYPASSED,
                            SRC_POD, reply_iface="cni0", peer_reset=True),
            HandshakeSample("10.0.1.100", 41000, "10.0.0.10", 30080, "eth0", UNANSWERED,
                            SRC_LOCAL),
        ))
    cap = CaptureResult(30.0, (30000, 32767), ports=(port,), kernel_drops=7,
                        kernel_packets=100, corroboration=(
                            Corroboration("in_martian_src", True, 3, "global counter"),))
    v = diagnose(tke, "n", capture=cap).to_dict("all")
    assert v["status"] == "loopback"
    by_id = {f["id"]: f for f in v["findings"]}
    loop = by_id["loopback-observed"]
    assert loop["port"] == 30080 and loop["service"] == "default/web"
    assert loop["lb_ip"] == "10.0.1.100"
    assert any("left through cni0" in e and "client reset" in e for e in loop["evidence"])
    hc = by_id["healthcheck-dropped-local-source"]
    assert "3 SYNs" in hc["summary"]
    assert "in_martian_src: 3 (global counter)" in hc["evidence"]
    assert by_id["nodeport-syn-unanswered"]["severity"] == "warning"
    assert any("kernel dropped 7" in u["reason"] for u in v["unknowns"])
    assert v["capture"]["syns"] == 9


def test_capture_with_only_answered_handshakes_adds_nothing(tke: NodeSnapshot) -> None:
    from agent.capture.model import ANSWERED, SRC_OTHER, CaptureResult, NodePortStats

    cap = CaptureResult(10.0, (30000, 32767), ports=(
        NodePortStats(30080, syns=5, counts={ANSWERED: {SRC_OTHER: 5}}),))
    v = diagnose(tke, "n", capture=cap).to_dict("all")
    assert v["status"] == "at-risk"  # the static finding stays; nothing observed
    assert not {"loopback-observed", "nodeport-syn-unanswered"} & {f["id"] for f in v["findings"]}


def test_lb_ip_bound_without_tke_evidence_is_a_conditional_warning(tke: NodeSnapshot) -> None:
    snap = replace(tke, local_routes=(*(tke.local_routes or ()), LocalRoute(
        "local", "10.0.1.100", "kube-ipvs0", "10.0.1.100", "local 10.0.1.100 dev kube-ipvs0")))
    f = findings(snap)[("lb-ip-local", "10.0.1.100")]
    assert f["severity"] == "warning" and f["summary"].count("if the load balancer") == 1
    assert "prevent-loopback" not in f["remedy"] and "ipMode: Proxy" in f["remedy"]


def test_external_ip_bound_on_the_node_is_not_a_health_check_problem(
        tke: NodeSnapshot) -> None:
    services = tuple(replace(s, external_ips=("10.0.0.10",)) if s.name == "api" else s
                     for s in tke.services or ())
    got = findings(replace(tke, services=services))
    assert ("lb-ip-local", "10.0.0.10") not in got


def test_ipv6_undecided_and_bad_addresses_listed_not_walked(tke: NodeSnapshot) -> None:
    services = tuple(
        replace(s, lb_ingress=(*s.lb_ingress, LoadBalancerIngress(ip="2001:db8::100"),
                               LoadBalancerIngress(ip="10.0.1.300")))
        if s.name == "web" else s for s in tke.services or ())
    v = diagnose(replace(tke, services=services), "n").to_dict("all")
    assert not [f for f in v["findings"] if f["lb_ip"] == "10.0.1.300"]
    reasons = " ".join(u["reason"] for u in v["unknowns"] if u["source"] == "LB IPs")
    assert "'10.0.1.300'" in reasons and "not an IP address" in reasons
    # an IPv6 LB IP is not walked: undecided (never silently healthy), and listed
    v6 = [f for f in v["findings"] if f["lb_ip"] == "2001:db8::100"]
    # (and, an IPv6 address on an IPv4-only node, kubernetes#80297 for a kube-proxy whose
    # version the bundle does not say)
    assert [(f["id"], (f.get("data") or {}).get("bug")) for f in v6] == [
        ("pod-to-lb-undetermined", None), ("kube-proxy-known-bug", "kubernetes#80297")]
    assert any("ip6tables-save" in e for e in v6[0]["evidence"])
    assert "2001:db8::100" in {r["ip"] for r in v["lb_ips"]}


def test_snat_to_another_address_is_not_the_nodes_masquerade(tke: NodeSnapshot) -> None:
    from agent.netfilter.rules_text import parse_iptables_save

    text = (TKE / "iptables-save.txt").read_text().replace(
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\"",
        "-A POSTROUTING -s 172.16.0.0/16 ! -d 172.16.0.0/16 -j SNAT --to-source 10.0.0.99\n"
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\"")
    got = findings(replace(tke, netfilter=parse_iptables_save(text)))
    f = got[("pod-to-lb-not-masqueraded", "10.0.1.101")]
    assert any("SNATed to 10.0.0.99" in e for e in f["evidence"])


def test_real_dump_missing_kube_proxy_hooks_is_not_patched_up(tke: NodeSnapshot) -> None:
    from agent.netfilter.rules_text import parse_iptables_save

    text = "\n".join(line for line in (TKE / "iptables-save.txt").read_text().splitlines()
                     if not line.startswith(("-A PREROUTING", "-A OUTPUT")))
    nf = parse_iptables_save(text)
    assert nf.backend == "nft"  # it has the iptables-save header
    v = diagnose(replace(tke, netfilter=nf), "n").to_dict("all")
    assert v["context"]["assumed_rules"] == []
    # nothing reaches KUBE-SERVICES, so eTP=Cluster is no longer marked for masquerade
    assert ("pod-to-lb-not-masqueraded", "10.0.1.101") in {
        (f["id"], f["lb_ip"]) for f in v["findings"]}


def test_no_kube_proxy_rules_is_undetermined(tke: NodeSnapshot) -> None:
    from agent.netfilter.rules_text import parse_iptables_save

    nf = parse_iptables_save("# Generated by iptables-nft-save v1.8.9 (nf_tables)\n*nat\n"
                             ":PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n")
    snap = replace(tke, netfilter=nf, ipsets=())
    v = diagnose(snap, "n").to_dict("all")
    assert {f["id"] for f in v["findings"]} == {"pod-to-lb-undetermined"}
    assert "nftables mode" in v["findings"][0]["summary"]


def test_a_malformed_value_in_one_rule_is_undetermined_not_healthy(tke: NodeSnapshot) -> None:
    from agent.netfilter.rules_text import parse_iptables_save

    text = (TKE / "iptables-save.txt").read_text().replace(
        "-A PREROUTING -m comment",
        "-A PREROUTING -m mark --mark 0x10000/0xZZ -j ACCEPT\n-A PREROUTING -m comment")
    v = diagnose(replace(tke, netfilter=parse_iptables_save(text)), "n").to_dict("all")
    assert v["status"] == "unknown"
    und = [f for f in v["findings"] if f["id"] == "pod-to-lb-undetermined"]
    assert und and "0xZZ" in und[0]["summary"]


def test_lb_ips_unknown_without_service_objects(tke: NodeSnapshot) -> None:
    v = diagnose(replace(tke, services=None, ipsets=()), "n").to_dict("all")
    assert "lb-ips-unknown" in {f["id"] for f in v["findings"]}
    assert v["status"] == "unknown"


def test_sources_that_disagree_are_named(tke: NodeSnapshot) -> None:
    """The Service says Cluster, kube-proxy's KUBE-LOAD-BALANCER-LOCAL lists the IP
    (Local): the verdict follows the first source and says they disagree."""
    services = tuple(replace(s, external_traffic_policy="Cluster") for s in tke.services or ())
    f = findings(replace(tke, services=services))[("pod-to-lb-not-masqueraded", "10.0.1.100")]
    (line,) = [e for e in f["evidence"] if e.startswith("sources disagree")]
    assert "Cluster (Service spec) vs Local (ipset KUBE-LOAD-BALANCER-LOCAL lists" in line
    assert any(e.startswith("learned from Service default/web") for e in f["evidence"])


def test_typed_verdict_round_trips_through_its_document(tke: NodeSnapshot) -> None:
    """Readers take the typed verdict; the collector stores the document; the demo renders
    what the collector stored: the document must come back as the same verdict."""
    from agent.capture.model import CaptureResult, Corroboration, NodePortStats
    from agent.diagnose.model import Verdict
    from agent.report import render

    cap = CaptureResult(5.0, (30000, 32767),
                        (NodePortStats(30080, syns=3, counts={"bypassed": {"pod": 3}}),),
                        kernel_packets=9, corroboration=(Corroboration("in_martian_src",
                                                                       True, 2, "delta"),))
    v = diagnose(tke, "n", capture=cap)
    doc = v.to_dict("all")
    back = Verdict.from_dict(doc)
    assert back.to_dict("all") == doc
    assert render(back) == render(v)
    assert back.change_key() == v.change_key()


def test_tke_remedy_for_a_bound_vip_says_what_its_family_does_with_the_checks() -> None:
    from agent.diagnose.lb_ip import LbTarget
    from agent.diagnose.remedies import for_lb_ip_local

    def remedy(ip: str) -> str:
        return for_lb_ip_local(LbTarget(
            ip, 80, "TCP", "loadbalancer", "default/web", ("services.json",),
            annotations=(("service.kubernetes.io/qcloud-loadbalancer-internal-subnetid",
                          "subnet-1"),)))

    # IPv4 drops a check from its own VIP as martian; on IPv6 the node (to lo) or the pod
    # behind the NodePort answers it and the answer never leaves the node
    assert "dropped as martian source" in remedy("10.0.1.100")
    v6 = remedy("2001:db8::7")
    assert "martian" not in v6 and "the answer stays (IPv6)" in v6


def test_a_masquerade_without_the_nodes_addresses_names_no_none(tke: NodeSnapshot) -> None:
    """Without `ip addr` the node's address and uplink are unknown: the MASQUERADE that
    decides 10.0.1.101 was worded "leaves None with the node's address None" (seen on a
    real pasted IPVS case too: blog-ssup2)."""
    snap = replace(tke, addresses=None)
    got = findings(snap)
    masq = got[("pod-to-lb-masqueraded", "10.0.1.101")]
    said = " ".join([masq["summary"], *masq["evidence"]])
    assert "None" not in said, said
    assert "leaves (uplink unknown) with the node's address (not in the input: `ip addr` " \
        "shows it) (MASQUERADE)" in said, said
