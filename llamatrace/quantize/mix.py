"""Write a base GGUF with a chosen type per tensor (a recipe), with gguf-py's writer.

The base's metadata in its order, ``general.quantization_version`` 2 and ``general.file_type``
(the llama.cpp file type the printed ``llama-quantize`` command names), then every tensor in the
base's order: the recipe's tensors quantized from the base's values by ``quantize`` (llama.cpp's
quantizers), the others copied as they are. Written to a temporary name and renamed when complete.

Stand-in for the writer of ``llamatrace quantize --type`` (issue 35 §1), which also matches
llama.cpp's metadata order byte for byte; the search only needs the tensor data right.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping

import gguf
import numpy as np

from llamatrace.errors import OutputError
from llamatrace.outputs import check_output_path

T = gguf.GGMLQuantizationType
FILE_TYPE_Q4_K_M = 15        # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M


def write_mix(base: Path, dest: Path, types: Mapping[str, T], quantize: Callable[..., np.ndarray],
              imatrix: Mapping[str, np.ndarray] | None = None, file_type: int = FILE_TYPE_Q4_K_M,
              option: str = "OUT") -> None:
    """Write ``dest``: ``base`` with each tensor of ``types`` (GGUF name → type) quantized.

    Raises:
        OutputError: ``dest`` cannot be written (nothing is left at ``dest``).
    """
    reader = gguf.GGUFReader(str(base))
    moved = ("general.quantization_version", "general.file_type")
    dest = Path(dest)
    check_output_path(dest, option)
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        writer = gguf.GGUFWriter(str(tmp), arch=reader.fields["general.architecture"].contents())
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in moved or key == "general.architecture":
                continue
            vtype = field.types[0]
            writer.add_key_value(key, field.contents(), vtype,
                                 sub_type=field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
        writer.add_uint32("general.quantization_version", 2)
        writer.add_uint32("general.file_type", file_type)
        for t in reader.tensors:
            shape = [int(d) for d in reversed(t.shape.tolist())]          # NumPy order
            target = types.get(t.name)
            if target is None or target == t.tensor_type:
                quantized = t.tensor_type not in (T.F32, T.F16)          # F32/F16 arrive typed
                writer.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=t.tensor_type if quantized else None)
                continue
            x = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            data = quantize(target, x, (imatrix or {}).get(t.name))
            writer.add_tensor(t.name, data, raw_dtype=target)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dest)
    except OSError as exc:
        raise OutputError(f"{option} {str(dest)!r}: cannot write it ({exc.strerror or exc}); free some space "
                          f"or choose another path") from None
    finally:
        tmp.unlink(missing_ok=True)
