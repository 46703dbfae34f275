"""`make bench`: the verdict document's size, and what encoding it costs, at 10k and 50k
LoadBalancer Services in each kube-proxy mode (issue 32), beside the same verdict
itemised as schema v1 did (``to_dict("all")``: every finding with its evidence, every LB
IP listed), measured in the same run.

Bundles: the real-shaped ones (lab/kube_proxy_rules/realistic.py: kubectl's
services.json, `ipvsadm -Ln`, 2-5 endpoints, ~30 % eTP=Local, ~10 % two ports). In
iptables and nftables mode such a node is healthy; in IPVS mode half its VIPs are bound
on kube-ipvs0 (lb-ip-local) and some of the other half (TKE's) leave unmasqueraded: some
6,700 of its 11,000 LB IP:ports have a finding that is not fine, each of which the
summary must name.

Targets: a healthy node's summary at most 256 KB at 10k and 1 MB at 50k; the mostly
exposed IPVS node's at most 4 MB at 10k (and every such finding named). Each prints PASS
or MISS; a MISS makes the exit code 1. The summary is also the daemon's held copy for
/verdict and what is spooled and shipped: its encoding time is printed beside v1's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose
from lab.kube_proxy_rules.realistic import realistic, realistic_services

HEALTHY_MAX = {10_000: 256 * 1024, 50_000: 1024 * 1024}
EXPOSED_MAX_10K = 4 * 1024 * 1024


def encode(doc: dict[str, object]) -> tuple[int, float]:
    t0 = time.process_time()
    text = json.dumps(doc, separators=(",", ":"))
    return len(text.encode()), time.process_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,50000")
    ap.add_argument("--modes", default="iptables,ipvs,nftables")
    args = ap.parse_args()
    ok = True
    for n in (int(x) for x in args.sizes.split(",")):
        svcs = realistic_services(n)
        for mode in args.modes.split(","):
            files = realistic(n, mode, services=svcs)
            v = diagnose(load_texts([(k, t, name_format(k)) for k, t in files.items()],
                                    origin="bundle:bench"), "bench")
            del files
            t0 = time.process_time()
            summary = v.to_dict()
            build = time.process_time() - t0
            size, enc = encode(summary)
            t0 = time.process_time()
            full = v.to_dict("all")
            build_all = time.process_time() - t0
            size_all, enc_all = encode(full)
            not_fine = [f for f in v.findings if f.severity != "info" and f.lb_ip]
            named = {(f["id"], f["lb_ip"], f["port"]) for f in summary["findings"]}
            all_named = all((f.id, f.lb_ip, f.port) in named for f in not_fine)
            print(f"{mode:9} {n:>6} services, {v.status:8}: summary {size / 1024:8.0f} KiB "
                  f"(to_dict {build:.2f} s + encode {enc:.2f} s CPU); v1-style all "
                  f"{size_all / 2**20:6.1f} MiB ({build_all:.2f} s + {enc_all:.2f} s): "
                  f"x{size_all / size:.0f} smaller; {len(not_fine)} findings not fine, "
                  f"{'all' if all_named else 'NOT all'} named")
            if v.status == "healthy":
                limit = HEALTHY_MAX.get(n)
                if limit is not None:
                    hit = size <= limit
                    ok &= hit
                    print(f"  {'PASS' if hit else 'MISS'}: healthy at {n}: {size / 1024:.0f} "
                          f"KiB, at most {limit / 1024:.0f} KiB")
            elif n == 10_000:
                hit = size <= EXPOSED_MAX_10K and all_named
                ok &= hit
                print(f"  {'PASS' if hit else 'MISS'}: {len(not_fine)} of "
                      f"{len(v.findings)} findings not fine at 10k, every one named: "
                      f"{size / 2**20:.2f} MiB, at most 4 MiB")
            sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
