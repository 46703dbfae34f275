"""Follow concrete packets through the node: a pod of this node to LB IP:port (does it
leave, and with which source?), and an outside client to LB IP:port (is it served here,
is its source kept?). The evidence is the walk, rule by rule."""

from __future__ import annotations

import functools
import ipaddress
import operator
import re
from dataclasses import dataclass

from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.node_facts import NodeFacts
from agent.diagnose.outcome import Outcome, PathOutcome, merge
from agent.netfilter import assumption
from agent.netfilter.assumption import AssumptionKind
from agent.netfilter.walk import (
    UNSEEN_REST,
    HookResult,
    Packet,
    Step,
    TableWalker,
)
from agent.parse.ip_text import host_port
from agent.snapshot import Chain, IpSet, Netfilter, Rule, Table

# An outside client (TEST-NET-2): never local, never a pod.


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

# How an evidence line says it took a fact the input lacks (a walk forked on it): for
# people only; the fact itself travels as an Assumption.
ASSUMED = ": assumed"
_SHOWS_LOCAL = "`ip addr show kube-ipvs0` or `ip route show table local`"
DECIDES_LOCAL = f" [not given: {_SHOWS_LOCAL} decides it]"
# an endpoint chain the walk reached but an excerpt does not show
_UNSEEN_ENDPOINT_CHAIN = re.compile(
    r"target (KUBE-(SVC|SVL|SEP|EXT|XLB|FW)-[A-Z2-7]{16}) is neither")
@dataclass(frozen=True, slots=True)
class ServedOutcome:
    """An outside client's SYN to LB IP:port arriving on the uplink."""

    served: bool | None  # DNATed/IPVS to an endpoint and not dropped
    source_kept: bool | None  # no masquerade on the way to the endpoint
    evidence: tuple[str, ...]
    how: str


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
                chains.append(Chain(name, None, (Rule(rule, src),)))
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
                                    tuple(rules)))
            else:
                chains[chains.index(existing)] = Chain(builtin, existing.policy,
                                                       (*rules, *existing.rules))
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
            chains.append(Chain("INPUT", "ACCEPT", (hook,)))
        else:
            chains[chains.index(inp)] = Chain("INPUT", inp.policy, (hook, *inp.rules))
        chains.append(Chain("KUBE-FIREWALL", None, (Rule(_FIREWALL_DROP, src),)))
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


class PathFinder:
    def __init__(self, facts: NodeFacts) -> None:
        self.facts = facts
        snap = facts.snapshot
        self.notes: tuple[str, ...] = ()
        self._lines: dict[str, str] = {}
        self._sets: dict[str, tuple[IpSet, frozenset[str]]] = {}
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

    # -- pod -> LB ----------------------------------------------------------------------

    def pod_to_lb(self, t: LbTarget) -> PathOutcome:
        f = self.facts
        if self.nat is None:
            return PathOutcome(Outcome.UNKNOWN, "the nat rules could not be read",
                               ("nat rules could not be read",))
        if f.pod is None:
            # walk it anyway: a rule that asks the source forks the walk, and where every
            # answer leads to the same outcome that outcome holds for any pod address
            pkt = Packet(src=f.pod_stand_in, dst=t.ip, proto=t.protocol.lower(),
                         dport=t.port, src_known=False)
            head = (f"packet: {pkt.describe()}; {f.pod_unknown}: both answers to every match "
                    "on the source are followed",)
        else:
            pkt = Packet(src=f.pod.pod_ip, dst=t.ip, proto=t.protocol.lower(), dport=t.port,
                         in_iface=f.pod.iface)
            head = (f"packet: {pkt.describe()}; {f.pod.how}",)
        results = self.nat.walk("PREROUTING", pkt)
        if len(results) > 1 and \
                all(r.verdict in _REWRITTEN and not _assumes(r.steps) for r in results):
            # kube-proxy's random choice among a service's endpoints, each DNATing, with
            # no fact assumed: every path is "captured" and the merge would show the
            # first one (its evidence made once, not once per endpoint)
            results = results[:1]
        outcomes = []
        for res in results:
            outcomes.extend(self._after_prerouting(res, head))
        return merge(outcomes)

    def _after_prerouting(self, res: HookResult, head: tuple[str, ...]) -> list[PathOutcome]:
        verdict, p, steps, detail = res
        ev = head + tuple(map(_rendered, steps))
        took = res.assumed
        unseen = _UNSEEN_ENDPOINT_CHAIN.search(detail) if verdict == "UNKNOWN" \
            and self.partial else None
        if unseen and unseen.group(2) in ("XLB", "FW"):
            # before 1.24, without --cluster-cidr, KUBE-XLB has no rule for pods: with no
            # local endpoint it only marks for drop (kubelet drops that mark on INPUT and
            # OUTPUT, not FORWARD) and the pod's packet leaves as it is: unseen, undecided
            chain = unseen.group(1)
            why = (f"what {chain} does with a pod's packet: `iptables -t nat -S {chain}` "
                   "shows it (without kube-proxy's --cluster-cidr and a local endpoint it "
                   "lets it leave unmasqueraded)")
            return [PathOutcome(Outcome.UNKNOWN, why, (*ev, why), assumptions=took)]
        if unseen:
            # kube-proxy jumps only to chains it wrote: endpoint chains DNAT to an endpoint;
            # its EXT chains (1.24+) send on to those, or leave what has no local endpoint
            # to filter's "has no local endpoints" drop. Either way the packet is handled on
            # the node, never sent to the LB with the pod's source.
            chain, kind = unseen.group(1), unseen.group(2)
            if kind in ("SVC", "SVL", "SEP"):
                how = f"kube-proxy sends it to {chain}, which DNATs to one of the service's " \
                      "endpoints"
                does = "to DNAT to an endpoint, as kube-proxy writes it"
            else:
                how = (f"kube-proxy sends it to {chain}, which sends it on to the service's "
                       "endpoints (or drops it where there is none)")
                does = ("to send it to the service's endpoint chain, or to drop it when "
                        "there is no (local) endpoint, as kube-proxy writes it")
            shows = f"iptables -t nat -S {chain}"
            return [PathOutcome(Outcome.CAPTURED, how, (
                *ev, f"{chain}{ASSUMED} {does} (not in the input: `{shows}` shows it)",
                f"result: {how}"), assumptions=(*took, assumption.unseen_chain(chain, shows)))]
        if verdict == "UNKNOWN":
            return [PathOutcome(Outcome.UNKNOWN, detail, (*ev, detail), assumptions=took)]
        if verdict in ("DROP", "REJECT"):
            return [PathOutcome(Outcome.DROPPED, f"{verdict} in nat PREROUTING", ev,
                                assumptions=took)]
        if verdict in ("DNAT", "REDIRECT"):
            how = f"kube-proxy rewrites the destination to {host_port(p.dst, p.dport)} ({verdict})"
            return [PathOutcome(Outcome.CAPTURED, how, (*ev, f"result: {how}; the packet never "
                                                        "goes to the load balancer"),
                                assumptions=took)]
        local = self.facts.is_local(p.dst)
        results: list[PathOutcome] = []
        if local is None:
            # not given the node's addresses: follow both answers (merge decides)
            how, line = self._ipvs_capture(p)
            took = (*took, assumption.local_address(p.dst, _SHOWS_LOCAL))
            results.append(PathOutcome(Outcome.CAPTURED, how, (
                *ev, f"routing{ASSUMED} {p.dst} is a local address (bound on kube-ipvs0 "
                     f"or another interface){DECIDES_LOCAL} -> INPUT", line,
                self._once(f"result: {how}")), assumptions=took))
            ev = (*ev, f"routing{ASSUMED} {p.dst} is NOT a local address{DECIDES_LOCAL}")
        elif local:
            how, line = self._ipvs_capture(p)
            route = self.facts.local_route(p.dst)
            return [PathOutcome(Outcome.CAPTURED, how,
                                (*ev, f"routing: {p.dst} is local ({route.line if route else ''})"
                                 " -> INPUT", line, self._once(f"result: {how}")),
                                assumptions=took)]
        out_iface = self.facts.uplink
        leaving = out_iface or "(uplink unknown)"
        ev = (*ev, f"routing: {p.dst} is not a local address -> forwarded out "
                   f"{leaving}"
              + (f" [{self.facts.uplink_how}]" if self.facts.uplink_how else ""))
        p = p._replace(out_iface=out_iface)
        for fr in self._filter("FORWARD", p):
            ev2 = ev + tuple(_rendered(s) for s in fr.steps if s.table == "filter")
            took2 = took + fr.assumed
            if fr.verdict == "UNKNOWN":
                results.append(PathOutcome(Outcome.UNKNOWN, fr.detail, (*ev2, fr.detail),
                                           assumptions=took2))
                continue
            if fr.verdict in ("DROP", "REJECT"):
                results.append(PathOutcome(Outcome.DROPPED, f"{fr.verdict} in filter FORWARD",
                                           ev2, assumptions=took2))
                continue
            assert self.nat is not None
            for pr in self.nat.walk("POSTROUTING", fr.packet):
                ev3 = ev2 + tuple(map(_rendered, pr.steps))
                took3 = took2 + pr.assumed
                if pr.verdict == "UNKNOWN":
                    results.append(PathOutcome(Outcome.UNKNOWN, pr.detail, (*ev3, pr.detail),
                                               assumptions=took3))
                elif pr.verdict in ("MASQUERADE", "SNAT"):
                    to = _snat_address(pr)
                    node_ip = self.facts.node_ip
                    if pr.verdict == "SNAT" and node_ip is None:
                        # not "not this node's address None": that address is unknown
                        how = (f"leaves {leaving} SNATed to {to}; whether that is the "
                               "node's address the load balancer sends to is not in the "
                               "input (`ip addr` shows it)")
                        results.append(PathOutcome(Outcome.UNKNOWN, how, (*ev3, how),
                                                   assumptions=took3))
                        continue
                    if pr.verdict == "SNAT" and to != node_ip:
                        # the LB only skips the real server whose IP equals the source
                        how = (f"leaves {leaving} SNATed to {to}, which is not this node's "
                               f"address {node_ip}: the load balancer may still pick this node")
                        results.append(PathOutcome(Outcome.NOT_MASQUERADED, how,
                                                   (*ev3, f"result: {how}"), assumptions=took3))
                        continue
                    how = (f"leaves {leaving} with {node_address(node_ip)} ({pr.verdict}): the "
                           "load balancer will not send it back to this node")
                    results.append(PathOutcome(Outcome.MASQUERADED, how, (*ev3, f"result: {how}"),
                                               assumptions=took3))
                elif pr.verdict in ("DROP", "REJECT"):
                    results.append(PathOutcome(Outcome.DROPPED,
                                               f"{pr.verdict} in nat POSTROUTING", ev3,
                                               assumptions=took3))
                else:
                    src = p.src if p.src_known else "(unchanged)"
                    how = (f"leaves {leaving} with the pod's source address {src} "
                           "(no DNAT, not local, no SNAT/MASQUERADE)")
                    results.append(PathOutcome(Outcome.NOT_MASQUERADED, how,
                                               (*ev3, f"result: {how}"), assumptions=took3))
        return results

    def _members(self, s: IpSet) -> frozenset[str]:
        """A set's members to look up (a tuple of 10k members is searched from the start
        each time); kept while the PathFinder is."""
        got = self._sets.get(s.name)
        if got is None or got[0] is not s:
            got = self._sets[s.name] = (s, frozenset(s.members))
        return got[1]

    def _once(self, line: str) -> str:
        """One string for an evidence line many findings share (a result said the same
        way for 10k LB IPs)."""
        return self._lines.setdefault(line, line)

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
            s = snap.ipset(name)
            if s is not None and member in self._members(s):
                return ("served inside the node (local address; kube-proxy lists it in "
                        f"ipset {name}): the packet never goes to the load balancer"), \
                    f"IPVS state unknown; ipset {name} has {member}"
        return ("delivered to this node's own stack (local address): it does not leave "
                "the node"), "IPVS state unknown"

    # -- outside client -> LB (what the load balancer's traffic meets) -----------------

    def outside_to_lb(self, t: LbTarget) -> ServedOutcome:
        """What the load balancer's own traffic meets: a SYN from outside to this node's
        NodePort for the service (the CLB sends to NodeIP:NodePort, never to its VIP)."""
        f = self.facts
        if self.nat is None:
            return ServedOutcome(None, None, (), "nat rules unknown")
        if t.node_port is None:
            return ServedOutcome(None, None, (), "the NodePort is unknown")
        node_ip = f.node_ip
        head: tuple[str, ...] = ()
        if node_ip is None:
            if f.node_stand_in not in f.assumed_local or self._nodeports_by_address():
                # with --nodeport-addresses kube-proxy names the node's addresses in its
                # NodePort jump: a stand-in would miss it
                return ServedOutcome(None, None, (), "the node's address is unknown")
            node_ip = f.node_stand_in
            head = (f"the node's address is not in the input: {node_ip} stands for it "
                    "(a local address, as any address of the node is)",)
        pkt = Packet(src=f.outside_client, dst=node_ip, proto=t.protocol.lower(),
                     dport=t.node_port, in_iface=f.uplink)
        head = (*head, f"packet: {pkt.describe()} (the load balancer forwarding a client)")
        served_any = False
        kept: bool | None = None
        # the evidence of the last path, rendered once at the end (a served NodePort's is
        # not read: 2.5k eTP=Local LB IPs at 10k services): its steps, in the order shown
        last: tuple[tuple[Step, ...], ...] = ()
        tail = ""
        for res in self.nat.walk("PREROUTING", pkt):
            why = _undecided(res)
            if why:
                return ServedOutcome(None, None, _evidence(head, (res.steps,), why), why)
            if res.verdict in ("DROP", "REJECT"):
                last, tail = (res.steps,), f"{res.verdict} in nat PREROUTING"
                continue
            p = res.packet
            if res.verdict not in ("DNAT", "REDIRECT"):
                # to the node itself: filter INPUT decides (kube-proxy's "has no local
                # endpoints" rules live there); nothing listens on a NodePort by itself
                for fr in self._filter("INPUT", p):
                    why = _undecided(fr)
                    if why:
                        return ServedOutcome(None, None, _evidence(head, (res.steps,), why),
                                             why)
                    last, tail = (res.steps, fr.steps), \
                        f"no DNAT to an endpoint: {fr.verdict} in filter INPUT"
                continue
            out = (f.pod.iface if f.pod and f.pod.iface and _in(p.dst, f.pod.prefix)
                   else f.uplink)
            p = p._replace(out_iface=out)
            for fr in self._filter("FORWARD", p):
                seen = (res.steps, tuple(s for s in fr.steps if s.table == "filter"))
                why = _undecided(fr)
                if why:
                    return ServedOutcome(None, None, _evidence(head, seen, why), why)
                if fr.verdict in ("DROP", "REJECT"):
                    last, tail = seen, ""
                    continue
                served_any = True
                for pr in self.nat.walk("POSTROUTING", fr.packet):
                    why = _undecided(pr)
                    if why:
                        return ServedOutcome(None, None, _evidence(head, seen, why), why)
                    masq = pr.verdict in ("MASQUERADE", "SNAT")
                    kept = (not masq) if kept is None else (kept and not masq)
                    last, tail = (*seen, pr.steps), ""
        evidence = _evidence(head, last, tail)
        if served_any:
            how = ("served here" + ("" if kept is None else
                                    (", client source kept" if kept else ", source masqueraded")))
            return ServedOutcome(True, kept, evidence, how)
        return ServedOutcome(False, None, evidence, "not served on this node")

    @functools.cached_property
    def _np_by_address(self) -> bool:
        # once per diagnosis: a scan of KUBE-SERVICES (10k rules at 10k services) for
        # each LB IP's walk was 149M steps, 20-37 s, when the pod subnet was unknown
        nat = self.facts.snapshot.netfilter.table("nat") if \
            self.facts.snapshot.netfilter else None
        chain = nat.chain("KUBE-SERVICES") if nat else None
        return chain is not None and any(
            " -d " in text and ("-j KUBE-NODEPORTS" in text or "-g KUBE-NODEPORTS" in text)
            for text in chain.rules.texts)

    def _nodeports_by_address(self) -> bool:
        """Does kube-proxy jump to KUBE-NODEPORTS for named destination addresses
        (--nodeport-addresses) rather than for every local one?"""
        return self._np_by_address

    def _filter(self, chain: str, p: Packet) -> list[HookResult]:
        return self.filter.walk(chain, p) if self.filter else [HookResult("ACCEPT", p, ())]


def _evidence(head: tuple[str, ...], steps: tuple[tuple[Step, ...], ...], tail: str
              ) -> tuple[str, ...]:
    """A path's evidence: ``head``, each step's line, then ``tail`` (if any)."""
    lines = [*head]
    for part in steps:
        lines += map(_rendered, part)
    if tail:
        lines.append(tail)
    return tuple(lines)


def _undecided(res: HookResult) -> str:
    """Why a path of the load balancer's packet decides nothing: it ended UNKNOWN, or it
    took an answer to a rule on the interface the input does not show (the uplink): a
    NodePort "served" on such a path only may not be served at all."""
    if res.verdict == "UNKNOWN":
        return res.detail
    for a in res.assumed:
        if a.kind == AssumptionKind.INTERFACE:
            return ("a rule asks an interface of the load balancer's packet (the node's "
                    "uplink or the pods' interface) that the input does not show (`ip addr` "
                    f"and `ip route` show them): {a.subject}")
    return ""


def node_address(node_ip: str | None) -> str:
    """The address a MASQUERADE leaves with, for evidence: the node's, whether or not the
    input shows which it is (never "None")."""
    if node_ip:
        return f"the node's address {node_ip}"
    return "the node's address (not in the input: `ip addr` shows it)"


def _snat_address(res: HookResult) -> str | None:
    """The --to-source address of the SNAT that ended the walk (first of a range)."""
    last = res.steps[-1].text if res.steps else ""
    m = re.search(r"--to-source \[?(\d+\.\d+\.\d+\.\d+|[0-9a-fA-F:]*:[0-9a-fA-F:.]*)", last)
    return m.group(1) if m else None


def _in(addr: str, prefix: str) -> bool:
    return ipaddress.ip_address(addr) in _network(prefix)


# the pod network, asked once per NodePort walk (parsing it each time was a tenth of
# the eTP=Local walks' time)
_network = functools.lru_cache(maxsize=64)(functools.partial(ipaddress.ip_network,
                                                             strict=False))


_REWRITTEN = ("DNAT", "REDIRECT")


def _assumes(steps: tuple[Step, ...]) -> bool:
    """Did a path assume a fact (a match the input could not decide)?"""
    return any(map(_ASSUMPTION, steps))


_ASSUMPTION = operator.itemgetter(5)  # Step.assumption (at C speed: walked per LB IP)


# A step's evidence line, made once for the steps many walks share (kube-proxy's jumps
# from the built-in chains, KUBE-MARK-MASQ): one string for every finding that shows it.
_rendered = functools.lru_cache(maxsize=4096)(Step.render)
