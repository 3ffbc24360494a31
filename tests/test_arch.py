"""The non-Llama architectures (qwen2, qwen3, phi3, gemma2, gemma3) against llama.cpp.

The random-weight files are written at test time by ``tests/arch_files.py``; llama.cpp's
float32 logits on the same files (same seed, so the same bytes) are in
``tests/golden/arch_llamacpp.npz``, made by ``tests/golden/make_arch_golden.py``. The new
kernels (NeoX rotary, window mask, GELU, soft-cap) are checked against formulas written here
independently, from llama.cpp's and HF's definitions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from arch_files import ARCHS, T, WINDOW, golden_arrays, relative, run_positions, write_arch_file
from cli_helpers import assert_one_line_error, run
from gguf_factory import write_tiny_llama

from llamatrace.errors import ModelFormatError, UnsupportedModelError
from llamatrace.kernels.ops import fp32 as kernels
from llamatrace.model.config import SUPPORTED_ARCHITECTURES
from llamatrace.model.llama import Llama
from llamatrace.tracing.recorder import Recorder
from llamatrace.tracing.stages import STAGES, stage_applies

GOLDEN = Path(__file__).parent / "golden"
PREFILL = 4                  # make_arch_golden.py's decode run: 4 tokens in one batch, then one a step
F32_RTOL = 1e-4              # relative L2 distance per position, the bar
# f32 mode's GELU is the exact tanh formula (HF's); llama.cpp's CPU GELU reads an fp16 table (about
# 1e-3 per element), which alone moves Gemma's logits by up to 1.4e-4 (measured: gemma2 9.3e-5,
# gemma3 1.38e-4; with the table, 2e-7 and 1e-6: test_llamacpp_arithmetic_matches_to_1e_5).
GELU_TABLE_RTOL = 3e-4
LLAMACPP_ARITHMETIC_RTOL = 1e-5


def f32_rtol(arch: str) -> float:
    return GELU_TABLE_RTOL if arch.startswith("gemma") else F32_RTOL


@pytest.fixture(scope="module")
def llamacpp():
    return golden_arrays("arch_llamacpp.npz")


@pytest.fixture(scope="module")
def arch_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("arch")
    return {a: write_arch_file(d / f"tiny-{a}.gguf", a) for a in ARCHS}


@pytest.fixture(scope="module")
def models(arch_paths):
    return {a: Llama.load(p) for a, p in arch_paths.items()}



# ---- fidelity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_f32_prefill_matches_llamacpp_at_every_position(arch, models, llamacpp):
    ids = llamacpp[f"{arch}_ids"]
    assert len(ids) > 3 * WINDOW                          # the window bites on the local layers
    ours = run_positions(models[arch], ids, len(ids))
    ref = llamacpp[f"{arch}_prefill"]
    assert relative(ours, ref).max() <= f32_rtol(arch), relative(ours, ref)
    assert (ours.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_decode_steps_match_llamacpp(arch, models, llamacpp):
    """Single-token steps past the window: the window mask of a decode step, the local rope base."""
    ids = llamacpp[f"{arch}_ids"]
    ours = run_positions(models[arch], ids, PREFILL)
    ref = llamacpp[f"{arch}_decode"]
    assert relative(ours, ref).max() <= f32_rtol(arch), relative(ours, ref)
    assert (ours.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_llamacpp_arithmetic_matches_to_1e_5(arch, arch_paths, llamacpp):
    """The q8 mode on F32 weights: float32 matmuls (q8 quantizes activations only for quantized
    weights) with llama.cpp's fp16-table GELU — the whole Gemma gap of the f32 mode is that table."""
    model = Llama.load(arch_paths[arch], activations="q8")
    ids = llamacpp[f"{arch}_ids"]
    for prefill, key in ((len(ids), "prefill"), (PREFILL, "decode")):
        ours = run_positions(model, ids, prefill)
        ref = llamacpp[f"{arch}_{key}"]
        assert relative(ours, ref).max() <= LLAMACPP_ARITHMETIC_RTOL, (key, relative(ours, ref))
        assert (ours.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_mode_agrees_with_f32_on_q8_0_weights(arch, tmp_path):
    path = write_arch_file(tmp_path / f"q8-{arch}.gguf", arch, qtype=T.Q8_0)
    ids = np.random.default_rng(1).integers(3, 269, size=16)
    f32 = run_positions(Llama.load(path), ids, PREFILL)
    q8 = run_positions(Llama.load(path, activations="q8"), ids, PREFILL)
    rel = relative(q8, f32)
    assert 0 < rel.max() < 0.05, rel                     # 8-bit activations: close, not equal
    assert (q8.argmax(1) == f32.argmax(1)).mean() >= 0.9


# What transformers 5.24's GGUF loader leaves at HF's config defaults instead of reading the file:
# Gemma's query_pre_attn_scalar (256, so queries scale by 1/16 whatever the head_dim) and Gemma 2's
# soft-caps (attn_logit_softcapping / final_logit_softcapping: 50 / 30). llama.cpp uses 1/√head_dim
# and the file's caps. With HF's values put into our config, HF and we agree to ~3e-7.
HF_LOADER_DEFAULTS = {"gemma2": dict(attn_scale=1 / 16, attn_softcap=50.0, final_softcap=30.0),
                      "gemma3": dict(attn_scale=1 / 16)}


@pytest.mark.parametrize("arch", ["qwen2", "phi3", "gemma2", "gemma3"])
def test_hf_fp32_logits_match_where_hf_loads_the_file(arch, arch_paths, llamacpp):
    """HF's fp32 forward on the same file (qwen3's head_dim HF's loader gets wrong: not loaded).
    Gemma runs with the values HF's loader assumes (HF_LOADER_DEFAULTS), which also checks our
    exact-GELU f32 path against HF's gelu_pytorch_tanh."""
    import dataclasses
    with np.load(GOLDEN / "arch_hf.npz") as hf:
        ref = hf[f"{arch}_prefill"]
    model = Llama.load(arch_paths[arch])
    model.config = dataclasses.replace(model.config, **HF_LOADER_DEFAULTS.get(arch, {}))
    ids = llamacpp[f"{arch}_ids"]
    ours = run_positions(model, ids, len(ids))
    assert relative(ours, ref).max() <= 1e-5, relative(ours, ref)
    assert (ours.argmax(1) == ref.argmax(1)).all()


# ---- the catalogue: each architecture's own stages, only where it has them -------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_trace_emits_the_architecture_stages_the_catalogue_declares(arch, models):
    model = models[arch]
    c = model.config
    ids = np.arange(3, 3 + 2 * WINDOW)
    rec = Recorder()
    cache = model.new_cache(len(ids) + 1)
    model.forward(ids, 0, cache, recorder=rec)
    model.forward(ids[:1], len(ids), cache, recorder=rec)
    got = [(e.step, e.layer, e.stage) for e in rec.events]
    expected = []
    for step, seq_len in ((0, len(ids)), (1, 1)):
        applies = [s for s in STAGES if stage_applies(s, seq_len, c.n_rep, c.features)]
        expected += [(step, None, s.id) for s in applies if s.level == "model" and s.group == "input"]
        for layer in range(c.n_layers):
            expected += [(step, layer, s.id) for s in STAGES if s.level == "layer"
                         and stage_applies(s, seq_len, c.n_rep, c.features, local=c.is_local(layer))]
        expected += [(step, None, s.id) for s in applies if s.level == "model" and s.group == "output"]
    assert got == expected
    stages = {e.stage for e in rec.events}
    wanted = {"qwen2": {"Qcur_b", "Kcur_b", "Vcur_b"}, "qwen3": {"Qcur_normed", "Kcur_normed"}, "phi3": set(),
              "gemma2": {"inp_scaled", "kq_mask_swa", "kq_softcap", "attn_post_norm", "ffn_gelu", "ffn_geglu",
                         "ffn_post_norm", "result_softcap"},
              "gemma3": {"inp_scaled", "kq_mask_swa", "Qcur_normed", "attn_post_norm", "ffn_geglu"}}[arch]
    assert wanted <= stages
    assert ("ffn_silu" in stages) == (c.ffn_act == "silu")


def test_gemma3_window_is_masked_on_local_layers_only(models):
    """Layer 5 of 7 is global (pattern 6): its decode step sees every key; the others only the last WINDOW."""
    model = models["gemma3"]
    assert model.config.local_layers == (0, 1, 2, 3, 4, 6)
    ids = np.arange(3, 3 + 3 * WINDOW)
    rec = Recorder(stages=["kq_soft_max"], keep_arrays=True)
    cache = model.new_cache(len(ids) + 1)
    model.forward(ids, 0, cache)
    model.forward(ids[:1], len(ids), cache, recorder=rec)
    seen = {e.layer: e.array for e in rec.events}
    for layer, p in seen.items():                          # [n_heads, 1, kv_len]
        visible = (p[:, 0, :] > 0).any(axis=0)
        n = int(visible.sum())
        assert n == (len(ids) + 1 if layer == 5 else WINDOW), (layer, n)


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["mamba", "phimoe"])
def test_unsupported_architecture_is_one_error_line_naming_it_and_the_list(arch, tmp_path, capsys):
    path = write_tiny_llama(tmp_path / f"{arch}.gguf", arch=arch)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"),
                          repr(arch), *SUPPORTED_ARCHITECTURES)
    with pytest.raises(UnsupportedModelError):
        Llama.load(path)


@pytest.mark.parametrize("arch, tensor", [("qwen2", "blk.1.attn_k.bias"), ("qwen3", "blk.0.attn_q_norm.weight"),
                                          ("phi3", "blk.1.attn_qkv.weight"),
                                          ("gemma2", "blk.2.post_ffw_norm.weight"),
                                          ("gemma3", "blk.0.post_attention_norm.weight")])
def test_a_missing_architecture_tensor_is_named(arch, tensor, tmp_path, capsys):
    path = write_arch_file(tmp_path / f"broken-{arch}.gguf", arch, skip_tensors=(tensor,))
    with pytest.raises(ModelFormatError, match=tensor):
        Llama.load(path)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), tensor)


def test_phi3s_fused_weights_are_drawn_and_traced_as_the_file_holds_them(arch_paths, tmp_path, capsys):
    """q, k, v read from attn_qkv and gate from ffn_up: once drawn as 'blk.0.attn_q.weight ? []' and traced as
    'attn_wq weights shape([?])', tensors the file does not have; then traced with attn_qkv's whole shape
    ([192 64]) for each of q, k and v. Each line now gives the rows its projection uses."""
    dot = tmp_path / "phi3.dot"
    code, out, err = run(capsys, "diagram", "-m", arch_paths["phi3"], "--raw", "hi", "--view", "block", "-o", dot)
    assert code == 0, err
    text = dot.read_text()
    assert "blk.0.attn_qkv.weight" in text and "blk.0.attn_q.weight" not in text and "?" not in text
    code, out, err = run(capsys, "trace", "-m", arch_paths["phi3"], "--raw", "--layer", "0", "--dump-shapes", "hi")
    assert code == 0, err
    assert "shape([?])" not in out and "attn_wk weights shape([" in out
    assert "attn_wq weights shape([64 64]) -> tensor xq" in out and "attn_wv weights shape([64 64])" in out
    assert "ffn_gate weights shape([96 64])" in out and "ffn_up weights shape([96 64])" in out


# ---- the CLI on every architecture ------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_generate_and_trace_run_on_each_architecture(arch, activations, arch_paths, tmp_path, capsys):
    code, out, err = run(capsys, "generate", "-m", arch_paths[arch], "--raw", "the cat", "-n", "3", "--json",
                         "--activations", activations)
    assert code == 0, err
    assert len(json.loads(out)["ids"]) >= 1
    jl = tmp_path / "t.jsonl"
    code, out, err = run(capsys, "trace", "-m", arch_paths[arch], "--raw", "--tokens", "2", "--jsonl", jl,
                         "--activations", activations, "the cat sat")
    assert code == 0, err
    records = [json.loads(line) for line in jl.read_text().splitlines() if line.strip()]
    stages = {r["stage"] for r in records if "stage" in r}   # the header line has no stage
    assert "l_out" in stages and "result_output" in stages


# ---- kernels against independent formulas -----------------------------------------------------
def test_rope_neox_is_pair_rope_on_the_de_interleaved_layout():
    """NeoX halves == adjacent pairs after moving dim i and i+half next to each other (the
    permutation llama.cpp's converter applies to Llama's Q/K)."""
    rng = np.random.default_rng(0)
    seq, heads, hd, rot = 3, 2, 16, 12                 # partial rotary: the last 4 dims untouched
    x = rng.normal(size=(seq, heads, hd)).astype(np.float32)
    freqs = kernels.precompute_freqs_cis(kernels.rope_frequencies(rot, 10000.0), 5, seq)
    cos, sin = np.ascontiguousarray(freqs.real), np.ascontiguousarray(freqs.imag)
    half = rot // 2
    perm = np.concatenate([np.stack([np.arange(half), np.arange(half) + half], 1).ravel(), np.arange(rot, hd)])
    via_pairs = np.empty_like(x)
    via_pairs[..., perm] = kernels.rope(np.ascontiguousarray(x[..., perm]), cos, sin)
    np.testing.assert_allclose(kernels.rope_neox(x, cos, sin), via_pairs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(kernels.rope_neox_ref(x, freqs), via_pairs, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(kernels.rope_neox(x, cos, sin)[..., rot:], x[..., rot:])


@pytest.mark.parametrize("start_pos, seq_len", [(0, 9), (7, 1), (3, 4)])
def test_window_mask_is_llamacpp_is_masked_swa(start_pos, seq_len):
    got = kernels.window_mask(seq_len, start_pos, WINDOW)
    for r in range(seq_len):
        i = start_pos + r
        for p in range(start_pos + seq_len):
            masked = p > i or i - p >= WINDOW             # llama_hparams::is_masked_swa, STANDARD
            assert got[r, p] == (-np.inf if masked else 0.0), (i, p)


def test_gelu_and_softcap_follow_their_formulas():
    x = np.linspace(-12, 12, 97, dtype=np.float32)
    gelu = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in x.tolist()]
    np.testing.assert_allclose(kernels.gelu(x), gelu, rtol=2e-6, atol=1e-6)   # float32 1 + tanh near -1
    np.testing.assert_allclose(kernels.softcap(x, 3.0), [3.0 * math.tanh(v / 3.0) for v in x.tolist()],
                               rtol=2e-6, atol=1e-7)


def test_gelu_f16_table_is_ggml_gelu_fp16():
    """ggml-cpu's table: ggml_table_gelu_f16[i] = fp16(gelu(fp16→fp32 of i)); input rounded to fp16."""
    x = np.concatenate([np.linspace(-11, 11, 4001, dtype=np.float32), np.float32([-10, 10, 0.1234567])])
    want = []
    for v in x.tolist():
        if v <= -10:
            want.append(0.0)
        elif v >= 10:
            want.append(v)
        else:
            h = np.float32(np.float16(v))           # ggml_gelu_f32 in float32, as the table is built
            inner = np.float32(math.sqrt(2 / math.pi)) * h * (np.float32(1) + np.float32(0.044715) * h * h)
            g = np.float32(0.5) * h * (np.float32(1) + np.float32(math.tanh(inner)))
            want.append(float(np.float16(g)))
    got = kernels.gelu_f16_table(x)
    # tanhf and a float64 tanh rounded may differ by a float32 ulp: then by one fp16 ulp at most
    ulp = np.abs(np.spacing(np.float16(want))).astype(np.float32)
    assert (np.abs(got - np.float32(want)) <= ulp).all()
    assert np.abs(kernels.gelu_f16_table(x) - kernels.gelu(x)).max() > 1e-4     # not the exact formula


def test_a_llama_file_with_a_sliding_window_key_ignores_it_as_llamacpp_does(tmp_path):
    """Mistral 7B files are ``llama`` and may carry ``llama.attention.sliding_window``; llama.cpp's
    llama graph reads no window (src/models/llama.cpp), so the logits are those without the key."""
    plain = Llama.load(write_tiny_llama(tmp_path / "plain.gguf", qtype=T.F32))
    windowed = Llama.load(write_tiny_llama(tmp_path / "swa.gguf", qtype=T.F32,
                                           extra_kv={"llama.attention.sliding_window": 3}))
    assert windowed.file.metadata["llama.attention.sliding_window"] == 3
    assert windowed.config.sliding_window == 0 and not windowed.config.features
    ids = np.arange(3, 15)
    np.testing.assert_array_equal(run_positions(windowed, ids, 6), run_positions(plain, ids, 6))


def test_attention_maps_grey_out_the_window_on_local_layers(models):
    from llamatrace.analysis.look import attention
    model = models["gemma3"]
    ids = list(range(3, 3 + 3 * WINDOW))
    for layer, window in ((0, WINDOW), (5, 0)):
        maps = attention(model, ids, layer)
        i, p = np.meshgrid(np.arange(len(ids)), np.arange(len(ids)), indexing="ij")
        hidden = (p > i) | ((i - p >= WINDOW) if window else False)
        assert maps.window == window
        np.testing.assert_array_equal(maps.masked, hidden)
        assert (maps.probs[:, hidden] == 0).all() and (maps.probs[:, ~hidden] > 0).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_run_with_cache_serves_tl_names_in_the_architecture_layout(arch, models):
    model = models[arch]
    c = model.config
    ids = list(range(3, 3 + 2 * WINDOW))
    logits, cache = model.run_with_cache(ids)
    cache_ = model.new_cache(len(ids))
    np.testing.assert_array_equal(logits[0], model.forward(np.array(ids), 0, cache_, all_logits=True))
    rec = Recorder(layers=[0], stages=["Qcur", "Qcur_b", "Qcur_rope", "ffn_swiglu", "ffn_geglu"], keep_arrays=True)
    model.forward(np.array(ids), 0, model.new_cache(len(ids)), recorder=rec)
    got = {e.stage: e.array for e in rec.events}
    q = got["Qcur_b" if c.qkv_bias else "Qcur"].reshape(len(ids), c.n_heads, c.head_dim)
    # NeoX files hold q in HF's halves already: TL's hook_q / hook_rot_q are our arrays as they are
    np.testing.assert_array_equal(cache["blocks.0.attn.hook_q"][0], q)
    np.testing.assert_array_equal(cache["blocks.0.attn.hook_rot_q"][0], got["Qcur_rope"])
    np.testing.assert_array_equal(cache["blocks.0.mlp.hook_post"][0], got["ffn_geglu" if c.ffn_act == "gelu"
                                                                          else "ffn_swiglu"])


def test_perplexity_stages_compare_gemma3_own_stages_and_refuse_another_architecture(arch_paths, tmp_path, capsys):
    """``--stages`` on Gemma 3 (the same random weights as F32 and Q8_0): its own stages (q/k norms,
    post-norms, GeGLU) are columns too, with finite accumulated errors; a Qwen 3 base is refused."""
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 20, encoding="utf-8")
    gemma = arch_paths["gemma3"]
    quant = write_arch_file(tmp_path / "tiny-gemma3-q8_0.gguf", "gemma3", qtype=T.Q8_0)
    code, out, err = run(capsys, "perplexity", "-f", text, "-m", quant, "--base", gemma, "--ctx-size", "32",
                         "--chunks", "2", "--workers", "1", "--stages", "--json")
    assert code == 0, err
    a = json.loads(out)["attribution"]
    col = {s: k for k, s in enumerate(a["stages"])}
    assert {"Qcur_normed", "Kcur_normed", "attn_post_norm", "ffn_gelu", "ffn_geglu", "ffn_post_norm"} <= set(col)
    assert "ffn_swiglu" not in col and "ffn_silu" not in col
    median = np.array(a["median"])
    assert median.shape == (7, len(col)) and np.isfinite(median).all()
    for stage in ("ffn_geglu", "attn_post_norm", "ffn_post_norm", "l_out"):   # Q8_0 rounding reaches them
        assert (median[:, col[stage]] > 0).all(), stage
    # local: the quantized weights add error at the projections; a norm (F32 weights in both
    # files), GELU, GeGLU or an add recomputed from the base's inputs adds none; NeoX rotary is not recomputed
    local = np.array(a["local_median"], dtype=float)               # None (not recomputed) -> NaN
    for stage in ("Qcur", "ffn_up", "ffn_out"):
        assert (local[:, col[stage]] > 0).all(), stage
    for stage in ("Qcur_normed", "attn_post_norm", "ffn_inp", "ffn_gelu", "ffn_geglu", "ffn_post_norm", "l_out"):
        assert (local[:, col[stage]] == 0).all(), stage
    assert np.isnan(local[:, col["Qcur_rope"]]).all()
    picture = tmp_path / "where.png"                  # the table and the heat map take these columns too
    code, out, err = run(capsys, "perplexity", "-f", text, "-m", quant, "--base", gemma, "--ctx-size", "32",
                         "--chunks", "1", "--workers", "1", "--stages", "-o", picture)
    assert code == 0, err
    assert "Where the error enters" in out and "ffn_post_norm" in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_one_line_error(*run(capsys, "perplexity", "-f", text, "-m", gemma, "--base", arch_paths["qwen3"],
                               "--ctx-size", "32", "--workers", "1", "--stages"), "--stages",
                          "architecture qwen3 vs gemma3")


@pytest.mark.parametrize("arch", ARCHS)
def test_local_error_recomputes_each_architectures_own_stages_as_the_forward_pass(arch, models):
    """Each per-token stage recomputed from the model's own recorded inputs equals the forward
    pass's output (the pass itself is checked against llama.cpp and HF above): the biases, q/k
    norms, post-norms, GELU/GeGLU, the heads merge and the adds after post-norms too. Not
    recomputed: NeoX rotary, and the local notes say so."""
    from llamatrace.corpus.stage_errors import capture, local_error_rows, local_notes, token_stages
    model = models[arch]
    acts, embd, inputs, _ = capture(model, np.arange(3, 3 + 2 * WINDOW), 2)
    local, _ = local_error_rows(model, acts, embd, inputs, 2)      # [n_layers, n_stages, n_scored]
    stages = token_stages(model.config.features)
    notes = local_notes(model.config, stages)
    assert set(notes) == {"Qcur_rope", "Kcur_rope"}
    for k, stage in enumerate(stages):
        if stage in notes:
            assert np.isnan(local[:, k]).all(), stage
        else:
            assert (local[:, k] < 1e-6).all(), (stage, local[:, k].max())


@pytest.mark.parametrize("layer, mask", [(0, "kq_mask_swa"), (1, "kq_mask")])
def test_diagram_wires_gemma2_post_norms_geglu_and_the_layer_mask(layer, mask, models):
    """Gemma 2: layer 0 is local (window mask), layer 1 global (causal mask); the residual adds take
    the post-norms' outputs; the down projection takes the GeGLU product."""
    from llamatrace.tracing.stages import STAGE_BY_ID
    from llamatrace.views.diagram.flow import trace_step, wire
    model = models["gemma2"]
    ids = list(range(3, 9))
    events, run_info = trace_step(model, "x", ids, chat=False, layer=layer)
    by_id = {}
    for e in events:
        if e.layer in (None, layer):
            by_id.setdefault(e.stage, e)
    drawn = [STAGE_BY_ID[s] for s in by_id if STAGE_BY_ID[s].group != "output"]
    edges = {(a, b) for a, b, _, _ in wire(drawn, by_id, "block", local=model.config.is_local(layer)).edges}
    assert {(mask, "kq_masked"), ("attn_post_norm", "ffn_inp"), ("ffn_geglu", "ffn_out"),
            ("ffn_post_norm", "l_out"), ("kq_softcap", "kq_masked")} <= edges
    other = "kq_mask" if mask == "kq_mask_swa" else "kq_mask_swa"
    assert (other, "kq_masked") not in edges and ("attn_out", "ffn_inp") not in edges


@pytest.mark.skipif(__import__("importlib").util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_compare_against_llamacpp_finds_no_divergence_and_pairs_the_new_stages(arch, arch_paths, capsys):
    code, out, err = run(capsys, "compare", "--model", arch_paths[arch], "--raw", "the cat sat on the mat and",
                         "--tokens", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["first_divergence"] is None
    paired = {r["stage"] for r in report["rows"] if r["status"] == "ok"}
    wanted = {"qwen2": {"Qcur_b", "Kcur_b", "Vcur_b", "Qcur_heads"}, "qwen3": {"Qcur_normed", "Kcur_normed"},
              "phi3": {"Qcur_rope", "kq_scaled", "ffn_swiglu", "Qcur", "Kcur_heads", "Vcur_heads"},   # its wqkv split
              "gemma2": {"inp_scaled", "kq_scaled", "kq_softcap", "attn_post_norm", "ffn_geglu", "result_softcap"},
              "gemma3": {"inp_scaled", "Qcur_normed", "attn_post_norm", "ffn_post_norm", "ffn_geglu"}}[arch]
    assert wanted <= paired, wanted - paired


def test_a_sliding_window_layers_decode_lines_name_its_mask(arch_paths, capsys):
    """Gemma 2's local layers mask every step, decode too: the block and attention lines said
    'mask: shape([])' while the next lines made and added a [1 N] window mask."""
    import re
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    with open_gguf(arch_paths["gemma2"]) as f:
        c = ModelConfig.from_gguf(f)
    code, out, err = run(capsys, "trace", "-m", arch_paths["gemma2"], "--raw", "--tokens", "1", "--dump-shapes",
                         "--stage", "attn_norm", "ab cd ef gh")
    assert code == 0, err
    decode = [m.groups() for m in re.finditer(r"layer: (\d+) / \d+, startPos: ([1-9]\d*) .*?\n.*?mask: shape\((\[[^)]*\])\)",
                                              out)]
    assert len(decode) == c.n_layers
    for layer1, start, mask in decode:
        local = int(layer1) - 1 in c.local_layers
        assert (mask == f"[1 {int(start) + 1}]") if local else (mask == "[]"), (layer1, mask)
    assert any(int(layer1) - 1 in c.local_layers for layer1, _, _ in decode)
