"""Record what llama.cpp's quantizer writes for the mixture-of-experts and Qwen3.5 families:
``tests/golden/quantize_moe.json``.

Run in the golden venv (llama-cpp-python 0.3.36, whose ``llama_model_quantize`` is ``llama-quantize``'s
own function)::

    PYTHONPATH=. /work/venv-golden/bin/python scripts/make_moe_quantize_golden.py

For each architecture of ``tests/moe_quantize_files.py`` it writes the random-weight base, quantizes it
with ``llama_model_quantize`` (2 threads; :func:`make_quantize_golden.quantize`, the same call as the
dense goldens) to each variant of :data:`VARIANTS` — file types, ``--tensor-type`` patterns on the
expert tensors, a per-expert importance matrix (``synthetic_imatrix``: ``[ne0 × n_expert]`` per
``_exps`` tensor, as llama-quantize passes a loaded one) and, for gpt-oss, ``MXFP4_MOE`` — and
records the base's sha256, and per variant the tensors' names and types in llama.cpp's order, the
sha256 of each tensor's data and of the whole file; and gpt-oss's MXFP4_MOE file (its experts as
published) requantized to Q4_K_M with ``allow_requantize``. No model file is committed.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import gguf
import llama_cpp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]
from make_quantize_golden import quantize  # noqa: E402
from moe_quantize_files import ARCHS, GOLDEN, make_base, synthetic_imatrix  # noqa: E402

from llamatrace.gguf.fetch import sha256_file  # noqa: E402

OVERRIDES = ("ffn_down_exps=q8_0", r"blk\.1\.ffn_up_exps=q5_0", "attn_q=q4_k")


def variants(arch: str) -> dict[str, tuple]:
    """name → (file type, --tensor-type overrides, with the per-expert imatrix)."""
    out = {"Q4_K_M": ("Q4_K_M", (), False), "Q8_0": ("Q8_0", (), False), "Q4_0": ("Q4_0", (), False),
           "Q4_K_M+imatrix": ("Q4_K_M", (), True), "Q4_0+imatrix": ("Q4_0", (), True),
           "Q4_K_M+overrides": ("Q4_K_M", OVERRIDES, False)}
    if arch != "qwen35":
        out["MXFP4_MOE"] = ("MXFP4_MOE", (), False)
    return out


def describe(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {"file_sha256": sha256_file(path),
            "tensors": [[t.name, t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()[:16]]
                        for t in r.tensors]}


def main() -> None:
    out: dict = {"llama_cpp_python": llama_cpp.__version__, "archs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            base = make_base(arch, Path(tmp) / f"{arch}.gguf")
            imatrix = synthetic_imatrix(arch)
            entry = {"base_sha256": sha256_file(base), "variants": {}}
            for name, (ftype, overrides, with_imatrix) in variants(arch).items():
                dest = Path(tmp) / f"{arch}-{name}.gguf"
                quantize(base, dest, ftype, overrides, imatrix if with_imatrix else None, {})
                entry["variants"][name] = {"type": ftype, "overrides": list(overrides), "imatrix": with_imatrix,
                                           **describe(dest)}
                print(arch, name, entry["variants"][name]["file_sha256"], flush=True)
                if name != "MXFP4_MOE":
                    dest.unlink()
            if arch == "gpt-oss":
                # as gpt-oss is published (MXFP4 experts): requantized to Q4_K_M with --allow-requantize
                published, dest = Path(tmp) / f"{arch}-MXFP4_MOE.gguf", Path(tmp) / f"{arch}-requant.gguf"
                params = llama_cpp.llama_model_quantize_default_params()
                params.ftype, params.nthread, params.allow_requantize = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2, True
                assert llama_cpp.llama_model_quantize(str(published).encode(), str(dest).encode(), params) == 0
                entry["requantized_from_MXFP4_MOE"] = {"type": "Q4_K_M", **describe(dest)}
            for leftover in Path(tmp).glob(f"{arch}*.gguf"):
                leftover.unlink()
            out["archs"][arch] = entry
    GOLDEN.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
