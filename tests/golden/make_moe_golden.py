#!/usr/bin/env python3
"""Golden logits of llama.cpp on the random-weight mixture-of-experts files of
``tests/moe_files.py`` (qwen3moe, Mixtral-style llama, olmoe).

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/moe_llamacpp.npz   per file NAME (and NAME_q8_0 for the Q8_0-weight variant):
                                  ``{NAME}_ids`` int32 [N] (the token sequence),
                                  ``{NAME}_prefill`` float32 [N, vocab] (one batch of N tokens),
                                  ``{NAME}_decode`` float32 [N, vocab] (PREFILL tokens in one batch,
                                  then one token a step), both from an empty cache.
                                  ``mixtral_tie_prefill`` / ``_decode``: the Mixtral file with
                                  top-1 and router rows 2 and 5 equal (``tie``), on ``mixtral_ids``.
  tests/golden/moe_llamacpp_dump.npz  llama.cpp's graph tensors on the F32 qwen3moe and mixtral files
                                  (prefill of PREFILL ids, then one decode step of the next id),
                                  keys ``{NAME}.step{S}.{index:03d}.{tensor}.{op}`` float32, as
                                  read (ggml's four dims reversed); ``{NAME}.ids`` int32 [PREFILL + 1].

llama.cpp runs through llamatrace's own adapter (:class:`llamatrace.peers.llamacpp.LlamaCpp` in
capture mode: logits of every token, F32 KV cache, flash attention off), 2 threads.

Usage (from the repo root, in the golden venv: llama-cpp-python 0.3.36, gguf):

  /work/venv-golden/bin/python tests/golden/make_moe_golden.py --out tests/golden
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))                        # this checkout's llamatrace (peers need no numba)
sys.path.insert(0, str(ROOT / "tests"))
from moe_files import ARCHS, T, write_moe_file  # noqa: E402
from llamatrace.peers.llamacpp import LlamaCpp  # noqa: E402
from make_arch_golden import llamacpp_logits, record  # noqa: E402  (tests/golden/, beside this script)

N = 16                                  # tokens
PREFILL = 4                             # the decode run: 4 tokens in one batch, then 1 a step
VARIANTS = {"": T.F32, "_q8_0": T.Q8_0}
TIE = (2, 5)                            # the tie file: Mixtral with top-1 and router rows 2 and 5 equal


def token_ids(vocab_size: int) -> np.ndarray:
    """The fixed sequence: N ids drawn once (seed 49) from the vocabulary, control tokens excluded."""
    return np.random.default_rng(49).integers(3, vocab_size, size=N).astype(np.int32)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARCHS:
            for suffix, qtype in VARIANTS.items():
                key = name + suffix
                record(write_moe_file(Path(tmp) / f"tiny-{key}.gguf", name, qtype=qtype), key, out, ids_of=token_ids)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_moe_file(Path(tmp) / "tiny-mixtral-tie.gguf", "mixtral", kv={"expert_used_count": 1}, tie=TIE)
        ids = out["mixtral_ids"]
        out["mixtral_tie_prefill"] = llamacpp_logits(path, ids, N)
        out["mixtral_tie_decode"] = llamacpp_logits(path, ids, PREFILL)
    np.savez_compressed(args.out / "moe_llamacpp.npz", **out)
    dump = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("qwen3moe", "mixtral"):
            path = write_moe_file(Path(tmp) / f"tiny-{name}.gguf", name)
            ids = out[f"{name}_ids"][:PREFILL + 1]
            dump[f"{name}.ids"] = ids
            engine = LlamaCpp(str(path), n_ctx=64, threads=2, capture=True)
            for step, chunk in enumerate((ids[:PREFILL], ids[PREFILL:])):
                engine.eval([int(t) for t in chunk])
                for i, c in enumerate(engine.captured):
                    dump[f"{name}.step{step}.{i:03d}.{c.name}.{c.op}"] = c.array.astype(np.float32)
            engine.close()
    np.savez_compressed(args.out / "moe_llamacpp_dump.npz", **dump)
    import llama_cpp
    print(f"wrote {args.out / 'moe_llamacpp.npz'} (llama-cpp-python {llama_cpp.__version__})")


if __name__ == "__main__":
    main()
