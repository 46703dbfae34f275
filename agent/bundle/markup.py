"""What a paste wraps around the command output it carries, taken off before it is read:
a terminal's colour codes (`grep --color=always`, `ip -c`, a `script` log), a reply's
quote markers (every line "> ..."), an indent that every line shares (a Markdown or
e-mail code block), and the non-breaking spaces of a web page or a chat client.
Markdown's code fences are sections' borders (agent.bundle.sections).

Each line stays where it was (nothing is joined or dropped), so a file:line in a verdict
still points at the line the user pasted.
"""

from __future__ import annotations

import os
import re

from agent.parse.text_file import replaced

# U+00A0 NO-BREAK SPACE, U+2007 FIGURE SPACE, U+202F NARROW NO-BREAK SPACE: what a page's
# &nbsp; or a chat client's aligned columns become; no command output we read holds one
_SPACES = ("\u00a0", "\u2007", "\u202f")
_QUOTE = re.compile(r"^> ?", re.M)
# ECMA-48 control sequences (CSI: colours, "erase line" after grep's matches) and
# operating system commands (a terminal's title, hyperlinks), as a terminal log holds them
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b\n]*(?:\x07|\x1b\\)?")
_MAX_QUOTE_DEPTH = 8  # a reply to a reply ...: past that it is not a paste of output
_FIRST = re.compile(r"\s*(\S)")  # the first character that is not blank
_INDENTED = re.compile(r"(?:[ \t]*\n)*[ \t]+\S")  # the first non-blank line is indented


def without_markup(text: str) -> str:
    """``text`` with the paste's wrapping taken off (see the module); the same text when
    it has none (a big dump costs a few scans at C speed)."""
    if "\x1b" in text:
        text = _ESCAPES.sub("", text)
    text = replaced(text, _SPACES, " ")
    for _ in range(_MAX_QUOTE_DEPTH):
        if not _quoted(text):
            break
        text = _QUOTE.sub("", text)
    return _dedented(text)


def _quoted(text: str) -> bool:
    """Does every line that is not blank start with ">"? (A quoted reply may keep blank
    lines unquoted.)"""
    m = _FIRST.match(text)
    if m is None or m.group(1) != ">":
        return False  # (the cheap test first: most texts are not quoted)
    return all(line.startswith(">") for line in text.splitlines() if line.strip())


def _dedented(text: str) -> str:
    """``text`` without the blanks every non-blank line starts with (textwrap.dedent's
    rule, keeping blank lines as they are)."""
    if not _INDENTED.match(text):
        return text  # (the first line that is not blank is not indented: nothing is shared)
    lines = text.split("\n")
    # (character by character is the point: these are indents, not paths)
    common = os.path.commonprefix(  # noqa: RUF071
        [line[:len(line) - len(line.lstrip(" \t"))] for line in lines if line.strip()])
    if not common:
        return text
    n = len(common)
    return "\n".join(line[n:] if line.startswith(common) else line.lstrip(" \t")
                     for line in lines)
