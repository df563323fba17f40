"""The package's shape: no import cycle (at module level or inside functions), small modules."""

import ast
import functools
import inspect
import re
import sys
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


# -- how many files changing one identity touches ----------------------------------------------

#: The most files one weight identity may touch: its identity module and its transform's module,
#: its test file and its chapter (the issue's target). No other package module names a weight
#: identity in a string: the pipeline (``pipeline.py``, ``fused.py``) composes and records the
#: steps through the imported transforms (``fold_layer_norm.identity``), a refusal that names the
#: step to run first takes the name from that step's transform, and the diagnosis's replay refers
#: to the registered Identity objects (``layer_norm_rotation``, registered with a private route
#: as its transform, is recorded by ``rotate_residual_stream`` on an LNPre model: the one module
#: beyond its own it counts is that transform's). What the count leaves out: ``process_weights``'s keywords,
#: the identities' names by the one vocabulary, are parameters of its signature (a public name,
#: like the transforms' callers; a test in ``tests/test_pipeline.py`` pins them to its steps), and
#: tests or chapters other than the identity's own that call its public function.
MAX_FILES_PER_IDENTITY = 4


def _literal_words(path: Path) -> set[str]:
    """The words of ``path``'s string literals, docstrings left out: the names its code uses."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return words


def _source(function) -> Path:
    while isinstance(function, functools.partial):
        function = function.func
    return Path(inspect.getsourcefile(inspect.unwrap(function))).resolve()


def files_per_identity(words: dict[Path, set[str]] | None = None) -> dict[str, tuple[set[Path], list[Path]]]:
    """For each weight identity: the package modules it owns (where it is registered, where its
    transform is written) and the other modules whose code names it in a string (an applied
    record, a pipeline keyword map, a refusal naming the step to run first). Docstrings, callers
    that import its public function, and the curated ``__init__`` re-exports are not counted:
    they go through its public name, which the registry tests pin. ``words``: each module's
    string words (default: the package's, from :func:`_literal_words`)."""
    import circuitmath as cm

    if words is None:
        words = {p.resolve(): _literal_words(p) for p in sorted(ROOT.rglob("*.py")) if p.name != "__init__.py"}
    out = {}
    for identity in cm.identities():
        if identity.compare is not None:
            continue
        own = {Path(sys.modules[identity.build_proof.__module__].__file__).resolve(), _source(identity.transform)}
        public = getattr(cm, identity.function or identity.name, None)
        if callable(public):
            own.add(_source(public))
        out[identity.name] = (own, [p for p, w in words.items() if identity.name in w and p not in own])
    return out


def test_the_file_count_sees_a_name_in_code_but_not_in_a_docstring(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        '"""fold_layer_norm in a docstring."""\nSTEP = "center_unembed"\n'
        'def f(kind):\n    return f"fold it first ({kind}, fold_value_biases)"\n'
    )
    words = _literal_words(path)
    assert {"center_unembed", "fold_value_biases"} <= words and "fold_layer_norm" not in words


def test_negative_control_a_module_naming_an_identity_in_a_string_is_counted(tmp_path):
    """A module outside the identity's own that types its name adds one file to its count."""
    path = (tmp_path / "pipeline.py").resolve()
    path.write_text('FUSED_STEPS = ("fold_layer_norm", "center_reading_weights")\n')
    words = {p.resolve(): _literal_words(p) for p in sorted(ROOT.rglob("*.py")) if p.name != "__init__.py"}
    counted = files_per_identity(words | {path: _literal_words(path)})
    assert path in counted["fold_layer_norm"][1] and path in counted["center_reading_weights"][1]
    assert path not in counted["center_unembed"][1]


def test_changing_one_identity_touches_few_files():
    """Files touched = its own modules + its test file + its chapter + the modules naming it."""
    counts = {name: len(own) + 2 + len(others) for name, (own, others) in files_per_identity().items()}
    assert max(counts.values()) >= 4  # the count sees something
    over = {
        name: sorted(str(p.relative_to(ROOT)) for p in files_per_identity()[name][1])
        for name, count in counts.items() if count > MAX_FILES_PER_IDENTITY
    }
    assert not over, f"over {MAX_FILES_PER_IDENTITY} files: {over} (counts {counts})"


if __name__ == "__main__":  # the figures: python tests/test_layout.py
    for name, (own, others) in files_per_identity().items():
        print(f"{name:32s} {len(own) + 2 + len(others):2d}  beyond its own: {' '.join(str(p.relative_to(ROOT)) for p in others)}")
