"""The cases every checker must judge alike, whatever the form and dtype: a small GPT-2 in a
Hugging Face folder, processed exactly (known identities), rewritten exactly in ways no identity
names, changed by 1 % on one row, or processed by a wrong rewrite. Shared by the corpus test
(tests/test_verdict_corpus.py) and ``benchmarks/sharpness.py``."""

from __future__ import annotations

import contextlib
import io as text_io
from pathlib import Path

import torch
import transformers

import circuitmath as cm
from circuitmath import _cli, io
from circuitmath._checkpoint import CheckpointWriter
from circuitmath.testing import NotEquivalentError, assert_equivalent

VOCAB, CTX = 48, 8
FORMS = ("memory", "file", "folder")


def hf_gpt2(folder: Path, dtype: torch.dtype, *, d_model: int = 16, layers: int = 2, heads: int = 2) -> Path:
    """A Hugging Face GPT-2 folder of random weights of unit scale (gains and biases not 1 and 0)."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CTX, n_embd=d_model, n_layer=layers, n_head=heads,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = torch.randn(param.shape, generator=g)
            if param.ndim == 1:
                value = torch.exp(0.3 * value) if name.endswith("weight") else 0.5 * value
            else:
                value = value * param.shape[-1] ** -0.5
            param.copy_(value)
    model.to(dtype).save_pretrained(folder)
    return folder


def _scaled(tensor: torch.Tensor, index, factor: float) -> torch.Tensor:
    """``tensor`` with ``tensor[index]`` times ``factor``, computed in float64, rounded once."""
    out = tensor.clone()
    out[index] = (tensor[index].double() * factor).to(tensor.dtype)
    return out


def changed_row(processed: dict, factor: float, name: str = "blocks.0.mlp.W_in", row: int = 3) -> dict:
    """``processed`` with one row of one tensor times ``factor``."""
    return dict(processed, **{name: _scaled(processed[name], row, factor)})


def cases(before: dict, cfg: cm.Config) -> dict[str, tuple[dict, cm.Config, bool]]:
    """``{case: (after, after_cfg, valid)}`` for ``before`` (GPT-2-like, 2 layers)."""
    processed, processed_cfg = cm.process_weights(before, cfg)
    folded, folded_cfg = cm.fold_layer_norm(before, cfg)
    ov = dict(processed, **{  # head 1's values times 3, its output weights over 3: W_V W_O unchanged
        "blocks.0.attn.W_V": _scaled(processed["blocks.0.attn.W_V"], 1, 3.0),
        "blocks.0.attn.b_V": _scaled(processed["blocks.0.attn.b_V"], 1, 3.0),
        "blocks.0.attn.W_O": _scaled(processed["blocks.0.attn.W_O"], 1, 1 / 3),
    })
    qk = dict(folded, **{  # head 0's queries times 0.7, its keys over 0.7: the scores unchanged
        "blocks.1.attn.W_Q": _scaled(folded["blocks.1.attn.W_Q"], 0, 0.7),
        "blocks.1.attn.b_Q": _scaled(folded["blocks.1.attn.b_Q"], 0, 0.7),
        "blocks.1.attn.W_K": _scaled(folded["blocks.1.attn.W_K"], 0, 1 / 0.7),
        "blocks.1.attn.b_K": _scaled(folded["blocks.1.attn.b_K"], 0, 1 / 0.7),
    })
    gain = before["blocks.1.ln1.w"].double()
    twice = dict(processed, **{  # layer 1's ln1 gain folded into W_Q twice
        "blocks.1.attn.W_Q": (processed["blocks.1.attn.W_Q"].double() * gain[:, None]).to(before["embed.W_E"].dtype)})
    unbiased = dict(processed, **{"unembed.b_U": before["unembed.b_U"]})  # the final norm's bias not folded into b_U
    return {
        "process_weights": (processed, processed_cfg, True),
        "fold_layer_norm": (folded, folded_cfg, True),
        "unknown: OV scaled": (ov, processed_cfg, True),
        "unknown: QK scaled": (qk, folded_cfg, True),
        "1% of one row": (changed_row(processed, 1.01), processed_cfg, False),
        "1% of one row of W_U": (changed_row(processed, 1.01, "unembed.W_U", 5), processed_cfg, False),
        "gain folded twice": (twice, processed_cfg, False),
        "final bias not folded": (unbiased, processed_cfg, False),
    }


def verdict(form: str, before_folder: Path, before: dict, cfg: cm.Config, after: dict, after_cfg: cm.Config,
            work: Path) -> bool:
    """Whether ``after`` passes as a processing of ``before`` in ``form``: ``assert_equivalent``
    in memory, ``check --processed`` of two files written by ``io.save``, or of the Hugging Face
    folder and a folder written a block at a time."""
    if form == "memory":
        try:
            assert_equivalent(before, after, cfg, after_cfg=after_cfg)
            return True
        except NotEquivalentError:
            return False
    work.mkdir(parents=True, exist_ok=True)
    if form == "file":
        first, second = work / "before.safetensors", work / "after.safetensors"
        io.save(first, before, cfg)
        io.save(second, after, after_cfg)
    else:
        first, second = before_folder, work / "after"
        with CheckpointWriter(second, 2) as out:
            out.write(after, after_cfg)
    with contextlib.redirect_stdout(text_io.StringIO()) as printed:
        status = _cli.main(["check", str(first), "--processed", str(second)])
    assert status in (0, 1), printed.getvalue()
    return status == 0
