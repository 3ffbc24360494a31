"""Prefill chunks with and without the heap reuse of ``runtime.configure_process``: the table of
docs/performance.md "Corpus throughput" (the heap now reuses freed arrays).

    python benchmarks/bench_heap.py -m 8b-q4_k_m.gguf [-c 512] [--chunks 4] [--rounds 2] [--no-cache]

Each round runs two processes one after the other, heap reuse on, then off (glibc's defaults:
every array over its mmap threshold a fresh map; the child gets ``GLIBC_TUNABLES`` with a
``glibc.malloc`` tunable that changes nothing, which ``configure_process`` leaves to the user), each loading the model once (through the
packed-weights cache unless ``--no-cache``) and scoring the same chunk ``--chunks`` times as
``perplexity`` does (``chunk_logits``). Prints one JSON line per chunk: wall seconds, the
process's system seconds and minor page faults during it; the first chunk of a process also
faults in the pages the later ones reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "golden" / "corpus.txt"


def child(args) -> None:
    import resource
    import time

    from llamatrace.machine.runtime import configure_process
    configure_process()
    from llamatrace.corpus.chunks import make_chunks, read_corpus
    from llamatrace.corpus.perplexity import chunk_logits
    from llamatrace.model.llama import Llama

    model = Llama.load(args.model, activations="q8", cache=not args.no_cache)
    model.warmup()
    chunks = make_chunks(model.tokenizer, read_corpus(Path(args.file)), args.ctx_size, 1, model.config.max_seq_len)
    ids = chunks.chunk(0)
    for i in range(args.chunks):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        chunk_logits(model, ids, chunks.first)
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps(dict(heap="on" if args.heap else "off", chunk=i, wall=round(wall, 2),
                              sys=round(r1.ru_stime - r0.ru_stime, 2), minflt=r1.ru_minflt - r0.ru_minflt)),
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="the GGUF")
    p.add_argument("-f", "--file", default=str(CORPUS), help="the text (default: tests/golden/corpus.txt)")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--chunks", type=int, default=4, help="chunks a process")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-cache", action="store_true", help="pack the weights in memory")
    p.add_argument("--heap", choices=("on", "off"), help=argparse.SUPPRESS)     # a child's mode
    args = p.parse_args()
    if args.heap:
        args.heap = args.heap == "on"
        child(args)
        return
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            env = dict(os.environ)
            env.pop("GLIBC_TUNABLES", None)
            if mode == "off":                   # glibc's default value: the user's setting, kept
                env["GLIBC_TUNABLES"] = "glibc.malloc.perturb=0"
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--heap", mode], check=True, env=env)


if __name__ == "__main__":
    main()
