"""Experts left in the GGUF file: a mixture of experts loads as a map of its own, not a packed copy.

Experts of a type the activation mode's ``mul_mat_id`` kernels run stay as the file stores them
(:class:`llamatrace.kernels.mul_mat_id.FileExperts`, a read-only map of the file that is not the
GGUFFile's): nothing of them is packed, nor written to the packed-weights cache, and
:func:`llamatrace.model.moe.moe_ffn` runs them through ``mul_mat_id``. Until the real kernels
declare their types, ``tests/raw_experts.py`` stands in for them (the :func:`raw` fixture: the
types these tiny files use, on ``mul_mat_id_ref``'s arithmetic). The logits are checked against
llama.cpp's on the same files (``tests/golden/*_llamacpp.npz``, made by the scripts beside them),
at the 1e-4 relative bar of the fidelity tests.

The other test files run with every expert raw too: ``python3 -m pytest -p raw_experts tests/test_moe.py``
(``PYTHONPATH`` holding ``tests/``).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import raw_experts
from arch_files import golden_arrays, relative, run_positions
from cli_helpers import run
from gptoss_files import write_gptoss_file
from moe_files import write_moe_file
from qwen35_files import write_qwen35_file

from llamatrace.analysis.local_error import local_errors
from llamatrace.kernels.mul_mat_id import FileExperts
from llamatrace.kernels.quantizers.rows import quantize_rows
from llamatrace.kernels.types import packing
from llamatrace.model import moe
from llamatrace.model.llama import Llama
from llamatrace.quantize import search as S

T = gguf.GGMLQuantizationType
RTOL = 1e-4
PREFILL = 4                   # make_moe_golden.py's and make_gptoss_golden.py's decode runs


@pytest.fixture
def raw():
    """The stand-in mul_mat_id kernels (tests/raw_experts.py) for one test."""
    mp = raw_experts.patch()
    yield
    mp.undo()


def _expert_tensors(model) -> dict[str, int]:
    """The file's expert tensors (name -> bytes)."""
    return {t.name: t.n_bytes for t in model.file.tensors.values() if "_exps.weight" in t.name}


def _assert_raw(model) -> None:
    """Every expert of the model is the file's bytes: a read-only view of a map that is not the
    GGUFFile's, and no packed Weight holds an expert."""
    held = {}
    for lw in model.weights.layers:
        assert lw.moe is not None
        for fe in lw.moe.file_experts():
            assert isinstance(fe, FileExperts) and not fe.data.flags.writeable
            assert fe.data.base is not None and not np.shares_memory(fe.data, model.file.tensors[fe.name].data)
            held[fe.name] = fe.data.nbytes
        assert all("_exps" not in w.name for w in lw.moe.matrices())
    assert held == _expert_tensors(model)


@pytest.mark.parametrize("name, qtype, acts", [("qwen3moe", T.F32, "f32"), ("mixtral", T.F32, "f32"),
                                               ("olmoe", T.Q8_0, "q8")])
def test_supported_experts_stay_in_the_file_and_match_llamacpp(raw, name, qtype, acts, tmp_path):
    path = write_moe_file(tmp_path / f"{name}.gguf", name, qtype=qtype)
    golden, key = golden_arrays("moe_llamacpp.npz"), name if qtype == T.F32 else f"{name}_q8_0"
    with Llama.load(path, activations=acts, cache=False) as model:
        _assert_raw(model)
        ids = golden[f"{key}_ids"]
        for run_kind, prefill in (("prefill", len(ids)), ("decode", PREFILL)):
            ours = run_positions(model, ids, prefill)
            assert relative(ours, golden[f"{key}_{run_kind}"]).max() <= RTOL, run_kind
            assert (ours.argmax(1) == golden[f"{key}_{run_kind}"].argmax(1)).all()


@pytest.mark.parametrize("experts, acts, key", [(T.F32, "f32", "f32"), (T.MXFP4, "q8", "mxfp4")])
def test_gpt_oss_experts_stay_in_the_file_and_match_llamacpp(raw, experts, acts, key, tmp_path):
    golden = golden_arrays("gptoss_llamacpp.npz")
    model = Llama.load(write_gptoss_file(tmp_path / "gptoss.gguf", experts=experts), activations=acts, cache=False)
    _assert_raw(model)
    for run_kind, prefill in (("prefill", len(golden["ids"])), ("decode", PREFILL)):
        ours = run_positions(model, golden["ids"], prefill)
        assert relative(ours, golden[f"{key}_{run_kind}"]).max() <= RTOL, run_kind


@pytest.mark.parametrize("fused", [False, True])
def test_qwen35moe_experts_fused_or_not_stay_in_the_file_and_match_llamacpp(raw, fused, tmp_path):
    golden = golden_arrays("qwen35moe_llamacpp.npz")
    model = Llama.load(write_qwen35_file(tmp_path / "q35.gguf", moe=True, fused_gate_up=fused), cache=False)
    _assert_raw(model)
    assert all(isinstance(lw.moe.w13 if fused else lw.moe.w1, FileExperts) for lw in model.weights.layers)
    ours = run_positions(model, golden["ids"], len(golden["ids"]))
    assert relative(ours, golden["fused" if fused else "prefill"]).max() <= RTOL


def test_the_cache_entry_holds_no_expert_and_close_keeps_the_model_running(raw, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMATRACE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_moe_file(tmp_path / "qwen3moe.gguf", "qwen3moe")
    ids = np.arange(3, 12)
    first = Llama.load(path, cache=True)                      # packs into the entry
    expert_bytes = sum(_expert_tensors(first).values())
    want = run_positions(first, ids, len(ids))
    first.close()
    np.testing.assert_array_equal(run_positions(first, ids, len(ids)), want)      # unmapped: the experts' own map stays
    entries = list((tmp_path / "cache").rglob("*.ltpack"))
    assert len(entries) == 1 and entries[0].stat().st_size < path.stat().st_size - expert_bytes
    with Llama.load(path, cache=True) as warm:              # from the entry: the same experts, the same numbers
        assert warm.pack_cache.read
        _assert_raw(warm)
        np.testing.assert_array_equal(run_positions(warm, ids, len(ids)), want)


def test_packed_and_raw_kinds_mix_in_one_layer_with_the_numbers_of_each(raw, tmp_path):
    """A layer whose gate is packed beside a raw up (the search swaps one kind at a time) computes
    what the all-raw layer does, to float32 rounding."""
    path = write_moe_file(tmp_path / "mixtral.gguf", "mixtral")
    model = Llama.load(path, cache=False)
    ids = np.arange(5, 14)
    want = run_positions(model, ids, len(ids))
    for i, lw in enumerate(model.weights.layers):
        fe = lw.moe.w1
        lw.moe.w1 = [packing.pack(f"{fe.name}#{e}", fe.ggml_type, fe.data[e].view(np.float32), fe.n_out, fe.n_in)
                     for e in range(fe.n_expert)]
    got = run_positions(model, ids, len(ids))
    assert relative(got, want).max() < 1e-6


@pytest.mark.parametrize("path_of, acts", [(lambda d: write_gptoss_file(d / "g.gguf", experts=T.MXFP4), "q8"),
                                           (lambda d: write_moe_file(d / "q.gguf", "qwen3moe"), "f32")])
def test_watched_unwatched_and_one_row_at_a_time_give_the_same_numbers(raw, path_of, acts, tmp_path):
    """The MoE block of a batch, of its rows one at a time (decode) and with every per-expert stage
    watched: bit for bit the same rows; and the whole model's logits with every stage recorded."""
    model = Llama.load(path_of(tmp_path), activations=acts, cache=False)
    _assert_raw(model)
    mw, opts = model.weights.layers[1].moe, moe.MoEOptions.from_config(model.config)
    x = np.random.default_rng(3).normal(size=(11, model.config.dim)).astype(np.float32)
    seen = {}

    def emit(stage, layer, a):
        seen[stage] = a
        return a
    batch = moe.moe_ffn(x, mw, opts, emit, 1, lambda layer, *stages: False)
    assert not seen.keys() & set(moe.EXPERT_STAGES)
    watched = moe.moe_ffn(x, mw, opts, emit, 1, lambda layer, *stages: True)
    assert seen["ffn_moe_down"].shape == (11, opts.k, model.config.dim)
    np.testing.assert_array_equal(watched, batch)
    rows = np.concatenate([moe.moe_ffn(x[i:i + 1], mw, opts, emit, 1, lambda layer, *stages: False) for i in range(11)])
    np.testing.assert_array_equal(rows, batch)
    ids = np.arange(3, 14)
    want = model.forward(ids, 0, model.new_cache(len(ids)), all_logits=True)
    with model.trace(keep_arrays=True):
        np.testing.assert_array_equal(model.forward(ids, 0, model.new_cache(len(ids)), all_logits=True), want)


def test_local_errors_recompute_the_raw_expert_stages(raw, tmp_path):
    model = Llama.load(write_gptoss_file(tmp_path / "gptoss.gguf", experts=T.MXFP4), activations="q8", cache=False)
    _assert_raw(model)
    cache = model.new_cache(8)
    with model.trace(keep_arrays=True) as rec:
        model.forward(np.arange(3, 9), 0, cache)
        model.forward(np.array([9]), 6, cache)
    errors = local_errors(model, rec.arrays())
    for stage in ("ffn_moe_gate", "ffn_moe_up", "ffn_moe_down", "ffn_moe_out"):
        for layer in range(model.config.n_layers):
            assert errors[f"step0.layer{layer}.{stage}"] < 1e-6, (stage, layer)


def test_the_search_swaps_requantized_experts_in_as_file_experts(raw, tmp_path):
    """The recipe search's in-memory re-quantized experts (Q8_0 here, a raw type) run as FileExperts
    over its bytes and give the logits of the file written with that type."""
    path = write_moe_file(tmp_path / "qwen3moe.gguf", "qwen3moe")
    with Llama.load(path, cache=False) as model:
        rng = np.random.default_rng(0)
        cal = S.Calibration([rng.integers(0, model.config.vocab_size, 16)], [np.arange(7, dtype=np.int64)], 8)
        measurer = S.Measurer(model, cal, quantize_rows)
        group = next(g for g in S.make_groups(model.file, model.config.n_layers, [T.Q8_0])
                     if g.name == "blk.1.ffn_down_exps")
        data = measurer.quantized(group, T.Q8_0)
        swapped = measurer.pack(group, T.Q8_0, data)
        assert isinstance(swapped, FileExperts) and swapped.ggml_type == T.Q8_0
        np.testing.assert_array_equal(swapped.data.reshape(data.shape), data)
        assert measurer.measure(group, T.Q8_0, data) > 0
        ids = np.arange(3, 12)
        old = measurer.swap(group, swapped)
        got = run_positions(model, ids, len(ids))
        rows = group.n_rows // group.n_expert
        measurer.swap(group, [packing.pack(f"{group.tensor}#{e}", T.Q8_0, swapped.data[e], rows, group.n_per_row)
                              for e in range(group.n_expert)])
        packed = run_positions(model, ids, len(ids))
        measurer.restore(group, old)
        w2 = model.weights.layers[1].moe.w2
        assert isinstance(w2, FileExperts) and w2.ggml_type == T.F32      # restored
    assert relative(got, packed).max() < 1e-5                # the same bytes, raw or packed: the same model


def test_info_says_how_each_expert_type_runs(raw, tmp_path, capsys):
    path = write_gptoss_file(tmp_path / "gptoss.gguf", experts=T.MXFP4)
    code, out, _ = run(capsys, "info", "-m", path)
    assert code == 0 and "experts: MXFP4: mul_mat_id on the file's blocks (f32, q8)" in out
    path = write_moe_file(tmp_path / "q.gguf", "qwen3moe", qtype=T.Q4_0)
    code, out, _ = run(capsys, "info", "-m", path)
    assert code == 0 and "experts: Q4_0: packed per expert (f32, q8)" in out
