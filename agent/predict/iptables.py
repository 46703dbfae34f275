"""What kube-proxy in iptables mode writes for a node's Services: the nat and filter
rules of its proxier's full sync (pkg/proxy/iptables/proxier.go syncProxyRules, the
generation since kubernetes#109060, v1.24: KUBE-EXT-, KUBE-SVL-, KUBE-SVC-, KUBE-SEP-
and KUBE-FW- chains, "has no local endpoints" DROPs in the filter table, KUBE-POSTROUTING
with the RETURN / --xor-mark / MASQUERADE triple), with the jumps it and kubelet make
from the built-in chains, as ``iptables-save`` prints them (or as kube-proxy pipes them
into ``iptables-restore``: agent.predict.xtables).

Per Service port: the ClusterIP's rule in KUBE-SERVICES (a REJECT in filter when the
port has no endpoint), each external and load balancer address's (to the KUBE-EXT
chain, or to KUBE-FW where loadBalancerSourceRanges are set, its fall-through dropped
by filter KUBE-PROXY-FIREWALL), the NodePort's in KUBE-NODEPORTS, the KUBE-EXT chain
(Cluster: mark for masquerade; Local: pod traffic and the node's own traffic to the
cluster chain, then the KUBE-SVL chain of the local endpoints, or a filter DROP where
there is none), the KUBE-SVC chain's random choice over the KUBE-SEP chains, each
masquerading hairpin traffic and DNATing. Without a local traffic detector (no
--cluster-cidr) the two rules that need it are left out, as the proxier does.

localhostNodePorts (default true): route_localnet=1 (set by kube-proxy, not written
here) and KUBE-FIREWALL's guard against martian localnet packets, IPv4 only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from agent.predict.model import Endpoint, ServicePort
from agent.predict.xtables import (
    LARGE_CLUSTER_ENDPOINTS,
    REJECT_OPTS,
    REJECT_OPTS6,
    Tables,
    canary_chains,
    chain_hash,
    endpoint_chain_hash,
    forward_rules,
    host_port,
    jump,
    masquerade_rules,
    nat_hooks,
    nodeports_last,
    prepend_hooks,
)


def iptables_tables(ports: Iterable[ServicePort], *, cluster_cidr: str | None,
                    node_ip: str | None = None, family: int = 4) -> Tables:
    """pkg/proxy/iptables/proxier.go syncProxyRules (v1.28+), one full sync; ``family``
    6: the IPv6 proxier of a dual-stack node (its services' addresses are IPv6);
    ``node_ip``: the node's address kube-proxy knows (a source range holding it lets the
    node's own traffic through, "allowFromNode")."""
    t = Tables(("filter", "nat"), family)
    for c in ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS",
              "KUBE-PROXY-FIREWALL"):
        t.chain("filter", c)
    for c in ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"):
        t.chain("nat", c)
    masquerade_rules(t)
    # localhostNodePorts (default true): route_localnet=1 plus this guard rule (IPv4
    # only: IPv6 has no route_localnet, and kube-proxy writes it for IPv4 alone)
    t.chain("filter", "KUBE-FIREWALL")
    if family == 4:
        t.rule("filter", "KUBE-FIREWALL", "DROP",
               comment="block incoming localnet connections", dst="127.0.0.0/8",
               src="127.0.0.0/8", nsrc=True,
               post="-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT")

    svcs = sorted(ports, key=lambda s: s.key)
    t.large_cluster = sum(len(s.endpoints) for s in svcs) > LARGE_CLUSTER_ENDPOINTS
    for sp in svcs:
        _service_port(t, sp, cluster_cidr, node_ip)

    nodeports_last(t)
    forward_rules(t, invalid_drop=True, conntrack_accept=True)

    # Built-in hooks (EnsureRule, not part of the restore input). kubelet created
    # KUBE-FIREWALL's jumps first, kube-proxy then prepends its own in list order.
    ctnew = "-m conntrack --ctstate NEW"
    canary_chains(t)
    prepend_hooks(t, "filter", [
        ("INPUT", jump("kubernetes externally-visible service portals", ctnew),
         "KUBE-EXTERNAL-SERVICES"),
        ("FORWARD", jump("kubernetes externally-visible service portals", ctnew),
         "KUBE-EXTERNAL-SERVICES"),
        ("INPUT", jump("kubernetes health check service ports"), "KUBE-NODEPORTS"),
        ("FORWARD", jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("OUTPUT", jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("FORWARD", jump("kubernetes forwarding rules"), "KUBE-FORWARD"),
        ("INPUT", jump("kubernetes load balancer firewall", ctnew), "KUBE-PROXY-FIREWALL"),
        ("OUTPUT", jump("kubernetes load balancer firewall", ctnew), "KUBE-PROXY-FIREWALL"),
        ("FORWARD", jump("kubernetes load balancer firewall", ctnew), "KUBE-PROXY-FIREWALL"),
    ], existing={"INPUT": ["-A INPUT -j KUBE-FIREWALL"], "OUTPUT": ["-A OUTPUT -j KUBE-FIREWALL"]})
    nat_hooks(t)
    return t


def iptables_rules(ports: Iterable[ServicePort], *, cluster_cidr: str | None,
                   node_ip: str | None = None, family: int = 4,
                   backend: str | None = "legacy") -> str:
    """What ``iptables-save`` (``ip6tables-save``) prints, nat and filter, on a node whose
    kube-proxy runs in iptables mode for ``ports``; ``backend`` only changes the header
    line ("nft": ``iptables-nft-save ... (nf_tables)``; None: no comment lines)."""
    return iptables_tables(ports, cluster_cidr=cluster_cidr, node_ip=node_ip,
                           family=family).save_text(backend)


def _in_range(addr: str | None, ranges: Sequence[str]) -> bool:
    if not addr:
        return False
    try:
        ip = ipaddress.ip_address(addr)
        return any(ip in ipaddress.ip_network(r, strict=False) for r in ranges)
    except ValueError:
        return False


def _service_port(t: Tables, sp: ServicePort, cluster_cidr: str | None,
                  node_ip: str | None) -> None:
    name = sp.key
    proto = sp.protocol.lower()
    h = chain_hash(name, proto)
    svc_chain, svl_chain, ext_chain = "KUBE-SVC-" + h, "KUBE-SVL-" + h, "KUBE-EXT-" + h
    eps = list(sp.endpoints)
    local_eps = [e for e in eps if e.local]
    has_endpoints = bool(eps)
    ext_local = sp.external_policy_local
    has_external_eps = has_endpoints and (bool(local_eps) if ext_local else True)
    uses_local_chain = bool(local_eps) and ext_local  # UsesLocalEndpoints (ITP=Cluster)
    uses_ext_chain = has_endpoints and sp.externally_accessible
    ext_policy_chain = svl_chain if ext_local else svc_chain
    if not has_endpoints:
        filter_target, filter_comment = "REJECT", f"{name} has no endpoints"
    else:
        filter_target, filter_comment = "DROP", f"{name} has no local endpoints"

    # Capture the clusterIP.
    if has_endpoints:
        t.rule("nat", "KUBE-SERVICES", svc_chain, comment=f"{name} cluster IP", proto=proto,
               dst=sp.cluster_ip, dport=sp.port)
    else:
        _filter_drop(t, "KUBE-SERVICES", "REJECT", f"{name} has no endpoints", proto,
                     sp.cluster_ip, sp.port)
    for ip in sp.external_ips:
        if has_endpoints:
            t.rule("nat", "KUBE-SERVICES", ext_chain, comment=f"{name} external IP",
                   proto=proto, dst=ip, dport=sp.port)
        if not has_external_eps:
            _filter_drop(t, "KUBE-EXTERNAL-SERVICES", filter_target, filter_comment, proto,
                         ip, sp.port)
    fw_chain = "KUBE-FW-" + h
    uses_fw = bool(sp.lb_ips and sp.source_ranges and has_endpoints)  # UsesFWChain
    for lb_ip in sp.lb_ips:
        if has_endpoints:
            t.rule("nat", "KUBE-SERVICES", fw_chain if uses_fw else ext_chain,
                   comment=f"{name} loadbalancer IP", proto=proto, dst=lb_ip,
                   dport=sp.port)
        if uses_fw:
            t.rule("filter", "KUBE-PROXY-FIREWALL", "DROP",
                   comment=f"{name} traffic not accepted by {fw_chain}", proto=proto,
                   dst=lb_ip, dport=sp.port)
        if not has_external_eps:
            _filter_drop(t, "KUBE-EXTERNAL-SERVICES", filter_target, filter_comment, proto,
                         lb_ip, sp.port)
    if sp.node_port:
        if has_endpoints:
            t.rule("nat", "KUBE-NODEPORTS", ext_chain, comment=name, proto=proto,
                   dport=sp.node_port)
        if not has_external_eps:
            t.rule("filter", "KUBE-EXTERNAL-SERVICES", filter_target, comment=filter_comment,
                   pre="-m addrtype --dst-type LOCAL", proto=proto, dport=sp.node_port,
                   save_topts=_reject_opts(t) if filter_target == "REJECT" else "")
    if sp.health_check_node_port:
        t.rule("filter", "KUBE-NODEPORTS", "ACCEPT", comment=f"{name} health check node port",
               proto="tcp", dport=sp.health_check_node_port)

    # Internal traffic: masquerade off-cluster sources (only with a local detector).
    if has_endpoints and cluster_cidr:
        t.rule("nat", svc_chain, "KUBE-MARK-MASQ", comment=f"{name} cluster IP", proto=proto,
               dst=sp.cluster_ip, dport=sp.port, src=cluster_cidr, nsrc=True)

    if uses_ext_chain:
        t.chain("nat", ext_chain)
        if not ext_local:
            t.rule("nat", ext_chain, "KUBE-MARK-MASQ",
                   comment=f"masquerade traffic for {name} external destinations")
        else:
            if cluster_cidr:
                # pod -> external VIP short-circuits to the cluster chain, "as if" it had
                # gone out to the LB and come back
                t.rule("nat", ext_chain, svc_chain,
                       comment=f"pod traffic for {name} external destinations", src=cluster_cidr)
            t.rule("nat", ext_chain, "KUBE-MARK-MASQ",
                   comment=f"masquerade LOCAL traffic for {name} external destinations",
                   pre="-m addrtype --src-type LOCAL")
            t.rule("nat", ext_chain, svc_chain,
                   comment=f"route LOCAL traffic for {name} external destinations",
                   pre="-m addrtype --src-type LOCAL")
        if has_external_eps:
            t.rule("nat", ext_chain, ext_policy_chain)

    if uses_fw:
        t.chain("nat", fw_chain)
        for src in sp.source_ranges:
            t.rule("nat", fw_chain, ext_chain, comment=f"{name} loadbalancer IP", src=src)
        # a range holding the node's own address: the node's traffic to its (local) VIP
        # comes from the VIP itself (allowFromNode)
        if _in_range(node_ip, sp.source_ranges):
            for lb_ip in sp.lb_ips:
                t.rule("nat", fw_chain, ext_chain, comment=f"{name} loadbalancer IP",
                       src=lb_ip)
        # a rule without a target: what falls off the chain is not DNATed, and filter's
        # KUBE-PROXY-FIREWALL drops it
        kp = (f"-A {fw_chain} -m comment --comment "
              f'"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL"')
        t.raw("nat", fw_chain, kp, kp)

    if has_endpoints:  # usesClusterPolicyChain (ITP=Cluster)
        t.chain("nat", svc_chain)
        _endpoint_rules(t, name, proto, svc_chain, eps)
    if uses_local_chain:
        t.chain("nat", svl_chain)
        _endpoint_rules(t, name, proto, svl_chain, local_eps)
    for e in eps:
        ep = host_port(e.ip, e.port)
        sep = "KUBE-SEP-" + endpoint_chain_hash(name, proto, ep)
        t.chain("nat", sep)
        comment = None if t.large_cluster else name
        t.rule("nat", sep, "KUBE-MARK-MASQ", comment=comment, src=e.ip)  # hairpin
        t.rule("nat", sep, "DNAT", comment=comment, proto=proto, topts="--to-destination " + ep)


def _endpoint_rules(t: Tables, name: str, proto: str, chain: str,
                    eps: Sequence[Endpoint]) -> None:
    n = len(eps)
    for i, e in enumerate(eps):
        ep = host_port(e.ip, e.port)
        sep = "KUBE-SEP-" + endpoint_chain_hash(name, proto, ep)
        t.rule("nat", chain, sep, comment=None if t.large_cluster else f"{name} -> {ep}",
               prob=n - i if i < n - 1 else 0)


def _filter_drop(t: Tables, chain: str, target: str, comment: str, proto: str, ip: str,
                 port: int) -> None:
    # kube-proxy writes a bare "-j REJECT"; iptables-save prints the default reject-with
    t.rule("filter", chain, target, comment=comment, proto=proto, dst=ip, dport=port,
           save_topts=_reject_opts(t) if target == "REJECT" else "")


def _reject_opts(t: Tables) -> str:
    return REJECT_OPTS6 if t.family == 6 else REJECT_OPTS
