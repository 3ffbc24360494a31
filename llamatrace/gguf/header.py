"""GGUF's metadata value types, described once for the validator and the reader.

A GGUF key/value pair stores a ``gguf_type`` (gguf.h; gguf-py's :class:`gguf.GGUFValueType`)
before its value: a fixed-size little-endian scalar, a string (``uint64`` length + UTF-8 bytes),
or an array (``uint32`` element type + ``uint64`` count + elements).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType


@dataclass(frozen=True)
class ValueType:
    """One fixed-size GGUF value type: ``name`` as GGUF spells it (``uint32``), ``fmt`` its
    ``struct`` format, ``size`` its bytes, ``dtype`` the NumPy dtype of an array of it."""

    name: str
    fmt: str
    size: int
    dtype: np.dtype


STRING = int(GGUFValueType.STRING)
ARRAY = int(GGUFValueType.ARRAY)
UINT32 = int(GGUFValueType.UINT32)
VALUE_TYPES = f"{int(min(GGUFValueType))}..{int(max(GGUFValueType))}"  # "0..12", for error messages

_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}

FIXED: dict[int, ValueType] = {
    int(t): ValueType(t.name.lower(), fmt, struct.calcsize(fmt), np.dtype(fmt)) for t, fmt in _FORMATS.items()
}
"""Fixed-size value types by their ``gguf_type`` number."""


def type_name(vtype: int) -> str:
    """``uint32``, ``string``, ``array`` … or ``unknown (N)`` for a number GGUF does not define."""
    if vtype in FIXED:
        return FIXED[vtype].name
    try:
        return GGUFValueType(vtype).name.lower()
    except ValueError:
        return f"unknown ({vtype})"
