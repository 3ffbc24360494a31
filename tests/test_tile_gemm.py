"""The float32 prefill's microkernel and chunk dequantizers (llamatrace.kernels.tile_gemm)
against their NumPy twins: sums to float32 rounding, dequantized weights bit for bit."""

import numpy as np
import pytest
from numba import njit

from llamatrace.kernels import tile_gemm
from llamatrace.kernels.tiles import TR


@njit
def _chunk(x, wt, k0, kc, acc):
    tile_gemm.chunk_matmul(x, wt, k0, kc, acc)


@njit
def _deq_i8(q, a):
    out = np.empty((q.shape[0], TR), np.float32)
    for k in range(q.shape[0]):
        tile_gemm.deq_i8(out, k * TR, q, k * TR, a, 0)
    return out


@njit
def _deq_bits(lo, lo_shift, lo_mask, hi, hi_shift, hi_mask, hi_pos, a, c, m):
    out = np.empty((lo.shape[0], TR), np.float32)
    for k in range(lo.shape[0]):
        tile_gemm.deq_bits(out, k * TR, lo, k * TR, lo_shift, lo_mask, hi, k * TR, hi_shift, hi_mask, hi_pos, a, c, m)
    return out


@pytest.mark.parametrize("n_seq", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize("k0,kc", [(0, 32), (32, 100), (64, 256)])
def test_chunk_matmul_adds_x_times_the_chunk(n_seq, k0, kc):
    rng = np.random.default_rng(n_seq * 1000 + kc)
    x = rng.standard_normal((n_seq, 352)).astype(np.float32)
    wt = rng.standard_normal((256, TR)).astype(np.float32)
    acc = rng.standard_normal((n_seq, TR)).astype(np.float32)
    want = acc.copy()
    tile_gemm.chunk_matmul_np(x, wt, k0, kc, want)
    _chunk(x, wt, k0, kc, acc)
    np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-4)


def test_a_row_sums_to_the_same_bits_in_any_block_of_rows():
    """Rows go 6 at a time, the rest in a smaller block: a row's sums are its own FMA chains, so
    they are the same bits whether it is computed alone or among 13 rows."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((13, 256)).astype(np.float32)
    wt = rng.standard_normal((256, TR)).astype(np.float32)
    together = np.zeros((13, TR), np.float32)
    _chunk(x, wt, 0, 256, together)
    for s in range(13):
        alone = np.zeros((1, TR), np.float32)
        _chunk(x[s:s + 1].copy(), wt, 0, 256, alone)
        np.testing.assert_array_equal(alone[0].view(np.uint32), together[s].view(np.uint32))


def test_deq_i8_is_scale_times_quant_bit_for_bit():
    rng = np.random.default_rng(2)
    q = rng.integers(-128, 128, (8, TR), dtype=np.int8)
    q[0] = 0                                          # d * 0 keeps the sign of d: -0 for d < 0
    a = rng.standard_normal(TR).astype(np.float32)
    want = a[None, :] * q.astype(np.float32)
    np.testing.assert_array_equal(_deq_i8(q, a).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("lo_shift,lo_mask,hi_shift,hi_mask,hi_pos,c", [
    (4, 15, 0, 0, 0, 0.0),          # Q4_K's high nibble, no high part
    (0, 15, 6, 3, 4, -32.0),        # Q6_K: four low bits, two high bits at bit 4, less 32
    (2, 3, 1, 1, 2, -4.0),          # Q3_K: two low bits, the high bit at bit 2, less 4
])
def test_deq_bits_is_gguf_order_of_rounding_bit_for_bit(lo_shift, lo_mask, hi_shift, hi_mask, hi_pos, c):
    rng = np.random.default_rng(3)
    lo = rng.integers(0, 256, (16, TR), dtype=np.uint8)
    hi = rng.integers(0, 256, (16, TR), dtype=np.uint8)
    a = (rng.standard_normal(TR) * 1e-3).astype(np.float32)
    m = np.where(np.arange(TR) % 2, rng.standard_normal(TR) * 1e-3, 0.0).astype(np.float32)
    q = ((lo >> lo_shift) & lo_mask) | (((hi >> hi_shift) & hi_mask) << hi_pos)
    want = a[None, :] * (q.astype(np.float32) + np.float32(c)) - m[None, :]
    got = _deq_bits(lo, lo_shift, lo_mask, hi, hi_shift, hi_mask, hi_pos, a, np.float32(c), m)
    assert (want == 0).any() and np.signbit(want[want == 0]).any()       # negative zeros are checked
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
