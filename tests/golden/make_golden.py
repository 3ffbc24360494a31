#!/usr/bin/env python3
"""Generate the HF-transformers golden reference files for llamatrace tests.

This script is NOT part of llamatrace and must never be imported by it or by the
test-suite: it needs torch + transformers, which live only in a separate venv
(see tests/golden/README.md).  The tests only read the files it writes:

  tests/golden/smollm2_golden.json   prompt ids, greedy continuations, top-5
                                     logits, per-stage statistics
  tests/golden/smollm2_logits.npz    fp32 logits at the last prompt position

Usage (from the repo root):

  /work/venv-golden/bin/python tests/golden/make_golden.py \
      --model /path/to/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/golden
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Everything is local; never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import regex  # noqa: E402  (dependency of transformers)
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's llamatrace
from llamatrace.gguf.fetch import sha256_file  # noqa: E402  (needs no numba)

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# --variant NAME: the default model requantized by llama.cpp (scripts/requantize_kquants.py)
# to SmolLM2-135M-Instruct.NAME.gguf; sha256 of llama-cpp-python 0.3.36's output.
VARIANT_SHA256 = {
    "Q4_K_M": "dc0f3a02e821146247a0af6895adf9872124f368682cb110cb9ed09ff2a9f9f1",
    "Q5_K_M": "8170c7ef444692b3b2fe63459c326def0358807ef9be6e3cb020efb86a71015e",
    "Q6_K": "a969ae2086dd4945a7c61594bf72b2bcc3b7df8571c92aed8f213918673a7f80",
    "Q3_K_M": "01045a8fee6c962e4f7b0f80dccf937503738f61f987c305378fd3f527eac9d4",
    "Q2_K-pure": "dc183fb648339d62e10b7f7a2cbafa8a502ff5e6c8c284b821c1d890426777a2",
    "Q3_K-pure": "c7817eb60d9477425a66e01cc07176bebcc67a9112d2fef890b4d7eb01b43d8e",
}
# Variants record these prompts only (keeps each logits file ~0.5 MB).
VARIANT_PROMPTS = ("ascii", "code", "chat")
# Where `llamatrace` caches the default model (llamatrace.gguf.fetch.cache_dir; this script runs in a
# separate venv that need not have llamatrace installed).
DEFAULT_MODEL_CANDIDATES = [
    Path(os.environ.get("LLAMATRACE_CACHE_DIR") or Path.home() / ".cache" / "llamatrace") / "models" / MODEL_FILE,
]

PROMPTS: dict[str, dict] = {
    "ascii": {"kind": "raw", "text": "The capital of France is"},
    "code": {"kind": "raw", "text": "def fibonacci(n):\n    if n < 2:\n        return n\n"},
    "digits": {"kind": "raw", "text": "Count: 1, 2, 3, 12345, 3.14159 and 2024-11-21"},
    "whitespace": {"kind": "raw", "text": "Hello   world\n\n\n  indented\tTab  end   "},
    "accents": {"kind": "raw", "text": "Café crème brûlée à la française, naïve señor"},
    "cjk": {"kind": "raw", "text": "北京是中国的首都。東京は日本の首都です。"},
    "emoji": {"kind": "raw", "text": "I love pizza 🍕 and cats 🐱\u200d👤! 👍🏽"},
    "chat": {
        "kind": "chat",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    },
}

# Tokenizer-only cases (no forward pass): whitespace before digits and non-ASCII
# numerics, where a pre-tokenizer without the individual-digit split gives
# different ids.
TOKENIZER_CASES = [
    "   1",
    "a  12 b",
    "x\n\n2",
    "1 2  3   4",
    "  12345  ",
    "\uff31\uff11\uff12\uff13",  # fullwidth Q123
    "\u00b2\u00b3 \u00bd \u0663",  # superscript 2 3, one half, Arabic-Indic 3
]

MAX_NEW_TOKENS = 32
TRACE_LAYERS = (0, 29)
LAYER_STAGES = (
    "attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "ffn_inp",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out",
)
MODEL_STAGES = ("inp_embd", "result_norm", "result_output")

# llama.cpp's pre-tokenizer for tokenizer.ggml.pre == "smollm" (llama-vocab.cpp):
# first split every digit on its own, then the GPT-2 regex.
_GPT2_RE = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
_DIGIT_RE = regex.compile(r"\p{N}")


def find_model(arg: str | None) -> Path:
    if arg:
        p = Path(arg)
        if not p.is_file():
            sys.exit(f"model file not found: {p}")
        return p
    env = os.environ.get("LLAMATRACE_SMOLLM2_GGUF")
    cands = ([Path(env)] if env else []) + DEFAULT_MODEL_CANDIDATES
    for c in cands:
        if c.is_file():
            return c
    sys.exit(
        "SmolLM2 GGUF not found; run `llamatrace pull` (it caches the model) "
        "or pass --model PATH"
    )



def stats(t: torch.Tensor) -> dict:
    """Permutation-invariant statistics in float64 over [seq_len, features]."""
    x = t.detach().to(torch.float64)
    if x.dim() == 3:  # drop batch dim (batch is always 1)
        assert x.shape[0] == 1, x.shape
        x = x[0]
    x = x.reshape(x.shape[0], -1)
    return {
        "shape": list(x.shape),
        "sum": float(x.sum()),
        "mean": float(x.mean()),
        "rms": float(torch.sqrt((x * x).mean())),
        "min": float(x.min()),
        "max": float(x.max()),
        "abs_max": float(x.abs().max()),
    }


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class StageRecorder:
    """Forward hooks that capture the llama.cpp-named intermediate tensors."""

    def __init__(self, model):
        self.active = False
        self.current: dict | None = None
        self.handles = []
        inner = model.model

        def out_hook(scope, name):
            def hook(mod, args, out):
                if self.active:
                    self._put(scope, name, _first(out))
            return hook

        def in_hook(scope, name):
            def hook(mod, args):
                if self.active:
                    self._put(scope, name, args[0])
            return hook

        def reg_out(m, scope, name):
            self.handles.append(m.register_forward_hook(out_hook(scope, name)))

        def reg_in(m, scope, name):
            self.handles.append(m.register_forward_pre_hook(in_hook(scope, name)))

        reg_out(inner.embed_tokens, "model", "inp_embd")
        reg_out(inner.norm, "model", "result_norm")
        reg_out(model.lm_head, "model", "result_output")
        for L in TRACE_LAYERS:
            layer = inner.layers[L]
            s = str(L)
            att, mlp = layer.self_attn, layer.mlp
            reg_out(layer.input_layernorm, s, "attn_norm")
            reg_out(att.q_proj, s, "Qcur")
            reg_out(att.k_proj, s, "Kcur")
            reg_out(att.v_proj, s, "Vcur")
            reg_in(att.o_proj, s, "kqv_out")
            reg_out(att.o_proj, s, "attn_out")
            # post_attention_layernorm's input is residual + attn_out
            reg_in(layer.post_attention_layernorm, s, "ffn_inp")
            reg_out(layer.post_attention_layernorm, s, "ffn_norm")
            reg_out(mlp.gate_proj, s, "ffn_gate")
            reg_out(mlp.up_proj, s, "ffn_up")
            reg_in(mlp.down_proj, s, "ffn_swiglu")
            reg_out(mlp.down_proj, s, "ffn_out")
            reg_out(layer, s, "l_out")

    def _put(self, scope, name, tensor):
        assert self.current is not None
        if scope == "model":
            d = self.current["model"]
        else:
            d = self.current["layers"].setdefault(scope, {})
        assert name not in d, f"stage {scope}/{name} recorded twice"
        d[name] = stats(tensor)

    def start(self):
        self.current = {"model": {}, "layers": {}}
        self.active = True

    def stop(self) -> dict:
        self.active = False
        cur, self.current = self.current, None
        assert set(cur["model"]) == set(MODEL_STAGES), cur["model"].keys()
        for L in TRACE_LAYERS:
            assert set(cur["layers"][str(L)]) == set(LAYER_STAGES), cur["layers"][str(L)].keys()
        return cur


def llamacpp_smollm_encode(tok, text: str) -> list[int]:
    """Independent re-implementation of llama.cpp's 'smollm' pre-tokenization,
    followed by the tokenizer's own BPE model (byte-level mapped pieces)."""
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe = tok.backend_tokenizer.model
    ids: list[int] = []
    # llama.cpp splits on special tokens first; raw prompts contain none.
    pieces: list[str] = []
    pos = 0
    for m in _DIGIT_RE.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos:m.start()])
        pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    for chunk in pieces:
        for word in _GPT2_RE.findall(chunk):
            (mapped, _), = bl.pre_tokenize_str(word)
            ids.extend(t.id for t in bpe.tokenize(mapped))
    return ids


def main() -> None:
    global MODEL_FILE, PROMPTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=f"path to {MODEL_FILE}")
    ap.add_argument("--out", default="tests/golden", help="output directory")
    ap.add_argument("--variant", default=None, choices=sorted(VARIANT_SHA256),
                    help="a requantized file (needs --model); writes smollm2_VARIANT_golden.json / _logits.npz")
    args = ap.parse_args()

    stem, want_sha = "smollm2", MODEL_SHA256
    if args.variant:
        if not args.model:
            sys.exit("--variant needs --model PATH")
        MODEL_FILE = f"SmolLM2-135M-Instruct.{args.variant}.gguf"
        stem, want_sha = f"smollm2_{args.variant}", VARIANT_SHA256[args.variant]
        PROMPTS = {k: v for k, v in PROMPTS.items() if k in VARIANT_PROMPTS}
    model_path = find_model(args.model).resolve()
    digest = sha256_file(model_path)
    if digest != want_sha:
        sys.exit(f"sha256 mismatch for {model_path}: {digest} != {want_sha}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    d, f = str(model_path.parent), model_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), \
        "expected tied output = token_embd"

    # ---- tokenizer: match llama.cpp's "smollm" pre-tokenizer ---------------
    converted_pre = str(tok.backend_tokenizer.pre_tokenizer)
    print("transformers GGUF-converted pre_tokenizer:", converted_pre)
    converted_ids = {
        n: tok(p["text"], add_special_tokens=False)["input_ids"]
        for n, p in PROMPTS.items() if p["kind"] == "raw"
    }
    if "Digits" not in converted_pre:
        # transformers' GGUF converter builds a plain ByteLevel(use_regex=True)
        # pre-tokenizer, i.e. no individual digit split.  llama.cpp ("smollm")
        # and the original SmolLM2 tokenizer.json split each digit first, so
        # install the original pre-tokenizer.
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        patched = True
    else:
        patched = False
    print("pre_tokenizer used:", tok.backend_tokenizer.pre_tokenizer)
    assert not getattr(tok, "add_bos_token", False)

    golden: dict = {
        "model_file": MODEL_FILE,
        "model_sha256": digest,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "prompts": {},
        "stage_stats": {},
    }
    logits_out: dict[str, np.ndarray] = {}
    recorder = StageRecorder(model)
    tok_diffs = []

    for name, p in PROMPTS.items():
        entry = {"kind": p["kind"]}
        if p["kind"] == "raw":
            text = p["text"]
            entry["text"] = text
            ids = tok(text, add_special_tokens=False)["input_ids"]
            ref = llamacpp_smollm_encode(tok, text)
            assert ids == ref, f"{name}: HF ids {ids} != llama.cpp-style ids {ref}"
            if ids != converted_ids[name]:
                tok_diffs.append(name)
            dec = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert dec == text, f"{name}: decode round-trip failed: {dec!r} != {text!r}"
        else:
            entry["messages"] = p["messages"]
            enc = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
            if hasattr(enc, "keys"):  # BatchEncoding in newer transformers
                enc = enc["input_ids"]
            ids = list(enc)
            rendered = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
            entry["rendered"] = rendered
            assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == rendered
        assert all(isinstance(i, int) for i in ids)
        if p["kind"] == "raw":
            assert ids[0] != tok.bos_token_id, "unexpected BOS"
        else:
            assert ids.count(tok.bos_token_id) == 3, "chat: expected 3 <|im_start|>, no extra BOS"
        entry["prompt_ids"] = ids

        x = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            recorder.start()
            out = model(input_ids=x, use_cache=False)
            st = golden["stage_stats"][name] = recorder.stop()
            last = out.logits[0, -1].to(torch.float32).numpy().copy()
            gen = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tok.eos_token_id,
                output_scores=True, return_dict_in_generate=True,
            )
        # top1 - top2 logit gap at every greedy step: tells tests how fragile an
        # exact greedy match is (small gaps can flip under fp32 rounding).
        margins = []
        for sc in gen.scores:
            t2 = torch.topk(sc[0].to(torch.float64), 2).values
            margins.append(round(float(t2[0] - t2[1]), 5))
        gen = gen.sequences
        # residual bookkeeping sanity: ffn_inp = layer input + attn_out etc.
        l0 = st["layers"]["0"]
        for a, b, c in ((st["model"]["inp_embd"], l0["attn_out"], l0["ffn_inp"]),
                        (l0["ffn_inp"], l0["ffn_out"], l0["l_out"])):
            assert abs(a["sum"] + b["sum"] - c["sum"]) <= 1e-3 * (1 + abs(c["sum"])), (a, b, c)
        new = gen[0, len(ids):].tolist()
        assert len(new) <= MAX_NEW_TOKENS
        assert new[0] == int(np.argmax(last)), "greedy token 1 != argmax of prefill logits"
        top = np.argsort(-last, kind="stable")[:5]
        entry["top5"] = [[int(i), float(last[i])] for i in top]
        entry["greedy_ids"] = new
        entry["greedy_margins"] = margins
        entry["greedy_text"] = tok.decode(new, skip_special_tokens=False)
        golden["prompts"][name] = entry
        logits_out[name] = last.astype(np.float32)
        print(f"[{name}] {len(ids)} prompt ids; top1={top[0]} {tok.decode([int(top[0])])!r}"
              f" ({last[top[0]]:.4f}); greedy: {entry['greedy_text']!r}")

    note = (
        f"transformers {transformers.__version__} GGUF tokenizer conversion builds pre_tokenizer "
        f"{converted_pre}, which does not split digits individually; "
        if patched else
        f"transformers GGUF tokenizer pre_tokenizer: {converted_pre}; "
    )
    if patched:
        note += (
            "make_golden.py replaces it with the original SmolLM2 tokenizer.json pre-tokenizer "
            "Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)], "
            "equivalent to llama.cpp's 'smollm' pre-tokenizer (\\p{N} split, then GPT-2 regex). "
        )
    note += (
        "Raw prompt ids were cross-checked against an independent regex re-implementation of the "
        "llama.cpp 'smollm' pre-tokenizer + the vocab's BPE, and decode(ids) round-trips exactly. "
        f"Golden prompts whose ids differ with the unpatched converted pre-tokenizer: {tok_diffs or 'none'} "
        "(the vocab has no multi-digit tokens); it does differ when whitespace precedes a digit, "
        "see tokenizer_cases, e.g. 'x\\n\\n2' -> [104, 1116, 34] (llama.cpp/original) vs [104, 198, 198, 34]. "
        "No BOS is added (add_bos_token=False); the chat prompt starts with <|im_start|> from the template."
    )
    cases = []
    for text in TOKENIZER_CASES:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == llamacpp_smollm_encode(tok, text), text
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == text, text
        cases.append({"text": text, "ids": ids})
    golden["tokenizer_cases"] = cases
    golden["tokenizer_note"] = note
    print(note)

    json_path = out_dir / f"{stem}_golden.json"
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(golden, fh, indent=1, sort_keys=True, ensure_ascii=False)
        fh.write("\n")
    np.savez_compressed(out_dir / f"{stem}_logits.npz", **logits_out)
    print("wrote", json_path, "and", out_dir / f"{stem}_logits.npz")


if __name__ == "__main__":
    main()
