"""Write a gpt-oss-20b-shaped ``gpt-oss`` GGUF: the real config, MXFP4 experts, random weights.

For benchmarks only (load, memory, prefill/decode of gpt-oss's MXFP4 experts at scale), never
for CI: all 24 layers make ~12 GB, each layer ~0.45 GB. Make one at a time, under /tmp, and
delete it after.

    python benchmarks/make_gptoss.py -o /tmp/gptoss-mxfp4.gguf --layers 4

Shape (config.json of openai/gpt-oss-20b): n_embd 2880, 24 layers, 32 experts of 2880 (top-4,
softmax over the chosen), 64 query and 8 KV heads of 64 with sinks and q/k/v/o biases, a
128-token sliding window on every other layer, YaRN (factor 32 from 4096). The vocabulary is
llama.cpp's ``ggml-vocab-llama-bpe.gguf`` (128256 tokens; gpt-oss's o200k has 201088): a real
tokenizer of the same order, which llama.cpp loads. Types as the published MXFP4 files: MXFP4
experts, Q8_0 for the other matrices, F32 router, biases, sinks and norms. The MXFP4 blocks are
random nibbles under one E8M0 scale per block chosen so that the weights have the wanted std.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from make_8b import VOCAB_KEYS, default_vocab, random_blocks  # noqa: E402

T = gguf.GGMLQuantizationType
ARCH = "gpt-oss"

# gpt-oss-20b (config.json of openai/gpt-oss-20b).
CONFIG = dict(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, n_expert=32, k=4, expert_ff=2880,
              rope_theta=150000.0, norm_eps=1e-5, ctx=131072, window=128, yarn_factor=32.0, yarn_orig=4096)
MXFP4_RMS = 2.93      # rms of the nibbles' values {0, ±.5, ±1, ±1.5, ±2, ±3, ±4, ±6} at scale 2^0


def mxfp4_blocks(rng: np.random.Generator, n_rows: int, n_in: int, std: float) -> np.ndarray:
    """uint8 ``[n_rows, n_in/32*17]``: per block an E8M0 scale byte then 16 bytes of random nibbles."""
    raw = rng.integers(0, 256, size=(n_rows, n_in // 32, 17), dtype=np.uint8)
    raw[..., 0] = 127 + int(round(np.log2(std / MXFP4_RMS)))
    return raw.reshape(n_rows, -1)


def write(out: Path, vocab_path: Path, n_layers: int, seed: int) -> None:
    c = CONFIG
    hd, dim, n_exp, ff = c["head_dim"], c["dim"], c["n_expert"], c["expert_ff"]
    q_dim, kv_dim = c["n_heads"] * hd, c["n_kv_heads"] * hd
    rng = np.random.default_rng(seed)
    vocab = gguf.GGUFReader(vocab_path)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)

    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_name("gpt-oss-20b-shaped-mxfp4-random")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(dim)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ff)
    w.add_expert_feed_forward_length(ff)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(c["k"])
    w.add_head_count(c["n_heads"])
    w.add_head_count_kv(c["n_kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_string(f"{ARCH}.rope.scaling.type", "yarn")
    w.add_float32(f"{ARCH}.rope.scaling.factor", c["yarn_factor"])
    w.add_uint32(f"{ARCH}.rope.scaling.original_context_length", c["yarn_orig"])
    w.add_layer_norm_rms_eps(c["norm_eps"])
    w.add_sliding_window(c["window"])
    w.add_vocab_size(n_vocab)
    for key in VOCAB_KEYS:
        field = vocab.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        vtype = gguf.GGUFValueType(field.types[0])
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)

    makers = []            # each tensor's data is made when it is written, in this order

    def weight(name: str, qtype: T, n_out: int, n_in: int, std: float, n_expert: int = 0) -> None:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = n_in // block * type_size
        shape = [n_expert, n_out, row_bytes] if n_expert else [n_out, row_bytes]
        w.add_tensor_info(name, shape, np.dtype(np.uint8), int(np.prod(shape)), raw_dtype=qtype)
        rows = max(1, n_expert) * n_out
        make = mxfp4_blocks if qtype == T.MXFP4 else (lambda r, n, k, s: random_blocks(r, qtype, n, k, s))
        makers.append(lambda: make(rng, rows, n_in, std).reshape(shape))

    def f32(name: str, data: np.ndarray) -> None:
        data = data.astype(np.float32)          # small (≤ 0.4 MB): made now, for its shape
        w.add_tensor_info(name, list(data.shape), np.dtype(np.float32), data.nbytes)
        makers.append(lambda: data)

    def norm(name: str, n: int) -> None:
        f32(name, 1.0 + 0.05 * rng.standard_normal(n))

    def bias(name: str, *shape: int) -> None:
        f32(name, 0.02 * rng.standard_normal(shape))

    weight("token_embd.weight", T.Q8_0, n_vocab, dim, 1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", dim)
        weight(p + "attn_q.weight", T.Q8_0, q_dim, dim, dim ** -0.5)
        bias(p + "attn_q.bias", q_dim)
        weight(p + "attn_k.weight", T.Q8_0, kv_dim, dim, dim ** -0.5)
        bias(p + "attn_k.bias", kv_dim)
        weight(p + "attn_v.weight", T.Q8_0, kv_dim, dim, dim ** -0.5)
        bias(p + "attn_v.bias", kv_dim)
        weight(p + "attn_output.weight", T.Q8_0, dim, q_dim, 0.5 * q_dim ** -0.5)
        bias(p + "attn_output.bias", dim)
        f32(p + "attn_sinks.weight", rng.normal(0, 1.0, size=c["n_heads"]))
        norm(p + "post_attention_norm.weight", dim)
        f32(p + "ffn_gate_inp.weight", 4 * dim ** -0.5 * rng.standard_normal((n_exp, dim)))
        bias(p + "ffn_gate_inp.bias", n_exp)
        weight(p + "ffn_gate_exps.weight", T.MXFP4, ff, dim, dim ** -0.5, n_exp)
        bias(p + "ffn_gate_exps.bias", n_exp, ff)
        weight(p + "ffn_up_exps.weight", T.MXFP4, ff, dim, dim ** -0.5, n_exp)
        bias(p + "ffn_up_exps.bias", n_exp, ff)
        weight(p + "ffn_down_exps.weight", T.MXFP4, dim, ff, 0.5 * ff ** -0.5, n_exp)
        bias(p + "ffn_down_exps.bias", n_exp, dim)
    norm("output_norm.weight", dim)
    weight("output.weight", T.Q8_0, n_vocab, dim, dim ** -0.5)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for make in makers:
        w.write_tensor_data(make())
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, required=True, help="output .gguf")
    ap.add_argument("--layers", type=int, default=CONFIG["n_layers"], help="blocks (24 = the real gpt-oss-20b)")
    ap.add_argument("--vocab", type=Path, help="ggml-vocab-llama-bpe.gguf (default: llamatrace's fetched copy)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    write(args.out, args.vocab or default_vocab(), args.layers, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
