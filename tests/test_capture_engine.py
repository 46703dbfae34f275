"""The capture engine: BPF filter, frame decoder, handshake table, TPACKET_V3 ring.

Pure tests run the filter through a small cBPF interpreter (bpf.run) and feed the table
with synthetic ring blocks laid out like the kernel's. Tests marked ``netns`` build a
node namespace (eth0 to a client namespace, a cni0 bridge with a pod behind it), run
``capture()`` *inside* the node through a python subprocess, and drive real traffic:
connections, a closed port, SYNs the node drops, a SYN from the pod's address arriving on
the uplink (the loopback case), odd frames, a flood beyond the table bound, and
interfaces that come and go during the capture.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.capture import bpf, engine, ring
from agent.capture.handshakes import HandshakeTable, Interfaces
from agent.capture.model import (
    ANSWERED,
    BYPASSED,
    PENDING,
    RESET,
    SRC_OTHER,
    SRC_POD,
    UNANSWERED,
    CaptureResult,
    NodePortStats,
)
from agent.capture.packets import (
    FAST_MAC,
    FRAGMENT,
    NOT_IPV4,
    NOT_TCP,
    TRUNCATED,
    UNKNOWN_LINK,
    Decoder,
    ip_int,
)
from agent.capture.ring import PACKET_HOST, PACKET_OUTGOING
from lab.netns import Netns, netns, veth

PY = sys.executable
SYN, RST, ACK = 0x02, 0x04, 0x10
NODE, CLIENT, CLIENT_DROPPED, POD = "10.0.0.10", "10.0.0.1", "10.0.0.3", "172.16.1.2"
OPEN, CLOSED, CHURN_PORT, INJECT_PORT = 30080, 30081, 30090, 30095


# --- frames -------------------------------------------------------------------------

def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def tcp(src: str, dst: str, sport: int, dport: int, flags: int, seq: int = 1000) -> bytes:
    hdr = struct.pack("!HHIIBBHHH", sport, dport, seq, 0 if flags == SYN else 1,
                      5 << 4, flags, 64240, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, 20)
    return hdr[:16] + struct.pack("!H", _csum(pseudo + hdr)) + hdr[18:]


def ipv4(src: str, dst: str, payload: bytes, *, proto: int = 6, options: bytes = b"",
         frag: int = 0x4000) -> bytes:
    ihl = 5 + len(options) // 4
    hdr = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, ihl * 4 + len(payload), 1, frag, 64,
                      proto, 0, socket.inet_aton(src), socket.inet_aton(dst)) + options
    return hdr[:10] + struct.pack("!H", _csum(hdr)) + hdr[12:] + payload


def eth(payload: bytes, *, ethertype: int = 0x0800, vlans: Sequence[tuple[int, int]] = (),
        dst_mac: bytes = b"\x02" * 6, src_mac: bytes = b"\x04" * 6) -> bytes:
    tags = b"".join(struct.pack("!HH", tpid, vid) for tpid, vid in vlans)
    return dst_mac + src_mac + tags + struct.pack("!H", ethertype) + payload


def seg(src: str, dst: str, sport: int, dport: int, flags: int, **kw: Any) -> bytes:
    """An IPv4 TCP segment (IP header on), ``kw`` for ``ipv4``."""
    return ipv4(src, dst, tcp(src, dst, sport, dport, flags), **kw)


def frame(src: str, dst: str, sport: int, dport: int, flags: int, *,
          vlans: Sequence[tuple[int, int]] = (), dst_mac: bytes = b"\x02" * 6,
          src_mac: bytes = b"\x04" * 6, **kw: Any) -> bytes:
    return eth(seg(src, dst, sport, dport, flags, **kw), vlans=vlans, dst_mac=dst_mac,
               src_mac=src_mac)


def ipv6_syn(dport: int, **kw: Any) -> bytes:
    hdr = struct.pack("!IHBB16s16s", 0x60000000, 20, 6, 64,
                      socket.inet_pton(socket.AF_INET6, "fd00::1"),
                      socket.inet_pton(socket.AF_INET6, "fd00::10"))
    return eth(hdr + struct.pack("!HHIIBBHHH", 40000, dport, 1, 0, 0x50, SYN, 1, 0, 0),
               ethertype=0x86DD, **kw)


# --- synthetic ring blocks ------------------------------------------------------------

PROGRAM = bpf.nodeport_filter()


def ring_block(records: Sequence[tuple[int, int, bytes, int]],
               program: Sequence[bpf.Insn] | None = PROGRAM) -> tuple[bytearray, int, int]:
    """A TPACKET_V3 block as the kernel fills it: (ifindex, pkt_type, frame, hatype)
    records that pass ``program`` (run through the interpreter, which also gives the
    captured length), or all of them uncut when ``program`` is None."""
    first = 48
    buf = bytearray(first)
    kept = []
    for ifindex, pkttype, fr, hatype in records:
        snap = len(fr) if program is None else bpf.run(program, fr, hatype, pkttype)
        if snap:
            kept.append((ifindex, pkttype, fr[:snap], hatype))
    for i, (ifindex, pkttype, fr, hatype) in enumerate(kept):
        mac = FAST_MAC if hatype in bpf.ETHERNET_HATYPES else 96
        size = (mac + len(fr) + 15) // 16 * 16
        nxt = size if i < len(kept) - 1 else 0
        rec = bytearray(size)
        struct.pack_into("=IIIIIIHH20x", rec, 0, nxt, 0, 0, len(fr), len(fr), 1, mac,
                         mac + (14 if mac == FAST_MAC else 0))
        struct.pack_into("=HHiHBB8x", rec, 48, 17, 3, ifindex, hatype, pkttype, 6)
        rec[mac:mac + len(fr)] = fr
        buf += rec
    return buf, first, len(kept)


def classify_by(mapping: dict[str, str]) -> Callable[[str], str]:
    return lambda ip: mapping.get(ip, SRC_OTHER)


def by_port(ports: Sequence[NodePortStats]) -> dict[int, dict[str, dict[str, int]]]:
    return {p.node_port: p.counts for p in ports}


class FakeNames(Interfaces):
    """Interfaces without the system: fixed names and groups."""

    def __init__(self, names: dict[int, str], groups: dict[int, str] | None = None) -> None:
        super().__init__(sys_net="/nonexistent", ifname=lambda i: names.get(i, f"if{i}"))
        self._fixed = groups or {}

    def _group_of(self, name: str) -> str:
        for idx, group in self._fixed.items():
            if self.name(idx) == name:
                return group
        return name


ETH0, CNI0, VETH, LO = 2, 3, 4, 1
NAMES = {ETH0: "eth0", CNI0: "cni0", VETH: "vethpod0", LO: "lo"}


def table(**kw: Any) -> HandshakeTable:
    kw.setdefault("interfaces", FakeNames(NAMES, {VETH: "cni0", CNI0: "cni0"}))
    return HandshakeTable(classify_by({POD: SRC_POD}), **kw)


def pkt(t: HandshakeTable, now: float, ifindex: int, pkttype: int, src: str, dst: str,
        sport: int, dport: int, flags: int) -> None:
    t.packet(now, ifindex, pkttype, ip_int(src), ip_int(dst), sport, dport, flags)


# --- the filter ------------------------------------------------------------------------

FAST, KEEP, DROP = bpf.FAST_SNAPLEN, bpf.DEFAULT_SNAPLEN, 0


OUT = PACKET_OUTGOING


@pytest.mark.parametrize("fr, pkttype, want", [
    # what the handshake table uses, in the direction it uses it
    (frame(CLIENT, NODE, 40000, OPEN, SYN), PACKET_HOST, FAST),
    (frame(CLIENT, NODE, 40000, OPEN, SYN), 3, FAST),  # PACKET_OTHERHOST: a bridge port
    (frame(NODE, CLIENT, OPEN, 40000, SYN | ACK), OUT, FAST),
    (frame(NODE, CLIENT, CLOSED, 40000, RST | ACK), OUT, FAST),
    (frame(NODE, CLIENT, CLOSED, 40000, RST), OUT, FAST),
    (frame(CLIENT, NODE, 40000, OPEN, RST), PACKET_HOST, FAST),
    # the same flags the other way round: never a NodePort handshake of this node
    (frame(CLIENT, NODE, 40000, OPEN, SYN), OUT, DROP),  # our own SYN to a NodePort
    (frame(NODE, CLIENT, OPEN, 40000, SYN | ACK), PACKET_HOST, DROP),
    (frame(CLIENT, NODE, 40000, OPEN, SYN | ACK), OUT, DROP),  # SYN-ACK *to* a NodePort
    (frame(CLIENT, NODE, 40000, OPEN, RST), OUT, DROP),
    (frame(NODE, CLIENT, OPEN, 40000, RST), PACKET_HOST, DROP),
    (frame(CLIENT, NODE, OPEN, 40000, SYN), PACKET_HOST, DROP),  # SYN *from* a NodePort
    # established traffic: the last ACK of the handshake, data, FIN, pure ACKs
    (frame(CLIENT, NODE, 40000, OPEN, ACK), PACKET_HOST, DROP),
    (frame(NODE, CLIENT, OPEN, 40000, ACK), OUT, DROP),
    (frame(NODE, CLIENT, OPEN, 40000, ACK | 0x08), OUT, DROP),  # PSH-ACK
    (frame(CLIENT, NODE, 40000, OPEN, 0x01 | ACK), PACKET_HOST, DROP),
])
def test_filter_passes_handshakes_by_direction(fr: bytes, pkttype: int, want: int) -> None:
    assert bpf.run(PROGRAM, fr, 1, pkttype) == min(want, len(fr))


@pytest.mark.parametrize("fr, hatype, want", [
    (frame(CLIENT, NODE, 40000, OPEN, SYN), 1, FAST),
    (frame(CLIENT, NODE, 40000, OPEN, RST), 1, FAST),
    (frame(CLIENT, NODE, 40000, 30000, SYN), 1, FAST),
    (frame(CLIENT, NODE, 40000, 32767, SYN), 1, FAST),
    (frame(CLIENT, NODE, 40000, 29999, SYN), 1, DROP),
    (frame(CLIENT, NODE, 40000, 32768, SYN), 1, DROP),
    (frame(CLIENT, NODE, 40000, OPEN, ACK), 1, DROP),  # data, FIN: not a handshake
    (frame(CLIENT, NODE, 40000, OPEN, 0x01 | ACK), 1, DROP),
    (frame(CLIENT, NODE, 40000, OPEN, SYN, frag=0x2001), 1, DROP),  # a later fragment
    (frame(CLIENT, NODE, 40000, OPEN, SYN, frag=0x2000), 1, FAST),  # first fragment
    (eth(ipv4(CLIENT, NODE, struct.pack("!HHHH", 40000, OPEN, 8, 0), proto=17)), 1, DROP),
    (ipv6_syn(OPEN), 1, KEEP),  # IPv6: tests/test_capture_ipv6.py has the cases
    (ipv6_syn(29999), 1, DROP),
    (frame(CLIENT, NODE, 40000, OPEN, SYN, options=b"\x01\x01\x01\x00"), 1, KEEP),
    # IP options that look like an in-range port where the TCP header would be at IHL 5
    (frame(CLIENT, NODE, 40000, 80, SYN, options=struct.pack("!HH", 30080, 30080)), 1, DROP),
    (frame(CLIENT, NODE, 40000, OPEN, SYN, vlans=[(0x8100, 5)]), 1, KEEP),
    (frame(CLIENT, NODE, 40000, OPEN, SYN, vlans=[(0x88A8, 5), (0x8100, 7)]), 1, KEEP),
    (frame(CLIENT, NODE, 40000, 80, SYN, vlans=[(0x8100, 5)]), 1, DROP),
    (frame(CLIENT, NODE, 40000, OPEN, SYN), 772, FAST),  # loopback: Ethernet-like
    (seg(CLIENT, NODE, 40000, OPEN, SYN), 0xFFFE, KEEP),  # header-less (wireguard, tun)
    (seg(CLIENT, NODE, 40000, OPEN, SYN), 768, KEEP),  # ipip
    (seg(CLIENT, NODE, 40000, OPEN, SYN), 32, DROP),  # infiniband: not parsed
    (frame(CLIENT, NODE, 40000, OPEN, SYN)[:14 + 20 + 13], 1, DROP),  # cut before flags
    (random.Random(20).randbytes(20), 1, DROP),  # (fixed: the ids must not vary)
    (b"", 1, DROP),
])
def test_filter_passes_only_nodeport_handshakes(fr: bytes, hatype: int, want: int) -> None:
    got = bpf.run(PROGRAM, fr, hatype)
    assert got == min(want, len(fr))


def test_filter_port_range_is_configurable_and_checked() -> None:
    prog = bpf.nodeport_filter((8000, 8080))
    assert bpf.run(prog, frame(CLIENT, NODE, 40000, 8080, SYN))
    assert not bpf.run(prog, frame(CLIENT, NODE, 40000, OPEN, SYN))
    with pytest.raises(ValueError):
        bpf.nodeport_filter((2, 1))
    with pytest.raises(ValueError):
        bpf.nodeport_filter(snaplen=64)


def test_filter_survives_random_frames() -> None:
    rnd = random.Random(7)
    for _ in range(3000):
        fr = bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 80)))
        assert bpf.run(PROGRAM, fr, rnd.choice((1, 772, 0xFFFE, 5))) in (0, FAST, len(fr),
                                                                         KEEP)


# --- the decoder ----------------------------------------------------------------------

def test_decoder_reads_plain_tagged_optioned_and_headerless_frames() -> None:
    d = Decoder()
    want = (ip_int(CLIENT), ip_int(NODE), 40000, OPEN, SYN)
    assert d.decode(frame(CLIENT, NODE, 40000, OPEN, SYN)) == want
    assert d.decode(frame(CLIENT, NODE, 40000, OPEN, SYN, vlans=[(0x8100, 9)])) == want
    assert d.decode(frame(CLIENT, NODE, 40000, OPEN, SYN,
                          vlans=[(0x88A8, 1), (0x8100, 9)])) == want
    assert d.decode(frame(CLIENT, NODE, 40000, OPEN, SYN, options=b"\x01" * 8)) == want
    assert d.decode(seg(CLIENT, NODE, 40000, OPEN, SYN), 0xFFFE) == want
    assert d.error_count == 0


@pytest.mark.parametrize("fr, hatype, reason", [
    (eth(b"\0" * 28, ethertype=0x0806), 1, NOT_IPV4),  # ARP
    (frame(CLIENT, NODE, 40000, OPEN, SYN)[:40], 1, TRUNCATED),
    (frame(CLIENT, NODE, 40000, OPEN, SYN)[:20], 1, TRUNCATED),
    (random.Random(10).randbytes(10), 1, TRUNCATED),
    (frame(CLIENT, NODE, 40000, OPEN, SYN, frag=0x0010), 1, FRAGMENT),
    (eth(ipv4(CLIENT, NODE, b"\0" * 8, proto=17)), 1, NOT_TCP),
    (eth(b"\x45" + b"\0" * 40, vlans=[(0x8100, 1)] * 3), 1, "bad header"),
    (eth(b"\x42" + b"\0" * 40), 1, "bad header"),  # IHL 2
    (seg(CLIENT, NODE, 40000, OPEN, SYN), 32, UNKNOWN_LINK),
])
def test_decoder_counts_what_it_rejects(fr: bytes, hatype: int, reason: str) -> None:
    d = Decoder()
    assert d.decode(fr, hatype) is None
    assert d.errors == {reason: 1}


def test_decoder_never_raises() -> None:
    d = Decoder()
    rnd = random.Random(3)
    base = frame(CLIENT, NODE, 40000, OPEN, SYN, options=b"\x01" * 4)
    for i in range(5000):
        if i % 2:
            fr = bytearray(base[:rnd.randrange(len(base) + 1)])
            for _ in range(rnd.randrange(4)):
                if fr:
                    fr[rnd.randrange(len(fr))] = rnd.randrange(256)
        else:
            fr = bytearray(rnd.randbytes(rnd.randrange(70)))
        d.decode(bytes(fr), rnd.choice((1, 0xFFFE, 9)))
    assert d.error_count > 0


# --- the handshake table ----------------------------------------------------------------

def test_table_outcomes() -> None:
    t = table(timeout=3.0)
    # answered through the interface the SYN came in on
    pkt(t, 0.0, ETH0, PACKET_HOST, CLIENT, NODE, 40001, OPEN, SYN)
    pkt(t, 0.0, ETH0, PACKET_OUTGOING, NODE, CLIENT, OPEN, 40001, SYN | ACK)
    # reset by the node
    pkt(t, 0.0, ETH0, PACKET_HOST, CLIENT, NODE, 40002, CLOSED, SYN)
    pkt(t, 0.0, ETH0, PACKET_OUTGOING, NODE, CLIENT, CLOSED, 40002, RST | ACK)
    # the loop: pod source on the uplink, the reply leaves through the pod bridge (seen
    # on cni0, then on its port), the pod answers RST
    pkt(t, 0.0, ETH0, PACKET_HOST, POD, NODE, 40003, OPEN, SYN)
    pkt(t, 0.0, CNI0, PACKET_OUTGOING, NODE, POD, OPEN, 40003, SYN | ACK)
    pkt(t, 0.0, VETH, PACKET_OUTGOING, NODE, POD, OPEN, 40003, SYN | ACK)
    pkt(t, 0.0, VETH, 3, POD, NODE, 40003, OPEN, RST)
    # bypassed, no RST from the peer
    pkt(t, 0.0, ETH0, PACKET_HOST, POD, NODE, 40004, OPEN, SYN)
    pkt(t, 0.0, CNI0, PACKET_OUTGOING, NODE, POD, OPEN, 40004, SYN | ACK)
    # dropped, retransmitted once
    pkt(t, 0.0, ETH0, PACKET_HOST, CLIENT, NODE, 40005, OPEN, SYN)
    pkt(t, 1.0, ETH0, PACKET_HOST, CLIENT, NODE, 40005, OPEN, SYN)
    # our own outgoing SYN to some NodePort elsewhere, and an incoming SYN-ACK: not ours
    pkt(t, 0.0, ETH0, PACKET_OUTGOING, NODE, CLIENT, 50000, OPEN, SYN)
    pkt(t, 0.0, ETH0, PACKET_HOST, CLIENT, NODE, OPEN, 50000, SYN | ACK)
    # still young at the end: pending
    pkt(t, 9.0, ETH0, PACKET_HOST, CLIENT, NODE, 40006, OPEN, SYN)
    assert t.syns == 6 and t.retransmissions == 1 and t.not_for_us == 2
    t.expire(3.5)
    assert t.unanswered == 1
    ports = t.finish(10.0)
    assert by_port(ports) == {
        OPEN: {ANSWERED: {SRC_OTHER: 1}, BYPASSED: {SRC_POD: 2},
               UNANSWERED: {SRC_OTHER: 1}, PENDING: {SRC_OTHER: 1}},
        CLOSED: {RESET: {SRC_OTHER: 1}},
    }
    assert {p.node_port: p.syns for p in ports} == {OPEN: 5, CLOSED: 1}
    loops = [s for p in ports for s in p.samples if s.outcome == BYPASSED]
    assert {(s.src, s.sport, s.in_iface, s.reply_iface, s.peer_reset) for s in loops} == {
        (POD, 40003, "eth0", "cni0", True), (POD, 40004, "eth0", "cni0", False)}
    reset = next(s for p in ports for s in p.samples if s.outcome == RESET)
    assert (reset.dst, reset.dport, reset.reply_iface) == (NODE, CLOSED, "eth0")


def test_table_stacked_devices_are_one_egress() -> None:
    # a SYN seen on a bridge port and again on the bridge: one SYN, no retransmission;
    # the reply leaving through the bridge is the same way back
    t = table()
    pkt(t, 0.0, VETH, 3, POD, NODE, 40000, OPEN, SYN)
    pkt(t, 0.0, CNI0, PACKET_HOST, POD, NODE, 40000, OPEN, SYN)
    pkt(t, 0.0, CNI0, PACKET_OUTGOING, NODE, POD, OPEN, 40000, SYN | ACK)
    assert (t.syns, t.retransmissions) == (1, 0)
    assert by_port(t.finish(1.0)) == {OPEN: {ANSWERED: {SRC_POD: 1}}}


def test_interfaces_groups_from_sysfs(tmp_path: Path) -> None:
    sysnet = tmp_path / "net"
    for name in ("eth0", "cni0", "vethpod0", "bond0", "ens1", "bond0.7", "br0"):
        (sysnet / name).mkdir(parents=True)
    (sysnet / "cni0" / "bridge").mkdir()
    (sysnet / "bond0" / "bonding").mkdir()
    (sysnet / "vethpod0" / "master").symlink_to("../cni0")
    (sysnet / "cni0" / "lower_vethpod0").symlink_to("../vethpod0")
    (sysnet / "ens1" / "master").symlink_to("../bond0")
    (sysnet / "bond0" / "lower_ens1").symlink_to("../ens1")
    (sysnet / "bond0.7" / "lower_bond0").symlink_to("../bond0")
    # a loop must not hang the lookup
    (sysnet / "br0" / "master").symlink_to("../br0")
    names = {1: "eth0", 2: "cni0", 3: "vethpod0", 4: "ens1", 5: "bond0.7", 6: "br0", 7: "gone"}
    ifs = Interfaces(sysnet, ifname=lambda i: names.get(i, f"if{i}"))
    assert [ifs.group(i) for i in range(1, 8)] == [
        "eth0", "cni0", "cni0", "bond0", "bond0", "br0", "gone"]
    assert ifs.same_egress(2, 3) and ifs.same_egress(4, 5) and not ifs.same_egress(1, 2)
    # a new pod's veth enslaved after we first looked at it
    (sysnet / "vethnew").mkdir()
    names[8] = "vethnew"
    assert ifs.group(8) == "vethnew"
    (sysnet / "vethnew" / "master").symlink_to("../cni0")
    assert ifs.same_egress(8, 2)


def test_table_bound_evicts_oldest_as_pending_and_memory_stays_flat() -> None:
    t = table(capacity=1000, timeout=3.0)
    rnd = random.Random(1)
    src_ips = [ip_int(f"10.1.{i // 250}.{i % 250 + 1}") for i in range(2000)]

    def flood(n: int) -> None:
        for i in range(n):
            t.packet(0.0, ETH0, PACKET_HOST, src_ips[i % 2000], ip_int(NODE),
                     rnd.randrange(1024, 65536), rnd.randrange(30000, 32768), SYN)
            assert len(t) <= 1000

    tracemalloc.start()
    try:
        flood(20_000)
        after_20k = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        flood(60_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # evicted in batches of capacity/16 (62): every SYN is either evicted or still held
    assert t.evictions + len(t) == 80_000
    assert 1000 - 62 < len(t) <= 1000
    # per-port counters (2768 ports x a few outcomes) and 3 samples each are allowed to
    # fill in; the table itself must not grow with the flood
    assert peak - after_20k < 512 * 1024, (after_20k, peak)
    ports = t.finish(1.0)
    total = sum(p.syns for p in ports)
    pending = sum(p.counts.get(PENDING, {}).get(SRC_OTHER, 0) for p in ports)
    answered = sum(sum(p.counts.get(ANSWERED, {}).values()) for p in ports)
    assert (total, pending, answered) == (80_000, 80_000, 0)
    assert all(len([s for s in p.samples if s.outcome == PENDING]) <= 3 for p in ports)


def _mixed_traffic(rnd: random.Random, n: int) -> list[tuple[int, int, bytes, int]]:
    """SYNs and replies of every kind, in plain, tagged, optioned and header-less frames,
    plus packets the filter drops."""
    out: list[tuple[int, int, bytes, int]] = []
    for i in range(n):
        src = rnd.choice((CLIENT, POD, "10.2.0.7"))
        sport, dport = 40000 + i, rnd.choice((OPEN, CLOSED, 30000, 32767))
        kw: dict[str, Any] = rnd.choice(({}, {}, {"vlans": [(0x8100, 3)]},
                                         {"options": b"\x01" * 4}))
        hatype = 1
        mk: Callable[..., bytes] = frame
        if rnd.random() < 0.1:
            hatype, mk, kw = 0xFFFE, seg, {}
        out.append((ETH0, PACKET_HOST, mk(src, NODE, sport, dport, SYN, **kw), hatype))
        fate = rnd.random()
        if fate < 0.4:
            out.append((ETH0, PACKET_OUTGOING, mk(NODE, src, dport, sport, SYN | ACK, **kw),
                        hatype))
        elif fate < 0.6:
            out.append((ETH0, PACKET_OUTGOING, mk(NODE, src, dport, sport, RST | ACK, **kw),
                        hatype))
        elif fate < 0.8:
            out.append((CNI0, PACKET_OUTGOING, mk(NODE, src, dport, sport, SYN | ACK, **kw),
                        hatype))
            if rnd.random() < 0.5:
                out.append((VETH, 3, mk(src, NODE, sport, dport, RST, **kw), hatype))
        if rnd.random() < 0.1:
            out.append((ETH0, PACKET_HOST, ipv6_syn(OPEN), 1))
            out.append((ETH0, PACKET_HOST, frame(src, NODE, sport, 80, SYN), 1))
    return out


def test_feed_block_equals_the_per_packet_path() -> None:
    rnd = random.Random(11)
    traffic = _mixed_traffic(rnd, 3000)
    fast = table(capacity=500)
    for i in range(0, len(traffic), 700):
        buf, off, num = ring_block(traffic[i:i + 700])
        fast.feed_block(buf, off, num, 0.0)
    slow = table(capacity=500)
    dec = Decoder()
    for ifindex, pkttype, fr, hatype in traffic:
        if bpf.run(PROGRAM, fr, hatype, pkttype):
            got = dec.decode(fr, hatype)
            assert got is not None
            slow.packet(0.0, ifindex, pkttype, *got)
    assert (fast.syns, fast.evictions, fast.packets) == (slow.syns, slow.evictions,
                                                         slow.packets)
    assert fast.decoder.error_count == 0
    assert fast.finish(1.0) == slow.finish(1.0)


def test_feed_block_counts_undecodable_records() -> None:
    # no filter: what a ring without (or with a looser) program would deliver
    recs = [(ETH0, PACKET_HOST, os.urandom(20), 1),
            (ETH0, PACKET_HOST, ipv6_syn(OPEN)[:60], 1),  # cut in the IPv6 header
            (ETH0, PACKET_HOST, frame(CLIENT, NODE, 40000, OPEN, SYN)[:40], 1),
            (ETH0, PACKET_HOST, seg(CLIENT, NODE, 40000, OPEN, SYN), 99),
            (ETH0, PACKET_HOST, frame(CLIENT, NODE, 40000, OPEN, SYN), 1)]
    t = table()
    buf, off, num = ring_block(recs, program=None)
    t.feed_block(buf, off, num, 0.0)
    assert t.decoder.error_count == 4 and t.syns == 1 and t.packets == 5


# --- the engine without privileges ----------------------------------------------------

def test_capture_unavailable_is_a_result_not_an_exception(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*a: Any, **kw: Any) -> socket.socket:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(ring.socket, "socket", denied)
    r = engine.capture(1.0, classify=classify_by({}))
    assert isinstance(r, CaptureResult) and r.ports == ()
    assert len(r.problems) == 1 and r.problems[0].startswith("capture unavailable: ")
    assert "CAP_NET_RAW" in r.problems[0]
    monkeypatch.delattr(ring.socket, "AF_PACKET")
    r = engine.capture(1.0, classify=classify_by({}))
    assert "AF_PACKET" in r.problems[0]


def test_capture_bad_arguments_are_a_result_not_an_exception() -> None:
    for kw in ({"port_range": (5, 1)}, {"table_size": 0}, {"port_range": (1, 70000)}):
        r = engine.capture(1.0, classify=classify_by({}), **kw)  # type: ignore[arg-type]
        assert r.problems and r.problems[0].startswith("capture unavailable: "), kw


def test_a_failing_classifier_costs_the_class_not_the_capture() -> None:
    def broken(ip: str) -> str:
        raise KeyError(ip)

    t = HandshakeTable(broken, interfaces=FakeNames(NAMES))
    pkt(t, 0.0, ETH0, PACKET_HOST, CLIENT, NODE, 40001, OPEN, SYN)
    pkt(t, 0.0, ETH0, PACKET_OUTGOING, NODE, CLIENT, OPEN, 40001, SYN | ACK)
    assert by_port(t.finish(1.0)) == {OPEN: {ANSWERED: {SRC_OTHER: 1}}}
    assert len(t.problems) == 1 and "classify(10.0.0.1) failed" in t.problems[0]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to drop CAP_NET_RAW")
def test_capture_without_cap_net_raw_says_why() -> None:
    proc = subprocess.run(
        ["setpriv", "--bounding-set", "-net_raw", "--inh-caps", "-net_raw", PY, "-c",
         "from agent.capture.engine import capture; "
         "print(capture(0.1, classify=str).problems)"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "capture unavailable" in proc.stdout and "CAP_NET_RAW" in proc.stdout


# --- real traffic in network namespaces ---------------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "iptables")),
    reason="needs root, ip and iptables")

# Runs inside the node namespace: capture, print the result as JSON. "ready" on stderr
# once the ring is open, so the test sends traffic only when it can be seen.
_CAPTURE = r"""
import json, sys, threading, time, tracemalloc
import agent.capture.engine as engine
from agent.snapshot import to_plain
args = json.loads(sys.argv[1])
classes = args.pop("classes")
seconds = args.pop("seconds")
stop = threading.Event()
stop_after = args.pop("stop_after", None)
if args.pop("tracemalloc", False):
    tracemalloc.start()
Ring = engine.Ring
class ReadyRing(Ring):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        print("ready", file=sys.stderr, flush=True)
        if stop_after is not None:
            threading.Timer(stop_after, stop.set).start()
engine.Ring = ReadyRing
calls = []
t0 = time.monotonic()
result = engine.capture(seconds, classify=lambda ip: classes.get(ip, "other"), stop=stop,
                        progress=lambda *a: calls.append(a), **args)
out = to_plain(result)
out["progress_calls"] = calls
out["wall"] = time.monotonic() - t0
if tracemalloc.is_tracing():
    out["traced_peak"] = tracemalloc.get_traced_memory()[1]
print(json.dumps(out))
"""

# Ring.packets() on its own, inside a namespace: a connection over lo while reading.
_RING = r"""
import json, socket, sys, threading, time
from agent.capture.packets import Decoder
from agent.capture.ring import Ring
port = int(sys.argv[1])
seen = []
with Ring() as ring:
    def hello():
        time.sleep(0.2)
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    threading.Thread(target=hello).start()
    dec = Decoder()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        for ts, ifindex, pkttype, hatype, fr in ring.packets(timeout=0.2):
            got = dec.decode(fr, hatype)
            seen.append([ring.ifname(ifindex), pkttype, hatype, len(fr), got and got[4],
                         got and got[2], got and got[3], abs(time.time() - ts) < 5])
    stats = ring.stats()
print(json.dumps({"seen": seen, "packets": stats.packets, "drops": stats.drops,
                  "errors": dec.error_count, "ring_bytes": ring.ring_bytes}))
"""

# Accepts and closes connections on the given ports.
_SERVER = r"""
import select, socket, sys
socks = []
for port in sys.argv[1:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(port)))
    s.listen(512)
    socks.append(s)
print("listening", flush=True)
while True:
    for s in select.select(socks, [], [])[0]:
        c, _ = s.accept()
        c.close()
"""

# Sends hex frames (one per stdin line) out of an interface through AF_PACKET.
_SEND = r"""
import socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((sys.argv[1], 0))
for line in sys.stdin:
    if line.strip():
        s.send(bytes.fromhex(line.strip()))
"""

_CONNECT = r"""
import socket, sys
src, dst, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
s = socket.socket()
s.bind((src, 0))
s.settimeout(timeout)
try:
    s.connect((dst, port))
    print("connected")
except OSError as e:
    print(type(e).__name__)
finally:
    s.close()
"""


@dataclass
class Lab:
    node: Netns
    client: Netns
    pod: Netns
    node_mac: bytes
    client_mac: bytes


def _mac(ns: Netns, ifname: str) -> bytes:
    info = json.loads(ns.run("ip", "-j", "link", "show", ifname).stdout)[0]
    return bytes.fromhex(info["address"].replace(":", ""))


def _wait_up(ns: Netns, *ifnames: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        infos = json.loads(ns.run("ip", "-j", "link", "show").stdout)
        states = {i["ifname"]: i.get("operstate") for i in infos}
        if all(states.get(n) == "UP" for n in ifnames):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"links not up in {ns.name}: {states}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with netns("lbcn") as node, netns("lbcc") as client, netns("lbcp") as pod:
        veth(node, "eth0", client, "eth0")
        node.run("ip", "link", "add", "cni0", "type", "bridge")
        veth(pod, "eth0", node, "vethpod0")
        node.sh(f"""
            sysctl -q -w net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
            ip addr add {NODE}/24 dev eth0
            ip link set eth0 up
            sysctl -q -w net.ipv4.conf.eth0.rp_filter=0
            ip link set vethpod0 master cni0
            ip link set vethpod0 up
            ip addr add 172.16.1.1/24 dev cni0
            ip link set cni0 up
            sysctl -q -w net.ipv4.conf.cni0.rp_filter=0
            iptables -w -A INPUT -s {CLIENT_DROPPED} -j DROP
            iptables -w -A INPUT -s 10.0.3.0/24 -j DROP
            iptables -w -A INPUT -p tcp --dport {INJECT_PORT} -j DROP
        """)
        client.sh(f"""
            ip addr add {CLIENT}/24 dev eth0
            ip addr add {CLIENT_DROPPED}/24 dev eth0
            ip link set eth0 up
        """)
        pod.sh(f"""
            ip addr add {POD}/24 dev eth0
            ip link set eth0 up
            ip route add default via 172.16.1.1 dev eth0
        """)
        _wait_up(node, "eth0", "cni0")
        server = node.popen([PY, "-c", _SERVER, str(OPEN), str(CHURN_PORT)],
                            stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None and server.stdout.readline() == "listening\n"
            # ARP/neighbour entries first: the capture tests send raw frames
            client.run(PY, "-c", _CONNECT, CLIENT, NODE, str(OPEN), "2")
            pod.run(PY, "-c", _CONNECT, POD, "172.16.1.1", str(OPEN), "2")
            yield Lab(node, client, pod, _mac(node, "eth0"), _mac(client, "eth0"))
        finally:
            server.kill()
            server.wait()


class Capture:
    """``capture()`` running inside the node namespace."""

    def __init__(self, ns: Netns, **args: Any) -> None:
        self.proc = ns.popen([PY, "-c", _CAPTURE, json.dumps(args)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        assert line == "ready\n", line + self.proc.stderr.read()

    def result(self, timeout: float = 30) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        got: dict[str, Any] = json.loads(out)
        return got


def send_frames(ns: Netns, ifname: str, frames: Sequence[bytes]) -> None:
    ns.run(PY, "-c", _SEND, ifname, input="".join(f.hex() + "\n" for f in frames))


def connect(ns: Netns, src: str, port: int, timeout: float = 2.0, dst: str = NODE) -> str:
    return ns.run(PY, "-c", _CONNECT, src, dst, str(port), str(timeout)).stdout.strip()


def counts(result: dict[str, Any]) -> dict[int, dict[str, dict[str, int]]]:
    return {p["node_port"]: p["counts"] for p in result["ports"]}


@pytest.mark.netns
@needs_root
def test_capture_sees_answered_reset_unanswered_and_bypassed(lab: Lab) -> None:
    cap = Capture(lab.node, seconds=4.0, handshake_timeout=1.0, classes={POD: SRC_POD})
    to_node = {"dst_mac": lab.node_mac, "src_mac": lab.client_mac}
    # (a) normal connections
    for _ in range(3):
        assert connect(lab.client, CLIENT, OPEN) == "connected"
    # (b) a closed NodePort
    assert connect(lab.client, CLIENT, CLOSED) == "ConnectionRefusedError"
    # (c) a source the node drops (one SYN: the connect gives up before the first RTO)
    assert connect(lab.client, CLIENT_DROPPED, OPEN, timeout=0.5) == "TimeoutError"
    send_frames(lab.client, "eth0", [
        # (d) the loop: a SYN from the pod's address on the uplink. The node answers
        # through cni0, straight to the pod, which answers RST.
        frame(POD, NODE, 41000, OPEN, SYN, **to_node),
        # odd frames: a priority-tagged SYN (answered), a SYN with IP options
        # (answered), an IPv6 SYN (captured; unanswered: the node has no IPv6 address),
        # a truncated SYN and garbage (both filtered)
        frame(CLIENT, NODE, 41001, OPEN, SYN, vlans=[(0x8100, 0)], **to_node),
        frame(CLIENT, NODE, 41002, OPEN, SYN, options=b"\x01\x01\x01\x00", **to_node),
        ipv6_syn(OPEN, **to_node),
        frame(CLIENT, NODE, 41003, OPEN, SYN, **to_node)[:44],
        lab.node_mac + os.urandom(14),
        # SYNs the node drops; their replies are injected below
        frame("10.0.0.7", NODE, 41004, INJECT_PORT, SYN, **to_node),
        frame("10.0.0.8", NODE, 41005, INJECT_PORT, SYN, **to_node),
    ])
    # An outgoing SYN-ACK with its VLAN tag still in the frame, and an outgoing RST with
    # IP options, sent from the node itself (what AF_PACKET sees as OUTGOING): the
    # filter's tagged and optioned paths, on real kernel rings.
    send_frames(lab.node, "eth0", [
        frame(NODE, "10.0.0.7", INJECT_PORT, 41004, SYN | ACK, vlans=[(0x8100, 0)],
              dst_mac=lab.client_mac, src_mac=lab.node_mac),
        frame(NODE, "10.0.0.8", INJECT_PORT, 41005, RST | ACK, options=b"\x01" * 4,
              dst_mac=lab.client_mac, src_mac=lab.node_mac),
    ])
    result = cap.result()
    assert result["problems"] == [] and result["kernel_drops"] == 0
    assert result["decode_errors"] == 0 and result["table_evictions"] == 0
    got = counts(result)
    assert got[OPEN] == {ANSWERED: {SRC_OTHER: 5}, BYPASSED: {SRC_POD: 1},
                         UNANSWERED: {SRC_OTHER: 2}}, got
    assert got[CLOSED] == {RESET: {SRC_OTHER: 1}}
    assert got[INJECT_PORT] == {ANSWERED: {SRC_OTHER: 1}, RESET: {SRC_OTHER: 1}}
    samples = [s for p in result["ports"] for s in p["samples"]]
    loop = [s for s in samples if s["outcome"] == BYPASSED]
    assert loop == [{"src": POD, "sport": 41000, "dst": NODE, "dport": OPEN,
                     "in_iface": "eth0", "outcome": BYPASSED, "source_class": SRC_POD,
                     "reply_iface": "cni0", "peer_reset": True}]
    dropped = [s for s in samples if s["outcome"] == UNANSWERED]
    assert sorted((s["src"], s["reply_iface"]) for s in dropped) == [
        (CLIENT_DROPPED, None), ("fd00::1", None)]
    # about once a second, then 0 seconds left at the end of the capture phase
    calls = result["progress_calls"]
    assert len(calls) >= 3 and calls[-1][0] == 0 and calls[-1][1] == 11
    assert [c[1] for c in calls] == sorted(c[1] for c in calls)


@pytest.mark.netns
@needs_root
def test_ring_yields_packets_with_interface_direction_and_link_type(lab: Lab) -> None:
    got = json.loads(lab.node.run(PY, "-c", _RING, str(OPEN)).stdout)
    # lo carries each packet twice: as it leaves (OUTGOING) and as it arrives (HOST);
    # the filter keeps the SYN arriving and the SYN-ACK leaving. Its frames have an
    # all-zero Ethernet header (ARPHRD_LOOPBACK)
    syns = [s for s in got["seen"] if s[4] == SYN]
    assert [s[:5] for s in syns] == [["lo", PACKET_HOST, 772, FAST, SYN]]
    synacks = [s for s in got["seen"] if s[4] == SYN | ACK]
    assert [s[:2] for s in synacks] == [["lo", PACKET_OUTGOING]], synacks
    assert all(s[5] == OPEN for s in synacks), synacks
    assert all(s[6] == OPEN for s in syns) and all(s[7] for s in got["seen"])
    assert got["errors"] == 0 and got["drops"] == 0
    # only what the filter passes: the SYN as it arrives, the SYN-ACK as it leaves; not
    # the other sighting of each on lo, no ACK, data or FIN
    assert got["packets"] == len(got["seen"]) == 2
    assert got["ring_bytes"] == ring.DEFAULT_RING_BYTES


@pytest.mark.netns
@needs_root
def test_capture_stops_on_request(lab: Lab) -> None:
    cap = Capture(lab.node, seconds=60.0, classes={}, stop_after=0.5)
    assert connect(lab.client, CLIENT, OPEN) == "connected"
    result = cap.result()
    assert result["wall"] < 5 and result["problems"] == []
    assert counts(result) == {OPEN: {ANSWERED: {SRC_OTHER: 1}}}


@pytest.mark.netns
@needs_root
def test_capture_flood_beyond_the_table_bound(lab: Lab) -> None:
    rnd = random.Random(5)
    syns = [frame(f"10.0.3.{i % 250 + 1}", NODE, 1024 + i, rnd.randrange(30000, 32768), SYN,
                  dst_mac=lab.node_mac, src_mac=lab.client_mac) for i in range(5000)]
    cap = Capture(lab.node, seconds=2.0, handshake_timeout=1.0, table_size=1000,
                  classes={}, tracemalloc=True)
    send_frames(lab.client, "eth0", syns)
    result = cap.result()
    assert result["problems"] == [] and result["kernel_drops"] == 0
    assert result["table_capacity"] == 1000
    evicted = result["table_evictions"]
    assert 4000 <= evicted < 4000 + 62  # batches of capacity/16
    got = counts(result)
    total = {o: sum(c.get(o, {}).get(SRC_OTHER, 0) for c in got.values())
             for o in (PENDING, UNANSWERED, ANSWERED)}
    # evicted handshakes are pending, never answered; the ones still held timed out
    assert total == {PENDING: evicted, UNANSWERED: 5000 - evicted, ANSWERED: 0}
    assert sum(p["syns"] for p in result["ports"]) == 5000
    # the bound holds memory: 1000 entries plus per-port counters and samples
    assert result["traced_peak"] < 6 * 1024 * 1024, result["traced_peak"]


@pytest.mark.netns
@needs_root
def test_capture_survives_interfaces_that_come_and_go(lab: Lab) -> None:
    cap = Capture(lab.node, seconds=3.0, handshake_timeout=0.5, classes={})
    answered = 0
    for i in range(4):
        with netns("lbcx") as churn:
            veth(lab.node, f"vt{i}", churn, "eth0")
            lab.node.sh(f"ip addr add 10.9.{i}.1/24 dev vt{i}; ip link set vt{i} up")
            churn.sh(f"ip addr add 10.9.{i}.2/24 dev eth0; ip link set eth0 up")
            lab.node.run("ip", "link", "add", f"br{i}", "type", "bridge")
            _wait_up(churn, "eth0")
            if connect(churn, f"10.9.{i}.2", CHURN_PORT, dst=f"10.9.{i}.1") == "connected":
                answered += 1
            # gone while the capture may still hold its packets and names
            lab.node.run("ip", "link", "del", f"vt{i}")
            lab.node.run("ip", "link", "del", f"br{i}")
    result = cap.result()
    assert result["problems"] == [] and result["kernel_drops"] == 0
    assert answered == 4
    assert counts(result)[CHURN_PORT] == {ANSWERED: {SRC_OTHER: 4}}
    names = {s["in_iface"] for p in result["ports"] for s in p["samples"]}
    assert names <= {f"vt{i}" for i in range(4)} | {f"if{n}" for n in range(1000)}


# --- review fixes -------------------------------------------------------------------------


def test_syns_to_other_hosts_are_not_nodeport_handshakes() -> None:
    """A pod's SYN to another host's port 31000, forwarded through this node, is no
    NodePort handshake; only SYNs to the node's own addresses are."""
    t = table(local_addresses=[NODE, "10.96.0.10"])
    pkt(t, 0.0, VETH, PACKET_HOST, POD, "203.0.113.9", 40000, 31000, SYN)
    pkt(t, 0.0, ETH0, PACKET_HOST, POD, NODE, 40001, OPEN, SYN)
    assert t.syns == 1
    got = {p.node_port: p.counts for p in t.finish(10.0)}
    assert got == {OPEN: {"unanswered": {SRC_POD: 1}}}


def test_a_syn_ack_looped_to_lo_and_reset_there_is_no_peer_reset() -> None:
    """accept_local=1: the reply to a VIP-sourced SYN goes to lo and the node's own stack
    resets it; that is no client expecting the load balancer."""
    t = table()
    pkt(t, 0.0, ETH0, PACKET_HOST, "10.0.1.10", NODE, 40000, OPEN, SYN)
    pkt(t, 0.0, LO, PACKET_OUTGOING, NODE, "10.0.1.10", OPEN, 40000, SYN | ACK)
    pkt(t, 0.0, LO, PACKET_HOST, "10.0.1.10", NODE, 40000, OPEN, RST)
    (port,) = t.finish(1.0)
    (sample,) = [s for s in port.samples if s.outcome == "bypassed"]
    assert sample.reply_iface == "lo" and sample.peer_reset is False


def test_a_failing_progress_callback_does_not_end_the_capture() -> None:
    from agent.capture.engine import _guarded

    problems: list[str] = []
    calls: list[float] = []

    def progress(left: float, syns: int, unanswered: int) -> None:
        calls.append(left)
        raise BrokenPipeError("stderr closed")

    guarded = _guarded(progress, problems)
    guarded(3.0, 0, 0)
    guarded(2.0, 0, 0)  # not called again, no exception
    assert calls == [3.0]
    assert problems == ["progress output stopped: BrokenPipeError: stderr closed"]


def test_retransmissions_after_the_timeout_are_not_new_handshakes() -> None:
    """Linux retransmits a dropped SYN at 1, 3, 7, 15 s: one handshake, unanswered once."""
    t = table(timeout=3.0)
    for at in (0.0, 1.0, 3.0, 7.0, 15.0):
        t.expire(at)
        pkt(t, at, ETH0, PACKET_HOST, POD, NODE, 40000, OPEN, SYN)
        t.expire(at)
    (port,) = t.finish(30.0)
    assert t.syns == 1 and t.retransmissions == 4
    assert port.counts == {"unanswered": {SRC_POD: 1}}
    assert len(port.samples) == 1


def test_retransmissions_after_the_timeout_on_the_block_path() -> None:
    t = table(timeout=3.0)
    for at in (0.0, 1.0, 3.0, 7.0, 15.0):
        t.expire(at)
        buf, off, num = ring_block([(ETH0, PACKET_HOST, frame(POD, NODE, 40000, OPEN, SYN), 1)])
        t.feed_block(buf, off, num, at)
        t.expire(at)
    (port,) = t.finish(30.0)
    assert t.syns == 1 and t.retransmissions == 4
    assert port.counts == {"unanswered": {SRC_POD: 1}}


def test_filter_passes_exactly_what_the_table_uses() -> None:
    """Every flag combination, direction and port side: the kernel filter passes a packet
    if and only if the handshake table would act on it (not count it "not for us")."""
    t = table()
    for flags in range(64):
        for pkttype in (PACKET_HOST, 3, PACKET_OUTGOING):
            for sport, dport in ((40000, OPEN), (OPEN, 40000), (OPEN, 31000), (80, 40000)):
                before = t.not_for_us
                pkt(t, 0.0, ETH0, pkttype, CLIENT, NODE, sport, dport, flags)
                used = t.not_for_us == before
                passed = bpf.run(PROGRAM, frame(CLIENT, NODE, sport, dport, flags), 1,
                                 pkttype) > 0
                assert passed == used, (flags, pkttype, sport, dport)


# A sink on a NodePort-range port: reads until EOF, prints the bytes.
_SINK = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
n = 0
while chunk := c.recv(1 << 16):
    n += len(chunk)
c.close()
print(n, flush=True)
"""

# Bulk data over one connection: ``mib`` MiB, then a normal close.
_BULK = r"""
import socket, sys
dst, port, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((dst, port), timeout=30)
block = b"x" * (1 << 20)
for _ in range(mib):
    s.sendall(block)
s.shutdown(socket.SHUT_WR)
s.close()
print("sent", flush=True)
"""


def _tcp_segs(ns: Netns) -> tuple[int, int]:
    """(InSegs, OutSegs) of the namespace's TCP (/proc/net/snmp is per namespace)."""
    lines = [ln.split() for ln in ns.run("cat", "/proc/net/snmp").stdout.splitlines()
             if ln.startswith("Tcp:")]
    row = dict(zip(lines[0], lines[1], strict=True))
    return int(row["InSegs"]), int(row["OutSegs"])


@pytest.mark.netns
@needs_root
def test_established_bulk_traffic_on_a_nodeport_never_reaches_the_agent(lab: Lab) -> None:
    """64 MiB over one connection to a NodePort-range port while the capture runs: the
    kernel filter passes the handshake (SYN in, SYN-ACK out) and nothing of the data, its
    ACKs or the FINs; the ring's own counter (PACKET_STATISTICS) says so."""
    port = 30500
    sink = lab.node.popen([PY, "-c", _SINK, str(port)], stdout=subprocess.PIPE)
    try:
        assert sink.stdout is not None and sink.stdout.readline() == "listening\n"
        cap = Capture(lab.node, seconds=2.5, handshake_timeout=0.5, classes={})
        segs0 = _tcp_segs(lab.node)
        assert lab.client.run(PY, "-c", _BULK, NODE, str(port), "64").stdout == "sent\n"
        received = int(sink.stdout.readline())
        segs1 = _tcp_segs(lab.node)
        result = cap.result()
    finally:
        sink.kill()
        sink.wait()
    assert received == 64 << 20
    in_segs, out_segs = segs1[0] - segs0[0], segs1[1] - segs0[1]
    assert in_segs + out_segs > 1000, (in_segs, out_segs)  # the data really went by
    assert result["problems"] == [] and result["kernel_drops"] == 0
    # SYN in and SYN-ACK out on eth0; nothing else of the connection
    assert result["kernel_packets"] == result["packets_seen"] == 2, result
    assert counts(result) == {port: {ANSWERED: {SRC_OTHER: 1}}}


@pytest.mark.netns
@needs_root
def test_pod_behind_the_bridge_and_the_node_itself_to_a_nodeport(lab: Lab) -> None:
    """Real packets the direction-aware filter must keep: a pod's SYN crosses its veth
    (a bridge port: PACKET_OTHERHOST, the frame is for cni0's MAC) and then cni0
    (PACKET_HOST), the node's SYN-ACK leaves through cni0 and the veth (OUTGOING); the
    node's own connection to its NodePort is seen on lo twice (OUTGOING and HOST). Each
    is one answered handshake, none taken for a loop."""
    cap = Capture(lab.node, seconds=3.0, handshake_timeout=1.0, classes={POD: SRC_POD})
    assert connect(lab.pod, POD, OPEN, dst="172.16.1.1") == "connected"
    assert connect(lab.pod, POD, OPEN, dst=NODE) == "connected"
    assert connect(lab.node, NODE, OPEN, dst=NODE) == "connected"
    result = cap.result()
    assert result["problems"] == [] and result["kernel_drops"] == 0
    assert counts(result) == {OPEN: {ANSWERED: {SRC_POD: 2, SRC_OTHER: 1}}}, counts(result)
