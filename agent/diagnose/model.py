"""Findings and the verdict document (schema loopback-agent/verdict/v1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.capture.model import CaptureResult, Corroboration, NodePortStats
from agent.quick_init import quick_init

VERDICT_SCHEMA = "loopback-agent/verdict/v1"

SEVERITIES = ("info", "warning", "critical")
STATUSES = ("healthy", "at-risk", "loopback")


@quick_init
@dataclass(frozen=True, slots=True)
class Finding:
    id: str
    severity: str  # "info" | "warning" | "critical"
    summary: str
    lb_ip: str | None = None
    port: int | None = None
    protocol: str | None = None
    service: str | None = None  # "ns/name"
    evidence: tuple[str, ...] = ()
    remedy: str | None = None
    # structured evidence, e.g. the NodePort table of a capture finding (schema: data)
    data: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "summary": self.summary,
            "lb_ip": self.lb_ip,
            "port": self.port,
            "protocol": self.protocol,
            "service": self.service,
            "evidence": list(self.evidence),
            "remedy": self.remedy,
            **({"data": self.data} if self.data is not None else {}),
        }


@quick_init
@dataclass(frozen=True, slots=True)
class LbIpReport:
    """One LoadBalancer/external/Ingress address the node knows, for the report."""

    ip: str
    ports: tuple[str, ...]  # "TCP/80"
    kind: str  # "loadbalancer" | "external" | "ingress"
    services: tuple[str, ...]
    learned_from: tuple[str, ...]
    local: bool | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ip": self.ip,
            "ports": list(self.ports),
            "kind": self.kind,
            "services": list(self.services),
            "learned_from": list(self.learned_from),
            "local": self.local,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    node: str
    time: str
    agent_version: str
    status: str
    kube_proxy_mode: str
    findings: tuple[Finding, ...]
    unknowns: tuple[dict[str, str], ...]
    lb_ips: tuple[LbIpReport, ...] = ()
    context: dict[str, Any] = field(default_factory=dict)
    capture: CaptureResult | None = None  # watched handshakes, when captured

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": VERDICT_SCHEMA,
            "node": self.node,
            "time": self.time,
            "agent_version": self.agent_version,
            "status": self.status,
            "kube_proxy_mode": self.kube_proxy_mode,
            "findings": [f.to_dict() for f in self.findings],
            "unknowns": [dict(u) for u in self.unknowns],
            "lb_ips": [r.to_dict() for r in self.lb_ips],
            "context": dict(self.context),
            **({"capture": _capture_summary(self.capture)} if self.capture is not None
               else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        """The typed verdict back from its document (what a collector stored); the
        capture keeps its counts, not its samples."""
        cap = d.get("capture")
        return cls(
            node=d["node"], time=d["time"], agent_version=d["agent_version"],
            status=d["status"], kube_proxy_mode=d["kube_proxy_mode"],
            findings=tuple(Finding(**{**f, "evidence": tuple(f.get("evidence", ()))})
                           for f in d["findings"]),
            unknowns=tuple(dict(u) for u in d.get("unknowns", ())),
            lb_ips=tuple(LbIpReport(r["ip"], tuple(r["ports"]), r["kind"],
                                    tuple(r["services"]), tuple(r["learned_from"]),
                                    r.get("local")) for r in d.get("lb_ips", ())),
            context=dict(d.get("context", {})),
            capture=None if cap is None else CaptureResult(
                seconds=cap["seconds"], port_range=tuple(cap["nodeport_range"]),
                ports=tuple(NodePortStats(p["node_port"], syns=p["syns"], counts=p["counts"])
                            for p in cap["ports"]),
                ports_omitted=cap.get("ports_more", 0),
                syns_omitted=cap.get("syns_more", 0),
                kernel_packets=cap["kernel_packets"], kernel_drops=cap["kernel_drops"],
                kernel_freezes=cap["kernel_freezes"], retransmissions=cap["retransmissions"],
                table_evictions=cap["table_evictions"], decode_errors=cap["decode_errors"],
                corroboration=tuple(Corroboration(**c) for c in cap["corroboration"])))

    def change_key(self) -> tuple[Any, ...]:
        """What makes a verdict different enough to ship at once."""
        return (self.status, tuple(sorted((f.id, f.lb_ip or "", f.port or 0)
                                          for f in self.findings)))


# NodePorts listed in a verdict's capture summary: a burst to the whole range must not
# put 2768 rows in every verdict (the findings carry the failed ones as ranges).
SUMMARY_PORTS = 50


def _failed(p: NodePortStats) -> int:
    return sum(n for o in ("bypassed", "unanswered") for n in p.counts.get(o, {}).values())


def _capture_summary(cap: CaptureResult) -> dict[str, Any]:
    # the ports with the most failed handshakes, then the busiest; in port order
    shown = sorted(sorted(cap.ports, key=lambda p: (-_failed(p), -p.syns, p.node_port))
                   [:SUMMARY_PORTS], key=lambda p: p.node_port)
    left_out = len(cap.ports) - len(shown)
    return {
        "seconds": cap.seconds,
        "nodeport_range": list(cap.port_range),
        "syns": sum(p.syns for p in cap.ports) + cap.syns_omitted,
        "ports": [{"node_port": p.node_port, "syns": p.syns, "counts": p.counts}
                  for p in shown],
        **({"ports_more": left_out + cap.ports_omitted,
            "syns_more": sum(p.syns for p in cap.ports) - sum(p.syns for p in shown)
            + cap.syns_omitted} if left_out or cap.ports_omitted else {}),
        "kernel_packets": cap.kernel_packets,
        "kernel_drops": cap.kernel_drops,
        "kernel_freezes": cap.kernel_freezes,
        "retransmissions": cap.retransmissions,
        "table_evictions": cap.table_evictions,
        "decode_errors": cap.decode_errors,
        "corroboration": [{"source": c.source, "available": c.available, "value": c.value,
                           "detail": c.detail} for c in cap.corroboration],
    }


def status_of(findings: tuple[Finding, ...] | list[Finding], observed: bool = False) -> str:
    """"loopback" when capture saw it, "at-risk" with any warning/critical finding."""
    if observed:
        return "loopback"
    if any(f.severity in ("warning", "critical") for f in findings):
        return "at-risk"
    return "healthy"
