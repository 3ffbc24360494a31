"""The ``q8`` mode's ``mul_mat_id`` kernels on the file's blocks (:mod:`llamatrace.kernels.mul_mat_id`).

The experts stay as the GGUF stores them: each weight row is ``n_in / 256`` (Q4_K, Q6_K) or
``n_in / 32`` (MXFP4, Q8_0) blocks in a row, never repacked. The arithmetic is that of llama.cpp's
CPU backend on x86 (``ggml-cpu/arch/x86/quants.c``):

- Activations are quantized once per call, as llama.cpp quantizes ``src1`` for the weights' vec
  dot type: Q8_K for Q4_K and Q6_K (:func:`llamatrace.kernels.int8.act8.quantize_k`: one float32
  scale per 256, the sums of 16 as ggml's ``bsums``), Q8_0 for MXFP4 and Q8_0
  (:func:`llamatrace.kernels.int8.act8.quantize`). Q4_K takes Q8_K here, as in llama.cpp, not the
  packed path's per-32 float32 scales: on the file's layout the block's eight 6-bit scales and
  mins go into the integer sums (``pmaddwd`` by the scale), so the float work is two FMAs per
  block and activation row.
- Q4_K, Q6_K and Q8_0 go a weight row at a time, as ``ggml_vec_dot_*`` do: per block and
  activation row the exact int32 sums in 8 lanes, then a vector FMA ``acc += (d * xd) * isum``;
  the row's 8 lanes are added at its end. Q4_K's sub-block scales multiply the ``pmaddubsw`` pair
  sums in ``pmaddwd`` (unpacked in general registers, as ggml's ``utmp``, each broadcast a row of
  a constant table: :func:`_q4k_scales`), its mins ``acc -= (dmin * xd) * sum_j mn_j *
  bsum32_j``; Q6_K sums ``q + 32`` (0..63) with its int8 scales in ``pmaddwd`` and takes ``32 *
  sum_g sc_g * bsum_g`` off in integers; Q8_0 multiplies ``|w|`` by ``sign(w) * x`` (``psignb``).
  32-weight blocks are summed into two chains of FMAs (a block's work is shorter than an FMA's
  latency). Q4_K with one activation row (decode) sums its low and high nibbles in two integer
  chains, kept apart by an empty asm statement: LLVM otherwise folds the block into one chain of
  8 ``vpdpwssd`` (~32 cycles of latency a block: qwen3moe-8 gate|up, one thread, 1.06-1.07x with
  two chains, four 1.05x; since the scales left the vector pipes, their bound, four take 1.06x
  the time of two).
- MXFP4 goes eight weight rows at a time (16 on AVX-512 VNNI), as the packed q8 kernels take a
  tile's rows (a register of them), because a per-row float step per 32 weights cost more than
  the integer work: each block's 16 code bytes of the rows are transposed in registers (4 bytes
  of a row per 32-bit lane), mapped to ``kvalues + 12`` by ``vpshufb``, and summed against an
  activation row's broadcast bytes, from its ``-12 * sum(xq)`` (AVX2: in int16); ``d`` is the
  E8M0 byte's ``GGML_E8M0_TO_FP32_HALF`` and the float step is one FMA for the rows. The next
  rows are prefetched a slice per block: 8 row streams at once are more than the hardware
  prefetcher followed (gpt-oss [2880, 2880], one thread: 8.3 -> 14.4 GB of weights per
  CPU-second).
- VNNI (:func:`llamatrace.machine.jit.has_vnni`, as :mod:`llamatrace.kernels.int8.act8_ir`):
  ``vpdpbusd`` adds four byte products to an int32 lane where AVX2 takes ``pmaddubsw`` and
  ``pmaddwd`` (MXFP4 from the zero point, Q8_0 after its ``psignb``); with AVX-512 (:data:`ZMM`)
  MXFP4 takes 16 rows a zmm and Q6_K (one activation row) 64 weights a zmm, ``pmaddubsw`` then
  ``vpdpwssd``, its two halves' lanes added before the float step. The int32 sums are exact in
  every path and the float32 steps the same, so the outputs are the AVX2 path's bit for bit
  (``LLAMATRACE_VNNI=0`` with a fresh ``NUMBA_CACHE_DIR`` compiles that path; a test does).
- Against llama.cpp's own x86 code (``quantize_row_q8_K`` / ``_q8_0`` and ``ggml_vec_dot_*``
  compiled from the sdist, ``tests/test_mul_mat_id_q8.py``): Q6_K bit for bit, Q4_K, MXFP4 and
  Q8_0 within 1.1e-7 of the sum of |products| (the same integer sums, another float32 order).
  The packed path's Q4_K (per-32 float32 activation scales) differs from both by ~3e-3.
- Overflow: Q4_K pairs are at most 2 * 15 * 127, times a scale <= 63 in ``pmaddwd``; Q6_K's
  2 * 63 * 127, times |scale| <= 128; Q8_0's 2 * 128 * 127; MXFP4's 2 * 24 * 127, four added in
  int16 (24384). A block's scaled sum stays below 2**31.

Kernels. :func:`matmul_id` runs one Numba parallel region over work items (group, part, tile of
:data:`TILE` weight rows); a group's activation rows go :data:`MAX_ROWS` at a time (then 1..3)
through a microkernel (LLVM IR, AVX2's ``pmaddubsw`` / ``pmaddwd`` / ``psignb`` / ``pshufb`` on
256-bit vectors, and VNNI's as above) that loops over the tile's rows and their blocks,
its float32 sums in registers, each block's codes and scales unpacked once for those activation
rows; the tile (at most 24 KB) stays in L1/L2 for the group's next rows, so each chosen expert's
bytes come from memory once a call. Prefetch: :data:`AHEAD`. Activations are quantized once per
call, on one thread up to :data:`SERIAL_ROWS` rows (a decode step: no second fork-join).

Speed (``benchmarks/bench_mul_mat_id.py``: layer 0, interleaved with the packed path, medians
of 9 rounds, 1 thread CPU time, 2-core AVX2 EPYC shared with other jobs at load 2.7-4.3; speed
relative to the packed path, its time over this one's, 3 runs): qwen3moe-8 (gate/up Q4_K, down
Q6_K) decode k = 8: 0.89-1.00 (12-13.6 GB of weights per second), prefill 128 tokens
0.98-1.12 (Q4_K alone ~0.88, Q6_K ~1.17); gptoss-4 (MXFP4) decode k = 4: 0.83-0.97 (~11.6 GB/s),
prefill 1.30-1.41. Synthetic Q8_0 [32, 768, 2048]: decode 0.90, prefill 1.00.
VNNI against that AVX2 path (Zen 4 EPYC, 2 cores, one thread, interleaved in one process, one
activation row, load 1.5-2.6): MXFP4 [1024, 2880] 1.13-1.24x faster (~16 -> ~19.6 GB/s), 4 rows
1.43x; Q8_0 [768, 2048] 1.09-1.14x, 4 rows 1.19x; Q6_K [2048, 768] 1.05-1.10x; Q4_K unchanged
(LLVM already fuses its ``pmaddwd`` and add into ``vpdpwssd``). docs/performance.md has the rest.

:func:`activations_ref` is the NumPy twin of the activation quantization (act8's NumPy twins),
used by :func:`llamatrace.kernels.mul_mat_id.mul_mat_id_ref`.
"""

from __future__ import annotations

import gguf
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from llamatrace.kernels.int8 import act8
from llamatrace.kernels.int8.act8_ir import _avx2_intrinsics, _opaque
from llamatrace.kernels.tiles import VectorTile, constant_table, e8m0_half_table, prefill_lanes
from llamatrace.machine.jit import JIT, JIT_INLINE, JIT_PARALLEL, has_vnni

_T = gguf.GGMLQuantizationType

TYPES: frozenset = frozenset({_T.Q4_K, _T.Q6_K, _T.MXFP4, _T.Q8_0})
"""The weight types these kernels run."""

QK, QK_K = 32, 256
MAX_ROWS = 4
"""Activation rows per microkernel call at most (a group's slots go 4 at a time, then 1..3)."""
TILE = 16
"""Weight rows per work item."""
SERIAL_ROWS = 16
"""Up to this many rows of x are quantized on one thread (decode: no second fork-join)."""

Q4K, Q6K, MXFP4, Q80 = 0, 1, 2, 3
_KIND = {_T.Q4_K: Q4K, _T.Q6_K: Q6K, _T.MXFP4: MXFP4, _T.Q8_0: Q80}

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V32I8, _V16I8, _V8I8 = ir.VectorType(_I8, 32), ir.VectorType(_I8, 16), ir.VectorType(_I8, 8)
_V16I16, _V8I16 = ir.VectorType(_I16, 16), ir.VectorType(_I16, 8)
_V4I32, _V8I32 = ir.VectorType(_I32, 4), ir.VectorType(_I32, 8)
_V64I8, _V32I16, _V16I32 = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32), ir.VectorType(_I32, 16)
_KVALUES = [int(v) for v in gguf.quants.MXFP4.kvalues]
MXFP4_ZERO = 12
"""Added to MXFP4's ``kvalues`` (-12..12) in the 8-row kernel, so that they are unsigned bytes."""
ZMM = prefill_lanes() == 16
"""With AVX-512 VNNI (and BW) MXFP4 and Q6_K go on 512-bit vectors (MXFP4 16 rows a register, Q6_K
64 weights for one activation row), else on 256-bit ones."""
MXFP4_ROWS = 16 if ZMM else 8
"""Weight rows of the MXFP4 kernel's register."""


class _Row(VectorTile):
    """IR builder of the microkernels for ``ns`` activation rows: 256-bit vectors (8 float32
    lanes), AVX2's byte products."""

    def __init__(self, builder, ns: int) -> None:
        super().__init__(builder, 8)
        self.ns = ns
        self.maddubs, self.maddwd, self.sign = _avx2_intrinsics(builder.module)
        self.maddwd128 = builder.module.declare_intrinsic("llvm.x86.sse2.pmadd.wd", (),
                                                          ir.FunctionType(_V4I32, [_V8I16, _V8I16]))
        self.shuffle = builder.module.declare_intrinsic("llvm.x86.avx2.pshuf.b", (),
                                                        ir.FunctionType(_V32I8, [_V32I8, _V32I8]))
        self.vnni = has_vnni()
        if self.vnni:
            self.dpbusd = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.256", (),
                                                           ir.FunctionType(_V8I32, [_V8I32] * 3))
        self.zmm = ZMM
        if self.zmm:
            module = builder.module
            self.maddubs512 = module.declare_intrinsic("llvm.x86.avx512.pmaddubs.w.512", (),
                                                       ir.FunctionType(_V32I16, [_V64I8, _V64I8]))
            self.dpwssd512 = module.declare_intrinsic("llvm.x86.avx512.vpdpwssd.512", (),
                                                      ir.FunctionType(_V16I32, [_V16I32] * 3))
            self.shuffle512 = module.declare_intrinsic("llvm.x86.avx512.pshuf.b.512", (),
                                                       ir.FunctionType(_V64I8, [_V64I8, _V64I8]))

    def c(self, vtype, v):
        return ir.Constant(vtype, [v] * vtype.count)

    def shuf(self, a, idx, b=None):
        b = ir.Constant(a.type, None) if b is None else b
        return self.b.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))

    def dot16(self, u8, s8):
        """int16 lanes: pairs of products of unsigned ``u8`` and signed ``s8`` bytes."""
        return self.b.call(self.maddubs, [u8, s8])

    def dp(self, acc, pairs):
        """VNNI: int32 lanes ``acc`` (``None``: 0) plus, per pair of (unsigned ``u8``, signed
        ``s8``) bytes, the sums of 4 products: a chain of ``vpdpbusd``."""
        b = self.b
        acc = self.c(_V8I32, 0) if acc is None else acc
        for u8, s8 in pairs:
            acc = b.call(self.dpbusd, [acc, b.bitcast(u8, _V8I32), b.bitcast(s8, _V8I32)])
        return acc

    def dp64(self, acc, u8, s8, scales):
        """zmm: int32 lanes ``acc`` (``None``: 0) plus the pairs of ``pmaddubsw`` sums of unsigned
        ``u8`` and signed ``s8`` (64 bytes each) times the int16 ``scales`` (``vpdpwssd``)."""
        b = self.b
        acc = self.c(_V16I32, 0) if acc is None else acc
        return b.call(self.dpwssd512, [acc, b.bitcast(b.call(self.maddubs512, [u8, s8]), _V16I32),
                                       b.bitcast(scales, _V16I32)])

    def halves_sum(self, v16):
        """int32 [8]: lanes l and 8 + l of ``v16`` added."""
        return self.b.add(self.shuf(v16, range(8)), self.shuf(v16, range(8, 16)))

    def wd(self, a16, b16):
        """int32 lanes: pairs of products of int16 lanes."""
        return self.b.call(self.maddwd, [a16, b16])

    def signed_dot(self, w, x):
        """int32 lanes: sums of 4 products of signed bytes ``w`` and ``x`` (``|w| * sign(w) x``;
        VNNI: one ``vpdpbusd``, else ``pmaddubsw`` and ``pmaddwd``, the same int32 lanes)."""
        b = self.b
        u8, s8 = b.call(self.sign, [w, w]), b.call(self.sign, [x, w])
        return self.dp(None, [(u8, s8)]) if self.vnni else self.wd(self.dot16(u8, s8), self.c(_V16I16, 1))

    def f16_at(self, p, offset):
        return self.b.fpext(self.load(p, offset, ir.HalfType(), 1), self.f32)


def _q4k_scales(k: _Row, w, at):
    """Q4_K's 12 bytes of 6-bit scales and mins at ``w + at``, unpacked as ``ggml_vec_dot_q4_K_q8_K``
    does (its ``utmp``), in three 32-bit general registers: the 8 scales as int16 [16] broadcasts
    (rows of :func:`_scale_table` at the scales), the mins as an int8 [8] vector. Unpacking in vector
    registers (byte shuffles, selects), then a ``vpshufb`` per broadcast, took 1.25x the time a
    block (one activation row from L2, Zen 4): the vector pipes are the kernel's bound, the general
    ones idle."""
    b = k.b
    c = lambda x: ir.Constant(_I32, x)                     # noqa: E731
    u0, u1, u2 = (k.load(w, b.add(at, k.c64(4 * i)), _I32) for i in range(3))
    low6, low4, top2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
    scales = (b.and_(u0, low6),                                                          # scales 0..3
              b.or_(b.and_(u2, low4), b.shl(b.and_(b.lshr(u0, c(6)), top2), c(4))))      # scales 4..7
    mins = (b.and_(u1, low6),                                                            # mins 0..3
            b.or_(b.and_(b.lshr(u2, c(4)), low4), b.shl(b.and_(b.lshr(u1, c(6)), top2), c(4))))  # mins 4..7
    table = _scale_table(b.module)
    bcast = []
    for i in range(8):
        sc = b.and_(b.lshr(scales[i // 4], c(8 * (i % 4))), c(63))
        row = b.gep(table, [k.c64(0), b.zext(sc, _I64)])
        bcast.append(b.load(b.bitcast(row, _V16I16.as_pointer()), align=32))
    mn = ir.Constant(ir.VectorType(_I32, 2), None)
    for i, word in enumerate(mins):
        mn = b.insert_element(mn, word, ir.Constant(_I32, i))
    return bcast, b.bitcast(mn, _V8I8)


def _scale_table(module):
    """The module's constant int16 [64, 16]: row s is s in every lane (Q4_K's 6-bit scales as
    ``pmaddwd`` operands, loaded, not shuffled)."""
    row = ir.ArrayType(_I16, 16)
    return constant_table(module, "llamatrace_q4k_scale_rows", lambda: ir.Constant(
        ir.ArrayType(row, 64), [ir.Constant(row, [s] * 16) for s in range(64)]), align=32)


def _q4k_block(k: _Row, a, blk, accs):
    """One Q4_K block (``d dmin scales[12] qs[128]``, 144 bytes) against ``ns`` Q8_K rows."""
    b, c64 = k.b, k.c64
    base = b.add(a.w_at, b.mul(blk, c64(144)))
    k.prefetch(a.on, a.w, b.add(base, a.ahead), range(3))
    dm = b.fpext(k.load(a.w, base, ir.VectorType(ir.HalfType(), 2)), ir.VectorType(k.f32, 2))   # d, dmin
    scales, mn = _q4k_scales(k, a.w, b.add(base, c64(4)))
    # one activation row (decode): the low and the high nibbles' sums in two chains, the second
    # kept apart by an empty asm (else LLVM makes one chain of 8 ``vpdpwssd``, whose latency
    # bounds the block); more rows are chains enough. Integer sums: the same bits either way.
    chains = [[None] * (2 if k.ns == 1 else 1) for _ in range(k.ns)]
    for j in range(4):                 # 64 weights: low nibbles sub-block 2j, high 2j + 1
        q = k.load(a.w, b.add(base, c64(16 + 32 * j)), _V32I8)
        lo, hi = b.and_(q, k.c(_V32I8, 15)), b.lshr(q, k.c(_V32I8, 4))
        slo, shi = scales[2 * j], scales[2 * j + 1]
        for i, row in enumerate(chains):
            xat = b.add(a.xq_at[i], b.add(b.mul(blk, c64(QK_K)), c64(64 * j)))
            xlo, xhi = k.load(a.xq, xat, _V32I8), k.load(a.xq, b.add(xat, c64(32)), _V32I8)
            for h, p in enumerate((k.wd(k.dot16(lo, xlo), slo), k.wd(k.dot16(hi, xhi), shi))):
                c = h % len(row)
                row[c] = p if row[c] is None else b.add(row[c], p)
    isums = [row[0] if len(row) == 1 else b.add(row[0], _opaque(b, row[1])) for row in chains]
    mn16 = b.zext(mn, _V8I16)
    new = []
    for i in range(k.ns):
        dx = b.load(b.gep(a.xd, [b.add(a.xd_at[i], blk)]), align=4)
        scaled = b.fmul(dm, k.splat(dx, ir.VectorType(k.f32, 2)))          # d dx, dmin dx
        sums = k.load(a.xs, b.add(a.xs_at[i], b.mul(blk, c64(8))), _V8I16, 2)     # the 8 sums of 32
        mins = k.shuf(b.call(k.maddwd128, [mn16, sums]), range(8), ir.Constant(_V4I32, [0] * 4))
        acc = k.fma(k.shuf(scaled, [0] * 8), b.sitofp(isums[i], k.vf), accs[i])
        new.append(k.fma(b.fneg(k.shuf(scaled, [1] * 8)), b.sitofp(mins, k.vf), acc))
    return new


def _q6k_block(k: _Row, a, blk, accs):
    """One Q6_K block (``ql[128] qh[64] scales[16] d``, 210 bytes) against ``ns`` Q8_K rows: the
    quants as ``q + 32`` (0..63), the offset ``-32 * sum_g sc_g * bsum_g`` in integers."""
    b, c64 = k.b, k.c64
    base = b.add(a.w_at, b.mul(blk, c64(210)))
    k.prefetch(a.on, a.w, b.add(base, a.ahead), range(4))
    d = k.f16_at(a.w, b.add(base, c64(208)))
    sc8 = k.load(a.w, b.add(base, c64(192)), _V16I8)
    sc16 = b.sext(sc8, _V16I16)
    isums = (_q6k_sums_zmm if k.zmm and k.ns == 1 else _q6k_sums)(k, a, blk, base, sc16)
    new = []
    for i in range(k.ns):
        bsums = k.load(a.xs, b.add(a.xs_at[i], b.mul(blk, c64(16))), _V16I16, 2)
        corr = b.shl(k.wd(sc16, bsums), k.c(_V8I32, 5))
        dx = b.load(b.gep(a.xd, [b.add(a.xd_at[i], blk)]), align=4)
        new.append(k.fma(k.splat(b.fmul(d, dx), k.vf), b.sitofp(b.sub(isums[i], corr), k.vf), accs[i]))
    return new


def _q6k_sums(k: _Row, a, blk, base, sc16) -> list:
    """:func:`_q6k_block`'s int32 lanes ``sum q * x * sc`` per activation row, 32 weights a ymm:
    ``pmaddubsw`` then ``pmaddwd`` by the scales of its two groups."""
    b, c64 = k.b, k.c64
    halves = [b.bitcast(k.shuf(sc16, list(range(8 * h, 8 * h + 8)) * 2), _V32I8) for h in range(2)]
    c32 = lambda x: k.c(_V32I8, x)                         # noqa: E731
    isums = [None] * k.ns
    for h in range(2):
        ql1 = k.load(a.w, b.add(base, c64(64 * h)), _V32I8)
        ql2 = k.load(a.w, b.add(base, c64(64 * h + 32)), _V32I8)
        qh = k.load(a.w, b.add(base, c64(128 + 32 * h)), _V32I8)
        quants = (b.or_(b.and_(ql1, c32(15)), b.shl(b.and_(qh, c32(3)), c32(4))),
                  b.or_(b.and_(ql2, c32(15)), b.shl(b.and_(qh, c32(12)), c32(2))),
                  b.or_(b.lshr(ql1, c32(4)), b.and_(qh, c32(48))),
                  b.or_(b.lshr(ql2, c32(4)), b.and_(b.lshr(qh, c32(2)), c32(48))))
        for c, q in enumerate(quants):                    # weights 128h + 32c ..: groups g, g + 1
            g = 8 * h + 2 * c            # scales g, g + 1 (int16) by one in-lane byte shuffle
            scv = b.bitcast(b.call(k.shuffle, [halves[h], ir.Constant(_V32I8, [2 * (g % 8), 2 * (g % 8) + 1] * 8
                                                                      + [2 * (g % 8) + 2, 2 * (g % 8) + 3] * 8)]),
                            _V16I16)
            for i in range(k.ns):
                x = k.load(a.xq, b.add(a.xq_at[i], b.add(b.mul(blk, c64(QK_K)), c64(128 * h + 32 * c))), _V32I8)
                p = k.wd(k.dot16(q, x), scv)
                isums[i] = p if isums[i] is None else b.add(isums[i], p)
    return isums


def _q6k_sums_zmm(k: _Row, a, blk, base, sc16) -> list:
    """:func:`_q6k_sums` on zmm, 64 weights a vector (the ymm path's quants ``c`` and ``c + 1``,
    four groups of 16): ``ql[64h:64h + 64]`` in one load, ``qh`` in both halves (per-half shifts),
    ``pmaddubsw`` then ``vpdpwssd`` by the four scales, in two chains (its latency). Lanes l and
    8 + l added give the ymm path's lane l: the same int32 sums. For one activation row (decode)
    only: Q6_K [2048, 768], one thread, 7-10 % less time; 2 rows the same, 4 rows 3-5 % more."""
    b, c64 = k.b, k.c64
    v8i64 = ir.VectorType(_I64, 8)
    # per half h its 8 int16 scales in every 128-bit lane (vpshufb stays in its lane)
    tables = [b.bitcast(k.shuf(sc16, list(range(8 * h, 8 * h + 8)) * 4), _V64I8) for h in range(2)]

    def shifted(v, op, lo, hi):
        """``op`` (shl, lshr) of the qwords of the low half by ``lo``, the high half by ``hi``."""
        return b.bitcast(op(b.bitcast(v, v8i64), ir.Constant(v8i64, [lo] * 4 + [hi] * 4)), _V64I8)

    c = lambda x: k.c(_V64I8, x)                           # noqa: E731
    isums = [[None, None] for _ in range(k.ns)]
    for h in range(2):
        ql = k.load(a.w, b.add(base, c64(64 * h)), _V64I8)
        qh = k.shuf(k.load(a.w, b.add(base, c64(128 + 32 * h)), _V32I8), list(range(32)) * 2)
        quants = (b.or_(b.and_(ql, c(15)), b.and_(shifted(qh, b.shl, 4, 2), c(48))),            # c = 0, 1
                  b.or_(b.and_(shifted(ql, b.lshr, 4, 4), c(15)), b.and_(shifted(qh, b.lshr, 0, 2), c(48))))
        for cc, q in enumerate(quants):                    # weights 128h + 64cc ..: groups g .. g + 3
            g = 8 * h + 4 * cc
            idx = [i for gi in range(g, g + 4) for i in [2 * (gi % 8), 2 * (gi % 8) + 1] * 8]
            scv = b.call(k.shuffle512, [tables[h], ir.Constant(_V64I8, idx)])
            for i in range(k.ns):
                x = k.load(a.xq, b.add(a.xq_at[i], b.add(b.mul(blk, c64(QK_K)), c64(128 * h + 64 * cc))), _V64I8)
                isums[i][cc] = k.dp64(isums[i][cc], q, x, scv)
    return [k.halves_sum(b.add(*v)) for v in isums]


def _q8_block(k: _Row, a, blk, accs, mxfp4: bool):
    """One MXFP4 block (``e qs[16]``, 17 bytes: weight j the low nibble of byte j, 16 + j its high
    nibble, mapped to ``kvalues`` by ``vpshufb``) or Q8_0 block (``d qs[32]``, 34 bytes) against
    ``ns`` Q8_0 rows."""
    b, c64 = k.b, k.c64
    size = 17 if mxfp4 else 34
    base = b.add(a.w_at, b.mul(blk, c64(size)))
    if mxfp4:
        k.prefetch(a.on, a.w, b.add(base, a.ahead), range(1))
        e = b.zext(k.load(a.w, base, _I8), _I64)
        d = b.load(b.gep(e8m0_half_table(b.module), [c64(0), e]), align=4)
        q = k.load(a.w, b.add(base, c64(1)), _V16I8)
        # both halves of a ymm the 16 bytes, the upper shifted by 4: low nibbles then high ones
        both = b.lshr(b.bitcast(k.shuf(q, list(range(16)) * 2), _V8I32), ir.Constant(_V8I32, [0] * 4 + [4] * 4))
        codes = b.and_(b.bitcast(both, _V32I8), k.c(_V32I8, 15))
        w = b.call(k.shuffle, [ir.Constant(_V32I8, _KVALUES * 2), codes])
    else:
        k.prefetch(a.on, a.w, b.add(base, a.ahead), range(1))
        d = k.f16_at(a.w, base)
        w = k.load(a.w, b.add(base, c64(2)), _V32I8)
    new = []
    for i in range(k.ns):
        x = k.load(a.xq, b.add(a.xq_at[i], b.mul(blk, c64(QK))), _V32I8)
        dx = b.load(b.gep(a.xd, [b.add(a.xd_at[i], blk)]), align=4)
        new.append(k.fma(k.splat(b.fmul(d, dx), k.vf), b.sitofp(k.signed_dot(w, x), k.vf), accs[i]))
    return new


class _Args:
    """The microkernel's arguments as IR values: data pointers, offsets of each activation row
    (``w_at``: the current weight row's, set by the row loop)."""

    def __init__(self, k: _Row, context, sig, args, kind: int) -> None:
        ptr = lambda i: context.make_array(sig.args[i])(context, k.b, args[i]).data   # noqa: E731
        b = k.b
        self.w, self.xq, self.xd, self.xs, self.res = ptr(0), ptr(5), ptr(6), ptr(7), ptr(12)
        if kind in (Q4K, Q6K):                              # int16 sums (act8's, narrowed)
            self.xs = b.bitcast(self.xs, _I16.as_pointer())
        self.w0, self.row_bytes, self.n_rows, self.n_blocks, self.ahead = (k.i64(args[i]) for i in (1, 2, 3, 4, 13))
        self.w_at = self.w0
        self.on = b.icmp_signed("!=", self.ahead, k.c64(0))
        rows = [k.i64(args[8 + i]) for i in range(k.ns)]
        per = QK_K if kind in (Q4K, Q6K) else QK
        self.xq_at = [b.mul(r, b.mul(self.n_blocks, k.c64(per))) for r in rows]
        self.xd_at = [b.mul(r, self.n_blocks) for r in rows]
        self.xs_at = [b.mul(r, b.mul(self.n_blocks, k.c64(8 if kind == Q4K else 16))) for r in rows]


def _row_loop(k: _Row, n_rows, body) -> None:
    """``for rr in range(n_rows): body(rr)`` in IR."""
    b, c64 = k.b, k.c64
    entry = b.basic_block
    loop, done = b.append_basic_block("rows"), b.append_basic_block("rows_done")
    b.cbranch(b.icmp_signed(">", n_rows, c64(0)), loop, done)
    b.position_at_end(loop)
    rr = b.phi(_I64)
    body(rr)
    nxt = b.add(rr, c64(1))
    rr.add_incoming(c64(0), entry)
    rr.add_incoming(nxt, b.basic_block)
    b.cbranch(b.icmp_signed("<", nxt, n_rows), loop, done)
    b.position_at_end(done)


def _two_chains(k: _Row, a, ns: int, body) -> list:
    """The block loop with blocks 2p and 2p + 1 summed into two sets of accumulators (then the
    last block of an odd count): a 32-weight block's work is shorter than an FMA's latency, so
    one chain of FMAs would bound the loop."""
    b = k.b

    def pair(p, accs):
        blk = b.mul(p, k.c64(2))
        return body(k, a, blk, accs[:ns]) + body(k, a, b.add(blk, k.c64(1)), accs[ns:])

    outs = k.block_loop(b.sdiv(a.n_blocks, k.c64(2)), 2 * ns, pair)
    last = b.sub(a.n_blocks, k.c64(1))
    tail = k.block_loop(b.srem(a.n_blocks, k.c64(2)), ns, lambda blk, accs: body(k, a, b.add(blk, last), accs))
    return [b.fadd(b.fadd(outs[i], outs[ns + i]), tail[i]) for i in range(ns)]


def _e8m0_bytes(k: _Row, a, row_at: list, off):
    """int32 lanes: the byte at ``row_at[r] + off`` of each of the 16 rows, gathered in two
    general registers (byte loads, shifts, ors on the integer pipes; the vector ones are busy with
    the transpose and ``vpshufb``), then widened: 5-7 % less time a block than 12 ``vpinsrd``
    and 3 inserts (one thread, one activation row, L2-resident weights)."""
    b = k.b
    ev = ir.Constant(ir.VectorType(_I64, 2), None)
    for h in range(2):
        word = None
        for r in range(8):
            v = b.zext(k.load(a.w, b.add(row_at[8 * h + r], off), _I8), _I64)
            v = b.shl(v, k.c64(8 * r)) if r else v
            word = v if word is None else b.or_(word, v)
        ev = b.insert_element(ev, word, ir.Constant(_I32, h))
    return b.zext(b.bitcast(ev, ir.VectorType(_I8, 16)), ir.VectorType(_I32, 16))


def _mxfp4_rows(k: _Row, a, n: int) -> None:
    """MXFP4 ``n`` weight rows at a time (8: a ymm, 16: a zmm), as the packed q8 kernels take a
    tile's rows: each block's 16 code bytes of the rows are transposed in registers (4 bytes of a
    row per 32-bit lane), mapped to ``kvalues + 12`` by ``vpshufb``, and the byte products of an
    activation row (its 4 bytes broadcast) summed for the rows at once from the activations' ``-12
    * sum(xq)`` (VNNI: ``vpdpbusd`` into int32; AVX2: ``pmaddubsw`` in int16, pairs at most 2 * 24
    * 127, four added: 24384, then ``pmaddwd``); the float step ``acc = fma(d * dx, isum, acc)``
    is one vector FMA for the rows. Rows past ``n_rows`` repeat the last one (their sums are not
    read). ``res[i * TILE + r]``."""
    b, c64, ns = k.b, k.c64, k.ns
    t = k if n == 8 else VectorTile(b, n)                   # float32 vectors of n lanes
    vi32, vi8 = ir.VectorType(_I32, n), ir.VectorType(_I8, 4 * n)
    shuffle = k.shuffle if n == 8 else b.module.declare_intrinsic("llvm.x86.avx512.pshuf.b.512", (),
                                                                  ir.FunctionType(vi8, [vi8, vi8]))
    if k.vnni and n == 16:
        dpbusd = b.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", (), ir.FunctionType(vi32, [vi32] * 3))
    else:
        dpbusd = k.dpbusd if k.vnni else None

    def dp(acc, pairs):
        acc = k.c(vi32, 0) if acc is None else acc
        for u8, s8 in pairs:
            acc = b.call(dpbusd, [acc, b.bitcast(u8, vi32), b.bitcast(s8, vi32)])
        return acc

    table = ir.Constant(vi8, [v + MXFP4_ZERO for v in _KVALUES] * (n // 4))
    ones = k.c(_V16I16, 1)
    last = b.sub(a.n_rows, c64(1))
    # in-lane (128-bit) dword interleaves of two vectors: unpck{l,h}dq, unpck{l,h}qdq
    lanes = range(n // 4)
    lo_d, hi_d = ([i for L in lanes for i in (4 * L + h, n + 4 * L + h, 4 * L + h + 1, n + 4 * L + h + 1)]
                  for h in (0, 2))
    lo_q, hi_q = ([i for L in lanes for i in (4 * L + h, 4 * L + h + 1, n + 4 * L + h, n + 4 * L + h + 1)]
                  for h in (0, 2))

    def group(rg):
        first = b.mul(rg, c64(n))
        row_at = []
        for r in range(n):
            ri = b.add(first, c64(r))
            ri = b.select(b.icmp_signed("<", ri, a.n_rows), ri, last)
            row_at.append(b.add(a.w0, b.mul(ri, a.row_bytes)))

        # the rows ``ahead`` on (contiguous), n rows' worth a slice per block: n row streams at
        # once are more than the hardware prefetcher follows
        nxt = b.add(a.w0, b.mul(b.add(first, a.ahead), a.row_bytes))

        def block(blk, accs):
            off = b.mul(blk, c64(17))
            # zmm: one offset for the 16 rows' addresses (else LLVM keeps 16 pointers stepped by 17
            # bytes each, spilled and reloaded every block)
            off = _opaque(b, off) if n == 16 else off
            k.prefetch(a.on, a.w, b.add(nxt, b.mul(blk, c64(n * 17))), range((n * 17 + 63) // 64))
            q = [b.bitcast(k.load(a.w, b.add(b.add(at, off), c64(1)), _V16I8), _V4I32) for at in row_at]
            if n == 16:
                e = _e8m0_bytes(k, a, row_at, off)
            else:                         # the E8M0 bytes: each block's first dword, its low byte
                e = ir.Constant(vi32, None)
                for r, at in enumerate(row_at):
                    e = b.insert_element(e, k.load(a.w, b.add(at, off), _I32), ir.Constant(_I32, r))
                e = b.and_(e, k.c(vi32, 255))
            y = [k.shuf(q[r], range(8), q[r + 4]) for r in range(4)]          # rows r and r + 4
            if n == 16:                                                       # and r + 8, r + 12
                y = [k.shuf(y[r], range(16), k.shuf(q[r + 8], range(8), q[r + 12])) for r in range(4)]
            tr = [k.shuf(y[0], lo_d, y[1]), k.shuf(y[0], hi_d, y[1]), k.shuf(y[2], lo_d, y[3]),
                  k.shuf(y[2], hi_d, y[3])]
            groups = [k.shuf(tr[0], lo_q, tr[2]), k.shuf(tr[0], hi_q, tr[2]), k.shuf(tr[1], lo_q, tr[3]),
                      k.shuf(tr[1], hi_q, tr[3])]                             # bytes 4g.. of the rows
            codes = [b.bitcast(v, vi8) for v in groups]
            lo = [b.call(shuffle, [table, b.and_(v, k.c(vi8, 15))]) for v in codes]
            hi = [b.call(shuffle, [table, b.and_(b.lshr(v, k.c(vi8, 4)), k.c(vi8, 15))]) for v in codes]
            bits = b.select(b.icmp_unsigned("<", e, k.c(vi32, 2)), b.shl(k.c(vi32, 0x00200000), e),
                            b.shl(b.sub(e, k.c(vi32, 1)), k.c(vi32, 23)))
            d = b.bitcast(bits, t.vf)
            new = []
            for i in range(ns):
                xat = b.add(a.xq_at[i], b.mul(blk, c64(QK)))
                x4 = [b.bitcast(k.splat(k.load(a.xq, b.add(xat, c64(4 * g)), _I32), vi32), vi8) for g in range(8)]
                at = b.add(a.xd_at[i], blk)
                zero = k.splat(b.load(b.gep(a.xs, [at]), align=4), vi32)
                if k.vnni:          # two chains (vpdpbusd's latency), the first from the zero point
                    isum = b.add(dp(zero, [(lo[g], x4[g]) for g in range(4)]),
                                 dp(None, [(hi[g], x4[4 + g]) for g in range(4)]))
                else:
                    s_lo = s_hi = None
                    for g in range(4):
                        p_lo, p_hi = k.dot16(lo[g], x4[g]), k.dot16(hi[g], x4[4 + g])
                        s_lo = p_lo if s_lo is None else b.add(s_lo, p_lo)
                        s_hi = p_hi if s_hi is None else b.add(s_hi, p_hi)
                    isum = b.add(b.add(k.wd(s_lo, ones), k.wd(s_hi, ones)), zero)
                dx = k.splat(b.load(b.gep(a.xd, [at]), align=4), t.vf)
                new.append(t.fma(b.fmul(d, dx), b.sitofp(isum, t.vf), accs[i]))
            return new

        outs = t.block_loop(a.n_blocks, ns, block)
        for i, acc in enumerate(outs):
            k.b.store(acc, k.ptr(a.res, b.add(first, c64(i * TILE)), t.vf), align=4)

    _row_loop(k, b.sdiv(b.add(a.n_rows, c64(n - 1)), c64(n)), group)


def _microkernel(kind: int, ns: int):
    body = {Q4K: _q4k_block, Q6K: _q6k_block, MXFP4: lambda k, a, blk, accs: _q8_block(k, a, blk, accs, True),
            Q80: lambda k, a, blk, accs: _q8_block(k, a, blk, accs, False)}[kind]

    def typer(typingctx, w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead):
        if not all(isinstance(v, types.Array) for v in (w, xq, xd, xs, res)):
            return None
        sig = types.void(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)

        def codegen(context, builder, signature, args):
            k = _Row(builder, ns)
            a = _Args(k, context, signature, args, kind)

            def row(rr):
                a.w_at = builder.add(a.w0, builder.mul(rr, a.row_bytes))
                outs = (k.block_loop(a.n_blocks, ns, lambda blk, accs: body(k, a, blk, accs)) if kind in (Q4K, Q6K)
                        else _two_chains(k, a, ns, body))
                for i, acc in enumerate(outs):
                    builder.store(k.lane_sum([acc]), builder.gep(a.res, [builder.add(rr, k.c64(i * TILE))]), align=4)

            if kind == MXFP4:
                _mxfp4_rows(k, a, MXFP4_ROWS)
            else:
                _row_loop(k, a.n_rows, row)
            return context.get_dummy_value()

        return sig, codegen

    typer.__doc__ = (f"``res[i * TILE + rr]`` (float32), i < {ns}, rr < ``n_rows``: weight row rr (``n_blocks`` "
                     "blocks at byte ``w_at + rr * row_bytes`` of ``w``) times activation row ``r_i`` (``xq``, "
                     "``xd``, ``xs`` flat); ``ahead``: prefetch distance in bytes (0: none).")
    return intrinsic(typer)


_q4k_1, _q4k_2, _q4k_3, _q4k_4 = (_microkernel(Q4K, n) for n in range(1, 5))
_q6k_1, _q6k_2, _q6k_3, _q6k_4 = (_microkernel(Q6K, n) for n in range(1, 5))
_mx_1, _mx_2, _mx_3, _mx_4 = (_microkernel(MXFP4, n) for n in range(1, 5))
_q80_1, _q80_2, _q80_3, _q80_4 = (_microkernel(Q80, n) for n in range(1, 5))


@njit(**JIT_INLINE)
def _call(kind, ns, w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead):
    """The microkernel of ``kind`` for ``ns`` (1..4) activation rows and ``n_rows`` weight rows."""
    if kind == Q4K:
        if ns == 4:
            _q4k_4(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        elif ns == 3:
            _q4k_3(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        elif ns == 2:
            _q4k_2(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        else:
            _q4k_1(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
    elif kind == Q6K:
        if ns == 4:
            _q6k_4(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        elif ns == 3:
            _q6k_3(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        elif ns == 2:
            _q6k_2(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        else:
            _q6k_1(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
    elif kind == MXFP4:
        if ns == 4:
            _mx_4(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        elif ns == 3:
            _mx_3(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        elif ns == 2:
            _mx_2(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        else:
            _mx_1(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
    else:
        if ns == 4:
            _q80_4(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        elif ns == 3:
            _q80_3(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        elif ns == 2:
            _q80_2(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)
        else:
            _q80_1(w, w_at, row_bytes, n_rows, n_blocks, xq, xd, xs, r0, r1, r2, r3, res, ahead)


@njit(**JIT)
def _activations(x, kind):
    """The rows of x quantized for ``kind``, flat: ``xq`` int8, ``xd`` float32 (a scale per block),
    ``xs`` int32: Q4_K's sums of 32 and Q6_K's of 16 as int16 pairs (``|sum| <= 32 * 127``),
    MXFP4's ``-12 * sum(xq)`` per block (its codes' zero point), none for Q8_0."""
    if kind == Q4K or kind == Q6K:
        if x.shape[0] <= SERIAL_ROWS:
            xq, xd, xsum = act8._quantized_k(x)
        else:
            xq, xd, xsum = act8._quantized_k_rows(x)
        if kind == Q4K:
            pairs = xsum.reshape(xsum.size // 2, 2)
            xs = (pairs[:, 0] + pairs[:, 1]).astype(np.int16)
        else:
            xs = xsum.reshape(xsum.size).astype(np.int16)
        return xq.reshape(xq.size), xd.reshape(xd.size), xs.view(np.int32)
    zero = -MXFP4_ZERO if kind == MXFP4 else 0
    if x.shape[0] <= SERIAL_ROWS:
        xq, xd, _, off = act8._quantized(x, act8.Q8_0, zero)
    else:
        xq, xd, _, off = act8._quantized_rows(x, act8.Q8_0, zero)
    return xq.reshape(xq.size), xd.reshape(xd.size), off.reshape(off.size)


@intrinsic
def _num_threads(typingctx):
    """The calling thread's count for parallel regions (``numba.get_num_threads()``) from Numba's
    threading layer's own symbol: Numba's overload calls it through ctypes, which a cached kernel
    cannot hold, and from Python the call takes two locks (~12 µs a call, cold, in a decode step).
    Like the region's own ``allocate_sched``, the symbol is there once the thread pool is up
    (:data:`llamatrace.kernels.mul_mat_id._POOL`)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(cgutils.intp_t, []), "get_num_threads")
        return builder.call(fn, [])
    return types.intp(), codegen


@njit(**JIT_PARALLEL)
def _matmul_id(x, rows, order, starts, experts, w0, w1, n_out0, n_out1, row_bytes, n_blocks, kind, out, ahead):
    """:func:`matmul_id`'s region: ``w0`` (part 0, columns ``0..n_out0``) and ``w1`` (part 1,
    columns ``n_out0..``; ``n_out1`` 0: none) flat uint8, expert ``e``'s row ``r`` at byte ``(e *
    n_out + r) * row_bytes``. Work items: (group, part, tile of :data:`TILE` weight rows), in one
    contiguous share per thread; per weight row, the group's slots :data:`MAX_ROWS` at a time
    (then the 1..3 left)."""
    n_threads = _num_threads()
    xq, xd, xs = _activations(x, kind)
    t0, t1 = (n_out0 + TILE - 1) // TILE, (n_out1 + TILE - 1) // TILE
    per_group = t0 + t1
    n_items = experts.shape[0] * per_group
    n_chunks = min(n_threads, n_items)
    for c in prange(n_chunks):           # a thread's contiguous share of the items, as prange's own split
        res = np.empty(MAX_ROWS * TILE, np.float32)      # once a thread, not once an item
        for item in range(c * n_items // n_chunks, (c + 1) * n_items // n_chunks):
            g, t = item // per_group, item % per_group
            w, n_out, col, r0 = w0, n_out0, 0, t * TILE
            if t >= t0:
                w, n_out, col, r0 = w1, n_out1, n_out0, (t - t0) * TILE
            e, first, end = experts[g], starts[g], starts[g + 1]
            n_rows = min(r0 + TILE, n_out) - r0
            s = first
            while s < end:
                ns = min(MAX_ROWS, end - s)
                last = end - 1
                _call(kind, ns, w, (e * n_out + r0) * row_bytes, row_bytes, n_rows, n_blocks, xq, xd, xs,
                      rows[order[s]], rows[order[min(s + 1, last)]], rows[order[min(s + 2, last)]],
                      rows[order[min(s + 3, last)]], res, ahead)
                for i in range(ns):
                    o = out[order[s + i]]
                    for r in range(n_rows):
                        o[col + r0 + r] = res[i * TILE + r]
                s += ns

AHEAD = {Q4K: 8192, Q6K: 8192, MXFP4: MXFP4_ROWS, Q80: 8192}
"""Each kind's software prefetch distance (0: none): bytes along a row; MXFP4: weight rows ahead
of its 8 (a slice of them per block). Q4_K and Q6_K decode, qwen3moe shapes, one thread: none
8.3-9.0, 2 KB 10.3-10.7, 8 KB 10.2-10.7 GB/s; MXFP4 [2880, 2880], one thread, cold: none 8.3,
8 rows 14.4-15.6, 16 rows 15.7, 32 rows 14.4 GB/s. Zen 4, two threads, qwen3moe-8 gate|up cold,
against 8 KB: none 0.92-0.98x, 4 KB 0.87-0.95x, 16 KB 0.95-1.01x; ``prefetcht0`` 0.95-0.98x."""


def _read_only(data: np.ndarray) -> np.ndarray:
    """``data`` flat, read-only as a map of the file is (one compiled signature for both)."""
    flat = np.ascontiguousarray(data).reshape(-1)
    if flat.flags.writeable:
        flat = flat.view()
        flat.flags.writeable = False
    return flat


class Parts(tuple):
    """1 or 2 parts of one type, ``n_expert`` and ``row_bytes`` (a tuple of them, as :func:`matmul_id`
    takes them), with what its region needs of them looked up and checked once: an
    :class:`~llamatrace.kernels.mul_mat_id.ExpertParts` keeps one, since the checks, views and enum
    look-ups cost ~40 µs a call with the caches cold after an expert matmul (16 calls a qwen3moe-8
    step).

    Attributes:
        ggml_type, n_in: the parts' type and input width.
        kind: the type's kernel (:data:`Q4K`, ...).
        w0, w1: the first and last part flat, read-only uint8 (one part: the same).
        n_out0, n_out1: their rows (``n_out1`` 0: one part).
        row_bytes, n_blocks: a weight row's bytes and blocks.

    Raises:
        ValueError: a type outside :data:`TYPES`, or parts that do not fit ``n_in``.
    """

    def __new__(cls, datas, ggml_type, n_in: int) -> "Parts":
        kind = _KIND.get(_T(ggml_type))
        if kind is None:
            raise ValueError(f"mul_mat_id_q8: no kernel for {_T(ggml_type).name}")
        block, size = gguf.GGML_QUANT_SIZES[_T(ggml_type)]
        if not 1 <= len(datas) <= 2 or n_in % block or any(
                d.ndim != 3 or d.shape[2] != n_in // block * size or d.shape[0] != datas[0].shape[0] for d in datas):
            raise ValueError(f"mul_mat_id_q8: parts {[list(d.shape) for d in datas]} do not fit n_in {n_in} "
                             f"of {_T(ggml_type).name}")
        self = super().__new__(cls, datas)
        self.ggml_type, self.n_in, self.kind = _T(ggml_type), n_in, kind
        self.w0, self.w1 = _read_only(datas[0]), _read_only(datas[-1])
        self.n_out0, self.n_out1 = datas[0].shape[1], datas[1].shape[1] if len(datas) == 2 else 0
        self.row_bytes, self.n_blocks = datas[0].shape[2], n_in // block
        return self


def matmul_id(x, rows, order, starts, experts, datas, ggml_type) -> np.ndarray:
    """``out[i] = q8(x[rows[i]]) @ W[ids[i]].T`` over the groups of :func:`llamatrace.kernels.mul_mat_id.groups`.

    Args:
        x: float32 ``[n_rows, n_in]`` C-contiguous.
        rows, order, starts, experts: int64 (:func:`llamatrace.kernels.mul_mat_id.groups` of the
            slots' ids; ``rows[i]`` slot i's row of x).
        datas: 1 or 2 uint8 ``[n_expert, n_out_p, row_bytes]`` C-contiguous (the file's blocks;
            read-only is fine), one type, ``n_expert`` and ``row_bytes``; or their :class:`Parts`
            of ``ggml_type`` and ``n_in`` (checked already).
        ggml_type: one of :data:`TYPES`.

    Returns:
        float32 ``[n_slots, sum of n_out_p]``.

    Raises:
        ValueError: a type outside :data:`TYPES`, or parts that do not fit.
    """
    n_in = x.shape[1]
    p = datas
    if not (isinstance(p, Parts) and p.ggml_type == ggml_type and p.n_in == n_in):
        p = Parts(datas, ggml_type, n_in)
    out = np.empty((order.shape[0], p.n_out0 + p.n_out1), dtype=np.float32)
    if order.shape[0] == 0:
        return out
    _matmul_id(np.ascontiguousarray(x, np.float32), rows, order, starts, experts, p.w0, p.w1, p.n_out0, p.n_out1,
               p.row_bytes, p.n_blocks, p.kind, out, AHEAD[p.kind])
    return out


def activations_ref(x: np.ndarray, ggml_type) -> np.ndarray:
    """float64 ``[n_rows, n_in]``: ``x`` as these kernels quantize it for ``ggml_type``, dequantized
    (act8's NumPy twins: :func:`~llamatrace.kernels.int8.act8.quantize_k_np` for Q4_K and Q6_K,
    :func:`~llamatrace.kernels.int8.act8.quantize_np` Q8_0 for MXFP4 and Q8_0). Raises
    ``ValueError`` for a type outside :data:`TYPES`."""
    kind = _KIND.get(_T(ggml_type))
    if kind is None:
        raise ValueError(f"mul_mat_id_q8: no kernel for {_T(ggml_type).name}")
    x = np.ascontiguousarray(x, np.float32)
    n_rows, n_in = x.shape
    if kind in (Q4K, Q6K):
        xq, xd, _ = act8.quantize_k_np(x)
        per = QK_K
    else:
        xq, xd, _ = act8.quantize_np(x, act8.Q8_0)
        per = QK
    xs = xq.reshape(n_rows, n_in // per, per).astype(np.float64) * xd.astype(np.float64)[:, :, None]
    return xs.reshape(n_rows, n_in)
