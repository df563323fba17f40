"""Train the zoo, deterministically, on the Python standard library's source.

    python -m circuitmath.zoo.train                      # train every model into circuitmath/zoo/
    python -m circuitmath.zoo.train --only attn_only_2l  # one model
    python -m circuitmath.zoo.train --out /tmp/zoo       # somewhere else
    python -m circuitmath.zoo.train --check              # retrain, compare with the shipped weights
    python -m circuitmath.zoo.train --study --only attn_only_2l   # the shortformer study (below)
    python -m circuitmath.zoo.train --study --controls --study-weights DIR  # its controls (CONTROLS)

The model is the reference forward pass itself (:func:`circuitmath.forward`) over a dict of
leaf tensors, so the weights are in the reference conventions by construction. Everything random
comes from ``torch.Generator``\\ s seeded by the recipe; training runs on one thread, so the
order of every floating-point reduction is fixed and a run on the same Python (the corpus), torch
version and CPU reproduces the shipped weights bit for bit. ``--check`` does that and refuses to
run when the corpus hash differs from the one recorded in the model card (another Python
version has different standard-library text).

``--study`` measures whether shortformer positions make induction heads easier to form: it
trains the two two-layer attention-only models with each of :data:`STUDY_SEEDS` (the shipped
seed among them), writes every run's training curve and final scores to ``study_<name>.json``
and, with ``--study-weights DIR``, each run's weights and card to ``DIR/seed<k>/`` (runs found
there are reused, so ``--seed K`` can split the study across processes). ``--controls`` runs the
controls of :data:`CONTROLS` for the positional scale at initialisation, each run cut at
:data:`CONTROL_STEPS`, into ``study_controls.json`` (``--control NAME --seed K`` trains one run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .._config import Config
from .._reference import forward
from .._state import expected_shapes
from ..io import save
from . import HERE, NAMES
from ._corpus import corpus_description, corpus_tokens
from .induction import induction_summary, positional_share

__all__ = ["Recipe", "RECIPES", "init_state_dict", "train", "baseline_losses", "heldout_loss", "STUDY_SEEDS", "STUDIED",
           "CONTROLS", "CONTROL_STEPS", "control_recipe", "main"]


@dataclass(frozen=True)
class Recipe:
    """How one zoo model is trained: AdamW (betas 0.9, 0.99, no weight decay), linear warm-up
    over ``warmup`` steps then cosine decay to zero, batches of ``batch`` random windows of
    ``n_ctx + 1`` bytes drawn from the training corpus.

    ``repeat_fraction`` of the windows (drawn at random) repeat their own first half: the text
    is real, but it is said twice, so that copying from earlier in the context pays off often
    enough for induction heads to form within a few thousand steps.
    """

    description: str
    cfg: Config
    seed: int
    steps: int
    batch: int
    lr: float
    warmup: int = 100
    eval_every: int = 100
    init_std: float = 0.02
    repeat_fraction: float = 0.5
    pos_init_std: float | None = None
    stop_at: int | None = None

    # ``pos_init_std``: the standard deviation of ``W_pos`` at initialisation (``None``: ``init_std``,
    # like every other matrix). ``stop_at``: end after this many steps while the learning-rate
    # schedule still runs over ``steps``, so the run is the first ``stop_at`` steps of the full one.
    # Both are for the study's controls; the zoo's recipes leave them unset.


def _cfg(n_layers: int, *, mlp: bool = False, positions: str = "standard") -> Config:
    return Config(
        n_layers=n_layers, d_model=64, n_heads=4, d_head=16, d_vocab=256, n_ctx=128,
        d_mlp=256 if mlp else None, act_fn="gelu", normalization_type="LN", positional_embedding_type=positions,
    )


RECIPES = {
    "attn_only_1l": Recipe("one attention-only layer", _cfg(1), seed=1, steps=3000, batch=16, lr=5e-3),
    "attn_only_2l": Recipe("two attention-only layers, learned positions in the residual stream", _cfg(2),
                           seed=2, steps=4000, batch=16, lr=5e-3),
    "attn_only_2l_shortformer": Recipe(
        "two attention-only layers, shortformer positions (added to the query and key inputs only)",
        _cfg(2, positions="shortformer"), seed=2, steps=4000, batch=16, lr=5e-3),
    "gelu_2l": Recipe("two layers with GELU MLPs (GPT-2 style pre-LN)", _cfg(2, mlp=True), seed=3, steps=3000,
                      batch=16, lr=5e-3),
}
assert tuple(RECIPES) == NAMES


def init_state_dict(cfg: Config, seed: int, std: float, *, pos_std: float | None = None) -> dict[str, torch.Tensor]:
    """Gains 1, biases 0, every matrix N(0, std^2) (``W_pos`` N(0, pos_std^2) when given), in
    float32 from ``seed``. ``pos_std`` rescales ``W_pos`` only: every other draw is unchanged."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[1]
        if leaf == "w":
            out[name] = torch.ones(shape)
        elif leaf.startswith("b"):
            out[name] = torch.zeros(shape)
        else:
            scale = pos_std if name == "pos_embed.W_pos" and pos_std is not None else std
            out[name] = torch.randn(shape, generator=g) * scale
    return out


def baseline_losses(train: torch.Tensor, evaluate: torch.Tensor) -> dict[str, float]:
    """Unigram and bigram cross-entropies in nats per byte.

    ``*_in_sample``: the entropy of the training text under its own byte (or byte-pair)
    frequencies, the lowest loss any unigram (bigram) model reaches on that text.
    ``*_heldout``: those frequencies, add-one smoothed, evaluated on ``evaluate``.
    """
    uni = torch.bincount(train, minlength=256).double()
    pairs = torch.bincount(train[:-1] * 256 + train[1:], minlength=256 * 256).double().reshape(256, 256)
    p_uni = uni / uni.sum()
    seen = p_uni > 0
    out = {"unigram_in_sample": float(-(p_uni[seen] * p_uni[seen].log()).sum())}
    rows = pairs.sum(1, keepdim=True)
    p_next = torch.where(rows > 0, pairs / rows.clamp(min=1), 0.0)
    nz = pairs > 0
    out["bigram_in_sample"] = float(-(pairs[nz] * p_next[nz].log()).sum() / pairs.sum())
    smooth_uni = (uni + 1) / (uni.sum() + 256)
    smooth_next = (pairs + 1) / (rows + 256)
    out["unigram_heldout"] = float(-smooth_uni[evaluate].log().mean())
    out["bigram_heldout"] = float(-smooth_next[evaluate[:-1], evaluate[1:]].log().mean())
    return out


def heldout_loss(state_dict, cfg: Config, tokens: torch.Tensor, *, batch: int = 16) -> float:
    """Mean next-byte loss (nats) over consecutive, non-overlapping windows of ``n_ctx + 1``
    bytes of ``tokens`` (every position of each window is predicted from its own window)."""
    span = cfg.n_ctx + 1
    windows = tokens[: (len(tokens) // span) * span].reshape(-1, span)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch):
            chunk = windows[start:start + batch]
            logits = forward(state_dict, cfg, chunk[:, :-1])
            total += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, cfg.d_vocab).double(), chunk[:, 1:].reshape(-1), reduction="sum"))
            count += chunk[:, 1:].numel()
    return total / count


def _learning_rate(recipe: Recipe, step: int) -> float:
    warm = min(1.0, (step + 1) / recipe.warmup)
    return recipe.lr * warm * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))


def _induction_point(state_dict, cfg: Config, step: int, recent_loss: float) -> dict:
    scores = induction_summary(state_dict, cfg, batch=8, length=50, seed=1)
    return {
        "step": step,
        "train_loss": recent_loss,
        "repeated_loss_first_half": scores["loss_first_half"],
        "repeated_loss_second_half": scores["loss_second_half"],
        "repeated_text_loss_first_half": scores["text_loss_first_half"],
        "repeated_text_loss_second_half": scores["text_loss_second_half"],
        "max_prefix_matching": max(scores["prefix_matching"][-1]),
        "max_previous_token": max(scores["previous_token"][0]),
        "positional_share": positional_share(state_dict, cfg),
    }


def train(name: str, *, recipe: Recipe | None = None, log=print) -> tuple[dict[str, torch.Tensor], Config, dict]:
    """Train zoo model ``name`` from its recipe (or ``recipe``); return ``(state_dict, cfg, card)``."""
    recipe = recipe or RECIPES[name]
    cfg = recipe.cfg
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data, heldout = corpus_tokens("train"), corpus_tokens("heldout")
        initial = init_state_dict(cfg, recipe.seed, recipe.init_std, pos_std=recipe.pos_init_std)
        params = {k: v.requires_grad_() for k, v in initial.items()}
        optimizer = torch.optim.AdamW(params.values(), lr=recipe.lr, betas=(0.9, 0.99), weight_decay=0.0)
        g = torch.Generator().manual_seed(recipe.seed + 1000)
        span = cfg.n_ctx + 1
        history, recent, started = [], [], time.perf_counter()
        steps = recipe.stop_at or recipe.steps
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(recipe, step)
            starts = torch.randint(0, len(data) - span, (recipe.batch,), generator=g)
            batch = torch.stack([data[s:s + span] for s in starts.tolist()])
            repeat = torch.rand(recipe.batch, generator=g) < recipe.repeat_fraction
            half = cfg.n_ctx // 2
            batch[repeat] = torch.cat([batch[repeat][:, :half], batch[repeat][:, :span - half]], dim=1)
            logits = forward(params, cfg, batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.d_vocab), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            recent = (recent + [float(loss.detach())])[-100:]
            if (step + 1) % recipe.eval_every == 0 or step == 0:
                with torch.no_grad():
                    point = _induction_point(params, cfg, step + 1, sum(recent) / len(recent))
                history.append(point)
                log(f"{name} step {step + 1}/{recipe.steps} loss {point['train_loss']:.3f} repeated"
                    f" {point['repeated_loss_first_half']:.2f}->{point['repeated_loss_second_half']:.2f}"
                    f" prefix-matching {point['max_prefix_matching']:.2f} ({time.perf_counter() - started:.0f} s)")
        seconds = time.perf_counter() - started
        state_dict = {k: v.detach().clone() for k, v in params.items()}
        card = {
            "name": name,
            "description": recipe.description,
            "config": cfg.to_dict(),
            "parameters": sum(v.numel() for v in state_dict.values()),
            "corpus": corpus_description(),
            "recipe": {k: v for k, v in asdict(recipe).items()
                       if k not in ("cfg", "description") and not (k in ("pos_init_std", "stop_at") and v is None)}
            | {"optimizer": "AdamW(betas=(0.9, 0.99), weight_decay=0)", "schedule": "linear warm-up, cosine decay to 0",
               "init": "gains 1, biases 0, matrices N(0, init_std^2)", "threads": 1},
            "tokens_seen": steps * recipe.batch * cfg.n_ctx,
            "steps": steps,
            "losses": {
                "final_train": sum(recent) / len(recent),
                "heldout": heldout_loss(state_dict, cfg, heldout),
                **baseline_losses(data, heldout),
            },
            "induction": induction_summary(state_dict, cfg),
            "history": history,
            "trained_with": {"torch": torch.__version__.split("+")[0], "seconds": round(seconds, 1)},
        }
        card["weights_sha256"] = weights_digest(state_dict)
        return state_dict, cfg, card
    finally:
        torch.set_num_threads(threads)


def weights_digest(state_dict) -> str:
    """SHA-256 over the names and float32 bytes of every tensor, in sorted order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        h.update(name.encode())
        h.update(state_dict[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def render_card(card: dict) -> str:
    """The model card as markdown."""
    losses, corpus, cfg = card["losses"], card["corpus"], card["config"]
    induction = card["induction"]
    lines = [
        f"# {card['name']}",
        "",
        f"{card['description'].capitalize()}: a byte-level language model of the Python standard library's source,"
        f" trained by `python -m circuitmath.zoo.train --only {card['name']}`.",
        "",
        "| | |",
        "|---|---|",
        f"| layers, d_model, heads x d_head | {cfg['n_layers']}, {cfg['d_model']}, {cfg['n_heads']} x {cfg['d_head']} |",
        f"| MLP | {'d_mlp ' + str(cfg['d_mlp']) + ', ' + cfg['act_fn'] if cfg['d_mlp'] else 'none (attention-only)'} |",
        f"| positions | {cfg['positional_embedding_type']}, n_ctx {cfg['n_ctx']} |",
        f"| norm | pre-{cfg['normalization_type']}, eps {cfg['eps']} |",
        f"| parameters | {card['parameters']:,} (float32) |",
        f"| steps | {card['steps']:,} |",
        f"| tokens seen | {card['tokens_seen']:,} |",
        f"| final training loss (mean of the last 100 batches, repeated windows included) | {losses['final_train']:.3f} nats/byte |",
        f"| held-out loss | {losses['heldout']:.3f} nats/byte |",
        f"| unigram baseline (in-sample, held-out) | {losses['unigram_in_sample']:.3f}, {losses['unigram_heldout']:.3f} |",
        f"| bigram baseline (in-sample, held-out) | {losses['bigram_in_sample']:.3f}, {losses['bigram_heldout']:.3f} |",
        f"| repeated random letters: loss on 1st / 2nd copy | {induction['loss_first_half']:.2f} / {induction['loss_second_half']:.2f} |",
        f"| best prefix-matching score (last layer) | {max(induction['prefix_matching'][-1]):.2f} |",
        f"| weights SHA-256 | `{card['weights_sha256'][:16]}...` |",
        "",
        "## Corpus",
        "",
        f"{corpus['source']}; {corpus['tokenisation']}. Python {corpus['python']} ({corpus['python_implementation']}).",
        "",
        f"- training split: {corpus['train']['bytes']:,} bytes, SHA-256 `{corpus['train']['sha256']}`,"
        f" modules: {', '.join(corpus['train']['modules'])}",
        f"- held-out split: {corpus['heldout']['bytes']:,} bytes, SHA-256 `{corpus['heldout']['sha256']}`,"
        f" modules: {', '.join(corpus['heldout']['modules'])}",
        "",
        "## Recipe",
        "",
        f"A fraction {card['recipe']['repeat_fraction']:g} of the training windows, drawn at random, repeat their own first"
        " half (real text, said twice), so that copying from earlier in the context pays off often enough for"
        " induction heads to form in a few thousand steps. The held-out loss is measured on plain text.",
        "",
        "```json",
        json.dumps(card["recipe"], indent=2),
        "```",
        "",
        f"Trained with torch {card['trained_with']['torch']} in {card['trained_with']['seconds']:.0f} s on one thread.",
        "",
    ]
    return "\n".join(lines)


def write(name: str, state_dict, cfg: Config, card: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save(folder / f"{name}.safetensors", state_dict, cfg, metadata={"weights_sha256": card["weights_sha256"]})
    (folder / f"{name}.json").write_text(json.dumps(card, indent=1) + "\n")
    (folder / f"{name}.md").write_text(render_card(card))


#: The seeds of the shortformer study (the shipped models' among them) and the models it trains.
STUDY_SEEDS = (2, 11)
STUDIED = ("attn_only_2l", "attn_only_2l_shortformer")

# The study's controls for its confound: at initialisation (W_pos ~ N(0, 0.02^2) in both models)
# the positional part of layer 0's query/key input is about 0.71 of its norm in the standard model
# (W_E and W_pos are renormalised together by ln1) but 0.02 in the shortformer model (W_pos is
# added after ln1, beside a unit-scale normalised token). Each control changes that scale alone
# (``pos_init_std``), runs the first 2,500 of the recipe's 4,000 steps (induction heads form by
# step 2,000 in every uncontrolled run) and is named after the model it changes.
CONTROLS = {
    # shortformer with W_pos ~ N(0, 1): positional share 0.71 at initialisation, as in the standard model
    "shortformer_matched": ("attn_only_2l_shortformer", 1.0),
    # standard with W_pos ~ N(0, 0.0004^2): positional share 0.02 at initialisation, as in shortformer
    "standard_matched": ("attn_only_2l", 0.02 * 0.02),
}
CONTROL_STEPS = 2500
CONTROL_SEEDS = STUDY_SEEDS


def control_recipe(control: str, seed: int) -> Recipe:
    """The recipe of one control run (see :data:`CONTROLS`)."""
    name, pos_std = CONTROLS[control]
    base = RECIPES[name]
    return replace(base, description=f"{base.description}; W_pos initialised N(0, {pos_std:g}^2)", seed=seed,
                   pos_init_std=pos_std, stop_at=CONTROL_STEPS)


def study(name: str, *, seeds=STUDY_SEEDS, weights: Path | None = None, control: str | None = None,
          stop_at: int | None = None, log=print) -> dict:
    """The shortformer study's runs for ``name``, one per seed: curves and final scores.

    With ``weights``, each run's weights and card go to ``weights / f"seed{k}"``, and a run whose
    card is already there is read back instead of retrained (runs can be split across processes).
    With ``control`` (a key of :data:`CONTROLS`), the runs are that control's, and ``name`` is
    the model it changes. ``stop_at`` ends uncontrolled runs early, as the controls end.
    """
    runs = []
    for seed in seeds:
        recipe = control_recipe(control, seed) if control else replace(RECIPES[name], seed=seed, stop_at=stop_at)
        label = control or name
        done = weights / f"seed{seed}" / f"{label}.json" if weights is not None else None
        if done is not None and done.exists():
            card = json.loads(done.read_text())
        else:
            state_dict, cfg, card = train(label, recipe=recipe, log=log)
            if weights is not None:
                write(label, state_dict, cfg, card, weights / f"seed{seed}")
        runs.append({
            "seed": seed, "heldout_loss": card["losses"]["heldout"], "weights_sha256": card["weights_sha256"],
            "history": card["history"], "induction": card["induction"],
        })
    out = {"model": name, "corpus": corpus_description(), "recipe": card["recipe"] | {"seed": "varies"}, "runs": runs}
    return out | ({"control": control, "description": recipe.description} if control else {})


def _truncated(run: dict, steps: int) -> dict:
    """A full run of the study as its first ``steps`` steps: the history up to them (the run is
    deterministic, so a run stopped there is this prefix); final scores are the full run's, dropped."""
    return {"seed": run["seed"], "history": [p for p in run["history"] if p["step"] <= steps],
            "weights_sha256": None, "truncated_from": run["history"][-1]["step"]}


def controls_study(weights: Path, *, log=print) -> dict:
    """The study's controls: the two models and the two controls of :data:`CONTROLS`, each with
    every seed of :data:`CONTROL_SEEDS`, for :data:`CONTROL_STEPS` steps.

    Uncontrolled runs with a seed of the main study are read from ``study_<model>.json`` (their
    first ``CONTROL_STEPS`` steps); every other run is trained, or read back from ``weights``.
    """
    out = {"steps": CONTROL_STEPS, "seeds": list(CONTROL_SEEDS), "variants": {}}
    for variant in (*STUDIED, *CONTROLS):
        control = variant if variant in CONTROLS else None
        name = CONTROLS[variant][0] if control else variant
        recorded = json.loads((HERE / f"study_{name}.json").read_text()) if not control else {"runs": []}
        runs = []
        for seed in CONTROL_SEEDS:
            full = next((r for r in recorded["runs"] if r["seed"] == seed), None)
            if full is not None:
                runs.append(_truncated(full, CONTROL_STEPS))
                continue
            run = study(name, seeds=(seed,), weights=weights, control=control, stop_at=CONTROL_STEPS, log=log)["runs"][0]
            runs.append({k: run[k] for k in ("seed", "history", "weights_sha256")})
        recipe = control_recipe(control, 0) if control else RECIPES[name]
        out["variants"][variant] = {
            "model": name, "pos_init_std": recipe.pos_init_std or recipe.init_std,
            "positional_share_at_init": [positional_share(init_state_dict(recipe.cfg, seed, recipe.init_std,
                                                                          pos_std=recipe.pos_init_std), recipe.cfg)
                                         for seed in CONTROL_SEEDS],
            "runs": runs,
        }
    return out


def main(argv=None) -> int:
    """``python -m circuitmath.zoo.train`` (the usage above): train, check or study; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m circuitmath.zoo.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=NAMES, help="train only this model (repeatable)")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the weights and cards (default: the package)")
    parser.add_argument("--check", action="store_true",
                        help="retrain and compare with the shipped weights instead of writing anything")
    parser.add_argument("--study", action="store_true", help=f"run the shortformer study for {', '.join(STUDIED)}")
    parser.add_argument("--study-weights", type=Path,
                        help="with --study: keep each run's weights and card here, and reuse runs already there")
    parser.add_argument("--seed", type=int, action="append", help="with --study: run only this seed (repeatable)")
    parser.add_argument("--controls", action="store_true",
                        help="with --study and --study-weights: write study_controls.json (see controls_study)")
    parser.add_argument("--stop-at", type=int, help="with --study: end each run after this many steps (schedule unchanged)")
    parser.add_argument("--control", choices=sorted(CONTROLS),
                        help="with --study: run this control of the positional scale instead (see CONTROLS)")
    args = parser.parse_args(argv)
    names = args.only or list(NAMES)
    if args.study and args.controls:
        if args.study_weights is None:
            parser.error("--controls needs --study-weights")
        result = controls_study(args.study_weights, log=lambda line: print(line, flush=True))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "study_controls.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.study and args.control:
        name = CONTROLS[args.control][0]
        result = study(name, seeds=args.seed or STUDY_SEEDS, weights=args.study_weights, control=args.control,
                       log=lambda line: print(line, flush=True))
        if not args.seed:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"study_control_{args.control}.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.study:
        for name in names:
            if name not in STUDIED:
                parser.error(f"the study covers {STUDIED}, not {name}")
            result = study(name, seeds=args.seed or STUDY_SEEDS, weights=args.study_weights, stop_at=args.stop_at,
                           log=lambda line: print(line, flush=True))
            if args.seed:  # a part of the study: its runs are kept in --study-weights only
                continue
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"study_{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0
    corpus = corpus_description()
    failed = []
    for name in names:
        if args.check:
            shipped = json.loads((HERE / f"{name}.json").read_text())
            for split in ("train", "heldout"):
                if shipped["corpus"][split]["sha256"] != corpus[split]["sha256"]:
                    print(f"{name}: this machine's {split} corpus (Python {corpus['python']}) differs from the one the"
                          f" shipped model was trained on (Python {shipped['corpus']['python']}); cannot reproduce",
                          file=sys.stderr)
                    return 2
        state_dict, cfg, card = train(name, log=lambda line: print(line, flush=True))
        if args.check:
            same = card["weights_sha256"] == shipped["weights_sha256"]
            print(f"{name}: {'reproduced bit for bit' if same else 'DIFFERS from the shipped weights'}")
            if not same:
                failed.append(name)
        else:
            write(name, state_dict, cfg, card, args.out)
            print(f"{name}: written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
