"""Read interface addresses from `ip addr show` (text) or `ip -j addr show` (JSON).

``link_up`` is the administrative UP flag of the interface: kube-proxy's kube-ipvs0 is
kept DOWN, yet its addresses are still local (they are in the local table), which is
exactly the case that makes a load balancer's VIP a martian source on this node.
"""

from __future__ import annotations

import ipaddress
import re
from sys import intern
from typing import Any

from agent.errors import InputError
from agent.parse.ip_text import PLAIN_V4
from agent.parse.json_text import loads
from agent.snapshot import Address

# "4: eth0@if5: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 ..." ("@..." names the peer).
_IFACE = re.compile(r"^(\d+):\s+([^\s@:]+)(?:@[^\s:]*)?:\s+<([^>]*)>")
# "    inet 10.0.0.10/24 brd 10.0.0.255 scope global eth0"
_ADDR = re.compile(r"^(inet6?)\s+(\S+)(.*)$")


def parse_addresses(text: str, source: str = "addr.txt") -> tuple[Address, ...]:
    """Parse `ip addr show` / `ip -j addr show`; an empty file is an error."""
    if text.lstrip().startswith("["):
        addrs = _parse_json(text, source)
    else:
        addrs = _parse_text(text, source)
    return tuple(sorted(addrs, key=_sort_key))


def _sort_key(a: Address) -> tuple[str, int, str]:
    return (a.ifname, 6 if ":" in a.address else 4, a.address)


# An IPv4 address line of the plain form and the lifetime line under it, as `ip addr`
# prints each address kube-proxy binds on kube-ipvs0 ("    inet 10.0.32.1/32 scope
# global kube-ipvs0" + "       valid_lft forever preferred_lft forever"): 20k of them at
# 10k services, found by one finditer over the text and read without the general loop's
# strip, split and address checks (the regex holds what they pass at once). Any other
# line goes to the loop.
_PLAIN_ADDR = re.compile(rf"^    inet ({PLAIN_V4.pattern})/(3[0-2]|[12]?[0-9]) "
                         r"scope (global|host|link|site) \S+(?:\n {7}valid_lft [^\n]*)?$",
                         re.M)


def _parse_text(text: str, source: str) -> list[Address]:
    addrs: list[Address] = []
    state: tuple[str | None, bool, bool] = (None, False, False)  # ifname, link up, a line
    pos = lineno = 0  # where the text not yet read starts, and the lines before it
    for m in _PLAIN_ADDR.finditer(text):
        start = m.start()
        if start != pos:  # other lines between: the general loop's
            gap = text[pos:start]
            state = _read_lines(gap, lineno, state, addrs, source)
            lineno += gap.count("\n")
        lineno += 1
        ifname, link_up, _ = state
        if ifname is None:
            raise InputError(source, lineno, "address line before any interface line")
        state = (ifname, link_up, True)
        end = m.end()
        lineno += text.count("\n", start, end)
        pos = end + 1
        address, plen, scope = m.groups()
        addrs.append(Address(ifname, intern(address), int(plen), intern(scope), link_up))
    if pos < len(text):
        state = _read_lines(text[pos:], lineno, state, addrs, source)
    if not state[2]:
        raise InputError(source, None, "empty file")
    return addrs


def _read_lines(text: str, before: int, state: tuple[str | None, bool, bool],
                addrs: list[Address], source: str) -> tuple[str | None, bool, bool]:
    """Read the lines of ``text`` (lines ``before`` + 1 on) into ``addrs``, from
    ``state`` (the interface they are under, whether it is up, whether a line that is not
    blank was seen); the state after them."""
    ifname, link_up, seen_line = state
    for lineno, raw in enumerate(text.split("\n"), before + 1):
        line = raw.strip()
        if not line:
            continue
        seen_line = True
        if not raw[:1].isspace():
            m = _IFACE.match(line)
            if not m:
                raise InputError(source, lineno,
                                 f"expected an interface line such as '2: eth0: <...>', "
                                 f"got {_short(line)!r}")
            ifname = intern(m.group(2))
            link_up = "UP" in m.group(3).split(",")
            continue
        m = _ADDR.match(line)
        if not m:
            continue  # link/ether, valid_lft, altname, vf ... lines carry nothing we need
        if ifname is None:
            raise InputError(source, lineno, "address line before any interface line")
        family, addr_text, rest = m.groups()
        words = rest.split()
        peer = words[words.index("peer") + 1] if "peer" in words[:-1] else None
        address, prefixlen = _addr_prefix(addr_text, peer, family, source, lineno)
        scope = words[words.index("scope") + 1] if "scope" in words[:-1] else "global"
        # interned: kube-ipvs0 holds 20k addresses, each one a route's too
        addrs.append(Address(ifname, intern(address), prefixlen, intern(scope), link_up))
    return ifname, link_up, seen_line


def _addr_prefix(addr_text: str, peer: str | None, family: str, source: str,
                 lineno: int) -> tuple[str, int]:
    """"10.0.0.10/24" -> ("10.0.0.10", 24); with "peer P/N" the length is on the peer."""
    address, _, plen = addr_text.partition("/")
    if not plen and peer is not None:
        plen = peer.partition("/")[2]
    got = _address(address)
    if got is None:
        raise InputError(source, lineno, f"bad address {_short(addr_text)!r}")
    canonical, longest = got
    if (longest == 128) != (family == "inet6"):
        raise InputError(source, lineno, f"{family} line with address {address!r}")
    if not plen:
        return canonical, longest  # printed without a length: a host address
    if not (plen.isascii() and plen.isdigit()) or int(plen) > longest:
        raise InputError(source, lineno, f"bad prefix length in {_short(addr_text)!r}")
    return canonical, int(plen)


def _address(text: str) -> tuple[str, int] | None:
    """(the address as ipaddress writes it, its family's longest prefix), or None where
    ipaddress refuses it; a plain dotted quad (20k on kube-ipvs0 at 10k services) is taken
    as it is, without ipaddress."""
    if PLAIN_V4.fullmatch(text):
        return text, 32
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return str(ip), ip.max_prefixlen


def _parse_json(text: str, source: str) -> list[Address]:
    data = loads(text, source)
    if not isinstance(data, list):
        raise InputError(source, 1, "expected a JSON list (`ip -j addr show` output)")
    if not data:
        raise InputError(source, None, "empty interface list")
    # `ip -j` prints everything on one line; for a pretty-printed file the line of a
    # bad item is not known.
    lineno = 1 if "\n" not in text.strip() else None
    addrs: list[Address] = []
    for n, link in enumerate(data):
        if not isinstance(link, dict):
            raise InputError(source, lineno, f"interface [{n}] is not an object")
        if not link:
            continue  # `ip -j addr show up` prints {} for interfaces filtered out
        ifname = link.get("ifname")
        flags = link.get("flags", [])
        infos = link.get("addr_info", [])
        if not isinstance(ifname, str) or not ifname:
            raise InputError(source, lineno, f"interface [{n}] has no ifname")
        if not isinstance(flags, list) or not isinstance(infos, list):
            raise InputError(source, lineno,
                             f"interface {ifname!r}: flags/addr_info are not lists")
        link_up = "UP" in flags
        for info in infos:
            addrs.append(_json_addr(info, ifname, link_up, source, lineno))
    return addrs


def _json_addr(info: Any, ifname: str, link_up: bool, source: str,
               lineno: int | None) -> Address:
    if not isinstance(info, dict):
        raise InputError(source, lineno, f"interface {ifname!r}: address is not an object")
    local, plen, scope = info.get("local"), info.get("prefixlen"), info.get("scope", "global")
    family = info.get("family")
    if not isinstance(local, str) or not isinstance(scope, str) \
            or not isinstance(plen, int) or isinstance(plen, bool):
        raise InputError(source, lineno,
                         f"interface {ifname!r}: address without local/prefixlen/scope")
    got = _address(local)
    if got is None:
        raise InputError(source, lineno,
                         f"interface {ifname!r}: bad address {_short(local)!r}")
    address, longest = got
    if family not in (None, "inet", "inet6") or not 0 <= plen <= longest:
        raise InputError(source, lineno, f"interface {ifname!r}: bad address {local!r}")
    return Address(ifname, address, plen, scope, link_up)


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
