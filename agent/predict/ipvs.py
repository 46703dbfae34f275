"""What kube-proxy in IPVS mode leaves on a node for its Services (pkg/proxy/ipvs/
proxier.go syncProxyRules and writeIptablesRules, pkg/proxy/ipvs/ipset.go): the KUBE-*
ipsets, the set-matching nat and filter rules (as ``iptables-save`` prints them), the
addresses it binds on the dummy device kube-ipvs0 (every ClusterIP, external IP and, in
the upstream proxier, LoadBalancer ingress IP: "Capture load-balancer ingress",
syncService(..., bindAddr=true)) and the IPVS virtual servers (``ipvsadm -S -n``).

Per Service port: a virtual server for the ClusterIP with every endpoint, one for each
external and load balancer address and one per node address for the NodePort, with the
local endpoints only where externalTrafficPolicy is Local (all of them where the node
has none: kubernetes#97081, v1.21.0); the set entries that pick the masquerade (KUBE-
CLUSTER-IP, KUBE-LOAD-BALANCER(-LOCAL), KUBE-NODE-PORT-*, KUBE-LOOP-BACK for the local
endpoints' hairpin) and loadBalancerSourceRanges (KUBE-LOAD-BALANCER-FW, KUBE-LOAD-
BALANCER-SOURCE-CIDR, and KUBE-LOAD-BALANCER-SOURCE-IP where a range holds the node's
address, "allowFromNode"). ``bind_lb_ip=False`` is TKE's IPVS proxier, which leaves the
load balancer address off kube-ipvs0 (its sets and rules are upstream's).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.predict.model import ServicePort
from agent.predict.xtables import (
    Tables,
    forward_rules,
    host_port,
    jump,
    masquerade_rules,
    nat_hooks,
    prepend_hooks,
)

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


def ipset_text(members: Mapping[str, Iterable[str]], save_form: bool, family: int = 4) -> str:
    """Every KUBE-* set with ``members`` (by the sets' IPv4 names), as `ipset restore`
    takes them or (``save_form``) as `ipset save` prints them."""
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


def _holds(ranges: Sequence[str], addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
        return any(ip in ipaddress.ip_network(r, strict=False) for r in ranges)
    except ValueError:
        return False


def ipvs_mode(ports: Iterable[ServicePort], *, bind_lb_ip: bool, cluster_cidr: str | None,
              node_ips: Sequence[str], backend: str | None = "legacy",
              family: int = 4) -> IpvsNodeState:
    """kube-proxy in IPVS mode for ``ports``. ``node_ips``: the addresses it makes the
    NodePorts' virtual servers on (the node's local addresses but kube-ipvs0's and the
    loopback ones, with --nodeport-addresses unset), the first the node's own address
    (its "nodeIP": a source range holding it lets the node's traffic through).
    ``family`` 6: the IPv6 proxier of a dual-stack node (KUBE-6-* sets, ip6tables
    rules, [addr]:port servers)."""
    svcs = sorted(ports, key=lambda s: s.key)
    sets: dict[str, list[str]] = {name: [] for name, _t, _c in IPVS_SETS}
    bound: list[str] = []
    vs_lines: list[str] = []
    node_ip = node_ips[0] if node_ips else None

    def virtual_server(proto: str, addr: str, port: int, eps: Sequence[tuple[str, int]]
                       ) -> None:
        flag = {"tcp": "-t", "udp": "-u", "sctp": "--sctp-service"}[proto]
        vs = f"{flag} {host_port(addr, port)}"
        vs_lines.append(f"-A {vs} -s rr")
        vs_lines.extend(f"-a {vs} -r {host_port(ip, p)} -m -w 1" for ip, p in eps)

    for sp in svcs:
        proto = sp.protocol.lower()
        all_eps = [(e.ip, e.port) for e in sp.endpoints]
        local_eps = [(e.ip, e.port) for e in sp.endpoints if e.local]
        ext_local = sp.external_policy_local
        # eTP=Local virtual servers get the local endpoints, or all of them when there
        # are none (kubernetes PR 97081: pods may still reach the VIP).
        ext_eps = (local_eps or all_eps) if ext_local else all_eps
        for ip, p in local_eps:
            sets["KUBE-LOOP-BACK"].append(f"{ip},{proto}:{p},{ip}")
        sets["KUBE-CLUSTER-IP"].append(f"{sp.cluster_ip},{proto}:{sp.port}")
        virtual_server(proto, sp.cluster_ip, sp.port, all_eps)
        bound.append(sp.cluster_ip)
        for ip in sp.external_ips:
            sets["KUBE-EXTERNAL-IP-LOCAL" if ext_local else "KUBE-EXTERNAL-IP"].append(
                f"{ip},{proto}:{sp.port}")
            virtual_server(proto, ip, sp.port, ext_eps)
            bound.append(ip)
        for lb_ip in sp.lb_ips:
            entry = f"{lb_ip},{proto}:{sp.port}"
            sets["KUBE-LOAD-BALANCER"].append(entry)
            if ext_local:
                sets["KUBE-LOAD-BALANCER-LOCAL"].append(entry)
            if sp.source_ranges:
                sets["KUBE-LOAD-BALANCER-FW"].append(entry)
                sets["KUBE-LOAD-BALANCER-SOURCE-CIDR"] += [
                    f"{entry},{r}" for r in sp.source_ranges]
                if node_ip and _holds(sp.source_ranges, node_ip):
                    sets["KUBE-LOAD-BALANCER-SOURCE-IP"].append(f"{entry},{lb_ip}")
            virtual_server(proto, lb_ip, sp.port, ext_eps)
            if bind_lb_ip:
                bound.append(lb_ip)
        if sp.node_port:
            if proto in ("tcp", "udp"):
                sets[f"KUBE-NODE-PORT-{proto.upper()}"].append(str(sp.node_port))
                if ext_local:
                    sets[f"KUBE-NODE-PORT-LOCAL-{proto.upper()}"].append(str(sp.node_port))
            for addr in node_ips:
                virtual_server(proto, addr, sp.node_port, ext_eps)
        if sp.health_check_node_port:
            sets["KUBE-HEALTH-CHECK-NODE-PORT"].append(str(sp.health_check_node_port))
    bound_unique = tuple(dict.fromkeys(bound))
    sets["KUBE-IPVS-IPS"] = list(bound_unique)
    # sets hold each member once (two services may share a local pod IP:port)
    for name, stype, _c in IPVS_SETS:
        members = dict.fromkeys(sets[name])
        sets[name] = sorted(members, key=int) if stype == "bitmap:port" else list(members)

    t = ipvs_tables(sets, cluster_cidr, family)
    return IpvsNodeState(
        ipset_restore=ipset_text(sets, save_form=False, family=family),
        iptables_restore=t.save_text(backend),
        kube_ipvs0_addresses=bound_unique,
        ipvsadm_save="\n".join(vs_lines) + "\n" if vs_lines else "",
        ipset_save=ipset_text(sets, save_form=True, family=family),
    )


def ipvs_tables(sets: Mapping[str, Sequence[str]], cluster_cidr: str | None,
                family: int = 4) -> Tables:
    """pkg/proxy/ipvs/proxier.go writeIptablesRules, in its order (``sets`` by their IPv4
    names; the rules name them as ``family``'s proxier does)."""
    t = Tables(("nat", "filter"), family)

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
    masquerade_rules(t)

    # createAndLinkKubeChain: EnsureRule(Prepend) in iptablesJumpChain order
    nat_hooks(t)
    prepend_hooks(t, "filter", [
        ("FORWARD", jump("kubernetes forwarding rules"), "KUBE-FORWARD"),
        ("INPUT", jump("kubernetes health check rules"), "KUBE-NODE-PORT"),
        ("INPUT", jump("kube-proxy firewall rules"), "KUBE-PROXY-FIREWALL"),
        ("FORWARD", jump("kube-proxy firewall rules"), "KUBE-PROXY-FIREWALL"),
        ("INPUT", jump("kubernetes ipvs access filter"), "KUBE-IPVS-FILTER"),
        ("OUTPUT", jump("kubernetes ipvs access filter"), "KUBE-IPVS-OUT-FILTER"),
    ])
    return t
