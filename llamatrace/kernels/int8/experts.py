"""The chosen experts of a decode step in one parallel region (8-bit activations).

A decode step of a mixture of experts multiplies one row by ``k`` experts' gate|up matrices, then
``k`` rows by their down matrices (:func:`llamatrace.model.moe.moe_ffn`). Called expert by expert
through :func:`llamatrace.kernels.types.registry.matmul`, that is ``2k`` fork-joins of the thread
pool a layer (16 at qwen3moe's k = 8, each on 0.9-1.8 MB), ``2k`` quantizations of the activation
and ``2k`` Python dispatches, and each call's tiles are split between the threads on their own.
:meth:`Experts.matmul` runs all ``k`` matrices of one kind in one region instead: the activation
rows quantized once, the threads sharing the ``k * T`` (expert, tile) pairs, as ggml's
``mul_mat_id`` shares a node's rows between its threads.

Each tile goes through the decode microkernel of its type, the one the registry's ``q8`` decode
kernel runs (:mod:`llamatrace.kernels.int8.act8_ir`), on the same quantized activations: the
result equals :func:`~llamatrace.kernels.types.registry.matmul` expert by expert bit for bit for
Q4_K and Q6_K. MXFP4 gets its own microkernel here (:data:`decode_mxfp4`): llama.cpp's
``ggml_vec_dot_mxfp4_q8_0`` on AVX2 maps the 4-bit codes to their int8 ``kvalues`` with one byte
shuffle (``vpshufb``) per 32 codes; here the table holds ``kvalues + 12`` (0..24, unsigned), so
the products are ``pmaddubsw``'s unsigned-by-signed ones, and each block's sum starts from the
activations' ``-12 * sum(xq)`` (their zero point, :func:`llamatrace.kernels.int8.act8._quantized`),
as Q4_0's ``-8 * sum(xq)``. Per block ``y = fma(2**(e - 128) * xd, isum, y)``, the same integer
sums as ``mxfp4._matmul_mxfp4_q8`` (which unpacks the codes with integer arithmetic into a
buffer, then sums them as Q8_0's) and its float32 step as LLVM contracts it there (equal bit for
bit in the tests). gpt-oss-20b shape, 4 experts' gate|up [5760, 2880] then down, one thread, a
shared machine at load 8: 16-17 GB of weights per CPU-second here, 5.5 expert by expert with the
registry's MXFP4 kernel (Q8_0's decode kernel streams ~20).

The prefetch distance reaches the microkernels as a run-time value: passed as a constant, LLVM
compiled the Q4_K driver so that it streamed 1.45x slower in CPU time (8 cold experts, 1 and 2
threads, alternated), the same microkernel on the same bytes.

Only the types in :data:`TYPES` go this way; :func:`llamatrace.model.moe.moe_ffn` runs the others
expert by expert. :meth:`Experts.matmul_np` is the NumPy twin (each expert's registered twin).
"""

from __future__ import annotations

import gguf
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.kernels import tiles
from llamatrace.kernels.int8 import act8
from llamatrace.kernels.int8.act8_ir import _decode_intrinsic, _Tile, decode_q4k, decode_q6k
from llamatrace.kernels.types.registry import lookup
from llamatrace.machine.jit import JIT_PARALLEL

_T = gguf.GGMLQuantizationType
TR = tiles.TR
QK = 32

MXFP4_ZERO = 12
"""The offset added to MXFP4's ``kvalues`` (-12..12) so that they are unsigned bytes."""
_KV_PLUS_ZERO = [int(v) + MXFP4_ZERO for v in gguf.quants.MXFP4.kvalues]
MXFP4_AHEAD = 2048
"""The MXFP4 microkernel's prefetch distance in bytes: four blocks of a tile (512 bytes each)."""


def _decode_mxfp4_ir(k: _Tile, args):
    """:data:`decode_mxfp4`'s body: as ``act8_ir._decode_q4_ir`` (Q4_0, one activation row against
    a whole tile, the sums in registers) with each nibble mapped to ``kvalues + 12`` by a byte
    shuffle and each block's scale built from its E8M0 byte ``e`` (uint16 in ``d``): the float32
    bits ``0x00200000 << e`` for e < 2, else ``(e - 1) << 23`` (ggml's ``GGML_E8M0_TO_FP32_HALF``).
    Pair sums of ``pmaddubsw`` are at most 2 * 24 * 127 = 6096, so four of them (24384) are added
    in int16 before ``pmaddwd``."""
    (qs, q_at, xq, xd, xs, s0, d, _, dm_at, n_blocks, _, _, ahead) = args
    b, c64, lanes = k.b, k.c64, k.lanes
    q_at, s0, dm_at, n_blocks, ahead = (k.i64(v) for v in (q_at, s0, dm_at, n_blocks, ahead))
    n_in = b.mul(n_blocks, c64(QK))
    width = 4 * lanes
    mask, four = ir.Constant(k.vi8, [15] * width), ir.Constant(k.vi8, [4] * width)
    table = ir.Constant(k.vi8, _KV_PLUS_ZERO * (width // 16))
    shuffle = b.module.declare_intrinsic("llvm.x86.avx2.pshuf.b" if width == 32 else "llvm.x86.avx512.pshuf.b.512",
                                         (), ir.FunctionType(k.vi8, [k.vi8, k.vi8]))
    vi32 = k.vi32
    two, one, low_bit, exp_shift = (ir.Constant(vi32, [v] * lanes) for v in (2, 1, 0x00200000, 23))
    on = b.icmp_signed("!=", ahead, c64(0))

    def scales(at):
        e = b.zext(k.load(d, at, ir.VectorType(ir.IntType(16), lanes), 2), vi32)
        bits = b.select(b.icmp_unsigned("<", e, two), b.shl(low_bit, e), b.shl(b.sub(e, one), exp_shift))
        return b.bitcast(bits, k.vf)

    def body(blk, accs):
        qb = b.add(q_at, b.mul(blk, c64(16 * TR)))
        k.prefetch(on, qs, b.add(qb, ahead), range(16 * TR // 64))
        xrow = b.add(b.mul(s0, n_in), b.mul(blk, c64(QK)))
        xlo = [k.bytes4(xq, b.add(xrow, c64(4 * g))) for g in range(4)]
        xhi = [k.bytes4(xq, b.add(xrow, c64(16 + 4 * g))) for g in range(4)]
        at = b.add(b.mul(s0, n_blocks), blk)
        dx = k.splat(b.load(b.gep(xd, [at]), align=4), k.vf)
        init = k.offset(xs, at)
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        new = []
        for h, acc in enumerate(accs):            # rows h*lanes ..: bytes 4g.. of each row, g < 4
            v = [k.load(qs, b.add(qb, c64((g * TR + h * lanes) * 4)), k.vi8) for g in range(4)]
            lo = [b.call(shuffle, [table, b.and_(v[g], mask)]) for g in range(4)]
            hi = [b.call(shuffle, [table, b.and_(b.lshr(v[g], four), mask)]) for g in range(4)]
            isum = b.add(k.isum(list(zip(lo, xlo)), init=init), k.isum(list(zip(hi, xhi))))
            scale = b.fmul(scales(b.add(dm, c64(h * lanes))), dx)
            new.append(k.fma(scale, b.sitofp(isum, k.vf), acc))
        return new

    return k.block_loop(n_blocks, TR // lanes, body)


decode_mxfp4 = _decode_intrinsic(_decode_mxfp4_ir, """Decode microkernel for MXFP4 (act8's
layout): ``res[r]`` (float32 [TR]) = row ``r`` of the tile whose block 0 is at byte ``q_at`` of ``qs``
(E8M0 bytes at ``dm_at`` of ``d``, uint16) times activation row ``s0`` of ``xq``, ``xd`` (Q8_0) and
``xs`` (int32: the blocks' ``-12 * sum(xq)``); ``m``, ``m_scale`` unused; ``ahead``: prefetch
distance in bytes (0: none).""")


@intrinsic
def _shifted(typingctx, a, n):
    """``a`` (an array) with its data pointer moved by ``n`` elements (may be negative), its shape
    and strides kept: another expert's arrays, for the microkernels, which read from the data
    pointer at the offsets they are given and check no bounds."""
    if not isinstance(a, types.Array) or not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        out = context.make_array(sig.return_type)(context, builder, arr._getvalue())
        out.data = builder.gep(arr.data, [args[1]])
        return out._getvalue()

    return a(a, types.int64), codegen


# --------------------------------------------------------------------------------------------
# the drivers: one parallel region over (slot, tile). Slot s multiplies activation row s * row_step
# by expert ids[s], whose arrays start off[ids[s]] elements after those of expert 0 (qs, d, m)


@njit(**JIT_PARALLEL)
def _experts_q4k(x, row_step, qs, d, m, off, ids, out, ahead):
    xq, xd, xs, _ = act8._quantized(x, act8.PER32_F32, 0)
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    k = ids.shape[0]
    for i in prange(k * n_tiles):
        s, t = i // n_tiles, i % n_tiles
        e = ids[s]
        res = np.empty(TR, np.float32)
        dmin = _shifted(m, off[e, 2] - off[e, 1])              # read at d's offsets
        decode_q4k(qs, off[e, 0] + t * n_blocks * block, xq, xd, xs, s * row_step, d, dmin,
                   off[e, 1] + t * n_blocks * TR, n_blocks, np.float32(0.0), res, ahead)
        tiles.store_tile(res, out, s, t)


@njit(**JIT_PARALLEL)
def _experts_q6k(x, row_step, qs, d, off, ids, out, ahead):
    xq, xd, xsum = act8._quantized_k(x)
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    k = ids.shape[0]
    for i in prange(k * n_tiles):
        s, t = i // n_tiles, i % n_tiles
        e = ids[s]
        res = np.empty(TR, np.float32)
        decode_q6k(qs, off[e, 0] + t * n_blocks * block, xq, xd, xsum, s * row_step, d, d,
                   off[e, 1] + t * n_blocks * TR, n_blocks, np.float32(0.0), res, ahead)
        tiles.store_tile(res, out, s, t)


@njit(**JIT_PARALLEL)
def _experts_mxfp4(x, row_step, qs, d, off, ids, out, ahead):
    xq, xd, _, xoff = act8._quantized(x, act8.Q8_0, -MXFP4_ZERO)
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    k = ids.shape[0]
    for i in prange(k * n_tiles):
        s, t = i // n_tiles, i % n_tiles
        e = ids[s]
        res = np.empty(TR, np.float32)
        decode_mxfp4(qs, off[e, 0] + t * n_blocks * block, xq, xd, xoff, s * row_step, d, d,
                     off[e, 1] + t * n_blocks * TR, n_blocks, np.float32(0.0), res, ahead)
        tiles.store_tile(res, out, s, t)


TYPES = frozenset({_T.Q4_K, _T.Q6_K, _T.MXFP4})
"""The weight types :class:`Experts` runs (in the ``q8`` mode)."""


class Experts:
    """One layer's experts of one kind (gate|up, or down), each a :class:`~llamatrace.kernels.types.packing.Weight`
    ``[n_out, n_in]`` where the model's loader put it, seen as expert 0's arrays plus each
    expert's offset from them (``off`` int64 ``[n_expert, 3]``: elements of ``qs``, ``d``, ``m``),
    so that a call passes three arrays and the chosen ids, whatever ``k``, and one compiled
    driver per type serves every model. Build it with :meth:`of`.
    """

    def __init__(self, ws) -> None:
        self.ws = ws
        w0 = ws[0]
        self.ggml_type, self.n_out, self.n_in = w0.ggml_type, w0.n_out, w0.n_in
        self.qs, self.d = w0.qs, w0.d
        self.m = w0.m if w0.m.size else w0.d
        self.off = np.array([[_elements(w.qs, self.qs), _elements(w.d, self.d),
                              _elements(w.m if w.m.size else w.d, self.m)] for w in ws], dtype=np.int64)

    @classmethod
    def of(cls, ws) -> "Experts | None":
        """The experts ``ws`` (a list of Weights, one per expert) as one :class:`Experts`, or None
        unless they share one type of :data:`TYPES` and one shape, packed for the ``q8`` mode."""
        w0 = ws[0]
        if not (w0.act8 and w0.ggml_type in TYPES):
            return None
        same = all(w.ggml_type == w0.ggml_type and w.act8 and w.qs.shape == w0.qs.shape and w.m.shape == w0.m.shape
                   and w.qs.flags.c_contiguous and w.d.flags.c_contiguous and w.m.flags.c_contiguous for w in ws)
        return cls(ws) if same else None

    def matmul(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """``out[s] = x[s or 0] @ W[ids[s]].T`` for the ``k`` chosen experts, in one parallel region.

        Args:
            x: float32 ``[1, n_in]`` (one row for every expert: gate|up) or ``[k, n_in]`` (row s
                for slot s: down); quantized once, as the type's ``q8`` kernel quantizes it.
            ids: int ``[k]``, experts in ``0 .. n_expert - 1``.

        Returns:
            float32 ``[k, n_out]``.

        Raises:
            ValueError: ``x``'s shape does not fit ``ids``, or an id is out of range.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        k = ids.shape[0]
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[0] not in (1, k) or x.shape[1] != self.n_in:
            raise ValueError(f"Experts.matmul: x has shape {list(x.shape)}, expected [1 or {k}, {self.n_in}]")
        if k and not (0 <= ids.min() and ids.max() < len(self.ws)):
            raise ValueError(f"Experts.matmul: ids must be in 0..{len(self.ws) - 1}, got {ids.tolist()}")
        out = np.empty((k, self.n_out), dtype=np.float32)
        row_step = 1 if x.shape[0] == k and k > 1 else 0
        if self.ggml_type == _T.Q4_K:
            _experts_q4k(x, row_step, self.qs, self.d, self.m, self.off, ids, out, act8.DECODE_AHEAD_Q4K)
        elif self.ggml_type == _T.Q6_K:
            _experts_q6k(x, row_step, self.qs, self.d, self.off, ids, out, act8.DECODE_AHEAD_Q6K)
        else:
            _experts_mxfp4(x, row_step, self.qs, self.d, self.off, ids, out, MXFP4_AHEAD)
        return out

    def matmul_np(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """NumPy twin of :meth:`matmul`: each chosen expert's registered ``q8`` decode twin
        (float64 sums). Returns float32 ``[k, n_out]``."""
        ids = np.asarray(ids).reshape(-1)
        rows = [x[s if x.shape[0] > 1 else 0][None] for s in range(len(ids))]
        return np.concatenate([lookup(self.ggml_type, "q8", "decode").twin(r, self.ws[e]) for r, e in zip(rows, ids)])


def _elements(a: np.ndarray, base: np.ndarray) -> int:
    """How many elements of ``base``'s dtype ``a``'s data starts after ``base``'s (may be negative)."""
    gap = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    if gap % base.itemsize:
        raise ValueError("Experts: an expert's arrays are not aligned to their element size")
    return gap // base.itemsize
