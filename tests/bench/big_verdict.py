"""`make bench` (or alone): what one 10k-LoadBalancer-service node's verdict costs to
spool, ship and store, beside a plain 4 MiB batch (the largest body the collector took
before gzip) measured in the same run.

Prints: verdict bytes plain and gzipped (iptables and IPVS mode), the spool's bytes for
it, and for the real collector process (SQLite) the CPU seconds and peak RSS growth to
take it (POST -> 200), then the same for the 4 MiB plain baseline; and a 2 GiB zip bomb.
Then heartbeats: the same verdict POSTed N times (a new time and key each, as the agent
re-ships an unchanged verdict) to this collector and, in the same run, to one on the
previous store (schema 2, tests/data/collector/store-schema2.py.txt: every document
stored whole, every one validated): the database's bytes after 1 and N, and the CPU of
the first and of a repeated POST. Last, the daemon's side: the peak RSS growth of a
process holding the verdict while it spools and ships it, and the same steps as the
previous spool and sender took them (text held, inflated and parsed) as the baseline.
A benchmark, not a timed test: a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
from tests.test_collector_store import OldProc

ROOT = Path(__file__).resolve().parents[2]


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


def validation(plain: bytes) -> str:
    """The collector's schema check of the verdict (fastjsonschema first) beside
    jsonschema alone (the collector before it), in this process."""
    import jsonschema

    from agent.collector.intake import Intake

    doc = json.loads(plain)
    intake = Intake()
    t0 = time.process_time()
    schema = intake.schemas[doc["schema"]]
    assert schema.fast_valid(doc)
    fast = time.process_time() - t0
    t0 = time.process_time()
    assert jsonschema.exceptions.best_match(schema.full.iter_errors(doc)) is None
    slow = time.process_time() - t0
    return (f"schema check: {fast:.2f} s CPU (compiled schema), jsonschema alone (the "
            f"collector before) {slow:.2f} s: x{slow / fast:.0f}")


def db_bytes(path: Path) -> int:
    """The SQLite database with its WAL and shared-memory files."""
    return sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))


def heartbeat(plain: bytes, i: int) -> bytes:
    """The verdict as the agent re-ships it unchanged: a new time and key, gzipped."""
    doc = json.loads(plain)
    doc.update(time=f"2026-11-27T00:{i // 60:02d}:{i % 60:02d}Z", idempotency_key=f"hb-{i}")
    return gz.compress(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())


def heartbeats(tmp: Path, plain: bytes, n: int) -> None:
    """n heartbeats of one verdict to the previous store and to this one."""
    for label, db, start in (("previous store (schema 2)", tmp / "hb-old.db", OldProc),
                             ("this store", tmp / "hb-new.db", Proc)):
        col = start(f"sqlite://{db}", tmp) if start is OldProc else start(db)
        try:
            sizes, cpus = [], []
            for i in range(n):
                body = heartbeat(plain, i)
                st, cpu, _, _ = take(col, body, "gzip")
                assert st == 200, st
                cpus.append(cpu)
                sizes.append(db_bytes(db))
        finally:
            col.stop()
        rest = sum(cpus[1:]) / max(1, n - 1)
        # with its WAL while running, then closed (checkpointed, the WAL removed: its
        # size is a high-water mark of pages rewritten, not of data kept)
        print(f"  {label}: database {sizes[0] / 1e6:.1f} MB after 1 POST, "
              f"{sizes[-1] / 1e6:.1f} MB after {n} ({db_bytes(db) / 1e6:.1f} MB once "
              f"closed); collector CPU {cpus[0]:.2f} s for the first, {rest:.2f} s per "
              "repeated one")


# the daemon's side, in a child process holding the verdict (as the daemon does)
_SHIP = r"""
import gc, json, sys
from pathlib import Path
import requests
from agent.ship import gz
from agent.ship.sender import Sender, drain
from agent.ship.spool import Spool

def kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])

doc = json.loads(Path(sys.argv[1]).read_bytes())
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
rss0 = kib("VmRSS")
if sys.argv[4] == "previous":  # the steps of the previous spool and sender
    plain = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    packed = gz.compress(plain)
    del plain
    text = bytes(gz.inflate(packed, 64 << 20))
    json.loads(text)  # its check for corruption
    r = requests.post(sys.argv[3] + "/v1/verdicts", data=gz.compress(b"[" + text + b"]"),
                      headers={"Content-Encoding": "gzip"}, timeout=120)
    sent = int(r.status_code == 200)
else:
    spool = Spool(sys.argv[2])
    spool.put(doc)
    sent = drain(spool, Sender(sys.argv[3], timeout=120)).sent
print(json.dumps({"sent": sent, "rss0": rss0, "hwm": kib("VmHWM")}))
"""


def daemon_side(tmp: Path, plain: bytes, col: Proc) -> None:
    path = tmp / "verdict.json"
    path.write_bytes(plain)
    for mode in ("previous", "now"):
        out = subprocess.run([sys.executable, "-c", _SHIP, str(path), str(tmp / f"sp-{mode}"),
                              col.url, mode], cwd=ROOT, capture_output=True, text=True,
                             check=True)
        r = json.loads(out.stdout)
        print(f"  daemon side, {mode}: spool + ship one verdict: peak RSS "
              f"+{(r['hwm'] - r['rss0']) / 1024:.0f} MiB (holding the verdict "
              f"{r['rss0'] / 1024:.0f} MiB, peak {r['hwm'] / 1024:.0f} MiB), sent {r['sent']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heartbeats", type=int, default=6)
    args = ap.parse_args()
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
            print("  " + validation(plain))
            st, cpu, rss, wall = take(col, packed, "gzip")
            print(f"  collector takes it gzipped -> {st}: CPU {cpu:.2f} s, peak RSS "
                  f"+{rss:.0f} MiB, {wall:.2f} s wall; database now "
                  f"{db_bytes(tmp / 'c.db') / 1e6:.0f} MB")
            if mode == "iptables":
                print(f"  {args.heartbeats} heartbeats of it (a new time and key each):")
                heartbeats(tmp, plain, args.heartbeats)
                daemon_side(tmp, plain, col)
        bomb = zip_bomb(2)
        st, cpu, rss, wall = take(col, bomb, "gzip")
        print(f"zip bomb: {len(bomb) / 1e6:.1f} MB -> 2 GiB: {st}, CPU {cpu:.2f} s, peak "
              f"RSS +{rss:.0f} MiB, {wall:.2f} s wall")
        print(f"collector total peak RSS {status_kib(col.p.pid, 'VmHWM') / 1024:.0f} MiB "
              f"(pid {col.p.pid}, {os.cpu_count()} CPUs)")
    finally:
        col.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the previous store's heartbeats: 0.4 GB


if __name__ == "__main__":
    main()
