"""A rule's shape: its text with what differs from one Service to the next left out.

kube-proxy writes the same chains for every Service, differing only in addresses, ports,
numbers, hashes and names (`KUBE-SVC-<hash>`, `service-<hash>-ns/name/tcp/http`, a
`numgen random mod 3 vmap { ... }` of the Service's endpoints). Two LB IPs whose walks took
rules of the same shapes, to the same outcome, were decided the same way: the verdict
counts them together and shows the evidence of one (issue 32). A shape is made from the
rule as the input wrote it (the walk's step), never from evidence text.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable

# a brace set ({ 0 : goto a, 1 : goto b }: one element per endpoint) as one token
_SET = re.compile(r"\{[^{}]*\}")
# a quoted string (a comment naming the Service); a token holding a digit, a slash or a
# 16-character kube-proxy hash: an address, port, number, mark, ns/name chain name, a
# per-Service chain's name (KUBE-SEP-<hash>: one of 28 hashes holds no digit, and its
# chain must take the same shape as the others)
_VARYING = re.compile(r'"[^"]*"|[^\s\[\](),;:]*(?:[\d/]|\b[A-Z0-9]{16}\b)[^\s\[\](),;]*')
# per-Service chain names: KUBE-SVC-<hash>, service-<hash>-ns/name/..., endpoint-...
_CHAIN = re.compile(r"^(KUBE-[A-Z]+-|(?:service|endpoint|external|firewall)-)\S+$")

_cache: dict[str, str] = {}
_CACHE_MAX = 200_000  # distinct rule texts kept (a 10k-service node walks ~60k)


def rule_shape(text: str) -> str:
    """The rule's text with its varying parts as "*" (cached: every walk through a shared
    rule asks for the same text)."""
    got = _cache.get(text)
    if got is None:
        got = _shape(text)
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[text] = got
    return got


def _shape(text: str) -> str:
    """_VARYING.sub of ``text`` (its brace sets first as "{*}"). Most rules are words
    between single blanks around at most one quoted comment: then no match crosses a blank
    and the comment, after a blank, is one match of its own, so the text's shape is its
    words' shapes (each word's remembered) around one "*": a per-Service rule's text is
    new to the cache, its words mostly are not."""
    if "{" in text:
        return _VARYING.sub("*", _SET.sub("{*}", text))
    q = text.find('"')
    if q < 0:
        return _word_shapes(text)
    end = text.find('"', q + 1)
    if end < 0 or (q and text[q - 1] != " ") or text.find('"', end + 1) >= 0:
        return _VARYING.sub("*", text)
    return _word_shapes(text[:q]) + "*" + _word_shapes(text[end + 1:])


def _word_shapes(text: str) -> str:
    return " ".join(map(_word_shape, text.split(" ")))


# (the common words come again and again; addresses and hashes are new each time)
@functools.lru_cache(maxsize=4096)
def _word_shape(word: str) -> str:
    return _VARYING.sub("*", word)


@functools.lru_cache(maxsize=4096)
def chain_shape(name: str) -> str:
    """A chain's name, a per-Service chain's as its kind ("KUBE-SVC-*", "service-*")."""
    m = _CHAIN.match(name)
    return m.group(1) + "*" if m else name


def shape_id(parts: Iterable[str]) -> str:
    """A short stable name of a sequence of shapes (12 hex digits): each part and a
    newline, hashed."""
    got = list(parts)
    data = "\n".join(got) + "\n" if got else ""
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
