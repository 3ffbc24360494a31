"""Write a Qwen3-30B-A3B-shaped ``qwen3moe`` GGUF (random weights), and time llama.cpp on it.

For benchmarks only, never for CI. The shape is Qwen3-30B-A3B's: n_embd 2048, 32 query and 4 KV
heads of 128, q/k norms, 128 experts of 768 per layer, top 8, renormalised; 48 layers in the real
model (``--layers`` fewer: each layer is ~390 MB in Q4_K_M). The vocabulary is Llama 3's (llama.cpp's
``ggml-vocab-llama-bpe.gguf``, 128,256 tokens, as ``make_8b.py``), not Qwen's 151,936. ``Q4_K_M``
here: Q4_K everywhere, Q6_K for ``attn_v``, ``ffn_down_exps`` and ``output``; the router
``ffn_gate_inp`` and the norms F32, as llama-quantize leaves them. Weights are ``make_8b.py``'s
random blocks; the router's rows are normal, wide enough that the chosen experts change from
token to token.

    python benchmarks/make_moe.py -o /tmp/qwen3moe-L4.gguf --layers 4
    llamatrace bench -m /tmp/qwen3moe-L4.gguf --no-cache --prompt-tokens 64 --decode-tokens 16 \\
        --repeats 2 --activations q8 --activations f32 -t 2
    /work/venv-golden/bin/python benchmarks/make_moe.py --time-llamacpp /tmp/qwen3moe-L4.gguf -t 2

``--time-llamacpp FILE`` (in a Python with llama-cpp-python; no numba needed) loads FILE in
llama.cpp (through ``llamatrace.peers.llamacpp``), prefills the same number of tokens and decodes
greedily, and prints load / prefill / decode times and the peak RSS, as JSON.
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
CONFIG = dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, n_expert=128, n_expert_used=8,
              expert_ff=768, ffn_dim=6144, rope_theta=1e6, norm_eps=1e-6, ctx=40960)


def write(out: Path, vocab_path: Path, n_layers: int, seed: int) -> None:
    c = CONFIG
    rng = np.random.default_rng(seed)
    vocab = gguf.GGUFReader(vocab_path)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    arch = "qwen3moe"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("qwen3-30b-a3b-shaped-q4_k_m-random")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(c["ffn_dim"])
    w.add_head_count(c["n_heads"])
    w.add_head_count_kv(c["n_kv_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["norm_eps"])
    w.add_uint32(f"{arch}.expert_count", c["n_expert"])
    w.add_uint32(f"{arch}.expert_used_count", c["n_expert_used"])
    w.add_uint32(f"{arch}.expert_feed_forward_length", c["expert_ff"])
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
        rows = n_out * max(n_expert, 1)
        shape = ([n_expert] if n_expert else []) + [n_out, n_in // block * type_size]
        w.add_tensor_info(name, shape, np.dtype(np.uint8), rows * (n_in // block) * type_size, raw_dtype=qtype)
        makers.append(lambda: random_blocks(rng, qtype, rows, n_in, std))

    def floats(name: str, shape: tuple[int, ...], make) -> None:
        w.add_tensor_info(name, list(shape), np.dtype(np.float32), 4 * int(np.prod(shape)))
        makers.append(make)

    def norm(name: str, n: int) -> None:
        floats(name, (n,), lambda: (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    dim, hd, ne, ff = c["dim"], c["head_dim"], c["n_expert"], c["expert_ff"]
    q_dim, kv_dim = c["n_heads"] * hd, c["n_kv_heads"] * hd
    weight("token_embd.weight", T.Q4_K, n_vocab, dim, 1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", dim)
        weight(p + "attn_q.weight", T.Q4_K, q_dim, dim, dim ** -0.5)
        weight(p + "attn_k.weight", T.Q4_K, kv_dim, dim, dim ** -0.5)
        weight(p + "attn_v.weight", T.Q6_K, kv_dim, dim, dim ** -0.5)
        norm(p + "attn_q_norm.weight", hd)
        norm(p + "attn_k_norm.weight", hd)
        weight(p + "attn_output.weight", T.Q4_K, dim, q_dim, 0.5 * q_dim ** -0.5)
        norm(p + "ffn_norm.weight", dim)
        floats(p + "ffn_gate_inp.weight", (ne, dim),
               lambda: rng.normal(0, 2 * dim ** -0.5, size=(ne, dim)).astype(np.float32))
        weight(p + "ffn_gate_exps.weight", T.Q4_K, ff, dim, dim ** -0.5, ne)
        weight(p + "ffn_up_exps.weight", T.Q4_K, ff, dim, dim ** -0.5, ne)
        weight(p + "ffn_down_exps.weight", T.Q6_K, dim, ff, 0.5 * ff ** -0.5, ne)
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
