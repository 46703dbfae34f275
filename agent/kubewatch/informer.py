"""Four reflectors (Services, Ingresses, this Node, kube-system's Pods on this Node) and
what a probe reads from them.

Each object is decoded by agent.parse.kube as it arrives (the code that reads a bundle's
kubectl JSON), so the memory holds Service/Ingress/NodeInfo records, not API objects,
and a live run, a watched run and a bundle agree.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable
from typing import Any

from agent.kubewatch.reflector import JitteredBackoff, Reflector, object_key
from agent.parse.kube import (
    KUBE_PROXY_NAMESPACE,
    parse_ingresses,
    parse_kube_proxy_pod,
    parse_node,
    parse_services,
)
from agent.snapshot import Ingress, KubeProxyPod, NodeInfo, Service

SOURCE = "kubernetes API"
REFUSED = (401, 403, 404)  # statuses a retry within seconds does not mend


def _one(parse: Callable[[dict[str, Any], str], Any], kind: str
         ) -> Callable[[dict[str, Any]], Any]:
    def decode(obj: dict[str, Any]) -> Any:
        ns, name = object_key(obj)
        source = f"{SOURCE} {kind} {ns + '/' if ns else ''}{name}"
        # Items of a watch carry their kind, LIST items need not: wrap as a List.
        out = parse({"kind": f"{kind}List", "items": [{**obj, "kind": kind}]}, source)
        return out[0] if isinstance(out, tuple) else out
    return decode


class KubeInformer:
    """Starts list+watch of Services, Ingresses and (with a node name) this Node and the
    kube-system Pods on it (kube-proxy's image says its version)."""

    def __init__(self, api_client: Any, node_name: str | None, *,
                 on_change: Callable[[str], None] | None = None,
                 watch_timeout: float = 300.0, request_timeout: float = 10.0,
                 backoff_base: float = 1.0, backoff_cap: float = 60.0,
                 rng: random.Random | None = None) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.node_name = node_name
        rng = rng or random.Random()
        core, net = client.CoreV1Api(api_client), client.NetworkingV1Api(api_client)

        def reflector(name: str, call: Callable[..., Any], decode: Callable[..., Any],
                      selector: str | None = None) -> Reflector:
            return Reflector(name, call, decode, on_change=on_change,
                             field_selector=selector, watch_timeout=watch_timeout,
                             request_timeout=request_timeout, rng=rng,
                             backoff=JitteredBackoff(backoff_base, backoff_cap, rng))

        self.services = reflector("services", core.list_service_for_all_namespaces,
                                  _one(parse_services, "Service"))
        self.ingresses = reflector("ingresses", net.list_ingress_for_all_namespaces,
                                   _one(parse_ingresses, "Ingress"))
        # This node only: a fieldSelector, so no agent ever lists the cluster's nodes.
        self.node = reflector("node", core.list_node, _one(parse_node, "Node"),
                              f"metadata.name={node_name}") if node_name else None
        # kube-system's Pods on this node only (as the kubelet watches its own Pods): a
        # handful, kube-proxy's among them
        self.pods = reflector(
            "pods", functools.partial(core.list_namespaced_pod, KUBE_PROXY_NAMESPACE),
            _one(parse_kube_proxy_pod, "Pod"), f"spec.nodeName={node_name}") \
            if node_name else None
        self._cache: dict[str, tuple[int, Any]] = {}
        self._lock = threading.Lock()

    @property
    def reflectors(self) -> list[Reflector]:
        return [r for r in (self.services, self.node, self.ingresses, self.pods)
                if r is not None]

    def start(self) -> KubeInformer:
        for r in self.reflectors:
            r.start()
        return self

    def stop(self) -> None:
        for r in self.reflectors:
            r.stop()
        self.api_client.close()

    def version(self) -> tuple[int, ...]:
        """Changes whenever what ``read`` returns may have."""
        return tuple(r.version + (1 << 40 if r.synced.is_set() else 0)
                     for r in self.reflectors)

    def wait_synced(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` in all) until every reflector has listed once, or
        was refused in a way no retry within seconds mends (401/403: RBAC, 404: no such
        API): a node whose RBAC leaves out ingresses must not wait the whole timeout for
        its first verdict. True when all listed."""
        import time

        end = time.monotonic() + timeout
        while True:
            waiting = [r for r in self.reflectors if not r.synced.is_set()]
            if not waiting:
                return True
            left = end - time.monotonic()
            if left <= 0 or all(r.status in REFUSED for r in waiting):
                return False
            waiting[0].synced.wait(min(left, 0.05))

    def read(self) -> tuple[tuple[Any, ...], list[tuple[str, str]]]:
        """(services, node_info, ingresses, kube_proxy_pod) as the kube_api probe fills
        them, and the
        (what, why) of anything that cannot be told."""
        unknowns: list[tuple[str, str]] = []
        services = self._read(self.services, "services", unknowns)
        ingresses = self._read(self.ingresses, "ingresses", unknowns)
        node_info: NodeInfo | None = None
        if self.node is None:
            unknowns.append(("node", "no node name given (--node or NODE_NAME)"))
        else:
            nodes = self._read(self.node, "node", unknowns)
            if nodes is not None and len(nodes) == 1:
                node_info = nodes[0]
            elif nodes is not None and not self.node.bad:
                unknowns.append(("node", f"node {self.node_name} not found"))
        pod: KubeProxyPod | None = None
        if self.pods is not None:
            pods = self._read(self.pods, "pods", unknowns)
            # (a Pod that is not kube-proxy's decodes to None)
            found = [p for p in pods or () if p is not None]
            pod = min(found, key=lambda p: p.name) if found else None
        return (services, node_info, ingresses, pod), unknowns

    def _read(self, r: Reflector, what: str, unknowns: list[tuple[str, str]]
              ) -> tuple[Any, ...] | None:
        if not r.synced.is_set():
            unknowns.append((what, f"not listed yet: {r.error or 'waiting for the API'}"))
            return None
        version, records, bad = r.snapshot()
        if r.error:  # listed once, the watch failing now: say the state may be old
            unknowns.append((what, f"watch failing ({r.error}); using the state last seen"))
        for _key, why in sorted(bad.items()):
            unknowns.append((what, why))
        with self._lock:
            cached = self._cache.get(what)
            if cached is not None and cached[0] == version:
                return cached[1]
        out: tuple[Service | Ingress | NodeInfo, ...] = tuple(
            records if what in ("node", "pods")  # type: ignore[arg-type]
            else sorted(records, key=lambda x: x.key))  # type: ignore[attr-defined]
        with self._lock:
            self._cache[what] = (version, out)
        return out

    def requests(self) -> dict[str, int]:
        """LIST and WATCH requests made so far, and failures (for the bench and metrics)."""
        rs = self.reflectors
        return {"list": sum(r.lists for r in rs), "watch": sum(r.watches for r in rs),
                "failures": sum(r.failures for r in rs),
                "relists_after_gone": sum(r.relists_after_gone for r in rs)}
