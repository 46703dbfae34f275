"""Four reflectors (Services, Ingresses, this Node, kube-proxy's DaemonSet) and what a
probe reads from them.

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

from agent.kubewatch.reflector import REFUSED, JitteredBackoff, Reflector, object_key
from agent.parse.kube import (
    KUBE_PROXY_DAEMONSET,
    KUBE_PROXY_NAMESPACE,
    choose_kube_proxy_image,
    kube_proxy_daemon_set,
    parse_ingresses,
    parse_node,
    parse_services,
)
from agent.snapshot import Ingress, KubeProxyImage, NodeInfo, Service

SOURCE = "kubernetes API"
REFUSED_RETRY = 3600.0  # seconds: how often a refused kube-proxy DaemonSet is asked again


def _one(parse: Callable[[dict[str, Any], str], Any], kind: str
         ) -> Callable[[dict[str, Any]], Any]:
    def decode(obj: dict[str, Any]) -> Any:
        ns, name = object_key(obj)
        source = f"{SOURCE} {kind} {ns + '/' if ns else ''}{name}"
        # Items of a watch carry their kind, LIST items need not: wrap as a List.
        out = parse({"kind": f"{kind}List", "items": [{**obj, "kind": kind}]}, source)
        return out[0] if isinstance(out, tuple) else out
    return decode


def _daemon_set(doc: dict[str, Any], source: str) -> KubeProxyImage | None:
    return choose_kube_proxy_image(kube_proxy_daemon_set(doc, source))


class KubeInformer:
    """Starts list+watch of Services, Ingresses, kube-proxy's DaemonSet (its image says
    kube-proxy's version) and, with a node name, this Node."""

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
        # kube-proxy's DaemonSet only (a fieldSelector on its name, which its RBAC names:
        # one object), for its image. Where the RBAC predates that grant it is refused:
        # retried at most hourly, not every minute from every node
        self.kube_proxy = Reflector(
            "kube-proxy", functools.partial(client.AppsV1Api(api_client)
                                            .list_namespaced_daemon_set,
                                            KUBE_PROXY_NAMESPACE),
            _one(_daemon_set, "DaemonSet"), on_change=on_change,
            field_selector=f"metadata.name={KUBE_PROXY_DAEMONSET}",
            watch_timeout=watch_timeout, request_timeout=request_timeout, rng=rng,
            backoff=JitteredBackoff(backoff_base, backoff_cap, rng),
            refused_backoff=JitteredBackoff(backoff_base, max(backoff_cap, REFUSED_RETRY),
                                            rng))
        self._cache: dict[str, tuple[int, Any]] = {}
        self._lock = threading.Lock()

    @property
    def reflectors(self) -> list[Reflector]:
        return [r for r in (self.services, self.node, self.ingresses, self.kube_proxy)
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
        """(services, node_info, ingresses, kube_proxy_image) as the kube_api probe fills
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
        found = self._read(self.kube_proxy, "kube-proxy", unknowns)
        image = choose_kube_proxy_image(found or ())
        return (services, node_info, ingresses, image), unknowns

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
            records if what in ("node", "kube-proxy")  # type: ignore[arg-type]
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
