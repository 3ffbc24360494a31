"""Write a Llama-3.1-8B-shaped GGUF: the chapter's config, the real Llama 3 vocabulary, random weights.

For benchmarks only (load time, peak memory, prefill/decode speed at the chapter's scale,
quantizing an F16 base), never for CI: each file is ~4.5–8.5 GB (16 GB in F16). Make one at a
time and delete it after.

    python benchmarks/make_8b.py --type Q4_0 -o /tmp/llama8b-q4_0.gguf
    python benchmarks/make_8b.py --type Q4_K_M -o /tmp/llama8b-q4_k_m.gguf --layers 4
    python benchmarks/make_8b.py --type F16 -o /tmp/llama8b-f16.gguf

The vocabulary (tokens, types, merges, `llama-bpe` pre-tokenizer) is copied from llama.cpp's
``models/ggml-vocab-llama-bpe.gguf`` (``--vocab``; by default the copy llamatrace fetches for its
tokenizer tests). Weights are raw random blocks: each block's scale is a small fp16 value chosen
so that activations stay O(1) through the layers, the quant bytes are uniform random. ``Q4_K_M``
is a llama.cpp-like mix: Q4_K everywhere, Q6_K for ``attn_v``, ``ffn_down`` and ``output``.
``F16`` weights are normal with that standard deviation (a base for ``quantize``). Tensors are
made and written one at a time, so memory stays at the largest tensor whatever the file's size.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType

# Llama 3.1 8B (config.json of meta-llama/Llama-3.1-8B).
CONFIG = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab=128256,
              rope_theta=500000.0, norm_eps=1e-5, ctx=131072,
              rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_ctx=8192))

VOCAB_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
              "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.chat_template")


def llama3_rope_freqs(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """Llama 3.1's per-frequency divisors (``rope_freqs.weight``), as Meta's ``apply_scaling``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    low_wavelen = s["original_ctx"] / s["low_freq_factor"]
    high_wavelen = s["original_ctx"] / s["high_freq_factor"]
    smooth = (s["original_ctx"] / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    factors = np.where(wavelen > low_wavelen, s["factor"],
                       np.where(wavelen < high_wavelen, 1.0, 1.0 / ((1 - smooth) / s["factor"] + smooth)))
    return factors.astype(np.float32)


def random_blocks(rng: np.random.Generator, qtype: T, n_out: int, n_in: int, std: float) -> np.ndarray:
    """``[n_out, row_bytes]`` uint8 of valid random blocks whose dequantized weights have ~``std``
    (F16: normal weights of that standard deviation)."""
    if qtype == T.F16:
        out = np.empty((n_out, n_in), np.float16)
        step = max(1, (64 << 20) // (4 * n_in))         # rows drawn at once: bounds the float32 temporary
        for first in range(0, n_out, step):
            rows = rng.standard_normal((min(step, n_out - first), n_in), dtype=np.float32)
            rows *= np.float32(std)
            out[first:first + len(rows)] = rows
        return out.view(np.uint8)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_in // block
    raw = rng.integers(0, 256, size=(n_out, n_blocks, type_size), dtype=np.uint8)

    def fp16(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)

    d_shape = (n_out, n_blocks, 1)
    if qtype == T.Q4_0:            # d · (q − 8), q uniform 0..15: std ≈ 4.6 d
        raw[..., 0:2] = fp16(np.full(d_shape, std / 4.6))
    elif qtype == T.Q8_0:          # d · q, q uniform int8: std ≈ 74 d
        raw[..., 0:2] = fp16(np.full(d_shape, std / 74))
    elif qtype == T.Q4_K:          # d · sc · q − dmin · m; 6-bit scales/mins in bytes 4..15
        raw[..., 0:2] = fp16(np.full(d_shape, std / (4.6 * 32)))
        raw[..., 2:4] = fp16(np.full(d_shape, std / (32 * 8)))
    elif qtype == T.Q6_K:          # ql, qh, int8 scales[16], then fp16 d at the end
        raw[..., 192:208] = rng.integers(8, 40, size=(n_out, n_blocks, 16), dtype=np.uint8)
        raw[..., 208:210] = fp16(np.full(d_shape, std / (18.5 * 24)))
    else:
        raise SystemExit(f"make_8b: no random-block recipe for {qtype.name}")
    return raw.reshape(n_out, n_blocks * type_size)


def types_for(mix: str) -> dict[str, T]:
    if mix == "Q4_K_M":
        return {"default": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q4_K}
    qtype = T[mix]
    return {"default": qtype}


def write(out: Path, vocab_path: Path, mix: str, n_layers: int, seed: int) -> None:
    c = CONFIG
    head_dim = c["dim"] // c["n_heads"]
    types = types_for(mix)
    rng = np.random.default_rng(seed)
    vocab = gguf.GGUFReader(vocab_path)

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"llama-3.1-8b-shaped-{mix.lower()}-random")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(c["ffn_dim"])
    w.add_head_count(c["n_heads"])
    w.add_head_count_kv(c["n_kv_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["norm_eps"])
    w.add_vocab_size(c["vocab"])
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

    makers = []            # each tensor's data is made when it is written, in this order (the same draws)

    def weight(name: str, kind: str, n_out: int, n_in: int, std: float) -> None:
        qtype = types.get(kind, types["default"])
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor_info(name, [n_out, n_in // block * type_size], np.dtype(np.uint8),
                          n_out * (n_in // block) * type_size, raw_dtype=qtype)
        makers.append(lambda: random_blocks(rng, qtype, n_out, n_in, std))

    def norm(name: str, n: int) -> None:
        w.add_tensor_info(name, [n], np.dtype(np.float32), 4 * n)
        makers.append(lambda: (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    dim, ffn, kv_dim = c["dim"], c["ffn_dim"], c["n_kv_heads"] * head_dim
    weight("token_embd.weight", "token_embd", c["vocab"], dim, 1.0)
    freqs = llama3_rope_freqs(head_dim, c["rope_theta"], c["rope_scaling"])
    w.add_tensor_info("rope_freqs.weight", list(freqs.shape), freqs.dtype, freqs.nbytes)
    makers.append(lambda: freqs)
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", dim)
        weight(p + "attn_q.weight", "attn_q", dim, dim, dim ** -0.5)
        weight(p + "attn_k.weight", "attn_k", kv_dim, dim, dim ** -0.5)
        weight(p + "attn_v.weight", "attn_v", kv_dim, dim, dim ** -0.5)
        weight(p + "attn_output.weight", "attn_output", dim, dim, 0.5 * dim ** -0.5)
        norm(p + "ffn_norm.weight", dim)
        weight(p + "ffn_gate.weight", "ffn_gate", ffn, dim, dim ** -0.5)
        weight(p + "ffn_up.weight", "ffn_up", ffn, dim, dim ** -0.5)
        weight(p + "ffn_down.weight", "ffn_down", dim, ffn, 0.5 * ffn ** -0.5)
    norm("output_norm.weight", dim)
    weight("output.weight", "output", c["vocab"], dim, dim ** -0.5)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for make in makers:
        w.write_tensor_data(make())
    w.close()


def default_vocab() -> Path:
    """llama.cpp's test vocabulary, fetched with the tests' fixture (tests/llamacpp_sdist.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from llamacpp_sdist import vocab_test_file
    return vocab_test_file("llama-bpe")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, required=True, help="output .gguf")
    ap.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q8_0", "Q4_K_M", "F16"], help="weight types")
    ap.add_argument("--layers", type=int, default=CONFIG["n_layers"], help="blocks (32 = the real 8B)")
    ap.add_argument("--vocab", type=Path, help="ggml-vocab-llama-bpe.gguf (default: llamatrace's fetched copy)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    write(args.out, args.vocab or default_vocab(), args.type, args.layers, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
