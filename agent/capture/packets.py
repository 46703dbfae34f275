"""Decode captured frames down to the TCP fields a handshake needs.

This is the per-packet path, so it is written for speed: precompiled ``struct.Struct``
objects reading in place (``unpack_from`` on the ring or a bytes object, no slicing),
addresses kept as 32-bit integers (turned into text only for the few packets that end
up as samples), and one unpack for the common frame (Ethernet + IPv4 without options).
Frames that do not decode are counted by reason and skipped; nothing here raises.

IPv6 addresses are 16-byte ``bytes`` (as ``unpack_from`` gives them with ``16s``): an
IPv4 address stays an int, so the IPv4 path does not change at all, and an IPv6 one can
never be equal to an IPv4 one (an int with a family tag would cost IPv4 a check, and an
IPv6 int needs two unpacks and a shift: see tests/bench/capture_rate.py). Text forms are
``ipaddress``'s canonical ones (``compressed``), which is how ``ip`` prints them too.
"""

from __future__ import annotations

import ipaddress
import mmap
import socket
import struct
import sys
from collections import Counter
from typing import Final

from agent.capture.bpf import (
    ETHERNET_HATYPES,
    IPV6_EXT_MAX,
    IPV6_EXT_WALKED,
    IPV6_FRAGMENT,
    RAW_IP_HATYPES,
    VLAN_TPIDS,
)

ETH_P_IP: Final = 0x0800
ETH_P_IPV6: Final = 0x86DD

TCP_FIN: Final = 0x01
TCP_SYN: Final = 0x02
TCP_RST: Final = 0x04
TCP_ACK: Final = 0x10

# Why a frame was skipped (keys of Decoder.errors).
TRUNCATED: Final = "truncated"
NOT_IPV4: Final = "not ip"  # neither IPv4 nor IPv6 (the name is older than IPv6 support)
NOT_TCP: Final = "not tcp"
FRAGMENT: Final = "fragment"
BAD_HEADER: Final = "bad header"
UNKNOWN_LINK: Final = "unknown link type"

# The common frame in one unpack, from the EtherType (offset 12) to the TCP flags:
# ethertype, version/IHL, fragment field, protocol, src, dst, sport, dport, flags.
ETH_IPV4_TCP: Final = struct.Struct(">HB5xHxB2xIIHH9xB")
ETH_IPV4_TCP_OFF: Final = 12  # where ETH_IPV4_TCP starts in the frame
ETH_IPV4_TCP_END: Final = 48  # bytes of frame it needs
# The same from the IP header on (header-less devices, VLAN frames, IP options).
IPV4: Final = struct.Struct(">B5xHxB2xII")  # version/IHL, fragment, protocol, src, dst
TCP: Final = struct.Struct(">HH9xB")  # sport, dport, flags
# IPv6 in one unpack from the EtherType to the TCP flags, when TCP follows the fixed
# header directly (every kube handshake): ethertype, version/class, next header, src,
# dst, sport, dport, flags.
ETH_IPV6_TCP: Final = struct.Struct(">HB5xBx16s16sHH9xB")
ETH_IPV6_TCP_END: Final = 12 + ETH_IPV6_TCP.size
# ... and from the IPv6 header on: version/class, next header, src, dst.
IPV6: Final = struct.Struct(">B5xBx16s16s")
IPV6_HEADER: Final = 40
_U16: Final = struct.Struct(">H")
_U8X2: Final = struct.Struct(">BB")

Addr = int | bytes  # IPv4: 32-bit int; IPv6: the 16 bytes of the address
Tcp = tuple[Addr, Addr, int, int, int]  # src, dst, sport, dport, flags
Buffer = bytes | bytearray | memoryview | mmap.mmap  # what unpack_from reads in place


def ip_text(addr: Addr) -> str:
    """Address -> dotted quad, or canonical IPv6 text."""
    if type(addr) is int:
        return socket.inet_ntoa(addr.to_bytes(4, "big"))
    return ipv6_text(addr)  # type: ignore[arg-type]


def ipv6_text(addr: bytes) -> str:
    """16 bytes -> ``ipaddress``'s canonical text (RFC 5952). inet_ntop writes the same
    but ~10x faster (a flood from random sources names each one once), except for the
    IPv4-mapped/-compatible forms it writes with a dotted quad."""
    text = socket.inet_ntop(socket.AF_INET6, addr)
    return ipaddress.IPv6Address(bytes(addr)).compressed if "." in text else text


def ip_int(text: str) -> Addr:
    """Text -> the decoder's form: an int for IPv4, 16 bytes for IPv6."""
    if ":" in text:
        return socket.inet_pton(socket.AF_INET6, text)
    return int.from_bytes(socket.inet_aton(text), "big")


# "Wire form": addresses and ports read *little-endian* from network-order bytes, i.e.
# byte-swapped on every host. The hot path reads a whole ring record (little-endian
# tpacket header + frame fields) with one unpack, which forces one byte order on the
# frame fields too; the handshake table therefore keys and counts in wire form and
# converts only what it reports. A bijection, so equality and hashing are unaffected.
def wire16(v: int) -> int:
    """Port <-> wire form (its own inverse)."""
    return ((v & 0xFF) << 8) | (v >> 8)


def wire32(v: int) -> int:
    """Address <-> wire form (its own inverse)."""
    return int.from_bytes(v.to_bytes(4, "big"), "little")


def wire_addr(v: Addr) -> Addr:
    """Any address <-> wire form: IPv6 bytes are their own wire form."""
    return wire32(v) if type(v) is int else v


def wire_ip_text(addr: Addr) -> str:
    if type(addr) is int:
        return socket.inet_ntoa(addr.to_bytes(4, "little"))
    return ipv6_text(addr)  # type: ignore[arg-type]


# One TPACKET_V3 record of a "fast" frame (see bpf.FAST_SNAPLEN) in one unpack:
# tpacket3_hdr tp_next_offset, tp_snaplen, tp_mac; sockaddr_ll sll_ifindex, sll_hatype,
# sll_pkttype; then, at tp_mac == FAST_MAC, the frame's src, dst, sport, dport (wire
# form) and TCP flags. Little-endian: the tpacket fields are host order, so this is only
# used on little-endian hosts (FAST_RECORD_OK); others take the general path.
FAST_MAC: Final = 82  # TPACKET_ALIGN(TPACKET3_HDRLEN + 16) - 14 for a 14-byte header
FAST_RECORD: Final = struct.Struct(f"<I8xI8xH22x4xiHB{FAST_MAC + 26 - 59}xIIHH9xB")
FAST_RECORD_OK: Final = sys.byteorder == "little"
# The plain IPv6 frame (Ethernet-like, no tag, TCP right after the fixed header) of such
# a record, read from the EtherType on in wire form (ports little-endian, so the
# EtherType reads as FAST6_ETHERTYPE): ethertype, version/class, next header, src, dst,
# sport, dport, flags. Tried only on records that are not the IPv4 fast one.
FAST6_FRAME: Final = struct.Struct("<HB5xBx16s16sHH9xB")
FAST6_OFF: Final = FAST_MAC + 12  # from the record's start
FAST6_SNAP: Final = 12 + FAST6_FRAME.size  # captured bytes it needs (68)
FAST6_ETHERTYPE: Final = 0xDD86  # ETH_P_IPV6 read little-endian


class Decoder:
    """Frame -> (src, dst, sport, dport, flags), counting what it rejects. Addresses are
    ints for IPv4, 16-byte ``bytes`` for IPv6."""

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def decode(self, frame: Buffer, hatype: int = ETHERNET_HATYPES[0]) -> Tcp | None:
        """Decode a whole frame (starting at the link-layer header, or at the IP header
        for the header-less device types)."""
        return self.decode_at(frame, 0, len(frame), hatype)

    def decode_at(self, buf: Buffer, off: int, length: int, hatype: int) -> Tcp | None:
        """Decode ``length`` bytes of ``buf`` starting at ``off`` (``buf`` may be the ring
        mapping itself: nothing is copied)."""
        if hatype in ETHERNET_HATYPES:
            if length >= ETH_IPV4_TCP_END:
                et, vihl, frag, proto, src, dst, sport, dport, flags = \
                    ETH_IPV4_TCP.unpack_from(buf, off + ETH_IPV4_TCP_OFF)
                if et == ETH_P_IP and vihl == 0x45 and not frag & 0x1FFF and proto == 6:
                    return src, dst, sport, dport, flags
                if et == ETH_P_IPV6 and length >= ETH_IPV6_TCP_END:
                    et, vtc, nh, src6, dst6, sport, dport, flags = \
                        ETH_IPV6_TCP.unpack_from(buf, off + ETH_IPV4_TCP_OFF)
                    if vtc >> 4 == 6 and nh == 6:
                        return src6, dst6, sport, dport, flags
            ip, et = self._skip_ethernet(buf, off, length)
            if ip < 0:
                return None
            if et == ETH_P_IPV6:
                return self._ipv6_tcp(buf, off + ip, length - ip)
        elif hatype in RAW_IP_HATYPES:
            ip = 0
            if length and buf[off] >> 4 == 6:
                return self._ipv6_tcp(buf, off, length)
        else:
            self.errors[UNKNOWN_LINK] += 1
            return None
        return self._ipv4_tcp(buf, off + ip, length - ip)

    def _skip_ethernet(self, buf: Buffer, off: int, length: int) -> tuple[int, int]:
        """(length of the Ethernet header and any VLAN tags in the frame, the EtherType
        after them); (-1, 0) if not IPv4 or IPv6."""
        pos = 12
        for _ in range(3):  # the EtherType, then at most two tags
            if length < pos + 2:
                self.errors[TRUNCATED] += 1
                return -1, 0
            (et,) = _U16.unpack_from(buf, off + pos)
            if et in (ETH_P_IP, ETH_P_IPV6):
                return pos + 2, et
            if et not in VLAN_TPIDS:
                self.errors[NOT_IPV4] += 1
                return -1, 0
            pos += 4
        self.errors[BAD_HEADER] += 1  # three tags: not something a node receives
        return -1, 0

    def _ipv6_tcp(self, buf: Buffer, off: int, length: int) -> Tcp | None:
        """The IPv6 header, the extension headers the filter walks (bpf.IPV6_EXT_MAX of
        hop-by-hop, routing, destination options, fragment at offset 0), then TCP."""
        if length < IPV6_HEADER:
            self.errors[TRUNCATED] += 1
            return None
        vtc, nh, src, dst = IPV6.unpack_from(buf, off)
        if vtc >> 4 != 6:
            self.errors[NOT_IPV4] += 1
            return None
        pos = IPV6_HEADER
        for _ in range(IPV6_EXT_MAX):
            if nh == 6:
                break
            if length < pos + 8:
                self.errors[TRUNCATED] += 1
                return None
            if nh == IPV6_FRAGMENT:
                (frag,) = _U16.unpack_from(buf, off + pos + 2)
                if frag & 0xFFF8:
                    self.errors[FRAGMENT] += 1
                    return None
                nh = buf[off + pos]
                pos += 8
            elif nh in IPV6_EXT_WALKED:
                nh, n = _U8X2.unpack_from(buf, off + pos)
                pos += (n + 1) * 8
            else:
                break
        if nh != 6:
            self.errors[NOT_TCP] += 1
            return None
        if length < pos + TCP.size:
            self.errors[TRUNCATED] += 1
            return None
        sport, dport, flags = TCP.unpack_from(buf, off + pos)
        return src, dst, sport, dport, flags

    def _ipv4_tcp(self, buf: Buffer, off: int, length: int) -> Tcp | None:
        if length < IPV4.size:
            self.errors[TRUNCATED] += 1
            return None
        vihl, frag, proto, src, dst = IPV4.unpack_from(buf, off)
        if vihl >> 4 != 4:
            self.errors[NOT_IPV4] += 1
            return None
        ihl = (vihl & 0x0F) * 4
        if ihl < 20:
            self.errors[BAD_HEADER] += 1
            return None
        if proto != socket.IPPROTO_TCP:
            self.errors[NOT_TCP] += 1
            return None
        if frag & 0x1FFF:
            self.errors[FRAGMENT] += 1
            return None
        if length < ihl + TCP.size:
            self.errors[TRUNCATED] += 1
            return None
        sport, dport, flags = TCP.unpack_from(buf, off + ihl)
        return src, dst, sport, dport, flags
