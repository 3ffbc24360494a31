"""The ``f32`` mode's ``mul_mat_id`` kernels on the file's blocks (:mod:`llamatrace.kernels.mul_mat_id`).

The experts stay as the GGUF file stores them: row-major, each weight row ``n_in / 256`` (Q4_K,
Q6_K) or ``n_in / 32`` (MXFP4, Q8_0) blocks in a row. One call is one parallel region over work
items (group of slots, part, tile of :data:`TR` weight rows), as ggml's ``mul_mat_id`` shares a
node's rows between its threads: a group of one slot runs :func:`_tile_ir`, a group of several
:func:`_slots_tile` (below).

The arithmetic is float32 activations times ``gguf.quants.dequantize``'s weights. One slot (a
decode step's experts) takes the products grouped as the packed kernels
(:mod:`llamatrace.kernels.types.f32_ir`) group them, fewer operations a weight:

- Q4_K: ``(d*sc) * (x . q) - (dmin*mn) * sum(x)`` per sub-block of 32 (``d*sc`` and
  ``dmin*mn`` are exact in float32; ``sum(x)`` per 32 inputs is computed once a call);
- MXFP4: ``d * (x . kvalue)`` per block (``d`` a power of two: ggml's ``GGML_E8M0_TO_FP32_HALF``);
  on zmm ``x . w`` with gguf-py's weights ``w = d * kvalue`` themselves, from a table (:func:`_mxfp4_wide`);
- Q8_0: ``d * (x . q)`` per block;
- Q6_K: ``(d*sc) * (x . (q - 32))`` per 16 inputs (``d*sc`` is exact; the weights
  ``(d*sc) * (q - 32)`` are not always, so this differs from gguf-py's rounded weights times x by
  float32 rounding, as the other groupings do).

One slot (a decode step's experts) runs a kernel of its own, :func:`_tile` (:func:`_tile_ir`): a
work item's whole tile of rows in one IR loop, each row's sums in registers from its first block
to its last, added across lanes straight into ``out`` (no buffer and no call a row). Its Q4_K and
Q6_K quants are read as float32 subnormals, not converted, with the slot's x scaled by 2**K
(:data:`SUBNORMAL`; as :mod:`llamatrace.kernels.types.f32_ir`'s Q4_K and Q6_K), on AMD's Zen cores
(:data:`~llamatrace.kernels.tiles.SUBNORMAL_BIAS`; converted elsewhere). With AVX-512
(:data:`WIDE`) those two run on zmm: Q6_K with two groups of 32 inputs side by side (the ymm
kernel's bits), Q4_K with its nibbles kept in place by ANDs, no byte shuffle (:func:`_q4k_wide`: its
own grouping of the products, so other float32 roundings than the ymm kernel's); and MXFP4, its
codes picking a block's 16 weights by ``vpermps`` (:func:`_mxfp4_wide`: other roundings too).

Several slots (a prefill's groups: ~8 slots an expert at 128 tokens, top-8 of 128; ~16 at top-4
of 32) of Q4_K or Q6_K on zmm go to :func:`_slots_wide` (:func:`_slots_wide_ir`): the one-slot
kernel's blocks, their quants converted and made the weights in registers, each vector of weights
multiplied into up to 8 slots (an FMA each), two rows sharing each load of x. The other kinds, and
every kind on ymm, go to :func:`_slots_tile`, the dense prefill's shape (:mod:`llamatrace.kernels.tile_gemm`)
on row-major blocks. A chunk of inputs at a time (the slots' x over it, :data:`X_CHUNK` floats,
stays in L1), a few rows of the tile are dequantized into a float32 scratch in L1
(:func:`_deq_ir`: gguf-py's values bit for bit; Q4_K's ``fma(d*sc, q, -(dmin*mn))`` is gguf-py's
``d*q - dm`` since ``d*sc*q`` is exact), then a register-blocked microkernel (:func:`_gemm`,
:func:`_gemm_ir`: 4 rows x 2 slots, 3 x up to 4 or 2 x 5 and 6, :func:`gemm_plan`) multiplies
them into the slots' sums.
One slot or several, results differ from float64 sums over the dequantized weights by float32
rounding only; :func:`llamatrace.kernels.mul_mat_id.mul_mat_id_ref` is the NumPy twin the tests hold them to.
Measured speeds, and what was tried: docs/performance.md, "f32 experts on the file's blocks: one
slot", "f32 experts in a prefill" and "f32 experts in a prefill: several slots a vector of weights".

Numba caches the drivers by this module's source; the IR is emitted here too, so a change to it
recompiles them.
"""

from __future__ import annotations

import functools

import gguf
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.kernels.tiles import (SUBNORMAL_BIAS, TR, VectorTile, constant_table, daz_off, daz_restore,
                                      e8m0_half_table, escape, prefetch, prefill_lanes, quants_as_float,
                                      subnormal_exp)
from llamatrace.kernels.types.f32_ir import chain, q6k_quants
from llamatrace.machine.jit import E8M0_HALF_TABLE, JIT_INLINE, JIT_PARALLEL

_T = gguf.GGMLQuantizationType

TYPES = frozenset({_T.Q4_K, _T.Q6_K, _T.MXFP4, _T.Q8_0})
"""The weight types these kernels run."""

LANES = 8
"""float32 lanes of the microkernels' vectors (ymm; with AVX-512 one slot's Q4_K, Q6_K and MXFP4
kernels take 16, zmm: :data:`WIDE`)."""

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_MXFP4_BITS = np.array(gguf.quants.MXFP4.kvalues, dtype=np.float32).view(np.uint32)
MXFP4_BYTES = tuple(tuple(int(v) for v in _MXFP4_BITS >> shift & 0xFF) for shift in (16, 24))
"""MXFP4's ``pshufb`` tables: bytes 2 and 3 of each kvalue's float32 (code 8, ``0``, as +0); bytes 0
and 1 are zero, the kvalues being small integers."""

# kind: (ggml type, weights a block, bytes a block, float32 sums of x a block appended to each row
# of one slot: Q4_K's per sub-block, Q6_K's per lane of each 32 inputs, :func:`_matmul_id`)
_KINDS = {"q4k": (_T.Q4_K, 256, 144, 8), "q6k": (_T.Q6_K, 256, 210, 64),
          "mxfp4": (_T.MXFP4, 32, 17, 0), "q8_0": (_T.Q8_0, 32, 34, 0)}
KIND = {v[0]: i for i, v in enumerate(_KINDS.values())}
"""ggml type -> the drivers' ``kind`` argument."""
_KIND_SHAPES = tuple(_KINDS.values())


# --------------------------------------------------------------------------------------------
# One block of one weight row -> groups of (float32 vector of 8 quants or weights, their first
# position in the block of x as the driver lays it out) with the group's scale (None: the vectors
# are the weights themselves).
#
# Widening: 32 bytes (inputs 32i .. 32i + 31 of a block, one byte each) become four vectors of 8
# int32 by one in-lane byte shuffle each (``vpshufb``): vector g holds inputs 4g .. 4g + 3 (low
# 128 bits) and 16 + 4g .. 16 + 4g + 3 (high 128 bits). The driver lays each 32 inputs of x out in
# that order (:data:`X_ORDER`), so the products pair up. Unsigned bytes land in the low byte of
# their int32 (the quant itself); signed ones in the high byte (the quant times 2**24, exact in
# float32), whose 2**-24 is folded into a scale. MXFP4 makes its float32 otherwise, in an order of
# its own (:data:`MXFP4_ORDER`, :func:`_mxfp4_block`).

X_ORDER = np.array([4 * g + j if j < 4 else 12 + 4 * g + j for g in range(4) for j in range(8)], dtype=np.int64)
"""Position p of each 32 inputs of x in the kernels' layout holds input ``X_ORDER[p]`` (all kinds
but MXFP4)."""
MXFP4_ORDER = np.array([16 * lane + 8 * h + 2 * j + odd for h in (0, 1) for odd in (0, 1) for lane in (0, 1)
                        for j in range(4)], dtype=np.int64)
"""The same for MXFP4 (:func:`_mxfp4_block`): vector 2h + odd holds inputs 8h + 2j + odd (low 128
bits) and 16 + 8h + 2j + odd (high), j < 4."""
_TOP = 2.0 ** -24


def x_order(ggml_type) -> np.ndarray:
    """int64 [32]: the order of each 32 inputs of x that the kernels of ``ggml_type`` read."""
    return MXFP4_ORDER if ggml_type == _T.MXFP4 else X_ORDER


WIDE = prefill_lanes() == 16
"""Whether one slot's Q4_K, Q6_K and MXFP4 kernels run on zmm (AVX-512): :func:`_q4k_wide`,
:func:`_q6k_wide`, :func:`_mxfp4_wide`."""
WIDE_ORDER = np.array([32 * s + X_ORDER[8 * g + lane] for g in range(4) for s in (0, 1) for lane in range(8)],
                      dtype=np.int64)
"""Position p of each 64 inputs of x for the zmm Q6_K kernel holds input ``WIDE_ORDER[p]``: vector g
(16 floats) is the two groups' :data:`X_ORDER` vectors g side by side."""
Q4K_BITS = tuple(tuple(8 * b + 4 * h if b < 3 else 16 + 4 * h for h in (0, 1)) for b in range(4))
"""``Q4K_BITS[b][h]``: where the zmm Q4_K kernel finds nibble h of byte b of each int32 of quants
(:func:`_q4k_wide`: byte 3's after a shift right by 8), so that lane reads as ``q * 2**e``."""
Q4K_ORDER = np.array([64 * s + 32 * h + 4 * d + b for h in (0, 1) for b in range(4) for s in (0, 1) for d in range(8)],
                     dtype=np.int64)
"""Position p of each 128 inputs of x for the zmm Q4_K kernel holds input ``Q4K_ORDER[p]``, times
``2**-Q4K_EXP[p]``: vector (h, b) holds nibble h of byte b of each int32 of two 32-byte chunks."""
Q4K_EXP = np.array([Q4K_BITS[b][h] for h in (0, 1) for b in range(4) for _ in range(16)], dtype=np.int64)


_NATURAL, _NATURAL_EXP = np.arange(32, dtype=np.int64), np.zeros(32, np.int64)


def alone_layout(ggml_type) -> tuple[np.ndarray, np.ndarray]:
    """int64 [n] twice, n dividing 256: position p of each n inputs of x that the one-slot kernel of
    ``ggml_type`` reads holds input ``order[p]`` times ``2**-exp[p]`` (as well as the 2**K of
    :func:`~llamatrace.kernels.tiles.subnormal_exp`): :func:`x_order`, or on zmm
    :data:`WIDE_ORDER` (Q6_K), :data:`Q4K_ORDER` with :data:`Q4K_EXP` (Q4_K) and the natural order
    (MXFP4, :func:`_mxfp4_wide`)."""
    if WIDE and ggml_type == _T.Q4_K:
        return Q4K_ORDER, Q4K_EXP
    if WIDE and ggml_type == _T.MXFP4:
        return _NATURAL, _NATURAL_EXP
    order = WIDE_ORDER if WIDE and ggml_type == _T.Q6_K else x_order(ggml_type)
    return order, np.zeros_like(order)


def _widen(k: VectorTile, v32, g: int, signed: bool, raw: bool = False):
    """Vector g (of 4) of the 32 bytes ``v32`` as float32: the bytes of inputs 4g .. 4g + 3 and
    16 + 4g .. 16 + 4g + 3; unsigned: their values, signed: their values times 2**24. Unsigned
    with ``raw``: their int32 lanes bitcast, not converted (the subnormals ``q * 2**-149``; x
    comes scaled, :func:`_matmul_id`). 64 bytes: the same of each 32, side by side (zmm)."""
    b = k.b
    vb = v32.type
    name = "llvm.x86.avx2.pshuf.b" if vb.count == 32 else "llvm.x86.avx512.pshuf.b.512"
    fn = b.module.declare_intrinsic(name, (), ir.FunctionType(vb, [vb, vb]))
    mask = []
    for _ in range(vb.count // 16):
        for j in range(4):
            dword = [0x80] * 4
            dword[3 if signed else 0] = 4 * g + j
            mask += dword
    words = b.bitcast(b.call(fn, [v32, ir.Constant(vb, mask)]), ir.VectorType(_I32, vb.count // 4))
    return quants_as_float(b, words) if raw else b.sitofp(words, k.vf)


def _half(k: VectorTile, qs, at):
    """The fp16 at byte ``at`` of ``qs`` as float32 (exact)."""
    return k.b.fpext(k.load(qs, at, ir.HalfType(), 1), k.f32)


def _const(values, ty=_I8):
    values = list(values)
    return ir.Constant(ir.VectorType(ty, len(values)), values)


def _q4k_block(k: VectorTile, qs, qb, exact: bool, u=None):
    """Q4_K (d, dmin, scales[12], qs[128]): per chunk j of 32 bytes, sub-block 2j in the low
    nibbles (inputs 64j + l) and 2j + 1 in the high ones (64j + 32 + l); the 6-bit scales and mins
    unpacked on 8 lanes as ggml's ``get_scale_min_k4``. Returns (groups, the 8 ``dmin*mn``), or
    with ``exact`` (the weights ``fma(d*sc, q, -(dmin*mn))`` one vector at a time, made as they
    are asked for: ``(d*sc) * q`` is exact in float32, so that is gguf-py's ``d * q - dm``, None).
    Without ``exact`` the quants are subnormals (:func:`_widen`'s ``raw``) and the scales
    ``(d*sc) * u`` (``u = 2**(149 - K)``, the float32 scalar that undoes x's 2**K: exact)."""
    b, c64 = k.b, k.c64
    d, dmin = _half(k, qs, qb), _half(k, qs, b.add(qb, c64(2)))
    sc, mn = _q4k_scales(k, qs, qb)
    dsc = b.fmul(k.splat(d, k.vf), b.sitofp(sc, k.vf))
    dmn = b.fmul(k.splat(dmin, k.vf), b.sitofp(mn, k.vf))
    if not exact:
        dsc = b.fmul(dsc, k.splat(u, k.vf))
    # each sub-block's scale broadcast from memory (a load) rather than out of the vector (2 shuffles)
    with b.goto_entry_block():
        scratch = b.alloca(ir.VectorType(k.f32, 16), name="q4k_scales")
    at = b.bitcast(scratch, k.f32.as_pointer())
    b.store(dsc, b.bitcast(at, dsc.type.as_pointer()), align=4)
    b.store(b.fneg(dmn), b.bitcast(b.gep(at, [ir.Constant(_I32, 8)]), dsc.type.as_pointer()), align=4)
    escape(b, scratch)
    v32 = ir.VectorType(_I8, 32)

    def nibbles():
        for j in range(4):
            q = k.load(qs, b.add(qb, c64(16 + 32 * j)), v32)
            yield 2 * j, b.and_(q, _const([15] * 32))
            yield 2 * j + 1, b.and_(b.lshr(q, _const([4] * 32)), _const([15] * 32))

    def weights():
        for sub, nib in nibbles():
            sv = k.splat(b.load(b.gep(at, [ir.Constant(_I32, sub)]), align=4), k.vf)
            mv = k.splat(b.load(b.gep(at, [ir.Constant(_I32, 8 + sub)]), align=4), k.vf)
            for g in range(4):
                yield k.fma(sv, _widen(k, nib, g, False), mv), 32 * sub + 8 * g

    if exact:
        return weights(), None
    return [([(_widen(k, nib, g, False, raw=True), 32 * sub + 8 * g) for g in range(4)],
             b.load(b.gep(at, [ir.Constant(_I32, sub)]), align=4)) for sub, nib in nibbles()], dmn


def _q4k_scales(k: VectorTile, qs, qb):
    """Q4_K's 6-bit scales and mins of the block at ``qb`` (bytes 4..15), unpacked on 8 lanes as
    ggml's ``get_scale_min_k4``: two int32 vectors of 8."""
    b, c64 = k.b, k.c64
    # bytes 4..15 (and qs[0:4]): per lane the 6-bit scales (lanes 0..7) and mins (8..15), on bytes
    s = k.load(qs, b.add(qb, c64(4)), ir.VectorType(_I8, 16))
    s4 = b.and_(b.lshr(s, _const([4] * 16)), _const([15] * 16))
    low = b.and_(b.shuffle_vector(s, s4, _const([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 24, 25, 26, 27], _I32)),
                 _const(([63] * 4 + [15] * 4) * 2))
    top = b.and_(b.lshr(b.shuffle_vector(s, ir.Constant(s.type, None), _const([0, 1, 2, 3] * 2 + [4, 5, 6, 7] * 2, _I32)),
                        _const([2] * 16)), _const(([0] * 4 + [0x30] * 4) * 2))      # (b >> 6) << 4
    both = b.or_(low, top)
    vi = ir.VectorType(_I32, 8)
    return tuple(b.zext(b.shuffle_vector(both, ir.Constant(both.type, None), _const(range(o, o + 8), _I32)), vi)
                 for o in (0, 8))


def _q6k_block(k: VectorTile, qs, qb, exact: bool, u=None):
    """Q6_K (ql[128], qh[64], scales int8[16], d): input 128h + 32c + l (l < 32) is
    ``(ql[64h + 32(c%2) + l] >> 4(c//2)) & 15 | ((qh[32h + l] >> 2c) & 3) << 4``, less 32, its
    weight ``(d * sc[(128h + 32c + l) // 16]) * (q - 32)`` (gguf-py's float32 roundings: the
    quant comes widened times 2**24 and the scale times 2**-24, both exact). Without ``exact``:
    :func:`_q6k_groups`."""
    if not exact:
        return _q6k_groups(k, qs, qb, u), None
    b, c64 = k.b, k.c64
    d = _half(k, qs, b.add(qb, c64(208)))
    v32 = ir.VectorType(_I8, 32)
    # the 16 scales d * sc (gguf-py's product), times 2**-24, as two vectors of 8
    sc = k.load(qs, b.add(qb, c64(192)), ir.VectorType(_I8, 16))
    dtop = k.splat(d, k.vf)
    dsc = [b.fmul(b.fmul(dtop, b.sitofp(b.shuffle_vector(sc, ir.Constant(sc.type, None), _const(range(8 * i, 8 * i + 8), _I32)),
                                        k.vf)), k.splat(ir.Constant(k.f32, _TOP), k.vf)) for i in (0, 1)]

    def cst(v):
        return _const([v] * 32)

    def weights():
        for h in range(2):
            qa = k.load(qs, b.add(qb, c64(64 * h)), v32)
            qc = k.load(qs, b.add(qb, c64(64 * h + 32)), v32)
            qh = k.load(qs, b.add(qb, c64(128 + 32 * h)), v32)
            for c, quant in enumerate(q6k_quants(b, qa, qc, qh)):
                q = b.sub(quant, cst(32))                           # -32 .. 31
                i = 2 * c                                           # the scales of l < 16 and l >= 16
                lanes = b.shuffle_vector(dsc[h], ir.Constant(k.vf, None), _const([i] * 4 + [i + 1] * 4, _I32))
                for g in range(4):
                    yield b.fmul(lanes, _widen(k, q, g, True)), 128 * h + 32 * c + 8 * g

    return weights(), None


def _q6k_groups(k: VectorTile, qs, qb, u):
    """Q6_K for one slot: per 32 inputs (h, c) the four vectors of quants ``q`` (0..63) as float32
    subnormals (``q * 2**-149``, not converted; x comes times 2**K), the vector of their lanes'
    scales ``(d*sc) * u`` (``u = 2**(149 - K)``) and the place of the lanes' ``32 * sum(x)`` (times
    2**(K - 149)) among the block's sums of x: lanes 0..3 of a vector hold inputs of one group of
    16, lanes 4..7 of the next (:data:`X_ORDER`), so ``(d*sc) * (x . q - 32 * sum(x))`` per 16
    inputs is a subtraction and one FMA of that vector into each lane's dot product, not a multiply
    a weight (:func:`_one_slot_block`). The quants are made on the block's bytes (their dwords first
    put in :data:`X_ORDER`'s order), stored to a scratch and read back 8 at a time by a load that
    widens them (as :mod:`llamatrace.kernels.types.f32_ir`'s Q6_K)."""
    b, c64 = k.b, k.c64
    d = _half(k, qs, b.add(qb, c64(208)))
    v32 = ir.VectorType(_I8, 32)
    vd = ir.VectorType(_I32, 8)
    sc = k.load(qs, b.add(qb, c64(192)), ir.VectorType(_I8, 16))
    dtop = k.splat(d, k.vf)
    uv = k.splat(u, k.vf)
    dsc = [b.fmul(b.fmul(dtop, b.sitofp(b.shuffle_vector(sc, ir.Constant(sc.type, None), _const(range(8 * i, 8 * i + 8), _I32)),
                                        k.vf)), uv) for i in (0, 1)]
    with b.goto_entry_block():
        scratch = b.alloca(ir.ArrayType(_I8, 256), name="q6k_quants")
    buf = b.bitcast(scratch, _I8.as_pointer())

    def cst(v):
        return _const([v] * 32)

    def load(at):                 # 32 bytes, their dwords in the order of X_ORDER's vectors
        v = b.bitcast(k.load(qs, b.add(qb, c64(at)), v32), vd)
        return b.bitcast(b.shuffle_vector(v, ir.Constant(vd, None), _const([0, 4, 1, 5, 2, 6, 3, 7], _I32)), v32)

    for h in range(2):
        for c, q in enumerate(q6k_quants(b, load(64 * h), load(64 * h + 32), load(128 + 32 * h))):
            b.store(q, k.ptr(buf, c64(128 * h + 32 * c), v32), align=1)      # 0 .. 63
    escape(b, buf)
    vi = ir.VectorType(_I32, 8)
    permps = ir.InlineAsm(ir.FunctionType(k.vf, [vi, k.vf]), "vpermps $2, $1, $0", "=x,x,x")
    for h in range(2):
        for c in range(4):                       # one vpermps (LLVM makes the shuffle two, from a constant mask)
            lanes = b.call(permps, [_const([2 * c] * 4 + [2 * c + 1] * 4, _I32), dsc[h]])
            yield [(quants_as_float(b, b.zext(k.load(buf, c64(128 * h + 32 * c + 8 * g), ir.VectorType(_I8, 8)), vi)),
                    128 * h + 32 * c + 8 * g) for g in range(4)], lanes, 8 * (4 * h + c)


def _mxfp4_block(k: VectorTile, qs, qb, exact: bool):
    """MXFP4 (e, qs[16]): input l (l < 16) the low nibble of byte l, 16 + l the high one, each a
    code of ``kvalues``, the block's scale ``d`` ggml's ``GGML_E8M0_TO_FP32_HALF(e)`` (one load
    from a table of the 256). The kvalues are small integers, their float32 bits zero below the top
    two bytes (a bfloat16 is exact), so the codes become float32 with no int -> float conversion:
    two ``pshufb`` tables (:data:`MXFP4_BYTES`) give the top two bytes, ``punpck{l,h}bw`` pairs
    them into words and a shift left by 16 (even words) or an AND of the high halves (odd ones)
    makes the dwords: 10 vector instructions a block to its 32 float32 and one load for ``d``,
    where the kvalue bytes, a ``pshufb`` of each into an int32's high byte and ``cvtdq2ps`` took 11
    and ``d`` 9 (a block 20 instructions in all, from 31; docs/performance.md, "The float32 mode's
    decode kernels"). Each 32 inputs come in
    :data:`MXFP4_ORDER`. Without ``exact`` the kvalues themselves, one group a block scaled by
    ``d``; with ``exact`` the weights ``d * kvalue`` (exact: a power of two times a small integer,
    gguf-py's float32 product)."""
    b, c64 = k.b, k.c64
    v16, v32, vi = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32), ir.VectorType(_I32, LANES)
    pshufb = b.module.declare_intrinsic("llvm.x86.avx2.pshuf.b", (), ir.FunctionType(v32, [v32, v32]))
    codes = k.load(qs, b.add(qb, c64(1)), v16)
    # the 16 bytes in both halves of a ymm, the upper shifted by 4: low nibbles, then high ones
    both = b.lshr(b.bitcast(b.shuffle_vector(codes, ir.Constant(v16, None), _const(list(range(16)) * 2, _I32)), vi),
                  _const([0] * 4 + [4] * 4, _I32))
    nibbles = b.and_(b.bitcast(both, v32), _const([15] * 32))
    byte2, byte3 = (b.call(pshufb, [_const(table * 2), nibbles]) for table in MXFP4_BYTES)
    kvs = []
    for h in (0, 1):                             # punpcklbw, punpckhbw: inputs 8h + j, 16 + 8h + j
        pairs = [i for lane in (0, 16) for j in range(8) for i in (lane + 8 * h + j, 32 + lane + 8 * h + j)]
        words = b.bitcast(b.shuffle_vector(byte2, byte3, _const(pairs, _I32)), vi)
        for odd, v in enumerate((b.shl(words, _const([16] * LANES, _I32)),
                                 b.and_(words, _const([-0x10000] * LANES, _I32)))):
            kvs.append((b.bitcast(v, k.vf), 8 * (2 * h + odd)))
    d = b.load(b.gep(e8m0_half_table(b.module), [ir.Constant(_I64, 0), b.zext(k.load(qs, qb, _I8), _I64)]), align=4)
    if exact:
        dv = k.splat(d, k.vf)
        return ((b.fmul(dv, v), off) for v, off in kvs), None
    return [(kvs, d)], None


def _q8_0_block(k: VectorTile, qs, qb, exact: bool):
    """Q8_0 (d, qs int8[32]): input l is ``qs[l]``; the quants come times 2**24 and the scale is
    ``d * 2**-24`` (d an fp16: a normal float32 still), so the weights (with ``exact``)
    ``(d * 2**-24) * (q * 2**24)`` are gguf-py's ``d * q``."""
    b, c64 = k.b, k.c64
    q = k.load(qs, b.add(qb, c64(2)), ir.VectorType(_I8, 32))
    d = b.fmul(_half(k, qs, qb), ir.Constant(k.f32, _TOP))
    qv = [(_widen(k, q, g, True), 8 * g) for g in range(4)]
    if exact:
        dv = k.splat(d, k.vf)
        return ((b.fmul(dv, v), off) for v, off in qv), None
    return [(qv, d)], None


def _q6k_wide(k: VectorTile, qs, qb, u, convert: bool = False):
    """Q6_K for one slot on zmm (:data:`WIDE`, ``k`` of 16 lanes): :func:`_q6k_groups`'s groups of
    c and c + 1 side by side, made in registers. Per half h: the 64 ``ql`` bytes (those of c = 0, 2
    in the lower 32, of c = 1, 3 in the upper) and the 32 ``qh`` bytes in both halves give the
    quants of c = 0 | 1 and c = 2 | 3 on 64 bytes (:func:`~llamatrace.kernels.types.f32_ir.q6k_quants`
    with the shifts of each half in a 64-bit shift: the bits it moves across bytes are masked off),
    then :func:`_widen`: vector g is c's vector g beside c + 1's (x in :data:`WIDE_ORDER`). A
    group's lanes' scales and sums of x are c's beside c + 1's too, and the 16 lanes of sums are
    the ymm kernel's two vectors of sums (even c, odd c) side by side: the same bits. With
    ``convert`` (the several slots' kernel, :func:`_slots_wide_ir`) the quants are converted, not
    read as subnormals."""
    b, c64 = k.b, k.c64
    v64, vq = ir.VectorType(_I8, 64), ir.VectorType(_I64, 8)
    d = _half(k, qs, b.add(qb, c64(208)))
    sc = k.load(qs, b.add(qb, c64(192)), ir.VectorType(_I8, 16))
    dsc = b.fmul(b.fmul(k.splat(d, k.vf), b.sitofp(sc, k.vf)), k.splat(u, k.vf))       # the 16 (d*sc) * u

    def cst(v):
        return _const([v] * 64)

    def shift(v, lower, upper, right):           # bits of 64-bit lanes, by ``lower`` / ``upper`` in each half
        by = _const([lower] * 4 + [upper] * 4, _I64)
        v = b.bitcast(v, vq)
        return b.bitcast(b.lshr(v, by) if right else b.shl(v, by), v64)

    groups = []
    for h in range(2):
        ql = k.load(qs, b.add(qb, c64(64 * h)), v64)
        qh = k.load(qs, b.add(qb, c64(128 + 32 * h)), ir.VectorType(_I8, 32))
        qh = b.shuffle_vector(qh, ir.Constant(qh.type, None), _const(list(range(32)) * 2, _I32))
        pairs = (b.or_(b.and_(ql, cst(15)), b.and_(shift(qh, 4, 2, False), cst(0x30))),
                 b.or_(b.and_(shift(ql, 4, 4, True), cst(15)), b.and_(shift(qh, 0, 2, True), cst(0x30))))
        for p, q in enumerate(pairs):
            first = 8 * h + 4 * p                # the scale of the pair's first 16 inputs
            pick = _const([first + i // 4 for i in range(16)], _I32)
            lanes = b.shuffle_vector(dsc, ir.Constant(dsc.type, None), pick)
            groups.append(([(_widen(k, q, g, False, raw=not convert), 128 * h + 64 * p + 16 * g) for g in range(4)],
                           lanes, 8 * (4 * h + 2 * p)))
    return groups, None


def _q4k_wide(k: VectorTile, qs, qb, u, convert: bool = False):
    """Q4_K for one slot on zmm (:data:`WIDE`, ``k`` of 16 lanes), no byte shuffles: 64 bytes of
    quants (chunks j, j + 1: sub-blocks 2j, 2j + 1 in the low and high nibbles of the lower 32
    bytes, 2j + 2, 2j + 3 of the upper) are 16 int32 lanes, and nibble h of byte b of each is kept
    where it is by an AND with ``0xF << e`` (:data:`Q4K_BITS`; byte 3's after a shift right by 8 so
    that ``q << e`` stays below 2**24). Those lanes read as float32 are ``q * 2**(e - 149)``
    (subnormal, or the exponent field 1 from 2**23 on: the same line), or are converted to ``q * 2**e``
    where :data:`~llamatrace.kernels.tiles.SUBNORMAL_BIAS` is 0 or with ``convert`` (the several
    slots' kernel, :func:`_slots_wide_ir`); x comes times ``2**-e``
    (:data:`Q4K_ORDER`), so each product is the ymm kernel's. A group is the four bytes of nibble
    h of two chunks: lanes 0..7 sub-block 2j + h, 8..15 2j + 2 + h, its scale the vector of their
    ``(d*sc) * u``. ANDs run on all four of Zen 4's vector pipes where ``vpshufb`` runs on two; the
    sums differ from the ymm kernel's by float32 rounding (each lane sums 4 inputs in a row)."""
    b, c64 = k.b, k.c64
    k8 = VectorTile(b, 8)
    vi = ir.VectorType(_I32, 16)
    d, dmin = _half(k, qs, qb), _half(k, qs, b.add(qb, c64(2)))
    sc, mn = _q4k_scales(k8, qs, qb)
    dsc = b.fmul(b.fmul(k8.splat(d, k8.vf), b.sitofp(sc, k8.vf)), k8.splat(u, k8.vf))
    dmn = b.fmul(k8.splat(dmin, k8.vf), b.sitofp(mn, k8.vf))
    groups = []
    for j in (0, 2):
        q = k.load(qs, b.add(qb, c64(16 + 32 * j)), vi)
        top = b.lshr(q, _const([8] * 16, _I32))
        for h in (0, 1):
            nibbles = [b.and_(q if n < 3 else top, _const([15 << Q4K_BITS[n][h]] * 16, _I32)) for n in range(4)]
            vecs = [(b.sitofp(v, k.vf) if convert else quants_as_float(b, v), 64 * j + 64 * h + 16 * n)
                    for n, v in enumerate(nibbles)]
            pick = _const([2 * j + h] * 8 + [2 * j + 2 + h] * 8, _I32)         # sub-blocks 2j + h, 2j + 2 + h
            lanes = b.shuffle_vector(dsc, ir.Constant(dsc.type, None), pick)
            groups.append((vecs, lanes))
    return groups, dmn


with np.errstate(over="ignore"):
    MXFP4_WEIGHTS = E8M0_HALF_TABLE[:256, None] * np.array(gguf.quants.MXFP4.kvalues, np.float32)
"""float32 [256, 16]: ``MXFP4_WEIGHTS[e, c]`` = ``2**(e - 128) * kvalues[c]``, gguf-py's weight of code c
in a block of scale byte e (its float32 product: exact, as gguf-py's, or as gguf-py's inf for the larger
codes of e 253..255, where ``d * (x . kvalue)`` would stay finite; no published file has such scales)."""


def _mxfp4_weights_table(module):
    """The module's constant :data:`MXFP4_WEIGHTS`, 64-byte aligned: one zmm load a block."""
    return constant_table(module, "llamatrace_mxfp4_weights", lambda: ir.Constant(
        ir.ArrayType(ir.FloatType(), MXFP4_WEIGHTS.size), [float(v) for v in MXFP4_WEIGHTS.reshape(-1)]), align=64)


def _mxfp4_wide(k: VectorTile, qs, qb):
    """MXFP4 for one slot on zmm (:data:`WIDE`, ``k`` of 16 lanes): the block's 16 weights of each
    code, ``2**(e - 128) * kvalues`` (one aligned load from :data:`MXFP4_WEIGHTS`), and the 16 code
    bytes widened to int32 lanes (``vpmovzxbd``); the low nibbles (inputs 0..15, x in its natural
    order) and the high ones after a shift right by 4 (16..31) each pick their weights by one
    ``vpermps`` (it reads only an index's low 4 bits: no AND). One group of the two vectors of
    weights, no scale: each goes into its chain of sums by one FMA, and a block takes 6 vector
    operations where ``d * (x . kvalue)`` took 7 (docs/performance.md, "f32 decode: MXFP4's
    one-slot kernel on zmm")."""
    b, c64 = k.b, k.c64
    vi = ir.VectorType(_I32, 16)
    permps = b.module.declare_intrinsic("llvm.x86.avx512.permvar.sf.512", (), ir.FunctionType(k.vf, [k.vf, vi]))
    e = b.zext(k.load(qs, qb, _I8), _I64)
    table = b.bitcast(_mxfp4_weights_table(b.module), k.f32.as_pointer())
    weights = k.load(table, b.mul(e, c64(16)), k.vf, 64)
    codes = b.zext(k.load(qs, b.add(qb, c64(1)), ir.VectorType(_I8, 16)), vi)
    nibbles = (codes, b.lshr(codes, _const([4] * 16, _I32)))
    return [([(b.call(permps, [weights, idx]), 16 * h) for h, idx in enumerate(nibbles)], None)], None


_BLOCK = {"q4k": _q4k_block, "q6k": _q6k_block, "mxfp4": _mxfp4_block, "q8_0": _q8_0_block}
_WIDE_BLOCK = {"q4k": _q4k_wide, "q6k": _q6k_wide, "mxfp4": _mxfp4_wide}


# --------------------------------------------------------------------------------------------
# one slot: a work item's tile of rows in one kernel


AHEAD = {"q4k": 4096, "q6k": 4096, "mxfp4": 8192 if WIDE else 4096, "q8_0": 4096}
"""Bytes ahead of the block being read that each block asks into L2: the file's 4 KiB pages stop
the hardware's prefetch at every page, which a running read does not. MXFP4's zmm kernel
(gpt-oss-4's experts of a decode step, one thread, cold, Zen 4): 4 KiB 10.8, 8 KiB 12.8, 16 KiB
12.7 GB/s; the ymm one keeps 4 KiB (not measured since)."""


def _eight_lanes(k: VectorTile, v):
    """The 8 float32 lanes ``v`` as a vector of ``k``'s lanes, zeros above (on zmm)."""
    if k.lanes == 8:
        return v
    return k.b.shuffle_vector(v, ir.Constant(v.type, [0.0] * 8), _const(range(k.lanes), _I32))


def _one_slot_block(k: VectorTile, rows, x, xb, sums_at, subnormal: bool = False):
    """One slot's sums of one block of each of ``rows`` (``(groups, mins, accs)``: :data:`_BLOCK`'s
    groups and mins of the row's block, its vectors of sums), x at ``xb`` of ``x`` (the block's
    sums of x at ``sums_at``: Q4_K's per sub-block, Q6_K's per lane), a group after the other: each
    group's products summed (one chain a group: the groups overlap), less the vector of sums at
    the group's third item if it has one (Q6_K), then times its scale (a float or a vector of the
    lanes' scales); a group whose scale is None holds the weights themselves (:func:`_mxfp4_wide`):
    its vector n goes by one FMA into sums n. The rows share each load of x. Returns each row's new ``accs``. With
    ``subnormal`` (the quants are float32 subnormals) each chain starts as an FMA into zero, not a
    multiply: a ``vmulps`` with a subnormal input ran the Q4_K kernel at half speed on Zen 3, an FMA
    at full (docs/performance.md)."""
    b, c64 = k.b, k.c64
    out = [list(accs) for _, _, accs in rows]
    for turn, parts in enumerate(zip(*(groups for groups, _, _ in rows))):
        if parts[0][1] is None:                      # the weights themselves: vector n into sums n
            for n, vecs in enumerate(zip(*(part[0] for part in parts))):
                xv = k.load(x, b.add(xb, c64(vecs[0][1])), k.vf, 4)
                for accs, (w, _) in zip(out, vecs):
                    accs[n % len(accs)] = k.fma(w, xv, accs[n % len(accs)])
            continue
        dots = [None] * len(rows)
        for n, vecs in enumerate(zip(*(part[0] for part in parts))):
            xv = k.load(x, b.add(xb, c64(vecs[0][1])), k.vf, 4)
            dots = [chain(k, None if n == 0 else dot, w, xv, subnormal) for (w, _), dot in zip(vecs, dots)]
        for accs, part, dot in zip(out, parts, dots):
            scale = part[1]
            if len(part) == 3:
                dot = b.fsub(dot, k.load(x, b.add(sums_at, c64(part[2])), k.vf, 4))
            sv = scale if isinstance(scale.type, ir.VectorType) else k.splat(scale, k.vf)
            j = turn % len(accs)
            accs[j] = k.fma(sv, dot, accs[j])
    if rows[0][1] is not None:                           # Q4_K: - (dmin*mn) * sum(x) per sub-block
        xs = _eight_lanes(k, k.load(x, sums_at, ir.VectorType(k.f32, 8), 4))
        for accs, (_, mins, _) in zip(out, rows):
            accs[-1] = k.fma(_eight_lanes(k, b.fneg(mins)), xs, accs[-1])
    return out


SUBNORMAL = ("q4k", "q6k")
"""The kinds whose one-slot kernel reads its (unsigned) quants as float32 subnormals, no
conversion: :data:`KIND` 0 and 1, their x scaled by :func:`_matmul_id`; DAZ is off while they run
(:func:`llamatrace.kernels.tiles.daz_off`)."""

ROWS_1 = {"q6k": 2}
"""Weight rows one slot's ymm kernel runs at once (:func:`_tile_ir`; 1 for the kinds not named): Q6_K's
two rows share their loads of x (1.07x; Q4_K and MXFP4 ran no faster so)."""
ROWS_1_WIDE = {"q6k": 2, "mxfp4": 2, "q4k": 2}
"""The same on zmm (:data:`WIDE`): MXFP4 takes two as well (:func:`_mxfp4_wide`: its two chains a
row, one FMA a block each, wait on the FMA's latency with one row; 1.12x with two), and Q4_K (with
one vector of sums a row: a step's f32 experts 1.02-1.06x on qwen3moe-8, three rows 0.92-0.95x)."""

ACC_1 = {"q4k": 1}
"""Vectors of sums a row of one slot keeps in registers (:func:`_tile_ir`; 2 for the kinds not
named): each group's products are a chain of their own, so few suffice; Q4_K ran 1.05x with one
than with two (its 9 FMAs a block into it are not what bounds it)."""
ACC_1_WIDE = {"q6k": 1, "q4k": 1}
"""The same on zmm (:data:`WIDE`): Q6_K one (the ymm kernel's two side by side), Q4_K one (its two
rows' chains overlap; one row with one: 0.98-1.03x), MXFP4 two (the low nibbles' products and the
high ones')."""


def _tile_ir(kind: str, k: VectorTile, qs, q_at, row_bytes, n_rows, n_blocks, x, x_at, out, out_at):
    """One slot's products with ``n_rows`` (>= 1) weight rows of ``n_blocks`` blocks (row i's block
    0 at byte ``q_at + i * row_bytes`` of ``qs``): ``out[out_at + i]`` = row i times the x at
    ``x_at`` of ``x`` (laid out as :func:`_matmul_id` lays it out). The loops over the rows and
    their blocks are one kernel, the sums in registers from a row's first block to its last (no
    buffer and no call a row)."""
    b, c64 = k.b, k.c64
    _, per_block, block_bytes, sums = _KINDS[kind]
    sums_at = b.add(x_at, b.mul(n_blocks, c64(per_block)))
    wide = k.lanes == 16                 # zmm: Q6_K's one vector is the ymm kernel's two side by side
    n_acc = (ACC_1_WIDE if wide else ACC_1).get(kind, 2)
    block_of = _WIDE_BLOCK[kind] if wide else functools.partial(_BLOCK[kind], exact=False)
    ahead = AHEAD[kind]
    extra = {}
    if kind in SUBNORMAL:                # x times 2**K, the row's sums, then 2**(149 - K)
        extra["u"] = k.load(x, b.add(sums_at, b.mul(n_blocks, c64(sums))), k.f32, 4)

    def rows(r, n):                  # rows r .. r + n - 1 at once: each load of x serves the n rows
        q_row = [b.add(q_at, b.mul(b.add(r, c64(i)), row_bytes)) for i in range(n)]

        def block(i, accs):
            blocks = []
            for j, q in enumerate(q_row):
                qb = b.add(q, b.mul(i, c64(block_bytes)))
                k.prefetch(ir.Constant(ir.IntType(1), 1), qs, b.add(qb, c64(ahead)), range(-(-block_bytes // 64)))
                groups, mins = block_of(k, qs, qb, **extra)
                blocks.append((groups, mins, accs[j * n_acc:(j + 1) * n_acc]))
            new = _one_slot_block(k, blocks, x, b.add(x_at, b.mul(i, c64(per_block))), b.add(sums_at, b.mul(i, c64(sums))),
                                  kind in SUBNORMAL)
            return [v for accs in new for v in accs]

        sums_ = k.block_loop(n_blocks, n_acc * n, block)
        for j in range(n):
            total = k.lane_sum(sums_[j * n_acc:(j + 1) * n_acc])
            b.store(total, k.ptr(out, b.add(out_at, b.add(r, c64(j))), k.f32), align=4)

    step = (ROWS_1_WIDE if wide else ROWS_1).get(kind, 1)
    n_steps = b.udiv(n_rows, c64(step))
    k.block_loop(n_steps, 0, lambda i, _: rows(b.mul(i, c64(step)), step) or [])
    if step > 1:                                         # the last n_rows % step rows one by one
        tail = b.mul(n_steps, c64(step))
        k.block_loop(b.sub(n_rows, tail), 0, lambda i, _: rows(b.add(tail, i), 1) or [])


def _tile_intrinsic(kind: str):
    def typer(typingctx, qs, q_at, row_bytes, n_rows, n_blocks, x, x_at, out, out_at):
        if not (isinstance(qs, types.Array) and qs.dtype == types.uint8 and isinstance(x, types.Array)
                and x.dtype == types.float32 and isinstance(out, types.Array) and out.dtype == types.float32):
            return None
        sig = types.void(qs, q_at, row_bytes, n_rows, n_blocks, x, x_at, out, out_at)

        def codegen(context, builder, signature, args):
            flat = list(args)
            for i in (0, 5, 7):
                flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
            k = VectorTile(builder, 16 if WIDE and kind in _WIDE_BLOCK else LANES)
            for i in (1, 2, 3, 4, 6, 8):
                flat[i] = k.i64(flat[i])
            saved = daz_off(builder) if kind in SUBNORMAL else None       # None: no subnormals here
            _tile_ir(kind, k, *flat)
            if saved is not None:
                daz_restore(builder, saved)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"tile_{kind}"
    typer.__doc__ = f"{kind} one-slot kernel over a tile's rows: :func:`_tile_ir`."
    return intrinsic(typer)


_tile_q4k, _tile_q6k, _tile_mx, _tile_q8 = (_tile_intrinsic(kind) for kind in _KINDS)


@njit(**JIT_INLINE)
def _tile(kind, qs, q_at, row_bytes, n_rows, n_blocks, x, x_at, out, out_at):
    """The one-slot kernel of ``kind`` (:data:`KIND`): :func:`_tile_ir`."""
    if kind == 0:
        _tile_q4k(qs, q_at, row_bytes, n_rows, n_blocks, x, x_at, out, out_at)
    elif kind == 1:
        _tile_q6k(qs, q_at, row_bytes, n_rows, n_blocks, x, x_at, out, out_at)
    elif kind == 2:
        _tile_mx(qs, q_at, row_bytes, n_rows, n_blocks, x, x_at, out, out_at)
    else:
        _tile_q8(qs, q_at, row_bytes, n_rows, n_blocks, x, x_at, out, out_at)


@intrinsic
def _total(typingctx, acc, at):
    """The sum of the 8 float32 lanes at ``at`` of ``acc`` (:meth:`VectorTile.lane_sum`)."""
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
        return None

    def codegen(context, b, signature, args):
        k = VectorTile(b, LANES)
        data = context.make_array(signature.args[0])(context, b, args[0]).data
        return k.lane_sum([k.load(data, k.i64(args[1]), k.vf, 4)])

    return types.float32(acc, at), codegen


@intrinsic
def _totals8(typingctx, acc, at, stride, out, out_at):
    """``out[out_at + j]`` = the sum of the 8 float32 lanes at ``at + j * stride`` of ``acc``, j < 8,
    each summed in :func:`_total`'s order (so bit for bit its sum): the 8 vectors transposed
    while they are added (``vperm2f128``, ``vshufps``: 14 shuffles and 7 adds for the 8 sums, where
    8 :func:`_total` calls take 8 times 3 adds and 3 shuffles, and 8 scalar stores). NumPy twin:
    :func:`totals8_np`."""
    if not all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (acc, out)):
        return None

    def codegen(context, b, signature, args):
        k = VectorTile(b, LANES)
        data, dst = (context.make_array(signature.args[i])(context, b, args[i]).data for i in (0, 3))
        at, stride, out_at = (k.i64(args[i]) for i in (1, 2, 4))
        a = [k.load(data, b.add(at, b.mul(stride, k.c64(j))), k.vf, 4) for j in range(8)]

        def shuf(u, v, idx):
            return b.shuffle_vector(u, v, _const(idx, _I32))

        # lanes l and l + 4 of rows j and j + 4 side by side: [a_j lo + hi | a_{j+4} lo + hi]
        h = [b.fadd(shuf(a[j], a[j + 4], [0, 1, 2, 3, 8, 9, 10, 11]),
                    shuf(a[j], a[j + 4], [4, 5, 6, 7, 12, 13, 14, 15])) for j in range(4)]
        # (m, m + 2) pairs of rows 2i, 2i + 1 (and + 4): [s0 s1 of row 2i, s0 s1 of 2i + 1 | the same + 4]
        p = [b.fadd(shuf(h[2 * i], h[2 * i + 1], [0, 1, 8, 9, 4, 5, 12, 13]),
                    shuf(h[2 * i], h[2 * i + 1], [2, 3, 10, 11, 6, 7, 14, 15])) for i in range(2)]
        total = b.fadd(shuf(p[0], p[1], [0, 2, 8, 10, 4, 6, 12, 14]), shuf(p[0], p[1], [1, 3, 9, 11, 5, 7, 13, 15]))
        b.store(total, k.ptr(dst, out_at, k.vf), align=4)
        return context.get_dummy_value()

    return types.void(acc, at, stride, out, out_at), codegen


def totals8_np(acc: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`_totals8` (and of :func:`_total` a row): float32 ``[m, 8]`` -> ``[m]``,
    ``((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`` in float32."""
    v = acc[:, :4] + acc[:, 4:]
    w = v[:, :2] + v[:, 2:]
    return w[:, 0] + w[:, 1]


# --------------------------------------------------------------------------------------------
# several slots: a chunk of a tile's rows dequantized into L1, then a register-blocked product


X_CHUNK = 6144
"""float32 of the slots' x one chunk of inputs covers (24 KiB) while the tile's rows use it."""
W_CHUNK = 4096
"""float32 of dequantized weights (2 or 4 of a tile's rows, a chunk of inputs each) at once (16 KiB;
3 rows take 2 rows' chunk, :func:`_slots_tile`)."""
PF_ROWS = 4
"""Rows ahead of the one dequantized that the first chunk of a tile asks into the caches, whole:
the later chunks find the tile there (a row's blocks are read a chunk at a time, too little of
a 4 KiB page for the hardware's prefetch)."""


@njit(**JIT_INLINE)
def gemm_plan(n):
    """How :func:`_slots_tile` runs ``n`` >= 2 slots: (calls, slots of the smaller calls, calls with
    one slot more, weight rows a call), the calls as even as can be. Each call keeps 8 or more FMA
    chains in flight (Zen 3: latency 4, 2 a cycle) and its sums, weights and x in AVX2's 16
    registers, with as few loads an FMA as that allows: 3 rows x up to 4 slots (3 x 4: 7 loads
    for 12 FMAs, 1.2x 2 x 4's 6 for 8 in L1), 2 x 5 and 2 x 6 for 5 and 6 slots (3 x 2 would be
    6 chains), 4 x 2 for 2 (docs/performance.md, "f32 experts in a prefill: three rows")."""
    if n == 2:
        return 1, 2, 0, 4
    if n == 5 or n == 6:
        return 1, n, 0, 2
    n_call = (n + 3) // 4
    return n_call, n // n_call, n % n_call, 3


def _deq_ir(kind: str, k: VectorTile, qs, q_at, blk0, n_blk, w, w_at) -> None:
    """Blocks ``blk0 .. blk0 + n_blk`` (n_blk >= 1) of one weight row (block 0 at byte ``q_at`` of
    ``qs``) as float32 at ``w_at`` of ``w``, block i's weights from ``w_at + i * per_block``, each
    32 inputs in the kind's order (:func:`x_order`): gguf-py's values bit for bit (the block functions' ``exact``)."""
    b, c64 = k.b, k.c64
    _, per_block, block_bytes, _ = _KINDS[kind]

    def body(i, _):
        blk = b.add(blk0, i)
        qb = b.add(q_at, b.mul(blk, c64(block_bytes)))
        at = b.add(w_at, b.mul(i, c64(per_block)))
        groups, _ = _BLOCK[kind](k, qs, qb, True)
        for v, off in groups:
            b.store(v, k.ptr(w, b.add(at, c64(off)), k.vf), align=4)
        return []

    k.block_loop(n_blk, 0, body)


def _deq_intrinsic(kind: str):
    def typer(typingctx, qs, q_at, blk0, n_blk, w, w_at):
        if not (isinstance(qs, types.Array) and qs.dtype == types.uint8 and isinstance(w, types.Array)
                and w.dtype == types.float32):
            return None

        def codegen(context, builder, signature, args):
            flat = list(args)
            for i in (0, 4):
                flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
            k = VectorTile(builder, LANES)
            for i in (1, 2, 3, 5):
                flat[i] = k.i64(flat[i])
            _deq_ir(kind, k, *flat)
            return context.get_dummy_value()

        return types.void(qs, q_at, blk0, n_blk, w, w_at), codegen

    typer.__name__ = f"deq_{kind}"
    typer.__doc__ = f"{kind} blocks of one row dequantized: :func:`_deq_ir`."
    return intrinsic(typer)


_deq_q4k, _deq_q6k, _deq_mx, _deq_q8 = (_deq_intrinsic(kind) for kind in _KINDS)


@njit(**JIT_INLINE)
def _deq(kind, qs, q_at, blk0, n_blk, w, w_at):
    if kind == 0:
        _deq_q4k(qs, q_at, blk0, n_blk, w, w_at)
    elif kind == 1:
        _deq_q6k(qs, q_at, blk0, n_blk, w, w_at)
    elif kind == 2:
        _deq_mx(qs, q_at, blk0, n_blk, w, w_at)
    else:
        _deq_q8(qs, q_at, blk0, n_blk, w, w_at)


def _gemm_ir(rows: int, slots: int, k: VectorTile, w, w_at, ldw, x, x_at, ldx, n_vec, acc, acc_at, lda) -> None:
    """``acc[acc_at + r*lda + 8s + l] += sum_{i < n_vec} w[w_at + r*ldw + 8i + l] * x[x_at + s*ldx + 8i + l]``
    for ``r < rows``, ``s < slots``, lanes ``l < 8``: each sum one FMA chain over i from zero."""
    b, c64 = k.b, k.c64
    w_rows = [b.add(w_at, b.mul(ldw, c64(r))) for r in range(rows)]
    x_rows = [b.add(x_at, b.mul(ldx, c64(s))) for s in range(slots)]

    def body(i, sums):
        o = b.mul(i, c64(LANES))
        wv = [k.load(w, b.add(wr, o), k.vf, 4) for wr in w_rows]
        new = list(sums)
        for s, xr in enumerate(x_rows):
            xv = k.load(x, b.add(xr, o), k.vf, 4)
            for r in range(rows):
                new[r * slots + s] = k.fma(wv[r], xv, sums[r * slots + s])
        return new

    sums = k.block_loop(n_vec, rows * slots, body)
    for r in range(rows):
        for s in range(slots):
            at = b.add(acc_at, b.add(b.mul(lda, c64(r)), c64(s * LANES)))
            old = k.load(acc, at, k.vf, 4)
            b.store(b.fadd(old, sums[r * slots + s]), k.ptr(acc, at, k.vf), align=4)


def _pairs() -> tuple[tuple[int, int], ...]:
    pairs = set()
    for n in range(2, 64):                        # the plans repeat from here on
        _, base, extra, rows = (int(v) for v in gemm_plan.py_func(n))
        for ns in {base, base + (1 if extra else 0)}:
            pairs.update((m, ns) for m in range(1, rows + 1))
    return tuple(sorted(pairs, reverse=True))


GEMM_PAIRS = _pairs()
"""(rows, slots) of the microkernel calls :func:`_slots_tile` makes (:func:`gemm_plan`), with fewer
rows for the rows a tile has left."""
_KEY = 1 + max(s for _, s in GEMM_PAIRS)


@intrinsic
def _gemm_pair(typingctx, rows, slots, w, w_at, ldw, x, x_at, ldx, n_vec, acc, acc_at, lda):
    """:func:`_gemm_ir` for each of :data:`GEMM_PAIRS`, ``(rows, slots)`` choosing one (another
    pair does nothing)."""
    if not all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (w, x, acc)):
        return None

    def codegen(context, builder, signature, args):
        flat = list(args)
        for i in (2, 5, 9):
            flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
        k = VectorTile(builder, LANES)
        for i in (0, 1, 3, 4, 6, 7, 8, 10, 11):
            flat[i] = k.i64(flat[i])
        key = builder.add(builder.mul(flat[0], k.c64(_KEY)), flat[1])
        done = builder.append_basic_block("gemm_done")
        switch = builder.switch(key, done)
        for r, n in GEMM_PAIRS:
            case = builder.append_basic_block(f"gemm_{r}x{n}")
            switch.add_case(k.c64(r * _KEY + n), case)
            builder.position_at_end(case)
            _gemm_ir(r, n, k, *flat[2:])
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.void(rows, slots, w, w_at, ldw, x, x_at, ldx, n_vec, acc, acc_at, lda), codegen


@njit(**JIT_INLINE)
def _gemm(rows, slots, w, w_at, ldw, x, x_at, ldx, n_vec, acc, acc_at, lda):
    """The microkernel for ``rows`` weight rows and ``slots`` slots, one of :data:`GEMM_PAIRS`: :func:`_gemm_ir`."""
    _gemm_pair(rows, slots, w, w_at, ldw, x, x_at, ldx, n_vec, acc, acc_at, lda)


def deq_np(blocks: np.ndarray, ggml_type) -> np.ndarray:
    """NumPy twin of :func:`_deq`: uint8 ``[n_blk * block_bytes]`` (one row's blocks) -> float32
    ``[n_blk * per_block]``, ``gguf.quants.dequantize``'s weights with each 32 in :func:`x_order`."""
    w = np.asarray(gguf.quants.dequantize(blocks, ggml_type), dtype=np.float32).reshape(-1, 32)
    return np.ascontiguousarray(w[:, x_order(ggml_type)]).reshape(-1)


def gemm_np(w: np.ndarray, x: np.ndarray, acc: np.ndarray) -> None:
    """NumPy twin of :func:`_gemm`: ``acc[r, s, l] += sum_i w[r, 8i + l] * x[s, 8i + l]`` (float64
    sums, added in float32) for w float32 ``[rows, 8n]``, x ``[slots, 8n]``, acc ``[rows, slots, 8]``."""
    prod = w.astype(np.float64)[:, None, :] * x.astype(np.float64)[None, :, :]
    acc += prod.reshape(w.shape[0], x.shape[0], -1, LANES).sum(axis=2).astype(np.float32)


@njit(**JIT_INLINE)
def _slots_tile(kind, per_block, qs, e, r0, r1, n_blocks, xe, first, n, acc):
    """Rows ``r0 .. r1`` of expert ``e`` (``qs`` uint8 ``[n_expert, n_out, row_bytes]``) times the
    ``n`` >= 2 slots ``first ..`` of ``xe`` (as :func:`_matmul_id` lays them out): their sums per
    lane added to ``acc`` (float32, ``[r1 - r0, n, LANES]`` flat). A chunk of inputs at a time (the
    slots' x over it in L1), the tile's rows a few at a time are dequantized into a scratch and
    multiplied into the slots, a few slots a call (:func:`gemm_plan`)."""
    n_out, row_bytes = qs.shape[1], qs.shape[2]
    width = xe.shape[1]
    n_call, base, extra, rows = gemm_plan(n)
    # 3 rows take 2 rows' chunk: the passes, so the sums' bits, are those of 2 rows a call (the
    # plan before 3 rows)
    per_pass = max(1, min(X_CHUNK // (n * per_block), W_CHUNK // ((2 if rows == 3 else rows) * per_block)))
    ldw = per_pass * per_block
    w = np.empty(rows * ldw, np.float32)
    for b0 in range(0, n_blocks, per_pass):
        n_blk = min(per_pass, n_blocks - b0)
        n_vec = n_blk * per_block // LANES
        for r in range(r0, r1, rows):
            m = min(rows, r1 - r)
            for j in range(m):
                q_at = (e * n_out + r + j) * row_bytes
                if b0 == 0 and q_at + (PF_ROWS + 1) * row_bytes <= qs.size:
                    for o in range(0, row_bytes, 64):  # the first pass asks for whole rows ahead
                        prefetch(qs, q_at + PF_ROWS * row_bytes + o)
                _deq(kind, qs, q_at, b0, n_blk, w, j * ldw)
            s0 = 0
            for i in range(n_call):
                ns = base + (1 if i < extra else 0)
                x_at = (first + s0) * width + b0 * per_block
                at = ((r - r0) * n + s0) * LANES
                _gemm(m, ns, w, 0, ldw, xe, x_at, width, n_vec, acc, at, n * LANES)
                s0 += ns


# --------------------------------------------------------------------------------------------
# several slots of Q4_K or Q6_K on zmm: the weights made once in registers, each multiplied into every slot


SLOTS_WIDE = 8
"""Most slots :func:`_slots_wide_ir` takes at a time (a variant for each count 1..8)."""
ROWS_WIDE = 2
"""Weight rows it takes at a time: their weights share each load of x."""
SLOTS_KINDS = ("q4k", "q6k")
"""The kinds whose several slots run :func:`_slots_wide` on zmm (the others: :func:`_slots_tile`)."""


def _slots_wide_ir(kind: str, n_slots: int, k: VectorTile, qs, q_at, row_bytes, n_rows, n_blk, x, x_at, x_stride,
                   sums_at, out, out_at, add) -> None:
    """``n_slots`` slots times ``n_rows`` Q4_K or Q6_K rows on zmm, ``n_blk`` blocks of each (row i's
    first at byte ``q_at + i * row_bytes`` of ``qs``): ``out[out_at + s * TR + i]`` = (``add``:
    plus) the sum of slot s's products with row i (an odd ``n_rows`` < TR also writes row
    ``n_rows``: its last row again, in the slot's unused part of ``out``). Slot s's x starts at
    ``x_at + s * x_stride`` of ``x`` in :func:`alone_layout`'s order (Q4_K's times
    ``2**-Q4K_EXP``), unscaled (no 2**K); Q4_K's sums per 32 inputs at ``sums_at + s * x_stride``.
    A block's 16 vectors of quants are converted and made the weights (Q4_K: times their lanes'
    ``d*sc``, exact, :func:`_q4k_wide`; Q6_K: ``fma(q, d*sc, -32 d*sc)``, :func:`_q6k_wide`), each
    vector once for every slot: one
    FMA a slot into the slot's vector of sums, ``ROWS_WIDE`` rows sharing each load of x; Q4_K
    then ``- (dmin*mn) * sum(x)`` per sub-block. Where the one-slot kernel takes 21 FMAs a Q4_K
    block and :func:`_slots_tile` writes and reads its weights through L1, this takes
    ``16 (n_slots + 1)`` FMAs and multiplies."""
    b, c64 = k.b, k.c64
    v8 = ir.VectorType(k.f32, 8)
    on, one = ir.Constant(ir.IntType(1), 1), ir.Constant(k.f32, 1.0)
    adding = b.icmp_signed("!=", add, c64(0))
    block_bytes = _KINDS[kind][2]
    minus32 = k.splat(ir.Constant(k.f32, -32.0), k.vf)

    def weights(group):                          # a group's vectors of weights, with their positions
        vecs, lanes = group[0], group[1]
        if kind == "q4k":
            return [(b.fmul(v, lanes), off) for v, off in vecs]
        low = b.fmul(lanes, minus32)
        return [(k.fma(v, lanes, low), off) for v, off in vecs]

    def rows(i):                             # rows i, i + 1 (an odd count's last: its last row twice)
        last = b.sub(n_rows, c64(1))
        q_rows = [b.add(q_at, b.mul(b.select(b.icmp_signed("<", b.add(i, c64(r)), n_rows), b.add(i, c64(r)), last),
                                    row_bytes)) for r in range(ROWS_WIDE)]
        n = ROWS_WIDE

        def block(j, accs):
            accs = list(accs)
            made = []
            for q_row in q_rows:
                qb = b.add(q_row, b.mul(j, c64(block_bytes)))
                k.prefetch(on, qs, b.add(qb, b.mul(row_bytes, c64(PF_ROWS))), range(-(-block_bytes // 64)))
                made.append((_q4k_wide if kind == "q4k" else _q6k_wide)(k, qs, qb, one, convert=True))
            xb = b.add(x_at, b.mul(j, c64(256)))
            for g in range(4):
                ws = [weights(groups[g]) for groups, _ in made]
                for v in range(4):
                    off = ws[0][v][1]
                    for s_ in range(n_slots):
                        xv = k.load(x, b.add(b.add(xb, b.mul(x_stride, c64(s_))), c64(off)), k.vf, 4)
                        for r, w in enumerate(ws):
                            accs[r * n_slots + s_] = k.fma(w[v][0], xv, accs[r * n_slots + s_])
            if kind == "q4k":
                sb = b.add(sums_at, b.mul(j, c64(8)))
                mins = [_eight_lanes(k, b.fneg(dmn)) for _, dmn in made]
                for s_ in range(n_slots):
                    xs = _eight_lanes(k, k.load(x, b.add(sb, b.mul(x_stride, c64(s_))), v8, 4))
                    for r, neg in enumerate(mins):
                        accs[r * n_slots + s_] = k.fma(neg, xs, accs[r * n_slots + s_])
            return accs

        sums_ = k.block_loop(n_blk, n_slots * n, block)
        for r in range(n):
            for s_ in range(n_slots):
                total = k.lane_sum([sums_[r * n_slots + s_]])
                p = k.ptr(out, b.add(b.add(out_at, c64(s_ * TR)), b.add(i, c64(r))), k.f32)
                b.store(b.select(adding, b.fadd(b.load(p, align=4), total), total), p, align=4)

    n_steps = b.udiv(b.add(n_rows, c64(ROWS_WIDE - 1)), c64(ROWS_WIDE))
    k.block_loop(n_steps, 0, lambda i, _: rows(b.mul(i, c64(ROWS_WIDE))) or [])


def _slots_wide_intrinsic(kind: str):
    def typer(typingctx, n, qs, q_at, row_bytes, n_rows, n_blk, x, x_at, x_stride, sums_at, out, out_at, add):
        if not (isinstance(qs, types.Array) and qs.dtype == types.uint8 and isinstance(x, types.Array)
                and x.dtype == types.float32 and isinstance(out, types.Array) and out.dtype == types.float32):
            return None
        sig = types.void(n, qs, q_at, row_bytes, n_rows, n_blk, x, x_at, x_stride, sums_at, out, out_at, add)

        def codegen(context, builder, signature, args):
            flat = list(args)
            for i in (1, 6, 10):
                flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
            k = VectorTile(builder, 16)
            for i in (0, 2, 3, 4, 5, 7, 8, 9, 11, 12):
                flat[i] = k.i64(flat[i])
            done = builder.append_basic_block("slots_done")
            switch = builder.switch(flat[0], done)                # one variant a slot count, 1..SLOTS_WIDE
            for n_slots in range(1, SLOTS_WIDE + 1):
                variant = builder.append_basic_block(f"slots_{n_slots}")
                switch.add_case(ir.Constant(_I64, n_slots), variant)
                builder.position_at_end(variant)
                _slots_wide_ir(kind, n_slots, k, *flat[1:])
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"slots_wide_{kind}"
    typer.__doc__ = (f"``n`` (1..{SLOTS_WIDE}) slots of {kind} on zmm: :func:`_slots_wide_ir` (another ``n``: "
                     "nothing).")
    return intrinsic(typer)


_slots_wide_q4k, _slots_wide_q6k = (_slots_wide_intrinsic(kind) for kind in SLOTS_KINDS)


@njit(**JIT_INLINE)
def slots_wide_plan(n):
    """How many slots the next pass of :func:`_slots_wide` takes of ``n`` left: all up to
    :data:`SLOTS_WIDE`, half of 9..15 (two passes of near-equal width), else 8."""
    if n <= SLOTS_WIDE:
        return n
    return (n + 1) // 2 if n < 2 * SLOTS_WIDE else SLOTS_WIDE


@njit(**JIT_INLINE)
def _slots_wide(kind, block_bytes, qs, q_at, row_bytes, n_rows, n_blocks, xe, first, n, acc):
    """Q4_K (``kind`` 0) or Q6_K (1) on zmm: rows ``q_at ..`` (``n_rows`` <= TR, ``row_bytes`` apart)
    times the ``n`` slots ``first ..`` of ``xe`` (:func:`_matmul_id`'s layout 2): ``acc[s * TR + i]``
    (float32, ``[n, TR]`` flat) = slot s times row i, a few slots (:func:`slots_wide_plan`) and a
    chunk of inputs (their x over it in L1, :data:`X_CHUNK`) a pass of :func:`_slots_wide_ir`."""
    width = xe.shape[1]
    n_in = n_blocks * 256
    s0 = 0
    while s0 < n:
        m = slots_wide_plan(n - s0)
        per_pass = max(1, X_CHUNK // (m * 256))
        for b0 in range(0, n_blocks, per_pass):
            x_at = (first + s0) * width
            args = (qs, q_at + b0 * block_bytes, row_bytes, n_rows, min(per_pass, n_blocks - b0), xe,
                    x_at + b0 * 256, width, x_at + n_in + b0 * 8, acc, s0 * TR, 1 if b0 else 0)
            if kind == 0:
                _slots_wide_q4k(m, *args)
            else:
                _slots_wide_q6k(m, *args)
        s0 += m


# --------------------------------------------------------------------------------------------
# the driver: one parallel region over (group, part, tile of TR weight rows)


ITEMS_A_CHUNK = 16
"""Work items a thread takes at a time in a prefill's call (``numba.set_parallel_chunksize``), as
threads finish rather than half the items each up front: an item's cost is its expert's slots,
2 to 16 and more at 128 tokens, top-8 of 128 (layer 0 of qwen3moe-8, 2 threads:
docs/performance.md, "f32 experts in a prefill: the sums, the gather and the threads' shares")."""


SERIAL_SLOTS = 16
"""Up to this many slots a call (a decode step's k) have their rows of x made on one thread: two
fork-joins fewer a call (4 experts of 32 rows, 2 threads: 35.9 -> 32.4 µs a call)."""


@njit(**JIT_INLINE)
def _gather(kind, x, src, layout, x_order, alone_order, alone_exp, sums, xe, i):
    """xe[i] from x[src] as :func:`_matmul_id` lays it out (``layout`` 0: x in ``x_order``; 1, a
    slot alone: as :func:`alone_layout` gives ``alone_order`` and ``alone_exp``, with the 2**K of
    the subnormal kinds; 2, several slots of Q4_K or Q6_K on zmm (:func:`_slots_wide`): that order
    without 2**K;
    the sums, the scale)."""
    n_in = x.shape[1]
    alone = layout > 0
    k = subnormal_exp(x, src) if layout == 1 and kind < 2 and SUBNORMAL_BIAS else 0
    xo = alone_order if alone else x_order
    up = 2.0 ** (k - alone_exp) if alone else np.full(xo.shape[0], 2.0 ** k)
    for j0 in range(0, n_in, xo.shape[0]):
        for p in range(xo.shape[0]):
            xe[i, j0 + p] = np.float32(x[src, j0 + xo[p]] * up[p])
    if kind == 0:
        for g in range(n_in // 32):
            acc = np.float32(0.0)
            for j in range(32):
                acc += x[src, 32 * g + j]
            xe[i, n_in + g] = acc
    elif kind == 1 and layout == 1:                  # Q6_K alone: the lanes' 32 * sum(x), scaled
        down = 2.0 ** (k - SUBNORMAL_BIAS + 5)
        for g in range(n_in // 32):
            for lane in range(8):
                acc = np.float32(0.0)
                for v in range(4):
                    acc += x[src, 32 * g + x_order[8 * v + lane]]
                xe[i, n_in + 8 * g + lane] = np.float32(acc * down)
    if layout == 1 and kind < 2:                     # the subnormal kinds' scale back (none for MXFP4)
        xe[i, n_in + n_in // 32 * (sums // 8)] = np.float32(2.0 ** (SUBNORMAL_BIAS - k))


@njit(**JIT_PARALLEL)
def _matmul_id(kind, x, rows, order, starts, experts, q0, q1, n_parts, per_block, sums, x_order, alone_order,
               alone_exp, xe, out):
    """out[order[i], :] for every slot; q0, q1 uint8 [n_expert, n_out_p, row_bytes] (q1 = q0 and
    n_parts 1 for one part). x is first gathered into xe (float32 [n_slots, >= width], 64-byte
    aligned rows; in parallel past :data:`SERIAL_SLOTS` slots, each row a token's k slots share
    made once and copied: on one thread, row by row, it took up to ~4 ms a call at 1,024 slots of
    2,048 inputs) in slot order: row i is x[rows[order[i]]], each 32 inputs in the order
    ``x_order`` (a slot alone in its group of Q4_K, Q6_K, or MXFP4 on zmm, and several slots of Q4_K
    or Q6_K on zmm: each 32, 64 or 128 in ``alone_order``, times ``2**-alone_exp``, :func:`alone_layout`);
    Q4_K's followed by its sums per 32 inputs. A slot alone in its group (the one-slot kernel's) of
    Q4_K or Q6_K (:data:`SUBNORMAL`) has its x times 2**K (:func:`~llamatrace.kernels.tiles.subnormal_exp`),
    Q6_K's sums of each lane of each 32 inputs times ``32 * 2**(K - 149)`` (after x), and
    ``2**(149 - K)`` after its sums."""
    n_in = x.shape[1]
    n_blocks = n_in // per_block
    width = xe.shape[1]
    n_groups = experts.shape[0]
    n_slots = order.shape[0]
    maker = np.empty(n_slots, np.int64)              # slot i's row of xe is slot maker[i]'s (i: made)
    layout = np.empty(n_slots, np.int64)             # :func:`_gather`'s
    first = np.full(3 * x.shape[0], -1, np.int64)    # by (row of x, layout): the slot that makes it
    for gr in range(n_groups):
        n = starts[gr + 1] - starts[gr]
        for i in range(starts[gr], starts[gr + 1]):
            layout[i] = 0
            if n == 1 and (kind < 2 or kind == 2 and WIDE):
                layout[i] = 1
            elif n > 1 and kind < 2 and WIDE:
                layout[i] = 2
            key = 3 * rows[order[i]] + layout[i]
            if first[key] < 0:
                first[key] = i
            maker[i] = first[key]
    if n_slots <= SERIAL_SLOTS:                      # a decode step: no fork-joins before the items'
        for i in range(n_slots):                     # (a slot's maker comes first)
            if maker[i] == i:
                _gather(kind, x, rows[order[i]], layout[i], x_order, alone_order, alone_exp, sums, xe, i)
            else:
                xe[i, :] = xe[maker[i], :]
    else:
        for i in prange(n_slots):                    # a token's k slots share one row of x: made once
            if maker[i] == i:
                _gather(kind, x, rows[order[i]], layout[i], x_order, alone_order, alone_exp, sums, xe, i)
        for i in prange(n_slots):
            if maker[i] != i:
                xe[i, :] = xe[maker[i], :]
    n_out0 = q0.shape[1]
    t0 = (n_out0 + TR - 1) // TR
    t1 = (q1.shape[1] + TR - 1) // TR if n_parts == 2 else 0
    per = t0 + t1
    for item in prange(n_groups * per):
        g, j = item // per, item % per
        qs, t, col = q0, j, 0
        if j >= t0:
            qs, t, col = q1, j - t0, n_out0
        n_out, row_bytes = qs.shape[1], qs.shape[2]
        e, first, n = experts[g], starts[g], starts[g + 1] - starts[g]
        if n == 1:                                       # one slot: the tile in one kernel
            r0 = t * TR
            _tile(kind, qs, (e * n_out + r0) * row_bytes, row_bytes, min(TR, n_out - r0), n_blocks, xe,
                  first * width, out, order[first] * out.shape[1] + col + r0)
            continue
        r0, r1 = t * TR, min((t + 1) * TR, n_out)
        if kind < 2 and WIDE:                            # several of Q4_K or Q6_K on zmm: their own kernel
            sums_s = np.empty(n * TR, np.float32)
            _slots_wide(kind, row_bytes // n_blocks, qs, (e * n_out + r0) * row_bytes, row_bytes, r1 - r0, n_blocks,
                        xe, first, n, sums_s)
            for s in range(n):
                at = order[first + s] * out.shape[1] + col + r0
                out.reshape(-1)[at:at + r1 - r0] = sums_s[s * TR:s * TR + r1 - r0]
            continue
        # several: dequantized into L1, then a GEMM
        acc = np.zeros((r1 - r0) * n * LANES, np.float32)
        _slots_tile(kind, per_block, qs, e, r0, r1, n_blocks, xe, first, n, acc)
        width_out = out.shape[1]
        flat = out.reshape(-1)
        whole = (r1 - r0) // 8 * 8
        for s in range(n):                               # each slot's sums 8 rows at a time
            at = order[first + s] * width_out + col + r0
            for r in range(0, whole, 8):
                _totals8(acc, (r * n + s) * LANES, n * LANES, flat, at + r)
            for r in range(whole, r1 - r0):
                flat[at + r] = _total(acc, (r * n + s) * LANES)


def matmul_id(x, rows, order, starts, experts, datas, ggml_type) -> np.ndarray:
    """``out[i] = x[rows[i]] @ W[ids[i]].T`` over the groups of :func:`llamatrace.kernels.mul_mat_id.groups`.

    Args:
        x: float32 C-contiguous ``[n_rows, n_in]``.
        rows, order, starts, experts: int64, as :func:`~llamatrace.kernels.mul_mat_id.mul_mat_id` passes them.
        datas: 1 or 2 uint8 ``[n_expert, n_out_p, row_bytes]`` C-contiguous (the file's blocks;
            read-only is fine), their outputs side by side.
        ggml_type: one of :data:`TYPES`.

    Returns:
        float32 ``[n_slots, sum of n_out_p]``.

    Raises:
        ValueError: a type outside :data:`TYPES`, more than 2 parts, or parts not C-contiguous
            ``[n_expert, n_out_p, n_in / block * block_bytes]``.
    """
    if ggml_type not in KIND:
        raise ValueError(f"mul_mat_id_f32: no kernel for {_T(ggml_type)!r}")
    kind = KIND[ggml_type]
    _, per_block, block_bytes, sums = _KIND_SHAPES[kind]
    n_in = x.shape[1]
    parts = [d if isinstance(d, np.ndarray) and not d.flags.writeable else _read_only(d) for d in datas]
    if not 1 <= len(parts) <= 2 or any(p.ndim != 3 or p.dtype != np.uint8 or not p.flags.c_contiguous
                                       or p.shape[2] * per_block != n_in * block_bytes for p in parts):
        raise ValueError(f"mul_mat_id_f32: parts must be 1 or 2 C-contiguous uint8 [n_expert, n_out, "
                         f"{n_in // per_block * block_bytes}], got {[(p.dtype.name, p.shape) for p in parts]}")
    out = np.empty((order.shape[0], sum(p.shape[1] for p in parts)), dtype=np.float32)
    if order.shape[0]:
        xe = _aligned((order.shape[0], n_in + n_in // 32 * (sums // 8) + 1))
        # a prefill's work items differ in cost (an expert's slots): dealt out a few at a time as
        # threads finish, not split in equal ranges up front
        prev = numba.set_parallel_chunksize(ITEMS_A_CHUNK) if order.shape[0] > experts.shape[0] else None
        try:
            _matmul_id(kind, x, rows, order, starts, experts, parts[0], parts[-1], len(parts), per_block, sums,
                       x_order(ggml_type), *alone_layout(ggml_type), xe, out)
        finally:
            if prev is not None:
                numba.set_parallel_chunksize(prev)
    return out


def _read_only(data) -> np.ndarray:
    """A read-only view of ``data``: one compiled signature, the file's maps being read-only (the
    maps themselves are passed as they are: a fresh view a call cost ~8 µs of Numba's typing)."""
    view = np.asarray(data).view()
    view.flags.writeable = False
    return view


def _aligned(shape: tuple[int, int]) -> np.ndarray:
    """float32 C-contiguous ``[shape[0], >= shape[1]]`` starting on a cache line, its rows a
    multiple of 16 floats (64 bytes) long: the microkernels' 32-byte loads of x then never
    straddle two lines."""
    width = -(-int(shape[1]) // 16) * 16
    raw = np.empty(shape[0] * width + 16, dtype=np.float32)
    skip = (-raw.__array_interface__["data"][0] % 64) // 4
    return raw[skip:skip + shape[0] * width].reshape(shape[0], width)
