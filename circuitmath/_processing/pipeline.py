"""Every weight-processing step of the source notes, in one call and in an order that keeps each exact."""

from __future__ import annotations

import torch

from .._config import Config
from .._state import StateDict, validated
from ._common import rewrite, untied
from .dispatch import fused_first, only_fused, processed
from .half_precision import half_by_parts
from .steps import StepDefaults, requested as requested_steps

__all__ = ["process_weights"]


@rewrite(composes=True, records=False, check_output=False)  # no autograd; the output is checked below, once
def process_weights(
    state_dict: StateDict,
    cfg: Config,
    *,
    fold_ln: bool | None = StepDefaults.fold_ln,
    center_writing_weights: bool | None = StepDefaults.center_writing_weights,
    center_unembed: bool | None = StepDefaults.center_unembed,
    fold_value_biases: bool | None = StepDefaults.fold_value_biases,
    refactor_factored_attn_matrices: bool | None = StepDefaults.refactor_factored_attn_matrices,
    identity: str,
) -> tuple[dict[str, torch.Tensor], Config]:
    """Apply the weight-processing steps of the source notes, each only where it is exact.

    Each keyword takes ``True`` (apply the step; if this model breaks one of its preconditions,
    raise that step's :class:`~circuitmath.PreconditionError`), ``False`` (leave it out) or
    ``None`` (apply it if its preconditions hold, leave it out otherwise). The defaults, ``None``
    for the first four steps and ``False`` for the refactor, apply what is exact for the model's
    architecture: every step on a pre-LayerNorm model; on an RMSNorm model (LLaMA) all but the
    centering of the writers (RMSNorm does not center). What was applied is read from the
    returned config's ``applied``; ask for a step with ``True`` to be told why it does not apply.
    A step already in ``cfg.applied`` is refused when asked for with ``True``
    (:class:`~circuitmath.AlreadyAppliedError`) and left out with ``None``. A refusal returns
    nothing, and the input is never modified. The steps, in the order applied (why this order:
    ``circuitmath/_processing/steps.py``):

    1. ``fold_ln``: fold each norm's gain (and bias) into the maps that read it: a LayerNorm by
       :func:`~circuitmath.fold_layer_norm`, its readers then centered
       (:func:`~circuitmath.center_reading_weights`, a shortformer model's ``W_pos`` first moved
       into per-layer tables by :func:`~circuitmath.shortformer_to_tables`), leaving ``"LNPre"``;
       an RMSNorm by :func:`~circuitmath.fold_rms_norm`, leaving ``"RMSPre"``.
    2. ``fold_value_biases``: ``b_O += Σ_h b_V[h] W_O[h]``, ``b_V = 0``.
    3. ``center_writing_weights``: every write to the residual stream minus its mean over
       ``d_model`` (needs a centering norm, ``"LN"`` or ``"LNPre"``).
    4. ``center_unembed``: ``W_U`` and ``b_U`` minus their means over the vocabulary.
    5. ``refactor_factored_attn_matrices``: balanced SVD factors of every ``W_Q W_K^T`` and
       ``W_V W_O`` (refused for rotary models).

    Shapes are those of :func:`~circuitmath.expected_shapes`; every dtype and device is kept.
    Half-precision weights are processed in float32 a part of the model at a time and rounded
    once (``circuitmath/_processing/half_precision.py``); float32 and float64 in their own dtype.
    Where steps 1-4 apply whatever the weights (a pre-LN model without shortformer positions or
    gated MLP, nothing applied yet), and steps 1, 2 and 4 of a pre-RMSNorm model, they run
    composed, each weight read and written once (``circuitmath/_processing/fused.py``): the
    chain's result up to rounding (pre-RMSNorm: bit for bit, for contiguous weights).

    >>> import torch
    >>> from circuitmath import Config, process_weights, random_state_dict
    >>> from circuitmath.testing import assert_equivalent
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    >>> sd = random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> processed, processed_cfg = process_weights(sd, cfg)
    >>> processed_cfg.applied  # doctest: +NORMALIZE_WHITESPACE
    ('fold_layer_norm', 'center_reading_weights', 'fold_value_biases', 'center_writing_weights',
     'center_unembed')
    >>> _ = assert_equivalent(sd, processed, cfg, after_cfg=processed_cfg)
    >>> rms = cfg.replace(normalization_type="RMS")
    >>> process_weights(random_state_dict(rms, seed=0), rms)[1].applied
    ('fold_rms_norm', 'fold_value_biases', 'center_unembed')
    >>> process_weights(random_state_dict(rms, seed=0), rms, center_writing_weights=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    circuitmath._errors.PreconditionError: center_writing_weights: precondition 'every reader sits behind a centering norm' does not hold: ...
    >>> process_weights(random_state_dict(rms, seed=0), rms, refactor_factored_attn_matrices=None)[1].applied
    ('fold_rms_norm', 'fold_value_biases', 'center_unembed', 'refactor_factored_attn_matrices')
    """
    requested = requested_steps(cfg, dict(
        fold_ln=fold_ln, fold_value_biases=fold_value_biases, center_writing_weights=center_writing_weights,
        center_unembed=center_unembed, refactor_factored_attn_matrices=refactor_factored_attn_matrices,
    ))
    # Fused, every entry of the input reaches the output, so only the output's are checked.
    state_dict = validated(state_dict, cfg, entries=not fused_first(cfg, requested))
    if torch.finfo(state_dict.dtype).bits < 32 and not only_fused(cfg, requested):
        out, out_cfg = half_by_parts(state_dict, cfg, requested, process_weights.identity)
    else:
        out, out_cfg = processed(state_dict, cfg, requested, process_weights.identity)
    return dict(out), untied(state_dict, out, out_cfg)  # a plain dict: the caller's to change
