"""Microbenchmark: ``mul_mat_id`` on a GGUF's own expert blocks against the packed path.

One layer's ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` of a MoE file, in one process,
the two paths interleaved round by round:

- decode: one row times ``k`` random experts' gate|up, then ``k`` rows times their down;
  packed: ``llamatrace.kernels.int8.experts.Experts.matmul`` on the packed q8 weights where that
  module exists (the packed decode path before ``mul_mat_id``), else expert by expert;
- prefill: ``--tokens`` rows, ``k`` distinct random experts each; packed: one registry
  ``matmul`` per chosen expert, as :mod:`llamatrace.model.moe` does.

Reports 1-thread CPU time and 2-thread wall time (medians) and GB of chosen weights per second;
the file's pages are touched before timing (a fresh page costs more than the kernel).

    python3 benchmarks/bench_mul_mat_id.py /tmp/bench/qwen3moe-8.gguf --activations q8
"""

from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np

from llamatrace.gguf.reader import open_gguf
from llamatrace.kernels.mul_mat_id import FileExperts, mul_mat_id
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import matmul


def _file_experts(f, layer: int, kind: str) -> FileExperts:
    t = f.tensor(f"blk.{layer}.ffn_{kind}_exps.weight")
    data = t.data
    np.add.reduce(data[..., ::64].reshape(-1), dtype=np.uint64)          # fault every page in once
    return FileExperts(t.name, t.tensor_type, data.shape[1], int(t.shape[0]), data)


def _packed(parts: tuple[FileExperts, ...], activations: str) -> list:
    p0 = parts[0]
    return [packing.pack(f"e{e}", p0.ggml_type, np.concatenate([p.data[e] for p in parts]),
                         sum(p.n_out for p in parts), p0.n_in, activations=activations)
            for e in range(p0.n_expert)]


def _time(fn, threads: int, cpu: bool) -> float:
    numba.set_num_threads(threads)
    clock = time.process_time if cpu else time.perf_counter
    t0 = clock()
    fn()
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--activations", default="q8")
    ap.add_argument("--k", type=int, default=None, help="experts per token (default: the file's)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    f = open_gguf(a.model)
    gate, up, down = (_file_experts(f, a.layer, kind) for kind in ("gate", "up", "down"))
    arch = f.field("general.architecture")
    k = a.k or int(f.field(f"{arch}.expert_used_count"))
    n_expert, n_ff, dim = gate.n_expert, gate.n_out, gate.n_in
    print(f"{a.model} layer {a.layer}: gate/up {gate.ggml_type.name} [{n_expert}, {n_ff}, {dim}], "
          f"down {down.ggml_type.name} [{n_expert}, {down.n_out}, {down.n_in}], k {k}", flush=True)
    t0 = time.perf_counter()
    w13, w2 = _packed((gate, up), a.activations), _packed((down,), a.activations)
    print(f"packed in {time.perf_counter() - t0:.1f} s", flush=True)
    try:                                    # the packed decode path's one region, where it exists
        from llamatrace.kernels.int8.experts import Experts
        e13, e2 = Experts.of(w13), Experts.of(w2)
    except ImportError:
        e13 = e2 = None
    rng = np.random.default_rng(0)
    row_bytes = lambda p: p.data.shape[1] * p.data.shape[2]           # noqa: E731 (bytes of one expert)

    def decode_case():
        ids = rng.choice(n_expert, k, replace=False)
        x = rng.standard_normal((1, dim)).astype(np.float32)
        h = rng.standard_normal((k, n_ff)).astype(np.float32)
        nbytes = k * (row_bytes(gate) + row_bytes(up) + row_bytes(down))
        ours = lambda: (mul_mat_id(x, (gate, up), ids, np.zeros(k, np.int64), a.activations),   # noqa: E731
                        mul_mat_id(h, (down,), ids, None, a.activations))
        if e13 is not None and e2 is not None:
            packed = lambda: (e13.matmul(x, ids), e2.matmul(h, ids))                             # noqa: E731
        else:
            packed = lambda: ([matmul(x, w13[e]) for e in ids], [matmul(h[s:s + 1], w2[e])    # noqa: E731
                                                                 for s, e in enumerate(ids)])
        return nbytes, ours, packed

    def prefill_case():
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(a.tokens)]).reshape(-1)
        rows = np.repeat(np.arange(a.tokens), k)
        x = rng.standard_normal((a.tokens, dim)).astype(np.float32)
        h = rng.standard_normal((a.tokens * k, n_ff)).astype(np.float32)
        used = np.unique(ids)
        nbytes = len(used) * (row_bytes(gate) + row_bytes(up) + row_bytes(down))

        def packed():
            for e in used:
                sel = np.flatnonzero(ids == e)
                matmul(x[rows[sel]], w13[e])
                matmul(h[sel], w2[e])

        ours = lambda: (mul_mat_id(x, (gate, up), ids, rows, a.activations),   # noqa: E731
                        mul_mat_id(h, (down,), ids, None, a.activations))
        return nbytes, ours, packed

    for name, case in (("decode", decode_case), ("prefill", prefill_case)):
        for threads, cpu in ((1, True), (2, False)):
            times = {"file blocks": [], "packed": []}
            nbytes = 0
            for r in range(a.rounds + 1):
                nbytes, ours, packed = case()
                pair = (("file blocks", ours), ("packed", packed))
                for label, fn in (pair if r % 2 else pair[::-1]):
                    dt = _time(fn, threads, cpu)
                    if r:                                       # round 0 compiles and warms
                        times[label].append(dt)
            med = {label: float(np.median(v)) for label, v in times.items()}
            what = "CPU s (1 thread)" if cpu else "wall s (2 threads)"
            print(f"{name:8s} {what:19s} " + "  ".join(
                f"{label} {med[label] * 1e3:8.2f} ms {nbytes / med[label] / 1e9:6.1f} GB/s" for label in med)
                + f"  ratio {med['packed'] / med['file blocks']:.2f}  load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
