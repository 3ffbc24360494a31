"""Step tracing: event order and shapes, HF-matching statistics, the trace command and its outputs.

Tiny-GGUF tests run in milliseconds; tests that take the ``smollm2`` fixtures use the real default
model (SmolLM2-135M-Instruct Q4_1) and the HF golden reference in ``tests/golden``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import write_tiny_llama
from snapshot import assert_matches_snapshot

from llamatrace.cli import main
from llamatrace.cli.options import parse_layers
from llamatrace.errors import OptionError, OutputError
from llamatrace.kernels.ops import fp32 as kernels
from llamatrace.outputs import check_output_path
from llamatrace.views.render import LineFormatter, write_npz_atomic
from llamatrace.tracing.stages import (
    LAYER_STAGE_IDS,
    STAGE_BY_ID,
    STAGES,
    eval_shape,
    stage_applies,
)
from llamatrace.tracing.recorder import Recorder

GOLDEN = Path(__file__).parent / "golden"
# dims chosen so that every shape variable has a different value
TINY_DIMS = dict(n_layers=2, dim=96, n_heads=6, n_kv_heads=2, hidden_dim=160)


@pytest.fixture(scope="module")
def gqa_path(tmp_path_factory) -> Path:
    """Tiny GQA model: dim 96, 6 heads of 16, 2 KV heads (n_rep 3), ffn 160, vocab 269, rope_half 8."""
    return write_tiny_llama(tmp_path_factory.mktemp("trace") / "gqa.gguf", **TINY_DIMS)


@pytest.fixture(scope="module")
def gqa(gqa_path):
    from llamatrace.model.llama import Llama
    return Llama.load(gqa_path)


def traced_shapes(model, ids: list[int], decode_token: int | None, **options) -> tuple[list, Recorder]:
    """Prefill ``ids`` at start_pos 0 (+ one decode step) with a recorder: [(step, layer, stage, shape)]."""
    cache = model.new_cache(len(ids) + 1)
    rec = Recorder(**options)
    model.forward(np.asarray(ids), 0, cache, recorder=rec)
    if decode_token is not None:
        model.forward(np.asarray([decode_token]), len(ids), cache, recorder=rec)
    return [(e.step, e.layer, e.stage, tuple(e.shape)) for e in rec.events], rec


def catalogue_shapes(model, step: int, start_pos: int, seq_len: int, max_seq: int) -> list:
    """What the catalogue's formulas and ``when`` rules say one forward call emits."""
    dims = model.shape_vars(start_pos, seq_len, max_seq)
    out = []
    stages = [s for s in STAGES if stage_applies(s, seq_len, dims["n_rep"])]
    for s in (s for s in stages if s.level == "model" and s.group == "input"):
        out.append((step, None, s.id, eval_shape(s.shape, dims)))
    for layer in range(model.config.n_layers):
        out += [(step, layer, s.id, eval_shape(s.shape, dims)) for s in stages if s.level == "layer"]
    for s in (s for s in stages if s.level == "model" and s.group == "output"):
        out.append((step, None, s.id, eval_shape(s.shape, dims)))
    return out


# ---- event order and shapes ------------------------------------------------------------------
def test_prefill_and_decode_emit_catalogue_stages_in_order(gqa):
    got, _ = traced_shapes(gqa, [5, 6, 7, 8, 9], 10)
    expected = catalogue_shapes(gqa, 0, 0, 5, 6) + catalogue_shapes(gqa, 1, 5, 1, 6)
    assert got == expected
    # spot checks of the formulas themselves, written out
    shapes = {(s, l, st): sh for s, l, st, sh in got}
    assert shapes[(0, None, "freqs_cis")] == (5, 8)
    assert shapes[(0, 1, "Kcur")] == (5, 32)
    assert shapes[(0, 1, "keys_rep")] == (5, 6, 16)
    assert shapes[(0, 0, "kq_masked")] == (6, 5, 5)
    assert shapes[(0, 0, "ffn_silu")] == (5, 160)
    assert shapes[(0, None, "result_output")] == (5, 269)
    assert shapes[(1, 0, "keys")] == (6, 2, 16)
    assert shapes[(1, 0, "kq_soft_max")] == (6, 1, 6)


def test_decode_step_has_no_mask_stages(gqa):
    got, _ = traced_shapes(gqa, [5, 6, 7], 10)
    decode = {stage for step, _, stage, _ in got if step == 1}
    assert "kq_mask" not in decode and "kq_masked" not in decode
    assert {"kq_mask", "kq_masked"} <= {stage for step, _, stage, _ in got if step == 0}


def test_no_repeat_kv_stages_when_kv_heads_equal_heads(tmp_path):
    from llamatrace.model.llama import Llama
    m = Llama.load(write_tiny_llama(tmp_path / "mha.gguf", n_layers=1, dim=64, n_heads=4, n_kv_heads=4))
    got, _ = traced_shapes(m, [5, 6, 7], 10)
    stages = [stage for _, _, stage, _ in got]
    assert "keys_rep" not in stages and "values_rep" not in stages
    assert [x for x in got if x[2] == "kq"] == [(0, 0, "kq", (4, 3, 3)), (1, 0, "kq", (4, 1, 4))]


def _issue_layer(n: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    """One traced layer of the default model, as issue 3 lists it (n queries, kv cached positions)."""
    rows = [("attn_norm", (n, 576)), ("Qcur", (n, 576)), ("Kcur", (n, 192)), ("Vcur", (n, 192)),
            ("Qcur_heads", (n, 9, 64)), ("Kcur_heads", (n, 3, 64)), ("Vcur_heads", (n, 3, 64)),
            ("Qcur_rope", (n, 9, 64)), ("Kcur_rope", (n, 3, 64)), ("cache_k", (n, 3, 64)), ("cache_v", (n, 3, 64)),
            ("keys", (kv, 3, 64)), ("values", (kv, 3, 64)), ("keys_rep", (kv, 9, 64)), ("values_rep", (kv, 9, 64)),
            ("kq", (9, n, kv)), ("kq_scaled", (9, n, kv)), ("kq_masked", (9, n, kv)), ("kq_soft_max", (9, n, kv)),
            ("kqv", (9, n, 64)), ("kqv_out", (n, 576)), ("attn_out", (n, 576)), ("ffn_inp", (n, 576)),
            ("ffn_norm", (n, 576)), ("ffn_gate", (n, 1536)), ("ffn_silu", (n, 1536)), ("ffn_up", (n, 1536)),
            ("ffn_swiglu", (n, 1536)), ("ffn_out", (n, 576)), ("l_out", (n, 576))]
    return [r for r in rows if n > 1 or r[0] != "kq_masked"]


def test_default_model_shapes_match_issue(smollm2):
    assert smollm2.config.n_layers == 30
    ids = smollm2.tokenizer.encode("The capital of France is")
    assert len(ids) == 5
    got, rec = traced_shapes(smollm2, ids, 7042)
    expected = [(0, None, "freqs_cis", (5, 32)), (0, None, "kq_mask", (5, 5)), (0, None, "inp_embd", (5, 576))]
    expected += [(0, layer, s, sh) for layer in range(30) for s, sh in _issue_layer(5, 5)]
    expected += [(0, None, "result_norm", (5, 576)), (0, None, "result_output", (5, 49152))]
    expected += [(1, None, "freqs_cis", (1, 32)), (1, None, "inp_embd", (1, 576))]
    expected += [(1, layer, s, sh) for layer in range(30) for s, sh in _issue_layer(1, 6)]
    expected += [(1, None, "result_norm", (1, 576)), (1, None, "result_output", (1, 49152))]
    assert got == expected
    assert {e.dtype for e in rec.events if e.stage == "freqs_cis"} == {"complex64"}
    assert {e.dtype for e in rec.events if e.stage != "freqs_cis"} == {"float32"}


# ---- agreement with the HF golden reference -----------------------------------------------------
HF_RMS_STAGES = ("attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "ffn_inp", "ffn_norm",
                 "ffn_swiglu", "ffn_out", "l_out")


def test_layer0_stats_match_hf_golden(smollm2):
    golden = json.loads((GOLDEN / "smollm2_golden.json").read_text())
    ids = golden["prompts"]["ascii"]["prompt_ids"]
    ref = golden["stage_stats"]["ascii"]["layers"]["0"]
    rec = Recorder(layers=[0], stats=True)
    smollm2.forward(np.asarray(ids), 0, smollm2.new_cache(len(ids)), recorder=rec)
    ours = {e.stage: e for e in rec.events if e.layer == 0}
    for stage in HF_RMS_STAGES:
        assert list(ours[stage].shape) == list(ref[stage]["shape"]), stage
        assert ours[stage].stats["rms"] == pytest.approx(ref[stage]["rms"], rel=1e-3), stage


def test_every_softmax_row_sums_to_one(smollm2):
    ids = smollm2.tokenizer.encode("The capital of France is")
    _, rec = traced_shapes(smollm2, ids, 7042, stages=["kq_soft_max"], keep_arrays=True)
    assert len(rec.events) == 2 * 30
    for e in rec.events:
        np.testing.assert_allclose(e.array.astype(np.float64).sum(axis=-1), 1.0, atol=1e-5, err_msg=e.key)


# ---- tracing changes nothing ---------------------------------------------------------------
def test_tracing_does_not_change_generated_tokens_tiny(gqa):
    ids = gqa.tokenizer.encode("the cat")
    plain = list(gqa.generate(ids, max_tokens=8, stop_ids=frozenset()))
    with gqa.trace(stats=True, values=2, keep_arrays=True) as rec:
        traced = list(gqa.generate(ids, max_tokens=8, stop_ids=frozenset()))
    assert traced == plain and len(plain) == 8
    assert rec.step == 7                                    # prefill + 7 decode steps were traced


def test_tracing_does_not_change_generated_tokens_default_model(smollm2):
    ids = smollm2.tokenizer.encode("The capital of France is")
    plain = list(smollm2.generate(ids, max_tokens=6))
    with smollm2.trace(layers=[0], stages=["kq*"], stats=True):
        traced = list(smollm2.generate(ids, max_tokens=6))
    assert traced == plain
    assert plain[0] == 7042                                 # " Paris", as HF


def test_unwatched_scores_are_skipped_and_a_recorded_kq_still_holds_every_score(gqa, monkeypatch):
    """A prefill computes q·k only for the keys each query sees, and SwiGLU from the unsplit
    gate|up product, unless a recorder or hook watches those stages. A recorded ``kq`` still holds
    every key's q·k (masked ones too) and ``kq_masked`` their -inf; the probabilities, the SwiGLU
    and the logits are the same bits either way."""
    ids, n_layers = np.arange(3, 43), gqa.config.n_layers         # 40 tokens: two key chunks
    calls = []
    for name in ("attention_scores", "silu"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))

    def run(stages, **options):
        calls.clear()
        rec = Recorder(stages=stages, keep_arrays=True, **options)
        logits = gqa.forward(ids, 0, gqa.new_cache(len(ids)), recorder=rec, all_logits=True)
        return logits, rec.arrays()

    quiet, kept = run(["kq_soft_max", "ffn_swiglu"])
    assert calls == []
    full, arrays = run(["Qcur_rope", "keys", "kq", "kq_masked", "kq_soft_max", "ffn_up", "ffn_swiglu"])
    assert sorted(calls) == ["attention_scores"] * n_layers + ["silu"] * n_layers
    hidden = np.triu(np.ones((len(ids), len(ids)), dtype=bool), 1)
    for layer in range(n_layers):
        at = f"step0.layer{layer}."
        kq = arrays[at + "kq"]
        ref = kernels.attention_scores_ref(arrays[at + "Qcur_rope"], arrays[at + "keys"])
        np.testing.assert_allclose(kq, ref, rtol=1e-5, atol=1e-5)     # every entry, the masked ones too
        assert np.isneginf(arrays[at + "kq_masked"][:, hidden]).all()
        for stage in ("kq_soft_max", "ffn_swiglu"):
            np.testing.assert_array_equal(kept[at + stage].view(np.uint32), arrays[at + stage].view(np.uint32))
    np.testing.assert_array_equal(quiet.view(np.uint32), full.view(np.uint32))
    with gqa.hooks({"kq_masked": lambda a, e: None}, layers=[1]):
        run(["l_out"])
    assert calls == ["attention_scores"]                          # only the hooked layer's scores
    for options in (dict(check_finite=True), dict(time_all=True)):   # every stage checked or timed
        run(["l_out"], **options)
        assert calls.count("attention_scores") == n_layers


# ---- log lines -------------------------------------------------------------------------------
def test_dump_shapes_matches_snapshot(smollm2_path, capsys):
    code = main(["trace", "--model", str(smollm2_path), "--raw", "--layer", "0", "--tokens", "1", "--dump-shapes"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert_matches_snapshot(captured.out, "smollm2_dump_shapes.txt")


def test_every_template_renders_one_line_per_template(gqa, gqa_path, capsys):
    assert main(["trace", "--model", str(gqa_path), "--raw", "--tokens", "1", "--dump-shapes", "the cat"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ids = gqa.tokenizer.encode("the cat")
    _, rec = traced_shapes(gqa, ids, 10)
    n = len(ids)
    # one line per template, plus one "Skipping addition scores + mask" per layer of the decode step
    assert len(lines) == sum(len(STAGE_BY_ID[e.stage].lines) for e in rec.events) + TINY_DIMS["n_layers"]
    assert lines.count("Skipping addition scores + mask") == TINY_DIMS["n_layers"]
    assert not any("{" in line or "}" in line or "?" in line for line in lines)
    assert (f"Calling LlamaAttention.Forward for tensor normalizedX shape([{n} 96]) and startPos: 0, "
            f"freqsCis: shape([{n} 8]), mask: shape([{n} {n}]) -> tensor h") in lines
    assert "Calling ml.LinearTransformation for x shape([1 96]) and LlamaAttention.attn_wk weights " \
           "shape([32 96]) -> tensor xk" in lines
    assert f"Calling ml.MatMul for xq shape([6 1 16]) and keys shape([6 16 {n + 1}]) -> tensor xqMatMulKeys" in lines


def test_skip_line_only_when_masked_stage_selected(gqa):
    formatter = LineFormatter.for_model(gqa, 8, selected={"kq_soft_max"})
    _, rec = traced_shapes(gqa, [5, 6, 7], 10, layers=[0], stages=["kq_soft_max"])
    assert all("Skipping" not in line for e in rec.events for line in formatter.lines(e))
    formatter = LineFormatter.for_model(gqa, 8, selected={"kq_soft_max", "kq_masked"})
    decode = [e for e in rec.events if e.step == 1]
    assert formatter.lines(decode[0])[0] == "Skipping addition scores + mask"


# ---- the trace command ------------------------------------------------------------------------
def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_jsonl_dash_is_stdout_holding_the_json_lines_only(gqa_path, tmp_path, capsys, monkeypatch):
    # '-' was a file named '-' (as -f - reads stdin, a user pipes --jsonl - into jq)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["trace", "--model", str(gqa_path), "--raw", "--layer", "0", "--stage", "attn_norm",
                              "--jsonl", "-", "the cat"], capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["type"] for x in lines] == ["header", "event", "footer"] and lines[1]["stage"] == "attn_norm"
    assert "Prompt tokens" in err and "Next-token probabilities" in err and not (tmp_path / "-").exists()
    code, out, err = run_cli(["trace", "--model", str(gqa_path), "--raw", "--jsonl", "-", "--format", "table",
                              "the cat"], capsys)
    assert code == 2 and "--jsonl - writes the events to stdout: drop --format table" in err


def test_jsonl_and_npz_round_trip(gqa_path, tmp_path, capsys):
    jl, nz, log = tmp_path / "t.jsonl", tmp_path / "t.npz", tmp_path / "debug.log"
    code, _, err = run_cli(["trace", "--model", str(gqa_path), "--raw", "--tokens", "2", "--stats", "--values", "3",
                            "--layer", "0,-1", "--jsonl", str(jl), "--npz", str(nz), "--log-file", str(log),
                            "--top", "4", "the cat"], capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in jl.read_text(encoding="utf-8").splitlines()]  # every line is JSON
    header, events, footer = lines[0], lines[1:-1], lines[-1]
    assert header["type"] == "header" and header["schema"] == "llamatrace.trace/1"
    assert header["config"]["dim"] == 96 and len(header["pieces"]) == len(header["prompt_ids"])
    assert header["prompt"] == "the cat" and header["activations"] == "f32"
    assert {e["type"] for e in events} == {"event"}
    assert footer["type"] == "footer" and len(footer["top_k"]) == 4 and len(footer["ids"]) == 3
    assert sum(p for _, _, p in footer["top_k"]) <= 1.0 + 1e-9
    assert footer["timings"]["decode_steps"] == 2
    assert {"prefill", "decode"} == set(footer["timings"]["stages_us"])
    for e in events:
        assert set(e) >= {"step", "start_pos", "layer", "stage", "op", "inputs", "shape", "dtype", "elapsed_us",
                          "stats", "values"}
        assert set(e["stats"]) == {"sum", "mean", "rms", "min", "max", "abs_max", "nan", "inf"}
    masked = next(e for e in events if e["stage"] == "kq_masked")
    assert masked["stats"]["inf"] > 0                       # -inf of the mask: counted, written as null
    for e in events:
        assert (len(e["values"]["head"]), len(e["values"]["tail"])) == (3, 3), e["stage"]
    with np.load(nz) as arrays:
        keys = [("step%d.%s" % (e["step"], e["stage"]) if e["layer"] is None else
                 "step%d.layer%d.%s" % (e["step"], e["layer"], e["stage"])) for e in events]
        assert sorted(arrays.files) == sorted(keys + ["__llamatrace__"])   # + what the recording is
        meta = json.loads(str(arrays["__llamatrace__"]))
        assert meta["engine"] == "llamatrace" and meta["activations"] == "f32"
        for e, key in zip(events, keys):
            assert list(arrays[key].shape) == e["shape"] and str(arrays[key].dtype) == e["dtype"]
        assert {e["layer"] for e in events} == {None, 0, 1}
        # the same trace through the Python API keeps the same arrays
        from llamatrace.model.llama import Llama
        m = Llama.load(gqa_path)
        with m.trace(layers=[0, 1], keep_arrays=True) as rec:
            list(m.generate(header["prompt_ids"], max_tokens=3, stop_ids=frozenset()))
        kept = rec.arrays()
        for key in keys:
            np.testing.assert_array_equal(arrays[key], kept[key], err_msg=key)
    debug = log.read_text(encoding="utf-8").splitlines()
    assert debug and all(line.startswith("[DEBUG] ") for line in debug)
    assert any(line.endswith("Skipping addition scores + mask") for line in debug)


def test_values_of_a_small_tensor_are_shown_once():
    """--values 3 on 4 values gave head [a, b, c] … tail [b, c, d]: repeats, and a '…' for nothing left out."""
    from llamatrace.tracing.recorder import head_tail
    from llamatrace.views.render import fmt_values
    small = head_tail(np.float32([1, 2, -np.inf, 4]), 3)
    assert small == {"head": [1.0, 2.0, None, 4.0], "tail": []} and fmt_values(small) == "values [1, 2, —, 4]"
    big = head_tail(np.arange(7, dtype=np.float32), 3)
    assert big == {"head": [0.0, 1.0, 2.0], "tail": [4.0, 5.0, 6.0]}
    assert fmt_values(big) == "head [0, 1, 2] … tail [4, 5, 6]"


def test_npz_write_is_atomic(tmp_path, monkeypatch):
    arrays = {"step0.layer0.kq": np.arange(6, dtype=np.float32).reshape(1, 2, 3),
              "step0.freqs_cis": np.ones((2, 4), dtype=np.complex64)}
    path = tmp_path / "a.npz"
    write_npz_atomic(path, arrays)
    with np.load(path) as got:
        for key, value in arrays.items():
            np.testing.assert_array_equal(got[key], value)
    target = tmp_path / "b.npz"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_npz_atomic(target, arrays)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz"]


def test_table_format_stats_and_timings(gqa_path, capsys):
    code, out, err = run_cli(["trace", "--model", str(gqa_path), "--raw", "--format", "table", "--stats",
                              "--timings", "--tokens", "1", "--layer", "1", "--stage", "kq*", "the cat"], capsys)
    assert code == 0, err
    for text in ("Prompt tokens", "kq_soft_max", "step 1 · decode", "Time by stage group", "attention",
                 "Slowest stages", "Next-token probabilities"):
        assert text in out, text


def test_default_log_output_starts_with_tokens_and_ends_with_top_k(gqa_path, capsys):
    code, out, err = run_cli(["trace", "--model", str(gqa_path), "--layer", "0", "--stage", "attn_norm",
                              "--stats"], capsys)
    assert code == 0, err
    assert out.lstrip().startswith("Prompt tokens")
    assert "Calling RMSNorm for tensor x shape(" in out and "rms " in out
    lines = out.splitlines()
    last_stage = max(i for i, line in enumerate(lines) if line.startswith("Calling "))
    assert next(i for i, line in enumerate(lines) if "Next-token probabilities" in line) > last_stage


def test_check_finite_names_stage_layer_and_step(gqa, gqa_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kernels, "silu", lambda x: np.full_like(x, np.nan))
    jl = tmp_path / "t.jsonl"
    code, out, err = run_cli(["trace", "--model", str(gqa_path), "--raw", "--check-finite", "--jsonl", str(jl),
                              "--npz", str(tmp_path / "t.npz"), "the cat"], capsys)
    assert code == 2
    assert "ffn_silu" in err and "layer 0" in err and "step 0" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert f"the trace so far is in {jl}, {tmp_path / 't.npz'}" in err
    # the recording holds what was traced, up to the failing stage (the evidence, for compare)
    with np.load(tmp_path / "t.npz") as rec:
        assert "step0.layer0.ffn_silu" in rec.files and np.isnan(rec["step0.layer0.ffn_silu"]).all()
        assert not any(".ffn_out" in k for k in rec.files)
    # every line written before the error is complete: the header, then step 0's events in the
    # catalogue's order up to the failing stage, which is there as evidence (its NaN counted)
    header, *events = [json.loads(line) for line in jl.read_text().splitlines()]
    assert header["type"] == "header"
    n = len(header["prompt_ids"])
    before = [(s, layer, st) for s, layer, st, _ in catalogue_shapes(gqa, 0, 0, n, n + 1)]
    assert [(e["step"], e["layer"], e["stage"]) for e in events] == before[:before.index((0, 0, "ffn_silu")) + 1]


def test_generate_refuses_logits_holding_nan(gqa_path, tmp_path, capsys):
    # NaN logits sort first: greedy sampling used to pick token 0 (an end of text here) and exit 0
    path = tmp_path / "nan.gguf"
    shutil.copyfile(gqa_path, path)
    norm = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output_norm.weight")
    np.memmap(path, dtype=np.float32, mode="r+", offset=norm.data_offset, shape=(int(norm.n_elements),))[:] = np.nan
    code, out, err = run_cli(["generate", "--model", str(path), "--raw", "-n", "3", "the cat"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "logits after position" in err and "NaN" in err and "--check-finite" in err


def test_check_finite_accepts_the_masks_minus_inf(gqa):
    _, rec = traced_shapes(gqa, [5, 6, 7], 10, check_finite=True, stages=["kq_mask", "kq_masked"], stats=True)
    assert rec.events[0].stats["inf"] == 3                  # the 3x3 mask's upper triangle


def test_ctrl_c_exits_130_and_keeps_the_old_files(gqa_path, tmp_path, capsys, monkeypatch):
    """An interrupted trace wrote its partial lines over an existing --jsonl / --log-file; now the
    new lines go to a temporary file that takes the name only when the trace is done."""
    from llamatrace.views import render
    calls = {"n": 0}
    original = render.LogView.__call__

    def interrupt_on_tenth(self, event):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        original(self, event)

    monkeypatch.setattr(render.LogView, "__call__", interrupt_on_tenth)
    jl, log, nz = tmp_path / "t.jsonl", tmp_path / "d.log", tmp_path / "t.npz"
    jl.write_text("old\n")
    code, _, err = run_cli(["trace", "--model", str(gqa_path), "--jsonl", str(jl), "--log-file", str(log),
                            "--npz", str(nz)], capsys)
    assert code == 130
    assert jl.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
    assert f"{jl} was not written (the old file is kept); {log} was not written; {nz} was not written" in err


def test_the_trace_files_take_their_names_when_the_trace_is_done(gqa_path, tmp_path, capsys, monkeypatch):
    from llamatrace.views import render
    seen = []
    original = render.LogView.__call__

    def look(self, event):                     # while the trace runs: only temporary files
        seen.append(sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")))
        original(self, event)

    monkeypatch.setattr(render.LogView, "__call__", look)
    jl = tmp_path / "t.jsonl"
    jl.write_text("old\n")
    code, _, err = run_cli(["trace", "--model", str(gqa_path), "--jsonl", str(jl), "--layer", "0"], capsys)
    assert code == 0, err
    assert seen and all(names == ["t.jsonl"] for names in seen)
    lines = [json.loads(line) for line in jl.read_text(encoding="utf-8").splitlines()]
    assert lines[0]["type"] == "header" and lines[-1]["type"] == "footer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_a_stream_to_a_device_is_written_in_place(gqa_path, tmp_path, capsys):
    # a named pipe stands for /dev/null or a terminal: read while the trace writes, still a pipe after
    fifo = tmp_path / "lines"
    os.mkfifo(fifo)
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.extend(fifo.read_text(encoding="utf-8").splitlines()),
                              daemon=True)
    reader.start()
    code, _, err = run_cli(["trace", "--model", str(gqa_path), "--jsonl", str(fifo), "--layer", "0"], capsys)
    reader.join(timeout=60)
    assert code == 0, err
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["lines"]
    assert json.loads(read[0])["type"] == "header" and json.loads(read[-1])["type"] == "footer"


def test_a_trace_whose_logits_are_nan_keeps_what_it_traced(gqa_path, tmp_path, capsys):
    """Without --check-finite, NaN logits stopped the trace with nothing saved: the recording and
    the lines are the evidence."""
    path = tmp_path / "nan.gguf"
    shutil.copyfile(gqa_path, path)
    norm = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output_norm.weight")
    np.memmap(path, dtype=np.float32, mode="r+", offset=norm.data_offset, shape=(int(norm.n_elements),))[:] = np.nan
    jl, nz = tmp_path / "t.jsonl", tmp_path / "t.npz"
    code, _, err = run_cli(["trace", "--model", str(path), "--raw", "--jsonl", str(jl), "--npz", str(nz), "the cat"],
                           capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "logits after position" in err and f"the trace so far is in {jl}, {nz}" in err
    with np.load(nz) as rec:
        assert np.isnan(rec["step0.result_norm"]).all() and np.isfinite(rec["step0.layer0.l_out"]).all()
    assert json.loads(jl.read_text().splitlines()[0])["type"] == "header"


@pytest.mark.parametrize("options, says", [
    ([], "interrupted"),
    (["--npz", "t.npz"], "interrupted: t.npz was not written"),
    (["--log-file", "d.log"], "interrupted: d.log was not written"),
    (["--jsonl", "t.jsonl", "--npz", "t.npz"], "interrupted: t.jsonl was not written; t.npz was not written"),
    (["--jsonl", "-"], "interrupted: every line written to stdout so far is complete"),
])
def test_ctrl_c_says_only_what_applies_to_the_outputs_asked_for(gqa_path, tmp_path, capsys, monkeypatch,
                                                                 options, says):
    from llamatrace.views import render

    def interrupt(self, event):
        raise KeyboardInterrupt

    monkeypatch.setattr(render.LogView, "__call__", interrupt)
    monkeypatch.setattr(render.JsonlWriter, "__call__", interrupt)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["trace", "--model", str(gqa_path), *options], capsys)
    assert code == 130
    assert [line for line in err.splitlines() if line.startswith("interrupted")] == [says]


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--layer", "5"], ["--layer", "0-1"]),
    (["--layer", "-3"], ["out of range", "0-1"]),
    (["--layer", "1-x"], ["--layer", "N-M"]),
    (["--stage", "kq*,nope"], ["nope", "llamatrace stages -m MODEL"]),
    (["--tokens", "-1"], ["--tokens"]),
    (["--dump-shapes", "--format", "table"], ["--dump-shapes"]),
])
def test_bad_options_fail_with_one_line(gqa_path, tmp_path, capsys, args, words):
    jl = tmp_path / "t.jsonl"
    code, out, err = run_cli(["trace", "--model", str(gqa_path), "--jsonl", str(jl), *args], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    assert not jl.exists()


@pytest.mark.parametrize("name", ["trace.txt", "trace", "trace.NPZ.gz"])
def test_npz_recording_must_end_in_npz_as_compare_reads_it(tmp_path, capsys, name):
    # a model path that does not exist: the name is refused first, and nothing is written
    code, out, err = run_cli(["trace", "--model", str(tmp_path / "absent.gguf"), "--npz", str(tmp_path / name)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--npz" in err and ".npz" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["--jsonl", "--npz", "--log-file"])
@pytest.mark.parametrize("where", ["directory", "missing_dir", "under_a_file"])
def test_unwritable_output_fails_before_loading(tmp_path, capsys, option, where):
    (tmp_path / "file.txt").write_text("x")
    target = {"directory": tmp_path, "missing_dir": tmp_path / "nope" / "t.out",
              "under_a_file": tmp_path / "file.txt" / "t.out"}[where]
    # a model path that does not exist: the output check must fail first
    code, out, err = run_cli(["trace", "--model", str(tmp_path / "absent.gguf"), option, str(target)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and option in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_check_output_path_accepts_new_file(tmp_path):
    check_output_path(tmp_path / "new.jsonl", "--jsonl")
    with pytest.raises(OutputError, match="is a directory"):
        check_output_path(tmp_path, "--jsonl")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec, expected", [
    ("all", None), ("0", [0]), ("-1", [29]), ("-2", [28]), ("3-5", [3, 4, 5]), ("0, 2-3 ,-1", [0, 2, 3, 29]),
    ("ALL", None), ("29", [29]),
])
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 30) == expected


@pytest.mark.parametrize("spec", ["30", "-31", "5-2", "x", "1-", "", "0-30"])
def test_parse_layers_rejects(spec):
    with pytest.raises(OptionError, match="--layer"):
        parse_layers(spec, 30)


def test_layer_stage_ids_cover_issue_list():
    # the Llama layer: every layer stage but those of other architectures' features
    llama = [sid for sid in LAYER_STAGE_IDS
             if STAGE_BY_ID[sid].when in ("always", "masked", "gqa") or STAGE_BY_ID[sid].when.startswith("!")]
    assert [s for s, _ in _issue_layer(5, 5)] == llama


def test_a_long_trace_says_how_long_before_it_starts(capsys, tiny_model_path):
    from cli_helpers import run
    code, out, err = run(capsys, "trace", "-m", tiny_model_path, "--raw", "--tokens", "65", "--layer", "0",
                         "--stage", "attn_norm", "hello")
    assert code == 0 and "warning" not in err              # 65 events: short, however many steps
    code, out, err = run(capsys, "trace", "-m", tiny_model_path, "--raw", "--tokens", "3", "hello")
    assert code == 0 and "warning" not in err
    # every stage: the count is what a decode step of this model emits (it multiplied the whole
    # catalogue, other architectures' stages too, by the layers: ~2.5 times too many)
    import re
    code, out, err = run(capsys, "trace", "-m", tiny_model_path, "--raw", "--tokens", "65", "--jsonl", "-", "hello")
    assert code == 0, err
    said = int(re.search(r"stage events \((\d+) a step\)", err).group(1))
    events = [json.loads(line) for line in out.splitlines()[1:-1]]
    steps = {e["step"] for e in events}
    assert said == sum(1 for e in events if e["step"] == 2) and len(steps) > 60
    assert f"warning: tracing 65 decode steps prints about {65 * said:,} stage events ({said} a step)" in err
    code, out, err = run(capsys, "trace", "-m", tiny_model_path, "--raw", "--tokens", "65", "--stage", "kq_mask",
                         "hello there")
    assert code == 0 and "warning" not in err            # a prefill-only stage: no '0 stage events (0 a step)'


def test_a_chunked_prefill_is_billed_to_prefill_and_only_generation_steps_to_decode(gqa):
    """A prompt run in chunks (the second at start_pos 4) is prefill; a one-token step is decode,
    and a one-token chunk of a prompt is prefill when its caller says so."""
    ids = [5, 6, 7, 8, 9, 10, 11]
    cache = gqa.new_cache(len(ids) + 2)
    rec = Recorder(stages=["l_out"], layers=[0], time_all=True)
    gqa.forward(np.asarray(ids[:4]), 0, cache, recorder=rec)
    gqa.forward(np.asarray(ids[4:6]), 4, cache, recorder=rec)
    gqa.forward(np.asarray(ids[6:]), 6, cache, recorder=rec, phase="prefill")
    gqa.forward(np.asarray([12]), 7, cache, recorder=rec)
    assert [(e.start_pos, e.seq_len, e.phase) for e in rec.events] == [
        (0, 4, "prefill"), (4, 2, "prefill"), (6, 1, "prefill"), (7, 1, "decode")]
    assert rec.stage_times[("prefill", "l_out")][1] == 3 * gqa.config.n_layers
    assert rec.stage_times[("decode", "l_out")][1] == gqa.config.n_layers
    # generate: one prefill call, then one decode call per generated token after the first
    with gqa.trace(stages=["result_norm"]) as traced:
        assert len(list(gqa.generate(ids, max_tokens=3))) == 3
    assert [e.phase for e in traced.events] == ["prefill", "decode", "decode"]


def test_a_ctx_size_over_the_models_context_is_refused_before_any_output(capsys, tiny_model_path, tmp_path):
    """It was checked when the cache was made: the prompt table had printed and --jsonl's file held its header."""
    from cli_helpers import assert_one_line_error, run
    jl = tmp_path / "t.jsonl"
    for command in (["trace", "--jsonl", jl], ["generate"]):
        code, out, err = run(capsys, *command, "-m", tiny_model_path, "--raw", "--ctx-size", "100000", "hello")
        assert_one_line_error(code, out, err, "--ctx-size 100000 is over the model's context length 64")
    assert not jl.exists()


def test_a_trace_stopped_by_a_full_context_says_so(gqa_path, capsys):
    """The note said 'stopped after 2 decode steps: context', the reason's code."""
    code, _, err = run_cli(["trace", "--model", str(gqa_path), "--raw", "--tokens", "5", "--ctx-size", "4",
                            "--layer", "0", "--stage", "l_out", "the"], capsys)
    assert code == 0, err
    note = next(line for line in err.splitlines() if line.startswith("note: stopped after"))
    assert "the context is full (4 tokens; raise --ctx-size, at most the model's" in note, note


def test_a_killed_traces_temporary_lines_are_removed_by_the_next(gqa_path, tmp_path, capsys):
    """--jsonl now goes to .NAME.PID.XXXXXXXX.tmp until the trace ends: one a SIGKILL left (its
    process gone) is removed by the next trace writing there, with a note."""
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".t.jsonl.{int(dead.stdout)}.abcd1234.tmp"
    stale.write_text('{"type": "header"}\n')
    code, _, err = run_cli(["trace", "--model", str(gqa_path), "--jsonl", str(tmp_path / "t.jsonl"), "--layer", "0",
                            "--stage", "l_out"], capsys)
    assert code == 0, err
    assert "removed 1 temporary file of a killed run" in err and stale.name in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
