"""Capture findings per cause, not per port: a burst to every NodePort of the range is
one finding per (finding id, LB IP or source address) with a bounded NodePort table.

The captures here come from the real HandshakeTable fed with SYNs (the netns burst in
tests/test_capture_netns.py does the same through the kernel)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest

from agent.bundle import load_bundle
from agent.capture.handshakes import HandshakeTable
from agent.capture.model import (
    BYPASSED,
    SRC_LOCAL,
    SRC_OTHER,
    SRC_POD,
    UNANSWERED,
    CaptureResult,
    FailedHandshakes,
    NodePortStats,
)
from agent.capture.packets import ip_int
from agent.cli import schema_text
from agent.diagnose import diagnose
from agent.diagnose.model import Verdict
from agent.diagnose.rules.observed import MAX_RANGES, TOP_PORTS, port_ranges
from agent.report import render
from agent.snapshot import NodeSnapshot

TKE = Path(__file__).parent / "data" / "bundles" / "tke-etp-local"
VIP, VIP2, NODE, POD, OTHER = "10.0.1.100", "10.0.1.101", "10.0.0.10", "172.16.1.2", "10.9.9.9"
CLASSES = {VIP: SRC_LOCAL, VIP2: SRC_LOCAL, POD: SRC_POD}
SYN = 0x02
RANGE = range(30000, 32768)


@pytest.fixture(scope="module")
def tke() -> NodeSnapshot:
    return load_bundle(TKE)


def captured(syns: list[tuple[str, int]], at: float = 0.0) -> CaptureResult:
    """Each (source, NodePort) SYN is dropped (no reply): unanswered after the timeout."""
    t = HandshakeTable(lambda ip: CLASSES.get(ip, SRC_OTHER))
    for i, (src, port) in enumerate(syns):
        t.packet(at + i * 0.001, 2, 0, ip_int(src), ip_int(NODE), 1024 + i % 60000, port,
                 SYN)
    t.expire(at + 100.0)
    ports = t.finish(at + 100.0)
    return CaptureResult(30.0, (30000, 32767), ports=ports, failures=t.failures(1.7e9))


def verdict(snap: NodeSnapshot, cap: CaptureResult) -> dict:
    v = diagnose(snap, "n", capture=cap).to_dict("all")
    jsonschema.validate(v, json.loads(schema_text()))
    return v


def of(v: dict, fid: str) -> list[dict]:
    return [f for f in v["findings"] if f["id"] == fid]


def test_port_ranges_are_compact() -> None:
    assert port_ranges([30002, 30000, 30001, 30080, 30082, 30081, 31000]) == [
        "30000-30002", "30080-30082", "31000"]
    assert port_ranges(list(RANGE)) == ["30000-32767"]
    assert port_ranges([]) == []


def test_a_burst_to_the_whole_range_is_one_finding(tke: NodeSnapshot) -> None:
    v = verdict(tke, captured([(VIP, p) for p in RANGE]))
    (hc,) = of(v, "healthcheck-dropped-local-source")
    assert len(v["findings"]) < 10  # was 2768 + the static ones
    assert hc["port"] is None and hc["lb_ip"] == VIP  # the source is a known LB IP
    assert hc["summary"].startswith("2768 SYNs to 2768 NodePorts (30000-32767) came "
                                    f"from {VIP}")
    d = hc["data"]
    assert (d["nodeports"], d["syns"], d["unanswered"], d["bypassed"]) == (2768, 2768,
                                                                           2768, 0)
    assert d["port_ranges"] == ["30000-32767"] and d["ports_not_in_ranges"] == 0
    assert len(d["ports"]) == TOP_PORTS and d["ports_more"] == 2768 - TOP_PORTS
    assert d["source"] == VIP
    # the first and the last SYN of the burst, in wall-clock time
    assert d["first_seen"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(1.7e9))
    assert d["last_seen"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(1.7e9 + 2.767))
    # ports of a known Service first among equals
    svc_ports = {p["node_port"] for p in d["ports"] if p["service"]}
    assert svc_ports and all(p["syns"] == 1 for p in d["ports"])
    # the verdict stays small: the capture summary lists a bounded number of ports
    assert len(json.dumps(v)) < 30_000
    assert len(v["capture"]["ports"]) == 50 and v["capture"]["ports_more"] == 2768 - 50
    assert v["capture"]["syns"] == 2768 and v["capture"]["syns_more"] == 2768 - 50


def test_one_finding_per_source_address_and_per_lb_ip(tke: NodeSnapshot) -> None:
    syns = [(VIP, p) for p in range(30000, 30100)] + [(VIP2, 31000)] * 3 \
        + [(POD, 30080)] * 4 + [(OTHER, 30081), (OTHER, 31500)]
    v = verdict(tke, captured(syns))
    hc = {f["data"]["source"]: f for f in of(v, "healthcheck-dropped-local-source")}
    assert set(hc) == {VIP, VIP2}
    assert hc[VIP]["data"]["nodeports"] == 100 and hc[VIP]["data"]["syns"] == 100
    assert hc[VIP2]["data"]["nodeports"] == 1 and hc[VIP2]["port"] == 31000
    assert hc[VIP2]["summary"].startswith("3 SYNs to NodePort 31000 came from 10.0.1.101")
    # the pod's SYNs went unanswered: loopback observed, under the port's Service LB IP
    (loop,) = of(v, "loopback-observed")
    assert loop["port"] == 30080 and loop["data"]["unanswered"] == 4
    unanswered = of(v, "nodeport-syn-unanswered")
    assert sum(f["data"]["syns"] for f in unanswered) == 2
    assert len({f["lb_ip"] for f in unanswered}) == len(unanswered)


def test_the_table_is_bounded_when_ports_are_scattered(tke: NodeSnapshot) -> None:
    ports = list(range(30000, 32768, 2))  # 1384 ranges of one port
    v = verdict(tke, captured([(VIP, p) for p in ports]))
    (hc,) = of(v, "healthcheck-dropped-local-source")
    d = hc["data"]
    assert len(d["port_ranges"]) == MAX_RANGES
    assert d["ports_not_in_ranges"] == len(ports) - MAX_RANGES
    assert len(json.dumps(hc)) < 8000


def test_counts_and_times_per_port(tke: NodeSnapshot) -> None:
    cap = CaptureResult(
        10.0, (30000, 32767),
        ports=(NodePortStats(30080, syns=5, counts={BYPASSED: {SRC_POD: 3},
                                                     UNANSWERED: {SRC_POD: 2}}),
               NodePortStats(30081, syns=1, counts={BYPASSED: {SRC_POD: 1}})),
        failures=(FailedHandshakes(30080, SRC_POD, BYPASSED, None, 3, 1.7e9 + 5, 1.7e9 + 9),
                  FailedHandshakes(30080, SRC_POD, UNANSWERED, None, 2, 1.7e9 + 1,
                                   1.7e9 + 2),
                  FailedHandshakes(30081, SRC_POD, BYPASSED, None, 1, 1.7e9 + 60,
                                   1.7e9 + 60)))
    v = verdict(tke, cap)
    loops = of(v, "loopback-observed")
    rows = {p["node_port"]: p for f in loops for p in f["data"]["ports"]}
    assert rows[30080]["syns"] == 5 and rows[30080]["bypassed"] == 3
    assert rows[30080]["first_seen"] == "2023-11-14T22:13:21Z"
    assert rows[30080]["last_seen"] == "2023-11-14T22:13:29Z"
    assert rows[30081]["first_seen"] == "2023-11-14T22:14:20Z"


def test_report_shows_top_ports_and_how_many_more(tke: NodeSnapshot) -> None:
    v = diagnose(tke, "n", capture=captured([(VIP, p) for p in RANGE]))
    text = render(v)
    assert len(text.splitlines()) < 150, text  # was 2 lines per NodePort and finding
    assert "30000-32767" in text and "30080  default/web" in text
    assert "2758 more NodePorts" in text
    assert text.count("healthcheck-dropped-local-source") == 1
    # and the same from the stored document
    back = Verdict.from_dict(v.to_dict("all"))
    assert back.to_dict("all") == v.to_dict("all")
    assert render(back) == text


def test_failures_in_the_table_are_bounded() -> None:
    from agent.capture import handshakes

    t = HandshakeTable(lambda ip: SRC_LOCAL, port_range=(0, 65535))
    old = handshakes.FAIL_CELLS
    handshakes.FAIL_CELLS = 100
    try:
        for i in range(300):
            t.packet(0.0, 2, 0, ip_int(f"10.1.{i // 200}.{i % 200 + 1}"), ip_int(NODE),
                     40000, 1000 + i, SYN)
        t.expire(10.0)
    finally:
        handshakes.FAIL_CELLS = old
    got = t.failures()
    assert len(got) == 101 and t.failure_cells_folded == 200
    assert sum(f.count for f in got) == 300
    assert [f.count for f in got if f.node_port == 0] == [200]


def test_collector_summary_and_page_of_a_burst_stay_small(tke: NodeSnapshot) -> None:
    """The fleet views read the summary: a burst is one row per cause, not per port."""
    from agent.collector import browse
    from agent.collector.intake import Intake
    from agent.collector.store import Store
    from agent.collector.summary import summarize

    v = diagnose(tke, "n", capture=captured([(VIP, p) for p in RANGE])).to_dict("all")
    assert Intake().verdicts(json.dumps(v).encode())  # schema-valid, within the body bound
    s = summarize(v)
    assert s.status == "loopback" and s.findings <= 3
    hc = [r for r in s.rows if r.finding_id == "healthcheck-dropped-local-source"]
    assert [(r.lb_ip, r.observed) for r in hc] == [(VIP, True)]
    store = Store(":memory:")
    store.add([{**v, "idempotency_key": "k"}])
    page = browse.fleet_page(store, browse.FleetView.of({}))
    # once in the node's row and once as the fleet's filter by it: not once per port
    assert page.count(">healthcheck-dropped-local-source<") == 2


def test_metrics_count_findings_not_per_port_series(
        tke: NodeSnapshot) -> None:
    from prometheus_client import generate_latest

    from agent.daemon import Metrics

    m = Metrics()
    m.verdict(diagnose(tke, "n", capture=captured([(VIP, p) for p in RANGE])))
    text = generate_latest(m.registry).decode()
    assert ('loopback_agent_findings{id="healthcheck-dropped-local-source",'
            'severity="critical"} 1.0') in text
    assert "30080" not in text and len(text.splitlines()) < 150


def test_many_local_sources_are_bounded_findings(tke: NodeSnapshot) -> None:
    """An IPVS node holds every LB VIP: 300 VIPs health-checking their own NodePort are
    300 causes; the verdict keeps the 19 biggest and merges the rest into one."""
    from agent.diagnose.rules.observed import MAX_PER_ID

    vips = [f"10.2.{i // 200}.{i % 200 + 1}" for i in range(300)]
    CLASSES.update(dict.fromkeys(vips, SRC_LOCAL))
    try:
        syns = [(vip, 30000 + i) for i, vip in enumerate(vips)] + [(vips[0], 30000)] * 4
        v = verdict(tke, captured(syns))
    finally:
        for vip in vips:
            CLASSES.pop(vip)
    hc = of(v, "healthcheck-dropped-local-source")
    assert len(hc) == MAX_PER_ID
    by_source = {f["data"]["source"]: f for f in hc}
    assert by_source[vips[0]]["data"]["syns"] == 5
    merged = [f for f in hc if f["data"].get("merged")]
    (m,) = merged
    assert m["data"]["merged"] == 300 - (MAX_PER_ID - 1)
    assert m["data"]["nodeports"] == m["data"]["syns"] == 300 - (MAX_PER_ID - 1)
    assert m["summary"].startswith(f"{m['data']['syns']} SYNs to {m['data']['nodeports']} "
                                   "NodePorts") and "281 addresses local" in m["summary"]
    assert sum(f["data"]["syns"] for f in hc) == 304
    assert len(json.dumps(v)) < 80_000
