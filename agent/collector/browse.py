"""The collector's pages a person browses (issue 37, item 5): the fleet, filtered and a
page at a time, and a page per node.

- ``/``: the nodes worst first, filtered by the query parameters ``status``, ``service``,
  ``lb_ip`` and ``finding`` (a finding id), all of them at once when several are given,
  ``limit`` and ``offset`` for paging (every link keeps the filters); then the Services
  and LB IPs, each row linking to the nodes where it has findings. A filter is a link,
  not a form: the page needs no script and its policy still allows no form.
- ``/nodes/NODE`` (the name percent-encoded): one node's latest verdict (its findings
  with evidence and remedy, its unknowns, kube-proxy's mode and version) and its status
  over time, an inline SVG drawn from the status column of its history rows (the rows
  GET /v1/nodes/NODE serves; no document is parsed but the newest, read through
  Store.history as that endpoint reads it).

Everything that came from a node is HTML-escaped, and what would not show as itself is
made visible first: a lone surrogate becomes U+FFFD, a control character (a terminal
escape) its Unicode control picture (ESC: U+241B), a bidirectional override or isolate
U+FFFD. The pages hold no script and no style attribute: the Content-Security-Policy
allows only the style sheet below, by its hash.

The fleet page reads only the summaries (``nodes``, ``node_findings``), a page at a
time, as the store's own readers do, with the store's SQL helpers, so SQLite and
PostgreSQL (and an older store a test serves) answer the same.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from agent.collector import views
from agent.collector.intake import BadRequest
from agent.collector.store import Store
from agent.verdict_doc import STATUSES

MAX_SCREEN_NODES = 1000  # rows of the nodes table one page may ask for (limit=)
MAX_FILTER = 512  # characters of one filter's value
SCREEN_FINDING_IDS = 30  # finding ids offered as filters
TIMELINE_ROWS = 2000  # history rows drawn (14 days of a verdict each 10 min: 2016)
CHANGES_SHOWN = 20  # rows of the status changes table
FULL_FINDINGS = 200  # findings shown with their evidence; the rest are counted
ROWS_SHOWN = 200  # abridged findings, fine groups, unknowns, evidence lines each
FILTERS = ("status", "service", "lb_ip", "finding")

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
a { color: #0b57d0; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: .3em .8em; text-align: left;
  vertical-align: top; }
th { background: #f4f4f4; }
.pill { color: #fff; padding: .2em .7em; border-radius: 1em; margin-right: .5em;
  text-decoration: none; display: inline-block; border: 2px solid transparent; }
.pill.on { border-color: #222; box-shadow: 0 0 0 2px #fff inset; }
.pill.loopback { background: #b00020; } .pill.at-risk { background: #c77700; }
.pill.healthy { background: #1b7f3b; } .pill.unknown { background: #5f6368; }
td.loopback { color: #b00020; } td.at-risk { color: #c77700; } td.healthy { color: #1b7f3b; }
td.unknown { color: #5f6368; }
.chip { display: inline-block; padding: .1em .6em; margin: .15em .1em; border: 1px solid #bbb;
  border-radius: 1em; text-decoration: none; color: #222; font-size: .9em; }
.chip.on { background: #222; color: #fff; border-color: #222; }
.chip.on .muted { color: #ccc; }
#filters p { margin: .4em 0; }
.muted { color: #5f6368; }
code, .mono { font-family: ui-monospace, monospace; font-size: .9em; }
dl.facts { display: grid; grid-template-columns: max-content auto; gap: .2em 1.2em; }
dl.facts dt { color: #5f6368; } dl.facts dd { margin: 0; }
.finding { border-left: 4px solid #c77700; padding: .1em 1em; margin: 1em 0;
  background: #fafafa; }
.finding.critical { border-color: #b00020; } .finding.info { border-color: #1b7f3b; }
.finding h3 { font-size: 1em; margin: .4em 0; }
.evidence { margin: .2em 0; padding-left: 2em; }
.evidence li { font-family: ui-monospace, monospace; font-size: .85em; white-space: pre-wrap;
  overflow-wrap: anywhere; }
.remedy { border-left: 3px solid #1b7f3b; padding-left: .6em; }
svg.timeline { width: 100%; height: 2.2em; display: block; border: 1px solid #ddd; }
rect.loopback { fill: #b00020; } rect.at-risk { fill: #c77700; }
rect.healthy { fill: #1b7f3b; } rect.unknown { fill: #5f6368; }
rect.silent { fill: #e8e8e8; }
.axis { display: flex; justify-content: space-between; font-size: .85em; color: #5f6368;
  margin-bottom: .6em; }
.key span { margin-right: 1em; } .key b { display: inline-block; width: .9em; height: .9em;
  vertical-align: middle; margin-right: .3em; }
.key b.loopback { background: #b00020; } .key b.at-risk { background: #c77700; }
.key b.healthy { background: #1b7f3b; } .key b.unknown { background: #5f6368; }
.key b.silent { background: #e8e8e8; }
"""

CSP = ("default-src 'none'; style-src 'sha256-"
       + base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()
       + "'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# what does not show as itself: lone surrogates, C0 controls but tab and newline, DEL, C1
# controls, bidirectional embeddings, overrides and isolates
_INVISIBLE = re.compile("[\ud800-\udfff\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _visible(ch: str) -> str:
    code = ord(ch)
    if code < 0x20:
        return chr(0x2400 + code)  # the control picture: ESC shows as U+241B
    if code == 0x7F:
        return "\u2421"
    return "\ufffd"


def text(value: Any) -> str:
    """``value`` as text that shows as itself (see the module's doc); None: ''."""
    s = value if isinstance(value, str) else ("" if value is None else str(value))
    return _INVISIBLE.sub(lambda m: _visible(m.group()), s)


def h(value: Any) -> str:
    """``value`` for HTML text or a quoted attribute."""
    return escape(text(value), quote=True)


def node_url(node: str) -> str:
    """The node's page (its exact name, percent-encoded: "/", "?", "#", "%" included)."""
    return "/nodes/" + quote(_SURROGATE.sub("\ufffd", node), safe="")


def _status_class(status: Any) -> str:
    return status if status in STATUSES else "unknown"


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# -- the fleet page ---------------------------------------------------------------------


@dataclass(frozen=True)
class FleetView:
    """What the fleet page shows: its filters ('' for none) and its page."""

    status: str = ""
    service: str = ""
    lb_ip: str = ""
    finding: str = ""
    offset: int = 0
    limit: int = views.SCREEN_NODES

    @classmethod
    def of(cls, args: dict[str, list[str]]) -> FleetView:
        """From the query's arguments (the last of each); 400 for a bad one."""
        page = views.page_of(args, (views.SCREEN_NODES, MAX_SCREEN_NODES))
        got = {}
        for name in FILTERS:
            value = (args.get(name) or [""])[-1]
            if len(value) > MAX_FILTER:
                raise BadRequest(400, f"{name} is longer than {MAX_FILTER} characters")
            if "\x00" in value:  # (PostgreSQL refuses it in text: a 400, not a 500)
                raise BadRequest(400, f"{name} holds a NUL character")
            got[name] = value
        if got["status"] and got["status"] not in STATUSES:
            raise BadRequest(400, f"status must be one of {', '.join(STATUSES)}")
        return cls(**got, offset=page.offset, limit=page.limit)

    def filters(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in FILTERS if getattr(self, k)}

    def url(self, **change: Any) -> str:
        """This view's address with ``change``; a filter changed goes to the first page."""
        if set(change) & set(FILTERS) and "offset" not in change:
            change["offset"] = 0
        v = replace(self, **change)
        q: dict[str, Any] = v.filters()
        if v.limit != views.SCREEN_NODES:
            q["limit"] = v.limit
        if v.offset:
            q["offset"] = v.offset
        return "/?" + urlencode(q, errors="replace") if q else "/"


def fleet_nodes(store: Store, view: FleetView) -> tuple[list[dict[str, Any]], int]:
    """One page of the nodes the view's filters keep, worst first, and how many they keep."""
    filters = {"status": view.status, "finding": view.finding, "service": view.service,
               "lb_ip": view.lb_ip}
    return store.nodes(view.limit, view.offset, **filters), store.node_count(**filters)


def fleet_page(store: Store, view: FleetView) -> str:
    nodes, matched = fleet_nodes(store, view)
    return render_fleet(view, store.status_counts(), store.node_total(), nodes, matched,
                        store.finding_counts(),
                        store.services(views.SCREEN_SERVICES, 0,
                                       max_nodes=views.SCREEN_SERVICE_NODES),
                        store.service_total())


def _head(title: str) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="30">
<title>{title}</title>
<style>{_STYLE}</style></head><body>
"""


def render_fleet(view: FleetView, counts: dict[str, int], fleet_total: int,
                 nodes: list[dict[str, Any]], matched: int,
                 findings: list[tuple[str, int]], services: list[dict[str, Any]],
                 service_total: int) -> str:
    """``nodes``: the view's page of the ``matched`` nodes its filters keep; the counts,
    the finding ids and the Services are of the whole fleet."""
    pills = " ".join(
        f'<a class="pill {s}{" on" if view.status == s else ""}" '
        f'href="{h(view.url(status="" if view.status == s else s))}">{s}: {counts.get(s, 0)}'
        '</a>' for s in STATUSES)
    chips = " ".join(
        f'<a class="chip{" on" if view.finding == fid else ""}" '
        f'href="{h(view.url(finding="" if view.finding == fid else fid))}">{h(fid)} '
        f'<span class="muted">{n}</span></a>'
        for fid, n in findings[:SCREEN_FINDING_IDS])
    if view.finding and view.finding not in dict(findings[:SCREEN_FINDING_IDS]):
        chips += (f' <a class="chip on" href="{h(view.url(finding=""))}">{h(view.finding)}'
                  '</a>')
    more_ids = (f' <span class="muted">and {len(findings) - SCREEN_FINDING_IDS} more ids'
                '</span>' if len(findings) > SCREEN_FINDING_IDS else "")
    names = {"status": "status", "service": "Service", "lb_ip": "LB IP", "finding": "finding"}
    active = " ".join(f'<a class="chip on" href="{h(view.url(**{k: ""}))}" '
                      f'title="remove this filter">{names[k]} {h(v)} &#215;</a>'
                      for k, v in view.filters().items())
    filters = (f'<p id="active">Showing only: {active} '
               f'<a href="{h(FleetView(limit=view.limit).url())}">show all nodes</a></p>'
               if active else "")
    node_rows = "".join(_node_row(view, n) for n in nodes)
    if nodes:
        shown = f"{view.offset + 1}-{view.offset + len(nodes)} of {matched}"
    else:
        shown = f"none of {matched}"
    which = "Nodes, worst first" if not view.filters() else "Nodes that match, worst first"
    return f"""{_head("loopback-agent fleet")}<h1>CLB loopback across the fleet</h1>
<p id="summary">{fleet_total} nodes: {pills}</p>
<div id="filters">
<p>Finding ids (nodes with each): {chips or '<span class="muted">none</span>'}{more_ids}</p>
{filters}</div>
<h2 id="shown">{which} ({shown})</h2>
<table id="nodes"><tr><th>node</th><th>status</th><th>findings</th><th>unknowns</th>
<th>kube-proxy</th><th>last verdict</th></tr>{node_rows}</table>
<p id="nav">{_nav(view, matched)}</p>
<h2>Services and LB IPs</h2>
<table id="services"><tr><th>service</th><th>LB IP</th><th>nodes observed</th>
<th>nodes exposed</th><th>findings</th><th>nodes</th></tr>{_service_rows(view, services)}</table>
{_more_services(len(services), service_total)}
<p>Refreshes every 30 s. Filters are in the address: <code>status</code>,
<code>finding</code>, <code>service</code>, <code>lb_ip</code>, <code>limit</code>,
<code>offset</code>. API: <a href="/v1/nodes">/v1/nodes</a>,
<a href="/v1/services">/v1/services</a>, <a href="/openapi.json">/openapi.json</a>.</p>
</body></html>
"""


def _node_row(view: FleetView, n: dict[str, Any]) -> str:
    ids = ", ".join(f'<a href="{h(view.url(finding=i))}">{h(i)}</a>' for i in n["ids"])
    return (f'<tr><td><a href="{h(node_url(n["node"]))}">{h(n["node"])}</a></td>'
            f'<td class="{_status_class(n["status"])}"><b>{h(n["status"])}</b></td>'
            f'<td>{ids}</td><td>{h(n["unknowns"])}</td>'
            f'<td>{h(n["kube_proxy_mode"])}</td><td>{h(n["time"])}</td></tr>')


def _service_rows(view: FleetView, services: list[dict[str, Any]]) -> str:
    out = []
    for s in services:
        service, lb_ip = s["service"] or "", s["lb_ip"] or ""
        # the nodes where it has findings: the nodes table filtered to this Service (and
        # LB IP), then the first of them, each to its page
        where = FleetView(service=service, lb_ip=lb_ip, limit=view.limit).url()
        names = list(dict.fromkeys(s["observed_nodes"] + s["exposed_nodes"]))
        count = len(set(s["observed_nodes"]) | set(s["exposed_nodes"]))
        whole = max(s["observed_count"], s["exposed_count"], count)
        listed = ", ".join(f'<a href="{h(node_url(n))}">{h(n)}</a>'
                           for n in names[:views.SCREEN_SERVICE_NODES])
        more = (f' &#8230; <a href="{h(where)}">all of them</a>'
                if whole > min(len(names), views.SCREEN_SERVICE_NODES) else "")
        ids = ", ".join(f'<a href="{h(view.url(finding=i))}">{h(i)}</a>' for i in s["ids"])
        out.append(f'<tr><td><a href="{h(where)}" title="its nodes">{h(service or "?")}</a>'
                   f'</td><td>{h(lb_ip)}</td><td>{s["observed_count"]}</td>'
                   f'<td>{s["exposed_count"]}</td><td>{ids}</td><td>{listed}{more}</td></tr>')
    return "".join(out)


def _more_services(shown: int, total: int) -> str:
    if total <= shown:
        return ""
    return (f'<p>{shown} of {total}: all in <a href="/v1/services">/v1/services</a>.</p>')


def _nav(view: FleetView, matched: int) -> str:
    limit = view.limit
    pages = max(1, -(-matched // limit))
    here = min(view.offset // limit + 1, pages)
    links = []
    if view.offset > 0:
        links.append(f'<a href="{h(view.url(offset=0))}">first</a>')
        links.append(f'<a href="{h(view.url(offset=max(0, min(view.offset, matched) - limit)))}"'
                     ' rel="prev">previous</a>')
    links.append(f'<span class="muted">page {here} of {pages}</span>')
    if view.offset + limit < matched:
        links.append(f'<a href="{h(view.url(offset=view.offset + limit))}" rel="next">next</a>')
        links.append(f'<a href="{h(view.url(offset=(pages - 1) * limit))}">last</a>')
    return " ".join(links)


# -- a node's page ----------------------------------------------------------------------


def node_page(store: Store, node: str, now: float | None = None) -> str | None:
    """The node's page, or None for a node the collector has no verdict of."""
    if "\x00" in node:  # (no node is named so, and PostgreSQL refuses it in text)
        raise BadRequest(400, "the node name holds a NUL character")
    latest = store.node_status(node)
    if latest is None:
        return None
    texts, _ = store.history(node, 1)  # its newest verdict, as GET /v1/nodes/NODE has it
    try:
        doc = _dict(json.loads(texts[0])) if texts else {}
    except ValueError:
        doc = {"error": "the stored document is not JSON"}
    runs, total = store.status_history(node, TIMELINE_ROWS)
    return render_node(node, latest, doc, runs, total, time.time() if now is None else now)


def _finding_link(fleet: FleetView, fid: str, severity: object) -> str:
    """A finding id, linked to the fleet filtered by it where that filter can find it:
    the fleet's summaries hold the ids of findings that are not info."""
    if severity == "info":
        return h(fid)
    return f'<a href="{h(fleet.url(finding=fid))}">{h(fid)}</a>'


def not_found_page(node: str) -> str:
    return f"""{_head("unknown node - loopback-agent fleet")}<h1>No node {h(node)}</h1>
<p>The collector holds no verdict of a node of this name.
<a href="/">The fleet</a>.</p>
</body></html>
"""


def render_node(node: str, summary: dict[str, Any], doc: dict[str, Any],
                history: list[tuple[str, str]], total: int, now: float) -> str:
    """``summary``: the node's row of the fleet table; ``doc``: its newest verdict;
    ``history``: (time, status) of its newest history rows, oldest first, of ``total``."""
    fleet = FleetView()
    status = summary["status"]
    ctx = _dict(doc.get("context"))
    counts = _dict(doc.get("lb_ip_counts"))
    version = ctx.get("kube_proxy_version")
    mode = doc.get("kube_proxy_mode", summary["kube_proxy_mode"])
    mode_from = f' <span class="muted">({h(ctx["kube_proxy_mode_from"])})</span>' \
        if ctx.get("kube_proxy_mode_from") else ""
    facts = [
        ("status", f'<span class="pill {_status_class(status)}">{h(status)}</span>'),
        ("latest verdict", f'{h(summary["time"])} <span class="muted">(agent '
                           f'{h(doc.get("agent_version") or "?")}, '
                           f'{h(doc.get("schema") or "?")})</span>'),
        ("kube-proxy mode", f"{h(mode)}{mode_from}"),
        ("kube-proxy version", h(version) if version else '<span class="muted">not known'
                                                          '</span>'),
        ("LB IPs", f'{h(counts.get("total", "?"))} known, {h(counts.get("local", "?"))} '
                   f'local to the node' if counts else '<span class="muted">not said</span>'),
    ]
    facts += [(label, f'<span class="mono">{h(ctx[key])}</span>')
              for key, label in (("node_ip", "node IP"), ("pod_network", "pod network"),
                                 ("uplink", "uplink"), ("iptables_backend", "iptables"),
                                 ("origin", "read from")) if ctx.get(key)]
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
    error = (f'<p class="finding critical">{h(doc["error"])}</p>' if doc.get("error") else "")
    quoted = quote(_SURROGATE.sub("\ufffd", node), safe="")
    return f"""{_head(h(node) + " - loopback-agent fleet")}<p><a href="/">&#8592; the fleet</a></p>
<h1 id="node">{h(node)}</h1>
<dl class="facts" id="facts">{dl}</dl>
{error}<h2>Status over time</h2>
{_timeline(history, total, now)}
<h2>Findings</h2>
{_findings(fleet, doc)}
<h2>Unknowns</h2>
{_unknowns(doc)}
<p>The verdicts as JSON: <a href="/v1/nodes/{h(quoted)}">/v1/nodes/{h(quoted)}</a>
(newest first). Refreshes every 30 s.</p>
</body></html>
"""


def _epoch(when: str) -> float | None:
    try:
        return datetime.fromisoformat(when).timestamp()
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _timeline(history: list[tuple[str, str]], total: int, now: float) -> str:
    """Runs of one status as bars on a time axis from the first verdict drawn to now:
    a run lasts until the next verdict of another status; after the newest verdict, grey
    (no verdict since)."""
    points = sorted(((t, when, s) for when, s in history
                     if (t := _epoch(when)) is not None), key=lambda p: p[0])
    if not points:
        return '<p class="muted" id="timeline">No verdict with a time to draw.</p>'
    runs: list[list[Any]] = []  # [start, its text, status, verdicts]
    for t, when, s in points:
        if runs and runs[-1][2] == s:
            runs[-1][3] += 1
        else:
            runs.append([t, when, s, 1])
    start, last, last_text = points[0][0], points[-1][0], points[-1][1]
    end = max(now, last)
    span = max(end - start, 1.0)

    def x(t: float) -> float:
        return (t - start) / span * 1000

    bars = []
    for i, (t, when, s, n) in enumerate(runs):
        until = runs[i + 1][0] if i + 1 < len(runs) else last
        until_text = runs[i + 1][1] if i + 1 < len(runs) else last_text
        width = max(x(until) - x(t), 2.0)  # a run of one verdict still shows
        bars.append(f'<rect class="{_status_class(s)}" x="{x(t):.2f}" y="0" '
                    f'width="{width:.2f}" height="20"><title>{h(s)} from {h(when)} to '
                    f'{h(until_text)} ({n} verdict{"s" if n != 1 else ""})</title></rect>')
    if end > last:
        bars.append(f'<rect class="silent" x="{x(last):.2f}" y="0" '
                    f'width="{x(end) - x(last):.2f}" height="20"><title>no verdict since '
                    f'{h(last_text)}</title></rect>')
    changes = []
    for i in range(len(runs) - 1, max(-1, len(runs) - 1 - CHANGES_SHOWN), -1):
        t, when, s, n = runs[i]
        until = runs[i + 1][1] if i + 1 < len(runs) else "now"
        changes.append(f'<tr><td>{h(when)}</td><td>{h(until)}</td>'
                       f'<td class="{_status_class(s)}"><b>{h(s)}</b></td><td>{n}</td></tr>')
    drawn = len(points)
    of = (f"the newest {drawn} of {total} verdicts" if total > drawn
          else f"{drawn} verdict{'s' if drawn != 1 else ''}")
    key = "".join(f'<span><b class="{s}"></b>{s}</span>' for s in (*STATUSES, "silent"))
    older = (f'<p class="muted">{len(runs) - CHANGES_SHOWN} older changes not listed.</p>'
             if len(runs) > CHANGES_SHOWN else "")
    try:
        when_end = datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (ValueError, OverflowError, OSError):  # a verdict dated past year 9999 (UTC)
        when_end = "(out of range)"
    return f"""<svg class="timeline" id="timeline" viewBox="0 0 1000 20" \
preserveAspectRatio="none" role="img" aria-label="status over time">{"".join(bars)}</svg>
<div class="axis"><span>{h(points[0][1])}</span><span>{len(runs)} run{"s" if len(runs) != 1
    else ""} of {of}</span><span>{h(when_end)}</span></div>
<p class="key muted">{key}</p>
<table id="changes"><tr><th>from</th><th>until</th><th>status</th><th>verdicts</th></tr>
{"".join(changes)}</table>
{older}"""


def _findings(fleet: FleetView, doc: dict[str, Any]) -> str:
    findings = [f for f in _list(doc.get("findings")) if isinstance(f, dict)]
    full = [f for f in findings if not f.get("abridged")]
    abridged = [f for f in findings if f.get("abridged")]
    if not findings:
        out = ['<p class="muted" id="findings">None in the latest verdict.</p>']
    else:
        out = ['<div id="findings">']
        out += [_finding(fleet, f, open_=i == 0) for i, f in enumerate(full[:FULL_FINDINGS])]
        if len(full) > FULL_FINDINGS:
            out.append(f'<p class="muted">{len(full) - FULL_FINDINGS} more findings in the '
                       'JSON below.</p>')
        out.append("</div>")
    if abridged:
        rows = "".join(
            f'<tr><td>{_finding_link(fleet, text(f.get("id")), f.get("severity"))}'
            f'</td><td>{h(f.get("severity"))}</td><td>{_service_link(fleet, f)}</td>'
            f'<td>{_target(f)}</td><td class="mono">{h(f.get("shape"))}</td></tr>'
            for f in abridged[:ROWS_SHOWN])
        more = (f'<p class="muted">and {len(abridged) - ROWS_SHOWN} more.</p>'
                if len(abridged) > ROWS_SHOWN else "")
        out.append(f'<h3>Abridged: {len(abridged)} more, each with the evidence and remedy '
                   'of the first shown of its id and shape</h3>'
                   '<table id="abridged"><tr><th>finding</th><th>severity</th><th>service</th>'
                   f'<th>target</th><th>shape</th></tr>{rows}</table>{more}')
    ok = [g for g in _list(doc.get("ok")) if isinstance(g, dict)]
    if ok:
        rows = "".join(
            f'<tr><td>{h(g.get("id"))}</td><td>{h(g.get("count"))}</td>'
            f'<td class="mono">{h(" ".join(text(t) for t in _list(g.get("targets"))[:10]))}'
            f'{" &#8230;" if len(_list(g.get("targets"))) > 10 else ""}</td>'
            f'<td>{h(_dict(g.get("example")).get("summary"))}</td></tr>'
            for g in ok[:ROWS_SHOWN])
        out.append('<h3>Fine</h3><table id="ok"><tr><th>finding</th><th>LB IPs</th>'
                   f'<th>targets</th><th>for example</th></tr>{rows}</table>')
    return "\n".join(out)


def _service_link(fleet: FleetView, f: dict[str, Any]) -> str:
    service = text(f.get("service"))
    if not service:
        return ""
    return f'<a href="{h(fleet.url(service=service))}">{h(service)}</a>'


def _target(f: dict[str, Any]) -> str:
    ip = text(f.get("lb_ip"))
    if not ip:
        return ""
    port = f.get("port")
    proto = text(f.get("protocol"))
    return h(ip + (f":{port}" if isinstance(port, int) else "") + (f"/{proto}" if proto
                                                                     else ""))


def _finding(fleet: FleetView, f: dict[str, Any], open_: bool) -> str:
    severity = text(f.get("severity"))
    fid = text(f.get("id"))
    evidence = _list(f.get("evidence"))
    lines = "".join(f"<li>{h(e)}</li>" for e in evidence[:ROWS_SHOWN])
    if len(evidence) > ROWS_SHOWN:
        lines += f'<li class="muted">{len(evidence) - ROWS_SHOWN} more lines</li>'
    where = " ".join(x for x in (_service_link(fleet, f), _target(f)) if x)
    remedy = (f'<p class="remedy"><b>Remedy:</b> {h(f["remedy"])}</p>' if f.get("remedy")
              else "")
    cls = severity if severity in ("critical", "warning", "info") else "warning"
    return f"""<div class="finding {cls}">
<h3>{_finding_link(fleet, fid, severity)} <span class="muted">{h(severity)}</span>
{where}</h3>
<p>{h(f.get("summary"))}</p>
{remedy}
<details{" open" if open_ else ""}><summary>evidence ({len(evidence)} \
line{"s" if len(evidence) != 1 else ""})</summary><ol class="evidence">{lines}</ol></details>
</div>"""


def _unknowns(doc: dict[str, Any]) -> str:
    unknowns = [u for u in _list(doc.get("unknowns")) if isinstance(u, dict)]
    more = _dict(doc.get("unknowns_more"))
    if not unknowns and not more:
        return '<p class="muted" id="unknowns">None: everything the diagnosis needed was read.</p>'
    rows = "".join(f'<tr><td class="mono">{h(u.get("source"))}</td><td>{h(u.get("reason"))}'
                   '</td></tr>' for u in unknowns[:ROWS_SHOWN])
    if len(unknowns) > ROWS_SHOWN:
        rows += f'<tr><td colspan="2">{len(unknowns) - ROWS_SHOWN} more</td></tr>'
    rows += "".join(f'<tr><td class="mono">{h(k)}</td><td>{h(n)} more of this source</td></tr>'
                    for k, n in list(more.items())[:ROWS_SHOWN])
    return f'<table id="unknowns"><tr><th>source</th><th>reason</th></tr>{rows}</table>'
