"""Turn an iptables rule line into conditions and a target the walker can evaluate.

Only what is needed to evaluate a concrete packet is kept. A match module or option
we do not understand is kept as an ``unsupported`` condition: the walker then reports
"unknown" naming the rule, instead of guessing.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

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


def parse_rule(rule: Rule) -> ParsedRule:
    toks = tokenize(rule.text)
    if len(toks) < 2 or toks[0] != "-A":
        return ParsedRule("", (), None, False, {}, text=rule.text, source=rule.source,
                          problem="not an '-A CHAIN ...' rule")
    chain = toks[1]
    conds: list[Cond] = []
    comment: str | None = None
    target: str | None = None
    goto = False
    topts: dict[str, str] = {}
    module: str | None = None
    neg = False
    i = 2
    n = len(toks)
    try:
        while i < n:
            t = toks[i]
            if t == "!":
                neg = True
                i += 1
                continue
            if t in ("-j", "--jump", "-g", "--goto"):
                target = toks[i + 1]
                goto = t in ("-g", "--goto")
                module = "target:" + target
                i += 2
                neg = False
                continue
            if t in ("-m", "--match"):
                module = toks[i + 1]
                i += 2
                continue
            base = _BASE.get(t)
            if base is not None:
                conds.append((base, neg, (toks[i + 1],)))
            elif t in ("-p", "--protocol"):
                conds.append(("proto", neg, (toks[i + 1].lower(),)))
            elif t in ("-f", "--fragment"):
                conds.append(("fragment", neg, ()))
                i += 1
                neg = False
                continue
            elif t in ("-c", "--set-counters"):
                i += 3
                continue
            elif t.startswith("-") and module is not None and module.startswith("target:"):
                # target options
                if t in _FLAG_OPTIONS:
                    topts[t] = ""
                    i += 1
                elif t in _TWO_VALUE_OPTIONS:
                    topts[t] = f"{toks[i + 1]} {toks[i + 2]}"
                    i += 3
                else:
                    topts[t] = toks[i + 1]
                    i += 2
                neg = False
                continue
            elif t.startswith("-") and module is not None:
                if module == "set" and t == "--set":  # old spelling of --match-set
                    t = "--match-set"
                    val: tuple[str, ...] = (toks[i + 1], toks[i + 2])
                    step = 3
                elif t in _FLAG_OPTIONS:
                    val = ()
                    step = 1
                elif t in _TWO_VALUE_OPTIONS:
                    val = (toks[i + 1], toks[i + 2])
                    step = 3
                else:
                    val = (toks[i + 1],)
                    step = 2
                if module == "comment" and t == "--comment":
                    comment = val[0]
                else:
                    conds.append((f"{module}{t}", neg, val))
                i += step
                neg = False
                continue
            else:
                # keep what parsed so far: a false -s/-d/-p still rules the rule out
                return ParsedRule(chain, tuple(conds), None, False, {}, text=rule.text,
                                  source=rule.source, problem=f"unexpected token {t!r}")
            i += 2
            neg = False
    except IndexError:
        return ParsedRule(chain, tuple(conds), None, False, {}, text=rule.text,
                          source=rule.source, problem="option without a value (line cut short?)")
    return ParsedRule(chain, tuple(conds), target, goto, topts, comment, rule.text, rule.source)


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


def parse_mark(text: str) -> tuple[int, int]:
    """'0x4000/0x4000' -> (value, mask); '0x4000' -> (value, 0xffffffff)."""
    if "/" in text:
        v, m = text.split("/", 1)
        return int(v, 0), int(m, 0)
    return int(text, 0), 0xFFFFFFFF


def port_in(spec: str, port: int) -> bool:
    """'80', '30000:32767', '80,443,8000:8080' (multiport) contain ``port``."""
    for part in spec.split(","):
        if ":" in part:
            lo, hi = part.split(":", 1)
            if int(lo or 0) <= port <= int(hi or 65535):
                return True
        elif part and _port_num(part) == port:
            return True
    return False


_SERVICES = {"http": 80, "https": 443, "ssh": 22, "domain": 53}


def _port_num(text: str) -> int:
    return int(text) if text.isdigit() else _SERVICES.get(text, -1)
