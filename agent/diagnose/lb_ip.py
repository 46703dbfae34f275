"""Which LoadBalancer, external and Ingress addresses does this node know, on which ports,
for which Service, and how did we learn it (API objects, ipsets, kube-proxy's rules)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from agent.netfilter.rules import Cond, parse_rule_text
from agent.numbers import is_number
from agent.parse.ip_text import PLAIN_V4, canonical_ip
from agent.quick_init import quick_init
from agent.snapshot import Address, LocalRoute, NodeSnapshot, Rules, Service

# kube-proxy comments: "ns/svc:port loadbalancer IP", "ns/svc:port external IP"
_KIND_BY_COMMENT = (("loadbalancer IP", "loadbalancer"), ("external IP", "external"))
_SVC_IN_COMMENT = re.compile(r"^([a-z0-9][-a-z0-9.]*)/([a-z0-9][-a-z0-9.]*)(?::(\S*))?")
_PROTOCOLS = frozenset({"TCP", "UDP", "SCTP"})
_HASHED_CHAIN = re.compile(r"^KUBE-(SVC|EXT|SVL|FW|XLB)-([A-Z2-7]{16})$")


@quick_init
@dataclass(frozen=True, slots=True)
class LbTarget:
    ip: str
    port: int
    protocol: str  # "TCP" | "UDP" | "SCTP"
    kind: str  # "loadbalancer" | "external" | "ingress"
    service: str | None
    learned_from: tuple[str, ...]
    etp: str | None = None  # "Local" | "Cluster" when known
    etp_how: str = ""
    ip_mode: str | None = None
    annotations: tuple[tuple[str, str], ...] = ()
    ingress: str | None = None  # "ns/name" of the Ingress for kind "ingress"
    node_port: int | None = None  # where the load balancer really sends it
    disagreements: tuple[str, ...] = ()  # where two sources said different things
    # kube-proxy's own rules, sets or maps name it (not only a Service, an Ingress or an
    # address on kube-ipvs0): where a Service's address lacks it, kube-proxy has not
    # written it (agent.diagnose.rules.consistency)
    by_kube_proxy: bool = False
    load_balancer_class: str | None = None  # the Service's spec.loadBalancerClass

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.ip, self.port, self.protocol)


def chain_hash(service_port_name: str, protocol: str) -> str:
    """kube-proxy's portProtoHash: base32(sha256(name + proto))[:16]."""
    import base64
    import hashlib  # (here: most checks never hash, and hashlib costs 4 ms to import)

    digest = hashlib.sha256((service_port_name + protocol.lower()).encode()).digest()
    # base32 turns each 5 bytes into 8 characters: the first 10 bytes give the 16
    return base64.b32encode(digest[:10]).decode()


def service_of_chains(snap: NodeSnapshot) -> dict[str, str]:
    """Map KUBE-{SVC,EXT,SVL,FW,XLB}-<hash> chains to "ns/name", from the Service objects'
    hashes (works without comments) and from rule comments."""
    out: dict[str, str] = {}
    for svc in snap.services or ():
        for p in svc.ports:
            # ServicePortName.String(): "ns/name:port", or "ns/name" for an unnamed port
            h = chain_hash(f"{svc.key}:{p.name}" if p.name else svc.key, p.protocol)
            for kind in ("SVC", "EXT", "SVL", "FW", "XLB"):
                out[f"KUBE-{kind}-{h}"] = svc.key
    return out


class ChainServices(Mapping[str, str]):
    """service_of_chains(snap), made when first asked (a walk's comments name the Service
    nearly always: hashing 10k Services' ports would be for nothing)."""

    def __init__(self, snap: NodeSnapshot) -> None:
        self._snap = snap
        self._map: dict[str, str] | None = None

    def _made(self) -> dict[str, str]:
        if self._map is None:
            self._map = service_of_chains(self._snap)
        return self._map

    def __getitem__(self, chain: str) -> str:
        return self._made()[chain]

    def __iter__(self) -> Iterator[str]:
        return iter(self._made())

    def __len__(self) -> int:
        return len(self._made())


_COMMENT = re.compile(r'--comment "([^"]*)"')
_SVC_ANYWHERE = re.compile(r"(?:^|\s)([a-z0-9][-a-z0-9.]*)/([a-z0-9][-a-z0-9.]*):")
_CHAIN_IN_LINE = re.compile(r"-[jg] (KUBE-(?:SVC|EXT|SVL|FW|XLB)-[A-Z2-7]{16})\b")


def infer_service(evidence: tuple[str, ...], hashed: Mapping[str, str]) -> str | None:
    """The Service a walk went through: from kube-proxy's comments ("ns/svc:port ..."),
    else from the hash in a KUBE-SVC/EXT/SVL/FW/XLB chain name (needs the Services)."""
    for line in evidence:
        for comment in _COMMENT.findall(line):
            m = _SVC_ANYWHERE.search(comment)
            if m:
                return f"{m.group(1)}/{m.group(2)}"
    for line in evidence:
        for chain in _CHAIN_IN_LINE.findall(line):
            if chain in hashed:
                return hashed[chain]
    return None


# One object's addresses x ports walked at most (issue 35, item 12: one Service with 500
# externalIPs x 500 ports made 250k targets, 26 s and 746 MiB, and any tenant who may
# create a Service can make one); and the node's in all (a 50k-Service node has 55k).
PER_OBJECT_TARGETS = 1_000
MAX_TARGETS = 100_000


class Discovery(NamedTuple):
    targets: list[LbTarget]
    not_walked: list[str]  # what was left out past the bounds above, and why


def discover(snap: NodeSnapshot) -> Discovery:
    found: dict[tuple[str, int, str], LbTarget] = {}
    not_walked: list[str] = []
    # what later sources said of an address already found, merged once at the end (one
    # LbTarget per address rather than one per source: 10k LB IPs have two or three)
    more: dict[tuple[str, int, str], list[LbTarget]] = {}

    def add(t: LbTarget) -> None:
        if t.protocol not in _PROTOCOLS:
            if t.protocol.upper() not in _PROTOCOLS:
                return  # no Service has it: a damaged or foreign rule, not an LB port
            t = replace(t, protocol=t.protocol.upper())
        if ":" in t.ip:
            # IPv6 is written many ways; the tools (`ip route`, ipvsadm) print one. An
            # IPv4-mapped one (::ffff:10.0.0.1) is IPv4 to kube-proxy (GetIPFamilyFromIP:
            # To4() != nil), which writes its rules for 10.0.0.1
            canonical = _mapped_v4(t.ip) or canonical_ip(t.ip)
            if canonical and canonical != t.ip:
                t = replace(t, ip=canonical)
        key = t.key
        if key in found:
            more.setdefault(key, []).append(t)
        else:
            found[key] = t

    by_key: dict[str, Service] = {}
    for svc in snap.services or ():
        by_key[svc.key] = svc
        annotations = tuple(sorted(svc.annotations.items()))
        ips = [(ing.ip, ing.ip_mode, "loadbalancer") for ing in svc.lb_ingress
               if ing.ip and svc.type == "LoadBalancer"]
        ips += [(ip, None, "external") for ip in svc.external_ips]
        many = len(ips) * len(svc.ports)
        if many > PER_OBJECT_TARGETS:
            not_walked.append(
                f"Service {svc.key} has {many} address:port targets ({len(ips)} addresses x "
                f"{len(svc.ports)} ports): the first {PER_OBJECT_TARGETS} were walked")
        left = PER_OBJECT_TARGETS
        for p in svc.ports:
            for ip, ip_mode, kind in ips:
                left -= 1
                if left < 0:
                    break
                add(LbTarget(ip, p.port, p.protocol, kind, svc.key,
                             (f"Service {svc.key} "
                              + ("status.loadBalancer.ingress" if kind == "loadbalancer"
                                 else "spec.externalIPs"),),
                             svc.external_traffic_policy,
                             "Service spec" if svc.external_traffic_policy else "",
                             ip_mode, annotations, node_port=p.node_port,
                             load_balancer_class=svc.load_balancer_class))

    for ingress in snap.ingresses or ():
        backends = sorted({b.service for b in ingress.backends})
        service = backends[0] if len(backends) == 1 else None
        ports = (80, 443) if ingress.tls else (80,)
        for ip in ingress.ips:
            for port in ports:
                add(LbTarget(ip, port, "TCP", "ingress", service,
                             (f"Ingress {ingress.key} status.loadBalancer.ingress",),
                             ingress=ingress.key))

    _from_ipsets(snap, add)
    _from_rules(snap, add)
    _from_filter(snap, add)
    _from_kube_ipvs0(snap, add, {t.ip for t in found.values()})
    if snap.ip6tables is not None:  # the IPv6 rules name IPv6 LB IPs the same way
        v6 = replace(snap, netfilter=snap.ip6tables)
        _from_rules(v6, add)
        _from_filter(v6, add)
    for key, later in more.items():
        found[key] = _merged(found[key], later)
    # the Service objects give NodePorts; read kube-proxy's comments only where they miss
    missing = any(t.node_port is None and t.service for t in found.values())
    node_ports = _node_ports_from_rules(snap) if missing else {}
    if missing and snap.ip6tables is not None:
        node_ports = {**_node_ports_from_rules(replace(snap, netfilter=snap.ip6tables)),
                      **node_ports}
    out = []
    for t in found.values():
        if t.node_port is None and t.service:
            np = node_ports.get((t.service, t.port, t.protocol))
            if np is not None:
                t = replace(t, node_port=np)
        out.append(t)
    out.sort(key=lambda t: (_ip_key(t.ip), t.port, t.protocol))
    if len(out) > MAX_TARGETS:
        not_walked.append(f"the node knows {len(out)} LB IP:port targets: the first "
                          f"{MAX_TARGETS} (in address order) were walked")
        del out[MAX_TARGETS:]
    return Discovery(out, not_walked)


# where each source hands what it found to discover()
_Add = Callable[[LbTarget], None]


def _merged(first: LbTarget, later: list[LbTarget]) -> LbTarget:
    """One address as its sources said it, in the order they came: the first one's
    values where it has them, every source, and where two disagree."""
    kind, service, learned = first.kind, first.service, first.learned_from
    etp, etp_how, ip_mode = first.etp, first.etp_how, first.ip_mode
    annotations, ingress, node_port = first.annotations, first.ingress, first.node_port
    disagreements, by_kube_proxy = first.disagreements, first.by_kube_proxy
    lb_class = first.load_balancer_class
    for t in later:
        disagree = disagreements + t.disagreements
        if etp and t.etp and etp != t.etp:
            disagree += (f"sources disagree on externalTrafficPolicy: {etp} "
                         f"({etp_how}) vs {t.etp} ({t.etp_how}); the first is used",)
        if service and t.service and service != t.service:
            disagree += (f"sources disagree on the Service: {service} "
                         f"({learned[0]}) vs {t.service} ({t.learned_from[0]})",)
        disagreements = tuple(dict.fromkeys(disagree))
        learned = tuple(dict.fromkeys(learned + t.learned_from))
        kind = kind if kind != "ingress" or t.kind == "ingress" else t.kind
        service = service or t.service
        etp, etp_how = etp or t.etp, etp_how or t.etp_how
        ip_mode = ip_mode or t.ip_mode
        annotations = annotations or t.annotations
        ingress = ingress or t.ingress
        node_port = node_port or t.node_port
        by_kube_proxy = by_kube_proxy or t.by_kube_proxy
        lb_class = lb_class or t.load_balancer_class
    last = later[-1]
    return LbTarget(last.ip, last.port, last.protocol, kind=kind, service=service,
                    learned_from=learned, etp=etp, etp_how=etp_how, ip_mode=ip_mode,
                    annotations=annotations, ingress=ingress, node_port=node_port,
                    disagreements=disagreements, by_kube_proxy=by_kube_proxy,
                    load_balancer_class=lb_class)


def split_by_family(targets: list[LbTarget]
                    ) -> tuple[list[LbTarget], list[LbTarget], list[str]]:
    """(IPv4 targets the agent analyses, IPv6 targets it does not walk, reasons for what
    is not an address)."""
    keep: list[LbTarget] = []
    v6: list[LbTarget] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for t in targets:
        try:
            # (a dotted quad as ipaddress takes it, without building the address)
            version = 4 if PLAIN_V4.fullmatch(t.ip) else ipaddress.ip_address(t.ip).version
        except ValueError:
            if t.ip not in seen:
                skipped.append(f"{t.ip!r} ({', '.join(t.learned_from)}) is not an IP address")
            seen.add(t.ip)
            continue
        (v6 if version == 6 else keep).append(t)
    return keep, v6, skipped


def _node_ports_from_rules(snap: NodeSnapshot) -> dict[tuple[str, int, str], int]:
    """(service, port, protocol) -> NodePort, from kube-proxy's comments: the KUBE-NODEPORTS
    rule and the "loadbalancer IP" rule of one service port share "ns/svc:portname"."""
    nat = snap.netfilter.table("nat") if snap.netfilter else None
    if nat is None:
        return {}

    def commented(chain_name: str) -> list[tuple[str, str, int]]:
        chain = nat.chain(chain_name)
        out = []
        rules = chain.rules if chain else Rules()
        for i, text in enumerate(rules.texts):
            if "--dport" not in text or "--comment" not in text:
                continue
            r = parse_rule_text(text, rules.source(i))
            proto = next((a[0] for k, n, a in r.conds if k == "proto" and not n), None)
            dport = next((a[0] for k, n, a in r.conds if k.endswith("--dport") and not n), "")
            if r.comment and proto and is_number(dport):
                out.append((r.comment.split(" ", 1)[0], proto.upper(), int(dport)))
        return out

    by_name = {(name, proto): port for name, proto, port in commented("KUBE-NODEPORTS")}
    result: dict[tuple[str, int, str], int] = {}
    for name, proto, port in commented("KUBE-SERVICES"):
        node_port = by_name.get((name, proto))
        if node_port is not None:
            result[(name.split(":", 1)[0], port, proto)] = node_port
    return result


# kube-proxy IPVS mode's sets that hold "ip,proto:port[,...]" of LB and external IPs:
# name -> (kind, the set that lists the externalTrafficPolicy=Local ones)
LB_SETS = {
    "KUBE-LOAD-BALANCER": ("loadbalancer", "KUBE-LOAD-BALANCER-LOCAL"),
    "KUBE-LOAD-BALANCER-LOCAL": ("loadbalancer", "KUBE-LOAD-BALANCER-LOCAL"),
    "KUBE-LOAD-BALANCER-FW": ("loadbalancer", "KUBE-LOAD-BALANCER-LOCAL"),
    "KUBE-LOAD-BALANCER-SOURCE-IP": ("loadbalancer", "KUBE-LOAD-BALANCER-LOCAL"),
    "KUBE-LOAD-BALANCER-SOURCE-CIDR": ("loadbalancer", "KUBE-LOAD-BALANCER-LOCAL"),
    "KUBE-EXTERNAL-IP": ("external", "KUBE-EXTERNAL-IP-LOCAL"),
    "KUBE-EXTERNAL-IP-LOCAL": ("external", "KUBE-EXTERNAL-IP-LOCAL"),
}
# kube-proxy names its IPv6 sets "KUBE-6-..." (pkg/proxy/ipvs/ipset.go NewIPSet), cut to
# ipset's 31 characters: KUBE-6-LOAD-BALANCER-SOURCE-CIDR is KUBE-6-LOAD-BALANCER-SOURCE-CID
LB_SETS.update({
    ("KUBE-6-" + name[5:])[:31]: (kind, ("KUBE-6-" + local[5:])[:31])
    for name, (kind, local) in list(LB_SETS.items())})


def _from_ipsets(snap: NodeSnapshot, add: _Add) -> None:
    """kube-proxy IPVS mode lists LB and external IPs as "ip,proto:port" in ipsets; a
    pasted excerpt may hold any one of them."""
    local_sets: dict[str, set[tuple[str, str, int] | None]] = {}
    for name, (kind, local_name) in LB_SETS.items():
        s = snap.ipset(name)
        if s is None:
            continue
        local = snap.ipset(local_name)
        local_keys = local_sets.get(local_name)
        if local_keys is None:
            local_keys = local_sets[local_name] = {ip_proto_port(m) for m in local.members} \
                if local else set()
        for m in s.members:
            parsed = ip_proto_port(m)
            if parsed is None:
                continue
            ip, proto, port = parsed
            if local is None:
                etp, how = None, ""  # not given: no claim either way
            else:
                is_local = parsed in local_keys
                etp = "Local" if is_local else "Cluster"
                how = f"ipset {local_name} {'lists' if is_local else 'does not list'} " \
                      f"{ip},{proto.lower()}:{port}"
            add(LbTarget(ip, port, proto, kind, None, (f"ipset {name} entry {m}",), etp, how,
                         by_kube_proxy=True))


# kube-proxy's filter-table rules name LB and external IPs too: "ns/svc:port has no
# endpoints" (REJECT), "has no local endpoints" (DROP, externalTrafficPolicy=Local),
# "traffic not accepted by KUBE-FW-..." (loadBalancerSourceRanges)
_FILTER_CHAINS = ("KUBE-EXTERNAL-SERVICES", "KUBE-PROXY-FIREWALL", "KUBE-FIREWALL")


def _from_filter(snap: NodeSnapshot, add: _Add) -> None:
    flt = snap.netfilter.table("filter") if snap.netfilter else None
    for chain_name in _FILTER_CHAINS:
        chain = flt.chain(chain_name) if flt else None
        rules = chain.rules if chain else Rules()
        for i, text in enumerate(rules.texts):
            if "--comment" not in text or " -d " not in text:
                continue
            r = parse_rule_text(text, rules.source(i))
            ip, proto, port = _dst_proto_port(r.conds)
            if ip is None or port is None or proto is None or "/" in ip or not r.comment:
                continue
            m = _SVC_IN_COMMENT.match(r.comment)
            service = f"{m.group(1)}/{m.group(2)}" if m else None
            etp = "Local" if "has no local endpoints" in r.comment else None
            kind = "loadbalancer" if "KUBE-FW-" in r.comment or "KUBE-PROXY-FIREWALL" in \
                chain_name else "external"
            src = f"filter {chain_name} rule ({r.source})" if r.source \
                else f"filter {chain_name} rule"
            add(LbTarget(ip, port, proto, kind, service, (src,), etp,
                         f"filter rule '{r.comment}'" if etp else "", by_kube_proxy=True))


def _from_kube_ipvs0(snap: NodeSnapshot, add: _Add, known: set[str]) -> None:
    """IPVS mode binds every service address on kube-ipvs0. A globally routable one is
    no ClusterIP (service ranges are private): it is an LB or external IP, ports unknown."""
    cluster_ips: set[str] = set()
    for name in ("KUBE-CLUSTER-IP", "KUBE-6-CLUSTER-IP"):  # (IPv6's: pkg/proxy/ipvs/ipset.go)
        cluster = snap.ipset(name)
        cluster_ips |= {m.split(",", 1)[0] for m in cluster.members} if cluster else set()
    cluster_ips |= {s.cluster_ip for s in snap.services or () if s.cluster_ip}
    # each address told by its address line, else by its route (the words made only for
    # the few that are neither known nor ClusterIPs: 20k addresses at 10k services)
    seen: dict[str, Address | LocalRoute] = {}
    on_kube_ipvs0: set[str] = set()
    for a in snap.addresses or ():
        if a.ifname == "kube-ipvs0":
            on_kube_ipvs0.add(a.address)
            if a.address not in known and a.address not in cluster_ips:
                seen.setdefault(a.address, a)
    for r in snap.local_routes or ():
        if r.dev == "kube-ipvs0" and r.type == "local" and r.dst not in on_kube_ipvs0 and \
                r.dst not in known and r.dst not in cluster_ips:
            seen.setdefault(r.dst, r)
    # ClusterIPs come from the service range, never from a subnet the node sits in:
    # an address on kube-ipvs0 inside one (MetalLB, internal LBs) is an LB or external IP
    subnets = []
    for a in snap.addresses or ():
        host = 128 if ":" in a.address else 32  # (IPv6: a ULA LB IP in the node's ULA subnet)
        if a.ifname not in ("kube-ipvs0", "lo") and 8 <= a.prefixlen < host and \
                (host == 32 or a.scope == "global"):  # (not fe80::/64, on every link)
            subnets.append((ipaddress.ip_network(f"{a.address}/{a.prefixlen}", strict=False),
                            a.ifname))
    for ip, said in seen.items():
        how = f"address {ip} on kube-ipvs0" if isinstance(said, Address) else \
            f"local table: {said.line}"
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            continue
        if addr.is_global:
            why = "a globally routable address on kube-ipvs0 is no ClusterIP"
        else:
            net = next(((n, dev) for n, dev in subnets if addr in n), None)
            if net is None:
                continue
            why = (f"an address on kube-ipvs0 inside {net[1]}'s subnet {net[0]} is no "
                   "ClusterIP (service ranges are apart from node subnets)")
        add(LbTarget(ip, 0, "TCP", "loadbalancer", None,
                     (f"{how}: {why} (an LB or external IP; its ports are not in the "
                      "input)",)))


def _dst_proto_port(conds: tuple[Cond, ...]) -> tuple[str | None, str | None, int | None]:
    ip: str | None = None
    proto: str | None = None
    port: int | None = None
    for ckind, negate, args in conds:
        if ckind == "dst" and not negate:
            ip = args[0].removesuffix("/128" if ":" in args[0] else "/32")
        elif ckind == "proto" and not negate:
            proto = args[0].upper()
        elif ckind.endswith("--dport") and not negate and is_number(args[0]):
            port = int(args[0])
    return ip, proto, port


def _from_rules(snap: NodeSnapshot, add: _Add) -> None:
    """kube-proxy iptables mode: KUBE-SERVICES rules commented "... loadbalancer IP"."""
    if snap.netfilter is None:
        return
    nat = snap.netfilter.table("nat")
    if nat is None:
        return
    chain = nat.chain("KUBE-SERVICES")
    if chain is None:
        return
    hashed: dict[str, str] | None = None  # made when a comment does not name the Service
    rules = chain.rules
    for i, text in enumerate(rules.texts):
        if "loadbalancer IP" not in text and "external IP" not in text:
            continue
        r = parse_rule_text(text, rules.source(i))
        if r.comment is None:
            continue
        kind = next((k for marker, k in _KIND_BY_COMMENT if r.comment.endswith(marker)), None)
        if kind is None:
            continue
        ip, proto, port = _dst_proto_port(r.conds)
        if ip is None or port is None or proto is None or "/" in ip:
            continue
        m = _SVC_IN_COMMENT.match(r.comment)
        if m:
            service: str | None = f"{m.group(1)}/{m.group(2)}"
        else:
            if hashed is None:
                hashed = service_of_chains(snap)
            service = hashed.get(r.target or "")
        add(LbTarget(ip, port, proto, kind, service,
                     (f"nat KUBE-SERVICES rule ({r.source})" if r.source
                      else "nat KUBE-SERVICES rule",), by_kube_proxy=True))


def _mapped_v4(text: str) -> str | None:
    """The IPv4 address of an IPv4-mapped IPv6 one (::ffff:a.b.c.d), else None."""
    if "." not in text and not text.lower().startswith("::ffff:"):
        return None
    try:
        mapped = ipaddress.IPv6Address(text).ipv4_mapped
    except ValueError:
        return None
    return str(mapped) if mapped else None


def ip_proto_port(member: str) -> tuple[str, str, int] | None:
    """(ip, PROTOCOL, port) of an ipset member "ip,proto:port[,...]", else None."""
    parts = member.split(",")
    if len(parts) < 2 or ":" not in parts[1]:
        return None
    proto, _, port = parts[1].partition(":")
    if not is_number(port):
        return None
    return parts[0], proto.upper(), int(port)


def _ip_key(ip: str) -> tuple[int, ...]:
    try:
        return tuple(map(int, ip.split(".")))
    except ValueError:
        pass
    try:  # IPv6 after IPv4, in address order (not in the order they were found)
        return (999, int(ipaddress.IPv6Address(ip.split("%", 1)[0])))
    except ValueError:
        return (1000,)
