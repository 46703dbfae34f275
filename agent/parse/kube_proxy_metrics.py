"""kube-proxy's sync metrics (its :10249/metrics, Prometheus text format), the few lines
that say whether its rules follow the cluster: the last successful sync, the last change
queued, and its failed writes (pkg/proxy/metrics/metrics.go). A whole page, a
`curl ... | grep sync_proxy_rules` excerpt and a bundle's file read the same way; a line
that is not one of these is skipped, one that is but does not parse is a problem named
by its line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from agent.snapshot import KubeProxySync

LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
LAST_QUEUED = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"
FAILURES = ("kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total")
# what the agent writes above a page it read, so a bundle keeps when it was read
READ_AT = "# loopback-agent read-at: "

_SAMPLE = re.compile(r"^(kubeproxy_[a-z_]+)(?:\{([^}]*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_FAMILY = re.compile(r'ip_family="([^"\\]*)"')


def read_metrics(lines: Iterable[str], source: str, first_line: int = 1
                 ) -> tuple[KubeProxySync | None, list[tuple[int, str]]]:
    """(what the lines say, or None when none is a sync metric; problems by line)."""
    read_at: float | None = None
    # the last value of each metric and family (a grep pasted twice says it twice)
    found: dict[str, dict[str, float]] = {LAST_SYNC: {}, LAST_QUEUED: {},
                                          **{name: {} for name in FAILURES}}
    problems: list[tuple[int, str]] = []
    any_metric = False
    for n, line in enumerate(lines, first_line):
        if line.startswith(READ_AT):
            read_at = _number(line[len(READ_AT):].strip())
            if read_at is None:
                problems.append((n, "the read-at time is not a number"))
            continue
        if not line.startswith("kubeproxy_sync_proxy_rules_"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            problems.append((n, "not a metric sample (name{labels} value)"))
            continue
        name, labels, raw = m.groups()
        if name not in found:
            continue
        value = _number(raw)
        if value is None:
            problems.append((n, f"{name}: {raw!r} is not a finite number"))
            continue
        family = _FAMILY.search(labels or "")
        fam = family.group(1) if family else ""
        # (the two failure counters: one mode writes only its own; summed per family)
        found[name][fam] = value
        any_metric = True
    if not any_metric:
        return None, problems
    # (one mode writes only its own counter: iptables and IPVS restores, nftables syncs)
    failures: dict[str, float] = {}
    for name in FAILURES:
        for fam, value in found[name].items():
            failures[fam] = failures.get(fam, 0.0) + value
    return KubeProxySync(source, read_at, tuple(sorted(found[LAST_SYNC].items())),
                         tuple(sorted(found[LAST_QUEUED].items())),
                         tuple(sorted(failures.items()))), problems


def _number(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None
