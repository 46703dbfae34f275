"""Reading a file someone else controls (a bundle's, a pasted one, kube-proxy's config
on the node): never blocking (a FIFO, a device), bounded, UTF-8 text or an InputError
naming the file (and the line of a bad byte)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from agent.errors import InputError


class UnreadableInput(InputError):
    """The file cannot be read at all (missing, not permitted, not a regular file), as
    opposed to read and found bad."""


def read_text_file(file: Path, name: str, limit: int, follow: bool = False) -> str:
    """The file as UTF-8 text; a read failure, a file that is not regular (a FIFO, a
    device, a directory: never opened for reading), more than ``limit`` bytes or a bad
    byte is an InputError (UnreadableInput for the first two)."""
    nofollow = 0 if follow else getattr(os, "O_NOFOLLOW", 0)
    flags = os.O_RDONLY | os.O_NONBLOCK | nofollow | getattr(os, "O_CLOEXEC", 0)
    o_path = getattr(os, "O_PATH", 0)
    try:
        # O_PATH first (Linux): the file's type is known before it is opened for reading
        # (opening a device may act: a watchdog arms, a tape rewinds); the read then
        # reopens that very file through /proc/self/fd, so nothing swapped in between
        # is read. Elsewhere (no O_PATH): opened without blocking, then fstat.
        where = os.open(file, (o_path | nofollow | os.O_CLOEXEC) if o_path else flags)
    except OSError as e:
        raise UnreadableInput(name, None, f"cannot read: {e.strerror or e}") from None
    fd = -1
    try:
        st = os.fstat(where)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableInput(name, None, "not a regular file")
        # (opened before its size is judged: one that may not be read says so, not "too big")
        fd = _reopened(where, file, flags, st) if o_path else os.dup(where)
        if st.st_size > limit:
            raise InputError(name, None, f"{st.st_size} bytes: larger than {_size(limit)}")
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            data = fh.read(limit + 1)
    except OSError as e:
        raise UnreadableInput(name, None, f"cannot read: {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(where)
    if len(data) > limit:  # (grown since fstat, or a size the kernel does not give)
        raise InputError(name, None, f"larger than {_size(limit)}")
    return decode_text(data, name)


def _reopened(where: int, file: Path, flags: int, st: os.stat_result) -> int:
    """The O_PATH descriptor's file opened for reading: through /proc/self/fd, or, with
    no /proc (a chroot, a rescue shell), by its path again, if that is still the file
    whose type was read (the same device and inode), else an OSError."""
    try:
        return os.open(f"/proc/self/fd/{where}", flags & ~os.O_NOFOLLOW)
    except FileNotFoundError:
        pass
    fd = os.open(file, flags)
    again = os.fstat(fd)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise OSError(errno.ESTALE, "replaced while it was read")
    return fd


def decode_text(data: bytes, name: str) -> str:
    """``data`` as text (CRLF line ends as LF): UTF-8, with or without a byte order mark,
    or UTF-16 that starts with one (what Windows PowerShell 5's `>` writes: a ticket's
    `kubectl get svc -A -o yaml > svc.yaml` arrives so); a bad byte is an InputError
    naming its line and column."""
    codec, skip = "utf-8", 0
    if data.startswith(_UTF8_BOM):
        skip = len(_UTF8_BOM)  # (a BOM kept would glue itself to the first line's word)
    elif data.startswith((b"\xff\xfe", b"\xfe\xff")):
        codec = "utf-16"  # (the codec reads the BOM for the byte order and drops it)
    try:
        text = data[skip:].decode(codec) if skip else data.decode(codec)
    except UnicodeDecodeError as e:
        start = e.start + skip
        if codec == "utf-8":
            line = data.count(b"\n", 0, start) + 1
            column = start - (data.rfind(b"\n", 0, start) + 1) + 1
        else:  # (offsets in UTF-16 units: the text before the bad unit, decoded)
            before = data[:start - start % 2].decode(codec, "replace")
            line = before.count("\n") + 1
            column = len(before) - (before.rfind("\n") + 1) + 1
        bad = f"byte 0x{data[start]:02x}" if codec == "utf-8" else \
            "a lone surrogate or a cut unit"
        raise InputError(name, line, f"not {'UTF-8' if codec == 'utf-8' else 'UTF-16'} "
                         f"text ({bad} at column {column})") from None
    # a test for "\r" (memchr) before the replace, which scans 20x slower
    return text.replace("\r\n", "\n") if "\r" in text else text


_UTF8_BOM = b"\xef\xbb\xbf"


def replaced(text: str, chars: tuple[str, ...], by: str) -> str:
    """``text`` with each of ``chars`` (non-ASCII ones) replaced by ``by``: the same
    object when it holds none. A search and a replace per character, where translate()
    costs 50 ns a character: 0.9 s on a 10k-service dump holding one accented letter."""
    if text.isascii():  # (O(1): the string's kind)
        return text
    for c in chars:
        if c in text:
            text = text.replace(c, by)
    return text


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"
