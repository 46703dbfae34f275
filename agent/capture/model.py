"""What a capture of NodePort handshakes found (plain data, JSON round trip via
agent.snapshot.to_plain / from_plain)."""

from __future__ import annotations

from dataclasses import dataclass, field

# How a SYN to a NodePort ended.
ANSWERED = "answered"  # SYN-ACK left through the interface the SYN came in on
BYPASSED = "bypassed"  # SYN-ACK left through another interface: the reply skips the LB
RESET = "reset"  # the node answered with RST
UNANSWERED = "unanswered"  # nothing within the handshake timeout: dropped
PENDING = "pending"  # capture ended before the timeout ran out
OUTCOMES = (ANSWERED, BYPASSED, RESET, UNANSWERED, PENDING)

# Who sent the SYN.
SRC_LOCAL = "local"  # an address of this node (e.g. an LB VIP on kube-ipvs0)
SRC_POD = "pod"  # a pod IP of this node
SRC_LB = "lb-ip"  # a known LB IP that is not local here
SRC_OTHER = "other"
SOURCE_CLASSES = (SRC_LOCAL, SRC_POD, SRC_LB, SRC_OTHER)


@dataclass(frozen=True)
class HandshakeSample:
    """One SYN and how it ended (evidence)."""

    src: str
    sport: int
    dst: str
    dport: int
    in_iface: str
    outcome: str
    source_class: str
    reply_iface: str | None = None  # where the SYN-ACK/RST left, if it did
    peer_reset: bool = False  # the client answered our SYN-ACK with RST (it expected the LB)


@dataclass(frozen=True)
class NodePortStats:
    node_port: int
    protocol: str = "TCP"
    syns: int = 0
    # outcome -> source class -> count
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    samples: tuple[HandshakeSample, ...] = ()  # a few per (outcome, source class)


@dataclass(frozen=True)
class FailedHandshakes:
    """The handshakes to one NodePort from one source class that failed (bypassed or
    unanswered), with when: what a finding's per-port table is made of. For the node's
    own addresses (SRC_LOCAL: a VIP health-checking from here) per source address, as
    a finding names that address; for the other classes per class (``src`` None), so a
    flood from random sources cannot grow it."""

    node_port: int
    source_class: str
    outcome: str  # BYPASSED or UNANSWERED
    src: str | None = None
    count: int = 0
    first_seen: float = 0.0  # wall clock (epoch seconds) of the first such SYN
    last_seen: float = 0.0  # ... and of the last


@dataclass(frozen=True)
class Corroboration:
    """A kernel counter or log that supports (or not) what the capture saw."""

    source: str  # "in_martian_src", "TcpExtIPReversePathFilter", "TcpExtEmbryonicRsts",
    #              "kernel log", "kfree_skb"
    available: bool
    value: int | None = None  # delta over the capture
    detail: str = ""  # "unavailable, because ..." or sample lines


@dataclass(frozen=True)
class CaptureResult:
    seconds: float
    port_range: tuple[int, int]
    ports: tuple[NodePortStats, ...] = ()
    packets_seen: int = 0  # packets the filter passed to us
    kernel_packets: int = 0  # PACKET_STATISTICS tp_packets
    kernel_drops: int = 0  # PACKET_STATISTICS tp_drops: ring overflow, never hidden
    kernel_freezes: int = 0  # PACKET_STATISTICS tp_freeze_q_cnt: ring was full at times
    retransmissions: int = 0  # repeated SYNs of a handshake already in the table
    table_evictions: int = 0  # handshakes dropped from the bounded table
    table_capacity: int = 0
    decode_errors: int = 0  # packets we could not decode (truncated, odd)
    corroboration: tuple[Corroboration, ...] = ()
    problems: tuple[str, ...] = ()  # "capture unavailable: ..." and similar
    # failed handshakes per (NodePort, source class[, local source address]), bounded
    failures: tuple[FailedHandshakes, ...] = ()
    # a verdict document lists a bounded number of ports: what it left out, so a result
    # read back from one (Verdict.from_dict) still adds up to the same totals
    ports_omitted: int = 0
    syns_omitted: int = 0
