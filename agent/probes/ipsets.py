"""All ipsets with their members, read over netlink (pyroute2; no `ipset` binary needed).

Members are spelled as `ipset save` prints them ("10.0.0.5,tcp:80",
"10.244.0.0/16", "10.0.0.5,tcp:80,10.244.1.5", "30080"), plus " nomatch" for
nomatch entries; per-entry extensions (timeout, counters, comment, skb*) are not
membership and are left out. KUBE-LOAD-BALANCER-LOCAL & co. tell which LB IPs
kube-proxy (IPVS mode) treats as externalTrafficPolicy: Local.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from typing import Any

from agent.numbers import is_number
from agent.probes.base import (
    CommandError,
    Probe,
    ProbeContext,
    ProbeResult,
    cached,
    kernel_module_present,
    register,
    run_command,
)
from agent.probes.markers import ipset_digest
from agent.snapshot import IpSet, Unknown

SOURCE = "ipsets"

IPSET_FLAG_PHYSDEV = 1 << 1  # CADT flag: iface element is "physdev:NAME"
IPSET_FLAG_NOMATCH = 1 << 2  # CADT flag: entry added with "nomatch"

# getprotobynumber() names from /etc/protocols, which is what `ipset save` prints.
_PROTO_NAMES = {1: "icmp", 6: "tcp", 17: "udp", 58: "ipv6-icmp", 132: "sctp", 136: "udplite"}


# ICMP (type, code) -> the name `ipset save` prints (the standard names iptables'
# --icmp-type also uses; the first of ipset's aliases, e.g. echo-request not ping).
_ICMP_NAMES = {
    (0, 0): "echo-reply", (3, 0): "network-unreachable", (3, 1): "host-unreachable",
    (3, 2): "protocol-unreachable", (3, 3): "port-unreachable",
    (3, 4): "fragmentation-needed", (3, 5): "source-route-failed", (3, 6): "network-unknown",
    (3, 7): "host-unknown", (3, 9): "network-prohibited", (3, 10): "host-prohibited",
    (3, 11): "TOS-network-unreachable", (3, 12): "TOS-host-unreachable",
    (3, 13): "communication-prohibited", (3, 14): "host-precedence-violation",
    (3, 15): "precedence-cutoff", (4, 0): "source-quench", (5, 0): "network-redirect",
    (5, 1): "host-redirect", (5, 2): "TOS-network-redirect", (5, 3): "TOS-host-redirect",
    (8, 0): "echo-request", (9, 0): "router-advertisement", (10, 0): "router-solicitation",
    (11, 0): "ttl-zero-during-transit", (11, 1): "ttl-zero-during-reassembly",
    (12, 0): "ip-header-bad", (12, 1): "required-option-missing",
    (13, 0): "timestamp-request", (14, 0): "timestamp-reply",
    (17, 0): "address-mask-request", (18, 0): "address-mask-reply",
}


def _proto_names() -> dict[int, str]:
    names = dict(_PROTO_NAMES)
    try:
        with open("/etc/protocols") as f:
            for line in f:
                parts = line.split("#", 1)[0].split()
                if len(parts) >= 2 and is_number(parts[1]):
                    names.setdefault(int(parts[1]), parts[0])
    except OSError:
        pass
    return names


def _attrs(nla: Any) -> dict[str, Any]:
    """A pyroute2 nla (or its plain {"attrs": [...]} form) -> {name: value}."""
    pairs = nla["attrs"] if not isinstance(nla, list) else nla
    return {item[0]: item[1] for item in pairs}


def _ip(value: Any) -> str | None:
    """IPSET_ATTR_IP* is a nested {IPADDR_IPV4|IPADDR_IPV6: "a.b.c.d"}."""
    if value is None:
        return None
    inner = _attrs(value)
    return inner.get("IPSET_ATTR_IPADDR_IPV4") or inner.get("IPSET_ATTR_IPADDR_IPV6")


def _with_cidr(ip: str, cidr: int | None) -> str:
    host = 128 if ":" in ip else 32
    return ip if cidr is None or cidr == host else f"{ip}/{cidr}"


def format_member(set_type: str, data: dict[str, Any], protos: dict[int, str]) -> str:
    """One IPSET_ATTR_DATA of a list dump -> the member as `ipset save` prints it.

    The components come from the type name ("hash:ip,port,net" -> ip, port, net); the
    first ip/net uses IP/CIDR, the second IP2/CIDR2.
    """
    parts = []
    addresses_seen = 0
    for comp in set_type.split(":", 1)[1].split(","):
        if comp in ("ip", "net"):
            if addresses_seen == 0:
                ip = _ip(data.get("IPSET_ATTR_IP_FROM") or data.get("IPSET_ATTR_IP"))
                cidr = data.get("IPSET_ATTR_CIDR")
                ip_to = _ip(data.get("IPSET_ATTR_IP_TO"))
            else:
                ip = _ip(data.get("IPSET_ATTR_IP2"))
                cidr = data.get("IPSET_ATTR_CIDR2")
                ip_to = _ip(data.get("IPSET_ATTR_IP2_TO"))
            addresses_seen += 1
            if ip is None:
                raise ValueError(f"{set_type} member without an address: {data}")
            text = _with_cidr(ip, cidr)
            if ip_to is not None:  # a range (bitmap:ip, hash:net,... with ranges)
                text += "-" + _with_cidr(ip_to, cidr)
            parts.append(text)
        elif comp == "port":
            port = data.get("IPSET_ATTR_PORT_FROM", data.get("IPSET_ATTR_PORT"))
            port_to = data.get("IPSET_ATTR_PORT_TO")
            text = str(port) if port_to is None else f"{port}-{port_to}"
            proto = data.get("IPSET_ATTR_PROTO")
            if proto is not None:  # hash:*,port types; bitmap:port has none
                if proto in (1, 58) and port is not None:
                    # The ICMP "port" is type<<8|code; ipset names the well-known
                    # ICMPv4 pairs. ICMPv6 names are not mapped (kube-proxy never
                    # stores ICMP entries): they print as type/code.
                    pair = (port >> 8, port & 0xFF)
                    name = _ICMP_NAMES.get(pair) if proto == 1 else None
                    text = name or f"{pair[0]}/{pair[1]}"
                text = f"{protos.get(proto, str(proto))}:{text}"
            parts.append(text)
        elif comp == "mac":
            parts.append(str(data.get("IPSET_ATTR_ETHER", "")).upper())
        elif comp == "iface":
            flags = data.get("IPSET_ATTR_CADT_FLAGS", 0) or 0
            prefix = "physdev:" if flags & IPSET_FLAG_PHYSDEV else ""
            parts.append(prefix + str(data.get("IPSET_ATTR_IFACE", "")))
        elif comp == "mark":
            parts.append(f"0x{data.get('IPSET_ATTR_MARK', 0):08x}")
        elif comp == "set":  # list:set
            parts.append(str(data.get("IPSET_ATTR_NAME", "")))
        else:
            raise ValueError(f"unknown ipset element kind {comp!r} in {set_type}")
    member = ",".join(parts)
    if (data.get("IPSET_ATTR_CADT_FLAGS", 0) or 0) & IPSET_FLAG_NOMATCH:
        member += " nomatch"
    return member


def sets_from_messages(messages: Iterable[Any]) -> tuple[IpSet, ...]:
    """An IPSET_CMD_LIST dump -> sorted IpSets.

    A big set arrives split over several messages with the same name, only the first
    with the set's type; they merge.
    """
    protos = _proto_names()
    types: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for msg in messages:
        top = _attrs(msg)
        name = top.get("IPSET_ATTR_SETNAME")
        # only a set's first message carries its header (type, family...): the kernel's
        # continuations of a big set name the set and hold members (a 10k-member set
        # came back with 1,005 when they were skipped)
        set_type = top.get("IPSET_ATTR_TYPENAME") or types.get(name or "")
        if name is None or set_type is None:
            continue
        types[name] = set_type
        bucket = members.setdefault(name, [])
        adt = top.get("IPSET_ATTR_ADT")
        if adt is None:
            continue
        for item in adt["attrs"]:
            if item[0] == "IPSET_ATTR_DATA":
                bucket.append(format_member(set_type, _attrs(item[1]), protos))
    return tuple(IpSet(name=n, type=types[n], members=tuple(sorted(members[n])))
                 for n in sorted(types))


# --- `ipset save` text (fallback reader and the bundle renderer) ---------------------

# Per-entry options that carry a value; "nomatch" is the only bare flag.
_VALUED_OPTIONS = {"timeout", "packets", "bytes", "comment", "skbmark", "skbprio", "skbqueue"}


def parse_ipset_save(text: str) -> tuple[IpSet, ...]:
    """`ipset save` output -> IpSets with the same member spelling as the netlink path."""
    types: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) >= 3 and words[0] == "create":
            types[words[1]] = words[2]
            members.setdefault(words[1], [])
        elif len(words) >= 3 and words[0] == "add":
            rest = words[3:]
            nomatch = False
            i = 0
            while i < len(rest):
                if rest[i] == "nomatch":
                    nomatch = True
                i += 2 if rest[i] in _VALUED_OPTIONS else 1
            members.setdefault(words[1], []).append(words[2] + (" nomatch" if nomatch else ""))
    return tuple(IpSet(name=n, type=types.get(n, "unknown"), members=tuple(sorted(m)))
                 for n, m in sorted(members.items()))


def render_ipset_save(sets: Iterable[IpSet]) -> str:
    """IpSets -> `ipset save`-shaped text (for a bundle written without the binary).

    Only the family survives of the create options: that is all the snapshot keeps.
    """
    out = []
    for s in sets:
        first = s.members[0].split(",", 1)[0] if s.members else ""
        family = ""
        if not s.type.startswith(("bitmap:", "list:")):
            family = " family inet6" if ":" in first else " family inet"
        out.append(f"create {s.name} {s.type}{family}\n")
        out.extend(f"add {s.name} {m}\n" for m in s.members)
    return "".join(out)


def _via_netlink() -> tuple[IpSet, ...]:
    from pyroute2 import IPSet as IPSetSocket

    with IPSetSocket() as sock:
        return sets_from_messages(list(sock.list()))


def collect(ctx: ProbeContext) -> ProbeResult:
    # the daemon re-reads (and re-parses: 1-2 s for IPVS mode's 60k members at 10k
    # services) only when the raw dump's digest moved
    return cached(ctx, SOURCE, ipset_digest, lambda: _collect(ctx))


def _collect(ctx: ProbeContext) -> ProbeResult:
    if not kernel_module_present("ip_set"):
        # No ip_set in the kernel means no sets; asking nfnetlink anyway would make
        # the kernel modprobe ip_set.
        return ProbeResult(())
    try:
        return ProbeResult(_via_netlink())
    except Exception as exc:  # pyroute2 raises many kinds (protocol version, EPERM...)
        netlink_error = f"{type(exc).__name__}: {exc}"
    # pyroute2 could not list (e.g. a kernel ipset protocol it does not speak):
    # `ipset save` speaks every protocol version, so use it when it is installed.
    try:
        text = run_command(["ipset", "save"], ctx.timeout)
    except CommandError as exc:
        return ProbeResult(None, (Unknown(SOURCE, f"netlink: {netlink_error}; {exc}"),))
    return ProbeResult(parse_ipset_save(text))


PROBE = register(Probe(name=SOURCE, field="ipsets", collect=collect))
