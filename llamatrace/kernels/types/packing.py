"""Packing GGUF tensors into row tiles: :class:`Weight`, :class:`Arena`, :func:`pack`, and the
NumPy reference (:func:`dequantize`, :func:`get_rows`, :func:`matmul_ref`).

A :class:`Weight` is one ``[n_out, n_in]`` matrix (torch/Meta ``out_features x in_features``
order) repacked once at load time into *row tiles*: ``TR`` consecutive output rows are
interleaved so that the innermost loop of every kernel runs over ``TR`` rows and compiles to
512-bit vector instructions (``vfmadd…ps %zmm``). There is no float32 copy of the model: the
quantized bytes stay as they are in the file, only the fp16 scales become float32 (Numba has
no float16), or stay fp16 bits for the kernels that widen them as they read: the ``q8``
activation mode's, and Q8_0's in ``f32``
(:meth:`llamatrace.kernels.types.registry.BlockFormat.scale_bits`; :mod:`llamatrace.kernels.int8.act8`
also reorders the quant bytes it reads in groups of four).

Block types (T = ceil(n_out / TR) tiles, B = n_in / weights-per-block blocks; padded rows are
zero)::

    qs uint8 (int8 for Q8_0) [T, B, P, TR]   qs[t, b, p, r] = packed byte p of block b of row t*TR + r
    d  [T, B, TR]                            m [T, B, TR] (types with a minimum only)
                                             float32 values, or fp16 bits uint16 in the q8 mode

Q8_0 in the q8 mode on a host with VNNI: ``qs`` uint8 ``q + 128``
(:data:`~llamatrace.kernels.int8.act8.Q8_0_UNSIGNED`, the bytes ``vpdpbusd`` multiplies).

Each type's :class:`~llamatrace.kernels.types.registry.QuantType` (declared in its family module)
holds its :class:`~llamatrace.kernels.types.registry.BlockFormat` (sizes, where ``d``, ``m`` and the
quant bytes sit in a file block, ``P``, how its sub-block scales unpack) and its NumPy
dequantizer; the one repacker here (:func:`repack_tiles`) copies by it. The byte layouts are
drawn in :mod:`llamatrace.kernels.types.q4`, :mod:`~llamatrace.kernels.types.q5`,
:mod:`~llamatrace.kernels.types.q8`, :mod:`~llamatrace.kernels.types.k_quants`; F32/F16/BF16 are tiled by
:mod:`llamatrace.kernels.types.floats`. Which kernel then multiplies a Weight is the registry's
business (:func:`llamatrace.kernels.types.registry.matmul`).
"""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass
from typing import Callable

import gguf
import numpy as np
from numba import njit, prange

from llamatrace.errors import OptionError, UnsupportedModelError
from llamatrace.kernels import tiles
from llamatrace.kernels.int8 import act8
from llamatrace.kernels.types import file_rows, floats
from llamatrace.kernels.types.registry import FORMATS, MODES, TYPES, QuantType, served_types
from llamatrace.machine.jit import JIT_INLINE, JIT_PARALLEL

_T = gguf.GGMLQuantizationType


def __getattr__(name: str):
    # SUPPORTED_TYPES is read when asked for: the family modules that declare the types import
    # this module (their prefill kernels' twin is matmul_ref) before they declare them
    if name == "SUPPORTED_TYPES":
        return served_types("f32")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TR = tiles.TR
"""Rows per tile: the vector width of the inner loops (2 zmm registers of float32)."""

_EMPTY_SCALES = np.zeros((0, 0, TR), dtype=np.float32)


@dataclass(frozen=True, eq=False)
class Weight:
    """One ``[n_out, n_in]`` matrix in row-tile layout (see the module docstring).

    ``qs`` holds the packed weights (uint8 / int8 / uint16 / float32 by type), ``d`` and ``m`` the
    block scales and minimums ``[T, B, TR]`` (empty where the type has none), encoded as the type's
    :meth:`~llamatrace.kernels.types.registry.BlockFormat.scale_bits` says for the weight's
    :attr:`mode`: the file's fp16 bits (uint16) in ``q8`` (and Q8_0's in ``f32``), else float32
    values; :meth:`scales_f32` gives float32 values in either. ``act8``: packed for the
    8-bit-activation kernels (:attr:`mode` ``q8``: the type's ``q8`` kernels, its quant bytes in
    :mod:`llamatrace.kernels.int8.act8`'s groups of four); a type without ``q8`` kernels is packed
    for ``f32`` whatever was asked. ``row_splits`` gives the row counts of the matrices fused by
    :func:`pack_concat` (``(n_out,)`` otherwise), so a caller can ``np.split(y,
    np.cumsum(w.row_splits)[:-1], axis=1)``. Raises ``ValueError`` if non-empty ``d`` / ``m`` do not
    have the mode's dtype.
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

    def __post_init__(self) -> None:
        fmt = FORMATS.get(self.ggml_type)
        want = fmt.scale_dtype(self.mode) if fmt is not None else np.dtype(np.float32)
        if any(a.size and a.dtype != want for a in (self.d, self.m)):
            raise ValueError(f"Weight {self.name!r}: d, m must be {want} in mode {self.mode}, got {self.d.dtype}, "
                             f"{self.m.dtype}")

    @property
    def mode(self) -> str:
        """The activation mode whose kernels the weight was packed for (``"f32"`` | ``"q8"``)."""
        return "q8" if self.act8 else "f32"

    def scales_f32(self, t, r) -> tuple[np.ndarray, np.ndarray | None]:
        """(d, m) float32 ``[n, B]`` of rows ``r`` of tiles ``t`` (int arrays [n]), in either
        mode; ``m`` None for a type without a minimum."""
        d, m = self.d[t, :, r], (self.m[t, :, r] if self.m.size else None)
        fmt = self._bits_format()
        if fmt is not None:
            d, m = fmt.scale_values(d), (fmt.scale_values(m) if m is not None else None)
        return d, m

    def block_scales(self) -> np.ndarray:
        """``d`` as float32 values ``[T, B, TR]`` (:meth:`scales_f32`'s, for every row), for the NumPy twins."""
        fmt = self._bits_format()
        return fmt.scale_values(self.d) if fmt is not None else self.d

    def _bits_format(self):
        """The type's block format when ``d`` and ``m`` hold the file's scale bits, else None."""
        fmt = FORMATS.get(self.ggml_type)
        return fmt if fmt is not None and fmt.scale_bits(self.mode) else None

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
    chunks of ``chunk_bytes`` of fresh anonymous memory (:func:`small_pages`), so hundreds of small
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
            chunk, start = small_pages(n_bytes + 64), 0
        else:
            chunk, start = self._chunk, self._used
            if start + 63 + n_bytes > chunk.size:
                chunk = self._chunk = small_pages(self.chunk_bytes)
                start = 0
            self._used = start + (-(chunk.ctypes.data + start) % 64) + n_bytes
        start += -(chunk.ctypes.data + start) % 64
        return chunk[start:start + n_bytes].view(dtype).reshape(shape)


def packed_bound(ggml_type, shape) -> int:
    """An upper bound of the bytes :func:`pack` / :func:`pack_concat` give a tensor of GGUF shape
    ``shape`` (ggml order: ``[n_in, rows, n_expert…]``), packed whole or a matrix at a time
    (each of its ``n_expert`` matrices padded to whole tiles), scales as float32, plus each
    array's alignment; 0 for a vector. Raises ``KeyError`` for a type without a packer."""
    shape = [int(n) for n in shape]
    if len(shape) < 2:
        return 0
    n_in, rows = shape[0], shape[1]
    n_tiles = int(np.prod(shape[2:], dtype=np.int64)) * -(-rows // TR)
    fmt = FORMATS.get(_T(ggml_type))
    if fmt is None:
        per_row = n_in * 4                                   # F32, or F16/BF16 bits (2 bytes)
    else:
        per_row = n_in // fmt.weights * (fmt.packed_bytes + 4 * (1 + fmt.has_min))
    return n_tiles * TR * per_row + 3 * 64 * int(np.prod(shape[2:], dtype=np.int64))


def small_pages(n_bytes: int) -> np.ndarray:
    """uint8 ``[n_bytes]`` of fresh private anonymous memory on the kernel's 4 KiB pages.

    NumPy asks for transparent huge pages from 4 MiB (``madvise``), and where the kernel
    compacts memory to find 2 MiB at fault time (``defrag`` = ``madvise``, as in this project's
    VMs) the first touch of those pages cost ~4 s per GiB against ~0.7 for small pages: the
    8B-shaped Q4_K_M file loaded in 15-16 s instead of 8-12 (separate processes, alternated); a
    copy into 2 MiB pages afterwards (``MADV_COLLAPSE``) costs as much (~2.2 s per GiB). At 8B a
    decode step on these pages took ~5 % longer than on the packed-weights cache's map when the
    page cache held that file in 2 MiB folios, and ~8 % less than when it held it in 4 KiB ones
    (docs/performance.md "Decode")."""
    pages = mmap.mmap(-1, max(n_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    populate(pages)
    return np.frombuffer(pages, dtype=np.uint8)


_MADV_POPULATE_WRITE = 23


def populate(pages: mmap.mmap) -> None:
    """Fault every page of the writable map ``pages`` in now, in one call (``MADV_POPULATE_WRITE``,
    Linux 5.14; a no-op before): the packers then write into mapped pages. A fault per page
    from the packers' stores cost 0.64-0.71 CPU-s per GiB of fresh anonymous memory against 0.55
    this way, and 0.9-1.9 against 0.34-0.46 for a shared map of a file's reserved blocks (a 1 GiB
    copy, this project's VM, 2 threads)."""
    with contextlib.suppress(OSError):
        pages.madvise(_MADV_POPULATE_WRITE)


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
    supported = ", ".join(sorted(t.name for t in served_types("f32")))
    return UnsupportedModelError(
        f"tensor {name!r} has type {type_name}, which llamatrace cannot compute with "
        f"(supported: {supported})"
    )


def _pack_blocks(name: str, qt: QuantType, parts: list[tuple[np.ndarray, int]], n_in: int, arena: Arena,
                 group: tuple[int, int], done: Callable[[int], None] | None = None):
    """Row tiles (qs, d, m) of the stacked rows of ``parts`` = [(raw, n_out)] of a block type,
    written in place by :func:`repack_tiles`: no concatenated or transposed temporary, so a load
    holds the file's pages and the packed copy, nothing more; quant bytes ``group`` in 8-bit
    activations' order (:func:`_group`), whose mode then also sets the dtype of ``d`` and ``m``
    (:meth:`~llamatrace.kernels.types.registry.BlockFormat.scale_dtype`). ``done(rows)`` after each part, with
    the rows packed so far. Raises ``ValueError`` on a size mismatch."""
    ggml_type, fmt = qt.ggml_type, qt.block
    if n_in % fmt.weights:
        raise ValueError(f"tensor {name!r} ({ggml_type.name}): n_in={n_in} is not a multiple of {fmt.weights}")
    n_blocks = n_in // fmt.weights
    n_rows = sum(int(n) for _, n in parts)
    n_tiles = -(-n_rows // TR)
    mode = "q8" if group != (0, 0) else "f32"
    scale_type, table = fmt.scale_dtype(mode), fmt.scale_lookup(mode)    # file scale bits -> what d, m hold
    qs_t = arena.empty((n_tiles, n_blocks, fmt.packed_bytes, TR), np.uint8)
    d_t = arena.empty((n_tiles, n_blocks, TR), scale_type)
    m_t = arena.empty((n_tiles, n_blocks, TR), scale_type) if fmt.has_min else _EMPTY_SCALES
    _zero_last_tile(n_rows, qs_t, d_t, m_t)
    row0 = 0
    for raw, n_out in parts:
        raw = np.asarray(raw)
        if raw.nbytes != n_out * n_blocks * fmt.file_bytes:
            raise ValueError(f"tensor {name!r} ({ggml_type.name} [{n_out}, {n_in}]): expected "
                             f"{n_out * n_blocks * fmt.file_bytes} bytes, got {raw.nbytes}")
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, n_blocks, fmt.file_bytes)
        repack_tiles(ggml_type, blocks, row0, table, qs_t, d_t, m_t, group)
        row0 += n_out
        if done is not None:
            done(row0)
    if mode == "f32" and qt.f32_layout is not None:
        qt.f32_layout.pack(qs_t)
    if mode == "q8" and ggml_type == _T.Q8_0 and act8.Q8_0_UNSIGNED:
        np.bitwise_xor(qs_t, np.uint8(0x80), out=qs_t)          # q + 128, what vpdpbusd multiplies
        return qs_t, d_t, m_t
    return (qs_t.view(np.int8) if fmt.signed else qs_t), d_t, m_t


def check_activations(activations: str) -> str:
    """``activations`` if it is a mode this machine runs (:data:`llamatrace.kernels.types.registry.MODES`), else
    :class:`OptionError`."""
    if activations not in MODES:
        raise OptionError(f"activations must be one of {', '.join(MODES)}, got {activations!r}")
    if activations == "q8" and not act8.available():
        raise OptionError("activations q8 needs a CPU with AVX2, which this one lacks; use f32")
    return activations


def _group(ggml_type, activations: str) -> tuple[int, int]:
    """The packed bytes ``(head, end)`` of a block row that the type's ``q8`` kernels read in
    groups of four (its ``q8_bytes``; ``(0, 0)``: none, the float32 path's layout)."""
    q8_bytes = TYPES[_T(ggml_type)].q8_bytes if activations == "q8" else None
    return q8_bytes or (0, 0)


RELEASE_BYTES = 32 << 20
"""A tensor packed with a ``release`` callback is packed (and released) this many bytes of the
file at a time."""


def pack(name: str, ggml_type, raw: np.ndarray, n_out: int, n_in: int, *, activations: str = "f32",
         arena: Arena | None = None, release: Callable[[int, int], None] | None = None) -> Weight:
    """Repack one GGUF tensor into row tiles.

    ``raw`` is a GGUF tensor's ``.data`` (:class:`llamatrace.gguf.reader.Tensor` or gguf-py
    ReaderTensor): uint8 ``[n_out, row_bytes]`` for the block types and BF16, float32 / float16
    ``[n_out, n_in]`` for F32 / F16 (any array of the right size and dtype is accepted).
    ``activations`` ``"q8"`` packs the types with ``q8`` kernels (``registry.served_types("q8")``) for
    them (other types are unaffected).
    Raises :class:`UnsupportedModelError` for a type not declared (``registry.served_types()``),
    ``ValueError`` if ``n_in`` is not a multiple of the block size or ``raw`` has the wrong
    size, and :class:`OptionError` for an unknown ``activations``. The block types' arrays
    come from ``arena`` when given (a model's loader passes one for all its weights).
    ``release(start, n_bytes)``: called as each :data:`RELEASE_BYTES` of ``raw`` (a block type's)
    has been packed, so that a loader can let those file pages go before the rest is packed (a
    large output matrix would otherwise be resident twice: gpt-oss's, 0.6 GB).
    """
    check_activations(activations)
    arena = arena if arena is not None else Arena(0)
    try:
        ggml_type = _T(ggml_type)
    except ValueError:
        raise _unsupported(name, ggml_type) from None
    if ggml_type not in TYPES:
        raise _unsupported(name, ggml_type)
    n_out, n_in = int(n_out), int(n_in)
    if n_out < 1 or n_in < 1:
        raise ValueError(f"tensor {name!r}: empty shape [{n_out}, {n_in}]")
    raw = np.asarray(raw)

    group = _group(ggml_type, activations)
    if ggml_type in FORMATS:
        parts, done = [(raw, n_out)], None
        if release is not None:
            row_bytes = raw.nbytes // n_out
            step = max(1, RELEASE_BYTES // row_bytes)
            rows = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, row_bytes)
            parts = [(rows[r:r + step], min(step, n_out - r)) for r in range(0, n_out, step)]
            released = [0]

            def done(row: int) -> None:
                release(released[0] * row_bytes, (row - released[0]) * row_bytes)
                released[0] = row
        qs_t, d_t, m_t = _pack_blocks(name, TYPES[ggml_type], parts, n_in, arena, group, done)
    else:
        if raw.nbytes != n_out * n_in * floats.ITEM_BYTES[ggml_type]:
            raise ValueError(f"tensor {name!r} ({ggml_type.name} [{n_out}, {n_in}]): "
                             f"got {raw.nbytes} bytes")
        qs_t = floats.tile_floats(ggml_type, raw, n_out, n_in)
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
    if _T(ggml_type) in FORMATS:
        group = _group(_T(ggml_type), activations)
        qs_t, d_t, m_t = _pack_blocks(name, TYPES[_T(ggml_type)], [(raw, n_out) for _, raw, n_out, _ in parts],
                                      n_in, arena, group)
        return Weight(name, _T(ggml_type), sum(splits), n_in, qs_t, d_t, m_t, splits, group != (0, 0))
    rows = [np.ascontiguousarray(raw).view(np.uint8).reshape(int(n_out), -1) for _, raw, n_out, _ in parts]
    row_bytes = {r.shape[1] for r in rows}
    if len(row_bytes) != 1:
        raise ValueError(f"pack_concat({name!r}): parts have different row sizes {sorted(row_bytes)}")
    w = pack(name, ggml_type, np.concatenate(rows, axis=0), sum(splits), n_in, activations=activations, arena=arena)
    return Weight(w.name, w.ggml_type, w.n_out, w.n_in, w.qs, w.d, w.m, splits, w.act8)


# --------------------------------------------------------------------------------------------
# repacking GGUF blocks (at load time)

def repack_blocks(ggml_type, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks uint8 ``[n, B, file_bytes]`` -> (packed uint8 ``[n, B, packed_bytes]``,
    d float32 ``[n, B]``, m float32 ``[n, B]`` or None), per the type's
    :class:`~llamatrace.kernels.types.registry.BlockFormat`: the copied quant bytes, and its
    sub-block scales unpacked by its :class:`~llamatrace.kernels.types.registry.ScaleByte` table."""
    fmt = FORMATS[_T(ggml_type)]
    src, dst, n = fmt.copy
    packed = np.empty(blocks.shape[:-1] + (fmt.packed_bytes,), np.uint8)
    packed[..., dst:dst + n] = blocks[..., src:src + n]
    if fmt.scales:
        out, lo, lo_shift, lo_mask, hi, hi_shift, hi_mask = fmt.scale_table().T
        packed[..., out] = (((blocks[..., lo] >> lo_shift) & lo_mask)
                            | (((blocks[..., hi] >> hi_shift) & hi_mask) << 4)).astype(np.uint8)
    d = fmt.scale_values(_u16_at(blocks, fmt.d_off))
    m = fmt.scale_values(_u16_at(blocks, fmt.m_off)) if fmt.has_min else None
    return packed, d, m


def _u16_at(blocks: np.ndarray, off: int) -> np.ndarray:
    """The little-endian uint16 at byte ``off`` of each block, ``[...]``."""
    return np.ascontiguousarray(blocks[..., off:off + 2]).view(np.uint16)[..., 0]


def repack_tiles_np(ggml_type, blocks: np.ndarray, row0: int, qs_t: np.ndarray, d_t: np.ndarray,
                    m_t: np.ndarray, group: tuple[int, int] = (0, 0)) -> None:
    """NumPy twin of :func:`repack_tiles`: :func:`repack_blocks` on a few hundred rows at a
    time, scattered into rows ``row0..`` of the tiles; uint16 ``d_t`` / ``m_t`` get the fp16
    bits as they are."""
    n_tiles, n_blocks, n_bytes = qs_t.shape[:3]
    flat = qs_t.reshape(n_tiles, n_blocks, n_bytes * TR)
    base, stride = tiles.byte_offsets_np(n_bytes, *group)
    fmt = FORMATS[_T(ggml_type)]
    d_off, m_off = fmt.d_off, fmt.m_off
    for c0 in range(0, blocks.shape[0], 256):
        packed, d, m = repack_blocks(ggml_type, blocks[c0:c0 + 256])
        if d_t.dtype == np.uint16:
            d, m = (fmt.scale_lookup("q8")[_u16_at(blocks[c0:c0 + 256], off)] if off >= 0 else None
                    for off in (d_off, m_off))
        rows = row0 + c0 + np.arange(packed.shape[0])
        at = base + (rows % TR)[:, None, None] * stride                     # [n, 1, P]
        flat[(rows // TR)[:, None, None], np.arange(n_blocks)[:, None], at] = packed
        d_t[rows // TR, :, rows % TR] = d
        if m is not None:
            m_t[rows // TR, :, rows % TR] = m


def repack_tiles(ggml_type, blocks: np.ndarray, row0: int, f16_table: np.ndarray, qs_t: np.ndarray,
                 d_t: np.ndarray, m_t: np.ndarray, group: tuple[int, int] = (0, 0)) -> None:
    """GGUF blocks uint8 ``[n, B, file_bytes]`` -> rows ``row0..row0+n`` of the tiles ``qs_t``
    uint8 ``[T, B, packed_bytes, TR]``, ``d_t`` / ``m_t`` ``[T, B, TR]`` (``m_t`` unused
    for types without a minimum), per the type's :class:`BlockFormat`; packed bytes
    ``group = (head, end)`` in :mod:`llamatrace.kernels.int8.act8`'s grouped order (:func:`tiles.byte_offset`).
    ``f16_table`` [65536] maps the uint16 at a block's ``d_off`` / ``m_off`` to what ``d_t`` /
    ``m_t`` hold (:meth:`~llamatrace.kernels.types.registry.BlockFormat.scale_lookup`): float32
    values, or the file's scale bits as they are. In parallel over tiles; rows of
    other tiles untouched. The NumPy scatter it replaced took ~7 s of an 8B Q4_K_M load; this
    moves 1.5-2.3 GB/s of file bytes on two threads, once the memory is mapped."""
    fmt = FORMATS[_T(ggml_type)]
    _repack_tiles(fmt.scale_table(), *fmt.copy, fmt.d_off, fmt.m_off, *group, blocks, row0, f16_table, qs_t, d_t, m_t)


@njit(**JIT_INLINE)
def _put(out, p, r, head, end, v):
    """Byte p of row r of a packed block (``out`` its flat [P * TR] bytes) = v."""
    base, stride = tiles.byte_offset(p, head, end)
    out[base + r * stride] = v


@njit(**JIT_PARALLEL)
def _repack_tiles(scales, src, dst, n_copy, d_off, m_off, head, end, blocks, row0, f16_table, qs_t, d_t, m_t):
    """:func:`repack_tiles` with the type's :class:`BlockFormat` and ``group`` spelled out;
    ``scales``: its :meth:`~llamatrace.kernels.types.registry.BlockFormat.scale_table`."""
    n_rows, n_blocks, block_bytes = blocks.shape
    flat = blocks.reshape(-1)
    t_first = row0 // TR
    for t in prange((row0 + n_rows - 1) // TR - t_first + 1):
        tile = t_first + t
        r_lo = max(tile * TR, row0) - row0
        r_hi = min((tile + 1) * TR, row0 + n_rows) - row0
        # the tile's rows are one run of the file: ask for all of it now, as the loop below
        # reads it a block of every row at a time (TR streams the prefetchers don't follow)
        for i in range(r_lo * n_blocks * block_bytes, r_hi * n_blocks * block_bytes, 64):
            tiles.prefetch(flat, i)
        for b in range(n_blocks):
            out = qs_t[tile, b].reshape(-1)
            for r in range(r_lo, r_hi):
                rr = row0 + r - tile * TR
                blk = blocks[r, b]
                d_t[tile, b, rr] = f16_table[blk[d_off] | (np.uint16(blk[d_off + 1]) << 8)]
                if m_off >= 0:
                    m_t[tile, b, rr] = f16_table[blk[m_off] | (np.uint16(blk[m_off + 1]) << 8)]
                for i in range(scales.shape[0]):          # the sub-block scales, a byte each
                    v = (blk[scales[i, 1]] >> scales[i, 2]) & scales[i, 3]
                    if scales[i, 6]:                      # a high part (ScaleByte.hi_mask)
                        v |= ((blk[scales[i, 4]] >> scales[i, 5]) & scales[i, 6]) << 4
                    _put(out, scales[i, 0], rr, head, end, v)
            tiles.copy_rows(flat, (r_lo * n_blocks + b) * block_bytes + src, n_blocks * block_bytes,
                            r_hi - r_lo, out, row0 + r_lo - tile * TR, dst, n_copy, head, end)


# --------------------------------------------------------------------------------------------
# NumPy reference


def file_order_rows(ggml_type, qs: np.ndarray, t: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The bytes of rows ``r`` of tiles ``t`` (int [n] each) of a ``q8``-mode weight's ``qs``, in
    the float32 path's layout: ``[n, B, P]``, what ``qs[t, :, :, r]`` gives there. Gathers only
    those rows (an embedding lookup per decode step: 112 -> 22 us for SmolLM2's token_embd,
    regrouping whole tiles)."""
    n_tiles, n_blocks, n_bytes, tr = qs.shape
    head, end = _group(ggml_type, "q8")
    rows = qs[t, :, :, r]                                     # right outside [head, end)
    grouped = qs.reshape(n_tiles, n_blocks, n_bytes * tr)[:, :, head * tr:end * tr]
    grouped = grouped.reshape(n_tiles, n_blocks, (end - head) // 4, tr, 4)   # [j // 4, r, j % 4]
    rows[:, :, head:end] = grouped[t, :, :, r].reshape(len(t), n_blocks, end - head)
    return act8.q8_0_quants(rows) if _T(ggml_type) == _T.Q8_0 else rows


def _dequant_rows_np(w: Weight, rows: np.ndarray) -> np.ndarray:
    """Dequantize the given rows (int array [n]) -> float32 [n, n_in], plain NumPy, by the
    type's :attr:`~llamatrace.kernels.types.registry.QuantType.dequant_np` (gguf-py's arithmetic, so
    results are bit-for-bit equal to ``gguf.quants.dequantize``)."""
    qt = TYPES[w.ggml_type]
    t, r = rows // TR, rows % TR
    if qt.block is None:
        return qt.dequant_np(w.qs[t, :, r], None, None)                    # [n, n_in]
    if w.act8:
        q = file_order_rows(w.ggml_type, w.qs, t, r)                        # [n, B, P]
    else:
        q = qt.f32_layout.rows_np(w.qs, t, r) if qt.f32_layout else w.qs[t, :, :, r]
    return qt.dequant_np(q, *w.scales_f32(t, r))


def dequantize(w: Weight) -> np.ndarray:
    """float32 ``[n_out, n_in]``, plain NumPy; bit-for-bit ``gguf.quants.dequantize`` of the file's data."""
    return _dequant_rows_np(w, np.arange(w.n_out))


@dataclass(frozen=True, eq=False)
class FileRows:
    """A ``[n_out, n_in]`` lookup table read where it lies in the GGUF file's map, never packed:
    an untied ``token_embd``, of which a run touches only its tokens' rows (a page or two each),
    where a packed copy is resident whole (gpt-oss's Q8_0 embedding: 0.65 GB). ``rows`` holds
    the tensor's bytes, uint8 ``[n_out * row_bytes]`` (a read-only map of its own, so the model
    outlives the GGUF file's map); :func:`get_rows` reads them with ``gguf.quants.dequantize``
    (or, for its commonest types, :mod:`~llamatrace.kernels.types.file_rows`' Numba twin of it),
    the arithmetic :func:`dequantize` matches bit for bit."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    n_out: int
    n_in: int
    rows: np.ndarray
    act8: bool = False

    @property
    def nbytes(self) -> int:
        """Resident bytes of packed arrays: none (the rows read stay in the file's page cache)."""
        return 0


def get_rows(w: Weight | FileRows, ids: np.ndarray) -> np.ndarray:
    """Embedding lookup: float32 ``[len(ids), n_in]``, the dequantized rows ``ids`` of ``w``.

    Raises ``IndexError`` if an id is outside ``[0, n_out)``.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    listed = ids.tolist()         # a decode step's one id: Python's min and max, not two NumPy reductions
    if listed and (min(listed) < 0 or max(listed) >= w.n_out):
        raise IndexError(f"{w.name}: row ids must be in [0, {w.n_out}), got {min(listed)}..{max(listed)}")
    if isinstance(w, FileRows):
        rows = np.asarray(w.rows).reshape(w.n_out, -1)[ids]
        if w.ggml_type in file_rows.TYPES:              # the same bits, without gguf-py's ~0.1 ms a call
            return file_rows.dequantize_rows(rows, w.ggml_type)
        if w.ggml_type in (_T.F32, _T.F16):
            rows = rows.view(np.float32 if w.ggml_type == _T.F32 else np.float16)
        return np.asarray(gguf.quants.dequantize(rows, w.ggml_type), dtype=np.float32).reshape(len(ids), w.n_in)
    return _dequant_rows_np(w, ids)


def dequant_tile_np(w: Weight, t: int) -> np.ndarray:
    """NumPy twin of the kernel modules' ``dequant_tile``: float32 [n_in, TR], rows t*TR.. as columns."""
    return _dequant_rows_np(w, np.arange(t * TR, (t + 1) * TR)).T.copy()


def matmul_ref(x: np.ndarray, w: Weight) -> np.ndarray:
    """Plain NumPy twin of :func:`llamatrace.kernels.types.registry.matmul`: ``x @ dequantize(w).T``
    summed in float64, float32 ``[S, n_out]``."""
    return (np.asarray(x, dtype=np.float64) @ dequantize(w).T.astype(np.float64)).astype(np.float32)
