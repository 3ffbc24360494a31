"""Attention tensors in every layout llama.cpp 0.3.36 loads (``create_tensor_qkv``), in every family:
q|k|v fused as one ``attn_qkv`` (``convert_hf_to_gguf.py --fuse-qkv``) or apart, their biases fused,
apart or absent, and a llama file's optional ``attn_output.bias``.

The variant files are written at test time by ``tests/layout_files.py``; llama.cpp's float32 logits on
the same bytes are in ``tests/golden/layout_llamacpp.npz``, made by
``tests/golden/make_layout_golden.py``. Before, a fused file was refused at its first missing
``attn_q``, a llama file with biases was refused as holding tensors the pass never reads, and a
qwen2 file without biases was refused for want of them.
"""

from __future__ import annotations

import importlib.util
import json

import gguf
import numpy as np
import pytest

from arch_files import golden_arrays, relative, run_positions, write_arch_file
from cli_helpers import assert_one_line_error, run
from gguf_factory import rewrite_metadata, write_tiny_llama
from gptoss_files import write_gptoss_file
from layout_files import LAYOUTS, relayout, write_layout_file
from moe_files import write_moe_file
from qwen35_files import write_qwen35_file

from llamatrace.errors import ModelFormatError, PeerError, UnsupportedModelError
from llamatrace.gguf.reader import open_gguf
from llamatrace.model.config import ModelConfig
from llamatrace.model.llama import Llama
from llamatrace.tracing.recorder import Recorder

T = gguf.GGMLQuantizationType
PREFILL = 4                      # make_layout_golden.py's decode run: 4 tokens in one batch, then one a step
F32_RTOL = 1e-4                  # relative L2 distance per position, as test_arch's


@pytest.fixture(scope="module")
def llamacpp():
    return golden_arrays("layout_llamacpp.npz")


@pytest.fixture(scope="module")
def layout_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    return {name: write_layout_file(d / f"{name}.gguf", name) for name in LAYOUTS}


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_matches_llamacpp_in_a_batch_and_in_decode_steps(name, layout_paths, llamacpp):
    model = Llama.load(layout_paths[name], cache=False)
    ids = llamacpp[f"{name}_ids"]
    for run_name, prefill in (("prefill", len(ids)), ("decode", PREFILL)):
        ours, ref = run_positions(model, ids, prefill), llamacpp[f"{name}_{run_name}"]
        rel = relative(ours, ref)
        assert rel.max() <= F32_RTOL, (name, run_name, rel)
        assert (ours.argmax(1) == ref.argmax(1)).all(), (name, run_name)


def test_the_config_says_how_each_file_stores_its_attention(layout_paths):
    def flags(name):
        c = ModelConfig.from_gguf(open_gguf(layout_paths[name]))
        return c.fused_qkv, c.qkv_bias, c.attn_out_bias
    assert flags("llama_biases") == (False, True, True)
    assert flags("qwen2_fused") == (True, True, False)
    assert flags("qwen2_no_biases") == (False, False, False)
    assert flags("phi3_split") == (False, False, False)
    assert flags("qwen3moe_fused") == (True, False, False)
    assert flags("gptoss_fused") == (True, True, True)


def _plain_and_fused(tmp_path, family: str):
    plain = tmp_path / f"{family}.gguf"
    if family == "llama":
        write_tiny_llama(plain, qtype=T.F32)
    elif family in ("qwen3moe", "mixtral", "olmoe"):
        write_moe_file(plain, family)
    elif family == "gpt-oss":
        write_gptoss_file(plain)
    elif family == "qwen35":
        write_qwen35_file(plain)
    else:
        write_arch_file(plain, family)
    return plain, relayout(plain, tmp_path / f"{family}-fused.gguf", fuse=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3moe", "mixtral", "olmoe",
                                    "gpt-oss", "qwen35"])
def test_fused_qkv_gives_the_logits_of_the_same_weights_apart(family, tmp_path):
    """Same weights, same kernels: the fused rows are packed as the three matrices (bit for bit)."""
    plain, fused = _plain_and_fused(tmp_path, family)
    c = ModelConfig.from_gguf(open_gguf(fused))
    assert c.fused_qkv                                       # every attention layer (Qwen3.5: 1 in 4)
    ids = np.array([5, 17, 33, 2, 9, 100, 44, 7])
    want = run_positions(Llama.load(plain, cache=False), ids, PREFILL)
    got = run_positions(Llama.load(fused, cache=False), ids, PREFILL)
    np.testing.assert_array_equal(got, want)


def test_fused_qkv_in_the_q8_mode_and_in_one_layer_only(tmp_path):
    """llama.cpp decides per layer; so does the loader: layer 0 fused, layer 1 apart."""
    plain = write_arch_file(tmp_path / "q.gguf", "qwen2", qtype=T.Q8_0)
    one = relayout(plain, tmp_path / "one.gguf", fuse=True, layers=(0,))
    assert not ModelConfig.from_gguf(open_gguf(one)).fused_qkv
    ids = np.array([5, 17, 33, 2, 9])
    want = run_positions(Llama.load(plain, activations="q8", cache=False), ids, 3)
    got = run_positions(Llama.load(one, activations="q8", cache=False), ids, 3)
    np.testing.assert_array_equal(got, want)


def test_biases_in_some_layers_only_are_refused_in_one_line_naming_the_first_missing(tmp_path, capsys):
    plain = write_tiny_llama(tmp_path / "l.gguf", qtype=T.F32)
    half = relayout(plain, tmp_path / "half.gguf",
                    biases={f"blk.0.attn_{x}.bias": np.zeros(n, np.float32) for x, n in (("q", 64), ("k", 32), ("v", 32))})
    with pytest.raises(ModelFormatError, match="blk.1.attn_q.bias"):
        Llama.load(half, cache=False)
    assert_one_line_error(*run(capsys, "generate", "-m", half, "--raw", "hi", "-n", "1"), "blk.1.attn_q.bias")
    # the output bias is all or nothing too: in layer 0 only, it is a tensor the pass never reads
    odd = relayout(plain, tmp_path / "odd.gguf", biases={"blk.0.attn_output.bias": np.zeros(64, np.float32)})
    with pytest.raises(UnsupportedModelError, match="blk.0.attn_output.bias"):
        Llama.load(odd, cache=False)


def test_a_missing_projection_names_both_layouts(tmp_path, capsys):
    path = write_arch_file(tmp_path / "b.gguf", "qwen3", skip_tensors=("blk.1.attn_k.weight",))
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"),
                          "blk.1.attn_k.weight", "blk.1.attn_qkv.weight")


def test_llama_biases_are_traced_as_stages_and_fused_weights_named_as_the_file_holds_them(layout_paths, capsys):
    model = Llama.load(layout_paths["llama_biases"], cache=False)
    rec = Recorder()
    model.forward(np.array([5, 6, 7]), 0, model.new_cache(4), recorder=rec)
    stages = {(e.layer, e.stage) for e in rec.events}
    assert {(1, "Qcur_b"), (1, "Kcur_b"), (1, "Vcur_b")} <= stages
    code, out, err = run(capsys, "trace", "-m", layout_paths["qwen2_fused"], "--raw", "--layer", "0",
                         "--dump-shapes", "hi")
    assert code == 0, err
    assert "shape([?])" not in out and "attn_wq weights shape([64 64]) -> tensor xq" in out


def test_compare_against_hf_refuses_a_layout_transformers_does_not_read(layout_paths):
    from llamatrace.analysis.compare import run_hf
    for name in ("llama_biases", "qwen2_fused", "qwen2_no_biases"):
        c = ModelConfig.from_gguf(open_gguf(layout_paths[name]))
        with pytest.raises(PeerError, match="use --against llama.cpp"):
            run_hf(layout_paths[name], c, [1, 2], [])


def test_generate_runs_on_a_fused_moe_file(layout_paths, capsys):
    code, out, err = run(capsys, "generate", "-m", layout_paths["qwen3moe_fused"], "--raw", "the cat", "-n", "3",
                         "--json")
    assert code == 0, err
    assert len(json.loads(out)["ids"]) >= 1


def test_mixtral_files_with_one_tensor_per_expert_are_refused_in_one_line(tmp_path, capsys):
    """Early Mixtral GGUFs stored blk.N.ffn_gate.E.weight, one 2-D tensor per expert."""
    def one_per_expert(r):
        for t in r.tensors:
            if t.name.endswith("_exps.weight"):
                for e in range(t.data.shape[0]):
                    yield t.name.replace("_exps.weight", f".{e}.weight"), np.ascontiguousarray(t.data[e]), t.tensor_type
            else:
                yield t.name, np.asarray(t.data), t.tensor_type
    split = rewrite_metadata(write_moe_file(tmp_path / "m.gguf", "mixtral"), tmp_path / "split.gguf", {},
                             tensors=one_per_expert)
    assert_one_line_error(*run(capsys, "generate", "-m", split, "--raw", "hi", "-n", "1"),
                          "blk.0.ffn_gate.0.weight", "re-convert")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("name", ["qwen2_fused", "llama_biases", "gptoss_fused"])
def test_compare_against_llamacpp_pairs_the_fused_projections(name, layout_paths, capsys):
    code, out, err = run(capsys, "compare", "--model", layout_paths[name], "--raw", "the cat sat on the mat and",
                         "--tokens", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["first_divergence"] is None
    paired = {r["stage"] for r in report["rows"] if r["status"] == "ok"}
    assert {"Qcur_b", "Kcur_b", "Vcur_b", "Qcur_heads", "Vcur_heads"} <= paired


def test_llamacpps_fused_wqkv_tensors_are_split_as_the_loader_splits_attn_qkv(layout_paths):
    """Offline, on arrays laid out as the llama-cpp-python adapter gives them (ggml dims reversed)."""
    from types import SimpleNamespace

    from llamatrace.analysis.compare import llamacpp_stage_arrays
    from llamatrace.tracing.recorder import stage_key
    c = ModelConfig.from_gguf(open_gguf(layout_paths["qwen2_fused"]))
    seq_len, width = 3, c.q_dim + 2 * c.kv_dim
    qkv = np.arange(seq_len * width, dtype=np.float32).reshape(1, 1, seq_len, width)
    rope = np.zeros((1, seq_len, c.n_heads, c.head_dim), np.float32)
    got = llamacpp_stage_arrays([SimpleNamespace(name="wqkv-0", op="MUL_MAT", array=qkv),
                                 SimpleNamespace(name="wqkv_b-0", op="ADD", array=qkv + 1),
                                 SimpleNamespace(name="Qcur-0", op="ROPE", array=rope)], 0, 0, seq_len, c)
    rows = qkv.reshape(seq_len, width)
    np.testing.assert_array_equal(got[stage_key(0, 0, "Kcur")], rows[:, c.q_dim:c.q_dim + c.kv_dim])
    np.testing.assert_array_equal(got[stage_key(0, 0, "Vcur_b")], rows[:, c.q_dim + c.kv_dim:] + 1)
    assert got[stage_key(0, 0, "Qcur_heads")].shape == (seq_len, c.n_heads, c.head_dim)
    np.testing.assert_array_equal(got[stage_key(0, 0, "Qcur_heads")].reshape(seq_len, -1), rows[:, :c.q_dim] + 1)


def test_info_shows_the_layout_the_file_has(layout_paths, capsys):
    code, out, err = run(capsys, "info", "-m", layout_paths["qwen2_fused"], "--json")
    assert code == 0, err
    config = json.loads(out)["config"]
    assert config["fused_qkv"] is True and config["qkv_bias"] is True
    code, out, err = run(capsys, "info", "-m", layout_paths["qwen2_no_biases"], "--json")
    assert "qkv_bias" not in json.loads(out)["config"]           # plain Llama's default, not shown
