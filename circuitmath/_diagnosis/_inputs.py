"""The inputs of a check, resolved once: state dicts or files, TransformerLens or Hugging Face format.

Each file is read once and each state dict validated once; the result is a :class:`Model`
(state dict, config, dtype, and the input's names of its tensors: :mod:`._names`) that the replay,
the forward passes and the report trust. Model objects become state dicts first
(:mod:`circuitmath._models`); pairs no check can mean are refused (:mod:`._misuse`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import io
from .._compare import compare_log_probs, default_tokens
from .._config import Config
from .._errors import ArgumentTypeError, StateDictError
from .._files import naming_file
from .._hf import hf_layout
from .._models import as_state_dict, is_model_object, own_config
from .._processing.norms import uncentered_writers
from .._stored import identity_value
from .._state import StateDict, Validated, check_config_fits, expected_shapes, validated, vouched
from ._misuse import CONFIG_FIRST, another_naming, is_hf_config, label, refuse_misuse
from ._names import InputNames

__all__ = ["Model", "resolve", "resolve_model", "resolve_pair", "resolve_tokens"]


#: Buffers a TransformerLens module's ``state_dict()`` carries besides its parameters.
_TRANSFORMER_LENS_BUFFERS = ("mask", "IGNORE", "rotary_sin", "rotary_cos")


def resolve_model(source, cfg=None) -> tuple[dict[str, torch.Tensor], Config]:
    """``(state_dict, Config)`` in the reference conventions, validated, from any accepted form.

    ``source`` is a state dict or the path of a ``.safetensors`` file or of a Hugging Face model
    folder (``config.json`` and ``model.safetensors``). ``cfg`` is a :class:`~circuitmath.Config`
    (TransformerLens-format names and shapes), a Hugging Face config (its ``config.json`` as a
    dict, or a ``transformers`` config object: the state dict is converted by
    :func:`circuitmath.io.from_hf`), or ``None`` for a file written by :func:`circuitmath.io.save`,
    whose config is read from its metadata. A ``cfg`` given explicitly wins over the metadata.
    TransformerLens's non-parameter buffers (``attn.mask``, ``attn.IGNORE``, rotary tables) are
    dropped. A pickle (``.pt``, ``.bin``, ...) is refused without being read.

    Raises :class:`~circuitmath.StateDictError` (or its subclass from :mod:`circuitmath.io`)
    naming what is wrong.
    """
    model = resolve(source, cfg)
    return dict(model.state_dict), model.cfg  # a plain dict: the caller's to change


@dataclass(frozen=True, eq=False)
class Model:
    """One input resolved once: its state dict in the reference conventions, validated against
    its config (a :class:`~circuitmath._state.Validated`), and its floating dtype. Everything
    after resolution (the replay, the forward passes, the diagnosis) trusts it and does not read
    or validate it again."""

    state_dict: Validated
    cfg: Config
    dtype: torch.dtype
    #: The input's own names of its tensors (``None``: circuitmath's, as the input gave them).
    names: "InputNames | None" = None


def resolve(source, cfg=None, *, loaded: tuple[dict, dict] | None = None) -> Model:
    """:func:`resolve_model` as a :class:`Model`; ``loaded`` is ``(tensors, metadata)`` of the
    file ``source`` when they have been read already (each file is read once)."""
    if isinstance(source, Config):
        raise ArgumentTypeError(CONFIG_FIRST)
    if is_model_object(source):
        source, cfg = as_state_dict(source, cfg)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists() and not path.is_symlink():
            raise StateDictError(f"{path}: no such file or folder")
        if path.is_dir():
            if cfg is not None:
                raise StateDictError(f"{path} is a Hugging Face folder with its own config.json; pass no config")
            checkpoint = io.open_checkpoint(path)
            state_dict, hf_cfg = checkpoint.load()  # validated as it is read
            names = None if checkpoint.native is None else InputNames.of(checkpoint.native, dict(checkpoint.tensors))
            return _model(vouched(state_dict, hf_cfg), names)
        with naming_file(path):  # every error names the file
            tensors, metadata = loaded if loaded is not None else io.load_tensors(path)
            if cfg is None:
                cfg = io.stored_config(path, metadata)
                if cfg is None:
                    raise StateDictError(
                        f"{path} carries no circuitmath config in its metadata (it was not written by"
                        " circuitmath.io.save): pass its config (a circuitmath Config or a Hugging Face config;"
                        " --config CFG.json on the command line)"
                    )
            return _resolve_mapping(tensors, cfg)
    return _resolve_mapping(source, cfg)


def _resolve_mapping(source, cfg) -> Model:
    """A state dict with a circuitmath or Hugging Face ``cfg``, TransformerLens buffers dropped."""
    if not isinstance(source, Mapping):
        raise StateDictError(f"expected a state dict, a .safetensors path, a folder or a model (a transformers"
                             f" model, a TransformerLens bridge, an nn.Module), got {type(source).__name__}")
    if cfg is None:
        raise StateDictError("a state dict needs its config: a circuitmath Config or a Hugging Face config")
    try:
        if is_hf_config(cfg):
            state_dict, converted = io.from_hf(dict(source), cfg)  # validated by the conversion
            return _model(vouched(state_dict, converted), InputNames.of(hf_layout(cfg), source))
        if not isinstance(cfg, Config):
            raise StateDictError(f"expected a circuitmath Config or a Hugging Face config, got {type(cfg).__name__}")
        return _model(validated(_without_buffers(source, cfg), cfg))
    except StateDictError as error:
        raise another_naming(source, cfg) or error


def _without_buffers(source: Mapping, cfg: Config) -> dict[str, torch.Tensor]:
    """``source`` without TransformerLens's non-parameter buffers (``attn.mask``, rotary tables)."""
    check_config_fits(source, cfg)
    shapes = expected_shapes(cfg)
    return {
        name: tensor
        for name, tensor in source.items()
        if not (name.rsplit(".", 1)[-1] in _TRANSFORMER_LENS_BUFFERS and name not in shapes)
    }


def _model(state_dict: Validated, names: "InputNames | None" = None) -> Model:
    return Model(state_dict, state_dict.cfg, state_dict.dtype, names)


def _processed_forms(cfg: Config) -> list[Config]:
    """``cfg`` and the configs processing can turn it into without changing any size."""
    forms = [cfg]
    bare = {"LN": "LNPre", "RMS": "RMSPre"}.get(cfg.normalization_type)
    if bare:  # folded, a pre-norm model's embedding LayerNorm is in W_E (BLOOM's)
        folded = {"embedding_norm": False} if cfg.embedding_norm and cfg.norm_position == "pre" else {}
        forms.append(cfg.replace(normalization_type=bare, **folded))
    if cfg.positional_embedding_type == "shortformer":
        forms += [form.replace(positional_embedding_type="shortformer_tables") for form in forms]
    return forms


def _resolve_after(after, after_cfg, before_cfg: Config, cfg, before: Model | None = None) -> Model:
    """Resolve ``after``: with ``after_cfg``, else from a file's metadata, else in the format of
    ``before`` (a Hugging Face ``cfg`` converts a Hugging Face state dict), read against
    ``before``'s config or the first processed form of it that its tensors fit. A file is read
    once, and validated against one form: the one its tensor names fit (the others only for the
    error message when none fits)."""
    if isinstance(after, Config):
        raise ArgumentTypeError(CONFIG_FIRST)
    if after_cfg is not None:
        return resolve(after, after_cfg)
    if is_model_object(after):  # read with its own config; a module without one, as a state dict is
        after, own_cfg = as_state_dict(after, required=False)
        if own_cfg is not None:
            return resolve(after, own_cfg)
    if isinstance(after, (str, os.PathLike)):
        path = Path(after)
        if path.is_dir() or not path.exists():
            return resolve(after)
        tensors, metadata = io.load_tensors(path)
        if io.CONFIG_KEY in metadata:
            return resolve(after, loaded=(tensors, metadata))
        after = tensors
    if is_hf_config(cfg) and isinstance(after, Mapping) and "embed.W_E" not in after:
        return resolve(after, cfg)
    if not isinstance(after, Mapping):
        raise StateDictError(f"expected a state dict, a .safetensors path, a folder or a model (a transformers"
                             f" model, a TransformerLens bridge, an nn.Module), got {type(after).__name__}")
    forms = _processed_forms(before_cfg)
    fitting = [form for form in forms if set(_without_buffers(after, form)) == set(expected_shapes(form))]
    first_error = None
    for form in fitting[:1] + [form for form in forms if form not in fitting[:1]]:
        try:
            resolved = resolve(after, form)
        except StateDictError as error:
            first_error = first_error or error
            continue
        return _layer_norm_or_rms_norm(resolved, before) if before is not None else resolved
    raise StateDictError(
        f"the processed state dict fits neither the model's config nor a processed form of it"
        f" ({', '.join(f.normalization_type or 'no norm' for f in forms[1:]) or 'none'}):"
        f" {first_error}"
    ) from None


def _layer_norm_or_rms_norm(resolved: Model, before: Model) -> Model:
    """``LNPre`` or ``RMSPre``: the two have the same tensors. Read as ``LNPre`` (a folded
    LayerNorm) unless a writer is not centered: then ``LNPre`` and ``RMSPre`` compute different
    functions (after ``layer_norm_to_rms_norm`` and a rotation the writes are not centered), and
    the embeddings decide (:func:`_norm_of_embedding`); where they do not, the form whose
    log-probs are closer to ``before``'s on the default tokens is taken."""
    if resolved.cfg.normalization_type != "LNPre" or before.cfg.normalization_type != "LN":
        return resolved
    if not uncentered_writers(resolved.state_dict, resolved.cfg):
        return resolved
    rms = resolved.cfg.replace(normalization_type="RMSPre")
    read = _norm_of_embedding(before.state_dict["embed.W_E"], resolved.state_dict["embed.W_E"])
    if read is None:
        tokens = default_tokens(before.cfg)
        errors = [compare_log_probs(before.state_dict, before.cfg, resolved.state_dict, form, tokens).max_abs_error
                  for form in (resolved.cfg, rms)]
        read = "RMSPre" if errors[1] < errors[0] else "LNPre"
    return _model(vouched(resolved.state_dict, rms), resolved.names) if read == "RMSPre" else resolved


#: How far apart (in units of the coarser dtype's ``eps``, relative to the largest row norm) the row
#: norms of two embeddings may be and count as the same: a rotation computed in float64 and
#: rounded once moves each norm by about one unit.
EMBEDDING_NORM_ULPS = 16


def _norm_of_embedding(before: torch.Tensor, after: torch.Tensor) -> str | None:
    """The norm a processed LayerNorm model with uncentered writes reads its stream with, told by
    its embedding ``after`` against the original's ``before`` (``[d_vocab, d_model]`` each):
    ``"LNPre"`` where the embedding is the original's, or its rows keep their norms (the fold
    leaves writers alone; a rotation that keeps ``1`` fixed leaves them uncentered);
    ``"RMSPre"`` where its rows have the norms of the original's rows centered (the writers
    centered, the norm switched to RMSNorm and the stream rotated: the SliceGPT route); ``None``
    where neither or both hold (another change, or rows too close to centered already)."""
    if before.shape != after.shape:
        return None
    if torch.equal(before, after.to(before.device)):
        return "LNPre"
    original = before.double()
    norms = after.double().norm(dim=-1).to(original.device)
    tolerance = EMBEDDING_NORM_ULPS * max(torch.finfo(before.dtype).eps, torch.finfo(after.dtype).eps)
    tolerance *= max(float(norms.max()), 1e-30)
    keeps = float((original.norm(dim=-1) - norms).abs().max()) <= tolerance
    centered = float(((original - original.mean(dim=-1, keepdim=True)).norm(dim=-1) - norms).abs().max()) <= tolerance
    return None if keeps == centered else "LNPre" if keeps else "RMSPre"


def _norm_parameters(cfg: Config) -> list[str]:
    """The names of every norm gain and bias ``cfg`` implies."""
    bare = {"LN": "LNPre", "RMS": "RMSPre"}.get(cfg.normalization_type)
    if bare is None or cfg.embedding_norm and cfg.norm_position == "pre":
        return []  # a pre-norm model's embedding LayerNorm (BLOOM's) has no bare form: it goes only into W_E
    return sorted(set(expected_shapes(cfg)) - set(expected_shapes(cfg.replace(normalization_type=bare))))


def _without_identity_norms(state_dict: StateDict, cfg: Config) -> tuple[dict, Config, str | None]:
    """Drop norms whose gains all apply 1 and biases are all 0, which compute ``LNPre`` (``RMSPre``):
    stored as 1, or as 0 where the gain is applied as ``1 + w`` (Gemma). ``state_dict`` is a
    :class:`~circuitmath._state.Validated`; so is the state dict returned.

    Tools that fold a norm often keep it with unit gain and zero bias (TransformerLens does); the
    replayed rewrite drops it. Returns the state dict, its config and a note saying what was read.
    """
    names = _norm_parameters(cfg)
    if not names or any(not bool((state_dict[n] == identity_value(n, cfg.norm_gain_offset)).all()) for n in names):
        return state_dict, cfg, None
    bare = "LNPre" if cfg.normalization_type == "LN" else "RMSPre"
    unit = f"stored gain is {identity_value('ln_final.w', cfg.norm_gain_offset):g}"
    gains = f"{unit} and bias 0" if cfg.normalization_type == "LN" else unit
    note = f"every {cfg.normalization_type} {gains}: read as {bare}, the same function"
    bare_cfg = cfg.replace(normalization_type=bare)
    return vouched({k: v for k, v in state_dict.items() if k not in names}, bare_cfg, state_dict.dtype), bare_cfg, note


def resolve_pair(before, after, cfg, after_cfg) -> tuple[Model, Model, list[str]]:
    """``before`` and ``after`` resolved once each (see :func:`resolve` and :func:`_resolve_after`),
    a folded norm kept with unit gain and zero bias read as none; and notes on how they were read.
    A diagnosis of the pair names the tensors as ``after`` does (``after``'s ``names``)."""
    if isinstance(before, Config) or isinstance(after, Config):
        raise ArgumentTypeError(CONFIG_FIRST)
    if cfg is None and is_model_object(before):  # its config reads an ``after`` in the same names
        cfg = own_config(before)
    first = resolve(before, cfg)
    second = _resolve_after(after, after_cfg, first.cfg, cfg, before=first)
    state_dict, second_cfg, note = _without_identity_norms(second.state_dict, second.cfg)
    refuse_misuse(first.cfg, second_cfg, label(before, "before"), label(after, "after"))
    return first, dataclasses.replace(second, state_dict=state_dict, cfg=second_cfg), [note] if note else []


def resolve_tokens(tokens, cfg: Config) -> torch.Tensor:
    """``tokens`` as given, :func:`default_tokens` for ``None``, or ``tokens(cfg)`` for a callable."""
    if tokens is None:
        return default_tokens(cfg)
    given = tokens(cfg) if callable(tokens) else tokens
    return given if isinstance(given, torch.Tensor) else torch.as_tensor(given, device="cpu")
