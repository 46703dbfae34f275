"""Constants, the Service model, kube-proxy's chain names and the two renderings
(iptables-save's and kube-proxy's restore input) every mode shares."""


from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# kube-proxy's default --iptables-masquerade-bit is 14. It formats the mark with
# fmt.Sprintf("%#08x", 1<<14) == "0x004000"; iptables-save normalises it to 0x4000.
_KP_MARK = "0x004000"
_MARK = "0x4000"
# kubelet's (pre-1.28) drop mark, bit 15, used by the old generation's KUBE-MARK-DROP.
_DROP_MARK = "0x8000"
_REJECT_OPTS = "--reject-with icmp-port-unreachable"
_REJECT_OPTS6 = "--reject-with icmp6-port-unreachable"  # what ip6tables-save prints
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
    return addr if "/" in addr else addr + ("/128" if ":" in addr else "/32")


def host_port(ip: str, port: int) -> str:
    """net.JoinHostPort, as kube-proxy writes an endpoint ("[fd00::5]:8080")."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _kp_probability(n: int) -> str:
    return f"{1.0 / n:0.10f}"  # computeProbability


def _save_probability(n: int) -> str:
    # xt_statistic stores lround(p * 2^31) and iptables prints it with %.11f.
    p = float(_kp_probability(n))
    return f"{int(p * 0x80000000 + 0.5) / 0x80000000:.11f}"


class _Tables:
    """Accumulates rules in both renderings while a proxier model writes them."""

    def __init__(self, order: Sequence[str], family: int = 4) -> None:
        self.order = list(order)  # table order of kube-proxy's restore input
        self.family = family  # 6: the ip6tables rules of a dual-stack node
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
        return _render_save(self.save, backend, self.family)


def _render_save(tables: Mapping[str, Mapping[str, Sequence[str]]],
                 backend: str | None = "legacy", family: int = 4) -> str:
    """iptables-save layout: built-in chains first, user chains sorted by name, rules
    grouped per chain in that order; ``backend`` None leaves out the comment lines."""
    ipt = "ip6tables" if family == 6 else "iptables"
    if backend == "nft":
        header = f"# Generated by {ipt}-nft-save {_IPTABLES_VERSION} (nf_tables) on {_SAVE_DATE}"
    else:
        header = f"# Generated by {ipt}-save {_IPTABLES_VERSION} on {_SAVE_DATE}"
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




# --- what every mode writes the same way -------------------------------------------------


def nodeports_last(t: _Tables) -> None:
    """iptables mode's final KUBE-SERVICES rule (both generations)."""
    t.rule("nat", "KUBE-SERVICES", "KUBE-NODEPORTS",
           comment="kubernetes service nodeports; NOTE: this must be the last rule in this chain",
           pre="-m addrtype --dst-type LOCAL")


def forward_rules(t: _Tables, *, invalid_drop: bool, conntrack_accept: bool) -> None:
    """KUBE-FORWARD: drop INVALID (iptables mode), accept what kube-proxy marked, and
    (v1.24+ and IPVS) accept established flows."""
    # nfacct-counted variants are left out: they need xt_nfacct, which most nodes lack,
    # and kube-proxy then writes the plain rule.
    if invalid_drop:
        t.raw("filter", "KUBE-FORWARD", "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
              "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP")
    t.raw("filter", "KUBE-FORWARD",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {_KP_MARK}/{_KP_MARK} -j ACCEPT",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {_MARK}/{_MARK} -j ACCEPT")
    if conntrack_accept:
        t.rule("filter", "KUBE-FORWARD", "ACCEPT", comment="kubernetes forwarding conntrack rule",
               pre="-m conntrack --ctstate RELATED,ESTABLISHED")


def canary_chains(t: _Tables) -> None:
    """kube-proxy's canaries (created by its health check, not by the restore input)."""
    t.chain("filter", "KUBE-PROXY-CANARY", by_kube_proxy=False)
    t.chain("nat", "KUBE-PROXY-CANARY", by_kube_proxy=False)


def nat_hooks(t: _Tables) -> None:
    """The nat built-in chain jumps (EnsureRule, not part of the restore input)."""
    _prepend_hooks(t, "nat", [
        ("OUTPUT", _jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("PREROUTING", _jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("POSTROUTING", _jump("kubernetes postrouting rules"), "KUBE-POSTROUTING"),
    ])
