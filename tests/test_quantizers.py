"""The quantizers (llamatrace.kernels.quantizers.rows) write ggml's bytes.

The reference is ggml's own ``quantize_<type>`` (what ``ggml_quantize_chunk`` calls, with and
without an importance matrix), compiled from llama-cpp-python's sdist with ``-DNDEBUG`` as
llama.cpp's release build is (:func:`kquant_files.ggml_quants_library`); gguf-py's
``quants.quantize`` is a second reference for the legacy types without an imatrix.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
from kquant_files import ggml_quants_library

from llamatrace.kernels.quantizers.k_rows import fp16_bits
from llamatrace.kernels.quantizers.rows import QUANTIZABLE, quantize_rows, quantize_rows_np
from llamatrace.kernels.types import registry

T = gguf.GGMLQuantizationType
LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
IMPLS = {"numba": quantize_rows, "numpy": quantize_rows_np,
         # what a type's declaration names (registry.QuantType.quantize / quantize_np)
         "declared": lambda t, x, qw=None: registry.TYPES[t].quantize(x, qw),
         "declared_np": lambda t, x, qw=None: registry.TYPES[t].quantize_np(x, qw)}
CASES = ("gaussian", "zero_blocks", "huge", "denormal", "constant", "negative", "short_rows", "float32_limits",
         "non_finite")


def ggml_quantize(t: T, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    """ggml's ``quantize_<type>(src, dst, nrow, n_per_row, imatrix)`` -> uint8 [n_rows, row_bytes]."""
    fn = getattr(ggml_quants_library(release=True), "quantize_" + t.name.lower().replace("_k", "_K"))
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    block, nbytes = gguf.GGML_QUANT_SIZES[t]
    out = np.zeros((x.shape[0], x.shape[1] // block * nbytes), np.uint8)
    written = fn(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1],
                 None if imatrix is None else imatrix.ctypes.data)
    assert written == out.nbytes
    return out


def rows(case: str, t: T) -> np.ndarray:
    """float32 [n_rows, n_per_row] test rows; ``short_rows``: n_per_row not a multiple of 256
    (5 blocks of 32) for the legacy types."""
    rng = np.random.default_rng(sum(map(ord, case)))
    n = 160 if case == "short_rows" and t in LEGACY else 512
    x = rng.standard_normal((6, n)).astype(np.float32)
    if case == "zero_blocks":
        x[0] = 0
        x[1, :256] = 0
        x[2, 32:64] = 0
        x[3, 16:32] = 0                                  # a K-quant sub-block of 16
        x[4, ::2] = 0
    elif case == "huge":
        x[0, 5] = 1e8                                    # d overflows fp16
        x[1, 40] = -3e4
        x[2, 300] = 6e4
        x[3] *= 1e-3
        x[3, 0] = 1e6
    elif case == "denormal":
        x *= np.float32(1e-39)                           # 1/d is inf, x*id inf or NaN
        x[1] *= np.float32(1e-3)
        x[2, :256] = np.float32(1e-44)
    elif case == "float32_limits":                     # max - min and x^2 overflow to inf
        x[0] *= np.float32(1e38)
        x[1, :64] = np.float32(3e38)
        x[1, 64:128] = np.float32(-3e38)
        x[2, ::3] = np.float32(2e19)
    elif case == "non_finite":                         # ggml goes on with inf and NaN, so must we
        x[0, 3] = np.nan
        x[1, 40] = np.inf
        x[2, 300] = -np.inf
        x[3, :32] = np.nan
    elif case == "constant":
        x[:3] = 0.5
        x[3:] = -2.0
    elif case == "negative":
        x = -np.abs(x)
    return np.ascontiguousarray(x)


def importance(n: int) -> np.ndarray:
    """A positive imatrix with some zero columns (columns no token used)."""
    qw = np.random.default_rng(7).gamma(1.0, 2.0, n).astype(np.float32)
    qw[::37] = 0
    return qw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("t", LEGACY + K_TYPES, ids=lambda t: t.name)
def test_bytes_equal_ggml(t, case, with_imatrix, impl):
    x = rows(case, t)
    qw = importance(x.shape[1]) if with_imatrix else None
    want = ggml_quantize(t, x, qw)
    got = IMPLS[impl](t, x, qw)
    assert got.dtype == np.uint8 and got.shape == want.shape
    block_bytes = gguf.GGML_QUANT_SIZES[t][1]
    differ = (got.reshape(-1, block_bytes) != want.reshape(-1, block_bytes)).any(axis=1)
    assert not differ.any(), f"{differ.sum()} of {differ.size} blocks differ, first {np.flatnonzero(differ)[:5]}"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")     # gguf-py's fp16 of the huge rows
@pytest.mark.parametrize("case", ("gaussian", "zero_blocks", "huge", "constant", "negative", "short_rows"))
@pytest.mark.parametrize("t", LEGACY, ids=lambda t: t.name)
def test_legacy_equal_gguf_py(t, case):
    x = rows(case, t)
    np.testing.assert_array_equal(quantize_rows(t, x), gguf.quants.quantize(x, t))


@pytest.mark.parametrize("impl", ("numba", "numpy"))
def test_bad_shapes(impl):
    quantize = IMPLS[impl]
    x = np.zeros((2, 96), np.float32)
    with pytest.raises(ValueError, match="n_per_row 96 is not a multiple of its block size 256"):
        quantize(T.Q4_K, x)
    with pytest.raises(ValueError, match="n_per_row 40 is not a multiple of its block size 32"):
        quantize(T.Q8_0, np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        quantize(T.Q4_0, np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="imatrix shape"):
        quantize(T.Q4_0, x, np.ones(64, np.float32))
    with pytest.raises(ValueError, match="cannot quantize to F16"):
        quantize(T.F16, x)


def test_every_type_served():
    assert set(QUANTIZABLE) == set(LEGACY + K_TYPES + (T.MXFP4,))
    declared = {t for t, qt in registry.TYPES.items() if qt.quantize and qt.quantize_np}
    assert declared <= set(QUANTIZABLE) and set(QUANTIZABLE) - declared <= {T.MXFP4}   # MXFP4: declared in its own room


def ggml_quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """ggml's ``quantize_row_mxfp4_ref(x, y, k)`` (what ``quantize_mxfp4`` runs, with or without an imatrix)."""
    fn = ggml_quants_library(release=True).quantize_row_mxfp4_ref
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    out = np.zeros((x.shape[0], x.shape[1] // 32 * 17), np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def mxfp4_rows(case: str) -> np.ndarray:
    """:func:`rows` with MXFP4's own edges: blocks whose largest |x| sits just below and at a power of
    two (where ``floorf(log2f(amax))`` turns), and tiny blocks whose exponent byte wraps below 0."""
    x = rows(case, T.Q4_0).copy()
    if case == "gaussian":
        for k, e in enumerate(range(-20, 20, 3)):
            x[k % 6, 32 * k] = np.float32(np.ldexp(1 - (k % 4) * 2.0 ** -24, e))
        x[5, 480:512] = np.float32(2.0 ** -126) * np.float32(1.5)          # e = (uint8_t)(-1): 255
        x[4, 448:480] = np.float32(2.0 ** -130)                            # e wraps to 251
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("impl", ("numba", "numpy"))
@pytest.mark.parametrize("case", CASES)
def test_mxfp4_bytes_equal_ggml(case, impl):
    """MXFP4 (gpt-oss's expert type) is ggml's ``quantize_row_mxfp4_ref``, byte for byte; an imatrix changes nothing."""
    x = mxfp4_rows(case)
    want = ggml_quantize_mxfp4(x)
    got = IMPLS[impl](T.MXFP4, x)
    assert got.dtype == np.uint8 and got.shape == want.shape == (6, x.shape[1] // 32 * 17)
    differ = (got.reshape(-1, 17) != want.reshape(-1, 17)).any(axis=1)
    assert not differ.any(), f"{differ.sum()} of {differ.size} blocks differ, first {np.flatnonzero(differ)[:5]}"
    np.testing.assert_array_equal(IMPLS[impl](T.MXFP4, x, importance(x.shape[1])), got)


@pytest.mark.parametrize("case", ("gaussian", "zero_blocks", "huge", "denormal", "constant", "negative", "float32_limits"))
def test_mxfp4_equal_gguf_py(case):
    """gguf-py's ``quants.quantize`` (MXFP4) as a second reference, on finite rows (its max meets a NaN
    where ggml's ``amax < |x|`` skips it)."""
    x = mxfp4_rows(case)
    with np.errstate(all="ignore"):
        want = gguf.quants.quantize(x, T.MXFP4)
    np.testing.assert_array_equal(quantize_rows(T.MXFP4, x), want)


def test_mxfp4_float16_rows():
    """An F16 base's rows quantize as their float32 values."""
    x16 = rows("gaussian", T.Q4_0).astype(np.float16)
    x16.view(np.uint16)[0, :64] = np.arange(64, dtype=np.uint16) * 0x03FF // 63
    np.testing.assert_array_equal(quantize_rows(T.MXFP4, x16), ggml_quantize_mxfp4(x16.astype(np.float32)))


def test_mxfp4_exponent_is_glibc_log2f():
    """``floor(log2f(amax))`` taken as float64 log2 rounded to float32 is glibc's on every float32
    just below (and at) a power of two, where a rounding could carry the floor up."""
    libm = ctypes.CDLL("libm.so.6")
    libm.log2f.restype, libm.log2f.argtypes = ctypes.c_float, [ctypes.c_float]
    amax = np.array([np.ldexp(1 - i * 2.0 ** -24, k) for k in range(-149, 128) for i in range(8)], np.float32)
    amax = amax[(amax > 0) & np.isfinite(amax)]
    ours = np.floor(np.log2(amax.astype(np.float64)).astype(np.float32))
    glibc = np.floor(np.array([libm.log2f(float(a)) for a in amax], np.float32))
    np.testing.assert_array_equal(ours, glibc)


def test_fp16_rounding():
    """The fp16 scales round to nearest even as ggml's GGML_FP32_TO_FP16 (NumPy's cast is the
    reference): fp16 subnormals, ties, overflow to inf, NaN."""
    rng = np.random.default_rng(3)
    bits = rng.integers(0x2F800000, 0x47900000, 3000, dtype=np.uint32)      # 2**-32 .. 73728
    halves = np.arange(0, 0x7C00, 97, dtype=np.uint16).view(np.float16).astype(np.float32)
    ties = (halves.view(np.uint32) + (1 << 12)).view(np.float32)             # halfway between fp16s
    values = np.concatenate([bits.view(np.float32), ties, [0.0, -0.0, 65504.0, 65520.0, np.inf, -np.inf]])
    values = np.concatenate([values, -values]).astype(np.float32)
    got = np.array([fp16_bits(v) for v in values], np.uint16)
    with np.errstate(over="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, want)
    assert fp16_bits(np.float32(np.nan)) == 0x7E00


@pytest.mark.parametrize("with_imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("t", LEGACY + K_TYPES, ids=lambda t: t.name)
def test_float16_rows_equal_ggml_on_their_float32(t, with_imatrix):
    """An F16 base's rows, given as float16 (widened inside the threads), quantize as ggml quantizes
    their float32 values: every fp16 bit pattern class (normal, subnormal, zero, inf, NaN) included."""
    x16 = rows("gaussian", t).astype(np.float16)
    x16.view(np.uint16)[0, :64] = np.arange(64, dtype=np.uint16) * 0x03FF // 63        # subnormals and 0
    x16.view(np.uint16)[1, 7] = 0x7C00                                                # inf
    x16.view(np.uint16)[2, 9] = 0x7E01                                                # NaN
    qw = importance(x16.shape[1]) if with_imatrix else None
    want = ggml_quantize(t, x16.astype(np.float32), qw)
    np.testing.assert_array_equal(quantize_rows(t, x16, qw), want)
