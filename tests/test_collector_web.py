"""The fleet page you can drill into (issue 37, item 5), server-side: filters by status,
Service, LB IP and finding id, paging through 1,000+ nodes with the filters kept, a page
per node (findings with evidence and remedy, unknowns, kube-proxy's mode and version, the
status over time), 404 for an unknown node, node names with URL-special characters, and
everything a node sent escaped: markup, lone surrogates, terminal escapes. The same pages
in a real browser: tests/test_collector_web_browser.py."""

from __future__ import annotations

import base64
import copy
import hashlib
import re
import time
from datetime import UTC, datetime
from html.parser import HTMLParser
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import requests

from agent.collector import browse
from agent.collector.store import open_store
from agent.verdict_doc import STATUSES
from tests.test_collector import Proc, verdict
from tests.test_collector import postgres as postgres  # the fixture, for big_fleet

STRICT_CSP = re.compile(r"default-src 'none'; style-src 'sha256-[A-Za-z0-9+/]+=*'; "
                        r"base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# names a URL must carry whole: "/", "?", "#", "%", "+", "&", a space, non-ASCII, markup
ODD_NAMES = ["a/b", "q?x=1#frag", "100%25 done", "plus+sign&amp", "sp ace", "节点-ü-🚀",
             "<img src=x onerror=alert(1)>", "esc\x1b[31mred\x1b[0m", "rtl\u202egnp.exe"]


class Page(HTMLParser):
    """What a test reads of a page: every element (tag, attributes), the links with
    their text and the table they are in, and the text of elements by id."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.links: list[tuple[str, str, str, str]] = []  # (table id, href, text, rel)
        self.texts: dict[str, str] = {}
        self._tables: list[str] = []
        self._open: list[tuple[str, str]] = []  # (tag, id) of elements with an id
        self._link: list[Any] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.elements.append((tag, a))
        if tag == "table":
            self._tables.append(a.get("id", ""))
        if tag == "a":
            self._link = [self._tables[-1] if self._tables else "", a.get("href", ""), "",
                          a.get("rel", "")]
        if "id" in a:
            self._open.append((tag, a["id"]))
            self.texts[a["id"]] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "table" and self._tables:
            self._tables.pop()
        if tag == "a" and self._link is not None:
            self.links.append(tuple(self._link))  # type: ignore[arg-type]
            self._link = None
        if self._open and self._open[-1][0] == tag:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._link is not None:
            self._link[2] += data
        for _, i in self._open:
            self.texts[i] += data

    def nodes(self) -> list[str]:
        """The node names of the nodes table, in order."""
        return [t for table, href, t, _ in self.links
                if table == "nodes" and href.startswith("/nodes/")]

    def next(self) -> str | None:
        return next((href for _, href, _, rel in self.links if rel == "next"), None)


def get(c: Proc, path: str) -> tuple[requests.Response, Page]:
    r = requests.get(c.url + path, timeout=30)
    return r, Page(r.content.decode("utf-8"))


def walk(c: Proc, path: str) -> tuple[list[str], list[str]]:
    """Every node the nodes table lists from ``path`` on, following its "next" links;
    and the addresses visited."""
    names: list[str] = []
    seen: list[str] = []
    link: str | None = path
    while link:
        seen.append(link)
        r, page = get(c, link)
        assert r.status_code == 200, (link, r.text[:300])
        names += page.nodes()
        link = page.next()
        assert len(seen) < 50
    return names, seen


# -- a fleet of 1,050 nodes, stored as the collector stores verdicts ---------------------


def finding(fid: str, service: str | None, lb_ip: str | None,
            severity: str = "critical") -> dict[str, Any]:
    return {"id": fid, "severity": severity, "summary": f"{fid} on {lb_ip}", "lb_ip": lb_ip,
            "port": 80, "protocol": "TCP", "service": service, "evidence": ["e"],
            "remedy": "r"}


def fleet_node(i: int) -> dict[str, Any]:
    """Node i of the fleet: 1 in 10 loopback, 4 at-risk, 1 unknown, 4 healthy; three
    Services with one LB IP each, a fourth on two LB IPs; ids that are prefixes of
    others ("lb-ip" of "lb-ip-local"): a filter matches whole ids only."""
    kind = i % 10
    svc, ip = f"ns{i % 3}/web", f"10.0.{i % 3}.1"
    if kind == 0:
        status, fs = "loopback", [finding("loopback-observed", svc, ip),
                                  finding("pod-to-lb-not-masqueraded", svc, ip)]
    elif kind <= 4:
        status, fs = "at-risk", [finding("pod-to-lb-not-masqueraded", svc, ip)]
        if i % 7 == 0:
            fs.append(finding("lb-ip-local", "shop/api", f"10.9.0.{i % 2}", "warning"))
        if i % 11 == 0:
            fs.append(finding("lb-ip", "shop/api", "10.9.0.0", "warning"))
    elif kind == 5:
        status, fs = "unknown", [finding("lb-ips-unknown", None, None, "warning")]
    else:
        status, fs = "healthy", []
    return {"node": f"node-{i:04d}", "status": status, "kube_proxy_mode": "iptables",
            "time": "2026-11-30T00:00:00Z", "unknowns": [], "idempotency_key": f"k{i}",
            "findings": fs}


FLEET = [fleet_node(i) for i in range(1050)]


def expected(keep: Any = lambda v: True) -> list[str]:
    """The nodes the page lists, worst first, as the store orders them."""
    rows = [v for v in FLEET if keep(v)]
    rows.sort(key=lambda v: (STATUSES.index(v["status"]),
                             -sum(f["severity"] != "info" for f in v["findings"]), v["node"]))
    return [v["node"] for v in rows]


def has(v: dict[str, Any], **want: str) -> bool:
    return any(all(f.get(k) == x for k, x in want.items()) for f in v["findings"])


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def big_fleet(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The fleet stored once per database kind, a collector on it for the module."""
    if request.param == "sqlite":
        db = f"sqlite://{tmp_path_factory.mktemp('fleet') / 'c.db'}"
    else:
        db = request.getfixturevalue("postgres").new_db()
    store = open_store(db)
    for i in range(0, len(FLEET), 500):
        store.add(FLEET[i:i + 500])
    store.close()
    c = Proc(db)
    yield c
    c.stop()


def test_paging_through_1050_nodes_with_and_without_filters(big_fleet: Proc) -> None:
    c = big_fleet
    r, page = get(c, "/")
    assert r.status_code == 200 and r.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.texts["summary"].startswith("1050 nodes")
    assert "page 1 of 6" in page.texts["nav"]
    names, seen = walk(c, "/")
    assert names == expected() and len(seen) == 6
    # a page size of its own, kept by every link; the last page, previous and first
    names, seen = walk(c, "/?limit=1000")
    assert names == expected() and seen == ["/?limit=1000", "/?limit=1000&offset=1000"]
    _, last = get(c, "/?limit=1000&offset=1000")
    assert {(t, h) for _, h, t, _ in last.links if t in ("first", "previous")} == {
        ("first", "/?limit=1000"), ("previous", "/?limit=1000")}
    # each filter, alone and together, a page at a time: exactly the nodes it names
    cases = {
        "/?status=loopback&limit=30": lambda v: v["status"] == "loopback",
        "/?finding=lb-ip-local&limit=40": lambda v: has(v, id="lb-ip-local"),
        "/?finding=lb-ip": lambda v: has(v, id="lb-ip"),  # not lb-ip-local's nodes
        "/?finding=lb-ips-unknown": lambda v: has(v, id="lb-ips-unknown"),
        "/?service=ns1%2Fweb&limit=100": lambda v: has(v, service="ns1/web"),
        "/?service=shop%2Fapi&lb_ip=10.9.0.1": lambda v: has(v, service="shop/api",
                                                             lb_ip="10.9.0.1"),
        "/?lb_ip=10.0.2.1&status=at-risk&finding=lb-ip-local&limit=5":
            lambda v: v["status"] == "at-risk" and has(v, lb_ip="10.0.2.1")
            and has(v, id="lb-ip-local"),
        "/?status=healthy&finding=pod-to-lb-not-masqueraded": lambda v: False,
        "/?service=no%2Fsuch": lambda v: False,
    }
    for path, keep in cases.items():
        want = expected(keep)
        names, seen = walk(c, path)
        assert names == want, path
        limit = int(parse_qs(urlsplit(path).query).get("limit", ["200"])[0])
        assert len(seen) == max(1, -(-len(want) // limit)), path
        for link in seen:  # every page keeps every filter
            assert parse_qs(urlsplit(link).query) | {"offset": ["x"]} == \
                parse_qs(urlsplit(path).query) | {"offset": ["x"]}, (path, link)
        _, first = get(c, path)
        assert first.texts["shown"].endswith(f" of {len(want)})"), path
    assert len(expected(lambda v: has(v, id="lb-ip-local"))) > 40  # more than a page
    # past the end: an empty page, no error
    r, page = get(c, "/?status=loopback&offset=5000")
    assert r.status_code == 200 and page.nodes() == [] and "none of 105" in r.text


def test_the_filters_are_links_on_the_page(big_fleet: Proc) -> None:
    """Each status pill, finding id and Service on the page filters; a filter on shows
    how to take it off; the Services table links to the nodes where each has findings."""
    c = big_fleet
    _, page = get(c, "/")
    hrefs = {h for _, h, _, _ in page.links}
    assert {f"/?status={s}" for s in STATUSES} <= hrefs
    assert {"/?finding=lb-ip-local", "/?finding=lb-ips-unknown"} <= hrefs
    services = [(t, h) for table, h, t, _ in page.links if table == "services"
                and h.startswith("/?service=") and t != "all of them"]
    # a row naming 8 of its nodes ends with a link to all of them: its own filter
    assert {h for table, h, t, _ in page.links if t == "all of them"} == \
        {h for _, h in services}
    assert ("ns0/web", "/?service=ns0%2Fweb&lb_ip=10.0.0.1") in services
    assert len(services) == 5  # ns0..2/web, shop/api on two LB IPs
    for text, href in services:  # each row: exactly the nodes with findings on it
        q = {k: v[0] for k, v in parse_qs(urlsplit(href).query).items()}
        assert q["service"] == text
        names, _ = walk(c, href)
        assert names == expected(lambda v, q=q: has(v, **q)), href
    # a Service row's node names go to the nodes' pages
    row_nodes = [h for table, h, _, _ in page.links if table == "services"
                 and h.startswith("/nodes/")]
    assert row_nodes and all(requests.get(c.url + h, timeout=10).status_code == 200
                             for h in row_nodes[:3])
    # a filter on: its pill marked, a link that takes it off, one that takes all off
    r, page = get(c, "/?status=at-risk&finding=lb-ip-local")
    assert ("pill at-risk on" in r.text) and page.texts["active"]
    off = {t.strip(): h for _, h, t, _ in page.links if t.endswith("\u00d7")}
    assert off == {"status at-risk \u00d7": "/?finding=lb-ip-local",
                   "finding lb-ip-local \u00d7": "/?status=at-risk"}
    assert ("show all nodes", "/") in {(t, h) for _, h, t, _ in page.links}


@pytest.mark.parametrize("query", ["status=bogus", "status=At-Risk", "limit=0",
                                   "limit=1001", "offset=-1", "offset=x",
                                   "finding=" + "x" * 513])
def test_bad_filters_are_400(query: str, fresh: Proc) -> None:
    r = requests.get(fresh.url + "/?" + query, timeout=5)
    assert r.status_code == 400 and "error" in r.json()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Any:
    c = Proc(tmp_path_factory.mktemp("fresh") / "c.db")
    yield c
    c.stop()


# -- a node's page ------------------------------------------------------------------------


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_node_pages_and_links_for_names_with_url_special_characters(fresh: Proc) -> None:
    base = verdict("x")
    now = time.time()
    batch = [{**copy.deepcopy(base), "node": n, "idempotency_key": f"odd-{i}",
              "time": iso(now - 60)} for i, n in enumerate(ODD_NAMES)]
    assert requests.post(fresh.url + "/v1/verdicts", json=batch,
                         timeout=10).json()["stored"] == len(ODD_NAMES)
    _, fleet = get(fresh, "/")
    links = {t: h for table, h, t, _ in fleet.links if table == "nodes"}
    for name in ODD_NAMES:
        shown = browse.text(name)
        href = links[shown]
        assert href.startswith("/nodes/") and "/" not in href[len("/nodes/"):]
        r, page = get(fresh, href)
        assert r.status_code == 200, (name, r.text[:300])
        assert page.texts["node"] == shown, name
        assert STRICT_CSP.fullmatch(r.headers["Content-Security-Policy"])
        # its JSON history is linked with the same name
        api = next(h for _, h, _, _ in page.links if h.startswith("/v1/nodes/"))
        hist = requests.get(fresh.url + api, timeout=10)
        assert hist.status_code == 200 and hist.json()[0]["node"] == name
    assert "\x1b" not in fleet.texts["nodes"] and "\u241b[31mred" in fleet.texts["nodes"]
    assert "\u202e" not in fleet.texts["nodes"] and "rtl\ufffdgnp.exe" in fleet.texts["nodes"]
    assert not [e for e in fleet.elements if e[0] in ("img", "script")]


def test_unknown_node_is_a_404_page(fresh: Proc) -> None:
    for path in ("/nodes/no-such-node", "/nodes/%3Cb%3Enope%3C%2Fb%3E", "/nodes/a%2Fnope"):
        r = requests.get(fresh.url + path, timeout=5)
        assert r.status_code == 404, path
        assert r.headers["Content-Type"] == "text/html; charset=utf-8"
        assert STRICT_CSP.fullmatch(r.headers["Content-Security-Policy"])
        assert "<b>" not in r.text
    assert "No node &lt;b&gt;nope&lt;/b&gt;" in requests.get(
        fresh.url + "/nodes/%3Cb%3Enope%3C%2Fb%3E", timeout=5).text
    # bytes that are no UTF-8 in the name: refused, not a 500
    assert requests.get(fresh.url + "/nodes/%ff%fe", timeout=5).status_code == 400
    for path in ("/nodes/", "/nodes/a/b"):
        assert requests.get(fresh.url + path, timeout=5).status_code == 404, path


def history_of(base: dict[str, Any], node: str, now: float) -> list[dict[str, Any]]:
    """Three days of a node: healthy, at-risk, loopback, at-risk again (a verdict each
    two hours, sent as the agent sends heartbeats: the same document, a new time)."""
    healthy = {"status": "healthy", "findings": [], "unknowns": []}
    loop = copy.deepcopy(base["findings"][0])
    loop.update(id="loopback-observed", summary="SYNs to 10.0.1.100:80 looped back")
    plan = [(72, healthy), (48, {}), (30, {"status": "loopback",
                                           "findings": [loop, *base["findings"]]}), (10, {})]
    out = []
    for k, (hours, changes) in enumerate(plan):
        until = plan[k + 1][0] if k + 1 < len(plan) else -1
        for h in range(hours, until, -2):
            out.append({**copy.deepcopy(base), **copy.deepcopy(changes), "node": node,
                        "time": iso(now - h * 3600 - 30),
                        "idempotency_key": f"{node}-{h}"})
    return out


def test_a_node_page_shows_the_latest_verdict_and_its_status_over_time(fresh: Proc) -> None:
    base = verdict("x")
    base["context"]["kube_proxy_version"] = "v1.31.2"
    f = base["findings"][0]
    f["evidence"] += ["comment <img src=x onerror=alert(1)>", "tty \x1b[2J\x1b]0;owned\x07",
                      "lone \udc80 surrogate", "bidi \u202eevil"]
    f["remedy"] = "Annotate it: <b>prevent-loopback</b> & \"true\""
    base["unknowns"].append({"source": "<script>x</script>", "reason": "bad \x1b[31m"})
    now = time.time()
    verdicts = history_of(base, "web/1?#", now)
    for i in range(0, len(verdicts), 20):
        r = requests.post(fresh.url + "/v1/verdicts", json=verdicts[i:i + 20], timeout=10)
        assert r.status_code == 200, r.text
    r, page = get(fresh, "/nodes/web%2F1%3F%23")
    assert r.status_code == 200
    text = r.content.decode("utf-8")
    facts = page.texts["facts"]
    assert "at-risk" in facts and "ipvs" in facts and "v1.31.2" in facts
    assert "ipset KUBE-CLUSTER-IP" in facts  # how the mode was learned
    # the findings: summary, remedy and every evidence line, escaped or made visible
    findings = page.texts["findings"]
    assert f["summary"] in findings and "10.0.1.100:80/TCP" in findings
    assert "Remedy: Annotate it: <b>prevent-loopback</b> & \"true\"" in findings
    assert "&lt;b&gt;prevent-loopback&lt;/b&gt; &amp; &quot;true&quot;" in text
    assert "comment <img src=x onerror=alert(1)>" in findings
    assert "tty \u241b[2J\u241b]0;owned\u2407" in findings and "\x1b" not in text
    assert "lone \ufffd surrogate" in findings and "bidi \ufffdevil" in findings
    assert f"evidence ({len(f['evidence'])} lines)" in findings
    assert "<script>x</script>" in page.texts["unknowns"] and "bad \u241b[31m" in \
        page.texts["unknowns"]
    assert not [e for e in page.elements if e[0] in ("img", "script")]
    assert not [e for e in page.elements for k in e[1] if k.startswith("on") or k == "style"]
    # each finding id and Service leads to the fleet filtered by it
    hrefs = {h for _, h, _, _ in page.links}
    assert {"/?finding=pod-to-lb-not-masqueraded", "/?service=default%2Fweb", "/"} <= hrefs
    # the status over time: four runs, oldest first, then no verdict since the newest
    rects = [a for tag, a in page.elements if tag == "rect"]
    assert [a["class"] for a in rects] == ["healthy", "at-risk", "loopback", "at-risk",
                                           "silent"]
    xs = [float(a["x"]) for a in rects]
    assert xs == sorted(xs) and xs[0] == 0
    assert 320 < xs[1] < 345 and 570 < xs[2] < 595 and 855 < xs[3] < 870  # hours 48, 30, 10
    assert float(rects[-1]["width"]) < 1  # 30 s of silence in 3 days
    assert page.texts["changes"].count("at-risk") == 2
    assert f"4 runs of {len(verdicts)} verdicts" in r.text


def test_the_pages_keep_the_strict_policy_and_its_style_hash(fresh: Proc) -> None:
    assert requests.post(fresh.url + "/v1/verdicts", json=verdict("csp-node"),
                         timeout=10).status_code == 200
    for path in ("/", "/?status=at-risk", "/nodes/csp-node", "/nodes/missing"):
        r = requests.get(fresh.url + path, timeout=5)
        csp = r.headers["Content-Security-Policy"]
        assert STRICT_CSP.fullmatch(csp), (path, csp)
        (style,) = re.findall(r"<style>(.*?)</style>", r.text, re.S)
        digest = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp
        page = Page(r.text)
        assert not [tag for tag, _ in page.elements if tag in ("script", "img", "iframe",
                                                               "object", "embed", "form")]
        assert not [a for _, a in page.elements for k in a if k == "style" or
                    k.startswith("on")], path
        assert r.headers["X-Frame-Options"] == "DENY" and r.headers["Cache-Control"] == \
            "no-store"


# -- the renderer alone: what no POST can store any more --------------------------------


def test_text_from_a_node_is_escaped_and_made_visible() -> None:
    """Old databases hold what intake now refuses (a lone surrogate in a name): every
    page renders it as text that encodes."""
    hostile = "\udc80<svg onload=alert(1)>\x1b[31m\x7f\x85\u2066"
    assert browse.text(hostile) == "\ufffd<svg onload=alert(1)>\u241b[31m\u2421\ufffd\ufffd"
    assert browse.h(hostile) == "\ufffd&lt;svg onload=alert(1)&gt;\u241b[31m\u2421\ufffd\ufffd"
    assert browse.text("tab\tand\nnewline") == "tab\tand\nnewline"
    assert browse.node_url("a/b?c#d%e \udc80") == "/nodes/a%2Fb%3Fc%23d%25e%20%EF%BF%BD"
    doc = {"node": hostile, "kube_proxy_mode": hostile, "agent_version": hostile,
           "context": {"kube_proxy_version": hostile, "kube_proxy_mode_from": hostile},
           "findings": [{"id": hostile, "severity": hostile, "summary": hostile,
                         "service": hostile, "lb_ip": hostile, "port": 1, "evidence": [hostile],
                         "remedy": hostile}, {"id": hostile, "abridged": True,
                                              "service": hostile, "lb_ip": hostile}],
           "ok": [{"id": hostile, "count": 1, "targets": [hostile], "example": {}}],
           "unknowns": [{"source": hostile, "reason": hostile}],
           "unknowns_more": {hostile: 3}}
    pages = [browse.render_node(hostile, {"status": hostile, "time": hostile,
                                          "kube_proxy_mode": hostile}, doc,
                                [(hostile, hostile), ("2026-11-30T00:00:00Z", hostile)], 2,
                                time.time()),
             browse.not_found_page(hostile),
             browse.render_fleet(browse.FleetView(service=hostile, finding=hostile),
                                 {hostile: 1}, 1,
                                 [{"node": hostile, "status": hostile, "time": hostile,
                                   "kube_proxy_mode": hostile, "ids": [hostile],
                                   "unknowns": 0}], 1, [(hostile, 1)],
                                 [{"service": hostile, "lb_ip": hostile, "ids": [hostile],
                                   "observed_nodes": [hostile], "exposed_nodes": [],
                                   "observed_count": 1, "exposed_count": 0}], 1)]
    for html in pages:
        html.encode("utf-8")  # strictly: no surrogate left
        assert "<svg onload" not in html and "\x1b" not in html and "\u2066" not in html
        assert "&lt;svg onload=alert(1)&gt;" in html
        assert not [a for _, a in Page(html).elements for k in a if k.startswith("on")]


def test_status_over_time_alone() -> None:
    t0 = datetime(2026, 11, 30, tzinfo=UTC).timestamp()
    hist = [(iso(t0 + i * 600), s) for i, s in enumerate(
        ["healthy"] * 5 + ["at-risk"] * 3 + ["weird-status"] + ["healthy"])]
    hist.insert(3, ("not a time", "loopback"))  # skipped, not drawn
    page = Page(browse._timeline(hist, 5000, t0 + 9 * 600))  # now: the newest verdict
    rects = [a for tag, a in page.elements if tag == "rect"]
    assert [a["class"] for a in rects] == ["healthy", "at-risk", "unknown", "healthy"]
    assert [float(a["x"]) for a in rects] == pytest.approx([0, 5 / 9 * 1000, 8 / 9 * 1000,
                                                            1000], abs=0.01)
    html = browse._timeline(hist, 5000, t0 + 9 * 600)
    assert "4 runs of the newest 10 of 5000 verdicts" in html
    assert "weird-status" in page.texts["changes"]
    assert browse._timeline([("x", "healthy")], 1, t0).startswith('<p class="muted"')


def test_a_verdict_dated_past_year_9999_does_not_break_its_nodes_page() -> None:
    """The schema's date-time takes 9999-12-31T23:59:59-12:00, past year 9999 in UTC: the
    node's page still renders (its axis says the end is out of range)."""
    from agent.collector import browse

    html = browse._timeline([("2026-12-01T00:00:00Z", "healthy"),
                             ("9999-12-31T23:59:59-12:00", "at-risk")], 2, 1.8e9)
    assert "(out of range)" in html and "at-risk" in html


def test_a_nul_in_a_filter_or_a_node_name_is_a_400() -> None:
    """PostgreSQL refuses a NUL in text (a 500 there); the pages refuse it first, on any
    store."""
    from agent.collector import browse
    from agent.collector.intake import BadRequest
    from agent.collector.store import Store

    with pytest.raises(BadRequest) as e:
        browse.FleetView.of({"service": ["a\x00b"]})
    assert e.value.code == 400
    with pytest.raises(BadRequest):
        browse.node_page(Store(":memory:"), "n\x00")
