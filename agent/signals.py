"""Signals that set threading.Events, without a lock taken in a signal handler.

A Python signal handler runs in the main thread between two bytecodes. One that calls
``Event.set()`` while the main thread is inside that Event's ``wait()`` or ``clear()``
(its Condition's lock held) waits for itself forever: a SIGTERM that hangs the daemon
until the kubelet's SIGKILL. Here the handler does nothing; the interpreter's C handler
writes the signal's number to a pipe (``signal.set_wakeup_fd``) and a thread of ours
reads it and sets the events, taking their locks like any other thread.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: replaces the default action (exit, KeyboardInterrupt);
    the work is done by the thread that reads the wakeup pipe."""


class SignalEvents:
    """While open, each of ``signals`` sets every one of ``events``. Main thread only
    (signal handlers and the wakeup fd can only be set there); ``close`` puts back the
    handlers and the wakeup fd that were there before."""

    def __init__(self, signals: Iterable[signal.Signals], *events: threading.Event) -> None:
        self.signals = tuple(signals)
        self.events = events
        self.received: list[int] = []  # in the order they came
        r, w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(w, False)  # (the C handler must never block)
        self._r, self._w = r, w
        self._old: dict[signal.Signals, Any] = {}
        self._thread: threading.Thread | None = None
        try:
            self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except BaseException:  # (not the main thread: ValueError)
            os.close(r)
            os.close(w)
            raise
        try:
            for s in self.signals:
                self._old[s] = signal.signal(s, _ignore)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._watch, name="signals", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        wanted = {int(s) for s in self.signals}
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:
                return
            if not data:  # the write end is closed: close()
                return
            for n in data:
                if n in wanted:
                    self.received.append(n)
                    for e in self.events:
                        e.set()

    def close(self) -> None:
        """Put back what was there before; a second call does nothing."""
        if self._w < 0:
            return
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._w)  # the thread reads EOF and ends
        self._w = -1
        if self._thread is not None:
            self._thread.join(5)
        os.close(self._r)

    def __enter__(self) -> SignalEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
