"""Walk one concrete packet through iptables chains, rule by rule.

The walker knows iptables semantics (matches, jumps, gotos, RETURN, marks, NAT targets),
nothing about Kubernetes. Node facts it needs (is an address local? ipset members)
come from a :class:`NodeView`. Where a match cannot be decided from the saved state
(``statistic``, ``recent``) the walk forks and follows both branches; where a match or
target is not understood the branch ends as ``UNKNOWN`` naming the rule.
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
import operator
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from agent.netfilter import assumption
from agent.netfilter.assumption import Assumption
from agent.netfilter.cni_chains import CniChain, known_chain
from agent.netfilter.packet import MAX_PATHS, MAX_RULES, HookResult, Packet, ToldApart
from agent.netfilter.rules import (
    BUILTIN_TARGETS,
    PASSIVE_TARGETS,
    Cond,
    ParsedRule,
    parse_mark,
    parse_net,
    parse_rule_text,
    port_in,
)
from agent.netfilter.shape import chain_shape, rule_shape
from agent.numbers import is_number
from agent.parse.ip_text import host_port, ip_number
from agent.snapshot import Chain, Rules, Table

TRUE, FALSE, MAYBE = 1, 0, 2
ASSUME = "assume"  # the action of a Step that records an assumed answer
# reasons a match cannot be decided that name a fact of the node the input lacks
ASSUMABLE = ("addrtype --", "ipset ", "source address", "interface ")
# why a source match cannot be decided when the pod's own address is not known
SRC_UNKNOWN = ("source address: the pods' addresses on this node are not in the input "
               "(their CIDR decides it)")
# the "policy" of a built-in chain an excerpt does not show, holding only the jumps
# kube-proxy always installs: a packet falling off its end meets rules nobody has seen
UNSEEN_REST = "(unseen)"
MAX_DEPTH = 64
MAX_STEPS = 2000  # rules on one path (kube-proxy's are some tens)


class NodeView(Protocol):
    """What the walker asks about the node."""

    def addr_type(self, addr: str) -> str | None:
        """"LOCAL" | "BROADCAST" | "MULTICAST" | "UNICAST"; None when unknown."""

    def ipset_members(self, name: str) -> tuple[str, frozenset[str]] | None:
        """(set type, members) or None when the set is unknown."""


class Step(NamedTuple):
    """One rule that matched and acted on the packet (evidence)."""

    table: str
    chain: str
    text: str
    source: str
    action: str
    assumptions: tuple[Assumption, ...] = ()  # action ASSUME: the fact taken

    def render(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"{self.table} {self.chain}: {self.text}{where}"

    def shape(self) -> str:
        return f"{self.table} {chain_shape(self.chain)}: {rule_shape(self.text)}"


# NamedTuple(...) through its generated __new__ costs three times this, for each step
_new_step = tuple.__new__

# what the walk does with a target that is not a chain (one dict lookup, not a dozen tests)
_VERDICT, _RETURN, _TO, _NETMAP, _FROM, _MARK, _CONNMARK, _PASSIVE, _QUEUE = range(9)
_TARGET_KIND = {"ACCEPT": _VERDICT, "DROP": _VERDICT, "REJECT": _VERDICT, "RETURN": _RETURN,
                "DNAT": _TO, "REDIRECT": _TO, "NETMAP": _NETMAP, "SNAT": _FROM,
                "MASQUERADE": _FROM, "MARK": _MARK, "CONNMARK": _CONNMARK,
                "QUEUE": _QUEUE, "NFQUEUE": _QUEUE,
                **{t: _PASSIVE for t in PASSIVE_TARGETS}}

# (an IPv6 host as ip6tables-save prints it: compressed, lower case, "/128"; each
# family's host length only: an IPv6 "/32" is a prefix; an IPv6 address with a dotted
# tail is not indexed, the walk compares it by value)
_DST_RE = re.compile(r"(?<!! )-d (\d+\.\d+\.\d+\.\d+(?=(?:/32)?\s)|[0-9a-f:]*:[0-9a-f:]*"
                     r"(?=(?:/128)?\s))(?:/32|/128)?(?=\s)")
_DPORT_RE = re.compile(r"(?<!! )--dport (\d+)(?=\s)")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
SMALL_CHAIN = 16  # rules: a scan is cheaper than indexing them
# A packet DNATed to an endpoint crosses these chains once per endpoint of every NodePort
# or LB IP walked (20k walks each at 10k services): where no rule reachable from them can
# tell its address from another's, the walk is made once and shared (TableWalker.walk)
SHARED_CHAINS = frozenset({"FORWARD", "POSTROUTING"})
_SHARED_KEPT = 4096  # packets whose shared walks are kept (by what else they hold)
_SHARED_PATHS = 8  # a walk of more paths is not kept (many undecided matches)
# the packet fields a shared walk is keyed without: its destination and where it was
# DNATed from (what the rules of a shared chain never read: _told_apart)
_DST, _ORIG_DST, _ORIG_DPORT = (Packet._fields.index(f) for f in ("dst", "orig_dst",
                                                                  "orig_dport"))
_ANY_ADDRESS = "any address"
# small chains whose parsed rules a walker keeps (kube-proxy writes one to four rules per
# service and endpoint chain: 47k chains for 10k services, each walked once or twice)
KEPT_SMALL_CHAINS = 1024


class _ChainIndex:
    """Rules of one chain, parsed when first reached. A big chain is indexed by exact
    destination address, else by exact destination port, so a 30k-rule KUBE-SERVICES or
    KUBE-NODEPORTS costs a dict lookup per packet rather than a scan; a rule with neither
    is a candidate for every packet. A big chain keeps the parses of those shared rules
    only: one destination's rule is reached by that destination's walk, and keeping every
    parse would hold the whole table twice."""

    __slots__ = ("by_dport", "by_dst", "generic", "keep", "n", "name", "parsed", "policy",
                 "rules")

    def __init__(self, chain: Chain) -> None:
        self.name = chain.name
        self.policy = chain.policy
        self.rules: Rules = chain.rules
        n = self.n = len(chain.rules.texts)
        self.parsed: list[ParsedRule | None] = [None] * n
        self.generic: list[int] | None = None  # None: every rule (a small chain)
        self.keep: frozenset[int] | None = None  # None: keep every parse
        if n <= SMALL_CHAIN:
            return
        generic = []
        by_dst: dict[str, list[int]] = {}
        by_dport: dict[int, list[int]] = {}
        self.by_dst, self.by_dport = by_dst, by_dport
        dst_search = _DST_RE.search
        dst_at = _DST_RE.match
        dport_search = _DPORT_RE.search
        for i, text in enumerate(chain.rules.texts):
            # kube-proxy's "-A CHAIN -d IP/32 ...": the first match there, before any
            # quote, is the leftmost one the search would find (one anchored match)
            at = text.find(" ", 3) + 1
            quote = text.find('"')
            m = dst_at(text, at) if at and (quote < 0 or quote > at) else None
            if m is None and "-d " in text:  # (no "-d ": the search cannot find one)
                m = _outside_quotes(dst_search, text)
            if m:
                by_dst.setdefault(m.group(1), []).append(i)
                continue
            m = _outside_quotes(dport_search, text) if "--dport " in text else None
            if m:
                by_dport.setdefault(int(m.group(1)), []).append(i)
            else:
                generic.append(i)
        self.generic = generic
        self.keep = frozenset(generic)

    def candidates(self, dst: str, dport: int, start: int) -> Sequence[int]:
        """The rules from ``start`` on that a packet to dst:dport may match, in order."""
        generic = self.generic
        if generic is None:
            return range(start, self.n)
        a = self.by_dst.get(dst)
        b = self.by_dport.get(dport)
        if a or b:
            generic = sorted(generic + (a or []) + (b or []))
        return generic[bisect.bisect_left(generic, start):] if start else generic

    def rule(self, i: int) -> ParsedRule:
        p = self.parsed[i]
        if p is None:
            rules = self.rules
            p = parse_rule_text(rules.texts[i], rules.source(i))
            if self.keep is None or i in self.keep:
                self.parsed[i] = p
        return p


def _outside_quotes(search: Callable[..., re.Match[str] | None], text: str
                    ) -> re.Match[str] | None:
    """The first match of ``search`` that is not inside a quoted comment (-d / --dport in
    a comment must not index the rule): what it finds in the text with each quoted part
    emptied. A rule with one quoted part and no backslash (kube-proxy's comment) is
    searched before and after it, in place; any other is emptied first."""
    first = text.find('"')
    if first < 0:
        return search(text)
    last = text.find('"', first + 1)
    if last < 0 or "\\" in text or text.find('"', last + 1) >= 0:
        return search(_QUOTED.sub('""', text))
    # (a search from ``last`` on still sees the quote before it, as the emptied text does)
    return search(text, 0, first) or search(text, last + 1)


# matches that read a packet's destination (or where it was DNATed from) other than by
# an address or prefix (_told_apart)
_READ_DST = frozenset({"conntrack--ctorigdst", "conntrack--ctorigdstport",
                       "iprange--dst-range"})


class TableWalker:
    def __init__(self, table: Table, view: NodeView, partial: bool = False) -> None:
        self.table = table
        self.tname = table.name
        self.view = view
        self.partial = partial  # an excerpt: a missing chain is unseen, not empty
        self._chains = {c.name: c for c in table.chains}
        self._big: dict[str, _ChainIndex] = {}
        # small chains reached lately, in two generations: the young ones, and the ones
        # before them (dropped when the young ones make a full generation; one reached
        # again goes back to the young)
        self._young: dict[str, _ChainIndex] = {}
        self._old: dict[str, _ChainIndex] = {}
        self._budget = MAX_PATHS - 1  # forks: each adds one path
        self._rules = MAX_RULES
        # each chain's paths from its first rule, by (chain, packet, depth): one walk's
        self._walked: dict[tuple[str, Packet, int],
                           list[tuple[str | None, Packet, tuple[Step, ...], str]]] = {}
        self._sets: dict[str, tuple[str, frozenset[str]] | None] = {}  # what the view said
        # a net set's members indexed for lookup, by (set, net dimensions, dimensions):
        # the walker's own (a module-wide LRU kept 64 sets' members past their snapshot)
        self._net_indexes: dict[tuple[str, tuple[int, ...], int], _NetIndex] = {}
        # SHARED_CHAINS: per chain the destinations its rules tell apart (None: any two
        # may be), and the shared walks by chain and packet (less its destination)
        self._told: dict[str, ToldApart | None] = {}
        self._shared: dict[tuple[object, ...], tuple[HookResult, ...]] = {}

    def _index(self, name: str) -> _ChainIndex | None:
        ix = self._young.get(name) or self._big.get(name)
        if ix is not None:
            return ix
        ix = self._old.get(name)
        if ix is None:
            chain = self._chains.get(name)
            if chain is None:
                return None
            ix = _ChainIndex(chain)
            if ix.generic is not None:
                self._big[name] = ix
                return ix
        young = self._young
        if len(young) >= KEPT_SMALL_CHAINS // 2:
            self._old = young
            young = self._young = {}
        young[name] = ix
        return ix

    def walk(self, chain: str, pkt: Packet) -> list[HookResult]:
        """All paths of ``pkt`` through built-in ``chain``; a fall-through takes the policy.

        A packet DNATed to an endpoint (SHARED_CHAINS) whose address no rule reachable
        from ``chain`` tells apart from another's (_told_apart: no address or prefix
        there holds it, no ipset, range or conntrack match reads it, no DNAT, no CNI chain
        standing in) has the paths of any other such packet alike in everything else,
        and of the same address type where a rule asks it: walked once, and given this
        packet's destination."""
        # (an orig_dst as conntrack's DNAT state reads it; a destination that is no
        # address, from a NAT target's text, walked on its own: the rules say so)
        if not pkt.orig_dst or chain not in SHARED_CHAINS or ip_number(pkt.dst) is None:
            return self._walk(chain, pkt)
        if chain in self._told:
            told = self._told[chain]
        else:
            told = self._told[chain] = self._told_apart(chain)
        if told is None or told.holds(pkt.dst):
            return self._walk(chain, pkt)
        addr_type = self.view.addr_type(pkt.dst) if told.by_type else ""
        if addr_type is None:
            return self._walk(chain, pkt)
        # (by position: _replace costs ~4x this, for every endpoint of every target)
        key = (chain, addr_type, *pkt[:_DST], _ANY_ADDRESS, *pkt[_DST + 1:_ORIG_DST],
               _ANY_ADDRESS, None, *pkt[_ORIG_DPORT + 1:])
        got = self._shared.get(key)
        if got is None:
            walked = self._walk(chain, pkt)
            if len(walked) <= _SHARED_PATHS:
                if len(self._shared) >= _SHARED_KEPT:
                    self._shared.clear()
                self._shared[key] = tuple(walked)
            return walked
        dst, orig_dst, orig_dport = pkt.dst, pkt.orig_dst, pkt.orig_dport
        return [_new_step(HookResult, (r[0], _new_step(Packet, (
            *r[1][:_DST], dst, *r[1][_DST + 1:_ORIG_DST], orig_dst, orig_dport,
            *r[1][_ORIG_DPORT + 1:])), *r[2:])) for r in got]

    def _told_apart(self, chain: str) -> ToldApart | None:
        """The destinations the rules reachable from ``chain`` compare a packet's with, or
        None where they may tell any two apart or change one: a destination read by an
        ipset, range or conntrack match, a NAT to a destination, a CNI chain the input
        does not hold (what it does depends on the destination), too many prefixes."""
        told = ToldApart()
        seen: set[str] = set()
        todo = [chain]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            c = self._chains.get(name)
            rules = c.rules if c is not None else Rules()
            ix = self._index(name) if len(rules.texts) > SMALL_CHAIN else None
            for host in ix.by_dst if ix is not None and ix.generic is not None else ():
                told.add(host)  # (what the index offers a rule to, parsed or not)
            for i, text in enumerate(rules.texts):
                r = parse_rule_text(text, rules.source(i))
                for k, _, a in r.conds:
                    if k == "dst":
                        told.add(a[0])
                    elif k == "addrtype--dst-type":
                        told.by_type = True
                    elif k in _READ_DST or (k == "set--match-set" and (
                            len(a) < 2 or "dst" in a[1].split(","))):
                        return None
                tgt = r.target
                if tgt is None:
                    continue
                kind = _TARGET_KIND.get(tgt)
                if kind in (_TO, _NETMAP):
                    return None
                if kind is None:
                    if tgt in self._chains:
                        todo.append(tgt)
                    elif known_chain(self.tname, tgt) is not None:
                        return None
            if told.crowded:
                return None
        return told

    def _walk(self, chain: str, pkt: Packet) -> list[HookResult]:
        self._budget = MAX_PATHS - 1  # forks: each adds one path
        self._rules = MAX_RULES
        self._walked = {}
        ix = self._index(chain)
        if ix is None and self.partial:
            return [HookResult("UNKNOWN", pkt, (), f"{self.tname} {chain} is not in the "
                               f"input (an excerpt): `iptables -t {self.tname} -S` "
                               "shows it")]
        if ix is None:
            return [HookResult("ACCEPT", pkt, (), f"{self.tname} {chain}: no such chain "
                               "(nothing hooked here)")]
        out = []
        for verdict, p, steps, detail in self._run(ix, 0, pkt, (), 0):
            if verdict is None:
                policy = ix.policy or "ACCEPT"
                if policy == UNSEEN_REST:
                    out.append(HookResult("UNKNOWN", p, steps, (
                        f"the rest of {self.tname} {chain} is not in the input (an excerpt): "
                        f"`iptables -t {self.tname} -S {chain}` shows it")))
                    continue
                steps = (*steps, Step(self.tname, chain, f"policy {policy}", "", policy))
                out.append(HookResult(policy, p, steps, f"end of {chain}: policy {policy}"))
            else:
                out.append(_new_step(HookResult, (verdict, p, steps, detail)))
        return out

    # -- traversal -------------------------------------------------------------------

    def _run(self, ix: _ChainIndex, start: int, pkt: Packet, steps: tuple[Step, ...],
             depth: int) -> list[tuple[str | None, Packet, tuple[Step, ...], str]]:
        """Every path of ``pkt`` from rule ``start`` of chain ``ix``: (verdict, or None
        where it fell off the chain's end or RETURNed; packet; steps; detail).

        A path through this chain is a thread (rule, packet, steps); a fork pushes the
        branch where the rule does not match to run before the one where it does, and a
        jump's paths, each continued here, go on the stack in their order, so paths come
        out in the order a depth-first walk finds them. Only a jump recurses (at most
        MAX_DEPTH deep), and a chain is walked once per packet state in a walk (_jump):
        a graph of chains costs its size, not its paths. Before, the walk recursed once per
        fork and per returning jump (1,200 endpoints of one Service, or 1,500 rules
        jumping to a chain that returns, ended in RecursionError), and 16 levels of chains
        each jumping twice to the next took over 60 s."""
        results: list[tuple[str | None, Packet, tuple[Step, ...], str]] = []
        tname = self.tname
        tests = _WALKER_TESTS
        kind_of = _TARGET_KIND.get
        if depth > MAX_DEPTH:
            return [("UNKNOWN", pkt, steps, f"more than {MAX_DEPTH} nested jumps (a loop "
                     f"through {ix.name}?)")]
        # a thread: (first rule, packet, steps, rule start matched), or a path's end found
        # by a jump, kept in its place: (None, result)
        threads: list[tuple[int, Packet, tuple[Step, ...], bool]
                      | tuple[None, tuple[str | None, Packet, tuple[Step, ...], str]]] = [
            (start, pkt, steps, False)]
        parsed = ix.parsed
        rules = ix.rules
        texts = rules.texts
        keep = ix.keep
        while threads:
            item = threads.pop()
            if item[0] is None:
                results.append(item[1])
                continue
            start, pkt, steps, matched = item
            cands = range(start, ix.n) if ix.generic is None else \
                ix.candidates(pkt.dst, pkt.dport, start)
            jumped = False
            for i in cands:
                self._rules -= 1
                if self._rules < 0:
                    results.append(("UNKNOWN", pkt, steps, f"walk stopped after {MAX_RULES} "
                                    "rules (a loop of jumps or a huge rule set)"))
                    jumped = True
                    break
                r = parsed[i]
                if r is None:
                    text = texts[i]
                    if not matched and "-s " in text and _src_rules_out(text, pkt):
                        continue  # not parsed: its first match, on the source, fails
                    r = parse_rule_text(text, rules.source(i))  # (ix.rule, inline)
                    if keep is None or i in keep:
                        parsed[i] = r
                # (one unpacking: a NamedTuple's fields by name cost a descriptor call each)
                _, conds, tgt, goto, _, _, rtext, rsource, problem = r
                if matched:  # a fork's branch where this rule matches: its target acts
                    matched = False
                else:
                    # does it match? TRUE / FALSE / MAYBE, or None with the reason when it
                    # cannot be decided (inline: this runs for every rule reached)
                    m: int | None = TRUE
                    why = ""
                    for c in conds:
                        k, negate, a = c
                        test = tests.get(k)
                        try:
                            v, reason = self._cond(c, pkt) if test is None else \
                                test(self, a, pkt)
                        except (ValueError, TypeError, IndexError) as e:  # a malformed value
                            v, reason = None, f"cannot read {k} {' '.join(a)!r}: {e}"
                        if negate and v is not None and v != MAYBE:
                            v = TRUE if v == FALSE else FALSE
                        if v == FALSE:
                            m = FALSE
                            break
                        if v is None and m is not None:
                            m, why = None, reason
                        elif v == MAYBE and m == TRUE:
                            m = MAYBE
                    if problem and m != FALSE:
                        results.append(("UNKNOWN", pkt, steps, _unknown(r, problem)))
                        jumped = True
                        break
                    if m == FALSE:
                        continue
                    if m is None and why.startswith(ASSUMABLE) and self._budget > 0:
                        # a fact of the node we were not given (its addresses, a set's
                        # members): follow both answers; the caller decides whether they
                        # agree. The branch where it does not match runs first.
                        self._budget -= 1
                        where = f" ({rsource})" if rsource else ""
                        what = (_assumption(why, f"{tname} {ix.name}: {rtext}{where}"),)
                        yes = Step(tname, ix.name, f"assumed matching: {rtext}{where}: {why}",
                                   rsource, ASSUME, what)
                        no = Step(tname, ix.name,
                                  f"assumed NOT matching: {rtext}{where}: {why}", rsource,
                                  ASSUME, what)
                        threads.append((i, pkt, (*steps, yes), True))
                        threads.append((i + 1, pkt, (*steps, no), False))
                        jumped = True
                        break
                    if m is None:
                        results.append(("UNKNOWN", pkt, steps, _unknown(r, why)))
                        jumped = True
                        break
                    if m == MAYBE:
                        if self._budget > 0:
                            self._budget -= 1
                            threads.append((i, pkt, steps, True))
                            threads.append((i + 1, pkt, steps, False))
                            jumped = True
                            break
                        # never drop a branch silently: the one not followed is unknown
                        results.append(("UNKNOWN", pkt, steps, _unknown(
                            r, f"more than {MAX_PATHS} random/recent branches: the branch "
                               "where this rule does not match was not followed")))
                if tgt is None:
                    continue
                step = _new_step(Step, (tname, ix.name, rtext, rsource, tgt, ()))
                kind = kind_of(tgt)
                if kind is None:
                    pass  # a chain (below)
                elif kind == _VERDICT:
                    results.append((tgt, pkt, (*steps, step), f"{tgt} in {ix.name}"))
                    jumped = True
                    break
                elif kind == _RETURN:
                    steps = (*steps, step)
                    break  # (as falling off the end)
                elif kind == _TO or (kind == _NETMAP and pkt.out_iface is None):
                    try:
                        new = _dnat(r, pkt)
                    except ValueError as e:
                        results.append(("UNKNOWN", pkt, steps,
                                        _unknown(r, f"bad NAT target: {e}")))
                    else:
                        results.append((tgt if tgt != "NETMAP" else "DNAT", new,
                                        (*steps, step),
                                        f"{tgt} to {host_port(new.dst, new.dport)}"))
                    jumped = True
                    break
                elif kind in (_FROM, _NETMAP):
                    to = r.target_opts.get("--to-source") or r.target_opts.get("--to") or ""
                    results.append((tgt if tgt != "NETMAP" else "SNAT",
                                    pkt._replace(snat=to or tgt.lower()), (*steps, step),
                                    f"{tgt} {r.target_opts.get('--to-source', '')}".strip()))
                    jumped = True
                    break
                elif kind == _MARK:
                    new_pkt, err = _mark(r, pkt)
                    if err:
                        results.append(("UNKNOWN", pkt, steps, _unknown(r, err)))
                        jumped = True
                        break
                    pkt = new_pkt
                    steps = (*steps, _new_step(Step, (tname, ix.name, rtext, rsource,
                                                      f"mark {pkt.mark:#x}", ())))
                    continue
                elif kind == _CONNMARK:
                    new_pkt, err = _connmark(r, pkt)
                    if err:
                        results.append(("UNKNOWN", pkt, steps, _unknown(r, err)))
                        jumped = True
                        break
                    pkt = new_pkt
                    continue
                elif kind == _PASSIVE:
                    continue
                else:  # _QUEUE
                    results.append(("UNKNOWN", pkt, steps,
                                    _unknown(r, f"target {tgt} hands the packet to user "
                                                "space")))
                    jumped = True
                    break
                sub = self._index(tgt)
                if sub is None:
                    if tgt in BUILTIN_TARGETS:
                        continue
                    cni = known_chain(tname, tgt)
                    if cni is not None:
                        # a CNI's chain the input does not hold: what that CNI writes
                        cni_end, go_on = _cni_chain(cni, tgt, tname, ix.name, rtext,
                                                    rsource, pkt, steps, self._budget > 0)
                        if cni_end is None:  # it passes the packet on
                            steps = go_on or steps
                            continue
                        if go_on is not None:  # or, as its configuration may say, not
                            self._budget -= 1
                            threads.append((i + 1, pkt, go_on, False))
                        results.append(cni_end)
                        jumped = True
                        break
                    results.append(("UNKNOWN", pkt, steps, _unknown(
                        r, f"target {tgt} is neither a chain of table {tname} "
                           "nor a target this walker knows" + (
                               f" (not in the input: `iptables -t {tname} -S {tgt}` "
                               "shows it)" if self.partial else ""))))
                    jumped = True
                    break
                # each path of the chain jumped to, in its order: an end is an end of this
                # chain's path too; a fall-through or RETURN goes on after this rule (a
                # goto's: where this chain would have returned to)
                base = (*steps, step)
                then: list[tuple[int, Packet, tuple[Step, ...], bool]
                           | tuple[None, tuple[str | None, Packet, tuple[Step, ...], str]]] = []
                walked, copied = self._jump(sub, pkt, depth + 1)
                for n, (end, p2, st2, d) in enumerate(walked):
                    if n and copied:
                        # paths a remembered chain walk adds again: charged as forks
                        # (each of a fresh walk's was, in the chain), within the bound
                        if self._budget <= 0:
                            then.append((None, ("UNKNOWN", p2, base, (
                                f"more than {MAX_PATHS} paths (through {tgt}): the others "
                                "were not followed"))))
                            break
                        self._budget -= 1
                    full = base + st2
                    if len(full) > MAX_STEPS:
                        then.append((None, ("UNKNOWN", p2, full[:MAX_STEPS], (
                            f"a path of more than {MAX_STEPS} rules (through {tgt}): not "
                            "followed further"))))
                    elif end is not None or goto:
                        then.append((None, (end, p2, full, d)))
                    else:
                        then.append((i + 1, p2, full, False))
                threads.extend(reversed(then))
                jumped = True
                break
            if not jumped:  # fell off the chain's end (or RETURNed)
                results.append((None, pkt, steps, ""))
        return results

    def _jump(self, ix: _ChainIndex, pkt: Packet, depth: int
              ) -> tuple[list[tuple[str | None, Packet, tuple[Step, ...], str]], bool]:
        """Every path of ``pkt`` through chain ``ix`` from its first rule (steps from
        there), walked once per packet state and depth in a walk; and whether they were
        remembered (their forks not charged in this walk again)."""
        key = (ix.name, pkt, depth)
        got = self._walked.get(key)
        if got is not None:
            return got, True
        got = self._walked[key] = self._run(ix, 0, pkt, (), depth)
        return got, False

    # -- matching ----------------------------------------------------------------------

    def _cond(self, c: Cond, pkt: Packet) -> tuple[int | None, str]:
        k, _, a = c
        if k in ("src", "dst"):
            if k == "src" and not pkt.src_known:
                return None, SRC_UNKNOWN
            addr = pkt.src if k == "src" else pkt.dst
            return _in_net(addr, a[0]), ""
        if k in ("in", "out"):
            iface = pkt.in_iface if k == "in" else pkt.out_iface
            if iface is None:
                # (kube-proxy's --detect-local-mode InterfaceNamePrefix / BridgeInterface
                # tells pods' packets so: `-i azv+`, `! -i cbr0`)
                return None, (f"interface {'-i' if k == 'in' else '-o'} {a[0]}: the "
                              f"interface the packet {'enters' if k == 'in' else 'leaves'} "
                              "by is not in the input")
            pat = a[0]
            ok = iface.startswith(pat[:-1]) if pat.endswith("+") else iface == pat
            return (TRUE if ok else FALSE), ""
        if k == "proto":
            p = a[0]
            if p in ("all", "0"):
                return TRUE, ""
            return (TRUE if p in (pkt.proto, _PROTO_NUM.get(pkt.proto)) else FALSE), ""
        if k == "fragment":
            return FALSE, ""  # we model the first, unfragmented packet
        module, _, opt = k.partition("--")
        opt = "--" + opt
        if module in ("tcp", "udp", "sctp"):
            if opt in ("--dport", "--destination-port"):
                return _port(a[0], pkt.dport)
            if opt in ("--sport", "--source-port"):
                return _port(a[0], pkt.sport)
            if opt == "--syn":
                return TRUE, ""  # the packet we walk is the handshake's SYN
            if opt == "--tcp-flags":
                mask = set(a[0].split(","))
                comp = set(a[1].split(","))
                flags = {"SYN"}
                if "ALL" in mask:
                    mask = {"SYN", "ACK", "FIN", "RST", "URG", "PSH"}
                return (TRUE if (flags & mask) == (comp - {"NONE"}) else FALSE), ""
            return None, f"{module} option {opt}"
        if module == "multiport":
            if opt in ("--dports", "--destination-ports"):
                return _port(a[0], pkt.dport)
            if opt in ("--sports", "--source-ports"):
                return _port(a[0], pkt.sport)
            if opt == "--ports":
                d, s_ = _port(a[0], pkt.dport), _port(a[0], pkt.sport)
                return d if d[0] != FALSE else s_
            return None, f"multiport option {opt}"
        if module == "set":
            if opt == "--match-set":
                return self._set(a[0], a[1], pkt)
            if opt in ("--return-nomatch", "--update-counters", "--update-subcounters"):
                return TRUE, ""
            return None, f"set option {opt}"
        if module == "addrtype":
            if opt in ("--src-type", "--dst-type"):
                if opt == "--src-type" and not pkt.src_known:
                    return None, SRC_UNKNOWN
                addr = pkt.src if opt == "--src-type" else pkt.dst
                t = self.view.addr_type(addr)
                if t is None:
                    return None, f"addrtype {opt}: local addresses of the node unknown"
                return (TRUE if t in a[0].split(",") else FALSE), ""
            if opt in ("--limit-iface-in", "--limit-iface-out"):
                return MAYBE, ""  # narrows LOCAL to one interface: follow both branches
            return None, f"addrtype option {opt}"
        if module in ("mark", "connmark"):
            if opt == "--mark":
                try:
                    v, m = parse_mark(a[0])
                except ValueError as e:
                    return None, str(e)
                cur = pkt.mark if module == "mark" else pkt.ctmark
                return (TRUE if (cur & m) == v else FALSE), ""
            return None, f"{module} option {opt}"
        if module in ("conntrack", "state"):
            if opt in ("--ctstate", "--state"):
                states = {"NEW"} | ({"DNAT"} if pkt.orig_dst else set())
                return (TRUE if states & set(a[0].split(",")) else FALSE), ""
            if opt == "--ctdir":
                return (TRUE if a[0] == "ORIGINAL" else FALSE), ""
            if opt == "--ctorigdst":
                return _in_net(pkt.orig_dst or pkt.dst, a[0]), ""
            if opt == "--ctorigsrc":
                return (None, SRC_UNKNOWN) if not pkt.src_known else (_in_net(pkt.src, a[0]), "")
            if opt == "--ctproto":
                return (TRUE if a[0].lower() in (pkt.proto, _PROTO_NUM[pkt.proto]) else FALSE), ""
            if opt == "--ctorigdstport":
                return _port(a[0], pkt.orig_dport or pkt.dport)
            return None, f"conntrack option {opt}"
        if module == "statistic":
            return MAYBE, ""
        if module == "recent":
            if opt in ("--rcheck", "--update", "--remove"):
                return MAYBE, ""
            return TRUE, ""  # --set and the modifiers (--name, --seconds, ...) always pass
        if module == "limit":
            return TRUE, ""  # the first packet is within any limit
        if module == "hashlimit":
            return MAYBE, ""
        if module == "pkttype" and opt == "--pkt-type":
            return (TRUE if a[0] == "unicast" else FALSE), ""
        if module == "iprange" and opt in ("--src-range", "--dst-range"):
            if opt == "--src-range" and not pkt.src_known:
                return None, SRC_UNKNOWN
            at = ipaddress.ip_address(pkt.src if opt == "--src-range" else pkt.dst)
            lo, _, hi = a[0].partition("-")
            lo_a, hi_a = ipaddress.ip_address(lo), ipaddress.ip_address(hi or lo)
            ok = at.version == lo_a.version == hi_a.version and \
                lo_a <= at <= hi_a  # type: ignore[operator]  # (versions checked first)
            return (TRUE if ok else FALSE), ""
        if module == "ipvs" and opt == "--ipvs":
            return FALSE, ""  # a packet on the netfilter path we walk is not IPVS's
        if module == "comment":
            return TRUE, ""
        if module == "listing":
            return None, ("a rule whose match text in the `iptables -L` listing could not be "
                          "read (give iptables-save output)")
        return None, f"match '-m {module}' option {opt} is not supported"

    def _t_src_type(self, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
        if not pkt.src_known:
            return None, SRC_UNKNOWN
        t = self.view.addr_type(pkt.src)
        if t is None:
            return None, "addrtype --src-type: local addresses of the node unknown"
        return (TRUE if t in a[0].split(",") else FALSE), ""

    def _t_dst_type(self, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
        t = self.view.addr_type(pkt.dst)
        if t is None:
            return None, "addrtype --dst-type: local addresses of the node unknown"
        return (TRUE if t in a[0].split(",") else FALSE), ""

    def _t_match_set(self, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
        return self._set(a[0], a[1], pkt)

    def _set(self, name: str, flags: str, pkt: Packet) -> tuple[int | None, str]:
        if name in self._sets:
            got = self._sets[name]
        else:
            got = self._sets[name] = self.view.ipset_members(name)
        if got is None:
            return None, f"ipset {name} is not known on this node"
        settype, members = got
        key_of = _set_key(settype, flags)
        if key_of is not None:  # only addresses and ports: the key by one format
            template, fields_of, needs_src = key_of
            if needs_src and not pkt.src_known:
                return None, SRC_UNKNOWN
            key = template % fields_of(pkt)
            return (TRUE if key in members else FALSE), ""
        dims_dirs, multi = _set_plan(settype, flags)
        parts: list[str] = []
        nets: list[int] = []
        for dim, d in dims_dirs:
            if dim in ("ip", "net"):
                if d == "src" and not pkt.src_known:
                    return None, SRC_UNKNOWN
                parts.append(pkt.src if d == "src" else pkt.dst)
                if dim == "net":
                    nets.append(len(parts) - 1)
            elif dim == "port":
                port = pkt.sport if d == "src" else pkt.dport
                parts.append(f"{pkt.proto}:{port}" if multi else str(port))
            elif dim == "mac":
                return None, f"ipset {name} of type {settype} matches MAC addresses"
            else:
                return None, f"ipset {name}: dimension {dim!r} of {settype} not supported"
        if not nets:
            key = ",".join(parts)
            return (TRUE if key in members else FALSE), ""
        key_of_index = (name, tuple(nets), len(parts))
        index = self._net_indexes.get(key_of_index)
        if index is None:
            index = self._net_indexes[key_of_index] = _net_index(members, *key_of_index[1:])
        return (TRUE if _net_member(parts, nets, index) else FALSE), ""


@functools.lru_cache(maxsize=256)
def _set_plan(settype: str, flags: str) -> tuple[tuple[tuple[str, str], ...], bool]:
    """The (dimension, direction) pairs a `--match-set NAME FLAGS` compares for a set of
    ``settype``, and whether there are several (ports are then "proto:port")."""
    dims = settype.split(":", 1)[1].split(",") if ":" in settype else ["ip"]
    dirs = flags.split(",")
    if len(dirs) < len(dims):
        dims = dims[: len(dirs)]
    return tuple(zip(dims, dirs, strict=False)), len(dims) > 1


@functools.lru_cache(maxsize=256)
def _set_key(settype: str, flags: str
             ) -> tuple[str, Callable[[Packet], tuple[object, ...]], bool] | None:
    """For a set of addresses and ports only (no net, mac or other dimension): the
    %-template of the member a packet is looked up as (what _set's loop over _set_plan
    joins) with the function that takes the packet's fields it fills (by one C call: a
    str.format with keywords was a few percent of an IPVS-mode walk), and whether it
    names the source address; None for any other set."""
    dims_dirs, multi = _set_plan(settype, flags)
    parts, names = [], []
    for dim, d in dims_dirs:
        if dim == "ip":
            parts.append("%s")
            names.append("src" if d == "src" else "dst")
        elif dim == "port":
            parts.append("%s:%s" if multi else "%s")
            names += ["proto"] if multi else []
            names.append("sport" if d == "src" else "dport")
        else:
            return None
    if not names:
        return None
    # (attrgetter of one name gives the value, of several a tuple: always a tuple)
    fields_of = operator.attrgetter(*names) if len(names) > 1 else \
        (lambda pkt, get=operator.attrgetter(names[0]): (get(pkt),))
    return ",".join(parts), fields_of, any(dim == "ip" and d == "src" for dim, d in dims_dirs)


class _Nets:
    """The prefixes of one dimension of a hash:net-style set, by prefix length: a lookup
    masks the address once per length the set holds (at most 33 for IPv4, 129 for IPv6)
    instead of testing every member (a 100k-prefix blocklist took 0.5 s a lookup)."""

    __slots__ = ("bad", "by_len")

    def __init__(self) -> None:
        # (version, prefix length) -> network address as an integer -> a "nomatch" entry
        self.by_len: dict[tuple[int, int], dict[int, bool]] = {}
        self.bad: list[str] = []  # members that are no address or prefix: never matched

    def add(self, text: str, nomatch: bool) -> None:
        net = _net(text)
        if net is None:
            self.bad.append(text)
            return
        nets = self.by_len.setdefault((net.version, net.prefixlen), {})
        nets[int(net.network_address)] = nets.get(int(net.network_address), False) or nomatch

    def match(self, addr: str) -> tuple[bool, bool]:
        """(some prefix holds ``addr``, one of those is a "nomatch" entry)."""
        try:
            a = _addr(addr)
        except ValueError:
            return False, False
        value, bits = int(a), a.max_prefixlen
        hit = nomatch = False
        for (version, length), nets in self.by_len.items():
            if version != a.version:
                continue
            got = nets.get(value >> (bits - length) << (bits - length))
            if got is not None:
                hit = True
                nomatch = nomatch or got
        return hit, nomatch


def _net_member(parts: list[str], nets: list[int], index: _NetIndex) -> bool:
    """hash:net / hash:ip,port,net style: exact dimensions by lookup, prefix dimensions
    by containment; a matching "nomatch" entry wins (ipset's semantics)."""
    key = tuple(p for j, p in enumerate(parts) if j not in nets)
    got = index.get(key)
    if got is None:
        return False
    if isinstance(got, _Nets):  # one prefix dimension
        hit, nomatch = got.match(parts[nets[0]])
        return hit and not nomatch
    hit = False
    for net_fields, nomatch in got:
        if all(_in_net(parts[j], f) == TRUE for j, f in zip(nets, net_fields, strict=True)):
            if nomatch:
                return False
            hit = True
    return hit


_NetIndex = dict[tuple[str, ...], "_Nets | list[tuple[tuple[str, ...], bool]]"]


def _net_index(members: frozenset[str], nets: tuple[int, ...], n: int) -> _NetIndex:
    index: _NetIndex = {}
    for m in members:
        nomatch = m.endswith(" nomatch")
        fields = (m[:-8] if nomatch else m).split(",")
        if len(fields) != n:
            continue
        key = tuple(f for j, f in enumerate(fields) if j not in nets)
        if len(nets) == 1:
            one = index.get(key)
            if not isinstance(one, _Nets):
                one = index[key] = _Nets()
            one.add(fields[nets[0]], nomatch)
        else:
            many = index.setdefault(key, [])
            assert isinstance(many, list)
            many.append((tuple(fields[j] for j in nets), nomatch))
    return index


_PROTO_NUM = {"tcp": "6", "udp": "17", "sctp": "132", "icmp": "1"}


@functools.lru_cache(maxsize=65536)
def _net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return parse_net(text)
    except ValueError:
        return None


@functools.lru_cache(maxsize=65536)
def _addr(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def _in_net(addr: str, net_text: str) -> int | None:
    if "/" not in net_text or net_text.endswith("/32"):
        host = net_text[:-3] if net_text.endswith("/32") else net_text
        if "." in host and "." in addr and host.count(".") == 3:
            return TRUE if host == addr else FALSE
    return _in_prefix(addr, net_text)


@functools.lru_cache(maxsize=4096)
def _in_prefix(addr: str, net_text: str) -> int | None:
    """_in_net's answer by ``ipaddress`` (remembered: every LB IP's walk asks whether the
    same pod address is in the same cluster CIDR)."""
    net = _net(net_text)
    if net is None:
        return None
    a = _addr(addr)
    return TRUE if a.version == net.version and a in net else FALSE


_IPSET_UNKNOWN = re.compile(r"ipset (\S+) is not known")


def _assumption(why: str, line: str) -> Assumption:
    """The fact behind a reason in ASSUMABLE (``line``: the rule, for one no kind names)."""
    if why == SRC_UNKNOWN:
        return assumption.pod_source()
    if why.startswith("interface "):
        flag, pattern = why.removeprefix("interface ").split(":", 1)[0].split(" ", 1)
        return assumption.interface(flag, pattern)
    if why.startswith("addrtype --"):
        return assumption.addrtype()
    m = _IPSET_UNKNOWN.match(why)
    if m:
        return assumption.ipset(m.group(1))
    return assumption.match(f"{line}: {why}")


def _cni_step(cni: CniChain, chain: str, table: str, at: str, rtext: str, rsource: str,
              effect: str, forked: bool) -> Step:
    what = {"passes": "passes the packet on (no NAT for it)",
            "masquerades": "masquerades it to the node's address"}[effect]
    taken = "assumed" if not forked else "assumed (one of the answers its configuration " \
        "allows)"
    fact = assumption.cni_chain(chain, cni.cni, cni.shows, forked)
    return _new_step(Step, (table, at, f"{rtext}: {chain}, {taken}: {what}; {cni.does} "
                                       f"[{cni.source}] (not in the input: `{cni.shows}` "
                                       "shows it)", rsource, ASSUME, (fact,)))


def _cni_chain(cni: CniChain, chain: str, table: str, at: str, rtext: str, rsource: str,
               pkt: Packet, steps: tuple[Step, ...], can_fork: bool
               ) -> tuple[tuple[str, Packet, tuple[Step, ...], str] | None,
                          tuple[Step, ...] | None]:
    """What a known CNI chain the input lacks does to ``pkt``: (how the path ends there,
    if it does; the steps to go on with, where it passes the packet on). Where the CNI's
    configuration decides, both: it masquerades on one path and passes on the other."""
    effect = cni.effect(pkt.dst)
    forked = effect == "depends"
    passed = (*steps, _cni_step(cni, chain, table, at, rtext, rsource, "passes", forked))
    if effect == "passes":
        return None, passed
    if forked and not can_fork:
        return ("UNKNOWN", pkt, steps, f"what {cni.cni}'s {chain} does is not in the input "
                f"(`{cni.shows}` shows it), and the walk has no paths left to follow both "
                "answers"), None
    masq = (*steps, _cni_step(cni, chain, table, at, rtext, rsource, "masquerades", forked))
    return (("MASQUERADE", pkt._replace(snat="masquerade"), masq,
             f"MASQUERADE in {chain} (assumed: {cni.cni}'s)"), passed if forked else None)


def _unknown(r: ParsedRule, why: str) -> str:
    where = f" ({r.source})" if r.source else ""
    return f"cannot evaluate rule {r.text!r}{where}: {why}"


def _dnat(r: ParsedRule, pkt: Packet) -> Packet:
    if r.target == "REDIRECT":
        ports = r.target_opts.get("--to-ports", str(pkt.dport)).split("-")[0]
        return pkt._replace(orig_dst=pkt.dst, orig_dport=pkt.dport,
                            dst="::1" if ":" in pkt.dst else "127.0.0.1",
                            dport=int(ports) if is_number(ports) else pkt.dport)
    to = r.target_opts.get("--to-destination") or r.target_opts.get("--to") or pkt.dst
    host: str = to
    port: str | None = None
    if to.startswith("["):  # IPv6 "[addr]:port" (or "[addr]")
        host, _, rest = to[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif to.count(":") == 1:
        host, _, port = to.partition(":")
    host = host.split("-")[0].split("/")[0]
    dport = int(port.split("-")[0]) if port and is_number(port.split("-")[0]) else pkt.dport
    # positional construction: NamedTuple._replace costs more than the whole DNAT
    return _new_step(Packet, (pkt.src, host or pkt.dst, pkt.proto, pkt.sport, dport,
                              pkt.in_iface, pkt.out_iface, pkt.mark, pkt.ctmark, pkt.dst,
                              pkt.dport, *pkt[11:]))


def _mark(r: ParsedRule, pkt: Packet) -> tuple[Packet, str]:
    o = r.target_opts
    try:
        if "--set-xmark" in o:
            v, m = parse_mark(o["--set-xmark"])
            return _with_mark(pkt, (pkt.mark & ~m & 0xFFFFFFFF) ^ v), ""
        if "--set-mark" in o:
            v, m = parse_mark(o["--set-mark"])
            return pkt._replace(mark=(pkt.mark & ~m & 0xFFFFFFFF) | v), ""
        if "--or-mark" in o:
            return pkt._replace(mark=pkt.mark | int(o["--or-mark"], 0)), ""
        if "--and-mark" in o:
            return pkt._replace(mark=pkt.mark & int(o["--and-mark"], 0)), ""
        if "--xor-mark" in o:
            return pkt._replace(mark=pkt.mark ^ int(o["--xor-mark"], 0)), ""
    except ValueError as e:
        return pkt, f"bad mark value: {e}"
    return pkt, "MARK without --set-xmark/--set-mark/--or-mark/--and-mark/--xor-mark"


def _with_mark(pkt: Packet, mark: int) -> Packet:
    """``pkt._replace(mark=mark)``, positionally (kube-proxy's KUBE-MARK-MASQ on every
    masqueraded path)."""
    return _new_step(Packet, (*pkt[:7], mark, *pkt[8:]))


def _connmark(r: ParsedRule, pkt: Packet) -> tuple[Packet, str]:
    o = r.target_opts
    try:
        if "--set-xmark" in o or "--set-mark" in o:
            v, m = parse_mark(o.get("--set-xmark") or o["--set-mark"])
            return pkt._replace(ctmark=(pkt.ctmark & ~m & 0xFFFFFFFF) ^ v), ""
        nf = int(o.get("--nfmask", o.get("--mask", "0xffffffff")), 0)
        ct = int(o.get("--ctmask", o.get("--mask", "0xffffffff")), 0)
        # as xt_connmark computes them (XOR, not OR)
        if "--save-mark" in o:
            return pkt._replace(ctmark=(pkt.ctmark & ~ct & 0xFFFFFFFF) ^ (pkt.mark & nf)), ""
        if "--restore-mark" in o:
            return pkt._replace(mark=(pkt.mark & ~nf & 0xFFFFFFFF) ^ (pkt.ctmark & ct)), ""
    except ValueError as e:
        return pkt, f"bad connmark value: {e}"
    return pkt, "CONNMARK option not supported"


# a rule whose first match is on the source (kube-proxy's endpoint chains start with
# "-s ENDPOINT -j KUBE-MARK-MASQ", its service chains' cluster IP rule with "! -s
# CLUSTER-CIDR"): the tokens the parser would read, before any quote
def leading_src(text: str) -> tuple[bool, str] | None:
    """(negated, address) of a rule's leading `[!] -s ADDRESS`: what the regex
    ``-A [^\\s"]+ (! )?-s ([^\\s"]+) `` matches at its start, by string operations (the
    regex tested each character against Unicode's blanks: a few percent of a walk);
    None when it would not match."""
    at = text.find(" ", 3) + 1
    if text.startswith("-s ", at):
        negated, start = False, at + 3
    elif text.startswith("! -s ", at):
        negated, start = True, at + 5
    else:
        return None  # (the cheap test first: most rules do not start so)
    end = text.find(" ", start)
    if end <= start or not text.startswith("-A "):
        return None
    chain, address = text[3:at - 1], text[start:end]
    # [^\s"]+: one or more characters, none a quote or a blank of any kind
    if '"' in chain or '"' in address or chain.split() != [chain] or \
            address.split() != [address]:
        return None
    return negated, address


def _src_rules_out(text: str, pkt: Packet) -> bool:
    """Does the rule's first match, `[!] -s X`, fail for ``pkt``? Then the rule cannot
    match, whatever follows (the walk stops at the first match that fails): no need to
    parse it."""
    got = leading_src(text)
    if got is None:
        return False
    try:
        v = _t_src(None, (got[1],), pkt)[0]
    except (ValueError, TypeError, IndexError):
        return False
    return v == (TRUE if got[0] else FALSE)


# -- the matches nearly every rule has, without the general dispatch of TableWalker._cond
# (the same answers: _cond says what each one means) ---------------------------------

# (the walker, the match's arguments, the packet): plain functions and TableWalker's
# methods alike (bound methods kept in the walker would make a reference cycle, which
# holds a 10k-service table until the cyclic collector's next full pass)
Test = Callable[[TableWalker, tuple[str, ...], Packet], tuple[int | None, str]]


def _t_src(w: TableWalker | None, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
    if not pkt.src_known:
        return None, SRC_UNKNOWN
    return _in_net(pkt.src, a[0]), ""


def _t_dst(w: TableWalker | None, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
    return _in_net(pkt.dst, a[0]), ""


def _t_proto(w: TableWalker | None, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
    p = a[0]
    if p in ("all", "0"):
        return TRUE, ""
    return (TRUE if p in (pkt.proto, _PROTO_NUM.get(pkt.proto)) else FALSE), ""


def _t_dport(w: TableWalker | None, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
    return _port(a[0], pkt.dport)


def _port(spec: str, port: int) -> tuple[int | None, str]:
    got = port_in(spec, port)
    if got is None:
        return None, (f"port {spec[:40]!r} is not a port number (malformed, or a service "
                      "name this agent does not know)")
    return (TRUE if got else FALSE), ""


def _t_maybe(w: TableWalker | None, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
    return MAYBE, ""


def _t_mark(w: TableWalker | None, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
    try:
        v, m = parse_mark(a[0])
    except ValueError as e:
        return None, str(e)
    return (TRUE if (pkt.mark & m) == v else FALSE), ""


def _t_ctstate(w: TableWalker | None, a: tuple[str, ...], pkt: Packet) -> tuple[int | None, str]:
    return _ctstate(a[0], bool(pkt.orig_dst)), ""


@functools.lru_cache(maxsize=256)
def _ctstate(listed: str, dnat: bool) -> int:
    """Does `--ctstate LISTED` hold for the walked packet: a new connection, DNATed or
    not? (A handful of lists, asked on every path through FORWARD and INPUT.)"""
    states = {"NEW"} | ({"DNAT"} if dnat else set())
    return TRUE if states & set(listed.split(",")) else FALSE


_TESTS: dict[str, Test] = {
    "src": _t_src, "dst": _t_dst, "proto": _t_proto,
    **{f"{proto}--{opt}": _t_dport for proto in ("tcp", "udp", "sctp")
       for opt in ("dport", "destination-port")},
    **{f"statistic--{opt}": _t_maybe for opt in ("mode", "probability", "every", "packet")},
    "mark--mark": _t_mark,
    **{f"{module}--{opt}": _t_ctstate for module in ("conntrack", "state")
       for opt in ("ctstate", "state")},
}
# the tests _run looks up by a condition's kind, with those that ask the walker's view
_WALKER_TESTS: dict[str, Test] = {**_TESTS, "addrtype--src-type": TableWalker._t_src_type,
                                  "addrtype--dst-type": TableWalker._t_dst_type,
                                  "set--match-set": TableWalker._t_match_set}
