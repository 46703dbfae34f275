"""Reading `loopback-agent run`'s output in tests: its stdout lines (the bounded log lines
of agent.ship.logline) and the full verdicts they point to (the spool, by idempotency key;
or GET /verdict)."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from agent.cli import schema_text
from agent.ship.logline import LINE_BYTES
from agent.verdict_doc import expand_targets

LINE_SCHEMA = json.loads(resources.files("agent").joinpath("schema/log-line-v1.json")
                         .read_text())
VERDICT_SCHEMA = json.loads(schema_text())


def log_line(line: str | bytes) -> dict[str, Any]:
    """One stdout line, checked against the contract: ASCII, one line, <= 16 KiB, JSON
    of the log-line schema, starting with ts, level and msg as every line of the agent
    (agent.logfmt)."""
    data = line.encode() if isinstance(line, str) else line
    assert data, "no line (the daemon ended?)"
    assert len(data) <= LINE_BYTES and data.endswith(b"\n") and data.count(b"\n") == 1, \
        f"a stdout line of {len(data)} bytes"
    data.decode("ascii")
    doc = json.loads(data)
    jsonschema.validate(doc, LINE_SCHEMA)
    assert list(doc)[:3] == ["ts", "level", "msg"], list(doc)[:3]
    return doc


def log_lines(out: str | bytes) -> list[dict[str, Any]]:
    data = out.encode() if isinstance(out, str) else out
    return [log_line(ln) for ln in data.splitlines(keepends=True)]


def spooled(line: dict[str, Any], spool: Path) -> dict[str, Any]:
    """The full verdict a log line names (``full.key``), from the spool (run without a
    collector and with --heartbeat-every 1, so every verdict stays there), checked against
    the verdict schema and the line."""
    key = line["full"]["key"]
    (path,) = spool.glob(f"*-{key}.json")
    raw = path.read_bytes()  # gzip as the spool writes it (plain from older agents)
    verdict = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    assert verdict["idempotency_key"] == key
    agrees(line, verdict)
    return verdict


def agrees(line: dict[str, Any], verdict: dict[str, Any]) -> None:
    """The line summarises this verdict: the same header, counts, and its most severe
    findings first."""
    jsonschema.validate(verdict, VERDICT_SCHEMA)
    for k in ("node", "time", "status", "kube_proxy_mode", "agent_version"):
        assert line[k] == verdict[k], k
    c, fs = line["counts"], verdict["findings"]
    # a v2 summary names the findings that are not fine and counts the fine ones (ok)
    ok = verdict.get("ok", [])
    assert c["findings"] == len(fs) + sum(g["count"] for g in ok)
    assert c["lb_ips"] == verdict["lb_ip_counts"]["total"]
    assert c["unknowns"] == len(verdict["unknowns"]) + sum(
        verdict.get("unknowns_more", {}).values())
    for sev in ("critical", "warning", "info"):
        assert c["by_severity"][sev] == sum(1 for f in fs if f["severity"] == sev) + sum(
            g["count"] for g in ok if g["severity"] == sev), sev
    if line["line"] == "summary":
        rank = {"critical": 0, "warning": 1, "info": 2}
        worst = sorted(fs, key=lambda f: rank[f["severity"]])
        keys = ("id", "severity", "port")
        shown = line["findings"]
        serious = [f for f in shown if f["severity"] != "info"]
        assert [{k: f[k] for k in keys} for f in serious] == \
            [{k: f[k] for k in keys} for f in worst[:len(serious)]]
        for f, full in zip(serious, worst, strict=False):
            for k in ("lb_ip", "service") + (() if full.get("abridged") else ("summary",)):
                assert represents(f[k], full[k]), (k, f[k], full[k])
        # the notes the line shows: itemised in the document, or counted in ok
        fine = {(g["id"], ip) for g in ok for ip, _ in expand_targets(g["targets"])}
        notes = {(f["id"], f["lb_ip"]) for f in fs if f["severity"] == "info"}
        for f in shown[len(serious):]:
            assert f["severity"] == "info" and (f["id"], f["lb_ip"]) in fine | notes, f
        assert len(shown) + line["omitted"]["findings"] == c["findings"]


def represents(shown: str | None, full: str | None) -> bool:
    """A string of a log line stands for the verdict's: the same, with any lone surrogate
    replaced (U+FFFD), and cut short (ending in an ellipsis) when long."""
    if shown is None or full is None:
        return shown is full
    fixed = full.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return shown == fixed or (shown.endswith("\u2026") and len(shown) < len(fixed)
                              and fixed.startswith(shown[:-1]))
