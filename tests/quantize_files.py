"""The F16 base and the importance matrix that ``llamatrace quantize``'s golden files were made from.

Both sides of the comparison (``scripts/make_quantize_golden.py`` with llama.cpp, the tests with
llamatrace) quantize the same base bytes, so the base may be made by our own code, and it is
rebuilt here, in CI, from the cached default model:

- :func:`make_f16_base`: SmolLM2-135M-Instruct Q4_1 (the default model) with every Q4_1 tensor
  dequantized (gguf-py's ``d * q + m`` in float32, as ggml's ``dequantize_row_q4_1``) and rounded
  to float16 (nearest even), the norms kept F32, ``general.file_type`` = 1 (MOSTLY_F16): what
  ``llamatrace quantize Q4_1.gguf base.gguf --type F16 --allow-requantize`` writes. Its sha256 is
  in the golden JSON (``base.sha256``) and checked.
- :func:`synthetic_imatrix`: column importances for every matrix, from a closed formula (exact in
  float32, no random generator whose stream could change), so that the imatrix paths of every
  quantizer are compared without committing a matrix of 130 000 values.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llamatrace.gguf.reader import open_gguf
from llamatrace.quantize.rules import FILE_TYPES, tensor_types
from llamatrace.quantize.writer import quantize_gguf

GOLDEN = Path(__file__).parent / "golden" / "quantize.json"
KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output", "token_embd")


def golden() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def make_f16_base(source: Path, dest: Path) -> Path:
    """Write the F16 base (see the module docstring) from the default model's Q4_1 file."""
    with open_gguf(source) as f:
        types = tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()},
                             f.metadata, "F16")
        quantize_gguf(f, dest, types, FILE_TYPES["F16"], allow_requantize=True)
    return dest


def synthetic_imatrix(base: Path) -> dict[str, np.ndarray]:
    """Tensor name → float32 ``[ne0]`` column importances for every 2-D ``.weight`` of ``base``
    but the token embedding (llama-imatrix has none for it): ``0.25 + ((j·40503 + 977·k) mod 1021) / 128``
    for column j of the k-th such tensor in name order — a spread of 1 to ~32, exact in float32."""
    with open_gguf(base) as f:
        names = sorted(n for n, t in f.tensors.items()
                       if len(t.shape) >= 2 and n.endswith(".weight") and n != "token_embd.weight")
        out = {}
        for k, name in enumerate(names):
            j = np.arange(int(f.tensors[name].shape[0]), dtype=np.int64)
            out[name] = (0.25 + ((j * 40503 + 977 * k) % 1021) / 128).astype(np.float32)
    return out
