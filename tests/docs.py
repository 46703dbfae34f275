"""The project's documentation as the tests read it: README.md, then the pages of the
docs site (docs/mkdocs.yml's nav) in their order. A command or a table a test holds the
docs to may live on any of them."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG = DOCS / "mkdocs" / "mkdocs.yml"


def _nav(items: list[object]) -> list[str]:
    out: list[str] = []
    for item in items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            out += _nav(value)
        elif isinstance(value, str):
            out.append(value)
    return out


def pages() -> list[Path]:
    """README.md, then every page of the site's nav, in order."""
    nav = _nav(yaml.safe_load(CONFIG.read_text())["nav"])
    return [README, *(DOCS / p for p in nav)]


def text() -> str:
    return "\n".join(p.read_text() for p in pages())
