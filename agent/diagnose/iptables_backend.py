"""iptables and IPVS mode as the path finder walks them: kube-proxy's nat and filter
tables (iptables-legacy or iptables-nft, as iptables-save prints them), and IPVS taking
a pod's packet to a local address (the LB IP bound on kube-ipvs0).

What the walk does not do here yet, where nftables mode's backend does: a DNATed pod
packet is not followed through filter FORWARD (kube-proxy's own rules there accept it; a
CNI's policy chains could drop it: "dropped", no loop either way, where "captured" is
said). A packet to a local address walks filter INPUT before IPVS takes it, as the
kernel runs them (tests/test_mode_contract.py found the walk skipping it).
"""

from __future__ import annotations

import functools
import re

from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.node_facts import NodeFacts
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
from agent.netfilter.packet import DROPPED, Hook, HookResult, Packet, WalkStep
from agent.netfilter.walk import UNSEEN_REST, TableWalker
from agent.parse.ip_text import host_port
from agent.snapshot import Chain, Netfilter, Rule, Rules, Table

# kube-proxy installs these jumps from the built-in chains itself (iptablesJumpChains,
# each prepended), outside the iptables-restore input it writes; a dump of that input
# lacks them. Listed in the order they end up in the chain.
_NEW = "-m conntrack --ctstate NEW "
_KUBE_HOOKS = {
    "nat": (("PREROUTING", "KUBE-SERVICES", "kubernetes service portals", ""),
            ("OUTPUT", "KUBE-SERVICES", "kubernetes service portals", ""),
            ("POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules", "")),
    "filter": (("INPUT", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules", _NEW),
               ("INPUT", "KUBE-NODEPORTS", "kubernetes health check service ports", ""),
               ("INPUT", "KUBE-EXTERNAL-SERVICES",
                "kubernetes externally-visible service portals", _NEW),
               ("FORWARD", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules", _NEW),
               ("FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules", ""),
               ("FORWARD", "KUBE-SERVICES", "kubernetes service portals", _NEW),
               ("FORWARD", "KUBE-EXTERNAL-SERVICES",
                "kubernetes externally-visible service portals", _NEW)),
}

# Chains whose one rule has been the same in every version (KUBE-MARK-MASQ is
# kube-proxy's, KUBE-MARK-DROP kubelet's until 1.28): an excerpt or restore input that
# jumps to one without showing it gets it, and says so.
_STANDARD_CHAINS = {"nat": (
    ("KUBE-MARK-MASQ", "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000", "kube-proxy"),
    ("KUBE-MARK-DROP", "-A KUBE-MARK-DROP -j MARK --or-mark 0x8000", "kubelet"),
)}
_FIREWALL_DROP = ('-A KUBE-FIREWALL -m comment --comment "kubernetes firewall for dropping '
                  'marked packets" -m mark --mark 0x8000/0x8000 -j DROP')


def with_kube_proxy_hooks(nf: Netfilter) -> tuple[Netfilter, tuple[str, ...]]:
    """Add kube-proxy's built-in-chain jumps when the dump is its restore input (no
    iptables-save header): a real dump without them is a node where they are missing.
    An excerpt also gets KUBE-MARK-MASQ's standard rule when it jumps there unseen."""
    if nf.backend != "unknown":
        return nf, ()
    notes: list[str] = []
    tables = []
    nat = nf.table("nat")
    marks_drop = nat is not None and nat.chain("KUBE-MARK-DROP") is None and \
        _referenced(nat, "KUBE-MARK-DROP")
    for t in nf.tables:
        chains = list(t.chains)
        for name, rule, owner in _STANDARD_CHAINS.get(t.name, ()):
            if t.chain(name) is None and _referenced(t, name):
                src = f"assumed: {owner}'s standard {name} (not in the input)"
                chains.append(Chain(name, None, Rules.of((Rule(rule, src),))))
                notes.append(f"{t.name} {name}: {src}")
        added: dict[str, list[Rule]] = {}
        for builtin, target, comment, extra in _KUBE_HOOKS.get(t.name, ()):
            if t.chain(target) is None:
                continue
            if nf.partial:
                # an excerpt that shows kube-proxy's chain but not the built-in one: the
                # jump kube-proxy always installs there is assumed, and said
                if t.chain(builtin) is not None:
                    continue
                src = "assumed: kube-proxy's jump; the excerpt does not show this chain"
            elif _referenced(t, target):
                continue
            else:
                src = "assumed: kube-proxy installs this jump outside its restore input"
            text = f'-A {builtin} {extra}-m comment --comment "{comment}" -j {target}'
            notes.append(f"{t.name} {builtin} -> {target}: {src}")
            added.setdefault(builtin, []).append(Rule(text, src))
        for builtin, rules in added.items():
            existing = next((c for c in chains if c.name == builtin), None)
            # kube-proxy prepends its jumps (EnsureRule(Prepend, ...))
            if existing is None:
                # an excerpt's unseen built-in chain holds more than kube-proxy's jump (a
                # CNI's masquerade in POSTROUTING): falling off its end is not ACCEPT
                chains.append(Chain(builtin, UNSEEN_REST if nf.partial else "ACCEPT",
                                    Rules.of(rules)))
            else:
                chains[chains.index(existing)] = Chain(builtin, existing.policy,
                                                       Rules.of((*rules, *existing.rules)))
        tables.append(Table(t.name, tuple(chains)))
    if marks_drop and not any(c.name == "KUBE-FIREWALL" for t in tables if t.name == "filter"
                              for c in t.chains):
        # kubelet pairs KUBE-MARK-DROP with filter KUBE-FIREWALL, hooked from INPUT
        src = "assumed: kubelet's KUBE-FIREWALL for KUBE-MARK-DROP (not in the input)"
        notes.append(f"filter INPUT -> KUBE-FIREWALL: {src}")
        flt = next((t for t in tables if t.name == "filter"), None)
        chains = list(flt.chains) if flt else []
        inp = next((c for c in chains if c.name == "INPUT"), None)
        hook = Rule("-A INPUT -j KUBE-FIREWALL", src)
        if inp is None:
            chains.append(Chain("INPUT", "ACCEPT", Rules.of((hook,))))
        else:
            chains[chains.index(inp)] = Chain("INPUT", inp.policy,
                                              Rules.of((hook, *inp.rules)))
        chains.append(Chain("KUBE-FIREWALL", None, Rules.of((Rule(_FIREWALL_DROP, src),))))
        new = Table("filter", tuple(chains))
        tables = [new if t is flt else t for t in tables] if flt else [*tables, new]
    return Netfilter(nf.backend, tuple(tables), nf.partial), tuple(notes)


def not_walked(nf: Netfilter) -> tuple[str, ...]:
    """Rules in tables the walk does not follow (raw, mangle) on the paths it models."""
    out = []
    for tname in ("raw", "mangle"):
        t = nf.table(tname)
        for cname in ("PREROUTING", "FORWARD", "POSTROUTING"):
            c = t.chain(cname) if t else None
            if c and c.rules:
                out.append(f"{tname} {cname} has {len(c.rules)} rules that are not walked "
                           "(marks or drops there are not taken into account)")
    return tuple(out)


def _referenced(t: Table, chain: str) -> bool:
    """Does any rule of the table jump or go to ``chain``?"""
    needles = (f"-j {chain}", f"-g {chain}")
    inside = (f"-j {chain} ", f"-g {chain} ")
    return any(text.endswith(needles) or inside[0] in text or inside[1] in text
               for c in t.chains for text in c.rules.texts)


_SHOWS_LOCAL = "`ip addr show kube-ipvs0` or `ip route show table local`"
DECIDES_LOCAL = f" [not given: {_SHOWS_LOCAL} decides it]"
# an endpoint chain the walk reached but an excerpt does not show
_UNSEEN_ENDPOINT_CHAIN = re.compile(
    r"target (KUBE-(SVC|SVL|SEP|EXT|XLB|FW)-[A-Z2-7]{16}) is neither")


class IptablesBackend(ModeBackend):
    where = {"prerouting": "nat PREROUTING", "input": "filter INPUT",
             "forward": "filter FORWARD", "output": "nat OUTPUT",
             "postrouting": "nat POSTROUTING"}

    def __init__(self, facts: NodeFacts) -> None:
        self.facts = facts
        snap = facts.snapshot
        self.notes: tuple[str, ...] = ()
        self.nat: TableWalker | None = None
        self.filter: TableWalker | None = None
        self.partial = snap.netfilter is not None and snap.netfilter.partial
        if snap.netfilter is not None:
            nf, self.notes = with_kube_proxy_hooks(snap.netfilter)
            self.notes += not_walked(snap.netfilter)
            nat = nf.table("nat")
            flt = nf.table("filter")
            self.nat = TableWalker(nat or Table("nat"), facts, nf.partial)
            self.filter = TableWalker(flt, facts, nf.partial) if flt is not None else None

    def walk_hook(self, hook: Hook, pkt: Packet) -> list[HookResult]:
        if hook in ("prerouting", "postrouting", "output"):
            assert self.nat is not None  # (cannot_walk said so before any walk)
            return self.nat.walk(hook.upper(), pkt)
        if self.filter is None:
            return [HookResult("ACCEPT", pkt, ())]
        return self.filter.walk(hook.upper(), pkt)

    def cannot_walk(self, t: LbTarget) -> PathOutcome | None:
        if self.nat is None:
            return PathOutcome(Outcome.UNKNOWN, "the nat rules could not be read",
                               ("nat rules could not be read",))
        return None

    def cannot_serve(self, t: LbTarget) -> str | None:
        return "nat rules unknown" if self.nat is None else None

    def unseen(self, res: HookResult, ev: tuple[str, ...], took: tuple[Assumption, ...]
               ) -> PathOutcome | None:
        unseen = _UNSEEN_ENDPOINT_CHAIN.search(res.detail) if self.partial else None
        if unseen is None:
            return None
        chain, kind = unseen.group(1), unseen.group(2)
        if kind in ("XLB", "FW"):
            # before 1.24, without --cluster-cidr, KUBE-XLB has no rule for pods: with no
            # local endpoint it only marks for drop (kubelet drops that mark on INPUT and
            # OUTPUT, not FORWARD) and the pod's packet leaves as it is: unseen, undecided
            why = (f"what {chain} does with a pod's packet: `iptables -t nat -S {chain}` "
                   "shows it (without kube-proxy's --cluster-cidr and a local endpoint it "
                   "lets it leave unmasqueraded)")
            return PathOutcome(Outcome.UNKNOWN, why, (*ev, why), took, res.steps)
        # kube-proxy jumps only to chains it wrote: endpoint chains DNAT to an endpoint;
        # its EXT chains (1.24+) send on to those, or leave what has no local endpoint to
        # filter's "has no local endpoints" drop. Either way the packet is handled on the
        # node, never sent to the LB with the pod's source.
        if kind in ("SVC", "SVL", "SEP"):
            how = f"kube-proxy sends it to {chain}, which DNATs to one of the service's " \
                  "endpoints"
            does = "to DNAT to an endpoint, as kube-proxy writes it"
        else:
            how = (f"kube-proxy sends it to {chain}, which sends it on to the service's "
                   "endpoints (or drops it where there is none)")
            does = ("to send it to the service's endpoint chain, or to drop it when there "
                    "is no (local) endpoint, as kube-proxy writes it")
        shows = f"iptables -t nat -S {chain}"
        return PathOutcome(Outcome.CAPTURED, how, (
            *ev, f"{chain}{ASSUMED} {does} (not in the input: `{shows}` shows it)",
            f"result: {how}"), (*took, assumption.unseen_chain(chain, shows)), res.steps)

    def local_assumption(self, p: Packet) -> Assumption:
        return assumption.local_address(p.dst, _SHOWS_LOCAL)

    def unknown_local(self, p: Packet) -> str:
        return DECIDES_LOCAL

    def to_local(self, finder: PathFinder, p: Packet, known: bool, ev: tuple[str, ...],
                 took: tuple[Assumption, ...], steps: tuple[WalkStep, ...]
                 ) -> list[PathOutcome]:
        """filter INPUT first (kube-proxy's KUBE-PROXY-FIREWALL drops sources outside
        loadBalancerSourceRanges there), then IPVS takes it at LOCAL_IN."""
        if known:
            route = self.facts.local_route(p.dst)
            routing = f"routing: {p.dst} is local ({route.line if route else ''}) -> INPUT"
        else:
            routing = (f"routing{ASSUMED} {p.dst} is a local address (bound on kube-ipvs0 "
                       f"or another interface){DECIDES_LOCAL} -> INPUT")
        out = []
        for ir in self.walk_hook("input", p):
            ev2 = (*ev, routing, *map(rendered, ir.steps))
            took2 = took + ir.assumed
            st2 = steps + ir.steps
            if ir.verdict in DROPPED:
                out.append(PathOutcome(Outcome.DROPPED, self.ended(ir.verdict, "input"), ev2,
                                       took2, st2))
            else:
                how, line = self._ipvs_capture(p)
                if ir.verdict == "UNKNOWN":
                    # filter INPUT only lets a local packet in or drops it: it does not
                    # leave the node either way (an excerpt that shows no INPUT, a rule
                    # there the walk cannot read)
                    how = unless_input_drops(how, ir.detail)
                    ev2 = (*ev2, ir.detail)
                out.append(PathOutcome(Outcome.CAPTURED, how,
                                       (*ev2, line, finder.once(f"result: {how}")),
                                       took2, st2))
        return out

    def _ipvs_capture(self, p: Packet) -> tuple[str, str]:
        snap = self.facts.snapshot
        proto = p.proto.upper()
        if snap.ipvs is not None:
            vs = self.facts.virtual_server(proto, p.dst, p.dport)
            if vs is not None:
                host = f"[{vs.address}]" if ":" in vs.address else vs.address
                line = (f"IPVS virtual server {proto} {host}:{vs.port} "
                        f"({len(vs.real_servers)} real servers)")
                return ("IPVS on this node serves it (the LB IP is local): the packet "
                        "never goes to the load balancer"), line
            return ("delivered to this node's own stack (local address, no IPVS virtual "
                    "server for this port): it does not leave the node"), \
                f"IPVS: no virtual server {proto} {host_port(p.dst, p.dport)}"
        member = f"{p.dst},{p.proto}:{p.dport}"
        for name in ("KUBE-LOAD-BALANCER", "KUBE-EXTERNAL-IP", "KUBE-CLUSTER-IP"):
            if self.facts.family == 6:  # kube-proxy's IPv6 sets (pkg/proxy/ipvs/ipset.go)
                name = name.replace("KUBE-", "KUBE-6-", 1)
            if self.facts.in_ipset(name, member):
                return ("served inside the node (local address; kube-proxy lists it in "
                        f"ipset {name}): the packet never goes to the load balancer"), \
                    f"IPVS state unknown; ipset {name} has {member}"
        return ("delivered to this node's own stack (local address): it does not leave "
                "the node"), "IPVS state unknown"

    def node_address(self, finder: PathFinder, v6: bool) -> tuple[str | None, str]:
        f = self.facts
        if f.node_ip is not None:
            return f.node_ip, ""
        if f.node_stand_in not in f.assumed_local or self._np_by_address:
            # with --nodeport-addresses kube-proxy names the node's addresses in its
            # NodePort jump: a stand-in would miss it
            return None, ""
        return f.node_stand_in, (f"the node's address is not in the input: {f.node_stand_in} "
                                 "stands for it (a local address, as any address of the "
                                 "node is)")

    @functools.cached_property
    def _np_by_address(self) -> bool:
        """Does kube-proxy jump to KUBE-NODEPORTS for named destination addresses
        (--nodeport-addresses) rather than for every local one? Once per diagnosis: a
        scan of KUBE-SERVICES (10k rules at 10k services) for each LB IP's walk was 149M
        steps, 20-37 s, when the pod subnet was unknown."""
        nat = self.facts.snapshot.netfilter.table("nat") if \
            self.facts.snapshot.netfilter else None
        chain = nat.chain("KUBE-SERVICES") if nat else None
        return chain is not None and any(
            " -d " in text and ("-j KUBE-NODEPORTS" in text or "-g KUBE-NODEPORTS" in text)
            for text in chain.rules.texts)


def iptables_paths(facts: NodeFacts) -> PathFinder:
    """The path finder of an iptables- or IPVS-mode node (or of its IPv6 view)."""
    return PathFinder(facts, IptablesBackend(facts))
