"""`perplexity --stages`: the per-stage relative differences of two models on the same tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from gguf_factory import T, write_tiny_llama

from llamatrace.analysis.difference import relative_error_rows
from llamatrace.cli import main
from llamatrace.corpus.chunks import make_chunks, read_corpus
from llamatrace.corpus.perplexity import ChunkJob, kl_divergence_stages
from llamatrace.corpus.worker import ModelSpec
from llamatrace.corpus.stage_errors import TOKEN_STAGES, PairSpec, capture, score_pair

CORPUS = Path(__file__).parent / "golden" / "corpus.txt"


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The same random weights as Q8_0 (the base) and as Q4_0: one vocabulary, two quantizations."""
    root = tmp_path_factory.mktemp("pair")
    return (write_tiny_llama(root / "base-q8_0.gguf", qtype=T.Q8_0, seed=3),
            write_tiny_llama(root / "quant-q4_0.gguf", qtype=T.Q4_0, seed=3))


def test_relative_error_is_the_norm_ratio_per_row():
    rng = np.random.default_rng(0)
    base, quant = rng.standard_normal((5, 7)), rng.standard_normal((5, 7))
    want = [np.sqrt(((q - b) ** 2).sum() / (b ** 2).sum()) for q, b in zip(quant, base)]
    np.testing.assert_allclose(relative_error_rows(quant.astype(np.float32), base.astype(np.float32)), want, rtol=1e-5)


def test_relative_error_rows_of_wide_strided_rows_and_edge_rows():
    # a column slice (the split of a fused product), 3-D rows, a zero row, a NaN: against float64 NumPy
    rng = np.random.default_rng(1)
    fused = rng.standard_normal((6, 3000)).astype(np.float32)
    base = rng.standard_normal((6, 1000)).astype(np.float32)
    base[2] = 0
    quant = fused[:, 1000:2000]
    quant[2] = 0
    quant[4, 7] = np.nan
    d = (quant - base).astype(np.float64)          # a float32 difference, as documented
    want = np.sqrt((d ** 2).sum(1)) / np.where((base.astype(np.float64) ** 2).sum(1) > 0,
                                               np.sqrt((base.astype(np.float64) ** 2).sum(1)), 1)
    got = relative_error_rows(quant, base)
    assert got[2] == 0 and np.isnan(got[4]) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_array_equal(relative_error_rows(quant.reshape(6, 10, 100), base.reshape(6, 10, 100)), got)


def test_capture_keeps_the_scored_rows_of_what_a_trace_records(tiny_pair):
    from llamatrace.model.llama import Llama
    model = Llama.load(tiny_pair[0])
    ids = np.arange(16) + 5
    acts, embd, inputs, logits = capture(model, ids, 8)
    with model.trace(stages=["l_out", "ffn_gate"], layers=[1], keep_arrays=True) as rec:
        full = model.forward(ids, 0, model.new_cache(16), all_logits=True)
    arrays = rec.arrays()
    np.testing.assert_array_equal(acts[1, TOKEN_STAGES.index("l_out")], arrays["step0.layer1.l_out"][8:15])
    np.testing.assert_array_equal(acts[1, TOKEN_STAGES.index("ffn_gate")], arrays["step0.layer1.ffn_gate"][8:15])
    np.testing.assert_array_equal(logits, full[8:15])
    assert embd.shape == (7, model.config.dim)


def test_a_model_against_itself_differs_nowhere(tiny_pair):
    from llamatrace.model.llama import Llama
    model = Llama.load(tiny_pair[0])
    ids = np.arange(16, dtype=np.int32) + 5
    job = ChunkJob(ids, ids[9:16].astype(np.int64), 8)
    part, errors, embd, experts = score_pair((model, model), job)
    assert experts is None                 # a dense model
    assert errors.shape == (2, 2, len(TOKEN_STAGES), 7) and not errors[0].any() and not embd.any()
    local = errors[1]                      # the model recomputing its own stages: 0 at every Llama stage
    assert not np.isnan(local).any() and not local.any()
    assert np.all(np.abs(part.kld) < 5e-5) and part.same_top.all()


def test_stage_attribution_runs_the_same_with_two_workers(tiny_pair):
    base, quant = tiny_pair
    spec = PairSpec(ModelSpec(str(base)), ModelSpec(str(quant)))
    from llamatrace.model.llama import Llama
    chunks = make_chunks(Llama.load(quant).tokenizer, read_corpus(CORPUS), 32, 4, 64)
    k1, s1 = kl_divergence_stages(spec, chunks, 1)
    k2, s2 = kl_divergence_stages(spec, chunks, 2)
    assert k1 == k2
    np.testing.assert_array_equal(s1.median, s2.median)
    assert s1.count == 4 * 15 and s1.median.shape == (2, len(TOKEN_STAGES))
    assert np.all(s1.p95 >= s1.median) and s1.median.min() > 0
    np.testing.assert_allclose(s1.l_out, s1.median[:, TOKEN_STAGES.index("l_out")])


def test_stages_cli_prints_the_table_and_draws_the_plot(capsys, tiny_pair, tmp_path):
    base, quant = tiny_pair
    picture = tmp_path / "where.png"
    args = ["perplexity", "-f", str(CORPUS), "-c", "32", "--chunks", "3", "--model", str(quant),
            "--base", str(base), "--stages"]
    assert main([*args, "-o", str(picture)]) == 0
    out, err = capsys.readouterr()
    assert "Where the error enters" in out and "Mean    KLD" in out
    assert f"wrote {picture}" in err                   # as experts, expert-load and diagram say it
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    a = got["attribution"]
    assert a["stages"] == list(TOKEN_STAGES) and len(a["median"]) == 2 and len(a["l_out_added"]) == 2
    assert a["count"] == 3 * 15 and got["mean_kld"] > 0


def test_stages_options_are_checked_before_any_compute(capsys, tiny_pair, tmp_path, monkeypatch):
    base, quant = tiny_pair
    from llamatrace.cli import perplexity
    monkeypatch.setattr(perplexity, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    text = tmp_path.parent / "not-a-model.txt"            # outside tmp_path: that must stay empty
    text.write_text("Hello there")
    for extra, needle in ((["--stages"], "--stages needs --base"),
                          (["--base", str(text)], f"--base '{text}' is neither a GGUF model nor a base file"),
                          (["--base", str(base), "-o", str(tmp_path / "x.png")], "add --stages"),
                          (["--base", str(base), "--stages", "-o", str(tmp_path / "x.txt")], "'.txt' is not an image format")):
        code = main(["perplexity", "-f", str(CORPUS), "-c", "32", "--model", str(quant), *extra])
        captured = capsys.readouterr()
        assert code == 2 and captured.out == ""
        lines = [ln for ln in captured.err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], captured.err
    assert not list(tmp_path.iterdir())


def test_stages_refuse_two_architectures(capsys, tiny_pair, tmp_path):
    deeper = write_tiny_llama(tmp_path / "deeper.gguf", qtype=T.Q8_0, n_layers=3)
    code = main(["perplexity", "-f", str(CORPUS), "-c", "32", "--model", str(deeper), "--base", str(tiny_pair[0]),
                 "--stages"])
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "n_layers 2 vs 3" in lines[0], captured.err


def test_local_error_is_what_the_quantized_weights_add_at_each_stage(tiny_pair):
    # the quantized model recomputing the base's stages from the base's own inputs: the
    # projections differ (their weights are quantized), the norms' and adds' arithmetic does not
    from llamatrace.analysis.local_error import LOCAL_STAGES
    from llamatrace.kernels.types.registry import matmul
    from llamatrace.model.llama import Llama
    base, quant = Llama.load(tiny_pair[0]), Llama.load(tiny_pair[1])
    ids = np.arange(16, dtype=np.int32) + 5
    job = ChunkJob(ids, ids[9:16].astype(np.int64), 8)
    _, errors, _, _ = score_pair((base, quant), job)
    local = errors[1]
    col = {s: TOKEN_STAGES.index(s) for s in ("ffn_up", "attn_out", "ffn_inp", "l_out")}
    assert (local[:, col["ffn_up"]] > 1e-4).all() and (local[:, col["attn_out"]] > 1e-4).all()
    assert local[:, col["ffn_inp"]].max() < 1e-6 and local[:, col["l_out"]].max() < 1e-6
    # against plain NumPy: ffn_up of layer 1, the quantized w3 on the base's own ffn_norm rows
    acts, _, _, _ = capture(base, ids, 8)
    x = acts[1, TOKEN_STAGES.index("ffn_norm")]
    w3 = quant.weights.layers[1].w3
    want = matmul(x, w3) if w3 is not None else matmul(x, quant.weights.layers[1].w13)[:, -quant.config.hidden_dim:]
    got = acts[1, col["ffn_up"]]
    rel = np.linalg.norm(want - got, axis=1) / np.linalg.norm(got, axis=1)
    np.testing.assert_allclose(local[1, col["ffn_up"]], rel, rtol=1e-4)
    assert "ffn_up" in LOCAL_STAGES


def test_a_fused_matrix_is_multiplied_once_a_layer(tiny_pair, monkeypatch):
    # Qcur/Kcur/Vcur split one wqkv product, ffn_gate/ffn_up one w13 product: the local error
    # of the three (two) stages needs it once, not once a stage
    from llamatrace.analysis import local_error
    from llamatrace.model.llama import Llama
    base, quant = Llama.load(tiny_pair[0]), Llama.load(tiny_pair[1])
    lw = quant.weights.layers[0]
    assert lw.wqkv is not None and lw.w13 is not None          # the tiny file stacks both
    calls = []
    real = local_error.matmul
    monkeypatch.setattr(local_error, "matmul", lambda x, w: calls.append(w.name) or real(x, w))
    ids = np.arange(16, dtype=np.int32) + 5
    _, errors, _, _ = score_pair((base, quant), ChunkJob(ids, ids[9:16].astype(np.int64), 8))
    n_layers = quant.config.n_layers
    assert sorted(set(calls)) == sorted({w.name for L in quant.weights.layers for w in (L.wqkv, L.w13, L.wo, L.w2)})
    assert len(calls) == 4 * n_layers
    for s in ("Qcur", "Kcur", "Vcur", "ffn_gate", "ffn_up"):
        assert (errors[1][:, TOKEN_STAGES.index(s)] > 1e-4).all()


def _drawn(monkeypatch):
    """The figures plot_stage_errors saves, kept for a look (savefig still writes them)."""
    from matplotlib.figure import Figure
    figures, real = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self) or real(self, *a, **k))
    return figures


def _columns_and_legend(figure) -> tuple[list[str], np.ndarray, list[str]]:
    """The local heat map's column labels, its masked values [layers, stages] and its legend's texts."""
    ax = figure.axes[0]
    return ([t.get_text() for t in ax.get_xticklabels()], ax.images[0].get_array(),
            [t.get_text() for legend in figure.legends for t in legend.get_texts()])


def test_every_local_column_is_computed_or_explained(capsys, tmp_path, monkeypatch, tiny_pair):
    # issue 47: kqv_out was a white column with no legend entry and a null local median (its
    # input kqv, [n_heads, seq_len, head_dim], was not captured); Gemma 3's NeoX rotary is not
    # recomputed: its columns are white, and the JSON and the legend say why
    from arch_files import write_arch_file
    gemma = (write_arch_file(tmp_path / "g-f32.gguf", "gemma3", seed=4),
             write_arch_file(tmp_path / "g-q8_0.gguf", "gemma3", seed=4, qtype=T.Q8_0))
    figures = _drawn(monkeypatch)
    for (base, quant), explained in ((tiny_pair, set()), (gemma, {"Qcur_rope", "Kcur_rope"})):
        args = ["perplexity", "-f", str(CORPUS), "-c", "32", "--chunks", "2", "--model", str(quant),
                "--base", str(base), "--stages"]
        assert main([*args, "--json"]) == 0
        a = json.loads(capsys.readouterr().out)["attribution"]
        assert set(a["local_notes"]) == explained and all(a["local_notes"].values())
        for k, stage in enumerate(a["stages"]):
            finite = all(row[k] is not None and np.isfinite(row[k]) for row in a["local_median"])
            assert finite != (stage in explained), stage
        assert "kqv_out" in a["stages"] and "kqv_out" not in explained
        assert main([*args, "-o", str(tmp_path / "where.png")]) == 0
        table = capsys.readouterr().out            # the table names them too
        assert all(re.search(rf"\b{s} +not recomputed: ", table) for s in explained)
        labels, values, legend = _columns_and_legend(figures[-1])
        assert labels == a["stages"]
        white = {labels[k] for k in range(len(labels)) if np.ma.getmaskarray(values)[:, k].all()}
        assert white == explained and all(any(t.startswith(f"{s}: ") for t in legend) for s in white)
