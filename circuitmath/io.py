"""Weights in and out: safetensors only, and converters from Hugging Face checkpoints.

Nothing here ever unpickles. :func:`save` writes a state dict with its :class:`~circuitmath.Config`
in the safetensors metadata and :func:`load` reads it back; :func:`load_tensors` reads any
safetensors file. A file is read as safetensors only when its header parses as one
(:func:`read_header`); anything else, a PyTorch pickle or zip archive included, is refused with
:class:`UnsafeFormatError` and never interpreted: unpickling runs arbitrary code. Only regular
files are opened (a FIFO or a device such as ``/dev/zero`` is refused before it is read), JSON
is read with a size and nesting limit, and every error is a
:class:`~circuitmath.CircuitMathError` naming the file and the key or field at fault.

The converters turn a Hugging Face state dict and its config (the ``config.json`` as a dict, or a
``transformers`` config object; ``transformers`` itself is not needed) into a state dict in the
reference conventions (TransformerLens names, row vectors ``x @ W``, per-head
``W_Q [n_heads, d_model, d_head]``) and the matching ``Config``:

- :func:`from_hf_gpt2`: GPT-2 (pre-LN, learned positions, ``gelu_new``, tied unembed);
- :func:`from_hf_gpt_neox`: GPT-NeoX / Pythia (parallel attention and MLP, partial rotary);
- :func:`from_hf_llama`: LLaMA (RMSNorm, SiLU-gated MLP, grouped-query attention, rotary);
- :func:`from_hf_mistral`, :func:`from_hf_qwen2`, :func:`from_hf_qwen3`: LLaMA's layout with a
  sliding window (Mistral), query/key/value biases (Qwen2), per-head QK-norm (Qwen3);
- :func:`from_hf_gemma`: LLaMA's layout with gains applied as ``1 + w`` and embeddings scaled by
  ``sqrt(d_model)``; :func:`from_hf_gemma2`: Gemma's with sandwich norms, a query scale, softcaps
  on the attention scores and the logits, and sliding-window layers; :func:`from_hf_gemma3`:
  Gemma 2's with QK-norm, no softcaps and a rotary base of their own in the sliding layers; :func:`from_hf_phi3`: LLaMA's
  with fused ``qkv_proj`` and ``gate_up_proj`` and partial rotary;
- :func:`from_hf_gptj`: GPT-J (parallel attention and MLP on one LayerNorm, interleaved partial
  rotary); :func:`from_hf_opt`: OPT (learned positions read with an offset of 2, ReLU, pre- or
  post-norm); :func:`from_hf_cohere`: Cohere (parallel attention and gated MLP on one bias-free
  LayerNorm, interleaved rotary, a logit scale); :func:`from_hf_falcon`: Falcon-7B style (fused
  multi-query or per-head q/k/v, parallel or sequential blocks); :func:`from_hf_bloom`: BLOOM
  (ALiBi, a LayerNorm of the token embeddings); :func:`from_hf_olmo2`: OLMo-2 (no norm before
  attention or the MLP, a norm after each, QK-norm over the whole query and key projections);
- :func:`from_hf_mixtral`, :func:`from_hf_qwen2_moe`, :func:`from_hf_qwen3_moe`,
  :func:`from_hf_gpt_oss`: mixtures of experts (a router choosing the top-k gated experts per
  token; Qwen2-MoE's shared expert; GPT-OSS's attention sinks and clamped SwiGLU), from a model's
  stacked experts or a saved folder's one ``Linear`` per expert;
- :func:`from_hf_bert`: BERT (post-LN, embedding LayerNorm, bidirectional attention).

:data:`FAMILIES` lists each architecture family as a tiny ``config.json`` (:class:`Family`),
:func:`identity_table` says which identity holds in which family, and :func:`family_model`
builds a family's ``transformers`` model with realistic random weights. :func:`as_state_dict`
reads a model object (a ``transformers`` model, a TransformerLens bridge) as a state dict and
config in circuitmath's names.

Every converter keeps the checkpoint's dtype, fills biases the architecture lacks with zeros,
refuses configurations the reference forward pass cannot reproduce (naming the option), and
refuses a state dict with tensors it does not know what to do with (naming them).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ._checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from ._config import Config
from ._errors import InputError
from ._families import FAMILIES, Family, family, feature_preconditions, identity_table
from ._conformance import family_model
from ._models import as_state_dict
from ._files import (
    CONFIG_KEY,
    UnsafeFormatError,
    load,
    load_tensors,
    read_config,
    read_header,
    read_json,
    save,
    stored_config,
)
from ._hf_moe import from_hf_gpt_oss, from_hf_mixtral, from_hf_qwen2_moe, from_hf_qwen3_moe
from ._hf import (
    UnsupportedArchitectureError,
    from_hf,
    from_hf_bert,
    from_hf_bloom,
    from_hf_gpt2,
    from_hf_gemma,
    from_hf_gemma2,
    from_hf_gemma3,
    from_hf_phi3,
    from_hf_gptj,
    from_hf_olmo2,
    from_hf_opt,
    from_hf_cohere,
    from_hf_falcon,
    from_hf_gpt_neox,
    from_hf_llama,
    from_hf_mistral,
    from_hf_qwen2,
    from_hf_qwen3,
)
from ._streaming_process import process_checkpoint

__all__ = [
    "CONFIG_KEY",
    "UnsafeFormatError",
    "UnsupportedArchitectureError",
    "save",
    "load",
    "load_tensors",
    "read_header",
    "read_config",
    "read_json",
    "stored_config",
    "from_hf",
    "from_hf_gpt2",
    "from_hf_gpt_neox",
    "from_hf_llama",
    "from_hf_mistral",
    "from_hf_qwen2",
    "from_hf_qwen3",
    "from_hf_gemma",
    "from_hf_gemma2",
    "from_hf_gemma3",
    "from_hf_phi3",
    "from_hf_gptj",
    "from_hf_opt",
    "from_hf_cohere",
    "from_hf_falcon",
    "from_hf_bloom",
    "from_hf_olmo2",
    "from_hf_mixtral",
    "from_hf_qwen2_moe",
    "from_hf_qwen3_moe",
    "from_hf_gpt_oss",
    "from_hf_bert",
    "load_hf_directory",
    "Family",
    "FAMILIES",
    "family",
    "feature_preconditions",
    "identity_table",
    "family_model",
    "as_state_dict",
    "Checkpoint",
    "CheckpointWriter",
    "open_checkpoint",
    "process_checkpoint",
]

def load_hf_directory(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert the ``config.json`` and ``model.safetensors`` (or the shards named by
    ``model.safetensors.index.json``) of a Hugging Face model folder, read whole into memory.

    A folder with only ``pytorch_model.bin`` (a pickle) is refused with :class:`UnsafeFormatError`.
    Every error names the folder and the file or field at fault. :func:`open_checkpoint` reads
    the same folder a layer at a time.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory} is not a folder")
    return open_checkpoint(directory).load()
