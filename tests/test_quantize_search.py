"""The recipe search (llamatrace.quantize.search): the allocator against brute force, the budget,
the in-memory swap against a file written with the same types, a tiny search end to end.

Quantization here is ggml's own (``ggml-quants.c`` compiled from the sdist, tests/kquant_files.py):
an independent reference, so the swap test checks our packing and swapping, not our quantizer.
"""

from __future__ import annotations

import ctypes
import itertools

import gguf
import numpy as np
import pytest
from gguf_factory import T, write_tiny_llama
from kquant_files import ggml_quants_library

from llamatrace.errors import OptionError, OutputError
from llamatrace.model.llama import Llama
from llamatrace.quantize import search as S


def ggml_quantize_rows(ggml_type, x, imatrix=None):
    """ggml's ``quantize_<type>`` of float32 rows -> uint8 [n_rows, row_bytes]."""
    ggml_type = T(ggml_type)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x.shape
    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    out = np.empty((n, k // block * size), np.uint8)
    fn = getattr(ggml_quants_library(), f"quantize_{ggml_type.name.lower().replace('_k', '_K')}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    im = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    assert fn(x.ctypes.data, out.ctypes.data, n, k, None if im is None else im.ctypes.data) == out.nbytes
    return out


def brute_force(costs, losses, budget):
    """The least total loss of one option per group within ``budget`` (None: nothing fits)."""
    best = None
    for pick in itertools.product(*(range(len(c)) for c in costs)):
        if sum(c[k] for c, k in zip(costs, pick)) <= budget:
            loss = sum(l[k] for l, k in zip(losses, pick))
            best = loss if best is None else min(best, loss)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_allocate_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n_groups = int(rng.integers(1, 6))
    costs = [sorted(int(c) for c in rng.integers(1, 60, int(rng.integers(1, 5)))) for _ in range(n_groups)]
    losses = [list(rng.random(len(c))) for c in costs]
    budget = int(rng.integers(sum(min(c) for c in costs), sum(max(c) for c in costs) + 2))
    pick = S.allocate(costs, losses, budget)            # costs below the resolution: unit 1, exact
    assert sum(c[k] for c, k in zip(costs, pick)) <= budget
    assert sum(l[k] for l, k in zip(losses, pick)) == pytest.approx(brute_force(costs, losses, budget))


@pytest.mark.parametrize("seed", range(40))
def test_allocate_coarse_units_never_exceed_the_budget(seed):
    rng = np.random.default_rng(100 + seed)
    costs = [[int(c) for c in rng.integers(1000, 100000, 4)] for _ in range(6)]
    losses = [list(rng.random(4)) for _ in costs]
    budget = int(rng.integers(sum(min(c) for c in costs), sum(max(c) for c in costs)))
    pick = S.allocate(costs, losses, budget, resolution=16)   # units of ~ thousands of bytes
    assert sum(c[k] for c, k in zip(costs, pick)) <= budget
    # rounding can only cost optimality, never feasibility; with fine units it is the optimum
    fine = S.allocate(costs, losses, budget, resolution=1 << 20)
    assert sum(l[k] for l, k in zip(losses, fine)) == pytest.approx(brute_force(costs, losses, budget))
    assert sum(l[k] for l, k in zip(losses, pick)) >= sum(l[k] for l, k in zip(losses, fine)) - 1e-12


def brute_force_in_units(costs, losses, budget, resolution):
    """The least total loss when, as :func:`S.allocate` documents, each option's cost above its
    group's cheapest is rounded up to units of ``ceil(min(spare, most that can be spent) / resolution)``."""
    spare = budget - sum(min(c) for c in costs)
    unit = max(1, -(-min(spare, sum(max(c) - min(c) for c in costs)) // resolution))
    rounded = [[-(-(x - min(c)) // unit) for x in c] for c in costs]
    return brute_force(rounded, losses, spare // unit)


@pytest.mark.parametrize("seed", range(30))
def test_allocate_with_a_budget_beyond_what_can_be_spent_equals_brute_force(seed):
    """Budgets from tight to far above the dearest options, fine and coarse units: the bounded
    table chooses what the rounded problem's brute force does."""
    rng = np.random.default_rng(200 + seed)
    costs = [sorted(int(c) for c in rng.integers(1, 5000, int(rng.integers(1, 4)))) for _ in range(int(rng.integers(1, 6)))]
    losses = [list(rng.random(len(c))) for c in costs]
    least, most = sum(min(c) for c in costs), sum(max(c) for c in costs)
    budget = int(rng.choice([rng.integers(least, most + 1), most + int(rng.integers(0, 10**5))]))
    for resolution in (7, 1 << 16):
        pick = S.allocate(costs, losses, budget, resolution=resolution)
        assert sum(c[k] for c, k in zip(costs, pick)) <= budget
        assert sum(l[k] for l, k in zip(losses, pick)) == pytest.approx(
            brute_force_in_units(costs, losses, budget, resolution))


def test_allocate_table_is_bounded_by_what_can_be_spent():
    """A budget far above what the options can spend (one candidate type, --target-bpw 8) takes
    a table the size of what they can spend, not of the budget: measured by tracemalloc, which
    sees NumPy's buffers (before: ~10^7 entries, 2.3 GB and 36 s for 50 groups of one option)."""
    import tracemalloc
    cases = [([[1000, 2000]] * 3, [[1.0, 0.5]] * 3, 10**7, [1, 1, 1]),
             ([[1000]] * 50, [[0.0]] * 50, 10**7, [0] * 50),
             ([[1000, 1500, 3000]] * 200, [[3.0, 2.0, 1.0]] * 200, 10**9, [2] * 200)]
    for costs, losses, budget, expected in cases:
        tracemalloc.start()
        try:
            pick = S.allocate(costs, losses, budget)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert pick == expected
        # at most resolution + groups + 1 entries: a float64 table or two and an int32 choice per group
        n_entries = (1 << 16) + len(costs) + 1
        assert peak < 8 * n_entries * (len(costs) + 4), (len(costs), peak)


def test_allocate_refuses_a_budget_below_the_cheapest():
    with pytest.raises(ValueError, match="over the budget"):
        S.allocate([[5, 9], [4]], [[1.0, 0.0], [0.0]], 8)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A tiny F16 llama (2 layers, dim 64, untied output) and its loaded model."""
    path = write_tiny_llama(tmp_path_factory.mktemp("search") / "tiny-f16.gguf", qtype=T.F16, tied=False)
    return path


def _calibration(model, n_chunks=2, n_ctx=32, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, model.config.vocab_size, n_ctx) for _ in range(n_chunks)]
    first = n_ctx // 2
    return S.Calibration(ids, [np.asarray(i[first + 1:], np.int64) for i in ids], first)


def test_budget_counts_bits_per_weight_as_llama_quantize(tiny_base):
    with Llama.load(tiny_base) as model:
        groups = S.make_groups(model.file, model.config.n_layers, [T.Q4_0, T.Q8_0])
        budget = S.make_budget(model.file, groups, target_bpw=6.0)
        # independent count: gguf-py's reader over every tensor of the file
        reader = gguf.GGUFReader(str(tiny_base))
        n_elements = sum(int(t.n_elements) for t in reader.tensors)
        norms = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 1)
        assert budget.n_elements == n_elements and budget.fixed == norms
        assert budget.limit == int(6.0 * n_elements / 8)
        with pytest.raises(OptionError, match="below the smallest file"):
            S.make_budget(model.file, groups, target_bpw=3.0)
        size = budget.limit - 100                       # the smaller of the two limits wins
        assert S.make_budget(model.file, groups, target_bpw=6.0, target_size=size).limit == size


def _write_mix(base, dest, types):
    """The base with each matrix of ``types`` quantized by ggml (gguf-py's writer): an
    independent file of the recipe."""
    reader = gguf.GGUFReader(str(base))
    writer = gguf.GGUFWriter(str(dest), arch=reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        writer.add_key_value(key, f.contents(), vtype, sub_type=f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if t.name in types:
            writer.add_tensor(t.name, ggml_quantize_rows(types[t.name], x), raw_dtype=types[t.name])
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_in_memory_swap_equals_the_file(tiny_base, tmp_path):
    """Every group swapped in memory gives the logits of the file quantized with the same types."""
    types = [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_1, T.Q5_0]
    with Llama.load(tiny_base) as model:
        cal = _calibration(model)
        measurer = S.Measurer(model, cal, ggml_quantize_rows)
        groups = S.make_groups(model.file, model.config.n_layers, types)
        mix = {g.tensor: types[i % len(types)] for i, g in enumerate(groups)}
        for g in groups:
            measurer.swap(g, measurer.pack(g, mix[g.tensor], measurer.quantized(g, mix[g.tensor])))
        swapped = [measurer._scored_logits(measurer._final_residual(c, 0)) for c in range(2)]
    _write_mix(tiny_base, tmp_path / "mix.gguf", mix)
    with Llama.load(tmp_path / "mix.gguf") as quantized:
        assert {name: quantized.file.tensors[name].tensor_type for name in mix} == mix
        for c, ids in enumerate(cal.ids):
            # the search's path: the last layer's output, then the output projection of the scored rows
            final = {}
            with quantized.hooks({"l_out": lambda a, e: final.__setitem__(0, a)}, layers=[1]):
                quantized.forward(ids, 0, quantized.new_cache(len(ids)))
            np.testing.assert_array_equal(swapped[c], quantized.logits(final[0][cal.first:len(ids) - 1]))


def test_resumed_forward_equals_the_full_one(tiny_base):
    with Llama.load(tiny_base) as model:
        ids = np.arange(20) % model.config.vocab_size
        seen = {}
        with model.hooks({"l_out": lambda a, e: seen.__setitem__(e.layer, a.copy())}):
            full = model.forward(ids, 0, model.new_cache(20), all_logits=True)
        resumed = model.forward(ids, 0, model.new_cache(20), all_logits=True, start_layer=1, residual=seen[0])
        np.testing.assert_array_equal(full, resumed)
        only_output = model.forward(ids, 0, model.new_cache(20), all_logits=True, start_layer=2, residual=seen[1])
        np.testing.assert_array_equal(full, only_output)
        with pytest.raises(OptionError, match="start_layer"):
            model.forward(ids, 0, model.new_cache(20), start_layer=1)


def test_tiny_search_end_to_end(tiny_base, tmp_path):
    """Measure every candidate, allocate at 6 bpw, then check the recipe against its own measurement."""
    cands = [T.Q4_0, T.Q5_0, T.Q8_0]
    with Llama.load(tiny_base) as model:
        cal = _calibration(model)
        groups = S.make_groups(model.file, model.config.n_layers, cands)
        store = S.Measurements.open(tmp_path / "m.json", {"t": 1})
        S.measure_groups(S.Setup(cal, ggml_quantize_rows, "all"), groups, store, model=model)
        measurer = S.Measurer(model, cal, ggml_quantize_rows)
        assert store.base_kld == measurer.base_kld
        # Q8_0 costs the least KLD of the three in every group; Q4_0 the most
        for g in groups:
            d = store.delta[g.name]
            assert d["Q8_0"] < d["Q5_0"] < d["Q4_0"], (g.name, d)
        budget = S.make_budget(model.file, groups, target_bpw=6.0)
        recipe = S.choose(groups, store, budget, store.base_kld, "all")
        assert recipe.total_bytes <= budget.limit
        assert len({c.ggml_type for c in recipe.choices}) > 1          # a real mix at this budget
        # the prediction against the measured KLD of all the recipe's swaps at once
        for c in recipe.choices:
            measurer.swap(c.group, measurer.pack(c.group, c.ggml_type, measurer.quantized(c.group, c.ggml_type)))
        measured = measurer._kld()
    assert recipe.predicted_kld == pytest.approx(measured, rel=0.5)
    assert S.Measurements.open(tmp_path / "m.json", {"t": 1}).delta == store.delta      # resumable
    with pytest.raises(OutputError, match="made with another t: give --measurements another path"):
        S.Measurements.open(tmp_path / "m.json", {"t": 2})              # other options: kept, not replaced


def test_search_resumes_and_its_tensor_type_args_name_every_choice(tiny_base, tmp_path):
    """search() end to end on text; its --tensor-type patterns, read as llama-quantize reads them
    (the first pattern found in the name wins), give every tensor the recipe's type."""
    import re
    text = "the keeper of the north light walked along the shore and counted the ships. " * 40
    with Llama.load(tiny_base) as model:
        kwargs = dict(target_bpw=6.0, candidates=[T.Q4_0, T.Q5_1, T.Q8_0], quantize=ggml_quantize_rows,
                      n_ctx=32, n_chunks=2, mode="probe", measurements=tmp_path / "m.json")
        done = []
        recipe, store = S.search(model, text, progress=lambda d, n: done.append(d), **kwargs)
        assert done == list(range(17)) and len(recipe.choices) == 16
        again, _ = S.search(model, text, progress=lambda d, n: done.append(-d), **kwargs)
        assert done[17:] == [-16] and again.types == recipe.types          # resumed: nothing measured twice
        names = list(model.file.tensors)
    assert recipe.total_bytes <= recipe.budget.limit
    patterns = [(re.compile(a.split("=")[0].lower()), T[a.split("=")[1].upper()]) for a in recipe.tensor_type_args()]
    for name in names:
        hit = next((t for p, t in patterns if p.search(name)), None)
        assert hit == recipe.types.get(name), name


CORPUS = __import__("pathlib").Path(__file__).parent / "golden" / "corpus.txt"


def test_cli_writes_the_recipe_and_reports_it(tiny_base, tmp_path, capsys):
    import json

    from cli_helpers import run
    out = tmp_path / "out.gguf"
    code, stdout, _ = run(capsys, "quantize", tiny_base, out, "--target-bpw", "6", "-f", CORPUS, "--ctx-size", 32,
                          "--chunks", 2, "--candidates", "Q4_0,Q5_0,Q8_0", "--verify-file", CORPUS, "--json")
    assert code == 0
    doc = json.loads(stdout)
    recipe = doc["recipe"]
    reader = gguf.GGUFReader(str(out))
    written = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {g["group"] + ".weight": g["type"] for g in recipe["groups"]}.items() <= written.items()
    data = sum(int(t.n_bytes) for t in reader.tensors)
    assert data == recipe["bytes"] and 8 * data / sum(int(t.n_elements) for t in reader.tensors) <= 6.0
    assert doc["measured"]["recipe on calibration"]["mean_kld"] > 0
    assert doc["measured"]["recipe on held-out"]["count"] > 0
    assert (tmp_path / "out.gguf.measurements.json").is_file()


@pytest.mark.parametrize("args, needle", [
    (["--target-bpw", "6"], "-f TEXT"),
    (["-f", CORPUS], "--target-bpw"),
    (["--verify-file", CORPUS, "--type", "Q8_0"], "-f TEXT"),
    (["-f", CORPUS, "--target-bpw", "6", "--verify-file", "no-such.txt"], "--verify-file 'no-such.txt'"),
    (["-f", CORPUS, "--target-bpw", "6", "--candidates", "Q4_Z"], "Q4_Z"),
    (["-f", CORPUS, "--target-bpw", "2", "--ctx-size", "32", "--candidates", "Q4_0"], "below the smallest file"),
    (["-f", CORPUS, "--target-bpw", "6", "--workers", "0"], "--workers"),
    (["--type", "Q8_0", "--workers", "2"], "-f TEXT"),
    (["--type", "Q8_0", "-o", "recipe.png"], "-o belongs to the recipe search"),     # was ignored, exit 0
    (["--type", "Q8_0", "--activations", "q8"], "--activations belongs to the recipe search"),
    (["-f", CORPUS, "--target-bpw", "6", "--activations", "f16"], "--activations"),
    (["--type", "Q8_0", "--measurements", "m.json", "--ctx-size", "64"], "--measurements, --ctx-size belong"),
    (["-f", CORPUS, "--target-bpw", "40", "--ctx-size", "32", "--candidates", "Q4_0,Q8_0"],
     "holds the largest file the candidates allow"),                               # measured for minutes
])
def test_cli_bad_input_is_one_error_line(tiny_base, tmp_path, capsys, args, needle):
    from cli_helpers import assert_one_line_error, run
    out = tmp_path / "out.gguf"
    assert_one_line_error(*run(capsys, "quantize", tiny_base, out, *args), needle)
    assert not out.exists()


def test_cli_search_measures_in_the_activations_mode_given(tiny_base, tmp_path, capsys):
    """--activations q8: the KL divergences in llama.cpp's arithmetic, as perplexity's option (the
    search had none and always ran f32, though its measurements' key named --activations)."""
    import json

    from cli_helpers import run
    from llamatrace.kernels.int8 import act8
    if not act8.available():
        pytest.skip("q8 needs AVX2")
    measured = {}
    for mode in ("f32", "q8"):
        out = tmp_path / f"{mode}.gguf"
        code, stdout, err = run(capsys, "quantize", tiny_base, out, "--target-bpw", "6", "-f", CORPUS, "--ctx-size",
                                32, "--chunks", 2, "--candidates", "Q4_0,Q8_0", "--activations", mode, "--json")
        assert code == 0, err
        kept = json.loads((tmp_path / f"{mode}.gguf.measurements.json").read_text())
        assert kept["key"]["activations"] == mode
        measured[mode] = kept["delta"]
    assert measured["f32"].keys() == measured["q8"].keys() and measured["f32"] != measured["q8"]   # other numbers


def test_cli_type_without_target_is_the_stock_mix_size(tiny_base, tmp_path, capsys):
    """-f with --type and no --target-*: the budget is the size of that stock mix, written beside it."""
    import json

    from cli_helpers import run
    stock = tmp_path / "stock.gguf"
    assert run(capsys, "quantize", tiny_base, stock, "--type", "Q4_K_M")[0] == 0
    stock_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(stock)).tensors)
    code, stdout, _ = run(capsys, "quantize", tiny_base, tmp_path / "out.gguf", "--type", "Q4_K_M", "-f", CORPUS,
                          "--ctx-size", 32, "--chunks", 2, "--candidates", "Q4_0,Q5_0,Q8_0", "--json")
    assert code == 0
    doc = json.loads(stdout)
    assert doc["recipe"]["budget_bytes"] == stock_bytes >= doc["recipe"]["bytes"]
    assert doc["stock"]["bytes"] == stock_bytes
