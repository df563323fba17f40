"""What every transform shares: the readers of each norm and the precondition checks."""

from __future__ import annotations

from .._config import Config
from .._errors import AlreadyAppliedError, PreconditionError
from .._state import attention_names

__all__ = ["readers", "require", "common_preconditions"]


def readers(cfg: Config) -> list[tuple[str, list[tuple[str, str]]]]:
    """For each norm, the (weight, bias) pairs that read its output (bias ``None``: W_gate has none).

    Attention weights are ``[n_heads, d_model, d_head]``, MLP and unembed ``[d_model, out]``;
    in both the residual axis is the second to last.
    """
    out = []
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        names = [attention_names(cfg, n) for n in "QKV"]
        out.append((f"{p}.ln1", [(f"{p}.attn.{w}", f"{p}.attn.{b}") for w, b, _ in names]))
        if not cfg.attn_only:
            mlp = [(f"{p}.mlp.W_in", f"{p}.mlp.b_in")] + ([(f"{p}.mlp.W_gate", None)] if cfg.gated_mlp else [])
            out.append((f"{p}.ln2", mlp))
    out.append(("ln_final", [("unembed.W_U", "unembed.b_U")]))
    return out


def require(identity: str, precondition: str, holds: bool, detail: str) -> None:
    if not holds:
        raise PreconditionError(identity, precondition, detail)


def common_preconditions(identity: str, cfg: Config) -> None:
    if identity in cfg.applied:
        raise AlreadyAppliedError(identity)
    require(
        identity, "pre-norm", cfg.norm_position == "pre",
        "the model is post-norm: each norm's output is the residual stream itself, read again by"
        " the next norm (a non-linear reader), so there is no linear map to fold into",
    )
    require(
        identity, "norm output read only by linear maps",
        cfg.positional_embedding_type != "shortformer" or cfg.n_layers == 0,
        "with shortformer embeddings W_pos is added to ln1's output before W_Q and W_K read it,"
        " so rewriting W_Q and W_K would rewrite W_pos's contribution too; move W_pos into"
        " per-layer query and key tables first (shortformer_to_tables)",
    )
