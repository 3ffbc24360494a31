"""What one parallel region costs on each Numba threading layer: an empty ``prange`` over as
many items as threads, timed over many launches (the median of several batches).

    python benchmarks/bench_region.py                # every layer that loads, all cores
    python benchmarks/bench_region.py --threads 1

Each layer runs in a process of its own (Numba picks the layer once per process). The figure
is the fixed cost a kernel launch pays before any arithmetic: a decode step of SmolLM2 opens
~120 regions, so 10 µs per region is ~1.2 ms per token. It depends on the machine's load;
run it with the cores free.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

LAYERS = ("omp", "tbb", "workqueue")

CHILD = """
import statistics, sys, time
import numpy as np, numba
from numba import njit, prange
from llamatrace.machine.runtime import configure_process
configure_process()                       # as the CLI: the libtbb preload
threads, launches = int(sys.argv[1]), int(sys.argv[2])
numba.set_num_threads(threads)

@njit(parallel=True)
def region(a):
    for i in prange(a.shape[0]):
        a[i] += 1

a = np.zeros(threads, np.int64)
region(a)
batches = []
for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(launches):
        region(a)
    batches.append((time.perf_counter() - t0) / launches)
print(numba.threading_layer(), statistics.median(batches) * 1e6)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--launches", type=int, default=20000)
    args = ap.parse_args()
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    for layer in LAYERS:
        env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.threads), str(args.launches)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{layer:10s} not available ({done.stderr.strip().splitlines()[-1]})")
            continue
        got, us = done.stdout.split()
        print(f"{layer:10s} {float(us):7.2f} µs per region" + ("" if got == layer else f" (ran {got})"))


if __name__ == "__main__":
    main()
