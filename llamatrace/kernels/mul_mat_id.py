"""``mul_mat_id``: the chosen experts' matmuls on the GGUF file's own bytes.

ggml's ``mul_mat_id`` (``ggml-cpu/ggml-cpu.c``) multiplies each row of its input by the matrix
of the expert its id names, out of one 3-D tensor ``[n_expert, n_out, n_in]``, with the rows
grouped by expert so that each chosen expert's bytes are read once per call. Here the 3-D
tensor is the file's: :class:`FileExperts` is a read-only view of the GGUF's quantized blocks
(``[n_expert, n_out, row_bytes]``, rows of ``n_in / block`` blocks as the file stores them),
never packed or copied, so that a mixture of experts loads in the time of a map and holds the
file's pages, not a second copy of them.

:func:`mul_mat_id` (or an :class:`ExpertParts`, its parts checked once) groups the slots by
expert (:func:`_group`, one Numba call) and hands them to the activation mode's kernels
(``f32``: :mod:`llamatrace.kernels.types.mul_mat_id_f32`; ``q8``:
:mod:`llamatrace.kernels.int8.mul_mat_id_q8`), one parallel region a call. Types outside a
mode's :data:`TYPES` are packed at load instead (:mod:`llamatrace.model.moe`).
:func:`mul_mat_id_ref` is the NumPy twin: float64 dot products of ``gguf.quants.dequantize``'s
weights with the float32 activations (``f32``) or with the activations as the ``q8`` kernels
quantize them (their dequantized values).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numba
import numpy as np
from numba import njit

from llamatrace.kernels.int8 import mul_mat_id_q8
from llamatrace.kernels.types import mul_mat_id_f32
from llamatrace.machine.jit import JIT_EXACT

_POOL: list = []
"""Not empty once :func:`mul_mat_id` has launched Numba's thread pool (3 µs a call otherwise)."""
TYPES = {"f32": mul_mat_id_f32.TYPES, "q8": mul_mat_id_q8.TYPES}
"""The weight types each activation mode's ``mul_mat_id`` kernels run on the file's bytes."""


@dataclass(frozen=True, eq=False)
class FileExperts:
    """One layer's experts of one kind (say ``ffn_down_exps``) as the GGUF file stores them.

    Attributes:
        name: the GGUF tensor name.
        ggml_type: the blocks' type.
        n_out, n_in: each expert's matrix is ``[n_out, n_in]`` (NumPy order).
        data: uint8 ``[n_expert, n_out, row_bytes]``, ``row_bytes = n_in / block * block_bytes``,
            read-only, a view of a map of the file (never copied).
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    n_out: int
    n_in: int
    data: np.ndarray

    @property
    def n_expert(self) -> int:
        return int(self.data.shape[0])

    def expert(self, e: int) -> np.ndarray:
        """Expert ``e``'s weights dequantized (``gguf.quants.dequantize``): float32 ``[n_out, n_in]``."""
        return np.asarray(gguf.quants.dequantize(self.data[e], self.ggml_type), dtype=np.float32)


def supported(ggml_type, activations: str) -> bool:
    """Whether ``activations``' kernels run experts of ``ggml_type`` on the file's bytes."""
    return gguf.GGMLQuantizationType(ggml_type) in TYPES[activations]


def _check_parts(parts: tuple[FileExperts, ...]) -> None:
    if not parts or len({(p.ggml_type, p.n_in, p.n_expert) for p in parts}) != 1:
        raise ValueError("mul_mat_id: parts must be 1 or more FileExperts of one type, n_in and n_expert")


def _check_rows(x: np.ndarray, n_in: int, n_expert: int, ids: np.ndarray, rows: np.ndarray | None):
    """``ids`` and ``rows`` as int64 ``[n_slots]`` (rows None: ``arange``), or ValueError for shapes
    that do not fit (their ranges are checked by the caller)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    rows = np.arange(ids.shape[0], dtype=np.int64) if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    if x.ndim != 2 or x.shape[1] != n_in or rows.shape != ids.shape:
        raise ValueError(f"mul_mat_id: x {list(x.shape)} must be [n_rows, {n_in}] and rows {list(rows.shape)} "
                         f"match ids {list(ids.shape)}")
    return ids, rows


def _out_of_range(x: np.ndarray, n_expert: int) -> ValueError:
    return ValueError(f"mul_mat_id: ids must be in 0..{n_expert - 1} and rows in 0..{x.shape[0] - 1}")


def _checked(x: np.ndarray, parts: tuple[FileExperts, ...], ids: np.ndarray, rows: np.ndarray | None):
    _check_parts(parts)
    ids, rows = _check_rows(x, parts[0].n_in, parts[0].n_expert, ids, rows)
    if ids.size and not (0 <= ids.min() and ids.max() < parts[0].n_expert and 0 <= rows.min()
                         and rows.max() < x.shape[0]):
        raise _out_of_range(x, parts[0].n_expert)
    return ids, rows


def groups(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The slots grouped by expert, as ``ggml_mul_mat_id`` groups them: ``order`` int64
    ``[n_slots]`` (slot indices, by expert, in slot order within one), ``starts`` int64
    ``[n_groups + 1]`` (group ``g`` is ``order[starts[g]:starts[g + 1]]``) and ``experts`` int64
    ``[n_groups]`` (ascending). The NumPy twin of :func:`_group`."""
    order = np.argsort(ids, kind="stable").astype(np.int64)
    by_expert = ids[order]
    starts = np.empty(0, np.int64) if not ids.size else np.flatnonzero(by_expert[1:] != by_expert[:-1]) + 1
    starts = np.concatenate(([0] if ids.size else [], starts, [ids.shape[0]])).astype(np.int64)
    return order, starts, by_expert[starts[:-1]].astype(np.int64)


@njit(**JIT_EXACT)
def _group(ids, rows, n_expert, n_rows):
    """:func:`groups` of ``ids`` by a counting sort (stable: slot order within an expert), in one
    call (a decode step's 8 slots: the argsort and its NumPy calls cost ~9 µs a call, twice a
    layer); ``ok`` False when an id is outside ``0..n_expert-1`` or a row outside ``0..n_rows-1``."""
    n = ids.shape[0]
    order = np.empty(n, dtype=np.int64)
    starts = np.zeros(min(n, n_expert) + 1, dtype=np.int64)
    experts = np.empty(min(n, n_expert), dtype=np.int64)
    for i in range(n):
        if not (0 <= ids[i] < n_expert and 0 <= rows[i] < n_rows):
            return False, order, starts, experts
    count = np.zeros(n_expert, dtype=np.int64)
    for i in range(n):
        count[ids[i]] += 1
    n_groups, at = 0, 0
    for e in range(n_expert):                # count[e] becomes expert e's first place in order
        c = count[e]
        if c:
            experts[n_groups] = e
            starts[n_groups] = at
            n_groups += 1
        count[e] = at
        at += c
    starts[n_groups] = n
    for i in range(n):
        order[count[ids[i]]] = i
        count[ids[i]] += 1
    return True, order, starts[:n_groups + 1], experts[:n_groups]


class ExpertParts:
    """1 or more :class:`FileExperts` of one type, ``n_in`` and ``n_expert`` (gate's and up's,
    say), checked once for an activation mode's kernels: calling it is :func:`mul_mat_id` without
    the checks of the parts (a layer's MoE block builds one per call site and keeps it).

    Attributes:
        n_in, n_expert, ggml_type: the parts' common input width, expert count and weight type.

    Raises:
        ValueError: parts that differ, a type outside ``TYPES[activations]``.
    """

    def __init__(self, parts: tuple[FileExperts, ...], activations: str = "f32") -> None:
        _check_parts(parts)
        if not supported(parts[0].ggml_type, activations):
            raise ValueError(f"mul_mat_id: no {activations} kernel for {parts[0].ggml_type.name} experts")
        self.n_in, self.n_expert, self.ggml_type = parts[0].n_in, parts[0].n_expert, parts[0].ggml_type
        datas = tuple(p.data for p in parts)
        # q8: the kernels' Parts, their checks and views done once (~40 µs a call, cold)
        self._datas = mul_mat_id_q8.Parts(datas, self.ggml_type, self.n_in) if activations == "q8" else datas
        self._kernels = mul_mat_id_q8 if activations == "q8" else mul_mat_id_f32

    def __call__(self, x: np.ndarray, ids: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """``out[i] = x[rows[i]] @ W[ids[i]].T`` for every slot ``i``, ``W`` the parts' experts side
        by side, as :func:`mul_mat_id`.

        Args:
            x: float32 ``[n_rows, n_in]``.
            ids: int ``[n_slots]``, each slot's expert.
            rows: int ``[n_slots]``, each slot's row of ``x`` (None: slot ``i`` takes row ``i``).

        Returns:
            float32 ``[n_slots, sum of the parts' n_out]``.

        Raises:
            ValueError: ``x`` not ``[n_rows, n_in]``, ``rows`` and ``ids`` of different shapes, an id
                outside ``0..n_expert-1`` or a row outside ``0..n_rows-1``.
        """
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids, rows = _check_rows(x, self.n_in, self.n_expert, ids, rows)
        ok, order, starts, experts = _group(ids, rows, self.n_expert, x.shape[0])
        if not ok:
            raise _out_of_range(x, self.n_expert)
        if not _POOL:            # a parallel kernel loaded from Numba's cache needs the thread pool up first
            _POOL.append(numba.get_num_threads())       # (else: "Symbol not found: allocate_sched")
        return self._kernels.matmul_id(x, rows, order, starts, experts, self._datas, self.ggml_type)


def mul_mat_id(x: np.ndarray, parts: tuple[FileExperts, ...], ids: np.ndarray, rows: np.ndarray | None = None,
               activations: str = "f32") -> np.ndarray:
    """``out[i] = x[rows[i]] @ W[ids[i]].T`` for every slot ``i``, ``W`` the experts of ``parts``
    side by side (gate's rows then up's, say), in one parallel region.

    Args:
        x: float32 ``[n_rows, n_in]``.
        parts: 1 or more :class:`FileExperts` of one type, ``n_in`` and ``n_expert``.
        ids: int ``[n_slots]``, each slot's expert.
        rows: int ``[n_slots]``, each slot's row of ``x`` (None: slot ``i`` takes row ``i``).
        activations: ``"f32"`` or ``"q8"``.

    Returns:
        float32 ``[n_slots, sum(p.n_out for p in parts)]``.

    Raises:
        ValueError: shapes or ids out of range, parts that differ, a type outside ``TYPES[activations]``.
    """
    return ExpertParts(parts, activations)(x, ids, rows)


def mul_mat_id_ref(x: np.ndarray, parts: tuple[FileExperts, ...], ids: np.ndarray, rows: np.ndarray | None = None,
                   activations: str = "f32") -> np.ndarray:
    """NumPy twin of :func:`mul_mat_id` (any type gguf-py dequantizes): float64 sums, float32 result."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    ids, rows = _checked(x, parts, ids, rows)
    xs = mul_mat_id_q8.activations_ref(x, parts[0].ggml_type) if activations == "q8" else x.astype(np.float64)
    out = np.empty((ids.shape[0], sum(p.n_out for p in parts)), dtype=np.float32)
    for e in np.unique(ids):
        sel = np.flatnonzero(ids == e)
        w = np.concatenate([p.expert(int(e)) for p in parts]).astype(np.float64)
        out[sel] = (xs[rows[sel]] @ w.T).astype(np.float32)
    return out
