"""Path expansions of attention-only transformers, and virtual weights.

All proofs state TransformerLens's forward pass (row vectors, no norms, no biases) on the left
and the paper's tensor-product expansion on the right, with the paper's matrices defined as
transposes (``row_column_convention``): ``W_E^c := W_E^T``, ``W_U^c := W_U^T`` and
``W_OV^{h,c} := (W_V^h W_O^h)^T``. ``t`` is the one-hot token matrix ``[n, d_vocab]``; the
attention patterns ``A^h`` are fixed matrices, which is what "exact once the patterns are fixed"
means. Products of operators are distributed and then combined term by term
(``_kronecker.expand_operator``): sympy's ``combine_kronecker`` is unsound on sums, and its
rewrite is a negative twin here.

- ``zero_layer_bigram``: ``t W_E W_U = (I ⊗ W_U^c W_E^c)·t``, a bigram table;
- ``one_layer_path_expansion``: the direct path plus one term per head;
- ``two_layer_path_expansion``: adds the virtual head ``A^2 A^1 ⊗ W_U^c W_OV^2 W_OV^1 W_E^c``;
- ``qk_composition_terms``: the second layer's scores split into direct, Q-, K- and
  Q-and-K-composition terms;
- ``virtual_weights``: the residual stream is the sum of everything written to it, so a reader
  sees each writer through the virtual weight ``W_O^A W_I^B`` (the paper's ``W_I^B W_O^A``).

Numeric checks use :func:`circuitmath.circuits.path_terms` and
:func:`circuitmath.circuits.score_terms` (norm scales frozen too, biases and positional
embeddings as extra paths) against the reference forward pass.
"""

from __future__ import annotations

import torch
from sympy import Identity as Eye, MatAdd, MatMul, MatrixSymbol, Transpose
from sympy.matrices.expressions.kronecker import KroneckerProduct

from .._errors import Precondition
from .._processing._common import NO_QK_NORM, require
from .._kronecker import Apply, expand_operator, tensor
from .._proof import Fact, Step, Twin
from .._registry import Identity, WrongRewrite, register
from ..circuits import Path, bigram_table, path_terms, pattern_from_scores as _softmax_scores, score_terms, virtual_weights
from ..circuits._heads import layer_bias, layer_weight
from ..circuits._paths import PATH_MODEL, embedding_terms, recorded_run
from ._circuit_checks import compare_logits, dim, frozen_norm_operator, logits_with_heads, notation_proof

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "path_expansion"

n, d, e, V, f = dim("n"), dim("d"), dim("e"), dim("V"), dim("f")
t = MatrixSymbol("t", n, V)
W_E, W_U = MatrixSymbol("W_E", V, d), MatrixSymbol("W_U", d, V)
W_Ec, W_Uc = MatrixSymbol(r"{W_E^{c}}", d, V), MatrixSymbol(r"{W_U^{c}}", V, d)
x_0 = MatrixSymbol("x_0", n, d)
CONVENTION = (
    Fact(W_Ec, Transpose(W_E), "the paper's embedding (column convention)"),
    Fact(W_Uc, Transpose(W_U), "the paper's unembedding (column convention)"),
)
DIMS = {n: 3, d: 4, e: 2, V: 5, f: 2}
#: How many layers each route needs (the path expansion's own preconditions come from PATH_MODEL:
#: attention-only, pre-norm, a known positional embedding; patterns and norm scales are frozen).
ZERO_LAYERS = Precondition("zero layers", "zero layers (positions and the norm's frozen scale enter per position)")
LAYERS = {1: Precondition("one layer"), 2: Precondition("two layers")}
AT_LEAST_TWO_LAYERS = Precondition("at least two layers", "at least two layers (the earlier patterns frozen)")


def _head(h):
    """``A^h, W_V^h, W_O^h`` and the paper's ``W_OV^{h,c} := (W_V^h W_O^h)^T`` with its definition."""
    A = MatrixSymbol(f"{{A^{{{h}}}}}", n, n)
    W_V, W_O = MatrixSymbol(f"{{W_V^{{{h}}}}}", d, e), MatrixSymbol(f"{{W_O^{{{h}}}}}", e, d)
    OV = MatrixSymbol(f"{{W_{{OV}}^{{{h},c}}}}", d, d)
    return A, W_V, W_O, OV, Fact(OV, Transpose(MatMul(W_V, W_O)), f"the paper's W_O W_V of head {h}")


def _distributed(factors_per_slot):
    """Every product choosing one operator per slot (the distributed form of a product of sums)."""
    products = [[]]
    for slot in factors_per_slot:
        products = [p + [f] for p in products for f in slot]
    return MatAdd(*(MatMul(*[f for f in p if f != "identity"]) for p in products))


def _path_expansion_proof(layers):
    """``layers``: for each layer, the heads in it. Builds lhs (TransformerLens's forward pass),
    the operator form, its distributed and combined forms, and the expanded right side."""
    heads = [[_head(h) for h in layer] for layer in layers]
    definitions = list(CONVENTION) + [h[4] for layer in heads for h in layer]
    xs = [x_0]
    definitions.append(Fact(x_0, MatMul(t, W_E), "the embedded tokens"))
    for i, layer in enumerate(heads, start=1):
        x_prev = xs[-1]
        x_i = MatrixSymbol(f"x_{i}", n, d)
        definitions.append(Fact(x_i, MatAdd(x_prev, *(MatMul(A, x_prev, W_V, W_O) for A, W_V, W_O, _, _ in layer)),
                                      f"the residual stream after layer {i}: x_{i-1} plus every head's output"))
        xs.append(x_i)
    lhs = MatMul(xs[-1], W_U)
    identity = Eye(n * d)
    layer_ops = [MatAdd(identity, *(tensor(A, OV) for A, _, _, OV, _ in layer)) for layer in heads]
    op = MatMul(tensor(Eye(n), W_Uc), *reversed(layer_ops), tensor(Eye(n), W_Ec))
    slots = [[tensor(Eye(n), W_Uc)]] + [["identity"] + [tensor(A, OV) for A, _, _, OV, _ in layer] for layer in reversed(heads)]
    slots.append([tensor(Eye(n), W_Ec)])
    distributed = _distributed(slots)
    combined = expand_operator(op)
    rhs = MatAdd(*(Apply(term, t) for term in combined.args))
    steps = (
        Step(Apply(op, t), r"the row/column convention for every map: the layers as operators"),
        Step(Apply(distributed, t), "distribute the product over the sums"),
        Step(Apply(combined, t), r"the mixed product, term by term"),
        Step(rhs, r"an operator sum acts term by term"),
    )
    return lhs, rhs, steps, definitions, heads, combined


def _combine_kronecker_on_sum(combined):
    """The rewrite sympy 1.14's ``combine_kronecker`` makes on a sum: ``Σ A_i ⊗ B_i`` to
    ``(Σ A_i) ⊗ (Σ B_i)``, false. Built here, not by calling sympy, so the twin stays wrong."""
    left = MatAdd(*(term.args[0] for term in combined.args))
    right = MatAdd(*(term.args[1] for term in combined.args))
    return KroneckerProduct(left, right)


# -- zero_layer_bigram -----------------------------------------------------------------------


def _zero_layer_proof():
    t_square = MatrixSymbol("t", V, V)  # as many positions as tokens: the only size where the twin is typed
    lhs = MatMul(t, W_E, W_U)
    rhs = Apply(tensor(Eye(n), MatMul(W_Uc, W_Ec)), t)
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatMul(Eye(n), t, Transpose(MatMul(W_Uc, W_Ec))), r"the row/column convention: $W_E W_U = (W_U^c W_E^c)^\top$"),
            Step(rhs, r"definition of $\otimes$"),
        ),
        facts=CONVENTION,
        explicit_dims=DIMS,
        twins=(
            Twin("row_product_in_paper_formula", "use TransformerLens's W_E W_U as the paper's feature factor",
                 lhs, Apply(tensor(Eye(n), MatMul(W_E, W_U)), t)),
            Twin("table_acts_on_positions", "let the bigram table mix positions: (W_U^c W_E^c ⊗ I)·t (n = d_vocab)",
                 MatMul(t_square, W_E, W_U), Apply(tensor(MatMul(W_Uc, W_Ec), Eye(V)), t_square)),
        ),
    )


def _bigram_route(transposed: bool):
    """Logits of a zero-layer model read off a table: ``s * (table[t] + positions) + constant``.

    Without a norm the table is :func:`bigram_table` and ``s = 1``; with one, the norm's
    linear part (centering, gain) sits between ``W_E`` and ``W_U`` and its frozen scale ``s``
    multiplies each position.
    """

    def route(state_dict, cfg, tokens):
        require("zero_layer_bigram", ZERO_LAYERS, cfg.n_layers == 0, f"the model has {cfg.n_layers} layers")
        run = recorded_run(state_dict, cfg, tokens, "zero_layer_bigram")
        norm = run.norms[-1]
        W_E = state_dict["embed.W_E"]
        operator = frozen_norm_operator(cfg, norm, tokens.shape[1], W_E.dtype, W_E.device)
        W_U = state_dict["unembed.W_U"]
        if cfg.normalization_type is None:
            table = bigram_table(state_dict, cfg)
        else:
            table = state_dict["embed.W_E"] @ operator.features.T @ W_U
        table = table.T if transposed else table
        logits = table[tokens]
        if cfg.positional_embedding_type == "standard":
            logits = logits + state_dict["pos_embed.W_pos"][: tokens.shape[1]] @ operator.features.T @ W_U
        logits = operator.positions @ logits
        return logits + norm.constant(run.inputs[-1]) @ W_U + state_dict["unembed.b_U"]

    return route


ZERO_LAYER_BIGRAM = register(
    Identity(
        name="zero_layer_bigram",
        title="The zero-layer transformer is a bigram table",
        summary="t W_E W_U = (I ⊗ W_U W_E)·t: each position's logits depend on its own token only",
        preconditions=(ZERO_LAYERS, *PATH_MODEL),
        build_proof=_zero_layer_proof,
        transform=_bigram_route(transposed=False),
        wrong_rewrites={"table_transposed": _bigram_route(transposed=True)},
        compare=compare_logits,
    )
)


# -- one_layer_path_expansion ----------------------------------------------------------------


def _one_layer_proof():
    lhs, rhs, steps, definitions, heads, combined = _path_expansion_proof([(1, 2)])
    (A1, W_V1, W_O1, OV1, _), (A2, W_V2, W_O2, OV2, _) = heads[0]
    direct_dropped = MatAdd(*(Apply(term, t) for term in combined.args[1:]))
    row_product = MatAdd(
        Apply(tensor(Eye(n), MatMul(W_Uc, W_Ec)), t),
        *(Apply(tensor(A, MatMul(W_Uc, W_V, W_O, W_Ec)), t) for A, W_V, W_O, _, _ in heads[0]),
    )
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=steps,
        facts=tuple(definitions),
        explicit_dims=DIMS,
        twins=(
            Twin("combine_kronecker_on_sum", "sympy 1.14's combine_kronecker on the sum: (Σ A) ⊗ (Σ B)",
                 lhs, Apply(_combine_kronecker_on_sum(combined), t)),
            Twin("direct_path_dropped", ONE_LAYER_PATH_EXPANSION.describe("direct_path_dropped"),
                 lhs, direct_dropped),
            Twin("row_product_in_paper_formula", "use TransformerLens's W_V W_O inside the paper's formula",
                 lhs, row_product),
        ),
    )


def _path_sum_route(identity: str, layers: int, keep=lambda path: True):
    def route(state_dict, cfg, tokens):
        require(identity, LAYERS[layers], cfg.n_layers == layers, f"the model has {cfg.n_layers} layers")
        terms = path_terms(state_dict, cfg, tokens)
        return sum(value for path, value in terms.items() if keep(path))

    return route


ONE_LAYER_PATH_EXPANSION = register(
    Identity(
        name="one_layer_path_expansion",
        title="Path expansion of a one-layer attention-only transformer",
        summary="T = I ⊗ W_U W_E + Σ_h A^h ⊗ W_U W_OV^h W_E, exact once the patterns are fixed",
        preconditions=(LAYERS[1], *PATH_MODEL),
        build_proof=_one_layer_proof,
        transform=_path_sum_route("one_layer_path_expansion", 1),
        wrong_rewrites={
            "direct_path_dropped": WrongRewrite(
                _path_sum_route("one_layer_path_expansion", 1, lambda p: p != Path("embed")),
                "forget the direct path I ⊗ W_U W_E",
            ),
        },
        compare=compare_logits,
    )
)


# -- two_layer_path_expansion ----------------------------------------------------------------


def _two_layer_proof():
    lhs, rhs, steps, definitions, heads, combined = _path_expansion_proof([(1,), (2,)])
    (A1, _, _, OV1, _), (A2, _, _, OV2, _) = heads[0][0], heads[1][0]
    terms = list(combined.args)
    virtual = [term for term in terms if isinstance(term.args[0], MatMul)]
    assert len(virtual) == 1, combined
    without_virtual = MatAdd(*(Apply(term, t) for term in terms if term not in virtual))
    reversed_virtual = tensor(MatMul(A1, A2), MatMul(W_Uc, OV1, OV2, W_Ec))
    wrong_order = MatAdd(*(Apply(term if term not in virtual else reversed_virtual, t) for term in terms))
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=steps,
        facts=tuple(definitions),
        explicit_dims=DIMS,
        twins=(
            Twin("virtual_head_dropped", "treat two layers as a sum of one-layer paths (no virtual head)",
                 lhs, without_virtual),
            Twin("virtual_head_reversed", "compose the heads in the wrong order: A^1 A^2 ⊗ W_U W_OV^1 W_OV^2 W_E",
                 lhs, wrong_order),
            Twin("combine_kronecker_on_sum", "sympy 1.14's combine_kronecker on the sum: (Σ A) ⊗ (Σ B)",
                 lhs, Apply(_combine_kronecker_on_sum(combined), t)),
        ),
    )


TWO_LAYER_PATH_EXPANSION = register(
    Identity(
        name="two_layer_path_expansion",
        title="Path expansion of a two-layer attention-only transformer",
        summary="adds virtual heads (A^2 A^1) ⊗ W_U W_OV^2 W_OV^1 W_E to the one-layer terms of both layers",
        preconditions=(LAYERS[2], *PATH_MODEL),
        build_proof=_two_layer_proof,
        transform=_path_sum_route("two_layer_path_expansion", 2),
        wrong_rewrites={
            "virtual_heads_dropped": _path_sum_route("two_layer_path_expansion", 2, lambda p: p.order < 2),
        },
        compare=compare_logits,
    )
)


# -- qk_composition_terms --------------------------------------------------------------------


def _qk_proof():
    A = MatrixSymbol(f"{{A^{{1}}}}", n, n)
    W_V, W_O = MatrixSymbol(f"{{W_V^{{1}}}}", d, e), MatrixSymbol(f"{{W_O^{{1}}}}", e, d)
    W_Q, W_K = MatrixSymbol(f"{{W_Q^{{2}}}}", d, e), MatrixSymbol(f"{{W_K^{{2}}}}", d, e)
    OV, QK = MatrixSymbol(f"{{W_{{OV}}^{{1}}}}", d, d), MatrixSymbol(f"{{W_{{QK}}^{{2}}}}", d, d)
    x_1 = MatrixSymbol("x_1", n, d)
    lhs = MatMul(x_1, W_Q, Transpose(MatMul(x_1, W_K)))
    direct = MatMul(x_0, QK, Transpose(x_0))
    q_comp = MatMul(A, x_0, OV, QK, Transpose(x_0))
    k_comp = MatMul(x_0, QK, Transpose(OV), Transpose(x_0), Transpose(A))
    qk_comp = MatMul(A, x_0, OV, QK, Transpose(OV), Transpose(x_0), Transpose(A))
    rhs = MatAdd(direct, q_comp, k_comp, qk_comp)
    written = MatAdd(x_0, MatMul(A, x_0, W_V, W_O))
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatMul(written, W_Q, Transpose(W_K), Transpose(written)),
                 r"definition of $x_1$; $(x_1 W_K)^\top = W_K^\top x_1^\top$"),
            Step(MatAdd(MatMul(x_0, W_Q, Transpose(W_K), Transpose(x_0)),
                        MatMul(A, x_0, W_V, W_O, W_Q, Transpose(W_K), Transpose(x_0)),
                        MatMul(x_0, W_Q, Transpose(W_K), Transpose(W_O), Transpose(W_V), Transpose(x_0), Transpose(A)),
                        MatMul(A, x_0, W_V, W_O, W_Q, Transpose(W_K), Transpose(W_O), Transpose(W_V), Transpose(x_0), Transpose(A))),
                 "distribute: queries and keys each read the embedding and the first layer's head"),
            Step(rhs, r"definitions of $W_{OV}^{1}$ and $W_{QK}^{2}$: direct, Q-, K- and Q-and-K-composition"),
        ),
        facts=(
            Fact(x_1, written, "the residual stream after the first layer (one head shown)"),
            Fact(OV, MatMul(W_V, W_O), "the first head's W_OV (TransformerLens's order)"),
            Fact(QK, MatMul(W_Q, Transpose(W_K)), "the second layer's W_QK"),
        ),
        explicit_dims=DIMS,
        twins=(
            Twin("key_side_untransposed", "write the key side with W_OV instead of W_OV^T",
                 lhs, MatAdd(direct, q_comp, MatMul(x_0, QK, OV, Transpose(x_0), Transpose(A)), qk_comp)),
            Twin("no_qk_term", "forget that queries and keys can both read the first head", lhs,
                 MatAdd(direct, q_comp, k_comp)),
            Twin("key_pattern_on_the_left", "put the first head's pattern on the query side in K-composition",
                 lhs, MatAdd(direct, q_comp, MatMul(A, x_0, QK, Transpose(OV), Transpose(x_0)), qk_comp)),
        ),
    )


def _split_scores_route(dropped: tuple[str, ...]):
    """Logits with the second layer's pattern rebuilt from :func:`score_terms` (minus ``dropped``)."""

    def route(state_dict, cfg, tokens):
        require("qk_composition_terms", AT_LEAST_TWO_LAYERS, cfg.n_layers >= 2, f"the model has {cfg.n_layers}")
        groups = score_terms(state_dict, cfg, tokens, 1)
        rebuilt = _softmax_scores(sum(v for k, v in groups.items() if k not in dropped), cfg, 1)

        def heads(layer, pattern, normed):
            A = rebuilt if layer == 1 else pattern
            v = torch.einsum("bpd,hde->bphe", normed, layer_weight(state_dict, cfg, layer, "V"))
            z = torch.einsum("bhqk,bkhe->bqhe", A, v + layer_bias(state_dict, cfg, layer, "V"))
            return torch.einsum("bqhe,hed->bqd", z, state_dict[f"blocks.{layer}.attn.W_O"])

        return logits_with_heads(state_dict, cfg, tokens, heads, "qk_composition_terms")

    return route


QK_COMPOSITION_TERMS = register(
    Identity(
        name="qk_composition_terms",
        title="Q- and K-composition in the second layer's scores",
        summary="x_1 W_QK x_1^T = direct + Q-composition + K-composition + both, with x_1 = x_0 + A x_0 W_OV",
        preconditions=(AT_LEAST_TWO_LAYERS, *PATH_MODEL, NO_QK_NORM),
        build_proof=_qk_proof,
        transform=_split_scores_route(()),
        wrong_rewrites={"k_composition_dropped": _split_scores_route(("k_composition",))},
        compare=compare_logits,
    )
)


# -- virtual_weights -------------------------------------------------------------------------


def _virtual_weights_proof():
    r_A, r_C = MatrixSymbol("r_A", n, e), MatrixSymbol("r_C", n, e)
    W_OA, W_OC = MatrixSymbol("{W_O^{A}}", e, d), MatrixSymbol("{W_O^{C}}", e, d)
    W_IB = MatrixSymbol("{W_I^{B}}", d, f)
    V_AB, V_CB = MatrixSymbol("{V^{AB}}", e, f), MatrixSymbol("{V^{CB}}", e, f)
    x_1, x_2 = MatrixSymbol("x_1", n, d), MatrixSymbol("x_2", n, d)
    lhs = MatMul(x_2, W_IB)
    rhs = MatAdd(MatMul(x_0, W_IB), MatMul(r_A, V_AB), MatMul(r_C, V_CB))
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatMul(MatAdd(x_0, MatMul(r_A, W_OA), MatMul(r_C, W_OC)), W_IB),
                 "unfold the residual stream: it is the sum of everything written to it"),
            Step(MatAdd(MatMul(x_0, W_IB), MatMul(r_A, W_OA, W_IB), MatMul(r_C, W_OC, W_IB)), "distribute"),
            Step(rhs, r"definition of the virtual weights $V^{AB} = W_O^A W_I^B$"),
        ),
        facts=(
            Fact(x_1, MatAdd(x_0, MatMul(r_A, W_OA)), "layer A adds its output r_A W_O^A"),
            Fact(x_2, MatAdd(x_1, MatMul(r_C, W_OC)), "layer C adds its output r_C W_O^C"),
            Fact(V_AB, MatMul(W_OA, W_IB), "virtual weight from writer A to reader B (the paper's W_I^B W_O^A, transposed)"),
            Fact(V_CB, MatMul(W_OC, W_IB), "virtual weight from writer C to reader B"),
        ),
        explicit_dims=DIMS,
        twins=(
            Twin("previous_layer_only", VIRTUAL_WEIGHTS.describe("previous_layer_only"),
                 lhs, MatMul(r_C, V_CB)),
            Twin("embedding_forgotten", "forget that the embedding stays in the stream", lhs,
                 MatAdd(MatMul(r_A, V_AB), MatMul(r_C, V_CB))),
        ),
    )


def _virtual_weights_route(previous_only: bool):
    """Logits where every reader (``W_V`` of each layer, ``W_U``) sees each earlier write through
    a virtual weight: ``s * Σ_writes r (W_O N W_I) + b W_I`` with the frozen norm's linear part ``N``.

    With ``previous_only`` a reader sees only the writes of the layer just before it (or the
    embedding, for the first layer): the ``previous_layer_only`` twin.
    """

    def route(state_dict, cfg, tokens):
        run = recorded_run(state_dict, cfg, tokens, "virtual_weights")
        dtype, device = state_dict["embed.W_E"].dtype, state_dict["embed.W_E"].device
        positions = tokens.shape[1]
        identity = torch.eye(cfg.d_model, dtype=dtype, device=device)
        embedding = sum(embedding_terms(state_dict, cfg, tokens).values())
        ones = torch.ones(*embedding.shape[:2], 1, dtype=dtype, device=device)
        writes = [(-1, embedding, identity)]  # (layer, r [b, p, *w, a], writer [*w, a, d_model])

        def read(layer, reader):
            """What ``reader [*r, d_model, b]`` sees: ``[b, p, *r, b]`` (``layer`` -1: the unembed)."""
            norm = run.norms[layer]
            operator = frozen_norm_operator(cfg, norm, positions, dtype, device)
            total = 0
            for source, r, writer in writes:
                if previous_only and source != (layer if layer >= 0 else cfg.n_layers) - 1:
                    continue
                weights = virtual_weights(writer @ operator.features.T, reader)  # [*w, *r, a, b]
                w_axes = writer.ndim - 2
                letters = "ghij"[:w_axes]
                r_axes = reader.ndim - 2
                r_letters = "uvw"[:r_axes]
                out = torch.einsum(f"bp{letters}a,{letters}{r_letters}ac->bp{r_letters}c", r, weights)
                total = total + out
            if norm.kind is not None:
                total = total * norm.scale.reshape(*norm.scale.shape[:2], *([1] * (reader.ndim - 2)), 1)
            return total + torch.einsum("bpd,...dc->bp...c", norm.constant(embedding), reader)

        for layer in range(cfg.n_layers):
            W_V = layer_weight(state_dict, cfg, layer, "V")
            values = read(layer, W_V) + layer_bias(state_dict, cfg, layer, "V")  # [b, p, heads, e]
            z = torch.einsum("bhqk,bkhe->bqhe", run.patterns[layer], values)
            writes.append((layer, z, state_dict[f"blocks.{layer}.attn.W_O"]))
            writes.append((layer, ones, state_dict[f"blocks.{layer}.attn.b_O"][None]))
        return read(-1, state_dict["unembed.W_U"]) + state_dict["unembed.b_U"]

    return route


VIRTUAL_WEIGHTS = register(
    Identity(
        name="virtual_weights",
        title="The residual stream and virtual weights",
        summary="x W_I^B = x_0 W_I^B + Σ_A r_A (W_O^A W_I^B): a reader sees every earlier writer through a virtual weight",
        preconditions=PATH_MODEL,
        build_proof=_virtual_weights_proof,
        transform=_virtual_weights_route(previous_only=False),
        wrong_rewrites={
            "previous_layer_only": WrongRewrite(
                _virtual_weights_route(previous_only=True), "a layer reads only the layer before it"),
        },
        compare=compare_logits,
    )
)
