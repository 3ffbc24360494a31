"""Benchmark the q8 prefill kernels: the microkernels against the per-row kernels, at 8B shapes.

    python benchmarks/bench_prefill.py [--rows 128] [--repeat 5] [--types Q4_K,Q6_K] [--all-shapes] [--micro-only] [--cpu-time]
    python benchmarks/bench_prefill.py --scaling 5 [--rows 128] [--repeat 5] [--types …] [--all-shapes]
    python benchmarks/bench_prefill.py --amx [--rows 128] [--repeat 5] [--types Q4_0,Q8_0,Q4_K,Q6_K]

For Q4_0, Q4_1, Q8_0, Q4_K ([14336, 4096], as ffn_gate/ffn_up) and Q6_K ([4096, 14336], as ffn_down):
milliseconds per call (best of --repeat), int8 multiply-adds per second, and whether the two
kernels' outputs are the same bits (else their largest difference relative to the largest output).
``--all-shapes`` runs each type at the three 8B matmul shapes ([4096, 4096], [14336, 4096],
[4096, 14336]); ``--micro-only`` skips the per-row kernels. Weights are random blocks with small fp16 scales. The machine may be shared: compare numbers
taken in one run. ``--scaling ROUNDS``: the microkernels' 1 -> 2 thread scaling instead, the two
counts alternated for ROUNDS rounds (each a mean of --repeat calls), every round's ratio shown:
on a VM the second vCPU's share of the host moves from round to round.

``--amx``: on a CPU with AMX, the AMX prefill against the VNNI prefill that runs without it
(:func:`llamatrace.kernels.int8.amx.measure`, what the default's decision times: random weights, one
call of each alternated for --repeat rounds, the best of each) for Q4_0, Q8_0, Q4_K and Q6_K at
the three 8B shapes: ms, G multiply-adds/s, the fraction of the tile peak (``tdpbssd`` chains,
:func:`llamatrace.kernels.int8.amx.make_dot_peak`) and of VNNI's speed, whether the bits are the same,
and a verdict per type. Whatever ``LLAMATRACE_AMX`` says but ``0``. Elsewhere: one ``error:``
line and exit status 2, as for an option this machine cannot run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import gguf
import numba
import numpy as np

from llamatrace.kernels.int8 import act8
from llamatrace.kernels.types import packing

T = gguf.GGMLQuantizationType
SHAPES = {T.Q4_0: (14336, 4096), T.Q4_1: (14336, 4096), T.Q8_0: (14336, 4096), T.Q4_K: (14336, 4096),
          T.Q6_K: (4096, 14336)}
SHAPES_8B = ((4096, 4096), (14336, 4096), (4096, 14336))
DEFAULT_TYPES = ",".join(t.name for t in SHAPES)
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


def best_of(f, x, out, repeat: int, clock=time.perf_counter) -> float:
    f(x, out)                                                    # compile or load, warm caches
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        f(x, out)
        best = min(best, clock() - t0)
    return best


def scaling(name: str, f, x, out, repeat: int, rounds: int) -> None:
    """Print ``f``'s milliseconds a call on 1 and 2 threads (medians) and their ratio each round."""
    ms: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(rounds):
        for n in ms:
            numba.set_num_threads(n)
            f(x, out)
            t0 = time.perf_counter()
            for _ in range(repeat):
                f(x, out)
            ms[n].append((time.perf_counter() - t0) * 1e3 / repeat)
    print(f"{name}: 1 thread {statistics.median(ms[1]):6.1f} ms, 2 threads {statistics.median(ms[2]):6.1f} ms; "
          f"1 -> 2 by round: {' '.join(f'{a / b:.2f}' for a, b in zip(ms[1], ms[2]))}", flush=True)


def amx_against_vnni(types: list[str], rows: int, rounds: int) -> None:
    """``--amx``: the table and a verdict per type (module docstring)."""
    from llamatrace.kernels.int8 import amx

    peak = amx.hw_dot_peak()
    threads = numba.get_num_threads()
    peak(8, threads, 0x04030201, 0x01FE0302)                     # compile or load
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        peak(200_000, threads, 0x04030201, 0x01FE0302)
        best = min(best, time.perf_counter() - t0)
    peak_gmac = 200_000 * amx.PEAK_MACS_PER_STEP * threads / best / 1e9
    print(f"AMX against VNNI, {rows} rows, {threads} threads, best of {rounds} alternated rounds; "
          f"tile peak {peak_gmac:.0f} G multiply-adds/s (tdpbssd chains); the default needs >= {amx.MARGIN}x "
          f"and the same bits", flush=True)
    for name in types:
        if name not in amx.KINDS:
            print(f"{name}: no AMX kernel", flush=True)
            continue
        ms = [amx.measure(amx.KINDS[name], (rows, n_out, n_in), rounds) for n_out, n_in in SHAPES_8B]
        for m in ms:
            a, v = m.row()["amx_gmac_s"], m.row()["vnni_gmac_s"]
            print(f"{name:5s} [{m.n_out}, {m.n_in}]: AMX {m.amx_s * 1e3:7.1f} ms ({a:5.0f} G/s, {a / peak_gmac:4.0%} of "
                  f"the tile peak), VNNI {m.vnni_s * 1e3:7.1f} ms ({v:5.0f} G/s): {m.speedup:.2f}x; "
                  f"{'same bits' if m.same_bits else 'NOT the same bits'}", flush=True)
        low, high = min(m.speedup for m in ms), max(m.speedup for m in ms)
        verdict = ("AMX faster on every shape: the default chooses it" if all(m.amx_wins for m in ms) else
                   "not the VNNI prefill's bits: never chosen by default" if not all(m.same_bits for m in ms) else
                   f"under {amx.MARGIN}x on some shape: the default keeps VNNI")
        print(f"{name}: AMX {low:.2f}-{high:.2f}x VNNI: {verdict}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128, help="activation rows (prompt tokens)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--types", default=DEFAULT_TYPES, help="comma-separated types (--amx: Q4_0,Q8_0,Q4_K,Q6_K)")
    ap.add_argument("--all-shapes", action="store_true", help="the three 8B shapes for every type")
    ap.add_argument("--micro-only", action="store_true", help="time the microkernels only")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time, not the wall clock: on a machine other processes share, "
                         "with NUMBA_NUM_THREADS=1, it leaves out the time the thread waited for a core")
    ap.add_argument("--scaling", type=int, metavar="ROUNDS", default=0,
                    help="1 -> 2 thread scaling of the microkernels over ROUNDS alternated rounds")
    ap.add_argument("--amx", action="store_true",
                    help="the AMX prefill against the VNNI prefill, --repeat alternated rounds (a CPU with AMX)")
    args = ap.parse_args()
    if not act8.available():
        raise SystemExit("the q8 kernels need AVX2")
    if args.amx:
        from llamatrace.kernels.int8 import amx
        if not amx.available().on:
            print(f"error: --amx: no AMX prefill to time here ({amx.available().reason}); run it on a CPU "
                  f"with amx_int8 (Xeon from Sapphire Rapids on), without LLAMATRACE_AMX=0", file=sys.stderr)
            raise SystemExit(2)
        amx_against_vnni(args.types.split(",") if args.types != DEFAULT_TYPES else list(amx.KINDS), args.rows, args.repeat)
        return
    rng = np.random.default_rng(0)
    print(f"{args.rows} rows, " + (f"1 and 2 threads alternated, {args.scaling} rounds of {args.repeat} calls"
                                   if args.scaling else f"{numba.get_num_threads()} threads, best of {args.repeat}"))
    for qtype in (T[name] for name in args.types.split(",")):
        for n_out, n_in in SHAPES_8B if args.all_shapes else (SHAPES[qtype],):
            w = weight(qtype, n_out, n_in, rng)
            x = rng.standard_normal((args.rows, n_in)).astype(np.float32)
            outs = [np.empty((args.rows, n_out), np.float32) for _ in range(2)]
            fs = kernels(qtype, w)[1:] if args.micro_only else kernels(qtype, w)
            if args.scaling:
                scaling(f"{qtype.name:5s} [{n_out}, {n_in}]", kernels(qtype, w)[1], x, outs[0], args.repeat, args.scaling)
                continue
            clock = time.process_time if args.cpu_time else time.perf_counter
            secs = [best_of(f, x, o, args.repeat, clock) for f, o in zip(fs, outs)]
            macs = n_out * n_in * args.rows
            if args.micro_only:
                print(f"{qtype.name:5s} [{n_out}, {n_in}]: microkernel {secs[0] * 1e3:6.1f} ms "
                      f"({macs / secs[0] / 1e9:4.0f} G/s)", flush=True)
                continue
            same = ("same bits" if np.array_equal(*outs)
                    else f"differ by {np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max():.1e} (relative)")
            print(f"{qtype.name:5s} [{n_out}, {n_in}]: per-row {secs[0] * 1e3:6.1f} ms ({macs / secs[0] / 1e9:4.0f} G/s), "
                  f"microkernel {secs[1] * 1e3:6.1f} ms ({macs / secs[1] / 1e9:4.0f} G/s); {same}", flush=True)

if __name__ == "__main__":
    main()
