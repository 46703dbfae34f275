"""Where a server listens: "HOST:PORT", "[IPV6]:PORT", or ":PORT" for every address of
the host, IPv6 and IPv4 alike where it has IPv6 (an IPv6-only cluster probes and scrapes
pods on IPv6; a socket on 0.0.0.0 refuses it, and the kubelet restarts the pod)."""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# what an IPv6 socket fails with where the kernel has no IPv6 (booted with ipv6.disable=1;
# disable_ipv6 sysctls leave "::" bindable, IPv4 reaching it)
_NO_IPV6 = (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT)


def split_listen(text: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" ("" for every address; an IPv6 one without its
    brackets)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    """The family and the address to bind for ``host``: an address as it is; a name
    resolved once, to its first IPv4 address as an IPv4 socket's bind would, else (no
    IPv4 address: an IPv6-only node's own name, which that bind failed to resolve) its
    first IPv6 one. A name that resolves to neither raises the IPv4 lookup's OSError."""
    if ":" in host:
        return socket.AF_INET6, host
    if not host or _is_ipv4(host):
        return socket.AF_INET, host
    first: OSError | None = None
    for family in (socket.AF_INET, socket.AF_INET6):  # (AAAA asked only without an A)
        try:
            found = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
        except UnicodeError:  # (a label longer than 63 characters)
            raise OSError(errno.EINVAL, f"{host!r} is not a host name") from None
        except OSError as e:
            first = first or e
            continue
        if found:
            return family, str(found[0][4][0])
    raise first or OSError(errno.EADDRNOTAVAIL, f"{host} has no address")


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def dual_stack(sock: socket.socket, host: str) -> None:
    """An IPv6 socket on "::" takes IPv4 connections too (as ::ffff:a.b.c.d), whatever
    net.ipv6.bindv6only says."""
    if sock.family == socket.AF_INET6 and host == "::":
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)


def on_every_address(bind: Callable[[str], T]) -> T:
    """``bind("::")``, or ``bind("0.0.0.0")`` where the host has no IPv6."""
    try:
        return bind("::")
    except OSError as e:
        if e.errno not in _NO_IPV6:
            raise
    return bind("0.0.0.0")
