"""A command run with a hosts file of the test's as its /etc/hosts: bind-mounted in a mount
namespace of that command's own (`unshare --mount`), so the machine's /etc/hosts and every
other process's view of it stay as they are."""

from __future__ import annotations

from pathlib import Path


def with_hosts(hosts: Path, cmd: list[str]) -> list[str]:
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *cmd]
