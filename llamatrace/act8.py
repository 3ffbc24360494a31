"""8-bit activations: the optional ``--activations q8`` mode for Q4_0, Q4_1 and Q8_0 weights.

llamatrace's default arithmetic is float32 activations times dequantized weights (matching HF
transformers fp32 to ~1e-5). llama.cpp instead quantizes each activation row to 8 bits and
multiplies integers (ggml-cpu ``quantize_row_q8_0`` and ``ggml_vec_dot_q4_0_q8_0``); this
module does the same, beside the float32 path and never instead of it:

1. Each block of 32 activations becomes ``xd * xq`` with ``xd = max|x| / 127`` (float32) and
   ``xq = round(x / xd)`` int8 in -127..127, rounded half away from zero: gguf-py's
   ``quants.Q8_0`` quantization (which is ggml's), except that ``xd`` stays float32 instead of
   being rounded to float16.
2. Per block and weight row, the integer dot product ``isum = sum_j q[j] * xq[j]`` is exact in
   int32, and ``y += (d * xd) * isum + m_scale * m * (xd * sum_j xq[j])`` in float32, with
   the weight ``d * q + m_scale * m`` as in :mod:`llamatrace.quant` (Q4_0: ``q`` in 0..15,
   ``m = d``, ``m_scale = -8``; Q4_1: ``m_scale = 1``; Q8_0: ``q`` int8, no offset).

The error is that of rounding x to 8 bits, about 1e-2 relative per matmul, as in llama.cpp
(``llamatrace compare`` shows it stage by stage); the integer part adds none.

Layout. A dot product of bytes needs the bytes of one row side by side, so weights in this
mode are repacked from the float32 path's ``qs[t, b, j, r]`` into groups of four bytes per
row, ``qs[t, b, g, r, i] = byte 4g + i`` of row ``t*TR + r`` (Q4: ``uint8 [T, B, 4, TR, 4]``,
where byte ``4g + i`` holds weight ``4g + i`` in its low nibble and ``16 + 4g + i`` in its high
nibble; Q8_0: ``int8 [T, B, 8, TR, 4]``). The same bytes as the float32 layout, reordered.

Kernels. x86 ``pmaddubsw`` multiplies 32 unsigned bytes by 32 signed bytes and adds adjacent
pairs to int16, ``pmaddwd`` adds pairs of int16 to int32: with four bytes of a row per 32-bit
lane, one register holds 8 rows and each row's four products end up in its own lane. Numba
types integer arithmetic as int64, so the block dot products are written in LLVM IR
(:func:`_isum_q4`, :func:`_isum_q8`) with the AVX2 intrinsics; this mode needs AVX2
(:func:`available`). Overflow bounds: a Q4 pair is at most 2 * 15 * 127 = 3810 and the 8 pairs
of a block summed in int16 at most 30480 < 32767; a Q8_0 pair uses ``|q|`` (<= 128) times
``sign(q) * xq`` (<= 127), at most 32512, and goes to int32 at once.

Each Numba kernel has a NumPy twin (``*_np``) that tests compare it with.
"""

from __future__ import annotations

import gguf
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace import tiles

_T = gguf.GGMLQuantizationType

TR = tiles.TR
QK = 32

TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q8_0})
"""Weight types with an 8-bit-activation kernel; other types keep float32 activations."""

MODES = ("f32", "q8")
"""Values of ``activations``: float32 (the default, the reference) or 8-bit."""

_GROUPS = {_T.Q4_0: 4, _T.Q4_1: 4, _T.Q8_0: 8}

_FASTMATH = {"contract", "arcp", "afn", "nsz"}
_JIT = dict(cache=True, fastmath=_FASTMATH)
_JIT_PARALLEL = dict(parallel=True, **_JIT)


def available() -> bool:
    """True when this CPU has AVX2, which the 8-bit kernels' instructions need."""
    return bool(llvm_binding.get_host_cpu_features().get("avx2", False))


# --------------------------------------------------------------------------------------------
# layout


def repack(qs: np.ndarray) -> np.ndarray:
    """Float32-path tiles ``[T, B, nq, TR]`` -> this module's ``[T, B, nq/4, TR, 4]`` (a copy)."""
    n_tiles, n_blocks, nq, tr = qs.shape
    return np.ascontiguousarray(qs.reshape(n_tiles, n_blocks, nq // 4, 4, tr).transpose(0, 1, 2, 4, 3))


def unpack_rows(qs: np.ndarray, t: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Bytes of rows ``t*TR + r`` in file order: ``[n, B, nq]`` from ``qs [T, B, nq/4, TR, 4]``."""
    q = qs[t, :, :, r, :]                                   # [n, B, nq/4, 4]
    return q.reshape(q.shape[0], q.shape[1], -1)


# --------------------------------------------------------------------------------------------
# activation quantization


def quantize_np(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of :func:`quantize`: gguf-py's Q8_0 arithmetic, written out."""
    n_seq, n = x.shape
    xb = x.reshape(n_seq, n // QK, QK).astype(np.float32)
    xd = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(xd == 0, np.float32(0), np.float32(1) / xd).astype(np.float32)
    v = xb * inv[:, :, None]
    a = np.abs(v)
    fl = np.floor(a)
    xq = (np.sign(v) * (fl + np.floor(2 * (a - fl)))).astype(np.int8)
    xs = (xd * xq.sum(axis=2, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return xq.reshape(n_seq, n), xd, xs


@njit(cache=True)  # no fastmath: 'arcp' would turn amax / 127 into amax * (1/127), not gguf's rounding
def _quantize(x, xq, xd, xs):
    n_seq, n_blocks = xd.shape
    for s in range(n_seq):
        for b in range(n_blocks):
            amax = np.float32(0.0)
            for j in range(QK):
                a = abs(x[s, b * QK + j])
                if a > amax or a != a:            # a NaN stays: the block's scale is NaN
                    amax = a
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            total = 0
            for j in range(QK):
                v = x[s, b * QK + j] * inv
                a = abs(v)
                fl = np.floor(a)
                q = fl + np.floor(np.float32(2.0) * (a - fl))
                qi = np.int8(min(q, np.float32(127.0))) if q == q else np.int8(0)
                if v < 0:
                    qi = -qi
                xq[s, b * QK + j] = qi
                total += qi
            xd[s, b] = d
            xs[s, b] = d * np.float32(total)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize activation rows to 8 bits per block of 32 (gguf-py's / ggml's Q8_0 rounding).

    x: float32 ``[n_seq, n]``, ``n`` a multiple of 32. Returns ``xq`` int8 ``[n_seq, n]``,
    ``xd`` float32 ``[n_seq, n/32]`` (block scales; ``x ~ xd * xq``) and ``xs`` float32
    ``[n_seq, n/32]`` (``xd * sum(xq)`` per block, for the weights' offsets). A block holding
    NaN gets a NaN scale, so NaN reaches the output as in the float32 path.
    """
    n_seq, n = x.shape
    xq = np.empty((n_seq, n), np.int8)
    xd = np.empty((n_seq, n // QK), np.float32)
    xs = np.empty((n_seq, n // QK), np.float32)
    _quantize(x, xq, xd, xs)
    return xq, xd, xs


# --------------------------------------------------------------------------------------------
# block dot products in LLVM IR


def _ir_types():
    i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
    return i32, i64, ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)


def _block_ir(builder, args, sig, context, groups: int, nibbles: bool) -> None:
    """Emit: isum[r] = sum over a block of q[r, j] * xq[j] for the TR rows of one tile block."""
    i32, i64, v32i8, v16i16, v8i32 = _ir_types()
    qa = context.make_array(sig.args[0])(context, builder, args[0]).data
    xa = context.make_array(sig.args[2])(context, builder, args[2]).data
    sa = context.make_array(sig.args[4])(context, builder, args[4]).data
    module = builder.module
    maddubs = module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw", (),
                                       ir.FunctionType(v16i16, [v32i8, v32i8]))
    maddwd = module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (),
                                      ir.FunctionType(v8i32, [v16i16, v16i16]))
    qp = builder.gep(qa, [args[1]])
    xp = builder.gep(xa, [args[3]])

    def at(ptr, offset, vtype):
        return builder.bitcast(builder.gep(ptr, [ir.Constant(i64, offset)]), vtype.as_pointer())

    def broadcast(offset):          # 4 activation bytes repeated in every 32-bit lane
        v = builder.load(at(xp, offset, i32), align=1)
        vec = builder.insert_element(ir.Constant(v8i32, None), v, ir.Constant(i32, 0))
        vec = builder.shuffle_vector(vec, ir.Constant(v8i32, None), ir.Constant(v8i32, [0] * 8))
        return builder.bitcast(vec, v32i8)

    ones = ir.Constant(v16i16, [1] * 16)
    if nibbles:
        xlo = [broadcast(4 * g) for g in range(groups)]
        xhi = [broadcast(16 + 4 * g) for g in range(groups)]
        mask, four = ir.Constant(v32i8, [15] * 32), ir.Constant(v32i8, [4] * 32)
    else:
        xg = [broadcast(4 * g) for g in range(groups)]
        sign = module.declare_intrinsic("llvm.x86.avx2.psign.b", (), ir.FunctionType(v32i8, [v32i8, v32i8]))
    for rg in range(TR // 8):                 # 8 rows per 256-bit register
        acc = None
        for g in range(groups):
            v = builder.load(at(qp, g * TR * 4 + rg * 32, v32i8), align=1)
            if nibbles:   # int16 sums cannot overflow within a block (module docstring)
                part = builder.add(builder.call(maddubs, [builder.and_(v, mask), xlo[g]]),
                                   builder.call(maddubs, [builder.lshr(v, four), xhi[g]]))
                acc = part if acc is None else builder.add(acc, part)
            else:         # |q| * (sign(q) * x): unsigned times signed, to int32 at once
                part = builder.call(maddwd, [builder.call(maddubs, [builder.call(sign, [v, v]),
                                                                    builder.call(sign, [xg[g], v])]), ones])
                acc = part if acc is None else builder.add(acc, part)
        if nibbles:
            acc = builder.call(maddwd, [acc, ones])
        builder.store(acc, at(sa, rg * 8, v8i32), align=4)


def _isum_intrinsic(groups: int, nibbles: bool, doc: str):
    def typer(typingctx, qs, qbase, xq, xbase, isum):
        if not all(isinstance(a, types.Array) for a in (qs, xq, isum)):
            return None

        def codegen(context, builder, signature, args):
            _block_ir(builder, args, signature, context, groups, nibbles)
            return context.get_dummy_value()

        return types.void(qs, qbase, xq, xbase, isum), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


_isum_q4 = _isum_intrinsic(4, True, """isum int32[TR] = block dot products of a Q4 tile block at
flat byte ``qbase`` of ``qs`` with the 32 int8 activations at ``xbase`` of ``xq`` (C-contiguous).""")
_isum_q8 = _isum_intrinsic(8, False, """As :func:`_isum_q4` for a Q8_0 tile block.""")


# --------------------------------------------------------------------------------------------
# matmul kernels


@njit(**_JIT_PARALLEL)
def _matmul_q4(xq, xd, xs, qs, d, m, m_scale, out):
    """out[s] = x[s] @ W.T for Q4_0 / Q4_1 (weight d*q + m_scale*m). xq int8 [S, B*32], xd, xs
    float32 [S, B]; qs uint8 [T, B, 4, TR, 4]; d, m float32 [T, B, TR]; out float32 [S, n_out].

    One parallel region over tiles; each block is loaded once and used by every row of x
    while it is in L1 (so prefill and decode share the kernel)."""
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR * 4
    for t in prange(n_tiles):
        isum = np.empty(TR, np.int32)
        acc = np.zeros((n_seq, TR), np.float32)
        for b in range(n_blocks):
            db = d[t, b]
            mb = m[t, b]
            for s in range(n_seq):
                _isum_q4(qs, (t * n_blocks + b) * block, xq, (s * n_blocks + b) * QK, isum)
                dx = xd[s, b]
                ms = m_scale * xs[s, b]
                a = acc[s]
                for r in range(TR):
                    a[r] += (db[r] * dx) * np.float32(isum[r]) + mb[r] * ms
        tiles.store_rows(acc, out, t)


@njit(**_JIT_PARALLEL)
def _matmul_q8(xq, xd, qs, d, out):
    """As :func:`_matmul_q4` for Q8_0: qs int8 [T, B, 8, TR, 4], weight d*q."""
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR * 4
    for t in prange(n_tiles):
        isum = np.empty(TR, np.int32)
        acc = np.zeros((n_seq, TR), np.float32)
        for b in range(n_blocks):
            db = d[t, b]
            for s in range(n_seq):
                _isum_q8(qs, (t * n_blocks + b) * block, xq, (s * n_blocks + b) * QK, isum)
                dx = xd[s, b]
                a = acc[s]
                for r in range(TR):
                    a[r] += (db[r] * dx) * np.float32(isum[r])
        tiles.store_rows(acc, out, t)


def _isums_np(xq: np.ndarray, q: np.ndarray) -> np.ndarray:
    """int64 [S, T, B, TR]: exact block dot products of xq int8 [S, B*32] with q [T, B, 32, TR]."""
    n_seq = xq.shape[0]
    n_blocks = q.shape[1]
    return np.einsum("sbj,tbjr->stbr", xq.reshape(n_seq, n_blocks, QK).astype(np.int64), q.astype(np.int64))


def _file_order(qs: np.ndarray) -> np.ndarray:
    """[T, B, nq/4, TR, 4] -> [T, B, nq, TR] (the float32 path's layout)."""
    n_tiles, n_blocks, groups, tr, _ = qs.shape
    return qs.transpose(0, 1, 2, 4, 3).reshape(n_tiles, n_blocks, groups * 4, tr)


def matmul_q4_np(xq, xd, xs, qs, d, m, m_scale) -> np.ndarray:
    """NumPy twin of :func:`_matmul_q4` (float64 sums). Returns float32 [S, T*TR]."""
    q = _file_order(qs)
    q32 = np.concatenate([q & 0x0F, q >> 4], axis=2)                        # [T, B, 32, TR]
    isum = _isums_np(xq, q32).astype(np.float64)
    y = (d[None] * xd[:, None, :, None] * isum
         + float(m_scale) * m[None] * xs[:, None, :, None].astype(np.float64)).sum(axis=2)
    return y.reshape(xq.shape[0], -1).astype(np.float32)


def matmul_q8_np(xq, xd, qs, d) -> np.ndarray:
    """NumPy twin of :func:`_matmul_q8` (float64 sums). Returns float32 [S, T*TR]."""
    isum = _isums_np(xq, _file_order(qs)).astype(np.float64)
    y = (d[None] * xd[:, None, :, None] * isum).sum(axis=2)
    return y.reshape(xq.shape[0], -1).astype(np.float32)


def matmul(x: np.ndarray, ggml_type, qs, d, m, out: np.ndarray) -> None:
    """``out = x @ W.T`` with x quantized to 8 bits per block (:func:`quantize`).

    x float32 C-contiguous ``[S, n_in]``; ``qs``/``d``/``m`` a weight of type ``ggml_type`` in
    this module's layout; out float32 ``[S, n_out]``.
    """
    xq, xd, xs = quantize(x)
    if ggml_type == _T.Q8_0:
        _matmul_q8(xq, xd, qs, d, out)
    elif ggml_type == _T.Q4_1:
        _matmul_q4(xq, xd, xs, qs, d, m, np.float32(1.0), out)
    else:
        _matmul_q4(xq, xd, xs, qs, d, d, np.float32(-8.0), out)
