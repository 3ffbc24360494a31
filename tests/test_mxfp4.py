"""MXFP4 weights (llamatrace.kernels.types.mxfp4): the dequantizer against gguf-py's, the float32
kernels against float64 sums over gguf-py's weights, the q8 mode against llama.cpp's own x86
``quantize_row_q8_0`` + ``ggml_vec_dot_mxfp4_q8_0`` (compiled from the sdist), every Numba kernel
against its NumPy twin, and the registry, packer and precompiler serving the type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from ggml_cpu_quants import ggml_cpu_mxfp4_matmul

from llamatrace.kernels.int8 import act8
from llamatrace.kernels.precompile import COMMON, compile_kernels
from llamatrace.kernels.types import mxfp4, packing, registry
from llamatrace.kernels.types.registry import GEMV_MAX_SEQ, PHASES, matmul

T = gguf.GGMLQuantizationType
N_OUT, N_IN = 70, 160                       # a padded tile; 5 blocks (odd: ggml's pairs loop has a tail)


def _raw(seed: int = 0) -> np.ndarray:
    """uint8 [N_OUT, 5*17]: gguf-py's MXFP4 of random weights, with the scale bytes' edges
    (e 0 and 1: float32 denormal scales; 200: 2**72) and every 4-bit code (random bytes)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N_OUT, N_IN)).astype(np.float32) * np.float32(0.02)
    raw = gguf.quants.quantize(w, T.MXFP4)
    blocks = raw.reshape(N_OUT, -1, 17)
    blocks[3, :, 1:] = rng.integers(0, 256, (blocks.shape[1], 16), dtype=np.uint8)
    blocks[0, 0, 0], blocks[1, 0, 0], blocks[2, 1, 0] = 0, 1, 200
    return raw


def _x(n_seq: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n_seq, N_IN)).astype(np.float32)
    x[0, :32] = 0.0                         # an all-zero block
    x[-1, 32:40] *= 1000.0                  # a block with a large range
    return x


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_dequantized_weights_are_gguf_pys_bit_for_bit(mode):
    raw = _raw()
    w = packing.pack("w", T.MXFP4, raw, N_OUT, N_IN, activations=mode)
    assert w.mode == mode and w.d.dtype == registry.FORMATS[T.MXFP4].scale_dtype(mode)
    want = gguf.quants.dequantize(raw, T.MXFP4)
    np.testing.assert_array_equal(packing.dequantize(w), want)
    np.testing.assert_array_equal(packing.get_rows(w, np.array([2, 0, 69])), want[[2, 0, 69]])
    if mode == "f32":                       # the prefill kernel's own dequantizer too
        np.testing.assert_array_equal(mxfp4.dequant_tile(w.qs, w.d, 2), packing.dequant_tile_np(w, 2))


def test_scales_are_ggmls_e8m0_half():
    # GGML_E8M0_TO_FP32_HALF: 2**(e - 128); e 0 and 1 are float32 denormals, never flushed
    raw = _raw()
    w = packing.pack("w", T.MXFP4, raw, N_OUT, N_IN)
    e = raw.reshape(N_OUT, -1, 17)[:, :, 0]
    rows = np.arange(N_OUT)
    np.testing.assert_array_equal(w.scales_f32(rows // packing.TR, rows % packing.TR)[0],
                                  np.ldexp(1.0, e.astype(np.int64) - 128).astype(np.float32))
    assert w.d[0, 0, 0] == np.float32(2.0 ** -128) and w.d[0, 0, 1] == np.float32(2.0 ** -127)


@pytest.mark.parametrize("n_seq", [1, GEMV_MAX_SEQ, GEMV_MAX_SEQ + 1, 9])
def test_float32_matmul_is_float64_sums_over_gguf_weights(n_seq):
    raw = _raw(n_seq)
    w = packing.pack("w", T.MXFP4, raw, N_OUT, N_IN)
    x = _x(n_seq)
    W = gguf.quants.dequantize(raw, T.MXFP4).astype(np.float64)
    got = matmul(x, w)
    bound = np.abs(x).astype(np.float64) @ np.abs(W).T
    assert np.all(np.abs(got - x.astype(np.float64) @ W.T) <= 1e-6 * bound + 1e-30)


@pytest.mark.parametrize("n_seq", [1, 3, GEMV_MAX_SEQ + 1, 9])
def test_q8_matmul_is_llamacpps_own(n_seq):
    # llama.cpp's x86 code on the same bytes: quantize_row_q8_0, then ggml_vec_dot_mxfp4_q8_0
    raw = _raw(10 + n_seq)
    w = packing.pack("w", T.MXFP4, raw, N_OUT, N_IN, activations="q8")
    x = _x(n_seq, seed=n_seq)
    got = matmul(x, w)
    ggml = ggml_cpu_mxfp4_matmul(raw, x)
    bound = np.abs(x).astype(np.float64) @ np.abs(gguf.quants.dequantize(raw, T.MXFP4)).astype(np.float64).T
    assert np.all(np.abs(got - ggml) <= 1e-6 * bound + 1e-30)
    # and the float32 path differs by about the activations' rounding, no more
    f32 = matmul(x, packing.pack("w", T.MXFP4, raw, N_OUT, N_IN))
    assert np.abs(got - f32).max() < 3e-2 * np.abs(f32).max()


@pytest.mark.parametrize("mode", ["f32", "q8"])
@pytest.mark.parametrize("phase", PHASES)
def test_each_kernel_is_its_numpy_twin(mode, phase):
    raw = _raw(3)
    w = packing.pack("w", T.MXFP4, raw, N_OUT, N_IN, activations=mode)
    x = _x(1 if phase == "decode" else GEMV_MAX_SEQ + 2, seed=4)
    kern = registry.TYPES[T.MXFP4].kernel(mode, phase)
    out = np.empty((x.shape[0], N_OUT), np.float32)
    kern.run(x, w, out)
    twin = kern.twin(x, w)
    bound = np.abs(x).astype(np.float64) @ np.abs(packing.dequantize(w)).T.astype(np.float64)
    assert np.all(np.abs(out - twin) <= 1e-6 * bound + 1e-30)
    if mode == "f32":                       # the GEMV's own twin over several rows as well
        y = np.empty((3, N_OUT), np.float32)
        mxfp4.gemv_mxfp4(_x(3), w, y)
        np.testing.assert_allclose(y, mxfp4.gemv_mxfp4_twin(_x(3), w), rtol=0, atol=1e-6 * np.abs(y).max())


def test_q8_packing_is_the_float32_layout_regrouped():
    raw = _raw(5)
    f32, q8 = (packing.pack("w", T.MXFP4, raw, N_OUT, N_IN, activations=m) for m in ("f32", "q8"))
    np.testing.assert_array_equal(act8.file_order(q8.qs, T.MXFP4), f32.qs)
    e = raw.reshape(N_OUT, -1, 17)[:, :, 0]                 # the q8 mode keeps the E8M0 bytes
    rows = np.arange(N_OUT)
    np.testing.assert_array_equal(q8.d[rows // packing.TR, :, rows % packing.TR], e)


def test_registry_serves_mxfp4_in_both_modes_and_precompiles_it():
    assert {(T.MXFP4, m, p) for m in registry.MODES for p in PHASES} <= set(registry.served())
    assert T.MXFP4 in registry.served_types("q8")
    assert registry.summary("MXFP4") == ("mxfp4.gemv_mxfp4 / mxfp4.tiled_mxfp4, q8: mxfp4.act8_mxfp4")
    assert registry.TYPES[T.MXFP4].quantize.args == (T.MXFP4,)   # quantizers/mxfp4 through quantize_rows
    assert "MXFP4" in COMMON
    lines = []
    compile_kernels(["MXFP4"], log=lines.append)
    assert [ln.split(":")[0] for ln in lines] == ["MXFP4"]


def test_codes_to_kvalues_four_at_a_time_is_the_table_for_every_code_quadruple():
    # the kernels' uint32 arithmetic (no table) against ggml's kvalues_mxfp4, all 16**4 words
    from numba import njit

    @njit
    def each(words):
        out = np.empty_like(words)
        for i in range(words.shape[0]):
            out[i] = mxfp4._kvalues4(words[i])
        return out

    codes = np.stack(np.meshgrid(*[np.arange(16, dtype=np.uint8)] * 4, indexing="ij"), -1).reshape(-1, 4)
    got = each(np.ascontiguousarray(codes).view(np.uint32).reshape(-1)).view(np.int8).reshape(-1, 4)
    np.testing.assert_array_equal(got, mxfp4.KVALUES[codes])
