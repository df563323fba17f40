"""Comparing two models' log-probabilities, and the tolerance rounding alone may explain.

The layer below the registry and the diagnosis: :mod:`circuitmath._registry` runs each
identity's numeric check through :func:`compare_log_probs`, the diagnosis measures each replayed
step with :func:`logprob_tolerance` and :func:`rounding_sensitivity`, and
:mod:`circuitmath.testing` re-exports all of it as the public API. Imports nothing above the
reference forward pass.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass

import torch

from ._config import Config
from ._reference import Centering, block, check_tokens, embed, log_probs, unembed
from ._state import StateDict, Validated, validated, vouched

__all__ = [
    "SAFETY",
    "SENSITIVITY_SAFETY",
    "Comparison",
    "compute_dtype",
    "logprob_tolerance",
    "rounding_sensitivity",
    "default_tokens",
    "compare_log_probs",
    "compare_with_log_probs",
    "in_dtype",
]

#: Safety factors of :func:`logprob_tolerance`: ``SAFETY`` multiplies the a-priori rounding
#: bound, ``SENSITIVITY_SAFETY`` the measured sensitivity. Measured on models drawn from
#: :mod:`circuitmath.strategies` (float64 and float32, up to 2 layers, d_model from 2, outlier
#: dimensions up to 30x): on 1000 random models per dtype |Δ log-prob| / tolerance had median
#: 0.01 and maximum 0.08; the worst case hypothesis found by searching for failures was 0.5 (a
#: float64 model whose log-probs are all below 1, so the a-priori term dominates). Without the
#: sensitivity term the a-priori bound was exceeded up to 19x (tiny LayerNorms over nearly
#: constant residuals). The sensitivity is measured, so its factor only covers the second model
#: and log-softmax (4); the a-priori term covers what it does not model (32). In bfloat16
#: (compared in float32, see :func:`compute_dtype`) a d_model 64 model's correct transforms stay
#: below 0.13 of the tolerance while every wrong transform of the test suite exceeds it. Float64
#: tolerances stay near 1e-13: wrong transforms miss them by ten orders of magnitude.
SAFETY = 32.0
SENSITIVITY_SAFETY = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _computation_roundoff(weights: float) -> float:
    """The unit roundoff of :func:`compute_dtype` of the dtype whose unit roundoff is ``weights``
    (float32's for half precisions): the forward pass's, where the weights' is ``weights``."""
    return min(weights, unit_roundoff(torch.float32))


def named_generator(name: str, seed: int = 0) -> torch.Generator:
    """The CPU generator of the rounding noise of the tensor (or norm) ``name``: seeded by
    ``seed`` and the name, so every pass draws the same numbers for it, whatever order the
    tensors come in (in memory, from a file, streamed)."""
    return torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))


def _rounded_centering(u: float, seed: int = 0) -> Centering:
    """The LayerNorms' centering in the nudged pass of :func:`rounding_sensitivity`: ``x - mean(x)``
    off along ``1`` by as much as two forward passes rounding with unit roundoff ``u`` may differ.

    A computed mean is off by up to about ``u * mean(|x|)`` (exactly that bound for two entries,
    one addition), an error along ``1`` that the exact centering would remove. To first order
    the other operations of the forward pass round as their inputs or outputs rounded by a few
    units of roundoff would, which the nudged weights mimic; this error is of no such kind, and
    over two dimensions nothing else reaches the output: ``LNPre`` of any two distinct entries
    is ``±(1, -1)``, up to the rounding of their mean. So ``x - mean(x)`` is computed twice (the second mean removes
    the first's rounding, to ``u**2``), then shifted along ``1`` by ``2 * u * mean(|x|)``, as far
    as two passes' means may be apart, with a sign drawn per position (``x: [batch, pos,
    d_model]``). The reference pass keeps its own rounding (at most half the shift), so the
    measured effect is at least that of one mean's worst rounding.

    The signs are drawn on the CPU, as the weights' noise is, from a generator seeded by ``seed``
    and the norm's name: every pass over the same tokens draws the same ones (in memory or
    streamed, on any device)."""

    def center(name: str, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(dim=-1, keepdim=True)
        centered = centered - centered.mean(dim=-1, keepdim=True)
        g = named_generator(f"{name}:centering", seed)
        signs = torch.randint(0, 2, (*x.shape[:-1], 1), generator=g, device="cpu").mul_(2).sub_(1)
        shift = x.abs().mean(dim=-1, keepdim=True).mul_(2 * u)
        return centered.add_(shift.mul_(signs.to(device=x.device, dtype=x.dtype)))

    return center


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a comparison runs in: the state dicts' own, but float32 for half precisions.

    A forward pass in bfloat16 or float16 is noisier than many wrong transforms are wrong
    (a dropped LayerNorm bias moves log-probs by a few nats; a bfloat16 forward pass of a small
    model by about as much), so half-precision weights are compared in float32 and only their
    own rounding counts.
    """
    return torch.float32 if torch.finfo(dtype).bits < 32 else dtype


def recognition_threshold(dtype: torch.dtype) -> float:
    """The largest relative difference (over a tensor's largest entry) at which a tensor of
    ``dtype`` counts as another's rewrite by the same identity: ``max(1e-3, 4 eps)``. Wrong
    rewrites miss it by orders of magnitude; the same rewrite computed another way (in float32, in
    another summation order, rounded to ``dtype``) stays well inside."""
    return max(1e-3, 4 * torch.finfo(dtype).eps)


def rounding_sensitivity(
    state_dict: StateDict,
    cfg: Config,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    computed: torch.Tensor | None = None,
) -> float:
    """How far this model's log-probs move from rounding alone, in ``dtype``.

    The sum of two measured effects, each the largest |Δ log-prob| over ``tokens``:

    - rounding the weights once more: every weight is multiplied by ``1 + u * xi`` (``xi``
      standard normal, ``u`` the unit roundoff of ``dtype``) and both versions run in float64;
      in the nudged version every LayerNorm's mean is also off by as much as two forward
      passes in :func:`compute_dtype` may round it apart (:func:`_rounded_centering`): the one
      rounding of the forward pass that no rounding of its inputs reproduces;
    - rounding the computation: the forward pass in :func:`compute_dtype` against float64
      (zero when that is float64).

    They measure the model's own conditioning: a LayerNorm over a nearly constant residual, a
    sharp softmax or an outlier dimension amplify rounding, and an exact transform's result
    differs from the original by rounding of these kinds.

    ``computed``: this model's log-probs on ``tokens`` computed in :func:`compute_dtype`, when
    the caller has them already (``[batch, pos, d_vocab]``); they are not computed again.

    The two float64 passes run side by side one part of the model at a time (the embedding rows
    of ``tokens``, each block, slices of the unembedding), so no float64 copy of the whole
    model is made; the weights' entries are checked once, here.
    """
    state_dict = validated(state_dict, cfg)
    tokens = check_tokens(cfg, tokens, state_dict["embed.W_E"].device)
    reference, nudged = _float64_passes(state_dict, cfg, tokens, unit_roundoff(dtype), seed)
    weights = float((reference - nudged).abs().max())
    run_in = compute_dtype(dtype)
    if run_in == torch.float64:
        return weights
    if computed is None:
        computed = log_probs(in_dtype(state_dict, run_in), cfg, tokens)
    return weights + float((computed.double() - reference).abs().max())


#: Vocabulary entries of one slice of the unembedding converted to float64 by
#: :func:`rounding_sensitivity` (GPT-2's whole ``W_U`` in float64 is 309 MB).
UNEMBED_COLUMNS = 8192


def _float64_passes(state_dict: StateDict, cfg: Config, tokens: torch.Tensor, u: float, seed: int):
    """Float64 log-probs ``[batch, pos, d_vocab]`` of ``state_dict`` and of it with every weight
    multiplied by ``1 + u * xi`` and its LayerNorms' means rounded apart
    (:func:`_rounded_centering`), a part of the model at a time (see :func:`rounding_sensitivity`)."""
    device = state_dict["embed.W_E"].device
    # The noise is drawn on the CPU and moved, as the checkpoint check draws it: the same numbers,
    # so the same tolerance, on every device.

    # Memory for the float64 copies and the noise, reused by every block (the same shapes):
    # fresh memory of this size is mapped and zeroed page by page, as slow as the copy itself.
    scratch: dict[tuple, torch.Tensor] = {}

    def buffer(role: str, name: str, shape: torch.Size, dtype: torch.dtype, on: torch.device) -> torch.Tensor:
        key = (role, re.sub(r"^blocks\.\d+\.", "", name), shape)
        if key not in scratch:
            scratch[key] = torch.empty(shape, dtype=dtype, device=on)
        return scratch[key]

    def both(part: dict[str, torch.Tensor], offset: int = 0) -> tuple[dict, dict]:
        exact, nudged = {}, {}
        for k, v in part.items():
            exact[k] = buffer("exact", k, v.shape, torch.float64, device).copy_(v)
            # The change u * xi * w is computed in float32 (several times faster than float64) and
            # added in float64: it is of the order of u, so its own rounding does not matter.
            # Each tensor's noise from a generator seeded by its name (as the streamed checks draw
            # it): the same sample whatever order the state dict lists its tensors in.
            g = named_generator(k, seed + (offset if k.startswith("unembed.") else 0))
            noise = buffer("noise", k, v.shape, torch.float32, torch.device("cpu")).normal_(generator=g)  # as randn draws
            change = buffer("nudged", k, v.shape, torch.float64, device).copy_(noise.to(device).mul_(v.float()))
            nudged[k] = torch.add(exact[k], change, alpha=u, out=change)  # float64 + float64: the fast kernel
        return exact, nudged

    def named(prefix: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state_dict.items() if k.startswith(prefix)}

    used, index = torch.unique(tokens, return_inverse=True)  # only the embedding rows these tokens read
    part = named("embed.") | {"embed.W_E": state_dict["embed.W_E"][used]}
    if "pos_embed.W_pos" in state_dict:
        part["pos_embed.W_pos"] = state_dict["pos_embed.W_pos"][: tokens.shape[1]]
    centerings = (None, _rounded_centering(_computation_roundoff(u), seed))  # the nudged pass's
    streams = [embed(params, cfg, index, centering=c) for params, c in zip(both(part), centerings)]  # (x, pos) of each pass
    for layer in range(cfg.n_layers):
        params = both(named(f"blocks.{layer}."))
        streams = [(block(p, layer, cfg, x, pos, centering=c), pos) for p, c, (x, pos) in zip(params, centerings, streams)]
    params = None  # (set by the loop unless there are no blocks)
    scratch.clear()  # the blocks' memory goes before the unembedding's: one part's at a time, as before
    final = named("ln_final.")
    logits = [[], []]
    for start in range(0, cfg.d_vocab, UNEMBED_COLUMNS):
        columns = slice(start, start + UNEMBED_COLUMNS)
        part = final | {"unembed.W_U": state_dict["unembed.W_U"][:, columns], "unembed.b_U": state_dict["unembed.b_U"][columns]}
        for out, params, c, (x, _pos) in zip(logits, both(part, start), centerings, streams):
            out.append(unembed(params, cfg, x, centering=c))
    return tuple(torch.log_softmax(torch.cat(out, dim=-1), dim=-1) for out in logits)


def logprob_tolerance(cfg: Config, dtype: torch.dtype, scale: float, sensitivity: float = 0.0) -> float:
    """Largest |Δ log-prob| two exactly-equivalent models may show from rounding alone.

    ``SAFETY * u * (n_layers + 1) * sqrt(K) * max(1, scale) + SENSITIVITY_SAFETY * sensitivity``,
    where

    - ``u`` is the unit roundoff of the dtype the forward pass runs in (:func:`compute_dtype`:
      ``2**-53`` for float64, ``2**-24`` for float32 and, via float32, for half precisions);
    - ``K`` is the longest inner product in the model (``d_model``, ``d_mlp`` or ``d_vocab``):
      rounding errors of a length-``K`` dot product grow like ``sqrt(K) * u`` times its size;
    - each layer (and the unembed) adds one such error, relative to the size of the values, and
      ``scale``, the largest |log-prob|, is the size of what is finally compared;
    - ``sensitivity`` (:func:`rounding_sensitivity`) is how much this model amplifies rounding
      of its weights and of its forward pass: the first term assumes a well-conditioned model,
      this one measures the actual one;
    - the factors cover two independent computations (one per model), the factor of at most 2
      by which log-softmax can amplify a logit error and, for the a-priori term, what it does
      not model; their values are measured (see :data:`SAFETY`).
    """
    u = unit_roundoff(compute_dtype(dtype))
    k = max(cfg.d_model, cfg.d_mlp or 0, cfg.d_vocab)
    return SAFETY * u * (cfg.n_layers + 1) * math.sqrt(k) * max(1.0, float(scale)) + SENSITIVITY_SAFETY * sensitivity


@dataclass(frozen=True)
class Comparison:
    """The result of comparing two models' log-probabilities on the same tokens."""

    max_abs_error: float
    tolerance: float
    where: tuple[int, int, int]  # (batch, position, token) of the largest difference

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.tolerance


def in_dtype(state_dict: StateDict, dtype: torch.dtype) -> StateDict:
    """``state_dict`` (a :class:`~circuitmath._state.Validated`) with its tensors in ``dtype``: itself
    when they are; a copy that is known valid when ``dtype`` is as wide as theirs (a finite entry
    stays finite), else one validated (an entry beyond the narrower dtype's range is refused). A
    plain state dict is copied as it is (validated where it is used)."""
    if isinstance(state_dict, Validated) and state_dict.dtype == dtype:
        return state_dict
    copy = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
    if not isinstance(state_dict, Validated):
        return copy
    if torch.finfo(dtype).max >= torch.finfo(state_dict.dtype).max:
        return vouched(copy, state_dict.cfg, dtype, entries=state_dict.entries, writers=state_dict.writers)
    return validated(copy, state_dict.cfg)


def default_tokens(cfg: Config, *, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Random tokens ``[batch, n_ctx]`` (at most 32 positions) from a fixed seed.

    Drawn on the CPU, so that they are the same whatever device the model is on; the forward
    pass moves them to the weights' device (a few hundred integers)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, cfg.d_vocab, (batch, min(cfg.n_ctx, 32)), generator=g, device="cpu")


@torch.no_grad()  # weights that require grad are compared as plain tensors
def compare_log_probs(
    before: StateDict,
    before_cfg: Config,
    after: StateDict,
    after_cfg: Config,
    tokens: torch.Tensor | None = None,
) -> Comparison:
    """Run both models on ``tokens`` (default: :func:`default_tokens`) and compare log-probs.

    Both run in :func:`compute_dtype` of the less precise of the two dtypes; the tolerance is
    :func:`logprob_tolerance` with the ``before`` model's :func:`rounding_sensitivity`.
    """
    return compare_with_log_probs(before, before_cfg, after, after_cfg, tokens)[0]


def compare_with_log_probs(
    before: StateDict, before_cfg: Config, after: StateDict, after_cfg: Config, tokens: torch.Tensor | None = None
) -> tuple[Comparison, torch.Tensor, torch.Tensor]:
    """:func:`compare_log_probs`, and both models' log-probs (float64 ``[batch, pos, d_vocab]``,
    computed in :func:`compute_dtype`) for a caller that goes on to use them."""
    before, after = validated(before, before_cfg), validated(after, after_cfg)
    tokens = default_tokens(before_cfg) if tokens is None else tokens
    coarse = max((before.dtype, after.dtype), key=lambda d: torch.finfo(d).eps)
    run_in = compute_dtype(coarse)
    a = log_probs(in_dtype(before, run_in), before_cfg, tokens).double()
    b = log_probs(in_dtype(after, run_in), after_cfg, tokens).double()
    diff = (a - b).abs()
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    sensitivity = rounding_sensitivity(before, before_cfg, tokens, coarse)
    comparison = Comparison(
        max_abs_error=float(diff.max()),
        tolerance=logprob_tolerance(before_cfg, coarse, float(a.abs().max()), sensitivity),
        where=where,
    )
    return comparison, a, b
