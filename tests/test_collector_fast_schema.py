"""The collector's fast schema check (fastjsonschema, compiled as draft-07) may refuse more
than jsonschema (2020-12), never less: whatever it refuses goes to jsonschema, which
decides. Held to that at every place of real verdicts (a capture verdict and a bundle's),
each replaced by values of every kind, removed, or given a neighbour it must not have."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import fastjsonschema
import jsonschema
import pytest

from agent.bundle import load_bundle
from agent.collector.intake import BadRequest, Intake, fast_validator
from agent.diagnose import diagnose
from tests.test_capture_findings import NODE, POD, RANGE, VIP, captured

SCHEMA = json.loads(resources.files("agent").joinpath("schema/verdict-v2.json").read_text())
SCHEMA_V1 = json.loads(resources.files("agent").joinpath("schema/verdict-v1.json").read_text())
DATA = Path(__file__).parent / "data"
# each value of another kind, and the edges the schema's keywords draw
HOSTILE: tuple[Any, ...] = (None, True, False, 0, 1, -1, 1.0, 1.5, -0.5, 2**64, math.nan,
                            math.inf, "", "x", "x\n", "2026-11-27T00:00:00Z\n", "a/b",
                            "a" * 300, [], [1], ["x"], {}, {"x": 1})


def _small(v: dict[str, Any]) -> dict[str, Any]:
    """A verdict with one finding of each id, and every other list cut to two items:
    each place of the schema kept, not each repetition of it."""
    def cut(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: cut(x) for k, x in node.items()}
        if isinstance(node, list):
            return [cut(x) for x in node[:2]]
        return node
    by_id = {f["id"]: f for f in v["findings"]}
    return {**cut({k: x for k, x in v.items() if k != "findings"}),
            "findings": [cut(f) for f in by_id.values()]}


@pytest.fixture(scope="module")
def verdicts() -> list[dict[str, Any]]:
    tke = load_bundle(DATA / "bundles" / "tke-etp-local")
    cap = captured([(VIP, p) for p in RANGE[:40]] + [(POD, 30080), (NODE, 30081)])
    out = [_small(diagnose(tke, "n", capture=cap).to_dict("all"))]
    out.append(_small(diagnose(tke, "n").to_dict("all")))
    # the summary an agent ships: its ok groups, shapes and abridged findings too
    summary = diagnose(tke, "n").to_dict()
    assert summary["ok"], "the bundle's summary has no fine LB IP to count"
    out.append(_small(summary))
    return out


def as_v1(doc: dict[str, Any]) -> dict[str, Any]:
    """The verdict as a v1 agent sent it (the fleet upgrades node by node)."""
    old = {k: v for k, v in copy.deepcopy(doc).items()
           if k not in ("detail", "ok", "shapes", "abridged", "lb_ip_counts")}
    old["schema"] = "loopback-agent/verdict/v1"
    old["status"] = "at-risk" if old["status"] == "unknown" else old["status"]
    for f in old["findings"]:
        f.pop("shape", None)
    return old


def _places(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _places(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _places(v, (*path, i))


def _mutants(doc: dict[str, Any]) -> Iterator[str]:
    """Changes ``doc`` in place, one place at a time, yielding what it did; each is undone
    before the next (a copy of the document for each would be most of the test's time)."""
    for path in list(_places(doc)):
        if not path:
            continue
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        key = path[-1]
        was = parent[key]
        for value in HOSTILE:
            parent[key] = value
            yield f"{path} = {value!r:.40}"
        parent[key] = was
        if isinstance(parent, dict):
            del parent[key]
            yield f"{path} removed"
            parent[key] = was
            parent["not_in_schema"] = 1
            yield f"{path[:-1]} + not_in_schema"
            del parent["not_in_schema"]
        else:
            parent.extend([was] * 60)  # past any maxItems
            yield f"{path[:-1]} x60"
            del parent[len(parent) - 60:]


def test_the_verdict_schema_compiles_fast() -> None:
    assert fast_validator(SCHEMA) is not None
    assert fast_validator(SCHEMA_V1) is not None


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_never_more_lenient_than_jsonschema(verdicts: list[dict[str, Any]],
                                            version: str) -> None:
    schema = SCHEMA if version == "v2" else SCHEMA_V1
    docs = verdicts if version == "v2" else [as_v1(verdicts[0]), as_v1(verdicts[1])]
    fast = fast_validator(schema)
    assert fast is not None
    slow = jsonschema.Draft202012Validator(schema)
    both_refused = fast_only = 0
    for doc in docs:
        fast(doc)  # a real verdict passes both
        assert slow.is_valid(doc)
        before = json.dumps(doc)
        for what in _mutants(doc):
            try:
                fast(doc)
            except fastjsonschema.JsonSchemaException:
                if slow.is_valid(doc):
                    fast_only += 1
                else:
                    both_refused += 1
                continue
            assert slow.is_valid(doc), f"fast accepted what jsonschema refuses: {what}"
        assert json.dumps(doc) == before  # every change undone
    # the mutations did reach the schema's rules (the test can fail)
    assert both_refused > 500, both_refused
    # where it is stricter, jsonschema decides: said here so a change shows
    assert fast_only < both_refused


def test_a_refused_verdict_gets_jsonschemas_words(verdicts: list[dict[str, Any]]) -> None:
    intake = Intake()
    doc = copy.deepcopy(verdicts[0])
    doc["findings"][0]["severity"] = "fatal"
    with pytest.raises(BadRequest) as e:
        intake.verdicts(json.dumps(doc).encode())
    expected = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(SCHEMA).iter_errors(doc))
    assert e.value.code == 422 and expected is not None
    assert str(e.value).endswith(f"findings/0/severity: {expected.message}"), str(e.value)
    # stricter than jsonschema (a trailing newline after a pattern's "$"): still taken
    doc = copy.deepcopy(verdicts[0])
    doc["time"] += "\n"
    with pytest.raises(fastjsonschema.JsonSchemaException):
        intake.schemas["loopback-agent/verdict/v2"].fast(doc)  # type: ignore[misc]
    assert intake.verdicts(json.dumps(doc).encode())[0]["time"] == doc["time"]


def test_a_keyword_of_another_meaning_falls_back_to_jsonschema() -> None:
    assert fast_validator({**SCHEMA, "unevaluatedProperties": False}) is None
    assert fast_validator({"type": "array", "items": [{"type": "string"}]}) is None
