"""Run TransformerLens's weight processing on circuitmath models, to compare against it, and
its ``TransformerBridge`` on ``transformers`` models.

Needs the ``peers`` extra (``transformer-lens==4.3.0``); importing this module does not, the
functions import TransformerLens when called. Both libraries use the same parameter names and
shapes (``blocks.{l}.attn.W_Q`` ``[n_heads, d_model, d_head]``, ...), so a circuitmath state
dict is a TransformerLens state dict as it is.
"""

from __future__ import annotations

from ._config import Config
from ._state import StateDict, validate_state_dict

__all__ = ["transformer_lens_bridge", "transformer_lens_config", "transformer_lens_process_weights"]


def transformer_lens_config(cfg: Config, dtype, device="cpu"):
    """``cfg`` as a ``transformer_lens.config.TransformerLensConfig`` for weights of ``dtype`` on ``device``.

    TransformerLensConfig has no field for the norm's position (every model is pre-norm to it),
    for parallel attention and MLP (which it handles by finding ``ln2`` in the state dict, as
    circuitmath's layout has), for the rotary base or for the causal mask; weight processing
    reads none of these.
    """
    from transformer_lens.config.transformer_lens_config import TransformerLensConfig

    return TransformerLensConfig(
        d_model=cfg.d_model,
        d_head=cfg.d_head,
        n_layers=cfg.n_layers,
        n_ctx=cfg.n_ctx,
        n_heads=cfg.n_heads,
        d_mlp=cfg.d_mlp,
        d_vocab=cfg.d_vocab,
        device=str(device),
        positional_embedding_type=cfg.positional_embedding_type,
        n_key_value_heads=cfg.n_key_value_heads,
        attn_only=cfg.attn_only,
        gated_mlp=cfg.gated_mlp,
        uses_rms_norm=cfg.normalization_type in ("RMS", "RMSPre"),
        eps=cfg.eps,
        act_fn=cfg.act_fn,
        normalization_type=cfg.normalization_type,
        dtype=dtype,
    )


def transformer_lens_process_weights(state_dict: StateDict, cfg: Config, **flags) -> dict:
    """TransformerLens's ``ProcessWeights.process_weights`` applied to a copy of ``state_dict``.

    ``flags`` are its keywords (``fold_ln``, ``center_writing_weights``, ``center_unembed``,
    ``fold_value_biases``, ``refactor_factored_attn_matrices``; all but the last default to
    True). The input mapping is copied first: TransformerLens replaces the entries of the
    mapping it is given by float32 copies when they are not float32. The result keeps the
    architecture of ``cfg``: a folded norm stays in the state dict with gain 1 and bias 0, so
    circuitmath's reference forward pass runs it with ``cfg`` itself (TransformerLens records
    nothing like ``cfg.applied``).
    """
    from transformer_lens.weight_processing import ProcessWeights

    dtype = validate_state_dict(state_dict, cfg)
    return ProcessWeights.process_weights(dict(state_dict), transformer_lens_config(cfg, dtype), **flags)


def transformer_lens_bridge(model, **flags):
    """A TransformerLens ``TransformerBridge`` over the ``transformers`` model ``model`` (built
    offline from the module and its config, for the architecture its class names), with the
    bridge's ``process_weights(**flags)`` applied (``fold_ln``, ``center_writing_weights``,
    ``center_unembed``, ``fold_value_biases``: each True unless given False).

    Building a bridge rewrites ``model`` in place (bridge components replace its submodules):
    pass a copy to keep the original. circuitmath's checkers read the result as a model object
    (:func:`circuitmath.testing.assert_equivalent`).
    """
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    bridge = build_bridge_from_module(model, type(model).__name__, hf_config=model.config)
    bridge.process_weights(**flags)
    return bridge
