"""The package's shape: no import cycle (at module level or inside functions), small modules."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "circuitmath"
PACKAGE = "circuitmath"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The circuitmath modules ``name`` imports anywhere in its source (``from X import y`` is an
    import of ``X.y`` when that is a module, else of ``X``)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return (out & known) - {name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes (first == last), or ``None``. A package's own
    ``__init__`` importing its submodules is no cycle unless a submodule imports the package back."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_the_import_walk_sees_relative_and_lazy_imports():
    graph = import_graph()
    assert "circuitmath._compare" in graph["circuitmath._registry"]
    assert "circuitmath.io" in graph["circuitmath._cli"]


def test_no_import_cycle_in_circuitmath():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)



#: Modules allowed over :data:`MAX_LINES`, each one cohesive thing.
COHESIVE = {
    "circuitmath._identities.composition": "one family of proofs: composition scores, SVDs and their invariances",
    "circuitmath._files": "one converter per supported architecture and the safetensors reader",
    "circuitmath._identities.rotation": "one family of proofs: the residual-stream symmetries, their twins and checks",
}
MAX_LINES = 600


@pytest.mark.parametrize("name", sorted(_modules()))
def test_modules_are_small_unless_cohesive(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES or name in COHESIVE, f"{name} has {lines} lines"
