"""Shipping spooled verdicts to the collector over HTTP (requests).

One pass (``drain``) sends the oldest verdicts in batches and removes each batch only
after a 2xx. What to do next is the caller's: ``Backoff.next_delay`` gives exponential
backoff with full jitter, never shorter than a Retry-After the collector sent (429/503).
The bearer token is read from a file and re-read when the file changes (a rotated Secret,
or the kubelet's refresh of a projected service-account token: see agent.ship.auth).

Bodies are gzipped (``Content-Encoding: gzip``) once the collector has said it takes them
(``Accept-Encoding: gzip`` in a reply, RFC 7694), so a newer agent never sends gzip to an
older collector, which refused it with 400 (taken here as "refused for good": the
verdicts would have been set aside). A batch too large to go plain is gzipped anyway
(plain could only be refused). A 415, or a 400 to a gzip body from a collector that
does not advertise gzip (an older replica behind the same Service, or a rollback), turns
gzip off and the batch goes again plain at once; nothing is set aside for it. A verdict
that can only go gzipped stays in the spool until a collector takes it, and does not
hold back the newer verdicts behind it.
"""

from __future__ import annotations

import errno
import os
import random
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path

import requests

from agent.numbers import is_number
from agent.regular_file import read_regular
from agent.ship import gz
from agent.ship.spool import Spool, SpoolItem

# well under the collector's 4 MiB request limit (on the wire: gzipped when it takes gzip),
# so a full batch is never refused as too large
BATCH_BYTES = 2 * 1024 * 1024
# a batch's JSON text at most (a larger verdict goes alone): what one drain pass holds
BATCH_PLAIN_BYTES = 16 * 1024 * 1024
WIRE_LIMIT = gz.WIRE_LIMIT  # the collector's limit on a request as received
MAX_TOKEN_BYTES = 64 * 1024  # a projected service-account token is ~1 KiB
RETRYABLE = {408, 425, 429, 500, 502, 503, 504}
REJECTED = {400, 413, 422}  # the collector will never take these verdicts as they are


@dataclass(frozen=True)
class SendResult:
    ok: bool
    status: int | None = None
    retry_after: float | None = None  # seconds, from the collector's Retry-After
    error: str | None = None

    @property
    def rejected(self) -> bool:
        return self.status in REJECTED


class TokenFile:
    """A bearer token in a file, re-read whenever the file changes: another file (inode:
    the kubelet swaps a projected token or a Secret in through a symlink), or a new mtime
    or size. Read without blocking and at most MAX_TOKEN_BYTES, so a FIFO or a device put
    there cannot hang or flood the agent; ``problem`` says why there is no token."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int, int] | None = None
        self._token: str | None = None
        self.problem: str | None = None

    def token(self) -> str | None:
        try:
            st = self.path.stat()
            if not stat.S_ISREG(st.st_mode):  # (never opened: opening a device may act)
                raise OSError(errno.EINVAL, "not a regular file")
            if _stamp(st) != self._stamp:
                self._token, self._stamp = self._read()
        except OSError as e:
            self._stamp, self._token = None, None
            self.problem = f"token file {self.path}: {e.strerror or e}"
            return None
        self.problem = None if self._token else f"token file {self.path} is empty"
        return self._token

    def invalidate(self) -> None:
        """Read the file again next time (the collector refused the token: it may have
        been rotated in a way the stamp missed)."""
        self._stamp = None

    def _read(self) -> tuple[str | None, tuple[int, int, int, int]]:
        data, st = read_regular(self.path, MAX_TOKEN_BYTES)
        try:
            text = data.decode("ascii").strip()
        except UnicodeDecodeError as e:
            raise OSError(errno.EINVAL, "not an ASCII token") from e
        if any(c.isspace() for c in text):  # one header value: no line breaks inside
            raise OSError(errno.EINVAL, "a token has no spaces or line breaks inside")
        return text or None, _stamp(st)


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class Sender:
    def __init__(self, url: str, *, token_file: str | Path | None = None,
                 ca_file: str | Path | None = None, timeout: float = 10.0,
                 session: requests.Session | None = None) -> None:
        self.url = url.rstrip("/") + "/v1/verdicts"
        self.token = TokenFile(token_file) if token_file else None
        # TLS verification is on by default; a CA bundle replaces the system's
        self.verify: bool | str = str(ca_file) if ca_file else True
        self.timeout = timeout
        self.session = session or requests.Session()

        # does the collector take gzip bodies? None: not known yet (no reply seen)
        self.gzip_ok: bool | None = None

    def send_items(self, items: list[SpoolItem]) -> SendResult:
        """Post spooled verdicts as one JSON array (a single verdict gzipped: its spool
        file), gzipped when the collector takes it or when plain could not be taken
        anyway. Gzipped, the array is made from each item's text a MiB at a time: a 21 MB
        verdict costs its 1.5 MB of gzip here, not its text."""
        too_big = _too_big(items)  # plain could only be refused (413): set aside
        if too_big or self.gzip_ok:
            # one verdict, spooled as gzip: its file is the body (the collector takes a
            # verdict alone as well as an array), not inflated and deflated again: a
            # 10k-service verdict, which always goes alone, cost 0.4 s of CPU a shipment
            one = items[0].raw if len(items) == 1 and items[0].gzipped else None
            res = self._post(one or gz.compress_chunks(_array(items)), gzipped=True)
            if res.status != 415:
                return res
            self.gzip_ok = False
            if too_big:
                return res  # 415 is neither retried at once nor rejected: kept
        return self._post(b"".join(_array(items)), gzipped=False)

    def _post(self, body: bytes, *, gzipped: bool) -> SendResult:
        headers = {"Content-Type": "application/json"}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        if self.token is not None:
            token = self.token.token()
            if token is None:
                # configured but unreadable: sending without it could only be refused
                # (401) and would hide why; retried with backoff like any failure
                return SendResult(False, error=f"no bearer token: {self.token.problem}")
            headers["Authorization"] = f"Bearer {token}"
        try:
            r = self.session.post(self.url, data=body, headers=headers,
                                  timeout=self.timeout, verify=self.verify)
        except requests.RequestException as e:
            return SendResult(False, error=f"{type(e).__name__}: {e}")
        takes = _takes_gzip(r.headers.get("Accept-Encoding"))
        # every reply says it: a collector replaced by an older one stops getting gzip
        self.gzip_ok = takes
        if 200 <= r.status_code < 300:
            return SendResult(True, r.status_code)
        if r.status_code in (401, 403) and self.token is not None:
            self.token.invalidate()
        status = r.status_code
        if gzipped and status == 400 and not takes:
            status = 415  # an older collector's 400 to a coding it does not know
        return SendResult(False, status, _retry_after(r.headers.get("Retry-After")),
                          f"HTTP {r.status_code}: {r.text[:200]}")


class Backoff:
    """Exponential backoff with full jitter; a Retry-After is a floor."""

    def __init__(self, base: float = 1.0, cap: float = 300.0,
                 rng: random.Random | None = None) -> None:
        self.base, self.cap = base, cap
        self.failures = 0
        self.rng = rng or random.Random()

    def success(self) -> None:
        self.failures = 0

    def next_delay(self, retry_after: float | None = None) -> float:
        self.failures += 1
        delay = self.rng.uniform(0, min(self.cap, self.base * 2 ** (self.failures - 1)))
        return max(delay, min(retry_after or 0.0, self.cap))


@dataclass
class DrainResult:
    sent: int = 0
    rejected: int = 0  # set aside: the collector refused them for good (4xx)
    last: SendResult | None = None  # the failure that ended the pass, if any
    # kept for a collector that takes gzip: too large to go plain, and this one does not
    # (415, or an older release's 400); the newer verdicts behind them went on
    held: int = 0
    held_why: str | None = None


def drain(spool: Spool, sender: Sender, *, batch: int = 50,
          batch_bytes: int = BATCH_BYTES,
          batch_plain_bytes: int = BATCH_PLAIN_BYTES) -> DrainResult:
    """Send everything spooled, oldest first, in batches of at most ``batch`` verdicts and
    ``batch_bytes`` on the wire and ``batch_plain_bytes`` of JSON text (a larger verdict
    goes alone); stop at the first failure. Verdicts are
    read one batch at a time, so memory is one batch, whatever the spool holds.
    A batch the collector rejects for good is retried one verdict at a time so a single
    bad verdict is set aside (NAME.rejected) without holding back the others. A verdict
    too large to go plain, to a collector that takes no gzip, is kept (``held``) and the
    pass goes on with the newer ones."""
    out = DrainResult()
    for chunk in _batches(spool.items(), batch, batch_bytes, batch_plain_bytes, sender):
        if out.held and sender.gzip_ok is False and _too_big(chunk):
            out.held += len(chunk)  # tried once this pass (the collector's answer stands)
            continue
        res = sender.send_items(chunk)
        if res.status == 415:
            # only a batch that cannot go plain ends so (send_items resends the others
            # plain): keep it for a collector that takes gzip, and do not let it hold
            # back the newer verdicts behind it (on a 10k-service node every verdict is
            # that large: each pass tries the first one, which tells when it is taken)
            out.held += len(chunk)
            out.held_why = res.error
            continue
        if res.ok:
            for it in chunk:
                spool.remove(it.name)
            out.sent += len(chunk)
            continue
        if not res.rejected:
            out.last = res
            return out
        for it in chunk:
            one = sender.send_items([it])
            if one.ok:
                spool.remove(it.name)
                out.sent += 1
            elif one.rejected:
                spool.set_aside(it.name, f"rejected by the collector: {one.error}")
                out.rejected += 1
            elif one.status == 415:
                out.held += 1
                out.held_why = one.error
            else:
                out.last = one
                return out
    return out


def _too_big(items: list[SpoolItem]) -> bool:
    """Is the JSON array of ``items`` past what the collector takes plain?"""
    return 1 + sum(it.plain_size + 1 for it in items) > WIRE_LIMIT


def _batches(items: Iterator[SpoolItem], batch: int, batch_bytes: int,
             batch_plain_bytes: int, sender: Sender) -> Iterator[list[SpoolItem]]:
    """On the wire an item costs its compressed size (as spooled) when the collector takes
    gzip, else its text; asked per item, as the answer may change between batches."""
    chunk: list[SpoolItem] = []
    wire = plain = 0
    for it in items:
        cost = it.size if sender.gzip_ok else it.plain_size
        if chunk and (len(chunk) >= batch or wire + cost > batch_bytes
                      or plain + it.plain_size > batch_plain_bytes):
            yield chunk
            chunk, wire, plain = [], 0, 0
        chunk.append(it)
        wire += cost
        plain += it.plain_size
    if chunk:
        yield chunk


def _array(items: list[SpoolItem]) -> Iterator[bytes]:
    yield b"["
    for i, it in enumerate(items):
        if i:
            yield b","
        yield from it.chunks()
    yield b"]"


def _takes_gzip(value: str | None) -> bool:
    """Accept-Encoding of a reply names gzip (and not with q=0)."""
    for part in (value or "").split(","):
        coding, *params = (p.strip().lower() for p in part.split(";"))
        if coding in ("gzip", "x-gzip"):
            q = next((p[2:] for p in params if p.startswith("q=")), "1")
            try:
                return float(q) > 0
            except ValueError:
                return False
    return False


def _retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: a number, or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if is_number(value):
        return float(value)
    try:
        import datetime as dt

        when = parsedate_to_datetime(value)
        return max(0.0, (when - dt.datetime.now(when.tzinfo)).total_seconds())
    except (TypeError, ValueError):
        return None
