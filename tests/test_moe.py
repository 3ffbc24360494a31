"""The mixture-of-experts architectures (qwen3moe, Mixtral-style llama, olmoe) against llama.cpp.

The random-weight files are written at test time by ``tests/moe_files.py``; llama.cpp's float32
logits on the same files (same seed, so the same bytes), F32 and Q8_0 weights, and its graph
tensors on two of them are in ``tests/golden/moe_llamacpp.npz`` / ``moe_llamacpp_dump.npz``, made
by ``tests/golden/make_moe_golden.py``. The routing kernels are checked against their NumPy twins
and against the rules of llama.cpp's ``build_moe_ffn`` written out here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from arch_files import golden_arrays, relative, run_positions
from cli_helpers import assert_one_line_error, run
from moe_files import ARCHS, SPECS, T, write_moe_file

from llamatrace.analysis import compare as cmp
from llamatrace.errors import ModelFormatError, UnsupportedModelError
from llamatrace.kernels.ops import moe as routing
from llamatrace.model.llama import Llama
from llamatrace.tracing.stages import STAGE_BY_ID, STAGES, stage_applies

GOLDEN = Path(__file__).parent / "golden"
PREFILL = 4                  # make_moe_golden.py's decode run: 4 tokens in one batch, then one a step
RTOL = 1e-4                  # relative L2 distance per position, the issue's bar
GPT_OSS_ONLY = {"ffn_moe_logits_biased", "ffn_moe_weights_softmax", "ffn_moe_swiglu_oai", "ffn_moe_gate_biased",
                "ffn_moe_up_biased", "ffn_moe_down_biased"}   # tests/test_gptoss.py
MOE_STAGES = [s.id for s in STAGES if s.id.startswith("ffn_moe_") and s.id not in GPT_OSS_ONLY]


@pytest.fixture(scope="module")
def llamacpp():
    return golden_arrays("moe_llamacpp.npz")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return {a: write_moe_file(d / f"tiny-{a}.gguf", a) for a in ARCHS}


@pytest.fixture(scope="module")
def models(paths):
    return {a: Llama.load(p) for a, p in paths.items()}


# ---- the routing kernels ----------------------------------------------------------------------
@pytest.mark.parametrize("gating, norm", [("softmax", False), ("softmax", True), ("softmax_weight", False)])
def test_route_matches_its_numpy_twin(gating, norm):
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, size=(37, 11)).astype(np.float32)
    logits[5] = 0.5                               # every expert tied: the lowest indices win
    logits[6, [2, 7, 9]] = 9.0                    # a three-way tie for first
    logits[7, [1, 4, 8]] = [np.inf, np.nan, -np.inf]  # nothing passes the NaN (softmax: every prob NaN)
    logits[8, [0, 3, 6]] = [-0.0, 0.0, np.nan]        # -0.0 ties 0.0
    with np.errstate(invalid="ignore"):                # the twin's softmax of row 7's chosen inf: inf - inf
        got, want = routing.route(logits, 4, gating, norm), routing.route_ref(logits, 4, gating, norm)
    np.testing.assert_array_equal(got[1], want[1])
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        if b is None:
            assert a is None
        else:
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(got[1][5], [0, 1, 2, 3])
    np.testing.assert_array_equal(got[1][6, :3], [2, 7, 9])


def test_route_follows_build_moe_ffn():
    """softmax over every expert, top-k best first, probs at the ids, divided by their sum;
    SOFTMAX_WEIGHT: top-k of the logits, softmax over those."""
    logits = np.array([[1.0, 3.0, 2.0, -1.0], [-200.0, -200.0, 0.0, -200.0]], np.float32)
    probs, ids, weights, normed = routing.route(logits, 2, "softmax", norm=True)
    e = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    np.testing.assert_allclose(probs, e / e.sum(1, keepdims=True), rtol=1e-6, atol=1e-30)
    np.testing.assert_array_equal(ids, [[1, 2], [2, 0]])
    np.testing.assert_array_equal(weights, np.take_along_axis(probs, ids.astype(np.int64), 1))
    np.testing.assert_allclose(normed[0], weights[0] / weights[0].sum(), rtol=1e-6)
    np.testing.assert_allclose(normed.sum(1), 1.0, rtol=1e-6)
    _, ids, weights, none = routing.route(logits, 3, "softmax_weight")
    np.testing.assert_array_equal(ids[0], [1, 2, 0])
    sel = np.exp(logits[0, [1, 2, 0]] - 3.0)
    np.testing.assert_allclose(weights[0], sel / sel.sum(), rtol=1e-6)
    assert none is None


def test_combine_matches_its_twin_and_adds_slots_in_order():
    rng = np.random.default_rng(2)
    experts = rng.normal(size=(9, 3, 40)).astype(np.float32)
    weights = rng.random((9, 3)).astype(np.float32)
    got = routing.combine(experts, weights)
    np.testing.assert_array_equal(got, routing.combine_ref(experts, weights))
    w = experts * weights[:, :, None]
    np.testing.assert_array_equal(got, (w[:, 0] + w[:, 1]) + w[:, 2])


def test_route_refuses_a_k_beyond_the_experts():
    with pytest.raises(ValueError, match="n_expert"):
        routing.route(np.zeros((2, 4), np.float32), 5)
    with pytest.raises(ValueError, match="gating"):
        routing.route(np.zeros((2, 4), np.float32), 2, "sigmoid")


# ---- fidelity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("run_kind", ["prefill", "decode"])
def test_f32_logits_match_llamacpp_at_every_position(name, run_kind, models, llamacpp):
    ids = llamacpp[f"{name}_ids"]
    ours = run_positions(models[name], ids, len(ids) if run_kind == "prefill" else PREFILL)
    ref = llamacpp[f"{name}_{run_kind}"]
    assert relative(ours, ref).max() <= RTOL, relative(ours, ref)
    assert (ours.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("name", ARCHS)
def test_q8_mode_on_q8_0_experts_matches_llamacpp(name, llamacpp, tmp_path):
    """llama.cpp rounds activations to Q8_0 before Q8_0 matmuls (mul_mat_id too); so does the q8 mode."""
    model = Llama.load(write_moe_file(tmp_path / f"{name}-q8_0.gguf", name, qtype=T.Q8_0), activations="q8")
    ids = llamacpp[f"{name}_q8_0_ids"]
    for run_kind, prefill in (("prefill", len(ids)), ("decode", PREFILL)):
        ours, ref = run_positions(model, ids, prefill), llamacpp[f"{name}_q8_0_{run_kind}"]
        assert relative(ours, ref).max() <= RTOL, (run_kind, relative(ours, ref))
        assert (ours.argmax(1) == ref.argmax(1)).all()


def test_an_exact_tie_is_broken_as_llamacpp_breaks_it(llamacpp, tmp_path):
    """Router rows 2 and 5 equal, top-1: the two experts tie exactly for every token, and
    llama.cpp's ggml_argsort_top_k (std::sort, an insertion sort for <= 16 experts) keeps expert 2."""
    model = Llama.load(write_moe_file(tmp_path / "tie.gguf", "mixtral", kv={"expert_used_count": 1}, tie=(2, 5)))
    ids = llamacpp["mixtral_ids"]
    with model.trace(stages=["ffn_moe_probs", "ffn_moe_topk"], keep_arrays=True) as rec:
        ours = run_positions(model, ids, len(ids))
    probs = [e.array for e in rec.events if e.stage == "ffn_moe_probs"]
    chosen = np.concatenate([e.array[:, 0] for e in rec.events if e.stage == "ffn_moe_topk"])
    assert all((p[:, 2] == p[:, 5]).all() for p in probs)
    assert (chosen == 2).sum() >= 8 and not (chosen == 5).any()         # the tie decides often
    for run_kind, prefill in (("prefill", len(ids)), ("decode", PREFILL)):
        ref = llamacpp[f"mixtral_tie_{run_kind}"]
        got = ours if run_kind == "prefill" else run_positions(model, ids, prefill)
        assert relative(got, ref).max() <= RTOL and (got.argmax(1) == ref.argmax(1)).all()
    with model.hooks({"ffn_moe_topk": lambda a, ev: np.where(a == 2, 5, a).astype(a.dtype)}):
        other_way = run_positions(model, ids, len(ids))
    assert relative(other_way, llamacpp["mixtral_tie_prefill"]).max() > 0.05


@pytest.mark.parametrize("name", ARCHS)
def test_test_files_route_differently_per_token_with_clear_margins(name, models, llamacpp):
    """The files are fit for the fidelity tests: the k-th and (k+1)-th router probabilities are
    far apart (no choice hangs on rounding), and the tokens do not all pick the same experts."""
    model, k = models[name], SPECS[name]["k"]
    ids = llamacpp[f"{name}_ids"]
    with model.trace(stages=["ffn_moe_logits", "ffn_moe_topk"], keep_arrays=True) as rec:
        model.forward(ids, 0, model.new_cache(len(ids)))
    logits = [e.array for e in rec.events if e.stage == "ffn_moe_logits"]
    assert len(logits) == SPECS[name]["n_layers"]
    for layer_logits in logits:
        ranked = -np.sort(-layer_logits, axis=1)
        assert (ranked[:, k - 1] - ranked[:, k]).min() > 1e-3          # logits ~ 4: rounding moves ~1e-6
    for e in rec.events:
        if e.stage == "ffn_moe_topk":
            assert len({tuple(sorted(r)) for r in e.array.tolist()}) > 3


@pytest.mark.parametrize("name", ARCHS)
def test_recording_every_moe_stage_leaves_the_logits_bit_identical(name, models):
    """Watched, the per-expert stages are assembled as [seq_len, k, …] arrays; unwatched, each
    expert's rows go from gate|up to down in one pass: the same numbers."""
    model = models[name]
    ids = np.arange(3, 13)
    plain = run_positions(model, ids, 6)
    with model.trace(stages=MOE_STAGES):
        traced = run_positions(model, ids, 6)
    np.testing.assert_array_equal(plain, traced)


def test_a_hook_on_the_chosen_experts_changes_the_output(models):
    model = models["mixtral"]
    ids = np.arange(3, 9)
    plain = model.forward(ids, 0, model.new_cache(8))
    with model.hooks({"ffn_moe_topk": lambda a, ev: (a + 1) % 8}, layers=[1]):
        hooked = model.forward(ids, 0, model.new_cache(8))
    assert np.abs(hooked - plain).max() > 1e-2


ROUTER_STAGES = ["ffn_moe_probs", "ffn_moe_topk", "ffn_moe_weights", "ffn_moe_weights_norm", "ffn_moe_out"]


@pytest.mark.parametrize("stage", ["ffn_moe_probs", "ffn_moe_topk", "ffn_moe_weights"])
def test_an_ablated_router_stage_is_what_the_later_ones_follow(models, stage):
    """``--ablate ffn_moe_probs`` (or ``ffn_moe_weights``) showed zeros and changed nothing after
    them: the choice and the weights were made before the stages were emitted. Each later stage now
    follows the replacement as build_moe_ffn makes it, written out here: the top k of probs (ties
    to the lower index), the weights probs at the ids (get_rows, whatever chose them), divided by
    their sum (clamped at fp16's smallest normal)."""
    from llamatrace.tracing.hooks import zero_ablation
    model = models["qwen3moe"]
    k, tokens = model.config.n_expert_used, np.arange(3, 9)
    with model.hooks({stage: zero_ablation(stage)}, layers=[1]):
        with model.trace(layers=[1], stages=ROUTER_STAGES, keep_arrays=True) as rec:
            hooked = model.forward(tokens, 0, model.new_cache(8))
    a = {name: rec.arrays()[f"step0.layer1.{name}"] for name in ROUTER_STAGES}
    assert not a[stage].any()
    ids = np.argsort(-a["ffn_moe_probs"], axis=1, kind="stable")[:, :k]
    if stage != "ffn_moe_topk":
        np.testing.assert_array_equal(a["ffn_moe_topk"], ids)
    weights = np.take_along_axis(a["ffn_moe_probs"], a["ffn_moe_topk"].astype(np.int64), axis=1)
    if stage != "ffn_moe_weights":
        np.testing.assert_array_equal(a["ffn_moe_weights"], weights)
    total = np.maximum(a["ffn_moe_weights"].sum(axis=1, keepdims=True), np.float32(6.103515625e-5))
    np.testing.assert_allclose(a["ffn_moe_weights_norm"], a["ffn_moe_weights"] / total, rtol=1e-6)
    if stage == "ffn_moe_topk":                  # every slot expert 0, so one weight k times
        assert (a["ffn_moe_weights"] == a["ffn_moe_probs"][:, :1]).all()
    else:                                        # no weight left: nothing out of the experts
        assert not a["ffn_moe_out"].any()
    assert np.abs(hooked - model.forward(tokens, 0, model.new_cache(8))).max() > 1e-2


@pytest.mark.parametrize("args, option, needles", [
    (["generate", "--raw", "hi", "-n", "1", "--ablate", "ffn_out@-1"], "--ablate", ["ffn_moe_out"]),
    (["trace", "--raw", "hi", "--stage", "attn_out,ffn_gate"], "--stage", ["mixture of experts", "ffn_moe_gate"]),
    (["trace", "--raw", "hi", "--stage", "ffn_sw*"], "--stage", ["none of the stages", "ffn_swiglu"]),
    (["collect", "-f", str(GOLDEN / "corpus.txt"), "--hook", "ffn_out@0", "--ctx-size", "32", "-o", "{tmp}/acts"],
     "--hook", ["ffn_moe_out"]),
])
def test_a_stage_the_model_does_not_compute_is_refused(paths, tmp_path, capsys, args, option, needles):
    """``--ablate ffn_out@-1`` (the help's example) said "ablating" and changed nothing on a mixture of
    experts, ``--stage ffn_gate`` printed nothing: a stage the model never emits is one error line
    naming the one it has instead (``collect --hook ffn_out@0`` stored ffn_moe_out under that name)."""
    argv = [a.format(tmp=tmp_path) for a in args]
    assert_one_line_error(*run(capsys, argv[0], "-m", paths["qwen3moe"], *argv[1:]), option, *needles)


def test_a_softmax_routers_probs_are_called_a_softmax(models):
    """The catalogue's variant (gpt-oss: the logits, test_gptoss) leaves softmax routers' op as it was."""
    model = models["qwen3moe"]
    with model.trace(layers=[0], stages=["ffn_moe_probs"], keep_arrays=True) as rec:
        model.forward(np.arange(3, 7), 0, model.new_cache(8))
    (event,) = rec.events
    assert event.op == "Softmax"
    np.testing.assert_allclose(event.array.sum(axis=1), 1.0, rtol=1e-5)


def test_the_chosen_experts_stats_are_those_of_ids(models):
    """``--stats`` summed and averaged the expert ids (sum 402, mean 16.75): ids get their range, how
    many distinct and the most chosen, counted here by hand."""
    from llamatrace.views.render import fmt_stats
    model = models["qwen3moe"]
    with model.trace(layers=[0], stages=["ffn_moe_topk"], stats=True, keep_arrays=True) as rec:
        model.forward(np.arange(3, 9), 0, model.new_cache(8))
    (event,) = rec.events
    ids = event.array.ravel().tolist()
    most = max(sorted(set(ids)), key=ids.count)
    assert event.stats["sum"] is None and event.stats["mean"] is None
    assert (event.stats["min"], event.stats["max"], event.stats["distinct"]) == (min(ids), max(ids), len(set(ids)))
    assert (event.stats["most"], event.stats["most_count"]) == (most, ids.count(most))
    line = f"ids {min(ids)}…{max(ids)}  distinct {len(set(ids))}  most {most} ×{ids.count(most)}"
    assert fmt_stats(event.stats) == line


def test_info_names_the_gating_and_a_dense_width_no_layer_uses(paths, capsys):
    """qwen3moe's feed_forward_length (96 here) is no layer's width (its experts' is 64); Mixtral's is
    its experts'. The gating is shown where it is the default softmax too (gpt-oss's always was)."""
    for name, unused in (("qwen3moe", True), ("mixtral", False)):
        code, out, err = run(capsys, "info", "-m", paths[name])
        assert code == 0, err
        hidden = next(line for line in out.splitlines() if line.split()[:1] == ["hidden_dim"])
        assert ("no layer uses it" in hidden) == unused, hidden
        assert any(line.split()[:2] == ["expert_gating", "softmax"] for line in out.splitlines())


def test_a_moe_stage_on_a_dense_model_is_refused(tiny_model_path, capsys):
    assert_one_line_error(*run(capsys, "generate", "-m", tiny_model_path, "--raw", "hi", "-n", "1",
                               "--ablate", "ffn_moe_topk@0"), "--ablate", "only by models with a mixture of experts")


# ---- stages and views -------------------------------------------------------------------------
def test_moe_stages_apply_only_to_moe_models_and_replace_the_dense_ffn():
    dense = {s.id for s in STAGES if stage_applies(s, 4, 2, frozenset())}
    moe = {s.id for s in STAGES if stage_applies(s, 4, 2, frozenset({"moe", "qk_norm"}))}
    normed = {s.id for s in STAGES if stage_applies(s, 4, 2, frozenset({"moe", "moe_norm"}))}
    assert not dense & set(MOE_STAGES)
    assert set(MOE_STAGES) - {"ffn_moe_weights_norm"} <= moe and "ffn_moe_weights_norm" in normed
    assert not moe & {"ffn_gate", "ffn_silu", "ffn_up", "ffn_swiglu", "ffn_out"}
    assert all(STAGE_BY_ID[s].llama_cpp == s for s in MOE_STAGES)


@pytest.mark.parametrize("name", ARCHS)
def test_every_moe_stage_has_its_catalogue_shape(name, models):
    model = models[name]
    c = model.config
    with model.trace() as rec:
        model.forward(np.arange(3, 8), 0, model.new_cache(8))
    got = {(e.layer, e.stage): tuple(e.shape) for e in rec.events}
    k, n, ff = c.n_expert_used, c.n_expert, c.expert_hidden_dim
    want = {"ffn_moe_logits": (5, n), "ffn_moe_probs": (5, n), "ffn_moe_topk": (5, k), "ffn_moe_weights": (5, k),
            "ffn_moe_gate": (5, k, ff), "ffn_moe_up": (5, k, ff), "ffn_moe_swiglu": (5, k, ff),
            "ffn_moe_down": (5, k, c.dim), "ffn_moe_weighted": (5, k, c.dim), "ffn_moe_out": (5, c.dim)}
    if c.expert_weights_norm:
        want["ffn_moe_weights_norm"] = (5, k)
    for layer in range(c.n_layers):
        for stage, shape in want.items():
            assert got[(layer, stage)] == shape, (layer, stage)
        assert (layer, "ffn_out") not in got and (layer, "ffn_gate") not in got
    assert ((0, "ffn_moe_weights_norm") in got) == (name != "olmoe")     # OLMoE does not renormalise


def test_trace_names_each_tokens_experts_and_weights(paths, capsys):
    code, out, err = run(capsys, "trace", "-m", paths["qwen3moe"], "--raw", "--layer", "1", "a cat")
    assert code == 0, err
    assert "Choosing the top [3] of [6] experts per token" in out
    assert "token at position 0: experts " in out
    chosen, normed = [[float(p.split("×")[1]) for p in ln.split(":", 1)[1].split(",")] for ln in out.splitlines()
                      if ln.strip().startswith("token at position 0: expert ") and "×" in ln]
    assert len(normed) == 3 and abs(sum(normed) - 1) < 1e-3                      # ffn_moe_weights_norm
    assert sum(chosen) < 1 and np.allclose(np.array(chosen) / sum(chosen), normed, atol=2e-4)
    code, out, err = run(capsys, "trace", "-m", paths["qwen3moe"], "--raw", "--layer", "1", "--dump-shapes", "a cat")
    assert code == 0, err
    n = int(re.search(r"positions \[0:(\d+)\]", out).group(1))
    assert f"tensor expertGate shape([{n} 3 64])" in out and "ffn_gate_exps weights shape([6 64 64])" in out
    assert "token at position" not in out                              # shapes only


def test_diagram_draws_the_moe_block_with_its_top_k(paths, tmp_path, capsys):
    dot = tmp_path / "block.dot"
    code, out, err = run(capsys, "diagram", "-m", paths["mixtral"], "--raw", "hi", "--view", "block", "-o", dot)
    assert code == 0, err
    text = dot.read_text()
    assert "top 2 of 8 experts per token" in text and "mixture of 8 SwiGLU experts, top 2" in text
    assert "ffn_moe_topk -> ffn_moe_gate" in text and "ffn_moe_out -> l_out" in text


def test_run_with_cache_serves_tl_mixtral_names(models):
    model = models["mixtral"]
    logits, cache = model.run_with_cache(["the cat", "a"])
    with model.trace(stages=["ffn_moe_probs", "ffn_moe_topk", "ffn_moe_out"], keep_arrays=True) as rec:
        model.forward(model.tokenizer.encode("the cat"), 0, model.new_cache(8))
    ours = {e.stage: e.array for e in rec.events if e.layer == 1}
    n = len(ours["ffn_moe_topk"])
    np.testing.assert_array_equal(cache["blocks.1.mlp.hook_expert_indices"][0, :n], ours["ffn_moe_topk"])
    assert cache["blocks.1.mlp.hook_expert_indices"].dtype == np.int32
    np.testing.assert_array_equal(cache["blocks.1.mlp.hook_expert_weights"][0, :n], ours["ffn_moe_probs"])
    np.testing.assert_array_equal(cache["blocks.1.hook_mlp_out"][0, :n], ours["ffn_moe_out"])
    from llamatrace.model import tl
    # the stage a manifest (collect) records for it: the one the model computes, not the dense ffn_out
    assert tl.resolve("blocks.1.hook_mlp_out", 2, moe=True).stage == "ffn_moe_out"
    assert tl.resolve("blocks.1.hook_mlp_out", 2).stage == "ffn_out"
    from llamatrace.errors import OptionError
    with pytest.raises(OptionError, match="ffn_moe_gate@0"):
        model.run_with_cache("a", names_filter="blocks.0.mlp.hook_pre")


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_compare_pairs_every_moe_stage_with_llamacpp(name, models):
    """llama.cpp's graph on the F32 file (one prefill, one decode step): every MoE stage it names
    (ffn_moe_topk is int32, not captured) pairs with ours and agrees to float32 rounding."""
    with np.load(GOLDEN / "moe_llamacpp_dump.npz") as z:
        ids = z[f"{name}.ids"]
        steps: dict[int, list] = {}
        for key in sorted(k for k in z.files if k.startswith(f"{name}.step")):
            _, step, _, rest = key.split(".", 3)
            tensor, op = rest.rsplit(".", 1)
            steps.setdefault(int(step[4:]), []).append(SimpleNamespace(name=tensor, op=op, array=z[key]))
    model = models[name]
    ref = {}
    for step, captured in steps.items():
        start, seq = (0, PREFILL) if step == 0 else (PREFILL, 1)
        ref.update(cmp.llamacpp_stage_arrays(captured, step, start, seq, model.config))
    cache = model.new_cache(8)
    with model.trace(keep_arrays=True) as rec:
        model.forward(ids[:PREFILL], 0, cache)
        model.forward(ids[PREFILL:], PREFILL, cache)
    ours = rec.arrays()
    result = cmp.compare_arrays(ours, ref)
    rows = {(r.step, r.layer, r.stage): r for r in result.rows}
    want = set(MOE_STAGES) - {"ffn_moe_topk"}
    if not model.config.expert_weights_norm:
        want.discard("ffn_moe_weights_norm")
    for step in (0, 1):
        for layer in range(model.config.n_layers):
            for stage in want:
                r = rows[(step, layer, stage)]
                assert r.status == "ok" and r.rel_rms_err < 1e-5, (step, layer, stage, r)
    assert not [r for r in result.rows if r.status == "shape mismatch"]


# ---- the CLI on each file ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ARCHS)
def test_generate_and_trace_run_on_each_moe_file(name, paths, tmp_path, capsys):
    code, out, err = run(capsys, "generate", "-m", paths[name], "--raw", "the cat", "-n", "3", "--json")
    assert code == 0, err
    assert len(json.loads(out)["ids"]) >= 1
    jl = tmp_path / "t.jsonl"
    code, out, err = run(capsys, "trace", "-m", paths[name], "--raw", "--tokens", "2", "--jsonl", jl, "the cat sat")
    assert code == 0, err
    events = [json.loads(line) for line in jl.read_text().splitlines() if line.strip()]
    assert {"ffn_moe_topk", "ffn_moe_out", "l_out", "result_output"} <= {e.get("stage") for e in events}
    k, n = SPECS[name]["k"], SPECS[name]["n_expert"]
    for e in events:                              # the router's choice is in the events, not only in the log
        if e.get("stage") in ("ffn_moe_topk", "ffn_moe_weights"):
            assert len(e["rows"]) == e["shape"][0] and all(len(row) == k for row in e["rows"]), e
        if e.get("stage") == "ffn_moe_topk":
            assert all(0 <= i < n for row in e["rows"] for i in row) and all(len(set(r)) == k for r in e["rows"])


def test_perplexity_runs_on_a_moe_file(paths, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 12)
    code, out, err = run(capsys, "perplexity", "-f", text, "-m", paths["olmoe"], "--ctx-size", "24",
                         "--workers", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["ppl"] > 1


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("make, needle, error", [
    (dict(kv={"expert_used_count": 7}), "qwen3moe.expert_used_count", ModelFormatError),
    (dict(kv={"expert_gating_func": 9}), "qwen3moe.expert_gating_func", UnsupportedModelError),
    (dict(skip_tensors=("blk.1.ffn_gate_inp.weight",)), "blk.1.ffn_gate_inp.weight", ModelFormatError),
    (dict(shapes={"blk.0.ffn_up_exps.weight": (5, 64, 64)}), "blk.0.ffn_up_exps.weight", ModelFormatError),
    (dict(shapes={"blk.2.ffn_down_exps.weight": (6, 64, 32)}), "blk.2.ffn_down_exps.weight", ModelFormatError),
])
def test_bad_moe_files_are_one_error_line_naming_the_key_or_tensor(make, needle, error, tmp_path, capsys):
    path = write_moe_file(tmp_path / "bad.gguf", "qwen3moe", **make)
    with pytest.raises(error, match=needle.replace(".", r"\.")):
        Llama.load(path, cache=False)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), needle)


@pytest.mark.parametrize("extra", [
    {f"blk.{i}.ffn_gate_inp_shexp.weight": np.ones(8) for i in range(3)},   # qwen2moe's shared expert gate
    {"blk.2.ffn_down_exps.bias": np.ones(8)},                                 # gpt-oss's experts' biases
])
def test_moe_tensors_of_another_family_are_refused_not_skipped(extra, tmp_path, capsys):
    """A qwen3moe file holding a shared expert or experts' biases (another family's, or a wrong
    architecture key) would run without them: refused, naming the first."""
    from gguf_factory import rewrite_metadata
    path = rewrite_metadata(write_moe_file(tmp_path / "a.gguf", "qwen3moe"), tmp_path / "extra.gguf", {},
                            extra_tensors=extra)
    first = next(iter(extra))
    with pytest.raises(UnsupportedModelError, match=rf"'{re.escape(first)}' is not part of the qwen3moe forward"):
        Llama.load(path, cache=False)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), first)


# ---- error attribution ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3moe", "olmoe"])
def test_local_errors_recompute_every_moe_stage_of_a_recording(name, models):
    """Recomputed from the recording's own inputs (and its choice of experts), each MoE stage is what
    the forward pass wrote: the formulas the --stages attribution uses hold."""
    from llamatrace.analysis.local_error import local_errors
    model = models[name]
    cache = model.new_cache(8)
    with model.trace(keep_arrays=True) as rec:
        model.forward(np.arange(3, 9), 0, cache)
        model.forward(np.array([9]), 6, cache)
    errors = local_errors(model, rec.arrays())
    for stage in ("ffn_moe_logits", "ffn_moe_probs", "ffn_moe_gate", "ffn_moe_up", "ffn_moe_swiglu",
                  "ffn_moe_down", "ffn_moe_out", "l_out"):
        for step in (0, 1):
            for layer in range(model.config.n_layers):
                assert errors[f"step{step}.layer{layer}.{stage}"] < 1e-6, (stage, step, layer)


def test_perplexity_stages_attributes_error_to_the_quantized_experts(paths, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 12)
    quant = write_moe_file(tmp_path / "q8_0.gguf", "qwen3moe", qtype=T.Q8_0)
    code, out, err = run(capsys, "perplexity", "-f", text, "-m", quant, "--base", paths["qwen3moe"],
                         "--ctx-size", "24", "--workers", "1", "--stages")
    assert code == 0, err
    local = out.split("Where the error enters")[1].split("Accumulated")[0]
    rows = {tuple(ln.split()[:2]): float(ln.split()[2]) for ln in local.splitlines()
            if ln.split() and ln.split()[0].isdigit()}
    assert any(stage.startswith("ffn_moe_") and 1e-3 < err_ < 2e-2 for (_, stage), err_ in rows.items())
    assert "l_out                not recomputed" not in local


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "olmoe"])
def test_a_gating_key_these_graphs_ignore_changes_nothing(name, tmp_path):
    # llama.cpp's llama / qwen3moe / olmoe graphs pass SOFTMAX to build_moe_ffn whatever
    # {arch}.expert_gating_func says: a file saying 3 (softmax over the chosen logits) routes the same
    from llamatrace.model.llama import Llama
    plain = Llama.load(write_moe_file(tmp_path / "plain.gguf", name), fetch=False)
    keyed = Llama.load(write_moe_file(tmp_path / "keyed.gguf", name, kv={"expert_gating_func": 3}), fetch=False)
    assert keyed.config.expert_gating == "softmax"
    ids = np.arange(3, 11, dtype=np.int32)
    np.testing.assert_array_equal(keyed.forward(ids, 0, keyed.new_cache(8)), plain.forward(ids, 0, plain.new_cache(8)))
    plain.close()
    keyed.close()
