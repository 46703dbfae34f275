"""An nftables ruleset as the walk needs it: tables, base chains with hook/priority/policy,
rules as statement tokens, sets and maps with their elements.

Both readers (nft_text: `nft list ruleset`/`nft list table`/`nft -f` scripts; nft_json:
`nft -j list ...`) produce this model; rules keep nft's own words (the JSON reader renders
its expressions the way `nft list` prints them), so one evaluator serves both and the
evidence quotes rules as nft shows them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TypeAlias

from agent.quick_init import quick_init

# nft's priority names (netfilter's NF_IP_PRI_*): "dstnat - 10" is -110
PRIORITY_NAMES = {"raw": -300, "mangle": -150, "dstnat": -100, "filter": 0, "security": 50,
                  "srcnat": 100, "out": 100}
HOOKS = ("prerouting", "input", "forward", "output", "postrouting", "ingress")

# Hostile input bounds: a real kube-proxy table of 10k services has ~100k rules.
MAX_LINES = 2_000_000
# kube-proxy writes one rule per Service that lists every endpoint (`numgen random mod N
# vmap { 0 : goto endpoint-..., ... }`, four tokens each): 4096 refused a Service of 1,000
MAX_TOKENS_PER_RULE = 1 << 16
MAX_ELEMENTS = 2_000_000

# A word of a rule as nft prints it (quoted strings keep their quotes), or a brace group of
# them as a nested tuple: "tcp dport { 80, 443 } accept" is
# ("tcp", "dport", ("80", ",", "443"), "accept")
Token: TypeAlias = "str | tuple[Token, ...]"
# a set or map element: (key parts, value or None), see NftSet
Element: TypeAlias = tuple[tuple[str, ...], str | None]


class NftError(ValueError):
    """An nft dump that cannot be read; names the file and line."""

    def __init__(self, source: str, line: int | None, why: str) -> None:
        self.source, self.line, self.why = source, line, why
        super().__init__(f"{source}:{line}: {why}" if line else f"{source}: {why}")


@quick_init
@dataclass(frozen=True, slots=True)
class NftRule:
    tokens: tuple[Token, ...]
    text: str  # as nft prints it (evidence)
    source: str  # "file:line"


@quick_init  # (40k chains at 10k services)
@dataclass(frozen=True, slots=True)
class NftChain:
    name: str
    type: str | None = None  # "filter" | "nat" | "route" for a base chain
    hook: str | None = None
    priority: int | None = None
    policy: str = "accept"
    rules: tuple[NftRule, ...] = ()

    @property
    def base(self) -> bool:
        return self.hook is not None


@dataclass(frozen=True, slots=True)
class NftSet:
    """A named set or map. An element is (key parts, value or None): "1.2.3.4 . tcp . 80 :
    goto x" is (("1.2.3.4", "tcp", "80"), "goto x")."""

    name: str
    is_map: bool
    key_type: str
    elements: tuple[Element, ...] = ()
    comments: tuple[str | None, ...] = ()  # per element, when nft gave one
    dynamic: bool = False  # filled by the datapath (affinity sets): members unknown
    source: str = ""


@dataclass(frozen=True)
class NftTable:
    family: str
    name: str
    chains: tuple[NftChain, ...] = ()
    sets: tuple[NftSet, ...] = ()

    def chain(self, name: str) -> NftChain | None:
        return self._chains.get(name)

    def set(self, name: str) -> NftSet | None:
        return self._sets.get(name)

    @functools.cached_property
    def _chains(self) -> dict[str, NftChain]:
        return {c.name: c for c in self.chains}

    @functools.cached_property
    def _sets(self) -> dict[str, NftSet]:
        return {s.name: s for s in self.sets}


@dataclass(frozen=True, slots=True)
class NftRuleset:
    tables: tuple[NftTable, ...] = ()
    source: str = ""
    notes: tuple[str, ...] = field(default=())  # what was skipped while reading

    def table(self, family: str, name: str) -> NftTable | None:
        return next((t for t in self.tables if t.family == family and t.name == name), None)

    @property
    def kube_proxy(self) -> NftTable | None:
        """kube-proxy's IPv4 table (`ip kube-proxy`)."""
        return self.table("ip", "kube-proxy")

    def kube_proxy_for(self, v6: bool) -> NftTable | None:
        """kube-proxy's table of one family: `ip6 kube-proxy` serves IPv6 addresses (a
        dual-stack node has both, one proxier each)."""
        return self.table("ip6" if v6 else "ip", "kube-proxy")


def parse_priority(text: str) -> int | None:
    """"-110", "dstnat", "dstnat - 10", "filter + 5" -> an int; None if not one."""
    parts = text.replace("+", " + ").replace(" - ", " -- ").split()
    if not parts:
        return None
    total, sign = 0, 1
    for p in parts:
        if p == "+":
            sign = 1
            continue
        if p == "--":
            sign = -1
            continue
        if p in PRIORITY_NAMES:
            total += sign * PRIORITY_NAMES[p]
        else:
            try:
                total += sign * int(p)
            except ValueError:
                return None
        sign = 1
    return total
