"""Follow concrete packets through the node: a pod of this node to LB IP:port (does it
leave, and with which source?), and an outside client to LB IP:port (is it served here,
is its source kept?). The evidence is the walk, rule by rule."""

from __future__ import annotations

from dataclasses import dataclass

from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.node_facts import NodeFacts
from agent.netfilter.walk import HookResult, Packet, TableWalker
from agent.snapshot import Chain, Netfilter, Rule, Table

# An outside client (TEST-NET-2): never local, never a pod.
OUTSIDE_CLIENT = "198.51.100.7"

# kube-proxy installs these jumps from the built-in chains itself, outside the
# iptables-restore input it writes; a dump of that input lacks them.
_KUBE_HOOKS = {
    "nat": (("PREROUTING", "KUBE-SERVICES", "kubernetes service portals"),
            ("OUTPUT", "KUBE-SERVICES", "kubernetes service portals"),
            ("POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules")),
    "filter": (("FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules"),
               ("FORWARD", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
               ("INPUT", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules")),
}

# Ranking when branches (statistic, recent) disagree: the worst one is reported.
_RANK = {"not-masqueraded": 0, "unknown": 1, "dropped": 2, "masqueraded": 3, "captured": 4}


@dataclass(frozen=True)
class PathOutcome:
    kind: str  # "captured" | "masqueraded" | "not-masqueraded" | "dropped" | "unknown"
    how: str
    evidence: tuple[str, ...]
    mixed: bool = False  # branches disagreed


@dataclass(frozen=True)
class ServedOutcome:
    """An outside client's SYN to LB IP:port arriving on the uplink."""

    served: bool | None  # DNATed/IPVS to an endpoint and not dropped
    source_kept: bool | None  # no masquerade on the way to the endpoint
    evidence: tuple[str, ...]
    how: str


def with_kube_proxy_hooks(nf: Netfilter) -> tuple[Netfilter, tuple[str, ...]]:
    """Add kube-proxy's built-in-chain jumps when the dump is its restore input."""
    notes: list[str] = []
    tables = []
    for t in nf.tables:
        chains = list(t.chains)
        for builtin, target, comment in _KUBE_HOOKS.get(t.name, ()):
            if t.chain(target) is None or _referenced(t, target):
                continue
            text = f'-A {builtin} -m comment --comment "{comment}" -j {target}'
            src = "assumed: kube-proxy installs this jump outside its restore input"
            notes.append(f"{t.name} {builtin} -> {target}: {src}")
            existing = next((c for c in chains if c.name == builtin), None)
            rule = Rule(text, src)
            # kube-proxy prepends its jumps (EnsureRule(Prepend, ...))
            if existing is None:
                chains.append(Chain(builtin, "ACCEPT", (rule,)))
            else:
                chains[chains.index(existing)] = Chain(builtin, existing.policy,
                                                       (rule, *existing.rules))
        tables.append(Table(t.name, tuple(chains)))
    return Netfilter(nf.backend, tuple(tables)), tuple(notes)


def _referenced(t: Table, chain: str) -> bool:
    """Does any rule of the table jump or go to ``chain``?"""
    needles = (f"-j {chain}", f"-g {chain}")
    return any(r.text.endswith(needles) or f"-j {chain} " in r.text or f"-g {chain} " in r.text
               for c in t.chains for r in c.rules)


class PathFinder:
    def __init__(self, facts: NodeFacts) -> None:
        self.facts = facts
        snap = facts.snapshot
        self.notes: tuple[str, ...] = ()
        self.nat: TableWalker | None = None
        self.filter: TableWalker | None = None
        if snap.netfilter is not None:
            nf, self.notes = with_kube_proxy_hooks(snap.netfilter)
            nat = nf.table("nat")
            flt = nf.table("filter")
            self.nat = TableWalker(nat or Table("nat"), facts)
            self.filter = TableWalker(flt, facts) if flt is not None else None

    # -- pod -> LB ----------------------------------------------------------------------

    def pod_to_lb(self, t: LbTarget) -> PathOutcome:
        f = self.facts
        if self.nat is None:
            return PathOutcome("unknown", "the nat rules could not be read",
                               ("nat rules could not be read",))
        if f.pod is None:
            return PathOutcome("unknown", f.pod_unknown, (f.pod_unknown,))
        pkt = Packet(src=f.pod.pod_ip, dst=t.ip, proto=t.protocol.lower(), dport=t.port,
                     in_iface=f.pod.iface)
        head = (f"packet: {pkt.describe()}; {f.pod.how}",)
        outcomes = []
        for res in self.nat.walk("PREROUTING", pkt):
            outcomes.extend(self._after_prerouting(res, head))
        return _merge(outcomes)

    def _after_prerouting(self, res: HookResult, head: tuple[str, ...]) -> list[PathOutcome]:
        ev = head + tuple(s.render() for s in res.steps)
        p = res.packet
        if res.verdict == "UNKNOWN":
            return [PathOutcome("unknown", res.detail, (*ev, res.detail))]
        if res.verdict in ("DROP", "REJECT"):
            return [PathOutcome("dropped", f"{res.verdict} in nat PREROUTING", ev)]
        if res.verdict in ("DNAT", "REDIRECT"):
            how = f"kube-proxy rewrites the destination to {p.dst}:{p.dport} ({res.verdict})"
            return [PathOutcome("captured", how, (*ev, f"result: {how}; the packet never "
                                                  "goes to the load balancer"))]
        local = self.facts.is_local(p.dst)
        if local is None:
            return [PathOutcome("unknown", "local addresses unknown",
                                (*ev, "routing: cannot tell whether the LB IP is local "
                                 "(no route-local.txt / addr.txt)"))]
        if local:
            how, line = self._ipvs_capture(p)
            route = self.facts.local_route(p.dst)
            return [PathOutcome("captured", how,
                                (*ev, f"routing: {p.dst} is local ({route.line if route else ''})"
                                 " -> INPUT", line, f"result: {how}"))]
        out_iface = self.facts.uplink
        ev = (*ev, f"routing: {p.dst} is not a local address -> forwarded out "
                   f"{out_iface or '(uplink unknown)'}"
              + (f" [{self.facts.uplink_how}]" if self.facts.uplink_how else ""))
        p = p._replace(out_iface=out_iface)
        results: list[PathOutcome] = []
        fwd = self.filter.walk("FORWARD", p) if self.filter else [HookResult("ACCEPT", p, ())]
        for fr in fwd:
            ev2 = ev + tuple(s.render() for s in fr.steps if s.table == "filter")
            if fr.verdict == "UNKNOWN":
                results.append(PathOutcome("unknown", fr.detail, (*ev2, fr.detail)))
                continue
            if fr.verdict in ("DROP", "REJECT"):
                results.append(PathOutcome("dropped", f"{fr.verdict} in filter FORWARD", ev2))
                continue
            assert self.nat is not None
            for pr in self.nat.walk("POSTROUTING", fr.packet):
                ev3 = ev2 + tuple(s.render() for s in pr.steps)
                if pr.verdict == "UNKNOWN":
                    results.append(PathOutcome("unknown", pr.detail, (*ev3, pr.detail)))
                elif pr.verdict in ("MASQUERADE", "SNAT"):
                    how = (f"leaves {out_iface} with the node's address ({pr.verdict}): the "
                           "load balancer will not send it back to this node")
                    results.append(PathOutcome("masqueraded", how, (*ev3, f"result: {how}")))
                elif pr.verdict in ("DROP", "REJECT"):
                    results.append(PathOutcome("dropped", f"{pr.verdict} in nat POSTROUTING",
                                               ev3))
                else:
                    how = (f"leaves {out_iface} with the pod's source address {p.src} "
                           "(no DNAT, not local, no SNAT/MASQUERADE)")
                    results.append(PathOutcome("not-masqueraded", how, (*ev3, f"result: {how}")))
        return results

    def _ipvs_capture(self, p: Packet) -> tuple[str, str]:
        snap = self.facts.snapshot
        proto = p.proto.upper()
        if snap.ipvs is not None:
            vs = self.facts.virtual_server(proto, p.dst, p.dport)
            if vs is not None:
                line = (f"IPVS virtual server {proto} {vs.address}:{vs.port} "
                        f"({len(vs.real_servers)} real servers)")
                return ("IPVS on this node serves it (the LB IP is local): the packet "
                        "never goes to the load balancer"), line
            return ("delivered to this node's own stack (local address, no IPVS virtual "
                    "server for this port): it does not leave the node"), \
                f"IPVS: no virtual server {proto} {p.dst}:{p.dport}"
        member = f"{p.dst},{p.proto}:{p.dport}"
        for name in ("KUBE-LOAD-BALANCER", "KUBE-EXTERNAL-IP", "KUBE-CLUSTER-IP"):
            s = snap.ipset(name)
            if s is not None and member in s.members:
                return ("served inside the node (local address; kube-proxy lists it in "
                        f"ipset {name}): the packet never goes to the load balancer"), \
                    f"IPVS state unknown; ipset {name} has {member}"
        return ("delivered to this node's own stack (local address): it does not leave "
                "the node"), "IPVS state unknown"

    # -- outside client -> LB (what the load balancer's traffic meets) -----------------

    def outside_to_lb(self, t: LbTarget) -> ServedOutcome:
        f = self.facts
        if self.nat is None:
            return ServedOutcome(None, None, (), "nat rules unknown")
        pkt = Packet(src=OUTSIDE_CLIENT, dst=t.ip, proto=t.protocol.lower(), dport=t.port,
                     in_iface=f.uplink)
        head = (f"packet: {pkt.describe()} (a client outside the cluster)",)
        served_any = False
        kept: bool | None = None
        evidence: tuple[str, ...] = head
        for res in self.nat.walk("PREROUTING", pkt):
            ev = head + tuple(s.render() for s in res.steps)
            if res.verdict == "UNKNOWN":
                return ServedOutcome(None, None, (*ev, res.detail), res.detail)
            if res.verdict not in ("DNAT", "REDIRECT"):
                evidence = (*ev, f"no DNAT to an endpoint ({res.detail or res.verdict})")
                continue
            p = res.packet
            out = (f.pod.iface if f.pod and f.pod.iface and _in(p.dst, f.pod.prefix)
                   else f.uplink)
            p = p._replace(out_iface=out)
            fwd = self.filter.walk("FORWARD", p) if self.filter else [HookResult("ACCEPT", p, ())]
            for fr in fwd:
                if fr.verdict in ("DROP", "REJECT"):
                    evidence = ev + tuple(s.render() for s in fr.steps if s.table == "filter")
                    continue
                served_any = True
                for pr in self.nat.walk("POSTROUTING", fr.packet):
                    masq = pr.verdict in ("MASQUERADE", "SNAT")
                    kept = (not masq) if kept is None else (kept and not masq)
                    evidence = ev + tuple(s.render() for s in pr.steps)
        if served_any:
            how = ("served here" + ("" if kept is None else
                                    (", client source kept" if kept else ", source masqueraded")))
            return ServedOutcome(True, kept, evidence, how)
        # filter rules of kube-proxy may drop it (e.g. "has no local endpoints")
        if self.filter:
            for fr in self.filter.walk("FORWARD", Packet(
                    OUTSIDE_CLIENT, t.ip, t.protocol.lower(), 45678, t.port, f.uplink,
                    f.pod.iface if f.pod else None)):
                if fr.verdict in ("DROP", "REJECT"):
                    evidence = evidence + tuple(s.render() for s in fr.steps)
        return ServedOutcome(False, None, evidence, "not served on this node")


def _in(addr: str, prefix: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(addr) in ipaddress.ip_network(prefix, strict=False)


def _merge(outcomes: list[PathOutcome]) -> PathOutcome:
    if not outcomes:
        return PathOutcome("unknown", "no path", ())
    kinds = {o.kind for o in outcomes}
    worst = min(outcomes, key=lambda o: _RANK[o.kind])
    if len(kinds) > 1:
        return PathOutcome(worst.kind, worst.how + " (on some of the paths kube-proxy's "
                           "random endpoint choice can take)", worst.evidence, mixed=True)
    return worst
