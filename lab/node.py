"""Build a scenario's node out of real kernel objects, inside network namespaces.

Three namespaces, wired like a cloud VM::

    client_pod            node                                   vpc
    eth0 172.16.1.2 --- vethpod0 [cni0 172.16.1.1]   eth0 10.0.0.10 --- eth1 10.0.0.1
                            kube-ipvs0 (IPVS only)     default via 10.0.0.1   route pod CIDR
                                                                              via the node

The node gets kube-proxy's ipsets and nat/filter rules (plus ip-masq-agent / CNI rules
per scenario) through the chosen iptables backend, the kube-ipvs0 addresses, and the
scenario's sysctls. IPVS comes in two forms (``ipvs_kind``): where the kernel has IP_VS
(the VM of ``lab.vm``, a stock distribution kernel) kube-ipvs0 is a real ``dummy``
device and the virtual servers are created with ``ipvsadm`` as kube-proxy does; where it
has not (this development machine) kube-ipvs0 is a DOWN bridge, no virtual server
exists, and the generated ``ipvsadm -S -n`` text stands in for them.

Nothing is done in the root namespace: links are created inside a namespace
(``netns.veth``), every command runs under ``ip netns exec``. Everything is torn down
when the ``build_lab`` block ends, also on error.

``add_node`` builds one node (build_lab's, or further ones of the same VPC) and
``install_ipvs_standin`` makes an IPVS node's virtual servers answer; both serve
``lab.clb.build_cluster``, which adds a second node, endpoint pods and the CLB
and drives real traffic. ``build_lab`` itself is unchanged by them.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.probes import ipvs as _probe_ipvs
from lab import netns as _netns
from lab.netns import Netns
from lab.scenarios import Scenario

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
    _check_backend(backend)
    with ExitStack() as stack:
        vpc = stack.enter_context(_netns.netns("lbv"))
        node, pod = add_node(stack, scenario, backend, vpc)
        kube_dir = Path(tempfile.mkdtemp(prefix="lbl-kube-"))
        stack.callback(shutil.rmtree, kube_dir, True)
        for name, text in scenario.kube_files().items():
            (kube_dir / name).write_text(text)
        yield Lab(node=node, vpc=vpc, client_pod=pod, scenario=scenario, kube_dir=kube_dir,
                  backend=backend)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")


def add_node(stack: ExitStack, scenario: Scenario, backend: str, vpc: Netns,
             vpc_if: str = "eth1", *, first: bool = True) -> tuple[Netns, Netns]:
    """A node of ``scenario`` (its namespace and a client pod on its cni0), uplinked to
    ``vpc`` through ``vpc_if``; both namespaces are deleted when ``stack`` closes.

    The ``first`` node's link gets the gateway with the node subnet's prefix on the
    VPC side, as build_lab always did. Further nodes of the same VPC (build_cluster)
    get it as /32 there, with a host route to the node (and proxy ARP, set by the
    caller once all links exist), so
    every node has a point-to-point link to the VPC and nothing reaches another node
    without passing the VPC (the real VPC is routed, not a shared segment either).
    """
    _check_backend(backend)
    node = stack.enter_context(_netns.netns("lbn"))
    pod = stack.enter_context(_netns.netns("lbp"))
    _sysctls(node, scenario)
    _uplink(node, vpc, scenario, vpc_if, first)
    _pod_network(node, pod, scenario)
    if scenario.mode == "ipvs":
        _kube_ipvs0(node, scenario)
    _rules(node, scenario, backend)
    _settle(node)
    return node, pod


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


def _uplink(node: Netns, vpc: Netns, sc: Scenario, vpc_if: str, first: bool) -> None:
    _netns.veth(node, "eth0", vpc, vpc_if)
    node.sh(f"""
        ip addr add {sc.node_ip}/{sc.node_prefix} dev eth0
        ip link set eth0 up
        ip route add default via {sc.vpc_gateway} dev eth0
        sysctl -q -w net.ipv4.conf.eth0.rp_filter={sc.rp_filter}
    """)
    if first:
        gateway = f"ip addr add {sc.vpc_gateway}/{sc.node_prefix} dev {vpc_if}"
        host_route = ""
    else:
        gateway = f"ip addr add {sc.vpc_gateway}/32 dev {vpc_if}"
        host_route = f"ip route add {sc.node_ip}/32 dev {vpc_if}"
    vpc.sh(f"""
        {gateway}
        ip link set {vpc_if} up
        {host_route}
        ip route add {sc.pod_cidr} via {sc.node_ip} dev {vpc_if}
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


REAL = "real"
STANDIN = "standin"
IPVS_KIND_ENV = "LOOPBACK_AGENT_LAB_IPVS"
PROC_IP_VS = _probe_ipvs.PROC_IP_VS  # one place for where ip_vs shows it is loaded
SYS_MODULE_DUMMY = "/sys/module/dummy"


def ipvs_kind() -> str:
    """``real`` when this kernel has IP_VS and ``dummy`` loaded (the VM guest loads both,
    as kube-proxy does on a node), else ``standin``; LOOPBACK_AGENT_LAB_IPVS overrides.
    Loaded, not merely available: the lab never loads a module, and creating a dummy
    device would load ``dummy``, which adds a ``dummy0`` to the root namespace."""
    forced = os.environ.get(IPVS_KIND_ENV, "")
    if forced in (REAL, STANDIN):
        return forced
    if forced:
        raise ValueError(f"{IPVS_KIND_ENV} must be {REAL!r} or {STANDIN!r}, not {forced!r}")
    loaded = os.path.exists(PROC_IP_VS) and os.path.isdir(SYS_MODULE_DUMMY)
    return REAL if loaded else STANDIN


def _kube_ipvs0(node: Netns, sc: Scenario) -> None:
    # kube-proxy creates a dummy device and leaves it DOWN. Without the dummy driver a
    # bridge left DOWN behaves the same for what matters: its addresses land in table
    # local.
    kind = "dummy" if ipvs_kind() == REAL else "bridge"
    node.run("ip", "link", "add", "kube-ipvs0", "type", kind)
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
    if state is not None and ipvs_kind() == REAL:
        # kube-proxy's IPVS sysctls: conntrack for IPVS connections is what lets its
        # KUBE-POSTROUTING masquerade them; the other two are its defaults too
        node.run("sysctl", "-q", "-w", "net.ipv4.vs.conntrack=1",
                 "net.ipv4.vs.expire_nodest_conn=1", "net.ipv4.vs.expire_quiescent_template=1")
        node.run("ipvsadm", "-R", input=state.ipvsadm_save)


# --- IPVS stand-in -------------------------------------------------------------------

_IPVS_SERVICE = re.compile(r"^-A -t (\S+):(\d+) ")
_IPVS_REAL = re.compile(r"^-a -t (\S+):(\d+) -r (\S+):(\d+) ")
IPVS_STANDIN_TABLE = "lab-ipvs"


def ipvs_standin_nft(ipvsadm_save: str) -> str:
    """nft input standing in for the IPVS virtual servers of ``ipvsadm -S -n`` text.

    This kernel has no IP_VS, so in IPVS scenarios nothing would answer a NodePort. IPVS
    takes a packet in LOCAL_IN, i.e. only when routing found its destination local, and
    NATs it to a real server (round robin here); the stand-in does the same with a DNAT
    in prerouting/output guarded by ``fib daddr type local`` (an unbound LB IP therefore
    stays unanswered, as with IPVS), at priority dstnat+10, after kube-proxy's nat rules
    have set their masquerade marks. It lives in its own nft table, so what
    ``iptables-save`` shows (what the agent reads) stays exactly kube-proxy's.

    Known difference: the DNAT happens before routing, so a packet that IPVS would take
    as local is forwarded to the real server instead; the martian-source and
    reverse-path checks run in both paths, so drops are the same.
    """
    reals: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for line in ipvsadm_save.splitlines():
        if m := _IPVS_SERVICE.match(line):
            reals.setdefault((m.group(1), int(m.group(2))), [])
        elif m := _IPVS_REAL.match(line):
            reals.setdefault((m.group(1), int(m.group(2))), []).append(
                (m.group(3), int(m.group(4))))
    chains: list[str] = []
    vmap: list[str] = []
    for i, ((vip, port), servers) in enumerate(reals.items()):
        if not servers:  # no real server: IPVS leaves it to the local stack (RST)
            continue
        targets = ", ".join(f"{n} : {ip} . {p}" for n, (ip, p) in enumerate(servers))
        chains.append(f"  chain vs{i} {{\n    meta l4proto tcp dnat ip to numgen inc mod "
                      f"{len(servers)} map {{ {targets} }}\n  }}")
        vmap.append(f"{vip} . {port} : jump vs{i}")
    if not vmap:
        return ""
    match = ("    fib daddr type local ip daddr . tcp dport vmap { " + ", ".join(vmap) + " }")
    hooks = [f"  chain {hook} {{\n    type nat hook {hook} priority -90; policy accept;\n"
             f"{match}\n  }}" for hook in ("prerouting", "output")]
    return f"table ip {IPVS_STANDIN_TABLE} {{\n" + "\n".join(chains + hooks) + "\n}\n"


def install_ipvs_standin(node: Netns, scenario: Scenario) -> None:
    """Make the node's IPVS virtual servers (NodePorts, and ClusterIPs/LB IPs bound on
    kube-ipvs0) answer: see ipvs_standin_nft. No-op in iptables mode, where
    kube-proxy's own rules already DNAT them, and with real IPVS, which does."""
    if ipvs_kind() == REAL:
        return
    state = scenario.ipvs_state()
    text = ipvs_standin_nft(state.ipvsadm_save) if state else ""
    if text:
        node.run("nft", "-f", "-", input=text)
