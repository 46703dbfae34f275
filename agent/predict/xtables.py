"""The iptables side that kube-proxy's iptables and IPVS proxiers share: the rule
accumulator with its two renderings, kube-proxy's chain names, and the rules both modes
write alike (KUBE-FORWARD, the jumps from the built-in chains).

Two renderings of the same rules, because both occur in the field: what
``iptables-save`` prints on a node (``Tables.save_text``: header, built-in chain hooks,
``/32`` suffixes, ``--set-xmark``, 11-digit probabilities, comments quoted only when
needed), which the prediction walks, and what kube-proxy itself pipes into
``iptables-restore`` (``Tables.restore_input``: kube-proxy's argument order, ``--or-mark
0x004000``, no hooks), the form of kube-proxy's own test expectations
(pkg/proxy/iptables/proxier_test.go). One accumulator writes both from the same calls, so
the rules are described once. The save rendering was checked against real
``iptables-save`` output by loading it into a namespace and saving it back
(tests/test_lab.py).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping, Sequence

from agent.diagnose.lb_ip import chain_hash
from agent.parse.ip_text import host_port

__all__ = ["BUILTIN", "DROP_MARK", "IPTABLES_VERSION", "KP_MARK", "LARGE_CLUSTER_ENDPOINTS",
           "MARK", "REJECT_OPTS", "REJECT_OPTS6", "SAVE_DATE", "Tables", "canary_chains",
           "chain_hash", "cidr", "endpoint_chain_hash", "forward_rules", "host_port", "jump",
           "nat_hooks", "nodeports_last", "prepend_hooks", "render_save", "save_quote"]

# kube-proxy's default --iptables-masquerade-bit is 14. It formats the mark with
# fmt.Sprintf("%#08x", 1<<14) == "0x004000"; iptables-save normalises it to 0x4000.
KP_MARK = "0x004000"
MARK = "0x4000"
# kubelet's (pre-1.28) drop mark, bit 15, used by the old generation's KUBE-MARK-DROP.
DROP_MARK = "0x8000"
REJECT_OPTS = "--reject-with icmp-port-unreachable"
REJECT_OPTS6 = "--reject-with icmp6-port-unreachable"  # what ip6tables-save prints
LARGE_CLUSTER_ENDPOINTS = 1000  # largeClusterEndpointsThreshold
_BARE = re.compile(r"[A-Za-z0-9_-]+")

# Fixed, so that every rendering is deterministic (tests compare texts).
SAVE_DATE = "Mon Jan  5 08:00:00 2026"
IPTABLES_VERSION = "v1.8.9"

BUILTIN = {
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
}


# --- chain names -----------------------------------------------------------------------


def endpoint_chain_hash(service_port_name: str, protocol: str, endpoint: str) -> str:
    """servicePortEndpointChainName's hash, base32(sha256(name + proto + "ip:port"))[:16]
    (16 base32 characters are exactly the first 10 bytes); ``endpoint`` is "ip:port".
    The service chains' own hash is agent.diagnose.lb_ip.chain_hash (portProtoHash)."""
    data = service_port_name + protocol.lower() + endpoint
    return base64.b32encode(hashlib.sha256(data.encode()).digest()[:10]).decode()


# --- rule rendering --------------------------------------------------------------------


def save_quote(s: str) -> str:
    """libxtables' xtables_save_string: bare only when [A-Za-z0-9_-]+, else "..." with \\
    and " escaped (checked against iptables-save 1.8.9, both backends)."""
    if _BARE.fullmatch(s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _kp_quote(s: str) -> str:
    # kube-proxy wraps its fmt templates in literal quotes; a bare svcPortNameString
    # (no spaces) is written as is.
    return f'"{s}"' if " " in s else s


def cidr(addr: str) -> str:
    """An address as iptables-save prints a -s/-d match: with its /32 (/128)."""
    return addr if "/" in addr else addr + ("/128" if ":" in addr else "/32")


def _kp_probability(n: int) -> str:
    return f"{1.0 / n:0.10f}"  # computeProbability


def _save_probability(n: int) -> str:
    # xt_statistic stores lround(p * 2^31) and iptables prints it with %.11f.
    p = float(_kp_probability(n))
    return f"{int(p * 0x80000000 + 0.5) / 0x80000000:.11f}"


class Tables:
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
            t: {c: [] for c in BUILTIN[t]} for t in order}

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
            sv.append(("! -s " if nsrc else "-s ") + cidr(src))
        if dst:
            sv.append("-d " + cidr(dst))
        if proto:
            sv.append("-p " + proto)
        if comment:
            kp.append("-m comment --comment " + _kp_quote(comment))
            sv.append("-m comment --comment " + save_quote(comment))
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
        """What kube-proxy pipes into ``iptables-restore --noflush`` for one full sync."""
        out: list[str] = []
        for t in self.order:
            out.append("*" + t)
            out.extend(self.kp_chains[t])
            out.extend(self.kp_rules[t])
            out.append("COMMIT")
        return "\n".join(out) + "\n"

    def save_text(self, backend: str | None = "legacy") -> str:
        """What ``iptables-save`` prints (``backend`` "nft": iptables-nft-save's header;
        None: no comment lines)."""
        return render_save(self.save, backend, self.family)


def render_save(tables: Mapping[str, Mapping[str, Sequence[str]]],
                backend: str | None = "legacy", family: int = 4) -> str:
    """iptables-save layout: built-in chains first, user chains sorted by name, rules
    grouped per chain in that order; ``backend`` None leaves out the comment lines."""
    ipt = "ip6tables" if family == 6 else "iptables"
    if backend == "nft":
        header = f"# Generated by {ipt}-nft-save {IPTABLES_VERSION} (nf_tables) on {SAVE_DATE}"
    else:
        header = f"# Generated by {ipt}-save {IPTABLES_VERSION} on {SAVE_DATE}"
    out: list[str] = []
    # iptables-nft-save prints filter before nat; iptables-legacy-save walks the
    # kernel's table list, newest registration first, so its order varies per node.
    # Use nft's order for both.
    for t in sorted(tables, key=lambda name: (name != "filter", name)):
        chains = tables[t]
        builtins = [c for c in BUILTIN.get(t, ()) if c in chains]
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
            out.append(f"# Completed on {SAVE_DATE}")
    return "\n".join(out) + "\n"


def prepend_hooks(t: Tables, table: str, jumps: Sequence[tuple[str, str, str]],
                  existing: Mapping[str, Sequence[str]] | None = None) -> None:
    """Apply kube-proxy's EnsureRule(Prepend, ...) calls in order to the built-ins.

    ``jumps`` are (builtin chain, rule args after "-A CHAIN", target chain); each is
    inserted at position 1, so the last one processed ends up first. ``existing`` are
    rules already there (kubelet's), which stay below.
    """
    hooks: dict[str, list[str]] = {c: list((existing or {}).get(c, ())) for c in BUILTIN[table]}
    for chain, args, target in jumps:
        hooks[chain].insert(0, f"-A {chain} {args} -j {target}")
    for chain in BUILTIN[table]:
        t.save[table][chain][:0] = hooks[chain]


def jump(comment: str, extra: str = "") -> str:
    """A built-in chain's jump's matches: ``extra``, then its comment."""
    return (extra + " " if extra else "") + "-m comment --comment " + save_quote(comment)


# --- what every mode writes the same way -------------------------------------------------


def nodeports_last(t: Tables) -> None:
    """iptables mode's final KUBE-SERVICES rule (both generations)."""
    t.rule("nat", "KUBE-SERVICES", "KUBE-NODEPORTS",
           comment="kubernetes service nodeports; NOTE: this must be the last rule in this chain",
           pre="-m addrtype --dst-type LOCAL")


def forward_rules(t: Tables, *, invalid_drop: bool, conntrack_accept: bool) -> None:
    """KUBE-FORWARD: drop INVALID (iptables mode), accept what kube-proxy marked, and
    (v1.24+ and IPVS) accept established flows."""
    # nfacct-counted variants are left out: they need xt_nfacct, which most nodes lack,
    # and kube-proxy then writes the plain rule.
    if invalid_drop:
        t.raw("filter", "KUBE-FORWARD", "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
              "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP")
    t.raw("filter", "KUBE-FORWARD",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {KP_MARK}/{KP_MARK} -j ACCEPT",
          f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
          f"-m mark --mark {MARK}/{MARK} -j ACCEPT")
    if conntrack_accept:
        t.rule("filter", "KUBE-FORWARD", "ACCEPT", comment="kubernetes forwarding conntrack rule",
               pre="-m conntrack --ctstate RELATED,ESTABLISHED")


def canary_chains(t: Tables) -> None:
    """kube-proxy's canaries (created by its health check, not by the restore input)."""
    t.chain("filter", "KUBE-PROXY-CANARY", by_kube_proxy=False)
    t.chain("nat", "KUBE-PROXY-CANARY", by_kube_proxy=False)


def nat_hooks(t: Tables) -> None:
    """The nat built-in chain jumps (EnsureRule, not part of the restore input)."""
    prepend_hooks(t, "nat", [
        ("OUTPUT", jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("PREROUTING", jump("kubernetes service portals"), "KUBE-SERVICES"),
        ("POSTROUTING", jump("kubernetes postrouting rules"), "KUBE-POSTROUTING"),
    ])


def masquerade_rules(t: Tables) -> None:
    """KUBE-POSTROUTING and KUBE-MARK-MASQ, as kube-proxy's iptables and IPVS proxiers
    both write them: masquerade what KUBE-MARK-MASQ marked, clearing the mark first so a
    re-traversing packet is not masqueraded twice."""
    t.raw("nat", "KUBE-POSTROUTING",
          f"-A KUBE-POSTROUTING -m mark ! --mark {KP_MARK}/{KP_MARK} -j RETURN",
          f"-A KUBE-POSTROUTING -m mark ! --mark {MARK}/{MARK} -j RETURN")
    t.raw("nat", "KUBE-POSTROUTING", f"-A KUBE-POSTROUTING -j MARK --xor-mark {KP_MARK}",
          f"-A KUBE-POSTROUTING -j MARK --set-xmark {MARK}/0x0")
    t.rule("nat", "KUBE-POSTROUTING", "MASQUERADE",
           comment="kubernetes service traffic requiring SNAT", topts="--random-fully")
    t.raw("nat", "KUBE-MARK-MASQ", f"-A KUBE-MARK-MASQ -j MARK --or-mark {KP_MARK}",
          f"-A KUBE-MARK-MASQ -j MARK --set-xmark {MARK}/{MARK}")
