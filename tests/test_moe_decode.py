"""A decode step's chosen experts in one parallel region (llamatrace.kernels.int8.experts).

The drivers are held to their NumPy twin and, bit for bit, to the registry's ``q8`` decode
kernels expert by expert (the same microkernels on the same quantized activations); the MXFP4
microkernel to llama.cpp's own ``quantize_row_q8_0`` + ``ggml_vec_dot_mxfp4_q8_0`` (compiled from
the sdist). On the tiny gpt-oss file with MXFP4 experts, a decode step takes two calls a layer and
gives the logits of the expert-by-expert path; ``test_gptoss.py`` holds those to llama.cpp's.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from ggml_cpu_quants import ggml_cpu_mxfp4_matmul
from gptoss_files import N_LAYERS, T, write_gptoss_file

from llamatrace.kernels.int8.experts import Experts
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import TYPES, matmul
from llamatrace.model.llama import Llama

N_OUT = 70                                   # a padded last tile
N_IN = {T.Q4_K: 512, T.Q6_K: 512, T.MXFP4: 160}
N_EXPERT = 5


def _experts(ggml_type, seed: int = 0) -> tuple[list[packing.Weight], list[np.ndarray]]:
    """N_EXPERT random experts quantized by the type's quantizer and packed for q8, alternately in
    an arena of small chunks and on their own; expert 0 is the one in the middle of memory, so
    the others' arrays lie before and after its own, and one expert's ``m`` is a copy elsewhere
    (a Q4_K expert's ``d`` and ``m`` are not the same distance from expert 0's)."""
    rng = np.random.default_rng(seed)
    arena = packing.Arena(1 << 16)
    ws, raws = [], []
    for e in range(N_EXPERT):
        raw = TYPES[ggml_type].quantize(rng.standard_normal((N_OUT, N_IN[ggml_type])).astype(np.float32))
        ws.append(packing.pack(f"e{e}", ggml_type, raw, N_OUT, N_IN[ggml_type], activations="q8",
                               arena=arena if e % 2 else None))
        raws.append(raw)
    ws[3] = dataclasses.replace(ws[3], m=ws[3].m.copy())
    order = sorted(range(N_EXPERT), key=lambda e: ws[e].qs.__array_interface__["data"][0])
    order = order[2:3] + order[:2] + order[3:]
    return [ws[e] for e in order], [raws[e] for e in order]


def _rows(n: int, n_in: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, n_in)).astype(np.float32)
    x[0, :32] = 0.0                          # an all-zero block
    x[-1, 32:40] *= 1000.0                   # a block with a large range
    return x


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.MXFP4])
@pytest.mark.parametrize("n_rows", [1, 3])
def test_experts_match_their_twin_and_the_registry_kernels_bit_for_bit(ggml_type, n_rows):
    ws, _ = _experts(ggml_type)
    table = Experts.of(ws)
    assert table is not None and (table.off[:, 0] < 0).any() and (table.off[:, 0] > 0).any()
    if ggml_type == T.Q4_K:
        assert (table.off[:, 1] != table.off[:, 2]).any()
    ids = np.array([4, 0, 2])
    x = _rows(n_rows, N_IN[ggml_type])
    got = table.matmul(x, ids)
    twin = table.matmul_np(x, ids)
    assert np.abs(got - twin).max() <= 1e-5 * np.abs(twin).max()
    one_by_one = np.concatenate([matmul(x[s if n_rows > 1 else 0][None], ws[e]) for s, e in enumerate(ids)])
    np.testing.assert_array_equal(got, one_by_one)


def test_mxfp4_microkernel_is_llamacpps_arithmetic():
    ws, raws = _experts(T.MXFP4, seed=5)
    x = _rows(2, N_IN[T.MXFP4], seed=6)
    got = Experts.of(ws).matmul(x, np.array([3, 1]))
    for s, e in enumerate((3, 1)):
        ggml = ggml_cpu_mxfp4_matmul(raws[e], x[s:s + 1])[0]
        bound = np.abs(x[s]).astype(np.float64) @ np.abs(gguf.quants.dequantize(raws[e], T.MXFP4)).astype(np.float64).T
        assert np.all(np.abs(got[s] - ggml) <= 1e-6 * bound + 1e-30)


def test_experts_it_does_not_serve_are_left_to_the_registry():
    ws, _ = _experts(T.Q4_K)
    f32 = [packing.pack("e", T.Q8_0, TYPES[T.Q8_0].quantize(np.ones((N_OUT, 64), np.float32)), N_OUT, 64,
                        activations="q8")]
    assert Experts.of(f32) is None                            # Q8_0: not one of its types
    raw = TYPES[T.Q4_K].quantize(np.ones((N_OUT, 512), np.float32))
    assert Experts.of([packing.pack("e", T.Q4_K, raw, N_OUT, 512)]) is None     # packed for f32
    assert Experts.of(ws[:2] + [packing.pack("e", T.Q4_K, raw[:32], 32, 512, activations="q8")]) is None
    with pytest.raises(ValueError, match="ids must be in"):
        Experts.of(ws).matmul(_rows(1, 512), np.array([N_EXPERT]))
    with pytest.raises(ValueError, match="expected"):
        Experts.of(ws).matmul(_rows(2, 512), np.array([0, 1, 2]))


def test_a_decode_step_runs_each_layers_experts_in_two_calls_with_the_same_logits(tmp_path, monkeypatch):
    model = Llama.load(write_gptoss_file(tmp_path / "tiny-gpt-oss-mxfp4.gguf", experts=T.MXFP4),
                       activations="q8", cache=False)
    ids = [5, 17, 3, 9, 11, 2]

    def steps() -> list[np.ndarray]:
        cache = model.new_cache(len(ids))
        return [model.forward([t], i, cache)[0] for i, t in enumerate(ids)]

    calls = []
    real = Experts.matmul
    monkeypatch.setattr(Experts, "matmul", lambda self, x, e: calls.append(len(e)) or real(self, x, e))
    fused = steps()
    assert calls == [model.config.n_expert_used] * (2 * N_LAYERS * len(ids))
    for lw in model.weights.layers:              # the expert-by-expert path
        lw.moe.__dict__["decode_experts"] = None
    calls.clear()
    for got, want in zip(fused, steps()):
        np.testing.assert_array_equal(got, want)
    assert not calls
