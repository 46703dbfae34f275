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


def _parse_text(text: str, source: str) -> list[Address]:
    addrs: list[Address] = []
    ifname: str | None = None
    link_up = False
    seen_line = False
    for lineno, raw in enumerate(text.split("\n"), 1):
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
            ifname = m.group(2)
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
        addrs.append(Address(intern(ifname), intern(address), prefixlen, intern(scope),
                             link_up))
    if not seen_line:
        raise InputError(source, None, "empty file")
    return addrs


def _addr_prefix(addr_text: str, peer: str | None, family: str, source: str,
                 lineno: int) -> tuple[str, int]:
    """"10.0.0.10/24" -> ("10.0.0.10", 24); with "peer P/N" the length is on the peer."""
    address, _, plen = addr_text.partition("/")
    if not plen and peer is not None:
        plen = peer.partition("/")[2]
    if family == "inet" and PLAIN_V4.fullmatch(address):
        # what ipaddress would say of it, without it
        if not plen:
            return address, 32
        if not (plen.isascii() and plen.isdigit()) or int(plen) > 32:
            raise InputError(source, lineno, f"bad prefix length in {_short(addr_text)!r}")
        return address, int(plen)
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise InputError(source, lineno, f"bad address {_short(addr_text)!r}") from None
    if (ip.version == 6) != (family == "inet6"):
        raise InputError(source, lineno, f"{family} line with address {address!r}")
    if not plen:
        return str(ip), ip.max_prefixlen  # printed without a length: a host address
    if not (plen.isascii() and plen.isdigit()) or int(plen) > ip.max_prefixlen:
        raise InputError(source, lineno, f"bad prefix length in {_short(addr_text)!r}")
    return str(ip), int(plen)


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
    try:
        ip = ipaddress.ip_address(local)
    except ValueError:
        raise InputError(source, lineno,
                         f"interface {ifname!r}: bad address {_short(local)!r}") from None
    if family not in (None, "inet", "inet6") or not 0 <= plen <= ip.max_prefixlen:
        raise InputError(source, lineno, f"interface {ifname!r}: bad address {local!r}")
    return Address(ifname, str(ip), plen, scope, link_up)


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
