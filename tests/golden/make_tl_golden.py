#!/usr/bin/env python3
"""Generate the TransformerLens golden files for llamatrace's ``run_with_cache`` tests.

NOT part of llamatrace and never imported by it or by the tests: it needs torch, transformers
and transformer-lens, which live only in the golden venv (tests/golden/README.md). It loads the
GGUF through HF transformers (de-quantized to float32), wraps it in TransformerLens 4's
``TransformerBridge`` with ``enable_compatibility_mode(no_processing=True)`` (HookedTransformer's
hook names, HF's numbers: no LayerNorm folding, no unembedding centring), runs TL's own
``run_with_cache`` on each prompt, and stores every hook llamatrace serves:

  tests/golden/tl_<tag>.npz     "<prompt>/<hook name>" -> float32 [1, ...] (TL's shape, batch 1)
                                "<prompt>/tokens" -> int64 [pos]; "<prompt>/logits" -> [1, pos, vocab]
                                (logits: last position only, [1, 1, vocab], to keep the file small)

Layers kept: the first, the middle and the last (every hook name is still exercised);
``--prompts france`` keeps one prompt (the K-quant file: ~0.5 MB instead of ~1 MB).

Usage (from the repo root):

  /work/venv-golden/bin/python tests/golden/make_tl_golden.py --model PATH.gguf --tag smollm2
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformer_lens.model_bridge import TransformerBridge  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's llamatrace
from llamatrace.gguf.fetch import sha256_file  # noqa: E402  (needs no numba)

PROMPTS = {
    "france": "The capital of France is",
    "hi": "Hi there!",
}
# the TransformerLens names llamatrace serves (llamatrace/tracing/tl.py); blocks.{L}. prefixed
LAYER_HOOKS = (
    "hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized",
    "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k",
    "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid",
    "ln2.hook_scale", "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post",
    "hook_mlp_out", "hook_resid_post",
)
MODEL_HOOKS = ("hook_embed", "ln_final.hook_scale", "ln_final.hook_normalized")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--tag", required=True, help="file name tag: tests/golden/tl_<tag>.npz")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--prompts", nargs="+", choices=sorted(PROMPTS), default=list(PROMPTS))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    path = args.model.resolve()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="eager")
    hf.eval()
    bridge = TransformerBridge.boot_transformers(hf.config.name_or_path or "llama", hf_model=hf, tokenizer=tok)
    bridge.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    n_layers = hf.config.num_hidden_layers
    layers = sorted({0, n_layers // 2, n_layers - 1})

    out: dict[str, np.ndarray] = {}
    for name in args.prompts:
        text = PROMPTS[name]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits, cache = bridge.run_with_cache(torch.tensor([ids]))
            hf_logits = hf(torch.tensor([ids])).logits
        # the bridge runs HF's own modules: its logits are HF's, bit for bit
        assert torch.equal(logits, hf_logits), "bridge logits differ from HF's"
        out[f"{name}/tokens"] = np.asarray(ids, dtype=np.int64)
        out[f"{name}/logits"] = logits[:, -1:].numpy().astype(np.float32)
        names = list(MODEL_HOOKS) + [f"blocks.{L}.{h}" for L in layers for h in LAYER_HOOKS]
        for hook in names:
            out[f"{name}/{hook}"] = cache[hook].detach().numpy().astype(np.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"tl_{args.tag}.npz"
    np.savez_compressed(target, **out)
    meta = (f"model {path.name} sha256 {sha256_file(path)}; layers {layers}; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, transformer-lens {importlib.metadata.version('transformer-lens')}")
    print(f"wrote {target} ({target.stat().st_size / 1e6:.1f} MB): {meta}")


if __name__ == "__main__":
    main()
