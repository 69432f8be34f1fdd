"""The package's shape: no import cycle between tensorsocket's modules, and no module too large."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tensorsocket"
MAX_LINES = 400
# The pure state machine: one job, long docstrings. Groups' joining and breaking, restored
# consumers' positions and a restarted producer's numbering live in it, next to the cursors
# they move; the groups' pure rules are in flow_groups.py, its invariants in flow_invariants.py.
LIMITS = {"flow.py": 700}
# The consumer's I/O thread also rejoins a restarted producer: the socket it replaces is its own.
CLASS_LIMITS = {"Flow": 540, "ConsumerIo": 330}


# Being split along their threads (issue 12): drop these entries once they are packages.
def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports anywhere in it (inside functions and
    ``if TYPE_CHECKING:`` blocks too). ``from .x import y`` imports ``x.y`` when that is a
    module, else ``x``; ``from .. import y`` likewise ``y`` or the parent package."""

    def resolve(target: str) -> str:
        while target and target not in known:  # the longest prefix that is one of ours
            target = target.rpartition(".")[0]
        return target

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = node.module or ""
            if node.level:
                parts = package.split(".")
                stem = ".".join(parts[: len(parts) - node.level + 1] + ([stem] if stem else []))
            targets = [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in map(resolve, targets) if t and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same node, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_import_graph_is_read() -> None:
    graph = import_graph()
    assert "tensorsocket.cli.common" in graph["tensorsocket.cli.sweep.trials"]  # from ..common import
    assert "tensorsocket.endpoint" in graph["tensorsocket.cli.status"]  # from .. import endpoint
    assert "tensorsocket.producer" in graph["tensorsocket.cli.serve"]  # inside a function
    assert "tensorsocket.errors" in graph["tensorsocket"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_CLASS_LINES = 300


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_module_size(path: Path) -> None:
    limit = LIMITS.get(str(path.relative_to(PACKAGE)), MAX_LINES)
    lines = len(path.read_text().splitlines())
    assert lines <= limit, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {limit})"


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_class_size(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno} class {node.name}"
            limit = CLASS_LIMITS.get(node.name, MAX_CLASS_LINES)
            assert lines <= limit, f"{where} has {lines} lines (at most {limit})"
