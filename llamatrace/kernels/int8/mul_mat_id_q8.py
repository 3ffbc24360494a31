"""The ``q8`` mode's ``mul_mat_id`` kernels on the file's blocks (:mod:`llamatrace.kernels.mul_mat_id`).

Placeholder: no type yet (the loader packs every expert type).
"""

from __future__ import annotations

import numpy as np

TYPES: frozenset = frozenset()
"""The weight types these kernels run."""


def matmul_id(x, rows, order, starts, experts, datas, ggml_type) -> np.ndarray:
    """``out[i] = q8(x[rows[i]]) @ W[ids[i]].T`` over the groups of :func:`llamatrace.kernels.mul_mat_id.groups`."""
    raise ValueError(f"mul_mat_id_q8: no kernel for {ggml_type!r}")


def activations_ref(x: np.ndarray, ggml_type) -> np.ndarray:
    """float64 ``[n_rows, n_in]``: ``x`` as these kernels quantize it for ``ggml_type``, dequantized."""
    raise ValueError(f"mul_mat_id_q8: no kernel for {ggml_type!r}")
