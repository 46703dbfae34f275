"""Decode captured frames down to the TCP fields a handshake needs.

This is the per-packet path, so it is written for speed: precompiled ``struct.Struct``
objects reading in place (``unpack_from`` on the ring or a bytes object, no slicing),
addresses kept as 32-bit integers (turned into text only for the few packets that end
up as samples), and one unpack for the common frame (Ethernet + IPv4 without options).
Frames that do not decode are counted by reason and skipped; nothing here raises.
"""

from __future__ import annotations

import mmap
import socket
import struct
import sys
from collections import Counter
from typing import Final

from agent.capture.bpf import ETHERNET_HATYPES, RAW_IP_HATYPES, VLAN_TPIDS

ETH_P_IP: Final = 0x0800
ETH_P_IPV6: Final = 0x86DD

TCP_FIN: Final = 0x01
TCP_SYN: Final = 0x02
TCP_RST: Final = 0x04
TCP_ACK: Final = 0x10

# Why a frame was skipped (keys of Decoder.errors).
TRUNCATED: Final = "truncated"
NOT_IPV4: Final = "not ipv4"
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
_U16: Final = struct.Struct(">H")

Tcp = tuple[int, int, int, int, int]  # src, dst (IPv4 as int), sport, dport, flags
Buffer = bytes | bytearray | memoryview | mmap.mmap  # what unpack_from reads in place


def ip_text(addr: int) -> str:
    """32-bit address -> dotted quad."""
    return socket.inet_ntoa(addr.to_bytes(4, "big"))


def ip_int(text: str) -> int:
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


def wire_ip_text(addr: int) -> str:
    return socket.inet_ntoa(addr.to_bytes(4, "little"))


# One TPACKET_V3 record of a "fast" frame (see bpf.FAST_SNAPLEN) in one unpack:
# tpacket3_hdr tp_next_offset, tp_snaplen, tp_mac; sockaddr_ll sll_ifindex, sll_hatype,
# sll_pkttype; then, at tp_mac == FAST_MAC, the frame's src, dst, sport, dport (wire
# form) and TCP flags. Little-endian: the tpacket fields are host order, so this is only
# used on little-endian hosts (FAST_RECORD_OK); others take the general path.
FAST_MAC: Final = 82  # TPACKET_ALIGN(TPACKET3_HDRLEN + 16) - 14 for a 14-byte header
FAST_RECORD: Final = struct.Struct(f"<I8xI8xH22x4xiHB{FAST_MAC + 26 - 59}xIIHH9xB")
FAST_RECORD_OK: Final = sys.byteorder == "little"


class Decoder:
    """Frame -> (src, dst, sport, dport, flags), counting what it rejects."""

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
            ip = self._skip_ethernet(buf, off, length)
            if ip < 0:
                return None
        elif hatype in RAW_IP_HATYPES:
            ip = 0
        else:
            self.errors[UNKNOWN_LINK] += 1
            return None
        return self._ipv4_tcp(buf, off + ip, length - ip)

    def _skip_ethernet(self, buf: Buffer, off: int, length: int) -> int:
        """Length of the Ethernet header and any VLAN tags in the frame; -1 if not IPv4."""
        pos = 12
        for _ in range(3):  # the EtherType, then at most two tags
            if length < pos + 2:
                self.errors[TRUNCATED] += 1
                return -1
            (et,) = _U16.unpack_from(buf, off + pos)
            if et == ETH_P_IP:
                return pos + 2
            if et not in VLAN_TPIDS:
                self.errors[NOT_IPV4] += 1
                return -1
            pos += 4
        self.errors[BAD_HEADER] += 1  # three tags: not something a node receives
        return -1

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
