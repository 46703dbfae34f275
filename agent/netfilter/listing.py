"""Turn `iptables [-t T] -L -n [-v] [-x] [--line-numbers]` listings into rule lines.

The listing prints each rule as columns (target, prot, opt, [in, out,] source,
destination) and the matches as text (`/* comment */ tcp dpt:80 ADDRTYPE match dst-type
LOCAL`). Where the columns and that text are unambiguous the rule is rebuilt as
`-A CHAIN ...`; a rule whose match text is not understood is kept as a rule the walker
cannot evaluate (so no verdict silently passes over it) and its line is reported.
Without `-n` addresses are host names: such rules are reported, not guessed.
"""

from __future__ import annotations

import ipaddress
import re

_CHAIN = re.compile(r"^\s*Chain (\S+) \((?:policy (\w+)|\d+ references?)")
_HEADER = re.compile(r"^\s*(?:num\s+)?(?:pkts\s+bytes\s+)?target\s+prot\s+opt")
_COMMENT = re.compile(r"/\* (.*?) \*/")

# match text -> iptables options; each takes the regex's groups
_MATCHES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r) for p, r in (
        (r"^(tcp|udp|sctp) dpts?:(\S+)", r"-m \1 --dport \2"),
        (r"^(tcp|udp|sctp) spts?:(\S+)", r"-m \1 --sport \2"),
        (r"^(tcp|udp|sctp) flags:(\S+)/(\S+)", r"-m \1 --tcp-flags \2 \3"),
        (r"^(tcp|udp|sctp)(?=\s|$)", r"-m \1"),
        (r"^multiport dports (\S+)", r"-m multiport --dports \1"),
        (r"^multiport sports (\S+)", r"-m multiport --sports \1"),
        (r"^ADDRTYPE match dst-type (!\s*)?(\S+)(?: limit-in)?",
         r"-m addrtype \1--dst-type \2"),
        (r"^ADDRTYPE match src-type (!\s*)?(\S+)", r"-m addrtype \1--src-type \2"),
        (r"^mark match (! )?(\S+)", r"-m mark \1--mark \2"),
        (r"^connmark match (! )?(\S+)", r"-m connmark \1--mark \2"),
        (r"^(?:ct)?state (\S+)", r"-m conntrack --ctstate \1"),
        (r"^statistic mode random probability (\S+)",
         r"-m statistic --mode random --probability \1"),
        (r"^statistic mode nth every (\d+)(?: packet (\d+))?",
         r"-m statistic --mode nth --every \1"),
        (r"^(! )?match-set (\S+) (\S+)", r"-m set \1--match-set \2 \3"),
        (r"^recent: (CHECK|UPDATE|SET|REMOVE)(?: seconds: \d+)?(?: reap)? name: (\S+) "
         r"side: (?:source|dest)(?: mask: \S+)?", r"-m recent --rcheck --name \2"),
        (r"^PHYSDEV match (.*?)(?=$)", r"-m physdev"),
        (r"^ctorigdst (\S+)", r"-m conntrack --ctorigdst \1"),
        (r"^ctdir (\S+)", r"-m conntrack --ctdir \1"),
        (r"^pkttype (\S+)", r"-m pkttype --pkt-type \1"),
    ))
# target text -> target options
_TARGETS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r) for p, r in (
        (r"^to:(\S+)", r"--to-destination \1"),
        (r"^MARK or (\S+)", r"--or-mark \1"),
        (r"^MARK xor (\S+)", r"--xor-mark \1"),
        (r"^MARK set (\S+)", r"--set-xmark \1/0xffffffff"),
        (r"^MARK and (\S+)", r"--and-mark \1"),
        (r"^reject-with (\S+)", r"--reject-with \1"),
        (r"^random-fully", r"--random-fully"),
        (r"^masq ports: (\S+)", r"--to-ports \1"),
        (r"^redir ports (\S+)", r"--to-ports \1"),
    ))


def listing_to_rules(lines: list[tuple[int, str]], chain: str | None = None
                     ) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(line number, `-N/-P/-A` line) pairs for read_rules_text, and the lines that could
    not be read (line number, why). ``chain`` is the one the command named (`iptables -L
    KUBE-SERVICES`), for rows pasted without their `Chain` and column header lines."""
    out: list[tuple[int, str]] = []
    problems: list[tuple[int, str]] = []
    columns: list[str] = []
    for lineno, raw in lines:
        line = raw.rstrip()
        if not line.strip() or _ELISION.match(line):
            continue
        m = _CHAIN.match(line)
        if m:
            chain = m.group(1)
            out.append((lineno, f"-P {chain} {m.group(2)}" if m.group(2) else f"-N {chain}"))
            columns = []
            continue
        if _HEADER.match(line):
            columns = line.split()
            continue
        if chain is not None and not columns:
            columns = _columns_of(line)  # the header was cut: the row's shape tells
        if chain is None or not columns:
            problems.append((lineno, "a listing row before its 'Chain' and column header "
                             "lines"))
            continue
        rule, why = _row(chain, columns, line)
        if why:
            problems.append((lineno, why))
        if rule:
            out.append((lineno, rule))
    return out, problems


# an author's elision inside a pasted listing ("...", "……")
_ELISION = re.compile(r"^\s*(?:\.{2,}|…+)\s*$")
_VERBOSE_ROW = re.compile(r"^\s*(?:\d+\s+)?\d+[KMGT]?\s+\d+[KMGT]?\s+\S+\s+\S+\s+(?:--|-f|!f)\s")
_PLAIN_ROW = re.compile(r"^\s*(?:\d+\s+)?\S+\s+\S+\s+(?:--|-f|!f)\s")


def _columns_of(row: str) -> list[str]:
    """The columns of `iptables -L -n [-v] [--line-numbers]` guessed from one row, for a
    paste whose header line was cut; [] when the row fits neither shape."""
    numbered = ["num"] if re.match(r"^\s*\d+\s+\d+[KMGT]?\s+\d+[KMGT]?\s+\S+\s+\S+\s+(?:--|-f)"
                                   r"\s", row) or re.match(r"^\s*\d+\s+\S+\s+\S+\s+(?:--|-f)\s",
                                                           row) else []
    if _VERBOSE_ROW.match(row) and re.match(r"^\s*\d", row):
        return [*numbered, "pkts", "bytes", "target", "prot", "opt", "in", "out", "source",
                "destination"]
    if _PLAIN_ROW.match(row):
        return [*numbered, "target", "prot", "opt", "source", "destination"]
    return []


def _row(chain: str, columns: list[str], line: str) -> tuple[str | None, str | None]:
    comment = None
    c = _COMMENT.search(line)
    if c:
        comment = c.group(1)
        line = line[: c.start()] + line[c.end():]
    words = line.split()
    # the column values; "target" may be empty (a rule with no target)
    fixed = [w for w in columns if w != "target"]
    if len(words) < len(fixed):
        return None, "too few columns for a listing row"
    values: dict[str, str] = {}
    i = 0
    for col in columns:
        if col == "target":
            # empty target: the next word is a protocol and then "--" (opt) follows
            if i + 2 < len(words) and words[i + 2] in ("--", "-f", "!f") and \
                    words[i + 1] not in ("--", "-f"):
                values["target"] = words[i]
                i += 1
            else:
                values["target"] = ""
            continue
        if i >= len(words):
            return None, "too few columns for a listing row"
        values[col] = words[i]
        i += 1
    rest = " ".join(words[i:])
    parts = [f"-A {chain}"]
    for col, flag in (("in", "-i"), ("out", "-o")):
        v = values.get(col, "*")
        if v not in ("*", "any"):
            parts.append(f"! {flag} {v[1:]}" if v.startswith("!") else f"{flag} {v}")
    for col, flag in (("source", "-s"), ("destination", "-d")):
        v = values.get(col, "0.0.0.0/0")
        neg = v.startswith("!")
        v = v.lstrip("!")
        if v in ("0.0.0.0/0", "::/0", "anywhere"):
            continue
        try:
            ipaddress.ip_network(v, strict=False)
        except ValueError:
            return _unreadable(chain, values), f"{col} {v!r} is not an address (list with -n)"
        parts.append(f"{'! ' if neg else ''}{flag} {v}")
    prot = values.get("prot", "all")
    if prot not in ("all", "0"):
        parts.append(f"-p {prot}")
    target = values.get("target", "")
    matches, topts, why = _matches(rest, target)
    if comment is not None:
        parts.append(f'-m comment --comment "{comment}"')
    parts += matches
    if why:
        return _unreadable(chain, values, comment), why
    if target:
        parts.append(f"-j {target}")
        parts += topts
    return " ".join(parts), None


def _matches(rest: str, target: str) -> tuple[list[str], list[str], str | None]:
    matches: list[str] = []
    topts: list[str] = []
    text = rest.strip()
    while text:
        for pattern, repl in _TARGETS:
            m = pattern.match(text)
            if m:
                topts.append(m.expand(repl))
                text = text[m.end():].strip()
                break
        else:
            for pattern, repl in _MATCHES:
                m = pattern.match(text)
                if m:
                    matches.append(re.sub(r"\s+", " ", m.expand(repl).replace("\\1", "")))
                    text = text[m.end():].strip()
                    break
            else:
                return matches, topts, f"match text not understood: {text[:60]!r}"
    return matches, topts, None


def _unreadable(chain: str, values: dict[str, str], comment: str | None = None) -> str:
    """A rule the walker reports as unknown if a packet reaches it, instead of one that
    silently does not exist."""
    target = values.get("target") or ""
    c = f' -m comment --comment "{comment}"' if comment else ""
    return f"-A {chain}{c} -m listing --unreadable row" + (f" -j {target}" if target else "")
