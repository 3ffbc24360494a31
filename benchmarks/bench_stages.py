"""`perplexity --stages` against a plain `perplexity --base BASE.gguf`, chunk by chunk: the table of
docs/performance.md "`--stages` and `collect` against plain perplexity".

    python benchmarks/bench_stages.py --base BASE.gguf -m MODEL.gguf [-c 512] [--chunks 2] [--rounds 3]
        [--activations q8] [--profile]

Both models are loaded once; per round and chunk, interleaved so that a shared machine's noise
falls on both alike, it times the compute of one chunk as each run does it (load, tokenization and
the final statistics excluded):

- ``plain``: what ``perplexity --base BASE.gguf`` computes: the base's chunk with its compressed
  log-probabilities (``score_chunk`` "base"), then the model's KL divergence against them
  (``score_chunk`` "kld");
- ``stages``: what ``--stages`` computes, ``score_pair`` (both models, their stages and the local
  error).

Prints each round's seconds, the ratio stages ÷ plain (wall time, then the process's CPU time,
less sensitive to other jobs on a shared machine), and the load average (1 min) before and after. ``--profile``: a cProfile of one ``score_pair`` too (the 25 largest cumulative entries).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "golden" / "corpus.txt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the base GGUF")
    p.add_argument("-m", "--model", required=True, help="the GGUF compared with it")
    p.add_argument("-f", "--file", default=str(CORPUS), help="the text (default: tests/golden/corpus.txt)")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--activations", default="f32", choices=("f32", "q8"))
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()

    from llamatrace.machine.runtime import configure_process
    configure_process()
    from llamatrace.corpus.chunks import make_chunks, read_corpus
    from llamatrace.corpus.perplexity import ChunkJob, score_chunk
    from llamatrace.corpus.stage_errors import score_pair
    from llamatrace.model.llama import Llama

    base = Llama.load(a.base, activations=a.activations)          # the packed cache as the CLI uses it
    model = Llama.load(a.model, activations=a.activations)
    base.warmup()
    model.warmup()
    chunks = make_chunks(model.tokenizer, read_corpus(Path(a.file)), a.ctx_size, a.chunks, model.config.max_seq_len)
    jobs = [ChunkJob(chunks.chunk(i), chunks.targets(i), chunks.first) for i in range(chunks.n_chunk)]

    def plain() -> None:
        for job in jobs:
            _, rows = score_chunk(base, ChunkJob(job.ids, job.targets, job.first, "base"))
            score_chunk(model, ChunkJob(job.ids, job.targets, job.first, "kld", rows))

    def stages() -> None:
        for job in jobs:
            score_pair((base, model), job)

    print(f"{Path(a.base).name} (base) and {Path(a.model).name}, {a.activations}, "
          f"{chunks.n_chunk} chunks of {a.ctx_size}")
    for r in range(a.rounds):
        load0 = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        plain()
        t1, c1 = time.perf_counter(), time.process_time()
        stages()
        t2, c2 = time.perf_counter(), time.process_time()
        print(f"round {r + 1}: plain {t1 - t0:.2f} s  stages {t2 - t1:.2f} s  ratio {(t2 - t1) / (t1 - t0):.3f}  "
              f"(CPU {c1 - c0:.1f} / {c2 - c1:.1f} s: {(c2 - c1) / (c1 - c0):.3f})  "
              f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    if a.profile:
        prof = cProfile.Profile()
        prof.runcall(score_pair, (base, model), jobs[0])
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
