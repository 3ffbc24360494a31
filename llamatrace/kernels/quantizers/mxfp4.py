"""llama.cpp's MXFP4 quantizer (gpt-oss's expert type): float32 rows -> ``block_mxfp4``, byte for byte.

Written from ggml's ``quantize_row_mxfp4_ref`` (``ggml-quants.c``, llama-cpp-python 0.3.36's
vendored llama.cpp); ``quantize_mxfp4`` ignores an importance matrix and always runs it. Per block
of 32 weights:

- ``amax`` = the largest ``|x|`` (a NaN never wins ``amax < |x|``);
- the shared E8M0 exponent ``e = (uint8_t)(floorf(log2f(amax)) - 2 + 127)``, 0 for an all-zero
  block. ``log2f`` is taken as float64 ``log2`` rounded to float32: its floor equals glibc's
  ``log2f``'s on every float32 just below a power of two (the only place they could part; checked
  by the tests). The cast is x86-64 C's: truncate to int32, keep the low byte (a block whose
  ``amax`` is below 2**-125 wraps, as llama.cpp's does);
- ``d = GGML_E8M0_TO_FP32_HALF(e)`` (``2**(e-128)``; denormal for e < 2), and each weight's
  quant is the first index of least ``|kvalues[i]*d - x|`` over ``kvalues_mxfp4 = (0, 1, 2, 3,
  4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)`` (E2M1 doubled), float32 arithmetic.

Layout: ``e qs[16]`` (17 bytes); byte j holds quant j low, quant j+16 high.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from llamatrace.kernels.quantizers.k_rows import F32, claim_rows, row_chunk, row_f32
from llamatrace.machine.jit import E8M0_HALF_TABLE, JIT_QUANT, JIT_QUANT_PARALLEL

QK_MXFP4 = 32
"""Weights per MXFP4 block."""
BLOCK_BYTES = 17
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
"""ggml's ``kvalues_mxfp4``: the E2M1 values, doubled (``d`` is half the E8M0 scale)."""
E8M0_HALF = E8M0_HALF_TABLE[:256].copy()
"""``ggml_e8m0_to_fp32_half(e)`` for every byte e: ``2**(e-128)`` (denormal bit patterns below e = 2)."""


@njit(**JIT_QUANT, inline="always")
def _exponent(amax):
    """The block's E8M0 byte (see the module docstring)."""
    if not amax > F32(0.0):
        return 0
    v = F32(F32(np.floor(F32(math.log2(np.float64(amax))))) - F32(2.0) + F32(127.0))
    i = int(v) if -2147483649.0 < v < 2147483648.0 else -2147483648
    return i & 0xFF


@njit(**JIT_QUANT, inline="always")
def _best_index(x, d, kv):
    best, best_err = 0, abs(F32(F32(kv[0] * d) - x))
    for i in range(1, 16):
        err = abs(F32(F32(kv[i] * d) - x))
        if err < best_err:
            best, best_err = i, err
    return best


@njit(**JIT_QUANT)
def _mxfp4_row(x, qw, out, kv, half):
    for b in range(x.shape[0] // QK_MXFP4):
        xb = x[b * QK_MXFP4:(b + 1) * QK_MXFP4]
        ob = out[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES]
        amax = F32(0.0)
        for j in range(QK_MXFP4):
            a = abs(xb[j])
            if amax < a:
                amax = a
        e = _exponent(amax)
        d = half[e]
        ob[0] = e
        for j in range(QK_MXFP4 // 2):
            ob[1 + j] = (_best_index(xb[j], d, kv) | (_best_index(xb[j + 16], d, kv) << 4)) & 0xFF


@njit(**JIT_QUANT_PARALLEL)
def _mxfp4_rows(x, qw, out, n_threads):
    kv, half = KVALUES.copy(), E8M0_HALF.copy()
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _mxfp4_row(row_f32(x[r]), qw, out[r], kv, half)
            first, last = claim_rows(counter, x.shape[0], chunk)


def _exponent_np(amax: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`_exponent` (int64 ``[nb]``)."""
    with np.errstate(divide="ignore"):
        lg = np.log2(amax.astype(np.float64)).astype(np.float32)
    v = np.floor(lg).astype(np.float32) - F32(2.0) + F32(127.0)
    ok = (v > -2147483649.0) & (v < 2147483648.0)
    i = np.where(ok, np.trunc(np.where(ok, v, 0)), -2147483648).astype(np.int64)
    return np.where(amax > 0, i & 0xFF, 0)


def _mxfp4_np(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """NumPy twin of :func:`_mxfp4_rows` on float32 ``[n_rows, n]``: bytes ``[n_blocks, 17]``."""
    xb = x.reshape(-1, QK_MXFP4)
    amax = np.zeros(xb.shape[0], np.float32)
    for j in range(QK_MXFP4):                           # ggml's `if (amax < |v|)`: a NaN never wins
        a = np.abs(xb[:, j])
        amax = np.where(amax < a, a, amax)
    e = _exponent_np(amax)
    d = E8M0_HALF[e]
    err = np.abs(KVALUES[None, None, :] * d[:, None, None] - xb[:, :, None])
    best = np.zeros(xb.shape, np.int64)                 # first least error, NaN errors never win
    best_err = err[:, :, 0]
    for i in range(1, 16):
        better = err[:, :, i] < best_err
        best = np.where(better, i, best)
        best_err = np.where(better, err[:, :, i], best_err)
    qs = (best[:, :16] | (best[:, 16:] << 4)).astype(np.uint8)
    return np.concatenate([e.astype(np.uint8)[:, None], qs], axis=1)


def kernels(ggml_type) -> dict:
    """``{MXFP4: (Numba rows kernel, NumPy twin)}`` for :mod:`llamatrace.kernels.quantizers.rows`'s table."""
    return {ggml_type: (_mxfp4_rows, _mxfp4_np)}
