"""``python -m circuitmath prove [NAME ...] [--json]``,
``python -m circuitmath check MODEL.safetensors [--config CFG.json] [--processed OTHER.safetensors] [--device DEV]
[--json]`` and
``python -m circuitmath process IN OUT [--steps ...] [--dtype ...] [--device ...]``."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from . import io
from ._checkpoint import INDEX
from ._config import Config
from ._errors import CircuitMathError, InputError
from ._identities import get_identity, identities
from ._processing.pipeline import process_weights
from ._processing.steps import PIPELINE_STEPS
from ._state import usable_device
from ._threads import check_threads

COLUMNS = ("identity", "symbolic dims", "steps", "seconds", "twins rejected", "status")


def _cells(r: dict, depth: int = 0) -> list[tuple[str, ...]]:
    """A report's row, then a row for each of its lemmas, indented under it (their time is the
    identity's)."""
    row = (
        "  " * depth + ("lemma " if depth else "") + r["name"],
        "yes" if r["symbolic_dims"] else "no",
        str(r["steps"]),
        f"{r['seconds']:.3f}" if "seconds" in r else "",
        f"{r['twins_rejected']}/{r['twins_total']}",
        r["status"],
    )
    return [row] + [cell for lemma in r.get("lemmas", ()) for cell in _cells(lemma, depth + 1)]


def _table(rows: list[dict]) -> str:
    cells = [COLUMNS] + [cell for r in rows for cell in _cells(r)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _prove(args) -> int:
    try:
        chosen = [get_identity(n) for n in args.names] if args.names else list(identities())
    except KeyError as error:
        raise InputError(error.args[0]) from None
    rows = []
    for identity in chosen:
        report = identity.prove()
        rows.append(report.as_dict())
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows))
        failed = [r for r in rows if r["status"] != "proved"]
        for r in failed:
            print(f"\n{r['name']}: failed steps {r['failed_steps']}, accepted twins {r['accepted_twins']}")
        total = sum(r["seconds"] for r in rows)
        print(f"\n{len(rows) - len(failed)}/{len(rows)} proved in {total:.2f} s")
    return 0 if all(r["status"] == "proved" for r in rows) else 1


CHECK_HELP = """With only MODEL, apply every weight identity that applies to it and compare log-probs, one row
per identity (an identity that refuses the model shows the precondition it breaks); below
float64 each identity is also checked in float64 on the same weights, and the tensors it wrote
are certified against the float64 rewrite, entry by entry (for a checkpoint folder only with
--exact: each part is then held in float64 too). With
--processed, check that OTHER is a valid processing of MODEL: the identities it applied are
replayed on MODEL (as OTHER's recorded cfg.applied says, or inferred), each row shows the
rewrite that reproduced OTHER ("exact" or a named wrong rewrite) and, when anything is wrong,
the change in log-probs it causes; "residual" lists tensors no identity explains, and
"before -> after" compares the two models. A file written by circuitmath.io.save carries its
config; otherwise pass --config: a circuitmath Config as JSON, or a Hugging Face config.json
(the weights are then converted). --device runs the forward passes, the certificates and the
diagnosis on another device (default cpu; e.g. cuda): the files are read onto the CPU and
moved there. Exit status: 0 all holds, 1 an identity is violated, 2 bad
input (nothing is computed or written). --json prints a list with one object per row (name,
kind, applicable, reason, rewrite, max_abs_error, tolerance, status, explanation, parameters)."""


#: Seconds a check runs before its progress line appears (short runs print none).
PROGRESS_DELAY = 0.5


class _ProgressLine:
    """A one-line progress bar on a terminal, redrawn in place; shown once a run lasts ``PROGRESS_DELAY`` s."""

    def __init__(self, stream, *, width: int = 24, label: str = "check"):
        self.stream, self.delay, self.width, self.label = stream, PROGRESS_DELAY, width, label
        self.start = time.monotonic()
        self.shown = 0

    def __call__(self, done: int, total: int, what: str) -> None:
        if time.monotonic() - self.start < self.delay:
            return
        filled = self.width * done // max(total, 1)
        line = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {what}"
        line = line[: shutil.get_terminal_size().columns - 1]
        self.stream.write("\r" + line.ljust(self.shown))
        self.stream.flush()
        self.shown = len(line)

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()


#: The most activation entries (batch x positions x the widest layer) a check may ask for: 2**28
#: float64 entries are 2 GiB, several times what a check of GPT-2-small on 4 x 128 tokens needs.
MAX_ACTIVATIONS = 1 << 28


def _check(args) -> int:
    from . import _diagnosis

    if not (1 <= args.batch and 1 <= args.seq_len):
        raise InputError("--batch and --seq-len must be at least 1")
    if args.exact and args.processed:
        raise InputError("--exact is for check MODEL alone (a checkpoint folder); --processed certifies OTHER's"
                         " tensors already")
    device = usable_device(args.device, "--device")

    def tokens(cfg: Config) -> torch.Tensor:
        positions = min(cfg.n_ctx, args.seq_len)
        widest = max(cfg.d_vocab, cfg.d_model, cfg.d_mlp or 0, cfg.n_heads * positions)
        if args.batch * positions * widest > MAX_ACTIVATIONS:
            raise InputError(
                f"--batch {args.batch} x --seq-len {positions} tokens need {args.batch * positions * widest:,}"
                f" activation entries in this model's widest layer ({widest}); the limit is {MAX_ACTIVATIONS:,}:"
                " use fewer or shorter sequences"
            )
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, cfg.d_vocab, (args.batch, positions), generator=g)

    progress = _ProgressLine(sys.stderr) if sys.stderr.isatty() and not args.json else None
    try:
        cfg = io.read_config(args.config) if args.config else None
        report = _checked(args, cfg, tokens, progress, device)
    finally:
        if progress is not None:
            progress.close()
    print(json.dumps(report.as_dicts(), indent=2) if args.json else str(report).lstrip("\n"))
    return 0 if report.ok else 1


def _checked(args, cfg, tokens, progress, device):
    """The report of ``check`` (see :func:`_check`), in the names of the input whose tensors it names."""
    from . import _diagnosis

    if args.processed and (Path(args.processed).is_dir() or (Path(args.model) / INDEX).exists()):
        from ._streaming_check_processed import check_processed  # checkpoint folders: read a block at a time

        _diagnosis._misuse.refuse_misused_checkpoints(args.model, args.processed, cfg)
        report = check_processed(
            args.model, args.processed, cfg, tokens=tokens, progress=progress, device=device)
        if Path(args.processed).is_dir():
            report = _diagnosis._names.speak(report, _diagnosis._names.checkpoint_names(args.processed))
    elif args.processed:
        report = _diagnosis.diagnose(
            args.model, args.processed, cfg, tokens=tokens, progress=progress, device=device)
    elif Path(args.model).is_dir():
        from ._streaming_check_model import check_model_streaming  # a checkpoint folder: read a block at a time

        report = check_model_streaming(args.model, cfg, tokens=tokens, progress=progress, device=device,
                                       exact=args.exact)
        report = _diagnosis._names.speak(report, _diagnosis._names.checkpoint_names(args.model, cfg))
    else:
        report = _diagnosis.check_model(args.model, cfg, tokens=tokens, progress=progress, device=device)
    return report


def _interrupt(_signal, _frame) -> None:
    raise KeyboardInterrupt


PROCESS_HELP = f"""Process the checkpoint IN (a Hugging Face folder with config.json and model.safetensors or
model.safetensors.index.json and its shards, a folder written by process, or a .safetensors file
written by circuitmath.io.save) one layer at a time, as {process_weights.__name__} processes a model in
memory, and write the result to the new folder OUT: one safetensors shard per layer with the
processed config in its metadata, and model.safetensors.index.json. A Hugging Face folder comes
out in its own architecture's names and layout, with its config.json, where the processed model
fits them (LLaMA: each norm's gain folded into the maps that read it and stored as 1; GPT-2 and
GPT-NeoX, which have no unembedding bias: the norms folded without centering their readers, the
final LayerNorm's bias kept), else in circuitmath's names (tied embeddings the processing makes
differ). Memory holds two layers (one written while the next is processed).
OUT is written under a temporary name and renamed at the end: a refusal, an error or an
interruption leaves nothing. Exit status: 0 written, 2 bad input or a step refused (nothing
written)."""

DTYPE_NAMES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _process(args) -> int:
    steps = None if args.steps == "default" else "applicable" if args.steps == "applicable" else [
        s.strip() for s in args.steps.split(",") if s.strip()]
    progress = _ProgressLine(sys.stderr, label="process") if sys.stderr.isatty() else None
    # A termination request unwinds like Ctrl-C, so the temporary output is removed.
    signal.signal(signal.SIGTERM, _interrupt)
    device = usable_device(args.device, "--device")
    try:
        cfg = io.process_checkpoint(
            args.input, args.output, steps=steps, dtype=DTYPE_NAMES.get(args.dtype), device=device, progress=progress)
    except KeyboardInterrupt:
        print(f"interrupted: {args.output} not written", file=sys.stderr)
        return 130
    finally:
        if progress is not None:
            progress.close()
    names = "its own architecture's" if (Path(args.output) / "config.json").exists() else "circuitmath's"
    print(f"{args.output}: {cfg.n_layers + 1} shards in {names} names, applied {', '.join(cfg.applied) or 'nothing'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m circuitmath",
        description="Prove the identities behind transformer weight processing, and check models against them.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prove = commands.add_parser("prove", help="check every proof and reject every negative twin")
    prove.add_argument("names", nargs="*", help="identities to prove (default: all)")
    prove.add_argument("--json", action="store_true", help="print a JSON list, one object per identity")
    prove.set_defaults(run=_prove)
    check = commands.add_parser(
        "check", help="check the identities on a model, or that a processed model is a valid processing of it",
        description=CHECK_HELP,
    )
    check.add_argument("model", metavar="MODEL", help="the model: a .safetensors file (or a Hugging Face folder)")
    check.add_argument("--config", metavar="CFG.json", help="MODEL's config: circuitmath Config JSON or Hugging Face config.json")
    check.add_argument("--processed", metavar="OTHER", help="a processed version of MODEL to check (.safetensors, or a"
                       " checkpoint folder: then both are read a block at a time)")
    check.add_argument("--json", action="store_true", help="print a JSON list, one object per row")
    check.add_argument("--batch", type=int, default=4, help="sequences of random tokens (default 4)")
    check.add_argument("--seq-len", type=int, default=128, help="positions per sequence, at most n_ctx (default 128)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    check.add_argument("--exact", action="store_true",
                       help="MODEL a folder, without --processed: also check each identity in float64 and certify its"
                            " rewrite, as a file always is (each part is then held in float64 too)")
    check.add_argument("--device", default=None,
                       help="where the check computes: cpu (default), cuda, cuda:1, ... (the files are read onto the CPU)")
    check.set_defaults(run=_check)
    process = commands.add_parser("process", help="process a checkpoint layer by layer into a new sharded checkpoint",
                                  description=PROCESS_HELP)
    process.add_argument("input", metavar="IN", help="the checkpoint: a folder or a .safetensors file")
    process.add_argument("output", metavar="OUT", help="the folder to write (must not exist)")
    process.add_argument("--steps", default="default", help=f"'default' ({process_weights.__name__}' defaults),"
                         " 'applicable' (every step that applies) or a comma-separated list of " + ", ".join(k for k, _ in PIPELINE_STEPS))
    process.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="cast the weights before processing (default: keep)")
    process.add_argument("--device", default=None, help="where each layer is processed (default cpu)")
    process.set_defaults(run=_process)
    args = parser.parse_args(argv)
    try:
        with check_threads():  # as many torch threads as cores are idle: a busy machine does not stall it
            return args.run(args)
    except CircuitMathError as error:  # bad input: said in one line, nothing written
        print(f"error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``check --json | head``): stop quietly
        sys.stderr.close()
        return 0
