"""Read `nft -j list ruleset` / `nft -j list table ...` (libnftables' JSON) into the model.

Rules are rendered the way `nft list` prints them, then tokenized like the text reader's,
so one evaluator reads both and the evidence quotes nft's own words. An expression this
reader does not know is rendered as `<unknown:KEY>`: the walk treats it as undecidable
(both answers), never as a match or a miss.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from agent.netfilter.nft_model import (
    MAX_ELEMENTS,
    NftChain,
    NftError,
    NftRule,
    NftRuleset,
    NftSet,
    NftTable,
)
from agent.netfilter.nft_text import render, split_elements, tokenize

MAX_JSON_BYTES = 512 * 1024 * 1024
_MAX_DEPTH = 64


def looks_like_nft_json(text: str) -> bool:
    head = text.lstrip()[:200]
    return head.startswith("{") and '"nftables"' in head


# what `nft -j` prints: one object whose one member is the array of nft objects
_HEAD = re.compile(r'\s*\{\s*"nftables"\s*:\s*\[')
_TAIL = re.compile(r"\s*\]\s*\}\s*")
_BLANKS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


class _NotPlain(Exception):
    """The document is not the plain `{"nftables": [...]}` of nft -j."""


def _items(text: str, source: str) -> Iterator[Any]:
    """The items of the "nftables" array, decoded one at a time: a 10k-service node's
    42 MB listing decoded whole was 500 MB of dicts alive at once, where each item is
    needed only while it is read into the model. Raises _NotPlain, at the latest after
    the last item, for a document of any other shape (another member beside the array,
    a second "nftables", a misplaced comma): the caller reads it whole instead, as
    before, and its answer or error is json.loads's. A syntax error inside an item is
    the first one of the text: the same error json.loads would give."""
    head = _HEAD.match(text)
    if head is None:
        raise _NotPlain
    decode = json.JSONDecoder().raw_decode
    blanks = _BLANKS.match(text, head.end())
    assert blanks is not None  # (_BLANKS matches anywhere, if only the empty string)
    pos = blanks.end()
    if text.startswith("]", pos):
        if not _TAIL.fullmatch(text, pos):
            raise _NotPlain
        return
    while True:
        try:
            item, pos = decode(text, pos)
        except (ValueError, RecursionError) as e:
            raise NftError(source, getattr(e, "lineno", None), f"not JSON: {e}") from None
        yield item
        blanks = _BLANKS.match(text, pos)
        assert blanks is not None  # (as above)
        pos = blanks.end()
        if text.startswith(",", pos):
            blanks = _BLANKS.match(text, pos + 1)
            assert blanks is not None
            pos = blanks.end()
            continue
        if _TAIL.fullmatch(text, pos):
            return
        raise _NotPlain


def _whole(text: str, source: str) -> list[Any]:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        line = getattr(e, "lineno", None)
        raise NftError(source, line, f"not JSON: {e}") from None
    items = doc.get("nftables") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise NftError(source, None, "no \"nftables\" array (not `nft -j` output)")
    return items


def read_nft_json(text: str, source: str) -> NftRuleset:
    if len(text) > MAX_JSON_BYTES:
        raise NftError(source, None, f"larger than {MAX_JSON_BYTES} bytes")
    try:
        return _read(_items(text, source), source)
    except _NotPlain:
        return _read(_whole(text, source), source)


def _read(items: Iterable[Any], source: str) -> NftRuleset:
    tables: dict[tuple[str, str], dict[str, Any]] = {}
    problems: list[str] = []
    elements = 0

    def table(family: str, name: str) -> dict[str, Any]:
        return tables.setdefault((family, name), {"chains": {}, "sets": {}})

    for k, item in enumerate(items):
        if not isinstance(item, dict) or len(item) != 1:
            problems.append(f"{source}: item {k} is not one nft object")
            continue
        kind, body = next(iter(item.items()))
        if not isinstance(body, dict):
            continue
        try:
            if kind == "table":
                table(str(body["family"]), str(body["name"]))
            elif kind == "chain":
                t = table(str(body["family"]), str(body["table"]))
                prio = body.get("prio")
                t["chains"].setdefault(str(body["name"]), {
                    "type": body.get("type"), "hook": body.get("hook"),
                    "prio": prio if isinstance(prio, int) else None,
                    "policy": body.get("policy", "accept"), "rules": []})
            elif kind in ("set", "map"):
                t = table(str(body["family"]), str(body["table"]))
                ktype = body.get("type")
                key = " . ".join(ktype) if isinstance(ktype, list) else str(ktype or "")
                elems = []
                for e in body.get("elem", ()) or ():
                    elements += 1
                    if elements > MAX_ELEMENTS:
                        raise NftError(source, None, f"more than {MAX_ELEMENTS} set elements")
                    elems.append(_element(e))
                flags = body.get("flags") or ()
                t["sets"][str(body["name"])] = NftSet(
                    str(body["name"]), kind == "map", key,
                    tuple((p, v) for p, v, _ in elems), tuple(c for _, _, c in elems),
                    # nft -j leaves "dynamic" out where `nft list` shows it: a set
                    # whose entries time out is filled at run time either way
                    dynamic="dynamic" in flags or "timeout" in flags,
                    source=f"{source} ({kind} {body['name']})")
            elif kind == "rule":
                t = table(str(body["family"]), str(body["table"]))
                chain = t["chains"].setdefault(str(body["chain"]), {
                    "type": None, "hook": None, "prio": None, "policy": "accept", "rules": []})
                text = " ".join(_stmt(s, 0) for s in body.get("expr", ()))
                if body.get("comment"):
                    text += f' comment "{body["comment"]}"'
                where = f"{source} (rule handle {body.get('handle', '?')})"
                toks = tokenize(text, source, None)
                chain["rules"].append(NftRule(toks, render(toks), where))
        except NftError as e:
            if e.why.startswith("more than"):
                raise  # a bound: the whole input is refused
            problems.append(f"{source}: item {k} ({kind}): {e.why}")
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            problems.append(f"{source}: item {k} ({kind}): {type(e).__name__}: {e}")
    out = []
    for (family, name), t in tables.items():
        chains = tuple(NftChain(n, c["type"], c["hook"], c["prio"], c["policy"],
                                tuple(c["rules"])) for n, c in t["chains"].items())
        out.append(NftTable(family, name, chains, tuple(t["sets"].values())))
    return NftRuleset(tuple(out), source, tuple(problems[:50]))


def _element(e: Any) -> tuple[tuple[str, ...], str | None, str | None]:
    """A set element ("1.2.3.4", {"concat": [...]}) or a map's [key, value]."""
    value = None
    if isinstance(e, list) and len(e) == 2:
        e, v = e
        value = _stmt(v, 0) if isinstance(v, dict) else _expr(v, 0)
    comment = None
    if isinstance(e, dict) and "elem" in e:
        comment = e["elem"].get("comment")
        e = e["elem"].get("val")
    key = _expr(e, 0)
    parts = split_elements(tokenize(key))[0][0] if key else ()
    return parts, value, comment


def _expr(e: Any, depth: int) -> str:
    if depth > _MAX_DEPTH:
        raise ValueError("expression nested too deep")
    d = depth + 1
    if isinstance(e, bool):
        return "true" if e else "false"
    if isinstance(e, (int, float)):
        return str(e)
    if isinstance(e, str):
        return e
    if isinstance(e, list):
        return "{ " + ", ".join(_expr(x, d) for x in e) + " }"
    if not isinstance(e, dict) or len(e) != 1:
        return "<unknown:expr>"
    k, v = next(iter(e.items()))
    if k == "payload":
        return f"{v.get('protocol')} {v.get('field')}"
    if k == "meta":
        return f"meta {v.get('key')}"
    if k == "ct":
        return f"ct {v.get('key')}"
    if k == "fib":
        flags = v.get("flags") or []
        flags = [flags] if isinstance(flags, str) else flags
        return "fib " + " . ".join(flags) + f" {v.get('result')}"
    if k == "concat":
        return " . ".join(_expr(x, d) for x in v)
    if k == "prefix":
        return f"{_expr(v.get('addr'), d)}/{v.get('len')}"
    if k == "range":
        return f"{_expr(v[0], d)}-{_expr(v[1], d)}"
    if k == "set":
        items = v if isinstance(v, list) else [v]
        return "{ " + ", ".join(_set_item(x, d) for x in items) + " }"
    if k == "numgen":
        return f"numgen {v.get('mode')} mod {v.get('mod')}"
    if k in ("&", "|", "^"):
        return f"{_expr(v[0], d)} {k} {_hex(v[1])}"
    if k == "elem":
        return _expr(v.get("val"), d)
    return f"<unknown:{k}>"


def _hex(v: Any) -> str:
    return f"{v:#010x}" if isinstance(v, int) else _expr(v, 1)


def _set_item(x: Any, d: int) -> str:
    if isinstance(x, list) and len(x) == 2:
        val = _stmt(x[1], d) if isinstance(x[1], dict) else _expr(x[1], d)
        return f"{_expr(x[0], d)} : {val}"
    return _expr(x, d)


def _stmt(s: Any, depth: int) -> str:
    if not isinstance(s, dict) or len(s) != 1:
        return "<unknown:stmt>"
    k: str  # (a JSON object's key)
    k, v = next(iter(s.items()))
    d = depth + 1
    if k == "match":
        op = v.get("op", "==")
        left, right = _expr(v.get("left"), d), v.get("right")
        if left.startswith("meta mark &") or " & " in left:
            return f"{left} {'==' if op in ('==', 'in') else op} {_hex(right)}"
        r = _expr(right, d)
        if op in ("==", "in"):
            return f"{left} {r}"
        return f"{left} {op} {r}"
    if k == "vmap":
        return f"{_expr(v.get('key'), d)} vmap {_expr(v.get('data'), d)}"
    if k in ("jump", "goto"):
        return f"{k} {v.get('target')}"
    if k in ("accept", "drop", "return", "continue"):
        return k
    if k == "reject":
        return "reject"
    if k == "counter":
        return ""
    if k == "masquerade":
        flags = (v or {}).get("flags") if isinstance(v, dict) else None
        flags = " ".join(flags) if isinstance(flags, list) else flags
        return "masquerade" + (f" {flags}" if flags else "")
    if k in ("dnat", "snat"):
        addr = _expr(v.get("addr"), d) if v.get("addr") is not None else ""
        port = v.get("port")
        if port is not None and ":" in addr:
            addr = f"[{addr}]"  # an IPv6 address and a port, as `nft list` prints them
        return f"{k} to {addr}" + (f":{_expr(port, d)}" if port is not None else "")
    if k == "mangle":
        return f"{_expr(v.get('key'), d)} set {_expr(v.get('value'), d)}"
    if k == "set":
        return f"{v.get('op')} {v.get('set')} {{ {_expr(v.get('elem'), d)} }}"
    if k == "notrack":
        return "notrack"
    if k in ("log", "limit", "xt"):
        return f"<passive:{k}>" if k != "xt" else "<unknown:xt>"
    if k == "goto_verdict":
        return "<unknown:verdict>"
    return f"<unknown:{k}>"
