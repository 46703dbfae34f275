"""Errors about input the user gave us: they name the file and the line."""

from __future__ import annotations


class InputError(Exception):
    """Bad input: ``str()`` reads ``FILE:LINE: message`` (LINE omitted when unknown)."""

    def __init__(self, source: str, line: int | None, message: str) -> None:
        self.source = source
        self.line = line
        self.message = message
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")
