"""Reading a small file that something else on the machine may replace (a token, a TLS
certificate or key, mounted from a Secret): never blocking on a FIFO, never opening a
device, never reading more than a bound. A leaf: the standard library only."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def read_regular(path: str | Path, limit: int) -> tuple[bytes, os.stat_result]:
    """The file's bytes and its stat, or OSError: not a regular file (checked on the
    path before it is opened, and on the descriptor after: opened without blocking, so a
    FIFO swapped in between cannot hang the caller), or more than ``limit`` bytes."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # (a device is never opened: it may act)
        raise OSError(errno.EINVAL, "not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than {limit}")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"grew past {limit} bytes while read")
    return data, st
