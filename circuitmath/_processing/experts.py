"""The symmetry of a mixture-of-experts MLP: reordering its experts with the router's columns."""

from __future__ import annotations

import torch

from .._config import Config
from .._errors import Precondition
from .._moe import EXPERT_LEAVES, expert_names
from .._state import StateDict, validate_state_dict
from ._common import require, rewrite
from .rotation import _per_layer, _take

__all__ = ["permute_experts", "recover_expert_permutation", "HAS_EXPERTS", "AN_EXPERT_PERMUTATION"]

HAS_EXPERTS = Precondition("the MLPs are mixtures of experts", "every MLP is a mixture of experts (Config.n_experts)")
AN_EXPERT_PERMUTATION = Precondition("a permutation of the experts", "a permutation of 0..n_experts-1, per layer or for all")


@rewrite(composes=True, check_output=False)
def permute_experts(
    state_dict: StateDict, cfg: Config, permutation, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Reorder the experts of every mixture-of-experts MLP: new expert ``i`` is old expert
    ``permutation[i]``, with the router's column ``i`` (``W_router`` ``[d_model, n_experts]``,
    ``b_router`` ``[n_experts]``) the old column ``permutation[i]``.

    ``permutation`` is ``[n_experts]`` (every layer) or ``[n_layers, n_experts]``. The router's
    logits are permuted, ``l P``; the softmax and the choice of the ``experts_per_token`` largest
    commute with a permutation of the experts (top-k routing is permutation-equivariant, when the
    ``k``-th and ``(k+1)``-th largest logits differ: a tie is broken by index, which the
    permutation changes), so each expert gets the weight it had and the weighted sum is the same.
    The shared expert is not routed and stays. Data movement only; dtype and device are kept. A
    second application is a permutation too and is not refused; each records ``"permute_experts"``.
    """
    require(identity, HAS_EXPERTS, cfg.n_experts is not None, "every MLP is dense: there are no experts to permute")
    validate_state_dict(state_dict, cfg)
    perms = _per_layer(identity, permutation, cfg.n_layers, cfg.n_experts, "experts", AN_EXPERT_PERMUTATION)
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        p, perm = f"blocks.{layer}.mlp", perms[layer]
        out[f"{p}.W_router"] = _take(state_dict[f"{p}.W_router"], perm, 1)
        out[f"{p}.b_router"] = _take(state_dict[f"{p}.b_router"], perm, 0)
        names = expert_names(cfg, p)
        for new, old in zip(names, perm.tolist()):
            for leaf in EXPERT_LEAVES:
                out[f"{new}.{leaf}"] = state_dict[f"{names[old]}.{leaf}"]
    return out, cfg


def recover_expert_permutation(before: StateDict, after: StateDict, cfg: Config) -> torch.Tensor | None:
    """``[n_layers, n_experts]``: the permutation with ``after`` closest to ``permute_experts(before,
    cfg, perm)``, each new expert matched to the old one whose ``W_out`` is nearest (so a
    permutation composed with rounded rewrites is found too; the caller certifies the tensors),
    or ``None``: a dense model, two experts matched to one, or no expert moved."""
    if cfg.n_experts is None or cfg.attn_only:
        return None
    perms = []
    for layer in range(cfg.n_layers):
        names = expert_names(cfg, f"blocks.{layer}.mlp")
        old = torch.stack([before[f"{name}.W_out"].double().flatten() for name in names])
        new = torch.stack([after[f"{name}.W_out"].double().flatten().to(old.device) for name in names])
        perm = torch.cdist(new, old).argmin(dim=1).cpu()
        if len(set(perm.tolist())) != cfg.n_experts:
            return None
        perms.append(perm)
    perm = torch.stack(perms)
    return None if torch.equal(perm, torch.arange(cfg.n_experts).expand_as(perm)) else perm
