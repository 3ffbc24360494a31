"""The float32 kernels that read Q4_K and Q6_K quants as float32 subnormals (their int32 bits, no
conversion: :func:`llamatrace.kernels.tiles.subnormal_exp`) under a caller's DAZ: a library built
with ``-ffast-math`` sets MXCSR's DAZ ("denormals are zero") when it is loaded, and then every
subnormal input reads as zero. The kernels clear DAZ while they run (:func:`llamatrace.kernels.tiles.daz_off`)
and put the caller's MXCSR back."""

from __future__ import annotations

import gguf
import numba
import numpy as np
import pytest
from gguf_factory import random_blocks
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from llamatrace.kernels import mul_mat_id as mmid
from llamatrace.kernels import tiles
from llamatrace.kernels.types import k_quants, mul_mat_id_f32, packing

T = gguf.GGMLQuantizationType
DAZ = 0x40
FLAGS = 0x3F                                     # MXCSR's sticky exception flags
N_OUT, N_IN, N_EXPERT = 40, 512, 4


def _mxcsr_fn(b, name):
    i8p = ir.IntType(8).as_pointer()
    return b.module.declare_intrinsic(name, (), ir.FunctionType(ir.VoidType(), [i8p]))


@intrinsic
def _stmxcsr(typingctx):
    def codegen(context, b, signature, args):
        with b.goto_entry_block():
            slot = b.alloca(ir.IntType(32))
        b.call(_mxcsr_fn(b, "llvm.x86.sse.stmxcsr"), [b.bitcast(slot, ir.IntType(8).as_pointer())])
        return b.zext(b.load(slot), ir.IntType(64))
    return types.int64(), codegen


@intrinsic
def _ldmxcsr(typingctx, value):
    def codegen(context, b, signature, args):
        with b.goto_entry_block():
            slot = b.alloca(ir.IntType(32))
        b.store(b.trunc(args[0], ir.IntType(32)), slot)
        b.call(_mxcsr_fn(b, "llvm.x86.sse.ldmxcsr"), [b.bitcast(slot, ir.IntType(8).as_pointer())])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@njit
def get_mxcsr():
    return _stmxcsr()


@njit
def set_mxcsr(value):
    _ldmxcsr(value)


@njit
def _subnormal_sum(a, b):
    return a + b                                 # under DAZ, two subnormal inputs read as zeros


def _runs(qtype):
    """The packed GEMV and the experts' one-slot kernel of ``qtype``: name -> (call, float64 reference)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, N_OUT, N_IN // block, seed=3, std=0.05)
    w = packing.pack("w", qtype, raw, N_OUT, N_IN)
    W = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((1, N_IN)).astype(np.float32)
    if qtype == T.Q4_K:
        def gemv():
            out = np.empty((1, N_OUT), np.float32)
            k_quants.gemv_q4k(x, w.qs, w.d, w.m, out)
            return out
    else:
        def gemv():
            out = np.empty((1, N_OUT), np.float32)
            k_quants.gemv_q6k(x, w.qs, w.d, out)
            return out
    experts = random_blocks(qtype, N_EXPERT * N_OUT, N_IN // block, seed=5, std=0.05)
    E = gguf.quants.dequantize(experts, qtype).astype(np.float64).reshape(N_EXPERT, N_OUT, N_IN)
    experts = experts.reshape(N_EXPERT, N_OUT, -1)
    experts.flags.writeable = False
    xs = np.random.default_rng(6).standard_normal((3, N_IN)).astype(np.float32)
    ids = np.array([2, 0, 3], np.int64)          # one slot an expert: the one-slot kernel
    rows = np.arange(3, dtype=np.int64)

    def one_slot():
        order, starts, ex = mmid.groups(ids)
        return mul_mat_id_f32.matmul_id(xs, rows, order, starts, ex, [experts], qtype)

    return {"gemv": (gemv, x.astype(np.float64) @ W.T),
            "one slot": (one_slot, np.einsum("si,soi->so", xs.astype(np.float64), E[ids]))}


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_daz_in_the_calling_thread_changes_nothing_and_is_restored(qtype):
    runs = _runs(qtype)
    clean = {name: call() for name, (call, _) in runs.items()}
    threads = numba.get_num_threads()
    numba.set_num_threads(1)                     # the kernels run in this thread, its DAZ set
    before = get_mxcsr()
    try:
        set_mxcsr(before | DAZ)
        tiny = np.float32(1e-45)
        assert _subnormal_sum(tiny, tiny) == 0.0, "DAZ did not take effect in this thread"
        got = {name: call() for name, (call, _) in runs.items()}
        after = get_mxcsr()
    finally:
        set_mxcsr(before)
        numba.set_num_threads(threads)
    assert after & ~FLAGS == (before | DAZ) & ~FLAGS      # the caller's DAZ back
    assert get_mxcsr() & DAZ == before & DAZ
    for name, (_, ref) in runs.items():
        np.testing.assert_array_equal(got[name], clean[name], err_msg=name)
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=name)


def test_subnormal_exp_and_its_twin():
    x = np.array([[0.0, 3.0, -5.0, 1.0], [0.0, 0.0, 0.0, 0.0], [np.inf, np.nan, 1e-3, 0.0],
                  [3e38, 1.0, 0.0, 0.0], [1e-44, 0.0, 0.0, 0.0]], np.float32)
    for s in range(x.shape[0]):
        k = tiles.subnormal_exp(x, s)
        assert k == tiles.subnormal_exp_np(x[s])
        assert tiles.SUBNORMAL_K[0] <= k <= tiles.SUBNORMAL_K[1]
        finite = np.abs(x[s][np.isfinite(x[s])].astype(np.float64))
        if finite.max() < 2.0 ** 81:             # scaled x stays below 2**126: no overflow
            assert np.all(finite * 2.0 ** k < 2.0 ** 126)
    assert tiles.subnormal_exp(x, 0) == 126 - 3  # max |x| 5 < 2**3
    assert tiles.subnormal_exp(x, 1) == 126      # zeros
    assert tiles.subnormal_exp(x, 2) == 126 + 9  # inf and NaN ignored: 1e-3 < 2**-9
