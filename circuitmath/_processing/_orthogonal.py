"""Orthogonal matrices for the rotations: drawn at random (Haar, or fixing the all-ones vector),
Hadamard's, a structured one the numeric checks apply cheaply, and their orthogonality error.

The structured ``Q`` (:class:`BlockOrthogonal`) is ``P B``, ``[d, d]``: ``P`` moves coordinate
``perm[j]`` to ``j`` (``(W P)[..., j] = W[..., perm[j]]``) and ``B`` is block-diagonal, one
orthogonal block of :data:`BLOCK` or more coordinates repeated down its diagonal. ``W Q`` and
``Q^T W`` cost ``O(W.numel() * BLOCK)`` instead of ``O(W.numel() * d)``: the numeric checks
rotate every writer and reader of a model by one (a dense ``Q`` makes each rotation of a
GPT-2-small-shaped model cost about three forward passes). :func:`~circuitmath.rotate_residual_stream`
takes it wherever it takes a dense ``Q``; :meth:`BlockOrthogonal.dense` is the same matrix as a tensor.

Why it is as sharp as a dense Haar ``Q`` for the checks: a rewrite is exact for every orthogonal
``Q`` (with ``Q 1 = ±1`` behind ``LNPre``) or it shows on a ``Q`` that does not commute with what
it got wrong. A writer left out shows on any ``Q`` but the identity, a reader not transposed on
any ``Q`` but a symmetric one (a random block is not).
A norm's gain ``diag(w)`` left unfolded commutes with ``Q`` only when ``Q_ij = 0`` wherever
``w_i != w_j``; every entry of the block is nonzero (checked when drawn), so ``Q`` mixes each set
of coordinates ``perm`` sends to one copy of the block, and commutes only when ``w`` is constant
on each such set. A gain value that a number of coordinates takes that is not a multiple of the
block's size (e.g. one coordinate's, or every gain distinct) is mixed with another value with
certainty; any other non-constant gain for all but a vanishing fraction of the permutations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "orthogonality_error", "random_orthogonal", "hadamard", "orthogonal_fixing_ones",
    "BlockOrthogonal", "block_orthogonal", "as_dense", "BLOCK",
]

#: The coordinates one block of a :class:`BlockOrthogonal` mixes, at least (all of them when
#: there are fewer).
BLOCK = 16

def orthogonality_error(Q: "torch.Tensor | BlockOrthogonal") -> float:
    """``max |Q^T Q - I|`` computed in float64 (a :class:`BlockOrthogonal`'s: its blocks')."""
    if isinstance(Q, BlockOrthogonal):
        return Q.orthogonality_error()
    Q = Q.double()
    return float((Q.T @ Q - torch.eye(Q.shape[0], dtype=torch.float64, device=Q.device)).abs().max())


def random_orthogonal(size: int, *, seed: int, dtype: torch.dtype = torch.float64, device="cpu") -> torch.Tensor:
    """A random orthogonal ``[size, size]`` matrix (Haar distributed), computed in float64 on the
    CPU (the same matrix for a seed whatever the device) and returned on ``device``: the QR factor
    of a Gaussian matrix, its columns' signs fixed by ``R``'s diagonal. A ``Q`` for
    :func:`rotate_residual_stream` (``size = d_model``).

    >>> import torch
    >>> Q = random_orthogonal(8, seed=0)
    >>> Q.shape, Q.dtype, bool(torch.allclose(Q.T @ Q, torch.eye(8, dtype=torch.float64)))
    (torch.Size([8, 8]), torch.float64, True)
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    gaussian = torch.randn(size, size, generator=generator, dtype=torch.float64, device="cpu")
    Q, R = torch.linalg.qr(gaussian)
    return (Q * torch.where(R.diagonal() < 0, -1.0, 1.0)).to(dtype=dtype, device=device)


def hadamard(size: int, *, dtype: torch.dtype = torch.float64, device="cpu") -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``size`` (a power of 2) divided by ``sqrt(size)``:
    orthogonal, symmetric, every entry ``±1/sqrt(size)`` (QuaRot's choice: it spreads every
    direction, an outlier dimension included, evenly over all dimensions). A ``Q`` for
    :func:`rotate_residual_stream` when ``d_model`` is a power of 2.

    >>> hadamard(4) * 2
    tensor([[ 1.,  1.,  1.,  1.],
            [ 1., -1.,  1., -1.],
            [ 1.,  1., -1., -1.],
            [ 1., -1., -1.,  1.]], dtype=torch.float64)
    """
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of 2, got {size}")
    H = torch.ones(1, 1, dtype=torch.float64, device=device)
    while H.shape[0] < size:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)])
    return (H / math.sqrt(size)).to(dtype)


def orthogonal_fixing_ones(size: int, *, seed: int, dtype: torch.dtype = torch.float64, device="cpu") -> torch.Tensor:
    """A random orthogonal ``Q`` with ``Q 1 = 1``: ``H diag(1, R) H`` with ``H`` the Householder
    reflection that swaps ``e_1`` and ``1 / sqrt(size)``, ``R`` random orthogonal of size
    ``size - 1``. It rotates the vectors orthogonal to ``1`` and leaves ``1`` alone, so it commutes
    with centering (``layer_norm_rotation``): the ``Q`` (``[size, size]``, ``size = d_model``)
    by which :func:`rotate_residual_stream` rotates an ``LNPre`` model; built on the CPU and
    returned on ``device``.

    >>> import torch
    >>> Q = orthogonal_fixing_ones(6, seed=0)
    >>> bool(torch.allclose(Q @ torch.ones(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)))
    True
    """
    v = torch.full((size,), 1 / math.sqrt(size), dtype=torch.float64, device="cpu")
    v[0] -= 1.0
    norm = float(v.norm())
    H = torch.eye(size, dtype=torch.float64, device="cpu") - (2 * torch.outer(v, v) / norm**2 if norm > 0 else 0)
    inner = torch.eye(size, dtype=torch.float64, device="cpu")
    if size > 1:
        inner[1:, 1:] = random_orthogonal(size - 1, seed=seed)
    return (H @ inner @ H).to(dtype=dtype, device=device)



@dataclass(frozen=True, eq=False)
class BlockOrthogonal:
    """``Q = P B`` (``[d, d]``, float64, see the module's docstring): ``perm`` ``[d]`` and
    ``block`` ``[b, b]``, ``B`` its ``d / b`` copies down the diagonal (one block serves: a
    product with it is one matrix product over every row, with no copy in between). Never
    changed once made."""

    perm: torch.Tensor
    block: torch.Tensor
    dtype = torch.float64

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.perm), len(self.perm)))

    def dense(self) -> torch.Tensor:
        """``Q`` as a ``[d, d]`` float64 tensor on the CPU."""
        B = torch.block_diag(*[self.block] * (len(self.perm) // len(self.block)))
        Q = torch.empty_like(B)
        Q[self.perm] = B
        return Q

    def times(self, W: torch.Tensor) -> torch.Tensor:
        """``W Q`` in float64 (``W`` ``[..., d]``), on ``W``'s device: ``W``'s columns gathered
        (in ``W``'s dtype: the fewest bytes), then each run of ``b`` times ``block``."""
        block = self.block.to(W.device)
        gathered = W.index_select(-1, self.perm.to(W.device)).double()
        return (gathered.reshape(-1, len(block)) @ block).reshape(W.shape)

    def transposed_times(self, W: torch.Tensor) -> torch.Tensor:
        """``Q^T W`` in float64 (``W`` ``[..., d, k]``): ``W``'s rows gathered, then ``block^T``
        times each run of ``b`` rows."""
        block = self.block.to(W.device)
        gathered = W.index_select(-2, self.perm.to(W.device)).double()
        runs = gathered.reshape(*W.shape[:-2], W.shape[-2] // len(block), len(block), W.shape[-1])
        return (block.T @ runs).reshape(W.shape)

    def image_of_ones(self) -> torch.Tensor:
        """``Q 1`` (``[d]``, float64): ``(Q 1)[perm[j]] = (B 1)[j]``."""
        image = torch.empty(len(self.perm), dtype=torch.float64, device=self.perm.device)
        image[self.perm] = self.block.sum(-1).repeat(len(self.perm) // len(self.block))
        return image

    def orthogonality_error(self) -> float:
        """``max |Q^T Q - I|``, that of ``block``: ``P`` is exact."""
        return float((self.block.T @ self.block - torch.eye(len(self.block), dtype=torch.float64, device=self.block.device)).abs().max())


def block_orthogonal(size: int, *, seed: int, fixing_ones: bool = False) -> BlockOrthogonal:
    """A random :class:`BlockOrthogonal` of ``size`` coordinates: a random permutation and one
    orthogonal block (:func:`random_orthogonal`, or with ``fixing_ones``
    :func:`orthogonal_fixing_ones`: then ``Q 1 = 1``) of the smallest divisor of ``size`` that is
    at least :data:`BLOCK` (``size`` itself where none is smaller), drawn again (the next seed)
    while a block of more than two coordinates has a zero entry (see the module's docstring).

    >>> Q = block_orthogonal(40, seed=0, fixing_ones=True)
    >>> dense, ones = Q.dense(), torch.ones(40, dtype=torch.float64)
    >>> len(Q.block), bool(torch.allclose(dense.T @ dense, torch.eye(40, dtype=torch.float64)))
    (20, True)
    >>> bool(torch.allclose(dense @ ones, ones))
    True
    """
    b = next(b for b in range(min(BLOCK, size), size + 1) if size % b == 0)
    draw = orthogonal_fixing_ones if fixing_ones else random_orthogonal
    for attempt in range(seed, seed + 100):
        generator = torch.Generator(device="cpu").manual_seed(attempt)
        perm = torch.randperm(size, generator=generator, device="cpu")
        block = draw(b, seed=int(torch.randint(0, 2**31 - 1, (), generator=generator, device="cpu")))
        if b <= 2 or bool((block != 0).all()):
            break
    return BlockOrthogonal(perm, block)


def as_dense(Q: "torch.Tensor | BlockOrthogonal") -> torch.Tensor:
    """``Q`` as a ``[d, d]`` float64 tensor on the CPU (a :class:`BlockOrthogonal`'s dense form)."""
    return Q.dense() if isinstance(Q, BlockOrthogonal) else Q.double().cpu()
