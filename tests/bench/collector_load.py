"""`make bench`: the collector under a fleet's load, on loopback, bounded in time.

N simulated nodes (default 2,000) each POST one verdict every 10 s for 60 s (200 verdicts/s),
against the collector with SQLite, then with PostgreSQL. Prints throughput, p50/p99
latency, errors and the collector's peak RSS (VmHWM). Target: no errors, p99 < 100 ms with
SQLite on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
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


def base_verdict() -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(TKE), "--json"],
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


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
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--period", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=32)
    args = ap.parse_args()
    template = base_verdict()
    size = len(json.dumps(template))
    print(f"{args.nodes} nodes x one verdict ({size} bytes) per {args.period:.0f}s for "
          f"{args.seconds:.0f}s = {args.nodes / args.period:.0f} verdicts/s offered")
    results = []
    with tempfile.TemporaryDirectory(prefix="lb-collector-bench-") as tmp:
        pg = Postgres()
        try:
            for name, db in (("sqlite", Path(tmp) / "bench.db"), ("postgresql", pg.new_db())):
                c = Proc(db)
                try:
                    res = load(c.url, args.nodes, args.seconds, args.period, args.workers,
                               template)
                    res["rss"] = peak_rss_mib(c.p.pid)
                    nodes = len(requests.get(c.url + "/v1/nodes", timeout=60).json())
                finally:
                    c.stop()
                results.append((name, res, nodes))
        finally:
            pg.stop()
    print(f"\n{'store':<11}{'sent':>8}{'ok':>8}{'errors':>8}{'verdicts/s':>12}{'p50 ms':>9}"
          f"{'p99 ms':>9}{'peak RSS MiB':>14}{'nodes seen':>12}")
    ok = True
    for name, r, nodes in results:
        print(f"{name:<11}{r['sent']:>8}{r['ok']:>8}{r['errors']:>8}{r['throughput']:>12.1f}"
              f"{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['rss']:>14.1f}{nodes:>12}")
        if r["error_kinds"]:
            print(f"  errors: {', '.join(r['error_kinds'])}")
        ok &= r["errors"] == 0
    sqlite = results[0][1]
    verdict = "OK" if sqlite["p99_ms"] < TARGET_P99_MS and sqlite["errors"] == 0 else "NOT MET"
    print(f"\ntarget (SQLite): no errors and p99 < {TARGET_P99_MS:.0f} ms: {verdict}")
    return 0 if ok and verdict == "OK" else 1


if __name__ == "__main__":
    raise SystemExit(main())
