"""The symmetries a streamed replay recovers from the processed checkpoint, a part at a time.

:class:`Recovery` extends the replay of the steps a processed checkpoint records (a
:func:`~circuitmath.process_weights` call) where its tensors show more: at the ends, where
``after``'s ``W_E`` is not the replay's but keeps its row norms, the RMSNorm gains folded (a
rotation needs them folded) and the residual rotation ``Q`` recovered from the ends (its
identity's ``recover``, with the widening of
:meth:`~circuitmath._diagnosis._uncertain.Widenings.recovered`: orthogonal Procrustes on ``W_E``
first, snapped to ``Q 1 = ±1`` in an ``LNPre`` model, as in memory); in each block, then,
the same fold and ``Q``, and the parameters of each identity in :data:`PER_BLOCK` recovered from
that block of ``after`` (``Identity.recover``, with the widening of
:meth:`~circuitmath._diagnosis._uncertain.Widenings.recovered`). Every step is an exact rewrite
with its parameter, so the replay stays a processing of ``before`` whatever is recovered: a
wrong recovery leaves tensors unexplained, to be judged, and never explains a wrong one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ._config import Config
from ._diagnosis._tensors import Thresholds
from ._diagnosis._uncertain import Widenings
from ._errors import CircuitMathError
from ._identities import get_identity
from ._processing.norms import fold_rms_norm
from ._processing.pipeline import process_weights

__all__ = ["PER_BLOCK", "RECOVERABLE", "Recovery"]

#: The identities whose parameters are recovered block by block, in the order they are replayed.
PER_BLOCK = ("rotate_heads", "migrate_norm_scales")
#: The residual rotation, recovered from the ends.
ROTATION = "rotate_residual_stream"
#: Every step the replay may add, in the order each part replays them.
RECOVERABLE = ("fold_rms_norm", ROTATION, *PER_BLOCK)


class Recovery:
    """The replay of :func:`process_weights` with ``keywords`` on each part, then what
    :meth:`start` recovers at the ends and each block's own parameters (see the module).
    ``steps`` names what was recovered, in order; ``widenings`` the tensors a recovered parameter
    rewrote in half precision (``dtype``, the replay's tensors': ``after``'s)."""

    def __init__(self, keywords: dict, cfg: Config, dtype: torch.dtype):
        self.keywords, self.cfg = keywords, cfg
        self.widenings = Widenings(dtype)
        self.dtype = dtype
        self.fold = False
        self.rotate = None  # the rewrite by the recovered Q (widening the bounds of what it rotates)
        self.steps: dict[str, None] = {}
        self.replayed_cfg: Config | None = None  # the ends' config from the recorded steps alone
        self.final: dict[str, torch.Tensor] = {}  # after's final norm, beside each block

    @property
    def named(self) -> list[str]:
        """The steps recovered, in the order each part replays them."""
        return [n for n in RECOVERABLE if n in self.steps]

    @property
    def on(self) -> bool:
        return self.rotate is not None

    def plan(self, layer: int | None, after: Mapping[str, torch.Tensor]):
        """The rewrite ``(state_dict, cfg) -> (state_dict, cfg)`` of part ``layer`` (``None``:
        the ends), ``after`` that part of the processed checkpoint in the whole model's names."""
        def transform(state_dict, cfg):
            out, out_cfg = process_weights(state_dict, cfg, **self.keywords)
            if layer is None:
                self.replayed_cfg = out_cfg
                self._start(out, out_cfg, after)
            if not self.on:
                return out, out_cfg
            if self.fold:
                out, out_cfg = fold_rms_norm(out, out_cfg)
            out, out_cfg = self.rotate(out, out_cfg)
            if layer is None:
                self.final = {n: t for n, t in after.items() if n.startswith("ln_final.")}
            # after's part, beside the replay's stand-ins for the rest of the model and after's final norm
            theirs = dict(out) | self.final | {n.replace(f"blocks.{layer}.", "blocks.0.", 1): t for n, t in after.items()}
            for name in PER_BLOCK:
                out, out_cfg = self._recovered(get_identity(name), out, out_cfg, theirs)
            return out, out_cfg
        return transform

    def shows_rotation(self, ours: torch.Tensor, theirs: torch.Tensor) -> bool:
        """Whether ``theirs`` (``after``'s ``W_E``, ``[d_vocab, d_model]``) differs from ``ours``
        beyond the recognition threshold and keeps its row norms: a rotation of it."""
        if ours.shape != theirs.shape or not ours.numel():
            return False
        # in float32 (no copy of a float32 embedding): its rounding is far below the threshold;
        # the row norms first, which a centering or a scaling changes
        ours, theirs = ours.float(), theirs.float().to(ours.device)
        threshold = Thresholds.of(self.dtype, self.cfg).recognise * float(theirs.abs().max())
        return float((ours.norm(dim=-1) - theirs.norm(dim=-1)).abs().max()) <= threshold * ours.shape[-1] ** 0.5 \
            and float((ours - theirs).abs().max()) > threshold

    def _start(self, ends: dict, cfg: Config, after: Mapping) -> None:
        """Where the ends show a rotation (:meth:`shows_rotation`), the fold and ``Q``."""
        if self.on or "embed.W_E" not in after or not self.shows_rotation(ends["embed.W_E"], after["embed.W_E"]):
            return
        state, state_cfg = ends, cfg
        if cfg.normalization_type == "RMS":
            try:
                state, state_cfg = fold_rms_norm(ends, cfg)
            except CircuitMathError:
                return
        rotation = get_identity(ROTATION)
        try:
            found, widen = self.widenings.recovered(rotation, state, dict(state) | dict(after), state_cfg,
                                                    widened=self.cfg.replace(n_layers=1))
        except (CircuitMathError, RuntimeError):
            return
        self.fold = state is not ends
        self.rotate = widen(lambda sd, c: rotation.with_parameters(sd, c, found))
        self.steps.update(dict.fromkeys(["fold_rms_norm"] if self.fold else []))
        self.steps[rotation.name] = None

    def _recovered(self, identity, state: dict, cfg: Config, after: Mapping):
        """``state`` rewritten by ``identity`` with its parameter recovered from ``after`` (the
        same block), or as it is where none is recovered or the rewrite refuses it."""
        try:
            found, widen = self.widenings.recovered(identity, state, after, cfg)
            if found is None:
                return state, cfg
            out, out_cfg = widen(lambda sd, c: identity.with_parameters(sd, c, found))(state, cfg)
        except CircuitMathError:
            return state, cfg
        self.steps[identity.name] = None
        return out, out_cfg
