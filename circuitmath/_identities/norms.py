"""LayerNorm as linear algebra, LayerNorm to RMSNorm, and RMSNorm folding.

Symbols (row-vector convention, one position of the residual stream at a time):

- ``x`` ``[1, d]`` the residual stream, ``C = I - 1 1^T / d`` the centering matrix;
- ``LNPre(y) = n(y C)`` and ``RMSPre(y) = n(y)`` with ``n(v) = v (|v|^2 / d + eps)^(-1/2)``;
- ``q = |x C|^2 > 0`` the squared norm of the centered stream (a scalar symbol: the proofs of
  scale invariance need only that it is positive and that ``|s x C|^2 = s^2 q``);
- ``rho`` the normaliser ``(q / d + eps)^(-1/2)`` where a proof holds for any value of it;
- ``w`` ``[d, 1]`` an RMSNorm gain, ``W`` ``[d, m]`` and ``b_W`` ``[1, m]`` a reader.
"""

from __future__ import annotations

import dataclasses
import functools

from sympy import DiagMatrix, Identity as Eye, MatAdd, MatMul, MatrixSymbol, Mul, OneMatrix, Pow, Rational, Symbol, sqrt

from .._processing import (
    center_reading_weights,
    center_writing_weights,
    fold_layer_norm,
    fold_rms_norm,
    layer_norm_to_rms_norm,
    readers,
    rescale_residual_stream,
    writers,
)
from .._processing._common import NO_POST_NORMS, NORM_READ_LINEARLY, NOT_APPLIED, PRE_NORM
from .._processing.norms import BEHIND_A_NORM, EPS_ZERO, IS_LNPRE, IS_RMS, SCALE_POSITIVE, WRITES_CENTERED
from ._postconditions import no_norm_parameters, writers_centered
from .._proof import Definition, Fact, Proof, Step, Twin
from .._registry import COMPUTES, MOVES_ENTRIES, NOTHING_SHOWN, Identity, WrongRewrite, register

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "norms"

d, m = Symbol("d", positive=True, integer=True), Symbol("m", positive=True, integer=True)
a = Symbol("a", real=True)
s, q = Symbol("s", positive=True), Symbol("q", positive=True)
eps, eps_other = Symbol(r"\varepsilon", positive=True), Symbol(r"\varepsilon'", positive=True)
rho, rho_other = Symbol(r"\rho", positive=True), Symbol(r"\rho'", positive=True)
x = MatrixSymbol("x", 1, d)
ones = OneMatrix(d, 1)
C = MatrixSymbol("C", d, d)
CENTERING = Definition(C, MatAdd(Eye(d), MatMul(-1 / d, ones, ones.T)), "the centering matrix")


# -- LayerNorm as linear algebra -------------------------------------------------------------


def _projection_proof() -> Proof:
    shifted = MatAdd(x, MatMul(a, ones.T))
    P, C_root = MatrixSymbol("P", d, d), MatrixSymbol(r"\tilde{C}", d, d)
    return Proof(
        lhs=MatMul(shifted, C.T, C),
        rhs=MatMul(x, C),
        steps=(
            Step(MatMul(shifted, C, C), r"$C^\top = C$"),
            Step(MatMul(shifted, C), r"$C C = C$, as $\mathbf{1}_d^\top \mathbf{1}_d = d$"),
            Step(MatAdd(MatMul(x, C), MatMul(a, ones.T, C)), "distribute"),
            Step(MatMul(x, C), r"$\mathbf{1}_d^\top C = 0$"),
        ),
        definitions=(
            Definition(P, MatMul(1 / d, ones, ones.T), "the projection onto the all-ones direction"),
            Definition(C_root, MatAdd(Eye(d), MatMul(-1 / sqrt(d), ones, ones.T)), "1/sqrt(d) once, not twice"),
        ),
        facts=(Fact(CENTERING.symbol, CENTERING.value, CENTERING.text),),
        explicit_dims={d: 4},
        assumptions=("for every x and every real a: equivalent to C^T = C, C C = C and C 1 = 0",),
        twins=(
            Twin(
                "notes_drop_x0",
                "the older notes' centering step without `x0 -`: (x0 . 1/sqrt(n)) 1/sqrt(n) = x P keeps only the mean",
                MatMul(shifted, P.T, P),
                MatMul(x, P),
            ),
            Twin(
                "ones_over_root_d_once",
                "subtract (x 1) 1^T / sqrt(d): divide by sqrt(d) once instead of twice",
                MatMul(shifted, C_root.T, C_root),
                MatMul(x, C_root),
            ),
        ),
    )


def _scale_invariance_proof() -> Proof:
    LNPre_x, LNPre_sx = MatrixSymbol(r"\mathrm{LNPre}(x)", 1, d), MatrixSymbol(r"\mathrm{LNPre}(s x)", 1, d)
    t = Symbol("t", real=True)
    norm = Pow(q / d, Rational(-1, 2), evaluate=False)
    scaled_norm = Pow(s**2 * q / d, Rational(-1, 2), evaluate=False)
    return Proof(
        lhs=LNPre_sx,
        rhs=LNPre_x,
        steps=(
            Step(MatMul(scaled_norm, s, x, C), r"definition: $\lVert s x C \rVert^2 = s^2 q$, $\varepsilon = 0$"),
            Step(MatMul(Pow(Mul(s, Pow(q / d, Rational(1, 2), evaluate=False), evaluate=False), -1, evaluate=False), s, x, C), r"$\sqrt{s^2} = s$ as $s > 0$"),
            Step(MatMul(norm, x, C), r"$s / s = 1$"),
            Step(LNPre_x, r"definition, $\varepsilon = 0$"),
        ),
        definitions=(CENTERING,),
        facts=(
            Fact(LNPre_x, MatMul(norm, x, C), r"eps = 0; q = |x C|^2 > 0"),
            Fact(LNPre_sx, MatMul(scaled_norm, s, x, C), "eps = 0; |s x C|^2 = s^2 q"),
        ),
        samplers={t: lambda rng, shape: -Rational(rng.randint(1, 9), rng.randint(1, 5))},
        explicit_dims={d: 4},
        assumptions=("s > 0", "eps = 0", "q = |x C|^2 > 0: x is not constant"),
        twins=(
            Twin(
                "with_eps",
                "scale invariance with eps > 0: the normaliser (s^2 q/d + eps)^(-1/2) s differs from (q/d + eps)^(-1/2)",
                MatMul(Pow(s**2 * q / d + eps, Rational(-1, 2), evaluate=False), s, x, C),
                MatMul(Pow(q / d + eps, Rational(-1, 2), evaluate=False), x, C),
            ),
            Twin(
                "negative_scale",
                SCALE_INVARIANCE.describe("negative_scale"),
                MatMul(Pow(t**2 * q / d, Rational(-1, 2), evaluate=False), t, x, C),
                LNPre_x,
            ),
        ),
    )


def with_explicit_eps(proof: Proof) -> Proof:
    """``proof`` with every ``rho`` replaced by ``(q / d + eps)^(-1/2)``, ``eps > 0`` written out.

    A proof that holds for every scalar ``rho`` (the LayerNorm fold, the RMSNorm fold) still
    holds, and is checked again, with the normaliser of ``eps > 0`` in place; the same is not
    true of scale invariance (its twin ``with_eps``).
    """
    normaliser = {rho: Pow(q / d + eps, Rational(-1, 2), evaluate=False)}

    def sub(expr):
        return expr.xreplace(normaliser)

    return dataclasses.replace(
        proof,
        lhs=sub(proof.lhs),
        rhs=sub(proof.rhs),
        steps=tuple(dataclasses.replace(step, expr=sub(step.expr)) for step in proof.steps),
        definitions=tuple(dataclasses.replace(d_, value=sub(d_.value)) for d_ in proof.definitions),
        facts=tuple(dataclasses.replace(f, product=sub(f.product), value=sub(f.value)) for f in proof.facts),
        twins=tuple(dataclasses.replace(t, lhs=sub(t.lhs), rhs=sub(t.rhs)) for t in proof.twins),
    )


def with_eps_lemma(proof: Proof) -> Proof:
    """``proof`` with the lemma ``eps_written_out``: :func:`with_explicit_eps` of itself, so that
    verifying a fold also verifies it with ``eps > 0`` written out."""
    return dataclasses.replace(proof, lemmas=(*proof.lemmas, ("eps_written_out", with_explicit_eps(proof))))


# -- LayerNorm to RMSNorm ---------------------------------------------------------------------


def _layer_norm_to_rms_proof() -> Proof:
    x_c = MatrixSymbol("x'", 1, d)
    LNPre_xc, RMSPre_xc = MatrixSymbol(r"\mathrm{LNPre}(x')", 1, d), MatrixSymbol(r"\mathrm{RMSPre}(x')", 1, d)
    return Proof(
        lhs=LNPre_xc,
        rhs=RMSPre_xc,
        steps=(
            Step(MatMul(rho, x_c, C), r"definition of $\mathrm{LNPre}$"),
            Step(MatMul(rho, x, C, C), r"definition of $x'$"),
            Step(MatMul(rho, x, C), r"$C C = C$"),
            Step(MatMul(rho, x_c), r"definition of $x'$: $x' C = x'$"),
            Step(RMSPre_xc, r"definition of $\mathrm{RMSPre}$, same $\varepsilon$"),
        ),
        definitions=(CENTERING, Definition(x_c, MatMul(x, C), "every write centered: the writes w C summed")),
        facts=(
            Fact(LNPre_xc, MatMul(rho, x_c, C), "rho from x' C"),
            Fact(RMSPre_xc, MatMul(rho, x_c), "rho from x', the same vector"),
        ),
        explicit_dims={d: 4},
        assumptions=(
            f"every write to the residual stream is centered ({center_writing_weights.identity})",
            "the same eps in both norms",
        ),
        twins=(
            Twin(
                "uncentered_stream",
                "switch to RMSNorm without centering the writes: x C != x",
                MatMul(rho, x, C),
                MatMul(rho, x),
            ),
            Twin(
                "eps_outside_root",
                "switch to an RMSNorm that adds eps to the root, x / (sqrt(q/d) + eps), as some implementations do,"
                " instead of to the mean square",
                MatMul(Pow(q / d + eps, Rational(-1, 2), evaluate=False), x_c, C),
                MatMul(Pow(sqrt(q / d) + eps, -1, evaluate=False), x_c),
            ),
        ),
    )


# -- RMSNorm folding --------------------------------------------------------------------------


def _rms_fold_proof() -> Proof:
    w = MatrixSymbol("w", d, 1)
    W, b_W, W_gate = MatrixSymbol("W", d, m), MatrixSymbol("b_W", 1, m), MatrixSymbol(r"W_{gate}", d, m)
    W_sq, W_router = MatrixSymbol("W", d, d), MatrixSymbol(r"W_{router}", d, m)
    RMSPre, RMS = MatrixSymbol(r"\mathrm{RMSPre}(x)", 1, d), MatrixSymbol(r"\mathrm{RMS}(x)", 1, d)
    folded = MatAdd(MatMul(RMSPre, MatMul(DiagMatrix(w), W)), b_W)
    lhs = MatAdd(MatMul(RMS, W), b_W)
    W_eff = MatMul(DiagMatrix(w), W)
    return Proof(
        lhs=lhs,
        rhs=folded,
        steps=(
            Step(MatAdd(MatMul(MatMul(RMSPre, DiagMatrix(w)), W), b_W), r"definition of $\mathrm{RMS}$"),
            Step(folded, r"regroup; the bias is unchanged"),
        ),
        definitions=(CENTERING,),
        facts=(
            Fact(RMSPre, MatMul(rho, x), "eps inside rho, no centering"),
            Fact(RMS, MatMul(RMSPre, DiagMatrix(w)), "RMSPre, then the gain"),
        ),
        explicit_dims={d: 4, m: 3},
        assumptions=("rho is any scalar: eps stays inside RMSPre", "W_gate, which has no bias, folds the same way",
                     "a mixture of experts' router and each expert's W_in and W_gate are readers and fold the same way",
                     "w is the gain the norm applies: for gains stored as w and applied as 1 + w (Gemma) it is 1 + w"),
        twins=(
            Twin(
                "gain_stored_as_w",
                RMS_NORM_FOLD.describe("gain_stored_as_w"),
                MatMul(RMSPre, DiagMatrix(MatAdd(ones, w)), W),
                MatMul(RMSPre, DiagMatrix(w), W),
            ),
            Twin(
                "forget_W_gate",
                RMS_NORM_FOLD.describe("forget_W_gate"),
                MatMul(RMS, W_gate),
                MatMul(RMSPre, W_gate),
            ),
            Twin(
                "forget_router",
                RMS_NORM_FOLD.describe("forget_router"),
                MatMul(RMS, W_router),
                MatMul(RMSPre, W_router),
            ),
            Twin(
                "center_after_fold",
                "center the folded reader as after a LayerNorm fold: RMSPre(x) is not orthogonal to 1",
                lhs,
                MatAdd(MatMul(RMSPre, MatMul(C, W_eff)), b_W),
            ),
            Twin(
                "scale_columns",
                "scale the reader's columns, not its rows (W * w[None, :], square W)",
                MatMul(RMS, W_sq),
                MatMul(RMSPre, W_sq, DiagMatrix(w)),
            ),
        ),
    )


# -- wrong rewrites: wrong transforms the numeric check must reject --------------------------


def _keep_only_the_mean(state_dict, cfg):
    """The older notes' slip applied to the writes: keep ``(w . 1/sqrt(d)) 1/sqrt(d)``, drop the rest."""
    out, new_cfg = center_writing_weights(state_dict, cfg)
    for name in writers(cfg):
        out[name] = state_dict[name].mean(dim=-1, keepdim=True).expand_as(state_dict[name]).clone()
    return out, new_cfg


def _switch_with_other_eps(state_dict, cfg):
    out, new_cfg = layer_norm_to_rms_norm(state_dict, cfg)
    return out, new_cfg.replace(eps=cfg.eps * 10 + 1e-3)


def _fold_forgetting(leaf):
    """Fold the gains, then put back every reader whose name ends in ``leaf`` (W_gate, W_router)."""
    def wrong(state_dict, cfg):
        out, new_cfg = fold_rms_norm(state_dict, cfg)
        for _norm, pairs in readers(cfg):
            for weight in [weight for weight, _bias in pairs if weight.endswith(f".{leaf}")]:
                out[weight] = state_dict[weight]
        return out, new_cfg
    return wrong


def _fold_stored_gain(state_dict, cfg):
    """Fold the stored ``w`` of gains applied as ``1 + w`` (Gemma), not ``1 + w``."""
    out, new_cfg = fold_rms_norm(state_dict, cfg)
    for norm, pairs in readers(cfg):
        for weight, _bias in pairs:
            out[weight] = state_dict[weight] * state_dict[f"{norm}.w"][:, None]
    return out, new_cfg


def _fold_and_center_readers(state_dict, cfg):
    out, new_cfg = fold_rms_norm(state_dict, cfg)
    for _norm, pairs in readers(cfg):
        for weight, _bias in pairs:
            out[weight] = out[weight] - out[weight].mean(dim=-2, keepdim=True)
    return out, new_cfg


def centered_layer_norm_model(state_dict, cfg):
    """Fold an ``LN`` model's gain and bias, then center every write: what the LN to RMS switch needs."""
    if cfg.normalization_type == "LN":
        state_dict, cfg = fold_layer_norm(state_dict, cfg)
    return center_writing_weights(state_dict, cfg)


def _rescale_by_negative_scale(state_dict, cfg):
    """Rescale by ``-CHECK_SCALE``, which the transform refuses: the norms are odd, not even."""
    out, new_cfg = rescale_residual_stream(state_dict, cfg, scale=CHECK_SCALE)
    for name in writers(cfg):
        out[name] = -out[name]
    return out, new_cfg


#: The scale the numeric check of scale invariance rescales the residual stream by.
CHECK_SCALE = 3.7

def _normalised_by_rms(state_dict, cfg):
    """Every norm is an RMSNorm."""
    rms = cfg.normalization_type in ("RMSPre", "RMS")
    return None if rms else f"normalization_type is {cfg.normalization_type!r}, not RMSPre or RMS"


CENTERING_PROJECTION = register(
    Identity(
        name="centering_projection",
        title="Centering is the orthogonal projection C = I - 1 1^T / d",
        summary="(x + a 1^T) C^T C = x C for all x and a: C is symmetric, idempotent and kills 1,"
        " so the 1 direction of the residual stream is invisible to LayerNorm",
        preconditions=(
            f"the transform it licenses is {center_writing_weights.identity}: pre-norm, normalization_type LN or LNPre",
            NOT_APPLIED,
        ),
        build_proof=_projection_proof,
        transform=center_writing_weights,
        postcondition=writers_centered,
        wrong_rewrites={"keep_only_the_mean": _keep_only_the_mean},
        half_precision=COMPUTES,
    )
)

SCALE_INVARIANCE = register(
    Identity(
        title="LayerNorm is invariant to positive scaling exactly when eps = 0",
        summary="LNPre(s x) = LNPre(x) for s > 0 when eps = 0; with eps > 0 it is not, while the"
        " LayerNorm fold, which holds for any normaliser, stays exact",
        preconditions=(EPS_ZERO, PRE_NORM, BEHIND_A_NORM, NO_POST_NORMS, SCALE_POSITIVE, NOT_APPLIED),
        build_proof=_scale_invariance_proof,
        transform=functools.partial(rescale_residual_stream, scale=CHECK_SCALE),
        postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "negative_scale": WrongRewrite(
                _rescale_by_negative_scale, "scale by t < 0: sqrt(t^2) = |t|, so LNPre(t x) = -LNPre(x)"),
        },
        half_precision=COMPUTES,
    )
)

LAYER_NORM_TO_RMS_NORM = register(
    Identity(
        title="LayerNorm becomes RMSNorm once every write is centered",
        summary="if every write to the residual stream is centered then x C = x, so LNPre(x) = RMSPre(x) with the same eps",
        preconditions=(WRITES_CENTERED, PRE_NORM, IS_LNPRE, NOT_APPLIED),
        build_proof=_layer_norm_to_rms_proof,
        transform=layer_norm_to_rms_norm,
        postcondition=_normalised_by_rms,
        wrong_rewrites={"other_eps": _switch_with_other_eps},
        prepare=centered_layer_norm_model,
        check_note="folded and with its writing weights centered first, as the identity needs",
        half_precision=MOVES_ENTRIES,
    )
)

RMS_NORM_FOLD = register(
    Identity(
        title="Folding RMSNorm into its readers, W_gate included",
        summary="RMS(x) W + b_W = RMSPre(x) (diag(w) W) + b_W for every reader, W_gate of a gated MLP"
        " included; nothing is centered",
        preconditions=(PRE_NORM, IS_RMS, NORM_READ_LINEARLY, NOT_APPLIED),
        build_proof=lambda: with_eps_lemma(_rms_fold_proof()),
        transform=fold_rms_norm,
        postcondition=no_norm_parameters,
        wrong_rewrites={
            "forget_W_gate": WrongRewrite(
                _fold_forgetting("W_gate"), "fold the gain into W_in but not into W_gate of a gated MLP"),
            "forget_router": WrongRewrite(
                _fold_forgetting("W_router"),
                "fold the gain into the experts but not into the router that chooses them (a mixture of "
                "experts)",
                differs_on=lambda cfg: cfg.n_experts is not None,
            ),
            center_reading_weights.identity: _fold_and_center_readers,  # centering as behind a LayerNorm
            "gain_stored_as_w": WrongRewrite(
                _fold_stored_gain,
                "fold the stored w of a norm that applies 1 + w (Gemma): the identity's gain is 1 + w",
                differs_on=lambda cfg: cfg.norm_gain_offset != 0,
            ),
        },
        half_precision=COMPUTES,
    )
)
