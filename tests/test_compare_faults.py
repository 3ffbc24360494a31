"""`llamatrace compare` flags real bugs where they appear: faults computed inside our forward pass
(through model.hooks), not edits of a recording, checked against the committed llama.cpp dump."""

from __future__ import annotations

import numpy as np
import pytest
from test_compare import dump_as_stages

from llamatrace.analysis import compare as cmp


def _first(model, hooks_in_order, layers_for=None):
    meta, ref = dump_as_stages("france")
    with model.hooks(hooks_in_order[0]):
        with model.hooks(hooks_in_order[1], layers=layers_for):
            ours, _, _ = cmp.run_ours(model, meta["prompt_ids"], tokens=1)
    result = cmp.compare_arrays(ours, ref, layers=[0, 29])
    return result.first_divergence, {(r.step, r.layer, r.stage): r for r in result.rows}


def test_split_half_rope_is_flagged_at_layer0_queries(smollm2):
    # HF/NeoX pairs (i, i + head_dim/2) on GGUF's adjacent-pair weights: the classic porting bug
    pre = {}
    n_prompt = len(dump_as_stages("france")[0]["prompt_ids"])

    def keep(a, e):
        pre[e.step, e.layer, e.stage[0]] = a
        return a

    def split_half_rope(a, e):
        x = pre[e.step, e.layer, e.stage[0]].astype(np.float64).reshape(a.shape)   # [seq, heads, head_dim]
        seq, _, hd = x.shape
        start = 0 if e.step == 0 else n_prompt + e.step - 1
        angle = np.arange(start, start + seq)[:, None] * smollm2.config.rope_theta ** (-np.arange(0, hd, 2) / hd)
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(a.dtype)

    first, rows = _first(smollm2, [{"Qcur": keep, "Kcur": keep},
                                   {"Qcur_rope": split_half_rope, "Kcur_rope": split_half_rope}])
    assert (first.step, first.layer, first.stage) == (0, 0, "Qcur_rope")
    assert first.rel_rms_err > 0.3 and rows[(0, 0, "Kcur_rope")].diverged
    assert rows[(0, 0, "Qcur")].status == "ok"                 # the projection before it agrees


def test_rmsnorm_without_its_scale_is_flagged_at_layer0_attn_norm(smollm2):
    x_in = {}

    def keep(a, e):
        x_in[e.step] = a
        return a

    def without_rsqrt(a, e):      # x * w instead of x / rms(x) * w
        x = x_in[e.step].astype(np.float64)
        return (a * np.sqrt((x * x).mean(-1, keepdims=True) + smollm2.config.norm_eps)).astype(a.dtype)

    first, rows = _first(smollm2, [{"inp_embd": keep}, {"attn_norm": without_rsqrt}], layers_for=[0])
    assert (first.step, first.layer, first.stage) == (0, 0, "attn_norm")
    assert first.rel_rms_err > 0.5 and rows[(0, None, "inp_embd")].status == "ok"


def test_a_fault_below_threshold_is_not_blamed_on_a_later_stage(smollm2):
    # noise at 0.1 of a stage's spread stays under the thresholds and does not grow past them downstream
    def noise(a, e):
        return a + 0.1 * float(a.std()) * np.random.default_rng(e.step).standard_normal(a.shape).astype(a.dtype)

    first, rows = _first(smollm2, [{}, {"ffn_up": noise}], layers_for=[0])
    assert first is None
    assert 0.05 < rows[(0, 0, "ffn_up")].rel_rms_err < cmp.THRESHOLDS["other"]


_LOCAL = ["attn_norm", "Qcur", "Vcur", "Kcur_rope", "kq_soft_max", "kqv_out", "attn_out", "ffn_inp",
          "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out"]


@pytest.fixture(scope="module")
def q8_model(smollm2_path):
    from llamatrace.model import Llama
    return Llama.load(smollm2_path, activations="q8")


@pytest.mark.parametrize("mode", ["f32", "q8"])
@pytest.mark.parametrize("stage,layer", [(s, 0 if i % 2 else 29) for i, s in enumerate(_LOCAL)])
def test_with_the_model_a_stage_five_percent_off_is_found_under_llamacpp_drift(smollm2, q8_model, mode,
                                                                                stage, layer):
    # llama.cpp's accumulated 8-bit drift (0.05-0.12) hides a 5 % fault from the thresholds; the
    # error the stage adds (recomputed from each recording's own inputs) does not
    model = smollm2 if mode == "f32" else q8_model
    meta, ref = dump_as_stages("france")
    with model.hooks({stage: lambda a, e: a * np.float32(1.05)}, layers=[layer]):
        ours, _, _ = cmp.run_ours(model, meta["prompt_ids"], tokens=1)
    blind = cmp.compare_arrays(ours, ref, layers=[0, 29]).first_divergence
    result = cmp.compare_arrays(ours, ref, layers=[0, 29], model=model)
    first = result.first_divergence
    assert (first.step, first.layer, first.stage, first.status) == (0, layer, stage, "added error")
    assert 0.04 < first.local_err < 0.06 and result.extra["local_errors"]
    if layer == 29:
        assert blind is None or (blind.layer, blind.stage) != (layer, stage)


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_with_the_model_a_healthy_llamacpp_comparison_still_passes(smollm2, q8_model, mode):
    model = smollm2 if mode == "f32" else q8_model
    meta, ref = dump_as_stages("france")
    ours, _, _ = cmp.run_ours(model, meta["prompt_ids"], tokens=1)
    result = cmp.compare_arrays(ours, ref, layers=[0, 29], model=model)
    assert result.first_divergence is None
    theirs = [r.ref_local_err for r in result.rows if r.ref_local_err is not None]
    assert len(theirs) > 40 and max(theirs) < cmp.LOCAL_THRESHOLDS[mode]
    assert all(r.local_err == 0.0 for r in result.rows if r.local_err is not None)
