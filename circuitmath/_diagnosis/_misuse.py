"""Pairs and arguments no check can mean: refused as bad input, saying what to do.

The processed model given first, two architectures, a config of another architecture than the
tensors' naming, a Config where a model goes: each is an :class:`~circuitmath.InputError` (exit 2
from the CLI) naming both sides and the right use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from .._config import Config
from .._errors import InputError, StateDictError

__all__ = ["CONFIG_FIRST", "is_hf_config", "another_naming", "refuse_misuse", "refuse_misused_checkpoints", "label"]


def is_hf_config(cfg) -> bool:
    if cfg is None or isinstance(cfg, Config):
        return False
    if isinstance(cfg, Mapping):
        return "model_type" in cfg
    return hasattr(cfg, "model_type")


CONFIG_FIRST = (
    "got a Config where a model goes: the models come first and their config last, e.g."
    " assert_equivalent(before, after, cfg), diagnose(before, after, cfg), check_model(model, cfg)")


#: How each naming is told: by the name of its token embedding, and the model types that use it.
_NAMINGS = (
    ("circuitmath's (TransformerLens's)", re.compile(r"embed\.W_E"), ()),
    ("GPT-2's (model_type 'gpt2')", re.compile(r"(transformer\.)?wte\.weight"), ("gpt2",)),
    ("GPT-NeoX's (model_type 'gpt_neox')", re.compile(r"(gpt_neox\.)?embed_in\.weight"), ("gpt_neox",)),
    ("LLaMA's (model_type 'llama' and its kin)", re.compile(r"(model\.)?embed_tokens\.weight"), None),
    ("BERT's (model_type 'bert')", re.compile(r"(bert\.)?embeddings\.word_embeddings\.weight"), ("bert",)),
)


def another_naming(source: Mapping, cfg) -> StateDictError | None:
    """The error to raise when ``source``'s tensors are named as another architecture's than
    ``cfg`` describes (naming both); ``None`` when their naming fits ``cfg`` or is not known."""
    found = next(((naming, name, types) for naming, pattern, types in _NAMINGS
                  for name in source if isinstance(name, str) and pattern.fullmatch(name)), None)
    if found is None:
        return None
    naming, example, types = found
    if not (isinstance(cfg, Config) or is_hf_config(cfg)):
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


def label(source, default: str) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else default


#: What no processing changes: two models that differ in one of these are two architectures.
def _architecture(cfg: Config) -> dict:
    norm = {"LN": "LayerNorm", "LNPre": "LayerNorm", "RMS": "RMSNorm", "RMSPre": "RMSNorm"}.get(cfg.normalization_type)
    return {
        "n_layers": cfg.n_layers, "d_model": cfg.d_model, "d_vocab": cfg.d_vocab, "n_ctx": cfg.n_ctx,
        "positions": {"rotary": "rotary", "alibi": "ALiBi"}.get(cfg.positional_embedding_type, "learned"),
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
    refuse_misuse(*configs, label(before, "before"), label(after, "after"))


def refuse_misuse(before: Config, after: Config, before_label: str = "before", after_label: str = "after") -> None:
    """Refuse (:class:`~circuitmath.InputError`) a pair no processing relates: the processed model
    given first (it records identities applied that the other lacks, or has bare norms where the
    other has gains), or two architectures (a size or a feature no processing changes differs;
    RMSNorm after LayerNorm is a processing, LayerNorm after RMSNorm is not)."""
    ours, theirs = _architecture(before), _architecture(after)
    folds_embedding_norm = before.norm_position == "pre" and not after.embedding_norm  # into W_E (BLOOM's)
    differ = [k for k in ours if ours[k] != theirs[k] and not (k == "norm" and None in (ours[k], theirs[k]))
              and not (k == "norm" and ours[k] == "LayerNorm") and not (k == "embedding_norm" and folds_embedding_norm)]
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
