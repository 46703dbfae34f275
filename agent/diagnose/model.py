"""Findings and the verdict document (schema loopback-agent/verdict/v2; v1 read too).

The document's size follows the problems, not the Services (issue 32): every finding that
is not fine is named (address, port, Service, id), its evidence in full for the first
FULL_PER_ID of its id, past that by reference to the example of its rule shape; the LB
IPs that are fine are counted by outcome and shape, with one example's evidence each and
their addresses in a compact form. ``to_dict("all")`` itemises everything, as v1 did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agent.capture.model import CaptureResult, Corroboration, NodePortStats
from agent.quick_init import quick_init
from agent.snapshot import Unknown
from agent.verdict_doc import OBSERVED_IDS, SCHEMA_V2, UNDECIDED_IDS, compact_targets

VERDICT_SCHEMA = SCHEMA_V2
Detail = Literal["summary", "all", "lb_ip"]
FULL_PER_ID = 20  # findings of one id shown with their evidence; the rest by their shape

Severity = Literal["info", "warning", "critical"]
Status = Literal["healthy", "unknown", "at-risk", "loopback"]
KubeProxyMode = Literal["iptables", "ipvs", "nftables", "unknown"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")
STATUSES: tuple[Status, ...] = ("healthy", "unknown", "at-risk", "loopback")  # best first
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
    # the way the walk decided it (agent.netfilter.shape): findings of one id and shape
    # were decided by rules of the same shapes, and the verdict shows one's evidence
    shape: str | None = None

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
            **({"shape": self.shape} if self.shape is not None else {}),
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
    # and how it was learned (agent.diagnose.kube_proxy_version)
    kube_proxy_version: str | None = None
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
            **({"kube_proxy_version": self.kube_proxy_version} if self.kube_proxy_version
               else {}),
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
            kube_proxy_version=d.get("kube_proxy_version"),
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

    def to_dict(self, detail: Detail = "summary") -> dict[str, Any]:
        """The verdict document: "summary" (the default: what is shipped, spooled and
        served) or "all" (every finding and LB IP itemised, as `check --json --all`)."""
        unknowns, more = _unknowns(self.unknowns, summary=detail == "summary")
        if detail == "summary":
            findings, ok, shapes, abridged = _summarised(self.findings)
            # the LB IPs whose findings are shown in full (the others are named by them)
            named = {f["lb_ip"] for f in findings if not f.get("abridged")}
            reports = [r.to_dict() for r in self.lb_ips if r.ip in named]
        else:
            findings = [f.to_dict() for f in self.findings]
            ok, shapes, reports = [], [], [r.to_dict() for r in self.lb_ips]
            abridged = 0
        return {
            "schema": VERDICT_SCHEMA,
            "node": self.node,
            "time": self.time,
            "agent_version": self.agent_version,
            "status": self.status,
            "kube_proxy_mode": self.kube_proxy_mode,
            "detail": detail,
            "findings": findings,
            **({"ok": ok, "shapes": shapes, "abridged": abridged} if detail == "summary"
               else {}),
            "unknowns": unknowns,
            **({"unknowns_more": more} if more else {}),
            "lb_ip_counts": {"total": len(self.lb_ips),
                             "local": sum(1 for r in self.lb_ips if r.local),
                             "listed": len(reports)},
            "lb_ips": reports,
            "context": self.context.to_dict(),
            **({"capture": _capture_summary(self.capture)} if self.capture is not None
               else {}),
        }

    def for_lb_ip(self, ip: str) -> Verdict:
        """The verdict as it regards one address: its findings and its LB IP report (the
        node's findings about no LB IP too), the status of those."""
        findings = tuple(f for f in self.findings if f.lb_ip in (ip, None))
        return Verdict(
            self.node, self.time, self.agent_version,
            status_of(findings, observed=any(f.id in OBSERVED_IDS for f in findings),
                      mode=self.kube_proxy_mode),
            self.kube_proxy_mode, findings, self.unknowns,
            tuple(r for r in self.lb_ips if r.ip == ip), self.context, self.capture)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        """The typed verdict back from its document (what a collector stored, v1 or v2);
        the capture keeps its counts, not its samples. A v2 summary's fine LB IPs come
        back as counts only (not findings), its abridged findings with their shape's
        example's evidence."""
        cap = d.get("capture")
        examples = {(s["id"], s["shape"]): s["example"] for s in d.get("shapes", ())}

        def finding(f: dict[str, Any]) -> Finding:
            if f.get("abridged"):
                ex = examples.get((f["id"], f.get("shape")), {})
                f = {**f, "summary": f"{f['id']}: as {ex.get('lb_ip')} (shape {f.get('shape')})",
                     "evidence": ex.get("evidence", ()), "remedy": ex.get("remedy")}
                del f["abridged"]
            return Finding(**{**f, "severity": _severity(f["severity"]),
                              "evidence": tuple(f.get("evidence", ()))})

        return cls(
            node=d["node"], time=d["time"], agent_version=d["agent_version"],
            status=_status(d["status"]), kube_proxy_mode=as_mode(d["kube_proxy_mode"]),
            findings=tuple(map(finding, d["findings"])),
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


UNKNOWNS_PER_SOURCE = 20  # in a summary: past it, a source's unknowns are counted


def _unknowns(unknowns: tuple[Unknown, ...], summary: bool
              ) -> tuple[list[dict[str, str]], dict[str, int]]:
    """The unknowns, in a summary the first UNKNOWNS_PER_SOURCE of each source, and how
    many more of each source there are (one per LB IP at 50k Services was 790 KB)."""
    out: list[dict[str, str]] = []
    seen: dict[str, int] = {}
    for u in unknowns:
        n = seen[u.source] = seen.get(u.source, 0) + 1
        if not summary or n <= UNKNOWNS_PER_SOURCE:
            out.append({"source": u.source, "reason": u.reason})
    return out, {s: n - UNKNOWNS_PER_SOURCE for s, n in seen.items()
                 if summary and n > UNKNOWNS_PER_SOURCE}


# Findings that say an LB IP is fine (served inside the node, masqueraded, or failing
# the load balancer's health check by design): counted by shape, not itemised.
FINE_IDS = frozenset({"pod-to-lb-captured", "pod-to-lb-masqueraded",
                      "etp-local-no-local-endpoint"})
_NAMED = ("id", "severity", "lb_ip", "port", "protocol", "service", "shape")


def _summarised(findings: tuple[Finding, ...]
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                           list[dict[str, Any]], int]:
    """(itemised findings, the fine ones grouped, the examples of abridged findings'
    shapes, how many findings were abridged): see the module's doc."""
    out: list[dict[str, Any]] = []
    in_full: dict[str, int] = {}
    ok: dict[tuple[str, str | None], tuple[Finding, list[Finding]]] = {}
    # per id and shape (a finding no walk made: its id is its shape) the first finding
    # and how many were abridged to refer to it
    examples: dict[tuple[str, str | None], tuple[Finding, int]] = {}
    abridged = 0
    for f in findings:
        if f.id in FINE_IDS and f.lb_ip is not None and f.severity == "info":
            ok.setdefault((f.id, f.shape), (f, []))[1].append(f)
            continue
        shown = in_full.get(f.id, 0)
        if shown < FULL_PER_ID or f.lb_ip is None:
            in_full[f.id] = shown + 1
            out.append(f.to_dict())
            examples.setdefault((f.id, f.shape), (f, 0))
            continue
        abridged += 1
        first, n = examples.get((f.id, f.shape), (f, 0))
        examples[(f.id, f.shape)] = (first, n + 1)
        out.append({**{k: getattr(f, k) for k in _NAMED}, "abridged": True})
    ordered = sorted(ok.items(), key=lambda kv: (-len(kv[1][1]), kv[0][0], kv[0][1] or ""))
    groups = [{"id": fid, "severity": first.severity, "shape": shape, "count": len(members),
               "example": first.to_dict(),
               "targets": compact_targets([(m.lb_ip or "", m.port, m.protocol)
                                           for m in members])}
              for (fid, shape), (first, members) in ordered]
    shapes = [{"id": fid, "shape": shape, "abridged": n, "example": first.to_dict()}
              for (fid, shape), (first, n) in examples.items() if n]
    return out, groups, shapes, abridged


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


def status_of(findings: tuple[Finding, ...] | list[Finding], *, observed: bool,
              mode: KubeProxyMode) -> Status:
    """"loopback" when capture saw it; "at-risk" with a warning/critical finding that is
    positive evidence of exposure; "unknown" when nothing at risk was found but something
    that could hide a risk was not decided (an undecided finding, kube-proxy's mode not
    known); "healthy" when every known LB IP was decided. Kubernetes conditions'
    True/Unknown/False, NPD's NonOK/Unknown/OK."""
    if observed:
        return "loopback"
    serious = {f.id for f in findings if f.severity in ("warning", "critical")}
    if serious - UNDECIDED_IDS:
        return "at-risk"
    if serious or mode == "unknown":
        return "unknown"
    return "healthy"
