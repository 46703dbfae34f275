"""One resource kept current by list+watch, as client-go's Reflector does.

One LIST (paged), then one WATCH at a time from the list's resourceVersion with
allowWatchBookmarks; a watch that ends (its timeoutSeconds, a server restart) is resumed
from the last resourceVersion seen, without a LIST. Only 410 Gone (an HTTP 410, or the
in-stream ERROR event with code 410) makes it LIST again. Any other error (connection
refused, 5xx, a read timeout) waits a jittered, exponentially growing delay and then
resumes the WATCH from where it was (the API server's watch cache answers that cheaply),
so when the API server comes back after an outage, its thousand agents neither LIST all at
once nor retry in lockstep.

Only decoded records are kept (``decode`` keeps the fields the diagnosis reads), never the
raw objects; each LIST page is decoded and dropped before the next is asked for.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

GONE = 410
PAGE = 500  # objects per LIST page: bounds the memory of one response
CONNECT_TIMEOUT = 10.0
READ_MARGIN = 30.0  # a watch's read timeout is its timeoutSeconds plus this
MAX_LINE = 16 << 20  # bytes of one watch event: the API server's objects are < 3 MiB
REFUSED = (401, 403, 404)  # statuses a retry within seconds does not mend
DELAYS_KEPT = 64  # backoff delays remembered (tests, the bench): a 403 retries forever


class JitteredBackoff:
    """Exponential delays with "equal jitter": half the step fixed, half random.

    The fixed half bounds how many requests one agent makes during an outage; the random
    half spreads agents that failed at the same moment so they do not retry together.
    A failure that comes ``reset_after`` (default twice the cap) after the last wait
    ended starts over from ``base``, as client-go's backoff manager does: a watch that
    served for hours and then broke is no outage (without this, only a LIST or a watch
    ending on its own timeout reset it, so one broken stream after an old outage waited
    the cap)."""

    def __init__(self, base: float = 1.0, cap: float = 60.0,
                 rng: random.Random | None = None, reset_after: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base, self.cap = base, cap
        self.rng = rng or random.Random()
        self.reset_after = 2 * cap if reset_after is None else reset_after
        self.clock = clock
        self.failures = 0
        self._waited_until: float | None = None

    def next_delay(self) -> float:
        now = self.clock()
        if self._waited_until is not None and now - self._waited_until > self.reset_after:
            self.failures = 0
        step = min(self.cap, self.base * (2 ** min(self.failures, 30)))
        self.failures += 1
        delay = step / 2 + self.rng.uniform(0, step / 2)
        self._waited_until = now + delay
        return delay

    def reset(self) -> None:
        self.failures = 0


def object_key(obj: dict[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an API object ("" for a cluster-scoped one's namespace)."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    ns, name = meta.get("namespace"), meta.get("name")
    return (ns if isinstance(ns, str) else "", name if isinstance(name, str) else "")


def describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    if status:  # kubernetes.client.ApiException
        return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".strip()[:300]
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class _BoundedLines:
    """A watch response whose stream refuses a line longer than MAX_LINE: the client's
    line splitter buffers until a newline, however much comes before it."""

    def __init__(self, resp: Any) -> None:
        self._resp = resp

    def __getattr__(self, attr: str) -> Any:  # status, data, close, connection...
        return getattr(self._resp, attr)

    def stream(self, amt: int | None = None, decode_content: bool | None = None) -> Any:
        # Watch asks for whole chunks (amt=None): one chunk can be any size. Pieces of
        # 64 KiB let the count stop a huge one early.
        pending = 0  # bytes since the last newline
        for seg in self._resp.stream(amt=min(amt or 1 << 16, 1 << 16),
                                     decode_content=decode_content):
            nl = seg.rfind(b"\n") if isinstance(seg, bytes) else -1
            pending = len(seg) - nl - 1 if nl >= 0 else pending + len(seg)
            if pending > MAX_LINE:
                raise ValueError(f"a line longer than {MAX_LINE} bytes")
            yield seg


class Reflector:
    def __init__(self, name: str, list_call: Callable[..., Any],
                 decode: Callable[[dict[str, Any]], object], *,
                 on_change: Callable[[str], None] | None = None,
                 field_selector: str | None = None, watch_timeout: float = 300.0,
                 request_timeout: float = 10.0, backoff: JitteredBackoff | None = None,
                 refused_backoff: JitteredBackoff | None = None,
                 rng: random.Random | None = None) -> None:
        self.name = name
        self._list_call = list_call
        self._decode = decode
        self._on_change = on_change
        self._selector = {"field_selector": field_selector} if field_selector else {}
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.rng = rng or random.Random()
        self.backoff = backoff or JitteredBackoff(rng=self.rng)
        # what waits after a refusal no retry within minutes mends (401/403/404: RBAC, no
        # such API), where that is not the usual backoff (an optional read)
        self.refused_backoff = refused_backoff
        self.stopping = threading.Event()
        self.synced = threading.Event()
        self.lock = threading.Lock()
        # decode(obj) keeps what the diagnosis reads; it raises (the message is kept in
        # ``bad``) for an object it cannot read, which then is left out.
        self.items: dict[tuple[str, str], object] = {}
        self.bad: dict[tuple[str, str], str] = {}  # objects that could not be read, and why
        self.version = 0  # bumped on every change of items/bad
        self.resource_version: str | None = None
        self.error: str | None = None  # the last failure, None once a request worked
        self.status: int | None = None  # its HTTP status, when the server gave one
        # counters, for metrics, tests and the bench
        self.lists = self.watches = self.relists_after_gone = self.failures = 0
        self.delays: deque[float] = deque(maxlen=DELAYS_KEPT)  # the last ones: bounded
        self._watch: Any = None
        self._listed_at = 0.0
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Reflector:
        self._thread = threading.Thread(target=self.run, name=f"reflector-{self.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, join: float = 2.0) -> None:
        self.stopping.set()
        w = self._watch
        if w is not None:
            w.stop()  # shuts the socket down: a blocked read returns
        if self._thread is not None:
            self._thread.join(join)

    def snapshot(self) -> tuple[int, list[object], dict[tuple[str, str], str]]:
        with self.lock:
            return self.version, list(self.items.values()), dict(self.bad)

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        need_list = True
        while not self.stopping.is_set():
            try:
                if need_list:
                    self._list()
                    need_list, self._listed_at = False, time.monotonic()
                self._watch_once()
            except ApiException as exc:
                if exc.status == GONE:
                    # Our resourceVersion is out of the server's window: what happened
                    # since is lost, only a new LIST tells. No wait, unless the version
                    # a LIST just gave is gone at once too (a server that cannot keep any
                    # window must not get a LIST loop).
                    self.relists_after_gone += 1
                    if need_list or time.monotonic() - self._listed_at < 1.0:
                        self._failed(exc)
                    need_list = True
                    continue
                self._failed(exc)
            except Exception as exc:  # urllib3 errors, timeouts, bad JSON
                if self.stopping.is_set():
                    break
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.error = describe(exc)
        status = getattr(exc, "status", None)
        self.status = status if isinstance(status, int) else None
        delay = (self.refused_backoff if self.refused_backoff is not None and
                 self.status in REFUSED else self.backoff).next_delay()
        self.delays.append(delay)
        self.stopping.wait(delay)

    def _list(self) -> None:
        items: dict[tuple[str, str], object] = {}
        bad: dict[tuple[str, str], str] = {}
        cont: str | None = None
        while True:
            kw: dict[str, Any] = {"limit": PAGE, **self._selector}
            if cont:
                kw["_continue"] = cont
            self.lists += 1
            resp = self._list_call(_preload_content=False,
                                   _request_timeout=self.request_timeout, **kw)
            try:
                doc = json.loads(resp.data)
            finally:
                resp.release_conn()
            if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict):
                raise ValueError(f"{self.name}: LIST answer is not a list object")
            for obj in doc.get("items") or ():
                self._decode_into(obj, items, bad)
            meta = doc["metadata"]
            cont = meta.get("continue") or None
            if not cont:
                rv = meta.get("resourceVersion")
                break
        if not isinstance(rv, str) or not rv:
            raise ValueError(f"{self.name}: LIST answer without a resourceVersion")
        with self.lock:
            changed = items != self.items or bad != self.bad
            self.items, self.bad, self.resource_version = items, bad, rv
            if changed:
                self.version += 1
        self.error = None
        self.backoff.reset()
        first = not self.synced.is_set()
        self.synced.set()
        if changed or first:
            self._changed()

    def _decode_into(self, obj: Any, items: dict[tuple[str, str], object],
                     bad: dict[tuple[str, str], str]) -> tuple[str, str] | None:
        if not isinstance(obj, dict):
            return None
        key = object_key(obj)
        try:
            record = self._decode(obj)
        except Exception as exc:  # InputError naming the field; never fatal to the rest
            items.pop(key, None)
            bad[key] = str(exc)[:300]
        else:
            items[key] = record
            bad.pop(key, None)
        return key

    def _watch_once(self) -> None:
        from kubernetes import watch

        # Spread the watches' ends (client-go: 5 to 10 minutes) so agents started together
        # do not all come back at the same second.
        timeout = max(1, int(self.watch_timeout * (1 + self.rng.random())))
        w = self._watch = watch.Watch()
        list_call = self._list_call

        def call(**kw: Any) -> Any:  # no return type for Watch to find: raw dict events
            return _BoundedLines(list_call(**kw))

        self.watches += 1
        started = time.monotonic()
        events = 0
        try:
            for event in w.stream(call, resource_version=self.resource_version,
                                  allow_watch_bookmarks=True, timeout_seconds=timeout,
                                  _request_timeout=(CONNECT_TIMEOUT, timeout + READ_MARGIN),
                                  **self._selector):
                if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                    # Watch yields None for a line that is not JSON: the stream is not
                    # an API server's (a proxy's error page, a cut line); resume from
                    # the last resourceVersion after a backoff.
                    raise TypeError("not JSON" if event is None else "no event type")
                events += 1
                self.error = None  # the server answers again
                self._apply(event)
                if self.stopping.is_set():
                    w.stop()
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # also raised inside Watch.stream for JSON that is no event ([1], no "object")
            raise ValueError(f"{self.name}: watch sent a line that is not a watch event "
                             f"({type(exc).__name__}: {describe(exc)})") from None
        finally:
            self._watch = None
        self.error = None
        if events:
            self.backoff.reset()
        if not events and time.monotonic() - started < min(1.0, timeout / 2):
            # Ended at once with nothing said: a server that closes watches is failing.
            raise ConnectionError(f"{self.name}: watch ended at once")

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("raw_object", event.get("object"))
        if not isinstance(obj, dict):
            return
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        rv = meta.get("resourceVersion")
        if kind == "BOOKMARK":
            if isinstance(rv, str) and rv:
                self.resource_version = rv
            return
        changed = False
        with self.lock:
            key = object_key(obj)
            if kind in ("ADDED", "MODIFIED"):
                before = (self.items.get(key), self.bad.get(key))
                self._decode_into(obj, self.items, self.bad)
                changed = (self.items.get(key), self.bad.get(key)) != before
            elif kind == "DELETED":
                changed = (self.items.pop(key, None) is not None) | \
                    (self.bad.pop(key, None) is not None)
            if changed:
                self.version += 1
            if isinstance(rv, str) and rv:
                self.resource_version = rv
        if changed:
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            with contextlib.suppress(Exception):  # a listener's bug must not end the watch
                self._on_change(self.name)
