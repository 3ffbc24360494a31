"""`perplexity --base … --stages` on a mixture of experts: the error per expert.

A random-weight qwen3moe base (F32, tests/moe_files.py) against its ``llamatrace quantize … Q4_0``.
The per-expert numbers are recomputed here from the two models' recorded stages: the local error
of ``ffn_moe_down`` with NumPy and ``gguf.quants.dequantize`` of the quantized file's experts on the
base's recorded SwiGLU rows and route, the accumulated one by matching each base (token, expert)
with the quantized model's row of the same expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from moe_files import SPECS, write_moe_file

from llamatrace.cli import main
from llamatrace.corpus.chunks import make_chunks, read_corpus
from llamatrace.corpus.perplexity import kl_divergence_stages
from llamatrace.corpus.stage_errors import PairSpec, same_expert, slot_stages, token_stages
from llamatrace.corpus.worker import ModelSpec
from llamatrace.model.llama import Llama

CORPUS = Path(__file__).parent / "golden" / "corpus.txt"
N_CTX, N_CHUNKS = 32, 2
SPEC = SPECS["qwen3moe"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-pair")
    base = write_moe_file(root / "base-f32.gguf", "qwen3moe")
    quant = root / "quant-q4_0.gguf"
    assert main(["quantize", str(base), str(quant), "--type", "Q4_0"]) == 0
    return base, quant


@pytest.fixture(scope="module")
def attribution(pair):
    base, quant = pair
    chunks = make_chunks(Llama.load(quant).tokenizer, read_corpus(CORPUS), N_CTX, N_CHUNKS, 64)
    _, errors = kl_divergence_stages(PairSpec(ModelSpec(str(base)), ModelSpec(str(quant))), chunks)
    return chunks, errors


def _recorded(model, ids, first):
    """The scored rows of the route, SwiGLU and down projection of every layer, from a trace."""
    with model.trace(stages=["ffn_moe_topk", "ffn_moe_swiglu", "ffn_moe_down"], keep_arrays=True) as rec:
        model.forward(ids, 0, model.new_cache(len(ids)))
    a = rec.arrays()
    n = len(ids)
    return [{s: np.asarray(a[f"step0.layer{i}.{s}"])[first:n - 1] for s in ("ffn_moe_topk", "ffn_moe_swiglu",
                                                                              "ffn_moe_down")}
            for i in range(SPEC["n_layers"])]


def _rel(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def test_the_moe_stages_are_columns_and_the_slot_stages_are_measured_per_expert(pair):
    features = Llama.load(pair[0]).config.features
    assert {"ffn_moe_logits", "ffn_moe_probs", "ffn_moe_topk", "ffn_moe_down", "ffn_moe_out"} <= set(token_stages(features))
    assert slot_stages(features) == ("ffn_moe_gate", "ffn_moe_up", "ffn_moe_swiglu", "ffn_moe_down", "ffn_moe_weighted")
    assert slot_stages(frozenset()) == ()


def test_same_expert_matches_by_expert_not_by_slot():
    slot, kept = same_expert(np.array([[3, 1], [0, 2]]), np.array([[1, 3], [2, 5]]))
    np.testing.assert_array_equal(slot, [[1, 0], [1, 0]])
    np.testing.assert_array_equal(kept, [[True, True], [True, False]])


def test_per_expert_errors_match_a_direct_recomputation(pair, attribution):
    base_path, quant_path = pair
    chunks, errors = attribution
    x = errors.experts
    n_expert, k = SPEC["n_expert"], SPEC["k"]
    base, quant = Llama.load(base_path), Llama.load(quant_path)
    reader = gguf.GGUFReader(str(quant_path))
    tensors = {t.name: t for t in reader.tensors}
    local = [[[] for _ in range(n_expert)] for _ in range(SPEC["n_layers"])]
    accumulated = [[[] for _ in range(n_expert)] for _ in range(SPEC["n_layers"])]
    rerouted = np.zeros((SPEC["n_layers"], n_expert), dtype=int)
    for c in range(chunks.n_chunk):
        ids = chunks.chunk(c)
        rec_b, rec_q = _recorded(base, ids, chunks.first), _recorded(quant, ids, chunks.first)
        for i in range(SPEC["n_layers"]):
            t = tensors[f"blk.{i}.ffn_down_exps.weight"]
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(n_expert, -1, SPEC["expert_ff"])
            route_b, route_q = rec_b[i]["ffn_moe_topk"], rec_q[i]["ffn_moe_topk"]
            for tok in range(len(route_b)):
                for s in range(k):
                    e = int(route_b[tok, s])
                    want = rec_b[i]["ffn_moe_down"][tok, s]
                    mine = w[e].astype(np.float64) @ rec_b[i]["ffn_moe_swiglu"][tok, s].astype(np.float64)
                    local[i][e].append(_rel(mine, want))
                    where = np.flatnonzero(route_q[tok] == e)
                    if len(where):
                        accumulated[i][e].append(_rel(rec_q[i]["ffn_moe_down"][tok, where[0]], want))
                    else:
                        rerouted[i, e] += 1
    down = x.stages.index("ffn_moe_down")
    count = np.array([[len(v) for v in layer] for layer in local])
    np.testing.assert_array_equal(x.count, count)
    np.testing.assert_array_equal(x.rerouted, rerouted)
    assert x.count.sum(axis=1).tolist() == [N_CHUNKS * chunks.n_scored * k] * SPEC["n_layers"]
    assert (count > 0).sum() > n_expert and rerouted.sum() > 0       # routes spread, and Q4_0 moves some
    for i in range(SPEC["n_layers"]):
        for e in range(n_expert):
            if count[i, e]:
                np.testing.assert_allclose(x.local_median[i, down, e], np.median(local[i][e]), rtol=2e-4)
                np.testing.assert_allclose(x.local_p95[i, down, e], np.percentile(local[i][e], 95), rtol=2e-4)
            else:
                assert np.isnan(x.local_median[i, down, e])
            if accumulated[i][e]:
                np.testing.assert_allclose(x.median[i, down, e], np.median(accumulated[i][e]), rtol=1e-4)
    assert 0.01 < np.nanmedian(x.local_median[:, down]) < 0.5        # Q4_0: a few per cent per expert


def test_stages_cli_json_and_printout_hold_the_experts(capsys, pair, attribution, tmp_path):
    base, quant = pair
    args = ["perplexity", "-f", str(CORPUS), "-c", str(N_CTX), "--chunks", str(N_CHUNKS), "--model", str(quant),
            "--base", str(base), "--stages"]
    assert main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["attribution"]
    x = attribution[1].experts
    assert "ffn_moe_down" in got["stages"] and "ffn_moe_topk" in got["stages"]
    e = got["experts"]
    assert e["stages"] == list(x.stages) and e["count"] == x.count.tolist() and e["rerouted"] == x.rerouted.tolist()
    down = x.stages.index("ffn_moe_down")
    np.testing.assert_allclose(np.array(e["local_median"], dtype=float)[:, down], x.local_median[:, down],
                               rtol=1e-5, atol=1e-6)
    assert np.array(e["median"], dtype=float).shape == (SPEC["n_layers"], len(x.stages), SPEC["n_expert"])
    picture = tmp_path / "experts.png"
    assert main([*args, "-o", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "Per expert: ffn_moe_down" in out and "route kept" in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worst_experts_fall_back_to_the_accumulated_error_where_no_local_one():
    """Experts with no local error (none of their rows was recomputed) are ranked by the accumulated error."""
    from llamatrace.corpus.stage_errors import ExpertErrors
    nan = np.nan
    x = ExpertErrors(("ffn_moe_down",), np.array([[3, 0, 2]]), np.array([[1, 0, 0]]),
                     np.full((1, 1, 3), nan), np.full((1, 1, 3), nan), np.array([[[0.2, nan, 0.5]]]))
    assert [(e, acc) for _, e, _, _, acc, _, _ in x.worst("ffn_moe_down")] == [(2, 0.5), (0, 0.2)]
    x.local_median[0, 0] = [0.3, nan, 0.1]
    assert [e for _, e, *_ in x.worst("ffn_moe_down")] == [0, 2]
    assert x.as_json()["local_median"] == [[[0.3, None, 0.1]]]
