"""Every line the agent's daemon and the collector write to stdout or stderr (issue 37):
`ts`, `level` and `msg` first, then the line's fields, as one JSON object (the default,
``--log-format json``) or as a human line (``--log-format text``)::

    {"ts":"2026-11-25T15:00:00.123Z","level":"warning","msg":"shipping failed ...","k":1}
    2026-11-25T15:00:00.123Z WARNING shipping failed ... k=1

``ts`` is the time the line was written, RFC 3339 in UTC with milliseconds (a verdict's
line keeps its own ``time`` too). JSON lines are ASCII (``\\uXXXX`` escapes) with every
string valid Unicode, as agent.ship.logline's verdict lines are. Text lines are ASCII
too: a value is quoted when it is empty or holds a space, ``=``, ``"`` or an escape;
backslashes and quotes in it are escaped with a backslash, control characters, terminal
escapes and bidirectional overrides are shown as ``\\xNN`` / ``\\uNNNN`` (agent.terminal,
as for the reports), other non-ASCII characters as ``\\uNNNN`` / ``\\UNNNNNNNN``. Nested
fields are flattened (``counts.by_severity.critical=1``; a list of plain values joined by
commas, a list of objects by index: ``findings.0.id=...``). The message is quoted only
when it is empty or holds ``=`` or ``"``: a text line splits unambiguously into
``TS LEVEL msg`` and the ``key=value`` pairs after it.

Either way a line is at most LINE_BYTES bytes with its newline (the CRI splits longer
lines): strings are cut (ending in an ellipsis) and fields that do not fit are left out,
counted in ``omitted_fields``.

``setup`` routes the process's records through one stderr handler (the root logger's:
third-party records of warnings and above too, named by ``logger``; Python warnings and
exceptions in threads also become lines); ``stream_logger`` gives a logger of its own
stream (the collector's access log on stdout).

A leaf: the standard library and agent.terminal only.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TextIO

from agent.terminal import one_line

FORMATS = ("json", "text")
LINE_BYTES = 16384  # the CRI's line limit, with the newline (agent.ship.logline's)
LOGGER = "loopback_agent"  # the project's loggers: this one and its children
MSG_CHARS = 4096  # a message's characters, at most
VALUE_CHARS = 2048  # a field's string's characters, at most
TRACE_CHARS = 8192  # an exception's traceback's
_DEPTH = 6  # nested fields deeper than this are shown as their text
_CUT = "\u2026"
_OMITTED = "omitted_fields"
_HEAD = ("ts", "level", "msg")
LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
          logging.ERROR: "error", logging.CRITICAL: "critical"}
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_.:/-]")
_QUOTE_IN_TEXT = re.compile(r'[ ="\\]')


def log_format(text: str) -> str:
    """--log-format's value (json or text)."""
    value = text.strip().lower()
    if value not in FORMATS:
        raise ValueError(f"not a log format: {text!r} (json or text)")
    return value


def timestamp(t: float | None = None) -> str:
    """RFC 3339, UTC, milliseconds: 2026-11-25T15:00:00.123Z."""
    d = dt.datetime.fromtimestamp(time.time() if t is None else t, dt.UTC)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


def level_name(levelno: int) -> str:
    return LEVELS.get(levelno) or logging.getLevelName(levelno).lower()


def render(fmt: str, ts: str, level: str, msg: str, fields: Mapping[str, Any] | None = None,
           budget: int = LINE_BYTES) -> str:
    """One line, its newline included, at most ``budget`` bytes (>= 256)."""
    if fmt == "text":
        return text_line(ts, level, msg, fields, budget)
    return json_line(ts, level, msg, fields, budget)


# -- JSON ---------------------------------------------------------------------------------

def json_line(ts: str, level: str, msg: str, fields: Mapping[str, Any] | None = None,
              budget: int = LINE_BYTES) -> str:
    limit = budget - 1  # the newline
    head = {"ts": clean(ts, 64), "level": clean(level, 16), "msg": clean(msg, MSG_CHARS)}
    text = dumps(head)
    if len(text) > limit // 2:  # a message of escaped characters (12 bytes an emoji)
        head["msg"] = _fit(head["msg"], limit // 2 - len(text) + len(dumps(head["msg"])))
        text = dumps(head)
    room = limit - len(text) - len(f',"{_OMITTED}":{len(fields or ())}')
    items, omitted = _fitting(("," + dumps(k + "_" if k in _HEAD else k) + ":"
                               + dumps(plain(value))
                               for key, value in (fields or {}).items()
                               for k in (clean(key, 128),)), room)
    if omitted:
        items.append(f',"{_OMITTED}":{omitted}')
    return text[:-1] + "".join(items) + "}\n"


def _fitting(items: Iterable[str], room: int) -> tuple[list[str], int]:
    """The items that fit in ``room`` characters, in order (one too long is left out and
    the next ones still tried), and how many were left out."""
    kept: list[str] = []
    omitted = 0
    for item in items:
        if len(item) <= room:
            kept.append(item)
            room -= len(item)
        else:
            omitted += 1
    return kept, omitted


def dumps(doc: object) -> str:
    # ASCII: the byte length is the character length, and no pipeline guesses an encoding
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def clean(value: object, cap: int) -> str:
    """A string any JSON parser takes: lone surrogates become U+FFFD (a valid pair is
    kept), at most ``cap`` characters (cut ones end in an ellipsis)."""
    s = (value if isinstance(value, str) else str(value))[:cap + 1]  # a huge one: cut first
    if s.isascii() and len(s) <= cap:
        return s
    s = s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return s if len(s) <= cap else s[:cap - 1] + _CUT


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON can say it, its strings cleaned and capped."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) < 1 << 63 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return clean(value, VALUE_CHARS)
    if depth < _DEPTH and isinstance(value, Mapping):
        return {clean(k, 128): plain(v, depth + 1) for k, v in list(value.items())[:256]}
    if depth < _DEPTH and isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value[:256]]
    return clean(value, VALUE_CHARS)


def _fit(s: str, room: int) -> str:
    """``s`` cut (with an ellipsis) until its JSON text takes at most ``room`` bytes."""
    n = len(s)
    while n > 1 and len(dumps(s)) > room:
        n //= 2
        s = s[:n - 1] + _CUT
    return s if len(dumps(s)) <= room else ""


# -- text ---------------------------------------------------------------------------------

def text_line(ts: str, level: str, msg: str, fields: Mapping[str, Any] | None = None,
              budget: int = LINE_BYTES) -> str:
    limit = budget - 1
    m = _text_msg(clean(msg, MSG_CHARS))
    head = f"{_esc(clean(ts, 64))} {_esc(clean(level, 16)).upper()} "
    if len(head) + len(m) > limit // 2:
        m = _text_msg(clean(msg, max(8, (limit // 2 - len(head)) // 10)))
    text = head + m
    pairs = list(flatten(fields or {}))
    room = limit - len(text) - len(f" {_OMITTED}={len(pairs)}")
    out, omitted = _fitting((f" {key}={value}" for key, value in pairs), room)
    if omitted:
        out.append(f" {_OMITTED}={omitted}")
    return text + "".join(out) + "\n"


def flatten(fields: Mapping[str, Any], prefix: str = "",
            depth: int = 0) -> Iterator[tuple[str, str]]:
    """(key, rendered value) pairs of ``fields``, nested ones with dotted keys."""
    for key, value in fields.items():
        k = prefix + _text_key(key)
        if not prefix and k in _HEAD:
            k += "_"
        if depth < _DEPTH and isinstance(value, Mapping):
            yield from flatten(value, k + ".", depth + 1)
        elif depth < _DEPTH and isinstance(value, (list, tuple)):
            if all(not isinstance(v, (Mapping, list, tuple)) for v in value):
                yield k, _text_value(",".join(_scalar(v) for v in value[:1024]))
            else:
                yield from flatten({str(i): v for i, v in enumerate(value[:256])}, k + ".",
                                   depth + 1)
        elif value is None or isinstance(value, (bool, int, float)):
            yield k, _scalar(value)
        else:
            yield k, _text_value(clean(value, VALUE_CHARS))


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return clean(value, VALUE_CHARS)


def _text_key(key: object) -> str:
    return _KEY_UNSAFE.sub("_", str(key)[:128]) or "_"


def _esc(s: str) -> str:
    """Backslashes and quotes escaped, then every control character, terminal escape and
    bidirectional override shown (agent.terminal.one_line), then other non-ASCII
    characters: ASCII printable characters only."""
    if s.isascii() and s.isprintable() and '"' not in s and "\\" not in s:
        return s
    s = one_line(s.replace("\\", "\\\\").replace('"', '\\"'))
    if s.isascii():
        return s
    return "".join(c if c.isascii() else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                   else f"\\U{ord(c):08x}" for c in s)


def _text_value(s: str) -> str:
    e = _esc(s)
    return f'"{e}"' if not e or _QUOTE_IN_TEXT.search(e) else e


def _text_msg(s: str) -> str:
    e = _esc(s)
    return f'"{e}"' if not e or "=" in e or '"' in e else e


# -- logging ------------------------------------------------------------------------------

def fields(**kw: Any) -> dict[str, Any]:
    """``extra`` for a record with fields: ``log.info("...", extra=fields(node=n))``."""
    return {"fields": kw}


class LineFormatter(logging.Formatter):
    """A record as one line of ``fmt`` (json or text): its message, its ``fields`` (the
    ``extra`` of ``fields()``), ``logger`` for records not of the project's loggers, and
    ``exception``: the traceback of ``exc_info`` on one line."""

    def __init__(self, fmt: str = "json", budget: int = LINE_BYTES) -> None:
        super().__init__()
        self.fmt = log_format(fmt)
        self.budget = budget

    def format(self, record: logging.LogRecord) -> str:
        extra = getattr(record, "fields", None)
        out: dict[str, Any] = dict(extra) if isinstance(extra, Mapping) else {}
        if record.name != LOGGER and not record.name.startswith(LOGGER + "."):
            out.setdefault("logger", record.name)
        if record.exc_info and record.exc_info[0] is not None:
            trace = "".join(traceback.format_exception(*record.exc_info))
            # its end says what was raised: cut from the front, to what a value may hold
            # (a value is cut at its end, where this one's matters most)
            keep = min(TRACE_CHARS, VALUE_CHARS - 1)
            out["exception"] = trace if len(trace) <= keep else "…" + trace[-(keep - 1):]
        try:
            msg = record.getMessage()
        except Exception:  # a bad format: the template, not no line
            msg = str(record.msg)
        line = render(self.fmt, timestamp(record.created), level_name(record.levelno), msg,
                      out, self.budget)
        return line[:-1]  # the handler adds the newline


_installed: list[tuple[logging.Logger, logging.Handler]] = []


def _handler(fmt: str, stream: TextIO) -> logging.Handler:
    h = logging.StreamHandler(stream)  # written and flushed record by record: no buffer
    h.setFormatter(LineFormatter(fmt))
    return h


def setup(fmt: str = "json", stream: TextIO | None = None) -> logging.Logger:
    """The process's log lines in ``fmt`` on ``stream`` (stderr): the project's loggers
    from info up, others' from warning up; Python warnings and exceptions that end a
    thread too. Returns the project's logger. Called again, it replaces what it set."""
    root = logging.getLogger()
    for logger, h in [x for x in _installed if x[0] is root]:
        logger.removeHandler(h)
        _installed.remove((logger, h))
    h = _handler(fmt, stream or sys.stderr)
    root.addHandler(h)
    _installed.append((root, h))
    root.setLevel(logging.WARNING)
    ours = logging.getLogger(LOGGER)
    ours.setLevel(logging.INFO)
    logging.captureWarnings(True)
    threading.excepthook = _thread_exception
    return ours


def stream_logger(name: str, fmt: str, stream: TextIO, *, on: bool = True) -> logging.Logger:
    """A logger whose lines (info and up) go to ``stream`` only; ``on=False``: none."""
    logger = logging.getLogger(name)
    for lg, h in [x for x in _installed if x[0] is logger]:
        lg.removeHandler(h)
        _installed.remove((lg, h))
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.disabled = not on
    if on:
        h = _handler(fmt, stream)
        logger.addHandler(h)
        _installed.append((logger, h))
    return logger


def _thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger(LOGGER).error(
        f"thread {name}: {args.exc_type.__name__}: {args.exc_value}",
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
