"""Where a decode step's time goes: each matmul kind against the bytes it reads, and the rest.

    python benchmarks/profile_decode.py -m FILE.gguf [--activations q8] [--threads 1 2] [--rounds 5] [--no-cache]

The model is loaded as ``bench`` and ``generate`` load it: through the packed-weights cache unless
``--no-cache`` (or ``$LLAMATRACE_NO_CACHE``); the cache's map can be on 2 MiB pages, a load without
it is on 4 KiB pages, and decode reads the two at different speeds (docs/performance.md "Decode"):
the first line says how much of the process is on 2 MiB pages.

Per thread count, alternating the measurements in rounds (medians shown, a shared machine):

- ``probe``: ``bench``'s read bandwidth (:func:`llamatrace.analysis.roofline.read_bandwidth`: the
  best of 3 reads of 1 GiB on 2 MiB pages), and ``probe small pages`` the same on the pages a load
  without the cache gives the weights;
- ``stream``: a Numba-parallel sum of every layer's packed weight bytes, split over the threads by
  tiles as the decode kernels split them (what a kernel that only reads could reach);
- one line per matmul kind (fused q|k|v, wo, fused gate|up, down, output): one row of x through
  every layer's matrix of that kind in turn (so the bytes come from DRAM, not the 260 MB L3),
  ms per call and GB/s of its packed bytes;
- ``region``: an empty parallel region (the fork/join every kernel call pays);
- a decode step at position ~``--prompt`` by ``Llama.forward``, split into time inside the
  matmuls, inside the other kernels (norms, RoPE, attention, SiLU, ...), and the rest (Python).

Each line: the median of the rounds where the process had its threads' CPU (the last field,
CPU / wall time, within 10 % of the thread count; all rounds when none did). Fields: GB/s and ms
per call for the matmuls and reads; ``step``: ms wall, ms in matmuls, in other kernels, in the
rest, GB/s of weights, ms of CPU; ``op``: ms per step, calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np
from numba import njit, prange

from llamatrace.machine.runtime import configure_process

configure_process()

from llamatrace.analysis.bench import process_huge_page_bytes  # noqa: E402
from llamatrace.analysis.roofline import read_bandwidth, read_buffer  # noqa: E402
from llamatrace.kernels.ops import fp32  # noqa: E402
from llamatrace.kernels.types import registry  # noqa: E402
from llamatrace.machine import threads  # noqa: E402
from llamatrace.machine.jit import JIT_EXACT_PARALLEL  # noqa: E402
from llamatrace.model import llama as llama_mod  # noqa: E402
from llamatrace.model.llama import Llama  # noqa: E402
from bench_decode import stream_tiles  # noqa: E402  (beside this script)


@njit(**JIT_EXACT_PARALLEL)
def _region(a):
    for i in prange(a.shape[0]):
        a[i] += 1


def _nbytes(w) -> int:
    return w.qs.nbytes + w.d.nbytes + (w.m.nbytes if w.m is not w.d else 0)


def _kinds(model):
    """{kind: [Weight per layer]} for the decode's matmuls."""
    kinds = defaultdict(list)
    for lw in model.weights.layers:
        for name in ("wqkv", "wq", "wk", "wv", "wo", "w13", "w1", "w3", "w2"):
            w = getattr(lw, name)
            if w is not None:
                kinds[f"{name} {w.ggml_type.name} {w.n_out}x{w.n_in}"].append(w)
    kinds[f"output {model.weights.output.ggml_type.name}"].append(model.weights.output)
    return kinds


def _time(fn, reps=1):
    t0 = time.perf_counter()
    c0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps


class _Timed:
    """Wraps the forward pass's matmul and fp32 kernels, adding their wall time per name."""

    def __init__(self):
        self.acc = defaultdict(float)
        self.calls = defaultdict(int)
        self._saved = []

    def wrap(self, module, name, key):
        fn = getattr(module, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            self.acc[key] += time.perf_counter() - t0
            self.calls[key] += 1
            return r

        self._saved.append((module, name, fn))
        setattr(module, name, timed)

    def matmul(self):
        fn = llama_mod.matmul

        def timed(x, w, out=None):
            t0 = time.perf_counter()
            r = fn(x, w, out)
            self.acc[f"matmul {w.name.split('.')[-1] if '.' in w.name else w.name}"] += time.perf_counter() - t0
            self.calls["matmul"] += 1
            return r

        self._saved.append((llama_mod, "matmul", fn))
        llama_mod.matmul = timed

    def restore(self):
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--activations", default="q8")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--no-cache", action="store_true", help="pack the weights, as bench --no-cache")
    args = ap.parse_args()

    model = Llama.load(args.model, activations=args.activations, cache=False if args.no_cache else None)
    model.warmup()
    kinds = _kinds(model)
    buffers = {"probe": read_buffer(), "probe small pages": read_buffer(small_pages=True)}
    # every layer's packed bytes as [T, n] uint64 rows: one copy, same total size, tile-split
    total = sum(_nbytes(w) for ws in kinds.values() for w in ws)
    x1 = np.random.default_rng(0).standard_normal((1, model.config.hidden_dim), np.float32)
    cache = model.new_cache(args.prompt + 8 * args.rounds * len(args.threads) + 8)
    model.forward(np.arange(1, args.prompt + 1) % 1000, 0, cache)
    region = np.zeros(64, np.int64)
    res = defaultdict(list)
    print(f"{args.model}: {args.activations}, {total / 1e9:.3f} GB of packed weights "
          f"({'mapped from the cache' if model.pack_cache.read else 'packed'}; the process has "
          f"{process_huge_page_bytes() / 1e9:.3f} GB on 2 MiB pages); load {open('/proc/loadavg').read().split()[:3]}")
    for rnd in range(args.rounds):
        for n in args.threads:
            threads.set_threads(n)
            tag = f"{n}t"
            for key, words in buffers.items():
                c0 = time.process_time()
                t0 = time.perf_counter()
                gb_s = read_bandwidth(n, 3, words)
                res[tag, key].append((gb_s, (time.process_time() - c0) / (time.perf_counter() - t0)))
            for kind, ws in kinds.items():
                # pure read of the same tiles, tile-split
                views = [w.qs.reshape(w.qs.shape[0], -1).view(np.uint64) if (w.qs.shape[1] * w.qs.shape[2] * w.qs.shape[3] * w.qs.itemsize) % 8 == 0 else None for w in ws]
                if all(v is not None for v in views):
                    stream_tiles(views[0])
                    t0 = time.perf_counter()
                    c0 = time.process_time()
                    for v in views:
                        stream_tiles(v)
                    dt = time.perf_counter() - t0
                    cpu = time.process_time() - c0
                    res[tag, "stream " + kind].append((sum(v.nbytes for v in views) / dt / 1e9, dt / len(views) * 1e3,
                                                       cpu / dt))
                n_in = ws[0].n_in
                x = np.ascontiguousarray(x1[:, :n_in])
                out = np.empty((1, ws[0].n_out), np.float32)
                registry.matmul(x, ws[0], out)
                t0 = time.perf_counter()
                c0 = time.process_time()
                for w in ws:
                    registry.matmul(x, w, out)
                dt = time.perf_counter() - t0
                cpu = time.process_time() - c0
                res[tag, kind].append((sum(_nbytes(w) for w in ws) / dt / 1e9, dt / len(ws) * 1e3, cpu / dt))
            wall, cpu = _time(lambda: _region(region), 2000)
            res[tag, "region"].append((wall * 1e6, cpu / wall))
            # one decode step, split
            timer = _Timed()
            timer.matmul()
            for name in ("rmsnorm", "rope", "attention_scores", "softmax", "attention_values", "silu",
                         "precompute_freqs_cis"):
                timer.wrap(fp32, name, name)
            t0 = time.perf_counter()
            c0 = time.process_time()
            model.forward(np.array([7]), cache.pos, cache)
            step = time.perf_counter() - t0
            cpu = time.process_time() - c0
            timer.restore()
            mm = sum(v for k, v in timer.acc.items() if k.startswith("matmul"))
            other = sum(v for k, v in timer.acc.items() if not k.startswith("matmul"))
            res[tag, "step"].append((step * 1e3, mm * 1e3, other * 1e3, (step - mm - other) * 1e3,
                                     total / step / 1e9, cpu * 1e3, cpu / step))
            for k, v in timer.acc.items():
                res[tag, "op " + k].append((v * 1e3, timer.calls[k.split()[0]] if k.startswith("matmul") else timer.calls[k],
                                            cpu / step))
    print(f"load after: {open('/proc/loadavg').read().split()[:3]}")
    # a sample counts when the process had its threads' CPU (the last field, CPU/wall, within 10 %)
    for (tag, key), vals in sorted(res.items()):
        n = int(tag[:-1])
        whole = key == "step" or key.startswith("op ")      # single-threaded Python inside: no filter
        clean = vals if whole else [v for v in vals if v[-1] >= 0.9 * n]
        shown = clean or vals                               # no clean round: all of them, said so
        med = [statistics.median(v[i] for v in shown) for i in range(len(shown[0]))]
        lo, hi = min(v[0] for v in shown), max(v[0] for v in shown)
        print(f"{tag} {key:36s} " + " ".join(f"{m:9.3f}" for m in med)
              + f"   ({len(clean)}/{len(vals)} clean{'' if clean else ', all shown'}, first {lo:.3f}..{hi:.3f})")


if __name__ == "__main__":
    main()
