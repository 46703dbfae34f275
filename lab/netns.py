"""Network namespaces for the lab and the tests: unique names, guaranteed clean-up.

Nothing here touches the root network namespace except creating and deleting the
namespaces themselves (and veth pairs whose ends are moved into them at once).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

_counter = itertools.count()
_live: dict[str, int] = {}  # name -> the pid that made it (a forked child deletes none)


def unique_name(prefix: str = "lbt") -> str:
    """prefix + pid + counter: parallel runs and repeated builds never collide."""
    return f"{prefix}{os.getpid()}x{next(_counter)}"


class NetnsError(RuntimeError):
    pass


class Netns:
    """A named network namespace; ``run`` executes a command inside it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, *args: str, check: bool = True, input: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = ["ip", "netns", "exec", self.name, *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise NetnsError(f"{' '.join(cmd)} exited {proc.returncode}: "
                             f"{proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def sh(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a shell script inside the namespace (``set -e``)."""
        return self.run("sh", "-ec", script, check=check)

    def popen(self, args: Sequence[str], **kw: object) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *args],  # type: ignore[call-overload]
                                text=True, **kw)

    def __repr__(self) -> str:
        return f"Netns({self.name!r})"


def create(prefix: str = "lbt") -> Netns:
    on_termination(_terminated)
    name = unique_name(prefix)
    _live[name] = os.getpid()  # (before it exists: a signal in between still deletes it)
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    except subprocess.CalledProcessError:  # (not made; interrupted, it may have been)
        _live.pop(name, None)
        raise
    ns = Netns(name)
    ns.run("ip", "link", "set", "lo", "up")
    return ns


def delete(ns: Netns) -> None:
    _delete(ns.name)


def _delete(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    _live.pop(name, None)


@contextmanager
def netns(prefix: str = "lbt") -> Iterator[Netns]:
    """A namespace that is deleted when the block ends, also on error."""
    ns = create(prefix)
    try:
        yield ns
    finally:
        delete(ns)


def veth(a: Netns, a_if: str, b: Netns, b_if: str) -> None:
    """A veth pair with one end in each namespace (created inside ``a``: never in the root)."""
    a.run("ip", "link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", b.name)


# what ends a run from outside: a timeout, a closed terminal, CI cancelling a job
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def on_termination(handler: Callable[[int, object], None]) -> None:
    """``handler`` for TERMINATING where nothing else handles them (the default kills the
    process where it stands), from the main thread only (where handlers can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, handler)


def _terminated(signum: int, _frame: object) -> None:
    """A script or bench ended from outside deletes its namespaces before it dies: by
    default it died where it stood and they stayed (under pytest, tests/conftest.py has
    already set its own handler: the session stops, each test cleaning up)."""
    # a second signal (timeout signals the whole group; CI often sends two) must not cut
    # the clean-up short: ignored by a Python handler (SIG_IGN would pass to children)
    for sig in TERMINATING:
        signal.signal(sig, _ignore)
    _cleanup()
    # then die of the signal, as without this handler (its status says so)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _ignore(_signum: int, _frame: object) -> None:
    pass


@atexit.register
def _cleanup() -> None:
    """Delete the namespaces this process made (not its parent's, in a forked child)."""
    me = os.getpid()
    for name, pid in list(_live.items()):
        if pid == me:
            with contextlib.suppress(Exception):  # (the next one still goes)
                _delete(name)
