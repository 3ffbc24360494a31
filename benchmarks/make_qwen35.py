"""Write a Qwen3.5-2B- or 9B-shaped ``qwen35`` GGUF (real widths and vocabulary, fewer layers) and
measure decode time per token against the context length, ours and llama.cpp's, on the same file.

For benchmarks only, never for CI. The widths are the published ones (``SHAPES``), checked
2026-11-29 against: the model cards of Qwen/Qwen3.5-2B and Qwen/Qwen3.5-9B (layer layout, heads,
head dims, rotary dims, FFN width, 248320 padded vocabulary); the 9B's HF ``text_config`` as
fine-tunes of it carry it (huggingface.co/KnowledgeXLab/ComActor-9B, config.json:
``linear_num_key_heads`` 16, ``linear_num_value_heads`` 32, ``linear_*_head_dim`` 128,
``linear_conv_kernel_dim`` 4, ``full_attention_interval`` 4); the Megatron arguments of
radixark/miles ``scripts/models/qwen3.5-9B.sh`` and williammtan/miles ``scripts/models/qwen3.5-2B.sh``
(rotary-percent 0.25, rotary-base 1e7, the 9B's ``--untie-embeddings-and-output-weights``, absent
for the 2B); llama.cpp's converter (``conversion/qwen.py``: Qwen3.5's default mrope_section
[11, 11, 10, 0]):

    2B: hidden_size 2048, intermediate_size 6144, 24 layers; full attention 8 query / 2 KV heads,
        head_dim 256, partial_rotary_factor 0.25 (64 rotary dims), mrope_section [11, 11, 10]
        (GGUF rope.dimension_sections [11, 11, 10, 0]), rope_theta 1e7; gated DeltaNet 16 key /
        16 value heads of 128 (linear_key_head_dim = linear_value_head_dim = 128),
        linear_conv_kernel_dim 4; full_attention_interval 4; vocab_size 248320; tied embeddings.
    9B: hidden_size 4096, intermediate_size 12288, 32 layers; full attention 16 query / 4 KV heads
        of 256, the same rotary (64 dims, [11, 11, 10]); DeltaNet 16 key / 32 value heads of 128,
        conv kernel 4; full_attention_interval 4; vocab_size 248320; an output projection of its own.

Only the layer count differs: ``--layers`` (default 4: three DeltaNet, one attention, the full
models' 3:1 pattern, which ``full_attention_interval`` 4 keeps for any multiple of 4). The
vocabulary is the real size: the tests' byte-level tokens and merges, then ``[PAD<i>]`` tokens of
type unused up to 248320 (as convert_hf_to_gguf.py pads a vocabulary), so that the embedding
row and the output projection (248320 × dim, a real part of a decode step) cost what they cost
in the real model; ``--vocab tiny`` keeps the 269 test tokens, to time the blocks alone.
Weights are Q8_0, random (norms, the conv kernel, A and dt bias F32).

One command per step (files under /tmp; the measure is skipped if the file exists):

    python benchmarks/make_qwen35.py --shape 9b -o /tmp/qwen35-9b.gguf             # write the file
    python benchmarks/make_qwen35.py --shape 9b -o /tmp/qwen35-9b.gguf --measure ours    > ours.json
    python benchmarks/make_qwen35.py --shape 9b -o /tmp/qwen35-9b.gguf --measure ours-q8 > q8.json
    PYTHONPATH=$PWD:/tmp/lcpp_only python3 benchmarks/make_qwen35.py --shape 9b -o /tmp/qwen35-9b.gguf \\
        --measure llama.cpp > lcpp.json       # or /work/venv-golden/bin/python (llama-cpp-python)
    python benchmarks/make_qwen35.py --plot ours.json q8.json lcpp.json --png curve.png   # + a table

``--measure`` prints one JSON object: per context length (64 … 4096 tokens), the median
milliseconds of 8 single-token decode steps after that many tokens (one growing sequence,
prefilled in batches up to each context; 2 threads), with the load average before and after. Run the three engines in turn, and the round again:
``--plot`` takes any number of such files and draws, per engine, the median over its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CONTEXTS = (64, 256, 1024, 2048, 4096)
STEPS = 8
# Widths of the published configs (module docstring); ``layers`` is the full model's count.
SHAPES = {
    "2b": dict(dim=2048, hidden=6144, n_heads=8, n_kv_heads=2, head_dim=256, rope_dim=64, sections=[11, 11, 10, 0],
               n_k_heads=16, n_v_heads=16, ssm_head_dim=128, conv_kernel=4, vocab=248320, tied=True, layers=24),
    "9b": dict(dim=4096, hidden=12288, n_heads=16, n_kv_heads=4, head_dim=256, rope_dim=64, sections=[11, 11, 10, 0],
               n_k_heads=16, n_v_heads=32, ssm_head_dim=128, conv_kernel=4, vocab=248320, tied=False, layers=32),
}
INTERVAL = 4  # full_attention_interval of both configs


def write(path: Path, shape: str, n_layers: int, real_vocab: bool = True) -> None:
    import gguf
    from gguf_factory import CHATML, vocabulary
    T = gguf.GGMLQuantizationType
    s = SHAPES[shape]
    rng = np.random.default_rng(0)
    tokens, types, merges = vocabulary()
    if real_vocab:
        n_pad = s["vocab"] - len(tokens)
        tokens, types = tokens + [f"[PAD{i}]" for i in range(n_pad)], types + [5] * n_pad  # 5: unused
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_name(f"qwen35-{shape}-shaped-random-{n_layers}-layers")
    keys = {"block_count": n_layers, "context_length": 8192, "embedding_length": s["dim"],
            "feed_forward_length": s["hidden"], "attention.head_count": s["n_heads"],
            "attention.head_count_kv": s["n_kv_heads"], "attention.key_length": s["head_dim"],
            "attention.value_length": s["head_dim"], "rope.dimension_count": s["rope_dim"],
            "full_attention_interval": INTERVAL, "ssm.conv_kernel": s["conv_kernel"],
            "ssm.state_size": s["ssm_head_dim"], "ssm.group_count": s["n_k_heads"],
            "ssm.time_step_rank": s["n_v_heads"], "ssm.inner_size": s["n_v_heads"] * s["ssm_head_dim"]}
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

    def q8(name, n_out, n_in, std):
        # by slices of rows, in float32: the 9B's 248320 × 4096 table would need 8 GB as float64
        step = max(1, (1 << 24) // n_in)
        parts = [gguf.quants.quantize(rng.standard_normal((min(step, n_out - r), n_in), dtype=np.float32) * std,
                                      T.Q8_0) for r in range(0, n_out, step)]
        w.add_tensor(name, np.concatenate(parts), raw_dtype=T.Q8_0)

    def mat(name, n_out, n_in):
        q8(name, n_out, n_in, n_in ** -0.5)

    def f32(name, data):
        w.add_tensor(name, np.asarray(data, dtype=np.float32))

    q8("token_embd.weight", len(tokens), dim, 1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", np.ones(dim))
        if (i + 1) % INTERVAL:
            mat(p + "attn_qkv.weight", 2 * kd + vd, dim)
            mat(p + "attn_gate.weight", vd, dim)
            mat(p + "ssm_beta.weight", s["n_v_heads"], dim)
            mat(p + "ssm_alpha.weight", s["n_v_heads"], dim)
            f32(p + "ssm_conv1d.weight", rng.normal(0, 0.5, size=(2 * kd + vd, s["conv_kernel"])))
            f32(p + "ssm_dt.bias", rng.normal(-1, 0.5, size=s["n_v_heads"]))
            f32(p + "ssm_a", -np.exp(rng.uniform(-1.5, 0, size=s["n_v_heads"])))
            f32(p + "ssm_norm.weight", np.ones(s["ssm_head_dim"]))
            mat(p + "ssm_out.weight", dim, vd)
        else:
            mat(p + "attn_q.weight", 2 * q_dim, dim)
            mat(p + "attn_k.weight", kv_dim, dim)
            mat(p + "attn_v.weight", kv_dim, dim)
            f32(p + "attn_q_norm.weight", np.ones(s["head_dim"]))
            f32(p + "attn_k_norm.weight", np.ones(s["head_dim"]))
            mat(p + "attn_output.weight", dim, q_dim)
        f32(p + "post_attention_norm.weight", np.ones(dim))
        mat(p + "ffn_gate.weight", s["hidden"], dim)
        mat(p + "ffn_up.weight", s["hidden"], dim)
        mat(p + "ffn_down.weight", dim, s["hidden"])
    f32("output_norm.weight", np.ones(dim))
    if not s["tied"]:
        mat("output.weight", len(tokens), dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(path: Path, engine: str) -> dict:
    """Decode ms per token at each context of CONTEXTS, on one growing sequence: prefill up to
    the context (in one batch, from where the last steps stopped), then time STEPS single-token
    decode steps; so the whole run prefills about 4,100 tokens once."""
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 269, size=max(CONTEXTS) + STEPS).tolist()
    out = {"engine": engine, "file": path.name, "threads": 2, "steps": STEPS,
           "loadavg_before": os.getloadavg()[0], "decode_ms": {}}
    if engine == "llama.cpp":
        from llamatrace.peers.llamacpp import LlamaCpp
        import llama_cpp
        out["engine"] = f"llama.cpp {llama_cpp.__version__}"
        e = LlamaCpp(str(path), n_ctx=max(CONTEXTS) + STEPS + 1, threads=2)
        step = lambda pos, chunk: e.eval(chunk)  # noqa: E731  (llama.cpp keeps its own position)
    else:
        from llamatrace.machine import threads
        from llamatrace.model.llama import Llama
        threads.set_threads(2)
        model = Llama.load(path, activations="q8" if engine == "ours-q8" else "f32")
        model.warmup()
        out["engine"] = "llamatrace q8" if engine == "ours-q8" else "llamatrace f32"
        cache = model.new_cache(max(CONTEXTS) + STEPS)
        step = lambda pos, chunk: model.forward(np.array(chunk), pos, cache)  # noqa: E731
    pos = 0
    for n in CONTEXTS:
        step(pos, ids[pos:n])
        times = []
        for i in range(n, n + STEPS):
            t0 = time.perf_counter()
            step(i, ids[i:i + 1])
            times.append(time.perf_counter() - t0)
        pos = n + STEPS
        out["decode_ms"][n] = 1e3 * float(np.median(times))
        print(n, out["decode_ms"][n], file=sys.stderr)
    if engine == "llama.cpp":
        e.close()
    out["loadavg_after"] = os.getloadavg()[0]
    return out


def plot(files: list[Path], png: Path | None) -> str:
    """Draw (if ``png``) and return as a Markdown table the per-engine median over ``files``."""
    runs: dict[str, list[dict]] = {}
    for f in files:
        r = json.loads(f.read_text())
        runs.setdefault(r["engine"], []).append(r)
    xs = sorted(int(k) for k in next(iter(runs.values()))[0]["decode_ms"])
    medians = {e: [float(np.median([r["decode_ms"][str(x)] for r in rs])) for x in xs] for e, rs in runs.items()}
    loads = [v for rs in runs.values() for r in rs for v in (r["loadavg_before"], r["loadavg_after"])]
    rows = ["| engine | " + " | ".join(map(str, xs)) + " |", "|---|" + "---|" * len(xs)]
    rows += [f"| {e} | " + " | ".join(f"{m:.1f}" for m in ms) + " |" for e, ms in medians.items()]
    rows.append(f"\n{sum(len(rs) for rs in runs.values())} runs of {', '.join(runs)}; "
                f"load average (1 min) {min(loads):.2f} to {max(loads):.2f}")
    if png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
        for e, ms in medians.items():
            ax.plot(xs, ms, marker="o", label=f"{e} ({len(runs[e])} runs)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context (tokens before the decode step)")
        ax.set_ylabel(f"ms per decode token (median of {STEPS})")
        ax.set_title(f"{next(iter(runs.values()))[0]['file']}: Q8_0, 2 threads; "
                     f"load average {min(loads):.1f} to {max(loads):.1f}", fontsize=8)
        ax.legend(fontsize=8)
        fig.savefig(png, dpi=120)
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, help="the GGUF file (written unless it exists)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    ap.add_argument("--layers", type=int, default=4, help="a multiple of 4 keeps the 3:1 pattern")
    ap.add_argument("--vocab", choices=["real", "tiny"], default="real")
    ap.add_argument("--measure", choices=["ours", "ours-q8", "llama.cpp"])
    ap.add_argument("--plot", type=Path, nargs="+", help="JSON files of --measure to draw and tabulate")
    ap.add_argument("--png", type=Path, help="where --plot draws (.png or .svg)")
    args = ap.parse_args()
    if args.plot:
        print(plot(args.plot, args.png))
        return
    if args.output is None:
        ap.error("-o/--output is required unless --plot")
    if not args.output.exists():
        write(args.output, args.shape, args.layers, args.vocab == "real")
        print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
    if args.measure:
        print(json.dumps(measure(args.output, args.measure)))


if __name__ == "__main__":
    main()
