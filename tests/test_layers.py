"""The shipped package's layers read top-down: cli/daemon/collector -> bundle/watch/report/
ship/predict -> diagnose -> netfilter/parse/probes/capture -> snapshot/errors/quick_init/signals.
Every import of an agent module (lazy ones inside functions too) points down or sideways,
never up, and the graph of subpackages has no circle."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).parent.parent / "agent"
RANK = {
    "__main__": 0, "cli": 0, "daemon": 0, "daemon_http": 0, "collector": 0,
    "kubectl_plugin": 0,
    "bundle": 1, "watch": 1, "report": 1, "ship": 1, "kubereport": 1, "predict": 1,
    "diagnose": 2,
    "netfilter": 3, "parse": 3, "probes": 3, "capture": 3, "kubewatch": 3,
    "snapshot": 4, "errors": 4, "__version__": 4, "agent": 4, "quick_init": 4, "signals": 4,
    "listen": 4, "numbers": 4, "verdict_doc": 4, "terminal": 4, "regular_file": 4,
    "logfmt": 4,
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


def module_edges() -> dict[str, set[str]]:
    """Module -> the agent modules it imports (lazy imports inside functions too)."""
    out: dict[str, set[str]] = {}
    modules = {".".join(p.relative_to(AGENT.parent).with_suffix("").parts).removesuffix(
        ".__init__") for p in AGENT.rglob("*.py")}
    for path in AGENT.rglob("*.py"):
        mod = ".".join(path.relative_to(AGENT.parent).with_suffix("").parts).removesuffix(
            ".__init__")
        deps = out.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("agent"):
                for a in node.names:  # `from agent.x import y`: y may be a module
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
        deps.discard(mod)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path, node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_module_circles() -> None:
    """No module imports one that imports it back, lazily or not (agent.collector.server,
    what a request does, and agent.collector.web, the HTTP server over it, did: web
    imports server, never the reverse)."""
    graph = module_edges()
    assert "agent.collector.server" in graph["agent.collector.web"]
    assert not _cycles(graph), _cycles(graph)
    # the check sees a circle where there is one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
