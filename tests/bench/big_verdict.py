"""`make bench` (or alone): what one 10k-LoadBalancer-service node's verdict costs to
spool, ship and store, beside a plain 4 MiB batch (the largest body the collector took
before gzip) measured in the same run.

Prints: verdict bytes plain and gzipped (iptables and IPVS mode), the spool's bytes for
it, and for the real collector process (SQLite) the CPU seconds and peak RSS growth to
take it (POST -> 200), then the same for the 4 MiB plain baseline; and a 2 GiB zip bomb.
A benchmark, not a timed test: about a minute.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agent.ship import gz
from agent.ship.spool import Spool
from tests.test_collector import Proc, verdict
from tests.test_collector_abuse import cpu_seconds, status_kib
from tests.test_collector_gzip import zip_bomb


def verdict_10k(mode: str, node: str) -> bytes:
    from agent.bundle import load_bundle
    from agent.diagnose import diagnose
    from lab.kube_proxy_rules.synthetic import synthetic

    with tempfile.TemporaryDirectory() as d:
        for name, text in synthetic(10000, mode).items():
            (Path(d) / name).write_text(text)
        doc = diagnose(load_bundle(d), node).to_dict()
    return json.dumps(doc, separators=(",", ":")).encode()


def baseline_4mib(node: str) -> bytes:
    """A batch of real (small) verdicts just under 4 MiB: the old limit, plain."""
    one = verdict(node)
    batch: list[dict[str, Any]] = []
    size = 2
    while True:
        v = {**one, "node": f"{node}-{len(batch)}"}
        n = len(json.dumps(v)) + 1
        if size + n > 4 * 1024 * 1024 or len(batch) >= 500:
            return json.dumps(batch).encode()
        batch.append(v)
        size += n


def take(col: Proc, body: bytes, coding: str | None) -> tuple[int, float, float, float]:
    """(status, collector CPU s, its peak RSS growth MiB, wall s) for one POST."""
    pid = col.p.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss0, cpu0, t0 = status_kib(pid, "VmRSS"), cpu_seconds(pid), time.monotonic()
    headers = {"Content-Type": "application/json"}
    if coding:
        headers["Content-Encoding"] = coding
    r = requests.post(col.url + "/v1/verdicts", data=body, headers=headers, timeout=120)
    wall = time.monotonic() - t0
    return (r.status_code, cpu_seconds(pid) - cpu0,
            (status_kib(pid, "VmHWM") - rss0) / 1024, wall)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bigverdict"))
    col = Proc(tmp / "c.db")
    try:
        base = baseline_4mib("base")
        st, cpu, rss, wall = take(col, base, None)
        print(f"baseline: plain batch of {len(base) / 2**20:.2f} MiB -> {st}: collector "
              f"CPU {cpu:.2f} s, peak RSS +{rss:.0f} MiB, {wall:.2f} s wall")
        for mode in ("iptables", "ipvs"):
            plain = verdict_10k(mode, f"big-{mode}")
            t0 = time.process_time()
            packed = gz.compress(plain)
            zcpu = time.process_time() - t0
            spool = Spool(tmp / f"spool-{mode}")
            spool.put(json.loads(plain))
            print(f"10k {mode}: verdict {len(plain) / 1e6:.1f} MB plain, "
                  f"{len(packed) / 1e6:.2f} MB gzip ({100 * len(packed) / len(plain):.1f} %, "
                  f"{zcpu:.2f} s CPU), spool {spool.bytes() / 1e6:.2f} MB")
            st, cpu, rss, wall = take(col, packed, "gzip")
            print(f"  collector takes it gzipped -> {st}: CPU {cpu:.2f} s, peak RSS "
                  f"+{rss:.0f} MiB, {wall:.2f} s wall; database now "
                  f"{sum(f.stat().st_size for f in tmp.glob('c.db*')) / 1e6:.0f} MB")
        bomb = zip_bomb(2)
        st, cpu, rss, wall = take(col, bomb, "gzip")
        print(f"zip bomb: {len(bomb) / 1e6:.1f} MB -> 2 GiB: {st}, CPU {cpu:.2f} s, peak "
              f"RSS +{rss:.0f} MiB, {wall:.2f} s wall")
        print(f"collector total peak RSS {status_kib(col.p.pid, 'VmHWM') / 1024:.0f} MiB "
              f"(pid {col.p.pid}, {os.cpu_count()} CPUs)")
    finally:
        col.stop()


if __name__ == "__main__":
    main()
