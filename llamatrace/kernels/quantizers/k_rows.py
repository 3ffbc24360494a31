"""llama.cpp's K-quant quantizers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the scale searches they
share with the legacy types' importance-weighted paths (:mod:`llamatrace.kernels.quantizers.rows`).

Written from the algorithm of ggml's ``ggml-quants.c`` (llama-cpp-python 0.3.36's vendored
llama.cpp), byte for byte what it writes:

- without an importance matrix ``quantize_q?_K`` runs the reference ``quantize_row_q?_K_ref``
  (:func:`make_qkx` as ``make_qkx2_quants`` for Q2_K/Q4_K/Q5_K, ``make_q3_quants`` for Q3_K,
  :func:`make_qx` for Q6_K, then the block's scales rounded to 4, 6 or 8 bits);
- with one, ``quantize_row_q?_K_impl``: each sub-block's weights are ``imatrix *
  sqrt(sigma2 + x^2)`` (``sigma2`` the block's mean square, times 2 except for Q2_K; Q6_K takes
  the imatrix alone), the sub-block scales are searched with those weights (:func:`make_qkx`
  as ``make_qkx3_quants``, :func:`make_qx`) and the block's scales are themselves quantized by a
  weighted search (:func:`make_qp`, Q3_K by :func:`make_qx`).

Rounding. Every step is float32 arithmetic in ggml's order (``w*x*l`` is ``(w*x)*float(l)``),
sums run in element order, without fastmath and with IEEE division (:data:`JIT_QUANT`): one
changed rounding moves a quant. :func:`nearest_int` is ggml's: add 1.5 * 2**23 and read the
low mantissa bits, half to even, and for inf and NaN (denormal blocks make ``1/(max-min)``
infinite) what llama.cpp's release build computes. fp16 scales round to nearest even
(:func:`fp16_bits`, ggml's ``GGML_FP32_TO_FP16``).

Block layouts (256 weights, fp16 little-endian): Q2_K ``scales[16] qs[64] d dmin`` (84 bytes;
a scale byte holds the sub-block's 4-bit scale low, its min high), Q3_K ``hmask[32] qs[64]
scales[12] d`` (110), Q4_K ``d dmin scales[12] qs[128]`` (144), Q5_K ``d dmin scales[12] qh[32]
qs[128]`` (176), Q6_K ``ql[128] qh[64] scales[16] d`` (210, int8 scales).

Each Numba function has a NumPy twin (``*_np``) computing every block at once, looping only
over the elements of a sub-block, where ggml's sums are sequential. The twins meet inf and NaN
where ggml does: :func:`~llamatrace.kernels.quantizers.rows.quantize_rows_np` runs them under
``np.errstate(all="ignore")``.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from llamatrace.machine.jit import F16_TABLE, JIT_QUANT, JIT_QUANT_PARALLEL, f16


QK_K = 256
"""Weights per K-quant super-block."""
F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
"""Below this largest |x| a sub-block is all zero (ggml's ``GROUP_MAX_EPS``)."""
_ROUND_MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round(x) in the low mantissa bits


# --------------------------------------------------------------------------------------------
# scalar helpers (Numba)


@intrinsic
def f32_bits(typingctx, value):
    """The IEEE bits of a float32, as int32 (a bitcast)."""
    if value == types.float32:
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.int32(value), codegen


@njit(**JIT_QUANT, inline="always")
def nearest_int(v):
    """ggml's ``nearest_int`` of a float32: round half to even for |v| < 2**22; inf gives
    -4194304 and NaN 0, as the release build's bit trick does."""
    return (f32_bits(F32(v + _ROUND_MAGIC)) & 0x7FFFFF) - 0x400000


@njit(**JIT_QUANT)
def fp16_bits(v):
    """float32 -> fp16 bits (int in 0..65535), round to nearest even; NaN -> 0x7E00 with its sign,
    as ggml's ``GGML_FP32_TO_FP16``."""
    b = f32_bits(F32(v)) & 0xFFFFFFFF
    sign = (b >> 16) & 0x8000
    exp = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    if exp == 0xFF:
        return sign | (0x7E00 if mant else 0x7C00)
    e = exp - 112                                       # the fp16 exponent field
    if e >= 31:
        return sign | 0x7C00
    if e <= 0:                                          # fp16 subnormal or zero
        if e < -10:
            return sign
        m = mant | 0x800000
        shift = 14 - e
        half = m >> shift
        rem = m & ((1 << shift) - 1)
        mid = 1 << (shift - 1)
        if rem > mid or (rem == mid and (half & 1)):
            half += 1
        return sign | half
    half = (e << 10) | (mant >> 13)
    rem = mant & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (half & 1)):
        half += 1                                       # a carry may reach inf, as it should
    return sign | half


@njit(**JIT_QUANT, inline="always")
def put_fp16(out, at, v):
    """Write float32 ``v`` as little-endian fp16 at ``out[at:at+2]``; returns the fp16's value
    (float32), which ggml reads back where it goes on with the rounded scale."""
    h = fp16_bits(v)
    out[at] = h & 0xFF
    out[at + 1] = h >> 8
    return F16_TABLE[h]


@njit(**JIT_QUANT)
def make_qx(x, nmax, L, Laux, w, use_w):
    """ggml's ``make_qx_quants`` with ``rmse_type`` 1: signed quants ``L`` (int8, stored as
    ``l + nmax`` in 0..2*nmax-1) of float32 ``x [n]`` and their scale, searched over 19 trial
    scales for the least weighted squared error; weights ``w [n]`` if ``use_w`` else ``x^2``;
    ``Laux`` int8 [n] scratch.
    Returns the scale (float32); 0 and all L 0 when max|x| < GROUP_MAX_EPS."""
    n = x.shape[0]
    amax = F32(0.0)
    mx = F32(0.0)
    for i in range(n):
        a = abs(x[i])
        if a > amax:
            amax, mx = a, x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    fnmax = F32(nmax)
    iscale = F32(-fnmax / mx)
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(F32(iscale * x[i]))))
        L[i] = l + nmax
        wi = w[i] if use_w else F32(x[i] * x[i])
        fl = F32(l)
        sumlx = F32(sumlx + F32(F32(wi * x[i]) * fl))
        suml2 = F32(suml2 + F32(F32(wi * fl) * fl))
    scale = F32(sumlx / suml2) if suml2 != 0 else F32(0.0)
    best = F32(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = F32(F32(-F32(fnmax + F32(F32(0.1) * F32(step)))) / mx)
        sumlx = F32(0.0)
        suml2 = F32(0.0)
        for i in range(n):                              # apart from the sums: LLVM vectorizes it
            Laux[i] = max(-nmax, min(nmax - 1, nearest_int(F32(iscale * x[i]))))
        for i in range(n):
            wi = w[i] if use_w else F32(x[i] * x[i])
            fl = F32(Laux[i])
            sumlx = F32(sumlx + F32(F32(wi * x[i]) * fl))
            suml2 = F32(suml2 + F32(F32(wi * fl) * fl))
        if suml2 > 0 and F32(sumlx * sumlx) > F32(best * suml2):
            for i in range(n):
                L[i] = Laux[i] + nmax
            scale = F32(sumlx / suml2)
            best = F32(scale * sumlx)
    return scale


@njit(**JIT_QUANT)
def make_qkx(x, nmax, w, L, Laux, rmin, rdelta, nstep, use_mad):
    """ggml's ``make_qkx2_quants`` / ``make_qkx3_quants`` (the same with weights given): unsigned
    quants ``L`` (uint8, 0..nmax) of float32 ``x [n]`` with a scale and a minimum, the pair
    fitted by weighted least squares at ``nstep + 1`` trial scales ``(rmin + rdelta*is +
    nmax)/(max - min)``, the one of least weighted error (absolute if ``use_mad``) kept.
    Returns ``(scale, -min)`` float32 (``x ~ scale*L + min``, ``min <= 0``)."""
    n = x.shape[0]
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = F32(sum_w * x[0])
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w = F32(sum_w + w[i])
        sum_x = F32(sum_x + F32(w[i] * x[i]))
    if mn > 0:
        mn = F32(0.0)
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return F32(0.0), F32(-mn)
    fnmax = F32(nmax)
    iscale = F32(fnmax / F32(mx - mn))
    scale = F32(F32(1.0) / iscale)
    best = F32(0.0)
    for i in range(n):
        l = max(0, min(nmax, nearest_int(F32(iscale * F32(x[i] - mn)))))
        L[i] = l
        diff = F32(F32(F32(scale * F32(l)) + mn) - x[i])
        diff = abs(diff) if use_mad else F32(diff * diff)
        best = F32(best + F32(w[i] * diff))
    if nstep < 1:
        return scale, F32(-mn)
    for step in range(nstep + 1):
        iscale = F32(F32(F32(rmin + F32(rdelta * F32(step))) + fnmax) / F32(mx - mn))
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):                              # apart from the sums: LLVM vectorizes it
            Laux[i] = max(0, min(nmax, nearest_int(F32(iscale * F32(x[i] - mn)))))
        for i in range(n):
            fl = F32(Laux[i])
            wl = F32(w[i] * fl)
            sum_l = F32(sum_l + wl)
            sum_l2 = F32(sum_l2 + F32(wl * fl))
            sum_xl = F32(sum_xl + F32(wl * x[i]))
        D = F32(F32(sum_w * sum_l2) - F32(sum_l * sum_l))
        if D > 0:
            this_scale = F32(F32(F32(sum_w * sum_xl) - F32(sum_x * sum_l)) / D)
            this_min = F32(F32(F32(sum_l2 * sum_x) - F32(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = F32(sum_xl / sum_l2)
            err = F32(0.0)
            for i in range(n):
                diff = F32(F32(F32(this_scale * F32(Laux[i])) + this_min) - x[i])
                diff = abs(diff) if use_mad else F32(diff * diff)
                err = F32(err + F32(w[i] * diff))
            if err < best:
                for i in range(n):
                    L[i] = Laux[i]
                best = err
                scale = this_scale
                mn = this_min
    return scale, F32(-mn)


@njit(**JIT_QUANT)
def make_q3(x, nmax, L):
    """ggml's ``make_q3_quants`` with ``do_rmse`` (Q3_K's reference path): signed quants of float32
    ``x [n]`` weighted by ``x^2``, then up to 5 sweeps moving single quants while the weighted
    fit improves. ``L`` int8 gets ``l + nmax``; returns the scale (float32)."""
    n = x.shape[0]
    amax = F32(0.0)
    mx = F32(0.0)
    for i in range(n):
        a = abs(x[i])
        if a > amax:
            amax, mx = a, x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    iscale = F32(F32(-nmax) / mx)
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(F32(iscale * x[i]))))
        L[i] = l
        w = F32(x[i] * x[i])
        sumlx = F32(sumlx + F32(F32(w * x[i]) * F32(l)))
        suml2 = F32(suml2 + F32(F32(w * F32(l)) * F32(l)))
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = F32(x[i] * x[i])
            li = F32(L[i])
            slx = F32(sumlx - F32(F32(w * x[i]) * li))
            if slx > 0:
                sl2 = F32(suml2 - F32(F32(w * li) * li))
                new_l = max(-nmax, min(nmax - 1, nearest_int(F32(F32(x[i] * sl2) / slx))))
                if new_l != L[i]:
                    slx = F32(slx + F32(F32(w * x[i]) * F32(new_l)))
                    sl2 = F32(sl2 + F32(F32(w * F32(new_l)) * F32(new_l)))
                    if sl2 > 0 and F32(F32(slx * slx) * suml2) > F32(F32(sumlx * sumlx) * sl2):
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if not changed:
            break
    for i in range(n):
        L[i] += nmax
    return F32(sumlx / suml2) if suml2 > 0 else F32(0.0)


@njit(**JIT_QUANT)
def make_qp(x, nmax, L, qw):
    """ggml's ``make_qp_quants``: the K types' imatrix path quantizes a block's sub-block scales
    (or mins) ``x [n]`` (>= 0) to 0..nmax with weights ``qw [n]``: 9 trial scales, then sweeps
    as :func:`make_q3`. ``L`` uint8; returns the scale (float32)."""
    n = x.shape[0]
    mx = F32(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    fnmax = F32(nmax)
    iscale = F32(fnmax / mx)
    for i in range(n):
        L[i] = nearest_int(F32(iscale * x[i])) & 0xFF
    scale = F32(F32(1.0) / iscale)
    best = F32(0.0)
    for i in range(n):
        diff = F32(x[i] - F32(scale * F32(L[i])))
        best = F32(best + F32(F32(qw[i] * diff) * diff))
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = F32(F32(F32(F32(0.1) * F32(step)) + fnmax) / mx)
        scale_is = F32(F32(1.0) / iscale_is)
        mse = F32(0.0)
        for i in range(n):
            l = min(nmax, nearest_int(F32(iscale_is * x[i])))
            diff = F32(x[i] - F32(scale_is * F32(l)))
            mse = F32(mse + F32(F32(qw[i] * diff) * diff))
        if mse < best:
            best = mse
            iscale = iscale_is
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = min(nmax, nearest_int(F32(iscale * x[i])))
        L[i] = l & 0xFF
        sumlx = F32(sumlx + F32(F32(qw[i] * x[i]) * F32(l)))
        suml2 = F32(suml2 + F32(F32(qw[i] * F32(l)) * F32(l)))
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = qw[i]
            li = F32(L[i])
            slx = F32(sumlx - F32(F32(w * x[i]) * li))
            sl2 = F32(suml2 - F32(F32(w * li) * li))
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(F32(F32(x[i] * sl2) / slx)))
                if new_l != L[i]:
                    slx = F32(slx + F32(F32(w * x[i]) * F32(new_l)))
                    sl2 = F32(sl2 + F32(F32(w * F32(new_l)) * F32(new_l)))
                    if F32(F32(slx * slx) * suml2) > F32(F32(sumlx * sumlx) * sl2):
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if not changed:
            break
    return F32(sumlx / suml2) if suml2 > 0 else F32(0.0)


# --------------------------------------------------------------------------------------------
# the K types, one super-block of 256 at a time (Numba)


@njit(**JIT_QUANT, inline="always")
def _block_sigma2(x, factor):
    """``factor * sum(x^2) / 256`` summed in order: the imatrix paths' ``sigma2``."""
    s = F32(0.0)
    for j in range(QK_K):
        s = F32(s + F32(x[j] * x[j]))
    return F32(F32(F32(factor) * s) / F32(QK_K))


@njit(**JIT_QUANT, inline="always")
def _weights(x, qw, sigma2, w):
    """``w = qw * sqrt(sigma2 + x^2)``; returns ``sum(w)`` in order."""
    total = F32(0.0)
    for j in range(x.shape[0]):
        w[j] = F32(qw[j] * F32(math.sqrt(F32(sigma2 + F32(x[j] * x[j])))))
        total = F32(total + w[j])
    return total


@njit(**JIT_QUANT, inline="always")
def _pack_2bit(L, ob, at):
    """Four 2-bit quants per byte: byte l of each 32 holds quants l, l+32, l+64, l+96 of a 128."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            ob[at + j // 4 + l] = ((L[j + l] & 3) | ((L[j + l + 32] & 3) << 2)
                                   | ((L[j + l + 64] & 3) << 4) | ((L[j + l + 96] & 3) << 6))


@njit(**JIT_QUANT, inline="always")
def _put_k4_scales(ls, lm, ob, at):
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins (``get_scale_min_k4``'s layout)."""
    for j in range(8):
        a, m = ls[j] & 0xFF, lm[j] & 0xFF
        if j < 4:
            ob[at + j] = a
            ob[at + j + 4] = m
        else:
            ob[at + j + 4] = ((a & 0xF) | ((m & 0xF) << 4)) & 0xFF
            ob[at + j - 4] = (ob[at + j - 4] | ((a >> 4) << 6)) & 0xFF
            ob[at + j] = (ob[at + j] | ((m >> 4) << 6)) & 0xFF


@njit(**JIT_QUANT, inline="always")
def _k4_scale_min(ob, at, j):
    if j < 4:
        return np.int64(ob[at + j]) & 63, np.int64(ob[at + j + 4]) & 63
    lo, hi_d, hi_m = np.int64(ob[at + j + 4]), np.int64(ob[at + j - 4]), np.int64(ob[at + j])
    return (lo & 0xF) | ((hi_d >> 6) << 4), (lo >> 4) | ((hi_m >> 6) << 4)


@njit(**JIT_QUANT, inline="always")
def _requant_k4(x, L, ob, d, dmin, nmax):
    """Q4_K/Q5_K: each sub-block of 32 re-rounded with its 6-bit scale and min as stored."""
    for j in range(8):
        sc, m = _k4_scale_min(ob, 4, j)
        dj = F32(d * F32(sc))
        if dj == 0:
            continue
        dm = F32(dmin * F32(m))
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int(F32(F32(x[32 * j + i] + dm) / dj))))


@njit(**JIT_QUANT, inline="always")
def _put_q3_scales(ls, ob, at):
    """Q3_K's sixteen 6-bit scales (0..63) in 12 bytes: low nibbles in 8, high pairs in 4."""
    for k in range(12):
        ob[at + k] = 0
    for j in range(16):
        l = ls[j]
        if j < 8:
            ob[at + j] = l & 0xF
        else:
            ob[at + j - 8] = (ob[at + j - 8] | ((l & 0xF) << 4)) & 0xFF
        l >>= 4
        ob[at + 8 + j % 4] = (ob[at + 8 + j % 4] | (l << (2 * (j // 4)))) & 0xFF


@njit(**JIT_QUANT, inline="always")
def _finish_q3(x, L, ob, d):
    """Q3_K: re-round with the stored scales, high bits to ``hmask``, low two bits to ``qs``."""
    for j in range(16):
        sc = np.int64(ob[96 + j]) & 0xF if j < 8 else np.int64(ob[96 + j - 8]) >> 4
        sc = (sc | (((np.int64(ob[96 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        dj = F32(d * F32(sc))
        if dj == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, nearest_int(F32(x[16 * j + i] / dj)))) + 4
    for k in range(32):
        ob[k] = 0
    for j in range(QK_K):
        if L[j] > 3:
            ob[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    _pack_2bit(L, ob, 32)


@njit(**JIT_QUANT)
def _q2_k_row(x, qw, out):
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(16, np.uint8)
    w = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    Ls = np.empty(16, np.uint8)
    Lm = np.empty(16, np.uint8)
    for b in range(x.shape[0] // QK_K):
        xb = x[b * QK_K:(b + 1) * QK_K]
        ob = out[b * 84:(b + 1) * 84]
        if qw.shape[0]:
            sigma2 = _block_sigma2(xb, 1.0)
            for j in range(16):
                sw[j] = _weights(xb[16 * j:16 * j + 16], qw[b * QK_K + 16 * j:b * QK_K + 16 * j + 16], sigma2, w)
                scales[j], mins[j] = make_qkx(xb[16 * j:16 * j + 16], 3, w, L[16 * j:16 * j + 16], Laux,
                                              F32(-0.9), F32(0.05), 36, False)
            d = put_fp16(ob, 80, make_qp(scales, 15, Ls, sw))
            dmin = put_fp16(ob, 82, make_qp(mins, 15, Lm, sw))
            for j in range(16):
                ob[j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
        else:
            max_scale = F32(0.0)
            max_min = F32(0.0)
            for j in range(16):
                for i in range(16):
                    w[i] = abs(xb[16 * j + i])
                scales[j], mins[j] = make_qkx(xb[16 * j:16 * j + 16], 3, w, L[16 * j:16 * j + 16], Laux,
                                              F32(-0.5), F32(0.1), 15, True)
                if scales[j] > max_scale:
                    max_scale = scales[j]
                if mins[j] > max_min:
                    max_min = mins[j]
            if max_scale > 0:
                iscale = F32(F32(15.0) / max_scale)
                for j in range(16):
                    ob[j] = nearest_int(F32(iscale * scales[j])) & 0xFF
                d = put_fp16(ob, 80, F32(max_scale / F32(15.0)))
            else:
                for j in range(16):
                    ob[j] = 0
                d = put_fp16(ob, 80, F32(0.0))
            if max_min > 0:
                iscale = F32(F32(15.0) / max_min)
                for j in range(16):
                    ob[j] = (ob[j] | (nearest_int(F32(iscale * mins[j])) << 4)) & 0xFF
                dmin = put_fp16(ob, 82, F32(max_min / F32(15.0)))
            else:
                dmin = put_fp16(ob, 82, F32(0.0))
        for j in range(16):
            dj = F32(d * F32(ob[j] & 0xF))
            if dj == 0:
                continue
            dm = F32(dmin * F32(ob[j] >> 4))
            for i in range(16):
                L[16 * j + i] = max(0, min(3, nearest_int(F32(F32(xb[16 * j + i] + dm) / dj))))
        _pack_2bit(L, ob, 16)


@njit(**JIT_QUANT)
def _q3_k_row(x, qw, out):
    L = np.empty(QK_K, np.int8)
    Laux = np.empty(16, np.int8)
    w = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    Ls = np.empty(16, np.int8)
    for b in range(x.shape[0] // QK_K):
        xb = x[b * QK_K:(b + 1) * QK_K]
        ob = out[b * 110:(b + 1) * 110]
        if qw.shape[0]:
            sigma2 = _block_sigma2(xb, 2.0)
            for j in range(16):
                sw[j] = _weights(xb[16 * j:16 * j + 16], qw[b * QK_K + 16 * j:b * QK_K + 16 * j + 16], sigma2, w)
                scales[j] = make_qx(xb[16 * j:16 * j + 16], 4, L[16 * j:16 * j + 16], Laux, w, True)
            d_block = make_qx(scales, 32, Ls, Laux, sw, True)
            _put_q3_scales(Ls, ob, 96)
            d = put_fp16(ob, 108, d_block)
        else:
            max_scale = F32(0.0)
            amax = F32(0.0)
            for j in range(16):
                scales[j] = make_q3(xb[16 * j:16 * j + 16], 4, L[16 * j:16 * j + 16])
                a = abs(scales[j])
                if a > amax:
                    amax, max_scale = a, scales[j]
            if max_scale != 0:
                iscale = F32(F32(-32.0) / max_scale)
                for j in range(16):
                    l = ((nearest_int(F32(iscale * scales[j])) & 0xFF) ^ 0x80) - 0x80     # int8_t
                    Ls[j] = max(-32, min(31, l)) + 32
                _put_q3_scales(Ls, ob, 96)
                d = put_fp16(ob, 108, F32(F32(1.0) / iscale))
            else:
                for k in range(12):
                    ob[96 + k] = 0
                d = put_fp16(ob, 108, F32(0.0))
        _finish_q3(xb, L, ob, d)


@njit(**JIT_QUANT, inline="always")
def _k4_block(xb, qw_b, ob, nmax, L, Laux, w, scales, mins, sw, Ls, Lm, rmin, rdelta, nstep):
    """The shared part of Q4_K and Q5_K: sub-block scales and mins, the block's 6-bit scales
    (``ob[4:16]``) and fp16 ``d``/``dmin`` (``ob[0:4]``), the re-rounded quants in ``L``."""
    if qw_b.shape[0]:
        sigma2 = _block_sigma2(xb, 2.0)
        for j in range(8):
            sw[j] = _weights(xb[32 * j:32 * j + 32], qw_b[32 * j:32 * j + 32], sigma2, w)
            scales[j], mins[j] = make_qkx(xb[32 * j:32 * j + 32], nmax, w, L[32 * j:32 * j + 32], Laux,
                                          F32(-0.9), F32(0.05), 36, False)
        d_block = make_qp(scales, 63, Ls, sw)
        m_block = make_qp(mins, 63, Lm, sw)
        if nmax == 31:                                   # ggml's Q5_K impl clamps, Q4_K's does not
            for j in range(8):
                Ls[j] = min(63, Ls[j])
                Lm[j] = min(63, Lm[j])
    else:
        max_scale = F32(0.0)
        max_min = F32(0.0)
        for j in range(8):
            s = F32(0.0)
            for i in range(32):
                s = F32(s + F32(xb[32 * j + i] * xb[32 * j + i]))
            av_x = F32(math.sqrt(F32(s / F32(32.0))))
            for i in range(32):
                w[i] = F32(av_x + abs(xb[32 * j + i]))
            scales[j], mins[j] = make_qkx(xb[32 * j:32 * j + 32], nmax, w, L[32 * j:32 * j + 32], Laux,
                                          rmin, rdelta, nstep, False)
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = F32(F32(63.0) / max_scale) if max_scale > 0 else F32(0.0)
        inv_min = F32(F32(63.0) / max_min) if max_min > 0 else F32(0.0)
        for j in range(8):
            Ls[j] = min(63, nearest_int(F32(inv_scale * scales[j])) & 0xFF)
            Lm[j] = min(63, nearest_int(F32(inv_min * mins[j])) & 0xFF)
        d_block = F32(max_scale / F32(63.0))
        m_block = F32(max_min / F32(63.0))
    _put_k4_scales(Ls, Lm, ob, 4)
    d = put_fp16(ob, 0, d_block)
    dmin = put_fp16(ob, 2, m_block)
    _requant_k4(xb, L, ob, d, dmin, nmax)


@njit(**JIT_QUANT)
def _q4_k_row(x, qw, out):
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(32, np.uint8)
    w = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    sw = np.empty(8, np.float32)
    Ls = np.empty(8, np.uint8)
    Lm = np.empty(8, np.uint8)
    for b in range(x.shape[0] // QK_K):
        ob = out[b * 144:(b + 1) * 144]
        _k4_block(x[b * QK_K:(b + 1) * QK_K], qw[b * QK_K:(b + 1) * QK_K], ob, 15, L, Laux, w,
                  scales, mins, sw, Ls, Lm, F32(-1.0), F32(0.1), 20)
        for j in range(0, QK_K, 64):
            for l in range(32):
                ob[16 + j // 2 + l] = (L[j + l] | (L[j + l + 32] << 4)) & 0xFF


@njit(**JIT_QUANT)
def _q5_k_row(x, qw, out):
    L = np.empty(QK_K, np.uint8)
    Laux = np.empty(32, np.uint8)
    w = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    sw = np.empty(8, np.float32)
    Ls = np.empty(8, np.uint8)
    Lm = np.empty(8, np.uint8)
    for b in range(x.shape[0] // QK_K):
        ob = out[b * 176:(b + 1) * 176]
        _k4_block(x[b * QK_K:(b + 1) * QK_K], qw[b * QK_K:(b + 1) * QK_K], ob, 31, L, Laux, w,
                  scales, mins, sw, Ls, Lm, F32(-0.5), F32(0.1), 15)
        for k in range(32):
            ob[16 + k] = 0
        for n in range(0, QK_K, 64):
            m1 = 1 << (n // 32)
            for j in range(32):
                l1 = L[n + j]
                if l1 > 15:
                    l1 -= 16
                    ob[16 + j] |= m1
                l2 = L[n + j + 32]
                if l2 > 15:
                    l2 -= 16
                    ob[16 + j] |= m1 << 1
                ob[48 + n // 2 + j] = (l1 | (l2 << 4)) & 0xFF


@njit(**JIT_QUANT)
def _q6_k_row(x, qw, out):
    L = np.empty(QK_K, np.int8)
    Laux = np.empty(16, np.int8)
    scales = np.empty(16, np.float32)
    for b in range(x.shape[0] // QK_K):
        xb = x[b * QK_K:(b + 1) * QK_K]
        ob = out[b * 210:(b + 1) * 210]
        max_scale = F32(0.0)
        max_abs = F32(0.0)
        for j in range(16):
            scales[j] = make_qx(xb[16 * j:16 * j + 16], 32, L[16 * j:16 * j + 16], Laux,
                                qw[b * QK_K + 16 * j:b * QK_K + 16 * j + 16], qw.shape[0] > 0)
            a = abs(scales[j])
            if a > max_abs:
                max_abs, max_scale = a, scales[j]
        if max_abs < GROUP_MAX_EPS:
            ob[:] = 0
            continue
        iscale = F32(F32(-128.0) / max_scale)
        d = put_fp16(ob, 208, F32(F32(1.0) / iscale))
        for j in range(16):
            ob[192 + j] = min(127, nearest_int(F32(iscale * scales[j]))) & 0xFF
        for j in range(16):
            sc = (np.int64(ob[192 + j]) ^ 0x80) - 0x80                           # int8
            dj = F32(d * F32(sc))
            if dj == 0:
                continue
            for i in range(16):
                L[16 * j + i] = max(-32, min(31, nearest_int(F32(xb[16 * j + i] / dj)))) + 32
        for j in range(0, QK_K, 128):
            for l in range(32):
                q = (L[j + l] & 0xFF, L[j + l + 32] & 0xFF, L[j + l + 64] & 0xFF, L[j + l + 96] & 0xFF)
                ob[j // 2 + l] = ((q[0] & 0xF) | ((q[2] & 0xF) << 4)) & 0xFF
                ob[j // 2 + l + 32] = ((q[1] & 0xF) | ((q[3] & 0xF) << 4)) & 0xFF
                ob[128 + j // 4 + l] = ((q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4)
                                        | ((q[3] >> 4) << 6)) & 0xFF


def row_f32(row):
    """A row of weights as float32 ``[n]``: a float32 row itself, or an F16 base's row (uint16 fp16
    bits) widened exactly into a new array. In the parallel drivers, so each thread widens its own
    rows (an F16 tensor is never converted whole, single-threaded, before quantizing)."""
    return np.asarray(row, np.float32)


@overload(row_f32, inline="always")
def _row_f32(row):
    if row.dtype == types.float32:
        return lambda row: row
    if row.dtype == types.uint16:
        def widen(row):
            out = np.empty(row.shape[0], np.float32)
            for j in range(row.shape[0]):
                out[j] = f16(row[j])
            return out
        return widen


CHUNK_WEIGHTS = 16384
"""Weights a thread claims at a time (whole rows, at least one): llama-quantize's chunk size."""


@intrinsic
def _fetch_add(typingctx, counter, value):
    """Atomically add ``value`` to ``counter[0]`` (int64 ``[1]``) and return what it held."""
    if counter == types.Array(types.int64, 1, "C") and value == types.int64:
        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, signature.args[0], ary,
                                           [context.get_constant(types.intp, 0)])
            return builder.atomic_rmw("add", ptr, args[1], "monotonic")
        return types.int64(counter, value), codegen


@njit(**JIT_QUANT, inline="always")
def claim_rows(counter, n_rows, chunk):
    """The next ``[first, last)`` rows for this thread (``first == last``: none left). Threads claim
    chunks as they finish, as llama-quantize's workers do: a thread the machine runs less does
    fewer rows, instead of the others waiting for it at the end of a static split."""
    first = min(_fetch_add(counter, np.int64(chunk)), n_rows)
    return first, min(first + chunk, n_rows)


@njit(**JIT_QUANT, inline="always")
def row_chunk(n_per_row):
    """Rows a thread claims at a time: :data:`CHUNK_WEIGHTS` weights of rows of ``n_per_row``, at least one."""
    return max(1, CHUNK_WEIGHTS // n_per_row)


# one parallel driver per type: Numba compiles (and caches) only the types a run uses; x is float32
# rows or an F16 base's uint16 bits (row_f32); one prange iteration per thread, rows claimed in chunks


@njit(**JIT_QUANT_PARALLEL)
def _q2_k_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q2_k_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


@njit(**JIT_QUANT_PARALLEL)
def _q3_k_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q3_k_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


@njit(**JIT_QUANT_PARALLEL)
def _q4_k_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q4_k_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


@njit(**JIT_QUANT_PARALLEL)
def _q5_k_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q5_k_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


@njit(**JIT_QUANT_PARALLEL)
def _q6_k_rows(x, qw, out, n_threads):
    counter, chunk = np.zeros(1, np.int64), row_chunk(x.shape[1])
    for _ in prange(n_threads):
        first, last = claim_rows(counter, x.shape[0], chunk)
        while first < last:
            for r in range(first, last):
                _q6_k_row(row_f32(x[r]), qw, out[r])
            first, last = claim_rows(counter, x.shape[0], chunk)


# --------------------------------------------------------------------------------------------
# NumPy twins of the helpers: x [nb, n] float32, one row per sub-block


def nearest_int_np(v: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`nearest_int`: float32 array -> int64 array."""
    bits = (np.asarray(v, np.float32) + _ROUND_MAGIC).view(np.int32)
    return ((bits & 0x7FFFFF) - 0x400000).astype(np.int64)


def fp16_np(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of :func:`fp16_bits` and :func:`fp16_value`: float32 array -> (uint16 bits,
    float32 value). NumPy's float16 cast rounds to nearest even, as ggml does."""
    h = np.asarray(v, np.float32).astype(np.float16)
    return h.view(np.uint16), h.astype(np.float32)


def first_absmax_np(x: np.ndarray) -> np.ndarray:
    """The first element of largest |x| in each row, float32 [nb], as ggml's scan ``if (ax >
    amax)`` from ``amax = max = 0`` finds it: NaN never wins, an all-zero row gives +0."""
    a = np.abs(x)
    a[np.isnan(a)] = -1
    mx = np.take_along_axis(x, a.argmax(axis=1)[:, None], axis=1)[:, 0]
    return np.where(np.abs(mx) > 0, mx, F32(0.0))


def make_qx_np(x: np.ndarray, nmax: int, w: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of :func:`make_qx`: x float32 [nb, n], w float32 [nb, n] or None (x^2) ->
    (scale float32 [nb], L int8 [nb, n])."""
    nb, n = x.shape
    w = x * x if w is None else w
    mx = first_absmax_np(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    fnmax = F32(nmax)

    def trial(iscale):
        l = np.clip(nearest_int_np(iscale[:, None] * x), -nmax, nmax - 1)
        fl = l.astype(np.float32)
        sumlx = np.zeros(nb, np.float32)
        suml2 = np.zeros(nb, np.float32)
        for i in range(n):
            sumlx += (w[:, i] * x[:, i]) * fl[:, i]
            suml2 += (w[:, i] * fl[:, i]) * fl[:, i]
        return l, sumlx, suml2

    l, sumlx, suml2 = trial(-fnmax / mx)
    L = l + nmax
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0.0)).astype(np.float32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l, sumlx, suml2 = trial(-(fnmax + F32(0.1) * F32(step)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better[:, None], l + nmax, L)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    L[zero] = 0
    scale[zero] = 0
    return scale.astype(np.float32), L.astype(np.int8)


def make_qkx_np(x: np.ndarray, nmax: int, w: np.ndarray, rmin: float, rdelta: float, nstep: int,
                use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of :func:`make_qkx`: x, w float32 [nb, n] -> (scale float32 [nb], -min float32
    [nb], L uint8 [nb, n])."""
    nb, n = x.shape
    mn = x[:, 0].copy()
    mx = x[:, 0].copy()
    sum_w = w[:, 0].copy()
    sum_x = sum_w * x[:, 0]
    for i in range(1, n):
        mn = np.where(x[:, i] < mn, x[:, i], mn)
        mx = np.where(x[:, i] > mx, x[:, i], mx)
        sum_w += w[:, i]
        sum_x += w[:, i] * x[:, i]
    mn = np.where(mn > 0, F32(0.0), mn)
    flat = mx <= mn                                     # False with NaN, as in ggml
    fnmax = F32(nmax)

    def error(scale, mn, L):
        err = np.zeros(nb, np.float32)
        for i in range(n):
            diff = (scale * L[:, i].astype(np.float32) + mn) - x[:, i]
            err += w[:, i] * (np.abs(diff) if use_mad else diff * diff)
        return err

    iscale = fnmax / (mx - mn)
    scale = F32(1.0) / iscale
    L = np.clip(nearest_int_np(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = error(scale, mn, L)
    for step in range(nstep + 1 if nstep >= 1 else 0):
        iscale = ((F32(rmin) + F32(rdelta) * F32(step)) + fnmax) / (mx - mn)
        Laux = np.clip(nearest_int_np(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        fl = Laux.astype(np.float32)
        sum_l = np.zeros(nb, np.float32)
        sum_l2 = np.zeros(nb, np.float32)
        sum_xl = np.zeros(nb, np.float32)
        for i in range(n):
            wl = w[:, i] * fl[:, i]
            sum_l += wl
            sum_l2 += wl * fl[:, i]
            sum_xl += wl * x[:, i]
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = np.where(pos, F32(0.0), this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        err = error(this_scale, this_min, Laux)
        better = (D > 0) & (err < best)
        L = np.where(better[:, None], Laux, L)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    L[flat] = 0
    scale = np.where(flat, F32(0.0), scale).astype(np.float32)
    return scale, (-mn).astype(np.float32), L.astype(np.uint8)


def scan_max_np(a: np.ndarray) -> np.ndarray:
    """ggml's ``if (v > best) best = v`` from 0 along axis 1 (NaN never wins): float32 [nb]."""
    best = np.zeros(a.shape[0], np.float32)
    for j in range(a.shape[1]):
        best = np.where(a[:, j] > best, a[:, j], best)
    return best


def seq_sum_np(a: np.ndarray) -> np.ndarray:
    """Sum along the last axis in element order, float32 (ggml's loops; NumPy's sum is pairwise)."""
    total = np.zeros(a.shape[:-1], np.float32)
    for j in range(a.shape[-1]):
        total += a[..., j]
    return total


def make_q3_np(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of :func:`make_q3`: x float32 [nb, n] -> (scale float32 [nb], L int64 [nb, n])."""
    nb, n = x.shape
    mx = first_absmax_np(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    w = x * x
    L = np.clip(nearest_int_np((F32(-nmax) / mx)[:, None] * x), -nmax, nmax - 1)
    fl = L.astype(np.float32)
    sumlx = seq_sum_np((w * x) * fl)
    suml2 = seq_sum_np((w * fl) * fl)
    active = np.ones(nb, bool)
    for _ in range(5):
        changed = np.zeros(nb, bool)
        for i in range(n):
            li = L[:, i].astype(np.float32)
            wx = w[:, i] * x[:, i]
            slx = sumlx - wx * li
            sl2 = suml2 - (w[:, i] * li) * li
            new_l = np.clip(nearest_int_np((x[:, i] * sl2) / slx), -nmax, nmax - 1)
            fn = new_l.astype(np.float32)
            slx = slx + wx * fn
            sl2 = sl2 + (w[:, i] * fn) * fn
            take = (active & (sumlx - wx * li > 0) & (new_l != L[:, i]) & (sl2 > 0)
                    & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2))
            L[:, i] = np.where(take, new_l, L[:, i])
            sumlx = np.where(take, slx, sumlx)
            suml2 = np.where(take, sl2, suml2)
            changed |= take
        active &= changed
        if not active.any():
            break
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0.0)).astype(np.float32)
    L = L + nmax
    L[zero] = 0
    scale[zero] = 0
    return scale, L


def make_qp_np(x: np.ndarray, nmax: int, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of :func:`make_qp`: x, qw float32 [nb, n] -> (scale float32 [nb], L int64
    [nb, n] in 0..255, as ggml's uint8)."""
    nb, n = x.shape
    mx = np.zeros(nb, np.float32)
    for i in range(n):
        mx = np.where(mx > x[:, i], mx, x[:, i])
    zero = mx < GROUP_MAX_EPS
    fnmax = F32(nmax)
    iscale = fnmax / mx
    L = nearest_int_np(iscale[:, None] * x) & 0xFF
    scale = F32(1.0) / iscale
    diff = x - scale[:, None] * L.astype(np.float32)
    best = seq_sum_np((qw * diff) * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + fnmax) / mx
        scale_is = F32(1.0) / iscale_is
        l = np.minimum(nmax, nearest_int_np(iscale_is[:, None] * x))
        diff = x - scale_is[:, None] * l.astype(np.float32)
        mse = seq_sum_np((qw * diff) * diff)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, iscale_is, iscale)
    l = np.minimum(nmax, nearest_int_np(iscale[:, None] * x))
    L = l & 0xFF
    fl = l.astype(np.float32)
    sumlx = seq_sum_np((qw * x) * fl)
    suml2 = seq_sum_np((qw * fl) * fl)
    active = np.ones(nb, bool)
    for _ in range(5):
        changed = np.zeros(nb, bool)
        for i in range(n):
            li = L[:, i].astype(np.float32)
            wx = qw[:, i] * x[:, i]
            slx = sumlx - wx * li
            sl2 = suml2 - (qw[:, i] * li) * li
            new_l = np.minimum(nmax, nearest_int_np((x[:, i] * sl2) / slx))
            fn = new_l.astype(np.float32)
            slx2 = slx + wx * fn
            sl22 = sl2 + (qw[:, i] * fn) * fn
            take = (active & (slx > 0) & (sl2 > 0) & (new_l != L[:, i])
                    & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22))
            L[:, i] = np.where(take, new_l & 0xFF, L[:, i])
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        active &= changed
        if not active.any():
            break
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0.0)).astype(np.float32)
    L[zero] = 0
    scale[zero] = 0
    return scale, L


# --------------------------------------------------------------------------------------------
# NumPy twins of the K types: xb float32 [NB, 256] (every super-block of every row), qw the
# imatrix tiled to the same shape or None


def _fp16_np_bytes(h: np.ndarray) -> np.ndarray:
    return h.astype("<u2").view(np.uint8).reshape(-1, 2)


def _importance_np(xb, qw, sigma2):
    return (qw * np.sqrt(sigma2[:, None] + xb * xb)).astype(np.float32)


def _pack_2bit_np(L: np.ndarray) -> np.ndarray:
    q = (L & 3).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64).astype(np.uint8)


def _q2_k_np(xb: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    nb = xb.shape[0]
    x16 = xb.reshape(-1, 16)
    if qw is not None:
        w = _importance_np(xb, qw, seq_sum_np(xb * xb) / F32(QK_K)).reshape(-1, 16)
        scales, mins, L = make_qkx_np(x16, 3, w, -0.9, 0.05, 36, False)
        sw = seq_sum_np(w).reshape(nb, 16)
        dm, Ls = make_qp_np(scales.reshape(nb, 16), 15, sw)
        mm, Lm = make_qp_np(mins.reshape(nb, 16), 15, sw)
        sc = (Ls | (Lm << 4)) & 0xFF
    else:
        scales, mins, L = make_qkx_np(x16, 3, np.abs(x16), -0.5, 0.1, 15, True)
        scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
        max_scale, max_min = scan_max_np(scales), scan_max_np(mins)
        ls = nearest_int_np((F32(15.0) / max_scale)[:, None] * scales) & 0xFF
        lm = nearest_int_np((F32(15.0) / max_min)[:, None] * mins)
        sc = np.where((max_scale > 0)[:, None], ls, 0)
        sc = np.where((max_min > 0)[:, None], (sc | (lm << 4)) & 0xFF, sc)
        dm = np.where(max_scale > 0, max_scale / F32(15.0), F32(0.0))
        mm = np.where(max_min > 0, max_min / F32(15.0), F32(0.0))
    (dh, d), (mh, dmin) = fp16_np(dm), fp16_np(mm)
    L = L.reshape(nb, 16, 16).astype(np.int64)
    dj = d[:, None] * (sc & 0xF).astype(np.float32)
    dmj = dmin[:, None] * (sc >> 4).astype(np.float32)
    redo = np.clip(nearest_int_np((xb.reshape(nb, 16, 16) + dmj[..., None]) / dj[..., None]), 0, 3)
    L = np.where((dj != 0)[..., None], redo, L).reshape(nb, QK_K)
    return np.concatenate([sc.astype(np.uint8), _pack_2bit_np(L), _fp16_np_bytes(dh), _fp16_np_bytes(mh)], axis=1)


def _q3_scale_bytes_np(Ls: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit scales [nb, 16] -> Q3_K's 12 bytes."""
    low = (Ls[:, :8] & 0xF) | ((Ls[:, 8:] & 0xF) << 4)
    high = (Ls >> 4).reshape(-1, 4, 4)
    packed = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    return np.concatenate([low, packed], axis=1).astype(np.uint8)


def _q3_k_np(xb: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    nb = xb.shape[0]
    x16 = xb.reshape(-1, 16)
    if qw is not None:
        w = _importance_np(xb, qw, (F32(2.0) * seq_sum_np(xb * xb)) / F32(QK_K)).reshape(-1, 16)
        scales, L = make_qx_np(x16, 4, w)
        d_block, Ls = make_qx_np(scales.reshape(nb, 16), 32, seq_sum_np(w).reshape(nb, 16))
        Ls = Ls.astype(np.int64)
    else:
        scales, L = make_q3_np(x16, 4)
        scales = scales.reshape(nb, 16)
        max_scale = first_absmax_np(scales)
        nz = max_scale != 0
        iscale = F32(-32.0) / max_scale
        l = ((nearest_int_np(iscale[:, None] * scales) & 0xFF) ^ 0x80) - 0x80       # int8_t
        d_block = np.where(nz, F32(1.0) / iscale, F32(0.0))
        Ls = np.where(nz[:, None], np.clip(l, -32, 31) + 32, 0)
    dh, d = fp16_np(d_block)
    L = L.reshape(nb, 16, 16).astype(np.int64)
    dj = d[:, None] * (Ls - 32).astype(np.float32)
    redo = np.clip(nearest_int_np(xb.reshape(nb, 16, 16) / dj[..., None]), -4, 3) + 4
    L = np.where((dj != 0)[..., None], redo, L).reshape(nb, QK_K)
    high = L > 3
    L = np.where(high, L - 4, L)
    hmask = (high.reshape(nb, 8, 32).astype(np.int64) << np.arange(8)[None, :, None]).sum(axis=1)
    return np.concatenate([hmask.astype(np.uint8), _pack_2bit_np(L), _q3_scale_bytes_np(Ls),
                           _fp16_np_bytes(dh)], axis=1)


def _k4_np(xb: np.ndarray, qw: np.ndarray | None, nmax: int, rmin: float, rdelta: float,
           nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """The shared part of Q4_K and Q5_K (:func:`_k4_block`): -> (``d dmin scales[12]`` uint8
    [NB, 16], quants int64 [NB, 256])."""
    nb = xb.shape[0]
    x32 = xb.reshape(-1, 32)
    if qw is not None:
        w = _importance_np(xb, qw, (F32(2.0) * seq_sum_np(xb * xb)) / F32(QK_K)).reshape(-1, 32)
        scales, mins, L = make_qkx_np(x32, nmax, w, -0.9, 0.05, 36, False)
        sw = seq_sum_np(w).reshape(nb, 8)
        d_block, Ls = make_qp_np(scales.reshape(nb, 8), 63, sw)
        m_block, Lm = make_qp_np(mins.reshape(nb, 8), 63, sw)
        if nmax == 31:
            Ls, Lm = np.minimum(63, Ls), np.minimum(63, Lm)
    else:
        av_x = np.sqrt(seq_sum_np(x32 * x32) / F32(32.0))
        scales, mins, L = make_qkx_np(x32, nmax, av_x[:, None] + np.abs(x32), rmin, rdelta, nstep, False)
        scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
        max_scale, max_min = scan_max_np(scales), scan_max_np(mins)
        inv_scale = np.where(max_scale > 0, F32(63.0) / max_scale, F32(0.0))
        inv_min = np.where(max_min > 0, F32(63.0) / max_min, F32(0.0))
        Ls = np.minimum(63, nearest_int_np(inv_scale[:, None] * scales) & 0xFF)
        Lm = np.minimum(63, nearest_int_np(inv_min[:, None] * mins) & 0xFF)
        d_block, m_block = max_scale / F32(63.0), max_min / F32(63.0)
    Ls, Lm = Ls & 0xFF, Lm & 0xFF
    b = np.zeros((nb, 12), np.int64)
    b[:, 0:4], b[:, 4:8] = Ls[:, :4], Lm[:, :4]
    b[:, 8:12] = (Ls[:, 4:] & 0xF) | ((Lm[:, 4:] & 0xF) << 4)
    b[:, 0:4] |= (Ls[:, 4:] >> 4) << 6
    b[:, 4:8] |= (Lm[:, 4:] >> 4) << 6
    b &= 0xFF
    sc = np.concatenate([b[:, 0:4] & 63, (b[:, 8:12] & 0xF) | ((b[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([b[:, 4:8] & 63, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], axis=1)
    (dh, d), (mh, dmin) = fp16_np(d_block), fp16_np(m_block)
    dj = d[:, None] * sc.astype(np.float32)
    dmj = dmin[:, None] * mn.astype(np.float32)
    redo = np.clip(nearest_int_np((xb.reshape(nb, 8, 32) + dmj[..., None]) / dj[..., None]), 0, nmax)
    L = np.where((dj != 0)[..., None], redo, L.reshape(nb, 8, 32).astype(np.int64)).reshape(nb, QK_K)
    head = np.concatenate([_fp16_np_bytes(dh), _fp16_np_bytes(mh), b.astype(np.uint8)], axis=1)
    return head, L


def _q4_k_np(xb: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    head, L = _k4_np(xb, qw, 15, -1.0, 0.1, 20)
    q = L.reshape(-1, 4, 2, 32)
    return np.concatenate([head, (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)], axis=1)


def _q5_k_np(xb: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    head, L = _k4_np(xb, qw, 31, -0.5, 0.1, 15)
    q = L.reshape(-1, 4, 2, 32)
    shifts = 2 * np.arange(4)[None, :, None]
    qh = (((q[:, :, 0] >> 4) << shifts) | ((q[:, :, 1] >> 4) << (shifts + 1))).sum(axis=1)
    ql = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    return np.concatenate([head, qh.astype(np.uint8), ql.astype(np.uint8)], axis=1)


def _q6_k_np(xb: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    nb = xb.shape[0]
    scales, L = make_qx_np(xb.reshape(-1, 16), 32, None if qw is None else qw.reshape(-1, 16))
    scales = scales.reshape(nb, 16)
    max_scale = first_absmax_np(scales)
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = F32(-128.0) / max_scale
    dh, d = fp16_np(F32(1.0) / iscale)
    sc = np.minimum(127, nearest_int_np(iscale[:, None] * scales)) & 0xFF
    dj = d[:, None] * ((sc ^ 0x80) - 0x80).astype(np.float32)
    redo = np.clip(nearest_int_np(xb.reshape(nb, 16, 16) / dj[..., None]), -32, 31) + 32
    L = np.where((dj != 0)[..., None], redo, L.reshape(nb, 16, 16).astype(np.int64)).reshape(nb, 2, 4, 32)
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    out = np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8), sc.astype(np.uint8), _fp16_np_bytes(dh)], axis=1)
    out[zero] = 0
    return out


def _super_blocks(fn):
    """Adapt a twin on super-blocks to the rows interface: (x [n_rows, n], imatrix [n] | None)."""
    def rows(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        xb = x.reshape(-1, QK_K)
        tiled = None if qw is None else np.tile(qw.reshape(-1, QK_K), (x.shape[0], 1))
        return fn(xb, tiled)
    return rows


_T = gguf.GGMLQuantizationType
KERNELS = {
    _T.Q2_K: (_q2_k_rows, _super_blocks(_q2_k_np)), _T.Q3_K: (_q3_k_rows, _super_blocks(_q3_k_np)),
    _T.Q4_K: (_q4_k_rows, _super_blocks(_q4_k_np)), _T.Q5_K: (_q5_k_rows, _super_blocks(_q5_k_np)),
    _T.Q6_K: (_q6_k_rows, _super_blocks(_q6_k_np)),
}
"""GGML type -> (Numba rows kernel ``(x, qw, out, n_threads)``, NumPy twin ``(x, qw | None) -> bytes``)."""
