"""Optional: Services, this Node, Ingresses and kube-proxy's DaemonSet (its image) from
the Kubernetes API.

One-shot commands LIST once (``fetch_raw``); the daemon keeps them by list+watch
(``start_informer``, agent.kubewatch) and the probe reads that memory (``ctx.kube_cache``).

Uses the official `kubernetes` client (the `kube` extra): in-cluster service account
when KUBERNETES_SERVICE_HOST is set, else a kubeconfig. Responses are fetched raw
(`_preload_content=False`) and parsed by agent.parse.kube, the same code that reads a
bundle's services.json/node.json/ingresses.json, so a live run and a bundle agree.
The node's facts never depend on this probe: without an API it just says why.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.errors import InputError
from agent.parse.kube import KUBE_PROXY_DAEMONSET, KUBE_PROXY_NAMESPACE
from agent.probes.base import Probe, ProbeContext, ProbeResult, register, unavailable
from agent.snapshot import Unknown

SOURCE = "kubernetes API"
FIELDS = ("services", "node_info", "ingresses", "kube_proxy_image")
DISABLED = "disabled (--no-kube-api)"
NOT_INSTALLED = "python package 'kubernetes' not installed"
NOT_CONFIGURED = "not configured: no in-cluster service account and no kubeconfig"
# TCP keepalive (idle s, interval s, probes): client-go's 30 s dialer keepalive with Go's
# 15 s x 9 probes, so a dead peer is found in 165 s at most
KEEPALIVE = (30, 15, 9)


@dataclass(frozen=True)
class RawResponse:
    """One API read: the body exactly as the server sent it, or why there is none."""

    what: str  # "services" | "node" | "ingresses" | "kube-proxy"
    body: bytes | None = None
    error: str | None = None


class KubeUnavailable(Exception):
    """The API cannot be used at all; ``str()`` is the Unknown reason."""


def _kubeconfig_candidates(ctx: ProbeContext) -> list[str]:
    if ctx.kubeconfig:
        return [ctx.kubeconfig]
    env = os.environ.get("KUBECONFIG")
    paths = env.split(os.pathsep) if env else ["~/.kube/config"]
    return [os.path.expanduser(p) for p in paths if p]


def api_client(ctx: ProbeContext) -> Any:
    """An ApiClient, or KubeUnavailable saying why not."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubeUnavailable(NOT_INSTALLED) from None
    cfg = client.Configuration()
    in_cluster_error = None
    # An explicit --kubeconfig wins; otherwise a pod uses its service account.
    if not ctx.kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException as exc:
            in_cluster_error = f"in-cluster config: {exc}"
        else:
            return _client(client, cfg)
    existing = [p for p in _kubeconfig_candidates(ctx) if os.path.isfile(p)]
    if not existing:
        if ctx.kubeconfig:
            raise KubeUnavailable(f"kubeconfig {ctx.kubeconfig} not found")
        raise KubeUnavailable(in_cluster_error or NOT_CONFIGURED)
    try:
        config.load_kube_config(config_file=ctx.kubeconfig, client_configuration=cfg,
                                persist_config=False)
    except Exception as exc:  # ConfigException, bad YAML, missing cert files...
        raise KubeUnavailable(f"kubeconfig {os.pathsep.join(existing)}: {exc}") from None
    return _client(client, cfg)


def _client(client: Any, cfg: Any) -> Any:
    # urllib3 retries a failed connect 3 times by default: with a dead API server that
    # multiplies the timeout; one attempt per request keeps the probe within bounds.
    cfg.retries = 0
    # A watch to an API server whose host died (or a partition) is never closed: without
    # keepalive only its read timeout (timeoutSeconds + 30 s: 5-10 min) ends it, all
    # that time with old Services and no word of it. client-go dials with keepalive.
    cfg.socket_options = keepalive_options(*KEEPALIVE)
    return client.ApiClient(cfg)


def keepalive_options(idle: int, interval: int, probes: int) -> list[tuple[int, int, int]]:
    """urllib3 socket options: its defaults (TCP_NODELAY) plus TCP keepalive."""
    import socket

    from urllib3.connection import HTTPConnection

    opts = list(HTTPConnection.default_socket_options)
    opts.append((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                        ("TCP_KEEPCNT", probes)):
        if hasattr(socket, name):  # Linux has all three
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return opts


def _describe_error(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    if status is not None:  # kubernetes.client.ApiException
        reason = getattr(exc, "reason", "") or ""
        return f"HTTP {status} {reason}".strip()
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def fetch_raw(ctx: ProbeContext) -> list[RawResponse]:
    """Read services, this node and ingresses; raises KubeUnavailable when no API."""
    from kubernetes import client

    api = api_client(ctx)
    core = client.CoreV1Api(api)
    networking = client.NetworkingV1Api(api)
    apps = client.AppsV1Api(api)
    opts: dict[str, Any] = {"_preload_content": False, "_request_timeout": ctx.timeout}
    calls: list[tuple[str, Callable[[], Any] | None]] = [
        ("services", lambda: core.list_service_for_all_namespaces(**opts)),
        ("node", (lambda: core.read_node(ctx.node_name, **opts)) if ctx.node_name else None),
        ("ingresses", lambda: networking.list_ingress_for_all_namespaces(**opts)),
        # kube-proxy's DaemonSet, by name (its RBAC names it: no other object is
        # readable), for the image kube-proxy runs
        ("kube-proxy", lambda: apps.read_namespaced_daemon_set(
            KUBE_PROXY_DAEMONSET, KUBE_PROXY_NAMESPACE, **opts)),
    ]
    out = []
    try:
        for what, call in calls:
            if call is None:
                out.append(RawResponse(what, error="no node name given (--node or NODE_NAME)"))
                continue
            try:
                response = call()
                out.append(RawResponse(what, body=response.data))
            except Exception as exc:  # ApiException (403...), urllib3 timeouts, TLS errors
                if what == "kube-proxy" and getattr(exc, "status", None) == 404:
                    # no such DaemonSet (a static-pod kube-proxy, or none): nothing to say
                    out.append(RawResponse(what))
                    continue
                out.append(RawResponse(what, error=_describe_error(exc) + (
                    " (the DaemonSet kube-system/kube-proxy: its Role may predate this "
                    "agent's RBAC)" if what == "kube-proxy" else "")))
    finally:
        api.close()
    return out


def start_informer(ctx: ProbeContext, on_change: Callable[[str], None] | None = None,
                   **options: Any) -> Any:
    """A started agent.kubewatch.KubeInformer for this node; KubeUnavailable when there is
    no API to watch (then the probe says why each cycle, without any request)."""
    from agent.kubewatch import KubeInformer

    return KubeInformer(api_client(ctx), ctx.node_name, on_change=on_change,
                        request_timeout=ctx.timeout, **options).start()


def _from_informer(informer: Any) -> ProbeResult:
    values, why = informer.read()
    return ProbeResult(tuple(values), tuple(Unknown(SOURCE, f"{what}: {reason}")
                                           for what, reason in why))


def _parse(raw: RawResponse) -> object:
    from agent.parse.kube import (
        choose_kube_proxy_image,
        kube_proxy_daemon_set,
        parse_ingresses,
        parse_node,
        parse_services,
    )

    source = f"{SOURCE} {raw.what}"
    try:
        doc = json.loads(raw.body or b"")
    except (ValueError, RecursionError) as exc:
        raise InputError(source, None, f"bad JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InputError(source, None, "expected a JSON object")
    if raw.what == "kube-proxy":
        return choose_kube_proxy_image(kube_proxy_daemon_set(doc, source))
    parser = {"services": parse_services, "node": parse_node,
              "ingresses": parse_ingresses}[raw.what]
    return parser(doc, source)


def collect(ctx: ProbeContext) -> ProbeResult:
    if not ctx.use_kube_api:
        return unavailable(SOURCE, DISABLED, fields=len(FIELDS))
    if ctx.kube_cache is not None:
        return _from_informer(ctx.kube_cache)
    try:
        responses = fetch_raw(ctx)
    except KubeUnavailable as exc:
        return unavailable(SOURCE, str(exc), fields=len(FIELDS))
    except ImportError:
        return unavailable(SOURCE, NOT_INSTALLED, fields=len(FIELDS))
    values: list[object] = []
    unknowns: list[Unknown] = []
    for raw in responses:
        if raw.body is None and raw.error is None:  # (none to read: no kube-proxy DaemonSet)
            values.append(None)
            continue
        if raw.error is not None:
            values.append(None)
            unknowns.append(Unknown(SOURCE, f"{raw.what}: {raw.error}"))
            continue
        try:
            values.append(_parse(raw))
        except (InputError, ImportError) as exc:
            values.append(None)
            unknowns.append(Unknown(SOURCE, f"{raw.what}: {exc}"))
    return ProbeResult(tuple(values), tuple(unknowns))


PROBE = register(Probe(name=SOURCE, field=FIELDS, collect=collect))
