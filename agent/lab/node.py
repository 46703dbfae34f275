"""Build a scenario's node out of real kernel objects, inside network namespaces.

Three namespaces, wired like a cloud VM::

    client_pod            node                                   vpc
    eth0 172.16.1.2 --- vethpod0 [cni0 172.16.1.1]   eth0 10.0.0.10 --- eth1 10.0.0.1
                            kube-ipvs0 (IPVS only)     default via 10.0.0.1   route pod CIDR
                                                                              via the node

The node gets kube-proxy's ipsets and nat/filter rules (plus ip-masq-agent / CNI rules
per scenario) through the chosen iptables backend, the kube-ipvs0 addresses, and the
scenario's sysctls. IPVS virtual servers are not created: this kernel has no IP_VS,
so ``ipvsadm`` cannot run; the generated ``ipvsadm -S -n`` text stands in for them.

Nothing is done in the root namespace: links are created inside a namespace
(``netns.veth``), every command runs under ``ip netns exec``. Everything is torn down
when the ``build_lab`` block ends, also on error.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.lab import netns as _netns
from agent.lab.netns import Netns
from agent.lab.scenarios import Scenario

BACKENDS = ("legacy", "nft")


@dataclass(frozen=True)
class Lab:
    node: Netns
    vpc: Netns  # the far end of the node's uplink: where the CLB / VPC router would be
    client_pod: Netns  # a pod of this node, on cni0
    scenario: Scenario
    kube_dir: Path  # services.json, node.json, ingresses.json
    backend: str  # "legacy" | "nft": which iptables holds the rules

    def iptables_save(self, table: str | None = None) -> str:
        args = [f"iptables-{self.backend}-save"] + (["-t", table] if table else [])
        return self.node.run(*args).stdout


# One ICMP echo over a raw socket: the lab image has no ping binary.
_PING = r"""
import os, socket, struct, sys
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xFFFF); s += s >> 16
    return ~s & 0xFFFF
ident = os.getpid() & 0xFFFF
hdr = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"loopback-agent-lab"
pkt = hdr[:2] + struct.pack("!H", csum(hdr)) + hdr[4:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(float(sys.argv[2]))
s.sendto(pkt, (sys.argv[1], 0))
try:
    while True:
        data, (src, _) = s.recvfrom(1500)
        ihl = (data[0] & 0x0F) * 4
        typ, _code, _c, rid = struct.unpack("!BBHH", data[ihl:ihl + 6])
        if typ == 0 and rid == ident and src == sys.argv[1]:
            sys.exit(0)
except socket.timeout:
    sys.exit(1)
"""


def ping(ns: Netns, addr: str, timeout: float = 2.0) -> bool:
    """True when ``addr`` answers one ICMP echo sent from inside ``ns``."""
    proc = ns.run(sys.executable, "-c", _PING, addr, str(timeout), check=False,
                  timeout=timeout + 10)
    return proc.returncode == 0


@contextmanager
def build_lab(scenario: Scenario, backend: str = "legacy") -> Iterator[Lab]:
    """The scenario's node, VPC peer and client pod; deleted when the block ends."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    with ExitStack() as stack:
        node = stack.enter_context(_netns.netns("lbn"))
        vpc = stack.enter_context(_netns.netns("lbv"))
        pod = stack.enter_context(_netns.netns("lbp"))
        kube_dir = Path(tempfile.mkdtemp(prefix="lbl-kube-"))
        stack.callback(shutil.rmtree, kube_dir, True)

        _sysctls(node, scenario)
        _uplink(node, vpc, scenario)
        _pod_network(node, pod, scenario)
        if scenario.mode == "ipvs":
            _kube_ipvs0(node, scenario)
        _rules(node, scenario, backend)
        _settle(node)
        for name, text in scenario.kube_files().items():
            (kube_dir / name).write_text(text)
        yield Lab(node=node, vpc=vpc, client_pod=pod, scenario=scenario, kube_dir=kube_dir,
                  backend=backend)


def _sysctls(node: Netns, sc: Scenario) -> None:
    # all/default first, so interfaces created (or moved in) later inherit them
    values = {
        "net.ipv4.ip_forward": 1,
        "net.ipv4.conf.all.rp_filter": sc.rp_filter,
        "net.ipv4.conf.default.rp_filter": sc.rp_filter,
        # The node is IPv4 only. IPv6 link-local addresses would appear whenever the
        # kernel's link watcher gets to them (after DAD, up to seconds after the build),
        # changing the local table under a test that compares before and after.
        "net.ipv6.conf.all.disable_ipv6": 1,
        "net.ipv6.conf.default.disable_ipv6": 1,
    }
    if sc.mode == "iptables":
        values["net.ipv4.conf.all.route_localnet"] = 1  # kube-proxy's localhostNodePorts
    node.run("sysctl", "-q", "-w", *(f"{k}={v}" for k, v in values.items()))


def _uplink(node: Netns, vpc: Netns, sc: Scenario) -> None:
    _netns.veth(node, "eth0", vpc, "eth1")
    node.sh(f"""
        ip addr add {sc.node_ip}/{sc.node_prefix} dev eth0
        ip link set eth0 up
        ip route add default via {sc.vpc_gateway} dev eth0
        sysctl -q -w net.ipv4.conf.eth0.rp_filter={sc.rp_filter}
    """)
    vpc.sh(f"""
        ip addr add {sc.vpc_gateway}/{sc.node_prefix} dev eth1
        ip link set eth1 up
        ip route add {sc.pod_cidr} via {sc.node_ip} dev eth1
    """)


def _pod_network(node: Netns, pod: Netns, sc: Scenario) -> None:
    prefix = sc.pod_cidr.split("/")[1]
    # cni0 goes up last, with its port already up, so that it changes state once. Its
    # operstate still follows later: a bridge's carrier events are not "urgent" for
    # the kernel's link watcher, which runs them at most once a second (_settle waits).
    node.run("ip", "link", "add", "cni0", "type", "bridge")
    _netns.veth(pod, "eth0", node, "vethpod0")
    pod.sh(f"""
        ip addr add {sc.client_pod_ip}/{prefix} dev eth0
        ip link set eth0 up
    """)
    node.sh(f"""
        ip link set vethpod0 master cni0
        ip link set vethpod0 up
        ip addr add {sc.pod_gateway}/{prefix} dev cni0
        ip link set cni0 up
    """)
    pod.run("ip", "route", "add", "default", "via", sc.pod_gateway, "dev", "eth0")


def _kube_ipvs0(node: Netns, sc: Scenario) -> None:
    # kube-proxy uses a dummy device; this kernel has no dummy driver. A bridge left
    # DOWN behaves the same for what matters: its addresses land in table local.
    node.run("ip", "link", "add", "kube-ipvs0", "type", "bridge")
    addrs = sc.kube_ipvs0_addresses()
    if addrs:
        batch = "".join(f"address add {a}/32 dev kube-ipvs0\n" for a in addrs)
        node.run("ip", "-batch", "-", input=batch)


def _settle(node: Netns, timeout: float = 5.0) -> None:
    """Wait until eth0 and cni0 report operstate UP (up to a second, see _pod_network):
    a lab that still changes by itself after build_lab returned would make
    before/after comparisons flaky."""
    deadline = time.monotonic() + timeout
    while True:
        out = node.run("ip", "-o", "link", "show", "up").stdout
        states = dict(re.findall(r"^\d+: ([^:@]+)[^\n]*? state (\S+)", out, re.M))
        if states.get("eth0") == "UP" and states.get("cni0") == "UP":
            return
        if time.monotonic() > deadline:
            raise _netns.NetnsError(f"links did not come up: {states}")
        time.sleep(0.02)


def _rules(node: Netns, sc: Scenario, backend: str) -> None:
    state = sc.ipvs_state()
    if state is not None:
        # the sets must exist before rules referencing them can be restored
        node.run("ipset", "restore", input=state.ipset_restore)
    node.run(f"iptables-{backend}-restore", input=sc.iptables_restore())
