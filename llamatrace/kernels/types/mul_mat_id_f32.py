"""The ``f32`` mode's ``mul_mat_id`` kernels on the file's blocks (:mod:`llamatrace.kernels.mul_mat_id`).

The experts stay as the GGUF file stores them: row-major, each weight row ``n_in / 256`` (Q4_K,
Q6_K) or ``n_in / 32`` (MXFP4, Q8_0) blocks in a row. One call is one parallel region over work
items (group of slots, part, tile of :data:`TR` weight rows); per weight row and up to
:data:`SLOTS` slots of the group at once, an LLVM IR microkernel (:func:`_row_ir`) turns 8
weights at a time into one float32 vector in registers and multiplies it into each slot's row of
``x`` (the activations are the vector's other side, loaded as they lie: no broadcast), so each
weight is converted once for all the slots that use it. Each slot's sums stay in vectors over
the whole row and are added across lanes at its end.

The arithmetic is float32 activations times ``gguf.quants.dequantize``'s weights, with the
products grouped as the packed kernels (:mod:`llamatrace.kernels.types.f32_ir`) group them:

- Q4_K: ``(d*sc) * (x . q) - (dmin*mn) * sum(x)`` per sub-block of 32 (``d*sc`` and
  ``dmin*mn`` are exact in float32; ``sum(x)`` per 32 inputs is computed once a call);
- Q6_K: the weights themselves, ``(d*sc) * (q - 32)`` rounded as gguf-py rounds them, times x;
- MXFP4: ``d * (x . kvalue)`` per block (``d`` a power of two: ggml's ``GGML_E8M0_TO_FP32_HALF``);
- Q8_0: ``d * (x . q)`` per block.

So results differ from float64 sums over the dequantized weights by float32 rounding only;
:func:`llamatrace.kernels.mul_mat_id.mul_mat_id_ref` is the NumPy twin the tests hold them to.

Numba caches the drivers by this module's source; the IR is emitted here too, so a change to it
recompiles them.
"""

from __future__ import annotations

import gguf
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.kernels.tiles import TR, VectorTile
from llamatrace.machine.jit import JIT_INLINE, JIT_PARALLEL

_T = gguf.GGMLQuantizationType

TYPES = frozenset({_T.Q4_K, _T.Q6_K, _T.MXFP4, _T.Q8_0})
"""The weight types these kernels run."""

SLOTS = 4
"""Slots of one expert multiplied by one pass over a weight row (more are taken 4 at a time)."""

LANES = 8
"""float32 lanes of the microkernels' vectors (ymm; AVX-512 hosts run the same code)."""

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_KVALUES_MXFP4 = tuple(gguf.quants.MXFP4.kvalues)

# kind: (ggml type, weights a block, bytes a block, float32 sums of x a block appended to each row)
_KINDS = {"q4k": (_T.Q4_K, 256, 144, 8), "q6k": (_T.Q6_K, 256, 210, 0),
          "mxfp4": (_T.MXFP4, 32, 17, 0), "q8_0": (_T.Q8_0, 32, 34, 0)}
KIND = {v[0]: i for i, v in enumerate(_KINDS.values())}
"""ggml type -> the drivers' ``kind`` argument."""


# --------------------------------------------------------------------------------------------
# One block of one weight row -> groups of (float32 vector of 8 quants or weights, their first
# input in the block) with the group's scale (None: the vectors are the weights themselves).


def _vec(k: VectorTile, bytes_, lo: int, signed: bool):
    """Bytes ``lo .. lo + 8`` of the byte vector ``bytes_`` as float32 lanes."""
    part = k.b.shuffle_vector(bytes_, ir.Constant(bytes_.type, None), _const(range(lo, lo + LANES), _I32))
    return k.b.sitofp(part, k.vf) if signed else k.b.uitofp(part, k.vf)


def _half(k: VectorTile, qs, at):
    """The fp16 at byte ``at`` of ``qs`` as float32 (exact)."""
    return k.b.fpext(k.load(qs, at, ir.HalfType(), 1), k.f32)


def _const(values, ty=_I8):
    return ir.Constant(ir.VectorType(ty, len(values)), list(values))


def _pick(k: VectorTile, v, idx, ty=_I32):
    """``v``'s bytes at ``idx`` zero-extended to ``ty`` lanes."""
    b = k.b
    sub = b.shuffle_vector(v, ir.Constant(v.type, None), _const(idx, _I32))
    return b.zext(sub, ir.VectorType(ty, len(idx)))


def _q4k_block(k: VectorTile, qs, qb):
    """Q4_K (d, dmin, scales[12], qs[128]): per chunk j of 32 bytes, sub-block 2j in the low
    nibbles (inputs 64j + l) and 2j + 1 in the high ones (64j + 32 + l); the 6-bit scales and mins
    unpacked on 8 lanes as ggml's ``get_scale_min_k4``. Returns (groups, the 8 ``dmin*mn``)."""
    b, c64 = k.b, k.c64
    d, dmin = _half(k, qs, qb), _half(k, qs, b.add(qb, c64(2)))
    s = k.load(qs, b.add(qb, c64(4)), ir.VectorType(_I8, 16))       # bytes 4..19: scales, qs[0:4]
    vi = ir.VectorType(_I32, 8)
    top = _const([0, 0, 0, 0, 48, 48, 48, 48], _I32)                # scales and mins 4..7: 2 more bits

    def high(idx):
        return b.and_(b.shl(b.lshr(_pick(k, s, idx), ir.Constant(vi, [6] * 8)), ir.Constant(vi, [4] * 8)), top)

    sc = b.or_(b.and_(_pick(k, s, [0, 1, 2, 3, 8, 9, 10, 11]), _const([63] * 4 + [15] * 4, _I32)),
               high([0, 1, 2, 3, 0, 1, 2, 3]))
    mn = b.or_(b.and_(b.lshr(_pick(k, s, [4, 5, 6, 7, 8, 9, 10, 11]), _const([0] * 4 + [4] * 4, _I32)),
                      _const([63] * 4 + [15] * 4, _I32)),
               high([4, 5, 6, 7, 4, 5, 6, 7]))
    dsc = b.fmul(k.splat(d, k.vf), b.uitofp(sc, k.vf))
    dmn = b.fmul(k.splat(dmin, k.vf), b.uitofp(mn, k.vf))
    v32 = ir.VectorType(_I8, 32)
    groups = []
    for j in range(4):
        q = k.load(qs, b.add(qb, c64(16 + 32 * j)), v32)
        lo = b.and_(q, _const([15] * 32))
        hi = b.lshr(q, _const([4] * 32))
        for sub, nib in ((2 * j, lo), (2 * j + 1, hi)):
            vecs = [(_vec(k, nib, 8 * g, False), 32 * sub + 8 * g) for g in range(4)]
            groups.append((vecs, b.extract_element(dsc, ir.Constant(_I32, sub))))
    return groups, dmn


def _q6k_block(k: VectorTile, qs, qb):
    """Q6_K (ql[128], qh[64], scales int8[16], d): input 128h + 32c + l (l < 32) is
    ``(ql[64h + 32(c%2) + l] >> 4(c//2)) & 15 | ((qh[32h + l] >> 2c) & 3) << 4``, less 32, its
    weight ``(d * sc[(128h + 32c + l) // 16]) * (q - 32)`` (gguf-py's float32 roundings)."""
    b, c64 = k.b, k.c64
    d = _half(k, qs, b.add(qb, c64(208)))
    v32 = ir.VectorType(_I8, 32)

    def cst(v):
        return _const([v] * 32)

    groups = []
    for h in range(2):
        qa = k.load(qs, b.add(qb, c64(64 * h)), v32)
        qc = k.load(qs, b.add(qb, c64(64 * h + 32)), v32)
        qh = k.load(qs, b.add(qb, c64(128 + 32 * h)), v32)
        quants = (b.or_(b.and_(qa, cst(15)), b.and_(b.shl(qh, cst(4)), cst(0x30))),
                  b.or_(b.and_(qc, cst(15)), b.and_(b.shl(qh, cst(2)), cst(0x30))),
                  b.or_(b.lshr(qa, cst(4)), b.and_(qh, cst(0x30))),
                  b.or_(b.lshr(qc, cst(4)), b.and_(b.lshr(qh, cst(2)), cst(0x30))))
        for c, q in enumerate(quants):
            q = b.sub(q, cst(32))                                   # -32 .. 31
            for g16 in range(2):
                i = 8 * h + 2 * c + g16
                sc = b.sitofp(k.load(qs, b.add(qb, c64(192 + i)), _I8), k.f32)
                dsc = k.splat(b.fmul(d, sc), k.vf)
                vecs = [(b.fmul(dsc, _vec(k, q, 16 * g16 + 8 * g, True)), 128 * h + 32 * c + 16 * g16 + 8 * g)
                        for g in range(2)]
                groups.append((vecs, None))
    return groups, None


def _mxfp4_block(k: VectorTile, qs, qb):
    """MXFP4 (e, qs[16]): input l (l < 16) the low nibble of byte l, 16 + l the high one, each a
    code of ``kvalues`` (a ``pshufb`` table); scale the E8M0 byte's ``0x00200000 << e`` (e < 2) or
    ``(e - 1) << 23`` as float32 bits."""
    b, c64 = k.b, k.c64
    v16 = ir.VectorType(_I8, 16)
    pshufb = b.module.declare_intrinsic("llvm.x86.ssse3.pshuf.b.128", (), ir.FunctionType(v16, [v16, v16]))
    table = _const([v & 0xFF for v in _KVALUES_MXFP4])
    e = b.zext(k.load(qs, qb, _I8), _I32)
    bits = b.select(b.icmp_unsigned("<", e, ir.Constant(_I32, 2)), b.shl(ir.Constant(_I32, 0x00200000), e),
                    b.shl(b.sub(e, ir.Constant(_I32, 1)), ir.Constant(_I32, 23)))
    codes = k.load(qs, b.add(qb, c64(1)), v16)
    lo = b.call(pshufb, [table, b.and_(codes, _const([15] * 16))])
    hi = b.call(pshufb, [table, b.lshr(codes, _const([4] * 16))])
    vecs = [(_vec(k, lo, 0, True), 0), (_vec(k, lo, 8, True), 8), (_vec(k, hi, 0, True), 16), (_vec(k, hi, 8, True), 24)]
    return [(vecs, b.bitcast(bits, k.f32))], None


def _q8_0_block(k: VectorTile, qs, qb):
    """Q8_0 (d, qs int8[32]): input l is ``qs[l]``, scale ``d``."""
    b, c64 = k.b, k.c64
    q = k.load(qs, b.add(qb, c64(2)), ir.VectorType(_I8, 32))
    return [([(_vec(k, q, 8 * g, True), 8 * g) for g in range(4)], _half(k, qs, qb))], None


_BLOCK = {"q4k": _q4k_block, "q6k": _q6k_block, "mxfp4": _mxfp4_block, "q8_0": _q8_0_block}


# --------------------------------------------------------------------------------------------
# the microkernel: one weight row against ns slots


def _hsum(k: VectorTile, v):
    b = k.b
    for n in (4, 2, 1):
        lo = b.shuffle_vector(v, ir.Constant(v.type, None), _const(range(n), _I32)) if n > 1 else \
            b.extract_element(v, ir.Constant(_I32, 0))
        hi = b.shuffle_vector(v, ir.Constant(v.type, None), _const(range(n, 2 * n), _I32)) if n > 1 else \
            b.extract_element(v, ir.Constant(_I32, 1))
        v = b.fadd(lo, hi)
    return v


def _row_ir(kind: str, ns: int, k: VectorTile, qs, q_at, n_blocks, x, x_at, ldx, res, res_at):
    """``res[res_at + s] = sum over the row's inputs of w * x[x_at + s * ldx + input]`` for
    ``s < ns``; the row's block 0 at byte ``q_at`` of ``qs``. Q4_K's x rows carry their sums per
    32 inputs after their ``n_in`` inputs."""
    b, c64 = k.b, k.c64
    _, per_block, block_bytes, sums = _KINDS[kind]
    n_acc = 4 if ns == 1 else 2                          # independent FMA chains per slot
    n_in = b.mul(n_blocks, c64(per_block))
    rows = [b.add(x_at, b.mul(ldx, c64(s))) for s in range(ns)]

    def body(blk, accs):
        accs = list(accs)
        qb = b.add(q_at, b.mul(blk, c64(block_bytes)))
        xb = [b.add(r, b.mul(blk, c64(per_block))) for r in rows]
        groups, mins = _BLOCK[kind](k, qs, qb)
        turn = 0
        for vecs, scale in groups:
            if scale is None:                            # the weights: straight into the sums
                for w, at in vecs:
                    for s in range(ns):
                        i = s * n_acc + turn % n_acc
                        accs[i] = k.fma(w, k.load(x, b.add(xb[s], c64(at)), k.vf, 4), accs[i])
                    turn += 1
                continue
            split = 2 if ns <= 2 else 1
            sv = k.splat(scale, k.vf)
            for s in range(ns):
                chains = [None] * split
                for j, (w, at) in enumerate(vecs):
                    xv = k.load(x, b.add(xb[s], c64(at)), k.vf, 4)
                    chains[j % split] = b.fmul(w, xv) if chains[j % split] is None else k.fma(w, xv, chains[j % split])
                dot = chains[0] if split == 1 else b.fadd(chains[0], chains[1])
                i = s * n_acc + turn % n_acc
                accs[i] = k.fma(sv, dot, accs[i])
            turn += 1
        if mins is not None:                             # Q4_K: - (dmin*mn) * sum(x) per sub-block
            neg = b.fneg(mins)
            for s in range(ns):
                at = b.add(b.add(rows[s], n_in), b.mul(blk, c64(sums)))
                i = s * n_acc + turn % n_acc
                accs[i] = k.fma(neg, k.load(x, at, k.vf, 4), accs[i])
        return accs

    accs = k.block_loop(n_blocks, ns * n_acc, body)
    for s in range(ns):
        part = accs[s * n_acc:(s + 1) * n_acc]
        while len(part) > 1:
            part = [b.fadd(part[i], part[i + 1]) for i in range(0, len(part), 2)]
        b.store(_hsum(k, part[0]), b.gep(res, [b.add(res_at, c64(s))]), align=4)


def _row_intrinsic(kind: str, ns: int):
    def typer(typingctx, qs, q_at, n_blocks, x, x_at, ldx, res, res_at):
        if not (isinstance(qs, types.Array) and qs.dtype == types.uint8 and isinstance(x, types.Array)
                and x.dtype == types.float32 and isinstance(res, types.Array) and res.dtype == types.float32):
            return None
        sig = types.void(qs, q_at, n_blocks, x, x_at, ldx, res, res_at)

        def codegen(context, builder, signature, args):
            flat = list(args)
            for i in (0, 3, 6):
                flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
            k = VectorTile(builder, LANES)
            for i in (1, 2, 4, 5, 7):
                flat[i] = k.i64(flat[i])
            _row_ir(kind, ns, k, *flat)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"row_{kind}_{ns}"
    return intrinsic(typer)


_q4k_1, _q4k_2, _q4k_3, _q4k_4 = (_row_intrinsic("q4k", n) for n in range(1, SLOTS + 1))
_q6k_1, _q6k_2, _q6k_3, _q6k_4 = (_row_intrinsic("q6k", n) for n in range(1, SLOTS + 1))
_mx_1, _mx_2, _mx_3, _mx_4 = (_row_intrinsic("mxfp4", n) for n in range(1, SLOTS + 1))
_q8_1, _q8_2, _q8_3, _q8_4 = (_row_intrinsic("q8_0", n) for n in range(1, SLOTS + 1))


@njit(**JIT_INLINE)
def _row(kind, ns, qs, q_at, n_blocks, x, x_at, ldx, res):
    """The microkernel of ``kind`` (:data:`KIND`) for ``ns`` (1 .. :data:`SLOTS`) slots."""
    if kind == 0:
        if ns == 4:
            _q4k_4(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        elif ns == 3:
            _q4k_3(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        elif ns == 2:
            _q4k_2(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        else:
            _q4k_1(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
    elif kind == 1:
        if ns == 4:
            _q6k_4(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        elif ns == 3:
            _q6k_3(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        elif ns == 2:
            _q6k_2(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        else:
            _q6k_1(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
    elif kind == 2:
        if ns == 4:
            _mx_4(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        elif ns == 3:
            _mx_3(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        elif ns == 2:
            _mx_2(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        else:
            _mx_1(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
    else:
        if ns == 4:
            _q8_4(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        elif ns == 3:
            _q8_3(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        elif ns == 2:
            _q8_2(qs, q_at, n_blocks, x, x_at, ldx, res, 0)
        else:
            _q8_1(qs, q_at, n_blocks, x, x_at, ldx, res, 0)


# --------------------------------------------------------------------------------------------
# the driver: one parallel region over (group, part, tile of TR weight rows)


@njit(**JIT_PARALLEL)
def _matmul_id(kind, x, rows, order, starts, experts, q0, q1, n_parts, per_block, sums, out):
    """out[order[i], :] for every slot; q0, q1 uint8 [n_expert, n_out_p, row_bytes] (q1 = q0 and
    n_parts 1 for one part). x is first gathered in slot order (xe row i: x[rows[order[i]]]),
    each row followed by ``sums`` float32 sums a block (per 32 inputs) when ``sums`` > 0."""
    n_slots, n_in = order.shape[0], x.shape[1]
    n_blocks = n_in // per_block
    width = n_in + n_blocks * sums
    xe = np.empty((n_slots, width), np.float32)
    for i in range(n_slots):
        src = rows[order[i]]
        for j in range(n_in):
            xe[i, j] = x[src, j]
        if sums:
            for g in range(n_in // 32):
                acc = np.float32(0.0)
                for j in range(32):
                    acc += x[src, 32 * g + j]
                xe[i, n_in + g] = acc
    n_out0 = q0.shape[1]
    t0 = (n_out0 + TR - 1) // TR
    t1 = (q1.shape[1] + TR - 1) // TR if n_parts == 2 else 0
    per = t0 + t1
    n_groups = experts.shape[0]
    for item in prange(n_groups * per):
        g, j = item // per, item % per
        qs, t, col = q0, j, 0
        if j >= t0:
            qs, t, col = q1, j - t0, n_out0
        n_out, row_bytes = qs.shape[1], qs.shape[2]
        e = experts[g]
        res = np.empty(SLOTS, np.float32)
        for r in range(t * TR, min((t + 1) * TR, n_out)):
            q_at = (e * n_out + r) * row_bytes
            for s0 in range(starts[g], starts[g + 1], SLOTS):
                ns = min(SLOTS, starts[g + 1] - s0)
                _row(kind, ns, qs, q_at, n_blocks, xe, s0 * width, width, res)
                for s in range(ns):
                    out[order[s0 + s], col + r] = res[s]


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
    ggml_type = _T(ggml_type)
    if ggml_type not in TYPES:
        raise ValueError(f"mul_mat_id_f32: no kernel for {ggml_type!r}")
    kind = KIND[ggml_type]
    _, per_block, block_bytes, sums = list(_KINDS.values())[kind]
    n_in = x.shape[1]
    parts = [np.asarray(d).view() for d in datas]
    if not 1 <= len(parts) <= 2 or any(p.ndim != 3 or p.dtype != np.uint8 or not p.flags.c_contiguous
                                       or p.shape[2] * per_block != n_in * block_bytes for p in parts):
        raise ValueError(f"mul_mat_id_f32: parts must be 1 or 2 C-contiguous uint8 [n_expert, n_out, "
                         f"{n_in // per_block * block_bytes}], got {[(p.dtype.name, p.shape) for p in parts]}")
    for p in parts:
        p.flags.writeable = False                # one compiled signature: the file's maps are read-only
    out = np.empty((order.shape[0], sum(p.shape[1] for p in parts)), dtype=np.float32)
    if order.shape[0]:
        _matmul_id(kind, x, rows, order, starts, experts, parts[0], parts[-1], len(parts), per_block, sums, out)
    return out
