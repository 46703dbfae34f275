"""Paging of the fleet views: every list is read a page at a time from the summaries.

GET /v1/nodes and /v1/services take ``limit`` and ``offset``; the reply stays a JSON array
(as before) and says the rest in headers: ``X-Total-Count`` and, when more remain, a
``Link: <...>; rel="next"``. /v1/nodes/NODE takes ``limit`` and ``before`` (a cursor).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, urlencode

from agent.collector.intake import BadRequest

NODES_PAGE = (500, 5000)  # (default, max) rows per reply
SERVICES_PAGE = (100, 1000)
HISTORY_PAGE = (100, 1000)
SCREEN_NODES = 200  # rows of each table on the HTML page
SCREEN_SERVICES = 100
SCREEN_SERVICE_NODES = 8  # node names shown per service row on the page


@dataclass(frozen=True)
class Page:
    limit: int
    offset: int


def _int(args: dict[str, list[str]], name: str, default: int, low: int, high: int) -> int:
    values = args.get(name)
    if not values:
        return default
    text = values[-1]
    # ASCII digits only: str.isdigit() is true of "²" and "٣", which int() refuses (or
    # reads as a number nobody typed)
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise BadRequest(400, f"{name} must be a whole number, not {text[:20]!r}")
    n = int(text)
    if not low <= n <= high:
        raise BadRequest(400, f"{name} must be between {low} and {high}")
    return n


def page_of(args: dict[str, list[str]], sizes: tuple[int, int]) -> Page:
    default, most = sizes
    return Page(_int(args, "limit", default, 1, most), _int(args, "offset", 0, 0, 10**12))


def cursor(args: dict[str, list[str]]) -> int | None:
    if not args.get("before"):
        return None
    return _int(args, "before", 0, 1, 2**62)


def next_link(path: str, page: Page, total: int) -> str | None:
    """The Link header for the next page, or None on the last one."""
    if page.offset + page.limit >= total:
        return None
    q = urlencode({"limit": page.limit, "offset": page.offset + page.limit})
    return f'<{quote(path)}?{q}>; rel="next"'


def history_link(path: str, limit: int, before: int | None) -> str | None:
    if before is None:
        return None
    return f'<{quote(path)}?{urlencode({"limit": limit, "before": before})}>; rel="next"'
