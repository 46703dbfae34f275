"""Facts derived from a snapshot that several rules need: which addresses are local,
the uplink, the pod network of this node, ipsets as lookup tables, kube-proxy's mode."""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass, field

from agent.diagnose.model import KubeProxyMode, as_mode
from agent.parse.ip_text import PLAIN_V4, quad_number
from agent.snapshot import (
    Address,
    IpSet,
    IpvsVirtualServer,
    LocalRoute,
    Netfilter,
    NodeSnapshot,
    Table,
)

KUBE_IPVS0 = "kube-ipvs0"
_UPLINK_NAME = re.compile(r"^(eth|ens|enp|eno|enx|em|bond|eni)\d")
_POD_BRIDGES = ("cni0", "cbr0", "kube-bridge", "cilium_host", "weave", "docker0")
_NOT_PODS = {"lo", KUBE_IPVS0}


@dataclass(frozen=True, slots=True)
class PodNetwork:
    pod_ip: str
    prefix: str
    iface: str | None  # where pod packets enter the node (the pod bridge); None if unknown
    how: str  # evidence: how we chose it


# the client a walk sends from outside the cluster (a documentation address, never a
# node's)
OUTSIDE_CLIENT = "198.51.100.7"
# stands for the node's own address where the input shows none (rules-only pastes): a
# NodePort is reached on some address of the node, and that is all the rules ask of it
NODE_STAND_IN = "192.0.2.10"
# the source of a pod's packet where the pod network is unknown (the walk never reads it:
# every match on it forks)
POD_STAND_IN = "192.0.2.77"
# the same stand-ins for an IPv6 walk (RFC 9637's documentation prefix 3fff::/20)
OUTSIDE_CLIENT6 = "3fff:0:0:7::7"
NODE_STAND_IN6 = "3fff::10"
POD_STAND_IN6 = "3fff::77"


@dataclass
class NodeFacts:
    snapshot: NodeSnapshot
    local_ips: dict[str, LocalRoute] = field(default_factory=dict)
    # the `local` routes of a prefix (127.0.0.0/8, an IPv6 one), both families
    local_nets: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, LocalRoute]] = \
        field(default_factory=list)
    broadcast: set[str] = field(default_factory=set)
    uplink: str | None = None
    node_ip: str | None = None
    uplink_how: str = ""
    pod: PodNetwork | None = None
    pod_unknown: str = ""
    # the IPv6 side of a dual-stack or IPv6-only node: the node's global IPv6 address (on
    # the uplink, or the Node's IPv6 InternalIP) and this node's IPv6 pod prefix
    node_ip6: str | None = None
    pod6: PodNetwork | None = None
    pod6_unknown: str = ""
    # the address family a walk over these facts speaks (ipv6_facts makes a view of 6),
    # and the stand-ins it sends from or to where the input shows no address
    family: int = 4
    outside_client: str = OUTSIDE_CLIENT
    node_stand_in: str = NODE_STAND_IN
    pod_stand_in: str = POD_STAND_IN
    # addresses known to be the node's own although the input lists none (a stand-in
    # for "the node's address" in a walk): LOCAL for addrtype, whatever else is unknown
    assumed_local: frozenset[str] = frozenset()
    # addresses that are never the node's (the documentation-range client a walk sends
    # from outside): UNICAST for addrtype even when the node's addresses are unknown
    assumed_remote: frozenset[str] = frozenset()
    # lookup tables (a node of 10k services has 20k addresses and 30k virtual servers: an
    # address with one of them maps to it, not to a list or a dict of one)
    _addrs: dict[str, Address | tuple[Address, ...]] = field(default_factory=dict)
    _ipvs: dict[str, IpvsVirtualServer | dict[tuple[str, int], IpvsVirtualServer]] = \
        field(default_factory=dict)
    # an ipset's members to look up, made at the first question (a set's tuple of 25k
    # members searched once per LB IP was quadratic: 50k services, 5.7 s)
    _set_members: dict[str, tuple[IpSet, frozenset[str]]] = field(default_factory=dict)
    # the IPv4 local_nets by number, and how many local_nets they were made of
    _spans4: tuple[int, list[tuple[int, int, LocalRoute]]] | None = field(
        default=None, compare=False, repr=False)

    def in_ipset(self, name: str, member: str) -> bool | None:
        """Does ipset ``name`` hold ``member`` ("10.0.0.5,tcp:80")? None: no such set in
        the input."""
        s = self.snapshot.ipset(name)
        if s is None:
            return None
        got = self._set_members.get(name)
        if got is None or got[0] is not s:
            got = self._set_members[name] = (s, frozenset(s.members))
        return member in got[1]

    # -- NodeView for the walker ----------------------------------------------------

    def addr_type(self, addr: str) -> str | None:
        if addr in self.assumed_local:
            return "LOCAL"
        if addr in self.assumed_remote:
            return "UNICAST"
        if self.snapshot.local_routes is None and self.snapshot.addresses is None:
            return None
        if self.local_route(addr) is not None:
            return "LOCAL"
        if addr in self.broadcast:
            return "BROADCAST"
        if (224 <= quad_number(addr) >> 24 <= 239) if PLAIN_V4.fullmatch(addr) else \
                parsed_ip(addr).is_multicast:
            return "MULTICAST"
        return "UNICAST"

    def ipset_members(self, name: str) -> tuple[str, frozenset[str]] | None:
        """(type, members) of a set; made anew each time: the walker keeps what it asked
        for as long as it walks, and a verdict keeps no 10k-member set alive."""
        if self.snapshot.ipsets is None:
            return None
        s = self.snapshot.ipset(name)
        if s is None:
            return None
        return s.type, frozenset(s.members)

    # -- helpers ------------------------------------------------------------------------

    def local_route(self, addr: str) -> LocalRoute | None:
        """The `local` table route that makes ``addr`` local, if any."""
        r = self.local_ips.get(addr)
        if r is not None:
            return r
        if PLAIN_V4.fullmatch(addr):
            # (by number: a walk asks it of every endpoint's address, 30k at 10k services,
            # and ipaddress took a tenth of the NodePort walks' time)
            n = quad_number(addr)
            for lo, hi, route in self._local_spans4():
                if lo <= n <= hi:
                    return route
            return None
        a = parsed_ip(addr)
        for net, route in self.local_nets:
            if a.version == net.version and a in net:
                return route
        return None

    def _local_spans4(self) -> list[tuple[int, int, LocalRoute]]:
        """The IPv4 ``local_nets`` as (first, last, route), in their order."""
        got = self._spans4
        if got is None or got[0] != len(self.local_nets):
            got = self._spans4 = (len(self.local_nets), [
                (int(net.network_address), int(net.broadcast_address), route)
                for net, route in self.local_nets if net.version == 4])
        return got[1]

    def is_local(self, addr: str) -> bool | None:
        if self.snapshot.local_routes is None and self.snapshot.addresses is None:
            return None
        return self.local_route(addr) is not None

    def addresses_of(self, addr: str) -> tuple[Address, ...]:
        got = self._addrs.get(addr)
        return () if got is None else got if isinstance(got, tuple) else (got,)

    def virtual_server(self, protocol: str, addr: str, port: int) -> IpvsVirtualServer | None:
        """The IPVS virtual server for addr:port (the caller checks ipvs is known)."""
        got = self._ipvs.get(addr)
        if got is None:
            return None
        protocol = protocol.upper()
        if isinstance(got, IpvsVirtualServer):
            return got if got.protocol == protocol and got.port == port else None
        return got.get((protocol, port))


@functools.lru_cache(maxsize=65536)
def parsed_ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """ipaddress.ip_address(addr), remembered (rules ask of the same addresses again)."""
    return ipaddress.ip_address(addr)


def build_facts(snap: NodeSnapshot) -> NodeFacts:
    f = NodeFacts(snap)
    addrs = f._addrs
    for a in snap.addresses or ():
        had = addrs.get(a.address)
        addrs[a.address] = a if had is None else \
            (*had, a) if isinstance(had, tuple) else (had, a)
    servers = f._ipvs
    for vs in snap.ipvs or ():  # the last of two for one address and port is the one
        had_vs = servers.get(vs.address)
        if had_vs is None or (isinstance(had_vs, IpvsVirtualServer) and (
                had_vs.protocol, had_vs.port) == (vs.protocol, vs.port)):
            servers[vs.address] = vs
        elif isinstance(had_vs, IpvsVirtualServer):
            servers[vs.address] = {(had_vs.protocol, had_vs.port): had_vs,
                                   (vs.protocol, vs.port): vs}
        else:
            had_vs[(vs.protocol, vs.port)] = vs
    if snap.local_routes is not None:
        for r in snap.local_routes:
            if r.type == "local":
                if "/" in r.dst:
                    f.local_nets.append((ipaddress.ip_network(r.dst, strict=False), r))
                else:
                    f.local_ips[r.dst] = r
            elif r.type == "broadcast":
                f.broadcast.add(r.dst)
    elif snap.addresses is not None:
        # No local table: the kernel puts every bound address there, so derive it.
        for a in snap.addresses:
            line = f"local {a.address} dev {a.ifname} (derived from addr.txt)"
            f.local_ips[a.address] = LocalRoute("local", a.address, a.ifname, a.address, line)
        f.local_nets.append((ipaddress.ip_network("127.0.0.0/8"),
                             LocalRoute("local", "127.0.0.0/8", "lo", None,
                                        "local 127.0.0.0/8 dev lo (assumed)")))
        if any(":" in a.address for a in snap.addresses):
            f.local_ips["::1"] = LocalRoute("local", "::1", "lo", None,
                                            "local ::1 dev lo (assumed)")
    _find_uplink(f)
    if f.node_ip is None and f.local_route(NODE_STAND_IN) is None:
        f.assumed_local = frozenset({NODE_STAND_IN})
    if f.local_route(OUTSIDE_CLIENT) is None:
        f.assumed_remote = frozenset({OUTSIDE_CLIENT})
    f.pod, f.pod_unknown = _find_pod_network(f, 4)
    _find_node_ip6(f)
    f.pod6, f.pod6_unknown = _find_pod_network(f, 6)
    return f


def _v4_global(snap: NodeSnapshot) -> list[Address]:
    return _global(snap, 4)


def _global(snap: NodeSnapshot, version: int) -> list[Address]:
    """The node's global addresses of one family, off lo and kube-ipvs0 (`ip addr` calls
    an IPv6 ULA global too; link-local ones are scope link)."""
    return [a for a in snap.addresses or ()
            if (":" in a.address) == (version == 6) and a.scope == "global"
            and a.ifname not in _NOT_PODS]


def _find_node_ip6(f: NodeFacts) -> None:
    """The node's IPv6 address: the Node's IPv6 InternalIP where an interface holds it,
    else the uplink's global IPv6 address, else the first NIC-named interface's."""
    snap = f.snapshot
    addrs = _global(snap, 6)
    internal = [_canon(ip) for ip in (snap.node_info.internal_ips if snap.node_info else ())
                if ":" in ip]
    for a in addrs:
        if _canon(a.address) in internal:
            f.node_ip6 = a.address
            return
    on_uplink = sorted((a for a in addrs if a.ifname == f.uplink), key=lambda a: a.address)
    named = sorted((a for a in addrs if _UPLINK_NAME.match(a.ifname)),
                   key=lambda a: (a.ifname, a.address))
    for a in on_uplink or named:
        f.node_ip6 = a.address
        return


def uplink6(f: NodeFacts) -> str | None:
    """The interface that holds the node's IPv6 address (where IPv6 leaves the node)."""
    if f.node_ip6 is None:
        return None
    return next((a.ifname for a in f.addresses_of(f.node_ip6)), None)


def _canon(addr: str) -> str:
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        return addr


def _find_uplink(f: NodeFacts) -> None:
    snap = f.snapshot
    addrs = _v4_global(snap)
    if snap.node_info and snap.node_info.internal_ips:
        for a in addrs:
            if a.address in snap.node_info.internal_ips:
                f.uplink, f.node_ip = a.ifname, a.address
                f.uplink_how = f"uplink {a.ifname}: holds the Node's InternalIP {a.address}"
                return
    named = sorted((a for a in addrs if _UPLINK_NAME.match(a.ifname)),
                   key=lambda a: (a.ifname, a.address))
    if named:
        a = named[0]
        f.uplink, f.node_ip = a.ifname, a.address
        f.uplink_how = f"uplink {a.ifname} ({a.address}): first NIC-named interface"
        return
    rest = [a for a in addrs if a.ifname not in _POD_BRIDGES and a.prefixlen < 32]
    if rest:
        a = sorted(rest, key=lambda a: (a.ifname, a.address))[0]
        f.uplink, f.node_ip = a.ifname, a.address
        f.uplink_how = f"uplink {a.ifname} ({a.address}): first interface with a global address"


def _find_pod_network(f: NodeFacts, version: int) -> tuple[PodNetwork | None, str]:
    """This node's pod network of one family (4 or 6), or why it is unknown."""
    snap = f.snapshot
    fam = "" if version == 4 else "IPv6 "

    def of_family(c: str) -> bool:
        return (":" in c) == (version == 6)

    node_cidrs = [c for c in (snap.node_info.pod_cidrs if snap.node_info else ())
                  if of_family(c)]
    given = [c for c in ((snap.given or {}).get("pod_cidr") or "").split(",")
             if c and of_family(c)]
    if version == 4 and snap.addresses is None and not node_cidrs and not given \
            and not pod_cidrs_in_rules(snap) and not _pod_routes(snap):
        return None, ("no addresses, no Node podCIDR and no rule naming the pod CIDR: "
                      "cannot tell the pod network (give --pod-cidr)")
    if version == 6 and snap.addresses is None and not node_cidrs and not given \
            and not pod_cidrs_in_rules(snap, 6) and not _pod_routes(snap, 6):
        return None, ("no addresses, no IPv6 podCIDR on the Node and no rule naming the "
                      "IPv6 pod CIDR: cannot tell the IPv6 pod network (give --pod-cidr)")
    # the uplink's subnet is the node's, never its pods' (IPv6: the interface holding the
    # node's IPv6 address, which an IPv6-only node's IPv4 uplink does not name)
    uplinks = {f.uplink} if version == 4 else {f.uplink, uplink6(f)}
    connected = [a for a in _global(snap, version)
                 if a.prefixlen < (32 if version == 4 else 128) and a.ifname not in uplinks]

    def iface_for(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> Address | None:
        for a in connected:
            if ipaddress.ip_address(a.address) in net:
                return a
        return None

    cidrs: list[tuple[str, str]] = []
    if given:
        cidrs += [(c, f"the {fam}pod CIDR {c} given with --pod-cidr") for c in given]
    if not cidrs:
        cidrs += [(c, f"the Node's {fam}podCIDR {c}") for c in node_cidrs]
    if not cidrs:
        for c, rule in pod_cidrs_in_rules(snap, version):
            net = ipaddress.ip_network(c, strict=False)
            a = iface_for(net)
            if a is not None:  # this node's pod bridge inside it: the narrower, same answer
                sub = ipaddress.ip_network(f"{a.address}/{a.prefixlen}", strict=False)
                cidrs.append((str(sub), f"{a.ifname}'s subnet {sub} inside the {fam}pod CIDR "
                              f"{c} kube-proxy's rules name: {rule}"))
            else:
                cidrs.append((c, f"the {fam}pod CIDR {c} kube-proxy's rules name: {rule}"))
            break
    if not cidrs and snap.addresses is None:
        cidrs += _pod_routes(snap, version)[:1]
    if not cidrs and snap.kube_proxy and snap.kube_proxy.cluster_cidr:
        for c in snap.kube_proxy.cluster_cidr.split(","):
            try:
                net = ipaddress.ip_network(c.strip(), strict=False)
            except ValueError:
                continue
            if net.version != version:
                continue
            a = iface_for(net)
            if a is not None:
                sub = ipaddress.ip_network(f"{a.address}/{a.prefixlen}", strict=False)
                cidrs.append((str(sub), f"{a.ifname}'s subnet {sub} inside kube-proxy's "
                              f"--cluster-cidr {c.strip()}"))
    if not cidrs:
        order = {n: i for i, n in enumerate(_POD_BRIDGES)}
        cands = sorted(connected, key=lambda a: (order.get(a.ifname, 50), a.ifname))
        for a in cands:
            if a.ifname == "docker0" and len(cands) > 1:
                continue
            sub = ipaddress.ip_network(f"{a.address}/{a.prefixlen}", strict=False)
            cidrs.append((str(sub), f"the subnet {sub} of pod bridge {a.ifname}"))
            break
    if not cidrs:
        return None, (f"no {fam}pod network found (no Node {fam}podCIDR, no kube-proxy "
                      f"{fam}--cluster-cidr, no bridge {fam}subnet besides the uplink)"
                      if version == 6 else
                      "no pod network found (no Node podCIDR, no kube-proxy --cluster-cidr, "
                      "no bridge subnet besides the uplink)")
    prefix, how = cidrs[0]
    net = ipaddress.ip_network(prefix, strict=False)
    bridge = iface_for(net)
    # the main table's route to the pod network names the bridge and its own address
    route = next((r for r in snap.routes or () if r.dst == str(net) and r.dev), None)
    entry = bridge.ifname if bridge else route.dev if route and route.dev in _POD_BRIDGES \
        else None
    pod_ip = None
    for n, host in enumerate(net.hosts()):
        if n >= 4096:  # a pod network with thousands of the node's own addresses: odd
            break
        if f.local_route(str(host)) is None and not (route and route.src == str(host)):
            pod_ip = str(host)
            break
    if pod_ip is None:
        return None, f"{fam}pod network {prefix} has no free address to stand for a pod"
    return PodNetwork(pod_ip, prefix, entry,
                      f"pod {pod_ip} stands for the pods of this node ({how}"
                      + (f", entering through {entry})" if entry else
                         ", entry interface unknown)")), ""


def kube_proxy_mode(snap: NodeSnapshot) -> tuple[KubeProxyMode, str]:
    """("ipvs" | "iptables" | "unknown", why; what --mode gave)."""
    given = (snap.given or {}).get("mode")
    if given:
        return as_mode(given), f"given with --mode {given}"
    kp = snap.kube_proxy
    if kp and kp.mode in ("ipvs", "iptables"):
        return as_mode(kp.mode), (f"kube-proxy --proxy-mode={kp.mode}" if kp.pid is not None else
                         f"kube-proxy's mode {kp.mode} as the input shows it (its command "
                         "line, log or configuration)")
    if kp and kp.mode:
        return "unknown", f"kube-proxy runs in mode {kp.mode!r}, which this agent does not read"
    if snap.ipsets is not None and snap.ipset("KUBE-CLUSTER-IP") is not None:
        return "ipvs", "ipset KUBE-CLUSTER-IP exists (kube-proxy IPVS mode)"
    if snap.ipsets is not None and snap.ipset("KUBE-6-CLUSTER-IP") is not None:
        return "ipvs", "ipset KUBE-6-CLUSTER-IP exists (kube-proxy IPVS mode, IPv6)"
    if snap.addresses is not None and any(a.ifname == KUBE_IPVS0 for a in snap.addresses):
        return "ipvs", "interface kube-ipvs0 holds service addresses"
    if any(r.dev == KUBE_IPVS0 for r in snap.local_routes or ()):
        return "ipvs", "the local table has routes on kube-ipvs0"
    if snap.ipvs:
        return "ipvs", "IPVS virtual servers exist"
    ipvs_sets = sorted(s.name for s in snap.ipsets or () if s.name in _IPVS_SETS)
    if ipvs_sets:
        return "ipvs", f"kube-proxy IPVS mode's ipset {ipvs_sets[0]} exists"
    nat = snap.netfilter.table("nat") if snap.netfilter is not None else None
    if nat is not None:
        names = {c.name for c in nat.chains}
        if any(n.startswith(("KUBE-SVC-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-XLB-", "KUBE-SVL-"))
               for n in names):
            return "iptables", "nat table has KUBE-SVC/SEP/EXT/XLB chains (kube-proxy " \
                               "iptables mode)"
        if "KUBE-LOAD-BALANCER" in names or _matches_ipvs_set(nat):
            return "ipvs", "nat rules match kube-proxy IPVS mode's ipsets (KUBE-CLUSTER-IP, " \
                           "KUBE-LOAD-BALANCER)"
        if nat.chain("KUBE-SERVICES") is not None:
            return "iptables", "nat table has KUBE-SERVICES without IPVS ipsets"
    return "unknown", "no kube-proxy process, no kube-ipvs0, no KUBE-* chains or ipsets"


def _pod_routes(snap: NodeSnapshot, version: int = 4) -> list[tuple[str, str]]:
    """This node's pod subnet from the main table: the pod bridge's connected route
    (flannel, kubenet, bridge CNIs) or Calico's blackhole route for the node's block."""
    out = []
    for r in snap.routes or ():
        if "/" not in r.dst or (":" in r.dst) != (version == 6):
            continue
        if version == 6 and r.dst.lower().startswith("fe80:"):  # every link has one
            continue
        if r.dev in _POD_BRIDGES or r.type == "blackhole":
            what = f"route to {r.dev}" if r.dev else "blackhole route (Calico's block)"
            out.append((r.dst, f"the {what} {r.dst} in the main table: {r.line}"))
    return out


# ipsets only kube-proxy's IPVS mode creates
_IPVS_SETS = frozenset({
    "KUBE-CLUSTER-IP", "KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-LOCAL", "KUBE-LOOP-BACK",
    "KUBE-LOAD-BALANCER-FW", "KUBE-LOAD-BALANCER-SOURCE-IP", "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP", "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL", "KUBE-HEALTH-CHECK-NODE-PORT", "KUBE-IPVS-IPS",
})
# with their IPv6 twins (kube-proxy's "KUBE-6-" prefix, cut to ipset's 31 characters)
_IPVS_SETS = _IPVS_SETS | {("KUBE-6-" + n[5:])[:31] for n in _IPVS_SETS}


def _matches_ipvs_set(nat: Table) -> bool:
    needles = tuple(f"--match-set {p}{n} " for n in ("CLUSTER-IP", "LOAD-BALANCER",
                                                      "LOOP-BACK", "NODE-PORT-TCP")
                    for p in ("KUBE-", "KUBE-6-"))
    return any(n in text for c in nat.chains for text in c.rules.texts for n in needles)


# kube-proxy's rules that name the cluster's pod CIDR (its --cluster-cidr):
# "! -s CIDR ... -j KUBE-MARK-MASQ" (masquerade what is not from a pod) and "-s CIDR"
# with "Redirect pods trying to reach external loadbalancer VIP" / "pod traffic for"
_NOT_FROM_PODS = re.compile(r"! -s ([0-9a-fA-F:.]+/\d+)\s.*-j KUBE-MARK-MASQ\b")
_FROM_PODS = re.compile(r"(?<!! )-s ([0-9a-fA-F:.]+/\d+)\s.*--comment \"?(?:Redirect pods "
                        r"trying to reach external loadbalancer VIP|pod traffic for)")


def _rules_of(snap: NodeSnapshot, version: int) -> Netfilter | None:
    """The iptables rules of one family."""
    return snap.netfilter if version == 4 else snap.ip6tables


def pod_cidrs_in_rules(snap: NodeSnapshot, version: int = 4) -> list[tuple[str, str]]:
    """The pod CIDRs of one family kube-proxy's own rules name, each with the rule that
    names it."""
    rules_of = _rules_of(snap, version)
    nat = rules_of.table("nat") if rules_of is not None else None
    found: dict[str, str] = {}
    for chain in nat.chains if nat else ():
        if not chain.name.startswith(("KUBE-SERVICES", "KUBE-SVC-", "KUBE-XLB-", "KUBE-EXT-")):
            continue
        rules = chain.rules
        for i, text in enumerate(rules.texts):
            if "-s " not in text:
                continue
            m = _NOT_FROM_PODS.search(text) or _FROM_PODS.search(text)
            if m and m.group(1) not in found and (":" in m.group(1)) == (version == 6):
                source = rules.source(i)
                found[m.group(1)] = f"{text[:120]}" + (f" ({source})" if source else "")
    return list(found.items())
