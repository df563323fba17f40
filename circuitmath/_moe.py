"""The mixture-of-experts MLP (``Config.n_experts``): its tensors, readers and writers, and its
forward pass.

Per layer, under ``blocks.{layer}.mlp``:

- ``W_router`` ``[d_model, n_experts]``, ``b_router`` ``[n_experts]``: the router, which reads
  the normalised residual stream ``x`` ``[..., d_model]``;
- ``experts.{e}.W_in``, ``experts.{e}.W_gate`` ``[d_model, d_mlp]``, ``experts.{e}.b_in``,
  ``experts.{e}.b_gate`` ``[d_mlp]``, ``experts.{e}.W_out`` ``[d_mlp, d_model]``,
  ``experts.{e}.b_out`` ``[d_model]``: expert ``e``, a gated MLP ``act(x W_gate + b_gate) *
  (x W_in + b_in) W_out + b_out`` (GPT-OSS: the clamped SwiGLU of ``Config.swiglu_limit``);
- with ``d_shared_mlp``: ``shared.*``, a gated MLP of width ``d_shared_mlp`` run on every token,
  and ``W_shared_gate`` ``[d_model, 1]``, its gate ``sigmoid(x W_shared_gate)``.

The output is ``sum_e g_e(x) expert_e(x)`` (plus the gated shared expert), with ``g(x)`` the
softmax of the router's logits ``x W_router + b_router`` kept on the ``experts_per_token``
largest and zero elsewhere (divided by their sum with ``router_normalize_top_k``, which is the
softmax over the chosen logits). Experts are summed in the order of their index, the order
``transformers`` adds them in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._config import Config

__all__ = ["mixture_shapes", "mixture_readers", "mixture_writers", "expert_names", "mixture", "routing", "routers",
           "clamped_swiglu", "EXPERT_LEAVES"]


def expert_names(cfg: Config, prefix: str) -> list[str]:
    """The prefixes of the experts of the MLP ``prefix`` (``blocks.0.mlp``), in index order."""
    return [f"{prefix}.experts.{e}" for e in range(cfg.n_experts)]


#: The tensors of one expert (under ``experts.{e}``), in the order :func:`mixture_shapes` lists them.
EXPERT_LEAVES = ("W_in", "W_gate", "b_in", "b_gate", "W_out", "b_out")


def routers(cfg: Config) -> list[str]:
    """Every router tensor (``W_router``, ``b_router``) of the model; none in a dense model."""
    if cfg.n_experts is None or cfg.attn_only:
        return []
    return [f"blocks.{layer}.mlp.{leaf}" for layer in range(cfg.n_layers) for leaf in ("W_router", "b_router")]


def _gated(prefix: str, d: int, width: int) -> dict[str, tuple[int, ...]]:
    shapes = {"W_in": (d, width), "W_gate": (d, width), "b_in": (width,), "b_gate": (width,), "W_out": (width, d),
              "b_out": (d,)}
    return {f"{prefix}.{leaf}": shapes[leaf] for leaf in EXPERT_LEAVES}


def mixture_shapes(cfg: Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of the mixture-of-experts MLP ``prefix`` (``blocks.0.mlp``) with its shape."""
    d = cfg.d_model
    shapes = {f"{prefix}.W_router": (d, cfg.n_experts), f"{prefix}.b_router": (cfg.n_experts,)}
    for expert in expert_names(cfg, prefix):
        shapes |= _gated(expert, d, cfg.d_mlp)
    if cfg.d_shared_mlp is not None:
        shapes |= _gated(f"{prefix}.shared", d, cfg.d_shared_mlp) | {f"{prefix}.W_shared_gate": (d, 1)}
    return shapes


def mixture_readers(cfg: Config, prefix: str) -> list[tuple[str, str | None]]:
    """The (weight, bias) pairs that read the MLP's norm (bias ``None``: none): the router, each
    expert's ``W_in`` and ``W_gate``, the shared expert's and its gate. Each is ``[d_model, out]``."""
    pairs = [(f"{prefix}.W_router", f"{prefix}.b_router")]
    for expert in expert_names(cfg, prefix) + ([f"{prefix}.shared"] if cfg.d_shared_mlp is not None else []):
        pairs += [(f"{expert}.W_in", f"{expert}.b_in"), (f"{expert}.W_gate", f"{expert}.b_gate")]
    if cfg.d_shared_mlp is not None:
        pairs.append((f"{prefix}.W_shared_gate", None))
    return pairs


def mixture_writers(cfg: Config, prefix: str) -> list[str]:
    """The tensors of the MLP that write to the residual stream (last axis ``d_model``): each
    expert's ``W_out`` ``[d_mlp, d_model]`` and ``b_out`` ``[d_model]``, and the shared expert's."""
    experts = expert_names(cfg, prefix) + ([f"{prefix}.shared"] if cfg.d_shared_mlp is not None else [])
    return [f"{expert}.{name}" for expert in experts for name in ("W_out", "b_out")]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's gated unit on the gate's and up's pre-activations ``[..., d_mlp]``:
    ``(clamp(up, -limit, limit) + 1) * g sigmoid(alpha g)`` with ``g = min(gate, limit)``."""
    gate = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def routing(params, prefix: str, cfg: Config, x: torch.Tensor) -> torch.Tensor:
    """The weight of each expert for each position, ``[..., n_experts]``: the softmax of the
    router's logits on the ``experts_per_token`` largest (renormalised over them with
    ``router_normalize_top_k``), zero on the others."""
    logits = x @ params[f"{prefix}.W_router"] + params[f"{prefix}.b_router"]
    probs = torch.softmax(logits, dim=-1)
    top, chosen = torch.topk(probs, cfg.experts_per_token, dim=-1)
    if cfg.router_normalize_top_k:
        top = top / top.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, chosen, top)


def mixture(params, prefix: str, cfg: Config, x: torch.Tensor,
            gated_mlp: Callable[[str, torch.Tensor], torch.Tensor], record: list | None = None) -> torch.Tensor:
    """The mixture-of-experts MLP ``prefix`` on the normalised stream ``x`` ``[batch, pos,
    d_model]``, ``[batch, pos, d_model]``. ``gated_mlp(prefix, x)`` is the dense gated MLP of the
    tensors under ``prefix`` (the reference's). Every expert runs on every position (clarity,
    not speed); one not chosen has weight exactly zero, so it adds nothing. ``record``, a list,
    receives the routing weights ``[batch, pos, n_experts]``."""
    weights = routing(params, prefix, cfg, x)
    if record is not None:
        record.append(weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(expert_names(cfg, prefix)):
        chosen = weights[..., e] != 0
        if bool(chosen.any()):
            out = out + weights[..., e, None] * gated_mlp(expert, x)
    if cfg.d_shared_mlp is not None:
        gate = torch.sigmoid(x @ params[f"{prefix}.W_shared_gate"])
        out = out + gate * gated_mlp(f"{prefix}.shared", x)
    return out
