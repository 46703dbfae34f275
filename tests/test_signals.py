"""Signals set events from a thread, never from a handler that takes a lock the main
thread may hold (agent.signals): the real signal, the real lock, in a child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# The main thread holds wake's lock, as inside wake.wait() or wake.clear(), when SIGTERM
# comes; the Python-level handler runs in that thread at the next bytecode (the sleep).
_CHILD = r"""
import os, signal, sys, threading, time
from agent.signals import SignalEvents
stop, wake = threading.Event(), threading.Event()
if sys.argv[1] == "handler":  # the way the daemon, the collector and a capture did it
    signal.signal(signal.SIGTERM, lambda *_: (stop.set(), wake.set()))
    signals = None
else:
    signals = SignalEvents((signal.SIGTERM, signal.SIGINT), stop, wake)
with wake._cond:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
assert wake.wait(5) and stop.is_set(), "not set"
if signals is not None:
    assert signals.received == [signal.SIGTERM]
    signals.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd put back too
print("stopped")
"""


def child(how: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, how], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_a_signal_while_the_main_thread_holds_the_event_lock_still_stops() -> None:
    r = child("events", timeout=20)
    assert r.returncode == 0 and r.stdout.strip() == "stopped", r.stderr


def test_the_plain_handler_deadlocks_there() -> None:
    """The control: a handler that sets the event itself waits for its own thread."""
    with pytest.raises(subprocess.TimeoutExpired):
        child("handler", timeout=3)


def test_other_signals_are_left_alone_and_close_restores() -> None:
    code = r"""
import signal, threading
from agent.signals import SignalEvents
before = signal.getsignal(signal.SIGINT)
e = threading.Event()
with SignalEvents((signal.SIGUSR1,), e) as s:
    signal.raise_signal(signal.SIGUSR1)
    assert e.wait(5) and s.received == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGINT) is before
assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
s.close()  # a second close does nothing
import os, threading
def elsewhere():
    try:
        SignalEvents((signal.SIGUSR1,), e)
    except ValueError:
        print("refused off the main thread")
before = len(os.listdir("/proc/self/fd"))
t = threading.Thread(target=elsewhere); t.start(); t.join()
assert len(os.listdir("/proc/self/fd")) == before  # its pipe closed
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=20, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["refused off the main thread", "ok"], r.stdout
