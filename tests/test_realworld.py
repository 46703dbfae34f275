"""The corpus of real pastes (tests/data/realworld/): node states people posted, in the
shapes they posted them, each with its source and a verdict traced by hand (case.json).

``expected.status`` "unknown" (issue 32): nothing at risk was found and something that
could hide a risk was not decided: the verdict says what (pod-to-lb-undetermined,
lb-ips-unknown, kube-proxy's mode unknown) instead of guessing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose

CORPUS = Path(__file__).parent / "data" / "realworld"
CASES = sorted(p.parent for p in CORPUS.glob("*/case.json"))
UNDECIDED = {"pod-to-lb-undetermined", "lb-ips-unknown"}


def test_corpus_is_large_and_sourced() -> None:
    assert len(CASES) >= 25
    sources = (CORPUS / "SOURCES.md").read_text()
    for case in CASES:
        meta = json.loads((case / "case.json").read_text())
        assert meta["source"] and meta["why"], case.name
        assert case.name in sources, f"{case.name} is not in SOURCES.md"
        for name in meta.get("constructed", {}):
            assert (case / name).exists(), f"{case.name}: constructed file {name} missing"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case: Path) -> None:
    meta = json.loads((case / "case.json").read_text())
    want = meta["expected"]
    files = sorted(f for f in case.iterdir() if f.name != "case.json")
    snap = load_texts([(f.name, f.read_text(), name_format(f.name)) for f in files],
                      origin=f"bundle:{case.name}")
    v = diagnose(snap, case.name).to_dict("all")
    ids = {f["id"] for f in v["findings"]}
    why = f"{case.name}: {meta['why']}\ngot {v['status']} {sorted(ids)}"
    assert v["status"] == want["status"], why
    if want["status"] == "unknown":
        # it says why: an undecided finding, or the mode it could not tell
        assert ids & UNDECIDED or v["kube_proxy_mode"] == "unknown", why
    if want.get("kube_proxy_mode"):
        assert v["kube_proxy_mode"] == want["kube_proxy_mode"], why
    for fid in want.get("findings", ()):
        assert fid in ids, why
    for fid in want.get("absent", ()):
        assert fid not in ids, why
    got_ips = {r["ip"] for r in v["lb_ips"]}
    for ip in want.get("lb_ips", ()):
        assert ip in got_ips, f"{why}\nLB IPs found: {sorted(got_ips)}"
    # what the verdict must (not) say it could not read or decide: substrings of unknowns
    said = "\n".join(f"{u['source']}: {u['reason']}" for u in v["unknowns"])
    for text in want.get("unknowns", ()):
        assert text in said, f"{why}\nunknowns:\n{said}"
    for text in want.get("unknowns_absent", ()):
        assert text not in said, f"{why}\nunknowns:\n{said}"
