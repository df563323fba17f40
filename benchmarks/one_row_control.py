"""Time ``check MODEL --processed OTHER`` where OTHER has one row of one tensor changed by 1 %.

MODEL: GPT-2-small-shaped float32 weights (``check_speed.weights``) with ``--layers`` layers
(4 unless told); OTHER: ``process_weights`` of it, then row 5 of ``blocks.0.mlp.W_in`` times
1.01, both saved with ``circuitmath.io.save``. The check must exit 1 and name
``blocks.0.mlp.W_in`` and its row; the benchmark prints its seconds and the ratio to the two
forward passes (model and OTHER) timed just before it, in the same run, and its peak resident
memory. Where the time goes: the replay and the search for a known wrong rewrite that would
explain the row (each identity's wrong rewrites on the stages that rewrite ``W_in``, then each
followed by the rest of the replay), and the float64 passes that judge the change.

Usage: ``python benchmarks/one_row_control.py [--layers L]`` (one torch thread). Exits 1 when
the check does not name the tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import io as text_io
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

import circuitmath as cm
from circuitmath import _cli, io

sys.path.insert(0, str(Path(__file__).parent))
from check_speed import gpt2_small, weights  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = gpt2_small(args.layers)
    model = weights(cfg)
    processed, processed_cfg = cm.process_weights(model, cfg)
    processed = dict(processed)
    changed = processed["blocks.0.mlp.W_in"].clone()
    changed[5] *= 1.01
    processed["blocks.0.mlp.W_in"] = changed
    tokens = torch.randint(0, cfg.d_vocab, (4, 128), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as folder:
        model_path, other_path = Path(folder, "model.safetensors"), Path(folder, "other.safetensors")
        io.save(model_path, model, cfg)
        io.save(other_path, processed, processed_cfg)
        start = time.perf_counter()
        cm.log_probs(model, cfg, tokens)
        cm.log_probs(processed, processed_cfg, tokens)
        forward = time.perf_counter() - start
        out = text_io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(out):
            status = _cli.main(["check", str(model_path), "--processed", str(other_path)])
        seconds = time.perf_counter() - start
    named = "blocks.0.mlp.W_in" in out.getvalue() and "rows 5 (1 of 768) differ" in out.getvalue()
    print(f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, d_vocab {cfg.d_vocab}; row 5 of blocks.0.mlp.W_in x 1.01")
    print(f"check exit status {status}, names the tensor and its row: {named}")
    print(f"check {seconds:.1f} s, two forward passes {forward:.2f} s: {seconds / forward:.1f}x;"
          f" peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")
    if status != 1 or not named:
        print(out.getvalue())
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
