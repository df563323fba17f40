"""Which rotations of a head's query/key space commute with a rotary embedding, partial or
interleaved: a rotation that turns each rotary pair within itself (``[[a, b], [-b, a]]``) and the
dimensions past ``rotary_dim`` among themselves (any orthogonal ``M``).

Symbols (``h`` = rotary_dim / 2 pairs, ``r`` = d_head - rotary_dim dimensions left unrotated,
``e = 2 h + r`` = d_head):

- ``E_1``, ``E_2`` ``[h, e]`` select the first and the second dimension of each pair, ``E_3``
  ``[r, e]`` the rest: rows of the identity, so ``E_a E_b^T`` is ``I`` for ``a = b`` and ``0``
  otherwise. The layout lives in them and nowhere else: GPT-NeoX pairs dimension ``i`` with
  ``i + h`` (``E_1`` the first ``h`` rows of ``I_e``, ``E_2`` the next ``h``), GPT-J interleaves,
  pairing ``2 i`` with ``2 i + 1``; the proof holds for either (its instances draw both);
- ``P = E_1^T C E_1 + E_2^T C E_2 + E_1^T S E_2 - E_2^T S E_1 + E_3^T E_3`` the rotary rotation
  of one relative position, ``C = diag(cos theta)``, ``S = diag(sin theta)``, one angle per pair;
- ``R`` the rotation of the query/key space, built the same way from ``A = diag(a)``,
  ``B = diag(b)`` and ``M`` ``[r, r]``.

Scores are ``q P k^T`` with the queries and keys rotated by position between ``W_Q`` and ``W_K``;
``W_Q R``, ``W_K R`` give ``q R P R^T k^T``, which is ``q P k^T`` for every position when
``R P = P R`` (and ``R R^T = I``).
"""

from __future__ import annotations

import dataclasses

import sympy
import torch
from sympy import DiagMatrix, MatAdd, MatMul, MatrixSymbol, ZeroMatrix, Identity as Eye

from .._errors import NOT_APPLIED, Precondition
from .._processing._common import NO_QK_NORM, require
from .._processing.quantisation import COMMUTES_WITH_ROTARY, nearest_commuting, rotate_heads
from .._proof import Fact, Proof, Step, Twin
from .._registry import COMPUTES, NOTHING_SHOWN, Identity, WrongRewrite, register
from ._circuit_checks import dim

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "quantisation"

h, r = dim("h"), dim("r")
e = 2 * h + r
E1, E2, F1, F2 = (MatrixSymbol(name, h, e) for name in ("E_1", "E_2", "F_1", "F_2"))
E3 = MatrixSymbol("E_3", r, e)
cos_, sin_, a, b = (MatrixSymbol(name, h, 1) for name in ("c", "s", "a", "b"))
M, G = MatrixSymbol("M", r, r), MatrixSymbol("G", h, r)
P, R = MatrixSymbol("P", e, e), MatrixSymbol("R", e, e)
LAYOUTS = ("neox", "interleaved")


def _turning(first, second, cosine, sine, rest) -> MatAdd:
    """``first^T C first + second^T C second + first^T S second - second^T S first + E_3^T rest E_3``."""
    C, S = DiagMatrix(cosine), DiagMatrix(sine)
    return MatAdd(MatMul(first.T, C, first), MatMul(second.T, C, second), MatMul(first.T, S, second),
                  MatMul(-1, second.T, S, first), MatMul(E3.T, rest, E3) if rest is not None else MatMul(E3.T, E3))


def _selector(layout: str, which: str):
    """A sampler drawing ``E_1`` (``which="first"``), ``E_2`` (``"second"``) or ``E_3`` (``"rest"``)
    of ``layout`` as rows of the identity (``rng.dims`` gives ``h`` and ``r``)."""
    def draw(rng, shape):
        pairs = rng.dims[h]
        if which == "rest":
            columns = range(2 * pairs, 2 * pairs + rng.dims[r])
        else:
            second = which == "second"
            columns = [i + second * pairs if layout == "neox" else 2 * i + second for i in range(pairs)]
        rows = sympy.zeros(*shape)
        for row, column in enumerate(columns):
            rows[row, column] = 1
        return rows
    return draw


def _orthogonality_facts(first, second) -> tuple[Fact, ...]:
    zero_h, zero_hr, zero_rh = ZeroMatrix(h, h), ZeroMatrix(h, r), ZeroMatrix(r, h)
    return (
        Fact(MatMul(first, first.T), Eye(h), f"{first.name} selects distinct rows of the identity"),
        Fact(MatMul(second, second.T), Eye(h), f"{second.name} selects distinct rows of the identity"),
        Fact(MatMul(first, second.T), zero_h, f"{first.name} and {second.name} select different dimensions"),
        Fact(MatMul(second, first.T), zero_h, f"{second.name} and {first.name} select different dimensions"),
        Fact(MatMul(first, E3.T), zero_hr, f"the pairs of {first.name} are rotary, E_3's dimensions are not"),
        Fact(MatMul(E3, first.T), zero_rh, f"the pairs of {first.name} are rotary, E_3's dimensions are not"),
        Fact(MatMul(second, E3.T), zero_hr, f"the pairs of {second.name} are rotary, E_3's dimensions are not"),
        Fact(MatMul(E3, second.T), zero_rh, f"the pairs of {second.name} are rotary, E_3's dimensions are not"),
    )


def _commuting_proof(layout: str) -> Proof:
    C, S, A, B = (DiagMatrix(v) for v in (cos_, sin_, a, b))
    R_wrong_layout = _turning(F1, F2, a, b, M)
    reflection = MatAdd(MatMul(E1.T, A, E1), MatMul(-1, E2.T, A, E2), MatMul(E1.T, B, E2), MatMul(E2.T, B, E1),
                        MatMul(E3.T, M, E3))
    mixing = MatAdd(R, MatMul(E1.T, G, E3))
    other = "interleaved" if layout == "neox" else "neox"
    blocks = [MatMul(E1.T, A, C, E1), MatMul(E2.T, A, C, E2), MatMul(E1.T, A, S, E2), MatMul(-1, E2.T, A, S, E1),
              MatMul(E1.T, B, C, E2), MatMul(-1, E1.T, B, S, E1), MatMul(-1, E2.T, B, C, E1), MatMul(-1, E2.T, B, S, E2),
              MatMul(E3.T, M, E3)]
    swapped = [MatMul(E1.T, C, A, E1), MatMul(E2.T, C, A, E2), MatMul(E1.T, S, A, E2), MatMul(-1, E2.T, S, A, E1),
               MatMul(E1.T, C, B, E2), MatMul(-1, E1.T, S, B, E1), MatMul(-1, E2.T, C, B, E1), MatMul(-1, E2.T, S, B, E2),
               MatMul(E3.T, M, E3)]
    return Proof(
        lhs=MatMul(R, P),
        rhs=MatMul(P, R),
        steps=(
            Step(MatAdd(*blocks), r"expand; $E_a E_b^\top = I$ for $a = b$, else $0$: each block meets its own pair"),
            Step(MatAdd(*swapped), r"diagonal matrices commute: $A C = C A$, $A S = S A$, $B C = C B$, $B S = S B$"),
            Step(MatMul(P, R), r"the same products expanded from $P R$"),
        ),
        facts=(
            Fact(P, _turning(E1, E2, cos_, sin_, None), "the rotary rotation of one relative position, one angle per pair"),
            Fact(R, _turning(E1, E2, a, b, M), "R turns each pair within itself and the rest among themselves"),
            Fact(MatMul(E3, E3.T), Eye(r), "E_3 selects distinct rows of the identity"),
            *_orthogonality_facts(E1, E2),
            *_orthogonality_facts(F1, F2),
        ),
        samplers={
            E1: _selector(layout, "first"), E2: _selector(layout, "second"), E3: _selector(layout, "rest"),
            F1: _selector(other, "first"), F2: _selector(other, "second"),
        },
        explicit_dims={h: 2, r: 1},
        assumptions=(
            f"the pairs are laid out as {'GPT-NeoX' if layout == 'neox' else 'GPT-J'} lays them out"
            f" ({'(i, i + h)' if layout == 'neox' else '(2i, 2i + 1)'}); the selectors carry the layout, the"
            " algebra is the same for both",
            "P stands for the rotation of every relative position: R commutes with each, so q R P R^T k^T = q P k^T"
            " for an orthogonal R; with distinct frequencies no other rotation commutes with all of them",
        ),
        twins=(
            Twin("mixes_a_pair_with_the_rest", ROTATE_ROTARY_PAIRS.describe("mixes_a_pair_with_the_rest"),
                 MatMul(mixing, P), MatMul(P, mixing)),
            Twin("pairs_of_the_other_layout",
                 f"{ROTATE_ROTARY_PAIRS.describe('pairs_of_the_other_layout')}: the {other} layout's on a {layout} model",
                 MatMul(R_wrong_layout, P), MatMul(P, R_wrong_layout)),
            Twin("reflection_in_a_pair", ROTATE_ROTARY_PAIRS.describe("reflection_in_a_pair"),
                 MatMul(reflection, P), MatMul(P, reflection)),
        ),
    )


def _proof() -> Proof:
    """The GPT-NeoX layout, with the GPT-J layout as a lemma: the same claim, drawn on the other selectors."""
    return dataclasses.replace(_commuting_proof("neox"), lemmas=(("interleaved_pairs", _commuting_proof("interleaved")),))


IS_ROTARY = Precondition(
    "queries and keys are rotated by position",
    "the model has rotary embeddings (positional_embedding_type rotary), full, partial (rotary_dim < d_head) or"
    " interleaved: what this identity is about",
)


def _query_key_rotation(cfg, layout_cfg=None) -> torch.Tensor:
    """A rotation of every head's query/key space ``[n_layers, kv_heads, d_head, d_head]`` (float64):
    a random one made to commute with ``layout_cfg``'s rotary embedding (default ``cfg``'s), the
    same in every layer."""
    shape = (1, cfg.n_key_value_heads or cfg.n_heads, cfg.d_head, cfg.d_head)
    generator = torch.Generator(device="cpu").manual_seed(0)
    R = torch.linalg.qr(torch.randn(*shape, generator=generator, dtype=torch.float64, device="cpu"))[0]
    return nearest_commuting(R, layout_cfg or cfg).expand(cfg.n_layers, *shape[1:]).clone()


def _rotated_pairs(state_dict, cfg):
    """``rotate_heads`` of the query/key space by a rotation that turns each rotary pair within
    itself and the dimensions past ``rotary_dim`` among themselves."""
    identity = "rotate_rotary_pairs"
    require(identity, IS_ROTARY, cfg.positional_embedding_type == "rotary",
            f"positional_embedding_type is {cfg.positional_embedding_type!r}: there are no rotary pairs"
            " (any rotation of such a model's query/key space keeps its scores)")
    return rotate_heads(state_dict, cfg, query_key=_query_key_rotation(cfg))


def _rotated_regardless(change):
    """A wrong query/key rotation ``change(R, cfg)``, applied as ``rotate_heads`` would apply it."""
    def wrong(state_dict, cfg):
        from ..circuits._bases import change_bases

        out, out_cfg = _rotated_pairs(state_dict, cfg)
        R = change(_query_key_rotation(cfg), cfg).to(state_dict["embed.W_E"].device)
        return change_bases(state_dict, cfg, query=R, key=R), out_cfg
    return wrong


def _mixing_the_rest(R, cfg):
    """Then turn the first rotary dimension with the first one past ``rotary_dim`` (partial rotary)."""
    rotary = cfg.rotary_dim or cfg.d_head
    G = torch.eye(cfg.d_head, dtype=torch.float64, device="cpu")
    G[0, 0] = G[rotary, rotary] = 0.6
    G[0, rotary], G[rotary, 0] = 0.8, -0.8
    return R @ G


def _other_layout(R, cfg):
    """A rotation that commutes with the other layout's pairs instead (GPT-J's on a GPT-NeoX model, or back)."""
    return _query_key_rotation(cfg, cfg.replace(rotary_interleaved=not cfg.rotary_interleaved))


def _reflected_pair(R, cfg):
    """Turn the first rotary pair by a reflection: its second dimension's sign flipped after R."""
    flip = torch.ones(cfg.d_head, dtype=torch.float64, device="cpu")
    flip[1 if cfg.rotary_interleaved else (cfg.rotary_dim or cfg.d_head) // 2] = -1
    return R * flip


ROTATE_ROTARY_PAIRS = register(
    Identity(
        name="rotate_rotary_pairs",
        title="Rotations of the query/key space that commute with partial and interleaved rotary embeddings",
        summary="R P = P R for R turning each rotary pair within itself ([[a, b], [-b, a]]) and the dimensions past"
        " rotary_dim among themselves, the pairs (i, i + h) for GPT-NeoX and (2i, 2i + 1) for GPT-J: W_Q R, W_K R"
        " keep every score",
        preconditions=(IS_ROTARY, COMMUTES_WITH_ROTARY, NO_QK_NORM, NOT_APPLIED),
        build_proof=_proof,
        transform=_rotated_pairs,
        postcondition=NOTHING_SHOWN,
        wrong_rewrites={
            "reflection_in_a_pair": WrongRewrite(
                _rotated_regardless(_reflected_pair),
                "turn a pair by a reflection [[a, b], [b, -a]] instead of a rotation",
            ),
            "mixes_a_pair_with_the_rest": WrongRewrite(
                _rotated_regardless(_mixing_the_rest),
                "a rotation that mixes a rotary dimension with one past rotary_dim (partial rotary): "
                "E_1^T G E_3 couples them",
                differs_on=lambda cfg: (cfg.rotary_dim or cfg.d_head) < cfg.d_head,
            ),
            "pairs_of_the_other_layout": WrongRewrite(
                _rotated_regardless(_other_layout), "turn the pairs of the other layout",
                differs_on=lambda cfg: (cfg.rotary_dim or cfg.d_head) >= 4),
        },
        half_precision=COMPUTES,
    )
)
