"""`make bench`: the collector under a fleet's load, on loopback, bounded in time.

N simulated nodes (default 2,000) each POST one verdict every 10 s for 2 minutes
(200 verdicts/s) while 20 slow clients hold connections open (half of them trickle
request headers a byte every 2 s, half a body shorter than its Content-Length; each
reconnects when the collector hangs up on it), against the collector with SQLite, then
with PostgreSQL. Prints throughput, p50/p99 latency, errors, how often the slow clients
were cut off and the collector's peak RSS (VmHWM). Bounds: no errors, p99 < 100 ms and
peak RSS < 200 MiB with SQLite on this 2-core machine. A benchmark, not a timed test:
about 5 minutes in all.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.test_collector import TKE, Postgres, Proc

TARGET_P99_MS = 100.0
TARGET_RSS_MIB = 200.0


def base_verdict() -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(TKE), "--json"],
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class SlowClients:
    """``n`` connections that never finish a request, re-opened when closed."""

    def __init__(self, port: int, n: int) -> None:
        self.port = port
        self.cut_off = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._hold, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _hold(self, i: int) -> None:
        start = (b"POST /v1/verdicts HTTP/1.1\r\nHost: x\r\nX-Slow: " if i % 2 == 0 else
                 b"POST /v1/verdicts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100000\r\n\r\n{")
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                    s.sendall(start)
                    while not self.stop.wait(2):
                        s.sendall(b"a")
            except OSError:  # hung up on: count it and come back
                self.cut_off += 1
                self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def load(url: str, nodes: int, seconds: float, period: float, workers: int,
         template: dict[str, Any]) -> dict[str, Any]:
    """Each node posts at offset + k*period; workers take the due sends in order."""
    schedule = sorted((i * period / nodes + k * period, i)
                      for i in range(nodes) for k in range(int(seconds / period)))
    lock = threading.Lock()
    cursor = [0]
    lat: list[float] = []
    errors: list[str] = []
    start = time.monotonic() + 0.5

    def worker() -> None:
        s = requests.Session()
        while True:
            with lock:
                if cursor[0] >= len(schedule):
                    return
                at, node = schedule[cursor[0]]
                cursor[0] += 1
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            body = {**template, "node": f"node-{node:05d}",
                    "idempotency_key": str(uuid.uuid4())}
            t0 = time.monotonic()
            try:
                r = s.post(url + "/v1/verdicts", json=body, timeout=10)
                ok = r.status_code == 200
                if not ok:
                    errors.append(f"HTTP {r.status_code}")
            except requests.RequestException as e:
                errors.append(type(e).__name__)
                ok = False
            if ok:
                with lock:
                    lat.append(time.monotonic() - t0)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    lat.sort()
    return {"sent": len(schedule), "ok": len(lat), "errors": len(errors),
            "error_kinds": sorted(set(errors))[:5], "wall": wall,
            "throughput": len(lat) / wall if wall else 0.0,
            "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
            "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--period", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--slow-clients", type=int, default=20)
    ap.add_argument("--stores", default="sqlite,postgresql",
                    help="which stores, comma-separated (default both)")
    args = ap.parse_args()
    stores = args.stores.split(",")
    template = base_verdict()
    size = len(json.dumps(template))
    print(f"{args.nodes} nodes x one verdict ({size} bytes) per {args.period:.0f}s for "
          f"{args.seconds:.0f}s = {args.nodes / args.period:.0f} verdicts/s offered, "
          f"{args.slow_clients} slow clients holding connections")
    results = []
    with tempfile.TemporaryDirectory(prefix="lb-collector-bench-") as tmp:
        pg = Postgres() if "postgresql" in stores else None
        try:
            for name in stores:
                db: Path | str = Path(tmp) / "bench.db"
                if name != "sqlite":
                    assert pg is not None
                    db = pg.new_db()
                c = Proc(db)
                slow = SlowClients(c.port, args.slow_clients)
                try:
                    res = load(c.url, args.nodes, args.seconds, args.period, args.workers,
                               template)
                    slow.close()
                    res["cut_off"] = slow.cut_off
                    r = requests.get(c.url + "/v1/nodes", timeout=60)
                    nodes = int(r.headers.get("X-Total-Count", len(r.json())))
                    res["rss"] = peak_rss_mib(c.p.pid)
                finally:
                    slow.close()
                    c.stop()
                results.append((name, res, nodes))
        finally:
            if pg is not None:
                pg.stop()
    print(f"\n{'store':<11}{'sent':>8}{'ok':>8}{'errors':>8}{'verdicts/s':>12}{'p50 ms':>9}"
          f"{'p99 ms':>9}{'peak RSS MiB':>14}{'nodes seen':>12}{'slow cut off':>14}")
    ok = True
    for name, r, nodes in results:
        print(f"{name:<11}{r['sent']:>8}{r['ok']:>8}{r['errors']:>8}{r['throughput']:>12.1f}"
              f"{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['rss']:>14.1f}{nodes:>12}"
              f"{r['cut_off']:>14}")
        if r["error_kinds"]:
            print(f"  errors: {', '.join(r['error_kinds'])}")
        ok &= r["errors"] == 0
    sqlite = dict((n, r) for n, r, _ in results).get("sqlite")
    if sqlite is None:
        return 0 if ok else 1
    met = (sqlite["p99_ms"] < TARGET_P99_MS and sqlite["rss"] < TARGET_RSS_MIB
           and sqlite["errors"] == 0)
    print(f"\nbounds (SQLite): no errors, p99 < {TARGET_P99_MS:.0f} ms, peak RSS < "
          f"{TARGET_RSS_MIB:.0f} MiB: {'MET' if met else 'NOT MET'}")
    return 0 if ok and met else 1


if __name__ == "__main__":
    raise SystemExit(main())
