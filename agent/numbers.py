"""A number as a person or a tool types it: ASCII digits, not too many of them.

`str.isdigit()` is true of "²" and "٣", which `int()` refuses or reads as a number nobody
typed, and of 5,000 digits, which `int()` refuses past Python's 4,300-digit limit: a
guard by isdigit() let either through to an internal error (exit 70) on a hostile paste.
"""

from __future__ import annotations


def is_number(text: str, most: int = 20) -> bool:
    """Is ``text`` 1 to ``most`` ASCII digits (20 holds any 64-bit counter)?"""
    return 0 < len(text) <= most and text.isascii() and text.isdigit()
