"""Rebuild llama.cpp's requantized SmolLM2 files without llama.cpp, byte for byte.

``scripts/requantize_kquants.py`` makes the six K-quant test files with llama.cpp's own
quantizer (llama-cpp-python, a separate venv). CI has no llama.cpp, so this module redoes what
``llama_model_quantize`` does for them, with ggml's reference quantizers:

1. fetch the llama-cpp-python 0.3.36 source distribution from PyPI (``pip download``, once,
   into the user cache, sha256-checked) and compile its ``ggml/src/ggml-quants.c`` with gcc
   into a small shared library beside it (plus four stub functions it links against);
2. read the default model; for each tensor of the committed map
   ``tests/golden/kquant_tensors.json`` (recorded from llama.cpp's output: order and type),
   copy its bytes if the type is unchanged, else dequantize it with ggml's ``dequantize_row_*``
   and quantize it with ggml's ``quantize_*`` (no importance matrix: the reference paths);
3. write the GGUF as llama.cpp does: the source's metadata in order, then
   ``general.quantization_version`` and ``general.file_type`` moved to the end.

The result is checked against the sha256 llama.cpp's file had (in the golden JSON).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import numpy as np
from llamacpp_sdist import sdist_path

from llamatrace.gguf.fetch import cache_root

T = gguf.GGMLQuantizationType
GOLDEN = Path(__file__).parent / "golden"
GGML = "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml"
# llama_ftype written to general.file_type
FILE_TYPE = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q3_K_M": 12, "Q2_K-pure": 10, "Q3_K-pure": 12}
# ggml_type -> (block weights, block bytes) for the stubs
_STUB_TYPES = {t: gguf.GGML_QUANT_SIZES[t] for t in
               (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)}

_STUBS = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
static const int BLCK[64] = { %(blck)s };
static const int SIZE[64] = { %(size)s };
size_t ggml_type_size(enum ggml_type t) { return (size_t) SIZE[t]; }
size_t ggml_row_size(enum ggml_type t, int64_t ne) { return (size_t) (SIZE[t] * ne / BLCK[t]); }
const char * ggml_type_name(enum ggml_type t) { (void) t; return "?"; }
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    va_list a; va_start(a, fmt); fprintf(stderr, "ggml abort %%s:%%d: ", file, line);
    vfprintf(stderr, fmt, a); va_end(a); abort();
}
"""


def ggml_quants_library(release: bool = False) -> ctypes.CDLL:
    """ggml-quants.c from the sdist, compiled once with gcc into the user cache. ``release``:
    with ``-DNDEBUG`` as llama.cpp's release build (``llama-quantize``), whose ``nearest_int``
    does not assert on the inf/NaN that denormal or infinite blocks reach."""
    folder = cache_root() / "ggml-quants-0.3.36"
    lib = folder / ("libggml_quants_release.so" if release else "libggml_quants.so")
    if not lib.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist_path()) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(GGML + "/include/")
                       or m.name.startswith(GGML + "/src/ggml-quants") or m.name.startswith(GGML + "/src/ggml-cpu/ggml-cpu-impl.h")
                       or m.name in (GGML + "/src/ggml-common.h", GGML + "/src/ggml-impl.h")]
            tar.extractall(folder, members=members, filter="data")
        root = folder / GGML
        blck = ["1"] * 64
        size = ["1"] * 64
        for t, (b, s) in _STUB_TYPES.items():
            blck[int(t)], size[int(t)] = str(b), str(s)
        stubs = folder / "stubs.c"
        stubs.write_text(_STUBS % {"blck": ", ".join(blck), "size": ", ".join(size)})
        tmp = lib.with_name(lib.name + ".tmp")
        subprocess.run(["gcc", "-O2", *(["-DNDEBUG"] if release else []), "-shared", "-fPIC", "-std=c11", f"-I{root}/include", f"-I{root}/src",
                        f"-I{root}/src/ggml-cpu", str(root / "src/ggml-quants.c"), str(stubs), "-lm",
                        "-o", str(tmp)], check=True, capture_output=True)
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


def _f32_ptr(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def requantize(lib, raw: np.ndarray, src_type: T, dst_type: T, n_rows: int, n_per_row: int) -> np.ndarray:
    """ggml's dequantize_row_<src> then quantize_<dst> (reference, no imatrix) -> uint8 bytes."""
    f32 = np.empty(n_rows * n_per_row, dtype=np.float32)
    src = np.ascontiguousarray(raw)
    if src_type == T.F32:
        f32[:] = src.view(np.float32).ravel()
    else:
        deq = getattr(lib, f"dequantize_row_{src_type.name.lower()}")
        deq.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64]
        deq(src.ctypes.data, _f32_ptr(f32), n_rows * n_per_row)
    block, nbytes = gguf.GGML_QUANT_SIZES[dst_type]
    out = np.empty(n_rows * n_per_row // block * nbytes, dtype=np.uint8)
    q = getattr(lib, f"quantize_{dst_type.name.lower().replace('_k', '_K')}")
    q.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    q.restype = ctypes.c_size_t
    written = q(_f32_ptr(f32), out.ctypes.data, n_rows, n_per_row, None)
    assert written == out.nbytes, (written, out.nbytes)
    return out


def tensor_map() -> dict[str, list[list[str]]]:
    """{variant: [[tensor name, type name], ...]} in llama.cpp's output order."""
    return json.loads((GOLDEN / "kquant_tensors.json").read_text(encoding="utf-8"))


def rebuild(variant: str, source: Path, dest: Path) -> Path:
    """Write ``dest`` (the requantized ``variant`` of ``source``) as llama.cpp did."""
    lib = ggml_quants_library()
    reader = gguf.GGUFReader(str(source))
    src = {t.name: t for t in reader.tensors}
    tmp = dest.with_name(dest.name + ".tmp")
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(tmp), arch=arch)                    # writes general.architecture first
    moved = ("general.quantization_version", "general.file_type")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in moved or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_uint32("general.quantization_version", 2)
    writer.add_uint32("general.file_type", FILE_TYPE[variant])
    for name, type_name in tensor_map()[variant]:
        t = src[name]
        dst_type = T[type_name]
        shape = [int(d) for d in reversed(t.shape.tolist())]           # NumPy order [n_out, n_in]
        n_per_row = shape[-1]
        n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        if dst_type == t.tensor_type:
            data = np.ascontiguousarray(t.data)
        else:
            data = requantize(lib, t.data, t.tensor_type, dst_type, n_rows, n_per_row)
            block, nbytes = gguf.GGML_QUANT_SIZES[dst_type]
            data = data.reshape(shape[:-1] + [n_per_row // block * nbytes])
        writer.add_tensor(name, data, raw_dtype=dst_type if dst_type not in (T.F32, T.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dest)
    return dest


def record_tensor_map(files: dict[str, Path]) -> None:
    """Write kquant_tensors.json from llama.cpp's output files ({variant: path})."""
    out = {v: [[t.name, t.tensor_type.name] for t in gguf.GGUFReader(str(p)).tensors] for v, p in files.items()}
    (GOLDEN / "kquant_tensors.json").write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")


if __name__ == "__main__":  # python tests/kquant_files.py record|rebuild VARIANT SOURCE DEST
    if sys.argv[1] == "record":
        models = cache_root() / "models"
        record_tensor_map({v: models / f"SmolLM2-135M-Instruct.{v}.gguf" for v in FILE_TYPE})
    else:
        rebuild(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
