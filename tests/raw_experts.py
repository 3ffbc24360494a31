"""Stand-in ``mul_mat_id`` kernels, so that the model's experts-in-the-file path runs on the golden
files whose expert types no real kernel takes (F32 experts, llama.cpp's float32 reference) and is
tested apart from the real kernels (``tests/test_mul_mat_id_q8.py``, ``tests/test_mul_mat_id_f32.py``).

:func:`patch` declares the types the test files use (F32, Q8_0 and MXFP4 in the ``f32`` mode;
Q8_0 and MXFP4 in ``q8``) in both activation modes' ``TYPES`` and gives them a ``matmul_id`` built
on :func:`llamatrace.kernels.mul_mat_id.mul_mat_id_ref`'s arithmetic (float64 dot products of
``gguf.quants.dequantize``'s weights), the ``q8`` one with ``activations_ref`` from
:func:`llamatrace.kernels.int8.act8.quantize_np` (ggml's ``quantize_row_q8_0``: Q8_0 and MXFP4
experts take Q8_0 activations, as llama.cpp's ``vec_dot_type`` says). So the loader leaves those
experts in the file (:class:`~llamatrace.kernels.mul_mat_id.FileExperts`) and ``moe_ffn`` runs
them through ``mul_mat_id``.

Used by ``tests/test_file_experts.py`` (its ``raw`` fixture) and, for any other test file,
as a pytest plugin: ``python3 -m pytest -p raw_experts tests/test_moe.py`` runs it with every
expert of those types raw.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llamatrace.kernels import mul_mat_id
from llamatrace.kernels.int8 import act8, mul_mat_id_q8
from llamatrace.kernels.types import mul_mat_id_f32

T = gguf.GGMLQuantizationType
F32_TYPES = frozenset({T.F32, T.Q8_0, T.MXFP4})
Q8_TYPES = frozenset({T.Q8_0, T.MXFP4})


def _activations_q8(x: np.ndarray, ggml_type) -> np.ndarray:
    """float64 ``[n_rows, n_in]``: ``x`` rounded to Q8_0 blocks (ggml's ``quantize_row_q8_0``), dequantized."""
    if T(ggml_type) not in Q8_TYPES:
        raise ValueError(f"raw_experts: no q8 activations for {ggml_type!r}")
    xq, xd, _ = act8.quantize_np(np.ascontiguousarray(x, np.float32), act8.Q8_0)
    n_rows, n_in = x.shape
    return (xq.reshape(n_rows, -1, act8.QK).astype(np.float64) * xd[:, :, None]).reshape(n_rows, n_in)


def _matmul_id(activations: str):
    """A ``matmul_id`` with the kernels' contract, on :func:`mul_mat_id_ref`'s arithmetic."""
    def matmul_id(x, rows, order, starts, experts, datas, ggml_type):
        xs = _activations_q8(x, ggml_type) if activations == "q8" else x.astype(np.float64)
        n_out = [d.shape[1] for d in datas]
        out = np.empty((rows.shape[0], sum(n_out)), dtype=np.float32)
        for g, e in enumerate(experts):
            sel = order[starts[g]:starts[g + 1]]
            w = np.concatenate([np.asarray(gguf.quants.dequantize(d[e], ggml_type), np.float64) for d in datas])
            out[sel] = (xs[rows[sel]] @ w.T).astype(np.float32)
        return out
    return matmul_id


def patch(mp: pytest.MonkeyPatch | None = None) -> pytest.MonkeyPatch:
    """Declare the stand-in kernels (undone by ``mp.undo()``); returns the monkeypatch."""
    mp = mp or pytest.MonkeyPatch()
    mp.setattr(mul_mat_id_f32, "TYPES", F32_TYPES)
    mp.setattr(mul_mat_id_q8, "TYPES", Q8_TYPES)
    mp.setitem(mul_mat_id.TYPES, "f32", F32_TYPES)
    mp.setitem(mul_mat_id.TYPES, "q8", Q8_TYPES)
    mp.setattr(mul_mat_id_f32, "matmul_id", _matmul_id("f32"))
    mp.setattr(mul_mat_id_q8, "matmul_id", _matmul_id("q8"))
    mp.setattr(mul_mat_id_q8, "activations_ref", _activations_q8)
    return mp


def pytest_configure(config):
    """As a plugin (``-p raw_experts``): the stand-in kernels for the whole run."""
    patch()
