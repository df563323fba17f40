"""The default processing of a pre-LayerNorm model, each weight read and written in one go.

:func:`~circuitmath.process_weights` with its default steps on a pre-LN model is the composition
(registered as the identity ``process_weights``) of ``fold_layer_norm``,
``center_reading_weights``, ``fold_value_biases``, ``center_writing_weights`` and
``center_unembed``. Composed, each output tensor is a function of a few inputs:

- a reader ``W`` of a norm with gain ``w`` and bias ``b`` (its own bias ``b_W``):
  ``C diag(w) W`` and ``b_W + b W``, with ``C = I - 1 1^T / d_model``;
- ``W_U`` is also centered over the vocabulary: ``C diag(w) W_U C_V`` and ``(b_U + b W_U) C_V``;
- ``b_O``: ``(b_O + Σ_h b_V'[h] W_O[h]) C`` where ``b_V' = b_V + ln1.b W_V``; ``b_V`` becomes 0;
- every other writer ``W``: ``W C``.

The chain of public transforms writes ``W_U`` twice and reads it four times; here every tensor
is written once, and the big ones are processed in blocks that stay in cache. Each formula is
the chain's, through the same helpers; ``tests/test_pipeline.py`` checks that both give the
same weights.

A pre-RMSNorm model's default chain (``fold_rms_norm``, ``fold_value_biases``,
``center_unembed``) runs fused too (:func:`_fused_rms_steps`): each reader ``diag(w) W``, ``W_U``
``diag(w) W_U C_V``, ``b_O`` with the value biases, every other tensor passed through; bit for
bit the chain's for contiguous weights (``tests/test_accuracy.py``). A non-contiguous ``W_U``
(a transposed view) is the same model, but the chain then sums its vocabulary mean in another
order, so a few entries may differ from the chain's in the last bit.
"""

from __future__ import annotations

import torch

from .._compare import compute_dtype
from .._config import Config
from .._state import StateDict, all_finite, attention_names
from ._common import readers
from ._memory import SCRATCH_MIN_BYTES, converted, in_memory, new_tensor, rows_per_block, scratch
from .attention import fold_value_biases, nothing_to_carry, value_bias_through_output
from .centering import center_unembed, center_writing_weights, centered_last_axis, writers
from .layer_norm import PRODUCT_ROWS, center_reading_weights, fold_layer_norm, fold_reader
from .norms import fold_rms_norm

__all__ = ["FUSED_STEPS", "FUSED_RMS_STEPS", "fusable", "rms_fusable", "fused_default_steps"]

#: What :func:`fused_default_steps` records in ``cfg.applied``: the chain's identities, in its order.
FUSED_STEPS = tuple(
    step.identity
    for step in (fold_layer_norm, center_reading_weights, fold_value_biases, center_writing_weights, center_unembed)
)


#: What :func:`fused_default_steps` records for a :func:`rms_fusable` model: the chain's identities, in its order.
FUSED_RMS_STEPS = tuple(step.identity for step in (fold_rms_norm, fold_value_biases, center_unembed))


def fusable(cfg: Config) -> bool:
    """Whether every step of the default chain applies to ``cfg`` whatever the weights.

    A pre-LN model with nothing applied yet, without shortformer positions (folded through
    per-layer tables by the chain) and without a gated MLP (whose ``W_gate`` has no bias to absorb
    ``ln2.b @ W_gate``, a condition on the weights).
    """
    return _fresh_pre_norm(cfg, "LN") and not cfg.gated_mlp


def rms_fusable(cfg: Config) -> bool:
    """Whether the default chain of a pre-RMSNorm model, :data:`FUSED_RMS_STEPS`, applies to
    ``cfg`` whatever the weights: nothing applied yet and no shortformer positions (gated MLPs
    and grouped-query attention included: an RMSNorm has no bias to absorb). The centering of
    the writers is not in it: RMSNorm does not center."""
    return _fresh_pre_norm(cfg, "RMS")


def _fresh_pre_norm(cfg: Config, normalization_type: str) -> bool:
    """Nothing applied yet, pre-norm of ``normalization_type``, no shortformer positions."""
    return (
        not cfg.applied
        and cfg.normalization_type == normalization_type
        and cfg.norm_position == "pre"
        and cfg.positional_embedding_type in ("standard", "rotary")
        and cfg.norm_gain_offset == 0  # gains applied as 1 + w fold by the step, rounded once
        and not cfg.post_norms and cfg.logit_softcap is None  # the steps' own refusals decide there
        and not cfg.attn_sinks  # rows that do not sum to 1: fold_value_biases refuses
    )


def fused_default_steps(
    state_dict: StateDict, cfg: Config, *, stack_layers: bool = True,
) -> tuple[dict[str, torch.Tensor], Config, bool]:
    """The chain :data:`FUSED_STEPS` applied to a :func:`fusable` model, each tensor written once
    (:data:`FUSED_RMS_STEPS` to an :func:`rms_fusable` one: see :func:`_fused_rms_steps`).

    Same shapes and dtype as the input; the caller validates the input's structure. A bfloat16 or
    float16 model is computed in float32 a tensor (or, for the embedding and unembedding, a block
    of rows) at a time and each output rounded once, as the chain in float32 followed by one
    rounding would, without a float32 copy of the model. Also returns whether every output entry
    is finite, taken from sums of each block while it is in cache (``False`` may also mean a sum
    overflowed: then check the entries).

    The blocks are processed a group of layers at a time (:func:`layer_groups`): on the CPU one
    layer, each tensor read in place; on another device (a GPU, where each kernel launch costs
    more than the arithmetic of a GPT-2-small layer) several, each name's tensors stacked once
    into a new tensor that is then rewritten in place, the outputs being its layers' views. Their
    memory is freed when every layer's view is: a caller that replaces the outputs a block at a
    time passes ``stack_layers=False`` (one layer at a time on every device).
    """
    if cfg.normalization_type == "RMS":
        return _fused_rms_steps(state_dict, cfg, stack_layers=stack_layers)
    dtype = next(iter(state_dict.values())).dtype
    compute = compute_dtype(dtype)

    def up(tensor: torch.Tensor) -> torch.Tensor:
        # the tensor itself when it is in the compute dtype already, else a mapped temporary (see scratch)
        return converted(tensor, compute, mapped_from=SCRATCH_MIN_BYTES)

    sums: list[torch.Tensor] = []  # their finiteness covers every output but the unembed's bias
    out = dict(state_dict)
    block_writers = [name for name in _block_names(writers(cfg)) if name is not None]
    _weight, b_V_name, _heads = attention_names(cfg, "V")
    for layers in layer_groups(cfg, state_dict) if stack_layers else _one_at_a_time(cfg):
        group = _Layers(state_dict, layers)
        biases = {}  # the readers' folded biases, stacked, in the compute dtype
        for norm, pairs in _block_readers(cfg):
            w, b = (up(group.stacked(f"{norm}.{part}")[0]) for part in "wb")  # [layers, d_model]
            group.drop(out, f"{norm}.w", f"{norm}.b")
            for weight, bias in pairs:
                W, owned = group.stacked(weight)
                W_up = up(W)
                # where the fold is written: the float32 copy of a half-precision weight, or the
                # stacked copy, in place (each read before it is written); else a new tensor
                into = W_up if W_up is not W else (W if owned else None)
                folded, biases[bias] = fold_reader(
                    W_up, _per_layer(w, W), _per_layer(b, W), up(group.stacked(bias)[0]), center=True, out=into)
                del W_up, into
                if folded.dtype != dtype:
                    folded = W.copy_(folded) if owned else converted(folded, dtype)
                sums.append(folded.sum())  # the folded reader is still in cache
                group.scatter(out, weight, folded)
                del W, folded
        b_V = biases[f"attn.{b_V_name}"]  # ln1.b @ W_V included by the fold
        W_O = group.stacked("attn.W_O")  # read here, centered below
        b_O = _with_value_bias(group.stacked("attn.b_O")[0], b_V, W_O[0]).to(compute)
        sums.append(b_V.sum())  # the folded b_V, zeroed below, carries any NaN of ln1.b or W_V into b_O too
        biases[f"attn.{b_V_name}"] = torch.zeros(b_V.shape, dtype=dtype, device=b_V.device)
        for bias, stacked in biases.items():
            sums.append(stacked.sum())
            group.scatter(out, bias, stacked.to(dtype))
        for name in block_writers:
            W, owned = {"attn.b_O": (b_O, True), "attn.W_O": W_O}.get(name) or group.stacked(name)
            same = owned and W.dtype == dtype
            group.scatter(out, name, centered_last_axis(W, sums=sums, dtype=dtype, out=W if same else None))
    for name in writers(cfg):
        if not name.startswith("blocks."):
            out[name] = centered_last_axis(state_dict[name], sums=sums, dtype=dtype)
    w, b = up(out.pop("ln_final.w")), up(out.pop("ln_final.b"))
    out["unembed.W_U"], out["unembed.b_U"] = _fold_centered_unembed(
        state_dict["unembed.W_U"], w, b, state_dict["unembed.b_U"], sums=sums)
    finite = all_finite([*sums, out["unembed.b_U"]])
    return out, cfg.replace(normalization_type="LNPre", applied=FUSED_STEPS), finite


def layer_groups(cfg: Config, state_dict: StateDict) -> list[range]:
    """The groups of layers the fused passes process together.

    On the CPU one layer each: a stacked copy would cost a pass over memory, while a layer's
    blocks stay in cache. On another device (a GPU, where a kernel launch costs more than a
    GPT-2-small layer's arithmetic) as many layers as keep a group's temporaries within
    :data:`GROUP_TEMPORARY_SHARE` of the model's weights: the float64 copy of ``W_O`` (the
    value biases' product) and, for a half-precision LayerNorm model, the float32 copy of the
    largest reader. The stacked copies themselves are rewritten in place into the outputs.

    >>> import circuitmath as cm
    >>> cfg = cm.Config(n_layers=3, d_model=4, n_heads=2, d_head=2, d_vocab=1000, n_ctx=4)
    >>> layer_groups(cfg, cm.random_state_dict(cfg, seed=0))
    [range(0, 1), range(1, 2), range(2, 3)]
    >>> layer_groups(cfg, {name: t.to("meta") for name, t in cm.random_state_dict(cfg, seed=0).items()})
    [range(0, 3)]
    """
    first = next(iter(state_dict.values()))
    if first.device.type == "cpu" or not cfg.n_layers:
        return _one_at_a_time(cfg)
    temporary = state_dict["blocks.0.attn.W_O"].numel() * torch.float64.itemsize
    if compute_dtype(first.dtype) != first.dtype and cfg.normalization_type == "LN":
        block = (t for name, t in state_dict.items() if name.startswith("blocks.0."))
        temporary = max(temporary, max(t.numel() for t in block) * compute_dtype(first.dtype).itemsize)
    weights = sum(t.numel() * t.element_size() for t in state_dict.values())
    size = max(1, min(cfg.n_layers, int(weights * GROUP_TEMPORARY_SHARE) // temporary))
    return [range(start, min(start + size, cfg.n_layers)) for start in range(0, cfg.n_layers, size)]


def _one_at_a_time(cfg: Config) -> list[range]:
    """Each layer its own group (the CPU's :func:`layer_groups`)."""
    return [range(layer, layer + 1) for layer in range(cfg.n_layers)]


#: The most a group's temporaries may take, as a share of the model's weights (see :func:`layer_groups`).
GROUP_TEMPORARY_SHARE = 1 / 10


class _Layers:
    """Some layers' tensors of one name (``"attn.W_Q"``), stacked along a new first axis."""

    def __init__(self, state_dict: StateDict, layers: range):
        self.state_dict, self.layers = state_dict, layers

    def names(self, name: str) -> list[str]:
        return [f"blocks.{layer}.{name}" for layer in self.layers]

    def stacked(self, name: str) -> tuple[torch.Tensor, bool]:
        """``[layers, *shape]``, and whether it is a new tensor: a view of the one layer's tensor
        (to be read, not written), else a stacked copy (the caller's to rewrite in place)."""
        tensors = [self.state_dict[full] for full in self.names(name)]
        if len(tensors) == 1:
            return tensors[0].unsqueeze(0), False
        return torch.stack(tensors), True

    def scatter(self, out: dict, name: str, stacked: torch.Tensor) -> None:
        """Each layer's slice of ``stacked`` as its output."""
        out.update(zip(self.names(name), stacked.unbind(0)))

    def drop(self, out: dict, *names: str) -> None:
        for name in names:
            for full in self.names(name):
                del out[full]


def _per_layer(v: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """A stacked norm parameter ``v: [layers, d_model]`` shaped to broadcast against its stacked
    readers ``W: [layers, ..., d_model, m]`` over their other axes (heads): ``[layers, 1, d_model]``
    for attention weights, ``[layers, d_model]`` for the MLP's."""
    return v.view(v.shape[0], *(1,) * (W.dim() - 3), v.shape[-1])


def _block_names(names: list[str | None]) -> list[str | None]:
    """Block 0's names without their ``blocks.0.`` prefix; ``None`` for any other name."""
    return [name.removeprefix("blocks.0.") if name and name.startswith("blocks.0.") else None for name in names]


def _block_readers(cfg: Config) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """:func:`readers` of a block, named within it: ``[("ln1", [("attn.W_Q", "attn.b_Q"), ...]), ...]``."""
    return [
        (inside, [tuple(_block_names(list(pair))) for pair in pairs])
        for norm, pairs in readers(cfg)
        if (inside := _block_names([norm])[0]) is not None
    ]


def _fold_centered_unembed(
    W_U: torch.Tensor, w: torch.Tensor, b: torch.Tensor, b_U: torch.Tensor, *, sums: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C diag(w) W_U C_V, (b_U + b W_U) C_V)`` for ``W_U: [d_model, d_vocab]``, ``b_U: [d_vocab]``.

    With ``m_j = mean_i w_i W_ij`` (the reader centering) and ``r_i = w_i mean_j W_ij - mean_j m_j``
    (the vocabulary mean of what remains), the result is ``w_i W_ij - m_j - r_i``. A first pass
    over blocks of :data:`~circuitmath._processing.layer_norm.PRODUCT_ROWS` rows accumulates ``w W_U`` and ``b W_U`` (blocks summed in float64, as
    :func:`~circuitmath._processing.layer_norm.products_through` does) and the row sums; a
    second writes the result in blocks of rows (8 on the CPU; see
    :func:`~circuitmath._processing._memory.rows_per_block`), each finished while in cache (and,
    given ``sums``, summed there, appended to it). The arithmetic is in ``w``'s dtype (float32
    for a half-precision ``W_U``, each block cast as it is read) and each output entry is rounded
    to ``W_U``'s dtype once.
    """
    d_model, d_vocab = W_U.shape
    compute = w.dtype
    rows = PRODUCT_ROWS  # the blocks whose products are summed in float64: products_through's, on any device
    rows_out = rows_per_block(d_model, 2 * d_vocab * compute.itemsize, W_U.device, cpu_rows=8,
                              staged=compute != W_U.dtype)
    gain_and_bias = torch.stack([w, b])  # [2, d_model]
    through = torch.zeros(2, d_vocab, dtype=torch.float64, device=W_U.device)
    row_sums = torch.empty(d_model, dtype=torch.float64, device=W_U.device)
    up = None if compute == W_U.dtype else scratch(
        (max(min(rows, d_model), 2 * rows_out), d_vocab), compute, W_U.device)
    for start in range(0, d_model, rows):
        block = W_U[start : start + rows]
        block = block if up is None else up[: block.shape[0]].copy_(block)  # cast into the reused scratch
        through += torch.matmul(gain_and_bias[:, start : start + rows], block)
        row_sums[start : start + rows] = block.sum(dim=-1)
    column_mean = through[0] / d_model
    minus_row_mean = (column_mean.mean() - w.double() * row_sums / d_vocab).to(compute)
    minus_column_mean = (-column_mean).to(compute)
    out = new_tensor(W_U.shape, W_U.dtype, W_U.device)
    for start in range(0, d_model, rows_out):
        stop = start + rows_out
        if compute == W_U.dtype:
            torch.addcmul(minus_column_mean, W_U[start:stop], w[start:stop, None], out=out[start:stop])
            out[start:stop].add_(minus_row_mean[start:stop, None])
        else:  # the block cast into the scratch's first rows_out rows, the result in its next ones
            count = min(stop, d_model) - start
            block, result = up[:count].copy_(W_U[start:stop]), up[rows_out : rows_out + count]
            torch.addcmul(minus_column_mean, block, w[start:stop, None], out=result)
            out[start:stop] = result.add_(minus_row_mean[start:stop, None])
        if sums is not None:
            sums.append(out[start:stop].sum())
    bias = b_U.double() + through[1]
    return out, (bias - bias.mean()).to(b_U.dtype)


def _with_value_bias(b_O: torch.Tensor, b_V: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """``b_O + Σ_h b_V[group(h)] W_O[h]`` in float64 (``b_O: [..., d_model]``, leading axes for
    stacked layers), the bits of :func:`~circuitmath.fold_value_biases` before its rounding.

    ``W_O`` (``[..., n_heads, d_head, d_model]``) is copied to float64 laid out ``[..., d_head,
    n_heads, d_model]``, the order in which the einsum of ``value_bias_through_output`` contracts
    it (its transposed view is passed), so the einsum takes it without a copy; mapped, so that no
    copy per layer is freed into the heap.
    """
    if not nothing_to_carry(b_V, W_O):
        W_O = W_O.transpose(-3, -2)
        W_O = scratch(W_O.shape, torch.float64, W_O.device).copy_(W_O).transpose(-3, -2)
    return b_O.double() + value_bias_through_output(b_V, W_O)


def _fused_rms_steps(
    state_dict: StateDict, cfg: Config, *, stack_layers: bool = True,
) -> tuple[dict[str, torch.Tensor], Config, bool]:
    """:data:`FUSED_RMS_STEPS` (``fold_rms_norm``, ``fold_value_biases``, ``center_unembed``) on
    an :func:`rms_fusable` model, each written tensor written once, the others passed through.

    Composed: every reader ``W`` of a gain ``w`` becomes ``diag(w) W``, ``b_O`` becomes ``b_O +
    Σ_h b_V[group(h)] W_O[h]`` (``b_V`` zero), and ``W_U`` becomes ``diag(w) W_U C_V``, ``b_U``
    ``b_U C_V``. Each output has the bits of the chain's in the compute dtype (float32 for a half
    precision model), rounded once: the products are elementwise, ``b_O`` is the chain's float64
    sum, and the vocabulary mean of ``W_U`` is taken per row as the chain's. A half-precision
    reader is multiplied by its gain in its own dtype: the product of two bfloat16 (or float16)
    numbers is exact in float32, so the one rounding of the product gives the float32 chain's
    bits rounded once, with no float32 temporary and, on a GPU, one same-dtype kernel. The
    unembed is computed a block of rows at a time in one mapped float32 scratch. The value biases
    (a group of layers at a time, :func:`layer_groups`) go first in each group, while little
    output is held: their float64 ``W_O`` is the largest temporary. Returns ``(state_dict, cfg,
    finite)`` as :func:`fused_default_steps`.
    """
    dtype = next(iter(state_dict.values())).dtype
    compute = compute_dtype(dtype)
    sums: list[torch.Tensor] = []
    out = dict(state_dict)
    _weight, b_V_name, _heads = attention_names(cfg, "V")
    written = set()
    for layers in layer_groups(cfg, state_dict) if stack_layers else _one_at_a_time(cfg):  # as fused_default_steps
        group = _Layers(state_dict, layers)
        b_V = group.stacked(f"attn.{b_V_name}")[0]
        b_O = _with_value_bias(group.stacked("attn.b_O")[0], b_V, group.stacked("attn.W_O")[0]).to(compute).to(dtype)
        group.scatter(out, "attn.b_O", b_O)
        group.scatter(out, f"attn.{b_V_name}", torch.zeros_like(b_V))
        sums += [b_V.sum(), b_O.sum()]  # b_V's NaN reaches b_O; a sum of b_O's rounding too
        for norm, pairs in _block_readers(cfg):
            # in the model's dtype: the product of two half-precision numbers is exact in float32,
            # so its one rounding gives the bits of the float32 product rounded once (see _scaled_rows)
            w = group.stacked(f"{norm}.w")[0]
            group.drop(out, f"{norm}.w")
            for weight, _bias in pairs:
                for layer, name in enumerate(group.names(weight)):  # each its own new tensor: no copy to stack
                    out[name] = _scaled_rows(state_dict[name], w[layer], sums=sums)
                    written.add(name)
    w = out.pop("ln_final.w").to(compute)
    out["unembed.W_U"] = _scaled_rows(state_dict["unembed.W_U"], w, sums=sums, center=True, cpu_rows=8)
    b_U = converted(state_dict["unembed.b_U"], compute)
    out["unembed.b_U"] = (b_U - b_U.mean()).to(dtype)
    written.add("unembed.W_U")
    finite = all_finite([*sums, *(tensor for name, tensor in out.items() if name not in written)])  # + the others
    return out, cfg.replace(normalization_type="RMSPre", applied=FUSED_RMS_STEPS), finite


def _row_blocks(count: int, rows: int) -> list[tuple[int, int]]:
    """``[start, stop)`` blocks of ``rows`` rows covering ``count``, none of 1 row unless ``count``
    is 1 (a 1-row mean is a reduction with one output, which torch may split over threads, so
    its bits could differ from those of the same row's mean in a larger tensor)."""
    bounds = [*range(0, count, rows), count]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


def _scaled_rows(
    W: torch.Tensor, w: torch.Tensor, *, sums: list, center: bool = False, cpu_rows: int | None = None,
) -> torch.Tensor:
    """``W * w[:, None]`` for ``W: [..., d_model, n]``, ``w: [d_model]`` in the compute dtype, a
    new tensor in ``W``'s dtype, written a block of rows at a time (:func:`~circuitmath._processing.
    _memory.rows_per_block`, ``cpu_rows`` on the CPU; a half-precision block computed in a reused float32 scratch and rounded
    once); with ``center``, each row is then centered (``W_U`` over the vocabulary) while in
    cache. Each block's sum is appended to ``sums``.

    A temporary made per block and freed while the sums made after it are kept would fragment
    the C heap (see :func:`~circuitmath._processing._memory.scratch`): a mixed-dtype ``torch.mul``
    (its cast of each block) leaves freed memory resident.
    On another device (a GPU) without ``center``, the whole weight is one mixed-dtype product, the
    same bits: it computes in ``w``'s dtype and rounds once, with no temporary. A ``W`` that is the
    transpose of a contiguous tensor (a checkpoint's ``[out, in]`` matrix as a converter hands it
    over) with ``w`` of its dtype gives a product in the same layout, without a transpose."""
    if not center and w.dtype == W.dtype and W.dim() >= 2 and not W.is_contiguous() and W.mT.is_contiguous():
        # W as a checkpoint stores it, [..., n, d_model] seen transposed (a converter's view of an
        # [out, in] matrix): the product is written in that layout, the same products, so a
        # writer in the checkpoint's layout copies it as it is
        stored = W.mT.reshape(-1, W.shape[-2])
        out = new_tensor(stored.shape, W.dtype, W.device)
        per_block = rows_per_block(stored.shape[0], stored.shape[1] * w.element_size(), W.device, cpu_rows=cpu_rows)
        for start, stop in _row_blocks(stored.shape[0], per_block):
            sums.append(torch.mul(stored[start:stop], w, out=out[start:stop]).sum())
        return out.view(W.mT.shape).mT
    if center and not W.is_contiguous():
        # rows read from a transposed view (a checkpoint's lm_head.weight) would gather an entry
        # per cache line: one blocked transpose first, then the rows as in memory, the same bits
        W = in_memory(W, scratch(W.shape, W.dtype, W.device))
    flat = W.reshape(-1, W.shape[-1])
    gains = w.repeat(flat.shape[0] // w.shape[0])
    out = new_tensor(flat.shape, W.dtype, W.device)
    if not center and W.device.type != "cpu":
        # one kernel: a mixed-dtype product computes in w's dtype and rounds once into out
        # (on the CPU it would allocate a cast of the whole weight first)
        torch.mul(flat, gains[:, None], out=out)
        sums.append(out.sum())
        return out.view(W.shape)
    per_block = rows_per_block(flat.shape[0], flat.shape[1] * w.element_size(), W.device, cpu_rows=cpu_rows)
    up = None if w.dtype == W.dtype else scratch((min(per_block + 1, flat.shape[0]), flat.shape[1]), w.dtype, W.device)
    for start, stop in _row_blocks(flat.shape[0], per_block):
        if up is None:
            block = torch.mul(flat[start:stop], gains[start:stop, None], out=out[start:stop])
        else:  # cast into the scratch first: a mixed-dtype product would allocate a cast temporary per block
            block = up[: stop - start].copy_(flat[start:stop]).mul_(gains[start:stop, None])
        if center:
            block.sub_(block.mean(dim=-1, keepdim=True))
        if up is not None:
            out[start:stop] = block
        sums.append(out[start:stop].sum())
    return out.view(W.shape)
