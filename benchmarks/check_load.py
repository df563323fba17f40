"""Time checks beside two busy processes, against the same checks on a quiet machine.

Two checks, each the median of ``--repeats`` runs: ``assert_equivalent`` of a small LayerNorm
model (2 layers, d_model 64, float64, the README's first example) against its
``fold_layer_norm``, and ``check_refactor_factored_attn_matrices`` of the same model. Each is
timed quiet, then beside two processes that spin on a core each (as many as this machine has
cores, at most two), with the thread count the checks choose (:mod:`circuitmath._threads`);
beside the same processes also with one thread fixed (the floor no choice of threads beats: the
scheduler's share of a core) and, for contrast, with the choice switched off (torch's default
threads). Prints the ratio busy / quiet of each and busy / floor; exits 1 when a ratio busy /
quiet with the checks' choice exceeds the target of 2.

Last, the README's Python examples run as written beside the same busy processes (every block in
order, then each ``test_*`` function a block defines: the property test keeps hypothesis's
200 ms deadline); exits 1 when one fails.

The busy processes run in sessions of their own, as other jobs' processes do. With the kernel's
autogroup scheduling, processes of the check's own session share its group's time instead: on
the shared 2-core machine (load about 13) that gave 3.6x and 4.1x busy / quiet, still within
1.09x of the one-thread floor, against 1.24x and 1.27x with the busy processes in their own
sessions (default threads: 40x to 200x either way).

Usage: ``python benchmarks/check_load.py [--repeats N]``. With as many busy processes as cores
(two on two) the scheduler gives a one-thread check half a core or less, so busy / quiet is about
2 or more whatever the check does; busy / floor then says what the thread choice costs. On more
cores the busy processes leave idle ones, which the choice uses.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from circuitmath import Config, fold_layer_norm, random_state_dict, refactor_factored_attn_matrices
from circuitmath import _threads
from circuitmath.testing import assert_equivalent, check_refactor_factored_attn_matrices

#: The issue's target: a check beside two busy processes takes at most this many times its quiet time.
TARGET_RATIO = 2.0

SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def busy(processes: int):
    """``processes`` Python processes spinning on a core each, stopped (by their ids) on exit."""
    # each in a session of its own, as another job's processes are: with the kernel's autogroup
    # scheduling a process's own children would share its group's time instead of competing with it
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True) for _ in range(processes)]
    try:
        time.sleep(0.5)  # let the scheduler see them
        yield
    finally:
        for spinner in spinners:
            os.kill(spinner.pid, signal.SIGKILL)
            spinner.wait()


@contextlib.contextmanager
def default_threads():
    """The checks' choice switched off: they compute with torch's default thread count."""
    chosen = _threads.idle_threads
    _threads.idle_threads = lambda ceiling=None, **_: torch.get_num_threads() if ceiling is None else ceiling
    try:
        yield
    finally:
        _threads.idle_threads = chosen


@contextlib.contextmanager
def one_thread():
    """The checks compute with one thread, whatever the machine."""
    chosen = _threads.idle_threads
    _threads.idle_threads = lambda ceiling=None, **_: 1
    try:
        yield
    finally:
        _threads.idle_threads = chosen


def checks():
    cfg = Config(n_layers=2, d_model=64, n_heads=4, d_head=16, d_vocab=100, n_ctx=32, d_mlp=256)
    weights = random_state_dict(cfg, seed=0, dtype=torch.float64)
    folded, folded_cfg = fold_layer_norm(weights, cfg, center_reading_weights=True)
    refactored, refactored_cfg = refactor_factored_attn_matrices(weights, cfg)
    return {
        "assert_equivalent": lambda: assert_equivalent(weights, folded, cfg, after_cfg=folded_cfg),
        "check_refactor": lambda: check_refactor_factored_attn_matrices(
            weights, refactored, cfg, after_cfg=refactored_cfg).ok or sys.exit("the refactor check failed"),
    }


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "README.md")


def readme_examples() -> float:
    """Run the README's Python blocks and the tests they define; the seconds it took."""
    with open(README) as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), flags=re.S)
    namespace: dict = {"__name__": "readme"}
    start = time.perf_counter()
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(open(os.devnull, "w")):
        os.chdir(scratch)  # the examples write files
        try:
            _run_blocks(blocks, namespace)
        finally:
            os.chdir(here)
    return time.perf_counter() - start


def _run_blocks(blocks: list[str], namespace: dict) -> None:
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"README.md python block {number}", "exec"), namespace)
    for name, value in list(namespace.items()):
        if name.startswith("test_") and callable(value):
            value()


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())  # torch's default, as a caller's process has it
    cores = len(os.sched_getaffinity(0))
    spinners = min(2, cores)
    print(f"{cores} cores, torch default threads {torch.get_num_threads()}, {spinners} busy processes,"
          f" median of {args.repeats}")
    runs = checks()
    for run in runs.values():
        run()  # warm up
    failed = False
    for name, run in runs.items():
        quiet = median_seconds(run, args.repeats)
        with busy(spinners):
            loaded = median_seconds(run, args.repeats)
            with one_thread():
                floor = median_seconds(run, args.repeats)
            with default_threads():
                loaded_default = median_seconds(run, max(1, args.repeats // 2))
        ratio = loaded / quiet
        failed |= ratio > TARGET_RATIO
        print(f"{name}: quiet {quiet:.3f} s, busy {loaded:.3f} s ({ratio:.2f}x, target <= {TARGET_RATIO:g}x);"
              f" {loaded / floor:.2f}x the one-thread floor beside them ({floor:.3f} s);"
              f" with torch's default threads {loaded_default:.3f} s ({loaded_default / quiet:.2f}x)")
    with busy(spinners):
        try:
            seconds = readme_examples()
            print(f"README examples beside {spinners} busy processes: passed in {seconds:.1f} s")
        except Exception as error:  # a failed example (hypothesis's deadline included) misses the target
            print(f"README examples beside {spinners} busy processes: FAILED: {type(error).__name__}: {error}")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
