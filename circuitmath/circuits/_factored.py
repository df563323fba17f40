"""Low-rank matrices kept as factors: ``A @ B`` without forming it."""

from __future__ import annotations

import torch

from .._errors import InputError

__all__ = ["FactoredMatrix"]


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


class FactoredMatrix:
    """A matrix kept as the product of its factors, ``left @ right``, never materialised.

    ``left: [..., m, k]`` and ``right: [..., k, n]`` (leading axes broadcast, e.g. ``[n_layers,
    n_heads]``) stand for ``left @ right: [..., m, n]``, whose rank is at most ``k``. Everything
    below is computed from the factors, at a cost linear in ``m`` and ``n``:

    - :attr:`BA` ``[..., k, k]``, whose eigenvalues are the nonzero eigenvalues of ``AB``;
    - :meth:`svd` from the QR decompositions of ``left`` and ``right^T`` and the SVD of a
      ``k x k`` core (identity ``factored_svd``);
    - :meth:`norm` (Frobenius), :meth:`eigenvalues`, :meth:`singular_values`, :meth:`rank`.

    >>> import torch
    >>> A, B = torch.randn(6, 2, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    >>> M = FactoredMatrix(A, B)
    >>> M.shape, int(M.rank())
    ((6, 6), 2)
    >>> bool(torch.allclose(M.norm(), torch.linalg.matrix_norm(A @ B)))
    True
    """

    def __init__(self, left: torch.Tensor, right: torch.Tensor):
        if left.ndim < 2 or right.ndim < 2:
            raise InputError(f"factors need at least two axes, got {tuple(left.shape)} and {tuple(right.shape)}")
        if left.shape[-1] != right.shape[-2]:
            raise InputError(
                f"inner sizes differ: left is {tuple(left.shape)}, right is {tuple(right.shape)}"
            )
        self.left = left
        self.right = right

    @property
    def shape(self) -> tuple[int, ...]:
        """``(*batch, m, n)``, the shape of ``left @ right``."""
        batch = torch.broadcast_shapes(self.left.shape[:-2], self.right.shape[:-2])
        return (*batch, self.left.shape[-2], self.right.shape[-1])

    @property
    def inner(self) -> int:
        """``k``, the inner size: a bound on the rank."""
        return self.left.shape[-1]

    @property
    def AB(self) -> torch.Tensor:
        """The materialised product ``[..., m, n]``."""
        return self.left @ self.right

    @property
    def BA(self) -> torch.Tensor:
        """``right @ left: [..., k, k]`` (needs ``m == n``)."""
        return self.right @ self.left

    @property
    def T(self) -> "FactoredMatrix":
        """``(AB)^T = B^T A^T``, still factored."""
        return FactoredMatrix(_t(self.right), _t(self.left))

    def __matmul__(self, other) -> "FactoredMatrix":
        """``(AB) @ other``: a tensor ``[..., n, p]`` joins the right factor; a factored matrix
        ``CD`` gives ``A ((B C) D)``, keeping this inner size."""
        if isinstance(other, FactoredMatrix):
            return FactoredMatrix(self.left, (self.right @ other.left) @ other.right)
        if isinstance(other, torch.Tensor):
            return FactoredMatrix(self.left, self.right @ other)
        return NotImplemented

    def __rmatmul__(self, other) -> "FactoredMatrix":
        """``other @ (AB)`` for a tensor ``[..., p, m]``: it joins the left factor."""
        if isinstance(other, torch.Tensor):
            return FactoredMatrix(other @ self.left, self.right)
        return NotImplemented

    def __getitem__(self, index) -> "FactoredMatrix":
        """Index the leading (batch) axes: ``ov_circuits(sd, cfg)[layer, head]``."""
        batch = self.shape[:-2]
        if not batch:
            raise IndexError("a FactoredMatrix without batch axes cannot be indexed")
        left = self.left.expand(*batch, *self.left.shape[-2:])
        right = self.right.expand(*batch, *self.right.shape[-2:])
        return FactoredMatrix(left[index], right[index])

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={self.shape}, inner={self.inner})"

    def _cores(self):
        """``left = Q_L R_L``, ``right^T = Q_R R_R`` and the core ``R_L R_R^T``."""
        q_left, r_left = torch.linalg.qr(self.left)
        q_right, r_right = torch.linalg.qr(_t(self.right))
        return q_left, q_right, r_left @ _t(r_right)

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``U [..., m, r]``, ``S [..., r]`` (descending), ``Vh [..., r, n]`` with ``r = min(m, n, k)``.

        ``AB = Q_L (R_L R_R^T) Q_R^T`` and the core is ``r x r`` at most, so only its SVD is
        computed: ``U = Q_L U_core``, ``Vh = Vh_core Q_R^T``.
        """
        q_left, q_right, core = self._cores()
        u, s, vh = torch.linalg.svd(core, full_matrices=False)
        return q_left @ u, s, vh @ _t(q_right)

    def singular_values(self) -> torch.Tensor:
        """``[..., r]``, descending, from the core (see :meth:`svd`)."""
        return torch.linalg.svdvals(self._cores()[2])

    def norm(self) -> torch.Tensor:
        """Frobenius norm ``[...]``: that of the core, since ``Q_L`` and ``Q_R`` are orthonormal."""
        return torch.linalg.matrix_norm(self._cores()[2])

    def rank(self, rtol: float | None = None) -> torch.Tensor:
        """Numerical rank ``[...]``: singular values above ``rtol * S_max`` (default: ``k`` eps)."""
        s = self.singular_values()
        if rtol is None:
            rtol = max(self.shape[-2:]) * torch.finfo(s.dtype).eps
        return (s > rtol * s[..., :1]).sum(dim=-1)

    def eigenvalues(self) -> torch.Tensor:
        """Complex ``[..., min(m, k)]``: every nonzero eigenvalue of ``AB``, padded with zeros.

        The nonzero eigenvalues of ``AB`` and ``BA`` coincide (identity ``eigenvalues_ab_ba``),
        so the smaller of the two is decomposed.
        """
        m, n = self.shape[-2:]
        if m != n:
            raise InputError(f"eigenvalues need a square product, this one is {m} x {n}")
        return torch.linalg.eigvals(self.BA if self.inner <= m else self.AB)
