"""The probe contract: a named, read-only reader of one source on the node.

Like a Prometheus node_exporter collector, each probe module registers one ``Probe``
at import time; ``agent.probes.collect_live`` runs them all. A probe returns facts
(``ProbeResult.value``) or says why it could not (``ProbeResult.unknowns``); it must
never change the node (no iptables/ipset/route/sysctl writes, no module loading).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.snapshot import NodeSnapshot, Unknown


@dataclass(frozen=True)
class ProbeContext:
    """What every probe may need to know about the run (never about the node)."""

    node_name: str | None = None
    use_kube_api: bool = True
    kubeconfig: str | None = None
    timeout: float = 5.0  # seconds, for each subprocess / API request
    # A running agent.kubewatch.KubeInformer (the daemon's): the kube_api probe reads its
    # memory instead of asking the API server every cycle.
    kube_cache: object | None = None


@dataclass(frozen=True)
class ProbeResult:
    """``value`` is None when the source could not be read; ``unknowns`` says why.

    A probe that fills several snapshot fields returns a tuple with one value per
    field (in ``Probe.fields`` order), or None for "none of them could be read".
    """

    value: object | None
    unknowns: tuple[Unknown, ...] = ()


@dataclass(frozen=True)
class Probe:
    name: str  # also the Unknown.source used when the probe crashes
    field: str | tuple[str, ...]  # the NodeSnapshot field(s) it fills
    collect: Callable[[ProbeContext], ProbeResult]

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.field,) if isinstance(self.field, str) else tuple(self.field)


REGISTRY: list[Probe] = []

# Fields a probe may fill: everything in the snapshot except bookkeeping.
_FILLABLE = frozenset(NodeSnapshot.__dataclass_fields__) - {"node", "origin", "unknowns",
                                                            "schema"}


def register(probe: Probe) -> Probe:
    """Add ``probe`` to the registry (once per name: a re-import replaces, not duplicates)."""
    for f in probe.fields:
        if f not in _FILLABLE:
            raise ValueError(f"probe {probe.name!r}: {f!r} is not a NodeSnapshot field")
    for i, existing in enumerate(REGISTRY):
        if existing.name == probe.name:
            REGISTRY[i] = probe
            return probe
        clash = set(existing.fields) & set(probe.fields)
        if clash:
            raise ValueError(f"probe {probe.name!r} and {existing.name!r} both fill "
                             f"{sorted(clash)}")
    REGISTRY.append(probe)
    return probe


def unavailable(source: str, reason: str, fields: int = 1) -> ProbeResult:
    """The usual "could not read" result (``fields`` > 1: a tuple of Nones)."""
    value: object | None = None if fields == 1 else (None,) * fields
    return ProbeResult(value, (Unknown(source, reason),))


# --- helpers shared by probes and the bundle writer ----------------------------------


class CommandError(RuntimeError):
    """A command that could not run or exited non-zero; ``str()`` is fit for a report."""


def run_command(args: Sequence[str], timeout: float) -> str:
    """Run a read-only command, return its stdout exactly as printed.

    Raises CommandError (missing binary, timeout, non-zero exit with its stderr) so
    callers can turn it into an Unknown or a "skipped" line, never a traceback.
    """
    exe = shutil.which(args[0])
    if exe is None:
        raise CommandError(f"{args[0]}: command not found")
    # LC_ALL=C: the tools we call print numbers and keywords the parsers expect only
    # in the C locale.
    env = {**os.environ, "LC_ALL": "C"}
    try:
        proc = subprocess.run([exe, *args[1:]], capture_output=True, text=True,
                              timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CommandError(f"{' '.join(args)}: timed out after {timeout:g}s") from None
    except OSError as exc:
        raise CommandError(f"{' '.join(args)}: {exc}") from None
    if proc.returncode != 0:
        err = proc.stderr.strip() or proc.stdout.strip() or "no output"
        raise CommandError(f"{' '.join(args)} exited {proc.returncode}: {err}")
    return proc.stdout


def kernel_module_present(name: str) -> bool:
    """Is kernel module ``name`` loaded or built in (so using it cannot trigger a load)?

    Asking the kernel for a netlink subsystem or family it does not have makes it
    call modprobe (nfnetlink's "nfnl-subsys-N", genetlink family aliases), which
    would change the node. So probes ask /proc and /sys first:
    - no /proc/modules: a kernel without loadable modules cannot autoload anything,
      so querying is harmless (the feature is built in or absent);
    - listed in /proc/modules: loaded;
    - /sys/module/NAME: loaded, or built in with parameters;
    - listed in modules.builtin: built in.
    """
    modules = Path("/proc/modules")
    if not modules.exists():
        return True
    try:
        for line in modules.read_text().splitlines():
            if line.split(" ", 1)[0] == name:
                return True
    except OSError:
        pass
    if Path("/sys/module", name).exists():
        return True
    try:
        builtin = Path("/lib/modules", os.uname().release, "modules.builtin").read_text()
    except OSError:
        return False
    return any(line.rsplit("/", 1)[-1] in (f"{name}.ko", f"{name.replace('_', '-')}.ko")
               for line in builtin.splitlines())
