"""Write a Qwen3.5-2B-shaped ``qwen35`` GGUF (real widths, fewer layers) and measure decode time
per token against the context length, ours and llama.cpp's, on the same file.

For benchmarks only, never for CI. The widths are Qwen3.5-2B's as its config gives them (dim 2048,
FFN 6144, full attention 8 query / 2 KV heads of 256 with 64 rotary dims, sections [11, 11, 10];
gated DeltaNet 16 key and 16 value heads of 128, conv kernel 4); the layers are ``--layers``
(default 4: three DeltaNet, one attention, as the full model's pattern), the vocabulary is the
tests' tiny byte-level one (so the output projection costs nothing: this measures the blocks).
Weights are Q8_0 (norms, the conv kernel, A and dt bias F32), random.

    python benchmarks/make_qwen35.py -o /tmp/qwen35-2b.gguf                       # write the file
    python benchmarks/make_qwen35.py -o /tmp/qwen35-2b.gguf --measure ours        # decode ms vs context
    /work/venv-golden/bin/python benchmarks/make_qwen35.py -o /tmp/qwen35-2b.gguf --measure llama.cpp
    python benchmarks/make_qwen35.py -o /tmp/qwen35-2b.gguf --plot ours.json llama.json --png curve.png

``--measure`` prints one JSON object: per context length (64 … 4096 tokens), the median
milliseconds of 8 single-token decode steps after a prefill of that many tokens (2 threads).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CONTEXTS = (64, 256, 1024, 2048, 4096)
STEPS = 8
SHAPE = dict(dim=2048, hidden=6144, n_heads=8, n_kv_heads=2, head_dim=256, rope_dim=64, sections=[11, 11, 10, 0],
             n_k_heads=16, n_v_heads=16, ssm_head_dim=128, conv_kernel=4)


def write(path: Path, n_layers: int) -> None:
    import gguf
    from gguf_factory import CHATML, _store, vocabulary
    T = gguf.GGMLQuantizationType
    s = SHAPE
    rng = np.random.default_rng(0)
    tokens, types, merges = vocabulary()
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_name("qwen35-2b-shaped-random")
    keys = {"block_count": n_layers, "context_length": 8192, "embedding_length": s["dim"],
            "feed_forward_length": s["hidden"], "attention.head_count": s["n_heads"],
            "attention.head_count_kv": s["n_kv_heads"], "attention.key_length": s["head_dim"],
            "attention.value_length": s["head_dim"], "rope.dimension_count": s["rope_dim"],
            "full_attention_interval": 4, "ssm.conv_kernel": s["conv_kernel"], "ssm.state_size": s["ssm_head_dim"],
            "ssm.group_count": s["n_k_heads"], "ssm.time_step_rank": s["n_v_heads"],
            "ssm.inner_size": s["n_v_heads"] * s["ssm_head_dim"]}
    for key, value in keys.items():
        w.add_uint32(f"qwen35.{key}", value)
    w.add_float32("qwen35.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen35.rope.freq_base", 1e7)
    w.add_array("qwen35.rope.dimension_sections", s["sections"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    dim, kd, vd = s["dim"], s["n_k_heads"] * s["ssm_head_dim"], s["n_v_heads"] * s["ssm_head_dim"]
    q_dim, kv_dim = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]

    def mat(n_out, n_in):
        return rng.normal(0, n_in ** -0.5, size=(n_out, n_in)).astype(np.float32)

    tensors = {"token_embd.weight": rng.normal(0, 1, size=(len(tokens), dim))}
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = np.ones(dim)
        if (i + 1) % 4:
            tensors |= {p + "attn_qkv.weight": mat(2 * kd + vd, dim), p + "attn_gate.weight": mat(vd, dim),
                        p + "ssm_beta.weight": mat(s["n_v_heads"], dim), p + "ssm_alpha.weight": mat(s["n_v_heads"], dim),
                        p + "ssm_conv1d.weight": rng.normal(0, 0.5, size=(2 * kd + vd, s["conv_kernel"])),
                        p + "ssm_dt.bias": rng.normal(-1, 0.5, size=s["n_v_heads"]),
                        p + "ssm_a": -np.exp(rng.uniform(-1.5, 0, size=s["n_v_heads"])),
                        p + "ssm_norm.weight": np.ones(s["ssm_head_dim"]), p + "ssm_out.weight": mat(dim, vd)}
        else:
            tensors |= {p + "attn_q.weight": mat(2 * q_dim, dim), p + "attn_k.weight": mat(kv_dim, dim),
                        p + "attn_v.weight": mat(kv_dim, dim), p + "attn_q_norm.weight": np.ones(s["head_dim"]),
                        p + "attn_k_norm.weight": np.ones(s["head_dim"]), p + "attn_output.weight": mat(dim, q_dim)}
        tensors |= {p + "post_attention_norm.weight": np.ones(dim), p + "ffn_gate.weight": mat(s["hidden"], dim),
                    p + "ffn_up.weight": mat(s["hidden"], dim), p + "ffn_down.weight": mat(dim, s["hidden"])}
    tensors |= {"output_norm.weight": np.ones(dim), "output.weight": mat(len(tokens), dim)}
    for name, data in tensors.items():
        data = np.asarray(data)
        big = data.ndim == 2 and "ssm_conv1d" not in name and data.shape[1] % 32 == 0
        _store(w, name, data, T.Q8_0 if big else T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(path: Path, engine: str) -> dict:
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 269, size=max(CONTEXTS) + STEPS).tolist()
    out = {"engine": engine, "threads": 2, "steps": STEPS, "decode_ms": {}}
    if engine == "llama.cpp":
        from llamatrace.peers.llamacpp import LlamaCpp
        for n in CONTEXTS:
            e = LlamaCpp(str(path), n_ctx=n + STEPS + 1, threads=2)
            e.eval(ids[:n])
            times = []
            for t in ids[n:n + STEPS]:
                t0 = time.perf_counter()
                e.eval([t])
                times.append(time.perf_counter() - t0)
            e.close()
            out["decode_ms"][n] = 1e3 * float(np.median(times))
            print(n, out["decode_ms"][n], file=sys.stderr)
        import llama_cpp
        out["version"] = llama_cpp.__version__
        return out
    from llamatrace.machine import threads
    from llamatrace.model.llama import Llama
    threads.set_threads(2)
    model = Llama.load(path, activations="q8" if engine == "ours-q8" else "f32")
    model.warmup()
    for n in CONTEXTS:
        cache = model.new_cache(n + STEPS)
        model.forward(np.array(ids[:n]), 0, cache)
        times = []
        for i in range(n, n + STEPS):
            t0 = time.perf_counter()
            model.forward(np.array(ids[i:i + 1]), i, cache)
            times.append(time.perf_counter() - t0)
        out["decode_ms"][n] = 1e3 * float(np.median(times))
        print(n, out["decode_ms"][n], file=sys.stderr)
    return out


def plot(files: list[Path], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
    for f in files:
        r = json.loads(f.read_text())
        xs = sorted(int(k) for k in r["decode_ms"])
        ax.plot(xs, [r["decode_ms"][str(x)] for x in xs], marker="o", label=r["engine"])
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (tokens before the decode step)")
    ax.set_ylabel("ms per decode token (median of 8)")
    ax.set_title("Qwen3.5-2B-shaped, 4 layers (3 DeltaNet + 1 attention), Q8_0, 2 threads", fontsize=8)
    ax.legend(fontsize=8)
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, required=True, help="the GGUF file (written unless it exists)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--measure", choices=["ours", "ours-q8", "llama.cpp"])
    ap.add_argument("--plot", type=Path, nargs="+", help="JSON files of --measure to draw")
    ap.add_argument("--png", type=Path, default=Path("qwen35_decode_context.png"))
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, args.png)
        return
    if not args.output.exists():
        write(args.output, args.layers)
        print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
    if args.measure:
        print(json.dumps(measure(args.output, args.measure)))


if __name__ == "__main__":
    main()
