"""The durable spool: atomic, ordered, bounded, survives SIGKILL and bad files."""

from __future__ import annotations

import json
import os
import signal
import stat
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


# -- a hostile or unlucky spool directory (a hostPath: anything may appear in it) ------------
#
# Each runs the spool in a child process with a time and an address-space limit, so the
# behaviour measured is the process's own (a hang, an exit, memory), and a regression fails
# the test instead of hanging or exhausting the machine running it.

_CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))
from agent.ship.spool import Spool
s = Spool(sys.argv[1])
if len(sys.argv) > 2:
    s.put(json.loads(sys.argv[2]))
items = [it.verdict for it in s.items()]
print(json.dumps({"items": items, "corrupt": s.corrupt, "dropped": s.dropped,
                  "problems": s.problems, "names": s.names()}))
"""


def child(spool: Path, put: dict | None = None, timeout: float = 30) -> dict:
    args = [sys.executable, "-c", _CHILD, str(spool)] + ([json.dumps(put)] if put else [])
    t0 = time.monotonic()
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the spool hung for {timeout}s")
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout)
    out["seconds"] = time.monotonic() - t0
    return out


def name(ns: int, key: str) -> str:
    return f"{ns:020d}-{key}.json"


def test_bad_entries_are_set_aside_and_foreign_ones_left_alone(tmp_path: Path) -> None:
    # Today's failure: Spool() took the newest name's number and exited 70 (ValueError)
    # at every restart; a FIFO named like a verdict blocked the read forever.
    s = Spool(tmp_path)
    s.put(verdict(1))
    (tmp_path / "zz-notes.json").write_text('{"idempotency_key": "not-ours"}')
    (tmp_path / "dir.json").mkdir()
    (tmp_path / name(2, "adir")).mkdir()
    os.mkfifo(tmp_path / name(3, "fifo"))
    os.mkfifo(tmp_path / "zz-fifo.json")
    os.mknod(tmp_path / name(4, "null"), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    out = child(tmp_path, put=verdict(5))
    assert [v["seq"] for v in out["items"]] == [1, 5]
    assert out["corrupt"] == 3 and out["dropped"] == 0
    assert out["seconds"] < 10
    for bad in (name(2, "adir"), name(3, "fifo"), name(4, "null")):
        assert (tmp_path / (bad + ".corrupt")).exists(), bad
        assert any(bad in p and "set aside" in p for p in out["problems"]), bad
    # a name put() never writes is someone else's: not read, not moved, said once
    assert (tmp_path / "zz-notes.json").read_text() == '{"idempotency_key": "not-ours"}'
    assert (tmp_path / "dir.json").is_dir() and stat.S_ISFIFO(
        (tmp_path / "zz-fifo.json").lstat().st_mode)
    for foreign in ("zz-notes.json", "dir.json", "zz-fifo.json"):
        assert sum(foreign in p and "left alone" in p for p in out["problems"]) == 1, foreign
    # set aside once: a restart sees a clean spool
    again = child(tmp_path)
    assert again["corrupt"] == 0 and [v["seq"] for v in again["items"]] == [1, 5]


def test_a_shared_directory_given_by_mistake_loses_no_file(tmp_path: Path) -> None:
    """--spool /tmp, or a directory of manifests: what others keep there (JSON files,
    temporary files, files with the spool's own suffixes, more than the spool keeps of
    its own) stays byte for byte, through a start, puts, reads, a refusal and bounds."""
    others = {"kube-apiserver.json": '{"kind": "Pod"}', ".tmp-editor-swap": "draft",
              "report.json.corrupt": "theirs", "old.json.rejected": "theirs too",
              **{f"junk-{i}.json.corrupt": str(i) for i in range(150)}}
    for n, text in others.items():
        (tmp_path / n).write_text(text)
    (tmp_path / "a-dir.json").mkdir()
    s = Spool(tmp_path, max_items=2)
    for i in range(4):
        s.put(verdict(i))  # the bound drops its own oldest, nothing else
    items = list(s.items())
    assert [i.verdict["seq"] for i in items] == [2, 3]
    s.set_aside(items[0].name, "refused for good (a test)")  # prunes its set-aside files
    said = [p for p in s.take_problems() if "left alone" in p]
    assert sorted(p.split()[2] for p in said) == ["a-dir.json", "kube-apiserver.json"]
    later = time.time_ns() + 10**10
    for i in range(120):  # more set-aside files of its own than it keeps: pruned to 100
        link = tmp_path / name(10 + i, f"bad{i}")
        link.symlink_to("/dev/null")
        # newer than the .rejected one on any clock (pruning goes by time): it goes
        os.utime(link, ns=(later + i, later + i), follow_symlinks=False)
    assert len(s) == 1
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("0")
                and p.name.endswith(".corrupt")]) == 100
    for n, text in others.items():
        assert (tmp_path / n).read_text() == text, n
    assert (tmp_path / "a-dir.json").is_dir()
    assert not [p for p in s.take_problems() if "left alone" in p]  # said once


def test_a_name_from_the_far_future_neither_renames_nor_unbounds_the_spool(
        tmp_path: Path) -> None:
    """A planted 99999999999999999999-x.json once pushed every later name to 21 digits:
    the spool no longer took its own verdicts for its own (never shipped nor bounded)."""
    planted = tmp_path / name(99999999999999999999, "x")
    planted.write_text("not a verdict")
    arabic = tmp_path / ("\u0661" * 20 + "-notes.json")  # digits, but not ASCII ones
    arabic.write_text("theirs")
    s = Spool(tmp_path, max_items=2)
    s.put(verdict(0))
    assert [i.verdict["seq"] for i in s.items()] == [0]  # the planted one set aside
    assert s.corrupt == 1 and (tmp_path / (planted.name + ".corrupt")).exists()
    for i in range(1, 5):
        s.put(verdict(i))
    assert all(len(n.split("-", 1)[0]) == 20 for n in s.names())
    assert [i.verdict["seq"] for i in s.items()] == [3, 4]  # its own, and bounded
    assert arabic.read_text() == "theirs"


@pytest.mark.parametrize("target", ["secret", "dev-zero", "fifo"])
def test_a_symlink_is_never_followed(tmp_path: Path, target: str) -> None:
    # Today's failures: the secret's content was read and delivered as a verdict;
    # /dev/zero was read until memory ran out; the FIFO blocked the read forever.
    spool = tmp_path / "spool"
    Spool(spool).put(verdict(1))
    secret = tmp_path / "secret.json"
    secret.write_text('{"idempotency_key": "k", "password": "hunter2"}')
    os.mkfifo(tmp_path / "fifo")
    link = spool / name(99999999999999999999, "link")  # the newest: read last
    link.symlink_to({"secret": secret, "dev-zero": Path("/dev/zero"),
                     "fifo": tmp_path / "fifo"}[target])
    out = child(spool, timeout=15)
    assert "hunter2" not in json.dumps(out)
    assert [v.get("seq") for v in out["items"]] == [1]
    assert out["corrupt"] == 1 and "symbolic link" in out["problems"][0]
    # the link itself was moved aside; its target is untouched
    assert (spool / (link.name + ".corrupt")).is_symlink()
    assert secret.read_text() == '{"idempotency_key": "k", "password": "hunter2"}'


def test_a_fifo_named_like_a_verdict_does_not_block(tmp_path: Path) -> None:
    # Today's failure: open() of the FIFO waited for a writer forever (SIGTERM only set
    # the daemon's stop flag; the read never returned to look at it).
    s = Spool(tmp_path)
    s.put(verdict(1))
    os.mkfifo(tmp_path / name(99999999999999999999, "fifo"))
    out = child(tmp_path, timeout=15)
    assert [v["seq"] for v in out["items"]] == [1] and out["corrupt"] == 1


def test_a_huge_file_neither_evicts_verdicts_nor_exhausts_memory(tmp_path: Path) -> None:
    # Today's failure: a 1 GiB file counted against the 64 MiB bound dropped every real
    # verdict (the one just put too), then was read whole (MemoryError under the limit).
    s = Spool(tmp_path)
    for i in range(3):
        s.put(verdict(i))
    huge = tmp_path / name(99999999999999999999, "huge")
    with huge.open("wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB by its size, no disk used
    out = child(tmp_path, put=verdict(3))
    assert [v["seq"] for v in out["items"]] == [0, 1, 2, 3]
    assert out["dropped"] == 0 and out["corrupt"] == 1
    assert (tmp_path / (huge.name + ".corrupt")).exists()


def test_a_verdict_sized_file_that_is_not_json_is_set_aside(tmp_path: Path) -> None:
    # Nested deeper than the JSON parser recurses: RecursionError, today uncaught (exit 70)
    s = Spool(tmp_path)
    s.put(verdict(1))
    (tmp_path / name(2, "deep")).write_text("[" * 200_000)
    out = child(tmp_path)
    assert [v["seq"] for v in out["items"]] == [1] and out["corrupt"] == 1


def test_a_file_grown_past_the_bound_after_listing_is_not_read_whole(tmp_path: Path) -> None:
    s = Spool(tmp_path, max_file_bytes=1000)
    s.put(verdict(1))
    big = tmp_path / name(99999999999999999999, "grows")  # after the real one
    big.write_text("{}")
    it = s.items()
    first = next(it)  # listed now, while small
    big.write_bytes(b" " * 5000)
    assert first.verdict["seq"] == 1 and list(it) == []
    assert s.corrupt == 1 and "5000 bytes" in s.problems[-1]


def test_set_aside_files_are_bounded(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    for i in range(150):  # named as the spool names verdicts: its own to set aside
        (tmp_path / name(i, f"junk{i}")).symlink_to("/dev/null")
    assert len(s) == 0 and s.corrupt == 150
    assert len(list(tmp_path.glob("*.corrupt"))) == 100


def test_an_unsafe_key_never_leaves_the_spool_directory(tmp_path: Path) -> None:
    s = Spool(tmp_path / "spool")
    key = s.put({**verdict(1), IDEMPOTENCY_KEY: "../../escape/x"})
    assert key == "../../escape/x" and next(s.items()).key == key
    assert [p.name for p in tmp_path.iterdir()] == ["spool"]


def test_an_oversized_verdict_is_refused_not_stored(tmp_path: Path) -> None:
    # the bound is on the compressed verdict (what is shipped): incompressible padding
    s = Spool(tmp_path, max_item_bytes=1000)
    with pytest.raises(ValueError, match="gzipped: more than the 1000"):
        s.put({**verdict(1), "pad": os.urandom(1000).hex()})
    assert len(s) == 0 and not list(tmp_path.iterdir())


_SHORT_WRITE = r"""
import os, resource, signal, sys
from agent.ship.spool import Spool
s = Spool(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    key = s.put({"seq": 1, "pad": os.urandom(10000).hex()})  # ~10 kB even gzipped
    print("returned", key)
except OSError as e:
    print("raised", e)
"""


def test_a_short_write_never_returns_a_truncated_verdict(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes the kernel write 4096 of the ~20 kB and return 4096 (a real short
    # write); the next write gets EFBIG. Today os.write's count was ignored: put()
    # returned, the verdict on disk was 4096 bytes of it, unreadable: lost.
    proc = subprocess.run([sys.executable, "-c", _SHORT_WRITE, str(tmp_path)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("raised"), proc.stdout
    assert "File too large" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no truncated verdict, no temporary file


def test_verdicts_are_gzipped_and_count_their_compressed_size(tmp_path: Path) -> None:
    """A 10k-service verdict (~21 MB) takes ~1.5 MB: ~6 MB of repetitive JSON here takes
    a few hundred kB of the byte bound; before, over 4 MiB was refused."""
    s = Spool(tmp_path)
    rows = [{"service": f"ns/svc-{j}", "lb_ip": f"10.{j // 250}.{j % 250}.1"}
            for j in range(120_000)]
    key = s.put({**verdict(1), "rows": rows})
    (name,) = s.names()
    raw = (tmp_path / name).read_bytes()
    assert raw[:2] == b"\x1f\x8b" and s.bytes() == len(raw) < 1_000_000
    (it,) = s.items()
    assert it.key == key and it.size == len(raw) and len(it.data) > 5_000_000
    assert it.verdict["rows"] == rows


def test_a_gzip_bomb_in_the_spool_is_set_aside_after_the_bound(tmp_path: Path) -> None:
    import zlib

    s = Spool(tmp_path)
    s.put(verdict(1))
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(c.compress(bytes(1 << 20)) for _ in range(80)) + c.flush()
    (tmp_path / name(99999999999999999999, "bomb")).write_bytes(bomb)  # 80 MiB inflated
    assert [it.verdict["seq"] for it in s.items()] == [1]
    assert s.corrupt == 1 and "inflates to more than" in s.problems[-1]


def test_a_truncated_gzip_file_is_set_aside(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    s.put(verdict(1))
    s.put(verdict(2))
    first = tmp_path / s.names()[0]
    first.write_bytes(first.read_bytes()[:-10])
    assert [it.verdict["seq"] for it in s.items()] == [2]
    assert s.corrupt == 1 and "truncated" in s.problems[-1]


def test_a_gzip_file_that_is_not_a_json_object_is_set_aside(tmp_path: Path) -> None:
    """An intact gzip member (its CRC holds) of something else than a verdict: set aside
    without its text being parsed (the first and last bytes say it is no JSON object)."""
    import gzip

    s = Spool(tmp_path)
    s.put(verdict(1))
    (tmp_path / name(99999999999999999999, "list")).write_bytes(gzip.compress(b"[1, 2]"))
    assert [it.verdict["seq"] for it in s.items()] == [1]
    assert s.corrupt == 1 and "not a JSON object" in s.problems[-1]


def test_a_verdict_is_spooled_as_the_json_text_it_was(tmp_path: Path) -> None:
    """Encoded a piece at a time, the text is json.dumps(sorted, compact) byte for byte,
    and its size is known from the gzip stream without parsing it."""
    from agent.ship.spool import json_chunks

    doc = {**verdict(1), "findings": [{"b": 1, "a": "ü"}, [], {}], "empty": [], "n": None,
           IDEMPOTENCY_KEY: "k"}
    text = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    assert b"".join(json_chunks(doc)) == text
    s = Spool(tmp_path)
    s.put(doc)
    (it,) = s.items()
    assert it.data == text and it.plain_size == len(text) and it.key == "k"


# a daemon holding a 10k-service-sized verdict (~20 MB as JSON) spools and ships it; the
# peak RSS growth of that, from /proc/self/status (VmHWM reset first)
_SHIP_RSS = r"""
import gc, json, sys
from pathlib import Path
from agent.ship.sender import Sender, drain
from agent.ship.spool import Spool

def kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])

doc = {"schema": "loopback-agent/verdict/v1", "node": "big", "status": "at-risk",
       "findings": [{"id": "pod-to-lb-not-masqueraded", "severity": "warning",
                     "service": f"ns-{j % 97}/svc-{j}", "lb_ip": f"10.{j // 250}.{j % 250}.1",
                     "evidence": [f"KUBE-FW-{j:016X} -d 10.{j // 250}.{j % 250}.1/32 "
                                  f"-j KUBE-EXT-{j * 7919:016X} rule {k}" for k in range(14)]}
                    for j in range(15000)]}
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
rss0 = kib("VmRSS")
spool = Spool(sys.argv[1])
spool.put(doc)
res = drain(spool, Sender(sys.argv[2], timeout=60))
print(json.dumps({"sent": res.sent, "grown_kib": kib("VmHWM") - rss0,
                  "text": len(json.dumps(doc))}))
"""


def test_spooling_and_shipping_a_big_verdict_costs_little_memory(tmp_path: Path) -> None:
    """Before: the JSON text was held to gzip it at put, then inflated and parsed whole
    to check it at drain (json.loads of 21 MB: ~150 MB) and held again to send it:
    +90 MiB at peak for a 20 MB verdict. Now the text is never held whole."""
    from tests.test_sender import Collector

    collector = Collector()
    collector.takes_gzip = True
    try:
        proc = subprocess.run([sys.executable, "-c", _SHIP_RSS, str(tmp_path / "spool"),
                               collector.url], capture_output=True, text=True, timeout=120)
    finally:
        collector.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["sent"] == 1 and out["text"] > 18_000_000, out
    assert [v["node"] for v in collector.received] == ["big"]
    assert out["grown_kib"] < 30 * 1024, f"peak RSS grew {out['grown_kib'] // 1024} MiB"


def filled(d: Path, **bounds: int) -> Spool:
    """A spool in ``d`` holding verdicts 0, 1, 2 (full, with max_items=3)."""
    s = Spool(d, **bounds)
    for i in range(3):
        s.put(verdict(i))
    return s


def test_files_planted_under_verdict_names_never_take_real_verdicts_places(
        tmp_path: Path) -> None:
    """Regular files named as the spool names its verdicts, the newest names, within the
    size a verdict may have: before, they counted against the bounds until read, so the
    real verdicts were dropped to make room for them. Now, before any verdict is dropped,
    each entry the spool neither wrote nor read back is checked: these are set aside."""
    s = filled(tmp_path, max_items=3)
    (tmp_path / name(99999999999999999998, "junk")).write_text('{"not": "gzip"}')
    (tmp_path / name(99999999999999999999, "junk")).write_bytes(os.urandom(300))
    s.put(verdict(3))  # 4 real ones for 3 places: the oldest, and only it, goes
    assert [it.verdict["seq"] for it in s.items()] == [1, 2, 3]
    assert s.dropped == 1 and s.corrupt == 2
    # by bytes: a planted file near the byte bound, in a spool the next one fills
    d = tmp_path / "bytes"
    s = filled(d, max_bytes=2000)
    (d / name(99999999999999999999, "junk")).write_bytes(b"\x1f\x8b" + os.urandom(1500))
    s.put(verdict(3))
    assert [it.verdict["seq"] for it in s.items()] == [0, 1, 2, 3]
    assert s.dropped == 0 and s.corrupt == 1
    # a previous run's real verdicts are checked too, and kept: they are verdicts
    s = Spool(d, max_bytes=2000)
    for i in range(4, 40):
        s.put({**verdict(i), "pad": os.urandom(40).hex()})
    kept = [it.verdict["seq"] for it in s.items()]
    assert kept[-1] == 39 and s.corrupt == 0 and s.bytes() <= 2000


def test_a_verdict_written_over_is_checked_again_and_many_planted_files_cost_little(
        tmp_path: Path) -> None:
    """The spool knows its verdicts by file (inode, size, time), not by name: junk
    written over the newest one it wrote is checked like any stranger, so it cannot take
    a real verdict's place. And thousands of planted files are set aside with one
    pruning of the set-aside files, not one each (8,000 took 24 s, quadratic)."""
    s = filled(tmp_path, max_items=3)
    (tmp_path / s.names()[-1]).write_bytes(os.urandom(200))  # over verdict 2
    s.put(verdict(3))
    assert [it.verdict["seq"] for it in s.items()] == [0, 1, 3]
    assert s.dropped == 0 and s.corrupt == 1
    d = tmp_path / "many"
    s = filled(d, max_items=3)
    for i in range(8000):
        (d / name(99999999999999990000 + i, "junk")).write_bytes(b"x")
    t0 = time.process_time()
    s.put(verdict(3))
    assert time.process_time() - t0 < 10  # (quadratic: 24 s of CPU; linear: about 1 s)
    assert [it.verdict["seq"] for it in s.items()] == [1, 2, 3] and s.corrupt == 8000
    assert len(list(d.glob("*.corrupt"))) == 100  # the set-aside files' own bound


def test_junk_written_over_a_verdict_with_its_old_times_is_still_checked(
        tmp_path: Path) -> None:
    """Same size and the old mtime put back (utime): the ctime, which a write cannot set
    back, still tells the file apart (the reviewer's forgery)."""
    s = filled(tmp_path, max_items=3)
    newest = tmp_path / s.names()[-1]
    st = newest.stat()
    time.sleep(0.05)  # (past the file clock's tick: a forger has all the time it wants)
    newest.write_bytes(os.urandom(st.st_size))
    os.utime(newest, ns=(st.st_atime_ns, st.st_mtime_ns))
    s.put(verdict(3))
    assert [it.verdict["seq"] for it in s.items()] == [0, 1, 3]
    assert s.dropped == 0 and s.corrupt == 1
