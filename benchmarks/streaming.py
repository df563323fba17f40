"""Processing and checking checkpoints layer by layer: time and peak memory against copying the files.

Two measurements.

1. A LLaMA-7B-shaped checkpoint in the Hugging Face layout (32 layers, d_model 4096, 32 heads
   of 128 with 8 key/value heads, gated MLP of 11008, RMSNorm, vocabulary 32000, untied
   ``lm_head``; 5.9 B parameters, 11.9 GB in bfloat16) of random weights, written once in 2 GB
   shards under ``.cache/streaming/`` (reused by later runs; ``torch.randn`` in bfloat16, the
   cheapest generator torch has). Then, each in its own subprocess whose peak resident memory is
   read from ``wait4`` (``ru_maxrss``: file pages mapped in count too):

   - ``cp -r`` of the folder (the yardstick: reading and writing the checkpoint once) and
     ``python -m circuitmath process IN OUT --steps applicable`` (for LLaMA: fold the RMSNorm
     gains, fold the value biases, center the unembed), alternating for ``--rounds`` rounds,
     each after ``sync`` and a read of the folder, so that both start with no writes pending
     and the checkpoint in the page cache as far as it fits; the best time of each counts
     (``cp`` alone varied from 6.7 to 17.9 s between runs here, with the disk's state);
   - ``python -m circuitmath check IN --processed OUT`` on ``--batch`` x ``--seq-len`` tokens;
   - ``python -m circuitmath check IN`` on the same tokens: every weight identity checked a
     layer at a time (for LLaMA: center_unembed, fold_rms_norm, fold_value_biases, the rotation
     of the residual stream, which multiplies every matrix by a d_model x d_model ``Q`` in
     float64, the permutations and process_weights; the others are refused).

   Outputs are removed afterwards; the input stays cached. Needs about 40 GB of free disk.

2. GPT-2-small-shaped float32 weights (163M parameters, untied unembed) in a circuitmath
   safetensors file: the streaming ``process_checkpoint`` against ``io.load`` +
   ``process_weights`` + ``io.save``, both in this process, alternating for ``--rounds`` rounds;
   the best time of each counts.

Targets: 7B ``process`` peak RSS at most 3 GB and time at most 2x ``cp``; ``check --processed``
peak RSS at most 4 GB; GPT-2-small streaming at most 1.5x in-memory. Exit status 1 if one is
missed.

``--layers N`` measures a 7B-shaped checkpoint of N layers instead of 32 (cached beside the
whole one; per-layer figures extrapolate to 32 layers: time(32) ~ time(N) + (32 - N) x the
per-layer difference of two such runs). ``--check-model-only`` measures ``check IN`` alone;
with ``--layers N`` and the whole checkpoint cached, on a temporary copy of its first N layers
(written under the system's temporary folder and removed afterwards).

Usage: ``python benchmarks/streaming.py [--skip-7b] [--skip-gpt2] [--layers N] [--rounds N] [--batch N] [--seq-len N]
[--check-model-only] [--skip-check-model]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import circuitmath as cm
from circuitmath import io

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "streaming"
LLAMA_7B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}
GPT2_SMALL = cm.Config(
    n_layers=12, d_model=768, n_heads=12, d_head=64, d_vocab=50257, n_ctx=1024, d_mlp=3072, act_fn="gelu_new"
)
SHARD_BYTES = 2 << 30
TARGET_PROCESS_RSS, TARGET_PROCESS_VS_CP, TARGET_CHECK_RSS, TARGET_GPT2 = 3.0, 2.0, 4.0, 1.5
#: ``check IN`` holds a layer (in bfloat16 and its transforms' float32/float64 temporaries): the
#: same bound as ``check --processed``.
TARGET_CHECK_MODEL_RSS = 4.0


def _llama_tensors(config: dict):
    """``(name, shape, kind)`` of every tensor of a ``LlamaForCausalLM`` checkpoint."""
    d, m, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * d // config["num_attention_heads"]
    yield "model.embed_tokens.weight", (v, d), "matrix"
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (d,), "gain"
        for name, rows in (("q_proj", d), ("k_proj", kv), ("v_proj", kv), ("o_proj", d)):
            yield f"{p}.self_attn.{name}.weight", (rows, d), "matrix"
        yield f"{p}.post_attention_layernorm.weight", (d,), "gain"
        for name, shape in (("gate_proj", (m, d)), ("up_proj", (m, d)), ("down_proj", (d, m))):
            yield f"{p}.mlp.{name}.weight", shape, "matrix"
    yield "model.norm.weight", (d,), "gain"
    yield "lm_head.weight", (v, d), "matrix"


def _write_llama(folder: Path, config: dict) -> None:
    """A sharded bfloat16 checkpoint of random weights (unit-scale rows through each matrix)."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for name, shape, kind in _llama_tensors(config):
        if kind == "gain":
            tensor = (1 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        else:
            tensor = torch.randn(shape, generator=g, dtype=torch.bfloat16).mul_(shape[-1] ** -0.5)
        current[name] = tensor
        size += tensor.numel() * 2
        if size >= SHARD_BYTES:
            shards.append(current)
            save_file(current, str(partial / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
            current, size = {}, 0
    if current:
        shards.append(current)
        save_file(current, str(partial / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (partial / f"shard-{i}.safetensors").rename(partial / final)
        weight_map |= dict.fromkeys(shard, final)
    total = sum(t.numel() * 2 for shard in shards for t in shard.values())
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    partial.rename(folder)


def _settled(folder: Path) -> None:
    """The same start for every timed command: the dirty pages of earlier writes flushed (``sync``:
    a command must not wait on another's writes) and ``folder`` read once, so that it is in the
    page cache as far as it fits (the copy and the output written after it evict part of it)."""
    os.sync()
    for file in sorted(folder.iterdir()):
        with open(file, "rb") as handle:
            while handle.read(1 << 24):
                pass


def _measured(command: list[str]) -> tuple[float, float, str]:
    """``(seconds, peak RSS in GB, output)`` of a subprocess (its own ``ru_maxrss``, from wait4;
    Linux starts it from this process's resident size at fork, a few hundred MB)."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                             env=os.environ | {"PYTHONPATH": str(ROOT)})
    output = child.stdout.read().decode()
    _pid, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode not in (0,):
        raise SystemExit(f"{' '.join(command)} exited {child.returncode}:\n{output}")
    return seconds, usage.ru_maxrss / 1e6, output  # ru_maxrss is in KiB on Linux


def _check_model(folder: Path, args, layers: int) -> list[tuple[str, bool]]:
    """``check IN`` timed in a subprocess: seconds and peak RSS."""
    command = [sys.executable, "-m", "circuitmath", "check", str(folder), "--batch", str(args.batch),
               "--seq-len", str(args.seq_len)]
    try:
        seconds, rss, output = _measured(command)
    except SystemExit as failed:  # exit status 1: an identity violated (the rows say which)
        raise SystemExit(f"check IN failed: {failed}") from None
    print(f"check IN, {layers} layers ({args.batch} x {args.seq_len} tokens): {seconds:.1f} s, peak RSS {rss:.2f} GB", flush=True)
    print("  " + output.strip().replace("\n", "\n  "), flush=True)
    return [(f"7B check IN peak RSS {rss:.2f} GB <= {TARGET_CHECK_MODEL_RSS} GB", rss <= TARGET_CHECK_MODEL_RSS)]


def _layer_view(folder: Path, layers: int, where: Path) -> Path:
    """The first ``layers`` layers of ``folder`` (and its embedding and unembedding) copied to
    a checkpoint of their own under ``where``: one shard per layer, read from ``folder``'s."""
    from safetensors import safe_open

    view = where / f"{folder.name}-{layers}-layers"
    view.mkdir()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    groups: dict[str, dict[str, str]] = {}
    for name, shard in index["weight_map"].items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer < layers:
            groups.setdefault(f"part-{layer + 1:05d}.safetensors", {})[name] = shard
    weight_map = {}
    for file, names in groups.items():
        tensors = {}
        for name, shard in names.items():
            with safe_open(str(folder / shard), framework="pt") as handle:
                tensors[name] = handle.get_tensor(name)
        save_file(tensors, str(view / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    (view / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    (view / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    return view


def bench_7b_check_model(args) -> list[bool]:
    whole = CACHE / "llama-7b-bf16"
    if not whole.exists():
        print(f"no {whole}: run without --check-model-only first to write it")
        return [False]
    layers = LLAMA_7B["num_hidden_layers"] if args.layers is None else args.layers
    with tempfile.TemporaryDirectory() as tmp:
        folder = whole if args.layers is None else _layer_view(whole, layers, Path(tmp))
        results = _check_model(folder, args, layers)
    for text, met in results:
        print(("met:    " if met else "MISSED: ") + text)
    return [met for _, met in results]


def bench_7b(args) -> list[bool]:
    if args.check_model_only:
        return bench_7b_check_model(args)
    layers = LLAMA_7B["num_hidden_layers"] if args.layers is None else args.layers
    folder = CACHE / ("llama-7b-bf16" if layers == LLAMA_7B["num_hidden_layers"] else f"llama-7b-bf16-{layers}-layers")
    if not folder.exists():
        free = shutil.disk_usage(CACHE.parent if CACHE.parent.exists() else ROOT).free / 1e9
        print(f"writing the 7B-shaped checkpoint ({layers} layers) to {folder} ({free:.0f} GB free) ...", flush=True)
        start = time.perf_counter()
        # in a process of its own: a child's peak RSS (ru_maxrss) starts from its parent's at fork
        writer = multiprocessing.get_context("spawn").Process(target=_write_llama, args=(folder, LLAMA_7B | {"num_hidden_layers": layers}))
        writer.start()
        writer.join()
        if writer.exitcode:
            raise SystemExit(f"writing {folder} failed (exit status {writer.exitcode})")
        print(f"  written in {time.perf_counter() - start:.0f} s", flush=True)
    size = sum(p.stat().st_size for p in folder.iterdir()) / 1e9
    copy, out = folder.with_name("copy.tmp"), folder.with_name("processed.tmp")
    for leftover in (copy, out):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        python = [sys.executable, "-m", "circuitmath"]
        cps, processes = [], []
        for round_ in range(args.rounds):  # alternating, each from the same state (see _settled)
            _settled(folder)
            cps.append(_measured(["cp", "-r", str(folder), str(copy)]))
            shutil.rmtree(copy)
            shutil.rmtree(out, ignore_errors=True)
            _settled(folder)
            processes.append(_measured(python + ["process", str(folder), str(out), "--steps", "applicable"]))
            print(f"round {round_ + 1}: cp -r {cps[-1][0]:.1f} s, process {processes[-1][0]:.1f} s"
                  f" ({processes[-1][0] / cps[-1][0]:.2f}x)", flush=True)
        (cp_s, cp_rss, _), (p_s, _, p_out) = min(cps), min(processes)
        p_rss = max(rss for _, rss, _ in processes)  # the worst round's memory, the best round's time
        print(f"cp -r of the folder ({size:.1f} GB), best of {args.rounds}: {cp_s:.1f} s, peak RSS {cp_rss:.2f} GB", flush=True)
        print(f"process, best of {args.rounds}: {p_s:.1f} s ({p_s / cp_s:.2f}x cp), peak RSS {p_rss:.2f} GB"
              f"  [{p_out.strip()}]", flush=True)
        c_s, c_rss, c_out = _measured(python + ["check", str(folder), "--processed", str(out), "--batch", str(args.batch),
                                                "--seq-len", str(args.seq_len)])
        print(f"check --processed ({args.batch} x {args.seq_len} tokens): {c_s:.1f} s, peak RSS {c_rss:.2f} GB", flush=True)
        print("  " + c_out.strip().replace("\n", "\n  "), flush=True)
        checked_model = [] if args.skip_check_model else _check_model(folder, args, layers)
    finally:
        for leftover in (copy, out):
            shutil.rmtree(leftover, ignore_errors=True)
    results = [
        (f"7B process peak RSS {p_rss:.2f} GB <= {TARGET_PROCESS_RSS} GB", p_rss <= TARGET_PROCESS_RSS),
        (f"7B process {p_s / cp_s:.2f}x cp <= {TARGET_PROCESS_VS_CP}x", p_s / cp_s <= TARGET_PROCESS_VS_CP),
        (f"7B check --processed peak RSS {c_rss:.2f} GB <= {TARGET_CHECK_RSS} GB", c_rss <= TARGET_CHECK_RSS),
        *checked_model,
    ]
    for text, met in results:
        print(("met:    " if met else "MISSED: ") + text)
    return [met for _, met in results]


def bench_gpt2(args) -> list[bool]:
    with tempfile.TemporaryDirectory(dir=CACHE.parent if CACHE.parent.exists() else None) as tmp:
        tmp = Path(tmp)
        source = tmp / "gpt2.safetensors"
        io.save(source, cm.random_state_dict(GPT2_SMALL, seed=0), GPT2_SMALL)
        streaming, in_memory = [], []
        for round_ in range(args.rounds):
            out = tmp / f"streamed-{round_}"
            start = time.perf_counter()
            io.process_checkpoint(source, out)
            streaming.append(time.perf_counter() - start)
            shutil.rmtree(out)
            start = time.perf_counter()
            state_dict, cfg = io.load(source)
            processed, processed_cfg = cm.process_weights(state_dict, cfg)
            io.save(tmp / "in-memory.safetensors", processed, processed_cfg)
            in_memory.append(time.perf_counter() - start)
            del state_dict, processed
            (tmp / "in-memory.safetensors").unlink()
    ratio = min(streaming) / min(in_memory)
    print(f"GPT-2-small float32, best of {args.rounds}: streaming process {min(streaming):.2f} s, in-memory"
          f" load + process_weights + save {min(in_memory):.2f} s: {ratio:.2f}x")
    met = ratio <= TARGET_GPT2
    print(("met:    " if met else "MISSED: ") + f"GPT-2-small streaming {ratio:.2f}x in-memory <= {TARGET_GPT2}x")
    return [met]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument("--skip-gpt2", action="store_true")
    parser.add_argument("--layers", type=int, default=None, help="layers of the 7B-shaped checkpoint (default 32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--check-model-only", action="store_true", help="measure only check IN on the 7B-shaped checkpoint")
    parser.add_argument("--skip-check-model", action="store_true", help="leave out check IN (25 minutes on 7B here)")
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    met = []
    if not args.skip_gpt2:
        met += bench_gpt2(args)
    if not args.skip_7b:
        met += bench_7b(args)
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
