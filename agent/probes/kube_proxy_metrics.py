"""kube-proxy's sync metrics, from its metrics server on this node (metricsBindAddress,
127.0.0.1:10249 by default; the agent shares the node's network namespace).

A GET of a local page, bounded in time and size: a kube-proxy that is wedged, or
something else listening there, costs the probe at most its timeout and 8 MiB.
"""

from __future__ import annotations

import http.client
import os
import time
import urllib.parse

from agent.parse.kube_proxy_metrics import READ_AT, read_metrics
from agent.probes.base import Probe, ProbeContext, ProbeResult, register, unavailable
from agent.snapshot import Unknown

SOURCE = "kube-proxy metrics"
DEFAULT_URL = "http://127.0.0.1:10249/metrics"
URL_ENV = "LOOPBACK_AGENT_KUBE_PROXY_METRICS"  # another metricsBindAddress
LIMIT = 8 << 20  # a 10k-service kube-proxy's page is some 100 KiB


def url() -> str:
    return os.environ.get(URL_ENV) or DEFAULT_URL


def fetch(timeout: float) -> tuple[str, float]:
    """(the page, with the agent's read-at line above it; the node's clock when read).
    Raises OSError or ValueError saying why it could not."""
    u = urllib.parse.urlsplit(url())
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"{URL_ENV}={url()!r}: not an http:// URL")
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    deadline = time.monotonic() + timeout
    try:
        conn.request("GET", u.path or "/metrics", headers={"Accept": "text/plain"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status} {resp.reason}")
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:  # (a peer that trickles bytes: each read's wait is what is left)
                raise OSError(f"the page took longer than {timeout:g} s")
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = resp.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > LIMIT:
                raise OSError(f"the page is larger than {LIMIT >> 20} MiB")
            chunks.append(chunk)
    finally:
        conn.close()
    read_at = time.time()
    return f"{READ_AT}{read_at:.3f}\n" + b"".join(chunks).decode("utf-8", "replace"), read_at


def collect(ctx: ProbeContext) -> ProbeResult:
    try:
        text, _ = fetch(min(ctx.timeout, 5.0))
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return unavailable(SOURCE, f"{url()}: {exc or type(exc).__name__} (kube-proxy's "
                           "metrics server: its sync health is not known)")
    sync, problems = read_metrics(text.splitlines(), url(), first_line=0)
    unknowns = tuple(Unknown(SOURCE, f"{url()} line {n}: {why}") for n, why in problems[:5])
    if sync is None:
        return ProbeResult(None, (*unknowns, Unknown(
            SOURCE, f"{url()} answered without kube-proxy's sync metrics "
            "(kubeproxy_sync_proxy_rules_*): not kube-proxy's metrics server?")))
    return ProbeResult(sync, unknowns)


PROBE = register(Probe(name=SOURCE, field="kube_proxy_sync", collect=collect))
