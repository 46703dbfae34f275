"""lb-ip-local: an LB/external IP is a local address here, so the load balancer's health
checks (sourced from its VIP) and anything else sourced from the VIP die: as martians on
IPv4; on IPv6, which has no martian check, the node answers them to itself (to lo)."""

from __future__ import annotations

from agent.diagnose.context import Context
from agent.diagnose.family import v6_local_known
from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.model import Finding, Severity
from agent.diagnose.remedies import PREVENT_LOOPBACK, for_lb_ip_local, is_tke
from agent.diagnose.rules.common import sysctl_evidence

ID = "lb-ip-local"
# what the kernel does with an IPv6 packet whose source is one of the node's addresses
# (measured in tests/test_ipv6_netns.py; README "How it decides")
V6_FATE = ("IPv6 has no martian-source check: the packet is taken in and the node's answer "
           "is routed to its own address (lo), so it never reaches the load balancer")


def check(ctx: Context) -> list[Finding]:
    if ctx.facts.is_local("127.0.0.1") is None:
        ctx.unknown(ID, "local addresses unknown (no route-local.txt and no addr.txt)")
        return []
    by_ip: dict[str, list[LbTarget]] = {}
    # IPv6 ones walked with the IPv4 ones (nftables mode's ip6 table) are IPv6 all the same
    v6 = [t for t in (*ctx.v6_targets, *(x for x in ctx.targets if ":" in x.ip))
          if t.kind == "loadbalancer"]
    if v6 and not v6_local_known(ctx.snapshot):
        ctx.unknown(ID, "IPv6 local addresses unknown (the input has no IPv6 local table: "
                        "`ip -6 route show table local`)")
        v6 = []
    for t in [*(x for x in ctx.targets if ":" not in x.ip), *v6]:
        # only a load balancer's VIP health-checks the nodes; an externalIP bound on a
        # node (kube-proxy IPVS binds them all) is local by design
        if t.kind == "loadbalancer":
            by_ip.setdefault(t.ip, []).append(t)
    out = []
    sysctls: list[str] | None = None  # the same lines for every LB IP: made once
    for ip, targets in by_ip.items():
        route = ctx.facts.local_route(ip)
        if route is None:
            continue
        is_v6 = ":" in ip
        t = next((x for x in targets if x.service), targets[0])
        ports = sorted({(x.protocol, x.port) for x in targets})
        evidence = [f"local table: {route.line}"]
        for a in ctx.facts.addresses_of(ip):
            state = "" if a.link_up else " (interface DOWN: it only holds addresses)"
            evidence.append(f"address {a.address}/{a.prefixlen} on {a.ifname}{state}")
        evidence += [f"learned from {src}" for x in targets for src in x.learned_from]
        if is_v6:
            evidence.append(V6_FATE)
        else:
            if sysctls is None:
                sysctls = sysctl_evidence(ctx)
            evidence += sysctls
        prevent = any(k == PREVENT_LOOPBACK and v.lower() == "true"
                      for x in targets for k, v in x.annotations)
        dev = route.dev or "an interface"
        fate = ("never answered: IPv6 routes the node's replies to its own address (lo)"
                if is_v6 else "dropped as martian source")
        severity: Severity
        if prevent:
            severity = "info"
            summary = (f"LB IP {ip} is bound on {dev} on purpose ({PREVENT_LOOPBACK}); "
                       "health checks must come from 100.64.0.0/10, not from the VIP")
            remedy = ("None if the CLB health-checks from 100.64.0.0/10; otherwise upgrade "
                      "the CLB/kube-proxy pairing that the annotation needs.")
        elif is_tke(t):
            severity = "critical"
            summary = (f"LB IP {ip} is a local address on this node (on {dev}): the Tencent "
                       f"CLB health-checks from its VIP, so its health checks and any packet "
                       f"sourced from {ip} that arrives here are {fate}")
            remedy = for_lb_ip_local(t)
        else:
            # other load balancers usually health-check from their own ranges
            severity = "warning"
            summary = (f"LB IP {ip} is a local address on this node (on {dev}): if the load "
                       f"balancer health-checks from its VIP (Tencent CLB does), its checks "
                       f"and any packet sourced from the VIP are {fate} here")
            remedy = for_lb_ip_local(t)
        out.append(Finding(
            ID, severity, summary, lb_ip=ip,
            port=ports[0][1] if len(ports) == 1 else None,
            protocol=ports[0][0] if len(ports) == 1 else None,
            service=t.service, evidence=tuple(dict.fromkeys(evidence)), remedy=remedy))
    return out

