"""The pod routes probe on a real main table, in a namespace it builds: what it keeps
(link-scope and blackhole routes; of the routes to single addresses, the lowest of each
kind of interface), each line as iproute2 prints it, and a pod started elsewhere on the
node that leaves what it reads unchanged (the daemon walks the LB IPs again only when
the snapshot changed)."""

from __future__ import annotations

import os
import sys

import pytest

from lab.netns import Netns, netns

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")]

READ = ("from agent.probes.pod_routes import read_pod_routes, render\n"
        "routes, dropped = read_pod_routes()\n"
        "print(render(routes), end='')\n"
        "print('dropped', dropped)\n")
# an AKS-like node: Azure CNI's routed veths, a Calico-like one beside them, the uplink's
# connected route and a gateway host route on it (GCE writes one), a blackhole route
# (Calico's block) and a route through a gateway (another node's pods: not kept)
NODE = """
ip link set lo up
ip link add eth0 type veth peer name eth0p
ip link set eth0 up
ip link set eth0p up
ip addr add 10.224.0.4/16 dev eth0
ip route add 10.224.0.1 dev eth0 scope link
for dev in azv0a1b2c3d4e5 azv8c1b2e3d4f5 cali3f5d1e2a9b8 azvffff0000; do
    ip link add $dev type veth peer name p${dev#???}
    ip link set $dev up
    ip link set p${dev#???} up
done
ip route add 10.224.0.61 dev azv8c1b2e3d4f5
ip route add 10.224.0.33 dev azv0a1b2c3d4e5
ip route add 10.224.0.90 dev cali3f5d1e2a9b8
ip route add blackhole 10.244.1.0/26
ip route add 10.50.0.0/16 via 10.224.0.1
ip -6 route add fd00:10::61 dev azv8c1b2e3d4f5
ip -6 route add fd00:10::33 dev azv0a1b2c3d4e5
ip -6 route add fd00:99::/64 via fe80::1 dev eth0
"""


def _read(ns: Netns) -> list[str]:
    proc = ns.run(sys.executable, "-c", READ, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_what_the_probe_keeps_as_iproute2_prints_it() -> None:
    with netns("lbr") as ns:
        ns.sh(NODE)
        got = _read(ns)
        assert got[-1] == "dropped 0"
        kept = got[:-1]
        shown = [line.rstrip() for family in ("-4", "-6") for line in ns.run(
            "ip", family, "route", "show", "table", "main").stdout.splitlines()]
        for line in kept:  # each as `ip route` prints it
            assert line in shown, (line, shown)
        dsts = [line.split()[1] if line.startswith("blackhole") else line.split()[0]
                for line in kept]
        assert dsts == ["10.224.0.0/16", "10.224.0.1", "10.224.0.33", "10.224.0.90",
                        "10.244.1.0/26", "fd00:10::33"], kept
        assert not any("10.224.0.61" in line or "10.50.0.0" in line for line in kept)
        # (IPv6 routes have no scope: neither a gateway's nor each link's fe80::/64 is kept)
        assert "fe80::/64 dev azv0a1b2c3d4e5 proto kernel metric 256 pref medium" in shown
        assert any(line.startswith("fd00:99::/64 via fe80::1 dev eth0") for line in shown)

        # a pod started elsewhere on the node: what the probe reads is the same
        ns.run("ip", "route", "add", "10.224.0.99", "dev", "azvffff0000")
        assert _read(ns) == got
        # the pod that stood for them is gone: the next one of its kind stands in
        ns.run("ip", "route", "del", "10.224.0.33")
        after = _read(ns)
        assert any(line.startswith("10.224.0.61 dev azv8c1b2e3d4f5") for line in after), after
        assert not any(line.startswith("10.224.0.33 ") for line in after)
