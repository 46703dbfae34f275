"""Walk one concrete packet through iptables chains, rule by rule.

The walker knows iptables semantics (matches, jumps, gotos, RETURN, marks, NAT targets),
nothing about Kubernetes. Node facts it needs (is an address local? ipset members)
come from a :class:`NodeView`. Where a match cannot be decided from the saved state
(``statistic``, ``recent``) the walk forks and follows both branches; where a match or
target is not understood the branch ends as ``UNKNOWN`` naming the rule.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from agent.netfilter.rules import (
    BUILTIN_TARGETS,
    PASSIVE_TARGETS,
    Cond,
    ParsedRule,
    parse_mark,
    parse_net,
    parse_rule,
    port_in,
)
from agent.snapshot import Chain, Rule, Table

TRUE, FALSE, MAYBE = 1, 0, 2
ASSUME = "assume"  # the action of a Step that records an assumed answer
# reasons a match cannot be decided that name a fact of the node the input lacks
ASSUMABLE = ("addrtype --", "ipset ", "source address")
# why a source match cannot be decided when the pod's own address is not known
SRC_UNKNOWN = ("source address: the pods' addresses on this node are not in the input "
               "(their CIDR decides it)")
MAX_DEPTH = 64
MAX_PATHS = 32


class NodeView(Protocol):
    """What the walker asks about the node."""

    def addr_type(self, addr: str) -> str | None:
        """"LOCAL" | "BROADCAST" | "MULTICAST" | "UNICAST"; None when unknown."""

    def ipset_members(self, name: str) -> tuple[str, frozenset[str]] | None:
        """(set type, members) or None when the set is unknown."""


class Packet(NamedTuple):
    """The packet being walked (a transient value: NamedTuple for cheap copies)."""

    src: str
    dst: str
    proto: str = "tcp"
    sport: int = 45678
    dport: int = 80
    in_iface: str | None = None
    out_iface: str | None = None
    mark: int = 0
    ctmark: int = 0
    orig_dst: str | None = None  # set once DNAT happened
    orig_dport: int | None = None
    src_known: bool = True  # False: src stands for a pod whose address is not known

    def describe(self) -> str:
        src = self.src if self.src_known else "(a pod of this node)"
        s = f"{self.proto} {src}:{self.sport} -> {self.dst}:{self.dport}"
        if self.in_iface:
            s += f" in {self.in_iface}"
        if self.out_iface:
            s += f" out {self.out_iface}"
        if self.mark:
            s += f" mark {self.mark:#x}"
        return s


class Step(NamedTuple):
    """One rule that matched and acted on the packet (evidence)."""

    table: str
    chain: str
    text: str
    source: str
    action: str

    def render(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"{self.table} {self.chain}: {self.text}{where}"


@dataclass(frozen=True)
class HookResult:
    """How one path through a hook ended."""

    verdict: str  # ACCEPT DROP REJECT DNAT SNAT MASQUERADE REDIRECT UNKNOWN
    packet: Packet
    steps: tuple[Step, ...]
    detail: str = ""

    @property
    def assumed(self) -> tuple[str, ...]:
        """The facts this path assumed (a match the input could not decide)."""
        return tuple(s.text for s in self.steps if s.action == ASSUME)


_DST_RE = re.compile(r"(?<!! )-d (\d+\.\d+\.\d+\.\d+)(?:/32)?(?=\s)")
_DPORT_RE = re.compile(r"(?<!! )--dport (\d+)(?=\s)")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


class _ChainIndex:
    """Rules of one chain, indexed by exact destination address, else by exact destination
    port, so a 30k-rule KUBE-SERVICES or KUBE-NODEPORTS costs a dict lookup per packet
    rather than a scan. A rule with neither is a candidate for every packet."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.rules: tuple[Rule, ...] = chain.rules
        self.parsed: list[ParsedRule | None] = [None] * len(chain.rules)
        self.by_dst: dict[str, list[int]] = {}
        self.by_dport: dict[int, list[int]] = {}
        if len(chain.rules) <= 16:  # a scan is cheaper than the regexes
            self.generic = list(range(len(chain.rules)))
            return
        self.generic = []
        for i, r in enumerate(chain.rules):
            # -d / --dport inside a quoted comment must not index the rule
            text = _QUOTED.sub('""', r.text) if '"' in r.text else r.text
            m = _DST_RE.search(text)
            if m:
                self.by_dst.setdefault(m.group(1), []).append(i)
                continue
            m = _DPORT_RE.search(text)
            if m:
                self.by_dport.setdefault(int(m.group(1)), []).append(i)
            else:
                self.generic.append(i)

    def candidates(self, dst: str, dport: int) -> list[int]:
        a = self.by_dst.get(dst)
        b = self.by_dport.get(dport)
        if not a and not b:
            return self.generic
        return sorted(self.generic + (a or []) + (b or []))

    def rule(self, i: int) -> ParsedRule:
        p = self.parsed[i]
        if p is None:
            p = self.parsed[i] = parse_rule(self.rules[i])
        return p


class TableWalker:
    def __init__(self, table: Table, view: NodeView, partial: bool = False) -> None:
        self.table = table
        self.view = view
        self.partial = partial  # an excerpt: a missing chain is unseen, not empty
        self._idx: dict[str, _ChainIndex] = {}
        self._budget = MAX_PATHS

    def _index(self, name: str) -> _ChainIndex | None:
        ix = self._idx.get(name)
        if ix is None:
            chain = self.table.chain(name)
            if chain is None:
                return None
            ix = self._idx[name] = _ChainIndex(chain)
        return ix

    def walk(self, chain: str, pkt: Packet) -> list[HookResult]:
        """All paths of ``pkt`` through built-in ``chain``; a fall-through takes the policy."""
        self._budget = MAX_PATHS
        ix = self._index(chain)
        if ix is None and self.partial:
            return [HookResult("UNKNOWN", pkt, (), f"{self.table.name} {chain} is not in the "
                               f"input (an excerpt): `iptables -t {self.table.name} -S` "
                               "shows it")]
        if ix is None:
            return [HookResult("ACCEPT", pkt, (), f"{self.table.name} {chain}: no such chain "
                               "(nothing hooked here)")]
        out = []
        for verdict, p, steps, detail in self._run(ix, 0, pkt, (), 0):
            if verdict is None:
                policy = ix.chain.policy or "ACCEPT"
                steps = (*steps, Step(self.table.name, chain, f"policy {policy}", "", policy))
                out.append(HookResult(policy, p, steps, f"end of {chain}: policy {policy}"))
            else:
                out.append(HookResult(verdict, p, steps, detail))
        return out

    # -- traversal -------------------------------------------------------------------

    def _run(self, ix: _ChainIndex, start: int, pkt: Packet, steps: tuple[Step, ...],
             depth: int) -> list[tuple[str | None, Packet, tuple[Step, ...], str]]:
        if depth > MAX_DEPTH:
            return [("UNKNOWN", pkt, steps, f"more than {MAX_DEPTH} nested jumps "
                     f"(a loop through {ix.chain.name}?)")]
        results: list[tuple[str | None, Packet, tuple[Step, ...], str]] = []
        cands = ix.candidates(pkt.dst, pkt.dport)
        # start is an index into the chain; skip candidates before it
        for i in cands:
            if i < start:
                continue
            r = ix.rule(i)
            m, why = self._match(r, pkt)
            if r.problem and m != FALSE:
                results.append(("UNKNOWN", pkt, steps, _unknown(r, r.problem)))
                return results
            if m == FALSE:
                continue
            if m is None and why.startswith(ASSUMABLE) and self._budget > 0:
                # a fact of the node we were not given (its addresses, a set's members):
                # follow both answers; the caller decides whether they agree
                self._budget -= 1
                where = f" ({r.source})" if r.source else ""
                no = Step(self.table.name, ix.chain.name,
                          f"assumed NOT matching: {r.text}{where}: {why}", r.source, ASSUME)
                results.extend(self._run(ix, i + 1, pkt, (*steps, no), depth))
                steps = (*steps, Step(self.table.name, ix.chain.name,
                                      f"assumed matching: {r.text}{where}: {why}", r.source,
                                      ASSUME))
                m = TRUE
            if m is None:
                results.append(("UNKNOWN", pkt, steps, _unknown(r, why)))
                return results
            if m == MAYBE:
                if self._budget > 0:
                    self._budget -= 1
                    results.extend(self._run(ix, i + 1, pkt, steps, depth))
                else:
                    # never drop a branch silently: the one not followed is unknown
                    results.append(("UNKNOWN", pkt, steps, _unknown(
                        r, f"more than {MAX_PATHS} random/recent branches: the branch where "
                           "this rule does not match was not followed")))
            tgt = r.target
            if tgt is None:
                continue
            step = Step(self.table.name, ix.chain.name, r.text, r.source, tgt)
            if tgt in ("ACCEPT", "DROP", "REJECT"):
                results.append((tgt, pkt, (*steps, step), f"{tgt} in {ix.chain.name}"))
                return results
            if tgt == "RETURN":
                results.append((None, pkt, (*steps, step), ""))
                return results
            if tgt in ("DNAT", "REDIRECT") or (tgt == "NETMAP" and pkt.out_iface is None):
                try:
                    new = _dnat(r, pkt)
                except ValueError as e:
                    results.append(("UNKNOWN", pkt, steps, _unknown(r, f"bad NAT target: {e}")))
                    return results
                results.append((tgt if tgt != "NETMAP" else "DNAT", new, (*steps, step),
                                f"{tgt} to {new.dst}:{new.dport}"))
                return results
            if tgt in ("SNAT", "MASQUERADE", "NETMAP"):
                results.append((tgt if tgt != "NETMAP" else "SNAT", pkt, (*steps, step),
                                f"{tgt} {r.target_opts.get('--to-source', '')}".strip()))
                return results
            if tgt == "MARK":
                new_pkt, err = _mark(r, pkt)
                if err:
                    results.append(("UNKNOWN", pkt, steps, _unknown(r, err)))
                    return results
                pkt = new_pkt
                steps = (*steps, step._replace(action=f"mark {pkt.mark:#x}"))
                continue
            if tgt == "CONNMARK":
                new_pkt, err = _connmark(r, pkt)
                if err:
                    results.append(("UNKNOWN", pkt, steps, _unknown(r, err)))
                    return results
                pkt = new_pkt
                continue
            if tgt in PASSIVE_TARGETS:
                continue
            if tgt in ("QUEUE", "NFQUEUE"):
                results.append(("UNKNOWN", pkt, steps,
                                 _unknown(r, f"target {tgt} hands the packet to user space")))
                return results
            sub = self._index(tgt)
            if sub is None:
                if tgt in BUILTIN_TARGETS:
                    continue
                results.append(("UNKNOWN", pkt, steps, _unknown(
                    r, f"target {tgt} is neither a chain of table {self.table.name} "
                       "nor a target this walker knows" + (
                           f" (not in the input: `iptables -t {self.table.name} -S {tgt}` "
                           "shows it)" if self.partial else ""))))
                return results
            for verdict, p2, s2, d2 in self._run(sub, 0, pkt, (*steps, step), depth + 1):
                if verdict is not None:
                    results.append((verdict, p2, s2, d2))
                elif r.goto:
                    results.append((None, p2, s2, d2))
                else:
                    results.extend(self._run(ix, i + 1, p2, s2, depth))
            return results
        results.append((None, pkt, steps, ""))
        return results

    # -- matching ----------------------------------------------------------------------

    def _match(self, r: ParsedRule, pkt: Packet) -> tuple[int | None, str]:
        """TRUE / FALSE / MAYBE, or None with the reason when it cannot be decided."""
        result: int | None = TRUE
        why = ""
        for c in r.conds:
            try:
                v, reason = self._cond(c, pkt)
            except (ValueError, TypeError, IndexError) as e:  # a malformed value in the rule
                v, reason = None, f"cannot read {c[0]} {' '.join(c[2])!r}: {e}"
            if v is not None and c[1] and v != MAYBE:
                v = TRUE if v == FALSE else FALSE
            if v == FALSE:
                return FALSE, ""
            if v is None and result is not None:
                result, why = None, reason
            elif v == MAYBE and result == TRUE:
                result = MAYBE
        return result, why

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
                return None, f"{'-i' if k == 'in' else '-o'} {a[0]}: interface not known here"
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
                return (TRUE if port_in(a[0], pkt.dport) else FALSE), ""
            if opt in ("--sport", "--source-port"):
                return (TRUE if port_in(a[0], pkt.sport) else FALSE), ""
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
                return (TRUE if port_in(a[0], pkt.dport) else FALSE), ""
            if opt in ("--sports", "--source-ports"):
                return (TRUE if port_in(a[0], pkt.sport) else FALSE), ""
            if opt == "--ports":
                ok = port_in(a[0], pkt.dport) or port_in(a[0], pkt.sport)
                return (TRUE if ok else FALSE), ""
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
                v, m = parse_mark(a[0])
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
                return (TRUE if port_in(a[0], pkt.orig_dport or pkt.dport) else FALSE), ""
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
            addr = ipaddress.ip_address(pkt.src if opt == "--src-range" else pkt.dst)
            lo, _, hi = a[0].partition("-")
            lo_a, hi_a = ipaddress.ip_address(lo), ipaddress.ip_address(hi or lo)
            ok = addr.version == lo_a.version == hi_a.version and lo_a <= addr <= hi_a
            return (TRUE if ok else FALSE), ""
        if module == "ipvs" and opt == "--ipvs":
            return FALSE, ""  # a packet on the netfilter path we walk is not IPVS's
        if module == "comment":
            return TRUE, ""
        if module == "listing":
            return None, ("a rule whose match text in the `iptables -L` listing could not be "
                          "read (give iptables-save output)")
        return None, f"match '-m {module}' option {opt} is not supported"

    def _set(self, name: str, flags: str, pkt: Packet) -> tuple[int | None, str]:
        got = self.view.ipset_members(name)
        if got is None:
            return None, f"ipset {name} is not known on this node"
        settype, members = got
        dims = settype.split(":", 1)[1].split(",") if ":" in settype else ["ip"]
        dirs = flags.split(",")
        if len(dirs) < len(dims):
            dims = dims[: len(dirs)]
        parts: list[str] = []
        nets: list[int] = []
        for dim, d in zip(dims, dirs, strict=False):
            if dim in ("ip", "net"):
                if d == "src" and not pkt.src_known:
                    return None, SRC_UNKNOWN
                parts.append(pkt.src if d == "src" else pkt.dst)
                if dim == "net":
                    nets.append(len(parts) - 1)
            elif dim == "port":
                port = pkt.sport if d == "src" else pkt.dport
                parts.append(f"{pkt.proto}:{port}" if len(dims) > 1 else str(port))
            elif dim == "mac":
                return None, f"ipset {name} of type {settype} matches MAC addresses"
            else:
                return None, f"ipset {name}: dimension {dim!r} of {settype} not supported"
        if not nets:
            key = ",".join(parts)
            return (TRUE if key in members else FALSE), ""
        index = _net_index(members, tuple(nets), len(parts))
        return (TRUE if _net_member(parts, nets, index) else FALSE), ""


def _net_member(parts: list[str], nets: list[int],
                index: dict[tuple[str, ...], list[tuple[tuple[str, ...], bool]]]) -> bool:
    """hash:net / hash:ip,port,net style: exact dimensions by lookup, prefix dimensions
    by containment; a matching "nomatch" entry wins (ipset's semantics)."""
    key = tuple(p for j, p in enumerate(parts) if j not in nets)
    hit = False
    for net_fields, nomatch in index.get(key, ()):
        if all(_in_net(parts[j], f) == TRUE for j, f in zip(nets, net_fields, strict=True)):
            if nomatch:
                return False
            hit = True
    return hit


@functools.lru_cache(maxsize=64)
def _net_index(members: frozenset[str], nets: tuple[int, ...], n: int
               ) -> dict[tuple[str, ...], list[tuple[tuple[str, ...], bool]]]:
    index: dict[tuple[str, ...], list[tuple[tuple[str, ...], bool]]] = {}
    for m in members:
        nomatch = m.endswith(" nomatch")
        fields = (m[:-8] if nomatch else m).split(",")
        if len(fields) != n:
            continue
        key = tuple(f for j, f in enumerate(fields) if j not in nets)
        index.setdefault(key, []).append((tuple(fields[j] for j in nets), nomatch))
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
    net = _net(net_text)
    if net is None:
        return None
    a = _addr(addr)
    return TRUE if a.version == net.version and a in net else FALSE


def _unknown(r: ParsedRule, why: str) -> str:
    where = f" ({r.source})" if r.source else ""
    return f"cannot evaluate rule {r.text!r}{where}: {why}"


def _dnat(r: ParsedRule, pkt: Packet) -> Packet:
    if r.target == "REDIRECT":
        port = r.target_opts.get("--to-ports", str(pkt.dport)).split("-")[0]
        return pkt._replace(orig_dst=pkt.dst, orig_dport=pkt.dport, dst="127.0.0.1",
                       dport=int(port) if port.isdigit() else pkt.dport)
    to = r.target_opts.get("--to-destination") or r.target_opts.get("--to") or pkt.dst
    host, port = to, None
    if to.count(":") == 1:
        host, port = to.split(":")
    host = host.split("-")[0].split("/")[0]
    dport = int(port.split("-")[0]) if port and port.split("-")[0].isdigit() else pkt.dport
    # positional construction: NamedTuple._replace costs more than the whole DNAT
    return Packet(pkt.src, host or pkt.dst, pkt.proto, pkt.sport, dport, pkt.in_iface,
                  pkt.out_iface, pkt.mark, pkt.ctmark, pkt.dst, pkt.dport, pkt.src_known)


def _mark(r: ParsedRule, pkt: Packet) -> tuple[Packet, str]:
    o = r.target_opts
    try:
        if "--set-xmark" in o:
            v, m = parse_mark(o["--set-xmark"])
            return pkt._replace(mark=(pkt.mark & ~m & 0xFFFFFFFF) ^ v), ""
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
