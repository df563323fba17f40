"""Hypothesis strategies for transformer configs, weights and tokens.

Every function returns a strategy, takes its options as keywords, and checks them when called,
not when drawn from. Weights are drawn with realistic structure (see
:func:`circuitmath.random_state_dict`): non-unit and occasionally negative norm gains, large
biases, a few outlier residual dimensions.

>>> from hypothesis import given, settings
>>> from circuitmath import fold_layer_norm
>>> from circuitmath.strategies import models
>>> from circuitmath.testing import assert_equivalent
>>> @settings(max_examples=20, deadline=None)  # a model per example takes longer than 200 ms under load
... @given(models(normalization_types=("LN",), positional_embedding_types=("standard", "rotary"),
...                gated_mlp=(False,)))
... def test_fold_layer_norm(model):
...     cfg, state_dict = model
...     folded, folded_cfg = fold_layer_norm(state_dict, cfg)
...     assert_equivalent(state_dict, folded, cfg, after_cfg=folded_cfg)
>>> test_fold_layer_norm()
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from ._config import ACTIVATIONS, NORM_POSITIONS, NORMALIZATIONS, POSITIONAL, QK_NORM_SPANS, Config
from ._weights import random_state_dict

__all__ = ["configs", "state_dicts", "models", "tokens", "DEVICE_VARIABLE"]

#: The environment variable that names the device :func:`state_dicts` and :func:`models` draw on
#: when they are given no ``device`` (default ``cpu``): a whole property-test suite can run its
#: examples on a GPU without an edit (circuitmath's own: ``pytest --device cuda``).
DEVICE_VARIABLE = "CIRCUITMATH_TEST_DEVICE"


def _device(device) -> torch.device:
    try:
        return torch.device(device if device is not None else os.environ.get(DEVICE_VARIABLE, "cpu"))
    except (RuntimeError, TypeError) as error:
        raise InvalidArgument(f"device must name a torch device, got {device!r}: {error}") from None


def _check_range(name: str, low, high, floor, *, kind: type = int) -> None:
    """``min_<name>`` and ``max_<name>`` are numbers of ``kind`` (a float range takes ints too)
    with ``floor <= low <= high``."""
    allowed = (int, float) if kind is float else (int,)
    for label, value in ((f"min_{name}", low), (f"max_{name}", high)):
        if not isinstance(value, allowed) or isinstance(value, bool) or value != value:
            raise InvalidArgument(f"{label} must be {'a number' if kind is float else 'an int'}, got {value!r}")
    if low < floor or high < low:
        raise InvalidArgument(f"need {floor} <= min_{name} <= max_{name}, got min_{name}={low}, max_{name}={high}")


#: The positional embeddings drawn unless a test names others: all but ALiBi (BLOOM's).
_DRAWN_POSITIONAL = tuple(p for p in POSITIONAL if p != "alibi")


def _check_choices(name: str, values, allowed) -> tuple:
    values = tuple(values)
    if not values:
        raise InvalidArgument(f"{name} must not be empty")
    bad = [v for v in values if v not in allowed]
    if bad:
        raise InvalidArgument(f"{name} has {bad!r}; allowed: {allowed!r}")
    return values


def configs(
    *, min_layers: int = 1, max_layers: int = 2, min_d_model: int = 2, max_d_model: int = 12, max_heads: int = 3,
    max_d_head: int = 4, max_d_mlp: int = 16, max_vocab: int = 12, min_ctx: int = 1, max_ctx: int = 6,
    normalization_types=NORMALIZATIONS, norm_positions=("pre",), positional_embedding_types=_DRAWN_POSITIONAL,
    act_fns=ACTIVATIONS, attn_only: bool | None = None, gated_mlp=(False, True), parallel_attn_mlp=(False, True),
    grouped_query=(False,), sliding_window=(False,), qk_norm=(False,), norm_gain_offsets=(0.0,), softcaps=(False,),
    post_norms=(False,), rotary_interleaved=(False,), embedding_norm=(False,), local_rotary_base=(False,),
    pre_norms=(True,), qk_norm_spans=("head",),
) -> st.SearchStrategy[Config]:
    """Strategy for :class:`~circuitmath.Config`\\ s no larger than the ``max_*`` sizes.

    ``attn_only=None`` draws both attention-only models and models with MLPs. ``gated_mlp``,
    ``parallel_attn_mlp`` and ``grouped_query`` are the choices drawn from for those
    architecture options (grouped-query draws ``n_key_value_heads`` among ``n_heads``'s
    divisors). ``d_model`` is at least 2 (a LayerNorm over one dimension is identically zero)
    and ``rotary`` models get an even ``d_head``.

    The defaults draw what a library written for TransformerLens-format state dicts of the
    common case expects to index: at least one block (``min_layers=1``), per-head ``W_K`` and
    ``W_V`` (``grouped_query=(False,)``: grouped-query models name them ``_W_K``, ``_W_V``) and
    pre-norm blocks (``norm_positions=("pre",)``: post-norm models have no ``ln_final``). Widen
    them to test a library that handles more: ``min_layers=0`` adds embedding-unembedding-only
    models, ``grouped_query=(False, True)`` grouped-query models, ``norm_positions=("pre",
    "post")`` post-norm models. Gated MLPs and parallel attention and MLP stay drawn by default:
    their state dicts have every key of the common case (a gated MLP adds ``mlp.W_gate``), so a
    library that ignores them runs and computes another function, which is what a property test
    is there to find; pass ``gated_mlp=(False,)`` or ``parallel_attn_mlp=(False,)`` for a
    library that does not handle them. The architecture features of the families beyond the
    common case are off unless asked for: ``sliding_window=(False, True)`` draws a window of
    keys (shorter than ``n_ctx`` where it can be) in some or all layers of causal models,
    ``qk_norm=(False, True)`` an RMSNorm of each head's queries and keys, and
    ``norm_gain_offsets=(0.0, 1.0)`` RMSNorm gains stored as ``w`` and applied as ``1 + w`` (Gemma),
    ``softcaps=(False, True)`` softcaps on the attention scores and the logits, small enough to
    bite, and a query scale of its own, and ``post_norms=(False, True)`` sandwich RMSNorms after
    each sub-layer of sequential models without LayerNorm (Gemma 2), ``pre_norms=(True, False)``
    drops the norms before the sub-layers of such models (OLMo-2: each reads the residual stream
    itself), ``qk_norm_spans=("head", "projection")`` draws a QK-norm over the whole query and key
    projections (OLMo-2) where a QK-norm is drawn, and
    ``rotary_interleaved=(False, True)`` rotary embeddings that rotate neighbouring pairs (GPT-J).
    The normalization and positional-embedding types are
    all drawn unless narrowed (a test names the ones its library processes), but for ALiBi
    (BLOOM), drawn when ``positional_embedding_types`` names ``"alibi"``; then
    ``embedding_norm=(False, True)`` draws BLOOM's LayerNorm of the token embeddings in its
    pre-LayerNorm models, and ``local_rotary_base=(False, True)`` a rotary base of their own for
    the sliding-window layers of rotary models (Gemma 3).

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, deadline=None)
    ... @given(configs(max_layers=1, normalization_types=("RMS",), gated_mlp=(True,), attn_only=False))
    ... def test_llama_like(cfg):
    ...     assert cfg.n_layers <= 1 and cfg.normalization_type == "RMS" and cfg.gated_mlp
    >>> test_llama_like()

    Options are checked when the strategy is built, not when it is drawn from:

    >>> configs(min_layers=3, max_layers=1)
    Traceback (most recent call last):
    ...
    hypothesis.errors.InvalidArgument: need 0 <= min_layers <= max_layers, got min_layers=3, max_layers=1
    """
    return _drawn_config(_ConfigOptions(
        min_layers=min_layers, max_layers=max_layers, min_d_model=min_d_model, max_d_model=max_d_model,
        max_heads=max_heads, max_d_head=max_d_head, max_d_mlp=max_d_mlp, max_vocab=max_vocab, min_ctx=min_ctx,
        max_ctx=max_ctx, normalization_types=normalization_types, norm_positions=norm_positions,
        positional_embedding_types=positional_embedding_types, act_fns=act_fns, attn_only=attn_only,
        gated_mlp=gated_mlp, parallel_attn_mlp=parallel_attn_mlp, grouped_query=grouped_query,
        sliding_window=sliding_window, qk_norm=qk_norm, norm_gain_offsets=norm_gain_offsets, softcaps=softcaps,
        post_norms=post_norms, rotary_interleaved=rotary_interleaved, embedding_norm=embedding_norm,
        local_rotary_base=local_rotary_base, pre_norms=pre_norms, qk_norm_spans=qk_norm_spans,
    ).checked())


@dataclass(frozen=True)
class _ConfigOptions:
    """The options of :func:`configs`, as given or (:meth:`checked`) checked and made tuples."""

    min_layers: int
    max_layers: int
    min_d_model: int
    max_d_model: int
    max_heads: int
    max_d_head: int
    max_d_mlp: int
    max_vocab: int
    min_ctx: int
    max_ctx: int
    normalization_types: tuple
    norm_positions: tuple
    positional_embedding_types: tuple
    act_fns: tuple
    attn_only: bool | None
    gated_mlp: tuple
    parallel_attn_mlp: tuple
    grouped_query: tuple
    sliding_window: tuple
    qk_norm: tuple
    norm_gain_offsets: tuple
    softcaps: tuple
    post_norms: tuple
    rotary_interleaved: tuple
    embedding_norm: tuple
    local_rotary_base: tuple
    pre_norms: tuple
    qk_norm_spans: tuple

    def checked(self) -> _ConfigOptions:
        """These options, each choice a tuple of allowed values; raises ``InvalidArgument`` naming the first bad one."""
        _check_range("layers", self.min_layers, self.max_layers, 0)
        _check_range("ctx", self.min_ctx, self.max_ctx, 1)
        _check_range("d_model", self.min_d_model, self.max_d_model, 2)
        for name, floor in (("max_heads", 1), ("max_d_head", 2), ("max_d_mlp", 1), ("max_vocab", 2)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < floor:
                raise InvalidArgument(f"{name} must be an int >= {floor}, got {value!r}")
        allowed = {"normalization_types": NORMALIZATIONS, "norm_positions": NORM_POSITIONS,
                   "positional_embedding_types": POSITIONAL, "act_fns": ACTIVATIONS}
        choices = {name: _check_choices(name, getattr(self, name), values) for name, values in allowed.items()}
        if self.attn_only not in (None, True, False):
            raise InvalidArgument(f"attn_only must be None, True or False, got {self.attn_only!r}")
        for name in ("gated_mlp", "parallel_attn_mlp", "grouped_query", "sliding_window", "qk_norm"):
            choices[name] = _check_choices(name, getattr(self, name), (False, True))
        choices["norm_gain_offsets"] = _check_choices("norm_gain_offsets", self.norm_gain_offsets, (0.0, 1.0))
        for name in ("softcaps", "post_norms", "rotary_interleaved", "embedding_norm", "local_rotary_base", "pre_norms"):
            choices[name] = _check_choices(name, getattr(self, name), (False, True))
        choices["qk_norm_spans"] = _check_choices("qk_norm_spans", self.qk_norm_spans, QK_NORM_SPANS)
        if choices["norm_positions"] == ("post",) and choices["normalization_types"] == (None,):
            raise InvalidArgument("post-norm models need a normalization type other than None")
        return replace(self, **choices)


@st.composite
def _drawn_config(draw, o: _ConfigOptions) -> Config:
    """A config drawn from the checked options ``o`` (see :func:`configs`)."""
    position = draw(st.sampled_from(o.norm_positions))
    norms = [n for n in o.normalization_types if position == "pre" or n is not None]
    allowed = [t for t in o.positional_embedding_types if position == "pre" or not t.startswith("shortformer")]
    if not allowed:
        raise InvalidArgument("post-norm models cannot use shortformer positional embeddings")
    positional = draw(st.sampled_from(allowed))
    d_head = draw(st.integers(1, o.max_d_head // 2)) * 2 if positional == "rotary" else draw(st.integers(1, o.max_d_head))
    mlp = draw(st.booleans()) if o.attn_only is None else not o.attn_only
    n_heads = draw(st.integers(1, o.max_heads))
    kv_heads = None
    if draw(st.sampled_from(o.grouped_query)):
        kv_heads = draw(st.sampled_from([k for k in range(1, n_heads + 1) if n_heads % k == 0]))
    n_layers, n_ctx = draw(st.integers(o.min_layers, o.max_layers)), draw(st.integers(o.min_ctx, o.max_ctx))
    window = window_layers = None
    if draw(st.sampled_from(o.sliding_window)):
        window = draw(st.integers(1, max(1, n_ctx - 1)))
        if draw(st.booleans()):
            window_layers = tuple(draw(st.sets(st.integers(0, max(0, n_layers - 1)))))
    normalization = draw(st.sampled_from(norms))
    parallel = mlp and position == "pre" and draw(st.sampled_from(o.parallel_attn_mlp))
    capped = draw(st.sampled_from(o.softcaps))
    caps = {name: draw(st.floats(0.5, 5.0)) if capped else None
            for name in ("attn_softcap", "logit_softcap", "attention_scale")}
    sandwich = (position == "pre" and not parallel and normalization not in ("LN", "LNPre")
                and draw(st.sampled_from(o.post_norms)))
    qk_norm = draw(st.sampled_from(o.qk_norm))
    return Config(
        n_layers=n_layers,
        d_model=draw(st.integers(o.min_d_model, o.max_d_model)),
        n_heads=n_heads,
        n_key_value_heads=kv_heads,
        gated_mlp=mlp and draw(st.sampled_from(o.gated_mlp)),
        parallel_attn_mlp=parallel,
        d_head=d_head,
        d_mlp=draw(st.integers(1, o.max_d_mlp)) if mlp else None,
        d_vocab=draw(st.integers(2, o.max_vocab)),
        n_ctx=n_ctx,
        act_fn=draw(st.sampled_from(o.act_fns)),
        normalization_type=normalization,
        norm_position=position,
        positional_embedding_type=positional,
        sliding_window=window,
        sliding_window_layers=window_layers,
        qk_norm=qk_norm,
        qk_norm_over=draw(st.sampled_from(o.qk_norm_spans)) if qk_norm else "head",
        pre_norms=not (sandwich and normalization in ("RMS", "RMSPre")) or draw(st.sampled_from(o.pre_norms)),
        norm_gain_offset=0.0 if normalization in ("LN", "LNPre") else draw(st.sampled_from(o.norm_gain_offsets)),
        post_norms=sandwich,
        rotary_interleaved=positional == "rotary" and draw(st.sampled_from(o.rotary_interleaved)),
        embedding_norm=(position, normalization, positional) == ("pre", "LN", "alibi") and draw(st.sampled_from(o.embedding_norm)),
        rotary_base_local=draw(st.sampled_from([100.0, 1e6])) if positional == "rotary" and window is not None
        and draw(st.sampled_from(o.local_rotary_base)) else None,
        **caps,
    )


def state_dicts(
    cfg: Config,
    *,
    dtype: torch.dtype = torch.float64,
    min_gain_spread: float = 0.0,
    max_gain_spread: float = 0.8,
    min_bias_scale: float = 0.1,
    max_bias_scale: float = 2.0,
    max_outlier_dims: int = 3,
    max_outlier_scale: float = 30.0,
    device: torch.device | str | None = None,
) -> st.SearchStrategy[dict]:
    """Strategy for state dicts of ``cfg`` in ``dtype`` on ``device``, with drawn structure.

    ``device=None``: the device named by the environment variable :data:`DEVICE_VARIABLE`, else
    the CPU (the weights are drawn on the CPU and moved, the same for every device).

    The gain spread, bias scale, number of outlier residual dimensions and their scale are drawn
    from the given ranges and passed to :func:`circuitmath.random_state_dict`. A negative
    control that needs non-trivial gains (a wrong fold that only differs when ``w != 1``) sets
    ``min_gain_spread > 0``.

    >>> from hypothesis import given, settings
    >>> from circuitmath import Config, expected_shapes
    >>> cfg = Config(n_layers=1, d_model=4, n_heads=2, d_head=2, d_vocab=5, n_ctx=3)
    >>> @settings(max_examples=10, deadline=None)
    ... @given(state_dicts(cfg, dtype=torch.float32, min_gain_spread=0.3))
    ... def test_shapes(state_dict):
    ...     assert {k: tuple(v.shape) for k, v in state_dict.items()} == expected_shapes(cfg)
    >>> test_shapes()
    """
    if not isinstance(cfg, Config):
        raise InvalidArgument(f"cfg must be a circuitmath Config, got {type(cfg).__name__}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgument(f"dtype must be a floating torch dtype, got {dtype!r}")
    _check_range("gain_spread", min_gain_spread, max_gain_spread, 0, kind=float)
    _check_range("bias_scale", min_bias_scale, max_bias_scale, 0, kind=float)
    if not (isinstance(max_outlier_dims, int) and max_outlier_dims >= 0):
        raise InvalidArgument(f"max_outlier_dims must be an int >= 0, got {max_outlier_dims!r}")
    if not max_outlier_scale >= 1:
        raise InvalidArgument(f"max_outlier_scale must be >= 1, got {max_outlier_scale!r}")
    where = _device(device)
    return st.builds(
        lambda seed, spread, bias, outliers, scale: random_state_dict(
            cfg, seed=seed, dtype=dtype, gain_spread=spread, bias_scale=bias,
            outlier_dims=min(outliers, cfg.d_model), outlier_scale=scale, device=where),
        st.integers(0, 2**32 - 1),
        st.floats(min_gain_spread, max_gain_spread),
        st.floats(min_bias_scale, max_bias_scale),
        st.integers(0, max_outlier_dims),
        st.floats(1.0, max_outlier_scale),
    )


def models(
    *, dtype: torch.dtype = torch.float64, weights: dict | None = None, device: torch.device | str | None = None,
    **config_options
) -> st.SearchStrategy[tuple[Config, dict]]:
    """Strategy for ``(cfg, state_dict)`` pairs.

    ``config_options`` go to :func:`configs`, ``weights`` (a dict of keyword options) and
    ``device`` to :func:`state_dicts`.

    >>> from hypothesis import given, settings
    >>> from circuitmath import center_unembed
    >>> from circuitmath.testing import assert_equivalent
    >>> @settings(max_examples=10, deadline=None)
    ... @given(models(max_layers=1, weights={"min_bias_scale": 0.5}))
    ... def test_center_unembed(model):
    ...     cfg, state_dict = model
    ...     centered, centered_cfg = center_unembed(state_dict, cfg)
    ...     assert_equivalent(state_dict, centered, cfg, after_cfg=centered_cfg)
    >>> test_center_unembed()
    """
    weights = dict(weights or {})
    configs_strategy = configs(**config_options)
    state_dicts(Config(n_layers=0, d_model=2, n_heads=1, d_head=2, d_vocab=2, n_ctx=1), dtype=dtype, device=device,
                **weights)
    return configs_strategy.flatmap(
        lambda cfg: state_dicts(cfg, dtype=dtype, device=device, **weights).map(lambda sd: (cfg, sd)))


def tokens(cfg: Config, *, max_batch: int = 2) -> st.SearchStrategy[torch.Tensor]:
    """Strategy for token tensors ``[batch, pos]`` with ``1 <= pos <= n_ctx``.

    >>> from hypothesis import given, settings
    >>> from circuitmath import Config
    >>> cfg = Config(n_layers=0, d_model=2, n_heads=1, d_head=2, d_vocab=7, n_ctx=4)
    >>> @settings(max_examples=10, deadline=None)
    ... @given(tokens(cfg, max_batch=3))
    ... def test_in_range(ids):
    ...     assert ids.shape[0] <= 3 and ids.shape[1] <= 4 and 0 <= int(ids.min()) and int(ids.max()) < 7
    >>> test_in_range()
    """
    if not isinstance(cfg, Config):
        raise InvalidArgument(f"cfg must be a circuitmath Config, got {type(cfg).__name__}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise InvalidArgument(f"max_batch must be an int >= 1, got {max_batch!r}")

    @st.composite
    def build(draw):
        batch = draw(st.integers(1, max_batch))
        length = draw(st.integers(1, cfg.n_ctx))
        ids = draw(st.lists(st.integers(0, cfg.d_vocab - 1), min_size=batch * length, max_size=batch * length))
        return torch.tensor(ids, dtype=torch.long).reshape(batch, length)

    return build()
