"""The ``f32`` mode's ``mul_mat_id`` kernels (llamatrace.kernels.types.mul_mat_id_f32) on the
file's own blocks: against float64 sums over gguf-py's dequantized weights (mul_mat_id_ref), with
awkward groupings of slots, and against today's packed float32 kernels on the same experts."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from numba import njit
from gguf_factory import random_blocks

from llamatrace.kernels.mul_mat_id import FileExperts, mul_mat_id, mul_mat_id_ref, supported
from llamatrace.kernels.types import mul_mat_id_f32, packing
from llamatrace.kernels.types.registry import matmul

T = gguf.GGMLQuantizationType
TYPES = (T.Q4_K, T.Q6_K, T.MXFP4, T.Q8_0)
N_EXPERT = 5
N_IN = {T.Q4_K: 512, T.Q6_K: 512, T.MXFP4: 96, T.Q8_0: 96}


def _raw(qtype: T, n_out: int, n_in: int, seed: int, std: float | None = 0.02) -> np.ndarray:
    """uint8 [N_EXPERT, n_out, row_bytes]: K-quants as random valid blocks (gguf-py cannot
    quantize them; ``std`` None: any fp16 scale, subnormals and +-65504 included), MXFP4 and Q8_0
    as gguf-py's quantization of random weights, MXFP4 with the E8M0 edges (0, 1: denormal
    scales; 200) and random codes in one row."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = N_EXPERT * n_out
    if qtype in (T.Q4_K, T.Q6_K):
        raw = random_blocks(qtype, rows, n_in // block, seed, std=std)
    else:
        rng = np.random.default_rng(seed)
        raw = gguf.quants.quantize((rng.standard_normal((rows, n_in)) * 0.02).astype(np.float32), qtype)
        if qtype == T.MXFP4:
            blocks = raw.reshape(rows, -1, nbytes)
            blocks[3, :, 1:] = rng.integers(0, 256, (blocks.shape[1], 16), dtype=np.uint8)
            blocks[0, 0, 0], blocks[1, 0, 0], blocks[2, 1, 0] = 0, 1, 200
    raw = np.ascontiguousarray(raw.reshape(N_EXPERT, n_out, n_in // block * nbytes))
    raw.flags.writeable = False                   # as the file's map
    return raw


def _experts(qtype: T, n_out: int, seed: int = 0, name: str = "ffn_gate_exps", std: float | None = 0.02):
    n_in = N_IN[qtype]
    return FileExperts(name, qtype, n_out, n_in, _raw(qtype, n_out, n_in, seed, std))


def _x(n_rows: int, n_in: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n_rows, n_in)).astype(np.float32)
    x[0, :32] = 0.0                               # an all-zero block
    x[-1, 32:40] *= 1000.0                        # a block with a large range
    return x


def _assert_close(got, x, parts, ids, rows):
    """got within float32 rounding of the float64 reference: |got - ref| <= 1e-6 * sum |x||w|."""
    want = mul_mat_id_ref(x, parts, ids, rows)
    w = np.abs(np.concatenate([np.stack([p.expert(e) for e in range(p.n_expert)]) for p in parts], axis=1))
    r = np.arange(len(ids)) if rows is None else np.asarray(rows)
    bound = np.einsum("si,soi->so", np.abs(x[r]).astype(np.float64), w[np.asarray(ids)].astype(np.float64))
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.isfinite(got))
    np.testing.assert_array_less(np.abs(got.astype(np.float64) - want), 1e-6 * bound + 1e-30)


# ids, rows (None: slot i takes row i) -> the awkward groupings
CASES = {
    "decode gate|up: k slots, one row": ([3, 0, 4, 1], [0, 0, 0, 0]),
    "one expert": ([2], None),
    "repeated ids": ([1, 1, 3, 1, 3], None),
    "many slots of one expert (7)": ([4, 2, 4, 4, 0, 4, 4, 4, 2, 4], None),
    "13 slots of one expert": ([1] * 6 + [3] + [1] * 7 + [0, 3], None),
    "a full pass (16 slots)": ([2] * 16 + [0], None),
    "more slots than a pass takes (19: 10 then 9)": ([4] * 12 + [1] + [4] * 7 + [3], None),
    "rows != slots": ([0, 2, 2, 1, 0, 2], [1, 0, 2, 2, 1, 0]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("qtype", TYPES)
def test_each_type_is_float64_sums_over_gguf_weights(qtype, case):
    ids, rows = (np.array(v, dtype=np.int64) if v is not None else None for v in CASES[case])
    parts = (_experts(qtype, 70),)                            # 70: not a multiple of the 32-row tiles
    x = _x(int(rows.max()) + 1 if rows is not None else len(ids), N_IN[qtype])
    _assert_close(mul_mat_id(x, parts, ids, rows), x, parts, ids, rows)


@pytest.mark.parametrize("qtype", TYPES)
def test_two_parts_side_by_side(qtype):
    parts = (_experts(qtype, 40, seed=2), _experts(qtype, 33, seed=3, name="ffn_up_exps"))
    ids = np.array([4, 1, 4, 0, 4, 4, 4, 1, 2], dtype=np.int64)
    x = _x(3, N_IN[qtype])
    rows = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2], dtype=np.int64)
    got = mul_mat_id(x, parts, ids, rows)
    assert got.shape == (9, 73)
    _assert_close(got, x, parts, ids, rows)


@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q6_K))
def test_k_quants_any_fp16_scales(qtype):
    """Subnormal, zero and +-65504 super-block scales (random fp16 bits)."""
    parts = (_experts(qtype, 37, seed=5, std=None),)
    ids = np.array([0, 3, 3, 1, 3, 4, 3, 3, 2], dtype=np.int64)
    x = _x(len(ids), N_IN[qtype])
    _assert_close(mul_mat_id(x, parts, ids), x, parts, ids, None)


def test_no_slots_and_the_declared_types():
    parts = (_experts(T.Q4_K, 8),)
    got = mul_mat_id(np.zeros((0, 512), np.float32), parts, np.zeros(0, np.int64))
    assert got.shape == (0, 8) and got.dtype == np.float32
    assert mul_mat_id_f32.TYPES == frozenset(TYPES)
    assert all(supported(t, "f32") for t in TYPES) and not supported(T.Q5_K, "f32")


@pytest.mark.parametrize("qtype", TYPES)
def test_as_close_to_the_packed_float32_kernels_as_to_the_reference(qtype):
    """Against the registry's float32 matmul on each expert packed as today's loader packs it:
    both are float32 sums of the same dequantized weights, so they differ by rounding only."""
    parts = (_experts(qtype, 70, seed=7),)
    ids = np.array([2, 0, 2, 2, 4], dtype=np.int64)
    x = _x(len(ids), N_IN[qtype])
    got = mul_mat_id(x, parts, ids)
    p = parts[0]
    packed = np.stack([matmul(x[i:i + 1], packing.pack("e", qtype, p.data[e], p.n_out, p.n_in))[0]
                       for i, e in enumerate(ids)])
    bound = np.abs(x).astype(np.float64)[:, None, :] * np.abs(np.stack([p.expert(e) for e in ids]))
    np.testing.assert_array_less(np.abs(got.astype(np.float64) - packed), 2e-6 * bound.sum(-1) + 1e-30)


# several slots: a tile's rows dequantized into a scratch, then a register-blocked product

@pytest.mark.parametrize("qtype", TYPES)
def test_dequantized_rows_are_gguf_weights_bit_for_bit(qtype):
    """_deq (blocks 1 .. 3 of a row, at an offset of the scratch) against its twin deq_np over
    gguf.quants.dequantize; K-quants with any fp16 scales."""
    p = _experts(qtype, 6, seed=11, std=None if qtype in (T.Q4_K, T.Q6_K) else 0.02)
    kind = mul_mat_id_f32.KIND[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blk = p.n_in // block - 1
    w = np.full(16 + n_blk * block, np.nan, np.float32)
    row = 4 * p.n_out + 5                                     # expert 4, row 5
    mul_mat_id_f32._deq(kind, p.data, row * p.data.shape[2], 1, n_blk, w, 16)
    want = mul_mat_id_f32.deq_np(p.data[4, 5, nbytes:], qtype)
    np.testing.assert_array_equal(w[16:].view(np.uint32), want.view(np.uint32))
    assert np.isnan(w[:16]).all()                             # nothing written before w_at


@pytest.mark.parametrize(("rows", "slots"), mul_mat_id_f32.GEMM_PAIRS)
def test_gemm_microkernel_against_its_twin(rows, slots):
    """_gemm on strided rows of w and x, added to a strided acc that already holds sums: each
    (rows, slots) the multi-slot tiles call it with."""
    rng = np.random.default_rng(rows * 10 + slots)
    n_vec, ldw, ldx, lda = 5, 48, 56, (slots + 1) * 8
    w = rng.standard_normal(rows * ldw + 8).astype(np.float32)
    x = rng.standard_normal(slots * ldx + 16).astype(np.float32)
    acc = rng.standard_normal(rows * lda + 8).astype(np.float32)
    want = acc.copy()
    mul_mat_id_f32._gemm(rows, slots, w, 8, ldw, x, 16, ldx, n_vec, acc, 8, lda)
    wv = np.stack([w[8 + r * ldw:8 + r * ldw + 8 * n_vec] for r in range(rows)])
    xv = np.stack([x[16 + s * ldx:16 + s * ldx + 8 * n_vec] for s in range(slots)])
    sums = np.zeros((rows, slots, 8), np.float32)
    mul_mat_id_f32.gemm_np(wv, xv, sums)
    view = want[8:8 + rows * lda].reshape(rows, lda)[:, :slots * 8].reshape(rows, slots, 8)
    view += sums
    bound = np.abs(wv).astype(np.float64)[:, None, :] * np.abs(xv).astype(np.float64)[None, :, :]
    bound = bound.reshape(rows, slots, n_vec, 8).sum(axis=2)
    got = acc[8:8 + rows * lda].reshape(rows, lda)[:, :slots * 8].reshape(rows, slots, 8)
    np.testing.assert_array_less(np.abs(got.astype(np.float64) - view), 1e-6 * bound + 1e-6)
    untouched = np.ones_like(acc, bool)
    untouched[8:8 + rows * lda].reshape(rows, lda)[:, :slots * 8] = False
    np.testing.assert_array_equal(acc[untouched], want[untouched])


@pytest.mark.parametrize("qtype", TYPES)
def test_several_slots_over_chunks_that_do_not_divide_the_row(qtype):
    """9 slots of one expert on long rows: the inputs in chunks (the last one shorter), 33 rows
    (the last tile a single row, left over from the 2-row microkernel)."""
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    n_in = 3 * block if qtype in (T.Q4_K, T.Q6_K) else 45 * block
    n_chunk = mul_mat_id_f32.X_CHUNK // (9 * block)
    assert 0 < n_chunk < n_in // block and (n_in // block) % n_chunk
    p = FileExperts("ffn_down_exps", qtype, 33, n_in, _raw(qtype, 33, n_in, seed=13))
    ids = np.array([3] * 9 + [1, 1, 0], dtype=np.int64)
    x = _x(len(ids), n_in)
    _assert_close(mul_mat_id(x, (p,), ids), x, (p,), ids, None)


@pytest.mark.parametrize("qtype", (T.Q4_K, T.MXFP4))
def test_every_plan_of_slots_and_the_rows_a_tile_has_left(qtype):
    """2 to 14 slots of one expert, each of gemm_plan's call shapes (4 x 2, 3 x 3 and 3 x 4 calls,
    2 x 5, 2 x 6), on 37 rows: tiles of 32 and 5, whose last 2 rows are left over from 3-row calls."""
    for n in range(2, 15):
        n_call, base, extra, rows = mul_mat_id_f32.gemm_plan.py_func(n)
        assert n_call * base + extra == n and extra < n_call
        assert all((m, ns) in mul_mat_id_f32.GEMM_PAIRS
                   for m in range(1, rows + 1) for ns in {base, base + bool(extra)})
    parts = (_experts(qtype, 37, seed=21),)
    for n in range(2, 15):                                   # one group of n slots a call
        ids = np.full(n, n % N_EXPERT, dtype=np.int64)
        x = _x(n, N_IN[qtype], seed=n)
        _assert_close(mul_mat_id(x, parts, ids), x, parts, ids, None)


def test_slots_wide_plan_takes_every_slot_in_passes_of_at_most_eight():
    for n in range(1, 41):
        passes, left = [], n
        while left:
            passes.append(mul_mat_id_f32.slots_wide_plan.py_func(left))
            left -= passes[-1]
        assert all(1 <= m <= mul_mat_id_f32.SLOTS_WIDE for m in passes)
        assert len(passes) == -(-n // mul_mat_id_f32.SLOTS_WIDE)      # no pass more than needed


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9, 15, 16, 21])
@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q6_K))
def test_k_quant_slots_over_passes_of_slots_and_of_inputs(qtype, n):
    """n slots of one Q4_K or Q6_K expert: on zmm their own kernel (:func:`mul_mat_id_f32._slots_wide`:
    every slot count up to 8, 9..15 in two passes, then 8 at a time), elsewhere the dequantizing
    path; 7 blocks of inputs (8 slots take 3 a pass: 3, 3, 1) and 35 rows (2 at a time, 1 left)."""
    n_in = 7 * 256
    assert 7 % (mul_mat_id_f32.X_CHUNK // (8 * 256)) == 1
    p = FileExperts("ffn_up_exps", qtype, 35, n_in, _raw(qtype, 35, n_in, seed=31))
    ids = np.array([2] * n + [0], dtype=np.int64)
    x = _x(len(ids), n_in, seed=n)
    _assert_close(mul_mat_id(x, (p,), ids), x, (p,), ids, None)


@njit
def _totals8(acc, at, stride, out, out_at):
    mul_mat_id_f32._totals8(acc, at, stride, out, out_at)


@njit
def _total(acc, at):
    return mul_mat_id_f32._total(acc, at)


def test_totals8_are_each_vectors_lane_sum_bit_for_bit():
    """_totals8 (8 strided vectors of sums -> 8 floats at an offset of out) against its twin
    totals8_np and against _total vector by vector, bit for bit; nothing else of out written."""
    rng = np.random.default_rng(17)
    acc = (rng.standard_normal(8 * 24 + 8) * np.exp(rng.uniform(-20, 20, 8 * 24 + 8))).astype(np.float32)
    acc[40:48] = [1e30, -1e30, 1.0, 3e-8, -2.0, 5e7, 1e-45, -1e-45]     # cancellation, subnormals
    out = np.full(20, np.nan, np.float32)
    _totals8(acc, 8, 24, out, 5)
    vecs = np.stack([acc[8 + 24 * j:16 + 24 * j] for j in range(8)])
    want = mul_mat_id_f32.totals8_np(vecs)
    np.testing.assert_array_equal(out[5:13].view(np.uint32), want.view(np.uint32))
    one = np.array([_total(acc, 8 + 24 * j) for j in range(8)], np.float32)
    np.testing.assert_array_equal(one.view(np.uint32), want.view(np.uint32))
    assert np.isnan(out[:5]).all() and np.isnan(out[13:]).all()


# MXFP4's codes to float32 through the bytes of their bfloat16s (no int -> float conversion)

def test_mxfp4_byte_tables_are_the_kvalues_float32_bits():
    """Bytes 3 and 2 of MXFP4_BYTES' entries, over zero low bytes, are gguf-py's kvalues as
    float32 bit for bit (+0 for both zero codes), and MXFP4_ORDER is a permutation of a block."""
    byte2, byte3 = (np.array(t, dtype=np.uint32) for t in mul_mat_id_f32.MXFP4_BYTES)
    bits = byte3 << 24 | byte2 << 16
    np.testing.assert_array_equal(bits.view(np.float32), np.array(gguf.quants.MXFP4.kvalues, dtype=np.float32))
    assert not (bits & 0x80000000)[[0, 8]].any()
    assert sorted(mul_mat_id_f32.MXFP4_ORDER) == list(range(32))
    assert mul_mat_id_f32.x_order(T.MXFP4) is mul_mat_id_f32.MXFP4_ORDER


@pytest.mark.parametrize("ids", ([3, 0, 4, 1], [2, 2, 2, 4, 2]), ids=("decode", "several slots"))
def test_mxfp4_x_over_six_decades(ids):
    """x spread over six decades (signs mixed, an all-zero block), the E8M0 edges (0, 1, 200)
    and random codes (code 8, the second zero, among them): float64 sums over gguf's weights,
    float32 rounding apart."""
    rng = np.random.default_rng(17)
    ids = np.array(ids, dtype=np.int64)
    parts = (_experts(T.MXFP4, 45, seed=19),)
    x = (rng.standard_normal((2, 96)) * 10.0 ** rng.uniform(-3, 3, (2, 96))).astype(np.float32)
    x[1, 64:] = 0.0
    rows = np.arange(len(ids)) % 2
    _assert_close(mul_mat_id(x, parts, ids, rows), x, parts, ids, rows)


@pytest.mark.parametrize("qtype", TYPES)
def test_slots_sharing_a_row_of_x_as_slots_with_their_own_copy(qtype):
    """A decode step's k slots read one row of x (its gate|up): the driver makes that row's
    layout once and copies it to the other slots. The same bits as k rows of their own, one
    slot of an expert (one-slot kernel) or several (dequantized product) alike."""
    parts = (_experts(qtype, 40, seed=23),)
    x = _x(2, N_IN[qtype])
    for ids in ([3, 0, 4, 1], [2, 2, 0, 2, 4]):
        ids = np.array(ids, dtype=np.int64)
        rows = np.array([1] * (len(ids) - 1) + [0], dtype=np.int64)
        shared = mul_mat_id(x, parts, ids, rows)
        own = mul_mat_id(np.ascontiguousarray(x[rows]), parts, ids)
        np.testing.assert_array_equal(shared, own)
        _assert_close(shared, x, parts, ids, rows)


def test_read_only_parts_are_passed_as_they_are(monkeypatch):
    """The file's maps (read-only) reach the kernel as the same arrays, not a view made a call
    (~8 µs of Numba's typing each); a writeable array is viewed read-only, itself unchanged."""
    parts = (_experts(T.Q4_K, 8),)
    seen = []
    real = mul_mat_id_f32._matmul_id

    def spy(*args):
        seen.append(args[6:8])
        return real(*args)

    monkeypatch.setattr(mul_mat_id_f32, "_matmul_id", spy)
    x, ids = _x(1, 512), np.array([1, 3], dtype=np.int64)
    got = mul_mat_id(x, parts, ids, np.zeros(2, np.int64))
    assert seen[0][0] is parts[0].data
    writeable = parts[0].data.copy()
    again = mul_mat_id(x, (FileExperts("ffn_gate_exps", T.Q4_K, 8, 512, writeable),), ids, np.zeros(2, np.int64))
    assert seen[1][0] is not writeable and not seen[1][0].flags.writeable and writeable.flags.writeable
    np.testing.assert_array_equal(got, again)
