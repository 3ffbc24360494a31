"""Small random-weight GGUF files of the mixture-of-experts architectures llamatrace runs:
``qwen3moe``, Mixtral (a ``llama`` file with ``ffn_gate_inp`` and ``ffn_{gate,up,down}_exps``) and
``olmoe``, written with ``gguf.GGUFWriter`` for the fidelity tests against llama.cpp.

Awkward on purpose: expert counts and top-k that are not powers of two (qwen3moe 6 experts, top
3; olmoe 5, top 2; Mixtral 8, top 2), an expert width unlike the dense one (qwen3moe's
``expert_feed_forward_length``), grouped-query attention, norms that are not all ones. The
router's rows are large (std 4/√dim) so that each token's router logits are spread: the
k-th and (k+1)-th stay apart by far more than float32 rounding can move them, and the routes
differ from token to token (tests/test_moe.py checks both on the run). Matrices are F32 (llama.cpp
then computes in float32 too) or Q8_0 for the q8 mode; the router and the norms are always F32,
as llama-quantize leaves them. Deterministic: the same ``seed`` writes the same bytes.

``python tests/moe_files.py DIR`` writes the three into DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gguf_factory import CHATML, _store, vocabulary  # noqa: E402

T = gguf.GGMLQuantizationType
ARCHS = ("qwen3moe", "mixtral", "olmoe")
DIM, HIDDEN, CONTEXT = 64, 96, 64

# Per file: its general.architecture, layers, heads, experts (n, top-k, width), what else it holds.
SPECS = {
    "qwen3moe": dict(arch="qwen3moe", n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, n_expert=6, k=3,
                     expert_ff=64, qk_norm="head", rope_theta=1e6),
    "mixtral": dict(arch="llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_expert=8, k=2,
                    expert_ff=HIDDEN),
    # OLMoE's q/k norms span the whole projection, so its K is as wide as its Q (no GQA)
    "olmoe": dict(arch="olmoe", n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, n_expert=5, k=2,
                  expert_ff=HIDDEN, qk_norm="flat"),
}
ROUTER_STD = 4.0


def write_moe_file(path: str | Path, name: str, seed: int = 0, qtype: T = T.F32,
                   skip_tensors: tuple[str, ...] = (), kv: dict[str, object] | None = None,
                   shapes: dict[str, tuple[int, ...]] | None = None, tie: tuple[int, int] | None = None) -> Path:
    """Write the random MoE file ``name`` (one of :data:`ARCHS`) at ``path`` and return the path.

    ``qtype``: the matrices' type (experts and attention; the router and norms stay F32).
    ``skip_tensors`` leaves tensors out, ``kv`` writes or replaces ``{arch}.<key>`` integers, and
    ``shapes`` gives tensors another NumPy shape (random values): broken files for the error tests.
    ``tie`` = ``(a, b)``: router rows ``a`` and ``b`` equal (and 3× longer, so that they usually lead):
    experts ``a`` and ``b`` tie exactly for every token, and top-k must break the tie as llama.cpp does.
    """
    spec = SPECS[name]
    arch = spec["arch"]
    rng = np.random.default_rng([seed, ARCHS.index(name), 49])
    n_layers, n_heads, n_kv_heads, hd = spec["n_layers"], spec["n_heads"], spec["n_kv_heads"], spec["head_dim"]
    n_expert, ff = spec["n_expert"], spec["expert_ff"]
    q_dim, kv_dim = n_heads * hd, n_kv_heads * hd
    tokens, types, merges = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-random-moe-test")
    w.add_block_count(n_layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(HIDDEN if arch != "qwen3moe" else 2 * HIDDEN)   # qwen3moe: the key below wins
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_float32(f"{arch}.rope.freq_base", spec.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(1e-6)
    keys = {"expert_count": n_expert, "expert_used_count": spec["k"]}
    if arch == "qwen3moe":
        keys["expert_feed_forward_length"] = ff
    for key, value in (keys | dict(kv or {})).items():
        w.add_uint32(f"{arch}.{key}", value)
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

    def mat(*shape: int, std: float = 1.0) -> np.ndarray:
        return rng.normal(0, std * shape[-1] ** -0.5, size=shape)

    def norm(n: int) -> np.ndarray:                    # around 1, never all ones
        return 1.0 + 0.2 * rng.normal(size=n)

    tensors = {"token_embd.weight": rng.normal(0, 1.0, size=(len(tokens), DIM))}
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(DIM)
        tensors[p + "attn_q.weight"] = mat(q_dim, DIM)
        tensors[p + "attn_k.weight"] = mat(kv_dim, DIM)
        tensors[p + "attn_v.weight"] = mat(kv_dim, DIM)
        if spec.get("qk_norm"):
            flat = spec["qk_norm"] == "flat"
            tensors[p + "attn_q_norm.weight"] = norm(q_dim if flat else hd)
            tensors[p + "attn_k_norm.weight"] = norm(kv_dim if flat else hd)
        tensors[p + "attn_output.weight"] = mat(DIM, q_dim)
        tensors[p + "ffn_norm.weight"] = norm(DIM)
        tensors[p + "ffn_gate_inp.weight"] = mat(n_expert, DIM, std=ROUTER_STD)
        if tie:
            tensors[p + "ffn_gate_inp.weight"][list(tie)] = 3 * tensors[p + "ffn_gate_inp.weight"][tie[0]]
        tensors[p + "ffn_gate_exps.weight"] = mat(n_expert, ff, DIM)
        tensors[p + "ffn_up_exps.weight"] = mat(n_expert, ff, DIM)
        tensors[p + "ffn_down_exps.weight"] = mat(n_expert, DIM, ff)
    tensors["output_norm.weight"] = norm(DIM)
    tensors["output.weight"] = mat(len(tokens), DIM)
    for tname, data in tensors.items():
        if tname in skip_tensors:
            continue
        data = np.asarray(data)
        if shapes and tname in shapes:
            data = rng.normal(0, 0.1, size=shapes[tname])
        matrix = data.ndim >= 2 and "ffn_gate_inp" not in tname
        _store(w, tname, data, qtype if matrix else T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    for name in ARCHS:
        print(write_moe_file(out / f"tiny-{name}.gguf", name))
