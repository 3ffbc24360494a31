"""The float32 prefill's arithmetic: rows of ``x`` times a dequantized chunk of a weight tile, the
sums in registers.

Every type's ``prefill`` kernel in the ``f32`` mode dequantizes a tile (:data:`~llamatrace.kernels.tiles.TR`
weight rows) a chunk of inputs at a time into a float32 scratch ``wt[k, r]`` (input k, row r),
exactly as ``gguf.quants.dequantize`` would, and hands it to :func:`chunk_matmul`, which adds
``x[s, k0:k0+kc] @ wt`` to the tile's float32 sums ``acc[s, :]``.

:func:`chunk_matmul` is a register-blocked microkernel written in LLVM IR (the shape of a BLAS
``sgemm`` kernel): :data:`ROWS` rows of ``x`` against :data:`VECS` float32 vectors of tile rows
(16 on AVX2's ymm, the whole tile of 32 with AVX-512), ``ROWS * VECS`` sums held in registers
over the chunk. Per input it loads ``VECS`` weight vectors and broadcasts ``ROWS`` activations
for ``ROWS * VECS`` FMAs, so the loop is bound by the FMA units rather than by loads and stores
(the Numba loop it replaced kept its sums in memory: 23-26 G multiply-adds/s a core against
~48 here). Each output's sum is one FMA chain over the chunk in input order, added to ``acc``:
the same bits whichever block of rows it falls in and however many threads run.

The chunk dequantizers :func:`deq_i8` and :func:`deq_bits` write one input of a tile's rows as
one vector.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from llamatrace.kernels.tiles import TR, VectorTile, prefill_lanes
from llamatrace.machine.jit import JIT_INLINE

LANES = prefill_lanes()
"""float32 lanes of a vector: 8 (ymm), 16 with AVX-512 VNNI."""
VECS = 2
"""Vectors of tile rows per microkernel call: ``VECS * LANES`` of a tile's :data:`TR` rows."""
COLS = VECS * LANES
ROWS = 6
"""Rows of ``x`` per microkernel call: 6 x 2 sums + 2 weights + 1 broadcast fill 15 of AVX2's 16
registers (the classic 6 x 16 ``sgemm`` kernel)."""

K_STEP = 64
"""Inputs per pass over the rows of x: the pass's 8 KiB of weights stay in L1 while every row
block uses them (a pass over 256 inputs, 32 KiB, ran 25 % slower at 128 rows: the rows of x
evicted them)."""

WIDE_ROWS = 2
"""Up to this many rows (the last rows of x) go against the whole tile at once (``TR // LANES``
vectors): 1 x 2 or 2 x 2 sums are too few FMA chains to hide the FMA's latency, 2 x 4 are 8
(experts in a prefill see ~8 rows each: 6 + 2)."""

_I64 = ir.IntType(64)


def _vecs(rows: int) -> int:
    return TR // LANES if rows <= WIDE_ROWS else VECS


def _gemm_ir(k: VectorTile, rows: int, x, x_at, ldx, wt, w_at, n_k, acc, acc_at) -> None:
    """``acc[acc_at + r*TR + j] += sum_{i < n_k} x[x_at + r*ldx + i] * wt[w_at + i*TR + j]`` for
    ``r < rows``, ``j < _vecs(rows) * LANES``; each sum one FMA chain in i order from zero."""
    b, vecs = k.b, _vecs(rows)
    x_at, ldx, w_at, acc_at = k.i64(x_at), k.i64(ldx), k.i64(w_at), k.i64(acc_at)
    x_rows = [b.add(x_at, b.mul(ldx, k.c64(r))) for r in range(rows)]

    def body(i, sums):
        w_row = b.add(w_at, b.mul(i, k.c64(TR)))
        wv = [k.load(wt, b.add(w_row, k.c64(v * LANES)), k.vf, 4) for v in range(vecs)]
        new = []
        for r in range(rows):
            xv = k.splat(b.load(b.gep(x, [b.add(x_rows[r], i)])), k.vf)
            new += [k.fma(xv, wv[v], sums[r * vecs + v]) for v in range(vecs)]
        return new

    sums = k.block_loop(k.i64(n_k), rows * vecs, body)
    at = [b.add(acc_at, k.c64(r * TR + v * LANES)) for r in range(rows) for v in range(vecs)]
    olds = [k.load(acc, a, k.vf, 4) for a in at]
    for a, old, s in zip(at, olds, sums):
        b.store(b.fadd(old, s), k.ptr(acc, a, k.vf), align=4)


def _gemm_intrinsic(rows: int):
    def typer(typingctx, x, x_at, ldx, wt, w_at, n_k, acc, acc_at):
        if not all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (x, wt, acc)):
            return None
        sig = types.void(x, x_at, ldx, wt, w_at, n_k, acc, acc_at)

        def codegen(context, builder, signature, args):
            flat = list(args)
            for i in (0, 3, 6):
                flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
            _gemm_ir(VectorTile(builder, LANES), rows, *flat)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"gemm_{rows}"
    return intrinsic(typer)


_g1, _g2, _g3, _g4, _g5, _g6 = (_gemm_intrinsic(r) for r in range(1, ROWS + 1))


@njit(**JIT_INLINE)
def _gemm(rows, x, x_at, ldx, wt, w_at, n_k, acc, acc_at):
    """The microkernel for ``rows`` (1 .. :data:`ROWS`) rows of x (one IR function per count)."""
    if rows == 6:
        _g6(x, x_at, ldx, wt, w_at, n_k, acc, acc_at)
    elif rows == 5:
        _g5(x, x_at, ldx, wt, w_at, n_k, acc, acc_at)
    elif rows == 4:
        _g4(x, x_at, ldx, wt, w_at, n_k, acc, acc_at)
    elif rows == 3:
        _g3(x, x_at, ldx, wt, w_at, n_k, acc, acc_at)
    elif rows == 2:
        _g2(x, x_at, ldx, wt, w_at, n_k, acc, acc_at)
    else:
        _g1(x, x_at, ldx, wt, w_at, n_k, acc, acc_at)


@njit(**JIT_INLINE)
def chunk_matmul(x, wt, k0, kc, acc):
    """``acc[s, r] += sum_{k < kc} x[s, k0 + k] * wt[k, r]`` for every row s of x and r < TR.

    x float32 C-contiguous ``[S, n_in]``; wt float32 C-contiguous ``[>= kc, TR]`` (the chunk of a
    dequantized tile); acc float32 C-contiguous ``[S, TR]``. Each sum is one FMA chain over the
    chunk in k order (NumPy twin: :func:`chunk_matmul_np`)."""
    n_seq, ldx = x.shape
    for i in range(0, kc, K_STEP):
        n_k = min(K_STEP, kc - i)
        for s0 in range(0, n_seq, ROWS):
            rows = min(ROWS, n_seq - s0)
            cols = TR if rows <= WIDE_ROWS else COLS
            for c in range(0, TR, cols):
                _gemm(rows, x, s0 * ldx + k0 + i, ldx, wt, i * TR + c, n_k, acc, s0 * TR + c)


def chunk_matmul_np(x: np.ndarray, wt: np.ndarray, k0: int, kc: int, acc: np.ndarray) -> None:
    """NumPy twin of :func:`chunk_matmul` (float64 sums, then added to ``acc`` in float32)."""
    acc += (x[:, k0:k0 + kc].astype(np.float64) @ wt[:kc].astype(np.float64)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Dequantizing a chunk: one input of TR tile rows at a time, as one vector of TR lanes. Written
# in IR because Numba's loops over the TR rows did not vectorise (the loop was unrolled, then the
# scalar code kept: scratch and quants may alias), 1.2-1.5 cycles a weight; these run at a few
# hundredths of that. No fastmath flags: each product and difference is rounded as gguf-py's.

_VTR_F32 = ir.VectorType(ir.FloatType(), TR)
_VTR_I8 = ir.VectorType(ir.IntType(8), TR)


def _data(context, builder, sig, args, i):
    return context.make_array(sig.args[i])(context, builder, args[i]).data


def _lanes_ptr(builder, data, at, vtype):
    return builder.bitcast(builder.gep(data, [at]), vtype.as_pointer())


def _splat(builder, scalar, vtype):
    v = builder.insert_element(ir.Constant(vtype, None), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(vtype, None), ir.Constant(ir.VectorType(ir.IntType(32), TR), [0] * TR))


@intrinsic
def deq_i8(typingctx, wt, w_at, q, q_at, a, a_at):
    """``wt[w_at + r] = a[a_at + r] * float32(q[q_at + r])`` for r < TR: int8 quants times their
    scales (Q8_0's ``d * q``, ``a`` its fp16 bits as uint16, widened exactly; MXFP4's kvalues,
    ``a`` float32). Arrays flat-indexed, C-contiguous."""
    if not (isinstance(q, types.Array) and q.dtype == types.int8 and wt.dtype == types.float32
            and a.dtype in (types.float32, types.uint16)):
        return None
    sig = types.void(wt, w_at, q, q_at, a, a_at)
    bits = a.dtype == types.uint16

    def codegen(context, b, signature, args):
        wt_p, q_p, a_p = (_data(context, b, signature, args, i) for i in (0, 2, 4))
        qv = b.sitofp(b.load(_lanes_ptr(b, q_p, args[3], _VTR_I8), align=1), _VTR_F32)
        if bits:
            av = b.fpext(b.load(_lanes_ptr(b, a_p, args[5], ir.VectorType(ir.HalfType(), TR)), align=2), _VTR_F32)
        else:
            av = b.load(_lanes_ptr(b, a_p, args[5], _VTR_F32), align=4)
        b.store(b.fmul(av, qv), _lanes_ptr(b, wt_p, args[1], _VTR_F32), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def deq_bits(typingctx, wt, w_at, lo, lo_at, lo_shift, lo_mask, hi, hi_at, hi_shift, hi_mask, hi_pos,
             a, c, m):
    """``wt[w_at + r] = a[r] * (float32(q) + c) - m[r]`` for r < TR, with the unsigned quant
    ``q = ((lo[lo_at + r] >> lo_shift) & lo_mask) | (((hi[hi_at + r] >> hi_shift) & hi_mask) << hi_pos)``
    computed on bytes (``hi_mask`` 0: no high part); a, m float32 [TR] (per-row sub-block scale
    and minimum, m zeros for types without one), c a float32 constant. The K-quants' weights:
    Q4_K ``(d*sc)*q - dmin*mn`` (c 0), Q6_K ``(d*sc)*(q - 32)`` (m 0: ``x - 0`` is ``x``)."""
    if not (isinstance(lo, types.Array) and lo.dtype == types.uint8 and isinstance(hi, types.Array)
            and hi.dtype == types.uint8 and wt.dtype == types.float32 and a.dtype == types.float32
            and m.dtype == types.float32):
        return None
    sig = types.void(wt, w_at, lo, lo_at, lo_shift, lo_mask, hi, hi_at, hi_shift, hi_mask, hi_pos, a,
                     types.float32, m)

    def codegen(context, b, signature, args):
        (wt_a, w_at_, lo_a, lo_at_, lo_sh, lo_m, hi_a, hi_at_, hi_sh, hi_m, hi_p, a_a, c_, m_a) = args
        i8 = ir.IntType(8)

        def splat8(v):
            return _splat(b, b.trunc(v, i8), _VTR_I8)

        lo_v = b.load(_lanes_ptr(b, _data(context, b, signature, args, 2), lo_at_, _VTR_I8), align=1)
        hi_v = b.load(_lanes_ptr(b, _data(context, b, signature, args, 6), hi_at_, _VTR_I8), align=1)
        low = b.and_(b.lshr(lo_v, splat8(lo_sh)), splat8(lo_m))
        high = b.and_(b.lshr(hi_v, splat8(hi_sh)), splat8(hi_m))
        qv = b.uitofp(b.or_(low, b.shl(high, splat8(hi_p))), _VTR_F32)
        qc = b.fadd(qv, _splat(b, c_, _VTR_F32))
        av = b.load(_lanes_ptr(b, _data(context, b, signature, args, 11), ir.Constant(_I64, 0), _VTR_F32), align=4)
        mv = b.load(_lanes_ptr(b, _data(context, b, signature, args, 13), ir.Constant(_I64, 0), _VTR_F32), align=4)
        b.store(b.fsub(b.fmul(av, qc), mv), _lanes_ptr(b, _data(context, b, signature, args, 0), w_at_, _VTR_F32),
                align=4)
        return context.get_dummy_value()

    return sig, codegen
