"""Addresses bound on the node's interfaces (what `ip addr show` lists), via rtnetlink.

kube-ipvs0 is the one that matters: kube-proxy (IPVS mode) binds ClusterIPs and
LoadBalancer IPs there, which puts them in the local table.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

from agent.parse.kernel_name import kernel_name
from agent.probes.base import Probe, ProbeContext, ProbeResult, register
from agent.snapshot import Address

IFF_UP = 0x1

# rtnetlink scope numbers -> the names `ip` prints (iproute2's rtnl_rtscope_n2a);
# any other number is printed as the number.
SCOPE_NAMES = {0: "global", 200: "site", 253: "link", 254: "host", 255: "nowhere"}


def scope_name(scope: int) -> str:
    return SCOPE_NAMES.get(scope, str(scope))


def addresses_from_messages(links: Iterable[Any], addrs: Iterable[Any]) -> tuple[Address, ...]:
    """RTM_NEWLINK + RTM_NEWADDR dumps (pyroute2 messages) -> sorted Address tuple."""
    names: dict[int, tuple[str, bool]] = {}
    for link in links:
        name = link.get_attr("IFLA_IFNAME")
        name = kernel_name(name) if name is not None else None
        # IFF_UP is the administrative state: a DOWN kube-ipvs0 still holds addresses
        # that are in the local table, so it is reported with link_up False, not hidden.
        names[link["index"]] = (name or f"if{link['index']}", bool(link["flags"] & IFF_UP))
    out = []
    for msg in addrs:
        family = msg["family"]
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        # `ip addr` shows IFA_LOCAL (our own address) when present; IFA_ADDRESS is the
        # peer on point-to-point links, and the only one for IPv6.
        address = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
        if address is None:
            continue
        ifname, up = names.get(msg["index"], (f"if{msg['index']}", False))
        out.append(Address(ifname=ifname, address=address, prefixlen=msg["prefixlen"],
                           scope=scope_name(msg["scope"]), link_up=up))
    out.sort(key=lambda a: (a.ifname, 0 if ":" not in a.address else 1, a.address))
    return tuple(out)


def collect(ctx: ProbeContext) -> ProbeResult:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        links = list(ipr.get_links())
        addrs = list(ipr.get_addr())
    return ProbeResult(addresses_from_messages(links, addrs))


PROBE = register(Probe(name="addresses", field="addresses", collect=collect))
