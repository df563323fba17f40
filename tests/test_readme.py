"""The README is a guide of at most 12 KB whose examples run as copied: every ```python block, in
order, in one namespace (in a scratch folder: an example writes a model file), every ``test_*``
function a block defines is called (a hypothesis test runs its examples), and every
``python -m circuitmath`` line of a ```sh block then runs in that folder and exits 0."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LARGEST = 12 * 1024  # bytes: a guide, with the reference in the book


def python_blocks(text: str | None = None) -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text() if text is None else text, flags=re.S)


def cli_lines(text: str | None = None) -> list[str]:
    """Every ``python -m circuitmath`` command of the README's ```sh blocks, comments removed."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text() if text is None else text, flags=re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
            if line.startswith("python -m circuitmath ")]


def property_block(examples: int | None = None) -> str:
    """The README's property-test example: the block that defines ``my_processing``; with
    ``examples``, its ``@settings(...)`` line draws that many examples, generated only."""
    (block,) = [b for b in python_blocks() if "def my_processing" in b]
    if examples is None:
        return block
    line = f"@settings(max_examples={examples}, phases=[Phase.generate], deadline=None, database=None)"
    quick, count = re.subn(r"^@settings\(.*\)$", line, block, flags=re.M)
    assert count == 1, "the README's property test sets its own settings (no deadline under load)"
    return "from hypothesis import Phase\n" + quick


def test_the_readme_is_a_guide_of_at_most_12_kb():
    size = len(README.read_bytes())
    assert size <= LARGEST, f"README.md is {size} bytes; the reference belongs in the book's chapters"


def test_the_readme_has_the_two_commands_and_three_examples():
    text = README.read_text()
    assert "make test" in text and "make book" in text  # CI runs `make test` (.ci/run)
    assert len(python_blocks()) >= 3 and len(cli_lines()) >= 3


def test_every_relative_link_of_the_readme_names_a_file():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert links, "the README links to the book's chapters"
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_link_check_fails_on_a_missing_chapter_negative_control():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", "see [it](book/no_such_chapter.md)")
    assert [link for link in links if not (ROOT / link).is_file()] == ["book/no_such_chapter.md"]


def _run_python_examples(folder: Path) -> dict:
    namespace: dict = {"__name__": "readme"}
    here = Path.cwd()
    os.chdir(folder)
    try:
        for number, block in enumerate(python_blocks(), 1):
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
    finally:
        os.chdir(here)
    return namespace


def _run_cli(line: str, folder: Path) -> subprocess.CompletedProcess:
    """``line`` (``python -m circuitmath ...``) run in ``folder`` with this interpreter and this tree's package."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *line.split()[1:]], cwd=folder, capture_output=True, text=True,
                          timeout=600, env=env)


def test_every_python_example_runs_as_copied(tmp_path):
    namespace = _run_python_examples(tmp_path)
    tests = [value for name, value in namespace.items() if name.startswith("test_") and callable(value)]
    assert tests, "the README shows a property test"
    for test in tests:
        test()


def test_every_command_line_example_runs_as_copied(tmp_path):
    """The shell example runs after the Python ones, in the same folder (they write its model)."""
    _run_python_examples(tmp_path)
    for line in cli_lines():
        done = _run_cli(line, tmp_path)
        assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_command_line_check_fails_a_wrong_processing_negative_control(tmp_path):
    """The README's ``check --processed`` line exits 1 when the processed folder is another model."""
    from circuitmath import io

    _run_python_examples(tmp_path)
    state_dict, cfg = io.load(tmp_path / "model.safetensors")
    io.save(tmp_path / "other.safetensors", {k: v * 1.01 if k == "blocks.0.attn.W_Q" else v
                                             for k, v in state_dict.items()}, cfg)
    (check,) = [line for line in cli_lines() if "--processed" in line]
    done = _run_cli(check.replace("--processed processed", "--processed other.safetensors"), tmp_path)
    assert done.returncode == 1, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])


def test_a_wrong_processing_in_the_readme_example_fails():
    """Negative control: the README's property test fails when the processing is wrong (a bias
    added to the unembed that differs across the vocabulary moves every log-prob)."""
    import pytest
    import torch

    from circuitmath.testing import NotEquivalentError

    namespace: dict = {"__name__": "readme"}
    exec(compile(property_block(examples=3), "README.md property test", "exec"), namespace)
    fold = namespace["my_processing"]

    def wrong(state_dict, cfg):
        folded, folded_cfg = fold(state_dict, cfg)
        b_U = folded["unembed.b_U"]
        return dict(folded, **{"unembed.b_U": b_U + torch.arange(b_U.numel(), dtype=b_U.dtype, device=b_U.device)}), folded_cfg

    namespace["my_processing"] = wrong
    with pytest.raises(NotEquivalentError):
        namespace["test_my_processing"]()


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


def _readme_property_test(processing, examples: int | None = None):
    """The README's property-test block executed as copied, its ``test_my_processing`` bound to
    ``processing`` instead of the block's own ``my_processing``."""
    namespace: dict = {"__name__": "readme"}
    exec(compile(property_block(examples), "README.md property test", "exec"), namespace)
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

    from circuitmath.testing import NotEquivalentError

    def wrong(state_dict, cfg):
        scaled = {k: v * state_dict[k[:-1] + "w"] if k.endswith(".b") and k[:-1] + "w" in state_dict else v
                  for k, v in state_dict.items()}
        return user_fold_layer_norm(scaled, cfg)

    with pytest.raises(NotEquivalentError):
        _readme_property_test(wrong, examples=5)()
