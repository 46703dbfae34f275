"""Walk a packet through an nftables ruleset, hook by hook, the way the kernel does: base
chains of one hook in priority order, jump/goto/return, verdict maps, NAT that ends the
nat chains of a hook, marks. Every rule that acted is a step (the evidence).

What the input cannot decide is never guessed: a match on something unknown (a pod's
exact address, which addresses are local) forks the walk, and the fork's step says what
was assumed (": assumed", as agent.netfilter.walk says it). A random choice (`numgen
random mod N vmap`) or a datapath-filled set (session affinity) forks too, as "any
branch": each branch is a path the kernel can take.

iptables rules in other tables on the same hooks (a CNI's iptables-nft or legacy rules)
are walked in their place by priority when the caller gives their walkers.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol

from agent.netfilter import assumption
from agent.netfilter.assumption import Assumption
from agent.netfilter.nft_model import NftChain, NftRule, NftRuleset, NftSet, NftTable
from agent.netfilter.nft_text import render, split_elements
from agent.netfilter.packet import MAX_PATHS, MAX_RULES, Hook, HookResult, Packet, ToldApart
from agent.netfilter.shape import chain_shape, rule_shape
from agent.netfilter.walk import Step
from agent.numbers import is_number
from agent.parse.ip_text import host_port, ip_number, ip_span

ASSUMED = ": assumed"
_MAX_DEPTH = 64
# nested _run calls along one path (a goto, a return, a forking rule each add one): goto
# loops never grow the return stack, and Python's own limit is 1000 frames
_MAX_NESTING = 300
# iptables' tables and their priority on each hook (what iptables-nft registers)
IPTABLES_PRIORITY = {
    ("raw", "prerouting"): -300, ("raw", "output"): -300,
    ("mangle", "prerouting"): -150, ("mangle", "input"): -150, ("mangle", "forward"): -150,
    ("mangle", "output"): -150, ("mangle", "postrouting"): -150,
    ("nat", "prerouting"): -100, ("nat", "output"): -100, ("nat", "input"): 100,
    ("nat", "postrouting"): 100,
    ("filter", "input"): 0, ("filter", "forward"): 0, ("filter", "output"): 0,
}
_DNAT_HOOKS = frozenset({"prerouting", "output"})
# an address no rule tells apart from another (walk_hook's key), as a packet's address
_ANY4, _ANY6, _ANY = "any address", "any address:", "any"
# rules whose compiled ops a walker keeps: kube-proxy's shared chains' rules come back in
# every walk, a Service's own are walked once or twice (all 126k of a 10k-service node
# kept were 66 MB, a quarter of its check's peak)
_COMPILED_KEPT = 16384
_DST, _DNAT_TO = Packet._fields.index("dst"), Packet._fields.index("dnat_to")
_new = tuple.__new__
# packets whose forward walks are kept, each of at most so many paths (a walk forks on
# every match the input does not decide: up to MAX_PATHS paths a packet)
_FORWARDED_KEPT = 4096
_FORWARDED_PATHS = 8


class NodeView(Protocol):
    def addr_type(self, addr: str) -> str | None: ...


class NftStep(NamedTuple):
    where: str  # "nft ip kube-proxy services" | "iptables nat PREROUTING"
    text: str  # the rule's own text (shared by every path through it, never copied)
    source: str
    assumptions: tuple[Assumption, ...] = ()  # facts this rule's answer took
    notes: str = ""  # what this path's answer was (the map element, the fork taken)

    def shape(self) -> str:
        head, _, chain = self.where.rpartition(" ")
        return f"{head} {chain_shape(chain)}: {rule_shape(self.text)}"

    def render(self) -> str:
        text = self.text
        if len(text) > _LONGEST_SHOWN:
            # one Service's endpoints in one rule (`numgen random mod N vmap {...}`): the
            # element this path took is in the notes
            text = f"{text[:_LONGEST_SHOWN]} ... ({len(text)} characters)"
        return (f"{self.where}: {text}" + (f" [{self.notes}]" if self.notes else "")
                + (f" ({self.source})" if self.source else ""))


_LONGEST_SHOWN = 600  # characters of a rule in the evidence


IptablesWalk = Callable[[str, Packet], list[HookResult]]
# one answer of a rule: action (None: on to the next rule), packet, notes, facts assumed
# A rule compiled for the walk: one op per statement, a tuple of the statement's parts
# ("match", selectors, negate, value, mask, text), ("vmap", selectors, map), ("mark",
# ...), ("dnat", address, port), ("verdict", word[, chain]), ...: _compile writes each
# shape and _ops reads it. nft_text's tokens are strings and nested tuples of them.
Op = tuple[Any, ...]
Tokens = tuple[Any, ...]
Action = tuple[str, ...]  # ("jump", chain) ("DNAT",) ("UNKNOWN", why) ...
_Answer = tuple[Action | None, Packet, tuple[str, ...], tuple[Assumption, ...]]


class _Budget:
    def __init__(self) -> None:
        self.rules = 0


class NftWalker:
    """Walks hooks of one ruleset. ``iptables`` maps an iptables table name to a function
    walking one of its built-in chains (agent.netfilter.walk.TableWalker.walk)."""

    def __init__(self, ruleset: NftRuleset, view: NodeView,
                 iptables: Mapping[str, IptablesWalk] | None = None,
                 quiet: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.ruleset = ruleset
        self.view = view
        self.iptables = dict(iptables or {})
        # the iptables (table, hook)s whose built-in chain holds no rule: its policy
        # decides, whatever the packet (see walk_hook)
        self.quiet = quiet
        self._maps: dict[int, dict[tuple[str, ...], str | None]] = {}
        self._stages: dict[tuple[str, bool], list[tuple[int, str, object]]] = {}
        self._sets: dict[int, tuple[NftSet, frozenset[str], list[str]]] = {}
        # each rule's ops by id(): the rules live as long as the ruleset this walker holds;
        # and by tokens, so that rules written alike compile once; both bounded
        # (_COMPILED_KEPT). The walker's own: a module-wide cache kept 100k compiled rules
        # (35 MB) in a daemon between cycles, to save 0.4 s when the rules change
        self._compiled: dict[int, list[Op]] = {}
        self._by_tokens: dict[Tokens, list[Op]] = {}
        # a DNATed packet's paths through the forward hook, by the packet with its
        # endpoint address left out (walk_hook), and per family the addresses the forward
        # hook's rules tell apart, or None where they may tell any two apart
        self._forwarded: dict[tuple[object, ...], tuple[HookResult, ...]] = {}
        self._told_apart: dict[bool, ToldApart | None] = {}

    # -- the hooks ------------------------------------------------------------------

    def stages(self, hook: str, v6: bool = False) -> list[tuple[int, str, object]]:
        """(priority, label, chain or iptables table name) for a hook and a packet family,
        in the order the kernel runs them (equal priorities: nft first, said in the
        notes); made once per hook and family (a 10k-service table has 40k chains, a few
        of them base chains). An IPv4 packet meets `ip` and `inet` tables, an IPv6 one
        `ip6` and `inet` tables; the iptables walkers are IPv4's (iptables, not
        ip6tables), so an IPv6 packet meets none of them."""
        got = self._stages.get((hook, v6))
        if got is not None:
            return got
        own = "ip6" if v6 else "ip"
        out: list[tuple[int, int, str, object]] = []
        for t in self.ruleset.tables:
            if t.family not in (own, "inet"):
                continue
            if t.family == "ip" and self.iptables and iptables_nft_table(t):
                # iptables-nft's own table: its rules are the iptables dump's, walked by
                # the iptables walker (nat, filter) or, as in the iptables modes, not
                # (mangle, raw: their xt matches would read as "not evaluated")
                continue
            for c in t.chains:
                if c.hook == hook and c.type in ("filter", "nat", "route"):
                    out.append((c.priority or 0, 0, f"nft {t.family} {t.name} {c.name}",
                                (t, c)))
        for name in () if v6 else self.iptables:
            prio = IPTABLES_PRIORITY.get((name, hook))
            if prio is not None:
                out.append((prio, 1, f"iptables {name} {hook.upper()}", name))
        out.sort(key=lambda x: (x[0], x[1]))
        got = self._stages[(hook, v6)] = [(p, label, obj) for p, _, label, obj in out]
        return got

    def walk_hook(self, hook: Hook, pkt: Packet) -> list[HookResult]:
        """Every path of ``pkt`` through the hook's chains, in priority order.

        A pod's packet DNATed to an endpoint crosses the forward hook once per endpoint of
        every LB IP (40k walks at 10k services). Where no rule on that hook can tell the
        endpoint's address from another (_told_apart: no match, set or map holds it, no
        fib lookup, no iptables rule), its paths are those of any other endpoint's packet
        alike in everything else: walked once, and given this packet's address."""
        if hook != "forward" or not pkt.dnat_to or \
                pkt.dnat_to != host_port(pkt.dst, pkt.dport):
            return self._walk_hook(hook, pkt)
        v6 = pkt.v6
        if v6 not in self._told_apart:
            self._told_apart[v6] = self._addresses_told_apart(hook, v6)
        told = self._told_apart[v6]
        if told is None or told.holds(pkt.dst):
            return self._walk_hook(hook, pkt)
        # (the packet's fields but these two, by position: _replace costs ~4x this, and
        # this runs for every endpoint of every LB IP)
        key = (*pkt[:_DST], _ANY6 if v6 else _ANY4, *pkt[_DST + 1:_DNAT_TO], _ANY,
               *pkt[_DNAT_TO + 1:])
        got = self._forwarded.get(key)
        if got is None:
            walked = self._walk_hook(hook, pkt)
            if len(walked) > _FORWARDED_PATHS:
                return walked  # (many undecided matches: not worth the memory it holds)
            if len(self._forwarded) >= _FORWARDED_KEPT:
                self._forwarded.clear()
            self._forwarded[key] = tuple(walked)
            return walked
        dst, dnat_to = pkt.dst, pkt.dnat_to
        return [_new(HookResult, (r[0], _new(Packet, (
            *r[1][:_DST], dst, *r[1][_DST + 1:_DNAT_TO], dnat_to, *r[1][_DNAT_TO + 1:])),
            *r[2:])) for r in got]

    def _addresses_told_apart(self, hook: str, v6: bool) -> ToldApart | None:
        """The destination addresses the hook's rules compare a packet's with (literals,
        prefixes, ranges, set and map elements), or None where they may tell any two
        apart (a masked or fib lookup of the destination, a NAT, an iptables rule, more
        spans than a packet is worth testing against)."""
        told = ToldApart()
        seen: set[tuple[int, str]] = set()
        todo: list[tuple[NftTable, NftChain]] = []
        for _prio, _label, obj in self.stages(hook, v6):
            if not isinstance(obj, tuple):
                if (str(obj), hook) not in self.quiet:
                    return None  # an iptables table's rules: not read here
                continue
            todo.append(obj)
        while todo:
            t, c = todo.pop()
            if (id(t), c.name) in seen:
                continue
            seen.add((id(t), c.name))
            for rule in c.rules:
                ops = self._by_tokens.get(rule.tokens)
                if ops is None:
                    ops = self._by_tokens[rule.tokens] = _compile(rule.tokens)
                for op in ops:
                    targets = _told_by_op(t, op, told)
                    if targets is None:
                        return None
                    for name in targets:
                        target = t.chain(name)
                        if target is not None:
                            todo.append((t, target))
        return None if told.crowded else told

    def _walk_hook(self, hook: Hook, pkt: Packet) -> list[HookResult]:
        paths: list[tuple[Packet, tuple[NftStep, ...], str | None]] = [(pkt, (), None)]
        finished: list[HookResult] = []
        for _prio, _label, obj in self.stages(hook, pkt.v6):
            nxt: list[tuple[Packet, tuple[NftStep, ...], str | None]] = []
            for p, steps, nat in paths:
                nat_chain = (isinstance(obj, tuple) and obj[1].type == "nat") or \
                    obj == "nat"
                if nat_chain and (nat or p.untracked or (hook in _DNAT_HOOKS and p.dnat_to) or
                                  (hook not in _DNAT_HOOKS and p.snat)):
                    # a NAT binding made earlier on this hook ends the nat chains
                    nxt.append((p, steps, nat))
                    continue
                if isinstance(obj, tuple):
                    results = self._base_chain(obj[0], obj[1], p)
                else:
                    results = self._iptables(str(obj), hook, p)
                for verdict, p2, st, detail in results:
                    steps2 = steps + st
                    if verdict in ("DROP", "REJECT", "UNKNOWN"):
                        finished.append(HookResult(verdict, p2, steps2, detail))
                    elif verdict in ("DNAT", "MASQUERADE", "SNAT"):
                        nxt.append((p2, steps2, verdict))
                    else:
                        nxt.append((p2, steps2, nat))
            if len(nxt) > MAX_PATHS:
                # the rest are paths the kernel may take too: say they were not walked
                p0, steps0, _ = nxt[MAX_PATHS]
                finished.append(HookResult(
                    "UNKNOWN", p0, steps0, f"more than {MAX_PATHS} paths through the "
                    f"{hook} hook over what the input does not decide: the others were "
                    "not walked"))
            paths = nxt[:MAX_PATHS]
        for p, steps, nat in paths:
            finished.append(HookResult(nat or "ACCEPT", p, steps))
        return finished

    # -- iptables in between -----------------------------------------------------------

    def _iptables(self, table: str, hook: str, p: Packet
                  ) -> list[tuple[str, Packet, tuple[NftStep, ...], str]]:
        walk = self.iptables[table]
        out = []
        for r in walk(hook.upper(), p):
            steps = tuple(NftStep(f"iptables {s.table} {s.chain}", s.text, s.source,
                                  s.assumptions)
                          for s in r.steps if isinstance(s, Step))
            q = r.packet
            p2 = p._replace(dst=q.dst, dport=q.dport, mark=q.mark)
            if r.verdict in ("DNAT", "REDIRECT"):
                p2 = p2._replace(dnat_to=host_port(q.dst, q.dport))
                out.append(("DNAT", p2, steps, r.detail))
            elif r.verdict in ("MASQUERADE", "SNAT"):
                out.append((r.verdict, p2._replace(snat=q.snat or r.verdict.lower()), steps,
                            r.detail))
            else:
                out.append((r.verdict if r.verdict != "RETURN" else "ACCEPT", p2, steps,
                            r.detail))
        return out

    # -- nft chains --------------------------------------------------------------------

    def _base_chain(self, t: NftTable, c: NftChain, p: Packet
                    ) -> list[tuple[str, Packet, tuple[NftStep, ...], str]]:
        budget = _Budget()
        out = []
        for end, p2, steps, detail in self._run(t, c, 0, p, (), (), budget, 0):
            if end == "FALLOFF":
                end = "ACCEPT" if c.policy == "accept" else "DROP"
                if c.policy != "accept":
                    steps = (*steps, NftStep(f"nft {t.family} {t.name} {c.name}",
                                             f"policy {c.policy}", ""))
            out.append((end, p2, steps, detail))
        return out

    def _run(self, t: NftTable, c: NftChain, i: int, p: Packet,
             stack: tuple[tuple[NftChain, int], ...], steps: tuple[NftStep, ...],
             budget: _Budget, forks: int
             ) -> list[tuple[str, Packet, tuple[NftStep, ...], str]]:
        """Run chain ``c`` from rule ``i``; ``stack`` holds where a return goes back to.
        Ends: ACCEPT DROP REJECT DNAT MASQUERADE SNAT UNKNOWN, or FALLOFF (the base chain
        ended: its policy decides)."""
        where = f"nft {t.family} {t.name} {c.name}"
        if forks > _MAX_NESTING:
            return [("UNKNOWN", p, steps, f"walk stopped after {_MAX_NESTING} nested gotos, "
                     "returns or undecided matches (a goto loop?)")]
        while True:
            if i >= len(c.rules):
                if not stack:
                    return [("FALLOFF", p, steps, "")]
                c, i = stack[-1]
                stack = stack[:-1]
                where = f"nft {t.family} {t.name} {c.name}"
                continue
            budget.rules += 1
            if budget.rules > MAX_RULES:
                return [("UNKNOWN", p, steps, f"walk stopped after {MAX_RULES} "
                         "rules (a loop or a huge ruleset)")]
            rule = c.rules[i]
            outcomes = self._eval(t, rule, p)
            results = []
            for action, p2, notes, took in outcomes:
                st = steps
                if action is not None or notes:
                    st = (*steps, NftStep(where, rule.text, rule.source, took,
                                          "; ".join(x for x in notes if x)))
                if action is None:
                    if len(outcomes) == 1:
                        p, steps = p2, st
                        break
                    results += self._run(t, c, i + 1, p2, stack, st, budget, forks + 1)
                    continue
                kind = action[0]
                if kind in ("jump", "goto"):
                    target = t.chain(action[1])
                    if target is None:
                        results.append(("UNKNOWN", p2, st, f"chain {action[1]} is not in "
                                        f"the input ({rule.source})"))
                        continue
                    if len(stack) >= _MAX_DEPTH:
                        results.append(("UNKNOWN", p2, st, "jumps nested too deep"))
                        continue
                    new_stack = (*stack, (c, i + 1)) if kind == "jump" else stack
                    results += self._run(t, target, 0, p2, new_stack, st, budget, forks + 1)
                elif kind == "return":
                    if not stack:
                        results.append(("FALLOFF", p2, st, ""))
                    else:
                        back, j = stack[-1]
                        results += self._run(t, back, j, p2, stack[:-1], st, budget,
                                             forks + 1)
                elif kind == "continue":
                    results += self._run(t, c, i + 1, p2, stack, st, budget, forks + 1)
                else:
                    results.append((kind, p2, st, action[1] if len(action) > 1 else ""))
            else:
                return results
            i += 1

    # -- one rule ------------------------------------------------------------------------

    def _eval(self, t: NftTable, rule: NftRule, p: Packet) -> list[_Answer]:
        """The rule's outcomes: (action or None for "on to the next rule", packet,
        notes, facts assumed). More than one when a match is undecidable or a choice is
        random."""
        ops = self._compiled.get(id(rule))
        if ops is None:  # (by the rule's identity: its tokens' hash is a walk of them)
            if len(self._compiled) >= _COMPILED_KEPT:
                self._compiled.clear()
                self._by_tokens.clear()
            ops = self._by_tokens.get(rule.tokens)
            if ops is None:
                ops = self._by_tokens[rule.tokens] = _compile(rule.tokens)
            self._compiled[id(rule)] = ops
        got = self._ops(t, rule, ops, 0, p, (), ())
        return got if len(got) == 1 else _dedupe(got)

    def _ops(self, t: NftTable, rule: NftRule, ops: list[Op], k: int, q: Packet,
             notes: tuple[str, ...], took: tuple[Assumption, ...]) -> list[_Answer]:
        """The rule's answers from statement ``k`` on. An undecided match answers "no
        match" for its false branch and goes on with its true one (a loop, not a call
        per match: 1,300 undecided matches in one rule were a RecursionError)."""
        out: list[_Answer] = []
        while k < len(ops):
            op = ops[k]
            kind = op[0]
            if kind == "match":
                r = self._match(t, op, q)
                if r is False:
                    out.append((None, q, (), ()))
                    return out
                if r == "either":
                    what = op[-1]
                    out.append((None, q, (*notes, f"{what}: either (a set the datapath "
                                          "fills, e.g. session affinity): any branch"), took))
                    notes = (*notes, f"{what}: either: any branch")
                elif r is None:
                    what = op[-1]
                    took = (*took, _assumption(t, op))
                    out.append((None, q, (*notes, f"{what}{ASSUMED} false (the input does "
                                          "not decide it)"), took))
                    notes = (*notes, f"{what}{ASSUMED} true")
            elif kind == "vmap":
                for verdict, note, guess in self._vmap(t, op, q):
                    n2 = (*notes, note) if note else notes
                    out.append((None if verdict is None else _verdict(verdict), q, n2,
                                took if guess is None else (*took, guess)))
                return out
            elif kind == "mark":
                q = q._replace(mark=_mark(op, q.mark))
            elif kind == "notrack":
                q = q._replace(untracked=True)
            elif kind == "unknown":
                out.append((("UNKNOWN", f"'{op[1]}' in '{rule.text}' is not evaluated by "
                             "this agent"), q, notes, took))
                return out
            elif kind == "dnat":
                addr, port = op[1], op[2]
                q = q._replace(dst=addr, dport=port or q.dport,
                               dnat_to=host_port(addr, port or q.dport))
                out.append((("DNAT",), q, notes, took))
                return out
            elif kind == "snat":
                out.append((("SNAT", op[1]), q._replace(snat=op[1]), notes, took))
                return out
            elif kind == "masquerade":
                out.append((("MASQUERADE",), q._replace(snat="masquerade"), notes, took))
                return out
            elif kind == "verdict":
                v = op[1]
                action = (v, op[2]) if v in ("jump", "goto") else (
                    (v.upper(),) if v in ("accept", "drop", "reject") else (v,))
                out.append((action, q, notes, took))
                return out
            k += 1
        # every match held and no verdict: marks were set, on to the next rule
        out.append((None, q, notes or ("",), took))
        return out

    def _value(self, sel: str, p: Packet) -> tuple[str, object]:
        """(kind, value) of one selector for the packet; value None = not known."""
        how = _SELECTORS.get(sel)
        if how is None:
            if len(_SELECTORS) > 4096:  # (a ruleset's own: a handful; a hostile one's: more)
                _SELECTORS.clear()
            how = _SELECTORS[sel] = _selector_kind(sel)
        family, icmp, proto, code = how
        if family is not None and family != (":" in p.dst):
            # the other family's header field (inet tables: firewalld's): nft adds `meta
            # nfproto ipv4|ipv6` before it, so the packet never matches, negated or not
            return "never", None
        if icmp and p.proto in ("tcp", "udp", "sctp"):
            return "never", None  # nft adds `meta l4proto icmp`: never a TCP packet
        if proto is not None and proto != p.proto:
            # `udp dport 53`: nft adds `meta l4proto udp` before it, so a packet of
            # another protocol never matches, negated or not
            return "never", None
        if code == _DADDR:
            return "addr", p.dst
        if code == _PROTO:
            return "proto", p.proto
        if code == _DPORT:
            return "int", p.dport
        if code == _CTSTATE:
            return "ctstate", "untracked" if p.untracked else "new"
        if code == _SADDR:
            return "addr", p.src if p.src_known else ("pod", p.src_within)
        if code == _MARK:
            return "int", p.mark
        if code == _SPORT:
            return "int", p.sport
        if code == _NFPROTO:
            return "word", "ipv6" if ":" in p.dst else "ipv4"
        if code == _ETHERTYPE:  # the ethertype, as nft names it
            return "word", "ip6" if ":" in p.dst else "ip"
        if code == _CTSTATUS:
            return "word", "dnat" if p.dnat_to else ""
        if code == _FIB_SADDR:
            if p.src_is_pod or not p.src_known:
                return "word", "unicast"
            kind = self.view.addr_type(p.src)
            return "word", kind.lower() if kind else None
        if code == _FIB_DADDR:
            kind = self.view.addr_type(p.dst)
            return "word", kind.lower() if kind else None
        if code == _IIF:
            return "word", p.in_iface
        if code == _OIF:
            return "word", p.out_iface
        return "word", None

    def _match(self, t: NftTable, op: Op, p: Packet) -> bool | Literal["either"] | None:
        _, sels, negate, value, mask, _what = op
        if len(sels) != 1:
            return self._match_concat(t, sels, negate, value, mask, p)
        kind, actual = self._value(sels[0], p)
        if kind == "never":
            return False
        if mask is not None:
            if not isinstance(actual, int):
                return None
            actual = actual & mask
        if isinstance(value, str) and value.startswith("@"):
            s = t.set(value[1:])
            if s is None:
                return None
            if s.dynamic:
                return "either"
            exact, inexact = self._members(s)
            if isinstance(actual, (str, int)) and str(actual) in exact:
                r: bool | None = True
            elif isinstance(actual, (str, int)):
                r = _any_of(kind, actual, inexact)
            else:
                r = _any_of(kind, actual, [*exact, *inexact])
        elif isinstance(value, tuple):
            r = _any_of(kind, actual, list(value))
        else:
            r = _one(kind, actual, value)
        if r is None:
            return None
        return (not r) if negate else r

    def _match_concat(self, t: NftTable, sels: Tokens, negate: bool, value: object,
                      mask: int | None, p: Packet) -> bool | Literal["either"] | None:
        """`a . b . c @set` (kube-proxy's first LoadBalancerSourceRanges rules) or `a . b
        { x . y, ... }`: true when one element matches every part."""
        values = [self._value(sel, p) for sel in sels]
        if any(k == "never" for k, _ in values):
            return False
        if mask is not None:
            return None
        if isinstance(value, str) and value.startswith("@"):
            s = t.set(value[1:])
            if s is None:
                return None
            if s.dynamic:
                return "either"
            elements = [parts for parts, _ in s.elements]
        elif isinstance(value, tuple):
            elements = [parts for parts, _, _ in split_elements(value)]
        else:
            return None  # a concatenated literal: not written by kube-proxy
        r: bool | None = False
        for parts in elements:
            if len(parts) != len(values):
                continue
            rs = [_one(k, v, part) for (k, v), part in zip(values, parts, strict=True)]
            if all(x is True for x in rs):
                r = True
                break
            if all(x is not False for x in rs):
                r = None
        if r is None:
            return None
        return (not r) if negate else r


    def _vmap(self, t: NftTable, op: Op, p: Packet
              ) -> list[tuple[str | None, str, Assumption | None]]:
        """The verdicts a verdict map gives the packet, with a note each and the fact
        taken where the input does not decide it; None = no element matched (on to the
        next rule)."""
        _, sels, ref = op
        if sels and sels[0].startswith("numgen"):
            named = None if isinstance(ref, list) else t.set(ref[1:])
            branches = ref if isinstance(ref, list) else (
                [(e[0], e[1]) for e in named.elements] if named else [])
            n = len(branches)
            return [(v, f"any branch: {n} of a random choice, this one {k[0] if k else '?'}",
                     None) for k, v in branches if v] or [(None, "", None)]
        values = [self._value(s, p) for s in sels]
        if any(k == "never" for k, _ in values):
            return [(None, "", None)]  # the other family's key: never this packet's
        s: NftSet | None = None
        elements: Sequence[tuple[tuple[str, ...], str | None]]
        if isinstance(ref, list):
            elements = ref
            index = None
        else:
            s = t.set(ref[1:])
            if s is None:
                return [("UNKNOWN-MAP", f"map {ref} is not in the input", None)]
            elements = s.elements
            index = self._index(s)
        if index is not None and all(v is not None and not isinstance(v, tuple)
                                     for _, v in values):
            key = tuple(_norm(k, v) for k, v in values)
            hit = index.get(key)
            if hit is not None:
                return [(hit, f"{ref} has {' . '.join(key)}", None)]
            elements = self._inexact(s) if s is not None else elements
        out: list[tuple[str | None, str, Assumption | None]] = []
        fact = _map_assumption(sels, ref)
        for parts, verdict in elements:
            if len(parts) != len(values):
                continue
            rs = [_one(k, v, part) for (k, v), part in zip(values, parts, strict=False)]
            if all(r is True for r in rs):
                out.append((verdict, f"{ref} has {' . '.join(parts)}", None))
                return out
            if all(r is not False for r in rs):
                out.append((verdict, f"{ref} has {' . '.join(parts)}{ASSUMED} to match "
                                     "(the input does not decide it)", fact))
        out.append((None, f"{ref}: no element matches{ASSUMED}", fact) if out
                   else (None, "", None))
        return out

    def _index(self, s: NftSet) -> dict[tuple[str, ...], str | None]:
        got = self._maps.get(id(s))
        if got is None:
            got = {parts: v for parts, v in s.elements if all(_exact(x) for x in parts)}
            self._maps[id(s)] = got
        return got

    def _members(self, s: NftSet) -> tuple[frozenset[str], list[str]]:
        """A set's one-part members: the exact ones to look up, the prefixes and ranges
        to test (a 10k-member @cluster-ips is asked for every forwarded packet)."""
        got = self._sets.get(id(s))
        if got is None or got[0] is not s:
            one = [e[0][0] for e in s.elements if len(e[0]) == 1]
            got = self._sets[id(s)] = (s, frozenset(x for x in one if _exact(x)),
                                       [x for x in one if not _exact(x)])
        return got[1], got[2]

    def _inexact(self, s: NftSet) -> list[tuple[tuple[str, ...], str | None]]:
        got = self._maps.get(-id(s))
        if got is None:
            got = self._maps[-id(s)] = [(parts, v) for parts, v in s.elements  # type: ignore[assignment]
                                        if not all(_exact(x) for x in parts)]
        return got  # type: ignore[return-value]


_IPTABLES_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})


def _tell_apart(told: ToldApart, pattern: object) -> None:
    """Add a pattern as _one reads it (a literal, a prefix, a range, an anonymous set)."""
    if isinstance(pattern, tuple):
        for x in pattern:
            _tell_apart(told, x)
        return
    pat = str(pattern).strip('"')
    if pat.startswith("{") and pat.endswith("}"):
        for x in pat[1:-1].split(","):
            _tell_apart(told, x.strip())
        return
    told.add(pat)  # (not an address: _one answers "not known" for every packet alike)


_DADDR_SELECTORS = frozenset({"ip daddr", "ip6 daddr"})


def _told_by_op(t: NftTable, op: Op, told: ToldApart) -> list[str] | None:
    """Add the destination addresses ``op`` compares with to ``told``; the chains it may
    go to; None where it may tell any two destinations apart or change one."""
    kind = op[0]
    if kind in ("dnat", "snat", "masquerade"):
        return None
    if kind == "verdict":
        return [op[2]] if op[1] in ("jump", "goto") else []
    if kind not in ("match", "vmap"):
        return []
    sels = op[1]
    if any(sel.startswith("fib ") and "daddr" in sel for sel in sels):
        return None
    at = [k for k, sel in enumerate(sels) if sel in _DADDR_SELECTORS]
    if kind == "match":
        _, _, _, value, mask, _ = op
        if not at:
            return []
        if mask is not None:
            return None
        if isinstance(value, str) and value.startswith("@"):
            s = t.set(value[1:])
            for parts, _v in s.elements if s is not None else ():
                for k in at:
                    if k < len(parts):
                        _tell_apart(told, parts[k])
        elif len(sels) == 1:
            _tell_apart(told, value)
        else:  # a concatenation against an anonymous set
            if not isinstance(value, tuple):
                return None
            for parts, _v, _c in split_elements(value):
                for k in at:
                    if k < len(parts):
                        _tell_apart(told, parts[k])
        return []
    ref = op[2]
    if isinstance(ref, list):
        elements: Sequence[tuple[tuple[str, ...], str | None]] = ref
    else:
        named = t.set(ref[1:])
        elements = named.elements if named is not None else ()
    targets = []
    for parts, verdict in elements:
        for k in at:
            if k < len(parts):
                _tell_apart(told, parts[k])
        words = (verdict or "").split()
        if len(words) > 1 and words[0] in ("jump", "goto"):
            targets.append(words[1].strip('"'))
    return targets


def iptables_nft_table(t: NftTable) -> bool:
    """A table iptables-nft made: one of its table names, its built-in chain names."""
    return t.name in ("filter", "nat", "mangle", "raw", "security") and all(
        c.name in _IPTABLES_CHAINS for c in t.chains if c.hook is not None)


def _dedupe(items: list[_Answer]) -> list[_Answer]:
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def _selector_assumption(sel: str, what: str) -> Assumption:
    """The fact a match on ``sel`` takes when the input does not decide it."""
    if sel in ("ip saddr", "ip6 saddr"):
        return assumption.pod_source()
    if sel.startswith("fib ") and sel.endswith(" type"):
        return assumption.addrtype()
    if sel in ("iifname", "meta iifname", "iif", "oifname", "meta oifname", "oif"):
        # `iifname "azv*"`, `iifname != { "a*", "b*" }`: the names, as iptables says them
        names = what.removeprefix(sel).strip().removeprefix("!=").strip()
        pattern = names.replace('"', "").replace("*", "+")
        return assumption.interface("-i" if "ii" in sel else "-o", pattern)
    return _undecided_match(what)


def _undecided_match(what: str) -> Assumption:
    return assumption.match(f"whether `{what}` holds for the packet: the input does not "
                            "show what decides it")


def _assumption(t: NftTable, op: Op) -> Assumption:
    """The fact an undecided match (``op``: "match", selectors, negate, value, mask,
    text) takes."""
    _, sels, _, value, _, what = op
    if isinstance(value, str) and value.startswith("@") and t.set(value[1:]) is None:
        return assumption.match(f"the elements of set {value} (`{what}`); `nft list set "
                                f"{t.family} {t.name} {value[1:]}` shows them")
    return _selector_assumption(sels[0], what) if len(sels) == 1 else _undecided_match(what)


def _map_assumption(sels: Tokens, ref: object) -> Assumption:
    """The fact an element of a map (``sels`` its key) is taken to match on."""
    what = f"{' . '.join(sels)} vmap {ref if isinstance(ref, str) else '{ ... }'}"
    return _selector_assumption(sels[0], what) if len(sels) == 1 else _undecided_match(what)


def _verdict(text: str) -> Action:
    words = text.split()
    if not words:
        return ("UNKNOWN", "empty verdict")
    if words[0] in ("goto", "jump") and len(words) > 1:
        return (words[0], words[1].strip('"'))
    if words[0] in ("accept", "drop", "reject"):
        return (words[0].upper(),)
    if words[0] in ("return", "continue"):
        return (words[0],)
    if words[0] == "UNKNOWN-MAP":
        return ("UNKNOWN", "a map that is not in the input")
    return ("UNKNOWN", f"verdict {text!r} is not evaluated")


def _exact(x: str) -> bool:
    return "/" not in x and "-" not in x.strip("-") and not x.startswith("{")


_PROTO_NUM = {"6": "tcp", "17": "udp", "132": "sctp", "1": "icmp"}
_CT_STATE = {"0x1": "invalid", "0x2": "established", "0x4": "related", "0x8": "new",
             "0x40": "untracked", "0x00000001": "invalid", "0x00000002": "established",
             "0x00000004": "related", "0x00000008": "new", "0x00000040": "untracked"}


_CT_STATE_MATCH: dict[tuple[str, object], bool] = {}


def _norm(kind: str, v: object) -> str:
    return str(v)


def _one(kind: str, actual: object, pattern: object) -> bool | None:
    """Does one value match one pattern (literal, prefix, range, anonymous set)?"""
    if isinstance(pattern, tuple):
        return _any_of(kind, actual, list(pattern))
    pat = str(pattern).strip('"')
    if pat.startswith("{") and pat.endswith("}"):
        return _any_of(kind, actual, [x.strip() for x in pat[1:-1].split(",")])
    if actual is None:
        return None
    if kind == "addr":
        try:
            version, lo, hi = ip_span(pat)
        except ValueError:
            return None
        if isinstance(actual, tuple):  # a pod whose address lies in a known prefix
            within = actual[1]
            if within is None:
                return None
            try:
                pod_version, first, last = _prefix(within)
            except ValueError:
                return None
            if pod_version != version:
                return False
            if lo <= first and last <= hi:
                return True
            return None if first <= hi and lo <= last else False
        got = ip_number(str(actual))
        if got is None:
            return None
        return got[0] == version and lo <= got[1] <= hi
    if kind == "int":
        try:
            got_int = actual if isinstance(actual, int) else int(str(actual))
            if "-" in pat.lstrip("-"):
                p_lo, p_hi = pat.split("-", 1)
                return int(p_lo, 0) <= got_int <= int(p_hi, 0)
            return got_int == int(pat, 0)
        except ValueError:
            return None
    if kind == "proto":
        return _PROTO_NUM.get(pat, pat) == actual
    if kind == "ctstate":
        # `nft -n` prints the state bits: 0x8 is new (asked in every walk: remembered)
        held = _CT_STATE_MATCH.get((pat, actual))
        if held is None:
            if len(_CT_STATE_MATCH) > 256:
                _CT_STATE_MATCH.clear()
            held = _CT_STATE_MATCH[(pat, actual)] = any(
                _CT_STATE.get(x.lower(), x) == actual for x in pat.split(","))
        return held
    if pat.endswith("*") and isinstance(actual, str):
        return actual.startswith(pat[:-1])  # iifname "veth*": nft's prefix wildcard
    # a flag list ("dnat,snat") holds the packet's one value
    return pat == actual or str(actual) in pat.split(",")


def _any_of(kind: str, actual: object, patterns: list[Any]) -> bool | None:
    unknown = False
    for pat in patterns:
        if pat == ",":
            continue
        r = _one(kind, actual, pat)
        if r is True:
            return True
        if r is None:
            unknown = True
    return None if unknown else False


@functools.lru_cache(maxsize=256)
def _prefix(text: str) -> tuple[int, int, int]:
    """(IP version, first, last) of a prefix (the pods' CIDR)."""
    net = ipaddress.ip_network(text, strict=False)
    return net.version, int(net.network_address), int(net.broadcast_address)


def _mark(op: Op, mark: int) -> int:
    how: str = op[1]
    value: int = op[2]
    if how == "or":
        return mark | value
    if how == "xor":
        return mark ^ value
    if how == "and":
        return mark & value
    return value


# what a selector reads: (its family: False IPv4, True IPv6, None either; an ICMP field;
# the one layer-4 protocol it belongs to, if any; which value), worked out once per
# selector text (_selector_kind)
(_DADDR, _SADDR, _PROTO, _DPORT, _SPORT, _MARK, _CTSTATE, _NFPROTO, _ETHERTYPE, _CTSTATUS,
 _FIB_SADDR, _FIB_DADDR, _IIF, _OIF, _UNKNOWN) = range(15)
_SELECTORS: dict[str, tuple[bool | None, bool, str | None, int]] = {}


def _selector_kind(sel: str) -> tuple[bool | None, bool, str | None, int]:
    family = True if sel.startswith(("ip6 ", "icmpv6 ")) else (
        False if sel.startswith(("ip ", "icmp ")) else None)
    icmp = sel.startswith(("icmp ", "icmpv6 "))
    head = sel.split(" ", 1)[0]
    proto = head if head in ("tcp", "udp", "sctp") else None
    if sel in ("ip daddr", "ip6 daddr"):
        code = _DADDR
    elif sel in ("ip saddr", "ip6 saddr"):
        code = _SADDR
    elif sel in ("meta l4proto", "ip protocol", "ip6 nexthdr"):
        code = _PROTO
    elif sel in ("th dport", "tcp dport", "udp dport", "sctp dport"):
        code = _DPORT
    elif sel in ("th sport", "tcp sport", "udp sport", "sctp sport"):
        code = _SPORT
    elif sel in ("meta mark", "mark"):
        code = _MARK
    elif sel == "ct state":
        code = _CTSTATE
    elif sel == "meta nfproto":
        code = _NFPROTO
    elif sel == "meta protocol":
        code = _ETHERTYPE
    elif sel == "ct status":
        code = _CTSTATUS
    elif sel.startswith("fib ") and sel.endswith(" type") and sel.split()[1] == "saddr":
        code = _FIB_SADDR
    elif sel.startswith("fib ") and sel.endswith(" type") and sel.split()[1] == "daddr":
        code = _FIB_DADDR
    elif sel in ("iifname", "meta iifname", "iif"):
        code = _IIF
    elif sel in ("oifname", "meta oifname", "oif"):
        code = _OIF
    else:
        code = _UNKNOWN
    return family, icmp, proto, code


# -- compiling a rule's tokens into ops --------------------------------------------------

_SELECTOR_HEADS = {
    "ip": ("daddr", "saddr", "protocol"), "icmp": ("type", "code"),
    "ip6": ("daddr", "saddr", "nexthdr", "version", "hoplimit", "flowlabel", "dscp"),
    "icmpv6": ("type", "code"), "meta": ("l4proto", "mark", "iifname", "oifname",
                                                    "nfproto", "protocol"),
    "th": ("dport", "sport"), "tcp": ("dport", "sport"), "udp": ("dport", "sport"),
    "sctp": ("dport", "sport"), "ct": ("state", "status", "mark", "direction"),
}
_SINGLE = frozenset({"mark", "iifname", "oifname", "iif", "oif"})
_VERDICT_WORDS = frozenset({"accept", "drop", "reject", "return", "continue"})
_PASSIVE = frozenset({"counter", "log", "<passive:log>", "<passive:limit>"})


def _selector(toks: Tokens, i: int) -> tuple[str | None, int]:
    w = toks[i] if i < len(toks) else None
    if not isinstance(w, str):
        return None, i
    if w in _SELECTOR_HEADS and i + 1 < len(toks) and toks[i + 1] in _SELECTOR_HEADS[w]:
        return f"{w} {toks[i + 1]}", i + 2
    if w in _SELECTOR_HEADS and w == "meta" and i + 1 < len(toks) and toks[i + 1] == "mark":
        return "meta mark", i + 2
    if w == "fib":
        j = i + 1
        parts = []
        while j < len(toks) and isinstance(toks[j], str) and toks[j] in (
                "saddr", "daddr", ".", "iif", "oif", "mark"):
            parts.append(toks[j])
            j += 1
        if j < len(toks) and toks[j] in ("type", "oif", "oifname"):
            return "fib " + " ".join(p for p in parts if p != ".") + f" {toks[j]}", j + 1
        return None, i
    if w == "numgen" and i + 3 < len(toks) and toks[i + 2] == "mod":
        return f"numgen {toks[i + 1]} mod {toks[i + 3]}", i + 4
    if w in _SINGLE:
        return w, i + 1
    return None, i


def _compile(toks: Tokens) -> list[Op]:
    ops: list[Op] = []
    i, n = 0, len(toks)
    while i < n:
        w = toks[i]
        if w == "comment" and i + 1 < n:
            i += 2
            continue
        if w == "counter":
            i += 1
            while i + 1 < n and toks[i] in ("packets", "bytes"):
                i += 2
            continue
        if w in ("jump", "goto") and i + 1 < n:
            ops.append(("verdict", w, str(toks[i + 1]).strip('"')))
            i += 2
            continue
        if w in _VERDICT_WORDS:
            ops.append(("verdict", w, ""))
            i += 1
            if w == "reject":
                while i < n and toks[i] != "comment":
                    i += 1  # reject with icmp type ...: still a reject
            continue
        if w == "masquerade":
            ops.append(("masquerade",))
            i += 1
            while i < n and toks[i] in ("fully-random", "random", "persistent", ","):
                i += 1
            continue
        if w in ("dnat", "snat") and i + 1 < n:
            j = i + 1
            if toks[j] in ("ip", "ip6") and j + 1 < n:
                j += 1
            if toks[j] != "to" or j + 1 >= n or not isinstance(toks[j + 1], str):
                ops.append(("unknown", f"{w} {render_tok(toks[j:j + 3])}"))
                break
            target = toks[j + 1]
            if target.startswith("["):  # "[fd00:10:180::1]:80": an IPv6 address and port
                addr, _, port = target[1:].partition("]")
                port = port[1:] if port.startswith(":") else ""
            else:
                addr, _, port = target.rpartition(":") if target.count(":") == 1 else (
                    target, "", "")
            if w == "dnat":
                ops.append(("dnat", addr, int(port) if is_number(port) else None))
            else:
                ops.append(("snat", addr))
            i = j + 2
            while i < n and toks[i] in ("fully-random", "random", "persistent", ","):
                i += 1
            continue
        if w in ("update", "add") and i + 2 < n and str(toks[i + 1]).startswith("@"):
            ops.append(("passive",))  # records session affinity: changes nothing now
            i += 3
            continue
        if w in ("notrack", "<passive:notrack>"):
            ops.append(("notrack",))
            i += 1
            continue
        if w in _PASSIVE or (isinstance(w, str) and w.startswith("<passive")):
            ops.append(("passive",))
            i += 1
            if w == "log":
                while i < n and toks[i] in ("prefix", "level", "flags") and i + 1 < n:
                    i += 2
            continue
        # a selector expression: a match, a map lookup or a mark assignment
        sels = []
        start = i
        sel, j = _selector(toks, i)
        while sel is not None:
            sels.append(sel)
            if j < n and toks[j] == ".":
                sel, j = _selector(toks, j + 1)
                continue
            break
        if not sels:
            ops.append(("unknown", render_tok(toks[i:i + 3])))
            break
        i = j
        if i < n and toks[i] == "set" and sels[-1] in ("meta mark", "mark"):
            # mark set mark or 0x4000 / meta mark set meta mark | 0x00004000 / mark set X
            rest = [str(x) for x in toks[i + 1:i + 6]]
            if len(rest) >= 3 and rest[0] in ("mark", "meta"):
                k = 2 if rest[0] == "meta" else 1
                how = {"or": "or", "|": "or", "xor": "xor", "^": "xor", "and": "and",
                       "&": "and"}.get(rest[k])
                if how is None or k + 1 >= len(rest):
                    ops.append(("unknown", "mark set " + " ".join(rest)))
                    break
                ops.append(("mark", how, int(rest[k + 1], 0)))
                i += 1 + k + 2
            else:
                try:
                    ops.append(("mark", "set", int(rest[0], 0)))
                except (ValueError, IndexError):
                    ops.append(("unknown", "mark set " + " ".join(rest)))
                    break
                i += 2
            continue
        mask = None
        if i + 1 < n and toks[i] in ("&", "and"):
            try:
                mask = int(str(toks[i + 1]), 0)
            except ValueError:
                ops.append(("unknown", render_tok(toks[start:i + 2])))
                break
            i += 2
        if i < n and toks[i] in ("vmap", "map"):
            if i + 1 >= n:
                ops.append(("unknown", "vmap without a map"))
                break
            ref = toks[i + 1]
            if isinstance(ref, tuple):
                ref = [(k, v) for k, v, _ in split_elements(ref)]
            ops.append(("vmap", tuple(sels), ref) if toks[i] == "vmap" else
                       ("unknown", "map lookup"))
            i += 2
            continue
        negate = False
        if i < n and toks[i] in ("!=", "==", "eq", "ne"):
            negate = toks[i] in ("!=", "ne")
            i += 1
        if i >= n:
            ops.append(("unknown", render_tok(toks[start:i])))
            break
        value = toks[i]
        i += 1
        # "established , related" (a comma list of flags)
        while i + 1 < n and toks[i] == "," and isinstance(toks[i + 1], str):
            value = f"{value},{toks[i + 1]}"
            i += 2
        if isinstance(value, tuple):
            value = tuple(x for x in value if x != ",")
        ops.append(("match", tuple(sels), negate, value, mask,
                    render_tok(toks[start:i])))
    return ops


def render_tok(toks: Tokens) -> str:
    return render(tuple(toks))
