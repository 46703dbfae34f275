"""`make bench`: time and peak memory of `check --from` on synthetic kube-proxy dumps of
1k, 10k and 20k LoadBalancer services (IPVS and iptables mode), next to the baseline
`iptables-restore --test` of the same dump, run in the same script.

Each measured command runs under GNU time, which reports its peak RSS (a child's maxrss
from wait4() would include this script's own memory: Linux carries the high-water mark
across fork and exec). The baseline runs inside a throwaway network namespace holding the
dump's ipsets (it never touches the root namespace).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from lab import netns
from lab.kube_proxy_rules import synthetic

SIZES = (1_000, 10_000, 20_000)
GNU_TIME = "/usr/bin/time"  # Debian package "time" (make bench installs it)
TARGET_10K_SECONDS = 5.0


def measure(cmd: list[str], stdin_path: Path | None = None) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS MiB, exit code, stderr tail) of one command."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        stdin = open(stdin_path, "rb") if stdin_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.run([GNU_TIME, "-o", out.name, "-f", "%e %M", *cmd],
                                  stdin=stdin, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, check=False)
        finally:
            if stdin_path:
                stdin.close()  # type: ignore[union-attr]
        wall, rss_kb = out.read().split()[-2:]
    return (float(wall), int(rss_kb) / 1024, proc.returncode,
            proc.stderr.decode(errors="replace")[-300:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                    help="comma-separated service counts (default 1000,10000,20000)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="lb-bench-") as tmp:
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
                with netns.netns("lbb") as ns:
                    # the rules match kube-proxy's ipsets: they must exist for --test, and
                    # loading them is part of the baseline (it is most of IPVS mode's dump)
                    swall, srss, _, _ = measure(["ip", "netns", "exec", ns.name,
                                                 "ipset", "restore"], d / "ipset.txt")
                    bwall, brss, bcode, berr = measure(
                        ["ip", "netns", "exec", ns.name, "iptables-legacy-restore", "--test"],
                        d / "iptables-save.txt")
                    bwall, brss = bwall + swall, max(brss, srss)
                if bcode != 0:
                    print(f"baseline failed ({bcode}): {berr}", file=sys.stderr)
                    ok = False
                print(f"{mode} {n}: check {wall:.2f}s, baseline {bwall:.2f}s", file=sys.stderr)
                rows.append((mode, n, rules, wall, rss, bwall, brss))
    print()
    print("check --from on synthetic kube-proxy dumps; baseline: ipset restore + "
          "iptables-legacy-restore --test of the same dump")
    print(f"{'mode':<9}{'services':>9}{'rules':>9}{'check s':>9}{'RSS MiB':>9}"
          f"{'base s':>9}{'base MiB':>9}{'check/base':>11}{'s per 1k svc':>13}")
    for mode, n, rules, wall, rss, bwall, brss in rows:
        print(f"{mode:<9}{n:>9}{rules:>9}{wall:>9.2f}{rss:>9.0f}{bwall:>9.2f}{brss:>9.0f}"
              + (f"{wall / bwall:>11.1f}" if bwall else f"{'-':>11}")
              + f"{wall / n * 1000:>13.3f}")
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
