"""The commands on a Qwen3.5 (``qwen35``) file that tests/test_qwen35.py and the corpus tests
(test_imatrix_qwen35.py, test_quantize_search_qwen35.py) leave out: ``bench`` (the memory per token
and the fixed state), ``trace --dump-shapes`` and ``--npz`` (the state itself), the page
(``diagram -o run.html``), ``lens`` and ``compare`` of two recordings. Tiny file, few tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import run
from qwen35_files import N_LAYERS, N_V_HEADS, SSM_HEAD_DIM, write_qwen35_file

RECURRENT = (0, 1, 3)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_qwen35_file(tmp_path_factory.mktemp("qwen35-commands") / "qwen35.gguf")


def test_bench_reports_the_memory_per_token_and_the_fixed_state(path, capsys):
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    from llamatrace.model.llama import Llama
    with open_gguf(path) as f:
        c = ModelConfig.from_gguf(f)
    with Llama.load(path, cache=False) as model:                # what the cache really holds
        small, big = model.new_cache(4), model.new_cache(20)
    per_token, state = (big.nbytes - small.nbytes) // 16, small.state_nbytes
    assert (per_token, state) == (256, 16_896)                  # as `info` shows them (test_qwen35.py)
    code, out, err = run(capsys, "bench", "-m", path, "--prompt-tokens", "4", "--decode-tokens", "2",
                         "--repeats", "1", "--threads", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["kv_bytes_per_token"], report["state_bytes"]) == (per_token, state)
    assert (report["n_attn_layers"], report["n_recurrent_layers"]) == (len(c.attn_layers), len(RECURRENT))
    code, out, err = run(capsys, "bench", "-m", path, "--prompt-tokens", "4", "--decode-tokens", "2",
                         "--repeats", "1", "--threads", "1")
    assert code == 0, err
    text = " ".join(out.split())
    assert "memory per token 256 bytes (KV of the 1 attention layer," in text
    assert "recurrent state 16,896 bytes, fixed (conv + DeltaNet state of 3 layers" in text


def test_trace_dump_shapes_and_npz_hold_the_state(path, tmp_path, capsys):
    code, out, err = run(capsys, "trace", "-m", path, "--raw", "--layer", "0", "--dump-shapes", "the cat sat")
    assert code == 0, err
    text = out + err
    assert "attn_qkv weights shape([128 64])" in text                   # 2 key heads × 2 (q, k) + 4 value heads, × 16
    assert "Writing the DeltaNet state S shape([4 16 16]) of layer 0" in text     # 0-based, as ↳ L0
    npz = tmp_path / "t.npz"
    code, out, err = run(capsys, "trace", "-m", path, "--raw", "--tokens", "2", "--npz", npz, "the cat sat")
    assert code == 0, err
    with np.load(npz) as z:
        keys = set(z.files)
        for layer in RECURRENT:
            assert z[f"step0.layer{layer}.new_state"].shape == (N_V_HEADS, SSM_HEAD_DIM, SSM_HEAD_DIM)
        # a decode step starts from the state the prefill left
        np.testing.assert_array_equal(z["step1.layer0.state_predelta"], z["step0.layer0.new_state"])
    assert "step0.layer2.attn_gated" in keys and "step0.layer2.new_state" not in keys


def test_compare_two_recordings_of_qwen35(path, tmp_path, capsys):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    for out_file in (a, b):
        code, _, err = run(capsys, "trace", "-m", path, "--raw", "--tokens", "1", "--npz", out_file, "the cat")
        assert code == 0, err
    code, out, err = run(capsys, "compare", a, b, "--model", path, "--json")
    assert code == 0, err
    doc = json.loads(out)
    rows = doc["rows"] if isinstance(doc, dict) and "rows" in doc else doc
    stages = {r["stage"] for r in rows}
    assert {"new_state", "linear_attn_out", "attn_gated"} <= stages


def test_page_of_a_qwen35_diagram_draws_each_kind_of_layer(path, tmp_path, capsys):
    """One drawing per kind of layer, each with its own stages: the page used to draw layer 0 (DeltaNet)
    and show it, relabelled, for the attention layer 2 too."""
    import re
    html = tmp_path / "run.html"
    code, out, err = run(capsys, "diagram", "-m", path, "--raw", "the cat", "-o", html)
    assert code == 0, err
    page = html.read_text()
    data = json.loads(re.search(r'<script id="run-data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert data["layer_kinds"] == ["deltanet", "deltanet", "attn", "deltanet"] and data["drawn_layers"] == {
        "deltanet": 0, "attn": 2}
    svgs = dict(re.findall(r'<div class="svg" data-key="([^"]+)" hidden>(.*?)</div>', page, re.S))
    nodes = {key: set(re.findall(r"<title>([^<]+)</title>", svg)) for key, svg in svgs.items()}
    assert {"new_state", "linear_attn_out"} <= nodes["block:0:deltanet"] and "kq_soft_max" not in nodes["block:0:deltanet"]
    assert {"Qcur", "kq_soft_max", "attn_gated"} <= nodes["block:0:attn"] and "new_state" not in nodes["block:0:attn"]


def test_lens_reads_every_layer_of_qwen35(path, capsys):
    from llamatrace.model.llama import Llama
    code, out, err = run(capsys, "lens", "-m", path, "--raw", "the cat sat", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {r["layer"] for r in doc["rows"]} == {"embd", *range(N_LAYERS)}
    last = max(r["pos"] for r in doc["rows"])
    top = next(r for r in doc["rows"] if r["layer"] == N_LAYERS - 1 and r["pos"] == last)
    with Llama.load(path, cache=False) as model:           # the last layer's row is the model's own output
        logits = model.forward(np.array(doc["prompt_ids"]), 0, model.new_cache(len(doc["prompt_ids"])))
    assert top["top_id"] == doc["final_id"] == int(np.argmax(logits)) and top["final_rank"] == 0


def test_a_stage_of_the_other_layer_kind_is_refused_with_the_layers_that_compute_it(path, capsys):
    """--ablate linear_attn_out@2 (an attention layer) said 'ablating' and changed nothing; trace
    --layer 2 --stage new_state printed no event and exited 0."""
    from cli_helpers import assert_one_line_error
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "-n", "1", "--ablate", "linear_attn_out@2",
                               "hi"), "linear_attn_out is not computed at layer 2, a softmax-attention layer",
                          "give one of layers 0, 1, 3")
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "-n", "1", "--ablate", "attn_out@-4", "hi"),
                          "attn_out is not computed at layer 0, a gated DeltaNet layer", "give layer 2")
    assert_one_line_error(*run(capsys, "trace", "-m", path, "--raw", "--layer", "2", "--stage", "new_state", "hi"),
                          "--stage 'new_state'", "give one of layers 0, 1, 3")
    assert_one_line_error(*run(capsys, "trace", "-m", path, "--raw", "--layer", "0,1", "--stage", "Kcur*", "hi"),
                          "--stage 'Kcur*'", "computed only in layers 2, none of --layer's")
    code, out, err = run(capsys, "trace", "-m", path, "--raw", "--layer", "1,2", "--stage", "new_state", "--jsonl",
                         "-", "hi")                                  # one layer of the two computes it
    assert code == 0, err
    assert [json.loads(x)["layer"] for x in out.splitlines()[1:-1]] == [1]
    code, out, err = run(capsys, "stages", "-m", path, "--json")
    assert code == 0, err
    rows = {r["id"]: r for r in json.loads(out)}
    assert rows["Qcur_full"]["model_shape"] == "[seq_len, 128]"      # 2*q_dim: query and gate, both evaluated
    # the model's own stages, each with the layers that compute it (it listed all 86, MoE and softcaps too)
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    from llamatrace.tracing.stages import model_stage_ids
    with open_gguf(path) as f:
        assert set(rows) == model_stage_ids(ModelConfig.from_gguf(f))
    assert "ffn_moe_logits" not in rows and "kq_softcap" not in rows
    assert rows["Qcur"]["layers"] == [2] and rows["Qcur"]["when"] == "layers 2"
    assert rows["new_state"]["layers"] == [0, 1, 3] and rows["l_out"]["layers"] == [0, 1, 2, 3]
    traced = run(capsys, "trace", "-m", path, "--raw", "--tokens", "1", "--jsonl", "-", "hi")[1]
    assert {json.loads(x)["stage"] for x in traced.splitlines()[1:-1]} <= set(rows)


def test_a_deltanet_head_can_be_ablated(path, tmp_path, capsys):
    """beta_sigmoid@0:1 said 'beta_sigmoid [seq_len, ssm_n_v_heads] has no heads axis'. With β = 0 value
    head 1 writes nothing, so its state stays the zeros a prefill starts from; the other heads' do not."""
    npz = tmp_path / "t.npz"
    code, out, err = run(capsys, "trace", "-m", path, "--raw", "--layer", "0", "--stage", "new_state", "--npz", npz,
                         "--ablate", "beta_sigmoid@0:1", "the cat sat")
    assert code == 0, err
    with np.load(npz) as z:
        state = z["step0.layer0.new_state"]
    assert not state[1].any() and all(state[h].any() for h in (0, 2, 3))
    from cli_helpers import assert_one_line_error
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "-n", "1", "--ablate", "beta_sigmoid@0:4",
                               "hi"), "head 4 is out of range; beta_sigmoid has 4 value heads (0-3)")


def test_a_qwen35moe_recording_against_itself_adds_no_error(tmp_path, capsys):
    """compare R R --model: each stage recomputed from the recording's own inputs adds exactly 0. l_out
    left the shared expert out, so every layer 'added' 0.34 and the run ended in a false divergence."""
    moe = write_qwen35_file(tmp_path / "qwen35moe.gguf", moe=True)
    rec = tmp_path / "r.npz"
    code, out, err = run(capsys, "trace", "-m", moe, "--raw", "ab cd", "--npz", rec)
    assert code == 0, err
    code, out, err = run(capsys, "compare", rec, rec, "--model", moe, "--json")
    assert code == 0, err
    doc = json.loads(out)
    rows = doc["rows"] if isinstance(doc, dict) and "rows" in doc else doc
    l_out = [r for r in rows if r["stage"] == "l_out"]
    assert len(l_out) == N_LAYERS and all(r["local_err"] == 0.0 for r in l_out)
