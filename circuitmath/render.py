"""Markdown (with MathJax math) for identities, proofs and their reports.

The book renders every derivation with these functions, so what a reader sees is the proof
object itself, not retyped LaTeX.

>>> import circuitmath as cm
>>> from circuitmath.render import statement
>>> print(statement(cm.get_identity("fold_layer_norm")).splitlines()[0])
**Claim** (`fold_layer_norm`: Folding LayerNorm into its readers):
"""

from __future__ import annotations

import re

from sympy import MatAdd

from ._algebra import to_latex
from ._kronecker import NOTATION, Apply
from ._proof import Proof, ProofReport
from ._registry import Identity

__all__ = [
    "md_text", "prose", "display_math", "equation", "statement", "definitions", "derivation", "steps", "twins",
    "summary", "established",
]

#: Characters of LaTeX source per displayed line: MathJax 3 does not break long formulas itself.
LINE_BUDGET = 110
QUAD = r"\quad"


def md_text(text: str) -> str:
    """Plain text escaped for Markdown."""
    for char in "\\`*_[]<>|#":
        text = text.replace(char, "\\" + char)
    return text


_WORD_SUBSCRIPTS = ("in", "out", "pos", "gate", "writing", "eff")
#: ASCII fragments of plain-text preconditions and their typeset form.
_ASCII_MATH = [
    (re.compile(r"\b(LNPre|LN|RMSPre|RMS)\((\w)\)"), lambda m: rf"\mathrm{{{m.group(1)}}}({m.group(2)})"),
    (re.compile(r"\beps (==|=|>=|>) 0\b"), lambda m: {"==": "=", ">=": r"\ge"}.get(m.group(1), m.group(1)).join(
        [r"\varepsilon ", " 0"])),
    (re.compile(r"\b(scale|s) > 0\b"), lambda m: r"s > 0"),
    (re.compile(r"\bq = \|\|x C\|\|\^2 > 0"), lambda m: r"q = \lVert x C \rVert^2 > 0"),
    (re.compile(r"\bx C = x' C\b"), lambda m: r"x C = x' C"),
    (re.compile(r"\b(\d+) x (\d+)\b"), lambda m: rf"{m.group(1)} \times {m.group(2)}"),
    (re.compile(r"\bR\^(\d+)"), lambda m: rf"\mathbb{{R}}^{m.group(1)}"),
    (re.compile(r"\b(rho|eps)\b"), lambda m: {"rho": r"\rho", "eps": r"\varepsilon"}[m.group(1)]),
    (re.compile(r"(?<![\w`])([A-Za-z])_([A-Za-z]\w*|\d+)(?![\w(])"),
     lambda m: rf"{m.group(1)}_\mathrm{{{m.group(2)}}}" if m.group(2) in _WORD_SUBSCRIPTS else f"{m.group(1)}_{{{m.group(2)}}}"),
]
_CODE_NAME = re.compile(r"(?<![\w`$\\])([a-z][a-z0-9]+(?:_[a-z0-9]+)+)(?![\w`])")


def prose(text: str) -> str:
    """Plain text that names weights and norms in ASCII (``W_Q``, ``LNPre(x)``, ``eps == 0``) as
    Markdown with those names typeset as math and code identifiers (``normalization_type``) as code."""
    spans = []
    for pattern, latex in _ASCII_MATH:
        spans += [(m.start(), m.end(), f"${latex(m)}$") for m in pattern.finditer(text)]
    spans += [(m.start(), m.end(), f"`{m.group(1)}`") for m in _CODE_NAME.finditer(text)]
    out, at = [], 0
    for start, end, replacement in sorted(spans, key=lambda span: (span[0], -span[1])):
        if start < at:
            continue  # inside an earlier match
        out += [md_text(text[at:start]), replacement]
        at = end
    return "".join(out + [md_text(text[at:])])


def _fact_lines(facts) -> list[str]:
    """One line per distinct explanation: the facts it covers, typeset, then the explanation
    unless it only restates them in ASCII."""
    grouped: dict[str, list[str]] = {}
    for fact in facts:
        grouped.setdefault(fact.text, []).append(f"${fact.latex()}$")
    lines = []
    for text, formulas in grouped.items():
        words = text.split(":")[0] if re.search(r"=|\^T|diag\(", text) else text
        words = "" if re.search(r"=|\^T|diag\(", words) else words
        lines.append(f"- {', '.join(formulas)}" + (f": {prose(words)}" if words else ""))
    return lines


def display_math(latex: str) -> str:
    """A display equation: ``latex`` between ``$$`` lines of its own."""
    return f"$$\n{latex}\n$$"


def _factors(latex: str) -> list[str]:
    """The top-level factors of a product written in LaTeX: split at spaces outside braces and
    outside ``\\left ... \\right`` pairs."""
    tokens, depth, start, i = [], 0, 0, 0
    while i < len(latex):
        if latex.startswith("\\left", i):
            depth, i = depth + 1, i + 5
        elif latex.startswith("\\right", i):
            depth, i = depth - 1, i + 6
        else:
            char = latex[i]
            depth += (char == "{") - (char == "}")
            if char == " " and depth == 0 and latex[start:i].strip():
                tokens.append(latex[start:i].strip())
                start = i
            i += 1
    return tokens + [latex[start:].strip()]


def _group(token: str) -> str | None:
    """The inside of ``\\left( ... \\right)`` when ``token`` is exactly one such group."""
    opening, closing = "\\left(", "\\right)"
    if not (token.startswith(opening) and token.endswith(closing)):
        return None
    inner = token[len(opening):-len(closing)]
    depth = 0
    for i in range(len(inner)):  # the opening bracket must close only at the very end
        depth += inner.startswith("\\left", i) - inner.startswith("\\right", i)
        if depth < 0:
            return None
    return inner


def _pack(pieces: list[list[str]], budget: int) -> list[str]:
    """Lines from pieces (each a list of lines): a piece's first line joins the line before it
    when both fit in ``budget``."""
    lines: list[str] = []
    for piece in pieces:
        if lines and len(lines[-1]) + 1 + len(piece[0]) <= budget:
            lines[-1] += " " + piece[0]
            lines += piece[1:]
        else:
            lines += piece
    return lines


def _lines(latex: str, budget: int) -> list[str]:
    """``latex`` cut into balanced lines of about ``budget`` characters: a sum between its terms,
    a product between its factors, and a parenthesised group too long for one line opened into
    ``\\Big(`` ... ``\\Big)`` lines. MathJax 3 does not break long formulas itself."""
    if len(latex) <= budget:
        return [latex]
    terms = _split_sum(latex)
    if len(terms) > 1:
        pieces = []
        for k, term in enumerate(terms):
            sign = "" if k == 0 or term.startswith("-") else "+ "
            sub = _lines(term, budget - len(sign))
            pieces.append([sign + sub[0], *sub[1:]])
        return _pack(pieces, budget)
    pieces = []
    for token in _factors(latex):
        inner = _group(token) if len(token) > budget else None
        if inner is None:
            pieces.append([token])
        else:
            sub = _lines(inner, budget - 5)
            sub[0] = "\\Big(" + sub[0]
            sub[-1] = sub[-1] + "\\Big)"
            pieces.append(sub)
    return _pack(pieces, budget)


def _broken(expr, budget: int) -> list[str]:
    """LaTeX lines of the matrix expression ``expr`` (see :func:`_lines`)."""
    return _lines(to_latex(expr), budget)


def _rows(expr, lead: str, budget: int, tag: str = "") -> list[str]:
    """Rows of an ``aligned`` block for ``expr``: ``lead`` before the first, ``tag`` after its last."""
    rows = []
    for j, line in enumerate(_broken(expr, budget)):
        rows.append(f"{lead if j == 0 else QUAD} & {line}")
    if tag:
        rows[-1] += f" && {tag}"
    return rows


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
        rows += _rows(side, first if i == 0 else "={}", budget)
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
    """A LaTeX sum already printed, as a display cut into lines; a coefficient 1 is not written."""
    terms = [re.sub(r"^(-\s*)?1 (?=[\\A-Za-z{(])", lambda m: m.group(1) or "", term) for term in _split_sum(latex)]
    lines = _lines(" + ".join(terms).replace("+ -", "-"), budget)
    return display_math("\\begin{aligned}\n& " + " \\\\\n& \\quad ".join(lines) + "\n\\end{aligned}")


def _proof(identity_or_proof) -> Proof:
    return identity_or_proof.proof if isinstance(identity_or_proof, Identity) else identity_or_proof


def statement(identity: Identity, proof: Proof | None = None) -> str:
    """The claim of ``proof`` (default: the identity's), the identity's preconditions, and
    everything the proof assumes: what the claim's symbols stand for, its facts and nonzero
    hypotheses, the assumptions it states in words; and any limit to explicit sizes."""
    proof = proof or identity.proof
    lines = [f"**Claim** (`{identity.name}`: {md_text(identity.title)}):", "", equation(proof.lhs, proof.rhs)]
    lines += ["", "**Preconditions**:", ""]
    lines += [f"- {prose(getattr(p, 'statement', p))}" for p in identity.preconditions] or ["- none"]
    values = [f for f in proof.facts if f.fixes is not None]
    facts = [a for a in proof.axioms if a not in values]
    count = len(proof.axioms) + len(proof.assumptions)
    if count:
        lines += ["", f"**Assumptions** ({count}): the claim is proved where they hold."]
    if values:
        lines += ["", "What the symbols of the claim stand for:", ""]
        lines += _fact_lines(values)
    if facts:
        lines += ["", "Facts the proof may use (every sampled instance is checked to satisfy them):", ""]
        lines += _fact_lines(facts)
    if proof.assumptions:
        lines += ["", "Stated in words (not checked by the engine):", ""]
        lines += [f"- {prose(a)}" for a in proof.assumptions]
    if proof.explicit_only:
        lines += ["", f"**Proved for explicit sizes only**: {prose(proof.explicit_only)}"]
    return "\n".join(lines)


def definitions(identity_or_proof) -> str:
    """What the checker unfolds, one table row each: the definitions (fresh symbols), then the
    facts that give a symbol of the claim its value, marked as assumed; the tensor-product
    actions ``(A ⊗ B)·X := A X B^T`` are counted in one sentence instead of listed."""
    proof = _proof(identity_or_proof)
    own = [d for d in proof.definitions if d.text != NOTATION]
    values = [f for f in proof.facts if f.fixes is not None]
    notation = len(proof.definitions) - len(own)
    lines = []
    if own or values:
        lines += ["| symbol | definition | meaning |", "|---|---|---|"]
        lines += [f"| ${to_latex(d.symbol)}$ | ${to_latex(d.value)}$ | {md_text(d.text)} |" for d in own]
        lines += [f"| ${to_latex(f.product)}$ | ${to_latex(f.value)}$ | {md_text(f.text)} (assumed: a fact of the claim) |"
                  for f in values]
    if notation:
        lines += ["", f"and {notation} definitions of the form $(A \\otimes B) \\cdot X := A X B^\\top$, one for each"
                  " tensor product applied in the proof (sums act term by term, products right to left)."]
    return "\n".join(lines)


def derivation(identity_or_proof, *, budget: int = LINE_BUDGET) -> str:
    """The checked chain as one aligned display: the left side, then each step on lines that
    begin with ``=`` and end with the step's number on the right; the reasons follow the display,
    numbered (a reason beside its line would make the display wider than the page).
    """
    proof = _proof(identity_or_proof)
    rows = _rows(proof.lhs, "", budget)
    for i, step in enumerate(proof.steps, 1):
        rows += _rows(step.expr, "={}", budget, tag=rf"\text{{({i})}}")
    block = display_math("\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}")
    reasons = [f"{i}. {step.reason}" for i, step in enumerate(proof.steps, 1)]
    return "\n".join([block, "", "Why each step holds (every line was checked, whatever its reason says):", "", *reasons])


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
    proof_twins = _proof(identity_or_proof).twins if identity_or_proof is not None else [None] * len(report.twins)
    for twin, t in zip(proof_twins, report.twins):
        claim = equation(twin.lhs, twin.rhs) if twin is not None else display_math(t.claim)
        lines += ["", f"**`{t.name}`** claims", "", claim, "", "which leaves the non-zero difference", "",
                  _long_latex(t.symbolic_residual)]
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


def _sizes(proof: Proof) -> list[str]:
    """The symbolic sizes of the matrices in the claim, as LaTeX, sorted."""
    from sympy import MatrixSymbol, Symbol

    sizes = {dim for side in (proof.lhs, proof.rhs) for m in side.atoms(MatrixSymbol) for dim in m.shape
             if isinstance(dim, Symbol)}
    return sorted(to_latex(dim) for dim in sizes)


#: Characters of LaTeX up to which an axiom is shown as its formula in a chapter's summary (longer
#: ones by their text: MathJax 3 does not break inline math).
INLINE_BUDGET = 60


def _axioms(report: ProofReport) -> list[str] | None:
    """The axioms the report says its proof rests on, as Markdown (a short formula, else its
    text); ``None`` when reports do not record them (the key is absent from ``as_dict``)."""
    axioms = report.as_dict().get("axioms")
    if axioms is None:
        return None
    if isinstance(axioms, dict):
        axioms = list(axioms)
    shown = []
    for a in axioms:
        if isinstance(a, dict) and a.get("latex") and len(a["latex"]) <= INLINE_BUDGET:
            shown.append(f"${a['latex']}$")
        else:
            shown.append(prose(str(a.get("name") or a.get("text") or a) if isinstance(a, dict) else str(getattr(a, "name", a))))
    return shown


def established(proved, numbers=()) -> str:
    """What a chapter established, as Markdown: for each ``(report, identity)`` in ``proved``,
    what was proved and for which sizes, which wrong versions the proof refuted, which wrong
    transforms the numeric check rejects and the axioms the proof rests on (when reports record
    them); then ``numbers``, one Markdown line each, the numeric results the chapter measured.
    """
    lines = []
    for report, identity in proved:
        proof = identity.proof
        r = report.as_dict()
        if proof.explicit_only:
            sizes = "for explicit sizes only"
        elif r["symbolic_dims"]:
            dims = _sizes(proof)
            sizes = "for every size" + (" (" + ", ".join(f"${d}$" for d in dims) + " symbolic)" if dims else "")
        else:
            sizes = "for the explicit sizes of its exact check"
        verdict = "proved" if r["status"] == "proved" else "**NOT proved**"
        parts = [f"{verdict} in {r['steps']} checked steps {sizes}"]
        twins = [f"`{t.name}`" for t in report.twins if t.rejected]
        if twins:
            parts.append(f"refutes {len(twins)} wrong version{'s' if len(twins) > 1 else ''} ({', '.join(twins)})"
                         " with exact counterexamples")
        if identity.wrong_everywhere:
            names = ", ".join(f"`{c}`" for c in identity.wrong_everywhere)
            parts.append(f"wrong rewrite{'s' if len(identity.wrong_everywhere) > 1 else ''}: {names}")
        axioms = _axioms(report)
        if axioms is not None:
            parts.append("rests on the axioms " + ", ".join(axioms) if axioms
                         else "rests on no axiom beyond the definitions it unfolds")
        stated = [a["text"] for a in r.get("assumptions", ()) if a.get("kind") == "stated"]
        if stated:
            parts.append("assumes in words " + "; ".join(prose(a) for a in stated))
        lines.append(f"- **`{identity.name}`** ({md_text(identity.title)}): " + "; ".join(parts) + ".")
    if numbers:
        lines += ["", "Measured when this page was built:", "", *[f"- {n}" for n in numbers]]
    return "\n".join(lines)
