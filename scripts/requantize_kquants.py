"""Make the K-quant test files from the default model with llama.cpp's own quantizer.

Run in a venv with llama-cpp-python (a tool for making test data, never a llamatrace
dependency), e.g. ``/opt/lcpp/venv/bin/python scripts/requantize_kquants.py``. Reads
``SmolLM2-135M-Instruct.Q4_1.gguf`` from the llamatrace model cache (``$LLAMATRACE_CACHE_DIR`` or
``~/.cache/llamatrace``) and writes, beside it, one file per entry of :data:`FILES` (requantized:
``allow_requantize``), then prints each file's sha256 and tensor-type counts. After a change,
update the sha256s in ``tests/golden/make_golden.py`` and the goldens; ``tests/kquant_files.py``
(the CI rebuild without llama.cpp: ``llamatrace quantize``'s writer) must still give those bytes.

SmolLM2's width 576 is not a multiple of 256, so llama.cpp keeps K-quants for ``ffn_down``
(n_in 1536) and falls back elsewhere (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
Q2_K / Q3_K -> Q4_0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's llamatrace
from llamatrace.gguf.fetch import sha256_file  # noqa: E402  (needs no numba)

# name: (llama_ftype, pure)
FILES = {
    "Q4_K_M": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, False),
    "Q5_K_M": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M, False),
    "Q6_K": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, False),
    "Q3_K_M": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M, False),
    "Q2_K-pure": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K, True),
    "Q3_K-pure": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M, True),
}
SOURCE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> Path:
    root = os.environ.get("LLAMATRACE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "llamatrace") / "models"


def requantize(src: Path, dst: Path, ftype: int, pure: bool) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.pure = pure
    params.nthread = 2
    tmp = dst.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        sys.exit(f"error: llama_model_quantize({dst.name}) returned {rc}")
    tmp.replace(dst)


def main() -> None:
    import gguf

    src = model_dir() / SOURCE
    if not src.exists():
        sys.exit(f"error: {src} not found: run `llamatrace pull` first")
    for name, (ftype, pure) in FILES.items():
        dst = model_dir() / f"SmolLM2-135M-Instruct.{name}.gguf"
        requantize(src, dst, ftype, pure)
        counts: dict[str, int] = {}
        for t in gguf.GGUFReader(str(dst)).tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        print(dst.name, sha256_file(dst), counts)


if __name__ == "__main__":
    main()
