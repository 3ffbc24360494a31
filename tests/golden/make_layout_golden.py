#!/usr/bin/env python3
"""Golden logits of llama.cpp on the attention layouts of ``tests/layout_files.py``: q|k|v fused
(``convert_hf_to_gguf.py --fuse-qkv``), biases added or left out, phi3's q, k, v apart.

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/layout_llamacpp.npz   per layout: ``{name}_ids`` int32 [N] (the token sequence),
                                     ``{name}_prefill`` float32 [N, vocab] (one batch of N tokens),
                                     ``{name}_decode`` float32 [N, vocab] (PREFILL tokens in one
                                     batch, then one token a step), both from an empty cache

llama.cpp runs through llamatrace's own adapter (:class:`llamatrace.peers.llamacpp.LlamaCpp` in
capture mode: logits of every token, F32 KV cache, flash attention off), 2 threads.

Usage (from the repo root, in a venv with llama-cpp-python 0.3.36 and gguf):

  /tmp/lv/bin/python tests/golden/make_layout_golden.py --out tests/golden
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
sys.path.insert(0, str(ROOT / "tests" / "golden"))
from layout_files import LAYOUTS, write_layout_file  # noqa: E402
from make_arch_golden import record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    args = ap.parse_args()
    cpp = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in LAYOUTS:
            record(write_layout_file(Path(tmp) / f"{name}.gguf", name), name, cpp)
    np.savez_compressed(args.out / "layout_llamacpp.npz", **cpp)
    import llama_cpp
    print(f"wrote {args.out / 'layout_llamacpp.npz'} (llama-cpp-python {llama_cpp.__version__})")


if __name__ == "__main__":
    main()
