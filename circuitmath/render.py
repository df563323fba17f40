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

from ._latex import to_latex
from ._kronecker import NOTATION, Apply
from ._proof import Proof, ProofReport
from ._registry import Identity

__all__ = [
    "md_text", "prose", "display_math", "equation", "statement", "definitions", "derivation", "steps", "twins",
    "summary", "established", "identity_list",
]

#: Width of a displayed line, in units of :func:`_width` (MathJax 3 does not break long formulas
#: itself): 36 units take 370 to 580 px, so a step, its ``=`` and its number fit the book's 688 px
#: column at a 1280 px window; on a phone a display scrolls inside its own box.
LINE_BUDGET = 36
QUAD = r"\quad"
_SILENT = {"left", "right", "Big", "big", "Bigg", "bigg", "displaystyle", "limits", "nolimits"}
_WRAPPERS = {"mathrm", "operatorname", "mathbf", "text", "mathbb", "bar", "hat", "tilde", "boldsymbol", "mathcal",
             "mathit", "overline", "underbrace", "widetilde"}
_SPACES = {"quad": 1.0, "qquad": 2.0, ",": 0.17, ";": 0.28, ":": 0.22, "!": -0.17, " ": 0.25}


def _argument(latex: str, i: int) -> tuple[str, int]:
    """The group ``{...}`` (or the single token) starting at ``latex[i]``, and the index after it."""
    while i < len(latex) and latex[i] == " ":
        i += 1
    if i >= len(latex):
        return "", i
    if latex[i] == "{":
        depth = 0
        for j in range(i, len(latex)):
            depth += (latex[j] == "{") - (latex[j] == "}")
            if depth == 0:
                return latex[i + 1:j], j + 1
        return latex[i + 1:], len(latex)
    if latex[i] == "\\":
        m = re.match(r"\\([A-Za-z]+|.)", latex[i:])
        return m.group(0), i + len(m.group(0))
    return latex[i], i + 1


def _width(latex: str) -> float:
    """About how wide ``latex`` is typeset, in widths of a lowercase italic letter (an upright
    name counts its letters, a fraction its wider part, a sub- or superscript 0.7 of its own;
    measured against MathJax 3's rendering: 10 to 16 px a unit in the book's column)."""
    total, i = 0.0, 0
    while i < len(latex):
        c = latex[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+|.)", latex[i:])
            name, i = m.group(1), i + len(m.group(0))
            if name in _SILENT:
                continue
            if name in _SPACES:
                total += _SPACES[name]
            elif name in _WRAPPERS:
                arg, i = _argument(latex, i)
                total += _width(arg)
            elif name in ("frac", "tfrac", "dfrac"):
                a, i = _argument(latex, i)
                b, i = _argument(latex, i)
                total += max(_width(a), _width(b)) * (0.75 if name == "tfrac" else 0.9) + 0.3
            elif name == "sqrt":
                a, i = _argument(latex, i)
                total += _width(a) + 1.0
            elif name in ("sum", "prod"):
                total += 1.6
            elif name in ("log", "exp", "max", "min", "det", "tr"):
                total += 0.55 * len(name) + 0.2
            elif name in ("otimes", "cdot", "times", "ne", "le", "ge", "approx", "oplus", "circ"):
                total += 2.0
            else:
                total += 1.1
        elif c in "_^":
            arg, i = _argument(latex, i + 1)
            total += 0.7 * _width(arg)
        elif c in "{}& ":
            i += 1
        elif c in "+=<>":
            total += 2.0
            i += 1
        elif c == "-":
            total += 1.6
            i += 1
        elif c in "(),|[]":
            total += 0.5
            i += 1
        else:
            total += 1.35 if c.isupper() else 0.95
            i += 1
    return total


def md_text(text: str) -> str:
    """Plain text escaped for Markdown."""
    for char in "\\`*_[]<>|#":
        text = text.replace(char, "\\" + char)
    return text


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
     lambda m: rf"{m.group(1)}_\mathrm{{{m.group(2)}}}" if len(m.group(2)) > 1 and m.group(2).isalpha()
     else f"{m.group(1)}_{{{m.group(2)}}}"),
]
_CODE_NAME = re.compile(r"(?<![\w`$\\])([a-z][a-z0-9]+(?:_[a-z0-9]+)+)(?![\w`])")

_FUNCTIONS = {"diag": r"\operatorname{diag}", "exp": r"\exp", "log": r"\log", "act": r"\operatorname{act}",
              "log_softmax": r"\operatorname{log\_softmax}", "LNPre": r"\mathrm{LNPre}", "LN": r"\mathrm{LN}",
              "RMSPre": r"\mathrm{RMSPre}", "RMS": r"\mathrm{RMS}", "sqrt": r"\sqrt"}
_FUNCTION = "|".join(sorted(_FUNCTIONS, key=len, reverse=True))
_ATOM = (rf"(?:(?:{_FUNCTION})\([^()]*(?:\([^()]*\)[^()]*)*\)|rho|eps|\d+(?:\.\d+)?"
         r"|[A-Za-z](?:_[A-Za-z0-9]+)?'?)")
_SUP = r"(?:\^(?:-?T\b|-?\d+|[A-Za-z]\b|\{[^}]*\}|\([^()]*\)))?"
_FACTOR = rf"[-±]?[(|]*{_ATOM}{_SUP}(?:[)|]+{_SUP})*"
_OPERATOR = r"(?:\s*(?:!=|<=|>=|=|\+|-|/|<|>|⊗|·)\s*|\s+|(?=[(|]))"
#: A formula written in ASCII inside a sentence: factors joined by operators or side by side (or a
#: transpose alone); :func:`_formulas` keeps those that an operator, power, norm, function or
#: subscript tells from words.
_FORMULA = re.compile(rf"(?<![\w`$\\'(]){_FACTOR}(?:{_OPERATOR}{_FACTOR})+(?![\w(])|(?<![\w`$\\'])[A-Za-z]\^-?T\b")
_MATHY = re.compile(rf"[=<>+/^|⊗·]| - |\b(?:{_FUNCTION})\(|\w_\w|\b(?:rho|eps)\b")


def _balanced(text: str) -> str:
    """The longest start of ``text`` whose parentheses balance (a formula ends before a bracket
    of the sentence around it)."""
    depth, cut = 0, len(text)
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth < 0:
            return text[:i].rstrip()
        if depth == 0:
            cut = i + 1
    return text if depth == 0 else text[:cut].rstrip()


def _formulas(text: str):
    """``(start, end, latex)`` of every ASCII formula in ``text``."""
    at = 0
    while (m := _FORMULA.search(text, at)) is not None:
        start, found = m.start(), _balanced(m.group(0))
        if found.startswith("a "):  # the article, not a factor
            start, found = start + 2, found[2:]
        at = max(start + len(found), m.start() + 1)
        if len(found) > 1 and _MATHY.search(found) and _FORMULA.fullmatch(found):
            yield start, start + len(found), _formula_latex(found)


def _formula_latex(ascii_math: str) -> str:
    """The LaTeX of an ASCII formula found by :func:`_formulas`."""
    symbols = {"!=": r"\ne", "<=": r"\le", ">=": r"\ge", "⊗": r"\otimes", "·": r"\cdot ", "±": r"\pm "}
    latex = re.sub(r"!=|<=|>=|⊗|·|±", lambda m: symbols[m.group(0)], ascii_math)
    latex = re.sub(r"\^\{?(-?)T\}?", lambda m: r"^{-\top}" if m.group(1) else r"^\top", latex)
    latex = re.sub(r"\^\(([^()]*)\)", r"^{\1}", latex)
    latex = re.sub(r"\^(-\d+)", r"^{\1}", latex)
    latex = re.sub(r"\bsqrt\(([^()]*)\)", r"\\sqrt{\1}", latex)
    latex = re.sub(rf"\b({_FUNCTION})(?=\()", lambda m: _FUNCTIONS[m.group(1)], latex)
    latex = re.sub(r"\b(rho|eps)\b", lambda m: {"rho": r"\rho", "eps": r"\varepsilon"}[m.group(1)], latex)
    latex = re.sub(r"\b([A-Za-z])_hat\b", r"\\hat{\1}", latex)
    latex = re.sub(r"\b([A-Za-z])_([A-Za-z0-9]+)",
                   lambda m: rf"{m.group(1)}_\mathrm{{{m.group(2)}}}" if len(m.group(2)) > 1 and m.group(2).isalpha()
                   else rf"{m.group(1)}_{{{m.group(2)}}}", latex)
    if re.search(r"\b1\^|[A-Za-z)] 1\b|\b1 [A-Za-z]", ascii_math):  # 1 times matrices: the all-ones vector
        latex = re.sub(r"(?<![\w./^{])(?<!\{-)1(?![\w./}])", r"\\mathbf{1}", latex)
    bars = iter([r"\lVert ", r" \rVert"] * latex.count("|"))
    return re.sub(r"\|", lambda m: next(bars), latex)


def prose(text: str) -> str:
    """Plain text that names weights and norms in ASCII (``W_Q``, ``LNPre(x)``, ``eps == 0``) or
    writes formulas in it (``|x G| != |x|``, ``Q^T``, ``rho = (|x|^2/d + eps)^(-1/2)``) as Markdown
    with those typeset as math and code identifiers (``normalization_type``) as code."""
    spans = [(start, end, f"${latex}$") for start, end, latex in _formulas(text)]
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
        if lines and _width(lines[-1]) + _width(piece[0]) <= budget:
            lines[-1] += " " + piece[0]
            lines += piece[1:]
        else:
            lines += piece
    return lines


def _lines(latex: str, budget: int) -> list[str]:
    """``latex`` cut into balanced lines of about ``budget`` characters: a sum between its terms,
    a product between its factors, and a parenthesised group too long for one line opened into
    ``\\Big(`` ... ``\\Big)`` lines. MathJax 3 does not break long formulas itself."""
    if _width(latex) <= budget:
        return [latex]
    terms = _split_sum(latex)
    if len(terms) > 1:
        pieces = []
        for k, term in enumerate(terms):
            sign = "" if k == 0 or term.startswith("-") else "+ "
            sub = _lines(term, budget - _width(sign))
            pieces.append([sign + sub[0], *sub[1:]])
        return _pack(pieces, budget)
    pieces = []
    for token in _factors(latex):
        inner = _group(token) if _width(token) > budget else None
        if inner is None:
            pieces.append([token])
        else:
            sub = _lines(inner, budget - 2)
            sub[0] = "\\Big(" + sub[0]
            sub[-1] = sub[-1] + "\\Big)"
            pieces.append(sub)
    return _pack(pieces, budget)


def _positive_first(latex: str) -> str:
    """A sum written in LaTeX with its first positive term moved to the front (matrices add
    commutatively): ``- A + B`` reads ``B - A``."""
    terms = _split_sum(latex)
    first = next((k for k, term in enumerate(terms) if not term.startswith("-")), 0)
    if first == 0:
        return latex
    terms.insert(0, terms.pop(first))
    return " ".join([terms[0]] + [t if t.startswith("-") else "+ " + t for t in terms[1:]])


def _tidy(latex: str) -> str:
    """``latex`` as a reader expects it, the same expression: in every sum (inside each
    ``\\left( ... \\right)`` group too) a positive term first, and a group of two terms that
    cancel, such as ``(1 - 1)`` left by a step that has not yet dropped it, marked as zero."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(latex):
        if latex.startswith("\\left(", i):
            if depth == 0:
                out.append(latex[start:i])
                start = i
            depth, i = depth + 1, i + 6
        elif latex.startswith("\\right)", i):
            depth, i = depth - 1, i + 7
            if depth == 0:
                inner = _tidy(latex[start + 6:i - 7])
                terms = _split_sum(inner)
                group = f"\\left({inner}\\right)"
                cancels = len(terms) == 2 and terms[1].startswith("-") and terms[1][1:].strip() == terms[0]
                out.append(f"\\underbrace{{{group}}}_{{0}}" if cancels else group)
                start = i
        else:
            i += 1
    out.append(latex[start:])
    return _positive_first("".join(out))


def _broken(expr, budget: int) -> list[str]:
    """LaTeX lines of the matrix expression ``expr`` (see :func:`_lines` and :func:`_tidy`)."""
    return _lines(_tidy(to_latex(expr)), budget)


def _rows(expr, lead: str, budget: int, tag: str = "") -> list[str]:
    """Rows of an ``aligned`` block for ``expr``: ``lead`` before the first, ``tag`` after its
    last; a continuation row is indented under the expression, leaving the ``=`` column alone."""
    rows = []
    for j, line in enumerate(_broken(expr, budget)):
        rows.append(f"{lead} & {line}" if j == 0 else f" & {QUAD} {line}")
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
    lines = _lines(_tidy(" + ".join(terms).replace("+ -", "-")), budget)
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
        lines += [f"| ${to_latex(d.symbol)}$ | ${to_latex(d.value)}$ | {prose(d.text)} |" for d in own]
        lines += [f"| ${to_latex(f.product)}$ | ${to_latex(f.value)}$ | {prose(f.text)} (assumed: a fact of the claim) |"
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
        lines.append(f"| `{t.name}` | {prose(t.description)} | {'yes' if t.rejected else '**NO**'} | {gap} |")
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


def _once(items: list[str]) -> list[str]:
    """``items`` with each said once: items that differ only in their numbers (one per head:
    ``head 1's row sums are positive``, ``head 2's ...``) become the first, then the others'
    numbers (``(likewise 2, 3)``)."""
    groups: dict[str, list[str]] = {}
    for item in items:
        groups.setdefault(re.sub(r"\d+", "#", item), []).append(item)
    out = []
    for same in groups.values():
        numbers = [re.search(r"\d+", item) for item in same[1:]]
        likewise = ", ".join(dict.fromkeys(m.group(0) for m in numbers if m))
        out.append(same[0] + (f" (likewise {likewise})" if likewise else ""))
    return out


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
            parts.append("rests on the axioms " + ", ".join(_once(axioms)) if axioms
                         else "rests on no axiom beyond the definitions it unfolds")
        stated = [a["text"] for a in r.get("assumptions", ()) if a.get("kind") == "stated"]
        if stated:
            parts.append("assumes in words " + "; ".join(prose(a) for a in stated))
        lines.append(f"- **`{identity.name}`** ({md_text(identity.title)}): " + "; ".join(parts) + ".")
    if numbers:
        lines += ["", "Measured when this page was built:", "", *[f"- {n}" for n in numbers]]
    return "\n".join(lines)


def identity_list(identities) -> str:
    """Markdown: one line per identity, in registry order: its name linked to the chapter that
    states, proves and checks it (``identity.chapter``), its title, and its checker when it has one."""
    lines = []
    for identity in identities:
        checker = f" Checker: `check_{identity.function}`." if identity.function and identity.compare is None else ""
        lines.append(f"- [`{identity.name}`]({identity.chapter}.md): {md_text(identity.title)}.{checker}")
    return "\n".join(lines)
