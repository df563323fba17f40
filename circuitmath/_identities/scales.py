"""Folding the embedding scale into the embedding and the logit scale into the unembedding.

Symbols (row-vector convention, one position at a time; ``d`` = d_model, ``V`` the vocabulary):

- ``t`` ``[1, V]`` a one-hot token, ``W_E`` ``[V, d]``, ``p`` ``[1, d]`` what is added to the
  embedded token before the first block (its row of ``W_pos``; zero for a rotary model);
- ``y`` ``[1, d]`` the final norm's output, ``W_U`` ``[d, V]``, ``b_U`` ``[1, V]``;
- ``s`` the scale, a real number: Gemma's ``sqrt(d_model)`` on the embeddings, Cohere's
  ``logit_scale`` on the logits. In a half-precision model ``s`` is the multiplier the forward
  pass uses, already rounded to the model's dtype (see :func:`~circuitmath.fold_embedding_scale`).
"""

from __future__ import annotations

from sympy import MatAdd, MatMul, MatrixSymbol, Symbol, Transpose

from .._errors import NOT_APPLIED
from .._processing.scales import (
    EMBEDDING_SCALED, LOGIT_SCALED, embedding_multiplier, fold_embedding_scale, fold_logit_scale, scaled,
)
from .._proof import Fact, Proof, Step, Twin
from .._registry import AS_THE_FORWARD_PASS, COMPUTES, NOTHING_SHOWN, Identity, WrongRewrite, register

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "norms"

d, V = Symbol("d", positive=True, integer=True), Symbol("V", positive=True, integer=True)
s = Symbol("s", real=True)
EXPLICIT_DIMS = {d: 3, V: 4}

# -- the embedding scale ---------------------------------------------------------------------

t, p, y = MatrixSymbol("t", 1, V), MatrixSymbol("p", 1, d), MatrixSymbol("y", 1, d)
W_E, W_E_s = MatrixSymbol("W_E", V, d), MatrixSymbol(r"{W_E^{s}}", V, d)


def _embedding_proof() -> Proof:
    lhs = MatAdd(MatMul(t, W_E_s), p)
    rhs = MatAdd(MatMul(s, t, W_E), p)
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(t, MatMul(s, W_E)), p), r"the fold: $W_E^{s} = s W_E$"),
            Step(rhs, r"a number commutes with the product"),
        ),
        facts=(Fact(W_E_s, MatMul(s, W_E), "the folded embedding: W_E times the scale"),),
        explicit_dims=EXPLICIT_DIMS,
        assumptions=(
            "s is the multiplier the forward pass uses: in half precision the scale rounded to the model's dtype,"
            " so each folded entry is the product the forward pass rounds, and the fold is exact bit for bit",
            "the folded model has no multiplier (embedding_scale None)",
        ),
        twins=(
            Twin("applied_twice", FOLD_EMBEDDING_SCALE.describe("applied_twice"),
                 MatAdd(MatMul(s, t, W_E_s), p), rhs),
            Twin("position_scaled_too", FOLD_EMBEDDING_SCALE.describe("position_scaled_too"),
                 MatAdd(MatMul(t, W_E_s), MatMul(s, p)), rhs),
            Twin("unembedding_scaled_too",
                 FOLD_EMBEDDING_SCALE.describe("unembedding_scaled_too"),
                 MatMul(y, Transpose(W_E_s)), MatMul(y, Transpose(W_E))),
        ),
    )


def _embedding_applied_twice(state_dict, cfg):
    """Multiply ``W_E`` by the scale twice (fold it, and keep it in the forward pass)."""
    out, new_cfg = fold_embedding_scale(state_dict, cfg)
    out["embed.W_E"] = out["embed.W_E"] * embedding_multiplier(cfg, out["embed.W_E"].dtype, out["embed.W_E"].device)
    return out, new_cfg


def _position_scaled_too(state_dict, cfg):
    """Scale ``W_pos`` with ``W_E``, as if the multiplier applied to the sum of both."""
    out, new_cfg = fold_embedding_scale(state_dict, cfg)
    if "pos_embed.W_pos" in state_dict and cfg.positional_embedding_type == "standard":
        W_pos = state_dict["pos_embed.W_pos"]
        out["pos_embed.W_pos"] = W_pos * embedding_multiplier(cfg, W_pos.dtype, W_pos.device)
    return out, new_cfg


def _unembedding_scaled_too(state_dict, cfg):
    """Scale ``W_U`` with ``W_E``, keeping tied matrices tied."""
    out, new_cfg = fold_embedding_scale(state_dict, cfg)
    W_U = state_dict["unembed.W_U"]
    out["unembed.W_U"] = W_U * embedding_multiplier(cfg, W_U.dtype, W_U.device)
    return out, new_cfg


def _embedding_unrounded(state_dict, cfg):
    """Fold the scale as a float64 number, not rounded to the model's dtype as the forward pass rounds it."""
    out, new_cfg = fold_embedding_scale(state_dict, cfg)
    W_E = state_dict["embed.W_E"]
    out["embed.W_E"] = (W_E.double() * cfg.embedding_scale).to(W_E.dtype)
    return out, new_cfg


FOLD_EMBEDDING_SCALE = register(
    Identity(
        title="Folding the embedding scale into W_E",
        summary="t (s W_E) + p = s (t W_E) + p: W_E becomes s W_E and the multiplier is dropped; a tied"
        " unembedding is untied (W_U keeps the unscaled matrix); s is the multiplier rounded to the model's dtype",
        preconditions=(EMBEDDING_SCALED, NOT_APPLIED),
        build_proof=_embedding_proof,
        transform=fold_embedding_scale,
        postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "applied_twice": WrongRewrite(
                _embedding_applied_twice,
                "keep the multiplier after folding it (or fold it twice): the embeddings scale by s^2",
            ),
            "position_scaled_too": WrongRewrite(
                _position_scaled_too,
                "scale what is added to the embedded token (W_pos) as well",
                differs_on=lambda cfg: cfg.positional_embedding_type == "standard",
            ),
            "unembedding_scaled_too": WrongRewrite(
                _unembedding_scaled_too,
                "keep a tied unembedding tied, W_U = (W_E^s)^T: the logits y W_E^T are scaled by s",
            ),
        },
        half_precision=AS_THE_FORWARD_PASS,
    )
)

#: A wrong fold only a half-precision model shows (the float64 product rounds differently from
#: the forward pass's): not in the registry's catalogue, whose checks run in float64.
EMBEDDING_UNROUNDED = _embedding_unrounded

# -- the logit scale -------------------------------------------------------------------------

W_U, b_U = MatrixSymbol("W_U", d, V), MatrixSymbol("b_U", 1, V)
W_U_s, b_U_s = MatrixSymbol(r"{W_U^{s}}", d, V), MatrixSymbol(r"{b_U^{s}}", 1, V)


def _logit_proof() -> Proof:
    lhs = MatAdd(MatMul(y, W_U_s), b_U_s)
    rhs = MatMul(s, MatAdd(MatMul(y, W_U), b_U))
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(y, MatMul(s, W_U)), MatMul(s, b_U)), r"the fold: $W_U^{s} = s W_U$, $b_U^{s} = s b_U$"),
            Step(rhs, r"factor out $s$"),
        ),
        facts=(
            Fact(W_U_s, MatMul(s, W_U), "the folded unembedding: W_U times the scale"),
            Fact(b_U_s, MatMul(s, b_U), "the folded unembedding bias: b_U times the scale"),
        ),
        explicit_dims=EXPLICIT_DIMS,
        assumptions=(
            "a logit softcap acts entrywise on the scaled logits s (y W_U + b_U), which the fold leaves unchanged",
            "the folded model has no multiplier (logit_scale None)",
        ),
        twins=(
            Twin("applied_twice", FOLD_LOGIT_SCALE.describe("applied_twice"),
                 MatMul(s, lhs), rhs),
            Twin("bias_unscaled", FOLD_LOGIT_SCALE.describe("bias_unscaled"),
                 MatAdd(MatMul(y, W_U_s), b_U), rhs),
            Twin("divided", FOLD_LOGIT_SCALE.describe("divided"),
                 MatAdd(MatMul(1 / s, y, W_U), MatMul(1 / s, b_U)), rhs),
        ),
    )


def _logit_applied_twice(state_dict, cfg):
    """Multiply ``W_U`` and ``b_U`` by the scale twice."""
    out, new_cfg = fold_logit_scale(state_dict, cfg)
    for name in ("unembed.W_U", "unembed.b_U"):
        out[name] = scaled(out[name], cfg.logit_scale)
    return out, new_cfg


def _logit_bias_unscaled(state_dict, cfg):
    """Scale ``W_U`` but leave ``b_U`` as it was."""
    out, new_cfg = fold_logit_scale(state_dict, cfg)
    out["unembed.b_U"] = state_dict["unembed.b_U"]
    return out, new_cfg


def _logit_divided(state_dict, cfg):
    """Divide ``W_U`` and ``b_U`` by the scale."""
    out, new_cfg = fold_logit_scale(state_dict, cfg)
    for name in ("unembed.W_U", "unembed.b_U"):
        out[name] = scaled(state_dict[name], 1 / cfg.logit_scale)
    return out, new_cfg


FOLD_LOGIT_SCALE = register(
    Identity(
        title="Folding the logit scale into the unembedding",
        summary="y (s W_U) + s b_U = s (y W_U + b_U): W_U and b_U become s W_U and s b_U and the multiplier is"
        " dropped; a softcap after it sees the same logits",
        preconditions=(LOGIT_SCALED, NOT_APPLIED),
        build_proof=_logit_proof,
        transform=fold_logit_scale,
        postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "applied_twice": WrongRewrite(
                _logit_applied_twice,
                "keep the multiplier after folding it (or fold it twice): the logits scale by s^2",
            ),
            "bias_unscaled": WrongRewrite(_logit_bias_unscaled, "scale W_U but not b_U"),
            "divided": WrongRewrite(_logit_divided, "divide by the scale instead of multiplying"),
        },
        half_precision=COMPUTES,
    )
)
