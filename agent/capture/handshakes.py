"""A bounded table of half-open NodePort handshakes, and what became of each.

Key: (client ip, client port, node ip, node port) in "wire form" (see
packets.wire16/wire32; an IPv6 address is its 16 bytes, its own wire form). An entry
is made by the first SYN into the NodePort range (any direction but outgoing); the
same tuple again on the same interface is a retransmission (counted, not a new
handshake), on another interface the same packet crossing stacked devices (ignored).
It ends as:

- ``answered``: the node's SYN-ACK left through the interface the SYN came in on (or
  one the kernel stacks with it: a bridge port and its bridge, a bond slave and its
  bond, a VLAN device and its lower device, as far as /sys/class/net tells);
- ``bypassed``: the SYN-ACK left through another interface (e.g. the pod bridge): the
  reply skips the LB. The entry stays until the timeout to catch the client's RST
  (``peer_reset``: a pod that expected the LB's address answers our SYN-ACK with RST);
- ``reset``: the node answered with RST;
- ``unanswered``: nothing within the timeout (dropped, e.g. martian source);
- ``pending``: the capture ended first, or the entry was evicted from a full table.

The table holds at most ``capacity`` entries: when full, the oldest 1/16 is evicted
(counted, and reported as pending - never as answered). Per-port results are counters
keyed by (port, outcome, source class) plus at most ``samples_per`` samples per
(port, outcome, class) and SAMPLE_BUDGET per (outcome, class) over all ports, so memory
is bounded whatever the traffic (about 400 bytes of RSS per table entry: ~26 MiB for the
default 65536; IPv6 keys hold two 16-byte strings: ~33 MiB for a table and recent list
filled from random IPv6 sources, against 26 for IPv4, measured in one run).

``feed_block`` is the hot path: it walks a TPACKET_V3 block in place and handles the
common frame inline, without a function call per packet (see the benchmark in
tests/bench/capture_rate.py for why every call counts at several 100k packets/s).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path
from struct import error as struct_error
from typing import Any

from agent.capture.bpf import FAST_SNAPLEN
from agent.capture.model import (
    OUTCOMES,
    SRC_LOCAL,
    SRC_OTHER,
    FailedHandshakes,
    HandshakeSample,
    NodePortStats,
)
from agent.capture.packets import (
    FAST6_ETHERTYPE,
    FAST6_FRAME,
    FAST6_OFF,
    FAST6_SNAP,
    FAST_MAC,
    FAST_RECORD,
    FAST_RECORD_OK,
    TCP_ACK,
    TCP_RST,
    TCP_SYN,
    Decoder,
    ip_int,
    wire16,
    wire32,
    wire_addr,
    wire_ip_text,
)
from agent.capture.ring import PACKET_OUTGOING, PKT_HDR_FAST
from agent.capture.ring import ifname_of as _ifname_of
from agent.parse.kernel_name import kernel_name

DEFAULT_CAPACITY = 65536
DEFAULT_TIMEOUT = 3.0
DEFAULT_SAMPLES = 3
# Samples over all ports per (outcome, class): a flood to every port of the range must not
# keep 3 samples for each of them (2768 ports x 5 outcomes x 4 classes), and one outcome
# must not use up the budget of another (the few "bypassed" samples matter most).
SAMPLE_BUDGET = 256
# Cells of the failed-handshake table ((class[, local source], port) -> counts and times):
# 4 classes x 2 outcomes x 2768 ports fit; a configured range of all 65536 ports under a flood does
# not grow it further (new cells fold into one "other ports" cell per class, port 0).
FAIL_CELLS = 32768
_CLASS_CACHE_MAX = 65536
_REFRESH = 1.0  # seconds between fresh sysfs lookups of one interface

# client ip, client port, node ip, node port - in wire form (packets.wire16/wire32);
# an IPv6 address is 16 bytes
Key = tuple[int | bytes, int, int | bytes, int]

# Outcome -> index into a class's counter rows (the order of model.OUTCOMES).
_I = {o: i for i, o in enumerate(OUTCOMES)}
_ANSWERED, _BYPASSED, _RESET, _UNANSWERED, _PENDING = (_I[o] for o in OUTCOMES)
_CLASS = len(OUTCOMES)  # the last item of a row list: the class name


class Interfaces:
    """ifindex -> name, and -> the group of interfaces the kernel stacks together.

    Read-only from /sys/class/net. Cached, looked up again for an unknown index, and
    never raising: an interface may vanish between the packet and the lookup.
    """

    def __init__(self, sys_net: str | Path = "/sys/class/net",
                 ifname: Callable[[int], str] = _ifname_of) -> None:
        self._sys = Path(sys_net)
        self._ifname = ifname
        self._names: dict[int, str] = {}
        self._groups: dict[int, str] = {}
        self._looked: dict[int, float] = {}  # ifindex -> when last read fresh

    def name(self, ifindex: int) -> str:
        got = self._names.get(ifindex)
        if got is None:
            got = self._names[ifindex] = self._ifname(ifindex)
        return got

    def group(self, ifindex: int, fresh: bool = False) -> str:
        got = None if fresh else self._groups.get(ifindex)
        if got is None:
            # the name stays cached: an index is not reused for another interface while
            # we run, and a vanished interface keeps the name it had
            got = self._groups[ifindex] = self._group_of(self.name(ifindex))
        return got

    def same_egress(self, a: int, b: int) -> bool:
        if a == b:
            return True
        if self.group(a) == self.group(b):
            return True
        # Enslaved after we first looked (a new pod's veth)? Look once more, at most once
        # a second per interface: a flood of bypassed replies must not turn into a flood
        # of sysfs reads.
        now = time.monotonic()
        fresh = False
        for i in (a, b):
            if now - self._looked.get(i, -_REFRESH) >= _REFRESH:
                self._looked[i] = now
                self.group(i, fresh=True)
                fresh = True
        return fresh and self.group(a) == self.group(b)

    def _group_of(self, name: str) -> str:
        """Follow ``master`` (bridge port -> bridge, bond slave -> bond) and, for a
        device with exactly one lower device that is not itself a bridge or bond (VLAN,
        macvlan), ``lower_*``, to the top of the stack."""
        seen = {name}
        cur = name
        for _ in range(8):
            d = self._sys / cur
            nxt = None
            try:
                master = d / "master"
                if master.is_symlink():
                    nxt = os.path.basename(os.readlink(master))
                elif not (d / "bridge").exists() and not (d / "bonding").exists():
                    lowers = [p.name[len("lower_"):] for p in d.iterdir()
                              if p.name.startswith("lower_")]
                    if len(lowers) == 1:
                        nxt = lowers[0]
            except OSError:
                break
            if nxt is None or nxt in seen:
                break
            seen.add(nxt)
            cur = nxt
        return cur


RECENT_WINDOW = 60.0  # seconds a judged handshake's retransmitted SYNs are recognised


class HandshakeTable:
    """See the module docstring. ``now`` is any clock in seconds, the same for all calls."""

    def __init__(self, classify: Callable[[str], str], *,
                 port_range: tuple[int, int] = (30000, 32767),
                 capacity: int = DEFAULT_CAPACITY,
                 timeout: float = DEFAULT_TIMEOUT,
                 samples_per: int = DEFAULT_SAMPLES,
                 interfaces: Interfaces | None = None,
                 decoder: Decoder | None = None,
                 local_addresses: Iterable[str] | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        lo, hi = port_range
        if not 0 <= lo <= hi <= 0xFFFF:
            raise ValueError(f"bad port range {port_range}")
        self.port_range = (lo, hi)
        # NodePort test by one index: in_range[wire-form port] is 1 inside the range.
        flags = bytearray(65536)
        for p in range(lo, hi + 1):
            flags[wire16(p)] = 1
        self._in_range = bytes(flags)
        # Only SYNs *to this node* are NodePort handshakes: a pod's SYN to another host's
        # port 31000, forwarded through here, is not. None: accept any destination.
        self.local_dst: frozenset[int | bytes] | None = (
            None if local_addresses is None
            else frozenset(wire_addr(ip_int(a)) for a in local_addresses))
        self.capacity = capacity
        self.timeout = timeout
        self.samples_per = samples_per
        self.classify = classify
        self.interfaces = interfaces or Interfaces()
        self.decoder = decoder or Decoder()
        # key -> (first SYN time, in ifindex) while waiting for the node's reply, or
        # (first SYN time, in ifindex, reply ifindex) once bypassed (waiting for the
        # peer's RST). Tuples: the smallest entry, and the time float is shared by a
        # whole block. A plain dict keeps arrival order; removing its oldest entries
        # means scanning past deleted slots, so that is done in batches (_evict, expire).
        self._table: dict[Key, tuple[float, int] | tuple[float, int, int]] = {}
        self._evict_batch = max(1, capacity // 16)
        # Handshakes already judged unanswered or bypassed, by the time of their first SYN:
        # the client keeps retransmitting that SYN (1, 3, 7, 15 s ...) and each must count
        # as a retransmission, not as a new handshake. Bounded like the table.
        self._recent: OrderedDict[Key, float] = OrderedDict()
        # Counters: one row list per source class, [outcome index] -> {wire port: n},
        # the class name last. The class cache maps a source address straight to its
        # class's row list, so counting a finished handshake is two lookups.
        self._rows: dict[str, list[Any]] = {}
        self._classes: dict[int | bytes, list[Any]] = {}
        self._samples: dict[int, list[HandshakeSample]] = {}
        self._budget: dict[tuple[int, str], int] = {}
        # failed handshakes (bypassed, unanswered) with when: (class, wire source address
        # for SRC_LOCAL else -1, wire port, outcome) -> [count, first, last]. Off the hot
        # path: only expire() and the RST/timeout paths finish such handshakes.
        self._failed: dict[tuple[str, int | bytes, int, int], list[Any]] = {}
        self.failure_cells_folded = 0
        self.accepting = True  # False: handle replies only (the end-of-capture grace time)
        self.packets = 0
        self.syns = 0  # distinct handshakes (tuples) that entered the table
        self.retransmissions = 0
        self.evictions = 0
        self.unanswered = 0
        self.not_for_us = 0  # decoded packets that matched no rule (e.g. our own SYNs out)
        self.problems: list[str] = []

    def __len__(self) -> int:
        return len(self._table)

    # -- per packet (general entry point) ----------------------------------------------

    def packet(self, now: float, ifindex: int, pkttype: int,
               src: int | bytes, dst: int | bytes, sport: int, dport: int,
               flags: int) -> None:
        """One decoded packet (addresses as the decoder gives them, see packets.ip_int)."""
        self.packets += 1
        self._dispatch(now, ifindex, pkttype, wire_addr(src), wire_addr(dst),
                       wire16(sport), wire16(dport), flags)

    def _dispatch(self, now: float, ifindex: int, pkttype: int, src: int | bytes,
                  dst: int | bytes, sport: int, dport: int, flags: int) -> None:
        """``packet`` for wire-form values."""
        in_range = self._in_range
        kind = flags & (TCP_SYN | TCP_ACK)
        if kind == TCP_SYN:
            if (pkttype != PACKET_OUTGOING and in_range[dport]
                    and (self.local_dst is None or dst in self.local_dst)):
                self._syn(now, (src, sport, dst, dport), ifindex)
                return
        elif kind == TCP_SYN | TCP_ACK:
            if pkttype == PACKET_OUTGOING and in_range[sport]:
                self._synack((dst, dport, src, sport), ifindex)
                return
        elif flags & TCP_RST:
            if pkttype == PACKET_OUTGOING:
                if in_range[sport]:
                    self._rst_out((dst, dport, src, sport), ifindex)
                    return
            elif in_range[dport]:
                self._rst_in((src, sport, dst, dport))
                return
        self.not_for_us += 1

    def _syn(self, now: float, key: Key, ifindex: int) -> None:
        e = self._table.get(key)
        if e is None:
            seen = self._recent.get(key)
            if seen is not None and now - seen < RECENT_WINDOW:
                self.retransmissions += 1
                return
            if self.accepting:
                if len(self._table) >= self.capacity:
                    self._evict()
                self._table[key] = (now, ifindex)
                self.syns += 1
        elif e[1] == ifindex:
            # Same tuple on the same interface: a retransmission. The same SYN seen again
            # on another interface is one packet crossing stacked devices (port, bridge).
            self.retransmissions += 1

    def _synack(self, key: Key, ifindex: int) -> None:
        e = self._table.get(key)
        if e is None or len(e) != 2:
            return  # not ours, or a later sighting of a reply we already judged
        if self.interfaces.same_egress(ifindex, e[1]):
            del self._table[key]
            self._finish(key, e[1], _ANSWERED, ifindex)
        else:
            self._table[key] = (e[0], e[1], ifindex)  # keeps its place (age) in the table

    def _rst_out(self, key: Key, ifindex: int) -> None:
        e = self._table.get(key)
        if e is not None and len(e) == 2:
            del self._table[key]
            self._finish(key, e[1], _RESET, ifindex)

    def _rst_in(self, key: Key) -> None:
        e = self._table.get(key)
        if e is not None and len(e) == 3:
            del self._table[key]
            self._remember(key, e[0])
            # a SYN-ACK routed to lo (accept_local=1, source = a local VIP) is reset by the
            # node's own stack: that is no client expecting the load balancer
            peer = self.interfaces.name(e[2]) != "lo"
            self._finish(key, e[1], _BYPASSED, e[2], peer_reset=peer, at=e[0])

    # -- per block (the hot path) ------------------------------------------------------

    def feed_block(self, buf: Any, off: int, num: int, now: float) -> None:
        """Handle the ``num`` packets of a TPACKET_V3 block starting at ``off`` in ``buf``
        (the ring mapping), all at time ``now``.

        Same logic as ``packet``, inlined for the common cases: one unpack per record
        for a frame the kernel filter marked as plain (bpf.FAST_SNAPLEN), SYN insertion
        with eviction, and counting of answered and reset handshakes. Everything else
        goes through the methods above. Measured in tests/bench/capture_rate.py: each
        function call or extra unpack here costs ~10% of the throughput.
        """
        if not FAST_RECORD_OK:
            self._feed_block_general(buf, off, num, now)
            return
        unpack = FAST_RECORD.unpack_from
        unpack_hdr = PKT_HDR_FAST.unpack_from
        decode_at = self.decoder.decode_at
        unpack6 = FAST6_FRAME.unpack_from
        table = self._table
        get = table.get
        in_range = self._in_range
        local_dst = self.local_dst
        recent = self._recent
        recent_get = recent.get
        cap = self.capacity
        accepting = self.accepting
        classes = self._classes
        rows_of = self._rows_of
        samples_per = self.samples_per
        new = retx = other = evicted = 0
        fresh_if, fresh = -1, (now, -1)
        for _ in range(num):
            try:
                nxt, snap, mac, ifindex, hatype, pkttype, src, dst, sport, dport, flags = \
                    unpack(buf, off)
            except struct_error:
                # A record shorter than a fast one, at the very end of the mapping (only
                # without our filter, which never keeps fewer bytes): the general path.
                nxt, snap, mac, ifindex, hatype, pkttype = unpack_hdr(buf, off)
            if snap != FAST_SNAPLEN or mac != FAST_MAC:
                # Not the plain IPv4 frame. The plain IPv6 one (checked here, not by its
                # length: another frame may be kept at the same length) in one more
                # unpack; anything else decoded properly, then into wire form.
                if mac == FAST_MAC and snap >= FAST6_SNAP:
                    et, vtc, nh, src, dst, sport, dport, flags = unpack6(buf, off + FAST6_OFF)
                    if et == FAST6_ETHERTYPE and nh == 6 and vtc >> 4 == 6:
                        mac = -1
                if mac != -1:
                    got = decode_at(buf, off + mac, snap, hatype)
                    if got is None:
                        off += nxt
                        continue
                    src, dst, sport, dport, flags = got
                    if type(src) is int:  # IPv6 bytes are their own wire form
                        src, dst = wire32(src), wire32(dst)  # type: ignore[arg-type]
                    sport, dport = wire16(sport), wire16(dport)
            off += nxt
            kind = flags & 0x12
            if kind == 0x02:  # SYN
                if pkttype != 4 and in_range[dport] and (local_dst is None or dst in local_dst):
                    key = (src, sport, dst, dport)
                    e = get(key)
                    if e is None:
                        if recent and (seen := recent_get(key)) is not None \
                                and now - seen < RECENT_WINDOW:
                            retx += 1  # a handshake already judged: its client retries
                            continue
                        if accepting:
                            if len(table) >= cap:
                                self._evict()  # full: the oldest batch goes, as pending
                            if ifindex != fresh_if:
                                fresh_if, fresh = ifindex, (now, ifindex)
                            table[key] = fresh  # shared: one tuple per block and interface
                            new += 1
                    elif e[1] == ifindex:
                        retx += 1
                    continue
            elif kind == 0x12:  # SYN-ACK
                if pkttype == 4 and in_range[sport]:
                    key = (dst, dport, src, sport)
                    e = get(key)
                    if e is not None:
                        if ifindex == e[1] and len(e) == 2:
                            # answered through the interface the SYN came in on
                            del table[key]
                            rows = classes.get(dst) or rows_of(dst)
                            row = rows[_ANSWERED]
                            n = row.get(sport, 0) + 1
                            row[sport] = n
                            if n <= samples_per:
                                self._sample(key, e[1], _ANSWERED, rows, ifindex, False)
                        else:
                            self._synack(key, ifindex)
                    continue
            elif flags & 0x04:  # RST
                if pkttype == 4:
                    if in_range[sport]:
                        key = (dst, dport, src, sport)
                        e = get(key)
                        if e is not None and len(e) == 2:
                            # the node refused: reset
                            del table[key]
                            rows = classes.get(dst) or rows_of(dst)
                            row = rows[_RESET]
                            n = row.get(sport, 0) + 1
                            row[sport] = n
                            if n <= samples_per:
                                self._sample(key, e[1], _RESET, rows, ifindex, False)
                        continue
                elif in_range[dport]:
                    self._rst_in((src, sport, dst, dport))
                    continue
            other += 1
        self.packets += num
        self.syns += new
        self.retransmissions += retx
        self.not_for_us += other
        self.evictions += evicted

    def _feed_block_general(self, buf: Any, off: int, num: int, now: float) -> None:
        """feed_block for big-endian hosts: host-order header, then the general path."""
        unpack_hdr = PKT_HDR_FAST.unpack_from
        decode_at = self.decoder.decode_at
        for _ in range(num):
            nxt, snap, mac, ifindex, hatype, pkttype = unpack_hdr(buf, off)
            got = decode_at(buf, off + mac, snap, hatype)
            off += nxt
            self.packets += 1
            if got is not None:
                src, dst, sport, dport, flags = got
                self._dispatch(now, ifindex, pkttype, wire_addr(src), wire_addr(dst),
                               wire16(sport), wire16(dport), flags)

    # -- time and the end ----------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Entries older than the timeout: unanswered, or (bypassed) done waiting for the
        peer's RST. The table is in arrival order, so this stops at the first young one."""
        cutoff = now - self.timeout
        table = self._table
        old = []
        for key, e in table.items():  # arrival order: stop at the first young one
            if e[0] > cutoff:
                break
            old.append((key, e))
        for key, e in old:
            del table[key]
            self._remember(key, e[0])
            if len(e) == 2:
                self.unanswered += 1
                self._finish(key, e[1], _UNANSWERED, None, at=e[0])
            else:
                self._finish(key, e[1], _BYPASSED, e[2], at=e[0])

    def _remember(self, key: Key, first_syn: float) -> None:
        recent = self._recent
        recent[key] = first_syn
        if len(recent) > self.capacity:
            recent.popitem(last=False)

    def _evict(self) -> None:
        """The table is full: the oldest 1/16 goes at once (counted as pending, or bypassed
        when the node's reply was seen). In batches because a plain dict is twice as fast
        as an OrderedDict on the per-SYN path, but finds its oldest entry by scanning."""
        table = self._table
        classes = self._classes
        rows_of = self._rows_of
        samples_per = self.samples_per
        victims = list(islice(table.items(), self._evict_batch))
        self.evictions += len(victims)
        for key, e in victims:
            del table[key]
            if len(e) == 2:
                # _finish(key, e[1], _PENDING, None) inlined: under a SYN flood every
                # entry ends here, so this loop is the per-SYN cost of the flood
                rows = classes.get(key[0]) or rows_of(key[0])
                row = rows[_PENDING]
                n = row.get(key[3], 0) + 1
                row[key[3]] = n
                if n <= samples_per:
                    self._sample(key, e[1], _PENDING, rows, None, False)
            else:
                self._finish(key, e[1], _BYPASSED, e[2], at=e[0])

    def open_count(self) -> int:
        """Entries still waiting for the node's reply (bypassed ones excluded)."""
        return sum(1 for e in self._table.values() if len(e) == 2)

    def finish(self, now: float) -> tuple[NodePortStats, ...]:
        """End of capture: expire what is old enough, the rest is pending (or bypassed
        when the node's reply was seen); then the per-port results."""
        self.expire(now)
        rest = list(self._table.items())
        self._table.clear()
        for key, e in rest:
            if len(e) == 2:
                self._finish(key, e[1], _PENDING, None)
            else:
                self._finish(key, e[1], _BYPASSED, e[2], at=e[0])
        return self.results()

    def results(self) -> tuple[NodePortStats, ...]:
        """Per-port statistics of the handshakes finished so far."""
        by_port: dict[int, dict[str, dict[str, int]]] = {}
        for cls, rows in self._rows.items():
            for i, outcome in enumerate(OUTCOMES):
                for wport, n in rows[i].items():
                    by_port.setdefault(wire16(wport), {}).setdefault(outcome, {})[cls] = n
        return tuple(
            NodePortStats(node_port=port,
                          syns=sum(sum(c.values()) for c in counts.values()),
                          counts=counts,
                          samples=tuple(self._samples.get(port, ())))
            for port, counts in sorted(by_port.items()))

    # -- helpers -------------------------------------------------------------------------

    def _rows_of(self, ip: int | bytes) -> list[Any]:
        """The counter rows of the class of a (wire-form) source address, cached."""
        text = wire_ip_text(ip)
        try:
            cls = self.classify(text)
        except Exception as e:  # a broken classifier must not lose the capture
            cls = SRC_OTHER
            if len(self.problems) < 5:
                self.problems.append(f"classify({text}) failed, counted as "
                                     f"{SRC_OTHER!r}: {type(e).__name__}: {e}")
        rows = self._rows.get(cls)
        if rows is None:
            rows = self._rows[cls] = [*({} for _ in OUTCOMES), cls]
        if len(self._classes) >= _CLASS_CACHE_MAX:
            self._classes.clear()  # bounded: a flood from random sources
        self._classes[ip] = rows
        return rows

    def _finish(self, key: Key, in_if: int, outcome: int, reply_if: int | None,
                peer_reset: bool = False, at: float | None = None) -> None:
        """Count a finished handshake; ``at``: its first SYN's time, for the failed ones
        (bypassed, unanswered) that findings are made of."""
        rows = self._classes.get(key[0]) or self._rows_of(key[0])
        row = rows[outcome]
        n = row.get(key[3], 0) + 1
        row[key[3]] = n
        if at is not None and outcome in (_BYPASSED, _UNANSWERED):
            self._fail(rows[_CLASS], key[0], key[3], outcome, at)
        if n <= self.samples_per:
            self._sample(key, in_if, outcome, rows, reply_if, peer_reset)

    def _fail(self, cls: str, src: int | bytes, wport: int, outcome: int,
              at: float) -> None:
        cell_key = (cls, src if cls == SRC_LOCAL else -1, wport, outcome)
        cell = self._failed.get(cell_key)
        if cell is None:
            if len(self._failed) >= FAIL_CELLS:
                self.failure_cells_folded += 1
                cell_key = (cls, -1, 0, outcome)
                cell = self._failed.get(cell_key)
            if cell is None:
                cell = self._failed[cell_key] = [0, at, at]
        cell[0] += 1
        if at < cell[1]:
            cell[1] = at
        if at > cell[2]:
            cell[2] = at

    def failures(self, wall_offset: float = 0.0) -> tuple[FailedHandshakes, ...]:
        """The failed handshakes so far, by port; times + ``wall_offset`` (the table's
        clock is the caller's: monotonic for the engine)."""
        return tuple(sorted(
            (FailedHandshakes(node_port=wire16(wport), source_class=cls,
                              outcome=OUTCOMES[outcome],
                              src=None if src == -1 else wire_ip_text(src), count=c[0],
                              first_seen=round(c[1] + wall_offset, 3),
                              last_seen=round(c[2] + wall_offset, 3))
             for (cls, src, wport, outcome), c in self._failed.items()),
            key=lambda f: (f.node_port, f.source_class, f.outcome, f.src or "")))

    def _sample(self, key: Key, in_if: int, outcome: int, rows: list[Any],
                reply_if: int | None, peer_reset: bool) -> None:
        budget = (outcome, rows[_CLASS])
        used = self._budget.get(budget, 0)
        if used >= SAMPLE_BUDGET:
            return
        self._budget[budget] = used + 1
        src, sport, dst, dport = key
        names = self.interfaces
        port = wire16(dport)
        self._samples.setdefault(port, []).append(HandshakeSample(
            src=wire_ip_text(src), sport=wire16(sport), dst=wire_ip_text(dst), dport=port,
            in_iface=kernel_name(names.name(in_if)), outcome=OUTCOMES[outcome],
            source_class=rows[_CLASS],
            reply_iface=kernel_name(names.name(reply_if)) if reply_if else None,
            peer_reset=peer_reset))
