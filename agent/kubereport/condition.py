"""What a verdict says as one Node condition, an NPD plugin line and Warning Events.

Pure functions of a Verdict: the writer (``writer``) and `check --npd` share them, so the
condition the agent writes and the one node-problem-detector would write agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.diagnose.model import Finding, Verdict
from agent.verdict_doc import UNDECIDED_IDS

CONDITION_TYPE = "LoadBalancerLoopback"
HEALTHY_REASON = "NoLoadBalancerLoopback"
UNKNOWN_REASON = "LoopbackUndetermined"
MESSAGE_MAX = 256  # a condition message is read in `kubectl describe node`: keep it short
RANK = {"critical": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Condition:
    status: str  # "True" | "False" | "Unknown"
    reason: str  # CamelCase
    message: str


def camel(finding_id: str) -> str:
    """"pod-to-lb-not-masqueraded" -> "PodToLbNotMasqueraded" (a condition's reason)."""
    return "".join(p[:1].upper() + p[1:] for p in finding_id.replace("_", "-").split("-")
                   if p) or "Unknown"


def serious(v: Verdict) -> list[Finding]:
    """Warning and critical findings, most severe first (stable within a severity)."""
    return sorted((f for f in v.findings if f.severity in ("warning", "critical")),
                  key=lambda f: RANK[f.severity])


def condition_of(v: Verdict) -> Condition:
    """The verdict's status as a condition: loopback and at-risk True, unknown Unknown,
    healthy False (the status decides; the findings name the reason)."""
    found = serious(v)
    definite = [f for f in found if f.id not in UNDECIDED_IDS]
    if v.status in ("loopback", "at-risk"):
        top = (definite or found or [None])[0]
        reason = camel(top.id) if top else "LoopbackObserved"
        return Condition("True", reason, _message(v.status, definite or found))
    if v.status == "unknown":
        if found:  # the "cannot tell" findings say what
            return Condition("Unknown", camel(found[0].id), _message("undetermined", found))
        return Condition("Unknown", UNKNOWN_REASON,
                         _bounded(f"kube-proxy's mode is unknown ({v.kube_proxy_mode}): "
                                  "no exposure found, none ruled out"))
    return Condition("False", HEALTHY_REASON,
                     _bounded(f"no LoadBalancer loopback exposure ({len(v.lb_ips)} LB "
                              f"IPs checked, kube-proxy {v.kube_proxy_mode})"))


def _message(status: str, findings: list[Finding]) -> str:
    """"at-risk: 10.0.1.100 (default/web), 10.0.1.101 (default/api) +3 more"."""
    parts: list[str] = []
    for f in findings:
        if f.lb_ip:
            part = f"{f.lb_ip} ({f.service})" if f.service else f.lb_ip
            if part not in parts:
                parts.append(part)
    if not parts:
        return _bounded(f"{status}: {findings[0].summary}" if findings else status)
    out, shown = f"{status}: ", 0
    for part in parts:
        candidate = out + (", " if shown else "") + part
        more = len(parts) - shown - 1
        if shown and len(candidate) + (len(f" +{more} more") if more else 0) > MESSAGE_MAX:
            break
        out, shown = candidate, shown + 1
    if shown < len(parts):
        out += f" +{len(parts) - shown} more"
    return _bounded(out)


def _bounded(text: str, limit: int = MESSAGE_MAX) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- node-problem-detector's custom plugin protocol ----------------------------------------

NPD_OK, NPD_NONOK, NPD_UNKNOWN = 0, 1, 2
NPD_LINE_MAX = 200  # the plugin config's max_output_length (daemonset/npd/) must match


def npd_result(v: Verdict) -> tuple[int, str]:
    """(exit code, one line) for NPD: 0 OK, 1 NonOK, 2 Unknown."""
    c = condition_of(v)
    code = {"True": NPD_NONOK, "False": NPD_OK}.get(c.status, NPD_UNKNOWN)
    return code, npd_line(f"{c.reason}: {c.message}")


def npd_line(text: str) -> str:
    return _bounded(text, NPD_LINE_MAX)


# -- Warning Events --------------------------------------------------------------------------


@dataclass(frozen=True)
class EventKey:
    """One finding as an Event series: what it is about and what it says."""

    finding: str
    lb_ip: str
    port: int
    service: str  # "ns/name" or "" (then the Event regards the Node)


def event_keys(v: Verdict) -> dict[EventKey, Finding]:
    """The warning/critical findings an Event is due for when they appear."""
    out: dict[EventKey, Finding] = {}
    for f in serious(v):
        out.setdefault(EventKey(f.id, f.lb_ip or "", f.port or 0, f.service or ""), f)
    return out
