"""The recipe search on a mixture of experts (qwen3moe): one group per expert tensor
(``blk.N.ffn_{gate,up,down}_exps``, every expert of the layer, as one GGUF tensor takes one type),
swapped into the loaded model expert by expert, measured and allocated like the dense groups."""

from __future__ import annotations

import numpy as np
import pytest
from moe_files import SPECS, write_moe_file

from llamatrace.gguf.reader import open_gguf
from llamatrace.kernels.quantizers.rows import quantize_rows
from llamatrace.model.llama import Llama
from llamatrace.quantize import search as S
from llamatrace.quantize.rules import FILE_TYPES
from llamatrace.quantize.writer import quantize_gguf

import gguf

T = gguf.GGMLQuantizationType
SPEC = SPECS["qwen3moe"]


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    return write_moe_file(tmp_path_factory.mktemp("search-moe") / "qwen3moe.gguf", "qwen3moe")


def _calibration(model, n_chunks=2, n_ctx=24, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, model.config.vocab_size, n_ctx) for _ in range(n_chunks)]
    first = n_ctx // 2
    return S.Calibration(ids, [np.asarray(i[first + 1:], np.int64) for i in ids], first)


def test_groups_of_a_moe(moe_base):
    with open_gguf(moe_base) as f:
        groups = {g.name: g for g in S.make_groups(f, SPEC["n_layers"], [T.Q4_0, T.Q8_0])}
        untied = "output.weight" in f.tensors
    n, ff, dim = SPEC["n_expert"], SPEC["expert_ff"], 64
    for layer in range(SPEC["n_layers"]):
        for kind in S.EXPERT_KINDS:
            g = groups[f"blk.{layer}.{kind}"]
            rows, cols = (dim, ff) if kind == "ffn_down_exps" else (ff, dim)
            assert (g.n_expert, g.n_rows, g.n_per_row, g.layer) == (n, n * rows, cols, layer)
        assert not any(f"blk.{layer}.{k}" in groups for k in ("ffn_gate_inp", "ffn_gate", "ffn_up", "ffn_down"))
    assert len(groups) == SPEC["n_layers"] * 7 + 1 + untied     # attn_q/k/v/output, 3 expert tensors; token_embd, output


def test_in_memory_swap_equals_the_file(moe_base, tmp_path):
    """Every group swapped in memory (the experts one by one) gives the logits of the file quantized with
    the same types by llamatrace's llama-quantize writer."""
    types = [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_1, T.Q5_0]
    with Llama.load(moe_base) as model:
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
            with quantized.hooks({"l_out": lambda a, e: final.__setitem__(0, a)}, layers=[SPEC["n_layers"] - 1]):
                quantized.forward(ids, 0, quantized.new_cache(len(ids)))
            np.testing.assert_array_equal(swapped[c], quantized.logits(final[0][cal.first:len(ids) - 1]))


@pytest.mark.parametrize("mode", ["all", "probe"])
def test_search_measures_and_allocates_expert_groups(moe_base, tmp_path, mode):
    cands = [T.Q4_0, T.Q8_0]
    with Llama.load(moe_base) as model:
        cal = _calibration(model)
        groups = S.make_groups(model.file, model.config.n_layers, cands)
        store = S.Measurements.open(tmp_path / "m.json", {"mode": mode})
        S.measure_groups(S.Setup(cal, quantize_rows, mode), groups, store, model=model)
        for g in groups:
            if g.n_expert:
                d = store.delta[g.name]
                assert 0 <= d["Q8_0"] < d["Q4_0"], (g.name, d)
        budget = S.make_budget(model.file, groups, target_bpw=6.5)
        recipe = S.choose(groups, store, budget, store.base_kld, mode)
    assert recipe.total_bytes <= budget.limit
    assert {c.ggml_type for c in recipe.choices if c.group.n_expert} == {T.Q4_0, T.Q8_0}      # a real mix of experts


def test_expert_group_quantized_with_a_per_expert_imatrix_as_the_writer(moe_base):
    """An expert group's bytes with a per-expert importance (``[n_expert × n_per_row]``, as
    ``column_importances`` gives it) are the writer's (each expert with its own slice, as llama-quantize)."""
    from llamatrace.quantize.writer import convert_tensor
    with Llama.load(moe_base) as model:
        measurer = S.Measurer(model, _calibration(model, n_chunks=1), quantize_rows)
        g = next(g for g in S.make_groups(model.file, model.config.n_layers, [T.Q4_0]) if g.name == "blk.1.ffn_down_exps")
        imatrix = (1 + np.arange(g.n_expert * g.n_per_row) % 97).astype(np.float32)
        ours = measurer.quantized(g, T.Q4_0, imatrix=imatrix)
        assert ours.tobytes() == convert_tensor(model.file.tensor(g.tensor), T.Q4_0, imatrix).tobytes()
        assert ours.tobytes() != measurer.quantized(g, T.Q4_0, imatrix=imatrix[:g.n_per_row]).tobytes()


def test_cli_recipe_of_a_moe(moe_base, tmp_path, capsys):
    """``quantize --target-bpw -f`` on a MoE: the recipe names the expert groups, the file holds their
    types, within the budget, and the plot has their columns."""
    import json
    from pathlib import Path

    from cli_helpers import run
    corpus = Path(__file__).parent / "golden" / "corpus.txt"
    out = tmp_path / "out.gguf"
    code, stdout, err = run(capsys, "quantize", moe_base, out, "--target-bpw", "6.5", "-f", corpus, "--ctx-size", 32,
                            "--chunks", 2, "--candidates", "Q4_0,Q8_0", "--json", "-o", tmp_path / "recipe.png")
    assert code == 0, err
    recipe = json.loads(stdout)["recipe"]
    chosen = {g["group"] + ".weight": g["type"] for g in recipe["groups"]}
    assert {f"blk.{i}.{k}.weight" for i in range(SPEC["n_layers"]) for k in S.EXPERT_KINDS} <= set(chosen)
    reader = gguf.GGUFReader(str(out))
    assert chosen.items() <= {t.name: t.tensor_type.name for t in reader.tensors}.items()
    data = sum(int(t.n_bytes) for t in reader.tensors)
    assert data == recipe["bytes"] and 8 * data / sum(int(t.n_elements) for t in reader.tensors) <= 6.5
    assert (tmp_path / "recipe.png").stat().st_size > 10_000
