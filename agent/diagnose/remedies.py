"""The one remedy that fits the evidence, per finding (PROBLEM.md, "Remedies")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from agent.diagnose.cloud import provider_of, providers
from agent.diagnose.lb_ip import LbTarget

if TYPE_CHECKING:
    from agent.diagnose.context import Context

PREVENT_LOOPBACK = "service.cloud.tencent.com/prevent-loopback"


def is_tke(t: LbTarget) -> bool:
    """Tencent's controller annotates its Services; that is the evidence we accept."""
    return tke_annotated(k for k, _ in t.annotations)


def tke_annotated(keys: Iterable[str]) -> bool:
    """Does one of these annotation keys start with one of Tencent's prefixes (the
    providers' catalogue, agent/diagnose/data)?"""
    tke = next(p for p in providers() if p.id == "tke")
    return any(k.startswith(tke.annotation_prefixes) for k in keys)


def tke_ipvs_variant(t: LbTarget, ctx: Context) -> bool:
    """IPVS mode, kube-proxy serves the LB IP (KUBE-LOAD-BALANCER lists it) but does not
    bind it: upstream kube-proxy binds every LB IP unless ipMode is Proxy, TKE's does not."""
    if ctx.mode != "ipvs" or t.ip_mode == "Proxy" or ctx.facts.is_local(t.ip):
        return False
    return bool(ctx.facts.in_ipset("KUBE-LOAD-BALANCER",
                                   f"{t.ip},{t.protocol.lower()}:{t.port}"))


def dns_name(t: LbTarget) -> str:
    if t.service:
        ns, name = t.service.split("/", 1)
        return f"{name}.{ns}.svc.cluster.local"
    return "<service>.<namespace>.svc.cluster.local"


def for_lb_ip_local(t: LbTarget) -> str:
    if t.ip_mode == "Proxy":
        return ("The Service asks for ipMode: Proxy but the VIP is still bound: upgrade "
                "kube-proxy to a version that honours status.loadBalancer.ingress[].ipMode "
                "(Kubernetes 1.30+), so it stops binding the VIP on kube-ipvs0.")
    if is_tke(t):
        return (f'Annotate the Service with {PREVENT_LOOPBACK}: "true" (with a kube-proxy '
                "that supports it): the CLB then health-checks from 100.64.0.0/10 instead of "
                "its own VIP, so the checks are no longer "
                + ("answered inside the node, where the answer stays (IPv6)" if ":" in t.ip
                   else "dropped as martian source")
                + " while the VIP stays bound for in-cluster short-circuiting.")
    return ("If the load balancer health-checks from its VIP: have it check from another "
            "address, or set status.loadBalancer.ingress[].ipMode: Proxy (Kubernetes 1.30+) "
            "so kube-proxy stops binding the VIP on the nodes.")


def for_not_masqueraded(t: LbTarget, ctx: Context) -> str:
    if t.kind == "ingress":
        return (f"Call the backend by its Service DNS name ({dns_name(t)}) instead of the "
                "Ingress address; if clients must keep the domain, a CoreDNS rewrite to a "
                "self-hosted ingress controller keeps the traffic inside the cluster.")
    if t.ip_mode == "Proxy":
        return (f"Use the Service DNS name ({dns_name(t)}) from pods: with ipMode: Proxy "
                "kube-proxy deliberately sends pod traffic to the load balancer.")
    # (a provider's knob is for its load balancer's own address, not an external IP)
    found = provider_of(t, ctx.snapshot) if t.kind == "loadbalancer" else None
    other = found is not None and found[0].id != "tke"  # another provider recognised
    if is_tke(t) or (not other and tke_ipvs_variant(t, ctx)):
        return (f'Annotate the Service with {PREVENT_LOOPBACK}: "true" and run a kube-proxy '
                "that supports it: the VIP is bound on kube-ipvs0 again, pods reach the "
                "Service inside the node, and the CLB health-checks from 100.64.0.0/10.")
    generic = (f"Use the Service DNS name ({dns_name(t)}) from pods instead of the load "
               "balancer address; where a domain is baked in, a CoreDNS rewrite to that name.")
    if found is None or not other:
        return generic
    p, how = found
    return f"{p.name} ({how}): {p.remedy} Or: {generic[0].lower()}{generic[1:]}"
