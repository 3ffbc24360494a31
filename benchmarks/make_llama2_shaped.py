"""Write a Llama-2-7B-shaped GGUF (chapter 15's Llama 2 edition): the real Llama 2 vocabulary, random Q4_0 weights.

dim 4096, 32 heads, 32 KV heads (no GQA), ffn 11008, vocab 32000, rope θ 10000, norm eps 1e-5,
context 4096. The vocabulary (SentencePiece tokens, scores, types, BOS/EOS/UNK) is copied from
llama.cpp's ``models/ggml-vocab-llama-spm.gguf`` (``--vocab``; by default the copy llamatrace fetches
for its tokenizer tests). Weights are raw random Q4_0 blocks (make_8b.random_blocks), so a 32-layer
file (~3.8 GB) takes seconds to write. CI writes a 2-layer file of the same width
(tests/test_llama2_shaped.py); the 32-layer one is for this script only:

    python benchmarks/make_llama2_shaped.py -o /tmp/llama2-7b-q4_0.gguf --trace --delete

``--trace`` runs ``llamatrace trace --raw --layer 0 --dump-shapes`` on a 32-token prompt and prints
the chapter's stage lines (x [32 4096], wq [4096 4096], xq [32 32 128], scores [32 32 32],
ffn_gate [11008 4096] → [32 11008], output [32 32000], layer: 1 / 32).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from make_8b import random_blocks  # noqa: E402

T = gguf.GGMLQuantizationType

# Llama 2 7B (params.json of meta-llama/Llama-2-7b)
CONFIG = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab=32000,
              rope_theta=10000.0, norm_eps=1e-5, ctx=4096)

VOCAB_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
              "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")

# 32 tokens with BOS in the Llama 2 vocabulary (checked by tests/test_llama2_shaped.py)
PROMPT_32 = ("The llama is a domesticated South American camelid, widely used as a meat and pack animal "
             "by Andean cultures since the Inca")


def write(out: Path, vocab_path: Path, n_layers: int, seed: int = 0) -> None:
    c = CONFIG
    rng = np.random.default_rng(seed)
    vocab = gguf.GGUFReader(vocab_path)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("llama-2-7b-shaped-q4_0-random")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(c["ffn_dim"])
    w.add_head_count(c["n_heads"])
    w.add_head_count_kv(c["n_kv_heads"])
    w.add_rope_dimension_count(c["dim"] // c["n_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["norm_eps"])
    w.add_vocab_size(c["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    for key in VOCAB_KEYS:
        field = vocab.fields.get(key)
        if field is None:
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), vtype)

    def weight(name: str, n_out: int, n_in: int, std: float) -> None:
        w.add_tensor(name, random_blocks(rng, T.Q4_0, n_out, n_in, std), raw_dtype=T.Q4_0)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    dim, ffn = c["dim"], c["ffn_dim"]
    weight("token_embd.weight", c["vocab"], dim, 1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", dim)
        for name in ("attn_q", "attn_k", "attn_v"):
            weight(p + name + ".weight", dim, dim, dim ** -0.5)
        weight(p + "attn_output.weight", dim, dim, 0.5 * dim ** -0.5)
        norm(p + "ffn_norm.weight", dim)
        weight(p + "ffn_gate.weight", ffn, dim, dim ** -0.5)
        weight(p + "ffn_up.weight", ffn, dim, dim ** -0.5)
        weight(p + "ffn_down.weight", dim, ffn, 0.5 * ffn ** -0.5)
    norm("output_norm.weight", dim)
    weight("output.weight", c["vocab"], dim, dim ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=sys.stderr.isatty())
    w.close()


def trace_command(path: Path) -> list[str]:
    """The CLI run whose log shows the chapter's stage lines (layer 0 only, shapes only)."""
    return [sys.executable, "-m", "llamatrace", "trace", "-m", str(path), "--raw", "--layer", "0",
            "--dump-shapes", PROMPT_32]


def default_vocab() -> Path:
    """llama.cpp's test vocabulary, fetched with the tests' fixture (tests/llamacpp_sdist.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from llamacpp_sdist import vocab_test_file
    return vocab_test_file("llama-spm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, required=True, help="output .gguf")
    ap.add_argument("--layers", type=int, default=CONFIG["n_layers"], help="blocks (32 = the real 7B)")
    ap.add_argument("--vocab", type=Path, help="ggml-vocab-llama-spm.gguf (default: llamatrace's fetched copy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true", help="trace a 32-token prompt through the file")
    ap.add_argument("--delete", action="store_true", help="delete the file at the end")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    write(args.out, args.vocab or default_vocab(), args.layers, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    try:
        if args.trace:
            subprocess.run(trace_command(args.out), check=True)
    finally:
        if args.delete:
            args.out.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
