"""The `local` routing tables (table 255) of IPv4 and IPv6, as `ip route show table local`
and `ip -6 route show table local` print them.

An address is "local" exactly when it is in this table: an IPv4 packet from it arriving
on eth0 is a martian, an IPv6 one is taken in and answered to the node itself (IPv6 has
no martian-source check; README "How it decides"). The kernel adds the `local` route of
an address even when its interface is administratively DOWN (only the broadcast/prefix
routes wait for IFF_UP), which is why a DOWN kube-ipvs0 still makes its VIPs local.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent.numbers import is_number
from agent.parse.kernel_name import kernel_name
from agent.probes.addresses import scope_name
from agent.probes.base import Probe, ProbeContext, ProbeResult, register
from agent.snapshot import LocalRoute

RT_TABLE_LOCAL = 255
RT_TABLE_MAIN = 254

# rtm_type names (iproute2 rtnl_rtntype_n2a).
ROUTE_TYPES = {0: "none", 1: "unicast", 2: "local", 3: "broadcast", 4: "anycast",
               5: "multicast", 6: "blackhole", 7: "unreachable", 8: "prohibit", 9: "throw",
               10: "nat", 11: "xresolve"}

# rtm_protocol names built into iproute2 (rt_protos adds/overrides these).
_PROTOCOLS = {0: "unspec", 1: "redirect", 2: "kernel", 3: "boot", 4: "static", 8: "gated",
              9: "ra", 10: "mrt", 11: "zebra", 12: "bird", 13: "dnrouted", 14: "xorp",
              15: "ntk", 16: "dhcp", 18: "keepalived", 42: "babel", 99: "openr", 186: "bgp",
              187: "isis", 188: "ospf", 189: "rip", 192: "eigrp"}

# Route flags in the order iproute2's print_rt_flags prints them.
_FLAGS = ((0x1, "dead"), (0x4, "onlink"), (0x2, "pervasive"), (0x8, "offload"),
          (0x40, "trap"), (0x100, "notify"), (0x10, "linkdown"), (0x20, "unresolved"),
          (0x4000, "rt_offload"), (0x8000, "rt_trap"), (0x20000000, "rt_offload_failed"))
RTM_F_CLONED = 0x200
_PREFS = {0: "medium", 1: "high", 3: "low"}  # ICMPV6_ROUTER_PREF_*
RTPROT_BOOT = 3


def _protocol_names() -> dict[int, str]:
    """Built-ins plus /etc/iproute2/rt_protos, as `ip` resolves them."""
    names = dict(_PROTOCOLS)
    for path in (Path("/etc/iproute2/rt_protos"), Path("/usr/share/iproute2/rt_protos")):
        try:
            # (a byte that is not UTF-8 in a name there cost every local route)
            text = path.read_bytes().decode("utf-8", "replace")
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split("#", 1)[0].split()
            if len(parts) >= 2 and is_number(parts[0]):
                names[int(parts[0])] = parts[1]
        break
    return names


def format_route(msg: Any, ifnames: dict[int, str], protocols: dict[int, str]) -> LocalRoute:
    """One RTM_NEWROUTE message -> LocalRoute with `line` as `ip route show table local`
    prints it (trailing blank removed: iproute2 ends every field with one)."""
    rtype = ROUTE_TYPES.get(msg["type"], str(msg["type"]))
    dst_len = msg["dst_len"]
    host_len = 32 if msg["family"] == socket.AF_INET else 128
    dst_attr = msg.get_attr("RTA_DST")
    if dst_attr is not None:
        dst = dst_attr if dst_len == host_len else f"{dst_attr}/{dst_len}"
    elif dst_len:
        dst = f"0/{dst_len}"
    else:
        dst = "default"
    words = [] if rtype == "unicast" else [rtype]
    words.append(dst)
    src_attr = msg.get_attr("RTA_SRC")
    if src_attr is not None:
        words += ["from", src_attr if msg["src_len"] == host_len
                  else f"{src_attr}/{msg['src_len']}"]
    elif msg["src_len"]:
        words += ["from", f"0/{msg['src_len']}"]
    if msg["tos"]:
        words += ["tos", f"0x{msg['tos']:02x}"]
    gateway = msg.get_attr("RTA_GATEWAY")
    if gateway is not None:
        words += ["via", gateway]
    oif = msg.get_attr("RTA_OIF")
    dev = None
    if oif is not None:
        dev = ifnames.get(oif, f"if{oif}")
        words += ["dev", dev]
    # No "table local": `ip` omits the table it was asked to show.
    if not msg["flags"] & RTM_F_CLONED:
        if msg["proto"] != RTPROT_BOOT:
            words += ["proto", protocols.get(msg["proto"], str(msg["proto"]))]
        if msg["scope"] != 0:
            words += ["scope", scope_name(msg["scope"])]
    prefsrc = msg.get_attr("RTA_PREFSRC")
    if prefsrc is not None:
        words += ["src", prefsrc]
    priority = msg.get_attr("RTA_PRIORITY")
    if priority is not None:
        words += ["metric", str(priority)]
    pref = msg.get_attr("RTA_PREF")  # IPv6 router preference (RFC 4191), as ip prints it
    if pref is not None:
        words += ["pref", _PREFS.get(pref, str(pref))]
    words += [name for bit, name in _FLAGS if msg["flags"] & bit]
    return LocalRoute(type=rtype, dst=dst, dev=dev, src=prefsrc, line=" ".join(words))


def routes_from_messages(links: Iterable[Any], routes: Iterable[Any]) -> tuple[LocalRoute, ...]:
    ifnames = {link["index"]: kernel_name(name) for link in links
               if (name := link.get_attr("IFLA_IFNAME")) is not None}
    protocols = _protocol_names()
    out = []
    for msg in routes:
        table = msg.get_attr("RTA_TABLE") or msg["table"]
        if msg["family"] not in (socket.AF_INET, socket.AF_INET6) or table != RT_TABLE_LOCAL:
            continue
        out.append(format_route(msg, ifnames, protocols))
    out.sort(key=lambda r: (r.type, r.dst, r.dev or ""))
    return tuple(out)


def collect(ctx: ProbeContext) -> ProbeResult:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        links = list(ipr.get_links())
        routes = list(ipr.get_routes(family=socket.AF_INET, table=RT_TABLE_LOCAL))
        # a kernel booted with ipv6.disable=1 answers the IPv6 dump with an error
        with contextlib.suppress(NetlinkError, OSError):
            routes += ipr.get_routes(family=socket.AF_INET6, table=RT_TABLE_LOCAL)
    return ProbeResult(routes_from_messages(links, routes))


PROBE = register(Probe(name="local routes", field="local_routes", collect=collect))
