"""Importance-matrix files as llama.cpp reads and writes them.

The current format (``llama-imatrix``'s default since 2025, ``tools/imatrix/imatrix.cpp``
``save_imatrix``, read by ``common/imatrix-loader.cpp``) is a GGUF file holding no model:

* metadata ``general.type = "imatrix"``, ``imatrix.datasets`` (array of str: the calibration
  files), ``imatrix.chunk_count`` (u32: chunks evaluated), ``imatrix.chunk_size`` (u32: tokens
  per chunk); ``llama-quantize`` refuses a GGUF imatrix without these three ``imatrix.*`` keys;
* per weight matrix ``W`` (e.g. ``blk.0.attn_q.weight``), sorted by name, two F32 tensors:
  ``W.in_sum2``, ggml shape ``{n_in, n_mat}`` — Σ x² over every token of each input column ``x``
  of ``W``'s matmuls (``n_mat`` > 1 only for stacked expert matrices) — and ``W.counts``, ggml
  shape ``{1, n_mat}`` — the number of tokens summed. The sums are raw, not means: files add up.

The legacy ``.dat`` format (``--output-format dat``) is read too: ``int32 n_entries``, then per
entry ``int32 len, name, int32 ncall, int32 nval, float32[nval]`` holding ``mean(x²) · ncall``,
then optionally ``int32 chunk_count, int32 len, dataset``. Read back as ``(sums, ncall)`` its
``sums / counts`` is the same mean as the GGUF format's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from llamatrace.errors import LlamatraceError, OptionError, shown

GGUF_MAGIC = b"GGUF"
IN_SUM2, COUNTS = ".in_sum2", ".counts"
KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"

# weight name -> (float32 in_sum2 [n_in] or [n_mat, n_in], int64 counts [n_mat])
Entries = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass
class ImatrixMeta:
    """The ``imatrix.*`` metadata: calibration files, chunks evaluated, tokens per chunk (0 when
    unknown: a legacy file)."""

    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0


def write_imatrix(path: Path, entries: Entries, meta: ImatrixMeta, option: str = "-o") -> None:
    """Write ``entries`` as llama.cpp's GGUF imatrix at ``path``, atomically (a temporary file
    renamed when complete, :func:`llamatrace.outputs.write_atomic`).

    Args:
        entries: weight name -> ``(in_sum2, counts)``: float ``[n_in]`` or ``[n_mat, n_in]``
            Σ x² (stored as float32), and the tokens summed, int ``[n_mat]`` or a scalar.
        meta: the ``imatrix.*`` metadata.
        option: how errors name the output.

    Raises:
        OptionError: an entry whose counts do not match its rows, or no entry.
        OutputError: ``path`` cannot be written (nothing is left at it).
    """
    from llamatrace.outputs import write_atomic
    tensors = []
    for name in sorted(entries):                  # llama.cpp sorts by name: the same bytes
        sums, counts = entries[name]
        sums = np.asarray(sums, dtype=np.float32)
        sums2d = sums.reshape(1, -1) if sums.ndim == 1 else sums
        counts = np.asarray(counts, dtype=np.float32).reshape(-1, 1)       # ggml {1, n_mat}
        if sums2d.ndim != 2 or counts.shape[0] != sums2d.shape[0]:
            raise OptionError(f"imatrix entry {name!r}: {counts.shape[0]} counts for in_sum2 of shape "
                              f"{list(sums.shape)}; give one count per matrix")
        tensors += [(name + IN_SUM2, np.ascontiguousarray(sums2d)), (name + COUNTS, counts)]
    if not tensors:
        raise OptionError("an importance matrix needs at least one entry")
    write_atomic(Path(path), lambda f: _write_gguf(f, tensors, meta), option)


def _write_gguf(f: BinaryIO, tensors: list[tuple[str, np.ndarray]], meta: ImatrixMeta) -> None:
    """gguf-py's writer on the open file ``f``, with llama-imatrix's keys and no architecture key."""
    import gguf
    from gguf.gguf_writer import WriterState
    w = gguf.GGUFWriter(None, "imatrix")
    del w.kv_data[0][gguf.Keys.General.ARCHITECTURE]     # an imatrix describes no model (llama.cpp writes none)
    w.add_type(gguf.GGUFType.IMATRIX)
    w.add_array(KEY_DATASETS, list(meta.datasets))
    w.add_uint32(KEY_CHUNK_COUNT, int(meta.chunk_count))
    w.add_uint32(KEY_CHUNK_SIZE, int(meta.chunk_size))
    for name, array in tensors:
        w.add_tensor(name, array)
    w.fout, w.state = [f], WriterState.EMPTY     # the writer's own file handling bypassed: f is write_atomic's
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.fout = None                                # f is closed by write_atomic


def read_imatrix(path: Path, option: str = "--imatrix") -> Entries:
    """The entries of an importance-matrix file (GGUF or legacy ``.dat``).

    Returns:
        weight name -> ``(in_sum2, counts)``: float32 ``[n_in]`` (one matrix) or ``[n_mat, n_in]``,
        and int64 ``[n_mat]``; ``in_sum2 / counts`` is the mean x² per input column.

    Raises:
        OptionError: the file is missing, unreadable, or not an importance matrix (a model
            GGUF, a truncated or foreign file), naming ``option`` and the path.
    """
    return _read(Path(path), option)[0]


def read_imatrix_meta(path: Path, option: str = "--imatrix") -> ImatrixMeta:
    """The ``imatrix.*`` metadata of an importance-matrix file; raises as :func:`read_imatrix`."""
    return _read(Path(path), option)[1]


def _read(path: Path, option: str) -> tuple[Entries, ImatrixMeta]:
    where = f"{option} {str(path)!r}"
    try:
        with open(path, "rb") as fh:
            is_gguf = fh.read(4) == GGUF_MAGIC
    except OSError as exc:
        raise OptionError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    return _read_gguf(path, where) if is_gguf else _read_legacy(path, where)


def _read_gguf(path: Path, where: str) -> tuple[Entries, ImatrixMeta]:
    from llamatrace.gguf.reader import open_gguf, tensor_type_name
    try:
        f = open_gguf(path)
    except LlamatraceError as exc:
        raise OptionError(f"{where} is not a readable GGUF imatrix ({exc})") from None
    with f:
        sums = {n[:-len(IN_SUM2)]: t for n, t in f.tensors.items() if n.endswith(IN_SUM2)}
        counts = {n[:-len(COUNTS)]: t for n, t in f.tensors.items() if n.endswith(COUNTS)}
        if not sums and not counts:
            kind = f.metadata.get("general.type") or f.metadata.get("general.architecture") or "other"
            raise OptionError(f"{where} is a GGUF file of type {shown(kind)}, not an importance matrix (no "
                              f"*.in_sum2 tensors); make one with `llamatrace imatrix` or llama-imatrix")
        if sums.keys() != counts.keys():
            name = sorted(sums.keys() ^ counts.keys())[0]
            raise OptionError(f"{where}: {name!r} has {'no counts' if name in sums else 'counts but no in_sum2'}; "
                              f"the imatrix is damaged")
        missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in f.metadata]
        if missing:            # llama-quantize refuses such a file too
            raise OptionError(f"{where}: the imatrix metadata {', '.join(missing)} is missing")
        entries: Entries = {}
        for name in sorted(sums):
            s, c = sums[name], counts[name]
            if tensor_type_name(s) != "F32" or tensor_type_name(c) != "F32":
                raise OptionError(f"{where}: {name!r} is stored as {tensor_type_name(s)}/{tensor_type_name(c)}; "
                                  f"an imatrix holds F32 sums and counts")
            values = np.array(s.data, dtype=np.float32)                   # NumPy order: [n_mat, n_in]
            n_mat = int(c.n_elements)
            if n_mat == 0 or values.size % n_mat:
                raise OptionError(f"{where}: {name!r} has {values.size} sums for {n_mat} counts; "
                                  f"the imatrix is damaged")
            values = values.reshape(n_mat, -1)
            entries[name] = (values[0] if n_mat == 1 else values,
                             np.rint(np.array(c.data, dtype=np.float64).reshape(-1)).astype(np.int64))
        datasets = f.metadata[KEY_DATASETS]
        meta = ImatrixMeta([str(d) for d in datasets] if isinstance(datasets, list) else [str(datasets)],
                           int(f.metadata[KEY_CHUNK_COUNT]), int(f.metadata[KEY_CHUNK_SIZE]))
    return entries, meta


def _read_legacy(path: Path, where: str) -> tuple[Entries, ImatrixMeta]:
    """llama.cpp's ``.dat`` layout (see the module docstring), every length checked."""
    data = path.read_bytes()
    bad = OptionError(f"{where} is neither a GGUF imatrix nor a legacy .dat imatrix "
                      f"(make one with `llamatrace imatrix` or llama-imatrix)")
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise bad
        values = struct.unpack_from(fmt, data, pos)
        pos += size
        return values

    (n_entries,) = take("<i")
    if n_entries < 1 or n_entries > len(data) // 16:
        raise bad
    entries: Entries = {}
    for _ in range(n_entries):
        (length,) = take("<i")
        if length < 1 or pos + length > len(data):
            raise bad
        try:
            name = data[pos:pos + length].decode("utf-8")
        except UnicodeDecodeError:
            raise bad from None
        pos += length
        ncall, nval = take("<ii")
        if nval < 1 or pos + 4 * nval > len(data):
            raise bad
        sums = np.frombuffer(data, np.float32, nval, pos).copy()
        pos += 4 * nval
        entries[name] = (sums, np.array([ncall], dtype=np.int64))
    meta = ImatrixMeta()
    if pos + 4 <= len(data):                       # optional trailer: chunk count, dataset
        (meta.chunk_count,) = take("<i")
        if pos + 4 <= len(data):
            (length,) = take("<i")
            if 0 < length and pos + length <= len(data):
                meta.datasets = [data[pos:pos + length].decode("utf-8", errors="replace")]
                pos += length
    if pos != len(data):
        raise bad
    return entries, meta
