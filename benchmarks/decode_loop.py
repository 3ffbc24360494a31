"""``bench``'s decode loop against ``profile_decode``'s step and the read probe, in one process.

    python benchmarks/decode_loop.py -m FILE.gguf [--threads 2] [--rounds 6] [--decode 8] [--pages] [--no-cache]

The model loads as ``bench`` loads it (through the packed-weights cache unless ``--no-cache`` or
``$LLAMATRACE_NO_CACHE``). Alternated in rounds, so that every figure of a round shares its moment
of a shared machine:

- ``bench``: the engine ``bench`` runs (:class:`llamatrace.analysis.bench._Llamatrace`, its
  ``run``: a 128-token prefill, then ``--decode`` greedy steps timed as ``bench`` times them),
  each step's forward pass also timed alone (wall and process CPU time);
- ``step``: one forward call at the next position of a separate cache, after a read of 1 GiB (as
  ``profile_decode`` runs it: not right after another step);
- ``probe`` / ``probe small pages``: :func:`llamatrace.analysis.roofline.read_bandwidth` (best of
  3) on 2 MiB pages and on the pages of weights packed without the cache.

``--pages``: the weights are also copied to fresh memory of the other kind (4 KiB pages
(:func:`llamatrace.kernels.types.packing.small_pages`) when they came from the cache's map, else 2 MiB
pages), and each round runs ``bench`` on both, in alternating order: what the pages cost decode,
in one process (twice the weights' memory). A step counts as clean when the process had its
threads' CPU (CPU / wall within 7 %); medians of the clean ones, and CPU ms of all.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np

from llamatrace.machine.runtime import configure_process

configure_process()

from llamatrace.analysis.bench import _Llamatrace, process_huge_page_bytes, prompt_ids  # noqa: E402
from llamatrace.analysis.roofline import read_bandwidth, read_buffer  # noqa: E402
from llamatrace.kernels.types import packing  # noqa: E402
from llamatrace.model.packcache import ENV_NO_CACHE  # noqa: E402

_HUGE = 2 << 20


def _huge_pages(n_bytes: int) -> np.ndarray:
    """uint8 ``[n_bytes]`` on 2 MiB pages where the kernel grants them (``MADV_HUGEPAGE``)."""
    buf = mmap.mmap(-1, n_bytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(buf, np.uint8)
    start = -whole.ctypes.data % _HUGE
    buf.madvise(mmap.MADV_HUGEPAGE)
    return whole[start:start + n_bytes]


def _copy(x: np.ndarray, pages) -> np.ndarray:
    if x.nbytes < 4096:
        return x
    y = pages(x.nbytes).view(x.dtype).reshape(x.shape)
    np.copyto(y, x)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=None, help="fixed threads (default: bench's automatic ones)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--pages", action="store_true")
    ap.add_argument("--no-cache", action="store_true", help="pack the weights, as bench --no-cache")
    args = ap.parse_args()
    if args.no_cache:
        os.environ[ENV_NO_CACHE] = "1"
    load = lambda: " ".join(open("/proc/loadavg").read().split()[:4])  # noqa: E731
    prompt = 128
    engine = _Llamatrace(args.model, args.threads, prompt + args.decode + 8, "q8")
    model = engine.model
    n = args.threads or 2
    weights = [w for lw in model.weights.layers for w in (lw.wqkv, lw.wq, lw.wk, lw.wv, lw.wo, lw.w13, lw.w1, lw.w3, lw.w2)
               if w is not None] + [model.weights.output]
    sets = {"loaded": [(w.qs, w.d, w.m) for w in weights]}
    if args.pages:
        other, pages = ("small pages", packing.small_pages) if model.pack_cache.read else ("2 MiB pages", _huge_pages)
        sets[other] = [(_copy(w.qs, pages), _copy(w.d, pages), w.m if w.m is w.d else _copy(w.m, pages))
                       for w in weights]
    print(f"{args.model}: {'mapped from the cache' if model.pack_cache.read else 'packed'}, "
          f"{process_huge_page_bytes() / 1e9:.2f} GB of the process on 2 MiB pages; load {load()}", flush=True)
    ids = prompt_ids(model.config.vocab_size, prompt)
    buffers = {"probe": read_buffer(), "probe small pages": read_buffer(small_pages=True)}
    forward, steps = model.forward, []

    def timed(*a, **k):
        t0, c0 = time.perf_counter(), time.process_time()
        out = forward(*a, **k)
        steps.append((np.size(a[0]), time.perf_counter() - t0, time.process_time() - c0))
        return out

    model.forward = timed
    res: dict[str, list] = {}
    for rnd in range(args.rounds):
        for name in (list(sets) if rnd % 2 == 0 else list(sets)[::-1]):
            for w, (qs, d, m) in zip(weights, sets[name]):
                object.__setattr__(w, "qs", qs)
                object.__setattr__(w, "d", d)
                object.__setattr__(w, "m", m)
            steps.clear()
            _, decode_s = engine.run(ids, args.decode)
            res.setdefault(f"bench {name}", []).extend(s[1:] for s in steps if s[0] == 1)
            res.setdefault(f"bench {name} loop", []).append((decode_s / args.decode, None))
        cache = model.new_cache(prompt + 8)
        forward(np.asarray(ids), 0, cache)
        read_bandwidth(n, 1, buffers["probe"])
        t0, c0 = time.perf_counter(), time.process_time()
        forward(np.array([7]), cache.pos, cache)
        res.setdefault("step", []).append((time.perf_counter() - t0, time.process_time() - c0))
        for key, words in buffers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            gb_s = read_bandwidth(n, 3, words)
            res.setdefault(key, []).append((gb_s, (time.process_time() - c0) / (time.perf_counter() - t0)))
        print(f"round {rnd + 1}: load {load()}", flush=True)
    for key, vals in res.items():
        if key.startswith("probe"):
            clean = [v[0] for v in vals if v[1] >= 0.93 * n]
            print(f"{key:28s} GB/s: clean median {statistics.median(clean) if clean else float('nan'):6.2f} "
                  f"({len(clean)}/{len(vals)} clean), all {' '.join(f'{v[0]:.1f}' for v in vals)}")
        elif key.endswith("loop"):
            print(f"{key:28s} ms a step (bench's timing): {' '.join(f'{v[0] * 1e3:.1f}' for v in vals)}")
        else:
            clean = [v for v in vals if v[1] >= 0.93 * n * v[0]]
            wall = statistics.median(v[0] for v in clean) * 1e3 if clean else float("nan")
            print(f"{key:28s} ms wall: clean median {wall:6.1f} ({len(clean)}/{len(vals)} clean); "
                  f"CPU ms median {statistics.median(v[1] for v in vals) * 1e3:6.1f}")
    print(f"load after: {load()}")


if __name__ == "__main__":
    main()
