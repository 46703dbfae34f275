"""Read nftables text into the model: `nft list ruleset`, `nft list table ip kube-proxy`
(blocks), and `nft -f` scripts of `add table/chain/set/map/rule/element` commands (what
kube-proxy's knftables writes, and what its tests print). Recognised by content.

Hostile input: every line and token count is bounded; a line that cannot be read is
reported with its file and line and skipped (the chain it was in becomes partial), never
guessed at.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from agent.netfilter.nft_model import (
    MAX_ELEMENTS,
    MAX_LINES,
    MAX_TOKENS_PER_RULE,
    Element,
    NftChain,
    NftError,
    NftRule,
    NftRuleset,
    NftSet,
    NftTable,
    Token,
    parse_priority,
)

_FAMILIES = frozenset({"ip", "ip6", "inet", "arp", "bridge", "netdev"})
# a line that starts nft text: a table block or a command of an nft -f script
_START = re.compile(r"^\s*(?:table\s+(?:ip6?|inet|arp|bridge|netdev)\s+\S+\s*\{"
                    r"|(?:add|create|insert)\s+(?:table|chain|rule|set|map|element)\s+"
                    r"(?:ip6?|inet|arp|bridge|netdev)\s)")
# a block of kube-proxy's table pasted without its `table ip kube-proxy {` line (people
# paste the one map or chain they mean, as `nft list map ip kube-proxy X` prints it too):
# recognised by kube-proxy's own names only, so no other table's block is taken for it
_KP_NAMES = (r"service-ips|service-nodeports|no-endpoint-services|no-endpoint-nodeports|"
             r"firewall-ips|firewall|cluster-ips|nodeport-ips|services|masquerading|"
             r"mark-for-masquerade|nat-(?:prerouting|output|postrouting)|filter-[a-z-]+|"
             r"(?:service-|nodeport-)?endpoints-check|firewall-check|cluster-ips-check|"
             r"reject-chain|(?:service|external|firewall|endpoint)-[A-Z0-9]{8}-\S+")
_HEADLESS = re.compile(rf"^\s*(?:chain|map|set)\s+(?:{_KP_NAMES})\s*\{{\s*$")
_PROBLEMS_KEPT = 50
# a line outside blocks that goes on with nft text (after a block has ended)
_COMMAND = re.compile(r"^(?:add|create|insert|flush|delete|table)\s")


def _starts(line: str) -> bool:
    return bool(_START.match(line) or _HEADLESS.match(line))


def looks_like_nft(text: str) -> bool:
    """Does this text hold nft ruleset text (a table block, an nft -f command, or a block
    of kube-proxy's table without its table line)?"""
    for n, line in enumerate(text[:1_000_000].splitlines()):
        if n > 200:
            return False
        if _starts(line):
            return True
    return False


def _headless_family(text: str) -> str:
    """The family of kube-proxy's table a headless block belongs to: ip6 when its keys
    and matches are IPv6 ones only."""
    head = text[:1_000_000]
    v6 = re.search(r"\bipv6_addr\b|\bip6 [sd]addr\b", head)
    v4 = re.search(r"\bipv4_addr\b|\bip [sd]addr\b", head)
    return "ip6" if v6 and not v4 else "ip"


_TOKEN = re.compile(r'"[^"]*"|"|[{};,]|#.*|[^\s{};,"]+')
_SPECIAL = re.compile(r'[{};,"#]')  # what makes a token of its own in _TOKEN
_intern = sys.intern
# the lines whose '{' opens a block, not a statement continued over lines
_BLOCK_HEAD = re.compile(r"^(?:table|chain|set|map|flowtable|ct\s+\w+|counter|quota|limit)\s")
_TABLE_HEAD = re.compile(r"^table\s+(\S+)\s+(\S+)\s*\{$")
_TABLE_WORD = re.compile(r"^table\s")
_MANY_TOKENS = re.compile(r"^(?:add|create|insert)\s+(?:element|set|map)\s")


# an element list is one statement: bounded by the element count (each element a few
# tokens: key parts, dots, ':' and a verdict, a comment), not by a rule's bound
_ELEMENT_TOKENS = 16 * MAX_ELEMENTS


def _words(text: str, source: str, line: int | None, limit: int) -> tuple[str, ...] | None:
    """Words only (most rules of a 10k-service listing): the tokens tokenize's pattern
    would give, one after another (ASCII: both split at the same blanks); None for text
    with a brace, quote, ',', ';' or '#'. Interned: kube-proxy's words and chain names
    repeat in every service's rules (a third of a 10k-service model was copies of them)."""
    if not text.isascii() or _SPECIAL.search(text):
        return None
    words = tuple(map(_intern, text.split()))
    if len(words) > limit:
        raise NftError(source, line, f"more than {limit} tokens in a "
                       + ("rule" if limit == MAX_TOKENS_PER_RULE else "statement"))
    return words


def rule_tokens(text: str, source: str, line: int) -> tuple[tuple[Token, ...], str]:
    """A rule's tokens and its text as render() writes them."""
    words = _words(text, source, line, MAX_TOKENS_PER_RULE)
    if words is None:
        toks = tokenize(text, source, line)
        return toks, render(toks)
    return words, " ".join(words)  # (render's text of words)


def tokenize(text: str, source: str = "", line: int | None = None,
             limit: int = MAX_TOKENS_PER_RULE) -> tuple[Token, ...]:
    """Words, quoted strings (kept quoted), ';' ',' as tokens, brace groups as nested
    tuples; '#' at a word's start begins a comment (`# handle 5` after `nft -a`)."""
    words = _words(text, source, line, limit)
    if words is not None:
        return words
    stack: list[list[Token]] = [[]]
    # a line's tokens at once (strings, not match objects); a long statement's one at a
    # time, so a hostile one stops at the bound without all its tokens made
    tokens: Iterable[str] = _TOKEN.findall(text) if len(text) < 65536 else \
        (m.group() for m in _TOKEN.finditer(text))
    for count, tok in enumerate(tokens, 1):
        if count > limit:
            raise NftError(source, line, f"more than {limit} tokens in a "
                           + ("rule" if limit == MAX_TOKENS_PER_RULE else "statement"))
        c = tok[0]
        if c == "#":
            break
        if tok == '"':
            raise NftError(source, line, "unterminated quoted string")
        if c == "{":
            if len(stack) > 16:
                raise NftError(source, line, "braces nested too deep")
            stack.append([])
        elif c == "}":
            if len(stack) == 1:
                raise NftError(source, line, "'}' without '{'")
            group = tuple(stack.pop())
            stack[-1].append(group)
        else:
            stack[-1].append(_intern(tok))
    if len(stack) != 1:
        raise NftError(source, line, "'{' without '}'")
    return tuple(stack[0])


def element_group(text: str) -> tuple[Token, ...] | None:
    """The brace group of an `elements = { ... }` statement, the tokens tokenize would
    give it, for the shape nft lists (words, ',' and ':', quoted comments standing
    apart): split at blanks, not matched token by token (a 10k-service map is one
    statement of 100k tokens). None for any other shape: tokenize reads it."""
    first = text.find("{")
    last = text.rfind("}")
    if first < 0 or last < first or len(text) > _ELEMENT_TOKENS or not text.isascii() \
            or text[:first].split() != ["elements", "="] or text[last + 1:].strip():
        return None
    inner = text[first + 1:last]
    if "{" in inner or "}" in inner or "#" in inner or ";" in inner:
        return None
    pieces = inner.split('"')
    if len(pieces) % 2 == 0:
        return None  # an unterminated quote: tokenize says so
    out: list[Token] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            # a quoted string: a token of its own only where blanks or a ',' part it from
            # its neighbours, as nft writes a comment
            before, after = pieces[k - 1], pieces[k + 1]
            if not (before[-1:].isspace() or before[-1:] == ",") or \
                    not (after[:1].isspace() or after[:1] in ("", ",")):
                return None
            out.append(_intern(f'"{piece}"'))
        elif piece:
            out += map(_intern, piece.replace(",", " , ").split())
    return tuple(out)


def render(tokens: tuple[Token, ...]) -> str:
    if tuple not in map(type, tokens):  # words only: no group to open
        # (which the checker cannot see; a cast would cost a call per rule read)
        text = " ".join(tokens)  # type: ignore[arg-type]
        return text.replace(" ,", ",").replace(" ;", ";") if "," in text or ";" in text \
            else text
    out: list[str] = []
    for t in tokens:
        if isinstance(t, tuple):
            out.append("{ " + render(t) + " }")
        else:
            out.append(t)
    return " ".join(out).replace(" ,", ",").replace(" ;", ";")


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] == '"' else s


@dataclass
class _Chain:
    name: str
    type: str | None = None
    hook: str | None = None
    priority: int | None = None
    policy: str = "accept"
    rules: list[NftRule] = field(default_factory=list)


@dataclass
class _Set:
    name: str
    is_map: bool
    key_type: str = ""
    elements: list[Element] = field(default_factory=list)
    comments: list[str | None] = field(default_factory=list)
    dynamic: bool = False
    source: str = ""


@dataclass
class _Table:
    family: str
    name: str
    chains: dict[str, _Chain] = field(default_factory=dict)
    sets: dict[str, _Set] = field(default_factory=dict)


class _Builder:
    def __init__(self, source: str) -> None:
        self.source = source
        self.tables: dict[tuple[str, str], _Table] = {}
        self.problems: list[str] = []
        self.elements = 0

    def table(self, family: str, name: str) -> _Table:
        name = _unquote(name)
        t = self.tables.get((family, name))
        if t is None:
            t = self.tables[(family, name)] = _Table(family, name)
        return t

    def chain(self, t: _Table, name: str) -> _Chain:
        name = _unquote(name)
        c = t.chains.get(name)
        if c is None:
            c = t.chains[name] = _Chain(name)
        return c

    def problem(self, line: int | None, why: str) -> None:
        if len(self.problems) < _PROBLEMS_KEPT:
            self.problems.append(f"{self.source}:{line}: {why}" if line else
                                 f"{self.source}: {why}")

    def add_elements(self, s: _Set, group: tuple[Token, ...], line: int) -> None:
        for key, value, comment in split_elements(group):
            self.elements += 1
            if self.elements > MAX_ELEMENTS:
                raise NftError(self.source, line, f"more than {MAX_ELEMENTS} set elements")
            s.elements.append((key, value))
            s.comments.append(comment)

    def ruleset(self) -> NftRuleset:
        tables = []
        for t in self.tables.values():
            chains = tuple(NftChain(c.name, c.type, c.hook, c.priority, c.policy,
                                    tuple(c.rules)) for c in t.chains.values())
            sets = tuple(NftSet(s.name, s.is_map, s.key_type,
                                proto_names(s.key_type, tuple(s.elements)),
                                tuple(s.comments), s.dynamic, s.source)
                         for s in t.sets.values())
            tables.append(NftTable(t.family, t.name, chains, sets))
        return NftRuleset(tuple(tables), self.source, tuple(self.problems))


# `nft -n` prints an inet_proto as its number
PROTO_NAMES = {"6": "tcp", "17": "udp", "132": "sctp", "1": "icmp", "58": "ipv6-icmp"}


def proto_names(key_type: str, elements: tuple[Element, ...]) -> tuple[Element, ...]:
    """Elements with numeric protocols named ("1.2.3.4 . 6 . 80" as `nft -n` lists it is
    "1.2.3.4 . tcp . 80"), so keys compare with a packet's protocol."""
    kinds = [k.strip() for k in key_type.split(" . ")]
    protos = [i for i, k in enumerate(kinds) if k in ("inet_proto", "meta l4proto",
                                                      "ip protocol")]
    if not protos or not any(p[i].isdigit() for p, _ in elements for i in protos
                             if i < len(p)):
        return elements
    return tuple((tuple(PROTO_NAMES.get(x, x) if i in protos else x
                        for i, x in enumerate(parts)), v) for parts, v in elements)


def split_elements(group: tuple[Token, ...]
                   ) -> list[tuple[tuple[str, ...], str | None, str | None]]:
    """The elements of `{ a . b : verdict, ... }` as (key parts, value, comment)."""
    out: list[tuple[tuple[str, ...], str | None, str | None]] = []
    current: list[Token] = []
    for tok in (*group, ","):
        if tok != ",":
            current.append(tok)
            continue
        if not current:
            continue
        comment: str | None = None
        key: list[Token] = []
        value: list[Token] | None = None
        i = 0
        while i < len(current):
            tok2 = current[i]
            if tok2 == "comment" and i + 1 < len(current):
                said = current[i + 1]
                # (a brace group is no comment nft writes: kept as written, a string)
                comment = _unquote(said) if isinstance(said, str) else \
                    "{ " + render(said) + " }"
                i += 2
                continue
            if tok2 in ("timeout", "expires") and i + 1 < len(current):
                i += 2
                continue
            if tok2 == "counter" and value is None:
                # a `counter` set's element: "10.0.0.1 counter packets 0 bytes 0"
                i += 1
                while i + 1 < len(current) and current[i] in ("packets", "bytes"):
                    i += 2
                continue
            if tok2 == ":" and value is None:
                value = []
            elif value is not None:
                value.append(tok2)
            else:
                key.append(tok2)
            i += 1
        parts = tuple(" ".join(p) for p in _split_dots(key))
        out.append((parts, render(tuple(value)) if value is not None else None, comment))
        current = []
    return out


def _split_dots(tokens: list[Token]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for t in tokens:
        if t == ".":
            parts.append([])
        elif isinstance(t, tuple):
            parts[-1].append("{ " + render(t) + " }")
        else:
            parts[-1].append(t)
    return [p for p in parts if p]


def _set_header(s: _Set, tokens: tuple[Token, ...]) -> None:
    """`type a . b : verdict ; flags dynamic,timeout ; ...` (in a block or a command)."""
    words = [t for t in tokens if isinstance(t, str)]
    stmt: list[str] = []
    for w in (*words, ";"):
        if w != ";":
            stmt.append(w)
            continue
        if stmt and stmt[0] == "type":
            key = " ".join(stmt[1:]).split(" : ", 1)[0]
            s.key_type = key
        elif stmt and stmt[0] == "typeof":
            s.key_type = " ".join(stmt[1:]).split(" : ", 1)[0]
        elif stmt and stmt[0] == "flags" and ("dynamic" in " ".join(stmt[1:])
                                              or "timeout" in " ".join(stmt[1:])):
            s.dynamic = True
        stmt = []


def _one_line_chain(c: _Chain, group: tuple[Token, ...], source: str, line: int) -> None:
    """A chain written on one line (config files, not `nft list`): its header statements
    and its rules, ';'-separated."""
    _chain_header(c, group, source, line)
    stmt: list[Token] = []
    for tok in (*group, ";"):
        if tok != ";":
            stmt.append(tok)
            continue
        if stmt and stmt[0] not in ("type", "policy", "comment", "devices", "device"):
            c.rules.append(NftRule(tuple(stmt), render(tuple(stmt)), f"{source}:{line}"))
        stmt = []


def _chain_header(c: _Chain, tokens: tuple[Token, ...], source: str, line: int) -> None:
    """`type nat hook prerouting priority dstnat ; policy accept ;`"""
    words = [t for t in tokens if isinstance(t, str)]
    stmt: list[str] = []
    for w in (*words, ";"):
        if w != ";":
            stmt.append(w)
            continue
        if stmt and stmt[0] == "type" and len(stmt) >= 4 and stmt[2] == "hook":
            c.type, c.hook = stmt[1], stmt[3]
            if "priority" in stmt:
                k = stmt.index("priority")
                prio = parse_priority(" ".join(stmt[k + 1:]))
                if prio is None:
                    raise NftError(source, line, f"unreadable priority {' '.join(stmt[k + 1:])!r}")
                c.priority = prio
        elif stmt and stmt[0] == "policy" and len(stmt) > 1:
            c.policy = stmt[1]
        stmt = []


def read_nft_text(text: str, source: str) -> NftRuleset:
    """The ruleset in ``text``; raises NftError when nothing in it is nft text."""
    b = _Builder(source)
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise NftError(source, None, f"more than {MAX_LINES} lines")
    real_end = len(lines)
    open_at_end = _open_blocks(lines)
    if open_at_end:
        # an excerpt cut inside a block (a pasted map whose element list goes on): what
        # it holds up to the cut is read, said once
        b.problem(len(lines), f"the input ends inside {open_at_end} '{{' block(s) (an "
                              "excerpt?): read up to where it ends")
        lines = [*lines, *(["}"] * open_at_end)]
    started = False
    table: _Table | None = None
    chain: _Chain | None = None
    nset: _Set | None = None
    pending: list[str] = []  # a statement continued over lines (an element list)
    pending_line = depth = 0
    for n, raw in enumerate(lines, 1):
        line = _uncomment(raw).strip() if "#" in raw else raw.strip()
        if pending:
            # depth kept as lines come: joining at every line was quadratic (a
            # 10k-service @service-ips is one statement over 10k lines)
            pending.append(line)
            depth += _braces(line)
            if depth > 0:
                continue
            line, pending = " ".join(pending), []
            n_at = pending_line
        else:
            n_at = n
            if not line or line.startswith("#"):
                continue
            if not started:
                if _HEADLESS.match(raw) and not _START.match(raw):
                    family = _headless_family(text)
                    table = b.table(family, "kube-proxy")
                    b.problem(n, f"no 'table' line before this block: read as part of "
                                 f"kube-proxy's table ({family} kube-proxy), by its name")
                elif not _START.match(raw):
                    continue  # a prompt, the command, prose before the output
                started = True
            if _braces(line) > 0 and not _BLOCK_HEAD.match(line):
                pending, pending_line = [line], n
                depth = _braces(line)  # outside quoted text: a comment may hold '{'
                continue
        try:
            if nset is not None:
                if line == "}":
                    nset = None
                    continue
                group = element_group(line) if line.startswith("elements") else None
                if group is not None:
                    b.add_elements(nset, group, n_at)
                    continue
                toks = tokenize(line, source, n_at, _ELEMENT_TOKENS
                                if line.startswith("elements") else MAX_TOKENS_PER_RULE)
                if toks and toks[0] == "elements":
                    elements = next((t for t in toks if isinstance(t, tuple)), ())
                    b.add_elements(nset, elements, n_at)
                else:
                    _set_header(nset, toks)
                continue
            if chain is not None:
                if line == "}":
                    chain = None
                    continue
                if n > real_end:
                    # a rule cut by the end of the input: its verdict may be what was cut
                    b.problem(n_at, "unterminated rule at the end of the input: not read")
                    continue
                toks, rtext = rule_tokens(line, source, n_at)
                if toks and toks[0] == "type" and "hook" in toks:
                    _chain_header(chain, toks, source, n_at)
                elif toks and toks[0] in ("comment", "policy", "devices", "device"):
                    continue
                elif toks:
                    chain.rules.append(NftRule(toks, rtext, f"{source}:{n_at}"))
                continue
            if table is not None:
                if line == "}":
                    table = None
                    continue
                toks = tokenize(line.rstrip("{").strip(), source, n_at, _ELEMENT_TOKENS)
                group = toks[2] if len(toks) == 3 and isinstance(toks[2], tuple) else None
                name = toks[1] if len(toks) >= 2 and toks[0] in ("chain", "set", "map") \
                    else None
                if isinstance(name, tuple):
                    # a brace group where the name goes: no object nft would make
                    b.problem(n_at, f"{toks[0]} without a name in table {table.name}: "
                                    f"{line[:80]!r}")
                    if line.endswith("{"):
                        chain = _Chain("(skipped object)")  # its block
                elif name is not None and toks[0] == "chain":
                    c = b.chain(table, name)
                    if group is None:
                        chain = c
                    else:  # `chain x { type ...; policy ...; rule; }` on one line
                        _one_line_chain(c, group, source, n_at)
                elif name is not None:  # a set or a map
                    s = table.sets.setdefault(_unquote(name), _Set(
                        _unquote(name), toks[0] == "map", source=f"{source}:{n_at}"))
                    if group is None:
                        nset = s
                    else:  # `set x { type ...; elements = { ... } }` on one line
                        _set_header(s, group)
                        inner = tokenize_elements_in_header(group)
                        if inner is not None:
                            b.add_elements(s, inner, n_at)
                elif toks and toks[0] in ("comment", "flags"):
                    continue
                elif toks and toks[0] in ("flowtable", "counter", "quota", "ct", "limit",
                                          "secmark", "synproxy"):
                    # objects the walk does not use: skip their block
                    if line.endswith("{"):
                        chain = _Chain("(skipped object)")
                else:
                    b.problem(n_at, f"not understood in table {table.name}: {line[:80]!r}")
                continue
            _top_level(b, line, n_at, source)
            m = _TABLE_HEAD.match(line)
            if m:
                table = b.table(m.group(1), m.group(2))
        except NftError as e:
            if e.line is None:
                raise
            b.problem(e.line, e.why)
    if pending:
        b.problem(pending_line, "unterminated '{' at the end of the input")
    if not started:
        raise NftError(source, None, "no nft ruleset text (no 'table ... {' block and no "
                                     "'add table/chain/rule' command)")
    return b.ruleset()


def _top_level(b: _Builder, line: str, n: int, source: str) -> None:
    """One command of an nft -f script (or a table block's opening line: done by the
    caller)."""
    if _TABLE_WORD.match(line):
        return
    toks = tokenize(line, source, n, _ELEMENT_TOKENS if _MANY_TOKENS.match(line)
                    else MAX_TOKENS_PER_RULE)
    if not toks:
        return
    verb = toks[0]
    if verb in ("flush", "delete", "destroy", "list", "reset"):
        return  # state changes a dump does not hold
    if verb not in ("add", "create", "insert", "replace") or len(toks) < 4:
        b.problem(n, f"not an nft command: {line[:80]!r}")
        return
    what, family, table = toks[1], toks[2], toks[3]
    if family not in _FAMILIES:
        b.problem(n, f"unknown family {family!r}")
        return
    # (a brace group where a name goes: no object nft would make)
    if not isinstance(table, str):
        b.problem(n, f"{what} without a table name: {line[:80]!r}")
        return
    if what == "table":
        b.table(family, table)
        return
    name = toks[4] if len(toks) >= 5 else None
    if not isinstance(name, str):
        b.problem(n, f"{what} without a name: {line[:80]!r}")
        return
    t = b.table(family, table)
    rest = toks[5:]
    if what == "chain":
        c = b.chain(t, name)
        group = next((x for x in rest if isinstance(x, tuple)), None)
        if group is not None:
            _chain_header(c, group, source, n)
    elif what in ("set", "map"):
        s = t.sets.setdefault(_unquote(name), _Set(_unquote(name), what == "map",
                                                   source=f"{source}:{n}"))
        group = next((x for x in rest if isinstance(x, tuple)), None)
        if group is not None:
            _set_header(s, group)
            inner = tokenize_elements_in_header(group)
            if inner is not None:
                b.add_elements(s, inner, n)
    elif what == "element":
        key = _unquote(name)
        into = t.sets.get(key)
        if into is None:
            into = t.sets[key] = _Set(key, True, source=f"{source}:{n}")
        b.add_elements(into, next((x for x in rest if isinstance(x, tuple)), ()), n)
    elif what == "rule":
        c = b.chain(t, name)
        if rest and rest[0] in ("position", "handle", "index"):
            rest = rest[2:]
        if verb == "insert":
            c.rules.insert(0, NftRule(rest, render(rest), f"{source}:{n}"))
        else:
            c.rules.append(NftRule(rest, render(rest), f"{source}:{n}"))
    else:
        b.problem(n, f"'{verb} {what}' is not read")


def tokenize_elements_in_header(group: tuple[Token, ...]) -> tuple[Token, ...] | None:
    """`add set ... { type x ; elements = { a, b } ; }`: the element group, if any."""
    for i, t in enumerate(group):
        if t == "elements":
            return next((x for x in group[i:] if isinstance(x, tuple)), None)
    return None


def split_nft(text: str) -> tuple[str | None, str]:
    """(the nft ruleset text in a paste, with the other lines blanked so line numbers
    stay; the rest of the paste with the nft lines blanked). (None, text) when it holds
    no nft text."""
    if not looks_like_nft(text):
        return None, text
    lines = text.split("\n")
    nft = [""] * len(lines)
    rest = list(lines)
    depth = 0
    inside = False
    for i, line in enumerate(lines):
        s = line.strip()
        # (asked outside blocks only: inside one every line is nft's, and a 10k-service
        # ruleset is 300k lines inside blocks)
        starts = (not inside or depth == 0) and _starts(line)
        if not inside and not starts:
            continue
        if depth == 0 and not starts and s and not s.startswith("#") and not _COMMAND.match(s):
            inside = False  # the nft text ended: something else follows
            continue
        inside = True
        depth += _braces(s)
        depth = max(depth, 0)
        nft[i] = line
        rest[i] = ""
    return "\n".join(nft), "\n".join(rest)


def _open_blocks(lines: list[str]) -> int:
    """How many '{' are still open at the end of nft text (0 for a whole dump)."""
    depth = 0
    for raw in lines:
        if "{" in raw or "}" in raw:
            depth = max(depth + _braces(_uncomment(raw) if "#" in raw else raw), 0)
    return min(depth, 16)


def _uncomment(s: str) -> str:
    """The line without a '#' comment outside quotes (`nft -a` ends every table, chain,
    set and rule line with `# handle N`)."""
    quoted = False
    for i, c in enumerate(s):
        if c == '"':
            quoted = not quoted
        elif c == "#" and not quoted and (i == 0 or s[i - 1] in " \t"):
            return s[:i]
    return s


def _braces(s: str) -> int:
    """'{' minus '}' outside quoted strings."""
    if "{" not in s and "}" not in s:  # (most lines of a listing: one scan each)
        return 0
    if '"' not in s:
        return s.count("{") - s.count("}")
    # the parts outside quotes are the even ones (after an odd quote, to the end: inside)
    outside = s.split('"')[::2]
    return sum(p.count("{") for p in outside) - sum(p.count("}") for p in outside)
