"""What a softcap ``kappa * tanh(v / kappa)`` (Gemma 2's logits and attention scores) does to the
identities around it, as claims about one entry of a softmax.

A softcap acts entrywise, after the linear map that makes the logits or the scores: a rewrite
that leaves those unchanged (folding the final norm into the unembedding, folding value biases,
the QK refactor) leaves the capped ones unchanged too. A rewrite that is exact only because the
softmax ignores a shift (centering the unembedding, removing key biases) is not: ``tanh`` does
not commute with a shift. The claims below are about entry ``0`` (one token of the vocabulary,
one key of a row); every entry is alike. Symbols: ``kappa`` the cap, a positive number; sums run
over the symbolic vocabulary size (logits) or the number of keys ``n`` (scores).
"""

from __future__ import annotations

from sympy import DiagMatrix, MatAdd, MatMul, MatrixSymbol, OneMatrix, Sum, Symbol, exp, log, tanh

from .._proof import Fact, Proof, Step, Twin

__all__ = [
    "CAP", "capped", "capped_log_prob", "logit_softcap_twin", "attention_softcap_twin", "capped_rows_sum_to_one",
    "fold_before_the_logit_softcap",
]

CAP = Symbol(r"\kappa", positive=True)
ENTRY = OneMatrix(1, 1)


def capped(v):
    """``kappa tanh(v / kappa)``: a softcap of the scalar ``v``."""
    return CAP * tanh(v / CAP)


def capped_log_prob(row, j, size, shift) -> MatMul:
    """Entry 0 of ``log_softmax(softcap(row - shift))`` for a ``[1, size]`` row, as a 1 x 1 matrix."""
    lse = log(Sum(exp(capped(row[0, j] - shift)), (j, 0, size - 1)))
    return MatMul(capped(row[0, 0] - shift) - lse, ENTRY)


def logit_softcap_twin(ell, j, V, m) -> Twin:
    """Centering the unembedding under a logit softcap: the logits ``ell`` ``[1, V]`` shift by
    their mean ``m``, and the capped log-probs do not stay as they were."""
    return Twin(
        "under_logit_softcap",
        "center the unembedding although the logits pass through a softcap kappa tanh(l / kappa) (Gemma 2): the shift"
        " by -m is not a shift of the capped logits, and entry 0 of the log-probs moves",
        capped_log_prob(ell, j, V, m),
        capped_log_prob(ell, j, V, 0),
    )


n = Symbol("n", positive=True, integer=True)
k = Symbol("k", integer=True)
S = MatrixSymbol("S", n, n)
shift = Symbol(r"c_0", real=True)


def _log_pattern_entry(extra) -> MatMul:
    """Entry (0, 0) of the log of the softmax over keys of the capped scores ``S + extra``."""
    return MatMul(capped(S[0, 0] + extra) - log(Sum(exp(capped(S[0, k] + extra)), (k, 0, n - 1))), ENTRY)


def attention_softcap_twin() -> Twin:
    """Removing key biases under an attention softcap: the bias adds ``c_0`` to every score of
    row 0, and the capped row's softmax changes."""
    return Twin(
        "under_attention_softcap",
        "remove the key biases although the scores pass through a softcap kappa tanh(s / kappa) (Gemma 2): the shift"
        " c_0 = q_0 . b_K of row 0 is not a shift of the capped scores, and entry (0, 0) of the log-pattern moves",
        _log_pattern_entry(shift),
        _log_pattern_entry(0),
    )


def capped_rows_sum_to_one() -> Proof:
    """Every row of a pattern made from capped scores sums to 1: what folding value biases needs
    of a pattern holds under an attention softcap."""
    row = Sum(exp(capped(S[0, k])), (k, 0, n - 1))
    lhs = MatMul(Sum(exp(capped(S[0, k])) / row, (k, 0, n - 1)), ENTRY)
    return Proof(
        lhs=lhs,
        rhs=ENTRY,
        steps=(Step(ENTRY, r"the row sum $\sum_k e^{\mathrm{cap}(s_{0k})}$ does not depend on the key: it factors out"),),
        explicit_dims={n: 3},
        assumptions=("the softcap acts on each score before the softmax, whose row sums it divides by",),
        twins=(
            Twin("row_sum_of_raw_scores", "normalise the capped exponentials by the row sum of the uncapped ones",
                 MatMul(Sum(exp(capped(S[0, k])) / Sum(exp(S[0, k]), (k, 0, n - 1)), (k, 0, n - 1)), ENTRY), ENTRY),
        ),
    )


d, V = Symbol("d", positive=True, integer=True), Symbol("V", positive=True, integer=True)
y_hat, w, beta = MatrixSymbol(r"\hat{y}", 1, d), MatrixSymbol("w", d, 1), MatrixSymbol(r"\beta", 1, d)
W_U, b_U = MatrixSymbol("W_U", d, V), MatrixSymbol("b_U", 1, V)
W_U_f, b_U_f = MatrixSymbol(r"{W_U^{f}}", d, V), MatrixSymbol(r"{b_U^{f}}", 1, V)


def fold_before_the_logit_softcap() -> Proof:
    """The final norm's gain ``w`` and bias ``beta`` folded into ``W_U`` and ``b_U`` leave the
    logits ``[1, V]`` themselves unchanged (not only up to a shift), so a softcap applied to them
    afterwards sees the same logits: the fold is exact under a logit softcap. ``y_hat`` is the
    normalised stream (``LNPre`` or ``RMSPre``; ``beta = 0`` for RMSNorm)."""
    lhs = MatAdd(MatMul(y_hat, W_U_f), b_U_f)
    rhs = MatAdd(MatMul(MatAdd(MatMul(y_hat, DiagMatrix(w)), beta), W_U), b_U)
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(y_hat, DiagMatrix(w), W_U), b_U, MatMul(beta, W_U)), "definitions of the folded W_U and b_U"),
            Step(rhs, "collect: the norm's output times W_U"),
        ),
        facts=(
            Fact(W_U_f, MatMul(DiagMatrix(w), W_U), "the gain folded into W_U"),
            Fact(b_U_f, MatAdd(b_U, MatMul(beta, W_U)), "the bias folded into b_U"),
        ),
        explicit_dims={d: 3, V: 4},
        assumptions=("a logit softcap acts on each logit after W_U and b_U: equal logits give equal capped logits",),
        twins=(
            Twin("bias_not_folded", "fold the gain but not the bias: the logits move by beta W_U before the cap",
                 MatAdd(MatMul(y_hat, W_U_f), b_U), rhs),
        ),
    )
