"""8-bit activations: the optional ``--activations q8`` mode for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K weights.

llamatrace's default arithmetic is float32 activations times dequantized weights (matching HF
transformers fp32 to ~1e-5). llama.cpp instead quantizes each activation row to 8 bits and
multiplies integers (ggml-cpu ``quantize_row_q8_0`` and ``ggml_vec_dot_q4_0_q8_0``; for
K-quants ``quantize_row_q8_K`` and ``ggml_vec_dot_q6_K_q8_K``); this module does the same,
beside the float32 path and never instead of it:

1. Each block of 32 activations becomes ``xd * xq`` with ``xd = max|x| / 127`` (float32) and
   ``xq = round(x / xd)`` int8 in -127..127, rounded half away from zero: gguf-py's
   ``quants.Q8_0`` quantization (which is ggml's), except that ``xd`` stays float32 instead of
   being rounded to float16.
2. Per block and weight row, the integer dot product ``isum = sum_j q[j] * xq[j]`` is exact in
   int32, and ``y += (d * xd) * isum + m_scale * m * (xd * sum_j xq[j])`` in float32, with
   the weight ``d * q + m_scale * m`` as in :mod:`llamatrace.kernels.quant` (Q4_0: ``q`` in 0..15,
   ``m = d``, ``m_scale = -8``; Q4_1: ``m_scale = 1``; Q8_0: ``q`` int8, no offset).
   Q4_K's sub-blocks are 32 weights too: ``y += (d * sc * xd) * isum - (dmin * mn) * (xd *
   sum xq)`` per sub-block (:mod:`llamatrace.kernels.k_quants`).
3. Q6_K weights take ggml's Q8_K activations instead (:func:`quantize_k`), as llama.cpp's
   ``ggml_vec_dot_q6_K_q8_K`` does: one scale per 256, so the block's 16 int8 scales (one per
   16 weights) are applied in integers and its float work is one line per row. ``q`` in -32..31
   is summed as ``q + 32`` in 0..63: ``y += d * xd * sum_j sc_j * (isum_j - 32 * sum xq_j)``
   over the 16 groups of 16. (Q4_K the same way, integer scales and mins per block, measured
   0.94-1.08x the per-32 path in decode and 0.83-0.88x in prefill, so it keeps the per-32 path,
   which also rounds activations more finely.)

The error is that of rounding x to 8 bits, about 1e-2 relative per matmul, as in llama.cpp
(``llamatrace compare`` shows it stage by stage); the integer part adds none.

Layout. A dot product of bytes needs the bytes of one row side by side, so weights in this
mode keep the float32 path's arrays (``qs [T, B, P, TR]``, :mod:`llamatrace.kernels.quant`,
:mod:`llamatrace.kernels.k_quants`) with each block's quant bytes (:func:`grouped_bytes`) not in
``[P, TR]`` order (byte j of row r at ``j*TR + r``) but in groups of four bytes per row,
``[P/4, TR, 4]``, as the packers write them at load (byte
``4g + i`` of row r at ``(g*TR + r)*4 + i``). Q4_0/Q4_1 byte ``j`` holds weight ``j`` in its low
nibble and ``16 + j`` in its high nibble; Q4_K keeps its 16 scale bytes per row first and then
has four 32-byte chunks, low nibbles sub-block ``2c``, high nibbles ``2c + 1``; Q6_K regroups its
``ql[128] qh[64]`` and keeps its 16 int8 scales last. The same bytes, the same memory, in another order.
The scales ``d`` and minimums ``m`` ``[T, B, TR]`` stay the file's fp16 bits (uint16), widened
as the kernels read them (:func:`_f16`, F16C): a Q4_0 block is 18 bytes as in the file, not 20
with float32 scales, so decode streams 10 % fewer bytes (8B-shaped Q4_0 file: resident 5.59 ->
5.12 GB, decode 1.01-1.02x, paired in one process; outputs bit for bit the same).

Kernels. x86 ``pmaddubsw`` multiplies 32 unsigned bytes by 32 signed bytes and adds adjacent
pairs to int16, ``pmaddwd`` adds pairs of int16 to int32: with four bytes of a row per 32-bit
lane, one register holds 8 rows and each row's four products end up in its own lane. Numba
types integer arithmetic as int64, so the block dot products are written in LLVM IR
(:func:`_isum_q4`, :func:`_isum_q8`) with the AVX2 intrinsics; this mode needs AVX2
(:func:`available`). Overflow bounds: a Q4 pair is at most 2 * 15 * 127 = 3810 and the 8 pairs
of a block summed in int16 at most 30480 < 32767; a Q8_0 pair uses ``|q|`` (<= 128) times
``sign(q) * xq`` (<= 127), at most 32512, and goes to int32 at once; a Q6_K pair is at most
2 * 63 * 127 = 16002, so two pairs (32004) are added in int16 before int32, and a block's
scaled int32 sum is at most 16 * 128 * 16 * 32 * 127 < 2**31. Q6_K's decode intrinsic
prefetches the next block's cache lines spread over its work (with the integer scales: Q6_K
[4096, 14336], 2 threads, 4.4-4.8 ms -> 2.6-2.8 ms, alternated in one process).

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

_T = gguf.GGMLQuantizationType

TR = tiles.TR
QK = 32
QK_K = 256

TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q8_0, _T.Q4_K, _T.Q6_K})
"""Weight types with an 8-bit-activation kernel; other types keep float32 activations."""

MODES = ("f32", "q8")
"""Values of ``activations``: float32 (the default, the reference) or 8-bit."""

_Q4K_HEAD = 16       # Q4_K: scale bytes sc[8] mn[8] per row before the 128 quant bytes
_Q6K_SCALES = 192    # Q6_K: ql[128] qh[64], then int8 scales[16]
_QK_K_BYTES = QK_K * TR  # a Q6_K block unpacked to one byte per weight, before its scales

_FASTMATH = {"contract", "arcp", "afn", "nsz"}
_JIT = dict(cache=True, fastmath=_FASTMATH)
_JIT_PARALLEL = dict(parallel=True, **_JIT)
_JIT_INLINE = dict(inline="always", **_JIT)


def available() -> bool:
    """True when this CPU has AVX2, which the 8-bit kernels' instructions need."""
    return bool(llvm_binding.get_host_cpu_features().get("avx2", False))


# --------------------------------------------------------------------------------------------
# layout


_GROUPED = {_T.Q4_0: (0, 16), _T.Q4_1: (0, 16), _T.Q8_0: (0, 32), _T.Q4_K: (_Q4K_HEAD, 144),
            _T.Q6_K: (0, _Q6K_SCALES)}


def grouped_bytes(ggml_type) -> tuple[int, int]:
    """The packed bytes ``[head, end)`` of a block row held in groups of four (the scales
    around them stay in the float32 path's order). :mod:`llamatrace.kernels.quant` writes them so at
    load (:func:`llamatrace.kernels.tiles.byte_offset`); a separate pass over the packed bytes cost 2 s
    of an 8B Q4_K_M load."""
    return _GROUPED[_T(ggml_type)]


def _regroup(qs: np.ndarray, ggml_type, to_groups: bool, tiles_per_step: int = 64) -> np.ndarray:
    """Reorder every block's quant bytes of ``qs [T, B, P, TR]`` in place, ``tiles_per_step`` tiles
    at a time (the only temporary): ``[P, TR]`` -> ``[P/4, TR, 4]`` or back (``to_groups``
    True: what :mod:`llamatrace.kernels.quant` writes at load in this mode)."""
    n_tiles, n_blocks, n_bytes, tr = qs.shape
    head, end = grouped_bytes(ggml_type)
    groups = (end - head) // 4
    src = (groups, 4, tr) if to_groups else (groups, tr, 4)
    for t0 in range(0, n_tiles, tiles_per_step):
        part = qs[t0:t0 + tiles_per_step, :, head:end]
        part[...] = part.reshape(part.shape[:2] + src).transpose(0, 1, 2, 4, 3).reshape(part.shape)
    return qs


def file_order(qs: np.ndarray, ggml_type) -> np.ndarray:
    """A copy of ``qs`` (this module's layout) in the float32 path's layout."""
    return _regroup(qs.copy(), ggml_type, False)


def file_order_rows(ggml_type, qs: np.ndarray, t: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The bytes of rows ``r`` of tiles ``t`` (int [n] each) in the float32 path's layout:
    ``[n, B, P]``, what ``qs[t, :, :, r]`` gives there. Gathers only those rows (an embedding
    lookup per decode step: 112 -> 22 us for SmolLM2's token_embd, regrouping whole tiles)."""
    n_tiles, n_blocks, n_bytes, tr = qs.shape
    head, end = grouped_bytes(ggml_type)
    rows = qs[t, :, :, r]                                     # right outside [head, end)
    grouped = qs.reshape(n_tiles, n_blocks, n_bytes * tr)[:, :, head * tr:end * tr]
    grouped = grouped.reshape(n_tiles, n_blocks, (end - head) // 4, tr, 4)   # [j // 4, r, j % 4]
    rows[:, :, head:end] = grouped[t, :, :, r].reshape(len(t), n_blocks, end - head)
    return rows


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


@njit(cache=True)
def _quantize(x, xq, xd, xs):
    n_seq, n_blocks = xd.shape
    for s in range(n_seq):
        for b in range(n_blocks):
            amax = np.float32(0.0)
            for j in range(QK):
                a = abs(x[s, b * QK + j])
                if a > amax or a != a:            # a NaN stays: the block's scale is NaN
                    amax = a
            # gguf's float32 amax / 127, correctly rounded even if a caller's 'arcp' flag reaches
            # this code: in float64 a reciprocal's error (2**-53) is far below the distance of
            # any float32 quotient by 127 from a float32 rounding boundary (~2**-32)
            d = np.float32(np.float64(amax) / 127.0)
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


@njit(cache=True)
def _quantized(x):
    n_seq, n = x.shape
    xq = np.empty((n_seq, n), np.int8)
    xd = np.empty((n_seq, n // QK), np.float32)
    xs = np.empty((n_seq, n // QK), np.float32)
    _quantize(x, xq, xd, xs)
    return xq, xd, xs


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize activation rows to 8 bits per block of 32 (gguf-py's / ggml's Q8_0 rounding).

    x: float32 ``[n_seq, n]``, ``n`` a multiple of 32. Returns ``xq`` int8 ``[n_seq, n]``,
    ``xd`` float32 ``[n_seq, n/32]`` (block scales; ``x ~ xd * xq``) and ``xs`` float32
    ``[n_seq, n/32]`` (``xd * sum(xq)`` per block, for the weights' offsets). A block holding
    NaN gets a NaN scale, so NaN reaches the output as in the float32 path.
    """
    return _quantized(x)


def quantize_k_np(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of :func:`quantize_k`: ggml's ``quantize_row_q8_K_ref``, written out."""
    n_seq, n = x.shape
    xb = x.reshape(n_seq, n // QK_K, QK_K).astype(np.float32)
    first = np.abs(xb).argmax(axis=2)[..., None]                         # the first largest |x|
    mx = np.take_along_axis(xb, first, axis=2).astype(np.float64)
    bad = ~np.isfinite(xb).all(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx == 0, 0, -127.0 / mx).astype(np.float32)
        v = np.rint((iscale.astype(np.float64) * xb).astype(np.float32))
        v = np.where(bad | (mx == 0), 0, np.minimum(v, 127))
        xd = np.where(mx == 0, 0, 1.0 / iscale.astype(np.float64)).astype(np.float32)[..., 0]
    xd[bad[..., 0]] = np.nan
    xq = v.astype(np.int8)
    xsum = xq.reshape(n_seq, n // 16, 16).sum(axis=2, dtype=np.int32)
    return xq.reshape(n_seq, n), xd, xsum


@njit(cache=True)
def _quantize_k(x, xq, xd, xsum):
    n_seq, n_blocks = xd.shape
    for s in range(n_seq):
        for b in range(n_blocks):
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            finite = True
            for j in range(QK_K):
                v = x[s, b * QK_K + j]
                a = abs(v)
                if a > amax:
                    amax, mx = a, v
                if not np.isfinite(v):
                    finite = False
            # float32 quotients and products, correctly rounded through float64 whatever flags a
            # caller's code carries (as in _quantize); rint rounds half to even, as ggml's
            # nearest_int does
            iscale = np.float32(-127.0 / np.float64(mx)) if amax != 0 and finite else np.float32(0.0)
            for j in range(QK_K):
                q = np.rint(np.float32(np.float64(iscale) * np.float64(x[s, b * QK_K + j])))
                xq[s, b * QK_K + j] = np.int8(min(q, np.float32(127.0))) if finite else np.int8(0)
            if not finite:
                xd[s, b] = np.nan
            else:
                xd[s, b] = np.float32(1.0 / np.float64(iscale)) if amax != 0 else np.float32(0.0)
            for g in range(16):
                total = 0
                for j in range(16):
                    total += xq[s, b * QK_K + 16 * g + j]
                xsum[s, b * 16 + g] = total


@njit(cache=True)
def _quantized_k(x):
    n_seq, n = x.shape
    xq = np.empty((n_seq, n), np.int8)
    xd = np.empty((n_seq, n // QK_K), np.float32)
    xsum = np.empty((n_seq, n // 16), np.int32)
    _quantize_k(x, xq, xd, xsum)
    return xq, xd, xsum


def quantize_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize activation rows to 8 bits per block of 256, for K-quant weights: ggml's Q8_K
    (``quantize_row_q8_K_ref`` in ggml-quants.c), which llama.cpp multiplies Q2_K..Q6_K with.

    The first element of largest ``|x|`` in a block becomes -127: ``xq = rint(x * (-127 / max))``,
    ``xd = max / -127``. x: float32 ``[n_seq, n]``, ``n`` a multiple of 256. Returns ``xq`` int8
    ``[n_seq, n]``, ``xd`` float32 ``[n_seq, n/256]`` (``x ~ xd * xq``) and ``xsum`` int32
    ``[n_seq, n/16]`` (``sum(xq)`` per 16, ggml's ``bsums``). A block holding NaN or inf gets a
    NaN scale and zero quants, so NaN reaches the output.
    """
    return _quantized_k(x)


# --------------------------------------------------------------------------------------------
# block dot products in LLVM IR


_I32, _I64 = ir.IntType(32), ir.IntType(64)
_V32I8, _V16I16, _V8I32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(_I32, 8)
_V8I8 = ir.VectorType(ir.IntType(8), 8)


class _Emit:
    """What every block intrinsic's IR needs. The intrinsics take ``(a, a_offset, b, b_offset,
    isum)`` or, for Q6_K, ``(a, a_offset, b, b_offset, xsum, xsum_offset, isum, prefetch)``:
    ``p``, ``q`` and ``sums`` point at ``a``, ``b`` and ``xsum`` at their offsets, ``out`` at
    ``isum``; ``prefetch`` (nonzero: the first activation row) turns :meth:`prefetch_next` on."""

    def __init__(self, builder, args, sig, context) -> None:
        arrays = [i for i, a in enumerate(sig.args) if isinstance(a, types.Array)]
        data = [context.make_array(sig.args[i])(context, builder, args[i]).data for i in arrays]
        self.builder = builder
        self.p = builder.gep(data[0], [args[1]])
        self.q = builder.gep(data[1], [args[3]])
        self.sums = builder.gep(data[2], [args[5]]) if len(data) == 4 else None
        self.prefetch_on = args[7] if len(args) == 8 else None
        self.out = data[-1]
        module = builder.module
        self.maddubs = module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw", (),
                                                ir.FunctionType(_V16I16, [_V32I8, _V32I8]))
        self.maddwd = module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (),
                                               ir.FunctionType(_V8I32, [_V16I16, _V16I16]))
        self.sign = module.declare_intrinsic("llvm.x86.avx2.psign.b", (),
                                             ir.FunctionType(_V32I8, [_V32I8, _V32I8]))
        self.ones = ir.Constant(_V16I16, [1] * 16)
        i8p = ir.IntType(8).as_pointer()
        self.prefetch = module.declare_intrinsic("llvm.prefetch", [i8p],
                                                 ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]))

    def at(self, ptr, offset, vtype=_V32I8):
        return self.builder.bitcast(self.builder.gep(ptr, [ir.Constant(_I64, offset)]), vtype.as_pointer())

    def load(self, ptr, offset):
        """32 bytes at ``ptr + offset``."""
        return self.builder.load(self.at(ptr, offset), align=1)

    def broadcast(self, offset):
        """The 4 bytes at ``q + offset`` repeated in every 32-bit lane."""
        b = self.builder
        v = b.load(self.at(self.q, offset, _I32), align=1)
        vec = b.insert_element(ir.Constant(_V8I32, None), v, ir.Constant(_I32, 0))
        vec = b.shuffle_vector(vec, ir.Constant(_V8I32, None), ir.Constant(_V8I32, [0] * 8))
        return b.bitcast(vec, _V32I8)

    def dot(self, u8, s8):
        """int32 lanes: sums of 4 products of unsigned ``u8`` and signed ``s8`` bytes."""
        return self.builder.call(self.maddwd, [self.builder.call(self.maddubs, [u8, s8]), self.ones])

    def store(self, vec, index):
        """8 int32 lanes into ``isum[index:index + 8]``."""
        self.builder.store(vec, self.at(self.out, index, _V8I32), align=4)

    def rows8(self, offset):
        """The 8 int8 at ``p + offset`` (one per row: a scale) as int32 lanes."""
        v = self.builder.load(self.at(self.p, offset, _V8I8), align=1)
        return self.builder.sext(v, _V8I32)

    def prefetch_next(self, step, n_steps, block_bytes):
        """Prefetch part ``step`` of ``n_steps`` of the next block (``p + block_bytes``: the
        next block of the tile or the next tile's first; past the array's end a prefetch does
        nothing), spreading a block's cache lines over the work on this one."""
        b = self.builder
        lines = -(-block_bytes // 64)
        on = b.icmp_signed("!=", self.prefetch_on, ir.Constant(self.prefetch_on.type, 0))
        with b.if_then(on, likely=True):
            for line in range(step * lines // n_steps, (step + 1) * lines // n_steps):
                ptr = b.gep(self.p, [ir.Constant(_I64, block_bytes + 64 * line)])
                b.call(self.prefetch, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])

    def barrier(self):
        """An empty asm statement that clobbers memory, so LLVM moves no load across it. Between
        the 16 groups of a Q6_K block it stops the scheduler hoisting later groups' loads ahead,
        which kept more values live than AVX2's 16 registers (~400 stack spills and reloads a
        block): Q6_K [4096, 14336] decode went 2.95-3.56 -> 2.12-2.27 ms (paired, one process,
        same output bit for bit), 32 prompt rows 0-6 % faster."""
        fn = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", side_effect=True)
        self.builder.call(fn, [])

    def xsum(self, index):
        """``xsum[index]`` (int32 at ``sums``) in every lane."""
        b = self.builder
        v = b.load(b.gep(self.sums, [ir.Constant(_I64, index)]), align=4)
        vec = b.insert_element(ir.Constant(_V8I32, None), v, ir.Constant(_I32, 0))
        return b.shuffle_vector(vec, ir.Constant(_V8I32, None), ir.Constant(_V8I32, [0] * 8))

    @staticmethod
    def const(v):
        return ir.Constant(_V32I8, [v] * 32)


def _block_ir(builder, args, sig, context, kind: str) -> None:
    """Emit the block dot products of one tile block: ``isum[r]`` for its TR rows.

    kind ``q4``: Q4_0/Q4_1, 4 groups, low nibbles times x[4g..], high nibbles times x[16 + 4g..];
    ``q8``: Q8_0, 8 groups of signed bytes; ``q4k``: 8 groups of one 32-byte Q4_K chunk, high
    nibbles times x[32 + 4g..], two sums (isum[0:TR] low, [TR:2TR] high); ``q6k``: a whole Q6_K
    block against Q8_K activations, ``sum_j sc_j * (isum_j - 32 * xsum_j)`` over its 16 groups
    of 16 (``q + 32`` is unsigned, the offset comes from the activations' sums); ``unpack_q6k``
    and ``u8_16``: Q6_K's prefill, the block unpacked once into weight-order bytes, then the same
    sums per activation row."""
    e = _Emit(builder, args, sig, context)
    if kind == "q6k":
        _q6k_ir(e)
        return
    if kind == "unpack_q6k":
        _q6k_unpack_ir(e)
        return
    if kind == "u8_16":
        _u8_16_ir(e)
        return
    groups = 4 if kind == "q4" else 8
    xlo = [e.broadcast(4 * g) for g in range(groups)]
    if kind != "q8":
        xhi = [e.broadcast((16 if kind == "q4" else 32) + 4 * g) for g in range(groups)]
        mask, four = e.const(15), e.const(4)
    for rg in range(TR // 8):                 # 8 rows per 256-bit register
        acc = acc_hi = None
        for g in range(groups):
            v = e.load(e.p, g * TR * 4 + rg * 32)
            if kind == "q8":   # |q| * (sign(q) * x): unsigned times signed, to int32 at once
                acc = _add(builder, acc, e.dot(builder.call(e.sign, [v, v]), builder.call(e.sign, [xlo[g], v])))
                continue
            # int16 sums cannot overflow within a block (module docstring)
            lo = builder.call(e.maddubs, [builder.and_(v, mask), xlo[g]])
            hi = builder.call(e.maddubs, [builder.lshr(v, four), xhi[g]])
            if kind == "q4":
                acc = _add(builder, acc, builder.add(lo, hi))
            else:
                acc, acc_hi = _add(builder, acc, lo), _add(builder, acc_hi, hi)
        if kind != "q8":
            acc = builder.call(e.maddwd, [acc, e.ones])
        e.store(acc, rg * 8)
        if kind == "q4k":
            e.store(builder.call(e.maddwd, [acc_hi, e.ones]), TR + rg * 8)


def _add(b, acc, part):
    return part if acc is None else b.add(acc, part)


def _q6k_group(e: _Emit, h: int, c: int, k: int, rg: int):
    """The 6-bit quants (``q + 32``, 0..63) of weights 32c + 4k .. + 3 of half h, rows
    8rg..8rg+7: group k (4 bytes of weights l = 4k..4k+3 in each 32) of the half's ql[0:32],
    ql[32:64] and qh[0:32] is group 16h + k, 16h + 8 + k and 32 + 8h + k of the block; weight
    32c + l of the half is ql (low nibble for c < 2, high for c >= 2) | qh bits 2c, 2c+1 << 4.
    Only the two groups one ``c`` needs are loaded: assembling all four ``c`` at once keeps too
    many registers live and spills."""
    b, v = e.builder, e.const
    ql = e.load(e.p, (16 * h + 8 * (c % 2) + k) * TR * 4 + rg * 32)
    qh = e.load(e.p, (32 + 8 * h + k) * TR * 4 + rg * 32)
    low = b.and_(ql, v(15)) if c < 2 else b.lshr(ql, v(4))
    high = {0: lambda: b.shl(b.and_(qh, v(3)), v(4)), 1: lambda: b.shl(b.and_(qh, v(12)), v(2)),
            2: lambda: b.and_(qh, v(48)), 3: lambda: b.and_(b.lshr(qh, v(2)), v(48))}[c]()
    return b.or_(low, high)


def _q6k_scaled(e: _Emit, acc, j: int, rg: int, p16_pairs, scales_at: int):
    """``acc + sc_j * (isum_j - 32 * xsum_j)`` for rows 8rg..8rg+7, isum_j from two pairs of
    int16 sums (each pair at most 2 * 2 * 63 * 127 = 32004, added in int16 before int32), the
    int8 scales at ``p + scales_at`` ([16, TR])."""
    b = e.builder
    isum = None
    for p16 in p16_pairs:
        isum = _add(b, isum, b.call(e.maddwd, [b.add(*p16), e.ones]))
    centred = b.sub(isum, b.shl(e.xsum(j), ir.Constant(_V8I32, [5] * 8)))
    return _add(b, acc, b.mul(centred, e.rows8(scales_at + j * TR + rg * 8)))


def _q6k_ir(e: _Emit) -> None:
    """The ``q6k`` case of :func:`_block_ir`: ``p`` is the block, ``q`` its 256 activations."""
    b = e.builder
    for rg in range(TR // 8):
        acc = None
        for j in range(16):                   # weights 16j..: half h, c = (j % 8) // 2, k = 4 (j % 2) + ..
            h, c, k0 = j // 8, (j % 8) // 2, 4 * (j % 2)
            pairs = [[b.call(e.maddubs, [_q6k_group(e, h, c, k, rg), e.broadcast(128 * h + 32 * c + 4 * k)])
                      for k in (kk, kk + 1)] for kk in (k0, k0 + 2)]
            acc = _q6k_scaled(e, acc, j, rg, pairs, _Q6K_SCALES * TR)
            e.prefetch_next(16 * rg + j, 16 * (TR // 8), (_Q6K_SCALES + 16) * TR)
            e.barrier()
        e.store(acc, rg * 8)


def _q6k_unpack_ir(e: _Emit) -> None:
    """``unpack_q6k``: the block at ``p`` as unsigned ``q + 32`` bytes in weight order, groups of
    four per row, written at ``q``: [(G*TR + r)*4 + i] = weight 4G + i of row r; then its 16
    scales per row ([16, TR] int8) at ``q + 256*TR``."""
    for h in range(2):
        for k in range(8):
            for rg in range(TR // 8):
                for c in range(4):      # weights 128h + 32c + 4k .. + 3: group 32h + 8c + k
                    g = 32 * h + 8 * c + k
                    e.builder.store(_q6k_group(e, h, c, k, rg), e.at(e.q, (g * TR + rg * 8) * 4), align=1)
    for i in range(0, 16 * TR, 32):
        e.builder.store(e.load(e.p, _Q6K_SCALES * TR + i), e.at(e.q, _QK_K_BYTES + i), align=1)


def _u8_16_ir(e: _Emit) -> None:
    """``u8_16``: as ``q6k`` for a block unpacked by :func:`_q6k_unpack_ir` at ``p``."""
    b = e.builder
    for rg in range(TR // 8):
        acc = None
        for j in range(16):
            pairs = [[b.call(e.maddubs, [e.load(e.p, ((4 * j + i) * TR + rg * 8) * 4), e.broadcast(4 * (4 * j + i))])
                      for i in (ii, ii + 1)] for ii in (0, 2)]
            acc = _q6k_scaled(e, acc, j, rg, pairs, _QK_K_BYTES)
            e.barrier()
        e.store(acc, rg * 8)


@intrinsic
def _f16(typingctx, bits):
    """float32 value of the fp16 bit pattern ``bits`` (uint16): LLVM's ``fpext half``, which is
    F16C's ``vcvtph2ps`` on AVX2 CPUs and vectorizes in the kernels' row loops."""
    if bits == types.uint16:
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(bits), codegen


def f16_np(bits: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`_f16`: float32 values of an array of fp16 bit patterns (uint16)."""
    return np.asarray(bits).view(np.float16).astype(np.float32)


def _isum_intrinsic(kind: str, doc: str, with_sums: bool = False):
    def codegen(context, builder, signature, args):
        _block_ir(builder, args, signature, context, kind)
        return context.get_dummy_value()

    if with_sums:
        def typer(typingctx, qs, qbase, xq, xbase, xsum, sbase, isum, prefetch):
            if all(isinstance(a, types.Array) for a in (qs, xq, xsum, isum)):
                return types.void(qs, qbase, xq, xbase, xsum, sbase, isum, prefetch), codegen
    else:
        def typer(typingctx, qs, qbase, xq, xbase, isum):
            if all(isinstance(a, types.Array) for a in (qs, xq, isum)):
                return types.void(qs, qbase, xq, xbase, isum), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


_isum_q4 = _isum_intrinsic("q4", """isum int32[TR] = block dot products of a Q4 tile block at
flat byte ``qbase`` of ``qs`` with the 32 int8 activations at ``xbase`` of ``xq`` (C-contiguous).""")
_isum_q8 = _isum_intrinsic("q8", """As :func:`_isum_q4` for a Q8_0 tile block.""")
_isum_q4k = _isum_intrinsic("q4k", """isum int32[2*TR]: one 32-byte chunk of Q4_K quants at ``qbase``
(two sub-blocks) with the 64 activations at ``xbase``: low-nibble sums, then high-nibble sums.""")
_isum_q6k = _isum_intrinsic("q6k", """isum int32[TR]: the Q6_K tile block at ``qbase`` with the 256
Q8_K activations at ``xbase`` and their 16 sums at ``sbase`` of ``xsum``, scaled (:func:`_q6k_ir`).""",
                            with_sums=True)
_unpack_q6k = _isum_intrinsic("unpack_q6k", """Writes the Q6_K tile block at ``qbase`` as unsigned bytes
in weight order, then its scales, into the third argument, uint8 [(256 + 16) * TR] (the fourth and
fifth are unused).""")
_isum_u8_16 = _isum_intrinsic("u8_16", """As :func:`_isum_q6k` for a block unpacked by
:func:`_unpack_q6k`.""", with_sums=True)


# --------------------------------------------------------------------------------------------
# matmul kernels


@njit(**_JIT_PARALLEL)
def _matmul_q4(x, qs, d, m, m_scale, signed, out):
    """out[s] = x[s] @ W.T for Q4_0 / Q4_1 / Q8_0 (weight d*q + m_scale*m), x quantized first
    (:func:`quantize`, in the same call: no second dispatch per matmul). x float32 [S, B*32];
    qs [T, B, P, TR] in this module's layout: uint8 nibbles (P = 16), or int8 (P = 32) when
    ``signed`` (Q8_0, with m_scale 0); d, m fp16 bits uint16 [T, B, TR]; out float32 [S, n_out].

    One parallel region over tiles; each block is loaded once and used by every row of x
    while it is in L1 (so prefill and decode share the kernel)."""
    xq, xd, xs = _quantized(x)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    for t in prange(n_tiles):
        isum = np.empty(TR, np.int32)
        acc = np.zeros((n_seq, TR), np.float32)
        for b in range(n_blocks):
            db = d[t, b]
            mb = m[t, b]
            for s in range(n_seq):
                if s == 0:
                    tiles.prefetch_next_block(qs, t, b)
                if signed:
                    _isum_q8(qs, (t * n_blocks + b) * block, xq, (s * n_blocks + b) * QK, isum)
                else:
                    _isum_q4(qs, (t * n_blocks + b) * block, xq, (s * n_blocks + b) * QK, isum)
                dx = xd[s, b]
                ms = m_scale * xs[s, b]
                a = acc[s]
                for r in range(TR):
                    a[r] += (_f16(db[r]) * dx) * np.float32(isum[r]) + _f16(mb[r]) * ms
        tiles.store_rows(acc, out, t)


@njit(**_JIT_PARALLEL)
def _matmul_q4k(x, qs, d, m, out):
    """As :func:`_matmul_q4` for Q4_K: qs uint8 [T, B, 144, TR] (this module's layout), d and
    m (dmin) fp16 bits uint16 [T, B, TR]."""
    xq, xd, xs = _quantized(x)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    for t in prange(n_tiles):
        isum = np.empty(2 * TR, np.int32)
        acc = np.zeros((n_seq, TR), np.float32)
        for b in range(n_blocks):
            db = d[t, b]
            mb = m[t, b]
            sc = qs[t, b]
            base = (t * n_blocks + b) * block + _Q4K_HEAD * TR
            for s in range(n_seq):
                a = acc[s]
                for c in range(4):           # 64 weights: sub-blocks 2c (low nibbles), 2c + 1
                    if s == 0:
                        tiles.prefetch_next_block(qs, t, b, c, 4)
                    j = 2 * c
                    _isum_q4k(qs, base + c * 32 * TR, xq, s * n_blocks * 256 + b * 256 + 64 * c, isum)
                    k = b * 8 + j
                    dx0, dx1 = xd[s, k], xd[s, k + 1]
                    xs0, xs1 = xs[s, k], xs[s, k + 1]
                    for r in range(TR):
                        a[r] += _f16(db[r]) * (np.float32(sc[j, r]) * dx0 * np.float32(isum[r])
                                               + np.float32(sc[j + 1, r]) * dx1 * np.float32(isum[TR + r])) \
                            - _f16(mb[r]) * (np.float32(sc[8 + j, r]) * xs0 + np.float32(sc[9 + j, r]) * xs1)
        tiles.store_rows(acc, out, t)


@njit(**_JIT_PARALLEL)
def _matmul_q6k(x, qs, d, out):
    """As :func:`_matmul_q4` for Q6_K with Q8_K activations (:func:`quantize_k`): qs uint8
    [T, B, 208, TR] (this module's layout), d fp16 bits uint16 [T, B, TR]. The 16 scales of a block are
    applied in integers; with several rows of x each block is unpacked once and reused."""
    xq, xd, xsum = _quantized_k(x)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    block = qs.shape[2] * TR
    for t in prange(n_tiles):
        isum = np.empty(TR, np.int32)
        unpacked = np.empty(_QK_K_BYTES + 16 * TR if n_seq > 1 else 0, np.uint8)   # prefill only
        acc = np.zeros((n_seq, TR), np.float32)
        for b in range(n_blocks):
            db = d[t, b]
            base = (t * n_blocks + b) * block
            if n_seq > 1:
                tiles.prefetch_next_block(qs, t, b)
                _unpack_q6k(qs, base, unpacked, 0, isum)
            for s in range(n_seq):
                if n_seq > 1:
                    _isum_u8_16(unpacked, 0, xq, (s * n_blocks + b) * QK_K, xsum, (s * n_blocks + b) * 16, isum, False)
                else:
                    _isum_q6k(qs, base, xq, (s * n_blocks + b) * QK_K, xsum, (s * n_blocks + b) * 16, isum, True)
                dx = xd[s, b]
                a = acc[s]
                for r in range(TR):
                    a[r] += (_f16(db[r]) * dx) * np.float32(isum[r])
        tiles.store_rows(acc, out, t)


def _isums_np(xq: np.ndarray, q: np.ndarray) -> np.ndarray:
    """int64 [S, T, B, TR]: exact block dot products of xq int8 [S, B*32] with q [T, B, 32, TR]."""
    n_seq = xq.shape[0]
    n_blocks = q.shape[1]
    return np.einsum("sbj,tbjr->stbr", xq.reshape(n_seq, n_blocks, QK).astype(np.int64), q.astype(np.int64))


def matmul_q4_np(x, qs, d, m, m_scale) -> np.ndarray:
    """NumPy twin of :func:`_matmul_q4` (float64 sums). Returns float32 [S, T*TR]."""
    d, m = f16_np(d), f16_np(m)
    xq, xd, xs = quantize_np(x)
    q = file_order(qs, _T.Q4_0)
    q32 = np.concatenate([q & 0x0F, q >> 4], axis=2)                        # [T, B, 32, TR]
    isum = _isums_np(xq, q32).astype(np.float64)
    y = (d[None] * xd[:, None, :, None] * isum
         + float(m_scale) * m[None] * xs[:, None, :, None].astype(np.float64)).sum(axis=2)
    return y.reshape(xq.shape[0], -1).astype(np.float32)


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
    xq, xd, xs = quantize_np(x)
    p = file_order(qs, _T.Q4_K)                                             # [T, B, 144, TR]
    n_tiles, n_blocks = p.shape[0], p.shape[1]
    e = np.arange(256)
    q = (p[:, :, _Q4K_HEAD + 32 * (e // 64) + e % 32] >> (4 * ((e // 32) % 2))[None, None, :, None]) & 15
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
    sc = p[:, :, _Q6K_SCALES:].view(np.int8).reshape(n_tiles, n_blocks * 16, TR).astype(np.float64)
    dd = np.repeat(d, 16, axis=1)                                           # [T, B*16, TR]
    xq, xd, _ = quantize_k_np(x)                                            # Q8_K: one scale per 256
    n_seq = xq.shape[0]
    xg = xq.reshape(n_seq, n_blocks * 16, 16).astype(np.int64)
    isum = np.einsum("sgj,tgjr->stgr", xg, q.reshape(n_tiles, n_blocks * 16, 16, TR)).astype(np.float64)
    xd16 = np.repeat(xd, 16, axis=1).astype(np.float64)                     # [S, B*16]
    y = (dd * sc * xd16[:, None, :, None] * isum).sum(axis=2)
    return y.reshape(n_seq, -1).astype(np.float32)


def matmul(x: np.ndarray, ggml_type, qs, d, m, out: np.ndarray) -> None:
    """``out = x @ W.T`` with x quantized to 8 bits per block (:func:`quantize`).

    x float32 C-contiguous ``[S, n_in]``; ``qs``/``d``/``m`` a weight of type ``ggml_type`` in
    this module's layout (``ggml_type`` a ``GGMLQuantizationType`` in :data:`TYPES`); out float32
    ``[S, n_out]``. Raises ``ValueError`` for another type.
    """
    # Decode makes ~120 of these calls a token: `is` on the enum and ready-made float32
    # constants save ~1.3 us a call over `==` and np.float32(...).
    if ggml_type is _T.Q4_1:
        _matmul_q4(x, qs, d, m, _ONE, False, out)
    elif ggml_type is _T.Q4_0:
        _matmul_q4(x, qs, d, d, _MINUS_8, False, out)
    elif ggml_type is _T.Q8_0:
        _matmul_q4(x, qs, d, d, _ZERO, True, out)
    elif ggml_type is _T.Q4_K:
        _matmul_q4k(x, qs, d, m, out)
    elif ggml_type is _T.Q6_K:
        _matmul_q6k(x, qs, d, out)
    else:
        raise ValueError(f"no 8-bit-activation kernel for {ggml_type!r}")


_ONE, _ZERO, _MINUS_8 = np.float32(1.0), np.float32(0.0), np.float32(-8.0)
