"""`check --capture` on a lab cluster with a CLB namespace: real connections that loop,
real health checks, and the verdicts they must produce."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest

from agent.capture.handshakes import DEFAULT_TIMEOUT as HANDSHAKE_TIMEOUT
from agent.cli import schema_text
from lab.clb import (
    CONNECTED,
    Cluster,
    build_cluster,
    healthcheck,
    other_node_pod_connect,
    pod_connect,
    sysctls,
)
from lab.scenarios import HEALTH_CHECK_SOURCE, LB_IP, SCENARIOS

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces")]

NODE_PORT = 30080
OBSERVED = {"loopback-observed", "healthcheck-dropped-local-source", "nodeport-syn-unanswered"}


def rp_filter(value: int) -> dict[str, int]:
    return {"net.ipv4.conf.all.rp_filter": value, "net.ipv4.conf.eth0.rp_filter": value}


def check_while(c: Cluster, drive: Callable[[], Any]) -> tuple[int, dict[str, Any], str]:
    """Run `check --capture` in node 1 while ``drive`` makes traffic: ``drive`` starts at
    the first progress line (the ring is open by then, however slow the machine: the VM
    of test_vm_ipvs emulates its CPU) and Ctrl-C ends the capture once its SYNs are
    judged."""
    proc = c.node.popen([sys.executable, "-m", "agent", "check", "--json", "--all", "--capture",
                         "120s", "--kube-json", str(c.lab.kube_dir), "--node-name", "node-1"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []
    capturing = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "capturing NodePorts" in line:
                capturing.set()

    out: list[str] = []
    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=lambda: out.append(proc.stdout.read()),  # type: ignore[union-attr]
                                daemon=True)]
    for t in readers:
        t.start()
    try:
        assert capturing.wait(60), "".join(lines)
        drive()
        # every SYN judged: answered, or unanswered after the handshake timeout (a capture
        # ended by a signal reports what is still waiting as pending)
        time.sleep(HANDSHAKE_TIMEOUT + 0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        for t in readers:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(lines)
    assert "Traceback" not in err, err
    assert "capturing NodePorts 30000-32767" in err  # the progress line
    assert "capture stopped early by a signal" in err
    verdict = json.loads(out[0])
    jsonschema.validate(verdict, json.loads(schema_text()))
    return proc.returncode, verdict, err


def observed(v: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in v["findings"] if f["id"] in OBSERVED}


@pytest.fixture(scope="module")
def etp_cluster() -> Iterator[Cluster]:
    with build_cluster(SCENARIOS["tke-ipvs-etp-cluster"], "nft") as c:
        yield c


@pytest.mark.parametrize(("rp", "outcome"), [(0, "bypassed"), (1, "unanswered")])
def test_same_node_pod_loop_is_observed(etp_local: Cluster, rp: int, outcome: str) -> None:
    c = etp_local
    c.clb.use_real_server(c.scenario.node_ip)
    with sysctls(c.node, rp_filter(rp)):
        code, v, _ = check_while(c, lambda: [pod_connect(c, LB_IP, 80, timeout=0.5)
                                             for _ in range(3)])
    assert code == 2 and v["status"] == "loopback"
    f = observed(v)["loopback-observed"]
    assert f["port"] == NODE_PORT and f["service"] == "demo/web" and f["lb_ip"] == LB_IP
    assert f"{outcome} from pod: 3" in f["evidence"][0]
    samples = [e for e in f["evidence"] if e.startswith(c.scenario.client_pod_ip)]
    assert len(samples) == 3
    if outcome == "bypassed":
        assert all("bypassed the load balancer" in s and "client reset it" in s
                   for s in samples)
    else:
        rpf = next(x for x in v["capture"]["corroboration"]
                   if x["source"] == "TcpExtIPReversePathFilter")
        assert rpf["value"] >= 3  # the node's own counter: the SYNs died in rp_filter
    assert v["capture"]["kernel_drops"] == 0


def test_healthcheck_from_a_vip_bound_here_is_observed_dropped(lb_bound: Cluster) -> None:
    c = lb_bound
    code, v, _ = check_while(c, lambda: [healthcheck(c, c.scenario.node_ip, NODE_PORT)
                                         for _ in range(3)])
    assert code == 2 and v["status"] == "loopback"
    f = observed(v)["healthcheck-dropped-local-source"]
    assert "3 SYNs" in f["summary"] and f["service"] == "demo/web"
    assert any(e.startswith(f"{LB_IP}:") and "no SYN-ACK" in e for e in f["evidence"])
    martian = next(x for x in v["capture"]["corroboration"] if x["source"] == "in_martian_src")
    assert martian["available"] and martian["value"] >= 3  # global counter: at least ours
    # the static check names the same cause
    assert "lb-ip-local" in {x["id"] for x in v["findings"]}


def test_healthcheck_from_a_non_local_source_is_healthy(etp_cluster: Cluster) -> None:
    c = etp_cluster

    def drive() -> None:
        for src in (LB_IP, HEALTH_CHECK_SOURCE):
            assert healthcheck(c, c.scenario.node_ip, NODE_PORT, source=src).outcome == \
                CONNECTED

    code, v, _ = check_while(c, drive)
    assert code == 0 and v["status"] == "healthy", v["findings"]
    assert not observed(v)
    port = next(p for p in v["capture"]["ports"] if p["node_port"] == NODE_PORT)
    assert port["counts"] == {"answered": {"lb-ip": 1, "other": 1}}


def test_pod_on_another_node_is_healthy(etp_cluster: Cluster) -> None:
    c = etp_cluster
    c.clb.use_real_server(c.scenario.node_ip)
    code, v, _ = check_while(c, lambda: other_node_pod_connect(c, LB_IP, 80))
    assert code == 0 and not observed(v)
    port = next(p for p in v["capture"]["ports"] if p["node_port"] == NODE_PORT)
    assert port["counts"] == {"answered": {"other": 1}}


def test_cluster_policy_masquerades_and_the_clb_picks_the_other_node(
        etp_cluster: Cluster) -> None:
    c = etp_cluster
    c.clb.use_real_server(c.scenario.node_ip)  # preferred, but never for its own address
    code, v, _ = check_while(c, lambda: pod_connect(c, LB_IP, 80))
    assert code == 0 and v["status"] == "healthy"
    assert not observed(v)
    assert v["capture"]["syns"] == 0  # the SYN went to node 2, not back here
    assert c.clb.picks()[c.node_ips[1]] >= 1


# From the CLB (vpc namespace): one SYN from ``src`` to every port of a range on the
# node, in batches of non-blocking connects (closed before the first retransmission:
# a socket closed in SYN-SENT sends nothing).
_BURST = r"""
import socket, sys, time
src, dst, lo, hi = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sent = 0
for start in range(lo, hi + 1, 400):
    socks = []
    for port in range(start, min(start + 400, hi + 1)):
        s = socket.socket()
        s.setblocking(False)
        s.bind((src, 0))
        s.connect_ex((dst, port))
        socks.append(s)
    time.sleep(0.3)
    for s in socks:
        s.close()
    sent += len(socks)
print(sent)
"""


def test_a_burst_to_the_whole_nodeport_range_is_one_finding(lb_bound: Cluster) -> None:
    """The CLB's VIP, bound on this node, health-checks every NodePort at once: each SYN
    is dropped as martian. One finding for the cause, with all 2768 ports inside, not
    2768 findings."""
    c = lb_bound
    sent: list[int] = []

    def drive() -> None:
        out = c.vpc.run(sys.executable, "-c", _BURST, LB_IP, c.scenario.node_ip, "30000",
                        "32767", timeout=120).stdout
        sent.append(int(out))

    code, v, _ = check_while(c, drive)
    doc = json.dumps(v)
    ids = [f["id"] for f in v["findings"]]
    print(f"burst: {len(ids)} findings ({ids.count('healthcheck-dropped-local-source')} "
          f"healthcheck-dropped-local-source), verdict {len(doc)} bytes")
    assert sent == [2768]
    assert code == 2 and v["status"] == "loopback"
    (hc,) = [f for f in v["findings"] if f["id"] == "healthcheck-dropped-local-source"]
    d = hc["data"]
    assert d["source"] == LB_IP and hc["lb_ip"] == LB_IP
    assert d["nodeports"] == 2768 and d["port_ranges"] == ["30000-32767"]
    assert d["unanswered"] + d["bypassed"] == d["syns"] >= 2768
    assert d["first_seen"] <= d["last_seen"] and d["first_seen"].startswith(v["time"][:10])
    assert len(d["ports"]) == 10 and d["ports_more"] == 2758
    assert any(p["node_port"] == NODE_PORT and p["service"] == "demo/web"
               for p in d["ports"])  # the Service's own port leads the table
    assert hc["summary"].startswith(f"{d['syns']} SYNs to 2768 NodePorts (30000-32767)")
    assert len(v["findings"]) < 10 and len(doc) < 40_000
    assert v["capture"]["kernel_drops"] == 0 and v["capture"]["syns"] >= 2768
    assert len(v["capture"]["ports"]) == 50 and v["capture"]["ports_more"] == 2718
