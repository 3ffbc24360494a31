"""Defensive validation of a GGUF file's header before anything else parses it.

gguf-py's :class:`gguf.GGUFReader` trusts every count, length and offset in the header: a
truncated or crafted file can make it loop for ever, allocate without bound or fail with an
arbitrary exception deep inside numpy.  :func:`validate_gguf` walks the header itself with
:mod:`struct`, checks every count and length against the bytes that are actually left in the
file *before* using it, and mirrors the limits of ggml's ``gguf.cpp`` (the fixes for
CVE-2024-21802/-21825/-21836/-23605/-23496 and CVE-2025-53630).  A file that passes can be
handed to ``GGUFReader`` (or mapped tensor by tensor) safely.

Every problem is reported as one :class:`~llamatrace.errors.ModelFormatError` line that names
the file, says what is wrong with the offending numbers and says how to fix it.  The work done
is bounded by the size of the header: every loop iteration consumes at least 8 bytes of the
file, and arrays of fixed-size elements are skipped by arithmetic, not read.

Bytes alone do not bound what comes *after* validation: ``GGUFReader`` builds Python objects per
key, per tensor and per string of a string array (~16 us each), so an 8 MB header of a million
empty strings passes a byte check in 0.16 s and then costs the reader 16.5 s.  The header is
therefore also limited in *items* (:data:`MAX_HEADER_ITEMS`), with room for gpt-oss's
201,088-token vocabulary and its ~446k merges (~647k strings).
"""

from __future__ import annotations

import os
import stat
import struct
from array import array
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llamatrace.errors import ModelFormatError, ModelNotFoundError
from llamatrace.errors import shown as show
from llamatrace.gguf.foreign import describe_foreign, show_bytes
from llamatrace.gguf.header import ARRAY, FIXED, STRING, UINT32, VALUE_TYPES, type_name

__all__ = ["GGUFSummary", "validate_gguf"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
ALIGNMENT_KEY = "general.alignment"

GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # tensor names must be shorter than this (gguf.cpp: length >= 64 is an error)
INT64_MAX = (1 << 63) - 1

# Sanity caps, far above anything a real model uses, far below anything that could hurt.
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 14
MAX_KEY_LEN = 1 << 16
MAX_STRING_LEN = 1 << 28
MAX_ARRAY_LEN = 1 << 26
MAX_HEADER_ITEMS = 1 << 21
"""Keys + tensors + strings inside string arrays: the objects a reader builds from the header.
2,097,152 admits gpt-oss's o200k vocabulary (201,088 tokens + 446,189 merges), Qwen3.5's (248,320 +
247,587) and Llama 3's (128,256 + 280,147) with room, and bounds GGUFReader to about half a minute."""

# ggml types 31-33, Q4_0 repacked for ARM in the file (2024): ggml removed them and repacks at load
_REMOVED_ARM_TYPES = {31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8"}

# Smallest possible encodings, used to bound the counts before looping over them.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, (empty key), value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, (empty name), n_dims, 1 dim, type, offset

# Names gguf-py's GGUFReader registers itself before reading the key/value pairs; a key with
# one of these names makes GGUFReader fail with a duplicate-key error.
_READER_RESERVED_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})

# ggml tensor types gguf-py knows, with (block size, bytes per block).
_TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES
}

FIX_TRUNCATED = "the file is truncated or not a GGUF model; re-download it"
FIX_CORRUPT = (
    "the file is corrupt or was written by a broken tool; re-download it or re-convert the model "
    "with llama.cpp's convert_hf_to_gguf.py"
)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")


@dataclass(frozen=True)
class GGUFSummary:
    """What :func:`validate_gguf` learned about a well-formed GGUF file."""

    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    data_offset: int  # file offset of the (aligned) tensor data section
    file_size: int
    header_items: int  # keys + tensors + strings in string arrays (bounded by MAX_HEADER_ITEMS)
    # Where things are, for a reader that trusts nothing else (llamatrace.gguf.reader): key → (value
    # type, file offset of the value); per tensor (name, ggml dims fastest-first, ggml type, offset
    # relative to data_offset), in header order.
    kv_offsets: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    tensor_infos: tuple[tuple[str, tuple[int, ...], int, int], ...] = field(default=(), repr=False)
    # per array of strings (keyed by its offset in kv_offsets): each string's length, uint32 (at
    # most MAX_STRING_LEN), found by the walk that checks them, so that a reader need not walk again
    string_lengths: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)


def validate_gguf(path: str | os.PathLike[str]) -> GGUFSummary:
    """Check that ``path`` is a well-formed little-endian GGUF v2/v3 file.

    Raises :class:`ModelNotFoundError` if the file is missing, a directory or unreadable, and
    :class:`ModelFormatError` (one line: file, problem with numbers, fix) if it is malformed.
    Runs in time bounded by the header size and never reads tensor data.
    """
    shown = _show_path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelNotFoundError(f"{shown}: no such file; check the path or download the model") from None
    except PermissionError as exc:
        raise ModelNotFoundError(
            f"{shown}: cannot access the file ({exc.strerror}); check its permissions"
        ) from None
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"{shown}: cannot access the file ({_os_reason(exc)}); check the path") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelNotFoundError(f"{shown}: is a directory, not a GGUF file; pass the .gguf file inside it")
    if not stat.S_ISREG(st.st_mode):
        raise ModelNotFoundError(f"{shown}: is not a regular file; pass a .gguf model file")
    try:
        f = open(path, "rb")
    except PermissionError as exc:
        raise ModelNotFoundError(f"{shown}: cannot read the file ({exc.strerror}); check its permissions") from None
    except OSError as exc:
        raise ModelNotFoundError(f"{shown}: cannot read the file ({_os_reason(exc)}); check the path") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            return _Parser(f, size, shown).parse()
        except OSError as exc:
            raise ModelNotFoundError(
                f"{shown}: reading the file failed ({_os_reason(exc)}); check the disk or re-download it"
            ) from None


# --------------------------------------------------------------------------------------------


class _Parser:
    """Sequential reader over the header, pulling bytes from the file only as they are needed."""

    def __init__(self, f, size: int, shown: str) -> None:
        self.f = f
        self.size = size
        self.shown = shown
        self.buf = bytearray()
        self.pos = 0
        self.items = 0  # objects a reader will build from the header; see MAX_HEADER_ITEMS
        self.kv_offsets: dict[str, tuple[int, int]] = {}
        self.tensor_infos: list[tuple[str, tuple[int, ...], int, int]] = []
        self.string_lengths: dict[int, np.ndarray] = {}

    # ---- errors -----------------------------------------------------------------------------

    def fail(self, what: str, fix: str = FIX_TRUNCATED) -> ModelFormatError:
        msg = f"{self.shown}: {what}; {fix}"
        return ModelFormatError(" ".join(msg.split()))  # guarantee a single line

    # ---- raw reads ----------------------------------------------------------------------------

    def _fill(self, end: int) -> None:
        """Make ``self.buf`` cover file bytes [0, end); ``end`` was checked against the size."""
        have = len(self.buf)
        if end <= have:
            return
        want = min(self.size, max(end, 2 * have, 1 << 16))
        self.f.seek(have)
        chunk = self.f.read(want - have)
        self.buf += chunk
        if len(self.buf) < end:  # the file shrank while we were reading it
            raise self.fail(
                f"file ended at byte {len(self.buf)} while reading the header (expected {self.size} bytes)"
            )

    def need(self, n: int, what: str) -> int:
        """Check that ``n`` more bytes exist for ``what``; return the current position."""
        pos = self.pos
        if n > self.size - pos:
            raise self.fail(
                f"{what} at byte {pos} needs {n} bytes but the file ends at byte {self.size}"
            )
        self._fill(pos + n)
        return pos

    def u32(self, what: str) -> int:
        pos = self.need(4, what)
        self.pos = pos + 4
        return _U32.unpack_from(self.buf, pos)[0]

    def u64(self, what: str) -> int:
        pos = self.need(8, what)
        self.pos = pos + 8
        return _U64.unpack_from(self.buf, pos)[0]

    def name(self, what: str, cap: int, cap_reason: str) -> str:
        """Read a length-prefixed UTF-8 string (a key or a tensor name)."""
        n = self.u64(f"length of {what}")
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"{what} at byte {self.pos - 8} claims {n} bytes but only {left} bytes are left in the file")
        if n > cap:
            raise self.fail(f"{what} at byte {self.pos - 8} is {n} bytes long, {cap_reason}", FIX_CORRUPT)
        pos = self.need(n, what)
        self.pos = pos + n
        raw = bytes(self.buf[pos : pos + n])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {pos - 8} is not valid UTF-8 ({show_bytes(raw)})", FIX_CORRUPT) from None

    def count_items(self, n: int, what: str) -> None:
        """Add ``n`` header items; fail once the header holds more than :data:`MAX_HEADER_ITEMS`."""
        self.items += n
        if self.items > MAX_HEADER_ITEMS:
            raise self.fail(
                f"the header holds over {MAX_HEADER_ITEMS} keys, tensors and strings (at {what}), "
                "far more than any real model's",
                FIX_CORRUPT,
            )

    # ---- structure ----------------------------------------------------------------------------

    def parse(self) -> GGUFSummary:
        size = self.size
        if size == 0:
            raise self.fail("the file is empty (0 bytes)", "the download failed; re-download the model")
        head_len = min(size, 64)
        self._fill(head_len)
        head = bytes(self.buf[:head_len])
        if size < 4 and GGUF_MAGIC.startswith(head):
            raise self.fail(f"the file is only {size} bytes, shorter than the {_HEADER.size}-byte GGUF header")
        if head[:4] != GGUF_MAGIC:
            raise self.fail(*describe_foreign(head))
        if size < _HEADER.size:
            raise self.fail(f"the file is only {size} bytes, shorter than the {_HEADER.size}-byte GGUF header")
        _, version, n_tensors, n_kv = _HEADER.unpack_from(self.buf, 0)
        self.pos = _HEADER.size
        self._check_version(version)

        left = size - self.pos
        if n_tensors > MAX_TENSORS:
            raise self.fail(f"header claims {n_tensors} tensors (limit {MAX_TENSORS})")
        if n_kv > MAX_KV:
            raise self.fail(f"header claims {n_kv} key/value pairs (limit {MAX_KV})")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > left:
            raise self.fail(
                f"header claims {n_kv} key/value pairs and {n_tensors} tensors, which need at least "
                f"{n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES} bytes but only {left} bytes follow"
            )

        self.count_items(n_kv + n_tensors, "key/value pairs and tensors")
        alignment = self._parse_kvs(n_kv)
        tensors = self._parse_tensor_infos(n_tensors)
        data_offset = -(-self.pos // alignment) * alignment
        self._check_tensor_data(tensors, alignment, data_offset)
        return GGUFSummary(
            version=version,
            n_tensors=n_tensors,
            n_kv=n_kv,
            alignment=alignment,
            data_offset=data_offset,
            file_size=size,
            header_items=self.items,
            kv_offsets=self.kv_offsets,
            tensor_infos=tuple(self.tensor_infos),
            string_lengths=self.string_lengths,
        )

    def _check_version(self, version: int) -> None:
        if version in SUPPORTED_VERSIONS:
            return
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version & 0xFFFF == 0 and swapped in (1, 2, 3):
            raise self.fail(
                f"the file is a big-endian GGUF (version field reads {version:#010x}, i.e. version {swapped} "
                "byte-swapped); llamatrace only reads little-endian GGUF",
                "download the little-endian file or convert it with gguf-py's gguf_convert_endian.py",
            )
        if version == 1:
            raise self.fail(
                "the file is GGUF version 1, which is no longer supported (need version 2 or 3)",
                "re-convert the model with a current llama.cpp or download a newer .gguf",
            )
        if version > 3 and version < 0x100:
            raise self.fail(
                f"the file is GGUF version {version}; llamatrace supports versions 2 and 3",
                "use a version 3 GGUF file (convert it with a llama.cpp release that writes v3)",
            )
        raise self.fail(f"invalid GGUF version {version} (expected 2 or 3)", FIX_CORRUPT)

    def _parse_kvs(self, n_kv: int) -> int:
        alignment = DEFAULT_ALIGNMENT
        keys: set[str] = set()
        for i in range(n_kv):
            start = self.pos
            key = self.name(f"key #{i}", MAX_KEY_LEN, f"over the {MAX_KEY_LEN}-byte limit for keys")
            shown = show(key)
            if key in keys:
                raise self.fail(f"duplicate key {shown} (key #{i} at byte {start})", FIX_CORRUPT)
            if key in _READER_RESERVED_KEYS:
                raise self.fail(f"key #{i} {shown} at byte {start} uses a name reserved by the GGUF reader", FIX_CORRUPT)
            keys.add(key)
            vtype = self.u32(f"value type of key {shown}")
            self.kv_offsets[key] = (vtype, self.pos)
            if key == ALIGNMENT_KEY and vtype != UINT32:
                raise self.fail(
                    f"key {shown} has type {type_name(vtype)}, but it must be a single uint32", FIX_CORRUPT
                )
            if vtype == ARRAY:
                self._skip_array(shown)
            elif vtype == STRING:
                self._skip_string(f"string value of key {shown}")
            elif vtype in FIXED:
                nbytes = FIXED[vtype].size
                pos = self.need(nbytes, f"{FIXED[vtype].name} value of key {shown}")
                self.pos = pos + nbytes
                if key == ALIGNMENT_KEY:
                    alignment = _U32.unpack_from(self.buf, pos)[0]
                    if alignment == 0 or alignment & (alignment - 1):
                        raise self.fail(f"key {shown} is {alignment}, which is not a power of two", FIX_CORRUPT)
            else:
                raise self.fail(
                    f"key {shown} at byte {start} has unknown value type {vtype} (valid types are {VALUE_TYPES})",
                    FIX_CORRUPT,
                )
        return alignment

    def _skip_string(self, what: str) -> None:
        n = self.u64(f"length of {what}")
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"{what} at byte {self.pos - 8} claims {n} bytes but only {left} bytes are left in the file")
        if n > MAX_STRING_LEN:
            raise self.fail(f"{what} at byte {self.pos - 8} is {n} bytes long (limit {MAX_STRING_LEN})", FIX_CORRUPT)
        self.pos += n

    def _skip_array(self, shown: str) -> None:
        start = self.pos
        etype = self.u32(f"element type of array {shown}")
        if etype == ARRAY:
            raise self.fail(f"key {shown} at byte {start} is an array of arrays, which GGUF does not allow", FIX_CORRUPT)
        if etype != STRING and etype not in FIXED:
            raise self.fail(
                f"array {shown} at byte {start} has unknown element type {etype} (valid types are {VALUE_TYPES})",
                FIX_CORRUPT,
            )
        n = self.u64(f"length of array {shown}")
        left = self.size - self.pos
        elem = FIXED[etype].size if etype in FIXED else 8  # a string element needs at least its 8-byte length
        if n * elem > left:
            raise self.fail(
                f"array {shown} at byte {start} claims {n} {type_name(etype)} elements "
                f"(at least {n * elem} bytes) but only {left} bytes are left in the file"
            )
        if n > MAX_ARRAY_LEN:
            raise self.fail(f"array {shown} at byte {start} has {n} elements (limit {MAX_ARRAY_LEN})", FIX_CORRUPT)
        if etype != STRING:
            self.pos += n * elem
            return
        self.count_items(n, f"strings (array {shown} has {n})")
        # Walk the strings; each iteration consumes >= 8 bytes, so this is bounded by the file size.
        # The walk of what is buffered reads lengths only; each stretch's lengths are checked after it
        # (a string running past the end stops the stretch: it is the stretch's last).
        size = self.size
        unpack = _U64.unpack_from
        p = self.pos
        heads = array("q")              # each string's length prefix, file offset
        i = 0
        while i < n:
            if p + 8 > size:
                self.pos = p
                raise self.fail(
                    f"string #{i} of array {shown} at byte {p} needs 8 bytes but the file ends at byte {size}"
                )
            self._fill(p + 8)
            buf, have, first = self.buf, len(self.buf), i
            for i in range(first, n):
                if p + 8 > have:
                    break
                heads.append(p)
                p += 8 + unpack(buf, p)[0]
            else:
                i = n
            self._check_string_lengths(np.frombuffer(heads[first:], np.int64), first, shown)
        self.string_lengths[start] = (np.diff(np.frombuffer(heads, np.int64), append=p) - 8).astype(np.uint32)
        self.pos = p

    def _check_string_lengths(self, heads: np.ndarray, first: int, shown: str) -> None:
        """Fail on the first string, of those whose length prefixes are at ``heads`` (string
        #``first`` of array ``shown`` and the next ones, at least one), that runs past the end of
        the file or is longer than :data:`MAX_STRING_LEN`. All but the last end where the next
        one's prefix begins, inside the file: only the last can run past its end."""
        over = np.flatnonzero(np.diff(heads) - 8 > MAX_STRING_LEN)
        k = int(over[0]) if over.size else len(heads) - 1
        pos = int(heads[k])
        slen = _U64.unpack_from(self.buf, pos)[0]
        if slen > self.size - pos - 8:
            raise self.fail(
                f"string #{first + k} of array {shown} at byte {pos} claims {slen} bytes but only "
                f"{self.size - pos - 8} bytes are left in the file"
            )
        if slen > MAX_STRING_LEN:
            raise self.fail(
                f"string #{first + k} of array {shown} at byte {pos} is {slen} bytes long (limit {MAX_STRING_LEN})",
                FIX_CORRUPT,
            )

    def _parse_tensor_infos(self, n_tensors: int) -> list[tuple[str, int, int]]:
        tensors: list[tuple[str, int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            start = self.pos
            name = self.name(
                f"name of tensor #{i}", GGML_MAX_NAME - 1, f"longer than ggml's limit of {GGML_MAX_NAME - 1} bytes"
            )
            shown = show(name)
            if name in names:
                raise self.fail(f"duplicate tensor name {shown} (tensor #{i} at byte {start})", FIX_CORRUPT)
            names.add(name)

            n_dims = self.u32(f"dimension count of tensor {shown}")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise self.fail(
                    f"tensor {shown} has {n_dims} dimensions (must be 1..{GGML_MAX_DIMS})", FIX_CORRUPT
                )
            pos = self.need(8 * n_dims, f"shape of tensor {shown}")
            self.pos = pos + 8 * n_dims
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, pos)
            n_elems = 1
            for d, ne in enumerate(dims):
                if ne > INT64_MAX:
                    raise self.fail(
                        f"tensor {shown} dimension {d} is {ne} ({ne - (1 << 64)} as int64; must be positive)",
                        FIX_CORRUPT,
                    )
                if ne == 0:
                    raise self.fail(f"tensor {shown} dimension {d} is 0 (must be positive)", FIX_CORRUPT)
                n_elems *= ne
            if n_elems >= INT64_MAX:
                raise self.fail(
                    f"tensor {shown} shape {list(dims)} has {n_elems} elements, more than int64 can hold",
                    FIX_CORRUPT,
                )

            ttype = self.u32(f"type of tensor {shown}")
            info = _TENSOR_TYPES.get(ttype)
            if info is None and ttype in _REMOVED_ARM_TYPES:
                raise self.fail(
                    f"tensor {shown} has type {_REMOVED_ARM_TYPES[ttype]} ({ttype}), an ARM repacking ggml "
                    f"has dropped (llama.cpp refuses it too)", "download the file's Q4_0 version instead")
            if info is None:
                raise self.fail(
                    f"tensor {shown} has unknown ggml type {ttype}",
                    "the file is corrupt or needs a newer gguf package (pip install -U gguf); re-download it",
                )
            ggml_name, block, type_size = info
            if dims[0] % block:
                raise self.fail(
                    f"tensor {shown} of type {ggml_name} has {dims[0]} elements per row, "
                    f"not a multiple of the block size {block}",
                    FIX_CORRUPT,
                )
            offset = self.u64(f"data offset of tensor {shown}")
            tensors.append((shown, offset, n_elems // block * type_size))
            self.tensor_infos.append((name, dims, ttype, offset))
        return tensors

    def _check_tensor_data(self, tensors: list[tuple[str, int, int]], alignment: int, data_offset: int) -> None:
        size = self.size
        prev: tuple[str, int, int] | None = None
        for shown, offset, nbytes in tensors:
            if offset % alignment:
                raise self.fail(
                    f"tensor {shown} data offset {offset} is not a multiple of the alignment {alignment}", FIX_CORRUPT
                )
            start = data_offset + offset
            if start + nbytes > size:
                raise self.fail(
                    f"tensor {shown} data [offset {start}, {nbytes} bytes] runs past end of file ({size} bytes)"
                )
            if prev is not None:
                p_shown, p_offset, p_nbytes = prev
                if offset < p_offset:
                    raise self.fail(
                        f"tensor {shown} data offset {offset} comes before that of the previous tensor "
                        f"{p_shown} ({p_offset}); tensor data must be stored in header order",
                        FIX_CORRUPT,
                    )
                if offset < p_offset + p_nbytes:
                    raise self.fail(
                        f"tensor {shown} data [offset {offset}, {nbytes} bytes] overlaps tensor {p_shown} "
                        f"[offset {p_offset}, {p_nbytes} bytes] (offsets relative to the data section at byte "
                        f"{data_offset})",
                        FIX_CORRUPT,
                    )
            prev = (shown, offset, nbytes)


# --------------------------------------------------------------------------------------------


def _show_path(path: str | os.PathLike[str]) -> str:
    try:
        text = os.fsdecode(path)
    except TypeError:
        text = str(path)
    return text if text.isprintable() else repr(text)


def _os_reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
