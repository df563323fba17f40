"""Changes no identity explains: the one rule for a processed tensor the replay does not reproduce.

A tensor of ``after`` that the replayed identities reproduce entry by entry (within the
certificate: :data:`~circuitmath._diagnosis._tensors.CERTIFICATE_ULPS` unit in the last place,
plus the rounding of computing the rewrite) is the rewrite. Every other tensor is judged the same
way whatever the form the models come in (in memory, a file, a folder read a part at a time) and
whatever their dtype:

- a **near miss** (every entry within :data:`NEAR_ULPS` units in the last place of the rewrite,
  some entry beyond the certificate) is the rewrite, slightly changed, and is refused: at a
  precision of a few bits the log-probs cannot tell a change of a few units from rounding (a
  1 % change of one row of a bfloat16 tensor is 1.3 to 2.6 units), the entries can;
- a **change** (some entry further) is what an exact rewrite no identity names looks like (a
  head's value and output weights scaled against each other), or a larger error. Its entries
  beyond the certificate are the change; the function decides: the replay's end against the
  replay's end with the changed tensors taken from ``after`` (every entry: one within the
  certificate of the rewrite only by coincidence, a near-zero entry of a rotated tensor, is
  ``after``'s and not the rewrite's), both run in float64 (nothing else differs between them,
  and nothing is rounded but what ``after`` rounded), within
  :func:`~circuitmath.testing.logprob_tolerance` of float64 plus ``SENSITIVITY_SAFETY`` times
  how far the log-probs move when every changed entry ``w`` is moved by ``u * xi * (|w| +
  rms)`` (``u`` the unit roundoff of ``after``'s tensor, ``xi`` standard normal from a
  generator seeded by the tensor's name, ``rms`` the root mean square of the changed entries:
  an entry computed by cancellation carries the rounding of its terms) and every other entry of
  a changed tensor by ``xi`` times its distance from the rewrite: the rounding of the tensors
  that actually changed, and of nothing else.

A change of at least ``NEAR_ULPS`` units on a row moves the log-probs coherently, many times
what rounding the same entries does; below that the certificate refuses it. So a change is
caught from about one unit in the last place up, in every dtype (``benchmarks/sharpness.py``).
The float64 passes run a part at a time (:class:`ChangePasses`), so a checkpoint folder is
judged while it is streamed, as a model in memory is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .._compare import Comparison, unit_roundoff, logprob_tolerance, named_generator
from .._config import Config
from .._reference import block, embed, unembed
from ._tensors import CERTIFICATE_ULPS, _MANTISSA_BITS, _largest_entry, _ratios_float64, Thresholds
from ._uncertain import widened_ratios

__all__ = ["NEAR_ULPS", "Change", "changes_of", "ChangePasses", "judge_changes"]

#: Units in the last place of the model's dtype within which a tensor off its certificate is a
#: near miss (refused by the certificate) rather than a change (judged by the float64 log-probs).
#: A coherent change of a row by this many units moves the log-probs about ten times what the
#: rounding of the row does (``SENSITIVITY_SAFETY`` covers four): nothing falls between the two.
NEAR_ULPS = 32


@dataclass(frozen=True)
class Change:
    """One tensor of ``after`` the replay does not reproduce: ``worst`` is its largest entry's
    distance from the rewrite in units of the certificate's bound (above 1), ``near`` whether
    that is within :data:`NEAR_ULPS`; ``tensor`` and ``mask`` (the entries beyond the bound)
    are kept for a change, to be run in float64."""

    name: str
    worst: float
    near: bool
    tensor: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def changes_of(names: Iterable[str], after: Mapping, rewrite: Mapping, thresholds: Thresholds,
               allowance: Mapping[str, list] | None = None) -> list[Change]:
    """The :class:`Change` of each tensor named (``after``'s against ``rewrite``'s, same shapes),
    measured entry by entry in float64 as the certificate measures it (widened where
    ``allowance`` says a recovered rotation rewrote the tensor: :mod:`._uncertain`)."""
    bits = _MANTISSA_BITS[thresholds.dtype]
    out = []
    for name in names:
        got, expected = after[name], rewrite[name]
        scale = max(_largest_entry(got), _largest_entry(expected))
        if (allowance or {}).get(name):
            ratios = widened_ratios(got, expected, scale, thresholds, allowance[name]).reshape(-1)
        else:
            ratios = _ratios_float64(got.reshape(-1), expected.reshape(-1).to(got.device), bits, thresholds.floor * scale)
        worst = float(ratios.max()) if ratios.numel() else 0.0
        near = worst * CERTIFICATE_ULPS <= NEAR_ULPS  # the ratio's unit is the bound, CERTIFICATE_ULPS units
        out.append(Change(name, worst, near, None if near else got, None if near else (ratios > 1).reshape(got.shape)))
    return out


class ChangePasses:
    """Three float64 forward passes on ``tokens``, a part at a time: the replay's end, it with
    the changes (:class:`Change`) taken from ``after``, and that with the changed entries moved
    by their rounding (see the module). Each part is handed to :meth:`start`, :meth:`step` and
    :meth:`finish` with the changes of its tensors; :meth:`finish` returns the
    :class:`~circuitmath.testing.Comparison` of the first two, its tolerance from the third."""

    def __init__(self, cfg: Config, tokens: torch.Tensor, seed: int = 0):
        self.cfg, self.seed = cfg, seed
        self.used, self.index = torch.unique(tokens, return_inverse=True)  # the embedding rows the tokens read
        self.positions = tokens.shape[1]
        self.streams: list = []

    def _weights(self, part: Mapping[str, torch.Tensor], changes: Mapping[str, Change], rows=None):
        """``(base, changed, nudged)`` float64 copies of ``part``: ``rows`` selects leading rows
        of every tensor named in it (``{name: index}``)."""
        rows = rows or {}
        base = {n: (t[rows[n]] if n in rows else t).double() for n, t in part.items()}
        changed, nudged = dict(base), dict(base)
        for name, change in changes.items():
            if name not in base:
                continue
            tensor, mask = change.tensor, change.mask
            if name in rows:
                tensor, mask = tensor[rows[name].to(tensor.device)], mask[rows[name].to(mask.device)]
            tensor, mask = tensor.to(base[name].device).double(), mask.to(base[name].device)
            changed[name] = tensor
            moved = tensor[mask]
            rms = float(moved.square().mean().sqrt()) if moved.numel() else 0.0
            g = named_generator(f"{name}:change", self.seed)
            xi = torch.randn(change.tensor.shape, generator=g, dtype=torch.float64, device="cpu")
            if name in rows:
                xi = xi[rows[name].cpu()]
            # a changed entry moved by its rounding; one within the certificate by its distance from the rewrite
            size = torch.where(mask, tensor.abs().add_(rms).mul_(unit_roundoff(change.tensor.dtype)), (tensor - base[name]).abs())
            nudged[name] = tensor + xi.to(tensor.device).mul_(size)
        return base, changed, nudged

    def start(self, ends: Mapping[str, torch.Tensor], changes: Mapping[str, Change]) -> None:
        rows = {"embed.W_E": self.used.to(ends["embed.W_E"].device)}
        part = {n: t for n, t in ends.items() if n.startswith(("embed.", "pos_embed."))}
        if "pos_embed.W_pos" in part:
            rows["pos_embed.W_pos"] = torch.arange(self.positions, device=ends["pos_embed.W_pos"].device)
        index = self.index.to(ends["embed.W_E"].device)
        self.streams = [embed(w, self.cfg, index) for w in self._weights(part, changes, rows)]

    def step(self, tensors: Mapping[str, torch.Tensor], layer: int, changes: Mapping[str, Change]) -> None:
        self.streams = [(block(w, layer, self.cfg, x, pos), pos)
                        for w, (x, pos) in zip(self._weights(tensors, changes), self.streams)]

    def finish(self, ends: Mapping[str, torch.Tensor], changes: Mapping[str, Change]) -> Comparison:
        part = {n: t for n, t in ends.items() if n.startswith(("ln_final.", "unembed."))}
        base, changed, nudged = (torch.log_softmax(unembed(w, self.cfg, x), dim=-1)
                                 for w, (x, _pos) in zip(self._weights(part, changes), self.streams))
        difference = (base - changed).abs()
        at = difference.argmax()
        sensitivity = float((nudged - changed).abs().max())
        return Comparison(
            max_abs_error=float(difference.reshape(-1)[at]),
            tolerance=logprob_tolerance(self.cfg, torch.float64, _largest_entry(base), sensitivity),
            where=tuple(int(i) for i in torch.unravel_index(at, difference.shape)),
        )


def judge_changes(changes: list[Change], rewrite: Mapping[str, torch.Tensor], cfg: Config,
                  tokens: torch.Tensor) -> Comparison | None:
    """The float64 comparison of the module for a model in memory: ``rewrite`` (the replay's
    end, config ``cfg``) against it with ``changes`` (``None`` when none is a change)."""
    far = {c.name: c for c in changes if not c.near}
    if not far:
        return None
    passes = ChangePasses(cfg, tokens)
    passes.start(rewrite, far)
    for layer in range(cfg.n_layers):
        prefix = f"blocks.{layer}."
        passes.step({n: t for n, t in rewrite.items() if n.startswith(prefix)}, layer, far)
    return passes.finish(rewrite, far)
