"""Model objects as checks take them: a ``transformers`` model, a TransformerLens bridge, any ``nn.Module``.

:func:`as_state_dict` turns each into the state dict and config the rest of circuitmath reads,
once, at the public boundary:

- a TransformerLens ``TransformerBridge``: its parameters in TransformerLens names and shapes
  (the bridge's ``tl_parameters()``, which already turn its stored ``q``/``k``/``v`` matrices,
  laid out ``[out, in]`` or ``[in, out]`` by architecture, into ``W_Q [n_heads, d_model,
  d_head]``), its norms as its forward pass reads them (``state_dict()``'s ``ln1.weight``: after
  ``process_weights`` the ``w`` that ``tl_parameters`` reports is stale), grouped keys and values
  taken back from the per-query-head copies it hands out, and its config read from the
  ``transformers`` model it wraps (the converter of its ``model_type``). What ``tl_parameters``
  leaves out is read as the family's converter reads it: QK-norms, sandwich norms and an
  embedding norm from ``state_dict()``, the one norm both parallel branches read as ``ln1`` and
  ``ln2``, a LayerNorm without a bias as one whose bias is zero, learned positions from the row
  the embedding's ``offset`` says position 0 reads (OPT's 2), the logit scale the wrapped model
  multiplies by (Cohere's, 1 once the bridge folds it into the unembedding); a parameter it
  makes up that its forward pass does not read (BLOOM's ``W_pos``) is left out;
- a ``transformers`` ``PreTrainedModel``: ``state_dict()`` in Hugging Face names with
  ``model.config`` (converted by :func:`circuitmath.io.from_hf`);
- any other ``nn.Module``: its ``state_dict()``, in a naming circuitmath reads (TransformerLens's
  with a :class:`~circuitmath.Config`, or a Hugging Face architecture's with its config), with
  ``module.config`` when it has one and no config is given.

Tensors are shared with the module (``state_dict()`` detaches them; nothing writes to them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from ._config import Config
from ._errors import StateDictError
from ._state import expected_shapes

__all__ = ["as_state_dict", "is_model_object", "own_config"]


def _is_bridge(source) -> bool:
    return callable(getattr(source, "tl_parameters", None)) and hasattr(type(source), "original_model")


def is_model_object(source) -> bool:
    """Whether ``source`` is a model object (a bridge or an ``nn.Module``), not a state dict or a path."""
    return _is_bridge(source) or isinstance(source, torch.nn.Module)


def own_config(source):
    """The config a model object carries (a ``transformers`` config; for a bridge, its wrapped
    model's), or ``None``."""
    if _is_bridge(source):
        return getattr(getattr(source, "original_model", None), "config", None)
    return getattr(source, "config", None) if isinstance(source, torch.nn.Module) else None


def as_state_dict(source, cfg=None, *, required: bool = True):
    """``(state_dict, cfg)`` of a model object (see the module's documentation); anything else
    is returned as it is. ``cfg`` given wins over the object's own config; an ``nn.Module``
    without one is refused unless not ``required`` (then its config is ``None``)."""
    if _is_bridge(source):
        return _bridge_state_dict(source, cfg)
    if isinstance(source, torch.nn.Module):
        config = cfg if cfg is not None else getattr(source, "config", None)
        if config is None and required:
            raise StateDictError(
                f"a {type(source).__name__} has no .config: pass its config (a circuitmath Config for"
                " TransformerLens names, or the Hugging Face config of its architecture's names)")
        return dict(source.state_dict()), config
    return source, cfg


#: A bridge parameter in TransformerLens names -> its key in ``bridge.state_dict()`` (the tensors
#: its forward pass reads; ``tl_parameters()`` can hold stale copies of biases and norms).
_LIVE = [
    (re.compile(r"(blocks\.\d+\.(?:ln[12](?:_post)?|attn\.[qk]_norm)|ln_final)\.w"), r"\1.weight"),
    (re.compile(r"(blocks\.\d+\.ln[12]|ln_final)\.b"), r"\1.bias"),
    (re.compile(r"(blocks\.\d+\.attn)\.W_([QKVO])"), lambda m: f"{m[1]}.{m[2].lower()}.weight"),
    (re.compile(r"(blocks\.\d+\.attn)\.b_([QKVO])"), lambda m: f"{m[1]}.{m[2].lower()}.bias"),
    (re.compile(r"(blocks\.\d+\.mlp)\.W_(in|out|gate)"), r"\1.\2.weight"),
    (re.compile(r"(blocks\.\d+\.mlp)\.b_(in|out|gate)"), r"\1.\2.bias"),
    (re.compile(r"embed\.W_E"), "embed.weight"),
    (re.compile(r"embed\.ln\.w"), "embed_ln.weight"),
    (re.compile(r"embed\.ln\.b"), "embed_ln.bias"),
    (re.compile(r"pos_embed\.W_pos"), "pos_embed.weight"),
    (re.compile(r"unembed\.W_U"), "unembed.weight"),
    (re.compile(r"unembed\.b_U"), "unembed.bias"),
]


def _live_key(name: str) -> str | None:
    for pattern, key in _LIVE:
        if pattern.fullmatch(name):
            return pattern.sub(key, name)
    return None


def _bridge_config(bridge, cfg) -> Config:
    from ._hf import hf_layout

    if isinstance(cfg, Config):
        return cfg
    config = cfg if cfg is not None else getattr(getattr(bridge, "original_model", None), "config", None)
    if config is None or not hasattr(config, "model_type") and not isinstance(config, Mapping):
        raise StateDictError(
            f"this {type(bridge).__name__} wraps no transformers model with a config: pass its circuitmath Config")
    read = hf_layout(config).cfg
    scale = getattr(getattr(bridge, "original_model", None), "logit_scale", None)
    if read.logit_scale is not None and isinstance(scale, (int, float)) and scale != read.logit_scale:
        # the scale the wrapped model's forward multiplies by (1 once the bridge folded it into W_U)
        read = read.replace(logit_scale=None if scale == 1 else float(scale))
    return read


def _as_matrix(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A TransformerLens weight as the ``[in, out]`` matrix of its map (per-head ones with heads joined)."""
    kind = name.rsplit(".", 1)[-1].lstrip("_")
    if kind in ("W_Q", "W_K", "W_V"):
        return tensor.permute(1, 0, 2).reshape(tensor.shape[1], -1)
    if kind == "W_O":
        return tensor.reshape(-1, tensor.shape[-1])
    return tensor


def _bridge_state_dict(bridge, cfg) -> tuple[dict[str, torch.Tensor], Config]:
    """The bridge's parameters in circuitmath's names and shapes, each checked against (biases and
    norms: taken from) the tensor its forward pass reads."""
    cfg = _bridge_config(bridge, cfg)
    params = {name: tensor.detach() for name, tensor in bridge.tl_parameters().items()}
    if cfg.n_key_value_heads and cfg.n_key_value_heads < cfg.n_heads:
        _regroup(params, cfg)
    live = bridge.state_dict()
    shapes = expected_shapes(cfg)
    for name in shapes.keys() - params.keys():  # read from the live tensors below
        params[name] = torch.empty(0)
    for name in params.keys() - shapes.keys():  # made up by the bridge (BLOOM's W_pos): nothing reads it
        if live.get(_live_key(name.replace("._", ".")) or "") is None:
            del params[name]
    for name, tensor in params.items():
        key = _live_key(name.replace("._", "."))
        stored = live.get(key) if key else None
        if stored is None:
            continue
        stored = stored.detach()
        if stored.dim() == 1:  # a bias or a norm, shaped as the config says (the bridge's config can differ)
            shape = shapes.get(name, tensor.shape)
            if stored.numel() != math.prod(shape):
                raise StateDictError(f"the bridge's {key} has {stored.numel()} entries, its {name} {math.prod(shape)}")
            params[name] = stored.reshape(shape)
            continue
        offset = _position_offset(bridge) if name == "pos_embed.W_pos" else None
        if offset is not None:  # position p reads row p + offset
            stored, params[name] = stored[offset:offset + cfg.n_ctx], tensor[offset:offset + cfg.n_ctx]
            tensor = params[name]
        matrix = _as_matrix(name, tensor)
        if not any(candidate.shape == matrix.shape and torch.equal(candidate, matrix) for candidate in (stored, stored.T)):
            raise StateDictError(
                f"the bridge's {name} (tl_parameters) is not the weight {key} its forward pass reads, in either"
                " layout ([in, out] or [out, in]): pass the processed model's state dict instead")
    _absent_norms(params, cfg)
    _from_wrapped_modules(bridge, params)
    for name in [name for name, tensor in params.items() if tensor.numel() == 0]:
        del params[name]  # the state's validation names what is missing
    return params, cfg


def _from_wrapped_modules(bridge, params: dict[str, torch.Tensor]) -> None:
    """The block tensors the bridge holds in neither ``tl_parameters()`` nor ``state_dict()`` (a
    mixture of experts' batched experts, router and shared expert; attention sinks), read by the
    family's converter from the modules of the model it wraps (the tensors its forward pass reads)."""
    from ._hf import hf_layout

    missing = [name for name, tensor in params.items() if tensor.numel() == 0 and name.startswith("blocks.")]
    config = getattr(getattr(bridge, "original_model", None), "config", None)
    if not missing or config is None:
        return
    layout = hf_layout(config)
    wrapped = {name.replace("._original_component", ""): tensor for name, tensor in bridge.original_model.state_dict().items()}
    src = layout.source(wrapped)
    read = {}
    for layer in sorted({int(name.split(".")[1]) for name in missing}):
        read |= layout.block(src, layer)
    params.update({name: read[name] for name in missing if name in read})


def _position_offset(bridge) -> int | None:
    """The row of learned positions that position 0 reads, where the embedding says (OPT: 2)."""
    offset = getattr(getattr(getattr(bridge, "pos_embed", None), "original_component", None), "offset", None)
    return offset if isinstance(offset, int) and not isinstance(offset, bool) else None


def _absent_norms(params: dict[str, torch.Tensor], cfg: Config) -> None:
    """Norms the bridge holds no tensor for, as the family's converter reads them: ``ln2`` of
    parallel branches that both read ``ln1``, a zero bias of a LayerNorm that has none."""
    for name in [name for name, tensor in params.items() if tensor.numel() == 0]:
        if cfg.parallel_attn_mlp and ".ln2." in name and params[name.replace(".ln2.", ".ln1.")].numel():
            params[name] = params[name.replace(".ln2.", ".ln1.")]
    for name in [name for name, tensor in params.items() if tensor.numel() == 0]:
        gain = params.get(name[:-1] + "w")
        if name.endswith(".b") and cfg.normalization_type == "LN" and gain is not None and gain.numel():
            params[name] = torch.zeros_like(gain)


def _regroup(params: dict[str, torch.Tensor], cfg: Config) -> None:
    """Grouped-query keys and values as circuitmath stores them (``attn._W_K [n_key_value_heads,
    d_model, d_head]``), from the copies per query head the bridge hands out, checked to be copies."""
    repeats = cfg.n_heads // cfg.n_key_value_heads
    for layer in range(cfg.n_layers):
        for kind in ("W_K", "W_V", "b_K", "b_V"):
            name = f"blocks.{layer}.attn.{kind}"
            tensor = params.pop(name, None)
            if tensor is None:
                continue
            if tensor.shape[0] == cfg.n_heads:
                grouped = tensor[::repeats]
                if not torch.equal(grouped.repeat_interleave(repeats, dim=0), tensor):
                    raise StateDictError(
                        f"the bridge's {name} is not {cfg.n_key_value_heads} key/value heads each repeated for"
                        f" {repeats} query heads, as its config's grouped-query attention says")
                tensor = grouped
            params[f"blocks.{layer}.attn._{kind}"] = tensor
