"""The agent's own memory cgroup: its limit and its out-of-memory kill count.

A child the agent runs (`nft list ruleset` of a 10k-service node needs ~370 MB) is charged
to the agent's container. When it passes the container's limit, the kernel kills it
(run_command makes the child the first victim), and the verdict should say that it was
memory, how much the container may use, and not "exited -9". Read from /proc/self/cgroup
and /sys/fs/cgroup, cgroup v2 or v1; None where they do not say (no cgroup, no limit).
"""

from __future__ import annotations

import functools
from pathlib import Path

from agent.numbers import is_number

ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # v1 prints "no limit" as a page-rounded LONG_MAX; v2 prints "max"


def own_dirs(proc_cgroup: str) -> list[tuple[Path, bool]]:
    """The directories that may hold this process's memory files, most specific first,
    each with whether it is cgroup v2's: its path under the v2 or the v1 memory
    hierarchy, then the mount's root (a container with its own cgroup namespace, or a v1
    container whose runtime mounts its own cgroup there, sees it at the root)."""
    dirs: list[tuple[Path, bool]] = []
    for line in proc_cgroup.splitlines():
        hid, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if hid == "0" and controllers == "":
            dirs += [(ROOT / rel, True), (ROOT, True)]
        elif "memory" in controllers.split(","):
            dirs += [(ROOT / "memory" / rel, False), (ROOT / "memory", False)]
    return dirs


@functools.cache
def _dirs() -> tuple[Path, ...]:
    """own_dirs of this process, read once (run_command asks before every command; a
    process stays in its cgroup)."""
    try:
        return tuple(d for d, _ in own_dirs(Path("/proc/self/cgroup").read_text()))
    except OSError:
        return ()


def _read(d: Path, name: str) -> str | None:
    try:
        return (d / name).read_text()
    except OSError:
        return None


def limit_bytes() -> int | None:
    """The memory this process's cgroup may use; None: no limit, or not known."""
    for d in _dirs():
        for name in ("memory.max", "memory.limit_in_bytes"):
            text = _read(d, name)
            if text is None:
                continue
            text = text.strip()
            if text == "max" or not is_number(text) or int(text) >= _NO_LIMIT:
                return None
            return int(text)
    return None


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's cgroup;
    None when not known."""
    for d in _dirs():
        got = oom_kills_in(d)
        if got is not None:
            return got
    return None


def oom_kills_in(d: Path) -> int | None:
    """The OOM kill count of cgroup directory ``d`` (v2 memory.events, v1
    memory.oom_control since Linux 4.13); None when it has none."""
    for name in ("memory.events", "memory.oom_control"):
        text = _read(d, name)
        if text is None:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and is_number(value.strip()):
                return int(value)
    return None


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
