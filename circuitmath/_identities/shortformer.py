"""Shortformer positional embeddings: where positions enter, and how to fold around them.

Symbols (one position, one head; row vectors): ``x`` ``[1, d]`` the residual stream, ``p``
``[1, d]`` that position's row of ``W_pos``, ``W`` ``[d, e]`` and ``b_W`` ``[1, e]`` the query
(or key) map, ``W_V`` and ``b_V`` the value map. ``LN(x) = LNPre(x) diag(w) + b`` as in the
LayerNorm family, with ``LNPre(x) = rho x C`` for a scalar ``rho``.

The source notes describe shortformer twice. The newer text: positions are not in the residual
stream, queries and keys read ``residual + W_pos``, values and MLPs read the residual alone.
The older text says positions are *also* added to the residual stream "in the standard way";
then values see them and queries see them twice. The implementation adds ``W_pos`` after
``ln1``; that is what the claim below computes, and the twins show each other reading differs.
"""

from __future__ import annotations

from sympy import DiagMatrix, MatAdd, MatMul, MatrixSymbol, Symbol

from .._processing import fold_layer_norm, shortformer_to_tables
from .._processing._common import NOT_APPLIED
from .._processing.shortformer import IS_SHORTFORMER
from .._proof import Fact, Proof, Step, Twin
from .._registry import COMPUTES, Identity, WrongRewrite, register
from .layer_norm import C, DEFINITIONS, FACTS, LN, LNPre, b, d, w, x

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "shortformer"

e = Symbol("e", positive=True, integer=True)
p = MatrixSymbol("p", 1, d)
W = MatrixSymbol("W", d, e)
b_W = MatrixSymbol("b_W", 1, e)
W_V = MatrixSymbol("W_V", d, e)
b_V = MatrixSymbol("b_V", 1, e)
rho_shifted = Symbol(r"\rho'", positive=True)
LNPre_shifted = MatrixSymbol(r"\mathrm{LNPre}(x + p)", 1, d)
LN_shifted = MatrixSymbol(r"\mathrm{LN}(x + p)", 1, d)

FACTS_SHIFTED = FACTS + (
    Fact(LNPre_shifted, MatMul(rho_shifted, MatAdd(x, p), C), "LNPre of the residual with positions added"),
    Fact(LN_shifted, MatAdd(MatMul(LNPre_shifted, DiagMatrix(w)), b), "LN of the residual with positions added"),
)


def _tables_proof() -> Proof:
    query = MatAdd(MatMul(MatAdd(LN, p), W), b_W)
    folded = MatAdd(MatMul(LNPre, MatMul(DiagMatrix(w), W)), MatAdd(b_W, MatMul(b, W)), MatMul(p, W))
    return Proof(
        lhs=query,
        rhs=folded,
        steps=(
            Step(MatAdd(MatMul(MatAdd(MatMul(LNPre, DiagMatrix(w)), b, p), W), b_W), r"definition of $\mathrm{LN}$"),
            Step(MatAdd(MatMul(LNPre, DiagMatrix(w), W), MatMul(b, W), MatMul(p, W), b_W), "distribute over the sum"),
            Step(folded, r"regroup: the folded reader, its bias, and the positional table $p W$"),
        ),
        definitions=DEFINITIONS,
        facts=FACTS_SHIFTED,
        explicit_dims={d: 4, e: 3},
        assumptions=("rho is any scalar: eps stays inside LNPre",),
        twins=(
            Twin(
                "naive_fold",
                SHORTFORMER_TABLES.describe("naive_fold"),
                query,
                MatAdd(MatMul(MatAdd(LNPre, p), DiagMatrix(w), W), b_W, MatMul(b, W)),
            ),
            Twin(
                "older_reading_queries",
                "the older notes' reading: positions also in the residual stream, so queries read"
                " LN(x + p) + p",
                query,
                MatAdd(MatMul(MatAdd(LN_shifted, p), W), b_W),
            ),
            Twin(
                "older_reading_values",
                "the older notes' reading makes values depend on positions: LN(x + p) W_V = LN(x) W_V",
                MatAdd(MatMul(LN, W_V), b_V),
                MatAdd(MatMul(LN_shifted, W_V), b_V),
            ),
        ),
    )


def _naive_fold(state_dict, cfg):
    """Fold as if W_pos entered the residual stream: ln1's gain then scales the positions."""
    folded, folded_cfg = fold_layer_norm(state_dict, cfg.replace(positional_embedding_type="standard"))
    return folded, folded_cfg.replace(positional_embedding_type="shortformer")


def _older_reading(state_dict, cfg):
    """Positions added to the residual stream as well (the older notes' description)."""
    return dict(state_dict), cfg.replace(positional_embedding_type="standard")


def _positions_in_tables(state_dict, cfg):
    """No ``W_pos`` is left: the positions are read from each layer's tables."""
    if "pos_embed.W_pos" in state_dict or cfg.positional_embedding_type != "shortformer_tables":
        return f"positional_embedding_type is {cfg.positional_embedding_type!r}, W_pos given: {'pos_embed.W_pos' in state_dict}"
    return None


SHORTFORMER_TABLES = register(
    Identity(
        title="Shortformer: positions only in queries and keys, folded into per-layer tables",
        summary="(LN(x) + p) W + b_W = LNPre(x) (diag(w) W) + (b_W + b W) + p W: positions move into"
        " per-layer query and key tables, so LayerNorm folds exactly",
        preconditions=(IS_SHORTFORMER, "pre-norm", NOT_APPLIED),
        build_proof=_tables_proof,
        transform=shortformer_to_tables,
        postcondition=_positions_in_tables,
        wrong_rewrites={
            "naive_fold": WrongRewrite(
                _naive_fold,
                "fold the gain into W and keep adding W_pos before it: positions get scaled by w",
            ),
            "older_reading": _older_reading,
        },
        half_precision=COMPUTES,
    )
)
