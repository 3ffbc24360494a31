#!/usr/bin/env python3
"""Golden logits of llama.cpp on the random-weight ``qwen35`` file of ``tests/qwen35_files.py``.

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/qwen35_llamacpp.npz   ``ids`` int32 [N] (the token sequence),
                                     ``prefill`` float32 [N, vocab] (one batch of N tokens),
                                     ``decode`` float32 [N, vocab] (PREFILL tokens in one batch,
                                     then one token a step), both from an empty cache
  tests/golden/qwen35_llamacpp_stages.npz   every named tensor llama.cpp's graph evaluates on
                                     STAGE_IDS (a prefill of 7 tokens, then 1 decode step of the
                                     8th), keyed ``{step}|{index}|{name}|{op}`` in graph order: the
                                     input of ``compare --against llama.cpp``'s pairing, replayed
                                     by the tests without llama-cpp-python

N (80) is past llama.cpp's 64-token DeltaNet chunk; PREFILL (66) too, so the decode run's
recurrent steps start from a state that crossed a chunk boundary. llama.cpp runs through
llamatrace's adapter (:class:`llamatrace.peers.llamacpp.LlamaCpp` in capture mode: logits of
every token, F32 KV cache, flash attention off), 2 threads.

Usage (from the repo root, in the golden venv: llama-cpp-python 0.3.36, gguf):

  /work/venv-golden/bin/python tests/golden/make_qwen35_golden.py --out tests/golden
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
from qwen35_files import CONTEXT, write_qwen35_file  # noqa: E402

from llamatrace.peers.llamacpp import LlamaCpp  # noqa: E402
from make_arch_golden import llamacpp_logits  # noqa: E402  (tests/golden/, beside this script)

N = 80
PREFILL = 66
STAGE_IDS = 8


def token_ids(vocab_size: int) -> np.ndarray:
    """The fixed sequence: N ids drawn once (seed 35) from the vocabulary, control tokens excluded."""
    return np.random.default_rng(35).integers(3, vocab_size, size=N).astype(np.int32)



def llamacpp_stages(path: Path, ids: np.ndarray) -> dict[str, np.ndarray]:
    engine = LlamaCpp(str(path), n_ctx=CONTEXT, threads=2, capture=True)
    out = {}
    try:
        for step, chunk in enumerate([ids[:-1], ids[-1:]]):
            engine.eval([int(t) for t in chunk])
            for i, c in enumerate(engine.captured):
                out[f"{step}|{i}|{c.name}|{c.op}"] = c.array
    finally:
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_qwen35_file(Path(tmp) / "tiny-qwen35.gguf")
        engine = LlamaCpp(str(path), n_ctx=CONTEXT, threads=1)
        vocab = engine.vocab_size
        engine.close()
        ids = token_ids(vocab)
        stages = llamacpp_stages(path, ids[:STAGE_IDS])
        out = {"ids": ids, "prefill": llamacpp_logits(path, ids, N, n_ctx=CONTEXT),
               "decode": llamacpp_logits(path, ids, PREFILL, n_ctx=CONTEXT)}
    gap = np.linalg.norm(out["prefill"] - out["decode"], axis=1) / np.linalg.norm(out["prefill"], axis=1)
    print(f"qwen35: llama.cpp prefill vs decode max relative {gap.max():.2e} ({N} tokens, decode from {PREFILL})")
    np.savez_compressed(args.out / "qwen35_llamacpp.npz", **out)
    np.savez_compressed(args.out / "qwen35_llamacpp_stages.npz", **stages)
    print(f"{len(stages)} llama.cpp tensors kept for the stage pairing")
    import llama_cpp
    print(f"wrote {args.out / 'qwen35_llamacpp.npz'} (llama-cpp-python {llama_cpp.__version__})")


if __name__ == "__main__":
    main()
