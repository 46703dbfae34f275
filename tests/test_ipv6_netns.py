"""IPv6 on a real kernel: what happens to a packet that arrives with one of the node's own
IPv6 addresses as its source (a load balancer health-checking from its VIP when the VIP
is bound on kube-ipvs0), and that the agent reports such a VIP, live and from a bundle.

IPv4 drops such a packet as a martian (in_martian_src; accept_local, rp_filter). IPv6 has
neither the check nor the sysctls: the SYN is taken in and answered, but the answer's
destination is a local address, so it is routed to lo and the node resets its own
half-open connection. The client never sees a SYN-ACK: the health check fails all the
same, with different traces (lo's IPv6 counters rise, no martian counter does)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.netns import Netns, netns, veth
from tests.nodestate import capture, settle

pytestmark = pytest.mark.netns

NODE_IP, CLIENT_IP = "2001:db8:1::10", "2001:db8:1::20"
VIP = "2001:db8:ff::7"  # the LB's address, bound on the node's kube-ipvs0
NODE_PORT = 30080


@pytest.fixture
def pair() -> Iterator[tuple[Netns, Netns]]:
    """node (eth0, kube-ipvs0 DOWN with the VIP, a listener's port) and lb (the load
    balancer's side, which owns the VIP too and sends from it)."""
    with netns("lb6n") as node, netns("lb6c") as lb:
        veth(node, "eth0", lb, "eth1")
        node.sh(f"ip link set lo up && ip addr add {NODE_IP}/64 dev eth0 nodad && "
                "ip link set eth0 up && ip link add kube-ipvs0 type bridge && "
                f"ip addr add {VIP}/128 dev kube-ipvs0 nodad")
        lb.sh(f"ip link set lo up && ip addr add {CLIENT_IP}/64 dev eth1 nodad && "
              f"ip link set eth1 up && ip addr add {VIP}/128 dev lo nodad")
        settle(node)
        settle(lb)
        yield node, lb


def _snmp6(ns: Netns, dev: str) -> dict[str, int]:
    text = ns.run("cat", f"/proc/net/dev_snmp6/{dev}").stdout
    return {k: int(v) for k, v in (line.split() for line in text.splitlines())}


def _tcp_out_segs(ns: Netns) -> int:
    """TCP segments the namespace sent (both families: /proc/net/snmp's Tcp line)."""
    head, values = (line.split() for line in ns.run("cat", "/proc/net/snmp").stdout
                    .splitlines() if line.startswith("Tcp:"))
    return int(values[head.index("OutSegs")])


def _health_check(node: Netns, lb: Netns, source: str) -> str:
    """One TCP health check from ``source`` to the node's port: "open" or the error."""
    script = (
        "import socket\n"
        "s = socket.socket(socket.AF_INET6)\n"
        "s.settimeout(1.5)\n"
        f"s.bind(({source!r}, 0))\n"
        "try:\n"
        f"    s.connect(({NODE_IP!r}, {NODE_PORT}))\n"
        "    print('open')\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n")
    return lb.run(sys.executable, "-c", script, timeout=30).stdout.strip()


def _listener(node: Netns):  # type: ignore[no-untyped-def]
    script = ("import socket, time\n"
              "s = socket.socket(socket.AF_INET6)\n"
              "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              f"s.bind(('::', {NODE_PORT}))\n"
              "s.listen(16)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    proc = node.popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_kernel_answers_a_packet_from_its_own_ipv6_address_to_itself(
        pair: tuple[Netns, Netns]) -> None:
    node, lb = pair
    listener = _listener(node)
    try:
        # warm the neighbour caches: only the handshake moves the counters below
        assert _health_check(node, lb, CLIENT_IP) == "open"
        time.sleep(0.5)  # the warm-up connection's close is answered meanwhile
        lo_before, up_before = _snmp6(node, "lo"), _snmp6(node, "eth0")
        tcp_before = _tcp_out_segs(node)
        outcome = _health_check(node, lb, VIP)
        lo_after, up_after = _snmp6(node, "lo"), _snmp6(node, "eth0")
        tcp_after = _tcp_out_segs(node)
        # the control: the same check once the VIP is not the node's passes
        node.run("ip", "addr", "del", f"{VIP}/128", "dev", "kube-ipvs0")
        node.run("ip", "route", "add", f"{VIP}/128", "via", CLIENT_IP)
        control = _health_check(node, lb, VIP)
    finally:
        listener.kill()
        listener.wait()
    assert outcome == "TimeoutError", outcome
    assert control == "open", control
    # the SYNs arrived on eth0 and were delivered (no address/martian error) ...
    assert up_after["Ip6InReceives"] > up_before["Ip6InReceives"]
    assert up_after["Ip6InAddrErrors"] == up_before["Ip6InAddrErrors"]
    assert up_after["Ip6InDiscards"] == up_before["Ip6InDiscards"]
    # ... and every TCP segment the node sent (its SYN-ACKs, then its resets of them)
    # went to lo, none out of eth0
    tcp_sent = tcp_after - tcp_before
    assert tcp_sent >= 2
    assert lo_after["Ip6InReceives"] - lo_before["Ip6InReceives"] == tcp_sent


def _services_json() -> str:
    svc = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "web6", "namespace": "default"},
           "spec": {"type": "LoadBalancer", "ipFamilies": ["IPv6"],
                    "ipFamilyPolicy": "SingleStack", "clusterIP": "fd00:96::10",
                    "ports": [{"port": 80, "protocol": "TCP", "nodePort": NODE_PORT}],
                    "externalTrafficPolicy": "Cluster"},
           "status": {"loadBalancer": {"ingress": [{"ip": VIP}]}}}
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [svc]})


def _agent(ns: Netns, *args: str) -> dict:  # type: ignore[type-arg]
    r = ns.run(sys.executable, "-m", "agent", *args, check=False, timeout=120)
    assert r.returncode in (0, 1, 3), r.stderr  # 3: its IPv6 rules are not all walked
    return json.loads(r.stdout)


def _lb_ip_local(verdict: dict) -> list[dict]:  # type: ignore[type-arg]
    return [f for f in verdict["findings"] if f["id"] == "lb-ip-local"]


def test_ipv6_vip_on_kube_ipvs0_is_reported_live_and_from_the_bundle(
        pair: tuple[Netns, Netns], tmp_path: Path) -> None:
    node, _ = pair
    kube = tmp_path / "kube"
    kube.mkdir()
    (kube / "services.json").write_text(_services_json())
    before = capture(node)
    live = _agent(node, "check", "--json", "--all", "--node-name", "n6", "--kube-json", str(kube))
    bundle = tmp_path / "bundle"
    node.run(sys.executable, "-m", "agent", "bundle", str(bundle), "--no-kube-api",
             timeout=120)
    assert capture(node) == before  # read-only
    (bundle / "services.json").write_text(_services_json())
    offline = _agent(node, "check", "--json", "--all", "--from", str(bundle))
    for verdict in (live, offline):
        found = _lb_ip_local(verdict)
        assert [f["lb_ip"] for f in found] == [VIP], verdict["findings"]
        assert "IPv6" in found[0]["summary"] and "lo" in found[0]["summary"]
        assert any(f"local {VIP} dev kube-ipvs0" in e for e in found[0]["evidence"])
        assert found[0]["service"] == "default/web6"
    assert _lb_ip_local(live)[0]["evidence"] == _lb_ip_local(offline)[0]["evidence"]

    # the VIP gone from the node: nothing to report (the rule can say no)
    node.run("ip", "addr", "del", f"{VIP}/128", "dev", "kube-ipvs0")
    healed = _agent(node, "check", "--json", "--all", "--node-name", "n6", "--kube-json", str(kube))
    assert _lb_ip_local(healed) == []


def test_ipv4_only_local_table_leaves_the_ipv6_vip_undecided(tmp_path: Path) -> None:
    """An old bundle's route-local.txt (IPv4 only) cannot say the VIP is not local."""
    (tmp_path / "route-local.txt").write_text(
        "local 10.0.0.10 dev eth0 proto kernel scope host src 10.0.0.10\n"
        "local 127.0.0.0/8 dev lo proto kernel scope host src 127.0.0.1\n")
    (tmp_path / "services.json").write_text(_services_json())
    p = subprocess.run([sys.executable, "-m", "agent", "check", "--json", "--all", "--from",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    verdict = json.loads(p.stdout)
    assert _lb_ip_local(verdict) == []
    assert any(u["source"] == "lb-ip-local" and "IPv6 local" in u["reason"]
               for u in verdict["unknowns"]), verdict["unknowns"]


def test_an_ipv6_lb_ip_written_another_way_is_the_same_address(tmp_path: Path) -> None:
    """A Service may write 2001:DB8:FF:0::7; `ip route` prints 2001:db8:ff::7."""
    (tmp_path / "route-local.txt").write_text(
        f"local ::1 dev lo proto kernel metric 0 pref medium\n"
        f"local {VIP} dev kube-ipvs0 proto kernel metric 0 pref medium\n")
    (tmp_path / "services.json").write_text(
        _services_json().replace(f'"ip": "{VIP}"', '"ip": "2001:DB8:FF:0::7"'))
    p = subprocess.run([sys.executable, "-m", "agent", "check", "--json", "--all", "--from",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    verdict = json.loads(p.stdout)
    assert [f["lb_ip"] for f in _lb_ip_local(verdict)] == [VIP], verdict["findings"]
