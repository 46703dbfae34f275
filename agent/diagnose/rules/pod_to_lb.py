"""pod-to-lb-*: follow a pod's SYN to each LB IP:port through the real nat rules."""

from __future__ import annotations

from dataclasses import replace
from typing import TypedDict

from agent.diagnose.context import Context
from agent.diagnose.lb_ip import infer_service
from agent.diagnose.model import Finding
from agent.diagnose.outcome import Outcome, PathOutcome, shape_of
from agent.diagnose.remedies import for_not_masqueraded
from agent.diagnose.rules.common import (
    has_kube_proxy_rules,
    ipv6_commands,
    no_kube_proxy_rules,
    rp_filter_effective,
)

NOT_MASQUERADED = "pod-to-lb-not-masqueraded"
CAPTURED = "pod-to-lb-captured"
MASQUERADED = "pod-to-lb-masqueraded"
DROPPED = "pod-to-lb-dropped"
UNDETERMINED = "pod-to-lb-undetermined"


class _Target(TypedDict):
    """The target's fields of each finding (Finding's keywords)."""

    lb_ip: str
    port: int
    protocol: str
    service: str | None
    shape: str | None


def check(ctx: Context) -> list[Finding]:
    out = []
    walkable = ctx.mode == "nftables" or (ctx.mode != "unknown" and has_kube_proxy_rules(ctx))
    etp_lines: dict[tuple[str, str], str] = {}  # one string per policy, not per finding
    for t in ctx.targets:
        if not walkable:
            # kube-proxy's rules are not in this backend's dump (nftables mode, a
            # kube-proxy replacement, the other backend): walking them would prove nothing
            o = PathOutcome(Outcome.UNKNOWN, no_kube_proxy_rules(ctx), ())
        else:
            try:
                o = ctx.paths.pod_to_lb(t)
            except Exception as e:  # one target's bug must not hide the others
                o = PathOutcome(Outcome.UNKNOWN, f"internal error walking it: "
                                f"{type(e).__name__}: {e}", ())
            if ctx.family == 6:
                o = ipv6_commands(o)
        host = f"[{t.ip}]" if ":" in t.ip else t.ip  # an IPv6 address before its port
        what = f"{host}:{t.port}/{t.protocol}" if t.port else f"{t.ip} (ports not in the input)"
        if t.kind == "ingress" and t.ingress:
            what += f" (Ingress {t.ingress})"
        if t.service is None:
            t = replace(t, service=infer_service(o.evidence, ctx.chain_services))
        common: _Target = {"lb_ip": t.ip, "port": t.port, "protocol": t.protocol,
                           "service": t.service, "shape": shape_of(o) if o.steps else None}
        ev = list(o.evidence)
        if t.etp:
            line = etp_lines.get((t.etp, t.etp_how))
            if line is None:
                line = etp_lines[(t.etp, t.etp_how)] = \
                    f"externalTrafficPolicy={t.etp} ({t.etp_how or 'from the Service'})"
            ev.append(line)
        ev.append("learned from " + "; ".join(t.learned_from))
        ev += t.disagreements
        if o.kind == Outcome.NOT_MASQUERADED and t.ip_mode == "Proxy":
            # kube-proxy writes no rule for an ipMode: Proxy address (every mode: its
            # service tracker skips it) and hands pod traffic to the load balancer on
            # purpose; a proxying load balancer opens its own connection to the node, so
            # the connection loops only if it keeps the pod's address: not decided here
            ev.append("status.loadBalancer.ingress[].ipMode: Proxy: kube-proxy (1.30+) "
                      "writes no rule for this address in any mode, so pods' traffic goes "
                      "to the load balancer by design")
            why = ("kube-proxy hands it to the load balancer (ipMode: Proxy); it loops only "
                   "if the load balancer forwards it back to this node keeping the pod's "
                   "address, which the node cannot show")
            ctx.unknown(f"nat walk {what}", why)
            out.append(Finding(UNDETERMINED, "warning",
                               f"Could not decide whether pods reaching {what} loop back: "
                               f"{why}", evidence=tuple(ev),
                               remedy=for_not_masqueraded(t, ctx), **common))
        elif o.kind == Outcome.NOT_MASQUERADED:
            v6 = ":" in t.ip  # also an IPv6 target walked beside IPv4 ones (nftables)
            rp = rp_filter_effective(ctx) if not v6 else None
            if v6:
                # IPv6 has no rp_filter: nothing drops the SYN the LB sends back here
                ev.append("if the load balancer sends it back to this node: IPv6 has no "
                          "rp_filter, so the SYN is taken in and the SYN-ACK goes straight "
                          "to the pod, bypassing the load balancer, and the pod resets it")
            if rp is not None:
                ev.append("if the load balancer sends it back to this node: " + (
                    "rp_filter drops the SYN (reverse path is the pod bridge)" if rp == 1 else
                    "the SYN-ACK goes straight to the pod, bypassing the load balancer, "
                    "and the pod resets it"))
            out.append(Finding(
                NOT_MASQUERADED, "critical",
                f"Pods of this node reaching {what} leave with their own address: the load "
                "balancer may pick this node as real server and the connection loops back "
                "and fails (4 s retries on layer 7, resets or timeouts on layer 4)",
                evidence=tuple(ev), remedy=for_not_masqueraded(t, ctx), **common))
        elif o.kind == Outcome.CAPTURED:
            out.append(Finding(CAPTURED, "info",
                               f"Pods reaching {what} are served inside the node: {o.how}",
                               evidence=tuple(ev), remedy=None, **common))
        elif o.kind == Outcome.MASQUERADED:
            out.append(Finding(MASQUERADED, "info",
                               f"Pods reaching {what} go through the load balancer but "
                               "with the node's address: no loop",
                               evidence=tuple(ev), remedy=None, **common))
        elif o.kind == Outcome.DROPPED:
            out.append(Finding(DROPPED, "info",
                               f"Pods of this node cannot reach {what}: the node drops the "
                               f"packet ({o.how}); not a loopback",
                               evidence=tuple(ev),
                               remedy="Check why the rule named in the evidence drops it.",
                               **common))
        else:
            ctx.unknown(f"nat walk {what}", o.how)
            out.append(Finding(UNDETERMINED, "warning",
                               f"Could not decide whether pods reaching {what} loop back: "
                               f"{o.how}",
                               evidence=tuple(ev),
                               remedy="Send `loopback-agent bundle DIR` output to support; "
                                      "the evidence names what could not be evaluated.",
                               **common))
    return out
