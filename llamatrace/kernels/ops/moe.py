"""The router of a mixture-of-experts FFN and the weighted sum of its experts' outputs, as
llama.cpp's ``build_moe_ffn`` (``src/llama-graph.cpp``) computes them on the CPU.

Per token (a row of ``logits``, float32 ``[n_expert]``):

* ``probs``: ``softmax(logits)`` (gating ``SOFTMAX``), or the logits themselves
  (``SOFTMAX_WEIGHT``, gpt-oss: the softmax comes after the choice). ggml's softmax: float32
  ``exp(x - max)``, their sum in float64, times the float32 ``1/sum``.
* ``ids``: the ``k`` largest probs, largest first (``ggml_argsort_top_k``: ``std::sort`` of the
  indices, descending). Ties go to the lower expert index, which is what libstdc++'s
  ``std::sort`` gives for rows of up to 16 experts (an insertion sort); above that its order of
  equal values is unspecified, so test files keep the k-th and (k+1)-th apart.
* ``weights``: ``probs[ids]``; for ``SOFTMAX_WEIGHT``, the softmax of those.
* ``weights_norm`` (``norm``): ``weights / max(sum(weights), 6.103515625e-5)`` (the smallest
  normal fp16, llama.cpp's clamp against a zero sum).

Then the chosen experts' outputs ``[n_tokens, k, dim]`` are multiplied by their weights
(``ffn_moe_weighted``) and summed in slot order, ``((e0 + e1) + e2) + …`` (``ffn_moe_out``).

Each Numba kernel has a NumPy twin (``*_ref``) with the same contract.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from llamatrace.kernels.ops.fp32 import exp_f32
from llamatrace.machine.jit import JIT_EXACT

GATING_FUNCS = {1: "softmax", 3: "softmax_weight"}
"""llama.cpp's ``llama_expert_gating_func_type`` values llamatrace runs (``{arch}.expert_gating_func``)."""

WEIGHTS_SUM_MIN = np.float32(6.103515625e-5)
"""The clamp of the weights' sum before normalising: the smallest normal fp16 (llama.cpp's)."""


@njit(inline="always", **JIT_EXACT)
def _softmax_into(x, out):
    m = x[0]
    for j in range(1, x.shape[0]):
        m = max(m, x[j])
    total = 0.0                                  # float64, as ggml_vec_soft_max_f32's ggml_float
    for j in range(x.shape[0]):
        v = exp_f32(x[j] - m)
        out[j] = v
        total += v
    inv = np.float32(1.0 / total)
    for j in range(x.shape[0]):
        out[j] *= inv


@njit(**JIT_EXACT)
def _route(logits, k, softmax_all, norm, probs, ids, weights, weights_norm):
    n_expert = logits.shape[1]
    order = np.empty(n_expert, dtype=np.int32)
    picked = np.empty(k, dtype=np.float32)
    for t in range(logits.shape[0]):
        p = probs[t]
        if softmax_all:
            _softmax_into(logits[t], p)
        else:
            p[:] = logits[t]
        # stable descending insertion sort of the indices: ties keep the lower index first
        for j in range(n_expert):
            v = p[j]
            i = j
            while i > 0 and p[order[i - 1]] < v:
                order[i] = order[i - 1]
                i -= 1
            order[i] = j
        for s in range(k):
            ids[t, s] = order[s]
            picked[s] = p[order[s]]
        if softmax_all:
            weights[t] = picked
        else:
            _softmax_into(picked, weights[t])
        if norm:
            total = 0.0
            for s in range(k):
                total += weights[t, s]
            total = max(np.float32(total), np.float32(6.103515625e-5))
            for s in range(k):
                weights_norm[t, s] = weights[t, s] / total


def route(logits: np.ndarray, k: int, gating: str = "softmax",
          norm: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Choose ``k`` experts per token and their weights, as the module docstring says.

    Args:
        logits: float32 ``[n_tokens, n_expert]``, the router's output (``ffn_moe_logits``).
        k: experts per token, ``1 <= k <= n_expert``.
        gating: ``"softmax"`` (over all experts, then choose) or ``"softmax_weight"`` (choose by
            logit, softmax over the chosen).
        norm: divide the chosen weights by their sum (``expert_weights_norm``).

    Returns:
        ``probs`` float32 ``[n_tokens, n_expert]`` (``ffn_moe_probs``), ``ids`` int32
        ``[n_tokens, k]`` (``ffn_moe_topk``, best first), ``weights`` float32 ``[n_tokens, k]``
        (``ffn_moe_weights``, or ``ffn_moe_weights_softmax``) and ``weights_norm`` (``None``
        unless ``norm``).

    Raises:
        ValueError: ``k`` out of range, an unknown ``gating``, ``logits`` not 2-D.
    """
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    _check(logits, k, gating)
    n = logits.shape[0]
    probs = np.empty_like(logits)
    ids = np.empty((n, k), dtype=np.int32)
    weights = np.empty((n, k), dtype=np.float32)
    weights_norm = np.empty((n, k), dtype=np.float32) if norm else weights[:0]
    _route(logits, k, gating == "softmax", norm, probs, ids, weights, weights_norm)
    return probs, ids, weights, (weights_norm if norm else None)


def _check(logits: np.ndarray, k: int, gating: str) -> None:
    if logits.ndim != 2 or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"route: logits {list(logits.shape)} must be [n_tokens, n_expert] with 1 <= k ({k}) "
                         f"<= n_expert")
    if gating not in GATING_FUNCS.values():
        raise ValueError(f"route: gating {gating!r} is not one of {sorted(GATING_FUNCS.values())}")


def _softmax_ref(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True)).astype(np.float32)
    return e * (1.0 / e.sum(axis=-1, dtype=np.float64, keepdims=True)).astype(np.float32)


def route_ref(logits: np.ndarray, k: int, gating: str = "softmax",
              norm: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """NumPy twin of :func:`route`."""
    logits = np.asarray(logits, dtype=np.float32)
    _check(logits, k, gating)
    probs = _softmax_ref(logits) if gating == "softmax" else logits.copy()
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :k].astype(np.int32)
    picked = np.take_along_axis(probs, ids, axis=1)
    weights = picked if gating == "softmax" else _softmax_ref(picked)
    if not norm:
        return probs, ids, weights, None
    total = np.maximum(weights.sum(axis=1, dtype=np.float64, keepdims=True).astype(np.float32), WEIGHTS_SUM_MIN)
    return probs, ids, weights, (weights / total).astype(np.float32)


@njit(**JIT_EXACT)
def _combine(experts, weights, out):
    for t in range(experts.shape[0]):
        for j in range(experts.shape[2]):
            out[t, j] = experts[t, 0, j] * weights[t, 0]
        for s in range(1, experts.shape[1]):
            w = weights[t, s]
            for j in range(experts.shape[2]):
                out[t, j] += experts[t, s, j] * w


def combine(experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted sum of the chosen experts' outputs: ``Σ_s weights[t, s] · experts[t, s]``,
    slots added in order (llama.cpp: ``ffn_moe_weighted`` then ``ffn_moe_out``), in float32.

    Args:
        experts: float32 ``[n_tokens, k, dim]`` (``ffn_moe_down``).
        weights: float32 ``[n_tokens, k]``.

    Returns:
        float32 ``[n_tokens, dim]``.
    """
    experts = np.ascontiguousarray(experts, dtype=np.float32)
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    out = np.empty((experts.shape[0], experts.shape[2]), dtype=np.float32)
    _combine(experts, weights, out)
    return out


def combine_ref(experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`combine`."""
    weighted = (experts * weights[:, :, None]).astype(np.float32)
    out = weighted[:, 0].copy()
    for s in range(1, weighted.shape[1]):
        out += weighted[:, s]
    return out
