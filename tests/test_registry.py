"""The kernel registry (llamatrace.kernels.types.registry): what is registered, that each registered kernel
computes what its NumPy reference does, the errors for what is not, and ``llamatrace info``'s column."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from gguf_factory import random_blocks, write_tiny_llama

from llamatrace.cli import main
from llamatrace.errors import UnsupportedModelError
from llamatrace.kernels.int8 import act8
from llamatrace.kernels.types import mxfp4, packing, q5, registry
from llamatrace.kernels.types.registry import GEMV_MAX_SEQ, PHASES, matmul

T = gguf.GGMLQuantizationType
FLOATS = (T.F32, T.F16, T.BF16)
BLOCKS = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4)
Q8_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4)
# what the old if-chain (quant._dispatch) served: every type with float32 activations in both
# phases, and the 8-bit-activation types with one kernel for both
SERVED = ({(t, "f32", p) for t in FLOATS + BLOCKS for p in PHASES}
          | {(t, "q8", p) for t in Q8_TYPES for p in PHASES})
N_OUT = 70                                   # not a multiple of the 32-row tile


def _weight(qtype, mode: str):
    """(raw file bytes or floats, packed Weight) of a random [70, n_in] matrix of ``qtype``."""
    rng = np.random.default_rng(int(qtype))
    if qtype in FLOATS + (T.Q4_0, T.Q4_1, T.Q8_0, T.MXFP4):  # types gguf-py can quantize
        n_in = 96
        w = rng.standard_normal((N_OUT, n_in)).astype(np.float32)
        raw = w if qtype == T.F32 else gguf.quants.quantize(w, qtype)
    else:
        n_in = 2 * registry.FORMATS[qtype].weights
        raw = random_blocks(qtype, N_OUT, 2, seed=int(qtype), std=0.05)
    return raw, packing.pack("w", qtype, raw, N_OUT, n_in, activations=mode)


def test_every_combination_the_old_dispatch_served_is_registered():
    assert set(registry.served()) == SERVED
    assert registry.served_types("q8") == set(Q8_TYPES)


@pytest.mark.parametrize("key", sorted(SERVED, key=lambda k: (k[0].name, k[1], k[2])),
                         ids=lambda k: "-".join((k[0].name, k[1], k[2])))
def test_registered_kernel_matches_its_reference(key):
    qtype, mode, phase = key
    raw, w = _weight(qtype, mode)
    assert w.act8 == (mode == "q8")
    n_seq = 1 if phase == "decode" else GEMV_MAX_SEQ + 1
    x = np.random.default_rng(5).standard_normal((n_seq, w.n_in)).astype(np.float32)
    kern = registry.lookup(qtype, mode, phase)
    assert registry.describe(w)[phase] == kern.name
    out = np.empty((n_seq, N_OUT), np.float32)
    kern.run(x, w, out)
    np.testing.assert_array_equal(matmul(x, w), out)          # matmul runs this kernel for this phase
    if mode == "f32":                                          # gguf-py's weights, float64 sums
        W = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(N_OUT, -1)
        ref = x.astype(np.float64) @ W.T
        scale = np.abs(x).astype(np.float64) @ np.abs(W).T
        assert np.all(np.abs(out - ref) <= 1e-6 * scale + 1e-30)
    else:                                                      # act8's NumPy twins of the same kernels
        twin = {T.Q4_0: lambda: act8.matmul_q4_np(x, w.qs, w.d, w.d, -8.0),
                T.Q4_1: lambda: act8.matmul_q4_np(x, w.qs, w.d, w.m, 1.0),
                T.Q8_0: lambda: act8.matmul_q8_np(x, w.qs, w.d),
                T.Q5_0: lambda: q5.act8_q5_np(x, w.qs, w.d, w.d, 0.0, 16),
                T.Q5_1: lambda: q5.act8_q5_np(x, w.qs, w.d, w.m, 1.0, 0),
                T.Q4_K: lambda: act8.matmul_q4k_np(x, w.qs, w.d, w.m),
                T.Q6_K: lambda: act8.matmul_q6k_np(x, w.qs, w.d),
                T.MXFP4: lambda: mxfp4.act8_mxfp4_np(x, w.qs, w.d)}[qtype]()[:, :N_OUT]
        np.testing.assert_allclose(out, twin, rtol=0, atol=1e-6 * np.abs(twin).max())


@pytest.mark.parametrize("key", sorted(SERVED, key=lambda k: (k[0].name, k[1], k[2])),
                         ids=lambda k: "-".join((k[0].name, k[1], k[2])))
def test_declared_kernel_matches_the_twin_declared_beside_it(key):
    qtype, mode, phase = key
    _, w = _weight(qtype, mode)
    n_seq = 1 if phase == "decode" else GEMV_MAX_SEQ + 1
    x = np.random.default_rng(6).standard_normal((n_seq, w.n_in)).astype(np.float32)
    kern = registry.TYPES[qtype].kernel(mode, phase)
    out = np.empty((n_seq, N_OUT), np.float32)
    kern.run(x, w, out)
    twin = kern.twin(x, w)
    assert twin.dtype == np.float32 and twin.shape == out.shape
    scale = np.abs(x).astype(np.float64) @ np.abs(packing.dequantize(w)).T.astype(np.float64)
    assert np.all(np.abs(out - twin) <= 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("qtype, f32_dtype", [(T.Q4_1, np.float32), (T.Q8_0, np.uint16)])
def test_weight_scales_follow_the_mode_declared_encoding(qtype, f32_dtype):
    """float32 values in f32 (fp16 bits for Q8_0, whose f32 kernels widen them), fp16 bits in q8;
    the same float32 scales either way."""
    f32, q8 = (_weight(qtype, mode)[1] for mode in ("f32", "q8"))
    fmt = registry.FORMATS[qtype]
    assert (f32.d.dtype, q8.d.dtype) == (np.dtype(f32_dtype), np.dtype(np.uint16))
    assert (fmt.scale_dtype("f32"), fmt.scale_dtype("q8")) == (f32.d.dtype, q8.d.dtype)
    rows = np.array([0, 33, 69])
    for got, want in zip(q8.scales_f32(rows // packing.TR, rows % packing.TR),
                         f32.scales_f32(rows // packing.TR, rows % packing.TR)):
        np.testing.assert_array_equal(got, want)
    assert f32.block_scales().dtype == np.float32
    np.testing.assert_array_equal(f32.block_scales(), q8.block_scales())
    with pytest.raises(ValueError, match="must be uint16 in mode q8"):
        dataclasses.replace(q8, d=f32.block_scales())


def test_unregistered_combination_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="no kernel computes with IQ4_NL weights in activation mode 'q8'"):
        registry.lookup(T.IQ4_NL, "q8", "decode")
    with pytest.raises(UnsupportedModelError, match="Q5_K weights in activation mode 'q8' for prefill"):
        registry.lookup(T.Q5_K, "q8", "prefill")
    _, w = _weight(T.Q4_0, "f32")
    odd = packing.Weight("odd", T.IQ4_NL, w.n_out, w.n_in, w.qs, w.d, w.m, w.row_splits)
    with pytest.raises(UnsupportedModelError, match="IQ4_NL"):
        matmul(np.zeros((1, w.n_in), np.float32), odd)
    with pytest.raises(UnsupportedModelError):
        registry.describe(odd)


def test_kernel_declarations_are_checked():
    q8_0 = registry.TYPES[T.Q8_0]
    with pytest.raises(ValueError, match="Q8_0 declared twice"):
        registry.declare(q8_0)
    with pytest.raises(ValueError, match="mode"):
        registry.declare(dataclasses.replace(q8_0, ggml_type=T.Q8_1, kernels={"int4": q8_0.kernels["f32"]}))
    with pytest.raises(ValueError, match="q8_bytes"):
        registry.declare(dataclasses.replace(q8_0, ggml_type=T.Q8_1, q8_bytes=None))
    assert set(registry.served()) == SERVED                  # nothing half-registered
    assert T.Q8_1 not in registry.TYPES and T.Q8_1 not in registry.FORMATS


def test_info_names_the_kernels_of_each_tensor_type(tmp_path, capsys):
    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype=T.Q4_1)
    assert main(["info", "-m", str(path)]) == 0
    out = capsys.readouterr().out
    assert "matmul kernels" in out
    for name in ("q4.gemv_q4_1", "q4.tiled_q4_1", "q4.act8_gemv_q4_1", "floats.tiled_f32"):   # rich may wrap the cell
        assert name in out
    assert registry.summary("Q4_1") == "q4.gemv_q4_1 / q4.tiled_q4_1, q8: q4.act8_gemv_q4_1 / q4.act8_prefill_q4_1"
    assert registry.summary("IQ4_NL") == "-"


def test_a_new_block_type_needs_only_its_declaration():
    """IQ4_NL declared the way a family module would (one QuantType: a BlockFormat, its dequantizer,
    an adapter and its twin) packs with the existing repacker and multiplies through matmul;
    packing itself is not touched."""
    kvalues = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)

    def dequant_np(p, db, mb):                 # d * kvalues[nibble]: low nibbles, then high
        q = np.concatenate([p & 15, p >> 4], axis=-1)
        return (db[..., None] * kvalues[q]).reshape(p.shape[0], -1)

    def matmul_iq4_nl(x, w, out):
        out[:] = packing.matmul_ref(x, w)

    tables = (registry.TYPES, registry.FORMATS, registry._KERNELS)      # packing reads these dicts
    saved = [dict(t) for t in tables]
    try:
        registry.declare(registry.QuantType(
            T.IQ4_NL, registry.BlockFormat(weights=32, file_bytes=18, packed_bytes=16, copy=(2, 0, 16), d_off=0),
            dequant_np=dequant_np, kernels={"f32": (registry.Kernel(matmul_iq4_nl, packing.matmul_ref),) * 2}))
        rng = np.random.default_rng(3)
        raw = rng.integers(0, 256, (N_OUT, 2 * 18), dtype=np.uint8)
        raw.reshape(N_OUT, 2, 18)[:, :, :2] = np.array([0.01], np.float16).view(np.uint8)   # finite scales
        w = packing.pack("w", T.IQ4_NL, raw, N_OUT, 64)
        ref = gguf.quants.dequantize(raw, T.IQ4_NL).astype(np.float32)
        np.testing.assert_array_equal(packing.dequantize(w), ref)
        x = rng.standard_normal((3, 64)).astype(np.float32)
        np.testing.assert_allclose(matmul(x, w), x @ ref.T, rtol=1e-5, atol=1e-5)
        assert registry.describe(w) == {"decode": "test_registry.matmul_iq4_nl",
                                        "prefill": "test_registry.matmul_iq4_nl"}
    finally:
        for table, old in zip(tables, saved):
            table.clear()
            table.update(old)


def test_precompile_runs_every_kernel_of_a_type_and_refuses_unknown_types(monkeypatch):
    from llamatrace.kernels import mul_mat_id
    from llamatrace.kernels.precompile import compile_kernels
    lines, calls = [], []
    real = mul_mat_id.mul_mat_id
    monkeypatch.setattr(mul_mat_id, "mul_mat_id", lambda x, parts, ids, rows, activations: calls.append(
        (parts[0].ggml_type.name, len(parts), len(ids), activations)) or real(x, parts, ids, rows, activations))
    seconds = compile_kernels(["Q4_0", "Q4_K"], log=lines.append)
    assert seconds >= 0 and [ln.split(":")[0] for ln in lines] == ["Q4_0", "Q4_K"]
    from llamatrace.kernels.int8 import act8
    modes = [m for m in ("f32", "q8") if mul_mat_id.supported(gguf.GGMLQuantizationType.Q4_K, m)
             and (m == "f32" or act8.available())]
    # the experts' kernels too, decode (one slot) and prefill (several), gate|up and down; Q4_0 has none
    assert modes and sorted(calls) == sorted((
        "Q4_K", parts, slots, m) for m in modes for parts in (1, 2) for slots in (1, 6))
    with pytest.raises(ValueError, match="Q9_9"):
        compile_kernels(["Q9_9"])
