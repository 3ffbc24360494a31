"""The arithmetic of the forward pass: Numba kernels, each beside its NumPy twin.

Four rooms by role, around the tiles every one of them uses::

    tiles        row tiles: float32 tile arithmetic, prefetch, bit helpers; VectorTile, the IR
                 builder of the register-blocked microkernels (prefill_lanes)
    types/       what a weight type is
      registry     QuantType, BlockFormat, ScaleByte, Kernel; declare, lookup, describe, summary, matmul
      packing      Weight, Arena, pack / pack_concat, the one repacker; dequantize, get_rows, matmul_ref (NumPy)
      floats       declares F32, F16, BF16
      q4 q5 q8     declare Q4_0/Q4_1, Q5_0/Q5_1, Q8_0, with their dequantizers and f32 kernels
      k_quants     declares Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, likewise
      mxfp4        declares MXFP4 (gpt-oss's experts: E8M0 scale, E2M1 codes), f32 and q8 kernels
    int8/        the q8 mode (``--activations q8``), llama.cpp's 8-bit activations
      act8         activation quantization and the Numba kernels the types declare as ``q8`` kernels
      act8_ir      their block dot products and microkernels in LLVM IR
      amx          Q4_0 / Q8_0 / Q4_K / Q6_K q8 prefill on AMX tiles where measured faster (hardware ops | emulator)
    ops/         fp32: RMSNorm, RoPE, masks, softmax, SiLU, GELU, soft-capping, attention
    quantizers/  the write side: rows (quantize_rows, the 32-weight blocks), k_rows (the K-quants)
    precompile   compiles the matmul kernels ahead of a first run

Numba's flags, the CPU features and the thread policy are the machine's
(:mod:`llamatrace.machine.jit`, :mod:`llamatrace.machine.threads`). ``registry.matmul`` looks up
the kernel for a weight's (GGML type, activation mode, phase).

Activations are float32 by default; ``q8`` quantizes them to 8 bits per block, as llama.cpp
does (:mod:`llamatrace.kernels.int8.act8`). A packed weight's scales ``d``, ``m`` are the file's fp16
bits in the ``q8`` mode (and Q8_0's in ``f32``), else float32 values
(``BlockFormat.scale_bits``, ``Weight.mode``, ``Weight.scales_f32``).

Adding a quant type (say IQ4_NL or Q8_1) touches one family module in ``types/`` (new, or the
family's) and, for a new module, this file's import line below. In the module, write the type's
NumPy dequantizer and its Numba kernels, each with a NumPy twin, thin adapters ``(x, w, out)``
that call the kernels with the weight's arrays (and twins ``(x, w) -> y``), and declare it once::

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
from llamatrace.kernels.types import floats, k_quants, mxfp4, q4, q5, q8  # noqa: F401
