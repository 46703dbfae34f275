"""gzip bodies, end to end and attacked: a real 10k-service verdict spooled, shipped
gzipped and shown by the real collector process; a real zip bomb, truncated and
concatenated streams, a wrong CRC, plain JSON said to be gzip, an unknown coding, gzip
trickled a byte at a time; the body budget counting what is inflated. Every request
crosses a real socket on 127.0.0.1."""

from __future__ import annotations

import gzip
import json
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from agent.ship import gz
from agent.ship.sender import Sender, drain
from agent.ship.spool import Spool
from tests.test_collector import Proc, verdict
from tests.test_collector_abuse import status_kib

BIG_NODE = "node-10k-lb"


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A 10k-LoadBalancer-service node's verdict (iptables mode), as `check --json`
    makes it (the same code path, in-process): ~20 MB of JSON."""
    from agent.bundle import load_bundle
    from agent.diagnose import diagnose
    from lab.kube_proxy_rules.synthetic import synthetic

    d = tmp_path_factory.mktemp("dump10k")
    for name, text in synthetic(10000, "iptables").items():
        (d / name).write_text(text)
    doc = diagnose(load_bundle(str(d)), BIG_NODE).to_dict("all")
    return json.dumps(doc, separators=(",", ":")).encode()


@pytest.fixture(scope="module")
def small() -> dict[str, Any]:
    return verdict("small")


@pytest.fixture
def col(tmp_path: Path) -> Iterator[Proc]:
    c = Proc(tmp_path / "c.db")
    yield c
    c.stop()


def post(col: Proc, data: bytes, coding: str | None = "gzip") -> requests.Response:
    headers = {"Content-Type": "application/json"}
    if coding is not None:
        headers["Content-Encoding"] = coding
    return requests.post(col.url + "/v1/verdicts", data=data, headers=headers, timeout=60)


def zip_bomb(gib: int = 2) -> bytes:
    """A real gzip member of ``gib`` GiB of zeros (valid CRC and size) in ~1 MB per GiB,
    made without ever holding the zeros: one deflate block of 1 MiB of zeros, fully
    flushed, is the same bytes every time, so it is repeated."""
    zeros = bytes(1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    head = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    n = gib << 10
    crc = 0
    for _ in range(n):
        crc = zlib.crc32(zeros, crc)
    # a final empty fixed-Huffman block, then CRC-32 and the size modulo 2**32
    return head + block * (n - 1) + b"\x03\x00" + struct.pack("<II", crc, (n << 20) & 0xFFFFFFFF)


# -- end to end ----------------------------------------------------------------------------


def test_a_10k_service_verdict_is_spooled_shipped_gzipped_and_shown(
        tmp_path: Path, col: Proc, big: bytes) -> None:
    """Before: the spool refused it (over 4 MiB), the node never reached the collector."""
    assert len(big) > 15_000_000
    spool = Spool(tmp_path / "spool")
    key = spool.put(json.loads(big))
    (name,) = spool.names()
    on_disk = (spool.dir / name).read_bytes()
    assert gz.is_gzip(on_disk) and len(on_disk) < len(big) / 8, len(on_disk)
    assert spool.bytes() == len(on_disk)
    res = drain(spool, Sender(col.url))
    assert res.sent == 1 and res.last is None and len(spool) == 0, res
    nodes = requests.get(col.url + "/v1/nodes", timeout=10).json()
    (node,) = nodes
    assert node["node"] == BIG_NODE and node["lb_ips"] == 10_000, node
    assert BIG_NODE in requests.get(col.url + "/", timeout=10).text
    got = requests.get(col.url + f"/v1/nodes/{BIG_NODE}?limit=1", timeout=30).json()
    assert got[0]["idempotency_key"] == key
    assert len(got[0]["findings"]) == len(json.loads(big)["findings"])


# -- what the collector takes and refuses ----------------------------------------------------


def test_plain_json_from_an_older_agent_is_still_taken_and_gzip_is_advertised(
        col: Proc, small: dict[str, Any]) -> None:
    r = post(col, json.dumps({**small, "node": "old-agent"}).encode(), coding=None)
    assert r.status_code == 200 and r.json()["stored"] == 1
    assert r.headers["Accept-Encoding"] == "gzip"  # what a newer agent waits for
    r = post(col, json.dumps({**small, "node": "identity"}).encode(), coding="identity")
    assert r.status_code == 200


def test_a_gzip_body_is_taken(col: Proc, small: dict[str, Any]) -> None:
    r = post(col, gz.compress(json.dumps({**small, "node": "gz"}).encode()))
    assert r.status_code == 200 and r.json()["stored"] == 1, r.text
    assert [n["node"] for n in requests.get(col.url + "/v1/nodes", timeout=5).json()] == ["gz"]


@pytest.mark.parametrize("coding", ["br", "deflate", "gzip, gzip", "compress"])
def test_another_coding_is_415_saying_what_is_taken(col: Proc, small: dict[str, Any],
                                                      coding: str) -> None:
    r = post(col, json.dumps(small).encode(), coding=coding)
    assert r.status_code == 415 and r.headers["Accept-Encoding"] == "gzip", r.text
    assert requests.get(col.url + "/v1/nodes", timeout=5).json() == []


def _bad_streams(text: bytes) -> dict[str, tuple[bytes, str]]:
    good = gz.compress(text)
    wrong_crc = good[:-8] + struct.pack("<I", zlib.crc32(text) ^ 1) + good[-4:]
    return {"plain JSON said to be gzip": (text, "not a valid gzip stream"),
            "truncated": (good[: len(good) // 2], "truncated"),
            "two members": (good + good, "more than one gzip member"),
            "trailing garbage": (good + b"garbage", "bytes after the end"),
            "wrong CRC": (wrong_crc, "incorrect data check")}


@pytest.mark.parametrize("case", list(_bad_streams(b"{}")))
def test_a_broken_gzip_body_is_a_clear_400(col: Proc, small: dict[str, Any],
                                           case: str) -> None:
    data, reason = _bad_streams(json.dumps(small).encode())[case]
    r = post(col, data)
    assert r.status_code == 400 and reason in r.json()["error"], r.text
    assert requests.get(col.url + "/v1/nodes", timeout=5).json() == []


def test_a_zip_bomb_is_413_after_at_most_the_bound(col: Proc) -> None:
    """2 GiB of zeros in 2 MB: refused once 64 MiB are inflated; the collector's peak
    RSS grows by about that bound, not by the bomb, and it goes on answering."""
    bomb = zip_bomb(2)
    assert len(bomb) < 4 * 1024 * 1024
    pid = col.p.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kib(pid, "VmRSS")
    t0 = time.monotonic()
    r = post(col, bomb)
    took = time.monotonic() - t0
    grown_mib = (status_kib(pid, "VmHWM") - before) / 1024
    assert r.status_code == 413 and "more than 67108864" in r.text, r.text
    assert grown_mib < 150, f"peak RSS grew {grown_mib:.0f} MiB for a zip bomb"
    assert took < 10, f"{took:.1f} s: it inflated more than the bound"
    assert requests.get(col.url + "/healthz", timeout=5).status_code == 200


def test_gzip_trickled_a_byte_at_a_time_is_taken(col: Proc, small: dict[str, Any]) -> None:
    """A slow sender of a gzip body (inside the 20 s body deadline) is served in full;
    the event loop is not held meanwhile."""
    data = gz.compress(json.dumps({**small, "node": "trickled"}).encode())
    assert len(data) < 4000  # a few s at ~1 ms a byte
    head = (b"POST /v1/verdicts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % len(data))
    with socket.create_connection(("127.0.0.1", col.port), timeout=20) as s:
        s.sendall(head)
        for i in range(len(data)):
            s.sendall(data[i:i + 1])
            if i == len(data) // 2:  # others are served while it trickles
                assert requests.get(col.url + "/healthz", timeout=2).status_code == 200
            time.sleep(0.001)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert [n["node"] for n in requests.get(col.url + "/v1/nodes", timeout=5).json()] \
        == ["trickled"]


def test_the_body_budget_counts_what_is_inflated(tmp_path: Path) -> None:
    """A 20 kB gzip body inflating to 6 MiB against a 4 MiB budget: 503 with Retry-After
    (the agent keeps it and comes back), not held past the budget."""
    from agent.collector.server import Collector
    from agent.collector.store import Store
    from agent.collector.web import CollectorServer, Limits

    server = CollectorServer(Collector(Store(tmp_path / "c.db")), "127.0.0.1", 0,
                             limits=Limits(body_budget=4 * 1024 * 1024))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/verdicts"
        body = gzip.compress(b'{"node": "x", "pad": "' + b" " * (6 << 20) + b'"}')
        assert len(body) < 100_000
        r = requests.post(url, data=body, timeout=10, headers={"Content-Encoding": "gzip"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "2", r.text
        assert server.receiving == 0  # everything reserved was given back
    finally:
        server.shutdown()

