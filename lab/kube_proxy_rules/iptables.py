"""kube-proxy's iptables mode, both generations: the new one (KUBE-EXT/SVL, v1.24+) is
the agent's own (agent.predict.iptables, which `check --what-if iptables` writes), given
the lab's service ports; the old one (KUBE-XLB/FW, v1.18/v1.19), which no prediction
targets, is the lab's alone, written through the same accumulator
(agent.predict.xtables)."""


from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from agent.predict.iptables import iptables_tables
from lab.kube_proxy_rules.common import (
    _DROP_MARK,
    _KP_MARK,
    _LARGE_CLUSTER_ENDPOINTS,
    _MARK,
    _REJECT_OPTS,
    LbService,
    _cidr,
    _jump,
    _prepend_hooks,
    _Tables,
    canary_chains,
    chain_hash,
    endpoint_chain_hash,
    forward_rules,
    nat_hooks,
    nodeports_last,
    service_port,
)


def _total_endpoints(services: Sequence[LbService]) -> int:
    return sum(len(s.local_endpoints) + len(s.remote_endpoints) for s in services)


def _filter_drop(t: _Tables, chain: str, target: str, comment: str, proto: str, ip: str,
                 port: int) -> None:
    # kube-proxy writes a bare "-j REJECT"; iptables-save prints the default reject-with
    t.rule("filter", chain, target, comment=comment, proto=proto, dst=ip, dport=port,
           save_topts=_REJECT_OPTS if target == "REJECT" else "")


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
                     cluster_cidr: str | None, node_ip: str | None, family: int = 4) -> _Tables:
    if generation == "new":
        return iptables_tables([service_port(s) for s in services], cluster_cidr=cluster_cidr,
                               node_ip=node_ip, family=family)
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
    ``iptables-nft-save ... (nf_tables)``). ``node_ip``: kube-proxy's node address (the
    new generation lets the node's own traffic through a loadBalancerSourceRanges that
    holds it).
    """
    return _iptables_tables(services, generation, cluster_cidr, node_ip,
                            family).save_text(backend)


def kube_proxy_restore_input(services: Iterable[LbService], *, generation: str = "new",
                             cluster_cidr: str | None, node_ip: str, family: int = 4) -> str:
    """What kube-proxy itself feeds to ``iptables-restore --noflush`` for one full sync:
    no header or counters, ``:CHAIN - [0:0]`` lines, bare IPs, kube-proxy's argument
    order, ``--or-mark 0x004000``, and no jumps from the built-in chains (those are
    made with separate ``iptables -I`` calls). The old generation references kubelet's
    KUBE-MARK-DROP, which must exist before this is restored.
    """
    return _iptables_tables(services, generation, cluster_cidr, node_ip,
                            family).restore_input()
