"""Qwen3.5 (llama.cpp ``qwen35``): gated DeltaNet layers beside gated full attention.

The random-weight file is written at test time by ``tests/qwen35_files.py``; llama.cpp's float32
logits on the same file (same seed, same bytes) are in ``tests/golden/qwen35_llamacpp.npz``, made
by ``tests/golden/make_qwen35_golden.py``. The delta-rule kernels are checked against each other
and against the rule written out in float64 (:func:`~llamatrace.kernels.ops.deltanet.delta_rule_naive`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from arch_files import golden_arrays, relative, run_positions
from cli_helpers import assert_one_line_error, run
from gguf_factory import rewrite_metadata
from qwen35_files import (CONV_KERNEL, DIM, N_K_HEADS, N_LAYERS, N_V_HEADS, SSM_HEAD_DIM, T, write_qwen35_file)

from llamatrace.errors import ModelFormatError, UnsupportedModelError
from llamatrace.kernels.ops import deltanet as dn
from llamatrace.model.config import imrope_text_rotated
from llamatrace.model.llama import Llama
from llamatrace.tracing.recorder import Recorder
from llamatrace.tracing.stages import STAGES, stage_applies

GOLDEN = Path(__file__).parent / "golden"
PREFILL = 66                 # make_qwen35_golden.py's decode run: 66 tokens in one batch, then one a step
F32_RTOL = 1e-4              # relative L2 distance per position, the issue's bar
TWO_PATHS_RTOL = 1e-5        # chunked prefill vs recurrent decode


@pytest.fixture(scope="module")
def golden():
    return golden_arrays("qwen35_llamacpp.npz")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_qwen35_file(tmp_path_factory.mktemp("qwen35") / "tiny-qwen35.gguf")


@pytest.fixture(scope="module")
def model(path):
    return Llama.load(path)


# ---- kernels: Numba against NumPy twin against the rule written out --------------------------
def _inputs(seq_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    f = np.float32
    q = dn.l2norm(rng.normal(size=(seq_len, 2, 16)).astype(f), 1e-6)
    k = dn.l2norm(rng.normal(size=(seq_len, 2, 16)).astype(f), 1e-6)
    v = rng.normal(size=(seq_len, 6, 16)).astype(f)
    g = -rng.uniform(0.0, 1.5, size=(seq_len, 6)).astype(f)           # decays exp(g) in (0.22, 1)
    beta = rng.uniform(0.0, 1.0, size=(seq_len, 6)).astype(f)
    state = (0.3 * rng.normal(size=(6, 16, 16))).astype(f)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("rule", [dn.delta_rule_recurrent, dn.delta_rule_recurrent_ref, dn.delta_rule_chunked,
                                  dn.delta_rule_chunked_ref])
def test_delta_rule_forms_match_the_rule_written_out(rule):
    """150 tokens: more than two 64-token chunks, a last one partial; a non-zero starting state."""
    q, k, v, g, beta, state = _inputs(150)
    want_o, want_s = dn.delta_rule_naive(q, k, v, g, beta, state)
    s = state.copy()
    o = rule(q, k, v, g, beta, s)
    assert np.abs(o - want_o).max() <= 1e-5 * np.abs(want_o).max()
    assert np.abs(s - want_s).max() <= 1e-5 * np.abs(want_s).max()


def test_chunked_prefill_and_recurrent_decode_agree_to_1e_5():
    q, k, v, g, beta, state = _inputs(100, seed=1)
    s1, s2 = state.copy(), state.copy()
    chunked = dn.delta_rule_chunked(q, k, v, g, beta, s1)
    steps = np.concatenate([dn.delta_rule_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                    beta[t:t + 1], s2) for t in range(len(q))])
    assert (np.linalg.norm(chunked - steps, axis=(1, 2)) / np.linalg.norm(steps, axis=(1, 2))).max() <= TWO_PATHS_RTOL
    assert np.linalg.norm(s1 - s2) <= TWO_PATHS_RTOL * np.linalg.norm(s2)


def test_causal_conv1d_twins_carry_the_state_across_calls():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(9, 20)).astype(np.float32)
    w = rng.normal(size=(20, 4)).astype(np.float32)
    # the plain definition: zero-padded causal convolution of the whole sequence
    padded = np.concatenate([np.zeros((3, 20)), x])
    want = sum(padded[k:k + 9] * w[:, k] for k in range(4))
    for conv in (dn.causal_conv1d, dn.causal_conv1d_ref):
        state = np.zeros((20, 3), dtype=np.float32)
        got = np.concatenate([conv(x[:5], state, w), conv(x[5:6], state, w), conv(x[6:], state, w)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(state, x[-3:].T)


def test_l2norm_twins_normalise_each_head_of_a_strided_slice():
    """The conv output's q columns, a slice with the row stride of all q|k|v channels."""
    conv = np.random.default_rng(3).normal(size=(5, 3 * 2 * 16)).astype(np.float32)
    x = conv[:, :2 * 16].reshape(5, 2, 16)
    want = x / np.sqrt(np.sum(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + 1e-6)
    for l2norm in (dn.l2norm, dn.l2norm_ref):
        got = l2norm(x, 1e-6)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_imrope_leaves_the_extra_section_of_a_text_token_unrotated():
    """llama.cpp's ggml_mrope_cache_init with is_imrope: Qwen3.5's [11, 11, 10, 0] rotates all 32
    pairs; [1, 1, 1, 1] (the test file) takes the extra position 0 at sector 3."""
    assert imrope_text_rotated(64, (11, 11, 10, 0)).all()
    assert imrope_text_rotated(8, (1, 1, 1, 1)).tolist() == [True, True, True, False]


# ---- fidelity against llama.cpp -------------------------------------------------------------
def test_config_reads_the_layers_and_ssm_sizes(model):
    c = model.config
    assert c.recurrent_layers == (0, 1, 3) and c.attn_layers == (2,)
    assert (c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_head_dim, c.ssm_conv_kernel) == (
        N_K_HEADS, N_V_HEADS, SSM_HEAD_DIM, CONV_KERNEL)


@pytest.mark.parametrize("key, prefill", [("prefill", None), ("decode", PREFILL)])
def test_f32_logits_match_llamacpp_at_every_position(key, prefill, model, golden):
    """One 80-token batch (past the 64-token chunk), and 66 tokens then one a step."""
    ids = golden["ids"]
    ours = run_positions(model, ids, prefill or len(ids))
    ref = golden[key]
    assert relative(ours, ref).max() <= F32_RTOL, relative(ours, ref).max()
    assert (ours.argmax(1) == ref.argmax(1)).all()


def test_prefill_and_decode_paths_agree(model, golden):
    ids = golden["ids"]
    assert relative(run_positions(model, ids, len(ids)), run_positions(model, ids, 1)).max() <= TWO_PATHS_RTOL


def test_q8_mode_agrees_with_llamacpp_on_f32_weights_and_with_f32_on_q8_0(model, path, golden, tmp_path):
    ids = golden["ids"]
    q8 = run_positions(Llama.load(path, activations="q8"), ids, PREFILL)
    assert relative(q8, golden["decode"]).max() <= F32_RTOL
    quant = write_qwen35_file(tmp_path / "q8.gguf", qtype=T.Q8_0)
    f32 = run_positions(Llama.load(quant), ids[:20], 8)
    q8 = run_positions(Llama.load(quant, activations="q8"), ids[:20], 8)
    assert 0 < relative(q8, f32).max() < 0.05
    assert (q8.argmax(1) == f32.argmax(1)).mean() >= 0.9


def test_cache_holds_keys_for_attention_layers_only_and_a_fixed_state_per_recurrent_layer(model):
    c = model.config
    small, big = model.new_cache(10), model.new_cache(100)
    assert small.k.shape == (1, 10, c.n_kv_heads, c.head_dim)
    assert sorted(small.recurrent) == [0, 1, 3]
    state = (c.ssm_conv_dim * (CONV_KERNEL - 1) + N_V_HEADS * SSM_HEAD_DIM ** 2) * 4
    assert small.state_nbytes == big.state_nbytes == 3 * state
    assert small.bytes_per_token == 2 * c.kv_dim * 4
    assert big.nbytes - small.nbytes == 90 * small.bytes_per_token
    assert (c.kv_bytes_per_token, c.state_bytes) == (small.bytes_per_token, small.state_nbytes)


def test_info_shows_memory_per_token_and_the_fixed_state(path, capsys):
    code, out, err = run(capsys, "info", "-m", path)
    assert code == 0, err
    text = " ".join(out.split())
    assert "memory per token 256 bytes" in text and "recurrent state 16,896 bytes, fixed" in text


# ---- stages --------------------------------------------------------------------------------
def test_trace_emits_deltanet_stages_on_recurrent_layers_and_gated_attention_elsewhere(model):
    c = model.config
    ids = np.arange(3, 9)
    rec = Recorder(stats=True, keep_arrays=True)
    cache = model.new_cache(len(ids) + 1)
    model.forward(ids, 0, cache, recorder=rec)
    model.forward(ids[:1], len(ids), cache, recorder=rec)
    got = [(e.step, e.layer, e.stage) for e in rec.events]
    expected = []
    for step, seq_len in ((0, len(ids)), (1, 1)):
        applies = [s for s in STAGES if stage_applies(s, seq_len, c.n_rep, c.features)]
        expected += [(step, None, s.id) for s in applies if s.level == "model" and s.group == "input"]
        for layer in range(c.n_layers):
            expected += [(step, layer, s.id) for s in STAGES if s.level == "layer" and stage_applies(
                s, seq_len, c.n_rep, c.features, recurrent=c.is_recurrent(layer))]
        expected += [(step, None, s.id) for s in applies if s.level == "model" and s.group == "output"]
    assert got == expected
    by_key = {e.key: e for e in rec.events}
    assert {"step0.layer2.Qcur_full", "step0.layer2.gate_sigmoid", "step0.layer2.attn_gated",
            "step0.layer0.linear_attn_qkv_mixed", "step1.layer3.new_state"} <= set(by_key)
    for e in rec.events:                                   # every event's shape is its formula's
        assert len(e.shape) >= 1
    # the state a decode step starts from is the one the prefill left
    np.testing.assert_array_equal(by_key["step1.layer0.state_predelta"].array, by_key["step0.layer0.new_state"].array)
    assert by_key["step0.layer1.new_state"].shape == [N_V_HEADS, SSM_HEAD_DIM, SSM_HEAD_DIM]
    gate = by_key["step0.layer0.gate"].array
    assert (gate < 0).all() and np.exp(gate).min() < 0.9    # a real decay
    # the state's stages report each head's norm and top singular value
    state = by_key["step1.layer3.new_state"]
    np.testing.assert_allclose(state.stats["head_norm"], [np.linalg.norm(h) for h in state.array], rtol=1e-6)
    np.testing.assert_allclose(state.stats["head_top_singular"],
                               [np.linalg.svd(h, compute_uv=False)[0] for h in state.array], rtol=1e-5)


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, needle", [
    (dict(meta={"attention.recurrent_layers": [True, False, True]}), "qwen35.attention.recurrent_layers"),
    (dict(meta={"ssm.inner_size": 60}), "qwen35.ssm.inner_size"),
    (dict(meta={"ssm.group_count": None}), "qwen35.ssm.group_count"),
    (dict(shapes={"blk.1.ssm_conv1d.weight": (128, 3)}), "blk.1.ssm_conv1d.weight"),
    (dict(shapes={"blk.0.ssm_beta.weight": (3, 64)}), "blk.0.ssm_beta.weight"),
    (dict(skip_tensors=("blk.3.ssm_a",)), "blk.3.ssm_a"),
    (dict(skip_tensors=("blk.0.ssm_norm.weight",)), "blk.0.ssm_norm.weight"),
])
def test_bad_qwen35_files_are_one_error_line_naming_the_key_or_tensor(kwargs, needle, tmp_path, capsys):
    path = write_qwen35_file(tmp_path / "broken.gguf", **kwargs)
    with pytest.raises(ModelFormatError, match=needle):
        Llama.load(path, cache=False)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), needle)


def test_an_explicit_recurrent_layer_list_overrides_the_interval(tmp_path):
    path = write_qwen35_file(tmp_path / "flags.gguf", meta={"attention.recurrent_layers": [True, True, False, True]})
    assert Llama.load(path, cache=False).config.recurrent_layers == (0, 1, 3)


# ---- the commands --------------------------------------------------------------------------
@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_generate_and_trace_run_on_qwen35(activations, path, tmp_path, capsys):
    code, out, err = run(capsys, "generate", "-m", path, "--raw", "the cat", "-n", "3", "--json",
                         "--activations", activations)
    assert code == 0, err
    assert len(json.loads(out)["ids"]) >= 1
    jl = tmp_path / "t.jsonl"
    code, out, err = run(capsys, "trace", "-m", path, "--raw", "--tokens", "2", "--jsonl", jl,
                         "--activations", activations, "the cat sat")
    assert code == 0, err
    stages = {json.loads(line).get("stage") for line in jl.read_text().splitlines() if line.strip()}
    assert {"linear_attn_qkv_mixed", "new_state", "attn_gated", "l_out", "result_output"} <= stages
    assert N_LAYERS == 4


def test_mtp_blocks_are_counted_in_block_count_but_not_run(model, golden, tmp_path):
    """``nextn_predict_layers`` blocks follow the trunk (llama.cpp loads them for speculative
    decoding and never runs them in the main pass): the trunk's logits are unchanged."""
    path = write_qwen35_file(tmp_path / "mtp.gguf", meta={"block_count": N_LAYERS + 1, "nextn_predict_layers": 1})
    mtp = Llama.load(path, cache=False)
    assert mtp.config.n_layers == N_LAYERS and mtp.config.n_mtp_layers == 1
    assert mtp.config.recurrent_layers == model.config.recurrent_layers
    ids = golden["ids"][:12]
    np.testing.assert_array_equal(run_positions(mtp, ids, 12), run_positions(model, ids, 12))


def test_the_mtp_blocks_tensors_are_left_unread_and_accepted(model, golden, tmp_path):
    """A published file carries the MTP block's tensors (``blk.{n_layers}.nextn.*``, its own norms
    and projections): not read, and not refused as leftovers; a stray tensor in a trunk block is."""
    path = write_qwen35_file(tmp_path / "mtp.gguf", meta={"block_count": N_LAYERS + 1, "nextn_predict_layers": 1})
    mtp_tensors = {f"blk.{N_LAYERS}.{name}": np.ones(DIM) for name in
                   ("nextn.enorm.weight", "nextn.hnorm.weight", "attn_norm.weight", "nextn.shared_head_norm.weight")}
    with_mtp = rewrite_metadata(path, tmp_path / "with-mtp.gguf", {}, extra_tensors=mtp_tensors)
    mtp = Llama.load(with_mtp, cache=False)
    assert not set(mtp_tensors) & mtp.file.read
    ids = golden["ids"][:12]
    np.testing.assert_array_equal(run_positions(mtp, ids, 12), run_positions(model, ids, 12))
    stray = rewrite_metadata(path, tmp_path / "stray.gguf", {},
                             extra_tensors={f"blk.{N_LAYERS - 1}.attn_norm.bias": np.ones(DIM)})
    with pytest.raises(UnsupportedModelError, match=f"'blk.{N_LAYERS - 1}.attn_norm.bias' is not part of the qwen35"):
        Llama.load(stray, cache=False)


def test_compare_pairs_the_new_stages_with_llamacpp_and_finds_no_divergence(model, golden):
    """llama.cpp's graph tensors on 7 prompt tokens and one decode step (captured by
    make_qwen35_golden.py, replayed here) through ``compare --against llama.cpp``'s pairing."""
    from llamatrace.analysis.compare import compare_arrays, llamacpp_stage_arrays
    from llamatrace.peers.llamacpp import Captured
    from llamatrace.tracing.recorder import stage_key
    with np.load(GOLDEN / "qwen35_llamacpp_stages.npz") as z:
        keys = sorted(z.files, key=lambda k: tuple(int(x) for x in k.split("|")[:2]))
        captured = [(int(k.split("|")[0]), Captured(*k.split("|")[2:], z[k])) for k in keys]
    ids = golden["ids"][:8]
    ref = {}
    for step, (start, n) in enumerate(((0, 7), (7, 1))):
        ref |= llamacpp_stage_arrays([c for s, c in captured if s == step], step, start, n, model.config)
    rec = Recorder(keep_arrays=True)
    cache = model.new_cache(8)
    model.forward(ids[:7], 0, cache, recorder=rec, all_logits=True)
    model.forward(ids[7:], 7, cache, recorder=rec, all_logits=True)
    ours = rec.arrays()
    result = compare_arrays(ours, ref)
    paired = {(r.layer, r.stage) for r in result.rows if r.status == "ok"}
    assert result.first_divergence is None, result.first_divergence
    for layer in (0, 1, 3):
        assert {(layer, s) for s in ("z", "beta_sigmoid", "a_softplus", "gate", "conv_output_silu", "q_conv_predelta",
                                     "k_conv_predelta", "linear_attn_out", "ffn_inp", "ffn_norm")} <= paired
    assert {(2, s) for s in ("Qcur_full", "Qcur_normed", "kqv_out", "gate_sigmoid", "attn_gated", "attn_out")} <= paired
    assert stage_key(1, 0, "gate") in ref                  # the decode step paired too


def test_run_with_cache_serves_linear_attn_hooks_on_recurrent_layers(model):
    """HF's module names (``linear_attn``) on the DeltaNet layers, TL's ``attn.*`` on the others;
    a hook on β changes the logits, and the state is served in llama.cpp's layout."""
    from llamatrace.errors import OptionError
    ids = [5, 6, 7, 8, 9]
    logits, cache = model.run_with_cache(ids)
    np.testing.assert_array_equal(logits[0], model.forward(np.array(ids), 0, model.new_cache(5), all_logits=True))
    assert cache["blocks.0.linear_attn.hook_state"].shape == (1, N_V_HEADS, SSM_HEAD_DIM, SSM_HEAD_DIM)
    assert cache["blocks.1.linear_attn.hook_q"].shape == (1, 5, N_K_HEADS, SSM_HEAD_DIM)
    assert cache["blocks.2.attn.hook_q"].shape == (1, 5, 4, 16)
    assert "blocks.2.linear_attn.hook_q" not in cache and "blocks.0.attn.hook_q" not in cache
    with pytest.raises(OptionError, match="layer 0 is a gated DeltaNet layer"):
        model.run_with_cache(ids, names_filter="blocks.0.attn.hook_q")
    beta = cache["blocks.1.linear_attn.hook_beta"]
    same = model.run_with_hooks(ids, fwd_hooks=[("blocks.1.linear_attn.hook_beta", lambda a, hook: beta)])
    np.testing.assert_array_equal(same, logits)
    zero = model.run_with_hooks(ids, fwd_hooks=[("blocks.1.linear_attn.hook_beta", lambda a, hook: 0 * a)])
    assert np.abs(zero - logits).max() > 1e-3          # no write at layer 1: a different answer


@pytest.mark.parametrize("layer", [0, 2])
def test_diagram_draws_the_deltanet_block_on_recurrent_layers_and_gated_attention_elsewhere(layer, model, tmp_path,
                                                                                             capsys):
    from llamatrace.tracing.stages import STAGE_BY_ID
    from llamatrace.views.diagram.flow import trace_step, wire
    events, _ = trace_step(model, "x", list(range(3, 9)), chat=False, layer=layer)
    by_id = {}
    for e in events:
        if e.layer in (None, layer):
            by_id.setdefault(e.stage, e)
    drawn = [STAGE_BY_ID[s] for s in by_id if STAGE_BY_ID[s].group != "output"]
    edges = {(a, b) for a, b, _, _ in wire(drawn, by_id, "block").edges}
    if layer == 0:
        assert {("conv_output_silu", "q_conv_predelta"), ("state_predelta", "attn_output"),
                ("attn_output", "new_state"), ("z", "final_output"), ("linear_attn_out", "ffn_inp")} <= edges
        assert "Qcur" not in by_id and "cache_k" not in by_id
    else:
        assert {("Qcur_full", "Qcur"), ("Qcur_full", "gate_sigmoid"), ("gate_sigmoid", "attn_gated"),
                ("attn_out", "ffn_inp")} <= edges
        assert "linear_attn_qkv_mixed" not in by_id
    dot = tmp_path / "d.dot"
    code, out, err = run(capsys, "diagram", "-m", model.path, "--raw", "the cat", "--layer", layer, "-o", dot)
    assert code == 0, err
    text = dot.read_text()
    assert "gated DeltaNet (linear attention) on layers 0, 1, 3; softmax attention on layers 2" in text
    assert ("Gated DeltaNet sub-layer" in text) == (layer == 0)


def test_perplexity_stages_attributes_the_deltanet_stages(path, tmp_path, capsys):
    """``--stages`` between the Q8_0 file and the F32 base: each layer fills its own kind's columns."""
    quant = write_qwen35_file(tmp_path / "q8.gguf", qtype=T.Q8_0)
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 4)
    code, out, err = run(capsys, "perplexity", "-m", quant, "-f", text, "--ctx-size", 32, "--base", path, "--stages")
    assert code == 0, err
    table = out + err
    assert "linear_attn_out" in table and "attn_gated" in table
    assert "ffn_inp               not recomputed" not in table        # recomputed from linear_attn_out too


def test_attention_on_a_deltanet_layer_is_one_error_line_naming_the_attention_layers(path, tmp_path, capsys):
    assert_one_line_error(*run(capsys, "attention", "-m", path, "--raw", "the cat sat", "--layer", 0,
                               "-o", tmp_path / "a.png"), "--layer 0 is a gated DeltaNet layer", "are 2")
    code, out, err = run(capsys, "attention", "-m", path, "--raw", "the cat sat", "--layer", 2, "-o", tmp_path / "a.png")
    assert code == 0, err


def test_collect_writes_deltanet_hooks_per_token(path, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 2)
    code, out, err = run(capsys, "collect", "-m", path, "-f", text, "--ctx-size", 16, "-o", tmp_path / "acts",
                         "--hook", "blocks.0.linear_attn.hook_q", "--hook", "blocks.1.linear_attn.hook_beta")
    assert code == 0, err
    import pyarrow.parquet as pq
    table = pq.read_table(next((tmp_path / "acts" / "data").glob("*.parquet")))
    assert {"blocks.0.linear_attn.hook_q", "blocks.1.linear_attn.hook_beta"} <= set(table.column_names)
    assert len(table.column("blocks.0.linear_attn.hook_q")[0].as_py()) == N_K_HEADS * SSM_HEAD_DIM


def test_state_view_writes_are_the_state_change_beyond_the_decay(model, path, tmp_path, capsys):
    """``llamatrace state``: token t's write ‖β·k·(v − Sᵀk)‖ is ‖S_t − exp(g_t)·S_{t−1}‖ of the
    rule written out (float64), the decay exp(g_t) is the gate stage's, and a hook that zeroes β
    zeroes every write."""
    from llamatrace.analysis.look import state_writes
    ids = [119, 260, 268, 35, 118, 267, 40, 50]
    rec = Recorder(layers=[1], keep_arrays=True)
    model.forward(np.array(ids), 0, model.new_cache(len(ids)), recorder=rec)
    a = {e.stage: e.array for e in rec.events}
    states = [a["state_predelta"].astype(np.float64)]
    for t in range(len(ids)):
        _, s = dn.delta_rule_naive(*(a[n][t:t + 1] for n in ("q_conv_predelta", "k_conv_predelta", "v_conv_predelta",
                                                            "gate", "beta_sigmoid")), states[-1])
        states.append(s)
    sw = state_writes(model, ids, 1)
    for t in range(len(ids)):
        change = states[t + 1] - np.exp(a["gate"][t])[:, None, None] * states[t]
        np.testing.assert_allclose(sw.write[:, t], np.linalg.norm(change, axis=(1, 2)), rtol=1e-4)
        np.testing.assert_allclose(sw.state_norm[:, t], np.linalg.norm(states[t + 1], axis=(1, 2)), rtol=1e-4)
    np.testing.assert_allclose(sw.decay, np.exp(a["gate"]).T, rtol=1e-6)
    with model.hooks({"beta_sigmoid": lambda x, event: np.zeros_like(x)}, layers=[1]):
        assert not state_writes(model, ids, 1).write.any()
    png = tmp_path / "state.png"
    code, out, err = run(capsys, "state", "-m", path, "--raw", "the cat sat", "--layer", 3, "-o", png, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert png.stat().st_size > 0 and len(got["heads"]) == N_V_HEADS and got["heads"][3]["key_head"] == 1
    assert_one_line_error(*run(capsys, "state", "-m", path, "--raw", "the cat", "--layer", 2, "--json"),
                          "--layer '2' is a softmax attention layer, with no recurrent state", "are 0, 1, 3")
    assert_one_line_error(*run(capsys, "state", "-m", path, "--raw", "the cat", "--layer", "0-1", "--json"),
                          "state shows one layer; give one of its gated DeltaNet layers (0, 1, 3)")
    assert_one_line_error(*run(capsys, "state", "-m", path, "--raw", "the cat", "--layer", 9, "--json"),
                          "valid are 0-3 (or -1 for the last)")          # no 'or all': state shows one layer


DELTANET_LOCAL = ("linear_attn_qkv_mixed", "z", "beta_sigmoid", "a_softplus", "gate", "conv_output_silu",
                  "q_conv_predelta", "k_conv_predelta", "v_conv_predelta", "attn_output", "new_state",
                  "final_output", "linear_attn_out")
GATED_ATTENTION_LOCAL = ("Qcur_full", "Qcur", "gate_sigmoid", "attn_gated", "attn_out")


def test_local_errors_recompute_the_deltanet_and_gated_attention_stages_of_a_recording(model):
    """Recomputed from a recording's own inputs (the conv state rebuilt from the earlier steps'
    rows, the delta rule from the recorded state), each stage is what the forward pass wrote,
    in the chunked prefill and in the recurrent decode steps."""
    from llamatrace.analysis.local_error import local_errors, not_recomputed
    assert not [s for s in DELTANET_LOCAL + GATED_ATTENTION_LOCAL if not_recomputed(s, model.config)]
    cache = model.new_cache(12)
    with model.trace(keep_arrays=True) as rec:
        model.forward(np.arange(3, 12), 0, cache)
        model.forward(np.array([12]), 9, cache)
        model.forward(np.array([13]), 10, cache)
    errors = local_errors(model, rec.arrays())
    for step in (0, 1, 2):
        for layer in range(N_LAYERS):
            stages = DELTANET_LOCAL if model.config.is_recurrent(layer) else GATED_ATTENTION_LOCAL
            for stage in stages + ("ffn_inp", "l_out"):
                assert errors[f"step{step}.layer{layer}.{stage}"] < 1e-6, (stage, step, layer)


def test_local_errors_recompute_llamacpps_own_deltanet_stages(model):
    """From llama.cpp's graph tensors (7 prompt tokens, then a decode step whose conv state is the
    prompt's last rows): each stage recomputed from llama.cpp's own inputs is what llama.cpp computed."""
    from llamatrace.analysis.compare import llamacpp_stage_arrays
    from llamatrace.analysis.local_error import local_errors
    from llamatrace.peers.llamacpp import Captured
    with np.load(GOLDEN / "qwen35_llamacpp_stages.npz") as z:
        keys = sorted(z.files, key=lambda k: tuple(int(x) for x in k.split("|")[:2]))
        captured = [(int(k.split("|")[0]), Captured(*k.split("|")[2:], z[k])) for k in keys]
    ref = {}
    for step, (start, n) in enumerate(((0, 7), (7, 1))):
        ref |= llamacpp_stage_arrays([c for s, c in captured if s == step], step, start, n, model.config)
    errors = local_errors(model, ref)
    want = {"z", "beta_sigmoid", "a_softplus", "gate", "q_conv_predelta", "k_conv_predelta",
            "gate_sigmoid", "attn_gated"}
    got = {key.split(".", 2)[2] for key in errors}
    assert want <= got, want - got
    for key, err in errors.items():
        assert err < 1e-5, (key, err)
