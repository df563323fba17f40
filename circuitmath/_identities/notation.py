"""The tensor-product notation of the circuits framework.

``(A ⊗ B)·X := A X B^T`` for ``X: [positions, features]``: ``A`` mixes positions, ``B`` mixes
features. Four identities:

- ``tensor_product_action``: the two factors act independently, in either order;
- ``tensor_mixed_product``: ``(A ⊗ B)·((C ⊗ D)·X) = (AC ⊗ BD)·X``;
- ``kronecker_vec``: ``A ⊗ B`` is the Kronecker product acting on the row-major ``vec(X)``;
- ``row_column_convention``: TransformerLens's ``X W_1 W_2`` is the paper's
  ``(I ⊗ W_2^T W_1^T)·X``; in particular its ``W_V @ W_O`` is the transpose of the paper's
  ``W_O W_V``. Every later identity states the paper's formulas with the paper's matrices
  defined as transposes of TransformerLens's and relies on this one.

Numeric checks: logits of attention-only models whose heads are computed along each route, with
the attention patterns frozen from a forward pass, against the reference forward pass.
"""

from __future__ import annotations

import sympy
import torch
from sympy import Identity as Eye, MatAdd, MatMul, MatrixExpr, MatrixSymbol, Symbol, Transpose, ZeroMatrix
from sympy.matrices.expressions.kronecker import KroneckerProduct

from .._kronecker import Apply, tensor
from .._proof import Definition, Fact, Step, Twin
from .._registry import Identity, WrongRewrite, register
from ..circuits import Path, TensorProduct, vec
from ..circuits._heads import layer_weight
from ..circuits._paths import PATH_MODEL, embedding_terms, recorded_run, through_layer
from ._circuit_checks import Joint, compare_logits, dim, frozen_norm_operator, heads_route, notation_proof, selector

#: The book chapter whose sections state, prove and check this family's identities.
CHAPTER = "notation"

n, m, d, q = dim("n"), dim("m"), dim("d"), dim("q")
e = dim("e")
A = MatrixSymbol("A", m, n)
B = MatrixSymbol("B", q, d)
X = MatrixSymbol("X", n, d)
I_n, I_m, I_d, I_q = Eye(n), Eye(m), Eye(d), Eye(q)

#: The route reruns the forward pass with frozen patterns: the path expansion's preconditions.
ATTENTION_ONLY = PATH_MODEL


# -- tensor_product_action -------------------------------------------------------------------


def _action_proof():
    lhs = Apply(tensor(A, B), X)
    rhs = MatMul(A, X, Transpose(B))
    A_sq, B_sq = MatrixSymbol("A", n, n), MatrixSymbol("B", d, d)
    lhs_sq = Apply(tensor(A_sq, B_sq), X)
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(Apply(tensor(A, I_q), Apply(tensor(I_n, B), X)), r"features first: $B$ acts on each position's row"),
            Step(Apply(tensor(I_m, B), Apply(tensor(A, I_d), X)), r"positions first: $A$ mixes the rows"),
            Step(MatMul(A, MatMul(X, Transpose(B))), r"definition of $\otimes$, twice"),
            Step(rhs, "associativity"),
        ),
        explicit_dims={n: 3, m: 2, d: 4, q: 3},
        twins=(
            Twin("no_transpose", TENSOR_PRODUCT_ACTION.describe("no_transpose"), lhs_sq,
                 MatMul(A_sq, X, B_sq)),
            Twin("sum_not_product", "read ⊗ as a sum of the two actions: A X + X B^T", lhs_sq,
                 MatAdd(Apply(tensor(A_sq, Eye(d)), X), Apply(tensor(Eye(n), B_sq), X))),
            Twin("factors_swapped", "let the feature factor act on positions: B X A^T (square)",
                 Apply(tensor(MatrixSymbol("A", n, n), MatrixSymbol("B", n, n)), MatrixSymbol("X", n, n)),
                 MatMul(MatrixSymbol("B", n, n), MatrixSymbol("X", n, n), Transpose(MatrixSymbol("A", n, n)))),
        ),
    )


def _positions_first(pattern, x, W_V, W_O):
    """``(A ⊗ B)·x`` with ``A`` applied first: ``(A x) B^T`` where ``B^T = W_V W_O``."""
    return (pattern @ x) @ (W_V @ W_O)


def _no_transpose(pattern, x, W_V, W_O):
    return pattern @ x @ (W_V @ W_O).T


TENSOR_PRODUCT_ACTION = register(
    Identity(
        name="tensor_product_action",
        title="The action of a tensor product",
        summary="(A ⊗ B)·X = A X B^T, and A (positions) and B (features) act independently, in either order",
        preconditions=ATTENTION_ONLY,
        build_proof=_action_proof,
        transform=heads_route(_positions_first, "tensor_product_action"),
        wrong_rewrites={
            "no_transpose": WrongRewrite(
                heads_route(_no_transpose, "tensor_product_action"),
                "let B act from the right without transposing it: A X B",
            ),
        },
        compare=compare_logits,
    )
)


# -- tensor_mixed_product --------------------------------------------------------------------


def _mixed_product_proof():
    n1, n2, n3, d1, d2, d3 = (dim(s) for s in ("n_1", "n_2", "n_3", "d_1", "d_2", "d_3"))
    A_, C_ = MatrixSymbol("A", n3, n2), MatrixSymbol("C", n2, n1)
    B_, D_ = MatrixSymbol("B", d3, d2), MatrixSymbol("D", d2, d1)
    X_ = MatrixSymbol("X", n1, d1)
    lhs = Apply(tensor(A_, B_), Apply(tensor(C_, D_), X_))
    rhs = Apply(tensor(MatMul(A_, C_), MatMul(B_, D_)), X_)
    As, Bs, Cs, Ds, Xs = (MatrixSymbol(s, n, n) for s in "ABCDX")
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatMul(A_, MatMul(C_, X_, Transpose(D_)), Transpose(B_)), r"definition of $\otimes$, twice"),
            Step(MatMul(MatMul(A_, C_), X_, Transpose(MatMul(B_, D_))), r"associativity; $D^\top B^\top = (B D)^\top$"),
            Step(rhs, r"definition of $\otimes$"),
        ),
        explicit_dims={n1: 2, n2: 3, n3: 2, d1: 3, d2: 2, d3: 4, n: 3},
        twins=(
            Twin("features_reversed", "multiply the feature factors in the other order: AC ⊗ DB",
                 Apply(tensor(As, Bs), Apply(tensor(Cs, Ds), Xs)), Apply(tensor(MatMul(As, Cs), MatMul(Ds, Bs)), Xs)),
            Twin("positions_reversed", TENSOR_MIXED_PRODUCT.describe("positions_reversed"),
                 Apply(tensor(As, Bs), Apply(tensor(Cs, Ds), Xs)), Apply(tensor(MatMul(Cs, As), MatMul(Bs, Ds)), Xs)),
        ),
    )


def _path_operators(state_dict, cfg, tokens, combine):
    """Logits as a sum over paths, each path's operators combined into one tensor product first.

    A path's operators, applied right to left, are tensor products: a frozen norm
    ``diag(s) ⊗ (P diag(w))^T``, a head ``A ⊗ W_OV^T``, the unembed ``I ⊗ W_U^T``. ``combine(S, T)``
    returns the single tensor product for "``T`` then ``S``".
    """
    run = recorded_run(state_dict, cfg, tokens, "tensor_mixed_product")
    positions = tokens.shape[1]
    dtype = run.inputs[0].dtype
    W_U = state_dict["unembed.W_U"]
    on = dict(dtype=dtype, device=W_U.device)
    unembed = TensorProduct(torch.eye(positions, **on), W_U.T)
    total = 0
    for source, heads in _path_sources(state_dict, cfg, tokens, run):
        op = TensorProduct(torch.eye(positions, **on), torch.eye(cfg.d_model, **on))
        for layer, head in heads:
            norm = frozen_norm_operator(cfg, run.norms[layer], positions, dtype, W_U.device)
            W_OV = layer_weight(state_dict, cfg, layer, "V")[head] @ state_dict[f"blocks.{layer}.attn.W_O"][head]
            op = combine(TensorProduct(run.patterns[layer][:, head], W_OV.T), combine(norm, op))
        op = combine(unembed, combine(frozen_norm_operator(cfg, run.norms[-1], positions, dtype, W_U.device), op))
        total = total + op.apply(source)
    return total + _constant_logits(state_dict, cfg, run)


def _path_sources(state_dict, cfg, tokens, run):
    """``(source term [b, p, d_model], heads)`` for every path: where it starts and the heads it
    passes through. Sources are the embeddings and the constants each layer writes."""
    sources = dict(embedding_terms(state_dict, cfg, tokens))
    terms = dict(sources)
    for layer in range(cfg.n_layers):
        terms = through_layer(state_dict, cfg, layer, run, terms)
        sources[Path(f"bias {layer}")] = terms[Path(f"bias {layer}")]
    return [(sources[Path(path.source)], path.heads) for path in terms]


def _constant_logits(state_dict, cfg, run):
    some = run.inputs[-1]
    return run.norms[-1].constant(some) @ state_dict["unembed.W_U"] + state_dict["unembed.b_U"]


def _positions_reversed(S: TensorProduct, T: TensorProduct) -> TensorProduct:
    """The ``positions_reversed`` twin: ``CA ⊗ BD`` for "``C ⊗ D`` then ``A ⊗ B``"."""
    return TensorProduct(T.positions @ S.positions, S.features @ T.features)


TENSOR_MIXED_PRODUCT = register(
    Identity(
        name="tensor_mixed_product",
        title="The mixed product",
        summary="(A ⊗ B)·((C ⊗ D)·X) = (AC ⊗ BD)·X: a path of operators is one tensor product",
        preconditions=ATTENTION_ONLY,
        build_proof=_mixed_product_proof,
        transform=lambda sd, cfg, tokens: _path_operators(sd, cfg, tokens, lambda S, T: S @ T),
        wrong_rewrites={
            "positions_reversed": WrongRewrite(
                lambda sd, cfg, tokens: _path_operators(sd, cfg, tokens, _positions_reversed),
                "multiply the position factors in the other order: CA ⊗ BD",
            ),
        },
        compare=compare_logits,
    )
)


# -- kronecker_vec ---------------------------------------------------------------------------


class Vec(MatrixExpr):
    """``vec(Y)``: the rows of ``Y`` stacked into one column (columns, with ``column_major``)."""

    #: A name a proof defines (``vec(Y) := ...``), although it is not a symbol.
    is_notation = True

    def __new__(cls, Y, column_major=False):
        return super().__new__(cls, Y, sympy.true if column_major else sympy.false)

    @property
    def shape(self):
        rows, cols = self.args[0].shape
        return (rows * cols, 1)

    def doit(self, **hints):
        return self

    def _latex(self, printer):
        name = r"\operatorname{vec}_{\mathrm{col}}" if self.args[1] else r"\operatorname{vec}"
        return rf"{name}\left({printer._print(self.args[0])}\right)"


class Kron(MatrixExpr):
    """``kron(A, B)``: the Kronecker product of two matrices, as a matrix."""

    #: A name a proof defines (``vec(Y) := ...``), although it is not a symbol.
    is_notation = True

    def __new__(cls, left, right):
        return super().__new__(cls, left, right)

    @property
    def shape(self):
        (a, b), (c, dd) = self.args[0].shape, self.args[1].shape
        return (a * c, b * dd)

    def doit(self, **hints):
        return self

    def _latex(self, printer):
        return rf"\operatorname{{kron}}\left({printer._print(self.args[0])}, {printer._print(self.args[1])}\right)"


def _selector_definitions(basis, S, T, Sc, Tc) -> tuple[Definition, ...]:
    """The basis columns ``e_0, e_1`` of R^2 and the selectors, defined, not sampled: which order
    of vec a proof means is part of it. Row-major: block i of ``S_i = e_i ⊗ I`` is the identity;
    column-major: feature k of position i goes to row 2k + i, which is ``I ⊗ e_i``."""
    e0, e1 = basis
    return (
        Definition(e0, sympy.ImmutableMatrix([[1], [0]]), "the first basis column of R^2"),
        Definition(e1, sympy.ImmutableMatrix([[0], [1]]), "the second basis column of R^2"),
        *(Definition(family[i], KroneckerProduct(basis[i], Eye(size)), "row-major block selector: e_i ⊗ I")
          for family, size in ((S, d), (T, q)) for i in range(2)),
        *(Definition(family[i], KroneckerProduct(Eye(size), basis[i]), "column-major interleaving selector: I ⊗ e_i")
          for family, size in ((Sc, d), (Tc, q)) for i in range(2)),
    )


def _orthonormal_selectors(families) -> list[Fact]:
    """``F_i^T F_j = δ_ij I`` for each family of two selectors ``(F, size)``."""
    return [Fact(MatMul(Transpose(family[i]), family[j]), Eye(size) if i == j else ZeroMatrix(size, size),
                 "selectors have orthonormal blocks")
            for family, size in families for i in range(2) for j in range(2)]


def _kronecker_vec_proof():
    """Two positions in and out (explicit), feature sizes ``d`` and ``q`` symbolic.

    ``e_i`` are the basis columns of R^2. Row-major ``vec`` of ``X: [2, d]`` is
    ``S_0 X^T e_0 + S_1 X^T e_1`` with block selectors ``S_i: [2d, d]`` (block ``i`` the
    identity; ``T_i: [2q, q]`` for the output); column-major ``vec`` uses interleaving selectors
    (written with a tilde) instead. ``kron(A, B)`` is the
    block matrix whose block ``(i, j)`` is ``a_ij B``.
    """
    e0, e1 = MatrixSymbol("e_0", 2, 1), MatrixSymbol("e_1", 2, 1)
    a = [[Symbol(f"a_{{{i}{j}}}") for j in range(2)] for i in range(2)]
    A2 = MatrixSymbol("A", 2, 2)
    X2 = MatrixSymbol("X", 2, d)
    S = [MatrixSymbol(f"S_{i}", 2 * d, d) for i in range(2)]
    T = [MatrixSymbol(f"T_{i}", 2 * q, q) for i in range(2)]
    Sc = [MatrixSymbol(rf"\tilde S_{i}", 2 * d, d) for i in range(2)]
    Tc = [MatrixSymbol(rf"\tilde T_{i}", 2 * q, q) for i in range(2)]
    basis = (e0, e1)

    def vec_value(Y, selectors):
        return MatAdd(*(MatMul(selectors[i], Transpose(Y), basis[i]) for i in range(2)))

    def kron_value(entries, Bmat, rows, cols):
        return MatAdd(*(MatMul(entries[i][j], rows[i], Bmat, Transpose(cols[j])) for i in range(2) for j in range(2)))

    applied = Apply(tensor(A2, B), X2)
    lhs, vec_X = Vec(applied), Vec(X2)
    K = Kron(A2, B)
    rhs = MatMul(K, vec_X)
    transposed_a = [[a[j][i] for j in range(2)] for i in range(2)]
    K_t = Kron(Transpose(A2), B)
    lhs_col, vec_X_col = Vec(applied, column_major=True), Vec(X2, column_major=True)
    facts = [  # e_i^T e_j is computed: the basis columns are explicit
        Fact(A2, MatAdd(*(MatMul(a[i][j], basis[i], Transpose(basis[j])) for i in range(2) for j in range(2))),
             "a 2 x 2 matrix of scalars"),
        Fact(lhs, vec_value(applied, T), "row-major vec: rows stacked, with block selectors"),
        Fact(vec_X, vec_value(X2, S), "row-major vec of X"),
        Fact(K, kron_value(a, B, T, S), "Kronecker product: block (i, j) is a_ij B"),
        Fact(K_t, kron_value(transposed_a, B, T, S), "Kronecker product of A^T and B"),
        Fact(lhs_col, vec_value(applied, Tc), "column-major vec, with interleaving selectors"),
        Fact(vec_X_col, vec_value(X2, Sc), "column-major vec of X"),
    ]
    facts += _orthonormal_selectors(((S, d), (T, q), (Sc, d), (Tc, q)))

    step_rows = MatAdd(*(MatMul(T[i], B, Transpose(X2), Transpose(A2), basis[i]) for i in range(2)))
    step_entries = MatAdd(*(MatMul(a[i][j], T[i], B, Transpose(X2), basis[j]) for i in range(2) for j in range(2)))
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(vec_value(applied, T), r"definition of $\operatorname{vec}$ (rows stacked)"),
            Step(step_rows, r"definition of $\otimes$; $(A X B^\top)^\top = B X^\top A^\top$"),
            Step(step_entries, r"$A^\top e_i = \sum_j a_{ij} e_j$"),
            Step(MatMul(kron_value(a, B, T, S), vec_value(X2, S)), r"$S_j^\top S_k = \delta_{jk} I_d$: block $(i, j)$ of the Kronecker product meets row $j$ of $X$"),
            Step(rhs, r"definitions of $\operatorname{kron}$ and $\operatorname{vec}$"),
        ),
        definitions=_selector_definitions(basis, S, T, Sc, Tc),
        facts=tuple(facts),
        explicit_dims={d: 3, q: 2},
        explicit_only=(
            "two positions in and out: the Kronecker matrix is written as 2 x 2 blocks a_ij B,"
            " which needs the number of positions explicit; the feature sizes d and q stay symbolic"
        ),
        twins=(
            Twin("column_major", KRONECKER_VEC.describe("column_major"),
                 lhs_col, MatMul(K, vec_X_col)),
            Twin("transposed_positions", "use kron(A^T, B)", lhs, MatMul(K_t, vec_X)),
        ),
    )


#: Output positions whose rows of the Kronecker matrix ``kronecker_vec``'s check builds at once.
KRON_POSITIONS = 2


def _kron_heads(column_major: bool):
    def compute(pattern, x, W_V, W_O):
        batch, positions, width = x.shape
        operator = TensorProduct(pattern, (W_V @ W_O).T)
        flat = vec(x.transpose(-1, -2) if column_major else x)[..., None]
        # the Kronecker matrix [b, p d, p d] a block of output positions at a time: the whole one
        # of a 128-position batch is a gigabyte in float64
        out = torch.cat([(operator.kron(slice(start, start + KRON_POSITIONS)) @ flat)[..., 0]
                         for start in range(0, positions, KRON_POSITIONS)], dim=-1)
        if column_major:
            return out.reshape(batch, width, positions).transpose(-1, -2)
        return out.reshape(batch, positions, width)

    return compute


KRONECKER_VEC = register(
    Identity(
        name="kronecker_vec",
        title="The tensor product is the Kronecker product on vec(X)",
        summary="vec((A ⊗ B)·X) = kron(A, B) vec(X) with vec stacking rows (row-major, as torch reshapes)",
        preconditions=(),  # an identity of matrices: it holds for every A, B and X
        check_note="the numeric check runs it inside an attention-only pre-norm model, each head's output computed as"
                   " kron(A, W_OV^T) vec(x) (the model it draws is a choice of the check, not a condition of the identity)",
        check_requires=ATTENTION_ONLY,
        build_proof=_kronecker_vec_proof,
        transform=heads_route(_kron_heads(column_major=False), "kronecker_vec"),
        wrong_rewrites={
            "column_major": WrongRewrite(
                heads_route(_kron_heads(column_major=True), "kronecker_vec"),
                "vectorise column by column (Fortran order) with the same kron(A, B)",
            ),
        },
        compare=compare_logits,
    )
)


# -- row_column_convention -------------------------------------------------------------------


def _convention_proof():
    W_1, W_2 = MatrixSymbol("W_1", d, e), MatrixSymbol("W_2", e, q)
    X_ = MatrixSymbol("X", n, d)
    P1, P2 = MatrixSymbol(r"{W_1^{\mathrm{col}}}", e, d), MatrixSymbol(r"{W_2^{\mathrm{col}}}", q, e)
    lhs = MatMul(X_, W_1, W_2)
    rhs = Apply(tensor(Eye(n), MatMul(P2, P1)), X_)
    W_1s, W_2s = MatrixSymbol("W_1", d, d), MatrixSymbol("W_2", d, d)
    X_s = MatrixSymbol("X", n, d)
    return notation_proof(
        lhs=lhs,
        rhs=rhs,
        steps=(
            Step(MatMul(Eye(n), X_, Transpose(MatMul(Transpose(W_2), Transpose(W_1)))),
                 r"$W_1 W_2 = (W_2^\top W_1^\top)^\top$"),
            Step(MatMul(Eye(n), X_, Transpose(MatMul(P2, P1))), r"definition of the column-convention matrices"),
            Step(rhs, r"definition of $\otimes$"),
        ),
        facts=(
            Fact(P1, Transpose(W_1), "the same map written for column vectors"),
            Fact(P2, Transpose(W_2), "the same map written for column vectors"),
        ),
        explicit_dims={n: 3, d: 4, e: 2, q: 3},
        twins=(
            Twin("row_product_in_paper_formula",
                 ROW_COLUMN_CONVENTION.describe("row_product_in_paper_formula"), MatMul(X_s, W_1s, W_2s), Apply(tensor(Eye(n), MatMul(W_1s, W_2s)), X_s)),
            Twin("reversed_not_transposed", "reverse the product without transposing: (I ⊗ W_2 W_1)",
                 MatMul(X_s, W_1s, W_2s), Apply(tensor(Eye(n), MatMul(W_2s, W_1s)), X_s)),
        ),
    )


def _paper_convention(pattern, x, W_V, W_O):
    """``(A ⊗ W_O^col W_V^col)·x`` with ``W^col = W^T``: the paper's formula on the paper's matrices."""
    return TensorProduct(pattern, W_O.T @ W_V.T).apply(x)


def _row_product_in_paper_formula(pattern, x, W_V, W_O):
    return TensorProduct(pattern, W_V @ W_O).apply(x)


ROW_COLUMN_CONVENTION = register(
    Identity(
        name="row_column_convention",
        title="Row vectors and column vectors",
        summary="X W_1 W_2 = (I ⊗ W_2^T W_1^T)·X: TransformerLens's W_V @ W_O is the transpose of the paper's W_O W_V",
        preconditions=ATTENTION_ONLY,
        build_proof=_convention_proof,
        transform=heads_route(_paper_convention, "row_column_convention"),
        wrong_rewrites={
            "row_product_in_paper_formula": WrongRewrite(
                heads_route(_row_product_in_paper_formula, "row_column_convention"),
                "put TransformerLens's product W_1 W_2 into (I ⊗ ·)",
            ),
        },
        compare=compare_logits,
    )
)
