"""Real connections through the lab's CLB: what the kernel does in each loopback case.

Each cluster (lab.clb.build_cluster) is built once per module and shared; tests
that change a node's sysctls put them back (``sysctls``). The assertions are the
kernel behaviours issue 4 relies on, measured with the packet recorder ``sniff`` (SYN,
SYN-ACK and RST per interface and direction inside the node) and the kernel counters.

Tests marked ``netns`` need root and build network namespaces; the rest are pure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.capture.corroborate import parse_netstat, parse_rt_cache
from lab.clb import (
    CONNECTED,
    RESET,
    TIMEOUT,
    Clb,
    Cluster,
    Listener,
    build_cluster,
    healthcheck,
    listeners_of,
    other_node_pod_connect,
    pod_connect,
    serve,
    sniff,
    sysctls,
)
from lab.netns import Netns
from lab.node import ipvs_standin_nft
from lab.scenarios import HEALTH_CHECK_SOURCE, INGRESS_IP, LB_IP, SCENARIOS, on_node

_HAVE_TOOLS = all(shutil.which(t) for t in ("ip", "ipset", "nft", "iptables-legacy-restore",
                                             "iptables-nft-restore"))
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not _HAVE_TOOLS,
                                reason="needs root, ip, ipset, nft and both iptables backends")

NODE_PORT = 30080  # demo/web in every scenario
DROP_WAIT = 1.0  # how long a dropped handshake is given: replies here take < 10 ms
LOOSE_RP = {"net.ipv4.conf.all.rp_filter": 0, "net.ipv4.conf.eth0.rp_filter": 0}


def _martians() -> int:
    return parse_rt_cache(Path("/proc/net/stat/rt_cache").read_text())["in_martian_src"]


def _rp_filter_drops(ns: Netns) -> int:
    return parse_netstat(ns.run("cat", "/proc/net/netstat").stdout)["TcpExtIPReversePathFilter"]


def _pod_bridge(ns: Netns, bridge: str = "cni0") -> set[str]:
    """The pod bridge and its ports: a reply to a pod is seen on the port only when it
    is bridged from a local endpoint, on cni0 too when the node routed it there."""
    out = ns.run("ip", "-o", "link", "show", "master", bridge).stdout
    return {bridge} | {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _ns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# --- pure -----------------------------------------------------------------------------


def test_clb_never_picks_a_real_server_equal_to_the_source() -> None:
    clb = Clb(Netns("unused"), [Listener("10.0.1.10", 80, 30080, "demo/web")],
              ("10.0.0.10", "10.0.0.11"))
    rules = clb.rules()
    assert "-A CLB-0 ! -s 10.0.0.10/32 -p tcp -j DNAT --to-destination 10.0.0.10:30080" in rules
    assert "-A CLB-0 ! -s 10.0.0.11/32 -p tcp -j DNAT --to-destination 10.0.0.11:30080" in rules
    assert rules.index("10.0.0.10:30080") < rules.index("10.0.0.11:30080")
    assert "SNAT" not in rules and "MASQUERADE" not in rules
    with pytest.raises(ValueError, match="not a real server"):
        clb.use_real_server("10.0.0.99")


def test_listeners_cover_lb_ips_and_ingresses() -> None:
    got = {(x.vip, x.port, x.node_port) for x in listeners_of(SCENARIOS["ip-masq-agent-ingress"])}
    assert got == {("10.0.1.20", 80, 30080), (INGRESS_IP, 80, 30081)}


def test_node2_sees_the_same_cluster_from_its_side() -> None:
    sc = on_node(SCENARIOS["tke-ipvs-etp-local"])
    web = next(s for s in sc.services if s.name == "web")
    assert web.local_endpoints == ("172.16.2.10",)
    assert set(web.remote_endpoints) == {"172.16.1.10", "172.16.3.10"}
    state = sc.ipvs_state()
    assert state is not None and "-A -t 10.0.0.11:30080 " in state.ipvsadm_save
    assert sc.expect == {}


def test_ipvs_standin_only_takes_local_destinations() -> None:
    state = SCENARIOS["tke-ipvs-etp-local"].ipvs_state()
    assert state is not None
    text = ipvs_standin_nft(state.ipvsadm_save)
    assert "fib daddr type local" in text  # an unbound LB IP is not IPVS's business
    assert "10.0.0.10 . 30080 : jump" in text
    # eTP=Local: the NodePort goes to the local endpoint only
    assert "mod 1 map { 0 : 172.16.1.10 . 8080 }" in text


# --- the kernel, case by case ------------------------------------------------------------


@pytest.mark.netns
@needs_root
def test_same_node_pod_loop_rp_filter_1_drops_the_syn(etp_local: Cluster) -> None:
    """The CLB sends the pod's SYN back to its own node, source = the pod IP: strict
    reverse-path filtering drops it on eth0 (the pod is reached through cni0), counted
    as IPReversePathFilter (and as in_martian_src): no SYN-ACK at all."""
    c = etp_local
    sc = c.scenario
    c.clb.use_real_server(sc.node_ip)
    rp0, m0 = _rp_filter_drops(c.node), _martians()
    with sniff(c.node) as seen:
        r = pod_connect(c, LB_IP, 80, timeout=DROP_WAIT)
    assert r.outcome == TIMEOUT, r
    assert c.clb.picks()[sc.node_ip] == 1
    syns = seen.find("SYN", iface="eth0", direction="in", src=sc.client_pod_ip,
                     dst=sc.node_ip, dport=NODE_PORT)
    assert syns, seen  # arrived un-SNATed: the CLB keeps the client's address
    assert not seen.find("SYN-ACK"), seen
    assert not seen.find(dst="172.16.1.10"), seen  # never reached the endpoint
    assert _rp_filter_drops(c.node) - rp0 >= len(syns)
    assert _martians() - m0 >= len(syns)  # global counter: others may add, never less


@pytest.mark.netns
@needs_root
def test_same_node_pod_loop_rp_filter_0_reply_bypasses_the_clb(etp_local: Cluster) -> None:
    """rp_filter=0: the node takes the SYN and answers, but its SYN-ACK (NodeIP:NodePort
    after conntrack) goes out through a cni0 port straight to the pod, bypassing the
    CLB; the pod expected VIP:80 and resets it. Nothing is dropped; no handshake."""
    c = etp_local
    sc = c.scenario
    c.clb.use_real_server(sc.node_ip)
    rp0 = _rp_filter_drops(c.node)
    with sysctls(c.node, LOOSE_RP), sniff(c.node) as seen:
        r = pod_connect(c, LB_IP, 80, timeout=DROP_WAIT)
    assert r.outcome == TIMEOUT, r
    assert seen.find("SYN", iface="eth0", direction="in", src=sc.client_pod_ip,
                     sport=r.sport, dport=NODE_PORT), seen
    synacks = seen.find("SYN-ACK", direction="out", src=sc.node_ip, sport=NODE_PORT,
                        dst=sc.client_pod_ip, dport=r.sport)
    assert synacks, seen
    assert {s.iface for s in synacks} <= _pod_bridge(c.node)  # vethpod0, a cni0 port
    # never back out through the uplink, i.e. the CLB
    assert not seen.find("SYN-ACK", iface="eth0", direction="out"), seen
    assert seen.find("RST", direction="in", src=sc.client_pod_ip, sport=r.sport,
                     dst=sc.node_ip, dport=NODE_PORT), seen
    assert _rp_filter_drops(c.node) == rp0


@pytest.mark.netns
@needs_root
def test_pod_on_another_node_completes(etp_local: Cluster) -> None:
    c = etp_local
    c.clb.use_real_server(c.scenario.node_ip)
    r = other_node_pod_connect(c, LB_IP, 80)
    assert r.outcome == CONNECTED, r
    # served by node 1's local endpoint, which saw node 2's pod: nobody SNATed
    assert r.endpoint == "172.16.1.10"
    assert r.seen_source == c.node2_scenario.client_pod_ip
    assert c.clb.picks()[c.scenario.node_ip] == 1


@pytest.mark.netns
@needs_root
def test_healthcheck_from_a_non_local_vip_is_healthy(etp_local: Cluster) -> None:
    """TKE's variant does not bind the VIP: the CLB's health check sourced from it is
    an ordinary remote source for the node."""
    c = etp_local
    r = healthcheck(c, c.scenario.node_ip, NODE_PORT)
    assert r.outcome == CONNECTED, r
    assert r.src == LB_IP and r.seen_source == LB_IP


@pytest.mark.netns
@needs_root
def test_healthcheck_from_a_vip_bound_on_kube_ipvs0_is_dropped_as_martian(
        lb_bound: Cluster) -> None:
    """The SYN's source is local (table local, via kube-ipvs0): dropped on arrival,
    in_martian_src rises, and it is not a reverse-path drop."""
    c = lb_bound
    sc = c.scenario
    rp0, m0 = _rp_filter_drops(c.node), _martians()
    with sniff(c.node) as seen:
        r = healthcheck(c, sc.node_ip, NODE_PORT, timeout=DROP_WAIT)
    assert r.outcome == TIMEOUT, r
    syns = seen.find("SYN", iface="eth0", direction="in", src=LB_IP, dport=NODE_PORT)
    assert syns and seen.segments == syns, seen  # nothing else happened
    assert _martians() - m0 >= len(syns)
    assert _rp_filter_drops(c.node) == rp0


@pytest.mark.netns
@needs_root
def test_accept_local_with_strict_rp_filter_still_drops(lb_bound: Cluster) -> None:
    """accept_local=1 lets a local source through the martian check, but the reverse
    path of the VIP is kube-ipvs0, not eth0: strict rp_filter drops it instead."""
    c = lb_bound
    rp0 = _rp_filter_drops(c.node)
    with sysctls(c.node, {"net.ipv4.conf.all.accept_local": 1}), sniff(c.node) as seen:
        r = healthcheck(c, c.scenario.node_ip, NODE_PORT, timeout=DROP_WAIT)
    assert r.outcome == TIMEOUT, r
    syns = seen.find("SYN", iface="eth0", direction="in", src=LB_IP)
    assert syns and seen.segments == syns, seen
    assert _rp_filter_drops(c.node) - rp0 >= len(syns)


@pytest.mark.netns
@needs_root
def test_accept_local_answers_but_the_syn_ack_to_the_vip_stays_on_the_node(
        lb_bound: Cluster) -> None:
    """accept_local=1 and rp_filter=0: the node takes the SYN, but its answer is
    addressed to the VIP, a local address: routed to lo, never out of eth0."""
    c = lb_bound
    sc = c.scenario
    loose = {**LOOSE_RP, "net.ipv4.conf.all.accept_local": 1}
    route = c.node.run("ip", "route", "get", LB_IP, "from", sc.node_ip).stdout
    assert route.startswith(f"local {LB_IP} ") and " dev lo " in route, route
    # A listener on the node itself (hostNetwork, or kube-proxy's healthCheckNodePort):
    # the node's own SYN-ACK is seen leaving through lo.
    with sysctls(c.node, loose), serve(c.node, [31999]), sniff(c.node) as seen:
        r = healthcheck(c, sc.node_ip, 31999, timeout=DROP_WAIT)
    assert r.outcome == TIMEOUT, r
    synacks = seen.find("SYN-ACK", src=sc.node_ip, sport=31999, dst=LB_IP)
    assert synacks and {s.iface for s in synacks} == {"lo"}, seen
    assert not seen.find(iface="eth0", direction="out"), seen
    # The NodePort (IPVS NATs it to an endpoint): the endpoint's SYN-ACK comes back,
    # is un-NATed to NodeIP:NodePort -> VIP and delivered locally; no SYN-ACK from the
    # NodePort leaves the node, and the node's own stack resets the endpoint.
    with sysctls(c.node, loose), sniff(c.node) as seen:
        r = healthcheck(c, sc.node_ip, NODE_PORT, timeout=DROP_WAIT)
    assert r.outcome == TIMEOUT, r
    assert seen.find("SYN", iface="eth0", direction="in", src=LB_IP, dport=NODE_PORT)
    assert not seen.find("SYN-ACK", sport=NODE_PORT), seen
    assert not seen.find("SYN-ACK", iface="eth0", direction="out", dst=LB_IP), seen


@pytest.mark.netns
@needs_root
def test_healthcheck_from_100_64_is_healthy_although_the_vip_is_bound(
        lb_bound: Cluster) -> None:
    """TKE's fix: health checks from 100.64.0.0/10, a source that is not local."""
    c = lb_bound
    for _ in range(3):  # round robin over all three endpoints of the NodePort
        r = healthcheck(c, c.scenario.node_ip, NODE_PORT, source=HEALTH_CHECK_SOURCE)
        assert r.outcome == CONNECTED, r
    # and a port nobody serves is refused at once, not dropped
    r = healthcheck(c, c.scenario.node_ip, 31998, source=HEALTH_CHECK_SOURCE)
    assert r.outcome == RESET and r.seconds < 0.5, r


@pytest.mark.netns
@needs_root
def test_etp_cluster_masquerade_makes_the_clb_pick_the_other_node() -> None:
    """eTP=Cluster: kube-proxy masquerades pod -> VIP to the node IP; the CLB, told to
    prefer this node, skips it (source = real server) and picks node 2."""
    sc = SCENARIOS["tke-ipvs-etp-cluster"]
    with build_cluster(sc, "nft", real_server=sc.node_ip) as c:
        with sniff(c.node) as seen:
            r = pod_connect(c, LB_IP, 80)
        assert r.outcome == CONNECTED, r
        assert seen.find("SYN", iface="eth0", direction="out", src=sc.node_ip, dst=LB_IP), seen
        assert c.clb.picks() == {sc.node_ip: 0, c.node2_scenario.node_ip: 1}
        assert r.seen_source != sc.client_pod_ip


@pytest.mark.netns
@needs_root
def test_iptables_mode_ingress_loop_and_other_node() -> None:
    """iptables mode (kube-proxy's own NodePort DNAT, legacy backend): the Ingress
    address is not captured or masqueraded, so the same loop happens on NodePort 30081;
    node 2's pod gets through."""
    sc = SCENARIOS["ip-masq-agent-ingress"]
    with build_cluster(sc, "legacy") as c:
        with sysctls(c.node, LOOSE_RP), sniff(c.node) as seen:
            r = pod_connect(c, INGRESS_IP, 80, timeout=DROP_WAIT)
        assert r.outcome == TIMEOUT, r
        synacks = seen.find("SYN-ACK", direction="out", src=sc.node_ip, sport=30081,
                            dst=sc.client_pod_ip)
        assert synacks and {s.iface for s in synacks} <= _pod_bridge(c.node), seen
        # (kube-proxy may pick node 2's endpoint: its SYN-ACK then comes in on eth0)
        assert not seen.find("SYN-ACK", iface="eth0", direction="out"), seen
        assert seen.find("RST", direction="in", src=sc.client_pod_ip, dport=30081), seen
        r2 = other_node_pod_connect(c, INGRESS_IP, 80)
        assert r2.outcome == CONNECTED, r2


@pytest.mark.netns
@needs_root
def test_cluster_goes_away_also_on_error() -> None:
    cluster: list[Cluster] = []
    with pytest.raises(RuntimeError, match="boom"), \
            build_cluster(SCENARIOS["tke-ipvs-etp-cluster"], "legacy") as c:
        cluster.append(c)
        assert {ns.name for ns in c.namespaces()} <= _ns_names()
        assert all(p.poll() is None for p in c.servers)
        raise RuntimeError("boom")
    # (not "the list is as before": other test runs may build labs at the same time)
    assert not {ns.name for ns in cluster[0].namespaces()} & _ns_names()
    assert cluster[0].servers and all(p.poll() is not None for p in cluster[0].servers)
