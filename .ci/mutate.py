"""Mutation testing: change the code in small realistic ways and count the changes the tests catch.

Usage: ``python .ci/mutate.py [--jobs N] [--per-file K] [--seed S] [--only TEXT[,TEXT]] [--list]``
(``make mutate`` runs it with the defaults, ``MUTATE_ARGS="--only _diagnosis/"`` one slice of
it). Prints every surviving mutant and the kill rate.

The targets are today's modules, derived: every module of the families of :data:`FAMILIES` (the
transforms, the tolerances, the checkers, the diagnosis and its certificates, the reference pass,
state validation, streaming, the stored layout, the proof engine) and of every registered
identity's transform, each with its family's tests, its own ``tests/test_<module>.py``, its
docstring examples (the suite runs them: ``--doctest-modules``) and the test files that import it. A pattern that matches nothing, a test file that does not exist, a
transform module no family covers, or an equivalent mutant the code no longer has stops the run
before any mutant is run: nothing is silently left untested.

A *mutant* is one edit of one target file, made on its syntax tree: an operator swapped
(``+``/``-``, ``*``/``/``, ``<``/``<=``, ``==``/``!=``, ``and``/``or``), a constant scaled (a
float times 10, an int plus 1, ``True``/``False``), ``.double()`` or ``.float()`` dropped,
``.mean(`` read as ``.sum(``, a sign dropped, a ``raise``, a call statement or an augmented
assignment deleted. For each target every mutant of the kinds a float64 accumulation or a
tolerance invites (see :func:`_priority`) is drawn, and ``--per-file`` of the others (seeded, so
a run is reproducible), each run in a private copy of the repository; the mutant is *killed* when
its tests fail. Each copy's runs of pytest are processes forked from one that has imported the
third-party modules once (:data:`PRELOADED`), and import the package afresh. One whose tests run past the time limit (a hang, or a machine too busy) is
*undecided*: listed, and left out of the rate rather than counted as killed. Mutants are run one
module at a time in turn, so a run stopped early has seen every module.

Its tests are those that can see it: first the suite (the book's build aside; the package's
docstring examples included, :func:`suite`) runs once under coverage, each file in a process of its own (so no other file's caches or fixtures hide the
lines it needs) with the processes its tests start, and records which test (node id) runs which
line, a shared fixture's lines counting for every test that uses it (:func:`coverage_map`,
cached per test file by the hash of the code). A mutant is then run against the tests that run
one of its lines, by node id in collection order, those of the files listed for its module first,
with ``-x``; where a line of it runs while modules are imported, against all the listed files and then the
tests of other files that run one of its lines; and
it survives unrun where no test runs it. ``--by-file`` runs the whole files of those tests
instead, ``--listed-tests`` every mutant against the listed files, and ``--confirm`` each survivor
again against the listed files.

Mutants that cannot change behaviour are listed, with the reason, in ``.ci/equivalent_mutants.txt``
and left out of the rate; a mutant is named by its function, not its line (``path::function::kind::k``,
the k-th change of that kind in the function), so edits elsewhere keep the list valid. The tool
needs only the standard library and the project's own test environment (``coverage`` is in its
``test`` extra).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / ".ci" / "equivalent_mutants.txt"

#: The modules mutated, by family (glob patterns, space-separated), with the tests that cover every module of the family. Each
#: module's own tests are added to these (:func:`targets`): ``tests/test_<module>.py`` where there is
#: one, every test file that imports the module by its dotted name, and :data:`EXTRA_TESTS`.
FAMILIES = {
    "transforms": ("circuitmath/_processing/*.py",
                   ["tests/test_processing_pins.py", "tests/test_accuracy.py", "tests/test_applied.py", "tests/test_mutants.py"]),
    "tolerances": ("circuitmath/_compare.py",
                   ["tests/test_tolerance_pins.py", "tests/test_rounding_sensitivity.py", "tests/test_mutants.py"]),
    "checkers": ("circuitmath/testing.py", ["tests/test_checkers.py", "tests/test_mutants.py"]),
    "diagnosis and certificates": ("circuitmath/_diagnosis/*.py circuitmath/_identities/_residual_fit.py",
                                   ["tests/test_diagnosis.py", "tests/test_certificate.py", "tests/test_mutants.py"]),
    "reference pass": ("circuitmath/_reference.py circuitmath/_moe.py", ["tests/test_processing_pins.py", "tests/test_moe.py"]),
    "state validation": ("circuitmath/_state.py", ["tests/test_state_validation.py", "tests/test_io.py"]),
    "streaming": ("circuitmath/_streaming*.py", ["tests/test_streaming.py"]),
    "stored layout": ("circuitmath/_stored.py", ["tests/test_streaming.py"]),
    "proof engine": ("circuitmath/_algebra.py circuitmath/_proof*.py", ["tests/test_soundness.py", "tests/test_algebra.py"]),
}

#: Tests of a module beyond those :func:`targets` derives (``test_<module>.py`` and the importers).
EXTRA_TESTS = {
    "circuitmath/_processing/attention.py": ["tests/test_value_biases.py", "tests/test_key_bias.py",
                                             "tests/test_reparametrise.py"],
    "circuitmath/_processing/fused.py": ["tests/test_pipeline.py"],
    "circuitmath/_processing/experts.py": ["tests/test_moe.py"],
    "circuitmath/_processing/_common.py": ["tests/test_layer_norm.py", "tests/test_norms.py", "tests/test_preconditions.py"],
    "circuitmath/_processing/_memory.py": ["tests/test_memory_pins.py"],
    "circuitmath/_processing/_parts.py": ["tests/test_pipeline.py"],
    "circuitmath/_compare.py": ["tests/test_checkers.py"],
    "circuitmath/testing.py": ["tests/test_public_api.py", "tests/test_diagnosis.py"],
    "circuitmath/_state.py": ["tests/test_state.py"],
    "circuitmath/_proof.py": ["tests/test_registry.py"],
    "circuitmath/_diagnosis/_replay.py": ["tests/test_rotation.py"],
    "circuitmath/_diagnosis/_recover.py": ["tests/test_rotation.py"],  # the recovery of permutations by hand
    "circuitmath/_identities/_residual_fit.py": ["tests/test_rotation.py"],  # the recovery of the residual rotation
}

#: Modules of the families above left out, with the reason.
LEFT_OUT = {
    "circuitmath/_processing/__init__.py": "re-exports only",
}


def _module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _registered_modules() -> set[str]:
    """The modules of every registered identity's public transform (the registry is the list of
    identities: a transform module it names is mutated even if no family's pattern covers it)."""
    sys.path.insert(0, str(ROOT))
    try:
        import circuitmath
        from circuitmath._identities import identities
    finally:
        sys.path.pop(0)
    out = set()
    for identity in identities():
        function = getattr(circuitmath, identity.function or "", None)
        module = getattr(function, "__module__", None) or ""
        if module.startswith("circuitmath."):
            out.add(str(Path(*module.split(".")).with_suffix(".py")))
    return out


def _has_doctests(path: str) -> bool:
    """Whether the module ``path`` has docstring examples, which the suite runs (``--doctest-modules``)."""
    return any(">>>" in (ast.get_docstring(node) or "") for node in ast.walk(ast.parse((ROOT / path).read_text()))
               if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))


def suite() -> list[str]:
    """What the coverage map runs: every test file but :data:`SLOW_TESTS`, and every module of the
    package with docstring examples."""
    tests = sorted(str(t.relative_to(ROOT)) for t in (ROOT / "tests").glob("test_*.py"))
    modules = sorted(str(m.relative_to(ROOT)) for m in (ROOT / "circuitmath").glob("**/*.py"))
    return [t for t in tests if t not in SLOW_TESTS] + [m for m in modules if _has_doctests(m)]


def targets() -> dict[str, list[str]]:
    """Target file -> the tests that cover it: every module of :data:`FAMILIES` and of the
    registry's transforms, but :data:`LEFT_OUT`. Raises ``SystemExit`` when a family's pattern
    matches nothing, a test file named here does not exist, or a module has no test."""
    tests_text = {p: p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py"))}
    found: dict[str, list[str]] = {}
    problems = []
    for family, (patterns, tests) in FAMILIES.items():
        paths = []
        for pattern in patterns.split():
            matched = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
            if not matched:
                problems.append(f"family {family!r}: {pattern} matches no file")
            paths += matched
        for path in paths:
            found.setdefault(path, []).extend(tests)
    for path in sorted(_registered_modules() - set(found)):
        problems.append(f"{path} holds a registered transform but no family covers it")
    for path in list(found):
        if path in LEFT_OUT:
            del found[path]
            continue
        stem = Path(path).stem.lstrip("_")
        own = [f"tests/test_{stem}.py"] if (ROOT / f"tests/test_{stem}.py").exists() else []
        own += [path] if _has_doctests(path) else []  # its docstring examples (pytest --doctest-modules)
        dotted = _module_name(path)
        package, _, name = dotted.rpartition(".")
        importers = [] if not name.startswith("_") else [  # a public module's importers are most tests
            str(p.relative_to(ROOT)) for p, text in tests_text.items()
            if re.search(rf"\b{re.escape(dotted)}\b", text) or re.search(rf"from {re.escape(package)} import .*\b{name}\b", text)]
        # the module's own tests first: pytest -x stops at the first failure, so a mutant they kill costs little
        found[path] = list(dict.fromkeys(own + EXTRA_TESTS.get(path, []) + importers + found[path]))
    for path, tests in found.items():
        missing = [t for t in tests if not (ROOT / t).exists()]
        if missing:
            problems.append(f"{path}: the tests {missing} do not exist")
    for path in set(EXTRA_TESTS) - set(found):
        problems.append(f"EXTRA_TESTS names {path}, which is no target")
    if problems:
        raise SystemExit("mutate: the targets do not match the code:\n  " + "\n  ".join(problems))
    return found


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
    scope: str  # the function (or class) it is in, dotted: ``Class.method``; ``<module>`` outside any
    ordinal: int  # which candidate of this kind in this scope
    end_line: int = 0  # the last line of the changed node

    @property
    def id(self) -> str:
        """Names the mutant by its function, not its line: edits elsewhere in the file keep it."""
        return f"{self.path}::{self.scope}::{self.kind}::{self.ordinal}"


class _Mutator(ast.NodeTransformer):
    """Visits every mutable node of a module; with ``target`` set, mutates that candidate only."""

    def __init__(self, path: str, target: int | None = None):
        self.path, self.target = path, target
        self.found: list[Mutant] = []
        self._scope: list[str] = []
        self._seen: dict[tuple[str, str], int] = {}

    def _candidate(self, node, kind: str) -> bool:
        scope = ".".join(self._scope) or "<module>"
        ordinal = self._seen.get((scope, kind), 0)
        self._seen[scope, kind] = ordinal + 1
        self.found.append(Mutant(self.path, node.lineno, node.col_offset, kind, len(self.found), scope, ordinal,
                                 node.end_lineno or node.lineno))
        return len(self.found) - 1 == self.target

    def _scoped(self, node):
        self._scope.append(node.name)
        node = self.generic_visit(node)
        self._scope.pop()
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

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


def candidates(path: str) -> list[Mutant]:
    mutator = _Mutator(path)
    mutator.visit(ast.parse((ROOT / path).read_text()))
    return mutator.found


def mutated_source(path: str, index: int) -> str:
    tree = _Mutator(path, index).visit(ast.parse((ROOT / path).read_text()))
    return ast.unparse(ast.fix_missing_locations(tree))


def equivalent(found: dict[str, list[Mutant]]) -> dict[str, str]:
    """``mutant id -> reason`` from ``.ci/equivalent_mutants.txt`` (``id  # reason`` per line).
    Raises ``SystemExit`` naming every listed mutant that the targets (``found``: path -> its
    candidates) no longer have: its reason was given for code that has changed or moved."""
    out = {}
    for line in EQUIVALENT.read_text().splitlines() if EQUIVALENT.exists() else []:
        if line.strip() and not line.startswith("#"):
            key, _, reason = line.partition("  # ")
            out[key.strip()] = reason.strip()
    ids = {m.id for mutants in found.values() for m in mutants}
    stale = sorted(set(out) - ids)
    if stale:
        raise SystemExit(f"mutate: {EQUIVALENT.name} lists mutants the code no longer has (check the reason on"
                         " today's code and list it again, or drop it):\n  " + "\n  ".join(stale))
    return out


def _copy(into: Path) -> None:
    for name in ("circuitmath", "tests"):
        shutil.copytree(ROOT / name, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")


#: Test files the coverage run leaves out: the book's build and browser test (minutes; it runs the
#: chapters' cells, which the other tests cover).
SLOW_TESTS = ("tests/test_book.py",)
COVERMAP = ROOT / ".ci" / "covermap"  # the pytest plugin and the subprocess hook of the coverage run
PYTEST = ["-q", "-p", "no:cacheprovider", "-n", "0", "-p", "no:randomly", "--hypothesis-seed=0"]


def _env(where: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(where), "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", **extra}


#: The third-party modules a worker imports once (:class:`_Server`), before it forks a process
#: per run of pytest: their import is most of a short run's time. Never the package or its tests,
#: which each run imports afresh from its copy of the repository, a mutant's source included.
PRELOADED = ("numpy", "torch", "sympy", "hypothesis", "safetensors.torch", "transformers", "pytest", "xdist")


class _Server:
    """A process in the private copy ``where`` (``first`` before it on ``PYTHONPATH``) that has
    imported :data:`PRELOADED` and runs pytest as asked (:meth:`pytest`), each time in a process
    forked from it (:func:`_serve`): a fresh pytest session that imports the package from disk."""

    def __init__(self, where: Path, first: str = ""):
        path = os.pathsep.join(filter(None, [first, str(where)]))
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"], cwd=where,
                                        env=_env(where, PYTHONPATH=path), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)

    def pytest(self, args: list[str], timeout: float | None, env: dict[str, str] | None = None) -> tuple[str, float]:
        """Runs ``pytest args`` (``env`` added to the environment): ``"passed"``, ``"failed"``
        (with the exit status, ``"failed 4"``, where it is not 1) or ``"timeout"``, and the seconds."""
        self.process.stdin.write(json.dumps({"args": args, "timeout": timeout, "env": env or {}}) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        return reply["outcome"], reply["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def _serve() -> None:
    """The loop of a :class:`_Server`: one JSON request a line on stdin, one reply a line on the
    stdout it starts with (anything else printed goes nowhere). Each run is a process of its own
    group, forked, its output discarded; past its ``timeout`` the group is killed."""
    import importlib
    import signal

    sys.path[0] = os.getcwd()  # as ``python -m pytest`` has it
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    for name in PRELOADED:
        importlib.import_module(name)
    import pytest

    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.setpgrp()
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.environ.update(request["env"])
            try:
                status = int(pytest.main(request["args"]))
            except BaseException:
                status = 3
            os._exit(status)
        timed_out = False
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if request["timeout"] is not None and time.perf_counter() - start > request["timeout"]:
                os.killpg(pid, signal.SIGKILL)
                timed_out, done = True, os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        status = os.waitstatus_to_exitcode(done[1])
        try:
            os.killpg(pid, signal.SIGKILL)  # whatever the run left running
        except (ProcessLookupError, PermissionError):
            pass
        outcome = "timeout" if timed_out else "passed" if status == 0 else "failed" if status == 1 else f"failed {status}"
        replies.write(json.dumps({"outcome": outcome, "seconds": time.perf_counter() - start}) + "\n")
        replies.flush()


#: ``path -> line -> the tests that ran it``: node ids, or ``""`` for a line run while modules are imported.
LineMap = dict[str, dict[int, set[str]]]
#: ``test file -> its node ids, in the order pytest collects them``.
TestOrder = dict[str, list[str]]


def _tests_of_context(context: str, collected: list[list]) -> set[str]:
    """The node ids a coverage context of :mod:`covermap_plugin` stands for: the test it names,
    every test that uses the shared fixture it names (``fixture:NAME``: its lines ran once, for the
    first of them, and serve all), or ``""`` (module import)."""
    if not context or not context.startswith("fixture:"):
        return {context}
    name = context.removeprefix("fixture:")
    users = {node for node, fixtures in collected if name in fixtures}
    return users or {node for node, _ in collected}


def _lines_of(test: str, server: _Server, where: Path, paths: list[str]) -> tuple[LineMap, list[str]]:
    """Runs one test file in its own process under coverage of ``paths`` (:mod:`covermap_plugin`),
    the processes its tests start included: the lines each of its tests runs, with the caches and
    fixtures of no other file warm, and its node ids in collection order."""
    import coverage

    data = where / f".covermap-{test.replace('/', '-')}"
    server.pytest(["-p", "covermap_plugin", *PYTEST, test], None,
                  {"CM_COVERMAP_DATA": str(data), "CM_COVERMAP_INCLUDE": ",".join(str(where / p) for p in paths)})
    listing = Path(f"{data}.tests.json")
    collected = json.loads(listing.read_text()) if listing.exists() else []
    listing.unlink(missing_ok=True)
    out: LineMap = {}
    for data_file in [data, *where.glob(f"{data.name}.process*")]:
        stored = coverage.CoverageData(basename=str(data_file))
        stored.read()
        for measured in stored.measured_files():
            by_line = out.setdefault(str(Path(measured).relative_to(where)), {})
            for line, contexts in stored.contexts_by_lineno(measured).items():
                for context in contexts:
                    by_line.setdefault(line, set()).update(_tests_of_context(context, collected))
        data_file.unlink(missing_ok=True)
    return out, [node for node, _ in collected]


def _map_cache(paths: list[str]) -> Path:
    """The folder of the coverage map's cache: named by the hash of the code, the test helpers
    (every file under ``tests/`` but the test files), the plugin and ``paths``; each test file's
    part is stored in it under the hash of that file."""
    digest = hashlib.sha256("\n".join(sorted(paths)).encode())
    helpers = [f for f in sorted(ROOT.glob("tests/**/*.py")) if not f.name.startswith("test_")]
    for file in sorted(ROOT.glob("circuitmath/**/*.py")) + helpers + sorted(COVERMAP.glob("*.py")):
        digest.update(str(file.relative_to(ROOT)).encode() + file.read_bytes())
    return ROOT / ".cache" / f"mutate-lines-{digest.hexdigest()[:16]}"


def coverage_map(tests: list[str], paths: list[str], dirs: list[Path]) -> tuple[LineMap, TestOrder]:
    """Which test runs which line of ``paths``, and each test file's node ids in order: each of
    ``tests`` run once under coverage, spread over ``dirs`` (private copies of the repository);
    cached in ``.cache/`` by the hash of the code, per test file (:func:`_map_cache`)."""
    cache = _map_cache(paths)
    start, out, order, free, servers = time.perf_counter(), {}, {}, list(dirs), {}

    def run(test: str) -> tuple[dict, list[str]]:
        stored = cache / f"{test.removeprefix('tests/').removesuffix('.py').replace('/', '-')}-{hashlib.sha256((ROOT / test).read_bytes()).hexdigest()[:16]}.json"
        if stored.exists():
            part = json.loads(stored.read_text())
            return {p: {int(k): set(v) for k, v in lines.items()} for p, lines in part["lines"].items()}, part["tests"]
        where = free.pop()
        try:
            if where not in servers:
                servers[where] = _Server(where, first=str(COVERMAP))
            lines, nodes = _lines_of(test, servers[where], where, paths)
        finally:
            free.append(where)
        cache.mkdir(parents=True, exist_ok=True)
        stored.write_text(json.dumps({"lines": {p: {k: sorted(v) for k, v in by.items()} for p, by in lines.items()},
                                      "tests": nodes}))
        return lines, nodes

    with concurrent.futures.ThreadPoolExecutor(len(dirs)) as pool:
        for test, (lines, nodes) in zip(tests, pool.map(run, tests)):
            order[test] = nodes
            for path, by_line in lines.items():
                for line, ran in by_line.items():
                    out.setdefault(path, {}).setdefault(line, set()).update(ran)
    for server in servers.values():
        server.close()
    print(f"coverage of {len(tests)} test files: {time.perf_counter() - start:.0f} s", flush=True)
    return out, order


def selected(mutant: Mutant, listed: list[str], lines: LineMap, order: TestOrder, *, by_file: bool = False) -> list[str] | None:
    """The tests run against ``mutant`` (pytest arguments): every test that ran one of its lines,
    by node id, in collection order, those of the files ``listed`` for its module first (a file
    whose every test ran one is named whole; ``by_file``: every such file whole); where a line of
    it runs while modules are imported (its effect reaches any test), all of ``listed`` first,
    then those tests of other files; ``None`` where no test runs it (it survives)."""
    by_line = lines.get(mutant.path, {})
    hits = set().union(*(by_line.get(n, set()) for n in range(mutant.line, max(mutant.end_line, mutant.line) + 1)))
    if not hits:
        return None
    if "" in hits:
        rest = selected(mutant, [], {mutant.path: {mutant.line: hits - {""}}}, order, by_file=by_file) or []
        return listed + [test for test in rest if test.split("::")[0] not in listed]
    files: dict[str, set[str]] = {}
    for node in hits:
        files.setdefault(node.split("::")[0], set()).add(node)
    rank = {test: i for i, test in enumerate(listed)}
    out = []
    for file in sorted(files, key=lambda test: (rank.get(test, len(rank)), test)):
        nodes = order.get(file, [])
        if by_file or file in files[file] or set(nodes) <= files[file]:
            out.append(file)
        else:
            position = {node: i for i, node in enumerate(nodes)}
            out += sorted(files[file], key=lambda node: (position.get(node, len(position)), node))
    return out


def _worker_dirs(jobs: int, base: Path) -> list[Path]:
    dirs = []
    for j in range(jobs):
        d = base / f"worker{j}"
        _copy(d)
        dirs.append(d)
    return dirs


def _arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--per-file", type=int, default=4,
                        help="mutants of the other kinds drawn per target, besides every one of the priority kinds (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="targets whose path contains this text (or one of these, comma-separated)")
    parser.add_argument("--list", action="store_true", help="list the drawn mutants and stop")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    parser.add_argument("--rerun", default=None, help="run only the survivors listed in this earlier output")
    parser.add_argument("--listed-tests", action="store_true",
                        help="run every mutant against all the tests listed for its module, not only those that run its lines")
    parser.add_argument("--by-file", action="store_true",
                        help="run every test of each file whose tests run a mutant's lines, not only those tests")
    parser.add_argument("--confirm", action="store_true",
                        help="run each survivor again against all the tests listed for its module")
    return parser.parse_args(argv)


def _draw(args, covered: dict[str, list[str]], found: dict[str, list[Mutant]]) -> list[Mutant]:
    drawn: list[Mutant] = []
    for path in covered:
        if args.only and not any(text in path for text in args.only.split(",")):
            continue
        rng = random.Random(f"{args.seed}:{path}")
        always = [m for m in found[path] if _priority(m)]
        others = [m for m in found[path] if not _priority(m)]
        if args.per_file and len(others) > args.per_file:
            others = rng.sample(others, args.per_file)
        drawn += sorted(always + others, key=lambda m: m.index)
    # one mutant of each module in turn, so a run stopped early has seen every module
    turn = {}
    drawn.sort(key=lambda m: (turn.setdefault(m.id, sum(1 for k in turn if k.startswith(m.path + "::"))), m.path))
    if args.rerun:
        again = {line.rsplit("  ", 1)[-1] for line in Path(args.rerun).read_text().splitlines()
                 if line.startswith("survived")}
        drawn = [m for m in drawn if m.id in again]
    return drawn


def _run(todo: list[Mutant], tests_of, dirs: list[Path], timeout: float) -> dict[str, str]:
    """Runs each mutant against ``tests_of(mutant)`` (``None``: no test runs it, it survives
    unrun) in the private copies ``dirs``, one at a time in each (``pytest -x``, by a
    :class:`_Server` of each); prints each outcome."""
    free, results, servers = list(dirs), {}, {}

    def run(mutant: Mutant):
        tests = tests_of(mutant)
        if tests is None:
            return mutant, "passed", "no test runs it", 0.0
        where = free.pop()
        try:
            if where not in servers:
                servers[where] = _Server(where)
            (where / mutant.path).write_text(mutated_source(mutant.path, mutant.index))
            outcome, seconds = servers[where].pytest(["-x", *PYTEST, *tests], timeout)
        finally:
            shutil.copy(ROOT / mutant.path, where / mutant.path)
            free.append(where)
        whole = sum("::" not in test for test in tests)
        return mutant, outcome, f"{len(tests) - whole:3d} tests {whole:2d} files", seconds

    with concurrent.futures.ThreadPoolExecutor(len(dirs)) as pool:
        for mutant, outcome, ran, seconds in pool.map(run, todo):
            kind, *status = outcome.split()
            results[mutant.id] = kind
            # an exit status other than 1 (an error in collection, a node id not found) is shown
            mark = {"passed": "survived", "failed": "killed", "timeout": "undecided"}[kind] + "".join(f" (exit {n})" for n in status)
            print(f"{mark:18s} {seconds:6.1f} s  {ran:18s} line {mutant.line:4d}  {mutant.id}", flush=True)
    for server in servers.values():
        server.close()
    return results


def _report(drawn: list[Mutant], known: dict[str, str], results: dict[str, str]) -> None:
    survivors = [k for k, v in results.items() if v == "passed"]
    skipped = [m.id for m in drawn if m.id in known]
    undecided = [k for k, v in results.items() if v == "timeout"]
    killed = len(results) - len(survivors) - len(undecided)
    print(f"\n{len(drawn)} mutants drawn, {len(skipped)} equivalent (listed with reasons in {EQUIVALENT.name}):")
    for key in skipped:
        print(f"  {key}: {known[key]}")
    print(f"survivors ({len(survivors)}):")
    for key in survivors:
        print(f"  {key}")
    if undecided:
        print(f"undecided, past the time limit and left out of the rate ({len(undecided)}):")
        for key in undecided:
            print(f"  {key}")
    decided = killed + len(survivors)
    rate = killed / decided if decided else 1.0
    print(f"\nkill rate: {killed}/{decided} = {100 * rate:.1f} %")


def main(argv=None) -> int:
    args = _arguments(argv)
    covered = targets()
    found = {path: candidates(path) for path in covered}
    known = equivalent(found)
    drawn = _draw(args, covered, found)
    if args.list:
        for path in dict.fromkeys(m.path for m in drawn):
            print(f"{path}: {' '.join(covered[path])}")
        for m in drawn:
            print(f"line {m.line:4d}  {m.id}", "(equivalent)" if m.id in known else "")
        return 0
    todo = [m for m in drawn if m.id not in known]
    with tempfile.TemporaryDirectory(prefix="circuitmath-mutate-") as tmp:
        dirs = _worker_dirs(args.jobs, Path(tmp))
        if args.listed_tests:
            tests_of = lambda m: covered[m.path]  # noqa: E731
        else:
            lines, order = coverage_map(suite(), sorted(covered), dirs)
            tests_of = lambda m: selected(m, covered[m.path], lines, order, by_file=args.by_file)  # noqa: E731
        results = _run(todo, tests_of, dirs, args.timeout)
        if args.confirm:
            again = [m for m in todo if results[m.id] == "passed"]
            print(f"\nconfirming {len(again)} survivors against every listed test:", flush=True)
            results.update(_run(again, lambda m: covered[m.path], dirs, args.timeout))
    _report(drawn, known, results)
    return 0


if __name__ == "__main__":
    sys.exit(_serve() if sys.argv[1:] == ["--serve"] else main())
