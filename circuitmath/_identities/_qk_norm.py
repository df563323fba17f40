"""What a QK-norm does to the rotations inside the heads: an RMSNorm of each head's queries and
keys (Qwen3, Gemma 3) or of each whole projection (OLMo-2), a gain per entry, then the rotary
embedding.

An orthogonal ``R_h`` of head ``h``'s query/key space keeps that head's sum of squares, hence
the whole projection's, so every normaliser is what it was, whichever span the norm has. The
gain ``diag(g)`` comes between ``W_Q R`` and the score: ``R^T diag(g_Q) P_i P_j^T diag(g_K) R``
is ``diag(g_Q) P_i P_j^T diag(g_K)`` when each gain is one number on the head (``c I``
commutes with ``R``), and not for a general gain. The claims are about one query position
``i`` and one key position ``j`` of two heads, each its own key/value head.

Symbols (row vectors; ``d`` = d_model, ``e`` = d_head, ``k`` the columns of the free test
matrices ``T``): ``x_i``, ``x_j`` ``[1, d]`` what the projections read; ``W_{Q,h}``,
``W_{K,h}`` ``[d, e]``, ``b_{Q,h}``, ``b_{K,h}`` ``[1, e]``; ``R_h`` ``[e, e]`` orthogonal,
turning each rotary pair within itself; ``P_i``, ``P_j`` ``[e, e]`` the rotary rotations of the
two positions; ``\\rho_{i,h}``, ``\\rho_{j,h}`` the normalisers; ``G_{Q,h} = c_{Q,h} I`` a gain
that is one number on the head, ``g_{Q,h}`` ``[e, 1]`` a general one.
"""

from __future__ import annotations

from sympy import DiagMatrix, Identity as Eye, MatAdd, MatMul, MatrixSymbol, Symbol, Transpose

from .._proof import Fact, Proof, Step, Twin
from ._circuit_checks import rotary_like
from .rotation import d, e, free_matrix, k

__all__ = ["uniform_gain_head_rotations"]

HEADS = (1, 2)
x_i, x_j = MatrixSymbol("x_i", 1, d), MatrixSymbol("x_j", 1, d)
P_i, P_j = MatrixSymbol("P_i", e, e), MatrixSymbol("P_j", e, e)
W = {(side, h): MatrixSymbol(f"W_{{{side},{h}}}", d, e) for side in "QK" for h in HEADS}
b = {(side, h): MatrixSymbol(f"b_{{{side},{h}}}", 1, e) for side in "QK" for h in HEADS}
R = {h: MatrixSymbol(f"R_{h}", e, e) for h in HEADS}
rho = {(pos, h): Symbol(rf"\rho_{{{pos},{h}}}", positive=True) for pos in "ij" for h in HEADS}
c = {(side, h): Symbol(f"c_{{{side},{h}}}", nonzero=True) for side in "QK" for h in HEADS}
G = {(side, h): MatrixSymbol(f"G_{{{side},{h}}}", e, e) for side in "QK" for h in HEADS}  # c I
g = {(side, h): DiagMatrix(MatrixSymbol(f"g_{{{side},{h}}}", e, 1)) for side in "QK" for h in HEADS}
T = {(what, h): free_matrix(f"T_{{{what},{h}}}", 1) for what in ("q", "k", "s") for h in HEADS}


def _projected(side, h, x, rotation):
    """``x W R + b R`` (``x W + b`` when ``rotation`` is ``None``)."""
    turned = () if rotation is None else (rotation,)
    return MatAdd(MatMul(x, W[side, h], *turned), MatMul(b[side, h], *turned))


def _claim(gain, *, query=R.get, key=R.get):
    """Per head: its query's sum of squares at ``i`` (times ``T_{q,h}``), its key's at ``j``
    (``T_{k,h}``), and its score of ``i`` on ``j`` (``T_{s,h}``), each projection turned by
    ``query(h)``, ``key(h)`` and multiplied by ``gain(side, h)`` after its normaliser."""
    terms = []
    for h in HEADS:
        q, k_ = _projected("Q", h, x_i, query(h)), _projected("K", h, x_j, key(h))
        score = MatMul(rho["i", h], rho["j", h], q, gain("Q", h), P_i, Transpose(MatMul(k_, gain("K", h), P_j)))
        terms += [MatMul(q, Transpose(q), T["q", h]), MatMul(k_, Transpose(k_), T["k", h]), MatMul(score, T["s", h])]
    return MatAdd(*terms)


def _unturned(_h):
    return None


def _uniform(side, h):
    return G[side, h]


def _general(side, h):
    return g[side, h]


def _key_general(side, h):
    return G[side, h] if side == "Q" else g[side, h]


def uniform_gain_head_rotations() -> Proof:
    """Queries and keys of head ``h`` turned by ``R_h`` under a QK-norm whose gains are one number
    on each head: every sum of squares, so every normaliser, and every score is what it was."""
    rhs = _claim(_uniform, query=_unturned, key=_unturned)

    def moved(h):  # head h's turned score with R_h moved next to R_h^T, the gains as numbers
        return MatMul(c["Q", h], c["K", h], rho["i", h], rho["j", h], _projected("Q", h, x_i, None), P_i,
                      Transpose(P_j), R[h], Transpose(R[h]), Transpose(_projected("K", h, x_j, None)))

    return Proof(
        lhs=_claim(_uniform),
        rhs=rhs,
        steps=(
            Step(MatAdd(*(MatMul(_projected(side, h, x, None), R[h], Transpose(R[h]), Transpose(_projected(side, h, x, None)),
                                 T[what, h])
                          for h in HEADS for side, x, what in (("Q", x_i, "q"), ("K", x_j, "k"))),
                        *(MatMul(moved(h), T["s", h]) for h in HEADS)),
                 r"$(x W R + b R)^\top = R^\top (x W + b)^\top$; the gains are $c I$, which commutes with $R_h$, and"
                 r" $R_h P_i = P_i R_h$, $R_h P_j^\top = P_j^\top R_h$: each turns every rotary pair within itself"),
            Step(rhs, r"$R_h R_h^\top = I$: each head's sums of squares, hence the whole projection's and every"
                      r" normaliser, and each score are what they were"),
        ),
        facts=(
            *(Fact(G[side, h], MatMul(c[side, h], Eye(e)), f"head {h}'s {side} gain is one number on the head")
              for side in "QK" for h in HEADS),
            *(Fact(MatMul(R[h], Transpose(R[h])), Eye(e), f"R_{h} is orthogonal") for h in HEADS),
            *(Fact(MatMul(R[h], P_i), MatMul(P_i, R[h]), f"R_{h} commutes with the rotary rotation of position i")
              for h in HEADS),
            *(Fact(MatMul(R[h], Transpose(P_j)), MatMul(Transpose(P_j), R[h]),
                   f"R_{h} commutes with the inverse rotary rotation of position j") for h in HEADS),
        ),
        samplers={**{R[h]: rotary_like for h in HEADS}, P_i: rotary_like, P_j: rotary_like},
        explicit_dims={d: 2, e: 2, k: 1},
        assumptions=(
            "head h's query normaliser at position i is (s / N + eps)^(-1/2) for the sum of squares s of what the"
            " norm spans there: the head's query (a QK-norm per head, N = d_head, each head its own) or the whole"
            " query projection (OLMo-2, N = n_heads d_head, one for every head); the keys' at j likewise. The first"
            " conclusions show every head's sum of squares kept, hence their sum, the projection's: the turned"
            " model's normalisers are the same",
            "the gain multiplies each entry after the normaliser and before the rotary rotations P_i, P_j, which"
            " are the same for every head (the identity without rotary embeddings)",
            "two heads, each its own key/value head turned by its own R_h; with grouped-query attention the query"
            " heads of a group share their key/value head's R, as in rotate_heads' own proof",
            "rotate_heads refuses every model with a QK-norm: a trained gain is not one number on a head, and the"
            " twins show that a general gain breaks the identity",
        ),
        twins=(
            Twin("gain_not_uniform", "turn each head's queries and keys by R_h under a QK-norm whose gains differ"
                 " within the head: diag(g) does not commute with R_h, and the scores change",
                 _claim(_general), _claim(_general, query=_unturned, key=_unturned)),
            Twin("key_gain_not_uniform", "the query gains one number on each head, the key gains not: the scores still"
                 " change, R_h^T diag(g_K) R_h != diag(g_K)",
                 _claim(_key_general), _claim(_key_general, query=_unturned, key=_unturned)),
        ),
    )
