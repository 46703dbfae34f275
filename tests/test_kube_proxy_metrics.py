"""kube-proxy's sync health from its metrics (issue 33, item 3): the probe reads its
:10249/metrics live, a bundle keeps the page with the time it was read, a paste of
`curl ... | grep` reads too, and a kube-proxy whose queued change waits longer than its
own health check allows is a finding.

The live tests run a real HTTP server inside a lab node's network namespace, on
127.0.0.1:10249 as kube-proxy's metrics server listens; its pages are constructed (the
metric names and label as kube-proxy v1.30+ prints them, pkg/proxy/metrics/metrics.go),
times relative to now. A server that answers half a page and waits, and a port nobody
listens on, cost the check a bounded time and an unknown, never a hang.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose
from agent.diagnose.rules.consistency import SYNC_FAILURES, SYNC_STALE
from agent.parse.kube_proxy_metrics import read_metrics
from lab.netns import Netns
from lab.node import build_lab
from lab.scenarios import SCENARIOS
from tests.nodestate import capture

_Q = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"
_S = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
_F = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"


def page(now: float, queued_ago: float, synced_ago: float, failures: int = 0) -> str:
    fam = '{ip_family="IPv4"}'
    return "\n".join([
        f"# HELP {_Q} [ALPHA] The last time a sync of proxy rules was queued",
        f"# TYPE {_Q} gauge",
        f"{_Q}{fam} {now - queued_ago:.9e}",
        f"# HELP {_S} [ALPHA] The last time proxy rules were successfully synced",
        f"# TYPE {_S} gauge",
        f"{_S}{fam} {now - synced_ago:.9e}",
        f"# HELP {_F} [ALPHA] Cumulative proxy iptables restore failures",
        f"# TYPE {_F} counter",
        f"{_F}{fam} {failures}",
        "process_open_fds 23", ""])


# The page says the change was queued 30 min before it was written; the agent reads it a few
# seconds to (on a loaded machine) a few minutes later.
_HALF_AN_HOUR = range(30, 34)


def waited(finding: dict[str, Any]) -> int:
    """The minutes a stale finding's evidence says the queued change had waited."""
    found = [int(m.group(1)) for e in finding["evidence"]
             if (m := re.search(r"had waited (\d+) min", e))]
    assert len(found) == 1, finding["evidence"]
    return found[0]


def ids_of(v: dict[str, Any]) -> set[str]:
    return {f["id"] for f in v["findings"]}


def test_the_metrics_read_as_kube_proxy_prints_them() -> None:
    sync, problems = read_metrics(page(1000.0, 30, 10, 2).splitlines(), "p")
    assert problems == []
    assert sync is not None
    assert sync.last_queued == (("IPv4", 970.0),) and sync.last_sync == (("IPv4", 990.0),)
    assert sync.failures == (("IPv4", 2.0),) and sync.read_at is None
    # before v1.30: no family label; a value that is no number is a problem by its line
    bad = ["kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7592264021e+09",
           "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds NaN",
           "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv6\" 5"]
    sync, problems = read_metrics(bad, "p")
    assert sync is not None and sync.last_sync == (("", 1759226402.1),)
    assert [n for n, _ in problems] == [2, 3]
    # the same grep pasted twice: its counters once, not twice; the two modes' added
    twice = page(1000.0, 30, 10, 2).splitlines() * 2 + [
        'kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family="IPv4"} 1']
    sync, _ = read_metrics(twice, "p")
    assert sync is not None and sync.failures == (("IPv4", 3.0),)


def verdict(files: list[tuple[str, str]]) -> dict[str, Any]:
    snap = load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


def test_a_pasted_grep_with_no_read_time_decides_no_staleness() -> None:
    now = time.time()
    paste = "$ curl -s http://127.0.0.1:10249/metrics | grep sync_proxy_rules\n" + \
        page(now, 3600, 7200, failures=4)
    v = verdict([("paste.txt", paste)])
    # when it was read is not in the paste: an hour-old queue may be a second old there
    assert SYNC_STALE not in ids_of(v)
    assert SYNC_FAILURES in ids_of(v)


def test_a_bundle_page_with_its_read_time() -> None:
    now = time.time()
    stale = f"# loopback-agent read-at: {now:.3f}\n" + page(now, 930, 4000)
    v = verdict([("kube-proxy-metrics.txt", stale)])
    got = [f for f in v["findings"] if f["id"] == SYNC_STALE]
    assert len(got) == 1
    assert "has not applied a change it queued at 20" in got[0]["summary"]
    assert any("the change had waited 15 min, 66 min since the last sync" in e
               for e in got[0]["evidence"]), got[0]["evidence"]
    fresh = f"# loopback-agent read-at: {now:.3f}\n" + page(now, 20, 1)
    assert SYNC_STALE not in ids_of(verdict([("kube-proxy-metrics.txt", fresh)]))
    # queued 30 s ago and not yet applied: within kube-proxy's own patience
    waiting = f"# loopback-agent read-at: {now:.3f}\n" + page(now, 30, 600)
    assert SYNC_STALE not in ids_of(verdict([("kube-proxy-metrics.txt", waiting)]))


# -- live, in a lab node's namespace -------------------------------------------------------

_SERVE = """
import http.server, sys
body = open(sys.argv[1], 'rb').read()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header('Content-Type', 'text/plain; version=0.0.4')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', 10249), H).serve_forever()
"""
# a server that answers a page's head and then holds the probe: "half" sends the start of
# a line and waits an hour, "trickle" sends the page a byte every 0.4 s (each byte within
# the socket's timeout)
_HOLD = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', 10249)); s.listen(4)
while True:
    c, _ = s.accept()
    c.recv(4096)
    c.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Length: 100000\\r\\n\\r\\nkubeproxy_sync_pro')
    if sys.argv[1] == 'half':
        time.sleep(3600)
    for _ in range(100000):
        c.sendall(b'k')
        time.sleep(0.4)
"""


@contextmanager
def serving(ns: Netns, script: str, *args: str) -> Iterator[None]:
    proc = ns.popen([sys.executable, "-c", script, *args])
    try:
        deadline = time.monotonic() + 10
        while ns.run("ss", "-Hltn", "sport = :10249").stdout.strip() == "":
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        yield
    finally:
        proc.kill()
        proc.wait()


def check_in(ns: Netns) -> tuple[dict[str, Any], float]:
    start = time.monotonic()
    r = ns.run(sys.executable, "-m", "agent", "check", "--json", "--node-name", "n",
               "--no-kube-api", check=False, timeout=120)
    assert r.returncode in (0, 1, 3), r.stderr
    return json.loads(r.stdout), time.monotonic() - start


@pytest.mark.netns
def test_live_a_kube_proxy_whose_syncs_stopped(tmp_path: Path) -> None:
    with build_lab(SCENARIOS["iptables-new-etp-local"], "legacy") as lab:
        v, _ = check_in(lab.node)  # nothing listens on :10249: not known, said
        assert SYNC_STALE not in ids_of(v)
        assert any(u["source"] == "kube-proxy metrics" and "10249" in u["reason"]
                   for u in v["unknowns"])
        body = tmp_path / "metrics"
        body.write_text(page(time.time(), 1800, 5400, failures=7))
        with serving(lab.node, _SERVE, str(body)):
            before = capture(lab.node)
            v, _ = check_in(lab.node)
            assert capture(lab.node) == before
            stale = [f for f in v["findings"] if f["id"] == SYNC_STALE]
            assert len(stale) == 1 and waited(stale[0]) in _HALF_AN_HOUR, stale[0]["evidence"]
            assert "http://127.0.0.1:10249/metrics" in stale[0]["evidence"][0]
            assert SYNC_FAILURES in ids_of(v)
            # a bundle keeps the page and when it was read: the same finding offline
            out = tmp_path / "bundle"
            r = lab.node.run(sys.executable, "-m", "agent", "bundle", str(out),
                             "--no-kube-api", check=False, timeout=120)
            assert r.returncode == 0, r.stderr
            saved = (out / "kube-proxy-metrics.txt").read_text()
            assert saved.startswith("# loopback-agent read-at: ")
        r = lab.node.run(sys.executable, "-m", "agent", "check", "--from", str(out), "--json",
                         check=False, timeout=120)
        offline = json.loads(r.stdout)
        got = [f for f in offline["findings"] if f["id"] == SYNC_STALE]
        assert len(got) == 1 and waited(got[0]) in _HALF_AN_HOUR, got[0]["evidence"]


@pytest.mark.netns
@pytest.mark.parametrize("how", ["half", "trickle"])
def test_live_a_metrics_server_that_holds_the_probe(how: str) -> None:
    with build_lab(SCENARIOS["iptables-new-etp-local"], "legacy") as lab, \
            serving(lab.node, _HOLD, how):
        v, took = check_in(lab.node)
        assert took < 30, took  # the probe's bound (5 s) and the rest of the check
        reasons = [u["reason"] for u in v["unknowns"] if u["source"] == "kube-proxy metrics"]
        # (either way the probe's own deadline ended it: the trickle would take 11 h)
        assert reasons and ("timed out" in reasons[0] or "took longer" in reasons[0]), \
            v["unknowns"]


def test_a_daemon_keeps_its_verdict_while_the_metrics_decide_the_same() -> None:
    """kube-proxy's metrics move on every read; re-walking 10k LB IPs each cycle for that
    would cost what the unchanged-node reuse saves (agent.daemon.same_node)."""
    from dataclasses import replace

    from agent.daemon import same_node

    now = time.time()

    def snap(read_at: float, queued_ago: float, failures: int = 0) -> Any:
        text = f"# loopback-agent read-at: {read_at:.3f}\n" + page(now, queued_ago, 20,
                                                                  failures)
        return load_texts([("kube-proxy-metrics.txt", text, name_format("m.txt"))],
                          origin="bundle:t")

    a = snap(now, 10)
    assert same_node(a, snap(now + 30, 10))  # read later, still within its patience
    assert not same_node(a, snap(now + 300, 10))  # now a queued change waits too long
    assert not same_node(a, snap(now + 30, 10, failures=1))  # a failed write since
    assert not same_node(a, replace(snap(now + 30, 10), node="other"))
    assert same_node(a, a)
