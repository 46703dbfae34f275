"""The README and the docs pages work as written: their shell blocks marked runnable are
run as a newcomer would, on this machine as root, in the order of the pages (README.md,
then docs/mkdocs.yml's nav: tests/docs.py).

- ``<!-- runnable -->``: from the checkout (``make demo``, the venv, ``make lint``);
- ``<!-- runnable: node -->``: on a node. All of them in order, in one shell (a block may
  use what an earlier one made, e.g. the bundle), inside a lab node: TKE's IPVS
  kube-proxy rules under iptables-nft, which plain ``iptables-save`` reads.

Every command line must exit 0, except ``loopback-agent check``, whose 1 (at risk) and 2
(loopback) are verdicts. Unmarked blocks need a cluster or a Docker engine; the
manifests and the Dockerfile they use are tested in test_deploy.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lab.node import build_lab
from lab.scenarios import SCENARIOS
from tests import docs

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces")]

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"<!-- runnable(?:: (\w+))? -->\n```sh\n(.*?)```", re.S)
VERDICT_CODES = {0, 1, 2}


def blocks(where: str) -> list[str]:
    return [body for kind, body in _BLOCK.findall(docs.text()) if (kind or "repo") == where]


def commands(block: str) -> list[str]:
    """Logical command lines: continuations joined, blank and comment lines dropped."""
    out: list[str] = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line)
    return out


def is_demo_block(block: str) -> bool:
    """Is ``block`` `make demo` alone? tests/test_demo.py runs that block, as written,
    and checks its story: running it here too cost the suite 22 s a second time."""
    return [shlex.split(line, comments=True) for line in commands(block)] == [["make", "demo"]]


def run_script(lines: list[str], cwd: Path, prefix: list[str], rc_file: Path,
               timeout: float) -> subprocess.CompletedProcess[str]:
    """One bash for all ``lines``, writing each line's exit status to ``rc_file``."""
    script = "".join(f"{line}\necho \"$? {i}\" >> {rc_file}\n" for i, line in enumerate(lines))
    return subprocess.run([*prefix, "bash", "-c", script], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def check_statuses(lines: list[str], rc_file: Path, proc: subprocess.CompletedProcess[str]
                   ) -> None:
    statuses = dict((int(i), int(rc)) for rc, i in
                    (row.split() for row in rc_file.read_text().splitlines()))
    context = f"\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert len(statuses) == len(lines), f"the script stopped early{context}"
    for i, line in enumerate(lines):
        allowed = VERDICT_CODES if line.startswith("loopback-agent check") else {0}
        assert statuses[i] in allowed, f"`{line}` exited {statuses[i]}{context}"
    assert "Traceback" not in proc.stdout + proc.stderr, context


def test_the_readme_marks_what_a_newcomer_runs() -> None:
    repo = "".join(blocks("repo"))
    assert "make demo" in repo and "loopback-agent check --from" in repo
    assert is_demo_block(blocks("repo")[0])  # the first thing a newcomer runs
    node = "".join(blocks("node"))
    for needed in ("loopback-agent check   ", "--capture", "loopback-agent bundle",
                   "iptables-save >", "check --from lb-bundle", "check --snapshot"):
        assert needed in node, needed
    assert set(kind for kind, _ in _BLOCK.findall(docs.text())) <= {"", "node"}


# (`make demo` is tests/test_demo.py's test_the_story_end_to_end)
@pytest.mark.parametrize("index", [i for i, b in enumerate(blocks("repo"))
                                   if not is_demo_block(b)])
def test_repo_block(index: int, tmp_path: Path) -> None:
    lines = commands(blocks("repo")[index])
    rc_file = tmp_path / "rc"
    proc = run_script(lines, ROOT, [], rc_file, timeout=600)
    check_statuses(lines, rc_file, proc)


def test_node_blocks_in_a_lab_node(tmp_path: Path) -> None:
    lines = [f"export PATH={Path(sys.executable).parent}:$PATH"]
    for block in blocks("node"):
        lines += commands(block)
    rc_file = tmp_path / "rc"
    work = tmp_path / "node"
    work.mkdir()
    with build_lab(SCENARIOS["tke-ipvs-etp-local"], "nft") as lab:
        proc = run_script(lines, work, ["ip", "netns", "exec", lab.node.name], rc_file,
                          timeout=300)
    check_statuses(lines, rc_file, proc)
    # what the blocks made: the agent's bundle and the plain-commands one are the same
    # directory, and the verdicts name this node's loop
    assert (work / "lb-bundle" / "iptables-save.txt").read_text().count("KUBE-") > 10
    assert '"status"' in (work / "verdict.json").read_text()
    assert "pod-to-lb-not-masqueraded" in proc.stdout


def test_the_references_name_every_option_and_metric(tmp_path: Path) -> None:
    """The configuration and metrics tables stay in step with the code."""
    from prometheus_client import CollectorRegistry

    from agent.collector.server import Collector
    from agent.collector.store import open_store
    from agent.daemon import Metrics
    from tests.test_deploy import env_options, subcommand_parser

    text = docs.text()
    for command in ("run", "collector"):
        for action in subcommand_parser(command)._actions:
            if (action.option_strings and action.help != argparse.SUPPRESS
                    and not isinstance(action, argparse._HelpAction)):
                assert f"`{action.option_strings[-1]}" in text, (command, action.option_strings)
        for variable in env_options(command):
            assert f"`{variable}`" in text, variable
    registries: list[CollectorRegistry] = [
        Metrics().registry,
        Collector(open_store(f"sqlite:///{tmp_path}/c.db")).registry]
    for registry in registries:
        for family in registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            assert f"| `{name}` | {family.type} |" in text, name
