"""llama.cpp's quantizers: float32 rows -> the GGUF blocks ``llama-quantize`` writes, byte for byte.

:func:`quantize_rows` (Numba, rows shared among the threads) and its NumPy twin
:func:`quantize_rows_np` serve Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (this module), Q2_K..Q6_K
(:mod:`llamatrace.kernels.quantizers.k_rows`) and MXFP4 (:mod:`~llamatrace.kernels.quantizers.mxfp4`), written from ggml's ``ggml-quants.c`` (llama-cpp-python
0.3.36's vendored llama.cpp). ``ggml_quantize_chunk`` calls ``quantize_<type>(src, dst, nrow,
n_per_row, imatrix)``, which takes one of two paths:

- no importance matrix: the reference ``quantize_row_<type>_ref`` (Q8_0 always: it ignores an
  imatrix). Legacy blocks of 32: Q4_0/Q5_0 scale by the first element of largest |x|
  (``d = max / -8`` or ``/ -16``), Q4_1/Q5_1 by ``(max - min) / 15`` or ``/ 31`` with ``m =
  min``, Q8_0 by ``max|x| / 127``; quants truncated after adding 8.5 / 16.5 / 0.5 (rounded
  half away from zero for Q8_0), as C converts float to an 8-bit integer;
- an importance matrix ``imatrix [n_per_row]``: each weight's importance is ``imatrix[j] *
  sqrt(sigma2 + x[j]^2)`` with ``sigma2`` the row's mean square, and the block's scale is
  searched for the least importance-weighted squared error: Q4_0/Q5_0 by ``make_qx_quants``,
  Q4_1/Q5_1 by ``make_qkx3_quants`` (scale and minimum; :mod:`~llamatrace.kernels.quantizers.k_rows`).

Block layouts (little-endian fp16 ``d``/``m``): Q4_0 ``d qs[16]`` (18 bytes; byte j holds quant j
low, j+16 high), Q4_1 ``d m qs[16]`` (20), Q5_0 ``d qh[4] qs[16]`` (22; bit j of the uint32
``qh`` is quant j's fifth bit), Q5_1 ``d m qh[4] qs[16]`` (24), Q8_0 ``d qs[32]`` int8 (34).
Rounding as in :mod:`~llamatrace.kernels.quantizers.k_rows`: float32 in ggml's order, no fastmath.
"""

from __future__ import annotations

import math
from functools import partial

import gguf
import numba
import numpy as np
from numba import njit, prange

from llamatrace.kernels.quantizers import k_rows as qk
from llamatrace.kernels.quantizers import mxfp4
from llamatrace.machine.jit import JIT_QUANT, JIT_QUANT_PARALLEL
from llamatrace.kernels.quantizers.k_rows import (F32, claim_rows, fp16_np, make_qkx, make_qkx_np,
                                                  make_qx, make_qx_np, put_fp16, row_chunk, row_f32)

T = gguf.GGMLQuantizationType
QK = 32
"""Weights per legacy block."""


@njit(**JIT_QUANT, inline="always")
def _c_int8(v):
    """``(int8_t)`` of a float32 as x86-64 C does it: truncate to int32 (``cvttss2si``; NaN and
    out of range give INT_MIN), keep the low byte. Denormal blocks reach it with inf and NaN."""
    i = int(v) if -2147483649.0 < v < 2147483648.0 else -2147483648
    return ((i & 0xFF) ^ 0x80) - 0x80


@njit(**JIT_QUANT, inline="always")
def _roundf(v):
    """C's ``roundf``: half away from zero (``v - trunc(v)`` is exact)."""
    t = F32(np.trunc(v))
    if abs(F32(v - t)) >= F32(0.5):
        t = F32(t + (F32(1.0) if v > 0 else F32(-1.0)))
    return t


@njit(**JIT_QUANT, inline="always")
def _importance(x, qw, sigma2, w):
    """ggml's legacy and K weights: ``w = qw * sqrt(sigma2 + x^2)`` (float32 ``sqrtf``)."""
    for j in range(x.shape[0]):
        w[j] = F32(qw[j] * F32(math.sqrt(F32(sigma2 + F32(x[j] * x[j])))))


@njit(**JIT_QUANT, inline="always")
def _row_sigma2(x):
    """A row's mean square, summed in order (the legacy impl paths' ``sigma2``)."""
    s = F32(0.0)
    for j in range(x.shape[0]):
        s = F32(s + F32(x[j] * x[j]))
    return F32(s / F32(x.shape[0]))


@njit(**JIT_QUANT, inline="always")
def _put_nibbles(L, ob, at):
    for j in range(16):
        ob[at + j] = ((L[j] & 0xFF) | (L[j + 16] << 4)) & 0xFF


@njit(**JIT_QUANT, inline="always")
def _put_q5(L, ob, at):
    """Q5 quants ``L [32]`` (0..31): low nibbles at ``ob[at+4:]``, fifth bits in ``qh`` at ``at``."""
    qh = 0
    for j in range(16):
        lo, hi = L[j] & 0xFF, L[j + 16] & 0xFF
        ob[at + 4 + j] = ((lo & 0x0F) | ((hi & 0x0F) << 4)) & 0xFF
        qh |= ((lo & 0x10) >> 4) << j
        qh |= ((hi & 0x10) >> 4) << (j + 16)
    for k in range(4):
        ob[at + k] = (qh >> (8 * k)) & 0xFF


@njit(**JIT_QUANT, inline="always")
def _absmax_first(xb):
    amax = F32(0.0)
    mx = F32(0.0)
    for j in range(xb.shape[0]):
        a = abs(xb[j])
        if amax < a:
            amax, mx = a, xb[j]
    return mx


@njit(**JIT_QUANT, inline="always")
def _min_max(xb):
    mn = F32(3.4028234663852886e38)
    mx = F32(-3.4028234663852886e38)
    for j in range(xb.shape[0]):
        if xb[j] < mn:
            mn = xb[j]
        if xb[j] > mx:
            mx = xb[j]
    return mn, mx


@njit(**JIT_QUANT)
def _q4_0_row(x, qw, out):
    L = np.empty(QK, np.int8)
    Laux = np.empty(QK, np.int8)
    w = np.empty(QK, np.float32)
    sigma2 = _row_sigma2(x) if qw.shape[0] else F32(0.0)
    for b in range(x.shape[0] // QK):
        xb = x[b * QK:(b + 1) * QK]
        ob = out[b * 18:(b + 1) * 18]
        if qw.shape[0]:
            _importance(xb, qw[b * QK:(b + 1) * QK], sigma2, w)
            put_fp16(ob, 0, make_qx(xb, 8, L, Laux, w, True))
        else:
            d = F32(_absmax_first(xb) / F32(-8.0))
            idd = F32(F32(1.0) / d) if d != 0 else F32(0.0)
            put_fp16(ob, 0, d)
            for j in range(QK):
                L[j] = min(15, _c_int8(F32(F32(xb[j] * idd) + F32(8.5))))
        _put_nibbles(L, ob, 2)


@njit(**JIT_QUANT)
def _q4_1_row(x, qw, out):
    L = np.empty(QK, np.uint8)
    Laux = np.empty(QK, np.uint8)
    w = np.empty(QK, np.float32)
    sigma2 = _row_sigma2(x) if qw.shape[0] else F32(0.0)
    for b in range(x.shape[0] // QK):
        xb = x[b * QK:(b + 1) * QK]
        ob = out[b * 20:(b + 1) * 20]
        if qw.shape[0]:
            _importance(xb, qw[b * QK:(b + 1) * QK], sigma2, w)
            d, neg_min = make_qkx(xb, 15, w, L, Laux, F32(-0.9), F32(0.05), 36, False)
            put_fp16(ob, 0, d)
            put_fp16(ob, 2, F32(-neg_min))
        else:
            mn, mx = _min_max(xb)
            d = F32(F32(mx - mn) / F32(15.0))
            idd = F32(F32(1.0) / d) if d != 0 else F32(0.0)
            put_fp16(ob, 0, d)
            put_fp16(ob, 2, mn)
            for j in range(QK):
                L[j] = min(15, _c_int8(F32(F32(F32(xb[j] - mn) * idd) + F32(0.5)))) & 0xFF
        _put_nibbles(L, ob, 4)


@njit(**JIT_QUANT)
def _q5_0_row(x, qw, out):
    L = np.empty(QK, np.int8)
    Laux = np.empty(QK, np.int8)
    w = np.empty(QK, np.float32)
    sigma2 = _row_sigma2(x) if qw.shape[0] else F32(0.0)
    for b in range(x.shape[0] // QK):
        xb = x[b * QK:(b + 1) * QK]
        ob = out[b * 22:(b + 1) * 22]
        if qw.shape[0]:
            _importance(xb, qw[b * QK:(b + 1) * QK], sigma2, w)
            put_fp16(ob, 0, make_qx(xb, 16, L, Laux, w, True))
        else:
            d = F32(_absmax_first(xb) / F32(-16.0))
            idd = F32(F32(1.0) / d) if d != 0 else F32(0.0)
            put_fp16(ob, 0, d)
            for j in range(QK):
                L[j] = min(31, _c_int8(F32(F32(xb[j] * idd) + F32(16.5))))
        _put_q5(L, ob, 2)


@njit(**JIT_QUANT)
def _q5_1_row(x, qw, out):
    L = np.empty(QK, np.uint8)
    Laux = np.empty(QK, np.uint8)
    w = np.empty(QK, np.float32)
    sigma2 = _row_sigma2(x) if qw.shape[0] else F32(0.0)
    for b in range(x.shape[0] // QK):
        xb = x[b * QK:(b + 1) * QK]
        ob = out[b * 24:(b + 1) * 24]
        if qw.shape[0]:
            _importance(xb, qw[b * QK:(b + 1) * QK], sigma2, w)
            d, neg_min = make_qkx(xb, 31, w, L, Laux, F32(-0.9), F32(0.05), 36, False)
            put_fp16(ob, 0, d)
            put_fp16(ob, 2, F32(-neg_min))
        else:
            mn, mx = _min_max(xb)
            d = F32(F32(mx - mn) / F32(31.0))
            idd = F32(F32(1.0) / d) if d != 0 else F32(0.0)
            put_fp16(ob, 0, d)
            put_fp16(ob, 2, mn)
            for j in range(QK):
                L[j] = _c_int8(F32(F32(F32(xb[j] - mn) * idd) + F32(0.5))) & 0xFF
        _put_q5(L, ob, 4)


@njit(**JIT_QUANT)
def _q8_0_row(x, qw, out):
    for b in range(x.shape[0] // QK):
        xb = x[b * QK:(b + 1) * QK]
        ob = out[b * 34:(b + 1) * 34]
        amax = F32(0.0)
        for j in range(QK):
            a = abs(xb[j])
            amax = amax if amax > a else a
        d = F32(amax / F32(127.0))
        idd = F32(F32(1.0) / d) if d != 0 else F32(0.0)
        put_fp16(ob, 0, d)
        for j in range(QK):
            ob[2 + j] = _c_int8(_roundf(F32(xb[j] * idd))) & 0xFF


# one parallel driver per type: Numba compiles (and caches) only the types a run uses; x is float32
# rows or an F16 base's uint16 bits (row_f32); one prange iteration per thread, rows claimed in chunks
# (quantizers_k.claim_rows)


@njit(**JIT_QUANT_PARALLEL)
def _q4_0_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q4_0_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


@njit(**JIT_QUANT_PARALLEL)
def _q4_1_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q4_1_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


@njit(**JIT_QUANT_PARALLEL)
def _q5_0_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q5_0_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


@njit(**JIT_QUANT_PARALLEL)
def _q5_1_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q5_1_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


@njit(**JIT_QUANT_PARALLEL)
def _q8_0_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q8_0_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


# --------------------------------------------------------------------------------------------
# NumPy twins: every block of every row at once, xb float32 [nb, 32]


def _c_int8_np(v: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`_c_int8`."""
    ok = (v > -2147483649.0) & (v < 2147483648.0)
    i = np.where(ok, np.trunc(np.where(ok, v, 0)), -2147483648).astype(np.int64)
    return ((i & 0xFF) ^ 0x80) - 0x80


def _roundf_np(v: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`_roundf`."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) >= F32(0.5), t + np.where(v > 0, F32(1.0), F32(-1.0)), t)


def _fp16_bytes_np(v: np.ndarray) -> np.ndarray:
    """float32 [nb] -> uint8 [nb, 2], little-endian fp16."""
    return fp16_np(v)[0].astype("<u2").view(np.uint8).reshape(-1, 2)


def _nibbles_np(L: np.ndarray) -> np.ndarray:
    L = L.astype(np.int64) & 0xFF
    return ((L[:, :16] | (L[:, 16:] << 4)) & 0xFF).astype(np.uint8)


def _q5_np(L: np.ndarray) -> np.ndarray:
    """Quants [nb, 32] in 0..31 -> ``qh[4] qs[16]`` uint8 [nb, 20]."""
    L = L.astype(np.int64) & 0xFF
    qh = (((L >> 4) & 1) << np.arange(QK)).sum(axis=1)
    qh_bytes = ((qh[:, None] >> (8 * np.arange(4))) & 0xFF).astype(np.uint8)
    return np.concatenate([qh_bytes, _nibbles_np(L & 0x0F)], axis=1)


def _scan_min_max_np(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first minimum and maximum found scanning in order (the sign of a zero matters: Q4_1's
    ``m`` keeps it)."""
    mn = np.full(xb.shape[0], np.finfo(np.float32).max, np.float32)
    mx = -mn
    for j in range(xb.shape[1]):
        mn = np.where(xb[:, j] < mn, xb[:, j], mn)
        mx = np.where(xb[:, j] > mx, xb[:, j], mx)
    return mn, mx


def _importance_np(x: np.ndarray, qw: np.ndarray, sigma2: np.ndarray, block: int) -> np.ndarray:
    """Per-block importance weights ``qw * sqrt(sigma2 + x^2)``: x float32 [n_rows, n], qw [n],
    sigma2 float32 [n_rows] -> float32 [n_rows * n / block, block]."""
    w = qw[None, :] * np.sqrt(sigma2[:, None] + x * x)
    return w.astype(np.float32).reshape(-1, block)


def _row_sigma2_np(x: np.ndarray) -> np.ndarray:
    s = np.zeros(x.shape[0], np.float32)
    for j in range(x.shape[1]):
        s += x[:, j] * x[:, j]
    return s / F32(x.shape[1])


def _inverse(d: np.ndarray) -> np.ndarray:
    return np.where(d != 0, F32(1.0) / d, F32(0.0)).astype(np.float32)


def _q4_0_np(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    xb = x.reshape(-1, QK)
    if qw is not None:
        d, L = make_qx_np(xb, 8, _importance_np(x, qw, _row_sigma2_np(x), QK))
    else:
        d = qk.first_absmax_np(xb) / F32(-8.0)
        L = np.minimum(15, _c_int8_np(xb * _inverse(d)[:, None] + F32(8.5)))
    return np.concatenate([_fp16_bytes_np(d), _nibbles_np(L)], axis=1)


def _q4_1_np(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    xb = x.reshape(-1, QK)
    if qw is not None:
        d, neg_min, L = make_qkx_np(xb, 15, _importance_np(x, qw, _row_sigma2_np(x), QK), -0.9, 0.05, 36, False)
        m = -neg_min
    else:
        m, mx = _scan_min_max_np(xb)
        d = (mx - m) / F32(15.0)
        L = np.minimum(15, _c_int8_np((xb - m[:, None]) * _inverse(d)[:, None] + F32(0.5)))
    return np.concatenate([_fp16_bytes_np(d), _fp16_bytes_np(m), _nibbles_np(L)], axis=1)


def _q5_0_np(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    xb = x.reshape(-1, QK)
    if qw is not None:
        d, L = make_qx_np(xb, 16, _importance_np(x, qw, _row_sigma2_np(x), QK))
    else:
        d = qk.first_absmax_np(xb) / F32(-16.0)
        L = np.minimum(31, _c_int8_np(xb * _inverse(d)[:, None] + F32(16.5)))
    return np.concatenate([_fp16_bytes_np(d), _q5_np(L)], axis=1)


def _q5_1_np(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    xb = x.reshape(-1, QK)
    if qw is not None:
        d, neg_min, L = make_qkx_np(xb, 31, _importance_np(x, qw, _row_sigma2_np(x), QK), -0.9, 0.05, 36, False)
        m = -neg_min
    else:
        m, mx = _scan_min_max_np(xb)
        d = (mx - m) / F32(31.0)
        L = _c_int8_np((xb - m[:, None]) * _inverse(d)[:, None] + F32(0.5))
    return np.concatenate([_fp16_bytes_np(d), _fp16_bytes_np(m), _q5_np(L)], axis=1)


def _q8_0_np(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    xb = x.reshape(-1, QK)
    amax = np.zeros(xb.shape[0], np.float32)
    for j in range(QK):                                  # ggml's MAX(amax, |v|), NaN included
        a = np.abs(xb[:, j])
        amax = np.where(amax > a, amax, a)
    d = amax / F32(127.0)
    q = _c_int8_np(_roundf_np(xb * _inverse(d)[:, None]))
    return np.concatenate([_fp16_bytes_np(d), (q & 0xFF).astype(np.uint8)], axis=1)


_KERNELS = {
    T.Q4_0: (_q4_0_rows, _q4_0_np), T.Q4_1: (_q4_1_rows, _q4_1_np),
    T.Q5_0: (_q5_0_rows, _q5_0_np), T.Q5_1: (_q5_1_rows, _q5_1_np),
    T.Q8_0: (_q8_0_rows, _q8_0_np),
}
_KERNELS.update(qk.KERNELS)
_KERNELS.update(mxfp4.kernels(T.MXFP4))

QUANTIZABLE = tuple(_KERNELS)
"""The GGML types :func:`quantize_rows` writes."""


def _checked(ggml_type, x, imatrix, keep_f16: bool = False):
    """(type, x float32 C-contiguous [n_rows, n] (float16 kept with ``keep_f16``), imatrix float32 [n]
    or None, block weights, block bytes)."""
    try:
        t = T(int(ggml_type))
    except (ValueError, TypeError):
        raise ValueError(f"cannot quantize to GGML type {ggml_type!r}: not a GGML type") from None
    if t not in _KERNELS:
        names = ", ".join(k.name for k in _KERNELS)
        raise ValueError(f"cannot quantize to {t.name}: the quantizers write {names}")
    block, nbytes = gguf.GGML_QUANT_SIZES[t]
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{t.name}: rows must be a 2-D array [n_rows, n_per_row], got shape {x.shape}")
    if x.shape[1] % block:
        raise ValueError(f"{t.name}: n_per_row {x.shape[1]} is not a multiple of its block size {block}")
    x = np.ascontiguousarray(x, dtype=np.float16 if keep_f16 and x.dtype == np.float16 else np.float32)
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (x.shape[1],):
            raise ValueError(f"{t.name}: imatrix shape {imatrix.shape} does not match n_per_row {x.shape[1]}")
    return t, x, imatrix, block, nbytes


def quantize_rows(ggml_type, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize rows as llama.cpp's ``ggml_quantize_chunk`` does, byte for byte (Numba, parallel
    over rows).

    ggml_type: a :class:`gguf.GGMLQuantizationType` (or its int) in :data:`QUANTIZABLE`.
    x: float32 ``[n_rows, n_per_row]`` (float16 is widened row by row inside the threads, exactly;
    other float dtypes are converted first), ``n_per_row`` a multiple of the type's block (32, or
    256 for the K types). imatrix: float32 ``[n_per_row]``
    importance per column (``llama-imatrix``'s mean squared activations) or None; Q8_0 and MXFP4 ignore it.
    Returns uint8 ``[n_rows, n_per_row / block * block_bytes]``: the GGUF tensor data.
    Raises ValueError for another type, a shape that is not 2-D or not a multiple of the
    block, or an imatrix of another length.
    """
    t, x, imatrix, block, nbytes = _checked(ggml_type, x, imatrix, keep_f16=True)
    out = np.empty((x.shape[0], x.shape[1] // block * nbytes), np.uint8)
    qw = np.empty(0, np.float32) if imatrix is None else imatrix
    _KERNELS[t][0](x.view(np.uint16) if x.dtype == np.float16 else x, qw, out, numba.get_num_threads())
    return out


def quantize_rows_np(ggml_type, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`quantize_rows` (same arguments, same bytes, same errors)."""
    t, x, imatrix, block, nbytes = _checked(ggml_type, x, imatrix)
    if x.shape[0] == 0:
        return np.empty((0, x.shape[1] // block * nbytes), np.uint8)
    qw = None if imatrix is None or t == T.Q8_0 else imatrix
    with np.errstate(all="ignore"):     # ggml's arithmetic meets inf and NaN on denormal or huge blocks
        return _KERNELS[t][1](x, qw).reshape(x.shape[0], x.shape[1] // block * nbytes)


def for_type(ggml_type) -> dict:
    """``{"quantize": ..., "quantize_np": ...}``: :func:`quantize_rows` and its twin bound to
    ``ggml_type``, for the type's :class:`~llamatrace.kernels.types.registry.QuantType` declaration
    (``quantize(x, imatrix=None)``). Raises ValueError for a type not in :data:`QUANTIZABLE`."""
    t = T(int(ggml_type))
    if t not in _KERNELS:
        raise ValueError(f"no quantizer writes {t.name}")
    return {"quantize": partial(quantize_rows, t), "quantize_np": partial(quantize_rows_np, t)}
