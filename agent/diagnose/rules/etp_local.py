"""etp-local-no-local-endpoint: an externalTrafficPolicy=Local service with no endpoint
on this node; failing load-balancer health checks here are expected."""

from __future__ import annotations

from agent.diagnose.context import Context
from agent.diagnose.model import Finding

ID = "etp-local-no-local-endpoint"
_LOCAL_HINTS = ("has no local endpoints", "KUBE-XLB-", "KUBE-SVL-")


def check(ctx: Context) -> list[Finding]:
    out = []
    for t in ctx.targets:
        if t.kind == "ingress" or t.etp == "Cluster":
            continue
        ev: list[str] = []
        if ctx.mode == "ipvs":
            if t.etp != "Local":
                continue
            if ctx.snapshot.ipvs is None:
                ctx.unknown(ID, "IPVS state unknown: cannot tell which externalTrafficPolicy="
                            "Local services have endpoints on this node")
                continue
            vs = ctx.facts.virtual_server(t.protocol, t.ip, t.port)
            if vs is not None and vs.real_servers:
                continue
            ev.append(f"externalTrafficPolicy=Local ({t.etp_how})")
            ev.append(f"IPVS virtual server {t.protocol} {t.ip}:{t.port} "
                      + ("has no real servers" if vs else "does not exist"))
        else:
            served = ctx.paths.outside_to_lb(t)
            if served.served is None:
                if t.etp == "Local":
                    ctx.unknown(ID, f"{t.ip}:{t.port}: {served.how}")
                continue
            if served.served:
                continue
            hinted = any(h in line for line in served.evidence for h in _LOCAL_HINTS)
            if t.etp != "Local" and not hinted:
                continue
            ev.extend(served.evidence)
            ev.append(f"externalTrafficPolicy=Local ({t.etp_how or 'kube-proxy rules'})")
        out.append(Finding(
            ID, "info",
            f"{t.service or t.ip} ({t.ip}:{t.port}/{t.protocol}) is externalTrafficPolicy="
            "Local and has no endpoint on this node: the load balancer's health checks "
            "fail here by design",
            lb_ip=t.ip, port=t.port, protocol=t.protocol, service=t.service,
            evidence=tuple(ev), remedy=None))
    return out
