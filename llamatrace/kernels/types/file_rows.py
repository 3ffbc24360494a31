"""A few rows of a GGUF tensor, dequantized from the file's own blocks in Numba (an untied
embedding's lookup, :func:`llamatrace.kernels.types.packing.get_rows`).

gguf-py's ``gguf.quants.dequantize`` of one 2048-wide Q4_K row costs ~120 µs, nearly all of it
NumPy calls on 8 blocks; here it is ~2 µs, once a decode step. The arithmetic is gguf-py's,
operation for operation in float32 (no FMA, no reordering: :data:`~llamatrace.machine.jit.JIT_EXACT`),
so the values are the same bits; ``gguf.quants.dequantize`` is the NumPy twin the tests hold them
against. Block layouts (bytes)::

    Q8_0  d fp16 (2) | qs int8 [32]                                  x = qs * d
    Q4_K  d fp16 (2) | dmin fp16 (2) | scales (12) | qs nibbles [128]  x = (d*sc) * q - (dmin*m)
    Q6_K  ql nibbles [128] | qh 2-bit [64] | scales int8 [16] | d fp16 (2)  x = (d*scale) * (q - 32)

Q4_K's 6-bit ``sc`` / ``m`` of sub-block j (of 32 weights): j < 4, the low 6 bits of bytes j and
4+j; j >= 4, byte 8+j-4's low (sc) or high (m) nibble and the top 2 bits of byte j-4 (sc) or
j (m). Q4_K's nibbles: 32-byte group g holds sub-block 2g (low) and 2g+1 (high); Q6_K's weight
p takes ql's byte 64·(p // 128) + p % 64 (nibble (p // 64) % 2) and qh's byte 32·(p // 128) +
p % 32 (bits 2·((p // 32) % 4)).
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import njit

from llamatrace.machine.jit import F16_TABLE, JIT_EXACT

_T = gguf.GGMLQuantizationType


@njit(**JIT_EXACT)
def _q8_0(blocks, table, out):
    for b in range(blocks.shape[0]):
        d = table[blocks[b, 0] | (np.uint16(blocks[b, 1]) << 8)]
        for i in range(32):
            out[b * 32 + i] = np.float32(np.int8(blocks[b, 2 + i])) * d


@njit(**JIT_EXACT)
def _q4_k(blocks, table, out):
    for b in range(blocks.shape[0]):
        blk = blocks[b]
        d = table[blk[0] | (np.uint16(blk[1]) << 8)]
        dmin = table[blk[2] | (np.uint16(blk[3]) << 8)]
        s = blk[4:16]
        for j in range(8):
            if j < 4:
                sc, m = s[j] & 0x3F, s[4 + j] & 0x3F
            else:
                sc = (s[4 + j] & 0x0F) | ((s[j - 4] >> 2) & 0x30)
                m = (s[4 + j] >> 4) | ((s[j] >> 2) & 0x30)
            scale = d * np.float32(sc)
            shift = dmin * np.float32(m)
            for i in range(32):
                q = (blk[16 + (j // 2) * 32 + i] >> (4 * (j % 2))) & 0x0F
                out[b * 256 + j * 32 + i] = scale * np.float32(q) - shift


@njit(**JIT_EXACT)
def _q6_k(blocks, table, out):
    for b in range(blocks.shape[0]):
        blk = blocks[b]
        d = table[blk[208] | (np.uint16(blk[209]) << 8)]
        for p in range(256):
            half, k = p // 128, p % 128
            lo = (blk[64 * half + k % 64] >> (4 * (k // 64))) & 0x0F
            hi = (blk[128 + 32 * half + k % 32] >> (2 * (k // 32))) & 0x03
            q = np.int8(lo | (hi << 4)) - np.int8(32)
            scale = d * np.float32(np.int8(blk[192 + p // 16]))
            out[b * 256 + p] = scale * np.float32(q)


_KERNELS = {_T.Q8_0: _q8_0, _T.Q4_K: _q4_k, _T.Q6_K: _q6_k}
TYPES = frozenset(_KERNELS)
"""The types :func:`dequantize_rows` runs (others: ``gguf.quants.dequantize``)."""


def dequantize_rows(rows: np.ndarray, ggml_type) -> np.ndarray:
    """float32 ``[n_rows, n_in]``: ``rows``, uint8 ``[n_rows, row_bytes]`` of a tensor of one of
    :data:`TYPES` as the file stores them, dequantized as ``gguf.quants.dequantize`` does, bit for bit.

    Raises:
        ValueError: another type, or ``row_bytes`` not a whole number of blocks.
    """
    qtype = _T(ggml_type)
    if qtype not in _KERNELS:
        raise ValueError(f"file_rows: no Numba dequantizer for {qtype.name}")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    if rows.ndim != 2 or rows.shape[1] % size:
        raise ValueError(f"file_rows: rows {list(rows.shape)} must be [n_rows, k * {size}] ({qtype.name} blocks)")
    n_blocks = rows.shape[1] // size
    out = np.empty(rows.shape[0] * n_blocks * block, dtype=np.float32)
    _KERNELS[qtype](rows.reshape(-1, size), F16_TABLE, out)
    return out.reshape(rows.shape[0], n_blocks * block)
