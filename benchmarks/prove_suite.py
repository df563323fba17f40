"""Time every proof (its chain, its concrete check and its twins' counterexamples).

Prints one line per identity and the total. The proofs have no peer to compare against, so
this reports seconds; each identity is proved `REPEATS` times in fresh processes' worth of state
(the proof object is rebuilt) and the median is printed.
"""

from __future__ import annotations

import statistics
import time

import circuitmath as cm

REPEATS = 3


def main() -> int:
    total = 0.0
    failed = []
    print(f"{'identity':<28} {'median s':>9}  status")
    for identity in cm.identities():
        times = []
        for _ in range(REPEATS):
            proof = identity.build_proof()
            start = time.perf_counter()
            report = proof.verify(identity.name)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        total += median
        status = "proved" if report.ok else "FAILED"
        if not report.ok:
            failed.append(identity.name)
        print(f"{identity.name:<28} {median:>9.3f}  {status}")
    print(f"{'total':<28} {total:>9.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
