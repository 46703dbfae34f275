"""gzip both ways, bounded: what the spool writes and the sender and collector exchange.

Inflating is done in steps of at most ``step`` output bytes, so a zip bomb (a few KiB
that inflate to GiBs) is refused after producing at most ``limit`` bytes, never held
whole. Exactly one gzip member is accepted: a second member, trailing bytes, a truncated
stream and a wrong CRC or length are each refused with a reason.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Iterator

MAGIC = b"\x1f\x8b"
LEVEL = 6  # 10k-service verdict: 21 MB -> 1.5 MB in 0.2 s (level 1: 1.9 MB in 0.08 s)
STEP = 1 << 20
# The collector's limits on one POST, which the agent sizes its batches by: the body as
# received (compressed or not), and what a gzip body may inflate to (a 10k-LoadBalancer-
# service node's verdict is 21 MB in iptables mode, 33 MB in IPVS mode; a zip bomb is
# refused at this size, never held whole)
WIRE_LIMIT = 4 * 1024 * 1024
INFLATED_LIMIT = 64 * 1024 * 1024


class GzipError(ValueError):
    """Not one well-formed gzip member (``too_large``: it inflates past the limit)."""

    def __init__(self, message: str, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


def compress(data: bytes) -> bytes:
    # mtime=0: the same document always gives the same bytes
    return gzip.compress(data, compresslevel=LEVEL, mtime=0)


def compress_chunks(chunks: Iterable[bytes], limit: int | None = None) -> bytes:
    """One gzip member of the concatenated ``chunks``, never holding them together: what
    is held is the compressed output (1/13 of a verdict). ValueError once more than
    ``limit`` bytes came in (GzipError, too_large)."""
    c = zlib.compressobj(LEVEL, zlib.DEFLATED, 31)  # 31: gzip header (mtime 0) and trailer
    out = bytearray()
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if limit is not None and total > limit:
            raise GzipError(f"more than {limit} bytes to compress", too_large=True)
        out += c.compress(chunk)
    out += c.flush()
    return bytes(out)


def check(data: bytes | bytearray, limit: int, step: int = STEP) -> tuple[int, bytes, bytes]:
    """Inflate and drop: (inflated size, its first byte, its last byte). GzipError as
    inflate_chunks: the CRC-32 and length checked without holding the inflated bytes."""
    size, first, last = 0, b"", b""
    for chunk in inflate_chunks(data, limit, step):
        first = first or chunk[:1]
        last = chunk[-1:]
        size += len(chunk)
    return size, first, last


def is_gzip(data: bytes | bytearray) -> bool:
    return data[:2] == MAGIC


def inflate_chunks(data: bytes | bytearray, limit: int, step: int = STEP) -> Iterator[bytes]:
    """The inflated bytes of one gzip member, ``step`` at most at a time; GzipError when
    the stream is not exactly one intact member or inflates past ``limit``."""
    d = zlib.decompressobj(wbits=31)  # 31: gzip header and trailer, CRC-32 and size checked
    buf: bytes | bytearray = data
    total = 0
    while True:
        try:
            out = d.decompress(buf, min(step, limit - total + 1))
        except zlib.error as e:
            raise GzipError(f"not a valid gzip stream: {e}") from None
        buf = d.unconsumed_tail
        total += len(out)
        if total > limit:
            raise GzipError(f"inflates to more than {limit} bytes", too_large=True)
        if out:
            yield out
        if d.eof:
            break
        if not buf and not out:
            raise GzipError("truncated gzip stream (no end of the member)")
    if d.unused_data:
        if d.unused_data[:2] == MAGIC:
            raise GzipError("more than one gzip member (concatenated streams)")
        raise GzipError(f"{len(d.unused_data)} bytes after the end of the gzip stream")


def inflate(data: bytes | bytearray, limit: int, step: int = STEP) -> bytearray:
    out = bytearray()
    for chunk in inflate_chunks(data, limit, step):
        out += chunk
    return out
