"""What every Hugging Face converter shares: the config readers, :class:`_Source` (a checkpoint's
tensors being consumed) and :class:`Layout` (how its tensors become a state dict in the reference
conventions, part by part). The converters themselves are in :mod:`circuitmath._hf` and
:mod:`circuitmath._hf_families`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ._config import Config
from ._errors import ConfigError, InputError, StateDictError
from ._state import StateDict, validate_state_dict

# No __all__: circuitmath.io lists the public names (one list), and the package imports the rest by name.


class UnsupportedArchitectureError(InputError):
    """A Hugging Face config uses an option the reference forward pass does not reproduce."""



def _option(config, name: str, default=None):
    """``config[name]`` for a dict (a config.json), ``config.name`` for a transformers config."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


_MISSING = object()


def _int(config, name: str, architecture: str, default=_MISSING, *, floor: int = 1) -> int:
    """The integer field ``name`` of a Hugging Face config (``ConfigError`` naming it otherwise)."""
    value = _option(config, name, default)
    if value is _MISSING:
        raise ConfigError(f"{architecture} config: the field {name!r} is missing")
    if value is None and default is None:  # an optional field (n_inner, head_dim) left unset
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < floor:
        raise ConfigError(f"{architecture} config: {name} must be an int >= {floor}, got {value!r}")
    return value


def _number(config, name: str, architecture: str, default: float) -> float:
    """The finite number field ``name`` of a Hugging Face config."""
    value = _option(config, name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{architecture} config: {name} must be a finite number, got {value!r}")
    return float(value)


class _Source:
    """A Hugging Face state dict being consumed: every tensor taken is ticked off, so that
    :meth:`finish` can refuse tensors nobody converted."""

    def __init__(self, state_dict: StateDict, prefixes: tuple[str, ...], ignored: str | None = None):
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"expected a mapping of names to tensors, got {type(state_dict).__name__}")
        if not all(isinstance(name, str) for name in state_dict):
            raise StateDictError("the checkpoint's tensor names must be strings")
        names = {n: n for n in state_dict}
        for prefix in prefixes:  # a task model (GPT2LMHeadModel, BertForX) nests the base model
            if any(n.startswith(prefix) for n in names):
                stripped = [n[len(prefix):] if n.startswith(prefix) else n for n in names]
                twice = sorted(n for n, count in Counter(stripped).items() if count > 1)
                if twice:
                    raise StateDictError(f"the checkpoint has {twice} both with and without the prefix {prefix!r}")
                names = dict(zip(stripped, names))
                break
        skip = re.compile(ignored) if ignored else None
        # Tensors are looked up when taken, so a lazy mapping (a checkpoint read from disk,
        # circuitmath.io.open_checkpoint) is read one part at a time.
        self.state_dict, self.names = state_dict, {n: o for n, o in names.items() if not (skip and skip.fullmatch(n))}
        # False for placeholders that hold no values (a structure being checked)
        self.holds_values = getattr(state_dict, "holds_values", True)
        self.unused = set(self.names)
        floats = {t.dtype for t in map(state_dict.get, self.names.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if len(floats) != 1:
            raise StateDictError(f"expected one floating dtype in the checkpoint, found {sorted(map(str, floats)) or 'none'}")
        self.dtype = floats.pop()

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def take(self, name: str, *shape: int) -> torch.Tensor:
        """The tensor ``name``, checked to have ``shape`` when one is given (before any reshape)."""
        if name not in self.names:
            raise StateDictError(f"the checkpoint has no tensor {name!r}")
        tensor = self.state_dict[self.names[name]]
        if not isinstance(tensor, torch.Tensor):
            raise StateDictError(f"the checkpoint's {name!r} is a {type(tensor).__name__}, not a tensor")
        if shape and tuple(tensor.shape) != shape:
            raise StateDictError(f"the checkpoint's {name!r} has shape {tuple(tensor.shape)}, the config implies {shape}")
        self.unused.discard(name)
        return tensor.detach()

    def linear(self, name: str, out_features: int, in_features: int) -> torch.Tensor:
        """A ``torch.nn.Linear`` weight ``[out, in]`` as the row-vector map ``[in, out]``."""
        return self.take(name, out_features, in_features).T

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype)

    def finish(self, out: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], Config]:
        self.all_used()
        out = {name: tensor.contiguous() for name, tensor in out.items()}
        validate_state_dict(out, cfg)
        return out, cfg

    def all_used(self) -> None:
        """Refuse tensors no part of the conversion took."""
        if self.unused:
            raise StateDictError(
                f"the checkpoint has tensors this converter does not use: {sorted(self.unused)}; the config"
                " does not describe the weights, or the architecture has a part the reference lacks"
            )


@dataclass(frozen=True)
class Layout:
    """How a checkpoint's tensors become a state dict in the reference conventions, part by part.

    ``cfg`` is the converted model's config; ``prefixes`` and ``ignored`` are those of
    :class:`_Source`. ``embed(source)`` returns the tensors before the first block (``embed.*``,
    ``pos_embed.*``), ``block(source, layer)`` those of ``blocks.{layer}``, ``final(source)``
    those after the last (``ln_final.*``, ``unembed.*``), each taken from the source by the
    checkpoint's names and checked against the shapes the config implies. The one mapping of
    names and shapes serves a whole model in memory (:meth:`convert`, behind
    :func:`from_hf_gpt2` and the others) and one layer at a time
    (:func:`circuitmath.io.open_checkpoint`).
    """

    cfg: Config
    prefixes: tuple[str, ...]
    ignored: str | None
    embed: Callable[[_Source], dict]
    block: Callable[[_Source, int], dict]
    final: Callable[[_Source], dict]

    def source(self, tensors: StateDict) -> _Source:
        return _Source(tensors, self.prefixes, self.ignored)

    def convert(self, tensors: StateDict) -> tuple[dict[str, torch.Tensor], Config]:
        """The whole state dict, validated, with every tensor of ``tensors`` used."""
        src = self.source(tensors)
        out = self.embed(src)
        for layer in range(self.cfg.n_layers):
            out |= self.block(src, layer)
        out |= self.final(src)
        return src.finish(out, self.cfg)


def _activation(hf_name: str, field: str, architecture: str) -> str:
    """The reference's activation for the Hugging Face config's ``field``, whose value is ``hf_name``."""
    known = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
    if not isinstance(hf_name, str):
        raise ConfigError(f"{architecture} config: {field} must be the name of an activation, got {hf_name!r}")
    if hf_name not in known:
        raise UnsupportedArchitectureError(
            f"{architecture}: activation {hf_name!r} is not one the reference has ({sorted(set(known.values()))})"
        )
    return known[hf_name]


def _require(holds: bool, architecture: str, detail: str) -> None:
    if not holds:
        raise UnsupportedArchitectureError(f"{architecture}: {detail}")


def _tied(config, default: bool) -> bool:
    """Whether ``config`` ties the unembedding to the token embedding (``tie_word_embeddings``,
    whose default the architecture sets: ``default``, transformers' for its config class)."""
    tied = _option(config, "tie_word_embeddings", default)
    if not isinstance(tied, bool):
        raise ConfigError(f"tie_word_embeddings must be true or false, got {tied!r}")
    return tied


def _unembed(src: "_Source", architecture: str, cfg, embedding: str) -> dict:
    """``unembed.W_U`` (``[d_model, d_vocab]``) from ``lm_head.weight``, else the transposed token
    embedding ``embedding`` where the config ties the two (``cfg.tied_embeddings``);
    ``unembed.b_U`` from ``lm_head.bias`` where the checkpoint has one, else zeros."""
    tied = "lm_head.weight" not in src
    _require(not tied or cfg.tied_embeddings, architecture, "no lm_head.weight and untied embeddings")
    d, vocab = cfg.d_model, cfg.d_vocab
    return {"unembed.W_U": src.take(embedding, vocab, d).T if tied else src.linear("lm_head.weight", vocab, d),
            "unembed.b_U": src.take("lm_head.bias", vocab) if "lm_head.bias" in src else src.zeros(vocab)}


def _heads_from_columns(weight: torch.Tensor, heads: int, d_head: int) -> torch.Tensor:
    """``[d_model, heads * d_head]`` (columns grouped by head) to ``[heads, d_model, d_head]``."""
    return weight.reshape(weight.shape[0], heads, d_head).permute(1, 0, 2)


def _linear_heads(source: _Source, prefix: str, heads: int, d_head: int, d_model: int, bias: bool):
    """A ``torch.nn.Linear`` projecting to ``heads * d_head`` as per-head weight and bias."""
    weight = _heads_from_columns(source.linear(f"{prefix}.weight", heads * d_head, d_model), heads, d_head)
    b = source.take(f"{prefix}.bias", heads * d_head).reshape(heads, d_head) if bias else source.zeros(heads, d_head)
    return weight, b


def _rotary(config, d_head: int, architecture: str) -> tuple[float, int]:
    """``(base, rotary_dim)`` from ``rope_parameters`` (transformers 5) or the older fields."""
    rope = _option(config, "rope_parameters") or {}
    scaling = _option(config, "rope_scaling") or {}
    if not isinstance(rope, Mapping) or not isinstance(scaling, Mapping):
        raise ConfigError(f"{architecture} config: rope_parameters and rope_scaling must be objects")
    kind = rope.get("rope_type", scaling.get("rope_type", "default"))
    _require(kind == "default", architecture, f"rope_type {kind!r}; only the default rotary embedding is in the reference")
    base = rope.get("rope_theta", _option(config, "rope_theta", _option(config, "rotary_emb_base", 10000.0)))
    fraction = rope.get("partial_rotary_factor", _option(config, "rotary_pct", 1.0))
    for name, value, most in (("rope_theta", base, math.inf), ("partial_rotary_factor", fraction, 1)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= most or not math.isfinite(value):
            bound = "a finite number > 0" if most == math.inf else f"a fraction of the head, in (0, {most}]"
            raise ConfigError(f"{architecture} config: {name} must be {bound}, got {value!r}")
    rotary_dim = int(d_head * fraction)
    _require(rotary_dim % 2 == 0 and rotary_dim > 0, architecture, f"rotary dimension {rotary_dim} is not even and positive")
    return float(base), rotary_dim


def _dimensions(config, architecture: str) -> tuple[int, int, int]:
    """``(hidden_size, num_attention_heads, num_hidden_layers)``, the heads dividing the width."""
    d, heads = _int(config, "hidden_size", architecture), _int(config, "num_attention_heads", architecture)
    layers = _int(config, "num_hidden_layers", architecture, floor=0)
    _require(d % heads == 0, architecture, f"hidden_size={d} is not a multiple of num_attention_heads={heads}")
    return d, heads, layers
