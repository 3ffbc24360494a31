"""How far one array is from another: the numbers ``compare``, the local errors and the corpus
attribution report."""

from __future__ import annotations

import math

import numba
import numpy as np

from llamatrace.machine.jit import JIT_ATTN


def metrics(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float, float]:
    """(relative RMS error, max abs error, cosine) of two arrays of one shape, in float64.

    Non-finite values must match exactly (else all three are inf, inf, nan); complex arrays are
    compared as (real, imag) pairs.
    """
    a, b = (np.asarray(x) for x in (ours, ref))
    if np.iscomplexobj(a) or np.iscomplexobj(b):
        a, b = (np.stack([x.real, x.imag]) for x in (a.astype(np.complex128), b.astype(np.complex128)))
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb) or not np.array_equal(a[~fa], b[~fb], equal_nan=True):
        return math.inf, math.inf, math.nan
    a, b = a[fa], b[fb]
    d = a - b
    nd, nb, na = float(np.linalg.norm(d)), float(np.linalg.norm(b)), float(np.linalg.norm(a))
    rel = nd / nb if nb > 0 else (0.0 if nd == 0 else math.inf)
    max_abs = float(np.abs(d).max()) if d.size else 0.0
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    return rel, max_abs, cos


def relative_error_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float64 ``[n]``: ``‖a − b‖ / ‖b‖`` per row (first axis) of two arrays of one shape, read as
    float32 (the stages' dtype: ``a − b`` is a float32 difference), the squares summed in float64
    (0 where a row of ``b`` is all zeros and ``a`` equals it)."""
    a = np.asarray(a, dtype=np.float32).reshape(len(a), -1)
    b = np.asarray(b, dtype=np.float32).reshape(len(b), -1)
    if a.shape != b.shape:
        raise ValueError(f"relative_error_rows: shapes {a.shape} and {b.shape} differ")
    sums = np.empty((len(a), 2), dtype=np.float64)
    _square_sums(a, b, sums)
    den = np.sqrt(sums[:, 1])
    return np.sqrt(sums[:, 0]) / np.where(den > 0, den, 1.0)


@numba.njit(parallel=True, **JIT_ATTN)         # reassoc + contract, as attention's sums
def _square_sums(a, b, out):
    """out[i] = (Σ (a − b)², Σ b²) of row i, float64 sums of float32 rows: one read of each
    array, no temporaries (--stages compares ~400 MB of rows a chunk at 8B). ``reassoc``: the
    sums vectorise (float64: the order changes the last bits only)."""
    for i in numba.prange(a.shape[0]):
        dd = 0.0
        bb = 0.0
        for j in range(a.shape[1]):
            d = np.float64(a[i, j] - b[i, j])
            x = np.float64(b[i, j])
            dd += d * d
            bb += x * x
        out[i, 0] = dd
        out[i, 1] = bb
