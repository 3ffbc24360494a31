"""The default model against golden files made by HF transformers (fp32, same GGUF).

See tests/golden/README.md for how tests/golden/make_golden.py produced them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llamatrace.generate import generate

GOLDEN = Path(__file__).parent / "golden"
GOLD = json.loads((GOLDEN / "smollm2_golden.json").read_text(encoding="utf-8"))
LOGITS = np.load(GOLDEN / "smollm2_logits.npz")
PROMPTS = sorted(GOLD["prompts"])

pytestmark = pytest.mark.model


def prompt_ids(model, name: str) -> list[int]:
    entry = GOLD["prompts"][name]
    if entry["kind"] == "chat":
        return model.tokenizer.encode_chat(entry["messages"], add_generation_prompt=True)
    return model.tokenizer.encode(entry["text"])


def test_golden_file_is_for_the_default_model(smollm2_path):
    from llamatrace.fetch import DEFAULT_MODEL
    assert GOLD["model_sha256"] == DEFAULT_MODEL.sha256
    assert smollm2_path.stat().st_size == DEFAULT_MODEL.size


@pytest.mark.parametrize("name", PROMPTS)
def test_prompt_token_ids_match_hf(smollm2, name):
    assert prompt_ids(smollm2, name) == GOLD["prompts"][name]["prompt_ids"]


@pytest.mark.parametrize("name", PROMPTS)
def test_last_position_logits_match_hf(smollm2, name):
    ids = GOLD["prompts"][name]["prompt_ids"]
    logits = smollm2.forward(np.array(ids), 0, smollm2.new_cache(len(ids)))[-1]
    ref = LOGITS[name]
    assert logits.shape == ref.shape
    err = np.abs(logits - ref).max()
    assert err <= 1e-3 * np.abs(ref).max(), f"max |diff| {err:.3g} vs max |logit| {np.abs(ref).max():.3g}"
    assert int(np.argmax(logits)) == GOLD["prompts"][name]["top5"][0][0]


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_continuation_matches_hf(smollm2, name):
    entry = GOLD["prompts"][name]
    want = entry["greedy_ids"]
    got = list(generate(smollm2, entry["prompt_ids"], max_tokens=32, stop_ids=frozenset()))
    # HF keeps the end-of-generation id in its output; we stop before it. Compare step by step up
    # to the first near-tie (top-1/top-2 margin below 1e-3), where fp32 rounding may pick either.
    for step, token in enumerate(want):
        if entry["greedy_margins"][step] < 1e-3:
            break
        assert got[step] == token, f"step {step}: got {got[step]}, HF {token} (margin {entry['greedy_margins'][step]})"
