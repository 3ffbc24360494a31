"""Write a quantized GGUF as ``llama-quantize`` writes it: same metadata, same tensor order, same bytes.

:func:`quantize_gguf` takes an opened base file and the type of each tensor (:mod:`.rules`), and
writes with gguf-py's ``GGUFWriter``, as ``llama_model_quantize_impl`` does
(``src/llama-quant.cpp``):

- metadata: every key of the base in its order (the split keys dropped), then
  ``general.quantization_version`` = 2 and ``general.file_type`` = the ``llama_ftype`` moved to the
  end (llama.cpp's ``gguf_set_val_*`` removes a key and appends it), then, with an importance
  matrix, ``quantize.imatrix.file`` / ``.dataset`` (at most 127 bytes each), ``.entries_count``
  and ``.chunks_count`` (u32) in that order;
- tensors in llama.cpp's order (:func:`~llamatrace.quantize.rules.llama_order`), each tensor's
  data padded to 32 bytes; a tensor whose type does not change is copied byte for byte, the
  others are dequantized to float32 (F16, BF16, F32, or a quantized base with
  ``allow_requantize``) and converted in slabs of rows (:func:`convert_rows`).

The file is written to a temporary name beside the output and renamed when complete
(:func:`llamatrace.outputs.replace_durably`): an error or Ctrl-C leaves nothing at the output path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import gguf
import numpy as np

from llamatrace.errors import OptionError, OutputError
from llamatrace.gguf.reader import GGUFFile, Tensor
from llamatrace.machine.runtime import check_interrupt
from llamatrace.quantize.rules import FileType, category, llama_order, n_dims, requires_imatrix

T = gguf.GGMLQuantizationType
QUANTIZATION_VERSION = 2
"""``GGML_QNT_VERSION``, written to ``general.quantization_version``."""
ALIGNMENT = 32
"""``GGUF_DEFAULT_ALIGNMENT``: llama-quantize pads every tensor's data to it."""
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_FLOATS = (T.F32, T.F16, T.BF16)
_SLAB_BYTES = 64 << 20          # float32 rows converted at once: bounds memory on an 8B model

Progress = Callable[[int, int, str, T, T], None]
"""``progress(i, n, name, from_type, to_type)`` before tensor ``i`` (0-based) of ``n``."""


@dataclass(frozen=True)
class ImatrixInfo:
    """What llama-quantize records of an importance matrix in the output's metadata.

    Attributes:
        file: the path as given on the command line (``quantize.imatrix.file``).
        dataset: the first calibration dataset's name, or None (``quantize.imatrix.dataset``).
        n_entries: the number of tensors it holds (``quantize.imatrix.entries_count``).
        n_chunks: the chunks it was computed on; 0 leaves ``quantize.imatrix.chunks_count`` out.
    """

    file: str
    dataset: str | None
    n_entries: int
    n_chunks: int


@dataclass
class QuantizeSummary:
    """What :func:`quantize_gguf` wrote: ``types`` (name → type, in file order), the bytes of the
    tensor data before and after, the number of weights, and seconds."""

    types: dict[str, T]
    bytes_in: int = 0
    bytes_out: int = 0
    n_elements: int = 0
    seconds: float = 0.0
    no_imatrix: list[str] = field(default_factory=list)   # quantized without an entry (the embedding aside:
                                                          # llama-imatrix never has one, it is no matmul)

    @property
    def bpw(self) -> float:
        """Bits per weight as llama-quantize prints it: 8 × data bytes ÷ elements."""
        return 8.0 * self.bytes_out / self.n_elements if self.n_elements else 0.0


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits as ggml's ``ggml_fp32_to_bf16_row_ref``: round to nearest even,
    a NaN kept quiet (``| 64``)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def convert_rows(ggml_type: T, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """float32 rows → the tensor data of ``ggml_type``, as ``ggml_quantize_chunk`` writes it.

    Args:
        x: float32 ``[n_rows, n_per_row]``, or float16 (an F16 base's rows: the quantizers widen
            each row in their threads, exactly as a float32 copy would).
        imatrix: float32 ``[n_per_row]`` column importances, or None (the float types ignore it).

    Returns:
        uint8 ``[n_rows, row_bytes]``.

    Raises:
        ValueError: a type llamatrace cannot write, or rows not a multiple of its block.
    """
    if ggml_type == T.F32:
        return np.ascontiguousarray(x, np.float32).view(np.uint8)
    if ggml_type == T.F16:
        return np.ascontiguousarray(x, np.float16).view(np.uint8)   # round to nearest even, as ggml_fp32_to_fp16_row
    if ggml_type == T.BF16:
        return _bf16_bits(x).view(np.uint8)
    from llamatrace.kernels.quantizers.rows import quantize_rows   # Numba: only when quantizing
    return quantize_rows(ggml_type, x, imatrix)


def dequantize(t: Tensor, rows: slice) -> np.ndarray:
    """Rows ``rows`` of tensor ``t`` (all dimensions after the first flattened into rows) as
    float32 ``[n, ne0]``, as llama.cpp's ``llama_tensor_dequantize_impl`` (gguf-py's dequantizers);
    an F16 tensor's rows stay float16 (a view of the file: :func:`convert_rows` widens them)."""
    ne0 = int(t.shape[0])
    data = t.data.reshape(-1, t.data.shape[-1])[rows]
    if t.tensor_type == T.F32:
        return np.asarray(data, np.float32)
    if t.tensor_type == T.F16:
        return np.asarray(data, np.float16)
    return gguf.quants.dequantize(np.ascontiguousarray(data), t.tensor_type).reshape(-1, ne0)


def output_metadata(base: GGUFFile, ftype: FileType, imatrix: ImatrixInfo | None = None
                    ) -> list[tuple[str, object, int, int | None]]:
    """The output's metadata as llama-quantize writes it: ``[(key, value, type, array element type)]``."""
    kv: dict[str, tuple[object, int, int | None]] = {}
    for key in base.keys():
        if key not in _SPLIT_KEYS:
            kv[key] = (base.field(key), *base.value_type(key))

    def put(key: str, value: object, vtype: gguf.GGUFValueType) -> None:
        kv.pop(key, None)                    # llama.cpp's gguf_set_val_*: remove, then append
        kv[key] = (value, int(vtype), None)

    put("general.quantization_version", QUANTIZATION_VERSION, gguf.GGUFValueType.UINT32)
    put("general.file_type", ftype.ftype, gguf.GGUFValueType.UINT32)
    if imatrix is not None:
        put("quantize.imatrix.file", _c_str127(imatrix.file), gguf.GGUFValueType.STRING)
        if imatrix.dataset:
            put("quantize.imatrix.dataset", _c_str127(imatrix.dataset), gguf.GGUFValueType.STRING)
        put("quantize.imatrix.entries_count", imatrix.n_entries, gguf.GGUFValueType.UINT32)
        if imatrix.n_chunks > 0:
            put("quantize.imatrix.chunks_count", imatrix.n_chunks, gguf.GGUFValueType.UINT32)
    return [(k, v, t, s) for k, (v, t, s) in kv.items()]


def column_importances(entries: Mapping[str, tuple[np.ndarray, np.ndarray]], legacy: bool = False
                       ) -> dict[str, np.ndarray]:
    """What llama-quantize passes the quantizers (``load_imatrix`` in ``tools/quantize/quantize.cpp``):
    per tensor, float32 ``[n_mat × n_in]`` = ``in_sum2 / count`` of each matrix, in float32; a
    matrix that saw no token gets 1 (a legacy ``.dat`` entry with ``ncall`` 0 keeps its sums).

    Args:
        entries: :func:`llamatrace.quantize.imatrix.files.read_imatrix`'s ``{name: (in_sum2, counts)}``.
        legacy: the entries come from a legacy ``.dat`` file.
    """
    out = {}
    for name, (sums, counts) in entries.items():
        sums = np.asarray(sums, np.float32).reshape(len(np.atleast_1d(counts)), -1)
        counts = np.atleast_1d(counts).astype(np.float32).reshape(-1, 1)
        seen = counts > 0
        mean = np.divide(sums, counts, out=np.empty_like(sums), where=seen)
        out[name] = np.where(seen, mean, sums if legacy else np.float32(1.0)).astype(np.float32).reshape(-1)
    return out


def check_finite(imatrix: Mapping[str, np.ndarray], where: str = "the importance matrix") -> None:
    """Refuse column importances holding NaN or ±inf, as llama-quantize does (``llama_model_quantize_impl``:
    "imatrix contains non-finite value"): the quantizers would write NaN scales into the file.

    Raises:
        OptionError: naming the first such tensor (in name order), its value and how many there are.
    """
    for name in sorted(imatrix):
        values = np.asarray(imatrix[name])
        bad = ~np.isfinite(values)
        if bad.any():
            raise OptionError(f"{where} contains non-finite value {values[bad].flat[0]} for {name!r} "
                              f"({int(bad.sum())} of its {values.size} values): it is damaged; compute it again")


def _c_str127(text: str) -> str:
    """llama-quantize copies a string override with ``strncpy(…, 127)``: at most 127 bytes."""
    return text.encode("utf-8")[:127].decode("utf-8", errors="ignore")


def check_requantize(base: GGUFFile, types: Mapping[str, T], allow_requantize: bool) -> None:
    """Refuse to requantize a quantized base tensor unless asked (llama.cpp's ``allow_requantize``);
    Q8_0 is taken as a base without it (it is the usual lossless-enough base).

    Raises:
        OptionError: a tensor other than F32/F16/BF16/Q8_0 would change type without ``allow_requantize``.
    """
    if allow_requantize:
        return
    for name, t in types.items():
        src = base.tensors[name].tensor_type
        if t != src and src not in (*_FLOATS, T.Q8_0):
            raise OptionError(f"{base.path.name}: tensor {name!r} is already quantized ({src.name}); requantizing "
                              f"loses precision twice: quantize from an F16/BF16/F32/Q8_0 file, or add "
                              f"--allow-requantize")


def quantize_gguf(base: GGUFFile, out: Path, types: Mapping[str, T], ftype: FileType, *,
                  imatrix: Mapping[str, np.ndarray] | None = None, imatrix_info: ImatrixInfo | None = None,
                  allow_requantize: bool = False, progress: Progress | None = None) -> QuantizeSummary:
    """Write ``out``: ``base`` with each tensor converted to ``types[name]``, as llama-quantize does.

    Args:
        base: the opened base model.
        out: the output path (written to a temporary name beside it, renamed when complete).
        types: name → ggml type for every tensor of ``base`` (:func:`~llamatrace.quantize.rules.tensor_types`).
        ftype: the file type recorded in ``general.file_type``.
        imatrix: tensor name → float32 ``[ne0 × experts]`` column importances (``in_sum2 / counts``),
            used where a tensor has an entry (llama-quantize quantizes the others without one).
        imatrix_info: what to record of the importance matrix in the metadata (None: nothing).
        allow_requantize: convert tensors of a quantized base other than Q8_0.
        progress: called before each tensor.

    Returns:
        :class:`QuantizeSummary`.

    Raises:
        OptionError: a quantized base without ``allow_requantize``, an imatrix holding NaN or ±inf
            (:func:`check_finite`), an imatrix entry whose size
            differs from its tensor's rows (an importance matrix of another model), or a tensor that
            needs an imatrix entry and has none (the Q2_K tensors of a Q2_K_S file, as llama.cpp).
        OutputError: ``out`` cannot be written.
    """
    start = time.perf_counter()
    order = llama_order(types)
    if sorted(order) != sorted(base.tensors):
        raise OptionError("the tensor types do not name every tensor of the base model")
    check_requantize(base, types, allow_requantize)
    imatrix = usable_imatrix(base, types, ftype, imatrix)

    summary = QuantizeSummary(types={name: T(types[name]) for name in order})
    writer = gguf.GGUFWriter(None, arch=str(base.metadata.get("general.architecture", "")))
    writer.kv_data = [{}]                    # GGUFWriter adds general.architecture first; keep the base's order
    for key, value, vtype, sub in output_metadata(base, ftype, imatrix_info):
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                             sub_type=None if sub is None else gguf.GGUFValueType(sub))
    for name in order:
        t, dst = base.tensors[name], summary.types[name]
        shape = [int(d) for d in t.shape[:n_dims(t.shape)]]        # ggml order; trailing 1s dropped
        block, size = gguf.GGML_QUANT_SIZES[dst]
        n_rows = int(np.prod(shape[1:], dtype=np.int64))
        nbytes = n_rows * (shape[0] // block) * size
        byte_shape = [*reversed(shape[1:]), shape[0] // block * size]
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=dst)
        summary.bytes_in += t.n_bytes
        summary.bytes_out += nbytes
        summary.n_elements += t.n_elements

    def write(f) -> None:
        writer.fout = [f]                    # our temporary file (replace_durably) instead of one it opens
        writer.state = gguf.gguf_writer.WriterState.EMPTY
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, name in enumerate(order):
            check_interrupt()                # a Ctrl-C lost in a finalizer (a compile's) stops here
            t, dst = base.tensors[name], summary.types[name]
            if progress is not None:
                progress(i, len(order), name, t.tensor_type, dst)
            if dst == t.tensor_type:
                data = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
            else:
                data = convert_tensor(t, dst, imatrix.get(name))
                check_row_data(name, dst, data)
                if imatrix and name not in imatrix and dst not in _FLOATS and category(name) != "token_embd":
                    summary.no_imatrix.append(name)
            writer.write_tensor_data(data)
            base.release(t)

    from llamatrace.outputs import check_output_path, replace_durably
    check_output_path(out, "OUT")
    try:
        replace_durably(out, write)
    except OSError as exc:
        raise OutputError(f"OUT {str(out)!r}: cannot write it ({exc.strerror or exc}); free some space or "
                          f"choose another path") from None
    summary.seconds = time.perf_counter() - start
    return summary


def usable_imatrix(base: GGUFFile, types: Mapping[str, T], ftype: FileType,
                   imatrix: Mapping[str, np.ndarray] | None, source: str = "the importance matrix"
                   ) -> dict[str, np.ndarray]:
    """The entries llama-quantize uses: those of tensors it converts whose size is the rows' length
    × experts. A token embedding of another size is quantized without one, as llama.cpp does.
    Cheap: a command calls it before compiling the quantizers, :func:`quantize_gguf` again.

    Args:
        source: how messages name the matrix (``"--imatrix 'im.gguf'"``).

    Raises:
        OptionError: an entry holding NaN or ±inf (:func:`check_finite`); another tensor's entry of
            another size (an importance matrix of another model); a tensor that needs an entry and
            has none (the Q2_K tensors of a Q2_K_S file, as llama.cpp).
    """
    check_finite(imatrix or {}, source)
    usable = {}
    for name, entry in (imatrix or {}).items():
        t = base.tensors.get(name)
        if t is None or types[name] == t.tensor_type:
            continue
        expected = int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1)
        if entry.size == expected:
            usable[name] = entry
        elif name not in ("token_embd.weight", "per_layer_token_embd.weight"):
            raise OptionError(f"{source} has {entry.size} values for {name!r}, whose rows have "
                              f"{expected}: it was computed for another model")
    needs = [n for n in llama_order(types) if types[n] != base.tensors[n].tensor_type and n not in usable
             and requires_imatrix(n, types[n], ftype)]
    if needs:
        raise OptionError(f"{ftype.name} needs an importance matrix for its {types[needs[0]].name} tensors "
                          f"(as llama-quantize: without one they are garbage) and "
                          f"{'none was given' if not imatrix else source + ' has no entry for ' + needs[0]}: "
                          f"add --imatrix FILE (llama-imatrix's or `llamatrace imatrix`'s)")
    return usable


def check_row_data(name: str, dst: T, data: np.ndarray) -> None:
    """Refuse what llama-quantize refuses after quantizing (``ggml_validate_row_data``): an MXFP4 block
    whose E8M0 exponent is 255 (NaN), which ggml writes for a block whose largest |x| lies in
    [2**-126, 2**-125) (``floor(log2) - 2 + 127`` = -1, cast to a byte).

    Raises:
        OptionError: naming the tensor and the block.
    """
    if dst == T.MXFP4:
        bad = np.flatnonzero(data.reshape(-1, gguf.GGML_QUANT_SIZES[dst][1])[:, 0] == 0xFF)
        if bad.size:
            raise OptionError(f"tensor {name!r}: MXFP4 block {int(bad[0])} gets exponent 255 (its weights are all "
                              f"below 2**-125, as small as float32 goes), which llama.cpp refuses "
                              f"(quantized data validation failed); keep the tensor in another type with "
                              f"--tensor-type '{name}=q8_0'")


def convert_tensor(t: Tensor, dst: T, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Tensor ``t`` dequantized and converted to ``dst`` in slabs of rows, as llama-quantize does.

    Args:
        imatrix: float32 ``[ne0 × experts]`` column importances (each expert's rows use their slice), or None.

    Returns:
        uint8 ``[bytes]``: the tensor's data in the output file.
    """
    ne0 = int(t.shape[0])
    rows_per_expert = int(t.shape[1]) if len(t.shape) > 1 else 1
    n_rows = t.n_elements // ne0
    block, size = gguf.GGML_QUANT_SIZES[dst]
    out = np.empty((n_rows, ne0 // block * size), np.uint8)
    slab = max(1, _SLAB_BYTES // (4 * ne0))
    first = 0
    while first < n_rows:
        expert = first // rows_per_expert
        last = min(first + slab, (expert + 1) * rows_per_expert)      # a slab never crosses an expert
        qw = None if imatrix is None else np.ascontiguousarray(imatrix[expert * ne0:(expert + 1) * ne0], np.float32)
        out[first:last] = convert_rows(dst, dequantize(t, slice(first, last)), qw)
        first = last
    return out.reshape(-1)
