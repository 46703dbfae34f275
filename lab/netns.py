"""Network namespaces for the lab and the tests: unique names, guaranteed clean-up.

Nothing here touches the root network namespace except creating and deleting the
namespaces themselves (and veth pairs whose ends are moved into them at once).
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

_counter = itertools.count()
_live: set[str] = set()


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
    _exit_on_termination()
    name = unique_name(prefix)
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    _live.add(name)
    ns = Netns(name)
    ns.run("ip", "link", "set", "lo", "up")
    return ns


def delete(ns: Netns) -> None:
    subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
    _live.discard(ns.name)


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


def _exit_on_termination() -> None:
    """SIGTERM and SIGHUP (a timeout, a closed terminal, CI cancelling a job) end this
    process through SystemExit, so every ``netns`` block's clean-up and the atexit one
    run: by default they killed it where it stood, its namespaces left behind. Only where
    nothing else handles them (pytest, a bench, a script), from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _terminated)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@atexit.register
def _cleanup() -> None:
    for name in list(_live):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    _live.clear()
