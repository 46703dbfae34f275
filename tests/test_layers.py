"""The shipped package's layers read top-down: cli/daemon/collector -> bundle/watch/report/
ship -> diagnose -> netfilter/parse/probes/capture -> snapshot/errors/quick_init/signals.
Every import of an agent module (lazy ones inside functions too) points down or sideways,
never up, and the graph of subpackages has no circle."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).parent.parent / "agent"
RANK = {
    "__main__": 0, "cli": 0, "daemon": 0, "daemon_http": 0, "collector": 0,
    "kubectl_plugin": 0,
    "bundle": 1, "watch": 1, "report": 1, "ship": 1, "kubereport": 1,
    "diagnose": 2,
    "netfilter": 3, "parse": 3, "probes": 3, "capture": 3, "kubewatch": 3,
    "snapshot": 4, "errors": 4, "__version__": 4, "agent": 4, "quick_init": 4, "signals": 4,
    "listen": 4,
}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "agent"


def edges() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in AGENT.rglob("*.py"):
        mod = ".".join(path.relative_to(AGENT.parent).with_suffix("").parts)
        src = unit(mod.removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] == "agent":
                targets = ([a.name for a in node.names] if node.module == "agent"
                           else [unit(node.module)])
            elif isinstance(node, ast.Import):
                targets = [unit(a.name) for a in node.names if a.name.startswith("agent.")]
            out.setdefault(src, set()).update(t for t in targets if t != src)
    return out


def test_every_unit_has_a_layer() -> None:
    assert set(edges()) | {t for ts in edges().values() for t in ts} <= set(RANK)


def test_imports_point_down() -> None:
    up = [(src, dst) for src, dsts in edges().items() for dst in dsts
          if RANK[dst] < RANK[src]]
    assert not up, f"upward imports: {up}"


def test_no_circles() -> None:
    graph = edges()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])
