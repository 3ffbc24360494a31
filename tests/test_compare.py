"""`llamatrace compare`: pairing and layouts against committed llama.cpp dumps, metrics, the
first divergence, the npz mode and its errors; a live run when llama-cpp-python is installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run

from llamatrace.analysis import compare as cmp
from llamatrace.tracing.recorder import stage_key
from llamatrace.tracing.stages import STAGES, stage_applies

GOLDEN = Path(__file__).parent / "golden"
DUMPS = ("france", "once")
# every stage llama.cpp has a tensor for (kq_mask: prefill only)
# stages with a llama.cpp name that a Llama model runs (other architectures' feature stages aside)
PAIRED = {s.id for s in STAGES if s.llama_cpp is not None and stage_applies(s, 2, 1)}


def load_dump(name: str):
    """(meta, {step: [captured tensors in graph order]}) from tests/golden/llamacpp_<name>.npz."""
    with np.load(GOLDEN / f"llamacpp_{name}.npz") as data:
        meta = json.loads(str(data["meta"]))
        steps: dict[int, list] = {}
        for key in sorted(k for k in data.files if k != "meta"):
            step, index, rest = key.split(".", 2)
            tensor_name, op = rest.rsplit(".", 1)
            steps.setdefault(int(step[4:]), []).append(
                SimpleNamespace(name=tensor_name, op=op, array=data[key].astype(np.float32)))
    return meta, steps


def dump_as_stages(name: str):
    meta, steps = load_dump(name)
    ids = meta["prompt_ids"]
    ref = {}
    for step, captured in steps.items():
        seq_len = len(ids) if step == 0 else 1
        ref.update(cmp.llamacpp_stage_arrays(captured, step, meta["start_pos"][step], seq_len))
    return meta, ref


@pytest.fixture(scope="module")
def ours_for_dumps(smollm2):
    out = {}
    for name in DUMPS:
        meta, _ = load_dump(name)
        arrays, fed, _ = cmp.run_ours(smollm2, meta["prompt_ids"], tokens=1)
        out[name] = (arrays, fed)
    return out


def test_dump_keeps_llamacpp_layouts():
    # the raw tensors hold what the layout fixes undo: padded KV cells, 4-D ggml order, one name thrice
    meta, steps = load_dump("france")
    n = len(meta["prompt_ids"])
    by = {(c.name, c.op): c.array.shape for c in steps[0]}
    assert by[("kq_soft_max-0", "SOFT_MAX")][:3] == (1, 9, n) and by[("kq_soft_max-0", "SOFT_MAX")][3] > n + 1
    assert by[("Qcur-0", "MUL_MAT")] == (1, 1, n, 576) and by[("Qcur-0", "ROPE")] == (1, n, 9, 64)
    assert by[("result_output", "MUL_MAT")] == (1, 1, n, 49152)      # every row: outputs for all tokens
    assert meta["settings"]["flash_attn"] is False and meta["settings"]["type_k"] == "f32"


@pytest.mark.parametrize("name", DUMPS)
def test_pairing_and_layouts_against_llamacpp_dump(name, smollm2, ours_for_dumps):
    meta, ref = dump_as_stages(name)
    assert smollm2.tokenizer.encode(meta["prompt"]) == meta["prompt_ids"]
    ours, fed = ours_for_dumps[name]
    assert fed == meta["fed"]             # our greedy token is llama.cpp's
    result = cmp.compare_arrays(ours, ref, layers=[0, 29])
    paired = {(r.step, r.layer, r.stage) for r in result.rows if r.status in ("ok", "diverged")}
    for step in (0, 1):
        for layer in (0, 29):
            missing = {s.id for s in STAGES if s.level == "layer" and s.id in PAIRED} - \
                {st for (sp, ly, st) in paired if (sp, ly) == (step, layer)}
            assert not missing, (step, layer, missing)
        model_level = {"inp_embd", "result_norm", "result_output"} | ({"kq_mask"} if step == 0 else set())
        assert model_level <= {st for (sp, ly, st) in paired if sp == step and ly is None}
    assert not [r for r in result.rows if r.status == "only reference"]
    assert not [r for r in result.rows if r.status == "shape mismatch"]
    assert result.first_divergence is None, result.first_divergence
    rows = {(r.step, r.layer, r.stage): r for r in result.rows}
    assert rows[(0, None, "inp_embd")].rel_rms_err < 1e-3              # the same dequantized rows
    assert rows[(0, None, "kq_mask")].rel_rms_err == 0
    # 8-bit activations in llama.cpp's matmuls: honest drift, but not zero
    assert 1e-3 < rows[(0, 0, "Qcur")].rel_rms_err < 0.15
    assert rows[(1, 29, "kq_soft_max")].shape == [9, 1, len(meta["prompt_ids"]) + 1]


def test_a_wrong_rope_layout_is_the_first_divergence(ours_for_dumps):
    # split-half RoPE (HF's layout on GGUF's interleaved weights) instead of adjacent pairs
    meta, ref = dump_as_stages("france")
    ours = dict(ours_for_dumps["france"][0])
    for key in [k for k in ours if k.endswith("Qcur_rope") or k.endswith("Kcur_rope")]:
        x = ours[key]
        ours[key] = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    first = cmp.compare_arrays(ours, ref, layers=[0, 29]).first_divergence
    assert (first.step, first.layer, first.stage) == (0, 0, "Qcur_rope")
    assert first.rel_rms_err > 0.3


def _perturb(array, event):
    noise = np.random.default_rng(event.step).standard_normal(array.shape).astype(array.dtype)
    return array + 0.5 * float(array.std()) * noise


def test_a_hooked_fault_is_the_first_divergence_against_llamacpp_dump(smollm2):
    meta, ref = dump_as_stages("france")
    with smollm2.hooks({"Kcur_rope": _perturb}, layers=[29]):
        ours, _, _ = cmp.run_ours(smollm2, meta["prompt_ids"], tokens=1)
    first = cmp.compare_arrays(ours, ref, layers=[0, 29]).first_divergence
    assert (first.step, first.layer, first.stage) == (0, 29, "Kcur_rope")


def test_injected_fault_is_exactly_the_first_divergence(ours_for_dumps):
    ours = ours_for_dumps["france"][0]
    ref = {k: v.copy() for k, v in ours.items()}
    key = "step0.layer3.Kcur_rope"
    rng = np.random.default_rng(0)
    ref[key] = ref[key] + 0.3 * ref[key].std() * rng.standard_normal(ref[key].shape).astype(np.float32)
    result = cmp.compare_arrays(ours, ref)
    first = result.first_divergence
    assert (first.step, first.layer, first.stage) == (0, 3, "Kcur_rope")
    assert sum(r.diverged for r in result.rows) == 1


def test_metrics():
    a = np.array([1.0, 2.0, -np.inf], dtype=np.float32)
    assert cmp.metrics(a, a) == (0.0, 0.0, pytest.approx(1.0))
    rel, max_abs, cos = cmp.metrics(np.array([3.0, 4.0]), np.array([3.0, 0.0]))
    assert rel == pytest.approx(4 / 3) and max_abs == 4 and cos == pytest.approx(0.6)
    assert cmp.metrics(np.array([0.0, -np.inf]), np.array([-np.inf, 0.0]))[0] == float("inf")
    z = np.exp(1j * np.arange(4, dtype=np.float32)).astype(np.complex64)
    assert cmp.metrics(z, z)[0] == 0


def test_forward_order_and_thresholds():
    keys = ["step1.inp_embd", "step0.result_output", "step0.layer1.Qcur", "step0.layer0.l_out",
            "step0.inp_embd", "step0.layer0.Qcur", "step0.layer0.my_stage"]
    assert sorted(keys, key=cmp.forward_order) == [
        "step0.inp_embd", "step0.layer0.Qcur", "step0.layer0.l_out", "step0.layer0.my_stage",
        "step0.layer1.Qcur", "step0.result_output", "step1.inp_embd"]
    assert [cmp.stage_kind(s) for s in ("kq_mask", "Kcur_rope", "kq", "kq_soft_max")] == ["exact", "qk", "qk", "other"]
    assert cmp.thresholds_for(0.5) == {"exact": 0.5, "qk": 0.5, "other": 0.5}


def _npz_pair(tmp_path, ours, ref):
    np.savez(tmp_path / "ours.npz", **ours)
    np.savez(tmp_path / "ref.npz", **ref)
    return str(tmp_path / "ours.npz"), str(tmp_path / "ref.npz")


def test_npz_mode_reports_missing_keys_and_shapes_as_rows(capsys, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    ours = {"step0.inp_embd": x, "step0.layer0.Qcur": x, "step0.layer0.ffn_up": x, "step0.layer1.l_out": x}
    ref = {"step0.inp_embd": x, "step0.layer0.Qcur": x * 1.01, "step0.layer0.ffn_up": x[:, :4],
           "step0.result_norm": x}
    code, out, err = run(capsys, "compare", *_npz_pair(tmp_path, ours, ref), "--json")
    assert code == 3, err
    report = json.loads(out)
    rows = {(r["layer"], r["stage"]): r for r in report["rows"]}
    assert rows[(0, "Qcur")]["rel_rms_err"] == pytest.approx(0.01 / 1.01, rel=1e-4)
    assert rows[(0, "ffn_up")]["status"] == "shape mismatch" and rows[(0, "ffn_up")]["ref_shape"] == [3, 4]
    assert rows[(1, "l_out")]["status"] == "only ours" and rows[(None, "result_norm")]["status"] == "only reference"
    assert report["first_divergence"]["stage"] == "ffn_up"
    code, out, err = run(capsys, "compare", *_npz_pair(tmp_path, ours, ref), "--stage", "Qcur,inp_embd")
    assert code == 0 and "no divergence" in out and "ours.npz vs" in out
    code, out, err = run(capsys, "compare", *_npz_pair(tmp_path, ours, ref), "--stage", "Qcur", "--threshold", "1e-3")
    assert code == 3 and "first divergence: step 0, layer 0, Qcur" in out
    # arrays of one recording only: counted beside "no divergence", which covered the paired ones only
    y = x[:, :2]
    many = {f"step0.layer{i}.l_out": y for i in range(20)}
    code, out, err = run(capsys, "compare", *_npz_pair(tmp_path, {"step0.inp_embd": x, **many}, {"step0.inp_embd": x}))
    assert code == 0, err
    text = " ".join(out.split())
    assert "no divergence: every paired stage (1) is within" in text
    assert "; 20 of 21 arrays are in one recording" in text
    assert "only in ours (not compared): l_out" in text
    # a pattern that matches no stage of either file was an empty table and "no divergence", exit 0
    assert_one_line_error(*run(capsys, "compare", *_npz_pair(tmp_path, ours, ref), "--stage", "Qcur,ffn_shexp*"),
                          "--stage 'ffn_shexp*' matches no stage of", "ours.npz", "ref.npz", "Qcur, ffn_up")


def test_npz_mode_refuses_a_model_that_is_not_the_recordings(capsys, tmp_path, monkeypatch):
    """--model of another width: 'internal error: ValueError: matmul … x has shape (1, 576)', exit 1;
    now refused from its header, before the load."""
    from gguf_factory import write_tiny_llama

    from llamatrace.cli import compare
    monkeypatch.setattr(compare, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    model = write_tiny_llama(tmp_path / "tiny.gguf")            # dim 64, 2 layers
    x = np.ones((3, 576), np.float32)
    pair = _npz_pair(tmp_path, {"step0.inp_embd": x, "step0.layer0.attn_norm": x},
                     {"step0.inp_embd": x, "step0.layer0.attn_norm": x})
    assert_one_line_error(*run(capsys, "compare", *pair, "--model", model), "--model tiny.gguf is not the model of",
                          "ours.npz", "step0.inp_embd is [3, 576]", "dim is 64")
    y = np.ones((3, 64), np.float32)
    pair = _npz_pair(tmp_path, {"step0.layer5.l_out": y}, {"step0.layer5.l_out": y})
    assert_one_line_error(*run(capsys, "compare", *pair, "--model", model), "it has layer 5")



def test_npz_mode_refuses_the_options_of_a_prompt_run(capsys, tmp_path):
    """--tokens 3, --against hf or --raw beside two recordings were ignored, exit 0."""
    x = np.ones((3, 8), np.float32)
    pair = _npz_pair(tmp_path, {"step0.inp_embd": x}, {"step0.inp_embd": x})
    assert_one_line_error(*run(capsys, "compare", *pair, "--tokens", "3", "--against", "hf"),
                          "--against, --tokens: for a run from a prompt", "leave them out")
    assert_one_line_error(*run(capsys, "compare", *pair, "--raw"), "--raw: for a run from a prompt", "leave it out")
    assert run(capsys, "compare", *pair, "--layer", "0")[0] == 0          # its own options still work


def test_recordings_of_prompts_of_different_lengths_are_refused_not_a_divergence(capsys, tmp_path):
    """Two recordings of a 5- and a 6-token prompt: 'first divergence: step 0, freqs_cis (shapes
    differ)', exit 3, as if the models differed."""
    a, b = np.ones((5, 8), np.float32), np.ones((6, 8), np.float32)
    pair = _npz_pair(tmp_path, {"step0.inp_embd": a, "step0.layer0.l_out": a},
                     {"step0.inp_embd": b, "step0.layer0.l_out": b})
    assert_one_line_error(*run(capsys, "compare", *pair), "record prompts of different lengths (5 and 6 tokens",
                          "same prompt")
    same = _npz_pair(tmp_path, {"step0.inp_embd": a}, {"step0.inp_embd": a * 2})
    assert run(capsys, "compare", *same)[0] == 3                 # the same length: a divergence, as before


def test_npz_mode_errors(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")), "a.npz",
                          "no such file")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    np.savez(tmp_path / "ok.npz", x=np.zeros(2))
    assert_one_line_error(*run(capsys, "compare", str(tmp_path / "bad.npz"), str(tmp_path / "ok.npz")), "bad.npz",
                          "not an .npz (zip) archive", "trace --npz")     # not numpy's "load it unsafely" advice
    np.save(tmp_path / "one.npy", np.zeros(2))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    code, out, err = run(capsys, "compare", str(tmp_path / "one.npz"), str(tmp_path / "ok.npz"))
    assert_one_line_error(code, out, err, "one.npz", "not an .npz (zip) archive")
    assert "pickle" not in err
    np.savez(tmp_path / "empty.npz")          # np.load's EOFError was click's Abort: "interrupted", exit 130
    for pair in (("empty.npz", "ok.npz"), ("empty.npz", "empty.npz")):   # two empties: "no divergence" in 0 stages
        assert_one_line_error(*run(capsys, "compare", *(str(tmp_path / p) for p in pair)), "empty.npz",
                              "no stage's array")
    (tmp_path / "dir.npz").mkdir()
    assert_one_line_error(*run(capsys, "compare", str(tmp_path / "ok.npz"), str(tmp_path / "dir.npz")), "dir.npz",
                          "is a directory")
    assert_one_line_error(*run(capsys, "compare", str(tmp_path / "ok.npz"), str(tmp_path / "ok.npz")),
                          "'x' is not a stage key")
    assert_one_line_error(*run(capsys, "compare", "a", "b", "c"), "one prompt or two .npz files")
    assert_one_line_error(*run(capsys, "compare", str(tmp_path / "ok.npz"), "model.gguf"),
                          "compare model.gguf: not a .npz recording")
    assert_one_line_error(*run(capsys, "compare", "hi", "--threshold", "-1"), "--threshold")
    assert_one_line_error(*run(capsys, "compare", "hi", "--sort", "best"), "--sort")
    assert_one_line_error(*run(capsys, "compare", "hi", "--against", "vllm"), "vllm", "llama.cpp, hf")


def test_says_how_to_install_llamacpp(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert_one_line_error(*run(capsys, "compare", "hi", "--against", "llama.cpp"),
                          "llama-cpp-python is not installed", 'pip install -e ".[llamacpp]"',
                          "docs/comparing.md#installing-llama-cpp-python")


@pytest.mark.parametrize("missing, words", [
    ({"accelerate"}, "accelerate is not installed in this Python: pip install accelerate"),
    ({"transformers", "accelerate"}, "transformers and accelerate are not installed in this Python: "
                                     "pip install transformers accelerate"),
    ({"torch", "transformers", "accelerate"}, "torch, transformers and accelerate are not installed"),
])
def test_names_exactly_the_missing_hf_modules(capsys, monkeypatch, missing, words):
    # the others pretend to be installed: find_spec only asks whether a module can be found
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else object())
    assert_one_line_error(*run(capsys, "compare", "hi", "--against", "hf"), "--against hf", words)


def test_one_npz_file_asks_for_two(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "compare", tmp_path / "a.npz"), "give two .npz files",
                          "or a prompt with --against")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_live_against_llamacpp(capsys, smollm2_path):
    code, out, err = run(capsys, "compare", "--model", str(smollm2_path), "--raw", "The capital of France is",
                         "--tokens", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["first_divergence"] is None and report["settings"]["flash_attn"] is False
    paired = {(r["step"], r["layer"], r["stage"]) for r in report["rows"] if r["status"] == "ok"}
    layer_stages = {s.id for s in STAGES if s.level == "layer" and s.id in PAIRED}
    assert all((step, layer, st) in paired for step in (0, 1) for layer in range(30) for st in layer_stages)
    assert all(a["ours"] == a["reference"] for a in report["argmax"])


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_live_hooked_fault_is_the_first_divergence(smollm2):
    ids = smollm2.tokenizer.encode("The capital of France is")
    with smollm2.hooks({"Kcur_rope": _perturb}, layers=[3]):
        result = cmp.compare_with_llamacpp(smollm2, ids, 1)
    first = result.first_divergence
    assert (first.step, first.layer, first.stage) == (0, 3, "Kcur_rope")
    assert all(r.status == "ok" for r in result.rows if cmp.forward_order(stage_key(r.step, r.layer, r.stage))
               < cmp.forward_order("step0.layer3.Kcur_rope") and r.rel_rms_err is not None)


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "accelerate")),
                    reason="torch, transformers or accelerate is not installed")
def test_live_against_hf(capsys, smollm2_path):
    # fp32 both sides: agreement far tighter than llama.cpp's, at every stage HF has a module for
    code, out, err = run(capsys, "compare", "--model", str(smollm2_path), "--raw", "The capital of France is",
                         "--tokens", "1", "--against", "hf", "--threshold", "1e-4", "--json")
    assert code == 0, err
    report = json.loads(out)
    paired = {r["stage"] for r in report["rows"] if r["status"] == "ok"}
    assert {"Qcur_heads", "Kcur", "kq_soft_max", "ffn_swiglu", "l_out", "result_output"} <= paired
    assert report["first_divergence"] is None


HF_MISSING = any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "accelerate"))


@pytest.mark.skipif(HF_MISSING, reason="torch, transformers or accelerate is not installed")
@pytest.mark.parametrize("arch", ["qwen2", "phi3", "gemma2", "gemma3"])
def test_live_against_hf_on_each_architecture(capsys, tmp_path, arch):
    """Every stage HF has a module for pairs with ours, in our layout (bias adds, fused
    projections split, per-head norms, post-norms, GeGLU). qwen2 and phi3 agree to 1e-4; on the
    Gemma files transformers 5.24's GGUF loader keeps its own query scale and soft-caps (the
    report names them), so HF departs from the file at layer 0's kq_soft_max and not before."""
    from arch_files import write_arch_file
    path = write_arch_file(tmp_path / f"tiny-{arch}.gguf", arch)
    code, out, err = run(capsys, "compare", "--model", str(path), "--raw", "Hello world, this is a test",
                         "--tokens", "1", "--against", "hf", "--threshold", "1e-4", "--json")
    report = json.loads(out)
    paired = {r["stage"] for r in report["rows"] if r["status"] == "ok"}
    glu = "ffn_geglu" if arch.startswith("gemma") else "ffn_swiglu"
    assert {"attn_norm", "Qcur_heads", "Kcur_heads", "kqv_out", "ffn_norm", "ffn_gate", "ffn_up", glu,
            "l_out", "result_norm"} <= {r["stage"] for r in report["rows"] if r["status"] != "only ours"}
    if arch in ("qwen2", "phi3"):
        assert code == 0, err
        assert report["first_divergence"] is None
        assert {"Qcur_b", "Vcur_b"} <= paired if arch == "qwen2" else {"Qcur", "Kcur", "Vcur"} <= paired
    else:
        assert code == 3
        first = report["first_divergence"]
        assert (first["step"], first["layer"], first["stage"]) == (0, 0, "kq_soft_max")
        assert {"attn_norm", "Qcur_heads", "Vcur_heads"} <= paired
        assert "query scale 0.0625" in report["settings"]["reads the file otherwise"]
        if arch == "gemma3":
            assert {"inp_scaled", "Qcur_normed", "Kcur_normed"} <= paired


@pytest.mark.skipif(HF_MISSING, reason="torch, transformers or accelerate is not installed")
def test_live_against_hf_on_the_gemma3_file(capsys, gemma3_path):
    """The real Gemma 3 270M file: transformers reads it as we do; every paired stage within 1e-4."""
    code, out, err = run(capsys, "compare", "--model", str(gemma3_path), "The capital of France is",
                         "--tokens", "1", "--against", "hf", "--threshold", "1e-4", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["first_divergence"] is None and "reads the file otherwise" not in report["settings"]
    paired = {r["stage"] for r in report["rows"] if r["status"] == "ok"}
    assert {"inp_scaled", "Qcur_normed", "Kcur_normed", "attn_post_norm", "ffn_post_norm", "ffn_geglu"} <= paired


def test_a_model_of_another_architecture_is_one_error_line(tmp_path, capsys):
    """compare R R --model M where M has the recording's width and depth but is another architecture
    (qwen2's recording, a qwen3 or phi3 file) was an internal error (TypeError, 'cannot reshape'): now
    one line, as is a key that is no stage's or a 0-d array."""
    from arch_files import write_arch_file
    paths = {a: write_arch_file(tmp_path / f"{a}.gguf", a) for a in ("qwen2", "qwen3", "phi3")}
    recs = {}
    for a, path in paths.items():
        recs[a] = tmp_path / f"{a}.npz"
        code, out, err = run(capsys, "trace", "-m", path, "--raw", "ab cd", "--npz", recs[a])
        assert code == 0, err
    assert_one_line_error(*run(capsys, "compare", recs["qwen2"], recs["qwen2"], "-m", paths["qwen3"]),
                          "is not the model of", "Qcur_b, a stage this model does not compute")
    assert_one_line_error(*run(capsys, "compare", recs["phi3"], recs["phi3"], "-m", paths["qwen2"]),
                          "give the model the recording")
    bad = tmp_path / "bad.npz"
    np.savez(bad, **{"step0.inp_embd": np.float32(1.0)})
    assert_one_line_error(*run(capsys, "compare", bad, bad, "-m", paths["qwen2"]), "a single number")
    np.savez(bad, foo=np.zeros(3, np.float32))
    assert_one_line_error(*run(capsys, "compare", bad, bad, "-m", paths["qwen2"]), "step0.layer0.Qcur")


def test_sort_worst_orders_the_json_rows_too(tmp_path, capsys, tiny_model_path):
    """--sort worst changed the table only; --json kept the forward order (the help's own example
    is `--sort worst --json`)."""
    from llamatrace.kernels.int8 import act8
    if not act8.available():
        pytest.skip("q8 needs AVX2")
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    for path, mode in ((a, "f32"), (b, "q8")):
        code, out, err = run(capsys, "trace", "-m", tiny_model_path, "--raw", "--npz", path, "--activations", mode,
                             "the cat")
        assert code == 0, err
    rows = {}
    for order in ("forward", "worst"):
        code, out, err = run(capsys, "compare", a, b, "--sort", order, "--json", "--threshold", "1")
        assert code == 0, err
        rows[order] = [r["rel_rms_err"] for r in json.loads(out)["rows"] if r["rel_rms_err"] is not None]
    assert rows["worst"] == sorted(rows["forward"], reverse=True) != rows["forward"]


def test_a_layer_or_stage_selection_that_compares_nothing_is_refused(tmp_path, capsys):
    """It passed with an empty table ('no divergence (0)'): a --layer the recordings do not hold, a
    --stage recorded at none of the chosen layers (Qwen3.5's Qcur at layer 0, a DeltaNet layer); the
    range error counted the recorded layers as the model's ('this model has 1 layers')."""
    from qwen35_files import write_qwen35_file
    path = write_qwen35_file(tmp_path / "qwen35.gguf")
    rec = tmp_path / "r.npz"
    code, out, err = run(capsys, "trace", "-m", path, "--raw", "--layer", "0,2", "--npz", rec, "ab cd")
    assert code == 0, err
    assert_one_line_error(*run(capsys, "compare", rec, rec, "--layer", "1"),
                          "--layer '1' selects none of them: the recordings hold layers 0, 2")
    assert_one_line_error(*run(capsys, "compare", rec, rec, "--layer", "7"), "the recordings hold layers 0, 2")
    assert_one_line_error(*run(capsys, "compare", rec, rec, "--layer", "0", "--stage", "Qcur"),
                          "--stage Qcur is recorded at none of --layer 0's layers")
    code, out, err = run(capsys, "compare", rec, rec, "--layer", "0-2", "--stage", "Qcur", "--json")
    assert code == 0, err
    assert {(r["layer"], r["stage"]) for r in json.loads(out)["rows"]} == {(2, "Qcur")}


def test_layer_lists_read_as_ranges():
    """'the recordings hold layers 0, 1, 2, 3, 4, 5 … 29' hid which layers were there."""
    from llamatrace.tracing.stages import layer_list
    assert layer_list(range(30)) == "0-29"
    assert layer_list([0, 1, 3]) == "0, 1, 3"
    assert layer_list([0, 2, 3, 4, 5, 9]) == "0, 2-5, 9"
    assert layer_list([3, 7, 11, 15]) == "3, 7, 11, 15"                    # a hybrid's attention layers
    assert layer_list(range(0, 48, 2)) == "0, 2, 4, 6, 8, 10 … 46"
