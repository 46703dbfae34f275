"""The lab's Service model and what every mode's generator shares.

The generators of kube-proxy's rules are the agent's own (agent.predict: nftables,
iptables, ipvs, with the iptables renderings in agent.predict.xtables): the lab adapts
its Service model (``LbService``: one port, one LB IP, endpoints as pod IPs on one
target port) to the agent's (agent.predict.model.ServicePort) and calls them, so the
lab, the benchmarks and `check --what-if` write one thing. The names the lab's own
renderings use (the old iptables generation, the neighbours' rules) are re-exported
here under their old names.
"""


from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.predict.model import Endpoint, ServicePort
from agent.predict.xtables import BUILTIN as _BUILTIN
from agent.predict.xtables import DROP_MARK as _DROP_MARK
from agent.predict.xtables import IPTABLES_VERSION as _IPTABLES_VERSION
from agent.predict.xtables import KP_MARK as _KP_MARK
from agent.predict.xtables import LARGE_CLUSTER_ENDPOINTS as _LARGE_CLUSTER_ENDPOINTS
from agent.predict.xtables import MARK as _MARK
from agent.predict.xtables import REJECT_OPTS as _REJECT_OPTS
from agent.predict.xtables import REJECT_OPTS6 as _REJECT_OPTS6
from agent.predict.xtables import SAVE_DATE as _SAVE_DATE
from agent.predict.xtables import Tables as _Tables
from agent.predict.xtables import (
    canary_chains,
    chain_hash,
    endpoint_chain_hash,
    forward_rules,
    host_port,
    nat_hooks,
    nodeports_last,
)
from agent.predict.xtables import cidr as _cidr
from agent.predict.xtables import jump as _jump
from agent.predict.xtables import prepend_hooks as _prepend_hooks
from agent.predict.xtables import render_save as _render_save
from agent.predict.xtables import save_quote as _save_quote

__all__ = [
    "_BUILTIN", "_DROP_MARK", "_IPTABLES_VERSION", "_KP_MARK", "_LARGE_CLUSTER_ENDPOINTS",
    "_MARK", "_REJECT_OPTS", "_REJECT_OPTS6", "_SAVE_DATE", "IngressSpec", "LbService",
    "_Tables", "_cidr", "_jump", "_prepend_hooks", "_render_save", "_save_quote",
    "canary_chains", "chain_hash", "endpoint_chain_hash", "forward_rules", "host_port",
    "nat_hooks", "nodeports_last", "service_port",
]


# --- services ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LbService:
    """One service port as kube-proxy sees it, plus where its endpoints run.

    ``lb_ip`` set makes it a LoadBalancer service, else ``node_port`` set makes it a
    NodePort service, else it is a ClusterIP service. Endpoint IPs are pod IPs; the
    endpoint port is ``target_port``.
    """

    namespace: str
    name: str
    port_name: str = "http"
    port: int = 80
    protocol: str = "TCP"
    target_port: int = 8080
    node_port: int | None = None
    cluster_ip: str
    lb_ip: str | None = None
    external_ips: tuple[str, ...] = ()
    etp: str = "Cluster"  # externalTrafficPolicy: "Cluster" | "Local"
    local_endpoints: tuple[str, ...] = ()
    remote_endpoints: tuple[str, ...] = ()
    health_check_node_port: int | None = None  # set for eTP=Local LoadBalancer services
    # loadBalancerSourceRanges (the new generation's KUBE-FW chain; the node's own address
    # is taken as outside them: no "allowFromNode" rules)
    source_ranges: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def port_name_key(self) -> str:
        """ServicePortName.String(): "ns/name:port" (kube-proxy's hash input)."""
        return f"{self.namespace}/{self.name}:{self.port_name}"

    @property
    def type(self) -> str:
        if self.lb_ip:
            return "LoadBalancer"
        return "NodePort" if self.node_port else "ClusterIP"

    @property
    def externally_accessible(self) -> bool:
        # BaseServicePortInfo.ExternallyAccessible()
        return bool(self.node_port or self.lb_ip or self.external_ips)

    @property
    def external_policy_local(self) -> bool:
        # ExternalPolicyLocal(): eTP only counts for externally accessible services.
        return self.etp == "Local" and self.externally_accessible

    def endpoints(self) -> list[tuple[str, bool]]:
        """(ip, is_local) sorted by address, the order kube-proxy's slice cache yields."""
        eps = [(ip, True) for ip in self.local_endpoints]
        eps += [(ip, False) for ip in self.remote_endpoints]
        eps.sort(key=lambda e: ipaddress.ip_address(e[0]))
        return eps


@dataclass(frozen=True, kw_only=True)
class IngressSpec:
    """A layer-7 Ingress served by a cloud load balancer (TKE: a CLB per Ingress)."""

    namespace: str
    name: str
    ip: str
    service_name: str
    service_port: int = 80
    host: str | None = None
    tls: bool = False
    annotations: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)


# --- the agent's model ----------------------------------------------------------------


def service_port(svc: LbService, *, by_address: bool = True) -> ServicePort:
    """The agent's model of one service port (agent.predict.model) from the lab's: its
    endpoints each on ``target_port``, sorted by address as kube-proxy's endpoint cache
    gives them to the iptables and IPVS proxiers (``by_address``), or the local ones
    first, then the remote ones (the lab's nftables states)."""
    eps = svc.endpoints() if by_address else [
        *((ip, True) for ip in svc.local_endpoints),
        *((ip, False) for ip in svc.remote_endpoints)]
    return ServicePort(
        namespace=svc.namespace, name=svc.name, port_name=svc.port_name, port=svc.port,
        protocol=svc.protocol, cluster_ip=svc.cluster_ip, node_port=svc.node_port,
        lb_ips=(svc.lb_ip,) if svc.lb_ip else (), external_ips=svc.external_ips,
        etp_local=svc.etp == "Local",
        endpoints=tuple(Endpoint(ip, svc.target_port, local) for ip, local in eps),
        source_ranges=svc.source_ranges, health_check_node_port=svc.health_check_node_port)
