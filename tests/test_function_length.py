"""Every function of the package fits on a screen: at most MAX_LINES lines from its ``def`` (or
first decorator) to its last line, docstring included."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "circuitmath"

#: The most lines a function may take.
MAX_LINES = 80

#: Functions allowed to be longer, ``"path relative to the package:qualified name"`` -> why.
ALLOWED: dict[str, str] = {}


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function in ``tree``, nested ones and methods included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _length(node: ast.AST) -> int:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    return node.end_lineno - first + 1


def long_functions(root: Path) -> dict[str, int]:
    """Every function under ``root`` longer than :data:`MAX_LINES`: ``"path:name"`` -> its lines."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            if (lines := _length(node)) > MAX_LINES:
                out[f"{path.relative_to(root).as_posix()}:{name}"] = lines
    return out


def test_no_function_is_longer_than_a_screen():
    long = {key: lines for key, lines in long_functions(PACKAGE).items() if key not in ALLOWED}
    assert not long, f"functions over {MAX_LINES} lines (split them by job): {long}"


def test_every_allowed_function_is_still_long():
    """An allowance whose function was split, renamed or removed goes too."""
    stale = set(ALLOWED) - set(long_functions(PACKAGE))
    assert not stale, f"allowed but not over {MAX_LINES} lines any more: {sorted(stale)}"


@pytest.mark.parametrize("lines, caught", [(MAX_LINES, False), (MAX_LINES + 1, True)])
def test_a_long_function_is_caught(tmp_path, lines, caught):
    """Negative control: a function of MAX_LINES + 1 lines, nested in a class, is found; one of
    MAX_LINES lines, decorator included, is not."""
    body = "\n".join(f"        x{i} = {i}" for i in range(lines - 3))
    (tmp_path / "m.py").write_text(f"class C:\n    @staticmethod\n    def f():\n{body}\n        return 0\n")
    assert ("m.py:C.f" in long_functions(tmp_path)) is caught
