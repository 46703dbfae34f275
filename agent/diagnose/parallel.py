"""The per-LB-IP rules of a big node, split over two processes (one-shot `check` only).

On a 10k-service node most of a diagnosis is walking each LB IP:port through the nat
rules (pod_to_lb, etp_local): independent per target, pure, CPU-bound. A forked child
takes the second half of the targets while the parent does the first; the child sends
each rule's findings and unknowns back pickled through a memfd (no pipe to keep
drained), and the parent puts them after its own, in the order one process would have
produced them: the verdict is the same byte for byte (tests/test_diagnose_parallel.py).

Why a fork and not threads: the walk is Python bytecode (the GIL). Why only `check
--jobs 2` (opt-in): a person waits for it, but the gain depends on the machine (on
2 vCPUs that slow each other, ~0.8x the diagnosis for 1.5x the memory: the child
unshares every page whose refcounts it touches); the daemon keeps to one core. If the
child fails in any way (cannot fork, killed, hung, a bad result), the parent walks the
second half itself: never a missing finding, only the time it would have taken anyway.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from agent.diagnose.context import Context, Unknowns
from agent.diagnose.model import Finding
from agent.snapshot import Unknown

Rule = Callable[[Context], list[Finding]]
# below this many targets a fork (a few ms, plus pickling) is not worth it
MIN_TARGETS = 1000
# the modes split: in iptables mode each LB IP's walk is long (its own EXT/SVC/SEP chains,
# ~130 us) and the split paid (diagnosis 2.6 -> 2.1 s at 10k services on 2 vCPUs); an
# IPVS-mode walk is a few shared rules and the fork cost what it saved (nftables: not
# measured yet)
SPLIT_MODES: tuple[str, ...] = ("iptables",)
_CHILD_FAILED = 70  # the child's exit code when it could not deliver (EX_SOFTWARE)
# How long the parent waits for the child once its own half is done: the child does as
# much work, so twice the time since the fork, and never less than this. A child that
# does not end by then (it cannot happen by design: no other thread holds a lock it
# could need) is killed and its half walked here: late, never hung, never incomplete.
WAIT_AT_LEAST = 30.0


@dataclass(frozen=True)
class _Part:
    """One rule's outcome over some targets."""

    findings: list[Finding]
    unknowns: list[Unknown]  # in the order the rule reported them
    error: BaseException | None = None


def usable_jobs(requested: int, targets: int) -> int:
    """How many processes to walk ``targets`` with: 1 unless asked for more, there is
    enough to split, and no other thread runs (a fork copies only the calling thread:
    a lock another thread held would stay held in the child)."""
    import threading  # (only here: `check` imports nothing it may not need)

    if requested < 2 or targets < MIN_TARGETS or threading.active_count() > 1:
        return 1
    return 2


class SplitRules:
    """The child started on the second half of ``ctx.targets`` for each of ``rules``;
    ``run(rule, ctx)`` does the first half here and returns the findings of all."""

    def __init__(self, ctx: Context, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)
        half = (len(ctx.targets) + 1) // 2
        self._head, self._tail = ctx.targets[:half], ctx.targets[half:]
        self._parts: dict[Rule, _Part] | None = None
        self._forked_at = time.monotonic()
        self._pid, self._fd = self._start(ctx)

    def _start(self, ctx: Context) -> tuple[int | None, int | None]:
        try:
            fd = os.memfd_create("loopback-agent-walk", os.MFD_CLOEXEC)
        except (OSError, AttributeError):
            return None, None
        try:
            pid = os.fork()
        except OSError:
            os.close(fd)
            return None, None
        if pid == 0:  # the child: never returns into the caller's code
            code = _CHILD_FAILED
            try:
                parts = {}
                for i, rule in enumerate(self.rules):
                    c = replace(ctx, targets=self._tail, unknowns=Unknowns())
                    try:
                        parts[i] = _Part(rule(c), c.unknowns)
                    except Exception as e:  # the parent reports it as it would its own
                        parts[i] = _Part([], c.unknowns, e)
                # streamed into the memfd: no second copy of the findings as one bytes
                with os.fdopen(os.dup(fd), "wb") as f:
                    pickle.dump(parts, f, protocol=pickle.HIGHEST_PROTOCOL)
                code = 0
            finally:
                # no atexit handlers, no flush of the parent's buffered output (twice)
                os._exit(code)
        return pid, fd

    def run(self, rule: Rule, ctx: Context) -> list[Finding]:
        """The findings of ``rule`` over every target, head then tail, with the tail's
        unknowns recorded after the head's (as one process would have)."""
        head = rule(replace(ctx, targets=self._head))
        part = self._child_parts().get(rule)
        if part is None:  # the child failed: walk the tail here
            return head + rule(replace(ctx, targets=self._tail))
        for u in part.unknowns:
            ctx.unknown(u.source, u.reason)
        if part.error is not None:
            raise part.error
        return head + part.findings

    def close(self) -> None:
        """Reap the child (when no rule asked for its result) and free the memfd."""
        if self._parts is None:
            self._child_parts()

    def _child_parts(self) -> dict[Rule, _Part]:
        if self._parts is not None:
            return self._parts
        self._parts = {}
        pid, fd = self._pid, self._fd
        if pid is None or fd is None:
            return self._parts
        try:
            if not _ended_within(pid, max(WAIT_AT_LEAST,
                                          2 * (time.monotonic() - self._forked_at))):
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) == 0:
                with os.fdopen(os.dup(fd), "rb") as f:
                    f.seek(0)
                    parts = pickle.load(f)  # (our own child's output, our own memfd)
                self._parts = {self.rules[i]: p for i, p in parts.items()}
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, IndexError):
            self._parts = {}
        finally:
            os.close(fd)
            self._fd = None
        return self._parts


def _ended_within(pid: int, seconds: float) -> bool:
    """Has child ``pid`` ended (not yet reaped) within ``seconds``? (A pidfd becomes
    readable when its process ends.)"""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # no pidfd (Linux < 5.3): wait as long as it takes
        return True
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])
    finally:
        os.close(pidfd)
