"""Microbenchmark: the ``q8`` ``mul_mat_id`` microkernel for one activation row (decode), alone.

One thread, CPU time (``time.thread_time``: a neighbour on the other core time-slices a wall
clock, not this), the microkernel called tile by tile from Numba (no region, no Python between
tiles) on an expert tensor of the file:

- from L2: the first 512 rows of expert 0 (590 KB for Q4_K ``n_in`` 2048), again and again: ns a
  block (times the clock in GHz: cycles; ~3.65 on the Zen 4 EPYC of docs/performance.md);
- from memory: every row of a layer's tensor once (113 MB for qwen3moe's gate), a layer in turn: GB/s.

``--against FILE`` (a copy of another version's ``llamatrace/kernels/int8/mul_mat_id_q8.py``)
times its kernel too, each with its own prefetch distance, interleaved round by round, and checks
both give the same bits. The file from ``benchmarks/make_moe.py``:

    git show 1a13dc4:llamatrace/kernels/int8/mul_mat_id_q8.py > /tmp/old_mmid.py
    python benchmarks/bench_q8_block.py -m /tmp/qwen3moe-8.gguf --tensor ffn_gate_exps [--against /tmp/old_mmid.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

from llamatrace.machine.runtime import configure_process

configure_process()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from llamatrace.gguf.reader import open_gguf  # noqa: E402
from llamatrace.kernels.int8 import mul_mat_id_q8  # noqa: E402


def _tiles(m, kind: int):
    """``reps`` passes over ``n_rows`` weight rows of ``w``, :data:`TILE` rows a microkernel call
    (``kind`` a constant of the compiled loop, as in the kernels' region)."""
    tile = m.TILE

    @njit
    def tiles(w, n_rows, row_bytes, n_blocks, xq, xd, xs, res, ahead, reps, out):
        for _ in range(reps):
            for r0 in range(0, n_rows, tile):
                n = min(tile, n_rows - r0)
                m._call(kind, 1, w, r0 * row_bytes, row_bytes, n, n_blocks, xq, xd, xs, 0, 0, 0, 0, res, ahead)
                out[r0:r0 + n] = res[:n]
    return tiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tensor", default="ffn_gate_exps", help="the expert tensor's name without blk.N. and .weight")
    ap.add_argument("--type", type=int, help="the layers of this ggml type only (default: the lowest present)")
    ap.add_argument("--against", help="a copy of another version's mul_mat_id_q8.py")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    mods = {"this": mul_mat_id_q8}
    if a.against:
        spec = importlib.util.spec_from_file_location("against_mul_mat_id_q8", a.against)
        mods["against"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods["against"])
    f = open_gguf(a.model)
    layers = [t for name, t in f.tensors.items() if name.endswith(f".{a.tensor}.weight")]
    kinds = sorted({t.tensor_type for t in layers})
    layers = [t for t in layers if t.tensor_type == (a.type or kinds[0])]        # one type (Q4_K_M mixes them)
    datas = [t.data for t in layers]
    for d in datas:                                   # fault every page in once
        np.add.reduce(d[..., ::64].reshape(-1), dtype=np.uint64)
    n_expert, n_out, row_bytes = datas[0].shape
    p = mul_mat_id_q8.Parts((datas[0],), layers[0].tensor_type, int(layers[0].shape[0]))
    print(f"{a.model}: {a.tensor} {p.ggml_type.name} [{n_expert}, {n_out}, {p.n_in}] x {len(datas)} layers; "
          f"load {' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)
    x = np.random.default_rng(0).standard_normal((1, p.n_in)).astype(np.float32)
    xq, xd, xs = mul_mat_id_q8._activations(x, p.kind)
    res = np.empty(mul_mat_id_q8.MAX_ROWS * mul_mat_id_q8.TILE, np.float32)
    hot_rows = min(512, n_expert * n_out)
    hot = np.ascontiguousarray(datas[0].reshape(-1)[:hot_rows * row_bytes])
    hot.flags.writeable = False
    fns = {name: _tiles(m, p.kind) for name, m in mods.items()}
    ahead = {name: m.AHEAD[p.kind] for name, m in mods.items()}
    outs = {name: np.zeros(n_expert * n_out, np.float32) for name in mods}
    for name, fn in fns.items():
        fn(datas[0].reshape(-1), n_expert * n_out, row_bytes, p.n_blocks, xq, xd, xs, res, ahead[name], 1, outs[name])
    if a.against:
        print("the same bits:", outs["this"].tobytes() == outs["against"].tobytes())
    numba.set_num_threads(1)
    reps = max(1, 50_000 // (hot_rows * p.n_blocks) * 20)
    got: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for name in (list(fns) if r % 2 else list(fns)[::-1]):
            t0 = time.thread_time()
            fns[name](hot, hot_rows, row_bytes, p.n_blocks, xq, xd, xs, res, ahead[name], reps, outs[name])
            ns = (time.thread_time() - t0) / (reps * hot_rows * p.n_blocks) * 1e9
            got.setdefault(f"L2, ns a block, {name}", []).append(ns)
            w = datas[(2 * r + (name == "this")) % len(datas)].reshape(-1)
            t0 = time.thread_time()
            fns[name](w, n_expert * n_out, row_bytes, p.n_blocks, xq, xd, xs, res, ahead[name], 1, outs[name])
            got.setdefault(f"memory, GB/s, {name}", []).append(w.size / (time.thread_time() - t0) / 1e9)
    for key in sorted(got):
        v = got[key]
        print(f"{key:28s} median {statistics.median(v):7.2f}   [{min(v):.2f} .. {max(v):.2f}]")
    print(f"load {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
