"""Prefill and decode speed of llamatrace against llama.cpp (llama-cpp-python) on the same GGUF.

Both run in this process, interleaved, with the same thread count, so the ratio is fair on a
noisy shared machine. llama-cpp-python is a benchmark-only dependency:

    python -m venv /tmp/bench && /tmp/bench/bin/pip install llama-cpp-python -e .
    /tmp/bench/bin/python benchmarks/bench_decode.py --threads 2

Optional: --hf also times HF transformers (fp32, needs torch + transformers + gguf installed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def bench_llamatrace(model, prompt: list[int], n_decode: int) -> tuple[float, float]:
    cache = model.new_cache(len(prompt) + n_decode + 1)
    t0 = time.perf_counter()
    logits = model.forward(np.asarray(prompt), 0, cache)[-1]
    prefill = len(prompt) / (time.perf_counter() - t0)
    token = int(np.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(model.forward(np.asarray([token]), cache.pos, cache)[-1]))
    return prefill, n_decode / (time.perf_counter() - t0)


def bench_llama_cpp(llm, prompt: list[int], n_decode: int) -> tuple[float, float]:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = len(prompt) / (time.perf_counter() - t0)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return prefill, n_decode / (time.perf_counter() - t0)


def bench_hf(hf, prompt: list[int], n_decode: int) -> tuple[float, float]:
    import torch
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        out = hf(ids, use_cache=True)
        prefill = len(prompt) / (time.perf_counter() - t0)
        past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
        t0 = time.perf_counter()
        for _ in range(n_decode):
            out = hf(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
        return prefill, n_decode / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the llamatrace default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[22, 128])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="also time HF transformers (fp32)")
    args = ap.parse_args()

    from llamatrace import quant
    from llamatrace.fetch import resolve_model
    from llamatrace.model import Llama

    path = resolve_model(args.model)
    quant.set_threads(args.threads)
    model = Llama.load(path)
    runners = {"llamatrace": lambda p: bench_llamatrace(model, p, args.decode_tokens)}
    try:
        from llama_cpp import Llama as LlamaCpp
        llm = LlamaCpp(model_path=str(path), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads,
                       n_batch=512, logits_all=True, verbose=False)
        runners["llama.cpp"] = lambda p: bench_llama_cpp(llm, p, args.decode_tokens)
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp comparison", file=sys.stderr)
    if args.hf:
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(args.threads)
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                  gguf_file=os.path.basename(path), torch_dtype=torch.float32)
        runners["HF transformers"] = lambda p: bench_hf(hf, p, args.decode_tokens)

    rng = np.random.default_rng(0)
    print(f"model {path.name}, {args.threads} threads, {args.decode_tokens} decode steps, "
          f"median of {args.repeats}")
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for n in args.prompt_tokens:
        prompt = [int(x) for x in rng.integers(100, model.config.vocab_size - 100, size=n)]
        for name, run in runners.items():
            run(prompt[:8])                                   # warm-up (JIT, caches)
        for _ in range(args.repeats):
            for name, run in runners.items():                 # interleaved: same machine state
                results.setdefault((name, n), []).append(run(prompt))
    print(f"{'system':<16}{'prompt':>8}{'prefill tok/s':>16}{'decode tok/s':>15}{'decode vs llama.cpp':>22}")
    for n in args.prompt_tokens:
        base = results.get(("llama.cpp", n))
        base_decode = statistics.median(d for _, d in base) if base else None
        for name in runners:
            rows = results[(name, n)]
            prefill = statistics.median(p for p, _ in rows)
            decode = statistics.median(d for _, d in rows)
            ratio = f"{decode / base_decode:.2f}x" if base_decode else "-"
            print(f"{name:<16}{n:>8}{prefill:>16.1f}{decode:>15.1f}{ratio:>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
