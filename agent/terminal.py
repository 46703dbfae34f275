"""One sanitiser for every string that reaches an operator's terminal (issue 35, items 7
and 8): the report of `check`, the kubectl plugin's tables, the plugin's and the CLI's
messages. Service and node names, rule comments and pasted log lines come from the node,
the API or a verdict a node sent; any of them may hold an escape sequence (OSC 52 writes
the clipboard, OSC 0 the window title, CSI 2J clears the screen; an unterminated OSC can
swallow the rest of the report). Control characters are shown escaped, never passed
through: a stripping pass can be undone by doubling the escape, a showing pass cannot.
A leaf: the standard library only.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls (U+009B is a one-character CSI), lone
# surrogates, and the bidirectional overrides and isolates that reorder what is shown
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")
_LINE_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


def _shown(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def for_terminal(text: str) -> str:
    """``text`` (lines of a report) with every control character but tab and newline
    shown as ``\\xNN`` / ``\\uNNNN``."""
    return _UNSAFE.sub(_shown, text) if _UNSAFE.search(text) else text


def one_line(text: str) -> str:
    """A value that must stay on one line (a table cell, a message): newlines and tabs
    escaped too."""
    return _LINE_UNSAFE.sub(_shown, text) if _LINE_UNSAFE.search(text) else text
