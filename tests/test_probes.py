"""Probes against the real commands, inside network namespaces (never the root one).

Each namespace test builds a small node (veth eth0 with its peer in a second
namespace, cni0 UP, a DOWN kube-ipvs0 holding /32 VIPs, ipsets, nat rules, sysctls),
runs the probes *inside* it through a python subprocess, and compares what they
report with what `ip`, `ipset save` and `iptables-*-save` print there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.netfilter.rules_text import parse_iptables_save
from agent.parse.kernel_name import kernel_name
from agent.probes import ProbeContext, ProbeResult, collect_live, ipvs, kube_api, kube_proxy
from agent.probes import base as probe_base
from agent.probes.nat_rules import Dump, choose, kube_score
from agent.probes.sysctls import sysctl_key
from agent.snapshot import (
    Address,
    IpSet,
    IpvsRealServer,
    IpvsVirtualServer,
    LocalRoute,
    NodeSnapshot,
    Unknown,
)
from lab.netns import Netns, netns, veth
from tests.nodestate import settle

PY = sys.executable

# --- unit tests (no root) -----------------------------------------------------------


def _fake_dest(addr: str, port: int, fwd: int, weight: int = 1,
               family: int | None = 2) -> dict[str, Any]:
    attrs: list[tuple[str, Any]] = [("IPVS_DEST_ATTR_ADDR", addr), ("IPVS_DEST_ATTR_PORT", port),
                                    ("IPVS_DEST_ATTR_FWD_METHOD", fwd),
                                    ("IPVS_DEST_ATTR_WEIGHT", weight)]
    if family is not None:
        attrs.append(("IPVS_DEST_ATTR_ADDR_FAMILY", family))
    return {"IPVS_CMD_ATTR_DEST": {"attrs": attrs}}


def test_ipvs_conversion_reads_the_raw_forward_method() -> None:
    svc = {"IPVS_CMD_ATTR_SERVICE": {"attrs": [
        ("IPVS_SVC_ATTR_AF", 2), ("IPVS_SVC_ATTR_PROTOCOL", 6),
        ("IPVS_SVC_ATTR_ADDR", "192.0.2.7"), ("IPVS_SVC_ATTR_PORT", 80),
        ("IPVS_SVC_ATTR_SCHED_NAME", "rr"),
        ("IPVS_SVC_ATTR_FLAGS", {"flags": 0, "mask": 0xFFFF}),
        ("IPVS_SVC_ATTR_NETMASK", "255.255.255.255")]}}
    dests = [
        _fake_dest("10.244.1.5", 8080, 0),           # Masq (pyroute2's parsed key says 3)
        _fake_dest("10.244.1.4", 8080, 0x10003, 2),  # Route, with flag bits above the mask
        _fake_dest("10.244.2.9", 8080, 2),           # Tunnel
        _fake_dest("10.244.3.9", 8080, 1),           # Local
        # an old kernel without ADDR_FAMILY: raw bytes, padded to 16 like IPVS does
        _fake_dest(bytes([10, 244, 4, 9]) + bytes(12), 8080, 0, family=None),  # type: ignore[arg-type]
    ]
    vs = ipvs.virtual_server_from_message(svc, dests)
    assert vs == IpvsVirtualServer(protocol="TCP", address="192.0.2.7", port=80,
                                   scheduler="rr", real_servers=(
        IpvsRealServer("10.244.1.4", 8080, "Route", 2),
        IpvsRealServer("10.244.1.5", 8080, "Masq", 1),
        IpvsRealServer("10.244.2.9", 8080, "Tunnel", 1),
        IpvsRealServer("10.244.3.9", 8080, "Local", 1),
        IpvsRealServer("10.244.4.9", 8080, "Masq", 1),
    ))


def test_ipvs_conversion_ipv6_and_pyroute2_default_trap() -> None:
    from pyroute2.ipvs import IPVSDest

    msg = _fake_dest("fd00::9", 443, 0, family=10)
    # The reason the probe reads the raw attribute: the parsed key keeps its default.
    assert IPVSDest.from_message(msg)["fwd_method"] == 3
    assert ipvs.real_server_from_message(msg) == IpvsRealServer("fd00::9", 443, "Masq", 1)


# IPVS generic netlink as the kernel writes it (net/netfilter/ipvs/ip_vs_ctl.c:
# ip_vs_genl_fill_service puts AF first; ip_vs_genl_fill_dest puts ADDR first and
# ADDR_FAMILY after it; both addresses are a 16-byte union nf_inet_addr)
def _nla(kind: int, payload: bytes) -> bytes:
    import struct

    size = 4 + len(payload)
    return struct.pack("HH", size, kind) + payload + bytes(-size % 4)


def _genl(cmd: int, nested_type: int, attrs: bytes) -> Any:
    import struct

    from pyroute2.netlink.generic.ipvs import ipvsmsg

    body = struct.pack("BBH", cmd, 1, 0) + _nla(nested_type | 0x8000, attrs)
    msg = ipvsmsg(struct.pack("IHHII", 16 + len(body), 0x20, 2, 1, 0) + body)
    msg.decode()
    return msg


def _inet(addr: str) -> bytes:
    import socket

    raw = socket.inet_pton(socket.AF_INET6 if ":" in addr else socket.AF_INET, addr)
    return raw + bytes(16 - len(raw))


def _kernel_service(af: int, addr: str, port: int) -> Any:
    import struct

    return _genl(4, 1, _nla(1, struct.pack("H", af)) + _nla(2, struct.pack("H", 6))
                 + _nla(3, _inet(addr)) + _nla(4, struct.pack(">H", port))
                 + _nla(6, b"rr\0") + _nla(7, struct.pack("II", 0, 0xFFFFFFFF)))


def _kernel_dest(af: int, addr: str, port: int, fwd: int, weight: int) -> Any:
    import struct

    return _genl(8, 2, _nla(1, _inet(addr)) + _nla(2, struct.pack(">H", port))
                 + _nla(3, struct.pack("I", fwd)) + _nla(4, struct.pack("I", weight))
                 + _nla(11, struct.pack("H", af)))


def test_ipvs_ipv6_virtual_and_real_servers_from_kernel_messages() -> None:
    """kube-proxy's IPv6 proxier's servers as netlink bytes, decoded by pyroute2: the
    addresses follow the family attributes (an IPv6 service may hold an IPv4 tunnel
    real server), and the dest dump asks for the IPv6 service by AF_INET6 and its
    16 bytes, as ip_vs_genl_parse_service reads them."""
    import socket

    from pyroute2.netlink.generic.ipvs import ipvsmsg

    v6, v4 = socket.AF_INET6, socket.AF_INET
    svc = _kernel_service(v6, "2001:db8:ff::7", 80)
    dests = [_kernel_dest(v6, "fd00:10:244:1::10", 8080, 0, 1),
             _kernel_dest(v4, "10.0.0.20", 8080, 2, 1)]
    assert ipvs.virtual_server_from_message(svc, dests) == IpvsVirtualServer(
        protocol="TCP", address="2001:db8:ff::7", port=80, scheduler="rr", real_servers=(
            IpvsRealServer("10.0.0.20", 8080, "Tunnel", 1),
            IpvsRealServer("fd00:10:244:1::10", 8080, "Masq", 1)))
    # no real server (eTP=Local, no endpoint): the virtual server is still listed
    empty = ipvs.virtual_server_from_message(_kernel_service(v6, "2001:db8:ff::e", 80), [])
    assert (empty.address, empty.real_servers) == ("2001:db8:ff::e", ())

    req = ipvsmsg()
    req["cmd"], req["version"] = 8, 1
    req["attrs"] = [("IPVS_CMD_ATTR_SERVICE", ipvs.dest_dump_key(svc).dump_key())]
    req.encode()
    sent = ipvsmsg(bytes(req.data))
    sent.decode()
    key = dict(sent.get_attr("IPVS_CMD_ATTR_SERVICE")["attrs"])
    assert (key["IPVS_SVC_ATTR_AF"], key["IPVS_SVC_ATTR_PROTOCOL"], key["IPVS_SVC_ATTR_PORT"],
            key["IPVS_SVC_ATTR_ADDR"]) == (v6, 6, 80, "2001:db8:ff::7")
    raw = bytes(req.data)
    assert _nla(3, _inet("2001:db8:ff::7")) in raw  # the 16-byte address, as sent


def test_ipvs_unavailable_without_proc_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipvs, "PROC_IP_VS", "/nonexistent/ip_vs")
    result = ipvs.collect(ProbeContext())
    assert result.value is None
    assert result.unknowns == (Unknown("ipvs", "unavailable: ip_vs not loaded"),)


def test_kube_proxy_flags_and_config() -> None:
    flags = kube_proxy.parse_flags(["--proxy-mode", "ipvs", "--cluster-cidr=10.244.0.0/16",
                                    "--masquerade-all", "--config=/var/lib/kp/config.conf"])
    assert flags == {"proxy-mode": "ipvs", "cluster-cidr": "10.244.0.0/16",
                     "masquerade-all": "true", "config": "/var/lib/kp/config.conf"}
    assert kube_proxy.parse_flags(["--masquerade-all=false"]) == {"masquerade-all": "false"}
    assert kube_proxy.is_kube_proxy("hyperkube", ["/hyperkube", "kube-proxy", "--v=2"])
    assert kube_proxy.is_kube_proxy(None, ["/usr/local/bin/kube-proxy"])
    assert not kube_proxy.is_kube_proxy("bash", ["bash", "kube-proxy"])

    yaml_text = """apiVersion: kubeproxy.config.k8s.io/v1alpha1
clusterCIDR: "10.244.0.0/16"   # pods
iptables:
  masqueradeAll: true
  masqueradeBit: 14
ipvs:
  scheduler: rr
mode: 'ipvs'
"""
    assert kube_proxy.read_config(yaml_text) == {
        "clusterCIDR": "10.244.0.0/16", "masqueradeAll": "true", "mode": "ipvs"}
    assert kube_proxy.read_config('{"mode": "iptables", "iptables": {"masqueradeAll": false}}'
                                  ) == {"mode": "iptables", "masqueradeAll": "false"}

    seen: list[Path] = []

    def read(path: Path) -> str:
        seen.append(path)
        return yaml_text

    value, unknowns = kube_proxy.describe(
        42, ["/hyperkube", "kube-proxy", "--config", "config.conf", "--proxy-mode=iptables"],
        cwd="/var/lib/kube-proxy", read=read)
    assert seen == [Path("/proc/42/root/var/lib/kube-proxy/config.conf")]
    # the config file replaces the flags, as in kube-proxy itself
    assert (value.mode, value.cluster_cidr, value.masquerade_all) == ("ipvs", "10.244.0.0/16",
                                                                      True)
    assert unknowns == []

    def unreadable(path: Path) -> str:
        raise PermissionError(13, "Permission denied")

    value, unknowns = kube_proxy.describe(7, ["kube-proxy", "--proxy-mode=ipvs",
                                              "--config=/c.yaml"], read=unreadable)
    assert value.mode == "ipvs" and len(unknowns) == 1
    assert "cannot read config /c.yaml" in unknowns[0].reason


def test_kube_proxy_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_proxy, "find_processes", lambda: [])
    result = kube_proxy.collect(ProbeContext())
    assert result == ProbeResult(None, (Unknown("kube-proxy", "no kube-proxy process found"),))


def test_kube_api_disabled_and_unconfigured(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    disabled = kube_api.collect(ProbeContext(use_kube_api=False))
    assert disabled == ProbeResult((None, None, None, None),
                                   (Unknown("kubernetes API", "disabled (--no-kube-api)"),))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    unconfigured = kube_api.collect(ProbeContext())
    assert unconfigured.value == (None, None, None, None)
    assert unconfigured.unknowns == (Unknown(
        "kubernetes API", "not configured: no in-cluster service account and no kubeconfig"),)
    missing = kube_api.collect(ProbeContext(kubeconfig=str(tmp_path / "kc")))
    assert "not found" in missing.unknowns[0].reason


def test_kube_api_unreachable_server_is_an_unknown(tmp_path: Path) -> None:
    # Port 9 on 127.0.0.1 (discard) is closed: every request fails fast.
    kc = tmp_path / "kubeconfig"
    kc.write_text("""apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
""")
    result = kube_api.collect(ProbeContext(node_name="n1", kubeconfig=str(kc), timeout=2))
    assert result.value == (None, None, None, None)
    assert [u.reason.split(":")[0] for u in result.unknowns] == ["services", "node",
                                                                  "ingresses", "kube-proxy"]


def test_collect_live_turns_a_crash_into_an_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.probes as probes

    def boom(ctx: ProbeContext) -> ProbeResult:
        raise RuntimeError("netlink exploded")

    def multi(ctx: ProbeContext) -> ProbeResult:
        return ProbeResult(((), None, ()), (Unknown("kubernetes API", "node: x"),))

    monkeypatch.setattr(probes, "REGISTRY", [
        probe_base.Probe("addresses", "addresses", boom),
        probe_base.Probe("kubernetes API", ("services", "node_info", "ingresses"), multi),
        probe_base.Probe("bad", ("ipvs", "ipsets"), lambda ctx: ProbeResult(1)),
    ])
    snap = collect_live(ProbeContext(node_name="n1"))
    assert snap.node == "n1" and snap.origin == "live"
    assert snap.addresses is None and snap.services == () and snap.node_info is None
    assert snap.ipvs is None and snap.ipsets is None
    assert snap.unknowns[0] == Unknown("addresses", "probe failed: netlink exploded")
    assert snap.unknowns[1] == Unknown("kubernetes API", "node: x")
    assert snap.unknowns[2].source == "bad"


def test_register_rejects_unknown_and_shared_fields() -> None:
    with pytest.raises(ValueError, match="not a NodeSnapshot field"):
        probe_base.register(probe_base.Probe("x", "nope", lambda c: ProbeResult(None)))
    with pytest.raises(ValueError, match="both fill"):
        probe_base.register(probe_base.Probe("x", "ipvs", lambda c: ProbeResult(None)))


def test_backend_choice() -> None:
    hint = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"
    kube = ("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n"
            "-A KUBE-SERVICES -j RETURN\nCOMMIT\n")
    docker = "*nat\n:DOCKER - [0:0]\n" + "-A DOCKER -j RETURN\n" * 3 + "COMMIT\n"
    assert kube_score(kube) == (0, 2, 1)
    assert choose([Dump("legacy", "l", hint), Dump("nft", "n", kube)]).backend == "legacy"
    assert choose([Dump("legacy", "l", kube), Dump("nft", "n", docker)]).backend == "legacy"
    assert choose([Dump("legacy", "l", docker), Dump("nft", "n", "")]).backend == "legacy"
    assert choose([Dump("legacy", "l", kube), Dump("nft", "n", kube)]).backend == "nft"


def test_sysctl_key_spelling() -> None:
    root = Path("/proc/sys")
    assert sysctl_key(root / "net/ipv4/conf/eth0.100/rp_filter", root) == \
        "net.ipv4.conf.eth0/100.rp_filter"
    assert sysctl_key(root / "net/ipv4/ip_forward", root) == "net.ipv4.ip_forward"


# --- namespace tests ------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="needs root and iproute2")


def _have(*tools: str) -> bool:
    return all(shutil.which(t) for t in tools)


IPSET_SCRIPT = """
ipset create KUBE-CLUSTER-IP hash:ip,port
ipset add KUBE-CLUSTER-IP 10.96.0.10,udp:53
ipset add KUBE-CLUSTER-IP 10.96.0.10,tcp:53
ipset add KUBE-CLUSTER-IP 192.0.2.7,sctp:9000
ipset create KUBE-LOAD-BALANCER hash:ip,port
ipset add KUBE-LOAD-BALANCER 192.0.2.7,tcp:80
ipset create KUBE-LOAD-BALANCER-LOCAL hash:ip,port
ipset create KUBE-LOOP-BACK hash:ip,port,ip
ipset add KUBE-LOOP-BACK 10.244.1.5,tcp:8080,10.244.1.5
ipset create KUBE-LOAD-BALANCER-SOURCE-CIDR hash:ip,port,net
ipset add KUBE-LOAD-BALANCER-SOURCE-CIDR 192.0.2.7,tcp:80,203.0.113.0/24
ipset add KUBE-LOAD-BALANCER-SOURCE-CIDR 192.0.2.7,tcp:80,198.51.100.0/25 nomatch
ipset create KUBE-NODE-PORT-TCP bitmap:port range 0-65535
ipset add KUBE-NODE-PORT-TCP 30080
ipset add KUBE-NODE-PORT-TCP 31000
ipset create KUBE-NET hash:net
ipset add KUBE-NET 10.244.0.0/16
ipset add KUBE-NET 10.244.9.0/24 nomatch
ipset add KUBE-NET 10.1.2.3
ipset create KUBE-IP hash:ip
ipset add KUBE-IP 10.0.0.10
ipset create KUBE-IP6 hash:ip,port family inet6
ipset add KUBE-IP6 fd00::7,tcp:80
ipset create KUBE-COMMENT hash:ip comment counters
ipset add KUBE-COMMENT 10.9.9.9 comment "a b c"
"""

NAT_KUBE = """*mangle
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-EXT-ABC - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -j MASQUERADE --random-fully
-A KUBE-SERVICES -d 192.0.2.7/32 -p tcp -m comment --comment "default/web lb IP" \
-m tcp --dport 80 -j KUBE-EXT-ABC
-A KUBE-EXT-ABC -s 10.244.0.0/16 -j RETURN
-A KUBE-EXT-ABC -j KUBE-MARK-MASQ
COMMIT
"""

# Something else's rules (more lines than kube's, no KUBE- chains): must lose.
NAT_OTHER = """*nat
:POSTROUTING ACCEPT [0:0]
:DOCKER - [0:0]
""" + "".join(f"-A DOCKER -d 172.17.0.{i}/32 -j RETURN\n" for i in range(1, 30)) + "COMMIT\n"


def build_node(ns: Netns, peer: Netns) -> None:
    # No IPv6 duplicate address detection: a link-local address that turns from
    # "tentative" to valid mid-test would look like a change made by the agent.
    ns.run("sysctl", "-q", "-w", "net.ipv6.conf.default.accept_dad=0")
    veth(ns, "eth0", peer, "eth1")
    ns.sh("""
ip addr add 10.0.0.10/24 dev eth0
ip link set eth0 up
ip link add cni0 type bridge
ip addr add 10.244.1.1/24 dev cni0
ip link set cni0 up
ip link add kube-ipvs0 type bridge
ip addr add 10.96.0.10/32 dev kube-ipvs0
ip addr add 192.0.2.7/32 dev kube-ipvs0
ip addr add 10.96.100.0/32 dev kube-ipvs0
ip link add eth0.100 type bridge
ip addr add 10.100.0.1/24 dev eth0.100
ip link set eth0.100 up
ip addr add fd00::1/64 dev eth0.100 nodad
""")
    peer.sh("ip addr add 10.0.0.1/24 dev eth1 && ip link set eth1 up")
    sysctls = {"net.ipv4.ip_forward": "1", "net.ipv4.conf.eth0.rp_filter": "2",
               "net.ipv4.conf.cni0.accept_local": "1",
               "net.ipv4.conf.kube-ipvs0.route_localnet": "1",
               "net.ipv4.conf.all.log_martians": "1",
               "net.ipv4.conf.eth0/100.rp_filter": "1"}
    for key, value in sysctls.items():
        ns.run("sysctl", "-q", "-w", f"{key}={value}")


@pytest.fixture(scope="module")
def node() -> Iterator[Netns]:
    if os.geteuid() != 0 or not _have("ip", "ipset", "sysctl"):
        pytest.skip("needs root, iproute2, ipset, procps")
    with netns("lbpn") as ns, netns("lbpp") as peer:
        build_node(ns, peer)
        ns.sh(IPSET_SCRIPT)
        yield ns


def snapshot_in(ns: Netns) -> NodeSnapshot:
    script = ("import json\n"
              "from agent.probes import collect_live, ProbeContext\n"
              "from agent.snapshot import to_plain\n"
              "snap = collect_live(ProbeContext(node_name='lab', use_kube_api=False))\n"
              "print(json.dumps(to_plain(snap)))\n")
    proc = ns.run(PY, "-c", script, timeout=120)
    return NodeSnapshot.from_json(proc.stdout)


def addresses_from_ip_json(text: str) -> tuple[Address, ...]:
    out = []
    for link in json.loads(text):
        up = "UP" in link["flags"]
        for a in link.get("addr_info", []):
            out.append(Address(link["ifname"], a["local"], a["prefixlen"], a["scope"], up))
    return tuple(sorted(out, key=lambda a: (a.ifname, a.address.count(":") > 0, a.address)))


def ipsets_from_save(text: str) -> tuple[IpSet, ...]:
    types: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for line in text.splitlines():
        words = line.split()
        if words[0] == "create":
            types[words[1]] = words[2]
            members[words[1]] = []
        elif words[0] == "add":
            members[words[1]].append(words[2] + (" nomatch" if "nomatch" in words[3:] else ""))
    return tuple(IpSet(n, types[n], tuple(sorted(members[n]))) for n in sorted(types))


@pytest.mark.netns
def test_addresses_match_ip_json(node: Netns) -> None:
    snap = snapshot_in(node)
    expected = addresses_from_ip_json(node.run("ip", "-j", "addr", "show").stdout)
    assert snap.addresses == expected
    ipvs0 = [a for a in snap.addresses or () if a.ifname == "kube-ipvs0"]
    assert {a.address for a in ipvs0} == {"10.96.0.10", "192.0.2.7", "10.96.100.0"}
    assert all(not a.link_up and a.prefixlen == 32 for a in ipvs0)


def local_tables(ns: Netns) -> str:
    """What `ip` prints of both families' local tables, IPv4 first."""
    return (ns.run("ip", "route", "show", "table", "local").stdout
            + ns.run("ip", "-6", "route", "show", "table", "local").stdout)


@pytest.mark.netns
def test_local_table_matches_ip_route(node: Netns) -> None:
    settle(node)  # the link-local address's local route follows its DAD
    snap = snapshot_in(node)
    printed = [line.rstrip() for line in local_tables(node).splitlines()]
    routes = snap.local_routes or ()
    assert sorted(r.line for r in routes) == sorted(printed)
    assert any(":" in r.dst for r in routes)  # the IPv6 table too (::1 at least)
    assert list(routes) == sorted(routes, key=lambda r: (r.type, r.dst, r.dev or ""))
    by_dst = {r.dst: r for r in routes}
    # The kernel adds local routes for addresses of a DOWN interface (and nothing else:
    # no broadcast route for it), so the VIPs on kube-ipvs0 are local.
    assert by_dst["192.0.2.7"] == LocalRoute(
        "local", "192.0.2.7", "kube-ipvs0", "192.0.2.7",
        "local 192.0.2.7 dev kube-ipvs0 proto kernel scope host src 192.0.2.7")
    assert by_dst["127.0.0.0/8"].line == \
        "local 127.0.0.0/8 dev lo proto kernel scope host src 127.0.0.1"
    assert by_dst["10.0.0.255"] == LocalRoute(
        "broadcast", "10.0.0.255", "eth0", "10.0.0.10",
        "broadcast 10.0.0.255 dev eth0 proto kernel scope link src 10.0.0.10")
    assert not any(r.type == "broadcast" and r.dev == "kube-ipvs0" for r in routes)


@pytest.mark.netns
@needs_root
def test_local_table_linkdown() -> None:
    # A carrier-less UP interface: `ip` prints "linkdown" on its broadcast route.
    with netns("lbpd") as ns, netns("lbpq") as peer:
        veth(ns, "eth0", peer, "eth1")  # peer end stays DOWN: no carrier
        ns.sh("ip addr add 10.5.0.10/24 dev eth0 && ip link set eth0 up")
        settle(ns)
        snap = snapshot_in(ns)
        printed = [line.rstrip() for line in local_tables(ns).splitlines()]
        assert sorted(r.line for r in snap.local_routes or ()) == sorted(printed)
        assert any(line.endswith(" linkdown") for line in printed)


@pytest.mark.netns
def test_ipsets_match_ipset_save(node: Netns) -> None:
    snap = snapshot_in(node)
    assert snap.ipsets == ipsets_from_save(node.run("ipset", "save").stdout)
    lb = snap.ipset("KUBE-LOAD-BALANCER-SOURCE-CIDR")
    assert lb is not None and lb.members == ("192.0.2.7,tcp:80,198.51.100.0/25 nomatch",
                                             "192.0.2.7,tcp:80,203.0.113.0/24")
    assert snap.ipset("KUBE-NODE-PORT-TCP") == IpSet("KUBE-NODE-PORT-TCP", "bitmap:port",
                                                     ("30080", "31000"))
    assert snap.ipset("KUBE-LOAD-BALANCER-LOCAL") == IpSet("KUBE-LOAD-BALANCER-LOCAL",
                                                           "hash:ip,port", ())


@pytest.mark.netns
def test_sysctls_and_the_unavailable_sources(node: Netns) -> None:
    snap = snapshot_in(node)
    values = snap.sysctls or {}
    for key in ("net.ipv4.ip_forward", "net.ipv4.conf.eth0.rp_filter",
                "net.ipv4.conf.cni0.accept_local", "net.ipv4.conf.kube-ipvs0.route_localnet",
                "net.ipv4.conf.all.log_martians", "net.ipv4.conf.eth0/100.rp_filter",
                "net.ipv4.conf.lo.accept_local"):
        printed = node.run("sysctl", "-n", key).stdout.strip()
        assert values[key] == printed, key
    assert values["net.ipv4.conf.eth0.rp_filter"] == "2"
    assert set(values) == {"net.ipv4.ip_forward"} | {
        f"net.ipv4.conf.{i}.{k}" for i in ("all", "default", "lo", "eth0", "cni0",
                                           "kube-ipvs0", "eth0/100")
        for k in ("accept_local", "rp_filter", "route_localnet", "log_martians")}

    reasons = {u.source: u.reason for u in snap.unknowns}
    if not os.path.exists("/proc/net/ip_vs"):
        assert snap.ipvs is None
        assert reasons["ipvs"] == "unavailable: ip_vs not loaded"
    if not any(kube_proxy.is_kube_proxy(p.info["name"], p.info["cmdline"] or [])
               for p in kube_proxy.find_processes()):
        assert snap.kube_proxy is None
        assert reasons["kube-proxy"] == "no kube-proxy process found"
    assert (snap.services, snap.node_info, snap.ingresses) == (None, None, None)
    assert reasons["kubernetes API"] == "disabled (--no-kube-api)"


def _nft_tables(ns: Netns) -> str:
    return ns.run("nft", "list", "tables").stdout if shutil.which("nft") else ""


@pytest.mark.netns
@needs_root
@pytest.mark.skipif(not _have("iptables-nft-restore", "iptables-nft-save"),
                    reason="needs iptables (nft)")
def test_nat_nft_only_creates_nothing() -> None:
    with netns("lbpf") as ns:
        ns.run("iptables-nft-restore", input=NAT_KUBE)
        tables_before = _nft_tables(ns)
        snap = snapshot_in(ns)
        assert snap.netfilter is not None and snap.netfilter.backend == "nft"
        expected = parse_iptables_save(ns.run("iptables-nft-save").stdout,
                                       source="iptables-nft-save", backend="nft")
        assert snap.netfilter.tables == expected.tables
        nat = snap.netfilter.table("nat")
        assert nat is not None and nat.chain("KUBE-EXT-ABC") is not None
        # no legacy table was created by looking, and no nft table either
        assert ns.run("cat", "/proc/net/ip_tables_names").stdout.strip() == ""
        assert _nft_tables(ns) == tables_before


@pytest.mark.netns
@needs_root
@pytest.mark.skipif(not _have("iptables-legacy-restore", "iptables-legacy-save"),
                    reason="needs iptables (legacy)")
def test_nat_legacy_only() -> None:
    with netns("lbpl") as ns:
        ns.run("iptables-legacy-restore", input=NAT_KUBE)
        tables_before = _nft_tables(ns)
        names_before = ns.run("cat", "/proc/net/ip_tables_names").stdout
        snap = snapshot_in(ns)
        assert snap.netfilter is not None and snap.netfilter.backend == "legacy"
        expected = parse_iptables_save(ns.run("iptables-legacy-save").stdout,
                                       source="iptables-legacy-save", backend="legacy")
        assert snap.netfilter.tables == expected.tables
        assert ns.run("cat", "/proc/net/ip_tables_names").stdout == names_before
        assert _nft_tables(ns) == tables_before


@pytest.mark.netns
@needs_root
@pytest.mark.skipif(not _have("iptables-legacy-restore", "iptables-nft-restore"),
                    reason="needs both iptables backends")
@pytest.mark.parametrize("kube_backend", ["legacy", "nft"])
def test_nat_both_backends_kube_chains_win(kube_backend: str) -> None:
    other = "nft" if kube_backend == "legacy" else "legacy"
    with netns("lbpb") as ns:
        ns.run(f"iptables-{kube_backend}-restore", input=NAT_KUBE)
        ns.run(f"iptables-{other}-restore", input=NAT_OTHER)
        snap = snapshot_in(ns)
        assert snap.netfilter is not None and snap.netfilter.backend == kube_backend
        expected = parse_iptables_save(ns.run(f"iptables-{kube_backend}-save").stdout,
                                       source=f"iptables-{kube_backend}-save")
        assert snap.netfilter.tables == expected.tables


@pytest.mark.netns
@needs_root
def test_nat_no_tables_at_all() -> None:
    with netns("lbpe") as ns:
        snap = snapshot_in(ns)
        if shutil.which("iptables-nft-save") or shutil.which("iptables-legacy-save"):
            assert snap.netfilter is not None and snap.netfilter.tables == ()
        assert ns.run("cat", "/proc/net/ip_tables_names").stdout.strip() == ""


# --- write_bundle ---------------------------------------------------------------------


def node_state(ns: Netns) -> dict[str, str]:
    """Everything a probe or the bundle writer must never change."""
    def strip(text: str) -> str:
        # "# Generated by ... on <date>" changes every run, and packet counters are
        # traffic, not configuration.
        return "\n".join(re.sub(r"\[\d+:\d+\]", "", line) for line in text.splitlines()
                         if not line.startswith("#"))

    state = {"ip_tables_names": ns.run("cat", "/proc/net/ip_tables_names").stdout,
             "routes": ns.run("ip", "route", "show", "table", "all").stdout,
             # not `ip -d`: it prints bridge timers that tick by themselves
             "addresses": ns.run("ip", "addr", "show").stdout,
             "ipset": ns.run("ipset", "save").stdout,
             "sysctl": ns.run("sh", "-c", "grep -r . /proc/sys/net/ipv4/conf "
                              "/proc/sys/net/ipv4/ip_forward").stdout}
    if state["ip_tables_names"].strip():
        state["legacy"] = strip(ns.run("iptables-legacy-save").stdout)
    if shutil.which("iptables-nft-save"):
        state["nft-save"] = strip(ns.run("iptables-nft-save").stdout)
    if shutil.which("nft"):
        state["nft"] = re.sub(r"packets \d+ bytes \d+", "",
                              ns.run("nft", "list", "ruleset").stdout)
    return state


@pytest.mark.netns
def test_write_bundle_writes_what_the_probes_read_and_changes_nothing(
        node: Netns, tmp_path: Path) -> None:
    if _have("iptables-nft-restore"):
        node.run("iptables-nft-restore", input=NAT_KUBE)
    settle(node)
    before = node_state(node)
    out = tmp_path / "bundle" / "sub"
    script = ("import json, sys\n"
              "from agent.bundle.write import write_bundle\n"
              "from agent.probes import ProbeContext\n"
              f"print(json.dumps(write_bundle({str(out)!r}, "
              "ProbeContext(use_kube_api=False))))\n")
    report = dict(json.loads(node.run(PY, "-c", script, timeout=120).stdout))
    after = node_state(node)
    assert after == before

    from agent.bundle import files as bundle_files

    assert list(report) == list(bundle_files.ALL)
    for name in (bundle_files.IPSET, bundle_files.ROUTE_LOCAL, bundle_files.ADDR,
                 bundle_files.SYSCTL):
        assert report[name] == "written", (name, report[name])
    for name in (bundle_files.SERVICES, bundle_files.NODE, bundle_files.INGRESSES):
        assert report[name] == "skipped: disabled (--no-kube-api)"
        assert not (out / name).exists()
    if not os.path.exists("/proc/net/ip_vs"):
        assert report[bundle_files.IPVSADM] == "skipped: unavailable: ip_vs not loaded"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files

    assert (out / bundle_files.ROUTE_LOCAL).read_text() == local_tables(node)
    assert ipsets_from_save((out / bundle_files.IPSET).read_text()) == \
        ipsets_from_save(node.run("ipset", "save").stdout)

    snap = snapshot_in(node)
    if _have("iptables-nft-restore"):
        assert report[bundle_files.IPTABLES] == "written"
        text = (out / bundle_files.IPTABLES).read_text()
        assert snap.netfilter is not None
        assert parse_iptables_save(text, source="iptables-nft-save").tables == \
            snap.netfilter.tables
    lines = (out / bundle_files.SYSCTL).read_text().splitlines()
    assert lines == sorted(lines)
    assert dict(line.split(" = ", 1) for line in lines) == snap.sysctls

    # The bundle readers see what the live probes saw (when they exist in this tree).
    try:
        from agent.parse.addr_text import parse_addresses
        from agent.parse.ipset_text import parse_ipsets
        from agent.parse.route_text import parse_local_routes
    except ImportError:
        return
    assert parse_addresses((out / bundle_files.ADDR).read_text()) == snap.addresses
    assert parse_local_routes((out / bundle_files.ROUTE_LOCAL).read_text()) == snap.local_routes
    assert parse_ipsets((out / bundle_files.IPSET).read_text()) == snap.ipsets



@pytest.mark.parametrize(("raw", "text"), [
    ("eth0", "eth0"),
    ("brcafé", "brcafé"),  # UTF-8 on the node: kept
    (b"br\xe9x", "br\ufffdx"),  # from netlink (pyroute2 gives bytes it cannot decode)
    (b"br\xe9x".decode("utf-8", "surrogateescape"), "br\ufffdx"),  # from /proc or /sys
    ("br\ud800x", "br?x"),  # a surrogate no escape made
])
def test_interface_names_are_text_every_output_can_encode(raw: bytes | str, text: str) -> None:
    got = kernel_name(raw)
    assert got == text
    got.encode("utf-8")  # (what the snapshot's JSON, a bundle file and the report need)


def test_kube_proxy_config_is_read_bounded_and_never_waited_for(tmp_path: Path) -> None:
    """Its path through /proc/PID/root (here this process's own root): a ConfigMap's
    relative symlinks are followed; a FIFO (read_text blocked for ever: the daemon's
    cycle with it), a device or a huge file is named and skipped, flags still used."""
    data = tmp_path / "..2026_11_28"
    data.mkdir()
    (data / "config.conf").write_text("mode: iptables\nclusterCIDR: 10.244.0.0/16\n")
    (tmp_path / "..data").symlink_to(data.name)
    (tmp_path / "config.conf").symlink_to("..data/config.conf")
    os.mkfifo(tmp_path / "fifo.conf")
    (tmp_path / "zero.conf").symlink_to("/dev/zero")
    with (tmp_path / "big.conf").open("wb") as f:
        f.truncate(2 << 20)

    def describe(name: str) -> tuple[Any, list[Unknown]]:
        got: list[tuple[Any, list[Unknown]]] = []
        t = threading.Thread(target=lambda: got.append(kube_proxy.describe(
            os.getpid(), ["kube-proxy", "--proxy-mode=ipvs", f"--config={tmp_path / name}"])),
            daemon=True)
        t.start()
        t.join(10)
        assert got, f"reading {name} hung"
        return got[0]

    value, unknowns = describe("config.conf")
    assert (value.mode, value.cluster_cidr, unknowns) == ("iptables", "10.244.0.0/16", [])
    for name, why in (("fifo.conf", "not a regular file"), ("zero.conf", "not a regular file"),
                      ("big.conf", "2097152 bytes: larger than 1 MiB")):
        value, unknowns = describe(name)
        assert value.mode == "ipvs", name  # the flag
        (u,) = unknowns
        assert u.reason.endswith(f": {why}; mode/clusterCIDR/masqueradeAll from flags only")
