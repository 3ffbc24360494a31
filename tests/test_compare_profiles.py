"""A stage 5 % off is the first divergence when two recordings of llamatrace are compared: the
thresholds follow from what is compared (analysis.compare.PROFILES), not from llama.cpp's 8-bit
drift, under which such a fault hid (its 0.25 threshold passed it)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llamatrace.analysis import compare as cmp
from llamatrace.model import Llama

PROMPT = [504, 3575, 282, 4649, 314]           # "The capital of France is" in SmolLM2's vocabulary
LAYER_STAGES = ["attn_norm", "Qcur", "Kcur", "Vcur", "Qcur_rope", "Kcur_rope", "kq", "kq_scaled",
                "kq_masked", "kq_soft_max", "kqv", "kqv_out", "attn_out", "ffn_inp", "ffn_norm",
                "ffn_gate", "ffn_silu", "ffn_up", "ffn_swiglu", "ffn_out", "l_out"]


@pytest.fixture(scope="module")
def models(smollm2, smollm2_path):
    return {"f32": smollm2, "q8": Llama.load(smollm2_path, activations="q8")}


@pytest.fixture(scope="module")
def healthy(models):
    return {mode: cmp.run_ours(m, PROMPT, tokens=1)[0] for mode, m in models.items()}


def _scaled(model, stage, layer):
    with model.hooks({stage: lambda a, e: a * np.float32(1.05)}, layers=[layer]):
        return cmp.run_ours(model, PROMPT, tokens=1)[0]


@pytest.mark.parametrize("mode", ["f32", "q8"])
@pytest.mark.parametrize("stage,layer", [(s, (i * 7) % 30) for i, s in enumerate(LAYER_STAGES)])
def test_a_stage_five_percent_off_is_the_first_divergence(models, healthy, mode, stage, layer):
    profile = cmp.profile_for({"engine": "llamatrace", "activations": mode},
                              {"engine": "llamatrace", "activations": mode})
    assert profile == f"same-{mode}"
    faulty = _scaled(models[mode], stage, layer)
    result = cmp.compare_arrays(faulty, healthy[mode], profile=profile)
    first = result.first_divergence
    assert first is not None and (first.step, first.layer, first.stage) == (0, layer, stage)
    assert result.extra["profile"] == profile
    assert 0.04 < first.rel_rms_err < 0.06
    # under llama.cpp's thresholds the same fault is not found where it is: why the profiles exist
    old = cmp.compare_arrays(faulty, healthy[mode]).first_divergence
    assert old is None or (old.step, old.layer, old.stage) != (0, layer, stage)


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_two_healthy_recordings_of_one_engine_agree_within_the_tight_profile(models, healthy, mode):
    again = cmp.run_ours(models[mode], PROMPT, tokens=1)[0]
    result = cmp.compare_arrays(again, healthy[mode], profile=f"same-{mode}")
    assert result.first_divergence is None
    assert max(r.rel_rms_err for r in result.rows if r.rel_rms_err is not None) <= 1e-6


def test_the_profile_follows_from_the_recordings_description():
    f32, q8 = ({"engine": "llamatrace", "activations": m} for m in ("f32", "q8"))
    assert cmp.profile_for(f32, f32) == "same-f32"
    assert cmp.profile_for(q8, q8) == "same-q8"
    assert cmp.profile_for(f32, q8) == "q8-vs-f32"
    assert cmp.profile_for(f32, None) == "llama.cpp"
    assert cmp.profile_for(f32, {"engine": "llama.cpp"}) == "llama.cpp"
    arrays = {cmp.META_KEY: np.array(json.dumps({"engine": "llamatrace", "activations": "q8"}))}
    assert cmp.recording_meta(arrays) == {"engine": "llamatrace", "activations": "q8"}
    assert cmp.recording_meta({cmp.META_KEY: np.array("not json")}) is None
    assert cmp.recording_meta({}) is None
    # the description is not a stage
    a = {"step0.inp_embd": np.ones((2, 3), np.float32), **arrays}
    assert [r.stage for r in cmp.compare_arrays(a, a, profile="same-q8").rows] == ["inp_embd"]


def test_cli_two_trace_recordings_one_with_a_stage_5_percent_off(capsys, smollm2_path, tmp_path, monkeypatch):
    # the new user's experiment: trace --npz twice, the second run with attn_out of layer 9 scaled by 5 %
    from cli_helpers import run

    from llamatrace.cli import main
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    assert main(["trace", "--raw", "-m", str(smollm2_path), "--npz", str(a), "--stats", "Hello there"]) == 0
    real = Llama.forward

    def faulty(self, *args, **kwargs):
        with self.hooks({"attn_out": lambda arr, e: arr * np.float32(1.05)}, layers=[9]):
            return real(self, *args, **kwargs)

    monkeypatch.setattr(Llama, "forward", faulty)
    assert main(["trace", "--raw", "-m", str(smollm2_path), "--npz", str(b), "--stats", "Hello there"]) == 0
    monkeypatch.setattr(Llama, "forward", real)
    capsys.readouterr()
    code, out, err = run(capsys, "compare", str(b), str(a), "--json")
    assert code == 3
    got = json.loads(out)
    assert got["profile"] == "same-f32"
    first = got["first_divergence"]
    assert (first["step"], first["layer"], first["stage"]) == (0, 9, "attn_out")
    code, out, err = run(capsys, "compare", str(b), str(a))
    assert code == 3 and "thresholds of same-f32" in out and "layer 9, attn_out" in out
    # with the model at hand the stage's own added error is measured too: 5 % in ours, none in the other
    code, out, err = run(capsys, "compare", str(b), str(a), "-m", str(smollm2_path), "--json")
    first = json.loads(out)["first_divergence"]
    assert code == 3 and (first["layer"], first["stage"]) == (9, "attn_out")
    assert 0.04 < first["local_err"] < 0.06 and first["ref_local_err"] == 0.0
