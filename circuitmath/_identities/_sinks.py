"""What an attention sink (GPT-OSS: a logit ``sigma`` per head in each softmax, whose weight is
dropped) does to the identities that read a pattern's rows, as claims about one row of ``n``
keys with scores ``S``: a row sums to ``sum_k e^{s_k} / (sum_k e^{s_k} + e^sigma) < 1``, so
folding value biases (which needs rows that sum to 1) is not exact, and a shift ``c_0`` of a
row's scores (a key bias) is not a shift of the sink, so removing key biases is not either."""

from __future__ import annotations

from sympy import MatMul, Sum, Symbol, exp, log

from .._proof import Twin
from ._softcaps import ENTRY, S, k, n, shift

__all__ = ["sink_rows_twin", "sink_shift_twin"]

SINK = Symbol(r"\sigma", real=True)


def _row_with_sink(extra) -> Sum:
    """``sum_k e^{s_0k + extra} + e^sigma``: row 0's softmax denominator with the sink."""
    return Sum(exp(S[0, k] + extra), (k, 0, n - 1)) + exp(SINK)


def sink_rows_twin() -> Twin:
    """Folding value biases under an attention sink: row 0 of the pattern does not sum to 1."""
    return Twin(
        "under_attention_sinks",
        "fold the value biases although each head's softmax has a sink logit sigma (GPT-OSS): a row of the pattern"
        " sums to sum_k e^{s_k} / (sum_k e^{s_k} + e^sigma), not 1, so A 1 b_V W_O is not 1 b_V W_O",
        MatMul(Sum(exp(S[0, k]) / _row_with_sink(0), (k, 0, n - 1)), ENTRY),
        ENTRY,
    )


def sink_shift_twin() -> Twin:
    """Removing key biases under an attention sink: the shift ``c_0`` of row 0 moves weight
    between the keys and the sink, and entry (0, 0) of the log-pattern moves."""
    return Twin(
        "under_attention_sinks",
        "remove the key biases although each head's softmax has a sink logit sigma (GPT-OSS): the shift c_0 = q_0 . b_K"
        " of row 0's scores does not shift the sink, so the pattern changes",
        MatMul(S[0, 0] + shift - log(_row_with_sink(shift)), ENTRY),
        MatMul(S[0, 0] - log(_row_with_sink(0)), ENTRY),
    )
