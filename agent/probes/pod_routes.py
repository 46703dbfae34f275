"""Where this node routes its pods: the main table's routes to a link (IPv4: link scope;
IPv6: no gateway, not fe80::/64) and its blackhole routes, as `ip route show table main`
prints them.

A bridge CNI has one connected route to its pod subnet (`172.16.1.0/24 dev cni0 proto
kernel scope link src 172.16.1.1`); a routed one (Calico, Azure CNI's transparent mode,
Cilium) has a /32 route per pod to the pod's own veth (`10.224.0.33 dev azv1a2b3c4d
proto static scope link`) and, for Calico, a blackhole route for the node's block. That
veth is the interface a pod's packet enters by, which kube-proxy's
--detect-local-mode=InterfaceNamePrefix rules (AKS: `-i azv+`) ask. Routes through a
gateway (another node's block, BGP, the default route) say nothing of this node's pods
and are not kept: a node that learns a whole routing table by BGP would otherwise hand
the agent hundreds of thousands of them.

Of the routes to single addresses (one per pod) only the lowest address of each kind of
interface is kept (interfaces named alike but for a trailing hexadecimal or decimal part:
azv1a2b3c4d and azv9f8e7d6c5 are one kind): one pod stands for the pods, and a pod
started or deleted elsewhere on the node leaves the snapshot as it was, so the daemon
does not walk every LB IP again for it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable
from typing import Any

from agent.parse.kernel_name import kernel_name
from agent.probes.base import Probe, ProbeContext, ProbeResult, register
from agent.probes.local_table import RT_TABLE_MAIN, _protocol_names, format_route
from agent.snapshot import LocalRoute, Unknown

RT_SCOPE_LINK = 253
RTN_BLACKHOLE = 6
# routes kept at most: a node has one per pod and per pod subnet (hundreds); more would
# be a routing daemon's table, not the CNI's
MAX_ROUTES = 10_000


def pod_routes_from_messages(links: Iterable[Any], routes: Iterable[Any]
                             ) -> tuple[tuple[LocalRoute, ...], int]:
    """(the main table's link-scope and blackhole routes, the lowest single-address one of
    each kind of interface only; how many more there were than MAX_ROUTES), by family,
    then address."""
    ifnames = {link["index"]: kernel_name(name) for link in links
               if (name := link.get_attr("IFLA_IFNAME")) is not None}
    protocols = _protocol_names()
    out: list[LocalRoute] = []
    # (family, kind of interface) -> (address, the route to it)
    lowest: dict[tuple[int, str], tuple[int, LocalRoute]] = {}
    dropped = 0
    for msg in routes:
        table = msg.get_attr("RTA_TABLE") or msg["table"]
        family = msg["family"]
        if family not in (socket.AF_INET, socket.AF_INET6) or table != RT_TABLE_MAIN:
            continue
        if msg["type"] != RTN_BLACKHOLE and not _direct(msg, family):
            continue
        if len(out) + len(lowest) >= MAX_ROUTES:
            dropped += 1
            continue
        route = format_route(msg, ifnames, protocols)
        single = msg["dst_len"] == (32 if family == socket.AF_INET else 128)
        dst = msg.get_attr("RTA_DST")
        if single and dst is not None and route.dev and msg["type"] != RTN_BLACKHOLE:
            key = (family, _kind(route.dev))
            addr = int(ipaddress.ip_address(dst))
            if key not in lowest or addr < lowest[key][0]:
                lowest[key] = (addr, route)
            continue
        out.append(route)
    out += (r for _, r in lowest.values())
    out.sort(key=lambda r: (":" in r.dst, r.dst, r.dev or ""))
    return tuple(out), dropped


def _direct(msg: Any, family: int) -> bool:
    """A route to a link, not through a gateway: IPv4 says so by its scope; IPv6 routes
    have none (all "universe"), and each interface's fe80::/64 is no pod's."""
    if family == socket.AF_INET:
        return bool(msg["scope"] == RT_SCOPE_LINK)
    if msg.get_attr("RTA_GATEWAY") is not None or msg.get_attr("RTA_MULTIPATH") is not None:
        return False
    dst = msg.get_attr("RTA_DST")
    return dst is not None and not ipaddress.ip_address(dst).is_link_local


def _kind(ifname: str) -> str:
    """An interface's name without its trailing hexadecimal part ("azv1a2b3c4d" ->
    "azv", "cali3f5d1e2a9b8" -> "cali", "eth0" -> "eth")."""
    return ifname.rstrip("0123456789abcdefABCDEF") or ifname


def read_pod_routes() -> tuple[tuple[LocalRoute, ...], int]:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        links = list(ipr.get_links())
        routes = list(ipr.get_routes(family=socket.AF_INET, table=RT_TABLE_MAIN))
        # a kernel booted with ipv6.disable=1 answers the IPv6 dump with an error
        with contextlib.suppress(NetlinkError, OSError):
            routes += ipr.get_routes(family=socket.AF_INET6, table=RT_TABLE_MAIN)
    return pod_routes_from_messages(links, routes)


def render(routes: Iterable[LocalRoute]) -> str:
    """The routes as `ip route` lines (what the bundle's route-main.txt holds)."""
    return "".join(r.line + "\n" for r in routes)


def collect(ctx: ProbeContext) -> ProbeResult:
    routes, dropped = read_pod_routes()
    unknowns = (Unknown("pod routes", f"the main table has {MAX_ROUTES + dropped} link-scope "
                        f"and blackhole routes: {dropped} after the first {MAX_ROUTES} are "
                        "not read"),) if dropped else ()
    return ProbeResult(routes or None, unknowns)


PROBE = register(Probe(name="pod routes", field="routes", collect=collect))
