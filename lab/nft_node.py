"""An nftables-mode node (kube-proxy's `ip kube-proxy` table) out of real kernel objects,
in network namespaces made here; nothing is done in the root namespace::

  pod  10.0.1.5 --- cni0 10.0.1.1 [node] eth0 192.168.0.2 --- 192.168.0.100 client
                                    [node] ep0 10.99.0.1 --- 10.99.0.2 ep (10.180.0.1-5)

The client also holds 203.0.113.2 and 203.0.113.130 (in and out of kube-proxy's test
source range 203.0.113.0/25); the ep namespace answers on port 80 of every endpoint
address with the addresses it saw ("peer=... local=..."). The ruleset is loaded with
`nft -f`, its `add` lines sorted by kind (chains before the rules that jump to them).

Dual stack (``script6``, kube-proxy's `ip6 kube-proxy` table beside the `ip` one, as its
dual-stack proxier writes them): the same links carry IPv6 too::

  pod  fd00:10::5 --- cni0 fd00:10::1 [node] eth0 2001:db8::1 --- 2001:db8::100 client
                                       [node] ep0 fd00:99::1 --- fd00:99::2 ep
                                                                  (fd00:10:180::1-5)

the client also holding 2001:db8:203::2 and 2001:db8:203:1::130 (in and out of the
IPv6 source range 2001:db8:203::/64 of ``ipv6_of``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from lab.netns import Netns, netns, veth

_ORDER = {"table": 0, "set": 1, "map": 1, "chain": 2, "rule": 3, "element": 4}

# an endpoint server: answers each connection with the addresses it saw
_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 80)); s.listen(16)
while True:
    c, peer = s.accept()
    c.sendall(f"peer={peer[0]} local={c.getsockname()[0]}\\n".encode()); c.close()
"""
SERVER6 = """
import socket
s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s.bind(("::", 80)); s.listen(16)
while True:
    c, peer = s.accept()
    c.sendall(f"peer={peer[0]} local={c.getsockname()[0]}\\n".encode()); c.close()
"""
# 4 s: room for the SYN's two retransmissions (1 s, 3 s) when the first is lost while a
# neighbour is resolved under load (an IPv6 NodePort probe timed out at 2 s, 1 run in 3)
_CLIENT = """
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.settimeout(4)
if len(sys.argv) > 3:
    s.bind((sys.argv[3], 0))
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); print(s.recv(200).decode().strip())
except socket.timeout:
    print("timeout")
except OSError as e:
    print(f"error {e.errno}")
"""


# kube-proxy's IPv4 test conventions -> the IPv6 ones of its tests (pod CIDR fd00:10::/64,
# service CIDR fd00:10:96::/112, node 2001:db8::1) and documentation addresses for the
# rest: what its IPv6 proxier writes for the same Services (ip6 family, ipv6_addr keys,
# `ip6 saddr`, `dnat to [addr]:port`, endpoint chain names with ':' as '.')
V6_ADDRESSES = {
    "1.2.3.4": "2001:db8:1234::4", "5.6.7.8": "2001:db8:5678::8",
    "192.168.99.22": "2001:db8:99::22", "192.168.99.33": "2001:db8:99::33",
    "192.168.0.2": "2001:db8::1", "203.0.113.0/25": "2001:db8:203::/64",
    "10.0.0.0/8": "fd00:10::/64", "172.30.0.0/16": "fd00:10:96::/112",
    "127.0.0.0/8": "::1",
}


def ipv6_of(script: str) -> str:
    """kube-proxy's IPv4 nftables transaction rewritten as its IPv6 proxier writes the
    same Services (constructed: kube-proxy's tests state no IPv6 LoadBalancer ruleset)."""
    out = []
    for line in script.splitlines():
        line = line.replace(" ip kube-proxy ", " ip6 kube-proxy ").replace(
            "ipv4_addr", "ipv6_addr").replace(" ip daddr", " ip6 daddr").replace(
            " ip saddr", " ip6 saddr").replace("{ ip saddr }", "{ ip6 saddr }")
        for v4, v6 in V6_ADDRESSES.items():
            line = re.sub(rf"(?<![\d.]){re.escape(v4)}(?![\d./])", v6, line)
        line = re.sub(r"__10\.180\.0\.(\d)/", r"__fd00.10.180..\1/", line)
        line = re.sub(r"dnat to 10\.180\.0\.(\d):", r"dnat to [fd00:10:180::\1]:", line)
        line = re.sub(r"\b10\.180\.0\.(\d)\b", r"fd00:10:180::\1", line)
        line = re.sub(r"\b172\.30\.0\.(\d+)\b", r"fd00:10:96::\1", line)
        out.append(line)
    return "\n".join(out) + "\n"


def ordered(script: str) -> str:
    """An `nft -f` script's `add` lines sorted by kind: table, sets and maps, chains,
    rules, elements (a dump lists them by object; nft -f wants targets first)."""
    lines = [ln for ln in script.splitlines() if ln.strip() and not ln.startswith("#")]
    return "\n".join(sorted(lines, key=lambda ln: _ORDER[ln.split()[1]])) + "\n"


@contextmanager
def nft_node(script: str, script6: str | None = None) -> Iterator[dict[str, Netns]]:
    """The namespaces by role (node, pod, client, ep), the ruleset loaded on the node;
    with ``script6`` (an `ip6 kube-proxy` transaction) the node is dual-stack."""
    with ExitStack() as stack:
        ns = {k: stack.enter_context(netns(f"nft{k[:2]}")) for k in ("node", "pod", "client", "ep")}
        node, pod, client, ep = ns["node"], ns["pod"], ns["client"], ns["ep"]
        veth(node, "cni0", pod, "eth0")
        veth(node, "eth0", client, "eth0")
        veth(node, "ep0", ep, "eth0")
        node.sh("""
            ip addr add 10.0.1.1/24 dev cni0; ip link set cni0 up
            ip addr add 192.168.0.2/24 dev eth0; ip link set eth0 up
            ip addr add 10.99.0.1/24 dev ep0; ip link set ep0 up
            ip route add 10.180.0.0/24 via 10.99.0.2
            ip route add default via 192.168.0.100
            sysctl -qw net.ipv4.ip_forward=1
        """)
        pod.sh("ip addr add 10.0.1.5/24 dev eth0; ip link set eth0 up; "
               "ip route add default via 10.0.1.1")
        # two outside clients of the load balancer's source range 203.0.113.0/25: one in
        # it, one not
        client.sh("ip addr add 192.168.0.100/24 dev eth0; ip link set eth0 up; "
                  "ip addr add 203.0.113.2/32 dev eth0; ip addr add 203.0.113.130/32 dev eth0; "
                  "ip route add default via 192.168.0.2")
        ep.sh("ip addr add 10.99.0.2/24 dev eth0; ip link set eth0 up; "
              "ip route add default via 10.99.0.1; "
              + "; ".join(f"ip addr add 10.180.0.{i}/32 dev lo" for i in range(1, 6)))
        if script6 is not None:
            _dual_stack(node, pod, client, ep)
        node.run("nft", "-f", "-", input=ordered(script + (script6 or "")))
        serve(stack, ep, "10.180.0.1")
        if script6 is not None:
            serve(stack, ep, "fd00:10:180::1", SERVER6)
        yield ns


def _dual_stack(node: Netns, pod: Netns, client: Netns, ep: Netns) -> None:
    """The IPv6 addresses and routes of the picture above (nodad: no 2 s of DAD)."""
    node.sh("""
        ip -6 addr add fd00:10::1/64 dev cni0 nodad
        ip -6 addr add 2001:db8::1/64 dev eth0 nodad
        ip -6 addr add fd00:99::1/64 dev ep0 nodad
        ip -6 route add fd00:10:180::/64 via fd00:99::2
        ip -6 route add default via 2001:db8::100
        sysctl -qw net.ipv6.conf.all.forwarding=1
    """)
    pod.sh("ip -6 addr add fd00:10::5/64 dev eth0 nodad; ip -6 route add default via fd00:10::1")
    client.sh("ip -6 addr add 2001:db8::100/64 dev eth0 nodad; "
              "ip -6 addr add 2001:db8:203::2/128 dev eth0 nodad; "
              "ip -6 addr add 2001:db8:203:1::130/128 dev eth0 nodad; "
              "ip -6 route add default via 2001:db8::1")
    ep.sh("ip -6 addr add fd00:99::2/64 dev eth0 nodad; ip -6 route add default via fd00:99::1; "
          + "; ".join(f"ip -6 addr add fd00:10:180::{i}/128 dev lo nodad" for i in range(1, 6)))


def serve(stack: ExitStack, ns: Netns, probe_ip: str, code: str = _SERVER) -> None:
    """Answer on port 80 of every address of ``ns`` until ``stack`` closes; back once
    ``probe_ip`` answers."""
    server = ns.popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)
    stack.callback(server.wait, 5)
    stack.callback(server.kill)
    for _ in range(50):
        if "peer=" in connect(ns, probe_ip, 80):
            break
        time.sleep(0.1)


def connect(ns: Netns, ip: str, port: int, src: str | None = None) -> str:
    return ns.run(sys.executable, "-c", _CLIENT, ip, str(port), *([src] if src else []),
                  check=False, timeout=30).stdout.strip()
