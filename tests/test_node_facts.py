"""build_facts on dual-stack and IPv6-only node states: the node's IPv6 address and this
node's IPv6 pod prefix, found from the same sources as the IPv4 ones."""

from __future__ import annotations

import pytest

from agent.diagnose.node_facts import build_facts
from agent.snapshot import Address, KubeProxy, LocalRoute, NodeInfo, NodeSnapshot

DUAL = (
    Address("eth0", "10.0.0.10", 24),
    Address("eth0", "2001:db8:0:1::10", 64),
    Address("eth0", "fe80::1", 64, "link"),
    Address("cni0", "10.244.1.1", 24),
    Address("cni0", "fd00:10:244:1::1", 64),
    Address("cni0", "fe80::2", 64, "link"),
    Address("kube-ipvs0", "2001:db8:ffff::5", 128),
    Address("lo", "::1", 128, "host"),
)


def test_dual_stack_node_has_both_families() -> None:
    f = build_facts(NodeSnapshot(addresses=DUAL))
    assert (f.uplink, f.node_ip) == ("eth0", "10.0.0.10")
    assert f.node_ip6 == "2001:db8:0:1::10"  # not the link-local one, not kube-ipvs0's
    assert f.pod is not None and f.pod.prefix == "10.244.1.0/24"
    assert f.pod6 is not None and f.pod6.prefix == "fd00:10:244:1::/64"
    assert f.pod6.iface == "cni0" and f.pod6.pod_ip == "fd00:10:244:1::2"  # ::1 is the bridge's
    assert "pod bridge cni0" in f.pod6.how and f.pod6_unknown == ""


def test_node_podcidrs_list_gives_the_ipv6_prefix() -> None:
    snap = NodeSnapshot(addresses=DUAL, node_info=NodeInfo(
        "n", pod_cidrs=("10.244.1.0/24", "fd00:10:244:1::/64"),
        internal_ips=("10.0.0.10", "2001:db8:0:1::10")))
    f = build_facts(snap)
    assert f.pod is not None and f.pod.prefix == "10.244.1.0/24"
    assert f.pod6 is not None and f.pod6.prefix == "fd00:10:244:1::/64"
    assert "Node's IPv6 podCIDR" in f.pod6.how


def test_internal_ip6_wins_over_the_uplink_and_is_matched_canonically() -> None:
    addrs = (*DUAL, Address("ens5", "2001:db8:0:2::20", 64))
    snap = NodeSnapshot(addresses=addrs, node_info=NodeInfo(
        "n", internal_ips=("10.0.0.10", "2001:DB8:0:2:0::20")))
    assert build_facts(snap).node_ip6 == "2001:db8:0:2::20"


def test_ipv6_only_node() -> None:
    addrs = (Address("eth0", "2001:db8:0:1::10", 64), Address("cni0", "fd00:10:244:1::1", 64))
    f = build_facts(NodeSnapshot(addresses=addrs))
    assert f.node_ip is None and f.pod is None and "no pod network" in f.pod_unknown
    assert f.node_ip6 == "2001:db8:0:1::10"
    assert f.pod6 is not None and f.pod6.prefix == "fd00:10:244:1::/64"


def test_cluster_cidr_list_narrowed_to_the_bridge() -> None:
    addrs = (Address("eth0", "10.0.0.10", 24), Address("eth0", "2001:db8:0:1::10", 64),
             Address("cbr0", "10.244.1.1", 24), Address("cbr0", "fd00:10:244:1::1", 64),
             Address("docker0", "fd00:dead::1", 64))
    kp = KubeProxy(cluster_cidr="10.244.0.0/16,fd00:10:244::/56")
    f = build_facts(NodeSnapshot(addresses=addrs, kube_proxy=kp))
    assert f.pod6 is not None and f.pod6.prefix == "fd00:10:244:1::/64"
    assert "--cluster-cidr fd00:10:244::/56" in f.pod6.how


def test_ipv6_pod_prefix_from_the_main_table_route_not_link_local() -> None:
    routes = (LocalRoute("unicast", "fe80::/64", "cni0", None, "fe80::/64 dev cni0"),
              LocalRoute("unicast", "fd00:10:244:1::/64", "cni0", None,
                         "fd00:10:244:1::/64 dev cni0 proto kernel metric 256"))
    f = build_facts(NodeSnapshot(routes=routes))
    assert f.pod6 is not None and f.pod6.prefix == "fd00:10:244:1::/64"
    assert f.pod6.iface == "cni0"


def test_ipv4_only_node_says_why_ipv6_is_unknown() -> None:
    addrs = (Address("eth0", "10.0.0.10", 24), Address("cni0", "10.244.1.1", 24))
    f = build_facts(NodeSnapshot(addresses=addrs))
    assert f.node_ip6 is None and f.pod6 is None
    assert "IPv6" in f.pod6_unknown and f.pod is not None
    f = build_facts(NodeSnapshot())
    assert f.pod6 is None and "--pod-cidr" in f.pod6_unknown


def test_given_pod_cidr_per_family() -> None:
    f = build_facts(NodeSnapshot(given={"pod_cidr": "10.244.1.0/24,fd00:1::/64"}))
    assert f.pod is not None and f.pod.prefix == "10.244.1.0/24"
    assert f.pod6 is not None and f.pod6.prefix == "fd00:1::/64"
    assert f.pod6.pod_ip == "fd00:1::1"


def test_the_ipv6_uplinks_subnet_is_never_the_pod_network() -> None:
    # an IPv6-only node whose pods sit on routed veths (no bridge address): the node's
    # own subnet on eth0 is no pod network (it was taken for one: "pod bridge eth0"),
    # and the IPv6 walk leaves by eth0, the interface holding the node's IPv6 address
    from agent.diagnose.family import ipv6_facts

    addrs = (Address("eth0", "2001:db8:0:1::10", 64), Address("eth0", "fe80::1", 64, "link"),
             Address("lo", "::1", 128, "host"))
    f = build_facts(NodeSnapshot(addresses=addrs))
    assert f.node_ip6 == "2001:db8:0:1::10"
    assert f.pod6 is None and "no IPv6 pod network" in f.pod6_unknown, f.pod6
    assert ipv6_facts(f).uplink == "eth0"
    # IPv4 on ens5, IPv6 on eth0 (a second NIC): eth0's IPv6 subnet is no pod network
    f = build_facts(NodeSnapshot(addresses=(*addrs, Address("ens5", "10.0.0.5", 24))))
    assert f.uplink == "ens5" and f.pod6 is None, f.pod6
    assert ipv6_facts(f).uplink == "eth0"


def test_local_and_address_types_of_ipv4_addresses_as_ipaddress_says() -> None:
    """A walk asks whether an address is local (and of what type) for every endpoint of
    every LB IP; IPv4 addresses are answered by number, not by ipaddress: the answers are
    ipaddress's, the first matching `local` route's, for addresses drawn around the edges
    of the node's local prefixes, broadcast and multicast ones and text ipaddress refuses."""
    import ipaddress
    import random

    routes = (LocalRoute("local", "10.0.0.10", "eth0", "10.0.0.10", "l1"),
              LocalRoute("local", "127.0.0.0/8", "lo", "127.0.0.1", "l2"),
              LocalRoute("local", "10.96.0.0/12", "lo", None, "l3"),
              LocalRoute("local", "10.96.0.0/16", "kube-ipvs0", None, "l4"),
              LocalRoute("local", "fd00::/64", "lo", None, "l5"),
              LocalRoute("broadcast", "10.0.0.255", "eth0", "10.0.0.10", "l6"))
    f = build_facts(NodeSnapshot(local_routes=routes))
    nets = [(ipaddress.ip_network(r.dst), r) for r in routes
            if r.type == "local" and "/" in r.dst]

    def expected(addr: str) -> tuple[LocalRoute | None, str]:
        if addr == "10.0.0.10":
            return routes[0], "LOCAL"
        a = ipaddress.ip_address(addr)
        route = next((r for net, r in nets if a.version == net.version and a in net), None)
        kind = "LOCAL" if route else "BROADCAST" if addr == "10.0.0.255" else \
            "MULTICAST" if a.is_multicast else "UNICAST"
        return route, kind

    rnd = random.Random(7)
    edges = [0x0A600000, 0x0A60FFFF, 0x0A610000, 0x0AAFFFFF, 0x0AB00000, 0x7F000000,
             0x7FFFFFFF, 0x80000000, 0xDFFFFFFF, 0xE0000000, 0xEFFFFFFF, 0xF0000000, 0,
             0xFFFFFFFF, 0x0A0000FF]
    numbers = [e + d for e in edges for d in (-1, 0, 1)] + \
        [rnd.getrandbits(32) for _ in range(3000)]
    for n in numbers:
        addr = str(ipaddress.IPv4Address(n % 2**32))
        assert (f.local_route(addr), f.addr_type(addr)) == expected(addr), addr
    for addr in ("fd00::5", "fd00:0:0:1::5", "::ffff:10.96.0.1"):
        assert (f.local_route(addr), f.addr_type(addr)) == expected(addr), addr
    for bad in ("010.96.0.1", "10.96.0.256", "10.96.0"):  # (not addresses: refused alike)
        with pytest.raises(ValueError):
            ipaddress.ip_address(bad)
        with pytest.raises(ValueError):
            f.local_route(bad)
    # a local prefix added after a question is in the next answer
    f.local_nets.append((ipaddress.ip_network("192.0.2.0/24"), routes[2]))
    assert f.local_route("192.0.2.9") is routes[2] and f.addr_type("192.0.2.9") == "LOCAL"
