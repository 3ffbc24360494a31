"""The kernel registry: which kernel computes ``x @ W.T`` for a weight, and :func:`matmul`.

Each kernel module declares, beside its definitions, what it serves (the registry pattern of
gguf-py's ``quants.py``, where each quant class registers its ``qtype``):

- :func:`block_format`: a GGML block type's sizes, where the packers find its fp16 scales and
  quant bytes in a file block, and its NumPy dequantizer (:class:`BlockFormat`);
- :func:`kernel`: a decorator on a thin adapter ``(x, w, out) -> None`` that calls the type's
  Numba kernel with the weight's arrays, for a GGML type, an activation mode (:data:`MODES`) and
  a phase (:data:`PHASES`).

:func:`matmul` picks the phase from the number of rows of ``x`` (:data:`GEMV_MAX_SEQ`) and runs
the registered adapter: ``forward()`` -> :func:`matmul` -> the adapter beside its kernel.
:func:`describe` names the kernels serving a weight (``llamatrace info`` shows them).

The tables fill when :mod:`llamatrace.kernels` is imported (its ``__init__`` imports every
kernel module); this module imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import gguf
import numpy as np

from llamatrace.errors import UnsupportedModelError

if TYPE_CHECKING:
    from llamatrace.kernels.packing import Weight

MODES = ("f32", "q8")
"""Activation modes: float32 activations (the default, the reference) or 8-bit
(:mod:`llamatrace.kernels.act8`)."""

PHASES = ("decode", "prefill")
"""``decode``: the GEMV kernels for a few rows of ``x`` (weights decoded in registers, once per
row); ``prefill``: the tiled kernels for more rows (each tile dequantized once, reused by every row)."""

GEMV_MAX_SEQ = 4
"""Up to this many rows of ``x`` take the ``decode`` kernels, more the ``prefill`` ones."""

SCALES_COPIED, SCALES_Q3_K, SCALES_K4 = 0, 1, 2
"""How the packers write a block's sub-block scales (:attr:`BlockFormat.scales`): none beyond
the copied bytes; Q3_K's 12 bytes of 6-bit scales as 16 bytes; Q4_K/Q5_K's 12 bytes
(ggml's ``get_scale_min_k4``) as 8 scales and 8 mins."""


@dataclass(frozen=True)
class BlockFormat:
    """A GGML block type as the packers (:mod:`llamatrace.kernels.packing`) see it.

    ``weights`` per block; ``file_bytes`` per block in the GGUF file; ``packed_bytes``: the
    bytes per row and block in the packed tiles (``qs [T, B, packed_bytes, TR]``). The packer
    copies ``copy = (src, dst, n)``: ``n`` quant bytes from offset ``src`` of a file block to
    offset ``dst`` of the packed block, unpacks sub-block scales per ``scales``
    (``SCALES_*``), and reads the fp16 scale ``d`` at byte ``d_off`` and the minimum ``m`` at
    ``m_off`` (-1: none, ``has_min`` False). ``signed``: the packed quants are int8.
    ``dequant_np(p, db, mb)``: packed bytes uint8 ``[n, B, packed_bytes]`` (file order), ``db``
    / ``mb`` float32 ``[n, B]`` (``mb`` None without a minimum) -> float32 ``[n, B*weights]``,
    bit for bit ``gguf.quants.dequantize``.
    """

    ggml_type: gguf.GGMLQuantizationType
    weights: int
    file_bytes: int
    packed_bytes: int
    copy: tuple[int, int, int]
    d_off: int
    m_off: int
    dequant_np: Callable[[np.ndarray, np.ndarray, np.ndarray | None], np.ndarray]
    scales: int = SCALES_COPIED
    signed: bool = False

    @property
    def has_min(self) -> bool:
        return self.m_off >= 0


@dataclass(frozen=True)
class Kernel:
    """A registered adapter: ``run(x, w, out)`` with x float32 C-contiguous ``[S, n_in]``, ``w``
    a :class:`~llamatrace.kernels.packing.Weight`, out float32 C-contiguous ``[S, n_out]``."""

    name: str
    run: Callable[[np.ndarray, "Weight", np.ndarray], None]


FORMATS: dict[gguf.GGMLQuantizationType, BlockFormat] = {}
"""The block types' formats, filled by :func:`block_format`."""

_KERNELS: dict[tuple[gguf.GGMLQuantizationType, str, str], Kernel] = {}


def block_format(fmt: BlockFormat) -> BlockFormat:
    """Declare ``fmt`` (once per type; a second declaration raises ``ValueError``)."""
    if fmt.ggml_type in FORMATS:
        raise ValueError(f"block format of {fmt.ggml_type.name} declared twice")
    FORMATS[fmt.ggml_type] = fmt
    return fmt


def kernel(ggml_types, mode: str, phases):
    """Decorator: register ``run(x, w, out)`` for each of ``ggml_types`` (one
    ``GGMLQuantizationType`` or a tuple) in activation mode ``mode`` (``"f32"`` | ``"q8"``) and
    each of ``phases`` (``"decode"`` | ``"prefill"``, or a tuple of both). Its name in
    :func:`describe` is ``module.function``. Raises ``ValueError`` for an unknown mode or phase
    or a combination registered twice."""
    ggml_types = ggml_types if isinstance(ggml_types, tuple) else (ggml_types,)
    phases = phases if isinstance(phases, tuple) else (phases,)
    if mode not in MODES or not set(phases) <= set(PHASES):
        raise ValueError(f"kernel: mode must be one of {MODES} and phases in {PHASES}, got {mode!r}, {phases!r}")

    def register(run):
        name = f"{run.__module__.rsplit('.', 1)[-1]}.{run.__name__}"
        for ggml_type in ggml_types:
            for phase in phases:
                key = (gguf.GGMLQuantizationType(ggml_type), mode, phase)
                if key in _KERNELS:
                    raise ValueError(f"kernel {name}: {key[0].name}/{mode}/{phase} is already "
                                     f"served by {_KERNELS[key].name}")
                _KERNELS[key] = Kernel(name, run)
        return run

    return register


def lookup(ggml_type, mode: str, phase: str) -> Kernel:
    """The kernel serving ``(ggml_type, mode, phase)``; :class:`UnsupportedModelError` if none is
    registered."""
    try:
        return _KERNELS[gguf.GGMLQuantizationType(ggml_type), mode, phase]
    except (KeyError, ValueError):
        name = getattr(ggml_type, "name", str(ggml_type))
        raise UnsupportedModelError(f"no kernel computes with {name} weights in activation mode "
                                    f"{mode!r} for {phase}") from None


def served() -> list[tuple[gguf.GGMLQuantizationType, str, str]]:
    """Every registered ``(ggml_type, mode, phase)``."""
    return list(_KERNELS)


def mode_of(w: Weight) -> str:
    """The activation mode ``w`` was packed for."""
    return "q8" if w.act8 else "f32"


def describe(w: Weight) -> dict[str, str]:
    """``{"decode": name, "prefill": name}``: the kernels :func:`matmul` runs for ``w``.
    Raises :class:`UnsupportedModelError` if one is missing."""
    return {phase: lookup(w.ggml_type, mode_of(w), phase).name for phase in PHASES}


def summary(type_name: str) -> str:
    """One line naming the kernels that multiply a matrix of the GGML type ``type_name`` (e.g.
    ``"Q4_1"``): ``"q4.gemv_q4_1 / q4.tiled_q4_1, q8: act8.matmul_q4_1"`` (decode / prefill,
    then the ``q8`` mode's when the type has its own), or ``"-"`` when none is registered."""
    ggml_type = getattr(gguf.GGMLQuantizationType, type_name, None)
    names = {mode: [_KERNELS[ggml_type, mode, p].name for p in PHASES if (ggml_type, mode, p) in _KERNELS]
             for mode in MODES}
    if not names["f32"]:
        return "-"
    line = " / ".join(dict.fromkeys(names["f32"]))
    return line + (f", q8: {' / '.join(dict.fromkeys(names['q8']))}" if names["q8"] else "")


def matmul(x: np.ndarray, w: Weight, out: np.ndarray | None = None) -> np.ndarray:
    """``y = x @ W.T`` by the kernel registered for ``w``'s type, activation mode and the phase
    (``decode`` up to :data:`GEMV_MAX_SEQ` rows, else ``prefill``); float32 accumulation.

    x: float32 ``[seq_len, n_in]`` (a 1-D ``[n_in]`` is treated as one row and gives a 1-D
    result); converted to C-contiguous float32 if it is not. out: optional float32 C-contiguous
    ``[seq_len, n_out]`` to write into. Returns float32 ``[seq_len, n_out]``.
    Raises ``ValueError`` on a shape mismatch, :class:`UnsupportedModelError` if no kernel is
    registered for the combination.
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
        key = (w.ggml_type, "q8" if w.act8 else "f32", "decode" if n_seq <= GEMV_MAX_SEQ else "prefill")
        kern = _KERNELS.get(key)
        if kern is None:
            kern = lookup(*key)          # raises the error
        kern.run(x2, w, out)
    return out[0] if squeeze else out
