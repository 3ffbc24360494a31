#!/usr/bin/env python3
"""Golden logits of llama.cpp (and HF transformers where its GGUF loader takes the file) on the
random-weight qwen2 / qwen3 / phi3 / gemma2 / gemma3 files of ``tests/arch_files.py``.

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/arch_llamacpp.npz   per arch: ``{arch}_ids`` int32 [N] (the token sequence),
                                   ``{arch}_prefill`` float32 [N, vocab] (one batch of N tokens),
                                   ``{arch}_decode`` float32 [N, vocab] (PREFILL tokens in one batch,
                                   then one token a step), both from an empty cache
  tests/golden/arch_hf.npz         ``{arch}_prefill`` float32 [N, vocab] for the files HF loads

llama.cpp runs through llamatrace's own adapter (:class:`llamatrace.peers.llamacpp.LlamaCpp` in
capture mode: logits of every token, F32 KV cache, flash attention off), 2 threads.

Usage (from the repo root, in the golden venv: llama-cpp-python 0.3.36, torch, transformers, gguf):

  /work/venv-golden/bin/python tests/golden/make_arch_golden.py --out tests/golden
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))                        # this checkout's llamatrace (peers need no numba)
sys.path.insert(0, str(ROOT / "tests"))
from arch_files import ARCHS, WINDOW, write_arch_file  # noqa: E402
from llamatrace.peers.llamacpp import LlamaCpp  # noqa: E402

N = 16                                  # tokens: > 3 windows of WINDOW (5)
PREFILL = 4                             # the decode run: 4 tokens in one batch, then 1 a step
HF_ARCHS = ARCHS                        # tried on each; those HF's GGUF loader refuses are reported


def token_ids(vocab_size: int) -> np.ndarray:
    """The fixed sequence: N ids drawn once (seed 34) from the vocabulary, control tokens excluded."""
    return np.random.default_rng(34).integers(3, vocab_size, size=N).astype(np.int32)


def llamacpp_logits(path: Path, ids: np.ndarray, prefill: int, n_ctx: int = 64) -> np.ndarray:
    """llama.cpp's float32 logits of every position of ``ids``: ``prefill`` tokens in one batch,
    then one a step (all of them in one batch when ``prefill == len(ids)``), from an empty cache."""
    engine = LlamaCpp(str(path), n_ctx=n_ctx, threads=2, capture=True)
    try:
        rows = [engine.eval([int(t) for t in ids[:prefill]])]
        rows += [engine.eval([int(t)]) for t in ids[prefill:]]
        return np.concatenate(rows).astype(np.float32)
    finally:
        engine.close()


def record(path: Path, name: str, cpp: dict, about: str = "", ids_of=None) -> np.ndarray:
    """Put llama.cpp's ``{name}_ids``, ``{name}_prefill`` and ``{name}_decode`` for the file at
    ``path`` into ``cpp`` (ids: ``ids_of`` — default :func:`token_ids` — of its vocabulary size);
    return the ids."""
    engine = LlamaCpp(str(path), n_ctx=64, threads=1)
    vocab = engine.vocab_size
    engine.close()
    ids = (ids_of or token_ids)(vocab)
    cpp[f"{name}_ids"] = ids
    cpp[f"{name}_prefill"] = llamacpp_logits(path, ids, N)
    cpp[f"{name}_decode"] = llamacpp_logits(path, ids, PREFILL)
    gap = np.abs(cpp[f"{name}_prefill"] - cpp[f"{name}_decode"]).max()
    print(f"{name}: llama.cpp prefill vs decode max |diff| {gap:.2e} ({about}{N} tokens)")
    return ids


def hf_logits(path: Path, ids: np.ndarray) -> np.ndarray | None:
    import torch
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     torch_dtype=torch.float32, attn_implementation="eager")
    except Exception as exc:                        # noqa: BLE001  (report which file HF refuses, go on)
        print(f"  HF cannot load {path.name}: {type(exc).__name__}: {str(exc)[:200]}")
        return None
    with torch.no_grad():
        out = model(torch.tensor(ids[None].astype(np.int64))).logits[0]
    return out.numpy().astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers logits")
    args = ap.parse_args()
    cpp, hf = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            path = write_arch_file(Path(tmp) / f"tiny-{arch}.gguf", arch)
            ids = record(path, arch, cpp, f"window {WINDOW}, ")
            if arch in HF_ARCHS and not args.no_hf:
                got = hf_logits(path, ids)
                if got is not None:
                    hf[f"{arch}_prefill"] = got
                    rel = np.linalg.norm(got - cpp[f"{arch}_prefill"], axis=1) / np.linalg.norm(got, axis=1)
                    print(f"  HF vs llama.cpp: max relative (per position) {rel.max():.2e}")
    np.savez_compressed(args.out / "arch_llamacpp.npz", **cpp)
    if hf:
        np.savez_compressed(args.out / "arch_hf.npz", **hf)
    import llama_cpp
    print(f"wrote {args.out / 'arch_llamacpp.npz'} (llama-cpp-python {llama_cpp.__version__})"
          + (f" and {args.out / 'arch_hf.npz'}" if hf else ""))


if __name__ == "__main__":
    main()
