"""The q8 mode's ``mul_mat_id`` kernels on the file's blocks (llamatrace.kernels.int8.mul_mat_id_q8):
against float64 sums over gguf-py's dequantized weights times the activations as act8 quantizes
them (``mul_mat_id_ref``), with awkward shapes and groupings, and against the packed q8 kernels
where both quantize the activations the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from ggml_cpu_quants import ggml_cpu_matmul
from gguf_factory import random_blocks

from llamatrace.kernels.int8 import act8, mul_mat_id_q8
from llamatrace.kernels.mul_mat_id import FileExperts, mul_mat_id, mul_mat_id_ref
from llamatrace.kernels.types import packing, registry
from llamatrace.machine.jit import has_vnni

T = gguf.GGMLQuantizationType
KINDS = [T.Q4_K, T.Q6_K, T.MXFP4, T.Q8_0]
N_IN = 768                      # 3 K-quant blocks, 24 blocks of 32
N_EXPERT = 5


def _raw(ggml_type, n_rows: int, seed: int) -> np.ndarray:
    """uint8 [n_rows, row_bytes]: realistic blocks (K-quants: random codes and scales, fp16 ``d``
    for weights of ~0.02; MXFP4 and Q8_0: gguf-py's quantizer, MXFP4 with the E8M0 edges 0, 1, 200)."""
    if ggml_type in (T.Q4_K, T.Q6_K):
        return random_blocks(ggml_type, n_rows, N_IN // 256, seed=seed, std=0.02)
    w = np.random.default_rng(seed).standard_normal((n_rows, N_IN)).astype(np.float32) * np.float32(0.02)
    raw = gguf.quants.quantize(w, ggml_type)
    if ggml_type == T.MXFP4:
        blocks = raw.reshape(n_rows, -1, 17)
        blocks[0, 0, 0], blocks[1, 1, 0], blocks[2, 2, 0] = 0, 1, 200
    return raw


def _parts(ggml_type, n_outs, n_expert=N_EXPERT, seed=0) -> tuple[FileExperts, ...]:
    parts = []
    for p, n_out in enumerate(n_outs):
        raw = _raw(ggml_type, n_expert * n_out, seed + p).reshape(n_expert, n_out, -1)
        raw.flags.writeable = False                             # as a map of the file
        parts.append(FileExperts(f"part{p}", ggml_type, n_out, N_IN, raw))
    return tuple(parts)


def _x(n_rows: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n_rows, N_IN)).astype(np.float32)
    x[0, :256] = 0.0                                            # an all-zero block
    x[-1, 256:300] *= 1000.0                                    # a block with a large range
    return x


def _bound(x, parts, ids, rows, ggml_type) -> np.ndarray:
    """float64 [n_slots, n_out]: sum of |products| (the scale a float32 sum's rounding is relative to)."""
    xs = np.abs(mul_mat_id_q8.activations_ref(x, ggml_type))
    w = [np.abs(np.concatenate([p.expert(int(e)) for p in parts]).astype(np.float64)) for e in ids]
    return np.stack([w[i] @ xs[rows[i]] for i in range(len(ids))]) if len(ids) else np.zeros((0, 1))


CASES = {
    # name: (n_outs, n_rows of x, ids, rows)
    "prefill gate|up": ((37, 21), 4, [3, 3, 0, 3, 3, 3, 3, 1, 4, 3, 0, 3], [0, 1, 1, 2, 3, 0, 1, 2, 3, 3, 2, 0]),
    "decode gate|up": ((37, 21), 1, [4, 0, 2], [0, 0, 0]),
    "down, slot i row i": ((50,), 6, [2, 2, 4, 0, 2, 2], None),
    "one expert": ((17,), 9, [0] * 9, None),
    "empty ids": ((37, 21), 3, [], []),
    # more rows of x than one thread quantizes (mul_mat_id_q8.SERIAL_ROWS): quantized in parallel
    "prefill, 20 rows": ((37,), 20, list(np.random.default_rng(5).integers(0, N_EXPERT, 40)),
                         list(np.random.default_rng(6).integers(0, 20, 40))),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ggml_type", KINDS, ids=lambda t: t.name)
def test_mul_mat_id_is_float64_sums_over_gguf_weights_and_q8_activations(ggml_type, case):
    n_outs, n_rows, ids, rows = CASES[case]
    n_expert = 1 if case == "one expert" else N_EXPERT
    parts = _parts(ggml_type, n_outs, n_expert)
    x = _x(n_rows)
    ids = np.array(ids, dtype=np.int64)
    rows = None if rows is None else np.array(rows, dtype=np.int64)
    got = mul_mat_id(x, parts, ids, rows, activations="q8")
    want = mul_mat_id_ref(x, parts, ids, rows, activations="q8")
    assert got.shape == want.shape == (len(ids), sum(n_outs)) and got.dtype == np.float32
    bound = _bound(x, parts, ids, np.arange(len(ids)) if rows is None else rows, ggml_type)
    assert np.all(np.abs(got - want) <= 1e-6 * bound + 1e-30)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("ggml_type", [T.MXFP4, T.Q8_0], ids=lambda t: t.name)
def test_an_odd_count_of_32_weight_blocks_and_a_lone_row(ggml_type):
    # 25 blocks a row: the kernels' blocks go two at a time (two FMA chains), then the last one
    n_in, n_out = 800, 9
    raw = gguf.quants.quantize(np.random.default_rng(3).standard_normal((2 * n_out, n_in)).astype(np.float32)
                               * np.float32(0.02), ggml_type).reshape(2, n_out, -1)
    parts = (FileExperts("w", ggml_type, n_out, n_in, raw),)
    x = np.random.default_rng(4).standard_normal((5, n_in)).astype(np.float32)
    ids = np.array([1, 1, 0, 1, 1], dtype=np.int64)
    got = mul_mat_id(x, parts, ids, activations="q8")
    want = mul_mat_id_ref(x, parts, ids, activations="q8")
    xs = np.abs(mul_mat_id_q8.activations_ref(x, ggml_type))
    bound = np.stack([np.abs(parts[0].expert(int(e)).astype(np.float64)) @ xs[i] for i, e in enumerate(ids)])
    assert np.all(np.abs(got - want) <= 1e-6 * bound)


@pytest.mark.parametrize("ggml_type", KINDS, ids=lambda t: t.name)
def test_mul_mat_id_is_llamacpps_own_x86_code(ggml_type):
    # ggml-cpu's quantize_row_q8_K / _q8_0 and ggml_vec_dot_*_q8_* (AVX2) compiled from the sdist:
    # the same integer sums, another float32 order (their per-block steps, their lane sums)
    parts = _parts(ggml_type, (21,), n_expert=3)
    x = _x(4)
    ids = np.array([2, 0, 2, 2], dtype=np.int64)
    got = mul_mat_id(x, parts, ids, activations="q8")
    want = np.stack([ggml_cpu_matmul(ggml_type.name, parts[0].data[e], x[i:i + 1])[0] for i, e in enumerate(ids)])
    bound = _bound(x, parts, ids, np.arange(4), ggml_type)
    assert np.all(np.abs(got - want) <= 2e-6 * bound + 1e-30)


@pytest.mark.parametrize("ggml_type", KINDS, ids=lambda t: t.name)
def test_types_are_declared_and_activations_ref_is_act8s_quantizers(ggml_type):
    assert ggml_type in mul_mat_id_q8.TYPES
    x = _x(3)
    got = mul_mat_id_q8.activations_ref(x, ggml_type)
    if ggml_type in (T.Q4_K, T.Q6_K):              # Q8_K, as llama.cpp's vec dot type for K-quants
        xq, xd, _ = act8.quantize_k(x)             # the Numba quantizer the kernels run
        twin_q, twin_d, _ = act8.quantize_k_np(x)
        per = 256
    else:                                          # Q8_0
        xq, xd, _ = act8.quantize(x, act8.Q8_0)
        twin_q, twin_d, _ = act8.quantize_np(x, act8.Q8_0)
        per = 32
    np.testing.assert_array_equal(xq, twin_q)
    np.testing.assert_array_equal(xd, twin_d)
    want = (xq.reshape(3, -1, per).astype(np.float64) * xd[:, :, None].astype(np.float64)).reshape(3, N_IN)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float64


@pytest.mark.parametrize("n_rows", [1, 6])
@pytest.mark.parametrize("ggml_type", [T.Q6_K, T.MXFP4, T.Q8_0], ids=lambda t: t.name)
def test_one_expert_is_the_packed_q8_kernels_where_activations_are_quantized_alike(ggml_type, n_rows):
    # Q6_K takes Q8_K, MXFP4 and Q8_0 take Q8_0 in both paths: the same integer sums, another
    # float32 order (a vector of 8 lanes per row here, a lane per row there). Q4_K's packed path
    # takes per-32 float32 activation scales, not Q8_K: not comparable to this precision.
    parts = _parts(ggml_type, (45,), n_expert=2)
    x = _x(n_rows)
    w = packing.pack("w", ggml_type, parts[0].data[1], 45, N_IN, activations="q8")
    packed = registry.matmul(x, w)
    got = mul_mat_id(x, parts, np.ones(n_rows, dtype=np.int64), activations="q8")
    bound = _bound(x, parts, np.ones(n_rows, dtype=np.int64), np.arange(n_rows), ggml_type)
    assert np.all(np.abs(got - packed) <= 2e-6 * bound + 1e-30)


def test_unknown_type_and_parts_that_do_not_fit_are_refused():
    x = _x(1)
    with pytest.raises(ValueError, match="no kernel for Q5_K"):
        mul_mat_id_q8.activations_ref(x, T.Q5_K)
    data = np.zeros((2, 4, N_IN // 256 * 144), np.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        mul_mat_id_q8.matmul_id(x[:, :512], np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([0, 1]),
                                np.zeros(1, np.int64), [data], T.Q4_K)


_AVX2_RUN = """
import sys
import numpy as np
from llamatrace.kernels.int8 import mul_mat_id_q8
from llamatrace.machine.jit import has_vnni
assert not has_vnni()
saved = np.load(sys.argv[1])
outs = {name: mul_mat_id_q8.matmul_id(saved["x"], saved["rows"], saved["order"], saved["starts"], saved["experts"],
                                      (saved[name],), int(name.split("_", 1)[1])) for name in saved if name[0] == "w"}
np.savez(sys.argv[2], **outs)
"""


@pytest.mark.skipif(not has_vnni(), reason="this host runs the AVX2 kernels already")
def test_the_vnni_kernels_give_the_avx2_kernels_bits(tmp_path):
    # VNNI's vpdpbusd sums what pmaddubsw + pmaddwd sum (exact int32 either way), and the float32
    # steps are the same; MXFP4 goes 16 rows a zmm with AVX-512. LLAMATRACE_VNNI=0 with a fresh
    # Numba cache compiles the AVX2 kernels in a subprocess, on this host
    x = _x(6)
    rows, order = np.array([0, 1, 2, 3, 4, 5, 5], np.int64), np.array([0, 3, 1, 2, 4, 6, 5], np.int64)
    starts, experts = np.array([0, 2, 7], np.int64), np.array([1, 4], np.int64)
    saved = {"x": x, "rows": rows, "order": order, "starts": starts, "experts": experts}
    for t in KINDS:
        saved[f"w_{int(t)}"] = _raw(t, N_EXPERT * 37, int(t)).reshape(N_EXPERT, 37, -1)
    np.savez(tmp_path / "in.npz", **saved)
    env = dict(os.environ, LLAMATRACE_VNNI="0", NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=str(Path(mul_mat_id_q8.__file__).parents[3]))
    subprocess.run([sys.executable, "-c", _AVX2_RUN, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], env=env,
                   check=True)
    avx2 = np.load(tmp_path / "out.npz")
    for t in KINDS:
        got = mul_mat_id_q8.matmul_id(x, rows, order, starts, experts, (saved[f"w_{int(t)}"],), t)
        np.testing.assert_array_equal(got.view(np.uint32), avx2[f"w_{int(t)}"].view(np.uint32), err_msg=t.name)
