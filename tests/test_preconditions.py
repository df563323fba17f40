"""Every precondition a transform raises is one its identity registers: the same object."""

import ast
import itertools
from pathlib import Path

import pytest
import torch

import circuitmath as cm
from circuitmath._errors import Precondition
from circuitmath._processing._common import require

PROCESSING = Path(__file__).parents[1] / "circuitmath" / "_processing"
BASE = dict(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=9, n_ctx=5, d_mlp=12)

#: Model options that break one precondition or another.
OPTIONS = {
    "normalization_type": ("LN", "LNPre", "RMS", "RMSPre", None),
    "norm_position": ("pre", "post"),
    "positional_embedding_type": ("standard", "shortformer", "rotary"),
    "eps": (1e-5, 0.0),
}


def _configs():
    for values in itertools.product(*OPTIONS.values()):
        changes = dict(zip(OPTIONS, values))
        if changes["norm_position"] == "post" and changes["normalization_type"] is None:
            continue
        try:
            yield cm.Config(**BASE).replace(**changes)
        except cm.CircuitMathError:
            continue  # a combination the config itself refuses


def _unregistered(error: cm.PreconditionError) -> str | None:
    """Why ``error`` names no registered precondition of its identity (``None``: it does)."""
    identity = cm.get_identity(error.identity)
    registered = identity.preconditions + identity.check_requires
    if not isinstance(error.precondition, Precondition):
        return f"{error.identity}: {error.precondition!r} is a plain string, not a Precondition"
    if not any(error.precondition is p for p in registered):
        return f"{error.identity}: {error.precondition!r} is not among its registered preconditions"
    return None


def test_the_check_catches_a_string_or_an_unregistered_object():
    for precondition in ("pre-norm", Precondition("made up")):
        with pytest.raises(cm.PreconditionError) as caught:
            require("fold_layer_norm", precondition, False, "detail")
        assert _unregistered(caught.value)  # the sweep below can fail


def test_require_is_called_with_named_preconditions_only():
    for path in sorted(PROCESSING.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and len(node.args) > 1:
                assert not isinstance(node.args[1], ast.Constant), f"{path.name}:{node.lineno}: a literal precondition"


def test_every_raised_precondition_is_registered():
    raised, problems = set(), []
    weight_identities = [i for i in cm.identities() if i.compare is None]
    for cfg in _configs():
        state_dict = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
        for identity in weight_identities:
            for applied in ((), (identity.name,)):
                try:
                    prepared, prepared_cfg = identity.prepare(state_dict, cfg) if identity.prepare else (state_dict, cfg)
                    identity.transform(prepared, prepared_cfg.replace(applied=prepared_cfg.applied + applied))
                except cm.PreconditionError as error:
                    raised.add((error.identity, str(error.precondition)))
                    if (why := _unregistered(error)) is not None:
                        problems.append(why)
    assert not problems, sorted(set(problems))
    # the sweep reaches every raisable precondition of the folds, the centerings and the norms
    for name, precondition in [("fold_layer_norm", "normalization_type is LN"), ("fold_layer_norm", "pre-norm"),
                               ("center_reading_weights", "readers see LNPre(x), which is orthogonal to 1"),
                               ("center_writing_weights", "every reader sits behind a centering norm"),
                               ("fold_rms_norm", "normalization_type is RMS"), ("rescale_residual_stream", "eps == 0"),
                               ("remove_key_biases", "keys and queries are not rotated by position"),
                               ("shortformer_to_tables", "positional_embedding_type is shortformer"),
                               ("fold_value_biases", "not already applied")]:
        assert (name, precondition) in raised, (name, precondition)


#: Models that break the circuits' preconditions one way or another.
CIRCUIT_CONFIGS = [
    cm.Config(n_layers=n_layers, d_model=8, n_heads=2, d_head=4, d_vocab=9, n_ctx=5, d_mlp=d_mlp).replace(**changes)
    for n_layers in (0, 1, 2, 3)
    for d_mlp in (None, 12)
    for changes in ({}, {"positional_embedding_type": "rotary"}, {"norm_position": "post"}, {"n_key_value_heads": 1})
]


def _circuit_calls(state_dict, cfg, tokens):
    """Every public circuit function that can refuse a model, called on it."""
    from circuitmath import circuits

    yield lambda: circuits.ov_circuits(state_dict, cfg)
    yield lambda: circuits.qk_circuits(state_dict, cfg)
    yield lambda: circuits.full_ov_circuits(state_dict, cfg)
    yield lambda: circuits.composition_scores(state_dict, cfg)
    yield lambda: circuits.composition_scores(state_dict, cfg, materialise=True)
    yield lambda: circuits.copying_scores(state_dict, cfg)
    yield lambda: circuits.attention_patterns(state_dict, cfg, tokens)
    yield lambda: circuits.path_terms(state_dict, cfg, tokens)
    yield lambda: circuits.score_terms(state_dict, cfg, tokens, 1)
    # a basis that scales the two dimensions of a rotary pair differently: it does not commute with the rotation
    diagonal = torch.diag(torch.arange(1, cfg.d_head + 1, dtype=torch.float64))
    bases = diagonal.expand(cfg.n_layers, cfg.n_key_value_heads or cfg.n_heads, -1, -1)
    yield lambda: circuits.change_head_bases(state_dict, cfg, query_key=bases, value=bases)


def test_every_precondition_a_circuit_raises_is_registered():
    """The circuit identities' routes and the public circuit functions refuse by registered objects."""
    raised, problems = set(), []
    circuit_identities = [i for i in cm.identities() if i.compare is not None]
    for cfg in CIRCUIT_CONFIGS:
        state_dict = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
        tokens = torch.arange(cfg.n_ctx)[None] % cfg.d_vocab
        calls = [lambda i=i: i.check(state_dict, cfg, tokens) for i in circuit_identities]
        for call in [*calls, *_circuit_calls(state_dict, cfg, tokens)]:
            try:
                call()
            except cm.PreconditionError as error:
                raised.add((error.identity, str(error.precondition)))
                if (why := _unregistered(error)) is not None:
                    problems.append(why)
            except cm.InputError:
                pass  # an argument out of range (score_terms' layer on a smaller model), not a precondition
    assert not problems, sorted(set(problems))
    # the sweep reaches the circuits' refusals
    for name, precondition in [("attention_head_tensor_form", "the model has attention layers"),
                               ("composition_scores_from_factors", "one QK matrix per head"),
                               ("two_layer_path_expansion", "attention-only"),
                               ("two_layer_path_expansion", "pre-norm"),
                               ("zero_layer_bigram", "zero layers"), ("one_layer_path_expansion", "one layer"),
                               ("qk_composition_terms", "at least two layers"),
                               ("refactor_factored_attn_matrices", "keys and queries are not rotated by position")]:
        assert (name, precondition) in raised, (name, precondition)


def test_no_circuit_module_raises_a_precondition_by_hand():
    """Circuit code refuses through ``require`` with a named object, never ``PreconditionError("...")``."""
    sources = [*(PROCESSING.parent / "circuits").glob("*.py"), *(PROCESSING.parent / "_identities").glob("*.py")]
    for path in sorted(sources):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("require", "PreconditionError"):
                if len(node.args) > 1:
                    assert not isinstance(node.args[1], ast.Constant), f"{path.name}:{node.lineno}: a literal precondition"
                    assert not isinstance(node.args[1], ast.JoinedStr), f"{path.name}:{node.lineno}: a literal precondition"
