"""The architecture families circuitmath reads, each as a tiny Hugging Face ``config.json``.

One list (:data:`FAMILIES`) serves the tests that compare the reference forward pass with
``transformers``, the processing tests, and the book's table of which identity holds in which
family (:func:`identity_table`). Each entry is small (2 layers, ``d_model`` 32) and sets the
options that make its features bite on short sequences: a sliding window shorter than the
sequence, biases where the architecture has them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ._config import Config
from ._errors import PreconditionError

__all__ = ["Family", "FAMILIES", "family", "feature_preconditions", "identity_table"]

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_SMALL = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 48, "max_position_embeddings": 16,
          "rope_parameters": _ROPE, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None}


@dataclass(frozen=True)
class Family:
    """An architecture family: its ``model_type``, a tiny ``config.json`` (:attr:`hf_config`),
    and its features in words (what the book's table says it has)."""

    name: str
    model_type: str
    fields: dict = field(repr=False)
    features: str = ""

    @property
    def hf_config(self) -> dict:
        """The ``config.json`` of a tiny model of the family (a fresh copy)."""
        return {"model_type": self.model_type, **copy.deepcopy(self.fields)}

    @property
    def cfg(self) -> Config:
        """The circuitmath :class:`~circuitmath.Config` its converter reads from :attr:`hf_config`."""
        from ._hf import hf_layout

        return hf_layout(self.hf_config).cfg


FAMILIES: tuple[Family, ...] = (
    Family("LLaMA", "llama", _SMALL, "RMSNorm, rotary, gated MLP, grouped-query attention"),
    Family("Mistral", "mistral", _SMALL | {"sliding_window": 4},
           "LLaMA with a sliding window of keys in every layer"),
    Family("Qwen2", "qwen2", _SMALL | {"use_sliding_window": False},
           "LLaMA with query, key and value biases"),
    Family("Qwen3", "qwen3", _SMALL | {"head_dim": 8, "use_sliding_window": False},
           "LLaMA with an RMSNorm of each head's queries and keys (QK-norm)"),
    Family("Gemma", "gemma", _SMALL | {"head_dim": 8, "hidden_act": "gelu_pytorch_tanh"},
           "LLaMA with RMSNorm gains applied as 1 + w, embeddings scaled by sqrt(d_model), tied unembedding"),
    Family("Gemma2", "gemma2", _SMALL | {"head_dim": 8, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16,
                                         "sliding_window": 4, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
           "Gemma with sandwich norms, softcaps on attention scores and logits (small here, so that they bite),"
           " a query scale and sliding-window layers"),
    Family("Gemma3", "gemma3_text", _SMALL | {"head_dim": 8, "hidden_activation": "gelu_pytorch_tanh",
                                              "query_pre_attn_scalar": 16, "sliding_window": 4,
                                              "layer_types": ["sliding_attention", "full_attention"],
                                              "rope_parameters": {"full_attention": _ROPE | {"rope_theta": 1000000.0},
                                                                  "sliding_attention": dict(_ROPE)}},
           "Gemma 2's sandwich norms and query scale with QK-norm, no softcaps, and sliding-window layers"
           " whose rotary base (10^4) is not the full layers' (10^6)"),
    Family("Phi3", "phi3", _SMALL | {"pad_token_id": 0,
                                     "rope_parameters": _ROPE | {"partial_rotary_factor": 0.5}},
           "LLaMA with fused query/key/value and gate/up projections and partial rotary"),
    Family("GPT-J", "gptj", {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4,
                             "n_positions": 16, "n_inner": 48, "bos_token_id": 0, "eos_token_id": 0},
           "LayerNorm, attention and MLP in parallel on one norm, interleaved partial rotary, an unembedding bias"),
    Family("OPT", "opt", {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "ffn_dim": 48, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1},
           "pre-LayerNorm, learned positions read with an offset of 2, ReLU MLP, tied unembedding"),
    Family("OPT-post", "opt", {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "ffn_dim": 48, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0,
                               "pad_token_id": 1, "do_layer_norm_before": False},
           "OPT with post-LayerNorm blocks (do_layer_norm_before=False, as OPT-350m) and no final norm"),
    Family("Cohere", "cohere", _SMALL | {"logit_scale": 0.25, "pad_token_id": 0},
           "LLaMA's body with attention and gated MLP in parallel on one bias-free LayerNorm, interleaved rotary,"
           " a logit scale, tied unembedding"),
    Family("Falcon", "falcon", {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "max_position_embeddings": 16, "ffn_hidden_size": 48, "rope_parameters": _ROPE,
                                "bos_token_id": 0, "eos_token_id": 0, "bias": True},
           "LayerNorm, multi-query attention fused in query_key_value, attention and MLP in parallel on one norm"),
    Family("Falcon-sequential", "falcon", {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                                           "num_attention_heads": 4, "max_position_embeddings": 16, "ffn_hidden_size": 48,
                                           "rope_parameters": _ROPE, "bos_token_id": 0, "eos_token_id": 0,
                                           "multi_query": False, "parallel_attn": False},
           "Falcon with per-head fused q/k/v and sequential attention and MLP, two norms"),
    Family("Falcon-40B", "falcon", {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_kv_heads": 2, "new_decoder_architecture": True, "max_position_embeddings": 16,
                                    "ffn_hidden_size": 48, "rope_parameters": _ROPE, "bos_token_id": 0, "eos_token_id": 0},
           "Falcon's new decoder architecture: a LayerNorm for each parallel branch (ln_attn, ln_mlp) and grouped"
           " key/value heads, each stored after its group's query heads in query_key_value"),
    Family("OLMo-2", "olmo2", _SMALL | {"rms_norm_eps": 1e-6},
           "LLaMA's body with no norm before attention or the MLP, an RMSNorm after each (post-norms),"
           " and QK-norm over the whole query and key projections (a gain per entry) rather than each head"),
    Family("Mixtral", "mixtral", _SMALL | {"intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2},
           "LLaMA whose MLP is a mixture of gated experts: a router picks the top 2 of 4 per token"),
    Family("Qwen2-MoE", "qwen2_moe", _SMALL | {"moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2,
                                               "shared_expert_intermediate_size": 40, "use_sliding_window": False},
           "Qwen2's attention, a mixture of 4 experts (top 2, not renormalised) and a shared expert under a sigmoid gate"),
    Family("Qwen3-MoE", "qwen3_moe", _SMALL | {"head_dim": 8, "moe_intermediate_size": 24, "num_experts": 4,
                                               "num_experts_per_tok": 2, "norm_topk_prob": True,
                                               "use_sliding_window": False},
           "Qwen3's attention (QK-norm) and a mixture of 4 experts, top 2 renormalised"),
    Family("BLOOM", "bloom", {"vocab_size": 64, "hidden_size": 32, "n_layer": 2, "n_head": 4, "seq_length": 16,
                              "bos_token_id": 0, "eos_token_id": 0},
           "LayerNorm, ALiBi positions (no positional weights), a LayerNorm of the token embeddings,"
           " per-head fused q/k/v with biases, tied unembedding"),
    Family("GPT-OSS", "gpt_oss", _SMALL | {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                           "intermediate_size": 24, "sliding_window": 4, "swiglu_limit": 1.5},
           "attention sinks, biases on every projection, alternating sliding-window layers, a router with a bias"
           " over 4 experts with a clamped SwiGLU (its limit small here, so that it bites)"),
)


def family(name: str) -> Family:
    """The family called ``name`` (``KeyError`` listing the names otherwise)."""
    for candidate in FAMILIES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no family {name!r}; the families are {[f.name for f in FAMILIES]}")


def feature_preconditions() -> frozenset:
    """The preconditions an architecture feature breaks (rotary embeddings, QK-norm, gains applied
    as ``1 + w``, softcaps, sandwich norms, ALiBi's slope per head, attention sinks): an identity that refuses a family by one of them is *not exact* there; one that
    refuses by any other (attention-only, a LayerNorm model, a layer count) does not apply."""
    from ._processing._common import (
        NO_ATTN_SINKS, NO_ATTN_SOFTCAP, NO_LOGIT_SOFTCAP, NO_POST_NORMS, NO_QK_NORM, NOT_ROTARY, POST_NORM_GAINS_EQUAL,
    )
    from ._processing.quantisation import GAINS_AS_STORED
    from ._processing.rotation import HEADS_SEE_POSITIONS_ALIKE

    return frozenset({NOT_ROTARY, NO_QK_NORM, GAINS_AS_STORED, NO_ATTN_SOFTCAP, NO_ATTN_SINKS, NO_LOGIT_SOFTCAP,
                      NO_POST_NORMS, POST_NORM_GAINS_EQUAL, HEADS_SEE_POSITIONS_ALIKE})


def identity_table(identities, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, dict[str, str]]:
    """Family by identity, on each family's random weights (:func:`~circuitmath.random_state_dict`
    of :attr:`Family.cfg`): ``"exact"`` (the identity's numeric check passes), ``"not exact:
    <precondition>: <detail>"`` (it refuses naming a precondition that an architecture feature
    breaks, :func:`feature_preconditions`), ``"not applicable: <precondition>: <detail>"`` (it
    refuses for another reason), or ``"fails"`` (neither: a bug the tests look for)."""
    from ._weights import random_state_dict

    features = feature_preconditions()
    table: dict[str, dict[str, str]] = {}
    for fam in FAMILIES:
        cfg = fam.cfg
        state = random_state_dict(cfg, seed=seed, dtype=dtype)
        row = table.setdefault(fam.name, {})
        for identity in identities:
            try:
                result = identity.check(state, cfg)
            except PreconditionError as refusal:
                kind = "not exact" if refusal.precondition in features else "not applicable"
                row[identity.name] = f"{kind}: {refusal.precondition}: {refusal.detail}"
                continue
            row[identity.name] = "exact" if result.passed else "fails"
    return table
