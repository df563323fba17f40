"""Composition scores between heads, and the eigenvalue copying score of OV circuits."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._config import Config
from .._state import StateDict, validate_state_dict
from ._factored import FactoredMatrix, _t
from ._heads import SCORES_CHECKED_BY, _per_head, _require_attention, _require_position_free_scores, ov_circuits, qk_circuits
from .._errors import InputError

__all__ = ["KINDS", "composition_scores", "copying_scores", "copying_circuits"]


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
    reparametrisations that leave ``W_OV`` and ``W_QK`` unchanged. From ``d_head``-sized factors
    (identity ``composition_scores_from_factors``): the writer ``N_1 = R_V W_O: [d_head,
    d_model]`` and the reader ``N_2 = W_Q R_K^T: [d_model, d_head]`` give the score's numerator
    ``|N_1 N_2|_F``, squared ``<N_1^T N_1, N_2 N_2^T>``: one inner product of ``d_model x
    d_model`` Gram matrices per pair of heads (their upper triangles, a band of rows at a time,
    so memory stays bounded) instead of a ``d_head x d_model x d_head`` product, about
    ``d_head^2 / d_model`` times fewer operations. Squaring loses accuracy on small scores, so
    every score below ``1 / (2 sqrt(d_model))`` is recomputed from ``N_1 N_2``. No ``d_model x
    d_model`` matrix of a head is formed. Q and K composition are refused for rotary models
    (see :func:`qk_circuits`).

    ``materialise=True`` computes the same scores the slow way, from the materialised
    ``[d_model, d_model]`` products ``W_OV^1 W_QK^2`` (one pair of layers at a time, in float64,
    returned in float64): the reference the factors are checked against.
    """
    validate_state_dict(state_dict, cfg)
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise InputError(f"unknown composition kinds {unknown}; choose among {KINDS}")
    _require_attention(cfg, SCORES_CHECKED_BY)
    if {"q", "k"} & set(kinds):
        _require_position_free_scores(cfg, SCORES_CHECKED_BY)
    if materialise:
        return _materialised_scores({name: tensor.double() for name, tensor in state_dict.items()}, cfg, kinds)
    L, H = cfg.n_layers, cfg.n_heads
    W_O = torch.stack([state_dict[f"blocks.{l}.attn.W_O"] for l in range(L)])
    writers = _t(_r_factor(_per_head(state_dict, cfg, "V")) @ W_O)  # [L, H, d, r]: |.|_F = |W_OV|_F
    readers = torch.stack([_reader_factors(state_dict, cfg, kind) for kind in kinds], 2)  # [L, H, K, d, r]
    norms = torch.linalg.matrix_norm(writers)[:, :, None, None, None] * torch.linalg.matrix_norm(readers).permute(2, 0, 1)
    squared = _gram_products(writers, readers) / norms.pow(2)  # [L, H, K, L, H], l1 < l2 only
    small = squared < 1 / (4 * cfg.d_model)
    small &= torch.ones(L, L, dtype=torch.bool, device=small.device).triu(1)[:, None, None, :, None]
    l1, h1, k, l2, h2 = small.nonzero(as_tuple=True)
    for chunk in torch.arange(len(l1), device=l1.device).split(256):
        product = _t(writers[l1[chunk], h1[chunk]]) @ readers[l2[chunk], h2[chunk], k[chunk]]  # [n, r, r]
        squared[l1[chunk], h1[chunk], k[chunk], l2[chunk], h2[chunk]] = product.pow(2).sum((-1, -2)) / norms[
            l1[chunk], h1[chunk], k[chunk], l2[chunk], h2[chunk]].pow(2)
    scores = squared.clamp_min(0).sqrt()
    scores.masked_fill_(~torch.ones(L, L, dtype=torch.bool, device=scores.device).triu(1)[:, None, None, :, None], float("nan"))
    return {kind: scores[:, :, i].contiguous() for i, kind in enumerate(kinds)}


_BAND_BYTES = 2**25  # the writer Gram matrices of one band of rows (smaller bands stay in cache)


def _gram_products(writers: torch.Tensor, readers: torch.Tensor) -> torch.Tensor:
    """``<W W^T, R R^T>_F`` for every writer ``W = writers[l1, h1]: [d, r]`` and every reader
    ``R = readers[l2, h2, k]: [d, r]`` with ``l1 < l2``: ``[L, H, K, L, H]`` (zero elsewhere).

    The symmetric ``d x d`` Gram matrices are taken a band of rows at a time, each band from
    its diagonal block on (off-diagonal blocks counted twice), so about half of each Gram
    matrix is formed and at most ``_BAND_BYTES`` of writer Gram matrices are held.
    """
    L, H, K, d, _r = readers.shape
    out = writers.new_zeros(L, H, K, L, H)
    flat_writers = writers.flatten(0, 1)  # [L H, d, r]
    rows = max(1, min(d, _BAND_BYTES // max(1, L * H * d * writers.element_size())))
    for start in range(0, d, rows):
        stop = min(d, start + rows)
        band = flat_writers[:, start:stop] @ _t(flat_writers[:, start:])  # [L H, rows, d - start]
        band[:, :, stop - start:] *= 2
        band = band.flatten(1)
        for l2 in range(1, L):
            reader = readers[l2].flatten(0, 1)  # [H K, d, r]
            reader_band = (reader[:, start:stop] @ _t(reader[:, start:])).flatten(1)  # [H K, ...]
            products = band[: l2 * H] @ reader_band.T  # [l2 H, H K]
            out[:l2, :, :, l2, :] += products.reshape(l2, H, H, K).permute(0, 1, 3, 2)
    return out


def _materialised_scores(state_dict: StateDict, cfg: Config, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The scores from the materialised ``[d_model, d_model]`` products, one layer pair at a time.

    Each product ``W_OV^1 W_QK^2 = W_V^1 ((W_O^1 W_Q^2) W_K^2^T)`` is formed whole and its
    Frobenius norm taken directly, the factors multiplied in the cheapest order (``d_model^2
    d_head`` operations a pair of heads, not ``d_model^3``); the heads' own norms are those of
    their materialised ``W_OV`` and ``W_QK``.
    """
    ov = ov_circuits(state_dict, cfg)
    readers = {"v": ov}
    if {"q", "k"} & set(kinds):
        qk = qk_circuits(state_dict, cfg)
        readers |= {"q": qk, "k": qk.T}
    fro = torch.linalg.matrix_norm
    norms = {name: fro(circuit.AB) for name, circuit in readers.items()}  # [L, H] each
    out = {}
    for kind in kinds:
        reader = readers[kind]
        scores = torch.full((cfg.n_layers, cfg.n_heads) * 2, float("nan"), dtype=torch.float64, device=ov.left.device)
        for l1 in range(cfg.n_layers):
            for l2 in range(l1 + 1, cfg.n_layers):
                core = ov.right[l1][:, None] @ reader.left[l2][None]  # [H, H, d_head, d_head]
                product = (ov.left[l1][:, None] @ core) @ reader.right[l2][None]  # [H, H, d, d]
                scores[l1, :, l2, :] = fro(product) / (norms["v"][l1][:, None] * norms[kind][l2][None])
        out[kind] = scores
    return out


def copying_scores(state_dict: StateDict, cfg: Config) -> torch.Tensor:
    """The eigenvalue copying score of every head: ``[n_layers, n_heads]``, each in ``[-1, 1]``.

    ``sum(λ) / sum(|λ|)`` (real; complex eigenvalues come in conjugate pairs) over the
    eigenvalues ``λ`` of the full OV circuit ``W_E W_OV W_U`` (:func:`full_ov_circuits`),
    computed from the ``d_head x d_head`` matrix ``W_O W_U W_E W_V`` (:func:`copying_circuits`):
    its eigenvalues are the nonzero ones of the ``d_vocab x d_vocab`` circuit (identity
    ``eigenvalues_ab_ba``). Near 1:
    the head copies the token it attends to; near -1: it suppresses it. Unchanged by positive
    rescaling of the head and by reparametrisations of its ``d_head`` space (identity
    ``copying_score_invariance``); a head with a zero circuit scores NaN.
    """
    eigenvalues = torch.linalg.eigvals(copying_circuits(state_dict, cfg))
    return eigenvalues.sum(dim=-1).real / eigenvalues.abs().sum(dim=-1)


def copying_circuits(state_dict: StateDict, cfg: Config) -> torch.Tensor:
    """``W_O W_U W_E W_V`` of every head: ``[n_layers, n_heads, d_head, d_head]``, whose
    eigenvalues are the nonzero ones of its full OV circuit (:func:`full_ov_circuits`, ``BA``
    for ``A = W_E W_V``, ``B = W_O W_U``; identity ``eigenvalues_ab_ba``) padded with zeros.

    Computed as ``W_O (W_U W_E) W_V``: the ``[d_model, d_model]`` product ``W_U W_E`` once for
    the model, not a ``[d_vocab, d_head]`` factor per head (for a 30,000-token vocabulary,
    several hundred times fewer operations).
    """
    ov = ov_circuits(state_dict, cfg)
    return ov.right @ (state_dict["unembed.W_U"] @ state_dict["embed.W_E"]) @ ov.left
