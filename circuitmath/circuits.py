"""Circuits of a transformer: the quantities of "A Mathematical Framework for Transformer Circuits".

Conventions. Everything here is in TransformerLens's row convention: a residual stream is a
tensor ``x: [..., pos, d_model]`` read by ``x @ W``. The framework writes columns, ``W x``; the
two are transposes of each other, and the identity ``row_column_convention`` proves the
translation once:

- ``W_OV = W_V @ W_O`` here (``[d_model, d_model]``) is the transpose of the paper's
  ``W_O W_V``; a head's output is ``A @ x @ W_OV``, the paper's ``(A ⊗ W_O W_V)·x``;
- ``W_QK = W_Q @ W_K.T`` here is the paper's ``W_Q^T W_K`` (a bilinear form: scores
  ``x_i W_QK x_j^T``, before the ``1/sqrt(d_head)`` scale and the biases);
- the bigram table ``W_E @ W_U`` (``[d_vocab, d_vocab]``) is the transpose of the paper's
  ``W_U W_E``.

Circuits are read off the weights as they are. Fold the LayerNorm first
(:func:`circuitmath.fold_layer_norm`) to include its gains; biases are not part of a circuit.
Grouped-query keys and values are repeated to one per query head.

The path expansion (:func:`path_terms`) is exact once the attention patterns and the norms'
scales are fixed at the values a forward pass computed: every other operation is linear.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ._config import Config
from ._errors import PreconditionError
from ._reference import _project, _rotate, check_tokens, forward
from ._state import StateDict, attention_names, validate_state_dict

__all__ = [
    "TensorProduct",
    "vec",
    "FactoredMatrix",
    "ov_circuits",
    "qk_circuits",
    "full_ov_circuits",
    "bigram_table",
    "attention_patterns",
    "Path",
    "path_terms",
    "score_terms",
    "virtual_weights",
    "composition_scores",
    "copying_scores",
]


# ---------------------------------------------------------------------------------------------
# The tensor-product notation


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

    def kron(self) -> torch.Tensor:
        """The Kronecker matrix ``[..., n_out * d_out, n_in * d_in]`` acting on :func:`vec` ``(x)``:
        entry ``(i d_out + k, j d_in + l)`` is ``A[i, j] B[k, l]`` (``torch.kron`` without batch axes)."""
        P, F = self.positions, self.features
        product = P[..., :, None, :, None] * F[..., None, :, None, :]
        batch = product.shape[:-4]
        return product.reshape(*batch, P.shape[-2] * F.shape[-2], P.shape[-1] * F.shape[-1])


# ---------------------------------------------------------------------------------------------
# Factored matrices


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
            raise ValueError(f"factors need at least two axes, got {tuple(left.shape)} and {tuple(right.shape)}")
        if left.shape[-1] != right.shape[-2]:
            raise ValueError(
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
            raise ValueError(f"eigenvalues need a square product, this one is {m} x {n}")
        return torch.linalg.eigvals(self.BA if self.inner <= m else self.AB)


# ---------------------------------------------------------------------------------------------
# Circuits of a model


def _per_head(state_dict: StateDict, cfg: Config, name: str) -> torch.Tensor:
    """``W_name`` of every layer, one per query head: ``[n_layers, n_heads, d_model, d_head]``."""
    weight, _bias, heads = attention_names(cfg, name)
    stacked = torch.stack([state_dict[f"blocks.{l}.attn.{weight}"] for l in range(cfg.n_layers)])
    return stacked.repeat_interleave(cfg.n_heads // heads, dim=1) if heads != cfg.n_heads else stacked


def _layer_weight(state_dict: StateDict, cfg: Config, layer: int, name: str) -> torch.Tensor:
    """``W_name`` of one layer, one per query head: ``[n_heads, d_model, d_head]``."""
    weight, _bias, heads = attention_names(cfg, name)
    W = state_dict[f"blocks.{layer}.attn.{weight}"]
    return W.repeat_interleave(cfg.n_heads // heads, dim=0) if heads != cfg.n_heads else W


def _layer_bias(state_dict: StateDict, cfg: Config, layer: int, name: str) -> torch.Tensor:
    """``b_name`` of one layer, one per query head: ``[n_heads, d_head]``."""
    _weight, bias, heads = attention_names(cfg, name)
    b = state_dict[f"blocks.{layer}.attn.{bias}"]
    return b.repeat_interleave(cfg.n_heads // heads, dim=0) if heads != cfg.n_heads else b


def _require_attention(cfg: Config, identity: str) -> None:
    if cfg.n_layers == 0:
        raise PreconditionError(identity, "the model has attention layers", "n_layers is 0")


def _require_position_free_scores(cfg: Config, identity: str) -> None:
    if cfg.positional_embedding_type == "rotary":
        raise PreconditionError(
            identity, "one QK matrix per head",
            "with rotary embeddings the score of query i and key j is x_i W_Q R_(j-i) W_K^T x_j^T:"
            " it depends on the offset j - i, so there is no single W_QK",
        )


def ov_circuits(state_dict: StateDict, cfg: Config) -> FactoredMatrix:
    """Every head's ``W_OV = W_V @ W_O`` as a :class:`FactoredMatrix` ``[n_layers, n_heads, d_model, d_model]``.

    Factors ``W_V: [n_layers, n_heads, d_model, d_head]`` and ``W_O: [n_layers, n_heads,
    d_head, d_model]``. The paper's ``W_O W_V`` is its transpose (``.T``).
    """
    validate_state_dict(state_dict, cfg)
    _require_attention(cfg, "attention_head_tensor_form")
    W_O = torch.stack([state_dict[f"blocks.{l}.attn.W_O"] for l in range(cfg.n_layers)])
    return FactoredMatrix(_per_head(state_dict, cfg, "V"), W_O)


def qk_circuits(state_dict: StateDict, cfg: Config) -> FactoredMatrix:
    """Every head's ``W_QK = W_Q @ W_K^T`` as a :class:`FactoredMatrix` ``[n_layers, n_heads, d_model, d_model]``.

    The attention score of query ``x_i`` and key ``x_j`` (rows ``[d_model]``) is ``x_i W_QK
    x_j^T / sqrt(d_head)`` plus bias terms; the paper's ``W_Q^T W_K`` is the same matrix.
    Refused for rotary models, whose scores depend on the offset between positions.
    """
    validate_state_dict(state_dict, cfg)
    _require_attention(cfg, "qk_reparametrisation")
    _require_position_free_scores(cfg, "qk_reparametrisation")
    return FactoredMatrix(_per_head(state_dict, cfg, "Q"), _t(_per_head(state_dict, cfg, "K")))


def full_ov_circuits(state_dict: StateDict, cfg: Config) -> FactoredMatrix:
    """``W_E @ W_OV @ W_U`` per head, factored as ``(W_E W_V)(W_O W_U)``: ``[n_layers, n_heads, d_vocab, d_vocab]``.

    Row ``a`` holds the logits head ``(layer, head)`` adds when it attends to token ``a``
    (through this path alone, norms ignored). The paper's ``W_U W_OV W_E`` is its transpose.
    Inner size ``d_head``.
    """
    ov = ov_circuits(state_dict, cfg)
    return FactoredMatrix(state_dict["embed.W_E"] @ ov.left, ov.right @ state_dict["unembed.W_U"])


def bigram_table(state_dict: StateDict, cfg: Config) -> torch.Tensor:
    """``W_E @ W_U: [d_vocab, d_vocab]``, the zero-layer transformer ``T = (Id ⊗ W_U W_E)·t``.

    Row ``a`` is the logits a token ``a`` predicts through the direct path. Without a norm and
    positional embeddings a zero-layer model's logits are exactly ``bigram_table[tokens] + b_U``
    (identity ``zero_layer_bigram``).
    """
    validate_state_dict(state_dict, cfg)
    return state_dict["embed.W_E"] @ state_dict["unembed.W_U"]


def virtual_weights(writer: torch.Tensor, reader: torch.Tensor) -> torch.Tensor:
    """The virtual weights ``writer @ reader`` between a layer that writes to the residual stream
    and a later one that reads it (the paper's ``W_I^B W_O^A``, transposed).

    ``writer: [*w, a, d_model]`` (``W_O: [n_heads, d_head, d_model]``, ``W_out``, ``W_E``) and
    ``reader: [*r, d_model, b]`` (``W_Q``, ``W_K``, ``W_V: [n_heads, d_model, d_head]``,
    ``W_in``, ``W_U``); every batch of one meets every batch of the other:
    returns ``[*w, *r, a, b]``. The reader sees ``x @ reader`` where ``x`` is the sum of all
    earlier writes, so a write ``r @ writer`` reaches it as ``r @ virtual_weights(writer, reader)``
    (identity ``virtual_weights``).
    """
    if writer.shape[-1] != reader.shape[-2]:
        raise ValueError(
            f"the writer's output axis ({writer.shape[-1]}) is not the reader's input axis"
            f" ({reader.shape[-2]}): pass W_O-like [..., a, d_model] and W_V-like [..., d_model, b]"
        )
    w_batch, r_batch = writer.shape[:-2], reader.shape[:-2]
    w = writer.reshape(*w_batch, *([1] * len(r_batch)), *writer.shape[-2:])
    return w @ reader


# ---------------------------------------------------------------------------------------------
# Composition scores and the eigenvalue copying score

KINDS = ("q", "k", "v")


def _r_factor(x: torch.Tensor) -> torch.Tensor:
    """``R`` of the reduced QR decomposition of ``x: [..., d, e]``: ``[..., min(d, e), e]``."""
    return torch.linalg.qr(x, mode="r")[1]


def _reader_factors(state_dict: StateDict, cfg: Config, kind: str) -> torch.Tensor:
    """A ``[n_layers, n_heads, d_model, d_head]`` factor with the reader's Frobenius geometry.

    For a reader ``M = X Y^T`` (``X, Y: [d_model, d_head]``), ``X R_Y^T`` where ``Y = Q_Y R_Y``:
    ``|N M|_F = |N X R_Y^T|_F`` for every ``N``, because ``Q_Y`` has orthonormal columns.
    """
    if kind == "q":  # W_QK = W_Q W_K^T
        return _per_head(state_dict, cfg, "Q") @ _t(_r_factor(_per_head(state_dict, cfg, "K")))
    if kind == "k":  # W_QK^T = W_K W_Q^T
        return _per_head(state_dict, cfg, "K") @ _t(_r_factor(_per_head(state_dict, cfg, "Q")))
    W_O = torch.stack([state_dict[f"blocks.{l}.attn.W_O"] for l in range(cfg.n_layers)])
    return _per_head(state_dict, cfg, "V") @ _t(_r_factor(_t(W_O)))  # W_OV = W_V W_O


def composition_scores(state_dict: StateDict, cfg: Config, kinds: Iterable[str] = KINDS) -> dict[str, torch.Tensor]:
    """Q-, K- and V-composition scores of every pair of heads, computed from the factors.

    Returns ``{kind: [n_layers, n_heads, n_layers, n_heads]}``; entry ``[l1, h1, l2, h2]`` is the
    score of the earlier head ``(l1, h1)`` writing into the later head ``(l2, h2)`` and is NaN
    unless ``l1 < l2``:

    - ``"q"``: ``|W_OV^1 W_QK^2|_F / (|W_OV^1|_F |W_QK^2|_F)`` (the paper's ``W_QK^T W_OV``);
    - ``"k"``: ``|W_OV^1 (W_QK^2)^T|_F / (...)`` (the paper's ``W_QK W_OV``);
    - ``"v"``: ``|W_OV^1 W_OV^2|_F / (...)`` (the paper's ``W_OV^2 W_OV^1``).

    Each score lies in ``[0, 1]`` and is unchanged by rescaling either head and by the
    reparametrisations that leave ``W_OV`` and ``W_QK`` unchanged. Cost: one QR per head and one
    ``[n_heads d_head, d_model] @ [d_model, n_heads d_head]`` product per pair of layers, never a
    ``d_model x d_model`` matrix (identity ``composition_scores_from_factors``). Q and K
    composition are refused for rotary models (see :func:`qk_circuits`).
    """
    validate_state_dict(state_dict, cfg)
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown composition kinds {unknown}; choose among {KINDS}")
    _require_attention(cfg, "composition_scores_from_factors")
    if {"q", "k"} & set(kinds):
        _require_position_free_scores(cfg, "composition_scores_from_factors")
    L, H = cfg.n_layers, cfg.n_heads
    W_O = torch.stack([state_dict[f"blocks.{l}.attn.W_O"] for l in range(L)])
    writers = _r_factor(_per_head(state_dict, cfg, "V")) @ W_O  # [L, H, r, d]: |.|_F = |W_OV|_F
    writer_norms = torch.linalg.matrix_norm(writers)
    rank = writers.shape[-2]  # d_head, or d_model if smaller
    scores = {}
    for kind in kinds:
        readers = _reader_factors(state_dict, cfg, kind)  # [L, H, d, r]
        reader_norms = torch.linalg.matrix_norm(readers)
        out = torch.full((L, H, L, H), float("nan"), dtype=writers.dtype)
        for l1 in range(L - 1):
            later = readers[l1 + 1 :]  # [L', H, d, r]
            wide = later.permute(2, 0, 1, 3).reshape(cfg.d_model, -1)  # [d, L' H r]
            products = writers[l1].reshape(H * rank, cfg.d_model) @ wide  # [H r, L' H r]
            squared = products.reshape(H, rank, L - l1 - 1, H, -1).pow(2).sum(dim=(1, 4))  # [H, L', H]
            norms = writer_norms[l1][:, None, None] * reader_norms[l1 + 1 :][None]
            out[l1, :, l1 + 1 :, :] = squared.sqrt() / norms
        scores[kind] = out
    return scores


def copying_scores(state_dict: StateDict, cfg: Config) -> torch.Tensor:
    """The eigenvalue copying score of every head: ``[n_layers, n_heads]``, each in ``[-1, 1]``.

    ``sum(λ) / sum(|λ|)`` (real; complex eigenvalues come in conjugate pairs) over the
    eigenvalues ``λ`` of the full OV circuit ``W_E W_OV W_U`` (:func:`full_ov_circuits`),
    computed from the ``d_head x d_head`` matrix ``W_O W_U W_E W_V``: its eigenvalues are the
    nonzero ones of the ``d_vocab x d_vocab`` circuit (identity ``eigenvalues_ab_ba``). Near 1:
    the head copies the token it attends to; near -1: it suppresses it. Unchanged by positive
    rescaling of the head and by reparametrisations of its ``d_head`` space (identity
    ``copying_score_invariance``); a head with a zero circuit scores NaN.
    """
    eigenvalues = full_ov_circuits(state_dict, cfg).eigenvalues()
    return eigenvalues.sum(dim=-1).real / eigenvalues.abs().sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Attention patterns and the path expansion of attention-only models


#: Positional embeddings the path expansion knows: ``standard`` writes ``W_pos`` into the stream
#: (a path source of its own); the others act on queries and keys only, inside the frozen patterns.
POSITIONS = ("standard", "rotary", "shortformer", "shortformer_tables")


def _require_path_model(cfg: Config, identity: str) -> None:
    problems = []
    if not cfg.attn_only:
        problems.append(("attention-only", "the model has MLPs, which are not linear in the residual stream"))
    if cfg.norm_position != "pre":
        problems.append(("pre-norm", "a post-norm model normalises the residual stream itself"))
    if cfg.positional_embedding_type not in POSITIONS:
        problems.append(("known positional embedding", f"positional_embedding_type is {cfg.positional_embedding_type!r}"))
    if problems:
        precondition, detail = problems[0]
        raise PreconditionError(identity, precondition, detail)


@dataclass(frozen=True)
class _Norm:
    """A norm with its scale frozen: ``N(x) = s * (x P) * w + b`` with ``P`` centring or not."""

    kind: str | None
    scale: torch.Tensor | None  # [batch, pos, 1]
    w: torch.Tensor | None
    b: torch.Tensor | None

    @classmethod
    def freeze(cls, state_dict: StateDict, cfg: Config, prefix: str, x: torch.Tensor) -> "_Norm":
        kind = cfg.normalization_type
        if kind is None:
            return cls(None, None, None, None)
        centred = x - x.mean(dim=-1, keepdim=True) if kind in ("LN", "LNPre") else x
        scale = 1 / torch.sqrt(centred.pow(2).mean(dim=-1, keepdim=True) + cfg.eps)
        return cls(kind, scale, state_dict.get(f"{prefix}.w"), state_dict.get(f"{prefix}.b"))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The linear part, applied to one term of the residual stream."""
        if self.kind is None:
            return x
        if self.kind in ("LN", "LNPre"):
            x = x - x.mean(dim=-1, keepdim=True)
        x = x * self.scale
        return x * self.w if self.kind in ("LN", "RMS") else x

    def constant(self, like: torch.Tensor) -> torch.Tensor:
        """The constant part ``b`` (zero unless LN), broadcast to ``like``."""
        return (self.b if self.kind == "LN" else torch.zeros(())).to(like.dtype).expand_as(like)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.constant(x)


def _pattern(state_dict: StateDict, cfg: Config, layer: int, qk_in: torch.Tensor) -> torch.Tensor:
    """Attention pattern ``[batch, n_heads, query, key]`` of one layer, as the reference computes it."""
    p = f"blocks.{layer}.attn"
    q, k = _project(state_dict, p, cfg, "Q", qk_in), _project(state_dict, p, cfg, "K", qk_in)
    if cfg.positional_embedding_type == "rotary":
        q, k = _rotate(q, cfg), _rotate(k, cfg)
    return _softmax_scores(torch.einsum("bqhe,bkhe->bhqk", q, k), cfg)


def _softmax_scores(scores: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Scale by ``1/sqrt(d_head)``, mask the future (causal models) and softmax over keys."""
    scores = scores / math.sqrt(cfg.d_head)
    if cfg.causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1), float("-inf"))
    return torch.softmax(scores, dim=-1)


def _embed(state_dict: StateDict, cfg: Config, tokens: torch.Tensor) -> dict["Path", torch.Tensor]:
    terms = {Path("embed"): state_dict["embed.W_E"][tokens]}
    if cfg.positional_embedding_type == "standard":
        pos = state_dict["pos_embed.W_pos"][: tokens.shape[1]]
        terms[Path("pos")] = pos.expand_as(terms[Path("embed")])
    return terms


@dataclass(frozen=True)
class _Run:
    """A forward pass of an attention-only model, with what the path expansion freezes."""

    patterns: tuple[torch.Tensor, ...]  # per layer [batch, n_heads, pos, pos]
    norms: tuple[_Norm, ...]  # ln1 of every layer, then ln_final
    inputs: tuple[torch.Tensor, ...]  # residual stream entering every layer, then ln_final


def _run(state_dict: StateDict, cfg: Config, tokens: torch.Tensor, identity: str) -> _Run:
    validate_state_dict(state_dict, cfg)
    _require_path_model(cfg, identity)
    tokens = check_tokens(cfg, tokens)
    x = sum(_embed(state_dict, cfg, tokens).values())
    patterns, norms, inputs = [], [], []
    for layer in range(cfg.n_layers):
        norm = _Norm.freeze(state_dict, cfg, f"blocks.{layer}.ln1", x)
        normed = norm(x)
        qk_in = normed + state_dict["pos_embed.W_pos"][: tokens.shape[1]] if cfg.positional_embedding_type == "shortformer" else normed
        pattern = _pattern(state_dict, cfg, layer, qk_in)
        patterns.append(pattern)
        norms.append(norm)
        inputs.append(x)
        x = x + _head_outputs(state_dict, cfg, layer, pattern, normed).sum(dim=2) + state_dict[f"blocks.{layer}.attn.b_O"]
    norms.append(_Norm.freeze(state_dict, cfg, "ln_final", x))
    inputs.append(x)
    return _Run(tuple(patterns), tuple(norms), tuple(inputs))


def _head_outputs(state_dict, cfg, layer, pattern, normed, with_bias: bool = True) -> torch.Tensor:
    """``A^h (normed W_V^h + b_V^h) W_O^h`` for every head: ``[batch, pos, n_heads, d_model]``."""
    v = torch.einsum("bpd,hde->bphe", normed, _layer_weight(state_dict, cfg, layer, "V"))
    if with_bias:
        v = v + _layer_bias(state_dict, cfg, layer, "V")
    z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
    return torch.einsum("bqhe,hed->bqhd", z, state_dict[f"blocks.{layer}.attn.W_O"])


def attention_patterns(state_dict: StateDict, cfg: Config, tokens: torch.Tensor) -> torch.Tensor:
    """The attention patterns of a forward pass: ``[n_layers, batch, n_heads, query, key]``.

    Recorded by the reference forward pass (:func:`circuitmath.forward`), for any model it
    runs; rows sum to 1 and causal models put zero weight on future keys.
    """
    record: dict = {}
    forward(state_dict, cfg, tokens, record=record)
    return torch.stack(record["patterns"])


@dataclass(frozen=True, order=True)
class Path:
    """A path through an attention-only model: where it starts, and the heads it passes through.

    ``source`` is ``"embed"`` (the token embedding ``W_E[t]``), ``"pos"`` (``W_pos``, standard
    positional embeddings), ``"bias L"`` (the constants layer ``L`` writes: ``b_O``, and
    ``b_V`` and the ``ln1`` bias through every head) or ``"bias out"`` (``b_U`` and the final
    norm's bias); ``heads`` lists ``(layer, head)`` pairs in increasing layer order. ``str``
    gives e.g. ``embed → L0H1 → L1H0``.
    """

    source: str
    heads: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        return " → ".join([self.source, *(f"L{l}H{h}" for l, h in self.heads)])

    @property
    def order(self) -> int:
        """How many heads the path passes through: 0 direct, 1 a head, 2 a virtual head, …"""
        return len(self.heads)


def path_terms(
    state_dict: StateDict, cfg: Config, tokens: torch.Tensor, *, max_paths: int = 10_000
) -> dict[Path, torch.Tensor]:
    """The logits of an attention-only model as a sum of paths: ``{path: [batch, pos, d_vocab]}``.

    With every attention pattern ``A^{l,h}`` and every norm's scale fixed at the values the
    forward pass on ``tokens`` computes, the model is linear, and its logits expand into

        Σ_paths  (A^{l_k,h_k} ... A^{l_1,h_1} ⊗ W_U W_OV^{l_k,h_k} ... W_OV^{l_1,h_1} W_E)·t

    (the paper's notation, norms' linear parts included), plus the same for positional
    embeddings and biases. The values sum to :func:`circuitmath.forward`'s logits up to
    rounding (identities ``one_layer_path_expansion`` and ``two_layer_path_expansion``).
    Pre-norm attention-only models (any norm, any positional embedding, grouped-query
    attention). There are about ``(n_heads + 1) ** n_layers`` paths per source;
    more than ``max_paths`` is an error.
    """
    run = _run(state_dict, cfg, tokens, "two_layer_path_expansion")
    sources = 2 + cfg.n_layers
    count = sources * (cfg.n_heads + 1) ** cfg.n_layers
    if count > max_paths:
        raise ValueError(f"about {count} paths (more than max_paths={max_paths}); raise max_paths to expand anyway")
    terms = _embed(state_dict, cfg, tokens)
    for layer in range(cfg.n_layers):
        terms = _through_layer(state_dict, cfg, layer, run, terms)
    final = run.norms[-1]
    W_U = state_dict["unembed.W_U"]
    logits = {path: final.linear(x) @ W_U for path, x in terms.items()}
    some = next(iter(terms.values()))
    logits[Path("bias out")] = final.constant(some) @ W_U + state_dict["unembed.b_U"]
    return logits


def _through_layer(state_dict, cfg, layer, run: _Run, terms: dict) -> dict:
    """Every term of the residual stream, plus each term passed through each head of ``layer``."""
    norm, pattern = run.norms[layer], run.patterns[layer]
    out = dict(terms)
    for path, x in terms.items():
        heads = _head_outputs(state_dict, cfg, layer, pattern, norm.linear(x), with_bias=False)
        for h in range(cfg.n_heads):
            out[Path(path.source, path.heads + ((layer, h),))] = heads[:, :, h]
    some = next(iter(terms.values()))
    constant = _head_outputs(state_dict, cfg, layer, pattern, norm.constant(some)).sum(dim=2)
    out[Path(f"bias {layer}")] = constant + state_dict[f"blocks.{layer}.attn.b_O"]
    return out


#: The groups :func:`score_terms` splits attention scores into.
SCORE_TERMS = ("direct", "q_composition", "k_composition", "qk_composition", "bias")


def score_terms(state_dict: StateDict, cfg: Config, tokens: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """The attention scores of ``layer`` split by where queries and keys read from:
    ``{group: [batch, n_heads, query, key]}``.

    The residual stream entering ``layer`` is a sum of paths (:func:`path_terms`, patterns and
    norm scales frozen): *direct* ones (the embeddings, no head), *composed* ones (through at
    least one earlier head) and *constant* ones (biases). Queries and keys are linear in it, so
    the scores ``q k^T`` split into

    - ``"direct"``: direct queries against direct keys (``x_0 W_QK x_0^T``);
    - ``"q_composition"``: composed queries, direct keys (``A x_0 W_OV W_QK x_0^T``);
    - ``"k_composition"``: direct queries, composed keys (``x_0 W_QK W_OV^T x_0^T A^T``);
    - ``"qk_composition"``: composed queries and keys;
    - ``"bias"``: every product with a constant part (biases, shortformer positions).

    They sum to the layer's scores before the ``1/sqrt(d_head)`` scale and the causal mask
    (identity ``qk_composition_terms``). V-composition is in the values, not the scores: it is
    the virtual heads of :func:`path_terms`. Rotary embeddings rotate each part (a linear map).
    """
    run = _run(state_dict, cfg, tokens, "qk_composition_terms")
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer must lie in [0, n_layers={cfg.n_layers}), got {layer}")
    terms = _embed(state_dict, cfg, tokens)
    for earlier in range(layer):
        terms = _through_layer(state_dict, cfg, earlier, run, terms)
    norm = run.norms[layer]
    some = next(iter(terms.values()))
    direct = sum(x for p, x in terms.items() if p.order == 0 and not p.source.startswith("bias"))
    composed = [x for p, x in terms.items() if p.order > 0]
    constant = norm.constant(some) + sum((norm.linear(x) for p, x in terms.items() if p.order == 0 and p.source.startswith("bias")), torch.zeros_like(some))
    if cfg.positional_embedding_type == "shortformer":
        constant = constant + state_dict["pos_embed.W_pos"][: tokens.shape[1]]
    parts = {
        "direct": norm.linear(direct),
        "composed": norm.linear(sum(composed)) if composed else torch.zeros_like(some),
    }
    q = {name: _project_linear(state_dict, cfg, layer, "Q", x) for name, x in parts.items()}
    k = {name: _project_linear(state_dict, cfg, layer, "K", x) for name, x in parts.items()}
    p = f"blocks.{layer}.attn"
    q["constant"], k["constant"] = _project(state_dict, p, cfg, "Q", constant), _project(state_dict, p, cfg, "K", constant)
    if cfg.positional_embedding_type == "rotary":
        q = {name: _rotate(x, cfg) for name, x in q.items()}
        k = {name: _rotate(x, cfg) for name, x in k.items()}

    def scores(a, b):
        return torch.einsum("bqhe,bkhe->bhqk", q[a], k[b])

    return {
        "direct": scores("direct", "direct"),
        "q_composition": scores("composed", "direct"),
        "k_composition": scores("direct", "composed"),
        "qk_composition": scores("composed", "composed"),
        "bias": scores("constant", "direct") + scores("constant", "composed") + scores("direct", "constant")
        + scores("composed", "constant") + scores("constant", "constant"),
    }


def _project_linear(state_dict: StateDict, cfg: Config, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
    """``x @ W_name`` per query head, no bias: ``[batch, pos, d_model]`` to ``[batch, pos, n_heads, d_head]``."""
    return torch.einsum("bpd,hde->bphe", x, _layer_weight(state_dict, cfg, layer, name))
