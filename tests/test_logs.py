"""Logs by convention (issue 37): every line the daemon (`run`) and the collector write,
on stdout and stderr, carries `ts`, `level` and `msg`, as JSON (the default) or as a
human line (`--log-format text`: `TS LEVEL msg key=value ...`), bounded, with terminal
escapes shown escaped (agent.logfmt); the collector writes an access log line per request
(agent.collector.access) that never holds a token. The daemon and the collector run as
real processes here, as in tests/test_collector.py."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import logfmt
from agent.ship.logline import LINE_BYTES, summary_line
from tests.daemon_output import log_line
from tests.test_collector import Proc, verdict
from tests.test_logline import WHERE, big_node

ESC_NAME = "n\x1b]0;owned\x07-\x1b[2J"  # OSC 0 (the window title) and CSI 2J (clear)
ESC_SHOWN = "n\\x1b]0;owned\\x07-\\x1b[2J"  # as a text line shows it
_TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
_QUOTED = r'"(?:[^"\\]|\\.)*"'
# TS LEVEL msg key=value ...: the message bare (no '=' or '"' in it) or quoted; a value
# bare (no space, '=', '"' or backslash) or quoted; printable ASCII only
TEXT_LINE = re.compile(
    rf"(?P<ts>{_TS.pattern}) (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    rf'(?P<msg>{_QUOTED}|[^"=]*?)'
    rf'(?P<pairs>(?: [A-Za-z0-9_.:/-]+=(?:{_QUOTED}|[^ "=\\]+))*)\n')
_PAIR = re.compile(rf' ([A-Za-z0-9_.:/-]+)=({_QUOTED}|[^ "=\\]+)')
SECRETS = ("SECRET-in-the-query", "SECRET-access-token", "SECRET-bearer", "WRONG-SECRET",
           "right-SECRET-token")


def json_head(line: str) -> dict[str, Any]:
    """One JSON line: ASCII, at most 16 KiB with its newline, ts/level/msg first."""
    data = line.encode("ascii")
    assert len(data) <= LINE_BYTES and data.endswith(b"\n") and data.count(b"\n") == 1
    doc = json.loads(data)
    assert list(doc)[:3] == ["ts", "level", "msg"], line
    assert _TS.fullmatch(doc["ts"]), doc["ts"]
    when = dt.datetime.strptime(doc["ts"], "%Y-%m-%dT%H:%M:%S.%f%z")
    assert abs((dt.datetime.now(dt.UTC) - when).total_seconds()) < 600
    assert doc["level"] in ("debug", "info", "warning", "error", "critical")
    assert isinstance(doc["msg"], str) and doc["msg"]
    return doc  # type: ignore[no-any-return]


def text_fields(line: str) -> dict[str, str]:
    """One text line, matched whole: ts, level, msg and the pairs (values as written:
    quoted ones without their quotes, escapes kept)."""
    assert line.isascii() and line.endswith("\n") and line[:-1].isprintable(), line
    assert len(line) <= LINE_BYTES
    m = TEXT_LINE.fullmatch(line)
    assert m, line
    out = {"ts": m["ts"], "level": m["level"], "msg": _unquote(m["msg"])}
    for key, value in _PAIR.findall(m["pairs"]):
        out[key] = _unquote(value)
    return out


def _unquote(value: str) -> str:
    return value[1:-1] if value.startswith('"') else value


def lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


# -- the format ----------------------------------------------------------------------------

def test_a_json_line_is_ts_level_msg_then_the_fields() -> None:
    line = logfmt.render("json", "2026-11-25T15:00:00.123Z", "warning", "shipping failed",
                         {"retry_in_s": 1.5, "node": ESC_NAME, "none": None, "ok": True,
                          "nested": {"a": [1, "x"]}})
    assert line == ('{"ts":"2026-11-25T15:00:00.123Z","level":"warning","msg":"shipping '
                    'failed","retry_in_s":1.5,"node":"n\\u001b]0;owned\\u0007-\\u001b[2J",'
                    '"none":null,"ok":true,"nested":{"a":[1,"x"]}}\n')
    assert json_head(line.replace("2026-11-25T15:00:00.123Z", logfmt.timestamp()))


def test_a_text_line_quotes_values_with_spaces_and_shows_escapes_escaped() -> None:
    line = logfmt.render("text", "2026-11-25T15:00:00.123Z", "warning", "shipping failed",
                         {"node": ESC_NAME, "path": "/v1/nodes", "why": "a b", "empty": "",
                          "q": 'say "hi"', "bs": "C:\\x1b", "nl": "a\nb\tc", "none": None,
                          "n": 3, "bidi": "abc\u202edef", "u": "\u00e9\u2026\U0001f680",
                          "nested": {"by": {"x": 1}}, "ips": ["10.0.0.1", "10.0.0.2"],
                          "items": [{"id": "a"}, {"id": "b c"}]})
    assert line == (
        '2026-11-25T15:00:00.123Z WARNING shipping failed '
        f'node="{ESC_SHOWN}" path=/v1/nodes why="a b" empty="" q="say \\"hi\\"" '
        'bs="C:\\\\x1b" nl="a\\x0ab\\x09c" none=null n=3 bidi="abc\\u202edef" '
        'u="\\u00e9\\u2026\\U0001f680" nested.by.x=1 ips=10.0.0.1,10.0.0.2 items.0.id=a '
        'items.1.id="b c"\n')
    got = text_fields(line)
    assert got["node"] == ESC_SHOWN and got["why"] == "a b" and got["items.1.id"] == "b c"
    # a literal backslash-x is told from an escaped control character
    assert got["bs"] == "C:\\\\x1b" != ESC_SHOWN
    # a message with '=' or '"' is quoted: the line still splits into msg and pairs
    quoted = logfmt.render("text", logfmt.timestamp(), "error", 'a=b "c"', {"k": "v"})
    assert text_fields(quoted)["msg"] == 'a=b \\"c\\"' and text_fields(quoted)["k"] == "v"


_ANY = st.text(max_size=3000) | st.text(alphabet="\x1b\x07\x9b\u202e\ud800\n\"=\\ é🚀",
                                        max_size=5000)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_ANY, st.dictionaries(_ANY, _ANY | st.integers() | st.none(), max_size=12),
       st.integers(256, 4096))
def test_any_message_and_fields_make_one_bounded_line(msg: str, fields: dict[str, Any],
                                                      budget: int) -> None:
    ts = logfmt.timestamp()
    j = logfmt.render("json", ts, "info", msg, fields, budget)
    assert len(j.encode()) <= budget and j.isascii()
    doc = json.loads(j)
    json.dumps(doc).encode("utf-8")  # no lone surrogate: strict parsers take it
    assert list(doc)[:3] == ["ts", "level", "msg"] and doc["ts"] == ts
    t = logfmt.render("text", ts, "info", msg, fields, budget)
    assert len(t) <= budget and "\x1b" not in t
    text_fields(t)


def test_fields_that_do_not_fit_are_counted_not_cut_mid_line() -> None:
    fields = {f"f{i}": "x" * 2000 for i in range(20)}
    for fmt in logfmt.FORMATS:
        line = logfmt.render(fmt, logfmt.timestamp(), "info", "many", fields)
        assert len(line) <= LINE_BYTES
        got = json_head(line) if fmt == "json" else text_fields(line)
        kept = [k for k in got if k.startswith("f")]
        assert 0 < len(kept) < 20 and int(got["omitted_fields"]) == 20 - len(kept)


def test_a_record_with_an_exception_is_one_line_naming_it() -> None:
    for fmt in logfmt.FORMATS:
        f = logfmt.LineFormatter(fmt)
        try:
            raise ZeroDivisionError("boom")
        except ZeroDivisionError:
            rec = logging.getLogger("tornado.application").makeRecord(
                "tornado.application", logging.ERROR, __file__, 1, "Uncaught exception",
                (), sys.exc_info())
        line = f.format(rec) + "\n"
        got = json_head(line) if fmt == "json" else text_fields(line)
        assert got["logger"] == "tornado.application"
        assert "ZeroDivisionError" in got["exception"] and line.count("\n") == 1
        assert got["level"].lower() == "error"


def test_the_verdict_line_has_a_level_by_status_and_its_text_form_fits() -> None:
    v = big_node()
    doc = json_head(summary_line(v, WHERE))
    assert doc["level"] == "warning" and doc["time"] == "2026-11-25T15:00:00Z"
    assert doc["msg"].startswith("verdict: at-risk; findings: 21429 (1429 critical")
    text = summary_line(v, WHERE, fmt="text", ts="2026-11-25T15:00:01.000Z")
    got = text_fields(text)
    assert len(text) <= LINE_BYTES and got["level"] == "WARNING"
    assert got["node"] == "node-a" and got["counts.by_severity.critical"] == "1429"
    # the lists as fitted: what is shown and what is omitted add up, as in JSON
    shown = sum(1 for k in got if k.startswith("findings.") and k.endswith(".id"))
    assert shown and shown + int(got["omitted.findings"]) == 21429
    ips = got["lb_ips"].split(",")
    assert len(ips) + int(got["omitted.lb_ips"]) == 10_000
    from dataclasses import replace

    for status, level in (("healthy", "info"), ("unknown", "warning"),
                          ("loopback", "error"), ("\x1bbogus", "warning")):
        assert json_head(summary_line(replace(v, status=status), WHERE))["level"] == level
        line = summary_line(replace(v, status=status), WHERE, unchanged_since="t",
                            fmt="text")
        assert text_fields(line)["level"] == level.upper() and "\x1b" not in line


# -- the daemon ----------------------------------------------------------------------------

def _daemon(tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Two cycles of `run` (no capture, no API), its Services from a --kube-json directory
    whose name holds terminal escapes and whose services.json is not JSON: a warning on
    stderr each cycle, the verdicts' lines on stdout."""
    kube = tmp_path / f"kube{ESC_NAME}"
    kube.mkdir()
    (kube / "services.json").write_text("{not json")
    return subprocess.run(
        [sys.executable, "-m", "agent", "run", "--no-capture", "--interval", "0.3",
         "--cycles", "2", "--listen", "", "--kube-json", str(kube), "--node-name", ESC_NAME,
         "--spool", str(tmp_path / "spool")],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_every_line_of_a_daemon_run_is_json_with_ts_level_msg(tmp_path: Path) -> None:
    r = _daemon(tmp_path)
    assert r.returncode == 0, r.stderr
    out, err = lines(r.stdout), lines(r.stderr)
    assert len(out) == 2
    for line in out:
        doc = json_head(line)
        assert log_line(line)["node"] == ESC_NAME  # the log-line schema, as before
        assert doc["level"] in ("info", "warning", "error")
    said = [json_head(line) for line in err]
    levels = [d["level"] for d in said]
    assert levels[0] == "info" and said[0]["msg"].startswith("no --collector")
    assert levels.count("warning") == 2 and said[-1]["msg"].startswith("stopped; ")
    warned = next(d for d in said if d["level"] == "warning")
    assert warned["msg"].startswith(f"--kube-json {tmp_path}/kube{ESC_NAME}: ")
    assert "\x1b" not in r.stdout + r.stderr  # (JSON escapes them: \u001b)


def test_every_line_of_a_daemon_run_in_text_is_ts_level_msg_key_values(
        tmp_path: Path) -> None:
    r = _daemon(tmp_path, {"LOOPBACK_AGENT_LOG_FORMAT": "text"})
    assert r.returncode == 0, r.stderr
    out = [text_fields(line) for line in lines(r.stdout)]
    assert len(out) == 2 and all(v["node"] == ESC_SHOWN for v in out)
    assert out[0]["line"] == "summary" and out[1]["line"] == "unchanged"
    assert out[0]["msg"].startswith("verdict: ") and out[0]["schema"] == "loopback-agent/log/v1"
    err = [text_fields(line) for line in lines(r.stderr)]
    assert [e["level"] for e in err] == ["INFO", "WARNING", "WARNING", "INFO"]
    assert ESC_SHOWN in err[1]["msg"] and err[-1]["spool_depth"] == "1"
    assert "\x1b" not in r.stdout + r.stderr and "\x07" not in r.stdout + r.stderr


def test_a_bad_log_format_is_a_usage_error() -> None:
    for env, argv in (({"LOOPBACK_AGENT_LOG_FORMAT": "xml"}, ["run", "--help"]),
                      ({}, ["collector", "--log-format", "xml"])):
        r = subprocess.run([sys.executable, "-m", "agent", *argv], capture_output=True,
                           text=True, env={**os.environ, **env}, timeout=60)
        assert r.returncode == 64 and "not a log format: 'xml' (json or text)" in r.stderr


# -- the collector ---------------------------------------------------------------------------

def _access_lines(c: Proc, n: int) -> list[str]:
    """The first ``n`` lines of its stdout, waited for: each is written as its request
    ends (not when the collector stops)."""
    deadline = time.monotonic() + 10
    while True:
        got = lines(c.access_log())
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _requests(c: Proc) -> dict[str, Any]:
    """A GET with tokens in its query and an Authorization header, a verdict POSTed for
    a node whose name holds terminal escapes (the right token), one with a wrong token."""
    v = {**verdict(ESC_NAME), "idempotency_key": "k-esc"}
    r = requests.get(c.url + "/v1/nodes?limit=1&token=SECRET-in-the-query&access_token="
                     "SECRET-access-token", headers={"Authorization": "Bearer SECRET-bearer"},
                     timeout=5)
    assert r.status_code == 200
    ok = requests.post(c.url + "/v1/verdicts", json=v, timeout=5,
                       headers={"Authorization": "Bearer right-SECRET-token"})
    assert ok.status_code == 200, ok.text
    bad = requests.post(c.url + "/v1/verdicts", json=v, timeout=5,
                        headers={"Authorization": "Bearer WRONG-SECRET"})
    assert bad.status_code == 401
    return {"posted": len(ok.content)}


def test_the_access_log_has_a_json_line_per_request_and_no_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("right-SECRET-token\n")
    c = Proc(tmp_path / "c.db", token)  # (its readiness probe: GET /healthz, a line too)
    try:
        sizes = _requests(c)
        got = [json_head(line) for line in _access_lines(c, 4)]
    finally:
        err = c.stop()
    out = c.access_log()
    for secret in SECRETS:
        assert secret not in out and secret not in err, secret
    assert all(d["msg"] == "request" and d["level"] == "info" for d in got)
    by_status = {(d["method"], d["path"], d["status"]): d for d in got}
    health = by_status["GET", "/healthz", 200]
    assert health["bytes"] == 3 and "query" not in health
    nodes = by_status["GET", "/v1/nodes", 200]
    assert nodes["query"] == "limit=1"  # paging kept, the rest of the query never
    post = by_status["POST", "/v1/verdicts", 200]
    assert post["node"] == ESC_NAME and post["bytes"] == sizes["posted"]
    assert post["bytes_in"] > 1000 and post["remote"] == "127.0.0.1"
    assert isinstance(post["duration_ms"], float) and 0 <= post["duration_ms"] < 10_000
    refused = by_status["POST", "/v1/verdicts", 401]
    assert "node" not in refused  # refused from its headers: its body never read
    # stderr: the collector's own lines, JSON too
    said = [json_head(line) for line in lines(err)]
    assert said[0]["msg"].startswith(f"collector on {c.url}/") and said[0]["level"] == "info"
    assert "\x1b" not in out + err


def test_the_access_log_in_text_shows_escapes_escaped(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("right-SECRET-token\n")
    c = Proc(tmp_path / "c.db", token, extra=("--log-format", "text"))
    try:
        _requests(c)
        got = [text_fields(line) for line in _access_lines(c, 4)]
    finally:
        err = c.stop()
    out = c.access_log()
    for secret in SECRETS:
        assert secret not in out and secret not in err, secret
    post = next(g for g in got if g["method"] == "POST" and g["status"] == "200")
    assert post["node"] == ESC_SHOWN and post["msg"] == "request" and post["level"] == "INFO"
    assert float(post["duration_ms"]) >= 0 and int(post["bytes"]) > 0
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert text_fields(lines(err)[0])["msg"].startswith(f"collector on {c.url}/")


def test_the_access_log_can_be_turned_off(tmp_path: Path) -> None:
    c = Proc(tmp_path / "c.db", env={**os.environ, "LOOPBACK_AGENT_ACCESS_LOG": "off"})
    try:
        for _ in range(20):
            assert requests.get(c.url + "/healthz", timeout=5).status_code == 200
        time.sleep(0.3)
    finally:
        err = c.stop()
    assert c.access_log() == ""
    assert [json_head(line)["level"] for line in lines(err)] == ["info"]


@pytest.mark.parametrize("fmt", logfmt.FORMATS)
def test_a_collector_that_cannot_start_says_so_in_its_format(tmp_path: Path,
                                                             fmt: str) -> None:
    r = subprocess.run([sys.executable, "-m", "agent", "collector", "--listen",
                        "127.0.0.1:9", "--db", f"sqlite://{tmp_path}/c.db", "--tls-cert",
                        "x.crt", "--log-format", fmt], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 64
    (line,) = lines(r.stderr)
    got = json_head(line) if fmt == "json" else text_fields(line)
    assert got["level"].lower() == "error" and got["msg"] == "--tls-cert and --tls-key go together"


def test_a_long_traceback_keeps_what_was_raised() -> None:
    """A traceback longer than a field may hold (here a chained one, 3 KB) is cut from its
    front: its last line, the exception's type and message, is what the line must keep."""
    try:
        try:
            raise KeyError("z" * 3000)
        except KeyError as e:
            raise ValueError("the cause") from e
    except ValueError:
        import sys as _sys

        record = logging.LogRecord("loopback-agent", logging.ERROR, __file__, 1, "failed",
                                   None, _sys.exc_info())
    line = json.loads(logfmt.LineFormatter("json").format(record))
    trace = line["exception"]
    assert len(trace) <= logfmt.VALUE_CHARS and trace.startswith("…")
    assert trace.rstrip().endswith("ValueError: the cause")


@pytest.mark.parametrize("db,shown", [
    ("postgresql://u:s3cret@db/x", "postgresql://u:***@db/x"),
    ("postgresql://u:s3/cr@t@db/x", "postgresql://u:***@db/x"),  # '/' and '@' in it
    ("postgresql://db/x?user=u&password=s3cret", "postgresql://db/x?user=u&password=***"),
    ("sqlite:///var/lib/c.db", "sqlite:///var/lib/c.db"),
    ("/var/lib/c.db", "/var/lib/c.db"),
])
def test_the_database_password_is_never_shown(db: str, shown: str) -> None:
    from agent.collector.main import shown_db

    assert shown_db(db) == shown and "s3" not in shown_db(db)
