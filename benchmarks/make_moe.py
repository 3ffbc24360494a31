"""Write a Qwen3-30B-A3B-shaped ``qwen3moe`` GGUF: the real config, the Llama 3 vocabulary, random weights.

For benchmarks only (load time, peak memory, prefill/decode speed of a mixture of experts at
scale), never for CI: all 48 layers make ~17 GB in Q4_K_M, each layer ~0.35 GB. Make one at a
time, under /tmp, and delete it after.

    python benchmarks/make_moe.py -o /tmp/qwen3moe-q4_k_m.gguf --layers 4
    python benchmarks/make_moe.py -o /tmp/qwen3moe-q4_k_m.gguf            # all 48 layers
    llamatrace bench -m /tmp/qwen3moe-q4_k_m.gguf --activations f32 --activations q8 --against llama.cpp -t 2
    /work/venv-golden/bin/python benchmarks/make_moe.py --time-llamacpp /tmp/qwen3moe-q4_k_m.gguf -t 2

``--time-llamacpp FILE`` (in a Python with llama-cpp-python; no numba needed) loads FILE in
llama.cpp (through ``llamatrace.peers.llamacpp``), prefills the same number of tokens and decodes
greedily, and prints load / prefill / decode times and the peak RSS, as JSON.

Shape (config.json of Qwen/Qwen3-30B-A3B): n_embd 2048, 48 layers, 128 experts of 768 (top-8,
weights renormalised), 32 query and 4 KV heads of 128, q/k norms, rope base 1e6. The vocabulary
is llama.cpp's ``ggml-vocab-llama-bpe.gguf`` (128256 tokens; Qwen3's own has 151936): a real
tokenizer that llama.cpp loads, of the same order of size.

Types as ``llama-quantize … Q4_K_M`` gives them (``llama-quant.cpp``): Q4_K everywhere; Q6_K for
``attn_v`` and ``ffn_down_exps`` in the layers of ``use_more_bits`` (the first and last eighth and
every third between) and for ``output``; the router (``ffn_gate_inp``) and the norms F32. The
quant bytes are uniform random with block scales chosen so that activations stay O(1)
(:func:`make_8b.random_blocks`), Q4_K's centred (:func:`centred`) so that routes differ token
to token, as a trained router's do. Each tensor is made when it is written, so memory stays at the
largest tensor (~0.17 GB), whatever the file's size.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from make_8b import VOCAB_KEYS, default_vocab, random_blocks  # noqa: E402

T = gguf.GGMLQuantizationType

# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B).
CONFIG = dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, n_expert=128, k=8,
              expert_ff=768, ffn_dim=6144, rope_theta=1e6, norm_eps=1e-6, ctx=40960)


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's choice of the layers whose attn_v and ffn_down get more bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def centred(qtype: T, blocks: np.ndarray) -> np.ndarray:
    """:func:`make_8b.random_blocks`' blocks with each Q4_K sub-block's mean made zero (in place).

    Random Q4_K blocks are ``d·sc·q − dmin·m`` with ``q`` uniform in 0..15: every weight leans
    positive by ~its std, so every row (token embeddings included) shares one direction, the router
    sees the same input for every token and all tokens choose the same experts. Here the mins
    equal the scales (bytes 8..11 copy 4..7; each of bytes 12..15 holds one nibble twice) and
    ``dmin = 7.5·d``: weights ``d·sc·(q − 7.5)``, mean zero, and routes that differ token to token.
    """
    if qtype != T.Q4_K:
        return blocks
    b = blocks.reshape(blocks.shape[0], -1, 144)
    b[..., 8:12] = b[..., 4:8]
    low = b[..., 12:16] & 15
    b[..., 12:16] = low | (low << 4)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    b[..., 2:4] = (7.5 * d).astype(np.float16).view(np.uint8)
    return blocks


def write(out: Path, vocab_path: Path, n_layers: int, seed: int) -> None:
    c = CONFIG
    hd, dim, n_exp, ff = c["head_dim"], c["dim"], c["n_expert"], c["expert_ff"]
    q_dim, kv_dim = c["n_heads"] * hd, c["n_kv_heads"] * hd
    rng = np.random.default_rng(seed)
    vocab = gguf.GGUFReader(vocab_path)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)

    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_name("qwen3-30b-a3b-shaped-q4_k_m-random")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_context_length(c["ctx"])
    w.add_embedding_length(dim)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(c["ffn_dim"])
    w.add_expert_feed_forward_length(ff)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(c["k"])
    w.add_head_count(c["n_heads"])
    w.add_head_count_kv(c["n_kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["norm_eps"])
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
        makers.append(lambda: centred(qtype, random_blocks(rng, qtype, rows, n_in, std)).reshape(shape))

    def f32(name: str, make) -> None:
        data = make()                 # small (≤ 1 MB): made now, for its shape
        w.add_tensor_info(name, list(data.shape), np.dtype(np.float32), data.nbytes)
        makers.append(lambda: data)

    def norm(name: str, n: int) -> None:
        f32(name, lambda: (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    weight("token_embd.weight", T.Q4_K, n_vocab, dim, 1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        more = use_more_bits(i, n_layers)
        norm(p + "attn_norm.weight", dim)
        weight(p + "attn_q.weight", T.Q4_K, q_dim, dim, dim ** -0.5)
        weight(p + "attn_k.weight", T.Q4_K, kv_dim, dim, dim ** -0.5)
        weight(p + "attn_v.weight", T.Q6_K if more else T.Q4_K, kv_dim, dim, dim ** -0.5)
        norm(p + "attn_q_norm.weight", hd)
        norm(p + "attn_k_norm.weight", hd)
        weight(p + "attn_output.weight", T.Q4_K, dim, q_dim, 0.5 * q_dim ** -0.5)
        norm(p + "ffn_norm.weight", dim)
        # router rows of std 4/sqrt(dim): each token's logits spread, routes differ token to token
        f32(p + "ffn_gate_inp.weight",
            lambda: (4 * dim ** -0.5 * rng.standard_normal((n_exp, dim))).astype(np.float32))
        weight(p + "ffn_gate_exps.weight", T.Q4_K, ff, dim, dim ** -0.5, n_exp)
        weight(p + "ffn_up_exps.weight", T.Q4_K, ff, dim, dim ** -0.5, n_exp)
        weight(p + "ffn_down_exps.weight", T.Q6_K if more else T.Q4_K, dim, ff, 0.5 * ff ** -0.5, n_exp)
    norm("output_norm.weight", dim)
    weight("output.weight", T.Q6_K, n_vocab, dim, dim ** -0.5)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for make in makers:
        w.write_tensor_data(make())
    w.close()


def time_llamacpp(path: Path, threads: int, prompt_tokens: int, decode_tokens: int) -> dict:
    """llama.cpp's load, prefill and greedy decode on ``path`` (seconds), and the peak RSS (MB)."""
    from llamatrace.peers.llamacpp import LlamaCpp
    t0 = time.perf_counter()
    engine = LlamaCpp(str(path), n_ctx=prompt_tokens + decode_tokens + 8, threads=threads)
    load_s = time.perf_counter() - t0
    ids = [int(i) for i in np.random.default_rng(0).integers(1000, 20000, size=prompt_tokens)]
    t0 = time.perf_counter()
    logits = engine.eval(ids)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        logits = engine.eval([int(np.argmax(logits[-1]))])
    decode_s = time.perf_counter() - t0
    engine.close()
    return {"engine": "llama.cpp", "threads": threads, "load_s": round(load_s, 2),
            "prefill_tok_s": round(prompt_tokens / prefill_s, 2), "decode_tok_s": round(decode_tokens / decode_s, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, help="output .gguf")
    ap.add_argument("--layers", type=int, default=CONFIG["n_layers"], help="blocks (48 = the real 30B-A3B)")
    ap.add_argument("--vocab", type=Path, help="ggml-vocab-llama-bpe.gguf (default: llamatrace's fetched copy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-llamacpp", type=Path, metavar="FILE", help="time llama.cpp on FILE instead")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    if args.time_llamacpp:
        print(json.dumps(time_llamacpp(args.time_llamacpp, args.threads, args.prompt_tokens, args.decode_tokens)))
        return 0
    if args.out is None:
        ap.error("-o/--out is required to write a file")
    t0 = time.perf_counter()
    write(args.out, args.vocab or default_vocab(), args.layers, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
