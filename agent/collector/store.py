"""Verdict storage for the collector: SQLite in WAL mode by default (embedded, no setup).

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
