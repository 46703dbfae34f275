"""One capture of this node's NodePort handshakes, set up from its snapshot: the source
classifier, the node's own addresses and the corroborating counters. Used by
`check --capture` and by the daemon alike."""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent.capture.classify import make_classifier
from agent.capture.corroborate import corroborators
from agent.capture.engine import capture
from agent.capture.model import CaptureResult
from agent.diagnose.lb_ip import discover
from agent.diagnose.node_facts import build_facts
from agent.snapshot import NodeSnapshot


def watch_node(snap: NodeSnapshot, seconds: float, *, port_range: tuple[int, int],
               stop: threading.Event | None = None,
               progress: Callable[[float, int, int], None] | None = None) -> CaptureResult:
    facts = build_facts(snap)
    classify = make_classifier(facts, (t.ip for t in discover(snap)))
    # NodePort handshakes are SYNs to this node's own addresses (None: could not tell)
    local = (sorted(facts.local_ips) if snap.local_routes is not None
             or snap.addresses is not None else None)
    with corroborators() as corr:
        result = capture(seconds, classify=classify, port_range=port_range,
                         progress=progress, stop=stop, local_addresses=local)
        return corr.attach(result)
