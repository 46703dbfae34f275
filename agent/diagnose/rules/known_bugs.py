"""kube-proxy-known-bug: a node state that a known kube-proxy bug makes, with the fix to
move to (issue 33). The bugs are data (agent/diagnose/data/known_bugs.json: the issue, the
fix and the releases that have it, the modes, the remedy); each names its detector here,
a pure function of the context that returns the targets it applies to. A detector never
fires where kube-proxy's version (its log) or its rules' shape says the fix is in
(agent.diagnose.kube_proxy_version); where neither says, the finding says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources

from agent.diagnose.context import Context
from agent.diagnose.kube_proxy_version import KubeProxyVersion, version_of
from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.model import Finding
from agent.netfilter.nft_read import ruleset_of

ID = "kube-proxy-known-bug"
Version = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Bug:
    id: str  # "kubernetes#131765"
    title: str
    issue: str
    fix: str
    modes: tuple[str, ...]
    fixed: Version
    backports: tuple[Version, ...]
    detector: str
    why: str
    remedy: str


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
                     _version(b["fixed"]), tuple(map(_version, b["backports"])),
                     b["detector"], b["why"], b["remedy"]) for b in doc["bugs"])


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


DETECTORS: dict[str, Callable[[Context], list[Hit]]] = {
    "nft_no_endpoint_drop_for_pods": nft_no_endpoint_drop_for_pods,
    "ipvs_empty_local_virtual_server": ipvs_empty_local_virtual_server,
    "ipvs_filter_rejects_health_checks": ipvs_filter_rejects_health_checks,
}


def check(ctx: Context) -> list[Finding]:
    if ctx.family != 4:
        return []  # (nftables mode walks both families in one context)
    version = ctx.kube_proxy_version
    out = []
    for bug in catalogue():
        if ctx.mode not in bug.modes:
            continue
        before = version.before(bug.fixed, bug.backports) if version else None
        if before is False:
            continue
        for t, evidence in DETECTORS[bug.detector](ctx):
            out.append(_finding(bug, t, evidence, version, before))
    return out


def _finding(bug: Bug, t: LbTarget, evidence: tuple[str, ...],
             version: KubeProxyVersion | None, before: bool | None) -> Finding:
    fixed = "v" + ".".join(map(str, bug.fixed)) + "".join(
        f" (v{'.'.join(map(str, b))} in the {b[0]}.{b[1]} line)" for b in bug.backports)
    which = (f"kube-proxy ({version.how})" if version is not None and before else
             f"kube-proxy older than {fixed}, if it is (its version is not in the input: "
             "its log's \"Version info\" line, or its rules' shape, would say)")
    host = f"[{t.ip}]" if ":" in t.ip else t.ip
    return Finding(
        ID, "info",
        f"{host}:{t.port}/{t.protocol} meets {bug.id} of {which}: {bug.title}",
        lb_ip=t.ip, port=t.port, protocol=t.protocol, service=t.service,
        evidence=(*evidence, f"{bug.id}: {bug.why}", f"fixed by {bug.fix}: in {fixed}",
                  *((f"kube-proxy: {version.how}",) if version is not None else ())),
        remedy=bug.remedy, data={"kind": "known-bug", "bug": bug.id, "issue": bug.issue})
