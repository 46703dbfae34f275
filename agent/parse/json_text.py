"""JSON decoding whose errors name the file and the line."""

from __future__ import annotations

import json
from typing import Any

from agent.errors import InputError


def loads(text: str, source: str) -> Any:
    """Decode JSON; syntax errors become InputError with their line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(source, e.lineno, f"bad JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        # Too deeply nested, or an integer too long to convert.
        raise InputError(source, None, f"bad JSON: {e}") from None
