"""The arithmetic of the forward pass: Numba kernels, each beside its NumPy twin.

``fp32`` holds the small float32 kernels (RMSNorm, RoPE, softmax, SiLU, attention). The weight
matmuls work on GGUF's blocks repacked into row tiles (``tiles``, ``packing``). A quant type is
one :class:`~llamatrace.kernels.types.registry.QuantType`, declared once in its family module: its block
format, NumPy dequantizer, kernels per (activation mode, phase) each with its NumPy twin, the
``q8`` mode's byte groups, and slots for its quantizer; the ``registry`` is built from the
declared types, and ``registry.matmul`` looks up the kernel for a weight's (GGML type, activation
mode, phase)::

    jit        Numba flag sets, fp16/bf16 decoding, target CPU features (every kernel module takes them from here)
    tiles      row tiles: float32 tile arithmetic, prefetch and 8-bit bit helpers
    registry   QuantType, BlockFormat, ScaleByte, Kernel; declare, lookup, describe, summary, matmul
    packing    Weight, Arena, pack / pack_concat, the one repacker; dequantize, get_rows, matmul_ref (NumPy)
    floats     declares F32, F16, BF16
    q4 q5 q8   declare Q4_0/Q4_1, Q5_0/Q5_1, Q8_0
    k_quants   declares Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
    act8       8-bit activations (``--activations q8``): quantization, layout, the Numba kernels
               that Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K declare as their ``q8`` kernels;
    act8_ir      its block dot products in LLVM IR
    amx        Q4_0 / Q8_0 / Q4_K / Q6_K q8 prefill on AMX tiles where measured faster (hardware ops | emulator)
    threads    threading layer, set_threads, AutoThreads
    probe      the machine's limits for bench: read bandwidth, int8 multiply-add peak

Activations are float32 by default; ``q8`` quantizes them to 8 bits per block, as llama.cpp
does (:mod:`llamatrace.kernels.int8.act8`). A packed weight's scales ``d``, ``m`` are float32 values
in the ``f32`` mode and the file's fp16 bits in the ``q8`` mode
(:data:`~llamatrace.kernels.types.registry.SCALE_DTYPES`, ``Weight.mode``, ``Weight.scales_f32``).

Adding a quant type (say IQ4_NL or Q8_1) touches one family module (new, or the family's) and, for
a new module, this file's import line below. In the module, write the type's NumPy dequantizer
and its Numba kernels, each with a NumPy twin, thin adapters ``(x, w, out)`` that call the
kernels with the weight's arrays (and twins ``(x, w) -> y``), and declare it once::

    IQ4_NL = declare(QuantType(
        _T.IQ4_NL, BlockFormat(weights=32, file_bytes=18, packed_bytes=16, copy=(2, 0, 16), d_off=0),
        dequant_np=dequant_iq4_nl_np,
        kernels={"f32": (Kernel(gemv_iq4_nl, gemv_iq4_nl_np), Kernel(tiled_iq4_nl, matmul_ref))}))

(``"q8": (decode, prefill)`` and ``q8_bytes`` too if it has 8-bit-activation kernels.)
``packing``, ``registry``, the model and ``llamatrace info`` need no change: the repacker copies
IQ4_NL (``d`` + 16 bytes of nibbles indexing a 16-value table) and Q8_1 (``d``, ``s`` + 32 int8)
as they are, and a type whose sub-block scales unpack at load (like Q3_K's or Q4_K's 6-bit
scales) says how in its ``BlockFormat.scales``, one :class:`~llamatrace.kernels.types.registry.ScaleByte`
per packed byte.
"""

# Every family module declares its types on import; the registry and packing read them.
from llamatrace.kernels.int8 import act8  # noqa: F401
from llamatrace.kernels.types import floats, k_quants, q4, q5, q8  # noqa: F401
