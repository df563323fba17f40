"""Induction-head evidence, in plain torch: attention patterns, prefix matching, direct logit
attribution and composition scores.

An induction head in layer 1 attends from a token to the token *after* that token's previous
occurrence (prefix matching) and raises the logit of the token it attends to (copying, measured
here by its direct logit attribution: not the eigenvalue copying score of
:func:`circuitmath.circuits.copying_scores`, which is a property of the weights alone, in [-1, 1]). It finds
that position through K-composition with a previous-token head in layer 0, whose output tells
each position which token came before it. Attention patterns and the behavioural scores are
computed here; composition scores come from :mod:`circuitmath.circuits`.

All scores are measured on repeated random sequences ``[r_1 .. r_L, r_1 .. r_L]`` of lowercase
ASCII letters (bytes the models saw in every identifier; rare bytes such as ``~`` have barely
trained embeddings), where only induction can predict the second half. The zoo's model cards
record :func:`induction_summary` of each model; the real-weights chapter of the book recomputes it.

>>> from circuitmath import zoo
>>> from circuitmath.zoo import induction
>>> tokens = induction.repeated_random_tokens(2, 5, seed=0)  # [batch, 2 * length]
>>> tokens.shape, bool((tokens[:, :5] == tokens[:, 5:]).all())
(torch.Size([2, 10]), True)
>>> _logits, patterns, _heads, _scale = induction.run_with_patterns(*zoo.load("attn_only_2l"), tokens)
>>> induction.prefix_matching_scores(patterns, 5).shape  # [n_layers, n_heads]
torch.Size([2, 4])
"""

from __future__ import annotations

import torch

from .. import circuits
from .._config import Config
from .._processing import center_writing_weights, fold_layer_norm
from .._reference import forward
from .._state import StateDict
from ._corpus import corpus_tokens
from .._errors import InputError

__all__ = [
    "repeated_random_tokens",
    "repeated_text_tokens",
    "run_with_patterns",
    "previous_token_scores",
    "prefix_matching_scores",
    "direct_logit_attribution",
    "in_context_losses",
    "composition_scores",
    "induction_summary",
    "positional_share",
]

LETTERS = torch.arange(ord("a"), ord("z") + 1)  # the 26 lowercase ASCII letters


def repeated_random_tokens(batch: int, length: int, *, seed: int = 0) -> torch.Tensor:
    """``[batch, 2 * length]`` byte tokens: ``length`` random lowercase letters, twice."""
    g = torch.Generator().manual_seed(seed)
    half = LETTERS[torch.randint(0, len(LETTERS), (batch, length), generator=g)]
    return torch.cat([half, half], dim=1)


def repeated_text_tokens(batch: int, length: int, *, seed: int = 0) -> torch.Tensor:
    """``[batch, 2 * length]``: random windows of held-out standard-library text, each said twice
    (the in-distribution counterpart of :func:`repeated_random_tokens`)."""
    text = corpus_tokens("heldout")
    starts = torch.randint(0, len(text) - length, (batch,), generator=torch.Generator().manual_seed(seed))
    half = torch.stack([text[s:s + length] for s in starts.tolist()])
    return torch.cat([half, half], dim=1)


def run_with_patterns(state_dict: StateDict, cfg: Config, tokens: torch.Tensor):
    """The reference forward pass of a pre-norm model, keeping what the scores need.

    Returns ``(logits [batch, pos, d_vocab], patterns, head_outputs, final_scale)``:
    ``patterns[l]`` is layer ``l``'s attention ``[batch, n_heads, query, key]``,
    ``head_outputs[l]`` each head's write to the residual stream ``[batch, pos, n_heads,
    d_model]`` (without ``b_O``), both recorded by :func:`circuitmath.forward`, and
    ``final_scale [batch, pos, 1]`` the divisor ``ln_final`` applies.
    """
    if cfg.norm_position != "pre":
        raise InputError("run_with_patterns needs a pre-norm model: its direct logit attribution reads the heads through ln_final")
    record: dict = {}
    logits = forward(state_dict, cfg, tokens, record=record)
    x = record["final_residual"]
    centered = x - x.mean(-1, keepdim=True) if cfg.normalization_type in ("LN", "LNPre") else x
    final_scale = torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + cfg.eps)
    return logits, record["patterns"], record["head_outputs"], final_scale


def previous_token_scores(patterns) -> torch.Tensor:
    """``[n_layers, n_heads]``: mean attention from each position to the one just before it."""
    return torch.stack([p.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2)) for p in patterns])


def prefix_matching_scores(patterns, length: int) -> torch.Tensor:
    """``[n_layers, n_heads]``: on ``[r, r]`` with ``len(r) = length``, the mean attention from
    position ``length + i`` (a repeat of ``r_i``) to position ``i + 1`` (what followed ``r_i``)."""
    queries = torch.arange(length, 2 * length - 1)
    return torch.stack([p[:, :, queries, queries - length + 1].mean(dim=(0, 2)) for p in patterns])


def direct_logit_attribution(state_dict: StateDict, cfg: Config, tokens: torch.Tensor, head_outputs, final_scale,
                             length: int):
    """``[n_layers, n_heads]``: on ``[r, r]``, the direct logit attribution of each head to the
    correct next token: how much the head's own output, read directly by the unembed, raises that
    token's logit above the mean logit, averaged over the second half (in logit units, unbounded).
    An induction head copies: large and positive.

    The head's write passes through ``ln_final`` as the model applies it (centering, the actual
    per-position scale, the gain), so the contributions of all heads and the other terms add up
    to the logits.
    """
    W_U = state_dict["unembed.W_U"]
    gain = state_dict.get("ln_final.w")
    targets = tokens[:, length + 1:]
    out = []
    for per_head in head_outputs:
        h = per_head[:, length:-1]  # positions whose next token is predictable by induction
        if cfg.normalization_type in ("LN", "LNPre"):
            h = h - h.mean(-1, keepdim=True)
        h = h / final_scale[:, length:-1, None]
        if gain is not None:
            h = h * gain
        logits = h @ W_U  # [batch, pos, head, vocab]
        correct = logits.gather(-1, targets[:, :, None, None].expand(-1, -1, logits.shape[2], 1))[..., 0]
        out.append((correct - logits.mean(-1)).mean(dim=(0, 1)))
    return torch.stack(out)


def in_context_losses(logits: torch.Tensor, tokens: torch.Tensor, length: int) -> tuple[float, float]:
    """Mean next-token loss (nats) on the first and on the second copy of ``[r, r]``."""
    nll = -torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return float(nll[:, : length - 1].mean()), float(nll[:, length:].mean())


def composition_scores(state_dict: StateDict, cfg: Config) -> dict[str, torch.Tensor]:
    """Q-, K- and V-composition scores between every layer-0 head and every layer-1 head.

    :func:`circuitmath.circuits.composition_scores` on the model as its LayerNorms see it: the
    gains folded into the matrices that read them (:func:`circuitmath.fold_layer_norm`) and the
    writing weights centered (:func:`circuitmath.center_writing_weights`), since every reader
    removes the mean first. Row convention: the K-composition score of heads ``a`` (layer 0) and
    ``b`` (layer 1) is ``||W_OV^a (W_QK^b)^T||_F / (||W_OV^a||_F ||W_QK^b||_F)``. Returns
    ``{"Q", "K", "V"}`` each ``[n_heads (layer 0), n_heads (layer 1)]``.
    """
    if cfg.n_layers < 2:
        raise InputError("composition scores need two layers")
    folded, folded_cfg = fold_layer_norm(state_dict, cfg)
    folded, folded_cfg = center_writing_weights(folded, folded_cfg)
    scores = circuits.composition_scores(folded, folded_cfg)
    return {kind.upper(): value[0, :, 1, :] for kind, value in scores.items()}


def induction_summary(state_dict: StateDict, cfg: Config, *, batch: int = 16, length: int = 50, seed: int = 0) -> dict:
    """Every score above for one model, as plain lists, with the in-context losses on repeated
    random bytes and on repeated held-out text (``length`` is capped at ``n_ctx // 2``)."""
    length = min(length, cfg.n_ctx // 2)
    tokens = repeated_random_tokens(batch, length, seed=seed)
    with torch.no_grad():
        logits, patterns, heads, scale = run_with_patterns(state_dict, cfg, tokens)
        first, second = in_context_losses(logits, tokens, length)
        out = {
            "repeated_sequence": {"batch": batch, "length": length, "seed": seed},
            "loss_first_half": first,
            "loss_second_half": second,
            "previous_token": previous_token_scores(patterns).tolist(),
            "prefix_matching": prefix_matching_scores(patterns, length).tolist(),
            "direct_logit_attribution": direct_logit_attribution(state_dict, cfg, tokens, heads, scale, length).tolist(),
        }
        text = repeated_text_tokens(batch, length, seed=seed)
        out["text_loss_first_half"], out["text_loss_second_half"] = in_context_losses(
            run_with_patterns(state_dict, cfg, text)[0], text, length)
        if cfg.n_layers >= 2:
            out["composition"] = {kind: m.tolist() for kind, m in composition_scores(state_dict, cfg).items()}
    return out



def positional_share(state_dict: StateDict, cfg: Config) -> float:
    """How much of layer 0's query/key input is position: the mean, over every lowercase letter
    and every position, of ``||positional part|| / ||input||`` for the input ``attn`` reads its
    queries and keys from (first head's gain and bias of ``ln1`` included).

    Standard positions enter before ``ln1``, which is linear once its scale is fixed: the
    positional part is ``w * center(p) / scale(e + p)`` and the input ``LN(e + p)``. Shortformer
    positions are added after it: ``p`` beside ``LN(e)``.
    """
    if cfg.positional_embedding_type not in ("standard", "shortformer") or cfg.normalization_type != "LN":
        raise InputError("positional_share covers pre-LN models with standard or shortformer positions")
    with torch.no_grad():
        e = state_dict["embed.W_E"][LETTERS].double()[:, None, :]
        p = state_dict["pos_embed.W_pos"].double()[None, :, :]
        w, b = state_dict["blocks.0.ln1.w"].double(), state_dict["blocks.0.ln1.b"].double()

        def center(v):
            return v - v.mean(-1, keepdim=True)

        def scale(v):
            return torch.sqrt(center(v).pow(2).mean(-1, keepdim=True) + cfg.eps)

        if cfg.positional_embedding_type == "standard":
            x = e + p
            part, whole = w * center(p) / scale(x), w * center(x) / scale(x) + b
        else:
            part, whole = p.expand(e.shape[0], -1, -1), w * center(e) / scale(e) + b + p
        return float((part.norm(dim=-1) / whole.norm(dim=-1)).mean())
