"""Shipping against a real HTTP server on loopback: 2xx removes, 5xx/429 keep and back
off (Retry-After honoured), rejected verdicts are set aside, the token file is re-read."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.cli import build_parser
from agent.ship.auth import KUBE_TOKEN_AUDIENCE, KUBE_TOKEN_FILE
from agent.ship.sender import Backoff, Sender, TokenFile, drain
from agent.ship.spool import Spool
from tests.fifo import blocked_writer


class Collector:
    """A scripted collector: answers from ``script`` (status, headers), then 200. As the
    collector before gzip did, by default: a gzip body is not JSON, so 400, and no
    Accept-Encoding; ``takes_gzip`` makes it inflate gzip bodies and say so."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, str]]] = []
        self.received: list[dict[str, Any]] = []
        self.bodies: list[tuple[int, str | None]] = []  # (bytes on the wire, coding)
        self.wire: list[bytes] = []  # each body, inflated
        self.sent: list[bytes] = []  # each body as it came
        self.takes_gzip = False
        self.auth: list[str | None] = []
        self.reject_seq: set[int] = set()
        self.delay = 0.0  # seconds before answering: a slow collector
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                wire = self.rfile.read(int(self.headers["Content-Length"]))
                outer.sent.append(wire)
                coding = self.headers.get("Content-Encoding")
                outer.bodies.append((len(wire), coding))
                time.sleep(outer.delay)
                outer.auth.append(self.headers.get("Authorization"))
                status, headers = outer.script.pop(0) if outer.script else (200, {})
                if outer.takes_gzip:
                    headers = {**headers, "Accept-Encoding": "gzip"}
                    if coding == "gzip":
                        wire = gzip.decompress(wire)
                try:
                    body = json.loads(wire)
                except ValueError:
                    body, status = [], 400  # what the old intake said to a gzip body
                outer.wire.append(wire)
                if isinstance(body, dict):  # a verdict alone, as the collector takes it
                    body = [body]
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


# -- the bearer token: modes, rotation, files that are not tokens --------------------------


def kubelet_token_dir(directory: Path, token: str, stamp: int) -> Path:
    """A projected token laid out as the kubelet's AtomicWriter does: the file is
    ..data/token through a symlink, ..data a symlink to a timestamped directory, swapped
    atomically (rename of a new symlink over it) on every refresh."""
    directory.mkdir(exist_ok=True)
    version = directory / f"..2026_01_01_00_00_{stamp:02d}.{stamp}"
    version.mkdir()
    (version / "token").write_text(token)
    os.utime(version / "token", ns=(10**18, 10**18))  # same mtime for every version
    tmp = directory / "..data_tmp"
    tmp.symlink_to(version.name)
    os.replace(tmp, directory / "..data")
    if not (directory / "token").is_symlink():
        (directory / "token").symlink_to("..data/token")
    return directory / "token"


def test_a_projected_token_refreshed_by_the_kubelet_is_sent(tmp_path: Path,
                                                             collector: Collector) -> None:
    # Two JWT-like tokens of the same length and mtime: only the file behind the
    # symlinks changed. Today the (mtime, size) stamp missed it and the old token went on
    # being sent until it expired (401 from then on).
    first, second = "eyJ.first-token.sig", "eyJ.other-token.sig"
    assert len(first) == len(second)
    token = kubelet_token_dir(tmp_path / "projected", first, 1)
    sender = Sender(collector.url, token_file=token)
    s = spool_with(tmp_path, 1)
    drain(s, sender)
    kubelet_token_dir(tmp_path / "projected", second, 2)
    s.put({"seq": 9})
    drain(s, sender)
    assert collector.auth == [f"Bearer {first}", f"Bearer {second}"]


def test_a_refused_token_is_read_again(tmp_path: Path, collector: Collector) -> None:
    # Rewritten in place with the same size and mtime (a coarse-timestamp filesystem):
    # nothing tells the change but the collector's 401; the next attempt re-reads.
    token = tmp_path / "token"
    token.write_text("old-token")
    sender = Sender(collector.url, token_file=token)
    s = spool_with(tmp_path, 1)
    drain(s, sender)
    st = token.stat()
    with token.open("r+") as f:
        f.write("new-token")
    os.utime(token, ns=(st.st_atime_ns, st.st_mtime_ns))
    s.put({"seq": 9})
    collector.script = [(401, {})]
    assert drain(s, sender).last.status == 401  # type: ignore[union-attr]
    assert drain(s, sender).sent == 1
    assert collector.auth == ["Bearer old-token", "Bearer old-token", "Bearer new-token"]


def test_a_missing_token_is_not_sent_without_one(tmp_path: Path,
                                                 collector: Collector) -> None:
    # Today the verdicts went out without Authorization: refused (401), or accepted by a
    # collector without a token, while the agent was configured to authenticate.
    s = spool_with(tmp_path, 2)
    res = drain(s, Sender(collector.url, token_file=tmp_path / "absent"))
    assert res.sent == 0 and len(s) == 2 and collector.auth == []
    assert res.last is not None and "no bearer token" in (res.last.error or "")
    assert str(tmp_path / "absent") in (res.last.error or "")


_READ_TOKEN = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))
from agent.ship.sender import TokenFile
t = TokenFile(sys.argv[1])
print(repr(t.token()), t.problem)
"""


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "binary"])
def test_a_token_file_that_is_not_a_token_neither_blocks_nor_floods(tmp_path: Path,
                                                                    kind: str) -> None:
    # In a child with a time and an address-space limit. Today: the FIFO blocked the
    # shipping forever, /dev/zero was read until memory ran out (MemoryError, exit 70).
    token = tmp_path / "token"
    if kind == "fifo":
        os.mkfifo(token)
    elif kind == "dev-zero":
        token.symlink_to("/dev/zero")
    elif kind == "directory":
        token.mkdir()
    else:
        token.write_bytes(b"\x00\xff token\nwith lines")
    try:
        proc = subprocess.run([sys.executable, "-c", _READ_TOKEN, str(token)],
                              capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading a {kind} as the token file blocked")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("None token file "), proc.stdout


def test_a_fifo_as_the_token_file_is_never_opened(tmp_path: Path) -> None:
    """Its type is read before any open (opening a device may act: a watchdog arms).
    Seen on a FIFO: a writer blocked in open() is released by any reader's open."""
    token = tmp_path / "token"
    with blocked_writer(token) as released:
        tf = TokenFile(token)
        assert tf.token() is None and tf.problem == f"token file {token}: not a regular file"
        assert not released.wait(0.5), "the token FIFO was opened for reading"


def test_batches_are_bounded_in_bytes_and_read_lazily(tmp_path: Path,
                                                      collector: Collector) -> None:
    s = Spool(tmp_path / "spool")
    for i in range(12):
        s.put({"seq": i, "pad": "p" * 300_000})
    res = drain(s, Sender(collector.url), batch=50, batch_bytes=1_000_000)
    assert res.sent == 12 and [v["seq"] for v in collector.received] == list(range(12))
    sizes = [n for n, _ in collector.bodies]
    assert len(sizes) == 4 and max(sizes) < 1_000_000 + 1000


def test_drain_never_posts_what_a_symlink_points_at(tmp_path: Path,
                                                    collector: Collector) -> None:
    s = spool_with(tmp_path, 1)
    secret = tmp_path / "secret.json"
    secret.write_text('{"idempotency_key": "k", "password": "hunter2"}')
    (s.dir / "99999999999999999999-leak.json").symlink_to(secret)
    res = drain(s, Sender(collector.url))
    assert res.sent == 1 and s.corrupt == 1
    assert "hunter2" not in json.dumps(collector.received)


# -- choosing the mode on the command line / in the environment -----------------------------


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, ("shared-token", None)),
    (["--token-file", "/s/token"], {}, ("shared-token", "/s/token")),
    (["--collector-auth", "kube-token"], {}, ("kube-token", KUBE_TOKEN_FILE)),
    (["--collector-auth", "kube-token", "--token-file", "/t"], {}, ("kube-token", "/t")),
    (["--token-file", "/t", "--collector-auth", "kube-token"], {}, ("kube-token", "/t")),
    ([], {"LOOPBACK_AGENT_COLLECTOR_AUTH": "kube-token"}, ("kube-token", KUBE_TOKEN_FILE)),
    ([], {"LOOPBACK_AGENT_COLLECTOR_AUTH": "kube-token", "LOOPBACK_AGENT_TOKEN_FILE": "/e"},
     ("kube-token", "/e")),
    (["--collector-auth", "shared-token"], {"LOOPBACK_AGENT_COLLECTOR_AUTH": "kube-token"},
     ("shared-token", None)),
])
def test_collector_auth_picks_the_token_file(argv: list[str], env: dict[str, str],
                                             expected: tuple[str, str | None],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOOPBACK_AGENT_COLLECTOR_AUTH", "LOOPBACK_AGENT_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["run", *argv])
    assert (args.collector_auth, args.token_file) == expected
    assert KUBE_TOKEN_AUDIENCE == "loopback-agent-collector"


def test_a_bad_collector_auth_is_a_usage_error() -> None:
    for env, argv in (({"LOOPBACK_AGENT_COLLECTOR_AUTH": "jwt"}, ["run", "--help"]),
                      ({}, ["run", "--collector-auth", "jwt"])):
        r = subprocess.run([sys.executable, "-m", "agent", *argv], capture_output=True,
                           text=True, env={**os.environ, **env}, timeout=60)
        assert r.returncode == 64 and "'jwt' is not one of shared-token, kube-token" \
            in r.stderr
        assert "Traceback" not in r.stderr


# -- gzip: only to a collector that says it takes it; never a verdict lost over it --------


def big_verdict(i: int, mib: int = 5) -> dict[str, Any]:
    """Over the collector's 4 MiB as plain JSON, under 1 MB gzipped (a 10k-service
    verdict: 21 MB, 1.5 MB)."""
    return {"seq": i, "node": "n1", "rows": [f"svc-{j} 10.0.{j % 250}.1" for j in
                                              range(mib * 1024 * 1024 // 20)]}


def test_gzip_only_once_the_collector_says_it_takes_it(tmp_path: Path,
                                                       collector: Collector) -> None:
    collector.takes_gzip = True
    s = spool_with(tmp_path, 3)
    res = drain(s, Sender(collector.url), batch=1)
    assert res.sent == 3 and [v["seq"] for v in collector.received] == [0, 1, 2]
    # the first reply said Accept-Encoding: gzip; nothing before it is gzipped
    assert [c for _, c in collector.bodies] == [None, "gzip", "gzip"]


def test_a_verdict_alone_goes_as_its_spool_file(tmp_path: Path, collector: Collector) -> None:
    """A gzipped verdict that goes alone (a big node's always does) is posted as the spool
    wrote it, not inflated and deflated again; several still go as one array."""
    collector.takes_gzip = True
    s = Spool(tmp_path / "spool")
    big = big_verdict(0)
    big["idempotency_key"] = s.put(big)  # (put adds it to what it stores)
    files = [p.read_bytes() for p in sorted((tmp_path / "spool").iterdir())]
    sender = Sender(collector.url)
    res = drain(s, sender, batch=1)
    assert res.sent == 1 and collector.received[0]["seq"] == 0
    assert collector.sent == files and collector.bodies[0][1] == "gzip"
    assert json.loads(collector.wire[0]) == big  # the verdict itself, no array
    small = [{"seq": 1, "node": "n1"}, {"seq": 2, "node": "n1"}]
    for v in small:
        v["idempotency_key"] = s.put(v)
    drain(s, sender)  # (gzip: the collector said it takes it)
    assert json.loads(gzip.decompress(collector.sent[-1])) == small


def test_an_older_collector_gets_plain_bodies_and_keeps_what_it_cannot_take(
        tmp_path: Path, collector: Collector) -> None:
    """A collector that never says Accept-Encoding (the previous release: 400 to a gzip
    body) gets plain bodies; a verdict too large to go plain is tried gzipped and, at
    that 400, kept in the spool (before: refused by the spool, so never delivered)."""
    s = spool_with(tmp_path, 2)
    s.put(big_verdict(2))
    res = drain(s, Sender(collector.url))
    assert [v["seq"] for v in collector.received] == [0, 1]
    assert [c for _, c in collector.bodies] == [None, "gzip"]
    assert res.sent == 2 and res.rejected == 0 and res.last is None and res.held == 1
    assert len(s) == 1 and s.rejected == 0 and not list(s.dir.glob("*.rejected"))
    collector.takes_gzip = True  # the collector is upgraded: the big one arrives
    res = drain(s, Sender(collector.url))
    assert res.sent == 1 and collector.received[-1]["seq"] == 2 and len(s) == 0
    assert collector.bodies[-1][1] == "gzip" and collector.bodies[-1][0] < 1_000_000


def test_a_verdict_only_gzip_can_carry_does_not_hold_back_newer_ones(
        tmp_path: Path, collector: Collector) -> None:
    """The oldest verdicts in the spool too large to go plain (a 10k-service node's), the
    collector an older release (no gzip): the newer, small ones behind them are delivered
    in the same pass; the big ones are kept, only the first of them is tried (one
    compression per pass, whose answer tells when the collector takes gzip), and the
    pass is no failure (no backoff). Once the collector takes gzip they all arrive."""
    s = Spool(tmp_path / "spool")
    s.put(big_verdict(0))
    s.put(big_verdict(1))
    s.put({"seq": 2, "node": "n1"})
    s.put({"seq": 3, "node": "n1"})
    res = drain(s, Sender(collector.url))
    assert [v["seq"] for v in collector.received] == [2, 3]
    assert res.sent == 2 and res.held == 2 and res.rejected == 0 and res.last is None
    assert res.held_why and "400" in res.held_why
    # one gzip try (the first big verdict), then the small ones plain in one batch
    assert [c for _, c in collector.bodies] == ["gzip", None]
    assert len(s) == 2 and s.rejected == 0 and not list(s.dir.glob("*.rejected"))
    res = drain(s, Sender(collector.url))  # the next pass: tried again, kept again
    assert res.held == 2 and res.sent == 0 and len(collector.bodies) == 3
    collector.takes_gzip = True  # the collector is upgraded
    res = drain(s, Sender(collector.url))
    assert res.sent == 2 and res.held == 0 and len(s) == 0
    assert [v["seq"] for v in collector.received] == [2, 3, 0, 1]


def test_a_415_or_an_older_replica_makes_it_resend_plain_at_once(
        tmp_path: Path, collector: Collector) -> None:
    """Replicas of two releases behind one Service: gzip to a new one, then the old one's
    400 (no Accept-Encoding) to gzip, then a 415: each batch goes again plain at once."""
    collector.takes_gzip = True
    s = spool_with(tmp_path, 1)
    sender = Sender(collector.url)
    assert drain(s, sender).sent == 1 and sender.gzip_ok
    collector.takes_gzip = False  # an older replica answers next
    s.put({"seq": 1, "node": "n1"})
    assert drain(s, sender).sent == 1
    collector.takes_gzip = True
    sender.gzip_ok = True
    collector.script = [(415, {})]
    s.put({"seq": 2, "node": "n1"})
    res = drain(s, sender)
    assert res.sent == 1 and res.rejected == 0 and len(s) == 0
    assert [v["seq"] for v in collector.received] == [0, 1, 2]
    assert [c for _, c in collector.bodies] == [None, "gzip", None, "gzip", None]


def test_a_plain_spool_file_of_the_previous_version_is_delivered(
        tmp_path: Path, collector: Collector) -> None:
    """Upgrade in place: a file the previous version wrote (plain JSON) and one written
    now (gzip) are both shipped, oldest first, and removed."""
    s = Spool(tmp_path / "spool")
    old = {"seq": 0, "node": "n1", "idempotency_key": "old-1", "pad": "o" * 3_500_000}
    (s.dir / "00000000000000000001-old-1.json").write_text(
        json.dumps(old, separators=(",", ":"), sort_keys=True))
    s.put({"seq": 1, "node": "n1"})
    assert (s.dir / s.names()[1]).read_bytes()[:2] == b"\x1f\x8b"
    res = drain(s, Sender(collector.url))
    assert res.sent == 2 and len(s) == 0 and s.corrupt == 0
    assert [v["seq"] for v in collector.received] == [0, 1]
    assert collector.received[0]["idempotency_key"] == "old-1"
