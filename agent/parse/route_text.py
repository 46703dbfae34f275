"""Read the `local` routing table from `ip route show table local` (text or `ip -j` JSON).

Every address the kernel treats as the node's own sits in this table, which is what
makes a packet with such a source "martian" when it arrives from outside.
"""

from __future__ import annotations

import ipaddress
import re
from sys import intern
from typing import Any

from agent.errors import InputError
from agent.parse.ip_text import PLAIN_V4, PLAIN_V4_NET
from agent.parse.json_text import loads
from agent.snapshot import LocalRoute

# Route types `ip route` prints as the first word; a unicast route is printed without one.
_ROUTE_TYPES = frozenset({
    "unicast", "local", "broadcast", "multicast", "anycast", "blackhole", "unreachable",
    "prohibit", "throw", "nat", "xresolve",
})


def parse_local_routes(text: str, source: str = "route-local.txt") -> tuple[LocalRoute, ...]:
    """Parse the local table; an empty file is an error (the table is never empty)."""
    if text.lstrip().startswith("["):
        routes = _parse_json(text, source)
    else:
        routes = _parse_text(text, source)
    return tuple(sorted(routes, key=lambda r: (r.type, r.dst, r.dev or "")))


# The routes the kernel adds for each IPv4 address of the node, as `ip route show table
# local` prints them ("local 10.0.32.1 dev kube-ipvs0 proto kernel scope host src
# 10.0.32.1 "): 20k of them at 10k services, found by one finditer over the text, their
# addresses checked by the same regex (the dotted quads _check_dst/_check_addr pass at
# once), without the general loop's split and word scan. A device named like an
# attribute the loop looks for ("dev", "src") is left to the loop, as is any other line.
_KERNEL_ROUTE = re.compile(rf"^((local|broadcast) ({PLAIN_V4_NET.pattern}) dev "
                           rf"(?!(?:dev|src) )(\S+) proto kernel scope (?:host|link) "
                           rf"src ({PLAIN_V4.pattern})) ?$", re.M)


def _parse_text(text: str, source: str) -> list[LocalRoute]:
    routes: list[LocalRoute] = []
    seen_line = False
    pos = lineno = 0  # where the text not yet read starts, and the lines before it
    for m in _KERNEL_ROUTE.finditer(text):
        start = m.start()
        if start != pos:  # other lines between: the general loop's
            gap = text[pos:start]
            seen_line = _read_lines(gap, lineno, routes, source) or seen_line
            lineno += gap.count("\n")
        lineno += 1
        pos = m.end() + 1
        seen_line = True
        line, rtype, dst, dev, src = m.groups()
        routes.append(LocalRoute(intern(rtype), intern(dst), intern(dev), intern(src), line))
    if pos < len(text):
        seen_line = _read_lines(text[pos:], lineno, routes, source) or seen_line
    if not seen_line:
        raise InputError(source, None, "empty file")
    return routes


def _read_lines(text: str, before: int, routes: list[LocalRoute], source: str) -> bool:
    """Read the routes of ``text`` (lines ``before`` + 1 on) into ``routes``; whether it
    held a line that is not blank."""
    seen_line = False
    for lineno, raw in enumerate(text.split("\n"), before + 1):
        line = raw.strip()
        if not line:
            continue
        seen_line = True
        if raw[:1].isspace() and line.startswith("nexthop"):
            continue  # a multipath route's next hop: the route line above carries dst
        words = line.split()
        if words[0] in _ROUTE_TYPES:
            rtype, words = words[0], words[1:]
        else:
            rtype = "unicast"
        if not words:
            raise InputError(source, lineno, f"route without a destination: {_short(line)!r}")
        dst = _check_dst(words[0], source, lineno)
        dev: str | None = None
        src: str | None = None
        # Only dev and src matter; other attributes ("proto kernel", "mtu lock 1400",
        # flags such as "linkdown") vary in shape and are passed over.
        for i, word in enumerate(words[1:], 1):
            if word not in ("dev", "src"):
                continue
            if i + 1 >= len(words):
                raise InputError(source, lineno, f"{word!r} without a value (line cut off?)")
            if word == "dev":
                dev = words[i + 1]
            else:
                src = _check_addr(words[i + 1], source, lineno)
        # interned: 20k routes of kube-ipvs0 repeat its name, and their addresses are the
        # ones the node's addresses, IPVS and Services hold
        routes.append(LocalRoute(intern(rtype), intern(dst), dev and intern(dev),
                                 src and intern(src), line))
    return seen_line


def _parse_json(text: str, source: str) -> list[LocalRoute]:
    data = _load_json_list(text, source)
    # `ip -j` prints everything on one line; for a pretty-printed file the line of a
    # bad item is not known.
    lineno = 1 if "\n" not in text.strip() else None
    if not data:
        raise InputError(source, None, "empty route list")
    routes: list[LocalRoute] = []
    for n, item in enumerate(data):
        if not isinstance(item, dict):
            raise InputError(source, lineno, f"route [{n}] is not an object")
        rtype = _opt_str(item, "type", n, source, lineno) or "unicast"
        dst_raw = _opt_str(item, "dst", n, source, lineno)
        if dst_raw is None:
            raise InputError(source, lineno, f"route [{n}] has no dst")
        dst = _check_dst(dst_raw, source, lineno)
        dev = _opt_str(item, "dev", n, source, lineno)
        src_raw = _opt_str(item, "prefsrc", n, source, lineno)
        src = _check_addr(src_raw, source, lineno) if src_raw is not None else None
        routes.append(LocalRoute(rtype, dst, dev, src, _json_line(item, rtype, dst)))
    return routes


def _json_line(item: dict[str, Any], rtype: str, dst: str) -> str:
    """The route as `ip route` would print it, so evidence reads the same either way."""
    words = [] if rtype == "unicast" else [rtype]
    words.append(dst)
    for key, word in (("dev", "dev"), ("protocol", "proto"), ("scope", "scope"),
                      ("prefsrc", "src"), ("metric", "metric")):
        value = item.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            words += [word, str(value)]
    return " ".join(words)


def _load_json_list(text: str, source: str) -> list[Any]:
    data = loads(text, source)
    if not isinstance(data, list):
        raise InputError(source, 1, "expected a JSON list (`ip -j` output)")
    return data


def _opt_str(item: dict[str, Any], key: str, n: int, source: str,
             lineno: int | None) -> str | None:
    value = item.get(key)
    if value is not None and not isinstance(value, str):
        raise InputError(source, lineno, f"route [{n}]: {key} is not a string")
    return value


def _check_dst(word: str, source: str, lineno: int | None) -> str:
    if word == "default" or PLAIN_V4_NET.fullmatch(word):
        return word
    try:
        ipaddress.ip_network(word, strict=False)
    except ValueError:
        raise InputError(source, lineno,
                         f"expected a route destination, got {_short(word)!r}") from None
    return word


def _check_addr(word: str, source: str, lineno: int | None) -> str:
    if PLAIN_V4.fullmatch(word):
        return word
    try:
        ipaddress.ip_address(word)
    except ValueError:
        raise InputError(source, lineno, f"bad source address {_short(word)!r}") from None
    return word


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
