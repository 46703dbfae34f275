"""A durable on-disk spool of verdicts waiting to be shipped.

A verdict is written atomically (temporary file, fsync, rename, fsync of the directory)
before any attempt to send it, and removed only once the collector accepted it, so a
crash or SIGKILL at any moment loses nothing that ``put`` returned for. The spool is
bounded in count and bytes: when full, the oldest verdicts are dropped and counted
(``dropped``), never unbounded growth. Each verdict carries an idempotency key so that a
send retried after a lost answer is stored once by the collector.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IDEMPOTENCY_KEY = "idempotency_key"
_SUFFIX = ".json"
_TMP_PREFIX = ".tmp-"
_CORRUPT_SUFFIX = ".corrupt"


@dataclass(frozen=True)
class SpoolItem:
    name: str  # file name: "<ns since epoch, 20 digits>-<key>.json", so names sort by age
    key: str
    verdict: dict[str, Any]


class Spool:
    def __init__(self, directory: str | Path, *, max_items: int = 1000,
                 max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError("spool bounds must be positive")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.dropped = 0  # oldest verdicts dropped because the spool was full
        self.corrupt = 0  # files that could not be read back (moved aside, reported)
        self.rejected = 0  # verdicts the collector refused for good (moved aside)
        self.problems: list[str] = []
        self._last_ns = 0
        # leftovers of a write interrupted by a crash: never renamed, so never complete
        for tmp in self.dir.glob(_TMP_PREFIX + "*"):
            tmp.unlink(missing_ok=True)
        # names must keep increasing after a restart, even if the clock went back
        names = self.names()
        if names:
            self._last_ns = int(names[-1].split("-", 1)[0])

    # -- writing --------------------------------------------------------------------

    def put(self, verdict: dict[str, Any]) -> str:
        """Store a verdict durably; returns its idempotency key (added to the document
        unless it already has one)."""
        doc = dict(verdict)
        key = str(doc.get(IDEMPOTENCY_KEY) or uuid.uuid4())
        doc[IDEMPOTENCY_KEY] = key
        data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        name = f"{self._next_ns():020d}-{key}{_SUFFIX}"
        tmp = self.dir / f"{_TMP_PREFIX}{name}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / name)
        self._fsync_dir()
        self._enforce_bounds()
        return key

    def set_aside(self, name: str, why: str) -> None:
        """Keep a verdict the collector refuses for good out of the queue, on disk
        (NAME.rejected) for a person to look at; counted and reported."""
        path = self.dir / name
        if path.exists():
            path.rename(path.with_name(name + ".rejected"))
            self.rejected += 1
            self.problems.append(f"spool file {name} set aside: {why}")
            self._fsync_dir()

    def remove(self, name: str) -> None:
        """The collector accepted it (2xx)."""
        (self.dir / name).unlink(missing_ok=True)
        self._fsync_dir()

    # -- reading --------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(p.name for p in self.dir.glob("*" + _SUFFIX)
                      if not p.name.startswith(_TMP_PREFIX))

    def __len__(self) -> int:
        return len(self.names())

    def bytes(self) -> int:
        return sum(_size(self.dir / n) for n in self.names())

    def items(self) -> Iterator[SpoolItem]:
        """Oldest first. A file that cannot be read back is moved aside as
        NAME.corrupt, counted and reported; the others are still delivered."""
        for name in self.names():
            path = self.dir / name
            try:
                doc = json.loads(path.read_bytes())
                if not isinstance(doc, dict) or not doc.get(IDEMPOTENCY_KEY):
                    raise ValueError("not a spooled verdict")
            except FileNotFoundError:
                continue  # removed meanwhile (sent by someone else, or dropped)
            except (OSError, ValueError) as e:
                self.corrupt += 1
                self.problems.append(f"spool file {name} unreadable, set aside: {e}")
                path.rename(path.with_name(name + _CORRUPT_SUFFIX))
                continue
            yield SpoolItem(name, str(doc[IDEMPOTENCY_KEY]), doc)

    # -- internals ------------------------------------------------------------------

    def _next_ns(self) -> int:
        # strictly increasing even when the clock stands still or steps back
        ns = max(time.time_ns(), self._last_ns + 1)
        self._last_ns = ns
        return ns

    def _enforce_bounds(self) -> None:
        names = self.names()
        sizes = [_size(self.dir / n) for n in names]
        total = sum(sizes)
        i = 0
        # keep at least the newest verdict even if it alone exceeds the byte bound
        while i < len(names) - 1 and (len(names) - i > self.max_items or total > self.max_bytes):
            (self.dir / names[i]).unlink(missing_ok=True)
            total -= sizes[i]
            self.dropped += 1
            i += 1
        if i:
            self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
