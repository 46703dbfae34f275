"""The IPv6 side of a node, as the IPv4 walk reads it: a view of the snapshot whose
iptables rules are the ip6tables ones, and node facts whose node address, pod network and
stand-ins are IPv6. The same PathFinder and rules then walk IPv6 LB IPs; only what the
kernel does differently (no rp_filter/accept_local for IPv6) is decided apart."""

from __future__ import annotations

from dataclasses import replace

from agent.diagnose.node_facts import (
    NODE_STAND_IN6,
    OUTSIDE_CLIENT6,
    POD_STAND_IN6,
    NodeFacts,
    uplink6,
)
from agent.snapshot import NodeSnapshot


def v6_local_known(snap: NodeSnapshot) -> bool:
    """Whether the input shows the IPv6 local table (or the addresses it is made of): a
    bundle or paste of IPv4 only cannot tell whether an IPv6 address is local."""
    if snap.local_routes is not None:
        return any(":" in r.dst for r in snap.local_routes)
    return any(":" in a.address for a in snap.addresses or ())


def ipv6_snapshot(snap: NodeSnapshot) -> NodeSnapshot:
    """``snap`` with the ip6tables rules where the iptables ones were (ipsets keep their
    names: kube-proxy's IPv6 ones are KUBE-6-*, and ip6tables rules name those); without
    any IPv6 local route or address, which addresses are local is unknown, not none."""
    known = v6_local_known(snap)
    return replace(snap, netfilter=snap.ip6tables,
                   local_routes=snap.local_routes if known else None,
                   addresses=snap.addresses if known else None)


def ipv6_facts(facts: NodeFacts) -> NodeFacts:
    """The facts a walk of IPv6 packets needs, from the node's facts (lookup tables are
    shared: they hold both families' addresses)."""
    snap6 = ipv6_snapshot(facts.snapshot)
    up6 = uplink6(facts) or facts.uplink
    f6 = NodeFacts(
        snap6, local_ips=facts.local_ips, local_nets=facts.local_nets,
        broadcast=facts.broadcast, uplink=up6, node_ip=facts.node_ip6,
        uplink_how=(f"{facts.uplink_how}; its IPv6 address {facts.node_ip6}"
                    if facts.uplink_how and facts.node_ip6 and up6 == facts.uplink else
                    f"IPv6 uplink {up6}: holds the node's IPv6 address {facts.node_ip6}"
                    if up6 != facts.uplink else facts.uplink_how),
        pod=facts.pod6, pod_unknown=facts.pod6_unknown, node_ip6=facts.node_ip6,
        pod6=facts.pod6, pod6_unknown=facts.pod6_unknown, family=6,
        outside_client=OUTSIDE_CLIENT6, node_stand_in=NODE_STAND_IN6,
        pod_stand_in=POD_STAND_IN6, _addrs=facts._addrs, _ipvs=facts._ipvs)
    if f6.node_ip is None and f6.local_route(NODE_STAND_IN6) is None:
        f6.assumed_local = frozenset({NODE_STAND_IN6})
    if f6.local_route(OUTSIDE_CLIENT6) is None:
        f6.assumed_remote = frozenset({OUTSIDE_CLIENT6})
    return f6
