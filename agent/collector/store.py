"""Verdict storage for the collector: SQLite in WAL mode by default (embedded, no setup),
PostgreSQL for several collector replicas serving a large fleet (``open_store(url)``).

One row per accepted verdict, unique by idempotency key (a retried send is stored once),
with the node, its time and the whole document. Next to it, written in the same
transaction, each node's summary (``nodes``: status, counts; ``node_findings``: the
Services and LB IPs of its serious findings) from its newest verdict: the fleet views
read only these, a page at a time, and never parse a stored document. A database written
by an older collector gets its summaries on open (one document per node is parsed).

Documents are stored once per node and content (``documents``: gzipped, keyed by the
fingerprint of agent.collector.docs): a verdict re-sent unchanged at every heartbeat adds
a history row of a few hundred bytes (its time, key and where they go), not the
document. Schema 3 added that; a schema-2 database is migrated on open (columns and a
table added; its rows keep their text in ``verdicts.doc`` and are served from it until
pruned). Pruning drops documents no row refers to any more.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agent.collector import docs
from agent.collector.intake import MAX_INFLATED, dump
from agent.collector.summary import NodeSummary, summarize
from agent.ship import gz

SCHEMA_VERSION = 3
HISTORY_BYTES = 16 * 1024 * 1024  # one history reply holds at most this much document text

# Written once with "?" placeholders; PostgreSQL's driver wants "%s" (no literal "?" or
# "%" appears in these statements).
_TABLES = """
CREATE TABLE IF NOT EXISTS verdicts (
    id {serial} PRIMARY KEY,
    idem_key TEXT NOT NULL UNIQUE,
    node TEXT NOT NULL,
    time TEXT NOT NULL,
    status TEXT NOT NULL,
    received {double} NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS verdicts_node ON verdicts (node, id);
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY,
    verdict_id {bigint} NOT NULL,
    rank INTEGER NOT NULL,
    status TEXT NOT NULL,
    time TEXT NOT NULL,
    kube_proxy_mode TEXT NOT NULL,
    findings INTEGER NOT NULL,
    ids TEXT NOT NULL,
    unknowns INTEGER NOT NULL,
    lb_ips INTEGER NOT NULL,
    lb_ips_local INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS nodes_worst_first ON nodes (rank, findings DESC, node);
CREATE TABLE IF NOT EXISTS node_findings (
    node TEXT NOT NULL,
    service TEXT NOT NULL,
    lb_ip TEXT NOT NULL,
    finding_id TEXT NOT NULL,
    observed INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS node_findings_node ON node_findings (node);
CREATE INDEX IF NOT EXISTS node_findings_key ON node_findings (service, lb_ip);
CREATE TABLE IF NOT EXISTS collector_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

# schema 3: one row per distinct document of a node, gzipped; ``size``: its body's bytes
# (the bound when it is inflated again); ``schema``: the verdict schema it was validated
# against (NULL: not known, e.g. stored by Store.add directly)
_DOCUMENTS = """
CREATE TABLE IF NOT EXISTS documents (
    id {serial} PRIMARY KEY,
    node TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    size {bigint} NOT NULL,
    body {blob} NOT NULL,
    schema TEXT,
    UNIQUE (node, fingerprint)
);
CREATE INDEX IF NOT EXISTS verdicts_doc ON verdicts (doc_id);
"""
# added to verdicts by schema 3 (NULL in the rows of a schema-2 database, whose text is
# in ``doc``; new rows leave ``doc`` empty): the document, the frame that puts this
# POST's time and key back into it, and the served text's length (the history budget)
_VERDICT_COLUMNS = (("doc_id", "{bigint}"), ("frame", "TEXT"), ("size", "{bigint}"))

# Stored documents (gzipped) one node may hold (issue 35, item 5: one client grew the
# database ~10 MiB/s with distinct large verdicts, the default 2Gi volume full in
# minutes): past it the node's oldest history goes first, its newest verdict never.
NODE_QUOTA = 64 * 1024 * 1024

_NODE_COLUMNS = ("node", "status", "time", "kube_proxy_mode", "findings", "ids", "unknowns",
                 "lb_ips", "lb_ips_local")

# what an old stored document may hold that strict JSON may not (NaN, Infinity, escaped
# lone surrogates): only such documents are parsed and cleaned before they are served
_SUSPECT = re.compile(r"NaN|Infinity|\\u[dD][89a-fA-F]|[\ud800-\udfff]")


def clean_document(text: str) -> str:
    """A stored document as strict JSON: as is, unless an older collector stored NaN,
    Infinity or a lone surrogate in it (those become null and U+FFFD)."""
    if _SUSPECT.search(text) is None:
        return text
    from agent.collector.intake import replace_lone_surrogates

    doc = json.loads(text, parse_constant=lambda _: None)
    doc = _finite(replace_lone_surrogates(doc)[0])
    return dump(doc)


def _finite(doc: Any) -> Any:
    if isinstance(doc, float) and doc in (float("inf"), float("-inf")):
        return None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_finite(v) for v in doc]
    return doc


class Store:
    """SQLite. One connection (writes are serialized anyway), used under a lock."""

    _placeholder = "?"
    _order_node = "node"  # SQLite compares TEXT as UTF-8 bytes: code point order
    _position = "instr"  # where a string is in another, 1-based (0: not in it)

    def __init__(self, path: str | Path, retention_days: float = 14.0,
                 node_quota: int = NODE_QUOTA) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.retention = retention_days * 86400
        self.node_quota = node_quota
        self.quota_pruned = 0  # history rows removed for the quota, since start
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a verdict acknowledged with 200 is on disk (the WAL is fsynced at every
        # commit); NORMAL could lose the last ones in a power cut after the agent deleted
        # them from its spool. Measured here: +0.3 ms per commit (p99 4 ms).
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=10000")
        types = {"serial": "INTEGER", "bigint": "INTEGER", "double": "REAL", "blob": "BLOB"}
        self._db.executescript(_TABLES.format(**types).replace(
            "id INTEGER PRIMARY KEY", "id INTEGER PRIMARY KEY AUTOINCREMENT"))
        self._migrate(types)
        self._reconcile()

    # -- the backend: SQL with "?" placeholders, one transaction at a time -------------

    def _sql(self, sql: str) -> str:
        return sql if self._placeholder == "?" else sql.replace("?", self._placeholder)

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(self._sql(sql), args).fetchall()

    @staticmethod
    def _run(tx: Any, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return tx.execute(sql, args).fetchall()

    # -- writing -----------------------------------------------------------------------

    def add(self, verdicts: list[dict[str, Any]], bodies: dict[int, docs.Body] | None = None,
            schema: str | None = None, stored_docs: set[int] | None = None) -> tuple[int, int]:
        """Store a batch in one transaction; returns (stored, duplicates). Each verdict
        that is the newest of its node replaces the node's summary. ``bodies``: each
        verdict's docs.Body by id() when the caller made it already; ``schema``: the tag
        of the verdict schema the caller validated them against; ``stored_docs``: the id()
        of each verdict whose body in ``bodies`` the caller found stored (known()): not
        looked up again (a stored one pruned since is stored again in the transaction)."""
        now = time.time()
        stored = 0
        octets = self._placeholder != "?"  # the served text's length as history counts it
        # bodies, frames, summaries and the gzip of new documents are made before the
        # transaction: it stays short
        rows = []
        for v in verdicts:
            body = (bodies or {}).get(id(v))
            if body is None or body.keys != tuple(v):  # e.g. an idempotency key added since
                body = docs.split(v)
                known, _ = self.known(v["node"], body.fingerprint)
            else:
                known = id(v) in stored_docs if stored_docs is not None else \
                    self.known(v["node"], body.fingerprint)[0]
            packed = None if known else gz.compress(body.text)
            rows.append((v, body, packed, docs.frame(v, body),
                         docs.served_size(v, body, octets), summarize(v)))
        insert = self._sql("INSERT INTO verdicts (idem_key, node, time, status, received, doc, "
                           "doc_id, frame, size) VALUES (?, ?, ?, ?, ?, '', ?, ?, ?) "
                           "ON CONFLICT (idem_key) DO NOTHING RETURNING id")
        with self._tx() as tx:
            self._doc_lock(tx, exclusive=False)
            for v, body, packed, frame, size, summary in rows:
                doc_id = self._document(tx, v["node"], body, packed, schema)
                got = self._run(tx, insert, (v["idempotency_key"], v["node"], v["time"],
                                             v["status"], now, doc_id, frame, size))
                if got:
                    stored += 1
                    self._put_summary(tx, int(got[0][0]), summary)
            for node in {v["node"] for v, _, packed, *_ in rows if packed is not None}:
                self.quota_pruned += self._within_quota(tx, node)
        return stored, len(verdicts) - stored

    def _within_quota(self, tx: Any, node: str) -> int:
        """The node's oldest history removed (its newest verdict kept) until its stored
        documents fit the quota; the rows removed."""
        size = self._length("body")
        total = int(self._run(tx, self._sql(f"SELECT COALESCE(SUM({size}), 0) FROM documents "
                                            "WHERE node = ?"), (node,))[0][0])
        if total <= self.node_quota:
            return 0
        rows = self._run(tx, self._sql(
            "SELECT id, doc_id FROM verdicts WHERE node = ? AND id NOT IN "
            "(SELECT verdict_id FROM nodes WHERE node = ?) ORDER BY id"), (node, node))
        removed = 0
        for vid, doc_id in rows:
            if total <= self.node_quota:
                break
            self._run(tx, self._sql("DELETE FROM verdicts WHERE id = ? RETURNING id"), (vid,))
            removed += 1
            if doc_id is None:
                continue
            gone = self._run(tx, self._sql(
                f"DELETE FROM documents WHERE id = ? AND NOT EXISTS (SELECT 1 FROM verdicts "
                f"WHERE doc_id = ?) RETURNING {size}"), (doc_id, doc_id))
            if gone:
                total -= int(gone[0][0])
        return removed

    def _document(self, tx: Any, node: str, body: docs.Body, packed: bytes | None,
                  schema: str | None) -> int:
        """The id of the node's document with this body: the stored one, else stored now.
        Scoped by node: a fingerprint never reaches another node's document."""
        find = self._sql("SELECT id FROM documents WHERE node = ? AND fingerprint = ?")
        got = self._run(tx, find, (node, body.fingerprint))
        if not got:
            if packed is None:  # pruned since it was looked up (rare)
                packed = gz.compress(body.text)
            got = self._run(tx, self._sql(
                "INSERT INTO documents (node, fingerprint, size, body, schema) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (node, fingerprint) DO NOTHING "
                "RETURNING id"), (node, body.fingerprint, len(body.text), packed, schema))
            # a replica inserting the same one meanwhile: its row, committed, is found now
            got = got or self._run(tx, find, (node, body.fingerprint))
        doc_id = int(got[0][0])
        if schema is not None:
            self._run(tx, self._sql("UPDATE documents SET schema = ? WHERE id = ? AND "
                                    "(schema IS NULL OR schema <> ?)"),
                      (schema, doc_id, schema))
        return doc_id

    def known(self, node: str, fingerprint: str) -> tuple[bool, str | None]:
        """(is this node's document with this fingerprint stored, the tag of the schema
        it was validated against)."""
        got = self._rows("SELECT schema FROM documents WHERE node = ? AND fingerprint = ?",
                         (node, fingerprint))
        return (True, got[0][0]) if got else (False, None)

    def _doc_lock(self, tx: Any, exclusive: bool) -> None:
        """Adding (shared) against pruning documents (exclusive): SQLite has one writer
        at a time anyway; PostgreSQL replicas take an advisory lock."""

    def _put_summary(self, tx: Any, verdict_id: int, s: NodeSummary) -> None:
        cols = ("node", "verdict_id", "rank", *_NODE_COLUMNS[1:])
        values = (s.node, verdict_id, s.rank, s.status, s.time, s.kube_proxy_mode, s.findings,
                  json.dumps(list(s.ids)), s.unknowns, s.lb_ips, s.lb_ips_local)
        updates = ", ".join(f"{c} = excluded.{c}" for c in cols[1:])
        # the guard keeps the newest: two PostgreSQL replicas may commit out of id order
        newer = self._run(tx, self._sql(
            f"INSERT INTO nodes ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
            f"ON CONFLICT (node) DO UPDATE SET {updates} "
            "WHERE nodes.verdict_id < excluded.verdict_id RETURNING node"), values)
        if not newer:
            return
        self._run(tx, self._sql("DELETE FROM node_findings WHERE node = ?"), (s.node,))
        for r in s.rows:
            self._run(tx, self._sql("INSERT INTO node_findings (node, service, lb_ip, "
                                    "finding_id, observed) VALUES (?, ?, ?, ?, ?)"),
                      (s.node, r.service, r.lb_ip, r.finding_id, int(r.observed)))

    def _reconcile(self) -> None:
        """Summaries for nodes whose newest verdict has none: every node of a database
        written by an older collector (parsing one document per node, one at a time)."""
        stale = self._rows("SELECT v.node, v.id FROM (SELECT node, MAX(id) AS id FROM "
                           "verdicts GROUP BY node) v LEFT JOIN nodes n ON n.node = v.node "
                           "WHERE n.verdict_id IS NULL OR n.verdict_id < v.id")
        for node, vid in stale:
            try:
                v = json.loads(self._text(int(vid), clean=False))  # an old row may hold NaN
            except ValueError:
                continue
            if isinstance(v, dict):
                with self._tx() as tx:
                    self._put_summary(tx, int(vid), summarize({**v, "node": node}))
        with self._tx() as tx:
            self._run(tx, self._sql(
                "INSERT INTO collector_meta (key, value) VALUES ('schema', ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value"),
                (str(SCHEMA_VERSION),))

    def _migrate(self, types: dict[str, str]) -> None:
        """Schema 2 -> 3 in place (nothing is rewritten: new columns are NULL in old
        rows, which are served from their ``doc`` text as before)."""
        have = self._columns("verdicts")
        for name, kind in _VERDICT_COLUMNS:
            if name not in have:
                self._rows(f"ALTER TABLE verdicts ADD COLUMN {name} {kind.format(**types)}")
        for statement in _DOCUMENTS.format(**types).split(";"):
            if statement.strip():
                self._rows(statement)

    def _columns(self, table: str) -> set[str]:
        return {str(r[1]) for r in self._rows(f"PRAGMA table_info({table})")}

    def prune(self) -> int:
        """History older than the retention (each node's newest verdict kept), then the
        documents no row refers to any more. Returns the history rows removed."""
        with self._tx() as tx:
            self._doc_lock(tx, exclusive=True)
            cur = tx.execute(self._sql("DELETE FROM verdicts WHERE received < ? AND id NOT IN "
                                       "(SELECT verdict_id FROM nodes)"),
                             (time.time() - self.retention,))
            removed = int(cur.rowcount)
            tx.execute("DELETE FROM documents WHERE NOT EXISTS "
                       "(SELECT 1 FROM verdicts v WHERE v.doc_id = documents.id)")
            return removed

    # -- the fleet views: summaries only, a page at a time -------------------------------

    def status_counts(self) -> dict[str, int]:
        return {s: int(n) for s, n in
                self._rows("SELECT status, COUNT(*) FROM nodes GROUP BY status")}

    def node_total(self) -> int:
        return int(self._rows("SELECT COUNT(*) FROM nodes")[0][0])

    def last_seen(self, limit: int, gone_before: float = 0.0) -> list[tuple[str, float]]:
        """(node, when its newest verdict was received), the longest silent first: the
        ones an alert wants when only ``limit`` of them can be exported. Nodes silent
        since before ``gone_before`` (taken as removed: every node is kept) come last, or
        on a cluster whose nodes come and go they would fill the cap."""
        return [(str(n), float(t)) for n, t in self._rows(
            "SELECT node, received FROM (SELECT n.node AS node, v.received AS received "
            "FROM nodes n JOIN verdicts v ON v.id = n.verdict_id) s "
            "ORDER BY CASE WHEN received < ? THEN 1 ELSE 0 END, "
            f"received, {self._order_node} LIMIT ?", (gone_before, limit))]

    def nodes(self, limit: int, offset: int = 0, **filters: str | None
              ) -> list[dict[str, Any]]:
        """Latest summary per node, worst first; ``filters`` (status, finding, service,
        lb_ip: ``_where``) keep the nodes that match all of them."""
        where, args = self._where(**filters)
        rows = self._rows(f"SELECT {', '.join(_NODE_COLUMNS)} FROM nodes{where} ORDER BY "
                          f"rank, findings DESC, {self._order_node} LIMIT ? OFFSET ?",
                          (*args, limit, offset))
        out = []
        for r in rows:
            d = dict(zip(_NODE_COLUMNS, r, strict=True))
            try:
                d["ids"] = [str(i) for i in json.loads(d["ids"])]
            except (TypeError, ValueError):
                d["ids"] = []
            out.append(d)
        return out

    def node_count(self, **filters: str | None) -> int:
        where, args = self._where(**filters)
        return int(self._rows(f"SELECT COUNT(*) FROM nodes{where}", args)[0][0])

    def _where(self, status: str | None = None, finding: str | None = None,
               service: str | None = None, lb_ip: str | None = None
               ) -> tuple[str, tuple[Any, ...]]:
        clauses: list[str] = []
        args: list[Any] = []
        if status:
            clauses.append("status = ?")
            args.append(status)
        if finding:
            # ``ids`` holds the JSON array of the node's finding ids: the id's JSON string,
            # quotes included, is in it exactly when the id is (no LIKE: no wildcard, and
            # the same case-sensitive answer from SQLite and PostgreSQL)
            clauses.append(f"{self._position}(ids, ?) > 0")
            args.append(json.dumps(finding))
        keys = [(c, v) for c, v in (("service", service), ("lb_ip", lb_ip)) if v]
        if keys:
            clauses.append("node IN (SELECT node FROM node_findings WHERE "
                           + " AND ".join(f"{c} = ?" for c, _ in keys) + ")")
            args += [v for _, v in keys]
        return (" WHERE " + " AND ".join(clauses) if clauses else ""), tuple(args)

    def finding_counts(self) -> list[tuple[str, int]]:
        """Each finding id of the fleet's latest verdicts and on how many nodes, most first
        (one row per distinct set of ids: a fleet has few)."""
        counts: dict[str, int] = {}
        for ids, n in self._rows("SELECT ids, COUNT(*) FROM nodes GROUP BY ids"):
            try:
                for i in set(json.loads(ids)):
                    counts[str(i)] = counts.get(str(i), 0) + int(n)
            except (TypeError, ValueError):
                continue
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))

    def node_status(self, node: str) -> dict[str, Any] | None:
        """The node's latest status, time and kube-proxy mode; None for a node not held."""
        row = self._rows("SELECT status, time, kube_proxy_mode FROM nodes WHERE node = ?",
                         (node,))
        return dict(zip(("status", "time", "kube_proxy_mode"), row[0], strict=True)) \
            if row else None

    def status_history(self, node: str, limit: int) -> tuple[list[tuple[str, str]], int]:
        """(time, status) of the node's newest ``limit`` verdicts, oldest first, and how
        many it has in all (the columns alone: no document is read)."""
        rows = self._rows("SELECT time, status FROM verdicts WHERE node = ? ORDER BY id DESC "
                          "LIMIT ?", (node, limit))
        total = int(self._rows("SELECT COUNT(*) FROM verdicts WHERE node = ?",
                               (node,))[0][0])
        return [(str(t), str(st)) for t, st in reversed(rows)], total

    _SERVICES = """
        SELECT service, lb_ip,
               COUNT(DISTINCT CASE WHEN observed = 1 THEN node END) AS n_observed,
               COUNT(DISTINCT CASE WHEN observed = 0 THEN node END) AS n_exposed
        FROM node_findings GROUP BY service, lb_ip"""

    def service_total(self) -> int:
        return int(self._rows(f"SELECT COUNT(*) FROM ({self._SERVICES}) s")[0][0])

    def services(self, limit: int, offset: int = 0,
                 max_nodes: int | None = None) -> list[dict[str, Any]]:
        """Per Service / LB IP: the nodes exposing it and those where loopback was
        observed (each list at most ``max_nodes`` long; the counts are always whole)."""
        keys = self._rows(f"{self._SERVICES} ORDER BY n_observed DESC, n_exposed DESC, "
                          f"{self._order('service')}, {self._order('lb_ip')} "
                          "LIMIT ? OFFSET ?", (limit, offset))
        out = []
        for service, lb_ip, n_obs, n_exp in keys:
            row: dict[str, Any] = {"service": service or None, "lb_ip": lb_ip or None,
                                   "exposed_nodes": [], "observed_nodes": [],
                                   "exposed_count": int(n_exp), "observed_count": int(n_obs)}
            for observed, field in ((1, "observed_nodes"), (0, "exposed_nodes")):
                cap = "" if max_nodes is None else f" LIMIT {int(max_nodes)}"
                row[field] = [n for (n,) in self._rows(
                    "SELECT node FROM node_findings WHERE service = ? AND lb_ip = ? "
                    f"AND observed = ? GROUP BY node ORDER BY {self._order_node}{cap}",
                    (service, lb_ip, observed))]
            row["ids"] = [i for (i,) in self._rows(
                "SELECT finding_id FROM node_findings WHERE service = ? AND lb_ip = ? "
                f"GROUP BY finding_id ORDER BY {self._order('finding_id')}", (service, lb_ip))]
            out.append(row)
        return out

    def _order(self, column: str) -> str:
        return column

    # -- one node's history: stored text, never parsed unless an old row needs it --------

    def history(self, node: str, limit: int = 100, before: int | None = None,
                max_bytes: int = HISTORY_BYTES) -> tuple[list[str], int | None]:
        """Newest first: the documents (JSON text) and, when more remain, the id to pass
        as ``before`` for the next page. At most ``max_bytes`` of text (at least one)."""
        where = "node = ?" + (" AND id < ?" if before is not None else "")
        args: tuple[Any, ...] = (node, before) if before is not None else (node,)
        sizes = self._rows(f"SELECT id, COALESCE(size, {self._length('doc')}) FROM verdicts "
                           f"WHERE {where} ORDER BY id DESC LIMIT ?", (*args, limit + 1))
        ids: list[int] = []
        texts: list[str] = []
        total = 0
        for vid, size in sizes[:limit]:
            if ids and total + int(size) > max_bytes:
                break
            ids.append(int(vid))
            total += int(size)
        more = len(ids) < len(sizes)
        for vid in ids:  # one at a time: a page never holds more than its budget
            texts.append(self._text(vid))
        return texts, (ids[-1] if more and ids else None)

    def _text(self, vid: int, clean: bool = True) -> str:
        """A history row's served text: its own (schema 2) or its document's, inflated at
        most to the size it was stored with (and never past what a verdict may be), with
        its time and key put back. A document that does not read back (the database was
        damaged or written to by something else) is served as an error object saying so."""
        node, when, key, doc, frame, body, size = self._rows(
            "SELECT v.node, v.time, v.idem_key, v.doc, v.frame, d.body, d.size "
            "FROM verdicts v LEFT JOIN documents d ON d.id = v.doc_id WHERE v.id = ?",
            (vid,))[0]
        if frame is None:
            return clean_document(doc) if clean else doc
        try:
            if body is None:
                raise ValueError("its document is missing")
            data = gz.inflate(bytes(body), min(int(size), MAX_INFLATED))
            if len(data) != int(size):
                raise ValueError(f"{len(data)} bytes, stored as {size}")
            text = docs.join(data.decode(), frame)
            del data
        except ValueError as e:  # GzipError, UnicodeDecodeError and a bad frame are too
            return dump({"node": node, "time": when, "idempotency_key": key,
                         "error": f"stored document unreadable: {e}"[:300]})
        return text  # (validated strictly before it was stored: nothing to clean)

    def _length(self, column: str) -> str:
        return f"length({column})"

    def count(self) -> int:
        return int(self._rows("SELECT COUNT(*) FROM verdicts")[0][0])

    def ping(self) -> None:
        """A cheap read: the database answers (for /healthz)."""
        self._rows("SELECT 1 FROM collector_meta LIMIT 1")

    def close(self) -> None:
        self._db.close()


class PostgresStore(Store):
    """The same store on PostgreSQL (psycopg 3). Replicas share it: the unique key makes a
    verdict sent to two replicas (a retry) land once."""

    _placeholder = "%s"
    _order_node = 'node COLLATE "C"'  # code point order, as SQLite and Python sort
    _position = "strpos"

    def __init__(self, url: str, retention_days: float = 14.0,
                 node_quota: int = NODE_QUOTA) -> None:
        import psycopg

        self.path = url
        self.retention = retention_days * 86400
        self.node_quota = node_quota
        self.quota_pruned = 0
        self._lock = threading.Lock()
        self._pg = psycopg.connect(url, autocommit=True)
        with self._pg.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(7710)")  # replicas starting together
            try:
                types = {"serial": "BIGSERIAL", "bigint": "BIGINT",
                         "double": "DOUBLE PRECISION", "blob": "BYTEA"}
                cur.execute(_TABLES.format(**types))
                self._migrate(types)
                self._reconcile()
            finally:
                cur.execute("SELECT pg_advisory_unlock(7710)")

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._lock, self._pg.transaction(), self._pg.cursor() as cur:
            yield cur

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock, self._pg.cursor() as cur:
            cur.execute(self._sql(sql), args)
            return cur.fetchall() if cur.description else []

    @staticmethod
    def _run(tx: Any, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        tx.execute(sql, args)
        return tx.fetchall() if tx.description else []

    def _order(self, column: str) -> str:
        return f'{column} COLLATE "C"'

    def _columns(self, table: str) -> set[str]:
        return {str(r[0]) for r in self._rows(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
            "AND table_schema = current_schema()", (table,))}

    def _doc_lock(self, tx: Any, exclusive: bool) -> None:
        # held to the end of the transaction: a prune waits for the adds in progress
        # (which may refer to a document it would find unreferenced) and they for it
        fn = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
        self._run(tx, f"SELECT {fn}(7711)", ())

    def _length(self, column: str) -> str:
        return f"octet_length({column})"

    def close(self) -> None:
        self._pg.close()


def open_store(url: str, retention_days: float = 14.0, node_quota: int = NODE_QUOTA
               ) -> Store:
    """sqlite:///PATH (or a plain path) or postgresql://..."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresStore(url, retention_days, node_quota)
    path = url.removeprefix("sqlite://") if url.startswith("sqlite://") else url
    return Store(path, retention_days, node_quota)
