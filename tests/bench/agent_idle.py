"""`make bench`: the agent daemon's steady-state cost on an idle lab node.

Runs `loopback-agent run` (capture on, no collector) inside a lab node namespace for a
bounded time, then reports its CPU use as a share of one core (after the first cycle, so
start-up is excluded) and its peak RSS. Baseline in the same run: `sleep` in the same
namespace (the cost of nothing). Target: < 2 % of a core and < 80 MiB.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.node import build_lab
from lab.scenarios import SCENARIOS

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process and its reaped children (it has none that matter)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out += [int(p.name), *descendants(int(p.name))]
    return out


def hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=10.0)
    args = ap.parse_args()
    with build_lab(SCENARIOS["tke-ipvs-etp-local"], "nft") as lab, \
            tempfile.TemporaryDirectory() as spool:
        proc = lab.node.popen([sys.executable, "-m", "agent", "run", "--spool", spool,
                               "--interval", str(args.interval), "--listen", "",
                               "--no-kube-api"], stdout=open(os.devnull, "w"),  # noqa: SIM115
                              stderr=open(os.devnull, "w"))  # noqa: SIM115
        # `ip netns exec` execs the agent: the pid is the agent's own (checked below)
        time.sleep(args.interval + 3)  # past start-up and the first cycle
        pids = [proc.pid, *descendants(proc.pid)]
        agent = next(p for p in pids if b"agent" in Path(f"/proc/{p}/cmdline").read_bytes())
        c0, t0 = cpu_seconds(agent), time.monotonic()
        time.sleep(args.seconds)
        c1, t1 = cpu_seconds(agent), time.monotonic()
        rss = hwm_mib(agent)
        proc.terminate()
        proc.wait(timeout=30)
        base = lab.node.popen(["sleep", str(args.seconds / 6)])
        b0, bt0 = cpu_seconds(base.pid), time.monotonic()
        base.wait()
        bt1 = time.monotonic()
    share = (c1 - c0) / (t1 - t0) * 100
    print(f"agent daemon, idle lab node, interval {args.interval:.0f}s, measured "
          f"{t1 - t0:.0f}s after start-up:")
    print(f"  CPU {share:.2f} % of one core, peak RSS {rss:.1f} MiB")
    print(f"  baseline `sleep` in the same namespace: CPU {b0 / max(bt1 - bt0, 1e-9) * 100:.2f} %")
    ok = share < 2.0 and rss < 80.0
    print(f"target: < 2 % of a core and < 80 MiB: {'OK' if ok else 'NOT MET'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
