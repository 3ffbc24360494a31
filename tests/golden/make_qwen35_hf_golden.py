#!/usr/bin/env python3
"""Golden logits of HF transformers' Qwen3.5 on the random-weight ``qwen35`` test file: a second
reference, beside llama.cpp's (make_qwen35_golden.py).

NOT part of llamatrace and never imported by the tests, which only read what it writes:

  tests/golden/qwen35_hf.npz   ``ids`` int32 [N] (make_qwen35_golden.py's sequence),
                               ``prefill`` float32 [N, vocab]: HF's logits, one batch of N tokens

The file is ``tests/qwen35_files.py``'s, but with ``rope.dimension_sections`` [2, 1, 1, 0]
(:data:`HF_SECTIONS`) instead of [1, 1, 1, 1]: HF rotates every rotary pair of a text token with
its position (``Qwen3_5TextRotaryEmbedding``: the three sections carry the same position), as
llama.cpp does when the fourth section is 0 (Qwen3.5's own [11, 11, 10, 0]); the test file's
fourth pair, left unrotated by llama.cpp, has no HF counterpart.

transformers has no GGUF loader for ``qwen35``, so the script builds ``Qwen3_5ForCausalLM`` from
the file's hyper-parameters and undoes what llama.cpp's converter (``conversion/qwen.py``:
``Qwen3NextModel`` and ``_LinearAttentionVReorderBase.modify_tensors``) did to HF's tensors:
- the RMSNorm weights but the gated one (``ssm_norm``) were stored as 1 + w (HF's norms scale
  by 1 + w): w = GGUF − 1;
- ``ssm_a`` = −exp(A_log): A_log = log(−ssm_a); ``ssm_dt.bias`` is ``dt_bias``;
- the value heads were reordered from HF's grouped order (the value heads of key head 0, then
  of key head 1, …) to ggml's tiled one (value head j of every key head, then j + 1, …), in the
  v rows of ``attn_qkv`` and of the conv kernel, in ``attn_gate`` (z), ``ssm_beta``,
  ``ssm_alpha``, ``ssm_a``, ``ssm_dt`` and the columns of ``ssm_out``: reordered back;
- the conv kernel lost its middle axis of 1.

Float32 weights and activations, eager attention, 1 thread, the ``torch`` fallbacks of the
DeltaNet kernels (``torch_chunk_gated_delta_rule``: HF's own chunked form, 64 tokens a chunk).

Usage (from the repo root, in a venv with torch and transformers ≥ 5.2 — not the golden venv,
which has no torch: see tests/golden/README.md):

  /work/venv-hf/bin/python tests/golden/make_qwen35_hf_golden.py --out tests/golden
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from qwen35_files import (CONTEXT, CONV_KERNEL, DIM, HEAD_DIM, HIDDEN, INTERVAL, N_HEADS,  # noqa: E402
                          N_K_HEADS, N_KV_HEADS, N_LAYERS, N_V_HEADS, ROPE_DIM, SSM_HEAD_DIM,
                          write_qwen35_file)

N = 80                          # make_qwen35_golden.py's N: past the 64-token chunk
HF_SECTIONS = [2, 1, 1, 0]      # every rotary pair rotated (see the module docstring)


def token_ids(vocab_size: int) -> np.ndarray:
    """make_qwen35_golden.py's sequence: N ids drawn once (seed 35), control tokens excluded."""
    return np.random.default_rng(35).integers(3, vocab_size, size=N).astype(np.int32)


def untile(x: np.ndarray, head_dim: int, axis: int = 0) -> np.ndarray:
    """Value heads along ``axis`` from ggml's tiled order back to HF's grouped order."""
    x = np.moveaxis(x, axis, 0)
    r = N_V_HEADS // N_K_HEADS
    y = x.reshape(r, N_K_HEADS, head_dim, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(y, 0, axis)


def hf_state_dict(path: Path) -> dict[str, np.ndarray]:
    import gguf
    t = {x.name: np.array(x.data, dtype=np.float32) for x in gguf.GGUFReader(str(path)).tensors}
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"] - 1,
          "lm_head.weight": t["output.weight"]}
    qk = 2 * N_K_HEADS * SSM_HEAD_DIM
    for i in range(N_LAYERS):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        sd |= {h + "input_layernorm.weight": t[g + "attn_norm.weight"] - 1,
               h + "post_attention_layernorm.weight": t[g + "post_attention_norm.weight"] - 1,
               h + "mlp.gate_proj.weight": t[g + "ffn_gate.weight"], h + "mlp.up_proj.weight": t[g + "ffn_up.weight"],
               h + "mlp.down_proj.weight": t[g + "ffn_down.weight"]}
        if (i + 1) % INTERVAL:
            a = h + "linear_attn."
            qkv, conv = t[g + "attn_qkv.weight"], t[g + "ssm_conv1d.weight"]
            sd |= {a + "in_proj_qkv.weight": np.concatenate([qkv[:qk], untile(qkv[qk:], SSM_HEAD_DIM)]),
                   a + "conv1d.weight": np.concatenate([conv[:qk], untile(conv[qk:], SSM_HEAD_DIM)])[:, None, :],
                   a + "in_proj_z.weight": untile(t[g + "attn_gate.weight"], SSM_HEAD_DIM),
                   a + "in_proj_b.weight": untile(t[g + "ssm_beta.weight"], 1),
                   a + "in_proj_a.weight": untile(t[g + "ssm_alpha.weight"], 1),
                   a + "A_log": np.log(-untile(t[g + "ssm_a"], 1)),
                   a + "dt_bias": untile(t[g + "ssm_dt.bias"], 1),
                   a + "norm.weight": t[g + "ssm_norm.weight"],
                   a + "out_proj.weight": untile(t[g + "ssm_out.weight"], SSM_HEAD_DIM, axis=1)}
        else:
            a = h + "self_attn."
            sd |= {a + "q_proj.weight": t[g + "attn_q.weight"], a + "k_proj.weight": t[g + "attn_k.weight"],
                   a + "v_proj.weight": t[g + "attn_v.weight"], a + "o_proj.weight": t[g + "attn_output.weight"],
                   a + "q_norm.weight": t[g + "attn_q_norm.weight"] - 1,
                   a + "k_norm.weight": t[g + "attn_k_norm.weight"] - 1}
    return sd


def hf_logits(path: Path, ids: np.ndarray, vocab_size: int) -> np.ndarray:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, head_dim=HEAD_DIM,
        linear_conv_kernel_dim=CONV_KERNEL, linear_key_head_dim=SSM_HEAD_DIM, linear_value_head_dim=SSM_HEAD_DIM,
        linear_num_key_heads=N_K_HEADS, linear_num_value_heads=N_V_HEADS, rms_norm_eps=1e-6,
        max_position_embeddings=CONTEXT, tie_word_embeddings=False,
        layer_types=["linear_attention" if (i + 1) % INTERVAL else "full_attention" for i in range(N_LAYERS)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": ROPE_DIM / HEAD_DIM,
                         "mrope_section": HF_SECTIONS[:3], "mrope_interleaved": True},
        attn_implementation="eager", dtype=torch.float32)
    model = Qwen3_5ForCausalLM(config).eval()
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_state_dict(path).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"weights do not map: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64))[None], use_cache=False)
    return out.logits[0].float().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    args = ap.parse_args()
    import gguf
    with tempfile.TemporaryDirectory() as tmp:
        path = write_qwen35_file(Path(tmp) / "tiny-qwen35-hf.gguf", meta={"rope.dimension_sections": HF_SECTIONS})
        vocab = len(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)
        ids = token_ids(vocab)
        logits = hf_logits(path, ids, vocab)
    np.savez_compressed(args.out / "qwen35_hf.npz", ids=ids, prefill=logits)
    import torch
    import transformers
    print(f"wrote {args.out / 'qwen35_hf.npz'} ({N} tokens × {vocab}; transformers {transformers.__version__}, "
          f"torch {torch.__version__})")


if __name__ == "__main__":
    main()
