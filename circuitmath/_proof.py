"""Proofs as chains of sympy-checked equalities, and negative twins that must be rejected."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import sympy
from sympy import Identity, MatAdd, MatMul, MatrixExpr, MatrixSymbol, OneMatrix, Symbol, ZeroMatrix

from ._algebra import IllTyped, NotExact, normal_form, same_size, shape_of
from ._instances import evaluate, random_instance
from ._latex import to_latex
from ._proof_terms import Definition, Fact, FactError, Nonzero, Step, Twin

__all__ = [
    "Definition", "Fact", "FactError", "Nonzero", "Step", "Twin", "Proof", "ProofReport", "StepReport", "TwinReport",
]


@dataclass(frozen=True)
class StepReport:
    """One step's verdict. The LaTeX (``before``, ``after``, ``residual``) is written when read:
    printing is most of the cost of a proof, and ``prove`` reads none of it."""

    before_expr: sympy.Basic = field(repr=False)
    after_expr: sympy.Basic = field(repr=False)
    reason: str
    holds: bool
    residual_terms: object = field(repr=False)  # the residual terms, or the text of a type error
    #: The same step evaluated exactly on every instance of the second check (``False`` when it
    #: fails on one, or could not be evaluated).
    instances_agree: bool = True

    @property
    def before(self) -> str:
        return to_latex(self.before_expr)

    @property
    def after(self) -> str:
        return to_latex(self.after_expr)

    @property
    def residual(self) -> str:
        return self.residual_terms if isinstance(self.residual_terms, str) else _describe(self.residual_terms)


@dataclass(frozen=True)
class TwinReport:
    name: str
    description: str
    lhs: sympy.Basic = field(repr=False)
    rhs: sympy.Basic = field(repr=False)
    rejected: bool = False
    residual_terms: object = field(default=None, repr=False)
    counterexample_gap: float | None = None

    @property
    def claim(self) -> str:
        return rf"{to_latex(self.lhs)} = {to_latex(self.rhs)}"

    @property
    def symbolic_residual(self) -> str:
        return self.residual_terms if isinstance(self.residual_terms, str) else _describe(self.residual_terms)


@dataclass(frozen=True)
class ProofReport:
    name: str
    proved: bool
    symbolic_dims: bool
    steps: tuple[StepReport, ...]
    twins: tuple[TwinReport, ...]
    concrete_check: bool
    seconds: float
    #: Why the claim is not proved (empty when it is): ill-typed steps, failed steps, bad
    #: definitions, a chain that does not reach the claim, instances that disagree.
    reasons: tuple[str, ...] = ()
    #: Everything the proof assumes: its facts and nonzero hypotheses (:class:`Fact`,
    #: :class:`Nonzero`, its lemmas' included), then the assumptions it states in words (``str``).
    assumed: tuple = field(default=(), repr=False)
    #: The sizes of the instances of the second check.
    instances: tuple[dict, ...] = ()
    #: The reports of the proof's lemmas, each named, with their own twins.
    lemmas: tuple["ProofReport", ...] = field(default=(), repr=False)

    @property
    def twins_rejected(self) -> int:
        return sum(t.rejected for t in self.twins)

    @property
    def axioms(self) -> tuple[tuple[str, str], ...]:
        """The facts and nonzero hypotheses the proof assumes without proof, as ``(LaTeX, text)``
        (written when read: printing is most of the cost of a proof)."""
        return tuple((a.latex(), a.text) for a in self.assumed if not isinstance(a, str))

    @property
    def assumptions(self) -> tuple[dict, ...]:
        """Every assumption, one ``{"kind", "latex", "text"}`` each: ``value`` (a fact giving a
        symbol of the claim its value), ``fact``, ``invertible``, ``nonzero`` (checked on every
        sampled instance), ``stated`` (said in words, not checked by the engine)."""
        return tuple(_assumption(a) for a in self.assumed)

    @property
    def ok(self) -> bool:
        """The claim is proved and every twin is rejected, the lemmas' twins included."""
        return self.proved and self.twins_rejected == len(self.twins) and all(lemma.ok for lemma in self.lemmas)

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
            "failed_steps": [s.reason for s in self.steps if not (s.holds and s.instances_agree)],
            "accepted_twins": [t.name for t in self.twins if not t.rejected] + [
                f"{lemma['name']}/{twin}" for lemma in map(_lemma_row, self.lemmas) for twin in lemma["accepted_twins"]],
            "reasons": list(self.reasons),
            "axioms": [{"latex": latex, "text": text} for latex, text in self.axioms],
            "assumptions": list(self.assumptions),
            "instances": [{str(s): int(v) for s, v in i.items()} for i in self.instances],
            "lemmas": [_lemma_row(lemma) for lemma in self.lemmas],
        }


def _lemma_row(report: ProofReport) -> dict:
    """A lemma's verdict as a row of its proof's ``as_dict``: status, sizes, twins."""
    return {
        "name": report.name,
        "status": "proved" if report.ok else "failed",
        "symbolic_dims": report.symbolic_dims,
        "steps": len(report.steps),
        "twins_rejected": report.twins_rejected,
        "twins_total": len(report.twins),
        "accepted_twins": [t.name for t in report.twins if not t.rejected],
        "lemmas": [_lemma_row(lemma) for lemma in report.lemmas],
    }


def _assumption(a) -> dict:
    """One assumption of a report as ``{"kind", "latex", "text"}``."""
    if isinstance(a, str):
        return {"kind": "stated", "latex": "", "text": a}
    if isinstance(a, Nonzero):
        kind = "nonzero"
    else:
        kind = "invertible" if a.invertible_matrix is not None else "value" if a.fixes is not None else "fact"
    return {"kind": kind, "latex": a.latex(), "text": a.text}


def _describe(terms) -> str:
    """The residual terms as LaTeX, ``0`` when none are left."""
    parts = [
        (to_latex(MatMul(*f)) if c == 1 else "-" + to_latex(MatMul(*f)) if c == -1 else to_latex(MatMul(c, *f)))
        if f else to_latex(c)
        for f, c in terms.items()
    ]
    return " + ".join(parts).replace("+ -", "-") or "0"


def _difference(a, b):
    """``a - b`` left unevaluated: sympy's ``MatrixExpr.__sub__`` runs ``doit``, which evaluates
    symbolic sums and can take seconds before the normal form even starts."""
    if isinstance(a, MatrixExpr) != isinstance(b, MatrixExpr):
        raise IllTyped(f"{a} = {b} equates a matrix and a scalar")
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


def _symbols_of(expr) -> set:
    """Every symbol ``expr`` mentions: scalars, matrices and the sizes of matrices."""
    expr = sympy.sympify(expr)
    found = set(expr.free_symbols) | set(expr.atoms(MatrixSymbol))
    for m in expr.atoms(MatrixSymbol):
        for size in m.shape:
            found |= sympy.sympify(size).free_symbols
    return found


def _singular(matrix, definitions, invertible) -> bool:
    """``matrix`` is singular whatever its symbols: zero, a matrix of ones, or explicit with
    determinant 0."""
    if (isinstance(matrix, OneMatrix) and matrix.shape != (1, 1)) or (isinstance(matrix, sympy.MatrixBase) and matrix.det() == 0):
        return True
    return not normal_form(matrix, definitions, (), invertible)


def _mentions(expr, symbols) -> set:
    """The members of ``symbols`` that occur in ``expr``."""
    expr = sympy.sympify(expr)
    return {s for s in symbols if expr.has(s)}


#: Sizes of the second check's first instance start here; the second instance adds one to each.
FIRST_SIZE = 2


@dataclass(frozen=True)
class Proof:
    """A machine-checked derivation of ``lhs = rhs``.

    ``steps`` lead from ``lhs`` to ``rhs``: each step's expression must equal the one before it in
    the normal form of :mod:`circuitmath._algebra`, with ``definitions`` unfolded, and (a second,
    independent check) on every instance of ``check_dims`` evaluated exactly. The last step's
    expression must be ``rhs`` itself. Every expression is type-checked; inverses are allowed
    only of matrices that a :meth:`Fact.invertible` declares invertible; coefficients must be
    exact. ``check_dims`` defaults to two instances whose dimension symbols take distinct sizes
    (``2, 3, ...`` then ``3, 4, ...``, ordered like ``explicit_dims``), so no matrix of two
    different sizes is square. ``explicit_dims`` gives the sizes for the twins'
    counterexamples (and orders the instances); ``samplers`` draws symbols that carry an
    assumption. ``explicit_only`` is set, with the reason, for a proof that only holds for the
    sizes it was run at.
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
    check_dims: tuple[Mapping, ...] | None = None
    nonzero: tuple[Nonzero, ...] = ()
    #: Further claims about the same symbols, each a named :class:`Proof` that must hold too
    #: (``factored_svd``: the factors it builds have orthonormal columns).
    lemmas: tuple[tuple[str, "Proof"], ...] = ()

    @property
    def symbolic_dims(self) -> bool:
        """Every matrix in the proof has symbolic sizes (``1`` for vectors allowed)."""
        if self.explicit_only:
            return False
        exprs = [self.lhs, self.rhs, *(s.expr for s in self.steps), *self._definitions.values()]
        symbols = set().union(*(sympy.sympify(e).atoms(MatrixSymbol) for e in exprs))
        return bool(symbols) and all(
            (sympy.sympify(n).free_symbols or n == 1) for s in symbols for n in s.shape
        )

    @property
    def _definitions(self) -> dict:
        """What the checker unfolds: the definitions, and the facts that give a symbol its value."""
        return {d.symbol: d.value for d in self.definitions} | {f.product: f.value for f in self.facts if f.fixes is not None}

    @property
    def _invertible(self) -> tuple:
        return tuple(f.invertible_matrix for f in self.facts if f.invertible_matrix is not None)

    @property
    def _facts(self) -> list:
        return [(f.product, f.value) for f in self.facts if f.invertible_matrix is None and f.fixes is None]

    @property
    def axioms(self) -> tuple:
        """What the proof assumes without proof (its lemmas' included): its facts and the nonzero
        hypotheses it does not derive. Each is checked on every sampled instance."""
        own = (*self.facts, *(h for h in self.nonzero if h.because is None))
        inherited = tuple(a for _name, lemma in self.lemmas for a in lemma.axioms if a not in own)
        return own + tuple(dict.fromkeys(inherited))

    def _nonzero_errors(self) -> list[str]:
        errors = []
        known = {h.expr for h in self.nonzero}

        def nonzero(w) -> bool:
            if w in known:
                return True
            if isinstance(w, MatMul):
                return all(a in known for a in w.args)
            return False

        for h in self.nonzero:
            if h.because is None:
                continue
            M, w = h.because
            try:
                if self._residual(MatMul(M, h.expr), w):
                    errors.append(f"{h.text}: {to_latex(M)} {to_latex(h.expr)} = {to_latex(w)} does not hold")
                elif not nonzero(w):
                    errors.append(f"{h.text}: {to_latex(w)} is not known to be nonzero")
            except (IllTyped, NotExact) as error:
                errors.append(f"{h.text}: {error}")
        return errors

    def _residual(self, a, b):
        return normal_form(_difference(a, b), self._definitions, self._facts, self._invertible)

    def _shape(self, expr):
        return shape_of(expr, self._definitions, self._invertible)

    # -- static checks ----------------------------------------------------------------------------

    def _definition_errors(self) -> list[str]:
        """Definitions introduce fresh symbols: each key is a symbol that occurs nowhere before its
        definition (not in the claim, not in an earlier definition, not drawn by a sampler) and is
        defined once, with the shape of its value; a notation node (``(A ⊗ B)·X``) is defined only
        by the notation's own rule. Anything else a proof relies on is a :class:`Fact`."""
        errors = []
        keys = [d.symbol for d in self.definitions]
        seen = _symbols_of(self.lhs) | _symbols_of(self.rhs)
        where = {s: "the claim" for s in seen}
        where.update({s: "a sampler" for s in self.samplers if s not in where})
        seen |= set(self.samplers)
        for number, d in enumerate(self.definitions, 1):
            key = d.symbol
            errors += self._key_errors(d, seen, where, keys)
            where.update({s: f"definition {number} ({to_latex(key)} := ...)" for s in _symbols_of(d.value) if s not in where})
            seen |= _symbols_of(d.value) | {key}
            where.setdefault(key, f"definition {number}")
            try:
                key_shape, value_shape = self._shape(key) if isinstance(key, MatrixExpr) else None, self._shape(d.value)
            except (IllTyped, NotExact) as error:
                errors.append(f"definition of {to_latex(key)}: {error}")
                continue
            if (key_shape is None) != (value_shape is None) or (
                key_shape is not None and not all(map(same_size, key_shape, value_shape))
            ):
                errors.append(f"definition of {to_latex(key)}: a {key_shape} symbol := a {value_shape} value")
        fixed = [f.fixes for f in self.facts if f.fixes is not None]
        for key in dict.fromkeys(fixed):
            if key in keys or fixed.count(key) > 1:
                errors.append(f"{to_latex(key)} is given a value {keys.count(key) + fixed.count(key)} times")
            if key in self.samplers:
                errors.append(f"{to_latex(key)} has a sampler and a fact giving its value: drop one")
        return errors + self._cycle_errors([*keys, *fixed])

    def _key_errors(self, d: Definition, seen: set, where: dict, keys: list) -> list[str]:
        """Why ``d``'s key is not a fresh symbol (nothing when it is)."""
        key, text = d.symbol, f"definition {to_latex(d.symbol)} := {to_latex(d.value)}"
        if getattr(key, "is_notation", False):
            rule = key.meaning(self._definitions) if hasattr(key, "meaning") else None
            if rule is None:
                return [f"{text}: {to_latex(key)} is notation with no rule of its own; state its value as a Fact"]
            if rule != d.value:
                return [f"{text}: the notation's rule gives {to_latex(rule)}, not the value given"]
            return [] if keys.count(key) == 1 else [f"{to_latex(key)} is defined {keys.count(key)} times"]
        if not isinstance(key, (MatrixSymbol, Symbol)):
            return [f"{text}: the key is an expression, not a fresh symbol"]
        if keys.count(key) > 1:
            return [f"{to_latex(key)} is defined {keys.count(key)} times"]
        if key in seen:
            return [
                f"{text}: {to_latex(key)} already occurs in {where[key]}, so this is an assumption about it, not a"
                " definition: a definition introduces a fresh symbol (state the equation as a Fact, which is"
                " listed among the proof's assumptions, or rename the symbol)"
            ]
        return []

    def _cycle_errors(self, keys: list) -> list[str]:
        uses = {key: _mentions(value, keys) for key, value in self._definitions.items()}

        def cycle(key, path):
            for used in uses.get(key, ()):
                if used in path:
                    return [*path[path.index(used):], used]
                found = cycle(used, [*path, used])
                if found:
                    return found
            return None

        for key in keys:
            found = cycle(key, [key])
            if found:
                return ["circular definition: " + " -> ".join(to_latex(k) for k in found)]
        return []

    def _fact_errors(self) -> list[str]:
        errors = []
        for f in self.facts:
            try:
                if f.invertible_matrix is not None:
                    rows, cols = self._shape(f.invertible_matrix)
                    if not same_size(rows, cols):
                        errors.append(f"fact {f.text!r}: a {rows} x {cols} matrix is not square: it cannot be invertible")
                    elif _singular(f.invertible_matrix, self._definitions, self._invertible):
                        errors.append(f"fact {f.text!r} declares {to_latex(f.invertible_matrix)} invertible, which is"
                                      " singular (zero, a matrix of ones, or of determinant 0)")
                    continue
                left, right = self._shape(f.product), self._shape(f.value)
                if f.fixes is not None and left is None and right is None:
                    continue  # a scalar symbol given a scalar value
                if left is None or right is None or not all(map(same_size, left, right)):
                    errors.append(f"fact {f.text!r} equates a {left} and a {right} expression")
            except (IllTyped, NotExact) as error:
                errors.append(f"fact {f.text!r}: {error}")
        return errors

    # -- the second check -------------------------------------------------------------------------

    def _dimension_symbols(self) -> list:
        exprs = [self.lhs, self.rhs, *(s.expr for s in self.steps), *(d.value for d in self.definitions)]
        exprs += [d.symbol for d in self.definitions] + [f.product for f in self.facts] + [f.value for f in self.facts]
        found = set()
        for e in exprs:
            for m in sympy.sympify(e).atoms(MatrixSymbol, OneMatrix, Identity, ZeroMatrix):
                for size in m.shape:
                    found |= sympy.sympify(size).free_symbols
        order = {s: i for i, s in enumerate(self.explicit_dims)}
        return sorted(found, key=lambda s: (self.explicit_dims.get(s, 0), order.get(s, len(order)), s.name))

    def instance_dims(self) -> tuple[dict, ...]:
        """The sizes of the second check: ``check_dims``, or two instances of distinct sizes."""
        if self.check_dims is not None:
            return tuple(dict(d) for d in self.check_dims)
        symbols = self._dimension_symbols()
        return tuple({s: FIRST_SIZE + shift + i for i, s in enumerate(symbols)} for shift in (0, 1))

    def _instance(self, exprs, dims, seed):
        exprs = [*exprs, *(f.product for f in self.facts), *(f.value for f in self.facts), *(h.expr for h in self.nonzero)]
        values = random_instance(exprs, dims, seed=seed, samplers=self.samplers, definitions=self._definitions)
        for fact in self.facts:
            if fact.fixes is not None:
                continue  # drawn from its value: it holds by construction
            try:
                broken = _gap(evaluate(_difference(fact.product, fact.value), values, self._definitions)) != 0
            except ValueError:  # a singular matrix under an inverse
                broken = True
            if broken:
                raise ValueError(f"the sampled instance breaks the assumption {fact.text!r}: fix the sampler")
        for h in self.nonzero:
            value = evaluate(h.expr, values, self._definitions) if isinstance(h.expr, MatrixExpr) else (
                sympy.sympify(h.expr).xreplace({k: sympy.sympify(v) for k, v in values.items() if not hasattr(v, "shape")})
            )
            if (all(x == 0 for x in value) if hasattr(value, "shape") else value == 0):
                raise ValueError(f"the sampled instance breaks the assumption {h.text!r}: fix the sampler")
        return values

    def _second_check(self, chain) -> tuple[list[bool], list[str]]:
        """Evaluate every expression of ``chain`` (and every definition) exactly on each instance."""
        agree = [True] * (len(chain) - 1)
        reasons = []
        definitions = self._definitions
        for number, dims in enumerate(self.instance_dims()):
            where = ", ".join(f"{s} = {v}" for s, v in dims.items())
            try:
                values = self._instance([*chain, *definitions], dims, seed=number)
                for key, value in definitions.items():
                    got = evaluate(value, values, definitions)
                    if isinstance(key, MatrixExpr):
                        want = tuple(int(sympy.sympify(n).xreplace(dims)) for n in key.shape)
                        if tuple(got.shape) != want:
                            reasons.append(f"definition of {to_latex(key)} has shape {got.shape}, not {want} ({where})")
                evaluated = [evaluate(e, values, definitions) for e in chain]
            except (ValueError, TypeError, KeyError, sympy.ShapeError) as error:
                reasons.append(f"instance {number} ({where}) could not be evaluated: {error}")
                return [False] * len(agree), reasons
            for i in range(len(agree)):
                a, b = evaluated[i], evaluated[i + 1]
                if a.shape != b.shape or _gap(a - b) != 0:
                    agree[i] = False
                    reasons.append(f"step {i + 1} fails on instance {number} ({where})")
        return agree, reasons

    def verify(self, name: str = "") -> ProofReport:
        """Check the chain and the twins. A malformed fact raises :class:`FactError`."""
        start = time.perf_counter()
        malformed = self._fact_errors()
        if malformed:
            raise FactError(f"{name or 'proof'}: " + "; ".join(malformed) + ": fix or drop the fact")
        reasons = self._definition_errors() + self._nonzero_errors()
        lemmas = tuple(lemma.verify(lemma_name) for lemma_name, lemma in self.lemmas)
        for lemma in lemmas:
            reasons += [f"lemma {lemma.name}: {r}" for r in lemma.reasons]
        try:
            lhs_shape, rhs_shape = self._shape(self.lhs), self._shape(self.rhs)
            if lhs_shape is None or rhs_shape is None or not all(map(same_size, lhs_shape, rhs_shape)):
                reasons.append(f"the claim equates a {lhs_shape} and a {rhs_shape} expression")
        except (IllTyped, NotExact) as error:
            reasons.append(f"the claim is ill-typed: {error}")
        reports = []
        previous = self.lhs
        unchecked = "not checked: the claim, its definitions or its facts are ill-formed" if reasons else None
        for number, step in enumerate(self.steps, 1):
            if unchecked:
                reports.append(StepReport(previous, step.expr, step.reason, False, unchecked))
                previous = step.expr
                continue
            try:
                residual = self._residual(previous, step.expr)
                if residual:
                    reasons.append(f"step {number} ({step.reason}) does not hold: {_describe(residual)} is left")
            except (IllTyped, NotExact) as error:
                residual = f"ill-typed: {error}"
                reasons.append(f"step {number} ({step.reason}) is ill-typed: {error}")
            reports.append(StepReport(previous, step.expr, step.reason, not residual, residual))
            previous = step.expr
        closes = bool(self.steps) and self.steps[-1].expr == self.rhs
        if not closes:
            reasons.append("the chain does not end at the right side of the claim")
        concrete = False
        if not reasons:
            agree, failures = self._second_check([self.lhs, *(s.expr for s in self.steps)])
            reports = [replace(r, instances_agree=a) for r, a in zip(reports, agree)]
            reasons += failures
            concrete = not failures
        twins = tuple(self._reject(t) for t in self.twins)
        return ProofReport(
            name=name,
            proved=not reasons,
            symbolic_dims=self.symbolic_dims,
            steps=tuple(reports),
            twins=twins,
            concrete_check=concrete,
            seconds=time.perf_counter() - start,
            reasons=tuple(reasons),
            assumed=(*self.axioms, *dict.fromkeys((*self.assumptions, *(a for _n, lm in self.lemmas for a in lm.assumptions)))),
            instances=self.instance_dims() if concrete else (),
            lemmas=lemmas,
        )

    def _reject(self, twin: Twin, attempts: int = 5) -> TwinReport:
        """A twin is rejected when it is well typed, its residual has terms left AND an exact
        instance refutes it."""
        try:
            residual = self._residual(twin.lhs, twin.rhs)
            text = residual
        except (IllTyped, NotExact) as error:
            residual, text = {}, f"ill-typed: {error}"
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
            lhs=twin.lhs,
            rhs=twin.rhs,
            rejected=bool(residual) and gap is not None,
            residual_terms=text,
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
