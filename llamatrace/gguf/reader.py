"""Open a GGUF file: validated header, metadata, memory-mapped tensors, and the GGUF → Meta name map.

The header is decoded at the offsets :mod:`llamatrace.gguf.validate` checked, not by gguf-py's
``GGUFReader`` (which builds a Python object per string: seconds for Llama 3's vocabulary).
Like ``ReaderTensor``, :attr:`Tensor.shape` is in ggml order (``ne[0]`` = fastest = in_features
first) while :attr:`Tensor.data` is in NumPy order (``[out_features, row_bytes]`` for quantized
types). We always speak NumPy / Meta order: a matrix is ``[out_features, in_features]``.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Container

import gguf
import numpy as np

from llamatrace.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError, shown
from llamatrace.gguf.header import ARRAY, FIXED, STRING
from llamatrace.gguf.metadata import check_metadata_types
from llamatrace.gguf.validate import validate_gguf

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
    # what other architectures add (llamatrace.model.config.ARCHITECTURES)
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_qkv.weight": "wqkv",
    "attn_qkv.bias": "bqkv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "attention_post_norm",
    "post_ffw_norm.weight": "ffn_post_norm",
    "attn_sinks.weight": "sinks",
    "attn_output.bias": "bo",
}

META_TO_GGUF = {meta: name for name, meta in GGUF_TO_META.items()}


def gguf_name(meta: str, layer: int | None = None) -> str:
    """The GGUF tensor name of Meta's weight ``meta`` (``gguf_name("wq", 0) == "blk.0.attn_q.weight"``)."""
    name = META_TO_GGUF[meta]
    return name if layer is None else f"blk.{layer}.{name}"


def weight_tensor_name(suffix: str, layer: int | None, names: Container[str]) -> tuple[str, bool]:
    """The GGUF tensor behind a stage weight (``"attn_q.weight"`` of ``layer`` → ``blk.0.attn_q.weight``).

    Returns ``(name, tied)``: without an ``output.weight`` in ``names`` the output projection is
    the token embedding (``token_embd.weight``, tied = True), as llama.cpp reads such files; a
    weight stored fused into another (:data:`_FUSED`) is that tensor.
    """
    name = suffix if layer is None else f"blk.{layer}.{suffix}"
    if suffix == "output.weight" and name not in names:
        return "token_embd.weight", True
    if suffix == "ffn_norm.weight" and name not in names:      # Qwen3.5: the FFN pre-norm is attn_post_norm
        return f"blk.{layer}.post_attention_norm.weight", False
    fused = _FUSED.get(suffix)
    if fused is not None and name not in names and f"blk.{layer}.{fused}" in names:
        return f"blk.{layer}.{fused}", False
    return name, False


_FUSED = {"attn_q.weight": "attn_qkv.weight", "attn_k.weight": "attn_qkv.weight", "attn_v.weight": "attn_qkv.weight",
          "attn_q.bias": "attn_qkv.bias", "attn_k.bias": "attn_qkv.bias", "attn_v.bias": "attn_qkv.bias",
          "ffn_gate.weight": "ffn_up.weight"}
"""A weight that a file may store fused into another (q|k|v in ``attn_qkv``: Phi-3's, or any family's
converted with ``--fuse-qkv``; Phi-3's gate|up in ``ffn_up``)."""
FUSED_TENSORS = tuple(sorted(set(_FUSED.values())))
"""Suffixes of the tensors that may hold several weights (``str.endswith`` takes the tuple)."""


# Large arrays decoded only when asked for (:meth:`GGUFFile.field`), never shown as metadata.
_BULK_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
              "tokenizer.ggml.scores")

_U64 = struct.Struct("<Q")

# Element types of tensor data as gguf-py exposes it; other types are raw bytes [rows, row_bytes].
_T = gguf.GGMLQuantizationType
_TENSOR_DTYPE = {_T.F32: np.float32, _T.F16: np.float16, _T.F64: np.float64, _T.I8: np.int8,
                 _T.I16: np.int16, _T.I32: np.int32, _T.I64: np.int64}


@dataclass(frozen=True, eq=False)
class Tensor:
    """One tensor of a GGUF file; :attr:`data` is a read-only view of the memory map (never copied).

    ``shape`` is in ggml order (``ne[0]`` = fastest = in_features first), as gguf-py's
    ``ReaderTensor``; ``data`` is in NumPy order: ``[out_features, in_features]`` for F32/F16,
    uint8 ``[out_features, row_bytes]`` for quantized types and BF16.
    """

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    offset: int                                  # of the data in the file, bytes
    _map: mmap.mmap = field(repr=False)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes in the memory map, a new read-only view on each access (so that
        :meth:`GGUFFile.close` can unmap the file once no view is held).

        Raises:
            ValueError: the file is closed.
        """
        if self._map.closed:
            raise ValueError(f"tensor {self.name!r}: its GGUF file is closed")
        np_dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        dtype = _TENSOR_DTYPE.get(self.tensor_type)
        if dtype is None:
            block, type_size = gguf.GGML_QUANT_SIZES[self.tensor_type]
            return np.frombuffer(self._map, np.uint8, self.n_bytes, self.offset).reshape(
                *np_dims[:-1], np_dims[-1] // block * type_size)
        return np.frombuffer(self._map, dtype, self.n_elements, self.offset).reshape(np_dims)


@dataclass
class GGUFFile:
    """An opened GGUF file, memory-mapped until :meth:`close` (``with open_gguf(path) as f:``).

    Attributes:
        path: the file.
        metadata: decoded key → value (Python scalars, str, lists), except the bulk tokenizer
            arrays (see :data:`_BULK_KEYS`; read them with :meth:`field`).
        tensors: GGUF tensor name → :class:`Tensor`, in file order.
        file_size: bytes.
        version: the GGUF format version (2 or 3).
        read: the names :meth:`tensor` has been asked for (a loader's leftovers are the rest).
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Tensor]
    file_size: int
    version: int
    _map: mmap.mmap
    _kv_offsets: dict[str, tuple[int, int]]
    _string_lengths: dict[int, np.ndarray]      # GGUFSummary.string_lengths
    read: set[str] = field(default_factory=set)

    def field(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (bulk arrays included, as lists), or ``default``.

        Raises:
            ValueError: a bulk array is asked for after :meth:`close`.
        """
        if key in self.metadata:
            return self.metadata[key]
        if key not in self._kv_offsets:
            return default
        if self._map.closed:
            raise ValueError(f"{self.path.name}: the GGUF file is closed; {key!r} was not read before")
        return _decode(self._map, *self._kv_offsets[key], self._string_lengths)

    def strings(self, key: str) -> StringArray | None:
        """The string array ``key`` as one buffer (:class:`StringArray`; ``field`` gives the same
        strings as a list), or None when the key is absent or not an array of strings.

        Raises:
            ValueError: asked for after :meth:`close`.
        """
        if key not in self._kv_offsets or self.value_type(key) != (ARRAY, STRING):
            return None
        pos = self._kv_offsets[key][1]
        return _string_array(self._map, pos, self._string_lengths[pos])

    def keys(self) -> list[str]:
        """Every metadata key, bulk arrays included, in file order."""
        return list(self._kv_offsets)

    def value_type(self, key: str) -> tuple[int, int | None]:
        """The GGUF value type of metadata ``key`` and, for an array, its elements' type (else None)
        (:class:`gguf.GGUFValueType` numbers), so that a writer can copy the value as it was.

        Raises:
            KeyError: no such key.
            ValueError: an array's type is asked for after :meth:`close`.
        """
        vtype, pos = self._kv_offsets[key]
        if vtype != ARRAY:
            return vtype, None
        if self._map.closed:
            raise ValueError(f"{self.path.name}: the GGUF file is closed")
        return vtype, struct.unpack_from("<I", self._map, pos)[0]

    def close(self) -> None:
        """Unmap the file (again: nothing). :attr:`metadata` and the tensors' names, types and
        shapes stay readable; :attr:`Tensor.data` then raises ``ValueError``.

        Raises:
            BufferError: an array from :attr:`Tensor.data` is still referenced (drop it first).
        """
        try:
            self._map.close()
        except BufferError:
            raise BufferError(f"{self.path.name}: cannot unmap it while an array from Tensor.data "
                              f"is still referenced; drop those arrays first") from None

    @property
    def closed(self) -> bool:
        return self._map.closed

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except BufferError:
            # leaving on an exception (Ctrl-C mid-write): its traceback's frames still hold views
            # of the map; that exception, not this one, is what the caller must see. The map is
            # unmapped when the last view goes.
            if exc is None:
                raise

    def release(self, t: Tensor, start: int = 0, n_bytes: int | None = None) -> None:
        """Drop ``t``'s pages (or those of its bytes ``start .. start + n_bytes``, e.g. one expert of
        a 3-D tensor) from this process's memory once they have been copied (packed); pages shared
        with bytes outside the range stay.

        The bytes stay in the OS page cache and are read again if ``t.data`` is used; without
        this, a load would hold the file's pages and the packed copy at once (~2x the file).
        """
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start += t.offset
        end = t.offset + t.n_bytes if n_bytes is None else start + n_bytes
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = end // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def tensor(self, name: str) -> Tensor:
        """The tensor called ``name``.

        Raises:
            ModelFormatError: the tensor is missing.
        """
        t = self._find(name)
        self.read.add(name)
        return t

    def matrix_shape(self, name: str) -> tuple[int, ...]:
        """Shape in NumPy / Meta order (``[out_features, in_features]`` for a matrix); not a read.

        Raises:
            ModelFormatError: the tensor is missing.
        """
        return tuple(int(d) for d in reversed(self._find(name).shape.tolist()))

    def _find(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path.name}: required tensor {shown(name)} is missing; "
                                   f"the GGUF file is incomplete or not a llama model") from None


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    n = _U64.unpack_from(buf, pos)[0]
    raw = buf[pos + 8:pos + 8 + n]
    try:
        return raw.decode("utf-8"), pos + 8 + n
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), pos + 8 + n


def _decode(buf: mmap.mmap, vtype: int, pos: int, string_lengths: dict[int, np.ndarray]) -> Any:
    """The value of type ``vtype`` at ``pos`` (offsets already checked by validate_gguf;
    ``string_lengths``: :attr:`GGUFSummary.string_lengths`)."""
    if vtype == STRING:
        return _string(buf, pos)[0]
    if vtype != ARRAY:
        return struct.unpack_from(FIXED[vtype].fmt, buf, pos)[0]
    etype, n = struct.unpack_from("<IQ", buf, pos)
    if etype != STRING:
        return np.frombuffer(buf, dtype=FIXED[etype].dtype, count=n, offset=pos + 12).tolist()
    return _string_array(buf, pos, string_lengths[pos]).tolist()


@dataclass(frozen=True)
class StringArray:
    """A GGUF array of strings held as one buffer: string ``i`` is ``data[ends[i-1]:ends[i]]``.

    Attributes:
        data: the strings' UTF-8 bytes, joined (no length prefixes).
        ends: int64 ``[n]``, each string's end offset in ``data``, bytes.
    """

    data: bytes
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.ends)

    def chars(self) -> tuple[str, np.ndarray] | None:
        """The strings as one text and each one's end in it (characters, int64 ``[n]``), or None
        when the bytes are not valid UTF-8."""
        try:
            text = self.data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if len(text) == len(self.data):     # ASCII: characters are bytes
            return text, self.ends
        raw = np.frombuffer(self.data, np.uint8)
        starts = np.cumsum((raw & 0xC0) != 0x80, dtype=np.int32 if len(raw) < 2**31 else np.int64)
        return text, np.concatenate(([0], starts))[self.ends].astype(np.int64)

    def tolist(self) -> list[str]:
        """The strings, each decoded as UTF-8; a string that is not valid UTF-8 gets U+FFFD for
        its bad bytes, as ``bytes.decode(errors="replace")`` (and gguf-py) would give it alone."""
        joined = self.chars()
        if joined is None:          # rare: decode each string on its own
            ends = self.ends.tolist()
            return [self.data[a:b].decode("utf-8", errors="replace") for a, b in zip([0, *ends[:-1]], ends)]
        text, ends = joined
        ends = ends.tolist()
        return list(map(text.__getitem__, map(slice, [0, *ends[:-1]], ends)))      # no Python loop: ~2x


def _string_array(buf: mmap.mmap, pos: int, lengths: np.ndarray) -> StringArray:
    """The string array whose header (element type, count) is at ``pos``, as one buffer.

    ``lengths``: each string's length (:attr:`GGUFSummary.string_lengths`: validate_gguf's walk
    found them, so no Python loop runs here). The bytes are moved out of the length prefixes in
    one NumPy step."""
    n, start = len(lengths), pos + 12
    ends = np.cumsum(lengths, dtype=np.int64)
    prefix = np.arange(n, dtype=np.int64) * 8 + ends - lengths      # each length prefix, from start
    size = 8 * n + (int(ends[-1]) if n else 0)
    keep = np.ones(size, bool)
    for k in range(8):
        keep[prefix + k] = False
    return StringArray(np.frombuffer(buf, np.uint8, size, start)[keep].tobytes(), ends)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Validate and open a GGUF file: metadata decoded, tensors mapped, nothing copied. Close it
    (:meth:`GGUFFile.close`, or ``with open_gguf(path) as f:``) when done with its tensors' data.

    The header is read with the offsets :func:`llamatrace.gguf.validate.validate_gguf` checked (it
    walks Llama 3's 128k-token header in ~0.1 s, where gguf-py's ``GGUFReader`` takes ~4–7 s).

    Raises:
        ModelNotFoundError: missing or unreadable file.
        ModelFormatError: not a GGUF file, truncated, an inconsistent header, or a key llamatrace
            reads stored with another type than :data:`~llamatrace.gguf.metadata.KEY_TYPES` declares.
    """
    summary = validate_gguf(path)
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"{p}: cannot map the file ({exc}); check the path and free memory") from None
    if len(buf) != summary.file_size:
        buf.close()
        raise ModelFormatError(f"{p.name}: the file changed size while it was opened; open it again")
    metadata = {key: _decode(buf, *where, summary.string_lengths)
                for key, where in summary.kv_offsets.items() if key not in _BULK_KEYS}
    tensors = {}
    for name, dims, ttype, offset in summary.tensor_infos:
        qtype = _T(ttype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims, dtype=np.int64))
        tensors[name] = Tensor(name, qtype, np.asarray(dims, dtype=np.uint64), n_elements,
                               n_elements // block * type_size, summary.data_offset + offset, buf)
    f = GGUFFile(path=p, metadata=metadata, tensors=tensors, file_size=summary.file_size,
                 version=summary.version, _map=buf, _kv_offsets=summary.kv_offsets,
                 _string_lengths=summary.string_lengths)
    try:
        check_metadata_types(f.value_type, summary.kv_offsets, metadata, p.name)
    except ModelFormatError:
        f.close()
        raise
    return f


def tensor_type_name(t: Any) -> str:
    """The ggml type name of tensor ``t`` (anything with a ``tensor_type``): ``"Q4_K"``, ``"F32"`` …"""
    return gguf.GGMLQuantizationType(t.tensor_type).name


def check_tensor_types(f: GGUFFile, supported: frozenset) -> None:
    """Raise :class:`UnsupportedModelError` naming the first tensor of an unsupported type."""
    for name, t in f.tensors.items():
        if t.tensor_type not in supported:
            names = ", ".join(sorted(gguf.GGMLQuantizationType(x).name for x in supported))
            raise UnsupportedModelError(
                f"{f.path.name}: tensor {shown(name)} has type {tensor_type_name(t)}, which llamatrace does not "
                f"support yet (supported: {names}); download a Q4_K_M, Q8_0 or F16 version of the model "
                f"instead, or quantize its F16/BF16 file to one of these types (llamatrace quantize)")
