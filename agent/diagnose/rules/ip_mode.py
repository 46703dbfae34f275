"""The ipMode audit (issue 34, item 2): `status.loadBalancer.ingress[].ipMode: Proxy` is the
upstream answer to load balancer loopback (GA in 1.32), and it fails silently both ways.

- ``ip-mode-proxy-ignored``: the Service says ipMode: Proxy, but this node still binds
  its address or captures pods' traffic to it: the datapath ignores the field (kube-proxy
  before 1.30, where it was off by default; Cilium 1.18.0, fixed in 1.18.1: cilium#40913),
  so pods bypass the load balancer that the Service asked them to go through (a backend
  that expects PROXY protocol refuses them).
- ``proxy-protocol-without-ip-mode``: the load balancer speaks PROXY protocol to the
  backends (the provider's annotation says so: agent/diagnose/data/load_balancers.json),
  but its address is in VIP mode: kube-proxy captures pods' traffic to it and hands it to
  the backends without the PROXY header, which they refuse. The provider's controller
  setting (or the release that sets ipMode: Proxy itself) is the remedy.
"""

from __future__ import annotations

from agent.diagnose.cloud import Provider, provider_of
from agent.diagnose.context import Context
from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.model import Finding
from agent.diagnose.outcome import Outcome
from agent.diagnose.remedies import dns_name

IGNORED = "ip-mode-proxy-ignored"
NO_IP_MODE = "proxy-protocol-without-ip-mode"


def check(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    # (the provider, once per set of annotations and class: 10k Services share a few)
    known: dict[tuple[object, ...], tuple[Provider, str] | None] = {}
    for t in ctx.targets:
        if t.kind != "loadbalancer" or not t.port:
            continue
        if t.ip_mode == "Proxy":
            f = _ignored(ctx, t)
        else:
            key = (t.annotations, t.load_balancer_class)
            if key not in known:
                known[key] = provider_of(t, ctx.snapshot)
            f = _without_ip_mode(ctx, t, known[key])
        if f is not None:
            out.append(f)
    return out


def _where(t: LbTarget) -> str:
    host = f"[{t.ip}]" if ":" in t.ip else t.ip
    return f"{host}:{t.port}/{t.protocol}"


def _ignored(ctx: Context, t: LbTarget) -> Finding | None:
    # bound on kube-ipvs0: kube-proxy's IPVS binding (an address that is the node's own, or
    # kube-vip's on the leader, is local for other reasons)
    route = ctx.facts.local_route(t.ip)
    local = route is not None and route.dev == "kube-ipvs0"
    evidence: list[str] = []
    if local and route is not None:
        evidence.append(f"routing: {t.ip} is a local address here, bound on kube-ipvs0 "
                        f"({route.line})")
    walked = ctx.paths.pod_to_lb(t) if ctx.mode != "unknown" else None
    if walked is not None and walked.kind == Outcome.CAPTURED:
        evidence += [f"a pod's packet to it: {walked.how}", *walked.evidence[-3:]]
    if not evidence:
        return None
    return Finding(
        IGNORED, "warning",
        f"Service {t.service or '?'} asks for ipMode: Proxy on {_where(t)}, but this node "
        + ("binds the address" if local else "captures pods' traffic to it")
        + ": the datapath ignores the field, so pods skip the load balancer the Service "
          "asked them to go through (a backend that expects PROXY protocol refuses them)",
        lb_ip=t.ip, port=t.port, protocol=t.protocol, service=t.service,
        evidence=(*evidence, "status.loadBalancer.ingress[].ipMode: Proxy "
                  "(learned from " + "; ".join(t.learned_from) + ")"),
        remedy=("Run a datapath that honours ipMode: kube-proxy 1.30 or later (the field was "
                "alpha and off by default in 1.29), Cilium 1.18.1 or later (1.18.0 ignored "
                "it: cilium#40913); `kubectl get svc -o jsonpath="
                "'{.status.loadBalancer.ingress[*].ipMode}'` shows what the Service asks."))


def _without_ip_mode(ctx: Context, t: LbTarget,
                     found: tuple[Provider, str] | None) -> Finding | None:
    if found is None:
        return None
    p, how = found
    on = p.proxy_protocol_on(t.annotations)
    if on is None or ctx.mode == "unknown":
        return None
    walked = ctx.paths.pod_to_lb(t)  # (only the few with PROXY protocol on)
    if walked.kind != Outcome.CAPTURED:
        return None  # not captured here: pods go through the load balancer
    controller = (f" ({p.sets_ip_mode[0]} {p.sets_ip_mode[1]} and later set it themselves: "
                  f"{p.sets_ip_mode[2]})" if p.sets_ip_mode else "")
    return Finding(
        NO_IP_MODE, "warning",
        f"The load balancer of {t.service or '?'} speaks PROXY protocol to the backends, but "
        f"{_where(t)} is in VIP mode: kube-proxy captures pods' traffic to it and hands it to "
        "the backends without the PROXY header, which they refuse",
        lb_ip=t.ip, port=t.port, protocol=t.protocol, service=t.service,
        evidence=(f"the Service's annotation {on}",
                  f"status.loadBalancer.ingress[].ipMode: {t.ip_mode or '(absent: VIP)'}",
                  f"a pod's packet to it: {walked.how}",
                  f"load balancer: {p.name}, recognised by {how}",
                  *(f"source: {s}" for s in p.sources[:2])),
        remedy=(f"{p.name}: {p.remedy}{controller} Or call the Service by its DNS name "
                f"({dns_name(t)}) from pods."))
