"""Small random-weight bases of the mixture-of-experts and Qwen3.5 families, for ``llamatrace quantize``'s
golden files (``scripts/make_moe_quantize_golden.py``, ``tests/golden/quantize_moe.json``).

Each base carries the keys llama.cpp 0.3.36's loader reads for its architecture (``load_hparams``
and ``load_arch_hparams`` in ``src/models/<arch>.cpp``: ``llama_model_quantize`` loads the
hyper-parameters, not the tensors) and the tensors its ``load_arch_tensors`` names, in GGUF's
shapes:

- ``qwen3moe``: q/k norms, a router ``ffn_gate_inp`` and ``ffn_{gate,up,down}_exps`` of 4 experts, a
  tied output;
- ``mixtral``: a ``llama`` file with 8 experts (llama.cpp's ``n_expert == 8`` rules: Q8_0 ``attn_k``/``attn_v``,
  Q5_K ``attn_output``), an untied output;
- ``olmoe``: full-width q/k norms, 4 experts;
- ``gpt-oss``: attention biases and sinks, router and expert biases, ``post_attention_norm``;
- ``qwen35``: a gated-DeltaNet layer (``attn_qkv``, ``attn_gate``, ``ssm_conv1d``, ``ssm_a``,
  ``ssm_dt.bias``, ``ssm_alpha``, ``ssm_beta``, ``ssm_norm``, ``ssm_out``) then a full-attention layer.

Widths are 256 (the K types fit) and 288 for the expert rows (``ffn_down_exps`` falls back, as in
``llama-quantize``). Matrices are F16, 1-D tensors and biases F32, the values from a seeded
generator (both sides read the same bytes: the golden JSON keeps each base's sha256).
:func:`synthetic_imatrix` gives per-expert column importances (``[ne0 × n_expert]``) by a closed formula.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

GOLDEN = Path(__file__).parent / "golden" / "quantize_moe.json"
ARCHS = ("qwen3moe", "mixtral", "olmoe", "gpt-oss", "qwen35")
N_EMBD, N_FF, N_HEAD, N_HEAD_KV, HEAD_DIM, N_VOCAB, N_LAYER = 256, 288, 4, 2, 64, 96, 2


def golden() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def _keys(arch: str, n_expert: int) -> dict[str, tuple[object, gguf.GGUFValueType]]:
    a = "llama" if arch == "mixtral" else arch
    U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    keys: dict[str, tuple[object, gguf.GGUFValueType]] = {
        f"{a}.context_length": (256, U32), f"{a}.embedding_length": (N_EMBD, U32),
        f"{a}.block_count": (N_LAYER, U32), f"{a}.feed_forward_length": (N_FF, U32),
        f"{a}.attention.head_count": (N_HEAD, U32), f"{a}.attention.head_count_kv": (N_HEAD_KV, U32),
        f"{a}.attention.key_length": (HEAD_DIM, U32), f"{a}.attention.value_length": (HEAD_DIM, U32),
        f"{a}.attention.layer_norm_rms_epsilon": (1e-6, F32), f"{a}.rope.freq_base": (10000.0, F32),
        f"{a}.rope.dimension_count": (HEAD_DIM, U32),
    }
    if n_expert:
        keys[f"{a}.expert_count"] = (n_expert, U32)
        keys[f"{a}.expert_used_count"] = (2, U32)
    if arch in ("qwen3moe", "gpt-oss"):
        keys[f"{a}.expert_feed_forward_length"] = (N_FF, U32)
    if arch == "gpt-oss":
        keys[f"{a}.attention.sliding_window"] = (8, U32)
    if arch == "qwen35":
        keys.update({f"{a}.ssm.conv_kernel": (4, U32), f"{a}.ssm.inner_size": (128, U32),
                     f"{a}.ssm.state_size": (32, U32), f"{a}.ssm.time_step_rank": (4, U32),
                     f"{a}.ssm.group_count": (2, U32), f"{a}.full_attention_interval": (2, U32)})
    return keys


def _tensors(arch: str, n_expert: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, GGUF shape in ggml order ``[ne0, ne1, ne2]``) of every tensor."""
    E, F, X, Dh = N_EMBD, N_FF, n_expert, HEAD_DIM
    out = [("token_embd.weight", (E, N_VOCAB)), ("output_norm.weight", (E,))]
    if arch in ("mixtral", "olmoe", "gpt-oss"):
        out.append(("output.weight", (E, N_VOCAB)))
    for i in range(N_LAYER):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (E,))]
        recurrent = arch == "qwen35" and i % 2 == 0
        if recurrent:                                   # key_dim 2×32, value_dim 4×32, conv_dim 2·64 + 128
            out += [(p + "post_attention_norm.weight", (E,)), (p + "attn_qkv.weight", (E, 256)),
                    (p + "attn_gate.weight", (E, 128)), (p + "ssm_conv1d.weight", (4, 256)),
                    (p + "ssm_dt.bias", (4,)), (p + "ssm_a", (4,)), (p + "ssm_beta.weight", (E, 4)),
                    (p + "ssm_alpha.weight", (E, 4)), (p + "ssm_norm.weight", (32,)), (p + "ssm_out.weight", (128, E))]
        else:
            q_rows = N_HEAD * Dh * (2 if arch == "qwen35" else 1)
            out += [(p + "attn_q.weight", (E, q_rows)), (p + "attn_k.weight", (E, N_HEAD_KV * Dh)),
                    (p + "attn_v.weight", (E, N_HEAD_KV * Dh)), (p + "attn_output.weight", (N_HEAD * Dh, E))]
            if arch in ("qwen3moe", "qwen35"):
                out += [(p + "attn_q_norm.weight", (Dh,)), (p + "attn_k_norm.weight", (Dh,))]
            elif arch == "olmoe":
                out += [(p + "attn_q_norm.weight", (E,)), (p + "attn_k_norm.weight", (N_HEAD_KV * Dh,))]
            if arch == "qwen35":
                out += [(p + "post_attention_norm.weight", (E,))]
        if arch == "gpt-oss":
            out += [(p + "post_attention_norm.weight", (E,)), (p + "attn_sinks.weight", (N_HEAD,)),
                    (p + "attn_q.bias", (N_HEAD * Dh,)), (p + "attn_k.bias", (N_HEAD_KV * Dh,)),
                    (p + "attn_v.bias", (N_HEAD_KV * Dh,)), (p + "attn_output.bias", (E,)),
                    (p + "ffn_gate_inp.bias", (X,)), (p + "ffn_gate_exps.bias", (F, X)),
                    (p + "ffn_up_exps.bias", (F, X)), (p + "ffn_down_exps.bias", (E, X))]
        else:
            out += [(p + "ffn_norm.weight", (E,))]
        if n_expert:
            out += [(p + "ffn_gate_inp.weight", (E, X)), (p + "ffn_gate_exps.weight", (E, F, X)),
                    (p + "ffn_up_exps.weight", (E, F, X)), (p + "ffn_down_exps.weight", (F, E, X))]
        else:
            out += [(p + "ffn_gate.weight", (E, F)), (p + "ffn_up.weight", (E, F)), (p + "ffn_down.weight", (F, E))]
    return out


N_EXPERT = {"qwen3moe": 4, "mixtral": 8, "olmoe": 4, "gpt-oss": 4, "qwen35": 0}


def make_base(arch: str, dest: Path) -> Path:
    """Write ``arch``'s random-weight base (see the module docstring) at ``dest``."""
    n_expert = N_EXPERT[arch]
    rng = np.random.default_rng(sum(map(ord, arch)))
    w = gguf.GGUFWriter(str(dest), arch="llama" if arch == "mixtral" else arch)
    w.add_name(f"tiny-{arch}")
    for key, (value, vtype) in _keys(arch, n_expert).items():
        w.add_key_value(key, value, vtype)
    if arch == "qwen35":
        w.add_key_value(f"{arch}.rope.dimension_sections", [11, 11, 10, 0], gguf.GGUFValueType.ARRAY,
                        sub_type=gguf.GGUFValueType.INT32)
    for name, shape in _tensors(arch, n_expert):
        x = (rng.standard_normal(tuple(reversed(shape)), dtype=np.float32) * np.float32(0.05)).astype(np.float32)
        if len(shape) >= 2 and name.endswith(".weight") and "ssm_conv1d" not in name:
            x = x.astype(np.float16)
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def synthetic_imatrix(arch: str) -> dict[str, np.ndarray]:
    """Tensor name → float32 ``[ne0 × n_mat]`` column importances for every matrix llama-imatrix sees
    (``.weight`` of 2 or 3 dimensions but the token embedding and the router… as it collects: every
    ``mul_mat``/``mul_mat_id`` weight), per expert for the ``_exps`` tensors:
    ``0.25 + ((j·40503 + 977·k + 331·e) mod 1021) / 128`` for column j of expert e of the k-th tensor
    in name order (exact in float32); layer 1's last expert 1 (what llama-quantize makes of an expert
    that saw no token)."""
    n_expert = N_EXPERT[arch]
    names = sorted((n, s) for n, s in _tensors(arch, n_expert)
                   if len(s) >= 2 and n.endswith(".weight") and n != "token_embd.weight"
                   and "ssm_conv1d" not in n)
    out = {}
    for k, (name, shape) in enumerate(names):
        n_mat = shape[2] if len(shape) > 2 else 1
        j = np.arange(shape[0], dtype=np.int64)[None, :]
        e = np.arange(n_mat, dtype=np.int64)[:, None]
        values = (0.25 + ((j * 40503 + 977 * k + 331 * e) % 1021) / 128).astype(np.float32)
        if n_mat > 1 and name.startswith("blk.1."):
            values[-1] = 1.0            # an expert no token chose: llama-quantize's 1 for a count of 0
        out[name] = values.reshape(-1)
    return out
