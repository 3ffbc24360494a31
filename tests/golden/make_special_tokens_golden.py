#!/usr/bin/env python3
"""Golden token ids of llama.cpp's tokenizer on tiny vocabularies that differ only in the keys
deciding which special tokens a text gets: ``tokenizer.ggml.add_bos_token``,
``tokenizer.ggml.add_eos_token`` (Qwen3-Embedding's files say true) and, without the BOS key, the
pre-tokenizer's name (``dbrx`` and ``smaug-bpe`` share llama3's regex but not its BOS).

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/special_tokens_llamacpp.json
      {"texts": [...], "variants": {name: {"vocab": write_vocab's keyword arguments,
                                           "special": [ids per text] (llama_tokenize, add_special),
                                           "plain": [ids per text] (without)}}}

The vocabularies are :func:`vocab_files.write_vocab`'s, so the test writes the same files. Usage
(from the repo root, in the golden venv: llama-cpp-python 0.3.36, gguf, numpy):

  /work/venv-golden/bin/python tests/golden/make_special_tokens_golden.py --out tests/golden
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))                        # llamatrace.text.vocab (no numba, no tiktoken)
sys.path.insert(0, str(ROOT / "tests"))
from vocab_files import write_vocab  # noqa: E402

TEXTS = ["hi the", "", "the cat and the hat", "<|im_end|> typed by hand"]
VARIANTS = {
    "bos_eos": {"add_bos": True, "add_eos": True},
    "eos_only": {"add_bos": False, "add_eos": True},
    "eos_false": {"add_bos": True, "add_eos": False},
    "pre_llama_bpe": {"pre": "llama-bpe"},
    "pre_tekken": {"pre": "tekken"},
    "pre_dbrx": {"pre": "dbrx"},
    "pre_smaug_bpe": {"pre": "smaug-bpe"},
    "pre_smollm": {"pre": "smollm"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    import llama_cpp

    out = {"texts": TEXTS, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in VARIANTS.items():
            path = write_vocab(Path(tmp) / f"{name}.gguf", **kwargs)
            llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
            out["variants"][name] = {
                "vocab": kwargs,
                "special": [llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in TEXTS],
                "plain": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in TEXTS],
            }
            del llm
    target = args.out / "special_tokens_llamacpp.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
