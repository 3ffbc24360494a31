"""Small random-weight ``gpt-oss`` GGUF files (llama.cpp's ``LLM_ARCH_OPENAI_MOE``), written with
``gguf.GGUFWriter`` for the fidelity tests against llama.cpp (tests/test_gptoss.py).

Awkward on purpose, with every part of the family in play:

* three layers, so the sliding window (5 tokens, shorter than the 16-token test sequence) is on
  layers 0 and 2 and layer 1 attends to everything (llama.cpp's swa pattern 2);
* non-zero attention sinks (one per head), biases on q, k, v and the output projection;
* YaRN rope scaling from an 8-token original context (factor 4), so the test runs past it;
* 6 experts, top 3, softmax over the chosen experts' logits (``SOFTMAX_WEIGHT``), router and
  expert biases, and the clamped SwiGLU: the up/gate products are large enough (std ~4) that the
  clamps at ±7 bite;
* the router's rows large (std 4/√dim) so each token's router logits are spread: the k-th and
  (k+1)-th stay apart by far more than rounding moves them (the test checks it on the run).

Experts are F32 (llama.cpp then computes in float32 too) or MXFP4 (``experts=T.MXFP4``, as the
published files: gguf-py's quantizer) for the q8 mode; everything else F32. The vocabulary is
:mod:`gguf_factory`'s byte-level BPE one with the ``gpt-4o`` pre-tokenizer. Deterministic: the
same ``seed`` writes the same bytes.

``python tests/gptoss_files.py DIR`` writes both into DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gguf_factory import CHATML, _store, vocabulary  # noqa: E402

T = gguf.GGMLQuantizationType
ARCH = "gpt-oss"
DIM, CONTEXT = 64, 64
N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = 3, 4, 2, 16
N_EXPERT, K, EXPERT_FF = 6, 3, 96
WINDOW = 5
YARN = {"scaling.type": "yarn", "scaling.factor": 4.0, "scaling.original_context_length": 8}
# Strings for the o200k pre-tokenizer against llama.cpp's: its split regex's corners (case runs and
# contractions, digits in threes, punctuation with trailing newlines or slashes, whitespace runs)
TOKENIZER_TEXTS = (
    "Hello world", " Hello World", "HELLOworld isn't WE'RE they'LL", "CamelCaseWords and snake_case",
    "1234567 12 3", "3.14159, 2,718", "a  b   c\t\td", "\n\n\nline\r\nnext", "   leading and trailing   ",
    "path/to//file.txt\n/", "!!! ??? ... ---\n\n", "café naïve résumé", "Ünïcödé ÀÉÎ", "日本語のテキスト",
    "Привет, мир!", "emoji 🦙🚀 mixed", "tabs\tand\nnewlines \n end", "x" * 40, "I'm  you're\n\t 42nd",
    "<|im_start|>not special", "",
)
# A conversation for gpt-oss's own chat template (models/templates/openai-gpt-oss-120b.jinja in the sdist)
CHAT_MESSAGES = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"},
                 {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"}]
CHAT_TEMPLATE_MEMBER = "vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja"
CHAT_DATE = ('strftime_now("%Y-%m-%d")', '"2026-01-01"')   # the template's "Current date", fixed for the golden


def gptoss_chat_template(sdist) -> str:
    """gpt-oss's chat template from the llama-cpp-python sdist tarball at ``sdist``, its current date
    fixed (:data:`CHAT_DATE`)."""
    import tarfile
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(CHAT_TEMPLATE_MEMBER))
        text = tar.extractfile(member).read().decode("utf-8")
    assert CHAT_DATE[0] in text
    return text.replace(*CHAT_DATE)


ROUTER_STD = 4.0
EXPERT_STD = 4.0                     # gate/up outputs reach past the clamp at ±7


def write_gptoss_file(path: str | Path, seed: int = 0, experts: T = T.F32,
                      skip_tensors: tuple[str, ...] = ()) -> Path:
    """Write the random gpt-oss file at ``path`` and return the path. ``experts``: the type of the
    ``ffn_*_exps`` matrices (F32 or MXFP4); ``skip_tensors`` leaves tensors out (a broken file)."""
    rng = np.random.default_rng([seed, 49, 120])
    q_dim, kv_dim = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    tokens, types, merges = vocabulary()
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny-random-gpt-oss-test")
    w.add_block_count(N_LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(EXPERT_FF)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_float32(f"{ARCH}.rope.freq_base", 10000.0)
    for key, value in YARN.items():
        add = w.add_string if isinstance(value, str) else w.add_uint32 if isinstance(value, int) else w.add_float32
        add(f"{ARCH}.rope.{key}", value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(WINDOW)
    w.add_uint32(f"{ARCH}.expert_count", N_EXPERT)
    w.add_uint32(f"{ARCH}.expert_used_count", K)
    w.add_uint32(f"{ARCH}.expert_feed_forward_length", EXPERT_FF)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
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

    def bias(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.5, size=shape)

    tensors = {"token_embd.weight": rng.normal(0, 1.0, size=(len(tokens), DIM))}
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(DIM)
        tensors[p + "attn_q.weight"] = mat(q_dim, DIM)
        tensors[p + "attn_q.bias"] = bias(q_dim)
        tensors[p + "attn_k.weight"] = mat(kv_dim, DIM)
        tensors[p + "attn_k.bias"] = bias(kv_dim)
        tensors[p + "attn_v.weight"] = mat(kv_dim, DIM)
        tensors[p + "attn_v.bias"] = bias(kv_dim)
        tensors[p + "attn_output.weight"] = mat(DIM, q_dim)
        tensors[p + "attn_output.bias"] = bias(DIM)
        tensors[p + "attn_sinks.weight"] = rng.normal(0, 1.5, size=N_HEADS)
        tensors[p + "post_attention_norm.weight"] = norm(DIM)
        tensors[p + "ffn_gate_inp.weight"] = mat(N_EXPERT, DIM, std=ROUTER_STD)
        tensors[p + "ffn_gate_inp.bias"] = bias(N_EXPERT)
        tensors[p + "ffn_gate_exps.weight"] = mat(N_EXPERT, EXPERT_FF, DIM, std=EXPERT_STD)
        tensors[p + "ffn_gate_exps.bias"] = bias(N_EXPERT, EXPERT_FF)
        tensors[p + "ffn_up_exps.weight"] = mat(N_EXPERT, EXPERT_FF, DIM, std=EXPERT_STD)
        tensors[p + "ffn_up_exps.bias"] = bias(N_EXPERT, EXPERT_FF)
        tensors[p + "ffn_down_exps.weight"] = mat(N_EXPERT, DIM, EXPERT_FF)
        tensors[p + "ffn_down_exps.bias"] = bias(N_EXPERT, DIM)
    tensors["output_norm.weight"] = norm(DIM)
    tensors["output.weight"] = mat(len(tokens), DIM)
    for name, data in tensors.items():
        if name in skip_tensors:
            continue
        expert = "_exps.weight" in name
        _store(w, name, np.asarray(data), experts if expert else T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    print(write_gptoss_file(out / "tiny-gpt-oss.gguf"))
    print(write_gptoss_file(out / "tiny-gpt-oss-mxfp4.gguf", experts=T.MXFP4))
