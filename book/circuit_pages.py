"""Rendering shared by the circuits chapters: notation, attention, path expansion, composition.

Statements and derivations are printed from the proof objects. Long sums are cut into lines
(MathJax 3 does not break formulas itself), and the definitions ``op·X := A X B^T`` that make
every tensor product checkable are summarised once instead of listed node by node.
"""

from __future__ import annotations

from IPython.display import Markdown, display
from sympy import MatAdd

from circuitmath import render
from circuitmath._algebra import to_latex
from circuitmath._kronecker import NOTATION, Apply

BUDGET = 110  # characters of LaTeX source per displayed line


def _join(pieces: list[str], budget: int) -> list[str]:
    lines = [pieces[0]]
    for piece in pieces[1:]:
        joined = piece if piece.startswith("-") else f"+ {piece}"
        if len(lines[-1]) + len(joined) > budget:
            lines.append(joined)
        else:
            lines[-1] += f" {joined}"
    return lines


def broken(expr, budget: int = BUDGET) -> list[str]:
    """LaTeX lines of ``expr``: a sum is cut between its terms, an operator sum applied to a
    matrix between the operator's terms (with ``\\Big(`` ... ``\\Big)``, which may span lines)."""
    if isinstance(expr, MatAdd):
        pieces = []
        for term in expr.args:
            pieces += broken(term, budget) if len(to_latex(term)) > budget else [to_latex(term)]
        return _join(pieces, budget)
    if isinstance(expr, Apply) and isinstance(expr.op, MatAdd) and len(to_latex(expr)) > budget:
        lines = _join([to_latex(term) for term in expr.op.args], budget)
        lines[0] = r"\Big(" + lines[0]
        lines[-1] += r"\Big) \cdot " + to_latex(expr.X)
        return lines
    return [to_latex(expr)]


def equation(*sides, first: str = "") -> str:
    """``sides[0] = sides[1] = ...`` as one aligned block, each side on as many lines as it needs."""
    rows = []
    for i, side in enumerate(sides):
        for j, line in enumerate(broken(side)):
            lead = (first if i == 0 else "={}") if j == 0 else r"\quad"
            rows.append(f"{lead} & {line}")
    return render.display_math("\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}")


def show_statement(identity) -> None:
    """The claim (cut into lines), the preconditions of the numeric check, facts, assumptions."""
    proof = identity.proof
    lines = [f"**Claim** (`{identity.name}`: {render.md_text(identity.title)}):", "", equation(proof.lhs, proof.rhs)]
    lines += ["", "**Numeric check** (preconditions):", ""]
    lines += [f"- {render.md_text(p)}" for p in identity.preconditions]
    if proof.facts:
        lines += ["", "**Facts** the proof may use (every sampled instance is checked to satisfy them):", ""]
        lines += [f"- ${f.latex()}$: {render.md_text(f.text)}" for f in proof.facts]
    if proof.assumptions:
        lines += ["", "**Assumptions**:", ""]
        lines += [f"- {render.md_text(a)}" for a in proof.assumptions]
    if proof.explicit_only:
        lines += ["", f"**Proved for explicit sizes only**: {render.md_text(proof.explicit_only)}."]
    display(Markdown("\n".join(lines)))


def show_definitions(identity) -> None:
    """The proof's abbreviations, except the tensor-product ones (one rule covers them all)."""
    own = [d for d in identity.proof.definitions if d.text != NOTATION]
    notation = len(identity.proof.definitions) - len(own)
    lines = []
    if own:
        lines += ["| symbol | definition | meaning |", "|---|---|---|"]
        lines += [f"| ${to_latex(d.symbol)}$ | ${to_latex(d.value)}$ | {render.md_text(d.text)} |" for d in own]
    if notation:
        lines += ["", f"and {notation} definitions of the form $(A \\otimes B) \\cdot X := A X B^\\top$, one for each"
                  " tensor product applied in the proof (sums act term by term, products right to left)."]
    display(Markdown("\n".join(lines)))


def show_derivation(identity) -> None:
    """The left side, then each step after the reason it holds."""
    proof = identity.proof
    lines = [equation(proof.lhs)]
    for step in proof.steps:
        lines += ["", f"{step.reason}:", "", equation(step.expr, first="={}")]
    display(Markdown("\n".join(lines)))


def prove(identity):
    """Run the proof, print its summary, and fail the build unless it holds and every twin falls."""
    report = identity.prove()
    print(render.summary(report))
    assert report.ok, report.as_dict()
    assert report.concrete_check and all(step.holds for step in report.steps)
    assert report.twins, "an identity needs at least one negative twin"
    for twin in report.twins:
        assert twin.rejected and twin.counterexample_gap, f"negative twin {twin.name} was not rejected"
    return report


def _split_sum(latex: str) -> list[str]:
    """The terms of a sum written in LaTeX, split at ``+`` and ``-`` outside any bracket."""
    pieces, depth, start = [], 0, 0
    for i, char in enumerate(latex):
        depth += (char in "({[") - (char in ")}]")
        if depth == 0 and i > start and latex[i - 1] == " " and char in "+-" and latex[i + 1 : i + 2] == " ":
            pieces.append(latex[start:i].strip())
            start = i if char == "-" else i + 1
    pieces.append(latex[start:].strip())
    return [piece for piece in pieces if piece]


def _lines(latex: str, budget: int = BUDGET) -> str:
    terms = _split_sum(latex)
    return render.display_math("\\begin{aligned}\n& " + " \\\\\n& \\quad ".join(_join(terms, budget)) + "\n\\end{aligned}")


def show_report(report, identity) -> None:
    """The steps table, then each negative twin: the mistake, its wrong claim (cut into lines),
    the counterexample gap and what is left of its difference in the normal form."""
    lines = [render.steps(report), "", "### Negative twins", ""]
    lines += ["| twin | the mistake | rejected | counterexample gap |", "|---|---|---|---|"]
    for t in report.twins:
        gap = "none found" if t.counterexample_gap is None else f"{t.counterexample_gap:g}"
        lines.append(f"| `{t.name}` | {render.md_text(t.description)} | {'yes' if t.rejected else '**NO**'} | {gap} |")
    for twin, t in zip(identity.proof.twins, report.twins):
        lines += ["", f"`{t.name}` claims", "", equation(twin.lhs, twin.rhs)]
        lines += ["", "and the normal form of the difference keeps", "", _lines(t.symbolic_residual)]
    display(Markdown("\n".join(lines)))


def numeric_checks(identities, models, seeds=range(2)) -> list[tuple]:
    """Each identity's check and corruptions on each model and seed; asserts the verdicts.

    ``models`` maps a label to ``(cfg, dtype)``. Returns rows ``(identity, what, label, dtype,
    max error, tolerance, passed)`` for :func:`show_numeric_checks`.
    """
    import circuitmath as cm

    rows = []
    for identity in identities:
        for label, (cfg, dtype) in models.items():
            for seed in seeds:
                state_dict = cm.random_state_dict(cfg, seed=seed, dtype=dtype)
                result = identity.check(state_dict, cfg)
                assert result.passed, (identity.name, label, seed, result)
                rows.append((identity.name, "the identity's computation", label, dtype, result))
                for corruption in identity.corruptions:
                    wrong = identity.check_corruption(corruption, state_dict, cfg)
                    assert not wrong.passed, (identity.name, corruption, label, seed, wrong)
                    rows.append((identity.name, corruption, label, dtype, wrong))
    return rows


def show_numeric_checks(rows) -> None:
    merged: dict = {}
    for name, what, label, dtype, result in rows:
        merged.setdefault((name, what, label, dtype), []).append(result)
    lines = ["| identity | computation | model | dtype | largest error | smallest tolerance | passed |",
             "|---|---|---|---|---|---|---|"]
    for (name, what, label, dtype), results in merged.items():
        lines.append(
            f"| `{name}` | {render.md_text(what)} | {label} | `{str(dtype).removeprefix('torch.')}`"
            f" | {max(r.max_abs_error for r in results):.3g} | {min(r.tolerance for r in results):.3g}"
            f" | {sum(r.passed for r in results)} of {len(results)} |"
        )
    display(Markdown("\n".join(lines)))
