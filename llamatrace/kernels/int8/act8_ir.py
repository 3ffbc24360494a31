"""The 8-bit activations' block dot products, written in LLVM IR with AVX2 intrinsics.

Numba types integer arithmetic as int64, so :mod:`llamatrace.kernels.int8.act8`'s kernels take their
block dot products from the intrinsics here (:func:`isum_q8`,
:func:`unpack_q6k`, :func:`isum_u8_16`): x86 ``pmaddubsw`` multiplies 32
unsigned bytes by 32 signed bytes and adds adjacent pairs to int16, ``pmaddwd`` adds pairs of
int16 to int32; with four bytes of a row per 32-bit lane, one register holds 8 rows and each
row's four products end up in its own lane. The byte layout they read and the overflow bounds
are in :mod:`llamatrace.kernels.int8.act8`'s docstring; the NumPy twins of the kernels that call them
are there too.

On CPUs with AVX-512 VNNI (and VL) or AVX-VNNI, ``vpdpbusd`` does what ``pmaddubsw`` +
``pmaddwd`` + ``paddd`` do, in one instruction and without the int16 step: four unsigned-by-signed
byte products added to an int32 lane. The sums are exact either way (no int16 sum here can
overflow), so both paths give the same int32 sums, bit for bit; which one a kernel uses is
decided when it is compiled (Numba's cache is per CPU). ``LLAMATRACE_VNNI=0`` turns it off (for
A/B timings, with a fresh ``NUMBA_CACHE_DIR``).

The prefill microkernels (:func:`prefill_q4`, :func:`prefill_q8`, :func:`prefill_q4k`,
:func:`prefill_q6k`) go further: a whole loop over a tile's blocks in IR, several activation rows
against one register of weight rows (16 rows in a zmm with AVX-512 VNNI, else 8 in a ymm), the
float32 sums kept in registers (phi nodes) from the first block to the last (Q4_K's and Q6_K's
blocks on zmm are inline asm: LLVM's own instruction choice and schedule took 12-27 % more
time). The Q4_0, Q4_1, Q8_0, Q4_K and Q6_K decode microkernels (:func:`decode_q4_0`, :func:`decode_q4`,
:func:`decode_q8`, :func:`decode_q4k`, :func:`decode_q6k`) are the one-row case over a whole tile in one pass, with a
prefetch.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from llamatrace.kernels import tiles
from llamatrace.kernels.tiles import prefill_lanes
from llamatrace.machine.jit import has_vnni, target_features

TR = tiles.TR
QK_K = 256
Q6K_SCALES = 192    # Q6_K: ql[128] qh[64], then int8 scales[16]
QK_K_BYTES = QK_K * TR  # a Q6_K block unpacked to one byte per weight, before its scales


_I32, _I64 = ir.IntType(32), ir.IntType(64)
_V32I8, _V16I16, _V8I32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(_I32, 8)
_V8I8 = ir.VectorType(ir.IntType(8), 8)


def _avx2_intrinsics(module):
    """``pmaddubsw``, ``pmaddwd`` and ``psignb`` on 256-bit vectors, declared in ``module``."""
    return (module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw", (), ir.FunctionType(_V16I16, [_V32I8, _V32I8])),
            module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (), ir.FunctionType(_V8I32, [_V16I16, _V16I16])),
            module.declare_intrinsic("llvm.x86.avx2.psign.b", (), ir.FunctionType(_V32I8, [_V32I8, _V32I8])))


class _Emit:
    """What every block intrinsic's IR needs. The intrinsics take ``(a, a_offset, b, b_offset,
    isum)`` or, for Q6_K's unpacked blocks, ``(a, a_offset, b, b_offset, xsum, xsum_offset, isum)``:
    ``p``, ``q`` and ``sums`` point at ``a``, ``b`` and ``xsum`` at their offsets, ``out`` at
    ``isum``."""

    def __init__(self, builder, args, sig, context) -> None:
        arrays = [i for i, a in enumerate(sig.args) if isinstance(a, types.Array)]
        data = [context.make_array(sig.args[i])(context, builder, args[i]).data for i in arrays]
        self.builder = builder
        self.p = builder.gep(data[0], [args[1]])
        self.q = builder.gep(data[1], [args[3]])
        self.sums = builder.gep(data[2], [args[5]]) if len(data) == 4 else None
        self.out = data[-1]
        module = builder.module
        self.maddubs, self.maddwd, self.sign = _avx2_intrinsics(module)
        self.ones = ir.Constant(_V16I16, [1] * 16)
        self.vnni = has_vnni()
        if self.vnni:
            self.dpbusd = module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.256", (),
                                                   ir.FunctionType(_V8I32, [_V8I32, _V8I32, _V8I32]))

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

    def dp(self, acc, u8, s8):
        """VNNI: ``acc`` (int32 lanes, ``None`` = 0) plus the sums of 4 products of unsigned ``u8``
        and signed ``s8`` bytes per lane, one ``vpdpbusd``."""
        b = self.builder
        acc = ir.Constant(_V8I32, [0] * 8) if acc is None else acc
        return b.call(self.dpbusd, [acc, b.bitcast(u8, _V8I32), b.bitcast(s8, _V8I32)])

    def store(self, vec, index):
        """8 int32 lanes into ``isum[index:index + 8]``."""
        self.builder.store(vec, self.at(self.out, index, _V8I32), align=4)

    def store_at(self, vec, offset):
        """8 int32 lanes at byte ``q + offset``."""
        self.builder.store(vec, self.at(self.q, offset, _V8I32), align=1)

    def rows8(self, offset):
        """The 8 int8 at ``p + offset`` (one per row: a scale) as int32 lanes."""
        v = self.builder.load(self.at(self.p, offset, _V8I8), align=1)
        return self.builder.sext(v, _V8I32)

    def barrier(self):
        """An empty asm statement that clobbers memory, so LLVM moves no load across it. Between
        the 16 groups of a Q6_K block it stops the scheduler hoisting later groups' loads ahead,
        which kept more values live than AVX2's 16 registers (~400 stack spills and reloads a
        block): Q6_K [4096, 14336] decode went 2.95-3.56 -> 2.12-2.27 ms (paired, one process,
        same output bit for bit), 32 prompt rows 0-6 % faster."""
        _barrier(self.builder)

    def xsum(self, index):
        """``xsum[index]`` (int32 at ``sums``) in every lane."""
        b = self.builder
        v = b.load(b.gep(self.sums, [ir.Constant(_I64, index)]), align=4)
        vec = b.insert_element(ir.Constant(_V8I32, None), v, ir.Constant(_I32, 0))
        return b.shuffle_vector(vec, ir.Constant(_V8I32, None), ir.Constant(_V8I32, [0] * 8))

    @staticmethod
    def const(v):
        return ir.Constant(_V32I8, [v] * 32)


def _barrier(builder):
    """:meth:`_Emit.barrier` for any builder."""
    builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", side_effect=True), [])


def _opaque(builder, value):
    """``value`` (an integer or an integer vector) through an empty asm statement: the same value,
    computed before this point (its arithmetic is not sunk below it), and what is addressed from
    it read after it (LLVM cannot hoist those loads above it, nor merge them with loads addressed
    from another copy). Such statements keep their order (:func:`_decode_q6k_ir`)."""
    constraint = "=v,0" if isinstance(value.type, ir.VectorType) else "=r,0"
    fn = ir.InlineAsm(ir.FunctionType(value.type, [value.type]), "", constraint, side_effect=True)
    return builder.call(fn, [value])


def _block_ir(builder, args, sig, context, kind: str) -> None:
    """Emit the block dot products of one tile block: ``isum[r]`` for its TR rows.

    kind ``q8``: Q8_0, 8 groups of signed bytes; ``unpack_q6k`` and ``u8_16``: a Q6_K block unpacked
    once into weight-order bytes, then per activation row (Q8_K) ``sum_j sc_j * (isum_j - 32 *
    xsum_j)`` over its 16 groups of 16 (``q + 32`` is unsigned, the offset comes from the
    activations' sums)."""
    e = _Emit(builder, args, sig, context)
    if kind == "unpack_q6k":
        _q6k_unpack_ir(e)
        return
    if kind == "unpack_q6k_pairs":
        _q6k_unpack_pairs_ir(e)
        return
    if kind == "u8_16":
        _u8_16_ir(e)
        return
    x = [e.broadcast(4 * g) for g in range(8)]
    for rg in range(TR // 8):                 # 8 rows per 256-bit register
        acc = None
        for g in range(8):    # |q| * (sign(q) * x): unsigned times signed, to int32 at once
            v = e.load(e.p, g * TR * 4 + rg * 32)
            u8, s8 = builder.call(e.sign, [v, v]), builder.call(e.sign, [x[g], v])
            acc = e.dp(acc, u8, s8) if e.vnni else _add(builder, acc, e.dot(u8, s8))
        e.store(acc, rg * 8)


def _add(b, acc, part):
    return part if acc is None else b.add(acc, part)


def _q6k_group(b, load, const, h: int, c: int, k: int):
    """The 6-bit quants (``q + 32``, 0..63) of weights 32c + 4k .. + 3 of half h for one register
    of rows, ``load(g)`` its bytes of group g and ``const(v)`` a byte vector: group k (4 bytes of
    weights l = 4k..4k+3 in each 32) of the half's ql[0:32], ql[32:64] and qh[0:32] is group
    16h + k, 16h + 8 + k and 32 + 8h + k of the block; weight 32c + l of the half is ql (low
    nibble for c < 2, high for c >= 2) | qh bits 2c, 2c+1 << 4. Only the two groups one ``c``
    needs are loaded: assembling all four ``c`` at once keeps too many registers live and spills."""
    v = const
    ql = load(16 * h + 8 * (c % 2) + k)
    qh = load(32 + 8 * h + k)
    low = b.and_(ql, v(15)) if c < 2 else b.lshr(ql, v(4))
    high = {0: lambda: b.shl(b.and_(qh, v(3)), v(4)), 1: lambda: b.shl(b.and_(qh, v(12)), v(2)),
            2: lambda: b.and_(qh, v(48)), 3: lambda: b.and_(b.lshr(qh, v(2)), v(48))}[c]()
    return b.or_(low, high)


def _q6k_scaled(e: _Emit, acc, j: int, rg: int, operands, scales_at: int):
    """``acc + sc_j * (isum_j - 32 * xsum_j)`` for rows 8rg..8rg+7, isum_j over two pairs of
    ``(u8, s8)`` operands (each pair's int16 sums at most 2 * 2 * 63 * 127 = 32004, added in int16
    before int32; with VNNI straight to int32), the int8 scales at ``p + scales_at`` ([16, TR])."""
    b = e.builder
    isum = None
    for pair in operands:
        if e.vnni:
            for u8, s8 in pair:
                isum = e.dp(isum, u8, s8)
        else:
            p16 = [b.call(e.maddubs, [u8, s8]) for u8, s8 in pair]
            isum = _add(b, isum, b.call(e.maddwd, [b.add(*p16), e.ones]))
    centred = b.sub(isum, b.shl(e.xsum(j), ir.Constant(_V8I32, [5] * 8)))
    return _add(b, acc, b.mul(centred, e.rows8(scales_at + j * TR + rg * 8)))


def _q6k_unpack_ir(e: _Emit) -> None:
    """``unpack_q6k``: the block at ``p`` as unsigned ``q + 32`` bytes in weight order, groups of
    four per row, written at ``q``: [(G*TR + r)*4 + i] = weight 4G + i of row r; then its 16
    scales per row ([16, TR] int8) at ``q + 256*TR``."""
    for h in range(2):
        for k in range(8):
            for rg in range(TR // 8):
                for c in range(4):      # weights 128h + 32c + 4k .. + 3: group 32h + 8c + k
                    g = 32 * h + 8 * c + k
                    quants = _q6k_group(e.builder, lambda g: e.load(e.p, g * TR * 4 + rg * 32), e.const, h, c, k)
                    e.builder.store(quants, e.at(e.q, (g * TR + rg * 8) * 4), align=1)
    for i in range(0, 16 * TR, 32):
        e.builder.store(e.load(e.p, Q6K_SCALES * TR + i), e.at(e.q, QK_K_BYTES + i), align=1)


def _q6k_unpack_pairs_ir(e: _Emit) -> None:
    """``unpack_q6k_pairs``: :func:`_q6k_unpack_ir`'s bytes and scales, then ``-32`` times the
    scales as pairs of int16 (at most 4096 in size), ``[8, TR]`` words (word ``p*TR + r``: row r's
    ``-32 sc_2p`` low, ``-32 sc_2p+1`` high), for ``vpdpwssd`` against pairs of the activations'
    sums (:func:`_prefill_q6k_ir`)."""
    _q6k_unpack_ir(e)
    b = e.builder
    sixteen, low = ir.Constant(_V8I32, [16] * 8), ir.Constant(_V8I32, [0xFFFF] * 8)
    minus32 = ir.Constant(_V8I32, [-32] * 8)
    for p in range(8):
        for rg in range(TR // 8):
            sc = [b.mul(b.sext(b.load(e.at(e.q, QK_K_BYTES + (2 * p + i) * TR + rg * 8, _V8I8), align=1), _V8I32),
                        minus32) for i in range(2)]
            e.store_at(b.or_(b.and_(sc[0], low), b.shl(sc[1], sixteen)), QK_K_BYTES + 16 * TR + (p * TR + rg * 8) * 4)


def _u8_16_ir(e: _Emit) -> None:
    """``u8_16``: the scaled sum of :func:`_block_ir` for a block unpacked by :func:`_q6k_unpack_ir`
    at ``p``, ``q`` its 256 activations."""
    for rg in range(TR // 8):
        acc = None
        for j in range(16):
            pairs = [[(e.load(e.p, ((4 * j + i) * TR + rg * 8) * 4), e.broadcast(4 * (4 * j + i)))
                      for i in (ii, ii + 1)] for ii in (0, 2)]
            acc = _q6k_scaled(e, acc, j, rg, pairs, QK_K_BYTES)
            e.barrier()
        e.store(acc, rg * 8)


def _isum_intrinsic(kind: str, doc: str, with_sums: bool = False):
    def codegen(context, builder, signature, args):
        _block_ir(builder, args, signature, context, kind)
        return context.get_dummy_value()

    if with_sums:
        def typer(typingctx, qs, qbase, xq, xbase, xsum, sbase, isum):
            if all(isinstance(a, types.Array) for a in (qs, xq, xsum, isum)):
                return types.void(qs, qbase, xq, xbase, xsum, sbase, isum), codegen
    else:
        def typer(typingctx, qs, qbase, xq, xbase, isum):
            if all(isinstance(a, types.Array) for a in (qs, xq, isum)):
                return types.void(qs, qbase, xq, xbase, isum), codegen

    typer.__doc__ = doc
    return intrinsic(typer)


isum_q8 = _isum_intrinsic("q8", """isum int32[TR] = block dot products of a Q8_0 tile block at
flat byte ``qbase`` of ``qs`` with the 32 int8 activations at ``xbase`` of ``xq`` (C-contiguous).""")
unpack_q6k = _isum_intrinsic("unpack_q6k", """Writes the Q6_K tile block at ``qbase`` as unsigned bytes
in weight order, then its scales, into the third argument, uint8 [(256 + 16) * TR] (the fourth and
fifth are unused).""")
unpack_q6k_pairs = _isum_intrinsic("unpack_q6k_pairs", """Writes the Q6_K tile block at ``qbase`` into the
third argument for :func:`prefill_q6k`, uint8 :data:`Q6K_UNPACKED` bytes: :func:`unpack_q6k`'s, then the scales
as int16 pairs (:func:`_q6k_unpack_pairs_ir`; the fourth and fifth arguments are unused).""")
isum_u8_16 = _isum_intrinsic("u8_16", """isum int32[TR]: a Q6_K tile block unpacked by :func:`unpack_q6k`
(at ``qbase``) with the 256 Q8_K activations at ``xbase`` and their 16 sums at ``sbase`` of
``xsum``, scaled (:func:`_u8_16_ir`).""", with_sums=True)


# --------------------------------------------------------------------------------------------
# prefill: register-blocked microkernels (Q4_0/Q4_1, Q8_0, Q4_K, Q6_K), after llamafile's tinyBLAS:
# a call runs a few activation rows against one register of weight rows over every block of a
# tile, the float32 sums in registers from the first block to the last (act8's _prefill drives them)


class _Tile(tiles.VectorTile):
    """:class:`~llamatrace.kernels.tiles.VectorTile` with the byte dot products of the 8-bit
    prefill microkernels (``vpdpbusd`` / ``vpdpwssd`` on VNNI, else AVX2's ``pmaddubsw`` and
    ``pmaddwd``)."""

    def __init__(self, builder, lanes: int) -> None:
        super().__init__(builder, lanes)
        module = builder.module
        self.vi8 = ir.VectorType(ir.IntType(8), 4 * lanes)
        self.vi32 = ir.VectorType(_I32, lanes)
        self.vnni = has_vnni()
        if self.vnni:
            self.dpbusd = module.declare_intrinsic(f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", (),
                                                   ir.FunctionType(self.vi32, [self.vi32] * 3))
            self.dpwssd_fn = module.declare_intrinsic(f"llvm.x86.avx512.vpdpwssd.{32 * lanes}", (),
                                                      ir.FunctionType(self.vi32, [self.vi32] * 3))
        else:
            self.maddubs, self.maddwd, self.sign = _avx2_intrinsics(module)

    def bytes4(self, xq, offset):
        """The 4 bytes at ``xq + offset`` in every 32-bit lane."""
        return self.b.bitcast(self.splat(self.load(xq, offset, _I32), self.vi32), self.vi8)

    def isum(self, pairs, wide: bool = False, init=None):
        """int32 lanes: ``init`` (int32 lanes, ``None`` = 0) plus the sum over ``pairs`` of
        (unsigned weight bytes, activation bytes) of 4-byte dot products (VNNI: a chain of
        ``vpdpbusd`` starting from ``init``, which costs nothing; AVX2: int16 sums, which cannot
        overflow within a Q4 block or a Q4_K sub-block, then to int32; ``wide``: each pair to
        int32 at once, for Q8_0's pairs of up to 2 * 128 * 127)."""
        b = self.b
        if self.vnni:
            acc = ir.Constant(self.vi32, [0] * self.lanes) if init is None else init
            for u8, s8 in pairs:
                acc = b.call(self.dpbusd, [acc, b.bitcast(u8, self.vi32), b.bitcast(s8, self.vi32)])
            return acc
        ones, s16, s32 = ir.Constant(_V16I16, [1] * 16), None, None
        for u8, s8 in pairs:
            part = b.call(self.maddubs, [u8, s8])
            if wide:
                part = b.call(self.maddwd, [part, ones])
                s32 = part if s32 is None else b.add(s32, part)
            else:
                s16 = part if s16 is None else b.add(s16, part)
        total = s32 if wide else b.call(self.maddwd, [s16, ones])
        return total if init is None else b.add(init, total)

    def offset(self, xs, at):
        """``xs[at]`` (int32: a block's integer offset, written by :func:`llamatrace.kernels.int8.act8._quantized`)
        in every lane: the start of its ``vpdpbusd`` chain (a broadcast from memory)."""
        return self.splat(self.b.load(self.b.gep(self.b.bitcast(xs, _I32.as_pointer()), [at]), align=4), self.vi32)

    def dpwssd(self, acc, u, v):
        """``acc`` (int32 lanes, ``None`` = 0) plus, per lane, the sum of the products of the two
        int16 halves of ``u`` and ``v`` (VNNI ``vpdpwssd``; else ``pmaddwd`` and an add)."""
        b = self.b
        acc = ir.Constant(self.vi32, [0] * self.lanes) if acc is None else acc
        if self.vnni:
            return b.call(self.dpwssd_fn, [acc, u, v])
        return b.add(acc, b.call(self.maddwd, [b.bitcast(u, _V16I16), b.bitcast(v, _V16I16)]))


class _Asm:
    """One inline asm statement built a line at a time, its operands named where they are made:
    :meth:`output` (a result, tied to an input value or written before the inputs are read),
    :meth:`scratch` (a register the text may overwrite), :meth:`input` (a register or general
    register holding a value). The statement declares no memory access: it reads memory LLVM
    never sees written while the kernel runs, and LLVM treats the call as one that may."""

    def __init__(self, builder) -> None:
        self.b, self.lines, self.outs, self.ins = builder, [], [], []

    def output(self, vtype, tied=None) -> str:
        self.outs.append(("=v" if tied is not None else "=&v", vtype))
        if tied is not None:
            self.ins.append((str(len(self.outs) - 1), tied))
        return f"\x01o{len(self.outs) - 1}\x01"

    def scratch(self, vtype) -> str:
        self.outs.append(("=&v", vtype))
        return f"\x01o{len(self.outs) - 1}\x01"

    def input(self, value, constraint: str = "v") -> str:
        self.ins.append((constraint, value))
        return f"\x01i{len(self.ins) - 1}\x01"

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def emit(self) -> list:
        """The statement's outputs, in the order they were declared."""
        text = "\n\t".join(self.lines)
        for i in range(len(self.outs)):
            text = text.replace(f"\x01o{i}\x01", f"${{{i}}}")
        for i in range(len(self.ins)):
            text = text.replace(f"\x01i{i}\x01", f"${{{len(self.outs) + i}}}")
        ret = ir.LiteralStructType([t for _, t in self.outs])
        fn = ir.InlineAsm(ir.FunctionType(ret, [v.type for _, v in self.ins]), text,
                          ",".join([c for c, _ in self.outs] + [c for c, _ in self.ins]))
        res = self.b.call(fn, [v for _, v in self.ins])
        return [self.b.extract_value(res, i) for i in range(len(self.outs))]


def _q8_weights(k: _Tile, qs, qb, rows):
    """One register of Q8_0 weight rows from byte ``rows`` of the block at ``qb`` (bytes 4g..4g+3 of
    each row, g < 8): with VNNI as ``q + 128`` (unsigned for ``vpdpbusd``; the ``128 sum(xq)`` it adds
    is the chain's start, the quantizer's offset), else as ``q``. The packed bytes hold either
    (``k.q_unsigned``: ``q + 128``, as the load packs them on a VNNI host); one ``xor`` a vector
    turns one into the other (5-7 % of a streamed Q8_0 matrix's decode, Zen 4)."""
    b, c64 = k.b, k.c64
    v = [k.load(qs, b.add(qb, b.add(rows, c64(g * TR * 4))), k.vi8) for g in range(8)]
    if k.vnni == k.q_unsigned:
        return v
    return [b.xor(u, ir.Constant(k.vi8, [0x80] * (4 * k.lanes))) for u in v]


def _q8_isum(k: _Tile, v, xg, init):
    """int32 lanes: ``init`` (the block's offset with VNNI, else ``None``) plus the dot products of
    :func:`_q8_weights`' ``v`` with the activation groups ``xg`` (:meth:`_Tile.bytes4`), in two chains
    of four (``vpdpbusd``'s latency). AVX2: ``|q| * (sign(q) x)``, as :func:`_block_ir` (``q + 128``
    would saturate ``pmaddubsw``'s int16), each pair to int32 at once."""
    b = k.b
    pairs = list(zip(v, xg))
    if not k.vnni:
        pairs = [(b.call(k.sign, [q, q]), b.call(k.sign, [x, q])) for q, x in pairs]
    return b.add(k.isum(pairs[:4], wide=True, init=init), k.isum(pairs[4:], wide=True))


def _prefill_q4_ir(k: _Tile, args, ns: int, kind: str = "q4"):
    """:func:`prefill_q4`'s body (``kind`` "q4_0": :func:`prefill_q4_0`'s, "q8": :func:`prefill_q8`'s):
    ``args`` as its signature, arrays as data pointers.

    Q4_0 and Q8_0 (VNNI) take a block's zero point in integers: ``xs`` holds each block's offset
    (``-8 sum(xq)``; Q8_0, whose VNNI products add ``128 sum(xq)`` for ``q + 128``: ``-128
    sum(xq)``), the start of the block's ``vpdpbusd`` chain, and ``acc = fma(d dx, isum, acc)``:
    per row and block 8 ``vpdpbusd`` and 4 other vector operations (an add of the two chains, a
    multiply, a conversion, an FMA), where Q4_0's float32 zero-point term (``m * (-8 xs)``, as
    Q4_1 still has its minimum) took 8 (llama.cpp's Q4_0 sums ``q - 8`` in integers too)."""
    (qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, m_scale, _, r_at) = args
    b, c64 = k.b, k.c64
    signed, offset = kind == "q8", kind == "q4_0" or (kind == "q8" and k.vnni)
    q_at, s0, dm_at, n_blocks, r_at = (k.i64(v) for v in (q_at, s0, dm_at, n_blocks, r_at))
    q_at, dm_at = b.add(q_at, b.mul(r_at, c64(4))), b.add(dm_at, r_at)     # the rows' first bytes, scales
    n_in = b.mul(n_blocks, c64(32))
    mask, four = ir.Constant(k.vi8, [15] * (4 * k.lanes)), ir.Constant(k.vi8, [4] * (4 * k.lanes))

    def body(blk, accs):
        qb = b.add(q_at, b.mul(blk, c64((32 if signed else 16) * TR)))
        if signed:
            v = _q8_weights(k, qs, qb, c64(0))
        else:           # bytes 4g..4g+3 of each row: weights 4g.. (low nibbles) and 16 + 4g.. (high)
            v = [k.load(qs, b.add(qb, c64(g * TR * 4)), k.vi8) for g in range(4)]
            halves = [[(b.and_(v[g], mask), 4 * g) for g in range(4)],
                      [(b.lshr(v[g], four), 16 + 4 * g) for g in range(4)]]
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        dvec = k.halves(d, dm)
        mvec = None if signed or offset else k.halves(m, dm)
        new = []
        for i, acc in enumerate(accs):
            row = b.add(s0, c64(i))
            xrow = b.add(b.mul(row, n_in), b.mul(blk, c64(32)))
            at = b.add(b.mul(row, n_blocks), blk)
            init = k.offset(xs, at) if offset else None
            if signed:
                isum = _q8_isum(k, v, [k.bytes4(xq, b.add(xrow, c64(4 * g))) for g in range(8)], init)
            else:       # two chains of 4, not one of 8: vpdpbusd's latency
                pairs = [[(u8, k.bytes4(xq, b.add(xrow, c64(x_at)))) for u8, x_at in h] for h in halves]
                isum = b.add(k.isum(pairs[0], init=init), k.isum(pairs[1]))
            dfx = b.fmul(dvec, k.splat(b.load(b.gep(xd, [at]), align=4), k.vf))
            if signed or offset:
                new.append(k.fma(dfx, b.sitofp(isum, k.vf), acc))
                continue
            ms = b.fmul(m_scale, b.load(b.gep(xs, [at]), align=4))
            # (d * dx) * isum + m * ms, then + acc: _matmul_q4's float32 operations, in its order
            new.append(b.fadd(acc, k.fma(dfx, b.sitofp(isum, k.vf), b.fmul(mvec, k.splat(ms, k.vf)))))
        return new

    return k.block_loop(n_blocks, ns, body)


def _prefill_q4k_ir(k: _Tile, args, ns: int):
    """:func:`prefill_q4k`'s body. A Q4_K block row: 16 scale bytes (sc[8], mn[8]; byte j of row r
    at ``j*TR + r``), then four 32-byte chunks in groups of four (low nibbles: sub-block 2c, high:
    2c + 1). ``xq``, ``xd`` and ``xs`` are laid out by ``act8._by_runs``: the ``ns`` rows from
    ``s0`` have block b side by side (256 bytes and 8 scales and sums a row).

    One sub-block at a time, its 8 weight vectors shared by the ``ns`` rows: per row 8 ``vpdpbusd``
    and ``acc += ((d sc) dx) isum - (dmin mn) xs`` (a multiply, a conversion, two FMAs), with
    ``d sc`` and ``dmin mn`` computed once for all the rows. A high nibble is taken as ``v & 0xF0``
    (16 times the quant, one operation instead of a shift and a mask) and its scale divided by 16,
    which is exact (VNNI only: ``vpmaddubsw``'s int16 pair sums would saturate; AVX2 shifts).
    Per block and 8 rows the loop has 512 ``vpdpbusd`` and 446 other vector operations (ports 0
    and 5), where the sub-block pair with both halves' 16 nibble vectors live, 12 float operations
    per pair and row and 4 rows a call had 290 for 256 (Q4_K, one thread, process CPU time, load
    average ~4: 129-139 -> 139-146 G multiply-adds/s at the three 8B shapes, 128 rows; 131-140 ->
    141-151 at 512; ``benchmarks/bench_prefill.py --cpu-time``).

    On zmm (AVX-512 VNNI) the block is inline asm, a statement per sub-block of all the rows
    (:func:`_q4k_sub_zmm`), the same float32 operations in the same order as the IR below, so
    the same bits. LLVM's loop for the IR (8 rows) had 1321 instructions a block: every one of
    the 512 ``vpdpbusd`` addressed its activation word as base + index (two micro-ops each to
    rename), 22 vector spills and 88 reloads (the weight vectors, the 0xF0 mask as a memory
    operand of 51 ``vpand``, the sign mask of ``-(dmin mn)``'s ``vorps``) and 100 reloads of
    row pointers; ``dx`` and ``xs`` were broadcast operands of the multiply and the FMA, as here.
    The asm's block: 966 instructions, no stack access, 512 ``vpdpbusd`` and 374 other vector
    operations (64 ``vpand`` / ``vpandn`` of weights from memory, 48 for ``d sc`` and ``dmin
    mn``, 4 divisions by 16, 2 for ``d`` and ``dmin``, per row and sub-block a conversion, a
    multiply and two FMAs) plus 64 zeroing idioms. One thread, process CPU time, same-run
    pairs, load 3.9-4.5, the three 8B shapes: 141-154 -> 172-179 G multiply-adds/s at 128
    rows, 150-163 -> 184-193 at 512
    (``benchmarks/bench_prefill.py --types Q4_K --all-shapes --micro-only --cpu-time``)."""
    (qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, _, _, r_at) = args
    b, c64 = k.b, k.c64
    q_at, s0, dm_at, n_blocks, r_at = (k.i64(v) for v in (q_at, s0, dm_at, n_blocks, r_at))
    dm_at = b.add(dm_at, r_at)
    run = b.mul(s0, n_blocks)                       # the rows' run: block b, row i at run + b ns + i
    masks = [ir.Constant(k.vi8, [v] * (4 * k.lanes)) for v in (0x0F, 0xF0)]
    sixteenth, four = ir.Constant(k.vf, [1.0 / 16] * k.lanes), ir.Constant(k.vi8, [4] * (4 * k.lanes))
    zmm = k.vnni and k.lanes == 16

    def body(blk, accs):
        qb = b.add(b.add(q_at, b.mul(blk, c64(144 * TR))), r_at)      # the rows' scale bytes
        qg = b.add(qb, b.mul(r_at, c64(3)))                                # their grouped bytes: + 4 r_at
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        dvec, mvec = k.halves(d, dm), k.halves(m, dm)
        at = b.add(run, b.mul(blk, c64(ns)))                              # row 0's block: ns rows on
        xrow, sub = b.mul(at, c64(QK_K)), b.mul(at, c64(8))
        if zmm:         # a pointer per two rows: displacements fit a byte (4 x 127)
            xptrs = [k.ptr(xq, b.add(xrow, c64(2 * QK_K * i)), ir.IntType(8)) for i in range((ns + 1) // 2)]
            w_at, sc_at = k.ptr(qs, qg, ir.IntType(8)), k.ptr(qs, qb, ir.IntType(8))
            dx_at, xs_at = b.gep(xd, [sub]), b.gep(xs, [sub])
            for j in range(8):
                accs = _q4k_sub_zmm(k, j, accs, dvec, mvec, masks[0], sixteenth, w_at, sc_at, xptrs, dx_at, xs_at)
            return accs
        for j in range(8):
            c, hi = j // 2, j % 2
            dsc = b.fmul(dvec, k.byte_floats(qs, b.add(qb, c64(j * TR))))
            dsc = b.fmul(dsc, sixteenth) if hi and k.vnni else dsc
            dmn = b.fmul(mvec, k.byte_floats(qs, b.add(qb, c64((8 + j) * TR))))
            chunk = b.add(qg, c64(16 * TR + c * 32 * TR))
            v = [k.load(qs, b.add(chunk, c64(g * TR * 4)), k.vi8) for g in range(8)]
            w = [b.and_(x, masks[hi]) if hi == 0 or k.vnni else b.lshr(x, four) for x in v]
            new = []
            for i, acc in enumerate(accs):
                x_at = b.add(xrow, c64(QK_K * i + 64 * c + 32 * hi))
                # two chains of 4, not one of 8: vpdpbusd's latency (one chain: 5-9 % slower)
                isum = b.add(*(k.isum([(w[g], k.bytes4(xq, b.add(x_at, c64(4 * g)))) for g in h])
                               for h in (range(4), range(4, 8))))
                at_ij = b.add(sub, c64(8 * i + j))
                dx = k.splat(b.load(b.gep(xd, [at_ij]), align=4), k.vf)
                xsv = k.splat(b.load(b.gep(xs, [at_ij]), align=4), k.vf)
                acc = k.fma(b.fmul(dsc, dx), b.sitofp(isum, k.vf), acc)
                new.append(k.fma(b.fneg(dmn), xsv, acc))
            accs = new
        return accs

    return k.block_loop(n_blocks, ns, body)


def _q4k_sub_zmm(k: _Tile, j: int, accs: list, dvec, mvec, low, sixteenth, w_at, sc_at, xptrs: list,
                 dx_at, xs_at) -> list:
    """Sub-block ``j`` of a Q4_K block for :func:`_prefill_q4k_ir` on zmm, as one asm statement:
    its 8 weight vectors (chunk ``j // 2`` from ``w_at``, each byte and ``low`` = 0x0F, or and
    not ``low`` for the high nibbles), ``d sc_j`` and ``dmin mn_j`` (``dvec``, ``mvec`` times the
    scale bytes at ``sc_at``; ``d sc_j`` times ``sixteenth`` for a high nibble), then per
    activation row i (its 256 bytes of the block at ``xptrs[i // 2] + 256 (i % 2)``, its dx and
    xs at ``dx_at``, ``xs_at`` + 8 i) a chain of 8 ``vpdpbusd`` with the activation words as
    broadcast operands (base + displacement), the rows' chains interleaved (the IR's two chains
    of 4 a row and their add, written so, ran 2-8 % slower), ``isum`` converted and ``acc =
    fma(d sc_j dx, isum, acc)``, ``acc = fma(-(dmin mn_j), xs, acc)``: the float32 operations of
    the IR path, in its order."""
    c, hi = j // 2, j % 2
    a = _Asm(k.b)
    outs = [a.output(k.vf, tied=v) for v in accs]
    w, dsc, dmn = [a.scratch(k.vi32) for _ in range(8)], a.scratch(k.vf), a.scratch(k.vf)
    ts, u = [a.scratch(k.vi32) for _ in accs], a.scratch(k.vf)
    dv, mv, lo = a.input(dvec), a.input(mvec), a.input(low)
    wq, sq, dq, sxq = a.input(w_at, "r"), a.input(sc_at, "r"), a.input(dx_at, "r"), a.input(xs_at, "r")
    xs = [a.input(p, "r") for p in xptrs]
    nib = "vpandnq" if hi else "vpandq"         # and-not 0x0F: v & 0xF0, 16 times the high nibble
    for g in range(8):
        a(f"{nib} {(16 + c * 32 + g * 4) * TR}({wq}), {lo}, {w[g]}")
    a(f"vpmovzxbd {j * TR}({sq}), {dsc}")
    a(f"vcvtdq2ps {dsc}, {dsc}")
    a(f"vmulps {dsc}, {dv}, {dsc}")
    if hi:
        a(f"vmulps {a.input(sixteenth)}, {dsc}, {dsc}")
    a(f"vpmovzxbd {(8 + j) * TR}({sq}), {dmn}")
    a(f"vcvtdq2ps {dmn}, {dmn}")
    a(f"vmulps {dmn}, {mv}, {dmn}")
    for t in ts:
        a(f"vpxord {t}, {t}, {t}")
    for g in range(8):              # the rows' chains side by side: each waits on its own
        for i, t in enumerate(ts):
            a(f"vpdpbusd {QK_K * (i % 2) + 64 * c + 32 * hi + 4 * g}({xs[i // 2]}){{1to16}}, {w[g]}, {t}")
    for i, (out, t) in enumerate(zip(outs, ts)):
        a(f"vcvtdq2ps {t}, {t}")
        a(f"vmulps {4 * (8 * i + j)}({dq}){{1to16}}, {dsc}, {u}")
        a(f"vfmadd231ps {u}, {t}, {out}")
        a(f"vfnmadd231ps {4 * (8 * i + j)}({sxq}){{1to16}}, {dmn}, {out}")
    return a.emit()[:len(accs)]


Q6K_UNPACKED = QK_K_BYTES + 16 * TR + 32 * TR
"""Bytes of one Q6_K tile block unpacked by :func:`unpack_q6k_pairs`: weights, int8 scales [16, TR],
int16 scale pairs [8, TR, 2]."""


def _prefill_q6k_ir(k: _Tile, args, ns: int):
    """:func:`prefill_q6k`'s body: ``qs`` holds the tile's blocks unpacked by
    :func:`unpack_q6k_pairs` (:data:`Q6K_UNPACKED` bytes each from ``q_at``); ``xq``, ``xd`` and
    ``xs`` (the Q8_K sums of 16 as int16; ``m`` and ``m_scale`` unused) are laid out by
    ``act8._by_runs``: the ``ns`` rows from ``s0`` have block b side by side. Per block and row
    ``acc += xd * (sum_j (d sc_j) * isum_j + d * sum_j (-32 sc_j) * xsum_j)``, the scaled sum
    of :func:`_u8_16_ir` (``sum_j sc_j * (isum_j - 32 * xsum_j)``) taken apart: ``isum_j`` over a
    group's ``(q + 32) * xq`` (4 ``vpdpbusd``, then a conversion and an FMA with ``d sc_j``, exact
    and shared by the rows), the second sum in int32 as 8 ``vpdpwssd`` of the unpacked ``-32 sc``
    pairs and the activation sums' pairs (at most 16 * 4096 * 2032 in size). Within 1e-7 of
    :func:`llamatrace.kernels.int8.act8._matmul_q6k` (its exact int32 block sum times ``d * xd``)
    relative to the largest output, not its bits.

    On zmm (AVX-512 VNNI) the block is inline asm, a statement per group of all the rows
    (:func:`_q6k_group_zmm`) and one per row's block end (:func:`_q6k_corr_zmm`), the same float32
    operations in the same order as the IR below, so the same bits. The IR alone gave LLVM the
    choice: it lowered the ``vpdpwssd`` chains to ``vpbroadcastd`` + ``vpmaddwd`` + ``vpaddd``
    (24 operations a row and block where 8 do), addressed each activation word as base + index
    (two micro-ops to rename each: 12-15 % slower, a C loop of the block measured) and, with the
    ``vpdpwssd`` fixed alone, interleaved the groups into ~300 vector spills and reloads a block.
    The asm block: 512 ``vpdpbusd`` and 392 other vector operations (ports 0 and 5) per block
    and 8 rows, 90-96 % of their port bound (two a cycle, ~3.05 GHz by a C loop): the microkernel
    alone over one L1/L2-resident tile 150-160 -> 198-213 G multiply-adds/s (one thread, process
    CPU time, load 2-6).
    History (the three 8B shapes, 128 rows, same-run pairs): the per-group form, a broadcast, a
    shift, a subtraction, a ``vpmulld`` and an add per group and row, 89-106 G/s, 4 rows a call;
    the int16 pairs with a ``vpmulld`` per group, 8 rows, 127-132 (the same bits); groups scaled
    in float32, 143-148 (load ~4.5). Activations as the unsigned side instead (``xq + 128``, the
    ``-32 sc xsum`` term then one constant per weight row and block) need a ``vpbroadcastd`` per
    ``vpdpbusd`` (only the signed operand can be a broadcast from memory): 5 % slower in the C
    loop despite 80 fewer operations a block."""
    (qs, q_at, xq, xd, xs16, s0, d, _, dm_at, n_blocks, _, _, r_at) = args
    b, c64, lanes = k.b, k.c64, k.lanes
    q_at, s0, dm_at, n_blocks, r_at = (k.i64(v) for v in (q_at, s0, dm_at, n_blocks, r_at))
    dm_at = b.add(dm_at, r_at)
    run = b.mul(s0, n_blocks)                       # the rows' run: block b, row i at run + b ns + i

    def body(blk, accs):
        ub = b.add(q_at, b.mul(blk, c64(Q6K_UNPACKED)))
        qg = b.add(ub, b.mul(r_at, c64(4)))                         # the rows' weight groups
        scales = b.add(b.add(ub, c64(QK_K_BYTES)), r_at)            # their int8 scales
        pairs_at = b.add(b.add(ub, c64(QK_K_BYTES + 16 * TR)), b.mul(r_at, c64(4)))
        dvec = k.halves(d, b.add(dm_at, b.mul(blk, c64(TR))))
        sums = [None] * ns
        at = b.add(run, b.mul(blk, c64(ns)))                        # row 0's block: ns rows on
        xrow = b.mul(at, c64(QK_K))
        if k.vnni and lanes == 16:      # a pointer per two rows: displacements fit a byte (4 x 127)
            xptrs = [k.ptr(xq, b.add(xrow, c64(2 * QK_K * i)), ir.IntType(8)) for i in range((ns + 1) // 2)]
            w_at, sc_at = k.ptr(qs, qg, ir.IntType(8)), k.ptr(qs, scales, ir.IntType(8))
            for j in range(16):
                sums = _q6k_group_zmm(k, j, sums, dvec, w_at, sc_at, xptrs)
        else:
            for j in range(16):             # weights 16j..16j+15: groups 4j..4j+3
                w = [k.load(qs, b.add(qg, c64((4 * j + i) * TR * 4)), k.vi8) for i in range(4)]
                sc = b.sext(k.load(qs, b.add(scales, c64(j * TR)), ir.VectorType(ir.IntType(8), lanes)), k.vi32)
                dsc = b.fmul(dvec, b.sitofp(sc, k.vf))                 # d * sc_j, exact
                for i in range(ns):
                    # AVX2: each pair to int32 at once (four of up to 2 * 63 * 127 would overflow int16)
                    x_at = b.add(xrow, c64(QK_K * i + 16 * j))
                    part = b.sitofp(k.isum([(w[g], k.bytes4(xq, b.add(x_at, c64(4 * g)))) for g in range(4)],
                                           wide=True), k.vf)
                    sums[i] = b.fmul(dsc, part) if sums[i] is None else k.fma(dsc, part, sums[i])
        sc_pairs = [k.load(qs, b.add(pairs_at, c64(p * TR * 4)), k.vi32) for p in range(8)]
        sums_at, dx_at = b.gep(xs16, [b.mul(at, c64(16))]), b.gep(xd, [at])     # int16: 16 a block and row
        new = []
        for i, acc in enumerate(accs):
            if k.vnni and lanes == 16:
                new.append(_q6k_corr_zmm(k, acc, sums[i], dvec, sc_pairs, sums_at, dx_at, i))
                continue
            corr = None                                 # sum_j (-32 sc_j) xsum_j, exact in int32
            for p in range(8):
                corr = k.dpwssd(corr, sc_pairs[p], k.splat(k.load(sums_at, c64(16 * i + 2 * p), _I32), k.vi32))
            dx = k.splat(k.load(dx_at, c64(i), k.f32, align=4), k.vf)
            new.append(k.fma(dx, k.fma(dvec, b.sitofp(corr, k.vf), sums[i]), acc))
        return new

    return k.block_loop(n_blocks, ns, body)


def _q6k_group_zmm(k: _Tile, j: int, sums: list, dvec, w_at, sc_at, xptrs: list) -> list:
    """Group ``j`` of a Q6_K block for :func:`_prefill_q6k_ir` on zmm, as one asm statement: its 4
    weight vectors (from ``w_at``) and ``d sc_j`` (``dvec`` times the int8 scales at ``sc_at``),
    then per activation row i (its 256 bytes of this block at ``xptrs[i // 2] + 256 (i % 2)``,
    a pointer per two rows so that every displacement fits a byte) 4 ``vpdpbusd`` with the
    activation words as broadcast operands (base + displacement: with an index register, each is
    two micro-ops to rename, 12-15 % slower), a conversion and ``sums[i] += d sc_j * isum``
    (``sums`` ``None``: a product). The float32 operations of the IR path, in its order."""
    a = _Asm(k.b)
    outs = [a.output(k.vf, tied=v) for v in sums] if sums[0] is not None else [a.output(k.vf) for _ in sums]
    w, dsc, t = [a.scratch(k.vi32) for _ in range(4)], a.scratch(k.vf), a.scratch(k.vi32)
    dv, wq, sq = a.input(dvec), a.input(w_at, "r"), a.input(sc_at, "r")
    xs = [a.input(p, "r") for p in xptrs]
    for g in range(4):
        a(f"vmovdqu64 {(4 * j + g) * TR * 4}({wq}), {w[g]}")
    a(f"vpmovsxbd {j * TR}({sq}), {dsc}")
    a(f"vcvtdq2ps {dsc}, {dsc}")
    a(f"vmulps {dv}, {dsc}, {dsc}")
    for i, out in enumerate(outs):
        a(f"vpxord {t}, {t}, {t}")
        for g in range(4):
            a(f"vpdpbusd {QK_K * (i % 2) + 16 * j + 4 * g}({xs[i // 2]}){{1to16}}, {w[g]}, {t}")
        a(f"vcvtdq2ps {t}, {t}")
        a(f"vmulps {t}, {dsc}, {out}" if sums[0] is None else f"vfmadd231ps {t}, {dsc}, {out}")
    return a.emit()[:len(sums)]


def _q6k_corr_zmm(k: _Tile, acc, total, dvec, pairs: list, sums_at, dx_at, i: int):
    """One row's end of a Q6_K block for :func:`_prefill_q6k_ir` on zmm, as one asm statement:
    ``acc + dx * (d * corr + total)``, ``corr`` = 8 ``vpdpwssd`` of the ``-32 sc`` ``pairs`` and
    the row's int16 sums at ``sums_at`` (broadcast operands; LLVM lowers the intrinsic's chain to
    ``vpbroadcastd`` + ``vpmaddwd`` + ``vpaddd``), ``dx`` the float32 at ``dx_at``."""
    a = _Asm(k.b)
    out, t = a.output(k.vf, tied=acc), a.scratch(k.vi32)
    ps = [a.input(p) for p in pairs]
    tot, dv, xs, xd = a.input(total), a.input(dvec), a.input(sums_at, "r"), a.input(dx_at, "r")
    a(f"vpxord {t}, {t}, {t}")
    for p, reg in enumerate(ps):
        a(f"vpdpwssd {32 * i + 4 * p}({xs}){{1to16}}, {reg}, {t}")
    a(f"vcvtdq2ps {t}, {t}")
    a(f"vfmadd213ps {tot}, {dv}, {t}")
    a(f"vfmadd231ps {4 * i}({xd}){{1to16}}, {t}, {out}")
    return a.emit()[0]


def _decode_q4_ir(k: _Tile, args, kind: str = "q4"):
    """:func:`decode_q4`'s body (``kind`` "q4_0": :func:`decode_q4_0`'s, ``xs`` the blocks' int32
    offsets; "q8": :func:`decode_q8`'s, with VNNI the same offsets): one activation row against every
    row of a tile, the ``TR / lanes`` float32 sums in registers over every block, per block and
    register of rows the float32 operations of :func:`_prefill_q4_ir` in its order, so a prefill
    row's bits. Each block asks for the cache lines of the block ``ahead`` bytes on into L2 (0: no
    prefetch)."""
    (qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, m_scale, _, ahead) = args
    b, c64 = k.b, k.c64
    signed = kind == "q8"
    offset = kind == "q4_0" or (signed and k.vnni)
    q_at, s0, dm_at, n_blocks, ahead = (k.i64(v) for v in (q_at, s0, dm_at, n_blocks, ahead))
    n_in = b.mul(n_blocks, c64(32))
    block = (32 if signed else 16) * TR
    mask, four = ir.Constant(k.vi8, [15] * (4 * k.lanes)), ir.Constant(k.vi8, [4] * (4 * k.lanes))
    on = b.icmp_signed("!=", ahead, c64(0))

    def body(blk, accs):
        qb = b.add(q_at, b.mul(blk, c64(block)))
        k.prefetch(on, qs, b.add(qb, ahead), range(block // 64))
        xrow = b.add(b.mul(s0, n_in), b.mul(blk, c64(32)))
        xg = [k.bytes4(xq, b.add(xrow, c64(4 * g))) for g in range(8)]       # Q4: low nibbles' x, then high
        at = b.add(b.mul(s0, n_blocks), blk)
        dx = k.splat(b.load(b.gep(xd, [at]), align=4), k.vf)
        init = k.offset(xs, at) if offset else None
        ms = None if offset or signed else k.splat(b.fmul(m_scale, b.load(b.gep(xs, [at]), align=4)), k.vf)
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        new = []
        for h, acc in enumerate(accs):            # rows h*lanes ..: bytes 4g.. of each row
            if signed:
                isum = _q8_isum(k, _q8_weights(k, qs, qb, c64(h * k.lanes * 4)), xg, init)
            else:
                v = [k.load(qs, b.add(qb, c64((g * TR + h * k.lanes) * 4)), k.vi8) for g in range(4)]
                isum = b.add(k.isum([(b.and_(v[g], mask), xg[g]) for g in range(4)], init=init),
                             k.isum([(b.lshr(v[g], four), xg[4 + g]) for g in range(4)]))
            dvec = k.halves(d, b.add(dm, c64(h * k.lanes)))
            if offset or signed:
                new.append(k.fma(b.fmul(dvec, dx), b.sitofp(isum, k.vf), acc))
                continue
            mvec = k.halves(m, b.add(dm, c64(h * k.lanes)))
            new.append(b.fadd(acc, k.fma(b.fmul(dvec, dx), b.sitofp(isum, k.vf), b.fmul(mvec, ms))))
        return new

    return k.block_loop(n_blocks, TR // k.lanes, body)


def _decode_q4k_ir(k: _Tile, args):
    """:func:`decode_q4k`'s body: as :func:`_decode_q4_ir` for a Q4_K tile (the layout of
    :func:`_prefill_q4k_ir`), per sub-block pair ``j = 2c, 2c + 1`` the float32 operations of
    ``act8._matmul_q4k`` as LLVM contracts them there: ``acc + fma(d, P, -(dmin * N))`` with
    ``P = fma(sc_j dx_j, isum_j, (sc_j+1 dx_j+1) isum_j+1)``, ``N = fma(mn_j, xs_j, mn_j+1 xs_j+1)``,
    so the same bits."""
    (qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, _, _, ahead) = args
    b, c64 = k.b, k.c64
    q_at, s0, dm_at, n_blocks, ahead = (k.i64(v) for v in (q_at, s0, dm_at, n_blocks, ahead))
    n_in, n_sub = b.mul(n_blocks, c64(256)), b.mul(n_blocks, c64(8))
    mask, four = ir.Constant(k.vi8, [15] * (4 * k.lanes)), ir.Constant(k.vi8, [4] * (4 * k.lanes))
    on = b.icmp_signed("!=", ahead, c64(0))
    halves = range(TR // k.lanes)
    lines = 144 * TR // 64

    def body(blk, accs):
        qb = b.add(q_at, b.mul(blk, c64(144 * TR)))
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        dvec = [k.halves(d, b.add(dm, c64(h * k.lanes))) for h in halves]
        mvec = [k.halves(m, b.add(dm, c64(h * k.lanes))) for h in halves]
        for c in range(4):
            k.prefetch(on, qs, b.add(qb, ahead), range(c * lines // 4, (c + 1) * lines // 4))
            j = 2 * c
            xrow = b.add(b.mul(s0, n_in), b.add(b.mul(blk, c64(256)), c64(64 * c)))
            xlo = [k.bytes4(xq, b.add(xrow, c64(4 * g))) for g in range(8)]
            xhi = [k.bytes4(xq, b.add(xrow, c64(32 + 4 * g))) for g in range(8)]
            at = b.add(b.add(b.mul(s0, n_sub), b.mul(blk, c64(8))), c64(j))
            dx0, dx1, xs0, xs1 = (k.splat(b.load(b.gep(arr, [a]), align=4), k.vf)
                                  for arr, a in ((xd, at), (xd, b.add(at, c64(1))), (xs, at), (xs, b.add(at, c64(1)))))
            new = []
            for h, acc in zip(halves, accs):
                rows = b.add(qb, c64(h * k.lanes))
                sc0, sc1, mn0, mn1 = (k.byte_floats(qs, b.add(rows, c64(i * TR))) for i in (j, j + 1, 8 + j, 9 + j))
                chunk = b.add(qb, c64(16 * TR + c * 32 * TR + h * k.lanes * 4))
                v = [k.load(qs, b.add(chunk, c64(g * TR * 4)), k.vi8) for g in range(8)]
                isum_lo = k.isum([(b.and_(v[g], mask), xlo[g]) for g in range(8)])
                isum_hi = k.isum([(b.lshr(v[g], four), xhi[g]) for g in range(8)])
                pos = k.fma(b.fmul(sc0, dx0), b.sitofp(isum_lo, k.vf), b.fmul(b.fmul(sc1, dx1), b.sitofp(isum_hi, k.vf)))
                neg = b.fmul(mvec[h], k.fma(mn0, xs0, b.fmul(mn1, xs1)))
                new.append(b.fadd(acc, k.fma(dvec[h], pos, b.fneg(neg))))
            accs = new
        return accs

    return k.block_loop(n_blocks, len(halves), body)


def _q6k_group_gfni(k: _Tile, const):
    """:func:`_q6k_group` on zmm with GFNI: each bit move is one ``vgf2p8affineqb`` whose matrix also
    clears the other bits (LLVM's byte shifts are an affine move and a ``vpandq``), qh's bits 6, 7 a
    word shift (``vpsrlw``: another port) masked in the ``vpternlogq`` that merges the halves. The same
    bytes: 1485 instructions for :func:`decode_q6k` against 1614, 160 -> 128 affine moves a block."""
    b = k.b
    fn = b.module.declare_intrinsic("llvm.x86.vgf2p8affineqb.512", (),
                                    ir.FunctionType(k.vi8, [k.vi8, k.vi8, ir.IntType(8)]))
    words = ir.VectorType(ir.IntType(16), 2 * k.lanes)

    def move(v, bits):
        """Bit ``bits[o]`` of each byte to bit ``o``, the others 0 (matrix byte 7 - o picks output bit o)."""
        rows = [0] * 8
        for o, src in bits.items():
            rows[7 - o] |= 1 << src
        return b.call(fn, [v, ir.Constant(k.vi8, rows * (k.lanes // 2)), ir.Constant(ir.IntType(8), 0)])

    def group(load, h: int, c: int, kk: int):
        ql, qh = load(16 * h + 8 * (c % 2) + kk), load(32 + 8 * h + kk)
        low = b.and_(ql, const(15)) if c < 2 else move(ql, {0: 4, 1: 5, 2: 6, 3: 7})
        if c == 2:
            high = b.and_(qh, const(48))
        elif c == 3:
            shifted = b.lshr(b.bitcast(qh, words), ir.Constant(words, [2] * (2 * k.lanes)))
            high = b.and_(b.bitcast(shifted, k.vi8), const(48))
        else:
            high = move(qh, {4: 2 * c, 5: 2 * c + 1})
        return b.or_(low, high)

    return group


def _decode_q6k_ir(k: _Tile, args):
    """:func:`decode_q6k`'s body: as :func:`_decode_q4_ir` for a Q6_K tile (``xs`` the Q8_K sums
    of 16, int32; ``m`` and ``m_scale`` unused): per block and register of rows the exact int32
    ``sum_j sc_j * (isum_j - 32 * xsum_j)`` of :func:`_u8_16_ir`, then ``acc = fma(d * dx, isum,
    acc)``, the per-block loop's float32 step as LLVM contracts it, so the same bits.

    One group of 16 weights (``j``) at a time for every register of rows, which share its
    activation broadcasts. :func:`_barrier` does not order the groups here: LLVM merged and
    hoisted loads of later groups across it all the same (even with the arrays' pointers given to
    the asm statement), sank arithmetic below them and spilled what it kept live, as much as the
    kernel around the call made it (in ``act8._matmul_q6k``, 8 rows a ymm: 370 stores and 709
    reloads of the stack a block, 2720 instructions; 16 a zmm: 13 and 60, 1126). So each group's
    offsets pass through :func:`_opaque` (its loads can neither move above that point nor merge
    with another group's) and so do its int32 sums (their arithmetic is done before the next
    group's loads): no spill there, 2127 instructions a block with ymm, 1061 with zmm."""
    (qs, q_at, xq, xd, xs, s0, d, _, dm_at, n_blocks, _, _, ahead) = args
    b, c64, lanes = k.b, k.c64, k.lanes
    q_at, s0, dm_at, n_blocks, ahead = (k.i64(v) for v in (q_at, s0, dm_at, n_blocks, ahead))
    n_in = b.mul(n_blocks, c64(QK_K))
    on = b.icmp_signed("!=", ahead, c64(0))
    block = (Q6K_SCALES + 16) * TR
    lines = block // 64
    five, zero = ir.Constant(k.vi32, [5] * lanes), ir.Constant(k.vi32, [0] * lanes)

    def const(v):
        return ir.Constant(k.vi8, [v] * (4 * lanes))

    group = _q6k_group_gfni(k, const) if lanes == 16 and "gfni" in target_features() else (
        lambda load, half, c, kk: _q6k_group(b, load, const, half, c, kk))

    def body(blk, accs):
        at = b.add(b.mul(s0, n_blocks), blk)
        sums_at = b.mul(at, c64(16))
        dx = k.splat(b.load(b.gep(xd, [at]), align=4), k.vf)
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        isums = [None] * len(accs)
        for j in range(16):         # weights 16j..16j+15: half j // 8, c = (j % 8) // 2, groups k0..k0+3
            qb = _opaque(b, b.add(q_at, b.mul(blk, c64(block))))
            xrow = _opaque(b, b.add(b.mul(s0, n_in), b.mul(blk, c64(QK_K))))
            k.prefetch(on, qs, b.add(qb, ahead), range(j * lines // 16, (j + 1) * lines // 16))
            half, c, k0 = j // 8, (j % 8) // 2, 4 * (j % 2)
            xv = [k.bytes4(xq, b.add(xrow, c64(16 * j + 4 * i))) for i in range(4)]
            # -32 xsum_j starts each register's vpdpbusd chain: no zeroing, no subtraction after it
            xsum = b.sub(zero, b.shl(k.splat(k.load(xs, b.add(sums_at, c64(j)), _I32, 4), k.vi32), five))
            for h in range(len(accs)):
                rows = b.add(qb, c64(h * lanes * 4))
                pairs = [(group(lambda g: k.load(qs, b.add(rows, c64(g * TR * 4)), k.vi8), half, c, k0 + i), xv[i])
                         for i in range(4)]
                # AVX2: two int16 pair sums (at most 2 * 2 * 63 * 127 each) to int32, as _q6k_scaled
                part = (k.isum(pairs, init=xsum) if k.vnni
                        else b.add(k.isum(pairs[:2], init=xsum), k.isum(pairs[2:])))
                sc = b.sext(k.load(qs, b.add(qb, c64(Q6K_SCALES * TR + j * TR + h * lanes)),
                                   ir.VectorType(ir.IntType(8), lanes)), k.vi32)
                term = b.mul(part, sc)
                isums[h] = term if isums[h] is None else b.add(isums[h], term)
            isums = [_opaque(b, v) for v in isums]
        new = []
        for h, acc in enumerate(accs):
            dvec = k.halves(d, b.add(dm, c64(h * lanes)))
            new.append(k.fma(b.fmul(dvec, dx), b.sitofp(isums[h], k.vf), acc))
        return new

    return k.block_loop(n_blocks, TR // lanes, body)


def _flat_args(context, builder, signature, args) -> list:
    """The microkernels' 13 arguments as IR values: the arrays (``qs, xq, xd, xs, d, m, res``) as
    their data pointers, ``m_scale`` as float32, the integers as they are."""
    flat = list(args)
    for i in (0, 2, 3, 4, 6, 7, 11):
        flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
    if flat[10].type != ir.FloatType():
        flat[10] = builder.fptrunc(flat[10], ir.FloatType())
    return flat


def _microkernel(body, doc: str):
    """An intrinsic taking the microkernels' 13 arguments (``qs, q_at, xq, xd, xs, s0, d, m,
    dm_at, n_blocks, m_scale, res`` and ``r_at`` or ``ahead``), its IR written by ``body(k, flat)``
    (a :class:`_Tile`, :func:`_flat_args`' values), which stores into ``res``."""
    def typer(typingctx, qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, m_scale, res, last):
        if not all(isinstance(a, types.Array) for a in (qs, xq, xd, xs, d, m, res)):
            return None
        sig = types.void(qs, q_at, xq, xd, xs, s0, d, m, dm_at, n_blocks, m_scale, res, last)

        def codegen(context, builder, signature, args):
            k = _Tile(builder, prefill_lanes())
            k.q_unsigned = signature.args[0].dtype == types.uint8      # Q8_0: q + 128 (act8.Q8_0_UNSIGNED)
            body(k, _flat_args(context, builder, signature, args))
            return context.get_dummy_value()

        return sig, codegen

    typer.__doc__ = doc
    return intrinsic(typer)


def _prefill_intrinsic(kind: str, ns: int, doc: str):
    emit = {"q4": _prefill_q4_ir, "q4_0": lambda *a: _prefill_q4_ir(*a, kind="q4_0"),
            "q8": lambda *a: _prefill_q4_ir(*a, kind="q8"), "q4k": _prefill_q4k_ir, "q6k": _prefill_q6k_ir}[kind]

    def body(k, flat):
        outs = emit(k, flat, ns)
        r_at = k.i64(flat[12])
        for i, out in enumerate(outs):
            k.b.store(out, k.ptr(flat[11], k.b.add(r_at, k.c64(i * TR)), k.vf), align=4)

    return _microkernel(body, doc)


_PREFILL_DOC = """Prefill microkernel for {ns} activation row(s): ``res[i*TR + r_at + l]`` (float32) = the
sum over every block of one tile's rows ``r_at + l``, ``l < prefill_lanes()`` (the tile's block 0
at byte ``q_at`` of ``qs``, its scales at ``dm_at`` of ``d`` and ``m``) times activation rows
``s0 + i`` of ``xq``, ``xd``, ``xs``; the sums stay in registers over every block and each block's
nibbles are unpacked once for all the rows. {what}"""
PREFILL_ROWS = {"q4": 8 if prefill_lanes() == 16 else 4, "q4_0": 8 if prefill_lanes() == 16 else 4, "q8": 8 if prefill_lanes() == 16 else 4, "q4k": 8 if prefill_lanes() == 16 else 4,
                "q6k": 8 if prefill_lanes() == 16 else 4}
"""Activation rows per call of the prefill microkernels: as many as the registers hold with the
block's unpacked weights (Q4 [14336, 4096] x 128 rows, zmm: 8 rows 326-335 G multiply-adds/s
against 4 rows' 308-320). Q4_K and Q6_K keep one sub-block's or group's weights live (8 and 4
registers), so 8 rows fit there too: one thread, process CPU time, Q4_K [14336, 4096] 146-147
against 4 rows' 114-128, Q6_K [4096, 14336] 119-122 against 82-116 (a machine at load ~4.5)."""
prefill_q4 = _prefill_intrinsic("q4", PREFILL_ROWS["q4"], _PREFILL_DOC.format(
    ns=PREFILL_ROWS["q4"], what="Q4_1: ``(d * xd) * isum + m * (m_scale * xs)``."))
prefill_q4_4rows = _prefill_intrinsic("q4", 4, _PREFILL_DOC.format(ns=4, what="As :func:`prefill_q4`."))
prefill_q4_1row = _prefill_intrinsic("q4", 1, _PREFILL_DOC.format(ns=1, what="As :func:`prefill_q4`."))
prefill_q4_0 = _prefill_intrinsic("q4_0", PREFILL_ROWS["q4_0"], _PREFILL_DOC.format(
    ns=PREFILL_ROWS["q4_0"], what="Q4_0: ``fma(d * xd, isum + xs, acc)``, ``xs`` the blocks' int32 offsets "
    "``-8 sum(xq)`` (``m``, ``m_scale`` unused)."))
prefill_q4_0_4rows = _prefill_intrinsic("q4_0", 4, _PREFILL_DOC.format(ns=4, what="As :func:`prefill_q4_0`."))
prefill_q4_0_1row = _prefill_intrinsic("q4_0", 1, _PREFILL_DOC.format(ns=1, what="As :func:`prefill_q4_0`."))
prefill_q8 = _prefill_intrinsic("q8", PREFILL_ROWS["q8"], _PREFILL_DOC.format(
    ns=PREFILL_ROWS["q8"], what="Q8_0: ``fma(d * xd, isum, acc)``; with VNNI ``isum`` sums ``(q + 128) xq`` from ``xs``, "
    "the blocks' int32 offsets ``-128 sum(xq)``."))
prefill_q8_4rows = _prefill_intrinsic("q8", 4, _PREFILL_DOC.format(ns=4, what="As :func:`prefill_q8`."))
prefill_q8_1row = _prefill_intrinsic("q8", 1, _PREFILL_DOC.format(ns=1, what="As :func:`prefill_q8`."))
prefill_q4k = _prefill_intrinsic("q4k", PREFILL_ROWS["q4k"], _PREFILL_DOC.format(
    ns=PREFILL_ROWS["q4k"], what="Q4_K, per sub-block pair: ``d * (sc dx isum + ...) - dmin * (mn xs + ...)`` (``m_scale`` unused)."))
prefill_q4k_4rows = _prefill_intrinsic("q4k", 4, _PREFILL_DOC.format(ns=4, what="As :func:`prefill_q4k`."))
prefill_q4k_1row = _prefill_intrinsic("q4k", 1, _PREFILL_DOC.format(ns=1, what="As :func:`prefill_q4k`."))
prefill_q6k = _prefill_intrinsic("q6k", PREFILL_ROWS["q6k"], _PREFILL_DOC.format(
    ns=PREFILL_ROWS["q6k"], what="Q6_K on blocks unpacked by :func:`unpack_q6k_pairs`, ``xs`` the Q8_K sums of 16 "
    "as int16 (``m``, ``m_scale`` unused)."))
prefill_q6k_4rows = _prefill_intrinsic("q6k", 4, _PREFILL_DOC.format(ns=4, what="As :func:`prefill_q6k`."))
prefill_q6k_1row = _prefill_intrinsic("q6k", 1, _PREFILL_DOC.format(ns=1, what="As :func:`prefill_q6k`."))


def _decode_intrinsic(emit, doc: str):
    def body(k, flat):
        for h, out in enumerate(emit(k, flat)):
            k.b.store(out, k.ptr(flat[11], k.c64(h * k.lanes), k.vf), align=4)

    return _microkernel(body, doc)


_DECODE_DOC = """Decode microkernel: ``res[r]`` (float32 [TR]) = the sum over every block of one tile (block 0
at byte ``q_at`` of ``qs``, scales at ``dm_at`` of ``d`` and ``m``) of row ``r`` times activation
row ``s0`` of ``xq``, ``xd``, ``xs``, the tile's rows in ``TR / prefill_lanes()`` registers whose
sums stay there from the first block to the last; ``ahead``: prefetch distance in bytes (0: none).
{what}"""
decode_q4 = _decode_intrinsic(_decode_q4_ir, _DECODE_DOC.format(
    what="Q4_1: ``(d * xd) * isum + m * (m_scale * xs)`` per block."))
decode_q4_0 = _decode_intrinsic(lambda k, flat: _decode_q4_ir(k, flat, kind="q4_0"), _DECODE_DOC.format(
    what="Q4_0: ``fma(d * xd, isum + xs, acc)`` per block, ``xs`` the blocks' int32 offsets ``-8 sum(xq)``, "
    "as :func:`prefill_q4_0`."))
decode_q8 = _decode_intrinsic(lambda k, flat: _decode_q4_ir(k, flat, kind="q8"), _DECODE_DOC.format(
    what="Q8_0: ``fma(d * xd, isum, acc)`` per block, as :func:`prefill_q8` (with VNNI ``xs`` the blocks' int32 "
    "offsets ``-128 sum(xq)``; ``m``, ``m_scale`` unused)."))
decode_q4k = _decode_intrinsic(_decode_q4k_ir, _DECODE_DOC.format(
    what="Q4_K (``m`` its dmin, ``m_scale`` unused): as ``act8._matmul_q4k`` per sub-block pair."))
decode_q6k = _decode_intrinsic(_decode_q6k_ir, _DECODE_DOC.format(
    what="Q6_K (``xs`` the Q8_K sums of 16, int32; ``m``, ``m_scale`` unused): as ``act8._matmul_q6k``'s "
    "per-block loop, ``(d * xd) * isum`` per block with the exact int32 block sum."))
