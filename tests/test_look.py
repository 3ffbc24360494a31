"""Looking inside: the logit lens, attention maps and pictures, the `attention`, `lens` and
`stages` commands and `--ablate` (bad options give one `error:` line, exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run

from llamatrace.cli import main
from llamatrace.analysis.look import attention, logit_lens

TOKENS = [5, 40, 77, 260, 3, 150, 268, 99]


# ---- the lens ---------------------------------------------------------------------------------
def test_lens_last_layer_row_is_the_models_own_logits(tiny_model):
    lens = logit_lens(tiny_model, TOKENS, positions=3)
    own = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))[-1]
    assert lens.lens_logits.shape == (tiny_model.config.n_layers + 1, 3, tiny_model.config.vocab_size)
    assert np.array_equal(lens.lens_logits[-1, -1], own)
    assert lens.positions == [5, 6, 7]
    last = lens.rows[-1]
    assert (last.layer, last.pos, last.top_id, last.final_rank) == (tiny_model.config.n_layers - 1, 7,
                                                                    lens.final_id, 0)


def test_lens_of_the_default_model_knows_paris_only_at_the_end(smollm2):
    ids = smollm2.tokenizer.encode("The capital of France is")
    lens = logit_lens(smollm2, ids, positions=2)
    own = smollm2.forward(np.array(ids), 0, smollm2.new_cache(len(ids)))[-1]
    assert np.array_equal(lens.lens_logits[-1, -1], own)
    assert smollm2.tokenizer.piece(lens.final_id) == " Paris"
    last_pos = [r for r in lens.rows if r.pos == len(ids) - 1]
    assert [r.layer for r in last_pos] == ["embd", *range(smollm2.config.n_layers)]
    assert last_pos[0].final_rank > 100 and last_pos[-1].final_rank == 0


def test_lens_json_has_the_documented_fields(capsys, tiny_model_path):
    code, out, err = run(capsys, "lens", "--model", str(tiny_model_path), "--raw", "--positions", "2", "--json",
                         "hello there")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) >= {"model", "prompt_ids", "final_id", "rows"}
    assert {tuple(sorted(r)) for r in doc["rows"]} == {
        ("final_prob", "final_rank", "layer", "pos", "top_id", "top_piece", "top_prob")}
    assert [r["layer"] for r in doc["rows"][::2]] == ["embd", 0, 1]
    assert doc["rows"][-1]["top_id"] == doc["final_id"]


def test_lens_table_in_a_pipe_keeps_every_column_however_wide(capsys, tiny_model_path):
    """Piped, the table was cut at 132 columns: at 9+ positions the rank column was an '…'."""
    code, out, err = run(capsys, "lens", "--model", str(tiny_model_path), "--raw", "--positions", "14",
                         "a b c d e f g h i j k l m n o p")
    assert code == 0, err
    lines = [line.rstrip() for line in out.splitlines() if line.strip()]
    header = next(line for line in lines if line.lstrip().startswith("layer"))
    assert header.endswith("rank") and len(header) > 132
    rows = [line for line in lines if line.lstrip().startswith(("embd", "0", "1"))]
    assert len(rows) == 3 and all(row.split()[-1].isdecimal() for row in rows), rows


# ---- attention ----------------------------------------------------------------------------------
def test_attention_rows_sum_to_one_over_unmasked_keys(tiny_model):
    maps = attention(tiny_model, TOKENS, layer=1)
    n = len(TOKENS)
    assert maps.probs.shape == (tiny_model.config.n_heads, n, n)
    assert np.array_equal(maps.masked, np.triu(np.ones((n, n), dtype=bool), k=1))
    assert np.all(maps.probs[:, maps.masked] == 0)
    np.testing.assert_allclose(np.where(maps.masked, 0, maps.probs).sum(-1), 1, rtol=1e-5)


def test_attention_at_a_decode_step_is_one_row_against_the_whole_cache(tiny_model):
    maps = attention(tiny_model, TOKENS, layer=0, step=2)
    assert maps.query_pos == [len(TOKENS) + 1]
    assert maps.probs.shape == (tiny_model.config.n_heads, 1, len(TOKENS) + 2)
    assert not maps.masked.any()
    np.testing.assert_allclose(maps.probs.sum(-1), 1, rtol=1e-5)


def test_attention_json_marks_masked_cells_null_and_the_picture_is_written(capsys, tmp_path, tiny_model_path):
    png = tmp_path / "attn.png"
    code, out, err = run(capsys, "attention", "--model", str(tiny_model_path), "--raw", "--layer", "-1",
                         "--json", "-o", str(png), "hello there")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["layer"] == 1 and len(doc["heads"]) == 4 and doc["heads"][3]["kv_head"] == 1
    probs = doc["heads"][0]["probs"]
    assert probs[0][1] is None and probs[1][0] is not None
    for row in probs:
        assert sum(p for p in row if p is not None) == pytest.approx(1, rel=1e-5)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("n_heads, n_rep, n", [(9, 3, 1000), (9, 3, 20), (64, 8, 400), (4, 1, 3000), (32, 16, 6),
                                                (128, 8, 12)])
def test_a_long_prompts_attention_figure_stays_within_the_size_cap(n_heads, n_rep, n):
    """A 400-token prompt made a 16,830 x 16,650 px picture (3.3 GB, minutes); 1,000 tokens would
    have needed ~20 GB: the cells shrink so that the figure stays within MAX_FIGURE_IN."""
    from llamatrace.analysis.look import AttentionMaps
    from llamatrace.views.plots import DPI, MAX_FIGURE_IN, _pyplot, attention_figure

    masked = np.triu(np.ones((n, n), dtype=bool), k=1)
    probs = np.where(masked, 0, 1.0 / np.arange(1, n + 1)[:, None]).astype(np.float32)
    maps = AttentionMaps(0, 0, np.broadcast_to(probs, (n_heads, n, n)), masked, list(range(n)), list(range(n)),
                         n_heads // n_rep, n_rep)
    fig = attention_figure(maps, ["x"] * n, list(range(n_heads)), "t")
    try:
        width, height = fig.get_size_inches()
        assert width <= MAX_FIGURE_IN and height <= MAX_FIGURE_IN, (width, height)
        if n <= 24:                                 # a short prompt keeps its readable cells
            assert width * DPI > 1000
    finally:
        _pyplot().close(fig)


@pytest.mark.parametrize("n_layers, n_tokens, n_expert", [(48, 1000, 128), (1, 5, 8), (8, 300, 32)])
def test_a_long_texts_routes_figure_stays_within_the_size_cap(n_layers, n_tokens, n_expert):
    """48 layers of 1,000 tokens made a figure ~490 inches tall (~73,000 px)."""
    from llamatrace.analysis.experts import Route
    from llamatrace.views.plots import MAX_FIGURE_IN, _pyplot, routes_figure

    rng = np.random.default_rng(0)
    routes = [Route(L, rng.integers(0, n_expert, (n_tokens, 2)).astype(np.int32),
                    np.full((n_tokens, 2), 0.5, np.float32), n_expert) for L in range(n_layers)]
    fig = routes_figure(routes, ["x"] * n_tokens, "t")
    try:
        width, height = fig.get_size_inches()
        assert width <= MAX_FIGURE_IN and height <= MAX_FIGURE_IN, (width, height)
    finally:
        _pyplot().close(fig)


@pytest.mark.parametrize("n_layers, k", [(30, 450), (80, 2000), (2, 3)])
def test_a_long_prompts_lens_figure_stays_within_the_size_cap(n_layers, k):
    """lens -k 450 drew a 71,059 x 1,253 px picture (1.05 inch a position)."""
    from llamatrace.analysis.look import Lens, LensRow
    from llamatrace.views.plots import DPI, MAX_FIGURE_IN, _pyplot, lens_figure

    rows = [LensRow("embd" if i == 0 else i - 1, p, 7, "x", 0.5, 0, 0.5) for i in range(n_layers + 1) for p in range(k)]
    lens = Lens(list(range(k)), list(range(k)), 7, np.zeros(9, np.float32), np.zeros((1, 1, 9), np.float32), rows)
    fig = lens_figure(lens, ["x"] * k, "t")
    try:
        width, height = fig.get_size_inches()
        assert width <= MAX_FIGURE_IN and height <= MAX_FIGURE_IN, (width, height)
        ax = fig.axes[0]
        assert len(ax.get_xticks()) <= max(3, width / 0.16) and len(ax.texts) == (0 if k > 30 else (n_layers + 1) * k)
        if k <= 6:
            assert width * DPI > 500
    finally:
        _pyplot().close(fig)


@pytest.mark.parametrize("n_heads, n", [(64, 2000), (16, 5)])
def test_a_long_prompts_state_figure_stays_within_the_size_cap(n_heads, n):
    from llamatrace.analysis.look import StateWrites
    from llamatrace.views.plots import MAX_FIGURE_IN, _pyplot, state_figure

    ones = np.ones((n_heads, n))
    fig = state_figure(StateWrites(0, ones, ones * 0.5, ones, list(range(n)), 4), ["x"] * n, "t")
    try:
        width, height = fig.get_size_inches()
        assert width <= MAX_FIGURE_IN and height <= MAX_FIGURE_IN, (width, height)
    finally:
        _pyplot().close(fig)


def test_token_labels_escape_what_the_font_cannot_draw():
    from llamatrace.views.plots import token_label

    assert token_label(" the") == "␣the"
    assert token_label("a\nb") == "a\\nb"
    assert token_label("\x00") == "\\u0000"
    assert token_label("中") == "\\u4e2d"            # DejaVu Sans has no CJK: escaped, not a box
    assert token_label("$x$") == r"\$x\$"
    assert token_label("abcdefghijklmnop", width=6) == "abcde…"


# ---- ablation through the CLI -----------------------------------------------------------------------
def test_generate_with_an_ablation_differs_and_without_it_does_not(capsys, tiny_model_path):
    base = ["generate", "--model", str(tiny_model_path), "--raw", "--json", "-n", "6", "hello there"]
    outs = []
    for extra in ([], ["--ablate", "l_out@all"], []):
        code, out, err = run(capsys, *base, *extra)
        assert code == 0, err
        outs.append(json.loads(out)["ids"])
    assert outs[0] == outs[2] != outs[1]


@pytest.mark.parametrize("args,needle", [
    (["attention", "--layer", "7"], "out of range"),
    (["attention", "--layer", "0", "--head", "4"], "--head 4 is out of range"),
    (["attention", "--layer", "0-1"], "one layer"),
    (["attention", "-o", "x.txt"], ".png, .svg, .pdf"),
    (["attention", "--json", "--step", "500"], "--step 500 needs at least 501"),  # at once: it decoded to the limit
    (["attention", "--json", "--step", "62"], "--step 62 needs 66 cache positions (4 prompt tokens"),  # once tokenized
    (["attention", "--layer", "0,1"], "one layer"),                               # before the load
    (["lens", "--ablate", "keys@0"], "stage 'keys' is not an array of its own"),
    (["lens", "--ablate", "Qcur_heads@0"], "cannot be replaced"),
    (["lens", "--ablate", "nope@0"], "unknown stage 'nope'"),
    (["trace", "--stage", "attn_nrom"], "unknown stage 'attn_nrom'; did you mean attn_norm"),  # not 86 ids
    (["lens", "--ablate", "attn_out@9"], "layer 9 is out of range"),
    (["lens", "--ablate", "attn_out@0:1"], "no heads axis"),
    (["lens", "--ablate", "kqv@0:4"], "head 4 is out of range"),
    (["lens", "--ablate", "Kcur_rope@0:2"], "head 2 is out of range; Kcur_rope has 2 KV heads"),
    (["lens", "--ablate", "attn_out"], "say which"),
    (["trace", "--ablate", "inp_embd@0"], "model-level"),
    (["generate", "--ablate", "attn_out@"], "expected STAGE@LAYER"),
    (["lens", "--positions", "0"], "--positions must be >= 1"),
    (["state", "--json"], "has no gated DeltaNet layers, so no recurrent state"),   # was a garbled sentence
    (["trace", "--stage", " , "], "names no stage"),                                # traced nothing, exit 0
    (["attention", "--layer", "9", "--json"], "(or -1 for the last)"),
])
def test_bad_options_give_one_error_line(capsys, tmp_path, tiny_model_path, args, needle):
    code, out, err = run(capsys, *args, "--model", str(tiny_model_path), "--raw", "hello")
    assert_one_line_error(code, out, err, needle)


@pytest.mark.parametrize("args, needle", [
    (["attention", "--layer", "9", "--json"], "(or -1 for the last)"),
    (["attention", "--head", "99", "--json"], "--head 99 is out of range"),
    (["state", "--json"], "has no gated DeltaNet layers"),
    (["diagram", "--layer", "9", "-o", "x.dot"], "(or -1 for the last)"),
    (["diagram", "--layer", "0,9", "-o", "x.html"], "this model has"),
    (["diagram", "--ctx-size", "99999", "-o", "x.dot"], "--ctx-size 99999 is over the model's context length"),
    (["experts", "--json"], "this is a dense model"),
    (["diagram", "--step", "99999", "-o", "x.dot"], "--step 99999 needs at least 100000 cache positions"),
    (["diagram", "--tokens", "99999", "-o", "x.html"], "--tokens 99999 needs at least"),
    (["diagram", "--step", "9", "--ctx-size", "8", "-o", "x.dot"], "--ctx-size is 8; raise it"),
    (["diagram", "--step", "99999", "--ctx-size", "8", "-o", "x.dot"], "give a smaller --step"),  # not "raise it"
    (["diagram", "--highlight", "Qcur_normed", "-o", "x.html"], "computed only by models with q/k norms"),
    (["attention", "--step", "99999", "--json"], "--step 99999 needs at least"),
])
def test_checks_against_the_models_header_come_before_the_load(capsys, tiny_model_path, monkeypatch, args, needle):
    from llamatrace.cli import options
    monkeypatch.setattr(options, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    assert_one_line_error(*run(capsys, *args, "--model", str(tiny_model_path), "--raw", "hello"), needle)


def _with_nan(src, path, tensor: str):
    """A copy of ``src`` whose F32 ``tensor`` is all NaN."""
    import shutil

    import gguf
    shutil.copyfile(src, path)
    norm = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    np.memmap(path, dtype=np.float32, mode="r+", offset=norm.data_offset, shape=(int(norm.n_elements),))[:] = np.nan
    return path


@pytest.fixture
def nan_logits_path(tmp_path, tiny_model_path):
    """The tiny model with a NaN output norm: every layer is finite, the logits are NaN."""
    return _with_nan(tiny_model_path, tmp_path / "nan.gguf", "output_norm.weight")


def test_attention_of_the_prefill_needs_no_token_so_nan_logits_do_not_stop_it(capsys, nan_logits_path):
    """``--step 0`` sampled a token it never used, and refused a model whose logits are NaN."""
    code, out, err = run(capsys, "attention", "--model", str(nan_logits_path), "--raw", "--layer", "0", "--json",
                         "hello there")
    assert code == 0, err
    assert json.loads(out)["heads"][0]["probs"][0][0] == pytest.approx(1)
    code, out, err = run(capsys, "attention", "--model", str(nan_logits_path), "--raw", "--layer", "0", "--json",
                         "--step", "1", "hello there")
    assert code == 2 and "hold NaN or Inf" in err


def test_lens_refuses_final_logits_holding_nan(capsys, nan_logits_path):
    """It printed NaN into its JSON (invalid JSON) and ranked argmax(NaN) as the final prediction."""
    path = nan_logits_path
    for extra in ([], ["--json"]):
        code, out, err = run(capsys, "lens", "--model", str(path), "--raw", "hello there", *extra)
        assert code == 2 and out == "" and "Traceback" not in err, err
        assert "hold NaN or Inf" in err and "--check-finite" in err


# ---- the catalogue as a command ---------------------------------------------------------------------
def test_stages_json_lists_names_hooks_and_replaceability(capsys, tiny_model_path):
    code, out, err = run(capsys, "stages", "--json", "--model", str(tiny_model_path))
    assert code == 0, err
    rows = {r["id"]: r for r in json.loads(out)}
    assert rows["kq_mask"]["llama_cpp"] == "attn_inp_kq_mask"
    assert rows["ffn_up"]["tl_hook"] == "mlp.hook_pre_linear"
    assert rows["result_output"]["tl_hook"] is None
    assert "before × attn_norm.weight" in rows["attn_norm"]["tl_differs"]
    assert rows["keys"]["replaceable"] is False and rows["attn_out"]["replaceable"] is True
    assert rows["Qcur_heads"]["model_shape"] == "[seq_len, 4, 16]"


def test_stages_table_without_a_model_shows_formulas(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("llamatrace.gguf.fetch.resolve_model", _no_model)
    code, out, err = run(capsys, "stages")
    assert code == 0, err
    assert "attn_inp_kq_mask" in out and "hook_pattern" in out and "n_kv_heads" in out


def _no_model(model, **kwargs):
    from llamatrace.errors import ModelNotFoundError
    raise ModelNotFoundError("not downloaded")


def test_help_of_the_look_commands_shows_examples(capsys):
    for cmd in ("attention", "lens", "stages"):
        code = main([cmd, "--help"])
        out = capsys.readouterr().out
        assert code == 0 and "Example" in out and f"llamatrace {cmd}" in out
