"""The package's shape: no import cycle (at module level or inside functions), small modules."""

import ast
import re
from pathlib import Path

import pytest

ROOT = (Path(__file__).parents[1] / "circuitmath").resolve()
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
}
MAX_LINES = 600


@pytest.mark.parametrize("name", sorted(_modules()))
def test_modules_are_small_unless_cohesive(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES or name in COHESIVE, f"{name} has {lines} lines"


def test_every_cohesive_exemption_is_still_needed():
    modules = _modules()
    for name in COHESIVE:
        assert len(modules[name].read_text().splitlines()) > MAX_LINES, f"{name} is small now: drop it from COHESIVE"


# -- where an identity's name is written ------------------------------------------------------

#: The most package files whose code may name one identity in a string: its family module and, at
#: most, one more (the module of a transform whose refusals name another identity's route, the
#: table of former names). A weight identity's name is its public transform's Python name, read
#: from the transform (:func:`circuitmath._processing._common.rewrite`), so it is often no string
#: at all.
MAX_FILES_NAMING_AN_IDENTITY = 2


def _literal_words(path: Path) -> set[str]:
    """The words of ``path``'s string literals: the names its code uses. Docstrings are left out
    (prose), and so are ``__all__`` lists (a module's Python names, which ``tests/test_public_api.py``
    checks against its definitions)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if (isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)):
            skipped.add(id(node.body[0].value))
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            skipped |= {id(n) for n in ast.walk(node.value)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            words |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return words


def files_naming(names: set[str], words: dict[Path, set[str]] | None = None) -> dict[str, set[Path]]:
    """For each of ``names``: the package modules whose code names it in a string. ``words``:
    each module's string words (default: the package's, from :func:`_literal_words`)."""
    if words is None:
        words = {p.resolve(): _literal_words(p) for p in sorted(ROOT.rglob("*.py"))}
    return {name: {p for p, w in words.items() if name in w} for name in names}


def test_the_literal_scan_sees_a_name_in_code_but_not_in_a_docstring_or_all(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        '"""fold_layer_norm in a docstring."""\n__all__ = ["remove_key_biases"]\nSTEP = "center_unembed"\n'
        'def f(kind):\n    return f"fold it first ({kind}, fold_value_biases)"\n'
    )
    words = _literal_words(path)
    assert {"center_unembed", "fold_value_biases"} <= words
    assert "fold_layer_norm" not in words and "remove_key_biases" not in words


def test_no_identity_name_is_a_string_in_more_than_two_package_files():
    import circuitmath as cm

    counts = files_naming({identity.name for identity in cm.identities()})
    over = {name: sorted(str(p.relative_to(ROOT)) for p in files) for name, files in counts.items()
            if len(files) > MAX_FILES_NAMING_AN_IDENTITY}
    assert not over, f"named in more than {MAX_FILES_NAMING_AN_IDENTITY} package files: {over}"


def test_negative_control_a_third_module_naming_an_identity_is_caught(tmp_path):
    """Two more modules that type an identity's name (a pipeline table, a refusal) push it over."""
    import circuitmath as cm

    extra = {}
    for stem in ("pipeline_table", "refusal"):
        path = (tmp_path / f"{stem}.py").resolve()
        path.write_text('STEPS = ("fold_layer_norm", "center_reading_weights")\n')
        extra[path] = _literal_words(path)
    words = {p.resolve(): _literal_words(p) for p in sorted(ROOT.rglob("*.py"))}
    counts = files_naming({identity.name for identity in cm.identities()}, words | extra)
    assert len(counts["fold_layer_norm"]) > MAX_FILES_NAMING_AN_IDENTITY
    assert not set(extra) & counts["center_unembed"]


if __name__ == "__main__":  # the figures: python tests/test_layout.py
    import circuitmath as cm

    for name, files in files_naming({identity.name for identity in cm.identities()}).items():
        print(f"{name:32s} {len(files)}  {' '.join(str(p.relative_to(ROOT)) for p in sorted(files))}")
