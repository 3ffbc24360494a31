"""The recipe search on Qwen3.5 (``qwen35``): a gated DeltaNet layer's matrices (``attn_qkv``, the
mixed q|k|v projection, ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_out``) are groups beside
the full-attention layers' and the FFN's, swapped into the loaded model one by one; a swapped
recipe gives exactly the logits of the file written with it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import run
from qwen35_files import DIM, HIDDEN, N_LAYERS, N_V_HEADS, SSM_HEAD_DIM, write_qwen35_file

from llamatrace.gguf.reader import open_gguf
from llamatrace.kernels.quantizers.rows import quantize_rows
from llamatrace.model.llama import Llama
from llamatrace.quantize import search as S
from llamatrace.quantize.rules import FILE_TYPES
from llamatrace.quantize.writer import quantize_gguf

T = gguf.GGMLQuantizationType
RECURRENT = (0, 1, 3)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_qwen35_file(tmp_path_factory.mktemp("search-qwen35") / "qwen35.gguf")


def _calibration(model, n_chunks=2, n_ctx=16, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, model.config.vocab_size, n_ctx) for _ in range(n_chunks)]
    first = n_ctx // 2
    return S.Calibration(ids, [np.asarray(i[first + 1:], np.int64) for i in ids], first)


def test_groups_of_a_qwen35(base):
    with open_gguf(base) as f:
        groups = {g.name: g for g in S.make_groups(f, N_LAYERS, [T.Q4_0, T.Q8_0])}
    v_dim = N_V_HEADS * SSM_HEAD_DIM
    for layer in range(N_LAYERS):
        kinds = S.DELTANET_KINDS if layer in RECURRENT else ("attn_q", "attn_k", "attn_v", "attn_output")
        assert {n.split(".")[2] for n in groups if n.startswith(f"blk.{layer}.")} == set(kinds) | {
            "ffn_gate", "ffn_up", "ffn_down"}
        assert (groups[f"blk.{layer}.ffn_down"].n_rows, groups[f"blk.{layer}.ffn_down"].n_per_row) == (DIM, HIDDEN)
    assert (groups["blk.0.ssm_out"].n_rows, groups["blk.0.ssm_out"].n_per_row) == (DIM, v_dim)
    assert (groups["blk.0.ssm_beta"].n_rows, groups["blk.0.ssm_beta"].layer) == (N_V_HEADS, 0)
    assert not any("ssm_conv1d" in n or "ssm_a" == n.split(".")[-1] for n in groups)


def test_in_memory_swap_equals_the_file(base, tmp_path):
    """Every group swapped in memory gives the logits of the file quantized with the same types."""
    types = [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_1, T.Q5_0]
    with Llama.load(base) as model:
        cal = _calibration(model)
        measurer = S.Measurer(model, cal, quantize_rows)
        groups = S.make_groups(model.file, model.config.n_layers, types)
        mix = {g.tensor: types[i % len(types)] for i, g in enumerate(groups)}
        for g in groups:
            measurer.swap(g, measurer.pack(g, mix[g.tensor], measurer.quantized(g, mix[g.tensor])))
        swapped = [measurer._scored_logits(measurer._final_residual(c, 0)) for c in range(2)]
        all_types = {n: mix.get(n, t.tensor_type) for n, t in model.file.tensors.items()}
        quantize_gguf(model.file, tmp_path / "mix.gguf", all_types, FILE_TYPES["Q8_0"])
    with Llama.load(tmp_path / "mix.gguf") as quantized:
        assert {n: quantized.file.tensors[n].tensor_type for n in mix} == mix
        for c, ids in enumerate(cal.ids):
            final = {}
            with quantized.hooks({"l_out": lambda a, e: final.__setitem__(0, a)}, layers=[N_LAYERS - 1]):
                quantized.forward(ids, 0, quantized.new_cache(len(ids)))
            np.testing.assert_array_equal(swapped[c], quantized.logits(final[0][cal.first:len(ids) - 1]))


@pytest.mark.parametrize("mode", ["all", "probe"])
def test_search_measures_the_deltanet_groups(base, tmp_path, mode):
    cands = [T.Q4_0, T.Q8_0]
    with Llama.load(base) as model:
        groups = S.make_groups(model.file, model.config.n_layers, cands)
        store = S.Measurements.open(tmp_path / "m.json", {"mode": mode})
        S.measure_groups(S.Setup(_calibration(model), quantize_rows, mode), groups, store, model=model)
    for kind in ("attn_qkv", "attn_gate", "ssm_out"):
        d = store.delta[f"blk.1.{kind}"]
        assert 0 <= d["Q8_0"] < d["Q4_0"], (kind, d)


def test_cli_recipe_of_a_qwen35(base, tmp_path, capsys):
    """``quantize BASE OUT --target-bpw -f`` on qwen35: the recipe names the DeltaNet groups, the
    file holds their types, within the budget."""
    corpus = Path(__file__).parent / "golden" / "corpus.txt"
    out = tmp_path / "out.gguf"
    code, stdout, err = run(capsys, "quantize", base, out, "--target-bpw", "7", "-f", corpus, "--ctx-size", 16,
                            "--chunks", 2, "--candidates", "Q4_0,Q8_0", "--json", "-o", tmp_path / "recipe.png")
    assert code == 0, err
    recipe = json.loads(stdout)["recipe"]
    chosen = {g["group"] + ".weight": g["type"] for g in recipe["groups"]}
    assert {f"blk.{i}.{k}.weight" for i in RECURRENT for k in S.DELTANET_KINDS} <= set(chosen)
    reader = gguf.GGUFReader(str(out))
    assert chosen.items() <= {t.name: t.tensor_type.name for t in reader.tensors}.items()
    data = sum(int(t.n_bytes) for t in reader.tensors)
    assert data == recipe["bytes"] and 8 * data / sum(int(t.n_elements) for t in reader.tensors) <= 7
    assert (tmp_path / "recipe.png").stat().st_size > 10_000


def test_probe_weights_attn_output_by_the_gated_heads_and_ssm_out_by_the_gated_norm(base):
    """Probe mode's column weights are the mean squares of each matrix's real input: the gated heads
    (``attn_gated``, not ``kqv_out``) for a gated attention's ``attn_output``, ``final_output`` for ``ssm_out``."""
    from llamatrace.tracing.recorder import Recorder
    with Llama.load(base) as model:
        cal = _calibration(model, n_chunks=1)
        measurer = S.Measurer(model, cal, quantize_rows)
        rec = Recorder(keep_arrays=True)
        model.forward(cal.ids[0], 0, model.new_cache(len(cal.ids[0])), recorder=rec)
        a = rec.arrays()
    for key, stage in ((("kqv_out", 2), "step0.layer2.attn_gated"), (("final_output", 1), "step0.layer1.final_output")):
        x = a[stage].astype(np.float64)
        np.testing.assert_allclose(measurer._col_sq[key], (x * x).mean(axis=0), rtol=1e-6)


def test_a_fused_attn_qkv_outside_a_deltanet_layer_is_still_refused():
    class File:                        # phi3's layout: attn_qkv with no ssm_out beside it
        tensors = {"blk.0.attn_qkv.weight": None, "blk.0.attn_output.weight": None}
    with pytest.raises(S.UnsupportedModelError, match="fused attn_qkv"):
        S.make_groups(File(), 1, [T.Q4_0])
