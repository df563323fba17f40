"""LayerNorm folding and centering of reading weights."""

from __future__ import annotations

import torch

from .._compare import compute_dtype
from .._reference import normalize
from .._config import Config
from .._state import StateDict, validate_state_dict
from .._errors import Precondition
from ._common import NORM_READ_LINEARLY, PRE_NORM, readers, refuse_reapplication, require, rewrite
from ._memory import new_tensor, rows_per_block
from .shortformer import shortformer_to_tables

__all__ = ["fold_layer_norm", "center_reading_weights", "fold_reader", "products_through", "PRODUCT_ROWS", "reader_preconditions",
           "IS_LN", "READER_HAS_BIAS", "READS_LNPRE"]

IS_LN = Precondition("normalization_type is LN")
READER_HAS_BIAS = Precondition(
    "every reader has a bias to absorb b @ W",
    "every reader has a bias to absorb b @ W (W_gate has none: there b @ W must be zero)",
)
READS_LNPRE = Precondition(
    "readers see LNPre(x), which is orthogonal to 1",
    "every reader's input is LNPre(x) (normalization_type LNPre, e.g. after fold_layer_norm)",
)


def reader_preconditions(identity: str, cfg: Config) -> None:
    """What every rewrite of the norms' readers (:func:`fold_layer_norm`,
    :func:`center_reading_weights`, :func:`~circuitmath.fold_rms_norm`) needs: not applied yet,
    pre-norm, and every norm's output read only by linear maps."""
    refuse_reapplication(identity, cfg)
    require(
        identity, PRE_NORM, cfg.norm_position == "pre",
        "the model is post-norm: each norm's output is the residual stream itself, read again by"
        " the next norm (a non-linear reader), so there is no linear map to fold into",
    )
    require(
        identity, NORM_READ_LINEARLY,
        cfg.positional_embedding_type != "shortformer" or cfg.n_layers == 0,
        "with shortformer embeddings W_pos is added to ln1's output before W_Q and W_K read it,"
        " so rewriting W_Q and W_K would rewrite W_pos's contribution too; move W_pos into"
        f" per-layer query and key tables first ({shortformer_to_tables.identity})",
    )


@rewrite(records=False)
def fold_layer_norm(
    state_dict: StateDict, cfg: Config, *, center_reading_weights: bool = False, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Fold every LayerNorm's gain ``w`` and bias ``b`` into the linear maps that read it.

    ``LN(x) @ W + b_W = LNPre(x) @ (w[:, None] * W) + (b_W + b @ W)`` for each reader: ``W_Q``,
    ``W_K``, ``W_V`` (``[n_heads, d_model, d_head]``), ``W_in`` (``[d_model, d_mlp]``) and
    ``W_U`` (``[d_model, d_vocab]``). ``eps`` stays inside ``LNPre``, so the fold is exact.
    The bias terms ``b @ W`` are accumulated in float64 and rounded once to the input dtype.
    The returned config has ``normalization_type="LNPre"`` and records ``"fold_layer_norm"``.
    A pre-norm model's embedding LayerNorm (BLOOM's ``embed.ln``; its configs add nothing to the
    token embedding before it, ALiBi positions having no weights) computes a function of the
    token alone, so it folds row by row: ``W_E`` becomes ``LN(W_E)`` (computed in float64, rounded
    once) and ``embedding_norm`` is switched off.
    A shortformer model first goes through :func:`shortformer_to_tables` (recorded too), since
    ``W_pos`` added after ``ln1`` must not be scaled by the gain.

    With ``center_reading_weights=True`` the result is then passed through
    :func:`center_reading_weights`.

    >>> import torch
    >>> from circuitmath import Config, fold_layer_norm, forward
    >>> from circuitmath import random_state_dict
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    >>> sd = random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> folded, folded_cfg = fold_layer_norm(sd, cfg)
    >>> folded_cfg.normalization_type, folded_cfg.applied
    ('LNPre', ('fold_layer_norm',))
    >>> tokens = torch.tensor([[1, 4, 2, 7]])
    >>> bool(torch.allclose(forward(sd, cfg, tokens), forward(folded, folded_cfg, tokens)))
    True
    """
    require(
        identity, IS_LN, cfg.normalization_type == "LN",
        f"normalization_type is {cfg.normalization_type!r}; there is no LayerNorm gain and bias"
        + (" (RMSNorm gains fold by a different identity)" if cfg.normalization_type == "RMS" else ""),
    )
    if cfg.positional_embedding_type == "shortformer" and cfg.norm_position == "pre" and identity not in cfg.applied:
        state_dict, cfg = shortformer_to_tables(state_dict, cfg)
    reader_preconditions(identity, cfg)
    validate_state_dict(state_dict, cfg)
    for norm, pairs in readers(cfg):
        for weight, bias in pairs:
            require(
                identity, READER_HAS_BIAS,
                bias is not None or not torch.any(state_dict[f"{norm}.b"] @ state_dict[weight]),
                f"{weight} has no bias, so {norm}.b @ {weight} (nonzero) cannot be folded;"
                " its non-linearity sits right behind it",
            )
    applied = (identity, _CENTERED_READERS) if center_reading_weights else (identity,)
    if center_reading_weights:
        reader_preconditions(_CENTERED_READERS, cfg)
    out = dict(state_dict)
    for norm, pairs in readers(cfg):
        w, b = out.pop(f"{norm}.w"), out.pop(f"{norm}.b")
        for weight, bias in pairs:
            out[weight], folded_bias = fold_reader(
                state_dict[weight], w, b, None if bias is None else state_dict[bias], center=center_reading_weights
            )
            if bias is not None:
                out[bias] = folded_bias
    if cfg.embedding_norm:  # a pre-norm model's (BLOOM's): a function of the token alone, tabled
        W_E, w, b = out.pop("embed.W_E"), out.pop("embed.ln.w"), out.pop("embed.ln.b")
        out["embed.W_E"] = normalize(W_E.double(), "LN", w.double(), b.double(), cfg.eps).to(W_E.dtype)
    return out, cfg.replace(normalization_type="LNPre", embedding_norm=False, applied=cfg.applied + applied)


def fold_reader(
    W: torch.Tensor, w: torch.Tensor, b: torch.Tensor, b_W: torch.Tensor | None, *, center: bool,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One reader ``W: [..., d_model, m]`` with bias ``b_W: [..., m]`` (or ``None``) folded with
    the gain ``w`` and bias ``b``: ``(w[:, None] * W, b_W + b @ W)``.

    ``w`` and ``b`` are ``[d_model]``, or ``[..., d_model]`` with leading axes that broadcast
    against ``W``'s (several layers' readers stacked, ``W: [layers, n_heads, d_model, d_head]``,
    each with its own norm, ``w: [layers, 1, d_model]``). With ``center=True`` the weight is also
    centered over ``d_model`` (:func:`center_reading_weights`): ``w_i W_ij - mean_i(w_i W_ij)``,
    the mean taken from the same pass over ``W`` as ``b @ W``, so the result is written once. The
    folded weight is written into ``out`` (``W``'s shape and dtype; ``W`` itself may be given)
    when given, else into a new tensor.
    """
    through = products_through(torch.stack([w, b], dim=-2), W)  # [..., 2, m]: w @ W and b @ W
    folded = new_tensor(W.shape, W.dtype, W.device) if out is None else out
    compute = compute_dtype(W.dtype)
    if not center:
        # exact in the compute dtype, so rounded once even in half precision (8 or 11 bits times
        # 8 or 11 bits fits float32's 24)
        torch.mul(W, w[..., :, None], out=folded)
    elif compute == W.dtype:
        mean = (through[..., 0, :] / W.shape[-2]).to(W.dtype).unsqueeze(-2)
        torch.addcmul(mean.neg_(), W, w[..., :, None], out=folded)
    else:  # half precision: w W - mean in float32 a chunk of rows at a time, each entry rounded once
        minus_mean = (through[..., 0, :] / -W.shape[-2]).to(compute).unsqueeze(-2)
        for start, stop in _chunks(W, compute):
            folded[..., start:stop, :] = torch.addcmul(
                minus_mean, W[..., start:stop, :].to(compute), w[..., start:stop, None].to(compute))
    bias = None if b_W is None else (b_W.double() + through[..., 1, :]).to(W.dtype)
    return folded, bias


def _chunks(W: torch.Tensor, compute: torch.dtype, rows: int = 1) -> list[tuple[int, int]]:
    """``(start, stop)`` of the chunks of ``W``'s rows (its axis -2) that a half-precision loop
    casts to ``compute`` one at a time: each a multiple of ``rows`` rows, of about a cache's
    size on the CPU (:func:`~circuitmath._processing._memory.rows_per_block`)."""
    count = W.shape[-2]
    row_bytes = W.numel() // max(1, count) * compute.itemsize
    step = rows * max(1, rows_per_block(count, row_bytes, W.device) // rows)
    return [(start, min(start + step, count)) for start in range(0, count, step)]


#: Terms of a float64 bias product summed in the weight's dtype before the float64 sum (:func:`products_through`).
PRODUCT_ROWS = 64


def products_through(V: torch.Tensor, W: torch.Tensor, *, rows: int = PRODUCT_ROWS) -> torch.Tensor:
    """``V @ W`` in float64 for ``V: [..., k, d_model]`` and ``W: [..., d_model, m]`` (leading
    axes broadcast): ``[..., k, m]``.

    A float32 product accumulates all ``d_model`` terms in float32, and the folded biases feed
    every later layer. Here each block of ``rows`` terms is summed in ``W``'s dtype (float32 for
    half precision, a chunk of blocks cast at a time) and the blocks in float64: no float64 copy
    of ``W`` is made, and each bias carries the rounding of ``rows`` terms, not ``d_model``. Blocks of 64 rows
    cost about what one float32 product costs; smaller blocks cost more.
    """
    compute = compute_dtype(W.dtype)
    if compute != W.dtype and W.shape[-2]:
        # half precision: its blocks summed in float32, a chunk of them cast at a time
        chunks = _chunks(W, compute, rows)
        return sum(products_through(V[..., start:stop].to(compute), W[..., start:stop, :].to(compute), rows=rows)
                   for start, stop in chunks)
    d_model, m = W.shape[-2:]
    whole = d_model - d_model % rows
    blocks = W[..., :whole, :].reshape(*W.shape[:-2], whole // rows, rows, m)
    V_blocks = V[..., :whole].reshape(*V.shape[:-1], whole // rows, rows).transpose(-3, -2)  # [..., blocks, k, rows]
    total = torch.matmul(V_blocks, blocks).double().sum(dim=-3)
    if whole < d_model:
        total += torch.matmul(V[..., whole:], W[..., whole:, :]).double()
    return total


@rewrite
def center_reading_weights(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Subtract from every reader its mean over the residual axis: ``W - 1 mean_d(W)``.

    Exact because every reader's input is ``LNPre(x)``, which is orthogonal to the all-ones
    vector. Needs ``normalization_type="LNPre"`` (fold the LayerNorm first). Records
    ``"center_reading_weights"``. The mean is summed as :func:`fold_layer_norm`'s bias products
    are (:func:`products_through`), and half precision is centered in float32 and rounded once.
    """
    reader_preconditions(identity, cfg)
    require(
        identity, READS_LNPRE, cfg.normalization_type == "LNPre",
        {
            "LN": "normalization_type is 'LN': LN(x) = LNPre(x) diag(w) + b is not orthogonal to 1;"
            " fold the LayerNorm first (fold_layer_norm)",
        }.get(
            cfg.normalization_type,
            f"normalization_type is {cfg.normalization_type!r}: the readers' input is not centered",
        ),
    )
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    for _norm, pairs in readers(cfg):
        for weight, _bias in pairs:
            W = state_dict[weight]
            ones = torch.ones(W.shape[-2], dtype=W.dtype, device=W.device)
            out[weight], _ = fold_reader(W, ones, torch.zeros_like(ones), None, center=True)  # the fold's centering alone
    return out, cfg


#: What :func:`fold_layer_norm` with ``center_reading_weights=True`` records after itself (its
#: keyword shadows the function there).
_CENTERED_READERS = center_reading_weights.identity
