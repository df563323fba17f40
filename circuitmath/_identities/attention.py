"""Attention as tensor products.

- ``attention_head_tensor_form``: a head computes values ``V = X W_V``, mixes them across
  positions with its pattern, ``R = A V``, and writes ``R W_O``; that is ``(A ⊗ W_O W_V)·X`` in
  the paper's notation (``W_O W_V`` the paper's matrices, the transpose of TransformerLens's
  ``W_V @ W_O``; the attention pattern is held fixed);
- ``multi_head_sum``: concatenating the heads' result vectors and applying the stacked ``W_O``
  equals the sum of the heads' outputs;
- ``only_attention_mixes_positions``: every operator ``I ⊗ W`` (embedding, unembedding, the
  linear maps inside MLPs; norms and activations act row by row too) commutes with every operator
  on positions, so it cannot move information between positions; attention ``A ⊗ W`` does not.
"""

from __future__ import annotations

import torch
from sympy import Identity as Eye, MatAdd, MatMul, MatrixSymbol, Transpose, ZeroMatrix

from .._kronecker import Apply, tensor
from .._proof import Definition, Fact, Step, Twin
from .._registry import Identity, WrongRewrite, register
from .._reference import normalize
from ..circuits import TensorProduct, ov_circuits
from ..circuits._heads import layer_bias, layer_weight
from ..circuits._heads import HAS_ATTENTION
from ..circuits._paths import PATH_MODEL, recorded_run
from ._circuit_checks import Joint, compare_logits, dim, logits_with_heads, notation_proof, selector

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "attention"

n, d, e, q = dim("n"), dim("d"), dim("e"), dim("q")
#: The routes rerun the forward pass with frozen patterns (the path expansion's preconditions);
#: the tensor form reads the OV circuits, which need attention layers.
ATTENTION_ONLY = PATH_MODEL


# -- attention_head_tensor_form ---------------------------------------------------------------


def _head_proof():
    X, A = MatrixSymbol("X", n, d), MatrixSymbol("A", n, n)
    W_V, W_O = MatrixSymbol("W_V", d, e), MatrixSymbol("W_O", e, d)
    V, R, H = MatrixSymbol("V", n, e), MatrixSymbol("R", n, e), MatrixSymbol("h(X)", n, d)
    W_Vc, W_Oc = MatrixSymbol(r"{W_V^{\mathrm{col}}}", e, d), MatrixSymbol(r"{W_O^{\mathrm{col}}}", d, e)
    rhs = Apply(tensor(A, MatMul(W_Oc, W_Vc)), X)
    return notation_proof(
        lhs=H,
        rhs=rhs,
        steps=(
            Step(MatMul(R, W_O), r"definition of the head's output"),
            Step(MatMul(A, V, W_O), r"definition of $R$: row $i$ is $\sum_j A_{ij} v_j$"),
            Step(MatMul(A, X, W_V, W_O), r"definition of $V$: row $j$ is $v_j = x_j W_V$"),
            Step(MatMul(A, X, Transpose(MatMul(W_Oc, W_Vc))), r"the row/column convention: $W_V W_O = (W_O^{\mathrm{col}} W_V^{\mathrm{col}})^\top$"),
            Step(rhs, r"definition of $\otimes$"),
        ),
        definitions=(
            Definition(V, MatMul(X, W_V), "the value vectors, one row per position"),
            Definition(R, MatMul(A, V), "the result vectors: values mixed by the attention pattern"),
        ),
        facts=(
            Fact(H, MatMul(R, W_O), "the head's output, written to the residual stream"),
            Fact(W_Vc, Transpose(W_V), "W_V for column vectors (the paper's)"),
            Fact(W_Oc, Transpose(W_O), "W_O for column vectors (the paper's)"),
        ),
        explicit_dims={n: 3, d: 4, e: 2},
        twins=(
            Twin("row_product_in_paper_formula", "use TransformerLens's W_V W_O as the paper's feature factor",
                 H, Apply(tensor(A, MatMul(W_V, W_O)), X)),
            Twin("pattern_transposed", ATTENTION_HEAD_TENSOR_FORM.describe("pattern_transposed"),
                 H, Apply(tensor(Transpose(A), MatMul(W_Oc, W_Vc)), X)),
        ),
    )


def _ov_tensor_route(transpose_pattern: bool):
    """Heads as ``(A ⊗ W_OV^T)·x`` with ``W_OV`` from :func:`circuitmath.circuits.ov_circuits`."""

    def route(state_dict, cfg, tokens):
        ov = ov_circuits(state_dict, cfg).AB  # [layers, heads, d, d], TransformerLens's W_V W_O

        def heads(layer, pattern, normed):
            A = pattern.transpose(-1, -2) if transpose_pattern else pattern
            b = torch.einsum("he,hed->hd", layer_bias(state_dict, cfg, layer, "V"), state_dict[f"blocks.{layer}.attn.W_O"])
            out = TensorProduct(A, ov[layer].transpose(-1, -2)).apply(normed[:, None])  # [b, heads, p, d]
            return (out + b[:, None, :]).sum(dim=1)

        return logits_with_heads(state_dict, cfg, tokens, heads, "attention_head_tensor_form")

    return route


ATTENTION_HEAD_TENSOR_FORM = register(
    Identity(
        name="attention_head_tensor_form",
        title="An attention head is a tensor product",
        summary="h(X) = A (X W_V) W_O = (A ⊗ W_O W_V)·X, with the paper's W_O W_V the transpose of W_V @ W_O",
        preconditions=(*ATTENTION_ONLY, HAS_ATTENTION),
        build_proof=_head_proof,
        transform=_ov_tensor_route(transpose_pattern=False),
        wrong_rewrites={
            "pattern_transposed": WrongRewrite(
                _ov_tensor_route(transpose_pattern=True),
                "mix positions with A^T (keys attending to queries)",
            ),
        },
        compare=compare_logits,
    )
)


# -- multi_head_sum --------------------------------------------------------------------------


def _multi_head_proof():
    X = MatrixSymbol("X", n, d)
    A = [MatrixSymbol(f"{{A^{{{h}}}}}", n, n) for h in (1, 2)]
    W_V = [MatrixSymbol(f"{{W_V^{{{h}}}}}", d, e) for h in (1, 2)]
    W_O = [MatrixSymbol(f"{{W_O^{{{h}}}}}", e, d) for h in (1, 2)]
    E = [MatrixSymbol(f"E_{h}", e, 2 * e) for h in (1, 2)]
    OV = [MatrixSymbol(f"{{W_{{OV}}^{{{h}}}}}", d, d) for h in (1, 2)]
    Z = MatrixSymbol("Z", n, 2 * e)
    W_O_all = MatrixSymbol("W_O", 2 * e, d)
    W_O_swapped = MatrixSymbol(r"{W_O^{\mathrm{swap}}}", 2 * e, d)
    results = [MatMul(A[h], X, W_V[h]) for h in range(2)]
    rhs = MatAdd(*(Apply(tensor(A[h], OV[h]), X) for h in range(2)))
    facts = tuple(
        Fact(MatMul(E[i], Transpose(E[j])), Eye(e) if i == j else ZeroMatrix(e, e), "the blocks of the concatenation")
        for i in range(2) for j in range(2)
    )
    joint = Joint(lambda rng, dims: {E[h]: selector(h, dims[e], 2) for h in range(2)}, {e: 2})
    return notation_proof(
        lhs=MatMul(Z, W_O_all),
        rhs=rhs,
        steps=(
            Step(MatMul(MatAdd(*(MatMul(results[h], E[h]) for h in range(2))), MatAdd(*(MatMul(Transpose(E[h]), W_O[h]) for h in range(2)))),
                 r"definitions of the concatenation $Z$ and the stacked $W_O$"),
            Step(MatAdd(*(MatMul(results[i], E[i], Transpose(E[j]), W_O[j]) for i in range(2) for j in range(2))),
                 "distribute"),
            Step(MatAdd(*(MatMul(results[h], W_O[h]) for h in range(2))), r"$E_i E_j^\top = \delta_{ij} I_e$"),
            Step(rhs, r"a head is a tensor product, once per head"),
        ),
        definitions=(
            Definition(W_O_swapped, MatAdd(MatMul(Transpose(E[0]), W_O[1]), MatMul(Transpose(E[1]), W_O[0])),
                       "W_O stacked in the wrong order"),
        ),
        facts=(
            Fact(Z, MatAdd(*(MatMul(results[h], E[h]) for h in range(2))),
                 "the heads' result vectors side by side (E_h puts a d_head block in place h)"),
            Fact(W_O_all, MatAdd(*(MatMul(Transpose(E[h]), W_O[h]) for h in range(2))),
                 "the heads' W_O stacked, [n_heads d_head, d_model]"),
            *(Fact(OV[h], Transpose(MatMul(W_V[h], W_O[h])), "the paper's W_O W_V of head h") for h in range(2)),
            *facts,
        ),
        samplers=joint.samplers(*E),
        explicit_dims={n: 3, d: 4, e: 2},
        twins=(
            Twin("stacked_in_wrong_order", MULTI_HEAD_SUM.describe("stacked_in_wrong_order"),
                 MatMul(Z, W_O_swapped), rhs),
            Twin("first_head_only", "keep only the block of the first head", MatMul(Z, W_O_all),
                 Apply(tensor(A[0], OV[0]), X)),
        ),
    )


def _concatenated_route(head_major: bool):
    def route(state_dict, cfg, tokens):
        def heads(layer, pattern, normed):
            v = torch.einsum("bpd,hde->bphe", normed, layer_weight(state_dict, cfg, layer, "V"))
            z = torch.einsum("bhqk,bkhe->bqhe", pattern, v + layer_bias(state_dict, cfg, layer, "V"))
            W_O = state_dict[f"blocks.{layer}.attn.W_O"]  # [heads, d_head, d_model]
            stacked = W_O.reshape(-1, cfg.d_model) if head_major else W_O.transpose(0, 1).reshape(-1, cfg.d_model)
            return z.reshape(*z.shape[:2], -1) @ stacked  # [b, p, heads d_head] @ [heads d_head, d]

        return logits_with_heads(state_dict, cfg, tokens, heads, "multi_head_sum")

    return route


MULTI_HEAD_SUM = register(
    Identity(
        name="multi_head_sum",
        title="Multi-head attention is a sum of heads",
        summary="concat(R^1, ..., R^H) W_O = Σ_h R^h W_O^h = Σ_h (A^h ⊗ W_O^h W_V^h)·X",
        preconditions=ATTENTION_ONLY,
        build_proof=_multi_head_proof,
        transform=_concatenated_route(head_major=True),
        wrong_rewrites={
            "stacked_in_wrong_order": WrongRewrite(
                _concatenated_route(head_major=False),
                "stack W_O in the other order than the result vectors",
            ),
        },
        compare=compare_logits,
    )
)


# -- only_attention_mixes_positions ----------------------------------------------------------


def _positions_proof():
    X, E, W = MatrixSymbol("X", n, d), MatrixSymbol("P", n, n), MatrixSymbol("W", q, d)
    A, V = MatrixSymbol("A", n, n), MatrixSymbol("V", d, d)
    lhs = Apply(tensor(Eye(n), W), Apply(tensor(E, Eye(d)), X))
    rhs = Apply(tensor(E, Eye(q)), Apply(tensor(Eye(n), W), X))
    Ws = MatrixSymbol("W", d, d)
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(Apply(tensor(E, W), X), r"the mixed product: $I P \otimes W I$"),
            Step(MatMul(E, X, Transpose(W)), r"definition of $\otimes$"),
            Step(rhs, r"the mixed product: $P I \otimes I W$"),
        ),
        explicit_dims={n: 3, d: 4, q: 2},
        twins=(
            Twin("attention_commutes", "an attention head A ⊗ W commutes with an operator on positions",
                 Apply(tensor(A, Ws), Apply(tensor(E, Eye(d)), X)), Apply(tensor(E, Eye(d)), Apply(tensor(A, Ws), X))),
            Twin("features_commute", "a feature map commutes with every P ⊗ V",
                 Apply(tensor(Eye(n), Ws), Apply(tensor(E, V), X)), Apply(tensor(E, V), Apply(tensor(Eye(n), Ws), X))),
        ),
    )


def _row_by_row_route(mix_positions: bool):
    """The forward pass with every operation but attention applied to one position at a time.

    With ``mix_positions`` the norms take their statistics over all positions together, the
    kind of position mixing that only attention may do.
    """

    def norm(state_dict, cfg, prefix, x):
        w, b = state_dict.get(f"{prefix}.w"), state_dict.get(f"{prefix}.b")
        if w is not None and cfg.norm_gain_offset:
            w = cfg.norm_gain_offset + w
        if not mix_positions:
            return torch.cat([normalize(x[:, p : p + 1], cfg.normalization_type, w, b, cfg.eps) for p in range(x.shape[1])], dim=1)
        flat = x.reshape(x.shape[0], 1, -1)  # [batch, 1, pos d]: one statistic per sequence
        kind = cfg.normalization_type
        if kind is None:
            return x
        centered = flat - flat.mean(dim=-1, keepdim=True) if kind in ("LN", "LNPre") else flat
        scaled = (centered / torch.sqrt(centered.pow(2).mean(dim=-1, keepdim=True) + cfg.eps)).reshape(x.shape)
        scaled = scaled * w if kind in ("LN", "RMS") else scaled
        return scaled + b if kind == "LN" else scaled

    def route(state_dict, cfg, tokens):
        run = recorded_run(state_dict, cfg, tokens, "only_attention_mixes_positions")
        W_E, W_U = state_dict["embed.W_E"], state_dict["unembed.W_U"]
        x = torch.stack([W_E[tokens[:, p]] for p in range(tokens.shape[1])], dim=1)
        if cfg.positional_embedding_type == "standard":
            x = x + state_dict["pos_embed.W_pos"][: tokens.shape[1]]
        for layer in range(cfg.n_layers):
            normed = norm(state_dict, cfg, f"blocks.{layer}.ln1", x)
            v = torch.einsum("bpd,hde->bphe", normed, layer_weight(state_dict, cfg, layer, "V"))
            v = v + layer_bias(state_dict, cfg, layer, "V")
            z = torch.einsum("bhqk,bkhe->bqhe", run.patterns[layer], v)  # the only mixing of positions
            x = x + torch.einsum("bqhe,hed->bqd", z, state_dict[f"blocks.{layer}.attn.W_O"]) + state_dict[f"blocks.{layer}.attn.b_O"]
        final = norm(state_dict, cfg, "ln_final", x)
        return torch.stack([final[:, p] @ W_U for p in range(tokens.shape[1])], dim=1) + state_dict["unembed.b_U"]

    return route


ONLY_ATTENTION_MIXES_POSITIONS = register(
    Identity(
        name="only_attention_mixes_positions",
        title="Only attention moves information between positions",
        summary="(I ⊗ W)(P ⊗ I) = (P ⊗ I)(I ⊗ W) for every P: maps of the form I ⊗ W act on each position alone",
        preconditions=ATTENTION_ONLY,
        build_proof=_positions_proof,
        transform=_row_by_row_route(mix_positions=False),
        wrong_rewrites={"norm_over_positions": _row_by_row_route(mix_positions=True)},
        compare=compare_logits,
    )
)
