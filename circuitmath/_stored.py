"""A processed model in its checkpoint's own names and layout: written there, and read back.

A Hugging Face folder that :func:`circuitmath.io.process_checkpoint` processes is written as a
folder of the same architecture where it can be: the same tensor names, shapes and dtype, each
processed weight written through the converter's own views of the stored tensors (the view
``W_Q`` of ``q_proj.weight`` is written, so the stored ``[out, in]`` matrix is), a folded norm
stored as the identity norm (gain 1, bias 0), ``config.json`` copied, and the circuitmath config
in the metadata with :data:`LAYOUT_KEY`. The converter that reads the input reads the output
(:func:`processed_layout` drops the identity norms, checked), so one mapping of names serves
both ways, and no tensor is transposed on the way out.

The processed model fits the layout when every tensor the converter makes up (a bias the
architecture lacks, read as zeros) is still what it makes up, and tensors stored once (a tied
embedding and unembedding) are still equal; :func:`place` checks both and raises
:class:`NotStored` otherwise (a tied GPT-2 or LLaMA whose unembedding the processing changes:
the caller writes circuitmath's layout instead), but for a tied embedding and unembedding the
processing made differ (:class:`Untied`): the caller writes them untied, the unembedding as
:data:`UNEMBEDDING` and ``tie_word_embeddings`` false, and the processed config says so
(``Config.tied_embeddings`` false). An architecture without an unembedding bias
(GPT-2, GPT-NeoX) keeps its final LayerNorm's bias instead of the bias its fold makes
(:func:`writing_steps`, :func:`final_bias_kept`), in every dtype; read back, a final norm of
gain 1 and bias ``c`` is the unembedding bias ``c W_U``. That product of two rounded tensors is
not the fold's ``b_U`` rounded once (in half precision an entry made by cancellation can be
many of its own units off), so a check certifies the stored ``c`` against ``b / w`` instead
(:func:`kept_final_bias`, :func:`gives`), and ``W_U`` as any other tensor.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from ._config import Config
from ._errors import StateDictError
from ._hf import Layout, _Source
from ._processing._memory import in_memory
from ._state import expected_shapes

__all__ = ["LAYOUT_KEY", "NotStored", "Untied", "UNEMBEDDING", "final_bias_kept", "gives", "kept_final_bias", "place",
           "processed_layout", "viewers", "writing_steps"]

#: The metadata key saying that a folder's tensors are in the names and layout of its
#: ``config.json``'s architecture (value: ``"config.json"``), its circuitmath config under
#: :data:`~circuitmath._files.CONFIG_KEY` describing the processed model.
LAYOUT_KEY = "circuitmath.layout"


class NotStored(Exception):
    """A processed part that the checkpoint's layout cannot hold exactly (the message says which
    tensor and why)."""


class Untied(NotStored):
    """A processed model whose unembedding the processing made differ from the token embedding
    the checkpoint stores once for both: the layout holds it untied (:data:`UNEMBEDDING`)."""


#: The stored name of an untied unembedding ``[d_vocab, d_model]`` in every causal-LM layout
#: circuitmath writes (``tie_word_embeddings`` false in its ``config.json``).
UNEMBEDDING = "lm_head.weight"


def identity_value(name: str, offset: float = 0.0) -> float | None:
    """The value a norm parameter folded away by processing is stored as in its architecture's
    layout (1 for a gain, 0 for a bias: the norm without an affine map, ``LNPre`` or ``RMSPre``;
    a gain applied as ``offset + w``, ``Config.norm_gain_offset``, is stored as ``1 - offset``);
    ``None`` for a name that is not a norm's parameter.

    >>> identity_value("blocks.3.ln2.w"), identity_value("ln_final.b"), identity_value("blocks.3.attn.b_O")
    (1.0, 0.0, None)
    """
    match = re.fullmatch(r"(?:blocks\.\d+\.)?(?:ln1|ln2|ln_final|embed\.ln)\.([wb])", name)
    return None if match is None else 1.0 - offset if match[1] == "w" else 0.0


def processed_layout(layout: Layout, cfg: Config) -> Layout:
    """``layout`` (a converter's) reading a processed checkpoint of config ``cfg``: the tensors
    ``cfg`` has no place for (the folded norms) are dropped, once checked to be the identity
    norm's (on placeholders, which hold no values, only their names are checked)."""
    shapes = expected_shapes(cfg)

    def dropping(convert):
        def converted(src: _Source, *layer):
            out, part, kept_bias = {}, convert(src, *layer), None
            for name, tensor in part.items():
                value = identity_value(name, cfg.norm_gain_offset)
                if name in shapes:
                    out[name] = tensor
                elif name.startswith("embed.ln."):
                    raise StateDictError(f"the converter gives {name!r}, but the circuitmath config in the metadata says the"
                                         " embedding norm was folded into W_E, which no stored LayerNorm leaves as it is")
                elif name == "ln_final.b" and "unembed.b_U" in shapes and src.holds_values and bool(tensor.ne(0).any()):
                    kept_bias = tensor  # the fold's unembedding bias, kept as the final norm's (final_bias_kept)
                elif value is None:
                    raise StateDictError(f"the converter gives {name!r}, which the circuitmath config in the metadata lacks")
                elif src.holds_values and not bool((tensor == value).all()):
                    raise StateDictError(
                        f"{name} (stored under the architecture's name) is not {value:g} everywhere, but the circuitmath"
                        " config in the metadata says its norm was folded")
            if kept_bias is not None:  # LNPre(x) + c read by W_U and b_U: b_U + c W_U, rounded once
                b_U = part["unembed.b_U"]
                out["unembed.b_U"] = (kept_bias.double() @ part["unembed.W_U"].double() + b_U.double()).to(b_U.dtype)
            return out
        return converted

    return dataclasses.replace(layout, cfg=cfg, embed=dropping(layout.embed), block=dropping(layout.block),
                               final=dropping(layout.final))


def _part(layout: Layout, src: _Source, layer: int | None) -> dict[str, torch.Tensor]:
    return layout.embed(src) | layout.final(src) if layer is None else layout.block(src, layer)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes a stored tensor's views start in: all of it when contiguous, else its first
    entry (a zero-stride placeholder)."""
    start = tensor.data_ptr()
    return start, start + (tensor.nbytes if tensor.is_contiguous() else tensor.element_size())


def _base(view: torch.Tensor, spans: dict[str, tuple[int, int]]) -> str | None:
    """The stored tensor ``view`` is a view of, by where its first entry lies; ``None`` for a
    tensor the converter made up."""
    if view.numel() == 0:
        return None
    where = view.data_ptr()
    return next((name for name, (start, stop) in spans.items() if start <= where < stop), None)


def grouped(layout: Layout, stored: Mapping[str, torch.Tensor], layer: int | None):
    """Part ``layer`` converted from ``stored`` (tensors by their names in the checkpoint):
    the converter's tensors, the circuitmath names it takes as views of each stored tensor it
    takes (in ``stored``'s order), and the names it makes up (views of no stored tensor)."""
    src = layout.source(stored)
    unused = set(src.unused)
    views = _part(layout, src, layer)
    taken = {src.names[name] for name in unused - src.unused}
    spans = {name: _span(tensor) for name, tensor in stored.items() if name in taken}
    through: dict[str, list[str]] = {name: [] for name in stored if name in taken}
    made_up = []
    for name, view in views.items():
        base = _base(view, spans)
        if base is None:
            made_up.append(name)
        else:
            through[base].append(name)
    return views, through, made_up


def viewers(layout: Layout, stored: Mapping[str, torch.Tensor], layer: int | None) -> dict[str, list[str]]:
    """The stored tensors part ``layer`` is converted from (``stored``: a checkpoint's tensors by
    their names, placeholders will do, each the same tensor whenever it is looked up), in its
    order, each with the circuitmath names the converter takes as views of it."""
    return grouped(layout, stored, layer)[1]


def _as_stored(view: torch.Tensor, buffer: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` (a processed tensor for ``view``, a view of all of the stored tensor ``buffer``)
    as the stored tensor itself, sharing its memory, when its entries lie in memory as ``view``'s
    do (a product the processing wrote in the checkpoint's layout); else ``None``."""
    if (tensor.dtype != buffer.dtype or tensor.device.type != "cpu" or tensor.shape != view.shape
            or tensor.stride() != view.stride() or view.data_ptr() != buffer.data_ptr() or view.numel() != buffer.numel()):
        return None
    stored = tensor.as_strided(buffer.shape, buffer.stride(), tensor.storage_offset())
    return stored if stored.is_contiguous() else None


def place(layout: Layout, layer: int | None, processed: Mapping[str, torch.Tensor],
          buffers: Mapping[str, torch.Tensor], kept: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The stored tensors of part ``layer`` (``None``: the ends) of a processed model,
    ``processed`` (its tensors in circuitmath names, on the CPU), by their names in the
    checkpoint. ``buffers`` holds a contiguous tensor of each stored tensor's shape and dtype
    (uninitialised; zero-stride placeholders may stand in for those named in ``kept``, whose
    bytes the caller copies from the checkpoint and which are not returned).

    A processed tensor whose entries already lie in memory as the stored tensor's do (written in
    the checkpoint's layout) is returned as it is, reshaped; any other is copied into its
    buffer through the converter's view, and a norm the processing folded away is written as the
    identity norm. Raises :class:`NotStored` when the part does not fit the layout: a tensor the
    converter makes up (zeros for a bias the architecture lacks) that the processing changed, a
    stored tensor that the converter uses in part (its views must cover it exactly once) or
    twice (tied tensors: each view must read back what was written through it), or a processed
    tensor the layout has no place for.
    """
    views, through, made_up = grouped(layout, buffers, layer)
    extra = sorted(set(processed) - set(views))
    if extra:
        raise NotStored(f"the processed {extra[:3]} have no place in the checkpoint's layout")
    folded_embedding_norm = sorted(n for n in views if n.startswith("embed.ln.") and n not in processed)
    if folded_embedding_norm:  # LN(x) of gain 1 and bias 0 is LNPre(x), not x
        raise NotStored(f"the embedding LayerNorm ({folded_embedding_norm}) was folded into W_E, and a LayerNorm of the"
                        " layout's still normalises: no stored value of it is the identity")
    for name in made_up:
        wanted = processed.get(name)
        wanted = identity_value(name, layout.cfg.norm_gain_offset) if wanted is None else wanted
        if wanted is None or not bool((views[name] == wanted).all()):
            raise NotStored(f"the processed {name} is not the {'identity norm' if name not in processed else 'zeros'}"
                            " the architecture's converter reads where it stores no tensor")
    out = {}
    for stored, names in through.items():
        if stored in kept:
            continue
        buffer, sizes = buffers[stored], [views[name].numel() for name in names]
        tied = len(names) > 1 and all(size == buffer.numel() for size in sizes)
        if sum(sizes) != buffer.numel() and not tied:
            raise NotStored(f"{stored}: the converter takes {names} from it, which do not cover it once")
        if len(names) == 1 and names[0] in processed:
            out[stored] = _as_stored(views[names[0]], buffer, processed[names[0]])
            if out[stored] is not None:
                continue
        for name in names:
            value, view = processed.get(name), views[name]
            if value is None:
                view.fill_(identity_value(name, layout.cfg.norm_gain_offset))
            elif view.dim() >= 2 and view.data_ptr() == buffer.data_ptr() and view.numel() == buffer.numel() \
                    and view.mT.is_contiguous():  # the stored matrix transposed: written as whole transposes
                in_memory(value.mT, buffer.view(view.mT.shape))
            else:
                view.copy_(value)
        if tied and not all(torch.equal(views[name], processed[name]) for name in names if name in processed):
            kind = Untied if sorted(names) == ["embed.W_E", "unembed.W_U"] else NotStored
            raise kind(f"{stored} is stored once for {names}, which the processing made different")
        out[stored] = buffer
    return out


def writing_steps(viewed_ends: Mapping[str, list[str]], cfg: Config, keywords: dict):
    """What a folder of config ``cfg`` is processed with to be written in its own layout, given
    the circuitmath names its ends are stored through (``viewed_ends``: each stored tensor's
    views): :func:`~circuitmath.process_weights`' ``keywords`` as they are, or, for a LayerNorm
    model whose unembedding has no bias (GPT-2, GPT-NeoX) and whose keywords fold its norms, a
    ``transform(state_dict, cfg)`` that applies the same steps but for the centering of the
    norms' readers, and keeps the final LayerNorm's bias (:func:`final_bias_kept`). The fold
    alone leaves each reader ``diag(w) W``, so the bias ``b W_U`` the final norm's fold makes is
    ``(b / w) diag(w) W_U``: the final norm's bias behind its folded gain; centering ``W_U`` over
    ``d_model`` would take from it a part no bias ahead of ``W_U`` gives. ``applied`` says so:
    ``center_reading_weights`` is not in it."""
    views = {name for names in viewed_ends.values() for name in names}
    if cfg.normalization_type != "LN" or "unembed.b_U" in views or "ln_final.b" not in views:
        return keywords
    from ._processing import process_weights
    from ._processing.layer_norm import center_reading_weights
    from ._identities import get_identity
    from ._weights import random_state_dict

    small = cfg.replace(n_layers=1, d_model=4, d_mlp=None if cfg.d_mlp is None else 4, d_vocab=3, n_ctx=min(cfg.n_ctx, 3))
    applied = process_weights(random_state_dict(small, seed=0), small, **keywords)[1].applied[len(cfg.applied):]
    if center_reading_weights.identity not in applied:
        return keywords
    steps = [get_identity(name).transform for name in applied if name != center_reading_weights.identity]

    def transform(state_dict, part_cfg):
        dtype = state_dict["embed.W_E"].dtype  # a block's part holds stand-ins of the ends too
        work = {n: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for n, t in state_dict.items()}
        out, out_cfg = work, part_cfg
        for step in steps:  # half precision in float32, rounded once
            out, out_cfg = step(out, out_cfg)
        out = {n: t.to(dtype) for n, t in out.items()}
        if part_cfg.n_layers == 0:  # the ends
            out = final_bias_kept(out, state_dict["ln_final.w"], state_dict["ln_final.b"], state_dict["unembed.b_U"])
        return out, out_cfg

    return transform


def final_bias_kept(processed: Mapping[str, torch.Tensor], w: torch.Tensor, b: torch.Tensor,
                    given_b_U: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ends ``processed`` (the final LayerNorm ``(w, b)`` folded, not centered) with the
    unembedding bias the fold made moved back into the final norm, for a layout whose
    unembedding has none (``given_b_U``, the zeros its converter reads).

    ``LN(x) W_U = LNPre(x) diag(w) W_U + b W_U`` and, with ``c = b / w`` (no gain zero),
    ``b W_U = c diag(w) W_U``; the centering of the unembedding over the vocabulary is linear,
    so the processed bias is ``c`` times the processed ``W_U``: the norm is stored with gain 1
    and bias ``c`` (rounded once to the dtype, as every folded weight is) ahead of the processed
    ``W_U``, and ``b_U`` as given. :class:`NotStored` when a zero gain meets a nonzero bias, or
    when ``c`` does not give the processed ``b_U`` to a few units of rounding."""
    b_U = processed["unembed.b_U"]
    if torch.equal(b_U, given_b_U):
        return dict(processed)
    w64, b64 = w.double(), b.double()
    if bool(((w64 == 0) & (b64 != 0)).any()):
        raise NotStored("the final LayerNorm has a zero gain with a nonzero bias: its bias cannot be kept behind the folded gain")
    c = (b64 / torch.where(w64 == 0, 1.0, w64)).to(b_U.dtype)
    # c, the folded W_U and b_U are each rounded once: their products agree to a few units of rounding
    if not gives(c, processed["unembed.W_U"], b_U, torch.finfo(b_U.dtype).eps):
        raise NotStored("the processed unembed.b_U is not the final LayerNorm's bias through the processed W_U")
    return {**processed, "unembed.b_U": given_b_U.clone(), "ln_final.b": c}


def gives(c: torch.Tensor, W_U: torch.Tensor, b_U: torch.Tensor, eps: float) -> bool:
    """Whether the bias ``c`` ``[d_model]`` ahead of ``W_U`` ``[d_model, d_vocab]`` gives the
    unembedding bias ``b_U`` ``[d_vocab]``: ``|c W_U - b_U| <= 8 eps (|c| |W_U| + |b_U|)`` entry by
    entry, in float64 (``eps``: the unit roundoff each of the three was computed to, times 2)."""
    c64, W64, b64 = c.double(), W_U.double(), b_U.double()
    return bool(((c64 @ W64 - b64).abs() <= 8 * eps * (c64.abs() @ W64.abs() + b64.abs())).all())


def kept_final_bias(native: Layout | None, cfg: Config, stored: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The bias a processed folder in its architecture's layout keeps in its final LayerNorm ahead
    of the unembedding (:func:`final_bias_kept`), ``[d_model]``, as stored (``native``: the
    architecture's converter, ``None`` for circuitmath's names; ``cfg``: the processed config;
    ``stored``: the folder's tensors by their stored names); ``None`` where it keeps none.
    :func:`processed_layout` reads it as the unembedding bias ``c W_U``, rounded once more, which
    is not the stored tensor: a check certifies ``c`` itself."""
    shapes = expected_shapes(cfg)
    if native is None or "unembed.b_U" not in shapes or "ln_final.b" in shapes:
        return None
    c = native.final(native.source(stored)).get("ln_final.b")
    return None if c is None or not bool(c.ne(0).any()) else c
