"""Prometheus and Grafana: the agent's and the collector's /metrics series, the monitoring
component (daemonset/monitoring/: PodMonitors and a PrometheusRule) and the dashboard
(dashboards/loopback-agent.json).

The rules and the dashboard have one source, dashboards/mixin.py, which writes them for the
component and the chart: the committed copies must be what it writes (and writing again
changes nothing), every alert has a runbook_url whose page exists in docs/runbooks/, and
the dashboard has its cluster and node variables and no fixed rate window.

The series are read from real exposition output (a Metrics instance fed a verdict that
`check` made from a saved bundle, and a Collector over a SQLite store), never from a list
kept here. The rules are checked with promtool (Debian's prometheus package, in DEB_PKGS):
`promtool check rules` and `promtool test rules` with tests/data/monitoring/alerts-test.yaml,
in which each alert fires for its series and not for near misses; a broken rule makes that
test fail. Every dashboard query must parse (promtool, as a recording rule) and name only
series that are exported; end to end, a real Prometheus (the same package) scrapes the
agent's /metrics server and a collector process, and every dashboard query returns data and
every rule evaluates.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.capture.model import CaptureResult, Corroboration, NodePortStats
from agent.collector.server import Collector
from agent.collector.store import open_store
from agent.daemon import Metrics
from agent.diagnose.model import Finding, Verdict
from dashboards import mixin
from tests.test_collector import Postgres
from tests.test_deploy import KUSTOMIZE_DIR, agent_ds, collector_dep, kustomize, one, pod_spec

REPO = Path(__file__).resolve().parents[1]
MONITORING_DIR = KUSTOMIZE_DIR / "monitoring"
ALERT_TESTS = Path(__file__).parent / "data" / "monitoring" / "alerts-test.yaml"
DASHBOARD = REPO / "dashboards" / "loopback-agent.json"
TKE = Path(__file__).parent / "data" / "bundles" / "tke-etp-local"
ALERTS = {"LoopbackAgentNodeLooping", "LoopbackAgentNodeAtRisk", "LoopbackAgentNodeSilent",
          "LoopbackAgentCaptureUnavailable", "LoopbackAgentNodeUndetermined",
          # the agents and the collector themselves
          "LoopbackAgentSilent", "LoopbackAgentAbsent", "LoopbackAgentShipFailing",
          "LoopbackAgentSpoolGrowing", "LoopbackAgentCollectorDown"}
# the jobs the prometheus-operator gives the component's PodMonitors' targets (NAMESPACE/NAME)
AGENT_JOB = "loopback-agent-node/loopback-agent"
COLLECTOR_JOB = "loopback-agent/loopback-agent-collector"
# what Grafana puts for the dashboard's variables, to run its queries elsewhere
ALL = {"$__rate_interval": "1m", "$cluster": ".*", "$node": ".*"}

Obj = dict[str, Any]


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: apt-get install prometheus (make deps does)")
    return found


# -- the real series ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tke_verdict() -> Verdict:
    """What `check` says about a saved TKE bundle (real findings with LB IPs, Services)."""
    out = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(TKE), "--json",
                          "--node-name", "node-a"], capture_output=True, text=True, timeout=120)
    v = Verdict.from_dict(json.loads(out.stdout))
    assert [f for f in v.findings if f.lb_ip and f.service], "the bundle's findings changed"
    return v


def with_capture(v: Verdict, problems: tuple[str, ...] = ()) -> Verdict:
    cap = CaptureResult(
        seconds=60.0, port_range=(30000, 32767), packets_seen=120, kernel_drops=3,
        ports=(NodePortStats(31380, syns=10, counts={"answered": {"external": 7},
                                                     "unanswered": {"pod": 3}}),),
        corroboration=(Corroboration("in_martian_src", True, 5),), problems=problems)
    return dataclasses.replace(v, capture=cap)


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def agent_exposition(v: Verdict) -> str:
    m = Metrics()
    m.verdict(v)
    return generate_latest(m.registry).decode()


def collector_exposition(db: str, doc: Obj, nodes: Iterable[tuple[str, float]],
                         monkeypatch: pytest.MonkeyPatch,
                         max_node_series: int = 10_000) -> str:
    """The collector's /metrics after it stored ``doc`` as each (node, received at)."""
    import agent.collector.store as store_mod

    store = open_store(db)
    for i, (node, when) in enumerate(nodes):
        monkeypatch.setattr(store_mod.time, "time", lambda when=when: when)
        store.add([{**doc, "node": node, "idempotency_key": f"{node}-{i}"}])
    monkeypatch.undo()
    try:
        return Collector(store, max_node_series=max_node_series).metrics().decode()
    finally:
        store.close()


@pytest.fixture(scope="module")
def exported_names(tke_verdict: Verdict, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name the agent and the collector expose (counters with _total)."""
    text = agent_exposition(with_capture(tke_verdict)) + collector_exposition(
        f"sqlite://{tmp_path_factory.mktemp('col') / 'c.db'}", tke_verdict.to_dict(),
        [("node-a", 1000.0)], pytest.MonkeyPatch())
    return {name for name, _, _ in samples(text)}


# -- the agent's per-finding series ---------------------------------------------------------


def finding_series(text: str) -> dict[tuple[str, str, str, str], float]:
    return {(lb["id"], lb["severity"], lb["lb_ip"], lb["service"]): value
            for name, lb, value in samples(text) if name == "loopback_agent_finding"}


def test_one_series_per_finding_while_it_is_present(tke_verdict: Verdict) -> None:
    m = Metrics()
    m.verdict(tke_verdict)
    series = finding_series(generate_latest(m.registry).decode())
    expected = {(f.id, f.severity, f.lb_ip or "", f.service or "")
                for f in tke_verdict.findings}
    assert set(series) == expected and set(series.values()) == {1.0}
    # the finding goes: its series goes (absent, not 0); the others stay
    gone = next(f for f in tke_verdict.findings if f.lb_ip)
    fewer = dataclasses.replace(tke_verdict, findings=tuple(
        f for f in tke_verdict.findings if (f.id, f.lb_ip) != (gone.id, gone.lb_ip)))
    m.verdict(fewer)
    after = finding_series(generate_latest(m.registry).decode())
    assert (gone.id, gone.severity, gone.lb_ip, gone.service or "") not in after
    assert set(after) == {(f.id, f.severity, f.lb_ip or "", f.service or "")
                          for f in fewer.findings}
    m.verdict(dataclasses.replace(tke_verdict, findings=(), status="healthy"))
    assert finding_series(generate_latest(m.registry).decode()) == {}


def test_finding_series_are_capped_most_severe_first() -> None:
    findings = tuple(Finding(f"f{i}", sev, "x", lb_ip=f"203.0.113.{i}", service=f"ns/s{i}")
                     for i, sev in enumerate(["info", "warning", "critical", "info", "warning"]))
    # the same key twice (two ports of one LB IP) is one series
    findings += (dataclasses.replace(findings[2], port=443),)
    v = Verdict(node="n", time="t", agent_version="0", status="at-risk",
                kube_proxy_mode="iptables", findings=findings, unknowns=())
    m = Metrics(max_finding_series=3)
    m.verdict(v)
    text = generate_latest(m.registry).decode()
    assert sorted(k[0] for k in finding_series(text)) == ["f1", "f2", "f4"]  # crit, 2 warn
    dropped = [val for name, _, val in samples(text)
               if name == "loopback_agent_finding_series_dropped_total"]
    assert dropped == [2.0]
    m.verdict(v)  # counted per verdict
    assert ("loopback_agent_finding_series_dropped_total", {}, 4.0) in \
        samples(generate_latest(m.registry).decode())
    # a hostile label value is cut, not refused
    long = Finding("f", "warning", "x", service="ns/" + "a" * 5000)
    m.verdict(dataclasses.replace(v, findings=(long,)))
    ((_, _, _, service),) = finding_series(generate_latest(m.registry).decode())
    assert len(service) == 253


def test_capture_availability_and_counters(tke_verdict: Verdict) -> None:
    def value(text: str, name: str, **labels: str) -> float | None:
        vals = [v for n, lb, v in samples(text) if n == name and lb == labels]
        return vals[0] if vals else None

    ok = agent_exposition(with_capture(tke_verdict))
    assert value(ok, "loopback_agent_capture_available") == 1.0
    assert value(ok, "loopback_agent_capture_packets_total") == 120.0
    assert value(ok, "loopback_agent_capture_kernel_drops_total") == 3.0
    assert value(ok, "loopback_agent_martian_source_drops_total") == 5.0
    assert value(ok, "loopback_agent_nodeport_syns_total",
                 outcome="unanswered", source_class="pod") == 3.0
    down = agent_exposition(with_capture(
        tke_verdict, problems=("capture unavailable: socket: Operation not permitted",)))
    assert value(down, "loopback_agent_capture_available") == 0.0
    # --no-capture: no capture was attempted, so no series to alert on
    assert value(agent_exposition(tke_verdict), "loopback_agent_capture_available") is None
    status = {lb["status"]: v for n, lb, v in samples(ok) if n == "loopback_agent_status"}
    assert status == {"healthy": 0.0, "unknown": 0.0, "at-risk": 1.0, "loopback": 0.0}


def test_read_costs_and_reads_put_off() -> None:
    """--reread-cpu's state per cached source: what its last read cost, and whether a
    change of it waits (the verdict then shows that read)."""
    from agent.probes.base import ProbeResult, ReadCache

    now = [0.0]
    cache, mark = ReadCache(cpu_share=0.1, clock=lambda: now[0]), [1]
    cache.begin_cycle()
    cache.read("nat rules", lambda: mark[0], lambda: ProbeResult("rules"))
    cache.read("ipsets", lambda: 1, lambda: ProbeResult("sets"))
    cache.charge(20.0)  # the walk that followed: the next reads 200 s after at the soonest
    mark[0] = 2
    now[0] = 100.0
    cache.begin_cycle()
    cache.read("nat rules", lambda: mark[0], lambda: ProbeResult("new rules"))
    m = Metrics()
    m.reads(cache)
    got = {(n, lb["source"]): v for n, lb, v in samples(generate_latest(m.registry).decode())
           if n.startswith("loopback_agent_read_")}
    assert got[("loopback_agent_read_put_off", "nat rules")] == 1.0
    assert got[("loopback_agent_read_put_off", "ipsets")] == 0.0
    assert 0.0 <= got[("loopback_agent_read_cpu_seconds", "nat rules")] < 1.0  # its own
    now[0] = 250.0
    cache.begin_cycle()
    cache.read("nat rules", lambda: mark[0], lambda: ProbeResult("new rules"))
    m.reads(cache)
    assert ("loopback_agent_read_put_off", {"source": "nat rules"}, 0.0) in \
        samples(generate_latest(m.registry).decode())


def test_commits_that_left_the_rules_as_read_are_counted() -> None:
    """A moved marker whose content digest is the last read's: counted per source, once
    per such commit however often the metrics are taken."""
    from agent.probes.base import ProbeResult, ReadCache

    cache, mark = ReadCache(), [1]
    m = Metrics()

    def cycle() -> None:
        cache.begin_cycle()
        cache.read("nat rules", lambda: mark[0], lambda: ProbeResult("rules"),
                   lambda _: "same")
        m.reads(cache)

    cycle()
    for mark[0] in (2, 3):
        cycle()
    m.reads(cache)
    got = [(lb, v) for n, lb, v in samples(generate_latest(m.registry).decode())
           if n == "loopback_agent_read_kept_commits_total"]
    assert got == [({"source": "nat rules"}, 2.0)]


# -- the collector's per-node last-seen series ----------------------------------------------


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    server = Postgres()  # a real PostgreSQL server of its own (tests/test_collector.py)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'c.db'}"
    return request.getfixturevalue("postgres").new_db()


def test_collector_last_seen_per_node_bounded(tke_verdict: Verdict, db_url: str,
                                              tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On SQLite and PostgreSQL (a real server: tests/test_collector.py's fixtures)."""
    doc = tke_verdict.to_dict()
    text = collector_exposition(db_url, doc, [("fresh", 3000.0), ("stale", 1000.0),
                                                ("middle", 2000.0), ("fresh", 4000.0)],
                                monkeypatch, max_node_series=2)
    seen = {lb["node"]: v for n, lb, v in samples(text)
            if n == "loopback_collector_node_last_seen_timestamp_seconds"}
    # the longest silent are the ones kept (what an alert needs), the newest verdict counts
    assert seen == {"stale": 1000.0, "middle": 2000.0}
    assert ("loopback_collector_node_series_dropped", {}, 1.0) in samples(text)
    everything = collector_exposition(f"sqlite://{tmp_path / 'other.db'}", doc,
                                      [("a", 5.0), ("b", 6.0)], monkeypatch)
    assert {lb["node"]: v for n, lb, v in samples(everything)
            if n == "loopback_collector_node_last_seen_timestamp_seconds"} == \
        {"a": 5.0, "b": 6.0}
    assert ("loopback_collector_node_series_dropped", {}, 0.0) in samples(everything)


def test_collector_last_seen_keeps_silent_nodes_before_removed_ones(
        tke_verdict: Verdict, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector keeps every node's last verdict, so on an autoscaled cluster the
    nodes removed long ago pile up, and they are the longest silent. Once they fill the
    cap, a node silent for an hour (the one LoopbackAgentNodeSilent is for: 30 min to a
    day) was left out and the alert could not fire. Nodes silent for more than the alert's
    day come after the others."""
    import time

    now = time.time()
    removed = [(f"gone-{i}", now - 86400 * (3 + i)) for i in range(3)]
    text = collector_exposition(db_url, tke_verdict.to_dict(),
                                [*removed, ("silent", now - 3600), ("fine", now - 60)],
                                monkeypatch, max_node_series=2)
    seen = {lb["node"] for n, lb, v in samples(text)
            if n == "loopback_collector_node_last_seen_timestamp_seconds"}
    assert seen == {"silent", "fine"}
    assert ("loopback_collector_node_series_dropped", {}, 3.0) in samples(text)


# -- the monitoring component ---------------------------------------------------------------


@pytest.fixture(scope="module")
def with_monitoring(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    overlay = tmp_path_factory.mktemp("overlay")
    rel = os.path.relpath(KUSTOMIZE_DIR, overlay)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [rel], "components": [f"{rel}/monitoring"]}))
    return kustomize(overlay)


def test_component_adds_monitors_and_rules_only(with_monitoring: list[Obj]) -> None:
    added = [o for o in with_monitoring if o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in added) == [
        ("PodMonitor", "loopback-agent"), ("PodMonitor", "loopback-agent-collector"),
        ("PrometheusRule", "loopback-agent")]
    assert [o for o in with_monitoring if o not in added] == kustomize(KUSTOMIZE_DIR)


def test_pod_monitors_select_the_pods_and_their_ports(with_monitoring: list[Obj]) -> None:
    for name, workload in (("loopback-agent", agent_ds(with_monitoring)),
                           ("loopback-agent-collector", collector_dep(with_monitoring))):
        pm = one(with_monitoring, "PodMonitor", name)
        # in the pods' namespace (a PodMonitor without namespaceSelector looks only there)
        assert pm["metadata"]["namespace"] == workload["metadata"]["namespace"]
        assert "namespaceSelector" not in pm["spec"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (endpoint,) = pm["spec"]["podMetricsEndpoints"]
        (container,) = pod_spec(workload)["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert endpoint["port"] in ports
        # the same port and path the pods' prometheus.io annotations name
        ann = workload["spec"]["template"]["metadata"]["annotations"]
        assert str(ports[endpoint["port"]]) == ann["prometheus.io/port"]
        assert endpoint["path"] == ann["prometheus.io/path"]
    # the alerts group by node: the agent's targets carry it
    agent_pm = one(with_monitoring, "PodMonitor", "loopback-agent")
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in \
        agent_pm["spec"]["podMetricsEndpoints"][0]["relabelings"]


def rule_groups(with_monitoring: list[Obj], annotations: bool = True) -> Obj:
    groups = copy.deepcopy(one(with_monitoring, "PrometheusRule", "loopback-agent")
                           ["spec"]["groups"])
    if not annotations:
        for g in groups:
            for r in g["rules"]:
                r.pop("annotations", None)
    return {"groups": groups}


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_rules_pass_promtool_check(with_monitoring: list[Obj], tmp_path: Path) -> None:
    rules = rule_groups(with_monitoring)
    assert {r["alert"] for g in rules["groups"] for r in g["rules"]} == ALERTS
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    proc = run_promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout
    # the check bites: an unknown function is refused
    rules["groups"][0]["rules"][0]["expr"] = "maxx(loopback_agent_status)"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(rules))
    assert run_promtool("check", "rules", "bad.yaml", cwd=tmp_path).returncode != 0


def alert_unit_test(rules: Obj, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    shutil.copy(ALERT_TESTS, tmp_path / "alerts-test.yaml")
    return run_promtool("test", "rules", "alerts-test.yaml", cwd=tmp_path)


def test_each_alert_fires_for_its_series_and_not_others(with_monitoring: list[Obj],
                                                        tmp_path: Path) -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t["alert_rule_test"]}
    assert tested == ALERTS
    for t in tests:  # each alert is tested both ways: silent and firing
        for name in {c["alertname"] for c in t["alert_rule_test"]}:
            outcomes = {bool(c["exp_alerts"]) for c in t["alert_rule_test"]
                        if c["alertname"] == name}
            assert outcomes == {True, False}, name
    proc = alert_unit_test(rule_groups(with_monitoring, annotations=False), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@pytest.mark.parametrize(("alert", "field", "value"), [
    ("LoopbackAgentNodeLooping", "expr", 'max by (node) (loopback_agent_status) == 1'),
    ("LoopbackAgentNodeAtRisk", "for", "5m"),
    ("LoopbackAgentNodeSilent", "expr",
     "(time() - loopback_collector_node_last_seen_timestamp_seconds) > 1800"),
    ("LoopbackAgentCaptureUnavailable", "expr",
     "max by (node) (loopback_agent_capture_available) < 1 or vector(0)"),
    # without the selector: another job's series of the name would page
    ("LoopbackAgentNodeLooping", "expr",
     'max by (cluster, node) (loopback_agent_status{status="loopback"}) == 1'),
    # the target down only: an agent that makes no verdicts goes unseen
    ("LoopbackAgentSilent", "expr", f'max by (cluster, node) (up{{job="{AGENT_JOB}"}}) == 0'),
    ("LoopbackAgentAbsent", "for", "1h"),
    # failures alone: a flaky link that still ships, or every node behind a down collector
    ("LoopbackAgentShipFailing", "expr",
     "sum by (cluster, node) (increase(loopback_agent_ship_failures_total[15m])) > 0"),
    # the threshold alone: a spool that grows slowly or drops verdicts goes unseen
    ("LoopbackAgentSpoolGrowing", "expr",
     "max by (cluster, node) (loopback_agent_spool_depth) > 100"),
    # up == 0 alone: a collector no longer scraped at all goes unseen
    ("LoopbackAgentCollectorDown", "expr",
     f'max by (cluster) (up{{job="{COLLECTOR_JOB}"}}) == 0'),
])
def test_the_unit_tests_catch_a_broken_rule(with_monitoring: list[Obj], tmp_path: Path,
                                            alert: str, field: str, value: str) -> None:
    rules = rule_groups(with_monitoring, annotations=False)
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r["alert"] == alert]
    rule[field] = value
    proc = alert_unit_test(rules, tmp_path)
    assert proc.returncode != 0, f"{alert} with {field}={value!r} passed the unit tests"
    assert alert in proc.stdout + proc.stderr


# -- metric names in queries ----------------------------------------------------------------


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: identifiers that are not functions
    (followed by '('), label names (inside {} or by/on/without (...)), keywords, strings,
    durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'", '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = m.group(0)
        after = text[m.end():].lstrip()
        if word.lower() in _KEYWORDS or after.startswith("(") or \
                re.match(r"\d", text[m.start() - 1:m.start()] or "x"):
            continue
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    assert metric_names('topk(15, count by (lb_ip, service) (loopback_agent_finding'
                        '{lb_ip!=""}))') == {"loopback_agent_finding"}
    assert metric_names("sum(rate(a_total[5m])) / on (node) group_left b or vector(0)") == \
        {"a_total", "b"}
    assert metric_names('(time() - x{node="a{b}"}) > 1800 and y') == {"x", "y"}


def test_rule_unit_tests_and_rules_use_exported_series(with_monitoring: list[Obj],
                                                       exported_names: set[str]) -> None:
    used: set[str] = set()
    for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for s in t["input_series"]:
            used.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", s["series"]).group(0))
    for g in rule_groups(with_monitoring)["groups"]:
        for r in g["rules"]:
            used |= metric_names(r["expr"])
    # `up`: Prometheus' own, per target
    assert used - exported_names == {"up"}


# -- one source: dashboards/mixin.py -------------------------------------------------------

MIXIN = REPO / "dashboards" / "mixin.py"
RUNBOOKS = REPO / "docs" / "runbooks"


def run_mixin(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(MIXIN), *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_the_committed_copies_are_what_the_generator_writes(tmp_path: Path) -> None:
    """The component's rules, the chart's, the dashboard and the chart's copy of it are
    byte for byte what dashboards/mixin.py writes: edit it and run it, never a copy."""
    assert mixin.stale(mixin.Config(), REPO) == []
    proc = run_mixin("--check")
    assert proc.returncode == 0, proc.stderr
    assert set(mixin.files(mixin.Config())) == {
        Path("daemonset/monitoring/prometheusrule.yaml"),
        Path("charts/loopback-agent/files/prometheus-rules.yaml"),
        Path("dashboards/loopback-agent.json"),
        Path("charts/loopback-agent/files/loopback-agent-dashboard.json")}
    # the check bites: a copy edited by hand is named
    for path, text in mixin.files(mixin.Config()).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    edited = tmp_path / "charts/loopback-agent/files/prometheus-rules.yaml"
    edited.write_text(edited.read_text().replace("for: 15m", "for: 5m", 1))
    proc = run_mixin("--check", "--out", tmp_path)
    assert proc.returncode == 1
    assert "charts/loopback-agent/files/prometheus-rules.yaml" in proc.stderr
    assert "dashboards/loopback-agent.json" not in proc.stderr


def test_the_generator_is_idempotent(tmp_path: Path) -> None:
    first = run_mixin("--out", tmp_path)
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.splitlines()) == 4  # "wrote PATH", each copy
    written = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    again = run_mixin("--out", tmp_path)
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == written
    assert run_mixin("--check", "--out", tmp_path).returncode == 0
    for path in written:  # the same as the committed ones
        assert path.read_bytes() == (REPO / path.relative_to(tmp_path)).read_bytes(), path


def test_the_copies_agree(with_monitoring: list[Obj]) -> None:
    """The chart's rules are the component's spec, its dashboard the dashboard (with the
    defaults; the chart puts the release's names into the selectors: tests/test_helm.py)."""
    component = one(with_monitoring, "PrometheusRule", "loopback-agent")["spec"]
    assert yaml.safe_load((REPO / mixin.RULES_CHART).read_text()) == component
    assert component == mixin.rule_groups(mixin.Config())
    assert (REPO / mixin.DASHBOARD_CHART).read_bytes() == DASHBOARD.read_bytes()
    # the collector's alerts are a group of their own, which the chart can leave out
    assert [g["name"] for g in component["groups"]] == ["loopback-agent", mixin.COLLECTOR_GROUP]
    (collector_group,) = [g for g in component["groups"] if g["name"] == mixin.COLLECTOR_GROUP]
    for r in collector_group["rules"]:
        assert "loopback_agent_" not in r["expr"], r["alert"]


def test_every_alert_has_a_runbook(with_monitoring: list[Obj]) -> None:
    """runbook_url on every alert, its page in docs/runbooks/ (what it means, how to
    confirm it with the agent's own commands, what to do), naming the series the alert
    reads; and no page for an alert that does not exist."""
    rules = [r for g in rule_groups(with_monitoring)["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    for r in rules:
        name = r["alert"]
        url = r["annotations"]["runbook_url"]
        assert url == mixin.Config().runbook_url.replace("{alert}", name)
        assert url.endswith(f"docs/runbooks/{name}.md"), url
        page = RUNBOOKS / f"{name}.md"
        assert page.is_file(), page
        text = page.read_text()
        assert text.startswith(f"# {name}\n"), page
        for section in ("## What it means", "## How to confirm", "## What to do"):
            assert f"\n{section}\n" in text, (page, section)
        assert "kubectl loopback" in text or "loopback-agent check" in text, page
        assert f"`{r['labels']['severity']}`" in text, (page, "its severity")
        for metric in metric_names(r["expr"]):
            assert metric in text, (page, metric)
    assert {p.stem for p in RUNBOOKS.glob("*.md")} == ALERTS


def test_the_runbook_url_follows_the_project_urls(tmp_path: Path) -> None:
    """The repository's URL from pyproject.toml's [project.urls]; without one, the path in
    the repository."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert mixin.default_runbook_url(tmp_path) == "docs/runbooks/{alert}.md"
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n[project.urls]\nHomepage = "https://example.org"\n'
        'Repository = "https://github.com/o/r/"\n')
    assert mixin.default_runbook_url(tmp_path) == \
        "https://github.com/o/r/blob/main/docs/runbooks/{alert}.md"
    assert mixin.Config().runbook_url == mixin.default_runbook_url(REPO)


def test_the_generator_settings(tmp_path: Path) -> None:
    """Other selectors, cluster label and runbook URL reach every rule and query, and the
    result is still valid for promtool."""
    agent, coll = 'job="kubernetes-pods", app="loopback-agent"', 'job="lb-collector"'
    proc = run_mixin("--out", tmp_path, "--agent-selector", agent, "--collector-selector", coll,
                     "--cluster-label", "k8s_cluster",
                     "--runbook-url", "https://runbooks.example/{alert}")
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load((tmp_path / mixin.RULES_COMPONENT).read_text())["spec"]
    assert yaml.safe_load((tmp_path / mixin.RULES_CHART).read_text()) == spec
    for r in (r for g in spec["groups"] for r in g["rules"]):
        assert r["annotations"]["runbook_url"] == f"https://runbooks.example/{r['alert']}"
        selectors = re.findall(r"([a-z_]+)\{([^}]*)\}", r["expr"])
        assert selectors, r["alert"]
        for metric, sel in selectors:
            own = coll if metric.startswith("loopback_collector_") else agent
            if metric == "up":
                own = agent if sel.startswith(agent) else coll
            assert sel.startswith(own), (r["alert"], metric, sel)
        assert "(cluster" not in r["expr"], r["alert"]
        assert "by (" not in r["expr"] or "by (k8s_cluster" in r["expr"], r["alert"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    check = run_promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    dash = json.loads((tmp_path / mixin.DASHBOARD).read_text())
    (cluster,) = [v for v in dash["templating"]["list"] if v["name"] == "cluster"]
    assert cluster["query"] == f"label_values(loopback_agent_status{{{agent}}}, k8s_cluster)"
    for ref, expr in dashboard_queries(dash):
        assert 'k8s_cluster=~"$cluster"' in expr, ref
        assert agent in expr or coll in expr, ref
    # a selector is needed: `up` of every target would be the agents'
    refused = run_mixin("--out", tmp_path / "no", "--agent-selector", "")
    assert refused.returncode == 2 and "agent_selector" in refused.stderr
    assert not (tmp_path / "no").exists()


def test_the_generator_follows_the_code() -> None:
    """The thresholds come from the agent's and the collector's defaults."""
    import inspect

    from agent.collector.server import NODE_GONE_AFTER
    from agent.daemon import DaemonConfig
    from agent.ship.spool import Spool

    c = mixin.Config()
    assert mixin.NODE_GONE_AFTER == NODE_GONE_AFTER
    defaults = {f.name: f.default for f in dataclasses.fields(DaemonConfig)}
    assert (c.interval, c.heartbeat_every) == (defaults["interval"],
                                               defaults["heartbeat_every"])
    config = yaml.safe_load((KUSTOMIZE_DIR / "config.yaml").read_text().split("---")[0])
    env = config["data"]
    assert env["LOOPBACK_AGENT_INTERVAL"] == str(c.interval)
    assert env["LOOPBACK_AGENT_HEARTBEAT_EVERY"] == str(c.heartbeat_every)
    # the threshold is met before the spool is full and drops verdicts
    assert c.spool_depth_threshold < inspect.signature(Spool).parameters["max_items"].default


# -- the Grafana dashboard --------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> Obj:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: Obj) -> list[Obj]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold theirs
    return out


def test_dashboard_shape(dashboard: Obj) -> None:
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    assert [v["name"] for v in dashboard["templating"]["list"]] == \
        ["datasource", "cluster", "node"]
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")), p["title"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24 and g["h"] >= 1, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()


def dashboard_queries(dash: Obj) -> list[tuple[str, str]]:
    return [(f"{p['id']}{t['refId']}", t["expr"]) for p in all_panels(dash)
            for t in p.get("targets", [])]


def concrete(expr: str, values: dict[str, str] = ALL) -> str:
    """A dashboard query as Grafana sends it: its variables replaced (longest first)."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


def test_dashboard_variables_and_windows(dashboard: Obj) -> None:
    """The cluster and node variables (kubernetes-mixin's way: a label matcher, "All" as
    .*, which also matches series without the label), and every query matches them;
    rates take Grafana's $__rate_interval, never a fixed window."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for name in ("cluster", "node"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"] == {"type": "prometheus",
                                                                "uid": "${datasource}"}
        assert var["includeAll"] and var["allValue"] == ".*" and var["multi"]
        assert var["current"]["value"] == ["$__all"]
    assert variables["cluster"]["query"] == \
        'label_values(loopback_agent_status{job=~"(.+/)?loopback-agent"}, cluster)'
    # the node from the agents' `node` label, within the chosen clusters
    assert variables["node"]["query"] == ('label_values(loopback_agent_status{job=~"(.+/)?'
                                          'loopback-agent", cluster=~"$cluster"}, node)')
    assert variables["node"]["query"] == variables["node"]["definition"]
    for ref, expr in dashboard_queries(dashboard):
        ranges = re.findall(r"\[([^\]]*)\]", expr)
        assert all(r == "$__rate_interval" for r in ranges), (ref, expr)
        assert "[5m]" not in expr
        names = metric_names(expr)
        for name in names:  # every selector: its job, the cluster; the agents' the node
            selectors = re.findall(re.escape(name) + r"\{([^}]*)\}", expr)
            assert selectors, (ref, name)
            for sel in selectors:
                assert 'cluster=~"$cluster"' in sel, (ref, expr)
                if name.startswith("loopback_agent_"):
                    assert sel.startswith('job=~"(.+/)?loopback-agent", ') and \
                        'node=~"$node"' in sel, (ref, expr)
                else:
                    assert sel.startswith('job=~"(.+/)?loopback-agent-collector", ')
    assert any("$__rate_interval" in e for _, e in dashboard_queries(dashboard))


def test_dashboard_queries_name_exported_series(dashboard: Obj,
                                                exported_names: set[str]) -> None:
    used = {}
    for ref, expr in dashboard_queries(dashboard):
        names = metric_names(expr)
        assert names, f"panel query {ref} selects no series: {expr}"
        used[ref] = names
    unknown = {ref: sorted(n - exported_names) for ref, n in used.items() if n - exported_names}
    assert not unknown, f"queries name series nothing exports: {unknown}"
    # the panels the dashboard is for
    everything = set().union(*used.values())
    assert {"loopback_agent_status", "loopback_agent_finding",
            "loopback_agent_nodeport_syns_total",
            "loopback_collector_node_last_seen_timestamp_seconds"} <= everything
    # ... and the check bites: a misspelt name is not exported
    assert metric_names("sum(loopback_agent_nodeport_syn_total)") - exported_names


def test_dashboard_queries_parse(dashboard: Obj, tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{ref}", "expr": concrete(expr)}
        for ref, expr in dashboard_queries(dashboard)]}]}
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump(rules))
    proc = run_promtool("check", "rules", "queries.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- end to end: a real Prometheus scraping a real agent endpoint and a real collector -------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prom_query(base: str, expr: str) -> list[Obj]:
    import requests

    r = requests.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_dashboard_and_rules_on_a_real_prometheus(tke_verdict: Verdict, tmp_path: Path,
                                                  with_monitoring: list[Obj]) -> None:
    """Debian's prometheus (the package that brings promtool) scrapes the agent's own
    /metrics server (agent.daemon, fed a verdict with a capture) and a collector process
    holding a verdict, every second, on 127.0.0.1, with the PodMonitor's `node` label;
    then every dashboard query returns data and every alert rule evaluates without error."""
    import requests

    from agent.daemon import Daemon, DaemonConfig
    from tests.test_collector import Proc

    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("prometheus not found: apt-get install prometheus (make deps does)")
    agent_port, prom_port = free_port(), free_port()
    daemon = Daemon(DaemonConfig(collector=None, spool_dir=str(tmp_path / "spool"),
                                 listen=f"127.0.0.1:{agent_port}"))
    daemon.metrics.verdict(with_capture(tke_verdict))
    daemon._serve(f"127.0.0.1:{agent_port}")
    collector = Proc(tmp_path / "c.db")
    proc = None
    try:
        r = requests.post(collector.url + "/v1/verdicts", timeout=10,
                          json={**tke_verdict.to_dict(), "idempotency_key": "k1"})
        assert r.status_code == 200, r.text
        (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups(with_monitoring)))
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yaml")],
            # the jobs the operator makes of the component's PodMonitors (NAMESPACE/NAME)
            "scrape_configs": [
                {"job_name": AGENT_JOB, "static_configs": [
                    {"targets": [f"127.0.0.1:{agent_port}"], "labels": {"node": "node-a"}}]},
                {"job_name": COLLECTOR_JOB, "honor_labels": True, "static_configs": [
                    {"targets": [f"127.0.0.1:{collector.port}"]}]}]}))
        proc = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{prom_port}"
        deadline = time.monotonic() + 60
        while True:  # both targets scraped at least three times: rate() has its points
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                up = prom_query(base, "count_over_time(up[1m]) >= 3 and up == 1")
                if len(up) == 2:
                    break
            except (requests.RequestException, ValueError):
                pass
            assert time.monotonic() < deadline, "prometheus did not scrape both targets"
            time.sleep(0.5)
        dash = json.loads(DASHBOARD.read_text())
        empty = [f"{ref}: {expr}" for ref, expr in dashboard_queries(dash)
                 if not prom_query(base, concrete(expr))]
        assert not empty, f"dashboard queries without data: {empty}"
        # the node variable picks the node: its agent's series, and none of another
        ((_, by_status),) = [(r, e) for r, e in dashboard_queries(dash) if r == "1A"]
        assert prom_query(base, concrete(by_status, {**ALL, "$node": "node-a"}))
        assert not prom_query(base, concrete(by_status, {**ALL, "$node": "node-b"}))
        # "Top LB IPs at risk" lists the LB IPs at risk, not those with an informational
        # note (10.0.1.101: pod-to-lb-masqueraded, i.e. safe)
        (top,) = [p for p in json.loads(DASHBOARD.read_text())["panels"]
                  if p["title"].startswith("Top LB IPs at risk")]
        rows = prom_query(base, concrete(top["targets"][0]["expr"]))
        assert {(r["metric"]["lb_ip"], r["metric"]["severity"]) for r in rows} == \
            {("10.0.1.100", "critical")}
        # the collector's last-seen series carries the verdict's node, not the target's
        seen = prom_query(base, "loopback_collector_node_last_seen_timestamp_seconds")
        assert [s["metric"]["node"] for s in seen] == ["node-a"]
        # the rules were evaluated, none failed; at-risk is pending (for: 15m), not firing
        while True:
            groups = requests.get(f"{base}/api/v1/rules", timeout=10).json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            if all(r.get("lastEvaluation", "").startswith("2") for r in rules):
                break
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert {r["name"]: r["health"] for r in rules} == dict.fromkeys(ALERTS, "ok")
        states = {r["name"]: r["state"] for r in rules}
        assert states["LoopbackAgentNodeAtRisk"] == "pending"
        # the rest is quiet: the agent and the collector are up, their jobs match the
        # selectors (else LoopbackAgentAbsent and LoopbackAgentCollectorDown would pend)
        assert {n for n, st in states.items() if st != "inactive"} == {"LoopbackAgentNodeAtRisk"}
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        collector.stop()
        if daemon._server:
            daemon._server.shutdown()
            daemon._server.server_close()
