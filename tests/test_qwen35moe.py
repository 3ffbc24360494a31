"""Qwen3.5's MoE variant (llama.cpp ``qwen35moe``): qwen35's gated DeltaNet and gated attention
layers, with a mixture of experts and a sigmoid-gated shared expert as the FFN.

The random-weight file is written at test time by ``tests/qwen35_files.py`` (``moe=True``);
llama.cpp's float32 logits on the same file are in ``tests/golden/qwen35moe_llamacpp.npz``, made
by ``tests/golden/make_qwen35moe_golden.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from arch_files import golden_arrays, relative, run_positions
from cli_helpers import assert_one_line_error, run
from qwen35_files import EXPERT_FF, N_EXPERT, N_EXPERT_USED, SHEXP_FF, write_qwen35_file

from llamatrace.errors import ModelFormatError
from llamatrace.model.llama import Llama
from llamatrace.tracing.recorder import Recorder
from llamatrace.tracing.stages import STAGES, eval_shape, stage_applies

PREFILL = 13                 # make_qwen35moe_golden.py's decode run: 13 tokens in one batch, then one a step
F32_RTOL = 1e-4              # relative L2 distance per position
SHEXP_STAGES = ("ffn_shexp", "shared_expert_gate", "shared_expert_gate_sigmoid", "ffn_shexp_gated")


@pytest.fixture(scope="module")
def golden():
    return golden_arrays("qwen35moe_llamacpp.npz")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_qwen35_file(tmp_path_factory.mktemp("qwen35moe") / "tiny-qwen35moe.gguf", moe=True)


@pytest.fixture(scope="module")
def model(path):
    return Llama.load(path)


def test_config_reads_the_experts_and_the_shared_expert_widths(model):
    c = model.config
    assert (c.arch, c.n_expert, c.n_expert_used, c.expert_hidden_dim, c.shexp_hidden_dim) == (
        "qwen35moe", N_EXPERT, N_EXPERT_USED, EXPERT_FF, SHEXP_FF)
    assert c.expert_gating == "softmax" and c.expert_weights_norm
    assert {"moe", "moe_norm", "moe_shexp", "deltanet", "attn_gate"} <= c.features
    assert c.recurrent_layers == (0, 1, 3)


def test_shared_expert_width_defaults_to_feed_forward_length(tmp_path):
    path = write_qwen35_file(tmp_path / "d.gguf", moe=True, meta={"expert_shared_feed_forward_length": None},
                             shapes={f"blk.{i}.{n}": s for i in range(4) for n, s in (
                                 ("ffn_gate_shexp.weight", (96, 64)), ("ffn_up_shexp.weight", (96, 64)),
                                 ("ffn_down_shexp.weight", (64, 96)))})
    assert Llama.load(path, cache=False).config.shexp_hidden_dim == 96


@pytest.mark.parametrize("key, prefill", [("prefill", None), ("decode", PREFILL)])
def test_f32_logits_match_llamacpp_at_every_position(key, prefill, model, golden):
    ids = golden["ids"]
    ours = run_positions(model, ids, prefill or len(ids))
    assert relative(ours, golden[key]).max() <= F32_RTOL
    np.testing.assert_array_equal(ours.argmax(axis=1), golden[key].argmax(axis=1))


def test_fused_gate_up_experts_match_llamacpp(golden, tmp_path):
    """``ffn_gate_up_exps`` (gate rows first) in place of ``ffn_gate_exps`` and ``ffn_up_exps``."""
    path = write_qwen35_file(tmp_path / "fused.gguf", moe=True, fused_gate_up=True)
    ids = golden["ids"]
    ours = run_positions(Llama.load(path, cache=False), ids, len(ids))
    assert relative(ours, golden["fused"]).max() <= F32_RTOL
    np.testing.assert_array_equal(ours.argmax(axis=1), golden["fused"].argmax(axis=1))


def test_routes_are_clear_and_the_shared_expert_matters(model, golden):
    """The k-th and (k+1)-th router logits stay apart (llama.cpp and we pick the same experts by a
    wide margin), routes differ between tokens, and the shared expert's gate is neither 0 nor 1."""
    ids = golden["ids"]
    rec = Recorder(keep_arrays=True)
    model.forward(ids, 0, model.new_cache(len(ids)), recorder=rec)
    logits = [e.array for e in rec.events if e.stage == "ffn_moe_logits"]
    assert len(logits) == 4
    for a in logits:
        top = -np.sort(-a, axis=1)
        assert (top[:, N_EXPERT_USED - 1] - top[:, N_EXPERT_USED]).min() > 1e-3
        assert len({tuple(sorted(r)) for r in np.argsort(-a, axis=1)[:, :N_EXPERT_USED]}) > 1
    sig = np.concatenate([e.array for e in rec.events if e.stage == "shared_expert_gate_sigmoid"])
    assert 0.001 < sig.min() and sig.max() < 0.999 and sig.std() > 0.1


def test_shared_expert_stages_match_llamacpps_graph_tensors(model, golden):
    """Each layer's ffn_moe_out, the four shared-expert stages, and their sum (llama.cpp's ffn_out)
    against the tensors of the same names in llama.cpp's graph, on a prefill of 6 tokens."""
    ids = golden["ids"][:6]
    rec = Recorder(keep_arrays=True)
    model.forward(ids, 0, model.new_cache(len(ids)), recorder=rec)
    ours = {(e.layer, e.stage): e.array.reshape(len(ids), -1) for e in rec.events
            if e.stage in ("ffn_moe_out", *SHEXP_STAGES)}
    for layer in range(model.config.n_layers):
        ours[layer, "ffn_out"] = ours[layer, "ffn_moe_out"] + ours[layer, "ffn_shexp_gated"]
        for stage in ("ffn_moe_out", *SHEXP_STAGES, "ffn_out"):
            ref = golden[f"stage|{stage}-{layer}"]
            assert np.linalg.norm(ours[layer, stage] - ref) <= 1e-5 * np.linalg.norm(ref), (layer, stage)


def test_trace_emits_the_shared_expert_stages_with_their_shapes(model):
    c = model.config
    ids = np.arange(3, 9)
    rec = Recorder(keep_arrays=True)
    cache = model.new_cache(len(ids) + 1)
    model.forward(ids, 0, cache, recorder=rec)
    model.forward(ids[:1], len(ids), cache, recorder=rec)
    got = [(e.step, e.layer, e.stage) for e in rec.events if e.layer is not None]
    expected = [(step, layer, s.id) for step, seq_len in ((0, len(ids)), (1, 1)) for layer in range(c.n_layers)
                for s in STAGES if s.level == "layer" and stage_applies(
                    s, seq_len, c.n_rep, c.features, recurrent=c.is_recurrent(layer))]
    assert got == expected
    stages = {s.id: s for s in STAGES}
    by_key = {e.key: e for e in rec.events}
    for step, seq_len in ((0, len(ids)), (1, 1)):
        for layer in range(c.n_layers):
            for sid in SHEXP_STAGES:
                e = by_key[f"step{step}.layer{layer}.{sid}"]
                assert tuple(e.shape) == eval_shape(stages[sid].shape, {"seq_len": seq_len, "dim": c.dim})
            gated = by_key[f"step{step}.layer{layer}.ffn_shexp_gated"].array
            want = (by_key[f"step{step}.layer{layer}.ffn_shexp"].array
                    * by_key[f"step{step}.layer{layer}.shared_expert_gate_sigmoid"].array)
            np.testing.assert_array_equal(gated, want)


@pytest.mark.parametrize("tensor", ["blk.0.ffn_up_shexp.weight", "blk.2.ffn_gate_inp_shexp.weight"])
def test_a_missing_shared_expert_tensor_is_one_error_line(tensor, tmp_path, capsys):
    path = write_qwen35_file(tmp_path / "broken.gguf", moe=True, skip_tensors=(tensor,))
    with pytest.raises(ModelFormatError, match=tensor):
        Llama.load(path, cache=False)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), tensor)


def test_a_shared_expert_of_the_wrong_width_is_one_error_line(tmp_path, capsys):
    tensor = "blk.1.ffn_down_shexp.weight"
    path = write_qwen35_file(tmp_path / "broken.gguf", moe=True, shapes={tensor: (64, 48)})
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), tensor)


@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_generate_and_trace_run_on_qwen35moe(activations, path, tmp_path, capsys):
    code, out, err = run(capsys, "generate", "-m", path, "--raw", "the cat", "-n", "3", "--json",
                         "--activations", activations)
    assert code == 0, err
    assert len(json.loads(out)["ids"]) >= 1
    jl = tmp_path / "t.jsonl"
    code, out, err = run(capsys, "trace", "-m", path, "--raw", "--tokens", "2", "--jsonl", jl,
                         "--activations", activations, "the cat sat")
    assert code == 0, err
    stages = {json.loads(line).get("stage") for line in jl.read_text().splitlines() if line.strip()}
    assert {"new_state", "attn_gated", "ffn_moe_out", *SHEXP_STAGES, "l_out", "result_output"} <= stages
