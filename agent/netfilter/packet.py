"""The walk contract every backend keeps: the packet walked, the steps that acted on it
and how a hook ended for it. The iptables walker (agent.netfilter.walk, also the rules
IPVS mode writes) and the nftables one (agent.netfilter.nft_walk) both take a
:class:`Packet` and give :class:`HookResult`s, so one path finder
(agent.diagnose.paths) follows a pod's packet through any kube-proxy mode.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

from agent.netfilter.assumption import Assumption
from agent.parse.ip_text import ip_number, ip_span

# the netfilter hooks a walk passes, by nftables' names
Hook = Literal["prerouting", "input", "forward", "output", "postrouting"]
# how a hook ended for one path: ACCEPT DROP REJECT DNAT REDIRECT SNAT MASQUERADE UNKNOWN
# (strings, not an enum: one is made for every path of every LB IP's walk)
DROPPED = ("DROP", "REJECT")
# At most this many paths through one hook, in every walker: past it the paths not
# followed end UNKNOWN, said. kube-proxy's random endpoint choice forks once per endpoint
# (a Service of 1,000 endpoints is 1,000 paths, each a few rules); a fact the input lacks
# doubles the paths after it, so this also bounds a walk over many undecided matches.
MAX_PATHS = 4096
# At most this many rules evaluated in one walk of one hook: chains that jump twice each to
# the next visit 2**depth rules without forking (a 1.6 KB paste of 16 levels).
MAX_RULES = 200_000
# prefixes and ranges a hook's rules may name for its walks to be shared (ToldApart: each
# is tested against every packet)
MAX_TOLD_SPANS = 64
REWRITTEN = ("DNAT", "REDIRECT")
SOURCE_NAT = ("MASQUERADE", "SNAT")


class Packet(NamedTuple):
    """The packet being walked (a transient value: NamedTuple for cheap copies; the
    iptables walker builds some by position, so new fields go at the end)."""

    src: str
    dst: str
    proto: str = "tcp"
    sport: int = 45678
    dport: int = 80
    in_iface: str | None = None
    out_iface: str | None = None
    mark: int = 0
    ctmark: int = 0
    orig_dst: str | None = None  # set once DNAT happened
    orig_dport: int | None = None
    src_known: bool = True  # False: src stands for a pod whose address is not known
    # the source is a pod whose exact address is unknown but lies in this prefix (the
    # cluster CIDR kube-proxy's own rules name): matches decide when the prefix does
    src_within: str | None = None
    src_is_pod: bool = False  # a pod address is never a local address of the node
    dnat_to: str | None = None  # "ip:port" once DNATed (nftables' walk)
    snat: str | None = None  # "masquerade" | address once source-NATed (nftables' walk)
    untracked: bool = False  # `notrack`: conntrack skips it, so every nat chain does

    @property
    def v6(self) -> bool:
        """An IPv6 packet (its destination says the family)."""
        return ":" in self.dst

    def describe(self) -> str:
        src = self.src if self.src_known else (
            f"(a pod of this node{', in ' + self.src_within if self.src_within else ''})")
        if ":" in self.dst:  # IPv6: "[addr]:port"
            src = f"[{src}]" if self.src_known else src
            s = f"{self.proto} {src}:{self.sport} -> [{self.dst}]:{self.dport}"
        else:
            s = f"{self.proto} {src}:{self.sport} -> {self.dst}:{self.dport}"
        if self.in_iface:
            s += f" in {self.in_iface}"
        if self.out_iface:
            s += f" out {self.out_iface}"
        if self.mark:
            s += f" mark {self.mark:#x}"
        return s


class WalkStep(Protocol):
    """One rule that acted on the packet (evidence), in either walker's form."""

    @property
    def assumptions(self) -> tuple[Assumption, ...]: ...

    def render(self) -> str: ...

    def shape(self) -> str:
        """The step with what differs from one Service to the next left out."""
        ...


class HookResult(NamedTuple):
    """How one path through a hook ended (a transient value: one per path of a walk)."""

    verdict: str  # ACCEPT DROP REJECT DNAT REDIRECT SNAT MASQUERADE UNKNOWN
    packet: Packet
    steps: tuple[WalkStep, ...]
    detail: str = ""

    @property
    def assumed(self) -> tuple[Assumption, ...]:
        """The facts this path took without the input (a match it could not decide)."""
        return tuple(a for s in self.steps for a in s.assumptions)


class Backend(Protocol):
    """One kube-proxy mode's rules, as a path finder walks them."""

    def walk_hook(self, hook: Hook, pkt: Packet) -> list[HookResult]:
        """Every path of ``pkt`` through ``hook``."""
        ...


class ToldApart:
    """The destinations a hook's rules compare a packet's with (addresses, prefixes,
    ranges), as a walker reads them: a DNATed packet to an address none of them holds
    is treated as any other such packet is, and each walker shares its walk (the
    nftables forward hook, iptables FORWARD and POSTROUTING)."""

    __slots__ = ("by_type", "exact", "spans")

    def __init__(self) -> None:
        self.exact: set[tuple[int, int]] = set()
        self.spans: list[tuple[int, int, int]] = []
        self.by_type = False  # a rule asks the address's type (local, ...): it splits too

    def add(self, pattern: str) -> None:
        """An address, prefix or range a rule names; text that is none is left out (a
        rule answers it alike for every address)."""
        try:
            version, lo, hi = ip_span(pattern)
        except ValueError:
            return
        if lo == hi:
            self.exact.add((version, lo))
        else:
            self.spans.append((version, lo, hi))

    @property
    def crowded(self) -> bool:
        """More spans than MAX_TOLD_SPANS (each asked of every packet): not worth it."""
        return len(self.spans) > MAX_TOLD_SPANS

    def holds(self, addr: str) -> bool:
        """Whether a rule may treat ``addr`` unlike another address (not one to key on)."""
        got = ip_number(addr)
        if got is None:
            return True
        version, n = got
        return got in self.exact or any(v == version and lo <= n <= hi
                                        for v, lo, hi in self.spans)
