"""Synthetic node states of 1k-20k services for the benchmark."""


from __future__ import annotations

import ipaddress
import json
import random
from collections.abc import Sequence

from lab.kube_proxy_rules.common import LbService
from lab.kube_proxy_rules.iptables import iptables_mode
from lab.kube_proxy_rules.ipvs import ipvs_mode
from lab.kube_proxy_rules.nftables import nftables_mode
from lab.kube_proxy_rules.objects import (
    ip_addr_text,
    node_json,
    route_local_text,
    services_json,
    sysctl_text,
)

# the sysctls the agent's probe reads, as a kube-proxy node has them
NODE_SYSCTLS: dict[str, str | int] = {
    "net.ipv4.ip_forward": 1, "net.ipv4.conf.all.rp_filter": 1,
    "net.ipv4.conf.default.rp_filter": 1, "net.ipv4.conf.eth0.rp_filter": 1,
    "net.ipv4.conf.all.accept_local": 0, "net.ipv4.conf.eth0.accept_local": 0,
    "net.ipv4.conf.all.log_martians": 0, "net.ipv4.conf.all.route_localnet": 0}

# --- synthetic bundles for the benchmark ------------------------------------------------


def synthetic(n_services: int, mode: str, seed: int = 0) -> dict[str, str]:
    """A support bundle (file name -> text) for a node with ``n_services`` LoadBalancer
    services, 2-3 endpoints each (some on this node), every second one eTP=Local, unique
    LB IPs and NodePorts (a widened --service-node-port-range beyond 2768 services).
    Ports stay ports: past 35,536 services (NodePorts 30000-65535) the rest have none
    (allocateLoadBalancerNodePorts: false), past 20,000 no health check NodePort either
    (10000 + i would meet the NodePorts). Deterministic for a given seed; 50k services
    take some 10 s."""
    if mode not in ("iptables", "ipvs", "nftables"):
        raise ValueError(f"mode must be 'iptables', 'ipvs' or 'nftables', not {mode!r}")
    rng = random.Random(seed)
    node_ip, pod_cidr, cluster_cidr = "10.0.0.10", "172.16.1.0/24", "172.16.0.0/16"
    svc_base = int(ipaddress.IPv4Address("10.96.0.0"))
    lb_base = int(ipaddress.IPv4Address("10.0.32.0"))
    services: list[LbService] = []
    for i in range(n_services):
        n_eps = 2 + rng.randrange(2)
        n_local = rng.randrange(2)  # 0 or 1 endpoint on this node
        local = tuple(f"172.16.1.{2 + (i + k) % 250}" for k in range(n_local))
        remote = tuple(f"172.16.{2 + rng.randrange(250)}.{2 + rng.randrange(250)}"
                       for _ in range(n_eps - n_local))
        etp = "Local" if i % 2 else "Cluster"
        services.append(LbService(
            namespace=f"ns{i // 100}", name=f"svc{i}", port=80, target_port=8080,
            node_port=30000 + i if 30000 + i <= 65535 else None,
            cluster_ip=str(ipaddress.IPv4Address(svc_base + 10 + i)),
            lb_ip=str(ipaddress.IPv4Address(lb_base + 1 + i)), etp=etp,
            local_endpoints=local, remote_endpoints=remote,
            health_check_node_port=(10000 + i) if etp == "Local" and i < 20_000 else None))

    interfaces: list[tuple[str, str, Sequence[str]]] = [
        ("lo", "UP", ["127.0.0.1/8"]), ("eth0", "UP", [f"{node_ip}/24"]),
        ("cni0", "UP", ["172.16.1.1/24"])]
    sysctls: dict[str, str | int] = dict(NODE_SYSCTLS)
    bundle: dict[str, str] = {}
    if mode == "iptables":
        bundle["iptables-save.txt"] = iptables_mode(services, generation="new",
                                                    cluster_cidr=cluster_cidr, node_ip=node_ip)
        bundle["ipset.txt"] = ""
        bundle["ipvsadm.txt"] = ""
        sysctls["net.ipv4.conf.all.route_localnet"] = 1  # localhostNodePorts
    elif mode == "nftables":  # the proxier's transaction, as `nft -f` takes it
        bundle["nft-transaction.txt"] = nftables_mode(
            services, cluster_cidr=cluster_cidr, node_ip=node_ip, service_cidr="10.96.0.0/12")
    else:
        state = ipvs_mode(services, bind_lb_ip=True, cluster_cidr=cluster_cidr, node_ip=node_ip)
        bundle["iptables-save.txt"] = state.iptables_restore
        bundle["ipset.txt"] = state.ipset_save
        bundle["ipvsadm.txt"] = state.ipvsadm_save
        interfaces.append(("kube-ipvs0", "DOWN",
                           [a + "/32" for a in state.kube_ipvs0_addresses]))
        sysctls["net.ipv4.vs.conntrack"] = 1
    bundle["route-local.txt"] = route_local_text(interfaces)
    bundle["addr.txt"] = ip_addr_text(interfaces)
    bundle["sysctl.txt"] = sysctl_text(sysctls)
    # compact JSON: the C encoder only runs without indent (10x faster at 20k services)
    bundle["services.json"] = json.dumps(services_json(services))
    bundle["node.json"] = json.dumps(node_json("node-10-0-0-10", pod_cidr, node_ip))
    return bundle
