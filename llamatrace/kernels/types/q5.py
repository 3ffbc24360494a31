"""Q5_0 and Q5_1 weights: block format, GEMV (decode) and tiled (prefill) kernels, NumPy twins.

GGUF blocks (ggml's ``block_q5_0`` / ``block_q5_1``) and the packed bytes per row and block::

    type  file bytes              packed bytes (qs)         d     m        weight
    Q5_0   22  d qh[4] qs[16]     qh[4] qs[16] = 20         d     -        d * q          q in -16..15
    Q5_1   24  d m qh[4] qs[16]   qh[4] qs[16] = 20         d     m        d * q + m      q in 0..31

Element j < 16 is the low nibble of qs[j] with bit j of qh as its fifth bit, element j + 16 the
high nibble with bit j + 16. Packed as the other types (:mod:`llamatrace.kernels.types.packing`):
``qs uint8 [T, B, 20, TR]``, ``d`` / ``m`` float32 ``[T, B, TR]``; resident bytes against the
file Q5_0 24/22 = 1.09x, Q5_1 28/24 = 1.17x. Both types share the kernels: a weight is
``d*q + m_scale*m`` with ``q`` in 0..31, Q5_1 passing ``(m, 1)``, Q5_0 ``(d, -16)``. Every
product is exact in float32, so the dequantizers equal ``gguf.quants.dequantize`` bit for bit;
the matmuls accumulate ``x * w`` in float32. The types are declared at the end (:data:`Q5_0`,
:data:`Q5_1`). Their ``q8``-mode kernel is :func:`llamatrace.kernels.int8.act8._matmul_q5` (8-bit
activations and integer sums, llama.cpp's arithmetic), all 20 packed bytes in groups of four.
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import njit, prange

from llamatrace.kernels import tile_gemm, tiles
from llamatrace.kernels.int8 import act8
from llamatrace.kernels.quantizers.rows import for_type
from llamatrace.kernels.tiles import quant_f32
from llamatrace.kernels.types.packing import matmul_ref
from llamatrace.kernels.types.registry import BlockFormat, Kernel, QuantType, declare
from llamatrace.machine.jit import JIT, JIT_INLINE, JIT_PARALLEL

_T = gguf.GGMLQuantizationType
TR = tiles.TR
QK = 32
"""Weights per block."""

_ONE, _MINUS_16 = np.float32(1.0), np.float32(-16.0)


def _quants_np(p: np.ndarray) -> np.ndarray:
    """Packed bytes uint8 [n, B, 20] -> the 5-bit quants q in 0..31, float32 [n, B, 32]."""
    qh = p[..., 0:4].astype(np.uint32)
    bits = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
    h = ((bits[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    lo = np.concatenate([p[..., 4:20] & 15, p[..., 4:20] >> 4], axis=-1)
    return (lo | (h << 4)).astype(np.float32)


def dequant_q5_0_np(p: np.ndarray, db: np.ndarray, mb: None) -> np.ndarray:
    """Q5_0 packed bytes uint8 [n, B, 20], d float32 [n, B] -> float32 [n, B*32]: gguf-py's
    ``d * (q - 16)``, bit for bit."""
    return (db[..., None] * (_quants_np(p) - np.float32(16))).reshape(p.shape[0], -1)


def dequant_q5_1_np(p: np.ndarray, db: np.ndarray, mb: np.ndarray) -> np.ndarray:
    """Q5_1 packed bytes uint8 [n, B, 20], d and m float32 [n, B] -> float32 [n, B*32]:
    gguf-py's ``d * q + m``, bit for bit."""
    return (db[..., None] * _quants_np(p) + mb[..., None]).reshape(p.shape[0], -1)


# --------------------------------------------------------------------------------------------
# tiled (prefill): each block dequantized into a float32 scratch used by every row of x


@njit(**JIT_INLINE)
def _deq_q5(q5_1, q, db, mb, wt):
    """Q5_0 (``q5_1`` False) / Q5_1 block q uint8 [20, TR] -> wt [32, TR]."""
    for j in range(16):
        sh = np.uint32(j % 8)
        for r in range(TR):
            byte = q[4 + j, r]
            h0 = (q[j // 8, r] >> sh) & 1
            h1 = (q[2 + j // 8, r] >> sh) & 1
            q0 = np.float32((byte & 15) | (h0 << 4))
            q1 = np.float32((byte >> 4) | (h1 << 4))
            if not q5_1:
                wt[j, r] = db[r] * (q0 - np.float32(16.0))
                wt[16 + j, r] = db[r] * (q1 - np.float32(16.0))
            else:
                wt[j, r] = db[r] * q0 + mb[r]
                wt[16 + j, r] = db[r] * q1 + mb[r]


@njit(**JIT)
def dequant_tile(q5_1, qs, d, m, t):
    """Tile t -> float32 ``[B*32, TR]`` (column r = row t*TR + r); twin:
    :func:`llamatrace.kernels.types.packing.dequant_tile_np`."""
    n_blocks = qs.shape[1]
    wt = np.empty((n_blocks * QK, TR), np.float32)
    for b in range(n_blocks):
        _deq_q5(q5_1, qs[t, b], d[t, b], m[t, b], wt[b * QK:(b + 1) * QK])
    return wt


@njit(**JIT_PARALLEL)
def _tiled_q5(q5_1, x, qs, d, m, out):
    """Many rows: each tile is dequantized a chunk (``tiles.CHUNK`` inputs) at a time into a
    float32 scratch, which every row of x then uses. x float32 [S, B*32]; qs uint8
    [T, B, 20, TR]; d, m float32 [T, B, TR] (Q5_0: m unread); out float32 [S, n_out]."""
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    per_chunk = tiles.CHUNK // QK
    for t in prange(n_tiles):
        wt = np.empty((tiles.CHUNK, TR), np.float32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for b0 in range(0, n_blocks, per_chunk):
            n = min(per_chunk, n_blocks - b0)
            for i in range(n):
                _deq_q5(q5_1, qs[t, b0 + i], d[t, b0 + i], m[t, b0 + i], wt[i * QK:(i + 1) * QK])
            tile_gemm.chunk_matmul(x, wt, b0 * QK, n * QK, acc)
        tiles.store_rows(acc, out, t)


# --------------------------------------------------------------------------------------------
# Q5_0 / Q5_1 GEMV without a scratch: per block, x.q5 with q5 = nibble | bit << 4 (element j < 16:
# low nibble of qs[j], bit j of qh; element j + 16: high nibble, bit j + 16), then
# d * x.q5 + m_scale * m * sum(x).


@njit(**JIT_INLINE)
def _q5_chain4(q, r, xb, j0):
    """sum over bytes j0..j0+3 of qs of x[j]*q5[j] + x[j+16]*q5[j+16], column r of one packed
    block q uint8 [20, TR] (qh[4] then qs[16])."""
    a = np.float32(0.0)
    for i in range(4):
        j = j0 + i
        v = q[4 + j, r]
        a += xb[j] * quant_f32(v, 0, 15, q[j >> 3, r], j & 7, 1, 4) \
            + xb[j + 16] * quant_f32(v, 4, 15, q[2 + (j >> 3), r], j & 7, 1, 4)
    return a


@njit(**JIT_PARALLEL)
def _gemv_q5(x, qs, d, m, m_scale, out):
    """Q5_0 / Q5_1 GEMV for a few rows: weight d*q + m_scale*m (Q5_1: (m, 1); Q5_0: (d, -16)).
    Shapes as in :func:`_tiled_q5`; twin :func:`gemv_q5_np`."""
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
    """NumPy twin of :func:`_gemv_q5`, same algebra: per block d*(x.q) + m_scale*m*sum(x).
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
# the types: adapters (x, w, out), their NumPy twins (x, w) -> [S, n_out], the declarations


def gemv_q5_0(x, w, out):
    _gemv_q5(x, w.qs, w.d, w.d, _MINUS_16, out)


def gemv_q5_0_np(x, w):
    return gemv_q5_np(x, w.qs, w.d, w.d, _MINUS_16)[:, :w.n_out]


def tiled_q5_0(x, w, out):
    _tiled_q5(False, x, w.qs, w.d, w.d, out)


def gemv_q5_1(x, w, out):
    _gemv_q5(x, w.qs, w.d, w.m, _ONE, out)


def gemv_q5_1_np(x, w):
    return gemv_q5_np(x, w.qs, w.d, w.m, _ONE)[:, :w.n_out]


def tiled_q5_1(x, w, out):
    _tiled_q5(True, x, w.qs, w.d, w.m, out)


def act8_q5_0(x, w, out):
    act8._matmul_q5(x, w.qs, w.d, w.d, np.float32(0.0), True, out)


def act8_q5_0_np(x, w):
    return act8_q5_np(x, w.qs, w.d, w.d, 0.0, 16)[:, :w.n_out]


def act8_q5_1(x, w, out):
    act8._matmul_q5(x, w.qs, w.d, w.m, _ONE, False, out)


def act8_q5_1_np(x, w):
    return act8_q5_np(x, w.qs, w.d, w.m, 1.0, 0)[:, :w.n_out]


def act8_q5_np(x: np.ndarray, qs, d, m, m_scale, offset) -> np.ndarray:
    """NumPy twin of :func:`llamatrace.kernels.int8.act8._matmul_q5` (float64 sums): weights
    ``d * (q - offset) + m_scale * m``, qs in act8's layout, d and m fp16 bits. Returns float32
    [S, T*TR]."""
    p = act8.file_order(qs, _T.Q5_0).transpose(0, 3, 1, 2)                # [T, TR, B, 20]
    q = _quants_np(p).astype(np.int64).transpose(0, 2, 3, 1) - offset     # [T, B, 32, TR]
    return act8.matmul_quants_np(x, q, d, m, m_scale)


Q5_0 = declare(QuantType(
    _T.Q5_0, BlockFormat(weights=QK, file_bytes=22, packed_bytes=20, copy=(2, 0, 20), d_off=0),
    dequant_np=dequant_q5_0_np,
    kernels={"f32": (Kernel(gemv_q5_0, gemv_q5_0_np), Kernel(tiled_q5_0, matmul_ref)),
             "q8": (Kernel(act8_q5_0, act8_q5_0_np), Kernel(act8_q5_0, act8_q5_0_np))},
    q8_bytes=(0, 20), **for_type(_T.Q5_0)))
Q5_1 = declare(QuantType(
    _T.Q5_1, BlockFormat(weights=QK, file_bytes=24, packed_bytes=20, copy=(4, 0, 20), d_off=0, m_off=2),
    dequant_np=dequant_q5_1_np,
    kernels={"f32": (Kernel(gemv_q5_1, gemv_q5_1_np), Kernel(tiled_q5_1, matmul_ref)),
             "q8": (Kernel(act8_q5_1, act8_q5_1_np), Kernel(act8_q5_1, act8_q5_1_np))},
    q8_bytes=(0, 20), **for_type(_T.Q5_1)))
