"""The agent's small HTTP listener (/metrics, /healthz, /verdict), hardened for a port that is open
on every node address (hostNetwork).

The standard library's ThreadingHTTPServer waits forever for a request and starts a thread
per connection, without bound; its listen backlog is 5. Here:

- every read and write times out (READ_TIMEOUT): an idle connection is closed;
- a connection lives at most LIFETIME seconds whatever it does: one that trickles a byte
  now and then (slowloris) is shut down by a single reaper thread;
- at most MAX_CONNECTIONS are served at once, MAX_PER_CLIENT from one address and
  MAX_PER_NET from one remote IPv6 /64 (a host is routed a whole /64 and may take a new
  address of it for each connection; a /64 may also be a subnet of many hosts, so it gets
  more); one more is closed at once (threads, file descriptors and memory stay bounded;
  the timeouts free the slots within seconds), so one client holding connections open
  cannot lock out the kubelet's probes or Prometheus;
- the backlog is BACKLOG (the kernel caps it at net.core.somaxconn), so a burst of
  scrapes and probes waits to be accepted instead of being dropped.

A request is answered in milliseconds, so the bounds cost a legitimate client nothing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent.listen import bind_address, dual_stack

READ_TIMEOUT = 5.0
LIFETIME = 15.0
MAX_CONNECTIONS = 64
MAX_PER_CLIENT = 16
MAX_PER_NET = 32
BACKLOG = 128
RESERVED_LOCAL = 16


def from_this_host(request: Any, client: str) -> bool:
    """A connection from this node: loopback, or to the very address it comes from."""
    try:
        # (on the dual-stack socket an IPv4 client is ::ffff:a.b.c.d)
        return client.removeprefix("::ffff:").startswith("127.") or client == "::1" or \
            client == request.getsockname()[0]
    except OSError:
        return False


def ipv6_net(client: str) -> str | None:
    """The /64 of a global IPv6 client, what MAX_PER_NET counts; None for an IPv4 one
    (also as ::ffff:a.b.c.d on the dual-stack socket), a link-local one (every neighbour
    on every link shares fe80::/64) and anything else."""
    try:
        addr = ipaddress.IPv6Address(client)
    except ValueError:
        return None
    if addr.ipv4_mapped or addr.is_link_local or addr.is_loopback:
        return None
    return str(ipaddress.IPv6Network((addr, 64), strict=False))


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 max_connections: int = MAX_CONNECTIONS, max_per_client: int = MAX_PER_CLIENT,
                 max_per_net: int = MAX_PER_NET, lifetime: float = LIFETIME) -> None:
        self._max, self._max_per_client = max_connections, max_per_client
        self._max_per_net = max_per_net
        # -> (accepted, client, its /64 or None)
        self._open: dict[socket.socket, tuple[float, str, str | None]] = {}
        self._per_client: dict[str, int] = {}
        self._per_net: dict[str, int] = {}
        self._lock = threading.Lock()
        self._lifetime = lifetime
        self._closing = threading.Event()
        # (the class's family is AF_INET; a name is resolved here, once)
        self.address_family, host = bind_address(address[0])
        super().__init__((host, address[1]), handler)
        threading.Thread(target=self._reap, name="http-reaper", daemon=True).start()

    def server_bind(self) -> None:
        dual_stack(self.socket, self.server_address[0])
        # TCPServer's, not HTTPServer's: that one asks getfqdn(host), a reverse DNS lookup
        # that a node with a broken resolver waits out at every start
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), \
            int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0])
        # the kubelet probes a hostNetwork pod from the node itself (node IP to node IP):
        # such connections may also use RESERVED_LOCAL slots, so remote clients filling
        # the shared ones cannot fail the liveness probe and restart the agent
        local = from_this_host(request, client)
        # (not the node's own: the kubelet's probe shares no /64 with its neighbours)
        net = None if local else ipv6_net(client)
        with self._lock:
            full = (len(self._open) >= self._max + (RESERVED_LOCAL if local else 0)
                    or self._per_client.get(client, 0) >= self._max_per_client
                    or (net is not None
                        and self._per_net.get(net, 0) >= self._max_per_net))
            if not full:
                self._open[request] = (time.monotonic(), client, net)
                self._per_client[client] = self._per_client.get(client, 0) + 1
                if net is not None:
                    self._per_net[net] = self._per_net.get(net, 0) + 1
        if full:
            self.shutdown_request(request)  # shed this one: stay bounded
            return
        try:
            super().process_request(request, client_address)  # its own thread
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that went away or was cut off: nothing to report
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()

    def _done(self, request: socket.socket) -> None:
        with self._lock:
            entry = self._open.pop(request, None)
            if entry is not None:
                _, client, net = entry
                _release(self._per_client, client)
                if net is not None:
                    _release(self._per_net, net)

    def _reap(self) -> None:
        while not self._closing.wait(1.0):
            now = time.monotonic()
            with self._lock:
                old = [s for s, (t, _, _) in self._open.items() if now - t > self._lifetime]
            for s in old:
                # wakes the handler's blocked read with EOF; it then cleans up
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def _release(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


class QuietHandler(BaseHTTPRequestHandler):
    """A handler with the read timeout set (StreamRequestHandler applies ``timeout`` to
    the socket) and no per-request log lines (stdout/stderr carry verdicts and logs)."""

    timeout = READ_TIMEOUT

    def log_message(self, *args: Any) -> None:
        pass
