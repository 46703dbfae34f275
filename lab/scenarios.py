"""Named lab scenarios: a node's kube-proxy flavour, services and neighbours, and what
the agent must conclude for each load-balancer address.

Addressing (TKE "global router" style, shared by all scenarios):

=================  =================  ==============================================
VPC                10.0.0.0/16        node subnet 10.0.0.0/24, gateway 10.0.0.1
node eth0          10.0.0.10/24       the node's InternalIP
private CLB VIPs   10.0.1.0/24        inside the VPC, off the node subnet: routed out
                                      via the gateway unless captured on the node
cluster CIDR       172.16.0.0/16      all pods
node pod CIDR      172.16.1.0/24      cni0 = 172.16.1.1, client pod = 172.16.1.2,
                                      local endpoints 172.16.1.10+
other nodes' pods  172.16.2.0/24 ...  remote endpoints
service CIDR       10.96.0.0/12       10.96.0.1 = default/kubernetes
node 2 (lab.clb)   10.0.0.11          pod CIDR 172.16.2.0/24, pod 172.16.2.2
CLB health checks  100.64.0.2         TKE's non-local source (the VIP by default)
=================  =================  ==============================================

Finding ids used in ``expect`` (per LB / Ingress IP):

- ``lb-ip-local``: the LB IP is a local address (bound on kube-ipvs0, in table local).
- ``pod-to-lb-captured``: a packet from a pod of this node to LB IP:port is DNATed by
  kube-proxy or served by IPVS on the node: it never reaches the CLB, no loop.
- ``pod-to-lb-not-masqueraded``: the packet is not captured and leaves the node with
  the pod's source IP: the CLB may pick this node and the handshake loops.
- ``pod-to-lb-masqueraded``: it leaves the node SNATed to the node IP: the CLB skips
  this node as a real server, no loop.
- ``etp-local-no-local-endpoint``: eTP=Local and no endpoint on this node.

Each expectation follows the rules a packet 172.16.1.2 -> VIP:80 would traverse
(nat PREROUTING, routing, nat POSTROUTING); the comments spell the walk out.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from lab import kube_proxy_rules as kpr
from lab.kube_proxy_rules import IngressSpec, LbService

VPC_CIDR = "10.0.0.0/16"
NODE_IP = "10.0.0.10"
NODE_PREFIX = 24
VPC_GATEWAY = "10.0.0.1"
CLUSTER_CIDR = "172.16.0.0/16"
POD_CIDR = "172.16.1.0/24"
NODE_NAME = "node-10-0-0-10"

# The lab's second node (lab.clb.build_cluster): another real server of the CLB,
# home of the "other nodes' pods" 172.16.2.0/24.
NODE2_IP = "10.0.0.11"
NODE2_POD_CIDR = "172.16.2.0/24"
NODE2_NAME = "node-10-0-0-11"
# TKE's prevent-loopback health checks come from 100.64.0.0/10, not from the VIP.
HEALTH_CHECK_SOURCE = "100.64.0.2"

LB_IP = "10.0.1.10"
INGRESS_IP = "10.0.1.100"

# TKE marks private-network CLBs with the subnet annotation.
_PRIVATE_CLB = {"service.kubernetes.io/qcloud-loadbalancer-internal-subnetid": "subnet-lab0001"}

# Present on every cluster; a ClusterIP service with an off-pod-network endpoint.
KUBERNETES = LbService(namespace="default", name="kubernetes", port_name="https", port=443,
                       target_port=6443, cluster_ip="10.96.0.1",
                       remote_endpoints=("10.0.0.2",))


def web(etp: str, *, local: bool = True, lb_ip: str = LB_IP) -> LbService:
    """demo/web: a LoadBalancer service on a private CLB, one endpoint here when
    ``local``, two on other nodes."""
    return LbService(
        namespace="demo", name="web", port=80, target_port=8080, node_port=30080,
        cluster_ip="10.96.100.10", lb_ip=lb_ip, etp=etp,
        local_endpoints=("172.16.1.10",) if local else (),
        remote_endpoints=("172.16.2.10", "172.16.3.10"),
        health_check_node_port=32080 if etp == "Local" else None,
        annotations=_PRIVATE_CLB)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    description: str
    mode: str  # "ipvs" | "iptables"
    generation: str = "new"  # iptables mode: "new" (KUBE-EXT/SVL) | "old" (KUBE-XLB/FW)
    bind_lb_ip: bool = True  # ipvs mode: False = TKE's variant, EXTERNAL-IP not bound
    cluster_cidr: str | None = CLUSTER_CIDR  # kube-proxy --cluster-cidr (local detector)
    services: tuple[LbService, ...]
    ip_masq_agent: tuple[str, ...] = ()  # nonMasqueradeCIDRs; empty = no ip-masq-agent
    cni_masquerade: bool = False
    rp_filter: int = 1
    node_name: str = NODE_NAME
    node_ip: str = NODE_IP
    node_prefix: int = NODE_PREFIX
    vpc_gateway: str = VPC_GATEWAY
    vpc_cidr: str = VPC_CIDR
    pod_cidr: str = POD_CIDR
    ingresses: tuple[IngressSpec, ...] = ()
    expect: Mapping[str, frozenset[str]] = field(hash=False, compare=False)

    # -- derived addresses ------------------------------------------------------------

    @property
    def pod_gateway(self) -> str:
        """cni0's address: the first host of the node's pod CIDR."""
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    @property
    def client_pod_ip(self) -> str:
        hosts = ipaddress.ip_network(self.pod_cidr).hosts()
        next(hosts)
        return str(next(hosts))

    @property
    def lb_ips(self) -> tuple[str, ...]:
        return tuple(s.lb_ip for s in self.services if s.lb_ip)

    @property
    def ingress_ips(self) -> tuple[str, ...]:
        return tuple(i.ip for i in self.ingresses)

    # -- node state (pure) ------------------------------------------------------------

    def ipvs_state(self) -> kpr.IpvsNodeState | None:
        if self.mode != "ipvs":
            return None
        return kpr.ipvs_mode(self.services, bind_lb_ip=self.bind_lb_ip,
                             cluster_cidr=self.cluster_cidr, node_ip=self.node_ip)

    def kube_proxy_rules(self) -> str:
        """kube-proxy's part of the nat and filter tables, iptables-save rendering."""
        state = self.ipvs_state()
        if state is not None:
            return state.iptables_restore
        return kpr.iptables_mode(self.services, generation=self.generation,
                                 cluster_cidr=self.cluster_cidr, node_ip=self.node_ip)

    def iptables_restore(self) -> str:
        """Everything the node's nat/filter tables hold: kube-proxy, then the agents
        that append to POSTROUTING after it (ip-masq-agent, CNI)."""
        fragments = [self.kube_proxy_rules()]
        if self.ip_masq_agent:
            fragments.append(kpr.ip_masq_agent(self.ip_masq_agent))
        if self.cni_masquerade:
            fragments.append(kpr.cni_masquerade(self.pod_cidr))
        return kpr.merge_restore(*fragments)

    def kube_ipvs0_addresses(self) -> tuple[str, ...]:
        state = self.ipvs_state()
        return state.kube_ipvs0_addresses if state else ()

    def kube_files(self) -> dict[str, str]:
        """services.json / node.json / ingresses.json as the API would return them."""
        return {
            "services.json": json.dumps(kpr.services_json(self.services), indent=4),
            "node.json": json.dumps(kpr.node_json(self.node_name, self.pod_cidr, self.node_ip),
                                    indent=4),
            "ingresses.json": json.dumps(kpr.ingresses_json(self.ingresses), indent=4),
        }


def _f(*ids: str) -> frozenset[str]:
    return frozenset(ids)


_TKE_MASQ = (CLUSTER_CIDR, VPC_CIDR)  # TKE's default ip-masq-agent nonMasqueradeCIDRs

_SCENARIOS = (
    Scenario(
        name="ipvs-lb-bound",
        description="Upstream IPVS mode: the LB IP is bound on kube-ipvs0, eTP=Cluster.",
        mode="ipvs", bind_lb_ip=True, services=(KUBERNETES, web("Cluster")),
        # The VIP is in table local: a CLB health check sourced from its own VIP is a
        # martian. Pod -> VIP: KUBE-SERVICES -> KUBE-LOAD-BALANCER marks it, routing
        # says "local", IPVS in INPUT serves it from the node: never reaches the CLB.
        expect={LB_IP: _f("lb-ip-local", "pod-to-lb-captured")},
    ),
    Scenario(
        name="tke-ipvs-etp-local",
        description="TKE IPVS (LB IP not bound), eTP=Local, ip-masq-agent exempting the "
                    "cluster and VPC ranges (TKE's default).",
        mode="ipvs", bind_lb_ip=False, services=(KUBERNETES, web("Local")),
        ip_masq_agent=_TKE_MASQ,
        # KUBE-SERVICES -> KUBE-LOAD-BALANCER: the VIP is in KUBE-LOAD-BALANCER-LOCAL,
        # RETURN before the KUBE-MARK-MASQ rule; the final KUBE-LOAD-BALANCER ACCEPT
        # does not NAT. The VIP is not local, so IPVS never sees it and it is routed to
        # eth0. POSTROUTING: KUBE-POSTROUTING returns (no mark), IP-MASQ-AGENT returns
        # for 10.0.0.0/16: source stays 172.16.1.2.
        expect={LB_IP: _f("pod-to-lb-not-masqueraded")},
    ),
    Scenario(
        name="tke-ipvs-etp-cluster",
        description="TKE IPVS (LB IP not bound), eTP=Cluster, same ip-masq-agent.",
        mode="ipvs", bind_lb_ip=False, services=(KUBERNETES, web("Cluster")),
        ip_masq_agent=_TKE_MASQ,
        # Not in KUBE-LOAD-BALANCER-LOCAL: KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ marks it;
        # KUBE-POSTROUTING (before IP-MASQ-AGENT in POSTROUTING) masquerades to 10.0.0.10.
        expect={LB_IP: _f("pod-to-lb-masqueraded")},
    ),
    Scenario(
        name="tke-ipvs-etp-local-cni-masq",
        description="TKE IPVS (LB IP not bound), eTP=Local, no ip-masq-agent but a plain "
                    "CNI masquerade rule for traffic leaving the pod network.",
        mode="ipvs", bind_lb_ip=False, services=(KUBERNETES, web("Local")),
        cni_masquerade=True,
        # kube-proxy leaves it unmarked (as in tke-ipvs-etp-local), but the CNI rule
        # -s 172.16.1.0/24 ! -d 172.16.1.0/24 -j MASQUERADE catches it in POSTROUTING.
        expect={LB_IP: _f("pod-to-lb-masqueraded")},
    ),
    Scenario(
        name="iptables-new-etp-local",
        description="Upstream iptables mode (KUBE-EXT/KUBE-SVL), eTP=Local, --cluster-cidr "
                    "given, no endpoint on this node.",
        mode="iptables", generation="new", services=(KUBERNETES, web("Local", local=False)),
        # KUBE-SERVICES "loadbalancer IP" -> KUBE-EXT: "pod traffic for ... external
        # destinations" -s 172.16.0.0/16 -> KUBE-SVC -> DNAT to any endpoint. Captured
        # even without a local endpoint (the filter DROPs match the VIP, which the
        # packet no longer carries after DNAT).
        expect={LB_IP: _f("pod-to-lb-captured", "etp-local-no-local-endpoint")},
    ),
    Scenario(
        name="iptables-new-no-cluster-cidr",
        description="Upstream iptables mode, eTP=Local, no --cluster-cidr (no pod-traffic "
                    "rule), one endpoint on this node.",
        mode="iptables", generation="new", cluster_cidr=None,
        services=(KUBERNETES, web("Local")),
        # KUBE-EXT has no pod rule; the src-type LOCAL rules do not match a pod source;
        # the fall-through -j KUBE-SVL DNATs to the local endpoint 172.16.1.10.
        expect={LB_IP: _f("pod-to-lb-captured")},
    ),
    Scenario(
        name="iptables-old-etp-local",
        description="Old iptables generation (KUBE-FW/KUBE-XLB), eTP=Local, --cluster-cidr "
                    "given.",
        mode="iptables", generation="old", services=(KUBERNETES, web("Local")),
        # KUBE-SERVICES "loadbalancer IP" -> KUBE-FW -> KUBE-XLB: "Redirect pods trying to
        # reach external loadbalancer VIP to clusterIP" -s 172.16.0.0/16 -> KUBE-SVC -> DNAT.
        expect={LB_IP: _f("pod-to-lb-captured")},
    ),
    Scenario(
        name="ip-masq-agent-ingress",
        description="iptables mode with ip-masq-agent exempting 10.0.0.0/8, and a layer-7 "
                    "Ingress on a private CLB whose address only ingresses.json knows.",
        mode="iptables", generation="new",
        services=(
            KUBERNETES,
            web("Cluster", lb_ip="10.0.1.20"),
            # The Ingress' backend: the CLB forwards to this NodePort on every node.
            LbService(namespace="demo", name="web-l7", port=80, target_port=8080,
                      node_port=30081, cluster_ip="10.96.100.11",
                      local_endpoints=("172.16.1.11",), remote_endpoints=("172.16.2.11",)),
        ),
        ip_masq_agent=("10.0.0.0/8",),
        ingresses=(IngressSpec(namespace="demo", name="web", ip=INGRESS_IP,
                               service_name="web-l7", service_port=80, host="web.example.com",
                               annotations={"kubernetes.io/ingress.class": "qcloud"}),),
        # 10.0.1.100 matches no kube-proxy rule (only KUBE-SERVICES' final LOCAL-dst
        # jump, and it is not local): routed out, KUBE-POSTROUTING returns, IP-MASQ-AGENT
        # returns for 10.0.0.0/8: the pod source IP reaches the CLB.
        # 10.0.1.20 is a kube-proxy LB IP: DNATed in KUBE-SERVICES.
        expect={INGRESS_IP: _f("pod-to-lb-not-masqueraded"),
                "10.0.1.20": _f("pod-to-lb-captured")},
    ),
)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in _SCENARIOS}


def on_node(sc: Scenario, *, node_ip: str = NODE2_IP, pod_cidr: str = NODE2_POD_CIDR,
            node_name: str = NODE2_NAME) -> Scenario:
    """The same cluster (kube-proxy flavour, services, neighbours' rules) as seen from
    another node: endpoints in ``pod_cidr`` become local, this scenario's local ones
    remote, and the NodePorts and rules are rendered for ``node_ip``.

    ``expect`` is empty: nothing checks the agent's verdict on that node (the lab uses
    it as a neighbour: a real server of the CLB and the home of a client pod)."""
    net = ipaddress.ip_network(pod_cidr)

    def regroup(svc: LbService) -> LbService:
        eps = svc.local_endpoints + svc.remote_endpoints
        local = tuple(ip for ip in eps if ipaddress.ip_address(ip) in net)
        return dataclasses.replace(svc, local_endpoints=local,
                                   remote_endpoints=tuple(ip for ip in eps if ip not in local))

    return dataclasses.replace(
        sc, name=f"{sc.name}@{node_name}", node_name=node_name, node_ip=node_ip,
        pod_cidr=pod_cidr, services=tuple(regroup(s) for s in sc.services), expect={})
