"""The decode kernels against a pure read of the same bytes, on model shapes with random weights.

    python benchmarks/bench_decode.py [--shapes q4_0_w13,q4k_w13,q6k_w2] [--threads 1,2] [--rounds 5]
                                      [--activations q8,f32]

Per shape, enough copies of one random matrix to pass the L3 (260 MB here) are multiplied by one
row of x in turn (the decode kernel, ``registry.matmul``), alternated with a Numba-parallel sum of
the same packed bytes split by tiles as the kernels split them. Both are reported as GB/s of wall
time over the rounds where the process had its threads' CPU (CPU / wall within 10 %), and as GB
per CPU-second (bytes over CPU time, times the threads): on a shared machine the second one is
the figure to compare, since time spent waiting for a core counts in neither.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
from numba import njit, prange

from llamatrace.machine.runtime import configure_process

configure_process()

from llamatrace.kernels.types import packing  # noqa: E402
from llamatrace.kernels.types.registry import matmul  # noqa: E402
from llamatrace.machine import threads  # noqa: E402
from llamatrace.machine.jit import JIT_EXACT_PARALLEL  # noqa: E402

T = gguf.GGMLQuantizationType
BLOCKS = {T.Q4_0: (32, 18, (0,)), T.Q4_K: (256, 144, (0, 2)), T.Q6_K: (256, 210, (208,)),
          T.Q8_0: (32, 34, (0,)), T.MXFP4: (32, 17, ())}
"""Per type: weights a block, file bytes a block, where its fp16 scales sit (set to 0.01: random
bits would give NaN and inf; MXFP4's E8M0 byte is set to 120)."""
SHAPES = {"q4_0_w13": (T.Q4_0, 28672, 4096, 9), "q4_0_w2": (T.Q4_0, 4096, 14336, 18),
          "q4_0_qkv": (T.Q4_0, 6144, 4096, 40), "q4k_w13": (T.Q4_K, 28672, 4096, 9),
          "q4k_q": (T.Q4_K, 4096, 4096, 40), "q6k_w2": (T.Q6_K, 4096, 14336, 12), "q6k_v": (T.Q6_K, 1024, 4096, 100),
          "q6k_out": (T.Q6_K, 128256, 4096, 1),
          # Qwen3.5-2B (Q8_0), Qwen3-30B-A3B's experts (Q4_K_M), gpt-oss-20b's (MXFP4)
          "q8_0_w13": (T.Q8_0, 12288, 2048, 12), "q8_0_w2": (T.Q8_0, 2048, 6144, 24),
          "q8_0_o": (T.Q8_0, 2048, 2048, 64), "q4k_exp13": (T.Q4_K, 768, 2048, 200),
          "q6k_exp2": (T.Q6_K, 2048, 768, 160), "mxfp4_exp": (T.MXFP4, 2880, 2880, 40)}
"""name: (type, n_out, n_in, copies)."""


@njit(**JIT_EXACT_PARALLEL)
def stream_tiles(words):
    """Sum of ``words`` uint64 [T, n]: the tiles split over the threads as the kernels' prange."""
    parts = np.zeros(words.shape[0], np.uint64)
    for t in prange(words.shape[0]):
        s = np.uint64(0)
        row = words[t]
        for i in range(row.shape[0]):
            s += row[i]
        parts[t] = s
    return parts.sum()


def random_weight(ggml_type, n_out: int, n_in: int, rng, activations: str = "q8") -> packing.Weight:
    per_block, nbytes, scales = BLOCKS[ggml_type]
    raw = rng.integers(0, 256, (n_out, n_in // per_block * nbytes), dtype=np.uint8)
    for at in scales:
        raw.reshape(n_out, -1, nbytes)[:, :, at:at + 2] = np.array([0.01], np.float16).view(np.uint8)
    if ggml_type == T.MXFP4:
        raw.reshape(n_out, -1, nbytes)[:, :, 0] = 120
    return packing.pack("w", ggml_type, raw, n_out, n_in, activations=activations)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="q4_0_w13,q4_0_w2,q4k_w13,q6k_w2")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--activations", default="q8", help="comma-separated activation modes (q8, f32)")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    names = [f"{n}:{a}" for n in args.shapes.split(",") for a in args.activations.split(",")]
    sets = {n: [random_weight(*SHAPES[n.split(":")[0]][:3], rng, n.split(":")[1])
                for _ in range(SHAPES[n.split(":")[0]][3])] for n in names}
    res: dict[tuple, list] = {}
    for _ in range(args.rounds):
        for n in names:
            ws = sets[n]
            x = rng.standard_normal((1, ws[0].n_in)).astype(np.float32)
            out = np.empty((1, ws[0].n_out), np.float32)
            nbytes = sum(w.qs.nbytes + w.d.nbytes + w.m.nbytes for w in ws)
            views = [w.qs.reshape(w.qs.shape[0], -1).view(np.uint64) for w in ws]
            for th in counts:
                threads.set_threads(th)
                matmul(x, ws[0], out)
                stream_tiles(views[0])
                for kind in ("kernel", "read"):
                    t0, c0 = time.perf_counter(), time.process_time()
                    if kind == "kernel":
                        for w in ws:
                            matmul(x, w, out)
                    else:
                        for v in views:
                            stream_tiles(v)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    res.setdefault((n, th, kind), []).append((nbytes / wall / 1e9, cpu / wall, nbytes / cpu * th / 1e9))
    print(f"load {open('/proc/loadavg').read().split()[:3]}")
    for (n, th, kind), vals in sorted(res.items()):
        clean = [v[0] for v in vals if v[1] >= 0.9 * th]
        wall = f"{statistics.median(clean):6.2f}" if clean else "     -"
        print(f"{n:14s} {th}t {kind:6s}  GB/s {wall} ({len(clean)}/{len(vals)} rounds with the CPU)  "
              f"GB per CPU-second {statistics.median(v[2] for v in vals):6.2f}")


if __name__ == "__main__":
    main()
