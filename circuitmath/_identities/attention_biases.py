"""Folding value biases into the output bias, and removing key biases.

Symbols (row-vector convention, all positions at once; ``n`` positions, ``d`` = d_model,
``e`` = d_head):

- ``X`` ``[n, d]`` the input every value reads; ``1_n`` the all-ones column;
- three query heads ``1, 2, 3`` with patterns ``A_h`` ``[n, n]`` and output weights ``W_O,h``
  ``[e, d]``; heads 1 and 2 share the key/value head ``a`` (grouped-query attention), head 3 has
  its own ``b``: values ``X W_V,a + 1_n b_V,a`` with ``W_V,a`` ``[d, e]``, ``b_V,a`` ``[1, e]``;
  ``b_O`` ``[1, d]`` the layer's output bias. Three heads are the smallest layer that shows the
  sum over heads and the sharing of a value head at once; each further head adds one more term
  of the same form, folded by the same step;
- for the key bias, one layer's scores ``Q K^T`` with queries ``Q`` ``[n, e]`` (biases included)
  and keys ``K + 1_n b_K``; ``E`` the entrywise exponential of the scores and ``g`` that of the
  shift ``Q b_K^T``.
"""

from __future__ import annotations

from fractions import Fraction

import sympy
import torch
from sympy import DiagMatrix, Inverse, MatAdd, MatMul, MatrixSymbol, OneMatrix, Symbol, Transpose

from .._processing import fold_value_biases, remove_key_biases
from .._processing.attention import value_bias_through_output
from .._processing._common import NO_ATTN_SINKS, NO_ATTN_SOFTCAP, NOT_APPLIED, NOT_ROTARY, NO_QK_NORM
from ._postconditions import biases_zero
from .._proof import Definition, Fact, Proof, Step, Twin
from .._registry import COMPUTES, MOVES_ENTRIES, Identity, WrongRewrite, register
from .._state import attention_names
from ._sinks import sink_rows_twin, sink_shift_twin
from ._softcaps import attention_softcap_twin, capped_rows_sum_to_one
from .layer_norm import REGARDLESS

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "attention_weights"

n, d, e = (Symbol(s, positive=True, integer=True) for s in ("n", "d", "e"))
ones = OneMatrix(n, 1)
EXPLICIT_DIMS = {n: 3, d: 3, e: 2}


def _positive(rng) -> sympy.Rational:
    return sympy.Rational(Fraction(rng.randint(1, 9), rng.randint(1, 5)))


def causal_pattern(rng, shape) -> sympy.Matrix:
    """A causal attention pattern: lower-triangular, positive rationals, every row summing to 1."""
    rows, cols = shape
    weights = sympy.Matrix(rows, cols, lambda i, j: _positive(rng) if j <= i else 0)
    return sympy.Matrix(rows, cols, lambda i, j: weights[i, j] / sum(weights.row(i)))


def _pattern_with_empty_first_row(rng, shape) -> sympy.Matrix:
    """A causal pattern whose first row was fully masked and then set to zero, as padding code does."""
    pattern = causal_pattern(rng, shape)
    pattern[0, :] = sympy.zeros(1, shape[1])
    return pattern


# -- value biases ----------------------------------------------------------------------------

X = MatrixSymbol("X", n, d)
A1, A2, A3 = (MatrixSymbol(f"A_{h}", n, n) for h in (1, 2, 3))
W_Va, W_Vb = MatrixSymbol("W_{V,a}", d, e), MatrixSymbol("W_{V,b}", d, e)
b_Va, b_Vb = MatrixSymbol("b_{V,a}", 1, e), MatrixSymbol("b_{V,b}", 1, e)
W_O1, W_O2, W_O3 = (MatrixSymbol(f"W_{{O,{h}}}", e, d) for h in (1, 2, 3))
b_O = MatrixSymbol("b_O", 1, d)
b_O_folded = MatrixSymbol(r"b_O^{\mathrm{fold}}", 1, d)
P = MatrixSymbol("P", n, n)  # a pattern with no guarantee on its row sums
EXPS = tuple(MatrixSymbol(f"E_{h}", n, n) for h in (1, 2, 3))  # each head's exponentiated scores


def _layer(pattern_1, bias_a, bias_b, bias_O):
    """The attention layer's output: three heads, heads 1 and 2 sharing value head a."""
    return MatAdd(
        MatMul(pattern_1, MatAdd(MatMul(X, W_Va), MatMul(ones, bias_a)), W_O1),
        MatMul(A2, MatAdd(MatMul(X, W_Va), MatMul(ones, bias_a)), W_O2),
        MatMul(A3, MatAdd(MatMul(X, W_Vb), MatMul(ones, bias_b)), W_O3),
        MatMul(ones, bias_O),
    )


def _without_value_biases(pattern_1, bias_O):
    return MatAdd(
        MatMul(pattern_1, X, W_Va, W_O1), MatMul(A2, X, W_Va, W_O2), MatMul(A3, X, W_Vb, W_O3), MatMul(ones, bias_O)
    )


def _value_bias_steps(rhs) -> tuple[Step, ...]:
    """The derivation of :func:`_value_bias_proof`, ending in ``rhs``."""
    return (
        Step(
            MatAdd(
                MatMul(A1, X, W_Va, W_O1), MatMul(A1, ones, b_Va, W_O1),
                MatMul(A2, X, W_Va, W_O2), MatMul(A2, ones, b_Va, W_O2),
                MatMul(A3, X, W_Vb, W_O3), MatMul(A3, ones, b_Vb, W_O3),
                MatMul(ones, b_O),
            ),
            "distribute over the sums",
        ),
        Step(
            MatAdd(
                MatMul(A1, X, W_Va, W_O1), MatMul(ones, b_Va, W_O1),
                MatMul(A2, X, W_Va, W_O2), MatMul(ones, b_Va, W_O2),
                MatMul(A3, X, W_Vb, W_O3), MatMul(ones, b_Vb, W_O3),
                MatMul(ones, b_O),
            ),
            r"$A_h \mathbf{1}_n = \operatorname{diag}(r_h)^{-1} r_h = \mathbf{1}_n$ with $r_h = E_h \mathbf{1}_n$: every row of a softmax pattern sums to 1",
        ),
        Step(
            MatAdd(
                MatMul(A1, X, W_Va, W_O1), MatMul(A2, X, W_Va, W_O2), MatMul(A3, X, W_Vb, W_O3),
                MatMul(ones, MatAdd(b_O, MatMul(b_Va, MatAdd(W_O1, W_O2)), MatMul(b_Vb, W_O3))),
            ),
            r"collect the rows $\mathbf{1}_n (\ldots)$, the same at every position",
        ),
        Step(rhs, r"definition of $b_O^{\mathrm{fold}}$, and $b_V = 0$ from now on"),
    )


def _value_bias_facts() -> tuple[Fact, ...]:
    """The folded output bias, each head's pattern as the softmax of its scores, and their row sums' invertibility."""
    patterns = ((A1, "1"), (A2, "2"), (A3, "3"))
    return (
        Fact(
            b_O_folded,
            MatAdd(b_O, MatMul(b_Va, MatAdd(W_O1, W_O2)), MatMul(b_Vb, W_O3)),
            "the folded output bias: each value bias through the W_O of every query head that reads it",
        ),
        *(
            Fact(A, MatMul(Inverse(DiagMatrix(MatMul(E_h, ones))), E_h),
                       f"head {h}'s pattern: the softmax of its scores, E_{h} their entrywise exponentials (0 where masked)")
            for (A, h), E_h in zip(patterns, EXPS)
        ),
        *(Fact.invertible(DiagMatrix(MatMul(E_h, ones)), f"head {h}'s row sums are positive: every row has an unmasked key")
          for (_A, h), E_h in zip(patterns, EXPS)),
    )


def _value_bias_twins(lhs) -> tuple[Twin, ...]:
    """The wrong folds of the value biases, each a twin of ``lhs``."""
    b_V_square = MatrixSymbol("b_{V,a}", 1, d)
    b_Vb_square = MatrixSymbol("b_{V,b}", 1, d)
    square = {n: 3, d: 2, e: 2}
    return (
        sink_rows_twin(),
        Twin(
            "no_sum_over_heads",
            FOLD_VALUE_BIASES.describe("no_sum_over_heads"),
            lhs,
            _without_value_biases(A1, MatAdd(b_O, MatMul(b_Va, W_O1))),
        ),
        Twin(
            "once_per_key_value_head",
            FOLD_VALUE_BIASES.describe("once_per_key_value_head"),
            lhs,
            _without_value_biases(A1, MatAdd(b_O, MatMul(b_Va, W_O1), MatMul(b_Vb, W_O3))),
        ),
        Twin(
            "without_W_O",
            "add the value biases to b_O directly, skipping W_O (type-checks only when d_head = d_model)",
            MatAdd(
                MatMul(A1, MatAdd(MatMul(X, MatrixSymbol("W_{V,a}", d, d)), MatMul(ones, b_V_square)),
                       MatrixSymbol("W_{O,1}", d, d)),
                MatMul(A3, MatAdd(MatMul(X, MatrixSymbol("W_{V,b}", d, d)), MatMul(ones, b_Vb_square)),
                       MatrixSymbol("W_{O,3}", d, d)),
                MatMul(ones, b_O),
            ),
            MatAdd(
                MatMul(A1, X, MatrixSymbol("W_{V,a}", d, d), MatrixSymbol("W_{O,1}", d, d)),
                MatMul(A3, X, MatrixSymbol("W_{V,b}", d, d), MatrixSymbol("W_{O,3}", d, d)),
                MatMul(ones, MatAdd(b_O, b_V_square, b_Vb_square)),
            ),
            dims=square,
        ),
        Twin(
            "fully_masked_row",
            "fold where head 1's pattern P has a fully masked row set to zero (its rows need not sum to 1)",
            _layer(P, b_Va, b_Vb, b_O),
            _without_value_biases(P, b_O_folded),
        ),
    )


def _value_bias_proof() -> Proof:
    lhs = _layer(A1, b_Va, b_Vb, b_O)
    rhs = _without_value_biases(A1, b_O_folded)
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=_value_bias_steps(rhs),
        facts=_value_bias_facts(),
        samplers={**{E_h: causal_exponentials for E_h in EXPS}, P: _pattern_with_empty_first_row},
        explicit_dims=EXPLICIT_DIMS,
        twins=_value_bias_twins(lhs),
        lemmas=(("capped_rows_sum_to_one", capped_rows_sum_to_one()),),
    )


# -- key biases ------------------------------------------------------------------------------

Q, Q0, K = MatrixSymbol("Q", n, e), MatrixSymbol("Q_0", n, e), MatrixSymbol("K", n, e)
b_K, b_Q = MatrixSymbol("b_K", 1, e), MatrixSymbol("b_Q", 1, e)
c = MatrixSymbol("c", n, 1)
E = MatrixSymbol("E", n, n)
g, h = MatrixSymbol("g", n, 1), MatrixSymbol("h", n, 1)
E_b, E_q = MatrixSymbol("E_b", n, n), MatrixSymbol("E_q", n, n)
r, r_b, r_q = MatrixSymbol("r", n, 1), MatrixSymbol("r_b", n, 1), MatrixSymbol("r_q", n, 1)
k, k_b = MatrixSymbol("k", 1, n), MatrixSymbol("k_b", 1, n)
A, A_b = MatrixSymbol("A", n, n), MatrixSymbol("A_b", n, n)


def causal_exponentials(rng, shape) -> sympy.Matrix:
    """Entrywise exponentials of causal scores: positive on and below the diagonal, 0 above."""
    rows, cols = shape
    return sympy.Matrix(rows, cols, lambda i, j: _positive(rng) if j <= i else 0)


def _positive_vector(rng, shape) -> sympy.Matrix:
    return sympy.Matrix(*shape, lambda i, j: _positive(rng))


def key_bias_scores_proof() -> Proof:
    """The lemma behind the key-bias removal: ``Q (K + 1 b_K)^T = Q K^T + c 1^T`` with ``c = Q b_K^T``.

    ``Q`` ``[n, e]`` are the queries with their bias, ``K`` ``[n, e]`` the keys without theirs.
    The key bias adds to row ``i`` of the scores the single number ``c_i``.
    """
    lhs = MatMul(Q, Transpose(MatAdd(K, MatMul(ones, b_K))))
    rhs = MatAdd(MatMul(Q, K.T), MatMul(c, ones.T))
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(Q, K.T), MatMul(Q, b_K.T, ones.T)), r"$(K + \mathbf{1}_n b_K)^\top = K^\top + b_K^\top \mathbf{1}_n^\top$, distribute"),
            Step(rhs, r"definition of $c$: the same $c_i$ for every key $j$ of row $i$"),
        ),
        facts=(Fact(c, MatMul(Q, b_K.T), "what the key bias adds to each row of scores"),),
        explicit_dims=EXPLICIT_DIMS,
        twins=(
            Twin(
                "drop_query_bias_too",
                "drop the query bias as well: it adds 1 b_Q K^T, which changes along each row",
                MatMul(MatAdd(Q0, MatMul(ones, b_Q)), Transpose(MatAdd(K, MatMul(ones, b_K)))),
                MatAdd(MatMul(Q0, K.T), MatMul(Q0, b_K.T, ones.T)),
            ),
        ),
    )


def _key_bias_proof() -> Proof:
    lhs = MatMul(Inverse(DiagMatrix(r_b)), E_b)
    rhs = MatMul(Inverse(DiagMatrix(r)), E)
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatMul(Inverse(DiagMatrix(r_b)), DiagMatrix(g), E), r"law of exponents: definition of $E_b$"),
            Step(
                MatMul(Inverse(DiagMatrix(r)), Inverse(DiagMatrix(g)), DiagMatrix(g), E),
                r"the row sums scale alike: $r_b = E_b \mathbf{1}_n = \operatorname{diag}(g)\, r$, and"
                r" $\operatorname{diag}(\operatorname{diag}(g)\, r) = \operatorname{diag}(g) \operatorname{diag}(r)$",
            ),
            Step(rhs, r"$\operatorname{diag}(g)^{-1} \operatorname{diag}(g) = I_n$"),
        ),
        definitions=(
            Definition(E_q, MatMul(E, DiagMatrix(h)), "exp of scores shifted by h_j, a different amount for each key"),
            Definition(r_q, MatMul(E_q, ones), "the row sums of E_q"),
            Definition(k, MatMul(ones.T, E), "the column sums of E"),
            Definition(k_b, MatMul(ones.T, E_b), "the column sums of E_b"),
        ),
        facts=(
            Fact(E_b, MatMul(DiagMatrix(g), E),
                 "exp of the biased scores S + c 1^T, entrywise: exp(s_ij + c_i) = exp(c_i) exp(s_ij), g = exp(c)"),
            Fact(r, MatMul(E, ones), "the row sums of E"),
            Fact(r_b, MatMul(E_b, ones), "the row sums of E_b"),
            Fact.invertible(DiagMatrix(r), "the row sums of E are positive: every row has an unmasked key"),
            Fact.invertible(DiagMatrix(g), "g = exp(c) is positive"),
            Fact.invertible(DiagMatrix(r_q), "the row sums of E_q are positive"),
            Fact.invertible(DiagMatrix(k), "the column sums of E are positive (for the twin that normalises columns)"),
            Fact.invertible(DiagMatrix(k_b), "the column sums of E_b are positive"),
        ),
        samplers={E: causal_exponentials, g: _positive_vector, h: _positive_vector},
        explicit_dims=EXPLICIT_DIMS,
        lemmas=(("key_bias_scores", key_bias_scores_proof()),),
        twins=(
            Twin(
                "shift_along_the_row",
                "a shift that changes along the row (a query bias b_Q k_j, or a key bias rotated by the key's position)",
                MatMul(Inverse(DiagMatrix(r_q)), E_q),
                rhs,
            ),
            Twin(
                "normalise_columns",
                "normalise over queries (columns) instead of keys: the row shift no longer cancels",
                MatMul(E_b, Inverse(DiagMatrix(k_b))),
                MatMul(E, Inverse(DiagMatrix(k))),
            ),
            attention_softcap_twin(),
            sink_shift_twin(),
        ),
    )


# -- wrong rewrites: wrong transforms the numeric check must reject --------------------------


def _fold_through(select):
    """Fold each value bias ``b_V[j]`` through the ``W_O[h]`` of ``select(group of j)`` only."""

    def transform(state_dict, cfg):
        out, new_cfg = fold_value_biases(state_dict, cfg)
        _weight, bias, kv_heads = attention_names(cfg, "V")
        size = cfg.n_heads // kv_heads
        for layer in range(cfg.n_layers):
            p = f"blocks.{layer}.attn"
            b_V, W_O = state_dict[f"{p}.{bias}"], state_dict[f"{p}.W_O"]
            folded = state_dict[f"{p}.b_O"].clone()
            for j in range(kv_heads):
                for head in select(range(j * size, (j + 1) * size)):
                    folded += b_V[j] @ W_O[head]
            out[f"{p}.b_O"] = folded
        return out, new_cfg

    return transform


def _fold_value_biases_regardless(state_dict, cfg):
    """Fold the value biases into the output bias although the pattern's rows do not sum to 1."""
    _weight, bias, _heads = attention_names(cfg, "V")
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        out[f"{p}.b_O"] = (state_dict[f"{p}.b_O"].double()
                           + value_bias_through_output(state_dict[f"{p}.{bias}"], state_dict[f"{p}.W_O"])).to(state_dict[f"{p}.b_O"].dtype)
        out[f"{p}.{bias}"] = torch.zeros_like(state_dict[f"{p}.{bias}"])
    return out, cfg.replace(applied=cfg.applied + ("fold_value_biases",))


def _remove_key_biases_regardless(state_dict, cfg):
    """Zero the key biases although the keys are rotated, normed or the scores capped after them."""
    _weight, bias, _heads = attention_names(cfg, "K")
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        out[f"blocks.{layer}.attn.{bias}"] = torch.zeros_like(state_dict[f"blocks.{layer}.attn.{bias}"])
    return out, cfg.replace(applied=cfg.applied + (remove_key_biases.identity,))


def _drop_query_biases(state_dict, cfg):
    """Zero the query biases instead of the key biases."""
    _unused, new_cfg = remove_key_biases(state_dict, cfg)
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        out[f"blocks.{layer}.attn.b_Q"] = torch.zeros_like(state_dict[f"blocks.{layer}.attn.b_Q"])
    return out, new_cfg


FOLD_VALUE_BIASES = register(
    Identity(
        title="Folding value biases into the output bias",
        summary="rows of a pattern sum to 1, so A (X W_V + 1 b_V) W_O = A X W_V W_O + 1 b_V W_O: b_O += sum_h b_V[h] W_O[h]",
        preconditions=(
            "every row of every attention pattern sums to 1: a softmax over at least one unmasked key"
            " (the reference pass masks causally, so no row is fully masked)",
            NO_ATTN_SINKS,
            NOT_APPLIED,
        ),
        build_proof=_value_bias_proof,
        transform=fold_value_biases,
        postcondition=biases_zero("V"),
        wrong_rewrites={
            "no_sum_over_heads": WrongRewrite(
                _fold_through(lambda heads: heads[:1] if heads.start == 0 else []),
                "fold only the first head's value bias term into b_O",
            ),
            "once_per_key_value_head": WrongRewrite(
                _fold_through(lambda heads: heads[:1]),
                "with grouped-query attention, fold each shared value bias through one W_O of its group",
            ),
            "drop_value_biases": _fold_through(lambda heads: []),
            "under_attention_sinks": WrongRewrite(_fold_value_biases_regardless, REGARDLESS, regardless=True),
        },
        half_precision=COMPUTES,
    )
)

REMOVE_KEY_BIASES = register(
    Identity(
        title="Removing key biases",
        summary="q_i . (k_j + b_K) = q_i . k_j + q_i . b_K, the same for every key j, and softmax over j ignores it",
        preconditions=(NOT_ROTARY, NO_QK_NORM, NO_ATTN_SOFTCAP, NO_ATTN_SINKS, NOT_APPLIED),
        build_proof=_key_bias_proof,
        transform=remove_key_biases,
        postcondition=biases_zero("K"),
        wrong_rewrites={
            "drop_query_biases": _drop_query_biases,
            "regardless": WrongRewrite(_remove_key_biases_regardless, REGARDLESS, regardless=True),
        },
        half_precision=MOVES_ENTRIES,
    )
)
