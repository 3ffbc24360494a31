"""8-bit activations: the optional ``--activations q8`` mode for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K weights.

This module is the mode's shared machinery: activation quantization, the byte-group layout, the
Numba matmul kernels and their NumPy twins. Which of them serves a weight type, with which
arguments, is in that type's declaration (``q8`` kernels and ``q8_bytes`` of
:class:`~llamatrace.kernels.types.registry.QuantType`, in :mod:`~llamatrace.kernels.types.q4`,
:mod:`~llamatrace.kernels.types.q8`, :mod:`~llamatrace.kernels.types.k_quants`).

llamatrace's default arithmetic is float32 activations times dequantized weights (matching HF
transformers fp32 to ~1e-5). llama.cpp instead quantizes each activation row to 8 bits and
multiplies integers (ggml-cpu ``quantize_row_q8_0`` and ``ggml_vec_dot_q4_0_q8_0``; for
K-quants ``quantize_row_q8_K`` and ``ggml_vec_dot_q6_K_q8_K``); this module does the same,
beside the float32 path and never instead of it:

1. Each block of 32 activations becomes ``xd * xq`` with ``xd = fp16(max|x| / 127)`` and
   ``xq = rint(x * (127 / max|x|))`` int8 in -127..127, rounded half to even: the x86 code
   llama.cpp's CPU backend runs (ggml-cpu ``quantize_row_q8_0``; gguf-py's and ggml's reference
   ``quantize_row_q8_0_ref`` divide by the scale and round half away from zero, which differs
   in ~0.05 % of the quants). Weights with a minimum (Q4_1, Q5_1) take Q8_1 as in llama.cpp:
   the block's ``s = fp16(max|x| / 127 * sum_j xq[j])`` rounded on its own (``quantize(x, Q8_1)``).
   Q4_K's blocks of 32 (see 3.) are not llama.cpp's (it takes Q8_K), and keep float32 scales
   (``quantize(x, PER32_F32)``): fp16 ones add error there without matching anything.
   With all three, layer 0's Q/V projections of SmolLM2 Q4_1 equal llama.cpp's to 1e-7
   relative; with float32 scales and gguf-py's rounding they were 3e-4 and 1.2e-3 off.
   A block's largest ``|x|`` is an integer max of the float bits and its rounding one vector
   step in LLVM IR (:func:`_rounded_of`): ~0.4 ns a value on AVX-512, against ~3 with a scalar
   loop (docs/performance.md, "Where the time goes").
2. Per block and weight row, the integer dot product ``isum = sum_j q[j] * xq[j]`` is exact in
   int32, and ``y += (d * xd) * isum + m_scale * m * xs`` in float32 (``xs = xd * sum_j
   xq[j]``, or Q8_1's ``s``), with
   the weight ``d * q + m_scale * m`` as in :mod:`llamatrace.kernels.types.q4` (Q4_0: ``q`` in 0..15,
   ``m = d``, ``m_scale = -8``; Q4_1: ``m_scale = 1``; Q8_0: ``q`` int8, no offset). Q5_0 and
   Q5_1 (llama.cpp's ``ggml_vec_dot_q5_0_q8_0`` / ``_q5_1_q8_1``) sum ``q - 16`` (no offset
   term) / ``q`` (``m_scale = 1``) as Q8_0's int8 quants (:func:`_matmul_q5`).
   Q4_K's sub-blocks are 32 weights too: ``y += (d * sc * xd) * isum - (dmin * mn) * (xd *
   sum xq)`` per sub-block (:mod:`llamatrace.kernels.types.k_quants`).
3. Q6_K weights take ggml's Q8_K activations instead (:func:`quantize_k`), as llama.cpp's
   ``ggml_vec_dot_q6_K_q8_K`` does: one scale per 256, so the block's 16 int8 scales (one per
   16 weights) are applied in integers and its float work is one line per row. ``q`` in -32..31
   is summed as ``q + 32`` in 0..63: ``y += d * xd * sum_j sc_j * (isum_j - 32 * sum xq_j)``
   over the 16 groups of 16. (Q4_K the same way, integer scales and mins per block, measured
   0.94-1.08x the per-32 path in decode and 0.83-0.88x in prefill, so it keeps the per-32 path,
   which also rounds activations more finely. With Q8_K and a float32 ``d sc`` per sub-block,
   the mins in integers, a timing prototype of the zmm asm prefill ran 1.02-1.11x the per-32
   asm: not built, docs/performance.md "Where the time goes".)

The error is that of rounding x to 8 bits, about 1e-2 relative per matmul, as in llama.cpp
(``llamatrace compare`` shows it stage by stage); the integer part adds none.

Layout. A dot product of bytes needs the bytes of one row side by side, so weights in this
mode keep the float32 path's arrays (``qs [T, B, P, TR]``, :mod:`llamatrace.kernels.types.packing`,
:mod:`llamatrace.kernels.types.k_quants`) with each block's quant bytes (:func:`grouped_bytes`) not in
``[P, TR]`` order (byte j of row r at ``j*TR + r``) but in groups of four bytes per row,
``[P/4, TR, 4]``, as the packers write them at load (byte
``4g + i`` of row r at ``(g*TR + r)*4 + i``). Q4_0/Q4_1 byte ``j`` holds weight ``j`` in its low
nibble and ``16 + j`` in its high nibble; Q4_K keeps its 16 scale bytes per row first and then
has four 32-byte chunks, low nibbles sub-block ``2c``, high nibbles ``2c + 1``; Q6_K regroups its
``ql[128] qh[64]`` and keeps its 16 int8 scales last. The same bytes, the same memory, in another order.
The scales ``d`` and minimums ``m`` ``[T, B, TR]`` stay the file's fp16 bits (uint16), widened
as the kernels read them (:func:`llamatrace.machine.jit.f16`, F16C): a Q4_0 block is 18 bytes
as in the file, not 20 with float32 scales, so decode streams 10 % fewer bytes (8B-shaped Q4_0 file: resident 5.59 ->
5.12 GB, decode 1.01-1.02x, paired in one process; outputs bit for bit the same).

Kernels. x86 ``pmaddubsw`` multiplies 32 unsigned bytes by 32 signed bytes and adds adjacent
pairs to int16, ``pmaddwd`` adds pairs of int16 to int32: with four bytes of a row per 32-bit
lane, one register holds 8 rows and each row's four products end up in its own lane. Numba
types integer arithmetic as int64, so the block dot products are written in LLVM IR
(:mod:`llamatrace.kernels.int8.act8_ir`) with the AVX2 intrinsics; this mode needs AVX2
(:func:`available`). Overflow bounds: a Q4 pair is at most 2 * 15 * 127 = 3810 and the 8 pairs
of a block summed in int16 at most 30480 < 32767; a Q8_0 pair uses ``|q|`` (<= 128) times
``sign(q) * xq`` (<= 127), at most 32512, and goes to int32 at once; a Q6_K pair is at most
2 * 63 * 127 = 16002, so two pairs (32004) are added in int16 before int32, and a block's
scaled int32 sum is at most 16 * 128 * 16 * 32 * 127 < 2**31. Q6_K's decode microkernel
(:func:`~llamatrace.kernels.int8.act8_ir.decode_q6k`) prefetches the next block, spread over its
work (Q6_K [4096, 14336]: that prefetch took the per-block intrinsic before it from 4.4-4.8 ms
to 2.6-2.8 ms on 2 threads). The whole tile a call, with no stack spill, runs at 0.87-1.15 of a
plain read of the same bytes on the three 8B Q6_K shapes, VNNI and 8 rows a ymm alike, where the
per-block kernel ran 0.80-0.93 (alternated, load 7-8, GB per CPU-second;
:data:`DECODE_AHEAD_Q6K`, docs/performance.md "Decode").

Each Numba kernel has a NumPy twin (``*_np``) that tests compare it with.
"""

from __future__ import annotations

import gguf
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.kernels import tiles
from llamatrace.kernels.int8.act8_ir import (Q6K_SCALES, Q6K_UNPACKED, QK_K_BYTES, decode_q4, decode_q4_0, decode_q4k,
                                             decode_q6k, decode_q8, isum_q8, isum_u8_16, PREFILL_ROWS, prefill_q4,
                                             prefill_q4_0, prefill_q4_0_1row, prefill_q4_0_4rows, prefill_q4_1row,
                                             prefill_q4_4rows, prefill_q4k, prefill_q8, prefill_q8_1row,
                                             prefill_q8_4rows, prefill_q4k_1row, prefill_q4k_4rows, prefill_q6k,
                                             prefill_q6k_1row, prefill_q6k_4rows, unpack_q6k, unpack_q6k_pairs)
from llamatrace.kernels.tiles import prefill_lanes
from llamatrace.kernels.types.registry import TYPES
from llamatrace.machine.jit import (JIT_EXACT, JIT_EXACT_PARALLEL, JIT_INLINE, JIT_PARALLEL, f16, f16_np, f16_round,
                                    f32_from_bits, has_vnni)

_T = gguf.GGMLQuantizationType

TR = tiles.TR
QK = 32
QK_K = 256

Q4K_HEAD = 16
"""Q4_K: the scale bytes sc[8] mn[8] per row before its 128 grouped quant bytes."""


def available() -> bool:
    """True when this CPU has AVX2, which the 8-bit kernels' instructions need."""
    return bool(llvm_binding.get_host_cpu_features().get("avx2", False))


# --------------------------------------------------------------------------------------------
# layout


def grouped_bytes(ggml_type) -> tuple[int, int]:
    """The packed bytes ``[head, end)`` of a block row held in groups of four (the scales
    around them stay in the float32 path's order): the type's declared ``q8_bytes``.
    :mod:`llamatrace.kernels.types.packing` writes them so at load (:func:`llamatrace.kernels.tiles.byte_offset`);
    a separate pass over the packed bytes cost 2 s of an 8B Q4_K_M load. Raises ``KeyError`` for
    a type without ``q8`` kernels."""
    q8_bytes = TYPES[_T(ggml_type)].q8_bytes
    if q8_bytes is None:
        raise KeyError(f"{_T(ggml_type).name} has no q8 kernels")
    return q8_bytes


def _regroup(qs: np.ndarray, ggml_type, to_groups: bool, tiles_per_step: int = 64) -> np.ndarray:
    """Reorder every block's quant bytes of ``qs [T, B, P, TR]`` in place, ``tiles_per_step`` tiles
    at a time (the only temporary): ``[P, TR]`` -> ``[P/4, TR, 4]`` or back (``to_groups``
    True: what :mod:`llamatrace.kernels.types.packing` writes at load in this mode)."""
    n_tiles, n_blocks, n_bytes, tr = qs.shape
    head, end = grouped_bytes(ggml_type)
    groups = (end - head) // 4
    src = (groups, 4, tr) if to_groups else (groups, tr, 4)
    for t0 in range(0, n_tiles, tiles_per_step):
        part = qs[t0:t0 + tiles_per_step, :, head:end]
        part[...] = part.reshape(part.shape[:2] + src).transpose(0, 1, 2, 4, 3).reshape(part.shape)
    return qs


VNNI = has_vnni()
Q8_0_UNSIGNED = VNNI
"""Whether the load packs a Q8_0 weight's quants as ``q + 128`` (uint8) rather than ``q`` (int8):
where ``vpdpbusd`` multiplies unsigned weight bytes, so that its decode and prefill kernels load
them as they are (the kernels take either, by dtype: :func:`~llamatrace.kernels.int8.act8_ir.decode_q8`)."""


def q8_0_quants(q: np.ndarray) -> np.ndarray:
    """Q8_0's int8 quants from packed bytes of either layout: int8 as they are, uint8 ``q + 128``."""
    return q.view(np.int8) if q.dtype == np.int8 else (q ^ np.uint8(0x80)).view(np.int8)


def file_order(qs: np.ndarray, ggml_type) -> np.ndarray:
    """A copy of ``qs`` (this module's layout) in the float32 path's layout (Q8_0: int8 quants,
    :func:`q8_0_quants`)."""
    out = _regroup(qs.copy(), ggml_type, False)
    return q8_0_quants(out) if _T(ggml_type) == _T.Q8_0 else out


# --------------------------------------------------------------------------------------------
# activation quantization

Q8_0, Q8_1, PER32_F32 = 0, 1, 2
"""Formats of :func:`quantize`: llama.cpp's Q8_0, its Q8_1, and Q4_K's blocks of 32 with float32 scales."""


def quantize_np(x: np.ndarray, fmt: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of :func:`quantize`: ggml-cpu's x86 ``quantize_row_q8_0`` / ``quantize_row_q8_1``
    arithmetic, written out."""
    n_seq, n = x.shape
    xb = x.reshape(n_seq, n // QK, QK).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
        xq = _to_int8_np(np.rint(xb * inv[:, :, None]))
    xd = d if fmt == PER32_F32 else d.astype(np.float16).astype(np.float32)
    total = xq.sum(axis=2, dtype=np.int32).astype(np.float32)
    xs = (d * total).astype(np.float16).astype(np.float32) if fmt == Q8_1 else (xd * total).astype(np.float32)
    return xq.reshape(n_seq, n), xd, xs


def _to_int8_np(v: np.ndarray) -> np.ndarray:
    """Rounded ``x * inv`` as int8, as the blocks' intrinsics (:func:`_rounded_of`) do: +inf 127,
    -inf and NaN 0."""
    return np.where(v > -128, np.minimum(v, 127), 0).astype(np.int8)


_ABS_BITS = 0x7FFFFFFF
"""A float32's bits but the sign: as integers they are in the order of the values ``|x|``, any NaN
above inf (:data:`_INF_BITS`)."""
_INF_BITS = 0x7F800000

# A block's steps in LLVM IR on <n x float> vectors, n a constant: straight-line vector code, as
# ggml's quantize_row_q8_0 (a Numba loop of 32 is unrolled into scalar steps before LLVM
# vectorises loops, and a loop of unknown length costs its checks per block). No fast-math flags:
# IEEE products, rint rounds half to even.
_F32, _I32 = ir.FloatType(), ir.IntType(32)


def _vector_at(context, builder, sig, args, i, at, n, element=None):
    """Pointer to ``n`` elements (``element``: the array's own type, or another of its size) of
    the C-contiguous array ``args[i]`` from index ``at``."""
    data = context.make_array(sig.args[i])(context, builder, args[i]).data
    vtype = ir.VectorType(element or data.type.pointee, n)
    return builder.bitcast(builder.gep(data, [at]), vtype.as_pointer())


def _splat(builder, value, n):
    vtype = ir.VectorType(value.type, n)
    one = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vtype, None), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _vector_intrinsic(builder, name, vtype, result):
    """The LLVM intrinsic ``name`` overloaded on the vector type ``vtype`` (llvmlite does not name
    vector overloads), taking one ``vtype`` and returning ``result``."""
    element = "f32" if vtype.element == _F32 else f"i{vtype.element.width}"
    return builder.module.declare_intrinsic(f"{name}.v{vtype.count}{element}", (), ir.FunctionType(result, [vtype]))


def _reduce(builder, op, v):
    """``llvm.vector.reduce.<op>`` of the integer vector ``v``."""
    return builder.call(_vector_intrinsic(builder, f"llvm.vector.reduce.{op}", v.type, v.type.element), [v])


def _row_ok(x, at):
    return x == types.Array(types.float32, 1, "C") and isinstance(at, types.Integer)


def _abs_bits_of(n):
    """Intrinsics on the float32 ``x[at:at + n]`` (C-contiguous, no bounds checks):
    ``abs_max_bits(x, at)``, the int32 bits of the largest ``|x|`` (above :data:`_INF_BITS` if
    one is NaN; an integer max, the bits of ``|x|`` being in its order), and ``first_with(x, at,
    bits)``, the index (0..n-1) of the first ``|x|`` with those bits (``n`` if none)."""
    vi = ir.VectorType(_I32, n)

    def abs_bits(context, builder, sig, args):
        v = builder.load(_vector_at(context, builder, sig, args, 0, args[1], n, _I32), align=4)
        return builder.and_(v, ir.Constant(vi, [_ABS_BITS] * n))

    @intrinsic
    def abs_max_bits(typingctx, x, at):
        if _row_ok(x, at):
            def codegen(context, builder, sig, args):
                return _reduce(builder, "umax", abs_bits(context, builder, sig, args))
            return types.int32(x, at), codegen

    @intrinsic
    def first_with(typingctx, x, at, bits):
        if _row_ok(x, at) and bits == types.int32:
            def codegen(context, builder, sig, args):
                equal = builder.icmp_unsigned("==", abs_bits(context, builder, sig, args), _splat(builder, args[2], n))
                index = builder.select(equal, ir.Constant(vi, list(range(n))), ir.Constant(vi, [n] * n))
                return _reduce(builder, "umin", index)
            return types.int32(x, at, bits), codegen

    return abs_max_bits, first_with


def _rounded_of(n):
    """An intrinsic ``rounded(x, xq, at, inv)``: ``xq[at:at + n] = rint(x[at:at + n] * inv)`` as
    int8 (float32 product, half to even), returning their int32 sum; x float32, xq int8, both
    C-contiguous, no bounds checks. Within -127..127 when ``|x| <= 127 / inv`` (a block's own
    scale); where ``inv`` overflowed to inf (a block below ~3.7e-37) +inf gives 127, -inf and NaN
    (``0 * inf``) 0: what x86's conversion of those gave before the rule was written down, and
    :func:`_to_int8_np`."""
    vf, vb = ir.VectorType(_F32, n), ir.VectorType(ir.IntType(8), n)

    @intrinsic
    def rounded(typingctx, x, xq, at, inv):
        if _row_ok(x, at) and xq == types.Array(types.int8, 1, "C") and inv == types.float32:
            def codegen(context, builder, sig, args):
                b = builder
                v = b.load(_vector_at(context, b, sig, args, 0, args[2], n), align=4)
                rint = _vector_intrinsic(b, "llvm.rint", vf, vf)
                r = b.call(rint, [b.fmul(v, _splat(b, args[3], n))])
                r = b.select(b.fcmp_ordered(">", r, ir.Constant(vf, [-128.0] * n)), r, ir.Constant(vf, [0.0] * n))
                r = b.select(b.fcmp_ordered("<", r, ir.Constant(vf, [127.0] * n)), r, ir.Constant(vf, [127.0] * n))
                q = b.fptosi(r, vb)
                b.store(q, _vector_at(context, b, sig, args, 1, args[2], n), align=1)
                return _reduce(b, "add", b.sext(q, ir.VectorType(_I32, n)))
            return types.int32(x, xq, at, inv), codegen

    return rounded


_abs_max_bits_32, _ = _abs_bits_of(QK)
_abs_max_bits_256, _first_with_256 = _abs_bits_of(QK_K)
_rounded_32, _rounded_16 = _rounded_of(QK), _rounded_of(16)


@njit(**JIT_EXACT)
def _quantize_row(x, xq, xd, xs, fmt, zero, off):
    """:func:`quantize` of one row: x float32 [n] C-contiguous, xq int8 [n], xd and xs float32 [n/32];
    ``off`` int32 [n/32] (or empty: not written) ``zero * sum(xq)`` per block, the integer a block's
    dot product starts from when its weights carry a zero point (Q4_0's 8: ``zero`` -8; Q8_0's
    ``q + 128`` on VNNI: -128)."""
    for b in range(xd.shape[0]):
        at = b * QK
        m = _abs_max_bits_32(x, at)
        amax = f32_from_bits(m)
        if m > _INF_BITS:               # a NaN stays: the block's scale is NaN (its last NaN, as ever)
            for j in range(at, at + QK):
                if x[j] != x[j]:
                    amax = abs(x[j])
        # ggml's float32 amax / 127 and 127 / amax, correctly rounded even if a caller's 'arcp'
        # flag reaches this code: a float64 quotient rounded to float32 is the float32 quotient
        d = np.float32(np.float64(amax) / 127.0)
        inv = np.float32(127.0 / np.float64(amax)) if amax != 0 else np.float32(0.0)
        total = _rounded_32(x, xq, at, inv)                  # ties to even, as _mm256_round_ps
        if off.shape[0]:
            off[b] = zero * total
        scale = d if fmt == PER32_F32 else f16_round(d)
        xd[b] = scale
        xs[b] = f16_round(d * np.float32(total)) if fmt == Q8_1 else scale * np.float32(total)


@njit(**JIT_EXACT)
def _q8_buffers(n_seq, n, zero):
    """Empty ``xq`` int8 [n_seq, n], ``xd`` and ``xs`` float32 [n_seq, n/32], ``off`` int32
    [n_seq, n/32] (``zero`` 0: [n_seq, 0])."""
    return (np.empty((n_seq, n), np.int8), np.empty((n_seq, n // QK), np.float32),
            np.empty((n_seq, n // QK), np.float32), np.empty((n_seq, n // QK if zero else 0), np.int32))


@njit(**JIT_EXACT)
def _quantized(x, fmt, zero):
    """:func:`quantize` of C-contiguous rows, one thread (decode's one row of 14336: ~6 µs, 0.4 ns
    a value on AVX-512, against ~3 ns with the scalar loop it replaced), and the blocks' zero-point
    offsets ``zero * sum(xq)`` (int32 [S, n/32]; ``zero`` 0: none, [S, 0]): ``xq, xd, xs, off``."""
    xq, xd, xs, off = _q8_buffers(x.shape[0], x.shape[1], zero)
    for s in range(x.shape[0]):
        _quantize_row(x[s], xq[s], xd[s], xs[s], fmt, zero, off[s])
    return xq, xd, xs, off


@njit(**JIT_EXACT_PARALLEL)
def _quantized_rows(x, fmt, zero):
    """:func:`_quantized` with the rows shared among the threads, for the prefill kernels (512
    rows of 14336: ~4 ms of CPU time, ~22 ms with the scalar loop it replaced)."""
    xq, xd, xs, off = _q8_buffers(x.shape[0], x.shape[1], zero)
    for s in prange(x.shape[0]):
        _quantize_row(x[s], xq[s], xd[s], xs[s], fmt, zero, off[s])
    return xq, xd, xs, off


def quantize(x: np.ndarray, fmt: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize activation rows to 8 bits per block of 32, as llama.cpp's CPU backend does on x86:
    ``fmt`` :data:`Q8_0` (ggml-cpu ``quantize_row_q8_0``), :data:`Q8_1` (``quantize_row_q8_1``,
    which it pairs with weights that have a minimum: Q4_1, Q5_1) or :data:`PER32_F32` (Q4_K's
    blocks of 32: scales kept float32).

    Per block: ``d = amax / 127`` (float32), ``xq = rint(x * (127 / amax))`` (ties to even),
    ``xd = fp16(d)`` (``d`` for PER32_F32); ``xs`` is ``xd * sum(xq)`` (exact in float32 for an
    fp16 ``xd``) or, for Q8_1, its ``s = fp16(d * sum(xq))``. x: float32 ``[n_seq, n]``, ``n`` a multiple of 32. Returns ``xq``
    int8 ``[n_seq, n]``, ``xd`` and ``xs`` float32 ``[n_seq, n/32]`` (``x ~ xd * xq``). A block
    holding NaN gets a NaN scale, so NaN reaches the output as in the float32 path; a block
    below ~3.7e-37 see :func:`_rounded_of`.
    """
    return _quantized(np.ascontiguousarray(x, np.float32), fmt, 0)[:3]


def quantize_k_np(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of :func:`quantize_k`: ggml's ``quantize_row_q8_K_ref``, written out."""
    n_seq, n = x.shape
    xb = x.reshape(n_seq, n // QK_K, QK_K).astype(np.float32)
    first = np.abs(xb).argmax(axis=2)[..., None]                         # the first largest |x|
    mx = np.take_along_axis(xb, first, axis=2).astype(np.float64)
    bad = ~np.isfinite(xb).all(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.where(mx == 0, 0, -127.0 / mx).astype(np.float32)
        v = _to_int8_np(np.rint((iscale.astype(np.float64) * xb).astype(np.float32)))
        xq = np.where(bad | (mx == 0), np.int8(0), v)
        xd = np.where(mx == 0, 0, 1.0 / iscale.astype(np.float64)).astype(np.float32)[..., 0]
    xd[bad[..., 0]] = np.nan
    xsum = xq.reshape(n_seq, n // 16, 16).sum(axis=2, dtype=np.int32)
    return xq.reshape(n_seq, n), xd, xsum


@njit(**JIT_EXACT)
def _quantize_k_row(x, xq, xd, xsum):
    """:func:`quantize_k` of one row: x float32 [n] C-contiguous, xq int8 [n], xd float32
    [n/256], xsum int32 [n/16]."""
    for b in range(xd.shape[0]):
        at = b * QK_K
        m = _abs_max_bits_256(x, at)
        if m >= _INF_BITS:                                  # inf or NaN: NaN scale, zero quants
            xq[at:at + QK_K] = 0
            xsum[16 * b:16 * b + 16] = 0
            xd[b] = np.nan
            continue
        mx = x[at + _first_with_256(x, at, m)]              # the first largest |x|
        # the float32 quotients correctly rounded through float64 whatever flags a caller's code
        # carries (as in _quantize_row); the float32 product iscale * x is ggml's; rint rounds
        # half to even, as ggml's nearest_int does
        iscale = np.float32(-127.0 / np.float64(mx)) if m != 0 else np.float32(0.0)
        for g in range(16):
            xsum[16 * b + g] = _rounded_16(x, xq, at + 16 * g, iscale)
        xd[b] = np.float32(1.0 / np.float64(iscale)) if m != 0 else np.float32(0.0)


@njit(**JIT_EXACT)
def _k_buffers(n_seq, n):
    """Empty ``xq`` int8 [n_seq, n], ``xd`` float32 [n_seq, n/256], ``xsum`` int32 [n_seq, n/16]."""
    return (np.empty((n_seq, n), np.int8), np.empty((n_seq, n // QK_K), np.float32),
            np.empty((n_seq, n // 16), np.int32))


@njit(**JIT_EXACT)
def _quantized_k(x):
    """:func:`quantize_k` of C-contiguous rows, one thread."""
    xq, xd, xsum = _k_buffers(x.shape[0], x.shape[1])
    for s in range(x.shape[0]):
        _quantize_k_row(x[s], xq[s], xd[s], xsum[s])
    return xq, xd, xsum


@njit(**JIT_EXACT_PARALLEL)
def _quantized_k_rows(x):
    """:func:`_quantized_k` with the rows shared among the threads (as :func:`_quantized_rows`)."""
    xq, xd, xsum = _k_buffers(x.shape[0], x.shape[1])
    for s in prange(x.shape[0]):
        _quantize_k_row(x[s], xq[s], xd[s], xsum[s])
    return xq, xd, xsum


def quantize_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize activation rows to 8 bits per block of 256, for K-quant weights: ggml's Q8_K
    (``quantize_row_q8_K_ref`` in ggml-quants.c), which llama.cpp multiplies Q2_K..Q6_K with.

    The first element of largest ``|x|`` in a block becomes -127: ``xq = rint(x * (-127 / max))``,
    ``xd = max / -127``. x: float32 ``[n_seq, n]``, ``n`` a multiple of 256. Returns ``xq`` int8
    ``[n_seq, n]``, ``xd`` float32 ``[n_seq, n/256]`` (``x ~ xd * xq``) and ``xsum`` int32
    ``[n_seq, n/16]`` (``sum(xq)`` per 16, ggml's ``bsums``). A block holding NaN or inf gets a
    NaN scale and zero quants, so NaN reaches the output; a block below ~3.7e-37 see :func:`_rounded_of`.
    """
    return _quantized_k(np.ascontiguousarray(x, np.float32))


# --------------------------------------------------------------------------------------------
# matmul kernels


DECODE_AHEAD = 4096
"""How far ahead (bytes) the Q4_0 / Q4_1 decode microkernel prefetches: 8 blocks of a tile. Q4_0
[28672, 4096], one thread, alternated on a shared machine: 2 KB 13.5 GB/s, 4 KB 14.1-14.5, 8 KB
14.1 (a pure read of the same bytes 15-16)."""
DECODE_AHEAD_Q8 = 4096
"""The Q8_0 decode microkernel's prefetch distance (bytes)."""
DECODE_AHEAD_Q4K = 8 * 144 * TR
"""The Q4_K decode microkernel's prefetch distance: eight blocks (36 KB, across tiles). qwen3moe-8's 16
attention matrices (4.7-5.3 MB), each read cold (L3 flushed), 2 threads, one compiled kernel alternated
in one process: 9 KB 15.4-19.0 GB/s, 18 KB 16.8, 36 KB 17.7-20.5, 72 KB 18.5-20.3, 144 KB 16.9, none
11.6 (a plain read of the same bytes 22.9-25.4). In real steps, main's module loaded beside: those
matmuls 9-22 % faster (docs/performance.md "Cold attention matrices")."""
DECODE_AHEAD_Q6K = 2 * 208 * TR
"""The Q6_K decode microkernel's: two blocks on (13 KB). qwen3moe-8's [128256, 2048] output matrix, 16 rows
a zmm, 2 threads, in real steps (kernels swapped per step, one process): 0.17-0.25 ms of ~8-9 faster than one
block, 0.36-0.41 with the shorter block of branch q6kout (docs/performance.md "fewer instructions"). Before
(8 rows a ymm, other shapes): Q6_K [4096, 14336], [1024, 4096] and [128256, 4096], 1 and 2 threads,
alternated in one process at load 5-6, kernel / plain read in GB per CPU-second: one block ahead
0.91-1.11, two 0.89-1.03, half a block 0.88-1.05, none 0.79-0.93 (leaving out [1024, 4096] on 2 threads in
one of the two runs, where the read ran at 1.5x every kernel); one block ahead beat or tied two in 18 of 20
same-round pairs, the other two that case."""


@njit(**JIT_INLINE)
def _add_scaled(a, db, mb, dx, ms, isum):
    """``a[r] += (d[r] * dx) * isum[r] + m[r] * ms`` for the TR rows of a tile block: the float32
    step of llama.cpp's Q4/Q5/Q8 dot products after the int32 sums. a float32 [TR]; db, mb fp16
    bits uint16 [TR]; dx, ms float32; isum int32 [TR]."""
    for r in range(TR):
        a[r] += (f16(db[r]) * dx) * np.float32(isum[r]) + f16(mb[r]) * ms


@njit(**JIT_PARALLEL)
def _matmul_q4(x, qs, d, m, m_scale, signed, out):
    """out[s] = x[s] @ W.T for Q4_0 / Q4_1 / Q8_0 (weight d*q + m_scale*m), x quantized first
    (:func:`quantize`, in the same call: no second dispatch per matmul). x float32 [S, B*32];
    qs [T, B, P, TR] in this module's layout: uint8 nibbles (P = 16), or when ``signed`` (Q8_0, with
    m_scale 0) int8 ``q`` or uint8 ``q + 128`` (P = 32, :data:`Q8_0_UNSIGNED`); d, m fp16 bits
    uint16 [T, B, TR]; out float32 [S, n_out].

    One parallel region over tiles. Per row of x, :func:`~llamatrace.kernels.int8.act8_ir.decode_q4_0`
    / ``decode_q4`` / ``decode_q8`` runs over a whole tile with its sums in registers (zmm: 16 rows a
    register), prefetching :data:`DECODE_AHEAD` (:data:`DECODE_AHEAD_Q8`) bytes ahead into L2 (Q4_0
    decode, one thread, shared machine: 80-83 % -> 89-94 % of a pure read of the same bytes); Q4_0
    (``m_scale`` -8, ``m`` its ``d``) and Q8_0 with VNNI take their zero points in integers (the
    quantizer's offsets, :func:`_quantize_row`), as :func:`_prefill` does, so the same bits as a
    prefill row (Q8_0 on every host). Decode runs it; prefill runs :func:`_prefill`. A weight with a
    minimum (``m_scale`` 1, Q4_1) takes Q8_1 activations, as in llama.cpp."""
    q4_0 = m_scale < 0 and not signed
    # the blocks' integer zero points, as _prefill's: Q4_0's -8 sum(xq), Q8_0's -128 sum(xq) with VNNI
    zero = int(m_scale) if q4_0 else -128 if signed and VNNI else 0
    xq, xd, xs, xoff = _quantized(x, Q8_1 if m_scale > 0 else Q8_0, zero)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    for t in prange(n_tiles):       # a row of x at a time over the whole tile, its sums in registers
        res = np.empty(TR, np.float32)
        for s in range(n_seq):
            if signed:
                decode_q8(qs, t * n_blocks * block, xq, xd, xoff, s, d, m, t * n_blocks * TR, n_blocks, m_scale,
                          res, DECODE_AHEAD_Q8 if s == 0 else 0)
            elif q4_0:
                decode_q4_0(qs, t * n_blocks * block, xq, xd, xoff, s, d, m, t * n_blocks * TR, n_blocks, m_scale,
                            res, DECODE_AHEAD if s == 0 else 0)
            else:
                decode_q4(qs, t * n_blocks * block, xq, xd, xs, s, d, m, t * n_blocks * TR, n_blocks, m_scale,
                          res, DECODE_AHEAD if s == 0 else 0)
            tiles.store_tile(res, out, s, t)


Q5_BYTES = 20
"""Q5_0 / Q5_1: packed bytes of a block row, ``qh[4] qs[16]``, all in groups of four."""


@njit(**JIT_EXACT)
def _unpack_q5(words, base, centered, w32):
    """One Q5_0 / Q5_1 tile block at word ``base`` of ``words`` (the packed bytes as uint32: word
    ``g*TR + r`` holds bytes ``4g..4g+3`` of row r; word ``r`` is its ``qh``, little-endian) ->
    ``w32`` uint32 ``[8 * TR]``, the int8 quants in Q8_0's grouped order (weight ``4g + i`` of row
    r in byte i of word ``g*TR + r``): ``q - 16`` when ``centered`` (Q5_0), else ``q`` (Q5_1), q
    in 0..31 the 5-bit quant. Four bytes a word, rows innermost, so the loops vectorize (Q5_0
    [2048, 640], one row of x: 1.2 ms a byte at a time, 0.31 ms so, the float32 kernel 0.22 ms;
    a shared, busy machine)."""
    for g in range(4):                # qs bytes 4g..4g+3: weights 4g.. (low), 16 + 4g.. (high)
        for r in range(TR):
            qh = np.uint32(words[base + r])
            v = np.uint32(words[base + (1 + g) * TR + r])
            for half in range(2):
                nib = (v >> np.uint32(4 * half)) & np.uint32(0x0F0F0F0F)
                h = qh >> np.uint32(16 * half + 4 * g)     # the fifth bits, to bit 4 of each byte
                top = (((h & np.uint32(1)) << np.uint32(4)) | ((h & np.uint32(2)) << np.uint32(11))
                       | ((h & np.uint32(4)) << np.uint32(18)) | ((h & np.uint32(8)) << np.uint32(25)))
                if centered:          # q - 16 as int8: the nibble, with 0xF0 above it when bit 4 is clear
                    top = (top ^ np.uint32(0x10101010)) * np.uint32(15)
                w32[(4 * half + g) * TR + r] = nib | top


@njit(**JIT_PARALLEL)
def _matmul_q5(x, qs, d, m, m_scale, centered, out):
    """out[s] = x[s] @ W.T for Q5_0 (``centered`` True, ``m_scale`` 0: ``d * (q - 16)``) and Q5_1
    (``centered`` False, ``m_scale`` 1: ``d * q + m``), x quantized first (:func:`quantize`), as
    llama.cpp's ``ggml_vec_dot_q5_0_q8_0`` / ``ggml_vec_dot_q5_1_q8_1``: per block the exact int32
    ``isum = sum_j q'_j * xq_j`` (``q'`` the quant minus 16 or not), then ``y += (d * xd) * isum
    + m * (m_scale * xs)`` in float32, :func:`_matmul_q4`'s operations. Each block is unpacked
    (:func:`_unpack_q5`) to signed bytes in Q8_0's layout once for every row of x, and summed by
    Q8_0's ``isum_q8`` (the 5-bit quants fit int8). Decode and prefill both run it. x float32
    [S, B*32]; qs uint8 [T, B, 20, TR] in this module's layout; d, m fp16 bits uint16 [T, B, TR];
    out float32 [S, n_out]. Q5_1 (``m_scale`` 1) takes Q8_1 activations, as in llama.cpp."""
    xq, xd, xs, _ = _quantized(x, Q8_1 if m_scale > 0 else Q8_0, 0)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    words = qs.reshape(qs.size).view(np.uint32)
    for t in prange(n_tiles):
        isum = np.empty(TR, np.int32)
        w32 = np.empty(8 * TR, np.uint32)
        w8 = w32.view(np.int8)
        acc = np.zeros((n_seq, TR), np.float32)
        for b in range(n_blocks):
            _unpack_q5(words, (t * n_blocks + b) * (Q5_BYTES // 4) * TR, centered, w32)
            db = d[t, b]
            mb = m[t, b]
            for s in range(n_seq):
                isum_q8(w8, 0, xq, (s * n_blocks + b) * QK, isum)
                _add_scaled(acc[s], db, mb, xd[s, b], m_scale * xs[s, b], isum)
        tiles.store_rows(acc, out, t)


LANES = prefill_lanes()                                  # weight rows per microkernel call
NS_Q4, NS_Q8, NS_Q4K, NS_Q6K = (PREFILL_ROWS[k] for k in ("q4", "q8", "q4k", "q6k"))   # activation rows a call


PREFILL_Q4, PREFILL_Q8, PREFILL_Q4K = 0, 1, 2       # _prefill's kinds


@njit(**JIT_PARALLEL)
def _prefill(x, qs, d, m, m_scale, kind, out):
    """As :func:`_matmul_q4` (``kind`` :data:`PREFILL_Q4`: Q4_0 / Q4_1; :data:`PREFILL_Q8`:
    Q8_0, ``m_scale`` unused) or :func:`_matmul_q4k` (:data:`PREFILL_Q4K`, ``m_scale`` unused)
    for many rows of x. Each call of a microkernel (:mod:`llamatrace.kernels.int8.act8_ir`'s
    ``prefill_q4_0``, ``prefill_q4``, ``prefill_q8``, ``prefill_q4k``) runs :data:`NS_Q4` /
    :data:`NS_Q8` / :data:`NS_Q4K` rows of x (then 4, then one at a time for the rows left)
    against :data:`LANES` rows of a tile over every block, its sums in registers, each block's
    weights unpacked once for all those rows. Q4_0 and Q4_1: the same float32 operations in the
    same order as :func:`_matmul_q4`, so the same bits (Q4_0's zero point in integers,
    :func:`_quantize_row`'s offsets, in both); Q8_0: the same int32 sums, one FMA a block where the
    per-row kernel also adds a zero term (within 1e-6); Q4_K: per sub-block, with ``d * sc`` and
    ``dmin * mn`` shared by the rows and FMAs, another float32 order (within 1e-6 of
    :func:`_matmul_q4k`; its activations laid out for the runs of rows first, :func:`_by_runs`, so
    that its zmm asm addresses a call's rows from a pointer per two rows). x float32 [S, B*32]
    (Q4_K: [S, B*256]); out float32 [S, n_out]."""
    fmt = PER32_F32 if kind == PREFILL_Q4K else Q8_1 if kind == PREFILL_Q4 and m_scale > 0 else Q8_0
    q4_0 = kind == PREFILL_Q4 and m_scale < 0
    # the blocks' integer zero points: Q4_0's -8 sum(xq), Q8_0's -128 sum(xq) for VNNI's q + 128
    zero = int(m_scale) if q4_0 else -128 if kind == PREFILL_Q8 and VNNI else 0
    xq, xd, xs, xoff = _quantized_rows(x, fmt, zero)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    most = NS_Q4 if kind == PREFILL_Q4 else NS_Q8 if kind == PREFILL_Q8 else NS_Q4K
    kq, kd, ks = np.empty(0, np.int8), np.empty(0, np.float32), np.empty(0, np.float32)
    if kind == PREFILL_Q4K:         # a call's rows side by side
        kq = _by_runs(xq, np.empty(xq.size, np.int8), QK_K, NS_Q4K)
        kd = _by_runs(xd, np.empty(xd.size, np.float32), 8, NS_Q4K)
        ks = _by_runs(xs, np.empty(xs.size, np.float32), 8, NS_Q4K)
    for t in prange(n_tiles):
        res = np.empty((most, TR), np.float32)
        flat = res.reshape(most * TR)
        q_at = t * n_blocks * block
        dm_at = t * n_blocks * TR
        s0 = 0
        while s0 < n_seq:
            ns = _run_rows(s0, n_seq, most)
            for r in range(0, TR, LANES):
                if kind == PREFILL_Q8:
                    if ns == NS_Q8:
                        prefill_q8(qs, q_at, xq, xd, xoff, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                    elif ns == 4:
                        prefill_q8_4rows(qs, q_at, xq, xd, xoff, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                    else:
                        prefill_q8_1row(qs, q_at, xq, xd, xoff, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                elif kind == PREFILL_Q4K:
                    if ns == NS_Q4K:
                        prefill_q4k(qs, q_at, kq, kd, ks, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                    elif ns == 4:
                        prefill_q4k_4rows(qs, q_at, kq, kd, ks, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                    else:
                        prefill_q4k_1row(qs, q_at, kq, kd, ks, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                elif q4_0:
                    if ns == NS_Q4:
                        prefill_q4_0(qs, q_at, xq, xd, xoff, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                    elif ns == 4:
                        prefill_q4_0_4rows(qs, q_at, xq, xd, xoff, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                    else:
                        prefill_q4_0_1row(qs, q_at, xq, xd, xoff, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                elif ns == NS_Q4:
                    prefill_q4(qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                elif ns == 4:
                    prefill_q4_4rows(qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
                else:
                    prefill_q4_1row(qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, m_scale, flat, r)
            for i in range(ns):
                tiles.store_tile(res[i], out, s0 + i, t)
            s0 += ns


@njit(**JIT_INLINE)
def _run_rows(s0, n_seq, most):
    """Rows of x the prefill microkernel call from row ``s0`` takes: ``most``, else 4, else 1."""
    return most if s0 + most <= n_seq else 4 if s0 + 4 <= n_seq else 1


@njit(**JIT_EXACT)
def _by_runs(a, out, width, most):
    """``a`` [S, B*width] into ``out`` (flat, S*B*width) block by block within each run of rows
    one microkernel call takes (:func:`_run_rows`): the run from row s0 of ns rows holds block b
    of its row i at ``(s0*B + b*ns + i) * width``, so a call finds its rows' block side by side.
    Returns ``out``."""
    n_seq, n_blocks = a.shape[0], a.shape[1] // width
    first, rows = np.empty(n_seq, np.int64), np.empty(n_seq, np.int64)      # each row's run
    s0 = 0
    while s0 < n_seq:
        ns = _run_rows(s0, n_seq, most)
        first[s0:s0 + ns], rows[s0:s0 + ns] = s0, ns
        s0 += ns
    for s in range(n_seq):            # one thread: ~1 ms at [512, 14336], and no extra fork-join
        s0, ns, src = first[s], rows[s], a[s]
        for b in range(n_blocks):
            dst, part = out[(s0 * n_blocks + b * ns + s - s0) * width:], src[b * width:]
            for k in range(width):          # slices from 0: no negative-index checks, a vector copy
                dst[k] = part[k]
    return out


@njit(**JIT_PARALLEL)
def _prefill_q6k(x, qs, d, out, n_chunks):
    """As :func:`_matmul_q6k` for many rows of x: a tile's blocks are unpacked once
    (:func:`llamatrace.kernels.int8.act8_ir.unpack_q6k_pairs`, into a buffer per thread) and the
    microkernel (:func:`llamatrace.kernels.int8.act8_ir.prefill_q6k`) runs :data:`NS_Q6K` rows of x at a
    time (then 4, then one) over them, with the activations' sums of 16 as int16, the sums in
    registers; each group's integer sum scaled in float32 (``d * sc``), so within 1e-7 of
    :func:`_matmul_q6k` relative to the largest output, not its bits. The activations are laid
    out for those runs of rows first (:func:`_by_runs`), so a call's rows sit side by side.
    ``n_chunks``: runs of tiles, one buffer each (the thread count: a buffer per tile would be
    mapped and unmapped each time, ~0.5 MB at n_in 14336)."""
    xq_rows, xd_rows, xsum = _quantized_k_rows(x)
    n_seq = xq_rows.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    xq = _by_runs(xq_rows, np.empty(xq_rows.size, np.int8), QK_K, NS_Q6K)
    xd = _by_runs(xd_rows, np.empty(xd_rows.size, np.float32), 1, NS_Q6K)
    xs16 = _by_runs(xsum, np.empty(xsum.size, np.int16), 16, NS_Q6K)       # |sum| <= 16 * 127
    block = qs.shape[2] * TR
    n_chunks = max(1, min(n_chunks, n_tiles))
    for c in prange(n_chunks):
        unpacked = np.empty(n_blocks * Q6K_UNPACKED, np.uint8)
        unused_isum = np.empty(TR, np.int32)
        res = np.empty((NS_Q6K, TR), np.float32)
        flat = res.reshape(NS_Q6K * TR)
        for t in range(c * n_tiles // n_chunks, (c + 1) * n_tiles // n_chunks):
            for b in range(n_blocks):
                tiles.prefetch_next_block(qs, t, b)
                unpack_q6k_pairs(qs, (t * n_blocks + b) * block, unpacked, b * Q6K_UNPACKED, unused_isum)
            dm_at = t * n_blocks * TR
            s0 = 0
            while s0 < n_seq:
                ns = _run_rows(s0, n_seq, NS_Q6K)
                for r in range(0, TR, LANES):
                    if ns == NS_Q6K:
                        prefill_q6k(unpacked, 0, xq, xd, xs16, s0, d, d, dm_at, n_blocks, np.float32(0.0), flat, r)
                    elif ns == 4:
                        prefill_q6k_4rows(unpacked, 0, xq, xd, xs16, s0, d, d, dm_at, n_blocks, np.float32(0.0), flat, r)
                    else:
                        prefill_q6k_1row(unpacked, 0, xq, xd, xs16, s0, d, d, dm_at, n_blocks, np.float32(0.0), flat, r)
                for i in range(ns):
                    tiles.store_tile(res[i], out, s0 + i, t)
                s0 += ns


@njit(**JIT_PARALLEL)
def _matmul_q4k(x, qs, d, m, out):
    """As :func:`_matmul_q4` for Q4_K: qs uint8 [T, B, 144, TR] (this module's layout), d and
    m (dmin) fp16 bits uint16 [T, B, TR]. Per row of x,
    :func:`~llamatrace.kernels.int8.act8_ir.decode_q4k` runs over a whole tile, its sums in registers,
    prefetching :data:`DECODE_AHEAD_Q4K` bytes ahead: per sub-block pair ``y += d * (sc_j dx_j
    isum_j + sc_j+1 dx_j+1 isum_j+1) - dmin * (mn_j xs_j + mn_j+1 xs_j+1)``, the float32 operations
    (and FMAs) of the per-block loop it replaced, so the same bits."""
    xq, xd, xs, _ = _quantized(x, PER32_F32, 0)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    for t in prange(n_tiles):
        res = np.empty(TR, np.float32)
        for s in range(n_seq):
            decode_q4k(qs, t * n_blocks * block, xq, xd, xs, s, d, m, t * n_blocks * TR, n_blocks, np.float32(0.0), res,
                       DECODE_AHEAD_Q4K if s == 0 else 0)
            tiles.store_tile(res, out, s, t)


@njit(**JIT_PARALLEL)
def _matmul_q6k(x, qs, d, out):
    """As :func:`_matmul_q4` for Q6_K with Q8_K activations (:func:`quantize_k`): qs uint8
    [T, B, 208, TR] (this module's layout), d fp16 bits uint16 [T, B, TR]. The 16 scales of a block are
    applied in integers, then per block ``y += (d * dx) * isum`` in float32. One row of x:
    :func:`~llamatrace.kernels.int8.act8_ir.decode_q6k` runs over a whole tile, its sums in registers,
    prefetching :data:`DECODE_AHEAD_Q6K` bytes ahead; several: each block is unpacked once and
    reused, one block at a time (the same bits for each row)."""
    xq, xd, xsum = _quantized_k(x)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    for t in prange(n_tiles):
        if n_seq == 1:
            res = np.empty(TR, np.float32)
            decode_q6k(qs, t * n_blocks * block, xq, xd, xsum, 0, d, d, t * n_blocks * TR, n_blocks, np.float32(0.0),
                       res, DECODE_AHEAD_Q6K)
            tiles.store_tile(res, out, 0, t)
            continue
        isum = np.empty(TR, np.int32)
        unpacked = np.empty(QK_K_BYTES + 16 * TR, np.uint8)
        acc = np.zeros((n_seq, TR), np.float32)
        for b in range(n_blocks):
            db = d[t, b]
            tiles.prefetch_next_block(qs, t, b)
            unpack_q6k(qs, (t * n_blocks + b) * block, unpacked, 0, isum)
            for s in range(n_seq):
                isum_u8_16(unpacked, 0, xq, (s * n_blocks + b) * QK_K, xsum, (s * n_blocks + b) * 16, isum)
                dx = xd[s, b]
                a = acc[s]
                for r in range(TR):
                    a[r] += (f16(db[r]) * dx) * np.float32(isum[r])
        tiles.store_rows(acc, out, t)


def _isums_np(xq: np.ndarray, q: np.ndarray) -> np.ndarray:
    """int64 [S, T, B, TR]: exact block dot products of xq int8 [S, B*32] with q [T, B, 32, TR]."""
    n_seq = xq.shape[0]
    n_blocks = q.shape[1]
    return np.einsum("sbj,tbjr->stbr", xq.reshape(n_seq, n_blocks, QK).astype(np.int64), q.astype(np.int64))


def matmul_quants_np(x, q, d, m, m_scale) -> np.ndarray:
    """The twins' arithmetic for weights ``d * q + m_scale * m`` in blocks of 32: x float32
    [S, B*32] quantized (:func:`quantize_np`), q integer [T, B, 32, TR] (weight order), d, m fp16
    bits uint16 [T, B, TR]; float64 sums; a weight with a minimum (``m_scale`` > 0) takes Q8_1
    activations. Returns float32 [S, T*TR]."""
    d, m = f16_np(d), f16_np(m)
    xq, xd, xs = quantize_np(x, Q8_1 if m_scale > 0 else Q8_0)
    isum = _isums_np(xq, q).astype(np.float64)
    y = (d[None] * xd[:, None, :, None] * isum
         + float(m_scale) * m[None] * xs[:, None, :, None].astype(np.float64)).sum(axis=2)
    return y.reshape(xq.shape[0], -1).astype(np.float32)


def matmul_q4_np(x, qs, d, m, m_scale) -> np.ndarray:
    """NumPy twin of :func:`_matmul_q4` (float64 sums). Returns float32 [S, T*TR]."""
    q = file_order(qs, _T.Q4_0)
    return matmul_quants_np(x, np.concatenate([q & 0x0F, q >> 4], axis=2), d, m, m_scale)   # [T, B, 32, TR]


def matmul_q8_np(x, qs, d) -> np.ndarray:
    """NumPy twin of :func:`_matmul_q4` for Q8_0 (float64 sums). Returns float32 [S, T*TR]."""
    d = f16_np(d)
    xq, xd, _ = quantize_np(x)
    isum = _isums_np(xq, file_order(qs, _T.Q8_0)).astype(np.float64)
    y = (d[None] * xd[:, None, :, None] * isum).sum(axis=2)
    return y.reshape(xq.shape[0], -1).astype(np.float32)


def matmul_q4k_np(x, qs, d, m) -> np.ndarray:
    """NumPy twin of :func:`_matmul_q4k` (float64 sums). Returns float32 [S, T*TR]."""
    d, m = f16_np(d), f16_np(m)
    xq, xd, xs = quantize_np(x, PER32_F32)
    p = file_order(qs, _T.Q4_K)                                             # [T, B, 144, TR]
    n_tiles, n_blocks = p.shape[0], p.shape[1]
    e = np.arange(256)
    q = (p[:, :, Q4K_HEAD + 32 * (e // 64) + e % 32] >> (4 * ((e // 32) % 2))[None, None, :, None]) & 15
    isum = _isums_np(xq, q.reshape(n_tiles, n_blocks * 8, 32, TR)).astype(np.float64)   # [S, T, B*8, TR]
    sc = p[:, :, :8].reshape(n_tiles, n_blocks * 8, TR).astype(np.float64)
    mn = p[:, :, 8:16].reshape(n_tiles, n_blocks * 8, TR).astype(np.float64)
    dd, mm = np.repeat(d, 8, axis=1), np.repeat(m, 8, axis=1)               # [T, B*8, TR]
    y = (dd * sc * xd[:, None, :, None] * isum - mm * mn * xs[:, None, :, None].astype(np.float64)).sum(axis=2)
    return y.reshape(xq.shape[0], -1).astype(np.float32)


def matmul_q6k_np(x, qs, d) -> np.ndarray:
    """NumPy twin of :func:`_matmul_q6k` (float64 sums, the file's signed quants). Returns float32
    [S, T*TR]."""
    d = f16_np(d)
    p = file_order(qs, _T.Q6_K)                                             # [T, B, 208, TR]
    n_tiles, n_blocks = p.shape[0], p.shape[1]
    e = np.arange(256)
    half, c, l = e // 128, (e % 128) // 32, e % 32
    ql = (p[:, :, 64 * half + 32 * (c % 2) + l] >> (4 * (c // 2))[:, None]) & 15   # [T, B, 256, TR]
    qh = (p[:, :, 128 + 32 * half + l] >> (2 * c)[:, None]) & 3
    q = (ql | (qh << 4)).astype(np.int64) - 32                              # [T, B, 256, TR]
    sc = p[:, :, Q6K_SCALES:].view(np.int8).reshape(n_tiles, n_blocks * 16, TR).astype(np.float64)
    dd = np.repeat(d, 16, axis=1)                                           # [T, B*16, TR]
    xq, xd, _ = quantize_k_np(x)                                            # Q8_K: one scale per 256
    n_seq = xq.shape[0]
    xg = xq.reshape(n_seq, n_blocks * 16, 16).astype(np.int64)
    isum = np.einsum("sgj,tgjr->stgr", xg, q.reshape(n_tiles, n_blocks * 16, 16, TR)).astype(np.float64)
    xd16 = np.repeat(xd, 16, axis=1).astype(np.float64)                     # [S, B*16]
    y = (dd * sc * xd16[:, None, :, None] * isum).sum(axis=2)
    return y.reshape(n_seq, -1).astype(np.float32)
