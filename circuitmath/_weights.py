"""Random weights with the structure real ones have, drawn reproducibly from a seed."""

from __future__ import annotations

import torch

from ._config import Config
from ._errors import InputError
from ._state import expected_shapes

__all__ = ["random_state_dict"]


def random_state_dict(
    cfg: Config,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    gain_spread: float = 0.5,
    bias_scale: float = 1.0,
    outlier_dims: int = 2,
    outlier_scale: float = 10.0,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """A state dict for ``cfg`` whose values look like a trained model's, not just N(0, 1).

    Drawn in float64 on the CPU from ``seed``, then cast to ``dtype`` and moved to ``device``
    (default the CPU), so the same seed gives the same model in every dtype and on every device.

    - matrices are Gaussian with standard deviation ``1/sqrt(fan_in)``;
    - norm gains are ``exp(N(0, gain_spread))`` (a spread of 0.5 gives gains from about 0.2 to 5),
      and one in ten flips sign;
    - every bias, and every LayerNorm bias, is ``N(0, bias_scale)``;
    - a config with ``tied_embeddings`` gets ``W_E = W_U^T`` (the unembedding's draw, no outliers);
    - ``outlier_dims`` residual directions are written ``outlier_scale`` times larger by the
      embeddings and by every layer's output (``W_O``, ``b_O``, ``W_out``, ``b_out``), as in
      trained transformers.

    >>> from circuitmath import Config
    >>> cfg = Config(n_layers=0, d_model=4, n_heads=1, d_head=2, d_vocab=3, n_ctx=2)
    >>> sorted(random_state_dict(cfg, seed=0))
    ['embed.W_E', 'ln_final.b', 'ln_final.w', 'pos_embed.W_pos', 'unembed.W_U', 'unembed.b_U']
    """
    for name, value in (("gain_spread", gain_spread), ("bias_scale", bias_scale), ("outlier_scale", outlier_scale)):
        if not value >= 0:
            raise InputError(f"{name} must be >= 0, got {value!r}")
    if not 0 <= outlier_dims <= cfg.d_model:
        raise InputError(f"outlier_dims must lie in [0, d_model={cfg.d_model}], got {outlier_dims!r}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    f64, cpu = torch.float64, torch.device("cpu")

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=f64, device=cpu) * std

    writer_scale = torch.ones(cfg.d_model, dtype=f64, device=cpu)
    chosen = torch.randperm(cfg.d_model, generator=g, device=cpu)[:outlier_dims]
    writer_scale[chosen] = outlier_scale

    out = {}
    for name, shape in expected_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[1]
        if leaf == "w":
            signs = torch.where(torch.rand(shape, generator=g, dtype=f64, device=cpu) < 0.1, -1.0, 1.0)
            value = torch.exp(normal(shape, gain_spread)) * signs
        elif leaf.startswith("pos_"):  # shortformer_tables: W_pos @ W_Q has unit-scale entries
            value = normal(shape, 1.0)
        elif leaf.startswith("b"):
            value = normal(shape, bias_scale)
        else:  # a matrix: the residual axis is read (fan-in) or written
            fan_in = shape[-2] if len(shape) > 1 else 1
            value = normal(shape, fan_in**-0.5 if leaf not in ("W_E", "W_pos") else 1.0)
        if leaf in ("W_E", "W_pos", "W_O", "b_O", "W_out", "b_out"):
            value = value * writer_scale
        out[name] = value.to(dtype=dtype, device=device or cpu)
    if cfg.tied_embeddings:  # one tensor in the checkpoint, at the unembedding's scale
        out["embed.W_E"] = out["unembed.W_U"].T.contiguous()
    return out
