"""Time and peak memory of a command, measured the way the benchmarks measure them.

Each command runs in a process of its own, so its peak resident memory is its own: Linux
reports it to the parent through ``wait4`` (``ru_maxrss``, which counts the pages of mapped
files that were read, as well as the process's own memory). A child's peak starts from the
size of the process that forked it, so the command is started by a small launcher (a bare
Python, about 10 MB) rather than by this page's kernel, which holds hundreds of megabytes.
The child uses one thread and imports the circuitmath that this page imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import circuitmath

#: The folder holding the circuitmath package this page imported: the children import it too.
SOURCE = Path(circuitmath.__file__).resolve().parents[1]
ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": str(SOURCE),
}


@dataclass(frozen=True)
class Run:
    """One command's wall-clock ``seconds``, peak resident memory ``peak_bytes``, its exit
    status and what it printed (stdout and stderr together)."""

    seconds: float
    peak_bytes: int
    returncode: int
    output: str


#: The launcher: runs its arguments as a command, passes its output through, then prints the
#: command's seconds, peak RSS (KiB) and exit status as the last line.
LAUNCHER = """
import os, subprocess, sys, time
start = time.perf_counter()
child = subprocess.Popen(sys.argv[1:])
_pid, status, usage = os.wait4(child.pid, 0)
seconds = time.perf_counter() - start
print(seconds, usage.ru_maxrss, os.waitstatus_to_exitcode(status), flush=True)
"""


def run(*command: str | os.PathLike) -> Run:
    """Run ``command`` (``python`` is this interpreter) and measure it."""
    argv = [sys.executable if c == "python" else str(c) for c in command]
    launched = subprocess.run(
        [sys.executable, "-S", "-c", LAUNCHER, *argv],
        env=os.environ | ENVIRONMENT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=True,
    )
    output, _, last = launched.stdout.decode().rstrip("\n").rpartition("\n")
    seconds, kib, returncode = last.split()
    return Run(float(seconds), int(kib) * 1024, int(returncode), output)


def python(code: str, *arguments: str | os.PathLike) -> Run:
    """:func:`run` of ``python -c code arguments``; fails unless it exits 0."""
    result = run("python", "-c", code, *arguments)
    assert result.returncode == 0, result.output
    return result


def megabytes(count: float) -> str:
    return f"{count / 1e6:,.0f} MB"
