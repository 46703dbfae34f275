"""Follow concrete packets through the node: a pod of this node to LB IP:port (does it
leave, and with which source?), and an outside client to LB IP:port (is it served here,
is its source kept?). The evidence is the walk, rule by rule.

One path finder serves every kube-proxy mode: it asks a :class:`ModeBackend` to walk each
hook (iptables' nat and filter tables in iptables and IPVS mode, kube-proxy's nftables
tables in nftables mode) and decides the rest (routing, what an end means) the same way
for all of them. What the modes' rules really do differently stays in their backends,
each said where it is (agent.diagnose.iptables_backend, agent.diagnose.nft_paths).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from agent.diagnose.family import v6_local_known
from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.node_facts import (
    OUTSIDE_CLIENT6,
    POD_STAND_IN6,
    NodeFacts,
    PodNetwork,
    uplink6,
)
from agent.diagnose.outcome import Outcome, PathOutcome, merge
from agent.netfilter.assumption import Assumption, AssumptionKind
from agent.netfilter.packet import (
    DROPPED,
    REWRITTEN,
    SOURCE_NAT,
    Hook,
    HookResult,
    Packet,
    WalkStep,
)
from agent.parse.ip_text import host_port

# How an evidence line says it took a fact the input lacks (a walk forked on it): for
# people only; the fact itself travels as an Assumption.
ASSUMED = ": assumed"


@dataclass(frozen=True, slots=True)
class ServedOutcome:
    """An outside client's SYN to LB IP:port arriving on the uplink."""

    served: bool | None  # DNATed/IPVS to an endpoint and not dropped
    source_kept: bool | None  # no masquerade on the way to the endpoint
    evidence: tuple[str, ...]
    how: str
    steps: tuple[WalkStep, ...] = ()  # the rules of the path the evidence shows

class ModeBackend:
    """One kube-proxy mode's rules as the path finder walks them, and what the mode's
    rules do differently. The defaults are the iptables modes'."""

    notes: tuple[str, ...] = ()
    # does the walk follow a DNATed pod packet through the forward hook? (see the
    # backends for why the iptables modes do not yet)
    forward_after_dnat = False
    # how the evidence names each hook, and a verdict: "DROP in filter FORWARD"
    where: dict[Hook, str] = {}

    def walk_hook(self, hook: Hook, pkt: Packet) -> list[HookResult]:
        raise NotImplementedError

    def word(self, verdict: str) -> str:
        return verdict

    def ended(self, verdict: str, hook: Hook) -> str:
        """How the evidence names a path that ``verdict`` ended in ``hook``."""
        return f"{self.word(verdict)} in {self.where[hook]}"

    def cannot_walk(self, t: LbTarget) -> PathOutcome | None:
        """Why a pod's packet to ``t`` cannot be walked in this input, if it cannot."""
        return None

    def cannot_serve(self, t: LbTarget) -> str | None:
        """Why the load balancer's packet for ``t`` cannot be walked, if it cannot."""
        return None

    def cluster_cidr(self, v6: bool) -> str | None:
        """Where kube-proxy's rules say pods' addresses lie (its local detector)."""
        return None

    def unseen(self, res: HookResult, ev: tuple[str, ...], took: tuple[Assumption, ...]
               ) -> PathOutcome | None:
        """An UNKNOWN end the mode's standard layout decides (an excerpt's unseen chain)."""
        return None

    def dnat_how(self, p: Packet, verdict: str) -> str:
        return f"kube-proxy rewrites the destination to {host_port(p.dst, p.dport)} ({verdict})"

    def to_local(self, finder: PathFinder, p: Packet, known: bool, ev: tuple[str, ...],
                 took: tuple[Assumption, ...], steps: tuple[WalkStep, ...]
                 ) -> list[PathOutcome]:
        """A pod's packet routed to a local address (``known``: the input says it is
        local; else the walk assumes it, and ``took`` says so); ``steps`` the rules taken
        so far."""
        raise NotImplementedError

    def local_assumption(self, p: Packet) -> Assumption:
        """The fact "``p.dst`` is a local address" where the input does not show it."""
        raise NotImplementedError

    def unknown_local(self, p: Packet) -> str:
        """The routing line's words for an address the input does not say is local."""
        raise NotImplementedError

    def finish(self, got: PathOutcome) -> PathOutcome:
        """A merged outcome, with what the mode's input leaves open said."""
        return got

    def node_address(self, finder: PathFinder, v6: bool) -> tuple[str | None, str]:
        """The node's address a NodePort is reached on, and how it was learned (empty
        when the input names it)."""
        raise NotImplementedError


class PathFinder:
    def __init__(self, facts: NodeFacts, backend: ModeBackend) -> None:
        self.facts = facts
        self.backend = backend
        self.notes = backend.notes
        self._lines: dict[str, str] = {}
        self._v6_local = v6_local_known(facts.snapshot)

    # -- the node's side of one family ------------------------------------------------

    def _pod(self, v6: bool) -> tuple[PodNetwork | None, str, str]:
        """(the pods' network, why it is unknown, a stand-in pod address)."""
        f = self.facts
        if v6 and f.family == 4:  # nftables mode walks both families with one finder
            return f.pod6, f.pod6_unknown, POD_STAND_IN6
        return f.pod, f.pod_unknown, f.pod_stand_in

    def node_ip(self, v6: bool) -> str | None:
        f = self.facts
        return f.node_ip6 if v6 and f.family == 4 else f.node_ip

    def uplink(self, v6: bool) -> str | None:
        """Where the packet leaves (or the load balancer's enters): IPv6 by the interface
        holding the node's IPv6 address (an IPv6-only node has no IPv4 uplink)."""
        f = self.facts
        return (uplink6(f) or f.uplink) if v6 and f.family == 4 else f.uplink

    def is_local(self, addr: str) -> bool | None:
        # an IPv4-only local table (an old bundle, a pasted `ip route show table local`)
        # says nothing of IPv6 addresses
        if ":" in addr and not self._v6_local:
            return None
        return self.facts.is_local(addr)

    def once(self, line: str) -> str:
        """One string for an evidence line many findings share (a result said the same
        way for 10k LB IPs)."""
        return self._lines.setdefault(line, line)

    # -- pod -> LB ----------------------------------------------------------------------

    def pod_to_lb(self, t: LbTarget) -> PathOutcome:
        b = self.backend
        blocked = b.cannot_walk(t)
        if blocked is not None:
            return blocked
        v6 = ":" in t.ip
        pod, pod_unknown, stand_in = self._pod(v6)
        if pod is None:
            # walk it anyway: a rule that asks the source forks the walk, and where every
            # answer leads to the same outcome that outcome holds for any pod address
            cidr = b.cluster_cidr(v6)
            pkt = Packet(src=stand_in, dst=t.ip, proto=t.protocol.lower(), dport=t.port,
                         src_known=False, src_within=cidr, src_is_pod=True)
            fam = "ip6" if v6 else "ip"
            head = (f"packet: {pkt.describe()}; {pod_unknown}: both answers to every match "
                    "on the source are followed"
                    + (f"; kube-proxy's rules name the cluster CIDR {cidr} ('{fam} saddr "
                       f"!= {cidr} jump mark-for-masquerade')" if cidr else ""),)
        else:
            pkt = Packet(src=pod.pod_ip, dst=t.ip, proto=t.protocol.lower(), dport=t.port,
                         in_iface=pod.iface, src_is_pod=True)
            head = (f"packet: {pkt.describe()}; {pod.how}",)
        results = b.walk_hook("prerouting", pkt)
        # each DNATed path's walk through the forward hook, where it follows (made once)
        forwarded: list[list[HookResult]] | None = None
        if len(results) > 1 and \
                all(r.verdict in REWRITTEN and not _assumes(r.steps) for r in results):
            if b.forward_after_dnat:
                forwarded = [b.walk_hook("forward", r.packet._replace(out_iface=None))
                             for r in results]
            if forwarded is None or all(map(_accepted_alike, forwarded)):
                # kube-proxy's random choice among a service's endpoints, each DNATing
                # (and, where the forward hook follows, accepted there), with no fact
                # assumed: every path is "captured" and the merge would show the first
                # one (its evidence made once, not once per endpoint)
                results = results[:1]
                forwarded = forwarded[:1] if forwarded is not None else None
        outcomes: list[PathOutcome] = []
        for k, res in enumerate(results):
            outcomes.extend(self._after_prerouting(
                res, head, forwarded[k] if forwarded is not None else None))
        return b.finish(merge(outcomes))

    def _after_prerouting(self, res: HookResult, head: tuple[str, ...],
                          forwarded: list[HookResult] | None = None) -> list[PathOutcome]:
        """The outcomes of one path through prerouting (``forwarded``: its DNATed
        packet's paths through the forward hook, where they were walked already)."""
        b = self.backend
        verdict, p, steps, detail = res
        ev = head + tuple(map(rendered, steps))
        took = res.assumed
        if verdict == "UNKNOWN":
            got = b.unseen(res, ev, took)
            return [got if got is not None else
                    PathOutcome(Outcome.UNKNOWN, detail, (*ev, detail), took, steps)]
        if verdict in DROPPED:
            return [PathOutcome(Outcome.DROPPED, b.ended(verdict, "prerouting"), ev, took,
                                steps)]
        if verdict in REWRITTEN:
            how = b.dnat_how(p, verdict)
            result = f"result: {how}; the packet never goes to the load balancer"
            if not b.forward_after_dnat:
                return [PathOutcome(Outcome.CAPTURED, how, (*ev, result), took, steps)]
            out = []
            for fr in forwarded if forwarded is not None else \
                    b.walk_hook("forward", p._replace(out_iface=None)):
                ev2 = ev + tuple(map(rendered, fr.steps))
                took2 = took + fr.assumed
                st2 = steps + fr.steps
                if fr.verdict in DROPPED:
                    out.append(PathOutcome(Outcome.DROPPED, b.ended(fr.verdict, "forward"),
                                           ev2, took2, st2))
                elif fr.verdict == "UNKNOWN":
                    out.append(PathOutcome(Outcome.UNKNOWN, fr.detail, (*ev2, fr.detail),
                                           took2, st2))
                else:
                    out.append(PathOutcome(Outcome.CAPTURED, how, (*ev2, result), took2,
                                           st2))
            return out
        local = self.is_local(p.dst)
        results: list[PathOutcome] = []
        if local is None:
            # not given the node's addresses: follow both answers (merge decides)
            took = (*took, b.local_assumption(p))
            results += b.to_local(self, p, False, ev, took, steps)
            ev = (*ev, f"routing{ASSUMED} {p.dst} is NOT a local address{b.unknown_local(p)}")
        elif local:
            return b.to_local(self, p, True, ev, took, steps)
        v6 = p.v6
        out_iface = self.uplink(v6)
        leaving = out_iface or "(uplink unknown)"
        uplink_how = self.facts.uplink_how if not (v6 and self.facts.family == 4) else ""
        ev = (*ev, f"routing: {p.dst} is not a local address -> forwarded out {leaving}"
              + (f" [{uplink_how}]" if uplink_how else ""))
        p = p._replace(out_iface=out_iface)
        for fr in b.walk_hook("forward", p):
            ev2 = ev + tuple(map(rendered, fr.steps))
            took2 = took + fr.assumed
            st2 = steps + fr.steps
            if fr.verdict == "UNKNOWN":
                results.append(PathOutcome(Outcome.UNKNOWN, fr.detail, (*ev2, fr.detail),
                                           took2, st2))
                continue
            if fr.verdict in DROPPED:
                results.append(PathOutcome(Outcome.DROPPED, b.ended(fr.verdict, "forward"),
                                           ev2, took2, st2))
                continue
            for pr in b.walk_hook("postrouting", fr.packet):
                ev3 = ev2 + tuple(map(rendered, pr.steps))
                results.append(self._postrouted(pr, p, leaving, ev3, took2 + pr.assumed)
                               ._replace(steps=st2 + pr.steps))
        return results

    def _postrouted(self, pr: HookResult, p: Packet, leaving: str,
                    ev: tuple[str, ...], took: tuple[Assumption, ...]) -> PathOutcome:
        """How a forwarded path of a pod's packet ends after the postrouting hook."""
        b = self.backend
        if pr.verdict == "UNKNOWN":
            return PathOutcome(Outcome.UNKNOWN, pr.detail, (*ev, pr.detail), assumptions=took)
        if pr.verdict in DROPPED:
            return PathOutcome(Outcome.DROPPED, b.ended(pr.verdict, "postrouting"), ev,
                               assumptions=took)
        if pr.verdict not in SOURCE_NAT:
            src = p.src if p.src_known else "(unchanged)"
            how = (f"leaves {leaving} with the pod's source address {src} "
                   "(no DNAT, not local, no SNAT/MASQUERADE)")
            return PathOutcome(Outcome.NOT_MASQUERADED, how, (*ev, f"result: {how}"),
                               assumptions=took)
        node_ip = self.node_ip(p.v6)
        to = _snat_host(pr.packet.snat) if pr.verdict == "SNAT" else None
        if to is not None and node_ip is None:
            # not "not this node's address None": that address is unknown
            how = (f"leaves {leaving} SNATed to {to}; whether that is the node's address "
                   "the load balancer sends to is not in the input (`ip addr` shows it)")
            return PathOutcome(Outcome.UNKNOWN, how, (*ev, how), assumptions=took)
        if to is not None and _canon(to) != node_ip:
            # the LB only skips the real server whose IP equals the source
            how = (f"leaves {leaving} SNATed to {to}, which is not this node's address "
                   f"{node_ip}: the load balancer may still pick this node")
            return PathOutcome(Outcome.NOT_MASQUERADED, how, (*ev, f"result: {how}"),
                               assumptions=took)
        how = (f"leaves {leaving} with {node_address(node_ip)} ({b.word(pr.verdict)}): the "
               "load balancer will not send it back to this node")
        return PathOutcome(Outcome.MASQUERADED, how, (*ev, f"result: {how}"), assumptions=took)

    # -- outside client -> LB (what the load balancer's traffic meets) -----------------

    def outside_to_lb(self, t: LbTarget) -> ServedOutcome:
        """What the load balancer's own traffic meets: a SYN from outside to this node's
        NodePort for the service (the CLB sends to NodeIP:NodePort, never to its VIP)."""
        b = self.backend
        f = self.facts
        blocked = b.cannot_serve(t)
        if blocked is not None:
            return ServedOutcome(None, None, (), blocked)
        if t.node_port is None:
            return ServedOutcome(None, None, (), "the NodePort is unknown")
        v6 = ":" in t.ip
        node_ip, how = b.node_address(self, v6)
        if node_ip is None:
            return ServedOutcome(None, None, (), "the node's address is unknown")
        client = OUTSIDE_CLIENT6 if v6 and f.family == 4 else f.outside_client
        pkt = Packet(src=client, dst=node_ip, proto=t.protocol.lower(), dport=t.node_port,
                     in_iface=self.uplink(v6))
        head = ((how,) if how else ()) + (
            f"packet: {pkt.describe()} (the load balancer forwarding a client)",)
        served_any = unserved_any = False
        # the facts a path took without the input: where paths that took one end served
        # and not served, the answer hangs on them
        facts: dict[str, None] = {}
        kept: bool | None = None
        # the evidence of the last path, rendered once at the end (a served NodePort's is
        # not read: 2.5k eTP=Local LB IPs at 10k services): its steps, in the order shown
        last: tuple[tuple[WalkStep, ...], ...] = ()
        tail = ""
        pod, _, _ = self._pod(v6)
        for res in b.walk_hook("prerouting", pkt):
            why = _undecided(res)
            if why:
                return ServedOutcome(None, None, _evidence(head, (res.steps,), why), why)
            facts.update(dict.fromkeys(a.fact for a in res.assumed))
            if res.verdict in DROPPED:
                last, tail = (res.steps,), b.ended(res.verdict, "prerouting")
                unserved_any = True
                continue
            p = res.packet
            if res.verdict not in REWRITTEN:
                # to the node itself: filter INPUT decides (kube-proxy's "has no local
                # endpoints" rules live there); nothing listens on a NodePort by itself
                for fr in b.walk_hook("input", p):
                    why = _undecided(fr)
                    if why:
                        return ServedOutcome(None, None, _evidence(head, (res.steps,), why),
                                             why)
                    last, tail = (res.steps, fr.steps), \
                        f"no DNAT to an endpoint: {b.ended(fr.verdict, 'input')}"
                    facts.update(dict.fromkeys(a.fact for a in fr.assumed))
                    unserved_any = True
                continue
            out = (pod.iface if pod and pod.iface and _in(p.dst, pod.prefix)
                   else self.uplink(v6))
            p = p._replace(out_iface=out)
            for fr in b.walk_hook("forward", p):
                seen = (res.steps, fr.steps)
                why = _undecided(fr)
                if why:
                    return ServedOutcome(None, None, _evidence(head, seen, why), why)
                facts.update(dict.fromkeys(a.fact for a in fr.assumed))
                if fr.verdict in DROPPED:
                    last, tail = seen, ""
                    unserved_any = True
                    continue
                served_any = True
                for pr in b.walk_hook("postrouting", fr.packet):
                    why = _undecided(pr)
                    if why:
                        return ServedOutcome(None, None, _evidence(head, seen, why), why)
                    masq = pr.verdict in SOURCE_NAT
                    kept = (not masq) if kept is None else (kept and not masq)
                    last, tail = (*seen, pr.steps), ""
        evidence = _evidence(head, last, tail)
        steps = tuple(step for part in last for step in part)
        if served_any and unserved_any and facts:
            why = "it depends on a fact the input does not show: " + "; ".join(list(facts)[:2])
            return ServedOutcome(None, None, (*evidence, why), why, steps)
        if served_any:
            said = ("served here" + ("" if kept is None else
                                     (", client source kept" if kept else
                                      ", source masqueraded")))
            return ServedOutcome(True, kept, evidence, said, steps)
        return ServedOutcome(False, None, evidence, "not served on this node", steps)


def _evidence(head: tuple[str, ...], steps: tuple[tuple[WalkStep, ...], ...], tail: str
              ) -> tuple[str, ...]:
    """A path's evidence: ``head``, each step's line, then ``tail`` (if any)."""
    lines = [*head]
    for part in steps:
        lines += map(rendered, part)
    if tail:
        lines.append(tail)
    return tuple(lines)


def _undecided(res: HookResult) -> str:
    """Why a path of the load balancer's packet decides nothing: it ended UNKNOWN, or it
    took an answer to a rule on the interface the input does not show (the uplink): a
    NodePort "served" on such a path only may not be served at all."""
    if res.verdict == "UNKNOWN":
        return res.detail
    for s in res.steps:
        for a in s.assumptions:
            if a.kind == AssumptionKind.INTERFACE:
                return ("a rule asks an interface of the load balancer's packet (the node's "
                        "uplink or the pods' interface) that the input does not show (`ip "
                        f"addr` and `ip route` show them): {a.subject}")
    return ""


def _accepted_alike(forwarded: list[HookResult]) -> bool:
    """Whether a DNATed packet crosses the forward hook on one path, neither dropped nor
    undecided, with no fact assumed: it ends "captured" as _after_prerouting says."""
    return len(forwarded) == 1 and forwarded[0].verdict not in DROPPED and \
        forwarded[0].verdict != "UNKNOWN" and not _assumes(forwarded[0].steps)


def _assumes(steps: tuple[WalkStep, ...]) -> bool:
    """Did a path assume a fact (a match the input could not decide)?"""
    return any(s.assumptions for s in steps)


def unless_input_drops(how: str, why: str) -> str:
    """A local delivery the input hook may still drop: no loop either way."""
    return (f"{how}, unless the input hook drops it first, which the input does not "
            f"decide ({why}): no loop either way")


def node_address(node_ip: str | None) -> str:
    """The address a MASQUERADE leaves with, for evidence: the node's, whether or not the
    input shows which it is (never "None")."""
    if node_ip:
        return f"the node's address {node_ip}"
    return "the node's address (not in the input: `ip addr` shows it)"


def _snat_host(to: str | None) -> str | None:
    """The first address of a SNAT's --to-source / `snat to` ("1.2.3.4-1.2.3.9:1024",
    "[2001:db8::1]:80"); None for a masquerade or an SNAT the rule does not say."""
    if not to or to in ("snat", "masquerade"):
        return None
    if to.startswith("["):
        return to[1:].partition("]")[0] or None
    host = to.split("-")[0]
    if host.count(":") == 1:  # IPv4 with a port
        host = host.split(":")[0]
    return host or None


def _canon(addr: str) -> str:
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        return addr


def _in(addr: str, prefix: str) -> bool:
    return ipaddress.ip_address(addr) in _network(prefix)


# the pod network, asked once per NodePort walk (parsing it each time was a tenth of
# the eTP=Local walks' time)
_network = functools.lru_cache(maxsize=64)(functools.partial(ipaddress.ip_network,
                                                             strict=False))


def _render(step: WalkStep) -> str:
    return step.render()


# A step's evidence line, made once for the steps many walks share (kube-proxy's jumps from
# the built-in chains, KUBE-MARK-MASQ): one string for every finding that shows it.
rendered = cast(Callable[[WalkStep], str], functools.lru_cache(maxsize=4096)(_render))
