"""Every documented name imports, and the docstring examples run (see --doctest-modules); the book
uses public names only."""

import ast
import functools
import importlib
import inspect
import re
from pathlib import Path

import pytest

import circuitmath

PUBLIC_MODULES = [
    "circuitmath", "circuitmath.strategies", "circuitmath.testing", "circuitmath.circuits", "circuitmath.render",
    "circuitmath.io", "circuitmath.notation", "circuitmath.zoo", "circuitmath.zoo.induction", "circuitmath.zoo.train",
]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_name_in_all_imports(module):
    mod = importlib.import_module(module)
    assert mod.__all__, f"{module} documents no names"
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


def test_public_names_have_docstrings():
    for name in circuitmath.__all__:
        obj = getattr(circuitmath, name)
        assert obj.__doc__ and obj.__doc__.strip(), f"circuitmath.{name} has no docstring"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_functions_classes_and_modules_have_docstrings(module):
    mod = importlib.import_module(module)
    for name in mod.__all__:
        obj = getattr(mod, name)
        if callable(obj) or inspect.ismodule(obj):
            assert (obj.__doc__ or "").strip(), f"{module}.{name} has no docstring"


# -- the book reads public names only ---------------------------------------------------------

BOOK = Path(__file__).parents[1] / "book"


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


@functools.lru_cache(maxsize=None)
def _is_module(dotted: str) -> bool:
    try:
        importlib.import_module(dotted)
    except ModuleNotFoundError:
        return False
    return True


def _documented(module: str, name: str) -> bool:
    """``name`` is public in the public ``module``: listed in its ``__all__``, or a public submodule."""
    if _private(module) or _private(name):
        return False
    return name in getattr(importlib.import_module(module), "__all__", ()) or _is_module(f"{module}.{name}")


def _chain(node: ast.Attribute) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; ``None`` unless it starts at a plain name."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None


def undocumented_uses(cells: list[str]) -> list[str]:
    """What the code cells of one page (one namespace) use of circuitmath that is not public: a
    private module or name imported (``circuitmath._x``, ``from circuitmath.zoo import _x``), a
    name imported that its module's ``__all__`` does not list, and an attribute of an imported
    circuitmath module that is neither in its ``__all__`` nor a public submodule (``cm._x``,
    ``zoo._x.y``, ``zoo.SOMETHING_UNLISTED``)."""
    trees = [ast.parse(cell) for cell in cells]
    modules: dict[str, str] = {}  # a name bound to a circuitmath module -> the module
    out = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "circuitmath":
                        if _private(alias.name):
                            out.append(alias.name)
                        modules[alias.asname or "circuitmath"] = alias.name if alias.asname else "circuitmath"
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "circuitmath":
                if _private(node.module):
                    out.append(node.module)
                    continue
                for alias in node.names:
                    if not _documented(node.module, alias.name):
                        out.append(f"{node.module}.{alias.name}")
                    elif _is_module(f"{node.module}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for tree in trees:
        for node in ast.walk(tree):
            chain = _chain(node) if isinstance(node, ast.Attribute) else None
            if not chain or chain[0] not in modules:
                continue
            module = modules[chain[0]]
            for depth, attr in enumerate(chain[1:], 2):
                if not _documented(module, attr):
                    out.append(".".join(chain[:depth]))
                    break
                if not _is_module(f"{module}.{attr}"):
                    break
                module = f"{module}.{attr}"
    return list(dict.fromkeys(out))


def _code_cells(text: str) -> list[str]:
    """The source of every ``{code-cell}`` of a MyST page, its ``:option:`` lines left out."""
    cells = re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```", text, re.S | re.M)
    return ["\n".join(line for line in cell.splitlines() if not line.startswith(":")) for cell in cells]


@pytest.mark.parametrize("code, found", [
    ("from circuitmath._algebra import is_zero", ["circuitmath._algebra"]),
    ("from circuitmath.zoo import _induction as induction", ["circuitmath.zoo._induction"]),
    ("import circuitmath._proof", ["circuitmath._proof"]),
    ("import circuitmath as cm\ncm._registry.registered()", ["cm._registry"]),
    ("from circuitmath import zoo\nx = zoo._corpus.corpus_tokens", ["zoo._corpus"]),
    ("import circuitmath as cm\ncm.zoo._corpus", ["cm.zoo._corpus"]),
    ("from circuitmath.zoo.train import weights_digest", ["circuitmath.zoo.train.weights_digest"]),
    ("from circuitmath import zoo\nzoo.json", ["zoo.json"]),
    ("import circuitmath as cm\nfrom circuitmath.zoo import induction\ncm.zoo.load('a'); induction.positional_share", []),
    ("import circuitmath as cm\nother._private; cm.Config.__doc__; cm.forward(1)._x", []),
])
def test_the_use_finder_finds_each_form(code, found):
    assert undocumented_uses([code]) == found


def test_the_cell_reader_sees_every_code_cell():
    page = "text\n\n```{code-cell} ipython3\n:tags: [hide-input]\n\nimport circuitmath._x\n```\n\n```python\nnot a cell\n```\n"
    assert _code_cells(page) == ["\nimport circuitmath._x"]
    assert sum(len(_code_cells(p.read_text())) for p in BOOK.glob("*.md")) > 100


@pytest.mark.parametrize("page", sorted(p.name for p in BOOK.glob("*.md")))
def test_the_book_uses_public_names_only(page):
    used = undocumented_uses(_code_cells((BOOK / page).read_text()))
    assert not used, f"book/{page} uses circuitmath names that are not public: {used}"


def test_the_shared_page_helpers_use_public_names_only():
    used = undocumented_uses([(BOOK / "pages.py").read_text()])
    assert not used, f"book/pages.py uses circuitmath names that are not public: {used}"
