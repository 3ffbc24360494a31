"""Write llama.cpp's float32 inputs and outputs of layer 0's matrix multiplications on the default
model: the file tests/test_act8.py holds the ``q8`` mode's matmuls to.

Needs llama-cpp-python 0.3.36 (the extra ``llamatrace[llamacpp]``); never imported by tests. One
prefill of the "france" prompt's ids (as ``make_llamacpp_dump.py``) through the graph callback
(:mod:`llamatrace.peers.llamacpp`, capture mode). Unlike that dump (float16), the tensors are kept
as float32, exactly as read: llama.cpp quantizes each input row to 8 bits, so an input rounded to
float16 moves some of its quants, and only the exact inputs can show the arithmetic is the same.

    python tests/golden/make_q8_matmul_golden.py path/to/SmolLM2-135M-Instruct.Q4_1.gguf

Writes ``tests/golden/llamacpp_q8_matmuls.npz``: ``<name>`` float32 ``[n_tokens, width]`` for the
inputs (``attn_norm-0``, ``kqv_out-0``, ``ffn_norm-0``, ``ffn_swiglu-0``) and outputs (``Qcur-0``,
``Kcur-0``, ``Vcur-0``, ``attn_out-0``, ``ffn_gate-0``, ``ffn_up-0``, ``ffn_out-0``), and ``meta``
(a JSON string: prompt ids, settings).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llamatrace.gguf.fetch import sha256_file  # noqa: E402
from llamatrace.peers.llamacpp import LlamaCpp  # noqa: E402

SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PROMPT = "The capital of France is"         # tokenized as-is (no BOS), as make_llamacpp_dump.py
KEEP = {("attn_norm-0", "MUL"), ("Qcur-0", "MUL_MAT"), ("Kcur-0", "MUL_MAT"), ("Vcur-0", "MUL_MAT"),
        ("kqv_out-0", "CONT"), ("attn_out-0", "MUL_MAT"), ("ffn_norm-0", "MUL"), ("ffn_gate-0", "MUL_MAT"),
        ("ffn_up-0", "MUL_MAT"), ("ffn_swiglu-0", "SWIGLU"), ("ffn_out-0", "MUL_MAT")}


def main(path: str) -> None:
    digest = sha256_file(Path(path))
    if digest != SHA256:
        sys.exit(f"{path}: sha256 {digest}, expected {SHA256} (SmolLM2-135M-Instruct.Q4_1.gguf)")
    import llama_cpp
    vocab = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    ids = vocab.tokenize(PROMPT.encode(), add_bos=False, special=False)
    peer = LlamaCpp(path, 64, 2, capture=True)
    peer.eval(ids)
    arrays = {c.name: c.array.reshape(len(ids), -1).astype(np.float32)
              for c in peer.captured if (c.name, c.op) in KEEP}
    assert len(arrays) == len(KEEP), sorted(arrays)
    meta = {"prompt": PROMPT, "prompt_ids": ids, "settings": peer.settings, "version": peer.version}
    out = Path(__file__).resolve().parent / "llamacpp_q8_matmuls.npz"
    np.savez_compressed(out, meta=json.dumps(meta), **arrays)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
