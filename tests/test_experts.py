"""`llamatrace experts` and `llamatrace expert-load`: the routing views of a mixture-of-experts model
(issue 49), on the random-weight MoE files of tests/moe_files.py."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run
from moe_files import SPECS, write_moe_file

from llamatrace.analysis.experts import ExpertLoad, Route, entropy_bits, routes
from llamatrace.model.llama import Llama
from llamatrace.tracing.recorder import Recorder

CORPUS = Path(__file__).parent / "golden" / "corpus.txt"


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return {name: write_moe_file(d / f"{name}.gguf", name) for name in ("qwen3moe", "olmoe")}


def test_routes_are_the_forward_pass_choice_top_k_of_its_own_router_probabilities(moe_paths):
    # the view reads ffn_moe_topk / the applied weights; they must be the k best experts of the
    # router's softmax the same run emitted, best first, renormalised where qwen3moe renormalises
    m = Llama.load(moe_paths["qwen3moe"], fetch=False)
    ids = m.tokenizer.encode("The capital of France is Paris, and of Italy Rome.")
    found = routes(m, ids)
    rec = Recorder(stages=["ffn_moe_logits"], keep_arrays=True)
    m.forward(np.asarray(ids, np.int32), 0, m.new_cache(len(ids)), recorder=rec)
    k, n = SPECS["qwen3moe"]["k"], SPECS["qwen3moe"]["n_expert"]
    assert sorted(found) == list(range(m.config.n_layers))
    for e in rec.events:
        route = found[e.layer]
        logits = e.array.astype(np.float64)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        best = np.argsort(-p, axis=1, kind="stable")[:, :k]
        assert route.ids.shape == (len(ids), k) and route.n_expert == n
        np.testing.assert_array_equal(route.ids, best)
        chosen = np.take_along_axis(p, best, axis=1)
        np.testing.assert_allclose(route.weights, chosen / chosen.sum(axis=1, keepdims=True), rtol=1e-5)
        assert len({tuple(r) for r in route.ids.tolist()}) > 1          # routes differ token to token
        dense = route.dense()
        assert dense.shape == (len(ids), n) and np.count_nonzero(dense, axis=1).tolist() == [k] * len(ids)
    m.close()


def test_a_route_choosing_an_expert_twice_shows_the_sum_of_its_weights():
    """``--ablate ffn_moe_topk@L`` routes every slot to expert 0: the picture showed 1/3, the last
    slot's weight, where the layer applied 1."""
    route = Route(0, np.array([[0, 0, 0], [2, 1, 0]], np.int32),
                  np.array([[1 / 3, 1 / 3, 1 / 3], [0.5, 0.3, 0.2]], np.float32), 4)
    np.testing.assert_allclose(route.dense(), [[1, 0, 0, 0], [0.2, 0.3, 0.5, 0]], rtol=1e-6)


def test_experts_cli_prints_routes_and_writes_the_heatmap_and_json(moe_paths, capsys, tmp_path):
    png = tmp_path / "routes.png"
    code, out, err = run(capsys, "experts", "--raw", "The capital of France is", "-m", moe_paths["olmoe"],
                         "-o", png, "--layer", "1")
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.splitlines()[0].startswith(f"layer 1: each token's {SPECS['olmoe']['k']} experts as expert:weight")
    rows = out.splitlines()[1:]
    assert rows and all(len(r.split()) >= 2 + SPECS["olmoe"]["k"] for r in rows)
    starts = {r.index(":") - 3 for r in rows}          # the first expert:weight in one column, whatever the piece
    assert len(starts) == 1, rows
    code, out, err = run(capsys, "experts", "--raw", "The capital of France is", "-m", moe_paths["olmoe"], "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["n_expert"] == SPECS["olmoe"]["n_expert"] and data["n_expert_used"] == SPECS["olmoe"]["k"]
    assert [layer["layer"] for layer in data["layers"]] == list(range(SPECS["olmoe"]["n_layers"]))
    for layer in data["layers"]:
        assert len(layer["experts"]) == len(data["ids"])
        for ids, weights in zip(layer["experts"], layer["weights"]):
            assert len(set(ids)) == len(ids) == SPECS["olmoe"]["k"]
            assert weights == sorted(weights, reverse=True) and all(0 < w <= 1 for w in weights)


def test_routing_views_refuse_a_dense_model_before_loading_it(capsys, tmp_path):
    from gguf_factory import write_tiny_llama
    dense = write_tiny_llama(tmp_path / "dense.gguf")
    assert_one_line_error(*run(capsys, "experts", "--raw", "hi", "-m", dense, "-o", tmp_path / "x.png"), "dense model")
    assert not (tmp_path / "x.png").exists()
    assert_one_line_error(*run(capsys, "expert-load", "-f", CORPUS, "-m", dense), "dense model")


def test_expert_load_counts_every_token_k_times_a_layer_and_is_the_same_with_two_workers(moe_paths, capsys, tmp_path):
    png = tmp_path / "load.png"
    args = ["expert-load", "-f", CORPUS, "-m", moe_paths["qwen3moe"], "--ctx-size", "16", "--chunks", "3", "--json"]
    code, out, err = run(capsys, *args, "-o", png)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out)
    k, n = SPECS["qwen3moe"]["k"], SPECS["qwen3moe"]["n_expert"]
    assert data["n_tokens"] == 3 * 16 and data["n_chunks"] == 3
    for layer in data["layers"]:
        assert sum(layer["counts"]) == data["n_tokens"] * k
        assert 0 < layer["entropy_bits"] <= math.log2(n) + 1e-9
        for expert, tokens in layer["top_tokens"].items():
            assert sum(t["count"] for t in tokens) <= layer["counts"][int(expert)]
        for pair in layer["together"]:
            a, b = pair["experts"]
            assert a < b and pair["tokens"] <= min(layer["counts"][a], layer["counts"][b])
    code, out2, err = run(capsys, *args, "--workers", "2")
    assert code == 0, err
    assert json.loads(out2)["layers"] == data["layers"]
    # the text's busiest list names used experts only (with --top >= n_expert it listed the unused ones with :0)
    code, text, err = run(capsys, *args[:-1], "--chunks", "1", "--top", str(n))
    assert code == 0, err
    lines = [line for line in text.splitlines() if line.startswith("layer")]
    assert len(lines) == SPECS["qwen3moe"]["n_layers"]
    for line in lines:
        busiest = re.search(r"busiest (.*?) · unused (\d+)", line)
        counts = [int(x.split(":")[1]) for x in busiest.group(1).split(", ")]
        assert all(counts) and len(counts) == n - int(busiest.group(2)), line


def test_expert_load_routes_one_chunk_and_a_text_shorter_than_ctx_size_as_one_chunk(moe_paths, capsys, tmp_path):
    # perplexity's rule (two chunks: 2 × --ctx-size tokens) refused a text expert-load can route whole
    from llamatrace.corpus.chunks import read_header
    tokenizer, _ = read_header(moe_paths["qwen3moe"])
    text = CORPUS.read_text(encoding="utf-8")
    one_chunk, short = tmp_path / "one.txt", tmp_path / "short.txt"
    one_chunk.write_text(text[:60], encoding="utf-8")
    short.write_text("Only a few words here.", encoding="utf-8")
    n_one, n_short = len(tokenizer.encode(text[:60])), len(tokenizer.encode("Only a few words here."))
    assert 32 <= n_one < 64 and n_short < 32                # one chunk of 32 and a tail; less than one chunk
    k = SPECS["qwen3moe"]["k"]
    for path, n_chunks, ctx, n_tokens in ((one_chunk, 1, 32, 32), (short, 1, n_short, n_short)):
        code, out, err = run(capsys, "expert-load", "-f", path, "-m", moe_paths["qwen3moe"], "--ctx-size", "32",
                             "--json")
        assert code == 0, err
        data = json.loads(out)
        assert (data["n_chunks"], data["ctx_size"], data["n_tokens"]) == (n_chunks, ctx, n_tokens), data
        assert all(sum(layer["counts"]) == n_tokens * k for layer in data["layers"])
        note = f"note: the text is {n_short} tokens, fewer than --ctx-size 32: it is routed as one chunk of {n_short}"
        assert (note in err) == (path == short), err
    code, out, err = run(capsys, "perplexity", "-f", one_chunk, "-m", moe_paths["qwen3moe"], "--ctx-size", "32")
    assert_one_line_error(code, out, err, f"tokenizes to {n_one} tokens", "at least 64 (two chunks)")


def test_expert_load_in_a_log_says_how_many_chunks_are_routed_unless_quiet(moe_paths, capsys, monkeypatch):
    # no bar in a log or a pipe: a status line at each tenth of the chunks instead (none at the end,
    # where the summary follows); stderr forced to a non-terminal, status lines on (the suite is quiet)
    from rich.console import Console
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: False))
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)
    args = ["expert-load", "-f", CORPUS, "-m", moe_paths["qwen3moe"], "--ctx-size", "16", "--chunks", "3", "--json"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    lines = re.findall(r"^routed (\d) of 3 chunks \((\d+) %\) in \d+:\d\d(, about \d+:\d\d left)?$", err, re.M)
    # the time left is the pace from the first chunk done: none on its own line (the load is no part of it)
    assert [(n, p, bool(left)) for n, p, left in lines] == [("1", "33", False), ("2", "66", True)], err
    assert err.splitlines()[-1].startswith("3 chunks of 16 tokens in "), err
    code, out, err = run(capsys, "-q", *args)
    assert code == 0 and "routed" not in err and len(err.splitlines()) == 1, err


def test_expert_load_statistics_follow_their_definitions():
    load = ExpertLoad(1, 4)
    ids = np.array([[0, 1], [0, 2], [1, 0], [3, 2]])
    load.record(0, ids, np.full((4, 2), 0.5), np.array([7, 7, 8, 9]))
    load.n_tokens = 4
    assert load.counts[0].tolist() == [3, 2, 2, 1]
    assert np.array_equal(np.diag(load.together[0]), load.counts[0])
    assert load.together[0, 0, 1] == 2 and load.together[0, 2, 3] == 1
    a, b, tokens, lift = load.top_pairs(0, 1)[0]
    assert (a, b, tokens) == (0, 1, 2) and lift == pytest.approx(2 / (3 * 2 / 4))
    assert load.top_tokens(0, 0) == [(7, 2), (8, 1)]
    assert entropy_bits(np.array([5, 5, 5, 5])) == pytest.approx(2.0)
    assert entropy_bits(np.array([9, 0, 0, 0])) == 0.0
    other = ExpertLoad(1, 4)
    other.record(0, ids[:1], np.ones((1, 2)), np.array([7]))
    other.n_tokens = 1
    load.add(other)
    assert load.counts[0].tolist() == [4, 3, 2, 1] and load.top_tokens(0, 0)[0] == (7, 3) and load.n_tokens == 5


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_page_clicking_a_token_shows_its_route_as_experts_prints_it(moe_paths, capsys, tmp_path):
    from test_page import CHROMEDRIVER, CHROMIUM, page_data
    out = tmp_path / "run.html"
    prompt = "The capital of France is"
    code, _, err = run(capsys, "diagram", "--raw", prompt, "-m", moe_paths["qwen3moe"], "--tokens", "1", "-o", out)
    assert code == 0, err
    code, printed, err = run(capsys, "experts", "--raw", prompt, "-m", moe_paths["qwen3moe"], "--json")
    routes_json = json.loads(printed)
    data = page_data(out)
    assert data["n_expert"] == SPECS["qwen3moe"]["n_expert"]
    for layer in routes_json["layers"]:
        step0 = data["routes"]["0"][str(layer["layer"])]
        assert step0["ids"] == layer["experts"]
        np.testing.assert_allclose(step0["weights"], layer["weights"], atol=1e-5)
        assert len(data["routes"]["1"][str(layer["layer"])]["ids"]) == 1        # the decode step: one token
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium/chromedriver (bash scripts/setup.sh --test installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.get(out.as_uri())
        pos = 3
        driver.find_element(By.CSS_SELECTOR, f'#tokens .tok[data-pos="{pos}"]').click()
        assert "route of" in driver.find_element(By.ID, "p-route").text
        rows = driver.find_elements(By.CSS_SELECTOR, "table.route tr")
        assert len(rows) == SPECS["qwen3moe"]["n_layers"]
        for row, layer in zip(rows, routes_json["layers"]):
            shown = [int(b.text) for b in row.find_elements(By.TAG_NAME, "b")]
            assert shown == layer["experts"][pos]
    finally:
        driver.quit()


def test_experts_json_writes_a_nan_weight_as_null(moe_paths, capsys, tmp_path):
    # a layer's experts of NaN make the next layer's router NaN; json.dumps wrote NaN, which is not JSON
    import gguf
    path = tmp_path / "nan.gguf"
    shutil.copyfile(moe_paths["qwen3moe"], path)
    down = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert down.tensor_type == gguf.GGMLQuantizationType.F32
    np.memmap(path, dtype=np.float32, mode="r+", offset=down.data_offset, shape=(int(down.n_elements),))[:] = np.nan
    code, out, err = run(capsys, "experts", "--raw", "The capital", "-m", path, "--json", "--layer", "1")
    assert code == 0, err
    data = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert all(w is None for row in data["layers"][0]["weights"] for w in row)
