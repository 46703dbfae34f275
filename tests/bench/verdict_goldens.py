"""Proof that a speed-up changed no answer: the verdict JSON (time dropped) of every
tests/data case and of the benchmark's synthetic dumps, saved before a change and
compared after it.

    verdict_goldens.py save DIR [--sizes 1000,10000]
    verdict_goldens.py compare DIR [--sizes 1000,10000]

Cases: each directory of tests/data/realworld, tests/data/constructed and
tests/data/bundles (its files but case.json, as tests/test_realworld.py loads them), and
the synthetic iptables, IPVS and nftables dumps of check_from.py for each size, through the CLI
(`check --from DIR --json`), whole and in variants that make the walk fork: without
the Node object (the pods' addresses unknown), without the node's addresses (which
addresses are local unknown), without either. The goldens of big sizes are tens of
MiB: keep them out of the repository. Exit 0 when every verdict is identical, 1 naming
the first differing case otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lab.kube_proxy_rules import synthetic  # noqa: E402

DATA = ROOT / "tests" / "data"
# (variant name, files left out) of each synthetic dump
VARIANTS = (("whole", ()), ("no-node", ("node.json",)), ("no-addr", ("addr.txt",)),
            ("no-node-no-addr", ("node.json", "addr.txt", "route-local.txt")))


def _data_cases() -> list[tuple[str, Path]]:
    out = []
    for kind in ("realworld", "constructed", "bundles"):
        for d in sorted((DATA / kind).iterdir()):
            if d.is_dir():
                out.append((f"{kind}/{d.name}", d))
    return out


def _data_verdict(d: Path) -> str:
    from agent.bundle import load_texts
    from agent.bundle.sections import name_format
    from agent.diagnose import diagnose

    files = sorted(f for f in d.rglob("*") if f.is_file() and f.name != "case.json")
    snap = load_texts([(f.name, f.read_text(), name_format(f.name)) for f in files],
                      origin=f"bundle:{d.name}")
    doc = diagnose(snap, d.name).to_dict()
    doc.pop("time", None)
    return json.dumps(doc, indent=1, sort_keys=True)


def _cli_verdict(d: Path, tmp: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(d), "--json"],
                          capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1, 2, 3):  # a verdict (3: unknown)
        raise SystemExit(f"{d}: check failed ({proc.returncode}): {proc.stderr[-500:]}")
    doc = json.loads(proc.stdout)
    doc.pop("time", None)
    # (the temporary directory's name, in the origin and the sources, changes each run)
    return json.dumps(doc, indent=1, sort_keys=True).replace(tmp, "TMP") + \
        f"\nexit {proc.returncode}\n"


def verdicts(sizes: list[int]):  # type: ignore[no-untyped-def]
    """(case name, verdict text) of every case."""
    for name, d in _data_cases():
        yield name, _data_verdict(d)
    with tempfile.TemporaryDirectory(prefix="lb-goldens-") as tmp:
        for mode in ("iptables", "ipvs", "nftables"):
            for n in sizes:
                files = synthetic(n, mode)
                for variant, left_out in VARIANTS:
                    if n > 1000 and variant != "whole" and variant != "no-node":
                        continue  # (the forks' code is the same at every size)
                    d = Path(tmp) / f"{mode}-{n}-{variant}"
                    d.mkdir()
                    for fname, text in files.items():
                        if fname not in left_out:
                            (d / fname).write_text(text)
                    yield f"synthetic/{mode}-{n}-{variant}", _cli_verdict(d, tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("save", "compare"))
    ap.add_argument("dir", type=Path)
    ap.add_argument("--sizes", default="1000,10000")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    args.dir.mkdir(parents=True, exist_ok=True)
    differ = same = 0
    for name, text in verdicts(sizes):
        path = args.dir / (name.replace("/", "__") + ".json")
        if args.action == "save":
            path.write_text(text)
            same += 1
            continue
        if not path.exists():
            print(f"{name}: no golden", file=sys.stderr)
            differ += 1
        elif path.read_text() != text:
            new = path.with_suffix(".new")
            new.write_text(text)
            print(f"{name}: DIFFERS (diff {path} {new})", file=sys.stderr)
            differ += 1
        else:
            same += 1
    print(f"{args.action}: {same} identical/saved, {differ} differing")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
