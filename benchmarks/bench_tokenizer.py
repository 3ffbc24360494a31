"""The tokenizer's share of a warm load, two source trees alternated: the table of
docs/performance.md "The tokenizer cache".

    python benchmarks/bench_tokenizer.py -m MODEL.gguf --tree before=/path/to/old --tree after=. [--rounds 4] [--first]

Each run is a fresh process (``PYTHONPATH`` = the tree) that times ``open_gguf`` (wall and CPU
seconds) and ``Tokenizer.from_reader`` (from the tokenizer cache, or with ``--first`` from the
GGUF as a first load builds it), then ``Llama.load(activations="q8")`` (the warm-up excluded), with the
packed and tokenizer caches in ``$LLAMATRACE_CACHE_DIR/NAME`` (default: folders under /tmp, kept
between runs so that every run after a tree's first finds its entries warm; delete them after).
Each tree has a folder of its own: trees whose entry formats differ would otherwise rewrite each
other's tokenizer entry (its name does not change with the format) on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
from llamatrace.machine.runtime import configure_process
configure_process()
from llamatrace.gguf.reader import open_gguf
from llamatrace.text.tokenizer import Tokenizer
from llamatrace.model.llama import Llama
path = sys.argv[1]
t0, c0 = time.perf_counter(), time.process_time(); f = open_gguf(path)
opened, opened_cpu = time.perf_counter() - t0, time.process_time() - c0
t0, c0 = time.perf_counter(), time.process_time(); Tokenizer.from_reader(f, path, cache=sys.argv[2] != "first")
tok, tok_cpu = time.perf_counter() - t0, time.process_time() - c0
f.close()
t0 = time.perf_counter(); m = Llama.load(path, activations="q8"); load = time.perf_counter() - t0
print(json.dumps({"open": opened, "open_cpu": opened_cpu, "tok": tok, "tok_cpu": tok_cpu, "load": load,
                  "read": m.pack_cache.read}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree (repeat)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--first", action="store_true", help="build the tokenizer from the GGUF, as a first load does")
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    env = dict(os.environ, LLAMATRACE_QUIET="1")
    root = env.get("LLAMATRACE_CACHE_DIR") or "/tmp/bench-tokenizer-cache"
    env.pop("LLAMATRACE_NO_CACHE", None)
    for r in range(a.rounds):
        for name, tree in trees.items():
            # cwd: `python -c` puts it first on sys.path, before PYTHONPATH: run in the tree measured
            out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(a.model),
                                  "first" if a.first else "warm"], check=True,
                                 capture_output=True, text=True, cwd=tree,
                                 env=dict(env, PYTHONPATH=tree, LLAMATRACE_CACHE_DIR=os.path.join(root, name))).stdout
            res = json.loads(out.strip().splitlines()[-1])
            print(f"round {r + 1} {name}: open_gguf {res['open']:.2f} s (CPU {res['open_cpu']:.2f}), tokenizer "
                  f"{res['tok']:.2f} s (CPU {res['tok_cpu']:.2f}), Llama.load {res['load']:.2f} s "
                  f"(packed entry read: {res['read']}), load avg {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
