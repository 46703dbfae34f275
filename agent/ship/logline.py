"""The daemon's stdout contract: one JSON object per line, at most LINE_BYTES bytes.

A verdict on a node with 10k LoadBalancer IPs is ~21 MB of JSON. As a log line it breaks
every real pipeline: the CRI (containerd, CRI-O) splits a line longer than 16 KiB into
partial lines (tag P/F) that most shippers do not join again, and the kubelet rotates a
container's log at 10 MiB, so one such line a cycle rotates the whole log away. The log
line is therefore a bounded summary of the verdict; the full verdict is in the spool and
at the collector (``full.key``: its idempotency key) and on the daemon's listener
(``full.http``: GET /verdict, from the node itself).

Whatever the verdict holds (any number of findings, any strings: lone surrogates, control
characters, megabyte Service names), the line is valid JSON, ASCII only (``\\uXXXX``
escapes: no encoding question for any pipeline, and lone surrogates are replaced by
U+FFFD, which strict parsers such as serde_json require) and at most LINE_BYTES bytes with
its newline. It carries what an SRE greps and alerts on: node, time, status, kube-proxy's
mode, counts by severity and by finding id, the most severe findings and the affected LB
IPs up to the budget, and ``omitted`` counts for what did not fit.

Like every line of the agent (agent.logfmt), it starts with ``ts`` (when it was written,
RFC 3339 UTC with milliseconds; ``time`` stays the verdict's), ``level`` (by the status:
healthy info, at-risk and unknown warning, loopback error) and ``msg`` (the status and
the counts by severity, in words). With ``--log-format text`` the same fields make a
human line (agent.logfmt.text_line), within the same bound.

``summary_line`` is pure but for ``ts`` (now, unless given): the daemon decides when a
cycle is unchanged (``same_key``) and then asks for the short form (``unchanged_since``),
which drops the lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent import logfmt
from agent.diagnose.model import SEVERITIES, Verdict

LOG_SCHEMA = "loopback-agent/log/v1"
LINE_BYTES = logfmt.LINE_BYTES  # the CRI's line limit, with the newline
# a verdict line's level, by its status (any other status: warning)
LEVELS = {"healthy": "info", "unknown": "warning", "at-risk": "warning", "loopback": "error"}
MAX_FINDINGS = 20  # shown in a line: the rest of the budget lists affected LB IPs
_HEADER_BYTES = 6144  # the fixed fields' share; their strings are cut shorter past it
_RANK = {s: i for i, s in enumerate(reversed(SEVERITIES))}  # critical 0, warning 1, info 2
_CUT = "\u2026"
# the longest string a field keeps (in characters; shortened further for the header
# when needed, see _header)
_CAPS = {"node": 253, "time": 40, "status": 16, "kube_proxy_mode": 32, "agent_version": 64,
         "url": 256, "spool": 256, "key": 128}
_FINDING_CAPS = {"id": 64, "severity": 16, "lb_ip": 64, "service": 253, "summary": 240}


@dataclass(frozen=True)
class Where:
    """Where the full verdict of this line is (each when there is one)."""

    http: str | None = None  # the daemon's GET /verdict
    collector: str | None = None  # the collector's history of this node
    spool: str | None = None  # the spool directory
    key: str | None = None  # the verdict's idempotency key, when spooled this cycle


def same_key(v: Verdict) -> tuple[Any, ...]:
    """Everything a summary line shows except its time: equal keys, equal lines."""
    return (v.node, v.status, v.kube_proxy_mode, v.agent_version, len(v.unknowns),
            len(v.lb_ips), sum(1 for r in v.lb_ips if r.local),
            tuple((f.id, f.severity, f.lb_ip, f.service, f.port, f.summary)
                  for f in v.findings))


def verdict_level(status: str) -> str:
    return LEVELS.get(status, "warning")


def summary_line(v: Verdict, where: Where = Where(), *, unchanged_since: str | None = None,
                 budget: int = LINE_BYTES, ts: str | None = None, fmt: str = "json") -> str:
    """The verdict's log line, newline included, at most ``budget`` bytes (>= 2048), in
    ``fmt`` (json or text); ``ts``: when it is written (default now).

    With ``unchanged_since`` (the time of the last full line) the short form: the same
    header and severity counts, no lists."""
    if budget < 2048:
        raise ValueError("a log line needs at least 2048 bytes")
    ts = logfmt.timestamp() if ts is None else ts
    if fmt == "text":
        return _text_line(v, where, unchanged_since, budget, ts)
    return _json_line(v, where, unchanged_since, budget, ts)


def _text_line(v: Verdict, where: Where, since: str | None, budget: int, ts: str) -> str:
    """The same fields as a text line: the JSON line's lists are made for a smaller
    budget until the text fits (its flattened keys take more room than JSON's nesting);
    past a few tries the text line's own bound leaves fields out."""
    inner = budget
    counted = _counts(v)
    for _ in range(4):
        fields = _doc(v, where, since, inner, ts, counted)
        head = [str(fields.pop(k)) for k in ("ts", "level", "msg")]
        line = logfmt.text_line(head[0], head[1], head[2], fields, budget=1 << 30)
        if len(line) <= budget or inner <= 2048:
            break
        inner = max(2048, inner * budget // len(line) - 256)
    return logfmt.text_line(head[0], head[1], head[2], fields, budget=budget)


def _json_line(v: Verdict, where: Where, since: str | None, budget: int, ts: str) -> str:
    limit = budget - 1  # the newline
    counted = _counts(v)
    line = _dumps(_doc(v, where, since, budget, ts, counted))
    if len(line) > limit:  # cannot happen (sizes are reserved); never print more anyway:
        # every string at 8 characters (<= 96 bytes escaped), no lists, all omitted
        line = _dumps(_header_at(v, Where(), counted[0], since, 0.0, ts))
    return line + "\n"


_Counted = tuple[dict[str, Any], list[Any], dict[str, int], list[str]]


def _counts(v: Verdict) -> _Counted:
    """The counts, the findings most severe first, the findings by id and the affected
    LB IPs (most severe first)."""
    ordered = sorted(v.findings, key=lambda f: _RANK.get(f.severity, len(_RANK)))
    by_sev: dict[str, int] = {s: 0 for s in reversed(SEVERITIES)}
    by_id: dict[str, int] = {}
    for f in ordered:
        sev = f.severity if f.severity in by_sev else "other"  # one key, whatever it says
        by_sev[sev] = by_sev.get(sev, 0) + 1
        fid = _clean(f.id, _FINDING_CAPS["id"])
        by_id[fid] = by_id.get(fid, 0) + 1
    affected: dict[str, None] = {}  # most severe first, each once
    for f in ordered:
        if f.lb_ip:
            affected.setdefault(_clean(f.lb_ip, _FINDING_CAPS["lb_ip"]), None)
    counts: dict[str, Any] = {
        "findings": len(v.findings), "by_severity": by_sev,
        "lb_ips": len(v.lb_ips), "lb_ips_local": sum(1 for r in v.lb_ips if r.local),
        "lb_ips_affected": len(affected), "unknowns": len(v.unknowns)}
    return counts, ordered, by_id, list(affected)


def _doc(v: Verdict, where: Where, since: str | None, budget: int, ts: str,
         counted: _Counted) -> dict[str, Any]:
    """The line's fields, whose JSON takes at most ``budget`` - 1 bytes."""
    limit = budget - 1  # the newline
    counts, ordered, by_id, affected = counted
    doc = _header(v, where, counts, since, min(_HEADER_BYTES, limit // 2), ts)
    if since is None:
        _fill(doc, ordered, by_id, affected, limit)
    return doc


def _header(v: Verdict, where: Where, counts: dict[str, Any], since: str | None,
            limit: int, ts: str) -> dict[str, Any]:
    """The fixed fields; their strings are cut shorter until they fit ``limit`` bytes
    (a node name of 253 astral characters is 3 KB escaped)."""
    scale = 1.0
    while True:
        doc = _header_at(v, where, counts, since, scale, ts)
        if len(_dumps(doc)) <= limit or scale < 0.01:
            return doc
        scale /= 2


def _header_at(v: Verdict, where: Where, counts: dict[str, Any], since: str | None,
               scale: float, ts: str) -> dict[str, Any]:
    def cap(name: str, value: str | None) -> str | None:
        return None if value is None else _clean(value, max(8, int(_CAPS[name] * scale)))

    full = {k: val for k, val in (
        ("http", cap("url", where.http)), ("collector", cap("url", where.collector)),
        ("spool", cap("spool", where.spool)), ("key", cap("key", where.key)))
        if val is not None}
    status = cap("status", v.status)
    sev = counts["by_severity"]
    msg = (f"verdict{' unchanged' if since is not None else ''}: {status}; findings: "
           f"{counts['findings']} ({sev['critical']} critical, {sev['warning']} warning, "
           f"{sev['info']} info)")
    doc: dict[str, Any] = {
        "ts": _clean(ts, 40), "level": verdict_level(v.status), "msg": msg,
        "schema": LOG_SCHEMA, "node": cap("node", v.node), "time": cap("time", v.time),
        "status": status,
        "kube_proxy_mode": cap("kube_proxy_mode", v.kube_proxy_mode),
        "agent_version": cap("agent_version", v.agent_version),
        "line": "summary" if since is None else "unchanged"}
    if since is not None:
        doc["unchanged_since"] = cap("time", since)
    doc["counts"] = dict(counts)
    doc["full"] = full
    if since is None:
        # the lists' empty shapes, and the largest omitted counts they can take
        doc["counts"]["by_id"] = {}
        doc["findings"] = []
        doc["lb_ips"] = []
        doc["omitted"] = {"findings": counts["findings"],
                          "lb_ips": counts["lb_ips_affected"],
                          "finding_ids": counts["findings"]}
    return doc


def _fill(doc: dict[str, Any], ordered: list[Any], by_id: dict[str, int],
          affected: list[str], limit: int) -> None:
    """By finding id, then the most severe findings (at most MAX_FINDINGS), then the
    affected LB IPs, each while it fits; ``omitted`` says what did not."""
    room = limit - len(_dumps(doc))  # omitted holds its largest values: only shrinks
    ids: dict[str, int] = doc["counts"]["by_id"]
    for fid, n in sorted(by_id.items(), key=lambda kv: -kv[1]):
        cost = len(_dumps(fid)) + 1 + len(str(n)) + (1 if ids else 0)
        if cost > room:
            break
        ids[fid] = n
        room -= cost
    shown: list[dict[str, Any]] = doc["findings"]
    for f in ordered[:MAX_FINDINGS]:
        item = {"id": _clean(f.id, _FINDING_CAPS["id"]),
                "severity": _clean(f.severity, _FINDING_CAPS["severity"]),
                "lb_ip": None if f.lb_ip is None else _clean(f.lb_ip, _FINDING_CAPS["lb_ip"]),
                "service": None if f.service is None
                else _clean(f.service, _FINDING_CAPS["service"]),
                "port": f.port if isinstance(f.port, int) else None,
                "summary": _clean(f.summary, _FINDING_CAPS["summary"])}
        cost = len(_dumps(item)) + (1 if shown else 0)
        if cost > room:
            break
        shown.append(item)
        room -= cost
    ips: list[str] = doc["lb_ips"]
    for ip in affected:
        cost = len(_dumps(ip)) + (1 if ips else 0)
        if cost > room:
            break
        ips.append(ip)
        room -= cost
    doc["omitted"] = {"findings": len(ordered) - len(shown),
                      "lb_ips": len(affected) - len(ips),
                      "finding_ids": len(by_id) - len(ids)}


# (one definition with every other line's: a string any JSON parser takes, capped; ASCII)
_clean = logfmt.clean
_dumps = logfmt.dumps
