"""The forward pass's fused stages against the unfused ones, in one process: the table of
docs/performance.md "Corpus throughput" (the glue after the matmuls).

    python benchmarks/bench_fused.py -m 8b-q4_0.gguf [-c 512] [--rounds 3] [--threads 2] [--activations q8]

One chunk of the text is scored as ``perplexity`` scores it (``chunk_logits``, then the NLL),
alternately on the fused path (nothing watches the stages: a prefill's probabilities without its
masked scores, SwiGLU from the unsplit gate|up product) and on the unfused path (a recorder that
watches ``kq`` and ``ffn_gate`` and records nothing: every score, the split halves); the order
flips every round, so that a shared machine's noise falls on both alike. Prints one JSON line per
chunk: wall and process CPU seconds (the steadier on a shared machine), the PPL (the same on both
paths, bit for bit) and the load average (1 min) before and after.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "golden" / "corpus.txt"


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="the GGUF")
    p.add_argument("-f", "--file", default=str(CORPUS), help="the text (default: tests/golden/corpus.txt)")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--activations", default="q8")
    args = p.parse_args()

    from llamatrace.machine.runtime import configure_process
    configure_process()
    from llamatrace.corpus.chunks import make_chunks, read_corpus
    from llamatrace.corpus.metrics import token_nll
    from llamatrace.corpus.perplexity import chunk_logits
    from llamatrace.machine.threads import set_threads
    from llamatrace.model.llama import Llama

    set_threads(args.threads)
    model = Llama.load(args.model, activations=args.activations, cache=False)
    model.warmup()
    chunks = make_chunks(model.tokenizer, read_corpus(Path(args.file)), args.ctx_size, 1, model.config.max_seq_len)
    ids, targets = chunks.chunk(0), chunks.targets(0)

    def score(unfused: bool) -> np.ndarray:
        if unfused:
            with model.trace(stages=["kq", "ffn_gate"], keep_events=False):
                return token_nll(chunk_logits(model, ids, chunks.first), targets)
        return token_nll(chunk_logits(model, ids, chunks.first), targets)

    for r in range(args.rounds):
        for unfused in ((False, True) if r % 2 == 0 else (True, False)):
            load0, cpu0, wall0 = _load(), time.process_time(), time.perf_counter()
            nll = score(unfused)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            print(json.dumps(dict(round=r, path="unfused" if unfused else "fused", wall=round(wall, 2),
                                  cpu=round(cpu, 2), ppl=float(np.exp(nll.mean())), load=f"{load0} -> {_load()}")),
                  flush=True)


if __name__ == "__main__":
    main()
