"""Open a GGUF file: validated header, metadata, and the one GGUF → Meta weight-name map.

Trap (gguf-py): ``ReaderTensor.shape`` is in ggml order (``ne[0]`` = fastest = in_features
first) while ``ReaderTensor.data`` is in NumPy order (``[out_features, row_bytes]`` for
quantized types). We always speak NumPy / Meta order: a matrix is ``[out_features, in_features]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Container

import gguf
import numpy as np

from .errors import ModelFormatError, UnsupportedModelError
from .validate import validate_gguf

# GGUF tensor name (per block: "blk.{i}." prefix) → Meta reference model.py attribute.
GGUF_TO_META = {
    "token_embd.weight": "tok_embeddings",
    "output_norm.weight": "norm",
    "output.weight": "output",
    "attn_norm.weight": "attention_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w1",
    "ffn_down.weight": "w2",
    "ffn_up.weight": "w3",
}

META_TO_GGUF = {meta: name for name, meta in GGUF_TO_META.items()}


def gguf_name(meta: str, layer: int | None = None) -> str:
    """The GGUF tensor name of Meta's weight ``meta`` (``gguf_name("wq", 0) == "blk.0.attn_q.weight"``)."""
    name = META_TO_GGUF[meta]
    return name if layer is None else f"blk.{layer}.{name}"


def weight_tensor_name(suffix: str, layer: int | None, names: Container[str]) -> tuple[str, bool]:
    """The GGUF tensor behind a stage weight (``"attn_q.weight"`` of ``layer`` → ``blk.0.attn_q.weight``).

    Returns ``(name, tied)``: without an ``output.weight`` in ``names`` the output projection is
    the token embedding (``token_embd.weight``, tied = True), as llama.cpp reads such files.
    """
    name = suffix if layer is None else f"blk.{layer}.{suffix}"
    if suffix == "output.weight" and name not in names:
        return "token_embd.weight", True
    return name, False


# Large arrays we never decode into Python lists here (the tokenizer reads them itself).
_BULK_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
              "tokenizer.ggml.scores")


class _Reader(gguf.GGUFReader):
    """GGUFReader whose buffer is a plain ndarray view of the memory map.

    gguf-py slices its ``np.memmap`` once per string while building fields; memmap slicing runs
    Python code per slice (``__array_finalize__``), which made opening SmolLM2's 49k-token
    vocabulary take ~6–12 s. The same bytes seen through a plain ndarray view take ~1–2 s.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


@dataclass
class GGUFFile:
    """An opened GGUF file.

    Attributes:
        path: the file.
        reader: the ``gguf.GGUFReader`` (memory-mapped; tensors are not copied).
        metadata: decoded key → value, except the bulk tokenizer arrays (see :data:`_BULK_KEYS`).
        tensors: GGUF tensor name → ``gguf.ReaderTensor``.
        file_size: bytes.
    """

    path: Path
    reader: gguf.GGUFReader
    metadata: dict[str, Any]
    tensors: dict[str, Any]
    file_size: int

    def tensor(self, name: str) -> Any:
        """The ``ReaderTensor`` called ``name``.

        Raises:
            ModelFormatError: the tensor is missing.
        """
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path.name}: required tensor {name!r} is missing; "
                                   f"the GGUF file is incomplete or not a llama model") from None

    def matrix_shape(self, name: str) -> tuple[int, ...]:
        """Shape in NumPy / Meta order (``[out_features, in_features]`` for a matrix)."""
        return tuple(int(d) for d in reversed(self.tensor(name).shape.tolist()))


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Validate and open a GGUF file.

    Raises:
        ModelNotFoundError: missing or unreadable file.
        ModelFormatError: not a GGUF file, truncated, or an inconsistent header (checked by
            :func:`llamatrace.validate.validate_gguf` before gguf-py sees it).
    """
    summary = validate_gguf(path)
    p = Path(path)
    try:
        reader = _Reader(p, "r")
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as exc:
        raise ModelFormatError(f"{p.name}: gguf could not parse the file ({exc}); "
                               f"it is damaged or from an incompatible writer — re-download it") from None
    metadata: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key in _BULK_KEYS:
            continue
        try:
            metadata[key] = fld.contents()
        except Exception:  # noqa: BLE001 — a value gguf-py cannot decode is simply not shown
            metadata[key] = None
    tensors = {t.name: t for t in reader.tensors}
    return GGUFFile(path=p, reader=reader, metadata=metadata, tensors=tensors, file_size=summary.file_size)


def tensor_type_name(t: Any) -> str:
    return gguf.GGMLQuantizationType(t.tensor_type).name


def check_tensor_types(f: GGUFFile, supported: frozenset) -> None:
    """Raise :class:`UnsupportedModelError` naming the first tensor of an unsupported type."""
    for name, t in f.tensors.items():
        if t.tensor_type not in supported:
            names = ", ".join(sorted(gguf.GGMLQuantizationType(x).name for x in supported))
            raise UnsupportedModelError(
                f"{f.path.name}: tensor {name!r} has type {tensor_type_name(t)}, which llamatrace does not "
                f"support yet (supported: {names}); use a GGUF quantized as Q8_0, Q4_0 or Q4_1")
