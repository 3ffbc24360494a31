"""Benchmark the q8 prefill kernels: the microkernels against the per-row kernels, at 8B shapes.

    python benchmarks/bench_prefill.py [--rows 128] [--repeat 5]

For Q4_0, Q4_1, Q8_0, Q4_K ([14336, 4096], as ffn_gate/ffn_up) and Q6_K ([4096, 14336], as ffn_down):
milliseconds per call (best of --repeat), int8 multiply-adds per second, and whether the two
kernels' outputs are the same bits (else their largest difference relative to the largest output).
Weights are random blocks with small fp16 scales. The machine may be shared: compare numbers
taken in one run.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numba
import numpy as np

from llamatrace.kernels import act8, packing

T = gguf.GGMLQuantizationType
SHAPES = {T.Q4_0: (14336, 4096), T.Q4_1: (14336, 4096), T.Q8_0: (14336, 4096), T.Q4_K: (14336, 4096),
          T.Q6_K: (4096, 14336)}
_F16 = {v: np.frombuffer(np.float16(v).tobytes(), np.uint8) for v in (0.01, 0.002, -0.05)}


def weight(qtype, n_out: int, n_in: int, rng) -> packing.Weight:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_out, n_in // block * size), dtype=np.uint8)
    blocks = raw.reshape(n_out, -1, size)
    if qtype == T.Q6_K:
        blocks[:, :, 208:210] = _F16[0.01]                        # d last
    else:
        blocks[:, :, 0:2] = _F16[0.01]                            # d first
        if qtype in (T.Q4_1, T.Q4_K):
            blocks[:, :, 2:4] = _F16[-0.05 if qtype == T.Q4_1 else 0.002]
    return packing.pack("w", qtype, raw, n_out, n_in, activations="q8")


def kernels(qtype, w):
    """(per-row kernel, microkernel), each ``f(x, out)``."""
    if qtype == T.Q4_K:
        return (lambda x, o: act8._matmul_q4k(x, w.qs, w.d, w.m, o),
                lambda x, o: act8._prefill(x, w.qs, w.d, w.m, np.float32(0.0), act8.PREFILL_Q4K, o))
    if qtype == T.Q6_K:
        return (lambda x, o: act8._matmul_q6k(x, w.qs, w.d, o),
                lambda x, o: act8._prefill_q6k(x, w.qs, w.d, o, numba.get_num_threads()))
    if qtype == T.Q8_0:
        return (lambda x, o: act8._matmul_q4(x, w.qs, w.d, w.d, np.float32(0.0), True, o),
                lambda x, o: act8._prefill(x, w.qs, w.d, w.d, np.float32(0.0), act8.PREFILL_Q8, o))
    m, m_scale = (w.m, np.float32(1.0)) if qtype == T.Q4_1 else (w.d, np.float32(-8.0))
    return (lambda x, o: act8._matmul_q4(x, w.qs, w.d, m, m_scale, False, o),
            lambda x, o: act8._prefill(x, w.qs, w.d, m, m_scale, act8.PREFILL_Q4, o))


def best_of(f, x, out, repeat: int) -> float:
    f(x, out)                                                    # compile or load, warm caches
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        f(x, out)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128, help="activation rows (prompt tokens)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if not act8.available():
        raise SystemExit("the q8 kernels need AVX2")
    rng = np.random.default_rng(0)
    print(f"{args.rows} rows, {numba.get_num_threads()} threads, best of {args.repeat}")
    for qtype, (n_out, n_in) in SHAPES.items():
        w = weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((args.rows, n_in)).astype(np.float32)
        outs = [np.empty((args.rows, n_out), np.float32) for _ in range(2)]
        secs = [best_of(f, x, o, args.repeat) for f, o in zip(kernels(qtype, w), outs)]
        same = ("same bits" if np.array_equal(*outs)
                else f"differ by {np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max():.1e} (relative)")
        macs = n_out * n_in * args.rows
        print(f"{qtype.name:5s} [{n_out}, {n_in}]: per-row {secs[0] * 1e3:6.1f} ms ({macs / secs[0] / 1e9:4.0f} G/s), "
              f"microkernel {secs[1] * 1e3:6.1f} ms ({macs / secs[1] / 1e9:4.0f} G/s); {same}")


if __name__ == "__main__":
    main()
