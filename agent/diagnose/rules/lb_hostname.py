"""pod-to-lb-undetermined for an AWS Network Load Balancer known only by its hostname
(status.loadBalancer.ingress[].hostname): kube-proxy writes no rule for a hostname (it has
no address to match), so pods' connections to it leave the node for the load balancer.
Whether it sends them back to this node keeping the pod's address, the loop this agent
looks for (an NLB that preserves client addresses does), is the load balancer's doing:
the node cannot show it. Without this rule such a Service said nothing, and a node with
no other LB IP was "healthy".

A hostname whose Service does not ask for an NLB (the annotation below, or the AWS Load
Balancer Controller's spec.loadBalancerClass) is a classic ELB for the AWS cloud
provider, which proxies: pods' connections reach the nodes from the
ELB's own address, no loop. It is named as not walked, not raised: on an AWS fleet every
node would otherwise be "at risk" for every such Service."""

from __future__ import annotations

from agent.diagnose.context import Context
from agent.diagnose.model import Finding

ID = "pod-to-lb-undetermined"
_LB_TYPE = "service.beta.kubernetes.io/aws-load-balancer-type"
_NLB = frozenset({"nlb", "nlb-ip", "external"})  # in-tree NLB; the AWS LB Controller's
_NLB_CLASS = "service.k8s.aws/nlb"  # the AWS LB Controller's loadBalancerClass
_WHY = ("the load balancer, an AWS NLB, is known only by its hostname: kube-proxy writes no "
        "rule for a hostname, so pods' connections to it leave the node for the load "
        "balancer, and whether it sends them back to this node keeping the pod's address (an "
        "NLB that preserves client addresses does) cannot be seen from the node")
_REMEDY = ("Find out whether the load balancer keeps client addresses (AWS NLB: its target "
           "type and the preserve_client_ip attribute). If it does, a pod's connection that "
           "the load balancer sends to the pod's own node fails: have pods use the Service's "
           "ClusterIP or DNS name, or turn client address preservation off.")


def check(ctx: Context) -> list[Finding]:
    if ctx.family != 4:
        return []  # (the Services are the same in the IPv6 view: said once)
    out = []
    for svc in ctx.snapshot.services or ():
        if svc.type != "LoadBalancer" or not svc.lb_ingress or \
                any(i.ip for i in svc.lb_ingress):
            continue  # (an address is walked by pod-to-lb)
        hosts = [i.hostname for i in svc.lb_ingress if i.hostname]
        if not hosts:
            continue
        kind = svc.annotations.get(_LB_TYPE, "")
        nlb_class = svc.load_balancer_class == _NLB_CLASS
        if kind.lower() not in _NLB and not nlb_class:
            ctx.unknown(f"LB hostname {hosts[0]}", f"Service {svc.key}'s load balancer is "
                        "known only by its hostname" + (
                            f" (loadBalancerClass {svc.load_balancer_class}): not walked"
                            if svc.load_balancer_class else
                            " and its annotations ask for no NLB (a classic ELB proxies: "
                            "pods' connections reach the nodes from its address): not "
                            "walked"))
            continue
        evidence = (f"Service {svc.key} status.loadBalancer.ingress: "
                    + ", ".join(f"hostname {h}" for h in hosts) + " (no ip)",
                    f"spec.loadBalancerClass: {_NLB_CLASS} (a Network Load Balancer)"
                    if nlb_class else f"annotation {_LB_TYPE}: {kind} (a Network Load "
                    "Balancer)")
        for p in svc.ports:
            what = f"{hosts[0]}:{p.port}/{p.protocol}"
            ctx.unknown(f"nat walk {what}", _WHY)
            out.append(Finding(
                ID, "warning", f"Could not decide whether pods reaching {what} loop back: "
                f"{_WHY}", lb_ip=None, port=p.port, protocol=p.protocol, service=svc.key,
                evidence=(*evidence, *((f"externalTrafficPolicy={svc.external_traffic_policy}"
                                        " (Service spec)",)
                                       if svc.external_traffic_policy else ())),
                remedy=_REMEDY))
    return out
