"""Read ipsets from `ipset save` or `ipset list` output.

Members are kept in the form `ipset save` prints them ("10.0.0.5,tcp:80", "30080" for a
bitmap:port set); per-member options (timeout, counters, comment, skb*) are dropped
because nothing downstream needs them, but ``nomatch`` is kept: it inverts the member's
meaning in a hash:net set.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from agent.errors import InputError
from agent.numbers import is_number
from agent.parse.ip_text import PLAIN_V4, PLAIN_V4_NET, canonical_ip, is_network
from agent.snapshot import IpSet

# Options ipset prints after a member that take one argument, and flags without one.
_MEMBER_OPTS_WITH_ARG = frozenset(
    {"timeout", "packets", "bytes", "comment", "skbmark", "skbprio", "skbqueue"})
# A comment is quoted and may contain spaces, so split on whitespace outside quotes.
_TOKEN = re.compile(r'"[^"]*"|\S+')
_SET_TYPE = re.compile(r"^(?:hash|bitmap|list):[a-z]+(?:,[a-z]+)*$")
_SET_NAME = re.compile(r"^[^\s\"'\x00-\x1f\x7f]{1,64}$")
_HEADER_LINE = re.compile(r"^([A-Za-z][A-Za-z ]*):\s*(.*)$")
_PORT = re.compile(r"^(?:[a-z0-9]+:)?[A-Za-z0-9_-]+(?:-[A-Za-z0-9_]+)?$")
_MAC = re.compile(r"^[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5}$")
_MARK = re.compile(r"^(?:0x[0-9a-fA-F]+|\d+)$")
_IFACE = re.compile(r"^(?:physdev:)?[^\s,/]{1,15}$")


def parse_ipsets(text: str, source: str = "ipset.txt") -> tuple[IpSet, ...]:
    """Parse `ipset save` or `ipset list` output; an empty text means no sets at all."""
    # Split on "\n" only (not str.splitlines' \f, \x1c, \u2028 ...), so line numbers
    # match what an editor or `sed -n Np` shows.
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it starts no new one
    for lineno, raw in enumerate(lines, 1):
        first = raw.strip()
        if not first:
            continue
        if first.startswith(("create ", "add ")):
            return _parse_save(text, source)
        if first.startswith("Name:"):
            return _parse_list(lines, source)
        raise InputError(source, lineno,
                         "expected `ipset save` ('create NAME TYPE ...') or `ipset list` "
                         f"('Name: NAME') output, got {_short(first)!r}")
    return ()


def _parse_save(text: str, source: str) -> tuple[IpSet, ...]:
    types: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    # set -> a regex its plain members match (None: none is known for its type)
    plain: dict[str, re.Pattern[str] | None] = {}
    run: str | None = None  # the set the last line named, when it has a plain shape
    pos = lineno = 0  # where the next line starts, and the lines before it
    n = len(text)
    while pos < n:
        if run is not None:
            # `ipset save` lists a set's members one after another: a run of plain ones
            # (each line "add SET MEMBER\n", each member of its type's plain form) is
            # found by one match and taken by one split, not by the loop below line by
            # line (65k members at 10k services: 2x faster)
            name, run = run, None
            # (the next line adds to this set, or the run's match would read another
            # set's whole run only to throw it away)
            shape = plain[name]
            m = _run_regex(shape.pattern).match(text, pos) \
                if shape is not None and text.startswith(f"add {name} ", pos) else None
            if m is not None and m.group(1) == name:
                chunk = text[pos:m.end()]
                k = len(name) + 5  # "add SET "
                members[name] += [line[k:] for line in chunk.split("\n")[:-1]]
                lineno += chunk.count("\n")
                pos = m.end()
                continue
        end = text.find("\n", pos)
        if end < 0:
            end = n
        raw = text[pos:end]
        pos = end + 1
        lineno += 1
        line = raw.strip()
        if not line:
            continue
        m = _PLAIN_ADD.fullmatch(line)
        if m is not None:
            # "add SET MEMBER" with nothing after the member: a member that fits its
            # type's plain form needs no closer look
            name, elem = m.groups()
            if name in plain:
                shape = plain[name]
            else:
                shape = plain[name] = _plain_shape(types[name]) if name in types else None
            if shape is not None and shape.fullmatch(elem):
                members[name].append(elem)
                run = name
                continue
        parts = line.split(None, 3)
        if parts[0] == "create":
            if len(parts) < 3:
                raise InputError(source, lineno, "create line without set name and type")
            name, set_type = parts[1], parts[2]
            _check_name(name, source, lineno)
            _check_type(set_type, source, lineno)
            if name in types:
                raise InputError(source, lineno, f"set {name!r} is created twice")
            types[name] = set_type
            members[name] = []
            shape = plain[name] = _plain_shape(set_type)
            if shape is not None:
                run = name
        elif parts[0] == "add":
            if len(parts) < 3:
                raise InputError(source, lineno, "add line without set name and member")
            name = parts[1]
            if name not in types:
                raise InputError(source, lineno,
                                 f"member added to set {name!r} before its create line")
            rest = line.split(None, 2)[2]
            members[name].append(_member(rest, types[name], source, lineno))
        else:
            raise InputError(source, lineno,
                             f"expected a 'create' or 'add' line, got {_short(line)!r}")
    return _result(types, members)



@functools.lru_cache(maxsize=64)
def _run_regex(shape: str) -> re.Pattern[str]:
    # one per member shape, not per set (a set name in the pattern made 18 compiles of
    # 1-2 ms each for kube-proxy's sets): the set's name is matched again by reference
    return re.compile(rf"add (\S+) (?:{shape})\n(?:add \1 (?:{shape})\n)*")


def _parse_list(lines: list[str], source: str) -> tuple[IpSet, ...]:
    types: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    # Per set: where it started, the entry count the header announced, and whether it
    # has a timeout (expired-but-not-yet-collected entries are counted, not listed).
    started: dict[str, int] = {}
    announced: dict[str, int] = {}
    has_timeout: dict[str, bool] = {}
    name: str | None = None
    last_member_line = 0
    state = "between"  # "between" sets, in a set's "header", or in its "members"
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if state == "members":
            if not line:
                state = "between"
                continue
            if not line.startswith("Name:"):
                assert name is not None
                members[name].append(_member(line, types[name], source, lineno))
                last_member_line = lineno
                continue
            state = "between"
        if not line:
            if state == "header":
                raise InputError(source, lineno,
                                 f"set {name!r} ends before its 'Members:' line "
                                 "(`ipset list -t` output has no members)")
            continue
        if state == "between":
            if not line.startswith("Name:"):
                raise InputError(source, lineno, f"expected 'Name: SET', got {_short(line)!r}")
            name = line[len("Name:"):].strip()
            _check_name(name, source, lineno)
            if name in types:
                raise InputError(source, lineno, f"set {name!r} is listed twice")
            types[name] = ""
            members[name] = []
            started[name] = lineno
            state = "header"
            continue
        # state == "header"
        assert name is not None
        if line == "Members:":
            if not types[name]:
                raise InputError(source, lineno, f"set {name!r} has no 'Type:' line")
            state = "members"
            last_member_line = lineno
            continue
        m = _HEADER_LINE.match(line)
        if not m:
            raise InputError(source, lineno,
                             f"expected a 'Key: value' header line of set {name!r}, "
                             f"got {_short(line)!r}")
        key, value = m.group(1), m.group(2).strip()
        if key == "Name":
            raise InputError(source, lineno, f"set {name!r} ends before its 'Members:' line")
        if key == "Type":
            _check_type(value, source, lineno)
            types[name] = value
        elif key == "Number of entries":
            if not is_number(value):
                raise InputError(source, lineno, f"bad entry count {value!r}")
            announced[name] = int(value)
        elif key == "Header":
            has_timeout[name] = "timeout" in value.split()
    if state == "header":
        assert name is not None
        raise InputError(source, started[name],
                         f"set {name!r} has no 'Members:' line (file truncated?)")
    # A cut-off file ends inside the last set's members: its count falls short of what
    # the header announced. (Only the last set can be cut off this way.)
    if name is not None and name in announced and not has_timeout.get(name, False) \
            and len(members[name]) < announced[name]:
        raise InputError(source, last_member_line,
                         f"set {name!r} lists {len(members[name])} of its "
                         f"{announced[name]} members (file truncated?)")
    return _result(types, members)


def _result(types: dict[str, str], members: dict[str, list[str]]) -> tuple[IpSet, ...]:
    return tuple(IpSet(name, types[name], tuple(sorted(members[name])))
                 for name in sorted(types))


def _member(rest: str, set_type: str, source: str, lineno: int) -> str:
    """The member in canonical form: its first token, plus " nomatch" when flagged."""
    tokens = _TOKEN.findall(rest)
    if not tokens:
        raise InputError(source, lineno, "member missing")
    elem = tokens[0]
    _check_member(elem, set_type, source, lineno)
    nomatch = False
    i = 1
    while i < len(tokens):
        tok = tokens[i]
        if tok == "nomatch":
            nomatch = True
        elif tok in _MEMBER_OPTS_WITH_ARG:
            i += 1  # skip its value
        # Unknown words are options of some newer ipset: ignored rather than fatal.
        i += 1
    return f"{elem} nomatch" if nomatch else elem


_PLAIN_ADD = re.compile(r'add (\S+) ([^\s"]+)')
# what each component of a member looks like as kube-proxy's sets hold it; each is
# narrower than the component's check below (so a match is a member that passes it)
_PLAIN_COMPONENT = {"ip": PLAIN_V4.pattern, "net": PLAIN_V4_NET.pattern,
                    "port": "(?:[a-z0-9]+:)?[0-9]+"}


def _plain_shape(set_type: str) -> re.Pattern[str] | None:
    kind, _, dims = set_type.partition(":")
    if kind not in ("hash", "bitmap"):
        return None
    parts = [_PLAIN_COMPONENT.get(d) for d in dims.split(",")]
    if None in parts:
        return None
    return re.compile(",".join(f"(?:{p})" for p in parts))


def _is_ip(value: str) -> bool:
    return canonical_ip(value) is not None


def _is_net(value: str) -> bool:
    # hash:net prints a /32 (/128) member without the prefix; ranges "a-b" may appear
    # in bitmap:ip/hash:ip sets created with a netmask.
    if "-" in value and "/" not in value:
        lo, _, hi = value.partition("-")
        return _is_ip(lo) and _is_ip(hi)
    return is_network(value)


_COMPONENT_CHECKS: dict[str, Callable[[str], bool]] = {
    "ip": _is_net,
    "net": _is_net,
    "port": lambda v: bool(_PORT.match(v)),
    "mac": lambda v: bool(_MAC.match(v)),
    "mark": lambda v: bool(_MARK.match(v)),
    "iface": lambda v: bool(_IFACE.match(v)),
    "set": lambda v: bool(_SET_NAME.match(v)),
}


def _check_member(elem: str, set_type: str, source: str, lineno: int) -> None:
    """A member must fit its set's type, which catches garbage and cut-off lines."""
    kind, _, dims = set_type.partition(":")
    components = ["set"] if kind == "list" else dims.split(",")
    values = elem.split(",")
    if len(values) != len(components):
        raise InputError(source, lineno,
                         f"member {_short(elem)!r} does not fit set type {set_type!r}")
    for comp, value in zip(components, values, strict=True):
        check = _COMPONENT_CHECKS.get(comp)
        # A component type this reader does not know (a newer ipset) is not checked.
        if check is not None and not check(value):
            raise InputError(source, lineno,
                             f"member {_short(elem)!r} does not fit set type {set_type!r} "
                             f"({value!r} is not a valid {comp})")


def _check_name(name: str, source: str, lineno: int) -> None:
    if not _SET_NAME.match(name):
        raise InputError(source, lineno, f"bad set name {_short(name)!r}")


def _check_type(set_type: str, source: str, lineno: int) -> None:
    if not _SET_TYPE.match(set_type):
        raise InputError(source, lineno, f"bad set type {_short(set_type)!r}")


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
