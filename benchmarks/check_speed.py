"""Time ``python -m circuitmath check MODEL --processed OTHER`` and ``check MODEL`` against the forward passes they need.

GPT-2-small-shaped float32 weights (12 layers, d_model 768, 12 heads, d_mlp 3072, d_vocab 50257,
untied unembed: 163M parameters) with LayerNorm gains and biases that are not 1 and 0; OTHER is
``process_weights`` of MODEL, both saved with ``circuitmath.io.save``. Each check runs in this
process (``circuitmath._cli.main``) on 4 x 128 random tokens. The baseline, measured in the same
run, is the reference forward pass of MODEL and of OTHER on the same tokens, from tensors already
in memory. The two are timed alternately, ``--repeats`` times, and the median of the per-repeat
ratios is reported (the machine is shared: the ratio of two times measured together is steadier
than either time). Targets (issue 35): ``check --processed`` at most 1.5 times its two forward
passes; ``check MODEL`` (every registered weight identity, each applied and compared) at most
1.5 times (identities + 1) forward passes, timed once (``--no-model-check`` skips it). Exits 1
when a target is missed.

Usage: ``python benchmarks/check_speed.py [--repeats N] [--layers L] [--threads T] [--no-model-check]``
(one thread unless ``--threads`` says otherwise; 0: torch's default).

Where the time goes in one warm ``check --processed`` (profile it with cProfile): the two
float32 forward passes, most of it; the replay with its tensor certificates (screened in float32,
:func:`circuitmath._diagnosis._tensors._screen`) and relative differences; the log-prob
comparison. The rounding sensitivity (two float64 passes) is measured only when the difference
exceeds the tolerance's a-priori term, so a correct float32 processing pays none. One reference
forward pass of GPT-2-small on 4 x 128 tokens is about 127 GFLOP.
"""

from __future__ import annotations

import argparse
import contextlib
import io as text_io
import statistics
import tempfile
import time
from pathlib import Path

import torch

import circuitmath as cm
from circuitmath import _cli, io


#: The issue's target: a check takes at most this many times the forward passes it needs.
TARGET_RATIO = 1.5


def gpt2_small(layers: int) -> cm.Config:
    return cm.Config(n_layers=layers, d_model=768, n_heads=12, d_head=64, d_vocab=50257, n_ctx=1024, d_mlp=3072,
                     act_fn="gelu_new")


def weights(cfg: cm.Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 weights drawn directly in float32 (``random_state_dict`` draws in float64 first,
    which for 163M parameters takes longer than the benchmark): matrices ``N(0, 1/fan_in)``,
    gains ``exp(N(0, 0.3))``, biases ``N(0, 0.1)``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in cm.expected_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[1]
        if leaf == "w":
            out[name] = torch.exp(torch.randn(shape, generator=g) * 0.3)
        elif leaf.startswith("b"):
            out[name] = torch.randn(shape, generator=g) * 0.1
        else:
            fan_in = shape[-2] if len(shape) > 1 and leaf not in ("W_E", "W_pos") else 1
            out[name] = torch.randn(shape, generator=g) * fan_in**-0.5
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (the median ratio is reported)")
    parser.add_argument("--layers", type=int, default=12, help="number of layers (12: GPT-2 small)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--no-model-check", action="store_true", help="skip timing check MODEL")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = gpt2_small(args.layers)
    model = weights(cfg)
    processed, processed_cfg = cm.process_weights(model, cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.d_vocab, (4, 128), generator=g)  # what `check` draws by default
    with tempfile.TemporaryDirectory() as folder:
        model_path, processed_path = Path(folder, "model.safetensors"), Path(folder, "processed.safetensors")
        io.save(model_path, model, cfg)
        io.save(processed_path, processed, processed_cfg)

        forward_times, check_times = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            cm.log_probs(model, cfg, tokens)
            cm.log_probs(processed, processed_cfg, tokens)
            forward_times.append(time.perf_counter() - start)
            check_times.append(_timed_check(["check", str(model_path), "--processed", str(processed_path)]))
        model_check = None if args.no_model_check else _model_check(model, cfg, tokens, model_path)

    ratios = [c / f for c, f in zip(check_times, forward_times)]
    parameters = sum(t.numel() for t in model.values())
    print(f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, d_vocab {cfg.d_vocab}, {parameters / 1e6:.0f}M parameters,"
          f" tokens 4 x 128, torch threads {torch.get_num_threads()}")
    print(f"two forward passes (model and processed): {' '.join(f'{t:.2f}' for t in forward_times)} s")
    print(f"check MODEL --processed OTHER:            {' '.join(f'{t:.2f}' for t in check_times)} s")
    ratio = statistics.median(ratios)
    print(f"ratio check / two forward passes:         {ratio:.2f} median of {' '.join(f'{r:.2f}' for r in ratios)}"
          f"  (target <= {TARGET_RATIO:g})")
    met = ratio <= TARGET_RATIO
    if model_check is not None:
        identities, seconds, forward = model_check
        model_ratio = seconds / ((identities + 1) * forward)
        print(f"check MODEL ({identities} weight identities): {seconds:.1f} s, one forward pass {forward:.2f} s:"
              f" {model_ratio:.2f}x (identities + 1) forward passes  (target <= {TARGET_RATIO:g})")
        met = met and model_ratio <= TARGET_RATIO
    print("targets met" if met else "targets NOT met")
    return 0 if met else 1


def _timed_check(argv: list[str]) -> float:
    """Seconds ``python -m circuitmath <argv>`` takes in this process (it must exit 0)."""
    out = text_io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        status = _cli.main(argv)
    seconds = time.perf_counter() - start
    if status != 0:
        print(out.getvalue())
        raise SystemExit(f"{' '.join(argv[:1])} exited {status} on a correct model")
    return seconds


def _model_check(model, cfg, tokens, model_path) -> tuple[int, float, float]:
    """``(weight identities, seconds of check MODEL, seconds of one forward pass)``, the pass timed
    just before and after the check (the smaller: the machine is shared)."""
    from circuitmath._diagnosis import weight_identities

    passes = []
    for _ in range(2):
        start = time.perf_counter()
        cm.log_probs(model, cfg, tokens)
        passes.append(time.perf_counter() - start)
        if len(passes) == 1:
            seconds = _timed_check(["check", str(model_path)])
    return len(weight_identities(symmetries=True)), seconds, min(passes)


if __name__ == "__main__":
    raise SystemExit(main())
