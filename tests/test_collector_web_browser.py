"""The fleet page you can drill into, in a real headless browser (Debian's chromium, as
tests/test_collector_page.py uses it, and skipped as it is where chromium is missing:
make test installs it). The browser is driven over the DevTools protocol (its own
websocket, Tornado's client: nothing more to install), as a person would: it loads the
fleet page, clicks a node's link, clicks a finding id and a status to filter; with
script execution off, since the pages need none. Every page keeps to its policy: no
violation is reported. A node named with markup stays text, with scripts on.

Screenshots of the three pages are written to the test's temporary directory; with
COLLECTOR_SCREENSHOTS=DIR they are copied into DIR too (the README's are made so:
``COLLECTOR_SCREENSHOTS=docs .venv/bin/python -m pytest -q tests/test_collector_web_browser.py``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import html
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
from tornado.websocket import WebSocketClientConnection, websocket_connect

from tests.test_collector import Proc, verdict
from tests.test_collector_page import CHROMIUM, FLAGS

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                                "(make test installs it)")
SHOTS = {"fleet": "collector-fleet-page.png", "node": "collector-node-page.png",
         "filtered": "collector-filtered.png"}


class Browser:
    """Headless Chromium and one tab of it, over the DevTools protocol."""

    def __init__(self, profile: Path) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        self.p = subprocess.Popen(
            [CHROMIUM or "chromium", *FLAGS, f"--user-data-dir={profile}",
             "--remote-debugging-port=0", "--hide-scrollbars", "--window-size=1280,900",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # its helpers in its own group: stopped with it
        self.loop = asyncio.new_event_loop()
        self.events: list[dict[str, Any]] = []
        self.n = 0
        try:
            port_file = profile / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
                if time.monotonic() > deadline or self.p.poll() is not None:
                    raise RuntimeError("chromium did not open its DevTools port")
                time.sleep(0.1)
            port = int(port_file.read_text().split()[0])
            tabs = requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            tab = next(t for t in tabs if t["type"] == "page")
            self.ws: WebSocketClientConnection = self._in_loop(
                lambda: websocket_connect(tab["webSocketDebuggerUrl"],
                                          max_message_size=256 << 20))
            for domain in ("Page", "DOM", "CSS", "Log", "Runtime", "Audits"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.loop.close()
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        # a helper left behind in its group (the group is its own: start_new_session)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)

    def _in_loop(self, make: Any, timeout: float = 30) -> Any:
        """What ``make()`` returns, awaited on the browser's own event loop (Tornado's
        futures belong to the loop they are made on: made inside it)."""
        async def run() -> Any:
            return await asyncio.wait_for(make(), timeout)

        return self.loop.run_until_complete(run())

    def _read(self, timeout: float = 30) -> dict[str, Any]:
        raw = self._in_loop(self.ws.read_message, timeout)
        if raw is None:
            raise RuntimeError("the DevTools connection closed")
        msg: dict[str, Any] = json.loads(raw)
        if "method" in msg:
            self.events.append(msg)
        return msg

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.n += 1
        mine = self.n
        self._in_loop(lambda: self.ws.write_message(
            json.dumps({"id": mine, "method": method, "params": params})))
        while True:
            msg = self._read()
            if msg.get("id") == mine:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result

    def _loaded(self, since: int) -> None:
        deadline = time.monotonic() + 30
        while not any(e["method"] == "Page.loadEventFired" for e in self.events[since:]):
            self._read(max(0.1, deadline - time.monotonic()))

    def go(self, url: str) -> None:
        since = len(self.events)
        self.call("Page.navigate", url=url)
        self._loaded(since)

    def url(self) -> str:
        h = self.call("Page.getNavigationHistory")
        return str(h["entries"][h["currentIndex"]]["url"])

    def all(self, css: str) -> list[int]:
        root = self.call("DOM.getDocument", depth=0)["root"]["nodeId"]
        return list(self.call("DOM.querySelectorAll", nodeId=root, selector=css)["nodeIds"])

    def outer(self, node: int) -> str:
        return str(self.call("DOM.getOuterHTML", nodeId=node)["outerHTML"])

    def text(self, css: str) -> list[str]:
        """The text of each element ``css`` selects (from the DOM, not the page's bytes)."""
        return [html.unescape(re.sub(r"<[^>]*>", "", self.outer(n))) for n in self.all(css)]

    def style(self, node: int, prop: str) -> str:
        got = self.call("CSS.getComputedStyleForNode", nodeId=node)["computedStyle"]
        return str(next(p["value"] for p in got if p["name"] == prop))

    def click(self, css: str, text: str | None = None) -> None:
        """A left click in the middle of the first element ``css`` selects (whose text is
        ``text`` when given), as a mouse would; then waits for the next page."""
        nodes = self.all(css)
        if text is not None:
            nodes = [n for n in nodes
                     if html.unescape(re.sub(r"<[^>]*>", "", self.outer(n))).strip() == text]
        assert nodes, (css, text, self.url())
        self.call("DOM.scrollIntoViewIfNeeded", nodeId=nodes[0])
        quad = self.call("DOM.getContentQuads", nodeId=nodes[0])["quads"][0]
        x, y = sum(quad[0::2]) / 4, sum(quad[1::2]) / 4
        since = len(self.events)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                      clickCount=1)
        self._loaded(since)

    def screenshot(self, path: Path, max_height: int = 2200) -> None:
        self.call("Runtime.evaluate", expression="0")  # (nothing: a round trip)
        m = self.call("Page.getLayoutMetrics")
        height = min(int(m["cssContentSize"]["height"]), max_height)
        width = int(m["cssLayoutViewport"]["clientWidth"])
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        path.write_bytes(base64.b64decode(data["data"]))

    def violations(self, since: int = 0) -> list[str]:
        """What the browser reported, from event ``since`` on, against the pages' policy
        (and any console error)."""
        out = []
        for e in self.events[since:]:
            p = e.get("params", {})
            if e["method"] == "Audits.issueAdded" and \
                    p["issue"]["code"] == "ContentSecurityPolicyIssue":
                out.append(json.dumps(p["issue"]["details"])[:500])
            elif e["method"] == "Log.entryAdded" and (
                    "Content Security Policy" in p["entry"]["text"]
                    or (p["entry"]["level"] == "error"
                        and "favicon" not in p["entry"].get("url", ""))):
                out.append(p["entry"]["text"][:500])
            elif e["method"] in ("Runtime.consoleAPICalled", "Runtime.exceptionThrown"):
                out.append(json.dumps(p)[:500])
        return out


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory.mktemp("chromium"))
    try:
        yield b
    finally:
        b.close()


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def fleet_verdicts(now: float) -> list[dict[str, Any]]:
    """A small TKE fleet as the README shows it: two nodes where a capture saw the loop,
    four at risk, one that could not tell, five healthy; the first node with three days
    of history (healthy, at risk, loopback)."""
    base = verdict("x")
    base["context"].update(kube_proxy_version="v1.30.0-tke.5", origin="live")
    exposure = base["findings"][0]
    observed = copy.deepcopy(exposure)
    observed.update(id="loopback-observed", summary=(
        "Handshakes from pods of this node to 10.0.1.100:80/TCP went unanswered: the load "
        "balancer sent them back to this node, which dropped them (watched 60 s)"),
        evidence=["capture: 41 SYNs from 172.16.1.0/24 to NodePort 31380 in 60 s, 41 "
                  "unanswered", *exposure["evidence"][:4]])
    checkout = copy.deepcopy(exposure)
    checkout.update(service="shop/checkout", lb_ip="10.0.1.102", summary=exposure["summary"]
                    .replace("10.0.1.100", "10.0.1.102"))
    unknown = {"id": "lb-ips-unknown", "severity": "warning", "lb_ip": None, "port": None,
               "protocol": None, "service": None,
               "summary": "The LB IPs of this node's Services could not be read: the "
                          "Kubernetes API did not answer",
               "evidence": ["GET /api/v1/services: connection refused"],
               "remedy": "Let the agent's ServiceAccount list Services (its ClusterRole)"}
    states = {
        "loopback": {"status": "loopback", "findings": [observed, exposure, checkout]},
        "at-risk": {"status": "at-risk", "findings": [exposure, checkout]},
        "at-risk-1": {"status": "at-risk", "findings": [exposure]},
        "unknown": {"status": "unknown", "findings": [unknown]},
        "healthy": {"status": "healthy", "findings": [], "unknowns": []},
    }
    plan = ["loopback", "loopback", "at-risk", "at-risk", "at-risk-1", "at-risk-1",
            "unknown", *["healthy"] * 5]
    out = []
    for i, state in enumerate(plan):
        out.append({**copy.deepcopy(base), **copy.deepcopy(states[state]),
                    "node": f"10.0.1.{11 + i}", "time": iso(now - 40 - i),
                    "idempotency_key": f"now-{i}"})
    # the first node's past: a verdict each 2 hours (a heartbeat, or a change)
    for hours, state in ((72, "healthy"), (50, "at-risk"), (34, "loopback"),
                         (20, "at-risk"), (9, "loopback")):
        for h in range(hours, hours - 12, -2):
            if h > 0:
                out.append({**copy.deepcopy(base), **copy.deepcopy(states[state]),
                            "node": "10.0.1.11", "time": iso(now - h * 3600),
                            "idempotency_key": f"past-{h}"})
    out.sort(key=lambda v: v["time"])
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    c = Proc(tmp_path_factory.mktemp("web") / "fleet.db")
    try:
        vs = fleet_verdicts(time.time())
        for i in range(0, len(vs), 20):
            r = requests.post(c.url + "/v1/verdicts", json=vs[i:i + 20], timeout=30)
            assert r.status_code == 200, r.text
        yield c
    finally:
        c.stop()


def keep(shot: Path) -> None:
    """Copied where COLLECTOR_SCREENSHOTS says, when it says (the README's: docs)."""
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    where = os.environ.get("COLLECTOR_SCREENSHOTS")
    if where:
        shutil.copyfile(shot, Path(where) / SHOTS[shot.stem])


def test_drill_down_from_the_fleet_to_a_node_and_filter(fleet: Proc, browser: Browser,
                                                        tmp_path: Path) -> None:
    b = browser
    b.call("Emulation.setScriptExecutionDisabled", value=True)  # the pages need none
    start = len(b.events)
    b.go(fleet.url + "/")
    assert b.text("head > title") == ["loopback-agent fleet"]
    assert b.text("#summary")[0].startswith("12 nodes")
    rows = b.all("#nodes tr")[1:]
    assert len(rows) == 12
    pill = b.all(".pill.loopback")[0]
    assert b.style(pill, "background-color") == "rgb(176, 0, 32)"  # its style sheet applies
    b.screenshot(tmp_path / "fleet.png")
    keep(tmp_path / "fleet.png")

    # the worst node first: its link opens its page
    first = b.text("#nodes tr td:first-child a")[0]
    assert first == "10.0.1.11"
    b.click("#nodes tr td:first-child a", first)
    assert b.url() == fleet.url + "/nodes/10.0.1.11"
    assert b.text("h1") == ["10.0.1.11"]
    facts = b.text("#facts")[0]
    assert "loopback" in facts and "ipvs" in facts and "v1.30.0-tke.5" in facts
    assert b.text("#findings h3 a:first-child")[:3] == [
        "loopback-observed", "pod-to-lb-not-masqueraded", "pod-to-lb-not-masqueraded"]
    assert b.all("#findings details[open] .evidence li")  # the first one's evidence shown
    assert "Remedy:" in b.text("#findings")[0]
    bars = b.all("#timeline rect")
    classes = [re.search(r'class="([^"]+)"', b.outer(n)).group(1)  # type: ignore[union-attr]
               for n in bars]
    assert classes == ["healthy", "at-risk", "loopback", "at-risk", "loopback", "silent"]
    assert b.style(bars[2], "fill") == "rgb(176, 0, 32)"
    b.screenshot(tmp_path / "node.png")
    keep(tmp_path / "node.png")

    # a finding id filters the fleet; a status narrows it: both kept in the address
    b.click("#findings h3 a", "pod-to-lb-not-masqueraded")
    assert b.url() == fleet.url + "/?finding=pod-to-lb-not-masqueraded"
    assert len(b.all("#nodes tr")) - 1 == 6
    b.click("#summary a.pill.at-risk")
    assert b.url() == fleet.url + "/?status=at-risk&finding=pod-to-lb-not-masqueraded"
    statuses = b.text("#nodes tr td:nth-child(2)")
    assert statuses == ["at-risk"] * 4
    assert b.text("#active a.chip")[0].startswith("status at-risk")
    b.screenshot(tmp_path / "filtered.png")
    keep(tmp_path / "filtered.png")

    # a Service's row: its nodes
    b.go(fleet.url + "/")
    b.click("#services td:first-child a", "shop/checkout")
    assert b.url() == fleet.url + "/?service=shop%2Fcheckout&lb_ip=10.0.1.102"
    assert b.text("#nodes tr td:first-child a") == ["10.0.1.11", "10.0.1.12", "10.0.1.13",
                                                     "10.0.1.14"]
    # the next page of a filtered list keeps the filter
    b.go(fleet.url + "/?status=healthy&limit=2")
    b.click("#nav a", "next")
    assert b.url() == fleet.url + "/?status=healthy&limit=2&offset=2"
    assert len(b.text("#nodes tr td:first-child a")) == 2
    assert b.violations(start) == []


def test_markup_in_a_node_name_stays_text_on_its_page_with_scripts_on(
        browser: Browser, tmp_path: Path) -> None:
    b = browser
    b.call("Emulation.setScriptExecutionDisabled", value=False)
    start = len(b.events)
    name = "<img src=x onerror=\"document.title='pwned'\">?#/%"
    v = verdict(name)
    v["findings"][0]["evidence"].append("<script>document.title='pwned2'</script>")
    c = Proc(tmp_path / "evil.db")
    try:
        assert requests.post(c.url + "/v1/verdicts", json=v, timeout=10).status_code == 200
        b.go(c.url + "/")
        b.click("#nodes tr td:first-child a")
        assert b.url() == c.url + "/nodes/%3Cimg%20src%3Dx%20onerror%3D%22document.title%3D" \
                                  "%27pwned%27%22%3E%3F%23%2F%25"
        assert b.text("h1") == [name]
        assert b.text("head > title") == [name + " - loopback-agent fleet"]  # no script retitled it
        assert b.all("img") == [] and b.all("script") == []
        assert "<script>document.title='pwned2'</script>" in b.text("#findings")[0]
    finally:
        c.stop()
    assert b.violations(start) == []
