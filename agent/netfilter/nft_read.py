"""The nftables ruleset of a snapshot: its dumps read once (text or JSON) and merged."""

from __future__ import annotations

from agent.netfilter.nft_json import read_nft_json
from agent.netfilter.nft_model import NftError, NftRuleset, NftTable
from agent.netfilter.nft_text import read_nft_text
from agent.snapshot import NftDump, NodeSnapshot

# the last snapshot's ruleset, by its dumps' identity: prepare() and diagnose() of one
# snapshot (and its IPv6 view, which shares the dumps) read it once. One entry: with
# eight, a daemon whose rules change grew by 67 MiB a change on a 10k-service node
_CACHE: dict[int, tuple[tuple[NftDump, ...], NftRuleset | None, tuple[str, ...]]] = {}


def forget() -> None:
    """Drop the last ruleset: a new listing is being read (the live probe, before it
    runs nft: the old parse need not share the container with nft's peak)."""
    _CACHE.clear()


def read_dump(d: NftDump) -> NftRuleset:
    return read_nft_json(d.text, d.source) if d.format == "json" else \
        read_nft_text(d.text, d.source)


def ruleset_of(snap: NodeSnapshot) -> tuple[NftRuleset | None, tuple[str, ...]]:
    """(the merged ruleset or None, problems met reading it)."""
    dumps = snap.nft
    if not dumps:
        return None, ()
    got = _CACHE.get(id(dumps))
    if got is not None and got[0] is dumps:
        return got[1], got[2]
    _CACHE.clear()  # (first: the last ruleset is freed before this one is made)
    tables: dict[tuple[str, str], NftTable] = {}
    problems: list[str] = []
    for d in dumps:
        try:
            rs = read_dump(d)
        except NftError as e:
            problems.append(str(e))
            continue
        problems += rs.notes
        for t in rs.tables:
            old = tables.get((t.family, t.name))
            # the same table in two dumps (a listing and its JSON): the bigger one
            if old is None or len(t.chains) + len(t.sets) > len(old.chains) + len(old.sets):
                tables[(t.family, t.name)] = t
    rs2 = NftRuleset(tuple(tables.values()), ", ".join(d.source for d in dumps)) \
        if tables else None
    _CACHE[id(dumps)] = (dumps, rs2, tuple(problems))
    return rs2, tuple(problems)
