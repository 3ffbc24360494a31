"""`llamatrace compare` on mixtures of experts: the per-expert stages ``[seq_len, k, …]`` are paired by
expert id, not by rank, so two near-tied experts that swap rank are no divergence; a token routed to
other experts is left out of them and counted, and ``ffn_moe_topk`` is scored as ids (a review found a
swap reported as a 49 % error and the first divergence)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cli_helpers import run

from llamatrace.analysis import compare as cmp

SEQ, N_EXPERT, K, FF, DIM = 6, 8, 3, 5, 4
PER_SLOT = ("ffn_moe_weights", "ffn_moe_gate", "ffn_moe_up", "ffn_moe_swiglu", "ffn_moe_down", "ffn_moe_weighted")


def _tables(seed: int = 0) -> dict[str, np.ndarray]:
    """What each (token, expert) pair computes, whichever slot it lands in: gate and up float32
    ``[SEQ, N_EXPERT, FF]``, down ``[SEQ, N_EXPERT, DIM]``, and the router's probabilities ``[SEQ, N_EXPERT]``
    with token 4's two best experts (1 and 6) near-tied and every k-th clear of the (k+1)-th."""
    rng = np.random.default_rng(seed)
    probs = np.tile(np.array([0.05, 0.30, 0.02, 0.12, 0.04, 0.03, 0.29, 0.15], np.float32), (SEQ, 1))
    probs = np.stack([rng.permutation(p) if t != 4 else p for t, p in enumerate(probs)])
    return {"probs": probs, "gate": rng.standard_normal((SEQ, N_EXPERT, FF)).astype(np.float32),
            "up": rng.standard_normal((SEQ, N_EXPERT, FF)).astype(np.float32),
            "down": rng.standard_normal((SEQ, N_EXPERT, DIM)).astype(np.float32)}


def _recording(t: dict[str, np.ndarray], ids: np.ndarray | None = None, *, layer: int = 0,
               topk: bool = True) -> dict[str, np.ndarray]:
    """One MoE layer as ``trace --npz`` keys it, built from the tables ``t`` (:func:`_tables`): the
    experts ``ids`` int32 ``[SEQ, K]`` in slot order (default: the top K of the probabilities) and every
    per-expert stage ``[SEQ, K, …]`` in that order. ``topk=False``: no ``ffn_moe_topk``, as llama.cpp's
    graph is read (its ids are int32, not captured)."""
    probs = t["probs"]
    if ids is None:
        ids = np.argsort(-probs, axis=1, kind="stable")[:, :K]
    ids = np.asarray(ids, dtype=np.int32)
    rows = np.arange(SEQ)[:, None]
    weights = np.take_along_axis(probs, ids, axis=1)                                  # [SEQ, K]
    gate, up, down = t["gate"][rows, ids], t["up"][rows, ids], t["down"][rows, ids]     # [SEQ, K, …]
    swiglu = gate / (1 + np.exp(-gate)) * up
    weighted = down * weights[:, :, None]
    stages = {"ffn_moe_probs": probs, "ffn_moe_topk": ids, "ffn_moe_weights": weights, "ffn_moe_gate": gate,
              "ffn_moe_up": up, "ffn_moe_swiglu": swiglu.astype(np.float32), "ffn_moe_down": down,
              "ffn_moe_weighted": weighted, "ffn_moe_out": weighted.sum(axis=1)}
    if not topk:
        del stages["ffn_moe_topk"]
    return {f"step0.layer{layer}.{stage}": a for stage, a in stages.items()}


def _swapped(ids: np.ndarray, token: int, i: int = 0, j: int = 1) -> np.ndarray:
    out = ids.copy()
    out[token, [i, j]] = out[token, [j, i]]
    return out


def _rows(result) -> dict[str, cmp.Row]:
    return {r.stage: r for r in result.rows if r.layer == 0}


def test_two_experts_that_swap_rank_are_paired_by_id_and_do_not_diverge():
    t = _tables()
    ours = _recording(t)
    ids = ours["step0.layer0.ffn_moe_topk"]
    assert list(ids[4, :2]) == [1, 6]                           # the near tie
    ref = _recording(t, _swapped(ids, 4))
    # slot by slot, token 4's first two slots hold other experts: what was reported as the first divergence
    assert cmp.metrics(ours["step0.layer0.ffn_moe_down"], ref["step0.layer0.ffn_moe_down"])[0] > 0.25
    result = cmp.compare_arrays(ours, ref, profile="same-f32")
    assert result.first_divergence is None, result.first_divergence
    rows = _rows(result)
    for stage in PER_SLOT:
        r = rows[stage]
        assert r.status == "ok" and r.rel_rms_err == 0 and r.max_abs_err == 0, r
        assert r.routing == {"tokens": SEQ, "experts_differ": 0, "experts_differ_at": [], "order_differs": 1}
    topk = rows["ffn_moe_topk"]
    assert topk.status == "ok" and topk.rel_rms_err is None and topk.cosine is None
    assert topk.routing["order_differs"] == 1 and topk.routing["experts_differ"] == 0
    assert rows["ffn_moe_out"].routing is None and rows["ffn_moe_out"].rel_rms_err < 1e-6    # summed, as before


def test_a_token_routed_to_other_experts_is_a_routing_divergence_and_left_out_of_the_slots():
    t = _tables()
    ours = _recording(t)
    ids = ours["step0.layer0.ffn_moe_topk"]
    other = ids.copy()
    other[2, 2] = next(e for e in np.argsort(-t["probs"][2], kind="stable") if e not in ids[2])   # its 4th best
    ref = _recording(t, _swapped(other, 4))
    result = cmp.compare_arrays(ours, ref, profile="same-f32")
    rows = _rows(result)
    topk = rows["ffn_moe_topk"]
    assert topk.status == "routing differs" and topk.diverged
    assert topk.routing == {"tokens": SEQ, "experts_differ": 1, "experts_differ_at": [2], "order_differs": 1}
    first = result.first_divergence
    assert (first.step, first.layer, first.stage) == (0, 0, "ffn_moe_topk")
    for stage in PER_SLOT:                   # token 2 not compared; the rest, paired by id, agree exactly
        assert rows[stage].status == "ok" and rows[stage].rel_rms_err == 0, rows[stage]
        assert rows[stage].routing["experts_differ"] == 1
    assert rows["ffn_moe_out"].status == "diverged"            # the sum does differ at token 2: said so


def test_a_layer_where_no_token_chose_the_same_experts_has_nothing_to_compare():
    t = _tables()
    ours = _recording(t)
    ids = ours["step0.layer0.ffn_moe_topk"]
    ref = _recording(t, (ids + 1) % N_EXPERT)
    rows = _rows(cmp.compare_arrays(ours, ref))
    assert rows["ffn_moe_topk"].routing["experts_differ"] == SEQ
    for stage in PER_SLOT:
        r = rows[stage]
        assert r.status == "rerouted" and not r.diverged and r.rel_rms_err is None, r


def test_an_expert_that_computes_otherwise_diverges_where_it_is_paired_by_id():
    t = _tables()
    ours = _recording(t)
    bad = {k: v.copy() for k, v in t.items()}
    bad["down"][1, ours["step0.layer0.ffn_moe_topk"][1, 0]] *= 1.5   # token 1's best expert, its down projection
    ids = ours["step0.layer0.ffn_moe_topk"]
    ref = _recording(bad, _swapped(_swapped(ids, 4), 1, 0, 2))      # and token 1's experts in another order
    result = cmp.compare_arrays(ours, ref, profile="same-f32")
    rows = _rows(result)
    first = result.first_divergence
    assert (first.layer, first.stage) == (0, "ffn_moe_down") and first.rel_rms_err > 0.1
    assert all(rows[s].status == "ok" and rows[s].rel_rms_err == 0 for s in ("ffn_moe_gate", "ffn_moe_swiglu"))
    assert rows["ffn_moe_topk"].status == "ok" and rows["ffn_moe_topk"].routing["order_differs"] == 2


def test_llamacpps_ids_are_the_top_k_of_its_probabilities_when_its_weights_confirm_them():
    t = _tables()
    ours = _recording(t)
    theirs = {k: v.copy() for k, v in t.items()}
    theirs["probs"][4, [1, 6]] = theirs["probs"][4, [6, 1]]        # its near tie went the other way
    ref = _recording(theirs, topk=False)
    assert "step0.layer0.ffn_moe_topk" not in ref
    ids, derived = cmp.route_ids(ref, 0, 0)
    assert derived and list(ids[4, :2]) == [6, 1]
    result = cmp.compare_arrays(ours, ref)                          # llama.cpp's profile
    assert result.first_divergence is None, result.first_divergence
    rows = _rows(result)
    assert rows["ffn_moe_topk"].status == "ok" and rows["ffn_moe_topk"].routing["derived"] == ["reference"]
    assert rows["ffn_moe_down"].rel_rms_err == 0 and rows["ffn_moe_gate"].routing["order_differs"] == 1
    # weights that are not the gathered probabilities: the ids cannot be trusted, slots compared as recorded
    ref["step0.layer0.ffn_moe_weights"] = ref["step0.layer0.ffn_moe_weights"] * np.float32(1.001)
    assert cmp.route_ids(ref, 0, 0) == (None, False)
    rows = _rows(cmp.compare_arrays(ours, ref))
    assert rows["ffn_moe_topk"].status == "only ours" and rows["ffn_moe_down"].routing is None
    assert rows["ffn_moe_down"].status == "diverged"


def _npz(tmp_path, name, arrays):
    np.savez(tmp_path / name, **arrays)
    return str(tmp_path / name)


def test_cli_reports_routing_apart_from_numeric_divergence(capsys, tmp_path):
    t = _tables()
    ours = _recording(t)
    ids = ours["step0.layer0.ffn_moe_topk"]
    a = _npz(tmp_path, "a.npz", ours)
    code, out, err = run(capsys, "compare", a, _npz(tmp_path, "swap.npz", _recording(t, _swapped(ids, 4))),
                         "--stage", "ffn_moe*", "--sort", "worst")
    assert code == 0, err
    assert "ok, 1/6 reordered" in out and "no divergence" in out
    assert "6 (token, layer) pairs, 1 with the same experts in another order, 0 with other experts" in out
    other = ids.copy()
    other[2, 2] = next(e for e in np.argsort(-t["probs"][2], kind="stable") if e not in ids[2])
    b = _npz(tmp_path, "other.npz", _recording(t, other))
    code, out, err = run(capsys, "compare", a, b, "--stage", "ffn_moe_topk,ffn_moe_down")
    assert code == 3, err
    assert "routing differs at 1/6 ← first" in out and "ok, 1/6 rerouted" in out
    assert "first divergence: step 0, layer 0, ffn_moe_topk (other experts chosen at 1 of 6 tokens: 2)" in out
    code, out, err = run(capsys, "compare", a, b, "--json")
    report = json.loads(out)
    assert report["first_divergence"]["routing"]["experts_differ_at"] == [2]
    rows = {r["stage"]: r for r in report["rows"]}
    assert rows["ffn_moe_down"]["status"] == "ok" and rows["ffn_moe_down"]["routing"]["experts_differ"] == 1
    assert "routing" not in rows["ffn_moe_out"] and "routing" not in rows["ffn_moe_probs"]
    code, out, err = run(capsys, "compare", a, _npz(tmp_path, "all.npz", _recording(t, (ids + 1) % N_EXPERT)),
                         "--stage", "ffn_moe_gate", "--json")
    assert code == 0 and json.loads(out)["rows"][0]["status"] == "rerouted", out   # gate alone: nothing diverged
    bad = {k: v.copy() for k, v in t.items()}
    bad["gate"] *= 2
    code, out, err = run(capsys, "compare", a, _npz(tmp_path, "bad.npz", _recording(bad, other)),
                         "--stage", "ffn_moe_gate")
    assert code == 3 and "rerouted at" not in out
    assert "ffn_moe_gate (rel rms err 0.5 > 0.25, thresholds of llama.cpp; over the 5 of 6 tokens routed alike)" in out


def test_cli_help_says_how_experts_are_paired(capsys):
    code, out, _ = run(capsys, "compare", "--help")
    assert code == 0 and "paired by expert id" in " ".join(out.split())


def test_dense_rows_carry_no_routing():
    x = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    result = cmp.compare_arrays({"step0.layer0.ffn_up": x}, {"step0.layer0.ffn_up": x * 1.5})
    (row,) = result.rows
    assert row.status == "diverged" and row.routing is None and "routing" not in row.to_json()


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    from moe_files import write_moe_file

    from llamatrace.model.llama import Llama
    return Llama.load(write_moe_file(tmp_path_factory.mktemp("moe") / "tiny-qwen3moe.gguf", "qwen3moe"))


def _traced(model, hooks=None) -> dict[str, np.ndarray]:
    ids = np.arange(3, 9)
    with model.hooks(hooks or {}, layers=[1]):
        with model.trace(keep_arrays=True) as rec:
            model.forward(ids, 0, model.new_cache(8))
    return rec.arrays()


def test_a_real_model_whose_experts_run_in_another_order_agrees_with_itself(qwen3moe):
    """The forward pass itself, its experts' slots reversed at layer 1 (a hook on ffn_moe_topk: every
    per-expert stage follows the new order): the same numbers, paired by id; ffn_moe_out differs only by
    the order of its sum."""
    plain = _traced(qwen3moe)
    reversed_ = _traced(qwen3moe, {"ffn_moe_topk": lambda a, ev: a[:, ::-1].copy()})
    assert not np.array_equal(plain["step0.layer1.ffn_moe_down"], reversed_["step0.layer1.ffn_moe_down"])
    result = cmp.compare_arrays(reversed_, plain, profile="same-f32")
    assert result.first_divergence is None, result.first_divergence
    rows = {r.stage: r for r in result.rows if r.layer == 1}
    assert rows["ffn_moe_topk"].routing["order_differs"] == 6 and rows["ffn_moe_down"].rel_rms_err < 1e-6
    # another expert for one token: the routing divergence, where it is
    k = qwen3moe.config.n_expert_used

    def other(a, ev):
        out = a.copy()
        out[3, k - 1] = next(e for e in range(qwen3moe.config.n_expert) if e not in a[3])
        return out
    first = cmp.compare_arrays(_traced(qwen3moe, {"ffn_moe_topk": other}), plain, profile="same-f32").first_divergence
    assert (first.layer, first.stage, first.status) == (1, "ffn_moe_topk", "routing differs")
    assert first.routing["experts_differ_at"] == [3]


def test_llamacpps_graph_gives_its_experts_through_its_probabilities(qwen3moe):
    """llama.cpp's own graph tensors on the same file (tests/golden/moe_llamacpp_dump.npz, one prefill of 4
    and a decode step): its ids, taken from its ffn_moe_probs and confirmed by its ffn_moe_weights, are
    ours at every layer, and every per-expert stage pairs by them."""
    steps: dict[int, list] = {}
    with np.load(Path(__file__).parent / "golden" / "moe_llamacpp_dump.npz") as z:
        ids = z["qwen3moe.ids"]
        for key in sorted(k for k in z.files if k.startswith("qwen3moe.step")):
            _, step, _, rest = key.split(".", 3)
            tensor, op = rest.rsplit(".", 1)
            steps.setdefault(int(step[4:]), []).append(SimpleNamespace(name=tensor, op=op, array=z[key]))
    ref = {}
    for step, captured in steps.items():
        ref.update(cmp.llamacpp_stage_arrays(captured, step, *((0, 4) if step == 0 else (4, 1)), qwen3moe.config))
    cache = qwen3moe.new_cache(8)
    with qwen3moe.trace(keep_arrays=True) as rec:
        qwen3moe.forward(ids[:4], 0, cache)
        qwen3moe.forward(ids[4:], 4, cache)
    result = cmp.compare_arrays(rec.arrays(), ref)
    assert result.first_divergence is None, result.first_divergence
    topk = [r for r in result.rows if r.stage == "ffn_moe_topk"]
    assert len(topk) == 2 * qwen3moe.config.n_layers
    assert all(r.status == "ok" and r.routing["derived"] == ["reference"] and not r.routing["experts_differ"]
               for r in topk), topk
    assert all(r.routing is not None and r.rel_rms_err < 1e-5 for r in result.rows if r.stage in PER_SLOT)
