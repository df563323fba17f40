"""Rewrites inside attention layers: value biases, key biases, and the factorisation of W_QK, W_OV."""

from __future__ import annotations

import torch

from .._config import Config
from .._state import StateDict, attention_names, key_value_groups, validate_state_dict
from ._common import NO_ATTN_SOFTCAP, NO_QK_NORM, NOT_ROTARY, require, qk_normed, require_no_sinks, rewrite
from ._memory import new_tensor

__all__ = ["fold_value_biases", "remove_key_biases", "refactor_factored_attn_matrices"]


def _refuse_rotary(identity: str, cfg: Config, why: str) -> None:
    require(
        identity, NOT_ROTARY, cfg.positional_embedding_type != "rotary",
        f"the model uses rotary embeddings: {why}",
    )


def _refuse_qk_norm(identity: str, cfg: Config, why: str) -> None:
    require(identity, NO_QK_NORM, not cfg.qk_norm, f"the model normalises {qk_normed(cfg)}: {why}")


@rewrite
def fold_value_biases(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Move every value bias into the layer's output bias: ``b_O += Σ_h b_V[h] @ W_O[h]``, ``b_V = 0``.

    ``b_V`` is ``[n_heads, d_head]`` (``attn._b_V``, ``[n_key_value_heads, d_head]``, with
    grouped-query attention, where each key/value head's bias reaches the output through the
    ``W_O[h]`` of every query head of its group), ``W_O`` is ``[n_heads, d_head, d_model]`` and
    ``b_O`` is ``[d_model]``. Exact because every row of an attention pattern sums to 1, so a bias
    added to every value comes out of the pattern unchanged; the reference forward pass masks
    causally, so no row is ever fully masked. The sum is accumulated in float64 and rounded once
    to the input dtype. Records ``"fold_value_biases"``.

    >>> import torch
    >>> from circuitmath import Config, fold_value_biases, random_state_dict
    >>> cfg = Config(n_layers=1, d_model=6, n_heads=2, d_head=3, d_vocab=7, n_ctx=4)
    >>> folded, folded_cfg = fold_value_biases(random_state_dict(cfg, seed=0), cfg)
    >>> bool(folded["blocks.0.attn.b_V"].eq(0).all()), folded_cfg.applied
    (True, ('fold_value_biases',))
    """
    require_no_sinks(identity, cfg, "each head's softmax gives part of its weight to a sink logit, so a pattern's rows"
                     " sum to less than 1 and A 1 b_V W_O is not 1 b_V W_O")
    validate_state_dict(state_dict, cfg)
    _weight, bias, _heads = attention_names(cfg, "V")
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        b_V, b_O = state_dict[f"{p}.{bias}"], state_dict[f"{p}.b_O"]
        out[f"{p}.b_O"] = (b_O.double() + value_bias_through_output(b_V, state_dict[f"{p}.W_O"])).to(b_O.dtype)
        out[f"{p}.{bias}"] = torch.zeros_like(b_V)
    return out, cfg


def nothing_to_carry(b_V: torch.Tensor, W_O: torch.Tensor) -> bool:
    """Whether :func:`value_bias_through_output` gives zeros without touching ``W_O``: value
    biases all zero, tested on the CPU only (on another device the test would synchronise it)."""
    return W_O.device.type == "cpu" and not b_V.any()


def value_bias_through_output(b_V: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """``Σ_h b_V[group(h)] @ W_O[h]`` in float64: ``b_V: [..., kv_heads, d_head]``, ``W_O: [...,
    n_heads, d_head, d_model]`` (the same leading axes: several layers stacked), ``[..., d_model]``.

    On the CPU, biases that are all zero (a model without value biases, such as LLaMA) give
    zeros without the float64 copy of ``W_O``: the einsum's sums of ``0 * W_O`` for a finite
    ``W_O`` (every input is validated finite) are zero too."""
    if nothing_to_carry(b_V, W_O):
        shape = torch.broadcast_shapes(b_V.shape[:-2], W_O.shape[:-3]) + W_O.shape[-1:]
        return torch.zeros(shape, dtype=torch.float64, device=W_O.device)
    per_query_head = b_V.double().repeat_interleave(W_O.shape[-3] // b_V.shape[-2], dim=-2)
    return torch.einsum("...he,...hed->...d", per_query_head, W_O.double())


@rewrite
def remove_key_biases(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Set every key bias ``b_K`` (``[n_heads, d_head]``, or ``attn._b_K``) to zero.

    A key bias adds ``q_i · b_K`` to every score of query ``i``: the same number for every key
    ``j``, which the softmax over ``j`` cancels. Refused for rotary models, where the key bias is
    rotated by the key's position and ``q_i · R_j b_K`` changes along the row, and for models with
    QK-norm, where the bias enters the key before its root mean square is taken, and under an
    attention-score softcap, which is not shift-invariant. Records
    ``"remove_key_biases"``.
    """
    _refuse_rotary(
        identity, cfg,
        "each key, bias included, is rotated by an angle that depends on its position, so the bias"
        " adds a different amount to each score of a row and the softmax does not cancel it",
    )
    _refuse_qk_norm(
        identity, cfg,
        "the key bias is added before the key is divided by its root mean square, so it changes each"
        " key by a different amount and the scores of a row by different amounts",
    )
    require_no_sinks(identity, cfg, "each head's softmax has a sink logit that q . b_K does not shift, so the constant"
                     " added to a row's scores moves weight between the keys and the sink")
    require(identity, NO_ATTN_SOFTCAP, cfg.attn_softcap is None,
            f"the scores pass through the softcap {cfg.attn_softcap:g} * tanh(s / {cfg.attn_softcap:g}), which turns"
            " the constant q . b_K added to a row into different amounts per key" if cfg.attn_softcap else "")
    validate_state_dict(state_dict, cfg)
    _weight, bias, _heads = attention_names(cfg, "K")
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        name = f"blocks.{layer}.attn.{bias}"
        out[name] = torch.zeros_like(state_dict[name])
    return out, cfg


def _svd_of_product(left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``left @ right = U diag(S) Vh`` for ``left: [p, r]``, ``right: [r, q]``, with exactly ``r`` terms.

    Returns ``U: [p, r]`` (orthonormal columns), ``S: [r]`` (descending, >= 0) and ``Vh: [r, q]``
    (orthonormal rows); when ``p`` or ``q`` is below ``r`` the missing terms are zero. Computed from
    QR factors of ``left`` and ``right.T`` and the SVD of the small ``R_left @ R_right.T``, without
    forming the ``[p, q]`` product.
    """
    rank = left.shape[1]
    q_left, r_left = torch.linalg.qr(left)
    q_right, r_right = torch.linalg.qr(right.T)
    u, s, vh = torch.linalg.svd(r_left @ r_right.T, full_matrices=False)
    U, Vh = q_left @ u, vh @ q_right.T
    missing = rank - s.shape[0]
    if missing:
        U = torch.cat([U, U.new_zeros(U.shape[0], missing)], dim=1)
        s = torch.cat([s, s.new_zeros(missing)])
        Vh = torch.cat([Vh, Vh.new_zeros(missing, Vh.shape[1])])
    return U, s, Vh


@rewrite
def refactor_factored_attn_matrices(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Refactor every head's ``W_Q, W_K`` and ``W_V, W_O`` into balanced factors of the same products.

    A head depends on its query and key weights only through the bilinear form
    ``(x W_Q + b_Q)(y W_K + b_K)^T`` and on its value and output weights only through
    ``(y W_V + b_V) W_O``; ``W_Q -> W_Q N``, ``W_K -> W_K N^{-T}``, ``W_V -> W_V M``,
    ``W_O -> M^{-1} W_O`` (biases alike) change neither. This picks the factors from the singular
    value decomposition of each product, with the bias as one more input row ``(x, 1)`` (and the
    positional tables ``pos_Q``, ``pos_K`` of a ``"shortformer_tables"`` model as further rows):

    - ``[W_Q; b_Q] [W_K; b_K]^T = U S V^T`` gives ``[W_Q; b_Q] = U S^{1/2}``,
      ``[W_K; b_K] = V S^{1/2}``: orthogonal columns, the i-th of equal norm in both;
    - ``[W_V; b_V] W_O = U S V^T`` gives ``[W_V; b_V] = U S`` and ``W_O = V^T``: the rows of ``W_O``
      are orthonormal, so ``W_O`` only rotates ``z`` into the residual stream.

    With grouped-query attention a key/value head is shared by a group of query heads, so one
    ``N`` and one ``M`` must serve the whole group: the queries of the group are stacked on the
    left of one SVD (against their shared keys), and their ``W_O`` side by side on the right of
    another. Shapes are kept: ``W_Q, W_K, W_V`` ``[heads, d_model, d_head]``, ``W_O``
    ``[n_heads, d_head, d_model]``, biases ``[heads, d_head]``. A side whose biases are all zero
    is not extended, so zero biases (after :func:`fold_value_biases` or :func:`remove_key_biases`)
    stay exactly zero. Computed in float64, rounded once to the input dtype. Refused for rotary
    models and for models with QK-norm. Records ``"refactor_factored_attn_matrices"``.
    """
    _refuse_rotary(
        identity, cfg,
        "queries and keys are rotated by position between W_Q, W_K and the scores, and a rotation"
        " commutes with a change of basis N only when N commutes with every rotation",
    )
    _refuse_qk_norm(
        identity, cfg,
        "the queries and keys are divided by their root mean square after W_Q and W_K, and W_Q N has another root"
        " mean square than W_Q unless N is orthogonal (the balanced factors are not)",
    )
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        out |= _refactor_qk(state_dict, cfg, p)
        out |= _refactor_ov(state_dict, cfg, p)
    return out, cfg


class _Side:
    """One side of a factored product: the given tensors, read a head at a time in float64, and
    new tensors in their dtype that the factors are written into a head at a time (so that no
    float64 copy of a whole weight is held).

    ``names`` are the state dict's weight ``[heads, d_model, d_head]``, bias ``[heads, d_head]``
    and, for the queries and keys of a ``"shortformer_tables"`` model, positional table
    ``[n_ctx, heads, d_head]``.
    """

    def __init__(self, state_dict: StateDict, *names: str):
        self.names = names
        self.weight, self.bias, *table = (state_dict[n] for n in names)
        self.table = table[0] if table else None
        # every head's weight (and table) is stored; a bias is stored only where it is extended
        self.out = [new_tensor(self.weight.shape, self.weight.dtype, self.weight.device), self.bias.clone()]
        if self.table is not None:
            self.out.append(new_tensor(self.table.shape, self.table.dtype, self.table.device))

    def extends(self, heads) -> bool:
        """Whether these heads need the extended input: a nonzero bias or a positional table."""
        return self.table is not None or bool(self.bias[list(heads)].any())

    def rows(self, head: int, extend: bool) -> torch.Tensor:
        """The head's map on the extended input ``(x, 1, onehot(position))`` in float64: ``[rows, d_head]``.

        ``extend=False`` gives the weight alone, ``[d_model, d_head]``.
        """
        if not extend:
            return self.weight[head].double()
        table = [self.table[:, head].double()] if self.table is not None else []
        return torch.cat([self.weight[head].double(), self.bias[head][None, :].double(), *table])

    def store(self, head: int, rows: torch.Tensor) -> None:
        """Write back rows laid out as :meth:`rows` returns them, rounded to the given dtype."""
        weight, bias, *table = self.out
        d_model = weight.shape[1]
        weight[head] = rows[:d_model]
        if rows.shape[0] > d_model:
            bias[head] = rows[d_model]
        if table:
            table[0][:, head] = rows[d_model + 1 :]

    def result(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.out))


def _refactor_qk(state_dict: StateDict, cfg: Config, p: str) -> dict[str, torch.Tensor]:
    """Balanced SVD factors of every ``[W_Q; b_Q] [W_K; b_K]^T``, query heads of a group stacked."""
    tables = cfg.positional_embedding_type == "shortformer_tables"
    queries, keys = (
        _Side(state_dict, *(f"{p}.{n}" for n in attention_names(cfg, side)[:2]), *([f"{p}.pos_{side}"] if tables else []))
        for side in "QK"
    )
    for j, heads in enumerate(key_value_groups(cfg)):
        extend_queries, extend_keys = queries.extends(heads), keys.extends([j])
        rows = [queries.rows(h, extend_queries) for h in heads]
        U, S, Vh = _svd_of_product(torch.cat(rows), keys.rows(j, extend_keys).T)
        for h, block in zip(heads, (U * S.sqrt()).split([r.shape[0] for r in rows])):
            queries.store(h, block)
        keys.store(j, Vh.T * S.sqrt())
    return queries.result() | keys.result()


def _refactor_ov(state_dict: StateDict, cfg: Config, p: str) -> dict[str, torch.Tensor]:
    """``[W_V; b_V] = U S`` and ``W_O = V^T`` from the SVD of ``[W_V; b_V] [W_O[h] for h in group]``."""
    values = _Side(state_dict, *(f"{p}.{n}" for n in attention_names(cfg, "V")[:2]))
    W_O = state_dict[f"{p}.W_O"]  # [n_heads, d_head, d_model]
    out = new_tensor(W_O.shape, W_O.dtype, W_O.device)
    for j, heads in enumerate(key_value_groups(cfg)):
        side_by_side = torch.cat([W_O[h].double() for h in heads], dim=1)  # [d_head, group * d_model]
        U, S, Vh = _svd_of_product(values.rows(j, values.extends([j])), side_by_side)
        values.store(j, U * S)
        for h, factor in zip(heads, Vh.split(cfg.d_model, dim=1)):
            out[h] = factor
    return values.result() | {f"{p}.W_O": out}
