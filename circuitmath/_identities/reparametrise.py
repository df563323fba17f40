"""Reparametrising a head's query/key and value/output factors leaves the head unchanged.

Symbols (row-vector convention, one head, all positions at once; ``n`` positions, ``d`` =
d_model, ``e`` = d_head):

- ``X``, ``Y``, ``Z`` ``[n, d]`` what the queries, keys and values read (they differ in a
  shortformer model, where only queries and keys see positions);
- ``W_Q, W_K, W_V`` ``[d, e]``, ``b_Q, b_K, b_V`` ``[1, e]``, ``W_O`` ``[e, d]``;
- ``N, M`` ``[e, e]`` invertible: the new bases of the query/key and value spaces;
- ``A`` ``[n, n]`` the head's pattern, the row softmax of the scores ``S / sqrt(e)``;
- ``T_1`` ``[n, m]`` and ``T_2`` ``[d, m]`` free test matrices. The claim
  ``S' T_1 + H' T_2 = S T_1 + H T_2`` for the scores ``S`` and head outputs ``H`` is one equality
  in the normal form, where every term ends in ``T_1`` or in ``T_2``; nothing cancels a term
  ending in ``T_1`` against one ending in ``T_2``, so it proves ``S' = S`` and ``H' = H`` at once.
  ``S' = S`` gives the same pattern ``A``, which is why ``H'`` may use ``A``.
"""

from __future__ import annotations

import sympy
import torch
from sympy import Inverse, MatAdd, MatMul, MatrixSymbol, OneMatrix, Symbol, Transpose

from .._processing import refactor_factored_attn_matrices
from .._processing._common import NOT_APPLIED, NOT_ROTARY, NO_QK_NORM
from .._proof import Fact, Proof, Step, Twin
from .._registry import COMPUTES, Identity, WrongRewrite, register
from .._state import attention_names, marked_as
from ..circuits._bases import change_bases

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "attention_weights"

n, d, e, m = (Symbol(s, positive=True, integer=True) for s in ("n", "d", "e", "m"))
ones = OneMatrix(n, 1)
X, Y, Z = (MatrixSymbol(s, n, d) for s in "XYZ")
W_Q, W_K, W_V = (MatrixSymbol(f"W_{s}", d, e) for s in "QKV")
b_Q, b_K, b_V = (MatrixSymbol(f"b_{s}", 1, e) for s in "QKV")
W_O = MatrixSymbol("W_O", e, d)
N, N_2, M = MatrixSymbol("N", e, e), MatrixSymbol("N_2", e, e), MatrixSymbol("M", e, e)
A = MatrixSymbol("A", n, n)
T_1, T_2 = MatrixSymbol("T_1", n, m), MatrixSymbol("T_2", d, m)
S, H = MatrixSymbol("S", n, n), MatrixSymbol("H", n, d)
x, y = MatrixSymbol("x", 1, d), MatrixSymbol("y", 1, d)
R = MatrixSymbol("R", e, e)
EXPLICIT_DIMS = {n: 3, d: 3, e: 2, m: 2}


def invertible(rng, shape) -> sympy.Matrix:
    """An integer matrix with determinant 1 (unit lower times unit upper triangular), not symmetric."""
    size = shape[0]
    lower = sympy.Matrix(size, size, lambda i, j: 1 if i == j else (rng.randint(-3, 3) if i > j else 0))
    upper = sympy.Matrix(size, size, lambda i, j: 1 if i == j else (rng.randint(1, 3) if i < j else 0))
    return lower * upper


def rotation(rng, shape) -> sympy.Matrix:
    """A rotary-style rotation: 2x2 blocks by the angle with cosine 3/5 and sine 4/5, exactly rational."""
    size = shape[0]
    out = sympy.eye(size)
    for i in range(0, size - 1, 2):
        out[i : i + 2, i : i + 2] = sympy.Matrix([[sympy.Rational(3, 5), -sympy.Rational(4, 5)],
                                                   [sympy.Rational(4, 5), sympy.Rational(3, 5)]])
    return out


def _affine(inputs, weight, bias, basis=None):
    """``inputs W + 1 b``, both factors times ``basis`` on the right when given."""
    if basis is None:
        return MatAdd(MatMul(inputs, weight), MatMul(ones, bias))
    return MatAdd(MatMul(inputs, weight, basis), MatMul(ones, bias, basis))


def _claim(query_basis, key_basis, value_basis, output_basis, *, move_biases=True):
    """``S' T_1 + H' T_2`` for the given changes of basis (``None``: unchanged)."""
    def side(inputs, weight, bias, basis):
        if basis is None:
            return _affine(inputs, weight, bias)
        if move_biases:
            return _affine(inputs, weight, bias, basis)
        return MatAdd(MatMul(inputs, weight, basis), MatMul(ones, bias))

    output_weight = (W_O,) if output_basis is None else (output_basis, W_O)
    return MatAdd(
        MatMul(side(X, W_Q, b_Q, query_basis), Transpose(side(Y, W_K, b_K, key_basis)), T_1),
        MatMul(A, side(Z, W_V, b_V, value_basis), *output_weight, T_2),
    )


def _reparametrise_proof() -> Proof:
    N_inv_T, M_inv = Transpose(Inverse(N)), Inverse(M)
    lhs = _claim(N, N_inv_T, M, M_inv)
    rhs = MatAdd(MatMul(S, T_1), MatMul(H, T_2))
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(
                MatAdd(
                    MatMul(_affine(X, W_Q, b_Q), N, Inverse(N), Transpose(_affine(Y, W_K, b_K)), T_1),
                    MatMul(A, _affine(Z, W_V, b_V), M, Inverse(M), W_O, T_2),
                ),
                r"factor $N$ and $M$ out of the sums; $(B N^{-\top})^\top = N^{-1} B^\top$",
            ),
            Step(
                MatAdd(
                    MatMul(_affine(X, W_Q, b_Q), Transpose(_affine(Y, W_K, b_K)), T_1),
                    MatMul(A, _affine(Z, W_V, b_V), W_O, T_2),
                ),
                r"$N N^{-1} = I_e$, $M M^{-1} = I_e$",
            ),
            Step(rhs, r"definitions of $S$ and $H$"),
        ),
        facts=(
            Fact(S, MatMul(_affine(X, W_Q, b_Q), Transpose(_affine(Y, W_K, b_K))),
                 "the head's scores before scaling: its pattern is the masked row softmax of S over the root of e"),
            Fact(H, MatMul(A, _affine(Z, W_V, b_V), W_O), "the head's output, given its pattern A"),
            Fact.invertible(N, "N is a change of basis of the query/key space"),
            Fact.invertible(N_2, "N_2 is another query head's change of basis"),
            Fact.invertible(M, "M is a change of basis of the value space"),
        ),
        samplers={N: invertible, N_2: invertible, M: invertible, R: rotation},
        explicit_dims=EXPLICIT_DIMS,
        twins=(
            Twin(
                "key_inverse_not_transposed",
                REFACTOR_FACTORED_ATTN_MATRICES.describe("key_inverse_not_transposed"),
                _claim(N, Inverse(N), M, M_inv),
                rhs,
            ),
            Twin("key_same_basis", "change the keys by N, like the queries", _claim(N, N, M, M_inv), rhs),
            Twin(
                "biases_not_moved",
                "change the weights but leave b_Q, b_K and b_V as they were",
                _claim(N, N_inv_T, M, M_inv, move_biases=False),
                rhs,
            ),
            Twin(
                "one_basis_per_query_head",
                "with grouped-query attention, give the shared key head another query head's basis N_2",
                _claim(N, Transpose(Inverse(N_2)), M, M_inv),
                rhs,
            ),
            Twin(
                "rotary",
                "a rotation R between queries and keys (rotary, one pair of positions): N R N^{-1} is not R",
                MatMul(x, W_Q, N, R, Transpose(MatMul(y, W_K, N_inv_T))),
                MatMul(x, W_Q, R, Transpose(MatMul(y, W_K))),
            ),
        ),
    )


# -- wrong rewrites: wrong transforms the numeric check must reject --------------------------


def _skewed_basis(size: int, device: torch.device) -> torch.Tensor:
    """A fixed, well-conditioned, non-symmetric basis on ``device``: ``I`` plus half the strict upper triangle."""
    on = dict(dtype=torch.float64, device=device)
    return torch.eye(size, **on) + 0.5 * torch.ones(size, size, **on).triu(1)


def _key_inverse_not_transposed(state_dict, cfg):
    """Change bases with the keys multiplied by ``N^{-1}`` instead of ``N^{-T}``."""
    _unused, new_cfg = refactor_factored_attn_matrices(state_dict, cfg)
    basis = _skewed_basis(cfg.d_head, state_dict["embed.W_E"].device).expand(cfg.n_layers, attention_names(cfg, "K")[2], cfg.d_head, cfg.d_head)
    inverse = torch.linalg.inv(basis)
    return change_bases(state_dict, cfg, query=basis, key=inverse, value=basis, output=inverse), new_cfg


def _biases_left_behind(state_dict, cfg):
    out, new_cfg = refactor_factored_attn_matrices(state_dict, cfg)
    for layer in range(cfg.n_layers):
        for side in "QKV":
            bias = f"blocks.{layer}.attn.{attention_names(cfg, side)[1]}"
            out[bias] = state_dict[bias]
    return out, new_cfg


def _one_svd_per_query_head(state_dict, cfg):
    """Refactor each query head on its own, as if it had its own key and value head; each shared
    key and value head keeps what the last query head of its group computed for it."""
    _unused, new_cfg = refactor_factored_attn_matrices(state_dict, cfg)
    size = cfg.n_heads // attention_names(cfg, "K")[2]
    ungrouped, grouped_names = dict(state_dict), {}  # each shared head copied to its query heads
    for layer in range(cfg.n_layers):
        for side in "KV":
            for kind, name in zip("Wb", attention_names(cfg, side)[:2]):
                per_query_head = f"blocks.{layer}.attn.{kind}_{side}"
                grouped_names[per_query_head] = f"blocks.{layer}.attn.{name}"
                ungrouped[per_query_head] = ungrouped.pop(grouped_names[per_query_head]).repeat_interleave(size, dim=0)
    ungrouped_cfg = cfg.replace(n_key_value_heads=None)
    out, _cfg = refactor_factored_attn_matrices(marked_as(state_dict, ungrouped, ungrouped_cfg), ungrouped_cfg)
    for per_query_head, grouped in grouped_names.items():
        out[grouped] = out.pop(per_query_head)[size - 1 :: size]
    return out, new_cfg


def _rows(state_dict, p, name):
    """``[W; b]`` (and the positional table of a shortformer_tables model) per head: ``[heads, rows, d_head]``."""
    parts = [state_dict[f"{p}.W_{name}"], state_dict[f"{p}.b_{name}"][:, None]]
    if f"{p}.pos_{name}" in state_dict:
        parts.append(state_dict[f"{p}.pos_{name}"].transpose(0, 1))
    return torch.cat(parts, 1)


def _off_diagonal(gram):
    return float((gram - torch.diag_embed(gram.diagonal(dim1=-2, dim2=-1))).abs().max())


def _balanced(state_dict, cfg):
    """The refactor's factors, per head: ``[W_Q; b_Q]`` and ``[W_K; b_K]`` ``[heads, rows, d_head]``
    with the same diagonal Gram matrix, ``[W_V; b_V]`` with orthogonal columns, ``W_O`` with
    orthonormal rows; each up to ``1e-9`` of its Gram matrix's largest entry."""
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        left, right = _rows(state_dict, p, "Q"), _rows(state_dict, p, "K")
        gram_q, gram_k = left.mT @ left, right.mT @ right
        tolerance = 1e-9 * float(gram_q.abs().max())
        values = state_dict[f"{p}.W_V"] if not state_dict[f"{p}.b_V"].any() else _rows(state_dict, p, "V")
        gram_v = values.mT @ values
        W_O = state_dict[f"{p}.W_O"]
        if float((gram_q - gram_k).abs().max()) > tolerance or _off_diagonal(gram_q) > tolerance:
            return f"block {layer}: the query and key factors do not share one diagonal Gram matrix"
        if _off_diagonal(gram_v) > 1e-9 * float(gram_v.abs().max()):
            return f"block {layer}: the value factor's columns are not orthogonal"
        if float((W_O @ W_O.mT - torch.eye(cfg.d_head, dtype=W_O.dtype)).abs().max()) > 1e-9:
            return f"block {layer}: W_O's rows are not orthonormal"
    return None


REFACTOR_FACTORED_ATTN_MATRICES = register(
    Identity(
        title="Reparametrising the query/key and value/output factors",
        summary="W_Q N, W_K N^-T, W_V M, M^-1 W_O (biases alike) give the same scores and head outputs;"
        " the SVD picks balanced factors",
        preconditions=(
            NOT_ROTARY,
            NO_QK_NORM,
            "with grouped-query attention, one basis per key/value head, shared by its group",
            NOT_APPLIED,
        ),
        build_proof=_reparametrise_proof,
        transform=refactor_factored_attn_matrices,
        postcondition=_balanced,
        check_note="Another balanced factorisation (other signs of the singular vectors) computes the same"
        ' function but is not recognised tensor by tensor: its row is ``"not recognised"`` while the'
        " log-probs agree.",
        wrong_rewrites={
            "key_inverse_not_transposed": WrongRewrite(
                _key_inverse_not_transposed, "change the keys by N^{-1} instead of N^{-T}"),
            "biases_left_behind": _biases_left_behind,
            "one_svd_per_query_head": _one_svd_per_query_head,
        },
        half_precision=COMPUTES,
    )
)
