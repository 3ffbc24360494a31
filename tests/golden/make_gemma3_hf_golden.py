#!/usr/bin/env python3
"""HF transformers fp32 on the Gemma 3 270M file, and why it differs from llama.cpp.

Not part of llamatrace, never imported by the tests; needs torch + transformers + gguf (the golden
venv) and tests/golden/gemma3_270m_llamacpp.json / gemma3_270m_logits.npz (make_gemma3_golden.py).
Writes tests/golden/gemma3_270m_hf.json:

* ``prompts``: for llama.cpp's prompt ids, HF's fp32 greedy continuation (32 tokens) with the
  top-1 minus top-2 logit of each step, and the 50 largest logits at the last prompt position
  (ids and values): the reference of llamatrace's f32 mode;
* ``gap_to_llamacpp``: max |HF − llama.cpp| / max |llama.cpp| of the last-position logits, per
  prompt, for HF as loaded and for readings of the file that differ in one convention (the local
  layers' rotary base, the query scale) or in arithmetic (llama.cpp's 8-bit activations, its fp16
  GELU table and fp16 K/V cache, emulated). docs/models.md discusses the numbers.

Usage (from the repo root)::

  /work/venv-golden/bin/python tests/golden/make_gemma3_hf_golden.py \\
      --model ~/.cache/llamatrace/models/gemma-3-270m-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

HERE = Path(__file__).resolve().parent
N_GENERATE = 32
HF_LINEAR_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                     "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_0 and back: blocks of 32, scale amax/127 stored as fp16."""
    b = x.reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    q = torch.round(b * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d.half().float()).reshape(x.shape)


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_K and back: blocks of 256, iscale -127/max (signed max), fp32 scale."""
    b = x.reshape(-1, 256)
    mx = torch.gather(b, 1, b.abs().argmax(1, keepdim=True))
    iscale = torch.where(mx != 0, -127 / mx, torch.zeros_like(mx))
    q = torch.clamp(torch.round(iscale * b), max=127)
    return (q * torch.where(iscale != 0, 1 / iscale, torch.zeros_like(iscale))).reshape(x.shape)


def gelu_fp16_table(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU (GGML_GELU_FP16): a table indexed by the fp16 input, fp16 values, |x| < 10."""
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    torch.set_num_threads(2)
    gold = json.loads((args.out / "gemma3_270m_llamacpp.json").read_text(encoding="utf-8"))
    ref = dict(np.load(args.out / "gemma3_270m_logits.npz"))
    model = AutoModelForCausalLM.from_pretrained(str(args.model.parent), gguf_file=args.model.name,
                                                 dtype=torch.float32).eval()
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(args.model)).tensors}

    def last_logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].numpy()

    prompts = {}
    for name, p in gold["prompts"].items():
        ids, out, margins = list(p["prompt_ids"]), [], []
        first = last_logits(ids)
        logits = first
        while len(out) < N_GENERATE:       # no KV cache: 32 short forward passes
            top2 = np.partition(logits, -2)[-2:]
            out.append(int(np.argmax(logits)))
            margins.append(float(top2[1] - top2[0]))
            logits = last_logits(ids + out)
        top = np.argsort(-first, kind="stable")[:50]
        prompts[name] = {"greedy_ids": out, "greedy_margins": margins,
                         "top50_ids": top.tolist(), "top50_logits": first[top].tolist()}

    def gaps() -> dict[str, float]:
        return {name: round(float(np.abs(last_logits(p["prompt_ids"]) - ref[name]).max()
                                  / np.abs(ref[name]).max()), 4) for name, p in gold["prompts"].items()}

    gap = {"hf_as_loaded": gaps()}
    rotary = model.model.rotary_emb
    local = rotary.sliding_attention_inv_freq.clone()
    rotary.sliding_attention_inv_freq.copy_(rotary.full_attention_inv_freq)
    gap["local_layers_rotary_base_1e6"] = gaps()
    rotary.sliding_attention_inv_freq.copy_(local)
    cfg = model.config
    for layer in model.model.layers:
        layer.self_attn.scaling = (cfg.hidden_size / cfg.num_attention_heads) ** -0.5
    gap["query_scale_1/sqrt(n_embd/n_head)"] = gaps()
    for layer in model.model.layers:
        layer.self_attn.scaling = cfg.query_pre_attn_scalar ** -0.5

    # llama.cpp's arithmetic, cumulatively: 8-bit activations into every matmul (Q8_K for K-quant
    # weights, Q8_0 otherwise), then its fp16 GELU table, then fp16 K and V
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            parts = name.split(".")
            tensor = "token_embd.weight" if parts[-1] == "lm_head" else \
                f"blk.{parts[2]}.{HF_LINEAR_TO_GGUF[parts[-1]]}.weight"
            quant = q8_k if types[tensor].endswith("_K") else q8_0
            module.register_forward_pre_hook(lambda mod, a, quant=quant: (quant(a[0]),))
    gap["q8_activations"] = gaps()
    for layer in model.model.layers:
        layer.mlp.act_fn.register_forward_hook(lambda mod, a, out: gelu_fp16_table(a[0]))
    gap["q8_activations+fp16_gelu"] = gaps()
    for layer in model.model.layers:
        for module in (layer.self_attn.k_norm, layer.self_attn.v_proj):
            module.register_forward_hook(lambda mod, a, out: out.half().float())
    gap["q8_activations+fp16_gelu+fp16_kv"] = gaps()

    golden = {"model_sha256": gold["model_sha256"], "transformers": transformers.__version__,
              "torch": torch.__version__, "config": {k: v for k, v in cfg.to_dict().items() if k in (
                  "head_dim", "query_pre_attn_scalar", "rope_parameters", "sliding_window", "layer_types")},
              "prompts": prompts, "gap_to_llamacpp": gap}
    (args.out / "gemma3_270m_hf.json").write_text(json.dumps(golden, indent=1) + "\n")
    for variant, per_prompt in gap.items():
        print(f"{variant:40s} " + " ".join(f"{n} {v:.4f}" for n, v in per_prompt.items()))


if __name__ == "__main__":
    main()
