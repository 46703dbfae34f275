"""`make bench`: Kubernetes API requests (and bytes) per agent-hour, informer vs polling.

Both run in this process against the same real HTTP API server (tests/kube_apiserver.py)
holding SERVICES Services, one Ingress and the agent's Node, with a Service changed
every CHURN seconds:

- baseline, the old polling: ``kube_api.fetch_raw`` (LIST all Services, GET the Node,
  LIST all Ingresses) run a few times; its per-cycle counts times 60 cycles (the
  default 60 s interval) is its agent-hour;
- the informer (agent.kubewatch) run for SECONDS with a short watch timeout; its LIST
  requests happen once per start, its WATCH requests scale with 1/timeout: the
  measured watch rate is scaled to the production timeout (300 s, jittered to 300-600 s,
  450 s on average) to give an agent-hour. The bytes of the watch streams (every change
  is sent once, whatever the timeout) are counted as measured, per hour of churn.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agent.probes import kube_api
from agent.probes.base import ProbeContext
from tests.kube_apiserver import FakeKubeAPI, ingress, kubeconfig, node, service

PROD_WATCH_MEAN = 450.0  # seconds: timeoutSeconds 300 * (1 + U[0,1)) on average
POLL_INTERVAL = 60.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--watch-timeout", type=float, default=2.0)
    ap.add_argument("--churn", type=float, default=1.0, help="seconds between changes")
    ap.add_argument("--poll-cycles", type=int, default=3)
    a = ap.parse_args()

    with FakeKubeAPI(bookmark_every=a.watch_timeout / 2) as api, \
            tempfile.TemporaryDirectory() as tmp:
        for i in range(a.services):
            api.put("services", service(f"svc{i}", f"10.{i // 65536 % 256}.{i // 256 % 256}."
                                        f"{i % 256}", node_port=30000 + i % 2768))
        api.put("nodes", node("n1"))
        api.put("ingresses", ingress("web", "203.0.113.9", "svc1"))
        ctx = ProbeContext(node_name="n1", kubeconfig=kubeconfig(f"{tmp}/kc", api.url),
                           timeout=60)

        # -- baseline: the polling the daemon did every cycle ------------------------------
        n0, t0 = len(api.log), time.monotonic()
        for _ in range(a.poll_cycles):
            responses = kube_api.fetch_raw(ctx)
            assert all(r.error is None for r in responses), responses
        poll_log = api.log[n0:]
        poll_secs = (time.monotonic() - t0) / a.poll_cycles
        poll_req = len(poll_log) / a.poll_cycles
        poll_bytes = sum(r.sent for r in poll_log) / a.poll_cycles
        cycles_per_hour = 3600 / POLL_INTERVAL

        # -- the informer ------------------------------------------------------------------
        n0, stream0, t0 = len(api.log), api.stream_bytes, time.monotonic()
        inf = kube_api.start_informer(ctx, watch_timeout=a.watch_timeout)
        assert inf.wait_synced(120), "informer did not sync"
        synced = time.monotonic()
        rng = random.Random(7)
        changes = 0
        while time.monotonic() < synced + a.seconds:
            i = rng.randrange(a.services)
            api.put("services", service(f"svc{i}", f"192.0.2.{changes % 250 + 1}",
                                        node_port=30000 + i % 2768))
            changes += 1
            time.sleep(a.churn)
        elapsed = time.monotonic() - synced
        time.sleep(0.5)
        inf.stop()
        log = api.log[n0:]
        lists = [r for r in log if not r.watch]
        watches = [r for r in log if r.watch]
        list_bytes = sum(r.sent for r in lists)
        stream_bytes = api.stream_bytes - stream0
        got = {s.name: s for s in inf.read()[0][0]}
        assert len(got) == a.services, len(got)

    watch_rate = len(watches) / elapsed  # per second, at the bench's timeout
    # the informer asks for timeoutSeconds = int(timeout * (1 + U[0,1))): its mean here
    bench_mean = sum(max(1, int(a.watch_timeout * (1 + k / 1000))) for k in range(1000)) / 1000
    watches_hour = watch_rate * bench_mean / PROD_WATCH_MEAN * 3600
    stream_hour = stream_bytes / elapsed * 3600
    inf_hour = len(lists) + watches_hour
    poll_hour = poll_req * cycles_per_hour
    mib = 1 / 2**20
    print(f"api_requests: {a.services} Services, 1 Ingress, 1 Node; a Service changed every "
          f"{a.churn:g} s")
    print(f"  polling (baseline, {POLL_INTERVAL:.0f} s interval): {poll_req:.0f} requests/"
          f"cycle, {poll_bytes * mib:.1f} MiB/cycle, {poll_secs:.2f} s/cycle -> "
          f"{poll_hour:.0f} requests and {poll_bytes * cycles_per_hour * mib:.0f} MiB "
          f"per agent-hour")
    print(f"  informer, measured over {elapsed:.0f} s (watch timeout {a.watch_timeout:g} s):"
          f" {len(lists)} LIST requests ({list_bytes * mib:.1f} MiB, once), "
          f"{len(watches)} WATCH requests, {stream_bytes / 1024:.0f} KiB streamed for "
          f"{changes} changes")
    print(f"  informer per agent-hour (watch timeout 300-600 s): {len(lists)} LIST (start) + "
          f"{watches_hour:.0f} WATCH = {inf_hour:.0f} requests; "
          f"{list_bytes * mib:.1f} MiB once + {stream_hour * mib:.1f} MiB streamed "
          f"at this churn")
    print(f"  ratio polling/informer: {poll_hour / inf_hour:.1f}x requests, "
          f"{poll_bytes * cycles_per_hour / (list_bytes + stream_hour):.0f}x bytes "
          f"(first hour, LIST included)")
    print(f"  1000 nodes in steady state: polling {poll_hour * 1000 / 3600:.0f} requests/s "
          f"and {poll_bytes * cycles_per_hour * 1000 / 3600 * mib:.0f} MiB/s from the API "
          f"server; informer {watches_hour * 1000 / 3600:.1f} requests/s and "
          f"{stream_hour * 1000 / 3600 * mib:.2f} MiB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
