"""One AF_PACKET socket on every interface of the current network namespace, read
through a TPACKET_V3 memory-mapped ring.

Why this shape: a socket per interface would miss interfaces that appear during the
capture (a new pod's veth); an unbound ETH_P_ALL socket sees them all, in both
directions (``PACKET_IGNORE_OUTGOING`` stays off: the node's SYN-ACKs are outgoing).
TPACKET_V3 hands over whole blocks of packets per wake-up, so the Python side pays one
``poll()`` per block instead of one ``recv()`` per packet, and reads headers in place
with ``struct.unpack_from`` on the mapping, without copying blocks.

Memory is bounded by ``ring_bytes`` (allocated once by the kernel, mapped here).
"""

from __future__ import annotations

import contextlib
import mmap
import select
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from agent.capture import bpf

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_RX_RING = 5
PACKET_STATISTICS = 6
PACKET_VERSION = 10
TPACKET_V3 = 2

PACKET_HOST = 0
PACKET_BROADCAST = 1
PACKET_MULTICAST = 2
PACKET_OTHERHOST = 3
PACKET_OUTGOING = 4

TP_STATUS_KERNEL = 0
TP_STATUS_USER = 1

DEFAULT_RING_BYTES = 8 << 20
DEFAULT_BLOCK_BYTES = 256 << 10  # 32 blocks in 8 MiB: fine-grained hand-back to the kernel
DEFAULT_BLOCK_TIMEOUT_MS = 100
_FRAME_BYTES = 2048  # only checked by the kernel for V3 (block_size % frame_size == 0)

# struct tpacket_block_desc (version, offset_to_priv, then tpacket_hdr_v1):
# block_status @8, num_pkts @12, offset_to_first_pkt @16, ts_last_pkt (sec, nsec) @40.
BLOCK_STATUS_OFF = 8
BLOCK_HDR = struct.Struct("=8xIII20xII")  # status, num_pkts, first, ts_last sec, nsec
_STATUS = struct.Struct("=I")

# struct tpacket3_hdr (48 bytes, already TPACKET_ALIGNed) directly followed by
# struct sockaddr_ll: one unpack per packet gives everything the reader needs:
# tp_next_offset, tp_sec, tp_nsec, tp_snaplen, tp_mac, sll_ifindex, sll_hatype,
# sll_pkttype.
PKT_HDR = struct.Struct("=IIII8xH22x4xiHB")
# The same without the timestamp, for the hot path (fewer fields = fewer objects):
# tp_next_offset, tp_snaplen, tp_mac, sll_ifindex, sll_hatype, sll_pkttype.
PKT_HDR_FAST = struct.Struct("=I8xI8xH22x4xiHB")

_REQ3 = struct.Struct("=7I")
_STATS3 = struct.Struct("=3I")


class CaptureUnavailable(RuntimeError):
    """AF_PACKET capture cannot run here (no CAP_NET_RAW, no AF_PACKET, no ring)."""


@dataclass(frozen=True)
class RingStats:
    packets: int  # tp_packets: what the filter passed (including drops)
    drops: int  # tp_drops: no room in the ring
    freezes: int  # tp_freeze_q_cnt: times the kernel found every block with us


class Ring:
    """The socket, its filter and the mapped ring. Use as a context manager.

    ``blocks()`` is the fast interface (one item per ring block, parsed by the caller);
    ``packets()`` yields one tuple per packet for everything else.
    """

    def __init__(self, *, port_range: tuple[int, int] = bpf.DEFAULT_PORT_RANGE,
                 ring_bytes: int = DEFAULT_RING_BYTES,
                 block_bytes: int = DEFAULT_BLOCK_BYTES,
                 block_timeout_ms: int = DEFAULT_BLOCK_TIMEOUT_MS,
                 snaplen: int = bpf.DEFAULT_SNAPLEN,
                 program: Sequence[bpf.Insn] | None = None) -> None:
        page = mmap.PAGESIZE
        block_bytes = max(page, block_bytes // page * page)
        # the kernel allocates a block as 2^order pages: use powers of two
        while block_bytes & (block_bytes - 1):
            block_bytes &= block_bytes - 1
        nblocks = max(2, ring_bytes // block_bytes)
        self.block_bytes = block_bytes
        self.nblocks = nblocks
        self.ring_bytes = block_bytes * nblocks
        self._acc = [0, 0, 0]
        self._sock: socket.socket | None = None
        self._mm: mmap.mmap | None = None
        self._next = 0
        self._names: dict[int, str] = {}
        try:
            af_packet = socket.AF_PACKET
        except AttributeError as e:
            raise CaptureUnavailable("AF_PACKET sockets do not exist on this system") from e
        try:
            # ETH_P_ALL: registered for every interface at once, also future ones.
            sock = socket.socket(af_packet, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        except PermissionError as e:
            raise CaptureUnavailable("AF_PACKET needs CAP_NET_RAW "
                                     f"(run as root or with that capability): {e}") from e
        except OSError as e:
            raise CaptureUnavailable(f"cannot open an AF_PACKET socket: {e}") from e
        try:
            # The filter first: what slips in before it lands in the socket's plain
            # receive queue, which PACKET_RX_RING purges.
            bpf.attach(sock, program if program is not None
                       else bpf.nodeport_filter(port_range, snaplen))
            sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
            req = _REQ3.pack(block_bytes, nblocks, _FRAME_BYTES,
                             block_bytes // _FRAME_BYTES * nblocks, block_timeout_ms, 0, 0)
            sock.setsockopt(SOL_PACKET, PACKET_RX_RING, req)
            self._mm = mmap.mmap(sock.fileno(), self.ring_bytes, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            sock.close()
            raise CaptureUnavailable(f"cannot set up the TPACKET_V3 ring: {e}") from e
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLERR)
        self.stats()  # reset the counters: count from here on

    # -- reading ---------------------------------------------------------------------

    def blocks(self, timeout: float = 0.2) -> Iterator[tuple[mmap.mmap, int, int, float]]:
        """Yield (buffer, offset of the first packet, number of packets, time of the last
        packet) for each ready block, in ring order.

        The block goes back to the kernel when the consumer asks for the next item (or
        the generator is closed), so the buffer must not be read after that. Returns
        after ``timeout`` seconds without a ready block so the caller can check the clock.
        """
        mm = self._mm
        if mm is None:
            return
        unpack_block = BLOCK_HDR.unpack_from
        pack_status = _STATUS.pack_into
        bsize, nblocks = self.block_bytes, self.nblocks
        poll_ms = max(1, int(timeout * 1000))
        while True:
            base = self._next * bsize
            status, num, first, sec, nsec = unpack_block(mm, base)
            if not status & TP_STATUS_USER:
                events = self._poll.poll(poll_ms)
                if not events:
                    return
                status, num, first, sec, nsec = unpack_block(mm, base)
                if not status & TP_STATUS_USER:
                    # Woken without a block: a pending socket error (clear it, or every
                    # poll returns at once) or spuriously. Let the caller look at the clock.
                    if events[0][1] & select.POLLERR and self._sock is not None:
                        with contextlib.suppress(OSError):
                            self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    return
            try:
                yield mm, base + first, num, sec + nsec * 1e-9
            finally:
                pack_status(mm, base + BLOCK_STATUS_OFF, TP_STATUS_KERNEL)
                self._next = (self._next + 1) % nblocks

    def packets(self, timeout: float = 0.2) -> Iterator[tuple[float, int, int, int, bytes]]:
        """Yield (timestamp, ifindex, pkt_type, hatype, frame) per packet.

        ``frame`` is a copy of the captured bytes (at most the filter's snaplen) starting
        at the link-layer header (at the IP header for header-less devices: see
        ``hatype``), so it stays valid after the block went back to the kernel.
        """
        unpack = PKT_HDR.unpack_from
        for mm, off, num, _ in self.blocks(timeout):
            for _ in range(num):
                nxt, sec, nsec, snap, mac, ifindex, hatype, pkttype = unpack(mm, off)
                yield (sec + nsec * 1e-9, ifindex, pkttype, hatype,
                       mm[off + mac:off + mac + snap])
                off += nxt

    def wait(self, timeout: float) -> None:
        """Sleep until a block may be ready (for callers that interleave other work)."""
        if self._poll is not None:
            self._poll.poll(max(0, int(timeout * 1000)))

    # -- counters and names ------------------------------------------------------------

    def stats(self) -> RingStats:
        """Totals since the ring was opened. The kernel resets its counters on every read
        of PACKET_STATISTICS, so they are accumulated here."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                raw = self._sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, _STATS3.size)
                for i, v in enumerate(_STATS3.unpack(raw)):
                    self._acc[i] += v
        return RingStats(*self._acc)

    def ifname(self, ifindex: int) -> str:
        """Interface name, cached; an index seen for the first time is looked up, and one
        that already vanished gets a stable placeholder instead of an exception."""
        name = self._names.get(ifindex)
        if name is None:
            name = ifname_of(ifindex)
            self._names[ifindex] = name
        return name

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view
                self._mm.close()
            self._mm = None
        if self._sock is not None:
            self.stats()
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ifname_of(ifindex: int) -> str:
    """if_indextoname that never raises: the interface may be gone already."""
    try:
        return socket.if_indextoname(ifindex)
    except OSError:
        return f"if{ifindex}"
