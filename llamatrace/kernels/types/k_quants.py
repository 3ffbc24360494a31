"""K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): block formats, matmul kernels, NumPy twins.

Weights use the same row tiles as the other types (:mod:`llamatrace.kernels.types.packing`:
``qs uint8 [T, B, P, TR]``, ``d`` / ``m`` float32 ``[T, B, TR]``, ``TR`` rows interleaved so
the inner loops run over rows), where ``B`` counts super-blocks of 256 weights and ``P`` bytes
per block hold the file's quant bytes plus the sub-block scales unpacked to one byte each; the
fp16 super-block scales become float32.

GGUF blocks (ggml's ``block_*`` structs, as gguf-py ``quants.py`` reads them) and the packed
``P`` bytes per row and block::

    type  file bytes                                   packed bytes (qs)              d     m
    Q2_K   84  scales[16] qs[64] d dmin                 scales[16] qs[64]       = 80   d     dmin
    Q3_K  110  hmask[32] qs[64] scales[12] d            hmask[32] qs[64] sc[16] = 112  d     -
    Q4_K  144  d dmin scales[12] qs[128]                sc[8] mn[8] qs[128]     = 144  d     dmin
    Q5_K  176  d dmin scales[12] qh[32] qs[128]         sc[8] mn[8] qh[32] qs[128] = 176 d  dmin
    Q6_K  210  ql[128] qh[64] scales int8[16] d         ql[128] qh[64] sc[16]   = 208  d     -

(``sc``/``mn``: the 6-bit scales and mins of Q3_K/Q4_K/Q5_K unpacked to bytes; Q6_K's int8
scales are kept as their bytes. In the ``f32`` mode Q6_K's ql, qh bytes are then rewritten as the
same 192 bytes of 6-bit fields, three dwords a row and scale group, for its decode kernel:
:data:`~llamatrace.kernels.types.f32_ir.Q6K_LAYOUT`, :func:`q6k_to_dwords`.) Resident bytes against the
file, per block: Q2_K 88/84, Q3_K 116/110, Q4_K 152/144, Q5_K 184/176, Q6_K 212/210 (all <= 1.06x) -- within issue 8's
cap, where float32 scales per 16 weights would not be.

Weights, with ``q`` the integer quant of each element (gguf-py's arithmetic, float32)::

    Q2_K  (d*sc) * q - (dmin*mn)     sc = scales & 15, mn = scales >> 4, q in 0..3
    Q3_K  (d*(sc - 32)) * q          q in -4..3
    Q4_K  (d*sc) * q - (dmin*mn)     q in 0..15
    Q5_K  (d*sc) * q - (dmin*mn)     q in 0..31
    Q6_K  (d*sc) * q                 sc int8, q in -32..31

Every product of a scale and an integer above is exact in float32 except Q6_K's ``(d*sc)*q``,
which the kernels round exactly as gguf-py does, so :func:`dequant_tile` and
:func:`dequant_bytes_np` equal ``gguf.quants.dequantize`` bit for bit. The matmul kernels
accumulate ``x * w`` in float32: a scratch-free GEMV per type for decode, one tiled kernel for
prefill. Q4_K and Q6_K also have 8-bit-activation kernels (:mod:`llamatrace.kernels.int8.act8`).
Each Numba kernel has a NumPy twin (``*_np``). The five types are declared at the end of the
module (:data:`Q2_K` .. :data:`Q6_K`), each in one place: format, scale unpacking, dequantizer,
kernels per mode and phase with their twins.
"""

from __future__ import annotations

from functools import partial

import gguf
import numba
import numpy as np
from numba import njit, prange

from llamatrace.kernels import tile_gemm, tiles
from llamatrace.kernels.int8 import act8, amx
from llamatrace.kernels.quantizers.rows import for_type
from llamatrace.kernels.tiles import quant_f32
from llamatrace.kernels.types.f32_ir import AHEAD_Q4K, AHEAD_Q6K, decode_q4k, decode_q6k
from llamatrace.kernels.types.packing import matmul_ref
from llamatrace.kernels.types.registry import BlockFormat, F32Layout, Kernel, QuantType, ScaleByte, declare
from llamatrace.machine.jit import JIT, JIT_EXACT, JIT_INLINE, JIT_PARALLEL

_T = gguf.GGMLQuantizationType

TR = tiles.TR
QK_K = 256
"""Weights per super-block."""

KQUANT_TYPES = (_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K)

KIND = {t: i for i, t in enumerate(KQUANT_TYPES)}
"""Kernel selector passed to the Numba kernels (an int: the kernels branch outside hot loops)."""


def dequant_bytes_np(ggml_type, p: np.ndarray, db: np.ndarray, mb: np.ndarray | None) -> np.ndarray:
    """Rows of packed blocks -> float32 ``[n, B*256]``: p uint8 ``[n, B, P]`` (this module's block
    layout), db / mb float32 ``[n, B]`` (mb None for types without a minimum)."""
    t_ = _T(ggml_type)
    n, nb = p.shape[0], p.shape[1]
    f32 = np.float32
    e = np.arange(256)
    half, c, l = e // 128, (e % 128) // 32, e % 32       # element = 128*half + 32*c + l
    if t_ == _T.Q2_K:
        sc = p[..., e // 16]
        q = ((p[..., 16 + 32 * half + l] >> (2 * c).astype(np.uint8)) & 3).astype(f32)
        w = (db[..., None] * (sc & 15).astype(f32)) * q - mb[..., None] * (sc >> 4).astype(f32)
    elif t_ == _T.Q3_K:
        low = (p[..., 32 + 32 * half + l] >> (2 * c).astype(np.uint8)) & 3
        hbit = (p[..., l] >> (4 * half + c).astype(np.uint8)) & 1
        q = low.astype(f32) - f32(4) * (1 - hbit).astype(f32)
        dl = db[..., None] * (p[..., 96 + e // 16].astype(f32) - f32(32))
        w = dl * q
    elif t_ in (_T.Q4_K, _T.Q5_K):
        j, sub = e // 64, e // 32                         # chunk of 64, sub-block of 32
        qoff = 16 if t_ == _T.Q4_K else 48
        q = (p[..., qoff + 32 * j + e % 32] >> (4 * (sub % 2)).astype(np.uint8)) & 15
        if t_ == _T.Q5_K:
            q = q | (((p[..., 16 + e % 32] >> sub.astype(np.uint8)) & 1) << 4)
        dsc = db[..., None] * p[..., sub].astype(f32)
        dmn = mb[..., None] * p[..., 8 + sub].astype(f32)
        w = dsc * q.astype(f32) - dmn
    elif t_ == _T.Q6_K:
        s, g = c // 2, c % 2
        ql = (p[..., 64 * half + 32 * g + l] >> (4 * s).astype(np.uint8)) & 15
        qh = (p[..., 128 + 32 * half + l] >> (2 * c).astype(np.uint8)) & 3
        q = (ql | (qh << 4)).astype(f32) - f32(32)
        sc = p[..., 192 + e // 16].view(np.int8).astype(f32)
        w = (db[..., None] * sc) * q
    else:
        raise ValueError(f"not a K-quant type: {t_!r}")
    return w.astype(f32).reshape(n, nb * 256)


SCALES_Q3_K = tuple(ScaleByte(96 + i, 96 + i % 8, 4 * (i // 8), 15, 104 + i % 4, 2 * (i // 4), 3) for i in range(16))
"""Q3_K's 12 bytes of 6-bit scales (file bytes 96..107) unpacked to 16 bytes at 96: scale i has
its low 4 bits in nibble i // 8 of byte 96 + i % 8, its high 2 bits at bit 2 (i // 4) of byte
104 + i % 4."""

SCALES_K4 = (*(ScaleByte(i, 4 + i, 0, 63) for i in range(4)),
             *(ScaleByte(4 + i, 12 + i, 0, 15, 4 + i, 6, 3) for i in range(4)),
             *(ScaleByte(8 + i, 8 + i, 0, 63) for i in range(4)),
             *(ScaleByte(12 + i, 12 + i, 4, 15, 8 + i, 6, 3) for i in range(4)))
"""Q4_K's / Q5_K's 12 bytes of 6-bit scales and mins (file bytes 4..15) unpacked to 8 scales
then 8 mins at 0 (ggml's ``get_scale_min_k4``): for j < 4, scale j is the low 6 bits of byte
4 + j and min j of byte 8 + j; scale 4 + j takes the low nibble of byte 12 + j and the top 2 bits
of byte 4 + j, min 4 + j the high nibble of byte 12 + j and the top 2 bits of byte 8 + j."""


# --------------------------------------------------------------------------------------------
# Numba kernels
#
# _deq_block writes one block of one tile as float32 wt[256, TR] (element k, row r). The scale
# products are formed per lane first (gguf-py's order of rounding); each element's TR lanes are
# then one tile_gemm.deq_bits: the bit fields extracted on bytes, times the scale, less the min.

_ZERO = np.float32(0.0)


@njit(inline="always", **JIT_EXACT)
def _deq_q2k(q, db, mb, wt, ds, dm, zero):
    for sub in range(16):
        tile_gemm.deq_bits(ds, 0, q, sub * TR, 0, 15, q, 0, 0, 0, 0, db, _ZERO, zero)
        tile_gemm.deq_bits(dm, 0, q, sub * TR, 4, 15, q, 0, 0, 0, 0, mb, _ZERO, zero)
        half, c, l0 = sub // 8, (sub % 8) // 2, (sub % 2) * 16
        for l in range(16):
            tile_gemm.deq_bits(wt, (sub * 16 + l) * TR, q, (16 + 32 * half + l0 + l) * TR, 2 * c, 3, q, 0, 0, 0, 0,
                               ds, _ZERO, dm)


@njit(inline="always", **JIT_EXACT)
def _deq_q3k(q, db, wt, ds, zero):
    """(d*(sc - 32)) * (low + 4*hbit - 4): the quant low | hbit << 2, less 4."""
    for sub in range(16):
        tile_gemm.deq_bits(ds, 0, q, (96 + sub) * TR, 0, 255, q, 0, 0, 0, 0, db, np.float32(-32.0), zero)
        half, c, l0 = sub // 8, (sub % 8) // 2, (sub % 2) * 16
        for l in range(16):
            tile_gemm.deq_bits(wt, (sub * 16 + l) * TR, q, (32 + 32 * half + l0 + l) * TR, 2 * c, 3,
                               q, (l0 + l) * TR, 4 * half + c, 1, 2, ds, np.float32(-4.0), zero)


@njit(inline="always", **JIT_EXACT)
def _deq_q45k(five, q, db, mb, wt, ds, dm, zero):
    qoff = 48 if five else 16
    for sub in range(8):
        tile_gemm.deq_bits(ds, 0, q, sub * TR, 0, 255, q, 0, 0, 0, 0, db, _ZERO, zero)
        tile_gemm.deq_bits(dm, 0, q, (8 + sub) * TR, 0, 255, q, 0, 0, 0, 0, mb, _ZERO, zero)
        j = sub // 2
        sh = 4 * (sub % 2)
        for l in range(32):
            tile_gemm.deq_bits(wt, (sub * 32 + l) * TR, q, (qoff + 32 * j + l) * TR, sh, 15,
                               q, (16 + l) * TR, sub, 1 if five else 0, 4, ds, _ZERO, dm)


# --------------------------------------------------------------------------------------------
# Q6_K's f32 layout (f32_ir.Q6K_LAYOUT): each row's 16 six-bit quants of a scale group as three
# dwords, so the decode kernel takes them out with shifts and ANDs on 16 rows at once. Made at
# load from the byte-order tiles (ggml's ql, qh, then the int8 scales; the same 208 bytes).


@njit(**JIT_PARALLEL)
def q6k_to_dwords(qs):
    """In place: Q6_K tiles qs uint8 [T, B, 208, TR] in byte order -> the f32 decode kernel's
    layout (:data:`~llamatrace.kernels.types.f32_ir.Q6K_LAYOUT`), on uint32 lanes with the rows
    innermost, so the loops vectorise. Twin :func:`q6k_to_dwords_np`."""
    for t in prange(qs.shape[0]):
        dw = np.empty((48, TR), np.uint32)
        for b in range(qs.shape[1]):
            q = qs[t, b]
            dw[:] = 0
            for e in range(256):
                half, c, l = e // 128, (e % 128) // 32, e % 32
                ql, qh = q[64 * half + 32 * (c % 2) + l], q[128 + 32 * half + l]
                s4, s2 = np.uint32(4 * (c // 2)), np.uint32(2 * c)
                k, off = divmod(6 * (e % 16), 32)
                lo, hi = dw[3 * (e // 16) + k], dw[3 * (e // 16) + min(k + 1, 2)]
                for r in range(TR):
                    v = (((np.uint32(ql[r]) >> s4) & np.uint32(15))
                         | (((np.uint32(qh[r]) >> s2) & np.uint32(3)) << np.uint32(4)))
                    lo[r] |= v << np.uint32(off)                 # the bits past 31 fall off ...
                    if off > 26:
                        hi[r] |= v >> np.uint32(32 - off)        # ... into the next dword
            q.reshape(-1)[:192 * TR] = dw.reshape(-1).view(np.uint8)


def _q6k_quants_np(p: np.ndarray) -> np.ndarray:
    """Byte-order Q6_K blocks uint8 [..., 208] -> their quants uint8 [..., 256] (0..63)."""
    e = np.arange(256)
    half, c, l = e // 128, (e % 128) // 32, e % 32
    ql = (p[..., 64 * half + 32 * (c % 2) + l] >> (4 * (c // 2)).astype(np.uint8)) & 15
    return ql | (((p[..., 128 + 32 * half + l] >> (2 * c).astype(np.uint8)) & 3) << 4)


def q6k_to_dwords_np(qs: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`q6k_to_dwords`, returning the new tiles."""
    n_tiles, n_blocks = qs.shape[:2]
    q = _q6k_quants_np(np.moveaxis(qs, 3, 2)).astype(np.uint64).reshape(n_tiles, n_blocks, TR, 16, 16)
    sh = np.arange(16, dtype=np.uint64) * np.uint64(6)
    lo = np.bitwise_or.reduce(q[..., :11] << sh[:11], axis=-1)      # 6j >= 64 bits fall off
    hi = np.bitwise_or.reduce(np.concatenate([q[..., 10:11] >> np.uint64(4),
                                              q[..., 11:] << (sh[11:] - np.uint64(64))], axis=-1), axis=-1)
    dw = np.stack([lo & np.uint64(0xFFFFFFFF), lo >> np.uint64(32), hi], axis=-1).astype(np.uint32)  # [T, B, TR, g, k]
    out = qs.copy()
    flat = out.reshape(n_tiles, n_blocks, 208 * TR)
    dw = np.ascontiguousarray(dw.transpose(0, 1, 3, 4, 2))                                    # [T, B, g, k, TR]
    flat[:, :, :192 * TR] = dw.view(np.uint8).reshape(n_tiles, n_blocks, -1)
    return out


def q6k_rows_np(qs: np.ndarray, t: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Rows ``r`` of tiles ``t`` (int [n] each) of f32-layout Q6_K tiles qs uint8 [T, B, 208, TR]
    -> uint8 [n, B, 208] in byte order (ql, qh, scales), what :func:`dequant_bytes_np` reads."""
    n_tiles, n_blocks = qs.shape[:2]
    dw = qs.reshape(n_tiles, n_blocks, 208 * TR)[:, :, :192 * TR].copy().view(np.uint32)
    dw = dw.reshape(n_tiles, n_blocks, 16, 3, TR)[t, :, :, :, r].astype(np.uint64)   # [n, B, g, k]
    stream = (dw[..., 0] | (dw[..., 1] << np.uint64(32)), dw[..., 2])
    q = np.empty(dw.shape[:3] + (16,), np.uint8)
    for j in range(16):
        lo = stream[0] >> np.uint64(6 * j) if 6 * j < 64 else np.uint64(0)
        hi = stream[1] << np.uint64(64 - 6 * j) if 6 * j > 58 and 6 * j < 64 else (
            stream[1] >> np.uint64(6 * j - 64) if 6 * j >= 64 else np.uint64(0))
        q[..., j] = (lo | hi) & np.uint64(63)
    q = q.reshape(len(t), n_blocks, 256)
    e = np.arange(256)
    half, c, l = e // 128, (e % 128) // 32, e % 32
    out = np.zeros((len(t), n_blocks, 208), np.uint8)
    for cc in range(4):                       # each byte gets one nibble (crumb) per c: no index repeats
        sel = c == cc
        out[..., 64 * half[sel] + 32 * (cc % 2) + l[sel]] |= (q[..., sel] & 15) << np.uint8(4 * (cc // 2))
        out[..., 128 + 32 * half[sel] + l[sel]] |= (q[..., sel] >> 4) << np.uint8(2 * cc)
    out[..., 192:] = qs[t, :, 192:, r]
    return out


@njit(inline="always", **JIT_EXACT)
def _deq_q6k(q, db, wt, ds, zero):
    """A block q uint8 [208, TR] in the f32 layout (f32_ir.Q6K_LAYOUT): per scale group its 16
    quants taken out of the dwords into bytes (rows innermost: the loops vectorise), then ggml's
    ``(d*sc) * (q - 32)`` as before the layout (:func:`tile_gemm.deq_bits`, the same bits)."""
    dw = q.reshape(-1)[:192 * TR].view(np.uint32).reshape(48, TR)
    qb = np.empty((16, TR), np.uint8)
    m6 = np.uint32(63)
    for sub in range(16):
        tile_gemm.deq_i8(ds, 0, q.view(np.int8), (192 + sub) * TR, db, 0)      # the scales are int8
        lo, mid, hi = dw[3 * sub], dw[3 * sub + 1], dw[3 * sub + 2]
        for r in range(TR):                   # quant j at bits 6j of hi:mid:lo; j = 5, 10 straddle
            a, b, c = lo[r], mid[r], hi[r]
            qb[0, r], qb[1, r], qb[2, r] = a & m6, (a >> np.uint32(6)) & m6, (a >> np.uint32(12)) & m6
            qb[3, r], qb[4, r] = (a >> np.uint32(18)) & m6, (a >> np.uint32(24)) & m6
            qb[5, r] = ((a >> np.uint32(30)) | (b << np.uint32(2))) & m6
            qb[6, r], qb[7, r] = (b >> np.uint32(4)) & m6, (b >> np.uint32(10)) & m6
            qb[8, r], qb[9, r] = (b >> np.uint32(16)) & m6, (b >> np.uint32(22)) & m6
            qb[10, r] = ((b >> np.uint32(28)) | (c << np.uint32(4))) & m6
            qb[11, r], qb[12, r] = (c >> np.uint32(2)) & m6, (c >> np.uint32(8)) & m6
            qb[13, r], qb[14, r], qb[15, r] = (c >> np.uint32(14)) & m6, (c >> np.uint32(20)) & m6, c >> np.uint32(26)
        for l in range(16):
            tile_gemm.deq_bits(wt, (16 * sub + l) * TR, qb, l * TR, 0, 63, qb, l * TR, 0, 0, 4, ds, np.float32(-32.0),
                               zero)


@njit(**JIT_EXACT)        # no fastmath: contraction or nsz would change gguf-py's roundings
def _deq_block(kind, qs, d, m, t, b, wt, ds, dm, zero):
    """Block b of tile t -> wt float32 [256, TR] (C-contiguous); ds, dm float32 [TR] scratch,
    zero float32 [TR] zeros."""
    q = qs[t, b]
    db = d[t, b]
    mb = m[t, b]
    if kind == 0:
        _deq_q2k(q, db, mb, wt, ds, dm, zero)
    elif kind == 1:
        _deq_q3k(q, db, wt, ds, zero)
    elif kind == 2:
        _deq_q45k(False, q, db, mb, wt, ds, dm, zero)
    elif kind == 3:
        _deq_q45k(True, q, db, mb, wt, ds, dm, zero)
    else:
        _deq_q6k(q, db, wt, ds, zero)


@njit(**JIT_EXACT)
def dequant_tile(kind, qs, d, m, t):
    """Tile t -> float32 ``[B*256, TR]`` (column r = row t*TR + r); twin:
    :func:`llamatrace.kernels.types.packing.dequant_tile_np`."""
    n_blocks = qs.shape[1]
    qkb = QK_K
    wt = np.empty((n_blocks * qkb, TR), np.float32)
    ds = np.empty(TR, np.float32)
    dm = np.empty(TR, np.float32)
    zero = np.zeros(TR, np.float32)
    for b in range(n_blocks):
        # the kinds inlined here, not through _deq_block: its compiled overload is shared with the
        # fastmath `tiled` kernel, and compiled there first it gives some of Q3_K's and Q6_K's zeros
        # the other sign (harmless in a matmul's sums, not gguf-py's bits)
        q, db, mb, w = qs[t, b], d[t, b], m[t, b], wt[b * qkb:(b + 1) * qkb]
        if kind == 0:
            _deq_q2k(q, db, mb, w, ds, dm, zero)
        elif kind == 1:
            _deq_q3k(q, db, w, ds, zero)
        elif kind == 2:
            _deq_q45k(False, q, db, mb, w, ds, dm, zero)
        elif kind == 3:
            _deq_q45k(True, q, db, mb, w, ds, dm, zero)
        else:
            _deq_q6k(q, db, w, ds, zero)
    return wt


@njit(**JIT_PARALLEL)
def tiled(kind, x, qs, d, m, out):
    """Many rows: out[s] = x[s] @ W.T. x float32 [S, B*256]; qs uint8 [T, B, P, TR]; d, m
    float32 [T, B, TR]; out float32 [S, n_out]. Each tile is dequantized a chunk (256 inputs) at
    a time into a float32 scratch, which every row of x then uses."""
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    qkb = QK_K
    per_chunk = tiles.CHUNK // qkb
    for t in prange(n_tiles):
        wt = np.empty((tiles.CHUNK, TR), np.float32)
        ds = np.empty(TR, np.float32)
        dm = np.empty(TR, np.float32)
        zero = np.zeros(TR, np.float32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for b0 in range(0, n_blocks, per_chunk):
            n = min(per_chunk, n_blocks - b0)
            for i in range(n):
                _deq_block(kind, qs, d, m, t, b0 + i, wt[i * qkb:(i + 1) * qkb], ds, dm, zero)
            tile_gemm.chunk_matmul(x, wt, b0 * qkb, n * qkb, acc)
        tiles.store_rows(acc, out, t)


# --------------------------------------------------------------------------------------------
# Q4_K and Q6_K GEMV: LLVM IR microkernels over a whole tile (f32_ir), after the activations are
# copied scaled by 2**K (the kernels read the quants as float32 subnormals, q * 2**-149) with their
# unscaled sums per scale group appended (Q4_K: per 32, for the mins; Q6_K: per 16, for the
# offset 32), then 2**(149 - K).


@njit(**JIT)
def _x_with_sums(x, group):
    """x float32 [S, n_in] -> float32 [S, n_in + n_in // group + 1]: each row times 2**K
    (:func:`~llamatrace.kernels.tiles.subnormal_exp`, exact), followed by the unscaled row's sums
    over every ``group`` inputs (float32, in order), then ``2**(149 - K)``."""
    n_seq, n_in = x.shape
    n_sums = n_in // group
    xe = np.empty((n_seq, n_in + n_sums + 1), np.float32)
    for s in range(n_seq):
        k = tiles.subnormal_exp(x, s) if tiles.SUBNORMAL_BIAS else 0
        up = 2.0 ** k
        for i in range(n_in):
            xe[s, i] = np.float32(x[s, i] * up)
        xe[s, n_in + n_sums] = np.float32(2.0 ** (tiles.SUBNORMAL_BIAS - k))
        for g in range(n_in // group):
            acc = np.float32(0.0)
            for i in range(group):
                acc += x[s, g * group + i]
            xe[s, n_in + g] = acc
    return xe


@njit(**JIT_PARALLEL)
def gemv_q4k(x, qs, d, m, out):
    """Q4_K GEMV for a few rows; shapes as in :func:`tiled` (m = dmin). Per tile and row of x,
    :func:`~llamatrace.kernels.types.f32_ir.decode_q4k` over the whole tile, its sums in registers.
    Twin :func:`llamatrace.kernels.types.packing.matmul_ref`."""
    n_seq = x.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    n_out = out.shape[1]
    xe = _x_with_sums(x, 32)
    width = xe.shape[1]
    for t in prange(n_tiles):
        for s in range(n_seq):
            ahead = AHEAD_Q4K if s == 0 else 0
            if (t + 1) * TR <= n_out:
                decode_q4k(qs, t * n_blocks * 144 * TR, xe, s * width, d, m, t * n_blocks * TR, n_blocks,
                           out, s * n_out + t * TR, ahead)
            else:
                res = np.empty(TR, np.float32)
                decode_q4k(qs, t * n_blocks * 144 * TR, xe, s * width, d, m, t * n_blocks * TR, n_blocks, res, 0, ahead)
                tiles.store_tile(res, out, s, t)


@njit(**JIT_PARALLEL)
def gemv_q6k(x, qs, d, out):
    """Q6_K GEMV for a few rows; shapes as in :func:`tiled`. Per tile and row of x,
    :func:`~llamatrace.kernels.types.f32_ir.decode_q6k` over the whole tile, its sums in registers.
    Twin :func:`llamatrace.kernels.types.packing.matmul_ref`."""
    n_seq = x.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    n_out = out.shape[1]
    xe = _x_with_sums(x, 16)
    width = xe.shape[1]
    for t in prange(n_tiles):
        for s in range(n_seq):
            ahead = AHEAD_Q6K if s == 0 else 0
            if (t + 1) * TR <= n_out:
                decode_q6k(qs, t * n_blocks * 208 * TR, xe, s * width, d, d, t * n_blocks * TR, n_blocks,
                           out, s * n_out + t * TR, ahead)
            else:
                res = np.empty(TR, np.float32)
                decode_q6k(qs, t * n_blocks * 208 * TR, xe, s * width, d, d, t * n_blocks * TR, n_blocks, res, 0, ahead)
                tiles.store_tile(res, out, s, t)


# --------------------------------------------------------------------------------------------
# Q5_K GEMV without a scratch: as Q4_K, with the fifth bit of element l of sub-block k in bit k
# of qh[l], taken on 8-bit integers (:func:`~llamatrace.kernels.tiles.quant_f32`). The chunk index j is a literal at each call of
# _q5k_chunk, so the shifts are constants (a shift by a loop variable did not vectorise).


@njit(**JIT_INLINE)
def _q5k_chain4(q, r, j, xlo, xhi, l0):
    """(x_lo . q5_lo, x_hi . q5_hi) over bytes l0..l0+3 of chunk j, column r."""
    a = np.float32(0.0)
    c = np.float32(0.0)
    for i in range(4):
        l = l0 + i
        v = q[48 + 32 * j + l, r]
        h = q[16 + l, r]
        a += xlo[l] * quant_f32(v, 0, 15, h, 2 * j, 1, 4)
        c += xhi[l] * quant_f32(v, 4, 15, h, 2 * j + 1, 1, 4)
    return a, c


@njit(**JIT_INLINE)
def _q5k_chunk(q, db, mb, xs, x, s, b, j, acc, lo01, hi01, lo2, hi2):
    """acc += chunk j's contribution (sub-blocks 2j, 2j+1) over the TR rows, in eight passes."""
    xlo = x[s, b * 256 + 64 * j:b * 256 + 64 * j + 32]
    xhi = x[s, b * 256 + 64 * j + 32:b * 256 + 64 * j + 64]
    for r in range(TR):
        lo01[r], hi01[r] = _q5k_chain4(q, r, j, xlo, xhi, 0)
    for k in range(1, 4):
        for r in range(TR):
            a1, c1 = _q5k_chain4(q, r, j, xlo, xhi, 4 * k)
            lo01[r] += a1
            hi01[r] += c1
    for r in range(TR):
        lo2[r], hi2[r] = _q5k_chain4(q, r, j, xlo, xhi, 16)
    for k in range(5, 7):
        for r in range(TR):
            a1, c1 = _q5k_chain4(q, r, j, xlo, xhi, 4 * k)
            lo2[r] += a1
            hi2[r] += c1
    for r in range(TR):
        a3, c3 = _q5k_chain4(q, r, j, xlo, xhi, 28)
        lo = lo01[r] + (lo2[r] + a3)
        hi = hi01[r] + (hi2[r] + c3)
        acc[r] += (db[r] * np.float32(q[2 * j, r])) * lo \
            + (db[r] * np.float32(q[2 * j + 1, r])) * hi \
            - (mb[r] * np.float32(q[8 + 2 * j, r])) * xs[2 * j] \
            - (mb[r] * np.float32(q[9 + 2 * j, r])) * xs[2 * j + 1]


@njit(**JIT_PARALLEL)
def gemv_q5k(x, qs, d, m, out):
    """Q5_K GEMV for a few rows; shapes as in :func:`tiled` (m = dmin). Twin :func:`llamatrace.kernels.types.packing.matmul_ref`."""
    n_seq = x.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    xsum = np.zeros((n_seq, n_blocks, 8), np.float32)
    for s in range(n_seq):
        for b in range(n_blocks):
            for sub in range(8):
                for l in range(32):
                    xsum[s, b, sub] += x[s, b * 256 + sub * 32 + l]
    for t in prange(n_tiles):
        acc = np.empty(TR, np.float32)
        lo01 = np.empty(TR, np.float32)
        hi01 = np.empty(TR, np.float32)
        lo2 = np.empty(TR, np.float32)
        hi2 = np.empty(TR, np.float32)
        for s in range(n_seq):
            acc[:] = 0.0
            for b in range(n_blocks):
                q = qs[t, b]
                db = d[t, b]
                mb = m[t, b]
                xs = xsum[s, b]
                tiles.prefetch_next_block(qs, t, b, 0, 2)
                _q5k_chunk(q, db, mb, xs, x, s, b, 0, acc, lo01, hi01, lo2, hi2)
                _q5k_chunk(q, db, mb, xs, x, s, b, 1, acc, lo01, hi01, lo2, hi2)
                tiles.prefetch_next_block(qs, t, b, 1, 2)
                _q5k_chunk(q, db, mb, xs, x, s, b, 2, acc, lo01, hi01, lo2, hi2)
                _q5k_chunk(q, db, mb, xs, x, s, b, 3, acc, lo01, hi01, lo2, hi2)
            tiles.store_tile(acc, out, s, t)


# --------------------------------------------------------------------------------------------
# Q2_K and Q3_K GEMV without a scratch: one scale per 16 weights, and the same layout of
# each half (128 weights) of a super-block. Element 128h + 32c + l (c = 0..3, l = 0..31) takes
#   Q2_K: 2 bits at shift 2c of byte 16 + 32h + l                   q in 0..3
#   Q3_K: 2 bits at shift 2c of byte 32 + 32h + l, plus bit 4h + c of hmask byte l worth 4,
#         minus 4                                                   q in -4..3
# and the scale of its 16 weights 8h + 2c + l // 16. Per half and group of 16 l, the four sums
# S_c = sum_l x_c[l] * q_c[l] (before the offsets) are gathered over the TR rows in eight passes
# of two l (four l at a time did not vectorise), then scales, mins and offsets enter once:
#   Q2_K  d*sc*S_c - dmin*mn*sum(x)    Q3_K  d*(sc - 32)*(S_c - 4 sum(x))
# (Q6_K's layout is the same; its GEMV is f32_ir's microkernel.) ``kind`` (KIND: 0, 1) and ``h``
# are literals at each call, so the branches fold away and every shift is a constant.


@njit(**JIT_INLINE)
def _k16_l2(kind, q, r, h, l0, x0, x1, x2, x3):
    """(S_0, S_1, S_2, S_3) over l0 and l0 + 1 of half h, column r."""
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    for i in range(2):
        l = l0 + i
        if kind == 0:
            v = q[16 + 32 * h + l, r]
            s0 += x0[l] * quant_f32(v, 0, 3, v, 0, 0, 2)
            s1 += x1[l] * quant_f32(v, 2, 3, v, 0, 0, 2)
            s2 += x2[l] * quant_f32(v, 4, 3, v, 0, 0, 2)
            s3 += x3[l] * quant_f32(v, 6, 3, v, 0, 0, 2)
        else:
            v = q[32 + 32 * h + l, r]
            hm = q[l, r]
            s0 += x0[l] * quant_f32(v, 0, 3, hm, 4 * h, 1, 2)
            s1 += x1[l] * quant_f32(v, 2, 3, hm, 4 * h + 1, 1, 2)
            s2 += x2[l] * quant_f32(v, 4, 3, hm, 4 * h + 2, 1, 2)
            s3 += x3[l] * quant_f32(v, 6, 3, hm, 4 * h + 3, 1, 2)
    return s0, s1, s2, s3


@njit(**JIT_INLINE)
def _nibble(v, shift):
    """float32((v >> shift) & 15) of a uint8, on 8-bit integers."""
    return quant_f32(v, shift, 15, v, 0, 0, 4)


@njit(**JIT_INLINE)
def _k16_scale(kind, q, i, r):
    """The scale of the 16 weights i, as a float (Q2_K: its low nibble; Q3_K: minus 32)."""
    if kind == 0:
        return _nibble(q[i, r], 0)
    return np.float32(q[96 + i, r]) - np.float32(32.0)


@njit(**JIT_INLINE)
def _k16_half(kind, qs, t, b, h, d, m, xs, x, s, acc, p0, p1, p2, p3):
    """acc += half h of super-block b of tile t, over the TR rows."""
    q = qs[t, b]
    db = d[t, b]
    mb = m[t, b]
    base = b * 256 + 128 * h
    x0 = x[s, base:base + 32]
    x1 = x[s, base + 32:base + 64]
    x2 = x[s, base + 64:base + 96]
    x3 = x[s, base + 96:base + 128]
    off = np.float32(4.0)                               # Q3_K's offset
    for grp in range(2):
        l0 = 16 * grp
        tiles.prefetch_next_block(qs, t, b, 2 * h + grp, 4)
        for r in range(TR):
            p0[r], p1[r], p2[r], p3[r] = _k16_l2(kind, q, r, h, l0, x0, x1, x2, x3)
        for j in range(1, 7):
            for r in range(TR):
                a0, a1, a2, a3 = _k16_l2(kind, q, r, h, l0 + 2 * j, x0, x1, x2, x3)
                p0[r] += a0
                p1[r] += a1
                p2[r] += a2
                p3[r] += a3
        g = 8 * h + grp                                 # the 16 weights of c = 0; c adds 2c
        for r in range(TR):
            a0, a1, a2, a3 = _k16_l2(kind, q, r, h, l0 + 14, x0, x1, x2, x3)
            if kind == 0:
                y = _k16_scale(kind, q, g, r) * (p0[r] + a0) + _k16_scale(kind, q, g + 2, r) * (p1[r] + a1) \
                    + _k16_scale(kind, q, g + 4, r) * (p2[r] + a2) + _k16_scale(kind, q, g + 6, r) * (p3[r] + a3)
                z = _nibble(q[g, r], 4) * xs[g] + _nibble(q[g + 2, r], 4) * xs[g + 2] \
                    + _nibble(q[g + 4, r], 4) * xs[g + 4] + _nibble(q[g + 6, r], 4) * xs[g + 6]
                acc[r] += db[r] * y - mb[r] * z
            else:
                y = _k16_scale(kind, q, g, r) * (p0[r] + a0 - off * xs[g]) \
                    + _k16_scale(kind, q, g + 2, r) * (p1[r] + a1 - off * xs[g + 2]) \
                    + _k16_scale(kind, q, g + 4, r) * (p2[r] + a2 - off * xs[g + 4]) \
                    + _k16_scale(kind, q, g + 6, r) * (p3[r] + a3 - off * xs[g + 6])
                acc[r] += db[r] * y


@njit(**JIT)
def _xsum16(x, n_blocks):
    """Sums of x over each 16 weights of a super-block (one scale each): float32 [S, B, 16]."""
    xsum = np.zeros((x.shape[0], n_blocks, 16), np.float32)
    for s in range(x.shape[0]):
        for b in range(n_blocks):
            for g in range(16):
                for i in range(16):
                    xsum[s, b, g] += x[s, b * 256 + 16 * g + i]
    return xsum


@njit(**JIT_INLINE)
def _k16_tile(kind, x, qs, d, m, xsum, t, out):
    """out[:, rows of tile t]; ``m`` is only read by Q2_K."""
    acc = np.empty(TR, np.float32)
    p = np.empty((4, TR), np.float32)
    for s in range(x.shape[0]):
        acc[:] = 0.0
        for b in range(qs.shape[1]):
            xs = xsum[s, b]
            _k16_half(kind, qs, t, b, 0, d, m, xs, x, s, acc, p[0], p[1], p[2], p[3])
            _k16_half(kind, qs, t, b, 1, d, m, xs, x, s, acc, p[0], p[1], p[2], p[3])
        tiles.store_tile(acc, out, s, t)


@njit(**JIT_PARALLEL)
def gemv_q2k(x, qs, d, m, out):
    """Q2_K GEMV for a few rows; shapes as in :func:`tiled` (m = dmin). Twin :func:`llamatrace.kernels.types.packing.matmul_ref`."""
    xsum = _xsum16(x, qs.shape[1])
    for t in prange(qs.shape[0]):
        _k16_tile(0, x, qs, d, m, xsum, t, out)


@njit(**JIT_PARALLEL)
def gemv_q3k(x, qs, d, out):
    """Q3_K GEMV for a few rows; shapes as in :func:`tiled`. Twin :func:`llamatrace.kernels.types.packing.matmul_ref`."""
    xsum = _xsum16(x, qs.shape[1])
    for t in prange(qs.shape[0]):
        _k16_tile(1, x, qs, d, d, xsum, t, out)


# --------------------------------------------------------------------------------------------
# the types: adapters (x, w, out) calling the kernels with a weight's arrays, their NumPy twins
# (x, w) -> [S, n_out] (the float32 kernels' is packing.matmul_ref, dequantize then x @ W.T),
# and the declarations


def gemv_q2_k(x, w, out):
    gemv_q2k(x, w.qs, w.d, w.m, out)


def tiled_q2_k(x, w, out):
    tiled(KIND[_T.Q2_K], x, w.qs, w.d, w.m, out)


def gemv_q3_k(x, w, out):
    gemv_q3k(x, w.qs, w.d, out)


def tiled_q3_k(x, w, out):
    tiled(KIND[_T.Q3_K], x, w.qs, w.d, w.d, out)


def gemv_q4_k(x, w, out):
    gemv_q4k(x, w.qs, w.d, w.m, out)


def tiled_q4_k(x, w, out):
    tiled(KIND[_T.Q4_K], x, w.qs, w.d, w.m, out)


def act8_gemv_q4_k(x, w, out):
    act8._matmul_q4k(x, w.qs, w.d, w.m, out)


def act8_prefill_q4_k(x, w, out):
    if amx.use(amx.KIND_Q4_K, x.shape[0]):
        amx.prefill_q4_k(x, w, out)
        return
    act8._prefill(x, w.qs, w.d, w.m, _ZERO, act8.PREFILL_Q4K, out)


def act8_q4_k_np(x, w):
    return act8.matmul_q4k_np(x, w.qs, w.d, w.m)[:, :w.n_out]


def gemv_q5_k(x, w, out):
    gemv_q5k(x, w.qs, w.d, w.m, out)


def tiled_q5_k(x, w, out):
    tiled(KIND[_T.Q5_K], x, w.qs, w.d, w.m, out)


def gemv_q6_k(x, w, out):
    gemv_q6k(x, w.qs, w.d, out)


def tiled_q6_k(x, w, out):
    tiled(KIND[_T.Q6_K], x, w.qs, w.d, w.d, out)


def act8_gemv_q6_k(x, w, out):
    act8._matmul_q6k(x, w.qs, w.d, out)


def act8_prefill_q6_k(x, w, out):
    if amx.use(amx.KIND_Q6_K, x.shape[0]):
        amx.prefill_q6_k(x, w, out)
        return
    act8._prefill_q6k(x, w.qs, w.d, out, numba.get_num_threads())


def act8_q6_k_np(x, w):
    return act8.matmul_q6k_np(x, w.qs, w.d)[:, :w.n_out]


def _f32(gemv, tiled_):
    """The float32 mode's pair: the GEMV and the tiled kernel, both twinned by ``matmul_ref``."""
    return Kernel(gemv, matmul_ref), Kernel(tiled_, matmul_ref)


# blocks (file bytes, packed bytes, quant bytes copied (src, dst, n), fp16 d / dmin at) as drawn above
Q2_K = declare(QuantType(
    _T.Q2_K, BlockFormat(weights=QK_K, file_bytes=84, packed_bytes=80, copy=(0, 0, 80), d_off=80, m_off=82),
    dequant_np=partial(dequant_bytes_np, _T.Q2_K), kernels={"f32": _f32(gemv_q2_k, tiled_q2_k)},
    **for_type(_T.Q2_K)))
Q3_K = declare(QuantType(
    _T.Q3_K, BlockFormat(weights=QK_K, file_bytes=110, packed_bytes=112, copy=(0, 0, 96), d_off=108,
                         scales=SCALES_Q3_K),
    dequant_np=partial(dequant_bytes_np, _T.Q3_K), kernels={"f32": _f32(gemv_q3_k, tiled_q3_k)},
    **for_type(_T.Q3_K)))
Q4_K = declare(QuantType(
    _T.Q4_K, BlockFormat(weights=QK_K, file_bytes=144, packed_bytes=144, copy=(16, 16, 128), d_off=0, m_off=2,
                         scales=SCALES_K4),
    dequant_np=partial(dequant_bytes_np, _T.Q4_K),
    kernels={"f32": _f32(gemv_q4_k, tiled_q4_k),
             "q8": (Kernel(act8_gemv_q4_k, act8_q4_k_np), Kernel(act8_prefill_q4_k, act8_q4_k_np))},
    q8_bytes=(act8.Q4K_HEAD, 144),              # the 16 scale bytes stay in the float32 order
    **for_type(_T.Q4_K)))
Q5_K = declare(QuantType(
    _T.Q5_K, BlockFormat(weights=QK_K, file_bytes=176, packed_bytes=176, copy=(16, 16, 160), d_off=0, m_off=2,
                         scales=SCALES_K4),
    dequant_np=partial(dequant_bytes_np, _T.Q5_K), kernels={"f32": _f32(gemv_q5_k, tiled_q5_k)},
    **for_type(_T.Q5_K)))
Q6_K = declare(QuantType(
    _T.Q6_K, BlockFormat(weights=QK_K, file_bytes=210, packed_bytes=208, copy=(0, 0, 208), d_off=208),
    dequant_np=partial(dequant_bytes_np, _T.Q6_K), f32_layout=F32Layout(q6k_to_dwords, q6k_rows_np),
    kernels={"f32": _f32(gemv_q6_k, tiled_q6_k),
             "q8": (Kernel(act8_gemv_q6_k, act8_q6_k_np), Kernel(act8_prefill_q6_k, act8_q6_k_np))},
    q8_bytes=(0, act8.Q6K_SCALES),              # ql, qh grouped; the 16 int8 scales stay last
    **for_type(_T.Q6_K)))
