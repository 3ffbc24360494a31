#!/usr/bin/env python3
"""Golden outputs of llama.cpp on the random-weight gpt-oss files of ``tests/gptoss_files.py``.

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/gptoss_llamacpp.npz
      ids            int32 [N]: the token sequence
      {f}_prefill    float32 [N, vocab]: logits of one batch of N tokens     f = f32 | mxfp4
      {f}_decode     float32 [N, vocab]: PREFILL tokens in one batch, then one token a step
      tok_ids        int32: llama.cpp's tokens (no BOS, no special parsing) of gptoss_files.TOKENIZER_TEXTS
                     (the file's vocabulary with the ``gpt-4o`` pre-tokenizer), one after another
      tok_offsets    int32 [len + 1]: where each string's tokens start in tok_ids
      dump.step{s}.{i:03d}.{name}.{op}   llama.cpp's graph tensors on the f32 file, step 0 the first
                     PREFILL ids in one batch, step 1 the next id (float32, ggml's dims reversed)
      chat           str: gptoss_files.CHAT_MESSAGES rendered by gpt-oss's own chat template
                     (the sdist's models/templates/openai-gpt-oss-120b.jinja, date fixed) through
                     llama-cpp-python's Jinja2ChatFormatter, with the generation prompt

The f32 file (F32 experts) runs as llama.cpp's float32 arithmetic; the mxfp4 file (MXFP4 experts)
runs with llama.cpp's Q8_0 activations before every MXFP4 matmul (its CPU backend's only way).
llama.cpp runs through llamatrace's own adapter (:class:`llamatrace.peers.llamacpp.LlamaCpp` in
capture mode: logits of every token, F32 KV cache, flash attention off), 2 threads.

Usage (from the repo root, in the golden venv: llama-cpp-python 0.3.36, gguf):

  /work/venv-golden/bin/python tests/golden/make_gptoss_golden.py --out tests/golden \
      --sdist ~/.cache/llamatrace/sdist/llama_cpp_python-0.3.36.tar.gz
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
from gptoss_files import CHAT_MESSAGES, TOKENIZER_TEXTS, T, WINDOW, gptoss_chat_template, write_gptoss_file  # noqa: E402
from llamatrace.peers.llamacpp import LlamaCpp  # noqa: E402
from make_arch_golden import llamacpp_logits  # noqa: E402  (tests/golden/, beside this script)

N = 16                                  # tokens: > 3 windows of WINDOW (5), past YaRN's 8
PREFILL = 4                             # the decode run: 4 tokens in one batch, then 1 a step


def token_ids(vocab_size: int) -> np.ndarray:
    """The fixed sequence: N ids drawn once (seed 34) from the vocabulary, control tokens excluded."""
    return np.random.default_rng(34).integers(3, vocab_size, size=N).astype(np.int32)



def llamacpp_tokens(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import llama_cpp
    texts = TOKENIZER_TEXTS
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    rows = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts]
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
    return np.array([i for r in rows for i in r], np.int32), offsets


def llamacpp_chat(sdist: Path) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    fmt = Jinja2ChatFormatter(gptoss_chat_template(sdist), eos_token="<|return|>", bos_token="<|startoftext|>",
                              add_generation_prompt=True)
    return fmt(messages=CHAT_MESSAGES).prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    ap.add_argument("--sdist", type=Path, required=True, help="the llama-cpp-python 0.3.36 sdist tarball")
    args = ap.parse_args()
    out = {"chat": np.array(llamacpp_chat(args.sdist))}
    with tempfile.TemporaryDirectory() as tmp:
        for name, experts in (("f32", T.F32), ("mxfp4", T.MXFP4)):
            path = write_gptoss_file(Path(tmp) / f"tiny-gpt-oss-{name}.gguf", experts=experts)
            if "ids" not in out:
                engine = LlamaCpp(str(path), n_ctx=64, threads=1)
                out["ids"] = token_ids(engine.vocab_size)
                engine.close()
                out["tok_ids"], out["tok_offsets"] = llamacpp_tokens(path)
            if name == "f32":
                engine = LlamaCpp(str(path), n_ctx=64, threads=2, capture=True)
                for step, chunk in enumerate((out["ids"][:PREFILL], out["ids"][PREFILL:PREFILL + 1])):
                    engine.eval([int(t) for t in chunk])
                    for i, c in enumerate(engine.captured):
                        out[f"dump.step{step}.{i:03d}.{c.name}.{c.op}"] = c.array.astype(np.float32)
                engine.close()
            out[f"{name}_prefill"] = llamacpp_logits(path, out["ids"], N)
            out[f"{name}_decode"] = llamacpp_logits(path, out["ids"], PREFILL)
            gap = np.abs(out[f"{name}_prefill"] - out[f"{name}_decode"]).max()
            print(f"{name}: llama.cpp prefill vs decode max |diff| {gap:.2e} (window {WINDOW}, {N} tokens)")
    np.savez_compressed(args.out / "gptoss_llamacpp.npz", **out)
    import llama_cpp
    print(f"wrote {args.out / 'gptoss_llamacpp.npz'} (llama-cpp-python {llama_cpp.__version__})")


if __name__ == "__main__":
    main()
