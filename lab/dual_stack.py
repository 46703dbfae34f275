"""A dual-stack kube-proxy iptables-mode node in network namespaces: IPv4 and IPv6 on the
uplink and on the pod bridge, kube-proxy's rules of both families (``iptables-restore``
and ``ip6tables-restore`` of what ``lab.kube_proxy_rules.iptables_mode`` writes for each
family's proxier), a local endpoint pod that answers, and a VPC side that holds LB VIPs
kube-proxy does not capture, to see what leaves the node and with which source.

    client pod            node                                     vpc
    eth0 172.16.1.2         cni0 172.16.1.1                          eth1 10.0.0.1
         fd00:10:244:1::2        fd00:10:244:1::1  eth0 10.0.0.10 ---      2001:db8:1::1
    endpoint pod                                        2001:db8:1::10   lo: uncaptured
    eth0 172.16.1.10, fd00:10:244:1::10 (listens on 8080)                    VIPs

Each IPv6 Service is what a dual-stack cluster's IPv6 proxier sees (ipFamilies IPv6);
``EXPECT`` says what a pod's SYN to each LB IP meets, traced through the rules."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from lab import netns as _netns
from lab.kube_proxy_rules import LbService, iptables_mode, ipvs_mode, services_json
from lab.netns import Netns
from lab.node import REAL, ipvs_kind

NODE_NAME = "node-dual"
NODE_IP4, NODE_IP6 = "10.0.0.10", "2001:db8:1::10"
GW4, GW6 = "10.0.0.1", "2001:db8:1::1"
CLUSTER_CIDR4, CLUSTER_CIDR6 = "172.16.0.0/16", "fd00:10:244::/56"
POD_CIDR4, POD_CIDR6 = "172.16.1.0/24", "fd00:10:244:1::/64"
BRIDGE4, BRIDGE6 = "172.16.1.1", "fd00:10:244:1::1"
CLIENT4, CLIENT6 = "172.16.1.2", "fd00:10:244:1::2"
EP4, EP6 = "172.16.1.10", "fd00:10:244:1::10"  # the local endpoint pod
REMOTE_EP6 = "fd00:10:244:2::10"  # another node's pod (never answers here)
EP_PORT = 8080

SERVICES = (
    # eTP=Cluster, a local endpoint: KUBE-EXT -> KUBE-SVC -> DNAT, captured
    LbService(namespace="default", name="web6", cluster_ip="fd00:96::7",
              lb_ip="2001:db8:ff::7", node_port=30080, local_endpoints=(EP6,)),
    # eTP=Local with a local endpoint: pod traffic short-circuits to KUBE-SVC, captured
    LbService(namespace="default", name="loc6", cluster_ip="fd00:96::8",
              lb_ip="2001:db8:ff::8", node_port=30081, etp="Local",
              health_check_node_port=32081, local_endpoints=(EP6,)),
    # eTP=Local, the only endpoint elsewhere: captured all the same (the pod's SYN goes
    # to KUBE-SVC), but the LB's health checks fail here by design
    LbService(namespace="default", name="far6", cluster_ip="fd00:96::9",
              lb_ip="2001:db8:ff::9", node_port=30082, etp="Local",
              health_check_node_port=32082, remote_endpoints=(REMOTE_EP6,)),
    # loadBalancerSourceRanges without the pods: KUBE-FW falls through, filter
    # KUBE-PROXY-FIREWALL drops it
    LbService(namespace="default", name="fw6", cluster_ip="fd00:96::a",
              lb_ip="2001:db8:ff::a", node_port=30083, local_endpoints=(EP6,),
              source_ranges=("2001:db8:abcd::/48",)),
    # source ranges that hold the pods: KUBE-FW -> KUBE-EXT, captured
    LbService(namespace="default", name="fwok6", cluster_ip="fd00:96::b",
              lb_ip="2001:db8:ff::b", node_port=30084, local_endpoints=(EP6,),
              source_ranges=(CLUSTER_CIDR6,)),
    # a VIP kube-proxy has not synced yet: no rule for it (the generator is given none),
    # the Service's status has it: the pod's SYN leaves the node with its own address
    LbService(namespace="default", name="unsynced6", cluster_ip="fd00:96::c",
              node_port=30085, local_endpoints=(EP6,)),
    # the IPv4 side of the node is walked as before
    LbService(namespace="default", name="web4", cluster_ip="10.96.0.7",
              lb_ip="10.0.1.100", node_port=30090, local_endpoints=(EP4,)),
)
UNSYNCED_VIP = "2001:db8:ff::c"  # unsynced6's VIP: held by the VPC side, which answers it
FW_VIP = "2001:db8:ff::a"
EXPECT = {
    "2001:db8:ff::7": {"pod-to-lb-captured"},
    "2001:db8:ff::8": {"pod-to-lb-captured"},
    "2001:db8:ff::9": {"pod-to-lb-captured", "etp-local-no-local-endpoint"},
    "2001:db8:ff::a": {"pod-to-lb-dropped"},
    "2001:db8:ff::b": {"pod-to-lb-captured"},
    UNSYNCED_VIP: {"pod-to-lb-not-masqueraded"},
    "10.0.1.100": {"pod-to-lb-captured"},
}


# IPVS mode's IPv6 proxier (an IPv6-only kube-proxy here: its IPv4 side is the iptables
# scenario's business): every VIP bound on kube-ipvs0, the sets KUBE-6-*; eTP Cluster and
# Local, each with and without a local endpoint
IPVS_SERVICES = (
    SERVICES[0],  # web6: Cluster, a local endpoint
    LbService(namespace="default", name="loc6", cluster_ip="fd00:96::8",
              lb_ip="2001:db8:ff::8", node_port=30081, etp="Local",
              health_check_node_port=32081, local_endpoints=(EP6,)),
    # Local, its only endpoint on another node: kube-proxy (>= 1.21, kubernetes PR 97081)
    # gives the virtual server that remote endpoint so that pods still reach the VIP
    LbService(namespace="default", name="far6", cluster_ip="fd00:96::9",
              lb_ip="2001:db8:ff::9", node_port=30082, etp="Local",
              health_check_node_port=32082, remote_endpoints=(REMOTE_EP6,)),
    # Cluster, its only endpoint on another node
    LbService(namespace="default", name="farc6", cluster_ip="fd00:96::d",
              lb_ip="2001:db8:ff::d", node_port=30086, remote_endpoints=(REMOTE_EP6,)),
    # Local and no ready endpoint anywhere: a virtual server without real servers
    LbService(namespace="default", name="none6", cluster_ip="fd00:96::e",
              lb_ip="2001:db8:ff::e", node_port=30087, etp="Local",
              health_check_node_port=32087),
)
IPVS_NO_REAL_SERVERS = "2001:db8:ff::e"
# bound on kube-ipvs0: a local address (IPv6's fate for health checks from the VIP), and
# a pod's SYN to it never leaves the node
IPVS_EXPECT = {s.lb_ip: {"lb-ip-local", "pod-to-lb-captured"} for s in IPVS_SERVICES}
# with real IPVS the agent reads the virtual servers: none6's has no real server, far6's
# only one on another node
IPVS_EXPECT_REAL = {**IPVS_EXPECT, **{ip: {
    "lb-ip-local", "pod-to-lb-captured", "etp-local-no-local-endpoint"}
    for ip in (IPVS_NO_REAL_SERVERS, "2001:db8:ff::9")}}


def ipvs_state(backend: str = "legacy"):  # type: ignore[no-untyped-def]
    return ipvs_mode(IPVS_SERVICES, bind_lb_ip=True, cluster_cidr=CLUSTER_CIDR6,
                     node_ip=NODE_IP6, backend=backend, family=6)


def kube_files(mode: str = "iptables") -> dict[str, str]:
    """services.json (unsynced6 with its VIP in the status) and node.json (both families)."""
    svcs = services_json(SERVICES if mode == "iptables" else IPVS_SERVICES)
    for item in svcs["items"]:
        if item["metadata"]["name"] == "unsynced6":
            item["spec"]["type"] = "LoadBalancer"
            item["spec"]["externalTrafficPolicy"] = "Cluster"
            item["status"] = {"loadBalancer": {"ingress": [{"ip": UNSYNCED_VIP}]}}
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME}},
            "spec": {"podCIDR": POD_CIDR4, "podCIDRs": [POD_CIDR4, POD_CIDR6]},
            "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP4},
                                     {"type": "InternalIP", "address": NODE_IP6},
                                     {"type": "Hostname", "address": NODE_NAME}]}}
    return {"services.json": json.dumps(svcs, indent=1), "node.json": json.dumps(node)}


def rules(backend: str = "legacy") -> tuple[str, str]:
    """(iptables-save text, ip6tables-save text) of the node's kube-proxy."""
    v4 = [s for s in SERVICES if ":" not in s.cluster_ip]
    v6 = [copy.copy(s) for s in SERVICES if ":" in s.cluster_ip]
    return (iptables_mode(v4, cluster_cidr=CLUSTER_CIDR4, node_ip=NODE_IP4, backend=backend),
            iptables_mode(v6, cluster_cidr=CLUSTER_CIDR6, node_ip=NODE_IP6, backend=backend,
                          family=6))


def _settle(node: Netns, timeout: float = 5.0) -> None:
    """Wait until the node's routes (IPv6 link-local and multicast ones come when a
    port's carrier does, asynchronously) and links stay the same for a moment: a lab
    that still changes by itself would fail a before/after comparison."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        now = node.run("ip", "route", "show", "table", "all").stdout + \
            node.run("ip", "-o", "link", "show").stdout
        if now == last and "state UP" in now:
            return
        last = now
        time.sleep(0.3)
    raise _netns.NetnsError("the dual-stack node did not settle")


@dataclass(frozen=True)
class DualLab:
    node: Netns
    vpc: Netns
    client_pod: Netns
    endpoint_pod: Netns
    kube_dir: Path
    backend: str
    mode: str = "iptables"


@contextmanager
def build_dual_stack(backend: str = "legacy", mode: str = "iptables") -> Iterator[DualLab]:
    """The dual-stack node, its VPC side, a client pod and a local endpoint pod; every
    namespace is deleted when the block ends, also on error. ``mode`` "ipvs": kube-proxy's
    IPv6 IPVS proxier instead (ipsets, ip6tables rules, VIPs on a DOWN kube-ipvs0, and
    where lab.node.ipvs_kind() is real its IPv6 virtual servers; elsewhere none: the
    kernel may have no IP_VS, and the lab never loads a module)."""
    with ExitStack() as stack:
        vpc = stack.enter_context(_netns.netns("lbv"))
        node = stack.enter_context(_netns.netns("lbn"))
        pod = stack.enter_context(_netns.netns("lbp"))
        ep = stack.enter_context(_netns.netns("lbe"))
        for ns in (vpc, node, pod, ep):  # no DAD: addresses usable at once, nothing moves
            ns.run("sysctl", "-q", "-w", "net.ipv6.conf.all.accept_dad=0",
                   "net.ipv6.conf.default.accept_dad=0")
        node.run("sysctl", "-q", "-w", "net.ipv4.ip_forward=1",
                 "net.ipv6.conf.all.forwarding=1")
        _netns.veth(node, "eth0", vpc, "eth1")
        node.sh(f"""
            ip addr add {NODE_IP4}/24 dev eth0
            ip addr add {NODE_IP6}/64 dev eth0 nodad
            ip link set eth0 up
            ip route add default via {GW4} dev eth0
            ip -6 route add default via {GW6} dev eth0
            ip link add cni0 type bridge
        """)
        vpc.sh(f"""
            ip addr add {GW4}/24 dev eth1
            ip addr add {GW6}/64 dev eth1 nodad
            ip link set eth1 up
            ip route add {POD_CIDR4} via {NODE_IP4} dev eth1
            ip -6 route add {POD_CIDR6} via {NODE_IP6} dev eth1
            ip addr add {UNSYNCED_VIP}/128 dev lo nodad
            ip addr add {FW_VIP}/128 dev lo nodad
        """)
        for name, (ns, ip4, ip6) in {"vethpod0": (pod, CLIENT4, CLIENT6),
                                     "vethep0": (ep, EP4, EP6)}.items():
            _netns.veth(ns, "eth0", node, name)
            ns.sh(f"""
                ip addr add {ip4}/24 dev eth0
                ip addr add {ip6}/64 dev eth0 nodad
                ip link set eth0 up
                ip route add default via {BRIDGE4} dev eth0
            """)
            node.sh(f"ip link set {name} master cni0 && ip link set {name} up")
        node.sh(f"""
            ip addr add {BRIDGE4}/24 dev cni0
            ip addr add {BRIDGE6}/64 dev cni0 nodad
            ip link set cni0 up
        """)
        for ns in (pod, ep):
            ns.run("ip", "-6", "route", "add", "default", "via", BRIDGE6, "dev", "eth0")
        if mode == "iptables":
            v4, v6 = rules(backend)
            node.run(f"iptables-{backend}-restore", input=v4)
            node.run(f"ip6tables-{backend}-restore", input=v6)
        else:
            state = ipvs_state(backend)
            node.run("ipset", "restore", input=state.ipset_restore)
            node.run(f"ip6tables-{backend}-restore", input=state.iptables_restore)
            real = ipvs_kind() == REAL
            # kube-proxy's dummy, left DOWN (a DOWN bridge stands in without the driver);
            # IPv6 VIPs bound with IFA_F_NODAD as kube-proxy's EnsureAddressBind does
            node.run("ip", "link", "add", "kube-ipvs0", "type", "dummy" if real else "bridge")
            node.run("ip", "-batch", "-", input="".join(
                f"address add {a}/128 dev kube-ipvs0 nodad\n"
                for a in state.kube_ipvs0_addresses))
            if real:  # the virtual servers as kube-proxy writes them (lab.node._rules)
                node.run("sysctl", "-q", "-w", "net.ipv4.vs.conntrack=1",
                         "net.ipv4.vs.expire_nodest_conn=1",
                         "net.ipv4.vs.expire_quiescent_template=1")
                node.run("ipvsadm", "-R", input=state.ipvsadm_save)
        _settle(node)
        kube_dir = Path(tempfile.mkdtemp(prefix="lbl-kube-"))
        stack.callback(shutil.rmtree, kube_dir, True)
        for name, text in kube_files(mode).items():
            (kube_dir / name).write_text(text)
        yield DualLab(node, vpc, pod, ep, kube_dir, backend, mode)
