"""Markdown (with MathJax math) for identities, proofs and their reports.

The book renders every derivation with these functions, so what a reader sees is the proof
object itself, not retyped LaTeX.

>>> import circuitmath as cm
>>> from circuitmath.render import statement
>>> print(statement(cm.get_identity("layer_norm_fold")).splitlines()[0])
**Claim** (`layer_norm_fold`: Folding LayerNorm into its readers):
"""

from __future__ import annotations

from sympy import MatAdd

from ._algebra import to_latex
from ._kronecker import NOTATION, Apply
from ._proof import Proof, ProofReport
from ._registry import Identity

__all__ = [
    "md_text", "display_math", "equation", "statement", "definitions", "derivation", "steps", "twins",
    "summary",
]

#: Characters of LaTeX source per displayed line: MathJax 3 does not break long formulas itself.
LINE_BUDGET = 110


def md_text(text: str) -> str:
    """Plain text escaped for Markdown."""
    for char in "\\`*_[]<>|#":
        text = text.replace(char, "\\" + char)
    return text


def display_math(latex: str) -> str:
    return f"$$\n{latex}\n$$"


def _join(pieces: list[str], budget: int) -> list[str]:
    lines = [pieces[0]]
    for piece in pieces[1:]:
        joined = piece if piece.startswith("-") else f"+ {piece}"
        if len(lines[-1]) + len(joined) > budget:
            lines.append(joined)
        else:
            lines[-1] += f" {joined}"
    return lines


def _broken(expr, budget: int) -> list[str]:
    """LaTeX lines of ``expr``: a sum is cut between its terms, an operator sum applied to a
    matrix between the operator's terms (inside ``\\Big(`` ... ``\\Big)``)."""
    if isinstance(expr, MatAdd):
        pieces = []
        for term in expr.args:
            pieces += _broken(term, budget) if len(to_latex(term)) > budget else [to_latex(term)]
        return _join(pieces, budget)
    if isinstance(expr, Apply) and isinstance(expr.op, MatAdd) and len(to_latex(expr)) > budget:
        lines = _join([to_latex(term) for term in expr.op.args], budget)
        lines[0] = r"\Big(" + lines[0]
        lines[-1] += r"\Big) \cdot " + to_latex(expr.X)
        return lines
    return [to_latex(expr)]


def equation(*sides, first: str = "", budget: int = LINE_BUDGET) -> str:
    """``sides[0] = sides[1] = ...`` (matrix expressions) as one aligned display, each side on as
    many lines of about ``budget`` characters of LaTeX as it needs; ``first`` leads the first line.

    >>> from sympy import MatrixSymbol
    >>> A, B = MatrixSymbol("A", 2, 2), MatrixSymbol("B", 2, 2)
    >>> print(equation(A + B, B + A))
    $$
    \\begin{aligned}
     & A + B \\\\
    ={} & A + B
    \\end{aligned}
    $$
    """
    rows = []
    for i, side in enumerate(sides):
        for j, line in enumerate(_broken(side, budget)):
            lead = (first if i == 0 else "={}") if j == 0 else r"\quad"
            rows.append(f"{lead} & {line}")
    return display_math("\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}")


def _split_sum(latex: str) -> list[str]:
    """The terms of a sum written in LaTeX, split at `` + `` and `` - `` outside any bracket."""
    pieces, depth, start = [], 0, 0
    for i, char in enumerate(latex):
        depth += (char in "({[") - (char in ")}]")
        if depth == 0 and i > start and latex[i - 1] == " " and char in "+-" and latex[i + 1 : i + 2] == " ":
            pieces.append(latex[start:i].strip())
            start = i if char == "-" else i + 1
    pieces.append(latex[start:].strip())
    return [piece for piece in pieces if piece]


def _long_latex(latex: str, budget: int = LINE_BUDGET) -> str:
    """A LaTeX sum already printed, as a display cut into lines."""
    lines = _join(_split_sum(latex), budget)
    return display_math("\\begin{aligned}\n& " + " \\\\\n& \\quad ".join(lines) + "\n\\end{aligned}")


def _proof(identity_or_proof) -> Proof:
    return identity_or_proof.proof if isinstance(identity_or_proof, Identity) else identity_or_proof


def statement(identity: Identity, proof: Proof | None = None) -> str:
    """The claim of ``proof`` (default: the identity's), the identity's preconditions, and the
    proof's facts, assumptions and any limit to explicit sizes."""
    proof = proof or identity.proof
    lines = [f"**Claim** (`{identity.name}`: {md_text(identity.title)}):", "", equation(proof.lhs, proof.rhs)]
    lines += ["", "**Preconditions**:", ""]
    lines += [f"- {md_text(getattr(p, 'statement', p))}" for p in identity.preconditions]
    if proof.facts:
        lines += ["", "**Facts** the proof may use (every sampled instance is checked to satisfy them):", ""]
        lines += [f"- ${f.latex()}$: {md_text(f.text)}" for f in proof.facts]
    if proof.assumptions:
        lines += ["", "**Assumptions** of the proof:", ""]
        lines += [f"- {md_text(a)}" for a in proof.assumptions]
    if proof.explicit_only:
        lines += ["", f"**Proved for explicit sizes only**: {md_text(proof.explicit_only)}"]
    return "\n".join(lines)


def definitions(identity_or_proof) -> str:
    """The abbreviations the checker unfolds, one table row each; the tensor-product actions
    ``(A ⊗ B)·X := A X B^T`` are counted in one sentence instead of listed."""
    proof = _proof(identity_or_proof)
    own = [d for d in proof.definitions if d.text != NOTATION]
    notation = len(proof.definitions) - len(own)
    lines = []
    if own:
        lines += ["| symbol | definition | meaning |", "|---|---|---|"]
        lines += [f"| ${to_latex(d.symbol)}$ | ${to_latex(d.value)}$ | {md_text(d.text)} |" for d in own]
    if notation:
        lines += ["", f"and {notation} definitions of the form $(A \\otimes B) \\cdot X := A X B^\\top$, one for each"
                  " tensor product applied in the proof (sums act term by term, products right to left)."]
    return "\n".join(lines)


def derivation(identity_or_proof) -> str:
    """The checked chain: the left side, then each step after the reason it holds."""
    proof = _proof(identity_or_proof)
    lines = [equation(proof.lhs)]
    for step in proof.steps:
        lines += ["", f"{step.reason}:", "", equation(step.expr, first="={}")]
    return "\n".join(lines)


def steps(report: ProofReport) -> str:
    """A table of the steps: reason, whether it was checked, what is left of the difference."""
    lines = ["| step | reason | checked | normal form of the difference |", "|---|---|---|---|"]
    for i, step in enumerate(report.steps, 1):
        lines.append(f"| {i} | {step.reason} | {'yes' if step.holds else '**NO**'} | ${step.residual}$ |")
    return "\n".join(lines)


def twins(report: ProofReport, identity_or_proof=None) -> str:
    """A table of the negative twins, then each twin's wrong claim (cut into lines when the
    proof is given) and what is left of its difference in the normal form."""
    lines = ["| twin | the mistake | rejected | counterexample gap |", "|---|---|---|---|"]
    for t in report.twins:
        gap = "none found" if t.counterexample_gap is None else f"{t.counterexample_gap:g}"
        lines.append(f"| `{t.name}` | {md_text(t.description)} | {'yes' if t.rejected else '**NO**'} | {gap} |")
    lines += ["", "The wrong claims, and what the normal form keeps of each difference (non-zero, so not an identity):"]
    proof_twins = _proof(identity_or_proof).twins if identity_or_proof is not None else [None] * len(report.twins)
    for twin, t in zip(proof_twins, report.twins):
        claim = equation(twin.lhs, twin.rhs) if twin is not None else display_math(t.claim)
        lines += ["", f"`{t.name}` claims", "", claim, "", "and the difference keeps", "", _long_latex(t.symbolic_residual)]
    return "\n".join(lines)


def summary(report: ProofReport) -> str:
    """Four plain lines: status and time, steps, dimensions, twins."""
    r = report.as_dict()
    return "\n".join([
        f"{r['name']}: {r['status']} in {r['seconds']:.2f} s",
        f"  steps checked: {r['steps']}, failed: {r['failed_steps']}",
        f"  symbolic dimensions: {r['symbolic_dims']}, concrete check: {r['concrete_check']}",
        f"  negative twins rejected: {r['twins_rejected']} of {r['twins_total']}",
    ])
