"""Threading choices with the cores free and with them taken: the table of docs/performance.md "Threads".

    python benchmarks/bench_threads.py -m MODEL.gguf [--load 2] [--rounds 3] [--base DIR]

Every choice (layer, wait policy, thread count) runs in a process of its own, loaded once;
the runs are interleaved — each round runs every choice with the cores free, then every
choice beside ``--load`` busy loops (:mod:`llamatrace.analysis.busy`) — so a shared machine's
own noise falls on every choice alike. ``--base DIR``: also run the code at DIR (a checkout of
an older commit, e.g. ``git archive COMMIT llamatrace | tar -x -C DIR``) as "before". Prints the
median tok/s of each choice and state, and each median as a ratio of the best of ``-t 1`` /
``-t 2`` in the same state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from llamatrace.analysis.busy import busy_loops

CHILD = """
import json, sys
try:
    from llamatrace.machine.runtime import configure_process       # as the CLI does
    configure_process()
except ImportError:
    pass                                                 # older code: importing llamatrace did it
from llamatrace.machine import threads
from llamatrace.model.generate import GenerationStats, generate
from llamatrace.model.llama import Llama
path, n = sys.argv[1], int(sys.argv[2])
if n:
    threads.set_threads(n)
model = Llama.load(path, activations=sys.argv[3])
model.warmup()
print(json.dumps({"layer": threads.threading_layer()}), flush=True)
for line in sys.stdin:
    prompt, decode = map(int, line.split())
    ids = [100 + (7 * i) % 1000 for i in range(prompt)]
    stats = GenerationStats()
    for _ in generate(model, ids, max_tokens=decode + 1, stats=stats, stop_ids=frozenset()):
        pass
    print(json.dumps({"prefill": stats.prefill_tokens_per_s, "decode": stats.decode_tokens_per_s}), flush=True)
"""

# name: (extra environment, --threads, True to run the --base code)
CHOICES = {
    "omp default (before)": ({"NUMBA_THREADING_LAYER": "omp"}, 0, True),
    "omp passive (before)": ({"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "passive"}, 0, True),
    "tbb (before)": ({"NUMBA_THREADING_LAYER": "tbb"}, 0, True),
    "-t 1 (before)": ({}, 1, True),
    "-t 2 (before)": ({}, 2, True),
    "-t 2, omp passive": ({"OMP_WAIT_POLICY": "passive"}, 2, False),
    "-t 2, tbb": ({"NUMBA_THREADING_LAYER": "tbb"}, 2, False),
    "-t 2, spin 1k": ({"GOMP_SPINCOUNT": "1000"}, 2, False),
    "-t 2, spin 10k": ({"GOMP_SPINCOUNT": "10000"}, 2, False),
    "-t 2, spin 30k": ({"GOMP_SPINCOUNT": "30000"}, 2, False),
    "-t 2, spin 100k": ({"GOMP_SPINCOUNT": "100000"}, 2, False),
    "new default": ({}, 0, False),
}
BEST_OF = ("-t 1 (before)", "-t 2 (before)")


class Engine:
    def __init__(self, name: str, model: str, env: dict, threads: int, root: str, activations: str) -> None:
        full = dict(os.environ, **env, PYTHONPATH=root)
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, model, str(threads), activations], env=full,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.layer = json.loads(self.proc.stdout.readline())["layer"]

    def run(self, prompt: int, decode: int) -> dict:
        self.proc.stdin.write(f"{prompt} {decode}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--activations", default="f32")
    ap.add_argument("--load", type=int, default=2, help="busy loops in the loaded state")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--base", help="a checkout of the older code (its folder holding llamatrace/)")
    ap.add_argument("--only", action="append", help="run only these choices (repeatable)")
    ap.add_argument("--idle-only", action="store_true", help="skip the loaded state")
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    names = [n for n in CHOICES if (args.only is None or n in args.only) and (args.base or not CHOICES[n][2])]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    engines = {}
    try:
        for name in names:
            env, threads, root = CHOICES[name]
            engines[name] = Engine(name, args.model, env, threads, args.base if root else here, args.activations)
        runs = {(n, s): [] for n in names for s in ("idle", "loaded")}
        for r in range(args.rounds):
            for state, load in (("idle", 0), ("loaded", args.load))[:1 if args.idle_only else 2]:
                with busy_loops(load):
                    for name, e in engines.items():
                        got = e.run(args.prompt_tokens, args.decode_tokens)
                        runs[name, state].append(got)
                        print(f"round {r + 1} {state:6s} {name:22s} prefill {got['prefill']:7.1f} "
                              f"decode {got['decode']:6.1f}  (load avg {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for e in engines.values():
            e.close()
    med = {k: {p: statistics.median(x[p] for x in v) for p in ("prefill", "decode")} for k, v in runs.items() if v}
    print(f"\nload average at end: {os.getloadavg()}; medians of {args.rounds} rounds, tok/s "
          f"(÷ best of -t 1 / -t 2 in the same state)")
    print(f"| choice | layer | idle prefill | idle decode | loaded prefill | loaded decode |\n|---|---|---|---|---|---|")
    for name in names:
        cells = []
        for state in ("idle", "loaded")[:1 if args.idle_only else 2]:
            for p in ("prefill", "decode"):
                best = max((med[t, state][p] for t in BEST_OF if (t, state) in med), default=None)
                v = med[name, state][p]
                cells.append(f"{v:.1f}" + (f" ({v / best:.2f})" if best else ""))
        print(f"| {name} | {engines[name].layer if name in engines else ''} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
