"""Reading a file someone else controls (a bundle's, a pasted one, kube-proxy's config
on the node): never blocking (a FIFO, a device), bounded, UTF-8 text or an InputError
naming the file (and the line of a bad byte)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.errors import InputError


def read_text_file(file: Path, name: str, limit: int, follow: bool = False) -> str:
    """The file as UTF-8 text; a read failure, a file that is not regular (a FIFO, a
    device: opened without blocking, never read), more than ``limit`` bytes or a bad byte
    is an InputError."""
    nofollow = 0 if follow else getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | nofollow)
    except OSError as e:
        raise InputError(name, None, f"cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(name, None, "not a regular file")
        if st.st_size > limit:
            raise InputError(name, None, f"{st.st_size} bytes: larger than {_size(limit)}")
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            data = fh.read(limit + 1)
    except OSError as e:
        raise InputError(name, None, f"cannot read: {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:  # (grown since fstat, or a size the kernel does not give)
        raise InputError(name, None, f"larger than {_size(limit)}")
    return decode_text(data, name)


def decode_text(data: bytes, name: str) -> str:
    """``data`` as UTF-8 text (CRLF line ends as LF); a bad byte is an InputError naming
    its line and column."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputError(name, line,
                         f"not UTF-8 text (byte 0x{data[e.start]:02x} at column {column})"
                         ) from None
    # a test for "\r" (memchr) before the replace, which scans 20x slower
    return text.replace("\r\n", "\n") if "\r" in text else text


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"
