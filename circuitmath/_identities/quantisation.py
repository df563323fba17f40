"""The rewrites of quantisation pipelines, made before anything is quantised: scale migration across
a norm (SmoothQuant), rotations inside the heads (QuaRot, SpinQuant), scales through a gated MLP's
product or a ReLU (SmoothQuant/AWQ between up and down projections, cross-layer equalisation).

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
from sympy import DiagMatrix, Identity as Eye, Inverse, MatAdd, MatMul, MatrixSymbol, OneMatrix, Transpose

from .._compare import named_generator
from .._errors import NOT_APPLIED
from .._processing import center_reading_weights, fold_layer_norm, fold_rms_norm, refactor_factored_attn_matrices
from .._processing._common import DENSE_MLP, NO_QK_NORM, NORM_READ_LINEARLY, PRE_NORM, readers
from .._processing.quantisation import (
    COMMUTES_WITH_ROTARY,
    GAINS_AS_STORED,
    HAS_A_NORM,
    HEAD_ROTATIONS,
    SCALES_PER_CHANNEL,
    migrate_norm_scales,
    NEURON_SCALES,
    SCALE_REACHES_OUTPUT_LINEARLY,
    nearest_commuting,
    recover_head_rotations,
    recover_neuron_scales,
    recover_norm_scales,
    rotate_heads,
    scale_neurons,
    scaled_neurons,
)
from .._processing.rotation import HAS_MLPS
from .._state import attention_names, key_value_groups, per_query_head
from .._proof import Fact, Proof, Step, Twin
from .._registry import COMPUTES, NOTHING_SHOWN, Identity, WrongRewrite, register
from ._circuit_checks import dim, rational_orthogonal, rotary_like
from ._qk_norm import uniform_gain_head_rotations
from .rotation import free_matrix

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "quantisation"

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
            Twin("readers_unscaled", MIGRATE_NORM_SCALES.describe("readers_unscaled"),
                 _migrated(G, b_s, lambda _name, W: (W,)), rhs),
            Twin("wrong_way", MIGRATE_NORM_SCALES.describe("wrong_way"),
                 _migrated(G, b_s, lambda _name, W: (Inverse(S), W)), rhs),
            Twin("gate_unscaled", MIGRATE_NORM_SCALES.describe("gate_unscaled"),
                 _migrated(G, b_s, lambda name, W: (W,) if name == "gate" else (S, W)), rhs),
            Twin("bias_unscaled", MIGRATE_NORM_SCALES.describe("bias_unscaled"),
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
    draw per kind of norm (``ln1``, ``ln2``, ``ln_final``), of the spread SmoothQuant's
    ``max|X|^a / max|W|^(1-a)`` takes on outliers. Every block draws the same, so a streamed
    part, numbered from 0, migrates what its block migrates in the whole model."""
    return {norm: torch.exp(torch.randn(cfg.d_model, generator=named_generator(norm.rsplit(".", 1)[-1], CHECK_SEED),
                                        dtype=torch.float64, device="cpu"))
            for norm, _pairs in readers(cfg)}


def _migrate(state_dict, cfg, scales=None):
    return migrate_norm_scales(state_dict, cfg, check_scales(cfg) if scales is None else scales)


def _migrate_but(change):
    """A wrong migration: the exact one, then ``change(out, before, pairs, norm, s)`` per norm (``pairs``
    its readers' (weight, bias) names)."""
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
        title="Migrating per-channel scales across a norm (SmoothQuant)",
        summary="gain w / s (and bias b / s), every reader of the norm diag(s) W: the readers compute what"
        " they did for any nonzero s; readers left unscaled, or divided by s too, change the model",
        preconditions=(NOT_APPLIED, PRE_NORM, NORM_READ_LINEARLY, HAS_A_NORM, GAINS_AS_STORED, SCALES_PER_CHANNEL),
        public=migrate_norm_scales,
        check_note="the scales are recovered from the tensors (each reader's input rows and the gain, by norm)"
        " and every tensor is certified against the migration by them",
        build_proof=_norm_scales_proof,
        transform=_migrate,
        postcondition=NOTHING_SHOWN,
        moves_off=(fold_layer_norm, fold_rms_norm, center_reading_weights),  # a folded gain comes back as 1 / s
        wrong_rewrites={  # the narrowest first: where several explain a tensor, the diagnosis names the first
            "gate_unscaled": WrongRewrite(
                _migrate_but(_unscale(lambda pairs: [w_ for w_, _b in pairs if w_.endswith("W_gate")])),
                "scale every reader but the gate of a gated MLP",
                differs_on=lambda cfg: cfg.gated_mlp and not cfg.attn_only,
            ),
            "router_unscaled": WrongRewrite(_migrate_but(_unscale(lambda pairs: [w_ for w_, _b in pairs if w_.endswith("W_router")])),
                                            "scale every reader of the MLP's norm but the router of its experts",
                                            differs_on=lambda cfg: cfg.n_experts is not None),
            "value_unscaled": WrongRewrite(_migrate_but(_unscale(lambda pairs: [w_ for w_, _b in pairs if w_.endswith("W_V")])),
                                           "scale every reader but W_V"),
            "bias_unscaled": WrongRewrite(
                _migrate_but(_bias_unscaled),
                "LayerNorm: divide the gain by s but not the bias",
                differs_on=lambda cfg: cfg.normalization_type == "LN",
            ),
            "readers_unscaled": WrongRewrite(
                _migrate_but(_unscale(lambda pairs: [w_ for w_, _b in pairs])),
                "divide the gain by s but leave the readers as they are",
            ),
            "wrong_way": WrongRewrite(
                _migrate_but(_divide_readers),
                "divide the readers' rows by s as well: diag(s)^-1 W instead of diag(s) W",
            ),
        },
        recover=recover_norm_scales,
        with_parameters=migrate_norm_scales,
        half_precision=COMPUTES,
    )
)


# -- rotations inside the heads ---------------------------------------------------------------

n = dim("n")
ones_n = OneMatrix(n, 1)
X_hat = MatrixSymbol(r"\hat{X}", n, d)
x_i, x_j = MatrixSymbol("x_i", 1, d), MatrixSymbol("x_j", 1, d)
W_V, W_Q, W_K = (MatrixSymbol(f"W_{c}", d, e) for c in "VQK")
b_V, b_Q, b_K = (MatrixSymbol(f"b_{c}", 1, e) for c in "VQK")
W_O1, W_O2 = MatrixSymbol("W_{O,1}", e, d), MatrixSymbol("W_{O,2}", e, d)
A_1, A_2 = MatrixSymbol("a_1", 1, n), MatrixSymbol("a_2", 1, n)  # the heads' pattern rows at query position i
V_ = MatrixSymbol("V", n, e)
U, U_2, R, G_e = (MatrixSymbol(name, e, e) for name in ("U", "U_2", "R", "G"))
P_i, P_j = MatrixSymbol("P_i", e, e), MatrixSymbol("P_j", e, e)
T_out, T_s = free_matrix(r"T_{out}", d), free_matrix("T_s", 1)


def _head_claim(*, value=U, second_output=None, output=None, value_bias=True, query=R, key=R):
    """Two query heads sharing one key/value head: their outputs (times ``T_out``) and the score
    of query position ``i`` on key position ``j`` (times ``T_s``), with the value side rotated by
    ``value`` (head 2's ``W_O`` by ``second_output``; ``output`` the factor on ``W_O``) and the
    query and key sides by ``query``, ``key``."""
    output = Transpose(value) if output is None else output
    values = MatAdd(MatMul(X_hat, W_V, value), MatMul(ones_n, b_V, value) if value_bias else MatMul(ones_n, b_V))
    second = output if second_output is None else second_output
    heads = MatAdd(MatMul(A_1, values, output, W_O1), MatMul(A_2, values, second, W_O2))
    q = MatMul(MatAdd(MatMul(x_i, W_Q, query), MatMul(b_Q, query)), P_i)
    k_ = MatMul(MatAdd(MatMul(x_j, W_K, key), MatMul(b_K, key)), P_j)
    return MatAdd(MatMul(heads, T_out), MatMul(q, Transpose(k_), T_s))


def _head_target():
    q = MatMul(MatAdd(MatMul(x_i, W_Q), b_Q), P_i)
    k_ = MatMul(MatAdd(MatMul(x_j, W_K), b_K), P_j)
    return MatAdd(MatMul(MatAdd(MatMul(A_1, V_, W_O1), MatMul(A_2, V_, W_O2)), T_out), MatMul(q, Transpose(k_), T_s))


def _orthogonal(rng, shape):
    return rational_orthogonal(rng, shape[0])


def _head_rotation_proof() -> Proof:
    rhs = _head_target()
    return Proof(
        lhs=_head_claim(),
        rhs=rhs,
        steps=(
            Step(MatAdd(
                MatMul(MatAdd(MatMul(A_1, V_, W_O1), MatMul(A_2, V_, W_O2)), T_out),
                MatMul(MatAdd(MatMul(x_i, W_Q, R), MatMul(b_Q, R)), P_i,
                       Transpose(MatMul(MatAdd(MatMul(x_j, W_K, R), MatMul(b_K, R)), P_j)), T_s)),
                 r"the value side: $U U^\top = I$ in each query head's $V U\, U^\top W_O$, one $U$ per group"),
            Step(rhs, r"the query/key side: $R P_i = P_i R$ and $R P_j^\top = P_j^\top R$ (both turn each rotary"
                      r" pair within itself), then $R R^\top = I$"),
        ),
        facts=(
            Fact(V_, MatAdd(MatMul(X_hat, W_V), MatMul(ones_n, b_V)), "the group's values"),
            Fact(MatMul(U, U.T), Eye(e), "U is orthogonal"),
            Fact(MatMul(U_2, U_2.T), Eye(e), "U_2 (the twin's second rotation) is orthogonal"),
            Fact(MatMul(R, R.T), Eye(e), "R is orthogonal"),
            Fact(MatMul(G_e, G_e.T), Eye(e), "G (the twin's rotation) is orthogonal"),
            Fact(MatMul(R, P_i), MatMul(P_i, R), "R commutes with the rotary rotation of position i"),
            Fact(MatMul(R, P_j.T), MatMul(P_j.T, R), "R commutes with the inverse rotary rotation of position j"),
        ),
        samplers={U: _orthogonal, U_2: _orthogonal, G_e: _orthogonal, R: rotary_like, P_i: rotary_like, P_j: rotary_like},
        explicit_dims={n: 2, d: 2, e: 4, k: 1},
        assumptions=(
            "a_1, a_2 are the two heads' pattern rows at query position i, functions of their scores, which the"
            " T_s term shows unchanged (for every pair of positions i, j and every head alike)",
            "P_i = the rotary rotation of position i (NeoX layout: pair (a, a + rotary_dim/2) turned by its angle),"
            " the identity without rotary embeddings; with distinct frequencies an R commutes with every P_i"
            " exactly when it turns each pair within itself by a rotation",
            "grouped-query attention: heads 1 and 2 share the key/value head, so its values V U serve both",
        ),
        twins=(
            Twin("per_query_head", ROTATE_HEADS.describe("per_query_head"),
                 _head_claim(second_output=Transpose(U_2)), rhs),
            Twin("output_not_transposed", ROTATE_HEADS.describe("output_not_transposed"),
                 _head_claim(output=U), rhs),
            Twin("value_bias_unrotated", ROTATE_HEADS.describe("value_bias_unrotated"),
                 _head_claim(value_bias=False), rhs),
            Twin("query_key_generic", ROTATE_HEADS.describe("query_key_generic"),
                 _head_claim(query=G_e, key=G_e), rhs),
            Twin("key_unrotated", ROTATE_HEADS.describe("key_unrotated"), _head_claim(key=Eye(e)), rhs),
        ),
        lemmas=(("uniform_qk_norm_gains", uniform_gain_head_rotations()),),
    )


def check_head_rotations(cfg) -> dict[str, torch.Tensor]:
    """The rotations the numeric checks use (float64 ``[n_layers, kv_heads, d_head, d_head]``):
    random orthogonal for the values; for queries and keys the same, made to commute with the
    rotary embedding on a rotary model. Every block draws the same, so a streamed part,
    numbered from 0, rotates what its block rotates in the whole model."""
    shape = (1, len(key_value_groups(cfg)), cfg.d_head, cfg.d_head)
    generator = torch.Generator(device="cpu").manual_seed(CHECK_SEED)
    value, query_key = (
        torch.linalg.qr(torch.randn(*shape, generator=generator, dtype=torch.float64, device="cpu"))[0]
        .expand(cfg.n_layers, *shape[1:]).clone() for _ in "vq")
    if cfg.positional_embedding_type == "rotary":
        query_key = nearest_commuting(query_key, cfg)
    return {"value": value, "query_key": query_key}


def _rotate_heads(state_dict, cfg, rotations=None):
    return rotate_heads(state_dict, cfg, **(check_head_rotations(cfg) if rotations is None else rotations))


def _heads_but(change):
    """A wrong rotation: the exact one, then ``change(out, before, cfg, rotations)``."""
    def wrong(state_dict, cfg, rotations=None):
        rotations = check_head_rotations(cfg) if rotations is None else rotations
        out, out_cfg = rotate_heads(state_dict, cfg, **rotations)
        change(out, state_dict, cfg, rotations)
        return out, out_cfg
    return wrong


def _per_query_head(out, before, cfg, rotations):
    """Every other query head of a group turns its W_O by another rotation (the group's next, or the first's)."""
    R = rotations["value"].double()
    other = torch.roll(R, 1, dims=1) if R.shape[1] > 1 else R.transpose(-1, -2)
    for layer in range(cfg.n_layers):
        name = f"blocks.{layer}.attn.W_O"
        W, turns = out[name].clone(), other[layer].to(before[name].device)  # multiplied where the weights are
        for g, heads in enumerate(key_value_groups(cfg)):
            for h in list(heads)[1::2]:
                W[h] = (turns[g].T @ before[name][h].double()).to(W.dtype)
        out[name] = W


def _output_not_transposed(out, before, cfg, rotations):
    R = per_query_head(rotations["value"].double(), cfg, rotations["value"].shape[1], dim=1)
    for layer in range(cfg.n_layers):
        name = f"blocks.{layer}.attn.W_O"
        out[name] = (R[layer].to(before[name].device) @ before[name].double()).to(before[name].dtype)


def _put_back(sides):
    def change(out, before, cfg, _rotations):
        for layer in range(cfg.n_layers):
            for side, which in sides:
                name = f"blocks.{layer}.attn.{attention_names(cfg, side)[which]}"
                out[name] = before[name]
    return change


def _query_key_generic(state_dict, cfg, rotations=None):
    """Rotate queries and keys by a rotation that mixes rotary pairs (the values as the identity does)."""
    from ..circuits._bases import change_bases

    rotations = check_head_rotations(cfg) if rotations is None else rotations
    out, out_cfg = rotate_heads(state_dict, cfg, value=rotations["value"])
    generic = torch.linalg.qr(torch.randn(rotations["value"].shape, dtype=torch.float64, device="cpu",
                                          generator=torch.Generator(device="cpu").manual_seed(CHECK_SEED + 1)))[0]
    generic = generic.to(state_dict["embed.W_E"].device)  # the products run where the weights are
    return change_bases(out, cfg, query=generic, key=generic), out_cfg


ROTATE_HEADS = register(
    Identity(
        title="Rotating the value/output and query/key spaces of each head",
        summary="W_V U, b_V U, U^T W_O (one U per key/value head, shared by its group) and W_Q R, W_K R with R"
        " commuting with the rotary embedding: every head's scores and output are what they were",
        preconditions=(HEAD_ROTATIONS, COMMUTES_WITH_ROTARY, NO_QK_NORM),
        public=rotate_heads,
        check_note="the rotations are recovered per key/value head (orthogonal Procrustes; on a rotary model the"
        " nearest rotation that commutes with it) and every tensor is certified against the rotation by them",
        build_proof=_head_rotation_proof,
        transform=_rotate_heads,
        postcondition=NOTHING_SHOWN,
        moves_off=(refactor_factored_attn_matrices,),  # a balanced head's basis rotated: no longer diagonal
        wrong_rewrites={
            "per_query_head": WrongRewrite(
                _heads_but(_per_query_head),
                "grouped-query attention: a rotation per query head, U for head 1's W_O and U_2 for "
                "head 2's, the shared W_V by U",
                differs_on=lambda cfg: (cfg.n_key_value_heads or cfg.n_heads) < cfg.n_heads,
            ),
            "value_bias_unrotated": WrongRewrite(_heads_but(_put_back([("V", 1)])), "rotate W_V but not b_V"),
            "key_unrotated": WrongRewrite(
                _heads_but(_put_back([("K", 0), ("K", 1)])), "rotate the queries but not the keys"),
            "output_not_transposed": WrongRewrite(
                _heads_but(_output_not_transposed), "W_O by U instead of U^T"),
            "query_key_generic": WrongRewrite(
                _query_key_generic,
                "rotate queries and keys of a rotary model by a G that mixes rotary pairs",
                differs_on=lambda cfg: cfg.positional_embedding_type == "rotary",
            ),
        },
        recover=recover_head_rotations,
        with_parameters=lambda state_dict, cfg, rotations: rotate_heads(state_dict, cfg, **rotations),
        half_precision=COMPUTES,
    )
)


# -- scales through the MLP's product or its ReLU -------------------------------------------

x_row = MatrixSymbol("x", 1, d)
W_in, W_gate_, W_out = MatrixSymbol(r"W_{in}", d, m), MatrixSymbol(r"W_{gate}", d, m), MatrixSymbol(r"W_{out}", m, d)
b_in = MatrixSymbol(r"b_{in}", 1, m)
s_m = MatrixSymbol("s", m, 1)
S_m = DiagMatrix(s_m)
g = MatrixSymbol("g", m, 1)  # act(x W_gate)^T: the gate, which the rewrite leaves alone
g_s = MatrixSymbol("g_s", m, 1)  # act(x W_gate diag(s))^T: the twin's gate, no function of g
F_relu, F_s = MatrixSymbol("f", 1, m), MatrixSymbol("f_s", 1, m)  # an ungated ReLU MLP's hidden row
F_neg = MatrixSymbol("f_-", 1, m)
T_g, T_r = free_matrix(r"T_{gated}", d), free_matrix(r"T_{relu}", d)


def _neuron_claim(*, up=S_m, bias=True, gate=g, out=None, relu=F_s):
    """A gated MLP (times ``T_gated``) and an ungated ReLU MLP (times ``T_relu``) at one position, their up projection scaled by ``up``, ``W_out`` by ``out`` (``diag(s)^-1``
    by default), the gate's activations ``gate`` and the ReLU's ``relu``."""
    out = Inverse(S_m) if out is None else out
    pre = MatAdd(MatMul(x_row, W_in, up), MatMul(b_in, up) if bias else b_in)
    gated = MatMul(pre, DiagMatrix(gate), out, W_out, T_g)
    return MatAdd(gated, MatMul(relu, out, W_out, T_r))


def _neuron_scales_proof() -> Proof:
    rhs = MatAdd(MatMul(MatAdd(MatMul(x_row, W_in), b_in), DiagMatrix(g), W_out, T_g), MatMul(F_relu, W_out, T_r))
    return Proof(
        lhs=_neuron_claim(),
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(MatAdd(MatMul(x_row, W_in), b_in), DiagMatrix(g), S_m, Inverse(S_m), W_out, T_g),
                        MatMul(F_relu, S_m, Inverse(S_m), W_out, T_r)),
                 r"the product with the gate is entrywise: $\operatorname{diag}(s) \operatorname{diag}(g) ="
                 r" \operatorname{diag}(g) \operatorname{diag}(s)$; ReLU: $f_s = f \operatorname{diag}(s)$"),
            Step(rhs, r"$\operatorname{diag}(s) \operatorname{diag}(s)^{-1} = I$"),
        ),
        facts=(
            Fact(F_s, MatMul(F_relu, S_m), "relu(p diag(s)) = relu(p) diag(s) entry by entry: positive homogeneity, s > 0"),
            Fact.invertible(S_m, "every scale is nonzero"),
            Fact(MatMul(S_m, DiagMatrix(g)), MatMul(DiagMatrix(g), S_m), "diagonal matrices commute"),
        ),
        samplers={s_m: _positive_vector},
        explicit_dims={n: 2, d: 2, m: 3, k: 1},
        assumptions=(
            "gated: g = act(x W_gate)^T, which the rewrite leaves alone; the MLP's hidden row is (x W_in + b_in) diag(g)",
            "ungated: f = relu(p) for the pre-activations p = x W_in + b_in; s > 0, so relu(p diag(s)) = f diag(s)",
        ),
        twins=(
            Twin("through_gate", SCALE_NEURONS.describe("through_gate"),
                 _neuron_claim(up=Eye(m), gate=g_s), rhs),
            Twin("out_not_divided", SCALE_NEURONS.describe("out_not_divided"),
                 _neuron_claim(out=Eye(m)), rhs),
            Twin("bias_not_scaled", SCALE_NEURONS.describe("bias_not_scaled"),
                 _neuron_claim(bias=False), rhs),
            Twin("not_homogeneous", "an ungated GELU or SiLU MLP, or ReLU with a negative scale: act(p diag(s)) is"
                 " another row f_-, not f diag(s)", _neuron_claim(relu=F_neg), rhs),
        ),
    )


def _positive_vector(rng, shape):
    return sympy.Matrix(*shape, lambda i, j: sympy.Rational(rng.randint(1, 9), rng.randint(1, 4)))


def check_neuron_scales(cfg) -> torch.Tensor:
    """The scales the numeric checks use: ``exp(N(0, 1))`` per neuron (float64
    ``[n_layers, d_mlp]``), the same in every block, so a streamed part, numbered from 0,
    scales what its block scales in the whole model."""
    generator = torch.Generator(device="cpu").manual_seed(CHECK_SEED)
    drawn = torch.exp(torch.randn(1, cfg.d_mlp or 0, generator=generator, dtype=torch.float64, device="cpu"))
    return drawn.expand(cfg.n_layers, -1).clone()


def _scale_neurons(state_dict, cfg, scales=None):
    return scale_neurons(state_dict, cfg, check_neuron_scales(cfg) if scales is None else scales)


def _neurons_but(leaf=None, into=None):
    """A wrong scaling: the exact one, then every layer's ``mlp.<leaf>`` put back, or the scales
    applied to ``mlp.<into>``'s columns as well."""
    def wrong(state_dict, cfg, scales=None):
        scales = check_neuron_scales(cfg) if scales is None else scales
        out, out_cfg = scale_neurons(state_dict, cfg, scales)
        for layer in range(cfg.n_layers):
            p = f"blocks.{layer}.mlp"
            if leaf is not None:
                out[f"{p}.{leaf}"] = state_dict[f"{p}.{leaf}"]
            if into is not None:
                W = state_dict[f"{p}.{into}"]
                s = scales.double() if scales.ndim == 1 else scales[layer].double()
                out[f"{p}.{into}"] = (W.double() * s.to(W.device)).to(W.dtype)
        return out, out_cfg
    return wrong


def _regardless(state_dict, cfg, scales=None):
    """Scale the neurons of an MLP the identity refuses (GELU or SiLU without a gate, or ReLU with a
    negative scale): the activation is not positively homogeneous there."""
    scales = check_neuron_scales(cfg) if scales is None else scales
    return scaled_neurons(state_dict, cfg, scales), cfg.replace(applied=cfg.applied + (scale_neurons.identity,))


SCALE_NEURONS = register(
    Identity(
        title="Scaling neurons through a gated product or a ReLU (cross-layer equalisation)",
        summary="W_in diag(s), b_in s, diag(1/s) W_out: exact through a gated MLP's up projection for any nonzero s,"
        " through ReLU for s > 0; not through the gate, GELU or SiLU, or ReLU with s < 0",
        preconditions=(HAS_MLPS, DENSE_MLP, NEURON_SCALES, SCALE_REACHES_OUTPUT_LINEARLY),
        public=scale_neurons,
        check_note="the scales are recovered from each neuron's W_in column (or W_out row) and every tensor is"
        " certified against the scaling by them",
        build_proof=_neuron_scales_proof,
        transform=_scale_neurons,
        postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "through_gate": WrongRewrite(
                _neurons_but(leaf="W_in", into="W_gate"),
                "scale the gate's columns instead of W_in's: act(z s) is no function of act(z) s (SiLU, "
                "GELU), so the gate becomes an unrelated g_s",
                differs_on=lambda cfg: cfg.gated_mlp,
            ),
            "out_not_divided": WrongRewrite(_neurons_but(leaf="W_out"), "scale W_in but leave W_out"),
            "bias_not_scaled": WrongRewrite(_neurons_but(leaf="b_in"), "scale W_in but not b_in"),
            "regardless": WrongRewrite(_regardless, regardless=True),
        },
        recover=recover_neuron_scales,
        with_parameters=scale_neurons,
        half_precision=COMPUTES,
    )
)
