"""The pairs of dimensions a rotary embedding rotates together, in either layout, and a matrix
that stands for the rotation of every position (what a map commutes with to pass through it)."""

from __future__ import annotations

import torch

from .._config import Config

__all__ = ["rotary_pairs", "rotary_generator"]


def rotary_pairs(cfg: Config, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two dimensions of each rotary pair, as index tensors on ``device``: ``(i, i + rotary_dim / 2)``
    (NeoX layout) or ``(2i, 2i + 1)`` (``cfg.rotary_interleaved``, GPT-J)."""
    half = (cfg.rotary_dim or cfg.d_head) // 2
    index = torch.arange(half, device=device)
    return (2 * index, 2 * index + 1) if cfg.rotary_interleaved else (index, index + half)


def rotary_generator(cfg: Config) -> torch.Tensor:
    """``J`` ``[d_head, d_head]`` (float64): ``J[a_i, b_i] = i + 1 = -J[b_i, a_i]`` for the rotary
    pairs ``(a_i, b_i)`` (:func:`rotary_pairs`), zero elsewhere. A matrix commutes with every
    rotary rotation (one angle per pair, the frequencies distinct) exactly when it commutes with
    ``J`` (whose pairs' distinct values stand for the distinct frequencies)."""
    first, second = rotary_pairs(cfg, "cpu")
    J = torch.zeros(cfg.d_head, cfg.d_head, dtype=torch.float64, device="cpu")
    J[first, second] = (torch.arange(len(first), device="cpu") + 1).double()
    J[second, first] = -(torch.arange(len(first), device="cpu") + 1).double()
    return J
