"""`loopback-agent run` on a lab node: JSON lines, shipping to a collector, /metrics and
/healthz, SIGTERM leaving undelivered verdicts in the spool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from agent.cli import schema_text
from lab.node import Lab, build_lab
from lab.scenarios import SCENARIOS

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces")]

# A collector stand-in inside the node's namespace: appends every POSTed body to a file.
_COLLECTOR = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
out = open(sys.argv[2], "a")
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        out.write(body.decode() + "\n"); out.flush()
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a): pass
print("ready", flush=True)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with build_lab(SCENARIOS["tke-ipvs-etp-local"], "nft") as lab:
        yield lab


def fetch(lab: Lab, url: str) -> tuple[int, str]:
    script = ("import sys, urllib.request, urllib.error\n"
              "try:\n r = urllib.request.urlopen(sys.argv[1], timeout=5)\n"
              " print(r.status); print(r.read().decode())\n"
              "except urllib.error.HTTPError as e:\n print(e.code); print(e.read().decode())\n")
    out = lab.node.run(sys.executable, "-c", script, url).stdout
    code, _, body = out.partition("\n")
    return int(code), body


def test_run_ships_verdicts_and_serves_metrics(lab: Lab, tmp_path: Path) -> None:
    received = tmp_path / "received.jsonl"
    coll = lab.node.popen([sys.executable, "-c", _COLLECTOR, "18080", str(received)],
                          stdout=subprocess.PIPE)
    assert coll.stdout is not None and coll.stdout.readline().strip() == "ready"
    agent = lab.node.popen([sys.executable, "-m", "agent", "run", "--collector",
                            "http://127.0.0.1:18080", "--spool", str(tmp_path / "spool"),
                            "--interval", "1", "--cycles", "4", "--listen", "127.0.0.1:19808",
                            "--no-kube-api", "--node-name", "lab-node"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(2.5)
        code, metrics = fetch(lab, "http://127.0.0.1:19808/metrics")
        assert code == 200
        assert 'loopback_agent_status{status="at-risk"} 1.0' in metrics
        assert 'loopback_agent_findings{id="pod-to-lb-not-masqueraded",severity="critical"}' \
            in metrics
        code, body = fetch(lab, "http://127.0.0.1:19808/healthz")
        assert (code, body.strip()) == (200, "ok")
        out, err = agent.communicate(timeout=60)
    finally:
        for p in (agent, coll):
            if p.poll() is None:
                p.kill()
    assert agent.returncode == 0, err
    schema = json.loads(schema_text())
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 4
    for v in lines:
        jsonschema.validate(v, schema)
        assert v["node"] == "lab-node" and v["status"] == "at-risk"
    # unchanged verdicts are not shipped again before the heartbeat: one arrived
    shipped = [v for line in received.read_text().splitlines() for v in json.loads(line)]
    assert len(shipped) == 1 and shipped[0]["idempotency_key"]
    assert not list((tmp_path / "spool").glob("*.json"))
    assert "Traceback" not in err


def test_sigterm_finishes_and_keeps_undelivered_verdicts(lab: Lab, tmp_path: Path) -> None:
    agent = lab.node.popen([sys.executable, "-m", "agent", "run", "--collector",
                            "http://127.0.0.1:9", "--spool", str(tmp_path / "spool"),
                            "--interval", "2", "--listen", "", "--no-kube-api"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert agent.stdout is not None
    first = agent.stdout.readline()  # the first verdict is out
    assert json.loads(first)["schema"] == "loopback-agent/verdict/v1"
    t0 = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    assert time.monotonic() - t0 < 15  # the capture stops at once; shipping gets the grace
    assert "shipping failed" in err and "left in the spool" in err
    assert len(list((tmp_path / "spool").glob("*.json"))) >= 1
