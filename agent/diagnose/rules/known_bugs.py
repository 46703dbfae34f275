"""kube-proxy-known-bug: a node state that a known kube-proxy bug makes, with the fix to
move to (issue 33). The bugs are data (agent/diagnose/data/known_bugs.json: the issue, the
fix and the releases that have it, the modes, the remedy); each names its detector here,
a pure function of the context that returns the targets it applies to. A detector never
fires where kube-proxy's version (its log) or its rules' shape says the fix is in
(agent.diagnose.kube_proxy_version); where neither says, the finding says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources

from agent.diagnose.context import Context
from agent.diagnose.kube_proxy_version import KubeProxyVersion, version_of
from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.model import Finding
from agent.netfilter.nft_read import ruleset_of
from agent.parse.ip_text import canonical_ip, ip_number

ID = "kube-proxy-known-bug"
Version = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Bug:
    id: str  # "kubernetes#131765"
    title: str
    issue: str
    fix: str
    modes: tuple[str, ...]
    fixed: Version | None  # None: no release is known to fix it (a limitation, or unfixed)
    backports: tuple[Version, ...]
    # a detector of DETECTORS, or None where another rule reports the state (reported_by)
    detector: str | None
    why: str
    remedy: str
    reported_by: str | None = None  # the finding id of the rule that reports the state
    related: tuple[str, ...] = ()  # other upstream threads of the same state, for people


def _version(text: str) -> Version:
    v = version_of(text)
    if v is None:
        raise ValueError(f"known_bugs.json: {text!r} is not a version (MAJOR.MINOR.PATCH)")
    return v


@cache
def catalogue() -> tuple[Bug, ...]:
    doc = json.loads(resources.files("agent.diagnose").joinpath("data/known_bugs.json")
                     .read_text())
    return tuple(Bug(b["id"], b["title"], b["issue"], b["fix"], tuple(b["modes"]),
                     None if b["fixed"] is None else _version(b["fixed"]),
                     tuple(map(_version, b["backports"])), b["detector"], b["why"],
                     b["remedy"], b.get("reported_by"), tuple(b.get("related", ())))
                 for b in doc["bugs"])


def entry(bug_id: str) -> Bug:
    """The catalogue's entry for ``bug_id`` (a rule that reports a catalogued state cites
    it by this)."""
    return next(b for b in catalogue() if b.id == bug_id)


# -- detectors: (context) -> [(target, evidence lines)] ---------------------------------

Hit = tuple[LbTarget, tuple[str, ...]]


def nft_no_endpoint_drop_for_pods(ctx: Context) -> list[Hit]:
    """An externalTrafficPolicy=Local address in kube-proxy's no-endpoint-services map
    with verdict drop and not in its service-ips map: before kubernetes#132456 the filter
    chains checked that map for pods' packets too, and dropped them."""
    rs, _ = ruleset_of(ctx.snapshot)
    if rs is None:
        return []
    # per family: the keys dropped and the keys served (each map read once, not once per
    # LB IP: 10k of them against 11k elements)
    maps: dict[str, tuple[set[tuple[str, ...]], set[tuple[str, ...]]]] = {}
    for family in ("ip", "ip6"):
        table = rs.table(family, "kube-proxy")
        drops = table.set("no-endpoint-services") if table is not None else None
        served = table.set("service-ips") if table is not None else None
        if drops is not None:
            maps[family] = ({parts for parts, v in drops.elements if v == "drop"},
                            {parts for parts, _ in served.elements} if served else set())
    out: list[Hit] = []
    for t in ctx.targets:
        if t.etp != "Local" or t.kind not in ("loadbalancer", "external") or not t.port:
            continue
        family = "ip6" if ":" in t.ip else "ip"
        dropped, sent = maps.get(family, (set(), set()))
        key = (t.ip, t.protocol.lower(), str(t.port))
        if key not in dropped or key in sent:
            continue  # (served: kube-proxy sends pods' packets to its endpoints first)
        out.append((t, (f"nft {family} kube-proxy map no-endpoint-services has "
                        f"{' . '.join(key)} : drop, and service-ips has no element for it",
                        f"externalTrafficPolicy=Local ({t.etp_how or 'kube-proxy rules'})")))
    return out


def ipvs_empty_local_virtual_server(ctx: Context) -> list[Hit]:
    """An externalTrafficPolicy=Local address whose IPVS virtual server has no real
    servers, the address local to this node (or not known not to be): before
    kubernetes#97081 that was every such Service on a node without a local endpoint."""
    if ctx.snapshot.ipvs is None:
        return []
    out: list[Hit] = []
    for t in ctx.targets:
        if t.etp != "Local" or t.kind not in ("loadbalancer", "external") or not t.port:
            continue
        vs = ctx.facts.virtual_server(t.protocol, t.ip, t.port)
        local = ctx.facts.is_local(t.ip)
        if vs is None or vs.real_servers or local is False:
            continue
        host = f"[{t.ip}]" if ":" in t.ip else t.ip
        route = ctx.facts.local_route(t.ip) if local else None
        out.append((t, (f"IPVS virtual server {t.protocol} {host}:{t.port} has no real "
                        "servers",
                        f"routing: {t.ip} is local ({route.line if route else 'bound here'})"
                        if local else f"{t.ip}: whether it is local is not in the input",
                        f"externalTrafficPolicy=Local ({t.etp_how or 'the Service'})")))
    return out


def ipvs_filter_rejects_health_checks(ctx: Context) -> list[Hit]:
    """KUBE-IPVS-FILTER rejecting new connections to every address on kube-ipvs0 (its
    KUBE-IPVS-IPS set) without first letting through the Services' health check node
    ports: an externalTrafficPolicy=Local load balancer's health checks to its own
    address bound here are rejected. kube-proxy v1.26.0 wrote the REJECT
    (kubernetes#108460); kubernetes#117723 added the RETURN before it. The chain's shape
    finds it (a chain without the REJECT, or with the RETURN, is not this bug); a version
    kube-proxy says it runs with the fix rules it out, as for every entry."""
    nf = ctx.snapshot.netfilter
    table = nf.table("filter") if nf else None
    chain = table.chain("KUBE-IPVS-FILTER") if table else None
    if chain is None:
        return []
    texts = chain.rules.texts
    reject = next((i for i, x in enumerate(texts)
                   if "KUBE-IPVS-IPS" in x and "-j REJECT" in x), None)
    if reject is None or any("KUBE-HEALTH-CHECK-NODE-PORT" in x and "-j RETURN" in x
                             for x in texts[:reject]):
        return []
    src = chain.rules.source(reject)
    rule = f"filter KUBE-IPVS-FILTER: {texts[reject]}" + (f" ({src})" if src else "")
    out: list[Hit] = []
    for t in ctx.targets:
        if t.etp != "Local" or t.kind != "loadbalancer":
            continue
        listed = ctx.facts.in_ipset("KUBE-IPVS-IPS", t.ip)
        local = ctx.facts.is_local(t.ip)
        if not listed and not local:
            continue  # (not bound here, as TKE's IPVS mode leaves LB addresses: no REJECT)
        out.append((t, (rule, "no rule before it lets KUBE-HEALTH-CHECK-NODE-PORT through",
                        f"{t.ip} is " + ("in ipset KUBE-IPVS-IPS" if listed else
                                         "local here (bound on kube-ipvs0)"),
                        f"externalTrafficPolicy=Local ({t.etp_how or 'the Service'}): "
                        "the load balancer health-checks its address at the Service's "
                        "healthCheckNodePort")))
    return out


# kube-proxy's log naming the address a sync failed on (kubernetes#80297's lines)
_BIND = re.compile(r"error bind address: (\S+?) to interface: kube-ipvs0")
_ADD = re.compile(r"Failed to add entry:? (\S+?),(tcp|udp|sctp):(\d+) to ip ?set:? (KUBE-[\w-]+)")
_SYNC = re.compile(r"Failed to sync service:? \[?([0-9A-Fa-f:.]+?)\]?:(\d+)/(TCP|UDP|SCTP)")


def _node_families(ctx: Context) -> tuple[set[int], str]:
    """The IP families this node serves, and how the input shows it (empty: not shown):
    every family any source says (its Node's pod CIDRs and addresses, its own addresses,
    kube-proxy's own state of that family), so that a family shown by one is never taken
    as missing because another says less."""
    fams: dict[int, str] = {}
    node = ctx.snapshot.node_info
    for what, values in (("its Node's spec.podCIDRs", node.pod_cidrs if node else ()),
                         ("its Node's InternalIP addresses",
                          node.internal_ips if node else ())):
        for v in values:
            fams.setdefault(6 if ":" in v else 4, f"{what}: {', '.join(values)}")
    f = ctx.facts
    for fam, ip in ((4, f.node_ip), (6, f.node_ip6)):
        if ip:
            fams.setdefault(fam, f"the node's address {ip}")
    snap = ctx.snapshot
    six = snap.ip6tables.table("nat") if snap.ip6tables is not None else None
    if (six is not None and six.chain("KUBE-SERVICES") is not None) or any(
            s.name.startswith("KUBE-6-") for s in snap.ipsets or ()):
        fams.setdefault(6, "kube-proxy's IPv6 rules or ipsets")
    rs, _ = ruleset_of(snap) if snap.nft else (None, "")
    if rs is not None and rs.table("ip6", "kube-proxy") is not None:
        fams.setdefault(6, "kube-proxy's table ip6 kube-proxy")
    return set(fams), "; ".join(dict.fromkeys(fams[k] for k in sorted(fams)))


def lb_ip_of_another_family(ctx: Context) -> list[Hit]:
    """A load balancer address of an IP family this node does not serve (an IPv4 node
    whose Service got an IPv6 ingress address, as a NAT64 load balancer gives, or the
    reverse). kube-proxy before kubernetes#87117 wrote it anyway: IPVS mode bound it on
    kube-ipvs0 and added it to an ipset of the other family, iptables mode wrote it into
    the other family's rules; the failure stopped the sync, so every Service changed
    after it went unserved. Shown by the Service (with the node's families) or by
    kube-proxy's log naming the address and an ipset of the other family."""
    fams, how = _node_families(ctx)
    hits: dict[tuple[str, int, str], tuple[LbTarget, list[str]]] = {}
    for t in (*ctx.targets, *ctx.v6_targets):
        fam = 6 if ":" in t.ip else 4
        if t.kind != "loadbalancer" or not t.port or not fams or fam in fams:
            continue
        hits[t.key] = (t, [f"{t.ip} is an IPv{fam} address; this node serves IPv"
                           f"{'/'.join(map(str, sorted(fams)))} only ({how})"])
    kp = ctx.snapshot.kube_proxy
    said: dict[str, list[str]] = {}  # each address's lines of kube-proxy's log
    ports: dict[str, tuple[int, str]] = {}  # the port a line names with it
    wrong: set[str] = set()  # an address kube-proxy added to an ipset of the other family
    for line in kp.errors if kp else ():
        for m in (_BIND.search(line), _ADD.search(line), _SYNC.search(line)):
            if m is None:
                continue
            addr = canonical_ip(m.group(1).strip("[]"))
            if addr is None:
                continue
            if line not in said.setdefault(addr, []):
                said[addr].append(line)
            if m.re is not _BIND:
                ports.setdefault(addr, (int(m.group(2 if m.re is _SYNC else 3)),
                                        m.group(3 if m.re is _SYNC else 2).upper()))
            if m.re is _ADD and (":" in addr) != ("KUBE-6-" in m.group(4)):
                wrong.add(addr)
    targets = {t.ip: t for t in (*ctx.targets, *ctx.v6_targets)}
    for addr, lines in said.items():
        fam = 6 if ":" in addr else 4
        known = next((k for k in hits if k[0] == addr), None)
        if known is None and addr not in wrong and not (fams and fam not in fams):
            continue  # (a failure of an address of the node's own family: not this bug)
        ev = [f"kube-proxy's log: {ln}" for ln in lines]
        if known is not None:
            hits[known][1].extend(ev)
            continue
        port, proto = ports.get(addr, (0, "TCP"))
        t = targets.get(addr) or LbTarget(addr, port, proto, "loadbalancer", None,
                                          ("kube-proxy's log",))
        ev.insert(0, f"kube-proxy's log adds the IPv{fam} address {addr} to an ipset of the "
                  "other family" if addr in wrong else f"{addr} is an IPv{fam} address; "
                  f"this node serves IPv{'/'.join(map(str, sorted(fams)))} only ({how})")
        hits[t.key] = (t, ev)
    return [(t, tuple(ev)) for t, ev in hits.values()]


def ipvs_localhost_node_ports(ctx: Context) -> list[Hit]:
    """IPVS virtual servers on 127.0.0.1 or ::1 (kube-proxy wrote one per NodePort on
    every local address, loopback included, until kubernetes#101023): a client on the
    node dialling localhost:NodePort is DNATed off the loopback interface, which the
    kernel drops as martian (IPv6 has no route_localnet), so it hangs."""
    snap = ctx.snapshot
    # the NodePorts: the Services' own where they are given, else the default range (the
    # API server's --service-node-port-range): a loopback virtual server on another port
    # (an API server's, a DNS cache's) is not kube-proxy's NodePort
    node_ports = {p.node_port for svc in snap.services or () for p in svc.ports
                  if p.node_port} if snap.services is not None else None
    out: list[Hit] = []
    for vs in snap.ipvs or ():
        number = ip_number(vs.address)  # (45k virtual servers at 10k services)
        if number is None:
            continue
        version, n = number
        loopback = n >> 24 == 127 if version == 4 else n == 1  # (127.0.0.0/8, ::1)
        if not loopback or not (vs.port in node_ports if node_ports is not None
                                else NODE_PORT_RANGE[0] <= vs.port <= NODE_PORT_RANGE[1]):
            continue
        host = f"[{vs.address}]" if ":" in vs.address else vs.address
        t = LbTarget(vs.address, vs.port, vs.protocol, "nodeport", None,
                     ("IPVS virtual servers",))
        n = len(vs.real_servers)
        out.append((t, (f"IPVS virtual server {vs.protocol} {host}:{vs.port} "
                        f"({n} real server{'' if n == 1 else 's'})",)))
        if len(out) >= MAX_HITS:
            break
    return out


MAX_HITS = 200  # per bug (a node has a localhost virtual server per NodePort)
NODE_PORT_RANGE = (30000, 32767)  # the API server's default --service-node-port-range


DETECTORS: dict[str, Callable[[Context], list[Hit]]] = {
    "nft_no_endpoint_drop_for_pods": nft_no_endpoint_drop_for_pods,
    "ipvs_empty_local_virtual_server": ipvs_empty_local_virtual_server,
    "ipvs_filter_rejects_health_checks": ipvs_filter_rejects_health_checks,
    "lb_ip_of_another_family": lb_ip_of_another_family,
    "ipvs_localhost_node_ports": ipvs_localhost_node_ports,
}


def check(ctx: Context) -> list[Finding]:
    if ctx.family != 4:
        return []  # (nftables mode walks both families in one context)
    version = ctx.kube_proxy_version
    out = []
    for bug in catalogue():
        if ctx.mode not in bug.modes or bug.detector is None:
            continue
        before = version.before(bug.fixed, bug.backports) \
            if version and bug.fixed is not None else None
        if before is False:
            continue
        for t, evidence in DETECTORS[bug.detector](ctx):
            out.append(_finding(bug, t, evidence, version, before))
    return out


def _finding(bug: Bug, t: LbTarget, evidence: tuple[str, ...],
             version: KubeProxyVersion | None, before: bool | None) -> Finding:
    fixed = None if bug.fixed is None else "v" + ".".join(map(str, bug.fixed)) + "".join(
        f" (v{'.'.join(map(str, b))} in the {b[0]}.{b[1]} line)" for b in bug.backports)
    if fixed is None:
        which = f"kube-proxy ({version.how})" if version is not None else "kube-proxy"
    else:
        which = (f"kube-proxy ({version.how})" if version is not None and before else
                 f"kube-proxy older than {fixed}, if it is (kube-proxy's own version is not "
                 "in the input: its log's \"Version info\" line, its image or its rules' "
                 "shape would say)")
    host = f"[{t.ip}]" if ":" in t.ip else t.ip
    what = f"{host}:{t.port}/{t.protocol}" if t.port else host  # (a log may name no port)
    return Finding(
        ID, "info",
        f"{what} meets {bug.id} of {which}: {bug.title}",
        lb_ip=t.ip, port=t.port, protocol=t.protocol, service=t.service,
        evidence=(*evidence, f"{bug.id}: {bug.why}",
                  f"fixed by {bug.fix}: in {fixed}" if fixed is not None else
                  f"no kube-proxy release fixes it: {bug.fix}",
                  *(f"related: {r}" for r in bug.related),
                  *((f"kube-proxy: {version.how}",) if version is not None else ())),
        remedy=bug.remedy, data={"kind": "known-bug", "bug": bug.id, "issue": bug.issue})
