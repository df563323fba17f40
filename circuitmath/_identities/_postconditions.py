"""What the processing identities make true of the weights they return, read from the weights.

Each function is a :data:`~circuitmath._registry.Postcondition` (or makes one): ``None`` when it
holds of ``state_dict``, else what is not true, naming the tensor. A mean counts as zero when
it is at most :data:`ZERO_IN_EPS` units of the dtype's ``eps`` times the largest entry of the
tensors it is measured with (a centering rounds each mean to about that).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._config import Config
from .._processing import readers, writers
from .._state import StateDict

__all__ = ["ZERO_IN_EPS", "no_norm_parameters", "means_zero", "readers_centered", "writers_centered", "biases_zero"]

#: A mean over a tensor's last axes counts as zero up to this many ``eps`` of the largest entry.
ZERO_IN_EPS = 5000


def no_norm_parameters(state_dict: StateDict, cfg: Config) -> str | None:
    """Every norm is ``LNPre`` or ``RMSPre`` and no gain or bias of one is left: a norm folded."""
    left = [name for name in state_dict if ".ln" in name or name.startswith("ln_final")]
    if left:
        return f"norm parameters are left: {', '.join(left[:3])}"
    if cfg.normalization_type not in ("LNPre", "RMSPre"):
        return f"normalization_type is {cfg.normalization_type!r}, not LNPre or RMSPre"
    return None


def means_zero(state_dict: StateDict, names: Iterable[str], dim: int) -> str | None:
    """The mean of each tensor ``names`` over ``dim`` is zero, measured against the largest entry of any of them."""
    names = list(names)
    if not names:
        return None
    scale = max(float(state_dict[n].abs().max()) for n in names)
    eps = torch.finfo(state_dict[names[0]].dtype).eps
    for name in names:
        mean = float(state_dict[name].double().mean(dim).abs().max())
        if mean > ZERO_IN_EPS * eps * max(scale, 1e-300):
            return f"{name} has a mean of {mean:.3g} over its axis {dim} (its entries reach {scale:.3g})"
    return None


def readers_centered(state_dict: StateDict, cfg: Config) -> str | None:
    """Every reader of a norm has mean zero over ``d_model`` (its second to last axis)."""
    return means_zero(state_dict, [weight for _norm, pairs in readers(cfg) for weight, _bias in pairs], -2)


def writers_centered(state_dict: StateDict, cfg: Config) -> str | None:
    """Every write to the residual stream has mean zero over ``d_model`` (its last axis)."""
    return means_zero(state_dict, writers(cfg), -1)


def biases_zero(kind: str):
    """The postcondition that every attention bias ``b_{kind}`` (``"V"`` or ``"K"``; a key/value
    head's, ``_b_{kind}``, too) is zero."""
    def holds(state_dict: StateDict, cfg: Config) -> str | None:
        bias = f"b_{kind}"
        nonzero = [n for n, t in state_dict.items() if n.endswith((f"attn.{bias}", f"attn._{bias}")) and bool(t.any())]
        return f"{', '.join(nonzero[:3])} not zero" if nonzero else None
    return holds
