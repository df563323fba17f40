"""The README's Python examples run as copied: every ```python block, in order, in one namespace,
and every ``test_*`` function a block defines is called (a hypothesis test runs its examples)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(python_blocks()) >= 2


def test_every_python_example_runs_as_copied():
    namespace: dict = {"__name__": "readme"}
    for number, block in enumerate(python_blocks(), 1):
        exec(compile(block, f"README.md python block {number}", "exec"), namespace)
    tests = [value for name, value in namespace.items() if name.startswith("test_") and callable(value)]
    assert tests, "the README shows a property test"
    for test in tests:
        test()


def test_a_wrong_processing_in_the_readme_example_fails():
    """Negative control: the README's property test fails when the processing is wrong (a bias
    added to the unembed that differs across the vocabulary moves every log-prob)."""
    import pytest
    import torch
    from hypothesis import Phase, settings

    from circuitmath.testing import NotEquivalentError

    namespace: dict = {"__name__": "readme"}
    exec(compile(python_blocks()[0], "README.md python block 1", "exec"), namespace)
    fold = namespace["my_processing"]

    def wrong(state_dict, cfg):
        folded, folded_cfg = fold(state_dict, cfg)
        b_U = folded["unembed.b_U"]
        return dict(folded, **{"unembed.b_U": b_U + torch.arange(b_U.numel(), dtype=b_U.dtype)}), folded_cfg

    namespace["my_processing"] = wrong
    quick = settings(max_examples=3, phases=[Phase.generate], deadline=None, database=None)
    with pytest.raises(NotEquivalentError):
        quick(namespace["test_my_processing"])()
