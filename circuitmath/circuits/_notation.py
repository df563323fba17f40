"""The tensor-product notation: ``vec`` and ``A ⊗ W`` acting on ``[pos, d]`` matrices."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["vec", "TensorProduct"]


def vec(x: torch.Tensor) -> torch.Tensor:
    """Row-major vectorisation of the last two axes: ``[..., n, d]`` to ``[..., n * d]``.

    Entry ``(i, k)`` lands at ``i * d + k``, the order in which :meth:`TensorProduct.kron`
    (``torch.kron``) numbers rows and columns.
    """
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


@dataclass(frozen=True)
class TensorProduct:
    """The operator ``positions ⊗ features`` of the framework: ``(A ⊗ B)·x = A x B^T``.

    ``positions: [n_out, n_in]`` mixes positions (an attention pattern, the identity);
    ``features: [d_out, d_in]`` mixes features (a weight matrix in the paper's column
    convention, e.g. ``W_OV.T`` for a TransformerLens ``W_OV``). Both may carry leading batch
    axes that broadcast.

    >>> import torch
    >>> A, B, x = torch.randn(3, 3), torch.randn(4, 4), torch.randn(3, 4)
    >>> bool(torch.allclose(TensorProduct(A, B).apply(x), A @ x @ B.T))
    True
    >>> bool(torch.allclose(TensorProduct(A, B).kron() @ vec(x), vec(A @ x @ B.T), atol=1e-5))
    True
    """

    positions: torch.Tensor
    features: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``A x B^T`` for ``x: [..., n_in, d_in]``; returns ``[..., n_out, d_out]``."""
        return self.positions @ x @ self.features.transpose(-1, -2)

    def __matmul__(self, other: "TensorProduct") -> "TensorProduct":
        """The mixed product ``(A ⊗ B)(C ⊗ D) = AC ⊗ BD``: apply ``other`` first, then ``self``."""
        if not isinstance(other, TensorProduct):
            return NotImplemented
        return TensorProduct(self.positions @ other.positions, self.features @ other.features)

    @property
    def T(self) -> "TensorProduct":
        """``(A ⊗ B)^T = A^T ⊗ B^T``."""
        return TensorProduct(self.positions.transpose(-1, -2), self.features.transpose(-1, -2))

    def kron(self, rows: slice = slice(None)) -> torch.Tensor:
        """The Kronecker matrix ``[..., n_out * d_out, n_in * d_in]`` acting on :func:`vec` ``(x)``:
        entry ``(i d_out + k, j d_in + l)`` is ``A[i, j] B[k, l]`` (``torch.kron`` without batch axes).

        ``rows``: only the rows of the output positions ``i`` in this slice (``[..., len(rows) *
        d_out, n_in * d_in]``), so that a long sequence's matrix can be applied a block at a time.

        >>> import torch
        >>> A, B = torch.randn(3, 3), torch.randn(2, 2)
        >>> bool(torch.equal(TensorProduct(A, B).kron(slice(1, 3)), torch.kron(A, B)[2:6]))
        True
        """
        P, F = self.positions[..., rows, :].contiguous(), self.features.contiguous()  # a contiguous product: reshaped without a copy
        product = P[..., :, None, :, None] * F[..., None, :, None, :]
        batch = product.shape[:-4]
        return product.reshape(*batch, P.shape[-2] * F.shape[-2], P.shape[-1] * F.shape[-1])
