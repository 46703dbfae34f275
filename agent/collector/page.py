"""The collector's HTML page: fleet status at a glance, worst nodes first, per-service
table, auto-refresh. Everything that came from a node is escaped: a node name or an
iptables comment holding markup renders as text."""

from __future__ import annotations

from html import escape
from typing import Any

from agent.collector.views import nodes_view, services_view

_COLOR = {"loopback": "#b00020", "at-risk": "#c77700", "healthy": "#1b7f3b"}


def render_page(latest: list[dict[str, Any]]) -> str:
    nodes = nodes_view(latest)
    services = services_view(latest)
    counts = {s: sum(1 for n in nodes if n["status"] == s)
              for s in ("loopback", "at-risk", "healthy")}
    e = escape
    head = "".join(
        f'<span class="pill" style="background:{_COLOR[s]}">{e(s)}: {n}</span> '
        for s, n in counts.items())
    node_rows = "".join(
        f'<tr><td>{e(n["node"])}</td>'
        f'<td style="color:{_COLOR.get(n["status"], "#000")}"><b>{e(n["status"])}</b></td>'
        f'<td>{e(", ".join(n["ids"]))}</td><td>{n["unknowns"]}</td>'
        f'<td>{e(n["kube_proxy_mode"])}</td><td>{e(n["time"])}</td></tr>'
        for n in nodes)
    svc_rows = "".join(
        f'<tr><td>{e(s["service"] or "?")}</td><td>{e(s["lb_ip"] or "")}</td>'
        f'<td>{len(s["observed_nodes"])}</td><td>{len(s["exposed_nodes"])}</td>'
        f'<td>{e(", ".join(s["ids"]))}</td>'
        f'<td>{e(", ".join(list(dict.fromkeys(s["observed_nodes"] + s["exposed_nodes"]))[:8]))}'
        '</td></tr>'
        for s in services)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="30">
<title>loopback-agent fleet</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 2em; }}
th, td {{ border-bottom: 1px solid #ddd; padding: .3em .8em; text-align: left; }}
th {{ background: #f4f4f4; }}
.pill {{ color: #fff; padding: .2em .7em; border-radius: 1em; margin-right: .5em; }}
</style></head><body>
<h1>CLB loopback across the fleet</h1>
<p id="summary">{len(nodes)} nodes: {head}</p>
<h2>Nodes, worst first</h2>
<table id="nodes"><tr><th>node</th><th>status</th><th>findings</th><th>unknowns</th>
<th>kube-proxy</th><th>last verdict</th></tr>{node_rows}</table>
<h2>Services and LB IPs</h2>
<table id="services"><tr><th>service</th><th>LB IP</th><th>nodes observed</th>
<th>nodes exposed</th><th>findings</th><th>nodes</th></tr>{svc_rows}</table>
<p>Refreshes every 30 s. API: <a href="/v1/nodes">/v1/nodes</a>,
<a href="/v1/services">/v1/services</a>, <a href="/openapi.json">/openapi.json</a>.</p>
</body></html>
"""
