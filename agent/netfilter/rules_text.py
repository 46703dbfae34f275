"""Read iptables rules in every shape people save or paste them, into a Netfilter.

Shapes: `iptables-save` (either backend, `-c` counters), kube-proxy's restore input,
`iptables [-t T] -S [CHAIN]` (with `-v` counters), grep excerpts of any of these (no
table header, tables mixed), lines indented or wrapped by their author (backslash
continuation), several dumps one after another, and `iptables -L -n [-v]
[--line-numbers]` listings (agent/netfilter/listing.py turns those into rule lines).

Nothing is all-or-nothing: a line that cannot be read is reported as a problem (line
number, why) and the rest is used. A rule whose table no header names gets it from its
chain and target (DNAT, KUBE-MARK-MASQ -> nat; REJECT, KUBE-FIREWALL -> filter), and the
inference is reported. ``parse_iptables_save`` (complete dumps: the live probe, bundles)
raises the first problem instead.
"""

from __future__ import annotations

import array
import operator
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from agent.errors import InputError
from agent.numbers import is_number
from agent.parse.text_file import replaced
from agent.snapshot import Chain, Netfilter, Rule, Rules, Table

BUILTIN_CHAINS = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
    "security": ("INPUT", "FORWARD", "OUTPUT"),
}
TABLES = tuple(BUILTIN_CHAINS)

# What places a rule in a table when no header says (kube-proxy's chains and the targets
# only one table allows). KUBE-SERVICES and KUBE-NODEPORTS exist in nat and filter both:
# their rules are placed by target.
_NAT_CHAINS = re.compile(r"^KUBE-(SVC|SEP|EXT|SVL|FW|XLB|MARK-MASQ|MARK-DROP|POSTROUTING|"
                         r"LOAD-BALANCER|LOOP-BACK|NODE-PORT|MARK-)")
_FILTER_CHAINS = re.compile(r"^KUBE-(FIREWALL|EXTERNAL-SERVICES|FORWARD|PROXY-FIREWALL|"
                            r"PROXY-CANARY|KUBELET-CANARY|NODEPORT-HEALTHCHECK|SOURCE-RANGES-"
                            r"FIREWALL|IPVS-FILTER|IPVS-OUT-FILTER)")
_NAT_TARGETS = frozenset({"DNAT", "SNAT", "MASQUERADE", "REDIRECT", "NETMAP"})
_FILTER_TARGETS = frozenset({"REJECT"})
_ONLY_NAT_BUILTIN = frozenset({"PREROUTING", "POSTROUTING"})  # of the tables we walk



def chain_table(chain: str, targets: list[str]) -> str | None:
    """The table one whole chain of a listing belongs to, from its name and its rules'
    targets (a listing prints a chain's rules together: they share a table); None when
    nothing settles it."""
    if any(t in _NAT_TARGETS for t in targets) or chain in _ONLY_NAT_BUILTIN:
        return "nat"
    if chain == "FORWARD" or any(t in _FILTER_TARGETS for t in targets):
        return "filter"
    for name in (chain, *targets):
        if name in ("KUBE-SERVICES", "KUBE-NODEPORTS"):
            continue
        if _NAT_CHAINS.match(name):
            return "nat"
        if _FILTER_CHAINS.match(name):
            return "filter"
    return None


_COUNTERS = re.compile(r"^\[\d+:\d+\]\s*")
_V_COUNTERS = re.compile(r"\s-c \d+ \d+(?=\s|$)")
_GREP_N = re.compile(r"^\d+(?:[:-]|\s+)(?=-[AINP] |[*:\[]|COMMIT)")  # grep -n, an editor's
# a terminal's wrapping pasted as padding: "-j KUBE-      SVC-X" and "...   5 -A NEXT"
_BROKEN_WORD = re.compile(r"(?<=-)\s{3,}(?=[A-Z0-9])")
# (tried only where a run of blanks starts: tried at each of its blanks, a run of n blanks
# cost n^2 steps, 34 s for a line padded with 32k)
_NEXT_RULE = re.compile(r"(?<!\s)\s{6,}(?:\d+\s+)?(?=-A [A-Za-z])")
_CHAIN_DECL_COUNTERS = re.compile(r"\[\d+:\d+\]")
# what a wrapped paste holds: a line that ends in a backslash or a blank, and runs of
# blanks (a regex that starts with the "\n" it looks behind skips from line end to line end
# at C speed: over a 15 MB dump 4x faster than three substring tests)
_WRAP_END = re.compile(r"\n(?<=[\\ \t]\n)")


@dataclass
class Problem:
    line: int | None
    why: str


@dataclass
class RuleLine:
    """A rule no table header placed: its table is inferred when settling."""

    chain: str
    rule: Rule
    insert_at: int | None = None  # -I CHAIN N
    table: str | None = None


class ChainRules:
    """The rules read so far for one chain, kept as their texts and each one's file and
    line (no object per rule: a dump holds hundreds of thousands); ``settle`` freezes
    them into :class:`Rules`. Indexing and iteration give :class:`Rule` objects."""

    __slots__ = ("_order", "_pos", "file", "files", "first", "lines", "texts")

    def __init__(self) -> None:
        # the rules as they came (an -I does not move the others: 200k `-I CHAIN 1`
        # lines were 200k list inserts, 11 s); ``_pos`` each one's asked-for index once
        # there is an -I, the chain's order made from them when asked (``_at``)
        self.texts: list[str] = []
        self._pos: list[int] | None = None
        self._order: list[int] | None = None
        # each rule's line: while they follow one another (a dump lists a chain's rules
        # together) the first one says them all; else one per rule
        self.first = 0
        self.lines: array.array[int] | None = None
        self.file: str | None = None  # the file of every rule, while there is only one
        self.files: list[str] | None = None  # each rule's file, once there are several

    def append(self, text: str, file: str, line: int) -> None:
        if self.files is None and file != self.file:
            self._another_file(file)
        n = len(self.texts)
        if self.lines is None:
            if not n:
                self.first = line
            elif line != self.first + n:
                self._lines().append(line)
        else:
            self.lines.append(line)
        if self._pos is not None:
            self._pos.append(n)
            self._order = None
        self.texts.append(text)
        if self.files is not None:
            self.files.append(file)

    def insert(self, i: int, text: str, file: str, line: int) -> None:
        if self.files is None and file != self.file:
            self._another_file(file)
        if not self.texts:
            self.append(text, file, line)
            return
        if self._pos is None:
            self._pos = list(range(len(self.texts)))
        self._lines().append(line)
        self._pos.append(min(max(i, 0), len(self.texts)))
        self._order = None
        self.texts.append(text)
        if self.files is not None:
            self.files.append(file)

    def _at(self, i: int) -> int:
        """Where the rule at index ``i`` of the chain is stored (its arrival)."""
        if self._pos is None:
            return i
        if self._order is None:
            self._order = _placed(self._pos)
        return self._order[i]

    def last_added(self) -> Rule:
        n = len(self.texts) - 1
        return Rule(self.texts[n], self._source(n))

    def _lines(self) -> array.array[int]:
        """The lines one per rule (no longer one after another)."""
        if self.lines is None:
            self.lines = array.array("I", range(self.first, self.first + len(self.texts)))
        return self.lines

    def line(self, i: int) -> int:
        return self._line(self._at(i))

    def _line(self, k: int) -> int:
        if self.lines is not None:
            return self.lines[k]
        return self.first + (k if k >= 0 else k + len(self.texts))

    def _another_file(self, file: str) -> None:
        if self.texts:
            assert self.file is not None  # (the first rule's append set it)
            self.files = [self.file] * len(self.texts)
        else:
            self.file = file

    def source(self, i: int) -> str:
        return self._source(self._at(i))

    def _source(self, k: int) -> str:
        file = self.file if self.files is None else self.files[k]
        return f"{file}:{self._line(k)}"

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> Rule:
        k = self._at(i if i >= 0 else i + len(self.texts))
        return Rule(self.texts[k], self._source(k))

    def __iter__(self) -> Iterator[Rule]:
        return (self[i] for i in range(len(self.texts)))

    def frozen(self) -> Rules:
        if self._pos is not None:
            order = [self._at(i) for i in range(len(self.texts))]
            return Rules([self.texts[k] for k in order], [self._source(k) for k in order])
        if self.files is None:
            lines = self.lines if self.lines is not None else \
                range(self.first, self.first + len(self.texts))
            return Rules.in_file(self.texts, self.file or "", lines)
        return Rules(self.texts, [self.source(i) for i in range(len(self.texts))])


def _placed(pos: list[int]) -> list[int]:
    """The chain's order from each rule's asked-for index when it came (``pos[k]`` at
    most k: an append asks for the end): the arrivals in chain order. Offline, in
    O(n log n): the last to come keeps the index it asked for, each earlier one takes
    the free index its position counts to (a Fenwick tree of free slots)."""
    n = len(pos)
    tree = [0] * (n + 1)
    for i in range(1, n + 1):  # every slot free: tree[i] covers (i - (i & -i), i]
        tree[i] = i & -i
    top = 1 << n.bit_length()
    order = [0] * n
    for k in range(n - 1, -1, -1):
        want, at, step = pos[k] + 1, 0, top
        while step:  # the slot where the count of free ones reaches ``want``
            nxt = at + step
            if nxt <= n and tree[nxt] < want:
                at, want = nxt, want - tree[nxt]
            step >>= 1
        order[at] = k
        i = at + 1
        while i <= n:
            tree[i] -= 1
            i += i & -i
    return order


_TEXTS = operator.attrgetter("texts")


@dataclass
class RulesText:
    """What one or more pasted iptables texts held, before tables are settled."""

    # (table, chain) -> its rules, for rules under a header or a command's -t
    rules: dict[tuple[str, str], ChainRules] = field(default_factory=dict)
    loose: list[RuleLine] = field(default_factory=list)  # rules without a table
    chains: dict[tuple[str | None, str], str | None] = field(default_factory=dict)
    backend: str = "unknown"
    problems: list[tuple[str, Problem]] = field(default_factory=list)  # (source, problem)
    inferred: dict[str, int] = field(default_factory=dict)  # "nat" -> rules placed there
    tables_seen: dict[str, None] = field(default_factory=dict)  # in order
    excerpt: bool = False  # rules read without a header (`-S [CHAIN]`, a grep)
    last: Rule | None = None  # the rule a wrapped line may continue
    last_at: tuple[ChainRules, int] | None = None

    def problem(self, source: str, line: int | None, why: str) -> None:
        self.problems.append((source, Problem(line, why)))

    def count(self) -> int:
        # (at C speed: 47k chains at 10k services, asked before and after each dump)
        return sum(map(len, map(_TEXTS, self.rules.values()))) + len(self.loose) + \
            len(self.chains)

    def add(self, table: str | None, chain: str, text: str, file: str, line: int,
            insert_at: int | None = None) -> None:
        rule = Rule(text, f"{file}:{line}")
        if table is None:
            self.loose.append(RuleLine(chain, rule, insert_at))
            where: tuple[ChainRules, int] | None = None
        else:
            rules = self.rules.get((table, chain))
            if rules is None:
                rules = self.rules[(table, chain)] = ChainRules()
            if insert_at is None:
                rules.append(text, file, line)
            else:
                rules.insert(insert_at - 1, text, file, line)
            where = (rules, len(rules) - 1)  # where it is stored: its arrival
        self.last, self.last_at = rule, where

    def extend_last(self, text: str) -> None:
        """The author's line break inside the last rule."""
        assert self.last is not None
        new = Rule(self.last.text + " " + text, self.last.source)
        if self.last_at is not None:
            rules, i = self.last_at
            rules.texts[i] = new.text
        else:
            self.loose[-1].rule = new
        self.last = new


# the quotes of a rule's --comment as a word processor or a notes app turns them (a paste
# by way of Confluence, Word or a phone): iptables-save writes plain ones only
_CURLY_QUOTES = ("\u201c", "\u201d", "\u201e")


def read_rules_text(text: str | list[tuple[int, str]], source: str, into: RulesText,
                    table: str | None = None) -> None:
    """Add the rules of ``text`` (a whole text, or (line number, line) pairs of a section
    of a file) to ``into``. ``table`` is what the command said (`iptables -t nat -S`)."""
    if isinstance(text, str):
        text = replaced(text, _CURLY_QUOTES, '"')
        # lazily: a big dump's lines as tuples would only feed the garbage collector
        pairs: Iterable[tuple[int, str]] = enumerate(text.splitlines(), 1)
        wrapped = "   " in text or bool(_WRAP_END.search(text)) or text.endswith(("\\", " "))
    else:
        pairs = text if all(line.isascii() for _, line in text) else \
            [(n, replaced(line, _CURLY_QUOTES, '"')) for n, line in text]
        wrapped = any(line.endswith(("\\", " ", "\t")) or "   " in line for _, line in text)
    if wrapped:
        pairs = list(_unwrapped(_joined(list(pairs))))  # a paste's wrapping: rare, costly
    current = table
    opened_at = 0
    pending: str | None = None  # the last rule line, which the next line may continue
    if table is not None:
        into.excerpt = True  # `iptables -t T -S`: not a whole dump with its headers
    rules_of = into.rules
    chains = into.chains
    # the chain the last plain rule went to, and how to add to it (a dump writes each
    # chain's rules together): most rules cost no dict lookup
    fast_table: str | None = None
    fast_chain = ""
    fast_next = 0  # the line the fast path takes next (the chain's rules are one run)
    add_text = None
    fast_prefix = "\0"  # "-A CHAIN " of that chain
    for lineno, raw in pairs:
        line = raw.strip()
        if lineno == fast_next and line.startswith(fast_prefix) and "-c " not in line and \
                add_text is not None:
            # the next line of the run below, as it would take it (stripped, it has a body
            # after the prefix's blank; nothing came between, so table and state stand)
            add_text(line)
            fast_next = lineno + 1
            pending = line
            continue
        if not line:
            continue
        if current is not None and line.startswith("-A ") and "-c " not in line:
            # the bulk of a dump: a plain rule under a table header
            blank = line.find(" ", 3)
            if 0 < blank < len(line) - 1:  # a chain and a body
                chain = line[3:blank]
                if lineno == fast_next and chain == fast_chain and current is fast_table \
                        and add_text is not None:
                    add_text(line)  # the next line of this chain's run
                    fast_next = lineno + 1
                else:
                    key = (current, chain)
                    rules = rules_of.get(key)
                    if rules is None:
                        if opened_at and key not in chains and \
                                chain not in BUILTIN_CHAINS.get(current, ()):
                            into.problem(source, lineno, f"rule for chain {chain!r} that "
                                         "was never declared (used anyway)")
                        rules = rules_of[key] = ChainRules()
                    rules.append(line, source, lineno)
                    fast_table, fast_chain, fast_next = current, chain, lineno + 1
                    # (one file, lines one after another: a text is all the next one adds)
                    add_text = rules.texts.append if rules.files is None and \
                        rules.file == source and rules.lines is None else None
                    fast_prefix = line[:blank + 1]
                pending = line
                into.last_at = None
                continue
        if line.startswith("#"):
            if line.startswith("# Generated by"):
                into.backend = "nft" if "nf_tables" in line else "legacy"
            elif "is incompatible" in line:
                into.problem(source, lineno, f"{line.lstrip('# ')} (dump it with the "
                             "iptables variant that wrote these rules)")
            continue
        if line[0].isdigit():
            line = _GREP_N.sub("", line)
        elif line[0] == "[":
            line = _COUNTERS.sub("", line)
        if line.startswith(":"):  # (before the rarer tests: 47k chains at 10k services)
            # ":NAME POLICY [packets:bytes]" (counters optional): what the pattern
            # ^:(\S+)\s+(\S+)(?:\s+\[\d+:\d+\])?\s*$ matches, by a split (the pattern's \s
            # and str.split's blanks are the same characters), at a third of its cost
            words = line.split()
            if len(words[0]) > 1 and (len(words) == 2 or (len(words) == 3 and (
                    words[2] == "[0:0]" or _CHAIN_DECL_COUNTERS.fullmatch(words[2])))):
                policy = words[1]
                chains[(current, words[0][1:])] = None if policy == "-" else policy
            else:
                into.problem(source, lineno, f"bad chain declaration {_short(line)!r}")
            continue
        if line.startswith("*"):
            name = line[1:].strip()
            if current is not None and opened_at:
                into.problem(source, lineno, f"table {name!r} starts before table "
                             f"{current!r} ended with COMMIT")
            if name not in BUILTIN_CHAINS:
                into.problem(source, lineno, f"bad table header {line!r}")
                current, opened_at = None, 0
                continue
            current, opened_at = name, lineno
            into.tables_seen.setdefault(name)
            continue
        if line == "COMMIT":
            current, opened_at = table, 0
            continue
        if line.startswith(("-N ", "-P ")):
            words = _V_COUNTERS.sub("", line).split()
            if len(words) < 2:
                into.problem(source, lineno, f"{words[0]} without a chain name")
                continue
            into.chains.setdefault((current, words[1]), None)
            if words[0] == "-P" and len(words) > 2:
                into.chains[(current, words[1])] = words[2]
            continue
        if line.startswith(("-A ", "-I ", "--append ", "--insert ")):
            if "-c " in line:
                line = _V_COUNTERS.sub("", line)
            parts = line.split(None, 2)
            if len(parts) < 3:
                name = parts[1] if len(parts) > 1 else "?"
                into.problem(source, lineno, f"rule for chain {name!r} has no body")
                continue
            op, chain, body = parts
            insert_at = None
            if op in ("-I", "--insert"):
                head, _, rest = body.partition(" ")
                if is_number(head):
                    insert_at, body = int(head), rest
                elif head and all(c.isdigit() for c in head):
                    # a position, but none the kernel takes (a superscript digit, 5,000
                    # digits): said, and taken as the first
                    into.problem(source, lineno, f"-I position {head[:20]!r} is not a "
                                 "number (taken as 1)")
                    insert_at, body = 1, rest
                else:
                    insert_at = 1
            if (current, chain) not in into.chains and opened_at and \
                    chain not in BUILTIN_CHAINS.get(current or "", ()):
                into.problem(source, lineno, f"rule for chain {chain!r} that was never "
                             "declared (used anyway)")
            into.add(current, chain, f"-A {chain} {body}", source, lineno, insert_at)
            pending = line
            continue
        if line.startswith(("-X", "-F", "-Z")):
            words = line.split()
            name = words[1] if len(words) > 1 else ""
            if words[0] == "-X":
                into.chains.pop((current, name), None)
            if words[0] in ("-X", "-F") and name and current is not None:
                into.rules.pop((current, name), None)
                into.last = into.last_at = None
                add_text = None  # it may have been the chain the fast path adds to
            continue
        if pending is not None and into.last_at is None and current is not None:
            rules = rules_of.get((current, pending[3:].partition(" ")[0]))
            if rules:  # the fast path's last rule
                into.last, into.last_at = rules.last_added(), (rules, len(rules) - 1)
        if pending is not None and into.last is not None and \
                _continues(line, into.last.text):
            # the author's line break inside a rule (a wrapped paste)
            into.extend_last(line)
            continue
        into.problem(source, lineno, f"not an iptables rule line: {_short(line)!r}")
        pending = None
    if opened_at and current is not None:
        into.problem(source, opened_at, f"table {current!r} is not closed by COMMIT "
                     "(file truncated?)")


def _joined(pairs: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Join backslash-continued lines (a pasted shell command's wrapping)."""
    buf: list[str] = []
    start = 0
    for lineno, line in pairs:
        if not buf and not line.endswith(("\\", " ", "\t")):
            yield lineno, line
            continue
        stripped = line.rstrip()
        if stripped.endswith("\\") and not stripped.endswith("\\\\"):
            if not buf:
                start = lineno
            buf.append(stripped[:-1].strip())
            continue
        if buf:
            buf.append(line.strip())
            yield start, " ".join(buf)
            buf = []
            continue
        yield lineno, line
    if buf:
        yield start, " ".join(buf)


def _unwrapped(pairs: Iterable[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Undo a terminal's wrapping pasted as runs of blanks: several rules on one line,
    and words broken by padding."""
    for lineno, line in pairs:
        if "   " not in line:
            yield lineno, line
            continue
        line = _BROKEN_WORD.sub("", line)
        for part in _NEXT_RULE.split(line):
            yield lineno, part


def _continues(line: str, previous: str) -> bool:
    """Is ``line`` the rest of ``previous`` (wrapped by a terminal or an editor)?"""
    if previous.count('"') % 2 == 1:
        return True  # inside a quoted comment
    return line.startswith(("-", "!")) and not line.startswith(("-A ", "-I ", "-N ", "-P "))


def settle(into: RulesText) -> Netfilter:
    """Place every rule in its table (inferring where no header said) and build the
    Netfilter. Chains keep the order they were first seen in."""
    declared: dict[str, str] = {}  # chain -> table, from headers (made when first asked:
    # a whole dump, every chain under a header, never asks)

    def table_of_chain(name: str) -> str | None:
        if not declared:
            for (t, known) in into.chains:
                if t is not None:
                    declared.setdefault(known, t)
            for (t, known) in into.rules:
                declared.setdefault(known, t)
        if name in declared and name not in ("KUBE-SERVICES", "KUBE-NODEPORTS"):
            return declared[name]
        if _NAT_CHAINS.match(name) or name in _ONLY_NAT_BUILTIN:
            return "nat"
        if _FILTER_CHAINS.match(name):
            return "filter"
        return None

    def infer(r: RuleLine) -> str:
        target = _target(r.rule.text)
        if target in _NAT_TARGETS:
            return "nat"
        if target in _FILTER_TARGETS:
            return "filter"
        if target:
            t = table_of_chain(target)
            if t:
                return t
        t = table_of_chain(r.chain)
        if t:
            return t
        if r.chain in ("KUBE-SERVICES", "KUBE-NODEPORTS"):
            # kube-proxy's nat copies jump to KUBE-SVC/EXT/FW chains (matched above);
            # the filter copies REJECT/DROP or ACCEPT health check ports
            return "filter" if target in ("DROP", "ACCEPT") else "nat"
        return "filter" if r.chain in ("INPUT", "FORWARD") else "nat"

    loose_table: dict[str, str] = {}
    placed: dict[tuple[str, str], list[RuleLine]] = {}
    for r in into.loose:
        r.table = infer(r)
        loose_table.setdefault(r.chain, r.table)
        into.inferred[r.table] = into.inferred.get(r.table, 0) + 1
        placed.setdefault((r.table, r.chain), []).append(r)
    # table -> chain -> policy, in the order first seen
    order: dict[str, dict[str, str | None]] = {t: {} for t in into.tables_seen}
    for (t, name), policy in into.chains.items():
        t = t or loose_table.get(name) or table_of_chain(name)
        if t is None:
            continue
        chains = order.setdefault(t, {})
        if policy is not None or name not in chains:
            chains[name] = policy
    for t, name in (*into.rules, *placed):
        in_table = order.get(t)
        if in_table is None:
            in_table = order[t] = {}
        if name not in in_table:
            in_table[name] = None

    def rules_of(t: str, name: str) -> Rules:
        rules = into.rules.get((t, name))
        extra = placed.get((t, name)) if placed else None
        if not extra:
            return rules.frozen() if rules is not None else Rules()
        out = list(rules or ())
        for r in extra:
            if r.insert_at is not None:
                out.insert(r.insert_at - 1, r.rule)
            else:
                out.append(r.rule)
        return Rules.of(out)

    def chains_of(t: str, chains: dict[str, str | None]) -> tuple[Chain, ...]:
        builtin = BUILTIN_CHAINS.get(t, ())
        read = into.rules.get
        out = []
        for name, policy in chains.items():
            if policy is None and name in builtin:
                policy = "ACCEPT"
            rules = read((t, name))
            # (a chain read from one file, its rules one line after another, as a dump
            # writes them: 47k chains at 10k services, each frozen without a call)
            if rules is not None and rules.files is None and rules.lines is None and \
                    not placed:
                texts = rules.texts
                frozen = Rules.in_file(texts, rules.file or "",
                                       range(rules.first, rules.first + len(texts)))
            else:
                frozen = rules_of(t, name)
            out.append(_chain(name, policy, frozen))
        return tuple(out)

    return Netfilter(
        backend=into.backend,
        tables=tuple(Table(t, chains_of(t, chains)) for t, chains in order.items()),
        partial=bool(into.loose) or into.excerpt)


_set = object.__setattr__


def _chain(name: str, policy: str | None, rules: Rules) -> Chain:
    """``Chain(name, policy, rules)`` without its generated __init__ and __post_init__
    (``rules`` is already a Rules): a 10k-service dump has 47k chains."""
    c = object.__new__(Chain)
    _set(c, "name", name)
    _set(c, "policy", policy)
    _set(c, "rules", rules)
    return c


def _target(text: str) -> str | None:
    for flag in (" -j ", " -g ", " --jump ", " --goto "):
        i = text.rfind(flag)
        if i >= 0:
            rest = text[i + len(flag):].split(None, 1)
            return rest[0] if rest else None
    return None


def parse_iptables_save(text: str, source: str = "iptables-save.txt",
                        backend: str | None = None) -> Netfilter:
    """A complete dump (`iptables-save`, kube-proxy's restore input). Raises InputError
    naming ``source`` and the line at the first line that cannot be read."""
    into = RulesText()
    read_rules_text(text, source, into)
    if into.problems:
        _, p = into.problems[0]
        raise InputError(source, p.line, p.why)
    if into.loose:
        first = into.loose[0].rule
        raise InputError(source, int(first.source.rsplit(":", 1)[1]),
                         f"expected a table header such as '*nat', got {_short(first.text)!r}")
    if not into.tables_seen:
        raise InputError(source, None, "no table found (expected lines like '*nat' ... "
                         "'COMMIT')")
    nf = settle(into)
    return Netfilter(backend or into.backend, nf.tables)


def _short(line: str, n: int = 80) -> str:
    return line if len(line) <= n else line[: n - 3] + "..."
