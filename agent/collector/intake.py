"""From a POSTed body to verdicts fit to store: JSON that means one thing, valid Unicode,
finite numbers, the verdict schema, an idempotency key.

Every check here is linear in the size of the body: the body may come from anyone who
can reach the port (before the token check when no token is configured).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from importlib import resources
from typing import Any

import fastjsonschema
import jsonschema

from agent.ship import gz
from agent.verdict_doc import SCHEMAS

MAX_BODY = gz.WIRE_LIMIT  # on the wire: as received, compressed or not
MAX_INFLATED = gz.INFLATED_LIMIT  # what a gzip body may inflate to
MAX_BATCH = 500
# What a body may make before it is built (issue 35): a 65 KB gzip body of `[{},{},...]`
# inflating to 64 MiB was 22 million dicts, 1.7 GiB, before the batch size was looked at.
# Values: commas, "[" and "{" counted in the bytes (an upper bound: those in strings count
# too): a 36 MB itemised v1 verdict of 10k Services holds 650k. Objects: counted as the
# parser makes them (a 10k-Service v1 verdict has ~30k).
MAX_VALUES = 1_000_000
MAX_OBJECTS = 250_000
# what differs between two POSTs of an unchanged verdict (agent.collector.docs)
VOLATILE = ("time", "idempotency_key")

_SURROGATE = re.compile("[\ud800-\udfff]")
# a \uD800-\uDFFF escape or a surrogate itself (its UTF-8 bytes, decoded with
# 'surrogatepass' as json.loads does): only then can a lone surrogate be in the document
_MAYBE_SURROGATE = re.compile("\\\\u[dD][89a-fA-F]|[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile("\\\\u[dD][89a-fA-F]")


def _maybe_surrogate(text: str) -> bool:
    """_MAYBE_SURROGATE.search, fast for ASCII text (an agent's: it escapes the rest):
    no surrogate itself can be in it, and the escape's literal prefix is searched for
    quickly (the alternation scanned 20 MB in 0.35 s, this in 0.01 s)."""
    if text.isascii():
        return _ESCAPED_SURROGATE.search(text) is not None
    return _MAYBE_SURROGATE.search(text) is not None


class BadRequest(Exception):
    """A request refused with an HTTP status and a message for the sender."""

    def __init__(self, code: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


class _Objects:
    """object_pairs_hook: each JSON object as a dict, duplicate keys refused, and the
    parse stopped at MAX_OBJECTS (before the next one is built)."""

    def __init__(self) -> None:
        self.left = MAX_OBJECTS

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        self.left -= 1
        if self.left < 0:
            raise BadRequest(413, f"more than {MAX_OBJECTS} JSON objects in one body: send "
                             "fewer verdicts per request")
        return _no_duplicate_keys(pairs)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: only then look for the name, still in one pass
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise BadRequest(400, f"duplicate key {_shown(k)!r} in a JSON object")
            seen.add(k)
    return out


def _not_a_number(token: str) -> Any:
    raise BadRequest(400, f"{token} is not a JSON number (only finite numbers are stored)")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999: JSON, but no double holds it
        raise BadRequest(400, f"number {text[:40]} is out of range")
    return value


def _shown(text: str) -> str:
    """A string from the body, safe to put into a reply (no lone surrogate)."""
    return _SURROGATE.sub("\ufffd", text)[:200]


def parse_json(body: bytes | bytearray) -> Any:
    """The document, or BadRequest(400) for anything that is not plain, unambiguous JSON:
    malformed, duplicate keys, NaN/Infinity (Python accepts them; JSON does not); 413 for
    more values or objects than a batch of verdicts holds (counted before they are built:
    the bytes first, in C, then the objects as they are made)."""
    values = body.count(b",") + body.count(b"[") + body.count(b"{")
    if values > MAX_VALUES:
        raise BadRequest(413, f"more than {MAX_VALUES} JSON values in one body ({values} "
                         "commas and brackets): send fewer verdicts per request")
    try:
        # JSON between systems is UTF-8 (RFC 8259); json.loads would also guess UTF-16/32
        text = body.decode("utf-8", "surrogatepass")
        return json.loads(text, object_pairs_hook=_Objects(),
                          parse_constant=_not_a_number, parse_float=_finite)
    except BadRequest:
        raise
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BadRequest(400, f"not JSON: {_shown(str(e))[:300]}") from None


def replace_lone_surrogates(doc: Any) -> tuple[Any, list[str]]:
    """The document with every lone surrogate replaced by U+FFFD, and the paths where
    one was. Such a string cannot be encoded as UTF-8: stored as is it would break
    every later page and JSON reply. Iterative: depth is whatever json.loads allowed."""
    found: list[str] = []

    def fix(value: str, path: str) -> str:
        if _SURROGATE.search(value) is None:
            return value
        found.append(path)
        return _SURROGATE.sub("\ufffd", value)

    root = [doc]
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        container, path = stack.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        fixes: list[tuple[Any, Any, Any]] = []  # (old key, new key, new value)
        for k, v in items:
            where = f"{path}/{k}" if container is not root else ""
            nk = fix(k, where + " (a key)") if isinstance(k, str) else k
            nv = fix(v, where or "(document)") if isinstance(v, str) else v
            if nk is not k or nv is not v:
                fixes.append((k, nk, nv))
            if isinstance(v, (dict, list)):
                stack.append((v, where))
        for k, nk, nv in fixes:
            if nk is not k:
                del container[k]
            container[nk] = nv
    return root[0], found


# Keywords whose meaning is the same in draft-07 (what fastjsonschema compiles) and in
# 2020-12 (the schema's), for the forms the schema uses them in ("items" a schema, not a
# list; "format" and the annotations ignored, as jsonschema does without a format checker)
_SAME_IN_DRAFT7 = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "pattern", "minimum", "maximum", "minLength", "maxLength", "maxItems", "minItems",
    "$ref", "$defs", "description", "title", "format", "$schema", "$id", "if", "then",
    "else"})
_DROPPED_FOR_DRAFT7 = ("format", "$id", "$schema", "description", "title")


def fast_validator(schema: dict[str, Any]) -> Callable[[Any], Any] | None:
    """The schema compiled by fastjsonschema (as draft-07): 0.17 s for a 20 MB verdict,
    where jsonschema takes 2.6 s (a 10k-service node's every changed verdict, times the
    fleet). Only an accept-fast path: whatever it refuses goes to jsonschema, which
    decides and words the error, so it may be stricter (it reads "$" as the end of the
    text, where Python's re lets a trailing newline through) but never more lenient; a
    test holds it to that at every place of a real verdict. None when the schema uses a
    keyword or form outside those that mean the same in both drafts."""
    def plain(node: Any, *, names: bool = False) -> Any:
        if isinstance(node, list):
            return [plain(v) for v in node]
        if not isinstance(node, dict):
            return node
        if names:  # "properties"/"$defs": the keys are names, not keywords
            return {k: plain(v) for k, v in node.items()}
        if not set(node) <= _SAME_IN_DRAFT7 or isinstance(node.get("items"), list):
            raise ValueError(f"keywords {sorted(set(node) - _SAME_IN_DRAFT7)}")
        return {k: plain(v, names=k in ("properties", "$defs"))
                for k, v in node.items() if k not in _DROPPED_FOR_DRAFT7}
    try:
        draft7 = {**plain(schema), "$schema": "http://json-schema.org/draft-07/schema#"}
    except ValueError:
        return None
    return fastjsonschema.compile(draft7)


class Intake:
    """Turns a body into a batch of valid verdicts or raises BadRequest."""

    def __init__(self) -> None:
        # each schema version an agent of the fleet may send (it upgrades node by node):
        # a document is validated against the one it names, else against the newest
        texts = {name: resources.files("agent").joinpath(f"schema/verdict-{name[-2:]}.json")
                 .read_text() for name in SCHEMAS}
        self.schemas = {name: _Schema(json.loads(text)) for name, text in texts.items()}
        # stored with each document it validated: a document validated against other
        # schemas (an older collector's) is validated again
        self.schema_tag = hashlib.sha256("".join(texts.values()).encode()).hexdigest()[:16]

    def _schema(self, v: Any) -> _Schema:
        name = v.get("schema") if isinstance(v, dict) else None
        return self.schemas.get(name) if isinstance(name, str) and name in self.schemas \
            else self.schemas[SCHEMAS[-1]]

    def verdicts(self, body: bytes | bytearray,
                 known: Callable[[Any], bool] | None = None) -> list[dict[str, Any]]:
        """``known(verdict)``: True when its document (all but VOLATILE) is stored and
        was validated against this schema: then only its VOLATILE members are (3 s of
        CPU saved for a 20 MB verdict). Never for a document not already stored."""
        doc = parse_json(body)
        text = body.decode("utf-8", "surrogatepass")  # parse_json checked it decodes
        batch = doc if isinstance(doc, list) else [doc]
        if not batch:
            raise BadRequest(422, "empty batch")
        if len(batch) > MAX_BATCH:
            raise BadRequest(413, f"batch of {len(batch)} verdicts; at most {MAX_BATCH}")
        for i, v in enumerate(batch):
            prefix = f"[{i}]/" if isinstance(doc, list) else ""
            if isinstance(v, dict) and isinstance(v.get("node"), str) \
                    and _SURROGATE.search(v["node"]):
                # a node's name is its identity: never stored altered
                raise BadRequest(400, f"{prefix}node: {_shown(v['node'])!r} is not valid "
                                 "Unicode (a lone surrogate, e.g. from undecodable bytes)")
        if _maybe_surrogate(text):
            doc, _ = replace_lone_surrogates(doc)
            batch = doc if isinstance(doc, list) else [doc]
        for i, v in enumerate(batch):
            prefix = f"[{i}]/" if isinstance(doc, list) else ""
            schema = self._schema(v)
            if known is not None and isinstance(v, dict) and known(v):
                err = jsonschema.exceptions.best_match(schema.volatile.iter_errors(
                    {k: v[k] for k in VOLATILE if k in v}))
            elif schema.fast_valid(v):
                err = None
            else:
                err = jsonschema.exceptions.best_match(schema.full.iter_errors(v))
            if err is not None:
                where = "/".join(str(p) for p in err.absolute_path) or "(document)"
                raise BadRequest(422, f"{prefix}{where}: {_shown(err.message)[:300]}")
            key = v.get("idempotency_key")
            if key is not None and not isinstance(key, str):
                raise BadRequest(422, f"{prefix}idempotency_key: must be a string")
            if not key:
                # without a key, the same document sent twice is still stored once
                v["idempotency_key"] = hashlib.sha256(
                    json.dumps(v, sort_keys=True).encode()).hexdigest()  # as before: same key
        return batch



class _Schema:
    """One verdict schema's validators."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.full = jsonschema.Draft202012Validator(schema)
        self.fast = fast_validator(schema)
        # what is left to check of a verdict whose document is stored and valid: the
        # schema's rules for the top-level members that are not in the document
        self.volatile = jsonschema.Draft202012Validator({
            "$schema": schema.get("$schema"), "type": "object",
            "required": [k for k in schema.get("required", []) if k in VOLATILE],
            "properties": {k: p for k, p in schema.get("properties", {}).items()
                           if k in VOLATILE}})

    def fast_valid(self, v: Any) -> bool:
        if self.fast is None:
            return False
        try:
            self.fast(v)
        except fastjsonschema.JsonSchemaException:
            return False  # jsonschema decides (and says why)
        return True


def dump(doc: Any) -> str:
    """JSON text as stored and served: strict (no NaN), UTF-8 friendly, compact."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
