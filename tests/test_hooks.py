"""Interventions (model.hooks, zero-ablation) on tiny models, checked against tests/reference.py
run with the same ablation; exact tracing (recording never changes the logits)."""

from __future__ import annotations

import numpy as np
import pytest
from reference import reference_logits

from llamatrace.errors import HookError, OptionError
from llamatrace.tracing.hooks import REPLACEABLE_IDS, zero_ablation
from llamatrace.tracing.stages import STAGES, stage_applies

TOKENS = [5, 40, 77, 260, 3, 150, 268, 99]


def _prefill_and_decode(model, extra=(7, 11)):
    """Prefill TOKENS, then decode `extra` one by one; every call's logits, concatenated."""
    cache = model.new_cache(16)
    out = [model.forward(np.array(TOKENS), 0, cache, all_logits=True)]
    for t in extra:
        out.append(model.forward(np.array([t]), cache.pos, cache))
    return np.concatenate(out)


def test_identity_hooks_give_bit_identical_logits(tiny_model):
    plain = _prefill_and_decode(tiny_model)
    seen = []

    def keep(array, event):                  # None: go on with the array as it is
        seen.append((event.step, event.layer, event.stage))

    def same(array, event):                  # a replacement equal to the input
        return array.copy()

    for fn in (keep, same):
        with tiny_model.hooks({sid: fn for sid in REPLACEABLE_IDS}):
            hooked = _prefill_and_decode(tiny_model)
        assert np.array_equal(hooked, plain)
    c = tiny_model.config                    # a prefill runs the stages the catalogue gives this model
    runs = [s for s in STAGES if s.replaceable and stage_applies(s, 2, c.n_rep, c.features)]
    model_stages = sum(1 for s in runs if s.level == "model")
    layer_stages = sum(1 for s in runs if s.level == "layer")
    per_prefill = model_stages + tiny_model.config.n_layers * layer_stages    # kq_masked included
    assert sum(1 for step, _, _ in seen if step == 0) == per_prefill
    assert {step for step, _, _ in seen} == {0, 1, 2}


@pytest.mark.parametrize("ablate", [
    [("attn_out", 1, None)],
    [("kqv", 0, 1)],
    [("kq_soft_max", 1, 3), ("ffn_swiglu", 0, None)],
    [("ffn_out", 0, None), ("l_out", 1, None)],
    [("inp_embd", None, None)],
])
def test_zero_ablation_matches_reference(tiny_model, tiny_model_path, ablate):
    model = tiny_model
    ref = reference_logits(tiny_model_path, TOKENS, ablate=ablate)
    plain = reference_logits(tiny_model_path, TOKENS)
    assert not np.allclose(ref, plain)       # the ablation changes something
    with_hooks = []
    for stage, layer, head in ablate:
        with_hooks.append(model.hooks({stage: zero_ablation(stage, head)},
                                      layers=None if layer is None else [layer]))
    for h in with_hooks:
        h.__enter__()
    try:
        logits = model.forward(np.array(TOKENS), 0, model.new_cache(16), all_logits=True)
    finally:
        for h in reversed(with_hooks):
            h.__exit__(None, None, None)
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


def test_a_replacement_is_what_later_stages_and_the_recorder_see(tiny_model):
    with tiny_model.hooks({"attn_out": zero_ablation("attn_out")}, layers=[0]):
        with tiny_model.trace(layers=[0], stages=["inp_embd", "attn_out", "ffn_inp"], keep_arrays=True) as rec:
            tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))
    arrays = rec.arrays()
    assert not arrays["step0.layer0.attn_out"].any()
    assert np.array_equal(arrays["step0.layer0.ffn_inp"], arrays["step0.inp_embd"])   # x + 0


def test_activation_patching_of_the_last_block_output_gives_the_source_logits(tiny_model):
    a, b = TOKENS, TOKENS[::-1]
    last = tiny_model.config.n_layers - 1
    with tiny_model.trace(layers=[last], stages=["l_out"], keep_arrays=True) as rec:
        logits_a = tiny_model.forward(np.array(a), 0, tiny_model.new_cache(16))
    saved = rec.arrays()[f"step0.layer{last}.l_out"]
    with tiny_model.hooks({"l_out": lambda array, event: saved}, layers=[last]):
        patched_b = tiny_model.forward(np.array(b), 0, tiny_model.new_cache(16))
    plain_b = tiny_model.forward(np.array(b), 0, tiny_model.new_cache(16))
    assert np.array_equal(patched_b, logits_a)
    assert not np.array_equal(plain_b, logits_a)


def test_hooks_end_with_their_block(tiny_model):
    plain = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))
    with tiny_model.hooks({"l_out": zero_ablation("l_out")}):
        zeroed = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))
    after = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))
    assert not np.array_equal(zeroed, plain)
    assert np.array_equal(after, plain)


@pytest.mark.parametrize("stage", ["keys", "values_rep", "Qcur_heads", "cache_k", "freqs_cis", "kq_mask"])
def test_views_and_lazy_copies_are_refused(tiny_model, stage):
    with pytest.raises(OptionError, match=f"stage '{stage}' is not an array of its own") as info:
        with tiny_model.hooks({stage: lambda a, e: None}):
            pass
    assert "\n" not in str(info.value)


def test_bad_hooks_are_refused(tiny_model):
    with pytest.raises(OptionError, match="unknown stage 'nope'"):
        with tiny_model.hooks({"nope": lambda a, e: None}):
            pass
    with pytest.raises(OptionError, match="out of range"):
        with tiny_model.hooks({"l_out": lambda a, e: None}, layers=[tiny_model.config.n_layers]):
            pass
    with pytest.raises(OptionError, match="has no heads axis"):
        zero_ablation("attn_out", 0)
    with tiny_model.hooks({"kqv": zero_ablation("kqv", tiny_model.config.n_heads)}):
        with pytest.raises(OptionError, match="head out of range"):
            tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))
    with tiny_model.hooks({"l_out": lambda a, e: a[:, :3]}):
        with pytest.raises(HookError, match=r"returned float32 \[8, 3\]; it must return float32 \[8, 64\]"):
            tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))


def test_recording_every_stage_leaves_the_logits_bit_identical(tiny_model):
    """Recording result_output computes every position's logits; the last row must still come
    from the same kernel call as in an unrecorded run (more than GEMV_MAX_SEQ rows here)."""
    plain = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))
    with tiny_model.trace(stats=True, keep_arrays=True) as rec:
        traced = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))
    assert traced.shape == (len(TOKENS), tiny_model.config.vocab_size)
    assert np.array_equal(traced[-1:], plain)
    assert np.array_equal(rec.arrays()["step0.result_output"][-1:], plain)
