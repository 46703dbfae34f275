"""What every reader of a verdict document needs, for each schema version it may meet:
an agent fleet upgrades node by node, so a collector, a log reader or the kubectl plugin
holds v1 and v2 documents at once (issue 32). A leaf: the standard library only.

- v1 (``loopback-agent/verdict/v1``): every finding itemised, every LB IP listed; status
  healthy, at-risk or loopback ("at-risk" also when only an undecided finding stood).
- v2 (``loopback-agent/verdict/v2``): status may be "unknown"; LB IPs that are fine are
  counted by outcome and rule shape (``ok``), not itemised, unless the document says
  ``"detail": "all"``; ``lb_ip_counts`` carries what the list no longer can.
"""

from __future__ import annotations

import ipaddress
from typing import Any

SCHEMA_V1 = "loopback-agent/verdict/v1"
SCHEMA_V2 = "loopback-agent/verdict/v2"
SCHEMAS = (SCHEMA_V1, SCHEMA_V2)
STATUSES = ("loopback", "at-risk", "unknown", "healthy")  # worst first
# Findings that say a capture saw the loop (the status "loopback"), not only exposure.
OBSERVED_IDS = frozenset({"loopback-observed", "healthcheck-dropped-local-source"})
# Findings that say the agent could not tell, not that the node is at risk.
UNDECIDED_IDS = frozenset({"lb-ips-unknown", "pod-to-lb-undetermined", "diagnosis-incomplete"})
_WALKED_MODES = ("iptables", "ipvs", "nftables")


def status_of_doc(doc: dict[str, Any]) -> str:
    """The document's status as v2 says it: a v1 verdict whose only serious findings are
    undecided, or whose kube-proxy mode is unknown, is "unknown" (v1 said "at-risk" or
    "healthy" for those). Anything else unknown to this version stays as it is."""
    status = doc.get("status")
    if not isinstance(status, str):
        return "unknown"
    if doc.get("schema") != SCHEMA_V1 or status not in ("at-risk", "healthy"):
        return status
    serious = {f.get("id") for f in doc.get("findings") or ()
               if isinstance(f, dict) and f.get("severity") in ("warning", "critical")}
    if status == "at-risk" and serious and serious <= UNDECIDED_IDS:
        return "unknown"
    if status == "healthy" and doc.get("kube_proxy_mode") not in _WALKED_MODES:
        return "unknown"
    return status


def lb_ip_counts(doc: dict[str, Any]) -> tuple[int, int]:
    """(LB IPs the node knows, of which local to it), from either version."""
    counts = doc.get("lb_ip_counts")
    if isinstance(counts, dict):
        total, local = counts.get("total"), counts.get("local")
        if isinstance(total, int) and isinstance(local, int):
            return total, local
    ips = [x for x in doc.get("lb_ips") or () if isinstance(x, dict)]
    return len(ips), sum(1 for x in ips if x.get("local") is True)


def compact_targets(targets: list[tuple[str, int | None, str | None]]) -> list[str]:
    """LB IP targets as short strings: one per port and protocol, its IPv4 addresses
    grouped by /24 ("TCP/80 10.64.0.{7,29,44}"), IPv6 ones in full. 50k LB IPs fit in
    about 300 KB this way; ``expand_targets`` reads them back."""
    by_port: dict[str, list[str]] = {}
    for ip, port, proto in targets:
        by_port.setdefault(f"{proto or '-'}/{port if port else '-'}", []).append(ip)
    out = []
    for where in sorted(by_port):
        v4: dict[str, list[int]] = {}
        other: list[str] = []
        for ip in dict.fromkeys(by_port[where]):
            head, dot, last = ip.rpartition(".")
            if dot and ":" not in ip and last.isascii() and last.isdigit():
                v4.setdefault(head, []).append(int(last))
            else:
                other.append(ip)
        parts = []
        for head in sorted(v4, key=_net_key):
            lasts = sorted(v4[head])
            parts.append(f"{head}.{lasts[0]}" if len(lasts) == 1 else
                         f"{head}.{{{','.join(map(str, lasts))}}}")
        parts += sorted(other)
        out.append(f"{where} {' '.join(parts)}")
    return out


def expand_targets(lines: list[str]) -> list[tuple[str, str]]:
    """``compact_targets``'s strings back as (address, "PROTO/port") pairs."""
    out = []
    for line in lines:
        where, _, rest = line.partition(" ")
        for part in rest.split():
            head, brace, tail = part.partition(".{")
            if brace and tail.endswith("}"):
                out += [(f"{head}.{x}", where) for x in tail[:-1].split(",")]
            else:
                out.append((part, where))
    return out


def _net_key(head: str) -> tuple[int, ...]:
    try:
        return tuple(ipaddress.IPv4Address(head + ".0").packed)
    except ValueError:
        return (256,)
