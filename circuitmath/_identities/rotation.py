"""Symmetries of the residual stream: rotating it, through the norms and the whole model (permuting
heads and neurons: :mod:`.permutations`).

Symbols (row-vector convention; ``n`` positions, ``d`` = d_model, ``e`` = d_head, ``m`` =
d_mlp, ``v`` = d_vocab, ``c`` = n_ctx; ``k`` the columns of the free test matrices ``T``):

- ``Q`` ``[d, d]`` orthogonal: the facts ``Q Q^T = Q^T Q = I`` (sympy's ``Q.orthogonal``),
  checked exactly on every sampled instance (rational orthogonal matrices, Cayley transforms);
- ``x`` ``[1, d]`` one position of the stream, ``X`` ``[n, d]`` all of them;
  ``RMSPre(X) = D X`` with ``D`` ``[n, n]`` the per-position normalisers
  ``(|x_i|^2 / d + eps)^(-1/2)``, a function of the squared norms only;
- several conclusions at once: a claim ``a_1 T_1 + a_2 T_2 + ... = b_1 T_1 + b_2 T_2 + ...`` with
  free test matrices ``T_i`` is one equality in the normal form, where every term ends in one
  ``T_i`` and nothing cancels a term ending in ``T_i`` against one ending in ``T_j``; it proves
  ``a_i = b_i`` for every ``i``. A Gram term ``(X Q)(X Q)^T T = X X^T T`` proves that the
  rotated stream has the squared norms of the original, so the normaliser ``D`` is the same:
  the step a square root would otherwise need.
"""

from __future__ import annotations

import sympy
import torch
from sympy import DiagMatrix, Identity as Eye, Inverse, MatAdd, MatMul, MatrixSymbol, OneMatrix, Transpose

from .._processing import center_reading_weights, center_writing_weights, fold_layer_norm, fold_rms_norm
from .._processing import layer_norm_to_rms_norm
from .._errors import Precondition
from .._processing._common import POST_NORM_GAINS_EQUAL, PRE_NORM, require
from .._processing.layer_norm import IS_LN
from .._processing.norms import IS_LNPRE
from .._processing._orthogonal import as_dense, block_orthogonal
from .._processing.rotation import (NO_NORM_GAIN, Q_FIXES_ONES, Q_ORTHOGONAL, Q_SQUARE, residual_readers, residual_writers,
                                    rotate_residual_stream, rotated_tensors)
from .._proof import Definition, Fact, Proof, Step, Twin
from .._moe import routers
from .._reference import forward, normalize
from .._registry import COMPOSES, COMPUTES, NOTHING_SHOWN, FirstRecovery, Identity, SharedRotation, WrongRewrite, register
from .._state import marked_as, validate_state_dict
from .._compare import compute_dtype, default_tokens
from ._circuit_checks import compare_values, dim, rational_orthogonal
from ._residual_fit import recover_residual_rotation, rotate_by_fit, switch_first, undone
from .norms import centered_layer_norm_model
from .reparametrise import invertible

n, d, e, m, v, c, k = (dim(s) for s in ("n", "d", "e", "m", "v", "c", "k"))
ones_n, ones_d, ones_dd = OneMatrix(n, 1), OneMatrix(d, 1), OneMatrix(d, d)
Q = MatrixSymbol("Q", d, d)
G = MatrixSymbol("G", d, d)  # invertible, not orthogonal: the twins' "rotation"
R = MatrixSymbol("R", d, d)  # orthogonal, but moving the all-ones direction (R 1 != ±1)
rho = sympy.Symbol(r"\rho", positive=True)
C = MatrixSymbol("C", d, d)
CENTERING = Definition(C, MatAdd(Eye(d), MatMul(-1 / d, ones_d, ones_d.T)), "the centering matrix")
#: The same, where the claim is about ``C`` itself.
CENTERING_FACT = Fact(C, CENTERING.value, CENTERING.text)
ORTHOGONAL = (
    Fact(MatMul(Q, Q.T), Eye(d), "Q is orthogonal: Q Q^T = I"),
    Fact(MatMul(Q.T, Q), Eye(d), "Q is orthogonal: Q^T Q = I"),
)

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "rotation"


def _orthogonal(rng, shape):
    return rational_orthogonal(rng, shape[0])


def free_matrix(name, rows):
    """A free test matrix ``[rows, k]``: several conclusions proved as one sum, each term ending in its own."""
    return MatrixSymbol(name, rows, k)


def _gram(Y):
    return MatMul(Y, Transpose(Y))


# -- RMSPre commutes with rotations -----------------------------------------------------------

x = MatrixSymbol("x", 1, d)
w = MatrixSymbol("w", d, 1)
T_1, T_2 = free_matrix("T_1", 1), free_matrix("T_2", d)


def _norm_claim(rotation, *, center=False, gain=False, back=None):
    """``|norm(x U)|^2 T_1 + norm(x U) back T_2`` for the rotation ``U``: ``norm`` is ``RMSPre``
    (``LNPre`` when ``center``; with a gain ``diag(w)`` when ``gain``), ``rho`` its normaliser."""
    inner = MatMul(x, rotation, C) if center else MatMul(x, rotation)
    out = MatMul(rho, inner, DiagMatrix(w)) if gain else MatMul(rho, inner)
    return MatAdd(MatMul(_gram(inner), T_1), MatMul(out, *([back] if back is not None else []), T_2))


def _norm_rotation_proof() -> Proof:
    RMSPre_x, RMSPre_xQ = MatrixSymbol(r"\mathrm{RMSPre}(x)", 1, d), MatrixSymbol(r"\mathrm{RMSPre}(x Q)", 1, d)
    lhs = MatAdd(MatMul(_gram(MatMul(x, Q)), T_1), MatMul(RMSPre_xQ, T_2))
    rhs = MatAdd(MatMul(_gram(x), T_1), MatMul(RMSPre_x, Q, T_2))
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(x, Q, Q.T, x.T, T_1), MatMul(rho, x, Q, T_2)),
                 r"$(xQ)^\top = Q^\top x^\top$; definition of $\mathrm{RMSPre}(xQ)$"),
            Step(MatAdd(MatMul(x, x.T, T_1), MatMul(rho, x, Q, T_2)),
                 r"$Q Q^\top = I$: $|xQ|^2 = |x|^2$, the normaliser $\rho$ is the same"),
            Step(rhs, r"definition of $\mathrm{RMSPre}(x)$"),
        ),
        definitions=(CENTERING,),
        facts=ORTHOGONAL + (
            Fact(RMSPre_x, MatMul(rho, x), "rho, the normaliser: one over the root of the mean square of x plus eps"),
            Fact(RMSPre_xQ, MatMul(rho, x, Q),
                 "the same rho: it reads x Q only through its squared norm, by the first conclusion that of x"),
        ),
        samplers={Q: _orthogonal, R: _orthogonal, G: invertible},
        explicit_dims={d: 4, k: 2},
        assumptions=("Q orthogonal (sympy's Q.orthogonal): the facts Q Q^T = Q^T Q = I",
                     "the normaliser depends on its input only through the squared norm; eps > 0 allowed"),
        twins=(
            Twin("non_orthogonal", RMS_NORM_ROTATION.describe("non_orthogonal"),
                 _norm_claim(G), MatAdd(MatMul(_gram(x), T_1), MatMul(rho, x, G, T_2))),
            Twin("layer_norm", "rotate the input of LNPre instead: LNPre(x Q) != LNPre(x) Q unless Q 1 = 1",
                 _norm_claim(Q, center=True), MatAdd(MatMul(_gram(MatMul(x, C)), T_1), MatMul(rho, x, C, Q, T_2))),
            Twin("unfolded_gain", "rotate through an RMSNorm whose gain is not folded: diag(w) Q != Q diag(w)",
                 _norm_claim(Q, gain=True), MatAdd(MatMul(_gram(x), T_1), MatMul(rho, x, DiagMatrix(w), Q, T_2))),
            Twin("not_transposed", RMS_NORM_ROTATION.describe("not_transposed"),
                 _norm_claim(Q, back=Q), MatAdd(MatMul(_gram(x), T_1), MatMul(rho, x, T_2))),
        ),
    )


# -- LayerNorm: only rotations that map the all-ones direction to itself (Q 1 = ±1) -------------


def _fixing_ones(rng, shape):
    """An exactly orthogonal rational ``Q`` with ``Q 1 = 1`` or ``Q 1 = -1`` (a random sign),
    for any size: a product of Householder reflections ``I - 2 v v^T / (v^T v)`` by integer
    vectors ``v`` orthogonal to ``1`` (each reflection is rational, orthogonal and fixes ``1``),
    times ``±1``."""
    size = shape[0]
    Q_ = sympy.eye(size)
    for _ in range(size):
        while True:
            r = [rng.randint(-3, 3) for _ in range(size)]
            v = sympy.Matrix([size * a - sum(r) for a in r])
            if any(v):
                break
        Q_ = Q_ * (sympy.eye(size) - 2 * v * v.T / (v.T * v)[0])
    return Q_ * rng.choice((1, -1))


def _layer_norm_rotation_proof() -> Proof:
    LNPre_x, LNPre_xQ = MatrixSymbol(r"\mathrm{LNPre}(x)", 1, d), MatrixSymbol(r"\mathrm{LNPre}(x Q)", 1, d)
    lhs = MatAdd(MatMul(_gram(MatMul(x, Q, C)), T_1), MatMul(LNPre_xQ, T_2))
    rhs = MatAdd(MatMul(_gram(MatMul(x, C)), T_1), MatMul(LNPre_x, Q, T_2))
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(_gram(MatMul(x, C, Q)), T_1), MatMul(rho, x, C, Q, T_2)),
                 r"$Q C = C Q$: $Q \mathbf{1}\mathbf{1}^\top = \mathbf{1}\mathbf{1}^\top Q$ (as $Q \mathbf{1} = \pm\mathbf{1}$);"
                 r" definition of $\mathrm{LNPre}(xQ)$"),
            Step(MatAdd(MatMul(_gram(MatMul(x, C)), T_1), MatMul(rho, x, C, Q, T_2)),
                 r"$Q Q^\top = I$: $|xQC|^2 = |xC|^2$, the normaliser $\rho$ is the same"),
            Step(rhs, r"definition of $\mathrm{LNPre}(x)$"),
        ),
        facts=ORTHOGONAL + (
            CENTERING_FACT,
            Fact(LNPre_x, MatMul(rho, x, C), "rho, one over the root of the mean square of x C plus eps"),
            Fact(LNPre_xQ, MatMul(rho, x, Q, C),
                 "the same rho: it reads x Q C only through its squared norm, by the first conclusion that of x C"),
            Fact(MatMul(Q, ones_dd), MatMul(ones_dd, Q),
                 "Q 1 = s 1 with s = ±1, so Q^T 1 = s 1 and Q 1 1^T = s 1 1^T = 1 1^T Q (for an orthogonal Q,"
                 " equivalent to Q 1 = ±1: times 1 it gives Q 1 = c 1, and |Q 1| = |1| gives c = ±1)"),
        ),
        samplers={Q: _fixing_ones, R: _orthogonal},
        explicit_dims={d: 4, k: 2},
        assumptions=("Q orthogonal with Q 1 = 1 or Q 1 = -1 (it maps the all-ones direction to itself)",),
        twins=(
            Twin("generic_rotation", LAYER_NORM_ROTATION.describe("generic_rotation"),
                 MatAdd(MatMul(_gram(MatMul(x, R, C)), T_1), MatMul(rho, x, R, C, T_2)),
                 MatAdd(MatMul(_gram(MatMul(x, C)), T_1), MatMul(rho, x, C, R, T_2))),
            Twin("unfolded_gain", "rotate an LN model whose gain is not folded, even with Q 1 = ±1: diag(w) Q != Q diag(w)",
                 MatMul(rho, x, Q, C, DiagMatrix(w), T_2), MatMul(rho, x, C, DiagMatrix(w), Q, T_2)),
        ),
    )


# -- the whole pre-RMSNorm model --------------------------------------------------------------

Tok, Pos = MatrixSymbol(r"\mathrm{Tok}", n, v), MatrixSymbol(r"\mathrm{Pos}", n, c)
W_E, W_pos = MatrixSymbol("W_E", v, d), MatrixSymbol(r"W_{pos}", c, d)
X = MatrixSymbol("X", n, d)
D, D_2 = MatrixSymbol("D", n, n), MatrixSymbol("D_2", n, n)
W_Q, W_K, W_V = (MatrixSymbol(f"W_{s}", d, e) for s in "QKV")
b_Q, b_K, b_V = (MatrixSymbol(f"b_{s}", 1, e) for s in "QKV")
A = MatrixSymbol("A", n, n)
W_O, b_O = MatrixSymbol("W_O", e, d), MatrixSymbol("b_O", 1, d)
W_in, W_gate = MatrixSymbol(r"W_{in}", d, m), MatrixSymbol(r"W_{gate}", d, m)
b_in = MatrixSymbol(r"b_{in}", 1, m)
F = MatrixSymbol("F", n, m)
W_out, b_out = MatrixSymbol(r"W_{out}", m, d), MatrixSymbol(r"b_{out}", 1, d)
W_U, b_U = MatrixSymbol("W_U", d, v), MatrixSymbol("b_U", 1, v)
E_, S_, V_, Y_, P_, H_, Z_, L_ = (
    MatrixSymbol(name, *shape) for name, shape in (
        ("E", (n, d)), ("S", (n, n)), ("V", (n, e)), ("Y", (n, d)), ("P", (n, m)), ("H", (n, m)), ("Z", (n, d)), ("L", (n, v))
    )
)
TESTS = {name: free_matrix(rf"T_{{{name}}}", rows) for name, rows in (
    ("E", d), ("X", n), ("S", n), ("V", e), ("Y", d), ("YY", n), ("P", m), ("H", m), ("Z", d), ("L", v)
)}
MODEL_FACTS = (
    Fact(E_, MatAdd(MatMul(Tok, W_E), MatMul(Pos, W_pos)), "the embeddings: one-hot tokens and positions"),
    Fact(S_, MatMul(MatAdd(MatMul(D, X, W_Q), MatMul(ones_n, b_Q)), Transpose(MatAdd(MatMul(D, X, W_K), MatMul(ones_n, b_K)))),
         "a head's scores before scaling: its pattern A is the masked row softmax of S over the root of e"),
    Fact(V_, MatAdd(MatMul(D, X, W_V), MatMul(ones_n, b_V)), "the head's values"),
    Fact(Y_, MatAdd(X, MatMul(A, V_, W_O), MatMul(ones_n, b_O)), "the stream after attention"),
    Fact(P_, MatAdd(MatMul(D_2, Y_, W_in), MatMul(ones_n, b_in)), "the MLP's pre-activations"),
    Fact(H_, MatMul(D_2, Y_, W_gate), "the gate's pre-activations; F = act(H) * P entrywise (act(P) ungated)"),
    Fact(Z_, MatAdd(Y_, MatMul(F, W_out), MatMul(ones_n, b_out)), "the stream after the block"),
    Fact(L_, MatAdd(MatMul(D, X, W_U), MatMul(ones_n, b_U)), "the logits, X the final stream"),
)


def _model_claim(U, reader, *, rotate_pos=True, rotate_bias=True):
    """The rotated model's quantities, each times its test matrix: writers ``(.) U``, readers
    ``reader (.)``; ``rotate_pos`` / ``rotate_bias``: whether ``W_pos`` / ``b_O`` are rotated."""
    stream = MatMul(X, U)
    values = MatAdd(MatMul(D, stream, reader, W_V), MatMul(ones_n, b_V))
    after_attention = MatAdd(stream, MatMul(A, values, W_O, U), MatMul(ones_n, b_O, U) if rotate_bias else MatMul(ones_n, b_O))
    parts = {
        "E": MatAdd(MatMul(Tok, W_E, U), MatMul(Pos, W_pos, U) if rotate_pos else MatMul(Pos, W_pos)),
        "X": _gram(stream),
        "S": MatMul(MatAdd(MatMul(D, stream, reader, W_Q), MatMul(ones_n, b_Q)),
                    Transpose(MatAdd(MatMul(D, stream, reader, W_K), MatMul(ones_n, b_K)))),
        "V": values,
        "Y": after_attention,
        "YY": _gram(after_attention),
        "P": MatAdd(MatMul(D_2, after_attention, reader, W_in), MatMul(ones_n, b_in)),
        "H": MatMul(D_2, after_attention, reader, W_gate),
        "Z": MatAdd(after_attention, MatMul(F, W_out, U), MatMul(ones_n, b_out, U)),
        "L": MatAdd(MatMul(D, stream, reader, W_U), MatMul(ones_n, b_U)),
    }
    return MatAdd(*(MatMul(part, TESTS[name]) for name, part in parts.items()))


def _model_target(U):
    parts = {"E": MatMul(E_, U), "X": _gram(X), "S": S_, "V": V_, "Y": MatMul(Y_, U), "YY": _gram(Y_),
             "P": P_, "H": H_, "Z": MatMul(Z_, U), "L": L_}
    return MatAdd(*(MatMul(part, TESTS[name]) for name, part in parts.items()))


def _model_rotation_proof() -> Proof:
    rhs = _model_target(Q)
    YQ = MatMul(Y_, Q)
    middle = {
        "E": MatMul(E_, Q), "X": _gram(X), "S": S_, "V": V_, "Y": YQ, "YY": _gram(YQ),
        "P": MatAdd(MatMul(D_2, YQ, Q.T, W_in), MatMul(ones_n, b_in)), "H": MatMul(D_2, YQ, Q.T, W_gate),
        "Z": MatAdd(YQ, MatMul(F, W_out, Q), MatMul(ones_n, b_out, Q)), "L": L_,
    }
    return Proof(
        lhs=_model_claim(Q, Q.T),
        rhs=rhs,
        steps=(
            Step(MatAdd(*(MatMul(part, TESTS[name]) for name, part in middle.items())),
                 r"the embedding and attention: $W_E Q$, $W_{pos} Q$, $W_O Q$, $b_O Q$ factor out, so the stream"
                 r" is $EQ$, then $YQ$; $Q Q^\top = I$ in each reader $Q^\top W$ and in $(XQ)(XQ)^\top = X X^\top$:"
                 r" the same normalisers $D$, scores, pattern $A$, values and logits"),
            Step(rhs, r"the MLP: $(YQ)(YQ)^\top = Y Y^\top$, so the same normalisers $D_2$; $Q Q^\top = I$ in"
                      r" $Q^\top W_{in}$ and $Q^\top W_{gate}$, so the same activations $F$; $W_{out} Q$, $b_{out} Q$ factor out"),
        ),
        facts=MODEL_FACTS + ORTHOGONAL + (Fact.invertible(G, "G, the twins' non-orthogonal rotation, is invertible"),),
        samplers={Q: _orthogonal, G: invertible},
        explicit_dims={n: 3, d: 3, e: 2, m: 2, v: 2, c: 3, k: 1},
        assumptions=(
            "pre-norm, every norm RMSPre (fold gains first) or none; D, D_2 the per-position normalisers,"
            " functions of the squared norms of the rows they normalise",
            "one block shown: by induction, every block maps the stream X Q to Z Q; X also stands for the"
            " final stream the unembed reads; a parallel block's MLP reads X like the attention does",
            "A (the pattern) is a function of the scores S, F of the pre-activations P and H, entry by entry",
        ),
        twins=(
            Twin("non_orthogonal", ROTATION_INVARIANCE.describe("non_orthogonal"),
                 _model_claim(G, Inverse(G)), _model_target(G)),
            *(Twin(name, ROTATION_INVARIANCE.describe(name), claim, rhs) for name, claim in (
                ("forget_W_pos", _model_claim(Q, Q.T, rotate_pos=False)),
                ("forget_writer_bias", _model_claim(Q, Q.T, rotate_bias=False)),
                ("readers_not_transposed", _model_claim(Q, Q)))),
        ),
    )


# -- the SliceGPT route -----------------------------------------------------------------------

W_r, b_r, b_ln = MatrixSymbol("W", d, m), MatrixSymbol("b_W", 1, m), MatrixSymbol("b", 1, d)
T_3 = free_matrix("T_3", m)


def _route_claim(stream, normed, reader):
    """``|stream|^2 T_1 + (normed reader + b_W + b W) T_3``: what the processed model's norm sees
    and what its reader computes."""
    return MatAdd(MatMul(_gram(stream), T_1), MatMul(MatAdd(MatMul(normed, reader), b_r, MatMul(b_ln, W_r)), T_3))


def _slicegpt_proof() -> Proof:
    LN = MatrixSymbol(r"\mathrm{LN}(x)", 1, d)
    RMSPre_xCQ = MatrixSymbol(r"\mathrm{RMSPre}(x C Q)", 1, d)
    folded = MatMul(Q.T, DiagMatrix(w), W_r)
    rhs = MatAdd(MatMul(_gram(MatMul(x, C)), T_1), MatMul(MatAdd(MatMul(LN, W_r), b_r), T_3))
    return Proof(
        lhs=_route_claim(MatMul(x, C, Q), RMSPre_xCQ, folded),
        rhs=rhs,
        steps=(
            Step(_route_claim(MatMul(x, C), MatMul(rho, x, C, Q), folded),
                 r"$(xCQ)(xCQ)^\top = xC\,Q Q^\top C^\top x^\top$ and $Q Q^\top = I$: the normaliser is LayerNorm's $\rho$"),
            Step(_route_claim(MatMul(x, C), MatMul(rho, x, C), MatMul(DiagMatrix(w), W_r)),
                 r"$Q Q^\top = I$: the rotation undone by the reader $Q^\top (\operatorname{diag}(w) W)$"),
            Step(rhs, r"the LayerNorm fold: $\mathrm{LN}(x) = \rho\, x C \operatorname{diag}(w) + b$"),
        ),
        facts=ORTHOGONAL + (
            CENTERING_FACT,
            Fact(LN, MatAdd(MatMul(rho, x, C, DiagMatrix(w)), b_ln),
                 "LayerNorm, rho one over the root of the mean square of x C plus eps"),
            Fact(RMSPre_xCQ, MatMul(rho, x, C, Q),
                 "after centering every write the stream is x C, after rotating x C Q; rho reads its squared norm,"
                 " by the first conclusion that of x C"),
        ),
        samplers={Q: _orthogonal},
        explicit_dims={d: 4, m: 3, k: 2},
        assumptions=(
            "every write to the stream is centered (C) and then rotated (Q), so the stream is x C Q",
            "the reader W, b_W stands for every reader of the norm: W_Q, W_K, W_V, W_in, W_U",
        ),
        twins=(
            Twin("skip_centering", SLICEGPT_ROUTE.describe("skip_centering"),
                 _route_claim(MatMul(x, Q), MatMul(rho, x, Q), folded), rhs),
            Twin("keep_layer_norm", SLICEGPT_ROUTE.describe("keep_layer_norm"),
                 _route_claim(MatMul(x, C, Q, C), MatMul(rho, x, C, Q, C), folded), rhs),
        ),
    )


# -- numeric checks ---------------------------------------------------------------------------

#: The seed of the rotations the numeric checks use.
CHECK_SEED = 0


def check_rotation(cfg, *, fixing_ones: bool = False):
    """The orthogonal ``Q`` the numeric checks rotate by (``Q 1 = 1`` with ``fixing_ones``): a
    :class:`~circuitmath._processing._orthogonal.BlockOrthogonal`, cheap and as sharp as a dense one."""
    return block_orthogonal(cfg.d_model, seed=CHECK_SEED, fixing_ones=fixing_ones)


def _non_orthogonal(cfg, Q=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``G = Q diag(s)`` with ``s = exp(N(0, 0.3))`` and its inverse: well conditioned, not orthogonal
    (``Q``: :func:`_matrix`)."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    scale = torch.exp(0.3 * torch.randn(cfg.d_model, generator=generator, dtype=torch.float64, device="cpu"))
    Q_ = as_dense(_matrix(cfg, Q))
    return Q_ * scale, (Q_ / scale).T


def _by_hand(state_dict, cfg, writer, reader, skip=()):
    """Writers ``writer(W)``, readers ``reader(W)``, in float64, rounded once; ``skip`` left alone."""
    out = dict(state_dict)
    for name in residual_writers(cfg):
        if name not in skip:
            out[name] = writer(state_dict[name].double()).to(state_dict[name].dtype)
    for name in residual_readers(cfg):
        if name not in skip:
            out[name] = reader(state_dict[name].double()).to(state_dict[name].dtype)
    return out


def to_rms_pre(state_dict, cfg):
    """A model whose norms are ``RMSPre``: LayerNorm folded, writes centered, switched to RMSNorm;
    RMSNorm folded; ``RMSPre`` and no norm as they are."""
    if cfg.normalization_type in ("LN", "LNPre"):
        state_dict, cfg = layer_norm_to_rms_norm(*centered_layer_norm_model(state_dict, cfg))
    if cfg.normalization_type == "RMS":
        state_dict, cfg = fold_rms_norm(state_dict, cfg)
    return state_dict, cfg


def _matrix(cfg, Q=None):
    """``Q``: :func:`check_rotation` unless given; the fitted ``Q`` of a recovered rotation (the
    diagnosis passes the rotation it recovered to :func:`_rotate` and to each wrong rewrite)."""
    return check_rotation(cfg) if Q is None else Q.matrix if isinstance(Q, SharedRotation) else Q


def _rotate(state_dict, cfg, Q=None):  # the rotation by Q (see _matrix)
    return rotate_residual_stream(state_dict, cfg, _matrix(cfg, Q))


def _rotate_non_orthogonal(state_dict, cfg, Q=None):
    G_, G_inv = _non_orthogonal(cfg, Q)
    _unused, new_cfg = _rotate(state_dict, cfg, Q)
    return _by_hand(state_dict, cfg, lambda W: W @ G_, lambda W: G_inv @ W), new_cfg


def forgetting(transform, names_of):
    """A wrong rewrite: ``transform``, then the tensors ``names_of(cfg)`` names put back as they
    were (a ``ValueError`` if there are none: a model without them cannot make this mistake)."""
    def wrong(state_dict, cfg, *parameter):
        out, new_cfg = transform(state_dict, cfg, *parameter)
        names = names_of(cfg)
        if not names:
            raise ValueError("this model has no such tensor to forget")
        for name in names:
            out[name] = state_dict[name]
        return out, new_cfg
    return wrong


def _readers_not_transposed(state_dict, cfg, Q=None):
    Q_ = as_dense(_matrix(cfg, Q))
    _unused, new_cfg = _rotate(state_dict, cfg, Q)
    return _by_hand(state_dict, cfg, lambda W: W @ Q_, lambda W: Q_ @ W), new_cfg


def _centered_embedding(state_dict, cfg, Q=None):
    """Center W_E (subtract its mean over d_model) before rotating: exact behind LayerNorm, which
    centers what it reads, but behind RMSNorm it changes every norm's input."""
    centered = dict(state_dict, **{"embed.W_E": state_dict["embed.W_E"] - state_dict["embed.W_E"].mean(-1, keepdim=True)})
    return _rotate(marked_as(state_dict, centered), cfg, Q)


def _norm_compare(state_dict, cfg, tokens, computation):
    """``computation(x, Q, eps)`` against ``RMSPre(x)`` on the model's final residual stream ``x``."""
    dtype = validate_state_dict(state_dict, cfg)
    record: dict = {}
    forward(state_dict, cfg, default_tokens(cfg) if tokens is None else tokens, record=record)
    x = record["final_residual"]
    return compare_values(computation(x, as_dense(check_rotation(cfg)).to(x.dtype), cfg.eps),
                          normalize(x, "RMSPre", None, None, cfg.eps), dtype, cfg.d_model)


def _rotated_norm(x, Q_, eps):
    """``RMSPre(x Q) Q^T``: the computation ``rms_norm_rotation`` licenses."""
    return normalize(x @ Q_, "RMSPre", None, None, eps) @ Q_.T


def _stretched_norm(x, Q_, eps):
    """``RMSPre(x G) G^{-1}`` with ``G = Q diag(s)`` not orthogonal: the linear part is undone, the norm is not."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    scale = torch.exp(0.3 * torch.randn(len(Q_), generator=generator, dtype=torch.float64, device="cpu"))
    G_ = Q_ * scale.to(dtype=Q_.dtype, device=Q_.device)
    return normalize(x @ G_, "RMSPre", None, None, eps) @ torch.linalg.inv(G_)


def _norm_not_transposed(x, Q_, eps):
    return normalize(x @ Q_, "RMSPre", None, None, eps) @ Q_


def _layer_norm_rotation(state_dict, cfg):
    require(
        LAYER_NORM_ROTATION.name, IS_LNPRE, cfg.normalization_type == "LNPre",
        f"normalization_type is {cfg.normalization_type!r}: this identity is about LayerNorm without gain and bias"
        + (f" (fold it first: {fold_layer_norm.identity})" if cfg.normalization_type == "LN" else ""),
    )
    return rotate_residual_stream(state_dict, cfg, check_rotation(cfg, fixing_ones=True))


def _layer_norm_generic_rotation(state_dict, cfg):
    _unused, new_cfg = _layer_norm_rotation(state_dict, cfg)
    return dict(state_dict) | rotated_tensors(state_dict, cfg, check_rotation(cfg)), new_cfg


def _to_lnpre(state_dict, cfg):
    return fold_layer_norm(state_dict, cfg) if cfg.normalization_type == "LN" else (state_dict, cfg)


def slicegpt_route(state_dict, cfg, Q=None):
    """Fold the LayerNorm, center every write, switch to RMSNorm, rotate by ``Q`` (default
    :func:`check_rotation`): SliceGPT's preparation, before it deletes directions. Half
    precision takes the route in float32 and is rounded once at its end."""
    require(
        "slicegpt_route", IS_LN, cfg.normalization_type == "LN",
        f"normalization_type is {cfg.normalization_type!r}: the route starts from a LayerNorm model"
        + (f" (an RMSNorm model needs only {fold_rms_norm.identity} before rotating)"
           if cfg.normalization_type == "RMS" else ""),
    )
    dtype = next(iter(state_dict.values())).dtype
    if compute_dtype(dtype) != dtype:  # half precision: the route in float32, rounded once at its end
        out, cfg = slicegpt_route({k: v.to(compute_dtype(dtype)) for k, v in state_dict.items()}, cfg, Q)
        return {k: v.to(dtype) for k, v in out.items()}, cfg
    state_dict, cfg = to_rms_pre(state_dict, cfg)
    return rotate_residual_stream(state_dict, cfg, check_rotation(cfg) if Q is None else Q)


def _route_skipping_centering(state_dict, cfg):
    _unused, new_cfg = slicegpt_route(state_dict, cfg)
    folded, _folded_cfg = fold_layer_norm(state_dict, cfg)
    return dict(folded) | rotated_tensors(folded, cfg, check_rotation(cfg)), new_cfg


def _route_keeping_layer_norm(state_dict, cfg):
    out, new_cfg = slicegpt_route(state_dict, cfg)
    return out, new_cfg.replace(normalization_type="LNPre")


NO_GAIN_INSIDE = Precondition(
    "no gain between the normalisation and the rotation", "no gain between the normalisation and the rotation (fold it first)"
)
ROUTE_ORDER = Precondition(
    "fold, center, switch, rotate in this order", "the steps in this order: the rotation needs RMSPre, the switch needs centered writes"
)

RMS_NORM_ROTATION = register(
    Identity(
        name="rms_norm_rotation",
        title="RMSNorm commutes with rotations",
        summary="RMSPre(x Q) = RMSPre(x) Q for orthogonal Q, eps included: |x Q| = |x|; not for LNPre"
        " unless Q 1 = ±1, not through an unfolded gain, not for a non-orthogonal Q",
        preconditions=(Q_ORTHOGONAL, NO_GAIN_INSIDE),
        build_proof=_norm_rotation_proof,
        transform=_rotated_norm,
        wrong_rewrites={
            "non_orthogonal": WrongRewrite(
                _stretched_norm, "rotate by an invertible G that is not orthogonal: |x G| != |x|"),
            "not_transposed": WrongRewrite(
                _norm_not_transposed, "undo the rotation with Q instead of Q^T: RMSPre(x Q) Q != RMSPre(x)"),
        },
        compare=_norm_compare,
        free_parameter=True,
    )
)

#: The residual rotation as the diagnosis recognises it, before the other recovered symmetries.
RESIDUAL_ROTATION = FirstRecovery(start=to_rms_pre, undone=undone, first=switch_first, performed=lambda cfg: (
    LAYER_NORM_ROTATION if cfg.normalization_type == "LNPre" else ROTATION_INVARIANCE))

LAYER_NORM_ROTATION = register(
    Identity(
        name="layer_norm_rotation",
        title="LayerNorm commutes only with rotations that map the all-ones direction to itself",
        summary="LNPre(x Q) = LNPre(x) Q when Q is orthogonal and Q 1 = 1 or Q 1 = -1: centering commutes"
        " with Q exactly then; any other rotation of an LNPre model changes it",
        preconditions=(IS_LNPRE, Q_ORTHOGONAL, Q_FIXES_ONES, PRE_NORM, NO_NORM_GAIN, Q_SQUARE),
        build_proof=_layer_norm_rotation_proof,
        transform=_layer_norm_rotation, postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "generic_rotation": WrongRewrite(_layer_norm_generic_rotation, "rotate an LNPre model by an orthogonal"
                                             " R that moves 1: centering does not commute with R"),
        },
        prepare=_to_lnpre, recover=recover_residual_rotation, with_parameters=rotate_by_fit,
        wrong_rewrites_recovered=False, recovered_first=RESIDUAL_ROTATION, half_precision=COMPUTES, free_parameter=True,
    )
)

ROTATION_INVARIANCE = register(
    Identity(
        title="Rotating the residual stream of a pre-RMSNorm model",
        summary="writers W Q (W_E, W_pos, W_O, b_O, W_out, b_out), readers Q^T W (W_Q, W_K, W_V, W_in,"
        " W_gate, W_U): the stream becomes x Q and every reader computes what it did",
        preconditions=(PRE_NORM, NO_NORM_GAIN, POST_NORM_GAINS_EQUAL, Q_SQUARE, Q_ORTHOGONAL),
        public=rotate_residual_stream,
        check_note="the rotation Q is recovered from the tensors (orthogonal Procrustes) and verified on every tensor",
        build_proof=_model_rotation_proof,
        transform=_rotate,
        postcondition=NOTHING_SHOWN, moves_off=(center_writing_weights, center_reading_weights),  # Q^T 1 != 1
        wrong_rewrites={
            "non_orthogonal": WrongRewrite(
                _rotate_non_orthogonal,
                "rotate by an invertible G that is not orthogonal, readers G^-1 W: the norms change",
            ),
            "forget_W_pos": WrongRewrite(forgetting(
                _rotate, lambda cfg: ["pos_embed.W_pos"] if cfg.positional_embedding_type in ("standard", "shortformer") else []),
                "rotate W_E but not W_pos"),
            "forget_writer_bias": WrongRewrite(forgetting(_rotate, lambda cfg: [f"blocks.{l}.attn.b_O" for l in range(
                cfg.n_layers)]), "rotate W_O but not the output bias b_O"),
            "router_unrotated": WrongRewrite(forgetting(_rotate, routers), "rotate every reader but the router of the experts",
                                             differs_on=lambda cfg: cfg.n_experts is not None),
            "readers_not_transposed": WrongRewrite(_readers_not_transposed, "readers Q W instead of Q^T W"),
            "centered_embedding": WrongRewrite(
                _centered_embedding, "W_E mean-centered before rotating behind RMSNorm: centering the writes is exact"
                " only for LayerNorm readers, which center what they read", differs_on=lambda cfg: cfg.normalization_type != "LNPre"),
        },
        prepare=to_rms_pre, recover=recover_residual_rotation, with_parameters=rotate_by_fit,
        recovered_first=RESIDUAL_ROTATION, half_precision=COMPUTES, free_parameter=True,
    )
)

SLICEGPT_ROUTE = register(
    Identity(
        name="slicegpt_route",
        title="The SliceGPT route: fold, center, switch to RMSNorm, rotate",
        summary="LN(x) W + b_W = RMSPre(x C Q) (Q^T diag(w) W) + b_W + b W: after folding the LayerNorm and"
        " centering every write, the stream x C Q is seen through RMSNorm with LayerNorm's normaliser",
        preconditions=(IS_LN, PRE_NORM, Q_ORTHOGONAL, ROUTE_ORDER),
        build_proof=_slicegpt_proof,
        transform=slicegpt_route,
        wrong_rewrites={
            "skip_centering": WrongRewrite(_route_skipping_centering, "fold and rotate without centering the writes:"
                                           " RMSPre then sees |x Q| = |x|, not |x C|"),
            "keep_layer_norm": WrongRewrite(
                _route_keeping_layer_norm, "rotate the centered model but keep LNPre instead of switching to RMSPre"),
        },
        half_precision=COMPOSES, free_parameter=True,
    )
)
