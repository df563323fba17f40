"""Which tensors a config implies, and validation of state dicts against it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import torch

from ._config import Config
from ._errors import StateDictError

__all__ = ["attention_names", "expected_shapes", "validate_state_dict", "entries_checked_elsewhere", "StateDict"]

StateDict = Mapping[str, torch.Tensor]

_CHECK_ENTRIES = contextvars.ContextVar("circuitmath_check_entries", default=True)


@contextlib.contextmanager
def entries_checked_elsewhere() -> Iterator[None]:
    """Within this block :func:`validate_state_dict` checks names, shapes and dtypes but not that
    every entry is finite: for a caller that checks the entries of what goes in and of what
    comes out itself (the processing pipeline), so its steps do not read every weight again."""
    token = _CHECK_ENTRIES.set(False)
    try:
        yield
    finally:
        _CHECK_ENTRIES.reset(token)


def _norm_shapes(prefix: str, kind, d_model: int) -> dict[str, tuple[int, ...]]:
    if kind == "LN":
        return {f"{prefix}.w": (d_model,), f"{prefix}.b": (d_model,)}
    if kind == "RMS":
        return {f"{prefix}.w": (d_model,)}
    return {}


def attention_names(cfg: Config, name: str) -> tuple[str, str, int]:
    """``(weight, bias, heads)`` for Q, K or V: ``("W_K", "b_K", n_heads)``, or for grouped-query
    keys and values ``("_W_K", "_b_K", n_key_value_heads)`` (TransformerLens's names)."""
    if name != "Q" and cfg.n_key_value_heads is not None:
        return f"_W_{name}", f"_b_{name}", cfg.n_key_value_heads
    return f"W_{name}", f"b_{name}", cfg.n_heads


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name the config implies, with its shape (TransformerLens names)."""
    d, h, e = cfg.d_model, cfg.n_heads, cfg.d_head
    shapes: dict[str, tuple[int, ...]] = {"embed.W_E": (cfg.d_vocab, d)}
    if cfg.embedding_norm:
        shapes |= _norm_shapes("embed.ln", cfg.normalization_type, d)
    if cfg.positional_embedding_type in ("standard", "shortformer"):
        shapes["pos_embed.W_pos"] = (cfg.n_ctx, d)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        shapes |= _norm_shapes(f"{p}.ln1", cfg.normalization_type, d)
        for name in ("Q", "K", "V"):
            weight, bias, heads = attention_names(cfg, name)
            shapes[f"{p}.attn.{weight}"] = (heads, d, e)
            shapes[f"{p}.attn.{bias}"] = (heads, e)
            if cfg.positional_embedding_type == "shortformer_tables" and name != "V":
                shapes[f"{p}.attn.pos_{name}"] = (cfg.n_ctx, heads, e)
        shapes[f"{p}.attn.W_O"] = (h, e, d)
        shapes[f"{p}.attn.b_O"] = (d,)
        if not cfg.attn_only:
            shapes |= _norm_shapes(f"{p}.ln2", cfg.normalization_type, d)
            shapes[f"{p}.mlp.W_in"] = (d, cfg.d_mlp)
            if cfg.gated_mlp:
                shapes[f"{p}.mlp.W_gate"] = (d, cfg.d_mlp)
            shapes[f"{p}.mlp.b_in"] = (cfg.d_mlp,)
            shapes[f"{p}.mlp.W_out"] = (cfg.d_mlp, d)
            shapes[f"{p}.mlp.b_out"] = (d,)
    if cfg.norm_position == "pre":
        shapes |= _norm_shapes("ln_final", cfg.normalization_type, d)
    shapes["unembed.W_U"] = (d, cfg.d_vocab)
    shapes["unembed.b_U"] = (cfg.d_vocab,)
    return shapes


def validate_state_dict(state_dict: StateDict, cfg: Config) -> torch.dtype:
    """Check names, shapes, dtypes and finiteness; return the common floating dtype.

    Raises :class:`StateDictError` listing every problem found.
    """
    if not isinstance(cfg, Config):
        raise StateDictError(f"expected a circuitmath Config, got {type(cfg).__name__}")
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"expected a mapping of names to tensors, got {type(state_dict).__name__}")
    shapes = expected_shapes(cfg)
    problems = []
    missing = sorted(set(shapes) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(shapes))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected} (does the config match the weights?)")
    dtypes = set()
    for name in sorted(set(shapes) & set(state_dict)):
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name} is a {type(tensor).__name__}, not a torch.Tensor")
            continue
        if tuple(tensor.shape) != shapes[name]:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the config implies {shapes[name]}")
        if not tensor.is_floating_point():
            problems.append(f"{name} has dtype {tensor.dtype}, expected a floating dtype")
            continue
        dtypes.add(tensor.dtype)
        # A finite sum proves every entry finite (a NaN or Inf entry makes it NaN or Inf) at a
        # fraction of the cost of isfinite; only a sum that is not finite needs the count.
        if _CHECK_ENTRIES.get() and not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            problems.append(f"{name} has {bad} NaN or Inf entries")
    if len(dtypes) > 1:
        problems.append(f"mixed dtypes {sorted(map(str, dtypes))}; use one floating dtype")
    if problems:
        raise StateDictError("state dict does not match its config: " + "; ".join(problems))
    return dtypes.pop() if dtypes else torch.get_default_dtype()
