"""`loopback-agent collector`: verdicts in, fleet view out (stdlib HTTP server + SQLite).

POST /v1/verdicts (one verdict or a batch), GET /v1/nodes, /v1/nodes/{node},
/v1/services, /metrics, /healthz, /openapi.json, and / (a page a person reads).
Bodies are validated against the verdict JSON Schema (422 naming the field), limited in
size (413), and need the bearer token when one is configured (401).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import unquote

import jsonschema
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from agent.collector.page import render_page
from agent.collector.store import Store
from agent.collector.views import nodes_view, services_view
from agent.ship.sender import TokenFile

MAX_BODY = 4 * 1024 * 1024
MAX_BATCH = 500


class BadRequest(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise BadRequest(400, f"duplicate key {dup!r} in a JSON object")
    return dict(pairs)


class Collector:
    def __init__(self, store: Store, token_file: str | None = None) -> None:
        self.store = store
        self.token = TokenFile(token_file) if token_file else None
        schema = json.loads(resources.files("agent").joinpath("schema/verdict-v1.json")
                            .read_text())
        self.validator = jsonschema.Draft202012Validator(schema)
        r = self.registry = CollectorRegistry()
        self.accepted = Counter("loopback_collector_verdicts_stored",
                                "Verdicts stored", registry=r)
        self.duplicates = Counter("loopback_collector_verdicts_duplicate",
                                  "Verdicts received again (same idempotency key)", registry=r)
        self.rejected = Counter("loopback_collector_requests_rejected",
                                "Requests refused", ["code"], registry=r)
        self.nodes = Gauge("loopback_collector_nodes", "Nodes by latest status", ["status"],
                           registry=r)
        self.lock = threading.Lock()

    # -- POST /v1/verdicts ------------------------------------------------------------

    def ingest(self, headers: Any, body: bytes) -> dict[str, Any]:
        if self.token is not None:
            want = self.token.token()
            got = headers.get("Authorization", "")
            if not want or got != f"Bearer {want}":
                raise BadRequest(401, "missing or wrong bearer token")
        try:
            doc = json.loads(body, object_pairs_hook=_no_duplicate_keys)
        except BadRequest:
            raise
        except (ValueError, RecursionError) as e:
            raise BadRequest(400, f"not JSON: {e}") from None
        batch = doc if isinstance(doc, list) else [doc]
        if not batch:
            raise BadRequest(422, "empty batch")
        if len(batch) > MAX_BATCH:
            raise BadRequest(413, f"batch of {len(batch)} verdicts; at most {MAX_BATCH}")
        for i, v in enumerate(batch):
            err = jsonschema.exceptions.best_match(self.validator.iter_errors(v))
            if err is not None:
                where = "/".join(str(p) for p in err.absolute_path) or "(document)"
                prefix = f"[{i}]/" if isinstance(doc, list) else ""
                raise BadRequest(422, f"{prefix}{where}: {err.message[:300]}")
            key = v.get("idempotency_key")
            if key is not None and not isinstance(key, str):
                raise BadRequest(422, f"{i}/idempotency_key: must be a string")
            if not key:
                # without a key, the same document sent twice is still stored once
                v["idempotency_key"] = hashlib.sha256(
                    json.dumps(v, sort_keys=True).encode()).hexdigest()
        stored, dup = self.store.add(batch)
        self.accepted.inc(stored)
        self.duplicates.inc(dup)
        return {"stored": stored, "duplicates": dup}

    def metrics(self) -> bytes:
        counts: dict[str, int] = {"healthy": 0, "at-risk": 0, "loopback": 0}
        for v in self.store.latest():
            counts[v["status"]] = counts.get(v["status"], 0) + 1
        for s, n in counts.items():
            self.nodes.labels(s).set(n)
        return generate_latest(self.registry)


def make_handler(col: Collector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, doc: Any) -> None:
            self._send(code, json.dumps(doc).encode())

        def do_POST(self) -> None:
            if self.path != "/v1/verdicts":
                self._json(404, {"error": "not found"})
                return
            try:
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit():
                    raise BadRequest(411, "Content-Length required")
                if int(length) > MAX_BODY:
                    raise BadRequest(413, f"body of {length} bytes; at most {MAX_BODY}")
                body = self.rfile.read(int(length))
                self._json(200, col.ingest(self.headers, body))
            except BadRequest as e:
                col.rejected.labels(str(e.code)).inc()
                if e.code == 413:
                    self.close_connection = True  # the unread body stays on the wire
                self._json(e.code, {"error": e.message})

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/":
                self._send(200, render_page(col.store.latest()).encode(),
                           "text/html; charset=utf-8")
            elif path == "/v1/nodes":
                self._json(200, nodes_view(col.store.latest()))
            elif m := re.fullmatch(r"/v1/nodes/([^/]+)", path):
                hist = col.store.history(unquote(m.group(1)))
                self._json(200 if hist else 404, hist if hist else {"error": "unknown node"})
            elif path == "/v1/services":
                self._json(200, services_view(col.store.latest()))
            elif path == "/metrics":
                self._send(200, col.metrics(), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                col.store.count()
                self._send(200, b"ok\n", "text/plain")
            elif path == "/openapi.json":
                self._send(200, resources.files("agent").joinpath("schema/collector-openapi.json")
                           .read_bytes())
            else:
                self._json(404, {"error": "not found"})

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def serve(listen: str, store: Store, token_file: str | None = None) -> ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")
    server = ThreadingHTTPServer((host or "0.0.0.0", int(port)),
                                 make_handler(Collector(store, token_file)))
    server.daemon_threads = True
    return server
