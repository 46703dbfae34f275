"""Shipping against a real HTTP server on loopback: 2xx removes, 5xx/429 keep and back
off (Retry-After honoured), rejected verdicts are set aside, the token file is re-read."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.ship.sender import Backoff, Sender, drain
from agent.ship.spool import Spool


class Collector:
    """A scripted collector: answers from ``script`` (status, headers), then 200."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, str]]] = []
        self.received: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.reject_seq: set[int] = set()
        self.delay = 0.0  # seconds before answering: a slow collector
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(outer.delay)
                outer.auth.append(self.headers.get("Authorization"))
                status, headers = outer.script.pop(0) if outer.script else (200, {})
                if status == 200 and any(v.get("seq") in outer.reject_seq for v in body):
                    status = 422
                if status == 200:
                    outer.received.extend(body)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def spool_with(tmp_path: Path, n: int) -> Spool:
    s = Spool(tmp_path / "spool")
    for i in range(n):
        s.put({"seq": i, "node": "n1"})
    return s


def test_drain_sends_in_order_and_removes_after_2xx(tmp_path: Path,
                                                    collector: Collector) -> None:
    s = spool_with(tmp_path, 7)
    res = drain(s, Sender(collector.url), batch=3)
    assert res.sent == 7 and res.last is None and len(s) == 0
    assert [v["seq"] for v in collector.received] == list(range(7))
    assert len({v["idempotency_key"] for v in collector.received}) == 7


def test_server_errors_keep_everything_and_report_retry_after(tmp_path: Path,
                                                              collector: Collector) -> None:
    s = spool_with(tmp_path, 4)
    collector.script = [(200, {}), (503, {"Retry-After": "7"})]
    res = drain(s, Sender(collector.url), batch=2)
    assert res.sent == 2 and len(s) == 2
    assert res.last is not None and res.last.status == 503 and res.last.retry_after == 7.0
    assert Backoff(rng=random.Random(0)).next_delay(res.last.retry_after) >= 7.0
    collector.script = [(429, {"Retry-After": "1"})]
    assert drain(s, Sender(collector.url)).last.status == 429  # type: ignore[union-attr]
    assert drain(s, Sender(collector.url)).sent == 2 and len(s) == 0
    assert [v["seq"] for v in collector.received] == [0, 1, 2, 3]


def test_unreachable_collector_keeps_the_spool(tmp_path: Path) -> None:
    s = spool_with(tmp_path, 2)
    res = drain(s, Sender("http://127.0.0.1:9", timeout=1))
    assert res.sent == 0 and len(s) == 2 and "ConnectionError" in (res.last.error or "")


def test_a_rejected_verdict_is_set_aside_the_rest_delivered(tmp_path: Path,
                                                            collector: Collector) -> None:
    s = spool_with(tmp_path, 5)
    collector.reject_seq = {2}
    res = drain(s, Sender(collector.url), batch=5)
    assert res.sent == 4 and res.rejected == 1 and len(s) == 0
    assert [v["seq"] for v in collector.received] == [0, 1, 3, 4]
    assert len(list((tmp_path / "spool").glob("*.rejected"))) == 1 and s.rejected == 1


def test_token_file_is_sent_and_re_read_when_it_changes(tmp_path: Path,
                                                        collector: Collector) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    sender = Sender(collector.url, token_file=token)
    s = spool_with(tmp_path, 1)
    drain(s, sender)
    token.write_text("second-and-longer\n")
    s.put({"seq": 9})
    drain(s, sender)
    assert collector.auth == ["Bearer first", "Bearer second-and-longer"]


def test_backoff_grows_with_jitter_and_resets() -> None:
    b = Backoff(base=1, cap=60, rng=random.Random(1))
    delays = [b.next_delay() for _ in range(8)]
    assert all(0 <= d <= min(60, 2 ** i) for i, d in enumerate(delays))
    assert max(delays[5:]) > max(delays[:2])
    b.success()
    assert b.next_delay() <= 1


def test_a_slow_collector_times_out_and_the_spool_is_kept(tmp_path: Path,
                                                          collector: Collector) -> None:
    s = spool_with(tmp_path, 2)
    collector.delay = 1.5
    res = drain(s, Sender(collector.url, timeout=0.5))
    assert res.sent == 0 and len(s) == 2 and "Timeout" in (res.last.error or "")
    collector.delay = 0.0
    assert drain(s, Sender(collector.url)).sent == 2
    # the timed-out batch may have been stored too: the idempotency keys make that harmless
    keys = [v["idempotency_key"] for v in collector.received]
    assert len(set(keys)) == 2
