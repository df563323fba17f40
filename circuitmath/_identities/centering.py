"""Centering the weights that write to the residual stream, and centering the unembed.

Symbols (row-vector convention, one position at a time):

- ``d`` is ``d_model``, ``V`` the vocabulary, ``e`` ``d_head``, ``k`` ``d_mlp``;
- ``t`` ``[1, V]`` a one-hot token, ``p`` ``[1, d]`` its row of ``W_pos``, ``z`` ``[1, e]`` a
  head's mixed values, ``a`` ``[1, k]`` an MLP's activations. One head and one MLP stand for all
  of them: every write is treated the same way and the residual stream is their sum;
- ``C = I - 1 1^T / d`` the centering matrix; ``rho`` the normaliser of ``LNPre``.

``LNPre(y) = n(y C)`` with ``n(v) = v (|v|^2 / d + eps)^(-1/2)``: LNPre sees ``y`` only through
``y C``. The writing-weight proof shows that centering every write leaves ``x C`` unchanged, so
``rho``, computed from ``x C``, is the same scalar on both sides, whatever ``eps``.

For the unembed: ``l = y W_U + b_U`` ``[1, V]`` are a position's logits (``y`` the final norm's
output) and ``m`` their mean. ``log_softmax(v) = v - log(sum_j e^{v_j}) 1^T``; the sums run over
the symbolic vocabulary size ``V``.
"""

from __future__ import annotations

import torch
from sympy import Identity as Eye, MatAdd, MatMul, MatrixSymbol, OneMatrix, Rational, Sum, Symbol, exp, log

from .._processing import center_unembed, center_writing_weights, writers
from .._processing._common import NO_LOGIT_SOFTCAP, NOT_APPLIED, PRE_NORM
from .._processing.centering import CENTERING_NORM
from ._postconditions import means_zero, writers_centered
from .._proof import Definition, Fact, Proof, Step, Twin
from .._registry import COMPUTES, Identity, WrongRewrite, register
from ._softcaps import fold_before_the_logit_softcap, logit_softcap_twin
from .layer_norm import REGARDLESS

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "centering"

d, V = Symbol("d", positive=True, integer=True), Symbol("V", positive=True, integer=True)
e, k = Symbol("e", positive=True, integer=True), Symbol("k", positive=True, integer=True)
rho = Symbol(r"\rho", positive=True)
ones = OneMatrix(d, 1)
C = MatrixSymbol("C", d, d)


def _centered(W: MatrixSymbol) -> MatAdd:
    """``W - (1/d) W 1 1^T``: ``W`` minus its mean over ``d_model`` (its last axis)."""
    return MatAdd(W, MatMul(-1 / d, W, ones, ones.T))


# -- writing weights -------------------------------------------------------------------------

t, p, z, a = MatrixSymbol("t", 1, V), MatrixSymbol("p", 1, d), MatrixSymbol("z", 1, e), MatrixSymbol("a", 1, k)
W_E, W_O, W_out = MatrixSymbol("W_E", V, d), MatrixSymbol("W_O", e, d), MatrixSymbol(r"W_{out}", k, d)
b_O, b_out = MatrixSymbol("b_O", 1, d), MatrixSymbol(r"b_{out}", 1, d)
WRITES = ((t, W_E), (None, p), (z, W_O), (None, b_O), (a, W_out), (None, b_out))
BARS = {W: MatrixSymbol(r"\bar{%s}" % W.name, *W.shape) for _, W in WRITES}
x, x_c = MatrixSymbol("x", 1, d), MatrixSymbol("x'", 1, d)
LNPre_x, LNPre_xc = MatrixSymbol(r"\mathrm{LNPre}(x)", 1, d), MatrixSymbol(r"\mathrm{LNPre}(x')", 1, d)
RMSPre_x, RMSPre_xc = MatrixSymbol(r"\mathrm{RMSPre}(x)", 1, d), MatrixSymbol(r"\mathrm{RMSPre}(x')", 1, d)


def _stream(weights, right=None) -> MatAdd:
    """The sum of the writes ``reader @ weights[W]`` (or ``weights[W]`` for a bias), each times ``right``."""
    terms = [MatMul(*(f for f in (r, weights.get(W, W), right) if f is not None)) for r, W in WRITES]
    return MatAdd(*terms)


def _writing_proof() -> Proof:
    definitions = (
        Definition(C, MatAdd(Eye(d), MatMul(-1 / d, ones, ones.T)), "the centering matrix"),
        Definition(x, _stream({}), "the stream: every write summed"),
        *(Definition(BARS[W], _centered(W), "mean over d subtracted") for _, W in WRITES),
        Definition(x_c, _stream(BARS), "every write centered"),
        Definition(RMSPre_x, MatMul(rho, x), "no centering"),
        Definition(RMSPre_xc, MatMul(rho, x_c), "the same for x'"),
    )
    facts = (
        Fact(LNPre_x, MatMul(rho, x, C), "rho is computed from x C"),
        Fact(LNPre_xc, MatMul(rho, x_c, C), "the same rho, as x' C = x C"),
    )
    W_O_tilde = MatrixSymbol(r"\tilde{W}_O", e, d)
    ones_e = OneMatrix(e, 1)
    wrong_W_O = _stream({W_O: MatAdd(W_O, MatMul(-1 / e, ones_e, ones_e.T, W_O))})
    return Proof(
        lhs=LNPre_xc,
        rhs=LNPre_x,
        steps=(
            Step(MatMul(rho, x_c, C), r"definition of $\mathrm{LNPre}$"),
            Step(MatMul(rho, _stream({}, C), C), r"$\bar{W} = W C$ for every write"),
            Step(MatMul(rho, _stream({}), C, C), r"factor out $C$"),
            Step(MatMul(rho, x, C), r"$C C = C$; definition of $x$"),
            Step(LNPre_x, r"definition of $\mathrm{LNPre}$"),
        ),
        definitions=definitions,
        facts=facts,
        explicit_dims={d: 4, V: 3, e: 2, k: 3},
        assumptions=(
            "LNPre(y) = n(y C) depends on y only through y C; rho, computed from x C = x' C, is the same on both sides",
            "eps stays inside rho: the identity holds for every eps >= 0",
        ),
        twins=(
            Twin(
                "behind_rms_norm",
                "center the writes of a model whose norm is RMSNorm, which does not center",
                RMSPre_xc,
                RMSPre_x,
            ),
            Twin(
                "W_O_over_d_head",
                CENTER_WRITING_WEIGHTS.describe("W_O_over_d_head"),
                MatMul(rho, wrong_W_O, C),
                LNPre_x,
            ),
            Twin(
                "shortformer_W_pos",
                CENTER_WRITING_WEIGHTS.describe("shortformer_W_pos"),
                MatAdd(LNPre_x, BARS[p]),
                MatAdd(LNPre_x, p),
            ),
        ),
    )


# -- unembed ---------------------------------------------------------------------------------

y = MatrixSymbol("y", 1, d)
ell = MatrixSymbol(r"\ell", 1, V)
W_U, b_U = MatrixSymbol("W_U", d, V), MatrixSymbol("b_U", 1, V)
W_U_bar, b_U_bar = MatrixSymbol(r"\bar{W}_U", d, V), MatrixSymbol(r"\bar{b}_U", 1, V)
m = Symbol("m", real=True)
j = Symbol("j", integer=True)
ones_V = OneMatrix(V, 1)
MEAN = Rational(1, 2)  # the mean every sampled row of logits is drawn with


def _log_sum_exp(entry) -> log:
    """``log(sum_j e^{entry_j})`` over the vocabulary; ``entry`` is a function of the index ``j``."""
    return log(Sum(exp(entry), (j, 0, V - 1)))


def _logits_with_mean(rng, shape) -> list[list]:
    """A row of integer logits whose mean is :data:`MEAN`, so the fact defining ``m`` holds."""
    head = [rng.randint(-4, 4) for _ in range(shape[1] - 1)]
    return [head + [shape[1] * MEAN - sum(head)]]


def _unembed_proof() -> Proof:
    row = ones_V.T
    lse_centered = _log_sum_exp(ell[0, j] - m)
    lse = _log_sum_exp(ell[0, j])
    rhs = MatAdd(ell, MatMul(-lse, row))
    W_U_over_d = MatAdd(W_U, MatMul(-1 / d, ones, ones.T, W_U))
    return Proof(
        lhs=MatAdd(MatMul(y, W_U_bar), b_U_bar, MatMul(-lse_centered, row)),
        rhs=rhs,
        steps=(
            Step(
                MatAdd(ell, MatMul(-m, row), MatMul(-lse_centered, row)),
                r"the logits are $\ell - \tfrac{1}{V}\ell \mathbf{1}_V \mathbf{1}_V^\top = \ell - m \mathbf{1}_V^\top$",
            ),
            Step(
                MatAdd(ell, MatMul(-m, row), MatMul(m - lse, row)),
                r"$\log \sum_j e^{\ell_j - m} = -m + \log \sum_j e^{\ell_j}$, $m$ real",
            ),
            Step(rhs, "collect: the shift cancels"),
        ),
        definitions=(
            Definition(b_U, MatAdd(ell, MatMul(-1, y, W_U)), "written through the logits: l = y W + b"),
        ),
        facts=(
            Fact(W_U_bar, MatAdd(W_U, MatMul(-1 / V, W_U, ones_V, ones_V.T)), "centered over the vocabulary"),
            Fact(b_U_bar, MatAdd(b_U, MatMul(-1 / V, b_U, ones_V, ones_V.T)), "centered over the vocabulary"),
            Fact(MatMul(ell, OneMatrix(V, V)), MatMul(V * m, row), "m is the mean of the logits: every entry of l 1 1^T is V m"),
        ),
        samplers={ell: _logits_with_mean, m: lambda rng, shape: MEAN},
        explicit_dims={d: 3, V: 4},
        assumptions=(
            "the logits are real, so m is real",
            "no softcap between the logits and the softmax: the lemma shows what still holds under one",
        ),
        twins=(
            Twin(
                "raw_logits_unchanged",
                "claim that centering leaves the raw logits unchanged: they shift by -m",
                MatAdd(MatMul(y, W_U_bar), b_U_bar),
                ell,
            ),
            Twin(
                "over_d_model",
                CENTER_UNEMBED.describe("over_d_model"),
                MatAdd(MatMul(y, W_U_over_d), b_U),
                MatAdd(ell, MatMul(-m, row)),
            ),
            Twin(
                "log_probs_shift_too",
                "claim that the log-probs shift like the raw logits: log_softmax(l - m 1^T) = log_softmax(l) - m 1^T",
                MatAdd(ell, MatMul(-m, row), MatMul(-lse_centered, row)),
                MatAdd(rhs, MatMul(-m, row)),
            ),
            logit_softcap_twin(ell, j, V, m),
        ),
        lemmas=(("fold_before_the_logit_softcap", fold_before_the_logit_softcap()),),
    )


# -- wrong rewrites: wrong transforms the numeric check must reject --------------------------


def _center_W_O_over_d_head(state_dict, cfg):
    """The source notes' ``mean(dim=1)``: for ``W_O [n_heads, d_head, d_model]`` that is ``d_head``."""
    out, new_cfg = center_writing_weights(state_dict, cfg)
    for layer in range(cfg.n_layers):
        W = state_dict[f"blocks.{layer}.attn.W_O"]
        out[f"blocks.{layer}.attn.W_O"] = W - W.mean(dim=1, keepdim=True)
    return out, new_cfg


def _center_shortformer_W_pos(state_dict, cfg):
    out, new_cfg = center_writing_weights(state_dict, cfg)
    if "pos_embed.W_pos" in state_dict:
        W = state_dict["pos_embed.W_pos"]
        out["pos_embed.W_pos"] = W - W.mean(dim=-1, keepdim=True)
    return out, new_cfg


def _center_unembed_over_d_model(state_dict, cfg):
    out, new_cfg = center_unembed(state_dict, cfg)
    W_U = state_dict["unembed.W_U"]
    out["unembed.W_U"] = W_U - W_U.mean(dim=0, keepdim=True)
    out["unembed.b_U"] = state_dict["unembed.b_U"]
    return out, new_cfg


def _center_unembed_regardless(state_dict, cfg):
    """Center W_U and b_U over the vocabulary although a logit softcap follows them."""
    out = dict(state_dict)
    for name in ("unembed.W_U", "unembed.b_U"):
        out[name] = state_dict[name] - state_dict[name].mean(dim=-1, keepdim=True)
    return out, cfg.replace(applied=cfg.applied + (center_unembed.identity,))


def _center_writers_regardless(state_dict, cfg):
    """Center every write to the residual stream over d_model whatever the norm."""
    out = dict(state_dict)
    for name in writers(cfg):
        out[name] = state_dict[name] - state_dict[name].mean(dim=-1, keepdim=True)
    return out, cfg.replace(applied=cfg.applied + (CENTER_WRITING_WEIGHTS.name,))


def _unembed_centered(state_dict, cfg):
    """``W_U`` and ``b_U`` have mean zero over the vocabulary."""
    return means_zero(state_dict, [n for n in ("unembed.W_U", "unembed.b_U") if n in state_dict], -1)


CENTER_WRITING_WEIGHTS = register(
    Identity(
        title="Centering the weights that write to the residual stream",
        summary="every reader sees the stream x through LNPre(x) = n(x C); centering every write turns x into"
        " x C, and (x C) C = x C, so LNPre is unchanged, eps included",
        preconditions=(
            PRE_NORM,
            CENTERING_NORM,
            "a shortformer W_pos is not a write to the stream and is left unchanged",
            NOT_APPLIED,
        ),
        build_proof=_writing_proof,
        transform=center_writing_weights,
        postcondition=writers_centered,
        wrong_rewrites={
            "W_O_over_d_head": WrongRewrite(
                _center_W_O_over_d_head,
                "center W_O [n_heads, d_head, d_model] over axis 1 (d_head), as `mean(dim=1)` in the "
                "source notes",
            ),
            "shortformer_W_pos": WrongRewrite(
                _center_shortformer_W_pos,
                "center a shortformer W_pos, which is added to the norm's output (the query and key "
                "input)",
            ),
            "regardless": WrongRewrite(_center_writers_regardless, REGARDLESS, regardless=True),
        },
        half_precision=COMPUTES,
    )
)

CENTER_UNEMBED = register(
    Identity(
        title="Centering the unembed",
        summary="centering W_U and b_U over the vocabulary shifts each position's logits by minus their mean;"
        " log_softmax is shift invariant, so the log-probs are unchanged",
        preconditions=(
            "the logits are read through a softmax: compare log-probs, not raw logits",
            NO_LOGIT_SOFTCAP,
            NOT_APPLIED,
        ),
        build_proof=_unembed_proof,
        transform=center_unembed,
        postcondition=_unembed_centered,
        wrong_rewrites={
            "over_d_model": WrongRewrite(
                _center_unembed_over_d_model,
                "center W_U over d_model instead of the vocabulary: the shift (1/d)(y 1)(1^T W_U) is "
                "not constant",
            ),
            "regardless": WrongRewrite(_center_unembed_regardless, REGARDLESS, regardless=True),
        },
        half_precision=COMPUTES,
    )
)
