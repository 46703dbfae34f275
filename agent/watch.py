"""One look at this node: the snapshot's facts and LB targets built once, then the
NodePort capture and the diagnosis both use them (`check --capture` and every daemon
cycle). The wiring lives here, above capture/ and diagnose/, so neither imports the other
to set itself up."""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent.capture.classify import ipv6_pod_prefixes, make_classifier
from agent.capture.corroborate import corroborators
from agent.capture.engine import capture
from agent.capture.model import CaptureResult
from agent.diagnose import Prepared


def watch_node(prepared: Prepared, seconds: float, *, port_range: tuple[int, int],
               stop: threading.Event | None = None,
               progress: Callable[[float, int, int], None] | None = None) -> CaptureResult:
    facts, snap = prepared.facts, prepared.facts.snapshot
    classify = source_classifier(prepared)
    # NodePort handshakes are SYNs to this node's own addresses (None: could not tell)
    local = (sorted(facts.local_ips) if snap.local_routes is not None
             or snap.addresses is not None else None)
    with corroborators() as corr:
        result = capture(seconds, classify=classify, port_range=port_range,
                         progress=progress, stop=stop, local_addresses=local)
        return corr.attach(result)


def source_classifier(prepared: Prepared) -> Callable[[str], str]:
    """The capture's source classes from the node's facts: its own addresses, its pod
    networks of both families (the Node's podCIDRs, the IPv4 and IPv6 pod networks the
    facts found, whichever way: --pod-cidr, kube-proxy's rules, routes, the pod bridge),
    and the LB IPs it knows."""
    facts, snap = prepared.facts, prepared.facts.snapshot
    pod_prefixes = [*(snap.node_info.pod_cidrs if snap.node_info else ()),
                    *([facts.pod.prefix] if facts.pod else ()),
                    *([facts.pod6.prefix] if facts.pod6 else ()),
                    *ipv6_pod_prefixes(snap.addresses)]
    return make_classifier(facts.is_local, pod_prefixes,
                           (t.ip for t in prepared.all_targets))
