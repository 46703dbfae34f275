"""Run by tests/test_diagnose_parallel.py in a fresh process: the split needs a process
with one thread (a fork copies only the calling thread), and pytest's may have more (the
VM's guest run starts one). Prints one JSON object: the verdict of BUNDLE with --jobs
JOBS (its time fixed), how many LB IP ports this process walked itself, and the seconds
the diagnosis took, with FAULT injected:

    python tests/parallel_run.py BUNDLE JOBS FAULT

FAULT: none (split as `check` would); any-mode (split whatever kube-proxy's mode, as
every fault below does too); kill-child (the child SIGKILLs itself in its first walk);
hang-child (it sleeps instead, the parent's wait cut to 1 s); fail-last (the rule raises
on the last LB IP, after the targets before it: as a bug would); usable (prints
usable_jobs answers).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agent.diagnose as diagnose_module
import agent.diagnose.rules as rules_module
from agent.bundle import load_bundle
from agent.diagnose import diagnose, parallel
from agent.diagnose.rules import pod_to_lb

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _usable() -> dict[str, int]:
    out = {"small": parallel.usable_jobs(2, parallel.MIN_TARGETS - 1),
           "one": parallel.usable_jobs(1, 10_000), "big": parallel.usable_jobs(2, 10_000)}
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        out["threaded"] = parallel.usable_jobs(2, 10_000)
    finally:
        stop.set()
        t.join()
    return out


def main() -> int:
    bundle, jobs, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if fault == "usable":
        print(json.dumps(_usable()))
        return 0
    snap = load_bundle(bundle)
    parent = os.getpid()
    real = pod_to_lb.check
    walked = [0]
    last_ip = diagnose(snap, "n", now=NOW).lb_ips[-1].ip

    def check(ctx):  # type: ignore[no-untyped-def]
        if os.getpid() != parent:
            if fault == "kill-child":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang-child":
                time.sleep(3600)
        else:
            walked[0] += len(ctx.targets)
        if fault == "fail-last":
            at = next((i for i, t in enumerate(ctx.targets) if t.ip == last_ip), None)
            if at is not None:
                real(replace(ctx, targets=ctx.targets[:at]))
                raise RuntimeError(f"walking {last_ip} failed")
        return real(ctx)

    swap = {real: check}
    rules_module.RULES = tuple(swap.get(r, r) for r in rules_module.RULES)
    diagnose_module.FAMILY_RULES = tuple(swap.get(r, r) for r in diagnose_module.FAMILY_RULES)
    if fault == "hang-child":
        parallel.WAIT_AT_LEAST = 1.0
    if fault != "none":  # the merging is the same in every mode: split this one too
        parallel.SPLIT_MODES = ("iptables", "ipvs", "nftables")
    started = time.monotonic()
    doc = diagnose(snap, "node-a", now=NOW, jobs=jobs).to_dict("all")
    print(json.dumps({"doc": json.dumps(doc), "parent_walked": walked[0],
                      "lb_ips": len(doc["lb_ips"]), "seconds": time.monotonic() - started,
                      "threads": threading.active_count()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
