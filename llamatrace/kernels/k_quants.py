"""K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1: repacking and matmul kernels.

:mod:`llamatrace.kernels.quant` dispatches here. Weights use the same row tiles as the other types
(``qs uint8 [T, B, P, TR]``, ``d`` / ``m`` float32 ``[T, B, TR]``, ``TR`` rows interleaved
so the inner loops run over rows), where ``B`` counts blocks of ``QKB`` weights (256 for the
K-quants, 32 for Q5_x) and ``P`` bytes per block hold the file's quant bytes plus the
sub-block scales unpacked to one byte each; the fp16 super-block scales become float32.

GGUF blocks (ggml's ``block_*`` structs, as gguf-py ``quants.py`` reads them) and the packed
``P`` bytes per row and block::

    type  file bytes                                   packed bytes (qs)              d     m
    Q2_K   84  scales[16] qs[64] d dmin                 scales[16] qs[64]       = 80   d     dmin
    Q3_K  110  hmask[32] qs[64] scales[12] d            hmask[32] qs[64] sc[16] = 112  d     -
    Q4_K  144  d dmin scales[12] qs[128]                sc[8] mn[8] qs[128]     = 144  d     dmin
    Q5_K  176  d dmin scales[12] qh[32] qs[128]         sc[8] mn[8] qh[32] qs[128] = 176 d  dmin
    Q6_K  210  ql[128] qh[64] scales int8[16] d         ql[128] qh[64] sc[16]   = 208  d     -
    Q5_0   22  d qh[4] qs[16]                           qh[4] qs[16]            = 20   d     -
    Q5_1   24  d m qh[4] qs[16]                         qh[4] qs[16]            = 20   d     m

(``sc``/``mn``: the 6-bit scales and mins of Q3_K/Q4_K/Q5_K unpacked to bytes; Q6_K's int8
scales are kept as their bytes.) Resident bytes against the file, per block: Q2_K 88/84,
Q3_K 116/110, Q4_K 152/144, Q5_K 184/176, Q6_K 212/210 (all <= 1.06x), Q5_0 24/22 = 1.09x,
Q5_1 28/24 = 1.17x -- within issue 8's cap, where float32 scales per 16 weights would not be.

Weights, with ``q`` the integer quant of each element (gguf-py's arithmetic, float32)::

    Q2_K  (d*sc) * q - (dmin*mn)     sc = scales & 15, mn = scales >> 4, q in 0..3
    Q3_K  (d*(sc - 32)) * q          q in -4..3
    Q4_K  (d*sc) * q - (dmin*mn)     q in 0..15
    Q5_K  (d*sc) * q - (dmin*mn)     q in 0..31
    Q6_K  (d*sc) * q                 sc int8, q in -32..31
    Q5_0  d * q                      q in -16..15
    Q5_1  d * q + m                  q in 0..31

Every product of a scale and an integer above is exact in float32 except Q6_K's ``(d*sc)*q``,
which the kernels round exactly as gguf-py does, so :func:`dequant_tile` and
:func:`dequant_rows_np` equal ``gguf.quants.dequantize`` bit for bit. The matmul kernels
accumulate ``x * w`` in float32. Each Numba kernel has a NumPy twin (``*_np``).
"""

from __future__ import annotations

import gguf
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.kernels import tiles

_T = gguf.GGMLQuantizationType

TR = tiles.TR
"""Rows per tile (the same as :data:`llamatrace.kernels.quant.TR`)."""

KQUANT_TYPES = (_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K, _T.Q5_0, _T.Q5_1)

KIND = {t: i for i, t in enumerate(KQUANT_TYPES)}
"""Kernel selector passed to the Numba kernels (an int: the kernels branch outside hot loops)."""

BLOCK_WEIGHTS = {t: (32 if t in (_T.Q5_0, _T.Q5_1) else 256) for t in KQUANT_TYPES}
FILE_BYTES = {_T.Q2_K: 84, _T.Q3_K: 110, _T.Q4_K: 144, _T.Q5_K: 176, _T.Q6_K: 210,
              _T.Q5_0: 22, _T.Q5_1: 24}
PACKED_BYTES = {_T.Q2_K: 80, _T.Q3_K: 112, _T.Q4_K: 144, _T.Q5_K: 176, _T.Q6_K: 208,
                _T.Q5_0: 20, _T.Q5_1: 20}
HAS_MIN = frozenset({_T.Q2_K, _T.Q4_K, _T.Q5_K, _T.Q5_1})

_F16 = np.float16


# --------------------------------------------------------------------------------------------
# repacking (at load time; the Numba kernel `_repack_tiles` sits with the others below)


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian fp16 -> float32 [...]."""
    return np.ascontiguousarray(b).view(_F16)[..., 0].astype(np.float32)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12 packed bytes [..., 12] -> (sc, mn) uint8 [..., 8] (ggml get_scale_min_k4)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _scales_q3(s: np.ndarray) -> np.ndarray:
    """Q3_K 12 packed bytes [..., 12] -> 16 unsigned 6-bit scales uint8 [..., 16]."""
    i = np.arange(16)
    low = (s[..., i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 15
    high = (s[..., 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return (low | (high << 4)).astype(np.uint8)


def repack_blocks(ggml_type, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks uint8 ``[n, B, FILE_BYTES]`` -> (packed uint8 ``[n, B, PACKED_BYTES]``,
    d float32 ``[n, B]``, m float32 ``[n, B]`` or None), per the table in the module docstring;
    also :mod:`llamatrace.kernels.quant`'s Q4_0, Q4_1 and Q8_0 (packed: their quant bytes)."""
    t = _T(ggml_type)
    if t == _T.Q2_K:
        return blocks[..., 0:80], _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])
    if t == _T.Q3_K:
        packed = np.concatenate([blocks[..., 0:96], _scales_q3(blocks[..., 96:108])], axis=-1)
        return packed, _f16(blocks[..., 108:110]), None
    if t in (_T.Q4_K, _T.Q5_K):
        sc, mn = _scale_min_k4(blocks[..., 4:16])
        packed = np.concatenate([sc, mn, blocks[..., 16:]], axis=-1)
        return packed, _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    if t == _T.Q6_K:
        return blocks[..., 0:208], _f16(blocks[..., 208:210]), None
    if t == _T.Q5_0:
        return blocks[..., 2:22], _f16(blocks[..., 0:2]), None
    if t == _T.Q5_1:
        return blocks[..., 4:24], _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    if t in (_T.Q4_0, _T.Q8_0):           # llamatrace.kernels.quant's types: the quants as they are
        return blocks[..., 2:], _f16(blocks[..., 0:2]), None
    if t == _T.Q4_1:
        return blocks[..., 4:], _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    raise ValueError(f"not a K-quant / Q5 / Q4_0 / Q4_1 / Q8_0 type: {t!r}")


def repack_tiles_np(ggml_type, blocks: np.ndarray, row0: int, qs_t: np.ndarray, d_t: np.ndarray,
                    m_t: np.ndarray, group: tuple[int, int] = (0, 0)) -> None:
    """NumPy twin of :func:`repack_tiles`: :func:`repack_blocks` on a few hundred rows at a
    time, scattered into rows ``row0..`` of the tiles; uint16 ``d_t`` / ``m_t`` get the fp16
    bits as they are."""
    n_tiles, n_blocks, n_bytes = qs_t.shape[:3]
    flat = qs_t.reshape(n_tiles, n_blocks, n_bytes * TR)
    base, stride = tiles.byte_offsets_np(n_bytes, *group)
    d_off, m_off = _COPY[_T(ggml_type)][3:]
    for c0 in range(0, blocks.shape[0], 256):
        packed, d, m = repack_blocks(ggml_type, blocks[c0:c0 + 256])
        if d_t.dtype == np.uint16:
            d, m = (np.ascontiguousarray(blocks[c0:c0 + 256, :, off:off + 2]).view(np.uint16)[..., 0]
                    if off >= 0 else None for off in (d_off, m_off))
        rows = row0 + c0 + np.arange(packed.shape[0])
        at = base + (rows % TR)[:, None, None] * stride                     # [n, 1, P]
        flat[(rows // TR)[:, None, None], np.arange(n_blocks)[:, None], at] = packed
        d_t[rows // TR, :, rows % TR] = d
        if m is not None:
            m_t[rows // TR, :, rows % TR] = m


# Per type, for repack_tiles: the quant bytes copied as they are (source offset, packed offset,
# length) and the fp16 d / m offsets in the file block (-1: none). Q4_0, Q4_1 and Q8_0 are
# llamatrace.kernels.quant's; their packer uses the same kernel.
_COPY = {_T.Q2_K: (0, 0, 80, 80, 82), _T.Q3_K: (0, 0, 96, 108, -1), _T.Q4_K: (16, 16, 128, 0, 2),
         _T.Q5_K: (16, 16, 160, 0, 2), _T.Q6_K: (0, 0, 208, 208, -1), _T.Q5_0: (2, 0, 20, 0, -1),
         _T.Q5_1: (4, 0, 20, 0, 2), _T.Q4_0: (2, 0, 16, 0, -1), _T.Q4_1: (4, 0, 16, 0, 2),
         _T.Q8_0: (2, 0, 32, 0, -1)}


def repack_tiles(ggml_type, blocks: np.ndarray, row0: int, f16_table: np.ndarray, qs_t: np.ndarray,
                 d_t: np.ndarray, m_t: np.ndarray, group: tuple[int, int] = (0, 0)) -> None:
    """GGUF blocks uint8 ``[n, B, FILE_BYTES]`` -> rows ``row0..row0+n`` of the tiles ``qs_t``
    uint8 ``[T, B, PACKED_BYTES, TR]``, ``d_t`` / ``m_t`` ``[T, B, TR]`` (``m_t`` unused
    for types without a minimum), per the table in the module docstring (Q4_0, Q4_1, Q8_0: per
    :mod:`llamatrace.kernels.quant`'s, ``qs_t`` ``[T, B, 16 or 32, TR]``); packed bytes
    ``group = (head, end)`` in :mod:`llamatrace.kernels.act8`'s grouped order (:func:`tiles.byte_offset`).
    ``f16_table`` [65536] maps an fp16 bit pattern to what ``d_t`` / ``m_t`` hold: float32
    values, or uint16 (the identity) for the bits as they are. In parallel over tiles; rows of
    other tiles untouched. The NumPy scatter it replaced took ~7 s of an 8B Q4_K_M load; this
    moves 1.5-2.3 GB/s of file bytes on two threads, once the memory is mapped."""
    t = _T(ggml_type)
    _repack_tiles(KIND.get(t, -1), *_COPY[t], *group, blocks, row0, f16_table, qs_t, d_t, m_t)


# --------------------------------------------------------------------------------------------
# NumPy twins


def dequant_rows_np(ggml_type, qs: np.ndarray, d: np.ndarray, m: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Dequantize rows (int [n]) of packed tiles -> float32 ``[n, B*QKB]``; NumPy twin of
    :func:`dequant_tile` (bit-for-bit ``gguf.quants.dequantize``)."""
    t, r = rows // TR, rows % TR
    return dequant_bytes_np(ggml_type, qs[t, :, :, r], d[t, :, r], m[t, :, r] if _T(ggml_type) in HAS_MIN else None)


def dequant_bytes_np(ggml_type, p: np.ndarray, db: np.ndarray, mb: np.ndarray | None) -> np.ndarray:
    """Rows of packed blocks -> float32 ``[n, B*QKB]``: p uint8 ``[n, B, P]`` (this module's block
    layout), db / mb float32 ``[n, B]`` (mb None for types without a minimum)."""
    t_ = _T(ggml_type)
    n, nb = p.shape[0], p.shape[1]
    f32 = np.float32

    if t_ in (_T.Q5_0, _T.Q5_1):
        qh = p[..., 0:4].astype(np.uint32)
        bits = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
        h = ((bits[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        lo = np.concatenate([p[..., 4:20] & 15, p[..., 4:20] >> 4], axis=-1)
        q = (lo | (h << 4)).astype(f32)
        if t_ == _T.Q5_0:
            w = db[..., None] * (q - f32(16))
        else:
            w = db[..., None] * q + mb[..., None]
        return w.reshape(n, nb * 32)
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
        raise ValueError(f"not a K-quant / Q5 type: {t_!r}")
    return w.astype(f32).reshape(n, nb * 256)


def matmul_np(x: np.ndarray, ggml_type, qs, d, m, n_out: int) -> np.ndarray:
    """NumPy twin of :func:`gemv` / :func:`tiled`: ``x @ W.T`` float32 ``[S, n_out]``."""
    w = dequant_rows_np(ggml_type, qs, d, m, np.arange(n_out))
    return (np.asarray(x, np.float32).astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Numba kernels
#
# _deq_block writes one block of one tile as float32 wt[QKB, TR] (element k, row r). Bit
# fields are extracted with integer shifts on the TR lanes; the scale products are formed
# per lane first, then multiplied by the integer quant (gguf-py's order of rounding).

_FASTMATH = {"contract", "arcp", "afn", "nsz"}
_JIT = dict(cache=True, fastmath=_FASTMATH)
_JIT_PARALLEL = dict(parallel=True, **_JIT)
_JIT_INLINE = dict(inline="always", **_JIT)


_Q3K, _Q4K, _Q5K = KIND[_T.Q3_K], KIND[_T.Q4_K], KIND[_T.Q5_K]


@njit(**_JIT_INLINE)
def _put(out, p, r, head, end, v):
    """Byte p of row r of a packed block (``out`` its flat [P * TR] bytes) = v."""
    base, stride = tiles.byte_offset(p, head, end)
    out[base + r * stride] = v


@njit(**_JIT_PARALLEL)
def _repack_tiles(kind, src, dst, n_copy, d_off, m_off, head, end, blocks, row0, f16_table, qs_t, d_t, m_t):
    """:func:`repack_tiles` with the type's :data:`_COPY` entry and ``group`` spelled out."""
    n_rows, n_blocks, block_bytes = blocks.shape
    flat = blocks.reshape(-1)
    t_first = row0 // TR
    for t in prange((row0 + n_rows - 1) // TR - t_first + 1):
        tile = t_first + t
        r_lo = max(tile * TR, row0) - row0
        r_hi = min((tile + 1) * TR, row0 + n_rows) - row0
        for b in range(n_blocks):
            out = qs_t[tile, b].reshape(-1)
            for r in range(r_lo, r_hi):
                rr = row0 + r - tile * TR
                blk = blocks[r, b]
                d_t[tile, b, rr] = f16_table[blk[d_off] | (np.uint16(blk[d_off + 1]) << 8)]
                if m_off >= 0:
                    m_t[tile, b, rr] = f16_table[blk[m_off] | (np.uint16(blk[m_off + 1]) << 8)]
                if kind == _Q3K:                  # 12 bytes of 6-bit scales -> 16 bytes
                    for i in range(16):
                        low = (blk[96 + i % 8] >> (4 * (i // 8))) & 15
                        high = (blk[104 + i % 4] >> (2 * (i // 4))) & 3
                        _put(out, 96 + i, rr, head, end, low | (high << 4))
                elif kind == _Q4K or kind == _Q5K:   # ggml's get_scale_min_k4: 8 scales, 8 mins
                    for i in range(4):
                        lo, mid, hi = blk[4 + i], blk[8 + i], blk[12 + i]
                        _put(out, i, rr, head, end, lo & 63)
                        _put(out, 4 + i, rr, head, end, (hi & 15) | ((lo >> 6) << 4))
                        _put(out, 8 + i, rr, head, end, mid & 63)
                        _put(out, 12 + i, rr, head, end, (hi >> 4) | ((mid >> 6) << 4))
            tiles.copy_rows(flat, (r_lo * n_blocks + b) * block_bytes + src, n_blocks * block_bytes,
                            r_hi - r_lo, out, row0 + r_lo - tile * TR, dst, n_copy, head, end)


@njit(**_JIT_INLINE)
def _deq_q5(kind, q, db, mb, wt):
    """Q5_0 (kind 5) / Q5_1 (kind 6) block q uint8 [20, TR] -> wt [32, TR]."""
    for j in range(16):
        sh = np.uint32(j % 8)
        for r in range(TR):
            byte = q[4 + j, r]
            h0 = (q[j // 8, r] >> sh) & 1
            h1 = (q[2 + j // 8, r] >> sh) & 1
            q0 = np.float32((byte & 15) | (h0 << 4))
            q1 = np.float32((byte >> 4) | (h1 << 4))
            if kind == 5:
                wt[j, r] = db[r] * (q0 - np.float32(16.0))
                wt[16 + j, r] = db[r] * (q1 - np.float32(16.0))
            else:
                wt[j, r] = db[r] * q0 + mb[r]
                wt[16 + j, r] = db[r] * q1 + mb[r]


@njit(**_JIT_INLINE)
def _deq_q2k(q, db, mb, wt, ds, dm):
    for sub in range(16):
        for r in range(TR):
            s = q[sub, r]
            ds[r] = db[r] * np.float32(s & 15)
            dm[r] = mb[r] * np.float32(s >> 4)
        half, c, l0 = sub // 8, (sub % 8) // 2, (sub % 2) * 16
        sh = 2 * c
        for l in range(16):
            e = sub * 16 + l
            for r in range(TR):
                wt[e, r] = ds[r] * np.float32((q[16 + 32 * half + l0 + l, r] >> sh) & 3) - dm[r]


@njit(**_JIT_INLINE)
def _deq_q3k(q, db, wt, ds):
    for sub in range(16):
        for r in range(TR):
            ds[r] = db[r] * (np.float32(q[96 + sub, r]) - np.float32(32.0))
        half, c, l0 = sub // 8, (sub % 8) // 2, (sub % 2) * 16
        sh = 2 * c
        hsh = 4 * half + c
        for l in range(16):
            e = sub * 16 + l
            for r in range(TR):
                low = np.float32((q[32 + 32 * half + l0 + l, r] >> sh) & 3)
                hb = np.float32((q[l0 + l, r] >> hsh) & 1)
                wt[e, r] = ds[r] * (low + np.float32(4.0) * hb - np.float32(4.0))


@njit(**_JIT_INLINE)
def _deq_q45k(five, q, db, mb, wt, ds, dm):
    qoff = 48 if five else 16
    for sub in range(8):
        for r in range(TR):
            ds[r] = db[r] * np.float32(q[sub, r])
            dm[r] = mb[r] * np.float32(q[8 + sub, r])
        j = sub // 2
        sh = 4 * (sub % 2)
        for l in range(32):
            e = sub * 32 + l
            for r in range(TR):
                v = (q[qoff + 32 * j + l, r] >> sh) & 15
                if five:
                    v |= ((q[16 + l, r] >> sub) & 1) << 4
                wt[e, r] = ds[r] * np.float32(v) - dm[r]


@njit(**_JIT_INLINE)
def _deq_q6k(q, db, wt, ds):
    for sub in range(16):
        for r in range(TR):
            s = np.float32(q[192 + sub, r])
            if s >= np.float32(128.0):
                s -= np.float32(256.0)
            ds[r] = db[r] * s
        e0 = sub * 16
        half, c, l0 = e0 // 128, (e0 % 128) // 32, e0 % 32
        s4, g = 4 * (c // 2), c % 2
        sh = 2 * c
        for l in range(16):
            for r in range(TR):
                lo = (q[64 * half + 32 * g + l0 + l, r] >> s4) & 15
                hi = (q[128 + 32 * half + l0 + l, r] >> sh) & 3
                wt[e0 + l, r] = ds[r] * (np.float32(lo | (hi << 4)) - np.float32(32.0))


@njit(**_JIT_INLINE)
def _deq_block(kind, qs, d, m, t, b, wt, ds, dm):
    """Block b of tile t -> wt float32 [QKB, TR]; ds, dm float32 [TR] scratch."""
    q = qs[t, b]
    db = d[t, b]
    mb = m[t, b]
    if kind == 0:
        _deq_q2k(q, db, mb, wt, ds, dm)
    elif kind == 1:
        _deq_q3k(q, db, wt, ds)
    elif kind == 2:
        _deq_q45k(False, q, db, mb, wt, ds, dm)
    elif kind == 3:
        _deq_q45k(True, q, db, mb, wt, ds, dm)
    elif kind == 4:
        _deq_q6k(q, db, wt, ds)
    else:
        _deq_q5(kind, q, db, mb, wt)


@njit(**_JIT)
def dequant_tile(kind, qs, d, m, t):
    """Tile t -> float32 ``[B*QKB, TR]`` (column r = row t*TR + r); twin: :func:`dequant_rows_np`."""
    n_blocks = qs.shape[1]
    qkb = 32 if kind >= 5 else 256
    wt = np.empty((n_blocks * qkb, TR), np.float32)
    ds = np.empty(TR, np.float32)
    dm = np.empty(TR, np.float32)
    for b in range(n_blocks):
        _deq_block(kind, qs, d, m, t, b, wt[b * qkb:(b + 1) * qkb], ds, dm)
    return wt


@njit(**_JIT_PARALLEL)
def gemv(kind, x, qs, d, m, out):
    """A few rows: out[s] = x[s] @ W.T. x float32 [S, B*QKB]; qs uint8 [T, B, P, TR]; d, m
    float32 [T, B, TR]; out float32 [S, n_out]. One parallel region over tiles; each block is
    dequantized once into an L1-sized scratch and used by every row of x."""
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    qkb = 32 if kind >= 5 else 256
    for t in prange(n_tiles):
        wt = np.empty((qkb, TR), np.float32)
        ds = np.empty(TR, np.float32)
        dm = np.empty(TR, np.float32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for b in range(n_blocks):
            tiles.prefetch_next_block(qs, t, b)
            _deq_block(kind, qs, d, m, t, b, wt, ds, dm)
            tiles.chunk_matmul(x, wt, b * qkb, acc)
        tiles.store_rows(acc, out, t)


@njit(**_JIT_PARALLEL)
def tiled(kind, x, qs, d, m, out):
    """Many rows: each tile is dequantized a chunk (256 inputs) at a time into a float32
    scratch, which every row of x then uses. Shapes as in :func:`gemv`."""
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    qkb = 32 if kind >= 5 else 256
    per_chunk = tiles.CHUNK // qkb
    for t in prange(n_tiles):
        wt = np.empty((tiles.CHUNK, TR), np.float32)
        ds = np.empty(TR, np.float32)
        dm = np.empty(TR, np.float32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for b0 in range(0, n_blocks, per_chunk):
            n = min(per_chunk, n_blocks - b0)
            for i in range(n):
                _deq_block(kind, qs, d, m, t, b0 + i, wt[i * qkb:(i + 1) * qkb], ds, dm)
            tiles.chunk_matmul(x, wt[:n * qkb], b0 * qkb, acc)
        tiles.store_rows(acc, out, t)


# --------------------------------------------------------------------------------------------
# Bits in 8-bit integer arithmetic. Numba types integer expressions as int64, so a shift or mask
# written in Python vectorises as 8 lanes per zmm register and costs more than float tricks.
# _quant_f32 is written in LLVM IR on i8 values instead: over the TR rows of a tile the loop
# vectorises as 32 byte lanes, then one conversion to float32 (Q5_0 [14336, 4096] GEMV:
# 20 -> 35 GB/s against floors and FMAs on float lanes).


@intrinsic
def _quant_f32(typingctx, lo, lo_shift, lo_mask, hi, hi_shift, hi_mask, hi_pos):
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
# Q5_0 / Q5_1 GEMV without a scratch: per block, x.q5 with q5 = nibble | bit << 4 (element j < 16:
# low nibble of qs[j], bit j of qh; element j + 16: high nibble, bit j + 16), then
# d * x.q5 + m_scale * m * sum(x).


@njit(**_JIT_INLINE)
def _q5_chain4(q, r, xb, j0):
    """sum over bytes j0..j0+3 of qs of x[j]*q5[j] + x[j+16]*q5[j+16], column r of one packed
    block q uint8 [20, TR] (qh[4] then qs[16])."""
    a = np.float32(0.0)
    for i in range(4):
        j = j0 + i
        v = q[4 + j, r]
        a += xb[j] * _quant_f32(v, 0, 15, q[j >> 3, r], j & 7, 1, 4) \
            + xb[j + 16] * _quant_f32(v, 4, 15, q[2 + (j >> 3), r], j & 7, 1, 4)
    return a


@njit(**_JIT_PARALLEL)
def gemv_q5(x, qs, d, m, m_scale, out):
    """Q5_0 / Q5_1 GEMV for a few rows: weight d*q + m_scale*m (Q5_1: (m, 1); Q5_0: (d, -16)).
    Shapes as in :func:`gemv`; twin :func:`gemv_q5_np`."""
    n_seq = x.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    xsum = np.zeros((n_seq, n_blocks), np.float32)
    for s in range(n_seq):
        for b in range(n_blocks):
            for j in range(32):
                xsum[s, b] += x[s, b * 32 + j]
            xsum[s, b] *= m_scale
    for t in prange(n_tiles):
        acc = np.empty(TR, np.float32)
        half = np.empty(TR, np.float32)
        for s in range(n_seq):
            acc[:] = 0.0
            for b in range(n_blocks):
                q = qs[t, b]
                db = d[t, b]
                mb = m[t, b]
                xb = x[s, b * 32:b * 32 + 32]
                xsb = xsum[s, b]
                # a block in two halves, 16 broadcast activations live in each
                for r in range(TR):
                    half[r] = _q5_chain4(q, r, xb, 0) + _q5_chain4(q, r, xb, 4)
                for r in range(TR):
                    dot = half[r] + (_q5_chain4(q, r, xb, 8) + _q5_chain4(q, r, xb, 12))
                    acc[r] += db[r] * dot + mb[r] * xsb
            tiles.store_tile(acc, out, s, t)


def gemv_q5_np(x: np.ndarray, qs, d, m, m_scale) -> np.ndarray:
    """NumPy twin of :func:`gemv_q5`, same algebra: per block d*(x.q) + m_scale*m*sum(x).
    Returns float32 [S, T*TR] (padded rows included)."""
    n_seq, n_blocks = x.shape[0], qs.shape[1]
    xb = x.reshape(n_seq, n_blocks, 32).astype(np.float64)
    qh = qs[:, :, 0:4].astype(np.uint32)                                   # [T, B, 4, TR]
    bits = qh[:, :, 0] | (qh[:, :, 1] << 8) | (qh[:, :, 2] << 16) | (qh[:, :, 3] << 24)
    h = (bits[:, :, None, :] >> np.arange(32, dtype=np.uint32)[None, None, :, None]) & 1
    lo = np.concatenate([qs[:, :, 4:20] & 15, qs[:, :, 4:20] >> 4], axis=2)
    q = (lo | (h << 4)).astype(np.float64)                                 # [T, B, 32, TR]
    dots = np.einsum("sbj,tbjr->stbr", xb, q)
    xsum = xb.sum(axis=2)[:, None, :, None]
    y = (d * dots + float(m_scale) * m * xsum).sum(axis=2)
    return y.reshape(n_seq, -1).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Q4_K GEMV without a scratch: chunk j of a super-block is 32 bytes whose low nibbles are
# sub-block 2j and high nibbles sub-block 2j+1, so per chunk two dot products
# (x_lo . lo, x_hi . hi) are scaled by their own d*sc, and the mins enter as dmin*mn*sum(x).


@njit(**_JIT_INLINE)
def _q4k_chain8(q, r, off, xlo, xhi, l0):
    """(x_lo . lo, x_hi . hi) over bytes l0..l0+7 of q[off:, r] (8 iterations: fully unrolled,
    so the caller's loop over r vectorises); nibbles split in float arithmetic, exactly."""
    a = np.float32(0.0)
    c = np.float32(0.0)
    for i in range(8):
        v = np.float32(q[off + l0 + i, r])
        h = np.floor(v * np.float32(0.0625))
        a += xlo[l0 + i] * (v - np.float32(16.0) * h)
        c += xhi[l0 + i] * h
    return a, c


@njit(**_JIT_PARALLEL)
def gemv_q4k(x, qs, d, m, out):
    """Q4_K GEMV for a few rows; shapes as in :func:`gemv` (m = dmin). Twin :func:`matmul_np`."""
    n_seq = x.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    n_out = out.shape[1]
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
        base = t * TR
        n = min(TR, n_out - base)
        for s in range(n_seq):
            acc[:] = 0.0
            for b in range(n_blocks):
                q = qs[t, b]
                db = d[t, b]
                mb = m[t, b]
                xs = xsum[s, b]
                for j in range(4):
                    tiles.prefetch_next_block(qs, t, b, j, 4)
                    xlo = x[s, b * 256 + 64 * j:b * 256 + 64 * j + 32]
                    xhi = x[s, b * 256 + 64 * j + 32:b * 256 + 64 * j + 64]
                    off = 16 + 32 * j
                    # four passes over the TR rows, 16 broadcast activations live in each
                    # (one pass over all 32 bytes spilled them); sums (a0 + a1) + (a2 + a3)
                    for r in range(TR):
                        lo01[r], hi01[r] = _q4k_chain8(q, r, off, xlo, xhi, 0)
                    for r in range(TR):
                        a1, c1 = _q4k_chain8(q, r, off, xlo, xhi, 8)
                        lo01[r] += a1
                        hi01[r] += c1
                    for r in range(TR):
                        lo2[r], hi2[r] = _q4k_chain8(q, r, off, xlo, xhi, 16)
                    for r in range(TR):
                        a3, c3 = _q4k_chain8(q, r, off, xlo, xhi, 24)
                        lo = lo01[r] + (lo2[r] + a3)
                        hi = hi01[r] + (hi2[r] + c3)
                        acc[r] += (db[r] * np.float32(q[2 * j, r])) * lo \
                            + (db[r] * np.float32(q[2 * j + 1, r])) * hi \
                            - (mb[r] * np.float32(q[8 + 2 * j, r])) * xs[2 * j] \
                            - (mb[r] * np.float32(q[9 + 2 * j, r])) * xs[2 * j + 1]
            for r in range(n):
                out[s, base + r] = acc[r]


# --------------------------------------------------------------------------------------------
# Q5_K GEMV without a scratch: as Q4_K, with the fifth bit of element l of sub-block k in bit k
# of qh[l], taken on 8-bit integers (_quant_f32). The chunk index j is a literal at each call of
# _q5k_chunk, so the shifts are constants (a shift by a loop variable did not vectorise).


@njit(**_JIT_INLINE)
def _q5k_chain4(q, r, j, xlo, xhi, l0):
    """(x_lo . q5_lo, x_hi . q5_hi) over bytes l0..l0+3 of chunk j, column r."""
    a = np.float32(0.0)
    c = np.float32(0.0)
    for i in range(4):
        l = l0 + i
        v = q[48 + 32 * j + l, r]
        h = q[16 + l, r]
        a += xlo[l] * _quant_f32(v, 0, 15, h, 2 * j, 1, 4)
        c += xhi[l] * _quant_f32(v, 4, 15, h, 2 * j + 1, 1, 4)
    return a, c


@njit(**_JIT_INLINE)
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


@njit(**_JIT_PARALLEL)
def gemv_q5k(x, qs, d, m, out):
    """Q5_K GEMV for a few rows; shapes as in :func:`gemv` (m = dmin). Twin :func:`matmul_np`."""
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
# Q2_K, Q3_K and Q6_K GEMV without a scratch: one scale per 16 weights, and the same layout of
# each half (128 weights) of a super-block. Element 128h + 32c + l (c = 0..3, l = 0..31) takes
#   Q2_K: 2 bits at shift 2c of byte 16 + 32h + l                   q in 0..3
#   Q3_K: 2 bits at shift 2c of byte 32 + 32h + l, plus bit 4h + c of hmask byte l worth 4,
#         minus 4                                                   q in -4..3
#   Q6_K: 4 bits from a nibble of ql (byte 64h + l for c = 0, 2, byte 64h + 32 + l for c = 1, 3;
#         the high nibble for c >= 2), 2 bits at shift 2c of qh byte 128 + 32h + l, minus 32
# and the scale of its 16 weights 8h + 2c + l // 16. Per half and group of 16 l, the four sums
# S_c = sum_l x_c[l] * q_c[l] (before the offsets) are gathered over the TR rows in eight passes
# of two l (four l at a time did not vectorise), then scales, mins and offsets enter once:
#   Q2_K  d*sc*S_c - dmin*mn*sum(x)    Q3_K  d*(sc - 32)*(S_c - 4 sum(x))
#   Q6_K  d*sc*(S_c - 32 sum(x))
# ``kind`` (KIND: 0, 1, 4) and ``h`` are literals at each call, so the branches fold away and
# every shift is a constant.


@njit(**_JIT_INLINE)
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
            s0 += x0[l] * _quant_f32(v, 0, 3, v, 0, 0, 2)
            s1 += x1[l] * _quant_f32(v, 2, 3, v, 0, 0, 2)
            s2 += x2[l] * _quant_f32(v, 4, 3, v, 0, 0, 2)
            s3 += x3[l] * _quant_f32(v, 6, 3, v, 0, 0, 2)
        elif kind == 1:
            v = q[32 + 32 * h + l, r]
            hm = q[l, r]
            s0 += x0[l] * _quant_f32(v, 0, 3, hm, 4 * h, 1, 2)
            s1 += x1[l] * _quant_f32(v, 2, 3, hm, 4 * h + 1, 1, 2)
            s2 += x2[l] * _quant_f32(v, 4, 3, hm, 4 * h + 2, 1, 2)
            s3 += x3[l] * _quant_f32(v, 6, 3, hm, 4 * h + 3, 1, 2)
        else:
            a = q[64 * h + l, r]
            b = q[64 * h + 32 + l, r]
            v = q[128 + 32 * h + l, r]
            s0 += x0[l] * _quant_f32(a, 0, 15, v, 0, 3, 4)
            s1 += x1[l] * _quant_f32(b, 0, 15, v, 2, 3, 4)
            s2 += x2[l] * _quant_f32(a, 4, 15, v, 4, 3, 4)
            s3 += x3[l] * _quant_f32(b, 4, 15, v, 6, 3, 4)
    return s0, s1, s2, s3


@njit(**_JIT_INLINE)
def _int8(v):
    """A uint8 byte read as int8, in float arithmetic."""
    f = np.float32(v)
    return f - np.float32(256.0) * np.floor(f * np.float32(1.0 / 128.0))


@njit(**_JIT_INLINE)
def _nibble(v, shift):
    """float32((v >> shift) & 15) of a uint8, on 8-bit integers."""
    return _quant_f32(v, shift, 15, v, 0, 0, 4)


@njit(**_JIT_INLINE)
def _k16_scale(kind, q, i, r):
    """The scale of the 16 weights i, as a float (Q2_K: its low nibble; Q3_K: minus 32)."""
    if kind == 0:
        return _nibble(q[i, r], 0)
    if kind == 1:
        return np.float32(q[96 + i, r]) - np.float32(32.0)
    return _int8(q[192 + i, r])


@njit(**_JIT_INLINE)
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
    off = np.float32(4.0 if kind == 1 else 32.0)        # Q3_K's and Q6_K's offsets
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


@njit(**_JIT)
def _xsum16(x, n_blocks):
    """Sums of x over each 16 weights of a super-block (one scale each): float32 [S, B, 16]."""
    xsum = np.zeros((x.shape[0], n_blocks, 16), np.float32)
    for s in range(x.shape[0]):
        for b in range(n_blocks):
            for g in range(16):
                for i in range(16):
                    xsum[s, b, g] += x[s, b * 256 + 16 * g + i]
    return xsum


@njit(**_JIT_INLINE)
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


@njit(**_JIT_PARALLEL)
def gemv_q2k(x, qs, d, m, out):
    """Q2_K GEMV for a few rows; shapes as in :func:`gemv` (m = dmin). Twin :func:`matmul_np`."""
    xsum = _xsum16(x, qs.shape[1])
    for t in prange(qs.shape[0]):
        _k16_tile(0, x, qs, d, m, xsum, t, out)


@njit(**_JIT_PARALLEL)
def gemv_q3k(x, qs, d, out):
    """Q3_K GEMV for a few rows; shapes as in :func:`gemv`. Twin :func:`matmul_np`."""
    xsum = _xsum16(x, qs.shape[1])
    for t in prange(qs.shape[0]):
        _k16_tile(1, x, qs, d, d, xsum, t, out)


@njit(**_JIT_PARALLEL)
def gemv_q6k(x, qs, d, out):
    """Q6_K GEMV for a few rows; shapes as in :func:`gemv`. Twin :func:`matmul_np`."""
    xsum = _xsum16(x, qs.shape[1])
    for t in prange(qs.shape[0]):
        _k16_tile(4, x, qs, d, d, xsum, t, out)
