"""Packing (llamatrace.kernels.types.packing), the Q4_0/Q4_1/Q8_0/F32/F16/BF16 kernels (q4, q8, floats)
through the registry's matmul, their NumPy twins, and the thread policy (threads).

Every supported type goes through a real GGUF round trip: random weights are quantized with
``gguf.quants.quantize``, written with ``gguf.GGUFWriter`` to a temporary file, read back
with ``gguf.GGUFReader`` and packed; ``gguf.quants.dequantize`` is the reference.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llamatrace.errors import OptionError, UnsupportedModelError
from llamatrace.kernels.types import packing, q4, q8
from llamatrace.kernels.types.registry import FORMATS, matmul
from llamatrace.machine import jit, threads

T = gguf.GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1]

# n_out = 70 is not a multiple of the tile (32 rows); quantized n_in spans 3 blocks;
# float n_in = 99 exercises the kernels' tail loop (not a multiple of 8).
N_OUT = 70
N_IN = {T.F32: 99, T.F16: 99, T.BF16: 99, T.Q8_0: 96, T.Q4_0: 96, T.Q4_1: 96}


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> None:
    """Write a minimal GGUF holding ``tensors`` ({name: (quantized array, type)})."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        if qtype in (T.F32, T.F16):
            writer.add_tensor(name, data)
        else:  # byte arrays: tell the writer the real type
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tensors(tmp_path_factory) -> dict:
    """{type: ReaderTensor} read back from one tiny GGUF holding one weight per type."""
    rng = np.random.default_rng(1234)
    written = {}
    for qtype in TYPES:
        w = rng.standard_normal((N_OUT, N_IN[qtype])).astype(np.float32)
        w[0, :8] += 5.0  # a block with a large range, so scales differ between blocks
        written[f"w_{qtype.name}"] = (gguf.quants.quantize(w, qtype), qtype)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, written)
    reader = gguf.GGUFReader(str(path))
    return {t.tensor_type: t for t in reader.tensors}


def _pack(t) -> packing.Weight:
    # ReaderTensor.shape is ggml order (ne[0] = n_in first); .data is NumPy order [n_out, ...]
    n_in, n_out = int(t.shape[0]), int(t.shape[1])
    return packing.pack(t.name, t.tensor_type, t.data, n_out, n_in)


def _reference(t) -> np.ndarray:
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(N_OUT, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_is_bit_exact_with_gguf(tensors, qtype):
    w = _pack(tensors[qtype])
    assert (w.n_out, w.n_in, w.ggml_type) == (N_OUT, N_IN[qtype], qtype)
    got = packing.dequantize(w)
    assert got.dtype == np.float32 and got.shape == (N_OUT, N_IN[qtype])
    np.testing.assert_array_equal(got, _reference(tensors[qtype]))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_resident_bytes_within_budget(tensors, qtype):
    t = tensors[qtype]
    w = _pack(t)
    # row padding to the tile size costs at most TR-1 rows; the budget applies to real models
    padded_rows = w.n_tiles * packing.TR
    assert w.nbytes <= 1.3 * t.data.nbytes * padded_rows / N_OUT


@pytest.mark.parametrize("seq_len", [1, 3, 17])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_matches_float64_reference(tensors, qtype, seq_len):
    w = _pack(tensors[qtype])
    x = np.random.default_rng(seq_len).standard_normal((seq_len, w.n_in)).astype(np.float32)
    y = matmul(x, w)
    assert y.dtype == np.float32 and y.shape == (seq_len, N_OUT)
    expected = x.astype(np.float64) @ _reference(tensors[qtype]).astype(np.float64).T
    np.testing.assert_allclose(y, expected, rtol=0, atol=2e-6 * np.abs(expected).max())
    np.testing.assert_allclose(packing.matmul_ref(x, w), expected, rtol=0, atol=2e-6 * np.abs(expected).max())


def test_matmul_writes_into_out_and_accepts_one_row(tensors):
    w = _pack(tensors[T.Q4_1])
    x = np.random.default_rng(0).standard_normal((2, w.n_in)).astype(np.float32)
    out = np.full((2, N_OUT), np.nan, dtype=np.float32)
    assert matmul(x, w, out=out) is out
    ref = packing.matmul_ref(x, w)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    np.testing.assert_allclose(matmul(x[0], w), out[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expected"):
        matmul(x[:, :-1], w)


def test_matmul_propagates_nan(tensors):
    # the kernels use a fastmath subset without nnan, so a NaN activation is not optimised away
    w = _pack(tensors[T.Q4_1])
    x = np.zeros((1, w.n_in), dtype=np.float32)
    x[0, 5] = np.nan
    assert np.isnan(matmul(x, w)).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_get_rows_returns_dequantized_rows(tensors, qtype):
    w = _pack(tensors[qtype])
    ids = np.array([0, 69, 31, 32, 5, 5])
    got = packing.get_rows(w, ids)
    np.testing.assert_array_equal(got, _reference(tensors[qtype])[ids])
    with pytest.raises(IndexError):
        packing.get_rows(w, np.array([N_OUT]))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda q: q.name)
def test_gemv_kernel_equals_numpy_twin(tensors, qtype):
    w = _pack(tensors[qtype])
    x = np.random.default_rng(7).standard_normal((3, w.n_in)).astype(np.float32)
    out = np.empty((3, w.n_tiles * packing.TR), dtype=np.float32)  # padded rows included
    if qtype == T.Q8_0:
        q8._gemv_q8(x, w.qs, w.d, out)
        twin = q8.gemv_q8_np(x, w.qs, w.block_scales())
    else:
        m, m_scale = (w.m, np.float32(1.0)) if qtype == T.Q4_1 else (w.d, np.float32(-8.0))
        q4._gemv_q4(x, w.qs, w.d, m, m_scale, out)
        twin = q4.gemv_q4_np(x, w.qs, w.d, m, m_scale)
    np.testing.assert_allclose(out, twin, rtol=0, atol=2e-6 * np.abs(twin).max())


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda q: q.name)
def test_tile_dequantizer_equals_numpy_twin(tensors, qtype):
    w = _pack(tensors[qtype])
    m, m_scale = (w.m, np.float32(1.0)) if qtype == T.Q4_1 else (w.d, np.float32(-8.0))
    for t in range(w.n_tiles):
        tile = q8.dequant_tile(w.qs, w.d, t) if qtype == T.Q8_0 else q4.dequant_tile(w.qs, w.d, m, m_scale, t)
        np.testing.assert_array_equal(tile, packing.dequant_tile_np(w, t))


def test_pack_concat_fuses_rows(tensors):
    rng = np.random.default_rng(5)
    parts_f32 = [rng.standard_normal((n, 64)).astype(np.float32) for n in (40, 24, 24)]
    parts = [(T.Q4_1, gguf.quants.quantize(p, T.Q4_1), p.shape[0], 64) for p in parts_f32]
    fused = packing.pack_concat("qkv", parts)
    assert fused.n_out == 88 and fused.row_splits == (40, 24, 24)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    y = matmul(x, fused)
    separate = [matmul(x, packing.pack(f"p{i}", *p)) for i, p in enumerate(parts)]
    np.testing.assert_array_equal(np.split(y, np.cumsum(fused.row_splits)[:-1], axis=1)[1], separate[1])
    np.testing.assert_array_equal(y, np.concatenate(separate, axis=1))
    mixed = parts[:1] + [(T.Q8_0, gguf.quants.quantize(parts_f32[1], T.Q8_0), 24, 64)]
    with pytest.raises(ValueError, match="differ"):
        packing.pack_concat("qkv", mixed)


def test_unsupported_type_raises_one_line_error():
    raw = np.zeros((4, 8 * 18), dtype=np.uint8)
    with pytest.raises(UnsupportedModelError) as info:
        packing.pack("blk.0.attn_q.weight", T.IQ4_NL, raw, 4, 256)
    message = str(info.value)
    assert "blk.0.attn_q.weight" in message and "IQ4_NL" in message and "Q4_K" in message
    assert "\n" not in message


def test_n_in_must_be_a_multiple_of_the_block_size():
    with pytest.raises(ValueError, match="multiple of 32"):
        packing.pack("w", T.Q8_0, np.zeros((2, 34), dtype=np.uint8), 2, 33)


def test_set_threads_validates():
    import numba

    threads.set_threads(1)
    assert numba.get_num_threads() == 1
    threads.set_threads(numba.config.NUMBA_NUM_THREADS)
    for bad in (0, -1, numba.config.NUMBA_NUM_THREADS + 1, 1.5, True):
        with pytest.raises(OptionError):
            threads.set_threads(bad)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8"])
def test_repack_kernel_equals_numpy_twin(qtype, q8):
    # rows 0..40 then 41..99 of one packed matrix: parts that start and end inside a tile;
    # q8: the bytes grouped as the 8-bit kernels read them
    rng = np.random.default_rng(7)
    group = packing._group(qtype, "q8" if q8 else "f32")
    nq = FORMATS[qtype].packed_bytes
    n_blocks, block_bytes = 3, FORMATS[qtype].file_bytes
    blocks = rng.integers(0, 256, size=(100, n_blocks, block_bytes), dtype=np.uint8)
    shape = (-(-100 // packing.TR), n_blocks)
    scales, table = (np.uint16, jit.F16_BITS) if q8 else (np.float32, jit.F16_TABLE)   # as the packer
    got = (np.zeros(shape + (nq, packing.TR), np.uint8), np.zeros(shape + (packing.TR,), scales),
           np.zeros(shape + (packing.TR,), scales))
    want = tuple(a.copy() for a in got)
    for lo, hi in ((0, 41), (41, 100)):
        packing.repack_tiles(qtype, blocks[lo:hi], lo, table, *got, group)
        packing.repack_tiles_np(qtype, blocks[lo:hi], lo, *want, group)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint32) if g.dtype == np.float32 else g,
                                      w.view(np.uint32) if w.dtype == np.float32 else w)


def test_arena_arrays_are_aligned_disjoint_and_outlive_their_chunk():
    arena = packing.Arena(chunk_bytes=1 << 16)
    arrays = [arena.empty((3, 5, 7), np.float32), arena.empty((100,), np.uint8), arena.empty((2, 4), np.int8),
              arena.empty((40_000,), np.uint8)]               # over half a chunk: its own allocation
    for i, a in enumerate(arrays):
        a[...] = i + 1
    del arena                                                  # views keep their chunk alive
    for i, a in enumerate(arrays):
        assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous
        assert (a == i + 1).all()                              # nothing overlapped another array
    assert arrays[0].base is arrays[1].base is arrays[2].base is not arrays[3].base
    dirty = packing.Arena(chunk_bytes=1 << 20)
    dirty.empty((0,), np.uint8)
    dirty._chunk[:] = 0xFF                                     # memory a packer must not rely on
    packed = packing.pack("w", gguf.GGMLQuantizationType.Q4_1, gguf.quants.quantize(
        np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1),
        40, 64, arena=dirty)
    plain = packing.pack("w", gguf.GGMLQuantizationType.Q4_1, gguf.quants.quantize(
        np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1), 40, 64)
    for a, b in ((packed.qs, plain.qs), (packed.d, plain.d), (packed.m, plain.m)):
        np.testing.assert_array_equal(a, b)
    assert not packed.qs[-1, ..., 40 % packing.TR:].any() and not packed.d[-1, :, 40 % packing.TR:].any()  # padding zeroed


@pytest.mark.parametrize("crowded", [True, False])
@pytest.mark.parametrize("n_out,n_in,seq_len", [(128, 2048, 1), (70, 99, 3), (33, 2880, 1), (128, 2048, 2)])
def test_a_small_f32_product_runs_serial_on_a_crowded_machine(monkeypatch, crowded, n_out, n_in, seq_len):
    """A mixture's router of one row (128 x 2048: 2^18 multiply-adds) runs tile after tile on the
    calling thread while other processes crowd the cores, as the parallel kernel would (the same
    bits); more work, or a quiet machine, runs in parallel."""
    from llamatrace.kernels.types import floats
    rng = np.random.default_rng(n_in)
    w = packing.pack("router", T.F32, rng.standard_normal((n_out, n_in)).astype(np.float32), n_out, n_in)
    x = rng.standard_normal((seq_len, n_in)).astype(np.float32)
    threaded = np.empty((seq_len, w.n_tiles * packing.TR), np.float32)
    floats._tiled_f32(x, w.qs, threaded)
    ran = []
    monkeypatch.setattr(floats, "_tiled_f32", lambda *a, real=floats._tiled_f32: ran.append(1) or real(*a))
    monkeypatch.setattr(threads, "_crowded", crowded)
    y = matmul(x, w)
    np.testing.assert_array_equal(y.view(np.uint32), threaded[:, :n_out].view(np.uint32))
    assert bool(ran) == (not crowded or seq_len * w.qs.size > 1 << 18)
