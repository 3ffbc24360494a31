"""Every command on the mixture-of-experts files (issue 49's "Done when"), the ones no other test
runs there: ``trace --npz``, ``lens``, ``attention``, ``compare`` (two ``.npz``: ours against the
replay of llama.cpp's graph tensors, as tests/test_compare.py does without llama-cpp-python),
``collect`` (TL's MoE hook names and stage ids) and ``bench``'s cost of a token.

Run elsewhere on MoE files: generate, trace (log, --dump-shapes, --jsonl), diagram and the page,
perplexity and --stages (tests/test_moe.py, tests/test_gptoss.py, tests/test_experts.py,
tests/test_perplexity_moe.py); imatrix, quantize and the recipe search (tests/test_imatrix_moe.py,
tests/test_quantize_moe.py, tests/test_quantize_search_moe.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from cli_helpers import run
from gptoss_files import write_gptoss_file
from moe_files import ARCHS, SPECS, write_moe_file

from llamatrace.analysis import compare as cmp
from llamatrace.model.llama import Llama

GOLDEN = Path(__file__).parent / "golden"
NAMES = (*ARCHS, "gpt-oss")
PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-commands")
    out = {a: write_moe_file(d / f"tiny-{a}.gguf", a) for a in ARCHS}
    out["gpt-oss"] = write_gptoss_file(d / "tiny-gpt-oss.gguf")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_trace_npz_holds_each_chosen_experts_rows(name, paths, capsys, tmp_path):
    npz = tmp_path / "t.npz"
    code, _, err = run(capsys, "trace", "-m", paths[name], "--raw", "--tokens", "1", "--npz", npz, PROMPT)
    assert code == 0, err
    c = Llama.load(paths[name]).config
    with np.load(npz) as z:
        for step in (0, 1):
            ids = z[f"step{step}.layer0.ffn_moe_topk"]
            n = len(ids)
            assert ids.dtype.kind == "i" and ids.shape == (n, c.n_expert_used) and 0 <= ids.min() and ids.max() < c.n_expert
            down = z[f"step{step}.layer0.ffn_moe_down"]
            assert down.shape == (n, c.n_expert_used, c.dim)
            weighted = z[f"step{step}.layer0.ffn_moe_weighted"]
            np.testing.assert_allclose(weighted.sum(axis=1), z[f"step{step}.layer0.ffn_moe_out"], rtol=1e-5, atol=1e-6)
        assert len(z["step1.layer0.ffn_moe_topk"]) == 1


@pytest.mark.parametrize("name", NAMES)
def test_lens_reads_the_moe_residual_stream(name, paths, capsys):
    code, out, err = run(capsys, "lens", "-m", paths[name], "--raw", PROMPT, "--json")
    assert code == 0, err
    got = json.loads(out)
    c = Llama.load(paths[name]).config
    last = [r for r in got["rows"] if r["layer"] == c.n_layers - 1]
    assert {r["layer"] for r in got["rows"]} == {"embd", *range(c.n_layers)}
    assert last[-1]["top_id"] == got["final_id"] and last[-1]["final_rank"] == 0   # the last layer is the model's output


@pytest.mark.parametrize("name", NAMES)
def test_attention_shows_the_traced_pattern(name, paths, capsys, tmp_path):
    code, out, err = run(capsys, "attention", "-m", paths[name], "--raw", PROMPT, "--layer", "1", "--json")
    assert code == 0, err
    got = json.loads(out)
    heads = np.array([[[np.nan if p is None else p for p in row] for row in h["probs"]] for h in got["heads"]])
    model = Llama.load(paths[name])
    with model.trace(stages=["kq_soft_max"], layers=[1], keep_arrays=True) as rec:
        model.forward(np.asarray(got["prompt_ids"]), 0, model.new_cache(16))
    want = np.asarray(rec.arrays()["step0.layer1.kq_soft_max"], dtype=np.float64)
    shown = ~np.isnan(heads)                           # the keys a query cannot see are None
    np.testing.assert_allclose(heads[shown], want.reshape(heads.shape)[shown], rtol=1e-5, atol=1e-7)
    rows = np.nansum(heads, axis=-1)
    assert np.all(rows <= 1 + 1e-5) and (name == "gpt-oss") == bool(np.any(rows < 0.999))   # sinks take a share
    code, out, err = run(capsys, "attention", "-m", paths[name], "--raw", PROMPT, "--layer", "1", "-o", tmp_path / "a.png")
    assert code == 0 and (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_compare_pairs_the_moe_stages_with_the_llamacpp_replay(name, paths, capsys, tmp_path):
    """What ``compare --against llama.cpp`` compares, from two .npz: our trace of the golden ids
    (as ``trace --npz`` writes it) against llama.cpp's graph tensors (tests/golden/make_moe_golden.py)."""
    model = Llama.load(paths[name])
    with np.load(GOLDEN / "moe_llamacpp_dump.npz") as z:
        ids = z[f"{name}.ids"]
        steps: dict[int, list] = {}
        for key in sorted(k for k in z.files if k.startswith(f"{name}.step")):
            _, step, _, rest = key.split(".", 3)
            tensor, op = rest.rsplit(".", 1)
            steps.setdefault(int(step[4:]), []).append(SimpleNamespace(name=tensor, op=op, array=z[key]))
    ref = {}
    for step, captured in steps.items():
        start, seq = (0, 4) if step == 0 else (4, 1)
        ref.update(cmp.llamacpp_stage_arrays(captured, step, start, seq, model.config))
    cache = model.new_cache(8)
    with model.trace(keep_arrays=True) as rec:
        model.forward(ids[:4], 0, cache)
        model.forward(ids[4:], 4, cache)
    np.savez(tmp_path / "ours.npz", **rec.arrays())
    np.savez(tmp_path / "ref.npz", **ref)
    code, out, err = run(capsys, "compare", tmp_path / "ours.npz", tmp_path / "ref.npz", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["first_divergence"] is None
    moe = [r for r in report["rows"] if r["stage"].startswith("ffn_moe_") and r["status"] == "ok"]
    assert {r["stage"] for r in moe} >= {"ffn_moe_logits", "ffn_moe_probs", "ffn_moe_gate", "ffn_moe_down",
                                         "ffn_moe_weighted", "ffn_moe_out"}
    assert {r["layer"] for r in moe} == set(range(SPECS[name]["n_layers"])) and {r["step"] for r in moe} == {0, 1}


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_collect_stores_the_moe_hooks(name, paths, capsys, tmp_path):
    import pyarrow.parquet as pq
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat and the dog ate the bone\n" * 2, encoding="utf-8")
    hooks = ["blocks.1.mlp.hook_expert_weights", "blocks.1.mlp.hook_expert_indices", "ffn_moe_down@0", "ffn_moe_topk@1"]
    code, out, err = run(capsys, "collect", "-m", paths[name], "-f", corpus, "-c", "8",
                         *[a for h in hooks for a in ("--hook", h)], "-o", tmp_path / "acts", "--json")
    assert code == 0, err
    table = pq.read_table(tmp_path / "acts").to_pydict()
    model = Llama.load(paths[name])
    c = model.config
    first = [i for i, s in enumerate(table["sequence"]) if s == 0]
    tokens = np.array([table["token"][i] for i in first])
    with model.trace(stages=["ffn_moe_probs", "ffn_moe_topk", "ffn_moe_down"], keep_arrays=True) as rec:
        model.forward(tokens, 0, model.new_cache(len(tokens)))
    a = rec.arrays()
    got = {h: np.array([table[h][i] for i in first]) for h in hooks}
    assert got[hooks[0]].shape == (len(tokens), c.n_expert) and got[hooks[1]].shape == (len(tokens), c.n_expert_used)
    np.testing.assert_allclose(got[hooks[0]], a["step0.layer1.ffn_moe_probs"], rtol=1e-6)
    np.testing.assert_array_equal(got[hooks[1]], a["step0.layer1.ffn_moe_topk"])
    np.testing.assert_array_equal(got[hooks[3]], a["step0.layer1.ffn_moe_topk"])
    np.testing.assert_allclose(got[hooks[2]], a["step0.layer0.ffn_moe_down"].reshape(len(tokens), -1), rtol=1e-6)


def test_bench_costs_a_token_the_experts_it_goes_through(paths, capsys):
    """A token reads the attention, the router and k of the n experts of each layer (gguf-py's
    reading of the file: the 2-D matrices, and k/n of each 3-D expert tensor)."""
    path = paths["qwen3moe"]
    reader = gguf.GGUFReader(path)
    k, n = SPECS["qwen3moe"]["k"], SPECS["qwen3moe"]["n_expert"]
    mats = [t for t in reader.tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    experts = [t for t in reader.tensors if len(t.shape) == 3]
    assert len(experts) == 3 * SPECS["qwen3moe"]["n_layers"]
    code, out, err = run(capsys, "bench", "-m", path, "--prompt-tokens", "4", "--decode-tokens", "2",
                         "--repeats", "1", "--json")
    assert code == 0, err
    cost = json.loads(out)["cost"]
    assert cost["macs"] == sum(int(t.n_elements) for t in mats) + sum(int(t.n_elements) * k // n for t in experts)
    assert cost["weight_bytes"] == sum(int(t.n_bytes) for t in mats) + sum(int(t.n_bytes) * k // n for t in experts)
