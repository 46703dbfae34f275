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

Time: a dump's cost grows with the node (iptables-nft-save 1.8.9 sorts the chains with a
first-element-pivot quicksort: quadratic when the kernel hands them over in name order,
20 s of CPU for 47k chains). So each backend's dump gets a budget sized on what it holds
(``read_budget``, from counts the kernel gives without a dump), in the daemon at the lowest
CPU and I/O priority, and when it overruns the Unknown says which dump, after how long, sized on
what. Then KUBE-SERVICES and the built-in chains are read alone (`iptables-nft -t nat -S
CHAIN` reads one chain: 0.2 s for 20k rules), an excerpt that still gives kube-proxy's
mode and the LB IPs. The daemon re-reads only when ``markers.netfilter_marker`` moved and
``markers.netfilter_content`` (the rules themselves, without handles and counters) did too.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass

from agent.errors import InputError
from agent.netfilter.rules_text import RulesText, parse_iptables_save, read_rules_text, settle
from agent.probes import markers
from agent.probes.base import (
    CommandError,
    CommandKilled,
    CommandTimeout,
    Probe,
    ProbeContext,
    ProbeResult,
    cached,
    kernel_module_present,
    register,
    run_command,
)
from agent.snapshot import Netfilter, Unknown

SOURCE = "nat rules"
SOURCE6 = "ip6tables"  # the IPv6 rules (ip6tables-save), read the same way
NO_BINARY = "unavailable: no iptables-save binary (install iptables)"
NO_BINARY6 = "unavailable: no ip6tables-save binary (install iptables)"

_HINT = re.compile(r"^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY)\s", re.M)
_TABLE = re.compile(r"^\*(\S+)", re.M)


@dataclass(frozen=True)
class Dump:
    backend: str  # "legacy" | "nft"
    command: str  # the command that printed ``text``
    text: str
    seconds: float = 0.0  # how long it took


# A dump's budget: FLOOR + SLACK x the time expected for the node's size, at most CEILING.
# Expected, from tests/bench/live_read.py on 2 shared cores (iptables 1.8.9):
# iptables-nft-save ~1e-8 s x chains^2 (its sort) + 2e-4 s per chain; legacy 2e-6 s a rule.
BUDGET_FLOOR = 10.0
BUDGET_SLACK = 3.0
BUDGET_CEILING = 900.0
NFT_SECONDS_PER_CHAIN_SQUARED = 1e-8
NFT_SECONDS_PER_CHAIN = 2e-4
LEGACY_SECONDS_PER_RULE = 5e-6


@dataclass(frozen=True)
class Budget:
    seconds: float
    sized_on: str  # "47,412 chains and sets in the nft ip tables"


def read_budget(backend: str, floor: float = BUDGET_FLOOR, family: int = 4) -> Budget:
    """How long a dump of ``backend`` may take here, from counts read without a dump
    (nft: each ip/ip6 table's use count; legacy: I(P6)T_SO_GET_INFO's entries).
    ``family`` 0: the ip and ip6 tables together (`nft list ruleset` lists both; measured
    on a 10k-service nftables-mode node, 50k chains: 16 s, within this expectation)."""
    try:
        if backend == "nft":
            families = {4: (markers.NFPROTO_IPV4,), 6: (markers.NFPROTO_IPV6,),
                        0: (markers.NFPROTO_IPV4, markers.NFPROTO_IPV6)}[family]
            n = sum(sum(markers.nft_table_uses(f).values()) for f in families)
            expected = NFT_SECONDS_PER_CHAIN_SQUARED * n * n + NFT_SECONDS_PER_CHAIN * n
            tables = {4: "ip", 6: "ip6", 0: "ip and ip6"}[family]
            what = f"{n:,} chains and sets in the nft {tables} tables"
        else:
            n = sum(markers.legacy_info(t, family).entries
                    for t in markers.legacy_table_names(family))
            expected = LEGACY_SECONDS_PER_RULE * n
            what = f"{n:,} rules in the legacy {'ip6tables ' if family == 6 else ''}tables"
    except (OSError, ValueError):
        return Budget(floor, "the default (the tables' sizes could not be read)")
    return Budget(min(BUDGET_CEILING, floor + BUDGET_SLACK * expected), what)


class NatDumpError(RuntimeError):
    """Every backend we tried failed; ``str()`` carries the commands' stderr."""


def _plain_save_mode(timeout: float, prog: str = "iptables") -> str | None:
    """"legacy"/"nft" for a plain `iptables-save` (old distros have no -legacy/-nft names)."""
    try:
        version = run_command([f"{prog}-save", "-V"], timeout)
    except CommandError:
        return None
    return "nft" if "nf_tables" in version else "legacy"


def _commands(timeout: float, family: int = 4) -> dict[str, str]:
    """backend -> save command available on this machine (ip6tables' for ``family`` 6)."""
    prog = "ip6tables" if family == 6 else "iptables"
    found: dict[str, str] = {}
    for backend in ("legacy", "nft"):
        if shutil.which(f"{prog}-{backend}-save"):
            found[backend] = f"{prog}-{backend}-save"
    if len(found) < 2 and shutil.which(f"{prog}-save"):
        mode = _plain_save_mode(timeout, prog)
        if mode is not None and mode not in found:
            found[mode] = f"{prog}-save"
    return found


def legacy_tables_present(family: int = 4) -> bool:
    """Does the legacy (x_tables) side hold any table in this network namespace?"""
    return bool(markers.legacy_table_names(family))


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


@dataclass(frozen=True)
class Overrun:
    """A dump stopped at its budget, or killed by a signal (its message is then the
    CommandKilled's; ``oom``: the cgroup counted an out-of-memory kill): either way read
    chain by chain instead."""

    backend: str
    command: str
    budget: Budget
    background: bool = False
    oom: bool = False

    def __str__(self) -> str:
        return (f"{self.command} ({self.backend} backend) was stopped after "
                f"{self.budget.seconds:.3g} s, its time budget for {self.budget.sized_on}"
                + (" (at the lowest CPU priority: a busy node slows it)"
                   if self.background else ""))


def dump_backends(timeout: float = BUDGET_FLOOR, background: bool = False, family: int = 4,
                  ) -> tuple[list[Dump], list[str], dict[str, str], list[Overrun]]:
    """Dump every backend that may hold rules, each within its ``read_budget`` (at least
    ``timeout``); ``background``: at the lowest CPU and I/O priority.

    Returns (dumps, errors, backend -> save command found, overruns). A backend with no
    tables at all is not run (see the module docstring for why that matters).
    """
    commands = _commands(timeout, family)
    dumps: list[Dump] = []
    errors: list[str] = []
    overruns: list[Overrun] = []
    wanted = []
    if "legacy" in commands and legacy_tables_present(family):
        wanted.append("legacy")
    if "nft" in commands and kernel_module_present("nf_tables"):
        wanted.append("nft")
    for backend in wanted:
        budget = read_budget(backend, timeout, family)
        start = time.monotonic()
        try:
            text = run_command([commands[backend]], budget.seconds, background=background)
        except CommandTimeout:
            overrun = Overrun(backend, commands[backend], budget, background)
            overruns.append(overrun)
            errors.append(str(overrun))
            continue
        except CommandKilled as exc:
            # (killed: by the container's memory limit, most often; read chain by chain,
            # as an overrun)
            overruns.append(Overrun(backend, commands[backend], budget, background,
                                    oom=bool(exc.oom)))
            errors.append(str(exc))
            continue
        except CommandError as exc:
            errors.append(str(exc))
            continue
        dumps.append(Dump(backend, commands[backend], text, time.monotonic() - start))
    return dumps, errors, commands, overruns


def choose(dumps: list[Dump]) -> Dump:
    """The dump kube-proxy wrote to; a tie goes to nft (the modern default)."""
    return max(dumps, key=lambda d: (*kube_score(d.text), d.backend == "nft"))


@dataclass(frozen=True)
class Selection:
    dump: Dump | None
    errors: list[str]
    have_binary: bool
    overruns: list[Overrun]


def _select(timeout: float, background: bool = False, family: int = 4) -> Selection:
    dumps, errors, commands, overruns = dump_backends(timeout, background, family)
    if dumps:
        best = choose(dumps)
        if not overruns or kube_score(best.text)[:2] != (0, 0):
            return Selection(best, errors, True, overruns)
        # the backend too big to dump in time is kube-proxy's, not the one read without
        # a KUBE- chain (an empty nft next to a legacy node): say what overran
        return Selection(None, errors, True, overruns)
    if not commands or errors:
        return Selection(None, errors, bool(commands), overruns)
    # Binaries exist but neither backend holds a table (no legacy tables, nf_tables
    # absent): an empty dump is the truth, and it is what iptables-save prints there.
    backend = "nft" if "nft" in commands else "legacy"
    return Selection(Dump(backend, commands[backend], ""), [], True, [])


def select_backend(timeout: float = BUDGET_FLOOR, family: int = 4) -> tuple[str, str] | None:
    """(backend, raw dump text exactly as printed) of kube-proxy's backend.

    None when no iptables-save binary exists; raises NatDumpError when every dump
    failed. The bundle writer uses this so iptables-save.txt is what the probe read
    (and ip6tables-save.txt, with ``family`` 6).
    """
    sel = _select(timeout, family=family)
    dump, errors = sel.dump, sel.errors
    if dump is None:
        if errors:
            raise NatDumpError("; ".join(errors))
        return None
    return dump.backend, dump.text


# Chains read one by one when the whole dump overran: where kube-proxy's mode and the
# LB IPs show (KUBE-SERVICES's "loadbalancer IP" rules) and the built-in chains that
# lead there. Each `iptables-nft -t nat -S CHAIN` fetches that chain only.
EXCERPT_TIMEOUT = 10.0  # seconds for each chain (20k rules take 0.2 s)
EXCERPT_CHAINS = ("PREROUTING", "OUTPUT", "POSTROUTING", "KUBE-SERVICES", "KUBE-NODEPORTS",
                  "KUBE-POSTROUTING", "KUBE-MARK-MASQ")


def read_excerpt(backend: str, timeout: float,
                 background: bool = False) -> tuple[Netfilter | None, list[str]]:
    """The nat chains of EXCERPT_CHAINS, read one at a time (nft only: there a chain is
    fetched alone, and the listing opens no xtables lock (traced); legacy's whole dump is
    fast). Only when nft holds an ip nat table; a listing creates nothing (traced in an
    empty namespace, and tests/test_live_read_netns.py: the generation id stays)."""
    if backend != "nft" or "nat" not in markers.nft_table_uses():
        return None, []
    into = RulesText()
    problems: list[str] = []
    for chain in EXCERPT_CHAINS:
        cmd = ["iptables-nft", "-t", "nat", "-S", chain]
        try:
            text = run_command(cmd, timeout, background=background)
        except CommandError as exc:
            if "No chain/target/match by that name" not in str(exc):
                problems.append(str(exc))
            continue
        read_rules_text(text, " ".join(cmd), into, table="nat")
    if not into.rules and not into.chains:
        return None, problems
    nf = settle(into)
    return Netfilter(backend, nf.tables, partial=True), problems


def collect(ctx: ProbeContext) -> ProbeResult:
    return cached(ctx, SOURCE, markers.netfilter_marker, lambda: _collect(ctx),
                  markers.netfilter_content)


def _collect(ctx: ProbeContext) -> ProbeResult:
    # At least 10 s: a dump of a node with thousands of Services takes seconds, and
    # ctx.timeout is sized for single API requests; read_budget scales it to the node.
    sel = _select(max(ctx.timeout, BUDGET_FLOOR), ctx.background)
    dump, errors, have_binary = sel.dump, sel.errors, sel.have_binary
    if dump is None:
        reason = NO_BINARY if not have_binary else "; ".join(errors)
        for overrun in sel.overruns:
            excerpt, problems = read_excerpt(overrun.backend, max(ctx.timeout, EXCERPT_TIMEOUT),
                                             ctx.background)
            if excerpt is not None:
                chains = ", ".join(c.name for t in excerpt.tables for c in t.chains)
                reason += (f"; read instead, one chain at a time: nat {chains} (an "
                           "excerpt: chains it does not show are undecided, not empty)")
                reason += "".join(f"; {p}" for p in problems)
                return ProbeResult(excerpt, (Unknown(SOURCE, reason),))
        # a kill repeats while the rules stay as they are: not every cycle
        return ProbeResult(None, (Unknown(SOURCE, reason),),
                           repeats=any(o.oom for o in sel.overruns))
    return _parsed(SOURCE, dump, errors)


def _parsed(source: str, dump: Dump, errors: list[str]) -> ProbeResult:
    # A failure of the other backend is worth saying even when one dump worked.
    unknowns = tuple(Unknown(source, f"other backend unreadable: {e}") for e in errors)
    if not _TABLE.search(dump.text):
        # No table at all is a real answer on a live node (the parser rejects it because
        # an empty *file* in a bundle usually means a failed capture).
        return ProbeResult(Netfilter(backend=dump.backend, tables=()), unknowns)
    try:
        netfilter = parse_iptables_save(dump.text, source=dump.command, backend=dump.backend)
    except InputError as exc:
        return ProbeResult(None, (*unknowns, Unknown(source, f"cannot parse: {exc}")))
    return ProbeResult(netfilter, unknowns)


PROBE = register(Probe(name=SOURCE, field="netfilter", collect=collect))


# -- the IPv6 rules ----------------------------------------------------------------------


def collect6(ctx: ProbeContext) -> ProbeResult:
    return cached(ctx, SOURCE6, lambda: markers.netfilter_marker(6), lambda: _collect6(ctx),
                  lambda marker: markers.netfilter_content(marker, 6))


def _collect6(ctx: ProbeContext) -> ProbeResult:
    """`ip6tables-save` of the backend kube-proxy writes to, chosen as for IPv4 (no
    chain-by-chain excerpt when it overruns: the IPv6 side says what it could not read)."""
    sel = _select(max(ctx.timeout, BUDGET_FLOOR), ctx.background, family=6)
    dump, errors = sel.dump, sel.errors
    if dump is None:
        reason = NO_BINARY6 if not sel.have_binary else "; ".join(errors)
        return ProbeResult(None, (Unknown(SOURCE6, reason),),
                           repeats=any(o.oom for o in sel.overruns))
    return _parsed(SOURCE6, dump, errors)


PROBE6 = register(Probe(name=SOURCE6, field="ip6tables", collect=collect6))
