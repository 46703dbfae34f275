"""The node state kube-proxy (and its neighbours) would leave behind, as plain text.

Pure functions, no I/O. They model what the upstream sources write, so the lab, the
parser tests and the benchmark all see realistic input:

* iptables mode, "new" generation (v1.24+, pkg/proxy/iptables/proxier.go): KUBE-SVC-,
  KUBE-SVL-, KUBE-EXT-, KUBE-SEP- chains, "has no local endpoints" DROPs in the filter
  table, KUBE-POSTROUTING with the RETURN / --xor-mark / MASQUERADE triple;
* iptables mode, "old" generation (v1.18/v1.19 era): KUBE-FW- and KUBE-XLB- chains,
  KUBE-MARK-DROP for eTP=Local without local endpoints, KUBE-POSTROUTING with a single
  mark-matching MASQUERADE;
* IPVS mode (pkg/proxy/ipvs/proxier.go, ipset.go): the KUBE-* ipsets, the set-matching
  nat rules, the kube-ipvs0 addresses and the IPVS virtual servers;
* ip-masq-agent's IP-MASQ-AGENT chain and a plain CNI masquerade rule.

Two renderings of the same rules exist because both occur in the field: what
``iptables-save`` prints on a node (``iptables_mode``: header, built-in chain hooks,
``/32`` suffixes, ``--set-xmark``, 11-digit probabilities, comments quoted only when
needed) and what kube-proxy itself pipes into ``iptables-restore``
(``kube_proxy_restore_input``: kube-proxy's argument order, ``--or-mark 0x004000``,
no hooks). The save rendering was checked against real ``iptables-save`` output by
loading it into a namespace and saving it back (tests/test_lab.py).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# kube-proxy's default --iptables-masquerade-bit is 14. It formats the mark with
# fmt.Sprintf("%#08x", 1<<14) == "0x004000"; iptables-save normalises it to 0x4000.
_KP_MARK = "0x004000"
_MARK = "0x4000"
# kubelet's (pre-1.28) drop mark, bit 15, used by the old generation's KUBE-MARK-DROP.
_DROP_MARK = "0x8000"
_REJECT_OPTS = "--reject-with icmp-port-unreachable"
_LARGE_CLUSTER_ENDPOINTS = 1000  # largeClusterEndpointsThreshold
_BARE = re.compile(r"[A-Za-z0-9_-]+")

# Fixed, so that every rendering is deterministic (tests compare texts).
_SAVE_DATE = "Mon Jan  5 08:00:00 2026"
_IPTABLES_VERSION = "v1.8.9"

_BUILTIN = {
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
}


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


# --- chain names -----------------------------------------------------------------------


def _b32_16(data: str) -> str:
    # 16 base32 characters are exactly the first 10 bytes (base32 works in 5-byte
    # groups), so encoding only those gives the same prefix, faster.
    return base64.b32encode(hashlib.sha256(data.encode()).digest()[:10]).decode()


def chain_hash(service_port_name: str, protocol: str) -> str:
    """portProtoHash: base32(sha256("ns/name:port" + "tcp"))[:16].

    Shared by KUBE-SVC-, KUBE-SVL-, KUBE-EXT-, KUBE-FW- and (old) KUBE-XLB- chains.
    """
    return _b32_16(service_port_name + protocol.lower())


def endpoint_chain_hash(service_port_name: str, protocol: str, endpoint: str) -> str:
    """servicePortEndpointChainName's hash; ``endpoint`` is "ip:port"."""
    return _b32_16(service_port_name + protocol.lower() + endpoint)


# --- rule rendering --------------------------------------------------------------------


def _save_quote(s: str) -> str:
    # libxtables' xtables_save_string: bare only when [A-Za-z0-9_-]+, else "..." with
    # \ and " escaped (checked against iptables-save 1.8.9, both backends).
    if _BARE.fullmatch(s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _kp_quote(s: str) -> str:
    # kube-proxy wraps its fmt templates in literal quotes; a bare svcPortNameString
    # (no spaces) is written as is.
    return f'"{s}"' if " " in s else s


def _cidr(addr: str) -> str:
    return addr if "/" in addr else addr + "/32"


def _kp_probability(n: int) -> str:
    return f"{1.0 / n:0.10f}"  # computeProbability


def _save_probability(n: int) -> str:
    # xt_statistic stores lround(p * 2^31) and iptables prints it with %.11f.
    p = float(_kp_probability(n))
    return f"{int(p * 0x80000000 + 0.5) / 0x80000000:.11f}"


class _Tables:
    """Accumulates rules in both renderings while a proxier model writes them."""

    def __init__(self, order: Sequence[str]) -> None:
        self.order = list(order)  # table order of kube-proxy's restore input
        # kube-proxy's "large cluster mode" (more than 1000 endpoints in total) drops
        # the per-endpoint comments to shrink the ruleset.
        self.large_cluster = False
        self.kp_chains: dict[str, list[str]] = {t: [] for t in order}
        self.kp_rules: dict[str, list[str]] = {t: [] for t in order}
        # save rendering: chain -> rules, builtins included; insertion-ordered dicts
        self.save: dict[str, dict[str, list[str]]] = {
            t: {c: [] for c in _BUILTIN[t]} for t in order}

    def chain(self, table: str, name: str, *, by_kube_proxy: bool = True) -> None:
        chains = self.save[table]
        if name not in chains:
            chains[name] = []
        if by_kube_proxy:
            self.kp_chains[table].append(f":{name} - [0:0]")

    def raw(self, table: str, chain: str, kp: str | None, save: str) -> None:
        """A rule given literally in both renderings (kp=None: not kube-proxy's input)."""
        if kp is not None:
            self.kp_rules[table].append(kp)
        self.save[table].setdefault(chain, []).append(save)

    def rule(self, table: str, chain: str, target: str, *, comment: str | None = None,
             prob: int = 0, pre: str = "", proto: str | None = None,
             dst: str | None = None, dport: int | None = None, src: str | None = None,
             nsrc: bool = False, post: str = "", topts: str = "",
             save_topts: str | None = None) -> None:
        """The common kube-proxy rule shape.

        kube-proxy's order: comment, statistic, ``pre`` matches, ``-m p -p p``, ``-d``,
        ``--dport``, ``[!] -s``, ``post`` matches, ``-j``. iptables-save moves -s/-d/-p
        to the front and prints matches in the order they were given, with --dport
        inside the ``-m tcp`` match.
        """
        kp = ["-A", chain]
        sv = ["-A", chain]
        if src:
            sv.append(("! -s " if nsrc else "-s ") + _cidr(src))
        if dst:
            sv.append("-d " + _cidr(dst))
        if proto:
            sv.append("-p " + proto)
        if comment:
            kp.append("-m comment --comment " + _kp_quote(comment))
            sv.append("-m comment --comment " + _save_quote(comment))
        if prob:
            kp.append("-m statistic --mode random --probability " + _kp_probability(prob))
            sv.append("-m statistic --mode random --probability " + _save_probability(prob))
        if pre:
            kp.append(pre)
            sv.append(pre)
        if proto:
            kp.append(f"-m {proto} -p {proto}")
            sv.append(f"-m {proto} --dport {dport}" if dport else "-m " + proto)
        if dst:
            kp.append("-d " + dst)
        if dport:
            kp.append(f"--dport {dport}")
        if src:
            kp.append(("! -s " if nsrc else "-s ") + src)
        if post:
            kp.append(post)
            sv.append(post)
        kp.append("-j " + target)
        sv.append("-j " + target)
        if topts:
            kp.append(topts)
        if save_topts is None:
            save_topts = topts
        if save_topts:
            sv.append(save_topts)
        self.kp_rules[table].append(" ".join(kp))
        self.save[table].setdefault(chain, []).append(" ".join(sv))

    # -- output ----------------------------------------------------------------------

    def restore_input(self) -> str:
        out: list[str] = []
        for t in self.order:
            out.append("*" + t)
            out.extend(self.kp_chains[t])
            out.extend(self.kp_rules[t])
            out.append("COMMIT")
        return "\n".join(out) + "\n"

    def save_text(self, backend: str = "legacy") -> str:
        return _render_save(self.save, backend)


def _render_save(tables: Mapping[str, Mapping[str, Sequence[str]]],
                 backend: str | None = "legacy") -> str:
    """iptables-save layout: built-in chains first, user chains sorted by name, rules
    grouped per chain in that order; ``backend`` None leaves out the comment lines."""
    if backend == "nft":
        header = f"# Generated by iptables-nft-save {_IPTABLES_VERSION} (nf_tables) on {_SAVE_DATE}"
    else:
        header = f"# Generated by iptables-save {_IPTABLES_VERSION} on {_SAVE_DATE}"
    out: list[str] = []
    # iptables-nft-save prints filter before nat; iptables-legacy-save walks the
    # kernel's table list, newest registration first, so its order varies per node.
    # Use nft's order for both.
    for t in sorted(tables, key=lambda name: (name != "filter", name)):
        chains = tables[t]
        builtins = [c for c in _BUILTIN.get(t, ()) if c in chains]
        users = sorted(c for c in chains if c not in builtins)
        if backend:
            out.append(header)
        out.append("*" + t)
        out.extend(f":{c} ACCEPT [0:0]" for c in builtins)
        out.extend(f":{c} - [0:0]" for c in users)
        for c in builtins + users:
            out.extend(chains[c])
        out.append("COMMIT")
        if backend:
            out.append(f"# Completed on {_SAVE_DATE}")
    return "\n".join(out) + "\n"


def _prepend_hooks(t: _Tables, table: str, jumps: Sequence[tuple[str, str, str]],
                   existing: Mapping[str, Sequence[str]] | None = None) -> None:
    """Apply kube-proxy's EnsureRule(Prepend, ...) calls in order to the built-ins.

    ``jumps`` are (builtin chain, rule args after "-A CHAIN", target chain); each is
    inserted at position 1, so the last one processed ends up first. ``existing`` are
    rules already there (kubelet's), which stay below.
    """
    hooks: dict[str, list[str]] = {c: list((existing or {}).get(c, ())) for c in _BUILTIN[table]}
    for chain, args, target in jumps:
        hooks[chain].insert(0, f"-A {chain} {args} -j {target}")
    for chain in _BUILTIN[table]:
        t.save[table][chain][:0] = hooks[chain]


def _jump(comment: str, extra: str = "") -> str:
    return (extra + " " if extra else "") + "-m comment --comment " + _save_quote(comment)


# --- iptables mode ---------------------------------------------------------------------


def _iptables_new(services: Iterable[LbService], cluster_cidr: str | None) -> _Tables:
    """pkg/proxy/iptables/proxier.go syncProxyRules (v1.28+), one full sync."""
    t = _Tables(("filter", "nat"))
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
    # localhostNodePorts (default true): route_localnet=1 plus this guard rule.
    t.chain("filter", "KUBE-FIREWALL")
    t.rule("filter", "KUBE-FIREWALL", "DROP", comment="block incoming localnet connections",
           dst="127.0.0.0/8", src="127.0.0.0/8", nsrc=True,
           post="-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT")

    svcs = sorted(services, key=lambda s: s.port_name_key)
    t.large_cluster = _total_endpoints(svcs) > _LARGE_CLUSTER_ENDPOINTS
    for svc in svcs:
        _new_service(t, svc, cluster_cidr)

    t.rule("nat", "KUBE-SERVICES", "KUBE-NODEPORTS",
           comment="kubernetes service nodeports; NOTE: this must be the last rule in this chain",
           pre="-m addrtype --dst-type LOCAL")
    # nfacct-counted variants are left out: they need xt_nfacct, which most nodes lack,
    # and kube-proxy then writes the plain rule.
    t.raw("filter", "KUBE-FORWARD", "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
          "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP")
    t.raw("filter", "KUBE-FORWARD",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {_KP_MARK}/{_KP_MARK} -j ACCEPT",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {_MARK}/{_MARK} -j ACCEPT")
    t.rule("filter", "KUBE-FORWARD", "ACCEPT", comment="kubernetes forwarding conntrack rule",
           pre="-m conntrack --ctstate RELATED,ESTABLISHED")

    # Built-in hooks (EnsureRule, not part of the restore input). kubelet created
    # KUBE-FIREWALL's jumps first, kube-proxy then prepends its own in list order.
    ctnew = "-m conntrack --ctstate NEW"
    t.chain("filter", "KUBE-PROXY-CANARY", by_kube_proxy=False)
    t.chain("nat", "KUBE-PROXY-CANARY", by_kube_proxy=False)
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
    _prepend_hooks(t, "nat", [
        ("OUTPUT", _jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("PREROUTING", _jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("POSTROUTING", _jump("kubernetes postrouting rules"), "KUBE-POSTROUTING"),
    ])
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
    if svc.lb_ip:
        if has_endpoints:
            t.rule("nat", "KUBE-SERVICES", ext_chain, comment=f"{name} loadbalancer IP",
                   proto=proto, dst=svc.lb_ip, dport=svc.port)
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
                   save_topts=_REJECT_OPTS if filter_target == "REJECT" else "")
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

    if has_endpoints:  # usesClusterPolicyChain (ITP=Cluster)
        t.chain("nat", svc_chain)
        _endpoint_rules(t, svc, svc_chain, eps)
    if uses_local_chain:
        t.chain("nat", svl_chain)
        _endpoint_rules(t, svc, svl_chain, local_eps)
    for ip, _local in eps:
        ep = f"{ip}:{svc.target_port}"
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
        ep = f"{ip}:{svc.target_port}"
        sep = "KUBE-SEP-" + endpoint_chain_hash(name, proto, ep)
        t.rule("nat", chain, sep, comment=None if t.large_cluster else f"{name} -> {ep}",
               prob=n - i if i < n - 1 else 0)


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

    t.rule("nat", "KUBE-SERVICES", "KUBE-NODEPORTS",
           comment="kubernetes service nodeports; NOTE: this must be the last rule in this chain",
           pre="-m addrtype --dst-type LOCAL")
    t.raw("filter", "KUBE-FORWARD", "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
          "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP")
    t.raw("filter", "KUBE-FORWARD",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {mark} -j ACCEPT",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {_MARK}/{_MARK} -j ACCEPT")
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
    t.chain("filter", "KUBE-PROXY-CANARY", by_kube_proxy=False)
    t.chain("nat", "KUBE-PROXY-CANARY", by_kube_proxy=False)
    _prepend_hooks(t, "filter", [
        ("INPUT", _jump("kubernetes externally-visible service portals", ctnew),
         "KUBE-EXTERNAL-SERVICES"),
        ("FORWARD", _jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("OUTPUT", _jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("INPUT", _jump("kubernetes service portals", ctnew), "KUBE-SERVICES"),
        ("FORWARD", _jump("kubernetes forwarding rules"), "KUBE-FORWARD"),
    ], existing={"INPUT": ["-A INPUT -j KUBE-FIREWALL"], "OUTPUT": ["-A OUTPUT -j KUBE-FIREWALL"]})
    _prepend_hooks(t, "nat", [
        ("OUTPUT", _jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("PREROUTING", _jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("POSTROUTING", _jump("kubernetes postrouting rules"), "KUBE-POSTROUTING"),
    ])
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
                     cluster_cidr: str | None) -> _Tables:
    if generation == "new":
        return _iptables_new(services, cluster_cidr)
    if generation == "old":
        return _iptables_old(services, cluster_cidr)
    raise ValueError(f"generation must be 'new' or 'old', not {generation!r}")


def iptables_mode(services: Iterable[LbService], *, generation: str = "new",
                  cluster_cidr: str | None, node_ip: str, backend: str = "legacy") -> str:
    """What ``iptables-save`` prints (nat and filter) on a node whose kube-proxy runs
    in iptables mode. ``backend`` only changes the header line ("nft" ->
    ``iptables-nft-save ... (nf_tables)``). ``node_ip`` is accepted for symmetry with
    ``ipvs_mode``: the generated rules do not depend on it (nodePortAddresses unset).
    """
    del node_ip
    return _iptables_tables(services, generation, cluster_cidr).save_text(backend)


def kube_proxy_restore_input(services: Iterable[LbService], *, generation: str = "new",
                             cluster_cidr: str | None, node_ip: str) -> str:
    """What kube-proxy itself feeds to ``iptables-restore --noflush`` for one full sync:
    no header or counters, ``:CHAIN - [0:0]`` lines, bare IPs, kube-proxy's argument
    order, ``--or-mark 0x004000``, and no jumps from the built-in chains (those are
    made with separate ``iptables -I`` calls). The old generation references kubelet's
    KUBE-MARK-DROP, which must exist before this is restored.
    """
    del node_ip
    return _iptables_tables(services, generation, cluster_cidr).restore_input()


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


@dataclass(frozen=True)
class IpvsNodeState:
    """Everything kube-proxy's IPVS proxier leaves on the node."""

    ipset_restore: str  # `ipset restore` input creating and filling every KUBE-* set
    iptables_restore: str  # nat + filter, iptables-save rendering incl. built-in hooks
    kube_ipvs0_addresses: tuple[str, ...]  # bound on kube-ipvs0 as /32
    ipvsadm_save: str  # `ipvsadm -S -n`
    ipset_save: str = ""  # what `ipset save` prints (bucketsize/initval added)


def _ipset_text(members: Mapping[str, Iterable[str]], save_form: bool) -> str:
    out: list[str] = []
    for name, stype, _comment in IPVS_SETS:
        if stype == "bitmap:port":
            out.append(f"create {name} {stype} range 0-65535")
        elif save_form:
            # ipset 7.x save adds bucketsize and a random initval; make it stable
            initval = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
            out.append(f"create {name} {stype} family inet hashsize 1024 maxelem 65536 "
                       f"bucketsize 12 initval 0x{initval:08x}")
        else:
            out.append(f"create {name} {stype} family inet hashsize 1024 maxelem 65536")
        out.extend(f"add {name} {m}" for m in members.get(name, ()))
    return "\n".join(out) + "\n"


def ipvs_mode(services: Iterable[LbService], *, bind_lb_ip: bool, cluster_cidr: str | None,
              node_ip: str, backend: str = "legacy") -> IpvsNodeState:
    """kube-proxy in IPVS mode. ``bind_lb_ip=False`` is TKE's variant that does not put
    the LoadBalancer ingress IP on kube-ipvs0 (the upstream proxier binds it, PR 63066);
    its ipsets and iptables rules are the same as upstream's."""
    svcs = sorted(services, key=lambda s: s.port_name_key)
    sets: dict[str, list[str]] = {name: [] for name, _t, _c in IPVS_SETS}
    bound: list[str] = []
    vs_lines: list[str] = []

    def virtual_server(proto: str, addr: str, port: int, eps: Sequence[str],
                       target_port: int) -> None:
        flag = {"tcp": "-t", "udp": "-u", "sctp": "--sctp-service"}[proto]
        vs = f"{flag} {addr}:{port}"
        vs_lines.append(f"-A {vs} -s rr")
        vs_lines.extend(f"-a {vs} -r {ip}:{target_port} -m -w 1" for ip in eps)

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

    t = _ipvs_tables(sets, cluster_cidr)
    return IpvsNodeState(
        ipset_restore=_ipset_text(sets, save_form=False),
        iptables_restore=t.save_text(backend),
        kube_ipvs0_addresses=bound_unique,
        ipvsadm_save="\n".join(vs_lines) + "\n" if vs_lines else "",
        ipset_save=_ipset_text(sets, save_form=True),
    )


def _ipvs_tables(sets: Mapping[str, Sequence[str]], cluster_cidr: str | None) -> _Tables:
    """pkg/proxy/ipvs/proxier.go writeIptablesRules, in its order."""
    t = _Tables(("nat", "filter"))
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
        line = (f"-A {chain} {p}-m comment --comment {cm(name)} -m set --match-set {name} "
                f"{match} -j {target}")
        t.raw(table, chain, line, line)

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
        base = f"-m comment --comment {cm('KUBE-CLUSTER-IP')} -m set --match-set KUBE-CLUSTER-IP"
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
        base = f"-A KUBE-SERVICES -m comment --comment {cm(name)} -m set --match-set {name} dst,dst"
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
            t.rule("nat", "KUBE-SERVICES", "ACCEPT", pre=f"-m set --match-set {name} dst,dst")
    t.raw("filter", "KUBE-FORWARD",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {_KP_MARK}/{_KP_MARK} -j ACCEPT",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {_MARK}/{_MARK} -j ACCEPT")
    t.rule("filter", "KUBE-FORWARD", "ACCEPT", comment="kubernetes forwarding conntrack rule",
           pre="-m conntrack --ctstate RELATED,ESTABLISHED")
    hc = "KUBE-HEALTH-CHECK-NODE-PORT"
    line = f"-A KUBE-NODE-PORT -m comment --comment {cm(hc)} -m set --match-set {hc} dst -j ACCEPT"
    t.raw("filter", "KUBE-NODE-PORT", line, line)
    for name, match in (("KUBE-LOAD-BALANCER", "dst,dst"), ("KUBE-CLUSTER-IP", "dst,dst"),
                        ("KUBE-EXTERNAL-IP", "dst,dst"), ("KUBE-EXTERNAL-IP-LOCAL", "dst,dst"),
                        (hc, "dst")):
        t.rule("filter", "KUBE-IPVS-FILTER", "RETURN", pre=f"-m set --match-set {name} {match}")
    t.raw("filter", "KUBE-IPVS-FILTER",
          "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst"
          " -j REJECT",
          "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst"
          " -j REJECT --reject-with icmp-port-unreachable")
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
    _prepend_hooks(t, "nat", [
        ("OUTPUT", _jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("PREROUTING", _jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("POSTROUTING", _jump("kubernetes postrouting rules"), "KUBE-POSTROUTING"),
    ])
    _prepend_hooks(t, "filter", [
        ("FORWARD", _jump("kubernetes forwarding rules"), "KUBE-FORWARD"),
        ("INPUT", _jump("kubernetes health check rules"), "KUBE-NODE-PORT"),
        ("INPUT", _jump("kube-proxy firewall rules"), "KUBE-PROXY-FIREWALL"),
        ("FORWARD", _jump("kube-proxy firewall rules"), "KUBE-PROXY-FIREWALL"),
        ("INPUT", _jump("kubernetes ipvs access filter"), "KUBE-IPVS-FILTER"),
        ("OUTPUT", _jump("kubernetes ipvs access filter"), "KUBE-IPVS-OUT-FILTER"),
    ])
    return t


# --- neighbours: ip-masq-agent and CNI -------------------------------------------------


def ip_masq_agent(nonmasq_cidrs: Sequence[str], *, masq_link_local: bool = False) -> str:
    """kubernetes-sigs/ip-masq-agent's nat rules (syncMasqRules), iptables-save rendering:
    the appended POSTROUTING jump for non-LOCAL destinations, a RETURN per
    non-masquerade CIDR (link-local first unless masqLinkLocal), a final MASQUERADE."""
    chain = "IP-MASQ-AGENT"
    jump_comment = ("ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination "
                    f"traffic to our custom {chain} chain")
    tables: dict[str, dict[str, list[str]]] = {"nat": {c: [] for c in _BUILTIN["nat"]}}
    nat = tables["nat"]
    nat["POSTROUTING"].append(f"-A POSTROUTING -m comment --comment {_save_quote(jump_comment)} "
                              f"-m addrtype ! --dst-type LOCAL -j {chain}")
    rules = nat.setdefault(chain, [])
    cidrs = ([] if masq_link_local else ["169.254.0.0/16"]) + list(nonmasq_cidrs)
    for cidr in cidrs:
        rules.append(f"-A {chain} -d {cidr} -m comment --comment "
                     '"ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN')
    rules.append(f"-A {chain} -m comment --comment "
                 '"ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in '
                 'chain)" -j MASQUERADE --random-fully')
    return _render_save(tables, backend=None)


def cni_masquerade(pod_cidr: str) -> str:
    """A bridge-plugin style (ipMasq) rule: pod traffic leaving the pod network is
    masqueraded, whatever kube-proxy decided."""
    tables = {"nat": {c: [] for c in _BUILTIN["nat"]}}
    tables["nat"]["POSTROUTING"].append(
        f"-A POSTROUTING -s {pod_cidr} ! -d {pod_cidr} -m comment --comment "
        '"cni: masquerade pod traffic leaving the pod network" -j MASQUERADE')
    return _render_save(tables, backend=None)


def merge_restore(*fragments: str) -> str:
    """Merge iptables-save/-restore texts into one iptables-restore input: per table the
    union of chains (first policy wins) and every fragment's rules appended in order,
    grouped per chain as iptables-save does; one COMMIT per table."""
    tables: dict[str, dict[str, list[str]]] = {}
    policies: dict[str, dict[str, str]] = {}
    for text in fragments:
        table: str | None = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("*"):
                table = line[1:]
                tables.setdefault(table, {})
                policies.setdefault(table, {})
            elif line == "COMMIT":
                table = None
            elif table is None:
                raise ValueError(f"rule outside a table: {line!r}")
            elif line.startswith(":"):
                name, policy = line[1:].split()[:2]
                tables[table].setdefault(name, [])
                policies[table].setdefault(name, policy)
            elif line.startswith("-A "):
                chain = line.split(None, 2)[1]
                tables[table].setdefault(chain, []).append(line)
                policies[table].setdefault(
                    chain, "ACCEPT" if chain in _BUILTIN.get(table, ()) else "-")
            else:
                raise ValueError(f"unsupported line in a restore fragment: {line!r}")
    out: list[str] = []
    for table, chains in tables.items():
        builtins = [c for c in _BUILTIN.get(table, ()) if c in chains]
        users = sorted(c for c in chains if c not in builtins)
        out.append("*" + table)
        out.extend(f":{c} {policies[table][c]} [0:0]" for c in builtins + users)
        for c in builtins + users:
            out.extend(chains[c])
        out.append("COMMIT")
    return "\n".join(out) + "\n"


# --- Kubernetes API objects -----------------------------------------------------------


def services_json(services: Iterable[LbService]) -> dict[str, Any]:
    """``kubectl get svc -A -o json``; ports of one Service are merged into one item."""
    items: dict[tuple[str, str], dict[str, Any]] = {}
    for svc in services:
        key = (svc.namespace, svc.name)
        port: dict[str, Any] = {"name": svc.port_name, "port": svc.port,
                                "protocol": svc.protocol, "targetPort": svc.target_port}
        if svc.node_port:
            port["nodePort"] = svc.node_port
        if key in items:
            items[key]["spec"]["ports"].append(port)
            continue
        spec: dict[str, Any] = {
            "clusterIP": svc.cluster_ip, "clusterIPs": [svc.cluster_ip],
            "internalTrafficPolicy": "Cluster", "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack", "ports": [port], "sessionAffinity": "None",
            "type": svc.type,
        }
        if svc.type != "ClusterIP":
            spec["externalTrafficPolicy"] = svc.etp
        if svc.type == "LoadBalancer":
            spec["allocateLoadBalancerNodePorts"] = True
            if svc.health_check_node_port:
                spec["healthCheckNodePort"] = svc.health_check_node_port
        if svc.external_ips:
            spec["externalIPs"] = list(svc.external_ips)
        metadata: dict[str, Any] = {"name": svc.name, "namespace": svc.namespace}
        if svc.annotations:
            metadata["annotations"] = dict(svc.annotations)
        status: dict[str, Any] = {"loadBalancer": {}}
        if svc.lb_ip:
            status["loadBalancer"] = {"ingress": [{"ip": svc.lb_ip}]}
        items[key] = {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
                      "spec": spec, "status": status}
    return {"apiVersion": "v1", "items": list(items.values()), "kind": "List",
            "metadata": {"resourceVersion": ""}}


def node_json(name: str, pod_cidr: str, internal_ip: str) -> dict[str, Any]:
    """``kubectl get node NAME -o json`` (the fields the agent reads)."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                              "kubernetes.io/os": "linux"}},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {"addresses": [{"type": "InternalIP", "address": internal_ip},
                                 {"type": "Hostname", "address": name}]},
    }


def ingresses_json(ingresses: Iterable[IngressSpec]) -> dict[str, Any]:
    """``kubectl get ingress -A -o json`` (networking.k8s.io/v1)."""
    items = []
    for ing in ingresses:
        path = {"path": "/", "pathType": "Prefix",
                "backend": {"service": {"name": ing.service_name,
                                        "port": {"number": ing.service_port}}}}
        rule: dict[str, Any] = {"http": {"paths": [path]}}
        if ing.host:
            rule["host"] = ing.host
        spec: dict[str, Any] = {"rules": [rule]}
        if ing.tls:
            spec["tls"] = [{"hosts": [ing.host] if ing.host else [],
                            "secretName": f"{ing.name}-tls"}]
        metadata: dict[str, Any] = {"name": ing.name, "namespace": ing.namespace}
        if ing.annotations:
            metadata["annotations"] = dict(ing.annotations)
        items.append({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                      "metadata": metadata, "spec": spec,
                      "status": {"loadBalancer": {"ingress": [{"ip": ing.ip}]}}})
    return {"apiVersion": "v1", "items": items, "kind": "List",
            "metadata": {"resourceVersion": ""}}


# --- node text outputs (addresses, local table, sysctls) ------------------------------


def ip_addr_text(interfaces: Sequence[tuple[str, str, Sequence[str]]]) -> str:
    """``ip addr show`` for (ifname, state "UP"/"DOWN", ["a.b.c.d/len", ...])."""
    out: list[str] = []
    for idx, (ifname, state, addrs) in enumerate(interfaces, 1):
        if ifname == "lo":
            out.append(f"{idx}: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state "
                       "UNKNOWN group default qlen 1000")
            out.append("    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00")
        elif state == "UP":
            out.append(f"{idx}: {ifname}: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc "
                       "noqueue state UP group default qlen 1000")
            out.append(f"    link/ether 52:54:00:00:00:{idx:02x} brd ff:ff:ff:ff:ff:ff")
        else:  # kube-ipvs0: a dummy that kube-proxy never sets up
            out.append(f"{idx}: {ifname}: <BROADCAST,NOARP> mtu 1500 qdisc noop state DOWN "
                       "group default")
            out.append(f"    link/ether 6a:00:00:00:00:{idx:02x} brd ff:ff:ff:ff:ff:ff")
        for a in addrs:
            iface = ipaddress.ip_interface(a)
            scope = "host" if iface.ip.is_loopback else "global"
            brd = ""
            if iface.network.prefixlen < 31 and not iface.ip.is_loopback:
                brd = f" brd {iface.network.broadcast_address}"
            out.append(f"    inet {a}{brd} scope {scope} {ifname}")
            out.append("       valid_lft forever preferred_lft forever")
    return "\n".join(out) + "\n"


def route_local_text(interfaces: Sequence[tuple[str, str, Sequence[str]]]) -> str:
    """``ip route show table local`` for the same interface list (kernel trie order,
    trailing space included as iproute2 prints it)."""
    routes: list[tuple[int, int, str]] = []
    for ifname, _state, addrs in interfaces:
        for a in addrs:
            iface = ipaddress.ip_interface(a)
            ip = str(iface.ip)
            if iface.ip.is_loopback:
                net = iface.network
                routes.append((int(net.network_address), 0,
                               f"local {net} dev lo proto kernel scope host src {ip} "))
            routes.append((int(iface.ip), 1, f"local {ip} dev {ifname} proto kernel scope host "
                                             f"src {ip} "))
            if iface.network.prefixlen < 31:
                b = iface.network.broadcast_address
                routes.append((int(b), 1, f"broadcast {b} dev {ifname} proto kernel scope link "
                                          f"src {ip} "))
    routes.sort()
    return "".join(r[2] + "\n" for r in routes)


def sysctl_text(values: Mapping[str, str | int]) -> str:
    """``sysctl -a`` lines for the given keys."""
    return "".join(f"{k} = {v}\n" for k, v in sorted(values.items()))


# --- synthetic bundles for the benchmark ------------------------------------------------


def synthetic(n_services: int, mode: str, seed: int = 0) -> dict[str, str]:
    """A support bundle (file name -> text) for a node with ``n_services`` LoadBalancer
    services, 2-3 endpoints each (some on this node), every second one eTP=Local, unique
    LB IPs and NodePorts (a widened --service-node-port-range beyond 2768 services).
    Deterministic for a given seed; fast enough for 20k services."""
    if mode not in ("iptables", "ipvs"):
        raise ValueError(f"mode must be 'iptables' or 'ipvs', not {mode!r}")
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
            node_port=30000 + i, cluster_ip=str(ipaddress.IPv4Address(svc_base + 10 + i)),
            lb_ip=str(ipaddress.IPv4Address(lb_base + 1 + i)), etp=etp,
            local_endpoints=local, remote_endpoints=remote,
            health_check_node_port=(10000 + i) if etp == "Local" else None))

    interfaces: list[tuple[str, str, Sequence[str]]] = [
        ("lo", "UP", ["127.0.0.1/8"]), ("eth0", "UP", [f"{node_ip}/24"]),
        ("cni0", "UP", ["172.16.1.1/24"])]
    sysctls: dict[str, str | int] = {
        "net.ipv4.ip_forward": 1, "net.ipv4.conf.all.rp_filter": 1,
        "net.ipv4.conf.default.rp_filter": 1, "net.ipv4.conf.eth0.rp_filter": 1,
        "net.ipv4.conf.all.accept_local": 0, "net.ipv4.conf.eth0.accept_local": 0,
        "net.ipv4.conf.all.log_martians": 0, "net.ipv4.conf.all.route_localnet": 0}
    bundle: dict[str, str] = {}
    if mode == "iptables":
        bundle["iptables-save.txt"] = iptables_mode(services, generation="new",
                                                    cluster_cidr=cluster_cidr, node_ip=node_ip)
        bundle["ipset.txt"] = ""
        bundle["ipvsadm.txt"] = ""
        sysctls["net.ipv4.conf.all.route_localnet"] = 1  # localhostNodePorts
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
