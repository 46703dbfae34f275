"""Shipping spooled verdicts to the collector over HTTP (requests).

One pass (``drain``) sends the oldest verdicts in batches and removes each batch only
after a 2xx. What to do next is the caller's: ``Backoff.next_delay`` gives exponential
backoff with full jitter, never shorter than a Retry-After the collector sent (429/503).
The bearer token is read from a file and re-read when the file changes (rotated Secrets).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import requests

from agent.ship.spool import Spool

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
    """A bearer token in a file, re-read whenever the file's mtime or size changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._token: str | None = None

    def token(self) -> str | None:
        try:
            st = self.path.stat()
        except OSError:
            self._stamp, self._token = None, None
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._token = self.path.read_text().strip() or None
            self._stamp = stamp
        return self._token


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

    def send(self, verdicts: list[dict[str, Any]]) -> SendResult:
        headers = {"Content-Type": "application/json"}
        token = self.token.token() if self.token else None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            r = self.session.post(self.url, json=verdicts, headers=headers,
                                  timeout=self.timeout, verify=self.verify)
        except requests.RequestException as e:
            return SendResult(False, error=f"{type(e).__name__}: {e}")
        if 200 <= r.status_code < 300:
            return SendResult(True, r.status_code)
        return SendResult(False, r.status_code, _retry_after(r.headers.get("Retry-After")),
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


def drain(spool: Spool, sender: Sender, *, batch: int = 50) -> DrainResult:
    """Send everything spooled, oldest first, in batches; stop at the first failure.
    A batch the collector rejects for good is retried one verdict at a time so a single
    bad verdict is set aside (NAME.rejected) without holding back the others."""
    out = DrainResult()
    items = list(spool.items())
    for i in range(0, len(items), batch):
        chunk = items[i:i + batch]
        res = sender.send([it.verdict for it in chunk])
        if res.ok:
            for it in chunk:
                spool.remove(it.name)
            out.sent += len(chunk)
            continue
        if not res.rejected:
            out.last = res
            return out
        for it in chunk:
            one = sender.send([it.verdict])
            if one.ok:
                spool.remove(it.name)
                out.sent += 1
            elif one.rejected:
                spool.set_aside(it.name, f"rejected by the collector: {one.error}")
                out.rejected += 1
            else:
                out.last = one
                return out
    return out


def _retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: a number, or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        import datetime as dt

        when = parsedate_to_datetime(value)
        return max(0.0, (when - dt.datetime.now(when.tzinfo)).total_seconds())
    except (TypeError, ValueError):
        return None
