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
        return dict(folded, **{"unembed.b_U": b_U + torch.arange(b_U.numel(), dtype=b_U.dtype, device=b_U.device)}), folded_cfg

    namespace["my_processing"] = wrong
    quick = settings(max_examples=3, phases=[Phase.generate], deadline=None, database=None)
    with pytest.raises(NotEquivalentError):
        quick(namespace["test_my_processing"])()


# -- the property test against a user's own library ---------------------------------------------


def user_fold_layer_norm(state_dict, cfg):
    """A small library of a user's own, written for TransformerLens-format LayerNorm models of the
    common case (it indexes ``blocks.{l}.attn.W_K``, ``blocks.{l}.ln2.w``, ...): fold each
    LayerNorm's gain and bias into the weights that read its output and centre those readers, as
    the README's ``my_processing`` does with circuitmath's ``fold_layer_norm``."""
    sd = dict(state_dict)

    def fold(norm, weights, biases, d_model_axis):
        w, b = sd.pop(f"{norm}.w"), sd.pop(f"{norm}.b")
        for weight, bias in zip(weights, biases):
            W = sd[weight]
            shape = [1] * W.dim()
            shape[d_model_axis] = -1
            sd[bias] = sd[bias] + (W * b.reshape(shape)).sum(d_model_axis)
            W = W * w.reshape(shape)
            sd[weight] = W - W.mean(d_model_axis, keepdim=True)

    for layer in range(cfg.n_layers):
        block = f"blocks.{layer}"
        attn = f"{block}.attn"
        fold(f"{block}.ln1", [f"{attn}.W_{x}" for x in "QKV"], [f"{attn}.b_{x}" for x in "QKV"], 1)
        if f"{block}.ln2.w" in sd:
            fold(f"{block}.ln2", [f"{block}.mlp.W_in"], [f"{block}.mlp.b_in"], 0)
    fold("ln_final", ["unembed.W_U"], ["unembed.b_U"], 0)
    return sd, cfg.replace(normalization_type="LNPre")


def _readme_property_test(processing):
    """The README's first block executed as copied, its ``test_my_processing`` bound to
    ``processing`` instead of the block's own ``my_processing``."""
    namespace: dict = {"__name__": "readme"}
    exec(compile(python_blocks()[0], "README.md python block 1", "exec"), namespace)
    namespace["my_processing"] = processing
    return namespace["test_my_processing"]


def test_the_readme_property_test_runs_against_a_library_written_for_the_common_case():
    """Issue 16: with its defaults, ``models(...)`` as the README calls it draws only models a
    library indexing ``blocks.{l}.attn.W_K`` can process (no 0-layer, no grouped-query models),
    and the user's correct LayerNorm fold passes."""
    _readme_property_test(user_fold_layer_norm)()


def test_the_user_library_crashes_on_the_models_the_defaults_leave_out():
    """Negative control: the models the defaults no longer draw are those the library cannot
    index (grouped-query keys ``_W_K``), so the test above would crash without the defaults."""
    import pytest
    import torch

    from circuitmath import Config, random_state_dict

    cfg = Config(n_layers=1, d_model=6, n_heads=2, n_key_value_heads=1, d_head=3, d_vocab=7, n_ctx=4, d_mlp=8)
    with pytest.raises(KeyError, match="blocks.0.attn.W_K"):
        user_fold_layer_norm(random_state_dict(cfg, seed=0, dtype=torch.float64), cfg)


def test_a_wrong_user_library_fails_the_readme_property_test():
    """Negative control: the same library with the bias pushed through the gain (``b * w``
    folded instead of ``b``) fails the README's property test."""
    import pytest
    from hypothesis import Phase, settings

    from circuitmath.testing import NotEquivalentError

    def wrong(state_dict, cfg):
        scaled = {k: v * state_dict[k[:-1] + "w"] if k.endswith(".b") and k[:-1] + "w" in state_dict else v
                  for k, v in state_dict.items()}
        return user_fold_layer_norm(scaled, cfg)

    quick = settings(max_examples=5, phases=[Phase.generate], deadline=None, database=None)
    with pytest.raises(NotEquivalentError):
        quick(_readme_property_test(wrong))()
