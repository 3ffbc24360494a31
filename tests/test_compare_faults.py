"""`llamatrace compare` flags real bugs where they appear: faults computed inside our forward pass
(through model.hooks), not edits of a recording, checked against the committed llama.cpp dump."""

from __future__ import annotations

import numpy as np
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
