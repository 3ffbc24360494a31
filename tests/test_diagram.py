"""`llamatrace diagram`: DOT/SVG/PNG/PDF from a traced run of a tiny GGUF, through ``main([...])``.

A snapshot of our own DOT (tests/snapshots/tiny_block.dot) pins the block view byte for byte;
after a deliberate change rewrite it with ``LLAMATRACE_UPDATE_SNAPSHOTS=1 python -m pytest
tests/test_diagram.py -k snapshot`` (see tests/snapshot.py).
"""

from __future__ import annotations

import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from snapshot import assert_matches_snapshot

from llamatrace.views import diagram as dg
from cli_helpers import error_line

from llamatrace.cli import main
from llamatrace.tracing.stages import STAGES, stage_applies

PROMPT = "The capital of France is"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")


def run(model_path: Path, *args: str) -> int:
    return main(["diagram", "--model", str(model_path), "--raw", PROMPT, *args])


def node_block(dot: str, node: str) -> str:
    """The DOT statement declaring ``node`` (its label and attributes)."""
    m = re.search(rf"^\s*{re.escape(node)} \[(.*?)\]$", dot, flags=re.M | re.S)
    assert m, f"node {node} not in the DOT source"
    return m.group(1)


# --- determinism and the snapshot ----------------------------------------------------------
def test_block_dot_is_deterministic_and_matches_snapshot(tiny_model_path, tmp_path):
    a, b = tmp_path / "a.dot", tmp_path / "b.dot"
    assert run(tiny_model_path, "--view", "block", "-o", str(a)) == 0
    assert run(tiny_model_path, "--view", "block", "-o", str(b)) == 0
    assert a.read_bytes() == b.read_bytes()
    assert_matches_snapshot(a.read_text(encoding="utf-8"), "tiny_block.dot")


def test_dot_output_carries_no_addresses_paths_or_timings(tiny_model_path, tmp_path):
    out = tmp_path / "m.dot"
    assert run(tiny_model_path, "-o", str(out)) == 0
    dot = out.read_text(encoding="utf-8")
    assert str(tmp_path) not in dot and str(tiny_model_path.parent) not in dot
    assert not re.search(r"0x[0-9a-f]{6,}|µs|\d ms\b", dot)


# --- SVG: every block stage with the traced shapes --------------------------------------------
@needs_dot
def test_svg_has_a_node_for_every_block_stage_with_traced_shapes(tiny_model, tiny_model_path, tmp_path):
    out = tmp_path / "block.svg"
    assert run(tiny_model_path, "--view", "block", "-o", str(out)) == 0
    root = ET.parse(out).getroot()
    ns = {"s": "http://www.w3.org/2000/svg"}
    nodes = {g.find("s:title", ns).text: " ".join(t.text or "" for t in g.iter(f"{{{ns['s']}}}text"))
             for g in root.iter(f"{{{ns['s']}}}g") if g.get("class") == "node"}
    ids = tiny_model.tokenizer.encode(PROMPT)
    events, run_info = dg.trace_step(tiny_model, PROMPT, ids, chat=False)
    shapes = {e.stage: e.shape for e in events if e.layer in (None, 0)}
    c = tiny_model.config
    expected = [s for s in STAGES if s.level == "layer" and stage_applies(s, len(ids), c.n_rep)]
    assert len(expected) == 30                           # tiny model: GQA (n_rep 2), prefill with mask
    for stage in expected:
        assert stage.id in nodes, f"no node for stage {stage.id}"
        shape = "[" + ", ".join(map(str, shapes[stage.id])) + "]"
        assert shape in nodes[stage.id], (stage.id, shape, nodes[stage.id])
        assert stage.chapter in nodes[stage.id] and stage.op in nodes[stage.id]
    cache = nodes[dg.KV_CACHE]
    assert f"[{run_info.max_seq}, {c.n_kv_heads}, {c.head_dim}]" in cache and f"[0:{len(ids)}]" in cache
    assert "blk.0.attn_q.weight" in nodes["w_Qcur_attn_wq"] and "Q8_0" in nodes["w_Qcur_attn_wq"]
    assert "4 query heads share 2 KV heads" in out.read_text(encoding="utf-8")


@needs_dot
@pytest.mark.parametrize("ext,magic", [("png", b"\x89PNG\r\n\x1a\n"), ("pdf", b"%PDF-")])
def test_png_and_pdf_start_with_their_magic_bytes(tiny_model_path, tmp_path, ext, magic):
    out = tmp_path / f"flow.{ext}"
    assert run(tiny_model_path, "-o", str(out)) == 0
    assert out.read_bytes().startswith(magic)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]          # no temporary file left


# --- views, steps, highlight -----------------------------------------------------------------
def test_model_view_draws_tokens_block_times_n_layers_logits_and_next_token(tiny_model_path, tmp_path):
    out = tmp_path / "m.dot"
    assert run(tiny_model_path, "-o", str(out)) == 0
    dot = out.read_text(encoding="utf-8")
    for node in (dg.TOKENS, "inp_embd", dg.BLOCK_IN, "l_out", "result_norm", "result_output", dg.SAMPLED,
                 dg.LEGEND, dg.KV_CACHE):
        node_block(dot, node)
    assert "Transformer block × 2" in dot and "token_embd.weight" in node_block(dot, "w_result_output_output")
    assert "(residual)" in dot


def test_decode_step_draws_one_query_row_without_mask(tiny_model, tiny_model_path, tmp_path):
    out = tmp_path / "s1.dot"
    assert run(tiny_model_path, "--view", "block", "--step", "1", "--layer", "1", "-o", str(out)) == 0
    dot = out.read_text(encoding="utf-8")
    n = len(tiny_model.tokenizer.encode(PROMPT))
    assert "kq_mask" not in dot and "kq_masked" not in dot
    assert "decode step 1" in dot and "blk.1.attn_q.weight" in dot
    assert "[1, 64] float32" in node_block(dot, "attn_norm")
    assert f"writes rows [{n}:{n + 1}]" in node_block(dot, "cache_k")
    assert f"reads rows [0:{n + 1}]" in node_block(dot, "keys")


@pytest.mark.parametrize("spec,hot,not_hot", [
    ("8", ("Qcur", "Kcur", "Vcur"), ("Qcur_rope",)),
    ("Qcur_rope", ("Qcur_rope",), ("Kcur_rope", "Qcur")),
    ("11", ("cache_k", "cache_v", "keys", "values", "keys_rep", "values_rep"), ("kq",)),
])
def test_highlight_by_stage_number_and_by_id(tiny_model_path, tmp_path, spec, hot, not_hot):
    out = tmp_path / "h.dot"
    assert run(tiny_model_path, "--view", "block", "--highlight", spec, "-o", str(out)) == 0
    dot = out.read_text(encoding="utf-8")
    for node in hot:
        assert "you are here" in node_block(dot, node), node
    for node in not_hot:
        assert "you are here" not in node_block(dot, node), node
    assert dg.resolve_highlight(spec).label in dot.replace("&quot;", '"')


def test_highlight_12_marks_the_transposed_inputs(tiny_model_path, tmp_path):
    out = tmp_path / "h12.dot"
    assert run(tiny_model_path, "--view", "block", "--highlight", "12", "-o", str(out)) == 0
    dot = out.read_text(encoding="utf-8")
    transposed = [ln for ln in dot.splitlines() if "transposed" in ln and "->" in ln]
    assert len(transposed) == 3 and all("#d62728" in ln for ln in transposed)


# --- errors: one line, exit 2, no file ---------------------------------------------------------
@pytest.mark.parametrize("name", ["flow.jpg", "flow", "flow.svgz"])
def test_unknown_extension_lists_formats_before_loading_the_model(tmp_path, capsys, name):
    code = main(["diagram", "--model", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / name)])
    assert code == 2
    line = error_line(capsys)
    assert ".svg, .png, .pdf, .dot" in line and "missing.gguf" not in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec", ["0", "20", "nope", "-3"])
def test_bad_highlight_is_a_one_line_error(tmp_path, capsys, spec):
    code = main(["diagram", "--model", str(tmp_path / "missing.gguf"), "--highlight", spec,
                 "-o", str(tmp_path / "f.dot")])
    assert code == 2
    line = error_line(capsys)
    assert "--highlight" in line and "llamatrace stages -m MODEL" in line and len(line) < 250, line   # not 80 ids
    assert list(tmp_path.iterdir()) == []


def test_model_level_highlight_in_block_view_is_refused(tmp_path, capsys):
    code = main(["diagram", "--model", str(tmp_path / "missing.gguf"), "--view", "block", "--highlight", "19",
                 "-o", str(tmp_path / "f.dot")])
    assert code == 2 and "model view" in error_line(capsys)


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    from moe_files import write_moe_file
    d = tmp_path_factory.mktemp("moe")
    return {name: write_moe_file(d / f"{name}.gguf", name) for name in ("qwen3moe", "olmoe")}


@pytest.mark.parametrize("model,args,says", [
    # qwen3moe has GQA (n_rep 2): the old message blamed n_rep = 1 for any stage that did not run
    ("qwen3moe", ("--highlight", "ffn_gate"),
     ("ffn_gate is not computed by a model with a mixture of experts; it has ffn_moe_gate",)),
    ("qwen3moe", ("--highlight", "ffn_swiglu"), ("ffn_swiglu is not computed by a model with a mixture of experts",)),
    ("olmoe", ("--highlight", "keys_rep"), ("n_rep = 1", "as many KV heads as query heads (4, no GQA)")),
    ("dense", ("--highlight", "ffn_moe_topk"),
     ("ffn_moe_topk is computed only by models with a mixture of experts, and this one has none",)),
    ("dense", ("--highlight", "Qcur_normed"), ("Qcur_normed is computed only by models with q/k norms",)),
    ("dense", ("--highlight", "kq_masked", "--step", "1"), ("single query row", "needs no causal mask", "--step 0")),
])
def test_a_highlight_that_did_not_run_says_why_from_the_catalogue(tiny_model_path, moe_paths, tmp_path, capsys,
                                                                  model, args, says):
    path = tiny_model_path if model == "dense" else moe_paths[model]
    out = tmp_path / "x.dot"
    assert run(path, "--view", "block", *args, "-o", str(out)) == 2
    line = error_line(capsys)
    # a stage the model never computes is refused from its header; one absent at this step, after the trace
    where = ": not drawn at layer 0, step " if "--step" in args else ": never drawn for this model: "
    assert line.startswith(f"error: --highlight {args[1]} (") and where in line, line
    for words in says:
        assert words in line, line
    assert "n_rep" not in line or model == "olmoe", line
    assert not out.exists()


@pytest.mark.parametrize("target", ["dir", "missing_parent"])
def test_bad_output_paths_fail_before_compute(tmp_path, capsys, target):
    path = tmp_path / "out.svg" if target == "dir" else tmp_path / "nope" / "flow.svg"
    if target == "dir":
        path.mkdir()
    code = main(["diagram", "--model", str(tmp_path / "missing.gguf"), "-o", str(path)])
    assert code == 2
    line = error_line(capsys)
    assert ("is a directory" in line) if target == "dir" else ("does not exist" in line)
    assert [p.name for p in tmp_path.iterdir()] == (["out.svg"] if target == "dir" else [])
    assert not any(path.iterdir()) if target == "dir" else True


def test_layer_out_of_range_and_bad_view(tiny_model_path, tmp_path, capsys):
    assert run(tiny_model_path, "--layer", "2", "-o", str(tmp_path / "f.dot")) == 2
    assert "valid are 0-1" in error_line(capsys)
    assert run(tiny_model_path, "--view", "side", "-o", str(tmp_path / "f.dot")) == 2
    assert "model, block" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_missing_dot_names_the_fix_and_dot_output(tiny_model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert run(tiny_model_path, "-o", str(tmp_path / "flow.svg")) == 2
    line = error_line(capsys)
    assert "apt-get install graphviz" in line and "scripts/setup.sh" in line and ".dot" in line
    assert list(tmp_path.iterdir()) == []


def test_dot_vanishing_at_render_time_gives_the_same_error(tiny_model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dg, "check_graphviz", lambda fmt: None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))        # graphviz raises ExecutableNotFound
    assert run(tiny_model_path, "-o", str(tmp_path / "flow.png")) == 2
    assert "apt-get install graphviz" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_dot_output_needs_no_graphviz_binary(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    out = tmp_path / "flow.dot"
    assert run(tiny_model_path, "-o", str(out)) == 0
    assert out.read_text(encoding="utf-8").startswith("digraph llamatrace {")


def test_interrupt_while_writing_leaves_no_partial_file(tiny_model_path, tmp_path, monkeypatch):
    out = tmp_path / "flow.dot"
    out.write_text("old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    assert run(tiny_model_path, "-o", str(out)) == 130
    assert [p.name for p in tmp_path.iterdir()] == ["flow.dot"] and out.read_text() == "old"


def test_stats_and_timings_annotate_nodes(tiny_model_path, tmp_path):
    out = tmp_path / "s.dot"
    assert run(tiny_model_path, "--view", "block", "--stats", "--timings", "-o", str(out)) == 0
    node = node_block(out.read_text(encoding="utf-8"), "kq_soft_max")
    assert "rms" in node and re.search(r"\d (µs|ms) \(\d+%\)", node) and "/oranges9/" in node


@needs_dot
def test_a_control_character_in_the_prompt_is_drawn_escaped(tiny_model_path, tmp_path):
    # a byte token such as 0x17 (one a random-weight MoE file sampled) is not XML: dot refused the label
    out = tmp_path / "flow.svg"
    assert main(["diagram", "--model", str(tiny_model_path), "--raw", "a\x17b", "-o", str(out)]) == 0
    texts = "".join(ET.parse(out).getroot().itertext())
    assert "a\\x17b" in texts and "\x17" not in texts
