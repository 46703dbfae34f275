"""Findings from watched NodePort handshakes: loopback that the static checks only
suspect, seen happening (loopback-observed, healthcheck-dropped-local-source), and SYNs
from elsewhere that nobody answers (nodeport-syn-unanswered). One finding per cause:
per (finding id, LB IP) or, for dropped health checks, per source address, with the
NodePorts it touched in a bounded table (the finding's ``data``).

A health check from an address local here fails in one of two ways, told apart by what
the capture saw, not by the address family: IPv4 drops the SYN as martian source
(``unanswered``); IPv6 (which has no martian check) and IPv4 with accept_local=1 take it
in and answer, but the SYN-ACK's destination is local, so it is routed to lo and the
node resets its own half-open connection there (``bypassed`` through lo), or, when the
NodePort is DNATed to a pod, the pod's SYN-ACK is taken in by the node and no answer
leaves at all (``unanswered`` from an IPv6 source). Same cause, same remedy, same finding
id; the summary says which happened."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.capture.model import (
    BYPASSED,
    RESET,
    SRC_LB,
    SRC_LOCAL,
    SRC_OTHER,
    SRC_POD,
    UNANSWERED,
    CaptureResult,
    FailedHandshakes,
    HandshakeSample,
    NodePortStats,
)
from agent.diagnose.context import Context
from agent.diagnose.model import Finding, Severity
from agent.parse.ip_text import host_port

LOOPBACK_OBSERVED = "loopback-observed"
HEALTHCHECK_DROPPED = "healthcheck-dropped-local-source"
SYN_UNANSWERED = "nodeport-syn-unanswered"

# One finding per cause, not per port: a burst to the whole NodePort range is one finding
# whose table (``data``) holds the ports. Bounded: the busiest TOP_PORTS rows, the ports
# as at most MAX_RANGES ranges, SAMPLES sample lines, MAX_PER_ID findings per id.
TOP_PORTS = 10
MAX_RANGES = 32
SAMPLES = 6
MAX_PER_ID = 20  # findings per id; the smallest causes beyond are merged into one

_TEXT: dict[str, tuple[Severity, str, str]] = {
    LOOPBACK_OBSERVED: (
        "critical",
        "SYNs came back through the load balancer from clients on this node and the "
        "handshake failed (the reply bypassed the load balancer, or the SYN was dropped)",
        "Stop pods reaching this Service through the load balancer address: use the "
        "Service DNS name; see the static findings for the remedy that fits."),
    HEALTHCHECK_DROPPED: (
        "critical",
        # the "how" (martian drop, answer routed to lo) comes first: see _local_how
        ": a load balancer VIP bound here (its health checks fail on this node) or a "
        "host-network client reaching the load balancer (see the sample sources)",
        "Stop binding the VIP on this node or make the load balancer health-check from a "
        "non-local address (on TKE: the prevent-loopback annotation with health checks "
        "from 100.64.0.0/10)."),
    SYN_UNANSWERED: (
        "warning",
        "from other sources got no answer within the handshake timeout",
        "Look for a DROP rule or a missing endpoint for this NodePort (an "
        "externalTrafficPolicy=Local service without a local endpoint is expected to "
        "ignore them)."),
}
# (source class, outcome) pairs each finding counts
_COUNTS = {
    LOOPBACK_OBSERVED: ((SRC_POD, BYPASSED), (SRC_POD, UNANSWERED), (SRC_OTHER, BYPASSED),
                        (SRC_LB, BYPASSED)),
    HEALTHCHECK_DROPPED: ((SRC_LOCAL, UNANSWERED), (SRC_LOCAL, BYPASSED)),
    SYN_UNANSWERED: ((SRC_OTHER, UNANSWERED), (SRC_LB, UNANSWERED)),
}


@dataclass(frozen=True)
class _Row:
    """One NodePort's part of a finding."""

    port: NodePortStats
    service: str | None
    lb_ip: str | None
    bypassed: int
    unanswered: int
    first_seen: float | None  # wall clock, None when the capture did not say
    last_seen: float | None

    @property
    def syns(self) -> int:
        return self.bypassed + self.unanswered


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
    cells: dict[int, list[FailedHandshakes]] = {}
    for f in cap.failures:
        cells.setdefault(f.node_port, []).append(f)
    # (finding id, LB IP or source address) -> its rows, in port order
    groups: dict[tuple[str, str | None], list[_Row]] = {}
    for port in cap.ports:
        svc, lb_ip = services.get(port.node_port, (None, None))
        mine = cells.get(port.node_port, [])
        for fid in (LOOPBACK_OBSERVED, SYN_UNANSWERED):
            row = _row(port, svc, lb_ip, fid, mine)
            if row.syns:
                groups.setdefault((fid, lb_ip), []).append(row)
        for src, row in _local_rows(port, svc, lb_ip, mine):
            groups.setdefault((HEALTHCHECK_DROPPED, src), []).append(row)
    lb_ips = {t.ip for t in ctx.targets}
    out: list[Finding] = []
    for fid in _TEXT:
        causes = sorted(((key, rows) for (f, key), rows in groups.items() if f == fid),
                        key=lambda g: (-sum(r.syns for r in g[1]), g[0] or ""))
        # a node holding every LB VIP (IPVS) may see health checks from hundreds of
        # them: the verdict keeps the biggest causes and one finding for the rest
        kept = causes if len(causes) <= MAX_PER_ID else causes[:MAX_PER_ID - 1]
        out += [_finding(cap, fid, key, rows, lb_ips) for key, rows in kept]
        rest = causes[len(kept):]
        if rest:
            out.append(_finding(cap, fid, None, _merge([r for _, rows in rest
                                                        for r in rows]),
                                lb_ips, others=[key for key, _ in rest], parts=rest))
    return out


def _merge(rows: list[_Row]) -> list[_Row]:
    """Rows of several causes as one row per NodePort."""
    by_port: dict[int, _Row] = {}
    for r in rows:
        got = by_port.get(r.port.node_port)
        if got is None:
            by_port[r.port.node_port] = r
            continue
        firsts = [t for t in (got.first_seen, r.first_seen) if t is not None]
        lasts = [t for t in (got.last_seen, r.last_seen) if t is not None]
        by_port[r.port.node_port] = _Row(
            got.port, got.service, got.lb_ip if got.lb_ip == r.lb_ip else None,
            got.bypassed + r.bypassed, got.unanswered + r.unanswered,
            min(firsts, default=None), max(lasts, default=None))
    return [by_port[p] for p in sorted(by_port)]


def _row(port: NodePortStats, svc: str | None, lb_ip: str | None, fid: str,
         cells: list[FailedHandshakes], src: str | None = None) -> _Row:
    pairs = _COUNTS[fid]
    counted = [(c, o) for c, o in pairs if port.counts.get(o, {}).get(c, 0)]
    bypassed = sum(port.counts[o][c] for c, o in counted if o == BYPASSED)
    unanswered = sum(port.counts[o][c] for c, o in counted if o == UNANSWERED)
    mine = [f for f in cells if (f.source_class, f.outcome) in pairs
            and (src is None or f.src == src)]
    if src is not None:  # one local source's share of the port
        bypassed = sum(f.count for f in mine if f.outcome == BYPASSED)
        unanswered = sum(f.count for f in mine if f.outcome == UNANSWERED)
    return _Row(port, svc, lb_ip, bypassed, unanswered,
                min((f.first_seen for f in mine), default=None),
                max((f.last_seen for f in mine), default=None))


def _local_rows(port: NodePortStats, svc: str | None, lb_ip: str | None,
                cells: list[FailedHandshakes]) -> list[tuple[str | None, _Row]]:
    """The port's dropped SYNs from local sources, per source address when the capture
    counted them so (else one row, under the samples' address if they name only one)."""
    whole = _row(port, svc, lb_ip, HEALTHCHECK_DROPPED, cells)
    if not whole.syns:
        return []
    srcs = sorted({f.src for f in cells if f.source_class == SRC_LOCAL and f.src})
    rows: list[tuple[str | None, _Row]] = [
        (s, _row(port, svc, lb_ip, HEALTHCHECK_DROPPED, cells, s)) for s in srcs]
    if rows and sum(r.syns for _, r in rows) == whole.syns:
        return rows
    named = {s.src for s in port.samples if s.source_class == SRC_LOCAL}
    return [(named.pop() if len(named) == 1 else None, whole)]


def _finding(cap: CaptureResult, fid: str, key: str | None, rows: list[_Row],
             lb_ips: set[str], others: list[str | None] | None = None,
             parts: list[tuple[str | None, list[_Row]]] | None = None) -> Finding:
    """The finding of one cause; ``others``: the keys (source addresses, LB IPs) of
    the causes merged into this one beyond MAX_PER_ID, ``parts`` their rows unmerged
    (a merged health-check finding words each family's share by its own source keys)."""
    severity, what, remedy = _TEXT[fid]
    total = sum(r.syns for r in rows)
    ports = [r.port.node_port for r in rows]
    services = list(dict.fromkeys(r.service for r in rows if r.service))
    where_lb = {r.lb_ip for r in rows}
    if fid == HEALTHCHECK_DROPPED:
        lb_ip = key if key in lb_ips else (next(iter(where_lb)) if len(where_lb) == 1
                                          else None)
    else:
        lb_ip = key
    ranges = port_ranges(ports)
    shown = ", ".join(ranges[:3]) + (", ..." if len(ranges) > 3 else "")
    where = (f"NodePort {ports[0]}" if len(ports) == 1
             else f"{len(ports)} NodePorts ({shown})")
    if fid == LOOPBACK_OBSERVED:
        summary = f"Loopback observed on {where}: {total} {what}"
    else:
        summary = f"{total} SYNs to {where} {what}"
    if fid == HEALTHCHECK_DROPPED:
        origin = (f"came from {key}, an address local on this node," if key
                  else f"came from {len(others)} addresses local on this node" if others
                  else "came from an address that is local on this node")
        summary = f"{total} SYNs to {where} {origin} {_local_how(parts or [(key, rows)])}{what}"
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        for o, by in r.port.counts.items():
            for c, n in by.items():
                counts.setdefault(o, {})[c] = counts.get(o, {}).get(c, 0) + n
    evidence = [f"captured {cap.seconds:.0f}s on all interfaces: "
                f"{sum(r.port.syns for r in rows)} SYNs to {where}; "
                + _counts_line(counts)]
    if len(rows) > 1 and len({r.syns for r in rows}) > 1:
        top = sorted(rows, key=_busiest)[:3]
        evidence.append("most: " + ", ".join(f"NodePort {r.port.node_port} {r.syns}"
                                              for r in top)
                        + (f" and {len(rows) - 3} more NodePorts" if len(rows) > 3 else ""))
    pairs = _COUNTS[fid]
    in_group = set(ports)
    samples = [s for r in rows for s in r.port.samples
               if (s.source_class, s.outcome) in pairs and s.dport in in_group
               and (fid != HEALTHCHECK_DROPPED or key is None or s.src == key)]
    evidence += [_sample(s) for s in samples[:SAMPLES]]
    evidence += [f"{c.source}: " + (f"{c.value} ({c.detail})" if c.value is not None
                                    else c.detail) for c in cap.corroboration]
    if others and fid != HEALTHCHECK_DROPPED:
        summary += f" (the {len(others)} LB IPs with the fewest such SYNs together)"
    return Finding(fid, severity, summary, lb_ip=lb_ip,
                   port=ports[0] if len(ports) == 1 else None,
                   protocol=rows[0].port.protocol,
                   service=services[0] if len(services) == 1 else None,
                   evidence=tuple(evidence), remedy=remedy,
                   data=_table(fid, key, rows, ranges, others))


def _table(fid: str, key: str | None, rows: list[_Row], ranges: list[str],
           others: list[str | None] | None = None) -> dict[str, Any]:
    """The finding's NodePort table, bounded whatever the number of ports."""
    firsts = [r.first_seen for r in rows if r.first_seen is not None]
    lasts = [r.last_seen for r in rows if r.last_seen is not None]
    top = sorted(rows, key=_busiest)[:TOP_PORTS]
    listed = ranges[:MAX_RANGES]
    out: dict[str, Any] = {
        "kind": "nodeport-table",
        "nodeports": len(rows),
        "syns": sum(r.syns for r in rows),
        "bypassed": sum(r.bypassed for r in rows),
        "unanswered": sum(r.unanswered for r in rows),
        "first_seen": _iso(min(firsts)) if firsts else None,
        "last_seen": _iso(max(lasts)) if lasts else None,
        "port_ranges": listed,
        "ports_not_in_ranges": sum(_range_size(x) for x in ranges[MAX_RANGES:]),
        "services": sorted({r.service for r in rows if r.service})[:TOP_PORTS],
        "ports": [{"node_port": r.port.node_port, "service": r.service, "syns": r.syns,
                   "bypassed": r.bypassed, "unanswered": r.unanswered,
                   "first_seen": _iso(r.first_seen), "last_seen": _iso(r.last_seen)}
                  for r in sorted(top, key=lambda r: r.port.node_port)],
        "ports_more": len(rows) - len(top),
    }
    if fid == HEALTHCHECK_DROPPED:
        out["source"] = key
    if others:
        # merged causes: how many, and the first few of their addresses
        out["merged"] = len(others)
        out["merged_keys"] = sorted(k or "?" for k in others)[:TOP_PORTS]
    return out


def _busiest(r: _Row) -> tuple[int, bool, int]:
    """Most failed SYNs first; among equals, ports of a known Service first."""
    return (-r.syns, r.service is None, r.port.node_port)


def port_ranges(ports: list[int]) -> list[str]:
    """Sorted ports as compact ranges: [30000, 30001, 30002, 30080] -> ["30000-30002",
    "30080"]."""
    out: list[str] = []
    run: list[int] = []
    for p in sorted(set(ports)):
        if run and p == run[-1] + 1:
            run.append(p)
            continue
        if run:
            out.append(_range_text(run))
        run = [p]
    if run:
        out.append(_range_text(run))
    return out


def _range_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def _range_size(text: str) -> int:
    lo, _, hi = text.partition("-")
    return int(hi or lo) - int(lo) + 1


def _iso(t: float | None) -> str | None:
    if t is None or t <= 0:
        return None
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# How SYNs from a local source failed (HEALTHCHECK_DROPPED), by what the capture saw.
_MARTIAN = "were dropped as martian source"
# IPv6 takes the SYN in; with the NodePort DNATed to a pod (kube-proxy), the pod's SYN-ACK
# comes back addressed to this node's own address and is taken in, never sent out
# (tests/test_capture_ipv6_netns.py): the capture sees no answer, as for a drop
_NO_ANSWER_V6 = ("got no answer out of the node (IPv6 has no martian-source drop: a pod "
                 "behind the NodePort answered and its SYN-ACK, addressed to this node's "
                 "own address, was taken in here, or something else dropped them)")
_NO_ANSWER = "got no answer (dropped: as martian source if IPv4)"
_TO_LO = ("were answered, but the SYN-ACK went to lo (its destination is this node's own "
          "address) and never left the node")


def _local_how(parts: list[tuple[str | None, list[_Row]]]) -> str:
    """``and were dropped as martian source``, ``and were answered, but ... lo``, or
    several with their counts. Unanswered SYNs are worded by their source's family (the
    key, else the local samples' addresses): IPv4 drops them as martian, IPv6 has no
    such drop; a merged finding of many sources counts each family's share."""
    bypassed = sum(r.bypassed for _, rows in parts for r in rows)
    unanswered: dict[int | None, int] = {}
    for key, rows in parts:
        family = _family(key, rows)
        unanswered[family] = unanswered.get(family, 0) + sum(r.unanswered for r in rows)
    said = [(n, text) for n, text in ((unanswered.get(4, 0), _MARTIAN),
                                      (unanswered.get(6, 0), _NO_ANSWER_V6),
                                      (unanswered.get(None, 0), _NO_ANSWER),
                                      (bypassed, _TO_LO)) if n]
    if len(said) == 1:
        return f"and {said[0][1]}"
    return "and " + ", ".join(f"{n} {text}" for n, text in said)


def _family(key: str | None, rows: list[_Row]) -> int | None:
    """4 or 6: the family of a local source (its key, else its samples' addresses, when
    they agree); None when it cannot be told."""
    srcs = {key} if key else {s.src for r in rows for s in r.port.samples
                               if s.source_class == SRC_LOCAL}
    families = {6 if ":" in s else 4 for s in srcs}
    return families.pop() if len(families) == 1 else None


def _counts_line(counts: dict[str, dict[str, int]]) -> str:
    parts = []
    for outcome, by_src in sorted(counts.items()):
        for src, n in sorted(by_src.items()):
            if n:
                parts.append(f"{outcome} from {src}: {n}")
    return ", ".join(parts) or "no outcome recorded"


def _sample(s: HandshakeSample) -> str:
    what = {
        BYPASSED: f"SYN-ACK left through {s.reply_iface}, not {s.in_iface}: "
                  + ("routed back into this node, it never left" if s.reply_iface == "lo"
                     else "it bypassed the load balancer"),
        # IPv6 drops no local source: a pod's answer may have been taken in here
        UNANSWERED: "no SYN-ACK left the node" if s.source_class == SRC_LOCAL
                    and ":" in s.src else "no SYN-ACK: dropped",
        RESET: f"answered by RST through {s.reply_iface}",
    }.get(s.outcome, s.outcome)
    tail = "; the client reset it (it expected the load balancer)" if s.peer_reset else ""
    return (f"{host_port(s.src, s.sport)} -> {host_port(s.dst, s.dport)} in {s.in_iface} "
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
            name = f"{m.group(1)}/{m.group(2)}"
            out[int(m.group(3))] = (name, lb_by_service.get(name))
    return out


_NODEPORT_RULE = re.compile(
    r'--comment "([a-z0-9][-a-z0-9.]*)/([a-z0-9][-a-z0-9.]*)[:"].*--dport (\d+)\b')
