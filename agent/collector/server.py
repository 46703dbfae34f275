"""`loopback-agent collector`: verdicts in, fleet view out.

POST /v1/verdicts (one verdict or a batch), GET /v1/nodes, /v1/nodes/{node},
/v1/services, /metrics, /healthz, /openapi.json, and / (a page a person reads).
The caller is authenticated from the headers before the body is read (401/403); bodies
are limited in size (413), must be plain JSON (400) and valid verdicts (422 naming the
field). ``Collector`` is what the requests do (thread-safe, no HTTP in it); the HTTP
server is agent.collector.web (which imports this module, never the other way).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from agent.collector import views
from agent.collector.auth import Anyone, Authenticator, Caller, SharedToken, authorize
from agent.collector.docs import Body, split
from agent.collector.intake import MAX_BATCH, MAX_BODY, BadRequest, Intake
from agent.collector.store import Store
from agent.verdict_doc import STATUSES

__all__ = ["MAX_BATCH", "MAX_BODY", "BadRequest", "Collector"]

# loopback_collector_node_last_seen_timestamp_seconds: one series per node, at most this many
MAX_NODE_SERIES = 10_000
# changed verdicts (a document not yet stored for the node) one node may send in
# CHANGE_WINDOW seconds: an agent sends one per changed cycle (one a minute by default), a
# spool drained after an outage its changes only; beyond: 429 (issue 35, item 5)
CHANGES_PER_WINDOW = 120
CHANGE_WINDOW = 600.0
# POSTs whose nodes are kept for their access log line (agent.collector.access) until it
# is written; a request that ends without one (its client gone) leaves its entry until
# this many newer ones push it out
MAX_POSTED = 4096
# silent this long: taken as removed from the cluster (the LoopbackAgentNodeSilent alert's
# upper bound, daemonset/monitoring/prometheusrule.yaml); exported only after the others
NODE_GONE_AFTER = 86400.0


class Collector:
    def __init__(self, store: Store, token_file: str | None = None,
                 authenticator: Authenticator | None = None,
                 max_node_series: int = MAX_NODE_SERIES) -> None:
        self.store = store
        self.max_node_series = max_node_series
        self._metrics_lock = threading.Lock()
        self.auth: Authenticator = authenticator or (
            SharedToken(token_file) if token_file else Anyone())
        self.intake = Intake()
        r = self.registry = CollectorRegistry()
        self.accepted = Counter("loopback_collector_verdicts_stored",
                                "Verdicts stored", registry=r)
        self.duplicates = Counter("loopback_collector_verdicts_duplicate",
                                  "Verdicts received again (same idempotency key)", registry=r)
        self.rejected = Counter("loopback_collector_requests_rejected",
                                "Requests refused", ["code"], registry=r)
        self.nodes = Gauge("loopback_collector_nodes", "Nodes by latest status", ["status"],
                           registry=r)
        self.last_seen = Gauge("loopback_collector_node_last_seen_timestamp_seconds",
                               "When the node's newest verdict was received (the longest "
                               "silent nodes, up to the cap)", ["node"], registry=r)
        self.nodes_left_out = Gauge("loopback_collector_node_series_dropped",
                                    "Nodes left out of the last-seen series (over the cap)",
                                    registry=r)
        self.quota_pruned = Gauge("loopback_collector_quota_pruned",
                                  "History rows removed since start to keep a node within "
                                  "its storage quota", registry=r)
        self._changes: dict[str, collections.deque[float]] = {}
        self._changes_lock = threading.Lock()
        # id(caller) -> (caller, the first node, how many nodes): the caller object the
        # server made for the request (kept here: its id is not reused meanwhile)
        self._posted: collections.OrderedDict[int, tuple[Caller, str, int]] = \
            collections.OrderedDict()
        self._posted_lock = threading.Lock()

    # -- POST /v1/verdicts ------------------------------------------------------------

    def authenticate(self, authorization: str) -> Caller:
        return self.auth.authenticate(authorization)

    def ingest(self, caller: Caller, body: bytes | bytearray) -> dict[str, Any]:
        bodies: dict[int, Body] = {}  # by id() of each verdict: made once, stored by add
        stored_docs: set[int] = set()  # id() of those whose document is stored: add knows

        def known(v: Any) -> bool:
            """Its document is stored for its node and valid under this schema."""
            if not isinstance(v.get("node"), str):
                return False
            if caller.node is not None and v["node"] != caller.node:
                # not its node: refused below (403) after a whole validation, as before;
                # looked up, its time would say whether it guessed another's document
                return False
            bodies[id(v)] = b = split(v)
            stored, schema = self.store.known(v["node"], b.fingerprint)
            if stored:
                stored_docs.add(id(v))
            return stored and schema == self.intake.schema_tag

        batch = self.intake.verdicts(body, known)
        authorize(caller, [v["node"] for v in batch])
        # (after the check: a refused post is not logged as the node it claimed to be)
        self._note_posted(caller, batch)
        self._within_rate([v["node"] for v in batch if id(v) not in stored_docs])
        stored, dup = self.store.add(batch, bodies, schema=self.intake.schema_tag,
                                     stored_docs=stored_docs)
        self.quota_pruned.set(getattr(self.store, "quota_pruned", 0))  # (an older Store: none)
        self.accepted.inc(stored)
        self.duplicates.inc(dup)
        return {"stored": stored, "duplicates": dup}

    def _note_posted(self, caller: Caller, batch: list[dict[str, Any]]) -> None:
        nodes = [v["node"] for v in batch if isinstance(v.get("node"), str)]
        if not nodes:
            return
        with self._posted_lock:
            self._posted[id(caller)] = (caller, nodes[0], len(set(nodes)))
            self._posted.move_to_end(id(caller))
            while len(self._posted) > MAX_POSTED:
                self._posted.popitem(last=False)

    def posted_node(self, caller: Caller) -> tuple[str, int] | None:
        """The node the request of ``caller`` (the object the server made for it) posted
        verdicts for, and how many nodes its batch named; once (for its access log)."""
        with self._posted_lock:
            entry = self._posted.pop(id(caller), None)
        if entry is None or entry[0] is not caller:
            return None
        return entry[1], entry[2]

    def _within_rate(self, changed: list[str]) -> None:
        """429 when a node's changed verdicts in this batch would pass CHANGES_PER_WINDOW
        in the last CHANGE_WINDOW seconds (counted only when taken)."""
        if not changed:
            return
        now = time.monotonic()
        with self._changes_lock:
            for node, n in collections.Counter(changed).items():
                seen = self._changes.get(node)
                if seen is None:
                    if len(self._changes) >= 4 * MAX_NODE_SERIES:  # forget the quietest
                        self._changes = {k: d for k, d in self._changes.items()
                                         if d and d[-1] > now - CHANGE_WINDOW}
                    seen = self._changes[node] = collections.deque()
                while seen and seen[0] <= now - CHANGE_WINDOW:
                    seen.popleft()
                if len(seen) + n > CHANGES_PER_WINDOW:
                    raise BadRequest(429, f"node {node[:100]!r} sent more than "
                                     f"{CHANGES_PER_WINDOW} changed verdicts in "
                                     f"{CHANGE_WINDOW / 60:.0f} min", retry_after=60)
            for node in changed:
                self._changes[node].append(now)

    # -- GET: summaries only, a page at a time ------------------------------------------

    def metrics(self) -> bytes:
        counts = {**dict.fromkeys(STATUSES, 0), **self.store.status_counts()}
        seen = self.store.last_seen(self.max_node_series,
                                    gone_before=time.time() - NODE_GONE_AFTER)
        with self._metrics_lock:  # one scrape's set of series at a time
            for s, n in counts.items():
                self.nodes.labels(s).set(n)
            self.last_seen.clear()  # a node gone from the store goes from here
            for node, when in seen:
                self.last_seen.labels(node).set(when)
            self.nodes_left_out.set(max(0, sum(counts.values()) - len(seen)))
            return generate_latest(self.registry)

    def nodes_page(self, page: views.Page) -> tuple[list[dict[str, Any]], int]:
        return self.store.nodes(page.limit, page.offset), self.store.node_total()

    def services_page(self, page: views.Page) -> tuple[list[dict[str, Any]], int]:
        return self.store.services(page.limit, page.offset), self.store.service_total()

    def history(self, node: str, limit: int, before: int | None) -> tuple[bytes, int | None]:
        """The JSON array of a node's verdicts, newest first, from the stored text."""
        docs, more = self.store.history(node, limit, before)
        return ("[" + ",".join(docs) + "]").encode(), more

    @staticmethod
    def openapi() -> bytes:
        return resources.files("agent").joinpath("schema/collector-openapi.json").read_bytes()


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=False).encode()
