"""Kernels of the gated DeltaNet (linear attention of Qwen3.5, llama.cpp's ``qwen35``): the causal
depthwise conv1d with its conv state, the L2 norm of q and k, and the gated delta rule in two
forms, recurrent (one token after another: decode) and chunked (a prefill's chunks as matrix
products).

The delta rule, per value head (Yang et al. 2024, "Gated Delta Networks"; llama.cpp
``ggml_compute_forward_gated_delta_net`` and ``build_delta_net_chunking``), for token t with key
``k`` and query ``q`` (L2-normalised), value ``v``, write strength ``beta`` ∈ (0, 1) and log-decay
``g`` ≤ 0::

    S ← exp(g) · S                       decay
    u = beta · (v − Sᵀk)                 what the token writes: the part of v the state lacks
    S ← S + k uᵀ                         delta-rule write
    o = Sᵀq / √head_dim                  read

``S`` is ``[head_k_dim, head_v_dim]``; it is stored transposed, as llama.cpp stores it (ne
``[S_v, S_v, H_v]``): ``state[h, j, i] = S[i][j]``, so ``state[h] @ k`` is ``Sᵀk``. Key and query
head ``h % n_k_heads`` serves value head ``h`` (llama.cpp tiles them: ``ggml_repeat_4d``).

Each Numba kernel ``foo`` has a plain NumPy twin ``foo_ref``; the tests check one against the
other and both against :func:`delta_rule_naive` (the four lines above, in float64).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from llamatrace.machine.jit import JIT_ATTN, JIT_ATTN_PARALLEL, JIT_EXACT_PARALLEL

CHUNK = 64
"""Tokens per chunk of :func:`delta_rule_chunked` (llama.cpp's ``CS`` for a scalar gate)."""


# ---------------------------------------------------------------------------------------------
# causal depthwise conv1d (llama.cpp ggml_ssm_conv over concat(conv state, x))
# ---------------------------------------------------------------------------------------------
@njit(**JIT_EXACT_PARALLEL)
def causal_conv1d(x, conv_state, weight):
    """Causal depthwise conv1d of each channel over the conv state then ``x``.

    Args:
        x: float32 ``[seq_len, channels]`` (``linear_attn_qkv_mixed``).
        conv_state: float32 ``[channels, kernel-1]``: the last ``kernel-1`` inputs before ``x``
            (zeros at the start of a sequence); updated in place to the last ``kernel-1`` of
            ``concat(conv_state, x)``.
        weight: float32 ``[channels, kernel]`` (GGUF ``ssm_conv1d.weight``, no bias).

    Returns:
        float32 ``[seq_len, channels]``: ``y[t, c] = Σ_k w[c, k] · window[t + k, c]``, summed in
        float32 in ``k`` order, as ``ggml_ssm_conv``.
    """
    seq_len, channels = x.shape
    km1 = conv_state.shape[1]
    if seq_len == 1:                     # a decode step: each channel's state row, then its input
        out = np.empty((1, channels), dtype=np.float32)
        for c in range(channels):
            acc = np.float32(0.0)
            for k in range(km1):
                acc += conv_state[c, k] * weight[c, k]
            out[0, c] = acc + x[0, c] * weight[c, km1]
            for j in range(km1 - 1):
                conv_state[c, j] = conv_state[c, j + 1]
            if km1:
                conv_state[c, km1 - 1] = x[0, c]
        return out
    # the window's rows [kernel-1 + seq_len, channels] are the conv state's columns, then x's rows:
    # in memory order, so that each output row is made of whole rows and vectorises over channels
    head = np.empty((km1, channels), dtype=np.float32)
    w = np.empty((km1 + 1, channels), dtype=np.float32)
    for c in range(channels):
        for j in range(km1):
            head[j, c] = conv_state[c, j]
        for k in range(km1 + 1):
            w[k, c] = weight[c, k]
    out = np.empty((seq_len, channels), dtype=np.float32)
    for t in prange(seq_len):
        o = out[t]
        o[:] = 0.0
        for k in range(km1 + 1):
            r = t + k
            src = head[r] if r < km1 else x[r - km1]
            wk = w[k]
            for c in range(channels):
                o[c] += wk[c] * src[c]
    for j in range(km1):                                      # the last kernel-1 rows of the window
        r = seq_len + j
        src = head[r] if r < km1 else x[r - km1]
        for c in range(channels):
            conv_state[c, j] = src[c]
    return out


def causal_conv1d_ref(x: np.ndarray, conv_state: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`causal_conv1d` (same contract: updates ``conv_state`` in place)."""
    km1 = conv_state.shape[1]
    window = np.concatenate([conv_state.T, x], axis=0)          # [kernel-1 + seq_len, channels]
    out = np.zeros(x.shape, dtype=np.float32)
    for k in range(km1 + 1):
        out += window[k:k + x.shape[0]] * weight[:, k]
    conv_state[:] = window[x.shape[0]:].T
    return out


def l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """``x / √(Σx² + eps)`` over the last axis of float32 ``[seq_len, n_heads, head_dim]`` (llama.cpp
    ``build_gdn_l2_norm``: an RMSNorm with ``eps/n`` scaled by ``1/√n``), into a new contiguous
    array. The sum in float64. A strided ``x`` (a slice of the conv output) is copied first: the
    kernel's loops vectorise on contiguous rows only (10x)."""
    return _l2norm(np.ascontiguousarray(x), eps)


@njit(**JIT_ATTN)
def _l2norm(x, eps):
    # JIT_ATTN's reassoc: the float64 sum in any order, vectorised (one serial chain waited on each add)
    seq_len, n_heads, d = x.shape
    out = np.empty((seq_len, n_heads, d), dtype=np.float32)
    for t in range(seq_len):
        for h in range(n_heads):
            xr, o = x[t, h], out[t, h]
            ss = 0.0
            for i in range(d):
                v = np.float64(xr[i])
                ss += v * v
            scale = np.float32(1.0 / math.sqrt(ss + eps))
            for i in range(d):
                o[i] = xr[i] * scale
    return out


def l2norm_ref(x: np.ndarray, eps: float) -> np.ndarray:
    """NumPy twin of :func:`l2norm`."""
    ss = np.sum(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x * (1.0 / np.sqrt(ss + eps)).astype(np.float32)).astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + eˣ)``, and ``x`` itself above 20, as ggml's ``ggml_compute_softplus_f32``."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# the gated delta rule: recurrent form
# ---------------------------------------------------------------------------------------------
@njit(**JIT_ATTN_PARALLEL)
def delta_rule_recurrent(q, k, v, g, beta, state):
    """The gated delta rule one token after another (decode; llama.cpp's fused GDN op).

    Args:
        q, k: float32 ``[seq_len, n_k_heads, head_dim]``, L2-normalised.
        v: float32 ``[seq_len, n_v_heads, head_dim]``.
        g: float32 ``[seq_len, n_v_heads]``, the log-decay (``gate``, ≤ 0).
        beta: float32 ``[seq_len, n_v_heads]``, the write strength (``beta_sigmoid``).
        state: float32 ``[n_v_heads, head_dim, head_dim]`` (``state[h] @ k = Sᵀk``), updated in place.

    Returns:
        float32 ``[seq_len, n_v_heads, head_dim]``: ``Sᵀq / √head_dim`` after each token's write.

    Row ``j`` of ``state[h]`` is all that output ``j`` reads and writes (``Sᵀk`` and the write
    ``k · delta_j`` are along the row), so one pass over the state per token does both halves.
    Flags: ``JIT_ATTN`` (``reassoc`` lets LLVM vectorise the ``head_dim``-long sums).
    """
    seq_len, n_k, d = q.shape
    n_v = v.shape[1]
    scale = np.float32(1.0 / math.sqrt(d))
    out = np.empty((seq_len, n_v, d), dtype=np.float32)
    for h in prange(n_v):
        hk = h % n_k
        s = state[h]
        for t in range(seq_len):
            kt, qt = k[t, hk], q[t, hk]
            decay = np.float32(math.exp(g[t, h]))
            b = beta[t, h]
            # a row j of the state at a time, read and written twice: decay and Sᵀk, write and Sᵀq
            for j in range(d):
                sj = s[j]
                acc = np.float32(0.0)
                for i in range(d):
                    sj[i] *= decay
                    acc += sj[i] * kt[i]
                delta = (v[t, h, j] - acc) * b
                acc = np.float32(0.0)
                for i in range(d):
                    sj[i] += delta * kt[i]
                    acc += sj[i] * qt[i]
                out[t, h, j] = acc * scale
    return out


def delta_rule_recurrent_ref(q, k, v, g, beta, state):
    """NumPy twin of :func:`delta_rule_recurrent` (vectorised over heads)."""
    n_k, d = q.shape[1], q.shape[2]
    n_v = v.shape[1]
    heads = np.arange(n_v) % n_k
    scale = np.float32(1.0 / math.sqrt(d))
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(q.shape[0]):
        kt, qt = k[t, heads], q[t, heads]                                   # [n_v, d]
        state *= np.exp(g[t]).astype(np.float32)[:, None, None]
        delta = (v[t] - np.einsum("hji,hi->hj", state, kt)) * beta[t][:, None]
        state += delta[:, :, None] * kt[:, None, :]
        out[t] = np.einsum("hji,hi->hj", state, qt) * scale
    return out


def delta_rule_naive(q, k, v, g, beta, state):
    """The delta rule as written in the module docstring, in float64, one head and token at a time:
    the plain reference of the tests. Returns ``(out, new_state)``, float64; ``state`` is not changed."""
    n_k, d = q.shape[1], q.shape[2]
    S = np.array(state, dtype=np.float64).transpose(0, 2, 1).copy()       # S[h, i, j]
    out = np.zeros(v.shape, dtype=np.float64)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            kk, qq = k[t, h % n_k].astype(np.float64), q[t, h % n_k].astype(np.float64)
            S[h] *= math.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - S[h].T @ kk)
            S[h] += np.outer(kk, u)
            out[t, h] = S[h].T @ qq / math.sqrt(d)
    return out, S.transpose(0, 2, 1)


# ---------------------------------------------------------------------------------------------
# the gated delta rule: chunked form (the WY representation, as llama.cpp build_delta_net_chunking)
# ---------------------------------------------------------------------------------------------
@njit(**JIT_ATTN)
def _dot(x, y):
    acc = np.float32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * y[i]
    return acc


@njit(**JIT_ATTN)
def _add_abt(a, b, out, lower):
    """``out += a bᵀ`` for float32 ``a [m, k]``, ``b [n, k]`` (contiguous rows: every entry a
    ``k``-long sum that vectorises). ``lower``: only the entries ``c ≤ r`` are needed (a few above
    are computed too). Rows and columns go in pairs: four sums share each load."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    for r in range(0, m - 1, 2):
        a0, a1 = a[r], a[r + 1]
        hi = min(r + 2, n) if lower else n
        for c in range(0, hi - 1, 2):
            b0, b1 = b[c], b[c + 1]
            s00 = np.float32(0.0)
            s01 = np.float32(0.0)
            s10 = np.float32(0.0)
            s11 = np.float32(0.0)
            for i in range(k):
                s00 += a0[i] * b0[i]
                s01 += a0[i] * b1[i]
                s10 += a1[i] * b0[i]
                s11 += a1[i] * b1[i]
            out[r, c] += s00
            out[r, c + 1] += s01
            out[r + 1, c] += s10
            out[r + 1, c + 1] += s11
        if hi % 2:
            out[r, hi - 1] += _dot(a0, b[hi - 1])
            out[r + 1, hi - 1] += _dot(a1, b[hi - 1])
    if m % 2:
        r = m - 1
        for c in range(min(r + 1, n) if lower else n):
            out[r, c] += _dot(a[r], b[c])


@njit(**JIT_ATTN_PARALLEL)
def delta_rule_chunked(q, k, v, g, beta, state, chunk=CHUNK):
    """The gated delta rule over chunks of ``chunk`` tokens: the same outputs and final state as
    :func:`delta_rule_recurrent`, from a chunk's matrix products (a prefill's form).

    Within a chunk, with ``G`` the cumulative log-decay from the chunk's start, ``S₀`` the state
    entering it, ``D[t,s] = exp(G_t − G_s)`` for ``s ≤ t`` (0 above)::

        A = strictly-lower(diag(β) K Kᵀ ⊙ D)             how earlier writes show in token t's key
        U = (I + A)⁻¹ (diag(β) V − diag(β e^G) K S₀)      every token's write u_t, one solve
        O = [diag(e^G) Q S₀ + (Q Kᵀ ⊙ D) U] / √d           reads
        S₁ = e^{G_last} S₀ + (K ⊙ e^{G_last − G})ᵀ U       the state after the chunk

    (llama.cpp ``build_delta_net_chunking``: its ``attn`` is ``(I + A)⁻¹``, ``k_cumdecay`` is
    ``(I+A)⁻¹ diag(β e^G) K``.) The solve is a unit lower-triangular forward substitution, row by
    row. One thread per value head, no BLAS (its threads, spinning beside Numba's, slowed the
    whole forward pass on 2 cores). Every product is ``X Yᵀ`` over contiguous rows
    (:func:`_add_abt`): the state as stored (``state[h] = S₀ᵀ``), the chunk's K, Q, Uᵀ and
    ``(K ⊙ e^{G_last − G})ᵀ`` copied. float32 products, float64 decays: ``G`` sums up to ``chunk``
    log-decays, and ``exp`` of a float32 sum would be off by its rounding times ``|G|``.

    Args and returns: as :func:`delta_rule_recurrent` (``state`` updated in place).
    """
    seq_len, n_k, d = q.shape
    n_v, dv = v.shape[1], v.shape[2]
    scale = np.float32(1.0 / math.sqrt(d))
    out = np.empty((seq_len, n_v, dv), dtype=np.float32)
    for h in prange(n_v):
        hk = h % n_k
        sT = state[h]                                            # S₀ᵀ [dv, d], updated in place
        for c0 in range(0, seq_len, chunk):
            n = min(chunk, seq_len - c0)
            K = np.empty((n, d), dtype=np.float32)
            Q = np.empty((n, d), dtype=np.float32)
            G = np.empty(n, dtype=np.float64)
            acc = 0.0
            for t in range(n):
                K[t] = k[c0 + t, hk]
                Q[t] = q[c0 + t, hk]
                acc += np.float64(g[c0 + t, h])
                G[t] = acc
            KS = np.zeros((n, dv), dtype=np.float32)
            _add_abt(K, sT, KS, False)                           # K S₀
            QS = np.zeros((n, dv), dtype=np.float32)
            _add_abt(Q, sT, QS, False)                           # Q S₀
            KK = np.zeros((n, n), dtype=np.float32)
            _add_abt(K, K, KK, True)                             # K Kᵀ, lower
            P = np.zeros((n, n), dtype=np.float32)
            _add_abt(Q, K, P, True)                              # Q Kᵀ, lower; ⊙ D below
            U = np.empty((n, dv), dtype=np.float32)
            for t in range(n):
                # u_t = β_t (v_t − e^{G_t} (K S₀)_t) − Σ_{s<t} A[t,s] u_s   (forward substitution)
                bt = beta[c0 + t, h]
                eg = np.float32(math.exp(G[t]))
                u, ks = U[t], KS[t]
                for j in range(dv):
                    u[j] = bt * (v[c0 + t, h, j] - eg * ks[j])
                for s in range(t):
                    a = bt * KK[t, s] * np.float32(math.exp(G[t] - G[s]))
                    us = U[s]
                    for j in range(dv):
                        u[j] -= a * us[j]
                for s in range(t + 1):
                    P[t, s] *= np.float32(math.exp(G[t] - G[s]))
                for s in range(t + 1, n):
                    P[t, s] = 0.0
            UT = np.empty((dv, n), dtype=np.float32)             # Uᵀ
            KT = np.empty((d, n), dtype=np.float32)              # (K ⊙ e^{G_last − G})ᵀ
            last = G[n - 1]
            for t in range(n):
                c = np.float32(math.exp(last - G[t]))
                for j in range(dv):
                    UT[j, t] = U[t, j]
                for i in range(d):
                    KT[i, t] = c * K[t, i]
            O = np.zeros((n, dv), dtype=np.float32)
            _add_abt(P, UT, O, False)                            # (Q Kᵀ ⊙ D) U
            for t in range(n):
                eg = np.float32(math.exp(G[t]))
                o = out[c0 + t, h]
                for j in range(dv):
                    o[j] = (eg * QS[t, j] + O[t, j]) * scale
            e_last = np.float32(math.exp(last))
            for j in range(dv):
                for i in range(d):
                    sT[j, i] *= e_last
            _add_abt(UT, KT, sT, False)                          # S₁ᵀ = e^{G_last} S₀ᵀ + Uᵀ (K ⊙ …)
    return out


def delta_rule_chunked_ref(q, k, v, g, beta, state, chunk: int = CHUNK):
    """NumPy twin of :func:`delta_rule_chunked`, the same formulas batched over heads, in float64
    (the forward substitution a row at a time for every head at once)."""
    seq_len, n_k, d = q.shape
    n_v = v.shape[1]
    heads = np.arange(n_v) % n_k
    scale = 1.0 / math.sqrt(d)
    out = np.empty(v.shape, dtype=np.float32)
    S = state.transpose(0, 2, 1).astype(np.float64)                        # [h, d_k, d_v]
    for c0 in range(0, seq_len, chunk):
        c1 = min(c0 + chunk, seq_len)
        n = c1 - c0
        Q = q[c0:c1][:, heads].transpose(1, 0, 2).astype(np.float64)       # [h, n, d]
        K = k[c0:c1][:, heads].transpose(1, 0, 2).astype(np.float64)
        V = v[c0:c1].transpose(1, 0, 2).astype(np.float64)
        b = beta[c0:c1].T.astype(np.float64)                                # [h, n]
        G = np.cumsum(g[c0:c1].T.astype(np.float64), axis=1)
        tril = np.tril(np.ones((n, n), dtype=bool))
        D = np.where(tril, np.exp(np.where(tril, G[:, :, None] - G[:, None, :], 0.0)), 0.0)
        KKt = K @ K.transpose(0, 2, 1)
        A = np.tril(b[:, :, None] * KKt * D, -1)
        U = b[:, :, None] * V - (b * np.exp(G))[:, :, None] * (K @ S)
        for t in range(1, n):                                                # forward substitution
            U[:, t] -= np.einsum("hs,hsd->hd", A[:, t, :t], U[:, :t])
        O = np.exp(G)[:, :, None] * (Q @ S) + ((Q @ K.transpose(0, 2, 1)) * D) @ U
        out[c0:c1] = (O * scale).transpose(1, 0, 2)
        S = np.exp(G[:, -1])[:, None, None] * S + (K * np.exp(G[:, -1:] - G)[:, :, None]).transpose(0, 2, 1) @ U
    state[...] = S.transpose(0, 2, 1)
    return out


def state_summary(state: np.ndarray) -> dict[str, list[float]]:
    """Per value head of a delta-rule state ``[n_v_heads, d, d]``: ``head_norm``, its Frobenius
    norm, and ``head_top_singular``, its largest singular value (how strongly the state maps one
    key direction to a value: the spectral norm). float64 lists, one entry per head."""
    s = np.asarray(state, dtype=np.float64)
    return {"head_norm": np.linalg.norm(s, axis=(1, 2)).tolist(),
            "head_top_singular": np.linalg.norm(s, ord=2, axis=(1, 2)).tolist()}
