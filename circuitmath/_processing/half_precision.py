"""How :func:`~circuitmath.process_weights` processes bfloat16 and float16 weights: a part of
the model at a time in float32, each part rounded once to the model's dtype."""

from __future__ import annotations

import torch

from .._config import Config
from .._errors import CircuitMathError, OverflowedError
from .._state import StateDict, expected_shapes, not_finite
from ._memory import SCRATCH_MIN_BYTES, converted
from ._parts import InMemory, Parts
from .attention import refactor_factored_attn_matrices
from .dispatch import fused_first, processed
from .steps import AFTER_FUSED, steps_between

__all__ = ["rounded_once", "half_by_parts"]


def rounded_once(processed: dict[str, torch.Tensor], dtype: torch.dtype, caller: str) -> dict[str, torch.Tensor]:
    """``processed`` (float32, emptied as it goes) rounded to ``dtype``; a NaN or Inf that the
    rounding makes (a finite float32 entry beyond the half dtype's range) is refused, the message
    starting with ``caller``, the public function's name."""
    out = {}
    for name in list(processed):
        # mapped: made while the part's float32 tensors live, kept after they are freed (see _memory.scratch)
        rounded = out[name] = converted(processed.pop(name), dtype, mapped_from=SCRATCH_MIN_BYTES)
        if count := not_finite(rounded):
            raise OverflowedError(
                f"{caller}: rounding the processed weights to {dtype} overflowed: the input is"
                f" finite but {name} has {count} NaN or Inf entries (process in float32)"
            )
    return out


def half_by_parts(
    state_dict: StateDict, cfg: Config, requested: dict, caller: str,
) -> tuple[dict[str, torch.Tensor], Config]:
    """:func:`~circuitmath.process_weights` of a bfloat16 or float16 model, a part at a time.

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
    requested = dict(requested)
    while True:
        out, out_cfg, disagreeing = _parts_processed(state_dict, cfg, requested, caller)
        if disagreeing is None:
            return out, out_cfg
        # A step that applies to some parts only: the whole model refuses it (asked with None).
        some = steps_between(*disagreeing)
        if not any(requested[keyword] is None for keyword in some):  # cannot happen: a True step raises
            raise RuntimeError(f"{caller}: parts disagree on {disagreeing[0]} and {disagreeing[1]}")
        for keyword in some:
            requested[keyword] = False


def _parts_processed(
    state_dict: StateDict, cfg: Config, requested: dict, caller: str,
) -> tuple[dict[str, torch.Tensor], Config, tuple[tuple[str, ...], tuple[str, ...]] | None]:
    """Every part of a half-precision model processed with ``requested``, rounded once: the
    output, its config and ``None``; or, at the first block that applies other steps than the
    ends, ``(the ends' applied, the block's applied)`` in place of ``None``."""
    dtype = next(iter(state_dict.values())).dtype
    device = next(iter(state_dict.values())).device
    parts = Parts(InMemory(state_dict), cfg, torch.float32, device)
    ends = Parts(InMemory(state_dict), cfg, dtype, device)  # not cast: for the fused steps
    out, asked = {}, dict(requested)
    for layer in parts.names():
        # Fused steps run in the model's dtype (float32 a block of rows at a time): on the ends
        # where they can, on a block when no step after them applies (the ends decide that:
        # whether the refactor applies depends on the config alone, and a step the ends
        # refuse is left out of the whole model anyway); the bits are float32's, rounded once.
        fused = fused_first(parts.ends_cfg, asked)
        later = {keyword for keyword, _ in AFTER_FUSED if asked[keyword] is not False}
        if fused and (layer is None or not later):
            part, part_cfg = ends.run(layer, lambda sd, c: processed(sd, c, asked, caller))
            part = part if layer is not None else rounded_once(part, dtype, caller)
        elif fused and later <= _ATTENTION_STEPS:
            part, part_cfg = _attention_then_block(state_dict, cfg, layer, asked, parts, dtype, caller)
        else:
            part, part_cfg = parts.run(layer, lambda sd, c: processed(sd, c, asked, caller, owned=True))
            part = rounded_once(part, dtype, caller)
        out |= part
        if layer is None:
            out_cfg = part_cfg
            for keyword, step in AFTER_FUSED:
                if asked[keyword] is None and step.identity not in part_cfg.applied:
                    asked[keyword] = False
        elif part_cfg.applied != out_cfg.applied:
            return out, out_cfg, (out_cfg.applied, part_cfg.applied)
    return out, out_cfg, None


#: The steps after the fused ones that read and write a block's attention tensors (ln1 and
#: attn.*) and nothing else: the refactor.
_ATTENTION_STEPS = {refactor_factored_attn_matrices.identity}


def _attention_then_block(
    state_dict: StateDict, cfg: Config, layer: int, asked: dict, parts: Parts, dtype: torch.dtype, caller: str,
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
    attention, attention_cfg, rest, rest_cfg = _block_halves(state_dict, cfg, layer, dtype, parts.device)
    fused_only = asked | {keyword: False for keyword, _ in AFTER_FUSED}
    try:
        attention_out, attention_out_cfg = Parts(InMemory(attention), attention_cfg, torch.float32, parts.device).run(
            layer, lambda sd, c: processed(sd, c, asked, caller, owned=True))
        attention_out = rounded_once(attention_out, dtype, caller)
        out, _cfg = Parts(InMemory(rest), rest_cfg, dtype, parts.device).run(
            layer, lambda sd, c: processed(sd, c, fused_only, caller))
    except CircuitMathError:
        out, out_cfg = parts.run(layer, lambda sd, c: processed(sd, c, asked, caller, owned=True))
        return rounded_once(out, dtype, caller), out_cfg
    names = list(out)
    out |= attention_out
    if set(out) != set(names):  # cannot happen: the attention's tensors are the block's
        raise RuntimeError(f"{caller}: block {layer}'s attention makes {sorted(set(out) - set(names))}")
    return out, attention_out_cfg


def _block_halves(
    state_dict: StateDict, cfg: Config, layer: int, dtype: torch.dtype, device: torch.device,
) -> tuple[dict[str, torch.Tensor], Config, dict[str, torch.Tensor], Config]:
    """Block ``layer`` cut in two models of one block each, with their configs: its attention
    (``ln1`` and ``attn.*``, the block of an attention-only model), and the rest (the block of a
    model with one head and one key/value head, whose attention tensors are zeros)."""
    block = InMemory(state_dict).block(layer)
    # n_ctx sizes only W_pos (the fused steps take no shortformer positions), a zero stand-in here
    attention_cfg = cfg.replace(d_mlp=None, gated_mlp=False, parallel_attn_mlp=False, n_ctx=1)
    in_attention = {_in_block(n) for n in expected_shapes(attention_cfg.replace(n_layers=1)) if n.startswith("blocks.")}
    attention = {n: t for n, t in block.items() if _in_block(n) in in_attention}
    rest_cfg = cfg.replace(n_heads=1, n_key_value_heads=None if cfg.n_key_value_heads is None else 1, n_ctx=1)
    one_head = {_in_block(n): s for n, s in expected_shapes(rest_cfg.replace(n_layers=1)).items() if n.startswith("blocks.")}
    rest = {n: torch.zeros(one_head[_in_block(n)], dtype=dtype, device=device) if n in attention else t
            for n, t in block.items()}
    return attention, attention_cfg, rest, rest_cfg


def _in_block(name: str) -> str:
    """``"blocks.3.attn.W_Q"`` -> ``"attn.W_Q"``: the name within its block."""
    return name.split(".", 2)[2]
