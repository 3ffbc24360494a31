"""Row tiles: the float32 arithmetic and the bit helpers every weight kernel module shares.

A tile holds ``TR`` weight rows; a dequantized chunk of it is float32 ``wt[k, r]`` (input k,
row r), so the inner loops run over the ``TR`` rows and vectorise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from llamatrace.machine.jit import E8M0_HALF_TABLE, JIT_INLINE, has_vnni, subnormal_fma_full_speed, target_features

TR = 32
"""Rows per tile."""


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Ask the CPU to start loading the cache line of ``arr.flat[idx]`` (C-contiguous ``arr``):
    LLVM's ``llvm.prefetch`` (read, keep in all cache levels); no effect on any value."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p],
                                              ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        ptr = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


prefetch = _prefetch
"""``prefetch(arr, idx)``: :func:`_prefetch` for the kernels of other modules."""

PREFETCH_BYTES = 2048
"""How far ahead :func:`prefetch_next_block` reaches. One 512-byte Q4_0 tile block ahead was too
close to hide DRAM's latency: Q4_0 [14336, 4096] decode (``q8``, 2 threads) streamed 24 GB/s with
it, 28-29 GB/s with 2-8 KB; 2 KB keeps Q8_0 (1 KB blocks) where it was. The 8B-shaped Q4_0
file's decode step: 231 -> 194 ms, SmolLM2's 9.1 -> 8.7 ms (paired, one process)."""


@njit(**JIT_INLINE)
def prefetch_next_block(qs, t, b, part=0, n_parts=1):
    """Start loading part ``part`` of ``n_parts`` of a block :data:`PREFETCH_BYTES` or more after
    block b of tile t of ``qs`` [T, B, P, TR] (C order: block b + 1 for blocks that large, later
    ones for small blocks, across tiles), while block b is computed.

    The GEMV kernels of the K-quants need it: the hardware prefetcher alone left them waiting on
    DRAM (Q4_K [4096, 4096], 2 threads: 15 GB/s streamed vs 32 from L3; with it 32 and 32).
    Large blocks are fetched in parts spread over the block's work, not in one burst.
    """
    n = qs.shape[2] * qs.shape[3]
    nxt = (t * qs.shape[1] + b + max(1, PREFETCH_BYTES // n)) * n
    if nxt < qs.size:
        step = n // n_parts
        for i in range(part * step, (part + 1) * step if part + 1 < n_parts else n, 64):
            _prefetch(qs, nxt + i)


@njit(**JIT_INLINE)
def byte_offset(p, head, end):
    """Where byte ``p`` of a row goes in a packed block's ``[P, TR]`` bytes: ``(base, stride)``,
    row r's byte at ``base + r * stride``. Bytes ``[head, end)`` are grouped four per row for
    8-bit activations (:mod:`llamatrace.kernels.int8.act8`'s layout, byte ``4g + i`` at ``head*TR + (g*TR +
    r)*4 + i``); the others, and all bytes when ``head == end``, at ``p*TR + r``."""
    if head <= p < end:
        return head * TR + ((p - head) >> 2) * 4 * TR + ((p - head) & 3), 4
    return p * TR, 1


@intrinsic
def load_u32(typingctx, arr, idx):
    """The little-endian uint32 at byte ``idx`` of the C-contiguous uint8 array ``arr``, at any
    alignment: one unaligned load (``arr[idx] | arr[idx+1] << 8 | …`` took four loads, shifts and
    ors, which Numba's int64 arithmetic does not fold back into one)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(32).as_pointer())
        return builder.load(ptr, align=1)
    return types.uint32(arr, idx), codegen


def load_u32_np(arr: np.ndarray, idx: int) -> int:
    """NumPy twin of :func:`load_u32`."""
    return int(np.frombuffer(arr[idx:idx + 4].tobytes(), dtype="<u4")[0])


@njit(**JIT_INLINE)
def copy_rows(src, i0, row_stride, n, out, r0, dst, n_copy, head, end):
    """Bytes ``dst..dst+n_copy`` of rows ``r0..r0+n`` of a packed block (``out``: its flat
    ``[P * TR]`` bytes, laid out as :func:`byte_offset` says) from ``src`` (flat uint8): row
    ``r0 + r``'s byte ``dst + j`` is ``src[i0 + r * row_stride + j]``. The grouped bytes (inside
    the copied ones) move four at a time as one uint32, rows innermost, so every store lands next
    to the last: 2-3x the rate of one byte at a time in row order."""
    # the bytes outside the group, [dst, head) and [end, dst + n_copy): each at p * TR + r
    _copy_bytes(src, i0, row_stride, n, out, r0, dst, min(head, dst + n_copy))
    lo = max(end, dst)
    _copy_bytes(src, i0 + lo - dst, row_stride, n, out, r0, lo, dst + n_copy)
    out32 = out.view(np.uint32)
    for g in range((end - head) // 4):
        o, i = head * TR // 4 + g * TR + r0, i0 + head - dst + 4 * g
        for r in range(n):
            out32[o + r] = load_u32(src, i + r * row_stride)


@njit(**JIT_INLINE)
def _copy_bytes(src, i0, row_stride, n, out, r0, p0, p1):
    """Bytes ``p0..p1`` of rows ``r0..r0+n`` into ``out[p * TR + r0 + r]`` from
    ``src[i0 + r * row_stride + p - p0]``, four bytes of a row read at once."""
    n4 = max(p1 - p0, 0) // 4 * 4
    for j in range(0, n4, 4):
        o = (p0 + j) * TR + r0
        for r in range(n):
            v = load_u32(src, i0 + r * row_stride + j)
            out[o + r] = v & 0xFF
            out[o + TR + r] = (v >> 8) & 0xFF
            out[o + 2 * TR + r] = (v >> 16) & 0xFF
            out[o + 3 * TR + r] = v >> 24
    for j in range(n4, max(p1 - p0, 0)):
        for r in range(n):
            out[(p0 + j) * TR + r0 + r] = src[i0 + r * row_stride + j]


def byte_offsets_np(n_bytes: int, head: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of :func:`byte_offset` for bytes ``0..n_bytes``: int arrays (base, stride)."""
    p = np.arange(n_bytes)
    grouped = (p >= head) & (p < end)
    base = np.where(grouped, head * TR + ((p - head) >> 2) * 4 * TR + ((p - head) & 3), p * TR)
    return base, np.where(grouped, 4, 1)


@njit(**JIT_INLINE)
def store_tile(acc, out, s, t):
    """out[s, t*TR + r] = acc[r] for the rows that exist (the last tile may be padded)."""
    n_out = out.shape[1]
    base = t * TR
    n = min(TR, n_out - base)
    for r in range(n):
        out[s, base + r] = acc[r]


CHUNK = 256
"""The tiled kernels dequantize a tile 256 inputs at a time: a float32 [256, TR] chunk is
32 KiB and stays in L1/L2 while every row of x uses it (a whole 8B tile, up to 14336 x TR
floats, did not); :func:`llamatrace.kernels.tile_gemm.chunk_matmul` multiplies it."""


@njit(**JIT_INLINE)
def store_rows(acc, out, t):
    for s in range(acc.shape[0]):
        store_tile(acc[s], out, s, t)


# --------------------------------------------------------------------------------------------
# Bits in 8-bit integer arithmetic. Numba types integer expressions as int64, so a shift or mask
# written in Python vectorises as 8 lanes per zmm register and costs more than float tricks.
# quant_f32 is written in LLVM IR on i8 values instead: over the TR rows of a tile the loop
# vectorises as 32 byte lanes, then one conversion to float32 (Q5_0 [14336, 4096] GEMV:
# 20 -> 35 GB/s against floors and FMAs on float lanes).


@intrinsic
def quant_f32(typingctx, lo, lo_shift, lo_mask, hi, hi_shift, hi_mask, hi_pos):
    """``float32(((lo >> lo_shift) & lo_mask) | (((hi >> hi_shift) & hi_mask) << hi_pos))`` for
    uint8 ``lo``/``hi``, computed on 8-bit integers (shifts and masks are small constants)."""
    if not (isinstance(lo, types.Integer) and lo.bitwidth == 8 and isinstance(hi, types.Integer)
            and hi.bitwidth == 8):
        return None

    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        lo_v, lo_s, lo_m, hi_v, hi_s, hi_m, hi_p = args
        low = builder.and_(builder.lshr(lo_v, builder.trunc(lo_s, i8)), builder.trunc(lo_m, i8))
        high = builder.and_(builder.lshr(hi_v, builder.trunc(hi_s, i8)), builder.trunc(hi_m, i8))
        return builder.uitofp(builder.or_(low, builder.shl(high, builder.trunc(hi_p, i8))), ir.FloatType())

    return types.float32(lo, lo_shift, lo_mask, hi, hi_shift, hi_mask, hi_pos), codegen


# --------------------------------------------------------------------------------------------
# register-blocked microkernels in LLVM IR

_I32, _I64 = ir.IntType(32), ir.IntType(64)


def escape(b, ptr) -> None:
    """Hand ``ptr`` to an empty asm statement that may read and write memory: the stores made
    through it before are done, and the loads after it are not folded back into the stored values."""
    fn = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type]), "", "r,~{memory}", side_effect=True)
    b.call(fn, [ptr])


def constant_table(module, name: str, initializer: Callable[[], ir.Constant], align: int = 0):
    """The module's internal constant global ``name``, made once per module from ``initializer()``
    (an array constant), ``align``-byte aligned if given: the kernels' tables of weights and scales."""
    if name in module.globals:
        return module.globals[name]
    value = initializer()
    table = ir.GlobalVariable(module, value.type, name)
    table.initializer = value
    table.global_constant = True
    table.linkage = "internal"
    if align:
        table.align = align
    return table


def e8m0_half_table(module):
    """The module's constant float32 [256] of ggml's ``GGML_E8M0_TO_FP32_HALF(e)`` for every byte e
    (:data:`~llamatrace.machine.jit.E8M0_HALF_TABLE`), one per module: the MXFP4 kernels' scales."""
    return constant_table(module, "llamatrace_e8m0_half", lambda: ir.Constant(
        ir.ArrayType(ir.FloatType(), 256), [float(v) for v in E8M0_HALF_TABLE[:256]]))


SUBNORMAL_BIAS = 149 if subnormal_fma_full_speed() else 0
"""149 where the ``f32`` decode kernels read unsigned quants q as the float32 subnormals
``q * 2**-149`` (their int32 bits, no conversion: :func:`quants_as_float`), x then scaled by
``2**K`` (:func:`subnormal_exp`) and the sums by ``2**(SUBNORMAL_BIAS - K)``; 0 on CPUs whose FMA
slows on subnormal inputs (:func:`~llamatrace.machine.jit.subnormal_fma_full_speed`): there the
quants are converted, K is 0 and the scale 1. A constant of the compiled kernels."""


def quants_as_float(b, ints):
    """Unsigned quants in int32 lanes as float32 lanes: bitcast (the subnormals ``q * 2**-149``)
    where :data:`SUBNORMAL_BIAS` is 149, else converted."""
    vf = ir.VectorType(ir.FloatType(), ints.type.count)
    return b.bitcast(ints, vf) if SUBNORMAL_BIAS else b.sitofp(ints, vf)


SUBNORMAL_K = (45, 240)
"""The range of :func:`subnormal_exp`'s exponent K: ``2**(149 - K)`` (2**-91 .. 2**104) times a
block's scales (fp16 ``d`` times a 6- or 8-bit integer: 2**-24 .. 2**23 in magnitude) stays a
normal float32."""


@njit(**JIT_INLINE)
def subnormal_exp(x, s):
    """The exponent K by which row ``s`` of x (float32 [S, n]) is scaled for the kernels that take
    unsigned quants as float32 subnormals (their int32 bits bitcast, ``q * 2**-149``, no
    conversion): ``126 - e`` for the largest finite ``|x|`` below ``2**e`` (so ``|x| * 2**K`` <
    2**126), clipped to :data:`SUBNORMAL_K`; a row of zeros, infs or NaNs gets 126. Then
    ``(x * 2**K) * (q * 2**-149)`` is ``x * q * 2**(K - 149)`` exactly, and a sum of such
    products times ``2**(149 - K)`` is the unscaled sum bit for bit, as long as every product and
    partial sum stays a normal float32: x down to ~2**-100 of the row's largest, and a largest
    ``|x|`` below 2**81 (above, ``x * 2**45`` can overflow)."""
    m = 0.0
    for i in range(x.shape[1]):
        a = abs(np.float64(x[s, i]))
        if a > m and a != np.inf:                  # NaN compares false
            m = a
    return min(max(126 - math.frexp(m)[1], SUBNORMAL_K[0]), SUBNORMAL_K[1])


def subnormal_exp_np(row: np.ndarray) -> int:
    """NumPy twin of :func:`subnormal_exp` for one row."""
    a = np.abs(row.astype(np.float64))
    a = a[np.isfinite(a)]
    e = int(np.frexp(a.max())[1]) if a.size else 0
    return min(max(126 - e, SUBNORMAL_K[0]), SUBNORMAL_K[1])


def daz_off(b):
    """Clear DAZ (MXCSR bit 6, denormals are zero) for the code emitted after, if the calling
    thread has it set: the kernels that read quants as float32 subnormals would see them as
    zeros (a library built with ``-ffast-math`` sets FTZ/DAZ process-wide when it is loaded).
    Returns what :func:`daz_restore` needs to put the caller's MXCSR back. ``stmxcsr`` at every
    call; ``ldmxcsr`` (slow, serialising) only when DAZ was set. Nothing (None) where the quants
    are converted (:data:`SUBNORMAL_BIAS` 0)."""
    if not SUBNORMAL_BIAS:
        return None
    i8p = ir.IntType(8).as_pointer()
    fty = ir.FunctionType(ir.VoidType(), [i8p])
    st = b.module.declare_intrinsic("llvm.x86.sse.stmxcsr", (), fty)
    ld = b.module.declare_intrinsic("llvm.x86.sse.ldmxcsr", (), fty)
    with b.goto_entry_block():
        slot = b.alloca(_I32, name="mxcsr")
    at = b.bitcast(slot, i8p)
    b.call(st, [at])
    old = b.load(slot)
    daz = b.icmp_unsigned("!=", b.and_(old, ir.Constant(_I32, 0x40)), ir.Constant(_I32, 0))
    with b.if_then(daz, likely=False):
        b.store(b.and_(old, ir.Constant(_I32, ~0x40 & 0xFFFFFFFF)), slot)
        b.call(ld, [at])
    return daz, old, slot, ld


def daz_restore(b, saved) -> None:
    """Put back the MXCSR :func:`daz_off` found (only if it changed it)."""
    if saved is None:
        return
    daz, old, slot, ld = saved
    with b.if_then(daz, likely=False):
        b.store(old, slot)
        b.call(ld, [b.bitcast(slot, ir.IntType(8).as_pointer())])


def prefill_lanes() -> int:
    """Rows of a weight tile one register holds in the prefill microkernels: 16 (zmm) on CPUs
    with AVX-512 VNNI, else 8 (ymm)."""
    return 16 if has_vnni() and {"avx512f", "avx512vnni", "avx512bw"} <= target_features() else 8


class VectorTile:
    """An LLVM IR builder for a register-blocked microkernel over a tile: ``lanes`` rows of the
    tile in one float32 vector, the loop over blocks with its accumulators as phi nodes
    (:meth:`block_loop`). The 8-bit prefill microkernels (:mod:`llamatrace.kernels.int8.act8_ir`)
    add their byte dot products to it; the attention products (:mod:`llamatrace.kernels.ops.fp32`)
    use it as it is."""

    def __init__(self, builder, lanes: int) -> None:
        self.b = builder
        self.lanes = lanes
        self.f32 = ir.FloatType()
        self.vf = ir.VectorType(self.f32, lanes)
        self.fma_fn = builder.module.declare_intrinsic(f"llvm.fma.v{lanes}f32", (),
                                                       ir.FunctionType(self.vf, [self.vf] * 3))

    def i64(self, v):
        return self.b.sext(v, _I64) if v.type.width < 64 else v

    @staticmethod
    def c64(v):
        return ir.Constant(_I64, v)

    def splat(self, scalar, vtype):
        b, n = self.b, vtype.count
        v = b.insert_element(ir.Constant(vtype, None), scalar, ir.Constant(_I32, 0))
        return b.shuffle_vector(v, ir.Constant(vtype, None), ir.Constant(ir.VectorType(_I32, n), [0] * n))

    def ptr(self, p, offset, etype):
        return self.b.bitcast(self.b.gep(p, [offset]), etype.as_pointer())

    def load(self, p, offset, etype, align=1):
        return self.b.load(self.ptr(p, offset, etype), align=align)

    def prefetch(self, on, p, offset, lines):
        """If ``on``: ask for the cache ``lines`` (indices of 64 bytes) from ``p + offset`` into L2
        (``prefetcht1``: L1's, ``prefetcht0``, streamed 3-6 % slower in the decode microkernels)."""
        b, i8p = self.b, ir.IntType(8).as_pointer()
        fn = b.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]))
        with b.if_then(on, likely=True):
            for line in lines:
                ptr = b.gep(p, [b.add(offset, self.c64(64 * line))])
                b.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])

    def halves(self, p, offset):
        """``lanes`` fp16 at ``p + offset`` widened to float32 (F16C)."""
        return self.b.fpext(self.load(p, offset, ir.VectorType(ir.HalfType(), self.lanes), 2), self.vf)

    def byte_floats(self, p, offset):
        """``lanes`` unsigned bytes at ``p + offset`` as float32."""
        return self.b.uitofp(self.load(p, offset, ir.VectorType(ir.IntType(8), self.lanes)), self.vf)

    def fma(self, a, x, y):
        return self.b.call(self.fma_fn, [a, x, y])

    def lane_sum(self, vs):
        """The float32 sum of the float vectors ``vs`` (a list of 1, 2, 4 ...): pairwise, then
        across lanes, halves at a time."""
        b = self.b
        while len(vs) > 1:
            vs = [b.fadd(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
        v, n = vs[0], self.lanes // 2
        while n > 1:
            v = b.fadd(b.shuffle_vector(v, ir.Constant(v.type, None), ir.Constant(ir.VectorType(_I32, n), list(range(n)))),
                       b.shuffle_vector(v, ir.Constant(v.type, None), ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n)))))
            n //= 2
        return b.fadd(b.extract_element(v, ir.Constant(_I32, 0)), b.extract_element(v, ir.Constant(_I32, 1)))

    def block_loop(self, n_blocks, ns, body):
        """``for blk in range(n_blocks)``: ``accs = body(blk, accs)`` for ``ns`` float vectors
        starting at zero; returns their final values."""
        b, zero = self.b, ir.Constant(self.vf, [0.0] * self.lanes)
        entry = b.basic_block
        loop = b.append_basic_block("blocks")
        done = b.append_basic_block("done")
        b.cbranch(b.icmp_signed(">", n_blocks, self.c64(0)), loop, done)
        b.position_at_end(loop)
        blk = b.phi(_I64)
        accs = [b.phi(self.vf) for _ in range(ns)]
        new = body(blk, accs)
        nxt = b.add(blk, self.c64(1))
        blk.add_incoming(self.c64(0), entry)
        blk.add_incoming(nxt, b.basic_block)
        for acc, n in zip(accs, new):
            acc.add_incoming(zero, entry)
            acc.add_incoming(n, b.basic_block)
        last = b.basic_block
        b.cbranch(b.icmp_signed("<", nxt, n_blocks), loop, done)
        b.position_at_end(done)
        outs = [b.phi(self.vf) for _ in range(ns)]
        for out, n in zip(outs, new):
            out.add_incoming(zero, entry)
            out.add_incoming(n, last)
        return outs
