"""Which class of source sent a SYN: this node's own address, a pod of this node, a known
LB IP, or anything else. Built once from the snapshot, called per handshake."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from agent.capture.model import SRC_LB, SRC_LOCAL, SRC_OTHER, SRC_POD
from agent.snapshot import Address

# The bridges CNIs put pods behind, as agent/diagnose/node_facts.py names them (capture
# sits below diagnose and does not import it).
POD_BRIDGES = ("cni0", "cbr0", "kube-bridge", "cilium_host", "weave", "docker0")


def ipv6_pod_prefixes(addresses: Iterable[Address] | None) -> list[str]:
    """The IPv6 networks of the global addresses on pod bridges: where this node's IPv6
    pods live when no Node object names its podCIDRs (the node facts find the IPv4 pod
    network; an IPv6 one they do not look for)."""
    out: list[str] = []
    for a in addresses or ():
        if a.ifname in POD_BRIDGES and ":" in a.address and a.scope == "global" \
                and a.prefixlen < 128:
            net = str(ipaddress.ip_network(f"{a.address}/{a.prefixlen}", strict=False))
            if net not in out:
                out.append(net)
    return out


def make_classifier(is_local: Callable[[str], bool | None], pod_prefixes: Iterable[str],
                    lb_ips: Iterable[str]) -> Callable[[str], str]:
    """``is_local``: is an address this node's own (None: unknown); ``pod_prefixes``:
    this node's pod networks; ``lb_ips``: the LB addresses the node knows."""
    prefixes = [ipaddress.ip_network(c, strict=False) for c in pod_prefixes]
    lbs = frozenset(lb_ips)
    cache: dict[str, str] = {}

    def classify(src: str) -> str:
        got = cache.get(src)
        if got is None:
            if is_local(src):
                got = SRC_LOCAL
            elif any(ipaddress.ip_address(src) in p for p in prefixes):
                got = SRC_POD
            elif src in lbs:
                got = SRC_LB
            else:
                got = SRC_OTHER
            if len(cache) < 65536:  # bounded: a SYN flood from random sources
                cache[src] = got
        return got

    return classify
