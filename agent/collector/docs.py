"""A verdict as the store keeps it: one document per distinct content, and per POST only
what differs (its ``time`` and idempotency key).

The text served for a verdict is ``dump(verdict)`` (compact, the keys in the order
received). It is split into a *body*, the same text with the top-level ``time`` and
``idempotency_key`` values replaced by ``null``, and a *frame*: where those values go
back and their JSON text. Joining them gives the served text byte for byte, so what the
API returns does not change. The body's sha256 is the document's fingerprint: the same
verdict re-sent at every heartbeat has one body, stored once (gzipped) and referenced by
each POST's history row. The agent spools with sorted keys, so for it the body is the
canonical JSON of the verdict without those two values.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from agent.collector.intake import MAX_INFLATED, VOLATILE, BadRequest, dump

_HOLE = "null"


@dataclass(frozen=True)
class Body:
    text: bytes  # UTF-8: the served text with VOLATILE values as null
    fingerprint: str  # sha256 hex of ``text``
    holes: tuple[tuple[str, int], ...]  # (key, character offset of its null in the body)
    chars: int  # len() of the body as str (SQLite's length() of the served text counts these)
    keys: tuple[str, ...]  # the top-level keys in order: the body is made for these only


def split(v: dict[str, Any]) -> Body:
    """The body of a verdict (a JSON object). One top-level member is encoded at a time,
    which gives the same text as ``dump(v)`` (compact separators, no sorting)."""
    parts: list[str] = []
    holes: list[tuple[str, int]] = []
    pos = 1  # after "{"
    for k, value in v.items():
        head = dump(k) + ":"
        member = head + (_HOLE if k in VOLATILE else dump(value))
        if k in VOLATILE:
            holes.append((k, pos + len(head)))
        parts.append(member)
        pos += len(member) + 1
    text = "{" + ",".join(parts) + "}"
    del parts
    data = text.encode()
    if len(data) > MAX_INFLATED:
        # our own encoding may be longer than what was sent (1E9 -> 1000000000.0): bound
        # what is stored as what is taken, or the row could never be read back
        raise BadRequest(413, f"verdict of node {str(v.get('node'))[:100]!r} is "
                              f"{len(data)} bytes as stored; at most {MAX_INFLATED}")
    return Body(data, hashlib.sha256(data).hexdigest(), tuple(holes), len(text),
                tuple(v))


def frame(v: dict[str, Any], body: Body) -> str:
    """The JSON list [[offset, value text], ...] that puts ``v``'s own VOLATILE values
    back into ``body``."""
    return json.dumps([[at, dump(v[k])] for k, at in body.holes])


def served_size(v: dict[str, Any], body: Body, octets: bool) -> int:
    """The length of the served text: in characters, or UTF-8 bytes (``octets``)."""
    size = len(body.text) if octets else body.chars
    for k, _ in body.holes:
        value = dump(v[k])
        size += (len(value.encode()) if octets else len(value)) - len(_HOLE)
    return size


def join(body: str, frame_text: str) -> str:
    """The served text: the body with its holes filled from the frame."""
    out, last = [], 0
    for at, value in json.loads(frame_text):
        if not (isinstance(at, int) and isinstance(value, str) and last <= at
                and body[at:at + len(_HOLE)] == _HOLE):
            raise ValueError("the stored frame does not fit its document")
        out += (body[last:at], value)
        last = at + len(_HOLE)
    out.append(body[last:])
    return "".join(out)
