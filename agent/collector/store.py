"""Verdict storage for the collector: SQLite in WAL mode by default (embedded, no setup),
PostgreSQL for several collector replicas serving a large fleet (``open_store(url)``).

One row per accepted verdict, unique by idempotency key (a retried send is stored once),
with the node, its time and the whole document. The "latest per node" and "per service"
views are computed from the newest verdict of each node.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    idem_key TEXT NOT NULL UNIQUE,
    node TEXT NOT NULL,
    time TEXT NOT NULL,
    status TEXT NOT NULL,
    received REAL NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS verdicts_node ON verdicts (node, id);
"""


class Store:
    def __init__(self, path: str | Path, retention_days: float = 14.0) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.retention = retention_days * 86400
        self._lock = threading.Lock()  # one writer; sqlite3 connections are per thread
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def add(self, verdicts: list[dict[str, Any]]) -> tuple[int, int]:
        """Store a batch in one transaction; returns (stored, duplicates)."""
        now = time.time()
        stored = 0
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for v in verdicts:
                    cur = self._db.execute(
                        "INSERT OR IGNORE INTO verdicts (idem_key, node, time, status, "
                        "received, doc) VALUES (?, ?, ?, ?, ?, ?)",
                        (v["idempotency_key"], v["node"], v["time"], v["status"], now,
                         json.dumps(v, separators=(",", ":"))))
                    stored += cur.rowcount
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return stored, len(verdicts) - stored

    def prune(self) -> int:
        with self._lock:
            cur = self._db.execute("DELETE FROM verdicts WHERE received < ? AND id NOT IN "
                                   "(SELECT MAX(id) FROM verdicts GROUP BY node)",
                                   (time.time() - self.retention,))
        return cur.rowcount

    def latest(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT doc FROM verdicts WHERE id IN (SELECT MAX(id) FROM verdicts "
                "GROUP BY node)").fetchall()
        return [json.loads(r[0]) for r in rows]

    def history(self, node: str, limit: int = 100) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT doc FROM verdicts WHERE node = ? ORDER BY id DESC "
                                    "LIMIT ?", (node, limit)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0])

    def close(self) -> None:
        self._db.close()


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (
    id BIGSERIAL PRIMARY KEY,
    idem_key TEXT NOT NULL UNIQUE,
    node TEXT NOT NULL,
    time TEXT NOT NULL,
    status TEXT NOT NULL,
    received DOUBLE PRECISION NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS verdicts_node ON verdicts (node, id);
"""


class PostgresStore(Store):
    """The same store on PostgreSQL (psycopg 3). Replicas share it: the unique key makes a
    verdict sent to two replicas (a retry) land once."""

    def __init__(self, url: str, retention_days: float = 14.0) -> None:
        import psycopg

        self.path = url
        self.retention = retention_days * 86400
        self._lock = threading.Lock()
        self._pg = psycopg.connect(url, autocommit=True)
        with self._pg.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(7710)")  # replicas starting together
            cur.execute(_PG_SCHEMA)
            cur.execute("SELECT pg_advisory_unlock(7710)")

    def add(self, verdicts: list[dict[str, Any]]) -> tuple[int, int]:
        now = time.time()
        stored = 0
        with self._lock, self._pg.transaction(), self._pg.cursor() as cur:
            for v in verdicts:
                cur.execute(
                    "INSERT INTO verdicts (idem_key, node, time, status, received, doc) "
                    "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (idem_key) DO NOTHING",
                    (v["idempotency_key"], v["node"], v["time"], v["status"], now,
                     json.dumps(v, separators=(",", ":"))))
                stored += cur.rowcount
        return stored, len(verdicts) - stored

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock, self._pg.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall() if cur.description else []

    def prune(self) -> int:
        with self._lock, self._pg.cursor() as cur:
            cur.execute("DELETE FROM verdicts WHERE received < %s AND id NOT IN "
                        "(SELECT MAX(id) FROM verdicts GROUP BY node)",
                        (time.time() - self.retention,))
            return cur.rowcount

    def latest(self) -> list[dict[str, Any]]:
        rows = self._rows("SELECT doc FROM verdicts WHERE id IN (SELECT MAX(id) FROM verdicts "
                          "GROUP BY node)")
        return [json.loads(r[0]) for r in rows]

    def history(self, node: str, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._rows("SELECT doc FROM verdicts WHERE node = %s ORDER BY id DESC LIMIT %s",
                          (node, limit))
        return [json.loads(r[0]) for r in rows]

    def count(self) -> int:
        return int(self._rows("SELECT COUNT(*) FROM verdicts")[0][0])

    def close(self) -> None:
        self._pg.close()


def open_store(url: str, retention_days: float = 14.0) -> Store:
    """sqlite:///PATH (or a plain path) or postgresql://..."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresStore(url, retention_days)
    path = url.removeprefix("sqlite://") if url.startswith("sqlite://") else url
    return Store(path, retention_days)
