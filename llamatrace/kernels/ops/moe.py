"""The router of a mixture-of-experts FFN and the weighted sum of its experts' outputs, as
llama.cpp's ``build_moe_ffn`` (``src/llama-graph.cpp``) computes them on the CPU.

Per token (a row of ``logits``, float32 ``[n_expert]``):

* ``probs``: ``softmax(logits)`` (gating ``SOFTMAX``), or the logits themselves
  (``SOFTMAX_WEIGHT``, gpt-oss: the softmax comes after the choice). ggml's softmax: float32
  ``exp(x - max)``, their sum in float64, times the float32 ``1/sum``.
* ``ids``: the ``k`` largest probs, largest first (``ggml_argsort_top_k``: ``std::sort`` of the
  indices, descending). Ties go to the lower expert index, which is what libstdc++'s
  ``std::sort`` gives for rows of up to 16 experts (an insertion sort); above that its order of
  equal values is unspecified, so test files keep the k-th and (k+1)-th apart (NaNs:
  :func:`top_k_ref`).
* ``weights``: ``probs[ids]``; for ``SOFTMAX_WEIGHT``, the softmax of those.
* ``weights_norm`` (``norm``): ``weights / max(sum(weights), 6.103515625e-5)`` (the smallest
  normal fp16, llama.cpp's clamp against a zero sum).

Each slot's stacked gate|up product goes through the gated activation (:func:`expert_glu`,
with gpt-oss's per-expert biases added first), then the chosen experts' outputs ``[n_tokens, k,
dim]`` are multiplied by their weights (``ffn_moe_weighted``, gpt-oss's down biases added first)
and summed in slot order, ``((e0 + e1) + e2) + …`` (``ffn_moe_out``).

Each Numba kernel has a NumPy twin (``*_ref``) with the same contract.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from llamatrace.kernels.ops.fp32 import (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, exp_f32, swiglu_oai_ref,
                                         swiglu_ref)
from llamatrace.machine.jit import JIT_EXACT, JIT_EXACT_PARALLEL

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


@njit(inline="always", **JIT_EXACT)
def _top_k(p, k, order):
    """``order[:k]``: the first k of a stable descending insertion sort of ``p``'s indices (ties
    keep the lower index first), in O(n·k), not the whole sort's O(n²). Index j enters the
    sort's first k only past every index left behind it (the tail: it moves left while the one
    before it is smaller), so the tail is kept as its max and whether it holds a NaN (which
    nothing passes): the same k, NaN or not, as the whole sort (:func:`top_k_ref`)."""
    n_top = 0
    tail_max = np.float32(-np.inf)
    tail_nan = False
    for j in range(p.shape[0]):
        v = p[j]
        if n_top == k:
            if tail_nan or not (tail_max < v and p[order[k - 1]] < v):
                dropped = v
            else:
                dropped = p[order[k - 1]]
                i = k - 1
                while i > 0 and p[order[i - 1]] < v:
                    order[i] = order[i - 1]
                    i -= 1
                order[i] = j
            if dropped != dropped:
                tail_nan = True
            elif dropped > tail_max:
                tail_max = dropped
            continue
        i = n_top
        while i > 0 and p[order[i - 1]] < v:
            order[i] = order[i - 1]
            i -= 1
        order[i] = j
        n_top += 1


@njit(**JIT_EXACT)
def _route(logits, k, softmax_all, norm):
    """:func:`route`'s arrays (``weights_norm`` ``[0, k]`` unless ``norm``), made here: four NumPy
    calls fewer a layer, ~10 µs with the caches cold after an expert matmul."""
    n = logits.shape[0]
    probs = np.empty_like(logits)
    ids = np.empty((n, k), dtype=np.int32)
    weights = np.empty((n, k), dtype=np.float32)
    weights_norm = np.empty((n if norm else 0, k), dtype=np.float32)
    order = np.empty(k, dtype=np.int32)
    picked = np.empty(k, dtype=np.float32)
    for t in range(logits.shape[0]):
        p = probs[t]
        if softmax_all:
            _softmax_into(logits[t], p)
        else:
            p[:] = logits[t]
        _top_k(p, k, order)
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
    return probs, ids, weights, weights_norm


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
    probs, ids, weights, weights_norm = _route(logits, k, gating == "softmax", norm)
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


def top_k_ref(probs: np.ndarray, k: int) -> np.ndarray:
    """NumPy twin of the router's top-k (``_top_k`` in :func:`route`): per row, the first ``k`` of
    a stable descending insertion sort of its indices, written out whole, in O(n_expert²).

    llama.cpp's ``ggml_argsort_top_k`` is ``std::sort`` of the indices by ``a > b``; libstdc++
    sorts rows of up to 16 by insertion, so equal values keep the lower index first (above 16
    their order is unspecified). ``-0.0`` and ``0.0`` are equal; ±inf are ordered as numbers; a
    NaN compares false, so here nothing moves past it (libstdc++ first compares each value with
    the row's first one, so its NaN order can differ: route's is this one, not llama.cpp's).

    Args:
        probs: float32 ``[n_tokens, n_expert]``.
        k: ``1 <= k <= n_expert``.

    Returns:
        int32 ``[n_tokens, k]``, best first.
    """
    ids = np.empty((len(probs), k), dtype=np.int32)
    for t, p in enumerate(np.asarray(probs, dtype=np.float32).tolist()):
        order: list[int] = []
        for j, v in enumerate(p):
            order.append(j)
            i = j
            while i > 0 and p[order[i - 1]] < v:
                order[i] = order[i - 1]
                i -= 1
            order[i] = j
        ids[t] = order[:k]
    return ids


def route_ref(logits: np.ndarray, k: int, gating: str = "softmax",
              norm: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """NumPy twin of :func:`route`."""
    logits = np.asarray(logits, dtype=np.float32)
    _check(logits, k, gating)
    probs = _softmax_ref(logits) if gating == "softmax" else logits.copy()
    return (probs, *choose_ref(probs, k, gating, norm))


def choose_ref(probs: np.ndarray, k: int, gating: str = "softmax", norm: bool = False,
               ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """What follows the router's probabilities (:func:`route` after ``probs``, in NumPy): the ``k``
    chosen experts (``ids`` when given: llama.cpp takes the weights by ``get_rows(probs, ids)``
    whatever chose them), their weights and, with ``norm``, the normalised weights. The forward
    pass runs it where a hook replaced ``ffn_moe_probs`` or ``ffn_moe_topk``.

    Args:
        probs: float32 ``[n_tokens, n_expert]``.
        ids: int ``[n_tokens, k]`` in ``0 .. n_expert - 1``, or None (the top ``k`` of ``probs``).

    Returns:
        ``ids`` int32 ``[n_tokens, k]``, ``weights`` float32 ``[n_tokens, k]``, ``weights_norm``
        (None unless ``norm``).

    Raises:
        ValueError: ``probs`` not 2-D, ``k`` out of range, ``ids`` of another shape or out of range.
    """
    probs = np.asarray(probs, dtype=np.float32)
    _check(probs, k, gating)
    if ids is None:
        ids = top_k_ref(probs, k)
    else:
        ids = np.asarray(ids)
        if ids.shape != (probs.shape[0], k) or (ids.size and not 0 <= ids.min() <= ids.max() < probs.shape[1]):
            raise ValueError(f"choose: ids {list(ids.shape)} must be [{probs.shape[0]}, {k}] experts in "
                             f"0..{probs.shape[1] - 1}")
        ids = ids.astype(np.int32)
    picked = np.take_along_axis(probs, ids.astype(np.int64), axis=1)
    weights = picked if gating == "softmax" else _softmax_ref(picked)
    return ids, weights, (normalise_ref(weights) if norm else None)


def normalise_ref(weights: np.ndarray) -> np.ndarray:
    """The chosen weights divided by their sum, clamped below at :data:`WEIGHTS_SUM_MIN` (float32
    ``[n_tokens, k]``; :func:`route`'s ``weights_norm``, in NumPy)."""
    weights = np.asarray(weights, dtype=np.float32)
    total = np.maximum(weights.sum(axis=1, dtype=np.float64, keepdims=True).astype(np.float32), WEIGHTS_SUM_MIN)
    return (weights / total).astype(np.float32)


_NO_BIAS = np.zeros((0, 0), dtype=np.float32)
_NO_IDS = np.zeros(0, dtype=np.int64)            # (the kernels read ids only with a bias)


def _bias_args(bias: np.ndarray | None, ids: np.ndarray | None, n_slots: int,
               width: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[n_expert, width]`` and int64 ``[n_slots]`` C-contiguous for the kernels (an empty
    bias: none), or ValueError: the kernels index them unchecked."""
    if bias is None:
        return _NO_BIAS, _NO_IDS
    if ids is None or np.ndim(bias) != 2 or np.shape(bias)[1] != width:
        raise ValueError(f"expert bias: {list(np.shape(bias))} must be [n_expert, {width}], with each slot's expert id")
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.shape[0] != n_slots or (n_slots and not 0 <= ids.min() <= ids.max() < bias.shape[0]):
        raise ValueError(f"expert bias: ids {list(ids.shape)} must be {n_slots} experts in 0..{bias.shape[0] - 1}")
    return np.ascontiguousarray(bias, dtype=np.float32), ids


@njit(**JIT_EXACT)
def _combine(experts, weights, bias, ids, out):
    k = experts.shape[1]
    has_bias = bias.shape[0] > 0
    for t in range(experts.shape[0]):
        o = out[t]
        for s in range(k):
            w = weights[t, s]
            e = experts[t, s]
            b = bias[ids[t * k + s]] if has_bias else e          # e: never read
            for j in range(o.shape[0]):
                v = e[j] + b[j] if has_bias else e[j]            # (down + its expert's bias), rounded to float32
                o[j] = v * w if s == 0 else o[j] + v * w


def combine(experts: np.ndarray, weights: np.ndarray, bias: np.ndarray | None = None,
            ids: np.ndarray | None = None) -> np.ndarray:
    """The weighted sum of the chosen experts' outputs: ``Σ_s weights[t, s] · experts[t, s]``,
    slots added in order (llama.cpp: ``ffn_moe_weighted`` then ``ffn_moe_out``), in float32.

    Args:
        experts: float32 ``[n_tokens, k, dim]`` (``ffn_moe_down``).
        weights: float32 ``[n_tokens, k]``.
        bias, ids: optional float32 ``[n_expert, dim]`` (gpt-oss's ``ffn_down_exps.bias``) and
            int ``[n_tokens, k]``, each slot's expert: its bias is added to ``experts[t, s]``
            first (``ffn_moe_down_biased``), as one float32 add.

    Returns:
        float32 ``[n_tokens, dim]``.

    Raises:
        ValueError: shapes that disagree, a bias without ids, ids that do not fit the slots or the bias.
    """
    experts = np.ascontiguousarray(experts, dtype=np.float32)
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if experts.ndim != 3 or weights.shape != experts.shape[:2]:
        raise ValueError(f"combine: experts {list(experts.shape)} must be [n_tokens, k, dim] and weights "
                         f"{list(weights.shape)} [n_tokens, k]")
    bias, ids = _bias_args(bias, ids, experts.shape[0] * experts.shape[1], experts.shape[2])
    out = np.empty((experts.shape[0], experts.shape[2]), dtype=np.float32)
    _combine(experts, weights, bias, ids, out)
    return out


def combine_ref(experts: np.ndarray, weights: np.ndarray, bias: np.ndarray | None = None,
                ids: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`combine`."""
    if bias is not None:
        experts = (experts + bias[np.asarray(ids, dtype=np.int64)]).astype(np.float32)
    weighted = (experts * weights[:, :, None]).astype(np.float32)
    out = weighted[:, 0].copy()
    for s in range(1, weighted.shape[1]):
        out += weighted[:, s]
    return out


@njit(error_model="numpy", inline="always", **JIT_EXACT)
def _glu(g, u, oai, alpha, limit):
    """One element's gated activation: llamatrace.kernels.ops.fp32's swiglu (silu) and swiglu_oai, op for op."""
    if oai:
        g = min(g, limit)
        return (g / (np.float32(1.0) + exp_f32(alpha * -g))) * (min(max(u, -limit), limit) + np.float32(1.0))
    return (g / (np.float32(1.0) + exp_f32(-g))) * u


# The experts' gated activation of each slot's stacked gate|up row, with its expert's biases
# (gpt-oss) added first: one pass, where bias adds, two half copies and a SwiGLU were four.
# No bias is no add, not an add of zeros: -0.0 + 0.0 would be +0.0.
@njit(error_model="numpy", inline="always", **JIT_EXACT)
def _glu_row(gate_up, bias, ids, oai, alpha, limit, out, i):
    ff = out.shape[1]
    g, u, o = gate_up[i, :ff], gate_up[i, ff:], out[i]
    if bias.shape[0]:
        b = bias[ids[i]]
        for j in range(ff):
            o[j] = _glu(g[j] + b[j], u[j] + b[ff + j], oai, alpha, limit)
    else:
        for j in range(ff):
            o[j] = _glu(g[j], u[j], oai, alpha, limit)


@njit(error_model="numpy", **JIT_EXACT)
def _glu_serial(gate_up, bias, ids, oai, alpha, limit, out):
    for i in range(out.shape[0]):
        _glu_row(gate_up, bias, ids, oai, alpha, limit, out, i)


@njit(error_model="numpy", **JIT_EXACT_PARALLEL)
def _glu_parallel(gate_up, bias, ids, oai, alpha, limit, out):
    for i in prange(out.shape[0]):
        _glu_row(gate_up, bias, ids, oai, alpha, limit, out, i)


GLU_ACTS = ("silu", "swiglu_oai")
"""The experts' gated activations :func:`expert_glu` runs."""
_ALPHA, _LIMIT = np.float32(SWIGLU_OAI_ALPHA), np.float32(SWIGLU_OAI_LIMIT)
_PARALLEL_GLU = 1 << 14
"""Outputs above which :func:`expert_glu` runs rows in parallel (a decode step's 8 x 1536 does not:
waking the threads costs more than the exps)."""


def expert_glu(gate_up: np.ndarray, act: str, bias: np.ndarray | None = None,
               ids: np.ndarray | None = None) -> np.ndarray:
    """Each slot's gated activation from its stacked gate|up row (``ffn_moe_swiglu`` /
    ``ffn_moe_swiglu_oai``), the same float32 numbers as :func:`llamatrace.kernels.ops.fp32.swiglu`
    (``act`` ``"silu"``) or :func:`~llamatrace.kernels.ops.fp32.swiglu_oai` (``"swiglu_oai"``) of
    the halves, after ``gate_up + bias[ids]`` in float32 (``ffn_moe_gate_biased`` /
    ``ffn_moe_up_biased``, ggml_add_id) when ``bias`` is given.

    Args:
        gate_up: float32 ``[n_slots, 2*expert_hidden_dim]``, gate's columns first.
        act: one of :data:`GLU_ACTS`.
        bias, ids: optional float32 ``[n_expert, 2*expert_hidden_dim]`` and int ``[n_slots]``.

    Returns:
        float32 ``[n_slots, expert_hidden_dim]``.

    Raises:
        ValueError: an unknown ``act``, an odd width, a bias of another width or without ids, ids that do not fit.
    """
    gate_up = np.ascontiguousarray(gate_up, dtype=np.float32)
    if act not in GLU_ACTS or gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"expert_glu: act {act!r} must be one of {GLU_ACTS}, gate_up {list(gate_up.shape)} "
                         f"[n_slots, 2*hidden]")
    bias, ids = _bias_args(bias, ids, gate_up.shape[0], gate_up.shape[1])
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    run = _glu_parallel if gate_up.shape[0] > 1 and out.size > _PARALLEL_GLU else _glu_serial
    run(gate_up, bias, ids, act == "swiglu_oai", _ALPHA, _LIMIT, out)
    return out


def expert_glu_ref(gate_up: np.ndarray, act: str, bias: np.ndarray | None = None,
                   ids: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`expert_glu`."""
    if bias is not None:
        gate_up = (gate_up + bias[np.asarray(ids, dtype=np.int64).reshape(-1)]).astype(np.float32)
    if act == "swiglu_oai":
        ff = gate_up.shape[1] // 2
        return swiglu_oai_ref(gate_up[:, :ff], gate_up[:, ff:])
    return swiglu_ref(gate_up)
