"""K-quants and Q5_0/Q5_1 (llamatrace.kernels.types.k_quants, q5, through packing and the registry) against gguf-py.

gguf-py cannot quantize K-quants, so the tests write raw random blocks: random quant bytes,
scale bytes covering every 4-bit / 6-bit / int8 pattern, and fp16 ``d``/``dmin`` drawn from
the finite values including 0, -0, subnormals and +-65504. ``gguf.quants.dequantize`` of the
same bytes is the reference, compared bit for bit.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from gguf_factory import FP16_FIELDS, SPECIAL_F16, random_blocks, write_tiny_llama
from llamatrace.kernels.types import k_quants, packing, q5
from llamatrace.kernels.types.registry import FORMATS, matmul
from llamatrace.machine import jit
from llamatrace.model.llama import Llama
from reference import reference_logits

T = gguf.GGMLQuantizationType
TYPES = [*k_quants.KQUANT_TYPES, T.Q5_0, T.Q5_1]
N_OUT = 70                                     # not a multiple of the 32-row tile

def _scale_patterns(qtype, blocks: np.ndarray) -> set[int]:
    """The scale (and min) values present in ``blocks``, decoded with gguf-py's own helpers
    where it has them."""
    b = blocks.reshape(-1, FORMATS[qtype].file_bytes)
    if qtype in (T.Q4_K, T.Q5_K):
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        return set(np.unique(sc).tolist()) | {v + 64 for v in np.unique(mn).tolist()}
    if qtype == T.Q2_K:
        return set(np.unique(b[:, :16] & 15).tolist()) | {v + 16 for v in np.unique(b[:, :16] >> 4).tolist()}
    if qtype == T.Q6_K:
        return set(np.unique(b[:, 192:208]).tolist())
    if qtype == T.Q3_K:
        # scale i: low 4 bits of byte i % 8 (shifted by 4 for i >= 8), high 2 bits of byte 8 + i % 4
        i = np.arange(16)
        low = (b[:, 96 + i % 8] >> (4 * (i // 8))) & 15
        high = (b[:, 104 + i % 4] >> (2 * (i // 4))) & 3
        return set(np.unique(low | (high << 4)).tolist())
    return set()


EXPECTED_PATTERNS = {T.Q2_K: 32, T.Q3_K: 64, T.Q4_K: 128, T.Q5_K: 128, T.Q6_K: 256}


def _n_in(qtype) -> int:
    return 3 * FORMATS[qtype].weights


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def case(request):
    qtype = request.param
    n_in = _n_in(qtype)
    raw = random_blocks(qtype, N_OUT, n_in // FORMATS[qtype].weights, seed=int(qtype))
    return qtype, raw, packing.pack(f"w_{qtype.name}", qtype, raw, N_OUT, n_in)


def test_blocks_cover_every_scale_pattern(case):
    qtype, raw, _ = case
    if qtype in EXPECTED_PATTERNS:
        assert len(_scale_patterns(qtype, raw)) == EXPECTED_PATTERNS[qtype]
    fp16 = raw.reshape(-1, FORMATS[qtype].file_bytes)[:, FP16_FIELDS[qtype][0]:FP16_FIELDS[qtype][0] + 2]
    seen = set(np.ascontiguousarray(fp16).view(np.uint16).ravel().tolist())
    assert set(SPECIAL_F16.tolist()) <= seen


def test_numpy_dequantize_bit_exact(case):
    qtype, raw, w = case
    ref = gguf.quants.dequantize(raw, qtype)
    ours = packing.dequantize(w)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_numba_tile_dequantize_bit_exact(case):
    qtype, raw, w = case
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    m = w.m if FORMATS[qtype].has_min else w.d
    for t in range(w.n_tiles):
        if qtype in (T.Q5_0, T.Q5_1):
            tile = q5.dequant_tile(qtype == T.Q5_1, w.qs, w.d, m, t)       # [n_in, TR]
        else:
            tile = k_quants.dequant_tile(k_quants.KIND[qtype], w.qs, w.d, m, t)
        rows = min(packing.TR, N_OUT - t * packing.TR)
        got = np.ascontiguousarray(tile[:, :rows].T)
        np.testing.assert_array_equal(got.view(np.uint32), ref[t * packing.TR:t * packing.TR + rows].view(np.uint32))


@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8"])
def test_repack_kernel_equals_numpy_twin(case, q8):
    # rows 0..40 then 41..69 of one packed matrix: parts that start and end inside a tile;
    # q8: the bytes the 8-bit kernels read grouped (Q4_K and Q6_K have such kernels)
    qtype, raw, _ = case
    group = packing._group(qtype, "q8" if q8 else "f32")
    n_blocks = _n_in(qtype) // FORMATS[qtype].weights
    blocks = raw.reshape(N_OUT, n_blocks, FORMATS[qtype].file_bytes)
    shape = (-(-N_OUT // packing.TR), n_blocks)
    scales, table = (np.uint16, jit.F16_BITS) if q8 else (np.float32, jit.F16_TABLE)   # as the packer
    got = (np.zeros(shape + (FORMATS[qtype].packed_bytes, packing.TR), np.uint8),
           np.zeros(shape + (packing.TR,), scales), np.zeros(shape + (packing.TR,), scales))
    want = tuple(a.copy() for a in got)
    for lo, hi in ((0, 41), (41, N_OUT)):
        packing.repack_tiles(qtype, blocks[lo:hi], lo, table, *got, group)
        packing.repack_tiles_np(qtype, blocks[lo:hi], lo, *want, group)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    assert got[0].any() and got[1].any()


def test_get_rows_matches_gguf(case):
    qtype, raw, w = case
    ids = np.array([69, 0, 33, 33, 31])
    ref = gguf.quants.dequantize(raw, qtype)[ids].astype(np.float32)
    np.testing.assert_array_equal(packing.get_rows(w, ids).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_seq", [1, 2, 3, 4, 5, 9])   # GEMV up to GEMV_MAX_SEQ = 4, then tiles
def test_matmul_matches_reference(qtype, n_seq):
    """GEMV (n_seq <= 4) and tiled kernels vs float64 x @ gguf-dequantized W, and vs the NumPy twin."""
    n_in = _n_in(qtype)
    raw = random_blocks(qtype, N_OUT, n_in // FORMATS[qtype].weights, seed=7, std=0.05)
    w = packing.pack("w", qtype, raw, N_OUT, n_in)
    x = np.random.default_rng(3).standard_normal((n_seq, n_in)).astype(np.float32)
    W = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    ref = x.astype(np.float64) @ W.T
    scale = np.abs(x).astype(np.float64) @ np.abs(W).T
    got = matmul(x, w)
    assert np.all(np.abs(got - ref) <= 1e-6 * scale + 1e-30)
    twin = packing.matmul_ref(x, w)
    assert np.all(np.abs(twin - ref) <= 1e-6 * scale + 1e-30)
    if qtype in (T.Q5_0, T.Q5_1):          # the scratch-free Q5 GEMV and its twin (same algebra)
        m, m_scale = (w.m, 1.0) if qtype == T.Q5_1 else (w.d, -16.0)
        twin = q5.gemv_q5_np(x, w.qs, w.d, m, m_scale)[:, :N_OUT]
        assert np.all(np.abs(twin - ref) <= 1e-6 * scale + 1e-30)
        out = np.empty_like(got)
        q5._gemv_q5(x, w.qs, w.d, m, np.float32(m_scale), out)
        assert np.all(np.abs(out - ref) <= 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_pack_concat_and_resident_bytes(qtype):
    n_in = _n_in(qtype)
    nb = n_in // FORMATS[qtype].weights
    a, b = random_blocks(qtype, 40, nb, seed=1, std=0.05), random_blocks(qtype, 24, nb, seed=2, std=0.05)
    w = packing.pack_concat("ab", [(qtype, a, 40, n_in), (qtype, b, 24, n_in)])
    assert w.row_splits == (40, 24)
    ref = np.concatenate([gguf.quants.dequantize(a, qtype), gguf.quants.dequantize(b, qtype)])
    np.testing.assert_array_equal(packing.dequantize(w), ref)
    file_bytes = a.nbytes + b.nbytes
    # 64 rows = 2 full tiles: resident bytes are the packed blocks, <= 1.06x for K-quants
    assert w.nbytes <= (1.06 if nb == n_in // 256 else 1.17) * file_bytes


def test_bad_width_is_refused():
    raw = random_blocks(T.Q4_K, 4, 1)
    with pytest.raises(ValueError, match="multiple of 256"):
        packing.pack("w", T.Q4_K, raw[:, :144], 4, 128)


TOKENS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def _check_against_reference(path):
    model = Llama.load(path)
    logits = model.forward(np.array(TOKENS), 0, model.new_cache(16), all_logits=True)
    ref = reference_logits(path, TOKENS)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()
    cache = model.new_cache(16)                                  # decode steps take the GEMV kernels
    rows = np.stack([model.forward(np.array([t]), i, cache)[0] for i, t in enumerate(TOKENS[:6])])
    assert np.abs(rows - ref[:6]).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiny_model_matches_reference(tmp_path, qtype):
    """A 256-wide model, every matrix and the embedding in ``qtype``, vs the float64 reference."""
    path = write_tiny_llama(tmp_path / f"tiny-{qtype.name}.gguf", qtype=qtype, dim=256, hidden_dim=512,
                            n_heads=4, n_kv_heads=2, seed=int(qtype))
    _check_against_reference(path)


def test_tiny_mixed_model_like_q4_k_m(tmp_path):
    """llama.cpp's Q4_K_M mix on a model whose width is not a multiple of 256 (SmolLM2's 576):
    Q5_0 attention and gate/up (n_in = dim), Q4_K / Q6_K ffn_down (n_in = hidden_dim), Q8_0 embedding."""
    path = tmp_path / "mix.gguf"
    write_tiny_llama(path, qtype=T.Q5_0, embd_type=T.Q8_0, dim=96, hidden_dim=256, n_heads=4,
                     n_kv_heads=2, extra_types={"blk.0.ffn_down.weight": T.Q4_K,
                                                "blk.1.ffn_down.weight": T.Q6_K,
                                                "blk.1.attn_v.weight": T.Q5_1})
    _check_against_reference(path)
