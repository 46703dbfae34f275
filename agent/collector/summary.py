"""A node's summary: what the fleet views need from its latest verdict, computed once when
the verdict is stored. The page, /metrics, /v1/nodes and /v1/services read only these,
never the verdict documents (a fleet's documents do not fit in memory at once)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agent.verdict_doc import (
    OBSERVED_IDS,
    STATUSES,
    UNDECIDED_IDS,
    lb_ip_counts,
    status_of_doc,
)

RANK = {s: i for i, s in enumerate(STATUSES)}  # worst first
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class FindingRow:
    """One serious finding that names an LB IP or a Service ('' when it names none): an
    exposure or an observed loop, not an undecided path (the node's status says that)."""

    service: str
    lb_ip: str
    finding_id: str
    observed: bool  # loopback seen (capture), not only exposure


@dataclass(frozen=True)
class NodeSummary:
    node: str
    status: str
    time: str
    kube_proxy_mode: str
    findings: int  # serious (not info) findings
    ids: tuple[str, ...]  # their distinct ids, sorted
    unknowns: int
    lb_ips: int  # addresses considered
    lb_ips_local: int  # of which local to the node
    rows: tuple[FindingRow, ...]

    @property
    def rank(self) -> int:
        return RANK.get(self.status, len(RANK))


def _text(value: Any) -> str:
    # old databases may hold lone surrogates (stored before they were refused): a summary
    # holds only text that encodes, so no page or reply can fail on it
    return _SURROGATE.sub("\ufffd", value) if isinstance(value, str) else ""


def summarize(v: dict[str, Any]) -> NodeSummary:
    """The summary of one verdict (schema-valid, or an old stored one: read defensively)."""
    findings = [f for f in v.get("findings") or [] if isinstance(f, dict)]
    serious = [f for f in findings if f.get("severity") != "info"]
    rows = {FindingRow(_text(f.get("service")), _text(f.get("lb_ip")), _text(f.get("id")),
                       f.get("id") in OBSERVED_IDS)
            for f in serious if (f.get("lb_ip") or f.get("service"))
            and f.get("id") not in UNDECIDED_IDS}  # "could not tell" is not exposure
    total, local = lb_ip_counts(v)
    return NodeSummary(
        node=_text(v.get("node")), status=_text(status_of_doc(v)), time=_text(v.get("time")),
        kube_proxy_mode=_text(v.get("kube_proxy_mode")), findings=len(serious),
        ids=tuple(sorted({_text(f.get("id")) for f in serious})),
        unknowns=len(v.get("unknowns") or []), lb_ips=total, lb_ips_local=local,
        rows=tuple(sorted(rows, key=lambda r: (r.service, r.lb_ip, r.finding_id))))
