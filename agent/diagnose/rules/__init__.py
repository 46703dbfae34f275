"""Diagnosis rules: one module per concern, each registered once here.

A rule is ``check(ctx: Context) -> list[Finding]``: pure, reads only the context.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.diagnose.context import Context
from agent.diagnose.model import Finding
from agent.diagnose.rules import (
    consistency,
    etp_local,
    ip_mode,
    known_bugs,
    lb_hostname,
    lb_ip_local,
    observed,
    pod_to_lb,
)

RULES: tuple[Callable[[Context], list[Finding]], ...] = (
    lb_ip_local.check,
    pod_to_lb.check,
    lb_hostname.check,
    etp_local.check,
    known_bugs.check,
    consistency.check,
    ip_mode.check,
    observed.check,
)
# the rules that read the capture (ctx.capture); every other rule's findings follow from
# the snapshot alone, and a daemon that captures each cycle on an unchanged node reuses
# them (agent.diagnose.Prepared.memo) instead of walking every LB IP again
CAPTURE_RULES = frozenset({observed.check})
