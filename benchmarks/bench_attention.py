"""The attention kernels alone, one layer, on random data: Llama-3.1-8B's shapes (32 heads, 8 KV
heads, head_dim 128) and SmolLM2-135M's (9 heads, 3 KV heads, head_dim 64).

    python benchmarks/bench_attention.py [--threads 2] [--rounds 3]

Per shape: milliseconds per call (the best round; wall and process CPU time, the steadier on a
shared machine) of ``attention_probs`` (q·k and the softmax of the keys each row sees: the fused
path), ``attention_values`` (P·V) and ``attention_scores`` (every key's q·k: the traced path),
for a causal prefill of 512 rows and for decode steps. To compare two checkouts, run it in each
tree with ``PYTHONPATH`` set to that tree, alternately, and quote the load average.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llamatrace.kernels.ops import fp32
from llamatrace.machine import threads

SHAPES = [  # (label, n_heads, n_kv_heads, head_dim, seq_len, kv_len)
    ("8B prefill", 32, 8, 128, 512, 512), ("8B decode", 32, 8, 128, 1, 512),
    ("SmolLM2 prefill", 9, 3, 64, 512, 512), ("SmolLM2 decode", 9, 3, 64, 1, 200),
    ("SmolLM2 decode", 9, 3, 64, 1, 600),
]


def _time(fn, calls: int, rounds: int) -> tuple[float, float]:
    fn()
    wall = cpu = float("inf")
    for _ in range(rounds):
        w, c = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        wall = min(wall, (time.perf_counter() - w) / calls)
        cpu = min(cpu, (time.process_time() - c) / calls)
    return wall * 1e3, cpu * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    threads.set_threads(args.threads)
    rng = np.random.default_rng(0)
    for label, n_heads, n_kv, head_dim, seq_len, kv_len in SHAPES:
        xq = rng.standard_normal((seq_len, n_heads, head_dim), dtype=np.float32)
        keys = rng.standard_normal((kv_len, n_kv, head_dim), dtype=np.float32)
        values = rng.standard_normal((kv_len, n_kv, head_dim), dtype=np.float32)
        scale, start = np.float32(head_dim ** -0.5), kv_len - seq_len
        probs = fp32.attention_probs(xq, keys, scale, start)
        calls = 3 if seq_len > 1 else 300
        times = {"probs": _time(lambda: fp32.attention_probs(xq, keys, scale, start), calls, args.rounds),
                 "values": _time(lambda: fp32.attention_values(probs, values), calls, args.rounds),
                 "scores": _time(lambda: fp32.attention_scores(xq, keys), calls, args.rounds)}
        print(f"{label} kv {kv_len}: " + "  ".join(f"{k} {w:.3f}/{c:.3f}" for k, (w, c) in times.items())
              + " ms wall/CPU")


if __name__ == "__main__":
    main()
