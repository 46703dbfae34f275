"""kube-proxy's nftables mode: which LB/external IPs its `ip kube-proxy` and `ip6
kube-proxy` tables serve, the mode itself, and its backend for the one path finder
(agent.diagnose.paths): the hooks walked through every nftables table on them in priority
order, iptables tables beside them. An IPv6 LB IP is walked with an IPv6 packet through
the `ip6` and `inet` tables (kube-proxy's dual-stack proxier writes one table per
family), by the same finder as the IPv4 ones.
"""

from __future__ import annotations

import re
from dataclasses import replace

from agent.diagnose.family import v6_local_known
from agent.diagnose.iptables_backend import IptablesBackend
from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.model import KubeProxyMode
from agent.diagnose.node_facts import (
    NODE_STAND_IN,
    NODE_STAND_IN6,
    OUTSIDE_CLIENT6,
    NodeFacts,
)
from agent.diagnose.outcome import Outcome, PathOutcome
from agent.diagnose.paths import (
    ASSUMED,
    ModeBackend,
    PathFinder,
    rendered,
    unless_input_drops,
)
from agent.netfilter import assumption
from agent.netfilter.assumption import Assumption
from agent.netfilter.nft_model import NftRuleset, NftTable
from agent.netfilter.nft_read import ruleset_of
from agent.netfilter.nft_walk import NftWalker, iptables_nft_table
from agent.netfilter.packet import Hook, HookResult, Packet, WalkStep
from agent.numbers import is_number
from agent.parse.ip_text import ip_number
from agent.snapshot import NodeSnapshot

# kube-proxy's chain names: "external-42NFTM6N-ns2/svc2/tcp/p80"
_CHAIN = re.compile(r"^(service|external|firewall|endpoint)-[A-Z0-9]{8}-"
                    r"([a-z0-9][-a-z0-9.]*)/([a-z0-9][-a-z0-9.]*)/(tcp|udp|sctp)/(.*)$")
# "ip saddr != 10.0.0.0/8 jump mark-for-masquerade" ("ip6 saddr != fd00:10::/64 ..."):
# kube-proxy's cluster CIDR
_CIDR_MASQ = re.compile(r"ip6? saddr != ([0-9a-fA-F:.]+/\d+) jump mark-for-masquerade")


def nft_mode(snap: NodeSnapshot, mode: KubeProxyMode, how: str) -> tuple[KubeProxyMode, str]:
    """kube-proxy's nftables mode, from its flags or from its table."""
    if (snap.given or {}).get("mode"):
        return mode, how
    kp = snap.kube_proxy
    if kp and kp.mode == "nftables":
        return "nftables", ("kube-proxy --proxy-mode=nftables" if kp.pid is not None else
                            "kube-proxy's mode nftables as the input shows it")
    rs, _ = ruleset_of(snap)
    t = (rs.kube_proxy or rs.kube_proxy_for(True)) if rs is not None else None
    if t is None:
        return mode, how
    if mode == "unknown":
        return "nftables", f"nft table {t.family} kube-proxy exists (kube-proxy nftables mode)"
    svc = t.set("service-ips")
    if svc is not None and svc.elements:
        # kube-proxy removes the other modes' rules when it starts: both at once is a
        # leftover or a second proxy; the verdict says which one it walked
        return mode, (f"{how}; an nft table {t.family} kube-proxy with {len(svc.elements)} "
                      f"service addresses exists too (a leftover of nftables mode, or a second "
                      f"proxy?): walked as {mode}; give --mode nftables to walk it instead")
    return mode, how


def cluster_cidr(t: NftTable) -> str | None:
    """The cluster CIDR kube-proxy's service chains name ("ip saddr != CIDR jump
    mark-for-masquerade"): its local-traffic detector, where pods' addresses lie."""
    for c in t.chains:
        if not c.name.startswith("service-"):
            continue
        for r in c.rules:
            m = _CIDR_MASQ.search(r.text)
            if m:
                return m.group(1)
    return None


def nft_targets(snap: NodeSnapshot, known: tuple[LbTarget, ...]) -> tuple[LbTarget, ...]:
    """``known`` (from Services, iptables, ipsets) with what kube-proxy's nft table says
    added: LB/external IPs of @service-ips that are no ClusterIP, their NodePort (the
    @service-nodeports element going to the same chain), the Service (from the chain's
    name) and externalTrafficPolicy (Local when the external chain short-circuits only
    pod and local traffic)."""
    rs, _ = ruleset_of(snap)
    by_key = {x.key: x for x in known}  # insertion order: known first, then the new
    # IPv6 (ip6 kube-proxy) LB IPs are listed too: the diagnosis says they are not walked
    for family, version in (("ip", 4), ("ip6", 6)):
        t = rs.table(family, "kube-proxy") if rs else None
        if t is not None:
            _table_targets(snap, t, version, by_key)
    return tuple(by_key.values())


def _table_targets(snap: NodeSnapshot, t: NftTable, version: int,
                   by_key: dict[tuple[str, int, str], LbTarget]) -> None:
    svc_ips = t.set("service-ips")
    if svc_ips is None:
        return
    cluster = t.set("cluster-ips")
    cluster_ips = {e[0][0] for e in cluster.elements} if cluster else set()
    cluster_ips |= {s.cluster_ip for s in snap.services or () if s.cluster_ip}
    # LoadBalancerSourceRanges: the @firewall-ips map (v1.30 on) or the v1.29 alpha's
    # @firewall set; either way only a load balancer's address is in it
    fw = t.set("firewall-ips") or t.set("firewall")
    fw_keys = {e[0] for e in fw.elements} if fw else set()
    nodeports: dict[str, int] = {}
    np_map = t.set("service-nodeports")
    for parts, verdict in np_map.elements if np_map else ():
        if len(parts) == 2 and is_number(parts[1]) and verdict:
            nodeports[verdict.split()[-1]] = int(parts[1])
    for parts, verdict in svc_ips.elements:
        if len(parts) != 3 or not is_number(parts[2]) or not verdict:
            continue
        ip, proto, port = parts[0], parts[1].upper(), int(parts[2])
        # without @cluster-ips (older generations), a ClusterIP is the element that goes
        # straight to its service- chain; LB and external IPs go to an external- chain, or
        # (v1.29 alpha, with source ranges) to a firewall- chain that goes on to it
        chain = _through_firewall(t, verdict.split()[-1])
        # (the Services' ClusterIPs are their primary family's only: a dual-stack
        # Service's other one is in no Service field read here)
        if ip in cluster_ips or (cluster is None and chain.startswith("service-")):
            continue
        number = ip_number(ip)
        if number is None or number[0] != version:
            continue
        m = _CHAIN.match(chain)
        service = f"{m.group(2)}/{m.group(3)}" if m else None
        etp, etp_how = _etp(t, chain)
        kind = "loadbalancer" if parts in fw_keys else "external"
        src = (f"nft {t.family} map service-ips element {ip} . {parts[1]} . {port} : {verdict} "
               f"(map declared at {svc_ips.source})" + ("" if kind == "loadbalancer" else
                                        ": an LB or external IP (not a ClusterIP)"))
        old = by_key.get((ip, port, proto))
        if old is not None:
            by_key[old.key] = replace(
                old, learned_from=tuple(dict.fromkeys((*old.learned_from, src))),
                service=old.service or service, etp=old.etp or etp,
                etp_how=old.etp_how or etp_how, node_port=old.node_port or nodeports.get(chain),
                by_kube_proxy=True)
            continue
        new = LbTarget(ip, port, proto, kind, service, (src,), etp, etp_how,
                       node_port=nodeports.get(chain), by_kube_proxy=True)
        by_key[new.key] = new



def _through_firewall(t: NftTable, chain_name: str) -> str:
    """The external- chain a firewall- chain sends allowed sources on to (kube-proxy
    v1.29 alpha's LoadBalancerSourceRanges), else the chain itself."""
    c = t.chain(chain_name) if chain_name.startswith("firewall-") else None
    for r in c.rules if c else ():
        words = r.text.split()
        for k, w in enumerate(words[:-1]):
            if w in ("goto", "jump") and words[k + 1].startswith("external-"):
                return words[k + 1]
    return chain_name


def _etp(t: NftTable, chain_name: str) -> tuple[str | None, str]:
    c = t.chain(chain_name)
    if c is None or not chain_name.startswith("external-"):
        return None, ""
    texts = [r.text for r in c.rules]
    if any("short-circuit pod traffic" in x or x.startswith("fib saddr type local")
           for x in texts):
        return "Local", (f"nft chain {chain_name} sends on only pod and local traffic "
                         "(kube-proxy's externalTrafficPolicy=Local chain)")
    if texts and texts[0].startswith("jump mark-for-masquerade"):
        return "Cluster", (f"nft chain {chain_name} masquerades all external traffic "
                           "(externalTrafficPolicy=Cluster)")
    return None, ""


class NftBackend(ModeBackend):
    """kube-proxy's nftables tables, walked hook by hook. iptables tables of the same node
    (a CNI's iptables-nft or legacy rules) are walked at their hook priorities."""

    forward_after_dnat = True
    where = {"prerouting": "the prerouting hook", "input": "the input hook",
             "forward": "the forward hook", "output": "the output hook",
             "postrouting": "the postrouting hook"}

    def __init__(self, facts: NodeFacts) -> None:
        self.facts = facts
        snap = facts.snapshot
        rs, problems = ruleset_of(snap)
        self.ruleset: NftRuleset = rs or NftRuleset()
        ipt = IptablesBackend(facts) if snap.netfilter is not None else None
        walkers = {}
        if ipt is not None:
            if ipt.nat is not None and snap.netfilter and snap.netfilter.table("nat"):
                walkers["nat"] = ipt.nat.walk
            if ipt.filter is not None:
                walkers["filter"] = ipt.filter.walk
        # iptables' filter FORWARD holding no rule: its policy answers every packet alike
        # (the forward hook's walks of DNATed packets are then shared: NftWalker)
        fwd = ipt.filter.table.chain("FORWARD") if ipt and ipt.filter else None
        quiet = frozenset({("filter", "forward")}) if "filter" in walkers and \
            (fwd is None or not len(fwd.rules)) else frozenset()
        self.walker = NftWalker(self.ruleset, _View(facts, v6_local_known(snap)), walkers,
                                quiet)
        kp = self.ruleset.kube_proxy
        self.cidr = cluster_cidr(kp) if kp else None
        kp6 = self.ruleset.kube_proxy_for(True)
        self.cidr6 = cluster_cidr(kp6) if kp6 else None
        self.problems = problems
        notes = [f"nft input: {p}" for p in problems[:5]]
        if walkers:
            notes.append("iptables tables (" + ", ".join(sorted(walkers)) + ") are walked "
                         "with kube-proxy's nftables chains in hook priority order; at equal "
                         "priority the kernel's order is registration order, which a dump "
                         "does not show: nft chains are walked first")
            if kp6 is not None:
                notes.append("IPv6 packets are walked through the ip6 and inet nftables "
                             "tables only: ip6tables rules are not read in nftables mode")
        other = [f"{t.family} {t.name}" for t in self.ruleset.tables
                 if t.name != "kube-proxy" and t.family in ("ip", "inet")
                 and not (walkers and t.family == "ip" and iptables_nft_table(t))]
        if other:
            notes.append("other nftables tables on the same hooks are walked too: "
                         + ", ".join(other[:10]))
        self.notes: tuple[str, ...] = tuple(notes)

    def walk_hook(self, hook: Hook, pkt: Packet) -> list[HookResult]:
        return self.walker.walk_hook(hook, pkt)

    def word(self, verdict: str) -> str:
        return verdict.lower()

    def walks(self, ip: str) -> bool:
        """Whether kube-proxy's table of this address's family is in the input."""
        return self.ruleset.kube_proxy_for(":" in ip) is not None

    def _missing(self, v6: bool) -> str | None:
        fam = "ip6" if v6 else "ip"
        kp = self.ruleset.kube_proxy_for(v6)
        if kp is None:
            return (f"kube-proxy's nft table ({fam} kube-proxy) is not in the input: `nft list "
                    f"table {fam} kube-proxy` shows it")
        if not _has_nat_prerouting(kp):
            return _EXCERPT.format(fam=fam)
        return None

    def cannot_walk(self, t: LbTarget) -> PathOutcome | None:
        why = self._missing(":" in t.ip)
        return None if why is None else PathOutcome(Outcome.UNKNOWN, why, ())

    def cannot_serve(self, t: LbTarget) -> str | None:
        return self._missing(":" in t.ip)

    def cluster_cidr(self, v6: bool) -> str | None:
        return self.cidr6 if v6 else self.cidr

    def local_assumption(self, p: Packet) -> Assumption:
        return assumption.local_address(
            p.dst, f"`{'ip -6 route' if p.v6 else 'ip route'} show table local`")

    def unknown_local(self, p: Packet) -> str:
        return (f" [not given: `{'ip -6 route' if p.v6 else 'ip route'} show table local` "
                "decides it]")

    def to_local(self, finder: PathFinder, p: Packet, known: bool, ev: tuple[str, ...],
                 took: tuple[Assumption, ...], steps: tuple[WalkStep, ...]
                 ) -> list[PathOutcome]:
        if known:
            route = self.facts.local_route(p.dst)
            routing = f"routing: {p.dst} is local ({route.line if route else ''}) -> input"
        else:
            routing = f"routing{ASSUMED} {p.dst} is a local address{self.unknown_local(p)} " \
                      "-> input"
        out = []
        for ir in self.walker.walk_hook("input", p):
            ev2 = (*ev, routing, *map(rendered, ir.steps))
            took2 = took + ir.assumed
            st2 = steps + ir.steps
            if ir.verdict in ("DROP", "REJECT"):
                out.append(PathOutcome(Outcome.DROPPED, self.ended(ir.verdict, "input"), ev2,
                                       took2, st2))
            else:
                how = "delivered to this node's own stack (local address): it does not " \
                      "leave the node"
                if ir.verdict == "UNKNOWN":  # (the input hook only accepts or drops it)
                    how = unless_input_drops(how, ir.detail)
                    ev2 = (*ev2, ir.detail)
                out.append(PathOutcome(Outcome.CAPTURED, how,
                                       (*ev2, finder.once(f"result: {how}")),
                                       took2, st2))
        return out

    def finish(self, got: PathOutcome) -> PathOutcome:
        if got.kind == Outcome.NOT_MASQUERADED and self.problems:
            # the loop may be built on a rule or map element the reader had to skip
            why = (f"the walk finds no DNAT and no masquerade, but {len(self.problems)} "
                   f"nft line(s) could not be read ({self.problems[0]}): what they hold "
                   "may DNAT or masquerade it")
            return PathOutcome(Outcome.UNKNOWN, why, (*got.evidence, why),
                               got.assumptions, got.steps)
        return got

    def node_address(self, finder: PathFinder, v6: bool) -> tuple[str | None, str]:
        f = self.facts
        own = finder.node_ip(v6)
        if own:
            return own, ""
        kp = self.ruleset.kube_proxy_for(v6)
        s = kp.set("nodeport-ips") if kp else None
        if s and s.elements:
            ip = s.elements[0][0][0]
            return ip, (f"the node's address {ip} from @nodeport-ips (kube-proxy lists the "
                        "node's addresses that accept NodePorts there)")
        stand_in = NODE_STAND_IN6 if v6 else NODE_STAND_IN
        if stand_in in f.assumed_local or (v6 and self.walker.view.addr_type(stand_in) ==
                                           "LOCAL"):
            return stand_in, (f"the node's {'IPv6 ' if v6 else ''}address is not in the "
                              f"input: {stand_in} stands for it (a local address, as any "
                              "address of the node is)")
        return None, ""


def nft_paths(facts: NodeFacts) -> PathFinder:
    """The path finder of an nftables-mode node (both families)."""
    return PathFinder(facts, NftBackend(facts))


_EXCERPT = ("kube-proxy's nft table ({fam} kube-proxy) in the input has no nat prerouting "
            "chain (an excerpt of it?): walking it would miss its DNAT; `nft list table "
            "{fam} kube-proxy` shows it whole")


def _has_nat_prerouting(t: NftTable) -> bool:
    """kube-proxy's table as a whole has its nat prerouting base chain; a pasted map or
    chain of it does not."""
    return any(c.hook == "prerouting" and c.type == "nat" for c in t.chains)


class _View:
    """The node as the walker sees it, with the IPv6 stand-ins answered as NodeFacts
    answers the IPv4 ones: the node's stand-in address is local when the node's IPv6
    address is unknown, the outside client is not local."""

    def __init__(self, facts: NodeFacts, v6_local: bool = True) -> None:
        self.facts = facts
        self.v6_local = v6_local  # the input shows the IPv6 local table

    def addr_type(self, addr: str) -> str | None:
        if addr == OUTSIDE_CLIENT6 and self.facts.local_route(addr) is None:
            return "UNICAST"
        if addr == NODE_STAND_IN6 and not self.facts.node_ip6 and \
                self.facts.local_route(addr) is None:
            return "LOCAL"
        if ":" in addr and not self.v6_local and addr not in self.facts.assumed_local:
            return None  # which IPv6 addresses are local is not in the input
        return self.facts.addr_type(addr)
