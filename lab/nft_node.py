"""An nftables-mode node (kube-proxy's `ip kube-proxy` table) out of real kernel objects,
in network namespaces made here; nothing is done in the root namespace::

  pod  10.0.1.5 --- cni0 10.0.1.1 [node] eth0 192.168.0.2 --- 192.168.0.100 client
                                    [node] ep0 10.99.0.1 --- 10.99.0.2 ep (10.180.0.1-5)

The client also holds 203.0.113.2 and 203.0.113.130 (in and out of kube-proxy's test
source range 203.0.113.0/25); the ep namespace answers on port 80 of every endpoint
address with the addresses it saw ("peer=... local=..."). The ruleset is loaded with
`nft -f`, its `add` lines sorted by kind (chains before the rules that jump to them).
"""

from __future__ import annotations

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
_CLIENT = """
import socket, sys
s = socket.socket(); s.settimeout(2)
if len(sys.argv) > 3:
    s.bind((sys.argv[3], 0))
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); print(s.recv(200).decode().strip())
except socket.timeout:
    print("timeout")
except OSError as e:
    print(f"error {e.errno}")
"""


def ordered(script: str) -> str:
    """An `nft -f` script's `add` lines sorted by kind: table, sets and maps, chains,
    rules, elements (a dump lists them by object; nft -f wants targets first)."""
    lines = [ln for ln in script.splitlines() if ln.strip() and not ln.startswith("#")]
    return "\n".join(sorted(lines, key=lambda ln: _ORDER[ln.split()[1]])) + "\n"


@contextmanager
def nft_node(script: str) -> Iterator[dict[str, Netns]]:
    """The namespaces by role (node, pod, client, ep), the ruleset loaded on the node."""
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
        node.run("nft", "-f", "-", input=ordered(script))
        serve(stack, ep, "10.180.0.1")
        yield ns


def serve(stack: ExitStack, ns: Netns, probe_ip: str) -> None:
    """Answer on port 80 of every address of ``ns`` until ``stack`` closes; back once
    ``probe_ip`` answers."""
    server = ns.popen([sys.executable, "-c", _SERVER], stdout=subprocess.DEVNULL,
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
