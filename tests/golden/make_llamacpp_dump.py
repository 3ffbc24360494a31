"""Write llama.cpp's graph tensors for the default model: the files test_compare.py reads.

Needs llama-cpp-python 0.3.36 (the extra ``llamatrace[llamacpp]``); never imported by tests.
For each prompt: llama.cpp's prefill of the prompt's ids, then one decode step fed the greedy
token, read through the graph callback (:mod:`llamatrace.peers.llamacpp`, capture mode). Kept:
every tensor of layers 0 and 29 and the model-level ones, exactly as read (ggml's four dims,
padded KV cells and all, so the tests exercise the layout fixes), stored as float16.

    python tests/golden/make_llamacpp_dump.py path/to/SmolLM2-135M-Instruct.Q4_1.gguf

Writes ``tests/golden/llamacpp_<name>.npz``: keys ``step{S}.{index:03d}.{name}.{op}`` and ``meta``
(a JSON string: prompt, prompt_ids, fed, start_pos per step, settings).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llamatrace.gguf.fetch import sha256_file  # noqa: E402
from llamatrace.peers.llamacpp import LlamaCpp  # noqa: E402

SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# tokenized as-is (no chat template, no BOS), as `llamatrace compare --raw` does
PROMPTS = {"france": "The capital of France is", "once": "Once upon a time there"}
KEEP = re.compile(r"^(?:.+-(?:0|29)|embd|inp_embd|attn_inp_kq_mask|result_norm|result_output)$")


def main(path: str) -> None:
    digest = sha256_file(Path(path))
    if digest != SHA256:
        sys.exit(f"{path}: sha256 {digest}, expected {SHA256} (SmolLM2-135M-Instruct.Q4_1.gguf)")
    import llama_cpp
    vocab = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    for name, text in PROMPTS.items():
        ids = vocab.tokenize(text.encode(), add_bos=False, special=False)
        engine = LlamaCpp(path, 64, 2, capture=True)
        arrays, start, fed = {}, [], []
        chunk = ids
        for step in range(2):
            start.append(engine.n_past)
            logits = engine.eval(chunk)
            for i, c in enumerate(engine.captured):
                if KEEP.match(c.name):
                    arrays[f"step{step}.{i:03d}.{c.name}.{c.op}"] = c.array.astype(np.float16)
            chunk = [int(np.argmax(logits[-1]))]
            fed.append(chunk[0])
        meta = {"prompt": text, "prompt_ids": list(ids), "fed": fed[:1], "start_pos": start,
                "settings": {"engine": engine.version, **engine.settings}, "model_sha256": SHA256}
        engine.close()
        out = Path(__file__).with_name(f"llamacpp_{name}.npz")
        np.savez_compressed(out, meta=np.array(json.dumps(meta)), **arrays)
        print(out, out.stat().st_size, "bytes", meta["prompt_ids"], meta["fed"])


if __name__ == "__main__":
    main(sys.argv[1])
