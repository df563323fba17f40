"""Markdown (with MathJax math) for identities, proofs and their reports.

The book renders every derivation with these functions, so what a reader sees is the proof
object itself, not retyped LaTeX.

>>> import circuitmath as cm
>>> from circuitmath.render import statement
>>> print(statement(cm.get_identity("layer_norm_fold")).splitlines()[0])
**Claim** (`layer_norm_fold`: Folding LayerNorm into its readers):
"""

from __future__ import annotations

from ._proof import ProofReport
from ._registry import Identity

__all__ = ["md_text", "tex_text", "display_math", "statement", "definitions", "derivation", "steps", "twins", "summary"]


def md_text(text: str) -> str:
    """Plain text escaped for Markdown."""
    for char in "\\`*_[]<>|#":
        text = text.replace(char, "\\" + char)
    return text


def tex_text(text: str) -> str:
    """Plain text escaped for ``\\text{...}`` as MathJax reads it: text mode is literal there
    (``_`` or ``%`` need no escape, and an escaped one would show its backslash), but braces
    must balance and ``$`` would open math."""
    for char in "\\{}$":
        text = text.replace(char, "\\" + char)
    return text


def _math_name(name: str) -> str:
    """An identifier set in math mode, where ``_`` would start a subscript."""
    return r"\mathtt{%s}" % name.replace("_", r"\_")


def display_math(latex: str) -> str:
    return f"$$\n{latex}\n$$"


def statement(identity: Identity) -> str:
    """The claim, the transform's preconditions, and the proof's facts and assumptions."""
    proof = identity.proof
    lines = [f"**Claim** (`{identity.name}`: {md_text(identity.title)}):", "", display_math(proof.statement_latex())]
    lines += ["", "**Preconditions** of the transform:", ""]
    lines += [f"- {md_text(p)}" for p in identity.preconditions]
    if proof.facts:
        lines += ["", "**Facts** the proof may use (every sampled instance is checked to satisfy them):", ""]
        lines += [f"- ${f.latex()}$: {md_text(f.text)}" for f in proof.facts]
    if proof.assumptions:
        lines += ["", "**Assumptions** of the proof:", ""]
        lines += [f"- {md_text(a)}" for a in proof.assumptions]
    if proof.explicit_only:
        lines += ["", f"**Explicit sizes only**: {md_text(proof.explicit_only)}"]
    return "\n".join(lines)


def _proof(identity_or_proof):
    return identity_or_proof.proof if isinstance(identity_or_proof, Identity) else identity_or_proof


def definitions(identity_or_proof) -> str:
    """The abbreviations the checker unfolds, one aligned row each."""
    rows = [
        d.latex().replace(":=", "&:=", 1) + rf" && \text{{{tex_text(d.text)}}}"
        for d in _proof(identity_or_proof).definitions
    ]
    return display_math("\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}")


def derivation(identity_or_proof) -> str:
    """The checked chain of equalities."""
    return display_math(_proof(identity_or_proof).derivation_latex())


def steps(report: ProofReport) -> str:
    """A table of the steps: reason, whether it was checked, what is left of the difference."""
    lines = ["| step | reason | checked | normal form of the difference |", "|---|---|---|---|"]
    for i, step in enumerate(report.steps, 1):
        lines.append(f"| {i} | {step.reason} | {'yes' if step.holds else '**NO**'} | ${step.residual}$ |")
    return "\n".join(lines)


def twins(report: ProofReport) -> str:
    """A table of the negative twins, their wrong claims and what is left of each difference."""
    lines = ["| twin | the mistake | rejected | counterexample gap |", "|---|---|---|---|"]
    for t in report.twins:
        gap = "none found" if t.counterexample_gap is None else f"{t.counterexample_gap:g}"
        lines.append(f"| `{t.name}` | {md_text(t.description)} | {'yes' if t.rejected else '**NO**'} | {gap} |")
    claims = " \\\\\n".join(rf"{_math_name(t.name)}: \quad & {t.claim}" for t in report.twins)
    lines += ["", "The wrong claims:", "", display_math("\\begin{aligned}\n" + claims + "\n\\end{aligned}")]
    lines += ["", "What is left of each difference in the normal form (non-zero, so not an identity):", ""]
    lines += [f"- `{t.name}`: ${t.symbolic_residual}$" for t in report.twins]
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
