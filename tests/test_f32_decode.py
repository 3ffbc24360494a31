"""The float32 mode's decode (GEMV) microkernels of :mod:`llamatrace.kernels.types.f32_ir`: float32
activations times gguf-py's dequantized weights, float32 sums, for every row count of the decode
phase, full tiles and a padded one."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from gguf_factory import random_blocks
from llamatrace.kernels.types import f32_ir, k_quants, mxfp4, packing, q8
from llamatrace.kernels.types.registry import GEMV_MAX_SEQ, matmul

T = gguf.GGMLQuantizationType
TYPES = [T.Q8_0, T.MXFP4, T.Q4_K, T.Q6_K]
N_OUT = 70                                   # two full tiles of 32 rows and a padded one
N_IN = {T.Q8_0: 96, T.MXFP4: 160, T.Q4_K: 512, T.Q6_K: 768}
GEMV = {T.Q8_0: lambda x, w, out: q8._gemv_q8(x, w.qs, w.d, out),
        T.MXFP4: lambda x, w, out: mxfp4._gemv_mxfp4(x, w.qs, w.d, out),
        T.Q4_K: lambda x, w, out: k_quants.gemv_q4k(x, w.qs, w.d, w.m, out),
        T.Q6_K: lambda x, w, out: k_quants.gemv_q6k(x, w.qs, w.d, out)}


def _raw(qtype) -> np.ndarray:
    """uint8 [N_OUT, row bytes]: weights of magnitude ~0.05. K-quants: valid random blocks (every
    scale pattern); Q8_0 and MXFP4: gguf-py's quantizer of random weights, then one row of random
    quant bytes (every code)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (T.Q4_K, T.Q6_K):
        return random_blocks(qtype, N_OUT, N_IN[qtype] // block, seed=5, std=0.05)
    rng = np.random.default_rng(5)
    raw = gguf.quants.quantize(rng.standard_normal((N_OUT, N_IN[qtype])).astype(np.float32) * np.float32(0.05), qtype)
    first = nbytes - block // (1 if qtype == T.Q8_0 else 2)       # the quant bytes follow the scale
    raw.reshape(N_OUT, -1, nbytes)[40, :, first:] = rng.integers(0, 256, (N_IN[qtype] // block, nbytes - first),
                                                                 dtype=np.uint8)
    return raw


def _x(n_seq: int) -> np.ndarray:
    x = np.random.default_rng(n_seq).standard_normal((n_seq, max(N_IN.values()))).astype(np.float32)
    x[:, 32:40] *= 1000.0                    # a block with a large range
    return x


@pytest.mark.parametrize("n_seq", range(1, GEMV_MAX_SEQ + 1))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_is_float32_sums_of_gguf_weights(qtype, n_seq):
    raw = _raw(qtype)
    w = packing.pack("w", qtype, raw, N_OUT, N_IN[qtype])
    x = np.ascontiguousarray(_x(n_seq)[:, :N_IN[qtype]])
    W = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    ref = x.astype(np.float64) @ W.T
    bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(W).T)
    got = matmul(x, w)                       # the registry's decode phase: these kernels
    assert got.dtype == np.float32 and np.all(np.abs(got - ref) <= bound)
    assert np.all(np.abs(packing.matmul_ref(x, w) - ref) <= bound)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_full_tiles_and_padded_rows(qtype):
    """Into an out as wide as the tiles (every tile written straight to it), the padded rows give
    0 and the others the same values as into an out of the real width (the last tile through a
    scratch)."""
    w = packing.pack("w", qtype, _raw(qtype), N_OUT, N_IN[qtype])
    x = np.ascontiguousarray(_x(2)[:, :N_IN[qtype]])
    wide = np.full((2, w.n_tiles * f32_ir.TR), np.nan, np.float32)
    exact = np.full((2, N_OUT), np.nan, np.float32)
    GEMV[qtype](x, w, wide)
    GEMV[qtype](x, w, exact)
    np.testing.assert_array_equal(wide[:, N_OUT:], 0.0)
    np.testing.assert_array_equal(wide[:, :N_OUT], exact)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_nan_activation_reaches_only_its_row(qtype):
    w = packing.pack("w", qtype, _raw(qtype), N_OUT, N_IN[qtype])
    x = np.ascontiguousarray(_x(3)[:, :N_IN[qtype]])
    x[1, 7] = np.nan
    y = matmul(x, w)
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


def test_q6k_dword_layout_and_its_twins():
    """The f32 mode's Q6_K tiles (f32_ir.Q6K_LAYOUT): the packer's relayout equals its NumPy twin,
    and the rows read back in byte order (the twins' path) and the prefill's blocks are the bytes
    the packer started from."""
    qs = np.random.default_rng(3).integers(0, 256, (3, 2, 208, f32_ir.TR), dtype=np.uint8)
    got = qs.copy()
    k_quants.q6k_to_dwords(got)
    np.testing.assert_array_equal(got, k_quants.q6k_to_dwords_np(qs))
    t, r = np.repeat(np.arange(3), f32_ir.TR), np.tile(np.arange(f32_ir.TR), 3)
    np.testing.assert_array_equal(k_quants.q6k_rows_np(got, t, r), qs[t, :, :, r])
    w = packing.pack("w", T.Q6_K, _raw(T.Q6_K), N_OUT, N_IN[T.Q6_K])
    np.testing.assert_array_equal(k_quants.dequant_tile(k_quants.KIND[T.Q6_K], w.qs, w.d, w.d, 1),
                                  packing.dequant_tile_np(w, 1))
