"""Q8_0 weights: block format, GEMV (decode) and tiled (prefill) kernels, NumPy twins.

GGUF block (per 32 weights of one row, as in gguf-py ``quants.py``)::

    Q8_0  34 bytes  | d f16 | q int8[32] |             w[j] = d * q[j]

Packed (:mod:`llamatrace.kernels.types.packing`; T = ceil(n_out / TR) tiles, B = n_in / 32 blocks,
padded rows zero)::

    qs int8 [T, B, 32, TR]    d uint16 [T, B, TR]: the file's fp16 bits

Resident bytes against the file: 34/34, in both modes (the ``q8`` mode's Numba kernels are
:mod:`llamatrace.kernels.int8.act8`'s). The ``f32`` kernels widen ``d`` as they read it (F16C,
exact), as the ``q8`` ones do: float32 scales made the file's 34 bytes a block 36, ~6 % more to
stream in a decode step (gpt-oss's output matrix: 392 MB, not 416). Float32 activations times
the dequantized weights, float32 accumulation, as :mod:`llamatrace.kernels.types.q4` (whose
notes on the loops apply here too). The type is declared at the end (:data:`Q8_0`).
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import njit, prange

from llamatrace.kernels import tile_gemm, tiles
from llamatrace.kernels.int8 import act8, amx
from llamatrace.kernels.quantizers.rows import for_type
from llamatrace.kernels.types.f32_ir import AHEAD_Q8_0, decode_q8_0
from llamatrace.kernels.types.packing import matmul_ref
from llamatrace.kernels.types.registry import BlockFormat, Kernel, QuantType, declare
from llamatrace.machine.jit import JIT, JIT_EXACT, JIT_PARALLEL

_T = gguf.GGMLQuantizationType
TR = tiles.TR
QK = 32
"""Weights per block."""


def dequant_np(p: np.ndarray, db: np.ndarray, mb: None) -> np.ndarray:
    """Q8_0 packed quants int8 [n, B, 32], d float32 [n, B] -> float32 [n, B*32]: gguf-py's
    ``d * q``, bit for bit."""
    return (db[:, :, None] * p.astype(np.float32)).reshape(p.shape[0], -1)


def gemv_q8_np(x: np.ndarray, qs, d) -> np.ndarray:
    """NumPy twin of :func:`_gemv_q8`: per block d*(x.q), d float32 [T, B, TR] values. Returns
    float32 [S, T*TR]."""
    n_seq, n_blocks = x.shape[0], qs.shape[1]
    xb = x.reshape(n_seq, n_blocks, 32).astype(np.float64)
    y = (d * np.einsum("sbj,tbjr->stbr", xb, qs.astype(np.float64))).sum(axis=2)
    return y.reshape(n_seq, -1).astype(np.float32)



@njit(**JIT_PARALLEL)
def _gemv_q8(x, qs, d, out):
    """Q8_0 GEMV for a few rows. x float32 [S, B*32]; qs int8 [T, B, 32, TR]; d uint16 [T, B,
    TR] fp16 bits (or float32 values); out float32 [S, n_out]. Per tile and row of x,
    :func:`~llamatrace.kernels.types.f32_ir.decode_q8_0` over the whole tile, its sums in registers
    (the tile's full rows written straight to out)."""
    n_seq, n_in = x.shape
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    n_out = out.shape[1]
    for t in prange(n_tiles):
        for s in range(n_seq):
            ahead = AHEAD_Q8_0 if s == 0 else 0
            if (t + 1) * TR <= n_out:
                decode_q8_0(qs, t * n_blocks * 32 * TR, x, s * n_in, d, d, t * n_blocks * TR, n_blocks,
                            out, s * n_out + t * TR, ahead)
            else:
                res = np.empty(TR, np.float32)
                decode_q8_0(qs, t * n_blocks * 32 * TR, x, s * n_in, d, d, t * n_blocks * TR, n_blocks, res, 0, ahead)
                tiles.store_tile(res, out, s, t)



@njit(**JIT_EXACT)        # no fastmath: nsz would turn d * 0 = -0 into +0
def _dequant_blocks_q8(qs, d, t, b0, n, wt):
    """Blocks b0 .. b0+n-1 of tile t of Q8_0 -> wt float32 [n*32, TR] (qs, d, wt C-contiguous)."""
    for i in range(n):
        blk = t * qs.shape[1] + b0 + i
        for j in range(32):
            tile_gemm.deq_i8(wt, (i * 32 + j) * TR, qs, (blk * 32 + j) * TR, d, blk * TR)



@njit(**JIT_PARALLEL)
def _tiled_q8(x, qs, d, out):
    """Q8_0 matmul for many rows (as :func:`llamatrace.kernels.types.q4._tiled_q4`)."""
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    for t in prange(n_tiles):
        wt = np.empty((tiles.CHUNK, TR), np.float32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for b0 in range(0, n_blocks, tiles.CHUNK // QK):
            n = min(tiles.CHUNK // QK, n_blocks - b0)
            _dequant_blocks_q8(qs, d, t, b0, n, wt)
            tile_gemm.chunk_matmul(x, wt, b0 * QK, n * QK, acc)
        tiles.store_rows(acc, out, t)



@njit(**JIT)
def dequant_tile(qs, d, t):
    """Tile t -> float32 [B*32, TR] by the prefill kernel's dequantizer; twin:
    :func:`llamatrace.kernels.types.packing.dequant_tile_np`."""
    n_blocks = qs.shape[1]
    wt = np.empty((n_blocks * 32, TR), np.float32)
    _dequant_blocks_q8(qs, d, t, 0, n_blocks, wt)
    return wt


# --------------------------------------------------------------------------------------------
# the type: adapters (x, w, out), their NumPy twins (x, w) -> [S, n_out], the declaration

_ZERO = np.float32(0.0)


def gemv_q8_0(x, w, out):
    _gemv_q8(x, w.qs, w.d, out)


def gemv_q8_0_np(x, w):
    return gemv_q8_np(x, w.qs, w.block_scales())[:, :w.n_out]


def tiled_q8_0(x, w, out):
    _tiled_q8(x, w.qs, w.d, out)


def act8_gemv_q8_0(x, w, out):
    act8._matmul_q4(x, w.qs, w.d, w.d, _ZERO, True, out)


def act8_prefill_q8_0(x, w, out):
    if amx.use(amx.KIND_Q8_0, x.shape[0]):
        amx.prefill_q8_0(x, w, out)
        return
    act8._prefill(x, w.qs, w.d, w.d, _ZERO, act8.PREFILL_Q8, out)


def act8_q8_0_np(x, w):
    return act8.matmul_q8_np(x, w.qs, w.d)[:, :w.n_out]


Q8_0 = declare(QuantType(
    _T.Q8_0, BlockFormat(weights=QK, file_bytes=34, packed_bytes=32, copy=(2, 0, 32), d_off=0, signed=True,
                         f32_bits=True),
    dequant_np=dequant_np,
    kernels={"f32": (Kernel(gemv_q8_0, gemv_q8_0_np), Kernel(tiled_q8_0, matmul_ref)),
             "q8": (Kernel(act8_gemv_q8_0, act8_q8_0_np), Kernel(act8_prefill_q8_0, act8_q8_0_np))},
    q8_bytes=(0, 32), **for_type(_T.Q8_0)))
