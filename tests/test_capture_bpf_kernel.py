"""The capture's BPF filter as the kernel runs it, against a spec written here apart from
agent/capture/bpf.py (and its interpreter) and agent/capture/packets.py: the filter's
author wrote the interpreter and the decoder too, so they could share a misreading.

One namespace holds a veth pair, lo and a tun device (no link-layer header, ARPHRD_NONE).
Seeded random frames (IPv4 with options and fragments, IPv6 with chains of extension
headers, fragments, AH, oversized options, 0-3 VLAN tags, cut short, bytes flipped) are
sent on them: out of the veth (the kernel's tap shows tags still in the frame, as a
VLAN device or a tag-inserting driver leaves them, PACKET_OUTGOING) and into its peer
(where the kernel has taken the tags out), on lo (out and in), written to the tun
device (in) and sent on it (out). Two packet sockets see every frame: one without a
filter, one with the capture's. The test checks, frame by frame in order:

- the kernel kept exactly what the spec says (0, 48 bytes for the plain IPv4 frame, or
  up to the snap length), and bpf.run says the same;
- every kept frame decodes, to what scapy reads in it.

(This kernel has no 8021q, ip6_tunnel or ipip: VLAN and ip6tnl devices cannot be made
here; tags in the frame and header-less frames reach the filter as above.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
from collections.abc import Iterator

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
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw

from agent.capture import bpf
from agent.capture.packets import Decoder
from lab.netns import Netns, netns

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip")
                                 or not os.path.exists("/dev/net/tun"),
                                 reason="needs root, ip and /dev/net/tun")]

PY = sys.executable
LOW, HIGH = 30000, 32767
SNAP = 128  # the capture's snap length (bpf.DEFAULT_SNAPLEN), written out: the spec's
PLAIN_IPV4 = 48  # Ethernet 14 + IPv4 20 + TCP to its flags 14
OUTGOING = 4
ETHERNET_LIKE = (1, 772)  # ARPHRD_ETHER, ARPHRD_LOOPBACK
HEADERLESS = (0xFFFE, 519, 768, 769, 512)  # NONE, RAWIP, TUNNEL, TUNNEL6, PPP

# In the namespace: make tun9, open both sockets, send every frame of stdin ("where hex"
# lines) in batches, print what each socket saw as JSON.
_SEND_AND_SEE = r"""
import fcntl, json, os, select, socket, struct, sys, time
from agent.capture import bpf
tun = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
fcntl.ioctl(tun, 0x400454CA, struct.pack("16sH", b"tun9", 0x0001 | 0x1000))  # TUN, NO_PI
os.system("ip link set tun9 up")
def sock(filtered):
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
    s.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
    if filtered:
        bpf.attach(s, bpf.nodeport_filter())
    s.setblocking(False)
    return s
every, kept = sock(False), sock(True)
out = {}
for name in ("va", "lo", "tun9"):
    out[name] = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    out[name].bind((name, 0))
def drain(s, into, quiet):
    end = time.monotonic() + quiet
    while time.monotonic() < end:
        if not select.select([s], [], [], 0.02)[0]:
            continue
        while True:
            try:
                data, addr = s.recvfrom(65535)
            except BlockingIOError:
                break
            into.append([data.hex(), addr[2], addr[3], addr[0]])
            end = time.monotonic() + quiet
seen = {"every": [], "kept": []}
lines = sys.stdin.read().split()
for i in range(0, len(lines), 300):
    batch = lines[i:i + 300]
    for where, hexed in zip(batch[::2], batch[1::2]):
        try:
            if where == "tun-in":
                os.write(tun, bytes.fromhex(hexed))
            else:
                out[where].send(bytes.fromhex(hexed))
        except OSError:
            pass  # tun refuses what is not IPv4/IPv6
    drain(every, seen["every"], 0.15)
    drain(kept, seen["kept"], 0.02)
    try:
        while os.read(tun, 65535):
            pass
    except BlockingIOError:
        pass
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def ns() -> Iterator[Netns]:
    with netns("lcbk") as n:
        n.sh("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1"
             "; ip link add va type veth peer name vb; ip link set va up; ip link set vb up")
        yield n


# --- the spec ------------------------------------------------------------------------

def _u16(b: bytes, at: int) -> int:
    return b[at] << 8 | b[at + 1]


def tcp_offset(fr: bytes, hatype: int) -> int | None:
    """Where the TCP header starts if the frame carries one the capture reads: Ethernet
    with at most two 802.1Q/802.1ad tags in the frame, or a header-less device (IP
    version from the first nibble); IPv4 (IHL >= 5, not a later fragment); IPv6 with at
    most three hop-by-hop / routing / destination options (length in 8-octet units past
    the first 8) / fragment (offset 0) headers (RFC 8200), its TCP flags within SNAP;
    the IP length field (IPv4 total, IPv6 payload) holding the headers and a 20-byte TCP
    header, and the frame the whole datagram (else the kernel drops the packet before
    TCP, and the SYN is never answered); a TCP data offset of at least 5. None when the
    filter must drop it, also when the flags are not in the frame."""
    n = len(fr)
    if hatype in ETHERNET_LIKE:
        at, tags = 12, 0
        while n >= at + 2 and _u16(fr, at) in (0x8100, 0x88A8) and tags < 2:
            at, tags = at + 4, tags + 1
        if n < at + 2 or _u16(fr, at) not in (0x0800, 0x86DD):
            return None
        version, ip = (4 if _u16(fr, at) == 0x0800 else 6), at + 2
    elif hatype in HEADERLESS:
        if n < 1:
            return None
        version, ip = (6 if fr[0] >> 4 == 6 else 4), 0
    else:
        return None
    if n <= ip or fr[ip] >> 4 != version:
        return None
    if version == 4:
        if n < ip + 10 or fr[ip + 9] != 6 or _u16(fr, ip + 6) & 0x1FFF:
            return None
        ihl = (fr[ip] & 0x0F) * 4
        tcp = ip + ihl if ihl >= 20 else None
        total = _u16(fr, ip + 2)
        if tcp is None or total < ihl + 20 or ip + total > n:
            return None
    else:
        if n < ip + 7:
            return None
        nh, tcp = fr[ip + 6], ip + 40
        for _ in range(3):
            if nh == 6:
                break
            if nh in (0, 43, 60) and n >= tcp + 2:
                nh, tcp = fr[tcp], tcp + (fr[tcp + 1] + 1) * 8
            elif nh == 44 and n >= tcp + 4 and not _u16(fr, tcp + 2) >> 3:
                nh, tcp = fr[tcp], tcp + 8
            else:
                return None
        if nh != 6 or tcp + 14 > SNAP:
            return None
        end = ip + 40 + _u16(fr, ip + 4)
        if end > n or end < tcp + 20:
            return None
    if tcp is None or n < tcp + 14 or fr[tcp + 12] >> 4 < 5:
        return None
    return tcp


def kept_length(fr: bytes, hatype: int, pkttype: int) -> int:
    """What the capture must keep of a frame: a SYN (no ACK) coming in to a NodePort, a
    SYN-ACK going out from one, a RST out from or in to one; nothing else."""
    tcp = tcp_offset(fr, hatype)
    if tcp is None:
        return 0
    sport, dport, flags = _u16(fr, tcp), _u16(fr, tcp + 2), fr[tcp + 13]
    out = pkttype == OUTGOING
    if flags & 0x02:
        port = (sport if out else None) if flags & 0x10 else (None if out else dport)
    elif flags & 0x04:
        port = sport if out else dport
    else:
        port = None
    if port is None or not LOW <= port <= HIGH:
        return 0
    plain = hatype in ETHERNET_LIKE and tcp == 14 + 20
    return min(PLAIN_IPV4 if plain else SNAP, len(fr))


def scapy_reads(fr: bytes, hatype: int) -> tuple[object, ...] | None:
    pkt = Ether(fr) if hatype in ETHERNET_LIKE else (
        IPv6(fr) if fr[0] >> 4 == 6 else IP(fr))
    ip, tcp = pkt.getlayer(IPv6) or pkt.getlayer(IP), pkt.getlayer(TCP)
    if ip is None or tcp is None:
        return None
    if isinstance(ip, IPv6):
        src, dst = (socket.inet_pton(socket.AF_INET6, a) for a in (ip.src, ip.dst))
        return src, dst, tcp.sport, tcp.dport, int(tcp.flags) & 0xFF
    src4, dst4 = (int.from_bytes(socket.inet_aton(a), "big") for a in (ip.src, ip.dst))
    return src4, dst4, tcp.sport, tcp.dport, int(tcp.flags) & 0xFF


# --- the frames ------------------------------------------------------------------------

def _frames(seed: int, count: int, vb_mac: str) -> list[tuple[str, bytes]]:
    rnd = random.Random(seed)

    def port() -> int:
        return rnd.choice((LOW, 30080, HIGH, HIGH + 1, LOW - 1, 80, 40000))

    def l4() -> Packet:
        if rnd.random() < 0.88:
            return TCP(sport=port(), dport=port(),
                       flags=rnd.choice(("S", "S", "SA", "R", "RA", "A", "F", "SE", "SR")))
        return UDP(sport=40000, dport=30080) if rnd.random() < 0.7 else Raw(b"\0" * 9)

    def ext() -> list[Packet]:
        out = []
        for _ in range(rnd.choice((0, 1, 1, 2, 3, 3, 4))):
            out.append(rnd.choice((
                lambda: IPv6ExtHdrHopByHop(),
                lambda: IPv6ExtHdrRouting(),
                lambda: IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * rnd.choice(
                    (0, 12, 28, 44, 52, 60)))]),
                lambda: IPv6ExtHdrFragment(offset=rnd.choice((0, 0, 9)), m=1, id=1),
                lambda: AH()))())
        return out

    def ip() -> bytes:
        if rnd.random() < 0.65:
            p: Packet = IPv6(src="2001:db8::1", dst=rnd.choice(("2001:db8::2", "fd00::5")))
            for h in ext():
                p = p / h
            return bytes(p / l4())
        return bytes(IP(src="10.0.0.1", dst="10.0.0.2", frag=rnd.choice((0, 0, 0, 7)),
                        options=b"\x01" * rnd.choice((0, 0, 0, 4, 40))) / l4())

    def damaged(b: bytes, start: int) -> bytes:
        out = bytearray(b)
        if rnd.random() < 0.25:  # flip header bytes to the values that steer the parse
            for _ in range(rnd.randrange(1, 3)):
                i = rnd.randrange(start, min(len(out), start + 100))
                out[i] = rnd.choice((rnd.randrange(256), 0, 6, 43, 44, 60, 0x45, 0x60,
                                     0x81, 0x86, 0x88, 0xA8, 0xDD))
        if rnd.random() < 0.2:  # cut short, also inside the extension headers
            out = out[:rnd.randrange(start + 1, len(out) + 1)]
        return bytes(out)

    packets = [ip() for _ in range(count // 6)]  # scapy builds slowly: reuse, damaged anew
    # SYNs behind 56 bytes of destination options: TCP 110 bytes into an untagged frame,
    # so behind 0, 1 or 2 tags its flags land either side of the snap length
    packets += [bytes(IPv6(src="2001:db8::1", dst="2001:db8::2")
                      / IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * 52)])
                      / TCP(sport=40000 + i, dport=30080, flags="S")) for i in range(8)]
    to_vb = bytes.fromhex(vb_mac.replace(":", ""))
    frames = []
    for _ in range(count):
        where = rnd.choice(("va", "va", "va", "lo", "tun-in", "tun9"))
        packet = rnd.choice(packets)
        if where.startswith("tun"):
            frames.append((where, damaged(packet, 0)))
            continue
        tags = rnd.choice((0, 0, 0, 1, 2, 3))
        tpids = [0x88A8 if i == 0 and tags > 1 else 0x8100 for i in range(tags)]
        link = (to_vb if rnd.random() < 0.7 else bytes.fromhex("020000000009")) \
            + bytes.fromhex("020000000001")
        for i, tpid in enumerate(tpids):
            link += tpid.to_bytes(2, "big") + (5 + i).to_bytes(2, "big")  # TPID, TCI
        link += (0x86DD if packet[0] >> 4 == 6 else 0x0800).to_bytes(2, "big")
        frames.append((where, damaged(link + packet, 12)))
    return frames


def _length_lies(vb_mac: str) -> list[tuple[bytes, bool]]:
    """SYNs to a NodePort whose IP length field or TCP data offset the kernel refuses
    (it drops them before TCP: never answered, they are no handshake), each beside a
    well-formed twin: (frame, well formed)."""
    eth = Ether(dst=vb_mac, src="02:00:00:00:00:01")
    v4 = IP(src="10.0.0.1", dst="10.0.0.2") / TCP(sport=40000, dport=30080, flags="S")
    v6 = IPv6(src="2001:db8::1", dst="2001:db8::2") / TCP(sport=40000, dport=30080,
                                                           flags="S")
    return [(bytes(eth / v4), True), (bytes(eth / v6), True),
            (bytes(eth / IP(src="10.0.0.1", dst="10.0.0.2", len=30) / v4[TCP]), False),
            (bytes(eth / IP(src="10.0.0.1", dst="10.0.0.2", len=48) / v4[TCP]), False),
            (bytes(eth / IP(src="10.0.0.1", dst="10.0.0.2") / TCP(
                sport=40000, dport=30080, flags="S", dataofs=4)), False),
            (bytes(eth / IPv6(src="2001:db8::1", dst="2001:db8::2", plen=8) / v6[TCP]),
             False),
            (bytes(eth / IPv6(src="2001:db8::1", dst="2001:db8::2", plen=28) / v6[TCP]),
             False)]


def test_the_kernel_filter_keeps_what_the_spec_says_and_it_decodes(ns: Netns) -> None:
    vb_mac = ns.run("cat", "/sys/class/net/vb/address").stdout.strip()
    lies = _length_lies(vb_mac)
    for fr, well_formed in lies:  # (the spec itself tells them apart)
        assert bool(kept_length(fr, 1, 0)) == well_formed, fr.hex()
    sent = _frames(15, 1200, vb_mac) + [("va", fr) for fr, _ in lies]
    proc = ns.run(PY, "-c", _SEND_AND_SEE, timeout=120,
                  input="".join(f"{w} {f.hex()}\n" for w, f in sent))
    seen = json.loads(proc.stdout)
    every = [(bytes.fromhex(h), pkttype, hatype, ifname)
             for h, pkttype, hatype, ifname in seen["every"]]
    kept = [(bytes.fromhex(h), pkttype, ifname) for h, pkttype, _, ifname in seen["kept"]]
    assert len(every) >= len(sent)  # each veth and lo frame twice (out, in)
    spec = [(fr, pkttype, hatype, ifname, kept_length(fr, hatype, pkttype))
            for fr, pkttype, hatype, ifname in every]
    # what the kernel kept, frame by frame, is what the spec keeps
    assert kept == [(fr[:n], pkttype, ifname) for fr, pkttype, _, ifname, n in spec if n]
    program, decoder = bpf.nodeport_filter(), Decoder()
    covered: set[str] = set()
    offsets: set[int] = set()
    for fr, pkttype, hatype, ifname, n in spec:
        assert bpf.run(program, fr, hatype, pkttype) == n, (fr.hex(), hatype, pkttype)
        if not n:
            continue
        got, scapy_got = decoder.decode(fr[:n], hatype), scapy_reads(fr, hatype)
        assert got is not None, (fr.hex(), hatype)
        # (every kept frame holds its whole TCP header, by its end and by its IP length
        # field: scapy reads it too)
        assert got == scapy_got, fr.hex()
        offsets.add(tcp_offset(fr, hatype) or 0)
        covered.add(ifname if hatype not in ETHERNET_LIKE else
                    f"{ifname} {_u16(fr, 12):04x} {'out' if pkttype == OUTGOING else 'in'}")
    # what the frames reached: tags still in the frame (out of the veth), 802.1ad + 802.1Q,
    # untagged IPv4 and IPv6 both ways, lo, the header-less device both ways
    assert {"va 8100 out", "va 88a8 out", "va 86dd out", "va 0800 out", "vb 86dd in",
            "vb 0800 in", "lo 86dd in", "lo 86dd out", "tun9"} <= covered, covered
    assert len(kept) > 100
    assert SNAP - 14 in offsets  # TCP flags in the last byte kept (one tag, 64 of options)
    # the length lies never reached the ring, in either direction; their twins did
    kept_frames = {fr for fr, _, _ in kept}
    for fr, well_formed in lies:
        cut = fr[:kept_length(fr, 1, 0) or len(fr)]
        assert (cut in kept_frames) == well_formed, fr.hex()
