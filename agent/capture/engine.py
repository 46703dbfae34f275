"""Watch NodePort handshakes for a while: ring + decoder + handshake table -> CaptureResult.

Runs in the network namespace of the calling process (the node's, for the agent). Never
raises: a node where AF_PACKET cannot run gets a result whose ``problems`` say why.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable

from agent.capture.handshakes import DEFAULT_CAPACITY, DEFAULT_TIMEOUT, HandshakeTable
from agent.capture.model import CaptureResult, FailedHandshakes, NodePortStats
from agent.capture.ring import DEFAULT_RING_BYTES, CaptureUnavailable, Ring

Progress = Callable[[float, int, int], None]  # seconds left, SYNs so far, unanswered so far

_POLL = 0.2  # longest wait for a block: how late a stop request or the clock is noticed
_PROGRESS_EVERY = 1.0


def capture(seconds: float, *, classify: Callable[[str], str],
            port_range: tuple[int, int] = (30000, 32767),
            ring_bytes: int = DEFAULT_RING_BYTES,
            table_size: int = DEFAULT_CAPACITY,
            handshake_timeout: float = DEFAULT_TIMEOUT,
            progress: Progress | None = None,
            stop: threading.Event | None = None,
            local_addresses: Iterable[str] | None = None) -> CaptureResult:
    """Capture for ``seconds``, then keep reading replies for up to ``handshake_timeout``
    more (new SYNs are no longer accepted) so the last SYNs get their outcome.

    ``classify(src_ip) -> SRC_*`` names the class of a SYN's source. ``stop`` ends the
    capture early (the result covers what was seen). ``progress`` is called about once a
    second, and once at the end of the capture phase with 0 seconds left.
    """
    try:
        port_range = (int(port_range[0]), int(port_range[1]))
        table = HandshakeTable(classify, port_range=port_range, capacity=int(table_size),
                               timeout=float(handshake_timeout),
                               local_addresses=local_addresses)
        ring = Ring(port_range=port_range, ring_bytes=int(ring_bytes))
    except (CaptureUnavailable, ValueError, TypeError, IndexError) as e:
        bad = port_range if isinstance(port_range, tuple) and len(port_range) == 2 \
            else (0, 0)
        return CaptureResult(seconds=0.0, port_range=bad, table_capacity=table_size,
                             problems=(f"capture unavailable: {e}",))
    problems: list[str] = []
    if progress is not None:
        progress = _guarded(progress, problems)
    started = time.monotonic()
    elapsed = 0.0
    ports: tuple[NodePortStats, ...] = ()
    failures: tuple[FailedHandshakes, ...] = ()
    with ring:
        try:
            end = started + max(0.0, seconds)
            _run(ring, table, end, stop, progress)
            elapsed = time.monotonic() - started
            if progress is not None:
                progress(0.0, table.syns, table.unanswered)
            # Grace time: replies to the last SYNs, and the client's RST after a bypassed
            # SYN-ACK. Done early when nothing is left waiting.
            table.accepting = False
            _run(ring, table, time.monotonic() + handshake_timeout, stop, None,
                 until_empty=True)
        except Exception as e:  # never raise into the verdict path; keep what was seen
            problems.append(f"capture failed: {type(e).__name__}: {e}")
            elapsed = elapsed or time.monotonic() - started
        try:
            ports = table.finish(time.monotonic())
        except Exception as e:
            problems.append(f"capture results incomplete: {type(e).__name__}: {e}")
            ports = table.results()
        # the table's clock is monotonic; findings say when in wall-clock time
        failures = table.failures(time.time() - time.monotonic())
        if table.failure_cells_folded:
            problems.append(f"{table.failure_cells_folded} failed handshakes came after "
                            "the per-port detail table was full: they are counted, but "
                            "without their source address and time")
        stats = ring.stats()
    return CaptureResult(
        seconds=round(elapsed, 3), port_range=port_range, ports=ports,
        packets_seen=table.packets, kernel_packets=stats.packets, kernel_drops=stats.drops,
        kernel_freezes=stats.freezes, retransmissions=table.retransmissions,
        table_evictions=table.evictions, table_capacity=table.capacity,
        decode_errors=table.decoder.error_count,
        problems=tuple(table.problems + problems), failures=failures)


def _guarded(progress: Progress, problems: list[str]) -> Progress:
    """A progress callback that cannot end the capture (e.g. stderr is a closed pipe)."""
    broken: list[bool] = []

    def call(left: float, syns: int, unanswered: int) -> None:
        if broken:
            return
        try:
            progress(left, syns, unanswered)
        except Exception as e:
            broken.append(True)
            problems.append(f"progress output stopped: {type(e).__name__}: {e}")

    return call


def _run(ring: Ring, table: HandshakeTable, end: float, stop: threading.Event | None,
         progress: Progress | None, until_empty: bool = False) -> None:
    """Feed ring blocks to the table until ``end`` (monotonic), a stop request, or (with
    ``until_empty``) an empty table."""
    monotonic = time.monotonic
    feed = table.feed_block
    expire = table.expire
    next_progress = monotonic() + _PROGRESS_EVERY
    while True:
        now = monotonic()
        if now >= end or (stop is not None and stop.is_set()):
            return
        if until_empty and not len(table):
            return
        # Block timestamps are not used as "now": the kernel stamps some outgoing TCP
        # packets with a monotonic departure time, others with wall-clock time.
        with contextlib.closing(ring.blocks(min(_POLL, end - now))) as blocks:
            for buf, off, num, _ts in blocks:
                now = monotonic()
                feed(buf, off, num, now)
                expire(now)
                if now >= end or now >= next_progress or (stop is not None
                                                          and stop.is_set()):
                    break
        now = monotonic()
        expire(now)
        if now >= next_progress:
            next_progress = now + _PROGRESS_EVERY
            if progress is not None:
                progress(max(0.0, end - now), table.syns, table.unanswered)
