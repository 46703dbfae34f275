"""IPv6 at scale beside IPv4, in one process: a node of N LoadBalancer services (kube-proxy
iptables mode, the generator's new generation) written once by the IPv4 proxier and once by
the IPv6 one (the same Services, IPv6 addresses), read from text and diagnosed. Time and
the peak of Python allocations (tracemalloc, in a run of its own) per family, interleaved,
best of --runs; the IPv4 figure is the baseline and the IPv6/IPv4 ratio is printed beside
each. Measured at 10k services (best of 3, load ~3.4 on 2 shared cores): IPv4 3.81 s CPU,
80.6 MiB; IPv6 4.28 s, 83.1 MiB (1.12x time, 1.03x memory), 11,667 findings each."""

from __future__ import annotations

import argparse
import gc
import ipaddress
import json
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.bundle import load_texts
from agent.diagnose import diagnose
from lab.kube_proxy_rules import LbService, iptables_mode, services_json


def bundle(n: int, family: int) -> list[tuple[str, str, str]]:
    v6 = family == 6

    def a(base: str, i: int) -> str:
        return str(ipaddress.ip_address(base) + i)

    svcs = []
    for i in range(n):
        etp = "Local" if i % 2 else "Cluster"
        svcs.append(LbService(
            namespace=f"ns{i // 100}", name=f"svc{i}", node_port=30000 + i,
            cluster_ip=a("fd00:96::" if v6 else "10.96.0.0", 10 + i),
            lb_ip=a("2001:db8:ff::" if v6 else "10.0.32.0", 1 + i), etp=etp,
            local_endpoints=(a("fd00:10:244:1::" if v6 else "172.16.1.0", 2 + i % 250),)
            if i % 3 else (),
            remote_endpoints=(a("fd00:10:244:2::" if v6 else "172.16.2.0", 2 + i % 250),),
            health_check_node_port=10000 + i if etp == "Local" else None))
    rules = iptables_mode(svcs, cluster_cidr="fd00:10:244::/56" if v6 else "172.16.0.0/16",
                          node_ip="2001:db8:1::10" if v6 else "10.0.0.10", family=family)
    addr = ("2: eth0: <BROADCAST,UP,LOWER_UP> mtu 1500 state UP\n"
            "    inet 10.0.0.10/24 scope global eth0\n    inet6 2001:db8:1::10/64 scope global\n"
            "3: cni0: <BROADCAST,UP,LOWER_UP> mtu 1500 state UP\n"
            "    inet 172.16.1.1/24 scope global cni0\n"
            "    inet6 fd00:10:244:1::1/64 scope global\n")
    return [("ip6tables-save.txt" if v6 else "iptables-save.txt", rules, "unknown"),
            ("services.json", json.dumps(services_json(svcs)), "unknown"),
            ("addr.txt", addr, "unknown")]


def once(files: list[tuple[str, str, str]], trace: bool) -> tuple[float, float, int]:
    """(CPU seconds, or the traced peak MiB when ``trace``: tracemalloc slows the run
    several times, so time and memory are measured in different runs; findings)."""
    gc.collect()
    if trace:
        tracemalloc.start()
    t0 = time.process_time()
    v = diagnose(load_texts(files, origin="bundle:bench"), "n")
    cpu = time.process_time() - t0
    peak = tracemalloc.get_traced_memory()[1] / 2**20 if trace else 0.0
    if trace:
        tracemalloc.stop()
    return cpu, peak, len(v.findings)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    files = {f: bundle(args.services, f) for f in (4, 6)}
    best: dict[int, tuple[float, float, int]] = {}
    for _ in range(args.runs):
        for fam in (4, 6):  # interleaved: the machine's load hits both alike
            got = once(files[fam], trace=False)
            if fam not in best or got[0] < best[fam][0]:
                best[fam] = got
    peak = {fam: once(files[fam], trace=True)[1] for fam in (4, 6)}
    (c4, _, n4), (c6, _, n6) = best[4], best[6]
    m4, m6 = peak[4], peak[6]
    print(f"{args.services} services, best of {args.runs} (CPU s; tracemalloc peak MiB, "
          "one traced run):")
    print(f"  IPv4 (baseline) {c4:6.2f} s {m4:7.1f} MiB  {n4} findings")
    print(f"  IPv6            {c6:6.2f} s {m6:7.1f} MiB  {n6} findings  "
          f"ratio {c6 / c4:.2f} time, {m6 / m4:.2f} memory")


if __name__ == "__main__":
    main()
