"""Every weight-processing step of the source notes, in one call and in an order that keeps each exact."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from contextvars import ContextVar

import torch

from .._config import Config
from .._errors import ArgumentTypeError, CircuitMathError, OverflowedError, PreconditionError
from .._state import (
    StateDict, all_finite, entries_checked_elsewhere, expected_shapes, not_finite, validate_state_dict,
)
from .attention import fold_value_biases as _fold_value_biases
from .attention import refactor_factored_attn_matrices as _refactor_factored_attn_matrices
from .attention import remove_key_biases
from .centering import center_unembed as _center_unembed
from .centering import center_writing_weights as _center_writing_weights
from ._memory import SCRATCH_MIN_BYTES, converted, temporaries
from ._parts import InMemory, Parts
from .fused import fusable, fused_default_steps, rms_fusable
from .layer_norm import center_reading_weights, fold_layer_norm
from ._common import refuse_reapplication, rewrite, undone_by
from .norms import fold_rms_norm, rescale_residual_stream
from .quantisation import migrate_norm_scales
from .shortformer import shortformer_to_tables

__all__ = [
    "process_weights", "PIPELINE_STEPS", "STEPS", "KEYWORD_OF", "rounded_once", "steps_left_out", "steps_between",
    "bits_free_of_strides",
]

Transform = Callable[[StateDict, Config], tuple[dict[str, torch.Tensor], Config]]


def _fold_norm(state_dict: StateDict, cfg: Config) -> tuple[dict[str, torch.Tensor], Config]:
    """Fold the norm's parameters into its readers; behind a LayerNorm, also center the readers.

    ``"LN"``: :func:`~circuitmath.fold_layer_norm` with ``center_reading_weights=True`` (a
    shortformer model first moves ``W_pos`` into per-layer query and key tables); ``"RMS"``:
    :func:`~circuitmath.fold_rms_norm`, and no centering (``RMSPre(x)`` is not orthogonal to 1).
    Any other norm has no parameters to fold: refused like :func:`~circuitmath.fold_layer_norm`.
    """
    for done in (fold_layer_norm, fold_rms_norm):
        refuse_reapplication(done.identity, cfg)
    if cfg.normalization_type == "RMS":
        return fold_rms_norm(state_dict, cfg)
    return fold_layer_norm(state_dict, cfg, center_reading_weights=True)


# Rewrites that make an earlier step's record false, which is then applied again after them
# (``cfg.applied`` is always true of the weights): the LayerNorm fold adds ``ln1.b @ W_V`` and
# ``ln1.b @ W_K`` to zeroed value and key biases; every rewrite of W_Q, W_K, W_V, W_O or their
# biases unbalances the refactor's factors (a rotation or a permutation keeps them balanced).
# Rewrites that move the weights off an earlier record's normal form by design are not listed:
# a rotation of the residual basis (centering refers to the basis it was made in), a scale
# migrated into a folded norm's gain (the gain comes back as 1 / s); the record is their history.
undone_by(_fold_value_biases, fold_layer_norm)
undone_by(remove_key_biases, fold_layer_norm)
undone_by(
    _refactor_factored_attn_matrices, fold_layer_norm, fold_rms_norm, center_reading_weights, _fold_value_biases,
    remove_key_biases, _center_writing_weights, rescale_residual_stream, shortformer_to_tables, migrate_norm_scales,
)


#: The steps of :func:`process_weights`, in the order it applies them: ``(keyword, transform)``.
#: A step's keyword is the name of the identity its transform applies (one name per thing), but
#: for the norm fold's ``fold_ln``, which applies the fold of whichever norm the model has.
PIPELINE_STEPS: tuple[tuple[str, Transform], ...] = (
    ("fold_ln", _fold_norm),
    *((step.identity, step) for step in (
        _fold_value_biases, _center_writing_weights, _center_unembed, _refactor_factored_attn_matrices,
    )),
)

#: The keywords of :func:`process_weights`, in the order it applies them.
STEPS = tuple(keyword for keyword, _step in PIPELINE_STEPS)

#: The transforms whose identities the norm fold (:func:`_fold_norm`) records.
_NORM_FOLD_RECORDS = (shortformer_to_tables, fold_layer_norm, center_reading_weights, fold_rms_norm)

#: The keyword of :func:`process_weights` that applies each identity it records.
KEYWORD_OF = {
    **{step.identity: STEPS[0] for step in _NORM_FOLD_RECORDS},
    **{keyword: keyword for keyword in STEPS[1:]},
}


def steps_between(applied: tuple[str, ...], other: tuple[str, ...]) -> frozenset[str]:
    """The keywords of :func:`process_weights` whose steps one of two parts of a model applied and
    the other did not (``applied`` and ``other``: their configs' ``applied``): the whole model
    leaves them out when they were left to apply where they can. Raises ``RuntimeError`` for an
    identity that is no step of it (a transform that applies to part of a model and not to the
    rest cannot happen elsewhere: the others apply or refuse)."""
    differ = set(applied) ^ set(other)
    if not differ <= KEYWORD_OF.keys():
        raise RuntimeError(f"parts of a model applied {applied} and {other}")
    return frozenset(KEYWORD_OF[name] for name in differ)


_LEFT_OUT: ContextVar[frozenset[str]] = ContextVar("circuitmath_steps_left_out", default=frozenset())


@contextlib.contextmanager
def steps_left_out(keywords: frozenset[str]):
    """Within this block :func:`process_weights` leaves out each step of ``keywords`` that it is
    asked to apply where it can (``None``), as it would on a model where the step does not
    apply. For a caller that processes a model a part at a time (``circuitmath._streaming_model``)
    and has found a part where the step does not apply: the whole model leaves it out."""
    token = _LEFT_OUT.set(frozenset(keywords))
    try:
        yield
    finally:
        _LEFT_OUT.reset(token)


@rewrite("process_weights", check_output=False)  # no autograd; the output is checked below, once
def process_weights(
    state_dict: StateDict,
    cfg: Config,
    *,
    fold_ln: bool | None = None,
    center_writing_weights: bool | None = None,
    center_unembed: bool | None = None,
    fold_value_biases: bool | None = None,
    refactor_factored_attn_matrices: bool | None = False,
) -> tuple[dict[str, torch.Tensor], Config]:
    """Apply the weight-processing steps of the source notes, each only where it is exact.

    Each keyword takes ``True`` (apply the step; if this model breaks one of its preconditions,
    raise that step's :class:`~circuitmath.PreconditionError`), ``False`` (leave it out) or
    ``None`` (apply it if its preconditions hold, leave it out otherwise). The defaults, ``None``
    for the first four steps and ``False`` for the refactor, apply what is exact for the model's
    architecture: every step on a pre-LayerNorm model, and on an RMSNorm model (LLaMA) the fold,
    the value biases and the unembed but not the centering of the writers (RMSNorm does not
    center). What was applied is read from the returned config's ``applied``, so nothing is
    skipped unseen; ask for a step with ``True`` to be told why it does not apply. A step already recorded in
    ``cfg.applied`` is refused when asked for with ``True`` (:class:`~circuitmath.AlreadyAppliedError`)
    and left out with ``None``. A refusal returns nothing, and the input is never modified.

    The steps, in the order applied:

    1. ``fold_ln``: fold each norm's gain (and bias) into the maps that read it. A LayerNorm
       (``"LN"``) is folded by :func:`~circuitmath.fold_layer_norm` and its readers are then
       centered (:func:`~circuitmath.center_reading_weights`), leaving ``"LNPre"``; a shortformer
       model first has ``W_pos`` moved into per-layer query and key tables
       (:func:`~circuitmath.shortformer_to_tables`, done inside the fold). An RMSNorm (``"RMS"``)
       is folded by :func:`~circuitmath.fold_rms_norm`, leaving ``"RMSPre"``, and its readers are
       not centered: ``RMSPre(x)`` is not orthogonal to the all-ones vector. First, because the
       centering of the readers is exact only once they read ``LNPre(x)``: centering behind an
       unfolded ``LN(x) = LNPre(x) diag(w) + b`` changes the model.
    2. ``fold_value_biases``: ``b_O += Σ_h b_V[h] W_O[h]``, ``b_V = 0``. After the fold, which
       adds ``ln1.b @ W_V`` to ``b_V``: folded earlier, that part would stay in ``b_V``.
    3. ``center_writing_weights``: subtract from every write to the residual stream its mean over
       ``d_model`` (needs a centering norm, ``"LN"`` or ``"LNPre"``). After the value-bias fold,
       so the final ``b_O`` is centered once, in the same pass as the other writers.
    4. ``center_unembed``: subtract from ``W_U`` and ``b_U`` their means over the vocabulary
       (log-probs unchanged, raw logits shift per position). After the fold, which rewrites
       ``W_U`` and moves ``ln_final.b @ W_U`` into ``b_U``.
    5. ``refactor_factored_attn_matrices``: balanced SVD factors of every ``W_Q W_K^T`` and
       ``W_V W_O`` (refused for rotary models). Last, because every earlier step rewrites
       ``W_Q``, ``W_K``, ``W_V`` or ``W_O`` and would undo the balanced factorisation, and
       because with ``b_V = 0`` the value side needs no bias row and ``b_V`` stays exactly zero.

    Shapes are those of :func:`~circuitmath.expected_shapes`; every dtype and device is kept.
    Half-precision weights (bfloat16, float16) are processed in float32 and rounded once at the
    end, which halves their error against rounding after every step, a part of the model at a
    time (the embedding and unembedding, then each block), so that no float32 copy of the whole
    model is made; float32 and float64 are processed in their own dtype. Returns the
    processed state dict and a config whose ``applied`` lists every identity used, in order.
    When steps 1–4 all apply whatever the weights (a pre-LN model without shortformer positions
    or gated MLP, nothing applied yet), they run composed, each weight read and written in one
    go (``circuitmath/_processing/fused.py``); the result is the chain's up to rounding. So do
    steps 1, 2 and 4 of a pre-RMSNorm model (nothing applied yet, no shortformer positions,
    ``center_writing_weights`` not asked for), bit for bit the chain's for contiguous weights
    (a transposed view is summed in another order: the last bit may differ); the tensors they leave
    alone are passed through. Fused, half precision is computed in float32 a block of rows at a
    time, not a part at a time.

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
    requested = _requested(cfg, dict(  # the keywords, in the order of STEPS
        fold_ln=fold_ln,
        fold_value_biases=fold_value_biases,
        center_writing_weights=center_writing_weights,
        center_unembed=center_unembed,
        refactor_factored_attn_matrices=refactor_factored_attn_matrices,
    ))
    fused = _fused(cfg, requested)
    with entries_checked_elsewhere() if fused else contextlib.nullcontext():
        # Fused, every entry of the input reaches the output, so only the output's are checked.
        dtype = validate_state_dict(state_dict, cfg)
    fused_only = fused and all(requested[keyword] is False for keyword, _ in PIPELINE_STEPS[4:])
    if torch.finfo(dtype).bits < 32 and not fused_only:
        return _half_by_parts(state_dict, cfg, requested)
    return _process(state_dict, cfg, requested)


def _requested(cfg: Config, keywords: dict) -> dict:
    """Each step's keyword of :func:`process_weights` (``keywords``, the others at their defaults)
    as it is applied: a step left out by :func:`steps_left_out`, or refused by ``cfg`` alone
    (the refactor of a rotary model), that was left to apply where it can (``None``) is
    ``False``: it would not apply anyway, and the fused steps alone may then run in half
    precision."""
    defaults = {name: p.default for name, p in inspect.signature(process_weights).parameters.items() if name in STEPS}
    requested = dict(defaults, **keywords)
    for keyword, value in requested.items():
        if not any(value is allowed for allowed in (True, False, None)):
            raise ArgumentTypeError(f"{keyword} must be True, False or None (if applicable), got {value!r}")
    refused = [_refactor_factored_attn_matrices.identity] if cfg.positional_embedding_type == "rotary" else []
    never = {*_LEFT_OUT.get(), *refused}
    return requested | {keyword: False for keyword in never if requested[keyword] is None}


def bits_free_of_strides(cfg: Config, keywords: dict) -> bool:
    """Whether :func:`process_weights` with ``keywords`` on a model of ``cfg`` gives the same bits
    whatever its inputs' strides, and writes each product in its input's layout: so when the fused
    steps of a pre-RMSNorm model run alone (each product elementwise, the unembedding's
    vocabulary means taken on rows made contiguous, ``b_O`` from a float64 copy of ``W_O`` laid
    out its own way). Any other step may sum in the order its inputs' layout gives, so a
    converter's transposed views are then made contiguous before processing."""
    requested = _requested(cfg, keywords)
    return rms_fusable(cfg) and _fused(cfg, requested) and all(requested[k] is False for k, _ in PIPELINE_STEPS[4:])


def _fused(cfg: Config, requested: dict) -> bool:
    """Whether the first four steps run fused (``fused.py``): all of them asked for or left to
    apply where they can, on a model where they all apply whatever its weights; on a pre-RMSNorm
    model, the three of them that apply (the centering of the writers left out, not asked for)."""
    if rms_fusable(cfg):
        fold, value_biases, center_writers, unembed = STEPS[:4]
        return requested[center_writers] is not True and all(
            requested[keyword] is not False for keyword in (fold, value_biases, unembed))
    return fusable(cfg) and all(requested[keyword] is not False for keyword, _ in PIPELINE_STEPS[:4])


def _process(
    state_dict: StateDict, cfg: Config, requested: dict, *, owned: bool = False,
) -> tuple[dict[str, torch.Tensor], Config]:
    """:func:`process_weights` of a model validated by the caller: float32 or float64, or half
    precision when only the fused steps run (they compute in float32 a tensor at a time).

    ``owned``: ``state_dict`` is a dict the caller gives away (a part's float32 copy): it is
    emptied once the fused steps have read it and their outputs are found finite (which proves
    the input finite, so it is not needed to name a NaN), so that the steps after them do not
    hold the part twice."""
    fused = _fused(cfg, requested)
    given, given_cfg = state_dict, cfg
    steps, checked_in_cache = PIPELINE_STEPS, False
    if fused:
        steps = PIPELINE_STEPS[4:]
        # a step after them replaces the blocks one at a time: each layer's outputs must be its own
        later = any(requested[keyword] is not False for keyword, _ in steps)
        state_dict, cfg, checked_in_cache = fused_default_steps(state_dict, cfg, stack_layers=not later)
        if not checked_in_cache and later:
            _finite_or_explained(state_dict, cfg, given, given_cfg)  # before an SVD meets a NaN
            checked_in_cache = True
        if owned and checked_in_cache:
            given.clear()
            given = None
    with entries_checked_elsewhere():  # checked here, on the way in and on the way out
        for keyword, step in steps:
            if requested[keyword] is False:
                continue
            try:
                # after the fused steps the state dict is this function's own: a local step may
                # replace it a block at a time, so that only one block is held twice
                state_dict, cfg = _block_by_block(state_dict, cfg, step) if fused else step(state_dict, cfg)
            except PreconditionError:
                if requested[keyword] is None:
                    continue
                raise
    # The fused steps summed every output block, rounded, in cache: finite sums prove finite
    # entries (a half-precision rounding that overflowed included), unless a later step rewrote tensors.
    if not (checked_in_cache and cfg.applied[-1] == _center_unembed.identity):
        _finite_or_explained(state_dict, cfg, given, given_cfg)
    return state_dict, cfg


def _block_by_block(state_dict: dict[str, torch.Tensor], cfg: Config, step: Transform) -> tuple[dict[str, torch.Tensor], Config]:
    """``step(state_dict, cfg)`` for a step that rewrites each block from that block alone (the
    refactor of W_Q W_K^T and W_V W_O after the fused steps), run on the ends and then on each
    block (:class:`~circuitmath._processing._parts.Parts`), each block's old tensors dropped from
    ``state_dict`` (emptied: it must be the caller's own) as soon as its new ones are made. The
    bits are the whole model's (the parts are); a refusal is raised by the ends, whose
    config it is, or else names the block."""
    tensor = next(iter(state_dict.values()))
    parts = Parts(InMemory(state_dict), cfg, tensor.dtype, tensor.device)
    out, out_cfg = parts.run(None, step)
    for layer in range(cfg.n_layers):
        block, block_cfg = parts.run(layer, step)
        for name in [n for n in state_dict if n.startswith(f"blocks.{layer}.")]:
            del state_dict[name]
        out |= block
        if block_cfg.applied != out_cfg.applied:  # cannot happen: the step's preconditions are the config's
            raise RuntimeError(f"{step.identity}: block {layer} applied {block_cfg.applied}, the ends {out_cfg.applied}")
    state_dict.clear()
    return out, out_cfg


def rounded_once(processed: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``processed`` (float32, emptied as it goes) rounded to ``dtype``; a NaN or Inf that the
    rounding makes (a finite float32 entry beyond the half dtype's range) is refused."""
    out = {}
    for name in list(processed):
        # mapped: made while the part's float32 tensors live, kept after they are freed (see _memory.scratch)
        rounded = out[name] = converted(processed.pop(name), dtype, mapped_from=SCRATCH_MIN_BYTES)
        if count := not_finite(rounded):
            raise OverflowedError(
                f"process_weights: rounding the processed weights to {dtype} overflowed: the input is"
                f" finite but {name} has {count} NaN or Inf entries (process in float32)"
            )
    return out


def _half_by_parts(state_dict: StateDict, cfg: Config, requested: dict) -> tuple[dict[str, torch.Tensor], Config]:
    """:func:`process_weights` of a bfloat16 or float16 model, a part at a time.

    Each part (``_parts.Parts``: the embedding and unembedding, then each block) is cast to
    float32 on the model's device, processed there and rounded once to the model's dtype, so the
    memory added beyond the output is one part in float32, never the whole model; the
    embedding and unembedding, the largest part, are not cast where the fused steps process them
    (in float32 a block of rows at a time: the same bits), so then the most is one block. A
    block is not cast either where the fused steps are all that apply to it; where the refactor
    follows them, only the block's attention is (:func:`_attention_then_block`). The parts'
    outputs are the whole model's, bit for bit. Where a step left to apply if it can (``None``)
    applies to some parts and not to others, it is left out of all of them, as the whole model's
    refusal would leave it out, and the parts are processed again.
    """
    dtype = next(iter(state_dict.values())).dtype
    device = next(iter(state_dict.values())).device
    parts = Parts(InMemory(state_dict), cfg, torch.float32, device)
    ends = Parts(InMemory(state_dict), cfg, dtype, device)  # not cast: for the fused steps
    requested = dict(requested)
    while True:
        out, applied, asked = {}, {}, dict(requested)
        for layer in parts.names():
            # Fused steps run in the model's dtype (float32 a block of rows at a time): on the ends
            # where they can, on a block when no step after them applies (the ends decide that:
            # whether the refactor applies depends on the config alone, and a step the ends
            # refuse is left out of the whole model anyway); the bits are float32's, rounded once.
            fused = _fused(parts.ends_cfg, asked)
            later = {keyword for keyword, _ in PIPELINE_STEPS[4:] if asked[keyword] is not False}
            if fused and (layer is None or not later):
                part, part_cfg = ends.run(layer, lambda sd, c: _process(sd, c, asked))
                part = part if layer is not None else rounded_once(part, dtype)
            elif fused and later <= _ATTENTION_STEPS:
                part, part_cfg = _attention_then_block(state_dict, cfg, layer, asked, parts, dtype)
            else:
                part, part_cfg = parts.run(layer, lambda sd, c: _process(sd, c, asked, owned=True))
                part = rounded_once(part, dtype)
            applied[layer] = part_cfg.applied
            out |= part
            if layer is None:
                out_cfg = part_cfg
                for keyword, step in PIPELINE_STEPS[4:]:
                    if asked[keyword] is None and step.identity not in part_cfg.applied:
                        asked[keyword] = False
            elif part_cfg.applied != out_cfg.applied:
                break
        else:
            return out, out_cfg
        # A step that applies to some parts only: the whole model refuses it (asked with None).
        some = steps_between(applied[None], applied[layer])
        if not any(requested[keyword] is None for keyword in some):  # cannot happen: a True step raises
            raise RuntimeError(f"process_weights: parts disagree on {applied[None]} and {applied[layer]}")
        for keyword in some:
            requested[keyword] = False


#: The steps after the fused ones that read and write a block's attention tensors (ln1 and
#: attn.*) and nothing else: the refactor.
_ATTENTION_STEPS = {_refactor_factored_attn_matrices.identity}


def _attention_then_block(
    state_dict: StateDict, cfg: Config, layer: int, asked: dict, parts: Parts, dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], Config]:
    """Block ``layer`` of a half-precision model (``dtype``) whose steps are the fused ones and then
    :data:`_ATTENTION_STEPS`: its output and config, rounded once, as ``parts.run`` would give.

    The block's attention (``ln1`` and ``attn.*``: the block of an attention-only model) is
    cast to float32, processed with every step and rounded; then the rest of the block (the
    block of a model with one head, whose zero attention is left out of the output) goes
    through the fused steps alone in its own dtype (float32 a block of rows at a time, rounded
    once). Every processed tensor is a function of its own half's tensors (readers of their
    norm, ``b_O`` of ``b_V`` and ``W_O``, each writer of itself), so both give the bits of the
    whole block in float32, rounded once, while the MLP is never held in float32 and the
    attention only while it is refactored. Where either half is refused (a NaN in the input, an
    overflow), the whole block is cast and processed as ``parts.run`` would, so that the
    refusal is the same (a fused attention tensor beyond the dtype's range that the refactor
    brings back is then no refusal).
    """
    block = InMemory(state_dict).block(layer)
    # n_ctx sizes only W_pos (the fused steps take no shortformer positions), a zero stand-in here
    attention_cfg = cfg.replace(d_mlp=None, gated_mlp=False, parallel_attn_mlp=False, n_ctx=1)
    in_attention = {_in_block(n) for n in expected_shapes(attention_cfg.replace(n_layers=1)) if n.startswith("blocks.")}
    attention = {n: t for n, t in block.items() if _in_block(n) in in_attention}
    # the rest: the block of a model with one head (and one key/value head), its attention zeros
    rest_cfg = cfg.replace(n_heads=1, n_key_value_heads=None if cfg.n_key_value_heads is None else 1, n_ctx=1)
    one_head = {_in_block(n): s for n, s in expected_shapes(rest_cfg.replace(n_layers=1)).items() if n.startswith("blocks.")}
    rest = {n: torch.zeros(one_head[_in_block(n)], dtype=dtype, device=parts.device) if n in attention else t
            for n, t in block.items()}
    del block
    fused_only = asked | {keyword: False for keyword, _ in PIPELINE_STEPS[4:]}
    try:
        with temporaries():  # the float32 tensors are rounded below and freed
            attention_out, attention_out_cfg = Parts(InMemory(attention), attention_cfg, torch.float32, parts.device).run(
                layer, lambda sd, c: _process(sd, c, asked, owned=True))
        attention_out = rounded_once(attention_out, dtype)
        out, _cfg = Parts(InMemory(rest), rest_cfg, dtype, parts.device).run(
            layer, lambda sd, c: _process(sd, c, fused_only))
    except CircuitMathError:
        out, out_cfg = parts.run(layer, lambda sd, c: _process(sd, c, asked, owned=True))
        return rounded_once(out, dtype), out_cfg
    names = list(out)
    out |= attention_out
    if set(out) != set(names):  # cannot happen: the attention's tensors are the block's
        raise RuntimeError(f"process_weights: block {layer}'s attention makes {sorted(set(out) - set(names))}")
    return out, attention_out_cfg


def _in_block(name: str) -> str:
    """``"blocks.3.attn.W_Q"`` -> ``"attn.W_Q"``: the name within its block."""
    return name.split(".", 2)[2]


def _finite_or_explained(state_dict: StateDict, cfg: Config, given: StateDict | None, given_cfg: Config) -> None:
    """Refuse processed weights with a NaN or Inf: name the input's when it has them (the fused
    steps pass a NaN or Inf of any input entry on to some output entry: each output is linear in
    its inputs, and NaN and Inf survive sums and products, 0 * Inf included), else the overflow."""
    if all_finite(state_dict.values()):
        return
    bad = {name: count for name, tensor in state_dict.items() if (count := not_finite(tensor))}
    if not bad:
        return
    if given is not None:  # None: the input is known finite
        validate_state_dict(given, given_cfg)
    dtype = next(iter(state_dict.values())).dtype
    raise OverflowedError(
        f"process_weights: processing overflowed {dtype}: the input is finite but the processed weights are not ("
        + ", ".join(f"{name} has {count} NaN or Inf entries" for name, count in bad.items())
        + ")"
    )
