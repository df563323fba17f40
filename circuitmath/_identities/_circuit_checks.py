"""What the circuits families share: samplers for exact instances, and their numeric checks.

Sympy side: dimension symbols, rational orthogonal matrices (Cayley transforms), rotations of the
rotary layout, block selectors, samplers for symbols that must be drawn together (``G`` with
``G^{-1}``; a matrix with an eigenvector), and :func:`notation_proof`, a :class:`Proof` with every
``(A ⊗ B)·X`` defined.

Torch side: the comparisons that the ``compare`` field of these identities uses (logits computed
along an identity's route against the reference forward pass; a quantity computed from factors
against its naive materialised value), and a forward pass with frozen attention patterns whose
heads are computed by a given route.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from fractions import Fraction

import sympy
import torch
from sympy import Symbol

from .._config import Config
from .._kronecker import notation_definitions
from .._proof import Proof
from .._reference import log_probs
from .._state import StateDict, validate_state_dict
from ..circuits import TensorProduct
from ..circuits._heads import layer_bias, layer_weight
from ..circuits._paths import FrozenNorm, recorded_run
from .._compare import SAFETY, Comparison, default_tokens, logprob_tolerance

# -- exact instances -------------------------------------------------------------------------


def dim(name: str) -> Symbol:
    """A symbolic size."""
    return Symbol(name, positive=True, integer=True)


def _rational(rng) -> sympy.Rational:
    return sympy.Rational(Fraction(rng.randint(-6, 6), rng.randint(1, 4)))


def rational_orthogonal(rng, n: int) -> sympy.Matrix:
    """An exactly orthogonal rational ``n x n`` matrix: ``(I - K)(I + K)^{-1}``, ``K`` skew."""
    K = sympy.zeros(n, n)
    for i in range(n):
        for j in range(i + 1, n):
            K[i, j] = _rational(rng)
            K[j, i] = -K[i, j]
    return (sympy.eye(n) - K) * (sympy.eye(n) + K).inv()


def rotary_like(rng, shape):
    """A rotation of the NeoX rotary layout, exact and rational: each pair ``(a, a + h)`` turned by
    ``[[c, s], [-s, c]]`` with ``(c, s)`` from a Pythagorean triple, a dimension past the pairs
    kept. Any two such matrices commute: the rotary rotations ``P_i``, ``P_j`` and an ``R`` made so."""
    size = shape[0]
    half = size // 2
    M = sympy.eye(size)
    for a in range(half):
        p, q, r = rng.choice([(3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25)])
        c, s_ = sympy.Rational(p, r) * rng.choice([1, -1]), sympy.Rational(q, r) * rng.choice([1, -1])
        M[a, a], M[a + half, a + half], M[a, a + half], M[a + half, a] = c, c, s_, -s_
    return M


def orthonormal_columns(rng, shape) -> sympy.Matrix:
    """``[m, k]`` with ``Q^T Q = I_k`` exactly (``k <= m``)."""
    m, k = shape
    return rational_orthogonal(rng, m)[:, :k]


def unimodular(rng, n: int) -> tuple[sympy.Matrix, sympy.Matrix]:
    """An integer matrix with determinant 1 and its (integer) inverse."""
    lower, upper = sympy.eye(n), sympy.eye(n)
    for i in range(n):
        for j in range(i):
            lower[i, j] = rng.randint(-2, 2)
            upper[j, i] = rng.randint(-2, 2)
    G = lower * upper
    return G, G.inv()


def selector(block: int, size: int, blocks: int) -> sympy.Matrix:
    """``[size, blocks * size]``: the identity in column block ``block``, zeros elsewhere."""
    out = sympy.zeros(size, blocks * size)
    out[:, block * size : (block + 1) * size] = sympy.eye(size)
    return out


class Joint:
    """Samplers for symbols that must be drawn together (``G`` and ``G^{-1}``, say).

    ``draw(rng, dims)`` returns ``{symbol: explicit matrix}`` for the whole group at the explicit
    sizes of the instance being drawn (``rng.dims``, else ``dims``); each symbol's sampler returns
    its part of one draw per random generator.
    """

    def __init__(self, draw: Callable, dims: Mapping):
        self._draw = draw
        self._dims = dict(dims)
        self._drawn: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def sampler(self, symbol) -> Callable:
        def sample(rng, shape):
            if rng not in self._drawn:
                self._drawn[rng] = self._draw(rng, getattr(rng, "dims", self._dims))
            value = self._drawn[rng][symbol]
            if tuple(getattr(value, "shape", ())) != tuple(shape):
                raise ValueError(f"joint sampler drew {symbol} with shape {value.shape}, {shape} was asked for")
            return value

        return sample

    def samplers(self, *symbols) -> dict:
        return {s: self.sampler(s) for s in symbols}


def notation_proof(*, lhs, rhs, steps, twins=(), definitions=(), operators=None, **options) -> Proof:
    """A :class:`Proof` whose definitions include ``op·X := act(op, X)`` for every ``Apply`` node."""
    exprs = [lhs, rhs, *(s.expr for s in steps), *(t.lhs for t in twins), *(t.rhs for t in twins)]
    exprs += [d.value for d in definitions] + [e for f in options.get("facts", ()) for e in (f.product, f.value)]
    notation = notation_definitions(exprs, operators)
    return Proof(lhs=lhs, rhs=rhs, steps=steps, twins=twins, definitions=tuple(definitions) + notation, **options)


# -- numeric checks --------------------------------------------------------------------------

#: The factor by which logits computed along a route may miss the reference, on top of
#: :func:`~circuitmath.testing.logprob_tolerance`. A route multiplies in another order than the
#: reference forward pass (``W_V W_O`` first, Kronecker matrices, sums of up to a hundred path
#: terms that partly cancel), so its rounding errors are not the reference's. Measured with the
#: strategies of tests/test_circuit_identities.py, 120 models per identity and dtype: the largest
#: error over ``logprob_tolerance`` was 4.2 (two_layer_path_expansion, float32); 32 leaves a
#: margin of more than 7, and the wrong routes still miss by orders of magnitude.
ROUTE_SAFETY = 32.0


def compare_logits(state_dict: StateDict, cfg: Config, tokens, route: Callable) -> Comparison:
    """Log-probs of ``route(state_dict, cfg, tokens)`` (logits) against the reference forward pass."""
    dtype = validate_state_dict(state_dict, cfg)
    tokens = default_tokens(cfg) if tokens is None else tokens
    expected = log_probs(state_dict, cfg, tokens).double()
    logits = route(state_dict, cfg, tokens)
    if logits.shape != expected.shape:
        return Comparison(math.inf, 0.0, (0, 0, 0))
    computed = torch.log_softmax(logits.double(), dim=-1)
    diff = (computed - expected).abs()
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    tolerance = ROUTE_SAFETY * logprob_tolerance(cfg, dtype, float(expected.abs().max()))
    return Comparison(float(diff.max()), tolerance, where)


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def values_tolerance(dtype: torch.dtype, size: int, scale: float) -> float:
    """Rounding allowed between two computations of a quantity of size ``scale`` that involve
    inner products and decompositions of length ``size``: ``SAFETY * u * size * max(1, scale)``."""
    return SAFETY * unit_roundoff(dtype) * size * max(1.0, scale)


def worst(errors: torch.Tensor, tolerances: torch.Tensor) -> Comparison:
    """The entry whose error is largest relative to its own tolerance, as a :class:`Comparison`."""
    errors, tolerances = errors.double(), tolerances.double().expand_as(errors)
    if errors.numel() == 0:
        return Comparison(0.0, 0.0, ())
    ratio = torch.where(errors == 0, torch.zeros_like(errors), errors / tolerances)
    ratio = torch.nan_to_num(ratio, nan=math.inf)
    flat = ratio.argmax()
    where = tuple(int(i) for i in torch.unravel_index(flat, errors.shape))
    return Comparison(float(errors[where]), float(tolerances[where]), where)


def compare_values(computed: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, size: int) -> Comparison:
    """Largest entrywise difference (NaN must meet NaN) against :func:`values_tolerance`."""
    if computed.shape != expected.shape or not torch.equal(computed.isnan(), expected.isnan()):
        return Comparison(math.inf, 0.0, (0,) * max(expected.ndim, 1))
    diff = (torch.nan_to_num(computed.double()) - torch.nan_to_num(expected.double())).abs()
    if diff.numel() == 0:
        return Comparison(0.0, 0.0, ())
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    scale = float(torch.nan_to_num(expected.double()).abs().max())
    return Comparison(float(diff.max()), values_tolerance(dtype, size, scale), where)


def match_order(few: torch.Tensor, many: torch.Tensor) -> torch.Tensor:
    """For each of ``few: [..., k]`` the index of a distinct nearest one of ``many: [..., n]``
    (``k <= n``; greedy: pairs are taken in order of increasing distance). Returns ``[..., k]``."""
    batch = few.shape[:-1]
    few2, many2 = few.reshape(-1, few.shape[-1]), many.reshape(-1, many.shape[-1])
    out = torch.zeros(few2.shape, dtype=torch.long, device=few.device)
    for b in range(few2.shape[0]):
        distances = (few2[b][:, None] - many2[b][None, :]).abs().double()
        for _ in range(few2.shape[1]):
            i, j = divmod(int(distances.argmin()), distances.shape[1])
            out[b, i] = j
            distances[i, :] = math.inf
            distances[:, j] = math.inf
    return out.reshape(*batch, few.shape[-1])


def match_eigenvalues(few: torch.Tensor, many: torch.Tensor) -> torch.Tensor:
    """For each of ``few: [..., k]`` the distance to a distinct nearest one of ``many: [..., n]``."""
    return (few - torch.gather(many, -1, match_order(few, many))).abs()


def random_invertible(
    generator: torch.Generator, batch: tuple, n: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Well-conditioned ``[*batch, n, n]`` matrices and their inverses, in float64 on ``device``
    (drawn with the CPU ``generator``, then moved: the same matrices on every device).

    ``Q1 diag(exp(z)) Q2`` with ``Q1, Q2`` orthogonal and ``z ~ N(0, 0.3)``: condition numbers
    of a few units, so a float32 model stays within its rounding tolerance.
    """
    q1 = torch.linalg.qr(torch.randn(*batch, n, n, generator=generator, dtype=torch.float64, device="cpu"))[0]
    q2 = torch.linalg.qr(torch.randn(*batch, n, n, generator=generator, dtype=torch.float64, device="cpu"))[0]
    scale = torch.exp(0.3 * torch.randn(*batch, n, generator=generator, dtype=torch.float64, device="cpu"))
    G = q1 @ torch.diag_embed(scale) @ q2
    G_inv = q2.transpose(-1, -2) @ torch.diag_embed(1 / scale) @ q1.transpose(-1, -2)
    return G.to(device), G_inv.to(device)


def logits_with_heads(state_dict: StateDict, cfg: Config, tokens, heads: Callable, identity: str) -> torch.Tensor:
    """Logits of an attention-only pre-norm model whose attention layers are computed by ``heads``.

    ``heads(layer, pattern [batch, n_heads, pos, pos], normed [batch, pos, d_model])`` returns the
    sum of the layer's heads ``[batch, pos, d_model]`` (without ``b_O``). The patterns are
    frozen from a forward pass; everything else is recomputed.
    """
    run = recorded_run(state_dict, cfg, tokens, identity)
    x = run.inputs[0]
    for layer in range(cfg.n_layers):
        normed = FrozenNorm.freeze(state_dict, cfg, f"blocks.{layer}.ln1", x)(x)
        x = x + heads(layer, run.patterns[layer], normed) + state_dict[f"blocks.{layer}.attn.b_O"]
    final = FrozenNorm.freeze(state_dict, cfg, "ln_final", x)(x)
    return final @ state_dict["unembed.W_U"] + state_dict["unembed.b_U"]


def heads_route(compute: Callable, identity: str) -> Callable:
    """A route (``(state_dict, cfg, tokens) -> logits``) whose heads are ``compute(A, x, W_V, W_O)``.

    ``compute`` gets one head's pattern ``A: [batch, pos, pos]``, the normed residual stream
    ``x: [batch, pos, d_model]`` and the head's ``W_V: [d_model, d_head]``, ``W_O: [d_head,
    d_model]``, and returns its output ``[batch, pos, d_model]`` without biases; ``b_V`` is added
    as ``b_V W_O`` (the rows of ``A`` sum to 1).
    """

    def heads(state_dict, cfg, layer, pattern, normed):
        W_V, b_V = layer_weight(state_dict, cfg, layer, "V"), layer_bias(state_dict, cfg, layer, "V")
        W_O = state_dict[f"blocks.{layer}.attn.W_O"]
        return sum(compute(pattern[:, h], normed, W_V[h], W_O[h]) + b_V[h] @ W_O[h] for h in range(cfg.n_heads))

    def route(state_dict, cfg, tokens):
        return logits_with_heads(
            state_dict, cfg, tokens, lambda layer, pattern, x: heads(state_dict, cfg, layer, pattern, x), identity
        )

    return route


def frozen_norm_operator(
    cfg: Config, norm: FrozenNorm, positions: int, dtype: torch.dtype, device: torch.device
) -> TensorProduct:
    """A frozen norm's linear part ``x -> s * (x P) * w`` as ``diag(s) ⊗ (P diag(w))^T``.

    ``P`` centers (LN, LNPre) or is the identity; ``w`` is the gain (LN, RMS) or 1; ``s`` the
    frozen scale ``[batch, pos]`` (positions ``[batch, pos, pos]``), or 1 without a norm; on ``device``.
    """
    features = torch.eye(cfg.d_model, dtype=dtype, device=device)
    if norm.kind is None:
        return TensorProduct(torch.eye(positions, dtype=dtype, device=device), features)
    if norm.kind in ("LN", "LNPre"):
        features = features - 1 / cfg.d_model
    if norm.kind in ("LN", "RMS"):
        features = features * norm.w
    return TensorProduct(torch.diag_embed(norm.scale[..., 0]), features.T)
