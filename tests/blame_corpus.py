"""A corpus of planted bugs: weight processings with one mistake each, and the tensors it touches.

Each :class:`PlantedBug` is a model recipe (a :class:`~circuitmath.Config` and a seed for
:func:`~circuitmath.random_state_dict`), the processing its user meant (``correct``) and the
user's processing with the bug (``buggy``). What the bug touches is computed, not typed: the
tensors where the buggy output differs from the correct one (or that only one of them has).
A user's library does not record circuitmath's identity names, so the processed config keeps
``before``'s ``applied``: the diagnosis infers the replay from the tensors.

The bugs span the identities (LayerNorm and RMSNorm folds, centring readers, writers and the
unembed, value biases, key biases, shortformer tables, refactoring) and the architectures
(LayerNorm, RMSNorm, gated MLP, grouped-query attention, rotary, parallel blocks, shortformer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import circuitmath as cm
from circuitmath import Config

StateDict = dict[str, torch.Tensor]
Processing = Callable[[StateDict, Config], tuple[StateDict, Config]]

#: Tensors whose buggy and correct versions differ by more than this, relative to their largest
#: entry, are touched by the bug: processings that agree differ by rounding (float64 ~1e-16,
#: float32 ~1e-7 over another summation order), every planted bug by 1e-2 or more.
TOUCHED = {torch.float64: 1e-9, torch.float32: 1e-4}


@dataclass(frozen=True)
class PlantedBug:
    name: str
    cfg: Config
    seed: int
    correct: Processing
    buggy: Processing
    dtype: torch.dtype = torch.float64

    def before(self) -> StateDict:
        return cm.random_state_dict(self.cfg, seed=self.seed, dtype=self.dtype)

    def outputs(self) -> tuple[StateDict, StateDict, Config]:
        """``(before, after, after_cfg)``: the model and the user's buggy processing of it."""
        before = self.before()
        after, after_cfg = self.buggy(before, self.cfg)
        return before, after, after_cfg.replace(applied=self.cfg.applied)

    def touched(self) -> set[str]:
        """The tensors where the buggy processing differs from the correct one."""
        before = self.before()
        right, wrong = self.correct(before, self.cfg)[0], self.buggy(before, self.cfg)[0]
        return {n for n in set(right) | set(wrong) if differ(right.get(n), wrong.get(n))}


def differ(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``a`` and ``b`` (``None``: absent) differ beyond the rounding of their dtype."""
    if a is None or b is None or a.shape != b.shape:
        return a is not b
    if not a.numel():
        return False
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return float((a.double() - b.double()).abs().max()) > TOUCHED[a.dtype] * scale


# -- building blocks of the users' processings -------------------------------------------------


def pipeline(*steps: Processing) -> Processing:
    def run(sd, cfg):
        for step in steps:
            sd, cfg = step(sd, cfg)
        return dict(sd), cfg
    return run


def then(step: Processing, edit: Callable[[StateDict, StateDict, Config], None]) -> Processing:
    """``step``, then ``edit(out, before, cfg)`` on a copy of its output (the planted mistake)."""
    def run(sd, cfg):
        out, out_cfg = step(sd, cfg)
        out = dict(out)
        edit(out, sd, cfg)
        return out, out_cfg
    return run


def on_input(edit: Callable[[StateDict, Config], None], step: Processing) -> Processing:
    """``step`` on a copy of its input edited by ``edit(sd, cfg)`` (a mistake made on the way in)."""
    def run(sd, cfg):
        sd = dict(sd)
        edit(sd, cfg)
        return step(sd, cfg)
    return run


fold_ln = cm.fold_layer_norm
fold_and_centre = functools.partial(cm.fold_layer_norm, center_reading_weights=True)


def _norms(sd, cfg):
    return [n[: -len(".w")] for n in sd if n.endswith(".w") and n.startswith(("blocks.", "ln_final"))]


def bias_through_gain(sd, cfg):
    for norm in _norms(sd, cfg):
        sd[f"{norm}.b"] = sd[f"{norm}.b"] * sd[f"{norm}.w"]


def readers_centred_over_d_head(sd, cfg):
    """The fold, then readers centred: attention's over d_head (the last axis), others rightly."""
    out, out_cfg = fold_ln(sd, cfg)
    out = dict(out)
    for layer in range(cfg.n_layers):
        for x in "QKV":
            W = out[f"blocks.{layer}.attn.W_{x}"]
            out[f"blocks.{layer}.attn.W_{x}"] = W - W.mean(-1, keepdim=True)
        if not cfg.attn_only:
            W = out[f"blocks.{layer}.mlp.W_in"]
            out[f"blocks.{layer}.mlp.W_in"] = W - W.mean(0, keepdim=True)
    out["unembed.W_U"] = out["unembed.W_U"] - out["unembed.W_U"].mean(0, keepdim=True)
    return out, out_cfg


def value_biases_without_W_O(sd, cfg):
    """Each head's value bias added to b_O as it is (heads concatenated), not through W_O."""
    out = dict(sd)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        out[f"{p}.b_O"] = sd[f"{p}.b_O"] + sd[f"{p}.b_V"].reshape(-1)
        out[f"{p}.b_V"] = torch.zeros_like(sd[f"{p}.b_V"])
    return out, cfg


def value_biases_first_head_of_each_group(sd, cfg):
    """Grouped-query: each key-value head's bias sent through the first query head of its group only."""
    out, out_cfg = cm.fold_value_biases(sd, cfg)
    out = dict(out)
    size = cfg.n_heads // cfg.n_key_value_heads
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        b_O = sd[f"{p}.b_O"].clone()
        for j in range(cfg.n_key_value_heads):
            b_O += sd[f"{p}._b_V"][j] @ sd[f"{p}.W_O"][j * size] * size
        out[f"{p}.b_O"] = b_O
    return out, out_cfg


def value_biases_one_head(sd, cfg):
    out, out_cfg = cm.fold_value_biases(sd, cfg)
    out = dict(out)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        out[f"{p}.b_O"] = sd[f"{p}.b_O"] + sd[f"{p}.b_V"][0] @ sd[f"{p}.W_O"][0]
    return out, out_cfg


def restore(*names):
    """Leave these tensors as they were before the step (a forgotten rewrite)."""
    def edit(out, before, cfg):
        for name in names:
            out[name.format(last=cfg.n_layers - 1)] = before[name.format(last=cfg.n_layers - 1)]
    return edit


def restore_layer(layer, suffixes):
    return restore(*(f"blocks.{layer}.{s}" for s in suffixes))


def scale(name, factor, head=None):
    def edit(out, before, cfg):
        t = out[name].clone()
        if head is None:
            t = t * factor
        else:
            t[head] = t[head] * factor
        out[name] = t
    return edit


def transpose_head(name, head):
    def edit(out, before, cfg):
        t = out[name].clone()
        t[head] = t[head].T.clone()
        out[name] = t
    return edit


def centre(name, dim):
    def edit(out, before, cfg):
        out[name] = out[name] - out[name].mean(dim, keepdim=True)
    return edit


def zero(*names):
    def edit(sd, *rest):
        for name in names:
            sd[name] = torch.zeros_like(sd[name])
    return edit


def swap_norms(first, second):
    def edit(sd, cfg):
        for layer in range(cfg.n_layers):
            for x in "wb":
                sd[f"blocks.{layer}.{second}.{x}"] = sd[f"blocks.{layer}.{first}.{x}"]
    return edit


def w_O_centred_over_d_head(out, before, cfg):
    folded = fold_ln(before, cfg)[0]
    for name in [n for n in out if n.endswith(".W_O")]:
        out[name] = folded[name] - folded[name].mean(-2, keepdim=True)


def value_biases_hidden_under_centring(sd, cfg):
    """The fold, value biases folded without W_O, then the writers centred (b_O centred again)."""
    out, out_cfg = value_biases_without_W_O(*fold_ln(sd, cfg))
    return cm.center_writing_weights(out, out_cfg)


def swap_rows(name, i, j):
    def edit(out, before, cfg):
        t = out[name].clone()
        t[[i, j]] = t[[j, i]]
        out[name] = t
    return edit


def add_one_hot(name, index):
    def edit(out, before, cfg):
        t = out[name].clone()
        t[index] += 1.0
        out[name] = t
    return edit


def keep_original(sd, cfg):
    return dict(sd), cfg


# -- a user's own library, written from scratch for TransformerLens-format LayerNorm models -----


def user_fold(sd, cfg, *, bias_through_gain=False, attn_centre_axis=1, fold_final=True, last_axis=False):
    """Fold every LayerNorm into its readers and centre them (over d_model, axis 1 of W_Q/K/V),
    computed the user's way (another summation order than circuitmath's). The knobs plant bugs."""
    sd = dict(sd)

    def fold(norm, pairs, axis, centre_axis):
        w, b = sd.pop(f"{norm}.w"), sd.pop(f"{norm}.b")
        if not fold_final and norm == "ln_final":
            return
        for weight, bias in pairs:
            W = sd[weight]
            shape = [1] * W.dim()
            shape[axis] = -1
            shift = b * w if bias_through_gain else b
            sd[bias] = sd[bias] + (W * shift.reshape(shape)).sum(axis)
            W = W * w.reshape(shape)
            sd[weight] = W - W.mean(-1 if last_axis else centre_axis, keepdim=True)

    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        fold(f"{p}.ln1", [(f"{p}.attn.W_{x}", f"{p}.attn.b_{x}") for x in "QKV"], 1, attn_centre_axis)
        if not cfg.attn_only:
            fold(f"{p}.ln2", [(f"{p}.mlp.W_in", f"{p}.mlp.b_in")], 0, 0)
    fold("ln_final", [("unembed.W_U", "unembed.b_U")], 0, 0)
    return sd, cfg.replace(normalization_type="LNPre")


def user_fold_value_biases(sd, cfg, *, through_W_O=True, repeat_groups=True):
    """Value biases into b_O (grouped-query: each key-value head's bias through its group's heads)."""
    sd = dict(sd)
    name = "b_V" if cfg.n_key_value_heads is None else "_b_V"
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        b_V, W_O = sd[f"{p}.{name}"], sd[f"{p}.W_O"]
        per_head = b_V.repeat_interleave(cfg.n_heads // b_V.shape[0], 0) if repeat_groups else b_V
        through = (per_head[:, :, None] * W_O[: per_head.shape[0]]).sum((0, 1))
        folded = through if through_W_O else b_V.reshape(-1)
        sd[f"{p}.b_O"] = sd[f"{p}.b_O"] + folded
        sd[f"{p}.{name}"] = torch.zeros_like(b_V)
    return sd, cfg


# -- the models -----------------------------------------------------------------------------------

GPT2 = Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=12)
ATTN_ONLY = GPT2.replace(d_mlp=None)
SQUARE_HEADS = GPT2.replace(n_heads=2, d_head=8)
LLAMA = GPT2.replace(normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
                     act_fn="silu")
GQA = GPT2.replace(n_heads=4, d_head=2, n_key_value_heads=2)
ROTARY = GPT2.replace(positional_embedding_type="rotary")
PARALLEL = GPT2.replace(parallel_attn_mlp=True, positional_embedding_type="rotary")
SHORTFORMER = GPT2.replace(positional_embedding_type="shortformer")
POST_NORM = GPT2.replace(norm_position="post")
NO_NORM = GPT2.replace(normalization_type=None)

_ATTN_READERS = ("attn.W_Q", "attn.W_K", "attn.W_V", "attn.b_Q", "attn.b_K", "attn.b_V")
_MLP_READERS = ("mlp.W_in", "mlp.b_in")


def corpus() -> list[PlantedBug]:
    bugs = [
        # LayerNorm fold
        PlantedBug("bias pushed through the gain", GPT2, 0, fold_ln, on_input(bias_through_gain, fold_ln)),
        PlantedBug("forgotten ln_final", GPT2, 1,
                   fold_ln, then(fold_ln, restore("unembed.W_U", "unembed.b_U"))),
        PlantedBug("one layer not folded", GPT2, 2, fold_ln,
                   then(fold_ln, restore_layer(1, _ATTN_READERS + _MLP_READERS))),
        PlantedBug("b_Q not folded (rotary)", ROTARY, 3, fold_ln,
                   then(fold_ln, restore("blocks.0.attn.b_Q", "blocks.1.attn.b_Q"))),
        PlantedBug("grouped-query _W_K, _b_K not folded", GQA, 4, fold_ln,
                   then(fold_ln, restore("blocks.0.attn._W_K", "blocks.0.attn._b_K"))),
        PlantedBug("ln1 folded into the MLP (parallel)", PARALLEL, 5,
                   fold_ln, on_input(swap_norms("ln1", "ln2"), fold_ln)),
        PlantedBug("W_in * 1.05 after the fold", GPT2, 6,
                   fold_ln, then(fold_ln, scale("blocks.0.mlp.W_in", 1.05))),
        PlantedBug("a transposed head after the fold", SQUARE_HEADS, 7, fold_ln,
                   then(fold_ln, transpose_head("blocks.1.attn.W_Q", 0))),
        # centring the readers
        PlantedBug("readers centred over d_head", GPT2, 8, fold_and_centre, readers_centred_over_d_head),
        PlantedBug("W_in centred over d_mlp", GPT2, 9, fold_and_centre,
                   then(fold_and_centre, lambda out, before, cfg: out.update(
                       {"blocks.0.mlp.W_in": fold_ln(before, cfg)[0]["blocks.0.mlp.W_in"]
                        - fold_ln(before, cfg)[0]["blocks.0.mlp.W_in"].mean(1, keepdim=True)}))),
        # centring the writers
        PlantedBug("W_pos centred over positions", GPT2, 10, pipeline(fold_ln, cm.center_writing_weights),
                   then(pipeline(fold_ln, cm.center_writing_weights), centre("pos_embed.W_pos", 0))),
        PlantedBug("sign flip of one head's W_O", GPT2, 11, pipeline(fold_ln, cm.center_writing_weights),
                   then(pipeline(fold_ln, cm.center_writing_weights), scale("blocks.0.attn.W_O", -1.0, head=1))),
        PlantedBug("W_O centred over d_head", ATTN_ONLY, 12, pipeline(fold_ln, cm.center_writing_weights),
                   then(pipeline(fold_ln, cm.center_writing_weights), w_O_centred_over_d_head)),
        # centring the unembed
        PlantedBug("b_U * 1.1 after centring", GPT2, 13,
                   cm.center_unembed, then(cm.center_unembed, scale("unembed.b_U", 1.1))),
        PlantedBug("unembed centred over d_model", NO_NORM, 14, cm.center_unembed,
                   then(cm.center_unembed, lambda out, before, cfg: out.update(
                       {"unembed.W_U": before["unembed.W_U"] - before["unembed.W_U"].mean(0, keepdim=True)}))),
        # value biases
        PlantedBug("value biases folded without W_O", GPT2, 15,
                   cm.fold_value_biases, value_biases_without_W_O),
        PlantedBug("value biases of head 0 only", GPT2, 16, cm.fold_value_biases, value_biases_one_head),
        PlantedBug("grouped-query value biases through one head per group", GQA, 17, cm.fold_value_biases,
                   value_biases_first_head_of_each_group),
        # RMSNorm fold
        PlantedBug("RMS fold forgets W_gate", LLAMA, 18, cm.fold_rms_norm,
                   then(cm.fold_rms_norm, restore("blocks.0.mlp.W_gate", "blocks.1.mlp.W_gate"))),
        PlantedBug("RMS fold forgets ln_final", LLAMA, 19,
                   cm.fold_rms_norm, then(cm.fold_rms_norm, restore("unembed.W_U"))),
        PlantedBug("W_in * 1.05 after the RMS fold", LLAMA, 20, cm.fold_rms_norm,
                   then(cm.fold_rms_norm, scale("blocks.1.mlp.W_in", 1.05))),
        # key biases
        PlantedBug("key biases dropped in a rotary model", ROTARY, 21, keep_original,
                   on_input(zero("blocks.0.attn.b_K", "blocks.1.attn.b_K"), keep_original)),
        PlantedBug("query biases dropped with the key biases", GPT2, 22, cm.remove_key_biases,
                   then(cm.remove_key_biases, lambda out, before, cfg: zero("blocks.1.attn.b_Q")(out))),
        # shortformer
        PlantedBug("shortformer positional table of one head lost", SHORTFORMER, 23, cm.shortformer_to_tables,
                   then(cm.shortformer_to_tables, scale("blocks.0.attn.pos_Q", 0.0, head=(slice(None), 1)))),
        # refactoring
        PlantedBug("refactor: W_V of a head doubled", ATTN_ONLY, 24, cm.refactor_factored_attn_matrices,
                   then(cm.refactor_factored_attn_matrices, scale("blocks.0.attn.W_V", 2.0, head=0))),
        # the whole pipeline
        PlantedBug("process_weights, then W_out * 0.9", GPT2, 25, cm.process_weights,
                   then(cm.process_weights, scale("blocks.1.mlp.W_out", 0.9))),
        # a user's own library (computed another way than circuitmath's, so rounding differs)
        PlantedBug("user library: bias pushed through the gain", GPT2, 26, user_fold,
                   functools.partial(user_fold, bias_through_gain=True)),
        PlantedBug("user library: readers centred over d_head", GPT2, 27, user_fold,
                   functools.partial(user_fold, attn_centre_axis=2)),
        PlantedBug("user library: forgotten ln_final", GPT2, 28,
                   user_fold, functools.partial(user_fold, fold_final=False)),
        PlantedBug("user library: value biases folded without W_O", GPT2, 29, user_fold_value_biases,
                   functools.partial(user_fold_value_biases, through_W_O=False)),
        PlantedBug("user library: grouped-query value biases not repeated over the group", GQA, 30,
                   user_fold_value_biases, functools.partial(user_fold_value_biases, repeat_groups=False)),
        PlantedBug("user library: every reader centred over its last axis", GPT2, 31, user_fold,
                   functools.partial(user_fold, last_axis=True)),
        # float32 weights, processed by the user's library in float32 (other rounding than circuitmath's)
        PlantedBug("float32 user library: bias pushed through the gain", GPT2, 32, user_fold,
                   functools.partial(user_fold, bias_through_gain=True), torch.float32),
        PlantedBug("float32 user library: forgotten ln_final", GPT2, 33, user_fold,
                   functools.partial(user_fold, fold_final=False), torch.float32),
        PlantedBug("float32 user library: value biases folded without W_O", GPT2, 34, user_fold_value_biases,
                   functools.partial(user_fold_value_biases, through_W_O=False), torch.float32),
        # mistakes under later rewrites and after the whole pipeline
        PlantedBug("value biases folded without W_O, then the writers centred", GPT2, 35,
                   pipeline(fold_ln, cm.fold_value_biases, cm.center_writing_weights),
                   value_biases_hidden_under_centring),
        PlantedBug("process_weights (LLaMA), then W_gate * 1.1", LLAMA, 36, cm.process_weights,
                   then(cm.process_weights, scale("blocks.0.mlp.W_gate", 1.1))),
        PlantedBug("process_weights (grouped-query), value biases of one layer left", GQA, 37,
                   cm.process_weights,
                   then(cm.process_weights, restore("blocks.1.attn._b_V"))),
        PlantedBug("process_weights (parallel), b_O of a layer dropped", PARALLEL, 38, cm.process_weights,
                   then(cm.process_weights, lambda out, before, cfg: zero("blocks.0.attn.b_O")(out))),
        PlantedBug("process_weights (attention only), two rows of W_E swapped", ATTN_ONLY, 39,
                   cm.process_weights,
                   then(cm.process_weights, swap_rows("embed.W_E", 0, 1))),
        PlantedBug("post-norm: unembed centred, W_E * 1.1", POST_NORM, 40, cm.center_unembed,
                   then(cm.center_unembed, scale("embed.W_E", 1.1))),
        PlantedBug("shortformer: tables and fold, pos_K * 1.1", SHORTFORMER, 41,
                   pipeline(cm.shortformer_to_tables, fold_ln),
                   then(pipeline(cm.shortformer_to_tables, fold_ln), scale("blocks.1.attn.pos_K", 1.1))),
        PlantedBug("RMS fold, then one entry of b_U + 1", LLAMA, 42, cm.fold_rms_norm,
                   then(cm.fold_rms_norm, add_one_hot("unembed.b_U", 0))),
        PlantedBug("fold: ln_final's gain taken from ln1", GPT2, 43, fold_ln,
                   on_input(lambda sd, cfg: sd.update({"ln_final.w": sd["blocks.0.ln1.w"]}), fold_ln)),
        PlantedBug("grouped-query value biases folded, then a head's W_O flipped", GQA, 44,
                   cm.fold_value_biases,
                   then(cm.fold_value_biases, scale("blocks.0.attn.W_O", -1.0, head=3))),
    ]
    return bugs
