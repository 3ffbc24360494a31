"""llama.cpp's K-quant quantizers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the scale searches they
share with the legacy types' importance-weighted paths (:mod:`llamatrace.kernels.quantizers`).

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
sums run in element order, without fastmath (:data:`~llamatrace.kernels.jit.JIT_EXACT`):
one changed rounding moves a quant. :func:`nearest_int` is ggml's: add 1.5 * 2**23 and read the
low mantissa bits, half to even, and for inf and NaN (denormal blocks make ``1/(max-min)``
infinite) what llama.cpp's release build computes. fp16 scales round to nearest even
(:func:`fp16_bits`, ggml's ``GGML_FP32_TO_FP16``).

Each Numba function has a NumPy twin (``*_np``) computing every block at once, looping only
over the elements of a sub-block, where ggml's sums are sequential.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.kernels.jit import F16_TABLE, JIT_EXACT, JIT_EXACT_PARALLEL

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


@njit(**JIT_EXACT, inline="always")
def nearest_int(v):
    """ggml's ``nearest_int`` of a float32: round half to even for |v| < 2**22; inf gives
    -4194304 and NaN 0, as the release build's bit trick does."""
    return (f32_bits(F32(v + _ROUND_MAGIC)) & 0x7FFFFF) - 0x400000


@njit(**JIT_EXACT)
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


@njit(**JIT_EXACT, inline="always")
def put_fp16(out, at, v):
    """Write float32 ``v`` as little-endian fp16 at ``out[at:at+2]``; returns the fp16's value
    (float32), which ggml reads back where it goes on with the rounded scale."""
    h = fp16_bits(v)
    out[at] = h & 0xFF
    out[at + 1] = h >> 8
    return F16_TABLE[h]


@njit(**JIT_EXACT)
def make_qx(x, nmax, L, w, use_w):
    """ggml's ``make_qx_quants`` with ``rmse_type`` 1: signed quants ``L`` (int8, stored as
    ``l + nmax`` in 0..2*nmax-1) of float32 ``x [n]`` and their scale, searched over 19 trial
    scales for the least weighted squared error; weights ``w [n]`` if ``use_w`` else ``x^2``.
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
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nearest_int(F32(iscale * x[i]))))
            wi = w[i] if use_w else F32(x[i] * x[i])
            fl = F32(l)
            sumlx = F32(sumlx + F32(F32(wi * x[i]) * fl))
            suml2 = F32(suml2 + F32(F32(wi * fl) * fl))
        if suml2 > 0 and F32(sumlx * sumlx) > F32(best * suml2):
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(F32(iscale * x[i]))))
            scale = F32(sumlx / suml2)
            best = F32(scale * sumlx)
    return scale


@njit(**JIT_EXACT)
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
        for i in range(n):
            l = max(0, min(nmax, nearest_int(F32(iscale * F32(x[i] - mn)))))
            Laux[i] = l
            fl = F32(l)
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


# --------------------------------------------------------------------------------------------
# NumPy twins of the helpers: x [nb, n] float32, one row per sub-block


def nearest_int_np(v: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`nearest_int`: float32 array -> int64 array."""
    with np.errstate(invalid="ignore", over="ignore"):
        bits = (np.asarray(v, np.float32) + _ROUND_MAGIC).view(np.int32)
    return ((bits & 0x7FFFFF) - 0x400000).astype(np.int64)


def fp16_np(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of :func:`fp16_bits` and :func:`fp16_value`: float32 array -> (uint16 bits,
    float32 value). NumPy's float16 cast rounds to nearest even, as ggml does."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = np.asarray(v, np.float32).astype(np.float16)
    return h.view(np.uint16), h.astype(np.float32)


def first_absmax_np(x: np.ndarray) -> np.ndarray:
    """The first element of largest |x| in each row (ggml's ``if (ax > amax)`` scan), float32 [nb]."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)[:, 0]


def make_qx_np(x: np.ndarray, nmax: int, w: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of :func:`make_qx`: x float32 [nb, n], w float32 [nb, n] or None (x^2) ->
    (scale float32 [nb], L int8 [nb, n])."""
    nb, n = x.shape
    w = x * x if w is None else w
    mx = first_absmax_np(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    fnmax = F32(nmax)

    def trial(iscale):
        with np.errstate(invalid="ignore", over="ignore"):
            l = np.clip(nearest_int_np(iscale[:, None] * x), -nmax, nmax - 1)
        fl = l.astype(np.float32)
        sumlx = np.zeros(nb, np.float32)
        suml2 = np.zeros(nb, np.float32)
        for i in range(n):
            sumlx += (w[:, i] * x[:, i]) * fl[:, i]
            suml2 += (w[:, i] * fl[:, i]) * fl[:, i]
        return l, sumlx, suml2

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
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
    flat = ~(mx > mn)
    fnmax = F32(nmax)

    def error(scale, mn, L):
        err = np.zeros(nb, np.float32)
        for i in range(n):
            diff = (scale * L[:, i].astype(np.float32) + mn) - x[:, i]
            err += w[:, i] * (np.abs(diff) if use_mad else diff * diff)
        return err

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
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


KERNELS: dict = {}
"""GGML type -> (Numba rows kernel ``(x, qw, out)``, NumPy twin ``(x, qw | None) -> bytes``)."""
