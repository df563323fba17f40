"""Every documented name imports, and the docstring examples run (see --doctest-modules)."""

import importlib
import re
from pathlib import Path

import pytest

import circuitmath

PUBLIC_MODULES = ["circuitmath", "circuitmath.strategies", "circuitmath.testing", "circuitmath.circuits", "circuitmath.render", "circuitmath.io"]


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


README = (Path(__file__).parents[1] / "README.md").read_text()


def test_readme_names_every_public_transform_and_checker():
    from circuitmath import testing

    transforms = [i.function for i in circuitmath.identities() if i.function]
    checkers = [n for n in testing.__all__ if n.startswith("check_")]
    assert transforms and checkers
    missing = [n for n in transforms + checkers + ["process_weights", "assert_equivalent", "diagnose"]
               if not re.search(rf"\b{n}\b", README)]
    assert not missing, f"the README does not name {missing}"


def test_readme_layout_lists_every_module():
    layout = README.split("## Layout", 1)[1].split("```")[1]
    names = set()
    for line in layout.splitlines():
        if line.startswith("  ") and not line.startswith("   "):  # an entry: names, then what it holds
            for word in line.split():
                if not word.endswith((".py", "/")):
                    break
                names.add(word)
    root = Path(__file__).parents[1] / "circuitmath"
    actual = {p.name + ("/" if p.is_dir() else "") for p in root.iterdir()
              if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert actual - names == set(), f"the README's layout misses {sorted(actual - names)}"
    assert names - actual == set(), f"the README's layout lists {sorted(names - actual)}, which do not exist"
