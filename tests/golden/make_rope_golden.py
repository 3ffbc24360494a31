#!/usr/bin/env python3
"""Golden logits of llama.cpp on the rope-scaled random-weight files of ``tests/arch_files.py``
(:data:`ROPE_VARIANTS`: Gemma 3 with linear ×8 on its global layers, qwen2 and gemma3 with YaRN).

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/rope_llamacpp.npz   per variant: ``{name}_ids`` int32 [N] (the token sequence),
                                   ``{name}_prefill`` float32 [N, vocab] (one batch of N tokens),
                                   ``{name}_decode`` float32 [N - PREFILL, vocab] (PREFILL tokens in
                                   one batch, then one token a step: the steps' rows only)
  tests/golden/longrope_llamacpp.npz
                                   per LongRoPE file (:data:`LONGROPE_VARIANTS`, Phi-3's factors
                                   tensors): ``{name}_ids`` and, for a context of 64 positions
                                   (llama.cpp pads it to 256, the original context: the short
                                   factors) and of 512 (the long ones), ``{name}_{short,long}_prefill``
                                   and ``{name}_{short,long}_decode`` as above

llama.cpp runs through llamatrace's own adapter (:class:`llamatrace.peers.llamacpp.LlamaCpp` in
capture mode: logits of every token, F32 KV cache, flash attention off), 2 threads. The rope
scaling is the file's alone: the adapter passes llama.cpp's context defaults (no rope or YaRN
overrides), so llama.cpp resolves it from the metadata as llamatrace must.

Usage (from the repo root, in the golden venv: llama-cpp-python 0.3.36, gguf, numpy):

  /work/venv-golden/bin/python tests/golden/make_rope_golden.py --out tests/golden [--only longrope]
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
sys.path.insert(0, str(Path(__file__).parent))     # make_arch_golden beside it
from arch_files import LONGROPE_VARIANTS, ROPE_VARIANTS, write_arch_file, write_longrope  # noqa: E402
from make_arch_golden import llamacpp_logits  # noqa: E402
from llamatrace.peers.llamacpp import LlamaCpp  # noqa: E402

N = 40                                  # tokens: past the YaRN files' 32-token original context
PREFILL = 32                            # the decode run: 32 tokens in one batch, then 1 a step


def token_ids(vocab_size: int) -> np.ndarray:
    """The fixed sequence: N ids drawn once (seed 47) from the vocabulary, control tokens excluded."""
    return np.random.default_rng(47).integers(3, vocab_size, size=N).astype(np.int32)



LONGROPE_CTX = {"short": 64, "long": 512}
"""llama.cpp's context for each table of a LongRoPE file (original context 256; llama.cpp pads 64 to 256)."""


def longrope_golden(tmp: Path, out: Path) -> None:
    cpp = {}
    for name in LONGROPE_VARIANTS:
        path, plain = write_longrope(tmp, name), write_longrope(tmp, name, factors={})
        engine = LlamaCpp(str(path), n_ctx=64, threads=1)
        ids = token_ids(engine.vocab_size)
        engine.close()
        cpp[f"{name}_ids"] = ids
        for table, n_ctx in LONGROPE_CTX.items():
            cpp[f"{name}_{table}_prefill"] = llamacpp_logits(path, ids, N, n_ctx=n_ctx)
            cpp[f"{name}_{table}_decode"] = llamacpp_logits(path, ids, PREFILL, n_ctx=n_ctx)[PREFILL:]
        short, long = cpp[f"{name}_short_prefill"], cpp[f"{name}_long_prefill"]
        without = llamacpp_logits(plain, ids, N)

        def rel(a, b):
            r = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
            return f"{r.min():.2e}..{r.max():.2e}"
        print(f"{name}: short vs long factors {rel(short, long)}; short vs no factors {rel(short, without)}; "
              f"prefill vs decode max |diff| {np.abs(long[PREFILL:] - cpp[f'{name}_long_decode']).max():.2e}")
    np.savez_compressed(out / "longrope_llamacpp.npz", **cpp)
    print(f"wrote {out / 'longrope_llamacpp.npz'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    ap.add_argument("--only", choices=("rope", "longrope"), help="write one of the two files")
    args = ap.parse_args()
    if args.only != "rope":
        with tempfile.TemporaryDirectory() as tmp:
            longrope_golden(Path(tmp), args.out)
    if args.only == "longrope":
        return
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, rope) in ROPE_VARIANTS.items():
            path = write_arch_file(Path(tmp) / f"tiny-{name}.gguf", arch, rope=rope)
            unscaled_keys = {k: v for k, v in rope.items() if not k.startswith("scaling.")}
            plain = write_arch_file(Path(tmp) / f"tiny-{name}-unscaled.gguf", arch, rope=unscaled_keys)
            engine = LlamaCpp(str(path), n_ctx=64, threads=1)
            vocab = engine.vocab_size
            engine.close()
            ids = token_ids(vocab)
            out[f"{name}_ids"] = ids
            out[f"{name}_prefill"] = prefill = llamacpp_logits(path, ids, N)
            out[f"{name}_decode"] = decode = llamacpp_logits(path, ids, PREFILL)[PREFILL:]
            unscaled = llamacpp_logits(plain, ids, N)
            gap = np.abs(prefill[PREFILL:] - decode).max()
            rel = np.linalg.norm(prefill - unscaled, axis=1) / np.linalg.norm(unscaled, axis=1)
            print(f"{name}: prefill vs decode max |diff| {gap:.2e}; against the unscaled file: relative "
                  f"{rel.min():.2e}..{rel.max():.2e}, top token differs at {(prefill.argmax(1) != unscaled.argmax(1)).sum()}"
                  f" of {N} positions")
    np.savez_compressed(args.out / "rope_llamacpp.npz", **out)
    import llama_cpp
    print(f"wrote {args.out / 'rope_llamacpp.npz'} (llama-cpp-python {llama_cpp.__version__})")


if __name__ == "__main__":
    main()
