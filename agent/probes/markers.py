"""Cheap change markers for the expensive sources: has anything changed since the last read?

A node with 10k LoadBalancer services holds some 150-230k nat rules; reading them with
iptables-nft-save takes 20-30 s of CPU. The daemon reads them every interval, so it asks
these markers first and reuses the previous read when its marker is the same:

- nftables: the ruleset generation id (NFT_MSG_GETGEN), which the kernel bumps on every
  committed transaction of the network namespace (any table, any family). Exact: no
  commit, no change; reads (iptables -S, -C, nft list) and counters do not bump it.
  Where it moved, a digest of what the family's tables hold (``nft_rules_digest``, 2 s
  of CPU at 155k rules where a read takes 30 s) tells a change from a commit that wrote
  the same rules again: kube-proxy's syncs (iptables mode) rewrite KUBE-SERVICES and its
  peers each time, and other tools commit their own tables.
- legacy iptables: each table's blob (IPT_SO_GET_ENTRIES on a raw socket), hashed with
  every rule's packet/byte counters zeroed. IPT_SO_GET_INFO's entry count and size
  alone miss a rewrite of the same size (an endpoint's address changed in a DNAT rule).
- ipsets: the IPSET_CMD_LIST dump's bytes (headers and members), hashed. A set whose
  entries carry counters or timeouts changes on every dump: it is always re-read.
- IPVS: /proc/net/ip_vs (services, schedulers, flags, real servers and weights) without
  the connection counters.

Read-only like every probe: a marker is None ("unknown, read everything") whenever asking
could load a module or create a table (see ``base.kernel_module_present`` and
``nat_rules``'s docstring), and on any error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.probes.base import kernel_module_present

NETLINK_NETFILTER = 12
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLM_F_DUMP_INTR = 0x10
NLMSG_ERROR, NLMSG_DONE = 2, 3
NFNL_SUBSYS_IPSET, NFNL_SUBSYS_NFTABLES = 6, 10
NFT_MSG_GETTABLE, NFT_MSG_GETCHAIN, NFT_MSG_GETRULE, NFT_MSG_GETGEN = 1, 4, 7, 16
NFTA_TABLE_NAME, NFTA_TABLE_USE = 1, 3
NFTA_GEN_ID = 1
NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME = 1, 3
NFTA_RULE_TABLE, NFTA_RULE_CHAIN = 1, 2
IPSET_CMD_LIST, IPSET_ATTR_PROTOCOL, IPSET_PROTOCOL = 7, 1, 6
NFPROTO_IPV4, NFPROTO_IPV6 = 2, 10
_NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER

# IPT_SO_GET_* and IP6T_SO_GET_* have the same numbers (at IPPROTO_IP / IPPROTO_IPV6)
IPT_SO_GET_INFO, IPT_SO_GET_ENTRIES = 64, 65
_IPT_GETINFO = struct.Struct("32sI5I5III")  # name, valid_hooks, hook_entry, underflow, n, size
_IPT_GET_ENTRIES_HEAD = 40  # char name[32]; unsigned int size; (8-aligned entrytable)
LEGACY_MAX_BLOB = 512 << 20  # a table larger than this is not hashed (re-read instead)

PROC_IP_VS = Path("/proc/net/ip_vs")
IP_TABLES_NAMES = Path("/proc/net/ip_tables_names")
IP6_TABLES_NAMES = Path("/proc/net/ip6_tables_names")


@dataclass(frozen=True)
class _LegacyFamily:
    names: Path  # the tables this namespace holds
    sock: tuple[int, int]  # (address family, sockopt level)
    next_offset: int  # of u16 next_offset in the entry
    counters: int  # of struct xt_counters {u64 pcnt, bcnt} in the entry


_LEGACY = {
    # struct ipt_entry: ipt_ip (84), nfcache, target_offset, next_offset at 90, comefrom,
    # counters at 96..112
    4: _LegacyFamily(IP_TABLES_NAMES, (socket.AF_INET, socket.IPPROTO_IP), 90, 96),
    # struct ip6t_entry: ip6t_ip6 (133, padded to 136), nfcache, target_offset, next_offset
    # at 142, comefrom, counters 8-aligned at 152..168
    6: _LegacyFamily(IP6_TABLES_NAMES, (socket.AF_INET6, socket.IPPROTO_IPV6), 142, 152),
}
# a real server line's connection counters (ActiveConn InActConn) change with traffic
_IPVS_CONNS = re.compile(rb"^(  -> \S+\s+\S+\s+\S+)\s+\d+\s+\d+[ \t]*$", re.M)


class MarkerError(OSError):
    """A marker could not be read (the caller re-reads the source)."""


# --- nfnetlink ----------------------------------------------------------------------


def _attrs(payload: bytes, start: int) -> dict[int, bytes]:
    """Top-level netlink attributes from ``start`` (type without flags -> value)."""
    out = {}
    i = start
    while i + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, i)
        if length < 4:
            break
        out[kind & _NLA_TYPE_MASK] = payload[i + 4:i + length]
        i += (length + 3) & ~3
    return out


def _nfnl_request(subsys: int, cmd: int, flags: int, family: int = 0,
                  attrs: bytes = b"", timeout: float = 5.0) -> list[bytes]:
    """Send one nfnetlink request; the payloads (after nlmsghdr) of its answers."""
    with _Nfnl(timeout) as nl:
        return list(nl.answers(subsys, cmd, flags, family, attrs))


class _Nfnl:
    """A NETLINK_NETFILTER socket for requests one after another (a digest asks once per
    chain: 47k chains on a 10k-service node).

    Opened only by callers that checked the subsystem's module is there: opening
    NETLINK_NETFILTER or asking a missing subsystem makes the kernel modprobe.
    """

    def __init__(self, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.seq = 0
        self.buf = bytearray(1 << 17)  # a dump's answers are at most 32 KiB each
        try:
            self.sock.settimeout(timeout)
            self.sock.bind((0, 0))
        except OSError:
            self.sock.close()
            raise

    def __enter__(self) -> _Nfnl:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def answers(self, subsys: int, cmd: int, flags: int, family: int = 0,
                attrs: bytes = b"") -> Iterator[bytes]:
        """The payloads (after nlmsghdr) of one request's answers, as they come (a dump
        of 230k rules is tens of MB: never held whole). A dump the kernel marks
        interrupted (a commit during it, NLM_F_DUMP_INTR) raises MarkerError."""
        self.seq += 1
        seq = self.seq
        body = struct.pack("!BBH", family, 0, 0) + attrs  # nfgenmsg: family, version, res_id
        self.sock.send(struct.pack("=IHHII", 16 + len(body), (subsys << 8) | cmd,
                                   NLM_F_REQUEST | flags, seq, 0) + body)
        done = False
        buf = self.buf
        while not done:
            # (into one buffer: a fresh 1 MiB per answer, shrunk to its 32 KiB, left
            # malloc's heap at 90 MiB after a digest of 155k rules)
            got = self.sock.recv_into(buf, 0, socket.MSG_TRUNC)
            if got > len(buf):
                raise MarkerError(f"netlink: an answer of {got} bytes")
            if not got:
                raise MarkerError("netlink: connection closed")
            data = memoryview(buf)[:got]
            i = 0
            while i + 16 <= got:
                length, kind, mflags, mseq, _ = struct.unpack_from("=IHHII", data, i)
                if length < 16:
                    raise MarkerError("netlink: malformed message")
                if mseq == seq:
                    if mflags & NLM_F_DUMP_INTR:
                        raise MarkerError("netlink: the dump was interrupted by a change")
                    if kind == NLMSG_ERROR:
                        err = -struct.unpack_from("=i", data, i + 16)[0]
                        if err:
                            raise MarkerError(err, os.strerror(err))
                        done = True
                    elif kind == NLMSG_DONE:
                        done = True
                    else:
                        yield bytes(data[i + 16:i + length])
                        if not flags & NLM_F_DUMP:
                            done = True
                i += (length + 3) & ~3


def _nla(kind: int, value: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    return struct.pack("=HH", 4 + len(value), kind) + value + bytes(-len(value) % 4)


def nft_generation() -> int | None:
    """The nftables ruleset generation id of this network namespace (None: no nf_tables)."""
    if not kernel_module_present("nf_tables"):
        return None
    for payload in _nfnl_request(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETGEN, 0):
        gen = _attrs(payload, 4).get(NFTA_GEN_ID)
        if gen is not None and len(gen) == 4:
            return int(struct.unpack("!I", gen)[0])
    raise MarkerError("NFT_MSG_GETGEN: no generation id in the answer")


# Attributes of a table, chain or rule that say where it sits, what it counted or what
# refers to it, not what it does: kube-proxy's syncs rewrite the same rules (flushed and
# added again: new handles), and traffic moves the counters.
_NFT_NOT_CONTENT = {
    # NFTA_TABLE_USE, _HANDLE, _PAD, _OWNER
    NFT_MSG_GETTABLE: frozenset({3, 4, 5, 7}),
    # NFTA_CHAIN_HANDLE, _USE, _COUNTERS, _PAD, _ID
    NFT_MSG_GETCHAIN: frozenset({2, 6, 8, 9, 11}),
    # NFTA_RULE_HANDLE, _POSITION (the previous rule's handle), _PAD, _ID, _POSITION_ID,
    # _CHAIN_ID
    NFT_MSG_GETRULE: frozenset({3, 6, 8, 9, 10, 11}),
}
# a "counter" expression's NFTA_LIST_ELEM: its NFTA_EXPR_NAME; the NFTA_EXPR_DATA after it
# holds the packets and bytes it counted
_COUNTER_NAME = struct.pack("=HH", 12, 1) + b"counter\0"
NFTA_RULE_EXPRESSIONS = 4
DIGEST_SECONDS = 60.0  # 2 s at 155k rules and 47k chains here; beyond: "may have changed"
# family -> ((network namespace, generation), its digest)
_nft_digests: dict[int, tuple[tuple[int, int], str]] = {}


def nft_rules_digest(family: int = NFPROTO_IPV4, gen: int | None = None) -> str | None:
    """A digest of what the nftables tables of ``family`` hold (their flags, chains with
    hooks and policies, rules in order), without handles, counters and use counts; None
    without nf_tables. The generation id moves on every commit of the namespace: another
    family's table, another tool's, and kube-proxy's own syncs, which (iptables mode)
    flush and write KUBE-SERVICES and its peers again each time, unchanged or not. This
    tells such a commit from a change. Taken again only when the generation (``gen``,
    when the caller just read it) moved."""
    if gen is None:
        gen = nft_generation()
        if gen is None:
            return None
    # (a generation id is the namespace's own: another namespace's may be the same)
    try:
        key = (os.stat("/proc/self/ns/net").st_ino, gen)
    except OSError:  # no /proc: this process's one namespace
        key = (0, gen)
    memo = _nft_digests.get(family)
    if memo is not None and memo[0] == key:
        return memo[1]
    h = hashlib.blake2b(digest_size=16)
    chains: list[tuple[bytes, bytes]] = []
    with _Nfnl(timeout=10.0) as nl:
        for cmd in (NFT_MSG_GETTABLE, NFT_MSG_GETCHAIN):
            for payload in nl.answers(NFNL_SUBSYS_NFTABLES, cmd, NLM_F_DUMP, family):
                _hash_framed(h, [_content(payload, cmd)])
                if cmd == NFT_MSG_GETCHAIN:
                    a = _attrs(payload, 4)
                    chains.append((a.get(NFTA_CHAIN_TABLE, b""), a.get(NFTA_CHAIN_NAME, b"")))
        # the rules chain by chain: a dump of the whole family restarts from its first
        # rule for each 32 KiB it returns (10 s of kernel time at 155k rules here, 2 s
        # this way)
        deadline = time.monotonic() + DIGEST_SECONDS
        for table, chain in chains:
            h.update(b"\xff\xff" + table + b"\xff" + chain)
            where = _nla(NFTA_RULE_TABLE, table) + _nla(NFTA_RULE_CHAIN, chain)
            rules: list[bytes] = []
            size = 0
            at = 4 + len(where)
            for payload in nl.answers(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETRULE, NLM_F_DUMP,
                                      family, where):
                # (its table and chain, as asked, are hashed once above)
                rules.append(_content(payload, NFT_MSG_GETRULE,
                                      at if payload.startswith(where, 4) else 4))
                size += len(rules[-1])
                if size > _BATCH:
                    _hash_framed(h, rules)
                    rules, size = [], 0
            _hash_framed(h, rules)
            if time.monotonic() > deadline:
                raise MarkerError(f"nftables digest: over {DIGEST_SECONDS:g} s")
    # one request per chain: a commit between two of them makes a digest of no state
    # the node was in (the kernel marks a commit within one dump only)
    if nft_generation() != gen:
        raise MarkerError("nftables: committed to while its digest was taken")
    digest = h.hexdigest()
    _nft_digests[family] = (key, digest)
    return digest


_BATCH = 1 << 18  # bytes of rules hashed at once (KUBE-SERVICES is 14 MB at 10k services)


def _hash_framed(h: hashlib._Hash, messages: list[bytes]) -> None:
    """Each of ``messages`` into ``h``, after its length (one update for them all)."""
    h.update(b"".join(len(m).to_bytes(4, "little") + m for m in messages))


def _content(payload: bytes, cmd: int, start: int = 4) -> bytes:
    """What a table, chain or rule message says the object does: nfgenmsg's family and
    version (its res_id is the generation), then its attributes from ``start`` without
    those of _NFT_NOT_CONTENT and, in a rule, the values of its counter expressions
    (found by the expressions' structure: a match's binary data may hold the same bytes)."""
    out = [payload[:2]]
    keep = i = start
    skip = _NFT_NOT_CONTENT[cmd]
    expressions = NFTA_RULE_EXPRESSIONS if cmd == NFT_MSG_GETRULE else -1
    unpack = struct.unpack_from
    n = len(payload)
    while i + 4 <= n:
        length, kind = unpack("=HH", payload, i)
        if length < 4:
            raise MarkerError("netlink: malformed attribute")
        end = i + ((length + 3) & ~3)
        kind &= _NLA_TYPE_MASK
        if kind in skip:
            out.append(payload[keep:i])
            keep = end
        elif kind == expressions:
            e, stop = i + 4, min(i + length, n)
            while e + 4 <= stop:
                elen = unpack("=H", payload, e)[0]
                if elen < 4:
                    raise MarkerError("netlink: malformed expression")
                if payload.startswith(_COUNTER_NAME, e + 4):  # its data: what it counted
                    out.append(payload[keep:e + 16])
                    keep = e + ((elen + 3) & ~3)
                e += (elen + 3) & ~3
        i = end
    out.append(payload[keep:])
    return b"".join(out)


def nft_table_uses(family: int = NFPROTO_IPV4) -> dict[str, int]:
    """Table name -> its use count (its chains and sets) for ``family``; {} without
    nf_tables. Sizes a read's time budget without listing a rule."""
    if not kernel_module_present("nf_tables"):
        return {}
    out = {}
    for payload in _nfnl_request(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETTABLE, NLM_F_DUMP, family):
        a = _attrs(payload, 4)
        name, use = a.get(NFTA_TABLE_NAME), a.get(NFTA_TABLE_USE)
        if name is not None and use is not None and len(use) == 4:
            out[name.rstrip(b"\0").decode(errors="replace")] = struct.unpack("!I", use)[0]
    return out


def ipset_digest() -> str | None:
    """A digest of every ipset (headers and members) in this namespace; None without
    ip_set (no sets: nothing to mark)."""
    if not kernel_module_present("ip_set"):
        return None
    # IPSET_ATTR_PROTOCOL (u8), padded to 4
    attr = struct.pack("=HHB3x", 5, IPSET_ATTR_PROTOCOL, IPSET_PROTOCOL)
    h = hashlib.blake2b(digest_size=16)
    for payload in _nfnl_request(NFNL_SUBSYS_IPSET, IPSET_CMD_LIST, NLM_F_DUMP,
                                 NFPROTO_IPV4, attr):
        h.update(struct.pack("=I", len(payload)))
        h.update(payload)
    return h.hexdigest()


# --- legacy iptables (x_tables) -------------------------------------------------------

_libc: ctypes.CDLL | None = None


def _getsockopt(fam: _LegacyFamily, opt: int, buf: ctypes.Array[ctypes.c_char]) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    size = ctypes.c_uint(len(buf))
    with socket.socket(fam.sock[0], socket.SOCK_RAW, socket.IPPROTO_RAW) as sock:
        failed = _libc.getsockopt(sock.fileno(), fam.sock[1], opt, buf, ctypes.byref(size))
    if failed != 0:
        err = ctypes.get_errno()
        raise MarkerError(err, os.strerror(err))


def legacy_table_names(family: int = 4) -> tuple[str, ...]:
    """The legacy tables this namespace holds (/proc/net/ip{,6}_tables_names; missing
    until ip{,6}_tables is loaded: none)."""
    try:
        return tuple(sorted(_LEGACY[family].names.read_text().split()))
    except OSError:
        return ()


@dataclass(frozen=True)
class LegacyInfo:
    table: str
    entries: int  # rules, including each chain's policy/ERROR entries
    size: int  # bytes of the table's blob


def legacy_info(table: str, family: int = 4) -> LegacyInfo:
    """I(P6)T_SO_GET_INFO of a table listed in /proc/net/ip{,6}_tables_names (asking for
    any other name would load iptable_NAME or create the table in this namespace)."""
    if table not in legacy_table_names(family):
        raise MarkerError(f"no legacy table {table!r} here")
    buf = ctypes.create_string_buffer(table.encode()[:31], _IPT_GETINFO.size)
    _getsockopt(_LEGACY[family], IPT_SO_GET_INFO, buf)
    fields = _IPT_GETINFO.unpack(buf.raw)
    return LegacyInfo(table, fields[-2], fields[-1])


def legacy_digest(table: str, family: int = 4) -> str:
    """The table's rules (IPT_SO_GET_ENTRIES) hashed without their counters.

    The counters are zeroed in the buffer, then the blob is hashed at once: at 230k rules
    the walk is one index read and two stores per entry (was two slices and two hash
    updates per entry: ~4x the CPU, most of the daemon's cycle on an unchanged node)."""
    fam = _LEGACY[family]
    info = legacy_info(table, family)
    if info.size > LEGACY_MAX_BLOB:
        raise MarkerError(f"legacy table {table} is {info.size} bytes")
    if info.size % 4:
        raise MarkerError(f"legacy table {table}: {info.size} bytes, not entries")
    buf = ctypes.create_string_buffer(_IPT_GET_ENTRIES_HEAD + info.size)
    struct.pack_into("32sI", buf, 0, table.encode()[:31], info.size)
    # EAGAIN-like races (the table replaced between the two calls: another size) come
    # back as EINVAL; the caller re-reads the rules then.
    _getsockopt(fam, IPT_SO_GET_ENTRIES, buf)
    blob = memoryview(buf).cast("B")[_IPT_GET_ENTRIES_HEAD:]
    half = blob.cast("H")  # native order, as the kernel wrote it
    # entries are XT_ALIGN'd: 8 bytes on 64-bit, where the counters are two u64 stores
    wide = blob.cast("Q") if info.size % 8 == 0 else None
    size, off = info.size, 0
    while off < size:
        nxt = half[(off + fam.next_offset) >> 1]
        if nxt < fam.counters + 16 or nxt & 3 or off + nxt > size:
            raise MarkerError(f"legacy table {table}: malformed entry at {off}")
        if wide is not None and not off & 7:
            q = (off + fam.counters) >> 3
            wide[q] = 0
            wide[q + 1] = 0
        else:
            blob[off + fam.counters:off + fam.counters + 16] = bytes(16)
        off += nxt
    h = hashlib.blake2b(struct.pack("=II", info.entries, info.size), digest_size=16)
    h.update(blob)
    return h.hexdigest()


# --- IPVS -----------------------------------------------------------------------------


def ipvs_digest() -> str | None:
    """/proc/net/ip_vs hashed without connection counters; None when ip_vs is not loaded
    (its file exists in every namespace once it is)."""
    try:
        with PROC_IP_VS.open("rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return hashlib.blake2b(_IPVS_CONNS.sub(rb"\1", text), digest_size=16).hexdigest()


# --- what the nat rules probe depends on ----------------------------------------------


def netfilter_marker(family: int = 4) -> tuple[object, ...]:
    """Everything the rules probe's answer depends on (iptables', or ip6tables' for
    ``family`` 6): the nft generation and each legacy table's digest. Raises MarkerError
    when a part cannot be read."""
    legacy = tuple((t, legacy_digest(t, family)) for t in legacy_table_names(family))
    return ("nft", nft_generation(), "legacy", legacy)


def netfilter_content(marker: object, family: int = 4) -> tuple[object, ...]:
    """``marker`` (netfilter_marker's, just taken) with what the family's nft tables hold
    in place of the generation, which every commit of the namespace moves
    (nft_rules_digest); its legacy digests are exact already."""
    if not (isinstance(marker, tuple) and len(marker) == 4 and marker[0] == "nft"):
        raise MarkerError(f"not a netfilter marker: {marker!r}")
    gen = marker[1]
    digest = None if gen is None else \
        nft_rules_digest(NFPROTO_IPV6 if family == 6 else NFPROTO_IPV4, gen)
    return ("nft", digest, *marker[2:])
