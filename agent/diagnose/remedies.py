"""The one remedy that fits the evidence, per finding (PROBLEM.md, "Remedies")."""

from __future__ import annotations

from agent.diagnose.lb_ip import LbTarget

PREVENT_LOOPBACK = "service.cloud.tencent.com/prevent-loopback"


def _is_tke(t: LbTarget) -> bool:
    return any(k.startswith(("service.cloud.tencent.com/", "service.kubernetes.io/qcloud"))
               for k, _ in t.annotations)


def dns_name(t: LbTarget) -> str:
    if t.service:
        ns, name = t.service.split("/", 1)
        return f"{name}.{ns}.svc.cluster.local"
    return "<service>.<namespace>.svc.cluster.local"


def for_lb_ip_local(t: LbTarget, mode: str) -> str:
    if t.ip_mode == "Proxy":
        return ("The Service asks for ipMode: Proxy but the VIP is still bound: upgrade "
                "kube-proxy to a version that honours status.loadBalancer.ingress[].ipMode "
                "(Kubernetes 1.30+), so it stops binding the VIP on kube-ipvs0.")
    if mode == "ipvs" or _is_tke(t):
        return (f'Annotate the Service with {PREVENT_LOOPBACK}: "true" (with a kube-proxy '
                "that supports it): the CLB then health-checks from 100.64.0.0/10 instead of "
                "its own VIP, so the checks are no longer dropped as martian source while the "
                "VIP stays bound for in-cluster short-circuiting.")
    return ("Make the load balancer health-check from an address that is not local on the "
            "nodes (on TKE: the prevent-loopback annotation), or set ipMode: Proxy so "
            "kube-proxy does not bind the VIP.")


def for_not_masqueraded(t: LbTarget, mode: str, lb_bound_elsewhere: bool) -> str:
    if t.kind == "ingress":
        return (f"Call the backend by its Service DNS name ({dns_name(t)}) instead of the "
                "Ingress address; if clients must keep the domain, a CoreDNS rewrite to a "
                "self-hosted ingress controller keeps the traffic inside the cluster.")
    if mode == "ipvs" and not lb_bound_elsewhere:
        return (f'Annotate the Service with {PREVENT_LOOPBACK}: "true" and run a kube-proxy '
                "that supports it: the VIP is bound on kube-ipvs0 again, pods reach the "
                "Service inside the node, and the CLB health-checks from 100.64.0.0/10.")
    if t.ip_mode == "Proxy":
        return (f"Use the Service DNS name ({dns_name(t)}) from pods: with ipMode: Proxy "
                "kube-proxy deliberately sends pod traffic to the load balancer.")
    return (f"Use the Service DNS name ({dns_name(t)}) from pods instead of the load "
            "balancer address; where a domain is baked in, a CoreDNS rewrite to that name.")
