"""Read `kubectl get svc [-A] [-o wide]` text into Services.

The table has no externalTrafficPolicy, annotations or ipMode: what it gives is each
Service's type, ClusterIP, EXTERNAL-IP (the load balancer's ingress IPs for type
LoadBalancer, else spec.externalIPs) and ports with their NodePorts.
"""

from __future__ import annotations

import re

from agent.errors import InputError
from agent.parse.ip_text import canonical_ip
from agent.snapshot import LoadBalancerIngress, Service, ServicePort

_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"})
_PORT = re.compile(r"^(\d+)(?::(\d+))?/(TCP|UDP|SCTP)$")


def parse_svc_table(text: str, source: str = "services.txt") -> tuple[Service, ...]:
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise InputError(source, None, "empty")
    header = lines[0][1].split()
    rows = lines[1:]
    if "NAME" not in header or "EXTERNAL-IP" not in header:
        # rows without their header (trimmed by hand): kubectl's own column order
        first = header
        header = (["NAMESPACE"] if len(first) > 1 and first[2:3] and first[2] in _TYPES
                  else []) + ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE",
                              "SELECTOR"]
        if len(first) < 4:
            raise InputError(source, lines[0][0], "expected the header of `kubectl get svc` "
                             "(NAME TYPE CLUSTER-IP EXTERNAL-IP PORT(S) ...)")
        rows = lines
    col = {name: i for i, name in enumerate(header)}
    out = []
    for n, line in rows:
        words = line.split()
        need = max(col[c] for c in ("NAMESPACE", "NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP")
                   if c in col) + 1
        if len(words) < need or ("TYPE" in col and words[col["TYPE"]] not in _TYPES):
            raise InputError(source, n, f"not a `kubectl get svc` row: {line.strip()[:60]!r}")
        ns = words[col["NAMESPACE"]] if "NAMESPACE" in col else "default"
        name = words[col["NAME"]]
        cluster_ip = words[col["CLUSTER-IP"]] if "CLUSTER-IP" in col else None
        ext = [x for x in words[col["EXTERNAL-IP"]].split(",") if canonical_ip(x)]
        # kubectl before 1.5 printed no TYPE: an EXTERNAL-IP there was most often the load
        # balancer's (it also showed spec.externalIPs; both reach the node the same way)
        stype = words[col["TYPE"]] if "TYPE" in col else \
            "LoadBalancer" if ext else "ClusterIP"
        ports = []
        at = col.get("PORT(S)")
        port_text = words[at] if at is not None and len(words) > at else ""
        for p in port_text.split(",") if port_text else ():
            m = _PORT.match(p)
            if not m:
                raise InputError(source, n, f"bad PORT(S) entry {p!r}")
            ports.append(ServicePort(int(m.group(1)), m.group(3),
                                     int(m.group(2)) if m.group(2) else None))
        if not ports:
            ports = [ServicePort(0)]  # rows trimmed of PORT(S): the addresses still count
        lb = tuple(LoadBalancerIngress(ip=x) for x in ext) if stype == "LoadBalancer" else ()
        out.append(Service(ns, name, stype, cluster_ip if canonical_ip(cluster_ip or "") else None,
                           external_ips=() if stype == "LoadBalancer" else tuple(ext),
                           lb_ingress=lb, ports=tuple(ports)))
    return tuple(out)
