"""The collector's HTTP(S) server, on Tornado.

Why Tornado and not the standard library's http.server (which this replaced) or another
WSGI server: the collector faces every node, and what matters there is measured in
tests/test_collector_abuse.py. Tornado is an event loop: a connection that sends half a
request and waits costs a socket, never a thread, and it bounds the *whole* time for
the request line and headers (and the TLS handshake) and for the body, not each read;
TLS handshakes are asynchronous. cheroot (CherryPy's server) was measured on this
machine: it does the TLS handshake in its accept loop, so one client that connects and
stays silent stopped every new connection for its 10 s timeout, and 20 clients that
sent half a request delayed a normal one by 19.5 s (a worker thread each, per-read
timeouts only). waitress buffers well but serves no TLS; gunicorn's workers need a
buffering proxy in front for slow clients (its own documentation).

What Tornado lacks is added here, small: a cap on open connections, below the file
descriptor limit, so the accept loop pauses instead of failing; a pause after EMFILE
(Linux keeps the listening socket readable: without it the loop spins at 100 % CPU);
a bound on the bytes of all bodies being received at once; a queue limit for the
worker threads (503 with Retry-After beyond it); a write timeout; and the check of
Content-Length (two of them: 400).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from tornado.httpserver import HTTPServer
from tornado.ioloop import IOLoop
from tornado.web import Application, HTTPError, RequestHandler, stream_request_body

from agent.collector import browse, views
from agent.collector.auth import Authenticator, Caller
from agent.collector.intake import MAX_BODY, MAX_INFLATED, BadRequest
from agent.collector.server import Collector, dumps
from agent.collector.store import Store
from agent.collector.tls import TLSFiles
from agent.listen import bind_address, dual_stack, on_every_address, split_listen
from agent.logfmt import LOGGER
from agent.ship.gz import GzipError, inflate_chunks

_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# token reviews waiting for the API (beyond: 503): of tokens that passed a review before,
# and of any other token (a small budget of their own: a flood of made-up tokens fills it,
# never the known agents' queue)
AUTH_QUEUE = 64
UNKNOWN_AUTH_QUEUE = 8


@dataclass(frozen=True)
class Limits:
    header_timeout: float = 10.0  # request line + headers (+ TLS handshake); idle keep-alive
    body_timeout: float = 20.0  # the whole body: a Content-Length longer than it ends here
    write_timeout: float = 30.0  # a reply the client does not read
    max_header: int = 64 * 1024
    max_connections: int = 2048  # and never closer than 64 to RLIMIT_NOFILE
    # bodies held, all connections together: as received and as inflated from gzip (one
    # verdict inflates to at most MAX_INFLATED: 64 MiB; 128 leaves room beside it)
    body_budget: int = 128 * 1024 * 1024
    # of which one client address may hold (issue 35, item 2: 32 connections announcing
    # 4 MiB each and sending nothing held the whole budget for the body timeout)
    client_share: int = 32 * 1024 * 1024
    workers: int = 4  # parsing, validation, the database
    max_queued: int = 256  # requests waiting for a worker
    backlog: int = 1024


def _raise_fd_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one (as Go programs do): a container's
    soft limit is often 1024. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _say(message: str) -> None:
    """A message of the server itself (an accept() that fails for want of descriptors):
    a line of the collector's log (agent.logfmt), as its command set it up."""
    logging.getLogger(LOGGER + ".collector").warning(message)


class _HTTPServer(HTTPServer):
    """Tornado's HTTPServer with an accept loop that knows its limits."""

    def initialize(self, *args: Any, tls: TLSFiles | None = None, max_connections: int = 1024,
                   **kwargs: Any) -> None:
        self._tls = tls
        super().initialize(*args, **kwargs)
        self.max_connections = max_connections
        self._accepting = False
        self._backoff_until = 0.0
        self._warned = 0.0
        self._sock: socket.socket | None = None

    # Tornado wraps each accepted socket with ``ssl_options``: the current context, so a
    # reloaded certificate serves the next connection
    @property  # type: ignore[override]
    def ssl_options(self) -> Any:
        tls = getattr(self, "_tls", None)
        return tls.context() if tls is not None else None

    @ssl_options.setter
    def ssl_options(self, value: Any) -> None:
        pass

    def serve_socket(self, sock: socket.socket) -> None:
        self._sock = sock
        self._resume()

    def stop_accepting(self) -> None:
        self._pause()
        self._sock = None

    def _resume(self) -> None:
        if self._sock is not None and not self._accepting \
                and time.monotonic() >= self._backoff_until:
            IOLoop.current().add_handler(self._sock, self._accept, IOLoop.READ)
            self._accepting = True

    def _pause(self) -> None:
        if self._accepting and self._sock is not None:
            IOLoop.current().remove_handler(self._sock)
        self._accepting = False

    def _accept(self, fd: Any, events: int) -> None:
        assert self._sock is not None
        for _ in range(128):  # then let the requests in progress run
            if len(self._connections) >= self.max_connections:
                self._pause()  # new ones wait in the backlog; on_close resumes
                return
            try:
                conn, addr = self._sock.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno not in _RESOURCE_ERRNOS:
                    raise
                self._pause()
                self._backoff_until = time.monotonic() + 1.0
                IOLoop.current().call_later(1.0, self._resume)
                if time.monotonic() - self._warned > 60:
                    self._warned = time.monotonic()
                    _say(f"accept: {e.strerror}: pausing new connections for 1 s "
                         f"({len(self._connections)} open)")
                return
            self._handle_connection(conn, addr)

    def on_close(self, server_conn: Any) -> None:
        super().on_close(server_conn)
        if len(self._connections) < self.max_connections:
            self._resume()


class CollectorServer:
    """What the command drives, as it drove socketserver: bound at construction,
    ``serve_forever()`` in a thread, ``shutdown()`` from another, ``server_address``."""

    def __init__(self, collector: Collector, host: str, port: int,
                 tls: TLSFiles | None = None, limits: Limits | None = None,
                 access_log: Callable[[RequestHandler], None] | None = None) -> None:
        self.collector = collector
        # called with each request's handler when it ends (agent.collector.access);
        # None: no access log
        self.access_log = access_log or _no_log
        self.tls = tls
        self.limits = limits or Limits()
        fd_limit = _raise_fd_limit()
        self.max_connections = max(8, min(self.limits.max_connections, fd_limit - 64))
        family, host = bind_address(host.strip("[]"))
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            dual_stack(self.socket, host)
            self.socket.bind((host, port))
            self.socket.listen(self.limits.backlog)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.pool = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="collector")
        self.auth_pool = ThreadPoolExecutor(4, thread_name_prefix="collector-auth")
        self.unknown_auth_pool = ThreadPoolExecutor(2, thread_name_prefix="collector-auth-new")
        # /healthz has its own thread: a full request queue is load, not a dead process
        # (a liveness probe failing under load would restart the collector when busiest)
        self.health_pool = ThreadPoolExecutor(1, thread_name_prefix="collector-health")
        self.blocking_auth = bool(getattr(collector.auth, "blocking", False))
        self.queued = 0  # requests given to the pool and not done (event loop only)
        self.auth_waiting = 0  # token reviews given to auth_pool and not done (loop only)
        self.unknown_waiting = 0  # those given to unknown_auth_pool
        # bytes reserved for bodies being received or inflated; the event loop reserves
        # what arrives, a worker thread what it inflates: hence the lock
        self.receiving = 0
        self.by_client: dict[str, int] = {}  # of it, per client address
        self._budget_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopped = threading.Event()

    # -- running ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._stopped.wait(30)
        for pool in (self.pool, self.auth_pool, self.unknown_auth_pool, self.health_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        lim = self.limits
        app = Application(_routes(self), default_handler_class=NotFound,
                          default_handler_args={"server": self},
                          log_function=self.access_log,
                          compress_response=False)
        http = _HTTPServer(app, tls=self.tls, max_connections=self.max_connections,
                           idle_connection_timeout=lim.header_timeout,
                           body_timeout=lim.body_timeout, max_header_size=lim.max_header,
                           # bodies are limited by the handlers (413 with a reason);
                           # Tornado's own limit would answer a bare 400
                           max_body_size=1 << 40, decompress_request=False, xheaders=False)
        http.serve_socket(self.socket)
        await self._stop.wait()
        http.stop_accepting()
        self.socket.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(http.close_all_connections(), 5)

    # -- what handlers share ------------------------------------------------------------

    async def work(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a worker thread; 503 when too many already wait."""
        if self.queued >= self.limits.max_queued:
            raise BadRequest(503, "the collector is busy", retry_after=2)
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.queued -= 1

    async def authenticate(self, authorization: str) -> Caller:
        if not self.blocking_auth:
            return self.collector.authenticate(authorization)
        auth = self.collector.auth
        hit = auth.cached(authorization)  # cached callers: no queue
        if hit is not None:
            return hit
        loop = asyncio.get_running_loop()
        if auth.known(authorization):
            if self.auth_waiting >= AUTH_QUEUE:
                raise BadRequest(503, "too many token reviews waiting", retry_after=5)
            self.auth_waiting += 1
            try:
                return await loop.run_in_executor(self.auth_pool, self.collector.authenticate,
                                                  authorization)
            finally:
                self.auth_waiting -= 1
        if self.unknown_waiting >= UNKNOWN_AUTH_QUEUE:
            raise BadRequest(503, "too many reviews of new tokens waiting", retry_after=5)
        self.unknown_waiting += 1
        try:
            return await loop.run_in_executor(self.unknown_auth_pool,
                                              self.collector.authenticate, authorization)
        finally:
            self.unknown_waiting -= 1

    def room(self, n: int, client: str) -> None:
        """503 now, before a body of ``n`` bytes is sent, where it could not be held:
        nothing is reserved (a body is reserved as its bytes arrive, so a client that
        announces a body and sends nothing holds nothing)."""
        with self._budget_lock:
            self._fits(n, client)

    def _fits(self, n: int, client: str | None) -> int:
        """503 unless ``n`` more bytes fit the budget and ``client``'s share; what the
        client holds (the lock held)."""
        held = self.by_client.get(client, 0) if client is not None else 0
        if client is not None and held + n > self.limits.client_share:
            raise BadRequest(503, "this client's bodies being received are over its "
                             "share", retry_after=2)
        if self.receiving + n > self.limits.body_budget:
            raise BadRequest(503, "too many bodies being received", retry_after=2)
        return held

    def reserve(self, n: int, client: str | None = None) -> None:
        with self._budget_lock:
            held = self._fits(n, client)
            self.receiving += n
            if client is not None:
                self.by_client[client] = held + n

    def release(self, n: int, client: str | None = None) -> None:
        with self._budget_lock:
            self.receiving -= n
            if client is not None:
                left = self.by_client.get(client, 0) - n
                if left > 0:
                    self.by_client[client] = left
                else:
                    self.by_client.pop(client, None)

    def inflate(self, wire: bytes) -> bytearray:
        """A gzip body inflated (on a worker thread), each step reserved in the body
        budget first: 413 past MAX_INFLATED, 400 for a bad stream, 503 when the budget
        is spent. The caller releases ``len(result)``; on an error it is released here."""
        out = bytearray()
        try:
            for chunk in inflate_chunks(wire, MAX_INFLATED):
                self.reserve(len(chunk))
                out += chunk
        except GzipError as e:
            self.release(len(out))
            if e.too_large:
                raise BadRequest(413, f"gzip body {e}; at most {MAX_INFLATED}") from None
            raise BadRequest(400, f"Content-Encoding gzip: {e}") from None
        except BaseException:
            self.release(len(out))
            raise
        return out


def _no_log(handler: RequestHandler) -> None:
    """No access log: a flood of refused requests would flood the log too."""


@stream_request_body  # every handler: no body is ever buffered by Tornado itself
class _Base(RequestHandler):
    server: CollectorServer
    accepts_body = False

    def initialize(self, server: CollectorServer) -> None:  # type: ignore[override]
        self.server = server
        self.col = server.collector
        self.body = bytearray()
        self.reserved = 0

    def set_default_headers(self) -> None:
        self.clear_header("Server")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("X-Frame-Options", "DENY")
        self.set_header("Referrer-Policy", "no-referrer")
        self.set_header("Cache-Control", "no-store")
        self.set_header("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'")

    async def prepare(self) -> None:
        try:
            await self.check_request()
        except BadRequest as e:
            self.fail(e)

    async def check_request(self) -> None:
        h = self.request.headers
        lengths = h.get_list("Content-Length")
        if len(lengths) > 1:
            raise BadRequest(400, "more than one Content-Length header")
        if lengths and "Transfer-Encoding" in h:
            raise BadRequest(400, "both Content-Length and Transfer-Encoding")
        if lengths and not (lengths[0].isdigit() and len(lengths[0]) <= 12):
            raise BadRequest(400, "Content-Length is not a number")
        has_body = (int(lengths[0]) if lengths else 0) > 0 or "Transfer-Encoding" in h
        if has_body and not self.accepts_body:
            raise BadRequest(400, f"{self.request.method} takes no body here")

    def data_received(self, chunk: bytes) -> None:
        if self._finished:
            return
        if len(self.body) + len(chunk) > MAX_BODY:
            self.fail(BadRequest(413, f"body over {MAX_BODY} bytes"))
            return
        extra = len(self.body) + len(chunk) - self.reserved
        if extra > 0:  # reserved as it comes
            try:
                self.server.reserve(extra, self.client)
            except BadRequest as e:
                self.fail(e)
                return
            self.reserved += extra
        self.body += chunk

    def on_finish(self) -> None:
        self._release()

    def on_connection_close(self) -> None:
        self._release()

    @property
    def client(self) -> str:
        return str(self.request.remote_ip or "")

    def _release(self) -> None:
        if self.reserved:
            self.server.release(self.reserved, self.client)
            self.reserved = 0
        self.body = bytearray()

    def fail(self, e: BadRequest) -> None:
        if self._finished:
            return
        if self.request.method == "POST":
            self.col.rejected.labels(str(e.code)).inc()
        self.set_status(e.code)
        if e.retry_after is not None:
            self.set_header("Retry-After", str(e.retry_after))
        self.reply(dumps({"error": e.message}))

    def reply(self, body: bytes, ctype: str = "application/json") -> None:
        self.set_header("Content-Type", ctype)
        done = self.finish(body)
        # a client that does not read its reply must not hold it (and its memory) forever
        stream = getattr(self.request.connection, "stream", None)
        if stream is None:
            return
        loop = IOLoop.current()
        timer = loop.call_later(self.server.limits.write_timeout,
                                lambda: None if done.done() else stream.close())
        done.add_done_callback(lambda _: loop.remove_timeout(timer))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        """An uncaught exception, as a line of the collector's log naming the method and
        the path only (Tornado's own line shows the whole URI: a query may hold what a
        client should not have put there, as the access log never shows)."""
        if isinstance(value, HTTPError):
            return  # (an answer, not an error of the collector's)
        logging.getLogger(LOGGER + ".collector").error(
            f"uncaught exception serving {self.request.method} {self.request.path[:512]}",
            exc_info=(typ, value, tb))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(dumps({"error": self._reason}))

    def args(self) -> dict[str, list[str]]:
        return {k: [v.decode("utf-8", "replace") for v in vs]
                for k, vs in self.request.query_arguments.items()}

    async def run(self, fn: Any, *args: Any) -> Any:
        return await self.server.work(fn, *args)


class NotFound(_Base):
    async def prepare(self) -> None:
        await super().prepare()
        if not self._finished:
            self.fail(BadRequest(404, "not found"))


# request body codings taken (RFC 9110 8.4): advertised in every reply of /v1/verdicts
# as Accept-Encoding (RFC 7694 3), so an agent compresses only for a collector that can
_ENCODINGS = {"": False, "identity": False, "gzip": True, "x-gzip": True}


class Verdicts(_Base):
    accepts_body = True
    caller: Caller | None = None
    gzipped = False

    def set_default_headers(self) -> None:
        super().set_default_headers()
        self.set_header("Accept-Encoding", "gzip")

    async def check_request(self) -> None:
        await super().check_request()
        if self.request.method != "POST":
            return
        self.gzipped = _body_coding(self.request.headers.get_list("Content-Encoding"))
        lengths = self.request.headers.get_list("Content-Length")
        if not lengths and "Transfer-Encoding" not in self.request.headers:
            raise BadRequest(411, "Content-Length required")
        length = int(lengths[0]) if lengths else 0
        if length > MAX_BODY:
            raise BadRequest(413, f"body of {length} bytes; at most {MAX_BODY}")
        # who is calling is known from the headers: refused before the body is read
        self.caller = await self.server.authenticate(
            self.request.headers.get("Authorization", ""))
        self.server.room(length, self.client)

    async def post(self) -> None:
        assert self.caller is not None
        wire, self.body = bytes(self.body), bytearray()
        error: BadRequest | None = None
        try:
            fn = self._ingest_gzip if self.gzipped else self.col.ingest
            result = await self.run(fn, self.caller, wire)
        except BadRequest as e:
            error = e
        finally:
            del wire
            self._release()  # before the reply: its sender may post again at once
        if error is not None:
            self.fail(error)
        else:
            self.reply(dumps(result))

    def _ingest_gzip(self, caller: Caller, wire: bytes) -> dict[str, Any]:
        """On a worker: inflate (bounded, in the budget), then what a plain body gets."""
        plain = self.server.inflate(wire)
        try:
            return self.col.ingest(caller, plain)
        finally:
            self.server.release(len(plain))


def _body_coding(values: list[str]) -> bool:
    """True for a gzip body, False for identity; 415 for any other coding or several
    (the reply's Accept-Encoding says what is taken)."""
    codings = [c.strip().lower() for v in values for c in v.split(",") if c.strip()]
    if len(codings) > 1 or (codings and codings[0] not in _ENCODINGS):
        raise BadRequest(415, f"Content-Encoding {', '.join(codings)[:100]!r} is not "
                         "taken: gzip or identity")
    return _ENCODINGS[codings[0] if codings else ""]


class Page(_Base):
    """The fleet page: filters and paging in the query (agent.collector.browse)."""

    async def get(self) -> None:
        try:
            view = browse.FleetView.of(self.args())
            html = await self.run(browse.fleet_page, self.col.store, view)
        except BadRequest as e:
            self.fail(e)
            return
        self.html(html)

    def html(self, html: str) -> None:
        self.set_header("Content-Security-Policy", browse.CSP)
        # old databases may hold text that does not encode: never a 500 for it
        self.reply(html.encode("utf-8", "replace"), "text/html; charset=utf-8")


class NodePage(Page):
    """/nodes/NODE: one node's latest verdict and its status over time; 404 (a page)
    for a node the collector holds no verdict of."""

    async def get(self, node: str) -> None:  # type: ignore[override]
        try:
            html = await self.run(browse.node_page, self.col.store, node)
        except BadRequest as e:
            self.fail(e)
            return
        if html is None:
            self.set_status(404)
            html = browse.not_found_page(node)
        self.html(html)


class _Paged(_Base):
    """A list a page at a time: the page spec, the collector's reader and the path."""

    list_spec: Any
    list_reader: str
    list_path: str

    async def get(self) -> None:
        try:
            page = views.page_of(self.args(), self.list_spec)
            rows, total = await self.run(getattr(self.col, self.list_reader), page)
        except BadRequest as e:
            self.fail(e)
            return
        self.set_header("X-Total-Count", str(total))
        link = views.next_link(self.list_path, page, total)
        if link:
            self.set_header("Link", link)
        self.reply(dumps(rows))


class Nodes(_Paged):
    list_spec, list_reader, list_path = views.NODES_PAGE, "nodes_page", "/v1/nodes"


class Services(_Paged):
    list_spec, list_reader, list_path = views.SERVICES_PAGE, "services_page", "/v1/services"


class History(_Base):
    async def get(self, node: str) -> None:
        try:
            args = self.args()
            limit = views._int(args, "limit", views.HISTORY_PAGE[0], 1, views.HISTORY_PAGE[1])
            body, more = await self.run(self.col.history, node, limit, views.cursor(args))
        except BadRequest as e:
            self.fail(e)
            return
        if body == b"[]" and "before" not in args:
            self.fail(BadRequest(404, "unknown node"))
            return
        link = views.history_link("/v1/nodes/" + quote(node, safe=""), limit, more)
        if link:
            self.set_header("Link", link)
        self.reply(body)


class Metrics(_Base):
    async def get(self) -> None:
        try:
            body = await self.run(self.col.metrics)
        except BadRequest as e:
            self.fail(e)
            return
        self.reply(body, CONTENT_TYPE_LATEST)


class Health(_Base):
    async def get(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.server.health_pool,
                                                          self.col.store.ping)
        self.reply(b"ok\n", "text/plain")


class OpenAPI(_Base):
    def get(self) -> None:
        self.reply(self.col.openapi())


def _routes(server: CollectorServer) -> list[Any]:
    kw = {"server": server}
    return [(r"/", Page, kw), (r"/nodes/([^/]+)", NodePage, kw),
            (r"/v1/verdicts", Verdicts, kw), (r"/v1/nodes", Nodes, kw),
            (r"/v1/nodes/([^/]+)", History, kw), (r"/v1/services", Services, kw),
            (r"/metrics", Metrics, kw), (r"/healthz", Health, kw), (r"/openapi.json", OpenAPI, kw)]


def serve(listen: str, store: Store, token_file: str | None = None, *,
          tls_cert: str | None = None, tls_key: str | None = None,
          authenticator: Authenticator | None = None,
          access_log: Callable[[RequestHandler], None] | None = None) -> Any:
    """Bind ``listen`` now (an OSError says why not); ``serve_forever()`` then serves
    until ``shutdown()``; ``access_log`` is called with each request's handler when it
    ends (agent.collector.access.AccessLog)."""
    host, port = split_listen(listen)
    tls = TLSFiles(tls_cert, tls_key) if tls_cert and tls_key else None
    collector = Collector(store, token_file, authenticator)
    if host:
        return CollectorServer(collector, host, port, tls, access_log=access_log)
    return on_every_address(lambda h: CollectorServer(collector, h, port, tls,
                                                      access_log=access_log))
