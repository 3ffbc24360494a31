"""gpt-oss (llama.cpp's ``LLM_ARCH_OPENAI_MOE``) against llama.cpp.

The random-weight files are written at test time by ``tests/gptoss_files.py`` (same seed, same
bytes); llama.cpp's logits on them, and its tokens of a few strings with the file's ``gpt-4o``
pre-tokenizer, are in ``tests/golden/gptoss_llamacpp.npz``, made by
``tests/golden/make_gptoss_golden.py`` in the golden venv. The file with F32 experts is held to
llama.cpp's float32 logits; the one with MXFP4 experts, in the ``q8`` mode, to llama.cpp's own
arithmetic on it (Q8_0 activations before every MXFP4 matmul).
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest

from arch_files import golden_arrays, relative, run_positions
from cli_helpers import assert_one_line_error, run
from gptoss_files import (CHAT_MESSAGES, K, N_LAYERS, TOKENIZER_TEXTS, WINDOW, T, gptoss_chat_template,
                          write_gptoss_file)
from llamacpp_sdist import sdist_path

from llamatrace.analysis import compare as cmp
from llamatrace.errors import UnsupportedModelError
from llamatrace.model import moe
from llamatrace.model.llama import Llama
from llamatrace.text.chat import render_chat
from llamatrace.tracing.stages import STAGES, stage_applies
from llamatrace.views.render import LineFormatter
from llamatrace.text.tokenizer import Tokenizer
from llamatrace.gguf.reader import open_gguf

PREFILL = 4                  # make_gptoss_golden.py's decode run: 4 tokens in one batch, then one a step
RTOL = 1e-4                  # relative L2 distance per position, the bar
FILES = {"f32": (T.F32, "f32"), "mxfp4": (T.MXFP4, "q8")}       # file -> (experts' type, activation mode)


@pytest.fixture(scope="module")
def llamacpp():
    return golden_arrays("gptoss_llamacpp.npz")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss")
    return {name: write_gptoss_file(d / f"tiny-gpt-oss-{name}.gguf", experts=experts)
            for name, (experts, _) in FILES.items()}


@pytest.fixture(scope="module")
def models(paths):
    return {name: Llama.load(paths[name], activations=acts) for name, (_, acts) in FILES.items()}


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("phase, prefill", [("prefill", None), ("decode", PREFILL)])
def test_logits_match_llamacpp_at_every_position(name, phase, prefill, models, llamacpp):
    ids = llamacpp["ids"]
    assert len(ids) > 3 * WINDOW                       # the window bites on layers 0 and 2
    ours = run_positions(models[name], ids, prefill or len(ids))
    ref = llamacpp[f"{name}_{phase}"]
    assert relative(ours, ref).max() <= RTOL, relative(ours, ref)
    assert (ours.argmax(1) == ref.argmax(1)).all()


def test_the_file_exercises_every_gpt_oss_part(models, monkeypatch, llamacpp):
    """What the fidelity test would miss if the file were too tame: the window and YaRN are in
    play, the sinks are not zero, the clamps bite, and each token's k-th and (k+1)-th router logits
    are far apart (so routing cannot hang on rounding) and the routes differ between tokens."""
    m = models["f32"]
    c = m.config
    assert c.arch == "gpt-oss" and c.local_layers == (0, 2) and c.sliding_window == WINDOW
    assert c.rope_scaling.type == "yarn" and c.rope_scaling.n_ctx_orig < len(llamacpp["ids"])
    assert {"attn_sinks", "moe_bias", "swa", "qkv_bias"} <= c.features
    assert c.expert_gating == "softmax_weight" and c.expert_act == "swiglu_oai"
    assert all(np.abs(lw.sinks).min() > 0 for lw in m.weights.layers)
    logits, glu_inputs = [], []
    route, expert_glu = moe.routing.route, moe.routing.expert_glu

    def glu_seen(gate_up, act, bias=None, ids=None):     # the clamp's inputs: the biased gate and up halves
        biased = gate_up + (0 if bias is None else bias[np.asarray(ids).reshape(-1)])
        glu_inputs.append(np.split(biased, 2, axis=1))
        return expert_glu(gate_up, act, bias, ids)
    monkeypatch.setattr(moe.routing, "route", lambda lg, *a: logits.append(lg.copy()) or route(lg, *a))
    monkeypatch.setattr(moe.routing, "expert_glu", glu_seen)
    m.forward(llamacpp["ids"], 0, m.new_cache(len(llamacpp["ids"])))
    assert len(logits) == N_LAYERS
    for lg in logits:
        top = -np.sort(-lg, axis=1)
        assert (top[:, K - 1] - top[:, K] > 1e-2).all()
        assert len({tuple(sorted(r)) for r in np.argsort(-lg, axis=1)[:, :K]}) > 3
    assert max(np.abs(g).max() for g, _ in glu_inputs) > 7 and max(np.abs(u).max() for _, u in glu_inputs) > 7


def test_o200k_pre_tokenizer_gives_llamacpps_tokens(paths, llamacpp):
    tok = Tokenizer.from_reader(open_gguf(paths["f32"]), str(paths["f32"]))
    assert tok.pre == "o200k"
    offsets, want = llamacpp["tok_offsets"], llamacpp["tok_ids"]
    assert len(offsets) == len(TOKENIZER_TEXTS) + 1
    for i, text in enumerate(TOKENIZER_TEXTS):
        assert tok.encode(text, bos=False) == want[offsets[i]:offsets[i + 1]].tolist(), text


@pytest.mark.parametrize("tensor", ["blk.1.attn_sinks.weight", "blk.0.ffn_down_exps.bias", "blk.2.attn_output.bias",
                                    "blk.0.post_attention_norm.weight"])
def test_missing_gpt_oss_tensor_is_one_error_line_naming_it(tensor, tmp_path, capsys):
    path = write_gptoss_file(tmp_path / "broken.gguf", skip_tensors=(tensor,))
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), tensor)


def test_an_expert_activation_we_do_not_have_is_refused(models):
    with pytest.raises(UnsupportedModelError, match="activation 'gelu'.*silu, swiglu_oai"):
        dataclasses.replace(models["f32"].config, expert_act="gelu")


def test_gpt_oss_chat_template_renders_as_llama_cpp_python_does(llamacpp):
    # the published template (harmony format: system header, developer instructions, channels),
    # through our sandbox, against llama-cpp-python's own Jinja2ChatFormatter on the same messages
    template = gptoss_chat_template(sdist_path())
    parts = render_chat(template, CHAT_MESSAGES, bos_token="<|startoftext|>", eos_token="<|return|>")
    assert "".join(text for text, _ in parts) == str(llamacpp["chat"])
    assert [text for text, user in parts if user] == [m["content"] for m in CHAT_MESSAGES]


@pytest.mark.parametrize("name", FILES)
def test_recorded_stages_are_the_catalogues_and_leave_the_logits_bit_identical(name, models):
    """Traced, the experts' stages are assembled as [seq_len, k, ...] arrays; untraced, each expert's
    rows go from gate|up to down in one pass: the same numbers. Every stage recorded is one the
    catalogue says applies to gpt-oss, and every one it says applies is recorded."""
    model = models[name]
    c = model.config
    ids = np.arange(3, 13)
    plain = run_positions(model, ids, 6)
    with model.trace(keep_arrays=True) as rec:
        traced = run_positions(model, ids, 6)
    np.testing.assert_array_equal(plain, traced)
    first = [e for e in rec.events if e.step == rec.events[0].step]          # the 6-token prefill
    for layer in range(c.n_layers):
        got = {e.stage for e in first if e.layer == layer}
        want = {s.id for s in STAGES if s.level == "layer"
                and stage_applies(s, 6, c.n_rep, c.features, c.is_local(layer))}
        assert got == want, (layer, got ^ want)
        assert {"ffn_moe_logits_biased", "ffn_moe_weights_softmax", "ffn_moe_swiglu_oai"} <= got
    sinks = [e for e in first if e.stage == "kq_soft_max"]
    assert all((e.array.sum(-1) < 1 - 1e-3).any() for e in sinks)         # the sinks took their share
    # ffn_moe_probs is the logits themselves (llama.cpp's name for them): no softmax, and not called one
    probs = [e for e in first if e.stage == "ffn_moe_probs"]
    logits = [e for e in first if e.stage == "ffn_moe_logits_biased"]
    assert all(p.op == "Identity" and np.array_equal(p.array, q.array) for p, q in zip(probs, logits))
    lines = LineFormatter.for_model(model, 16).lines(probs[0])
    assert "no softmax" in lines[0] and "Softmax" not in lines[0], lines


def test_generate_and_trace_run_on_the_mxfp4_file_in_both_modes(paths, tmp_path, capsys):
    for acts in ("f32", "q8"):
        code, out, err = run(capsys, "generate", "-m", paths["mxfp4"], "--activations", acts, "--raw", "the cat",
                             "-n", "3", "--json")
        assert code == 0, err
        jl = tmp_path / f"t-{acts}.jsonl"
        code, out, err = run(capsys, "trace", "-m", paths["mxfp4"], "--activations", acts, "--raw", "--tokens", "2",
                             "--jsonl", jl, "the cat sat")
        assert code == 0, err
        stages = {json.loads(line).get("stage") for line in jl.read_text().splitlines() if line.strip()}
        assert {"kq_soft_max", "ffn_moe_swiglu_oai", "ffn_moe_out", "result_output"} <= stages
    code, out, err = run(capsys, "diagram", "-m", paths["mxfp4"], "--raw", "-o", tmp_path / "d.svg", "hi")
    assert code == 0 and (tmp_path / "d.svg").read_text().lstrip().startswith("<"), err
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 12)
    code, out, err = run(capsys, "perplexity", "-f", text, "-m", paths["mxfp4"], "--ctx-size", "24", "--workers", "1",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["ppl"] > 1


def test_compare_pairs_gpt_oss_stages_with_llamacpps_graph(models, llamacpp):
    """llama.cpp's graph on the F32 file (one prefill of 4 tokens, one decode step): the sinks'
    softmax, the biased router and experts, the clamped SwiGLU and the pre-norm llama.cpp calls
    attn_post_norm pair with ours and agree to float32 rounding."""
    steps: dict[int, list] = {}
    for key in sorted(k for k in llamacpp if k.startswith("dump.step")):
        _, step, _, rest = key.split(".", 3)
        tensor, op = rest.rsplit(".", 1)
        steps.setdefault(int(step[4:]), []).append(SimpleNamespace(name=tensor, op=op, array=llamacpp[key]))
    model = models["f32"]
    ids = llamacpp["ids"]
    ref = {}
    for step, captured in steps.items():
        start, seq = (0, PREFILL) if step == 0 else (PREFILL, 1)
        ref.update(cmp.llamacpp_stage_arrays(captured, step, start, seq, model.config))
    cache = model.new_cache(8)
    with model.trace(keep_arrays=True) as rec:
        model.forward(ids[:PREFILL], 0, cache)
        model.forward(ids[PREFILL:PREFILL + 1], PREFILL, cache)
    result = cmp.compare_arrays(rec.arrays(), ref)
    rows = {(r.step, r.layer, r.stage): r for r in result.rows}
    want = ("kq_soft_max", "attn_out", "ffn_norm", "ffn_moe_logits", "ffn_moe_gate", "ffn_moe_gate_biased",
            "ffn_moe_up_biased", "ffn_moe_swiglu_oai", "ffn_moe_down", "ffn_moe_down_biased", "ffn_moe_weighted",
            "ffn_moe_out", "l_out")
    for step in (0, 1):
        for layer in range(N_LAYERS):
            for stage in want:
                r = rows[(step, layer, stage)]
                assert r.status == "ok" and r.rel_rms_err < 1e-5, (step, layer, stage, r)
    assert not [r for r in result.rows if r.status == "shape mismatch"]


GPT_OSS_MOE_STAGES = ("ffn_moe_logits", "ffn_moe_logits_biased", "ffn_moe_probs", "ffn_moe_gate", "ffn_moe_up",
                      "ffn_moe_gate_biased", "ffn_moe_up_biased", "ffn_moe_swiglu_oai", "ffn_moe_down",
                      "ffn_moe_down_biased", "ffn_moe_weighted", "ffn_moe_out")


@pytest.mark.parametrize("name", FILES)
def test_local_errors_recompute_every_gpt_oss_moe_stage_of_a_recording(name, models):
    """The --stages attribution's formulas hold for gpt-oss: recomputed from a recording's own inputs
    (its choice of experts, the experts' biases, the clamped SwiGLU), each MoE stage is what the
    forward pass wrote."""
    from llamatrace.analysis.local_error import local_errors, not_recomputed
    model = models[name]
    assert not [s for s in GPT_OSS_MOE_STAGES if not_recomputed(s, model.config)]
    cache = model.new_cache(8)
    with model.trace(keep_arrays=True) as rec:
        model.forward(np.arange(3, 9), 0, cache)
        model.forward(np.array([9]), 6, cache)
    errors = local_errors(model, rec.arrays())
    for stage in GPT_OSS_MOE_STAGES:
        for step in (0, 1):
            for layer in range(N_LAYERS):
                assert errors[f"step{step}.layer{layer}.{stage}"] < 1e-6, (name, stage, step, layer)


def test_local_errors_recompute_llamacpps_own_gpt_oss_expert_stages(models, llamacpp):
    """From llama.cpp's graph tensors (the F32 file): each expert stage recomputed from llama.cpp's own
    inputs (the experts and weights chosen from its own router output) is what llama.cpp computed: our
    biases, clamped SwiGLU and weighting are llama.cpp's."""
    from llamatrace.analysis.local_error import local_errors
    from llamatrace.kernels.ops.moe import route
    from llamatrace.tracing.recorder import stage_key
    model = models["f32"]
    arrays = {}
    for step in (0, 1):
        captured = [SimpleNamespace(name=key.split(".", 3)[3].rsplit(".", 1)[0], op=key.rsplit(".", 1)[1],
                                    array=llamacpp[key]) for key in sorted(llamacpp)
                    if key.startswith(f"dump.step{step}.")]
        start, seq = (0, PREFILL) if step == 0 else (PREFILL, 1)
        arrays.update(cmp.llamacpp_stage_arrays(captured, step, start, seq, model.config))
        for layer in range(N_LAYERS):   # llama.cpp's graph dumps neither its argsort nor the softmax of the chosen
            probs = arrays[stage_key(step, layer, "ffn_moe_probs")]
            _, ids, weights, _ = route(probs, K, "softmax_weight")
            arrays[stage_key(step, layer, "ffn_moe_topk")] = ids
            arrays[stage_key(step, layer, "ffn_moe_weights_softmax")] = weights
    errors = local_errors(model, arrays)
    for stage in ("ffn_moe_gate", "ffn_moe_up", "ffn_moe_gate_biased", "ffn_moe_up_biased", "ffn_moe_swiglu_oai",
                  "ffn_moe_down", "ffn_moe_down_biased", "ffn_moe_weighted"):
        for step in (0, 1):
            for layer in range(N_LAYERS):
                assert errors[f"step{step}.layer{layer}.{stage}"] < 1e-5, (stage, step, layer)
