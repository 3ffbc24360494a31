"""Q4_0 and Q4_1 weights: block format, GEMV (decode) and tiled (prefill) kernels, NumPy twins.

GGUF blocks (per 32 weights of one row, as in gguf-py ``quants.py``)::

    Q4_0  18 bytes  | d f16 | qs[16] |                 w[j] = d * (lo(qs[j]) - 8)
    Q4_1  20 bytes  | d f16 | m f16 | qs[16] |         w[j] = d * lo(qs[j]) + m
    (qs[j] holds element j in its low nibble and element j + 16 in its high nibble,
     so w[j + 16] uses hi(qs[j]) = qs[j] >> 4.)

Packed (:mod:`llamatrace.kernels.types.packing`; T = ceil(n_out / TR) tiles, B = n_in / 32 blocks,
padded rows zero)::

    qs uint8 [T, B, 16, TR]   qs[t, b, j, r] = byte j of block b of row t*TR + r
    d  float32 [T, B, TR]     m float32 [T, B, TR] (Q4_1 only)

Resident bytes against the file: Q4_1 24/20 = 1.2x, Q4_0 20/18 = 1.11x (1.0x in the ``q8``
mode, whose Numba kernels are :mod:`llamatrace.kernels.int8.act8`'s). Both types share the kernels: a
weight is ``d*q + m_scale*m``, Q4_1 passing ``(m, 1)``, Q4_0 ``(d, -8)`` for ``d*(q - 8)``. Float32
activations times the dequantized weights, float32 accumulation (about 1e-7 relative to
``x @ gguf.quants.dequantize(raw).T``). The two types are declared at the end of the module
(:data:`Q4_0`, :data:`Q4_1`): format, dequantizer, kernels per mode and phase, their twins.
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import njit, prange

from llamatrace.kernels import tile_gemm, tiles
from llamatrace.kernels.int8 import act8, amx
from llamatrace.kernels.quantizers.rows import for_type
from llamatrace.kernels.types.packing import matmul_ref
from llamatrace.kernels.types.registry import BlockFormat, Kernel, QuantType, declare
from llamatrace.machine.jit import JIT, JIT_INLINE, JIT_PARALLEL

_T = gguf.GGMLQuantizationType
TR = tiles.TR
QK = 32
"""Weights per block."""

_ONE, _MINUS_8 = np.float32(1.0), np.float32(-8.0)


def dequant_q4_0_np(p: np.ndarray, db: np.ndarray, mb: None) -> np.ndarray:
    """Q4_0 packed bytes uint8 [n, B, 16], d float32 [n, B] -> float32 [n, B*32]: gguf-py's
    ``d * (q - 8)``, bit for bit."""
    q32 = np.concatenate([p & 0x0F, p >> 4], axis=2)          # [n, B, 32]: lo nibbles, then hi
    return (db[:, :, None] * (q32.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(p.shape[0], -1)


def dequant_q4_1_np(p: np.ndarray, db: np.ndarray, mb: np.ndarray) -> np.ndarray:
    """Q4_1 packed bytes uint8 [n, B, 16], d and m float32 [n, B] -> float32 [n, B*32]:
    gguf-py's ``d * q + m``, bit for bit."""
    q32 = np.concatenate([p & 0x0F, p >> 4], axis=2)
    return (db[:, :, None] * q32.astype(np.float32) + mb[:, :, None]).reshape(p.shape[0], -1)


def gemv_q4_np(x: np.ndarray, qs, d, m, m_scale) -> np.ndarray:
    """NumPy twin of :func:`_gemv_q4`, same algebra: per block d*(x.q) + m_scale*m*sum(x).

    x float32 [S, B*32]; returns float32 [S, T*TR] (padded rows included).
    """
    n_seq, n_blocks = x.shape[0], qs.shape[1]
    xb = x.reshape(n_seq, n_blocks, 32).astype(np.float64)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.float64)   # [T, B, 32, TR]
    dots = np.einsum("sbj,tbjr->stbr", xb, q)                            # [S, T, B, TR]
    xsum = xb.sum(axis=2)[:, None, :, None]                              # [S, 1, B, 1]
    y = (d * dots + float(m_scale) * m * xsum).sum(axis=2)                               # [S, T, TR]
    return y.reshape(n_seq, -1).astype(np.float32)



# --------------------------------------------------------------------------------------------
# Numba kernels
#
# Loop indices in hot loops start at 0 (range(n)) so LLVM knows they are non-negative; a
# signed index of unknown sign makes Numba emit wraparound selects and LLVM falls back to
# byte gathers. A block's sum is four independent FMA chains added at the end, so several
# chains are in flight instead of one 32-long dependency chain (a plain tree of products
# costs an extra add per product; measured ~15% slower).


@njit(**JIT_INLINE)
def _q4_fma(acc, q, xl, xc):
    """acc + x[j]*lo + x[j+16]*hi for one byte q = lo | hi << 4, given xc = x[j+16] - 16*x[j].

    Since lo = q - 16*hi this is acc + xl*q + xc*hi: two FMAs, and the nibbles are split in
    float arithmetic (cvt, mul, floor) on 16 lanes, because Numba widens integer ops to int64.
    """
    qf = np.float32(q)
    return acc + xl * qf + xc * np.floor(qf * np.float32(0.0625))


@njit(**JIT_INLINE)
def _q4_chain4(q, r, xl, xc, j):
    acc = np.float32(0.0)
    acc = _q4_fma(acc, q[j, r], xl[j], xc[j])
    acc = _q4_fma(acc, q[j + 1, r], xl[j + 1], xc[j + 1])
    acc = _q4_fma(acc, q[j + 2, r], xl[j + 2], xc[j + 2])
    return _q4_fma(acc, q[j + 3, r], xl[j + 3], xc[j + 3])


@njit(**JIT_INLINE)
def _q4_half_dot(q, r, xl, xc, j):
    """sum over bytes j..j+7 of one block q uint8 [16, TR], column r: two 4-FMA chains.

    A block is done in two halves (bytes 0-7, then 8-15, each over all TR rows) so that one
    half's 16 broadcast activations stay in registers; the whole block's 32 spilled (~13%
    slower at 8B shapes). (c0 + c1) + (c2 + c3) is the sum order of a whole-block dot.
    """
    return _q4_chain4(q, r, xl, xc, j) + _q4_chain4(q, r, xl, xc, j + 4)



@njit(**JIT_PARALLEL)
def _gemv_q4(x, qs, d, m, m_scale, out):
    """Q4_0 / Q4_1 GEMV for a few rows: out[s] = x[s] @ W.T.

    x float32 [S, B*32]; qs uint8 [T, B, 16, TR]; d, m float32 [T, B, TR]; a weight is
    d*q + m_scale*m: Q4_1 passes (m, 1.0), Q4_0 passes (d, -8.0) for d*(q-8). out float32
    [S, n_out], n_out <= T*TR. One parallel region over tiles; each tile's bytes are decoded
    in registers once per row of x.
    """
    n_seq = x.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    # per row and block: xl = x[j], xc = x[j+16] - 16 x[j], xsum = sum of the 32 values
    xl = np.empty((n_seq, n_blocks, 16), np.float32)
    xc = np.empty((n_seq, n_blocks, 16), np.float32)
    xsum = np.zeros((n_seq, n_blocks), np.float32)
    for s in range(n_seq):
        for b in range(n_blocks):
            for j in range(16):
                lo = x[s, b * 32 + j]
                hi = x[s, b * 32 + 16 + j]
                xl[s, b, j] = lo
                xc[s, b, j] = hi - np.float32(16.0) * lo
                xsum[s, b] += lo + hi
            xsum[s, b] *= m_scale
    scratch = np.empty((n_tiles, 2, TR), np.float32)   # one allocation, not two per tile
    for t in prange(n_tiles):
        acc = scratch[t, 0]
        half = scratch[t, 1]
        for s in range(n_seq):
            acc[:] = 0.0
            for b in range(n_blocks):
                q = qs[t, b]
                db = d[t, b]
                xlb = xl[s, b]
                xcb = xc[s, b]
                xsb = xsum[s, b]
                mb = m[t, b]
                for r in range(TR):
                    half[r] = _q4_half_dot(q, r, xlb, xcb, 0)
                for r in range(TR):
                    acc[r] += db[r] * (half[r] + _q4_half_dot(q, r, xlb, xcb, 8)) + mb[r] * xsb
            tiles.store_tile(acc, out, s, t)



@njit(**JIT_INLINE)
def _dequant_blocks_q4(qs, d, m, m_scale, t, b0, n, wt):
    """Blocks b0 .. b0+n-1 of tile t of Q4_0 / Q4_1 -> wt float32 [n*32, TR], weight
    d*q + m_scale*m.

    Bit-exact with gguf-py: d*q and m_scale*m are exact in float32 (11-bit scales times
    4-bit integers), so the one rounding of their sum matches d*q + m and d*(q - 8).
    """
    for i in range(n):
        q = qs[t, b0 + i]
        db = d[t, b0 + i]
        mb = m[t, b0 + i]
        for j in range(16):
            lo_row = wt[i * 32 + j]
            hi_row = wt[i * 32 + 16 + j]
            for r in range(TR):
                qf = np.float32(q[j, r])
                hi = np.floor(qf * np.float32(0.0625))
                mr = m_scale * mb[r]
                lo_row[r] = db[r] * (qf - np.float32(16.0) * hi) + mr
                hi_row[r] = db[r] * hi + mr



@njit(**JIT_PARALLEL)
def _tiled_q4(x, qs, d, m, m_scale, out):
    """Q4_0 / Q4_1 matmul for many rows: each tile is dequantized a chunk at a time into a
    float32 scratch, which every row of x then uses. Shapes as in :func:`_gemv_q4`."""
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    for t in prange(n_tiles):
        wt = np.empty((tiles.CHUNK, TR), np.float32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for b0 in range(0, n_blocks, tiles.CHUNK // QK):
            n = min(tiles.CHUNK // QK, n_blocks - b0)
            _dequant_blocks_q4(qs, d, m, m_scale, t, b0, n, wt)
            tile_gemm.chunk_matmul(x, wt, b0 * QK, n * QK, acc)
        tiles.store_rows(acc, out, t)



@njit(**JIT)
def dequant_tile(qs, d, m, m_scale, t):
    """Tile t -> float32 [B*32, TR] by the prefill kernel's dequantizer (``m``, ``m_scale`` as
    in :func:`_gemv_q4`); twin: :func:`llamatrace.kernels.types.packing.dequant_tile_np`."""
    n_blocks = qs.shape[1]
    wt = np.empty((n_blocks * 32, TR), np.float32)
    _dequant_blocks_q4(qs, d, m, m_scale, t, 0, n_blocks, wt)
    return wt


# --------------------------------------------------------------------------------------------
# the types: adapters (x, w, out) calling the kernels with a weight's arrays, their NumPy twins
# (x, w) -> [S, n_out], and the declarations


def gemv_q4_0(x, w, out):
    _gemv_q4(x, w.qs, w.d, w.d, _MINUS_8, out)


def gemv_q4_0_np(x, w):
    return gemv_q4_np(x, w.qs, w.d, w.d, _MINUS_8)[:, :w.n_out]


def tiled_q4_0(x, w, out):
    _tiled_q4(x, w.qs, w.d, w.d, _MINUS_8, out)


def act8_gemv_q4_0(x, w, out):
    act8._matmul_q4(x, w.qs, w.d, w.d, _MINUS_8, False, out)


def act8_prefill_q4_0(x, w, out):
    if amx.use(amx.KIND_Q4_0, x.shape[0]):
        amx.prefill_q4_0(x, w, out)
        return
    act8._prefill(x, w.qs, w.d, w.d, _MINUS_8, act8.PREFILL_Q4, out)


def act8_q4_0_np(x, w):
    return act8.matmul_q4_np(x, w.qs, w.d, w.d, _MINUS_8)[:, :w.n_out]


def gemv_q4_1(x, w, out):
    _gemv_q4(x, w.qs, w.d, w.m, _ONE, out)


def gemv_q4_1_np(x, w):
    return gemv_q4_np(x, w.qs, w.d, w.m, _ONE)[:, :w.n_out]


def tiled_q4_1(x, w, out):
    _tiled_q4(x, w.qs, w.d, w.m, _ONE, out)


def act8_gemv_q4_1(x, w, out):
    act8._matmul_q4(x, w.qs, w.d, w.m, _ONE, False, out)


def act8_prefill_q4_1(x, w, out):
    act8._prefill(x, w.qs, w.d, w.m, _ONE, act8.PREFILL_Q4, out)


def act8_q4_1_np(x, w):
    return act8.matmul_q4_np(x, w.qs, w.d, w.m, _ONE)[:, :w.n_out]


Q4_0 = declare(QuantType(
    _T.Q4_0, BlockFormat(weights=QK, file_bytes=18, packed_bytes=16, copy=(2, 0, 16), d_off=0),
    dequant_np=dequant_q4_0_np,
    kernels={"f32": (Kernel(gemv_q4_0, gemv_q4_0_np), Kernel(tiled_q4_0, matmul_ref)),
             "q8": (Kernel(act8_gemv_q4_0, act8_q4_0_np), Kernel(act8_prefill_q4_0, act8_q4_0_np))},
    q8_bytes=(0, 16), **for_type(_T.Q4_0)))
Q4_1 = declare(QuantType(
    _T.Q4_1, BlockFormat(weights=QK, file_bytes=20, packed_bytes=16, copy=(4, 0, 16), d_off=0, m_off=2),
    dequant_np=dequant_q4_1_np,
    kernels={"f32": (Kernel(gemv_q4_1, gemv_q4_1_np), Kernel(tiled_q4_1, matmul_ref)),
             "q8": (Kernel(act8_gemv_q4_1, act8_q4_1_np), Kernel(act8_prefill_q4_1, act8_q4_1_np))},
    q8_bytes=(0, 16), **for_type(_T.Q4_1)))
