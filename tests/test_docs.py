"""The documentation site builds strictly (mkdocs: a broken link, a page left out of the
nav or a missing anchor fails it), and the README stays a map: short, a sample report in
its first screen, a link to every page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests import docs


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(docs.CONFIG), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    built = {p.relative_to(tmp_path / "site").as_posix()
             for p in (tmp_path / "site").rglob("index.html")}
    for page in docs.pages()[1:]:
        name = page.stem
        assert (name == "index" and "index.html" in built) or f"{name}/index.html" in built
    # the configuration is no page of the site
    assert not (tmp_path / "site" / "mkdocs").exists()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check above can fail: the same docs with one link to a page that is not there."""
    import shutil

    copy = tmp_path / "docs"
    shutil.copytree(docs.DOCS, copy)
    page = copy / "findings.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(copy / "mkdocs" / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "missing.md" in proc.stderr


def test_the_readme_is_a_map() -> None:
    text = docs.README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 260, len(lines)
    # the two commands a newcomer runs first, then a real report within the first screen
    assert lines.index("make demo    # a real CLB loopback reproduced in network namespaces, "
                       "found and fixed (~25 s)") < 20
    first_screen = "\n".join(lines[:70])
    assert "AT RISK: this node is exposed to CLB loopback" in first_screen
    assert "[CRITICAL] pod-to-lb-not-masqueraded" in first_screen
    # every page is linked from the README, and every link in it leads somewhere
    for page in docs.pages()[1:]:
        if page.name != "index.md":
            assert f"(docs/{page.name})" in text, page.name
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith("http"):
            assert (docs.ROOT / target).exists(), target


def test_the_sample_report_is_the_agents_own() -> None:
    """The README's sample is what the agent says of that bundle today (the lines it
    shows, in their order; the evidence it shortens is marked with ...)."""
    text = docs.README.read_text()
    sample = text.split("```text\n", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-m", "agent", "check", "--from",
                           "tests/data/bundles/tke-etp-local"], cwd=docs.ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    said = proc.stdout
    at = 0
    for line in sample.splitlines():
        if not line.strip() or line.strip() in ("- ...",) or line.rstrip().endswith("..."):
            continue
        found = said.find(line, at)
        assert found >= 0, line
        at = found
