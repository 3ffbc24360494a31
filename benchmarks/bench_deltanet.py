"""The gated DeltaNet kernels alone, one layer, on random data at Qwen3.5-2B's shape (16 key and
value heads, head_dim 128, conv kernel 4), for a 128-token prefill and a decode step.

    python benchmarks/bench_deltanet.py [--threads 1] [--rounds 5] [--tokens 128]

Milliseconds per call (the best round; wall and process CPU time, the steadier on a shared
machine) of the delta rule's forms (``delta_rule_chunked``, the prefill's; its NumPy twin, the
kernel before it was one; ``delta_rule_recurrent`` over the same tokens, and one decode step),
``causal_conv1d`` and ``l2norm``. ``--threads 1`` times the work, ``2`` the parallel kernels
as a prefill runs them (Numba's threads; the twin's products run on OpenBLAS's, which
``OPENBLAS_NUM_THREADS`` sets). To compare two checkouts, run it in each tree with ``PYTHONPATH`` set to
that tree, alternately, and quote the load average.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from llamatrace.kernels.ops import deltanet as dn
from llamatrace.machine import threads

N_HEADS, HEAD_DIM, CONV_KERNEL = 16, 128, 4
CONV_DIM = 3 * N_HEADS * HEAD_DIM


def _time(fn, rounds: int) -> tuple[float, float]:
    fn()                                          # compile or load, warm caches
    wall = cpu = float("inf")
    for _ in range(rounds):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - w)
        cpu = min(cpu, time.process_time() - c)
    return wall * 1e3, cpu * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    threads.set_threads(a.threads)
    rng = np.random.default_rng(0)
    n, f = a.tokens, np.float32
    q = dn.l2norm(rng.normal(size=(n, N_HEADS, HEAD_DIM)).astype(f), 1e-6)
    k = dn.l2norm(rng.normal(size=(n, N_HEADS, HEAD_DIM)).astype(f), 1e-6)
    v = rng.normal(size=(n, N_HEADS, HEAD_DIM)).astype(f)
    g = -rng.uniform(0.0, 1.5, size=(n, N_HEADS)).astype(f)
    beta = rng.uniform(0.0, 1.0, size=(n, N_HEADS)).astype(f)
    state = (0.3 * rng.normal(size=(N_HEADS, HEAD_DIM, HEAD_DIM))).astype(f)
    conv_in = rng.normal(size=(n, CONV_DIM)).astype(f)
    conv_w = rng.normal(size=(CONV_DIM, CONV_KERNEL)).astype(f)
    conv_state = np.zeros((CONV_DIM, CONV_KERNEL - 1), dtype=f)
    q_cols = conv_in[:, :N_HEADS * HEAD_DIM].reshape(n, N_HEADS, HEAD_DIM)   # strided, as in the block
    rows = [
        (f"delta_rule_chunked, {n} tokens", lambda: dn.delta_rule_chunked(q, k, v, g, beta, state.copy())),
        (f"delta_rule_chunked_ref (NumPy), {n} tokens",
         lambda: dn.delta_rule_chunked_ref(q, k, v, g, beta, state.copy())),
        (f"delta_rule_recurrent, {n} tokens", lambda: dn.delta_rule_recurrent(q, k, v, g, beta, state.copy())),
        ("delta_rule_recurrent, 1 token", lambda: dn.delta_rule_recurrent(q[:1], k[:1], v[:1], g[:1], beta[:1], state)),
        (f"causal_conv1d, {n} tokens", lambda: dn.causal_conv1d(conv_in, conv_state.copy(), conv_w)),
        ("causal_conv1d, 1 token", lambda: dn.causal_conv1d(conv_in[:1], conv_state, conv_w)),
        (f"l2norm (q of the conv output), {n} tokens", lambda: dn.l2norm(q_cols, 1e-6)),
    ]
    print(f"Qwen3.5-2B DeltaNet layer, {a.threads} thread(s), best of {a.rounds}; load average "
          f"{os.getloadavg()[0]:.2f}")
    for label, fn in rows:
        wall, cpu = _time(fn, a.rounds)
        print(f"  {label:44s} {wall:8.3f} ms wall  {cpu:8.3f} ms CPU")


if __name__ == "__main__":
    main()
