"""F32, F16 and BF16 weights: packing into row tiles and the matmul kernels.

Packed layout (T = ceil(n_out / TR) tiles; padded rows are zero)::

    F32         qs float32 [T, n_in, TR]
    F16, BF16   qs uint16  [T, n_in, TR]    raw bits, widened through a 65,536-entry table
                                            (:data:`llamatrace.machine.jit.F16_TABLE`, ``BF16_TABLE``)

Resident bytes: 1.0x the file (plus row padding to a multiple of ``TR``). Each tile is widened
to float32 a chunk at a time and multiplied in float32 (:func:`llamatrace.kernels.tile_gemm.chunk_matmul`),
for any number of rows of x: decode and prefill share the kernel. NumPy twins: the dequantizers
(``dequant_*_np``) and :func:`tiled_np`. The types are declared at the end (:data:`F32`,
:data:`F16`, :data:`BF16`; no block format, no ``q8``-mode kernels).
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import njit, prange

from llamatrace.kernels import tile_gemm, tiles
from llamatrace.kernels.types.registry import TYPES, Kernel, QuantType, declare
from llamatrace.machine.jit import BF16_TABLE, F16_TABLE, JIT, JIT_INLINE, JIT_PARALLEL
from llamatrace.machine.threads import crowded

_T = gguf.GGMLQuantizationType
TR = tiles.TR

ITEM_BYTES = {_T.F32: 4, _T.F16: 2, _T.BF16: 2}
"""Bytes per weight in the file."""


def tile_floats(ggml_type, raw: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """``raw`` float32 / float16 ``[n_out, n_in]`` (or BF16's uint8 ``[n_out, 2*n_in]``: any
    array of ``n_out * n_in * ITEM_BYTES`` bytes) -> ``qs`` ``[T, n_in, TR]`` (float32 for F32,
    the uint16 bits otherwise)."""
    flat = np.ascontiguousarray(raw).view(np.float32 if ggml_type == _T.F32 else np.uint16)
    n_tiles = -(-n_out // TR)
    rows = flat.reshape(n_out, n_in)
    if n_tiles * TR > n_out:
        rows = np.concatenate([rows, np.zeros((n_tiles * TR - n_out, n_in), dtype=rows.dtype)])
    # [n_out, n_in] -> [T, TR, n_in] -> [T, n_in, TR]
    return np.ascontiguousarray(rows.reshape(n_tiles, TR, n_in).transpose(0, 2, 1))


def dequant_f32_np(v: np.ndarray, d: None = None, m: None = None) -> np.ndarray:
    """Rows of a packed F32 weight, ``v`` float32 ``[n, n_in]`` (``qs[t, :, r]``) -> a float32 copy."""
    return v.copy()


def dequant_f16_np(v: np.ndarray, d: None = None, m: None = None) -> np.ndarray:
    """Rows of a packed F16 weight, ``v`` uint16 bits ``[n, n_in]`` -> float32; NumPy twin of the
    kernels' widening."""
    return F16_TABLE[v]


def dequant_bf16_np(v: np.ndarray, d: None = None, m: None = None) -> np.ndarray:
    """As :func:`dequant_f16_np` for BF16 bits."""
    return BF16_TABLE[v]


def tiled_np(x: np.ndarray, w) -> np.ndarray:
    """NumPy twin of the three kernels: ``x @ W.T`` summed in float64, W the type's dequantizer
    of the packed rows; float32 ``[S, n_out]``."""
    rows = w.qs.transpose(0, 2, 1).reshape(-1, w.n_in)[:w.n_out]            # [n_out, n_in]
    W = TYPES[w.ggml_type].dequant_np(rows, None, None).astype(np.float64)
    return (np.asarray(x, np.float64) @ W.T).astype(np.float32)


@njit(**JIT_INLINE)
def _dequant_rows_u16(qs, table, t, k0, n, wt):
    """Inputs k0 .. k0+n-1 of tile t of F16 / BF16 bits [T, n_in, TR] -> wt float32 [n, TR]
    through ``table``."""
    for k in range(n):
        for r in range(TR):
            wt[k, r] = table[qs[t, k0 + k, r]]


@njit(**JIT_PARALLEL)
def _tiled_u16(x, qs, table, out):
    """F16 / BF16 matmul: qs uint16 [T, n_in, TR], table float32 [65536]."""
    n_tiles, n_in = qs.shape[0], x.shape[1]
    kc = tiles.CHUNK
    for t in prange(n_tiles):
        wt = np.empty((kc, TR), np.float32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for k0 in range(0, n_in, kc):
            n = min(kc, n_in - k0)
            _dequant_rows_u16(qs, table, t, k0, n, wt)
            tile_gemm.chunk_matmul(x, wt, k0, n, acc)
        tiles.store_rows(acc, out, t)


@njit(**JIT_INLINE)
def _f32_tile(x, qs, out, t):
    acc = np.zeros((x.shape[0], TR), np.float32)
    tile_gemm.chunk_matmul(x, qs[t], 0, qs.shape[1], acc)
    tiles.store_rows(acc, out, t)


@njit(**JIT_PARALLEL)
def _tiled_f32(x, qs, out):
    """F32 matmul: qs float32 [T, n_in, TR] is already a stack of tiles."""
    for t in prange(qs.shape[0]):
        _f32_tile(x, qs, out, t)


@njit(**JIT)
def _tiled_f32_serial(x, qs, out):
    """:func:`_tiled_f32` on the calling thread, tile after tile (the same bits)."""
    for t in range(qs.shape[0]):
        _f32_tile(x, qs, out, t)


SERIAL_WORK = 1 << 18
"""Multiply-adds up to which an F32 product runs serial on a crowded machine
(:func:`~llamatrace.machine.threads.crowded`): a mixture's router of one row (128 x 2048, ~20-90
µs) is short, and a region waits for a thread another process holds for a time slice.
Qwen3-30B-A3B's shape (8 layers), 2 threads, load ~2, decode steps with the big matmuls stubbed:
the router 5.3 -> 0.44 ms a step; quiet, the two threads read its 1 MB faster."""


# --------------------------------------------------------------------------------------------
# the types: adapters (x, w, out) and the declarations; one kernel serves decode and prefill


def tiled_f32(x, w, out):
    serial = x.shape[0] * w.qs.size <= SERIAL_WORK and crowded()
    (_tiled_f32_serial if serial else _tiled_f32)(x, w.qs, out)


def tiled_f16(x, w, out):
    _tiled_u16(x, w.qs, F16_TABLE, out)


def tiled_bf16(x, w, out):
    _tiled_u16(x, w.qs, BF16_TABLE, out)


F32 = declare(QuantType(_T.F32, None, dequant_np=dequant_f32_np,
                        kernels={"f32": (Kernel(tiled_f32, tiled_np),) * 2}))
F16 = declare(QuantType(_T.F16, None, dequant_np=dequant_f16_np,
                        kernels={"f32": (Kernel(tiled_f16, tiled_np),) * 2}))
BF16 = declare(QuantType(_T.BF16, None, dequant_np=dequant_bf16_np,
                         kernels={"f32": (Kernel(tiled_bf16, tiled_np),) * 2}))
