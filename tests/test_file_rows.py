"""An untied embedding's rows dequantized from the file's blocks in Numba
(llamatrace.kernels.types.file_rows), against gguf-py's dequantize, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llamatrace.kernels.quantizers.rows import quantize_rows_np
from llamatrace.kernels.types import file_rows, packing

T = gguf.GGMLQuantizationType


def _blocks(qtype, n_rows: int, n_in: int, seed: int) -> np.ndarray:
    """uint8 [n_rows, row_bytes]: random rows quantized as llama-quantize does, a row of zeros and one
    of huge values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n_in)).astype(np.float32) * rng.uniform(0.01, 100, (n_rows, 1)).astype(np.float32)
    x[1] = 0.0
    x[2, :40] += 3e4
    return quantize_rows_np(qtype, x)


@pytest.mark.parametrize("qtype", sorted(file_rows.TYPES, key=int), ids=lambda t: t.name)
@pytest.mark.parametrize("n_in", [256, 2048])
def test_file_rows_are_gguf_dequantize_bit_for_bit(qtype, n_in):
    raw = _blocks(qtype, 9, n_in, n_in + int(qtype))
    got = file_rows.dequantize_rows(raw, qtype)
    want = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(9, n_in)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", sorted(file_rows.TYPES, key=int), ids=lambda t: t.name)
def test_random_bytes_too(qtype):
    """Any block bytes (scales of every value, fp16 subnormals, inf and NaN)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (40, 8 * size), dtype=np.uint8)
    got = file_rows.dequantize_rows(raw, qtype)
    with np.errstate(invalid="ignore"):                 # inf * 0 in gguf-py's products, as in ours
        want = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(got.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))


def test_get_rows_of_a_file_table_takes_the_numba_rows(monkeypatch):
    raw = _blocks(T.Q4_K, 6, 512, 0)
    table = packing.FileRows("token_embd.weight", T.Q4_K, 6, 512, raw.reshape(-1))
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("gguf-py's dequantize ran"))
    got = packing.get_rows(table, np.array([5, 0, 5]))
    monkeypatch.undo()
    want = np.asarray(gguf.quants.dequantize(raw, T.Q4_K), dtype=np.float32).reshape(6, 512)[[5, 0, 5]]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_other_types_and_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="Q4_0"):
        file_rows.dequantize_rows(np.zeros((1, 18), np.uint8), T.Q4_0)
    with pytest.raises(ValueError, match="144"):
        file_rows.dequantize_rows(np.zeros((1, 100), np.uint8), T.Q4_K)
