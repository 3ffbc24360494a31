"""The float32 mode's decode microkernels, in LLVM IR: one activation row against a whole tile.

Each kernel runs the loop over a tile's blocks in IR (:meth:`llamatrace.kernels.tiles.VectorTile.block_loop`),
``TR / lanes`` registers of rows (8 rows a ymm, 16 a zmm with AVX-512: :func:`~llamatrace.kernels.tiles.prefill_lanes`)
whose float32 sums stay in registers from the first block to the last. The quants become float32
in registers (Q8_0's bytes widened and converted, MXFP4's codes through a ``pshufb`` table of its
kvalues, Q6_K's 6-bit fields of dwords shifted and masked: :data:`Q6K_LAYOUT`) and meet the
broadcast activations in FMA chains, several independent chains a register
of rows; each block's sums are scaled as the NumPy twins write it (Q8_0, MXFP4: ``d * (x . q)``;
Q4_K: ``(d*sc) * (x . q) - (dmin*mn) * sum(x)`` per sub-block; Q6_K: ``(d*sc) * (x . q - 32 sum(x))``
per 16 weights), and every scale times integer product is exact in float32. So the result is
float32 activations times the dequantized weights (``gguf.quants.dequantize``), summed in float32 in
another order than a plain loop: the tests hold each kernel against its twin and the reference.

On AMD's Zen cores (:data:`~llamatrace.kernels.tiles.SUBNORMAL_BIAS` 149; elsewhere the quants are
converted, x is not scaled and the scale is 1) Q4_K's and Q6_K's quants (unsigned, 0..255 in an
int32 lane) are not converted at all: their
int32 bits read as float32 are the subnormals ``q * 2**-149``, and the caller scales x by 2**K
(:func:`~llamatrace.kernels.tiles.subnormal_exp`), so each product is ``x * q * 2**(K - 149)``
exactly and each chain's sum times ``2**(149 - K)`` (read after the row's sums) is the converted
kernel's sum bit for bit, while products and sums stay normal floats (x within ~2**100 of its row's
largest, that largest below 2**81). A chain starts with an FMA into zero, not a multiply (a
``vmulps`` with a subnormal input halved the speed on Zen 3; FMAs take them at full speed). The
kernels clear DAZ while they run (:func:`~llamatrace.kernels.tiles.daz_off`): a caller's
denormals-are-zero would read every quant as zero.

Why IR: the Numba loops they replace kept their partial sums in memory arrays between passes over
the rows (and MXFP4's unpacked its codes through a scratch); on one thread they ran at 0.15-0.45 of
a plain read of their bytes, these at 0.35-0.8 (docs/performance.md, "Decode": "The float32
mode's decode kernels").
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from llamatrace.kernels import tiles
from llamatrace.kernels.tiles import VectorTile, daz_off, daz_restore, prefill_lanes, quants_as_float

TR = tiles.TR
_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)   # ggml's kvalues_mxfp4

AHEAD_Q8_0 = AHEAD_MXFP4 = 4096
AHEAD_Q4K = 2 * 144 * TR
AHEAD_Q6K = 2 * 208 * TR
"""Prefetch distances in bytes (into L2), as the ``q8`` mode's decode microkernels' (Q6_K two
blocks ahead since its dword layout: qwen3moe's output matrix 5-8 % faster than one block ahead)."""


def _block_bytes(kind: str) -> int:
    return {"q8_0": 32, "mxfp4": 16, "q4k": 144, "q6k": 208}[kind] * TR


def chain(k, acc, x, w, subnormal: bool = False):
    """``acc + x * w`` on float32 vectors (``x * w`` for ``acc`` None), emitted by ``k``: with
    ``subnormal`` (an operand may be a float32 subnormal) an FMA into zero where a chain starts (a
    ``vmulps`` with a subnormal input is slow on Zen 3, an FMA is not)."""
    if acc is None:
        return k.fma(x, w, k.splat(ir.Constant(k.f32, 0.0), k.vf)) if subnormal else k.b.fmul(x, w)
    return k.fma(x, w, acc)


def _bytes(k, qs, at, signed: bool, to_float: bool = True):
    """``lanes`` bytes at ``qs + at`` widened to int32 lanes (or converted to float32)."""
    v = k.load(qs, at, ir.VectorType(_I8, k.lanes))
    if to_float:
        return k.b.sitofp(v, k.vf) if signed else k.b.uitofp(v, k.vf)
    vi32 = ir.VectorType(_I32, k.lanes)
    return k.b.sext(v, vi32) if signed else k.b.zext(v, vi32)


def _q8_0_ir(k: VectorTile, a):
    """Q8_0: per block and register of rows two chains (even, odd j) of ``x[j] * q[j]``, then
    ``acc = fma(d, even + odd, acc)``, ``d`` widened from its fp16 bits (uint16 ``d``, F16C:
    exact) or read as float32."""
    qs, q_at, x, x_at, d, _, dm_at, n_blocks, ahead = a
    b, c64, lanes = k.b, k.c64, k.lanes
    on = b.icmp_signed("!=", ahead, c64(0))
    block = _block_bytes("q8_0")
    scale = k.halves if isinstance(d.type.pointee, ir.IntType) else (lambda p, at: k.load(p, at, k.vf, 4))

    def body(blk, accs):
        qb = b.add(q_at, b.mul(blk, c64(block)))
        k.prefetch(on, qs, b.add(qb, ahead), range(block // 64))
        xb = b.add(x_at, b.mul(blk, c64(32)))
        parts = [[None, None] for _ in accs]
        for j in range(32):
            xj = k.splat(k.load(x, b.add(xb, c64(j)), k.f32, 4), k.vf)
            for h, p in enumerate(parts):
                p[j % 2] = chain(k, p[j % 2], xj, _bytes(k, qs, b.add(qb, c64(j * TR + h * lanes)), True))
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        return [k.fma(scale(d, b.add(dm, c64(h * lanes))), b.fadd(p[0], p[1]), acc)
                for h, (p, acc) in enumerate(zip(parts, accs))]

    return k.block_loop(n_blocks, TR // lanes, body)


def _mxfp4_ir(k: VectorTile, a):
    """MXFP4: byte j of the TR rows' codes (one 32-byte load) split in nibbles, each through a
    ``pshufb`` table to its int8 kvalue; per register of rows a chain for the low nibbles (x[j])
    and one for the high ones (x[j + 16]), then ``acc = fma(d, lo + hi, acc)``."""
    qs, q_at, x, x_at, d, _, dm_at, n_blocks, ahead = a
    b, c64, lanes = k.b, k.c64, k.lanes
    on = b.icmp_signed("!=", ahead, c64(0))
    block = _block_bytes("mxfp4")
    v32 = ir.VectorType(_I8, 32)
    pshufb = b.module.declare_intrinsic("llvm.x86.avx2.pshuf.b", (), ir.FunctionType(v32, [v32, v32]))
    table = ir.Constant(v32, [v & 0xFF for v in _KVALUES_MXFP4 * 2])
    low, four = ir.Constant(v32, [15] * 32), ir.Constant(v32, [4] * 32)
    picks = [ir.Constant(ir.VectorType(_I32, lanes), list(range(h * lanes, (h + 1) * lanes)))
             for h in range(TR // lanes)]                # each register's rows of the 32 kvalues

    def body(blk, accs):
        qb = b.add(q_at, b.mul(blk, c64(block)))
        k.prefetch(on, qs, b.add(qb, ahead), range(block // 64))
        xb = b.add(x_at, b.mul(blk, c64(32)))
        parts = [[None, None] for _ in accs]
        for j in range(16):
            codes = k.load(qs, b.add(qb, c64(j * TR)), v32)
            kv = (b.call(pshufb, [table, b.and_(codes, low)]), b.call(pshufb, [table, b.lshr(codes, four)]))
            for half in range(2):
                xj = k.splat(k.load(x, b.add(xb, c64(16 * half + j)), k.f32, 4), k.vf)
                for h, p in enumerate(parts):
                    sub = b.shuffle_vector(kv[half], ir.Constant(v32, None), picks[h])
                    p[half] = chain(k, p[half], xj, b.sitofp(sub, k.vf))
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        return [k.fma(k.load(d, b.add(dm, c64(h * lanes)), k.vf, 4), b.fadd(p[0], p[1]), acc)
                for h, (p, acc) in enumerate(zip(parts, accs))]

    return k.block_loop(n_blocks, TR // lanes, body)


def _q4k_ir(k: VectorTile, a):
    """Q4_K (``m`` its dmin, x scaled by 2**K, then its unscaled sums per sub-block of 32, then
    ``u = 2**(149 - K)``: :func:`~llamatrace.kernels.tiles.subnormal_exp`): the
    loop runs over chunks c of 32 bytes (sub-blocks 2c in the low nibbles, 2c + 1 in the high
    ones), not blocks (a whole block unrolled, ~4,600 instructions, ran at 0.85x: two chunks a
    pass ran at 0.92x, half a chunk no faster); per chunk and register of rows a chain per
    sub-block, then ``acc += (d*sc0) * lo + (d*sc1) * hi - ((dmin*mn0) * xs0 + (dmin*mn1) * xs1)``.
    The high nibbles are taken as ``byte & 0xF0`` (16 times the quant: an AND where a shift was,
    1.03x), and both nibbles are not converted: their int32 lanes are bitcast to float32, the
    subnormals ``q * 2**-149`` (``16 q * 2**-149``); the chains' sums are scaled back by ``u``
    (``u / 16``): powers of two, so the same sums bit for bit (short of products below float32's
    normal range)."""
    qs, q_at, x, x_at, d, m, dm_at, n_blocks, ahead = a
    b, c64, lanes = k.b, k.c64, k.lanes
    on = b.icmp_signed("!=", ahead, c64(0))
    block = _block_bytes("q4k")
    lines = block // 64
    vi32 = ir.VectorType(_I32, lanes)
    low, high = ir.Constant(vi32, [0x0F] * lanes), ir.Constant(vi32, [0xF0] * lanes)
    n_in = b.mul(n_blocks, c64(256))
    u = k.load(x, b.add(b.add(x_at, n_in), b.mul(n_blocks, c64(8))), k.f32, 4)
    u_lo, u_hi = k.splat(u, k.vf), k.splat(b.fmul(u, ir.Constant(k.f32, 1 / 16)), k.vf)

    def body(chunk, accs):
        blk, c = b.lshr(chunk, c64(2)), b.and_(chunk, c64(3))
        qb = b.add(q_at, b.mul(blk, c64(block)))
        k.prefetch(on, qs, b.add(b.add(qb, b.mul(c, c64(lines // 4 * 64))), ahead), range(lines // 4))
        xb = b.add(b.add(x_at, b.mul(blk, c64(256))), b.mul(c, c64(64)))
        qc = b.add(qb, b.mul(c, c64(32 * TR)))                    # byte 16 + 32c of the rows at qc + 16 TR
        sc_at = b.add(qb, b.mul(c, c64(2 * TR)))                  # sc[2c] (mn[2c] 8 TR further)
        xs_at = b.add(b.add(b.add(x_at, n_in), b.mul(blk, c64(8))), b.mul(c, c64(2)))   # the sums follow the row in x
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        parts = [[None, None] for _ in accs]
        for l in range(32):
            xl = k.splat(k.load(x, b.add(xb, c64(l)), k.f32, 4), k.vf)
            xh = k.splat(k.load(x, b.add(xb, c64(32 + l)), k.f32, 4), k.vf)
            for h, p in enumerate(parts):
                v = _bytes(k, qs, b.add(qc, c64((16 + l) * TR + h * lanes)), False, False)
                p[0] = chain(k, p[0], xl, quants_as_float(b, b.and_(v, low)), True)
                p[1] = chain(k, p[1], xh, quants_as_float(b, b.and_(v, high)), True)
        xs0, xs1 = (k.splat(k.load(x, b.add(xs_at, c64(i)), k.f32, 4), k.vf) for i in (0, 1))
        new = []
        for h, (p, acc) in enumerate(zip(parts, accs)):
            dvec = k.load(d, b.add(dm, c64(h * lanes)), k.vf, 4)
            mvec = k.load(m, b.add(dm, c64(h * lanes)), k.vf, 4)
            rows = b.add(sc_at, c64(h * lanes))
            sc0, sc1, mn0, mn1 = (_bytes(k, qs, b.add(rows, c64(i * TR)), False) for i in (0, 1, 8, 9))
            pos = k.fma(b.fmul(dvec, sc1), b.fmul(p[1], u_hi), b.fmul(b.fmul(dvec, sc0), b.fmul(p[0], u_lo)))
            neg = k.fma(b.fmul(mvec, mn1), xs1, b.fmul(b.fmul(mvec, mn0), xs0))
            new.append(b.fadd(acc, b.fsub(pos, neg)))
        return new

    return k.block_loop(b.mul(n_blocks, c64(4)), TR // lanes, body)


def q6k_quants(b, qa, qc, qh):
    """Q6_K's 6-bit quants (0..63) of the four c, on byte vectors: ``qa`` the ``ql`` bytes of c = 0
    (low nibbles) and 2 (high), ``qc`` those of c = 1 and 3, ``qh`` the bytes whose bits 2c, 2c + 1
    are c's bits 4, 5 (ggml's ``dequantize_row_q6_K``). Returns the four vectors, c in order. (The
    experts' kernels read the file's blocks with it; the dense decode kernel's packed quants are
    dwords: :func:`q6k_group_quants`.)"""
    def cst(v):
        return ir.Constant(qa.type, [v] * qa.type.count)

    return (b.or_(b.and_(qa, cst(15)), b.and_(b.shl(qh, cst(4)), cst(0x30))),
            b.or_(b.and_(qc, cst(15)), b.and_(b.shl(qh, cst(2)), cst(0x30))),
            b.or_(b.lshr(qa, cst(4)), b.and_(qh, cst(0x30))),
            b.or_(b.lshr(qc, cst(4)), b.and_(b.lshr(qh, cst(2)), cst(0x30))))


def q6k_group_quants(b, d0, d1, d2):
    """The 16 quants (0..63, int32 lanes) of a Q6_K scale group from its three dwords (int32
    vectors): the 96-bit stream ``d2:d1:d0``, quant j at bits 6j (:data:`Q6K_LAYOUT`). A quant is a
    shift and an AND of one dword (a funnel shift of two for j = 5, 10; j = 0 no shift, j = 15 no
    AND): 30 integer operations a group, no byte shuffles."""
    vt = d0.type
    fshr = b.module.declare_intrinsic(f"llvm.fshr.v{vt.count}i32", (), ir.FunctionType(vt, [vt, vt, vt]))
    dws = (d0, d1, d2)

    def cst(v):
        return ir.Constant(vt, [v] * vt.count)

    out = []
    for j in range(16):
        k, off = divmod(6 * j, 32)
        if off + 6 > 32:
            v = b.call(fshr, [dws[k + 1], dws[k], cst(off)])
        else:
            v = b.lshr(dws[k], cst(off)) if off else dws[k]
        out.append(v if off == 26 else b.and_(v, cst(0x3F)))
    return out


Q6K_LAYOUT = "dwords"
"""The ``f32`` mode's packed Q6_K quants (:func:`llamatrace.kernels.types.k_quants.q6k_to_dwords`):
per row and scale group g of 16 weights, three dwords holding the 96-bit little-endian stream of
its 16 six-bit quants (ql's 4 bits | qh's 2 bits << 4), quant j at bits 6j; dword k of group g of
row r at byte ``((3g + k) * TR + r) * 4`` of the block's first ``192 * TR`` bytes (a 64-byte load:
one dword of 16 rows); the int8 scales ``sc[g]`` of the TR rows after, at ``(192 + g) * TR``."""


def _q6k_ir(k: VectorTile, a):
    """Q6_K (x scaled by 2**K, then its unscaled sums ``xs`` per 16 weights, then ``u = 2**(149 - K)``:
    :func:`~llamatrace.kernels.tiles.subnormal_exp`; the quants in :data:`Q6K_LAYOUT`): the loop
    runs over quarters of blocks (half of the block, group of 16 l), not blocks: a whole block
    unrolled was ~38 KB of code, more than the L1 instruction cache, and ran at 0.75x. Per quarter
    the four scale groups 8 half + 2c + grp (c = 0..3) are read as dwords of ``lanes`` rows and
    their quants taken out by shifts and ANDs (:func:`q6k_group_quants`; ggml's ql / qh bytes took
    byte shifts, a stack scratch and a widening load a register: 1.3-1.4x slower on Zen 4), their
    int32 lanes bitcast to float32 (the subnormals ``q * 2**-149``, no conversion), in a chain per
    c and register of rows (two c at a time), and ``acc = fma(d*sc, u * S - 32 * xs, acc)`` per
    16 weights, c in order (``u * S`` the unscaled sum bit for bit, short of products below
    float32's normal range)."""
    qs, q_at, x, x_at, d, _, dm_at, n_blocks, ahead = a
    b, c64, lanes = k.b, k.c64, k.lanes
    on = b.icmp_signed("!=", ahead, c64(0))
    block = _block_bytes("q6k")
    lines = block // 64
    vi32 = ir.VectorType(_I32, lanes)
    n_in = b.mul(n_blocks, c64(256))
    thirty_two = k.splat(ir.Constant(k.f32, 32.0), k.vf)
    uv = k.splat(k.load(x, b.add(b.add(x_at, n_in), b.mul(n_blocks, c64(16))), k.f32, 4), k.vf)

    def body(quarter, accs):
        accs = list(accs)
        blk = b.lshr(quarter, c64(2))
        half, grp = b.and_(b.lshr(quarter, c64(1)), c64(1)), b.and_(quarter, c64(1))
        qb = b.add(q_at, b.mul(blk, c64(block)))
        k.prefetch(on, qs, b.add(b.add(q_at, b.mul(quarter, c64(block // 4))), ahead), range(lines // 4))
        xl = b.add(b.add(x_at, b.mul(blk, c64(256))), b.add(b.mul(half, c64(128)), b.mul(grp, c64(16))))
        g0 = b.add(b.mul(half, c64(8)), grp)                             # scale group of c = 0
        dw_at = b.add(qb, b.mul(g0, c64(12 * TR)))                       # its dwords (group g0 + 2c: 24c TR on)
        sc_at = b.add(qb, b.mul(b.add(c64(192), g0), c64(TR)))
        xs_at = b.add(b.add(b.add(x_at, n_in), b.mul(blk, c64(16))), g0)
        dm = b.add(dm_at, b.mul(blk, c64(TR)))
        for cs in (range(0, 2), range(2, 4)):
            quants = {}
            for c in cs:
                for h in range(len(accs)):
                    dws = (k.load(qs, b.add(dw_at, c64(((6 * c + i) * TR + h * lanes) * 4)), vi32) for i in range(3))
                    quants[h, c] = q6k_group_quants(b, *dws)
            parts = {}
            for i in range(16):
                for c in cs:
                    xc = k.splat(k.load(x, b.add(xl, c64(32 * c + i)), k.f32, 4), k.vf)
                    for h in range(len(accs)):
                        parts[h, c] = chain(k, parts.get((h, c)), xc, quants_as_float(b, quants[h, c][i]), True)
            for h in range(len(accs)):
                dvec = k.load(d, b.add(dm, c64(h * lanes)), k.vf, 4)
                for c in cs:
                    sc = _bytes(k, qs, b.add(sc_at, c64(2 * c * TR + h * lanes)), True)
                    xs = k.splat(k.load(x, b.add(xs_at, c64(2 * c)), k.f32, 4), k.vf)
                    accs[h] = k.fma(b.fmul(dvec, sc), k.fma(thirty_two, b.fneg(xs), b.fmul(parts[h, c], uv)), accs[h])
        return accs

    return k.block_loop(b.mul(n_blocks, c64(4)), TR // lanes, body)


_EMIT = {"q8_0": _q8_0_ir, "mxfp4": _mxfp4_ir, "q4k": _q4k_ir, "q6k": _q6k_ir}
_SUBNORMAL = frozenset({"q4k", "q6k"})
"""The kernels that read their quants as float32 subnormals: DAZ off while they run."""


def _decode_intrinsic(kind: str):
    emit = _EMIT[kind]

    def typer(typingctx, qs, q_at, x, x_at, d, m, dm_at, n_blocks, res, res_at, ahead):
        if not all(isinstance(a, types.Array) for a in (qs, x, d, m, res)):
            return None
        sig = types.void(qs, q_at, x, x_at, d, m, dm_at, n_blocks, res, res_at, ahead)

        def codegen(context, builder, signature, args):
            flat = list(args)
            for i in (0, 2, 4, 5, 8):
                flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
            k = VectorTile(builder, prefill_lanes())
            for i in (1, 3, 6, 7, 9, 10):
                flat[i] = k.i64(flat[i])
            saved = daz_off(builder) if kind in _SUBNORMAL else None       # None: no subnormals here
            outs = emit(k, [flat[i] for i in (0, 1, 2, 3, 4, 5, 6, 7, 10)])
            for h, out in enumerate(outs):
                builder.store(out, k.ptr(flat[8], builder.add(flat[9], k.c64(h * k.lanes)), k.vf), align=4)
            if saved is not None:
                daz_restore(builder, saved)
            return context.get_dummy_value()

        return sig, codegen

    typer.__doc__ = (f"{kind} decode microkernel: ``res[res_at + r]`` (float32, r < TR) = row r of one tile "
                     "(block 0 at byte ``q_at`` of ``qs``, float32 scales at ``dm_at`` of ``d`` and ``m``) "
                     "times the activation row at ``x_at`` of ``x`` (for the K-quants: scaled by 2**K, followed "
                     "there by its unscaled per-sub-block sums and ``2**(149 - K)``), over ``n_blocks`` blocks; "
                     "``ahead``: prefetch distance in bytes (0: none).")
    return intrinsic(typer)


decode_q8_0 = _decode_intrinsic("q8_0")
decode_mxfp4 = _decode_intrinsic("mxfp4")
decode_q4k = _decode_intrinsic("q4k")
decode_q6k = _decode_intrinsic("q6k")

