"""The symmetry of a mixture-of-experts MLP, and the router as a reader of the normalised stream.

Symbols (row-vector convention, one position at a time; ``d`` = d_model, ``E`` = n_experts):

- ``L = x W_router + b_router`` ``[1, E]`` the router's logits on the normalised stream ``x``;
- ``g(L)`` ``[1, E]`` the routing weights: the softmax of ``L`` kept on its ``k`` largest entries
  (renormalised or not) and zero elsewhere; ``G = g(L)``;
- ``Y`` ``[E, d]`` the experts' outputs on ``x``, row ``e`` expert ``e``'s; the MLP writes ``G Y``
  (plus a shared expert, which no router chooses and no permutation moves);
- ``P`` ``[E, E]`` a permutation matrix (``P P^T = I``), sampled as a random permutation that is
  not its own inverse: new expert ``i`` is old expert ``perm[i]``, so the router's logits become
  ``L P`` and the experts' outputs ``P^T Y``.

Top-k routing is permutation-equivariant, ``g(L P) = g(L) P``: the softmax acts on each entry
with a sum over all of them, and the ``k`` largest entries of ``L P`` are those of ``L``, moved
by ``P``, when the ``k``-th and ``(k+1)``-th largest differ (a tie is broken by index, which
``P`` changes). The proof takes it as a fact; ``tests/test_moe.py`` checks it on every
permutation of ``E <= 5`` experts for every ``k``, and that a tie breaks it.
"""

from __future__ import annotations

import torch
from sympy import Identity as Eye, MatMul, MatrixSymbol

from .._processing.experts import AN_EXPERT_PERMUTATION, HAS_EXPERTS, permute_experts, recover_expert_permutation
from .._proof import Fact, Proof, Step, Twin
from .._registry import MOVES_ENTRIES, NOTHING_SHOWN, Identity, WrongRewrite, register
from .._moe import EXPERT_LEAVES, expert_names, routers
from ._circuit_checks import dim
from .permutations import _permutation
from .rotation import forgetting

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "quantisation"


d, E = dim("d"), dim("E")
P = MatrixSymbol("P", E, E)
G = MatrixSymbol("G", 1, E)  # g(L): the routing weights
G_moved = MatrixSymbol("G'", 1, E)  # g(L P): the routing weights of the permuted router
G_back = MatrixSymbol("G''", 1, E)  # g(L P^T): the router permuted the other way
Y = MatrixSymbol("Y", E, d)
EQUIVARIANT = "top-k routing is permutation-equivariant (the k-th and (k+1)-th largest logits differ)"


def _experts_proof() -> Proof:
    rhs = MatMul(G, Y)
    return Proof(
        lhs=MatMul(G_moved, P.T, Y),
        rhs=rhs,
        steps=(
            Step(MatMul(G, P, P.T, Y), r"$g(L P) = g(L) P$: the routing weights move with the router's columns"),
            Step(rhs, r"$P P^\top = I$"),
        ),
        facts=(
            Fact(G_moved, MatMul(G, P), f"g(L P) = g(L) P: {EQUIVARIANT}"),
            Fact(G_back, MatMul(G, P.T), f"g(L P^T) = g(L) P^T: {EQUIVARIANT}"),
            Fact(MatMul(P, P.T), Eye(E), "P is a permutation matrix: P P^T = I"),
        ),
        samplers={P: _permutation},
        explicit_dims={d: 2, E: 3},
        assumptions=(
            "each expert's tensors move together, so its output moves with it: the experts write P^T Y",
            "g(L P) = g(L) P for distinct logits (the k largest of L P are those of L, moved by P; the"
            " softmax is a function of each entry and the sum of all); checked on every permutation of"
            " up to 5 experts for every k (tests/test_moe.py)",
        ),
        twins=(
            Twin("router_not_permuted", PERMUTE_EXPERTS.describe("router_not_permuted"),
                 MatMul(G, P.T, Y), rhs),
            Twin("experts_not_permuted", PERMUTE_EXPERTS.describe("experts_not_permuted"),
                 MatMul(G_moved, Y), rhs),
            Twin("router_by_inverse", PERMUTE_EXPERTS.describe("router_by_inverse"),
                 MatMul(G_back, P.T, Y), rhs),
        ),
    )


def _shift(cfg) -> torch.Tensor:
    """The numeric check's permutation: every expert one place on (not its own inverse for 3+ experts)."""
    return torch.roll(torch.arange(cfg.n_experts or 1, device="cpu"), 1)


def _permute(state_dict, cfg):
    return permute_experts(state_dict, cfg, _shift(cfg))


def _experts(cfg) -> list[str]:
    return [f"{expert}.{leaf}" for layer in range(cfg.n_layers) for expert in expert_names(cfg, f"blocks.{layer}.mlp")
            for leaf in EXPERT_LEAVES]


def _router_by_inverse(state_dict, cfg):
    """Permute the experts, and the router's columns by the inverse permutation."""
    out, new_cfg = _permute(state_dict, cfg)
    inverse = torch.argsort(_shift(cfg))
    for name in routers(cfg):
        out[name] = state_dict[name].index_select(-1, inverse.to(state_dict[name].device))
    return out, new_cfg


PERMUTE_EXPERTS = register(
    Identity(
        title="Permuting the experts of a mixture-of-experts MLP",
        summary="g(L P) P^T Y = g(L) Y for a permutation P: top-k routing is permutation-equivariant, so"
        " the experts may be reordered with the router's columns",
        preconditions=(HAS_EXPERTS, AN_EXPERT_PERMUTATION),
        public=permute_experts,
        check_note="the permutation is recovered from the experts' output maps and verified on every tensor",
        build_proof=_experts_proof,
        transform=_permute,
        postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "router_not_permuted": WrongRewrite(
                forgetting(_permute, routers), "move the experts, leave the router's columns in place"),
            "experts_not_permuted": WrongRewrite(
                forgetting(_permute, _experts), "move the router's columns, leave the experts in place"),
            "router_by_inverse": WrongRewrite(
                _router_by_inverse,
                "move the router's columns by P^T (a cycle of three is not its own inverse)",
                differs_on=lambda cfg: (cfg.n_experts or 0) >= 3,
            ),
        },
        recover=recover_expert_permutation,
        with_parameters=permute_experts,
        half_precision=MOVES_ENTRIES,
    )
)
