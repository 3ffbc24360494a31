"""ggml-cpu's x86 activation quantizers compiled from the llama-cpp-python sdist: the code
llama.cpp's CPU backend runs on an AVX2 (or AVX-512) machine, as an independent reference for
the ``q8`` mode's activation quantization (``llamatrace.kernels.int8.act8``).

``ggml/src/ggml-cpu/arch/x86/quants.c`` is compiled once with gcc (``-mavx2 -mfma -mf16c``) into
a shared library in the user cache, linked against ``kquant_files``' build of ``ggml-quants.c``
(the reference quantizers it calls), with the lookup tables it names defined here. Its
``quantize_row_q8_0`` / ``quantize_row_q8_1`` differ from ``ggml-quants.c``'s ``*_ref`` versions:
they multiply by ``127 / amax`` and round half to even (``_mm256_round_ps``).
"""

from __future__ import annotations

import ctypes
import subprocess
import tarfile
from pathlib import Path

import numpy as np
from kquant_files import GGML, ggml_quants_library
from llamacpp_sdist import sdist_path

from llamatrace.gguf.fetch import cache_root

_TABLES = r"""
#include <stdint.h>
float ggml_table_f32_f16[1 << 16];
float ggml_table_f32_e8m0_half[1 << 8];
float ggml_table_f32_ue4m3[1 << 8];
"""


def ggml_cpu_x86_library() -> ctypes.CDLL:
    """arch/x86/quants.c from the sdist, compiled once (needs gcc and an AVX2 CPU to run)."""
    base = ggml_quants_library()
    folder = cache_root() / "ggml-cpu-x86-0.3.36"
    lib = folder / "libggml_cpu_x86.so"
    if not lib.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist_path()) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(GGML + "/include/")
                       or m.name.startswith(GGML + "/src/ggml-cpu/")
                       or m.name in (GGML + "/src/ggml-common.h", GGML + "/src/ggml-impl.h",
                                     GGML + "/src/ggml-quants.h")]
            tar.extractall(folder, members=members, filter="data")
        root = folder / GGML
        tables = folder / "tables.c"
        tables.write_text(_TABLES)
        tmp = lib.with_name(lib.name + ".tmp")
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-std=c11", "-mavx2", "-mfma", "-mf16c",
                        f"-I{root}/include", f"-I{root}/src", f"-I{root}/src/ggml-cpu",
                        str(root / "src/ggml-cpu/arch/x86/quants.c"), str(tables), base._name, "-lm",
                        f"-Wl,-rpath,{Path(base._name).parent}",
                        "-o", str(tmp)], check=True, capture_output=True)
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


def ggml_cpu_q8(x: np.ndarray, q8_1: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml-cpu's x86 ``quantize_row_q8_0`` / ``quantize_row_q8_1`` of float32 ``x [S, n]``:
    (qs int8 [S, n], d float32 [S, n/32], s float32 [S, n/32]: Q8_1's fp16 ``d * sum(qs)``,
    zeros for Q8_0), the fp16 fields widened."""
    fn = getattr(ggml_cpu_x86_library(), "quantize_row_q8_1" if q8_1 else "quantize_row_q8_0")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    n_seq, n = x.shape
    x = np.ascontiguousarray(x, np.float32)
    head = 4 if q8_1 else 2                                              # fp16 d (and s), then qs[32]
    blocks = np.zeros((n_seq, n // 32, head + 32), np.uint8)
    for s in range(n_seq):                                               # one row a call, as ggml
        fn(x[s].ctypes.data, blocks[s].ctypes.data, n)
    scales = blocks[..., :head].copy().view(np.float16).astype(np.float32)
    return (blocks[..., head:].copy().view(np.int8).reshape(n_seq, n), scales[..., 0],
            scales[..., 1] if q8_1 else np.zeros_like(scales[..., 0]))


def _ggml_cpu_tables(lib) -> None:
    """Fill the lookup tables ``ggml_cpu_init`` would: fp16 -> float32 by NumPy, E8M0 by gguf-py's
    ``e8m0_to_fp32_half``."""
    import gguf
    for name, values in (("ggml_table_f32_f16", np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
                          .view(np.float16).astype(np.float32)),
                         ("ggml_table_f32_e8m0_half", gguf.quants.MXFP4.e8m0_to_fp32_half(
                             np.arange(256, dtype=np.uint32)).astype(np.float32))):
        ctypes.memmove((ctypes.c_float * values.size).in_dll(lib, name), values.ctypes.data, values.nbytes)


def ggml_cpu_mxfp4_matmul(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """llama.cpp's own ``x @ W.T`` for MXFP4 weights on x86 (:func:`ggml_cpu_matmul`): each row of
    ``x`` rounded to Q8_0 by ``quantize_row_q8_0``, then ``ggml_vec_dot_mxfp4_q8_0`` (AVX2) per
    weight row. raw uint8 [n_out, B*17] (the file's blocks), x float32 [S, B*32]; returns float32
    [S, n_out]."""
    return ggml_cpu_matmul("MXFP4", raw, x)


_VEC_DOT = {"Q4_K": ("quantize_row_q8_K", "ggml_vec_dot_q4_K_q8_K", 256, 292),
            "Q6_K": ("quantize_row_q8_K", "ggml_vec_dot_q6_K_q8_K", 256, 292),
            "MXFP4": ("quantize_row_q8_0", "ggml_vec_dot_mxfp4_q8_0", 32, 34),
            "Q8_0": ("quantize_row_q8_0", "ggml_vec_dot_q8_0_q8_0", 32, 34)}
"""Per weight type: the activation quantizer and vec dot llama.cpp's CPU backend pairs with it
(``type_traits_cpu``), and the quantized activations' block (weights, bytes: Q8_K is float32 d,
int8 qs[256], int16 bsums[16])."""


def ggml_cpu_matmul(type_name: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """llama.cpp's own ``x @ W.T`` on x86 for ``type_name`` (a key of :data:`_VEC_DOT`): each row of
    ``x`` quantized by the type's ``vec_dot_type`` quantizer, then its ``ggml_vec_dot_*`` (AVX2)
    per weight row, one row a call (``nrc`` 1). raw uint8 [n_out, row_bytes] (the file's blocks),
    x float32 [S, n]; returns float32 [S, n_out]."""
    lib = ggml_cpu_x86_library()
    _ggml_cpu_tables(lib)
    quant_name, dot_name, block, size = _VEC_DOT[type_name]
    quant, dot = getattr(lib, quant_name), getattr(lib, dot_name)
    quant.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    dot.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n_seq, n = x.shape
    raw = np.ascontiguousarray(raw, np.uint8)
    x = np.ascontiguousarray(x, np.float32)
    y = np.zeros((n_seq, raw.shape[0]), np.float32)
    q8 = np.zeros((n // block, size), np.uint8)
    for s in range(n_seq):
        quant(x[s].ctypes.data, q8.ctypes.data, n)
        for o in range(raw.shape[0]):
            dot(n, y[s, o:].ctypes.data, 0, raw[o].ctypes.data, 0, q8.ctypes.data, 0, 1)
    return y
