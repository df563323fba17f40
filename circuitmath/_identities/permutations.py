"""Symmetries of the heads and the neurons: permuting the heads of a layer, the neurons of an MLP.

Symbols (row-vector convention; ``n`` positions, ``d`` = d_model, ``e`` = d_head, ``m`` =
d_mlp; ``k`` the columns of the free test matrices ``T``): as in :mod:`.rotation`, several
conclusions are proved at once as one equality of sums whose terms each end in their own test
matrix. ``P`` ``[m, m]`` is a permutation matrix (``P P^T = I``), sampled as a random permutation
that is not its own inverse. Under OLMo-2's QK-norm over the whole projection (the lemma
``projection_qk_norm``), ``x_i``, ``x_j`` ``[1, d]`` are what the projections read at a query and a
key position, ``\\rho_i``, ``\\rho_j`` the projections' normalisers, ``g_{Q,h}``, ``g_{K,j}``
``[e, 1]`` the gains of head ``h``'s and key/value head ``j``'s entries, ``P_i``, ``P_j`` ``[e, e]``
the rotary rotations.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import sympy
import torch
from sympy import DiagMatrix, Identity as Eye, MatAdd, MatMul, MatrixSymbol, Symbol, Transpose

from .._errors import Precondition
from .._processing import permute_heads, permute_neurons
from .._processing._common import DENSE_MLP
from .._processing.rotation import (
    A_HEAD_PERMUTATION, A_NEURON_PERMUTATION, GROUPS_MOVE_TOGETHER, HAS_MLPS, HEADS_SEE_POSITIONS_ALIKE,
    recover_head_permutation, recover_neuron_permutation,
)
from .._proof import Fact, Proof, Step, Twin
from .._registry import MOVES_ENTRIES, NOTHING_SHOWN, Identity, WrongRewrite, register
from .._state import attention_names
from .rotation import F, W_gate, W_in, W_out, b_in, d, e, forgetting, free_matrix, k, m, n, ones_n

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "rotation"


# -- the heads of a layer ---------------------------------------------------------------------

Xn = MatrixSymbol(r"\hat{X}", n, d)  # the normed stream every head reads
HEADS, GROUPS = (1, 2, 3, 4), (1, 2)
GROUP = {1: 1, 2: 1, 3: 2, 4: 2}  # grouped-query attention: two query heads per key/value head
HEAD_MOVE = {1: 3, 2: 4, 3: 2, 4: 1}  # slot i holds head HEAD_MOVE[i]
GROUP_MOVE = {1: 2, 2: 1}  # so slot group j holds key/value head GROUP_MOVE[j]
PQ = {h: (MatrixSymbol(f"W_{{Q,{h}}}", d, e), MatrixSymbol(f"b_{{Q,{h}}}", 1, e)) for h in HEADS}
PK = {j: (MatrixSymbol(f"W_{{K,{j}}}", d, e), MatrixSymbol(f"b_{{K,{j}}}", 1, e)) for j in GROUPS}
PV = {j: (MatrixSymbol(f"W_{{V,{j}}}", d, e), MatrixSymbol(f"b_{{V,{j}}}", 1, e)) for j in GROUPS}
PO = {h: MatrixSymbol(f"W_{{O,{h}}}", e, d) for h in HEADS}
PA = {h: MatrixSymbol(f"A_{h}", n, n) for h in HEADS}
PS = {h: MatrixSymbol(f"S_{h}", n, n) for h in HEADS}
PT = {h: free_matrix(f"T_{h}", n) for h in HEADS}
T_out = free_matrix(r"T_{out}", d)


def _affine(weight_bias):
    weight, bias = weight_bias
    return MatAdd(MatMul(Xn, weight), MatMul(ones_n, bias))


def _heads_claim(query_of, key_of, value_of, output_of, pattern_of):
    """Each slot's scores times its test matrix, plus the layer's output: slot ``i`` uses the
    queries of head ``query_of(i)``, the keys and values of key/value heads ``key_of(i)``,
    ``value_of(i)``, the output map of head ``output_of(i)`` and the pattern ``pattern_of(i)``."""
    scores = [MatMul(_affine(PQ[query_of(i)]), Transpose(_affine(PK[key_of(i)])), PT[i]) for i in HEADS]
    output = MatAdd(*(MatMul(PA[pattern_of(i)], _affine(PV[value_of(i)]), PO[output_of(i)]) for i in HEADS))
    return MatAdd(*scores, MatMul(output, T_out))


def _heads_proof() -> Proof:
    return dataclasses.replace(_plain_heads_proof(), lemmas=(("projection_qk_norm", _projection_qk_norm_proof()),))


def _plain_heads_proof() -> Proof:
    moved = lambda i: HEAD_MOVE[i]  # noqa: E731
    slot_group = lambda i: GROUP_MOVE[GROUP[i]]  # noqa: E731
    rhs = MatAdd(*(MatMul(PS[HEAD_MOVE[i]], PT[i]) for i in HEADS),
                 MatMul(MatAdd(*(MatMul(PA[h], _affine(PV[GROUP[h]]), PO[h]) for h in HEADS)), T_out))
    return Proof(
        lhs=_heads_claim(moved, slot_group, slot_group, moved, moved),
        rhs=rhs,
        steps=(
            Step(MatAdd(*(MatMul(PS[HEAD_MOVE[i]], PT[i]) for i in HEADS),
                        MatMul(MatAdd(*(MatMul(PA[HEAD_MOVE[i]], _affine(PV[GROUP[HEAD_MOVE[i]]]), PO[HEAD_MOVE[i]])
                                        for i in HEADS)), T_out)),
                 r"slot $i$ holds head $\pi(i)$ and its group's keys and values: $\sigma(g(i)) = g(\pi(i))$, so its"
                 r" scores are $S_{\pi(i)}$ and its pattern $A_{\pi(i)}$"),
            Step(rhs, r"a sum does not depend on the order of its terms"),
        ),
        facts=tuple(
            Fact(PS[h], MatMul(_affine(PQ[h]), Transpose(_affine(PK[GROUP[h]]))),
                       f"head {h}'s scores; A_{h} is their masked row softmax")
            for h in HEADS
        ),
        explicit_dims={n: 2, d: 2, e: 2, k: 1},
        assumptions=(
            "four query heads in two groups ({1, 2} read key/value head 1, {3, 4} head 2); the permutation"
            " pi = (3, 4, 2, 1) moves whole groups (sigma = (2, 1)) and reorders inside them",
            "without grouped-query attention every head is its own group; any number of heads works alike",
        ),
        twins=(
            Twin("keys_not_permuted", PERMUTE_HEADS.describe("keys_not_permuted"),
                 _heads_claim(moved, lambda i: GROUP[i], slot_group, moved, moved), rhs),
            Twin("output_not_permuted", PERMUTE_HEADS.describe("output_not_permuted"),
                 _heads_claim(moved, slot_group, slot_group, lambda i: i, moved), rhs),
            Twin("query_heads_leave_their_group", "grouped-query attention: move query heads across groups, the shared key/value heads stay",
                 _heads_claim(lambda i: {1: 3, 2: 1, 3: 2, 4: 4}[i], lambda i: GROUP[i], lambda i: GROUP[i],
                              lambda i: {1: 3, 2: 1, 3: 2, 4: 4}[i], lambda i: {1: 3, 2: 1, 3: 2, 4: 4}[i]),
                 MatAdd(*(MatMul(PS[{1: 3, 2: 1, 3: 2, 4: 4}[i]], PT[i]) for i in HEADS),
                        MatMul(MatAdd(*(MatMul(PA[h], _affine(PV[GROUP[h]]), PO[h]) for h in HEADS)), T_out))),
        ),
    )


# -- the heads under a QK-norm over the whole projection (OLMo-2) -----------------------------

x_i, x_j = MatrixSymbol("x_i", 1, d), MatrixSymbol("x_j", 1, d)  # what the projections read at positions i, j
rho_i, rho_j = Symbol(r"\rho_i", positive=True), Symbol(r"\rho_j", positive=True)
P_i, P_j = MatrixSymbol("P_i", e, e), MatrixSymbol("P_j", e, e)
GQ = {h: MatrixSymbol(f"g_{{Q,{h}}}", e, 1) for h in HEADS}
GK = {j: MatrixSymbol(f"g_{{K,{j}}}", e, 1) for j in GROUPS}
TS = {h: free_matrix(f"T_{{s,{h}}}", 1) for h in HEADS}
T_q, T_k = free_matrix("T_q", 1), free_matrix("T_k", 1)


def _projected(weight_bias, x):
    weight, bias = weight_bias
    return MatAdd(MatMul(x, weight), bias)


def _normed_claim(slots, key_slots):
    """The query projection's sum of squares at position ``i`` (times ``T_q``), the key
    projection's at ``j`` (times ``T_k``), and each query slot's score of ``i`` on ``j`` (times
    ``T_{s,i}``). ``slots`` gives, per query slot, ``(query head, query gain, key/value head, key
    gain)`` it holds; ``key_slots`` the key/value head in each key slot."""
    q = {h: _projected(PQ[h], x_i) for h in HEADS}
    k_ = {j: _projected(PK[j], x_j) for j in GROUPS}
    squares = [MatMul(MatAdd(*(MatMul(q[h], Transpose(q[h])) for h, *_rest in slots)), T_q),
               MatMul(MatAdd(*(MatMul(k_[j], Transpose(k_[j])) for j in key_slots)), T_k)]
    scores = [MatMul(rho_i, q[h], DiagMatrix(GQ[gq]), P_i, Transpose(MatMul(rho_j, k_[j], DiagMatrix(GK[gk]), P_j)), TS[s])
              for s, (h, gq, j, gk) in zip(HEADS, slots)]
    return MatAdd(*squares, *scores)


def _projection_qk_norm_proof() -> Proof:
    """The queries and keys of :func:`_plain_heads_proof`'s permuted heads under OLMo-2's QK-norm:
    one RMSNorm over each whole projection, a gain per entry, then the rotary embedding."""
    pi, sigma = HEAD_MOVE.__getitem__, lambda s: GROUP_MOVE[GROUP[s]]  # query slot s, the key slot it reads
    claim = _normed_claim([(pi(s), pi(s), sigma(s), sigma(s)) for s in HEADS], [GROUP_MOVE[j] for j in GROUPS])
    rhs = _normed_claim([(pi(s), pi(s), GROUP[pi(s)], GROUP[pi(s)]) for s in HEADS], list(GROUPS))
    describe = PERMUTE_HEADS.describe
    return Proof(
        lhs=claim,
        rhs=rhs,
        steps=(
            Step(rhs, r"the sums of squares are the same terms in another order, so the normalisers $\rho_i$,"
                      r" $\rho_j$ are the same; slot $s$ holds head $\pi(s)$ with its gain $g_{Q,\pi(s)}$, and the"
                      r" key slot it reads holds key/value head $\sigma(g(s)) = g(\pi(s))$ with its gain"),),
        explicit_dims={d: 2, e: 2, k: 1},
        assumptions=(
            "x_i, x_j: what the projections read at query position i and key position j (the stream itself in"
            " OLMo-2, which has no norm before attention)",
            "rho_i, rho_j: the normalisers of the whole query projection at position i and of the whole key"
            " projection at j, each (s / N + eps)^(-1/2) for that projection's sum of squares s over its N entries:"
            " d_head times the number of query heads, or of key/value heads for the keys, whose repetition over a"
            " group's query heads keeps their mean square. A function of s only; the first two conclusions show"
            " the permuted model's sums equal to the original's, so its normalisers are the same",
            "the gain multiplies each entry after the normaliser; P_i, P_j are the rotary rotations of positions i"
            " and j, the same for every head (the identity without rotary embeddings)",
            "four query heads in two groups ({1, 2} read key/value head 1, {3, 4} head 2); the permutation"
            " pi = (3, 4, 2, 1) moves whole groups (sigma = (2, 1)); any number of heads works alike",
            "the values, W_O and the patterns move as in permute_heads' own proof: the QK-norm acts on queries"
            " and keys only",
        ),
        twins=(
            Twin("qk_norm_gains_not_permuted", describe("qk_norm_gains_not_permuted"),
                 _normed_claim([(pi(s), s, sigma(s), GROUP[s]) for s in HEADS], [GROUP_MOVE[j] for j in GROUPS]), rhs),
            Twin("key_norm_gains_not_permuted", "move the heads and the query gains, leave the key projection's gains"
                 " in place: each key slot's entries are scaled by another key/value head's gain",
                 _normed_claim([(pi(s), pi(s), sigma(s), GROUP[s]) for s in HEADS], [GROUP_MOVE[j] for j in GROUPS]), rhs),
            Twin("keys_not_permuted", describe("keys_not_permuted") + ", the key gains moved with the heads",
                 _normed_claim([(pi(s), pi(s), GROUP[s], sigma(s)) for s in HEADS], list(GROUPS)), rhs),
        ),
    )


# -- the neurons of an MLP --------------------------------------------------------------------

Pm = MatrixSymbol("P", m, m)
Xm = MatrixSymbol(r"\hat{X}", n, d)
T_in, T_gate, T_mlp = free_matrix(r"T_{in}", m), free_matrix(r"T_{gate}", m), free_matrix(r"T_{out}", d)


def _neurons_claim(*, bias=True, gate=True, out=Pm.T):
    pre = MatAdd(MatMul(Xm, W_in, Pm), MatMul(ones_n, b_in, Pm) if bias else MatMul(ones_n, b_in))
    gated = MatMul(Xm, W_gate, Pm) if gate else MatMul(Xm, W_gate)
    return MatAdd(MatMul(pre, T_in), MatMul(gated, T_gate), MatMul(F, Pm, *([out] if out is not None else []), W_out, T_mlp))


def _permutation(rng, shape):
    """A random permutation matrix that is not its own inverse (for ``size >= 3``)."""
    size = shape[0]
    order = list(range(size))
    while True:
        rng.shuffle(order)
        if size < 3 or any(order[order[i]] != i for i in range(size)):
            break
    return sympy.Matrix(size, size, lambda i, j: 1 if order[j] == i else 0)


def _neurons_proof() -> Proof:
    rhs = MatAdd(MatMul(MatAdd(MatMul(Xm, W_in), MatMul(ones_n, b_in)), Pm, T_in), MatMul(Xm, W_gate, Pm, T_gate),
                 MatMul(F, W_out, T_mlp))
    return Proof(
        lhs=_neurons_claim(),
        rhs=rhs,
        steps=(
            Step(MatAdd(MatMul(MatAdd(MatMul(Xm, W_in), MatMul(ones_n, b_in)), Pm, T_in), MatMul(Xm, W_gate, Pm, T_gate),
                        MatMul(F, Pm, Pm.T, W_out, T_mlp)),
                 r"factor $P$ out of the pre-activations: they are permuted, so the activations are $F P$"),
            Step(rhs, r"$P P^\top = I$"),
        ),
        facts=(Fact(MatMul(Pm, Pm.T), Eye(m), "P is a permutation matrix: P P^T = I"),),
        samplers={Pm: _permutation},
        explicit_dims={n: 2, d: 2, m: 3, k: 1},
        assumptions=(
            "the activation (and the gate's product) acts entry by entry, so act(Y P) = act(Y) P for a"
            " permutation matrix P: F is the original activations, F P the permuted model's",
        ),
        twins=(
            Twin("bias_not_permuted", PERMUTE_NEURONS.describe("bias_not_permuted"),
                 _neurons_claim(bias=False), rhs),
            Twin("gate_not_permuted", "gated MLP: permute W_in but not W_gate", _neurons_claim(gate=False), rhs),
            Twin("out_not_permuted", PERMUTE_NEURONS.describe("out_not_permuted"),
                 _neurons_claim(out=None), rhs),
            Twin("out_by_P", "permute W_out's rows by P instead of P^T (a cycle of three is not its own inverse)",
                 _neurons_claim(out=Pm), rhs),
        ),
    )


# -- numeric checks ---------------------------------------------------------------------------

def _reversed(size):
    return torch.arange(size - 1, -1, -1, device="cpu")


def _permute_heads(state_dict, cfg):
    return permute_heads(state_dict, cfg, _reversed(cfg.n_heads))


def _heads_but(kept):
    """Permute the heads, then put back the tensors ``kept(cfg, layer)`` names."""
    return forgetting(_permute_heads, lambda cfg: [name for layer in range(cfg.n_layers) for name in kept(cfg, layer)])


def _qk_norm_gains_kept(state_dict, cfg):
    """Move every head, but leave the gains of a QK-norm over the whole projection in place."""
    spans = cfg.qk_norm and cfg.qk_norm_over == "projection"  # per head, one gain serves every head
    return _heads_but(lambda cfg, l: [f"blocks.{l}.attn.{side}_norm.w" for side in "qk"] if spans else [])(state_dict, cfg)


def _permute_neurons(state_dict, cfg):
    return permute_neurons(state_dict, cfg, _reversed(cfg.d_mlp or 0))  # attention-only: refused


def _neurons_but(leaf):
    """Permute the neurons, then put back every layer's ``mlp.<leaf>``."""
    return forgetting(_permute_neurons, lambda cfg: [f"blocks.{layer}.mlp.{leaf}" for layer in range(cfg.n_layers)])


ENTRYWISE_ACTIVATION = Precondition("the activation (and the gate) acts entry by entry")

PERMUTE_HEADS = register(
    Identity(
        title="Permuting the heads of a layer",
        summary="a layer's output is the sum of its heads: any order gives the same sum, each head moving"
        " its W_Q, W_K, W_V, W_O and biases together; with grouped-query attention whole groups move",
        preconditions=(A_HEAD_PERMUTATION, GROUPS_MOVE_TOGETHER, HEADS_SEE_POSITIONS_ALIKE),
        public=permute_heads,
        check_note="the permutation is recovered from the tensors and verified on every tensor",
        build_proof=_heads_proof,
        transform=_permute_heads,
        postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "keys_not_permuted": WrongRewrite(
                _heads_but(
                lambda cfg, l: [f"blocks.{l}.attn.{n}" for n in attention_names(cfg, "K")[:2]]),
                "move the query heads and W_O, leave the keys in place",
            ),
            "output_not_permuted": WrongRewrite(
                _heads_but(lambda cfg, l: [f"blocks.{l}.attn.W_O"]),
                "move every head's W_Q, W_K, W_V but not its W_O",
            ),
            "qk_norm_gains_not_permuted": WrongRewrite(  # OLMo-2: a gain per entry of the projection
                _qk_norm_gains_kept, differs_on=lambda cfg: cfg.qk_norm and cfg.qk_norm_over == "projection",
            ),
        },
        recover=partial(recover_head_permutation, verify_all=False),  # the rest may be another step's
        with_parameters=permute_heads, wrong_rewrites_recovered=False, permutes="heads",
        half_precision=MOVES_ENTRIES,
    )
)

PERMUTE_NEURONS = register(
    Identity(
        title="Permuting the neurons of an MLP",
        summary="f(x W_in P + b_in P) P^T W_out = f(x W_in + b_in) W_out for a permutation P: the"
        " activation acts entry by entry; W_gate moves with W_in",
        preconditions=(HAS_MLPS, DENSE_MLP, A_NEURON_PERMUTATION, ENTRYWISE_ACTIVATION),
        public=permute_neurons,
        check_note="the permutation is recovered from the tensors and verified on every tensor",
        build_proof=_neurons_proof,
        transform=_permute_neurons,
        postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "bias_not_permuted": WrongRewrite(_neurons_but("b_in"), "permute W_in's columns but not b_in"),
            "out_not_permuted": WrongRewrite(_neurons_but("W_out"), "permute W_in but not W_out's rows"),
        },
        recover=partial(recover_neuron_permutation, verify_all=False),
        with_parameters=permute_neurons, wrong_rewrites_recovered=False, permutes="neurons",
        half_precision=MOVES_ENTRIES,
    )
)
