"""sha256 of every kernel's output on fixed random inputs: run it before and after a change that
must not move a bit (a refactor, a kernel rewrite), and compare the two files.

Run from a repo root: ``PYTHONPATH=$PWD python3 scripts/kernel_bits.py OUT.json`` (compiles every
kernel: ~25 min on 2 busy cores). Issue 48's move of kernels/ into rooms gave the same 389 hashes
before and after. Covers: every registered matmul kernel (type x f32/q8 x
decode/prefill, 1/3 rows decode, 5/37 rows prefill) with its NumPy twin, pack/dequantize/get_rows
in both modes, each declared dequant_np on the file's blocks, the quantizers (Numba and NumPy, with
and without an imatrix), the activation quantizers (Q8_0, Q8_1, PER32_F32, Q8_K) and every fp32 op.
"""

import hashlib
import json
import sys

import gguf
import numpy as np



import llamatrace.kernels  # noqa: E402,F401  (declares the types)

from llamatrace.kernels.int8 import act8  # noqa: E402
from llamatrace.kernels.ops import fp32  # noqa: E402
from llamatrace.kernels.quantizers import rows as quantizers  # noqa: E402
from llamatrace.kernels.types import packing, registry  # noqa: E402

T = gguf.GGMLQuantizationType
out = {}


def h(key, *arrays):
    d = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        d.update(str((a.dtype.str, a.shape)).encode())
        d.update(a.tobytes())
    out[key] = d.hexdigest()


rng = np.random.default_rng(48)
N_OUT, N_IN = 80, 512
W = (rng.standard_normal((N_OUT, N_IN)) * 0.05).astype(np.float32)
IMAT = rng.random(N_IN).astype(np.float32) + 0.1
XS = {rows: rng.standard_normal((rows, N_IN)).astype(np.float32) for rows in (1, 3, 5, 37)}
IDS = np.array([0, 5, 79, 33, 5], dtype=np.int64)

# quantizers, and the file blocks every block type is tested on
raw_of = {}
for t in quantizers.QUANTIZABLE:
    q = quantizers.quantize_rows(t, W)
    h(f"quantize_rows/{t.name}", q)
    h(f"quantize_rows/{t.name}/imatrix", quantizers.quantize_rows(t, W, IMAT))
    h(f"quantize_rows_np/{t.name}", quantizers.quantize_rows_np(t, W))
    h(f"quantize_rows_np/{t.name}/imatrix", quantizers.quantize_rows_np(t, W, IMAT))
    raw_of[t] = np.asarray(q, dtype=np.uint8)
raw_of[T.F32] = W
raw_of[T.F16] = W.astype(np.float16)
raw_of[T.BF16] = (W.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(N_OUT, 2 * N_IN)

served = registry.served()
for t in sorted({t for t, _, _ in served}, key=int):
    qt = registry.TYPES[t]
    raw = raw_of[t]
    for mode in registry.MODES:
        if mode not in qt.kernels:
            continue
        w = packing.pack(f"w.{t.name}", t, raw, N_OUT, N_IN, activations=mode)
        h(f"pack/{t.name}/{mode}", w.qs, w.d, w.m)
        h(f"dequantize/{t.name}/{mode}", packing.dequantize(w))
        h(f"get_rows/{t.name}/{mode}", packing.get_rows(w, IDS))
        for phase, rows_list in (("decode", (1, 3)), ("prefill", (5, 37))):
            k = qt.kernel(mode, phase)
            for rows in rows_list:
                y = np.empty((rows, N_OUT), dtype=np.float32)
                k.run(XS[rows], w, y)
                h(f"kernel/{t.name}/{mode}/{phase}/{rows}", y)
                h(f"twin/{t.name}/{mode}/{phase}/{rows}", k.twin(XS[rows], w))
                h(f"matmul/{t.name}/{mode}/{rows}", registry.matmul(XS[rows], w))

# activation quantizers
X = rng.standard_normal((7, 1024)).astype(np.float32) * 3
for fmt in (act8.Q8_0, act8.Q8_1, act8.PER32_F32):
    h(f"act8.quantize/{fmt}", *act8.quantize(X, fmt))
    h(f"act8.quantize_np/{fmt}", *act8.quantize_np(X, fmt))
h("act8.quantize_k", *act8.quantize_k(X))
h("act8.quantize_k_np", *act8.quantize_k_np(X))

# fp32 ops
S, H, KV, D = 13, 8, 2, 64
x = rng.standard_normal((S, H * D)).astype(np.float32)
g = rng.standard_normal(H * D).astype(np.float32)
h("rmsnorm", fp32.rmsnorm(x, g, 1e-5))
h("rmsnorm_ref", fp32.rmsnorm_ref(x, g, 1e-5))
inv = fp32.rope_frequencies(D, 10000.0)
h("rope_frequencies", inv)
h("rope_frequencies/factors", fp32.rope_frequencies(D, 500000.0, np.linspace(1, 4, D // 2)))
fc = fp32.precompute_freqs_cis(inv, 3, S)
h("precompute_freqs_cis", fc)
cos, sin = np.ascontiguousarray(fc.real, dtype=np.float32), np.ascontiguousarray(fc.imag, dtype=np.float32)
q = rng.standard_normal((S, H, D)).astype(np.float32)
for name in ("rope", "rope_neox"):
    a = q.copy()
    r = getattr(fp32, name)(a, cos, sin)
    h(name, a if r is None else r)
    h(name + "_ref", getattr(fp32, name + "_ref")(q, fc))
h("causal_mask", fp32.causal_mask(S, 4))
h("window_mask", fp32.window_mask(S, 4, 5))
sc = rng.standard_normal((H, S, S + 4)).astype(np.float32) * 4
for name in ("softmax", "softmax_ref"):
    h(name, getattr(fp32, name)(sc))
for name in ("silu", "silu_ref", "gelu", "gelu_f16_table"):
    h(name, getattr(fp32, name)(x))
gu = rng.standard_normal((S, 2 * 96)).astype(np.float32)
h("swiglu", fp32.swiglu(gu))
h("swiglu_ref", fp32.swiglu_ref(gu))
h("softcap", fp32.softcap(sc, 30.0))
keys = rng.standard_normal((S + 4, KV, D)).astype(np.float32)
vals = rng.standard_normal((S + 4, KV, D)).astype(np.float32)
for S_ in (1, S):
    qq = q[:S_]
    h(f"attention_scores/{S_}", fp32.attention_scores(qq, keys))
    h(f"attention_scores_ref/{S_}", fp32.attention_scores_ref(qq, keys))
    for window in (0, 6):
        for par in (False, True):
            h(f"attention_probs/{S_}/{window}/{par}", fp32.attention_probs(qq, keys, 0.125, S + 4 - S_, window, parallel=par))
        h(f"attention_probs_ref/{S_}/{window}", fp32.attention_probs_ref(qq, keys, 0.125, S + 4 - S_, window))
    p = fp32.softmax(np.ascontiguousarray(sc[:, :S_]))
    h(f"attention_values/{S_}", fp32.attention_values(p, vals))
    h(f"attention_values_ref/{S_}", fp32.attention_values_ref(p, vals))
h("repeat_kv", fp32.repeat_kv(keys, 4))

json.dump(out, open(sys.argv[1], "w"), indent=1, sort_keys=True)
print(len(out), "hashes ->", sys.argv[1])
