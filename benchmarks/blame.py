"""Precision and recall of the diagnosis's blame over the planted-bug corpus (tests/blame_corpus.py).

For each planted bug, ``circuitmath.testing.diagnose`` runs on the model and the user's buggy
processing of it; the blamed tensors are the names of ``Diagnosis.culprits()``, the touched ones
those where the buggy processing differs from the correct one. Prints one line per bug whose blame
differs from what it touched, then precision and recall summed over tensors (target 95 % each) and
the time per diagnosis. Exits 1 when either figure is below the target.

Usage: ``python benchmarks/blame.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from blame_corpus import corpus  # noqa: E402

from circuitmath.testing import diagnose  # noqa: E402

TARGET = 0.95


def main() -> int:
    torch.set_num_threads(1)
    right = wrong = missed = 0
    seconds = []
    bugs = corpus()
    for bug in bugs:
        before, after, after_cfg = bug.outputs()
        touched = bug.touched()
        start = time.perf_counter()
        diagnosis = diagnose(before, after, bug.cfg, after_cfg=after_cfg)
        seconds.append(time.perf_counter() - start)
        blamed = {p.name for p in diagnosis.culprits()}
        right += len(blamed & touched)
        wrong += len(blamed - touched)
        missed += len(touched - blamed)
        if blamed != touched:
            print(f"{bug.name}: blamed but correct {sorted(blamed - touched)},"
                  f" touched but not blamed {sorted(touched - blamed)}")
    precision = right / max(right + wrong, 1)
    recall = right / max(right + missed, 1)
    print(f"{len(bugs)} planted bugs: precision {precision:.1%} ({right}/{right + wrong}),"
          f" recall {recall:.1%} ({right}/{right + missed}); diagnosis {sum(seconds) / len(seconds):.2f} s per bug (median"
          f" {sorted(seconds)[len(seconds) // 2]:.2f} s)")
    return 0 if precision >= TARGET and recall >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
