"""What tracing costs: generation time with a recorder against the same run without one.

The README's tracing-overhead figures come from here. Each configuration generates the same
tokens (prefill of the prompt, then greedy decode steps); configurations run interleaved,
``--repeats`` times, and each ratio is the median time with the recorder over the median time
without it, from the same run — the machine is shared and noisy, so only ratios are compared.

    python3 benchmarks/bench_trace_overhead.py [--model M] [--tokens 32] [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba

from llamatrace.gguf.fetch import resolve_model
from llamatrace.machine import threads
from llamatrace.model.llama import Llama

PROMPT = "The capital of France is"
# name → Recorder options (None = no recorder at all)
CONFIGS = {
    "off": None,
    "layer 0, kq* stages": dict(layers=[0], stages=["kq*"], keep_events=False),
    "every stage, every layer": dict(keep_events=False),
    "every stage, every layer, --stats": dict(stats=True, keep_events=False),
}


def run_once(model: Llama, ids: list[int], n_tokens: int, options: dict | None) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    if options is None:
        tokens = list(model.generate(ids, max_tokens=n_tokens, stop_ids=frozenset()))
    else:
        with model.trace(**options):
            tokens = list(model.generate(ids, max_tokens=n_tokens, stop_ids=frozenset()))
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the default model)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        threads.set_threads(args.threads)
    model = Llama.load(resolve_model(args.model))
    model.warmup()
    ids = model.tokenizer.encode(PROMPT)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    reference = None
    for _ in range(args.repeats):
        for name, options in CONFIGS.items():
            seconds, tokens = run_once(model, ids, args.tokens, options)
            reference = reference or tokens
            if tokens != reference:
                raise SystemExit(f"tracing changed the generated tokens ({name})")
            times[name].append(seconds)
    base = statistics.median(times["off"])
    print(f"{model.path.name}, {len(ids)} prompt tokens + {args.tokens} generated, "
          f"median of {args.repeats}, threads {numba.get_num_threads()}")
    print(f"{'recorder':<38} {'median s':>9} {'vs off':>7}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<38} {med:9.3f} {med / base:6.2f}x")


if __name__ == "__main__":
    main()
