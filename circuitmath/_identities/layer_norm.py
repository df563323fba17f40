"""LayerNorm folding and centering of reading weights.

Symbols (row-vector convention, one position of the residual stream at a time; positions are
independent because a norm acts on each row separately):

- ``x`` ``[1, d]`` the residual stream; ``W`` ``[d, m]`` and ``b_W`` ``[1, m]`` a reader;
- ``w`` ``[d, 1]`` and ``b`` ``[1, d]`` the LayerNorm gain and bias;
- ``C = I - 1 1^T / d`` the centering matrix;
- ``rho`` the scalar ``(|x C|^2 / d + eps)^(-1/2)``. Every proof below holds for *any* scalar
  ``rho``, so it holds with ``eps > 0``: this is why the fold is exact with ``eps`` kept
  inside ``LNPre``.
"""

from __future__ import annotations

import torch
from sympy import DiagMatrix, Identity as Eye, MatAdd, MatMul, MatrixSymbol, OneMatrix, Symbol, Transpose

from .._processing import center_reading_weights, fold_layer_norm, readers
from .._processing._common import NORM_READ_LINEARLY, NOT_APPLIED, PRE_NORM
from .._processing.layer_norm import IS_LN, READER_HAS_BIAS, READS_LNPRE
from ._postconditions import no_norm_parameters, readers_centered
from .._proof import Definition, Fact, Proof, Step, Twin
from .._registry import COMPUTES, Identity, WrongRewrite, register

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "layer_norm"

d, m = Symbol("d", positive=True, integer=True), Symbol("m", positive=True, integer=True)
rho = Symbol(r"\rho", positive=True)
x = MatrixSymbol("x", 1, d)
w = MatrixSymbol("w", d, 1)
b = MatrixSymbol("b", 1, d)
W = MatrixSymbol("W", d, m)
b_W = MatrixSymbol("b_W", 1, m)
ones = OneMatrix(d, 1)
C = MatrixSymbol("C", d, d)
LNPre = MatrixSymbol(r"\mathrm{LNPre}(x)", 1, d)
LN = MatrixSymbol(r"\mathrm{LN}(x)", 1, d)
RMSPre = MatrixSymbol(r"\mathrm{RMSPre}(x)", 1, d)

DEFINITIONS = (Definition(C, MatAdd(Eye(d), MatMul(-1 / d, ones, ones.T)), "the centering matrix"),)
#: What the norms of the claims stand for.
FACTS = (
    Fact(LNPre, MatMul(rho, x, C), "center, then divide by the RMS (eps inside rho)"),
    Fact(LN, MatAdd(MatMul(LNPre, DiagMatrix(w)), b), "LNPre, then gain and bias"),
    Fact(RMSPre, MatMul(rho, x), "divide by the RMS, no centering"),
)
EXPLICIT_DIMS = {d: 4, m: 3}


def _layer_norm_fold_proof() -> Proof:
    folded = MatAdd(MatMul(LNPre, MatMul(DiagMatrix(w), W)), MatAdd(b_W, MatMul(b, W)))
    lhs = MatAdd(MatMul(LN, W), b_W)
    W_sq, b_sq = MatrixSymbol("W", d, d), MatrixSymbol("b_W", 1, d)
    return Proof(
        lhs=lhs,
        rhs=folded,
        steps=(
            Step(MatAdd(MatMul(MatAdd(MatMul(LNPre, DiagMatrix(w)), b), W), b_W), r"definition of $\mathrm{LN}$"),
            Step(MatAdd(MatMul(LNPre, DiagMatrix(w), W), MatMul(b, W), b_W), "distribute over the sum"),
            Step(folded, r"regroup: $W_\mathrm{eff} = \operatorname{diag}(w) W$, $b_\mathrm{eff} = b_W + b W$"),
        ),
        definitions=DEFINITIONS,
        facts=FACTS,
        explicit_dims=EXPLICIT_DIMS,
        assumptions=("rho is any scalar: eps stays inside LNPre",),
        twins=(
            Twin(
                "scale_columns",
                LAYER_NORM_FOLD.describe("scale_columns"),
                MatAdd(MatMul(LN, W_sq), b_sq),
                MatAdd(MatMul(LNPre, W_sq, DiagMatrix(w)), b_sq, MatMul(b, W_sq)),
            ),
            Twin(
                "bias_through_transpose",
                LAYER_NORM_FOLD.describe("bias_through_transpose"),
                MatAdd(MatMul(LN, W_sq), b_sq),
                MatAdd(MatMul(LNPre, DiagMatrix(w), W_sq), b_sq, MatMul(b, Transpose(W_sq))),
            ),
            Twin(
                "drop_bias",
                LAYER_NORM_FOLD.describe("drop_bias"),
                lhs,
                MatAdd(MatMul(LNPre, DiagMatrix(w), W), b_W),
            ),
            Twin(
                "bias_through_gain",
                LAYER_NORM_FOLD.describe("bias_through_gain"),
                lhs,
                MatAdd(MatMul(LNPre, DiagMatrix(w), W), b_W, MatMul(b, DiagMatrix(w), W)),
            ),
            Twin(
                "fold_twice",
                "fold into a model that still applies LN (the fold applied twice)",
                lhs,
                MatAdd(MatMul(LN, DiagMatrix(w), W), b_W, MatMul(b, W)),
            ),
        ),
    )


def _layer_norm_fold_proof_with_eps() -> Proof:
    """The fold's proof with its lemma ``eps_written_out``: the same chain, ``eps > 0`` written out."""
    from .norms import with_eps_lemma  # the normaliser's symbols live with the other norms

    return with_eps_lemma(_layer_norm_fold_proof())


def _center_reading_proof() -> Proof:
    centered = MatAdd(W, MatMul(-1 / d, ones, ones.T, W))
    lhs = MatMul(LNPre, centered)
    rhs = MatMul(LNPre, W)
    ones_m = OneMatrix(m, 1)
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(LNPre, W), MatMul(-1 / d, LNPre, ones, ones.T, W)), "distribute over the sum"),
            Step(MatAdd(MatMul(LNPre, W), MatMul(-rho / d, x, C, ones, ones.T, W)), r"definition of $\mathrm{LNPre}$"),
            Step(
                MatAdd(MatMul(LNPre, W), MatMul(-rho / d, x, MatAdd(ones, MatMul(-1 / d, ones, ones.T, ones)), ones.T, W)),
                r"definition of $C$",
            ),
            Step(MatAdd(MatMul(LNPre, W), MatMul(-rho / d, x, MatAdd(ones, MatMul(-d / d, ones)), ones.T, W)), r"$\mathbf{1}_d^\top \mathbf{1}_d = d$"),
            Step(rhs, r"$C \mathbf{1}_d = 0$: $\mathrm{LNPre}(x)$ is orthogonal to $\mathbf{1}_d$"),
        ),
        definitions=DEFINITIONS,
        facts=FACTS,
        explicit_dims=EXPLICIT_DIMS,
        assumptions=("rho is any scalar: eps stays inside LNPre",),
        twins=(
            Twin(
                "wrong_axis",
                CENTER_READING_WEIGHTS.describe("wrong_axis"),
                MatMul(LNPre, MatAdd(W, MatMul(-1 / m, W, ones_m, ones_m.T))),
                rhs,
            ),
            Twin(
                "behind_rms_norm",
                "center a reader behind RMSNorm, whose output is not orthogonal to 1",
                MatMul(RMSPre, centered),
                MatMul(RMSPre, W),
            ),
            Twin(
                "before_folding",
                "center a reader behind LN before folding its gain and bias",
                MatMul(LN, centered),
                MatMul(LN, W),
            ),
        ),
    )


# -- wrong rewrites: wrong transforms the numeric check must reject --------------------------


def _fold_with_bias_term(state_dict, cfg, bias_term):
    """Fold, but give each reader the bias ``b_W + bias_term(b, W_eff)`` instead."""
    out, new_cfg = fold_layer_norm(state_dict, cfg)
    for norm, pairs in readers(cfg):
        for weight, bias in pairs:
            if bias is not None:
                out[bias] = state_dict[bias] + bias_term(state_dict[f"{norm}.b"], out[weight])
    return out, new_cfg


def _center_wrong_axis(state_dict, cfg):
    out, new_cfg = center_reading_weights(state_dict, cfg)
    for _norm, pairs in readers(cfg):
        for weight, _bias in pairs:
            W_ = state_dict[weight]
            out[weight] = W_ - W_.mean(dim=-1, keepdim=True)
    return out, new_cfg


def _fold_scaling_columns(state_dict, cfg):
    """Fold each LayerNorm gain along the reader's last axis (``W * w``) wherever that axis has
    length d_model, where the mistake broadcasts silently."""
    out, new_cfg = fold_layer_norm(state_dict, cfg)
    for norm, pairs in readers(cfg):
        gain = state_dict[f"{norm}.w"]
        for weight, _bias in pairs:
            if state_dict[weight].shape[-1] == cfg.d_model:
                out[weight] = state_dict[weight] * gain
    return out, new_cfg


def _fold_bias_through_transpose(state_dict, cfg):
    """Fold each LayerNorm bias through the reader's transpose (b_W + W b instead of b_W + b W)
    wherever the reader is square, where the mistake broadcasts silently."""
    out, new_cfg = fold_layer_norm(state_dict, cfg)
    for norm, pairs in readers(cfg):
        bias_of_norm = state_dict[f"{norm}.b"]
        for weight, bias in pairs:
            if bias is not None and state_dict[weight].shape[-1] == cfg.d_model:
                out[bias] = state_dict[bias] + state_dict[weight] @ bias_of_norm
    return out, new_cfg


def _a_square_reader(cfg) -> bool:
    """Whether some reader's output axis has length d_model (d_head, d_mlp or d_vocab)."""
    return cfg.d_model in (cfg.d_head, cfg.d_mlp, cfg.d_vocab)


def _center_readers_regardless(state_dict, cfg):
    """Center every reader over d_model whatever its input."""
    out = dict(state_dict)
    for _norm, pairs in readers(cfg):
        for weight, _bias in pairs:
            W_ = state_dict[weight]
            out[weight] = W_ - W_.mean(dim=-2, keepdim=True)
    return out, cfg.replace(applied=cfg.applied + (CENTER_READING_WEIGHTS.name,))


#: What the diagnosis says of a rewrite applied although its identity refuses the model.
REGARDLESS = "the rewrite, applied although the identity refuses this model"

LAYER_NORM_FOLD = register(
    Identity(
        title="Folding LayerNorm into its readers",
        summary="LN(x) W + b_W = LNPre(x) (diag(w) W) + (b_W + b W), with eps kept inside LNPre",
        preconditions=(PRE_NORM, IS_LN, NORM_READ_LINEARLY, READER_HAS_BIAS, NOT_APPLIED),
        build_proof=_layer_norm_fold_proof_with_eps,
        transform=fold_layer_norm,
        postcondition=no_norm_parameters,
        wrong_rewrites={
            "drop_bias": WrongRewrite(
                lambda sd, cfg: _fold_with_bias_term(sd, cfg, lambda b, W_eff: 0),
                "forget the LayerNorm bias term b W",
            ),
            "bias_through_gain": WrongRewrite(
                lambda sd, cfg: _fold_with_bias_term(sd, cfg, torch.matmul),
                "push the LayerNorm bias through the folded weight: b diag(w) W",
            ),
            "scale_columns": WrongRewrite(
                _fold_scaling_columns,
                "scale the reader's columns, not its rows (W * w[None, :], square W)",
                differs_on=_a_square_reader,
            ),
            "bias_through_transpose": WrongRewrite(
                _fold_bias_through_transpose,
                "fold the LayerNorm bias through the reader's transpose, b W^T (square W, where W @ b "
                "broadcasts)",
                differs_on=_a_square_reader,
            ),
        },
        half_precision=COMPUTES,
    )
)

CENTER_READING_WEIGHTS = register(
    Identity(
        title="Centering the weights that read the residual stream",
        summary="LNPre(x) is orthogonal to 1, so W - 1 mean_d(W) reads the same values as W",
        preconditions=(READS_LNPRE, PRE_NORM, NORM_READ_LINEARLY, NOT_APPLIED),
        build_proof=_center_reading_proof,
        transform=center_reading_weights,
        postcondition=readers_centered,
        wrong_rewrites={
            "wrong_axis": WrongRewrite(
                _center_wrong_axis, "center over the reader's output axis (mean over m), not over d_model"),
            "regardless": WrongRewrite(_center_readers_regardless, REGARDLESS, regardless=True),
        },
        prepare=lambda sd, cfg: fold_layer_norm(sd, cfg) if cfg.normalization_type == "LN" else (sd, cfg),
        check_note="folded first if it is a LayerNorm model",
        half_precision=COMPUTES,
    )
)
