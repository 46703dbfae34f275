"""A rule's shape: its text with what differs from one Service to the next left out.

kube-proxy writes the same chains for every Service, differing only in addresses, ports,
numbers, hashes and names (`KUBE-SVC-<hash>`, `service-<hash>-ns/name/tcp/http`, a
`numgen random mod 3 vmap { ... }` of the Service's endpoints). Two LB IPs whose walks took
rules of the same shapes, to the same outcome, were decided the same way: the verdict
counts them together and shows the evidence of one (issue 32). A shape is made from the
rule as the input wrote it (the walk's step), never from evidence text.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

# a brace set ({ 0 : goto a, 1 : goto b }: one element per endpoint) as one token
_SET = re.compile(r"\{[^{}]*\}")
# a token holding a digit or a slash: an address, port, number, mark, ns/name chain name;
# a quoted string (a comment naming the Service); a 16-character kube-proxy hash
_VARYING = re.compile(r'"[^"]*"|[^\s\[\](),;:]*[\d/][^\s\[\](),;]*|\b[A-Z0-9]{16}\b')
# per-Service chain names: KUBE-SVC-<hash>, service-<hash>-ns/name/..., endpoint-...
_CHAIN = re.compile(r"^(KUBE-[A-Z]+-|(?:service|endpoint|external|firewall)-)\S+$")

_cache: dict[str, str] = {}
_CACHE_MAX = 200_000  # distinct rule texts kept (a 10k-service node walks ~60k)


def rule_shape(text: str) -> str:
    """The rule's text with its varying parts as "*" (cached: every walk through a shared
    rule asks for the same text)."""
    got = _cache.get(text)
    if got is None:
        # (iptables rules have no brace set: one pass of the two)
        got = _VARYING.sub("*", _SET.sub("{*}", text) if "{" in text else text)
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[text] = got
    return got


def chain_shape(name: str) -> str:
    """A chain's name, a per-Service chain's as its kind ("KUBE-SVC-*", "service-*")."""
    m = _CHAIN.match(name)
    return m.group(1) + "*" if m else name


def shape_id(parts: Iterable[str]) -> str:
    """A short stable name of a sequence of shapes (12 hex digits)."""
    h = hashlib.blake2b(digest_size=6)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()
