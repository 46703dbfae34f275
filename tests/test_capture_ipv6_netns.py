"""IPv6 NodePort handshakes on a real kernel, watched by the capture: what the wire shows
when IPv6 loops, and the findings it gives.

A node (uplink eth0, kube-ipvs0 holding the VIP, a pod behind cni0) and a load balancer
(the VPC side: DNAT of its LB address to the node's NodePort, keeping the client's
source, as a CLB does; it owns the VIP too and health-checks from it). IPv6 has no
martian-source check (tests/test_ipv6_netns.py): the kernel answers the health check,
but the SYN-ACK's destination is local, so it goes to lo and the node resets its own
half-open connection there. The capture sees the SYN come in on eth0 and the reply
leave through lo: ``bypassed`` (reply through lo, no client RST), never ``unanswered``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.capture.handshakes import DEFAULT_TIMEOUT as HANDSHAKE_TIMEOUT
from agent.capture.model import (
    ANSWERED,
    BYPASSED,
    SRC_LOCAL,
    SRC_OTHER,
    SRC_POD,
    UNANSWERED,
)
from lab.netns import Netns, netns, veth
from tests.nodestate import settle
from tests.test_capture_engine import Capture, counts

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"),
                                 reason="needs root for namespaces, and nft")]

PY = sys.executable
NODE6, LB_SIDE6 = "2001:db8:1::10", "2001:db8:1::1"
VIP6 = "2001:db8:ff::7"  # an LB address bound on the node's kube-ipvs0 (IPVS mode)
LB6 = "2001:db8:ff::8"  # an LB address the node does not hold: the LB DNATs it here
POD_NET, POD_GW, POD6 = "fd00:10::/64", "fd00:10::1", "fd00:10::5"
NODE_PORT = 30080  # the VIP's Service
LB_NODE_PORT = 30081  # LB6's Service
DNAT_NODE_PORT, POD_PORT = 30082, 8080  # a Service whose NodePort the node DNATs to the pod

_SERVER = r"""
import select, socket, sys
socks = []
for port in sys.argv[1:]:
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::", int(port)))
    s.listen(64)
    socks.append(s)
print("listening", flush=True)
while True:
    for s in select.select(socks, [], [])[0]:
        c, _ = s.accept()
        c.close()
"""

_CONNECT = r"""
import socket, sys
src, dst, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET6)
s.settimeout(timeout)
if src:
    s.bind((src, 0))
try:
    s.connect((dst, port))
    print("connected")
except OSError as e:
    print(type(e).__name__)
finally:
    s.close()
"""


@dataclass
class Node6:
    node: Netns
    lb: Netns
    pod: Netns


def connect(ns: Netns, dst: str, port: int, src: str = "", timeout: float = 1.0) -> str:
    return ns.run(PY, "-c", _CONNECT, src, dst, str(port), str(timeout),
                  timeout=30).stdout.strip()


@pytest.fixture(scope="module")
def lab6() -> Iterator[Node6]:
    with netns("lc6n") as node, netns("lc6l") as lb, netns("lc6p") as pod:
        veth(node, "eth0", lb, "eth1")
        veth(pod, "eth0", node, "vethpod0")
        node.sh(f"""
            sysctl -q -w net.ipv6.conf.all.forwarding=1
            ip addr add {NODE6}/64 dev eth0 nodad
            ip link set eth0 up
            ip link add kube-ipvs0 type bridge
            ip addr add {VIP6}/128 dev kube-ipvs0 nodad
            ip link add cni0 type bridge
            ip addr add {POD_GW}/64 dev cni0 nodad
            ip link set cni0 up
            ip link set vethpod0 master cni0
            ip link set vethpod0 up
            ip -6 route add default via {LB_SIDE6} dev eth0
        """)
        # kube-proxy's NodePort: DNAT to a pod (DNAT_NODE_PORT; the others are served here)
        node.run("nft", "-f", "-", input=f"""
            table ip6 kp {{
                chain pre {{
                    type nat hook prerouting priority -100;
                    tcp dport {DNAT_NODE_PORT} dnat to [{POD6}]:{POD_PORT}
                }}
            }}
        """)
        lb.sh(f"""
            sysctl -q -w net.ipv6.conf.all.forwarding=1
            ip addr add {LB_SIDE6}/64 dev eth1 nodad
            ip link set eth1 up
            ip addr add {VIP6}/128 dev lo nodad
            ip -6 route add {POD_NET} via {NODE6} dev eth1
        """)
        lb.run("nft", "-f", "-", input=f"""
            table ip6 lb {{
                chain pre {{
                    type nat hook prerouting priority -100;
                    ip6 daddr {LB6} tcp dport 80 dnat to [{NODE6}]:{LB_NODE_PORT}
                }}
            }}
        """)
        pod.sh(f"""
            ip addr add {POD6}/64 dev eth0 nodad
            ip link set eth0 up
            ip -6 route add default via {POD_GW} dev eth0
        """)
        for ns in (node, lb, pod):
            settle(ns)
        server = node.popen([PY, "-c", _SERVER, str(NODE_PORT), str(LB_NODE_PORT)],
                            stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None and server.stdout.readline() == "listening\n"
            # neighbour entries first, so the captures below see only handshakes
            assert connect(lb, NODE6, NODE_PORT, timeout=3) == "connected"
            assert connect(pod, POD_GW, NODE_PORT, timeout=3) == "connected"
            yield Node6(node, lb, pod)
        finally:
            server.kill()
            server.wait()


def test_ipv6_handshakes_as_the_capture_sees_them(lab6: Node6) -> None:
    """The three IPv6 cases on one capture: a client (answered), the LB's health check
    from the VIP bound here (answered to lo: bypassed, no client RST), and a pod reaching
    the LB address that the LB sends back here (answered straight to the pod: bypassed,
    the pod resets it)."""
    c = lab6
    cap = Capture(c.node, seconds=3.0, handshake_timeout=1.5,
                  classes={VIP6: SRC_LOCAL, POD6: SRC_POD},
                  local_addresses=[NODE6, VIP6, POD_GW, "::1"])
    assert connect(c.lb, NODE6, NODE_PORT) == "connected"
    assert connect(c.lb, NODE6, NODE_PORT, src=VIP6) == "TimeoutError"
    assert connect(c.pod, LB6, 80) == "TimeoutError"  # the SYN-ACK came from NODE6
    result = cap.result()
    assert result["problems"] == [] and result["kernel_drops"] == 0
    assert result["decode_errors"] == 0
    assert counts(result) == {NODE_PORT: {ANSWERED: {SRC_OTHER: 1},
                                          BYPASSED: {SRC_LOCAL: 1}},
                              LB_NODE_PORT: {BYPASSED: {SRC_POD: 1}}}
    samples = {s["source_class"]: s for p in result["ports"] for s in p["samples"]}
    assert samples[SRC_LOCAL] == {
        "src": VIP6, "sport": samples[SRC_LOCAL]["sport"], "dst": NODE6,
        "dport": NODE_PORT, "in_iface": "eth0", "outcome": BYPASSED,
        "source_class": SRC_LOCAL, "reply_iface": "lo", "peer_reset": False}
    loop = samples[SRC_POD]
    assert (loop["src"], loop["dst"], loop["in_iface"], loop["reply_iface"],
            loop["peer_reset"]) == (POD6, NODE6, "eth0", "cni0", True)
    assert samples[SRC_OTHER]["src"] == LB_SIDE6
    failed = {(f["source_class"], f["outcome"]): f for f in result["failures"]}
    assert failed[(SRC_LOCAL, BYPASSED)]["src"] == VIP6


def test_a_health_check_to_a_nodeport_dnated_to_a_pod_gets_no_answer_out(
        lab6: Node6) -> None:
    """kube-proxy's NodePort DNATs to a pod: the health check from the VIP bound here is
    taken in (no martian drop), the pod answers, but its SYN-ACK is addressed to the VIP,
    this node's own address, so the node takes it in and resets the pod's half-open
    connection: nothing leaves, and the capture sees no answer (``unanswered``, not
    ``bypassed`` through lo as for a listener on the node). The reset is counted in the
    pod's namespace, not the node's (TcpExtEmbryonicRsts)."""
    from agent.capture.corroborate import parse_netstat

    def embryonic_rsts(ns: Netns) -> int:
        return parse_netstat(ns.run("cat", "/proc/net/netstat").stdout)["TcpExtEmbryonicRsts"]

    c = lab6
    server = c.pod.popen([PY, "-c", _SERVER, str(POD_PORT)], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        assert connect(c.lb, NODE6, DNAT_NODE_PORT, timeout=3) == "connected"  # warm
        before = embryonic_rsts(c.node), embryonic_rsts(c.pod)
        cap = Capture(c.node, seconds=2.5, handshake_timeout=1.0,
                      classes={VIP6: SRC_LOCAL, POD6: SRC_POD},
                      local_addresses=[NODE6, VIP6, POD_GW, "::1"])
        assert connect(c.lb, NODE6, DNAT_NODE_PORT) == "connected"
        assert connect(c.lb, NODE6, DNAT_NODE_PORT, src=VIP6) == "TimeoutError"
        result = cap.result()
        after = embryonic_rsts(c.node), embryonic_rsts(c.pod)
    finally:
        server.kill()
        server.wait()
    assert result["problems"] == [] and result["kernel_drops"] == 0
    assert counts(result) == {DNAT_NODE_PORT: {ANSWERED: {SRC_OTHER: 1},
                                               UNANSWERED: {SRC_LOCAL: 1}}}
    assert after[0] == before[0] and after[1] - before[1] >= 1


# --- `check --capture` on the node --------------------------------------------------------

def _services(tmp: Path) -> Path:
    kube = tmp / "kube"
    kube.mkdir()
    items = [{"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": name, "namespace": "default"},
              "spec": {"type": "LoadBalancer", "ipFamilies": ["IPv6"],
                       "ipFamilyPolicy": "SingleStack", "clusterIP": cluster_ip,
                       "ports": [{"port": 80, "protocol": "TCP", "nodePort": port}],
                       "externalTrafficPolicy": "Cluster"},
              "status": {"loadBalancer": {"ingress": [{"ip": ip}]}}}
             for name, cluster_ip, port, ip in (("web6", "fd00:96::10", NODE_PORT, VIP6),
                                                ("shop6", "fd00:96::11", LB_NODE_PORT, LB6))]
    (kube / "services.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List",
                                                    "items": items}))
    return kube


def check_while(node: Netns, kube: Path, drive: Any) -> dict[str, Any]:
    """`check --capture` in the node while ``drive()`` makes traffic; Ctrl-C once every
    SYN is judged (as tests/test_capture_netns.py does)."""
    proc = node.popen([PY, "-m", "agent", "check", "--json", "--all", "--capture", "60s",
                       "--kube-json", str(kube), "--node-name", "n6"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []
    capturing = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "capturing NodePorts" in line:
                capturing.set()

    out: list[str] = []
    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=lambda: out.append(proc.stdout.read()),  # type: ignore[union-attr]
                                daemon=True)]
    for t in readers:
        t.start()
    try:
        assert capturing.wait(60), "".join(lines)
        drive()
        time.sleep(HANDSHAKE_TIMEOUT + 0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        for t in readers:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(lines)
    assert "Traceback" not in err, err
    verdict: dict[str, Any] = json.loads(out[0])
    return verdict


def test_ipv6_health_check_and_pod_loop_are_observed(lab6: Node6, tmp_path: Path) -> None:
    """One `check --capture` (each costs seconds): the LB health-checking from the VIP
    bound here, and a pod reaching LB6, which the LB sends back to this node. No Node
    object: the pod prefix is cni0's IPv6 network (capture.classify)."""
    c = lab6
    kube = _services(tmp_path)

    def drive() -> None:
        for _ in range(3):
            connect(c.lb, NODE6, NODE_PORT, src=VIP6, timeout=0.5)
        for _ in range(2):
            connect(c.pod, LB6, 80, timeout=0.5)

    v = check_while(c.node, kube, drive)
    assert v["status"] == "loopback", v["findings"]
    ids = [x["id"] for x in v["findings"]]
    (f,) = [f for f in v["findings"] if f["id"] == "healthcheck-dropped-local-source"]
    assert f["lb_ip"] == VIP6 and f["service"] == "default/web6" and f["port"] == NODE_PORT
    assert f["data"]["source"] == VIP6 and f["data"]["bypassed"] == 3
    # IPv6 has no martian check: the finding says what happened instead
    assert "martian" not in f["summary"] and "went to lo" in f["summary"], f["summary"]
    assert f"came from {VIP6}" in f["summary"]
    assert any(e.startswith(f"[{VIP6}]:") and "SYN-ACK left through lo" in e
               for e in f["evidence"]), f["evidence"]
    # the static check names the same cause
    assert "lb-ip-local" in ids

    (f,) = [f for f in v["findings"] if f["id"] == "loopback-observed"]  # LB6's only
    assert f["lb_ip"] == LB6 and f["service"] == "default/shop6" and f["port"] == LB_NODE_PORT
    assert "bypassed from pod: 2" in f["evidence"][0], f["evidence"]
    samples = [e for e in f["evidence"] if e.startswith(f"[{POD6}]:")]
    assert len(samples) == 2 and all(
        f"-> [{NODE6}]:{LB_NODE_PORT} in eth0 (pod): SYN-ACK left through cni0" in e
        and "bypassed the load balancer" in e and "client reset it" in e for e in samples)
    assert "nodeport-syn-unanswered" not in ids
    # the kernel's side: each of the 5 half-open connections ended by a reset (the node's
    # own after its SYN-ACK went to lo; the pod's), none by a martian or rp_filter drop
    corr = {x["source"]: x for x in v["capture"]["corroboration"]}
    assert corr["TcpExtEmbryonicRsts"]["value"] >= 5, corr
    assert corr["TcpExtIPReversePathFilter"]["value"] == 0, corr
    assert any(e.startswith("TcpExtEmbryonicRsts: ") for e in f["evidence"])


def test_ipv6_nodeport_handshake_that_completes_is_healthy(lab6: Node6,
                                                           tmp_path: Path) -> None:
    c = lab6
    kube = _services(tmp_path)
    c.node.run("ip", "addr", "del", f"{VIP6}/128", "dev", "kube-ipvs0")
    try:
        v = check_while(c.node, kube, lambda: [
            connect(c.lb, NODE6, NODE_PORT, src=src) for src in (LB_SIDE6, VIP6)])
    finally:
        c.node.run("ip", "addr", "add", f"{VIP6}/128", "dev", "kube-ipvs0", "nodad")
    # nothing observed (the static IPv6 walk may still be undecided: not the capture's)
    assert not {"loopback-observed", "healthcheck-dropped-local-source",
                "nodeport-syn-unanswered"} & {f["id"] for f in v["findings"]}, v["findings"]
    assert v["status"] != "loopback"
    port = next(p for p in v["capture"]["ports"] if p["node_port"] == NODE_PORT)
    assert port["counts"] == {"answered": {"lb-ip": 1, "other": 1}}
