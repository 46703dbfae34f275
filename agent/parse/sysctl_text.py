"""Read the sysctls that decide the martian-source drop from `sysctl -a` output.

Only ``net.ipv4.ip_forward`` and the per-interface ``accept_local``, ``rp_filter``,
``route_localnet`` and ``log_martians`` are kept. Keys stay exactly as sysctl prints
them: an interface name with a dot is printed with "/" (``eth0/100`` for ``eth0.100``).
"""

from __future__ import annotations

import re

from agent.errors import InputError

_WANTED = frozenset({"accept_local", "rp_filter", "route_localnet", "log_martians"})
# "key = value" (sysctl -a) or "key=value" (sysctl -e / hand-written files).
_LINE = re.compile(r"^([a-z0-9_]+(?:\.[^\s=.]+)+)\s*=\s*(.*)$")
_IPV4_CONF = "net.ipv4.conf."


def parse_sysctls(text: str, source: str = "sysctl.txt") -> dict[str, str]:
    """Key -> value for the wanted keys. Noise lines (e.g. "sysctl: permission denied
    on key ...", which unprivileged `sysctl -a` mixes in) are skipped; a text without
    a single "key = value" line is an error."""
    result: dict[str, str] = {}
    usable = False
    for raw in text.split("\n"):
        m = _LINE.match(raw.strip())
        if not m:
            continue
        usable = True
        key, value = m.group(1), m.group(2).strip()
        if _wanted(key):
            result[key] = value
    if not usable:
        raise InputError(source, None, "no 'key = value' line found (not `sysctl -a` output?)")
    return dict(sorted(result.items()))


def _wanted(key: str) -> bool:
    if key == "net.ipv4.ip_forward":
        return True
    if not key.startswith(_IPV4_CONF):
        return False
    ifname, dot, name = key[len(_IPV4_CONF):].rpartition(".")
    return bool(dot and ifname and name in _WANTED)
