"""A durable on-disk spool of verdicts waiting to be shipped.

A verdict is stored gzipped (one member: a 10k-service node's 21 MB verdict takes 1.5 MB
of the byte bound) and written atomically (temporary file, every byte written, fsync, rename, fsync
of the directory) before any attempt to send it, and removed only once the collector
accepted it, so a crash or SIGKILL at any moment loses nothing that ``put`` returned for;
a write that cannot complete (disk full, a file size limit) raises instead of leaving a
truncated verdict behind. The spool is bounded in count and bytes: when full, the oldest
verdicts are dropped and counted (``dropped``), never unbounded growth. Each verdict
carries an idempotency key so that a send retried after a lost answer is stored once by
the collector.

The directory is a hostPath on the node, so anything may appear in it. Only regular files
named as ``put`` names them are verdicts; any other entry with such a name (a symlink, a
directory, a FIFO, a device, a file larger than a verdict may be) is set aside (renamed
NAME.corrupt) without being opened, followed or counted: it can neither be shipped, nor
block a read, nor evict real verdicts; a regular file under such a name that the spool
did not write is read back and checked before any verdict is dropped to make room for it
(not a verdict: set aside). An entry with a name ``put`` never writes is not
the spool's: it is left alone (reported once, never read, renamed or deleted), so a
--spool pointed at a shared directory by mistake (/tmp, a manifests directory) loses
nobody's files. A verdict file is read with
O_NOFOLLOW|O_NONBLOCK and at most ``max_item_bytes``, so one swapped in after the listing
cannot do any of that either. Files of the previous version (plain JSON, no gzip magic)
are still read and shipped, so an upgrade in place loses nothing.

Memory: a verdict is encoded and gzipped a piece at a time, and read back as its gzip
bytes (its CRC checked by inflating and dropping): its JSON text is never held whole
nor parsed on the way out (the sender inflates and re-gzips it a MiB at a time).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.ship import gz

IDEMPOTENCY_KEY = "idempotency_key"
_SUFFIX = ".json"
_TMP_PREFIX = ".tmp-"
_CORRUPT_SUFFIX = ".corrupt"
_REJECTED_SUFFIX = ".rejected"
# "<ns since epoch, 20 digits>-<key>.json": the only names put() writes
_NAME = re.compile(r"([0-9]{20})-([A-Za-z0-9][A-Za-z0-9._-]{0,127})\.json")  # ASCII digits
# a verdict's compressed size may be at most this: well under the collector's 4 MiB
# request (on the wire), so it is always sent whole
MAX_ITEM_BYTES = 3 * 1024 * 1024
# a verdict's JSON text at most: what the collector inflates a body to, less the "[" and
# "]" of the batch it goes in alone (at exactly the limit it was refused, 413, and set aside)
MAX_PLAIN_BYTES = gz.INFLATED_LIMIT - 2
# the previous version wrote plain JSON files of up to 4 MiB: still read (upgrade in place)
LEGACY_ITEM_BYTES = 4 * 1024 * 1024
_MAX_PROBLEMS = 100  # kept until taken; older ones are dropped, never unbounded
_MAX_SET_ASIDE = 100  # NAME.corrupt / NAME.rejected files kept for a person to look at
# a name's time at most this far ahead of the clock counts when names go on after a
# restart (a clock stepped back by less keeps the order)
_FUTURE_NS = 86_400 * 10**9
_MAX_FOREIGN = 10_000  # foreign names remembered (reported once); past it, skipped quietly


class SpoolWriteError(OSError):
    """A verdict could not be stored (nothing was: no partial file is left)."""


@dataclass(frozen=True)
class SpoolItem:
    name: str  # file name: "<ns since epoch, 20 digits>-<key>.json", so names sort by age
    raw: bytes  # the file's bytes: gzip (as put() writes it) or plain JSON (an older agent)
    size: int = 0  # bytes on disk (compressed: about what shipping it gzipped costs)
    plain_size: int = 0  # bytes of its JSON text

    @property
    def gzipped(self) -> bool:
        return gz.is_gzip(self.raw)

    def chunks(self) -> Iterator[bytes]:
        """The JSON text, at most 1 MiB at a time: shipped as is, never re-encoded."""
        if self.gzipped:
            yield from gz.inflate_chunks(self.raw, MAX_PLAIN_BYTES)
        else:
            yield self.raw

    @property
    def data(self) -> bytes:
        """The whole JSON text (21 MB for a 10k-service verdict): made on demand."""
        return b"".join(self.chunks())

    @property
    def verdict(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.data)  # parsed on demand: 150 MB for 21 MB
        return doc

    @property
    def key(self) -> str:
        return str(self.verdict[IDEMPOTENCY_KEY])


class _SetAside(Exception):
    """This entry is not a verdict the spool can deliver; the message says why."""


class Spool:
    def __init__(self, directory: str | Path, *, max_items: int = 1000,
                 max_bytes: int = 64 * 1024 * 1024,
                 max_item_bytes: int = MAX_ITEM_BYTES,
                 max_file_bytes: int | None = None) -> None:
        if max_items < 1 or max_bytes < 1 or max_item_bytes < 1 or (
                max_file_bytes is not None and max_file_bytes < 1):
            raise ValueError("spool bounds must be positive")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.max_item_bytes = max_item_bytes  # compressed, as put() writes it
        # what a file on disk may be to be read: a plain one of the previous version too
        self.max_file_bytes = max_file_bytes or max(max_item_bytes, LEGACY_ITEM_BYTES)
        self.dropped = 0  # oldest verdicts dropped because the spool was full
        self.corrupt = 0  # entries that are not readable verdicts (moved aside, reported)
        self.rejected = 0  # verdicts the collector refused for good (moved aside)
        self.problems: list[str] = []
        self._unmovable: set[str] = set()  # set-aside candidates a rename failed for
        self._foreign: set[str] = set()  # *.json entries not named as put() names them
        # verdicts this spool wrote or read back whole, by name and file identity (a file
        # written over one since is not it): the others (a previous run's, or planted)
        # are checked before a real verdict is dropped to make room for them
        self._known: dict[str, tuple[int, ...]] = {}
        self._last_ns = 0
        # leftovers of a write interrupted by a crash: never renamed, so never complete
        for tmp in self.dir.glob(_TMP_PREFIX + "*"):
            if not _NAME.fullmatch(tmp.name[len(_TMP_PREFIX):]):
                continue  # not a name put() writes: someone else's file
            try:
                tmp.unlink(missing_ok=True)
            except OSError as e:  # e.g. a directory someone made: never ours, never read
                self._problem(f"spool entry {tmp.name} left alone: {e.strerror or e}")
        # names must keep increasing after a restart, even if the clock went back
        # (a name from the far future is not one it wrote: planted, it would push every
        # later name past 20 digits, names the spool would no longer take for its own)
        latest = time.time_ns() + _FUTURE_NS
        stamps = [int(n.split("-", 1)[0]) for n in self.names()]
        self._last_ns = max((ns for ns in stamps if ns <= latest), default=0)

    # -- writing --------------------------------------------------------------------

    def put(self, verdict: dict[str, Any]) -> str:
        """Store a verdict durably; returns its idempotency key (added to the document
        unless it already has one). Raises ValueError for a verdict larger than
        ``max_item_bytes`` gzipped (or MAX_PLAIN_BYTES inflated: the collector would
        refuse it) and SpoolWriteError when it cannot be written completely."""
        doc = dict(verdict)
        key = str(doc.get(IDEMPOTENCY_KEY) or uuid.uuid4())
        doc[IDEMPOTENCY_KEY] = key
        try:
            # encoded and gzipped a piece at a time: the JSON text (21 MB for 10k
            # Services) is never held whole, only its gzip (1.5 MB)
            data = gz.compress_chunks(json_chunks(doc), MAX_PLAIN_BYTES)
        except gz.GzipError:
            raise ValueError(f"verdict of more than {MAX_PLAIN_BYTES} bytes: more than "
                             "a collector inflates a verdict to") from None
        if len(data) > self.max_item_bytes:
            raise ValueError(f"verdict of {len(data)} bytes gzipped: more than the "
                             f"{self.max_item_bytes} a spooled verdict may have")
        name = f"{self._next_ns():020d}-{_file_key(key)}{_SUFFIX}"
        tmp = self.dir / f"{_TMP_PREFIX}{name}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.dir / name)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise SpoolWriteError(e.errno, f"cannot spool a verdict in {self.dir}: "
                                           f"{e.strerror or e}") from e
        self._fsync_dir()
        with contextlib.suppress(OSError):
            self._known[name] = _identity(os.lstat(self.dir / name))
        self._enforce_bounds()
        return key

    def set_aside(self, name: str, why: str) -> None:
        """Keep a verdict the collector refuses for good out of the queue, on disk
        (NAME.rejected) for a person to look at; counted and reported."""
        if self._rename_aside(name, _REJECTED_SUFFIX, why):
            self.rejected += 1
            self._prune_set_aside()

    def remove(self, name: str) -> None:
        """The collector accepted it (2xx)."""
        (self.dir / name).unlink(missing_ok=True)
        self._fsync_dir()

    # -- reading --------------------------------------------------------------------

    def names(self) -> list[str]:
        """The spooled verdicts' file names, oldest first."""
        return [name for name, _ in self._scan()]

    def __len__(self) -> int:
        return len(self._scan())

    def bytes(self) -> int:
        return sum(size for _, size in self._scan())

    def items(self) -> Iterator[SpoolItem]:
        """Oldest first, read one at a time (memory: one verdict). An entry that is not a
        readable verdict is moved aside as NAME.corrupt, counted and reported; the others
        are still delivered."""
        moved = False
        try:
            for name, _ in self._scan():
                got = self._read_checked(name)
                if isinstance(got, tuple):
                    yield SpoolItem(name, got[0], len(got[0]), got[1])
                moved = moved or got is True
        finally:
            if moved:  # (once: pruning after each of thousands was quadratic)
                self._prune_set_aside()

    def take_problems(self) -> list[str]:
        """What went wrong since the last call (for the log), oldest first."""
        out, self.problems = self.problems, []
        return out

    # -- internals ------------------------------------------------------------------

    def _scan(self) -> list[tuple[str, int]]:
        """(name, size) of every spooled verdict, oldest first. Anything else named
        *.json is set aside first, from the directory entry alone (lstat: nothing is
        opened or followed)."""
        listed: list[tuple[str, os.stat_result]] = []
        with os.scandir(self.dir) as entries:
            for e in entries:
                if not e.name.endswith(_SUFFIX) or e.name.startswith(_TMP_PREFIX):
                    continue
                if e.name in self._unmovable or e.name in self._foreign:
                    continue
                if not _NAME.fullmatch(e.name):
                    # not the spool's: never read, moved or deleted (nor counted)
                    if len(self._foreign) < _MAX_FOREIGN:
                        self._foreign.add(e.name)
                        self._problem(f"spool entry {e.name} left alone: not a name the "
                                      "spool writes (it reads, moves and deletes only its "
                                      "own files)")
                    continue
                try:
                    listed.append((e.name, e.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue
        good: list[tuple[str, int]] = []
        moved = False
        for name, st in listed:  # renamed after the listing: readdir is not disturbed
            why = _not_a_verdict(st, self.max_file_bytes)
            if why:
                moved |= self._set_aside_corrupt(name, why)
            else:
                good.append((name, st.st_size))
        if moved:
            self._prune_set_aside()
        good.sort()
        return good

    def _read(self, name: str) -> tuple[bytes, os.stat_result]:
        # O_NOFOLLOW: a symlink swapped in since the listing fails (ELOOP), never read;
        # O_NONBLOCK: a FIFO swapped in cannot block the daemon (fstat refuses it next)
        fd = os.open(self.dir / name,
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            why = _not_a_verdict(st, self.max_file_bytes)
            if why:
                raise _SetAside(why)
            chunks, left = [], self.max_file_bytes + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            if left <= 0:
                raise _SetAside(f"grew past {self.max_file_bytes} bytes while read")
            return b"".join(chunks), st
        finally:
            os.close(fd)

    def _set_aside_corrupt(self, name: str, why: str) -> bool:
        if self._rename_aside(name, _CORRUPT_SUFFIX, why):
            self.corrupt += 1
            return True
        return False

    def _rename_aside(self, name: str, suffix: str, why: str) -> bool:
        """NAME -> NAME+suffix (rename never follows a symlink: the link itself moves).
        True when moved; a failure is reported once and the entry is ignored from then
        on, so it is never read or shipped either way."""
        path = self.dir / name
        try:
            os.rename(path, path.with_name(name + suffix))
        except FileNotFoundError:
            return False
        except OSError as e:
            self._unmovable.add(name)
            self._problem(f"spool entry {name} ignored ({why}); could not set it aside: "
                          f"{e.strerror or e}")
            return False
        self._problem(f"spool entry {name} set aside as {name + suffix}: {why}")
        # no fsync: a rename lost in a crash is simply made again at the next listing
        return True

    def _prune_set_aside(self) -> None:
        """Keep the newest set-aside files only: a producer of bad entries must not fill
        the node's disk. Directories are never removed (only renamed)."""
        aside: list[tuple[int, str]] = []
        with os.scandir(self.dir) as entries:
            for e in entries:
                if e.name.endswith((_CORRUPT_SUFFIX, _REJECTED_SUFFIX)) and \
                        _NAME.fullmatch(e.name.rpartition(".")[0]):  # (its own only)
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISDIR(st.st_mode):
                        aside.append((st.st_mtime_ns, e.name))
        aside.sort()
        for _, name in aside[:max(0, len(aside) - _MAX_SET_ASIDE)]:
            (self.dir / name).unlink(missing_ok=True)

    def _problem(self, text: str) -> None:
        self.problems.append(text)
        del self.problems[:-_MAX_PROBLEMS]

    def _next_ns(self) -> int:
        # strictly increasing even when the clock stands still or steps back
        ns = max(time.time_ns(), self._last_ns + 1)
        self._last_ns = ns
        return ns

    def _enforce_bounds(self) -> None:
        entries = self._scan()
        if len(self._known) > len(entries):  # (sent, dropped, or removed by someone)
            listed = {name for name, _ in entries}
            self._known = {k: v for k, v in self._known.items() if k in listed}
        total = sum(size for _, size in entries)
        if (len(entries) > self.max_items or total > self.max_bytes) and \
                self._check_unknown(entries):
            entries = self._scan()  # (without what was set aside)
            total = sum(size for _, size in entries)
        i = 0
        # keep at least the newest verdict even if it alone exceeds the byte bound
        while i < len(entries) - 1 and (len(entries) - i > self.max_items
                                        or total > self.max_bytes):
            (self.dir / entries[i][0]).unlink(missing_ok=True)
            total -= entries[i][1]
            self.dropped += 1
            i += 1
        if i:
            self._fsync_dir()

    def _check_unknown(self, entries: list[tuple[str, int]]) -> bool:
        """Read back (one at a time, bounded) each entry named as a verdict that this
        spool neither wrote nor read: a file planted under such a name must not take a
        real verdict's place. True when one was set aside."""
        moved = False
        for name, _ in entries:
            known = self._known.get(name)
            if known is not None:
                try:
                    if _identity(os.lstat(self.dir / name)) == known:
                        continue
                except OSError:
                    continue  # gone meanwhile
            moved |= self._read_checked(name) is True
        if moved:
            self._prune_set_aside()  # (once: after each of thousands it was quadratic)
        return moved

    def _read_checked(self, name: str) -> tuple[bytes, int] | bool:
        """The entry's bytes and the size of its JSON text; True when it is not a
        readable verdict and was set aside as NAME.corrupt (counted and reported; the
        caller prunes the set-aside files), False when it is gone (sent by someone else,
        or dropped) or could not be moved."""
        try:
            raw, st = self._read(name)
            plain_size = _checked(raw)
        except FileNotFoundError:
            return False
        except (OSError, ValueError, RecursionError, _SetAside) as e:
            # RecursionError: JSON nested deeper than the parser goes
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            return self._set_aside_corrupt(name, f"unreadable: {why}")
        self._known[name] = _identity(st)
        return raw, plain_size

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """Which file a name holds: another one written there since (or this one written
    over) is not the verdict the spool wrote or read (ctime: a write cannot set it back,
    as utime can set back the mtime)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _not_a_verdict(st: os.stat_result, max_bytes: int) -> str | None:
    """Why an entry named as a verdict (_scan takes no other) with (l)stat ``st`` is not
    one, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link (never followed)"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size > max_bytes:
        return f"{st.st_size} bytes: more than the {max_bytes} a verdict may have"
    return None


def _checked(raw: bytes) -> int:
    """The size of a spooled verdict's JSON text; ValueError when it is not one. A gzip
    file (what put() writes) is inflated and dropped as it goes: its CRC-32 and length
    prove it is what was written, so its text is not parsed (150 MB for a 21 MB verdict);
    it must still be one JSON object (first and last byte). A plain file of the previous
    version (at most 4 MiB) has no checksum: it is parsed whole, as it was."""
    if gz.is_gzip(raw):
        size, first, last = gz.check(raw, MAX_PLAIN_BYTES)
        if (first, last) != (b"{", b"}"):
            raise ValueError("not a spooled verdict (not a JSON object)")
        return size
    doc = json.loads(raw)
    if not isinstance(doc, dict) or not doc.get(IDEMPOTENCY_KEY):
        raise ValueError("not a spooled verdict")
    return len(raw)


def json_chunks(doc: dict[str, Any]) -> Iterator[bytes]:
    """json.dumps(doc, separators=(",", ":"), sort_keys=True).encode(), in pieces: a
    top-level list (a verdict's findings, its LB IPs) an element at a time."""
    yield b"{"
    for i, k in enumerate(sorted(doc)):
        head = ("," if i else "") + json.dumps(k) + ":"
        value = doc[k]
        if isinstance(value, list) and value:
            yield (head + "[").encode()
            for j, item in enumerate(value):
                yield (("," if j else "") + _dumps(item)).encode()
            yield b"]"
        else:
            yield (head + _dumps(value)).encode()
    yield b"}"


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _file_key(key: str) -> str:
    """The key as it appears in the file name: itself when it is a safe name part (a
    UUID), else a digest of it (the document keeps the key itself)."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", key):
        return key
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a signal, a file size limit, a full disk):
    write the rest until done, or raise."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # not seen from Linux for regular files; never loop forever on it
            raise OSError(0, "write made no progress")
        view = view[n:]
