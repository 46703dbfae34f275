"""The durable spool: atomic, ordered, bounded, survives SIGKILL and bad files."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.ship.spool import IDEMPOTENCY_KEY, Spool


def verdict(i: int) -> dict:
    return {"schema": "loopback-agent/verdict/v1", "node": f"n{i}", "status": "healthy",
            "findings": [], "seq": i}


def test_put_items_remove_in_order_with_keys(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    keys = [s.put(verdict(i)) for i in range(5)]
    items = list(s.items())
    assert [it.verdict["seq"] for it in items] == [0, 1, 2, 3, 4]
    assert [it.key for it in items] == keys and len(set(keys)) == 5
    assert all(it.verdict[IDEMPOTENCY_KEY] == it.key for it in items)
    s.remove(items[0].name)
    assert [it.verdict["seq"] for it in s.items()] == [1, 2, 3, 4]


def test_an_existing_idempotency_key_is_kept(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    assert s.put({**verdict(1), IDEMPOTENCY_KEY: "k-1"}) == "k-1"
    assert next(s.items()).key == "k-1"


def test_restart_sees_what_was_spooled_and_drops_partial_writes(tmp_path: Path) -> None:
    Spool(tmp_path).put(verdict(1))
    (tmp_path / ".tmp-00000000000000000001-x.json").write_text('{"half')
    s = Spool(tmp_path)
    assert [it.verdict["seq"] for it in s.items()] == [1]
    assert not list(tmp_path.glob(".tmp-*"))
    s.put(verdict(2))  # names keep increasing after a restart
    assert [it.verdict["seq"] for it in s.items()] == [1, 2]


def test_full_by_count_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    s = Spool(tmp_path, max_items=3)
    for i in range(5):
        s.put(verdict(i))
    assert [it.verdict["seq"] for it in s.items()] == [2, 3, 4]
    assert s.dropped == 2 and len(s) == 3


def test_full_by_bytes_drops_the_oldest(tmp_path: Path) -> None:
    s = Spool(tmp_path, max_bytes=1000)
    for i in range(10):
        s.put({**verdict(i), "pad": "x" * 200})
    assert s.bytes() <= 1000 and s.dropped > 0
    assert [it.verdict["seq"] for it in s.items()][-1] == 9


def test_a_corrupted_file_is_set_aside_and_the_rest_delivered(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    for i in range(3):
        s.put(verdict(i))
    bad = s.names()[1]
    (tmp_path / bad).write_bytes(b"\x00garbage")
    assert [it.verdict["seq"] for it in s.items()] == [0, 2]
    assert s.corrupt == 1 and bad in s.problems[0]
    assert (tmp_path / (bad + ".corrupt")).exists() and len(s) == 2


def test_bad_bounds_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Spool(tmp_path, max_items=0)


_WRITER = r"""
import sys
from agent.ship.spool import Spool
s = Spool(sys.argv[1], max_items=100000)
i = 0
while True:
    key = s.put({"seq": i, "pad": "y" * 2000})
    print(key, flush=True)  # printed only once put() returned: it must survive
    i += 1
"""


@pytest.mark.parametrize("after", [0.05, 0.2, 0.5])
def test_sigkill_mid_write_loses_nothing_that_put_returned(tmp_path: Path,
                                                           after: float) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    time.sleep(after)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=10)
    returned = out.split()
    s = Spool(tmp_path)
    stored = {it.key: it.verdict for it in s.items()}
    assert s.corrupt == 0  # no half-written verdict is ever visible
    assert set(returned) <= set(stored)
    assert len(stored) - len(returned) <= 1  # at most the one in flight, complete
    assert all(json.dumps(v) for v in stored.values())
