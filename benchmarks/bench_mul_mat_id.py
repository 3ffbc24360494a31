"""Experts' matmuls of one MoE layer: ``mul_mat_id`` on the file's blocks against the packed paths.

Usage: python3 benchmarks/bench_mul_mat_id.py FILE [--layer 0] [--reps 20] [--activations f32]

On layer ``--layer``'s ffn_gate_exps / ffn_up_exps / ffn_down_exps of FILE (a qwen3moe or gpt-oss
GGUF), interleaved in one process, each repetition on freshly drawn experts:

- decode: one row through k random experts' gate|up, then k rows through their downs;
- prefill: 128 rows, each with k random experts (top-k ids), grouped by expert.

Engines: ``file`` (:func:`llamatrace.kernels.mul_mat_id.mul_mat_id`, the f32 or q8 mode), ``packed``
(today's f32 path: each expert's gate|up packed as one Weight, ``registry.matmul`` expert by
expert, as :mod:`llamatrace.model.moe` runs them), ``q8`` (decode: the q8 mode's
:class:`~llamatrace.kernels.int8.experts.Experts`; prefill: the registry's q8 kernels expert by
expert). Reports GB/s of the chosen experts' file bytes per CPU-second at 1 thread and per
wall-second at 2 threads (medians), with the load average. The layer's file pages are faulted in
first (a running model's steady state; the first touch of a page costs more than its kernel).
"""

from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np

from llamatrace.gguf.reader import open_gguf
from llamatrace.kernels.int8.experts import Experts
from llamatrace.kernels.mul_mat_id import FileExperts, mul_mat_id
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import matmul


def _file_experts(f, layer: int) -> dict[str, FileExperts]:
    out = {}
    for short in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        t = f.tensor(f"blk.{layer}.{short}.weight")
        n_expert, n_out, n_in = t.shape[2], t.shape[1], t.shape[0]
        out[short] = FileExperts(t.name, t.tensor_type, int(n_out), int(n_in), t.data.reshape(n_expert, n_out, -1))
    return out


def _pack(fe: dict[str, FileExperts], activations: str):
    g, u, d = fe["ffn_gate_exps"], fe["ffn_up_exps"], fe["ffn_down_exps"]
    w13 = [packing.pack(f"gu#{e}", g.ggml_type, np.concatenate([g.data[e], u.data[e]]), 2 * g.n_out, g.n_in,
                        activations=activations) for e in range(g.n_expert)]
    w2 = [packing.pack(f"d#{e}", d.ggml_type, d.data[e], d.n_out, d.n_in, activations=activations)
          for e in range(d.n_expert)]
    return w13, w2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--activations", default="f32")
    ap.add_argument("--no-q8", action="store_true")
    a = ap.parse_args()
    f = open_gguf(a.file)
    fe = _file_experts(f, a.layer)
    g, u, d = fe["ffn_gate_exps"], fe["ffn_up_exps"], fe["ffn_down_exps"]
    n_expert, dim, ff = g.n_expert, g.n_in, g.n_out
    k = a.k or (8 if n_expert >= 64 else 4)
    for e in fe.values():                # fault the layer's pages in once: a model's steady state
        int(e.data.reshape(-1)[::4096].sum())
    expert_bytes = g.data[0].nbytes + u.data[0].nbytes + d.data[0].nbytes
    t0 = time.perf_counter()
    w13, w2 = _pack(fe, "f32")
    q13, q2 = (None, None) if a.no_q8 else _pack(fe, "q8")
    eq = None if a.no_q8 else (Experts.of(q13), Experts.of(q2))
    print(f"{os.path.basename(a.file)} layer {a.layer}: {n_expert} experts, {g.ggml_type.name} gate/up [{ff}, {dim}], "
          f"{d.ggml_type.name} down [{dim}, {ff}], k={k}; packed in {time.perf_counter() - t0:.0f} s")
    rng = np.random.default_rng(0)

    def engines_decode(ids, x1, h):
        yield "file", lambda: (mul_mat_id(x1, (g, u), ids, np.zeros(k, np.int64), a.activations),
                               mul_mat_id(h, (d,), ids, activations=a.activations))
        yield "packed", lambda: ([matmul(x1, w13[e]) for e in ids], [matmul(h[s:s + 1], w2[e]) for s, e in enumerate(ids)])
        if eq is not None:
            yield "q8", lambda: (eq[0].matmul(x1, ids), eq[1].matmul(h, ids))

    def engines_prefill(flat, rows, x, h):
        order = np.argsort(flat, kind="stable")
        es, starts = np.unique(flat[order], return_index=True)
        grp = [(int(e), order[s:t]) for e, s, t in zip(es, starts, list(starts[1:]) + [len(order)])]
        yield "file", lambda: (mul_mat_id(x, (g, u), flat, rows, a.activations),
                               mul_mat_id(h, (d,), flat, activations=a.activations))
        yield "packed", lambda: [(matmul(x[rows[p]], w13[e]), matmul(h[p], w2[e])) for e, p in grp]
        if eq is not None:
            yield "q8", lambda: [(matmul(x[rows[p]], q13[e]), matmul(h[p], q2[e])) for e, p in grp]

    for threads in (1, 2):
        numba.set_num_threads(threads)
        clock = time.process_time if threads == 1 else time.perf_counter
        for phase in ("decode", "prefill"):
            reps = a.reps if phase == "decode" else a.prefill_reps
            rates: dict[str, list[float]] = {}
            for rep in range(reps + 1):                   # the first: warm-up (compiles)
                if phase == "decode":
                    ids = rng.choice(n_expert, k, replace=False).astype(np.int64)
                    x1 = rng.standard_normal((1, dim)).astype(np.float32)
                    h = rng.standard_normal((k, ff)).astype(np.float32)
                    engines, n_bytes = engines_decode(ids, x1, h), k * expert_bytes
                else:
                    flat = np.concatenate([rng.choice(n_expert, k, replace=False) for _ in range(128)]).astype(np.int64)
                    rows = np.repeat(np.arange(128), k).astype(np.int64)
                    x = rng.standard_normal((128, dim)).astype(np.float32)
                    h = rng.standard_normal((128 * k, ff)).astype(np.float32)
                    engines, n_bytes = engines_prefill(flat, rows, x, h), len(np.unique(flat)) * expert_bytes
                for name, run in engines:
                    t = clock()
                    run()
                    dt = clock() - t
                    if rep:
                        rates.setdefault(name, []).append(n_bytes / dt / 1e9)
            base = np.median(rates["packed"])
            cells = "  ".join(f"{n} {np.median(r):5.2f} GB/s ({np.median(r) / base:4.2f}x)" for n, r in rates.items())
            unit = "CPU" if threads == 1 else "wall"
            print(f"  {phase:7s} {threads} thr ({unit}): {cells}   load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
