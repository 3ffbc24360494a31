"""A small random-weight ``qwen35`` GGUF (Qwen3.5: gated DeltaNet layers beside gated full
attention), written with ``gguf.GGUFWriter`` for the fidelity tests against llama.cpp.

Deliberately awkward: 4 layers with ``full_attention_interval`` 3 (layers 0, 1, 3 recurrent,
2 full attention); 2 key heads under 4 value heads in the DeltaNet (``num_k_heads`` ≠
``num_v_heads``, so the key heads are tiled); grouped-query full attention with a partial rotary
(8 of 16 dims) whose sections ``[1, 1, 1, 1]`` leave the fourth pair unrotated (a text token's
extra M-RoPE position is 0); decays ``exp(g)`` spread over about (0.2, 1) and write strengths β
over (0, 1); norms that are not all ones; a context long enough for a prompt past llama.cpp's
64-token chunk. F32 weights (Q8_0 for the q8 mode's test). Deterministic per ``seed``.

``moe=True`` writes the ``qwen35moe`` variant instead: the same layers with a mixture of
:data:`N_EXPERT` experts (top :data:`N_EXPERT_USED`, width :data:`EXPERT_FF`) and a gated shared
expert (width :data:`SHEXP_FF`), all widths unlike each other and the dense one. The router's
rows are large (std ROUTER_STD/√dim, as tests/moe_files.py) so that each token's k-th and
(k+1)-th router logits stay far apart beside float32 rounding.

``python tests/qwen35_files.py DIR`` writes both files into DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gguf_factory import CHATML, _store, vocabulary  # noqa: E402

T = gguf.GGMLQuantizationType
ARCH = "qwen35"
DIM, HIDDEN, CONTEXT = 64, 96, 128
N_LAYERS, INTERVAL = 4, 3                      # recurrent: 0, 1, 3; full attention: 2
N_HEADS, N_KV_HEADS, HEAD_DIM, ROPE_DIM, SECTIONS = 4, 2, 16, 8, [1, 1, 1, 1]
N_K_HEADS, N_V_HEADS, SSM_HEAD_DIM, CONV_KERNEL = 2, 4, 16, 4
N_EXPERT, N_EXPERT_USED, EXPERT_FF, SHEXP_FF, ROUTER_STD = 7, 3, 40, 56, 4.0     # qwen35moe


def write_qwen35_file(path: str | Path, seed: int = 0, qtype: T = T.F32, skip_tensors: tuple[str, ...] = (),
                      meta: dict[str, object] | None = None, shapes: dict[str, tuple[int, ...]] | None = None,
                      moe: bool = False, fused_gate_up: bool = False) -> Path:
    """Write the random ``qwen35`` (``moe``: ``qwen35moe``) file at ``path`` and return the path.

    ``skip_tensors`` leaves those tensors out; ``meta`` writes or replaces ``qwen35.*`` keys (key
    without the prefix → value: int as uint32, float as float32, list of bools as a bool array,
    ``None`` removes the key); ``shapes`` gives tensors another numpy shape (broken files).
    ``fused_gate_up`` (with ``moe``) stores the same experts' gate and up as one ``ffn_gate_up_exps``
    ``[n_expert, 2*EXPERT_FF, dim]``, gate rows first."""
    arch = "qwen35moe" if moe else ARCH
    rng = np.random.default_rng([seed, 35] + ([1] if moe else []))
    tokens, types, merges = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-random-{arch}-test")
    keys: dict[str, object] = {
        "block_count": N_LAYERS, "context_length": CONTEXT, "embedding_length": DIM,
        "feed_forward_length": HIDDEN, "attention.head_count": N_HEADS, "attention.head_count_kv": N_KV_HEADS,
        "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM,
        "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": ROPE_DIM, "rope.freq_base": 10000.0,
        "rope.dimension_sections": SECTIONS, "full_attention_interval": INTERVAL,
        "ssm.conv_kernel": CONV_KERNEL, "ssm.state_size": SSM_HEAD_DIM, "ssm.group_count": N_K_HEADS,
        "ssm.time_step_rank": N_V_HEADS, "ssm.inner_size": N_V_HEADS * SSM_HEAD_DIM,
    } | ({"expert_count": N_EXPERT, "expert_used_count": N_EXPERT_USED, "expert_feed_forward_length": EXPERT_FF,
          "expert_shared_feed_forward_length": SHEXP_FF} if moe else {}) | dict(meta or {})
    for key, value in keys.items():
        if value is None:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, list):
            vtype = gguf.GGUFValueType.BOOL if isinstance(value[0], bool) else gguf.GGUFValueType.INT32
            w.add_key_value(full, value, gguf.GGUFValueType.ARRAY, sub_type=vtype)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        else:
            w.add_float32(full, value)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return rng.normal(0, gain * n_in ** -0.5, size=(n_out, n_in))

    def norm(n: int) -> np.ndarray:                    # around 1, never all ones
        return 1.0 + 0.2 * rng.normal(size=n)

    k_dim, v_dim = N_K_HEADS * SSM_HEAD_DIM, N_V_HEADS * SSM_HEAD_DIM
    recurrent = [(i + 1) % INTERVAL != 0 for i in range(N_LAYERS)]
    tensors = {"token_embd.weight": rng.normal(0, 1.0, size=(len(tokens), DIM))}
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(DIM)
        if recurrent[i]:
            tensors[p + "attn_qkv.weight"] = mat(2 * k_dim + v_dim, DIM)
            tensors[p + "attn_gate.weight"] = mat(v_dim, DIM)
            tensors[p + "ssm_beta.weight"] = mat(N_V_HEADS, DIM, 2.0)            # β over (0, 1)
            tensors[p + "ssm_alpha.weight"] = mat(N_V_HEADS, DIM)
            tensors[p + "ssm_conv1d.weight"] = rng.normal(0, 0.5, size=(2 * k_dim + v_dim, CONV_KERNEL))
            tensors[p + "ssm_dt.bias"] = rng.normal(-1.0, 0.5, size=N_V_HEADS)
            tensors[p + "ssm_a"] = -np.exp(rng.uniform(-1.5, 0.0, size=N_V_HEADS))   # −exp(A_log)
            tensors[p + "ssm_norm.weight"] = norm(SSM_HEAD_DIM)
            tensors[p + "ssm_out.weight"] = mat(DIM, v_dim)
        else:
            tensors[p + "attn_q.weight"] = mat(2 * N_HEADS * HEAD_DIM, DIM)     # query | gate per head
            tensors[p + "attn_k.weight"] = mat(N_KV_HEADS * HEAD_DIM, DIM)
            tensors[p + "attn_v.weight"] = mat(N_KV_HEADS * HEAD_DIM, DIM)
            tensors[p + "attn_q_norm.weight"] = norm(HEAD_DIM)
            tensors[p + "attn_k_norm.weight"] = norm(HEAD_DIM)
            tensors[p + "attn_output.weight"] = mat(DIM, N_HEADS * HEAD_DIM)
        tensors[p + "post_attention_norm.weight"] = norm(DIM)
        if moe:
            tensors[p + "ffn_gate_inp.weight"] = mat(N_EXPERT, DIM, ROUTER_STD)
            tensors[p + "ffn_gate_exps.weight"] = np.stack([mat(EXPERT_FF, DIM) for _ in range(N_EXPERT)])
            tensors[p + "ffn_up_exps.weight"] = np.stack([mat(EXPERT_FF, DIM) for _ in range(N_EXPERT)])
            tensors[p + "ffn_down_exps.weight"] = np.stack([mat(DIM, EXPERT_FF) for _ in range(N_EXPERT)])
            tensors[p + "ffn_gate_inp_shexp.weight"] = rng.normal(0, 2.0 * DIM ** -0.5, size=DIM)
            tensors[p + "ffn_gate_shexp.weight"] = mat(SHEXP_FF, DIM)
            tensors[p + "ffn_up_shexp.weight"] = mat(SHEXP_FF, DIM)
            tensors[p + "ffn_down_shexp.weight"] = mat(DIM, SHEXP_FF)
        else:
            tensors[p + "ffn_gate.weight"] = mat(HIDDEN, DIM)
            tensors[p + "ffn_up.weight"] = mat(HIDDEN, DIM)
            tensors[p + "ffn_down.weight"] = mat(DIM, HIDDEN)
    tensors["output_norm.weight"] = norm(DIM)
    tensors["output.weight"] = mat(len(tokens), DIM)
    for i in range(N_LAYERS if moe and fused_gate_up else 0):
        p = f"blk.{i}."
        tensors[p + "ffn_gate_up_exps.weight"] = np.concatenate(
            [tensors.pop(p + "ffn_gate_exps.weight"), tensors.pop(p + "ffn_up_exps.weight")], axis=1)
    for name, data in tensors.items():
        if name in skip_tensors:
            continue
        data = np.asarray(data)
        if shapes and name in shapes:
            data = rng.normal(0, 0.1, size=shapes[name])
        # matrices in qtype; norms, biases, the conv kernel and A in F32 (as llama.cpp's converter)
        big = (data.ndim in (2, 3) and "ssm_conv1d" not in name and "ffn_gate_inp" not in name
               and data.shape[-1] % 32 == 0)
        _store(w, name, data, qtype if big else T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    print(write_qwen35_file(out / "tiny-qwen35.gguf"))
    print(write_qwen35_file(out / "tiny-qwen35moe.gguf", moe=True))
