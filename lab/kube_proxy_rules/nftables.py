"""kube-proxy's nftables mode for the lab's Services: the agent's own model of what its
proxier writes (agent.predict.nftables, which `check --what-if` uses), given the lab's
service ports. One implementation: the lab, the benchmarks and the prediction agree."""

from __future__ import annotations

from collections.abc import Iterable

from agent.predict.nftables import ServicePort, nftables_rules
from lab.kube_proxy_rules import common
from lab.kube_proxy_rules.common import LbService

TABLE = "ip kube-proxy"


def service_port(svc: LbService) -> ServicePort:
    """The agent's model of one service port (agent.predict.model), from the lab's: its
    local endpoints first, then the remote ones, each on ``target_port``."""
    return common.service_port(svc, by_address=False)


def nftables_mode(services: Iterable[LbService], *, cluster_cidr: str | None, node_ip: str,
                  service_cidr: str, family: int = 4, before_132456: bool = False) -> str:
    """The transaction (`nft -f` text) for ``services``: the agent's own prediction of
    kube-proxy's nftables mode (agent.predict.nftables), so the lab and `check --what-if`
    write one thing."""
    return nftables_rules([service_port(s) for s in services], family=family,
                          cluster_cidr=cluster_cidr, node_ips=(node_ip,),
                          service_cidr=service_cidr, before_132456=before_132456)
