"""How :func:`~circuitmath.process_weights` runs its steps on a validated model: composed where
they can be (``circuitmath/_processing/fused.py``), then one after another."""

from __future__ import annotations

import torch

from .._config import Config
from .._errors import OverflowedError, PreconditionError
from .._state import StateDict, all_finite, not_finite, validated, vouched
from ._parts import InMemory, Parts
from .centering import center_unembed
from .fused import fusable, fused_default_steps, rms_fusable
from .steps import AFTER_FUSED, FUSABLE_STEPS, PIPELINE_STEPS, STEPS, Transform, requested as requested_steps

__all__ = ["fused_first", "only_fused", "bits_free_of_strides", "processed"]


def fused_first(cfg: Config, requested: dict) -> bool:
    """Whether the first four steps run fused (``fused.py``): all of them asked for or left to
    apply where they can, on a model where they all apply whatever its weights; on a pre-RMSNorm
    model, the three of them that apply (the centering of the writers left out, not asked for)."""
    if rms_fusable(cfg):
        fold, value_biases, center_writers, unembed = STEPS[:4]
        return requested[center_writers] is not True and all(
            requested[keyword] is not False for keyword in (fold, value_biases, unembed))
    return fusable(cfg) and all(requested[keyword] is not False for keyword, _ in FUSABLE_STEPS)


def only_fused(cfg: Config, requested: dict) -> bool:
    """Whether the fused steps are all that run: :func:`fused_first`, and no step after them asked for."""
    return fused_first(cfg, requested) and all(requested[keyword] is False for keyword, _ in AFTER_FUSED)


def bits_free_of_strides(cfg: Config, keywords: dict) -> bool:
    """Whether :func:`~circuitmath.process_weights` with ``keywords`` on a model of ``cfg`` gives
    the same bits whatever its inputs' strides, and writes each product in its input's layout:
    so when the fused steps of a pre-RMSNorm model run alone (each product elementwise, the
    unembedding's vocabulary means taken on rows made contiguous, ``b_O`` from a float64 copy of
    ``W_O`` laid out its own way). Any other step may sum in the order its inputs' layout gives,
    so a converter's transposed views are then made contiguous before processing."""
    return rms_fusable(cfg) and only_fused(cfg, requested_steps(cfg, keywords))


def processed(
    state_dict: StateDict, cfg: Config, requested: dict, caller: str, *, owned: bool = False,
) -> tuple[dict[str, torch.Tensor], Config]:
    """:func:`~circuitmath.process_weights` of a model validated by the caller: float32 or
    float64, or half precision when only the fused steps run (they compute in float32 a tensor
    at a time). ``requested``: each step's keyword as :func:`~.steps.requested` gives them;
    ``caller``: the public function's name, with which a refusal starts.

    ``owned``: ``state_dict`` is a dict the caller gives away (a part's float32 copy): it is
    emptied once the fused steps have read it and their outputs are found finite (which proves
    the input finite, so it is not needed to name a NaN), so that the steps after them do not
    hold the part twice."""
    fused = fused_first(cfg, requested)
    given, given_cfg = state_dict, cfg
    steps, checked_in_cache = PIPELINE_STEPS, False
    if fused:
        steps = AFTER_FUSED
        # a step after them replaces the blocks one at a time: each layer's outputs must be its own
        later = any(requested[keyword] is not False for keyword, _ in steps)
        state_dict, cfg, checked_in_cache = fused_default_steps(state_dict, cfg, stack_layers=not later)
        if not checked_in_cache and later:
            _finite_or_explained(state_dict, cfg, given, given_cfg, caller)  # before an SVD meets a NaN
            checked_in_cache = True
        if owned and checked_in_cache:
            given.clear()
            given = None
    # the entries are checked here, on the way in and on the way out, not by each step
    state_dict = vouched(state_dict, cfg, entries=False)
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
    if not (checked_in_cache and cfg.applied[-1] == center_unembed.identity):
        _finite_or_explained(state_dict, cfg, given, given_cfg, caller)
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
    def unchecked(part: StateDict, part_cfg: Config):  # a part of a model this pipeline checks
        return step(vouched(part, part_cfg, entries=False), part_cfg)

    out, out_cfg = parts.run(None, unchecked)
    for layer in range(cfg.n_layers):
        block, block_cfg = parts.run(layer, unchecked)
        for name in [n for n in state_dict if n.startswith(f"blocks.{layer}.")]:
            del state_dict[name]
        out |= block
        if block_cfg.applied != out_cfg.applied:  # cannot happen: the step's preconditions are the config's
            raise RuntimeError(f"{step.identity}: block {layer} applied {block_cfg.applied}, the ends {out_cfg.applied}")
    state_dict.clear()
    return out, out_cfg


def _finite_or_explained(
    state_dict: StateDict, cfg: Config, given: StateDict | None, given_cfg: Config, caller: str,
) -> None:
    """Refuse processed weights with a NaN or Inf: name the input's when it has them (the fused
    steps pass a NaN or Inf of any input entry on to some output entry: each output is linear in
    its inputs, and NaN and Inf survive sums and products, 0 * Inf included), else the overflow."""
    if all_finite(state_dict.values()):
        return
    bad = {name: count for name, tensor in state_dict.items() if (count := not_finite(tensor))}
    if not bad:
        return
    if given is not None:  # None: the input is known finite
        validated(given, given_cfg)  # names the input's NaN or Inf entries
    dtype = next(iter(state_dict.values())).dtype
    raise OverflowedError(
        f"{caller}: processing overflowed {dtype}: the input is finite but the processed weights are not ("
        + ", ".join(f"{name} has {count} NaN or Inf entries" for name, count in bad.items())
        + ")"
    )
