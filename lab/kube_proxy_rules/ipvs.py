"""kube-proxy's IPVS mode for the lab's Services: the agent's own model of what its
proxier leaves on a node (agent.predict.ipvs: the KUBE-* ipsets, the set-matching nat and
filter rules, the kube-ipvs0 addresses and the IPVS virtual servers, which `check
--what-if ipvs` writes), given the lab's service ports. One implementation."""


from __future__ import annotations

from collections.abc import Iterable

from agent.predict.ipvs import IPVS_SETS, IpvsNodeState, set_name
from agent.predict.ipvs import ipset_text as _ipset_text
from agent.predict.ipvs import ipvs_mode as _ipvs_mode
from agent.predict.ipvs import ipvs_tables as _ipvs_tables
from lab.kube_proxy_rules.common import LbService, service_port

__all__ = ["IPVS_SETS", "IpvsNodeState", "_ipset_text", "_ipvs_tables", "ipvs_mode",
           "set_name"]


def ipvs_mode(services: Iterable[LbService], *, bind_lb_ip: bool, cluster_cidr: str | None,
              node_ip: str, backend: str = "legacy", family: int = 4) -> IpvsNodeState:
    """kube-proxy in IPVS mode. ``bind_lb_ip=False`` is TKE's variant that does not put
    the LoadBalancer ingress IP on kube-ipvs0 (the upstream proxier binds it, PR 63066);
    its ipsets and iptables rules are the same as upstream's. ``family`` 6: the IPv6
    proxier of a dual-stack node (KUBE-6-* sets, ip6tables rules, [addr]:port servers).
    The NodePorts' virtual servers are on ``node_ip`` only (kube-proxy makes them on
    every address of the node but kube-ipvs0's and the loopback ones)."""
    return _ipvs_mode([service_port(s) for s in services], bind_lb_ip=bind_lb_ip,
                      cluster_cidr=cluster_cidr, node_ips=(node_ip,), backend=backend,
                      family=family)
