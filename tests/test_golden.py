"""The default model against golden files made by HF transformers (fp32, same GGUF).

See tests/golden/README.md for how tests/golden/make_golden.py produced them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llamatrace.model.generate import generate

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
    from llamatrace.gguf.fetch import DEFAULT_MODEL
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


@pytest.mark.parametrize("name", PROMPTS)
def test_stage_statistics_match_hf_for_first_and_last_layer(smollm2, name):
    """Every stage HF's forward hooks see, layers 0 and 29 and model level, for every prompt."""
    from llamatrace.tracing.recorder import Recorder

    ref = GOLD["stage_stats"][name]
    ids = GOLD["prompts"][name]["prompt_ids"]
    rec = Recorder(layers=[0, 29], stats=True)
    smollm2.forward(np.array(ids), 0, smollm2.new_cache(len(ids)), recorder=rec)
    ours = {(e.layer, e.stage): e for e in rec.events}
    wanted = [(None, stage, s) for stage, s in ref["model"].items()]
    wanted += [(int(layer), stage, s) for layer, stages in ref["layers"].items() for stage, s in stages.items()]
    assert len(wanted) >= 2 * 13 + 3
    for layer, stage, want in wanted:
        got = ours[(layer, stage)]
        where = f"{name} layer {layer} {stage}"
        assert got.shape == want["shape"], where
        s = got.stats
        assert s["rms"] == pytest.approx(want["rms"], rel=1e-3), where
        scale = want["abs_max"]
        for key in ("min", "max", "abs_max"):
            assert abs(s[key] - want[key]) <= 2e-3 * scale, f"{where} {key}: {s[key]} vs {want[key]}"
        n = float(np.prod(want["shape"]))
        assert abs(s["sum"] - want["sum"]) <= 1e-4 * want["rms"] * n, f"{where} sum: {s['sum']} vs {want['sum']}"
