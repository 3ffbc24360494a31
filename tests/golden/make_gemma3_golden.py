#!/usr/bin/env python3
"""Golden tokenizer ids, EOG tokens, chat renderings, greedy continuations and logits of the
Gemma 3 270M file (``llamatrace pull gemma3-270m``) from llama.cpp (llama-cpp-python).

Not part of llamatrace, never imported by the tests; needs ``llama_cpp`` (run it in the golden
venv). Writes:

  tests/golden/gemma3_270m_llamacpp.json   tokenizer cases (llama.cpp's ids, with and without
                                           parse_special, and detokenized bytes), the EOG token
                                           ids, chat renderings and their ids, greedy continuations
                                           with llama.cpp's top-1 minus top-2 logit at each step
  tests/golden/gemma3_270m_logits.npz      float32 logits at the last prompt position, per prompt

and, under ``"reproducibility"``, how far llama.cpp is from itself on this file when the same
tokens are scheduled otherwise: the prompt fed one token per ``eval`` (llama.cpp's decode
kernels instead of its batched ones) and the greedy continuation re-run as one teacher-forced
batch, with the F16 K/V cache and with an F32 one. The 8-bit activations of every matmul turn
rounding-order differences into whole quantization steps, so these runs differ by several % of
the largest logit; llamatrace's ``q8`` mode is held to that, not to bit equality
(tests/test_gemma3_file.py, docs/models.md).

Settings: llama-cpp-python's defaults (``n_ctx`` 512, ``n_batch`` 512, F16 KV cache, no flash
attention, full-size SWA cache) with ``n_threads`` 2 and ``seed`` 0; greedy = argmax of llama.cpp's logits,
first index on ties (llama.cpp's greedy sampler), stopping early only at an EOG token.

Usage (from the repo root)::

  /work/venv-golden/bin/python tests/golden/make_gemma3_golden.py \\
      --model ~/.cache/llamatrace/models/gemma-3-270m-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

HERE = Path(__file__).resolve().parent
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
N_THREADS = 2
N_GENERATE = 32

# Strings where SentencePiece implementations part ways: whitespace runs (Gemma has user-defined
# tokens for runs of spaces, tabs and newlines), byte fallback, digits, code, HTML (user-defined
# tags), and the text of control tokens, which user text must not turn into control tokens.
TOKENIZER_CASES = [
    "", " ", "  ", "a", " a", "Hello world", "Hello  world", "Hello   world", "  leading",
    "trailing  ", "\n", "\n\n", "a\nb", "a\n\nb", "a\n \nb", " \n", "\n ", "\t", "tab\there",
    "\t\tx", "a \t\n b", "\r\n", "line1\r\nline2", " " * 40, "\n" * 40, "\t" * 35, "x" + " " * 33 + "y",
    "12345", "3.14159", "2024-11-21", "1,000,000", "０１２３", "Count: 1, 2, 3, 12345, 3.14159",
    "Café crème brûlée à la française, naïve señor", "北京是中国的首都。", "東京は日本の首都です。",
    "한국어 텍스트", "Привет, мир!", "مرحبا بالعالم", "हिन्दी पाठ", "Ελληνικά", "e\u0301 vs \u00e9",
    "\u200bzero\u200bwidth", "\ufeffBOM", "a\u00a0b", "ﬁne ligature", "½ ² ∑ ∞ ≠ →",
    "🦙", "I love pizza 🍕 and cats 🐱\u200d👤! 👍🏽", "🏳️\u200d🌈", "😀😃😄😁",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}", "x = {'a': [1, 2], \"b\": None}  # comment",
    "<html><body><div>hi</div></body></html>", "x<s>y</s>z", "<table><tr><td>1</td></tr></table>",
    "<b>bold</b> and <i>it</i>", "C:\\path\\to\\file.txt", "https://example.com/a?b=c&d=e#f",
    "@user #hashtag $100 50% a+b=c", "‘quotes’ “double” — dash…", "ÀÉÎÕÜ àéîõü",
    "\x00\x01\x7f", "Supercalifragilisticexpialidocious", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The capital of France is", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>hello", "<eos>", "<pad>", "<mask>", "<unk>", "[multimodal]", "<start_of_image>", "<unused0>",
    "<start_of_turn>", "text<end_of_turn>more", " <start_of_turn>", "<start_of_turn> ",
]

# The file carries no tokenizer.chat_template. Gemma's turn format, as in llama.cpp's
# models/templates/google-gemma-2-2b-it.jinja (Gemma 3's instruction-tuned models use the same
# <start_of_turn>role ... <end_of_turn> turns), rendered by llama-cpp-python's Jinja2ChatFormatter
# and tokenized as its chat handler does (parse_special, no added BOS: the template renders it).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
CHATS = {
    "one_turn": [{"role": "user", "content": "What is the capital of France?"}],
    "two_turns": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
                  {"role": "user", "content": "  Name three colours.\n\n"}],
    "unicode": [{"role": "user", "content": "Translate 'naïve café' to 日本語 🦙"}],
}

PROMPTS = {
    "france": "The capital of France is",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "story": "Once upon a time, in a small village by the sea,",
    "list": "Here is a list of the planets of the solar system:\n1.",
    "chat": "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    """float32 [n_vocab] logits of the last evaluated position (``Llama.scores`` stays empty
    without ``logits_all`` in 0.3.36, so they are read from the context)."""
    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float32)


def greedy(llm: llama_cpp.Llama, ids: list[int], vocab) -> tuple[list[int], list[float], np.ndarray]:
    """llama.cpp's greedy continuation of ``ids``, the top-1 minus top-2 logit at each step, and
    the float32 logits at the last prompt position."""
    llm.reset()
    llm.eval(ids)
    first = last_logits(llm)
    logits, out, margins = first, [], []
    while len(out) < N_GENERATE:
        token = int(np.argmax(logits))
        out.append(token)
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        llm.eval([token])
        logits = last_logits(llm)
    return out, margins, first


def rel_gap(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref|: the measure the tests use."""
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def reproducibility(path: Path, prompts: dict, first_logits: dict) -> dict:
    """llama.cpp against itself: the prompt one token per eval (F16 K/V, as the goldens), and
    the prompt plus its greedy continuation as one teacher-forced batch (F16 and F32 K/V)."""
    per_prompt, flips = {}, []
    for kv_name, kv_type in (("f16", 1), ("f32", 0)):
        llm = llama_cpp.Llama(str(path), n_threads=N_THREADS, seed=0, verbose=False, logits_all=True,
                              type_k=kv_type, type_v=kv_type)
        for name, p in prompts.items():
            entry = per_prompt.setdefault(name, {})
            ids, want, margins = p["prompt_ids"], p["greedy_ids"], p["greedy_margins"]
            if kv_name == "f16":
                llm.reset()
                for tok in ids:
                    llm.eval([tok])
                entry["one_token_per_eval_gap"] = rel_gap(np.array(llm.scores[len(ids) - 1], dtype=np.float32),
                                                          first_logits[name])
            llm.reset()
            llm.eval(ids + want[:-1])
            top = np.asarray(llm.scores[len(ids) - 1:len(ids) + len(want) - 1]).argmax(-1)
            differ = [(step, margins[step]) for step in range(len(want)) if int(top[step]) != want[step]]
            entry[f"teacher_forced_{kv_name}_kv_differs_at"] = differ
            flips += [margin for _, margin in differ]
        del llm
    return {"prompts": per_prompt, "largest_gap": max(e["one_token_per_eval_gap"] for e in per_prompt.values()),
            "largest_margin_of_a_different_top_token": max(flips, default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    digest = sha256(args.model)
    if digest != MODEL_SHA256:
        raise SystemExit(f"{args.model}: sha256 {digest}, expected {MODEL_SHA256} (llamatrace pull gemma3-270m)")

    llm = llama_cpp.Llama(str(args.model), n_threads=N_THREADS, seed=0, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llm.n_vocab()

    cases = []
    for text in TOKENIZER_CASES:
        plain = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        special = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        cases.append({"text": text, "ids": plain, "ids_special": special,
                      "detokenized_hex": llm.detokenize(plain[1:], special=True).hex()})

    chats = {}
    for name, messages in CHATS.items():
        formatter = Jinja2ChatFormatter(GEMMA_TEMPLATE, eos_token="<eos>", bos_token="<bos>")
        rendered = formatter(messages=messages).prompt
        chats[name] = {"messages": messages, "rendered": rendered,
                       "ids": llm.tokenize(rendered.encode("utf-8"), add_bos=False, special=True)}

    prompts, logits = {}, {}
    for name, text in PROMPTS.items():
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        out, margins, first = greedy(llm, ids, vocab)
        top = np.argsort(-first, kind="stable")[:5]
        prompts[name] = {"text": text, "prompt_ids": ids, "greedy_ids": out, "greedy_margins": margins,
                         "greedy_text": llm.detokenize(out).decode("utf-8", "replace"),
                         "top5_ids": top.tolist(), "top5_logits": first[top].tolist()}
        logits[name] = first
        print(f"{name}: {prompts[name]['greedy_text']!r}")

    golden = {
        "model_file": args.model.name, "model_sha256": digest,
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {"n_ctx": llm.n_ctx(), "n_batch": llm.n_batch, "n_threads": N_THREADS, "seed": 0,
                     "n_generate": N_GENERATE},
        "n_vocab": n_vocab, "bos_id": llm.token_bos(), "eos_id": llm.token_eos(),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "eog_ids": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "tokenizer_cases": cases,
        "chat_template": GEMMA_TEMPLATE, "chats": chats,
        "prompts": prompts,
        "reproducibility": reproducibility(args.model, prompts, logits),
    }
    print("reproducibility:", json.dumps(golden["reproducibility"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemma3_270m_llamacpp.json").write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    np.savez_compressed(args.out / "gemma3_270m_logits.npz", **logits)
    print(f"wrote {args.out / 'gemma3_270m_llamacpp.json'} and gemma3_270m_logits.npz; EOG {golden['eog_ids']}")


if __name__ == "__main__":
    main()
