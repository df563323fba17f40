"""The package's shape: no import cycle (at module level or inside functions), small modules."""

import ast
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
            target = _imported_from(name, is_package, node)
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return (out & known) - {name}


def _imported_from(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name of the module that ``from ... import`` in module ``name`` imports from."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


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


# -- private names stay in their sub-package --------------------------------------------------


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def private_names_imported_across(modules: dict[str, Path]) -> list[str]:
    """Each ``from X import _name`` (a function, class or constant, not a module) in a module of
    another sub-package than ``X``'s: a private module is private to the package that holds it,
    so what other sub-packages use from it has a name without an underscore. Importing a private
    *module* (``from .. import _identities``) is no such import."""
    found = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _imported_from(name, is_package, node)
            if target not in modules or _package_of(target, modules[target]) == _package_of(name, path):
                continue
            found += [f"{name}: from {target} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and f"{target}.{a.name}" not in modules]
    return found


def test_no_private_name_is_imported_across_sub_packages():
    found = private_names_imported_across(_modules())
    assert not found, "private names imported from another sub-package:\n" + "\n".join(found)


def test_negative_control_a_private_name_imported_across_is_found(tmp_path):
    """A copy of two modules of different sub-packages: a private function imported across is
    found; the same function imported within its sub-package, and a private module imported
    across, are not."""
    package = tmp_path / PACKAGE
    (package / "_inner").mkdir(parents=True)
    for init in (package / "__init__.py", package / "_inner" / "__init__.py"):
        init.write_text("")
    (package / "_inner" / "_tools.py").write_text("def _helper():\n    return 1\n")
    (package / "_inner" / "_near.py").write_text("from ._tools import _helper\n")
    (package / "_far.py").write_text("from . import _inner\n\n\ndef f():\n    from ._inner._tools import _helper\n")
    modules = {".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
               for p in sorted(package.rglob("*.py"))}
    assert private_names_imported_across(modules) == [
        "circuitmath._far: from circuitmath._inner._tools import _helper"]


# -- no context variable steers control flow ---------------------------------------------------

#: Modules allowed a ``ContextVar``, each with its reason. What a caller must know is an argument
#: or a return value. The one left is the allocator's policy for processed tensors: the pool of
#: memory maps reused within ``recycling()`` (streamed processing) and the huge-page advice
#: withheld within ``without_huge_pages()`` (the checks). It decides where a tensor's memory
#: comes from, never its values nor any verdict, and reaches every tensor a transform
#: allocates: as an argument it would be one on every transform.
CONTEXT_VARIABLES = {
    "circuitmath._processing._memory": "the allocator's policy (maps recycled, huge pages advised), read by new_tensor",
}


def context_variables(modules: dict[str, Path]) -> dict[str, list[int]]:
    """The lines of each module that name ``ContextVar`` (imported, or as ``contextvars.ContextVar``)."""
    found: dict[str, list[int]] = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            named = (isinstance(node, ast.Name) and node.id == "ContextVar"
                     or isinstance(node, ast.Attribute) and node.attr == "ContextVar"
                     or isinstance(node, ast.ImportFrom) and any(a.name == "ContextVar" for a in node.names))
            if named:
                found.setdefault(name, []).append(node.lineno)
    return found


def test_no_context_variable_steers_control_flow():
    found = context_variables(_modules())
    unexplained = {name: lines for name, lines in found.items() if name not in CONTEXT_VARIABLES}
    assert not unexplained, f"ContextVar used (pass an argument or return a value instead): {unexplained}"
    stale = set(CONTEXT_VARIABLES) - set(found)
    assert not stale, f"no ContextVar left in {stale}: drop it from CONTEXT_VARIABLES"


def test_negative_control_a_context_variable_is_found(tmp_path):
    """Each way of naming one is found; a word in a string or a comment is not."""
    snippets = {
        "a": "from contextvars import ContextVar\nX: ContextVar[int] = ContextVar('x', default=0)\n",
        "b": "import contextvars\n\n\ndef f():\n    return contextvars.ContextVar('y')\n",
        "c": "import contextvars as cv\nY = cv.ContextVar('y')\n",
        "d": "TEXT = 'a ContextVar steers nothing here'  # nor a ContextVar in a comment\n",
    }
    for stem, text in snippets.items():
        (tmp_path / f"{stem}.py").write_text(text)
    found = context_variables({stem: tmp_path / f"{stem}.py" for stem in snippets})
    assert found == {"a": [1, 2, 2], "b": [5], "c": [2]}


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


# -- adding an identity: four files, measured on a copy of the package -------------------------

#: A throwaway identity's family module: negating every head's value map, value bias and output
#: map leaves each head's output unchanged, ``A (X (-W_V) + 1 (-b_V)) (-W_O) = A (X W_V + 1 b_V) W_O``.
THROWAWAY_FAMILY = '''"""Negating the value and output maps of every head together."""

from __future__ import annotations

from sympy import MatAdd, MatMul, MatrixSymbol, OneMatrix, Symbol

from .._processing._common import NOT_APPLIED, rewrite
from .._proof import Proof, Step, Twin
from .._registry import {half_precision_import}NOTHING_SHOWN, Identity, register
from .._state import attention_names, validate_state_dict

CHAPTER = "attention_weights"

n, d, e = (Symbol(s, positive=True, integer=True) for s in "nde")
A, X = MatrixSymbol("A", n, n), MatrixSymbol("X", n, d)
W_V, b_V, W_O = MatrixSymbol("W_V", d, e), MatrixSymbol("b_V", 1, e), MatrixSymbol("W_O", e, d)


@rewrite
def negate_values(state_dict, cfg, *, identity):
    """Negate every head's ``W_V`` ``[heads, d_model, d_head]``, ``b_V`` ``[heads, d_head]`` and ``W_O``."""
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    weight, bias, _heads = attention_names(cfg, "V")
    for layer in range(cfg.n_layers):
        for name in (weight, bias, "W_O"):
            out[f"blocks.{{layer}}.attn.{{name}}"] = -state_dict[f"blocks.{{layer}}.attn.{{name}}"]
    return out, cfg


def _head(values, bias, output):
    return MatMul(A, MatAdd(MatMul(X, values), MatMul(OneMatrix(n, 1), bias)), output)


def _proof() -> Proof:
    rhs = _head(W_V, b_V, W_O)
    return Proof(
        lhs=_head(-W_V, -b_V, -W_O),
        rhs=rhs,
        steps=(Step(rhs, "(-M)(-N) = M N"),),
        explicit_dims={{n: 3, d: 3, e: 2}},
        twins=(Twin("bias_kept", "negate W_V and W_O but keep b_V", _head(-W_V, b_V, -W_O), rhs),),
    )


def _bias_kept(state_dict, cfg):
    """Negate W_V and W_O but keep b_V."""
    out, out_cfg = negate_values(state_dict, cfg)
    _weight, bias, _heads = attention_names(cfg, "V")
    for layer in range(cfg.n_layers):
        out[f"blocks.{{layer}}.attn.{{bias}}"] = state_dict[f"blocks.{{layer}}.attn.{{bias}}"]
    return out, out_cfg


NEGATE_VALUES = register(
    Identity(
        title="Negating the value and output maps together",
        summary="A (X (-W_V) + 1 (-b_V)) (-W_O) = A (X W_V + 1 b_V) W_O",
        preconditions=(NOT_APPLIED,),
        build_proof=_proof,
        transform=negate_values,
        wrong_rewrites={{"bias_kept": _bias_kept}},
        postcondition=NOTHING_SHOWN,{half_precision}
    )
)
'''

#: Its test file.
THROWAWAY_TEST = '''import torch

import circuitmath as cm


def test_negating_values_and_outputs_keeps_the_log_probs():
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    identity = cm.get_identity("negate_values")
    out, out_cfg = identity.transform(sd, cfg)
    assert out_cfg.applied == ("negate_values",) and torch.equal(out["blocks.0.attn.W_O"], -sd["blocks.0.attn.W_O"])
    cm.assert_equivalent(sd, out, cfg, after_cfg=out_cfg)
    report = identity.prove()
    assert report.ok and [t.name for t in report.twins if t.rejected] == ["bias_kept"]
'''

#: Its section, appended to its chapter.
THROWAWAY_SECTION = '''

## Negating values and outputs

`negate_values` negates every head's value map and output map together.
'''

#: Its public names: a line in each of the two static lists of public names
#: (``circuitmath/__init__.py``, ``circuitmath/testing.py``), with their entries in ``__all__``.
THROWAWAY_EXPORT = "from ._identities.signs import negate_values as negate_values"
THROWAWAY_CHECKER = ("from ._identities.signs import negate_values as _negate_values\n"
                     "check_negate_values, assert_negate_values = _pair(_negate_values)")

#: The registry-driven tests run on the copy: its checker (recognises the exact rewrite through
#: the diagnosis's replay, names each wrong rewrite), its half-precision behaviour, the book's
#: list, its postcondition stated, and the static public names held to the registry.
REGISTRY_DRIVEN = ["tests/test_checkers.py", "tests/test_accuracy.py", "tests/test_registry.py", "tests/test_applied.py"]
SELECTED = ("negate_values or declares_its_half_precision or book_lists_every_identity or states_its_postcondition"
            " or checkers_come_from_the_registry or static_checker_names_are_the_registry_s")


def _export(path: Path, anchor: str, line: str, names: list[str]) -> None:
    """``line`` added to the module ``path`` after its line ``anchor``, and ``names`` to its ``__all__``."""
    text = path.read_text()
    assert anchor in text and "__all__ = [\n" in text
    text = text.replace(anchor, anchor + "\n" + line, 1)
    path.write_text(text.replace("__all__ = [\n", "__all__ = [\n" + "".join(f'    "{n}",\n' for n in names), 1))


def _copy_with_throwaway(root: Path, *, half_precision: bool, public_names: bool = True) -> list[Path]:
    """A copy of the package, its tests and book under ``root``, with the throwaway identity added;
    returns the files edited: its four (family module, the line listing families, its tests, its
    book section) and, with ``public_names``, the two static lists of public names."""
    import shutil

    repository = ROOT.parent
    shutil.copytree(ROOT, root / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repository / "book", root / "book", ignore=shutil.ignore_patterns("_build", "_extra", "__pycache__"))
    (root / "tests").mkdir()
    for name in ["conftest.py", "support.py", *(Path(t).name for t in REGISTRY_DRIVEN)]:
        shutil.copy(repository / "tests" / name, root / "tests" / name)
    shutil.copy(repository / "pyproject.toml", root / "pyproject.toml")
    family = root / PACKAGE / "_identities" / "signs.py"
    family.write_text(THROWAWAY_FAMILY.format(
        half_precision_import="MOVES_ENTRIES, " if half_precision else "",
        half_precision="\n        half_precision=MOVES_ENTRIES," if half_precision else "",
    ))
    families = root / PACKAGE / "_identities" / "__init__.py"
    text = families.read_text()
    last = [line for line in text.splitlines() if re.fullmatch(r"from \. import \w+  # noqa: F401", line)][-1]
    families.write_text(text.replace(last, last + "\nfrom . import signs  # noqa: F401", 1))
    (root / "tests" / "test_signs.py").write_text(THROWAWAY_TEST)
    chapter = root / "book" / "attention_weights.md"
    chapter.write_text(chapter.read_text() + THROWAWAY_SECTION)
    edited = [family, families, root / "tests" / "test_signs.py", chapter]
    if public_names:
        _export(root / PACKAGE / "__init__.py", "from ._weights import random_state_dict as random_state_dict",
                THROWAWAY_EXPORT, ["negate_values"])
        _export(root / PACKAGE / "testing.py",
                "check_fold_logit_scale, assert_fold_logit_scale = _pair(_transforms.fold_logit_scale)",
                THROWAWAY_CHECKER, ["check_negate_values", "assert_negate_values"])
        edited += [root / PACKAGE / "__init__.py", root / PACKAGE / "testing.py"]
    return edited


def _run_registry_tests(root: Path):
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_signs.py",
         *REGISTRY_DRIVEN, "-k", f"{SELECTED} or keeps_the_log_probs"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )


def test_an_identity_added_in_four_files_and_two_public_names_passes_the_registry_driven_tests(tmp_path):
    """Its family module, the line listing families, its test file and its book section, and its
    public transform and checker in the two static lists of public names (a line and ``__all__``
    entries each): the files changed in the copy are exactly these six, and its registry-driven
    tests pass with the throwaway identity among them (and run it: each test named after it ran)."""
    edited = _copy_with_throwaway(tmp_path, half_precision=True)
    assert len(edited) == 6
    changed = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
               and not _same_as_repository(tmp_path, p)}
    assert changed == {p.relative_to(tmp_path) for p in edited}
    result = _run_registry_tests(tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", result.stdout).group(1))
    # its checker (exact rewrite, wrong rewrites), half precision (two dtypes), the registry guards, its test
    assert passed >= 10, result.stdout[-2000:]


def test_negative_control_an_identity_missing_a_registry_hook_fails(tmp_path):
    """The same identity without its half-precision behaviour declared: the registry guard fails."""
    _copy_with_throwaway(tmp_path, half_precision=False)
    result = _run_registry_tests(tmp_path)
    assert result.returncode != 0
    assert "test_every_weight_identity_declares_its_half_precision_behaviour" in result.stdout, result.stdout[-3000:]


def test_negative_control_a_public_transform_missing_its_public_names_fails(tmp_path):
    """The same identity in its four files only: its public transform is not ``circuitmath.negate_values``
    and has no static ``check_negate_values``, and the tests holding the public names to the
    registry fail: the two lists of public names are files an identity with a public transform needs."""
    assert len(_copy_with_throwaway(tmp_path, half_precision=True, public_names=False)) == 4
    result = _run_registry_tests(tmp_path)
    assert result.returncode != 0
    for test in ("test_the_checkers_come_from_the_registry", "test_the_static_checker_names_are_the_registry_s"):
        assert test in result.stdout, result.stdout[-3000:]


def _same_as_repository(root: Path, path: Path) -> bool:
    original = ROOT.parent / path.relative_to(root)
    return original.exists() and original.read_bytes() == path.read_bytes()
