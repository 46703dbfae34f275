"""The verdict contract (issue 32): one verdict says the same thing everywhere it is read,
an honest "unknown" included, and its document's size follows the problems, not the
Services.

Three real verdicts, one per status: the TKE bundle (at risk: 10.0.1.100 loops), the same
bundle with that Service's eTP=Local entry removed (healthy), and a pasted `kubectl
describe svc` of an AWS load balancer known only by its hostname, no rules (unknown: the
mode is not in the input; kubernetes#80579). Each goes through the human report, the exit
code, `--json`, `--npd`, the Node condition, the agent's metrics, a real collector
process (its API, page and metrics) and the kubectl plugin's `nodes` table.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import requests

from agent.bundle import load_bundle
from agent.cli import EXIT_BY_STATUS, schema_text
from agent.diagnose import diagnose
from agent.diagnose.model import FULL_PER_ID, Verdict
from agent.kubereport.condition import NPD_NONOK, NPD_OK, NPD_UNKNOWN, condition_of, npd_result
from agent.report import render
from agent.verdict_doc import compact_targets, expand_targets, status_of_doc
from lab.kube_proxy_rules.realistic import realistic
from lab.kube_proxy_rules.synthetic import synthetic
from tests.test_collector import Proc
from tests.test_monitoring import agent_exposition, samples

DATA = Path(__file__).parent / "data"
TKE = DATA / "bundles" / "tke-etp-local"
AWS = DATA / "realworld" / "k8s-issue-80579-describe-svc-aws-lb-hostname-only"
CONDITION = {"healthy": "False", "unknown": "Unknown", "at-risk": "True", "loopback": "True"}
NPD = {"healthy": NPD_OK, "unknown": NPD_UNKNOWN, "at-risk": NPD_NONOK, "loopback": NPD_NONOK}
HEADLINE = {"healthy": "HEALTHY", "unknown": "UNKNOWN", "at-risk": "AT RISK"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    healthy = tmp_path_factory.mktemp("healthy")
    for f in TKE.iterdir():
        shutil.copy(f, healthy / f.name)
    ipset = (healthy / "ipset.txt").read_text().replace(
        "add KUBE-LOAD-BALANCER-LOCAL 10.0.1.100,tcp:80 comment \"default/web:http\"\n", "")
    (healthy / "ipset.txt").write_text(ipset)
    aws = tmp_path_factory.mktemp("aws")
    shutil.copy(AWS / "paste.txt", aws / "paste.txt")
    return {"at-risk": TKE, "healthy": healthy, "unknown": aws / "paste.txt"}


@pytest.mark.parametrize("status", ["healthy", "unknown", "at-risk"])
def test_one_verdict_says_the_same_everywhere(status: str, inputs: dict[str, Path],
                                              tmp_path: Path) -> None:
    src = str(inputs[status])
    # the command: its JSON, its report, its exit code, its NPD line
    as_json = run("check", "--from", src, "--json", "--node-name", f"node-{status}")
    doc = json.loads(as_json.stdout)
    jsonschema.validate(doc, json.loads(schema_text()))
    assert doc["status"] == status, doc["findings"]
    assert as_json.returncode == EXIT_BY_STATUS[status]
    report = run("check", "--from", src)
    assert report.returncode == EXIT_BY_STATUS[status]
    assert report.stdout.splitlines()[1].startswith(HEADLINE[status] + ":"), report.stdout
    npd = run("check", "--from", src, "--npd")
    assert npd.returncode == NPD[status], npd.stdout
    # the typed verdict: the Node condition, NPD's result, the agent's metrics
    v = Verdict.from_dict(doc)
    assert v.status == status
    assert condition_of(v).status == CONDITION[status]
    assert npd_result(v)[0] == NPD[status]
    gauges = {lb["status"]: x for n, lb, x in samples(agent_exposition(v))
              if n == "loopback_agent_status"}
    assert gauges == {s: float(s == status) for s in ("healthy", "unknown", "at-risk",
                                                      "loopback")}
    # a real collector: its API, its page, its metrics
    col = Proc(tmp_path / "c.db")
    try:
        r = requests.post(col.url + "/v1/verdicts", json={**doc, "idempotency_key": "k"},
                          timeout=30)
        assert r.status_code == 200, r.text
        (node,) = requests.get(col.url + "/v1/nodes", timeout=10).json()
        assert node["status"] == status
        page = requests.get(col.url + "/", timeout=10).text
        assert f'<td class="{status}"><b>{status}</b></td>' in page
        assert re.search(rf'<a class="pill {status}"[^>]*>{status}: 1</a>', page), page
        metrics = requests.get(col.url + "/metrics", timeout=10).text
        counts = {lb["status"]: x for n, lb, x in samples(metrics)
                  if n == "loopback_collector_nodes"}
        assert counts[status] == 1.0 and sum(counts.values()) == 1.0
        # the kubectl plugin's table, from the same collector
        table = subprocess.run([sys.executable, "-m", "agent.kubectl_plugin", "nodes",
                                "--collector", col.url], capture_output=True, text=True,
                               timeout=60)
        assert table.returncode == 0, table.stderr
        row = table.stdout.splitlines()[1].split()
        assert row[:2] == [f"node-{status}", status]
    finally:
        col.stop()


def test_a_v1_verdict_of_an_older_agent_is_read_as_v2_says_it(tmp_path: Path) -> None:
    """A fleet upgrades node by node: the collector holds v1 and v2 documents at once, and
    a v1 document whose only serious finding is undecided (v1 said "at-risk") or whose
    mode is unknown (v1 said "healthy") is shown as "unknown", as a v2 agent would say."""
    undecided = json.loads((DATA / "verdicts" / "v1-undecided-only.json").read_text())
    at_risk = json.loads((DATA / "verdicts" / "v1-at-risk.json").read_text())
    assert undecided["schema"] == at_risk["schema"] == "loopback-agent/verdict/v1"
    assert undecided["status"] == "at-risk"
    assert status_of_doc(undecided) == "unknown" and status_of_doc(at_risk) == "at-risk"
    col = Proc(tmp_path / "c.db")
    try:
        new = json.loads(run("check", "--from", str(TKE), "--json", "--node-name",
                             "new-node").stdout)
        for i, doc in enumerate((undecided, at_risk, new)):
            r = requests.post(col.url + "/v1/verdicts",
                              json={**doc, "idempotency_key": str(i)},
                              timeout=30)
            assert r.status_code == 200, r.text
        nodes = {n["node"]: n for n in
                 requests.get(col.url + "/v1/nodes", timeout=10).json()}
        assert {k: n["status"] for k, n in nodes.items()} == {
            undecided["node"]: "unknown", at_risk["node"]: "at-risk", "new-node": "at-risk"}
        # a v2 summary counts its LB IPs without listing them: the same count as v1's list
        assert nodes["new-node"]["lb_ips"] == nodes[at_risk["node"]]["lb_ips"] == 2
        services = requests.get(col.url + "/v1/services", timeout=10).json()
        web = [s for s in services if s["lb_ip"] == "10.0.1.100"]
        assert web and set(web[0]["exposed_nodes"]) == {at_risk["node"], "new-node"}
        page = requests.get(col.url + "/", timeout=10).text
        assert re.search(r'<a class="pill unknown"[^>]*>unknown: 1</a>', page), page
        assert re.search(r'<a class="pill at-risk"[^>]*>at-risk: 2</a>', page), page
    finally:
        col.stop()


def test_compact_targets_round_trip() -> None:
    targets = [("10.64.0.7", 80, "TCP"), ("10.64.0.29", 80, "TCP"), ("10.64.1.5", 80, "TCP"),
               ("2001:db8::1", 80, "TCP"), ("10.64.0.7", 443, "TCP"), ("9.9.9.9", None, None),
               ("10.64.0.7", 80, "TCP")]  # a repeat is listed once
    lines = compact_targets(targets)
    assert lines == ["-/- 9.9.9.9", "TCP/443 10.64.0.7",
                     "TCP/80 10.64.0.{7,29} 10.64.1.5 2001:db8::1"]
    assert sorted(expand_targets(lines)) == sorted({
        ("10.64.0.7", "TCP/80"), ("10.64.0.29", "TCP/80"), ("10.64.1.5", "TCP/80"),
        ("2001:db8::1", "TCP/80"), ("10.64.0.7", "TCP/443"), ("9.9.9.9", "-/-")})


def _bundle(tmp_path: Path, n: int, mode: str) -> Verdict:
    for name, text in synthetic(n, mode).items():
        (tmp_path / name).write_text(text)
    return diagnose(load_bundle(str(tmp_path)), "big")


def test_a_healthy_nodes_summary_counts_its_lb_ips_by_shape(tmp_path: Path) -> None:
    """2,000 LB IPs served inside the node: a summary of a few groups, each with one
    example's evidence, every address in its group's compact targets; --all itemises."""
    v = _bundle(tmp_path, 2000, "iptables")
    assert v.status == "healthy"
    doc = v.to_dict()
    full = v.to_dict("all")
    assert len(json.dumps(doc)) < len(json.dumps(full)) / 20
    assert doc["findings"] == [] and doc["detail"] == "summary"
    fine = {(g["id"], ip, where) for g in doc["ok"] for ip, where in expand_targets(g["targets"])}
    want = {(f["id"], f["lb_ip"], f"{f['protocol']}/{f['port']}") for f in full["findings"]}
    assert fine == want  # every fine LB IP is counted, none twice
    assert sum(g["count"] for g in doc["ok"]) == len(full["findings"])
    # kube-proxy writes the same chains for every Service: a few shapes, not thousands
    assert len(doc["ok"]) <= 10, [(g["id"], g["count"]) for g in doc["ok"]]
    for g in doc["ok"]:
        assert g["example"]["evidence"] and g["example"]["shape"] == g["shape"]
    assert doc["lb_ip_counts"]["total"] == len(v.lb_ips) and doc["lb_ips"] == []


def test_an_exposed_node_names_every_lb_ip_and_abridges_the_evidence(tmp_path: Path) -> None:
    """Every not-masqueraded LB IP is named (address, port, Service, id, shape); the first
    FULL_PER_ID of an id carry their evidence, the rest refer to their shape's example."""
    # a real-shaped IPVS node: half its VIPs not bound on kube-ipvs0 (TKE), and those
    # outside ip-masq-agent's ranges leave unmasqueraded
    for name, body in realistic(400, "ipvs").items():
        (tmp_path / name).write_text(body)
    v = diagnose(load_bundle(str(tmp_path)), "big")
    exposed = [f for f in v.findings if f.id == "pod-to-lb-not-masqueraded"]
    if len(exposed) <= FULL_PER_ID:
        pytest.fail(f"only {len(exposed)} exposed LB IPs: the lab's rules changed")
    doc = v.to_dict()
    jsonschema.validate(doc, json.loads(schema_text()))
    named = [f for f in doc["findings"] if f["id"] == "pod-to-lb-not-masqueraded"]
    assert [(f["lb_ip"], f["port"]) for f in named] == [(f.lb_ip, f.port) for f in exposed]
    in_full = [f for f in named if not f.get("abridged")]
    assert len(in_full) == FULL_PER_ID and all(f["evidence"] for f in in_full)
    shapes = {(s["id"], s["shape"]): s for s in doc["shapes"]}
    for f in named[FULL_PER_ID:]:
        assert f["abridged"] is True and "evidence" not in f and f["service"]
        example = shapes[(f["id"], f["shape"])]["example"]
        assert example["evidence"] and example["id"] == f["id"]
    assert sum(s["abridged"] for s in doc["shapes"]) == doc["abridged"] >= len(named) - 20
    # read back (what a collector stored): the abridged ones with their shape's evidence
    back = Verdict.from_dict(doc)
    assert [(f.lb_ip, f.port) for f in back.findings if f.id == exposed[0].id] == \
        [(f.lb_ip, f.port) for f in exposed]


def test_check_lb_ip_gives_one_address_in_full(tmp_path: Path) -> None:
    r = run("check", "--from", str(TKE), "--json", "--lb-ip", "10.0.1.101")
    assert r.returncode == EXIT_BY_STATUS["healthy"], r.stdout  # this address is fine
    doc = json.loads(r.stdout)
    assert doc["detail"] == "lb_ip" and doc["status"] == "healthy"
    assert {f["lb_ip"] for f in doc["findings"]} <= {"10.0.1.101", None}
    assert any(f["id"] == "pod-to-lb-masqueraded" and f["evidence"] for f in doc["findings"])
    assert [r["ip"] for r in doc["lb_ips"]] == ["10.0.1.101"]
    r = run("check", "--from", str(TKE), "--lb-ip", "10.0.1.100")
    assert r.returncode == EXIT_BY_STATUS["at-risk"] and "10.0.1.100" in r.stdout
    r = run("check", "--from", str(TKE), "--lb-ip", "192.0.2.99")
    assert r.returncode == 64 and "not an address this node knows" in r.stderr
    r = run("check", "--from", str(TKE), "--lb-ip", "not-an-ip")
    assert r.returncode == 64 and "not an IP address" in r.stderr


def test_report_says_unknown_not_at_risk(inputs: dict[str, Path]) -> None:
    from agent.bundle import load_texts
    from agent.bundle.sections import name_format

    p = inputs["unknown"]
    v = diagnose(load_texts([(p.name, p.read_text(), name_format(p.name))],
                            origin="bundle:p"), "n")
    text = render(v)
    assert v.status == "unknown" and "UNKNOWN: no exposure found" in text
    assert "AT RISK" not in text and "HEALTHY" not in text


def test_a_50k_service_nodes_verdict_is_spooled_shipped_and_shown(tmp_path: Path) -> None:
    """v1's 50k-service verdict passed the collector's 64 MiB inflated limit and was never
    shipped: the node vanished from the page. The summary is spooled, shipped and shown."""
    from agent.ship.sender import Sender, drain
    from agent.ship.spool import Spool

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for name, text in synthetic(50_000, "iptables").items():
        (bundle / name).write_text(text)
    r = run("check", "--from", str(bundle), "--json", "--node-name", "node-50k")
    assert r.returncode in (0, 1, 3), r.stderr
    assert len(r.stdout) < 1_000_000, len(r.stdout)
    doc = json.loads(r.stdout)
    assert doc["lb_ip_counts"]["total"] == 50_000
    assert sum(g["count"] for g in doc["ok"]) >= 50_000
    col = Proc(tmp_path / "c.db")
    try:
        spool = Spool(tmp_path / "spool")
        spool.put({**doc, "idempotency_key": "big-1"})
        res = drain(spool, Sender(col.url, timeout=60))
        assert res.sent == 1 and len(spool) == 0, res
        (node,) = requests.get(col.url + "/v1/nodes", timeout=10).json()
        assert (node["node"], node["status"], node["lb_ips"]) == (
            "node-50k", doc["status"], 50_000)
        page = requests.get(col.url + "/", timeout=10).text
        assert '<td><a href="/nodes/node-50k">node-50k</a></td>' in page
    finally:
        col.stop()


def test_unknowns_of_one_source_are_counted_past_twenty() -> None:
    """A 50k-Service nftables node without NodePorts for some eTP=Local Services had an
    unknown per LB IP: 790 KB of a summary. The first 20 of a source are listed, the rest
    counted; --all lists every one."""
    from dataclasses import replace

    from agent.snapshot import Unknown

    v = diagnose(load_bundle(str(TKE)), "n")
    many = tuple(Unknown("etp-local-no-local-endpoint", f"10.64.0.{i}:80: the NodePort is "
                                                          "unknown") for i in range(50))
    had = sum(1 for u in v.unknowns if u.source == "etp-local-no-local-endpoint")
    v = replace(v, unknowns=(*v.unknowns, *many))
    doc = v.to_dict()
    jsonschema.validate(doc, json.loads(schema_text()))
    listed = [u for u in doc["unknowns"] if u["source"] == "etp-local-no-local-endpoint"]
    assert len(listed) == 20
    assert doc["unknowns_more"] == {"etp-local-no-local-endpoint": had + 50 - 20}
    assert len(v.to_dict("all")["unknowns"]) == len(v.unknowns)
