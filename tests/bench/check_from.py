"""`make bench`: time and peak memory of `check --from` on synthetic kube-proxy dumps of
1k, 10k and 50k LoadBalancer services (iptables, IPVS and nftables mode), next to the
baseline `ipset restore` + `iptables-legacy-restore --test` of the same state (nftables
mode: `nft -c -f` of its transaction, up to 10k services), run in the same script.
Checked: at 10k services under 2 s and 150 MiB (issue 14), and 10k -> 50k
linear (5x the services: at most 5x the CPU time, with some slack; the wall time of a
single 50k run on a shared machine can be twice its CPU time).

Each measured command runs under GNU time, which reports its peak RSS (a child's maxrss
from wait4() would include this script's own memory: Linux carries the high-water mark
across fork and exec). `check --jobs 2` (opt-in) walks an iptables-mode node's LB IPs
in two processes: it is run once beside the default, and the peak of both processes
together (their proportional set sizes summed: each page they share counted once) is
sampled in another run (GNU time would report the larger of the two peaks only).
The check runs --runs times for sizes up to 10k (the median is
shown: other work on the machine moves single runs by tenths of a second), once above.
The baseline runs inside a throwaway network namespace holding the dump's ipsets (it
never touches the root namespace). CPU time (user + sys) is shown beside the wall time:
on a shared machine it moves less. The agent's modules are byte-compiled first (with
PYTHONDONTWRITEBYTECODE set and a changed source, each run would compile them again).
Beyond 35,535 services the synthetic state numbers NodePorts past 65535 (one per service,
from 30000) and fills sets past their 65,536 elements: the baseline gets those ports as
65535 (the kernel refuses more; `ipset restore -exist` takes the repeats) and sets with
room, the check the state as written.

--shape real (issue 31; run by default after the lab shape, --shape lab or real runs one)
times the same check on bundles shaped like real nodes' (lab/kube_proxy_rules/
realistic.py: kubectl's indented services.json of ~1.7 KB a Service, `ipvsadm -Ln`,
`ip -j addr`, `nft list ruleset`, 2-5 endpoints, ~30 % eTP=Local, ~10 % two ports, half
the IPVS VIPs on kube-ipvs0) at 10k and 50k services in each mode, each bundle with and
without services.json (the LB IPs then learned from the rules alone), beside the same
baseline. Targets (issue 31): at 10k at most 1.5 s and 150 MiB in each mode and variant;
50k at most 5.5x the 10k CPU time. Each target prints PASS or MISS; as for the lab
shape's targets, a MISS makes the exit code 1 (`make bench` runs the other benches
and then fails). --no-baseline skips the baselines (no network namespace is made).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the lab (the checkout's)

from lab import netns
from lab.kube_proxy_rules import synthetic
from lab.kube_proxy_rules.realistic import realistic, realistic_services

ROOT = Path(__file__).resolve().parents[2]
SIZES = (1_000, 10_000, 50_000)
GNU_TIME = "/usr/bin/time"  # Debian package "time" (make bench installs it)
TARGET_10K_SECONDS = 2.0
TARGET_10K_MIB = 150.0
LINEAR_SLACK = 1.3  # 10k -> 50k: at most 5 x 1.3 the time
MODES = ("iptables", "ipvs", "nftables")
TARGET_MODES = ("iptables", "ipvs")  # issue 14's targets; nftables mode is measured too
RULES_FILE = {"iptables": "iptables-save.txt", "ipvs": "iptables-save.txt",
              "nftables": "nft-transaction.txt"}
NFT_BASELINE_UP_TO = 10_000  # `nft -c -f` of 10k services took 99 s here
# issue 31: the real-shaped bundles
REAL_SIZES = (10_000, 50_000)
REAL_TARGET_10K_SECONDS = 1.5
REAL_TARGET_10K_MIB = 150.0
REAL_TARGET_50K_CPU_RATIO = 5.5
REAL_RULES_FILE = {"iptables": "iptables-save.txt", "ipvs": "iptables-save.txt",
                   "nftables": "nft-ruleset.txt"}
_PORT = re.compile(r"(?<=--dport )(\d+)|(?<=,tcp:)(\d+)|(?<=,udp:)(\d+)|^(?=add )(.*? )(\d+)$",
                   re.M)


def measure(cmd: list[str], stdin_path: Path | None = None
            ) -> tuple[float, float, int, str, float]:
    """(wall seconds, peak RSS MiB, exit code, stderr tail, CPU seconds) of one command."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        stdin = open(stdin_path, "rb") if stdin_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.run([GNU_TIME, "-o", out.name, "-f", "%e %M %U %S", *cmd],
                                  stdin=stdin, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, check=False)
        finally:
            if stdin_path:
                stdin.close()  # type: ignore[union-attr]
        wall, rss_kb, user, system = out.read().split()[-4:]
    return (float(wall), int(rss_kb) / 1024, proc.returncode,
            proc.stderr.decode(errors="replace")[-300:], float(user) + float(system))


def median_check(d: Path, runs: int) -> tuple[float, float, float, list[float], bool]:
    """`check --from d` ``runs`` times: the median wall time, peak RSS and CPU time, the
    wall times, and whether every run ended as a check does (exit 0 or 1)."""
    walls, rsss, cpus = [], [], []
    ok = True
    for _ in range(runs):
        wall, rss, code, err, cpu = measure(
            [sys.executable, "-m", "agent", "check", "--from", str(d), "--json"])
        if code not in (0, 1):
            print(f"check --from failed ({code}): {err}", file=sys.stderr)
            ok = False
        walls.append(wall)
        rsss.append(rss)
        cpus.append(cpu)
    return (statistics.median(walls), statistics.median(rsss), statistics.median(cpus),
            walls, ok)


def tree_peak_mib(cmd: list[str]) -> float:
    """Peak of the summed PSS of ``cmd`` and its children, sampled every 5 ms (psutil,
    smaps_rollup): the memory --jobs 2 takes, each page the two share counted once."""
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            for p in (proc, *proc.children(recursive=True)):
                total += p.memory_full_info().pss
        except psutil.Error:  # a child that just ended
            pass
        peak = max(peak, total)
        time.sleep(0.005)
    return peak / 2**20


def _for_the_kernel(text: str) -> str:
    """Ports past 65535 (NodePorts of more than 35,535 synthetic services) as 65535, and
    room in the sets for more than their 65,536 elements."""
    def clamp(m: re.Match[str]) -> str:
        if m.group(4) is not None:  # a bitmap:port member: "add SET 70000"
            return m.group(4) + str(min(int(m.group(5)), 65535))
        port = next(g for g in m.groups()[:3] if g is not None)
        return str(min(int(port), 65535))
    return _PORT.sub(clamp, text).replace(" maxelem 65536 ", " maxelem 1048576 ")


def baseline(d: Path, n: int) -> tuple[float, float, int, str]:
    """ipset restore + iptables-legacy-restore --test of bundle ``d`` in a namespace."""
    src = d
    if n > 35_535:
        src = d.parent / f"{d.name}-kernel"
        src.mkdir(exist_ok=True)
        for name in ("ipset.txt", "iptables-save.txt"):
            (src / name).write_text(_for_the_kernel((d / name).read_text()))
    with netns.netns("lbb") as ns:
        # the rules match kube-proxy's ipsets: they must exist for --test, and loading
        # them is part of the baseline (it is most of IPVS mode's dump)
        swall, srss, scode, serr, _ = measure(["ip", "netns", "exec", ns.name,
                                               "ipset", "restore", "-exist"],
                                              src / "ipset.txt")
        bwall, brss, bcode, berr, _ = measure(
            ["ip", "netns", "exec", ns.name, "iptables-legacy-restore", "--test"],
            src / "iptables-save.txt")
    return bwall + swall, max(brss, srss), scode or bcode, serr if scode else berr


def nft_baseline(d: Path, name: str = "nft-transaction.txt") -> tuple[float, float, int, str]:
    """`nft -c -f` (parse and check in the kernel, nothing committed) of the nftables
    state in a namespace: the tool that owns the state, reading it."""
    with netns.netns("lbb") as ns:
        wall, rss, code, err, _ = measure(["ip", "netns", "exec", ns.name, "nft", "-c", "-f",
                                           str(d / name)])
    return wall, rss, code, err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                    help="comma-separated service counts (default 1000,10000,50000)")
    ap.add_argument("--runs", type=int, default=3,
                    help="runs of the check per size up to 10k, the median shown (default 3)")
    ap.add_argument("--shape", choices=("both", "lab", "real"), default="both",
                    help="lab: synthetic() bundles (issue 14's targets); real: bundles shaped "
                         "like real nodes' (issue 31's); both (default): lab, then real")
    ap.add_argument("--real-sizes", default=",".join(str(s) for s in REAL_SIZES),
                    help="comma-separated service counts of the real shape (default "
                         "10000,50000)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated kube-proxy modes (default iptables,ipvs,nftables)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the baselines (no network namespace is made)")
    args = ap.parse_args()
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "agent")],
                   stdout=subprocess.DEVNULL, check=False)
    ok = True
    if args.shape in ("both", "lab"):
        ok &= lab_shape(args)
    if args.shape in ("both", "real"):
        ok &= real_shape(args)
    return 0 if ok else 1


def lab_shape(args: argparse.Namespace) -> bool:
    """synthetic() bundles: the table and issue 14's targets; False when one is missed."""
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m for m in MODES if m in args.modes.split(",")]
    rows = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="lb-bench-") as tmp:
        for mode in modes:
            for n in sizes:
                d = Path(tmp) / f"{mode}-{n}"
                d.mkdir()
                for name, text in synthetic(n, mode).items():
                    (d / name).write_text(text)
                rules = sum(1 for line in (d / RULES_FILE[mode]).open()
                            if line.startswith(("-A", "add rule")))
                wall, rss, cpu, walls, ran = median_check(d, args.runs if n <= 10_000 else 1)
                ok = ok and ran
                check = [sys.executable, "-m", "agent", "check", "--from", str(d), "--json"]
                two_wall, _, _, _, _ = measure([*check, "--jobs", "2"])
                tree = tree_peak_mib([*check, "--jobs", "2"])
                if args.no_baseline:
                    bwall, brss, bcode, berr = 0.0, 0.0, 0, ""
                elif mode != "nftables":
                    bwall, brss, bcode, berr = baseline(d, n)
                elif n <= NFT_BASELINE_UP_TO:
                    bwall, brss, bcode, berr = nft_baseline(d)
                else:  # (the kernel's check of 50k services' chains: many minutes)
                    bwall, brss, bcode, berr = 0.0, 0.0, 0, ""
                if bcode != 0:
                    print(f"baseline failed ({bcode}): {berr}", file=sys.stderr)
                    ok = False
                print(f"{mode} {n}: check {wall:.2f}s (CPU {cpu:.2f}s) {rss:.0f} MiB (runs "
                      f"{', '.join(f'{w:.2f}' for w in walls)}; --jobs 2 {two_wall:.2f}s, "
                      f"both processes {tree:.0f} MiB), baseline {bwall:.2f}s",
                      file=sys.stderr)
                rows.append((mode, n, rules, wall, rss, bwall, brss, cpu, two_wall, tree))
    print()
    print("check --from on synthetic kube-proxy dumps (median of the runs); baseline: "
          "ipset restore + iptables-legacy-restore --test of the same state (nftables: "
          "nft -c -f)")
    print("(jobs2: check --jobs 2, its wall time and both processes' summed PSS, sampled; "
          "IPVS and nftables modes are not split)")
    print(f"{'mode':<9}{'services':>9}{'rules':>9}{'check s':>9}{'CPU s':>7}{'RSS MiB':>9}"
          f"{'jobs2 s':>9}{'jobs2 MiB':>10}{'base s':>9}{'base MiB':>9}{'check/base':>11}"
          f"{'s per 1k svc':>13}")
    for mode, n, rules, wall, rss, bwall, brss, cpu, two_wall, tree in rows:
        print(f"{mode:<9}{n:>9}{rules:>9}{wall:>9.2f}{cpu:>7.2f}{rss:>9.0f}{two_wall:>9.2f}"
              f"{tree:>10.0f}{bwall:>9.2f}{brss:>9.0f}"
              + (f"{wall / bwall:>11.1f}" if bwall else f"{'-':>11}")
              + f"{wall / n * 1000:>13.3f}")
    print()
    for mode in modes:
        by_n = {n: (wall, rss, cpu) for m, n, _, wall, rss, _, _, cpu, _, _ in rows
                if m == mode}
        if 10_000 in by_n and mode not in TARGET_MODES:
            wall, rss, _ = by_n[10_000]
            print(f"{mode}: 10k services in {wall:.2f}s and {rss:.0f} MiB (no target set)")
        elif 10_000 in by_n:
            wall, rss, _ = by_n[10_000]
            verdict = "OK" if wall < TARGET_10K_SECONDS and rss < TARGET_10K_MIB else "MISSED"
            print(f"{mode}: 10k services in {wall:.2f}s and {rss:.0f} MiB (targets < "
                  f"{TARGET_10K_SECONDS:.0f}s, < {TARGET_10K_MIB:.0f} MiB): {verdict}")
            ok &= verdict == "OK"
        if 10_000 in by_n and 50_000 in by_n:
            growth = by_n[50_000][2] / by_n[10_000][2]
            wall_growth = by_n[50_000][0] / by_n[10_000][0]
            mem = by_n[50_000][1] / by_n[10_000][1]
            linear = growth < 5 * LINEAR_SLACK
            print(f"{mode}: 10k -> 50k services took x{growth:.2f} the CPU time (wall "
                  f"x{wall_growth:.2f}) and x{mem:.2f} the memory (linear = x5.00)"
                  f"{'' if linear else '  <-- superlinear'}")
            ok &= linear
    return ok


def _write_real(d: Path, bundle: dict[str, str]) -> Path:
    """``d`` with the whole bundle, and ``d``-nosvc beside it with the same files but
    services.json (hard links: one copy on disk); the latter is returned."""
    d.mkdir()
    bare = d.parent / f"{d.name}-nosvc"
    bare.mkdir()
    for name, text in bundle.items():
        (d / name).write_text(text)
        if name != "services.json":
            os.link(d / name, bare / name)
    return bare


def real_shape(args: argparse.Namespace) -> bool:
    """Bundles shaped like real nodes' (issue 31), with and without services.json: the
    table, and PASS/MISS per target; False when one is missed."""
    sizes = [int(s) for s in args.real_sizes.split(",")]
    modes = [m for m in MODES if m in args.modes.split(",")]
    rows: list[tuple[str, int, str, int, float, float, float, float, float, list[float]]] = []
    ok = True
    for n in sizes:
        t = time.monotonic()
        services = realistic_services(n)
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="lb-bench-real-") as tmp:
                d = Path(tmp) / f"{mode}-{n}"
                bare = _write_real(d, realistic(n, mode, services=services))
                print(f"real {mode} {n}: bundle made in {time.monotonic() - t:.0f}s",
                      file=sys.stderr)
                if args.no_baseline:
                    bwall, brss, bcode, berr = 0.0, 0.0, 0, ""
                elif mode != "nftables":
                    bwall, brss, bcode, berr = baseline(d, n)
                elif n <= NFT_BASELINE_UP_TO:
                    bwall, brss, bcode, berr = nft_baseline(d, REAL_RULES_FILE[mode])
                else:
                    bwall, brss, bcode, berr = 0.0, 0.0, 0, ""
                if bcode != 0:
                    print(f"baseline failed ({bcode}): {berr}", file=sys.stderr)
                    ok = False
                for variant, where in (("yes", d), ("no", bare)):
                    size = sum(f.stat().st_size for f in where.iterdir())
                    wall, rss, cpu, walls, ran = median_check(
                        where, args.runs if n <= 10_000 else 1)
                    ok = ok and ran
                    print(f"real {mode} {n} services.json {variant}: check {wall:.2f}s (CPU "
                          f"{cpu:.2f}s) {rss:.0f} MiB (runs "
                          f"{', '.join(f'{w:.2f}' for w in walls)}), baseline {bwall:.2f}s",
                          file=sys.stderr)
                    rows.append((mode, n, variant, size, wall, cpu, rss, bwall, brss, walls))
            t = time.monotonic()
    print()
    print("check --from on bundles shaped like real nodes' (issue 31; lab/kube_proxy_rules/"
          "realistic.py), with and without services.json (median of the runs); baseline as "
          "above, of the same state (nftables: nft -c -f of its `nft list ruleset`, up to "
          f"{NFT_BASELINE_UP_TO // 1000}k)")
    print(f"{'mode':<9}{'services':>9}{'svc.json':>9}{'MB':>6}{'check s':>9}{'CPU s':>7}"
          f"{'RSS MiB':>9}{'base s':>8}{'base MiB':>9}{'check/base':>11}  runs")
    for mode, n, variant, size, wall, cpu, rss, bwall, brss, walls in rows:
        print(f"{mode:<9}{n:>9}{variant:>9}{size / 1e6:>6.0f}{wall:>9.2f}{cpu:>7.2f}"
              f"{rss:>9.0f}" + (f"{bwall:>8.2f}{brss:>9.0f}{wall / bwall:>11.1f}" if bwall
                                else f"{'-':>8}{'-':>9}{'-':>11}")
              + "  " + ", ".join(f"{w:.2f}" for w in walls))
    print()
    by = {(mode, n, variant): (wall, cpu, rss)
          for mode, n, variant, _, wall, cpu, rss, _, _, _ in rows}
    for mode in modes:
        for variant in ("yes", "no"):
            label = f"{mode} {'with' if variant == 'yes' else 'without'} services.json"
            if (mode, 10_000, variant) in by:
                wall, cpu, rss = by[(mode, 10_000, variant)]
                hit = wall <= REAL_TARGET_10K_SECONDS and rss <= REAL_TARGET_10K_MIB
                print(f"real {label}: 10k services in {wall:.2f}s (CPU {cpu:.2f}s) and "
                      f"{rss:.0f} MiB (targets <= {REAL_TARGET_10K_SECONDS}s, <= "
                      f"{REAL_TARGET_10K_MIB:.0f} MiB): {'PASS' if hit else 'MISS'}")
                ok &= hit
            if (mode, 10_000, variant) in by and (mode, 50_000, variant) in by:
                (w10, c10, m10), (w50, c50, m50) = (by[(mode, 10_000, variant)],
                                                    by[(mode, 50_000, variant)])
                hit = c50 / c10 <= REAL_TARGET_50K_CPU_RATIO
                print(f"real {label}: 10k -> 50k services took x{c50 / c10:.2f} the CPU time "
                      f"(wall x{w50 / w10:.2f}, memory x{m50 / m10:.2f}; target <= "
                      f"x{REAL_TARGET_50K_CPU_RATIO}): {'PASS' if hit else 'MISS'}")
                ok &= hit
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
