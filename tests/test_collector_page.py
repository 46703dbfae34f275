"""The fleet page in a real headless browser (Debian's chromium): it renders the fleet,
and markup a node sent stays inert text."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.test_collector import Proc, verdict

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                                "(make test installs it)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Proc]:
    c = Proc(tmp_path / "page.db")
    try:
        evil = verdict("<script>document.title='pwned'</script>")
        evil["findings"][0]["service"] = "ns/<img src=x onerror=\"document.title='pwned2'\">"
        for v in (verdict("node-healthy-ish"), evil):
            assert requests.post(c.url + "/v1/verdicts", json=v, timeout=5).status_code == 200
        yield c
    finally:
        c.stop()


def browse(url: str, tmp_path: Path, *extra: str) -> str:
    r = subprocess.run([CHROMIUM or "chromium", *FLAGS, f"--user-data-dir={tmp_path}/profile",
                        *extra, url], capture_output=True, text=True, timeout=60)
    return r.stdout


def test_page_renders_the_fleet_and_injected_markup_stays_text(fleet: Proc,
                                                               tmp_path: Path) -> None:
    dom = browse(fleet.url + "/", tmp_path, "--dump-dom")
    assert "<title>loopback-agent fleet</title>" in dom  # no script retitled the page
    assert "pwned" not in dom.split("<title>")[1].split("</title>")[0]
    assert "2 nodes" in dom and "at-risk: 2" in dom
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom
    assert "<img" not in dom  # the injected image never became an element
    assert 'id="services"' in dom and "default/web" in dom


def test_screenshot_of_the_page(fleet: Proc, tmp_path: Path) -> None:
    shot = tmp_path / "fleet.png"
    browse(fleet.url + "/", tmp_path, f"--screenshot={shot}", "--window-size=1200,700")
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one


def test_the_page_keeps_to_its_content_security_policy(fleet: Proc, tmp_path: Path) -> None:
    """The policy allows no script and only the page's own style sheet: a browser that
    enforces it still renders the page styled, with no violation in its console."""
    r = subprocess.run([CHROMIUM or "chromium", *FLAGS, f"--user-data-dir={tmp_path}/profile",
                        "--enable-logging=stderr", "--v=0", "--dump-dom", fleet.url + "/"],
                       capture_output=True, text=True, timeout=60)
    assert 'id="nodes"' in r.stdout
    assert "Content Security Policy" not in r.stderr, r.stderr[-2000:]
    csp = requests.get(fleet.url + "/", timeout=5).headers["Content-Security-Policy"]
    assert "style-src 'sha256-" in csp
