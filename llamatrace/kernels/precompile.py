"""Compile the matmul kernels and the quantizers ahead of the first run (``scripts/setup.sh`` calls this).

Numba compiles a kernel the first time it runs and caches the machine code (per CPU), so a
first ``generate`` on a new machine, or on a file with another quant type, spends seconds
compiling, and a first ``quantize`` about a minute. ``python -m llamatrace.kernels.precompile
[TYPE ...]`` runs every registered kernel of the given GGML types (default: :data:`COMMON`)
once, decode and prefill, in both activation modes, on a small random matrix (and, for the
types of mixtures' experts, :func:`llamatrace.kernels.mul_mat_id.mul_mat_id` on a few random
experts, one slot and several, gate|up and down), and the quantizer
of each of them that ``quantize`` writes (default: :data:`QUANTIZED`) from float32 and from
float16 rows, so that later runs load them from the cache.
"""

from __future__ import annotations

import sys
import time

import gguf
import numpy as np

from llamatrace.kernels import mul_mat_id
from llamatrace.kernels.int8 import act8
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import GEMV_MAX_SEQ, MODES, matmul, served

# the types of the GGUF files people download (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0 mixes; gpt-oss's MXFP4)
COMMON = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "F16", "F32")
# what `quantize` writes for those mixes and for Q2_K / Q3_K_*, and the recipe search's default candidates
QUANTIZED = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def compile_kernels(type_names=COMMON, log=print, modes=MODES) -> float:
    """Run each kernel registered for ``type_names`` once per mode (of ``modes``) and phase;
    returns the seconds.

    Raises:
        ValueError: an unknown type name.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    registered = {t for t, _, _ in served()}
    for name in type_names:
        ggml_type = getattr(gguf.GGMLQuantizationType, name, None)
        if ggml_type is None:
            raise ValueError(f"unknown GGML type {name!r}")
        if ggml_type not in registered:
            continue
        block, size = gguf.GGML_QUANT_SIZES[ggml_type]
        n_in, n_out = 256, 64
        if ggml_type == gguf.GGMLQuantizationType.F32:
            raw = rng.standard_normal((n_out, n_in)).astype(np.float32)
        elif ggml_type == gguf.GGMLQuantizationType.F16:
            raw = rng.standard_normal((n_out, n_in)).astype(np.float16)
        else:
            raw = rng.integers(0, 256, (n_out, n_in // block * size), dtype=np.uint8)
        t1 = time.perf_counter()
        for mode in modes:
            if mode == "q8" and not act8.available():
                continue
            w = packing.pack(name, ggml_type, raw, n_out, n_in, activations=mode)
            for rows in (1, GEMV_MAX_SEQ + 1):
                matmul(np.ones((rows, n_in), dtype=np.float32), w)
            if mul_mat_id.supported(ggml_type, mode):
                experts = mul_mat_id.FileExperts(name, ggml_type, n_out // 2, n_in, raw.reshape(2, n_out // 2, -1))
                for ids in ([0], [1, 0, 1, 1, 0, 1]):
                    for parts in ((experts,), (experts, experts)):
                        mul_mat_id.mul_mat_id(np.ones((1, n_in), np.float32), parts, np.array(ids), np.zeros(len(ids)),
                                              activations=mode)
        log(f"{name}: {time.perf_counter() - t1:.1f} s")
    return time.perf_counter() - t0


def compile_quantizers(type_names=QUANTIZED, log=print) -> float:
    """Run the quantizer of each of ``type_names`` that has one on float32 and on float16 rows (an
    F16 base's rows go in as float16: another compiled signature); returns the seconds.

    Raises:
        ValueError: an unknown type name.
    """
    from llamatrace.kernels.quantizers.rows import QUANTIZABLE, quantize_rows
    t0 = time.perf_counter()
    for name in type_names:
        ggml_type = getattr(gguf.GGMLQuantizationType, name, None)
        if ggml_type is None:
            raise ValueError(f"unknown GGML type {name!r}")
        if ggml_type not in QUANTIZABLE:
            continue
        t1 = time.perf_counter()
        for dtype in (np.float32, np.float16):
            quantize_rows(ggml_type, np.zeros((1, 256), dtype))
        log(f"{name} quantizer: {time.perf_counter() - t1:.1f} s")
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    log = lambda line: print(f"  {line}", file=sys.stderr)      # noqa: E731
    seconds = compile_kernels(argv or COMMON, log=log) + compile_quantizers(argv or QUANTIZED, log=log)
    print(f"kernels compiled in {seconds:.0f} s (cached for later runs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
