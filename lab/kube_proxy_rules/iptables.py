"""kube-proxy's iptables mode, both generations (KUBE-EXT/SVL, v1.24+; KUBE-XLB/FW,
v1.18/v1.19)."""


from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lab.kube_proxy_rules.common import (
    _DROP_MARK,
    _KP_MARK,
    _LARGE_CLUSTER_ENDPOINTS,
    _MARK,
    _REJECT_OPTS,
    _REJECT_OPTS6,
    LbService,
    _cidr,
    _jump,
    _prepend_hooks,
    _Tables,
    canary_chains,
    chain_hash,
    endpoint_chain_hash,
    forward_rules,
    host_port,
    nat_hooks,
    nodeports_last,
)

# --- iptables mode ---------------------------------------------------------------------


def _iptables_new(services: Iterable[LbService], cluster_cidr: str | None,
                  family: int = 4) -> _Tables:
    """pkg/proxy/iptables/proxier.go syncProxyRules (v1.28+), one full sync; ``family``
    6: the IPv6 proxier of a dual-stack node (its services' addresses are IPv6)."""
    t = _Tables(("filter", "nat"), family)
    for c in ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS",
              "KUBE-PROXY-FIREWALL"):
        t.chain("filter", c)
    for c in ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"):
        t.chain("nat", c)
    t.raw("nat", "KUBE-POSTROUTING",
          f"-A KUBE-POSTROUTING -m mark ! --mark {_KP_MARK}/{_KP_MARK} -j RETURN",
          f"-A KUBE-POSTROUTING -m mark ! --mark {_MARK}/{_MARK} -j RETURN")
    # clear the mark so a re-traversing packet is not masqueraded twice
    t.raw("nat", "KUBE-POSTROUTING", f"-A KUBE-POSTROUTING -j MARK --xor-mark {_KP_MARK}",
          f"-A KUBE-POSTROUTING -j MARK --set-xmark {_MARK}/0x0")
    t.rule("nat", "KUBE-POSTROUTING", "MASQUERADE",
           comment="kubernetes service traffic requiring SNAT", topts="--random-fully")
    t.raw("nat", "KUBE-MARK-MASQ", f"-A KUBE-MARK-MASQ -j MARK --or-mark {_KP_MARK}",
          f"-A KUBE-MARK-MASQ -j MARK --set-xmark {_MARK}/{_MARK}")
    # localhostNodePorts (default true): route_localnet=1 plus this guard rule (IPv4
    # only: IPv6 has no route_localnet, and kube-proxy writes it for IPv4 alone)
    t.chain("filter", "KUBE-FIREWALL")
    if family == 4:
        t.rule("filter", "KUBE-FIREWALL", "DROP",
               comment="block incoming localnet connections", dst="127.0.0.0/8",
               src="127.0.0.0/8", nsrc=True,
               post="-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT")

    svcs = sorted(services, key=lambda s: s.port_name_key)
    t.large_cluster = _total_endpoints(svcs) > _LARGE_CLUSTER_ENDPOINTS
    for svc in svcs:
        _new_service(t, svc, cluster_cidr)

    nodeports_last(t)
    forward_rules(t, invalid_drop=True, conntrack_accept=True)

    # Built-in hooks (EnsureRule, not part of the restore input). kubelet created
    # KUBE-FIREWALL's jumps first, kube-proxy then prepends its own in list order.
    ctnew = "-m conntrack --ctstate NEW"
    canary_chains(t)
    _prepend_hooks(t, "filter", [
        ("INPUT", _jump("kubernetes externally-visible service portals", ctnew),
         "KUBE-EXTERNAL-SERVICES"),
        ("FORWARD", _jump("kubernetes externally-visible service portals", ctnew),
         "KUBE-EXTERNAL-SERVICES"),
        ("INPUT", _jump("kubernetes health check service ports"), "KUBE-NODEPORTS"),
        ("FORWARD", _jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("OUTPUT", _jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("FORWARD", _jump("kubernetes forwarding rules"), "KUBE-FORWARD"),
        ("INPUT", _jump("kubernetes load balancer firewall", ctnew), "KUBE-PROXY-FIREWALL"),
        ("OUTPUT", _jump("kubernetes load balancer firewall", ctnew), "KUBE-PROXY-FIREWALL"),
        ("FORWARD", _jump("kubernetes load balancer firewall", ctnew), "KUBE-PROXY-FIREWALL"),
    ], existing={"INPUT": ["-A INPUT -j KUBE-FIREWALL"], "OUTPUT": ["-A OUTPUT -j KUBE-FIREWALL"]})
    nat_hooks(t)
    return t


def _new_service(t: _Tables, svc: LbService, cluster_cidr: str | None) -> None:
    name = svc.port_name_key
    proto = svc.protocol.lower()
    h = chain_hash(name, proto)
    svc_chain, svl_chain, ext_chain = "KUBE-SVC-" + h, "KUBE-SVL-" + h, "KUBE-EXT-" + h
    eps = svc.endpoints()
    local_eps = [e for e in eps if e[1]]
    has_endpoints = bool(eps)
    ext_local = svc.external_policy_local
    has_external_eps = has_endpoints and (bool(local_eps) if ext_local else True)
    uses_local_chain = bool(local_eps) and ext_local  # UsesLocalEndpoints (ITP=Cluster)
    uses_ext_chain = has_endpoints and svc.externally_accessible
    ext_policy_chain = svl_chain if ext_local else svc_chain
    if not has_endpoints:
        filter_target, filter_comment = "REJECT", f"{name} has no endpoints"
    else:
        filter_target, filter_comment = "DROP", f"{name} has no local endpoints"

    # Capture the clusterIP.
    if has_endpoints:
        t.rule("nat", "KUBE-SERVICES", svc_chain, comment=f"{name} cluster IP", proto=proto,
               dst=svc.cluster_ip, dport=svc.port)
    else:
        _filter_drop(t, "KUBE-SERVICES", "REJECT", f"{name} has no endpoints", proto,
                     svc.cluster_ip, svc.port)
    for ip in svc.external_ips:
        if has_endpoints:
            t.rule("nat", "KUBE-SERVICES", ext_chain, comment=f"{name} external IP",
                   proto=proto, dst=ip, dport=svc.port)
        if not has_external_eps:
            _filter_drop(t, "KUBE-EXTERNAL-SERVICES", filter_target, filter_comment, proto,
                         ip, svc.port)
    fw_chain = "KUBE-FW-" + h
    uses_fw = bool(svc.lb_ip and svc.source_ranges and has_endpoints)  # UsesFWChain
    if svc.lb_ip:
        if has_endpoints:
            t.rule("nat", "KUBE-SERVICES", fw_chain if uses_fw else ext_chain,
                   comment=f"{name} loadbalancer IP", proto=proto, dst=svc.lb_ip,
                   dport=svc.port)
        if uses_fw:
            t.rule("filter", "KUBE-PROXY-FIREWALL", "DROP",
                   comment=f"{name} traffic not accepted by {fw_chain}", proto=proto,
                   dst=svc.lb_ip, dport=svc.port)
        if not has_external_eps:
            _filter_drop(t, "KUBE-EXTERNAL-SERVICES", filter_target, filter_comment, proto,
                         svc.lb_ip, svc.port)
    if svc.node_port:
        if has_endpoints:
            t.rule("nat", "KUBE-NODEPORTS", ext_chain, comment=name, proto=proto,
                   dport=svc.node_port)
        if not has_external_eps:
            t.rule("filter", "KUBE-EXTERNAL-SERVICES", filter_target, comment=filter_comment,
                   pre="-m addrtype --dst-type LOCAL", proto=proto, dport=svc.node_port,
                   save_topts=_reject_opts(t) if filter_target == "REJECT" else "")
    if svc.health_check_node_port:
        t.rule("filter", "KUBE-NODEPORTS", "ACCEPT", comment=f"{name} health check node port",
               proto="tcp", dport=svc.health_check_node_port)

    # Internal traffic: masquerade off-cluster sources (only with a local detector).
    if has_endpoints and cluster_cidr:
        t.rule("nat", svc_chain, "KUBE-MARK-MASQ", comment=f"{name} cluster IP", proto=proto,
               dst=svc.cluster_ip, dport=svc.port, src=cluster_cidr, nsrc=True)

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
        for src in svc.source_ranges:
            t.rule("nat", fw_chain, ext_chain, comment=f"{name} loadbalancer IP", src=src)
        # a rule without a target: what falls off the chain is not DNATed, and filter's
        # KUBE-PROXY-FIREWALL drops it
        kp = (f"-A {fw_chain} -m comment --comment "
              f'"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL"')
        t.raw("nat", fw_chain, kp, kp)

    if has_endpoints:  # usesClusterPolicyChain (ITP=Cluster)
        t.chain("nat", svc_chain)
        _endpoint_rules(t, svc, svc_chain, eps)
    if uses_local_chain:
        t.chain("nat", svl_chain)
        _endpoint_rules(t, svc, svl_chain, local_eps)
    for ip, _local in eps:
        ep = host_port(ip, svc.target_port)
        sep = "KUBE-SEP-" + endpoint_chain_hash(name, proto, ep)
        t.chain("nat", sep)
        comment = None if t.large_cluster else name
        t.rule("nat", sep, "KUBE-MARK-MASQ", comment=comment, src=ip)  # hairpin
        t.rule("nat", sep, "DNAT", comment=comment, proto=proto, topts="--to-destination " + ep)


def _total_endpoints(services: Sequence[LbService]) -> int:
    return sum(len(s.local_endpoints) + len(s.remote_endpoints) for s in services)


def _endpoint_rules(t: _Tables, svc: LbService, chain: str,
                    eps: Sequence[tuple[str, bool]]) -> None:
    name = svc.port_name_key
    proto = svc.protocol.lower()
    n = len(eps)
    for i, (ip, _local) in enumerate(eps):
        ep = host_port(ip, svc.target_port)
        sep = "KUBE-SEP-" + endpoint_chain_hash(name, proto, ep)
        t.rule("nat", chain, sep, comment=None if t.large_cluster else f"{name} -> {ep}",
               prob=n - i if i < n - 1 else 0)


def _filter_drop(t: _Tables, chain: str, target: str, comment: str, proto: str, ip: str,
                 port: int) -> None:
    # kube-proxy writes a bare "-j REJECT"; iptables-save prints the default reject-with
    t.rule("filter", chain, target, comment=comment, proto=proto, dst=ip, dport=port,
           save_topts=_reject_opts(t) if target == "REJECT" else "")


def _reject_opts(t: _Tables) -> str:
    return _REJECT_OPTS6 if t.family == 6 else _REJECT_OPTS


def _iptables_old(services: Iterable[LbService], cluster_cidr: str | None) -> _Tables:
    """The KUBE-XLB-/KUBE-FW- generation (pkg/proxy/iptables/proxier.go, v1.18/v1.19)."""
    t = _Tables(("filter", "nat"))
    for c in ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD"):
        t.chain("filter", c)
    for c in ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"):
        t.chain("nat", c)
    mark = f"{_KP_MARK}/{_KP_MARK}"  # "%#08x/%#08x"
    t.raw("nat", "KUBE-POSTROUTING",
          '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring '
          f'SNAT" -m mark --mark {mark} -j MASQUERADE --random-fully',
          '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring '
          f'SNAT" -m mark --mark {_MARK}/{_MARK} -j MASQUERADE --random-fully')
    t.raw("nat", "KUBE-MARK-MASQ", f"-A KUBE-MARK-MASQ -j MARK --set-xmark {mark}",
          f"-A KUBE-MARK-MASQ -j MARK --set-xmark {_MARK}/{_MARK}")

    svcs = sorted(services, key=lambda s: s.port_name_key)
    t.large_cluster = _total_endpoints(svcs) > _LARGE_CLUSTER_ENDPOINTS
    for svc in svcs:
        _old_service(t, svc, cluster_cidr)

    nodeports_last(t)
    forward_rules(t, invalid_drop=True, conntrack_accept=False)
    if cluster_cidr:
        t.raw("filter", "KUBE-FORWARD",
              f"-A KUBE-FORWARD -s {cluster_cidr} -m comment --comment \"kubernetes forwarding "
              'conntrack pod source rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT',
              f"-A KUBE-FORWARD -s {cluster_cidr} -m comment --comment \"kubernetes forwarding "
              'conntrack pod source rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT')
        t.raw("filter", "KUBE-FORWARD",
              '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack pod '
              f'destination rule" -d {cluster_cidr} -m conntrack --ctstate RELATED,ESTABLISHED'
              " -j ACCEPT",
              f"-A KUBE-FORWARD -d {cluster_cidr} -m comment --comment \"kubernetes forwarding "
              'conntrack pod destination rule" -m conntrack --ctstate RELATED,ESTABLISHED'
              " -j ACCEPT")

    # kubelet's chains of that era (makeIPTablesUtilChains): KUBE-MARK-DROP and the
    # KUBE-FIREWALL that drops what it marks. Not part of kube-proxy's restore input.
    t.chain("nat", "KUBE-MARK-DROP", by_kube_proxy=False)
    t.raw("nat", "KUBE-MARK-DROP", None,
          f"-A KUBE-MARK-DROP -j MARK --set-xmark {_DROP_MARK}/{_DROP_MARK}")
    t.chain("filter", "KUBE-FIREWALL", by_kube_proxy=False)
    t.raw("filter", "KUBE-FIREWALL", None,
          '-A KUBE-FIREWALL -m comment --comment "kubernetes firewall for dropping marked '
          f'packets" -m mark --mark {_DROP_MARK}/{_DROP_MARK} -j DROP')
    t.raw("filter", "KUBE-FIREWALL", None,
          '-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block '
          'incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT'
          " -j DROP")
    ctnew = "-m conntrack --ctstate NEW"
    canary_chains(t)
    _prepend_hooks(t, "filter", [
        ("INPUT", _jump("kubernetes externally-visible service portals", ctnew),
         "KUBE-EXTERNAL-SERVICES"),
        ("FORWARD", _jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("OUTPUT", _jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("INPUT", _jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("FORWARD", _jump("kubernetes forwarding rules"), "KUBE-FORWARD"),
    ], existing={"INPUT": ["-A INPUT -j KUBE-FIREWALL"], "OUTPUT": ["-A OUTPUT -j KUBE-FIREWALL"]})
    nat_hooks(t)
    return t


def _old_service(t: _Tables, svc: LbService, cluster_cidr: str | None) -> None:
    name = svc.port_name_key
    proto = svc.protocol.lower()
    h = chain_hash(name, proto)
    svc_chain, xlb_chain, fw_chain = "KUBE-SVC-" + h, "KUBE-XLB-" + h, "KUBE-FW-" + h
    eps = svc.endpoints()
    has_endpoints = bool(eps)
    only_local = svc.external_policy_local  # OnlyNodeLocalEndpoints()
    # old kube-proxy wrote utilproxy.ToCIDR(ip), i.e. "/32" already in its own input
    cip = _cidr(svc.cluster_ip)

    if has_endpoints:
        t.chain("nat", svc_chain)
    if only_local:
        t.chain("nat", xlb_chain)

    if has_endpoints:
        if cluster_cidr:
            t.rule("nat", "KUBE-SERVICES", "KUBE-MARK-MASQ", comment=f"{name} cluster IP",
                   proto=proto, dst=cip, dport=svc.port, src=cluster_cidr, nsrc=True)
        t.rule("nat", "KUBE-SERVICES", svc_chain, comment=f"{name} cluster IP", proto=proto,
               dst=cip, dport=svc.port)
    else:
        _filter_drop(t, "KUBE-SERVICES", "REJECT", f"{name} has no endpoints", proto, cip,
                     svc.port)

    for ip in svc.external_ips:
        if has_endpoints:
            kw: dict[str, Any] = dict(comment=f"{name} external IP", proto=proto,
                                      dst=_cidr(ip), dport=svc.port)
            t.rule("nat", "KUBE-SERVICES", "KUBE-MARK-MASQ", **kw)
            t.rule("nat", "KUBE-SERVICES", svc_chain,
                   post="-m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL", **kw)
            t.rule("nat", "KUBE-SERVICES", svc_chain, post="-m addrtype --dst-type LOCAL", **kw)
        else:
            _filter_drop(t, "KUBE-EXTERNAL-SERVICES", "REJECT", f"{name} has no endpoints",
                         proto, _cidr(ip), svc.port)

    if svc.lb_ip:
        if has_endpoints:
            t.chain("nat", fw_chain)
            t.rule("nat", "KUBE-SERVICES", fw_chain, comment=f"{name} loadbalancer IP",
                   proto=proto, dst=_cidr(svc.lb_ip), dport=svc.port)
            chosen = xlb_chain
            if not only_local:
                t.rule("nat", fw_chain, "KUBE-MARK-MASQ", comment=f"{name} loadbalancer IP")
                chosen = svc_chain
            t.rule("nat", fw_chain, chosen, comment=f"{name} loadbalancer IP")
            # reaching the end of the firewall chain means "not DNATed": drop it
            t.rule("nat", fw_chain, "KUBE-MARK-DROP", comment=f"{name} loadbalancer IP")
        else:
            _filter_drop(t, "KUBE-SERVICES", "REJECT", f"{name} has no endpoints", proto,
                         _cidr(svc.lb_ip), svc.port)

    if svc.node_port:
        if has_endpoints:
            if not only_local:
                t.rule("nat", "KUBE-NODEPORTS", "KUBE-MARK-MASQ", comment=name, proto=proto,
                       dport=svc.node_port)
                t.rule("nat", "KUBE-NODEPORTS", svc_chain, comment=name, proto=proto,
                       dport=svc.node_port)
            else:
                # "Fix localhost martian source error"
                t.rule("nat", "KUBE-NODEPORTS", "KUBE-MARK-MASQ", comment=name, proto=proto,
                       dport=svc.node_port, src="127.0.0.0/8")
                t.rule("nat", "KUBE-NODEPORTS", xlb_chain, comment=name, proto=proto,
                       dport=svc.node_port)
        else:
            t.rule("filter", "KUBE-EXTERNAL-SERVICES", "REJECT", comment=f"{name} has no endpoints",
                   pre="-m addrtype --dst-type LOCAL", proto=proto, dport=svc.node_port,
                   save_topts=_REJECT_OPTS)

    if not has_endpoints:
        return

    n = len(eps)
    local_seps: list[str] = []
    seps: list[str] = []
    for ip, local in eps:
        sep = "KUBE-SEP-" + endpoint_chain_hash(name, proto, f"{ip}:{svc.target_port}")
        seps.append(sep)
        t.chain("nat", sep)
        if only_local and local:
            local_seps.append(sep)
    for i, ((ip, _local), sep) in enumerate(zip(eps, seps, strict=True)):
        comment = None if t.large_cluster else name
        t.rule("nat", svc_chain, sep, comment=comment, prob=n - i if i < n - 1 else 0)
        t.rule("nat", sep, "KUBE-MARK-MASQ", comment=comment, src=_cidr(ip))
        t.rule("nat", sep, "DNAT", comment=comment, proto=proto,
               topts=f"--to-destination {ip}:{svc.target_port}")

    if not only_local:
        return
    if cluster_cidr:
        t.rule("nat", xlb_chain, svc_chain,
               comment="Redirect pods trying to reach external loadbalancer VIP to clusterIP",
               src=cluster_cidr)
    t.rule("nat", xlb_chain, "KUBE-MARK-MASQ", comment=f"masquerade LOCAL traffic for {name} LB IP",
           pre="-m addrtype --src-type LOCAL")
    t.rule("nat", xlb_chain, svc_chain,
           comment=f"route LOCAL traffic for {name} LB IP to service chain",
           pre="-m addrtype --src-type LOCAL")
    if not local_seps:
        t.rule("nat", xlb_chain, "KUBE-MARK-DROP", comment=f"{name} has no local endpoints")
    nl = len(local_seps)
    for i, sep in enumerate(local_seps):
        t.rule("nat", xlb_chain, sep, comment=f"Balancing rule {i} for {name}",
               prob=nl - i if i < nl - 1 else 0)


def _iptables_tables(services: Iterable[LbService], generation: str,
                     cluster_cidr: str | None, family: int = 4) -> _Tables:
    if generation == "new":
        return _iptables_new(services, cluster_cidr, family)
    if family != 4:
        raise ValueError("the old generation is modelled for IPv4 only")
    if generation == "old":
        return _iptables_old(services, cluster_cidr)
    raise ValueError(f"generation must be 'new' or 'old', not {generation!r}")


def iptables_mode(services: Iterable[LbService], *, generation: str = "new",
                  cluster_cidr: str | None, node_ip: str, backend: str = "legacy",
                  family: int = 4) -> str:
    """What ``iptables-save`` prints (nat and filter) on a node whose kube-proxy runs
    in iptables mode. ``backend`` only changes the header line ("nft" ->
    ``iptables-nft-save ... (nf_tables)``). ``node_ip`` is accepted for symmetry with
    ``ipvs_mode``: the generated rules do not depend on it (nodePortAddresses unset).
    """
    del node_ip
    return _iptables_tables(services, generation, cluster_cidr, family).save_text(backend)


def kube_proxy_restore_input(services: Iterable[LbService], *, generation: str = "new",
                             cluster_cidr: str | None, node_ip: str, family: int = 4) -> str:
    """What kube-proxy itself feeds to ``iptables-restore --noflush`` for one full sync:
    no header or counters, ``:CHAIN - [0:0]`` lines, bare IPs, kube-proxy's argument
    order, ``--or-mark 0x004000``, and no jumps from the built-in chains (those are
    made with separate ``iptables -I`` calls). The old generation references kubelet's
    KUBE-MARK-DROP, which must exist before this is restored.
    """
    del node_ip
    return _iptables_tables(services, generation, cluster_cidr, family).restore_input()


