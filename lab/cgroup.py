"""A memory cgroup of the tests' own, below the one they run in: the container an agent
runs in on a node, with its memory limit, so that the kernel's out-of-memory killer does
what it does there. cgroup v1 (memory controller) or v2 (memory in the parent's
subtree_control). Unique names, removed on exit even when the test fails; nothing outside
the cgroup made here is changed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from agent.probes import memory_limit
from lab.netns import unique_name


class MemoryCgroup:
    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    def prefix(self) -> list[str]:
        """A command prefix that runs the rest of the command inside this cgroup."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh"]

    def mount(self) -> str:
        """Shell that mounts this cgroup's hierarchy at /sys/fs/cgroup, as a container
        runtime does in a container: for a command under `ip netns exec`, whose fresh
        sysfs has nothing mounted there (its own mount namespace: nothing outside it
        sees the mount)."""
        if self.v2:
            return "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
        return ("mount -t tmpfs cgroups /sys/fs/cgroup && mkdir /sys/fs/cgroup/memory && "
                "mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory")

    def set_limit(self, limit: int) -> None:
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(
            str(limit))

    def peak(self) -> int:
        """The most memory the cgroup's processes held at once (bytes)."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        got = memory_limit.oom_kills_in(self.path)
        if got is None:
            raise OSError(f"{self.path}: no oom_kill count (kernel older than 4.13?)")
        return got


def _parent() -> tuple[Path, bool] | None:
    """The memory cgroup this process is in (as the agent finds its own), if a child can
    be made there."""
    try:
        dirs = memory_limit.own_dirs(Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    for d, v2 in dirs:
        if v2:
            try:
                ok = "memory" in (d / "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
        else:
            ok = (d / "memory.limit_in_bytes").exists()
        if ok and os.access(d, os.W_OK):
            return d, v2
    return None


def why_not() -> str | None:
    """Why no memory cgroup can be made here; None when one can."""
    if os.geteuid() != 0:
        return "needs root (a memory cgroup of its own)"
    if _parent() is None:
        return ("no writable memory cgroup (v1 memory controller, or v2 with memory in "
                "the parent's subtree_control) above this process")
    return None


@contextlib.contextmanager
def memory_cgroup(prefix: str = "lbcg") -> Iterator[MemoryCgroup]:
    got = _parent()
    if got is None:
        raise OSError(why_not())
    parent, v2 = got
    path = parent / unique_name(prefix)
    path.mkdir()
    try:
        yield MemoryCgroup(path, v2)
    finally:
        # a cgroup with processes cannot be removed: stop what the test left in it
        for _ in range(50):
            try:
                pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)
