"""kube-proxy's IPVS mode: the KUBE-* ipsets, the set-matching nat rules, the kube-ipvs0
addresses and the IPVS virtual servers."""


from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lab.kube_proxy_rules.common import (
    _KP_MARK,
    _MARK,
    LbService,
    _jump,
    _prepend_hooks,
    _Tables,
    forward_rules,
    host_port,
    nat_hooks,
)

# --- IPVS mode -------------------------------------------------------------------------


# pkg/proxy/ipvs/ipset.go: name, type, and the comment kube-proxy attaches to the
# iptables rules matching the set (ipset itself stores no comment: sets are created
# without the "comment" extension).
IPVS_SETS: tuple[tuple[str, str, str], ...] = (
    ("KUBE-LOOP-BACK", "hash:ip,port,ip",
     "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"),
    ("KUBE-CLUSTER-IP", "hash:ip,port",
     "Kubernetes service cluster ip + port for masquerade purpose"),
    ("KUBE-EXTERNAL-IP", "hash:ip,port",
     "Kubernetes service external ip + port for masquerade and filter purpose"),
    ("KUBE-EXTERNAL-IP-LOCAL", "hash:ip,port",
     "Kubernetes service external ip + port with externalTrafficPolicy=local"),
    ("KUBE-LOAD-BALANCER", "hash:ip,port", "Kubernetes service lb portal"),
    ("KUBE-LOAD-BALANCER-FW", "hash:ip,port",
     "Kubernetes service load balancer ip + port for load balancer with sourceRange"),
    ("KUBE-LOAD-BALANCER-LOCAL", "hash:ip,port",
     "Kubernetes service load balancer ip + port with externalTrafficPolicy=local"),
    ("KUBE-LOAD-BALANCER-SOURCE-IP", "hash:ip,port,ip",
     "Kubernetes service load balancer ip + port + source IP for packet filter purpose"),
    ("KUBE-LOAD-BALANCER-SOURCE-CIDR", "hash:ip,port,net",
     "Kubernetes service load balancer ip + port + source cidr for packet filter purpose"),
    ("KUBE-NODE-PORT-TCP", "bitmap:port", "Kubernetes nodeport TCP port for masquerade purpose"),
    ("KUBE-NODE-PORT-LOCAL-TCP", "bitmap:port",
     "Kubernetes nodeport TCP port with externalTrafficPolicy=local"),
    ("KUBE-NODE-PORT-UDP", "bitmap:port", "Kubernetes nodeport UDP port for masquerade purpose"),
    ("KUBE-NODE-PORT-LOCAL-UDP", "bitmap:port",
     "Kubernetes nodeport UDP port with externalTrafficPolicy=local"),
    ("KUBE-NODE-PORT-SCTP-HASH", "hash:ip,port",
     "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'"),
    ("KUBE-NODE-PORT-LOCAL-SCTP-HASH", "hash:ip,port",
     "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'"),
    ("KUBE-HEALTH-CHECK-NODE-PORT", "bitmap:port", "Kubernetes health check node port"),
    ("KUBE-IPVS-IPS", "hash:ip", "Addresses on the ipvs interface"),
)
_SET_COMMENT = {name: comment for name, _type, comment in IPVS_SETS}


def set_name(name: str, family: int = 4) -> str:
    """kube-proxy's IPv6 proxier names its sets "KUBE-6-..." (pkg/proxy/ipvs/ipset.go
    NewIPSet), cut to ipset's 31 characters (KUBE-6-LOAD-BALANCER-SOURCE-CID)."""
    return ("KUBE-6-" + name[5:])[:31] if family == 6 else name


@dataclass(frozen=True)
class IpvsNodeState:
    """Everything kube-proxy's IPVS proxier leaves on the node."""

    ipset_restore: str  # `ipset restore` input creating and filling every KUBE-* set
    iptables_restore: str  # nat + filter, iptables-save rendering incl. built-in hooks
    kube_ipvs0_addresses: tuple[str, ...]  # bound on kube-ipvs0 as /32
    ipvsadm_save: str  # `ipvsadm -S -n`
    ipset_save: str = ""  # what `ipset save` prints (bucketsize/initval added)


def _ipset_text(members: Mapping[str, Iterable[str]], save_form: bool, family: int = 4) -> str:
    out: list[str] = []
    inet = "inet6" if family == 6 else "inet"
    for base, stype, _comment in IPVS_SETS:
        name = set_name(base, family)
        if stype == "bitmap:port":
            out.append(f"create {name} {stype} range 0-65535")
        elif save_form:
            # ipset 7.x save adds bucketsize and a random initval; make it stable
            initval = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
            out.append(f"create {name} {stype} family {inet} hashsize 1024 maxelem 65536 "
                       f"bucketsize 12 initval 0x{initval:08x}")
        else:
            out.append(f"create {name} {stype} family {inet} hashsize 1024 maxelem 65536")
        out.extend(f"add {name} {m}" for m in members.get(base, ()))
    return "\n".join(out) + "\n"


def ipvs_mode(services: Iterable[LbService], *, bind_lb_ip: bool, cluster_cidr: str | None,
              node_ip: str, backend: str = "legacy", family: int = 4) -> IpvsNodeState:
    """kube-proxy in IPVS mode. ``bind_lb_ip=False`` is TKE's variant that does not put
    the LoadBalancer ingress IP on kube-ipvs0 (the upstream proxier binds it, PR 63066);
    its ipsets and iptables rules are the same as upstream's. ``family`` 6: the IPv6
    proxier of a dual-stack node (KUBE-6-* sets, ip6tables rules, [addr]:port servers)."""
    svcs = sorted(services, key=lambda s: s.port_name_key)
    sets: dict[str, list[str]] = {name: [] for name, _t, _c in IPVS_SETS}
    bound: list[str] = []
    vs_lines: list[str] = []

    def virtual_server(proto: str, addr: str, port: int, eps: Sequence[str],
                       target_port: int) -> None:
        flag = {"tcp": "-t", "udp": "-u", "sctp": "--sctp-service"}[proto]
        vs = f"{flag} {host_port(addr, port)}"
        vs_lines.append(f"-A {vs} -s rr")
        vs_lines.extend(f"-a {vs} -r {host_port(ip, target_port)} -m -w 1" for ip in eps)

    for svc in svcs:
        proto = svc.protocol.lower()
        eps = svc.endpoints()
        all_ips = [ip for ip, _l in eps]
        local_ips = [ip for ip, local in eps if local]
        ext_local = svc.external_policy_local
        # eTP=Local virtual servers get the local endpoints, or all of them when there
        # are none (kubernetes PR 97081: pods may still reach the VIP).
        ext_ips = (local_ips or all_ips) if ext_local else all_ips
        for ip in local_ips:
            sets["KUBE-LOOP-BACK"].append(f"{ip},{proto}:{svc.target_port},{ip}")
        sets["KUBE-CLUSTER-IP"].append(f"{svc.cluster_ip},{proto}:{svc.port}")
        virtual_server(proto, svc.cluster_ip, svc.port, all_ips, svc.target_port)
        bound.append(svc.cluster_ip)
        for ip in svc.external_ips:
            sets["KUBE-EXTERNAL-IP-LOCAL" if ext_local else "KUBE-EXTERNAL-IP"].append(
                f"{ip},{proto}:{svc.port}")
            virtual_server(proto, ip, svc.port, ext_ips, svc.target_port)
            bound.append(ip)
        if svc.lb_ip:
            sets["KUBE-LOAD-BALANCER"].append(f"{svc.lb_ip},{proto}:{svc.port}")
            if ext_local:
                sets["KUBE-LOAD-BALANCER-LOCAL"].append(f"{svc.lb_ip},{proto}:{svc.port}")
            virtual_server(proto, svc.lb_ip, svc.port, ext_ips, svc.target_port)
            if bind_lb_ip:
                bound.append(svc.lb_ip)
        if svc.node_port:
            if proto in ("tcp", "udp"):
                sets[f"KUBE-NODE-PORT-{proto.upper()}"].append(str(svc.node_port))
                if ext_local:
                    sets[f"KUBE-NODE-PORT-LOCAL-{proto.upper()}"].append(str(svc.node_port))
            virtual_server(proto, node_ip, svc.node_port, ext_ips, svc.target_port)
        if svc.health_check_node_port:
            sets["KUBE-HEALTH-CHECK-NODE-PORT"].append(str(svc.health_check_node_port))
    bound_unique = tuple(dict.fromkeys(bound))
    sets["KUBE-IPVS-IPS"] = list(bound_unique)
    # sets hold each member once (two services may share a local pod IP:port)
    for name, stype, _c in IPVS_SETS:
        members = dict.fromkeys(sets[name])
        sets[name] = sorted(members, key=int) if stype == "bitmap:port" else list(members)

    t = _ipvs_tables(sets, cluster_cidr, family)
    return IpvsNodeState(
        ipset_restore=_ipset_text(sets, save_form=False, family=family),
        iptables_restore=t.save_text(backend),
        kube_ipvs0_addresses=bound_unique,
        ipvsadm_save="\n".join(vs_lines) + "\n" if vs_lines else "",
        ipset_save=_ipset_text(sets, save_form=True, family=family),
    )


def _ipvs_tables(sets: Mapping[str, Sequence[str]], cluster_cidr: str | None,
                 family: int = 4) -> _Tables:
    """pkg/proxy/ipvs/proxier.go writeIptablesRules, in its order (``sets`` by their IPv4
    names; the rules name them as ``family``'s proxier does)."""
    t = _Tables(("nat", "filter"), family)

    def sn(name: str) -> str:
        return set_name(name, family)

    for c in ("KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER",
              "KUBE-MARK-MASQ"):
        t.chain("nat", c)
    for c in ("KUBE-FORWARD", "KUBE-NODE-PORT", "KUBE-PROXY-FIREWALL",
              "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER"):
        t.chain("filter", c)

    def cm(name: str) -> str:
        return '"' + _SET_COMMENT[name] + '"'  # getComment() always quotes

    def set_rule(table: str, chain: str, name: str, match: str, target: str,
                 proto: str = "") -> None:
        if not sets.get(name):
            return
        p = f"-p {proto} " if proto else ""
        line = (f"-A {chain} {p}-m comment --comment {cm(name)} -m set --match-set {sn(name)} "
                f"{match} -j {target}")
        t.raw(table, chain, line, line)

    if family == 4:  # (127.0.0.0/8 has no IPv6 counterpart here)
        t.rule("nat", "KUBE-SERVICES", "RETURN", src="127.0.0.0/8")
    # ipsetWithIptablesChain, in order
    set_rule("nat", "KUBE-POSTROUTING", "KUBE-LOOP-BACK", "dst,dst,src", "MASQUERADE")
    set_rule("nat", "KUBE-SERVICES", "KUBE-LOAD-BALANCER", "dst,dst", "KUBE-LOAD-BALANCER")
    set_rule("nat", "KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-LOCAL", "dst,dst", "RETURN")
    set_rule("nat", "KUBE-NODE-PORT", "KUBE-NODE-PORT-LOCAL-TCP", "dst", "RETURN", "tcp")
    set_rule("nat", "KUBE-NODE-PORT", "KUBE-NODE-PORT-TCP", "dst", "KUBE-MARK-MASQ", "tcp")
    set_rule("nat", "KUBE-NODE-PORT", "KUBE-NODE-PORT-LOCAL-UDP", "dst", "RETURN", "udp")
    set_rule("nat", "KUBE-NODE-PORT", "KUBE-NODE-PORT-UDP", "dst", "KUBE-MARK-MASQ", "udp")
    set_rule("filter", "KUBE-PROXY-FIREWALL", "KUBE-LOAD-BALANCER-FW", "dst,dst",
             "KUBE-SOURCE-RANGES-FIREWALL")
    set_rule("filter", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-LOAD-BALANCER-SOURCE-CIDR",
             "dst,dst,src", "RETURN")
    set_rule("filter", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-LOAD-BALANCER-SOURCE-IP",
             "dst,dst,src", "RETURN")
    if sets.get("KUBE-CLUSTER-IP"):
        base = (f"-m comment --comment {cm('KUBE-CLUSTER-IP')} -m set --match-set "
                f"{sn('KUBE-CLUSTER-IP')}")
        if cluster_cidr:
            t.raw("nat", "KUBE-SERVICES",
                  f"-A KUBE-SERVICES {base} dst,dst ! -s {cluster_cidr} -j KUBE-MARK-MASQ",
                  f"-A KUBE-SERVICES ! -s {cluster_cidr} {base} dst,dst -j KUBE-MARK-MASQ")
        else:
            # no local detector: masquerade node-originated traffic sourced from a VIP
            line = f"-A KUBE-SERVICES {base} src,dst -j KUBE-MARK-MASQ"
            t.raw("nat", "KUBE-SERVICES", line, line)
    for name in ("KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL"):
        if not sets.get(name):
            continue
        base = (f"-A KUBE-SERVICES -m comment --comment {cm(name)} -m set --match-set "
                f"{sn(name)} dst,dst")
        if name == "KUBE-EXTERNAL-IP":
            t.raw("nat", "KUBE-SERVICES", base + " -j KUBE-MARK-MASQ", base + " -j KUBE-MARK-MASQ")
        for extra in ("-m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL",
                      "-m addrtype --dst-type LOCAL"):
            t.raw("nat", "KUBE-SERVICES", f"{base} {extra} -j ACCEPT", f"{base} {extra} -j ACCEPT")
    t.rule("nat", "KUBE-SERVICES", "KUBE-NODE-PORT", pre="-m addrtype --dst-type LOCAL")
    t.rule("nat", "KUBE-LOAD-BALANCER", "KUBE-MARK-MASQ")
    t.rule("filter", "KUBE-SOURCE-RANGES-FIREWALL", "DROP")
    for name in ("KUBE-CLUSTER-IP", "KUBE-LOAD-BALANCER"):  # acceptIPVSTraffic
        if sets.get(name):
            t.rule("nat", "KUBE-SERVICES", "ACCEPT",
                   pre=f"-m set --match-set {sn(name)} dst,dst")
    forward_rules(t, invalid_drop=False, conntrack_accept=True)
    hc = "KUBE-HEALTH-CHECK-NODE-PORT"
    line = (f"-A KUBE-NODE-PORT -m comment --comment {cm(hc)} -m set --match-set {sn(hc)} dst "
            "-j ACCEPT")
    t.raw("filter", "KUBE-NODE-PORT", line, line)
    for name, match in (("KUBE-LOAD-BALANCER", "dst,dst"), ("KUBE-CLUSTER-IP", "dst,dst"),
                        ("KUBE-EXTERNAL-IP", "dst,dst"), ("KUBE-EXTERNAL-IP-LOCAL", "dst,dst"),
                        (hc, "dst")):
        t.rule("filter", "KUBE-IPVS-FILTER", "RETURN",
               pre=f"-m set --match-set {sn(name)} {match}")
    reject = ("-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set "
              f"{sn('KUBE-IPVS-IPS')} dst -j REJECT")
    t.raw("filter", "KUBE-IPVS-FILTER", reject,
          reject + (" --reject-with icmp6-port-unreachable" if family == 6
                    else " --reject-with icmp-port-unreachable"))
    t.raw("nat", "KUBE-POSTROUTING",
          f"-A KUBE-POSTROUTING -m mark ! --mark {_KP_MARK}/{_KP_MARK} -j RETURN",
          f"-A KUBE-POSTROUTING -m mark ! --mark {_MARK}/{_MARK} -j RETURN")
    t.raw("nat", "KUBE-POSTROUTING", f"-A KUBE-POSTROUTING -j MARK --xor-mark {_KP_MARK}",
          f"-A KUBE-POSTROUTING -j MARK --set-xmark {_MARK}/0x0")
    t.rule("nat", "KUBE-POSTROUTING", "MASQUERADE",
           comment="kubernetes service traffic requiring SNAT", topts="--random-fully")
    t.raw("nat", "KUBE-MARK-MASQ", f"-A KUBE-MARK-MASQ -j MARK --or-mark {_KP_MARK}",
          f"-A KUBE-MARK-MASQ -j MARK --set-xmark {_MARK}/{_MARK}")

    # createAndLinkKubeChain: EnsureRule(Prepend) in iptablesJumpChain order
    nat_hooks(t)
    _prepend_hooks(t, "filter", [
        ("FORWARD", _jump("kubernetes forwarding rules"), "KUBE-FORWARD"),
        ("INPUT", _jump("kubernetes health check rules"), "KUBE-NODE-PORT"),
        ("INPUT", _jump("kube-proxy firewall rules"), "KUBE-PROXY-FIREWALL"),
        ("FORWARD", _jump("kube-proxy firewall rules"), "KUBE-PROXY-FIREWALL"),
        ("INPUT", _jump("kubernetes ipvs access filter"), "KUBE-IPVS-FILTER"),
        ("OUTPUT", _jump("kubernetes ipvs access filter"), "KUBE-IPVS-OUT-FILTER"),
    ])
    return t


