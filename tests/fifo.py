"""A FIFO with a writer blocked in open(): what shows that a reader never opened it."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def blocked_writer(fifo: Path) -> Iterator[threading.Event]:
    """Make the FIFO ``fifo`` with a writer blocked in open(); the event is set once
    anyone opens it for reading (a reader that reads a file's type first never does)."""
    os.mkfifo(fifo)
    released = threading.Event()

    def writer() -> None:
        with open(fifo, "wb"):  # blocks until someone opens the FIFO for reading
            released.set()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        yield released
    finally:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # (lets the writer go)
        t.join(5)
