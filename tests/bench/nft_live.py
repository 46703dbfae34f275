"""`make bench`: the live read of a kube-proxy nftables-mode node of 10k LoadBalancer
services, and the memory its container needs. The synthetic state (lab.kube_proxy_rules,
kube-proxy's nftables transaction) is loaded with `nft -f` into a throwaway network
namespace (about 100 s at 10k: the kernel's own time); then, each in a memory cgroup of
its own (lab.cgroup: the container's view, the agent and the commands it runs together):

- `nft list ruleset` (what the agent reads) and `nft -j list ruleset` (what it read
  before): wall time and peak;
- a live `check --json --no-kube-api` in the namespace: wall time and the container's
  peak; right when its mode is nftables and it finds every LB IP;
- the daemon (`run --no-capture`) through one change of the rules: its container's peak
  from its start to the verdict after the change, when it holds the last cycle's
  snapshot and verdict while nft lists the new ruleset.

Targets: the check within 2x the listing alone (the issue's 1.5x is for iptables-save,
whose text the agent reads as printed; here the nft text is tokenized and walked), and
both peaks under the DaemonSet's memory limit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab import cgroup, netns
from lab.kube_proxy_rules import synthetic
from tests.bench.live_read import node_like_synthetic

LIMIT_MIB = 768  # daemonset/agent-daemonset.yaml
TARGET_RATIO = 2.0
INTERVAL = 30
DAEMON_SECONDS = 900


def in_cgroup(ns: netns.Netns, *cmd: str) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """(wall seconds, the cgroup's peak MiB, the run) of ``cmd`` in ``ns``."""
    with cgroup.memory_cgroup("lbbn") as cg:
        t = time.monotonic()
        r = subprocess.run([*cg.prefix(), "ip", "netns", "exec", ns.name, *cmd],
                           capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - t
        return wall, cg.peak() / 2**20, r


def daemon_through_a_change(ns: netns.Netns, spool: str) -> tuple[float, int]:
    """(the daemon's container peak MiB, verdicts seen) from its start to the first
    verdict made after one rule was added."""
    with cgroup.memory_cgroup("lbbd") as cg:
        proc = subprocess.Popen([*cg.prefix(), "ip", "netns", "exec", ns.name,
                                 sys.executable, "-m", "agent", "run", "--no-capture",
                                 "--no-kube-api", "--listen", "", "--interval",
                                 str(INTERVAL), "--spool", spool],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        # (bounded: a daemon that stops printing is stopped, and the bench says so)
        guard = threading.Timer(DAEMON_SECONDS, proc.kill)
        guard.start()
        try:
            assert proc.stdout is not None
            lines = [proc.stdout.readline()]  # the first verdict (a full read)
            ns.run("nft", "add rule ip kube-proxy services ip daddr 10.255.0.1 tcp dport 81 "
                   "drop")
            # the next cycle reads the changed rules (one more: a cycle under way when the
            # rule went in reads the old ones)
            lines += [proc.stdout.readline(), proc.stdout.readline()]
            assert all(lines), "the daemon stopped"
            return cg.peak() / 2**20, len(lines)
        finally:
            guard.cancel()
            proc.terminate()
            proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=10_000)
    args = ap.parse_args()
    why = cgroup.why_not()
    if why:
        print(f"nft_live: cannot measure: {why}")
        return 1
    with netns.netns("lbn") as ns:
        node_like_synthetic(ns)
        t = time.monotonic()
        ns.run("nft", "-f", "-", input=synthetic(args.services, "nftables")[
            "nft-transaction.txt"], timeout=3600)
        print(f"\nnftables-mode node of {args.services} LB services: loaded in "
              f"{time.monotonic() - t:.0f}s (nft -f)")
        rows = []
        for cmd in (("nft", "list", "ruleset"), ("nft", "-j", "list", "ruleset")):
            wall, peak, r = in_cgroup(ns, *cmd)
            assert r.returncode == 0, r.stderr
            rows.append((" ".join(cmd), wall, peak))
        wall, peak, r = in_cgroup(ns, sys.executable, "-m", "agent", "check", "--json",
                                  "--no-kube-api")
        v = json.loads(r.stdout)
        lb_ips = v["lb_ip_counts"]["total"]  # (the summary names only LB IPs not fine)
        right = v["kube_proxy_mode"] == "nftables" and lb_ips == args.services
        rows.append(("live check (agent and nft)", wall, peak))
        with tempfile.TemporaryDirectory(prefix="lb-nft-live-") as spool:
            daemon_peak, _ = daemon_through_a_change(ns, spool)
    for what, w, p in rows:
        print(f"  {what:<30} {w:7.1f} s  peak {p:6.0f} MiB")
    ratio = rows[-1][1] / rows[0][1]
    print(f"  check: mode {v['kube_proxy_mode']}, {lb_ips} LB IPs, "
          f"{len(v['findings'])} findings: {'right' if right else 'WRONG'}; "
          f"{ratio:.2f}x `nft list ruleset` alone; the JSON listing needs "
          f"{rows[1][2] / rows[0][2]:.2f}x the text's memory")
    print(f"  daemon through one change of the rules (interval {INTERVAL}s): container "
          f"peak {daemon_peak:.0f} MiB")
    ok = right and ratio <= TARGET_RATIO and max(rows[-1][2], daemon_peak) < LIMIT_MIB
    print(f"target: right, within {TARGET_RATIO:g}x the listing, both peaks under "
          f"{LIMIT_MIB} MiB: {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
