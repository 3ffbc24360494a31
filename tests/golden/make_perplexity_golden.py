#!/usr/bin/env python3
"""Golden perplexity values from HF transformers (fp32), computed the way llama.cpp does.

Not part of llamatrace and never imported by the tests (needs torch + transformers: the golden
venv, see README.md). Writes ``tests/golden/perplexity_hf.json``: for each model file, the
corpus token ids, the running ``[i]`` values, PPL and its ± error over ``tests/golden/corpus.txt``
with ``n_ctx`` 256. The method is llama.cpp ``tools/perplexity/perplexity.cpp``
(``perplexity()``): ``n_chunk = n_tokens // n_ctx``, chunk ``i`` = ``tokens[i*n_ctx:(i+1)*n_ctx]``
(BOS in slot 0 when the vocabulary adds one; SmolLM2's does not), one forward pass from position
0 per chunk, NLL of the logits at positions ``n_ctx/2 … n_ctx-2`` against the next token,
``PPL = exp(mean NLL)``, error ``PPL * sqrt((mean(NLL²) - mean(NLL)²) / (count - 1))``.

Usage (from the repo root)::

  /work/venv-golden/bin/python tests/golden/make_perplexity_golden.py \
      --model ~/.cache/llamatrace/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --model ~/.cache/llamatrace/models/SmolLM2-135M-Instruct.Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's llamatrace
from llamatrace.gguf.fetch import sha256_file  # noqa: E402  (needs no numba)

HERE = Path(__file__).resolve().parent
N_CTX = 256


def perplexity(model, ids: list[int], n_ctx: int) -> dict:
    n_chunk = len(ids) // n_ctx
    first = n_ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    running = []
    t0 = time.perf_counter()
    for i in range(n_chunk):
        chunk = torch.tensor([ids[i * n_ctx:(i + 1) * n_ctx]])
        with torch.no_grad():
            logits = model(chunk).logits[0].double()                  # [n_ctx, vocab]
        logp = torch.log_softmax(logits[first:n_ctx - 1], dim=-1)
        targets = chunk[0, first + 1:n_ctx]
        nll = (-logp[torch.arange(len(targets)), targets]).tolist()
        for v in nll:
            nll_sum += v
            nll2_sum += v * v
        count += len(nll)
        running.append(math.exp(nll_sum / count))
    mean = nll_sum / count
    ppl = math.exp(mean)
    err = ppl * math.sqrt((nll2_sum / count - mean * mean) / (count - 1))
    return {"n_chunks": n_chunk, "n_scored": count, "running": running, "ppl": ppl, "ppl_error": err,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="a GGUF file (repeatable)")
    ap.add_argument("--corpus", default=str(HERE / "corpus.txt"))
    ap.add_argument("--out", default=str(HERE / "perplexity_hf.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    text = Path(args.corpus).read_text(encoding="utf-8")
    result = {"corpus_sha256": hashlib.sha256(text.encode()).hexdigest(), "n_ctx": N_CTX,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "models": {}}
    for path in map(Path, args.model):
        path = path.expanduser().resolve()
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        # llama.cpp's "smollm" pre-tokenizer splits digits first (see README.md, Tokenizer note)
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        assert not getattr(tok, "add_bos_token", False), "this script assumes no BOS (SmolLM2)"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32, attn_implementation="eager")
        model.eval()
        entry = perplexity(model, ids, N_CTX)
        entry.update(file=path.name, sha256=sha256_file(path), n_tokens=len(ids), ids=ids)
        print(f"{path.name}: PPL = {entry['ppl']:.4f} +/- {entry['ppl_error']:.5f} "
              f"({entry['n_chunks']} chunks, {entry['seconds']:.1f} s)")
        result["models"][path.name] = entry
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
