"""Quant types and the kernel registry: what a GGML type is, which kernel computes ``x @ W.T``
for a weight, and :func:`matmul`.

A quant type is one :class:`QuantType`, declared once in its family module (``q4`` declares
Q4_0 and Q4_1, ``k_quants`` Q2_K..Q6_K, ``floats`` F32/F16/BF16 …) with :func:`declare`, as
gguf-py's ``quants.py`` keeps one class per ``qtype``. It holds, for that one type:

- its :class:`BlockFormat`: sizes, where the fp16 ``d`` / ``m`` and the quant bytes sit in a
  file block, and how its sub-block scales unpack (:class:`ScaleByte` rows);
- its NumPy dequantizer (``dequant_np``, bit for bit ``gguf.quants.dequantize``);
- its matmul kernels per activation mode (:data:`MODES`) and phase (:data:`PHASES`), each a
  :class:`Kernel`: the adapter that calls the Numba kernel with the weight's arrays, and its
  NumPy twin beside it;
- the ``q8`` mode's byte groups (``q8_bytes``: which packed bytes :mod:`llamatrace.kernels.int8.act8`'s
  kernels read in groups of four);
- ``quantize`` / ``quantize_np``: its quantizer (float32 rows -> the file's blocks) and the
  quantizer's NumPy twin, where one is wired.

The registry's tables (:data:`TYPES`, :data:`FORMATS`, the kernels) are built from the declared
types when :mod:`llamatrace.kernels` is imported (its ``__init__`` imports every family module);
this module imports none of them. :func:`matmul` picks the phase from the number of rows of
``x`` (:data:`GEMV_MAX_SEQ`) and runs the declared adapter: ``forward()`` -> :func:`matmul` ->
the adapter beside its kernel. :func:`describe` and :func:`summary` name the kernels
(``llamatrace info`` shows them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import gguf
import numpy as np

from llamatrace.errors import UnsupportedModelError
from llamatrace.machine.jit import E8M0_BITS, E8M0_HALF_TABLE, F16_BITS, F16_TABLE

MODES = ("f32", "q8")
"""Activation modes: float32 activations (the default, the reference) or 8-bit
(:mod:`llamatrace.kernels.int8.act8`)."""

PHASES = ("decode", "prefill")
"""``decode``: the GEMV kernels for a few rows of ``x`` (weights decoded in registers, once per
row); ``prefill``: the tiled kernels for more rows (each tile dequantized once, reused by every row)."""

GEMV_MAX_SEQ = 4
"""Up to this many rows of ``x`` take the ``decode`` kernels, more the ``prefill`` ones."""

_SCALE_TABLES = {"f16": (F16_TABLE, F16_BITS), "e8m0": (E8M0_HALF_TABLE, E8M0_BITS)}
"""BlockFormat.scale -> (the float32 values, the kept bits) of each uint16 read from a block."""


@dataclass(frozen=True)
class ScaleByte:
    """How the packer makes one byte of a packed block's unpacked sub-block scales:
    ``packed[dst] = ((file[lo_byte] >> lo_shift) & lo_mask) | (((file[hi_byte] >> hi_shift) & hi_mask) << 4)``
    (``hi_mask`` 0: no high part). Q3_K's and Q4_K/Q5_K's 6-bit scales are tables of these."""

    dst: int
    lo_byte: int
    lo_shift: int
    lo_mask: int
    hi_byte: int = 0
    hi_shift: int = 0
    hi_mask: int = 0


@dataclass(frozen=True)
class BlockFormat:
    """A GGML block as the packer (:mod:`llamatrace.kernels.types.packing`) sees it.

    ``weights`` per block; ``file_bytes`` per block in the GGUF file; ``packed_bytes``: the
    bytes per row and block in the packed tiles (``qs [T, B, packed_bytes, TR]``). The packer
    copies ``copy = (src, dst, n)``: ``n`` quant bytes from offset ``src`` of a file block to
    offset ``dst`` of the packed block, writes the unpacked sub-block scales ``scales`` (one
    :class:`ScaleByte` per packed byte; empty when the scales are among the copied bytes or
    the type has none), and reads the fp16 scale ``d`` at byte ``d_off`` and the minimum ``m``
    at ``m_off`` (-1: none, ``has_min`` False). ``signed``: the packed quants are int8.
    ``scale``: how ``d`` is encoded in the file, ``"f16"`` (two bytes) or ``"e8m0"`` (MXFP4's
    one exponent byte, whose value the type's kernels take as ggml's ``GGML_E8M0_TO_FP32_HALF``,
    ``2**(e - 128)``); :meth:`scale_lookup` says what ``d`` holds in each mode. ``f32_bits``: the
    ``f32`` mode's kernels too take the file's scale bits (:meth:`scale_bits`).
    """

    weights: int
    file_bytes: int
    packed_bytes: int
    copy: tuple[int, int, int]
    d_off: int
    m_off: int = -1
    scales: tuple[ScaleByte, ...] = ()
    signed: bool = False
    scale: str = "f16"
    f32_bits: bool = False

    def __post_init__(self) -> None:
        if self.scale not in _SCALE_TABLES:
            raise ValueError(f"BlockFormat: scale must be one of {sorted(_SCALE_TABLES)}, got {self.scale!r}")

    @property
    def has_min(self) -> bool:
        return self.m_off >= 0

    def scale_bits(self, mode: str) -> bool:
        """Whether a packed weight's ``d`` and ``m`` hold the file's scale bits (uint16: fp16 bits,
        or the E8M0 byte) in activation ``mode``, else float32 values. The ``q8`` kernels widen the
        bits as they read (F16C: a Q4_0 block streams 18 bytes, as in the file, instead of 20), and
        so do the ``f32`` ones of a type with :attr:`f32_bits`; the other ``f32`` kernels multiply
        float32 values as they are. :meth:`llamatrace.kernels.types.packing.Weight.scales_f32`
        gives float32 in either."""
        return mode == "q8" or self.f32_bits

    def scale_dtype(self, mode: str) -> np.dtype:
        """The dtype of a packed weight's ``d`` and ``m`` in activation ``mode`` (:meth:`scale_bits`)."""
        return np.dtype(np.uint16 if self.scale_bits(mode) else np.float32)

    def scale_lookup(self, mode: str) -> np.ndarray:
        """[65536]: the little-endian uint16 read at ``d_off`` (or ``m_off``) of a file block ->
        what the packed ``d`` / ``m`` hold in activation ``mode`` (:meth:`scale_bits`): the
        float32 value, or the file's scale bits (fp16 bits, or the E8M0 byte)."""
        return _SCALE_TABLES[self.scale][self.scale_bits(mode)]

    def scale_values(self, bits: np.ndarray) -> np.ndarray:
        """float32 values of scales held as bits (:meth:`scale_bits`; or as read from the file:
        the uint16 at ``d_off``)."""
        return _SCALE_TABLES[self.scale][0][np.asarray(bits, np.uint16)]

    def scale_table(self) -> np.ndarray:
        """:attr:`scales` as int64 ``[n, 7]`` rows (the fields of :class:`ScaleByte`, in order),
        for the Numba repacker."""
        rows = [(s.dst, s.lo_byte, s.lo_shift, s.lo_mask, s.hi_byte, s.hi_shift, s.hi_mask) for s in self.scales]
        return np.array(rows, np.int64).reshape(len(rows), 7)


class PackedWeight(Protocol):
    """What the registry reads of a packed weight, a :class:`llamatrace.kernels.types.packing.Weight`
    (whose arrays its kernels read). Declared here, not imported: packing builds its weights from
    this module's tables, so the registry names no class of packing."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    n_in: int
    n_out: int

    @property
    def mode(self) -> str: ...


@dataclass(frozen=True)
class Kernel:
    """One matmul kernel: ``run(x, w, out)`` with x float32 C-contiguous ``[S, n_in]``, ``w`` a
    :class:`~llamatrace.kernels.types.packing.Weight`, out float32 C-contiguous ``[S, n_out]``: a thin
    adapter calling a Numba kernel with the weight's arrays. ``twin(x, w)`` -> float32
    ``[S, n_out]``: its NumPy twin (float64 sums; the tests hold one against the other)."""

    run: Callable[[np.ndarray, PackedWeight, np.ndarray], None]
    twin: Callable[[np.ndarray, PackedWeight], np.ndarray]

    @property
    def name(self) -> str:
        """``module.function`` of the adapter, as :func:`describe` and ``llamatrace info`` show it."""
        return f"{self.run.__module__.rsplit('.', 1)[-1]}.{self.run.__name__}"


@dataclass(frozen=True)
class F32Layout:
    """A type whose ``f32`` decode kernel reads its packed bytes in an order of its own (Q6_K's
    quants as 6-bit fields of dwords, :mod:`llamatrace.kernels.types.k_quants`): ``pack(qs)``
    rewrites freshly packed tiles ``qs`` uint8 ``[T, B, P, TR]`` (byte order) in place;
    ``rows_np(qs, t, r)`` gives rows ``r`` of tiles ``t`` (int [n] each) back in byte order,
    uint8 ``[n, B, P]`` (what :attr:`QuantType.dequant_np` reads)."""

    pack: Callable[[np.ndarray], None]
    rows_np: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class QuantType:
    """One GGML type, everything llamatrace knows of it (module docstring).

    ``block``: its :class:`BlockFormat` (None for F32/F16/BF16, which
    :mod:`llamatrace.kernels.types.floats` tiles). ``dequant_np(p, d, m)``: packed bytes uint8
    ``[n, B, packed_bytes]`` in file order (int8 when ``signed``), ``d`` / ``m`` float32
    ``[n, B]`` (``m`` None without a minimum) -> float32 ``[n, B*weights]``, bit for bit
    ``gguf.quants.dequantize``; for a float type ``p`` is the packed row values ``[n, n_in]``
    and ``d``, ``m`` None. ``kernels``: per mode in :data:`MODES`, the ``(decode, prefill)``
    :class:`Kernel` pair (the same kernel twice where one serves both); ``"f32"`` is required.
    ``q8_bytes = (head, end)``: the packed bytes of a block row that the ``q8`` kernels read in
    groups of four (:func:`llamatrace.kernels.int8.act8.grouped_bytes`); required with ``"q8"``
    kernels. ``quantize`` and its NumPy twin ``quantize_np``: the type's quantizer (float32 rows
    -> the file's block bytes, :mod:`llamatrace.kernels.quantizers.rows`), None where none is wired.
    ``f32_layout``: how the ``f32`` mode's packed quant bytes differ from ``[T, B, P, TR]`` byte
    order, None where they do not (:class:`F32Layout`).
    """

    ggml_type: gguf.GGMLQuantizationType
    block: BlockFormat | None
    dequant_np: Callable[..., np.ndarray]
    kernels: Mapping[str, tuple[Kernel, Kernel]]
    q8_bytes: tuple[int, int] | None = None
    quantize: Callable[..., np.ndarray] | None = None
    quantize_np: Callable[..., np.ndarray] | None = None
    f32_layout: F32Layout | None = None

    def kernel(self, mode: str, phase: str) -> Kernel | None:
        """The kernel for ``mode`` and ``phase``, None if the type has none in that mode."""
        pair = self.kernels.get(mode)
        return pair[PHASES.index(phase)] if pair else None


TYPES: dict[gguf.GGMLQuantizationType, QuantType] = {}
"""Every declared type, filled by :func:`declare`."""

FORMATS: dict[gguf.GGMLQuantizationType, BlockFormat] = {}
"""The block types' formats (the ``block`` of each declared type that has one)."""

_KERNELS: dict[tuple[gguf.GGMLQuantizationType, str, str], Kernel] = {}     # matmul's flat lookup


def declare(qt: QuantType) -> QuantType:
    """Register ``qt`` (once per type) and return it. Raises ``ValueError`` for a type declared
    twice, a mode not in :data:`MODES`, a type without ``"f32"`` kernels, or ``"q8"`` kernels
    without ``q8_bytes``; nothing is registered then."""
    name = qt.ggml_type.name
    if qt.ggml_type in TYPES:
        raise ValueError(f"quant type {name} declared twice")
    if not set(qt.kernels) <= set(MODES) or "f32" not in qt.kernels:
        raise ValueError(f"{name}: kernels are declared per activation mode of {MODES}, 'f32' required; "
                         f"got {sorted(qt.kernels)}")
    if ("q8" in qt.kernels) != (qt.q8_bytes is not None):
        raise ValueError(f"{name}: 'q8' kernels and q8_bytes go together")
    TYPES[qt.ggml_type] = qt
    if qt.block is not None:
        FORMATS[qt.ggml_type] = qt.block
    for mode, pair in qt.kernels.items():
        for phase, kern in zip(PHASES, pair):
            _KERNELS[qt.ggml_type, mode, phase] = kern
    return qt


def served_types(mode: str = "f32") -> frozenset[gguf.GGMLQuantizationType]:
    """The declared types with kernels in activation mode ``mode`` (every type has ``f32``)."""
    return frozenset(t for t, qt in TYPES.items() if mode in qt.kernels)


def lookup(ggml_type, mode: str, phase: str) -> Kernel:
    """The kernel serving ``(ggml_type, mode, phase)``; :class:`UnsupportedModelError` if none is
    declared."""
    try:
        return _KERNELS[gguf.GGMLQuantizationType(ggml_type), mode, phase]
    except (KeyError, ValueError):
        name = getattr(ggml_type, "name", str(ggml_type))
        raise UnsupportedModelError(f"no kernel computes with {name} weights in activation mode "
                                    f"{mode!r} for {phase}") from None


def served() -> list[tuple[gguf.GGMLQuantizationType, str, str]]:
    """Every declared ``(ggml_type, mode, phase)``."""
    return list(_KERNELS)


def describe(w: PackedWeight) -> dict[str, str]:
    """``{"decode": name, "prefill": name}``: the kernels :func:`matmul` runs for ``w``.
    Raises :class:`UnsupportedModelError` if one is missing."""
    return {phase: lookup(w.ggml_type, w.mode, phase).name for phase in PHASES}


def summary(type_name: str) -> str:
    """One line naming the kernels that multiply a matrix of the GGML type ``type_name`` (e.g.
    ``"Q4_1"``): ``"q4.gemv_q4_1 / q4.tiled_q4_1, q8: q4.act8_gemv_q4_1 / q4.act8_prefill_q4_1"``
    (decode / prefill, then the ``q8`` mode's when the type has its own), or ``"-"`` when the type
    is not declared."""
    qt = TYPES.get(getattr(gguf.GGMLQuantizationType, type_name, None))
    if qt is None:
        return "-"
    names = {mode: " / ".join(dict.fromkeys(k.name for k in pair)) for mode, pair in qt.kernels.items()}
    return names["f32"] + (f", q8: {names['q8']}" if "q8" in names else "")


def matmul(x: np.ndarray, w: PackedWeight, out: np.ndarray | None = None) -> np.ndarray:
    """``y = x @ W.T`` by the kernel registered for ``w``'s type, activation mode and the phase
    (``decode`` up to :data:`GEMV_MAX_SEQ` rows, else ``prefill``); float32 accumulation.

    x: float32 ``[seq_len, n_in]`` (a 1-D ``[n_in]`` is treated as one row and gives a 1-D
    result); converted to C-contiguous float32 if it is not. out: optional float32 C-contiguous
    ``[seq_len, n_out]`` to write into. Returns float32 ``[seq_len, n_out]``.
    Raises ``ValueError`` on a shape mismatch, :class:`UnsupportedModelError` if no kernel is
    declared for the combination.
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
        key = (w.ggml_type, w.mode, "decode" if n_seq <= GEMV_MAX_SEQ else "prefill")
        kern = _KERNELS.get(key)
        if kern is None:
            kern = lookup(*key)          # raises the error
        kern.run(x2, w, out)
    return out[0] if squeeze else out
