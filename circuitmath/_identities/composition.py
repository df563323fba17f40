"""Only OV and QK matter; low rank, spectra from factors; composition and copying scores.

- (that a head depends on its weights only through ``W_OV`` and ``W_QK`` is the identity
  ``refactor_factored_attn_matrices``: ``W_V -> W_V G``, ``W_O -> G^{-1} W_O``,
  ``W_Q -> W_Q M``, ``W_K -> W_K M^{-T}`` keep every head);
- ``factored_svd``: the SVD of ``AB`` from the QR decompositions of ``A`` and ``B^T`` and the
  SVD of a ``k x k`` core, so ``rank(W_OV), rank(W_QK) <= d_head``;
- ``eigenvalues_ab_ba``: ``B`` maps an eigenvector of ``AB`` with eigenvalue ``λ != 0`` to one
  of ``BA``, so their nonzero eigenvalues agree (multiplicities: checked numerically);
- ``composition_scores_from_factors``: ``|V O Q K^T|_F = |R_V O Q R_K^T|_F``, so every
  composition score comes from ``d_head``-sized factors;
- ``composition_score_invariance``, ``copying_score_invariance``: the scores do not change under
  the reparametrisations above (algebraic, proved) and under positive rescaling (a property of
  norms and eigenvalues, checked numerically).

Symbols follow TransformerLens's row convention (``W_OV = W_V W_O``); the paper's matrices are
their transposes (``row_column_convention``), which changes no norm and no eigenvalue.
"""

from __future__ import annotations

import math

import sympy
import torch
from sympy import DiagMatrix, Identity as Eye, MatMul, MatrixSymbol, Symbol, Transpose

from .._errors import Precondition, PreconditionError
from .._proof import Definition, Fact, Nonzero, Proof, Step, Twin
from .._registry import Identity, register
from .._state import attention_names, validate_state_dict
from ..circuits import FactoredMatrix, composition_scores, copying_circuits, copying_scores, full_ov_circuits, ov_circuits
from ..circuits._bases import change_bases
from ..circuits._heads import HAS_ATTENTION, ONE_QK_PER_HEAD
from .._compare import Comparison
from .._compare import SAFETY, SENSITIVITY_SAFETY
from ._circuit_checks import (
    Joint,
    compare_values,
    dim,
    match_eigenvalues,
    match_order,
    unit_roundoff,
    worst,
    orthonormal_columns,
    random_invertible,
    rational_orthogonal,
    unimodular,
    values_tolerance,
)

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "composition"

n, d, e, m, k, V = dim("n"), dim("d"), dim("e"), dim("m"), dim("k"), dim("V")
ANY_ATTENTION = (HAS_ATTENTION,)
#: Checking eigenvalues_ab_ba compares with the dense spectrum of every head's circuit.
CIRCUITS_FIT = Precondition("the materialised [d_vocab, d_vocab] circuits fit in memory")


def _inverse_pair(name: str, size):
    """``G`` and a symbol for ``G^{-1}`` with the fact ``G G^{-1} = I`` and a joint sampler."""
    G, G_inv = MatrixSymbol(name, size, size), MatrixSymbol(f"{{{name}^{{-1}}}}", size, size)
    fact = Fact(MatMul(G, G_inv), Eye(size), f"{name}^(-1) is the inverse of {name}")
    return G, G_inv, fact


def _unimodular_sampler(G, G_inv, dims):
    def draw(rng, explicit):
        size = int(sympy.sympify(G.shape[0]).xreplace(explicit))
        value, inverse = unimodular(rng, size)
        return {G: value, G_inv: inverse}

    return Joint(draw, dims).samplers(G, G_inv)


# -- random reparametrisations (the numeric side of the invariance identities) ------------------


def _random_bases(cfg, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random well-conditioned ``[n_layers, kv_heads, d_head, d_head]`` matrices and their
    inverses on ``device``, drawn from ``seed``: one per key/value head, shared by its query heads."""
    generator = torch.Generator().manual_seed(seed)
    heads = attention_names(cfg, "K")[2]
    pairs = [random_invertible(generator, (heads,), cfg.d_head, device) for _ in range(cfg.n_layers)]
    if not pairs:
        empty = torch.empty(0, heads, cfg.d_head, cfg.d_head, dtype=torch.float64, device=device)
        return empty, empty
    return torch.stack([G for G, _ in pairs]), torch.stack([G_inv for _, G_inv in pairs])


def _reparametrise_ov(state_dict, cfg, *, seed: int = 0, wrong: str | None = None):
    """:func:`~circuitmath.circuits.change_head_bases` with a random ``M`` (here ``G``) drawn
    from ``seed``: ``W_V G``, ``b_V G``, ``G^{-1} W_O``. ``wrong="output_times_G"`` multiplies
    ``W_O`` by ``G`` instead: a wrong rewrite."""
    validate_state_dict(state_dict, cfg)
    G, G_inv = _random_bases(cfg, seed, state_dict["embed.W_E"].device)
    return change_bases(state_dict, cfg, value=G, output=G if wrong == "output_times_G" else G_inv), cfg


def _reparametrise_qk(state_dict, cfg, *, seed: int = 0, wrong: str | None = None):
    """:func:`~circuitmath.circuits.change_head_bases` with a random ``N`` (here ``M``) drawn
    from ``seed``: ``W_Q M``, ``W_K M^{-T}``, biases alike. The callers leave rotary models out
    (``M`` does not commute with the rotation). ``wrong="key_times_M"`` multiplies ``W_K`` by
    ``M`` instead: a wrong rewrite."""
    validate_state_dict(state_dict, cfg)
    M, M_inv = _random_bases(cfg, seed, state_dict["embed.W_E"].device)
    return change_bases(state_dict, cfg, query=M, key=M if wrong == "key_times_M" else M_inv.transpose(-1, -2)), cfg


def _float64(state_dict) -> dict:
    """The weights in float64: the reference side of a check is computed from them."""
    return {name: tensor.double() for name, tensor in state_dict.items()}


# -- factored_svd ----------------------------------------------------------------------------


def _orthonormal_product(Q, U, q_name, u_name, samplers, dims) -> Proof:
    """``(Q U)^T (Q U) = I_k``: the factors of the SVD have orthonormal columns, from those of
    ``Q`` (QR) and ``U`` (the core's SVD)."""
    size = U.shape[0]
    return Proof(
        lhs=MatMul(Transpose(MatMul(Q, U)), MatMul(Q, U)),
        rhs=Eye(size),
        steps=(
            Step(MatMul(Transpose(U), Transpose(Q), Q, U), r"$(Q U)^\top = U^\top Q^\top$"),
            Step(MatMul(Transpose(U), U), rf"${q_name}^\top {q_name} = I$"),
            Step(Eye(size), rf"${u_name}$ is orthogonal"),
        ),
        facts=(
            Fact(MatMul(Transpose(Q), Q), Eye(size), f"{q_name} has orthonormal columns (QR)"),
            Fact(MatMul(Transpose(U), U), Eye(size), f"{u_name} is orthogonal (the core's SVD)"),
        ),
        samplers=samplers,
        explicit_dims=dims,
    )


def _svd_proof():
    A_, B_ = MatrixSymbol("A", m, k), MatrixSymbol("B", k, n)
    Q_A, Q_B = MatrixSymbol("Q_A", m, k), MatrixSymbol("Q_B", n, k)
    R_A, R_B = MatrixSymbol("R_A", k, k), MatrixSymbol("R_B", k, k)
    U, V_, s = MatrixSymbol("U", k, k), MatrixSymbol("V", k, k), MatrixSymbol("s", k, 1)
    S = DiagMatrix(s)
    core = MatMul(U, S, Transpose(V_))
    dims = {m: 4, n: 3, k: 2}

    def draw(rng, explicit):
        size = explicit[k]
        u, v = rational_orthogonal(rng, size), rational_orthogonal(rng, size)
        values = sympy.Matrix([sympy.Rational(size - i, 1) + sympy.Rational(rng.randint(0, 3), 7) for i in range(size)])
        r_b = sympy.eye(size)
        for i in range(size):
            for j in range(i + 1, size):
                r_b[i, j] = rng.randint(-2, 2)
        r_a = u * sympy.diag(*values) * v.T * r_b.T.inv()  # so that R_A R_B^T = U S V^T
        return {U: u, V_: v, s: values, R_A: r_a, R_B: r_b}

    joint = Joint(draw, dims)
    samplers = {**joint.samplers(U, V_, s, R_A, R_B), Q_A: orthonormal_columns, Q_B: orthonormal_columns}
    rhs = MatMul(MatMul(Q_A, U), S, Transpose(MatMul(Q_B, V_)))
    return Proof(
        lhs=MatMul(A_, B_),
        rhs=rhs,
        steps=(
            Step(MatMul(Q_A, R_A, Transpose(R_B), Transpose(Q_B)), r"QR decompositions $A = Q_A R_A$, $B^\top = Q_B R_B$"),
            Step(MatMul(Q_A, core, Transpose(Q_B)), r"SVD of the $k \times k$ core: $R_A R_B^\top = U S V^\top$"),
            Step(rhs, r"regroup; $Q_A U$ and $Q_B V$ have orthonormal columns (products of such)"),
        ),
        facts=(
            Fact(A_, MatMul(Q_A, R_A), "A by its QR decomposition (Q_A^T Q_A = I_k)"),
            Fact(B_, MatMul(Transpose(R_B), Transpose(Q_B)), "B^T by its QR decomposition (Q_B^T Q_B = I_k)"),
            Fact(MatMul(R_A, Transpose(R_B)), core, "the SVD of the core"),
        ),
        lemmas=(
            ("left_singular_vectors_orthonormal", _orthonormal_product(Q_A, U, "Q_A", "U", samplers, dims)),
            ("right_singular_vectors_orthonormal", _orthonormal_product(Q_B, V_, "Q_B", "V", samplers, dims)),
        ),
        samplers=samplers,
        explicit_dims=dims,
        twins=(
            Twin("singular_vectors_swapped", "swap the left and right singular vectors of the core",
                 MatMul(A_, B_), MatMul(MatMul(Q_A, V_), S, Transpose(MatMul(Q_B, U)))),
            Twin("right_vectors_untransposed", "use Q_B V^T for the right singular vectors",
                 MatMul(A_, B_), MatMul(MatMul(Q_A, U), S, Transpose(MatMul(Q_B, Transpose(V_))))),
        ),
    )


def _svd_route(wrong: bool = False):
    """Every head's ``W_OV`` SVD from its factors; ``wrong``: singular values of ``BA = W_O W_V``."""

    def route(state_dict, cfg, tokens):
        ov = ov_circuits(state_dict, cfg)
        U, S, Vh = ov.svd()
        if wrong:
            S = torch.linalg.svdvals(ov.BA)
        return U, S, Vh

    return route


def _compare_svd(state_dict, cfg, tokens, route) -> Comparison:
    """``U diag(S) Vh`` against the materialised ``W_OV``; ``S`` against its singular values;
    ``U`` and ``Vh`` orthonormal."""
    dtype = validate_state_dict(state_dict, cfg)
    U, S, Vh = route(state_dict, cfg, tokens)
    ov = ov_circuits(_float64(state_dict), cfg).AB
    r = min(cfg.d_model, cfg.d_head)
    if S.shape[-1] != r or U.shape[-1] != r or Vh.shape[-2] != r:
        return Comparison(math.inf, 0.0, (0,))
    expected_s = torch.linalg.svdvals(ov)[..., :r]
    eye = torch.eye(r, dtype=torch.float64, device=ov.device)
    errors = torch.stack([
        (U.double() @ torch.diag_embed(S.double()) @ Vh.double() - ov).abs().amax(dim=(-1, -2)),
        (S.double() - expected_s).abs().amax(dim=-1),
        (U.double().transpose(-1, -2) @ U.double() - eye).abs().amax(dim=(-1, -2)) * expected_s[..., 0],
        (Vh.double() @ Vh.double().transpose(-1, -2) - eye).abs().amax(dim=(-1, -2)) * expected_s[..., 0],
    ])
    where = tuple(int(i) for i in torch.unravel_index(errors.argmax(), errors.shape))
    scale = float(expected_s.max()) if expected_s.numel() else 0.0
    return Comparison(float(errors.max()), values_tolerance(dtype, cfg.d_model, scale), where)


FACTORED_SVD = register(
    Identity(
        name="factored_svd",
        title="The SVD of a product from its factors; rank at most d_head",
        summary="AB = (Q_A U) S (Q_B V)^T from A = Q_A R_A, B^T = Q_B R_B and R_A R_B^T = U S V^T (k x k)",
        preconditions=ANY_ATTENTION,
        build_proof=_svd_proof,
        transform=_svd_route(),
        wrong_rewrites={"singular_values_of_BA": _svd_route(wrong=True)},
        compare=_compare_svd,
    )
)


# -- eigenvalues_ab_ba -----------------------------------------------------------------------


def _eigen_fact_draw(product, v, lam, free, target):
    """A draw where ``product v = λ v`` holds: everything but ``target`` (the leftmost factor of
    ``product``, shape ``[a, c]``) is random, and ``target`` is solved for.

    With ``u`` the rest of the product applied to ``v`` (``[c, 1]``, redrawn until nonzero),
    ``target = λ v u^T / (u^T u) + C (I - u u^T / (u^T u))`` maps ``u`` to ``λ v``.
    """

    def shape(symbol, explicit):
        return tuple(int(sympy.sympify(s).xreplace(explicit)) for s in symbol.shape)

    def draw(rng, explicit):
        while True:
            values = {s: sympy.Matrix(*shape(s, explicit), lambda i, j: rng.randint(-3, 3)) for s in free}
            u = values[v]
            for factor in reversed(product[1:]):
                u = values[factor] * u
            if any(values[v]) and any(u):
                break
        values[lam] = sympy.Rational(rng.choice([-3, -2, -1, 1, 2, 3]), rng.randint(1, 3))
        rows, cols = shape(target, explicit)
        C = sympy.Matrix(rows, cols, lambda i, j: rng.randint(-2, 2))
        norm = (u.T * u)[0]
        values[target] = values[lam] * values[v] * u.T / norm + C * (sympy.eye(cols) - u * u.T / norm)
        return values

    return draw


def _eigen_proof():
    A_, B_ = MatrixSymbol("A", m, n), MatrixSymbol("B", n, m)
    v, lam = MatrixSymbol("v", m, 1), Symbol(r"\lambda")
    dims = {m: 4, n: 2}
    joint = Joint(_eigen_fact_draw((A_, B_), v, lam, free=(B_, v), target=A_), dims)
    mapped = MatMul(B_, v)
    return Proof(
        lhs=MatMul(B_, A_, mapped),
        rhs=MatMul(lam, mapped),
        steps=(
            Step(MatMul(B_, MatMul(A_, B_, v)), "associativity"),
            Step(MatMul(B_, MatMul(lam, v)), r"$A B v = \lambda v$"),
            Step(MatMul(lam, mapped), r"scalars commute: $B v$ is an eigenvector of $B A$, nonzero since $A (B v) = \lambda v \ne 0$"),
        ),
        facts=(Fact(MatMul(A_, B_, v), MatMul(lam, v), "v is an eigenvector of AB with eigenvalue λ"),),
        nonzero=(
            Nonzero(lam, "λ ≠ 0 (the zero eigenvalues of AB and BA differ in number: m - n of them)"),
            Nonzero(v, "v ≠ 0: an eigenvector"),
            Nonzero(mapped, "B v ≠ 0, so B v is an eigenvector: A (B v) = λ v ≠ 0", because=(A_, MatMul(lam, v))),
        ),
        samplers=joint.samplers(A_, B_, v, lam),
        explicit_dims=dims,
        twins=(
            Twin("transposed_product", "B v is an eigenvector of (BA)^T", MatMul(Transpose(A_), Transpose(B_), mapped),
                 MatMul(lam, mapped)),
            Twin("mapped_by_A_transpose", "map the eigenvector by A^T instead of B",
                 MatMul(B_, A_, Transpose(A_), v), MatMul(lam, Transpose(A_), v)),
        ),
    )


def _eigenvalues_route(wrong: bool = False):
    """Eigenvalues of every head's full OV circuit ``W_E W_OV W_U`` from the ``d_head x d_head``
    ``W_O W_U W_E W_V``; ``wrong``: from ``W_OV`` alone (embed and unembed forgotten)."""

    def route(state_dict, cfg, tokens):
        if wrong:
            return ov_circuits(state_dict, cfg).eigenvalues()
        return full_ov_circuits(state_dict, cfg).eigenvalues()

    return route


def eigenvalue_sensitivity(matrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a :class:`FactoredMatrix` ``AB`` (square), in float64: the eigenvalues
    ``λ`` of ``BA`` ``[..., k]``, their condition numbers as eigenvalues of ``BA`` and of ``AB``,
    and the scale ``|A|_F |B|_F`` ``[...]`` of the rounding errors of either product.

    A perturbation ``E`` moves a simple eigenvalue by at most about ``κ |E|``, with
    ``κ = |x| |y| / |y^H x|`` for its right and left eigenvectors ``x``, ``y``. For ``BA`` these are
    ``w`` and ``z``; for ``AB`` they are ``A w`` and ``B^H z`` (and ``z^H B A w = λ z^H w``).
    """
    if matrix.inner > matrix.shape[-2]:  # then AB is the small side: swap the roles
        matrix = FactoredMatrix(matrix.right, matrix.left)
    A, B = matrix.left.double(), matrix.right.double()
    lam, W, Z, kappa_small = _conditioned_eig(B @ A)
    x = A.to(W.dtype) @ W
    y = B.to(W.dtype).conj().transpose(-1, -2) @ Z
    kappa_big = torch.linalg.vector_norm(x, dim=-2) * torch.linalg.vector_norm(y, dim=-2) / lam.abs()
    scale = torch.linalg.matrix_norm(A) * torch.linalg.matrix_norm(B)
    return lam, kappa_small, kappa_big, scale


def _conditioned_eig(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eigenvalues ``λ: [..., k]`` of ``matrix: [..., k, k]``, its right eigenvectors ``W`` and
    left ones ``Z`` (columns, ``z_i^H w_j = δ_ij``), and each eigenvalue's condition number
    ``|w| |z| / |z^H w|`` (see :func:`eigenvalue_sensitivity`)."""
    lam, W = torch.linalg.eig(matrix)
    Z = torch.linalg.inv(W).conj().transpose(-1, -2)
    return lam, W, Z, torch.linalg.vector_norm(W, dim=-2) * torch.linalg.vector_norm(Z, dim=-2)


#: The largest materialised ``[heads, d_vocab, d_vocab]`` float64 circuit the eigenvalue check
#: builds (its dense eigensolver needs a few times as much again): 1 GiB.
MATERIALISED_CIRCUIT_LIMIT_BYTES = 1 << 30


def _compare_eigenvalues(state_dict, cfg, tokens, route) -> Comparison:
    """Each eigenvalue from the factors against a distinct nearest eigenvalue of the materialised
    ``[d_vocab, d_vocab]`` circuit (float64), within its own rounding bound: ``SAFETY * size *
    |A| |B| (u κ_BA + u_64 κ_AB)`` (see :func:`eigenvalue_sensitivity`). Refused when the
    materialised circuits would exceed :data:`MATERIALISED_CIRCUIT_LIMIT_BYTES`."""
    dtype = validate_state_dict(state_dict, cfg)
    circuit_bytes = cfg.n_layers * cfg.n_heads * cfg.d_vocab**2 * 8
    if circuit_bytes > MATERIALISED_CIRCUIT_LIMIT_BYTES:
        raise PreconditionError(
            "eigenvalues_ab_ba", CIRCUITS_FIT,
            f"checking the identity compares with the dense spectrum of every head's"
            f" {cfg.d_vocab:,} x {cfg.d_vocab:,} circuit: {cfg.n_layers * cfg.n_heads} heads,"
            f" {circuit_bytes / 2**30:,.0f} GiB in float64, over the limit of"
            f" {MATERIALISED_CIRCUIT_LIMIT_BYTES / 2**30:g} GiB (the eigenvalues themselves come from the"
            f" d_head x d_head factors at any size)",
        )
    few = route(state_dict, cfg, tokens)
    exact = full_ov_circuits(_float64(state_dict), cfg)
    many = torch.linalg.eigvals(exact.AB)
    lam, kappa_small, kappa_big, scale = eigenvalue_sensitivity(exact)
    if few.shape != lam.shape:
        return Comparison(math.inf, 0.0, (0,) * lam.ndim)
    distances = match_eigenvalues(few.to(torch.complex128), many)
    size = cfg.d_vocab + cfg.d_model
    bound = unit_roundoff(dtype) * kappa_small + unit_roundoff(torch.float64) * kappa_big
    # bounds per eigenvalue of BA; match each computed eigenvalue to its nearest exact one
    tolerances = SAFETY * size * scale[..., None] * bound
    order = match_order(few.to(torch.complex128), lam)
    tolerances = torch.gather(tolerances, -1, order)
    return worst(distances, tolerances)


EIGENVALUES_AB_BA = register(
    Identity(
        name="eigenvalues_ab_ba",
        title="The nonzero eigenvalues of AB and BA agree",
        summary="A B v = λ v with λ ≠ 0 implies B A (B v) = λ (B v): spectra of big circuits from d_head x d_head matrices",
        preconditions=(*ANY_ATTENTION, CIRCUITS_FIT),
        build_proof=_eigen_proof,
        transform=_eigenvalues_route(),
        wrong_rewrites={"ov_without_embeddings": _eigenvalues_route(wrong=True)},
        compare=_compare_eigenvalues,
    )
)


# -- composition_scores_from_factors ---------------------------------------------------------


def _scores_proof():
    W_V, W_O = MatrixSymbol("W_V", d, e), MatrixSymbol("W_O", e, d)
    W_Q, W_K = MatrixSymbol("W_Q", d, e), MatrixSymbol("W_K", d, e)
    Q_V, R_V = MatrixSymbol("Q_V", d, e), MatrixSymbol("R_V", e, e)
    Q_K, R_K = MatrixSymbol("Q_K", d, e), MatrixSymbol("R_K", e, e)
    M, N = MatrixSymbol("M", d, d), MatrixSymbol("N", e, e)
    N_no_rv, N_untransposed = MatrixSymbol(r"{N^{\prime}}", e, e), MatrixSymbol(r"{N^{\prime\prime}}", e, e)
    product = MatMul(W_V, W_O, W_Q, Transpose(W_K))
    lhs = MatMul(Transpose(M), M)
    rhs = MatMul(Q_K, Transpose(N), N, Transpose(Q_K))
    expanded = MatMul(Q_K, R_K, Transpose(W_Q), Transpose(W_O), Transpose(R_V), Transpose(Q_V),
                      Q_V, R_V, W_O, W_Q, Transpose(R_K), Transpose(Q_K))
    dims = {d: 4, e: 2}
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(expanded, r"definitions: $M = W_V W_O W_Q W_K^\top$ with $W_V = Q_V R_V$, $W_K = Q_K R_K$"),
            Step(MatMul(Q_K, R_K, Transpose(W_Q), Transpose(W_O), Transpose(R_V), R_V, W_O, W_Q,
                        Transpose(R_K), Transpose(Q_K)), r"$Q_V^\top Q_V = I$"),
            Step(rhs, r"definition of $N = R_V W_O W_Q R_K^\top$, the $d_\mathrm{head} \times d_\mathrm{head}$ core"),
        ),
        definitions=(
            Definition(W_V, MatMul(Q_V, R_V), "QR decomposition of the writer's W_V"),
            Definition(W_K, MatMul(Q_K, R_K), "QR decomposition of the reader's W_K"),
            Definition(N_no_rv, MatMul(W_O, W_Q, Transpose(R_K)), "the core without R_V"),
            Definition(N_untransposed, MatMul(R_V, W_O, W_Q, R_K), "the core with R_K untransposed"),
        ),
        facts=(
            Fact(M, product, "the Q-composition product W_OV^1 W_QK^2 (row convention)"),
            Fact(N, MatMul(R_V, W_O, W_Q, Transpose(R_K)), "its core"),
            Fact(MatMul(Transpose(Q_V), Q_V), Eye(e), "Q_V has orthonormal columns"),
            Fact(MatMul(Transpose(Q_K), Q_K), Eye(e), "Q_K has orthonormal columns"),
        ),
        samplers={Q_V: orthonormal_columns, Q_K: orthonormal_columns},
        explicit_dims=dims,
        twins=(
            Twin("writer_factor_dropped", "drop R_V: normalise by the writer's W_O alone",
                 lhs, MatMul(Q_K, Transpose(N_no_rv), N_no_rv, Transpose(Q_K))),
            Twin("reader_factor_untransposed", "use R_K instead of R_K^T",
                 lhs, MatMul(Q_K, Transpose(N_untransposed), N_untransposed, Transpose(Q_K))),
        ),
    )


def _compare_scores(expected):
    def compare(state_dict, cfg, tokens, route) -> Comparison:
        dtype = validate_state_dict(state_dict, cfg)
        computed, reference = route(state_dict, cfg, tokens), expected(state_dict, cfg)
        stacked = torch.stack([computed[k].double() for k in sorted(reference)])
        reference = torch.stack([reference[k] for k in sorted(reference)])
        return compare_values(stacked, reference, dtype, cfg.d_model)

    return compare


def _scores_route(k_untransposed: bool = False):
    def route(state_dict, cfg, tokens):
        scores = composition_scores(state_dict, cfg, _kinds(cfg))
        if k_untransposed and "k" in scores:
            scores["k"] = scores["q"]  # K-composition read with W_QK instead of W_QK^T
        return scores

    return route


def _kinds(cfg) -> tuple[str, ...]:
    """The composition kinds a model has: no Q or K composition with rotary embeddings."""
    return ("v",) if cfg.positional_embedding_type == "rotary" else ("q", "k", "v")


def _naive_expected(state_dict, cfg):
    return composition_scores(state_dict, cfg, _kinds(cfg), materialise=True)


COMPOSITION_SCORES_FROM_FACTORS = register(
    Identity(
        name="composition_scores_from_factors",
        title="Composition scores from the factors",
        summary="M^T M = Q_K N^T N Q_K^T with N = R_V W_O W_Q R_K^T, so |W_OV W_QK|_F = |N|_F (d_head x d_head)",
        preconditions=(HAS_ATTENTION, ONE_QK_PER_HEAD),
        build_proof=_scores_proof,
        transform=_scores_route(),
        wrong_rewrites={"k_composition_untransposed": _scores_route(k_untransposed=True)},
        compare=_compare_scores(_naive_expected),
    )
)


# -- composition_score_invariance ------------------------------------------------------------


def _score_invariance_proof():
    W_V, W_O = MatrixSymbol("W_V", d, e), MatrixSymbol("W_O", e, d)
    W_Q, W_K = MatrixSymbol("W_Q", d, e), MatrixSymbol("W_K", d, e)
    G, G_inv, g_fact = _inverse_pair("G", e)
    P, P_inv, p_fact = _inverse_pair("P", e)
    lhs = MatMul(W_V, G, G_inv, W_O, W_Q, P, Transpose(MatMul(W_K, Transpose(P_inv))))
    rhs = MatMul(W_V, W_O, W_Q, Transpose(W_K))
    dims = {d: 4, e: 2}
    return Proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatMul(W_V, G, G_inv, W_O, W_Q, P, P_inv, Transpose(W_K)), r"$(W_K P^{-\top})^\top = P^{-1} W_K^\top$"),
            Step(rhs, r"$G G^{-1} = I$, $P P^{-1} = I$"),
        ),
        facts=(g_fact, p_fact),
        samplers={**_unimodular_sampler(G, G_inv, dims), **_unimodular_sampler(P, P_inv, dims)},
        explicit_dims=dims,
        twins=(
            Twin("key_times_P", "reparametrise W_K with P instead of P^{-T}",
                 MatMul(W_V, G, G_inv, W_O, W_Q, P, Transpose(MatMul(W_K, P))), rhs),
            Twin("output_times_G", "reparametrise W_O with G instead of G^{-1}",
                 MatMul(W_V, G, G, W_O, W_Q, P, Transpose(MatMul(W_K, Transpose(P_inv)))), rhs),
        ),
    )


SCALE = 2.5


def _scaled(state_dict, cfg, factor: float):
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        out[f"blocks.{layer}.attn.W_O"] = state_dict[f"blocks.{layer}.attn.W_O"] * factor
        q = attention_names(cfg, "Q")[0]
        out[f"blocks.{layer}.attn.{q}"] = state_dict[f"blocks.{layer}.attn.{q}"] * factor
    return out


def _reparametrised_scores(wrong: str | None = None):
    def route(state_dict, cfg, tokens):
        changed, _ = _reparametrise_ov(state_dict, cfg, seed=1)
        if cfg.positional_embedding_type in ("standard", "shortformer"):
            changed, _ = _reparametrise_qk(changed, cfg, seed=2, wrong=wrong)
        return _scores_route()(_scaled(changed, cfg, SCALE), cfg, tokens)

    return route


def _original_scores(state_dict, cfg):
    return _scores_route()(state_dict, cfg, None)


COMPOSITION_SCORE_INVARIANCE = register(
    Identity(
        name="composition_score_invariance",
        title="Composition scores do not depend on the parametrisation",
        summary="(W_V G)(G^{-1} W_O)(W_Q P)(W_K P^{-T})^T = W_V W_O W_Q W_K^T; positive rescaling cancels in the ratio",
        preconditions=(HAS_ATTENTION, ONE_QK_PER_HEAD),
        build_proof=_score_invariance_proof,
        transform=_reparametrised_scores(),
        wrong_rewrites={"key_times_M": _reparametrised_scores(wrong="key_times_M")},
        compare=_compare_scores(lambda sd, cfg: {k: v.double() for k, v in _original_scores(sd, cfg).items()}),
    )
)


# -- copying_score_invariance ----------------------------------------------------------------


def _copying_proof():
    W_V, W_O = MatrixSymbol("W_V", d, e), MatrixSymbol("W_O", e, d)
    W_E, W_U = MatrixSymbol("W_E", V, d), MatrixSymbol("W_U", d, V)
    v, lam = MatrixSymbol("v", e, 1), Symbol(r"\lambda")
    G, G_inv, g_fact = _inverse_pair("G", e)
    small = (W_O, W_U, W_E, W_V)
    dims = {d: 3, e: 2, V: 4}
    eigen = Joint(_eigen_fact_draw(small, v, lam, free=(W_U, W_E, W_V, v), target=W_O), dims)
    mapped = MatMul(G_inv, v)
    lhs = MatMul(G_inv, *small, G, mapped)
    return Proof(
        lhs=lhs,
        rhs=MatMul(lam, mapped),
        steps=(
            Step(MatMul(G_inv, *small, v), r"$G G^{-1} = I$"),
            Step(MatMul(G_inv, MatMul(lam, v)), r"$W_O W_U W_E W_V v = \lambda v$"),
            Step(MatMul(lam, mapped), "scalars commute"),
        ),
        facts=(g_fact, Fact(MatMul(*small, v), MatMul(lam, v), "v is an eigenvector of the d_head x d_head circuit")),
        samplers={**_unimodular_sampler(G, G_inv, dims), **eigen.samplers(*small, v, lam)},
        explicit_dims=dims,
        assumptions=(
            "the copying score sum(λ)/sum(|λ|) is a function of the eigenvalues: a similarity keeps"
            " it, a positive factor c maps λ to c λ and cancels",
        ),
        twins=(
            Twin("similarity_reversed", "conjugate the other way, G S G^{-1}",
                 MatMul(G, *small, G_inv, mapped), MatMul(lam, mapped)),
            Twin("eigenvector_unchanged", "keep the eigenvector v", MatMul(G_inv, *small, G, v), MatMul(lam, v)),
        ),
    )


def _reparametrised_copying(factor: float):
    def route(state_dict, cfg, tokens):
        changed, _ = _reparametrise_ov(state_dict, cfg, seed=3)
        changed = dict(changed)
        for layer in range(cfg.n_layers):
            changed[f"blocks.{layer}.attn.W_O"] = changed[f"blocks.{layer}.attn.W_O"] * factor
        return copying_scores(changed, cfg)

    return route


def _compare_copying(state_dict, cfg, tokens, route) -> Comparison:
    """Copying scores of the rescaled and reparametrised model against the original's.

    Both are computed in the model's dtype from ``BA = W_O (W_U W_E) W_V``
    (:func:`~circuitmath.circuits.copying_circuits`). A score ``Re Σλ / Σ|λ|`` moves by at most
    ``2 Σ|δλ| / Σ|λ|``, and each ``|δλ|`` by about ``κ`` times the rounding of ``BA``
    (:func:`eigenvalue_sensitivity`), at most about ``(d_vocab + 2 d_model) u |W_O| |W_U| |W_E|
    |W_V|`` (Frobenius norms); twice that for the two computations. That a-priori bound grows
    with ``d_vocab`` and with the norms, and on a real vocabulary it says nothing (tens on
    MiniLM in float32, for scores in [-1, 1]). So the tolerance is the smaller of it and what
    rounding is measured to do here: each side computed in the model's dtype against the same
    computation in float64 (``SENSITIVITY_SAFETY`` times the sum of both differences), plus the
    float64 a-priori bound for the identity itself, plus ``SAFETY * d_head * u`` for the final
    sums of ``d_head`` eigenvalues, which round however well conditioned the eigenvalues are.
    """
    dtype = validate_state_dict(state_dict, cfg)
    computed, expected = route(state_dict, cfg, tokens).double(), copying_scores(state_dict, cfg).double()
    exact = _float64(state_dict)
    lam, _W, _Z, kappa_small = _conditioned_eig(copying_circuits(exact, cfg))
    # copying_circuits rounds W_U W_E (inner size d_vocab), then two products of inner size d_model
    ov = ov_circuits(exact, cfg)
    fro = torch.linalg.matrix_norm
    scale = fro(ov.left) * fro(ov.right) * fro(exact["unembed.W_U"]) * fro(exact["embed.W_E"])
    size = cfg.d_vocab + 2 * cfg.d_model

    def a_priori(u: float) -> torch.Tensor:
        return 4 * (SAFETY * size * u * scale[..., None] * kappa_small).sum(dim=-1) / lam.abs().sum(dim=-1)

    def rounding(ours: torch.Tensor, in_float64: torch.Tensor) -> float:
        return float(torch.nan_to_num(ours - in_float64).abs().max())

    measured = SENSITIVITY_SAFETY * (
        rounding(computed, route(exact, cfg, tokens).double()) + rounding(expected, copying_scores(exact, cfg))
    )
    tolerances = torch.minimum(
        a_priori(unit_roundoff(dtype)),
        measured + a_priori(unit_roundoff(torch.float64)) + SAFETY * cfg.d_head * unit_roundoff(dtype),
    )
    return worst((computed - expected).abs(), tolerances)


COPYING_SCORE_INVARIANCE = register(
    Identity(
        name="copying_score_invariance",
        title="The eigenvalue copying score",
        summary="W_V -> W_V G, W_O -> G^{-1} W_O conjugates W_O W_U W_E W_V: same eigenvalues, same copying score",
        preconditions=ANY_ATTENTION,
        build_proof=_copying_proof,
        transform=_reparametrised_copying(SCALE),
        wrong_rewrites={"negative_rescaling": _reparametrised_copying(-SCALE)},
        compare=_compare_copying,
    )
)

