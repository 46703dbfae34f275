"""Findings and the verdict document (schema loopback-agent/verdict/v1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VERDICT_SCHEMA = "loopback-agent/verdict/v1"

SEVERITIES = ("info", "warning", "critical")
STATUSES = ("healthy", "at-risk", "loopback")


@dataclass(frozen=True)
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
        }


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
    capture: dict[str, Any] | None = None  # summary of watched handshakes, when captured

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
            **({"capture": self.capture} if self.capture is not None else {}),
        }


def status_of(findings: tuple[Finding, ...] | list[Finding], observed: bool = False) -> str:
    """"loopback" when capture saw it, "at-risk" with any warning/critical finding."""
    if observed:
        return "loopback"
    if any(f.severity in ("warning", "critical") for f in findings):
        return "at-risk"
    return "healthy"
