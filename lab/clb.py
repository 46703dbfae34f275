"""A small cluster around the lab node, with a private cloud load balancer (CLB) that
does not SNAT, and drivers for real traffic through it.

``build_cluster(scenario, backend)`` extends ``build_lab``'s node ("node 1", the node
under diagnosis) into::

    client pod 172.16.1.2   endpoint pod          pod 172.16.2.2   endpoint pod
           |               172.16.1.10, .11 ...         |          172.16.2.10 ...
           |                |                            |          |
      [cni0 172.16.1.1] node 1                      [cni0 172.16.2.1] node 2
                        eth0 10.0.0.10                                eth0 10.0.0.11
                         |                                             |
                        eth1 10.0.0.1/24 ---- vpc = the CLB ---- eth2 10.0.0.1/32
                                   lo: LB VIPs, Ingress IPs, 100.64.0.2
                                                   |
                                                  eth3 ---- rest: 172.16.3.10 ...
                                                            (pods of nodes not modelled)

- **The VPC is routed, point to point.** Each node's uplink is its own link to the
  ``vpc`` namespace (proxy ARP answers for the other node inside the node subnet), and
  the VPC routes every node's pod CIDR to that node (TKE's global router). Whatever a
  node sends to another node, a pod or a VIP passes the VPC, so the CLB sees the
  replies of the connections it forwarded and conntrack un-DNATs them.
- **The CLB** (in ``vpc``) owns every LB VIP and Ingress IP of the scenario on its
  ``lo``, also those bound on the node's kube-ipvs0 (IPVS mode), and DNATs VIP:port to
  a real server NodeIP:NodePort without SNAT. ``Clb.use_real_server(ip)`` chooses the
  real server: it is tried first, the other nodes follow, and a real server whose IP
  equals the packet's source IP is never chosen (``! -s`` on each candidate), as the
  real CLB does. Layer-7 Ingress addresses are forwarded the same way (no L7 proxy, so
  no 4 s retry either). ``arp_announce=2`` there: with the default the CLB's ARP
  requests carry the VIP as sender address, which the node drops as martian.
- **NodePorts answer.** Endpoint pods (one namespace per node holding all its endpoint
  IPs, a TCP server on every targetPort replying "<endpoint ip> <peer ip>\\n") serve
  what kube-proxy's rules DNAT to; in IPVS scenarios ``node.install_ipvs_standin`` does
  the DNAT IPVS would. Endpoint IPs outside both nodes' pod CIDRs (the scenarios name a
  third node's 172.16.3.10) live in ``rest``, so every kube-proxy choice connects.
- **Node 2** runs the same kube-proxy flavour as node 1 (``scenarios.on_node``).

The drivers (``pod_connect``, ``other_node_pod_connect``, ``healthcheck``) run one
connect() in a namespace and say what happened (connected / reset / timeout /
unreachable, with timings); ``sniff`` records the SYN and RST segments a namespace sees,
per interface and direction. Nothing runs in the root namespace; everything is
deleted (processes first) when the ``build_cluster`` block ends, also on error.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from lab import netns as _netns
from lab.netns import Netns
from lab.node import Lab, add_node, build_lab, install_ipvs_standin
from lab.scenarios import (
    CLUSTER_CIDR,
    HEALTH_CHECK_SOURCE,
    NODE2_IP,
    NODE2_NAME,
    NODE2_POD_CIDR,
    Scenario,
    on_node,
)

# Outcomes of one connect().
CONNECTED = "connected"
RESET = "reset"  # the peer (or someone on the path) answered the SYN with RST
TIMEOUT = "timeout"  # no SYN-ACK within the timeout: dropped, or the reply went elsewhere
UNREACHABLE = "unreachable"  # an ICMP error or no route
ERROR = "error"

_CLB_IPTABLES = "iptables-nft"  # the CLB's own namespace: either backend would do


@dataclass(frozen=True)
class Listener:
    """One CLB listener: VIP:port forwarded to NodePort on the real servers."""

    vip: str
    port: int
    node_port: int
    name: str  # "ns/svc" or "ingress ns/name"


@dataclass(frozen=True)
class ConnectResult:
    outcome: str  # CONNECTED | RESET | TIMEOUT | UNREACHABLE | ERROR
    seconds: float  # connect() duration (the timeout when nothing came back)
    src: str | None  # the client socket's address and port (as the client saw them)
    sport: int | None
    dst: str
    dport: int
    reply: str = ""  # the endpoint's line "<endpoint ip> <peer ip it saw>", if connected
    error: str = ""

    @property
    def connected(self) -> bool:
        return self.outcome == CONNECTED

    @property
    def endpoint(self) -> str | None:
        """The endpoint pod that served the connection."""
        return self.reply.split()[0] if self.reply else None

    @property
    def seen_source(self) -> str | None:
        """The source address the endpoint saw (after every NAT on the way)."""
        parts = self.reply.split()
        return parts[1] if len(parts) > 1 else None


@dataclass(frozen=True)
class Segment:
    """A TCP segment with SYN or RST set, as seen by AF_PACKET in one namespace."""

    iface: str
    direction: str  # "in" | "out"
    src: str
    sport: int
    dst: str
    dport: int
    flags: int

    @property
    def kind(self) -> str:
        if self.flags & 0x04:
            return "RST"
        return "SYN-ACK" if self.flags & 0x12 == 0x12 else "SYN"

    def __str__(self) -> str:
        return (f"{self.iface} {self.direction} {self.kind} "
                f"{self.src}:{self.sport} > {self.dst}:{self.dport}")


@dataclass(repr=False)
class Sniffed:
    """What ``sniff`` recorded; filled when its block ends."""

    segments: list[Segment] = field(default_factory=list)

    def find(self, kind: str | None = None, *, iface: str | None = None,
             direction: str | None = None, src: str | None = None, dst: str | None = None,
             sport: int | None = None, dport: int | None = None) -> list[Segment]:
        return [s for s in self.segments
                if (kind is None or s.kind == kind) and (iface is None or s.iface == iface)
                and (direction is None or s.direction == direction)
                and (src is None or s.src == src) and (dst is None or s.dst == dst)
                and (sport is None or s.sport == sport) and (dport is None or s.dport == dport)]

    def __repr__(self) -> str:  # readable in assertion messages
        return "\n".join(map(str, self.segments)) or "(nothing)"


# --- the CLB -------------------------------------------------------------------------


class Clb:
    """The private CLB in ``ns`` (the VPC namespace): VIPs on lo, DNAT without SNAT."""

    def __init__(self, ns: Netns, listeners: Sequence[Listener], real_servers: Sequence[str],
                 health_check_source: str = HEALTH_CHECK_SOURCE) -> None:
        if not real_servers:
            raise ValueError("a CLB needs at least one real server")
        self.ns = ns
        self.listeners = tuple(listeners)
        self.real_servers = tuple(real_servers)  # preference order, see use_real_server
        self.health_check_source = health_check_source

    @property
    def vips(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(lst.vip for lst in self.listeners))

    def setup(self) -> None:
        """VIPs and the health-check source on lo, arp_announce=2, the DNAT rules."""
        self.ns.run("sysctl", "-q", "-w", "net.ipv4.conf.all.arp_announce=2")
        addrs = (*self.vips, self.health_check_source)
        self.ns.run("ip", "-batch", "-", input="".join(f"address add {a}/32 dev lo\n"
                                                       for a in addrs))
        self._load()

    def use_real_server(self, node_ip: str) -> None:
        """Forward every listener to ``node_ip`` first; the other real servers follow in
        their order, for packets whose source IP is ``node_ip`` (the CLB never picks
        a real server whose IP is the packet's source). Rule counters restart."""
        if node_ip not in self.real_servers:
            raise ValueError(f"{node_ip} is not a real server of this CLB: {self.real_servers}")
        self.real_servers = (node_ip, *(r for r in self.real_servers if r != node_ip))
        self._load()

    def rules(self) -> str:
        """The CLB's nat table, iptables-restore input."""
        chains = [f"CLB-{i}" for i in range(len(self.listeners))]
        lines = ["*nat", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]",
                 ":OUTPUT ACCEPT [0:0]", ":POSTROUTING ACCEPT [0:0]", ":CLB - [0:0]"]
        lines += [f":{c} - [0:0]" for c in chains]
        lines.append("-A PREROUTING -j CLB")
        for chain, lst in zip(chains, self.listeners, strict=True):
            lines.append(f"-A CLB -d {lst.vip}/32 -p tcp -m tcp --dport {lst.port} "
                         f'-m comment --comment "{lst.name}" -j {chain}')
            # First candidate whose IP is not the source wins; none left (a one-node
            # cluster, source = that node): no DNAT, the CLB itself resets.
            for rs in self.real_servers:
                lines.append(f"-A {chain} ! -s {rs}/32 -p tcp -j DNAT "
                             f"--to-destination {rs}:{lst.node_port}")
        lines.append("COMMIT")
        return "\n".join(lines) + "\n"

    def _load(self) -> None:
        # A full restore of the CLB's own nat table: atomic, and nothing else lives there.
        self.ns.run(f"{_CLB_IPTABLES}-restore", input=self.rules())

    def picks(self) -> dict[str, int]:
        """Real server IP -> new connections DNATed to it since the last rule change."""
        out = self.ns.run(f"{_CLB_IPTABLES}-save", "-c", "-t", "nat").stdout
        picks: dict[str, int] = {}
        for m in re.finditer(r"^\[(\d+):\d+\] -A CLB-\d+ .*--to-destination ([\d.]+):\d+",
                             out, re.M):
            picks[m.group(2)] = picks.get(m.group(2), 0) + int(m.group(1))
        return picks


def listeners_of(sc: Scenario) -> tuple[Listener, ...]:
    """One listener per LB service port and per Ingress (its backend's NodePort)."""
    out: list[Listener] = []
    for svc in sc.services:
        if svc.lb_ip and svc.node_port:
            out.append(Listener(svc.lb_ip, svc.port, svc.node_port,
                                f"{svc.namespace}/{svc.name}"))
    for ing in sc.ingresses:
        backend = next((s for s in sc.services if s.namespace == ing.namespace
                        and s.name == ing.service_name and s.port == ing.service_port
                        and s.node_port), None)
        if backend and backend.node_port:
            out.append(Listener(ing.ip, 443 if ing.tls else 80, backend.node_port,
                                f"ingress {ing.namespace}/{ing.name}"))
    return tuple(out)


# --- the cluster ---------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    lab: Lab  # node 1 (the scenario's node), the VPC (= the CLB's namespace), client pod
    clb: Clb
    node2: Netns
    node2_pod: Netns  # a client pod on node 2
    node2_scenario: Scenario
    rest: Netns  # endpoint pods of nodes the lab does not model
    endpoints: Mapping[str, Netns]  # endpoint pod IP -> the namespace answering on it
    servers: tuple[subprocess.Popen[str], ...]  # the endpoint servers (stopped on exit)

    @property
    def scenario(self) -> Scenario:
        return self.lab.scenario

    @property
    def node(self) -> Netns:
        return self.lab.node

    @property
    def vpc(self) -> Netns:
        return self.lab.vpc

    @property
    def client_pod(self) -> Netns:
        return self.lab.client_pod

    @property
    def node_ips(self) -> tuple[str, str]:
        return (self.scenario.node_ip, self.node2_scenario.node_ip)

    def namespaces(self) -> tuple[Netns, ...]:
        return (self.node, self.vpc, self.client_pod, self.node2, self.node2_pod, self.rest,
                *dict.fromkeys(self.endpoints.values()))


@contextmanager
def build_cluster(scenario: Scenario, backend: str = "legacy", *,
                  real_server: str | None = None, node2_ip: str = NODE2_IP,
                  node2_pod_cidr: str = NODE2_POD_CIDR) -> Iterator[Cluster]:
    """``build_lab(scenario, backend)`` plus node 2, endpoint pods and the CLB (see the
    module docstring); the CLB starts with ``real_server`` (default: node 1) first.
    Everything is deleted when the block ends, also on error."""
    node2_sc = on_node(scenario, node_ip=node2_ip, pod_cidr=node2_pod_cidr,
                       node_name=NODE2_NAME if node2_ip == NODE2_IP else f"node-{node2_ip}")
    with build_lab(scenario, backend) as lab, ExitStack() as stack:
        vpc = lab.vpc
        _vpc_router(vpc)
        node2, pod2 = add_node(stack, node2_sc, backend, vpc, "eth2", first=False)
        rest = stack.enter_context(_netns.netns("lbr"))
        for ifname in ("eth1", "eth2"):
            # answer a node's ARP for the other node: the VPC routes between them
            _sysctls(vpc, {f"net.ipv4.conf.{ifname}.proxy_arp": 1,
                           f"net.ipv4.neigh.{ifname}.proxy_delay": 0,
                           f"net.ipv4.conf.{ifname}.rp_filter": 0,
                           f"net.ipv4.conf.{ifname}.send_redirects": 0})
        install_ipvs_standin(lab.node, scenario)
        install_ipvs_standin(node2, node2_sc)

        ports = sorted({s.target_port for s in scenario.services})
        groups = _endpoint_groups(scenario, (scenario.pod_cidr, node2_pod_cidr))
        endpoints: dict[str, Netns] = {}
        for (cidr, ips), node in zip(groups[:2], (lab.node, node2), strict=True):
            if ips:
                ep = stack.enter_context(_netns.netns("lbe"))
                _endpoint_pod(node, ep, cidr, ips)
                endpoints.update(dict.fromkeys(ips, ep))
        _rest(vpc, rest, groups[2][1], scenario.vpc_gateway)
        endpoints.update(dict.fromkeys(groups[2][1], rest))
        servers = tuple(stack.enter_context(serve(ep, ports))
                        for ep in dict.fromkeys(endpoints.values()))

        clb = Clb(vpc, listeners_of(scenario), (scenario.node_ip, node2_ip))
        clb.setup()
        if real_server:
            clb.use_real_server(real_server)
        yield Cluster(lab=lab, clb=clb, node2=node2, node2_pod=pod2, node2_scenario=node2_sc,
                      rest=rest, endpoints=endpoints, servers=servers)


def _sysctls(ns: Netns, values: Mapping[str, int | str]) -> None:
    ns.run("sysctl", "-q", "-w", *(f"{k}={v}" for k, v in values.items()))


def set_sysctls(ns: Netns, values: Mapping[str, int | str]) -> None:
    """Set sysctls inside a lab namespace (e.g. a node's rp_filter or accept_local)."""
    _sysctls(ns, values)


@contextmanager
def sysctls(ns: Netns, values: Mapping[str, int | str]) -> Iterator[None]:
    """Set sysctls in ``ns`` for the block, then put the previous values back (so tests
    can share one cluster)."""
    before = {k: ns.run("sysctl", "-n", k).stdout.strip() for k in values}
    _sysctls(ns, values)
    try:
        yield
    finally:
        _sysctls(ns, before)


def _vpc_router(vpc: Netns) -> None:
    # A router that forwards everything: no reverse-path filter, no ICMP redirects (the
    # CLB sends a DNATed SYN back out the link it came in on, which would trigger them),
    # and default.* first so the links created next inherit it.
    _sysctls(vpc, {"net.ipv4.ip_forward": 1,
                   "net.ipv4.conf.all.rp_filter": 0, "net.ipv4.conf.default.rp_filter": 0,
                   "net.ipv4.conf.all.send_redirects": 0,
                   "net.ipv4.conf.default.send_redirects": 0,
                   "net.ipv6.conf.all.disable_ipv6": 1,
                   "net.ipv6.conf.default.disable_ipv6": 1})


def _endpoint_groups(sc: Scenario, node_cidrs: Sequence[str]
                     ) -> list[tuple[str, tuple[str, ...]]]:
    """Endpoint pod IPs per node pod CIDR, then the other pod IPs of the cluster CIDR
    (node-network endpoints like the API server's are left out)."""
    ips = sorted({ip for s in sc.services for ip in (*s.local_endpoints, *s.remote_endpoints)},
                 key=ipaddress.ip_address)
    cluster = ipaddress.ip_network(sc.cluster_cidr or CLUSTER_CIDR)
    groups: list[tuple[str, tuple[str, ...]]] = []
    left = [ip for ip in ips if ipaddress.ip_address(ip) in cluster]
    for cidr in node_cidrs:
        net = ipaddress.ip_network(cidr)
        groups.append((cidr, tuple(ip for ip in left if ipaddress.ip_address(ip) in net)))
        left = [ip for ip in left if ipaddress.ip_address(ip) not in net]
    groups.append((str(cluster), tuple(left)))
    return groups


def _endpoint_pod(node: Netns, ep: Netns, pod_cidr: str, ips: Sequence[str]) -> None:
    """One pod namespace on ``node``'s cni0 holding all of ``ips`` (a lab shortcut for
    one pod per endpoint: they behave alike)."""
    prefix = pod_cidr.split("/")[1]
    gateway = str(next(ipaddress.ip_network(pod_cidr).hosts()))
    _netns.veth(ep, "eth0", node, "vethep0")
    ep.run("ip", "-batch", "-", input="".join(f"address add {ip}/{prefix} dev eth0\n"
                                              for ip in ips) + "link set eth0 up\n")
    ep.run("ip", "route", "add", "default", "via", gateway, "dev", "eth0")
    node.sh("ip link set vethep0 master cni0\nip link set vethep0 up")


def _rest(vpc: Netns, rest: Netns, ips: Sequence[str], gateway: str) -> None:
    """Pods of nodes the lab does not model, straight behind the VPC."""
    _netns.veth(vpc, "eth3", rest, "eth0")
    _sysctls(rest, {"net.ipv4.conf.all.rp_filter": 0, "net.ipv4.conf.default.rp_filter": 0})
    rest.run("ip", "-batch", "-", input="".join(f"address add {ip}/32 dev eth0\n"
                                                for ip in ips) + "link set eth0 up\n")
    rest.run("ip", "route", "add", "default", "via", gateway, "dev", "eth0", "onlink")
    vpc.run("ip", "-batch", "-", input=f"address add {gateway}/32 dev eth3\n"
            "link set eth3 up\n" + "".join(f"route add {ip}/32 dev eth3\n" for ip in ips))


# Answers every accepted connection with "<its own address> <the peer's address>\n";
# exits when stdin closes.
_SERVER = r"""
import select, socket, sys
socks = []
for port in sys.argv[1:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(port)))
    s.listen(128)
    s.setblocking(False)
    socks.append(s)
print("ready", flush=True)
while True:
    ready, _, _ = select.select(socks + [sys.stdin], [], [])
    if sys.stdin in ready:
        break
    for s in ready:
        try:
            c, peer = s.accept()
        except OSError:  # reset before we got to it
            continue
        try:
            c.sendall(f"{c.getsockname()[0]} {peer[0]}\n".encode())
        except OSError:
            pass
        c.close()
"""


@contextmanager
def serve(ns: Netns, ports: Iterable[int]) -> Iterator[subprocess.Popen[str]]:
    """A TCP server in ``ns`` on every port of ``ports`` (all addresses), answering each
    connection with "<its address> <the peer's address>\n"; stopped when the block
    ends. The endpoint pods run one; a test may run one on a node (a hostNetwork
    listener) to see where the node's own SYN-ACK goes."""
    # Own session: a terminal's Ctrl-C goes to whoever runs the lab (demo, pytest), which
    # stops the server by closing stdin, instead of a KeyboardInterrupt trace per server.
    proc = ns.popen([sys.executable, "-c", _SERVER, *map(str, ports)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise _netns.NetnsError(f"server in {ns.name} did not start: {line!r}")
        yield proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Close stdin (the process exits by itself), kill it if it does not."""
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    finally:
        if proc.stdout:
            proc.stdout.close()


# --- traffic -------------------------------------------------------------------------

_CONNECT = r"""
import errno, json, socket, sys, time
src, dst, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
s = socket.socket()
if src:
    s.bind((src, 0))
s.settimeout(timeout)
out = {"reply": "", "error": ""}
t0 = time.monotonic()
try:
    s.connect((dst, port))
    out["outcome"] = "connected"
except ConnectionRefusedError:
    out["outcome"] = "reset"
except (socket.timeout, TimeoutError):
    out["outcome"] = "timeout"
except OSError as e:
    unreachable = (errno.EHOSTUNREACH, errno.ENETUNREACH)
    out["outcome"] = "unreachable" if e.errno in unreachable else "error"
    out["error"] = str(e)
out["seconds"] = time.monotonic() - t0
out["src"], out["sport"] = s.getsockname()
if out["outcome"] == "connected":
    s.settimeout(max(0.2, timeout - out["seconds"]))
    try:
        out["reply"] = s.recv(200).decode(errors="replace").strip()
    except OSError as e:
        out["error"] = f"connected, then: {e}"
print(json.dumps(out))
"""


def connect(ns: Netns, dst: str, port: int, timeout: float = 1.5,
            source: str | None = None) -> ConnectResult:
    """One TCP connect() from ``ns`` (bound to ``source`` when given)."""
    proc = ns.run(sys.executable, "-c", _CONNECT, source or "", dst, str(port), str(timeout),
                  timeout=timeout + 30)
    d = json.loads(proc.stdout)
    src = None if d["src"] == "0.0.0.0" else d["src"]
    return ConnectResult(outcome=d["outcome"], seconds=d["seconds"], src=src,
                         sport=d["sport"] or None, dst=dst, dport=port, reply=d["reply"],
                         error=d["error"])


def pod_connect(cluster: Cluster, vip: str, port: int, timeout: float = 1.5) -> ConnectResult:
    """The client pod of node 1 connects to ``vip:port``."""
    return connect(cluster.client_pod, vip, port, timeout)


def other_node_pod_connect(cluster: Cluster, vip: str, port: int,
                           timeout: float = 1.5) -> ConnectResult:
    """The client pod of node 2 connects to ``vip:port``."""
    return connect(cluster.node2_pod, vip, port, timeout)


def healthcheck(cluster: Cluster, node_ip: str, node_port: int, timeout: float = 1.0,
                source: str | None = None) -> ConnectResult:
    """The CLB's TCP health check: a SYN from ``source`` (default: the CLB's first VIP,
    as the CLBs of the field reports do) to ``node_ip:node_port``; healthy when the
    handshake completes within ``timeout``."""
    return connect(cluster.vpc, node_ip, node_port, timeout,
                   source=source or cluster.clb.vips[0])


# AF_PACKET, all interfaces, cooked (no link-layer header): records TCP segments with
# SYN or RST as JSON lines until stdin closes. pkttype 4 (PACKET_OUTGOING) is "out".
_SNIFF = r"""
import json, select, socket, struct, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0003))
s.setblocking(False)
print("ready", flush=True)
def drain():
    while True:
        try:
            data, addr = s.recvfrom(65535)
        except BlockingIOError:
            return
        if addr[1] != 0x0800 or len(data) < 20 or data[9] != 6:
            continue
        ihl = (data[0] & 15) * 4
        if len(data) < ihl + 14 or not data[ihl + 13] & 0x06:
            continue
        sport, dport = struct.unpack("!HH", data[ihl:ihl + 4])
        print(json.dumps([addr[0], "out" if addr[2] == 4 else "in",
                          socket.inet_ntoa(data[12:16]), sport,
                          socket.inet_ntoa(data[16:20]), dport, data[ihl + 13]]))
while True:
    ready, _, _ = select.select([s, sys.stdin], [], [])
    drain()
    if sys.stdin in ready:
        break
sys.stdout.flush()
"""


@contextmanager
def sniff(ns: Netns) -> Iterator[Sniffed]:
    """Record SYN/SYN-ACK/RST segments on every interface of ``ns`` during the block."""
    result = Sniffed()
    proc = ns.popen([sys.executable, "-c", _SNIFF], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise _netns.NetnsError(f"packet recorder in {ns.name} did not start")
        yield result
        out, _ = proc.communicate(timeout=10)
        for line in out.splitlines():
            iface, direction, src, sport, dst, dport, flags = json.loads(line)
            result.segments.append(Segment(iface, direction, src, sport, dst, dport, flags))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
