"""Numba compile flags and fp16/bf16 decoding: the one place every kernel module takes them from.

Flag sets (pass as ``@njit(**JIT_PARALLEL)``):

- :data:`JIT`, :data:`JIT_PARALLEL`, :data:`JIT_INLINE`: the weight-matmul kernels. Their
  fastmath subset :data:`FASTMATH` is ``contract`` (FMAs), ``arcp``, ``afn``, ``nsz``. Not
  ``fastmath=True``: that adds ``nnan``/``ninf``, which let LLVM delete the NaN/Inf handling the
  tracer relies on. Not ``reassoc`` either: the kernels write their sums as explicit trees so
  several FMA chains run in parallel, and ``reassoc`` lets LLVM fold such a tree back into one
  serial chain (latency-bound).
- :data:`JIT_EXACT`, :data:`JIT_EXACT_PARALLEL`: no fastmath at all, for the float32 kernels of
  the forward pass (the causal mask's -inf must survive) and the activation quantizers (their
  roundings must be gguf's whatever the caller's flags).
- :data:`JIT_ATTN`: attention's products; ``reassoc`` lets LLVM vectorise the head_dim-long
  sums, and without ``nnan``/``ninf`` NaN still propagates.

fp16 / bf16 bits to float32: :data:`F16_TABLE` / :data:`BF16_TABLE` (65,536 entries, indexed by
the raw uint16; the float32 path's packers and the F16/BF16 kernels), :func:`f16` (LLVM's
``fpext half``, F16C's ``vcvtph2ps``, inside kernels that keep the file's fp16 bits) and its
NumPy twin :func:`f16_np`; :func:`f16_round` rounds a float32 to fp16 and back inside kernels
(:func:`f32_from_bits`: a float32 from its bits); :func:`f16_bytes_np` reads little-endian fp16 from a file's bytes.
All give the same float32 for every bit pattern (fp16 -> fp32 is exact).

Kernel cache: every kernel is compiled with ``cache=True``, and Numba keys a cached kernel by
its own file's content only, so a kernel whose callee (an intrinsic, an inlined function) lives
in another file kept the old callee's machine code after that file changed: ``git pull`` could
leave wrong kernels running with no error. :class:`_SourcesStamp`, registered here for
llamatrace's own files (those of other packages keep Numba's locators), adds to each kernel's
key a digest of every file kernels can call (:func:`kernel_sources_digest`), so a change to any
of them compiles the kernels again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import caching
from numba.extending import intrinsic

FASTMATH = {"contract", "arcp", "afn", "nsz"}  # a set: Numba rejects frozenset
JIT = dict(cache=True, fastmath=FASTMATH)
JIT_PARALLEL = dict(parallel=True, **JIT)
JIT_INLINE = dict(inline="always", **JIT)

JIT_EXACT = dict(cache=True)
JIT_EXACT_PARALLEL = dict(parallel=True, **JIT_EXACT)
JIT_QUANT = dict(JIT_EXACT, error_model="numpy")
"""The quantizers' flags: :data:`JIT_EXACT` with IEEE division (x/0 is
inf or NaN, as in C). Numba's default raises ZeroDivisionError, which inf inputs and blocks near
the float32 limit reach where ggml goes on with inf."""
JIT_QUANT_PARALLEL = dict(JIT_EXACT_PARALLEL, error_model="numpy")
JIT_ATTN = dict(cache=True, fastmath={"reassoc", "contract"})
JIT_ATTN_PARALLEL = dict(parallel=True, **JIT_ATTN)

_PACKAGE = Path(__file__).resolve().parent.parent         # llamatrace/
_IMPORTS_JIT = re.compile(rb"^(from|import) (numba|llvmlite)", re.MULTILINE)


@functools.cache
def kernel_sources_digest() -> str:
    """SHA-256 of every llamatrace file a kernel can call or read a constant from: all of
    ``kernels/`` and ``machine/``, and any other module that imports Numba or llvmlite at its top."""
    h = hashlib.sha256()
    for p in sorted(_PACKAGE.rglob("*.py")):
        text = p.read_bytes()
        if p.parent.name in ("kernels", "machine") or _PACKAGE / "kernels" in p.parents or _IMPORTS_JIT.search(text):
            h.update(str(p.relative_to(_PACKAGE)).encode() + b"\0" + text + b"\0")
    return h.hexdigest()


class _SourcesStamp:
    """A cache locator's source stamp plus :func:`kernel_sources_digest`, for llamatrace's files only."""

    def get_source_stamp(self):
        return super().get_source_stamp(), kernel_sources_digest()

    @classmethod
    def from_function(cls, py_func, py_file):
        if _PACKAGE not in Path(py_file).resolve().parents:
            return None
        return super().from_function(py_func, py_file)


class _UserProvidedLocator(_SourcesStamp, caching.UserProvidedCacheLocator):
    """``$NUMBA_CACHE_DIR``'s locator, keyed by the kernel sources too."""


class _InTreeLocator(_SourcesStamp, caching.InTreeCacheLocator):
    """The ``__pycache__`` locator, keyed by the kernel sources too."""


if _UserProvidedLocator not in caching.CacheImpl._locator_classes:
    caching.CacheImpl._locator_classes[:0] = [_UserProvidedLocator, _InTreeLocator]


def target_features() -> set[str]:
    """The CPU features Numba compiles for: ``NUMBA_CPU_FEATURES`` when set (then not the host's),
    else the host CPU's (LLVM's names: ``avx2``, ``avx512vnni``, ``avxvnni`` ...). Kernels that
    pick instructions by feature ask here, so a cross-target build picks the target's."""
    from numba.core import config
    if config.CPU_FEATURES:
        return {f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")}
    return {name for name, on in llvm_binding.get_host_cpu_features().items() if on}


def subnormal_fma_full_speed() -> bool:
    """Whether the CPU Numba compiles for takes float32 subnormal inputs to an FMA at full speed,
    so the ``f32`` decode kernels may read unsigned quants as subnormals instead of converting them
    (:data:`llamatrace.kernels.tiles.SUBNORMAL_BIAS`): AMD's Zen cores (LLVM's ``znver*``; measured
    on Zen 3, docs/performance.md "The float32 mode's decode kernels"). Intel documents microcode
    assists, hundreds of cycles, for operations on subnormal operands (its optimization manual;
    VTune's "FP Assists"), so every other CPU, and ``NUMBA_CPU_NAME=generic``, keeps the
    conversion. Keyed on the CPU name, as Numba's cache of compiled kernels is."""
    from numba.core import config
    return (config.CPU_NAME or llvm_binding.get_host_cpu_name()).startswith("znver")


def has_vnni() -> bool:
    """Whether the CPU Numba compiles for has ``vpdpbusd`` on 256-bit registers (AVX-512 VNNI + VL,
    or AVX-VNNI), unless ``LLAMATRACE_VNNI=0``."""
    if os.environ.get("LLAMATRACE_VNNI", "1") == "0":
        return False
    features = target_features()
    return {"avx512vnni", "avx512vl"} <= features or "avxvnni" in features


F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
"""float32 [65536]: the value of each fp16 bit pattern."""
BF16_TABLE = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
"""float32 [65536]: the value of each bf16 bit pattern."""
F16_BITS = np.arange(65536, dtype=np.uint32).astype(np.uint16)
"""uint16 [65536]: the identity, for packers that keep the fp16 bits as they are."""


def _e8m0_half_bits(e: np.ndarray) -> np.ndarray:
    # ggml-impl.h ggml_e8m0_to_fp32_half: 2**(e - 128), the two smallest as float32 denormals
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)


E8M0_HALF_TABLE = _e8m0_half_bits(np.arange(65536, dtype=np.uint32) & np.uint32(0xFF)).view(np.float32)
"""float32 [65536]: ggml's ``GGML_E8M0_TO_FP32_HALF`` of the low byte of each index, ``2**(e - 128)``
(half the E8M0 scale, because MXFP4's ``kvalues`` are the E2M1 values doubled); indexed by the
two bytes from an MXFP4 block's ``e`` on (the second is a quant byte, ignored)."""
E8M0_BITS = (np.arange(65536, dtype=np.uint32) & np.uint32(0xFF)).astype(np.uint16)
"""uint16 [65536]: the low byte of each index, for packers that keep an E8M0 byte as it is."""


@intrinsic
def f16(typingctx, bits):
    """float32 value of the fp16 bit pattern ``bits`` (uint16): LLVM's ``fpext half``, which is
    F16C's ``vcvtph2ps`` on AVX2 CPUs and vectorizes in the kernels' row loops."""
    if bits == types.uint16:
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(bits), codegen


@intrinsic
def f16_round(typingctx, v):
    """float32 ``v`` rounded to the nearest fp16 value (ties to even), as float32: LLVM's
    ``fptrunc`` to half then ``fpext`` (F16C's ``vcvtps2ph``/``vcvtph2ps``), what ggml's
    ``GGML_CPU_FP32_TO_FP16`` stores and its kernels read back. NumPy: ``v.astype(np.float16)``."""
    if v == types.float32:
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(v), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is ``bits`` (int32): LLVM's ``bitcast``, no instruction. NumPy:
    ``bits.view(np.float32)``."""
    if bits == types.int32:
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(bits), codegen


def f16_np(bits: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`f16`: float32 values of an array of fp16 bit patterns (uint16)."""
    return np.asarray(bits).view(np.float16).astype(np.float32)


def f16_bytes_np(b: np.ndarray) -> np.ndarray:
    """uint8 ``[..., 2]`` little-endian fp16 (a scale inside a GGUF block) -> float32 ``[...]``."""
    return f16_np(np.ascontiguousarray(b).view(np.uint16)[..., 0])
