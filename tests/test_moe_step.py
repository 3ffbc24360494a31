"""The pieces of a mixture-of-experts decode step that were cut down to fewer calls, against the
forms they replace: the same ids, groups and float32 bits.

- the router's top-k keeps k indices, not the whole insertion sort (``route``);
- the slots are grouped by expert in one Numba call (``_group``, twin ``groups``), and the
  experts' parts are checked once (``ExpertParts``), not at every ``mul_mat_id`` call;
- gpt-oss's per-expert biases go into the gated activation (``expert_glu``) and the weighted sum
  (``combine``) instead of separate adds;
- a decode step's attention scores, scaling, softmax and values are one call (``attention_decode``)
  when nothing watches them.

Whole models are held against llama.cpp in tests/test_moe.py and tests/test_file_experts.py
(``test_recording_every_moe_stage_leaves_the_logits_bit_identical`` holds the fused step against
the one that assembles every per-expert stage).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import raw_experts
from gptoss_files import write_gptoss_file
from moe_files import write_moe_file

from llamatrace.kernels import mul_mat_id as mmid
from llamatrace.kernels.ops import fp32
from llamatrace.kernels.ops import moe as routing
from llamatrace.model.llama import Llama

T = gguf.GGMLQuantizationType


def test_top_k_is_the_first_k_of_the_whole_insertion_sort_ties_infs_and_nans_included():
    rng = np.random.default_rng(3)
    few = np.array([0.1, 0.2, 0.3, 0.5, -np.inf, np.inf, np.nan], np.float32)
    for trial in range(400):
        n = int(rng.integers(1, 24))
        k = int(rng.integers(1, n + 1))
        row = rng.choice(few, n) if trial % 2 else rng.normal(size=n).astype(np.float32)
        _, ids, _, _ = routing.route(row[None], k, "softmax_weight")       # probs are the logits
        assert list(ids[0]) == list(routing.top_k_ref(row[None], k)[0]), (row, k)


@pytest.mark.parametrize("n_slots", [0, 1, 8, 37, 4096])
def test_group_is_groups_in_one_call(n_slots):
    rng = np.random.default_rng(n_slots)
    ids = rng.integers(0, 128, n_slots)
    ids[: n_slots // 2] = ids[0] if n_slots else 0             # a crowded expert: slot order within it
    rows = np.arange(n_slots, dtype=np.int64) // 8
    ok, order, starts, experts = mmid._group(ids, rows, 128, max(1, -(-n_slots // 8)))
    assert ok
    for got, want in zip((order, starts, experts), mmid.groups(ids)):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int64


def test_group_refuses_an_id_or_a_row_out_of_range():
    rows = np.zeros(2, np.int64)
    assert not mmid._group(np.array([3, 128]), rows, 128, 1)[0]
    assert not mmid._group(np.array([-1, 3]), rows, 128, 1)[0]
    assert not mmid._group(np.array([3, 4]), np.array([0, 1]), 128, 1)[0]


@pytest.fixture
def raw():
    """The stand-in mul_mat_id kernels (tests/raw_experts.py): the checks, not the kernels, are tested."""
    mp = raw_experts.patch()
    yield
    mp.undo()


def _experts(name: str, n_out: int, n_in: int, seed: int, qtype: T = T.Q8_0) -> mmid.FileExperts:
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    w = np.random.default_rng(seed).standard_normal((5 * n_out, n_in)).astype(np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(w, qtype).reshape(5, n_out, n_in // block * nbytes))
    raw.flags.writeable = False
    return mmid.FileExperts(name, qtype, n_out, n_in, raw)


@pytest.mark.parametrize("acts", ["f32", "q8"])
def test_expert_parts_run_as_mul_mat_id_and_check_each_call(raw, acts):
    parts = (_experts("gate", 6, 64, 0), _experts("up", 6, 64, 1))
    run = mmid.ExpertParts(parts, acts)
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    ids, rows = np.array([4, 0, 4, 2, 1, 0]), np.array([0, 0, 1, 1, 2, 2])
    for _ in range(2):                                          # kept and called again
        np.testing.assert_array_equal(run(x, ids, rows), mmid.mul_mat_id(x, parts, ids, rows, acts))
    np.testing.assert_allclose(run(x, ids, rows), mmid.mul_mat_id_ref(x, parts, ids, rows, acts), rtol=1e-5)
    with pytest.raises(ValueError, match="ids must be in 0..4"):
        run(x, np.array([5, 0, 4, 2, 1, 0]), rows)
    with pytest.raises(ValueError, match="rows in 0..2"):
        run(x, ids, np.array([0, 0, 1, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"must be \[n_rows, 64\]"):
        run(x[:, :32], ids, rows)


def test_expert_parts_refuse_parts_that_differ_or_have_no_kernel(raw):
    with pytest.raises(ValueError, match="one type, n_in and n_expert"):
        mmid.ExpertParts((_experts("gate", 6, 64, 0), _experts("up", 6, 96, 1)))
    with pytest.raises(ValueError, match="no q8 kernel for Q4_0"):
        mmid.ExpertParts((_experts("gate", 6, 64, 0, T.Q4_0),), "q8")


def test_moe_weights_keep_one_expert_parts_a_call_site_when_the_search_swaps_experts(raw):
    """The recipe search puts candidate after candidate into a layer's experts: each call site
    keeps the parts of its current experts only, so a replaced candidate's bytes can be freed."""
    import gc
    import weakref

    from llamatrace.model.moe import MoEWeights
    mw = MoEWeights(router=None, w2=_experts("down", 64, 32, 0), w1=_experts("gate", 32, 64, 1),
                    w3=_experts("up", 32, 64, 2))
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    ids = np.array([4, 1, 0, 4])
    gone = []
    for seed in range(4):
        gone.append(weakref.ref(mw.w2))
        mw.w2 = _experts("down", 64, 32, 10 + seed)             # the search's candidate
        h = mw.gate_up(x, ids, np.array([0, 0, 1, 1]))[:, :32].copy()
        np.testing.assert_array_equal(mw.down(h, ids), mmid.mul_mat_id(h, (mw.w2,), ids))
        assert len(mw._in_file) == 2                              # "gate_up" and "down", no more
    gc.collect()
    assert all(ref() is None for ref in gone)


@pytest.mark.parametrize("act", routing.GLU_ACTS)
@pytest.mark.parametrize("n_slots", [1, 8, 64])          # 64: the threaded variant
def test_expert_glu_is_the_bias_add_and_swiglu_it_replaces_bit_for_bit(act, n_slots):
    rng = np.random.default_rng(n_slots)
    ff = 300
    gate_up = (rng.standard_normal((n_slots, 2 * ff)) * 6).astype(np.float32)    # past gpt-oss's clamp at 7
    gate_up[0, :3] = [np.inf, -np.inf, np.nan]
    bias = rng.standard_normal((32, 2 * ff)).astype(np.float32)
    ids = rng.integers(0, 32, n_slots)
    for b in (None, bias):
        summed = gate_up + b[ids] if b is not None else gate_up
        want = fp32.swiglu(summed) if act == "silu" else fp32.swiglu_oai(summed[:, :ff], summed[:, ff:])
        got = routing.expert_glu(gate_up, act, b, ids)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        with np.errstate(invalid="ignore", over="ignore"):              # the inf and NaN entries
            np.testing.assert_allclose(got, routing.expert_glu_ref(gate_up, act, b, ids), rtol=2e-6, atol=1e-7)


def test_expert_glu_refuses_what_does_not_fit():
    gate_up = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="act 'gelu'"):
        routing.expert_glu(gate_up, "gelu")
    with pytest.raises(ValueError, match="ids"):
        routing.expert_glu(gate_up, "silu", np.zeros((4, 8), np.float32), np.array([0, 4]))


def test_combine_adds_each_slot_s_down_bias_first_bit_for_bit():
    rng = np.random.default_rng(4)
    down = rng.standard_normal((5, 4, 70)).astype(np.float32)
    weights = rng.random((5, 4)).astype(np.float32)
    bias = rng.standard_normal((32, 70)).astype(np.float32)
    ids = rng.integers(0, 32, (5, 4))
    got = routing.combine(down, weights, bias, ids)
    np.testing.assert_array_equal(got, routing.combine(down + bias[ids], weights))
    np.testing.assert_array_equal(got, routing.combine_ref(down, weights, bias, ids))


def test_combine_and_expert_glu_refuse_a_bias_or_weights_of_another_shape():
    """The kernels index them unchecked: a narrower bias was read past its end."""
    down, weights, ids = np.zeros((2, 3, 8), np.float32), np.ones((2, 3), np.float32), np.zeros((2, 3), np.int64)
    with pytest.raises(ValueError, match=r"must be \[n_expert, 8\]"):
        routing.combine(down, weights, np.zeros((4, 5), np.float32), ids)
    with pytest.raises(ValueError, match="with each slot's expert id"):
        routing.combine(down, weights, np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match=r"weights \[2, 2\]"):
        routing.combine(down, weights[:, :2])
    with pytest.raises(ValueError, match=r"must be \[n_expert, 8\]"):
        routing.expert_glu(np.zeros((2, 8), np.float32), "silu", np.zeros((4, 6), np.float32), np.array([0, 1]))


@pytest.mark.parametrize("name", ["gptoss", "qwen3moe"])
def test_a_decode_step_s_attention_is_one_call_with_the_bits_of_the_three(name, tmp_path, monkeypatch):
    """Unwatched, a decode step's scores, scaling, softmax and values are one attention_decode call
    (every key seen; gpt-oss: sinks, and its window on every other layer); watched, the three
    stages are computed and recorded: the same logits bit for bit, step after step."""
    path = (write_gptoss_file(tmp_path / "g.gguf") if name == "gptoss"
            else write_moe_file(tmp_path / "q.gguf", "qwen3moe"))
    model = Llama.load(path, cache=False)
    calls = []
    real = fp32.attention_decode
    monkeypatch.setattr(fp32, "attention_decode", lambda xq, *a, **k: calls.append(xq.shape[0]) or real(xq, *a, **k))
    ids = [5, 9, 2, 7, 30, 11, 4, 8, 21, 3]               # past gpt-oss's window of the test file
    plain, traced = model.new_cache(len(ids)), model.new_cache(len(ids))
    for pos, t in enumerate(ids):
        want = model.forward([t], pos, plain)
        n = len(calls)
        with model.trace(stages=["kq", "kq_scaled", "kq_soft_max"], keep_arrays=True) as rec:
            got = model.forward([t], pos, traced)
        assert len(calls) == n and {e.stage for e in rec.events} == {"kq", "kq_scaled", "kq_soft_max"}
        np.testing.assert_array_equal(got, want)
    assert calls == [1] * model.config.n_layers * len(ids)
