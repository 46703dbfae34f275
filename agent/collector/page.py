"""The collector's HTML page: fleet status at a glance, worst nodes first, per-service
table, auto-refresh. Everything that came from a node is escaped: a node name or an
iptables comment holding markup renders as text. The page holds no script and no inline
style attribute, so its Content-Security-Policy allows only its own style sheet (by
hash): markup that slipped through escaping could still not run."""

from __future__ import annotations

import base64
import hashlib
from html import escape
from typing import Any
from urllib.parse import urlencode

from agent.verdict_doc import STATUSES

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 2em; }
th, td { border-bottom: 1px solid #ddd; padding: .3em .8em; text-align: left; }
th { background: #f4f4f4; }
.pill { color: #fff; padding: .2em .7em; border-radius: 1em; margin-right: .5em; }
.pill.loopback { background: #b00020; } .pill.at-risk { background: #c77700; }
.pill.healthy { background: #1b7f3b; } .pill.unknown { background: #5f6368; }
td.loopback { color: #b00020; } td.at-risk { color: #c77700; } td.healthy { color: #1b7f3b; }
td.unknown { color: #5f6368; }
"""

CSP = ("default-src 'none'; style-src 'sha256-"
       + base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()
       + "'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _status_class(status: str) -> str:
    return status if status in STATUSES else "unknown"


def render_page(counts: dict[str, int], total: int, nodes: list[dict[str, Any]],
                services: list[dict[str, Any]], service_total: int, offset: int = 0,
                limit: int = 200) -> str:
    """``nodes``: one screen of node summaries from ``offset``; ``services``: the top
    rows (node lists already cut to a few names); the counts are of the whole fleet."""
    e = escape
    head = "".join(f'<span class="pill {s}">{e(s)}: {counts.get(s, 0)}</span> '
                   for s in STATUSES)
    node_rows = "".join(
        f'<tr><td>{e(n["node"])}</td>'
        f'<td class="{_status_class(n["status"])}"><b>{e(n["status"])}</b></td>'
        f'<td>{e(", ".join(n["ids"]))}</td><td>{n["unknowns"]}</td>'
        f'<td>{e(n["kube_proxy_mode"])}</td><td>{e(n["time"])}</td></tr>'
        for n in nodes)
    svc_rows = "".join(
        f'<tr><td>{e(s["service"] or "?")}</td><td>{e(s["lb_ip"] or "")}</td>'
        f'<td>{s["observed_count"]}</td><td>{s["exposed_count"]}</td>'
        f'<td>{e(", ".join(s["ids"]))}</td>'
        f'<td>{e(", ".join(list(dict.fromkeys(s["observed_nodes"] + s["exposed_nodes"]))[:8]))}'
        '</td></tr>'
        for s in services)
    shown = f"{offset + 1}-{offset + len(nodes)} of {total}" if nodes else f"none of {total}"
    nav = []
    if offset > 0:
        nav.append(f'<a href="/?{urlencode({"offset": max(0, offset - limit)})}">previous</a>')
    if offset + limit < total:
        nav.append(f'<a href="/?{urlencode({"offset": offset + limit})}">next</a>')
    more_services = (f'<p>{len(services)} of {service_total}: all in '
                     '<a href="/v1/services">/v1/services</a>.</p>'
                     if service_total > len(services) else "")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="30">
<title>loopback-agent fleet</title>
<style>{_STYLE}</style></head><body>
<h1>CLB loopback across the fleet</h1>
<p id="summary">{total} nodes: {head}</p>
<h2>Nodes, worst first ({shown})</h2>
<table id="nodes"><tr><th>node</th><th>status</th><th>findings</th><th>unknowns</th>
<th>kube-proxy</th><th>last verdict</th></tr>{node_rows}</table>
<p id="nav">{" ".join(nav)}</p>
<h2>Services and LB IPs</h2>
<table id="services"><tr><th>service</th><th>LB IP</th><th>nodes observed</th>
<th>nodes exposed</th><th>findings</th><th>nodes</th></tr>{svc_rows}</table>
{more_services}
<p>Refreshes every 30 s. API: <a href="/v1/nodes">/v1/nodes</a>,
<a href="/v1/services">/v1/services</a>, <a href="/openapi.json">/openapi.json</a>.</p>
</body></html>
"""
