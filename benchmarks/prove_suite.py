"""Time every proof (its chain, its second check on two instances, its twins' counterexamples).

Prints one line per identity (median wall and CPU seconds, the axioms it assumes, the sizes of
its second check) and the totals, and fails when the CPU total misses the target: ``python -m
circuitmath prove`` must take under ``TARGET_SECONDS`` in all. The proofs have no peer to
compare against, so this reports seconds; each identity is proved ``REPEATS`` times, the proof
object rebuilt each time, and the median is printed. CPU time is reported beside wall time
because the wall clock of a shared machine also counts its other work.
"""

from __future__ import annotations

import statistics
import time

import circuitmath as cm

REPEATS = 3
TARGET_SECONDS = 10.0


def main() -> int:
    wall_total = cpu_total = 0.0
    axioms_total = 0
    failed = []
    print(f"{'identity':<32} {'wall s':>7} {'cpu s':>7} {'axioms':>6}  {'second check sizes':<28} status")
    for identity in cm.identities():
        walls, cpus = [], []
        for _ in range(REPEATS):
            proof = identity.build_proof()
            start, start_cpu = time.perf_counter(), time.process_time()
            report = proof.verify(identity.name)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - start_cpu)
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        wall_total, cpu_total, axioms_total = wall_total + wall, cpu_total + cpu, axioms_total + len(report.axioms)
        status = "proved" if report.ok else "FAILED"
        if not report.ok:
            failed.append(identity.name)
        sizes = " / ".join(",".join(f"{s}={v}" for s, v in i.items()) for i in report.instances)
        print(f"{identity.name:<32} {wall:>7.3f} {cpu:>7.3f} {len(report.axioms):>6}  {sizes[:28]:<28} {status}")
    print(f"{'total':<32} {wall_total:>7.3f} {cpu_total:>7.3f} {axioms_total:>6}")
    print(f"target: under {TARGET_SECONDS:.0f} s of CPU in all: {'met' if cpu_total < TARGET_SECONDS else 'MISSED'}")
    return 1 if failed or cpu_total >= TARGET_SECONDS else 0


if __name__ == "__main__":
    raise SystemExit(main())
