"""Every documented name imports, and the docstring examples run (see --doctest-modules)."""

import importlib

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


def test_readme_names_exist():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for name in ("fold_layer_norm", "assert_equivalent", "strategies"):
        assert name in readme
