"""The alerts and the Grafana dashboard of loopback-agent, from one source (the
monitoring-mixin way): the rules and panels below, with the selectors, the cluster label
and the runbook URL as settings, write every copy the project ships:

    daemonset/monitoring/prometheusrule.yaml                 the kustomize component's rules
    charts/loopback-agent/files/prometheus-rules.yaml        their spec, for the chart
    dashboards/loopback-agent.json                           the dashboard
    charts/loopback-agent/files/loopback-agent-dashboard.json    its copy in the chart

    python dashboards/mixin.py             # write them (after editing this file)
    python dashboards/mixin.py --check     # exit 1, naming them, when a copy is not current
    python dashboards/mixin.py --out DIR --agent-selector 'job="kubernetes-pods"' ...

Edit this file, never the copies: tests/test_monitoring.py regenerates them and requires
the committed ones to be byte for byte what it writes. Only the standard library and
PyYAML (a dependency of the agent) are used.

The series are the ones agent/daemon.py (loopback_agent_*) and agent/collector/server.py
(loopback_collector_*) export; the agents' carry a `node` label (their PodMonitor sets it
from the pod's node), and `up` is Prometheus' own per target. The selectors pick the
scrape jobs: the prometheus-operator names a PodMonitor's job NAMESPACE/NAME and a
ServiceMonitor's after its Service, so the defaults match both ways of the kustomize
component and of the chart (whose template puts the release's names in them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
RULES_COMPONENT = Path("daemonset/monitoring/prometheusrule.yaml")
RULES_CHART = Path("charts/loopback-agent/files/prometheus-rules.yaml")
DASHBOARD = Path("dashboards/loopback-agent.json")
DASHBOARD_CHART = Path("charts/loopback-agent/files/loopback-agent-dashboard.json")
RUNBOOKS = Path("docs/runbooks")
# the rules of the collector's series: a group of their own, which the chart leaves out
# when it deploys no collector (the agents then ship to one monitored elsewhere)
COLLECTOR_GROUP = "loopback-collector"
# agent.collector.server.NODE_GONE_AFTER: nodes silent longer are taken as removed
NODE_GONE_AFTER = 86400

Obj = dict[str, Any]


def default_runbook_url(repo: Path = REPO) -> str:
    """docs/runbooks/<alert>.md in the project's repository, as pyproject.toml's
    [project.urls] names it; without one, that path relative to the repository."""
    try:
        urls = tomllib.loads((repo / "pyproject.toml").read_text())["project"].get("urls", {})
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        urls = {}
    by_key = {k.lower().replace("-", " ").replace("_", " "): v for k, v in urls.items()}
    for key in ("repository", "source", "source code", "code", "github", "homepage"):
        if by_key.get(key):
            return f"{by_key[key].rstrip('/')}/blob/main/{RUNBOOKS.as_posix()}/{{alert}}.md"
    return f"{RUNBOOKS.as_posix()}/{{alert}}.md"


@dataclasses.dataclass(frozen=True)
class Config:
    # PromQL label matchers of the agents' and the collector's scrape jobs (with `up`, the
    # only way to tell their targets from others'); not empty
    agent_selector: str = 'job=~"(.+/)?loopback-agent"'
    collector_selector: str = 'job=~"(.+/)?loopback-agent-collector"'
    # the label that names the cluster where one Prometheus (Thanos, Mimir) holds several:
    # the rules group by it, the dashboard's `cluster` variable matches it
    cluster_label: str = "cluster"
    # where each alert's runbook is; {alert} is the alert's name
    runbook_url: str = dataclasses.field(default_factory=default_runbook_url)
    # the agents' settings (daemonset/config.yaml, the chart's agent.interval and
    # agent.heartbeatEvery): seconds per verdict, and every how many an unchanged one is
    # shipped anyway
    interval: int = 60
    heartbeat_every: int = 10
    # LoopbackAgentSilent: no new verdict for this many intervals
    silent_intervals: int = 5
    # LoopbackAgentSpoolGrowing: verdicts waiting (the spool holds at most 1,000)
    spool_depth_threshold: int = 100

    def __post_init__(self) -> None:
        for name in ("agent_selector", "collector_selector"):
            if not getattr(self, name).strip():
                raise ValueError(f"{name} must not be empty: it picks the targets of `up`")
        if "{alert}" not in self.runbook_url:
            raise ValueError("runbook_url must contain {alert}")

    # -- selectors ---------------------------------------------------------------------

    def agent(self, metric: str, *matchers: str) -> str:
        return f"{metric}{{{', '.join((self.agent_selector, *matchers))}}}"

    def collector(self, metric: str, *matchers: str) -> str:
        return f"{metric}{{{', '.join((self.collector_selector, *matchers))}}}"

    @property
    def by_node(self) -> str:
        return f"by ({self.cluster_label}, node)"

    @property
    def by_cluster(self) -> str:
        return f"by ({self.cluster_label})"


# -- the rules ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Alert:
    name: str
    comment: str  # why, for whoever reads the YAML
    expr: str
    for_: str
    severity: str
    summary: str
    description: str


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    comment: str
    alerts: tuple[Alert, ...]


def groups(c: Config) -> tuple[Group, ...]:
    heartbeat = c.interval * c.heartbeat_every
    silent_node = 3 * heartbeat
    silent_agent = c.silent_intervals * c.interval

    def status(value: str) -> str:
        return c.agent("loopback_agent_status", f'status="{value}"')

    verdicts = (
        Alert(
            "LoopbackAgentNodeLooping",
            'The verdict is "loopback": LB traffic was seen looping back into this node and '
            "dropped (a capture observed it). Two scrapes, so a single stray sample is not "
            "paged.",
            f"max {c.by_node} ({status('loopback')}) == 1", "2m", "critical",
            "Node {{ $labels.node }}: load balancer traffic loops back and is dropped",
            'The loopback-agent on {{ $labels.node }} says "loopback": traffic to a '
            "LoadBalancer IP comes back into the node and is dropped. Its findings: "
            'loopback_agent_finding{node="{{ $labels.node }}"}; the verdict and the remedy: '
            "`kubectl loopback check {{ $labels.node }}` or the collector's page."),
        Alert(
            "LoopbackAgentNodeAtRisk",
            '"at-risk": the node\'s state would drop such traffic, none was seen yet. Not '
            "urgent on its own; for 15 min, so that a Service being reconfigured does not "
            "page.",
            f"max {c.by_node} ({status('at-risk')}) == 1", "15m", "warning",
            "Node {{ $labels.node }} has been at risk of LB loopback for 15 min",
            "The loopback-agent on {{ $labels.node }} finds a node state that would drop "
            "load balancer traffic looping back (see loopback_agent_finding for which LB IPs "
            "and Services). `kubectl loopback check {{ $labels.node }}` explains it."),
        Alert(
            "LoopbackAgentNodeUndetermined",
            '"unknown": nothing at risk was found, but the agent could not decide something '
            "that could hide a risk (kube-proxy's mode, the LB IPs, a path). Not a page: for "
            "1 h, so that a node starting up (its Services not yet read) does not open a "
            "ticket.",
            f"max {c.by_node} ({status('unknown')}) == 1", "1h", "info",
            "Node {{ $labels.node }}: LB loopback undetermined for 1 h",
            "The loopback-agent on {{ $labels.node }} found no exposure but could not rule "
            "it out: its findings (lb-ips-unknown, pod-to-lb-undetermined) or an unknown "
            "kube-proxy mode say what it lacks. `kubectl loopback check {{ $labels.node }}` "
            "shows which input would decide it."),
        Alert(
            "LoopbackAgentCaptureUnavailable",
            "The agent could not open its NodePort capture (an AF_PACKET socket: NET_RAW "
            "dropped, a kernel without it): it still checks the node's state but cannot see "
            'looping traffic, so "loopback" is never concluded there.',
            f"max {c.by_node} ({c.agent('loopback_agent_capture_available')}) == 0", "15m",
            "warning",
            "Node {{ $labels.node }}: the agent cannot capture NodePort handshakes",
            "The loopback-agent on {{ $labels.node }} reports its capture unavailable; the "
            "reason is among its verdict's unknowns, source capture (`kubectl loopback check "
            "{{ $labels.node }} --capture 30s`)."),
    )
    last_verdict = c.agent("loopback_agent_last_verdict_timestamp_seconds")
    depth = c.agent("loopback_agent_spool_depth")
    agents = (
        Alert(
            "LoopbackAgentSilent",
            f"The agent itself: no new verdict for {c.silent_intervals} intervals "
            f"({silent_agent} s; one every {c.interval} s), or its /metrics cannot be "
            "scraped. Its /healthz fails after 3 intervals, so the kubelet restarts a wedged "
            "agent first; this is for one that stays so. A node whose agent pod is gone has "
            "no series: LoopbackAgentNodeSilent (the collector's view) covers it.",
            f"(time() - max {c.by_node} ({last_verdict})) > {silent_agent}\n"
            f"or\nmax {c.by_node} ({c.agent('up')}) == 0",
            "5m", "warning",
            "Node {{ $labels.node }}: the loopback-agent has made no verdict for "
            f"{silent_agent // 60} min, or cannot be scraped",
            "The loopback-agent on {{ $labels.node }} is running but either made no verdict "
            f"for more than {c.silent_intervals} intervals or its /metrics did not answer "
            "Prometheus: the node is not being checked. Its pod and restarts: "
            "`kubectl -n loopback-agent-node get pods -o wide "
            "--field-selector spec.nodeName={{ $labels.node }}`."),
        Alert(
            "LoopbackAgentAbsent",
            "No agent target at all: the DaemonSet is gone, its PodMonitor (or ServiceMonitor) "
            "is not selected by this Prometheus, or the selector above does not match the "
            "scrape job. Every other agent alert is blind then.",
            f"absent({c.agent('up')})", "15m", "warning",
            "No loopback-agent is scraped by Prometheus",
            "Prometheus has no target of the loopback-agent DaemonSet ("
            + c.agent_selector + "): no node is being checked, or none is monitored. Check "
            "the DaemonSet (`kubectl -n loopback-agent-node get ds`) and that Prometheus "
            "selects its PodMonitor."),
        Alert(
            "LoopbackAgentShipFailing",
            "Shipping to the collector fails: attempts failed and none succeeded for 15 min "
            "(the agent retries with backoff, at most 5 min apart, while verdicts wait). Not "
            "while every collector target is down or there is none: "
            "LoopbackAgentCollectorDown says that once.",
            f"sum {c.by_node} (increase("
            f"{c.agent('loopback_agent_ship_failures_total')}[15m])) > 0\n"
            f"unless\nsum {c.by_node} (increase("
            f"{c.agent('loopback_agent_shipped_verdicts_total')}[15m])) > 0\n"
            f"unless on ({c.cluster_label})\n"
            f"max {c.by_cluster} ({c.collector('up')}) == 0\n"
            # (no collector target at all: CollectorDown's absent() says it, once)
            f"unless on ()\nabsent({c.collector('up')})",
            "15m", "warning",
            "Node {{ $labels.node }}: the loopback-agent cannot ship verdicts to the collector",
            "The loopback-agent on {{ $labels.node }} failed to ship verdicts for 15 min and "
            "shipped none; they wait in its spool. Its log names the error (`shipping failed "
            "(...); retrying in ...`): `kubectl -n loopback-agent-node logs POD`, the pod from "
            "`kubectl -n loopback-agent-node get pods -o wide "
            "--field-selector spec.nodeName={{ $labels.node }}`."),
        Alert(
            "LoopbackAgentSpoolGrowing",
            f"Verdicts pile up in the agent's spool: more than {c.spool_depth_threshold} wait, "
            "or the spool grew over the last hour without once being empty (a healthy agent "
            "empties it every cycle), or verdicts were dropped because it was full (1,000 "
            "verdicts or 64 MiB).",
            f"max {c.by_node} ({depth}) > {c.spool_depth_threshold}\n"
            f"or\n(\n  max {c.by_node} (delta({depth}[1h])) > 0\n  and\n"
            f"  max {c.by_node} (min_over_time({depth}[1h])) > 0\n)\n"
            f"or\nmax {c.by_node} (delta("
            f"{c.agent('loopback_agent_spool_dropped')}[1h])) > 0",
            "15m", "warning",
            "Node {{ $labels.node }}: verdicts pile up in the loopback-agent's spool",
            "The loopback-agent on {{ $labels.node }} has verdicts waiting in its spool that "
            "do not leave (loopback_agent_spool_depth, loopback_agent_spool_dropped): the "
            "collector does not get this node's verdicts, and once the spool is full the "
            "oldest are lost. Its log says why (shipping failed, kept in the spool)."),
    )
    last_seen = c.collector("loopback_collector_node_last_seen_timestamp_seconds")
    collector = (
        Alert(
            "LoopbackAgentNodeSilent",
            f"The collector has not heard from a node for 3 heartbeats ({silent_node // 60} "
            f"min; an agent sends at least one verdict every {heartbeat // 60} min). Nodes "
            f"silent for more than {NODE_GONE_AFTER // 3600} h are taken as removed from the "
            "cluster (the collector keeps every node's last verdict) and no longer alerted "
            "on. The newest of several collector replicas counts.",
            f"(time() - max {c.by_node} ({last_seen})) > {silent_node}\n"
            f"and\n(time() - max {c.by_node} ({last_seen})) < {NODE_GONE_AFTER}",
            "5m", "warning",
            "The collector has not heard from node {{ $labels.node }} for "
            f"{silent_node // 60} min",
            "No verdict from {{ $labels.node }} for {{ $value | humanizeDuration }}. Is its "
            "agent pod running (`kubectl -n loopback-agent-node get pods -o wide`), and can it "
            "reach the collector (its log names the shipping error)?"),
        Alert(
            "LoopbackAgentCollectorDown",
            "No collector target is up, or there is none: the fleet's verdicts are not "
            "stored (the agents keep them in their spools meanwhile) and "
            "LoopbackAgentNodeSilent cannot fire.",
            f"absent({c.collector('up')})\nor\nmax {c.by_cluster} ({c.collector('up')}) == 0",
            "5m", "warning",
            "The loopback-agent collector is down",
            "Prometheus scrapes no collector of loopback-agent (" + c.collector_selector
            + "), or none answers: the agents cannot ship their verdicts and keep them "
            "spooled, the fleet page and `kubectl loopback nodes` are unavailable."),
    )
    return (
        Group("loopback-agent", "From the agents' own series: each node's verdict, and the "
              "agents' health.", verdicts + agents),
        Group(COLLECTOR_GROUP, "From the collector's series: the nodes it hears from, and "
              "itself.", collector),
    )


def rule(c: Config, a: Alert) -> Obj:
    return {"alert": a.name, "expr": a.expr, "for": a.for_,
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary, "description": a.description,
                            "runbook_url": c.runbook_url.replace("{alert}", a.name)}}


def rule_groups(c: Config) -> Obj:
    """The PrometheusRule's spec (also promtool's rule file)."""
    return {"groups": [{"name": g.name, "rules": [rule(c, a) for a in g.alerts]}
                       for g in groups(c)]}


def _scalar(text: str) -> str:
    """A YAML scalar for ``text``: plain where it reads back the same, else quoted."""
    try:
        plain_ok = yaml.safe_load(f"k: {text}") == {"k": text}
    except yaml.YAMLError:
        plain_ok = False
    return text if plain_ok else json.dumps(text)


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` (a longer word alone), never broken inside
    `code` or a {{ template }}: the chart's template replaces `kubectl -n NAMESPACE `
    in the text, which must stay on one line."""
    parts = re.split(r"(`[^`]*`|\{\{[^}]*\}\})", text)
    glued = "".join(part.replace(" ", "\0") if part.startswith(("`", "{{")) else part
                    for part in parts)
    return [line.replace("\0", " ") for line in textwrap.wrap(
        glued, width, break_long_words=False, break_on_hyphens=False)]


def _comment(text: str, indent: int, width: int = 92) -> list[str]:
    return [" " * indent + "# " + line for line in textwrap.wrap(text, width - indent)]


def rules_yaml(c: Config, indent: int) -> str:
    """The spec as YAML text, commented, ``indent`` spaces in (`groups:` first)."""
    p = " " * indent
    out = [f"{p}groups:"]
    for g in groups(c):
        out += _comment(g.comment, indent + 2)
        out += [f"{p}  - name: {g.name}", f"{p}    rules:"]
        for a in g.alerts:
            r, q = rule(c, a), p + "        "
            out += _comment(a.comment, indent + 6)
            out.append(f"{p}      - alert: {a.name}")
            if "\n" in a.expr:
                out.append(f"{q}expr: |-")
                out += [f"{q}  {line}" if line else "" for line in a.expr.split("\n")]
            else:
                out.append(f"{q}expr: {_scalar(a.expr)}")
            out += [f"{q}for: {a.for_}", f"{q}labels:", f"{q}  severity: {a.severity}",
                    f"{q}annotations:", f"{q}  summary: {json.dumps(a.summary)}",
                    f"{q}  description: >-"]
            out += [f"{q}    {line}" for line in _wrap(a.description, 96 - len(q))]
            out.append(f"{q}  runbook_url: {_scalar(r['annotations']['runbook_url'])}")
    return "\n".join(out) + "\n"


HEADER = """\
# Generated by dashboards/mixin.py: edit that file and run it, not this one
# (tests/test_monitoring.py fails while a copy differs from what it writes).
"""


def component_rules(c: Config) -> str:
    about = (
        "Alerts on the agents' and the collector's series, each with a runbook "
        "(docs/runbooks/); tests/test_monitoring.py checks them with promtool: syntax, and "
        "unit tests in which each fires for its series and not for others. Thresholds "
        f"follow the settings in config.yaml: a verdict every {c.interval} s (the agent's "
        "loopback_agent_status is set from each), an unchanged verdict re-sent to the "
        f"collector every {c.heartbeat_every} verdicts (a node is heard from at least every "
        f"{c.interval * c.heartbeat_every // 60} min). The agents' targets: "
        f"{c.agent_selector}; the collector's: {c.collector_selector} (the monitoring "
        "component's PodMonitors' jobs are NAMESPACE/NAME).")
    return HEADER + "\n".join(_comment(about, 0)) + """
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: loopback-agent
  namespace: loopback-agent
  labels:
    app.kubernetes.io/name: loopback-agent
    app.kubernetes.io/component: monitoring
    app.kubernetes.io/part-of: loopback-agent
spec:
""" + rules_yaml(c, 2)


def chart_rules(c: Config) -> str:
    return HEADER + """\
# The PrometheusRule's groups: daemonset/monitoring/prometheusrule.yaml's spec, read with
# .Files.Get so that Helm leaves the alerts' own {{ $labels }} templates alone (the
# template puts the release's names and namespace in).
""" + rules_yaml(c, 0)


# -- the dashboard ------------------------------------------------------------------------


DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
TIMESERIES = {"fieldConfig": {"defaults": {"custom": {"drawStyle": "line", "fillOpacity": 10}},
                              "overrides": []}}
STAT = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}


def _target(ref: str, expr: str, legend: str, instant: bool = False,
            table: bool = False) -> Obj:
    t: Obj = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t |= {"instant": True, "range": False}
    if table:
        t["format"] = "table"
    return t


def _panel(pid: int, kind: str, title: str, description: str, grid: tuple[int, int, int, int],
           targets: list[Obj], **rest: Any) -> Obj:
    x, y, w, h = grid
    return {"id": pid, "type": kind, "title": title, "description": description,
            "datasource": DATASOURCE, "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "targets": targets, **rest}


def _variable(name: str, label: str, query: str) -> Obj:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": query, "definition": query, "refresh": 2, "sort": 1, "regex": "",
            "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0, "options": []}


def dashboard(c: Config) -> Obj:
    in_cluster = f'{c.cluster_label}=~"$cluster"'
    on_node = 'node=~"$node"'

    def agent(metric: str, *matchers: str) -> str:
        return c.agent(metric, in_cluster, on_node, *matchers)

    def collector(metric: str, *matchers: str) -> str:
        return c.collector(metric, in_cluster, *matchers)

    def rate(selector: str) -> str:
        return f"rate({selector}[{RATE}])"

    status = agent("loopback_agent_status")
    last_seen = collector("loopback_collector_node_last_seen_timestamp_seconds", on_node)
    at_risk = agent("loopback_agent_finding", 'lb_ip!=""', 'severity!="info"')
    panels = [
        _panel(1, "stat", "Nodes by verdict (agents)",
               "How many nodes' agents say healthy, at-risk, loopback now.", (0, 0, 8, 5),
               [_target("A", f"sum by (status) ({status})", "{{status}}", instant=True)],
               options={**STAT, "colorMode": "background", "textMode": "value_and_name"}),
        _panel(2, "stat", "Nodes the collector has not heard from (30 min)",
               "Nodes whose newest verdict reached the collector more than 30 minutes ago.",
               (8, 0, 8, 5),
               [_target("A", f"count((time() - {last_seen}) > 1800) or vector(0)",
                        "silent nodes", instant=True)],
               options=STAT),
        _panel(3, "stat", "Agents without a capture",
               "Agents whose NodePort capture is unavailable: they cannot see looping traffic.",
               (16, 0, 8, 5),
               [_target("A", f"count({agent('loopback_agent_capture_available')} == 0) "
                        "or vector(0)", "no capture", instant=True)],
               options=STAT),
        _panel(4, "timeseries", "Fleet status over time",
               "Nodes per verdict status, as the agents report it and as the collector "
               "stored it.", (0, 5, 12, 8),
               [_target("A", f"sum by (status) ({status})", "agents: {{status}}"),
                _target("B", f"sum by (status) ({collector('loopback_collector_nodes')})",
                        "collector: {{status}}")], **TIMESERIES),
        _panel(5, "table", "Top LB IPs at risk (nodes with a finding)",
               "LoadBalancer IPs with the most nodes reporting a finding for them, now.",
               (12, 5, 12, 8),
               [_target("A", f"topk(15, count by (lb_ip, service, severity) ({at_risk}))",
                        "", instant=True, table=True)]),
        _panel(6, "timeseries", "NodePort SYNs by outcome (capture rate)",
               "Handshakes the agents watched, per second, by what became of them.",
               (0, 13, 12, 8),
               [_target("A", "sum by (outcome) "
                        f"({rate(agent('loopback_agent_nodeport_syns_total'))})",
                        "{{outcome}}")], **TIMESERIES),
        _panel(7, "timeseries", "Capture: packets and kernel ring drops",
               "What the captures saw, and what the kernel dropped before they could.",
               (12, 13, 12, 8),
               [_target("A", f"sum({rate(agent('loopback_agent_capture_packets_total'))})",
                        "packets/s"),
                _target("B", "sum("
                        f"{rate(agent('loopback_agent_capture_kernel_drops_total'))})",
                        "ring drops/s"),
                _target("C", "sum("
                        f"{rate(agent('loopback_agent_martian_source_drops_total'))})",
                        "martian source drops/s")], **TIMESERIES),
        _panel(8, "timeseries", "Findings by id",
               "Finding series across the fleet; the second line counts series left out by "
               "the cap.", (0, 21, 12, 8),
               [_target("A", f"sum by (id, severity) ({agent('loopback_agent_finding')})",
                        "{{id}} ({{severity}})"),
                _target("B", "sum("
                        f"{rate(agent('loopback_agent_finding_series_dropped_total'))})",
                        "series over the cap/s")], **TIMESERIES),
        _panel(9, "timeseries", "Shipping to the collector",
               "Verdicts leaving the agents and arriving at the collector.", (12, 21, 12, 8),
               [_target("A", f"sum({rate(agent('loopback_agent_shipped_verdicts_total'))})",
                        "shipped/s"),
                _target("B", f"sum({rate(agent('loopback_agent_ship_failures_total'))})",
                        "failures/s"),
                _target("C", f"sum({agent('loopback_agent_spool_depth')})", "spooled"),
                _target("D", "sum("
                        f"{rate(collector('loopback_collector_verdicts_stored_total'))})",
                        "stored/s")], **TIMESERIES),
    ]
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus",
         "label": "Prometheus", "current": {}, "hide": 0, "refresh": 1, "options": []},
        _variable("cluster", "cluster", "label_values("
                  f"{c.agent('loopback_agent_status')}, {c.cluster_label})"),
        _variable("node", "node", "label_values("
                  f"{c.agent('loopback_agent_status', in_cluster)}, node)"),
    ]
    return {
        "title": "loopback-agent",
        "uid": "loopback-agent",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "tags": ["loopback-agent", "kubernetes"],
        "timezone": "browser",
        "refresh": "1m",
        "time": {"from": "now-6h", "to": "now"},
        "description": "Cloud-LB loopback across the fleet: verdicts, LB IPs at risk, "
                       "captures. Series: the agents' and the collector's /metrics "
                       "(daemonset/monitoring). Generated by dashboards/mixin.py.",
        "templating": {"list": variables},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def dashboard_json(c: Config) -> str:
    return json.dumps(dashboard(c), indent=2, ensure_ascii=False) + "\n"


# -- the copies ---------------------------------------------------------------------------


def files(c: Config) -> dict[Path, str]:
    """Every file this writes, by its path in the repository."""
    spec = rule_groups(c)
    component, chart = component_rules(c), chart_rules(c)
    # the text is written by hand (to keep its comments): it must read back as the rules
    assert yaml.safe_load(component)["spec"] == spec, "component rules do not read back"
    assert yaml.safe_load(chart) == spec, "chart rules do not read back"
    dash = dashboard_json(c)
    return {RULES_COMPONENT: component, RULES_CHART: chart, DASHBOARD: dash,
            DASHBOARD_CHART: dash}


def stale(c: Config, root: Path) -> list[Path]:
    """The copies under ``root`` that are not what ``c`` writes."""
    out = []
    for path, text in files(c).items():
        try:
            current = (root / path).read_text()
        except OSError:
            current = None
        if current != text:
            out.append(path)
    return out


def write(c: Config, root: Path) -> list[Path]:
    """Write the copies under ``root``; the ones that changed."""
    changed = stale(c, root)
    for path, text in files(c).items():
        if path in changed:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Config()
    ap.add_argument("--out", type=Path, default=REPO,
                    help="the tree to write into (default: this checkout)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 naming the copies that are not current")
    for field in dataclasses.fields(Config):
        ap.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                        type=type(getattr(defaults, field.name)),
                        default=getattr(defaults, field.name),
                        help=f"default: {getattr(defaults, field.name)!r}".replace("%", "%%"))
    args = ap.parse_args(argv)
    try:
        config = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    except ValueError as e:
        ap.error(str(e))
    if args.check:
        out = stale(config, args.out)
        for path in out:
            print(f"not current: {path} (run python dashboards/mixin.py)", file=sys.stderr)
        return 1 if out else 0
    for path in write(config, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
