"""How a pod's packet to an LB IP ends, one path at a time, and how the paths of one walk
merge into one answer: the same for every kube-proxy mode (iptables, IPVS, nftables).

A walk forks where the input cannot decide a match (an assumption: which fact, see
agent.netfilter.assumption) or where kube-proxy chooses at random (an endpoint). Merged:

- one end on every path: that end; where paths forked on a fact, each fact is named as
  not deciding it ("either way"); where a path took the standard layout of kube-proxy or
  a CNI for a chain the input does not show, that assumption is named;
- ends that differ, one of them a loop, where a path assumed a fact: undecided, naming the
  fact it hangs on;
- ends that differ, none a loop: the least served one, with the other said beside it;
- ends that differ only over kube-proxy's random choice: the worst, said to be on some
  paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple

from agent.netfilter.assumption import Assumption
from agent.netfilter.packet import WalkStep
from agent.netfilter.shape import shape_id


class Outcome(StrEnum):
    CAPTURED = "captured"  # DNAT or a local address: served inside the node
    MASQUERADED = "masqueraded"  # leaves with the node's address: no loop
    NOT_MASQUERADED = "not-masqueraded"  # leaves with the pod's address: a loop
    DROPPED = "dropped"
    UNKNOWN = "unknown"


# Outcomes that all mean "no loop": paths that end in different ones of these agree.
NO_LOOP = frozenset({Outcome.CAPTURED, Outcome.MASQUERADED, Outcome.DROPPED})
# Ranking when paths disagree: the worst one is reported.
_RANK = {Outcome.NOT_MASQUERADED: 0, Outcome.UNKNOWN: 1, Outcome.DROPPED: 2,
         Outcome.MASQUERADED: 3, Outcome.CAPTURED: 4}


class PathOutcome(NamedTuple):
    """How one path (or, merged, all of them) of a pod's packet ended (a NamedTuple: one is
    made per path of every LB IP's walk)."""

    kind: Outcome
    how: str
    evidence: tuple[str, ...]
    assumptions: tuple[Assumption, ...] = ()  # what the path took without the input
    steps: tuple[WalkStep, ...] = ()  # the rules it took, in order (its shape: see shape_of)


def _rank(o: PathOutcome) -> int:
    return _RANK[o.kind]


def merge(outcomes: Sequence[PathOutcome]) -> PathOutcome:
    if not outcomes:
        return PathOutcome(Outcome.UNKNOWN, "no path", ())
    kinds = {o.kind for o in outcomes}
    # (one kind: min would return the first; the key costs a call per outcome)
    worst = outcomes[0] if len(kinds) == 1 else min(outcomes, key=_rank)
    assumed = [o for o in outcomes if o.assumptions]
    # the facts the walk forked on (every answer followed) before those it took from the
    # standard layout of kube-proxy or a CNI (one answer, the one they write)
    forked = list(dict.fromkeys(a.fact for o in assumed for a in o.assumptions if a.forked))
    layout = list(dict.fromkeys(a.fact for o in assumed for a in o.assumptions
                                if not a.forked and a.fact not in forked))
    facts = forked + layout
    if forked and len(kinds) > 1 and not kinds <= NO_LOOP:
        # the answer depends on a fact the input lacks: name it, decide nothing
        loop = next((o for o in outcomes if o.kind == Outcome.NOT_MASQUERADED), worst)
        return PathOutcome(Outcome.UNKNOWN, "it depends on a fact the input does not show: "
                           + "; ".join(facts[:2]),
                           (*loop.evidence, "the other answer: " + next(
                               (o.how for o in outcomes if o.kind != loop.kind), "")),
                           assumptions=loop.assumptions, steps=loop.steps)
    if assumed:
        notes = tuple(f"either way ({len(outcomes)} paths over what the input does not "
                      f"show): {fact}" for fact in forked) + tuple(
            f"assumed as it is written where the input does not show it: {fact}"
            for fact in layout)
        if len(kinds) > 1 and forked:
            # no loop on any answer, but not the same end (served here on one, dropped on
            # another): say both, claim neither
            shown = worst  # (as a decision would be: the end that is least served)
            other = next(o for o in outcomes if o.kind != shown.kind)
            return PathOutcome(shown.kind, f"{shown.how}; or, depending on a fact the input "
                               f"lacks, {other.kind}: {other.how} (no loop either way)",
                               (*shown.evidence, f"the other answer: {other.how}", *notes),
                               steps=shown.steps)
        said = " (decided without a fact the input lacks: every answer to it leads here)" \
            if forked else " (taking the chains the input does not show as they are " \
            "written: the assumption is in the evidence)"
        if len(kinds) > 1:  # (only kube-proxy's random endpoint choice made them differ)
            said += " (on some of the paths kube-proxy's random endpoint choice can take)"
        return PathOutcome(worst.kind, worst.how + said, (*worst.evidence, *notes),
                           steps=worst.steps)
    if len(kinds) > 1:
        return PathOutcome(worst.kind, worst.how + " (on some of the paths kube-proxy's "
                           "random endpoint choice can take)", worst.evidence,
                           steps=worst.steps)
    return worst


def shape_of(o: PathOutcome) -> str:
    """The name of the way this outcome was reached: its kind and the shapes of the rules
    its path took (agent.netfilter.shape), the same for every LB IP kube-proxy serves with
    the same chains."""
    return shape_id((o.kind.value, *(s.shape() for s in o.steps)))
