"""Which load balancer provider a Service is behind, from what the node shows (the
Service's annotations and loadBalancerClass, else the Node's spec.providerID), and that
provider's own knobs (agent/diagnose/data/load_balancers.json, each entry sourced)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from agent.diagnose.lb_ip import LbTarget
from agent.snapshot import NodeSnapshot


@dataclass(frozen=True, slots=True)
class ProxyProtocol:
    key: str  # the annotation that turns it on
    off: tuple[str, ...]  # the values that leave it off


@dataclass(frozen=True, slots=True)
class Provider:
    id: str
    name: str
    provider_id_prefixes: tuple[str, ...]
    annotation_prefixes: tuple[str, ...]
    load_balancer_classes: tuple[str, ...]
    remedy: str
    proxy_protocol: tuple[ProxyProtocol, ...]
    # (controller, first release, the change) that sets ipMode: Proxy, if one does
    sets_ip_mode: tuple[str, str, str] | None
    sources: tuple[str, ...]

    def proxy_protocol_on(self, annotations: tuple[tuple[str, str], ...]) -> str | None:
        """The annotation that turns PROXY protocol on, as "key: value", if one does."""
        given = dict(annotations)
        for pp in self.proxy_protocol:
            value = given.get(pp.key)
            if value is not None and value.strip().lower() not in pp.off:
                return f"{pp.key}: {value}"
        return None


@cache
def providers() -> tuple[Provider, ...]:
    doc = json.loads(resources.files("agent.diagnose").joinpath("data/load_balancers.json")
                     .read_text())
    out = []
    for p in doc["providers"]:
        ip_mode = p["sets_ip_mode"]
        out.append(Provider(
            p["id"], p["name"], tuple(p["provider_id_prefixes"]),
            tuple(p["annotation_prefixes"]), tuple(p["load_balancer_classes"]), p["remedy"],
            tuple(ProxyProtocol(x["key"], tuple(x["off"])) for x in p["proxy_protocol"]),
            (ip_mode["component"], ip_mode["since"], ip_mode["change"]) if ip_mode else None,
            tuple(p["sources"])))
    return tuple(out)


def provider_of(t: LbTarget, snap: NodeSnapshot) -> tuple[Provider, str] | None:
    """(the provider, how it was recognised): the Service's loadBalancerClass, then its
    annotations (a MetalLB address on an AWS node is MetalLB's), else the Node's
    providerID."""
    if t.load_balancer_class:
        for p in providers():
            if t.load_balancer_class in p.load_balancer_classes:
                return p, f"the Service's loadBalancerClass {t.load_balancer_class}"
    for p in providers():
        key = next((k for k, _ in t.annotations if k.startswith(p.annotation_prefixes)), None)
        if key is not None:
            return p, f"the Service's annotation {key}"
    node = snap.node_info
    pid = node.provider_id if node else None
    if pid:
        for p in providers():
            if pid.startswith(p.provider_id_prefixes):
                return p, f"the Node's spec.providerID {pid}"
    return None
