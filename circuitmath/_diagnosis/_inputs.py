"""The inputs of a check, resolved once: state dicts or files, TransformerLens or Hugging Face format.

Each file is read once and each state dict validated once; the result is a :class:`Model`
(state dict, config, dtype) that the replay, the forward passes and the report trust.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import io
from .._compare import compare_log_probs, default_tokens
from .._config import Config
from .._errors import ArgumentTypeError, InputError, StateDictError
from .._files import _about
from .._hf import Layout, hf_layout
from .._stored import _grouped
from .._models import as_state_dict, is_model_object, own_config
from .._processing.norms import uncentered_writers
from .._state import StateDict, check_config_fits, expected_shapes, validate_state_dict

__all__ = ["Model", "InputNames", "input_names", "checkpoint_names", "speak", "speaking_input_names", "resolve", "resolve_model", "resolve_pair", "resolve_tokens", "refuse_misuse",
           "refuse_misused_checkpoints"]


#: Buffers a TransformerLens module's ``state_dict()`` carries besides its parameters.
_TRANSFORMER_LENS_BUFFERS = ("mask", "IGNORE", "rotary_sin", "rotary_cos")


def _is_hf_config(cfg) -> bool:
    if cfg is None or isinstance(cfg, Config):
        return False
    if isinstance(cfg, Mapping):
        return "model_type" in cfg
    return hasattr(cfg, "model_type")


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
    return model.state_dict, model.cfg


@dataclass(frozen=True, eq=False)
class Model:
    """One input resolved once: its state dict in the reference conventions, validated against
    its config, and its floating dtype. Everything after resolution (the replay, the forward
    passes, the diagnosis) trusts it and does not read or validate it again."""

    state_dict: dict[str, torch.Tensor]
    cfg: Config
    dtype: torch.dtype
    #: The input's own names of its tensors (``None``: circuitmath's, as the input gave them).
    names: "InputNames | None" = None


class InputNames:
    """Each tensor of a converted model by the name and the entries it has in the input: the
    converter's view ``blocks.1.mlp.W_in`` of the stored ``model.layers.1.mlp.up_proj.weight``,
    and where a view lies in its stored tensor (``transformer.h.0.attn.c_attn.weight[:, 8:16]``
    for head 1 of ``W_Q``). Built once from the converter's views of the input's tensors: no
    tensor is copied or read."""

    def __init__(self, views: dict[str, tuple]):
        self.views = views  # circuitmath name -> (stored name, stored shape, view shape, view strides, offset)

    @classmethod
    def of(cls, layout: Layout, stored: Mapping[str, torch.Tensor]) -> "InputNames":
        """The names ``layout`` (a converter) takes from ``stored`` (the input's tensors by their names)."""
        views = {}
        for part in [None, *range(layout.cfg.n_layers)]:
            converted, through, _made_up = _grouped(layout, stored, part)
            for name, taken in through.items():
                base = stored[name]
                for view_name in taken:
                    view = converted[view_name]
                    if base.is_contiguous() and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
                        views[view_name] = (name, tuple(base.shape), tuple(view.shape), view.stride(),
                                            view.storage_offset() - base.storage_offset())
                    else:
                        views[view_name] = (name, None, None, None, None)
        return cls(views)

    def name(self, name: str, heads: tuple[int, ...] = ()) -> str:
        """``name`` (a circuitmath name) as the input names it, with the entries it (or its ``heads``,
        along the head axis ``0``) takes of the stored tensor: ``q_proj.weight[8:16, :]``."""
        found = self.views.get(name)
        if found is None:
            return name
        stored, shape, view_shape, strides, offset = found
        if shape is None:
            return stored
        whole = [(0, size - 1) for size in view_shape]
        boxes = [[(h, h), *whole[1:]] for h in heads] or [whole]
        slices = []
        for box in boxes:
            described = _slice(shape, strides, offset, box)
            if described is None and view_shape:  # strided across the stored tensor: one piece per index of axis 0
                pieces = [_slice(shape, strides, offset, [(i, i), *box[1:]]) or "" for i in range(box[0][0], box[0][1] + 1)]
                described = ", ".join(pieces if len(pieces) <= 4 else [*pieces[:2], f"... ({len(pieces)} pieces)"])
            slices.append(described or "")
        return stored + ", ".join(dict.fromkeys(s for s in slices if s))

    def index(self, name: str, at: tuple[int, ...]) -> str:
        """The entry ``at`` of ``name`` (a circuitmath name) as the input indexes its stored tensor:
        ``"[5, 3]"`` (empty when the view is not known)."""
        found = self.views.get(name)
        if found is None or found[1] is None or len(at) != len(found[2]):
            return ""
        _stored, shape, _view_shape, strides, offset = found
        return _slice(shape, strides, offset, [(i, i) for i in at]) or ""

    def text(self, text: str | None) -> str | None:
        """``text`` with every circuitmath name the input does not use replaced by the input's."""
        if not text:
            return text
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(self.views, key=len, reverse=True)))
                             + r")(?![\w.])")
        return pattern.sub(lambda match: self.name(match[1]), text)


def _slice(shape: tuple[int, ...], strides, offset: int, box) -> str:
    """The entries of a stored tensor of ``shape`` (contiguous) that the box ``box`` (first and
    last index per axis) of a view (``strides``, ``offset``) covers, as ``[a:b, :]`` (empty when
    the whole tensor; ``None`` when the box's entries are strided across the stored tensor, not a
    box of it): from the box's corners, exact for views that permute, split and narrow axes."""
    low, high = [None] * len(shape), [None] * len(shape)
    for corner in range(2 ** len(box)):
        flat = offset + sum(box[k][(corner >> k) & 1] * strides[k] for k in range(len(box)))
        for axis in reversed(range(len(shape))):
            flat, index = divmod(flat, shape[axis])
            low[axis] = index if low[axis] is None else min(low[axis], index)
            high[axis] = index if high[axis] is None else max(high[axis], index)
    if math.prod(b - a + 1 for a, b in zip(low, high)) != math.prod(b - a + 1 for a, b in box):
        return None  # the box's entries do not fill the stored box: strided
    parts = [":" if (a, b) == (0, n - 1) else str(a) if a == b else f"{a}:{b + 1}" for a, b, n in zip(low, high, shape)]
    return "" if all(p == ":" for p in parts) else f"[{', '.join(parts)}]"


#: The names of the input a check names its tensors by (set as inputs are resolved; see :func:`input_names`).
_NAMING: contextvars.ContextVar = contextvars.ContextVar("circuitmath_naming", default=None)


def _named(model: "Model") -> "Model":
    """``model``, its names now the ones a diagnosis speaks (when a check is collecting them)."""
    holder = _NAMING.get()
    if holder is not None:
        holder[:] = [model.names]
    return model


@contextlib.contextmanager
def input_names():
    """Collect, within, the names of the input a check's tensors are named by (``after`` of a
    pair, the model of a check of one): yields a one-item list, ``[None]`` for circuitmath's names."""
    holder: list = [None]
    token = _NAMING.set(holder)
    try:
        yield holder
    finally:
        _NAMING.reset(token)


def checkpoint_names(source, config=None) -> "InputNames | None":
    """The names of a checkpoint (a folder or a file, or an opened one) in its architecture's
    layout; ``None`` for one in circuitmath's names. Only headers are read."""
    from .._checkpoint import Checkpoint, open_checkpoint

    checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(source, config)
    return None if checkpoint.native is None else InputNames.of(checkpoint.native, dict(checkpoint.tensors))


def speak(report, names: "InputNames | None"):
    """``report`` (a :class:`~._report.Diagnosis` or the rows of a checkpoint check) in the input's names."""
    from ._report import Diagnosis, in_input_names

    if names is None:
        return report
    if isinstance(report, Diagnosis):
        return in_input_names(report, names)
    if hasattr(report, "rows"):
        report.rows = [dict(row, explanation=names.text(row.get("explanation"))) for row in report.rows]
    return report


def speaking_input_names(function):
    """``function`` (a public check) returning its diagnosis, or raising its failure, in the names
    of the input whose tensors it names (see :func:`input_names`)."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with input_names() as names:
            try:
                return speak(function(*args, **kwargs), names[0])
            except AssertionError as error:
                found = getattr(error, "diagnosis", None)
                if names[0] is not None and found is not None:
                    spoken = speak(found, names[0])
                    error.args = (str(error).replace(str(found), str(spoken)),)
                    error.diagnosis = spoken
                raise

    return run


def resolve(source, cfg=None, *, loaded: tuple[dict, dict] | None = None) -> Model:
    """:func:`resolve_model` as a :class:`Model`; ``loaded`` is ``(tensors, metadata)`` of the
    file ``source`` when they have been read already (each file is read once)."""
    if isinstance(source, Config):
        raise ArgumentTypeError(_CONFIG_FIRST)
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
            state_dict, hf_cfg = checkpoint.load()
            names = None if checkpoint.native is None else InputNames.of(checkpoint.native, dict(checkpoint.tensors))
            return _named(Model(state_dict, hf_cfg, _dtype(state_dict), names))
        with _about(path):  # every error names the file
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


_CONFIG_FIRST = (
    "got a Config where a model goes: the models come first and their config last, e.g."
    " assert_equivalent(before, after, cfg), diagnose(before, after, cfg), check_model(model, cfg)")


def _resolve_mapping(source, cfg) -> Model:
    """A state dict with a circuitmath or Hugging Face ``cfg``, TransformerLens buffers dropped."""
    if not isinstance(source, Mapping):
        raise StateDictError(f"expected a state dict, a .safetensors path, a folder or a model (a transformers"
                             f" model, a TransformerLens bridge, an nn.Module), got {type(source).__name__}")
    if cfg is None:
        raise StateDictError("a state dict needs its config: a circuitmath Config or a Hugging Face config")
    try:
        if _is_hf_config(cfg):
            state_dict, converted = io.from_hf(dict(source), cfg)
            return _named(Model(state_dict, converted, _dtype(state_dict), InputNames.of(hf_layout(cfg), source)))
        if not isinstance(cfg, Config):
            raise StateDictError(f"expected a circuitmath Config or a Hugging Face config, got {type(cfg).__name__}")
        state_dict = _without_buffers(source, cfg)
        return _named(Model(state_dict, cfg, validate_state_dict(state_dict, cfg)))
    except StateDictError as error:
        raise _another_naming(source, cfg) or error


#: How each naming is told: by the name of its token embedding, and the model types that use it.
_NAMINGS = (
    ("circuitmath's (TransformerLens's)", re.compile(r"embed\.W_E"), ()),
    ("GPT-2's (model_type 'gpt2')", re.compile(r"(transformer\.)?wte\.weight"), ("gpt2",)),
    ("GPT-NeoX's (model_type 'gpt_neox')", re.compile(r"(gpt_neox\.)?embed_in\.weight"), ("gpt_neox",)),
    ("LLaMA's (model_type 'llama' and its kin)", re.compile(r"(model\.)?embed_tokens\.weight"), None),
    ("BERT's (model_type 'bert')", re.compile(r"(bert\.)?embeddings\.word_embeddings\.weight"), ("bert",)),
)


def _another_naming(source: Mapping, cfg) -> StateDictError | None:
    """The error to raise when ``source``'s tensors are named as another architecture's than
    ``cfg`` describes (naming both); ``None`` when their naming fits ``cfg`` or is not known."""
    found = next(((naming, name, types) for naming, pattern, types in _NAMINGS
                  for name in source if isinstance(name, str) and pattern.fullmatch(name)), None)
    if found is None:
        return None
    naming, example, types = found
    if not (isinstance(cfg, Config) or _is_hf_config(cfg)):
        return None
    if isinstance(cfg, Config):
        if types == ():
            return None
        return StateDictError(
            f"the config is a circuitmath Config but the tensors are in {naming} names (e.g. {example!r}):"
            " pass the Hugging Face config of these weights (their config.json; --config on the command line)")
    model_type = cfg.get("model_type") if isinstance(cfg, Mapping) else getattr(cfg, "model_type", None)
    if types is None and model_type not in ("gpt2", "gpt_neox", "bert") or model_type in (types or ()):
        return None
    if types == ():
        return StateDictError(
            f"the config is a Hugging Face {model_type!r} config but the tensors are in {naming} names (e.g."
            f" {example!r}): pass a circuitmath Config, or none for a file written by circuitmath.io.save")
    return StateDictError(
        f"the config is a Hugging Face {model_type!r} config but the tensors are in {naming} names (e.g."
        f" {example!r}): pass the config of these weights (their config.json; --config on the command line)")


def _without_buffers(source: Mapping, cfg: Config) -> dict[str, torch.Tensor]:
    """``source`` without TransformerLens's non-parameter buffers (``attn.mask``, rotary tables)."""
    check_config_fits(source, cfg)
    shapes = expected_shapes(cfg)
    return {
        name: tensor
        for name, tensor in source.items()
        if not (name.rsplit(".", 1)[-1] in _TRANSFORMER_LENS_BUFFERS and name not in shapes)
    }


def _dtype(state_dict: Mapping) -> torch.dtype:
    return next(iter(state_dict.values())).dtype if state_dict else torch.get_default_dtype()


def _processed_forms(cfg: Config) -> list[Config]:
    """``cfg`` and the configs processing can turn it into without changing any size."""
    forms = [cfg]
    bare = {"LN": "LNPre", "RMS": "RMSPre"}.get(cfg.normalization_type)
    if bare:
        forms.append(cfg.replace(normalization_type=bare))
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
        raise ArgumentTypeError(_CONFIG_FIRST)
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
    if _is_hf_config(cfg) and isinstance(after, Mapping) and "embed.W_E" not in after:
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
    the one whose log-probs are closer to ``before``'s on the default tokens is taken."""
    if resolved.cfg.normalization_type != "LNPre" or before.cfg.normalization_type != "LN":
        return resolved
    if not uncentered_writers(resolved.state_dict, resolved.cfg):
        return resolved
    rms = resolved.cfg.replace(normalization_type="RMSPre")
    tokens = default_tokens(before.cfg)
    errors = [compare_log_probs(before.state_dict, before.cfg, resolved.state_dict, form, tokens).max_abs_error
              for form in (resolved.cfg, rms)]
    return dataclasses.replace(resolved, cfg=rms) if errors[1] < errors[0] else resolved


def _norm_parameters(cfg: Config) -> list[str]:
    """The names of every norm gain and bias ``cfg`` implies."""
    bare = {"LN": "LNPre", "RMS": "RMSPre"}.get(cfg.normalization_type)
    if bare is None:
        return []
    return sorted(set(expected_shapes(cfg)) - set(expected_shapes(cfg.replace(normalization_type=bare))))


def _without_identity_norms(state_dict: StateDict, cfg: Config) -> tuple[dict, Config, str | None]:
    """Drop norms whose gains are all 1 and biases all 0, which compute ``LNPre`` (``RMSPre``).

    Tools that fold a norm often keep it with unit gain and zero bias (TransformerLens does); the
    replayed rewrite drops it. Returns the state dict, its config and a note saying what was read.
    """
    names = _norm_parameters(cfg)
    if not names or any(not bool((state_dict[n] == (1 if n.endswith(".w") else 0)).all()) for n in names):
        return dict(state_dict), cfg, None
    bare = "LNPre" if cfg.normalization_type == "LN" else "RMSPre"
    gains = "gain is 1 and bias 0" if cfg.normalization_type == "LN" else "gain is 1"
    note = f"every {cfg.normalization_type} {gains}: read as {bare}, the same function"
    return {k: v for k, v in state_dict.items() if k not in names}, cfg.replace(normalization_type=bare), note


def resolve_pair(before, after, cfg, after_cfg) -> tuple[Model, Model, list[str]]:
    """``before`` and ``after`` resolved once each (see :func:`resolve` and :func:`_resolve_after`),
    a folded norm kept with unit gain and zero bias read as none; and notes on how they were read."""
    if isinstance(before, Config) or isinstance(after, Config):
        raise ArgumentTypeError(_CONFIG_FIRST)
    if cfg is None and is_model_object(before):  # its config reads an ``after`` in the same names
        cfg = own_config(before)
    first = resolve(before, cfg)
    second = _resolve_after(after, after_cfg, first.cfg, cfg, before=first)
    state_dict, second_cfg, note = _without_identity_norms(second.state_dict, second.cfg)
    refuse_misuse(first.cfg, second_cfg, _label(before, "before"), _label(after, "after"))
    _named(second)  # a diagnosis of the pair names the tensors as ``after`` does
    return first, dataclasses.replace(second, state_dict=state_dict, cfg=second_cfg), [note] if note else []


def _label(source, default: str) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else default


#: What no processing changes: two models that differ in one of these are two architectures.
def _architecture(cfg: Config) -> dict:
    norm = {"LN": "LayerNorm", "LNPre": "LayerNorm", "RMS": "RMSNorm", "RMSPre": "RMSNorm"}.get(cfg.normalization_type)
    return {
        "n_layers": cfg.n_layers, "d_model": cfg.d_model, "d_vocab": cfg.d_vocab, "n_ctx": cfg.n_ctx,
        "positions": "rotary" if cfg.positional_embedding_type == "rotary" else "learned",
        "mlp": "none" if cfg.d_mlp is None else ("gated " if cfg.gated_mlp else "") + cfg.act_fn,
        "parallel_attn_mlp": cfg.parallel_attn_mlp, "norm_position": cfg.norm_position,
        "embedding_norm": cfg.embedding_norm, "norm": norm,
    }


def _describe(cfg: Config) -> str:
    a = _architecture(cfg)
    return (f"{a['n_layers']} layers, d_model {a['d_model']}, d_vocab {a['d_vocab']}, {a['norm'] or 'no norm'},"
            f" {a['positions']} positions, {a['mlp']} MLP" + (", parallel blocks" if a["parallel_attn_mlp"] else ""))


def refuse_misused_checkpoints(before, after, cfg=None) -> None:
    """:func:`refuse_misuse` for two checkpoints (folders or files, or :class:`~circuitmath.io.Checkpoint`
    objects), from their configs alone: no tensor is read."""
    from .._checkpoint import Checkpoint, open_checkpoint

    configs = [c.cfg if isinstance(c, Checkpoint) else open_checkpoint(c, config).cfg
               for c, config in ((before, cfg), (after, None))]
    refuse_misuse(*configs, _label(before, "before"), _label(after, "after"))


def refuse_misuse(before: Config, after: Config, before_label: str = "before", after_label: str = "after") -> None:
    """Refuse (:class:`~circuitmath.InputError`) a pair no processing relates: the processed model
    given first (it records identities applied that the other lacks, or has bare norms where the
    other has gains), or two architectures (a size or a feature no processing changes differs;
    RMSNorm after LayerNorm is a processing, LayerNorm after RMSNorm is not)."""
    ours, theirs = _architecture(before), _architecture(after)
    differ = [k for k in ours if ours[k] != theirs[k] and not (k == "norm" and None in (ours[k], theirs[k]))
              and not (k == "norm" and ours[k] == "LayerNorm")]
    if differ:
        raise InputError(
            f"{before_label} and {after_label} are two different architectures: {before_label} has {_describe(before)};"
            f" {after_label} has {_describe(after)} ({', '.join(f'{k}: {ours[k]} vs {theirs[k]}' for k in differ)})."
            f" No processing changes these: give the processed model with the model it was processed from")
    done, recorded = before.applied, after.applied
    swapped_records = len(done) > len(recorded) and done[: len(recorded)] == recorded
    bare_first = (not done and not recorded and before.normalization_type in ("LNPre", "RMSPre")
                  and after.normalization_type in ("LN", "RMS"))
    if swapped_records or bare_first:
        why = (f"{before_label} records {', '.join(done[len(recorded):])} applied and {after_label} "
               + ("nothing" if not recorded else "only what came before") if swapped_records else
               f"{before_label}'s norms are folded ({before.normalization_type}) and {after_label}'s have gains"
               f" ({after.normalization_type})")
        raise InputError(
            f"{before_label} looks processed and {after_label} does not: swapped? ({why}). Give the original model"
            f" first and the processed one second: check ORIGINAL --processed PROCESSED, assert_equivalent(original,"
            f" processed)")


def resolve_tokens(tokens, cfg: Config) -> torch.Tensor:
    """``tokens`` as given, :func:`default_tokens` for ``None``, or ``tokens(cfg)`` for a callable."""
    if tokens is None:
        return default_tokens(cfg)
    given = tokens(cfg) if callable(tokens) else tokens
    return given if isinstance(given, torch.Tensor) else torch.as_tensor(given, device="cpu")
