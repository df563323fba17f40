"""LaTeX for matrix expressions, with ``1`` vectors, ``diag`` and transposes written the usual way."""

from __future__ import annotations

from sympy import DiagMatrix, Inverse, MatrixSymbol, Transpose
from sympy.printing.latex import LatexPrinter

__all__ = ["to_latex"]


class _Printer(LatexPrinter):
    def _print_OneMatrix(self, expr):
        rows, cols = expr.shape
        if cols == 1:
            return r"\mathbf{1}_{%s}" % self._print(rows)
        if rows == 1:
            return r"\mathbf{1}_{%s}^{\top}" % self._print(cols)
        return r"\mathbf{1}_{%s \times %s}" % (self._print(rows), self._print(cols))

    def _print_Identity(self, expr):
        return r"I_{%s}" % self._print(expr.shape[0])

    def _print_DiagMatrix(self, expr):
        return r"\operatorname{diag}(%s)" % self._print(expr.args[0])

    def _print_Inverse(self, expr):
        if isinstance(expr.arg, Transpose) and isinstance(expr.arg.arg, MatrixSymbol):
            return r"%s^{-\top}" % self._print(expr.arg.arg)
        if isinstance(expr.arg, DiagMatrix):
            return r"%s^{-1}" % self._print(expr.arg)
        return super()._print_MatPow(expr)

    def _print_Transpose(self, expr):
        arg = expr.arg
        if isinstance(arg, Inverse) and isinstance(arg.arg, MatrixSymbol):
            return r"%s^{-\top}" % self._print(arg.arg)
        inner = self._print(arg)
        if not isinstance(arg, MatrixSymbol):
            inner = r"\left(%s\right)" % inner
        return r"%s^{\top}" % inner


def to_latex(expr) -> str:
    """LaTeX for an expression, with ``1`` vectors, ``diag`` and transposes written the usual way."""
    return _Printer({"mat_symbol_style": "plain"}).doprint(expr)
