"""Turn an iptables rule line into conditions and a target the walker can evaluate.

Only what is needed to evaluate a concrete packet is kept. A match module or option
we do not understand is kept as an ``unsupported`` condition: the walker then reports
"unknown" naming the rule, instead of guessing.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

from agent.numbers import is_number
from agent.snapshot import Rule

_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|(\S+)')

# Targets that do not end the traversal and do not change what we model.
PASSIVE_TARGETS = frozenset({
    "LOG", "NFLOG", "ULOG", "TRACE", "CT", "NOTRACK", "TCPMSS", "CHECKSUM", "TOS", "DSCP",
    "CLASSIFY", "AUDIT", "SET", "TEE", "IDLETIMER", "LED", "SECMARK", "CONNSECMARK", "HMARK",
    "TTL", "HL", "RATEEST", "SYNPROXY",
})
BUILTIN_TARGETS = frozenset({
    "ACCEPT", "DROP", "REJECT", "RETURN", "DNAT", "SNAT", "MASQUERADE", "REDIRECT", "NETMAP",
    "MARK", "CONNMARK", "QUEUE", "NFQUEUE",
}) | PASSIVE_TARGETS

# Options that take no value (everything else takes exactly one, except a few listed below).
_FLAG_OPTIONS = frozenset({
    "--syn", "--return-nomatch", "--set", "--rcheck", "--update", "--remove", "--rsource",
    "--rdest", "--rttl", "--random", "--random-fully", "--persistent", "--save-mark",
    "--restore-mark", "--ipvs", "--log-uid", "--log-tcp-sequence", "--log-tcp-options",
    "--log-ip-options", "--notrack", "--reap", "--to-ports-random", "--fragment", "-f",
    "--update-counters", "--update-subcounters", "--physdev-is-in", "--physdev-is-out",
    "--physdev-is-bridged", "--mask-all", "--limit-iface-in", "--limit-iface-out",
    "--clamp-mss-to-pmtu", "--checksum-fill", "--exist", "--transparent", "--nowildcard",
    "--restore-skmark", "--loose", "--validmark", "--accept-local", "--invert",
    "--connlimit-saddr", "--connlimit-daddr", "--socket-exists", "--queue-bypass",
    "--queue-cpu-fanout", "--fail-open", "--ecn-tcp-remove", "--log-macdecode",
})
# Options followed by two words: --tcp-flags MASK COMP, --match-set NAME FLAGS, and the
# SET target's --add-set/--del-set/--map-set NAME FLAGS.
_TWO_VALUE_OPTIONS = frozenset({"--tcp-flags", "--match-set", "--add-set", "--del-set",
                                "--map-set"})


# One test a packet must pass: (kind, negated, args). A plain tuple, not a class: a
# 300k-rule dump builds hundreds of thousands of them and plain tuples are the cheapest.
Cond = tuple[str, bool, tuple[str, ...]]


class ParsedRule(NamedTuple):
    chain: str
    conds: tuple[Cond, ...]
    target: str | None  # None: a rule with no target (counts only)
    goto: bool
    target_opts: dict[str, str]
    comment: str | None = None
    text: str = ""
    source: str = ""
    problem: str | None = None  # why this rule cannot be evaluated at all


_BASE = {"-s": "src", "--source": "src", "-d": "dst", "--destination": "dst",
         "-i": "in", "--in-interface": "in", "-o": "out", "--out-interface": "out"}


def tokenize(text: str) -> list[str]:
    if '"' not in text:
        return text.split()
    if "\\" not in text:
        # fast path: outside quotes split on blanks, inside quotes one token
        out: list[str] = []
        for i, part in enumerate(text.split('"')):
            if i % 2:
                out.append(part)
            else:
                out.extend(part.split())
        return out
    out = []
    for m in _TOKEN.finditer(text):
        if m.group(1) is not None:
            out.append(m.group(1).replace('\\"', '"').replace("\\\\", "\\"))
        else:
            out.append(m.group(2))
    return out


# What a token at an option's place does (anything else starting with "-" is an option of
# the last -m module or of the target)
_NEG, _JUMP, _GOTO, _MATCH, _PROTO, _FRAGMENT, _COUNTERS = range(7)
_OPTION_KIND = {"!": _NEG, "-j": _JUMP, "--jump": _JUMP, "-g": _GOTO, "--goto": _GOTO,
                "-m": _MATCH, "--match": _MATCH, "-p": _PROTO, "--protocol": _PROTO,
                "-f": _FRAGMENT, "--fragment": _FRAGMENT, "-c": _COUNTERS,
                "--set-counters": _COUNTERS}
_new_parsed = tuple.__new__  # ParsedRule(...) through its generated __new__ costs twice


def parse_rule(rule: Rule) -> ParsedRule:
    return parse_rule_text(rule.text, rule.source)


def parse_rule_text(text: str, source: str = "") -> ParsedRule:
    """One `-A CHAIN ...` line (``source`` says where it came from) -> a ParsedRule."""
    if '"' not in text:
        toks = text.split()
    else:
        parts = text.split('"')
        if len(parts) == 3 and "\\" not in text:  # one quoted comment: tokenize's way
            toks = parts[0].split()
            toks.append(parts[1])
            toks += parts[2].split()
        else:
            toks = tokenize(text)
    if len(toks) < 2 or toks[0] != "-A":
        return _new_parsed(ParsedRule, ("", (), None, False, {}, None, text, source,
                                        "not an '-A CHAIN ...' rule"))
    known = _kube_layout(toks, text, source)
    if known is not None:
        return known
    chain = toks[1]
    conds: list[Cond] = []
    comment: str | None = None
    target: str | None = None
    goto = False
    topts: dict[str, str] = {}
    module: str | None = None
    in_target = False  # the options that follow are the target's
    neg = False
    i = 2
    n = len(toks)
    kind_of = _OPTION_KIND.get
    base_of = _BASE.get
    try:
        while i < n:
            t = toks[i]
            kind = kind_of(t)
            if kind is not None:
                if kind == _MATCH:
                    module = toks[i + 1]
                    in_target = module.startswith("target:")
                    i += 2
                elif kind == _NEG:
                    neg = True
                    i += 1
                elif kind in (_JUMP, _GOTO):
                    target = toks[i + 1]
                    goto = kind == _GOTO
                    module = "target:" + target
                    in_target = True
                    i += 2
                    neg = False
                elif kind == _PROTO:
                    conds.append(("proto", neg, (toks[i + 1].lower(),)))
                    i += 2
                    neg = False
                elif kind == _FRAGMENT:
                    conds.append(("fragment", neg, ()))
                    i += 1
                    neg = False
                else:  # _COUNTERS
                    i += 3
                continue
            base = base_of(t)
            if base is not None:
                conds.append((base, neg, (toks[i + 1],)))
                i += 2
                neg = False
                continue
            if t[:1] != "-" or module is None:
                # keep what parsed so far: a false -s/-d/-p still rules the rule out
                return _new_parsed(ParsedRule, (chain, tuple(conds), None, False, {}, None,
                                                text, source, f"unexpected token {t!r}"))
            if in_target:
                if t in _FLAG_OPTIONS:
                    topts[t] = ""
                    i += 1
                elif t in _TWO_VALUE_OPTIONS:
                    topts[t] = f"{toks[i + 1]} {toks[i + 2]}"
                    i += 3
                else:
                    topts[t] = toks[i + 1]
                    i += 2
            elif module == "comment" and t == "--comment":
                comment = toks[i + 1]
                i += 2
            else:
                if module == "set" and t == "--set":  # old spelling of --match-set
                    t = "--match-set"
                    val: tuple[str, ...] = (toks[i + 1], toks[i + 2])
                    i += 3
                elif t in _FLAG_OPTIONS:
                    val = ()
                    i += 1
                elif t in _TWO_VALUE_OPTIONS:
                    val = (toks[i + 1], toks[i + 2])
                    i += 3
                else:
                    val = (toks[i + 1],)
                    i += 2
                conds.append((f"{module}{t}", neg, val))
            neg = False
    except IndexError:
        return _new_parsed(ParsedRule, (chain, tuple(conds), None, False, {}, None, text,
                                        source, "option without a value (line cut short?)"))
    return _new_parsed(ParsedRule, (chain, tuple(conds), target, goto, topts, comment, text,
                                    source, None))


_JUMPS = ("-j", "-g")


def _kube_layout(t: list[str], text: str, source: str) -> ParsedRule | None:
    """The rules kube-proxy writes for each service and endpoint, by their tokens' places
    (each place what the loop of parse_rule_text makes of it: a value any token is, an
    option only that option; a module named "target:..." would make the options after it
    the target's); None for a rule of any other layout, which the loop reads.
    Half the time of a walk of 10k LB IPs went to that loop on these few layouts."""
    n = len(t)
    if n == 4:  # -A C -j T
        if t[2] in _JUMPS:
            return _new_parsed(ParsedRule, (t[1], (), t[3], t[2] == "-g", {}, None, text,
                                            source, None))
    elif n == 8:  # -A C -m comment --comment X -j T
        if t[2] == "-m" and t[3] == "comment" and t[4] == "--comment" and t[6] in _JUMPS:
            return _new_parsed(ParsedRule, (t[1], (), t[7], t[6] == "-g", {}, t[5], text,
                                            source, None))
    elif n == 10:
        if t[2] == "-p" and t[4] == "-m" and t[6] in _JUMPS and t[8] == "--to-destination":
            # -A C -p P -m M -j T --to-destination X
            return _new_parsed(ParsedRule, (t[1], (("proto", False, (t[3].lower(),)),), t[7],
                                            t[6] == "-g", {"--to-destination": t[9]}, None,
                                            text, source, None))
        if t[2] == "-m" and t[3] == "statistic" and t[4] == "--mode" and \
                t[6] == "--probability" and t[8] in _JUMPS:
            # -A C -m statistic --mode M --probability P -j T
            return _new_parsed(ParsedRule, (t[1], (("statistic--mode", False, (t[5],)),
                                                   ("statistic--probability", False, (t[7],))),
                                            t[9], t[8] == "-g", {}, None, text, source, None))
        if t[2] == "-s" and t[4] == "-m" and t[5] == "comment" and t[6] == "--comment" and \
                t[8] in _JUMPS:
            # -A C -s S -m comment --comment X -j T
            return _new_parsed(ParsedRule, (t[1], (("src", False, (t[3],)),), t[9],
                                            t[8] == "-g", {}, t[7], text, source, None))
    elif n == 12:
        if t[2] == "-m" and t[3] == "comment" and t[4] == "--comment" and t[6] == "-m" and \
                t[7] == "addrtype" and t[8] in ("--src-type", "--dst-type") and \
                t[10] in _JUMPS:
            # -A C -m comment --comment X -m addrtype --src-type A -j T
            return _new_parsed(ParsedRule, (t[1], ((f"addrtype{t[8]}", False, (t[9],)),),
                                            t[11], t[10] == "-g", {}, t[5], text, source,
                                            None))
    elif n == 14:
        if t[2] == "-p" and t[4] == "-m" and t[5] == "comment" and t[6] == "--comment" and \
                t[8] == "-m":
            if t[10] in _JUMPS and t[12] == "--to-destination":
                # -A C -p P -m comment --comment X -m M -j T --to-destination D
                return _new_parsed(ParsedRule, (t[1], (("proto", False, (t[3].lower(),)),),
                                                t[11], t[10] == "-g",
                                                {"--to-destination": t[13]}, t[7], text,
                                                source, None))
            if t[10] == "--dport" and t[12] in _JUMPS and not t[9].startswith("target:"):
                # -A C -p P -m comment --comment X -m M --dport N -j T
                return _new_parsed(ParsedRule, (t[1], (("proto", False, (t[3].lower(),)),
                                                       (f"{t[9]}--dport", False, (t[11],))),
                                                t[13], t[12] == "-g", {}, t[7], text, source,
                                                None))
        if t[2] == "-m" and t[3] == "comment" and t[4] == "--comment" and t[6] == "-m" and \
                t[7] == "statistic" and t[8] == "--mode" and t[10] == "--probability" and \
                t[12] in _JUMPS:
            # -A C -m comment --comment X -m statistic --mode M --probability P -j T
            return _new_parsed(ParsedRule, (t[1], (("statistic--mode", False, (t[9],)),
                                                   ("statistic--probability", False,
                                                    (t[11],))),
                                            t[13], t[12] == "-g", {}, t[5], text, source,
                                            None))
    elif n == 16 and t[2] == "-d" and t[4] == "-p" and t[6] == "-m" and t[7] == "comment" \
            and t[8] == "--comment" and t[10] == "-m" and t[12] == "--dport" and \
            t[14] in _JUMPS and not t[11].startswith("target:"):
        # -A C -d D -p P -m comment --comment X -m M --dport N -j T
        return _new_parsed(ParsedRule, (t[1], (("dst", False, (t[3],)),
                                               ("proto", False, (t[5].lower(),)),
                                               (f"{t[11]}--dport", False, (t[13],))),
                                        t[15], t[14] == "-g", {}, t[9], text, source, None))
    return None


def parse_net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """'10.0.0.5', '10.0.0.5/32', '10.0.0.0/255.255.0.0' -> network (iptables forms)."""
    return ipaddress.ip_network(text, strict=False)


def exact_dst(rule: ParsedRule) -> str | None:
    """The single address a rule requires as destination (``-d X/32``), for indexing."""
    for kind, negate, args in rule.conds:
        if kind == "dst" and not negate:
            a = args[0]
            if a.endswith("/32"):
                return a[:-3]
            if "/" not in a:
                return a
            return None
    return None


_MARK = re.compile(r"(?:0[xX][0-9a-fA-F]{1,8}|[0-9]{1,10})\Z")


def parse_mark(text: str) -> tuple[int, int]:
    """'0x4000/0x4000' -> (value, mask); '0x4000' -> (value, 0xffffffff). ValueError for
    anything else (a superscript digit, 5,000 digits), raised before int() sees it."""
    v, _, m = text.partition("/")
    if not _MARK.match(v) or (m and not _MARK.match(m)):
        raise ValueError(f"mark {text[:40]!r} is not a number")
    return int(v, 0), int(m, 0) if m else 0xFFFFFFFF


def port_in(spec: str, port: int) -> bool | None:
    """'80', '30000:32767', '80,443,8000:8080' (multiport) contain ``port``; None where
    the spec holds what is no port (a superscript digit, a service name not known here):
    the match is then not decided, never silently false."""
    for part in spec.split(","):
        if ":" in part:
            lo, hi = part.split(":", 1)
            if not (lo == "" or is_number(lo)) or not (hi == "" or is_number(hi)):
                return None
            if int(lo or 0) <= port <= int(hi or 65535):
                return True
        elif part:
            n = _port_num(part)
            if n is None:
                return None
            if n == port:
                return True
    return False


_SERVICES = {"http": 80, "https": 443, "ssh": 22, "domain": 53}


def _port_num(text: str) -> int | None:
    return int(text) if is_number(text) else _SERVICES.get(text)
