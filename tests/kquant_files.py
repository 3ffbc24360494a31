"""llama.cpp's requantized SmolLM2 test files rebuilt without llama.cpp, byte for byte; ggml's
quantizers compiled from the llama-cpp-python sdist as an independent reference.

``scripts/requantize_kquants.py`` makes the six K-quant test files with llama.cpp's own
quantizer (llama-cpp-python, a separate venv). CI has no llama.cpp, so :func:`rebuild` makes them
with ``llamatrace quantize``'s rules and writer (``--allow-requantize``, ``--pure`` for the
``-pure`` files), which write llama.cpp's bytes (``tests/test_quantize.py``); the result is
checked against the sha256 llama.cpp's file had (in the golden JSON).

:func:`ggml_quants_library` fetches the llama-cpp-python 0.3.36 source distribution from PyPI
(``pip download``, once, into the user cache, sha256-checked) and compiles its
``ggml/src/ggml-quants.c`` with gcc into a small shared library beside it (plus four stub
functions it links against): ggml's own quantizers and dequantizers, for the kernel tests.
"""

from __future__ import annotations

import ctypes
import subprocess
import tarfile
from pathlib import Path

import gguf
from llamacpp_sdist import sdist_path

from llamatrace.gguf.fetch import cache_root

T = gguf.GGMLQuantizationType
GGML = "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml"
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


# variant -> (llama-quantize's file type, --pure)
VARIANTS = {"Q4_K_M": ("Q4_K_M", False), "Q5_K_M": ("Q5_K_M", False), "Q6_K": ("Q6_K", False),
            "Q3_K_M": ("Q3_K_M", False), "Q2_K-pure": ("Q2_K", True), "Q3_K-pure": ("Q3_K_M", True)}


def rebuild(variant: str, source: Path, dest: Path) -> Path:
    """Write ``dest``, the requantized ``variant`` of ``source``, as llama.cpp did."""
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.quantize.rules import file_type, tensor_types
    from llamatrace.quantize.writer import quantize_gguf
    name, pure = VARIANTS[variant]
    with open_gguf(source) as f:
        types = tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()},
                             f.metadata, name, pure=pure)
        quantize_gguf(f, dest, types, file_type(name), allow_requantize=True)
    return dest
