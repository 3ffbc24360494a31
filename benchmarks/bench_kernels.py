"""Benchmark the quant matmul kernels on SmolLM2-135M's weight shapes.

    python benchmarks/bench_kernels.py [MODEL.gguf] [--threads 2] [--repeat 200]

Per shape: microseconds per call and GB/s of packed weight bytes, for seq_len 1 (decode,
GEMV) and 64 (prefill, tiled). "hot" repeats one matrix (it stays in L2/L3, an upper bound);
"stream" cycles through all 30 layers' copies of the shape, as decode does, so the bytes come
from DRAM. Then one decode-like sweep: every layer's fused QKV, wo, fused gate+up, down, and
the Q8_0 output head, which estimates the matmul time per token.

With the model file absent the weights are random bytes of the same shapes and types.
The machine may be shared: compare numbers taken in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gguf
import numba
import numpy as np

from llamatrace.errors import ModelNotFoundError
from llamatrace.gguf import fetch
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import matmul
from llamatrace.machine import threads

T = gguf.GGMLQuantizationType
N_LAYERS = 30
# (label, ggml names fused into one Weight, n_out, n_in, type)
SHAPES = [
    ("attn_q", ["attn_q"], 576, 576, T.Q4_1),
    ("attn_k", ["attn_k"], 192, 576, T.Q4_1),
    ("attn_output", ["attn_output"], 576, 576, T.Q4_1),
    ("ffn_gate", ["ffn_gate"], 1536, 576, T.Q4_1),
    ("ffn_down", ["ffn_down"], 576, 1536, T.Q4_1),
    ("qkv fused", ["attn_q", "attn_k", "attn_v"], 960, 576, T.Q4_1),
    ("gate+up fused", ["ffn_gate", "ffn_up"], 3072, 576, T.Q4_1),
]


def _load(path: str | None):
    """{ggml tensor name: (type, raw, n_out, n_in)} from the model, or random stand-ins."""
    if path and os.path.exists(path):
        reader = gguf.GGUFReader(path)
        return {t.name: (t.tensor_type, t.data, int(t.shape[1]), int(t.shape[0]))
                for t in reader.tensors if len(t.shape) == 2}, True
    rng = np.random.default_rng(0)
    fake = {}

    def add(name, n_out, n_in, typ):
        block = {T.Q4_1: 20, T.Q8_0: 34}[typ]
        raw = rng.integers(0, 256, (n_out, n_in // 32 * block), dtype=np.uint8)
        raw.reshape(n_out, -1, block)[:, :, :4] = np.array([0.01], np.float16).view(np.uint8)[None, None, [0, 1, 0, 1]]
        fake[name] = (typ, raw, n_out, n_in)

    for i in range(N_LAYERS):
        for name, n_out, n_in in (("attn_q", 576, 576), ("attn_k", 192, 576), ("attn_v", 192, 576),
                                  ("attn_output", 576, 576), ("ffn_gate", 1536, 576),
                                  ("ffn_up", 1536, 576), ("ffn_down", 576, 1536)):
            add(f"blk.{i}.{name}.weight", n_out, n_in, T.Q4_1)
    add("token_embd.weight", 49152, 576, T.Q8_0)
    return fake, False


def _weights(tensors, names, layer):
    parts = [tensors[f"blk.{layer}.{n}.weight"] for n in names]
    if len(parts) == 1:
        return packing.pack(f"blk.{layer}.{names[0]}", *parts[0])
    return packing.pack_concat(f"blk.{layer}.{'+'.join(names)}", parts)


def _time(fn, repeat: int) -> float:
    """Median seconds per call of fn() over `repeat` calls (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None,
                    help="GGUF file (default: the cached default model, if fetched)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()

    threads.set_threads(args.threads)
    if args.model is None:                       # the default model, if it is here already
        try:
            args.model = str(fetch.resolve_model(None, fetch=False))
        except ModelNotFoundError:
            pass
    tensors, real = _load(args.model)
    print(f"weights: {'model ' + args.model if real else 'random stand-ins'}; threads "
          f"{numba.get_num_threads()}, layer {numba.threading_layer() if _warm() else '?'}, TR={packing.TR}")
    rng = np.random.default_rng(1)

    print(f"{'shape':<14} {'n_out x n_in':>12} {'S':>3} {'hot us':>9} {'hot GB/s':>9} "
          f"{'stream us':>10} {'stream GB/s':>11} {'GFLOP/s':>8}")
    for label, names, n_out, n_in, _typ in SHAPES:
        layers = [_weights(tensors, names, i) for i in range(N_LAYERS)]
        nbytes = layers[0].nbytes
        for seq in (1, 64):
            x = rng.standard_normal((seq, n_in)).astype(np.float32)
            out = np.empty((seq, layers[0].n_out), np.float32)
            hot = _time(lambda: matmul(x, layers[0], out), args.repeat)
            reps = max(2, args.repeat // N_LAYERS) if seq == 1 else 2
            stream = _time(lambda: [matmul(x, w, out) for w in layers], reps) / N_LAYERS
            flops = 2.0 * seq * layers[0].n_out * n_in
            print(f"{label:<14} {layers[0].n_out:>5} x {n_in:<5} {seq:>3} {hot * 1e6:>9.1f} "
                  f"{nbytes / hot / 1e9:>9.1f} {stream * 1e6:>10.1f} {nbytes / stream / 1e9:>11.1f} "
                  f"{flops / stream / 1e9:>8.1f}")

    head = packing.pack("token_embd", *tensors["token_embd.weight"])
    for seq in (1, 64):
        x = rng.standard_normal((seq, head.n_in)).astype(np.float32)
        out = np.empty((seq, head.n_out), np.float32)
        dt = _time(lambda: matmul(x, head, out), max(3, args.repeat // 20))
        print(f"{'output Q8_0':<14} {head.n_out:>5} x {head.n_in:<5} {seq:>3} {dt * 1e6:>9.1f} "
              f"{head.nbytes / dt / 1e9:>9.1f} {'':>10} {'':>11} {2.0 * seq * head.n_out * head.n_in / dt / 1e9:>8.1f}")

    # decode-like sweep: the matmuls of one token through all layers + the head
    layers = [(_weights(tensors, ["attn_q", "attn_k", "attn_v"], i), _weights(tensors, ["attn_output"], i),
               _weights(tensors, ["ffn_gate", "ffn_up"], i), _weights(tensors, ["ffn_down"], i))
              for i in range(N_LAYERS)]
    total_bytes = sum(w.nbytes for ws in layers for w in ws) + head.nbytes
    x576 = rng.standard_normal((1, 576)).astype(np.float32)
    x1536 = rng.standard_normal((1, 1536)).astype(np.float32)

    def token():
        for qkv, wo, gu, down in layers:
            matmul(x576, qkv)
            matmul(x576, wo)
            matmul(x576, gu)
            matmul(x1536, down)
        matmul(x576, head)

    dt = _time(token, max(5, args.repeat // 10))
    print(f"\ndecode sweep (30 layers x 4 fused matmuls + head): {dt * 1e3:.2f} ms/token, "
          f"{total_bytes / 1e6:.1f} MB packed, {total_bytes / dt / 1e9:.1f} GB/s, "
          f"{1 / dt:.0f} tok/s matmul-only bound")


def _warm() -> bool:
    """Run one tiny parallel kernel so numba.threading_layer() is defined."""
    w = packing.pack("warm", T.F32, np.zeros((1, 8), np.float32), 1, 8)
    matmul(np.zeros((1, 8), np.float32), w)
    return True


if __name__ == "__main__":
    main()
