"""Composition scores between heads, and the eigenvalue copying score of OV circuits."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._config import Config
from .._state import StateDict, validate_state_dict
from ._factored import FactoredMatrix, _t
from ._heads import _per_head, _require_attention, _require_position_free_scores, full_ov_circuits, ov_circuits, qk_circuits
from .._errors import InputError

__all__ = ["KINDS", "composition_scores", "copying_scores"]


KINDS = ("q", "k", "v")


def _r_factor(x: torch.Tensor) -> torch.Tensor:
    """``R`` of the reduced QR decomposition of ``x: [..., d, e]``: ``[..., min(d, e), e]``."""
    return torch.linalg.qr(x, mode="r")[1]


def _reader_factors(state_dict: StateDict, cfg: Config, kind: str) -> torch.Tensor:
    """A ``[n_layers, n_heads, d_model, d_head]`` factor with the reader's Frobenius geometry.

    For a reader ``M = X Y^T`` (``X, Y: [d_model, d_head]``), ``X R_Y^T`` where ``Y = Q_Y R_Y``:
    ``|N M|_F = |N X R_Y^T|_F`` for every ``N``, because ``Q_Y`` has orthonormal columns.
    """
    if kind == "q":  # W_QK = W_Q W_K^T
        return _per_head(state_dict, cfg, "Q") @ _t(_r_factor(_per_head(state_dict, cfg, "K")))
    if kind == "k":  # W_QK^T = W_K W_Q^T
        return _per_head(state_dict, cfg, "K") @ _t(_r_factor(_per_head(state_dict, cfg, "Q")))
    W_O = torch.stack([state_dict[f"blocks.{l}.attn.W_O"] for l in range(cfg.n_layers)])
    return _per_head(state_dict, cfg, "V") @ _t(_r_factor(_t(W_O)))  # W_OV = W_V W_O


def composition_scores(
    state_dict: StateDict, cfg: Config, kinds: Iterable[str] = KINDS, *, materialise: bool = False
) -> dict[str, torch.Tensor]:
    """Q-, K- and V-composition scores of every pair of heads, computed from the factors.

    Returns ``{kind: [n_layers, n_heads, n_layers, n_heads]}``; entry ``[l1, h1, l2, h2]`` is the
    score of the earlier head ``(l1, h1)`` writing into the later head ``(l2, h2)`` and is NaN
    unless ``l1 < l2``:

    - ``"q"``: ``|W_OV^1 W_QK^2|_F / (|W_OV^1|_F |W_QK^2|_F)`` (the paper's ``W_QK^T W_OV``);
    - ``"k"``: ``|W_OV^1 (W_QK^2)^T|_F / (...)`` (the paper's ``W_QK W_OV``);
    - ``"v"``: ``|W_OV^1 W_OV^2|_F / (...)`` (the paper's ``W_OV^2 W_OV^1``).

    Each score lies in ``[0, 1]`` and is unchanged by rescaling either head and by the
    reparametrisations that leave ``W_OV`` and ``W_QK`` unchanged. Cost: one QR per head and one
    ``[n_heads d_head, d_model] @ [d_model, n_heads d_head]`` product per pair of layers, never a
    ``d_model x d_model`` matrix (identity ``composition_scores_from_factors``). Q and K
    composition are refused for rotary models (see :func:`qk_circuits`).

    ``materialise=True`` computes the same scores the slow way, from the materialised
    ``[d_model, d_model]`` products ``W_OV^1 W_QK^2`` (one pair of layers at a time, in float64,
    returned in float64): the reference the factors are checked against.
    """
    validate_state_dict(state_dict, cfg)
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise InputError(f"unknown composition kinds {unknown}; choose among {KINDS}")
    _require_attention(cfg, "composition_scores_from_factors")
    if {"q", "k"} & set(kinds):
        _require_position_free_scores(cfg, "composition_scores_from_factors")
    if materialise:
        return _materialised_scores({name: tensor.double() for name, tensor in state_dict.items()}, cfg, kinds)
    L, H = cfg.n_layers, cfg.n_heads
    W_O = torch.stack([state_dict[f"blocks.{l}.attn.W_O"] for l in range(L)])
    writers = _r_factor(_per_head(state_dict, cfg, "V")) @ W_O  # [L, H, r, d]: |.|_F = |W_OV|_F
    writer_norms = torch.linalg.matrix_norm(writers)
    rank = writers.shape[-2]  # d_head, or d_model if smaller
    scores = {}
    for kind in kinds:
        readers = _reader_factors(state_dict, cfg, kind)  # [L, H, d, r]
        reader_norms = torch.linalg.matrix_norm(readers)
        out = torch.full((L, H, L, H), float("nan"), dtype=writers.dtype)
        for l1 in range(L - 1):
            later = readers[l1 + 1 :]  # [L', H, d, r]
            wide = later.permute(2, 0, 1, 3).reshape(cfg.d_model, -1)  # [d, L' H r]
            products = writers[l1].reshape(H * rank, cfg.d_model) @ wide  # [H r, L' H r]
            squared = products.reshape(H, rank, L - l1 - 1, H, -1).pow(2).sum(dim=(1, 4))  # [H, L', H]
            norms = writer_norms[l1][:, None, None] * reader_norms[l1 + 1 :][None]
            out[l1, :, l1 + 1 :, :] = squared.sqrt() / norms
        scores[kind] = out
    return scores


def _materialised_scores(state_dict: StateDict, cfg: Config, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The scores from materialised ``[d_model, d_model]`` products, one layer pair at a time."""
    ov = ov_circuits(state_dict, cfg).AB
    readers = {"v": ov}
    if {"q", "k"} & set(kinds):
        qk = qk_circuits(state_dict, cfg).AB
        readers |= {"q": qk, "k": qk.transpose(-1, -2)}
    fro = torch.linalg.matrix_norm
    out = {}
    for kind in kinds:
        reader = readers[kind]
        scores = torch.full((cfg.n_layers, cfg.n_heads) * 2, float("nan"), dtype=torch.float64)
        for l1 in range(cfg.n_layers):
            for l2 in range(l1 + 1, cfg.n_layers):
                product = ov[l1][:, None] @ reader[l2][None]  # [H, H, d, d]
                scores[l1, :, l2, :] = fro(product) / (fro(ov[l1])[:, None] * fro(reader[l2])[None])
        out[kind] = scores
    return out


def copying_scores(state_dict: StateDict, cfg: Config) -> torch.Tensor:
    """The eigenvalue copying score of every head: ``[n_layers, n_heads]``, each in ``[-1, 1]``.

    ``sum(λ) / sum(|λ|)`` (real; complex eigenvalues come in conjugate pairs) over the
    eigenvalues ``λ`` of the full OV circuit ``W_E W_OV W_U`` (:func:`full_ov_circuits`),
    computed from the ``d_head x d_head`` matrix ``W_O W_U W_E W_V``: its eigenvalues are the
    nonzero ones of the ``d_vocab x d_vocab`` circuit (identity ``eigenvalues_ab_ba``). Near 1:
    the head copies the token it attends to; near -1: it suppresses it. Unchanged by positive
    rescaling of the head and by reparametrisations of its ``d_head`` space (identity
    ``copying_score_invariance``); a head with a zero circuit scores NaN.
    """
    eigenvalues = full_ov_circuits(state_dict, cfg).eigenvalues()
    return eigenvalues.sum(dim=-1).real / eigenvalues.abs().sum(dim=-1)
