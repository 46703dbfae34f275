"""A classic-BPF socket filter that lets only NodePort handshake packets into the ring.

It passes exactly the TCP packets (IPv4 and IPv6) the handshake table uses: a SYN
(without ACK) coming in to a NodePort, the node's SYN-ACK or RST going out from one, and
a RST coming in to one (the client's answer to a bypassed SYN-ACK); the direction is the
packet type the kernel gives the socket (``SKF_AD_PKTTYPE``, PACKET_OUTGOING for what
the node sends). Everything else stays in the kernel: data and pure ACKs of established
flows, FINs, the node's own SYNs out and SYN-ACKs in. So ordinary traffic on NodePorts
never wakes the agent, and the per-packet Python path only sees the few packets that
matter.

Assembled here with ``struct`` instead of compiled by libpcap (scapy's
``compile_filter`` shells out to tcpdump): no runtime dependency, and the program can
look at the device type (``SKF_AD_HATYPE``), which a pcap expression cannot, so one
socket serves Ethernet-like devices and header-less ones (ipip, wireguard, tun) alike.

Layout handled:

- Ethernet (also loopback, which carries an Ethernet header), with up to two 802.1Q /
  802.1ad tags still in the frame (a tag offloaded by the kernel is not in the frame
  and needs nothing), EtherType IPv4 or IPv6;
- devices without a link-layer header: the frame starts with the IP header, whose
  first nibble (4 or 6) says which;
- IPv4 options (the TCP header is found from IHL), fragments with offset != 0 rejected
  (they carry no TCP header), IHL < 5 rejected;
- IPv6 extension headers: up to IPV6_EXT_MAX of hop-by-hop (0), routing (43),
  destination options (60) and fragment (44, offset 0 only: a later fragment carries no
  TCP header) are walked, unrolled (cBPF has no loops), keeping the walk's position in
  X and the next header in scratch memory M[0]. Any other header (AH, ESP, mobility,
  more than IPV6_EXT_MAX) is rejected: a kube NodePort handshake has none (the node's
  own SYN-ACKs never do, and a SYN with them would not be answered any differently).
  An IPv6 packet whose TCP flags lie beyond the snap length is rejected too, so user
  space never sees a truncated one.

- the length fields: an IPv4 total length or IPv6 payload length too short for the
  headers and a 20-byte TCP header, or longer than the frame, and a TCP data offset
  under 5, are rejected: the kernel drops such a packet before TCP (a SYN never
  answered: counted, it would be an unanswered handshake that never was one).

Loads past the end of the packet make the kernel return 0 (drop), so truncated frames
never reach user space.
"""

from __future__ import annotations

import ctypes
import socket
import struct
from collections.abc import Sequence

# Opcode pieces (linux/bpf_common.h).
LD, LDX, ST, STX, ALU, JMP, RET, MISC = 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07
W, H, B = 0x00, 0x08, 0x10
IMM, ABS, IND, MEM, LEN, MSH = 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0
ADD, AND, LSH = 0x00, 0x50, 0x60
JA, JEQ, JGT, JGE, JSET = 0x00, 0x10, 0x20, 0x30, 0x40
K, X = 0x00, 0x08
TAX, TXA = 0x00, 0x80

SKF_AD_OFF = -0x1000
SKF_AD_PKTTYPE = 4
SKF_AD_HATYPE = 28
PACKET_OUTGOING = 4  # skb->pkt_type of a packet the node sends (linux/if_packet.h)
SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27

# Device types (linux/if_arp.h) whose frames start with an Ethernet header ...
ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772
ETHERNET_HATYPES = (ARPHRD_ETHER, ARPHRD_LOOPBACK)
# ... and those whose frames start with the IP header (no header_ops in the kernel).
ARPHRD_PPP = 512
ARPHRD_RAWIP = 519
ARPHRD_TUNNEL = 768
ARPHRD_TUNNEL6 = 769
ARPHRD_NONE = 0xFFFE
RAW_IP_HATYPES = (ARPHRD_NONE, ARPHRD_RAWIP, ARPHRD_TUNNEL, ARPHRD_TUNNEL6, ARPHRD_PPP)

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
VLAN_TPIDS = (0x8100, 0x88A8)
TCP_SYN = 0x02
TCP_RST = 0x04
TCP_ACK = 0x10

# IPv6 extension headers the filter walks (and how many at most, unrolled).
IPV6_HOP_BY_HOP, IPV6_ROUTING, IPV6_FRAGMENT, IPV6_DEST_OPTS = 0, 43, 44, 60
IPV6_EXT_WALKED = (IPV6_HOP_BY_HOP, IPV6_ROUTING, IPV6_DEST_OPTS)  # length in byte 1
IPV6_EXT_MAX = 3
IPV6_HEADER = 40

DEFAULT_PORT_RANGE = (30000, 32767)
# Bytes kept per packet: Ethernet + two tags (22) + IPv4 with options (60) + the TCP
# fields we read (14) = 96; 128 leaves room and keeps ring slots small. IPv6: 22 + 40 +
# 14 = 76, leaving 52 bytes of extension headers (an IPv6 packet whose TCP flags lie
# further in is dropped by the filter).
DEFAULT_SNAPLEN = 128
# The common frame (Ethernet-like device, no tag in the frame, IPv4 without options) is
# kept at exactly this many bytes: Ethernet 14 + IPv4 20 + TCP up to the flags 14. The
# reader takes a captured length of exactly FAST_SNAPLEN at the usual link-layer offset
# as "the kernel already checked this frame" and reads it with one fixed-layout unpack.
# Any other frame passing the filter is at least 52 bytes long there (a tag or IP options
# add 4+), so it cannot be mistaken for one.
FAST_SNAPLEN = 48
_FAST_TCP_OFFSET = 14 + 20

Insn = tuple[int, int, int, int]  # code, jt, jf, k (struct sock_filter)
_INSN = struct.Struct("=HBBI")


class _Asm:
    """A tiny assembler with forward labels: cBPF jumps are relative 8-bit offsets."""

    def __init__(self) -> None:
        self.code: list[tuple[int, str | int, str | int, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def op(self, code: int, k: int = 0) -> None:
        self.code.append((code, 0, 0, k & 0xFFFFFFFF))

    def jmp(self, code: int, k: int, jt: str | int, jf: str | int) -> None:
        """``jt``/``jf``: a label, or 0 for "the next instruction"."""
        self.code.append((code, jt, jf, k & 0xFFFFFFFF))

    def ja(self, target: str) -> None:
        self.code.append((JMP | JA, target, 0, 0))

    def assemble(self) -> list[Insn]:
        out: list[Insn] = []
        for pc, (code, jt, jf, k) in enumerate(self.code):
            if code == JMP | JA and isinstance(jt, str):
                out.append((code, 0, 0, self._rel(pc, jt, limit=0xFFFFFFFF)))
                continue
            out.append((code, self._rel(pc, jt), self._rel(pc, jf), k))
        return out

    def _rel(self, pc: int, target: str | int, limit: int = 255) -> int:
        if isinstance(target, int):
            return target
        off = self.labels[target] - pc - 1
        if not 0 <= off <= limit:
            raise ValueError(f"BPF jump from {pc} to {target} out of range ({off})")
        return off


def nodeport_filter(port_range: tuple[int, int] = DEFAULT_PORT_RANGE,
                    snaplen: int = DEFAULT_SNAPLEN) -> list[Insn]:
    """The filter program as (code, jt, jf, k) tuples."""
    lo, hi = port_range
    if not 0 <= lo <= hi <= 0xFFFF:
        raise ValueError(f"bad port range {port_range}")
    if snaplen < 96:
        raise ValueError(f"snaplen {snaplen} < 96 would cut headers the reader needs")
    a = _Asm()
    a.op(LD | W | ABS, SKF_AD_OFF + SKF_AD_HATYPE)
    for t in ETHERNET_HATYPES:
        a.jmp(JMP | JEQ | K, t, "eth", 0)
    for t in RAW_IP_HATYPES:
        a.jmp(JMP | JEQ | K, t, "raw", 0)
    a.op(RET | K, 0)

    a.label("raw")  # no link-layer header: the IP version says which
    a.op(LDX | IMM, 0)
    a.op(LD | B | ABS, 0)
    a.op(ALU | AND | K, 0xF0)
    a.jmp(JMP | JEQ | K, 0x60, "ip6", 0)
    a.ja("ip")

    # Ethernet, then up to two VLAN tags: X = offset of the IP header.
    for depth, (off, nxt) in enumerate(((12, "vlan1"), (16, "vlan2"), (20, None))):
        a.label(("eth", "vlan1", "vlan2")[depth])
        a.op(LD | H | ABS, off)
        if nxt is not None:
            for tpid in VLAN_TPIDS:
                a.jmp(JMP | JEQ | K, tpid, nxt, 0)
        a.op(LDX | IMM, off + 2)
        a.jmp(JMP | JEQ | K, ETH_P_IP, "ip", 0)
        a.jmp(JMP | JEQ | K, ETH_P_IPV6, "ip6", "drop")

    a.label("ip")
    a.op(LD | B | IND, 0)  # version/IHL
    a.op(ALU | AND | K, 0xF0)
    a.jmp(JMP | JEQ | K, 0x40, 0, "drop")
    a.op(LD | B | IND, 9)  # protocol
    a.jmp(JMP | JEQ | K, socket.IPPROTO_TCP, 0, "drop")
    a.op(LD | H | IND, 6)  # flags + fragment offset
    a.jmp(JMP | JSET | K, 0x1FFF, "drop", 0)
    a.op(LD | H | IND, 2)  # total length
    a.op(ST, 1)
    a.op(MISC | TXA, 0)
    a.op(ST, 2)  # M[2] = offset of the IP header
    a.op(LD | B | IND, 0)
    a.op(ALU | AND | K, 0x0F)
    a.op(ALU | LSH | K, 2)  # A = IHL * 4
    a.jmp(JMP | JGE | K, 20, 0, "drop")
    a.op(ST, 3)
    # the IP length field must hold the headers, and the frame the whole datagram: the
    # kernel drops any other packet before TCP sees it, so its SYN is never answered
    # (counted, it would be an unanswered handshake that never was one)
    a.op(ALU | ADD | K, 20)
    a.op(MISC | TAX, 0)  # X = IHL * 4 + a TCP header
    a.op(LD | MEM, 1)
    a.jmp(JMP | JGE | X, 0, 0, "drop")
    a.op(LDX | MEM, 2)
    a.op(ALU | ADD | X, 0)
    a.op(MISC | TAX, 0)  # X = where the datagram ends
    a.op(LD | W | LEN, 0)
    a.jmp(JMP | JGE | X, 0, 0, "drop")
    a.op(LDX | MEM, 2)
    a.op(LD | MEM, 3)
    a.op(ALU | ADD | X, 0)  # A = L2 length + IP header length
    a.op(MISC | TAX, 0)  # X = offset of the TCP header
    a.ja("tcp")

    # IPv6: X = offset of the IPv6 header. The walk keeps the next header in M[0] (A is
    # needed to move X) and the offset of the header it names in X.
    a.label("ip6")
    a.op(LD | B | IND, 0)
    a.op(ALU | AND | K, 0xF0)
    a.jmp(JMP | JEQ | K, 0x60, 0, "drop")
    a.op(MISC | TXA, 0)
    a.op(ST, 2)  # M[2] = offset of the IPv6 header
    a.op(LD | B | IND, 6)  # next header
    a.op(ST, 0)
    a.op(MISC | TXA, 0)
    a.op(ALU | ADD | K, IPV6_HEADER)
    a.op(MISC | TAX, 0)
    for i in range(IPV6_EXT_MAX + 1):
        a.label(f"nh{i}")
        a.op(LD | MEM, 0)
        a.jmp(JMP | JEQ | K, socket.IPPROTO_TCP, "tcp6", 0)
        if i == IPV6_EXT_MAX:
            a.ja("drop")
            break
        for h in IPV6_EXT_WALKED:
            a.jmp(JMP | JEQ | K, h, f"ext{i}", 0)
        a.jmp(JMP | JEQ | K, IPV6_FRAGMENT, 0, "drop")
        a.op(LD | H | IND, 2)  # fragment offset (13 bits) + flags
        a.jmp(JMP | JSET | K, 0xFFF8, "drop", 0)
        a.op(LD | B | IND, 0)
        a.op(ST, 0)
        a.op(MISC | TXA, 0)
        a.op(ALU | ADD | K, 8)  # a fragment header is 8 bytes
        a.op(MISC | TAX, 0)
        a.ja(f"nh{i + 1}")
        a.label(f"ext{i}")
        a.op(LD | B | IND, 0)
        a.op(ST, 0)
        a.op(LD | B | IND, 1)  # length in 8-byte units, not counting the first 8
        a.op(ALU | LSH | K, 3)
        a.op(ALU | ADD | K, 8)
        a.op(ALU | ADD | X, 0)
        a.op(MISC | TAX, 0)
    a.label("tcp6")
    # as for IPv4: the payload length must hold the extension headers and a TCP header,
    # and the frame the whole datagram
    a.op(MISC | TXA, 0)
    a.op(ST, 3)  # M[3] = offset of the TCP header
    a.op(LDX | MEM, 2)
    a.op(LD | H | IND, 4)  # payload length
    a.op(ALU | ADD | K, IPV6_HEADER)
    a.op(ALU | ADD | X, 0)
    a.op(ST, 1)  # M[1] = where the datagram ends
    a.op(MISC | TAX, 0)
    a.op(LD | W | LEN, 0)
    a.jmp(JMP | JGE | X, 0, 0, "drop")
    a.op(LD | MEM, 3)
    a.op(ALU | ADD | K, 20)
    a.op(MISC | TAX, 0)
    a.op(LD | MEM, 1)
    a.jmp(JMP | JGE | X, 0, 0, "drop")
    a.op(LDX | MEM, 3)
    a.op(MISC | TXA, 0)  # the TCP flags must be within what is kept
    a.jmp(JMP | JGT | K, snaplen - 14, "drop", "tcp")

    a.label("tcp")
    a.op(LD | B | IND, 12)  # data offset: a TCP header is at least 20 bytes
    a.op(ALU | AND | K, 0xF0)
    a.jmp(JMP | JGE | K, 0x50, 0, "drop")
    # Flags and direction, as HandshakeTable._dispatch reads them: a SYN coming in to a
    # NodePort, the node's SYN-ACK or RST going out from one, a RST coming in to one.
    # Anything else (data, FIN, the handshake's last ACK, our own SYNs out, SYN-ACKs in)
    # is dropped here, so established traffic never wakes the agent.
    a.op(LD | B | IND, 13)  # TCP flags
    a.jmp(JMP | JSET | K, TCP_SYN, 0, "rst")
    a.jmp(JMP | JSET | K, TCP_ACK, "synack", 0)
    a.op(LD | W | ABS, SKF_AD_OFF + SKF_AD_PKTTYPE)  # a SYN: not our own, going out
    a.jmp(JMP | JEQ | K, PACKET_OUTGOING, "drop", "dport")
    a.label("synack")
    a.op(LD | W | ABS, SKF_AD_OFF + SKF_AD_PKTTYPE)  # a SYN-ACK: the node's, going out
    a.jmp(JMP | JEQ | K, PACKET_OUTGOING, "sport", "drop")
    a.label("rst")
    a.jmp(JMP | JSET | K, TCP_RST, 0, "drop")
    a.op(LD | W | ABS, SKF_AD_OFF + SKF_AD_PKTTYPE)  # a RST: out from, or in to, a NodePort
    a.jmp(JMP | JEQ | K, PACKET_OUTGOING, "sport", "dport")
    a.label("dport")
    a.op(LD | H | IND, 2)  # destination port
    a.jmp(JMP | JGE | K, lo, 0, "drop")
    a.jmp(JMP | JGT | K, hi, "drop", "accept")
    a.label("sport")
    a.op(LD | H | IND, 0)  # source port
    a.jmp(JMP | JGE | K, lo, 0, "drop")
    a.jmp(JMP | JGT | K, hi, "drop", "accept")
    a.label("accept")
    a.op(MISC | TXA, 0)
    a.jmp(JMP | JEQ | K, _FAST_TCP_OFFSET, 0, "keep")
    a.op(RET | K, FAST_SNAPLEN)
    a.label("keep")
    a.op(RET | K, snaplen)
    a.label("drop")
    a.op(RET | K, 0)
    return a.assemble()


def pack(program: Sequence[Insn]) -> bytes:
    return b"".join(_INSN.pack(*insn) for insn in program)


def attach(sock: socket.socket, program: Sequence[Insn]) -> None:
    """SO_ATTACH_FILTER: the kernel copies the program, the buffer may go after the call."""
    raw = pack(program)
    buf = ctypes.create_string_buffer(raw, len(raw))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }
    fprog = struct.pack("HP", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def run(program: Sequence[Insn], frame: bytes, hatype: int = ARPHRD_ETHER,
        pkttype: int = 0) -> int:
    """Interpret ``program`` on ``frame`` the way the kernel does (the subset used here).

    Returns the number of bytes the kernel would keep (0 = dropped). For tests and for
    checking a filter offline; not on the packet path.
    """
    a = x = 0
    mem = [None] * 16  # scratch memory; reading a slot never written is a bug
    pc = 0
    n = len(frame)

    def load(off: int, size: int) -> int | None:
        if off == SKF_AD_OFF + SKF_AD_HATYPE and size == 4:
            return hatype
        if off == SKF_AD_OFF + SKF_AD_PKTTYPE and size == 4:
            return pkttype
        if off < 0 or off + size > n:
            return None
        return int.from_bytes(frame[off:off + size], "big")

    sizes = {W: 4, H: 2, B: 1}
    while pc < len(program):
        code, jt, jf, k = program[pc]
        pc += 1
        cls = code & 0x07
        if cls == LD:
            mode, size = code & 0xE0, sizes[code & 0x18]
            if mode == IMM:
                a = k
                continue
            if mode == LEN:
                a = n
                continue
            if mode == MEM:
                got = mem[k]
                if got is None:
                    raise ValueError(f"BPF load of scratch M[{k}] before a store")
                a = got
                continue
            kk = k - 0x100000000 if k & 0x80000000 else k
            got = load(kk if mode == ABS else x + kk, size)
            if got is None:
                return 0
            a = got
        elif cls == LDX:
            if code & 0xE0 == MSH:
                got = load(k, 1)
                if got is None:
                    return 0
                x = (got & 0x0F) * 4
            elif code & 0xE0 == MEM:
                got = mem[k]
                if got is None:
                    raise ValueError(f"BPF load of scratch M[{k}] before a store")
                x = got
            else:
                x = k
        elif cls == ST:
            mem[k] = a
        elif cls == STX:
            mem[k] = x
        elif cls == ALU:
            src = x if code & X else k
            op = code & 0xF0
            if op == ADD:
                a = (a + src) & 0xFFFFFFFF
            elif op == AND:
                a &= src
            elif op == LSH:
                a = (a << src) & 0xFFFFFFFF
            else:
                raise ValueError(f"ALU op {op:#x} not supported")
        elif cls == JMP:
            op = code & 0xF0
            if op == JA:
                pc += k
                continue
            src = x if code & X else k
            hit = {JEQ: a == src, JGT: a > src, JGE: a >= src, JSET: bool(a & src)}[op]
            pc += jt if hit else jf
        elif cls == RET:
            return min(k, n)
        elif cls == MISC:
            if code & 0xF8 == TAX:
                x = a
            else:
                a = x
    return 0
