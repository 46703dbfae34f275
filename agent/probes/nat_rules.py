"""The iptables rules of the backend (legacy or nft) that holds kube-proxy's chains.

Both backends can hold rules at once (an old component still on legacy, the host
on nft). Like kube-proxy's iptables-wrapper we pick the one kube-proxy/kubelet
wrote to: the one with the KUBE-IPTABLES-HINT / KUBE-KUBELET-CANARY chain, else the
one with more KUBE- chains in nat, else the one with more rules; a tie goes to nft.

Read-only rules:
- legacy is read only when /proc/net/ip_tables_names lists a table, and then with a
  plain `iptables-legacy-save`: with `-t nat` it would *create* the nat table in a
  namespace that has none (loading iptable_nat on a host);
- nft is read only when nf_tables is present (asking nfnetlink for a missing
  subsystem makes the kernel modprobe it);
- no `-w`: iptables 1.8.9's *-save commands reject it ("invalid option -- 'w'"),
  and they do not take the xtables lock anyway (a dump is a read).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from agent.errors import InputError
from agent.netfilter.rules_text import parse_iptables_save
from agent.probes.base import (
    CommandError,
    Probe,
    ProbeContext,
    ProbeResult,
    kernel_module_present,
    register,
    run_command,
)
from agent.snapshot import Netfilter, Unknown

SOURCE = "nat rules"
IP_TABLES_NAMES = Path("/proc/net/ip_tables_names")
NO_BINARY = "unavailable: no iptables-save binary (install iptables)"

_HINT = re.compile(r"^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY)\s", re.M)
_TABLE = re.compile(r"^\*(\S+)", re.M)


@dataclass(frozen=True)
class Dump:
    backend: str  # "legacy" | "nft"
    command: str  # the command that printed ``text``
    text: str


class NatDumpError(RuntimeError):
    """Every backend we tried failed; ``str()`` carries the commands' stderr."""


def _plain_save_mode(timeout: float) -> str | None:
    """"legacy"/"nft" for a plain `iptables-save` (old distros have no -legacy/-nft names)."""
    try:
        version = run_command(["iptables-save", "-V"], timeout)
    except CommandError:
        return None
    return "nft" if "nf_tables" in version else "legacy"


def _commands(timeout: float) -> dict[str, str]:
    """backend -> save command available on this machine."""
    found: dict[str, str] = {}
    for backend in ("legacy", "nft"):
        if shutil.which(f"iptables-{backend}-save"):
            found[backend] = f"iptables-{backend}-save"
    if len(found) < 2 and shutil.which("iptables-save"):
        mode = _plain_save_mode(timeout)
        if mode is not None and mode not in found:
            found[mode] = "iptables-save"
    return found


def legacy_tables_present() -> bool:
    """Does the legacy (x_tables) side hold any table in this network namespace?"""
    try:
        return bool(IP_TABLES_NAMES.read_text().split())
    except OSError:
        # Missing: ip_tables is not loaded, so there are no legacy tables.
        return False


def kube_score(text: str) -> tuple[int, int, int]:
    """(has hint chain, KUBE- chains in nat, rule lines): bigger = kube-proxy's backend."""
    hint = 1 if _HINT.search(text) else 0
    kube_nat = 0
    rules = 0
    table = None
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif line.startswith(":KUBE-") and table == "nat":
            kube_nat += 1
        elif line.startswith(("-A ", "-I ", "[")):
            rules += 1
    return hint, kube_nat, rules


def dump_backends(timeout: float = 10.0) -> tuple[list[Dump], list[str], dict[str, str]]:
    """Dump every backend that may hold rules.

    Returns (dumps, errors, backend -> save command found). A backend with no tables
    at all is not run (see the module docstring for why that matters).
    """
    commands = _commands(timeout)
    dumps: list[Dump] = []
    errors: list[str] = []
    wanted = []
    if "legacy" in commands and legacy_tables_present():
        wanted.append("legacy")
    if "nft" in commands and kernel_module_present("nf_tables"):
        wanted.append("nft")
    for backend in wanted:
        try:
            text = run_command([commands[backend]], timeout)
        except CommandError as exc:
            errors.append(str(exc))
            continue
        dumps.append(Dump(backend, commands[backend], text))
    return dumps, errors, commands


def choose(dumps: list[Dump]) -> Dump:
    """The dump kube-proxy wrote to; a tie goes to nft (the modern default)."""
    return max(dumps, key=lambda d: (*kube_score(d.text), d.backend == "nft"))


def _select(timeout: float) -> tuple[Dump | None, list[str], bool]:
    dumps, errors, commands = dump_backends(timeout)
    if dumps:
        return choose(dumps), errors, True
    if not commands or errors:
        return None, errors, bool(commands)
    # Binaries exist but neither backend holds a table (no legacy tables, nf_tables
    # absent): an empty dump is the truth, and it is what iptables-save prints there.
    backend = "nft" if "nft" in commands else "legacy"
    return Dump(backend, commands[backend], ""), [], True


def select_backend(timeout: float = 10.0) -> tuple[str, str] | None:
    """(backend, raw dump text exactly as printed) of kube-proxy's backend.

    None when no iptables-save binary exists; raises NatDumpError when every dump
    failed. The bundle writer uses this so iptables-save.txt is what the probe read.
    """
    dump, errors, _ = _select(timeout)
    if dump is None:
        if errors:
            raise NatDumpError("; ".join(errors))
        return None
    return dump.backend, dump.text


def collect(ctx: ProbeContext) -> ProbeResult:
    # At least 10 s: a dump of a node with thousands of Services takes seconds, and
    # ctx.timeout is sized for single API requests.
    dump, errors, have_binary = _select(max(ctx.timeout, 10.0))
    if dump is None:
        reason = NO_BINARY if not have_binary else "; ".join(errors)
        return ProbeResult(None, (Unknown(SOURCE, reason),))
    # A failure of the other backend is worth saying even when one dump worked.
    unknowns = tuple(Unknown(SOURCE, f"other backend unreadable: {e}") for e in errors)
    if not _TABLE.search(dump.text):
        # No table at all is a real answer on a live node (the parser rejects it because
        # an empty *file* in a bundle usually means a failed capture).
        return ProbeResult(Netfilter(backend=dump.backend, tables=()), unknowns)
    try:
        netfilter = parse_iptables_save(dump.text, source=dump.command, backend=dump.backend)
    except InputError as exc:
        return ProbeResult(None, (*unknowns, Unknown(SOURCE, f"cannot parse: {exc}")))
    return ProbeResult(netfilter, unknowns)


PROBE = register(Probe(name=SOURCE, field="netfilter", collect=collect))
