#!/usr/bin/env python3
"""Golden logits of llama.cpp on the random-weight ``qwen35moe`` file of ``tests/qwen35_files.py``
(``write_qwen35_file(..., moe=True)``).

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/qwen35moe_llamacpp.npz   ``ids`` int32 [N] (the token sequence),
                                        ``prefill`` float32 [N, vocab] (one batch of N tokens),
                                        ``decode`` float32 [N, vocab] (PREFILL tokens in one batch,
                                        then one token a step), both from an empty cache,
                                        ``fused`` float32 [N, vocab] (one batch of N tokens, on the
                                        same weights stored with ``ffn_gate_up_exps``),
                                        ``stage|NAME-L`` float32 [STAGE_IDS, …]: llama.cpp's graph
                                        tensors of the FFN (ffn_moe_out, the shared expert's, ffn_out)
                                        on a prefill of the first STAGE_IDS tokens

llama.cpp runs through llamatrace's adapter (:class:`llamatrace.peers.llamacpp.LlamaCpp` in
capture mode: logits of every token, F32 KV cache, flash attention off), 2 threads. It also
prints, over every token and MoE layer, the smallest gap between the k-th and (k+1)-th router
logits llama.cpp computed (``ffn_moe_logits``), which must stay far above float32 rounding.

Usage (from the repo root, in the golden venv: llama-cpp-python 0.3.36, gguf):

  /work/venv-golden/bin/python tests/golden/make_qwen35moe_golden.py --out tests/golden
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
from qwen35_files import CONTEXT, N_EXPERT_USED, write_qwen35_file  # noqa: E402

from llamatrace.peers.llamacpp import LlamaCpp  # noqa: E402

N = 20
PREFILL = 13
STAGE_IDS = 6
FFN_STAGES = ("ffn_moe_out", "ffn_shexp", "shared_expert_gate", "shared_expert_gate_sigmoid", "ffn_shexp_gated",
              "ffn_out")


def token_ids(vocab_size: int) -> np.ndarray:
    """The fixed sequence: N ids drawn once (seed 36) from the vocabulary, control tokens excluded."""
    return np.random.default_rng(36).integers(3, vocab_size, size=N).astype(np.int32)


def llamacpp_logits(path: Path, ids: np.ndarray, prefill: int) -> tuple[np.ndarray, float]:
    """Logits of every position, and the smallest k-th minus (k+1)-th router logit seen."""
    engine = LlamaCpp(str(path), n_ctx=CONTEXT, threads=2, capture=True)
    gap = np.inf
    try:
        rows = []
        for chunk in [ids[:prefill]] + [ids[i:i + 1] for i in range(prefill, len(ids))]:
            rows.append(engine.eval([int(t) for t in chunk]))
            for c in engine.captured:
                if c.name.startswith("ffn_moe_logits"):
                    top = -np.sort(-np.asarray(c.array, dtype=np.float64).reshape(-1, c.array.shape[-1]), axis=1)
                    gap = min(gap, float((top[:, N_EXPERT_USED - 1] - top[:, N_EXPERT_USED]).min()))
        return np.concatenate(rows).astype(np.float32), gap
    finally:
        engine.close()


def llamacpp_stages(path: Path, ids: np.ndarray) -> dict[str, np.ndarray]:
    engine = LlamaCpp(str(path), n_ctx=CONTEXT, threads=2, capture=True)
    try:
        engine.eval([int(t) for t in ids])
        return {f"stage|{c.name}": np.asarray(c.array, dtype=np.float32).reshape(len(ids), -1)
                for c in engine.captured if c.name.rsplit("-", 1)[0] in FFN_STAGES}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_qwen35_file(Path(tmp) / "tiny-qwen35moe.gguf", moe=True)
        engine = LlamaCpp(str(path), n_ctx=CONTEXT, threads=1)
        vocab = engine.vocab_size
        engine.close()
        ids = token_ids(vocab)
        prefill, gap1 = llamacpp_logits(path, ids, N)
        decode, gap2 = llamacpp_logits(path, ids, PREFILL)
        stages = llamacpp_stages(path, ids[:STAGE_IDS])
        fused, _ = llamacpp_logits(write_qwen35_file(Path(tmp) / "fused.gguf", moe=True, fused_gate_up=True), ids, N)
    gap = np.linalg.norm(prefill - decode, axis=1) / np.linalg.norm(prefill, axis=1)
    print(f"qwen35moe: llama.cpp prefill vs decode max relative {gap.max():.2e} ({N} tokens, decode from {PREFILL})")
    fgap = np.linalg.norm(prefill - fused, axis=1) / np.linalg.norm(prefill, axis=1)
    print(f"llama.cpp fused ffn_gate_up_exps vs separate: max relative {fgap.max():.2e}")
    print(f"smallest k-th - (k+1)-th router logit gap: {min(gap1, gap2):.3f}")
    np.savez_compressed(args.out / "qwen35moe_llamacpp.npz", ids=ids, prefill=prefill, decode=decode, fused=fused,
                        **stages)
    import llama_cpp
    print(f"wrote {args.out / 'qwen35moe_llamacpp.npz'} (llama-cpp-python {llama_cpp.__version__})")


if __name__ == "__main__":
    main()
