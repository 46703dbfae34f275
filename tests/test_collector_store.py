"""The store keeps one gzipped document per node and content, and a history row per POST:
the API answers as the previous store did for the same POSTs (compared with that store,
kept verbatim in tests/data, serving the same sequence); a schema-2 database (SQLite file,
PostgreSQL database) made by the previous code is migrated in place; pruning frees
documents no row refers to; a stored document is bounded when read back; a fingerprint
never reaches another node's document; a known document is not validated again. Every
request crosses a real socket; SQLite files and PostgreSQL databases are real."""

from __future__ import annotations

import copy
import gzip
import importlib.util
import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from agent.ship import gz
from tests.test_collector import Proc, free_port
from tests.test_collector import postgres as postgres  # the fixture, for db below
from tests.test_collector_abuse import base as base  # the fixtures: a verdict, a database
from tests.test_collector_abuse import db as db
from tests.test_collector_abuse import status_kib
from tests.test_collector_gzip import zip_bomb

ROOT = Path(__file__).resolve().parents[1]
SCHEMA2 = ROOT / "tests" / "data" / "collector" / "store-schema2.py.txt"


def like(base: dict[str, Any], node: str, i: int, **changes: Any) -> dict[str, Any]:
    v = copy.deepcopy(base)
    v.update({"node": node, "time": f"2026-11-27T00:00:{i:02d}Z",
              "idempotency_key": f"k{i}", **changes})
    return v


def sql(db: str, query: str) -> list[tuple[Any, ...]]:
    """Read the database directly (what the store keeps, not what it serves)."""
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as c:
            return c.execute(query).fetchall()
    with sqlite3.connect(db.removeprefix("sqlite://")) as c:
        return c.execute(query).fetchall()


def old_store_module(tmp_path: Path) -> Any:
    """agent/collector/store.py as of 5ddf321 (schema 2), from tests/data."""
    path = tmp_path / "store_schema2.py"
    path.write_text(SCHEMA2.read_text())
    spec = importlib.util.spec_from_file_location("store_schema2", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the collector of today's code over the schema-2 store: the reference for the answers
OLD_SERVER = """
import importlib.util, sys
from agent.collector.web import serve
spec = importlib.util.spec_from_file_location("store_schema2", sys.argv[3])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
store = old.open_store(sys.argv[2])
# the readers the pages came to need after schema 2, over the same tables (the page
# is compared too): grafted from today's store, unfiltered nodes kept the old store's
from agent.collector.store import Store as New
for name in ("node_count", "_where", "finding_counts", "node_status", "status_history",
             "_position"):
    setattr(type(store), name, getattr(New, name))
old_nodes = type(store).nodes
def nodes(self, limit, offset=0, **filters):
    assert not any(filters.values()), filters
    return old_nodes(self, limit, offset)
type(store).nodes = nodes
add = store.add
store.add = lambda batch, bodies=None, schema=None, stored_docs=None: add(batch)  # stores all
store.known = lambda node, fingerprint: (False, None)  # so every one is validated
server = serve("127.0.0.1:" + sys.argv[1], store)
print("ready", flush=True)
server.serve_forever()
"""


class OldProc:
    def __init__(self, db: str, tmp_path: Path) -> None:
        path = tmp_path / "store_schema2.py"
        path.write_text(SCHEMA2.read_text())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.p = subprocess.Popen([sys.executable, "-c", OLD_SERVER, str(self.port), db,
                                   str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert self.p.stdout is not None and self.p.stdout.readline() == "ready\n", \
            self.p.stderr.read() if self.p.stderr else ""

    def stop(self) -> None:
        self.p.terminate()
        self.p.communicate(timeout=10)


def post(url: str, body: Any, coding: str | None = None) -> requests.Response:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if coding == "gzip":
        data, headers["Content-Encoding"] = gz.compress(data), "gzip"
    return requests.post(url + "/v1/verdicts", data=data, headers=headers, timeout=30)


def sequence(base: dict[str, Any]) -> list[tuple[Any, str | None]]:
    """POSTs as a fleet makes them: heartbeats of an unchanged verdict (new time and key
    each), a retry, a change and back, the same content on another node, a batch, no
    key (the collector makes one), the key first in order, gzip, a document an old
    store's reader would rewrite ("NaN" in a name) and non-ASCII text."""
    healthy = {"status": "healthy", "findings": [], "unknowns": []}
    weird = copy.deepcopy(base)
    weird["findings"][0]["service"] = "ns/NaN-Infinity-ü-🚀"
    no_key = like(base, "n-c", 12)
    del no_key["idempotency_key"]
    key_first = {"idempotency_key": "k13", **like(base, "n-c", 13)}
    return [
        (like(base, "n-a", 1), None),
        (like(base, "n-a", 2), None),
        (like(base, "n-a", 2), None),  # a retry: a duplicate
        (like(base, "n-a", 3, **healthy), None),
        (like(base, "n-a", 4), None),  # back to the first document
        (like(base, "n-b", 5), None),  # the same content on another node
        ([like(base, "n-a", 6), like(base, "n-b", 7), like(base, "n-a", 8)], None),
        (like(base, "n-a", 9), "gzip"),
        (like(weird, "n-d", 10), None),
        (like(weird, "n-d", 11), "gzip"),
        (no_key, None),
        (key_first, None),
        (like(base, "n-c", 14), None),
    ]


def answers(url: str) -> dict[str, Any]:
    """Every read the API and the page give for the nodes of ``sequence``."""
    out: dict[str, Any] = {}
    for path in ("/v1/nodes", "/v1/nodes?limit=2&offset=1", "/v1/services", "/"):
        r = requests.get(url + path, timeout=30)
        out[path] = (r.status_code, r.headers.get("X-Total-Count"), r.content)
    for node in ("n-a", "n-b", "n-c", "n-d", "n-nope"):
        r = requests.get(f"{url}/v1/nodes/{node}", timeout=30)
        out[node] = (r.status_code, r.content)
        pages, link = [], f"/v1/nodes/{node}?limit=2"
        while link:  # paged with the cursor
            r = requests.get(url + link, timeout=30)
            pages.append((r.status_code, r.content))
            link = r.links.get("next", {}).get("url", "")
        out[node + " pages"] = pages
    return out


def test_the_api_answers_as_the_previous_store_did_for_the_same_posts(
        db: str, tmp_path: Path, base: dict[str, Any], request: pytest.FixtureRequest) -> None:
    """The same POSTs to a collector on the previous store (every document stored) and
    to this one: every reply, the page and every history page are the same bytes. This
    one stores one document per node and content: 6 for 14 history rows."""
    ref_db = (f"sqlite://{tmp_path / 'ref.db'}" if db.startswith("sqlite")
              else request.getfixturevalue("postgres").new_db())
    ref, new = OldProc(ref_db, tmp_path), Proc(db)
    try:
        for body, coding in sequence(base):
            a, b = post(ref.url, body, coding), post(new.url, body, coding)
            assert (a.status_code, a.content) == (b.status_code, b.content), body
        want, got = answers(ref.url), answers(new.url)
    finally:
        ref.stop()
        new.stop()
    for key in want:
        assert got[key] == want[key], key
    assert len(json.loads(got["n-a"][1])) == 7 and got["n-nope"][0] == 404
    assert sql(db, "SELECT COUNT(*) FROM verdicts")[0][0] == 14
    # n-c: the key made by the collector goes last, as in k14; k13's key came first
    assert sql(db, "SELECT node, COUNT(*) FROM documents GROUP BY node ORDER BY node") == [
        ("n-a", 2), ("n-b", 1), ("n-c", 2), ("n-d", 1)]
    stored = sum(len(bytes(b)) for (b,) in sql(db, "SELECT body FROM documents"))
    one = len(sql(ref_db, "SELECT doc FROM verdicts LIMIT 1")[0][0])
    assert stored < 6 * one / 3  # and gzipped


def test_a_schema2_database_is_migrated_in_place(db: str, tmp_path: Path,
                                                 base: dict[str, Any]) -> None:
    """Made by the previous code (its DDL, its rows): opened by this collector, it
    answers as before, takes new POSTs (an unchanged one is stored once), and pruning
    drops the old rows and the documents no longer referred to."""
    old = old_store_module(tmp_path)
    store = old.open_store(db)
    store.add([like(base, "m", 1), like(base, "m", 2),
               like(base, "other", 3, status="healthy", findings=[])])
    store.close()
    ref = OldProc(db, tmp_path)
    try:
        before = answers(ref.url)
    finally:
        ref.stop()
    c = Proc(db)
    try:
        assert answers(c.url) == before
        assert sql(db, "SELECT value FROM collector_meta WHERE key = 'schema'") == [("3",)]
        for i in (4, 5, 6):  # heartbeats of an unchanged verdict
            assert post(c.url, like(base, "m", i)).json() == {"stored": 1, "duplicates": 0}
        assert post(c.url, like(base, "m", 2)).json() == {"stored": 0, "duplicates": 1}
        hist = requests.get(c.url + "/v1/nodes/m", timeout=10).json()
        assert [v["idempotency_key"] for v in hist] == ["k6", "k5", "k4", "k2", "k1"]
        assert hist[0] == like(base, "m", 6) and hist[-1] == like(base, "m", 1)
    finally:
        c.stop()
    assert sql(db, "SELECT COUNT(*) FROM documents") == [(1,)]
    from agent.collector.store import open_store

    store = open_store(db, retention_days=0)
    try:
        time.sleep(0.01)
        assert store.prune() == 4  # k1, k2 (old rows), k4, k5; k6 and other's kept
        docs, _ = store.history("m")
        assert [json.loads(d)["idempotency_key"] for d in docs] == ["k6"]
        store.add([like(base, "m", 7, status="healthy", findings=[])])
        time.sleep(0.01)
        assert store.prune() == 1
        assert store.history("m")[0] == [json.dumps(
            like(base, "m", 7, status="healthy", findings=[]), separators=(",", ":"),
            ensure_ascii=False)]
    finally:
        store.close()
    # m's first document is referred to by no row any more: freed
    assert sql(db, "SELECT COUNT(*) FROM documents") == [(1,)]
    assert sql(db, "SELECT COUNT(*) FROM verdicts") == [(2,)]


def test_pruning_frees_a_document_no_longer_referenced(db: str,
                                                       base: dict[str, Any]) -> None:
    from agent.collector.store import open_store

    store = open_store(db, retention_days=0)
    try:
        store.add([like(base, "p", 1), like(base, "p", 2), like(base, "q", 3)])
        store.add([like(base, "p", 4, status="healthy", findings=[])])
        assert sql(db, "SELECT COUNT(*) FROM documents") == [(3,)]
        time.sleep(0.01)
        assert store.prune() == 2
        assert sql(db, "SELECT node FROM documents ORDER BY node") == [("p",), ("q",)]
        assert store.history("q")[0][0] == json.dumps(like(base, "q", 3),
                                                      separators=(",", ":"))
    finally:
        store.close()


def test_a_stored_document_is_bounded_when_read_back(tmp_path: Path,
                                                     base: dict[str, Any]) -> None:
    """A database written to by something else: a document replaced by a 2 GiB zip bomb
    said to be 2 GiB, one that is not gzip, one whose frame does not fit. The history
    says each is unreadable, peak RSS grows by far less than the bomb, and the other
    rows are served."""
    path = tmp_path / "h.db"
    c = Proc(path)
    try:
        nodes = {"bomb": 1, "junk": 3, "frame": 5}  # the first of two keys each
        for node, i in nodes.items():
            assert post(c.url, like(base, node, i)).status_code == 200
            assert post(c.url, like(base, node, i + 1, status="healthy",
                                    findings=[])).status_code == 200
        with sqlite3.connect(path) as d:
            d.execute("UPDATE documents SET body = ?, size = ? WHERE node = 'bomb' AND "
                      "id = (SELECT MIN(id) FROM documents WHERE node = 'bomb')",
                      (zip_bomb(2), 2 << 30))
            d.execute("UPDATE documents SET body = ? WHERE node = 'junk' AND "
                      "id = (SELECT MIN(id) FROM documents WHERE node = 'junk')",
                      (b"\x1f\x8bnot gzip",))
            d.execute("UPDATE verdicts SET frame = '[[3, \"1\"]]' WHERE idem_key = 'k5'")
        pid = c.p.pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        rss0 = status_kib(pid, "VmRSS")
        for node, why in (("bomb", "inflates to more than 67108864"),
                          ("junk", "not a valid gzip stream"),
                          ("frame", "does not fit")):
            hist = requests.get(f"{c.url}/v1/nodes/{node}", timeout=30)
            assert hist.status_code == 200, hist.text
            newest, oldest = hist.json()
            i = nodes[node]
            assert newest == like(base, node, i + 1, status="healthy", findings=[])
            assert oldest["idempotency_key"] == f"k{i}" and why in oldest["error"], oldest
        grown = (status_kib(pid, "VmHWM") - rss0) / 1024
        assert grown < 200, f"peak RSS grew {grown:.0f} MiB reading a 2 GiB bomb back"
    finally:
        c.stop()


def test_a_fingerprint_never_reaches_another_nodes_document(tmp_path: Path,
                                                             base: dict[str, Any]) -> None:
    """A collision forged outright (node b's body said to have node a's fingerprint):
    b's verdict is stored with its own document, a's is untouched."""
    from agent.collector import docs
    from agent.collector.store import Store

    store = Store(tmp_path / "f.db")
    try:
        a, b = like(base, "a", 1), like(base, "b", 2, status="healthy", findings=[])
        store.add([a])
        body_b = docs.split(b)
        forged = docs.Body(body_b.text, docs.split(a).fingerprint, body_b.holes,
                           body_b.chars, body_b.keys)
        store.add([b], {id(b): forged})
        assert json.loads(store.history("b")[0][0]) == b
        assert json.loads(store.history("a")[0][0]) == a
    finally:
        store.close()


class Counting:
    """The real (fast) validator, counting the documents it is given whole: each goes to
    it first (jsonschema gets only what it refuses)."""

    def __init__(self, validate: Any) -> None:
        self.validate, self.seen = validate, []

    def __call__(self, doc: Any) -> Any:
        self.seen.append((doc.get("node"), doc.get("idempotency_key")))
        return self.validate(doc)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    from agent.collector.server import Collector
    from agent.collector.store import Store
    from agent.collector.web import CollectorServer

    srv = CollectorServer(Collector(Store(tmp_path / "v.db")), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv.collector
    srv.shutdown()


def test_a_stored_document_is_not_validated_again(server: tuple[str, Any],
                                                  base: dict[str, Any]) -> None:
    """Schema validation is skipped only for a document this node already stored and
    that was validated against this schema; its time is still checked."""
    url, col = server
    v2 = col.intake.schemas[base["schema"]]
    assert v2.fast is not None
    counting = v2.fast = Counting(v2.fast)
    assert post(url, like(base, "v", 1)).status_code == 200
    assert post(url, [like(base, "v", 2), like(base, "v", 3)], "gzip").status_code == 200
    assert counting.seen == [("v", "k1")]  # the heartbeats: their time and key only
    bad = post(url, like(base, "v", 4, time="yesterday"))
    assert bad.status_code == 422 and bad.json()["error"].startswith("time:"), bad.text
    changed = like(base, "v", 5, status="healthy", findings=[])
    assert post(url, changed).status_code == 200
    assert post(url, like(base, "w", 6)).status_code == 200  # another node's: validated
    invalid = like(base, "v", 7)
    invalid["findings"][0]["severity"] = "catastrophic"
    assert post(url, invalid).status_code == 422  # a document never stored
    assert counting.seen == [("v", "k1"), ("v", "k5"), ("w", "k6"), ("v", "k7")]
    # stored without validation (Store.add directly, or another schema): validated once
    col.store.add([like(base, "x", 8)])
    assert post(url, like(base, "x", 9)).status_code == 200
    assert post(url, like(base, "x", 10)).status_code == 200
    assert counting.seen[4:] == [("x", "k9")]
    assert len(requests.get(url + "/v1/nodes/v", timeout=10).json()) == 4


def test_a_heartbeat_looks_its_document_up_once_before_storing(
        server: tuple[str, Any], base: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """What the intake found stored is not looked up again by Store.add (three lookups of
    (node, fingerprint) per verdict before, each a round trip to PostgreSQL)."""
    url, col = server
    lookups: list[str] = []
    known = col.store.known

    def counted(node: str, fingerprint: str) -> tuple[bool, str | None]:
        lookups.append(node)
        return known(node, fingerprint)

    monkeypatch.setattr(col.store, "known", counted)
    assert post(url, like(base, "h", 1)).status_code == 200  # new: stored
    assert post(url, [like(base, "h", 2), like(base, "h", 3)]).status_code == 200
    assert lookups == ["h", "h", "h"]  # one per verdict, in the intake
    assert [v["idempotency_key"] for v in
            requests.get(url + "/v1/nodes/h", timeout=10).json()] == ["k3", "k2", "k1"]


def test_a_document_is_stored_gzipped(tmp_path: Path, base: dict[str, Any]) -> None:
    from agent.collector.store import Store

    store = Store(tmp_path / "g.db")
    try:
        v = like(base, "g", 1)
        store.add([v])
        ((body,),) = store._rows("SELECT body FROM documents")
        assert json.loads(gzip.decompress(body))["node"] == "g"
        assert len(body) < len(json.dumps(v)) / 3
    finally:
        store.close()


def test_a_caller_never_learns_whether_another_nodes_document_is_stored(
        tmp_path: Path, base: dict[str, Any]) -> None:
    """Per-node identity: agent a posting node b's stored document gets its 403 after a
    whole validation, as for any document (a skipped one would answer faster: a way to
    check a guess of b's verdict)."""
    from agent.collector.auth import Caller
    from agent.collector.intake import BadRequest
    from agent.collector.server import Collector
    from agent.collector.store import Store
    from agent.collector.web import CollectorServer

    class PerNode:
        def authenticate(self, authorization: str) -> Caller:
            node = authorization.removeprefix("Bearer ")
            if node not in ("a", "b"):
                raise BadRequest(401, "who?")
            return Caller(f"agent-{node}", node)

    srv = CollectorServer(Collector(Store(tmp_path / "n.db"), authenticator=PerNode()),
                          "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/verdicts"
    v2 = srv.collector.intake.schemas[base["schema"]]
    counting = v2.fast = Counting(v2.fast)
    try:
        for token, i, code in (("b", 1, 200), ("b", 2, 200), ("a", 3, 403)):
            r = requests.post(url, json=like(base, "b", i), timeout=30,
                              headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == code, r.text
    finally:
        srv.shutdown()
    assert counting.seen == [("b", "k1"), ("b", "k3")]


def test_a_document_longer_as_stored_than_taken_is_refused(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The collector stores its own encoding, which can be longer than the body it took
    (1E9 is stored as 1000000000.0): past the inflate limit such a row could never be read
    back, so it is refused with 413 naming the node."""
    from agent.collector import docs
    from agent.collector.intake import BadRequest

    v = {"node": "n1", "time": "t", "numbers": [1e9] * 100}
    monkeypatch.setattr(docs, "MAX_INFLATED", len(docs.split(v).text) - 1)
    with pytest.raises(BadRequest) as e:
        docs.split(v)
    assert e.value.code == 413 and "'n1'" in e.value.message
