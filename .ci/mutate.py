"""Mutation testing: change the code in small realistic ways and count the changes the tests catch.

Usage: ``python .ci/mutate.py [--jobs N] [--per-file K] [--seed S] [--only PATH] [--list]``
(``make mutate`` runs it with the defaults). Prints every surviving mutant and the kill rate.

A *mutant* is one edit of one target file, made on its syntax tree: an operator swapped
(``+``/``-``, ``*``/``/``, ``<``/``<=``, ``==``/``!=``, ``and``/``or``), a constant scaled (a
float times 10, an int plus 1, ``True``/``False``), ``.double()`` or ``.float()`` dropped,
``.mean(`` read as ``.sum(``, a sign dropped, a ``raise``, a call statement or an augmented
assignment deleted. For each target every mutant of the kinds a float64 accumulation or a
tolerance invites (see :func:`_priority`) is drawn, and ``--per-file`` of the others (seeded, so
a run is reproducible) and each is run against the tests listed for its file, in a private copy of the
repository; the mutant is *killed* when they fail (or hang past the time limit).

Mutants that cannot change behaviour are listed, with the reason, in ``.ci/equivalent_mutants.txt``
and left out of the rate. No tool from PyPI fits offline here (mutmut and cosmic-ray are not in
the local package lists), hence this small one: it needs only the standard library and the
project's own test environment.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / ".ci" / "equivalent_mutants.txt"

PROCESSING_TESTS = ["tests/test_processing_pins.py", "tests/test_accuracy.py"]
#: Target file (or ``file::name,name`` for some top-level names only) -> the tests that cover it.
TARGETS = {
    "circuitmath/_processing/layer_norm.py": [*PROCESSING_TESTS, "tests/test_layer_norm.py"],
    "circuitmath/_processing/centering.py": [*PROCESSING_TESTS, "tests/test_centering.py"],
    "circuitmath/_processing/norms.py": [*PROCESSING_TESTS, "tests/test_norms.py"],
    "circuitmath/_processing/attention.py": [
        *PROCESSING_TESTS, "tests/test_value_biases.py", "tests/test_key_bias.py", "tests/test_reparametrise.py",
    ],
    "circuitmath/_processing/fused.py": [*PROCESSING_TESTS, "tests/test_pipeline.py"],
    "circuitmath/_processing/pipeline.py": [*PROCESSING_TESTS, "tests/test_pipeline.py"],
    "circuitmath/_processing/shortformer.py": ["tests/test_shortformer.py"],
    "circuitmath/_processing/_common.py": ["tests/test_layer_norm.py", "tests/test_norms.py"],
    "circuitmath/_processing/_memory.py": ["tests/test_memory_pins.py", "tests/test_memory.py"],
    "circuitmath/_reference.py": [*PROCESSING_TESTS, "tests/test_reference.py"],
    "circuitmath/_state.py": ["tests/test_state_validation.py", "tests/test_state.py", "tests/test_io.py"],
    "circuitmath/testing.py::SAFETY,SENSITIVITY_SAFETY,_unit_roundoff,compute_dtype,rounding_sensitivity,"
    "logprob_tolerance,Comparison,compare_log_probs": ["tests/test_tolerance_pins.py", "tests/test_checkers.py"],
    "circuitmath/_algebra.py": ["tests/test_soundness.py", "tests/test_algebra.py"],
    "circuitmath/_proof.py": ["tests/test_soundness.py", "tests/test_algebra.py", "tests/test_registry.py"],
}

SWAPS = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
    ast.FloorDiv: ast.Div, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
    ast.NotIn: ast.In, ast.And: ast.Or, ast.Or: ast.And,
}


@dataclass(frozen=True)
class Mutant:
    path: str
    line: int
    col: int
    kind: str
    index: int  # which candidate of the file, in the order _Mutator visits them

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.kind}"


class _Mutator(ast.NodeTransformer):
    """Visits every mutable node of a module; with ``target`` set, mutates that candidate only."""

    def __init__(self, path: str, names: set[str] | None, target: int | None = None):
        self.path, self.names, self.target = path, names, target
        self.found: list[Mutant] = []
        self._inside = names is None

    def _candidate(self, node, kind: str) -> bool:
        if not self._inside:
            return False
        self.found.append(Mutant(self.path, node.lineno, node.col_offset, kind, len(self.found)))
        return len(self.found) - 1 == self.target

    def _named(self, node, names):
        if self.names is None:
            return self.generic_visit(node)
        outer, self._inside = self._inside, self._inside or bool(set(names) & self.names)
        node = self.generic_visit(node)
        self._inside = outer
        return node

    def visit_FunctionDef(self, node):
        return self._named(node, [node.name])

    def visit_ClassDef(self, node):
        return self._named(node, [node.name])

    def visit_Assign(self, node):
        return self._named(node, [t.id for t in node.targets if isinstance(t, ast.Name)])

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant):  # a docstring
            return node
        node = self.generic_visit(node)
        if isinstance(node.value, ast.Call) and self._candidate(node, "delete call statement"):
            return ast.copy_location(ast.Pass(), node)
        return node

    def visit_Raise(self, node):
        if self._candidate(node, "delete raise"):
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)

    def visit_AugAssign(self, node):
        node = self.generic_visit(node)
        if self._candidate(node, "delete augmented assignment"):
            return ast.copy_location(ast.Pass(), node)
        return node

    def visit_BinOp(self, node):
        node = self.generic_visit(node)
        if type(node.op) in SWAPS and self._candidate(node, f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"):
            node.op = SWAPS[type(node.op)]()
        return node

    def visit_BoolOp(self, node):
        node = self.generic_visit(node)
        if self._candidate(node, f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"):
            node.op = SWAPS[type(node.op)]()
        return node

    def visit_Compare(self, node):
        node = self.generic_visit(node)
        op = type(node.ops[0])
        if op in SWAPS and self._candidate(node, f"{op.__name__} -> {SWAPS[op].__name__}"):
            node.ops = [SWAPS[op](), *node.ops[1:]]
        return node

    def visit_UnaryOp(self, node):
        node = self.generic_visit(node)
        if isinstance(node.op, (ast.USub, ast.Not)) and self._candidate(node, f"drop {type(node.op).__name__}"):
            return node.operand
        return node

    def visit_Constant(self, node):
        value = node.value
        if isinstance(value, bool):
            if self._candidate(node, f"{value} -> {not value}"):
                return ast.copy_location(ast.Constant(not value), node)
        elif isinstance(value, float) and value != 0:
            if self._candidate(node, f"{value!r} -> {value * 10!r}"):
                return ast.copy_location(ast.Constant(value * 10), node)
        elif isinstance(value, int) and value not in (0, 1) and self._candidate(node, f"{value} -> {value + 1}"):
            return ast.copy_location(ast.Constant(value + 1), node)
        return node

    def visit_Call(self, node):
        node = self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and not node.args and not node.keywords and func.attr in ("double", "float"):
            if self._candidate(node, f"drop .{func.attr}()"):
                return func.value
        if isinstance(func, ast.Attribute) and func.attr == "mean" and self._candidate(node, ".mean( -> .sum("):
            func.attr = "sum"
        return node


def _priority(mutant: Mutant) -> bool:
    """The kinds of mistake a float64 accumulation or a tolerance invites, always drawn: a
    dropped ``.double()``, a mean read as a sum, a deleted ``raise``, a scaled float constant."""
    kind = mutant.kind
    return kind.startswith(("drop .double", "drop .float", ".mean(", "delete raise")) or (
        kind[0].isdigit() and "." in kind.split(" -> ")[0]
    )


def _split(target: str) -> tuple[str, set[str] | None]:
    path, _, names = target.partition("::")
    return path, set(names.split(",")) if names else None


def candidates(target: str) -> list[Mutant]:
    path, names = _split(target)
    mutator = _Mutator(path, names)
    mutator.visit(ast.parse((ROOT / path).read_text()))
    return mutator.found


def mutated_source(target: str, index: int) -> str:
    path, names = _split(target)
    tree = _Mutator(path, names, index).visit(ast.parse((ROOT / path).read_text()))
    return ast.unparse(ast.fix_missing_locations(tree))


def equivalent() -> dict[str, str]:
    """``mutant id -> reason`` from ``.ci/equivalent_mutants.txt`` (``id  # reason`` per line)."""
    out = {}
    for line in EQUIVALENT.read_text().splitlines() if EQUIVALENT.exists() else []:
        if line.strip() and not line.startswith("#"):
            key, _, reason = line.partition("  # ")
            out[key.strip()] = reason.strip()
    return out


def _copy(into: Path) -> None:
    for name in ("circuitmath", "tests"):
        shutil.copytree(ROOT / name, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")


def _pytest(where: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": str(where), "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0", "-p", "no:randomly",
               *[t for t in tests if (where / t.split("::")[0]).exists()]]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=where, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start
    return ("passed" if done.returncode == 0 else "failed"), time.perf_counter() - start


def _worker_dirs(jobs: int, base: Path) -> list[Path]:
    dirs = []
    for j in range(jobs):
        d = base / f"worker{j}"
        _copy(d)
        dirs.append(d)
    return dirs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--per-file", type=int, default=4,
                        help="mutants of the other kinds drawn per target, besides every one of the priority kinds (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="targets whose path contains this text")
    parser.add_argument("--list", action="store_true", help="list the drawn mutants and stop")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    parser.add_argument("--rerun", default=None, help="run only the survivors listed in this earlier output")
    args = parser.parse_args(argv)

    known = equivalent()
    drawn: list[tuple[str, Mutant]] = []
    for target in TARGETS:
        if args.only and args.only not in target:
            continue
        found = candidates(target)
        rng = random.Random(f"{args.seed}:{target}")
        always = [m for m in found if _priority(m)]
        others = [m for m in found if not _priority(m)]
        if args.per_file and len(others) > args.per_file:
            others = rng.sample(others, args.per_file)
        chosen = always + others
        drawn += [(target, m) for m in sorted(chosen, key=lambda m: m.index)]
    if args.rerun:
        again = {line.split()[-1] for line in Path(args.rerun).read_text().splitlines() if line.startswith("survived")}
        drawn = [(t, m) for t, m in drawn if m.id in again]
    if args.list:
        for _target, m in drawn:
            print(m.id, "(equivalent)" if m.id in known else "")
        return 0

    with tempfile.TemporaryDirectory(prefix="circuitmath-mutate-") as tmp:
        dirs = _worker_dirs(args.jobs, Path(tmp))
        free = list(dirs)
        results: dict[str, str] = {}

        def run(item):
            target, mutant = item
            where = free.pop()
            path = _split(target)[0]
            try:
                (where / path).write_text(mutated_source(target, mutant.index))
                outcome, seconds = _pytest(where, TARGETS[target], args.timeout)
            finally:
                shutil.copy(ROOT / path, where / path)
                free.append(where)
            return mutant, outcome, seconds

        todo = [(t, m) for t, m in drawn if m.id not in known]
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for mutant, outcome, seconds in pool.map(run, todo):
                results[mutant.id] = outcome
                mark = "survived" if outcome == "passed" else f"killed ({outcome})"
                print(f"{mark:18s} {seconds:6.1f} s  {mutant.id}", flush=True)

    survivors = [k for k, v in results.items() if v == "passed"]
    skipped = [m.id for _t, m in drawn if m.id in known]
    killed = len(results) - len(survivors)
    print(f"\n{len(drawn)} mutants drawn, {len(skipped)} equivalent (listed with reasons in {EQUIVALENT.name}):")
    for key in skipped:
        print(f"  {key}: {known[key]}")
    print(f"survivors ({len(survivors)}):")
    for key in survivors:
        print(f"  {key}")
    rate = killed / len(results) if results else 1.0
    print(f"\nkill rate: {killed}/{len(results)} = {100 * rate:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
