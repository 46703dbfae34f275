"""kube-proxy's nftables mode: the ruleset, as `nft list ruleset` prints it, read when
netlink (or `nft -j list tables`) shows a kube-proxy table. The text listing, not the JSON
one (`nft -j`): the same rules (tests/test_lab.py reads a kernel's both ways), read
by the reader of pasted listings, and nft needs far less memory to print it. On a node of
10k services in nftables mode, nft's own peak was 370 MB for the text and 834 MB for the
JSON (libjansson builds the whole document before printing it), all charged to the
agent's container: see agent.probes.memory_limit for what the verdict says when the
kernel kills it. The whole ruleset, not only kube-proxy's table: other tables on
the same hooks decide too (a CNI's own nft masquerade, flannel's `ip flannel-ipv4`;
firewalld's `inet firewalld`), and reading kube-proxy's alone made a masqueraded pod
look unmasqueraded.

Read only when nf_tables is in the kernel (asking nfnetlink for a missing subsystem makes
the kernel load it). Whether a kube-proxy table exists is asked of netlink (a table dump
lists no rule): `nft -j list tables` fetches the whole ruleset first, and on an
iptables-nft node of 10k services that overran 10 s every cycle. The ruleset is read again
only when the nftables generation moves (agent.probes.markers). No table: not this mode,
nothing to say. No `nft` command: said, as the rules of an nftables-mode node cannot be
read without it.
"""

from __future__ import annotations

import re
import time

from agent.netfilter import nft_read
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
    unavailable,
)
from agent.probes.nat_rules import BUDGET_FLOOR, Overrun, read_budget
from agent.snapshot import NftDump, Unknown

SOURCE = "nft rules"
TABLES = ("nft", "-j", "list", "tables")
COMMAND = ("nft", "list", "ruleset")
NO_NFT = ("nft: command not found: kube-proxy's nftables mode (table ip kube-proxy) cannot "
          "be read; install nftables or give `nft list ruleset` output")
# {"table": {"family": "ip", "name": "kube-proxy", ...}} as nft -j prints it
_KUBE_PROXY = re.compile(r'"table":\s*\{\s*"family":\s*"ip6?",\s*"name":\s*"kube-proxy"')


def kube_proxy_table() -> bool | None:
    """Is there an `ip` or `ip6` table named kube-proxy? None when netlink cannot say."""
    try:
        return any("kube-proxy" in markers.nft_table_uses(family)
                   for family in (markers.NFPROTO_IPV4, markers.NFPROTO_IPV6))
    except OSError:
        return None


def read_table(timeout: float, has_table: bool | None = None,
               background: bool = False) -> str | None:
    """The ruleset as `nft list ruleset` prints it, or None when no kube-proxy table is
    in it (iptables or IPVS mode: their rulesets can be big, and are not read twice).
    ``has_table``: what netlink said; None asks nft. ``timeout``: at least this; more as
    the node's tables hold more (nat_rules.read_budget: listing a 10k-service nftables
    node took 13-16 s, and a fixed 10 s made that node "unknown"). Raises CommandTimeout
    naming the budget and what it was sized on, CommandKilled when nft died (of the
    container's memory limit, most often)."""
    budget = read_budget("nft", timeout, family=0)
    deadline = time.monotonic() + budget.seconds

    def run(cmd: tuple[str, ...], seconds: float) -> str:
        try:
            return run_command(list(cmd), seconds, background)
        except CommandTimeout:
            raise CommandTimeout(str(Overrun("nft", " ".join(cmd), budget, background)),
                                 budget.seconds) from None

    if has_table is None:
        if not _KUBE_PROXY.search(run(TABLES, budget.seconds)):
            return None
    elif not has_table:
        return None
    # (a second at least for the listing when asking for the tables took the budget)
    return run(COMMAND, max(deadline - time.monotonic(), min(1.0, budget.seconds)))


def collect(ctx: ProbeContext) -> ProbeResult:
    if not kernel_module_present("nf_tables"):
        return ProbeResult(None)
    return cached(ctx, SOURCE, lambda: ("nft", markers.nft_generation()),
                  lambda: _collect(ctx))


def _collect(ctx: ProbeContext) -> ProbeResult:
    nft_read.forget()  # (the rules changed, or this is the first read)
    try:
        text = read_table(max(ctx.timeout, BUDGET_FLOOR), kube_proxy_table(), ctx.background)
    except CommandKilled as exc:
        # (an out-of-memory kill repeats while the rules stay as they are: not every
        # cycle; any other death is tried again next cycle)
        return ProbeResult(None, (Unknown(SOURCE, str(exc)),), repeats=bool(exc.oom))
    except CommandError as exc:
        if "command not found" in str(exc):
            return unavailable(SOURCE, NO_NFT)
        return unavailable(SOURCE, str(exc))
    if text is None:
        return ProbeResult(None)
    return ProbeResult((NftDump("text", text, " ".join(COMMAND)),))


PROBE = register(Probe(name=SOURCE, field="nft", collect=collect))
