"""Findings from watched NodePort handshakes: loopback that the static checks only
suspect, seen happening (loopback-observed, healthcheck-dropped-local-source), and SYNs
from elsewhere that nobody answers (nodeport-syn-unanswered)."""

from __future__ import annotations

import re

from agent.capture.model import (
    BYPASSED,
    RESET,
    SRC_LB,
    SRC_LOCAL,
    SRC_OTHER,
    SRC_POD,
    UNANSWERED,
    CaptureResult,
    HandshakeSample,
    NodePortStats,
)
from agent.diagnose.context import Context
from agent.diagnose.model import Finding

LOOPBACK_OBSERVED = "loopback-observed"
HEALTHCHECK_DROPPED = "healthcheck-dropped-local-source"
SYN_UNANSWERED = "nodeport-syn-unanswered"
OBSERVED_IDS = frozenset({LOOPBACK_OBSERVED, HEALTHCHECK_DROPPED})


def check(ctx: Context) -> list[Finding]:
    cap = ctx.capture
    if cap is None:
        return []
    for p in cap.problems:
        ctx.unknown("capture", p)
    if cap.kernel_drops:
        ctx.unknown("capture", f"the kernel dropped {cap.kernel_drops} of "
                    f"{cap.kernel_packets} packets (capture ring full): counts are lower bounds")
    if cap.table_evictions:
        ctx.unknown("capture", f"{cap.table_evictions} handshakes were evicted from the "
                    f"table (capacity {cap.table_capacity}) before they ended")
    services = _services_by_node_port(ctx)
    out: list[Finding] = []
    for port in cap.ports:
        svc, lb_ip = services.get(port.node_port, (None, None))
        pod = _count(port, (BYPASSED, UNANSWERED), SRC_POD)
        # a reply that leaves through another interface bypasses the load balancer
        # whoever the client is (pods outside the node's podCIDR: Calico blocks, VPC-CNI)
        bypassed_other = _count(port, (BYPASSED,), SRC_OTHER) + _count(port, (BYPASSED,),
                                                                       SRC_LB)
        if pod or bypassed_other:
            out.append(_finding(
                ctx, cap, port, svc, lb_ip, LOOPBACK_OBSERVED, "critical",
                SRC_POD if pod else SRC_OTHER, (BYPASSED, UNANSWERED),
                f"Loopback observed on NodePort {port.node_port}: {pod + bypassed_other} "
                "SYNs came back through the load balancer from clients on this node and the "
                "handshake failed (the reply bypassed the load balancer, or the SYN was "
                "dropped)",
                "Stop pods reaching this Service through the load balancer address: use the "
                "Service DNS name; see the static findings for the remedy that fits."))
        local = _count(port, (UNANSWERED, BYPASSED), SRC_LOCAL)
        if local:
            out.append(_finding(
                ctx, cap, port, svc, lb_ip, HEALTHCHECK_DROPPED, "critical", SRC_LOCAL,
                (UNANSWERED, BYPASSED),
                f"{local} SYNs to NodePort {port.node_port} came from an address that is "
                "local on this node and were dropped as martian source: a load balancer VIP "
                "bound here (its health checks fail on this node) or a host-network client "
                "reaching the load balancer (see the sample sources)",
                "Stop binding the VIP on this node or make the load balancer health-check "
                "from a non-local address (on TKE: the prevent-loopback annotation with "
                "health checks from 100.64.0.0/10)."))
        other = _count(port, (UNANSWERED,), SRC_OTHER) + _count(port, (UNANSWERED,), SRC_LB)
        if other:
            out.append(_finding(
                ctx, cap, port, svc, lb_ip, SYN_UNANSWERED, "warning", SRC_OTHER,
                (UNANSWERED,),
                f"{other} SYNs to NodePort {port.node_port} from other sources got no answer "
                "within the handshake timeout",
                "Look for a DROP rule or a missing endpoint for this NodePort (an "
                "externalTrafficPolicy=Local service without a local endpoint is expected "
                "to ignore them)."))
    return out


def _count(port: NodePortStats, outcomes: tuple[str, ...], source: str) -> int:
    return sum(port.counts.get(o, {}).get(source, 0) for o in outcomes)


def _finding(ctx: Context, cap: CaptureResult, port: NodePortStats, svc: str | None,
             lb_ip: str | None, fid: str, severity: str, source: str,
             outcomes: tuple[str, ...], summary: str, remedy: str) -> Finding:
    sources = (source, SRC_LB) if source == SRC_OTHER else (source,)
    evidence = [f"captured {cap.seconds:.0f}s on all interfaces: {port.syns} SYNs to "
                f"NodePort {port.node_port}; " + _counts_line(port)]
    evidence += [_sample(s) for s in port.samples
                 if s.source_class in sources and s.outcome in outcomes]
    evidence += [f"{c.source}: " + (f"{c.value} ({c.detail})" if c.value is not None
                                    else c.detail) for c in cap.corroboration]
    return Finding(fid, severity, summary, lb_ip=lb_ip, port=port.node_port,
                   protocol=port.protocol, service=svc, evidence=tuple(evidence),
                   remedy=remedy)


def _counts_line(port: NodePortStats) -> str:
    parts = []
    for outcome, by_src in sorted(port.counts.items()):
        for src, n in sorted(by_src.items()):
            if n:
                parts.append(f"{outcome} from {src}: {n}")
    return ", ".join(parts) or "no outcome recorded"


def _sample(s: HandshakeSample) -> str:
    what = {
        BYPASSED: f"SYN-ACK left through {s.reply_iface}, not {s.in_iface}: it bypassed "
                  "the load balancer",
        UNANSWERED: "no SYN-ACK: dropped",
        RESET: f"answered by RST through {s.reply_iface}",
    }.get(s.outcome, s.outcome)
    tail = "; the client reset it (it expected the load balancer)" if s.peer_reset else ""
    return (f"{s.src}:{s.sport} -> {s.dst}:{s.dport} in {s.in_iface} "
            f"({s.source_class}): {what}{tail}")


def _services_by_node_port(ctx: Context) -> dict[int, tuple[str | None, str | None]]:
    """NodePort -> (Service, its first LB IP), from the Service objects, else from the
    comments of kube-proxy's KUBE-NODEPORTS rules (iptables mode)."""
    out: dict[int, tuple[str | None, str | None]] = {}
    for svc in ctx.snapshot.services or ():
        lb = next((i.ip for i in svc.lb_ingress if i.ip), None)
        for p in svc.ports:
            if p.node_port:
                out.setdefault(p.node_port, (svc.key, lb))
    nat = ctx.snapshot.netfilter.table("nat") if ctx.snapshot.netfilter else None
    chain = nat.chain("KUBE-NODEPORTS") if nat else None
    lb_by_service = {t.service: t.ip for t in ctx.targets if t.service}
    for text in chain.rules.texts if chain else ():
        m = _NODEPORT_RULE.search(text)
        if m and int(m.group(3)) not in out:
            svc = f"{m.group(1)}/{m.group(2)}"
            out[int(m.group(3))] = (svc, lb_by_service.get(svc))
    return out


_NODEPORT_RULE = re.compile(
    r'--comment "([a-z0-9][-a-z0-9.]*)/([a-z0-9][-a-z0-9.]*)[:"].*--dport (\d+)\b')
