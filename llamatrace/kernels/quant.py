"""Weight storage and matmul kernels that compute directly on GGUF quantized blocks.

A :class:`Weight` is one ``[n_out, n_in]`` matrix (torch/Meta ``out_features x in_features``
order) repacked once at load time into *row tiles*: ``TR`` consecutive output rows are
interleaved so that the innermost loop of every kernel runs over ``TR`` rows and compiles to
512-bit vector instructions (``vfmadd…ps %zmm``). There is no float32 copy of the model: the
quantized bytes stay as they are in the file, only the float16 scales become float32 (Numba
has no float16; the ``q8`` mode's kernels keep them as fp16 bits, :mod:`llamatrace.kernels.act8`).

GGUF block layouts (per 32 weights of one row, as in gguf-py ``quants.py``)::

    Q4_0  18 bytes  | d f16 | qs[16] |                 w[j] = d * (lo(qs[j]) - 8)
    Q4_1  20 bytes  | d f16 | m f16 | qs[16] |         w[j] = d * lo(qs[j]) + m
    Q8_0  34 bytes  | d f16 | q int8[32] |             w[j] = d * q[j]
    (Q4_x: qs[j] holds element j in its low nibble and element j + 16 in its high nibble,
     so w[j + 16] uses hi(qs[j]) = qs[j] >> 4.)

Packed layout (T = ceil(n_out / TR) tiles, B = n_in / 32 blocks; padded rows are zero)::

    Q4_0, Q4_1  qs uint8   [T, B, 16, TR]   qs[t, b, j, r] = byte j of block b of row t*TR + r
                d  float32 [T, B, TR]       m float32 [T, B, TR] (Q4_1 only)
    Q8_0        qs int8    [T, B, 32, TR]   d float32 [T, B, TR]
    F32         qs float32 [T, n_in, TR]
    F16, BF16   qs uint16  [T, n_in, TR]    raw bits, widened through a 65,536-entry table

Resident bytes against the file: Q4_1 24/20 = 1.2x, Q4_0 20/18 = 1.11x, Q8_0 36/34 = 1.06x
(1.0x for all three in the ``q8`` mode),
float types 1.0x (plus row padding to a multiple of ``TR``). The K-quants and Q5_0/Q5_1 live
in :mod:`llamatrace.kernels.k_quants` (same tiles, <= 1.06x for the K-quants).

Arithmetic is float32 activations times dequantized weights with float32 accumulation
(about 1e-7 relative to ``x @ gguf.quants.dequantize(raw).T``); activations are never
quantized. Each Numba kernel has a plain NumPy twin (``*_np``) that tests compare it with.

Threads: one ``prange`` region per :func:`matmul` call, so callers fuse matrices
(:func:`pack_concat`). llamatrace asks Numba for its threading layers in the order omp, tbb,
workqueue: a region costs ~4-5 us with ``omp`` (libgomp), ~9 us with ``tbb`` (``pip install
tbb``) and 54-100 us with ``workqueue``, which turns a ~6 ms decode step of SmolLM2 into
~40 ms. All three give the same results. OpenMP's spinning threads slow down badly when another
process keeps a core busy; :class:`AutoThreads` then drops to one thread.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import gguf
import numba
import numpy as np
from numba import njit, prange

from llamatrace.kernels import act8
from llamatrace.kernels import k_quants as kquants
from llamatrace.kernels import tiles
from llamatrace.errors import OptionError, UnsupportedModelError

_T = gguf.GGMLQuantizationType

SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, *kquants.KQUANT_TYPES}
)

TR = tiles.TR
"""Rows per tile: the vector width of the inner loops (2 zmm registers of float32)."""

QK = 32
"""Weights per quantization block (Q4_0, Q4_1, Q8_0)."""

GEMV_MAX_SEQ = 4
"""Up to this many rows of ``x`` use the GEMV kernels (weights decoded in registers, once per
row); more rows use the tiled kernels (each tile dequantized once, reused by every row)."""

_QUANTIZED = frozenset({_T.Q4_0, _T.Q4_1, _T.Q8_0})
_BLOCK_BYTES = {_T.Q4_0: 18, _T.Q4_1: 20, _T.Q8_0: 34}

# LLVM flags for the kernels. Not fastmath=True: that adds nnan/ninf, which lets LLVM delete
# NaN/Inf handling the tracer relies on. Not 'reassoc' either: the kernels write their sums as
# explicit trees so several FMA chains run in parallel; 'reassoc' lets LLVM fold such a tree
# back into one serial chain (latency-bound).
_FASTMATH = {"contract", "arcp", "afn", "nsz"}  # a set: Numba rejects frozenset
_JIT = dict(cache=True, fastmath=_FASTMATH)
_JIT_PARALLEL = dict(parallel=True, **_JIT)
_JIT_INLINE = dict(inline="always", **_JIT)

# float16 / bfloat16 bit patterns -> float32, indexed by the raw uint16.
_F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_BF16_TABLE = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
_F16_BITS = np.arange(65536, dtype=np.uint32).astype(np.uint16)   # the bits kept as they are
_EMPTY_SCALES = np.zeros((0, 0, TR), dtype=np.float32)


@dataclass(frozen=True, eq=False)
class Weight:
    """One ``[n_out, n_in]`` matrix in row-tile layout (see the module docstring).

    ``qs`` holds the packed weights (uint8 / int8 / uint16 / float32 by type), ``d`` and ``m``
    the float32 block scales and minimums (empty where the type has none). ``act8``: packed for
    8-bit activations (:mod:`llamatrace.kernels.act8`'s layout and kernels; ``d`` and ``m`` are then the
    file's fp16 bits, uint16). ``row_splits``
    gives the row counts of the matrices fused by :func:`pack_concat` (``(n_out,)`` otherwise),
    so a caller can ``np.split(y, np.cumsum(w.row_splits)[:-1], axis=1)``.
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    n_out: int
    n_in: int
    qs: np.ndarray
    d: np.ndarray
    m: np.ndarray
    row_splits: tuple[int, ...]
    act8: bool = False

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed arrays."""
        return int(self.qs.nbytes + self.d.nbytes + self.m.nbytes)

    @property
    def n_tiles(self) -> int:
        return int(self.qs.shape[0])

    def __repr__(self) -> str:
        return (f"Weight({self.name!r}, {self.ggml_type.name}, n_out={self.n_out}, "
                f"n_in={self.n_in}, nbytes={self.nbytes})")


# --------------------------------------------------------------------------------------------
# packing


class Arena:
    """Bump allocator for packed weights: a model's arrays side by side, in load order, in
    chunks of ``chunk_bytes`` of fresh anonymous memory (:func:`_pages`), so hundreds of small
    per-layer arrays cost a handful of mappings and sit next to each other as a decode step
    streams them. Arrays over half a chunk get a mapping of their own. Views into a chunk keep
    it alive.
    """

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk = np.empty(0, dtype=np.uint8)
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised C-contiguous array, 64-byte aligned (a cache line)."""
        dtype = np.dtype(dtype)
        n_bytes = int(np.prod(shape)) * dtype.itemsize
        if n_bytes > self.chunk_bytes // 2:
            chunk, start = _pages(n_bytes + 64), 0
        else:
            chunk, start = self._chunk, self._used
            if start + 63 + n_bytes > chunk.size:
                chunk = self._chunk = _pages(self.chunk_bytes)
                start = 0
            self._used = start + (-(chunk.ctypes.data + start) % 64) + n_bytes
        start += -(chunk.ctypes.data + start) % 64
        return chunk[start:start + n_bytes].view(dtype).reshape(shape)


def _pages(n_bytes: int) -> np.ndarray:
    """uint8 ``[n_bytes]`` of fresh private anonymous memory on the kernel's 4 KiB pages.

    NumPy asks for transparent huge pages from 4 MiB (``madvise``), and where the kernel
    compacts memory to find 2 MiB at fault time (``defrag`` = ``madvise``, as in this project's
    VMs) the first touch of those pages cost ~4 s per GiB against ~0.7 for small pages: the
    8B-shaped Q4_K_M file loaded in 15-16 s instead of 8-12 (separate processes, alternated).
    Decode did not notice (paired, one process: 0.99-1.01 at 8B and on SmolLM2)."""
    pages = mmap.mmap(-1, max(n_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype=np.uint8)


def _zero_last_tile(n_rows: int, qs_t: np.ndarray, d_t: np.ndarray, m_t: np.ndarray) -> None:
    """Zero the last tile when ``n_rows`` leaves padding rows in it; the packers then write
    every byte of the real rows (wherever the layout puts them), so the padding stays zero."""
    if n_rows % TR:
        qs_t[-1] = 0
        d_t[-1] = 0
        if m_t.size:
            m_t[-1] = 0


def _unsupported(name: str, ggml_type) -> UnsupportedModelError:
    type_name = getattr(ggml_type, "name", str(ggml_type))
    supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
    return UnsupportedModelError(
        f"tensor {name!r} has type {type_name}, which llamatrace cannot compute with "
        f"(supported: {supported})"
    )


def _tile_rows(a: np.ndarray, n_out: int) -> np.ndarray:
    """[n_out, ...] -> [T, TR, ...], zero rows appended up to a multiple of TR."""
    n_tiles = -(-n_out // TR)
    pad = n_tiles * TR - n_out
    if pad:
        a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], dtype=a.dtype)])
    return a.reshape((n_tiles, TR) + a.shape[1:])


_QUANT_BYTES = {_T.Q4_0: 16, _T.Q4_1: 16, _T.Q8_0: 32}   # per block: the quants after d (and m)


def _block_sizes(ggml_type) -> tuple[int, int, int, bool]:
    """(weights, file bytes, packed quant bytes) per block and whether it has a minimum."""
    if ggml_type in _QUANTIZED:
        return QK, _BLOCK_BYTES[ggml_type], _QUANT_BYTES[ggml_type], ggml_type == _T.Q4_1
    return (kquants.BLOCK_WEIGHTS[ggml_type], kquants.FILE_BYTES[ggml_type], kquants.PACKED_BYTES[ggml_type],
            ggml_type in kquants.HAS_MIN)


def _pack_blocks(name: str, ggml_type, parts: list[tuple[np.ndarray, int]], n_in: int, arena: Arena,
                 group: tuple[int, int]):
    """Row tiles (qs, d, m) of the stacked rows of ``parts`` = [(raw, n_out)] of a block type
    (Q4_0/Q4_1/Q8_0 as in this module's docstring, the others as in :mod:`llamatrace.kernels.k_quants`),
    written in place by :func:`kquants.repack_tiles`: no concatenated or transposed temporary,
    so a load holds the file's pages and the packed copy, nothing more; quant bytes ``group`` in
    8-bit activations' order (:func:`_group`). Raises ``ValueError`` on a size mismatch."""
    qkb, block_bytes, packed_bytes, has_min = _block_sizes(ggml_type)
    if n_in % qkb:
        raise ValueError(f"tensor {name!r} ({ggml_type.name}): n_in={n_in} is not a multiple of {qkb}")
    n_blocks = n_in // qkb
    n_rows = sum(int(n) for _, n in parts)
    n_tiles = -(-n_rows // TR)
    # 8-bit activations' kernels widen fp16 scales as they read them (act8._f16): decode
    # streams 18 bytes per Q4_0 block instead of 20, as the file has them.
    scale_type, table = (np.uint16, _F16_BITS) if group != (0, 0) else (np.float32, _F16_TABLE)
    qs_t = arena.empty((n_tiles, n_blocks, packed_bytes, TR), np.uint8)
    d_t = arena.empty((n_tiles, n_blocks, TR), scale_type)
    m_t = arena.empty((n_tiles, n_blocks, TR), scale_type) if has_min else _EMPTY_SCALES
    _zero_last_tile(n_rows, qs_t, d_t, m_t)
    row0 = 0
    for raw, n_out in parts:
        raw = np.asarray(raw)
        if raw.nbytes != n_out * n_blocks * block_bytes:
            raise ValueError(f"tensor {name!r} ({ggml_type.name} [{n_out}, {n_in}]): expected "
                             f"{n_out * n_blocks * block_bytes} bytes, got {raw.nbytes}")
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, n_blocks, block_bytes)
        kquants.repack_tiles(ggml_type, blocks, row0, table, qs_t, d_t, m_t, group)
        row0 += n_out
    return (qs_t.view(np.int8) if ggml_type == _T.Q8_0 else qs_t), d_t, m_t


def check_activations(activations: str) -> str:
    """``activations`` if it is a mode this machine runs (:data:`llamatrace.kernels.act8.MODES`), else
    :class:`OptionError`."""
    if activations not in act8.MODES:
        raise OptionError(f"activations must be one of {', '.join(act8.MODES)}, got {activations!r}")
    if activations == "q8" and not act8.available():
        raise OptionError("activations q8 needs a CPU with AVX2, which this one lacks; use f32")
    return activations


def _group(ggml_type, activations: str) -> tuple[int, int]:
    """The packed bytes ``(head, end)`` of a block row that :mod:`llamatrace.kernels.act8`'s kernels
    read in groups of four (``(0, 0)``: none, the float32 path's layout)."""
    if activations != "q8" or ggml_type not in act8.TYPES:
        return (0, 0)
    return act8.grouped_bytes(ggml_type)


def pack(name: str, ggml_type, raw: np.ndarray, n_out: int, n_in: int, *, activations: str = "f32",
         arena: Arena | None = None) -> Weight:
    """Repack one GGUF tensor into row tiles.

    ``raw`` is a GGUF tensor's ``.data`` (gguf_io.Tensor or gguf-py ReaderTensor): uint8 ``[n_out, row_bytes]`` for the
    quantized types and BF16, float32 / float16 ``[n_out, n_in]`` for F32 / F16 (any array of
    the right size and dtype is accepted). ``activations`` ``"q8"`` packs the types in
    :data:`llamatrace.kernels.act8.TYPES` for its 8-bit-activation kernels (other types are unaffected).
    Raises :class:`UnsupportedModelError` for a type not in :data:`SUPPORTED_TYPES`,
    ``ValueError`` if ``n_in`` is not a multiple of the block size or ``raw`` has the wrong
    size, and :class:`OptionError` for an unknown ``activations``. The quantized types' arrays
    come from ``arena`` when given (a model's loader passes one for all its weights).
    """
    check_activations(activations)
    arena = arena if arena is not None else Arena(0)
    try:
        ggml_type = _T(ggml_type)
    except ValueError:
        raise _unsupported(name, ggml_type) from None
    if ggml_type not in SUPPORTED_TYPES:
        raise _unsupported(name, ggml_type)
    n_out, n_in = int(n_out), int(n_in)
    if n_out < 1 or n_in < 1:
        raise ValueError(f"tensor {name!r}: empty shape [{n_out}, {n_in}]")
    raw = np.asarray(raw)

    group = _group(ggml_type, activations)
    if ggml_type in _QUANTIZED or ggml_type in kquants.KIND:
        qs_t, d_t, m_t = _pack_blocks(name, ggml_type, [(raw, n_out)], n_in, arena, group)
    else:
        if raw.nbytes != n_out * n_in * (4 if ggml_type == _T.F32 else 2):
            raise ValueError(f"tensor {name!r} ({ggml_type.name} [{n_out}, {n_in}]): "
                             f"got {raw.nbytes} bytes")
        flat = np.ascontiguousarray(raw).view(np.float32 if ggml_type == _T.F32 else np.uint16)
        # [n_out, n_in] -> [T, TR, n_in] -> [T, n_in, TR]
        qs_t = np.ascontiguousarray(_tile_rows(flat.reshape(n_out, n_in), n_out).transpose(0, 2, 1))
        d_t = m_t = _EMPTY_SCALES
    return Weight(name, ggml_type, n_out, n_in, qs_t, d_t, m_t, (n_out,), group != (0, 0))


def pack_concat(name: str, parts: list[tuple], *, activations: str = "f32", arena: Arena | None = None) -> Weight:
    """Stack the rows of several ``(ggml_type, raw, n_out, n_in)`` matrices into one Weight.

    Used to fuse wq/wk/wv and w1/w3 so that one parallel region computes them all; split the
    result with ``row_splits``. Raises ``ValueError`` if the parts differ in type or ``n_in``
    or a part has the wrong size (the caller then packs them separately), and what
    :func:`pack` raises. ``activations`` and ``arena`` as in :func:`pack`.
    """
    check_activations(activations)
    arena = arena if arena is not None else Arena(0)
    if not parts:
        raise ValueError(f"pack_concat({name!r}): no parts")
    ggml_type, n_in = parts[0][0], int(parts[0][3])
    for typ, raw, n_out, part_n_in in parts:
        if typ != ggml_type or int(part_n_in) != n_in:
            raise ValueError(f"pack_concat({name!r}): parts differ in type or n_in "
                             f"({getattr(typ, 'name', typ)} [{n_out}, {part_n_in}] vs "
                             f"{getattr(ggml_type, 'name', ggml_type)} [.., {n_in}]); pack them separately")
        if np.asarray(raw).size == 0 or np.asarray(raw).nbytes % int(n_out):
            raise ValueError(f"pack_concat({name!r}): a part [{n_out}, {n_in}] has "
                             f"{np.asarray(raw).nbytes} bytes")
    splits = tuple(int(p[2]) for p in parts)
    if _T(ggml_type) in _QUANTIZED or _T(ggml_type) in kquants.KIND:
        group = _group(_T(ggml_type), activations)
        qs_t, d_t, m_t = _pack_blocks(name, _T(ggml_type), [(raw, n_out) for _, raw, n_out, _ in parts], n_in,
                                      arena, group)
        return Weight(name, _T(ggml_type), sum(splits), n_in, qs_t, d_t, m_t, splits, group != (0, 0))
    rows = [np.ascontiguousarray(raw).view(np.uint8).reshape(int(n_out), -1) for _, raw, n_out, _ in parts]
    row_bytes = {r.shape[1] for r in rows}
    if len(row_bytes) != 1:
        raise ValueError(f"pack_concat({name!r}): parts have different row sizes {sorted(row_bytes)}")
    w = pack(name, ggml_type, np.concatenate(rows, axis=0), sum(splits), n_in, activations=activations, arena=arena)
    return Weight(w.name, w.ggml_type, w.n_out, w.n_in, w.qs, w.d, w.m, splits, w.act8)


# --------------------------------------------------------------------------------------------
# NumPy reference twins


def _dequant_rows_np(w: Weight, rows: np.ndarray) -> np.ndarray:
    """Dequantize the given rows (int array [n]) -> float32 [n, n_in], plain NumPy.

    Follows gguf-py's arithmetic (d * q, d * q + m, d * (q - 8)) so results are bit-for-bit
    equal to ``gguf.quants.dequantize``.
    """
    typ = w.ggml_type
    t, r = rows // TR, rows % TR
    n = len(rows)
    if typ in kquants.KIND or typ in _QUANTIZED:
        q = act8.file_order_rows(typ, w.qs, t, r) if w.act8 else w.qs[t, :, :, r]   # [n, B, P]
        db, mb = w.d[t, :, r], (w.m[t, :, r] if w.m.size else None)                 # [n, B]
        if w.act8:                                               # fp16 bits
            db, mb = act8.f16_np(db), (act8.f16_np(mb) if mb is not None else None)
    if typ in kquants.KIND:
        return kquants.dequant_bytes_np(typ, q, db, mb)
    if typ in _QUANTIZED:
        d = db[:, :, None]                                       # [n, B, 1]
        if typ == _T.Q8_0:
            return (d * q.astype(np.float32)).reshape(n, w.n_in)
        q32 = np.concatenate([q & 0x0F, q >> 4], axis=2)          # [n, B, 32]: lo nibbles, then hi
        if typ == _T.Q4_1:
            return (d * q32.astype(np.float32) + mb[:, :, None]).reshape(n, w.n_in)
        return (d * (q32.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(n, w.n_in)
    v = w.qs[t, :, r]                                            # [n, n_in]
    if typ == _T.F32:
        return v.copy()
    return (_F16_TABLE if typ == _T.F16 else _BF16_TABLE)[v]


def dequantize(w: Weight) -> np.ndarray:
    """float32 ``[n_out, n_in]``, plain NumPy; bit-for-bit ``gguf.quants.dequantize`` of the file's data."""
    return _dequant_rows_np(w, np.arange(w.n_out))


def get_rows(w: Weight, ids: np.ndarray) -> np.ndarray:
    """Embedding lookup: float32 ``[len(ids), n_in]``, the dequantized rows ``ids`` of ``w``.

    Raises ``IndexError`` if an id is outside ``[0, n_out)``.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.n_out):
        raise IndexError(f"{w.name}: row ids must be in [0, {w.n_out}), got {ids.min()}..{ids.max()}")
    return _dequant_rows_np(w, ids)


def matmul_ref(x: np.ndarray, w: Weight) -> np.ndarray:
    """Plain NumPy twin of :func:`matmul`: ``x @ dequantize(w).T`` (float32)."""
    return (np.asarray(x, dtype=np.float32) @ dequantize(w).T).astype(np.float32)


def _gemv_q4_np(x: np.ndarray, qs, d, m, m_scale) -> np.ndarray:
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


def _gemv_q8_np(x: np.ndarray, qs, d) -> np.ndarray:
    """NumPy twin of :func:`_gemv_q8`: per block d*(x.q). Returns float32 [S, T*TR]."""
    n_seq, n_blocks = x.shape[0], qs.shape[1]
    xb = x.reshape(n_seq, n_blocks, 32).astype(np.float64)
    y = (d * np.einsum("sbj,tbjr->stbr", xb, qs.astype(np.float64))).sum(axis=2)
    return y.reshape(n_seq, -1).astype(np.float32)


def _dequant_tile_np(w: Weight, t: int) -> np.ndarray:
    """NumPy twin of the Numba tile dequantizers: float32 [n_in, TR], rows t*TR.. as columns."""
    return _dequant_rows_np(w, np.arange(t * TR, (t + 1) * TR)).T.copy()


# --------------------------------------------------------------------------------------------
# Numba kernels
#
# Loop indices in hot loops start at 0 (range(n)) so LLVM knows they are non-negative; a
# signed index of unknown sign makes Numba emit wraparound selects and LLVM falls back to
# byte gathers. A block's sum is four independent FMA chains added at the end, so several
# chains are in flight instead of one 32-long dependency chain (a plain tree of products
# costs an extra add per product; measured ~15% slower).


@njit(**_JIT_INLINE)
def _q4_fma(acc, q, xl, xc):
    """acc + x[j]*lo + x[j+16]*hi for one byte q = lo | hi << 4, given xc = x[j+16] - 16*x[j].

    Since lo = q - 16*hi this is acc + xl*q + xc*hi: two FMAs, and the nibbles are split in
    float arithmetic (cvt, mul, floor) on 16 lanes, because Numba widens integer ops to int64.
    """
    qf = np.float32(q)
    return acc + xl * qf + xc * np.floor(qf * np.float32(0.0625))


@njit(**_JIT_INLINE)
def _q4_chain4(q, r, xl, xc, j):
    acc = np.float32(0.0)
    acc = _q4_fma(acc, q[j, r], xl[j], xc[j])
    acc = _q4_fma(acc, q[j + 1, r], xl[j + 1], xc[j + 1])
    acc = _q4_fma(acc, q[j + 2, r], xl[j + 2], xc[j + 2])
    return _q4_fma(acc, q[j + 3, r], xl[j + 3], xc[j + 3])


@njit(**_JIT_INLINE)
def _q4_half_dot(q, r, xl, xc, j):
    """sum over bytes j..j+7 of one block q uint8 [16, TR], column r: two 4-FMA chains.

    A block is done in two halves (bytes 0-7, then 8-15, each over all TR rows) so that one
    half's 16 broadcast activations stay in registers; the whole block's 32 spilled (~13%
    slower at 8B shapes). (c0 + c1) + (c2 + c3) is the sum order of a whole-block dot.
    """
    return _q4_chain4(q, r, xl, xc, j) + _q4_chain4(q, r, xl, xc, j + 4)


@njit(**_JIT_INLINE)
def _i8_chain8(q, r, x, j):
    acc = np.float32(0.0)
    for i in range(8):  # constant trip count: fully unrolled by LLVM
        acc += x[j + i] * np.float32(q[j + i, r])
    return acc


@njit(**_JIT_INLINE)
def _i8_half_dot(q, r, x, j):
    """sum over j..j+15 of x[j] * q[j, r] for one Q8_0 block q int8 [32, TR]: two 8-FMA chains
    (a block in two halves, as in :func:`_q4_half_dot`)."""
    return _i8_chain8(q, r, x, j) + _i8_chain8(q, r, x, j + 8)


@njit(**_JIT_PARALLEL)
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


@njit(**_JIT_PARALLEL)
def _gemv_q8(x, qs, d, out):
    """Q8_0 GEMV for a few rows. x float32 [S, B*32]; qs int8 [T, B, 32, TR]; d float32
    [T, B, TR]; out float32 [S, n_out]."""
    n_seq = x.shape[0]
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    for t in prange(n_tiles):
        acc = np.empty(TR, np.float32)
        half = np.empty(TR, np.float32)
        for s in range(n_seq):
            acc[:] = 0.0
            for b in range(n_blocks):
                q = qs[t, b]
                db = d[t, b]
                xb = x[s, b * 32:b * 32 + 32]
                for r in range(TR):
                    half[r] = _i8_half_dot(q, r, xb, 0)
                for r in range(TR):
                    acc[r] += db[r] * (half[r] + _i8_half_dot(q, r, xb, 16))
            tiles.store_tile(acc, out, s, t)


@njit(**_JIT_INLINE)
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


@njit(**_JIT_INLINE)
def _dequant_blocks_q8(qs, d, t, b0, n, wt):
    """Blocks b0 .. b0+n-1 of tile t of Q8_0 -> wt float32 [n*32, TR]."""
    for i in range(n):
        q = qs[t, b0 + i]
        db = d[t, b0 + i]
        for j in range(32):
            row = wt[i * 32 + j]
            for r in range(TR):
                row[r] = db[r] * np.float32(q[j, r])


@njit(**_JIT_INLINE)
def _dequant_rows_u16(qs, table, t, k0, n, wt):
    """Inputs k0 .. k0+n-1 of tile t of F16 / BF16 bits [T, n_in, TR] -> wt float32 [n, TR]
    through ``table``."""
    for k in range(n):
        for r in range(TR):
            wt[k, r] = table[qs[t, k0 + k, r]]


@njit(**_JIT_PARALLEL)
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
            tiles.chunk_matmul(x, wt[:n * QK], b0 * QK, acc)
        tiles.store_rows(acc, out, t)


@njit(**_JIT_PARALLEL)
def _tiled_q8(x, qs, d, out):
    """Q8_0 matmul for many rows (as :func:`_tiled_q4`)."""
    n_tiles, n_blocks = qs.shape[0], qs.shape[1]
    for t in prange(n_tiles):
        wt = np.empty((tiles.CHUNK, TR), np.float32)
        acc = np.zeros((x.shape[0], TR), np.float32)
        for b0 in range(0, n_blocks, tiles.CHUNK // QK):
            n = min(tiles.CHUNK // QK, n_blocks - b0)
            _dequant_blocks_q8(qs, d, t, b0, n, wt)
            tiles.chunk_matmul(x, wt[:n * QK], b0 * QK, acc)
        tiles.store_rows(acc, out, t)


@njit(**_JIT_PARALLEL)
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
            tiles.chunk_matmul(x, wt[:n], k0, acc)
        tiles.store_rows(acc, out, t)


@njit(**_JIT_PARALLEL)
def _tiled_f32(x, qs, out):
    """F32 matmul: qs float32 [T, n_in, TR] is already a stack of tiles."""
    for t in prange(qs.shape[0]):
        acc = np.zeros((x.shape[0], TR), np.float32)
        tiles.chunk_matmul(x, qs[t], 0, acc)
        tiles.store_rows(acc, out, t)


@njit(**_JIT)
def _dequant_tile(qs, d, m, kind, t):
    """Numba tile dequantizer as one entry point for tests: kind 0 Q4_0, 1 Q4_1, 2 Q8_0.
    Returns float32 [n_in, TR]."""
    n_blocks = qs.shape[1]
    wt = np.empty((n_blocks * 32, TR), np.float32)
    if kind == 2:
        _dequant_blocks_q8(qs, d, t, 0, n_blocks, wt)
    elif kind == 1:
        _dequant_blocks_q4(qs, d, m, np.float32(1.0), t, 0, n_blocks, wt)
    else:
        _dequant_blocks_q4(qs, d, d, np.float32(-8.0), t, 0, n_blocks, wt)
    return wt


# --------------------------------------------------------------------------------------------
# public entry points


def matmul(x: np.ndarray, w: Weight, out: np.ndarray | None = None) -> np.ndarray:
    """``y = x @ W.T`` with W dequantized on the fly; float32 accumulation. A weight packed with
    ``activations="q8"`` (``w.act8``) quantizes x to 8 bits per block of 32 first
    (:func:`llamatrace.kernels.act8.matmul`).

    x: float32 ``[seq_len, n_in]`` (a 1-D ``[n_in]`` is treated as one row and gives a 1-D
    result); converted to C-contiguous float32 if it is not. out: optional float32 C-contiguous
    ``[seq_len, n_out]`` to write into. Returns float32 ``[seq_len, n_out]``.
    Raises ``ValueError`` on a shape mismatch.
    """
    x = np.asarray(x)
    squeeze = x.ndim == 1
    x2 = np.ascontiguousarray(x.reshape(1, -1) if squeeze else x, dtype=np.float32)
    if x2.ndim != 2 or x2.shape[1] != w.n_in:
        raise ValueError(f"matmul {w.name}: x has shape {x.shape}, expected [seq_len, {w.n_in}]")
    n_seq = x2.shape[0]
    if out is None:
        out = np.empty((n_seq, w.n_out), dtype=np.float32)
    elif (out.shape != (n_seq, w.n_out) or out.dtype != np.float32 or not out.flags.c_contiguous):
        raise ValueError(f"matmul {w.name}: out must be C-contiguous float32 [{n_seq}, {w.n_out}], "
                         f"got {out.dtype} {out.shape}")
    if n_seq:
        _dispatch(x2, w, out)
    return out[0] if squeeze else out


def _q4_offsets(w: Weight) -> tuple[np.ndarray, np.float32]:
    """(m, m_scale) with weight = d*q + m_scale*m: Q4_1 (m, 1), Q4_0 (d, -8) = d*(q - 8)."""
    if w.ggml_type == _T.Q4_1:
        return w.m, np.float32(1.0)
    return w.d, np.float32(-8.0)


def _dispatch(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    typ = w.ggml_type
    if w.act8:
        act8.matmul(x, typ, w.qs, w.d, w.m, out)
        return
    gemv = x.shape[0] <= GEMV_MAX_SEQ
    if gemv and (typ == _T.Q5_0 or typ == _T.Q5_1):
        m, m_scale = (w.m, np.float32(1.0)) if typ == _T.Q5_1 else (w.d, np.float32(-16.0))
        kquants.gemv_q5(x, w.qs, w.d, m, m_scale, out)
    elif gemv and typ == _T.Q4_K:
        kquants.gemv_q4k(x, w.qs, w.d, w.m, out)
    elif gemv and typ == _T.Q5_K:
        kquants.gemv_q5k(x, w.qs, w.d, w.m, out)
    elif gemv and typ == _T.Q6_K:
        kquants.gemv_q6k(x, w.qs, w.d, out)
    elif gemv and typ == _T.Q2_K:
        kquants.gemv_q2k(x, w.qs, w.d, w.m, out)
    elif gemv and typ == _T.Q3_K:
        kquants.gemv_q3k(x, w.qs, w.d, out)
    elif typ in kquants.KIND:
        m = w.m if typ in kquants.HAS_MIN else w.d
        (kquants.gemv if gemv else kquants.tiled)(kquants.KIND[typ], x, w.qs, w.d, m, out)
    elif typ == _T.Q4_1 or typ == _T.Q4_0:
        m, m_scale = _q4_offsets(w)
        (_gemv_q4 if gemv else _tiled_q4)(x, w.qs, w.d, m, m_scale, out)
    elif typ == _T.Q8_0:
        (_gemv_q8 if gemv else _tiled_q8)(x, w.qs, w.d, out)
    elif typ == _T.F32:
        _tiled_f32(x, w.qs, out)
    else:
        _tiled_u16(x, w.qs, _F16_TABLE if typ == _T.F16 else _BF16_TABLE, out)


@njit(**_JIT_PARALLEL)
def _touch_threads(a):
    for i in prange(a.shape[0]):
        a[i] = i


def threading_layer() -> str:
    """Numba's threading layer in use (``tbb``, ``omp`` or ``workqueue``): runs one tiny parallel
    kernel first, since Numba picks the layer at the first parallel call."""
    _touch_threads(np.zeros(4, dtype=np.int64))
    return numba.threading_layer()


_fixed_threads: int | None = None


def set_threads(n: int) -> None:
    """Use ``n`` threads in the parallel kernels (``numba.set_num_threads``), from now on:
    :class:`AutoThreads` no longer chooses.

    Raises :class:`OptionError` unless ``1 <= n <= numba.config.NUMBA_NUM_THREADS``.
    """
    global _fixed_threads
    limit = numba.config.NUMBA_NUM_THREADS
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= limit:
        raise OptionError(f"threads must be an integer from 1 to {limit} (this machine), got {n!r}")
    numba.set_num_threads(int(n))
    _fixed_threads = int(n)


class AutoThreads:
    """Chooses the thread count of each forward call by measuring, unless :func:`set_threads` fixed it.

    With every core free, all of them are fastest. When another process keeps a core busy, a
    parallel region waits for its slowest thread, which then shares a core (a scheduler time
    slice is ~3 ms, a region ~40 µs), and one thread beats two. So each kind of call (decode)
    keeps a moving average of seconds per token for each candidate count (all cores, one fewer,
    one) and uses the fastest. It retries another count after ``explore`` calls, then after
    twice as many each time the fastest stays the same (up to ``max_interval``; a retry of a
    slower count costs one slow token), and again after ``explore`` once the fastest changes.
    A prefill is one long call, too costly to spend on a slower count: it takes decode's
    fastest (:meth:`best`).

    Fewer threads can only win when another process takes cores, so while all cores are the
    fastest and this process gets their CPU time (``cpu_seconds_per_token`` at least
    ``threads - 0.3`` times the wall time, averaged) it does not explore: each exploration
    costs a slow token (at 8B, ~0.5 s), and a short generation pays it several times.
    """

    def __init__(self, explore: int = 16, max_interval: int = 256) -> None:
        limit = numba.config.NUMBA_NUM_THREADS
        self.candidates = sorted({limit, max(1, limit - 1), 1}, reverse=True)
        self.explore = explore
        self.max_interval = max_interval
        self._avg: dict[tuple[str, int], float] = {}
        self._calls: dict[str, int] = {}
        self._interval: dict[str, int] = {}
        self._next: dict[str, int] = {}
        self._retries: dict[str, int] = {}
        self._share: dict[str, float] = {}     # CPU seconds per wall second with all cores

    def _cores_busy_elsewhere(self, kind: str) -> bool:
        """True unless calls with all cores got (on average) nearly all of their CPU time;
        also True when that was never measured."""
        top = self.candidates[0]
        return self._share.get(kind, 0.0) < top - 0.3

    def _fastest(self, kind: str) -> int:
        return min(self.candidates, key=lambda c: self._avg[kind, c])

    def pick(self, kind: str) -> int:
        """The thread count for the next call of ``kind`` (and sets it); the fixed one if any."""
        if _fixed_threads is not None:
            return _fixed_threads
        calls = self._calls.get(kind, 0)
        self._calls[kind] = calls + 1
        untried = [n for n in self.candidates if (kind, n) not in self._avg]
        top = self.candidates[0]
        measured = [c for c in self.candidates if (kind, c) in self._avg]
        if (measured and not self._cores_busy_elsewhere(kind)
                and min(measured, key=lambda c: self._avg[kind, c]) == top):
            n = top                           # the cores are ours and all of them are fastest
        elif untried:
            n = untried[0]
        else:
            n = self._fastest(kind)
            interval = self._interval.setdefault(kind, self.explore)
            if len(self.candidates) > 1 and calls >= self._next.setdefault(kind, calls + interval):
                others = [c for c in self.candidates if c != n]
                retries = self._retries.get(kind, 0)
                n = others[retries % len(others)]
                self._retries[kind] = retries + 1
                self._interval[kind] = min(2 * interval, self.max_interval)
                self._next[kind] = calls + self._interval[kind]
        numba.set_num_threads(n)
        return n

    def best(self, kind: str) -> int:
        """The fastest count measured so far for ``kind`` (all cores before any measurement; the
        fixed one if any), set without exploring."""
        if _fixed_threads is not None:
            return _fixed_threads
        known = [c for c in self.candidates if (kind, c) in self._avg]
        n = min(known, key=lambda c: self._avg[kind, c]) if known else self.candidates[0]
        numba.set_num_threads(n)
        return n

    def record(self, kind: str, n: int, seconds_per_token: float,
               cpu_seconds_per_token: float | None = None) -> None:
        """Add one measurement of ``n`` threads for ``kind`` (wall seconds and, when known, the
        process's CPU seconds, ``time.process_time``); a new fastest count restarts the
        retries at every ``explore`` calls."""
        if cpu_seconds_per_token is not None and n == self.candidates[0] and seconds_per_token > 0:
            share = cpu_seconds_per_token / seconds_per_token
            old_share = self._share.get(kind)
            self._share[kind] = share if old_share is None else 0.7 * old_share + 0.3 * share
        key = (kind, n)
        old = self._avg.get(key)
        tried = all((kind, c) in self._avg for c in self.candidates)
        before = self._fastest(kind) if tried else None
        self._avg[key] = seconds_per_token if old is None else 0.7 * old + 0.3 * seconds_per_token
        if tried and self._fastest(kind) != before:
            self._interval[kind] = self.explore
            self._next[kind] = self._calls.get(kind, 0) + self.explore


AUTO_THREADS = AutoThreads()
"""The process's policy (Numba's threads are a process-wide resource); :func:`generate` uses it."""
