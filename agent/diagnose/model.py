"""Findings and the verdict document (schema loopback-agent/verdict/v1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agent.capture.model import CaptureResult, Corroboration, NodePortStats
from agent.quick_init import quick_init
from agent.snapshot import Unknown

VERDICT_SCHEMA = "loopback-agent/verdict/v1"

Severity = Literal["info", "warning", "critical"]
Status = Literal["healthy", "at-risk", "loopback"]
KubeProxyMode = Literal["iptables", "ipvs", "nftables", "unknown"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")
STATUSES: tuple[Status, ...] = ("healthy", "at-risk", "loopback")
KUBE_PROXY_MODES: tuple[KubeProxyMode, ...] = ("iptables", "ipvs", "nftables", "unknown")


def as_mode(word: str | None) -> KubeProxyMode:
    """A mode as the verdict names it: one of kube-proxy's modes this agent walks, else
    "unknown"."""
    return next((m for m in KUBE_PROXY_MODES if m == word), "unknown")


def _severity(word: str) -> Severity:
    return next((s for s in SEVERITIES if s == word), "warning")


def _status(word: str) -> Status:
    return next((s for s in STATUSES if s == word), "at-risk")


@quick_init
@dataclass(frozen=True, slots=True)
class Finding:
    id: str
    severity: Severity
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
class VerdictContext:
    """Where the input came from and what the walk stood on (the verdict's "context";
    the IPv6 fields only where the node has IPv6 LB IPs)."""

    origin: str | None = None
    kube_proxy_mode_from: str = ""
    node_ip: str | None = None
    uplink: str | None = None
    pod_ip: str | None = None
    pod_network: str | None = None
    pod_interface: str | None = None
    iptables_backend: str | None = None
    # the rules the walk took as kube-proxy or kubelet writes them, the input not showing
    assumed_rules: tuple[str, ...] = ()
    given_by_user: dict[str, str] | None = None  # check --mode, --pod-cidr
    ipv6: bool = False  # the fields below are said
    node_ip6: str | None = None
    pod_ip6: str | None = None
    pod_network6: str | None = None
    ip6tables_backend: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "kube_proxy_mode_from": self.kube_proxy_mode_from,
            "node_ip": self.node_ip,
            "uplink": self.uplink,
            "pod_ip": self.pod_ip,
            "pod_network": self.pod_network,
            "pod_interface": self.pod_interface,
            **({"node_ip6": self.node_ip6, "pod_ip6": self.pod_ip6,
                "pod_network6": self.pod_network6,
                "ip6tables_backend": self.ip6tables_backend} if self.ipv6 else {}),
            "iptables_backend": self.iptables_backend,
            "assumed_rules": list(self.assumed_rules),
            **({"given_by_user": dict(self.given_by_user)} if self.given_by_user else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerdictContext:
        return cls(
            origin=d.get("origin"), kube_proxy_mode_from=d.get("kube_proxy_mode_from", ""),
            node_ip=d.get("node_ip"), uplink=d.get("uplink"), pod_ip=d.get("pod_ip"),
            pod_network=d.get("pod_network"), pod_interface=d.get("pod_interface"),
            iptables_backend=d.get("iptables_backend"),
            assumed_rules=tuple(d.get("assumed_rules", ())),
            given_by_user=d.get("given_by_user"), ipv6="node_ip6" in d,
            node_ip6=d.get("node_ip6"), pod_ip6=d.get("pod_ip6"),
            pod_network6=d.get("pod_network6"), ip6tables_backend=d.get("ip6tables_backend"))


@dataclass(frozen=True, slots=True)
class Verdict:
    node: str
    time: str
    agent_version: str
    status: Status
    kube_proxy_mode: KubeProxyMode
    findings: tuple[Finding, ...]
    unknowns: tuple[Unknown, ...]
    lb_ips: tuple[LbIpReport, ...] = ()
    context: VerdictContext = field(default_factory=VerdictContext)
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
            "unknowns": [{"source": u.source, "reason": u.reason} for u in self.unknowns],
            "lb_ips": [r.to_dict() for r in self.lb_ips],
            "context": self.context.to_dict(),
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
            status=_status(d["status"]), kube_proxy_mode=as_mode(d["kube_proxy_mode"]),
            findings=tuple(Finding(**{**f, "severity": _severity(f["severity"]),
                                      "evidence": tuple(f.get("evidence", ()))})
                           for f in d["findings"]),
            unknowns=tuple(Unknown(u["source"], u["reason"]) for u in d.get("unknowns", ())),
            lb_ips=tuple(LbIpReport(r["ip"], tuple(r["ports"]), r["kind"],
                                    tuple(r["services"]), tuple(r["learned_from"]),
                                    r.get("local")) for r in d.get("lb_ips", ())),
            context=VerdictContext.from_dict(d.get("context") or {}),
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


def status_of(findings: tuple[Finding, ...] | list[Finding], observed: bool = False
              ) -> Status:
    """"loopback" when capture saw it, "at-risk" with any warning/critical finding."""
    if observed:
        return "loopback"
    if any(f.severity in ("warning", "critical") for f in findings):
        return "at-risk"
    return "healthy"
