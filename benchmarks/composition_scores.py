"""Time the Q-, K- and V-composition scores of every pair of heads of a GPT-2-small-shaped model.

From the factors (``circuitmath.circuits.composition_scores``): one QR per head and one
``[n_heads d_head, d_model] @ [d_model, n_heads d_head]`` product per pair of layers; no
``d_model x d_model`` matrix is formed. Against the naive computation, measured in the same run:
materialise ``W_OV`` and ``W_QK`` of every head (``[d_model, d_model]`` each), then one
``d_model x d_model`` product and three Frobenius norms per pair of heads and kind. Every naive
pair costs the same, so the naive time is measured on a sample of pairs and scaled to all of
them (both numbers are printed), and the two methods' scores are compared on the sample.

Usage: ``python benchmarks/composition_scores.py [--repeats N] [--sample PAIRS]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import circuitmath as cm
from circuitmath.circuits import composition_scores, ov_circuits, qk_circuits

GPT2_SMALL = cm.Config(n_layers=12, d_model=768, n_heads=12, d_head=64, d_vocab=50257, n_ctx=1024, d_mlp=3072)


def gpt2_shaped_weights(cfg: cm.Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 Gaussian weights of the right shapes (``1/sqrt(fan_in)``), drawn directly in
    float32 to keep the set-up light (``random_state_dict`` draws in float64 first)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in cm.expected_shapes(cfg).items():
        fan_in = shape[-2] if len(shape) > 1 else 1
        scale = fan_in**-0.5 if name.rsplit(".", 1)[1].startswith("W") else 0.1
        out[name] = torch.randn(shape, generator=g) * scale
    return out


def naive_scores(ov: torch.Tensor, qk: torch.Tensor, pairs: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """Scores ``[len(pairs), 3]`` (q, k, v) from materialised ``[d_model, d_model]`` circuits."""
    fro = torch.linalg.matrix_norm
    out = torch.empty(len(pairs), 3)
    for i, (l1, h1, l2, h2) in enumerate(pairs):
        writer = ov[l1, h1]
        for j, reader in enumerate((qk[l2, h2], qk[l2, h2].T, ov[l2, h2])):
            out[i, j] = fro(writer @ reader) / (fro(writer) * fro(reader))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the factored computation (median)")
    parser.add_argument("--sample", type=int, default=24, help="head pairs timed for the naive computation")
    args = parser.parse_args()

    cfg = GPT2_SMALL
    state_dict = gpt2_shaped_weights(cfg)
    L, H = cfg.n_layers, cfg.n_heads
    all_pairs = [(l1, h1, l2, h2) for l1 in range(L) for l2 in range(l1 + 1, L) for h1 in range(H) for h2 in range(H)]
    print(f"GPT-2-small shape: {L} layers x {H} heads, d_model {cfg.d_model}, d_head {cfg.d_head}; "
          f"{len(all_pairs)} pairs of heads in different layers, 3 kinds each; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")

    composition_scores(state_dict, cfg)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        scores = composition_scores(state_dict, cfg)
        times.append(time.perf_counter() - start)
    factored = statistics.median(times)

    start = time.perf_counter()
    ov, qk = ov_circuits(state_dict, cfg).AB, qk_circuits(state_dict, cfg).AB  # [L, H, d, d] each
    materialise = time.perf_counter() - start
    sample = all_pairs[:: max(1, len(all_pairs) // args.sample)][: args.sample]
    start = time.perf_counter()
    naive = naive_scores(ov, qk, sample)
    per_pair = (time.perf_counter() - start) / len(sample)
    naive_total = materialise + per_pair * len(all_pairs)

    ours = torch.stack([torch.stack([scores[k][l1, h1, l2, h2] for k in ("q", "k", "v")]) for l1, h1, l2, h2 in sample])
    gap = float((ours - naive).abs().max())
    print(f"from factors (all pairs, q+k+v):   {factored:8.3f} s  (median of {args.repeats})")
    print(f"naive, materialising W_OV, W_QK:   {materialise:8.3f} s  (once per head)")
    print(f"naive, per pair of heads:          {per_pair * 1e3:8.3f} ms (measured on {len(sample)} pairs)")
    print(f"naive, all pairs (scaled):         {naive_total:8.3f} s")
    print(f"ratio naive / factored:            {naive_total / factored:8.1f} x")
    print(f"largest score difference on the sampled pairs: {gap:.2e}")
    return 0 if gap < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
