"""The rewrites of quantisation pipelines, made before anything is quantised: scale migration across
a norm (SmoothQuant).

Symbols (row-vector convention, one position of the stream; ``d`` = d_model, ``e`` = d_head,
``m`` = d_mlp, ``k`` the columns of the free test matrices ``T``):

- ``\\hat{x}`` ``[1, d]`` the normalised stream with no gain, ``LNPre(x)`` or ``RMSPre(x)``: the
  normaliser sees the stream, which a migration leaves alone, so it is one opaque vector;
- ``w`` ``[d, 1]`` the gain (1 for ``LNPre``, ``RMSPre``), ``b`` ``[1, d]`` a LayerNorm's bias
  (0 for RMSNorm), ``s`` ``[d, 1]`` the scales, nonzero: ``diag(s)`` is invertible;
- the migrated gain ``G = diag(w) diag(s)^{-1}`` (the diagonal of ``w / s``), bias ``b diag(s)^{-1}``;
- one reader per kind, each times its own test matrix (several conclusions as one sum, see
  :mod:`.rotation`): ``W_Q``, ``W_K``, ``W_V`` ``[d, e]`` (one head; every head alike) and
  ``W_in``, ``W_gate`` ``[d, m]`` (``W_U`` behind ``ln_final`` is a reader like these).
"""

from __future__ import annotations

import sympy
import torch
from sympy import DiagMatrix, Inverse, MatAdd, MatMul, MatrixSymbol

from .._errors import NOT_APPLIED
from .._processing._common import NORM_READ_LINEARLY, PRE_NORM, readers
from .._processing.quantisation import GAINS_AS_STORED, HAS_A_NORM, SCALES_PER_CHANNEL, migrate_norm_scales, recover_norm_scales
from .._proof import Fact, Proof, Step, Twin
from .._registry import Identity, WrongRewrite, register
from ._circuit_checks import dim
from .rotation import free_matrix

d, e, m, k = (dim(s) for s in ("d", "e", "m", "k"))

# -- scale migration across a norm ------------------------------------------------------------

x_hat = MatrixSymbol(r"\hat{x}", 1, d)
w, s = MatrixSymbol("w", d, 1), MatrixSymbol("s", d, 1)
b = MatrixSymbol("b", 1, d)
S = DiagMatrix(s)
G = MatrixSymbol("G", d, d)
b_s = MatrixSymbol("b_s", 1, d)
NORM_READERS = {name: MatrixSymbol(f"W_{{{name}}}", d, rows) for name, rows in
                (("Q", e), ("K", e), ("V", e), ("in", m), ("gate", m))}
NORM_TESTS = {name: free_matrix(f"T_{{{name}}}", W.shape[1]) for name, W in NORM_READERS.items()}


def _migrated(gain, bias, reader_of):
    """``sum_r (x_hat gain + bias) reader_of(r) T_r`` over the readers ``r``."""
    normed = MatAdd(MatMul(x_hat, gain), bias)
    return MatAdd(*(MatMul(normed, *reader_of(name, W), NORM_TESTS[name]) for name, W in NORM_READERS.items()))


def _norm_scales_proof() -> Proof:
    rhs = _migrated(DiagMatrix(w), b, lambda _name, W: (W,))
    return Proof(
        lhs=_migrated(G, b_s, lambda _name, W: (S, W)),
        rhs=rhs,
        steps=(
            Step(_migrated(MatMul(DiagMatrix(w), Inverse(S)), MatMul(b, Inverse(S)), lambda _name, W: (S, W)),
                 r"definitions of the migrated gain and bias: $w / s$ and $b / s$"),
            Step(rhs, r"$\operatorname{diag}(s)^{-1} \operatorname{diag}(s) = I$ in every reader"),
        ),
        facts=(
            Fact(G, MatMul(DiagMatrix(w), Inverse(S)), "the migrated gain diag(w / s): diagonal matrices commute"),
            Fact(b_s, MatMul(b, Inverse(S)), "the migrated bias b / s (LayerNorm; 0 for RMSNorm)"),
            Fact.invertible(S, "every scale is nonzero: diag(s) is invertible"),
        ),
        samplers={s: _nonzero_vector},
        explicit_dims={d: 3, e: 2, m: 2, k: 1},
        assumptions=(
            "pre-norm; x_hat = LNPre(x) or RMSPre(x) is computed from the stream, which the migration leaves alone",
            "every reader of the norm is a linear map of its output (no shortformer W_pos added to it)",
            "LNPre and RMSPre have the gain w = 1 and no bias: the migration gives them the gain 1 / s",
        ),
        twins=(
            Twin("readers_unscaled", "divide the gain by s but leave the readers as they are",
                 _migrated(G, b_s, lambda _name, W: (W,)), rhs),
            Twin("wrong_way", "divide the readers' rows by s as well: diag(s)^-1 W instead of diag(s) W",
                 _migrated(G, b_s, lambda _name, W: (Inverse(S), W)), rhs),
            Twin("gate_unscaled", "scale every reader but the gate of a gated MLP",
                 _migrated(G, b_s, lambda name, W: (W,) if name == "gate" else (S, W)), rhs),
            Twin("bias_unscaled", "LayerNorm: divide the gain by s but not the bias",
                 _migrated(G, b, lambda _name, W: (S, W)), rhs),
        ),
    )


def _nonzero_vector(rng, shape):
    return sympy.Matrix(*shape, lambda i, j: rng.choice([-3, -2, -1, 1, 2, 3]))


# -- numeric checks ---------------------------------------------------------------------------

#: The seed of the scales the numeric checks migrate.
CHECK_SEED = 0


def check_scales(cfg) -> dict[str, torch.Tensor]:
    """The scales the numeric checks migrate: ``s = exp(N(0, 1))`` per channel (float64), one
    draw per norm, of the spread SmoothQuant's ``max|X|^a / max|W|^(1-a)`` takes on outliers."""
    generator = torch.Generator(device="cpu").manual_seed(CHECK_SEED)
    return {norm: torch.exp(torch.randn(cfg.d_model, generator=generator, dtype=torch.float64))
            for norm, _pairs in readers(cfg)}


def _migrate(state_dict, cfg, scales=None):
    return migrate_norm_scales(state_dict, cfg, check_scales(cfg) if scales is None else scales)


def _migrate_but(change):
    """A wrong migration: the exact one, then ``change(out, before, cfg, norm, s)`` per norm."""
    def wrong(state_dict, cfg, scales=None):
        scales = check_scales(cfg) if scales is None else scales
        out, out_cfg = migrate_norm_scales(state_dict, cfg, scales)
        for norm, pairs in readers(cfg):
            if norm in scales:
                change(out, state_dict, pairs, norm, scales[norm].double())
        return out, out_cfg
    return wrong


def _unscale(names):
    """Put back the readers ``names(pairs)`` as they were."""
    def change(out, before, pairs, _norm, _s):
        for weight in names(pairs):
            out[weight] = before[weight]
    return change


def _divide_readers(out, before, pairs, _norm, s):
    for weight, _bias in pairs:
        W = before[weight]
        out[weight] = (W.double() / s.to(W.device)[:, None]).to(W.dtype)


def _bias_unscaled(out, before, _pairs, norm, _s):
    if f"{norm}.b" in before:  # LNPre's bias is 0, and 0 / s is 0
        out[f"{norm}.b"] = before[f"{norm}.b"]


MIGRATE_NORM_SCALES = register(
    Identity(
        name="migrate_norm_scales",
        title="Migrating per-channel scales across a norm (SmoothQuant)",
        summary="gain w / s (and bias b / s), every reader of the norm diag(s) W: the readers compute what"
        " they did for any nonzero s; readers left unscaled, or divided by s too, change the model",
        preconditions=(NOT_APPLIED, PRE_NORM, NORM_READ_LINEARLY, HAS_A_NORM, GAINS_AS_STORED, SCALES_PER_CHANNEL),
        function="migrate_norm_scales",
        check_note="the scales are recovered from the tensors (each reader's input rows and the gain, by norm)"
        " and every tensor is certified against the migration by them",
        build_proof=_norm_scales_proof,
        transform=_migrate,
        wrong_rewrites={  # the narrowest first: where several explain a tensor, the diagnosis names the first
            "gate_unscaled": WrongRewrite(_migrate_but(_unscale(lambda pairs: [w_ for w_, _b in pairs if w_.endswith("W_gate")])),
                                          differs_on=lambda cfg: cfg.gated_mlp and not cfg.attn_only),
            "value_unscaled": WrongRewrite(_migrate_but(_unscale(lambda pairs: [w_ for w_, _b in pairs if w_.endswith("W_V")])),
                                           "scale every reader but W_V"),
            "bias_unscaled": WrongRewrite(_migrate_but(_bias_unscaled), differs_on=lambda cfg: cfg.normalization_type == "LN"),
            "readers_unscaled": _migrate_but(_unscale(lambda pairs: [w_ for w_, _b in pairs])),
            "wrong_way": _migrate_but(_divide_readers),
        },
        recover=recover_norm_scales,
        with_parameters=migrate_norm_scales,
    )
)
