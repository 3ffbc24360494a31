"""Where a mixture of experts' decode step goes: dense matmuls by weight, ``mul_mat_id`` by type, the rest.

    python benchmarks/profile_moe_decode.py -m /tmp/qwen3moe-8.gguf --activations q8 --threads 2 --steps 24

The model is loaded as ``generate`` loads it, a 128-token prompt is run, then ``--steps`` decode
steps, each fed a random token (greedy output on random weights repeats itself, and the same
experts would stay in the caches). Each dense ``matmul`` call of the layer loop is timed by its
weight's name and type, each ``mul_mat_id`` call (:class:`~llamatrace.kernels.mul_mat_id.ExpertParts`)
by its weights' type and input width; ``rest`` is the step's wall time less those (attention, the
router, norms, RoPE, the experts' activation and weighted sum, Python). Per line: the median and
the best step, ms. On a shared machine read the best column too: one busy neighbour doubles a step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from llamatrace.machine.runtime import configure_process

configure_process()

import numpy as np  # noqa: E402

from llamatrace.kernels import mul_mat_id as mmid  # noqa: E402
from llamatrace.machine import threads  # noqa: E402
from llamatrace.model import llama as llama_mod  # noqa: E402
from llamatrace.model.llama import Llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--activations", default="q8", choices=("q8", "f32"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    a = ap.parse_args()
    model = Llama.load(a.model, activations=a.activations)
    model.warmup()
    threads.set_threads(a.threads)
    cache = model.new_cache(128 + a.steps + 8)
    model.forward(np.arange(1, 129) % 1000, 0, cache)
    step_ms: dict[str, list[float]] = defaultdict(list)
    cur: dict[str, float] = defaultdict(float)
    matmul, call = llama_mod.matmul, mmid.ExpertParts.__call__

    def timed_matmul(x, w, out=None):
        t0 = time.perf_counter()
        r = matmul(x, w, out)
        name = w.name.split(".")[-2] if w.name.count(".") >= 2 else w.name
        cur[f"matmul {name} {w.ggml_type.name}"] += time.perf_counter() - t0
        return r

    def timed_id(self, x, ids, rows=None):
        t0 = time.perf_counter()
        r = call(self, x, ids, rows)
        cur[f"mul_mat_id {self.ggml_type.name} n_in={self.n_in}"] += time.perf_counter() - t0
        return r

    llama_mod.matmul, mmid.ExpertParts.__call__ = timed_matmul, timed_id
    rng = np.random.default_rng(0)
    try:
        for _ in range(a.steps):
            cur.clear()
            t0 = time.perf_counter()
            model.forward(np.array([int(rng.integers(1000, 20000))]), cache.pos, cache)
            step = time.perf_counter() - t0
            for key, v in cur.items():
                step_ms[key].append(v * 1e3)
            step_ms["rest"].append((step - sum(cur.values())) * 1e3)
            step_ms["step"].append(step * 1e3)
    finally:
        llama_mod.matmul, mmid.ExpertParts.__call__ = matmul, call
    load = open("/proc/loadavg").read().split()[:3]
    print(f"{a.model}: {a.activations}, {a.threads} threads, {a.steps} steps; load {' '.join(load)}")
    for key in sorted(step_ms, key=lambda k: -statistics.median(step_ms[k])):
        print(f"{key:40s} median {statistics.median(step_ms[key]):8.2f} ms   best {min(step_ms[key]):8.2f}")


if __name__ == "__main__":
    main()
