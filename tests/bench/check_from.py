"""`make bench`: time and peak memory of `check --from` on synthetic kube-proxy dumps of
1k, 10k and 20k LoadBalancer services (IPVS and iptables mode), next to the baseline
`iptables-restore --test` of the same dump, run in the same script.

Each measured command is its own child process; its peak RSS comes from wait4() of that
very child. The baseline runs inside a throwaway network namespace (it never touches the
root namespace).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.lab import netns
from agent.lab.kube_proxy_rules import synthetic

SIZES = (1_000, 10_000, 20_000)
TARGET_10K_SECONDS = 5.0


def measure(cmd: list[str], stdin_path: Path | None = None) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS MiB, exit code, stderr tail) of one child process."""
    stdin = open(stdin_path, "rb") if stdin_path else subprocess.DEVNULL  # noqa: SIM115
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if stdin_path:
        stdin.close()  # type: ignore[union-attr]
    return wall, usage.ru_maxrss / 1024, proc.returncode, err.decode(errors="replace")[-300:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                    help="comma-separated service counts (default 1000,10000,20000)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="lb-bench-") as tmp, netns.netns("lbb") as ns:
        for mode in ("iptables", "ipvs"):
            for n in sizes:
                d = Path(tmp) / f"{mode}-{n}"
                d.mkdir()
                for name, text in synthetic(n, mode).items():
                    (d / name).write_text(text)
                rules = sum(1 for line in (d / "iptables-save.txt").open()
                            if line.startswith("-A"))
                wall, rss, code, err = measure(
                    [sys.executable, "-m", "agent", "check", "--from", str(d), "--json"])
                if code not in (0, 1):
                    print(f"check --from failed ({code}): {err}", file=sys.stderr)
                    ok = False
                bwall, brss, bcode, berr = measure(
                    ["ip", "netns", "exec", ns.name, "iptables-legacy-restore", "--test"],
                    d / "iptables-save.txt")
                if bcode != 0:
                    print(f"baseline failed ({bcode}): {berr}", file=sys.stderr)
                rows.append((mode, n, rules, wall, rss, bwall, brss))
    print()
    print("check --from on synthetic kube-proxy dumps; baseline: iptables-legacy-restore --test")
    print(f"{'mode':<9}{'services':>9}{'rules':>9}{'check s':>9}{'RSS MiB':>9}"
          f"{'base s':>9}{'base MiB':>9}{'check/base':>11}{'s per 1k svc':>13}")
    for mode, n, rules, wall, rss, bwall, brss in rows:
        print(f"{mode:<9}{n:>9}{rules:>9}{wall:>9.2f}{rss:>9.0f}{bwall:>9.2f}{brss:>9.0f}"
              f"{wall / bwall if bwall else float('nan'):>11.1f}{wall / n * 1000:>13.3f}")
    print()
    for mode in ("iptables", "ipvs"):
        by_n = {n: wall for m, n, _, wall, *_ in rows if m == mode}
        if 10_000 in by_n and 20_000 in by_n:
            growth = by_n[20_000] / by_n[10_000]
            print(f"{mode}: 10k -> 20k services took x{growth:.2f} the time "
                  f"(linear = x2.00){'' if growth < 2.6 else '  <-- superlinear'}")
            ok &= growth < 2.6
        if 10_000 in by_n:
            verdict = "OK" if by_n[10_000] < TARGET_10K_SECONDS else "TOO SLOW"
            print(f"{mode}: 10k services in {by_n[10_000]:.2f}s "
                  f"(target < {TARGET_10K_SECONDS:.0f}s): {verdict}")
            ok &= by_n[10_000] < TARGET_10K_SECONDS
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
