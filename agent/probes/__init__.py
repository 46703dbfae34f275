"""Probes read the live node into a NodeSnapshot; they never write to it.

One module per source, each registering one ``Probe`` at import (see ``base``).
``collect_live`` runs them all; a probe that raises becomes an ``Unknown``, so a
broken source never takes the verdict down with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from agent.probes import (  # noqa: F401  (imported for their registration)
    addresses,
    ipsets,
    ipvs,
    kube_api,
    kube_proxy,
    kube_proxy_metrics,
    local_table,
    nat_rules,
    nft_rules,
    sysctls,
)
from agent.probes.base import REGISTRY, Probe, ProbeContext, ProbeResult, register
from agent.snapshot import NodeSnapshot, Unknown

__all__ = ["REGISTRY", "Probe", "ProbeContext", "ProbeResult", "ProbeRun", "collect_live",
           "register", "run_probes"]


@dataclass(frozen=True)
class ProbeRun:
    """One probe's outcome and how long it took (for logs and metrics)."""

    probe: Probe
    result: ProbeResult
    seconds: float


def _run_one(probe: Probe, ctx: ProbeContext) -> ProbeResult:
    try:
        result = probe.collect(ctx)
        if not isinstance(result, ProbeResult):
            raise TypeError(f"returned {type(result).__name__}, not ProbeResult")
        if len(probe.fields) > 1 and result.value is not None and (
                not isinstance(result.value, tuple) or len(result.value) != len(probe.fields)):
            raise TypeError(f"must return a {len(probe.fields)}-tuple for {probe.fields}")
        return result
    except Exception as exc:  # a probe never raises into the verdict path
        return ProbeResult(None, (Unknown(probe.name, f"probe failed: {exc}"),))


def run_probes(ctx: ProbeContext) -> list[ProbeRun]:
    """Run every registered probe in registration order, timing each."""
    runs = []
    for probe in list(REGISTRY):
        start = time.monotonic()
        result = _run_one(probe, ctx)
        runs.append(ProbeRun(probe, result, time.monotonic() - start))
    return runs


def snapshot_from_runs(runs: list[ProbeRun], node: str | None) -> NodeSnapshot:
    values: dict[str, object] = {}
    unknowns: list[Unknown] = []
    for run in runs:
        fields = run.probe.fields
        value = run.result.value
        if len(fields) == 1:
            values[fields[0]] = value
        else:
            parts = value if isinstance(value, tuple) else (None,) * len(fields)
            values.update(zip(fields, parts, strict=True))
        unknowns.extend(run.result.unknowns)
    return NodeSnapshot(node=node, origin="live", unknowns=tuple(unknowns),
                        **values)  # type: ignore[arg-type]


def collect_live(ctx: ProbeContext) -> NodeSnapshot:
    """Read this node with every probe: the snapshot the verdict is computed from."""
    return snapshot_from_runs(run_probes(ctx), ctx.node_name)
