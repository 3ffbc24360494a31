"""MXFP4 weights (gpt-oss's experts): block format, float32 and 8-bit-activation kernels, NumPy twins.

GGUF block (ggml-common.h ``block_mxfp4``, 32 weights of one row, 17 bytes)::

    | e u8 (E8M0) | qs[16] |        w[j] = 2**(e - 128) * kvalues[lo(qs[j])]
                                    w[j + 16] = 2**(e - 128) * kvalues[hi(qs[j])]

``kvalues`` = 0 1 2 3 4 6 8 12 0 -1 -2 -3 -4 -6 -8 -12 (ggml's ``kvalues_mxfp4``): the E2M1 values
of the OCP microscaling spec, doubled, so the scale is half of the E8M0 one
(``GGML_E8M0_TO_FP32_HALF``, :data:`llamatrace.machine.jit.E8M0_HALF_TABLE`). Every weight is a
power of two times a small integer: the dequantizer equals ``gguf.quants.dequantize`` bit for bit.

Packed (:mod:`llamatrace.kernels.types.packing`; T = ceil(n_out / TR) tiles, B = n_in / 32)::

    qs uint8 [T, B, 16, TR]     the file's nibble bytes (act8's groups of four in the q8 mode)
    d  float32 [T, B, TR]       2**(e - 128) (f32 mode) | uint16 [T, B, TR] the byte e (q8 mode)

Float32 activations (the default): ``x`` times the dequantized weights, float32 sums. The ``q8``
mode is llama.cpp's ``ggml_vec_dot_mxfp4_q8_0`` (ggml-cpu arch/x86/quants.c): the activations
rounded to Q8_0 (:func:`llamatrace.kernels.int8.act8.quantize`), per block the exact int32 sum
of ``kvalues[nibble] * xq`` and ``y += (xd * 2**(e - 128)) * isum`` in float32. The quantizer
slot (``quantize``) is left empty here. The type is declared at the end (:data:`MXFP4`).
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import njit, prange

from llamatrace.kernels import tile_gemm, tiles
from llamatrace.kernels.int8 import act8
from llamatrace.kernels.int8.act8_ir import isum_q8
from llamatrace.kernels.quantizers.rows import for_type
from llamatrace.kernels.types.f32_ir import AHEAD_MXFP4, decode_mxfp4
from llamatrace.kernels.types.packing import matmul_ref
from llamatrace.kernels.types.registry import BlockFormat, Kernel, QuantType, declare
from llamatrace.machine.jit import E8M0_HALF_TABLE, JIT, JIT_EXACT, JIT_INLINE, JIT_PARALLEL

_T = gguf.GGMLQuantizationType
TR = tiles.TR
QK = 32
"""Weights per block."""

KVALUES = np.array(gguf.quants.MXFP4.kvalues, np.int8)
"""int8 [16]: ggml's ``kvalues_mxfp4``, the doubled E2M1 value of each 4-bit code."""
_KV_F32 = KVALUES.astype(np.float32)
_E8M0_HALF = E8M0_HALF_TABLE[:256].copy()           # the byte e -> 2**(e - 128), for the kernels


def dequant_mxfp4_np(p: np.ndarray, db: np.ndarray, mb: None) -> np.ndarray:
    """MXFP4 packed bytes uint8 [n, B, 16], d float32 [n, B] (``2**(e - 128)``) -> float32
    [n, B*32]: ggml's ``dequantize_row_mxfp4``, bit for bit ``gguf.quants.dequantize``."""
    q32 = np.concatenate([p & 0x0F, p >> 4], axis=2)                       # [n, B, 32]
    return (db[:, :, None] * _KV_F32[q32]).reshape(p.shape[0], -1)


def gemv_mxfp4_np(x: np.ndarray, qs, d) -> np.ndarray:
    """NumPy twin of :func:`_gemv_mxfp4`: per block d * (x . kvalues[q]), float64 sums. x float32
    [S, B*32], qs uint8 [T, B, 16, TR], d float32 [T, B, TR]; returns float32 [S, T*TR]."""
    n_seq, n_blocks = x.shape[0], qs.shape[1]
    xb = x.reshape(n_seq, n_blocks, QK).astype(np.float64)
    q = _KV_F32[np.concatenate([qs & 0x0F, qs >> 4], axis=2)].astype(np.float64)   # [T, B, 32, TR]
    y = (d * np.einsum("sbj,tbjr->stbr", xb, q)).sum(axis=2)
    return y.reshape(n_seq, -1).astype(np.float32)


def act8_mxfp4_np(x: np.ndarray, qs, d) -> np.ndarray:
    """NumPy twin of :func:`_matmul_mxfp4_q8` (float64 sums): qs in act8's layout, d the E8M0
    bytes (uint16). Returns float32 [S, T*TR]."""
    p = act8.file_order(qs, _T.MXFP4)                                       # [T, B, 16, TR]
    q = KVALUES[np.concatenate([p & 0x0F, p >> 4], axis=2)].astype(np.int64)   # [T, B, 32, TR]
    xq, xd, _ = act8.quantize_np(x)
    isum = np.einsum("sbj,tbjr->stbr", xq.reshape(x.shape[0], -1, QK).astype(np.int64), q).astype(np.float64)
    y = (_E8M0_HALF[d][None] * xd[:, None, :, None] * isum).sum(axis=2)
    return y.reshape(x.shape[0], -1).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Numba kernels
#
# The codes become int8 kvalues four at a time in uint32 arithmetic (:func:`_kvalues4`), no table:
# a 16-entry lookup per code compiled to gathers and ran at a fraction of Q4_0's speed. The int8
# values then feed the prefill's float32 dequantizer or the q8 mode's integer block sums (Q8_0's);
# the f32 decode takes its kvalues from a pshufb table in registers (f32_ir.decode_mxfp4).


@njit(**JIT_INLINE)
def _kvalues4(c):
    """Four 4-bit codes, one in the low nibble of each byte of uint32 ``c`` (high nibbles zero) ->
    their kvalues as four int8 bytes of a uint32. With ``m`` the code's low three bits,
    ``|kvalue| = m + (m & 3 if m >= 4) + (2 if m == 7)`` (0 1 2 3 4 6 8 12), and bit 3 its sign,
    negated per byte as ``(0x80 - v) ^ 0x80`` (no borrow between bytes: v <= 12)."""
    m = c & np.uint32(0x07070707)
    four = ((m >> np.uint32(2)) & np.uint32(0x01010101)) * np.uint32(0xFF)
    seven = ((m + np.uint32(0x01010101)) >> np.uint32(3)) & np.uint32(0x01010101)
    v = m + ((m & np.uint32(0x03030303)) & four) + (seven << np.uint32(1))
    neg = (np.uint32(0x80808080) - v) ^ np.uint32(0x80808080)
    sign = ((c >> np.uint32(3)) & np.uint32(0x01010101)) * np.uint32(0xFF)
    return (v & (sign ^ np.uint32(0xFFFFFFFF))) | (neg & sign)


@njit(**JIT_INLINE)
def _unpack(words, base, w32):
    """One tile block's 16 * TR code bytes at word ``base`` of ``words`` -> ``w32`` uint32
    [8 * TR], the int8 kvalues of the low nibbles in words ``k`` and of the high ones in words
    ``4*TR + k`` of code word ``k``. In both layouts that is the int8 layout of Q8_0 the kernels
    read: in the float32 path's (word ``j*TR/4 + r/4`` holds byte j of rows r..r+3) weight j of
    row r lands at byte ``j*TR + r`` (weight 16 + j at ``(16 + j)*TR + r``); in act8's (word
    ``g*TR + r`` holds bytes 4g..4g+3 of row r) weight ``4g + i`` of row r at byte i of word
    ``g*TR + r`` (16 + 4g + i: of word ``(4 + g)*TR + r``). One flat loop of 4*TR words, which
    vectorizes (nested loops over rows and bytes ran ~10x slower)."""
    for k in range(4 * TR):
        v = np.uint32(words[base + k])
        w32[k] = _kvalues4(v & np.uint32(0x0F0F0F0F))
        w32[4 * TR + k] = _kvalues4((v >> np.uint32(4)) & np.uint32(0x0F0F0F0F))


@njit(**JIT_PARALLEL)
def _gemv_mxfp4(x, qs, d, out):
    """MXFP4 GEMV for a few rows: out[s] = x[s] @ W.T. x float32 [S, B*32]; qs uint8
    [T, B, 16, TR]; d float32 [T, B, TR]; out float32 [S, n_out]. Per tile and row of x,
    :func:`~llamatrace.kernels.types.f32_ir.decode_mxfp4` over the whole tile, its sums in registers
    (the tile's full rows written straight to out)."""
    n_seq, n_in = x.shape
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    n_out = out.shape[1]
    for t in prange(n_tiles):
        for s in range(n_seq):
            ahead = AHEAD_MXFP4 if s == 0 else 0
            if (t + 1) * TR <= n_out:
                decode_mxfp4(qs, t * n_blocks * 16 * TR, x, s * n_in, d, d, t * n_blocks * TR, n_blocks,
                             out, s * n_out + t * TR, ahead)
            else:
                res = np.empty(TR, np.float32)
                decode_mxfp4(qs, t * n_blocks * 16 * TR, x, s * n_in, d, d, t * n_blocks * TR, n_blocks, res, 0, ahead)
                tiles.store_tile(res, out, s, t)


@njit(**JIT_EXACT)        # no fastmath: nsz would turn d * 0 = -0 into +0
def _dequant_blocks(qs, d, t, b0, n, wt, w32):
    """Blocks b0 .. b0+n-1 of tile t -> wt float32 [n*32, TR] (C-contiguous), ``d * kvalues[code]``
    (exact); ``w32`` uint32 [8 * TR] scratch."""
    words = qs.reshape(qs.size).view(np.uint32)
    q = w32.view(np.int8)
    for i in range(n):
        blk = t * qs.shape[1] + b0 + i
        _unpack(words, blk * 4 * TR, w32)
        for j in range(QK):
            tile_gemm.deq_i8(wt, (i * QK + j) * TR, q, j * TR, d, blk * TR)


@njit(**JIT_PARALLEL)
def _tiled_mxfp4(x, qs, d, out):
    """MXFP4 matmul for many rows: each tile dequantized a chunk at a time, which every row of x
    then uses (as :func:`llamatrace.kernels.types.q4._tiled_q4`). Shapes as in :func:`_gemv_mxfp4`."""
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    for t in prange(n_tiles):
        wt = np.empty((tiles.CHUNK, TR), np.float32)
        w32 = np.empty(8 * TR, np.uint32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for b0 in range(0, n_blocks, tiles.CHUNK // QK):
            n = min(tiles.CHUNK // QK, n_blocks - b0)
            _dequant_blocks(qs, d, t, b0, n, wt, w32)
            tile_gemm.chunk_matmul(x, wt, b0 * QK, n * QK, acc)
        tiles.store_rows(acc, out, t)


@njit(**JIT)
def dequant_tile(qs, d, t):
    """Tile t -> float32 [B*32, TR] by the prefill kernel's dequantizer; twin:
    :func:`llamatrace.kernels.types.packing.dequant_tile_np`."""
    wt = np.empty((qs.shape[1] * QK, TR), np.float32)
    _dequant_blocks(qs, d, t, 0, qs.shape[1], wt, np.empty(8 * TR, np.uint32))
    return wt


@njit(**JIT_PARALLEL)
def _matmul_mxfp4_q8(x, qs, d, out):
    """out[s] = x[s] @ W.T with x rounded to Q8_0 first (:func:`llamatrace.kernels.int8.act8.quantize`),
    as llama.cpp's ``ggml_vec_dot_mxfp4_q8_0``: per block the exact int32 ``isum = sum_j
    kvalues[q_j] * xq_j``, then ``y += (xd * 2**(e - 128)) * isum`` in float32. Each block is
    unpacked to int8 kvalues in Q8_0's layout once for every row of x and summed by Q8_0's
    ``isum_q8`` (|kvalue| <= 12). Decode and prefill both run it. x float32 [S, B*32]; qs uint8
    [T, B, 16, TR] in act8's layout; d uint16 [T, B, TR] the E8M0 bytes; out float32 [S, n_out]."""
    xq, xd, _, _ = act8._quantized(x, act8.Q8_0, 0)
    n_seq = xq.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    words = qs.reshape(qs.size).view(np.uint32)
    for t in prange(n_tiles):
        isum = np.empty(TR, np.int32)
        w32 = np.empty(8 * TR, np.uint32)
        w8 = w32.view(np.int8)
        scale = np.empty(TR, np.float32)
        acc = np.zeros((n_seq, TR), np.float32)
        for b in range(n_blocks):
            _unpack(words, (t * n_blocks + b) * 4 * TR, w32)
            db = d[t, b]
            for r in range(TR):
                scale[r] = _E8M0_HALF[db[r]]
            for s in range(n_seq):
                isum_q8(w8, 0, xq, (s * n_blocks + b) * QK, isum)
                dx = xd[s, b]
                a = acc[s]
                for r in range(TR):
                    a[r] += (dx * scale[r]) * np.float32(isum[r])
        tiles.store_rows(acc, out, t)


# --------------------------------------------------------------------------------------------
# the type: adapters (x, w, out), their NumPy twins (x, w) -> [S, n_out], the declaration


def gemv_mxfp4(x, w, out):
    _gemv_mxfp4(x, w.qs, w.d, out)


def gemv_mxfp4_twin(x, w):
    return gemv_mxfp4_np(x, w.qs, w.d)[:, :w.n_out]


def tiled_mxfp4(x, w, out):
    _tiled_mxfp4(x, w.qs, w.d, out)


def act8_mxfp4(x, w, out):
    _matmul_mxfp4_q8(x, w.qs, w.d, out)


def act8_mxfp4_twin(x, w):
    return act8_mxfp4_np(x, w.qs, w.d)[:, :w.n_out]


MXFP4 = declare(QuantType(
    _T.MXFP4, BlockFormat(weights=QK, file_bytes=17, packed_bytes=16, copy=(1, 0, 16), d_off=0, scale="e8m0"),
    dequant_np=dequant_mxfp4_np,
    kernels={"f32": (Kernel(gemv_mxfp4, gemv_mxfp4_twin), Kernel(tiled_mxfp4, matmul_ref)),
             "q8": (Kernel(act8_mxfp4, act8_mxfp4_twin), Kernel(act8_mxfp4, act8_mxfp4_twin))},
    q8_bytes=(0, 16), **for_type(_T.MXFP4)))
