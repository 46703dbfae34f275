"""The sysctls that relax or log the martian-source drop, per interface.

Read straight from /proc/sys (no `sysctl` binary needed). Keys are spelled as
`sysctl` prints them, so a bundle's sysctl.txt and a live run compare equal.
"""

from __future__ import annotations

from pathlib import Path

from agent.parse.kernel_name import kernel_name
from agent.probes.base import Probe, ProbeContext, ProbeResult, register
from agent.snapshot import Unknown

PER_INTERFACE = ("accept_local", "rp_filter", "route_localnet", "log_martians")


def sysctl_key(path: Path, root: Path) -> str:
    """/proc/sys/net/ipv4/conf/eth0.100/rp_filter -> net.ipv4.conf.eth0/100.rp_filter.

    `sysctl` turns the path's '/' into '.', and a '.' inside a component (VLAN
    interfaces) into '/', so the key stays unambiguous.
    """
    return kernel_name(".".join(part.replace(".", "/")
                                for part in path.relative_to(root).parts))


def read_sysctls(root: Path = Path("/proc/sys")) -> tuple[dict[str, str], list[Unknown]]:
    values: dict[str, str] = {}
    unknowns: list[Unknown] = []
    paths = [root / "net/ipv4/ip_forward"]
    conf = root / "net/ipv4/conf"
    try:
        interfaces = sorted(p for p in conf.iterdir() if p.is_dir())
    except OSError as exc:
        unknowns.append(Unknown("sysctls", f"cannot list {conf}: {exc.strerror or exc}"))
        interfaces = []
    paths += [iface / name for iface in interfaces for name in PER_INTERFACE]
    for path in paths:
        try:
            values[sysctl_key(path, root)] = path.read_text().strip()
        except FileNotFoundError:
            # An interface that went away during the walk, or an old kernel without
            # this knob: nothing to report either way.
            continue
        except OSError as exc:
            unknowns.append(Unknown("sysctls", f"cannot read {path}: {exc.strerror or exc}"))
    return dict(sorted(values.items())), unknowns


def collect(ctx: ProbeContext) -> ProbeResult:
    values, unknowns = read_sysctls()
    if not values:
        return ProbeResult(None, tuple(unknowns) or (Unknown("sysctls", "nothing readable "
                                                             "under /proc/sys/net/ipv4"),))
    return ProbeResult(values, tuple(unknowns))


def render_sysctl_txt(values: dict[str, str]) -> str:
    """`key = value` lines, sorted: the bundle's sysctl.txt (what `sysctl -a` prints)."""
    return "".join(f"{k} = {v}\n" for k, v in sorted(values.items()))


PROBE = register(Probe(name="sysctls", field="sysctls", collect=collect))
