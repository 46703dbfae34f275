"""kube-proxy's nftables mode: its table, as `nft -j list table ip kube-proxy` gives it
(libnftables' JSON through the nft command: the structured interface).

Read only when nf_tables is in the kernel (asking nfnetlink for a missing subsystem makes
the kernel load it). No table: not this mode, nothing to say. No `nft` command: said, as
the rules of an nftables-mode node cannot be read without it.
"""

from __future__ import annotations

from agent.probes.base import (
    CommandError,
    Probe,
    ProbeContext,
    ProbeResult,
    kernel_module_present,
    register,
    run_command,
    unavailable,
)
from agent.snapshot import NftDump

SOURCE = "nft rules"
COMMAND = ("nft", "-j", "list", "table", "ip", "kube-proxy")
NO_NFT = ("nft: command not found: kube-proxy's nftables mode (table ip kube-proxy) cannot "
          "be read; install nftables or give `nft list table ip kube-proxy` output")


def read_table(timeout: float) -> str | None:
    """The JSON text, or None when there is no such table."""
    try:
        return run_command(list(COMMAND), timeout)
    except CommandError as exc:
        msg = str(exc)
        if "No such file or directory" in msg or "does not exist" in msg:
            return None
        raise


def collect(ctx: ProbeContext) -> ProbeResult:
    if not kernel_module_present("nf_tables"):
        return ProbeResult(None)
    try:
        text = read_table(max(ctx.timeout, 10.0))
    except CommandError as exc:
        if "command not found" in str(exc):
            return unavailable(SOURCE, NO_NFT)
        return unavailable(SOURCE, str(exc))
    if text is None:
        return ProbeResult(None)
    return ProbeResult((NftDump("json", text, " ".join(COMMAND)),))


PROBE = register(Probe(name=SOURCE, field="nft", collect=collect))
