"""Proofs as chains of sympy-checked equalities, and negative twins that must be rejected."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
from sympy import MatAdd, MatMul, MatrixExpr, MatrixSymbol

from ._algebra import evaluate, normal_form, random_instance, to_latex

__all__ = ["Definition", "Fact", "Step", "Twin", "Proof", "ProofReport", "StepReport", "TwinReport"]


@dataclass(frozen=True)
class Definition:
    """``symbol := value``: an abbreviation the checker unfolds wherever it meets ``symbol``."""

    symbol: sympy.Basic
    value: sympy.Basic
    text: str

    def latex(self) -> str:
        return rf"{to_latex(self.symbol)} := {to_latex(self.value)}"


@dataclass(frozen=True)
class Fact:
    """An assumption ``product = value`` the proof may use, e.g. ``A 1 = 1`` for attention rows.

    Every concrete instance the engine draws is checked to satisfy it exactly, so a sampler that
    breaks the assumption is an error, not a silent counterexample.
    """

    product: sympy.Basic
    value: sympy.Basic
    text: str

    def latex(self) -> str:
        return rf"{to_latex(self.product)} = {to_latex(self.value)}"


@dataclass(frozen=True)
class Step:
    """One link of a chain: the previous expression equals ``expr`` because of ``reason``."""

    expr: sympy.Basic
    reason: str  # LaTeX text mode: math goes between $...$


@dataclass(frozen=True)
class Twin:
    """A plausible wrong variant of a claim, ``lhs = rhs``, that the engine must reject.

    ``dims`` overrides the explicit sizes used to look for a counterexample (a twin that scales
    columns instead of rows only type-checks when the matrix is square, say).
    """

    name: str
    description: str
    lhs: sympy.Basic
    rhs: sympy.Basic
    dims: Mapping | None = None


@dataclass(frozen=True)
class StepReport:
    before: str
    after: str
    reason: str
    holds: bool
    residual: str


@dataclass(frozen=True)
class TwinReport:
    name: str
    description: str
    claim: str
    rejected: bool
    symbolic_residual: str
    counterexample_gap: float | None


@dataclass(frozen=True)
class ProofReport:
    name: str
    proved: bool
    symbolic_dims: bool
    steps: tuple[StepReport, ...]
    twins: tuple[TwinReport, ...]
    concrete_check: bool
    seconds: float

    @property
    def twins_rejected(self) -> int:
        return sum(t.rejected for t in self.twins)

    @property
    def ok(self) -> bool:
        """The claim is proved and every twin is rejected."""
        return self.proved and self.twins_rejected == len(self.twins)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "status": "proved" if self.ok else "failed",
            "symbolic_dims": self.symbolic_dims,
            "steps": len(self.steps),
            "seconds": round(self.seconds, 4),
            "twins_rejected": self.twins_rejected,
            "twins_total": len(self.twins),
            "claim_proved": self.proved,
            "concrete_check": self.concrete_check,
            "failed_steps": [s.reason for s in self.steps if not s.holds],
            "accepted_twins": [t.name for t in self.twins if not t.rejected],
        }


def _describe(terms) -> str:
    """The residual terms as LaTeX, ``0`` when none are left."""
    parts = [to_latex(MatMul(c, *f)) if f else to_latex(c) for f, c in terms.items()]
    return " + ".join(parts).replace("+ -", "-") or "0"


def _difference(a, b):
    """``a - b`` left unevaluated: sympy's ``MatrixExpr.__sub__`` runs ``doit``, which evaluates
    symbolic sums and can take seconds before the normal form even starts."""
    if isinstance(a, MatrixExpr):
        return MatAdd(a, MatMul(-1, b))
    return a - b


#: Entries of an exact instance that are not rational (logs and exponentials of rationals) are
#: compared at this many digits, and counted as zero below ZERO_BELOW.
DIGITS = 60
ZERO_BELOW = 1e-45


def _gap(matrix) -> float:
    """The largest |entry| of an exactly evaluated difference (0 when it vanishes)."""
    worst = 0.0
    for v in matrix:
        size = abs(v) if v.is_Rational else abs(sympy.N(v, DIGITS))
        if size > ZERO_BELOW:
            worst = max(worst, float(size))
    return worst


@dataclass(frozen=True)
class Proof:
    """A machine-checked derivation of ``lhs = rhs``.

    ``steps`` lead from ``lhs`` to ``rhs``: each step's expression must equal the one before it in
    the normal form of :mod:`circuitmath._algebra`, with ``definitions`` unfolded. The last step's
    expression must be ``rhs`` itself. ``explicit_dims`` gives the sizes for the concrete checks
    (the claim on a random exact instance, the twins' counterexamples); ``samplers`` draws symbols
    that carry an assumption. ``explicit_only`` is set, with the reason, for a proof that only
    holds for the sizes it was run at.
    """

    lhs: sympy.Basic
    rhs: sympy.Basic
    steps: tuple[Step, ...]
    explicit_dims: Mapping
    definitions: tuple[Definition, ...] = ()
    twins: tuple[Twin, ...] = ()
    samplers: Mapping = field(default_factory=dict)
    facts: tuple[Fact, ...] = ()
    assumptions: tuple[str, ...] = ()
    explicit_only: str | None = None

    @property
    def symbolic_dims(self) -> bool:
        """Every matrix in the proof has symbolic sizes (``1`` for vectors allowed)."""
        if self.explicit_only:
            return False
        exprs = [self.lhs, self.rhs, *(s.expr for s in self.steps), *(d.value for d in self.definitions)]
        symbols = set().union(*(sympy.sympify(e).atoms(MatrixSymbol) for e in exprs))
        return bool(symbols) and all(
            (sympy.sympify(n).free_symbols or n == 1) for s in symbols for n in s.shape
        )

    @property
    def _definitions(self) -> dict:
        return {d.symbol: d.value for d in self.definitions}

    def _residual(self, a, b):
        return normal_form(_difference(a, b), self._definitions, [(f.product, f.value) for f in self.facts])

    def _instance(self, exprs, dims, seed):
        exprs = [*exprs, *(f.product for f in self.facts), *(f.value for f in self.facts)]
        values = random_instance(exprs, dims, seed=seed, samplers=self.samplers, definitions=self._definitions)
        for fact in self.facts:
            if _gap(evaluate(_difference(fact.product, fact.value), values, self._definitions)) != 0:
                raise ValueError(f"the sampled instance breaks the assumption {fact.text!r}: fix the sampler")
        return values

    def verify(self, name: str = "") -> ProofReport:
        start = time.perf_counter()
        reports = []
        previous = self.lhs
        for step in self.steps:
            residual = self._residual(previous, step.expr)
            reports.append(
                StepReport(to_latex(previous), to_latex(step.expr), step.reason, not residual, _describe(residual))
            )
            previous = step.expr
        closes = bool(self.steps) and self.steps[-1].expr == self.rhs
        values = self._instance([self.lhs, self.rhs], self.explicit_dims, seed=0)
        concrete = _gap(evaluate(_difference(self.lhs, self.rhs), values, self._definitions)) == 0
        proved = closes and all(r.holds for r in reports) and concrete
        twins = tuple(self._reject(t) for t in self.twins)
        return ProofReport(
            name=name,
            proved=proved,
            symbolic_dims=self.symbolic_dims,
            steps=tuple(reports),
            twins=twins,
            concrete_check=concrete,
            seconds=time.perf_counter() - start,
        )

    def _reject(self, twin: Twin, attempts: int = 5) -> TwinReport:
        """A twin is rejected when its residual has terms left AND an exact instance refutes it."""
        residual = self._residual(twin.lhs, twin.rhs)
        dims = dict(twin.dims or self.explicit_dims)
        gap = None
        if residual:
            for seed in range(attempts):
                values = self._instance([twin.lhs, twin.rhs], dims, seed=seed)
                found = _gap(evaluate(_difference(twin.lhs, twin.rhs), values, self._definitions))
                if found:
                    gap = found
                    break
        return TwinReport(
            name=twin.name,
            description=twin.description,
            claim=rf"{to_latex(twin.lhs)} = {to_latex(twin.rhs)}",
            rejected=bool(residual) and gap is not None,
            symbolic_residual=_describe(residual),
            counterexample_gap=gap,
        )

    # -- rendering ------------------------------------------------------------------------------

    def statement_latex(self) -> str:
        return rf"{to_latex(self.lhs)} = {to_latex(self.rhs)}"

    def derivation_latex(self) -> str:
        """The chain as an ``aligned`` block, one checked step per line with its reason."""
        lines = [rf"& {to_latex(self.lhs)}"]
        for step in self.steps:
            lines.append(rf"={{}} & {to_latex(step.expr)} && \text{{{step.reason}}}")
        return "\\begin{aligned}\n" + " \\\\\n".join(lines) + "\n\\end{aligned}"

    def definitions_latex(self) -> list[str]:
        return [d.latex() for d in self.definitions]
