"""A forward pass of a checkpoint a block at a time, for the streamed checks.

:class:`ForwardPass` runs the reference forward pass (:mod:`circuitmath._reference`) on the
check tokens one part at a time, keeping only the tokens' activations; each weight is converted
to the pass's dtype as it is read (and, for the nudged pass of
:func:`~circuitmath.testing.rounding_sensitivity`, nudged as there), so no part is held twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ._compare import _computation_roundoff, _rounded_centering, named_generator
from ._config import Config
from ._reference import block, embed, unembed

__all__ = ["ForwardPass", "UNEMBED_COLUMNS"]


class _Weights(Mapping):
    """A part's tensors as one forward pass reads them: converted to ``dtype`` when looked up
    (nothing kept), and with ``nudge`` each multiplied by ``1 + nudge * xi``, ``xi`` standard
    normal drawn from a generator seeded by the name (as :func:`rounding_sensitivity` nudges,
    one tensor at a time)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, nudge: float = 0.0,
                 seeds: Mapping[str, int] | None = None, scratch: list | None = None,
                 device: torch.device | None = None):
        self.tensors, self.dtype, self.nudge, self.seeds, self.device = tensors, dtype, nudge, seeds or {}, device
        self.scratch = [torch.empty(0, device="cpu")] if scratch is None else scratch  # memory for the noise, reused

    def _noise(self, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
        count = math.prod(shape)
        if self.scratch[0].numel() < count:
            self.scratch[0] = torch.empty(count, device="cpu")
        return torch.randn(shape, generator=g, out=self.scratch[0][:count].view(shape))

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        converted = tensor.to(device=self.device, dtype=self.dtype)
        if not self.nudge:
            return converted
        g = named_generator(name, self.seeds.get(name, 0))
        # in place, without float32 and float64 temporaries of the tensor (the same numbers: a
        # half-precision factor is converted to float32 exactly inside the product)
        # drawn on the CPU (the same noise on every device), then moved: no copy on the CPU
        change = self._noise(tensor.shape, g).to(converted.device).mul_(self.nudge)
        change.mul_((tensor if torch.finfo(tensor.dtype).bits <= 32 else tensor.float()).to(converted.device))
        return converted.add_(change) if converted is not tensor else converted + change

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


#: Vocabulary entries per slice of the unembedding: each slice of ``W_U`` is converted to
#: float64 on its own (a 7B model's whole ``W_U`` in float64 is 1 GiB).
UNEMBED_COLUMNS = 4096


@dataclass
class ForwardPass:
    """One forward pass of a checkpoint on the check tokens, block by block: weights read in
    ``dtype``, activations of the tokens kept. With ``nudge``, the nudged pass of
    :func:`~circuitmath.testing.rounding_sensitivity`: weights nudged by ``nudge`` and the
    LayerNorms' means rounded apart as there (the same signs: they are seeded by the norms' names)."""

    dtype: torch.dtype
    nudge: float = 0.0
    device: torch.device | None = None
    x: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    scratch: list = field(default_factory=lambda: [torch.empty(0, device="cpu")])

    @property
    def centering(self):
        return _rounded_centering(_computation_roundoff(self.nudge)) if self.nudge else None

    def weights(self, tensors) -> _Weights:
        return _Weights(tensors, self.dtype, self.nudge, scratch=self.scratch, device=self.device)

    def start(self, ends: Mapping[str, torch.Tensor], cfg: Config, tokens: torch.Tensor) -> None:
        # Only the rows of W_E the tokens use are read and converted.
        used, inverse = torch.unique(tokens, return_inverse=True)
        params = dict(ends, **{"embed.W_E": ends["embed.W_E"][used]})
        self.x, pos = embed(self.weights(params), cfg, inverse.to(self.device), centering=self.centering)
        self.pos = None if pos is None else pos.clone()  # not a view that keeps the ends' W_pos

    def step(self, tensors: Mapping[str, torch.Tensor], layer: int, cfg: Config) -> None:
        self.x = block(self.weights(tensors), layer, cfg, self.x, self.pos, centering=self.centering)

    def log_probs(self, ends: Mapping[str, torch.Tensor], cfg: Config) -> torch.Tensor:
        logits = []
        for start in range(0, cfg.d_vocab, UNEMBED_COLUMNS):
            columns = slice(start, start + UNEMBED_COLUMNS)
            params = dict(ends, **{"unembed.W_U": ends["unembed.W_U"][:, columns], "unembed.b_U": ends["unembed.b_U"][columns]})
            weights = _Weights(params, self.dtype, self.nudge, seeds={"unembed.W_U": start, "unembed.b_U": start},
                               scratch=self.scratch, device=self.device)
            logits.append(unembed(weights, cfg, self.x, centering=self.centering))
        return torch.log_softmax(torch.cat(logits, dim=-1), dim=-1)
