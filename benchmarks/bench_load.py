"""Load times, one process after the other: the table of docs/performance.md "Loading a model".

    python benchmarks/bench_load.py -m MODEL.gguf [-m MODEL2.gguf] [--activations q8] [--rounds 3]

Each run is a process of its own that loads the model and returns; the file stays in the page
cache between runs (it is read once before the first). Per round and file, interleaved so that a
shared machine's noise falls on every case alike:

- ``llama.cpp``: llama-cpp-python's model and context constructors (it maps the file);
- ``pack``: ``Llama.load(cache=False)`` + warm-up: packing every tensor, as before the cache;
- ``cold``: the entry (and the tokenizer's, :mod:`llamatrace.text.tokcache`) removed first, so
  the load packs and writes it (the first load of a file);
- ``warm``: the entry written by ``cold``, mapped, right after it (while the kernel may still be
  writing the entry to disk); ``warm 2nd``: the next load of it.

llamatrace's figure is ``Llama.load`` + :meth:`~llamatrace.model.llama.Llama.warmup` (Numba's
cached kernels loaded, every weight touched once), as ``llamatrace bench`` reports it. The entries
go to a temporary ``$LLAMATRACE_CACHE_DIR`` (deleted at the end). llama.cpp runs in the same
interpreter: install llama-cpp-python there, or put a folder holding it on ``--llamacpp-path``.
Prints the median of each case, its ratio to llama.cpp's median and the load average (1 min) of
the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, os, sys, time
engine, path, mode = sys.argv[1:4]
if engine == "llama.cpp":
    from llamatrace.peers.llamacpp import LlamaCpp
    t0 = time.perf_counter()
    LlamaCpp(path, 512, os.cpu_count())
    print(json.dumps({"total": time.perf_counter() - t0}))
    sys.exit()
from llamatrace.machine.runtime import configure_process           # as the CLI does
configure_process()
from llamatrace.model.llama import Llama
t0 = time.perf_counter()
model = Llama.load(path, activations=mode, cache=engine != "pack")
load = time.perf_counter() - t0
model.warmup()
print(json.dumps({"total": time.perf_counter() - t0, "load": load, "read": model.pack_cache.read,
                  "written": model.pack_cache.written}))
"""

CASES = ("llama.cpp", "pack", "cold", "warm", "warm 2nd")


def run(case: str, path: Path, mode: str, env: dict) -> dict:
    engine = "cold" if case.startswith("warm") else case
    out = subprocess.run([sys.executable, "-c", CHILD, engine, str(path), mode], env=env, check=True,
                         capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["loadavg"] = os.getloadavg()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, action="append", required=True)
    ap.add_argument("--activations", action="append", choices=("f32", "q8"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llamacpp-path", help="a folder holding llama_cpp, put on the children's PYTHONPATH")
    args = ap.parse_args(argv)
    modes = args.activations or ["q8"]
    with tempfile.TemporaryDirectory(prefix="bench-load-") as cache_root:
        env = dict(os.environ, LLAMATRACE_CACHE_DIR=cache_root, LLAMATRACE_QUIET="1")
        env.pop("LLAMATRACE_NO_CACHE", None)
        if args.llamacpp_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (args.llamacpp_path, env.get("PYTHONPATH")) if p)
        for path in args.model:                    # into the page cache
            with open(path, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        results: dict[tuple, list[dict]] = {}
        for r in range(args.rounds):
            for path in args.model:
                for mode in modes:
                    for case in ("llama.cpp", "pack", "cold", "warm", "llama.cpp", "warm 2nd"):
                        if case == "llama.cpp" and len(modes) > 1 and mode != modes[0]:
                            continue                # once per file and round is enough
                        if case == "cold":            # the packed entry and the tokenizer's
                            for pattern in (f"{path.stem}.{mode}.*", f"{path.stem}.*.tokenizer"):
                                for entry in Path(cache_root, "packed").glob(pattern):
                                    entry.unlink()
                        res = run(case, path, mode, env)
                        expect = {"pack": (False, False), "cold": (False, True)}.get(case, (True, False))
                        if case != "llama.cpp" and (res["read"], res["written"]) != expect:
                            print(f"warning: {case} run read={res['read']} written={res['written']}", file=sys.stderr)
                        results.setdefault((path.name, mode if case != "llama.cpp" else "-", case), []).append(res)
                        print(f"round {r + 1} {path.name} {mode} {case}: {res['total']:.2f} s "
                              f"(load avg {res['loadavg']:.1f})", file=sys.stderr, flush=True)
        print("| file | mode | case | load s (median) | ÷ llama.cpp | runs | load avg |")
        print("|---|---|---|---|---|---|---|")
        for path in args.model:
            base = statistics.median(x["total"] for x in results[path.name, "-", "llama.cpp"])
            for mode in ["-", *modes]:
                for case in CASES:
                    runs = results.get((path.name, mode, case))
                    if not runs:
                        continue
                    med = statistics.median(x["total"] for x in runs)
                    loads = [x["loadavg"] for x in runs]
                    each = " ".join(f"{x['total']:.2f}" for x in runs)
                    print(f"| {path.name} | {mode} | {case} | {med:.2f} | {med / base:.2f} | {each} | "
                          f"{min(loads):.1f}–{max(loads):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
