"""A small, real HTTP Kubernetes API server for tests: list+watch, patches, events.

Not a mock of the client: it speaks HTTP/1.1 on a loopback port the way kube-apiserver
does for the parts the agent uses, so the real `kubernetes` client (urllib3, chunked
streams, its Watch) is what talks to it.

- An in-memory store per resource (services, ingresses, nodes, pods, daemonsets, events)
  with one global resourceVersion counter (as etcd's revision) and a history of changes for watches.
- LIST with limit/continue (the continue token carries the list's resourceVersion and the
  next key), fieldSelector metadata.name / metadata.namespace / spec.nodeName (Pods).
- WATCH (watch=true): chunked JSON lines, ADDED/MODIFIED/DELETED and BOOKMARK (with
  allowWatchBookmarks, every ``bookmark_every`` seconds and before a timeout), ended by
  timeoutSeconds (capped by ``max_watch_seconds``). A resourceVersion older than the
  compacted history gets 410 Gone: as an in-stream ERROR event (what the watch cache
  does) or as an HTTP 410 (``gone_as = "http"``). ``expire_watches()`` sends the ERROR
  event on every open watch and compacts, as when a watch falls out of the window.
- GET/PATCH nodes/NAME/status (strategic-merge-patch: conditions merged by type; merge-
  patch: RFC 7386), POST/GET/PATCH events.k8s.io/v1 events.
- ``outage``: None, "503" (every request answered 503, open watches cut) or "refuse" (the
  listening socket is closed: connections are refused; ``outage = None`` reopens it on
  the same port).
- ``forbidden``: resources answered 403 Forbidden (as RBAC without the verb would).
- ``inject(raw)``: write ``raw`` bytes as they are into every open watch stream (garbage,
  half a JSON line), then carry on. ``hang_watches()``: open watches go silent, not closed.
- ``log``: every request reaching the server (time, method, path, query, status).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

# resource -> (API prefix, namespaced, kind)
RESOURCES = {
    "services": ("/api/v1", True, "Service"),
    "nodes": ("/api/v1", False, "Node"),
    "pods": ("/api/v1", True, "Pod"),
    "daemonsets": ("/apis/apps/v1", True, "DaemonSet"),
    "ingresses": ("/apis/networking.k8s.io/v1", True, "Ingress"),
    "events": ("/apis/events.k8s.io/v1", True, "Event"),
}
API_VERSION = {"/api/v1": "v1", "/apis/networking.k8s.io/v1": "networking.k8s.io/v1",
               "/apis/apps/v1": "apps/v1",
               "/apis/events.k8s.io/v1": "events.k8s.io/v1"}


@dataclass(frozen=True)
class Request:
    at: float  # time.monotonic()
    method: str
    path: str
    query: dict[str, str]
    status: int = 0
    body: Any = None  # decoded JSON of a write
    sent: int = 0  # bytes of the response body (a watch's stream: see stream_bytes)

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")

    @property
    def resource(self) -> str | None:
        parts = [p for p in self.path.split("/") if p]
        for name in RESOURCES:
            if name in parts:
                return name
        return None


@dataclass
class _Change:
    rv: int
    resource: str
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]


@dataclass
class _Watch:
    resource: str
    expire: threading.Event = field(default_factory=threading.Event)
    cut: threading.Event = field(default_factory=threading.Event)
    raw: list[bytes] = field(default_factory=list)  # bytes to send as they are
    hang: threading.Event = field(default_factory=threading.Event)


class FakeKubeAPI:
    def __init__(self, *, bookmark_every: float = 30.0, max_watch_seconds: float = 1800,
                 gone_as: str = "event", netns: str | None = None) -> None:
        self.netns = netns  # listen on 127.0.0.1 of this named network namespace
        self.lock = threading.Condition()
        self.rv = 100
        self.store: dict[str, dict[tuple[str, str], dict[str, Any]]] = {r: {} for r in RESOURCES}
        self.history: list[_Change] = []
        self.compacted = 0  # a watch from a resourceVersion below this is 410 Gone
        self.bookmark_every = bookmark_every
        self.max_watch_seconds = max_watch_seconds
        self.gone_as = gone_as
        self.log: list[Request] = []
        self.watches: list[_Watch] = []
        self.stream_bytes = 0  # bytes sent on watch streams
        self.conns: set[socket.socket] = set()  # open client connections (keep-alive too)
        self.forbidden: set[str] = set()  # resources answered 403
        # called (without the lock) after a LIST page with a continue token was sent
        self.after_page: Any = None
        self._outage: str | None = None
        self._httpd = self._bind(0)
        self.port = self._httpd.server_address[1]
        self._serve()

    # -- lifecycle -------------------------------------------------------------------------

    def _bind(self, port: int) -> ThreadingHTTPServer:
        api = self

        class Handler(_Handler):
            server_api = api

        httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler, bind_and_activate=False)
        httpd.daemon_threads = True
        if self.netns:
            httpd.socket.close()
            httpd.socket = _socket_in_netns(self.netns)
        httpd.allow_reuse_address = True
        httpd.server_bind()
        httpd.server_activate()
        return httpd

    def _serve(self) -> None:
        threading.Thread(target=self._httpd.serve_forever, daemon=True,
                         kwargs={"poll_interval": 0.05}).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.cut_watches()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None  # type: ignore[assignment]

    def __enter__(self) -> FakeKubeAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def outage(self) -> str | None:
        return self._outage

    @outage.setter
    def outage(self, mode: str | None) -> None:
        assert mode in (None, "503", "refuse")
        if mode == "refuse" and self._outage != "refuse":
            self._httpd.shutdown()
            self._httpd.server_close()
            with self.lock:  # kept-alive connections die with the server too
                for conn in list(self.conns):
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
        if mode is not None:
            self.cut_watches()
        if mode != "refuse" and self._outage == "refuse":
            self._httpd = self._bind(self.port)
            self._serve()
        self._outage = mode

    # -- the store -------------------------------------------------------------------------

    def put(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (kind/apiVersion and resourceVersion filled in)."""
        with self.lock:
            return self._put(resource, copy.deepcopy(obj))

    def _put(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        prefix, namespaced, kind = RESOURCES[resource]
        meta = obj.setdefault("metadata", {})
        if namespaced:
            meta.setdefault("namespace", "default")
        key = (meta.get("namespace", ""), meta["name"])
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("uid", f"uid-{resource}-{key[0]}-{key[1]}")
        meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        obj["kind"], obj["apiVersion"] = kind, API_VERSION[prefix]
        kind_of = "MODIFIED" if key in self.store[resource] else "ADDED"
        self.store[resource][key] = obj
        self.history.append(_Change(self.rv, resource, kind_of, copy.deepcopy(obj)))
        self.lock.notify_all()
        return copy.deepcopy(obj)

    def delete(self, resource: str, name: str, namespace: str = "") -> None:
        with self.lock:
            ns = namespace or ("default" if RESOURCES[resource][1] else "")
            obj = self.store[resource].pop((ns, name))
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.history.append(_Change(self.rv, resource, "DELETED", obj))
            self.lock.notify_all()

    def get(self, resource: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        with self.lock:
            ns = namespace or ("default" if RESOURCES[resource][1] else "")
            obj = self.store[resource].get((ns, name))
            return copy.deepcopy(obj) if obj else None

    def objects(self, resource: str) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(o) for _, o in sorted(self.store[resource].items())]

    def compact(self) -> None:
        """Forget the history: any watch from an older resourceVersion is 410 Gone."""
        with self.lock:
            self.compacted = self.rv  # a watch from the current version misses nothing
            self.history.clear()

    def expire_watches(self) -> None:
        """Compact, and end every open watch with an in-stream ERROR 410 event."""
        with self.lock:
            self.compact()
            for w in self.watches:
                w.expire.set()
            self.lock.notify_all()

    def inject(self, raw: bytes) -> None:
        """Send ``raw`` as it is (no JSON encoding, no newline added) on every open watch."""
        with self.lock:
            for w in self.watches:
                w.raw.append(raw)
            self.lock.notify_all()

    def hang_watches(self) -> None:
        """Every open watch stops sending (no bookmark, no end) but stays open, as a
        stuck server or a proxy holding the connection would; ``close`` ends them."""
        with self.lock:
            for w in self.watches:
                w.hang.set()
            self.lock.notify_all()

    def cut_watches(self) -> None:
        """Close every open watch stream (as an API server restart does)."""
        with self.lock:
            for w in self.watches:
                w.cut.set()
            self.lock.notify_all()

    # -- the log ---------------------------------------------------------------------------

    def requests(self, method: str | None = None, resource: str | None = None,
                 watch: bool | None = None, since: float = 0.0) -> list[Request]:
        with self.lock:
            log = list(self.log)
        return [r for r in log if (method is None or r.method == method)
                and (resource is None or r.resource == resource)
                and (watch is None or r.watch == watch) and r.at >= since]

    def open_watches(self, resource: str) -> int:
        with self.lock:
            return sum(1 for w in self.watches if w.resource == resource)


def _socket_in_netns(name: str) -> socket.socket:
    """A TCP socket made inside network namespace ``name`` (it stays there): setns(2)
    in a thread of its own, which then ends, so this process's other threads are not
    moved."""
    import ctypes
    import os

    out: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), f"setns {name}")
            finally:
                os.close(fd)
            out.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _matches(obj: dict[str, Any], namespace: str | None, selectors: dict[str, str]) -> bool:
    meta = obj["metadata"]
    if namespace and meta.get("namespace") != namespace:
        return False
    for key, want in selectors.items():
        have = {"metadata.name": meta.get("name"),
                "metadata.namespace": meta.get("namespace", ""),
                "spec.nodeName": (obj.get("spec") or {}).get("nodeName")}.get(key)
        if have != want:
            return False
    return True


def _field_selector(text: str) -> dict[str, str]:
    out = {}
    for term in filter(None, text.split(",")):
        key, _, value = term.partition("=")
        out[key.strip()] = value.lstrip("=").strip()
    return out


def strategic_merge(target: Any, patch: Any, key: str = "") -> Any:
    """Strategic merge for what the agent patches: lists of conditions merge by "type",
    other lists are replaced, null deletes, objects merge recursively."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return copy.deepcopy(patch)
    out = dict(target)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif k == "conditions" and isinstance(v, list) and isinstance(out.get(k), list):
            merged = [dict(c) for c in out[k]]
            for cond in v:
                for i, old in enumerate(merged):
                    if old.get("type") == cond.get("type"):
                        merged[i] = strategic_merge(old, cond)
                        break
                else:
                    merged.append(dict(cond))
            out[k] = merged
        else:
            out[k] = strategic_merge(out.get(k), v, k)
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class _Handler(BaseHTTPRequestHandler):
    server_api: FakeKubeAPI
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.server_api.lock:
            self.server_api.conns.add(self.connection)

    def finish(self) -> None:
        with self.server_api.lock:
            self.server_api.conns.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def handle_one_request(self) -> None:
        if self.server_api.outage == "refuse":  # a request already on its way in
            self.close_connection = True
            return
        try:
            super().handle_one_request()
        except OSError:
            self.close_connection = True

    # -- plumbing --------------------------------------------------------------------------

    def _record(self, status: int, body: Any = None, sent: int = 0) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        with self.server_api.lock:
            self.server_api.log.append(Request(time.monotonic(), self.command, url.path,
                                               query, status, body, sent))

    def _send(self, code: int, doc: Any, request_body: Any = None) -> None:
        body = json.dumps(doc).encode()
        self._record(code, request_body, len(body))
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self) -> tuple[str, str | None, str | None, str | None] | None:
        """(resource, namespace, name, subresource) of the path, or None."""
        path = urlsplit(self.path).path.rstrip("/")
        for resource, (prefix, namespaced, _) in RESOURCES.items():
            if not path.startswith(prefix + "/"):
                continue
            parts = path[len(prefix) + 1:].split("/")
            ns = None
            if namespaced and len(parts) >= 3 and parts[0] == "namespaces":
                ns, parts = parts[1], parts[2:]
            if not parts or parts[0] != resource:
                continue
            name = parts[1] if len(parts) > 1 else None
            sub = parts[2] if len(parts) > 2 else None
            return resource, ns, name, sub
        return None

    def _query(self) -> dict[str, str]:
        url = urlsplit(self.path)
        return {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None

    def _outage(self) -> bool:
        if self.server_api.outage == "503":
            if self.command in ("POST", "PATCH", "PUT"):
                self._body()  # read it, or it would be taken for the next request
            self._send(503, _status(503, "ServiceUnavailable", "outage"))
            return True
        return False

    # -- verbs -----------------------------------------------------------------------------

    def do_GET(self) -> None:
        if self._outage():
            return
        route = self._route()
        if route is None:
            self._send(404, _status(404, "NotFound", "no such path"))
            return
        resource, ns, name, _ = route
        api = self.server_api
        if resource in api.forbidden:
            self._send(403, _status(403, "Forbidden", f'{resource} is forbidden: User '
                                    f'"system:serviceaccount:x:y" cannot list resource'))
            return
        if name is not None:
            obj = api.get(resource, name, ns or "")
            code = 200 if obj else 404
            self._send(code, obj or _status(404, "NotFound", f"{resource} {name} not found"))
            return
        q = self._query()
        if q.get("watch") in ("true", "1"):
            self._watch(resource, ns, q)
        else:
            self._list(resource, ns, q)

    def _list(self, resource: str, ns: str | None, q: dict[str, str]) -> None:
        api = self.server_api
        selectors = _field_selector(q.get("fieldSelector", ""))
        limit = int(q.get("limit") or 0)
        start_key: tuple[str, str] | None = None
        with api.lock:
            rv = api.rv
            if q.get("continue"):
                try:
                    tok = json.loads(base64.urlsafe_b64decode(q["continue"]))
                    rv, start_key = int(tok["rv"]), (tok["ns"], tok["name"])
                except (ValueError, KeyError, TypeError):
                    self._send(400, _status(400, "BadRequest", "bad continue token"))
                    return
                if rv < api.compacted:
                    self._send(410, _status(410, "Expired", "continue token too old"))
                    return
            items = [copy.deepcopy(o) for k, o in sorted(api.store[resource].items())
                     if (start_key is None or k > start_key) and _matches(o, ns, selectors)]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit and len(items) > limit:
            items = items[:limit]
            last = items[-1]["metadata"]
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                {"rv": rv, "ns": last.get("namespace", ""), "name": last["name"]}).encode()
            ).decode()
        kind = RESOURCES[resource][2]
        for o in items:  # items of a typed list carry no kind, as the real server's
            o.pop("kind", None)
            o.pop("apiVersion", None)
        self._send(200, {"kind": f"{kind}List", "apiVersion": API_VERSION[
            RESOURCES[resource][0]], "metadata": meta, "items": items})
        if "continue" in meta and api.after_page is not None:
            api.after_page(resource)

    def _watch(self, resource: str, ns: str | None, q: dict[str, str]) -> None:
        api = self.server_api
        selectors = _field_selector(q.get("fieldSelector", ""))
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        timeout = min(float(q.get("timeoutSeconds") or api.max_watch_seconds),
                      api.max_watch_seconds)
        try:
            since = int(q.get("resourceVersion") or 0)
        except ValueError:
            since = -1
        w = _Watch(resource)
        with api.lock:
            gone = since < api.compacted and since != 0
            if gone and api.gone_as == "http":
                self._send(410, _status(410, "Expired", f"too old resource version: "
                                                        f"{since} ({api.compacted})"))
                return
            api.watches.append(w)
            if since == 0:  # "any": the current state as ADDED events, then changes
                backlog = [_Change(int(o["metadata"]["resourceVersion"]), resource, "ADDED",
                                   copy.deepcopy(o))
                           for o in api.store[resource].values()]
                since = api.rv
            else:
                backlog = []
        self._record(200)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        end = time.monotonic() + timeout
        last_bookmark = time.monotonic()
        try:
            if gone:
                self._chunk({"type": "ERROR", "object": _status(
                    410, "Expired", f"too old resource version: {since} ({api.compacted})")})
                return
            for c in backlog:
                if _matches(c.obj, ns, selectors):
                    self._chunk({"type": c.type, "object": c.obj})
            while True:
                with api.lock:
                    pending = [c for c in api.history
                               if c.rv > since and c.resource == resource]
                    if not pending and not w.expire.is_set() and not w.cut.is_set() \
                            and not w.raw:
                        wait = min(end, last_bookmark + api.bookmark_every) - time.monotonic()
                        if wait > 0:
                            api.lock.wait(min(wait, 0.5))
                        pending = [c for c in api.history
                                   if c.rv > since and c.resource == resource]
                    current = api.rv
                    raw, w.raw = w.raw, []
                for data in raw:
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                if w.hang.is_set():
                    w.cut.wait()
                if w.cut.is_set() or api.outage is not None:
                    return
                if w.expire.is_set():
                    self._chunk({"type": "ERROR", "object": _status(
                        410, "Expired", "The resourceVersion for the provided watch is too "
                                        "old.")})
                    return
                for c in pending:
                    since = c.rv
                    if _matches(c.obj, ns, selectors):
                        self._chunk({"type": c.type, "object": c.obj})
                now = time.monotonic()
                if bookmarks and (now >= last_bookmark + api.bookmark_every or now >= end):
                    since = max(since, current)
                    kind = RESOURCES[resource][2]
                    self._chunk({"type": "BOOKMARK", "object": {
                        "kind": kind, "apiVersion": API_VERSION[RESOURCES[resource][0]],
                        "metadata": {"resourceVersion": str(since)}}})
                    last_bookmark = now
                if now >= end:
                    return
        except OSError:  # the client went away
            self.close_connection = True
            return
        finally:
            with api.lock:
                if w in api.watches:
                    api.watches.remove(w)
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        with self.server_api.lock:
            self.server_api.stream_bytes += len(data)
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_PATCH(self) -> None:
        if self._outage():
            return
        route = self._route()
        body = self._body()
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if route is None or route[2] is None:
            self._send(404, _status(404, "NotFound", "no such path"), body)
            return
        resource, ns, name, sub = route
        if ctype not in ("application/strategic-merge-patch+json",
                         "application/merge-patch+json"):
            self._send(415, _status(415, "UnsupportedMediaType", ctype), body)
            return
        if ctype == "application/strategic-merge-patch+json" and resource == "events":
            # events.k8s.io has no strategic-merge schema for custom types; both work
            pass
        api = self.server_api
        with api.lock:
            key = (ns or ("default" if RESOURCES[resource][1] else ""), name)
            obj = api.store[resource].get(key)
            if obj is None:
                self._send(404, _status(404, "NotFound", f"{resource} {name} not found"), body)
                return
            if sub == "status":  # the status subresource changes status only
                body = {"status": (body or {}).get("status", {})}
            merge = strategic_merge if ctype.startswith("application/strategic") \
                else merge_patch
            new = merge(obj, body)
            new["metadata"]["name"] = name
            out = api._put(resource, new)
        self._send(200, out, body)

    def do_POST(self) -> None:
        if self._outage():
            return
        route = self._route()
        body = self._body()
        if route is None or route[2] is not None or not isinstance(body, dict):
            self._send(404, _status(404, "NotFound", "no such path"), body)
            return
        resource, ns, _, _ = route
        api = self.server_api
        meta = body.setdefault("metadata", {})
        if ns:
            meta["namespace"] = ns
        with api.lock:
            if not meta.get("name"):
                meta["name"] = f"{meta.get('generateName', 'x')}{api.rv + 1:x}"
            key = (meta.get("namespace", ""), meta["name"])
            if key in api.store[resource]:
                self._send(409, _status(409, "AlreadyExists", f"{meta['name']} exists"), body)
                return
            out = api._put(resource, body)
        self._send(201, out, body)


# -- objects for tests ---------------------------------------------------------------------


def service(name: str, lb_ip: str | None = None, *, namespace: str = "default",
            port: int = 80, node_port: int = 30080, etp: str = "Cluster") -> dict[str, Any]:
    svc: dict[str, Any] = {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"type": "LoadBalancer" if lb_ip else "ClusterIP", "clusterIP": "10.96.0.10",
                 "externalTrafficPolicy": etp,
                 "ports": [{"port": port, "protocol": "TCP", "nodePort": node_port}]},
        "status": {"loadBalancer": {"ingress": [{"ip": lb_ip}] if lb_ip else []}},
    }
    return svc


def node(name: str, internal_ip: str = "10.0.0.5", pod_cidr: str = "10.244.1.0/24"
         ) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
            "status": {"addresses": [{"type": "InternalIP", "address": internal_ip},
                                     {"type": "Hostname", "address": name}],
                       "conditions": [{"type": "Ready", "status": "True",
                                       "reason": "KubeletReady",
                                       "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}


def daemon_set(image: str, name: str = "kube-proxy", namespace: str = "kube-system"
               ) -> dict[str, Any]:
    """kube-proxy's DaemonSet as kubeadm writes it (labels k8s-app: kube-proxy)."""
    return {"metadata": {"name": name, "namespace": namespace,
                         "labels": {"k8s-app": "kube-proxy"}},
            "spec": {"selector": {"matchLabels": {"k8s-app": "kube-proxy"}},
                     "template": {"metadata": {"labels": {"k8s-app": "kube-proxy"}},
                                  "spec": {"containers": [{"name": "kube-proxy",
                                                           "image": image,
                                                           "env": [{"name": "NODE_NAME"}]}]}}}}


def pod(name: str, node_name: str, image: str, *, namespace: str = "kube-system",
        labels: dict[str, str] | None = None, container: str = "kube-proxy"
        ) -> dict[str, Any]:
    """A Pod as kubeadm's kube-proxy DaemonSet makes them (labels k8s-app: kube-proxy)."""
    return {"metadata": {"name": name, "namespace": namespace,
                         "labels": {"k8s-app": "kube-proxy"} if labels is None else labels},
            "spec": {"nodeName": node_name,
                     "containers": [{"name": container, "image": image}]},
            "status": {"phase": "Running"}}


def ingress(name: str, ip: str, backend: str, *, namespace: str = "default"
            ) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {"defaultBackend": {"service": {"name": backend,
                                                    "port": {"number": 80}}}},
            "status": {"loadBalancer": {"ingress": [{"ip": ip}]}}}


def kubeconfig(path: str, url: str) -> str:
    """A kubeconfig file for the fixture (no auth: the fixture asks for none)."""
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
           "clusters": [{"name": "fake", "cluster": {"server": url}}],
           "users": [{"name": "fake", "user": {"token": "t"}}],
           "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}
    with open(path, "w") as f:
        json.dump(doc, f)
    return path
