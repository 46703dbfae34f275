"""The agent's model of a node's Service ports as kube-proxy's proxiers are given them
(pkg/proxy/serviceport.go's ServicePort with its endpoints): what the generators of each
mode (agent.predict.nftables, agent.predict.iptables, agent.predict.ipvs) write rules
for, what agent.predict.cluster reads from a node, and what the lab's generators adapt
their own Service model to (lab/kube_proxy_rules): one model, one implementation per
mode.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Endpoint:
    ip: str
    port: int
    local: bool  # on this node


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One Service port as kube-proxy's proxiers are given it."""

    namespace: str
    name: str
    port_name: str  # "" for an unnamed port
    port: int
    protocol: str  # "TCP" | "UDP" | "SCTP"
    cluster_ip: str
    node_port: int | None = None
    lb_ips: tuple[str, ...] = ()  # status.loadBalancer.ingress[].ip in VIP mode
    external_ips: tuple[str, ...] = ()
    etp_local: bool = False  # externalTrafficPolicy: Local
    # in the order kube-proxy's endpoint cache gives them (the nftables vmap numbers them,
    # iptables' KUBE-SVC chain and IPVS's real servers list them in it)
    endpoints: tuple[Endpoint, ...] = ()
    source_ranges: tuple[str, ...] = ()  # loadBalancerSourceRanges
    # spec.healthCheckNodePort of an eTP=Local LoadBalancer Service (iptables mode accepts
    # it in filter KUBE-NODEPORTS, IPVS mode lists it in KUBE-HEALTH-CHECK-NODE-PORT)
    health_check_node_port: int | None = None

    @property
    def key(self) -> str:
        """ServicePortName.String(): "ns/name:port", "ns/name" for an unnamed port."""
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.port_name}" if self.port_name else base

    @property
    def externally_accessible(self) -> bool:
        """BaseServicePortInfo.ExternallyAccessible()."""
        return bool(self.node_port or self.lb_ips or self.external_ips)

    @property
    def external_policy_local(self) -> bool:
        """ExternalPolicyLocal(): eTP only counts for an externally accessible port."""
        return self.etp_local and self.externally_accessible
