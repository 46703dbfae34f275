"""IPv6 NodePort handshakes in the capture: the BPF filter (interpreted, on frames scapy
builds, and attached to a real socket in a namespace), the decoder, the handshake table
and the source classes. The IPv4 cases stay in tests/test_capture_engine.py; these check
that IPv6 joins without changing them."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import (
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
    PadN,
)
from scapy.layers.ipsec import AH
from scapy.layers.l2 import Dot1AD, Dot1Q, Ether
from scapy.packet import Packet

from agent.bundle import load_bundle
from agent.capture import bpf
from agent.capture.classify import ipv6_pod_prefixes, make_classifier
from agent.capture.handshakes import HandshakeTable
from agent.capture.model import (
    ANSWERED,
    BYPASSED,
    RESET,
    SRC_LB,
    SRC_LOCAL,
    SRC_OTHER,
    SRC_POD,
    UNANSWERED,
    CaptureResult,
)
from agent.capture.packets import (
    FRAGMENT,
    NOT_TCP,
    TRUNCATED,
    Decoder,
    ip_int,
    ip_text,
    wire_ip_text,
)
from agent.capture.ring import PACKET_HOST, PACKET_OUTGOING
from agent.diagnose import diagnose
from agent.snapshot import Address
from lab.netns import Netns, netns, veth
from tests.nodestate import settle
from tests.test_capture_engine import (
    ETH0,
    LO,
    VETH,
    FakeNames,
    frame,
    ring_block,
    send_frames,
)

PY = sys.executable
PROGRAM = bpf.nodeport_filter()
FAST, KEEP, DROP = bpf.FAST_SNAPLEN, bpf.DEFAULT_SNAPLEN, 0
OUT = PACKET_OUTGOING
CLIENT6, NODE6, VIP6, POD6 = "2001:db8:1::20", "2001:db8:1::10", "2001:db8:ff::7", "fd00:10::5"
PORT = 30080
ELSEWHERE = "2001:db8:1::99"  # on the link, but nobody's
MACS = {"src": "02:00:00:00:00:01", "dst": "02:00:00:00:00:02"}


def v6(l4: Packet, *, src: str = CLIENT6, dst: str = NODE6, ext: Packet | None = None,
       vlans: tuple[Packet, ...] = (), raw: bool = False) -> bytes:
    """A frame scapy builds: Ethernet (with ``vlans``), IPv6, ``ext`` headers, ``l4``;
    ``raw``: from the IPv6 header on (a header-less device)."""
    ip = IPv6(src=src, dst=dst)
    if ext is not None:
        ip = ip / ext
    ip = ip / l4
    if raw:
        return bytes(ip)
    link = Ether(**MACS)
    for tag in vlans:
        link = link / tag
    return bytes(link / ip)


def syn(dport: int = PORT, sport: int = 40000, flags: str = "S") -> Packet:
    return TCP(sport=sport, dport=dport, flags=flags)


def synack(sport: int = PORT, dport: int = 40000) -> Packet:
    return TCP(sport=sport, dport=dport, flags="SA")


FRAG0 = IPv6ExtHdrFragment(offset=0, m=1, id=7)
FRAG_LATER = IPv6ExtHdrFragment(offset=8, m=0, id=7)
BIG_OPTS = IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * 60)])  # 64 bytes


# --- the filter, interpreted ------------------------------------------------------------

@pytest.mark.parametrize("fr, hatype, pkttype, want", [
    # what the handshake table uses, in the direction it uses it
    (v6(syn()), 1, PACKET_HOST, KEEP),
    (v6(syn()), 1, 3, KEEP),  # PACKET_OTHERHOST: a bridge port
    (v6(synack(), src=NODE6, dst=CLIENT6), 1, OUT, KEEP),
    (v6(TCP(sport=PORT, dport=40000, flags="RA"), src=NODE6, dst=CLIENT6), 1, OUT, KEEP),
    (v6(syn(flags="R")), 1, PACKET_HOST, KEEP),  # the client's RST to a bypassed SYN-ACK
    # the same flags the other way round, and what is no handshake
    (v6(syn()), 1, OUT, DROP),  # our own SYN to a NodePort
    (v6(synack(), src=NODE6, dst=CLIENT6), 1, PACKET_HOST, DROP),
    (v6(syn(flags="A")), 1, PACKET_HOST, DROP),
    (v6(syn(flags="FA")), 1, PACKET_HOST, DROP),
    (v6(syn(dport=80)), 1, PACKET_HOST, DROP),
    (v6(syn(dport=29999)), 1, PACKET_HOST, DROP),
    (v6(syn(dport=32767)), 1, PACKET_HOST, KEEP),
    (v6(UDP(sport=40000, dport=PORT)), 1, PACKET_HOST, DROP),
    # link layers: tags, loopback, header-less devices (wireguard, ip6tnl, tun)
    (v6(syn(), vlans=(Dot1Q(vlan=5),)), 1, PACKET_HOST, KEEP),
    (v6(syn(), vlans=(Dot1AD(vlan=1), Dot1Q(vlan=7))), 1, PACKET_HOST, KEEP),
    (v6(syn(dport=80), vlans=(Dot1Q(vlan=5),)), 1, PACKET_HOST, DROP),
    (v6(syn()), 772, PACKET_HOST, KEEP),
    (v6(syn(), raw=True), 0xFFFE, PACKET_HOST, KEEP),
    (v6(syn(), raw=True), 769, PACKET_HOST, KEEP),
    (v6(syn(dport=80), raw=True), 0xFFFE, PACKET_HOST, DROP),
    (v6(syn(), raw=True), 32, PACKET_HOST, DROP),  # infiniband: not parsed
    # extension headers: the common ones walked, at most three
    (v6(syn(), ext=IPv6ExtHdrHopByHop()), 1, PACKET_HOST, KEEP),
    (v6(syn(), ext=FRAG0), 1, PACKET_HOST, KEEP),  # first fragment: has the TCP header
    (v6(syn(), ext=FRAG_LATER), 1, PACKET_HOST, DROP),
    (v6(syn(), ext=IPv6ExtHdrHopByHop() / IPv6ExtHdrRouting() / FRAG0), 1, PACKET_HOST,
     KEEP),
    (v6(syn(), ext=IPv6ExtHdrHopByHop() / IPv6ExtHdrDestOpt() / IPv6ExtHdrRouting()
        / IPv6ExtHdrDestOpt()), 1, PACKET_HOST, DROP),  # four: beyond the walk
    (v6(syn(dport=80), ext=IPv6ExtHdrHopByHop()), 1, PACKET_HOST, DROP),
    (v6(syn(), ext=AH()), 1, PACKET_HOST, DROP),  # not walked
    (v6(syn(), ext=BIG_OPTS), 1, PACKET_HOST, DROP),  # TCP flags beyond the snap length
    (v6(syn(), ext=IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * 20)])), 1,
     PACKET_HOST, KEEP),
    (v6(syn(), ext=IPv6ExtHdrDestOpt(), raw=True), 0xFFFE, PACKET_HOST, KEEP),
    # broken: cut before the flags, an IPv4 header under the IPv6 EtherType
    (v6(syn())[:14 + 40 + 13], 1, PACKET_HOST, DROP),
    (bytes(Ether(type=0x86DD, **MACS) / IP(src="10.0.0.1", dst="10.0.0.10")
           / syn()), 1, PACKET_HOST, DROP),
    (bytes(Ether(type=0x0800, **MACS)) + v6(syn(), raw=True), 1, PACKET_HOST, DROP),
])
def test_filter_passes_ipv6_nodeport_handshakes(fr: bytes, hatype: int, pkttype: int,
                                                want: int) -> None:
    assert bpf.run(PROGRAM, fr, hatype, pkttype) == min(want, len(fr))


def test_ipv4_frames_keep_their_fast_length() -> None:
    """The IPv4 fast path is untouched: a plain frame is still cut at FAST_SNAPLEN, which
    no IPv6 frame ever is (the reader's fast path keys on it)."""
    assert bpf.run(PROGRAM, frame("10.0.0.1", "10.0.0.10", 40000, PORT, 0x02), 1) == FAST
    assert bpf.run(PROGRAM, v6(syn()), 1) != FAST


def test_filter_loads_scratch_memory_only_after_storing_it() -> None:
    """The kernel's checker rejects a program that may read M[k] before writing it; the
    interpreter raises instead. Every path through the extension-header walk stores."""
    for ext in (None, IPv6ExtHdrHopByHop(), FRAG0, FRAG_LATER, IPv6ExtHdrHopByHop()
                / IPv6ExtHdrRouting() / IPv6ExtHdrDestOpt() / IPv6ExtHdrDestOpt()):
        bpf.run(PROGRAM, v6(syn(), ext=ext), 1)
    assert len(PROGRAM) < 4096  # BPF_MAXINSNS


# --- the decoder ----------------------------------------------------------------------

@pytest.mark.parametrize("fr, hatype", [
    (v6(syn()), 1),
    (v6(syn(), vlans=(Dot1Q(vlan=5),)), 1),
    (v6(syn(), vlans=(Dot1AD(vlan=1), Dot1Q(vlan=7))), 1),
    (v6(syn(), raw=True), 0xFFFE),
    (v6(syn(), ext=IPv6ExtHdrHopByHop()), 1),
    (v6(syn(), ext=IPv6ExtHdrHopByHop() / IPv6ExtHdrRouting() / FRAG0), 1),
    (v6(syn(), ext=IPv6ExtHdrDestOpt(), raw=True), 0xFFFE),
    (v6(syn(), ext=IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * 20)])), 1),
])
def test_decoder_reads_ipv6(fr: bytes, hatype: int) -> None:
    d = Decoder()
    kept = bpf.run(PROGRAM, fr, hatype)
    assert kept  # the filter passes it ...
    got = d.decode(fr[:kept], hatype)  # ... and what it keeps decodes
    assert got == (ip_int(CLIENT6), ip_int(NODE6), 40000, PORT, 0x02)
    assert isinstance(got[0], bytes) and len(got[0]) == 16
    assert d.error_count == 0


@pytest.mark.parametrize("fr, reason", [
    (v6(syn(), ext=FRAG_LATER), FRAGMENT),
    (v6(syn(), ext=AH()), NOT_TCP),
    (v6(UDP(sport=1, dport=PORT)), NOT_TCP),
    (v6(syn(), ext=IPv6ExtHdrHopByHop() / IPv6ExtHdrDestOpt() / IPv6ExtHdrRouting()
        / IPv6ExtHdrDestOpt()), NOT_TCP),
    (v6(syn())[:14 + 30], TRUNCATED),
    (v6(syn(), ext=IPv6ExtHdrHopByHop())[:14 + 40 + 4], TRUNCATED),
    (v6(syn(), ext=IPv6ExtHdrHopByHop())[:14 + 48 + 10], TRUNCATED),
])
def test_decoder_rejects_what_the_filter_rejects(fr: bytes, reason: str) -> None:
    d = Decoder()
    assert d.decode(fr) is None and d.errors == {reason: 1}
    assert bpf.run(PROGRAM, fr, 1) == 0


def test_what_the_filter_keeps_the_decoder_reads() -> None:
    """Mutated IPv6 frames (headers, extension headers, tags, header-less): the decoder
    never raises, and every frame the filter keeps decodes to a TCP packet (the reader
    never meets a kept frame it cannot read)."""
    rnd = random.Random(6)
    bases = [(v6(syn()), 1), (v6(syn(), vlans=(Dot1Q(vlan=5),)), 1),
             (v6(syn(), ext=IPv6ExtHdrHopByHop() / FRAG0), 1),
             (v6(syn(), ext=IPv6ExtHdrRouting() / IPv6ExtHdrDestOpt()), 1),
             (v6(syn(), raw=True), 0xFFFE), (v6(synack(), ext=FRAG0, raw=True), 0xFFFE)]
    d = Decoder()
    kept = 0
    for _ in range(4000):
        base, hatype = rnd.choice(bases)
        fr = bytearray(base)
        for _ in range(rnd.randrange(1, 4)):
            i = rnd.randrange(min(len(fr), 90))
            fr[i] = rnd.choice((rnd.randrange(256), 0, 6, 43, 44, 60, 0x60, 0x86, 0xDD))
        if rnd.random() < 0.3:  # (a frame cut short: the filter drops it, as its IPv6
            fr = fr[:rnd.randrange(40, len(fr) + 1)]  # payload length is then a lie)
        for pkttype in (PACKET_HOST, OUT):
            n = bpf.run(PROGRAM, bytes(fr), hatype, pkttype)
            got = d.decode(bytes(fr), hatype)  # never raises
            if n:
                kept += 1
                assert d.decode(bytes(fr[:n]), hatype) is not None, (fr.hex(), hatype)
                assert got is not None
    assert kept > 500


def test_ipv6_text_is_canonical() -> None:
    for text in ("2001:DB8:0:0::7", "2001:db8::7", "2001:0db8:0000::0007"):
        assert ip_text(ip_int(text)) == "2001:db8::7"
        assert wire_ip_text(ip_int(text)) == "2001:db8::7"
    assert ip_text(ip_int("fd00::1:0:0:1")) == "fd00::1:0:0:1"
    assert ip_text(ip_int("10.1.2.3")) == "10.1.2.3"
    assert ip_int("::a01:203") != ip_int("10.1.2.3")  # never the same key
    # the fast text form is ipaddress's, also for zero runs, ties and IPv4-mapped forms
    rnd = random.Random(5)
    for _ in range(5000):
        words = [rnd.choice((0, 0, 0, 1, 0xFFFF, rnd.randrange(65536))) for _ in range(8)]
        if rnd.random() < 0.05:
            words[:6] = [0, 0, 0, 0, 0, rnd.choice((0, 0xFFFF))]
        b = b"".join(w.to_bytes(2, "big") for w in words)
        assert ip_text(b) == ipaddress.IPv6Address(b).compressed, b.hex()


# --- the handshake table ----------------------------------------------------------------

NAMES = {ETH0: "eth0", 3: "cni0", VETH: "vethpod0", LO: "lo"}


def _table(**kw: Any) -> HandshakeTable:
    kw.setdefault("interfaces", FakeNames(NAMES, {VETH: "cni0", 3: "cni0"}))
    classes = {CLIENT6: SRC_OTHER, VIP6: SRC_LOCAL, POD6: SRC_POD, "10.0.0.1": SRC_OTHER}
    return HandshakeTable(lambda ip: classes.get(ip, SRC_LB), **kw)


def _pkt(t: HandshakeTable, now: float, ifindex: int, pkttype: int, src: str, dst: str,
         sport: int, dport: int, flags: int) -> None:
    t.packet(now, ifindex, pkttype, ip_int(src), ip_int(dst), sport, dport, flags)


def test_table_judges_ipv6_handshakes_beside_ipv4_ones() -> None:
    t = _table(timeout=1.0)
    # answered
    _pkt(t, 0.0, ETH0, PACKET_HOST, CLIENT6, NODE6, 40000, PORT, 0x02)
    _pkt(t, 0.0, ETH0, OUT, NODE6, CLIENT6, PORT, 40000, 0x12)
    # the same ports over IPv4: its own handshake
    t.packet(0.0, ETH0, PACKET_HOST, ip_int("10.0.0.1"), ip_int("10.0.0.10"), 40000, PORT, 2)
    t.packet(0.0, ETH0, OUT, ip_int("10.0.0.10"), ip_int("10.0.0.1"), PORT, 40000, 0x14)
    # the health check from a VIP bound here: answered to lo, reset there by the node
    _pkt(t, 0.1, ETH0, PACKET_HOST, VIP6, NODE6, 41000, PORT, 0x02)
    _pkt(t, 0.1, LO, OUT, NODE6, VIP6, PORT, 41000, 0x12)
    _pkt(t, 0.1, LO, PACKET_HOST, VIP6, NODE6, 41000, PORT, 0x04)
    # a pod's SYN back through the LB: answered through the pod bridge, the pod resets
    _pkt(t, 0.2, ETH0, PACKET_HOST, POD6, NODE6, 42000, PORT, 0x02)
    _pkt(t, 0.2, VETH, OUT, NODE6, POD6, PORT, 42000, 0x12)
    _pkt(t, 0.2, VETH, PACKET_HOST, POD6, NODE6, 42000, PORT, 0x04)
    # unanswered, and its retransmission after the timeout
    _pkt(t, 0.3, ETH0, PACKET_HOST, "2001:db8:9::1", NODE6, 43000, PORT, 0x02)
    t.expire(2.0)
    _pkt(t, 2.5, ETH0, PACKET_HOST, "2001:db8:9::1", NODE6, 43000, PORT, 0x02)
    (port,) = t.finish(10.0)
    assert port.counts == {ANSWERED: {SRC_OTHER: 1}, RESET: {SRC_OTHER: 1},
                           BYPASSED: {SRC_LOCAL: 1, SRC_POD: 1},
                           UNANSWERED: {SRC_LB: 1}}
    assert t.retransmissions == 1
    by = {(s.outcome, s.source_class): s for s in port.samples}
    hc = by[(BYPASSED, SRC_LOCAL)]
    assert (hc.src, hc.dst, hc.in_iface, hc.reply_iface, hc.peer_reset) == \
        (VIP6, NODE6, "eth0", "lo", False)
    loop = by[(BYPASSED, SRC_POD)]
    assert (loop.src, loop.reply_iface, loop.peer_reset) == (POD6, "vethpod0", True)
    fails = {(f.source_class, f.outcome): f for f in t.failures()}
    assert fails[(SRC_LOCAL, BYPASSED)].src == VIP6  # per local source, canonical text
    assert fails[(SRC_LB, UNANSWERED)].src is None


def test_local_destinations_take_both_families() -> None:
    t = _table(local_addresses=["10.0.0.10", "2001:DB8:1:0::10"])
    _pkt(t, 0.0, ETH0, PACKET_HOST, CLIENT6, NODE6, 40000, PORT, 0x02)  # to this node
    _pkt(t, 0.0, ETH0, PACKET_HOST, CLIENT6, "2001:db8:1::99", 40001, PORT, 0x02)  # forwarded
    assert t.syns == 1 and t.not_for_us == 1


def test_feed_block_equals_the_per_packet_path_for_mixed_families() -> None:
    records = [
        (ETH0, PACKET_HOST, v6(syn()), 1),
        (ETH0, OUT, v6(synack(), src=NODE6, dst=CLIENT6), 1),
        (ETH0, PACKET_HOST, frame("10.0.0.1", "10.0.0.10", 40000, PORT, 0x02), 1),
        (ETH0, PACKET_HOST, v6(syn(sport=41000), src=VIP6), 1),
        (LO, OUT, v6(synack(dport=41000), src=NODE6, dst=VIP6), 772),
        (LO, PACKET_HOST, v6(syn(sport=41000, flags="R"), src=VIP6), 772),
        (ETH0, PACKET_HOST, v6(syn(sport=44000), raw=True), 0xFFFE),
        (ETH0, PACKET_HOST, v6(syn(sport=45000), ext=FRAG0, vlans=(Dot1Q(vlan=3),)), 1),
    ]
    fast, slow = _table(), _table()
    buf, off, num = ring_block(records)
    assert num == len(records)
    fast.feed_block(buf, off, num, 0.0)
    d = Decoder()
    for ifindex, pkttype, fr, hatype in records:
        got = d.decode(fr, hatype)
        assert got is not None
        slow.packet(0.0, ifindex, pkttype, *got)
    assert fast.finish(1.0) == slow.finish(1.0)
    assert fast.syns == slow.syns == 5 and fast.decoder.error_count == 0


# --- the source classes ------------------------------------------------------------------

def test_classifier_knows_ipv6_local_pod_and_lb_addresses() -> None:
    local = {VIP6, NODE6, "10.0.0.10"}
    classify = make_classifier(lambda a: a in local, ["10.244.1.0/24", "fd00:10::/64"],
                               ["2001:db8:ff::8", "203.0.113.9"])
    assert classify(VIP6) == SRC_LOCAL
    assert classify(POD6) == SRC_POD
    assert classify("10.244.1.7") == SRC_POD
    assert classify("2001:db8:ff::8") == SRC_LB
    assert classify("2001:db8:99::1") == SRC_OTHER
    # what the table hands it is canonical text, whatever the Service wrote
    assert classify(wire_ip_text(ip_int("2001:DB8:FF:0::8"))) == SRC_LB


def test_ipv6_pod_prefixes_come_from_the_pod_bridges() -> None:
    addrs = [Address("cni0", "10.244.1.1", 24), Address("cni0", "fd00:10::1", 64),
             Address("cni0", "fe80::1", 64, scope="link"), Address("eth0", NODE6, 64),
             Address("cbr0", "FD00:20:0::1", 80), Address("cni0", "fd00:10::2", 64),
             Address("kube-ipvs0", VIP6, 128)]
    assert ipv6_pod_prefixes(addrs) == ["fd00:10::/64", "fd00:20::/80"]
    assert ipv6_pod_prefixes(None) == []


# --- the filter in the kernel ----------------------------------------------------------

# Inside the node namespace: the capture's own ring (its filter attached), every packet
# that reaches it printed as JSON: [ifname, pkt_type, decoded tuple as text].
_RING = r"""
import json, sys, time
from agent.capture.packets import Decoder, ip_text
from agent.capture.ring import Ring
seen = []
with Ring() as ring:
    print("ready", file=sys.stderr, flush=True)
    dec = Decoder()
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline:
        for ts, ifindex, pkttype, hatype, fr in ring.packets(timeout=0.1):
            got = dec.decode(fr, hatype)
            seen.append([ring.ifname(ifindex), pkttype, got and
                         [ip_text(got[0]), ip_text(got[1]), *got[2:]]])
print(json.dumps({"seen": seen, "errors": dec.error_count}))
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="needs root and ip")


def _mac(ns: Netns, ifname: str) -> str:
    return str(json.loads(ns.run("ip", "-j", "link", "show", ifname).stdout)[0]["address"])


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Netns, Netns]]:
    with netns("lc6n") as node, netns("lc6c") as client:
        veth(node, "eth0", client, "eth0")
        node.sh(f"ip addr add {NODE6}/64 dev eth0 nodad && ip link set eth0 up")
        client.sh(f"ip addr add {CLIENT6}/64 dev eth0 nodad && ip link set eth0 up")
        settle(node)
        settle(client)
        yield node, client


@pytest.mark.netns
@needs_root
def test_filter_in_the_kernel_passes_and_drops_real_ipv6_frames(
        pair: tuple[Netns, Netns]) -> None:
    node, client = pair
    to_node = {"src": _mac(client, "eth0"), "dst": _mac(node, "eth0")}
    from_node = {"src": to_node["dst"], "dst": to_node["src"]}

    def frame6(l4: Packet, mac: dict[str, str], src: str = CLIENT6, dst: str = ELSEWHERE,
               ext: Packet | None = None) -> bytes:
        ip = IPv6(src=src, dst=dst)
        return bytes(Ether(**mac) / (ip / ext / l4 if ext is not None else ip / l4))

    proc = node.popen([PY, "-c", _RING, "2.0"], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None and proc.stderr.readline() == "ready\n"
        # in, to an address the node does not have (it forwards nothing): its stack
        # stays out of it; the client's port names the case
        send_frames(client, "eth0", [
            frame6(syn(sport=1001), to_node),  # pass
            frame6(syn(dport=80, sport=1002), to_node),  # drop: not a NodePort
            frame6(syn(sport=1003, flags="A"), to_node),  # drop: no handshake
            frame6(syn(sport=1004), to_node, ext=IPv6ExtHdrHopByHop()),  # pass
            frame6(syn(sport=1005), to_node, ext=FRAG_LATER),  # drop
            frame6(syn(sport=1006), to_node, ext=FRAG0),  # pass
            frame6(syn(sport=1007), to_node, ext=AH()),  # drop
            frame6(syn(sport=1008, flags="R"), to_node),  # pass: RST in
            frame6(UDP(sport=1009, dport=PORT), to_node),  # drop
        ])
        # out of the node (what the capture sees as PACKET_OUTGOING), to an address
        # the client does not have, so its stack does not answer
        send_frames(node, "eth0", [
            frame6(synack(dport=2001), from_node, src=NODE6, dst=ELSEWHERE),  # pass
            frame6(syn(sport=2002), from_node, src=NODE6, dst=ELSEWHERE),  # drop: our SYN
            frame6(TCP(sport=PORT, dport=2003, flags="RA"), from_node, src=NODE6,
                   dst=ELSEWHERE),  # pass
        ])
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    got = json.loads(out)
    assert got["errors"] == 0
    seen = sorted((pkttype, tup[2] if pkttype != OUT else tup[3], tup[4])
                  for _, pkttype, tup in got["seen"])
    assert seen == [(PACKET_HOST, 1001, 0x02), (PACKET_HOST, 1004, 0x02),
                    (PACKET_HOST, 1006, 0x02), (PACKET_HOST, 1008, 0x04),
                    (OUT, 2001, 0x12), (OUT, 2003, 0x14)], got
    assert all(tup[:2] in ([CLIENT6, ELSEWHERE], [NODE6, ELSEWHERE])
               for _, _, tup in got["seen"])
    assert {name for name, _, _ in got["seen"]} == {"eth0"}


# --- the findings ------------------------------------------------------------------------

def _health_checks(how: list[str]) -> CaptureResult:
    """One SYN per item from a local source to NodePort 30080: ``lo`` (answered into lo
    and reset there: IPv6, or IPv4 with accept_local=1) or ``drop`` (IPv4's martian drop:
    no reply); IPv6 sources for ``lo6``/``drop6``."""
    local = {VIP6: SRC_LOCAL, "10.0.1.100": SRC_LOCAL}
    t = HandshakeTable(lambda ip: local.get(ip, SRC_OTHER),
                       interfaces=FakeNames(NAMES, {VETH: "cni0", 3: "cni0"}))
    for i, h in enumerate(how):
        src, dst = (VIP6, NODE6) if h.endswith("6") else ("10.0.1.100", "10.0.0.10")
        _pkt(t, i * 0.01, ETH0, PACKET_HOST, src, dst, 40000 + i, PORT, 0x02)
        if h.startswith("lo"):
            _pkt(t, i * 0.01, LO, OUT, dst, src, PORT, 40000 + i, 0x12)
            _pkt(t, i * 0.01, LO, PACKET_HOST, src, dst, 40000 + i, PORT, 0x04)
    t.expire(100.0)
    return CaptureResult(30.0, (30000, 32767), ports=t.finish(100.0),
                         failures=t.failures(1.7e9))


@pytest.mark.parametrize("how, says, never", [
    (["lo6"] * 2, "and were answered, but the SYN-ACK went to lo", "martian"),
    # IPv6 unanswered: a NodePort DNATed to a pod (tests/test_capture_ipv6_netns.py)
    (["drop6"], "got no answer out of the node (IPv6 has no martian-source drop: a pod "
     "behind the NodePort answered", "martian source:"),
    (["drop"] * 2, "and were dropped as martian source:", "went to lo"),
    (["lo"], "and were answered, but the SYN-ACK went to lo", "martian"),  # accept_local
    (["drop", "lo", "lo"], "and 1 were dropped as martian source, 2 were answered", "!"),
])
def test_a_local_source_finding_says_how_the_checks_failed(
        how: list[str], says: str, never: str) -> None:
    snap = load_bundle(Path(__file__).parent / "data" / "bundles" / "tke-etp-local")
    v = diagnose(snap, "n", capture=_health_checks(how)).to_dict("all")
    (f,) = [f for f in v["findings"] if f["id"] == "healthcheck-dropped-local-source"]
    assert says in f["summary"] and never not in f["summary"], f["summary"]
    assert v["status"] == "loopback"
    lo = [e for e in f["evidence"] if "SYN-ACK left through lo" in e]
    assert len(lo) == sum(h.startswith("lo") for h in how)
    assert all("never left" in e and "bypassed" not in e for e in lo)
    ipv6 = [e for e in f["evidence"] if VIP6 in e]
    assert all(e.startswith(f"[{VIP6}]:") and f"-> [{NODE6}]:{PORT} " in e for e in ipv6)
    assert len(ipv6) == sum(h.endswith("6") for h in how)


def _many_local_sources(v4: int, v6: int) -> CaptureResult:
    """One unanswered SYN to NodePort 30080 from each of ``v4`` IPv4 and ``v6`` IPv6
    addresses local on the node (VIPs bound on kube-ipvs0, as IPVS binds every LB IP)."""
    srcs = [f"10.0.1.{100 + i}" for i in range(v4)] + [f"2001:db8:ff::{i + 1:x}"
                                                       for i in range(v6)]
    local = set(srcs)
    t = HandshakeTable(lambda ip: SRC_LOCAL if ip in local else SRC_OTHER,
                       interfaces=FakeNames(NAMES, {VETH: "cni0", 3: "cni0"}))
    for i, src in enumerate(srcs):
        dst = NODE6 if ":" in src else "10.0.0.10"
        _pkt(t, i * 0.01, ETH0, PACKET_HOST, src, dst, 40000 + i, PORT, 0x02)
    return CaptureResult(30.0, (30000, 32767), ports=t.finish(100.0),
                         failures=t.failures(1.7e9))


@pytest.mark.parametrize("v4, v6, says, never", [
    # more sources than findings per id: the smallest are merged into one finding,
    # which has no single source address to tell the family by
    (0, 25, "got no answer out of the node (IPv6 has no martian", "martian source:"),
    (25, 0, "were dropped as martian source:", "IPv6"),
    (0, 3, "got no answer out of the node (IPv6 has no martian", "martian source:"),
    # the merged finding holds 3 of each family: each is worded by its own
    (22, 3, "3 were dropped as martian source, 3 got no answer out of the node (IPv6",
     "went to lo"),
])
def test_merged_local_sources_are_worded_by_their_family(v4: int, v6: int, says: str,
                                                         never: str) -> None:
    snap = load_bundle(Path(__file__).parent / "data" / "bundles" / "tke-etp-local")
    v = diagnose(snap, "n", capture=_many_local_sources(v4, v6)).to_dict("all")
    found = [f for f in v["findings"] if f["id"] == "healthcheck-dropped-local-source"]
    assert len(found) == min(v4 + v6, 20)
    merged = [f for f in found if "addresses local" in f["summary"]]
    assert len(merged) == (v4 + v6 > 20)
    for f in merged or found:
        assert says in f["summary"], f["summary"]
    assert not any(never in f["summary"] for f in found)
    v4_kept = [f for f in found if f not in merged and "2001:" not in f["summary"]]
    assert all("were dropped as martian source:" in f["summary"] for f in v4_kept)


@pytest.mark.parametrize("given", ["fd00:10::/64", "10.244.0.0/16,fd00:10::/64"])
def test_the_capture_knows_ipv6_pods_the_node_facts_found(given: str) -> None:
    """An IPv6 pod network found other than on a pod bridge (here --pod-cidr; also
    kube-proxy's rules or --cluster-cidr, as on a Calico node without bridge or Node
    podCIDRs) classes the capture's IPv6 pod sources as pods, as IPv4's does."""
    from dataclasses import replace

    from agent.diagnose import prepare
    from agent.watch import source_classifier

    snap = load_bundle(Path(__file__).parent / "data" / "bundles" / "tke-etp-local")
    assert not ipv6_pod_prefixes(snap.addresses)  # no IPv6 on a pod bridge here
    prepared = prepare(replace(snap, given={"pod_cidr": given}))
    assert prepared.facts.pod6 is not None and prepared.facts.pod6.prefix == "fd00:10::/64"
    classify = source_classifier(prepared)
    assert classify(POD6) == SRC_POD
    assert classify("2001:db8:99::1") == SRC_OTHER
    assert classify(prepared.facts.pod.pod_ip if prepared.facts.pod else "") == SRC_POD


def test_an_unanswered_ipv6_local_sample_does_not_say_dropped() -> None:
    """Its sample line says what was seen (no SYN-ACK left), not a drop: behind a NodePort
    DNATed to a pod the pod answered (tests/test_capture_ipv6_netns.py); IPv4's stays."""
    snap = load_bundle(Path(__file__).parent / "data" / "bundles" / "tke-etp-local")
    v = diagnose(snap, "n", capture=_health_checks(["drop6", "drop"])).to_dict("all")
    lines = [e for f in v["findings"] if f["id"] == "healthcheck-dropped-local-source"
             for e in f["evidence"] if " (local): " in e]
    assert [e.split(": ", 1)[1] for e in lines if VIP6 in e] == ["no SYN-ACK left the node"]
    assert [e.split(": ", 1)[1] for e in lines if VIP6 not in e] == ["no SYN-ACK: dropped"]
