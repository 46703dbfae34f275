"""Checking addresses in tool output cheaply: a big dump holds hundreds of thousands, and
``ipaddress`` costs microseconds each. Canonical dotted-quad IPv4 (what every tool prints)
is checked with one regex; everything else goes to ``ipaddress``."""

from __future__ import annotations

import functools
import ipaddress
import re

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_V4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")
_V4_NET = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}/(?:3[0-2]|[12]?\d)")
# Dotted quads (and prefixes) in the one form ``ipaddress`` prints, ASCII digits only: what
# these match ``ipaddress`` takes as it is; what they do not, it decides (a reader's quick
# path around ``ipaddress``, which costs microseconds per address).
ASCII_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
PLAIN_V4 = re.compile(rf"{ASCII_OCTET}(?:\.{ASCII_OCTET}){{3}}")
PLAIN_V4_NET = re.compile(rf"{ASCII_OCTET}(?:\.{ASCII_OCTET}){{3}}(?:/(?:3[0-2]|[12]?[0-9]))?")


def host_port(ip: str, port: int | str) -> str:
    """``10.0.0.1:80``, ``[2001:db8::1]:80`` (an IPv6 address before a port is bracketed:
    2001:db8::1:80 is another address)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@functools.lru_cache(maxsize=65536)
def ip_number(text: str) -> tuple[int, int] | None:
    """(IP version, integer) of an address; None when it is not one (a walk asks it of a
    packet's addresses at every address match)."""
    if PLAIN_V4.fullmatch(text):
        return 4, quad_number(text)
    try:
        a = ipaddress.ip_address(text)
    except ValueError:
        return None
    return a.version, int(a)


# 64k: kube-proxy names each endpoint's address in its endpoint chain (25k at 10k
# services), and an LRU smaller than what a walk asks evicts every entry before reuse
@functools.lru_cache(maxsize=65536)
def ip_span(pat: str) -> tuple[int, int, int]:
    """(IP version, first, last) of an address, a prefix or a range (nft lists an
    interval set's merged prefixes as "203.0.113.0-203.0.113.191"); ValueError for
    anything else."""
    if "-" in pat:
        a, b = (ipaddress.ip_address(x.strip()) for x in pat.split("-", 1))
        if a.version != b.version or int(a) > int(b):
            raise ValueError(f"not a range: {pat}")
        return a.version, int(a), int(b)
    if PLAIN_V4.fullmatch(pat):  # one address (an endpoint's, a cluster IP)
        n = quad_number(pat)
        return 4, n, n
    net = ipaddress.ip_network(pat, strict=False)
    return net.version, int(net.network_address), int(net.broadcast_address)


def quad_number(text: str) -> int:
    """A PLAIN_V4 address's integer by str.split (ipaddress took 3 us: a tenth of an
    nftables-mode walk)."""
    a, b, c, d = text.split(".")
    return (int(a) << 24) | (int(b) << 16) | (int(c) << 8) | int(d)


def canonical_ip(text: str) -> str | None:
    """The address in canonical form, or None when ``text`` is not one."""
    if _V4.fullmatch(text):
        return text
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def is_network(text: str) -> bool:
    """An address or a prefix ("10.0.0.0/8", "10.0.0.5"), host bits allowed."""
    if _V4_NET.fullmatch(text) or _V4.fullmatch(text):
        return True
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True
