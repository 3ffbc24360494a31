"""The arithmetic of the forward pass: Numba kernels, each beside its NumPy twin.

``fp32`` holds the small float32 kernels (RMSNorm, RoPE, softmax, SiLU, attention). The weight
matmuls work on GGUF's blocks repacked into row tiles (``tiles``, ``packing``); one module per
quant family declares its block format and its kernels in the ``registry``, and
``registry.matmul`` looks up the kernel for a weight's (GGML type, activation mode, phase)::

    jit        Numba flag sets, fp16/bf16 decoding, target CPU features (every kernel module takes them from here)
    tiles      row tiles: float32 tile arithmetic, prefetch and 8-bit bit helpers
    registry   BlockFormat and @kernel declarations, lookup, describe, matmul
    packing    Weight, Arena, pack / pack_concat, the one repacker; dequantize, get_rows (NumPy)
    floats     F32, F16, BF16
    q4 q5 q8   Q4_0/Q4_1, Q5_0/Q5_1, Q8_0
    k_quants   Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
    act8       8-bit activations (``--activations q8``) for Q4_0, Q4_1, Q8_0, Q4_K, Q6_K;
    act8_ir      its block dot products in LLVM IR
    threads    threading layer, set_threads, AutoThreads
    probe      the machine's limits for bench: read bandwidth, int8 multiply-add peak

Activations are float32 by default; ``q8`` quantizes them to 8 bits per block, as llama.cpp
does (:mod:`llamatrace.kernels.act8`).

Adding a quant type (say IQ4_NL or Q8_1) touches one kernel module (new, or the family's) and
this file's import line below: in the module, declare the type's
:class:`~llamatrace.kernels.registry.BlockFormat` with :func:`~llamatrace.kernels.registry.block_format`
(block sizes, where the fp16 ``d`` / ``m`` and the quant bytes sit, its NumPy dequantizer), and
decorate thin adapters around its Numba kernels with ``@kernel(type, "f32", "decode")`` and
``@kernel(type, "f32", "prefill")`` (and ``"q8"`` if it has an 8-bit-activation kernel, which
also needs its row of ``act8``'s byte-group table, :data:`llamatrace.kernels.act8.TYPES`). ``packing``,
``registry``, the model and ``llamatrace info`` need no change: IQ4_NL (``d`` + 16 bytes of
nibbles indexing a 16-value table) and Q8_1 (``d``, ``s`` + 32 int8) are copied by the existing
repacker. Only a type whose sub-block scales must be unpacked at load in a new way (like
Q3_K's or Q4_K's 6-bit scales) adds a ``SCALES_*`` case to ``packing``'s repacker.
"""

# Every kernel module registers its formats and kernels on import; packing reads the registry.
from llamatrace.kernels import act8, floats, k_quants, q4, q5, q8  # noqa: F401
