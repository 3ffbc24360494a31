"""Small random-weight GGUF files of every non-Llama architecture llamatrace runs (qwen2, qwen3,
phi3, gemma2, gemma3), written with ``gguf.GGUFWriter`` for the fidelity tests against llama.cpp.

F32 weights (so llama.cpp computes in float32 too) and deliberately awkward settings: several
layers so local (sliding-window) and global layers both occur, a window (5) shorter than the
test prompt, biases and norms that are not all ones, ``head_dim`` ≠ dim / n_heads for Gemma 3,
grouped-query attention, small soft-caps on Gemma 2 so ``tanh`` bends. The vocabulary is
:mod:`gguf_factory`'s tiny byte-level BPE one, which llama.cpp loads. Deterministic: the same
``seed`` writes the same bytes.

``python tests/arch_files.py DIR`` writes all five into DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gguf_factory import CHATML, _store, vocabulary, write_tiny_llama  # noqa: E402

T = gguf.GGMLQuantizationType
ARCHS = ("qwen2", "qwen3", "phi3", "gemma2", "gemma3")
WINDOW = 5                                 # sliding window of the Gemma files, in tokens

# Per architecture: layers, heads, head_dim, what the file holds beyond the Llama block.
SPECS = {
    "qwen2": dict(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, bias=True, tied=False, rope_theta=1e6),
    "qwen3": dict(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, rope_theta=1e6),
    "phi3": dict(n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, fused=True, tied=False),
    # gemma2: local layers 0 and 2, global 1 (pattern 2); caps small enough to bend tanh
    "gemma2": dict(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, post_norms=True, window=WINDOW,
                   attn_softcap=2.0, final_softcap=10.0),
    # gemma3: local layers 0-4 and 6, global 5 (pattern 6); head_dim 32 != 64 / 4; rope 1e6 / 1e4 local
    "gemma3": dict(n_layers=7, n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True, post_norms=True,
                   window=WINDOW, rope_theta=1e6),
}
DIM, HIDDEN, CONTEXT = 64, 96, 64

# Rope-scaled variants: (architecture, the file's extra ``{arch}.rope.*`` keys). Gemma 3 4B–27B carry
# linear ×8, which llama.cpp applies to the global layers only (layer 5 here). The YaRN files start
# from a 32-token original context, so a 40-token run reaches past it; with rope base 10000 the
# ramp runs from pair 0 to pair 2 of qwen2's 8 (pair 1 half-way) and to pair 3 of gemma3's 16. Gemma 3's
# local layers (base 500 here) are not scaled, but take YaRN's attention factor as well.
# llama.cpp reads ``yarn_beta_*`` only for grok and mistral3: on these files it ignores them, as
# llamatrace must (its defaults 32 and 1 hold); the attention factor it does read, for any type.
ROPE_VARIANTS = {
    "gemma3_linear8": ("gemma3", {"scaling.type": "linear", "scaling.factor": 8.0}),
    "qwen2_yarn": ("qwen2", {"freq_base": 10000.0, "scaling.type": "yarn", "scaling.factor": 4.0,
                             "scaling.original_context_length": 32, "scaling.attn_factor": 0.8,
                             "scaling.yarn_beta_fast": 8.0, "scaling.yarn_beta_slow": 2.0}),
    "gemma3_yarn": ("gemma3", {"freq_base": 10000.0, "freq_base_swa": 500.0, "scaling.type": "yarn",
                               "scaling.factor": 8.0, "scaling.original_context_length": 32,
                               "scaling.attn_factor": 1.25}),
}

# LongRoPE files (Phi-3.5-mini, Phi-3's 128k variants; partial rotary as Phi-4-mini; llama.cpp's
# llama graph reads the factors too): (architecture, ``{arch}.rope.*`` keys). Their factors are
# :func:`longrope_factors`'s. llama.cpp pads its context to a multiple of 256, so the original
# context is 256: a 256-position context rotates with the short factors, a 512-position one with
# the long ones; the file's own context is 1024. The attention factor is what Phi-3's converter
# writes for 128k from 4k: sqrt(1 + ln 32 / ln 4096). The llama file is gguf_factory's (F32); its
# graph reads the factors only with the type key ``longrope``.
LONGROPE_CONTEXT = 1024
LONGROPE_VARIANTS = {
    "phi3_longrope": ("phi3", {"scaling.original_context_length": 256, "scaling.attn_factor": 1.1902381}),
    "phi3_longrope_partial": ("phi3", {"scaling.original_context_length": 256, "scaling.attn_factor": 1.1902381,
                                       "dimension_count": 12}),
    "llama_longrope": ("llama", {"scaling.type": "longrope", "scaling.original_context_length": 256}),
}


def longrope_factors(rope_dim: int) -> dict[str, np.ndarray]:
    """LongRoPE's tensors for ``rope_dim`` rotated dims: float32 ``[rope_dim/2]`` each, shaped like
    Phi-3.5-mini's (short ~1–1.4, long rising from 1 to ~50 over the slow pairs)."""
    i = np.linspace(0.0, 1.0, rope_dim // 2)
    return {"rope_factors_short.weight": (1.0 + 0.4 * i ** 2).astype(np.float32),
            "rope_factors_long.weight": (1.0 + 49.0 * i ** 3).astype(np.float32)}


def write_longrope(directory: str | Path, name: str, factors: dict[str, np.ndarray] | None = None, **keys) -> Path:
    """The LongRoPE file ``name`` of :data:`LONGROPE_VARIANTS` in ``directory``, with
    :func:`longrope_factors` (or ``factors``: ``{}`` leaves them out) and ``keys`` as more
    ``{arch}.rope.*`` keys."""
    arch, rope = LONGROPE_VARIANTS[name]
    rope = rope | keys
    extra = longrope_factors(int(rope.get("dimension_count", 16))) if factors is None else factors
    path = Path(directory) / f"{name}{'' if factors is None else '-' + str(len(factors))}.gguf"
    if arch == "llama":
        return write_tiny_llama(path, qtype=T.F32, context_length=LONGROPE_CONTEXT, extra_tensors=extra,
                                extra_kv={f"llama.rope.{k}": v for k, v in rope.items()})
    return write_arch_file(path, arch, rope=rope, extra=extra, context=LONGROPE_CONTEXT)


def write_arch_file(path: str | Path, arch: str, seed: int = 0, qtype: T = T.F32,
                    skip_tensors: tuple[str, ...] = (), rope: dict[str, object] | None = None,
                    extra: dict[str, np.ndarray] | None = None, context: int | None = None) -> Path:
    """Write a random ``arch`` GGUF (one of :data:`ARCHS`) at ``path`` and return the path.
    Matrices are stored as ``qtype`` (F32 for the fidelity tests, Q8_0 for the q8 mode's); norms
    and biases always F32. ``skip_tensors`` leaves those tensors out (a broken file). ``rope``:
    ``{arch}.rope.*`` keys to write or replace (``{"scaling.type": "linear", "scaling.factor": 8.0}``;
    str, int as uint32, float as float32); the weights stay those of the plain file. ``extra``:
    more tensors, F32, after the others (LongRoPE's factors); ``context``: ``context_length``
    (default :data:`CONTEXT`)."""
    spec = SPECS[arch]
    rng = np.random.default_rng([seed, ARCHS.index(arch)])
    n_layers, n_heads, n_kv_heads, hd = spec["n_layers"], spec["n_heads"], spec["n_kv_heads"], spec["head_dim"]
    q_dim, kv_dim = n_heads * hd, n_kv_heads * hd
    tokens, types, merges = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    # not "…phi3…": llama.cpp then looks up Phi-3's </s> and <unk> tokens, absent from this vocabulary
    w.add_name("tiny-random-arch-test")
    w.add_block_count(n_layers)
    w.add_context_length(context or CONTEXT)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(HIDDEN)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    rope = {"dimension_count": hd, "freq_base": spec.get("rope_theta", 10000.0)} | dict(rope or {})
    for key, value in rope.items():
        add = w.add_string if isinstance(value, str) else w.add_uint32 if isinstance(value, int) else w.add_float32
        add(f"{arch}.rope.{key}", value)
    w.add_layer_norm_rms_eps(1e-6)
    if "window" in spec:
        w.add_sliding_window(spec["window"])
    if "attn_softcap" in spec:
        w.add_attn_logit_softcapping(spec["attn_softcap"])
        w.add_final_logit_softcapping(spec["final_softcap"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)              # else HF's phi3 config defaults to 32000, outside this vocabulary
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return rng.normal(0, n_in ** -0.5, size=(n_out, n_in))

    def norm(n: int) -> np.ndarray:                    # around 1, never all ones
        return 1.0 + 0.2 * rng.normal(size=n)

    tensors = {"token_embd.weight": rng.normal(0, 1.0, size=(len(tokens), DIM))}
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(DIM)
        if spec.get("fused"):
            tensors[p + "attn_qkv.weight"] = mat(q_dim + 2 * kv_dim, DIM)
        else:
            tensors[p + "attn_q.weight"] = mat(q_dim, DIM)
            tensors[p + "attn_k.weight"] = mat(kv_dim, DIM)
            tensors[p + "attn_v.weight"] = mat(kv_dim, DIM)
        if spec.get("bias"):
            tensors[p + "attn_q.bias"] = rng.normal(0, 0.5, size=q_dim)
            tensors[p + "attn_k.bias"] = rng.normal(0, 0.5, size=kv_dim)
            tensors[p + "attn_v.bias"] = rng.normal(0, 0.5, size=kv_dim)
        if spec.get("qk_norm"):
            tensors[p + "attn_q_norm.weight"] = norm(hd)
            tensors[p + "attn_k_norm.weight"] = norm(hd)
        tensors[p + "attn_output.weight"] = mat(DIM, q_dim)
        if spec.get("post_norms"):
            tensors[p + "post_attention_norm.weight"] = norm(DIM)
        tensors[p + "ffn_norm.weight"] = norm(DIM)
        if spec.get("fused"):
            tensors[p + "ffn_up.weight"] = mat(2 * HIDDEN, DIM)          # gate rows, then up rows
        else:
            tensors[p + "ffn_gate.weight"] = mat(HIDDEN, DIM)
            tensors[p + "ffn_up.weight"] = mat(HIDDEN, DIM)
        tensors[p + "ffn_down.weight"] = mat(DIM, HIDDEN)
        if spec.get("post_norms"):
            tensors[p + "post_ffw_norm.weight"] = norm(DIM)
    tensors["output_norm.weight"] = norm(DIM)
    if not spec.get("tied", True):
        tensors["output.weight"] = mat(len(tokens), DIM)
    tensors |= dict(extra or {})
    for name, data in tensors.items():
        if name in skip_tensors:
            continue
        data = np.asarray(data)
        _store(w, name, data, qtype if data.ndim == 2 else T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def golden_arrays(name: str) -> dict[str, np.ndarray]:
    """Every array of ``tests/golden/{name}`` (a golden script's ``.npz``), read once into memory."""
    with np.load(Path(__file__).parent / "golden" / name) as z:
        return {k: z[k] for k in z.files}


def relative(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position: ‖ours − ref‖ / ‖ref‖ over the vocabulary."""
    return np.linalg.norm(ours - ref, axis=1) / np.linalg.norm(ref, axis=1)


def run_positions(model, ids: np.ndarray, prefill: int, ctx: int | None = None) -> np.ndarray:
    """float32 [len(ids), vocab]: ``model`` (a :class:`llamatrace.model.llama.Llama`) on ``prefill``
    tokens in one call, then one token a call, in a KV cache of ``ctx`` positions (default ``len(ids)``)."""
    cache = model.new_cache(ctx or len(ids))
    rows = [model.forward(ids[:prefill], 0, cache, all_logits=True)]
    rows += [model.forward(ids[i:i + 1], i, cache) for i in range(prefill, len(ids))]
    return np.concatenate(rows)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    for name in ARCHS:
        print(write_arch_file(out / f"tiny-{name}.gguf", name))
