"""Small fp32 kernels of the forward pass: RMSNorm, RoPE (pairs and NeoX halves), masks, softmax,
SiLU (and SwiGLU), GELU, soft-capping (and the exp they use), attention's products (and the
masked probabilities without the masked scores).

Each Numba kernel ``foo`` has a plain NumPy twin ``foo_ref`` with the same contract; the tests
check one against the other. Shapes follow the forward pass: ``[seq_len, dim]`` activations,
``[seq_len, n_heads, head_dim]`` per-head tensors, ``[n_heads, seq_len, kv_len]`` scores.
The big weight matmuls are :func:`llamatrace.kernels.types.registry.matmul`.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.kernels.tiles import VectorTile, prefill_lanes
from llamatrace.machine.jit import JIT_ATTN, JIT_EXACT, JIT_EXACT_PARALLEL
from llamatrace.machine.threads import crowded

# No fastmath here (jit.JIT_EXACT): its nnan/ninf flags would break the -inf of the causal mask.


# ---------------------------------------------------------------------------------------------
# exp for float32 in plain LLVM IR (Cephes expf: Cody-Waite reduction by ln 2, degree-6
# polynomial), so that loops calling it vectorise: np.exp in Numba is a libm call per element.
# ---------------------------------------------------------------------------------------------
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_EXP_LO, _EXP_HI = -87.33654, 88.72283     # exp(x) is below float32's normal range / overflows
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)


def _f32(v: float) -> ir.Constant:
    return ir.Constant(_F32, float(np.float32(v)))


@intrinsic
def exp_f32(typingctx, x):
    """``exp(x)`` of a float32, within 1 ulp of the exact value (measured over [-100, 100]; numpy's
    float32 exp: 2.4). ``x < -87.33654`` gives 0 (where exp is subnormal or 0), ``x > 88.72283``
    inf, NaN stays NaN. NumPy twin: ``np.exp``. Written in IR (rint, integer shift, bitcast for
    2**n) so that a loop of calls vectorises (3-4x on AVX2 for a 1728-element softmax)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b, x = builder, args[0]
        lo, hi = _f32(_EXP_LO), _f32(_EXP_HI)
        xc = b.select(b.fcmp_ordered("<", x, lo), lo, b.select(b.fcmp_ordered(">", x, hi), hi, x))
        rint = b.module.declare_intrinsic("llvm.rint", [_F32])
        n = b.call(rint, [b.fmul(xc, _f32(1.44269504088896341))])            # x = n ln2 + r
        r = b.fsub(b.fsub(xc, b.fmul(n, _f32(0.693359375))), b.fmul(n, _f32(-2.12194440e-4)))
        p = _f32(_EXP_POLY[0])
        for c in _EXP_POLY[1:]:
            p = b.fadd(b.fmul(p, r), _f32(c))
        p = b.fadd(b.fadd(b.fmul(b.fmul(p, r), r), r), _f32(1.0))              # e**r
        n_int = b.fptosi(n, _I32)                                             # -126..128: two
        half = b.ashr(n_int, ir.Constant(_I32, 1))                            # normal factors

        def pow2(k):
            return b.bitcast(b.shl(b.add(k, ir.Constant(_I32, 127)), ir.Constant(_I32, 23)), _F32)

        y = b.fmul(b.fmul(p, pow2(half)), pow2(b.sub(n_int, half)))
        y = b.select(b.fcmp_ordered(">", x, hi), _f32(np.inf), y)
        y = b.select(b.fcmp_ordered("<", x, lo), _f32(0.0), y)
        return b.select(b.fcmp_unordered("uno", x, x), x, y)

    return types.float32(x), codegen


# ---------------------------------------------------------------------------------------------
# RMSNorm — Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; Meta model.py RMSNorm:
#   y = x / sqrt(mean(x²) + eps) * weight
# ---------------------------------------------------------------------------------------------

@njit(**JIT_EXACT)
def rmsnorm(x, weight, eps):
    """RMSNorm each row of ``x``.

    Args:
        x: float32 ``[seq_len, dim]``.
        weight: float32 ``[dim]`` (the GGUF ``*_norm.weight``).
        eps: epsilon added to the mean square (``norm_eps``).

    Returns:
        float32 ``[seq_len, dim]``; the mean square is accumulated in float64.
    """
    seq_len, dim = x.shape
    out = np.empty((seq_len, dim), dtype=np.float32)
    for i in range(seq_len):
        ss = 0.0
        for j in range(dim):
            v = np.float64(x[i, j])
            ss += v * v
        scale = np.float32(1.0 / math.sqrt(ss / dim + eps))
        for j in range(dim):
            out[i, j] = (x[i, j] * scale) * weight[j]
    return out


def rmsnorm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """NumPy twin of :func:`rmsnorm`."""
    ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    scale = (1.0 / np.sqrt(ms + eps)).astype(np.float32)
    return ((x * scale) * weight).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding — Su et al. 2021 "RoFormer"; Meta model.py precompute_freqs_cis /
# apply_rotary_emb. GGUF's llama layout rotates ADJACENT pairs (x[2i], x[2i+1]) — the converter
# permuted Q/K rows for it; HF's rotate_half (split halves) is a different layout.
# ---------------------------------------------------------------------------------------------

def rope_frequencies(rope_dim: int, theta: float, freq_factors: np.ndarray | None = None, *,
                     freq_scale: float = 1.0, ext_factor: float = 0.0,
                     corr_dims: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """Angle per position of each rotated pair, float64 ``[rope_dim/2]``: ``theta ** (-2i / rope_dim)``,
    divided by ``freq_factors`` (GGUF ``rope_freqs.weight``, Llama 3.1's long-context scaling), then
    scaled as ggml's ``rope_yarn`` scales positions (ggml-cpu ``ops.cpp``).

    Linear scaling (``ext_factor`` 0) multiplies every angle by ``freq_scale`` (``1 / factor``).
    YaRN mixes, per pair ``i``, the interpolated angle (× ``freq_scale``) and the extrapolated
    one (unscaled): ``freq_scale·(1 − m_i) + m_i`` with ``m_i = ext_factor · ramp_i``, where
    ``ramp_i = 1 − clamp((i − low) / max(0.001, high − low), 0, 1)`` and ``(low, high) =
    corr_dims`` (:func:`rope_yarn_corr_dims`): the fast pairs below ``low`` keep their angles, the
    slow ones above ``high`` are interpolated. Since the angle is linear in the position, the mix
    is a factor per pair. The magnitude correction is :func:`rope_mscale`'s. With
    ``freq_scale`` 1 and ``ext_factor`` 0 the frequencies are the plain ones, bit for bit.
    """
    freqs = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if freq_factors is not None:
        freqs = freqs / freq_factors.astype(np.float64)
    if freq_scale != 1.0 or ext_factor != 0.0:
        low, high = (np.float32(d) for d in corr_dims)
        y = (np.arange(rope_dim // 2, dtype=np.float32) - low) / max(np.float32(0.001), high - low)
        ramp_mix = (np.float32(1) - np.clip(y, 0, 1)) * np.float32(ext_factor)     # float32, as ggml
        freqs = freqs * (freq_scale * (1.0 - ramp_mix.astype(np.float64)) + ramp_mix)
    return freqs


def rope_yarn_corr_dims(rope_dim: int, n_ctx_orig: int, theta: float, beta_fast: float,
                        beta_slow: float) -> tuple[float, float]:
    """The pairs ``(low, high)`` between which YaRN's ramp falls from extrapolation to interpolation:
    the pair that turns ``beta`` times over ``n_ctx_orig`` positions is
    ``rope_dim · ln(n_ctx_orig / (2π·beta)) / (2 ln theta)``; ``low`` is that of ``beta_fast``
    rounded down (≥ 0), ``high`` that of ``beta_slow`` rounded up (≤ rope_dim − 1). In float32,
    as ggml's ``ggml_rope_yarn_corr_dims`` (``ggml.c``), so the rounding falls where it does there.
    """
    f = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        return f(rope_dim) * np.log(f(n_ctx_orig) / (f(n_rot) * f(2) * f(math.pi))) / (f(2) * np.log(f(theta)))

    low = max(0.0, float(np.floor(corr_dim(beta_fast))))
    high = min(float(rope_dim - 1), float(np.ceil(corr_dim(beta_slow))))
    return low, high


def rope_mscale(freq_scale: float, ext_factor: float, attn_factor: float) -> float:
    """The magnitude of cos and sin: ``attn_factor``, times YaRN's ``1 + 0.1·ln(1/freq_scale)``
    when ``ext_factor`` ≠ 0 (ggml ``rope_yarn``, float32)."""
    mscale = np.float32(attn_factor)
    if ext_factor != 0.0:
        mscale *= np.float32(1) + np.float32(0.1) * np.log(np.float32(1) / np.float32(freq_scale))
    return float(mscale)


def precompute_freqs_cis(inv_freq: np.ndarray, start_pos: int, seq_len: int, mscale: float = 1.0) -> np.ndarray:
    """``freqs_cis[p, i] = mscale · exp(1j * (start_pos + p) * inv_freq[i])``.

    ``mscale`` (:func:`rope_mscale`, 1 unless the model scales its rotary embedding) multiplies the
    rotated pairs, as ggml's cos/sin cache does.

    Returns complex64 ``[seq_len, rope_dim/2]`` (the chapter's freqsCis ``{22, 64}``).
    """
    t = np.arange(start_pos, start_pos + seq_len, dtype=np.float64)
    angles = np.outer(t, inv_freq)
    freqs = np.exp(1j * angles)
    if mscale != 1.0:
        freqs = freqs * mscale
    return freqs.astype(np.complex64)


class RopeAngles:
    """:func:`precompute_freqs_cis` of ``inv_freq`` and ``mscale`` with its cos and sin, for runs of
    positions: those within one block of :attr:`BLOCK` positions are rows of the block's table,
    computed once (up to :attr:`KEEP` blocks kept, then dropped together). Each entry is computed
    on its own either way, so the rows are the bits of a call of their own; a decode step's one
    position costs a slice, not NumPy's complex exp (~50 µs a step with the caches cold after the
    matmuls)."""

    BLOCK = 256
    KEEP = 4

    def __init__(self, inv_freq: np.ndarray, mscale: float = 1.0) -> None:
        self.inv_freq, self.mscale = inv_freq, mscale
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __call__(self, start_pos: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``freqs_cis`` complex64 ``[seq_len, rope_dim/2]`` (positions ``start_pos …``; read-only when
        rows of a kept block) and its real and imaginary parts, float32 C-contiguous (not to be written)."""
        b, at = divmod(start_pos, self.BLOCK)
        if at + seq_len > self.BLOCK:
            freqs = precompute_freqs_cis(self.inv_freq, start_pos, seq_len, self.mscale)
            return freqs, np.ascontiguousarray(freqs.real), np.ascontiguousarray(freqs.imag)
        table = self._blocks.get(b)
        if table is None:
            if len(self._blocks) >= self.KEEP:
                self._blocks.clear()             # one call, safe beside another thread's forward
            freqs = precompute_freqs_cis(self.inv_freq, b * self.BLOCK, self.BLOCK, self.mscale)
            table = self._blocks[b] = (freqs, np.ascontiguousarray(freqs.real), np.ascontiguousarray(freqs.imag))
            # freqs_cis is emitted: read-only; cos and sin stay writable (a read-only argument sends a
            # Numba call through its slow type lookup, ~1 µs an array with the caches cold)
            freqs.flags.writeable = False
        return tuple(a[at:at + seq_len] for a in table)


@njit(**JIT_EXACT)
def rope(x, cos, sin):
    """Rotate adjacent pairs of every head: ``(a, b) -> (a·cos - b·sin, a·sin + b·cos)``.

    Args:
        x: float32 ``[seq_len, n_heads, head_dim]``.
        cos, sin: float32 ``[seq_len, rope_dim/2]`` (real/imag parts of ``freqs_cis``);
            dims past ``rope_dim`` are left unrotated.

    Returns:
        float32 ``[seq_len, n_heads, head_dim]`` (a new array).
    """
    seq_len, n_heads, head_dim = x.shape
    half = cos.shape[1]
    out = x.copy()
    for s in range(seq_len):
        for h in range(n_heads):
            for i in range(half):
                a = x[s, h, 2 * i]
                b = x[s, h, 2 * i + 1]
                c = cos[s, i]
                si = sin[s, i]
                out[s, h, 2 * i] = a * c - b * si
                out[s, h, 2 * i + 1] = a * si + b * c
    return out


def rope_ref(x: np.ndarray, freqs_cis: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`rope`, written as Meta's ``apply_rotary_emb`` (view pairs as complex)."""
    seq_len, n_heads, head_dim = x.shape
    rot = 2 * freqs_cis.shape[1]
    out = x.copy()
    pairs = x[..., :rot].astype(np.float32).reshape(seq_len, n_heads, rot // 2, 2)
    xc = pairs[..., 0] + 1j * pairs[..., 1]
    yc = xc * freqs_cis[:, None, :]
    out[..., :rot] = np.stack([yc.real, yc.imag], axis=-1).reshape(seq_len, n_heads, rot)
    return out.astype(np.float32)


@njit(**JIT_EXACT)
def rope_neox(x, cos, sin):
    """Rotate the two halves of every head (GPT-NeoX style, HF's ``rotate_half``): dim ``i`` pairs
    with dim ``i + rope_dim/2``: ``(a, b) -> (a·cos - b·sin, a·sin + b·cos)``.

    Args:
        x: float32 ``[seq_len, n_heads, head_dim]``.
        cos, sin: float32 ``[seq_len, rope_dim/2]``; dims past ``rope_dim`` are left unrotated.

    Returns:
        float32 ``[seq_len, n_heads, head_dim]`` (a new array).
    """
    seq_len, n_heads, head_dim = x.shape
    half = cos.shape[1]
    out = x.copy()
    for s in range(seq_len):
        for h in range(n_heads):
            for i in range(half):
                a = x[s, h, i]
                b = x[s, h, i + half]
                c = cos[s, i]
                si = sin[s, i]
                out[s, h, i] = a * c - b * si
                out[s, h, i + half] = a * si + b * c
    return out


def rope_neox_ref(x: np.ndarray, freqs_cis: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`rope_neox`, written as HF's ``q * cos + rotate_half(q) * sin``."""
    half = freqs_cis.shape[1]
    cos = np.concatenate([freqs_cis.real, freqs_cis.real], axis=-1)[:, None, :].astype(np.float32)
    sin = np.concatenate([freqs_cis.imag, freqs_cis.imag], axis=-1)[:, None, :].astype(np.float32)
    out = x.copy()
    rot = x[..., :2 * half]
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out[..., :2 * half] = rot * cos + rotated * sin
    return out.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Causal mask and softmax
# ---------------------------------------------------------------------------------------------

def causal_mask(seq_len: int, start_pos: int) -> np.ndarray:
    """Additive causal mask, float32 ``[seq_len, start_pos + seq_len]``.

    Query row ``i`` sits at absolute position ``start_pos + i`` and may attend to every cached
    key at positions ``0 .. start_pos + i``: entries past that are ``-inf``, the rest 0 (Meta's
    ``torch.hstack([zeros(seq_len, start_pos), triu(full(-inf), diagonal=1)])``).
    """
    kv_len = start_pos + seq_len
    rows = np.arange(seq_len)[:, None] + start_pos
    cols = np.arange(kv_len)[None, :]
    return np.where(cols > rows, np.float32(-np.inf), np.float32(0.0)).astype(np.float32)


def window_mask(seq_len: int, start_pos: int, window: int) -> np.ndarray:
    """Additive causal mask with a sliding window, float32 ``[seq_len, start_pos + seq_len]``.

    The query at position ``i`` sees the key at position ``p`` iff ``p <= i`` and ``i - p < window``
    (llama.cpp ``llama_hparams::is_masked_swa``, ``LLAMA_SWA_TYPE_STANDARD``; HF's sliding-window
    mask is the same): every query sees at most ``window`` keys, itself included.
    """
    kv_len = start_pos + seq_len
    if seq_len == 1:                 # a decode step's row (built every step): the keys before the window
        mask = np.zeros((1, kv_len), dtype=np.float32)
        mask[0, :max(0, start_pos - window + 1)] = -np.inf
        return mask
    rows = np.arange(seq_len)[:, None] + start_pos
    cols = np.arange(kv_len)[None, :]
    hidden = (cols > rows) | (rows - cols >= window)
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0)).astype(np.float32)


_LANES_SUM = 16
"""Partial sums (and maxima) of a softmax row: entry k goes to lane k % 16, so that the loops
vectorise without reordering a lane's own sum. One in-order float32 sum a row was a chain of
dependent adds (4 cycles each): 2.5x the time of the row's exps."""


@njit(inline="always", **JIT_EXACT)
def _lane_max(row, lo, hi, lanes):
    """max(row[lo:hi]) ignoring NaN (-inf if empty or all NaN); lanes: float32 [16] scratch."""
    lanes[:] = -np.inf
    k = lo
    while k < hi and k % _LANES_SUM:
        v = row[k]
        lanes[k % _LANES_SUM] = v if v > lanes[k % _LANES_SUM] else lanes[k % _LANES_SUM]
        k += 1
    while k + _LANES_SUM <= hi:
        for u in range(_LANES_SUM):
            v = row[k + u]
            lanes[u] = v if v > lanes[u] else lanes[u]
        k += _LANES_SUM
    while k < hi:
        v = row[k]
        lanes[k % _LANES_SUM] = v if v > lanes[k % _LANES_SUM] else lanes[k % _LANES_SUM]
        k += 1
    m = np.float32(-np.inf)
    for u in range(_LANES_SUM):
        if lanes[u] > m:
            m = lanes[u]
    return m


@njit(inline="always", **JIT_EXACT)
def _no_max_fill(row, lo, hi):
    """What a row whose :func:`_lane_max` is -inf becomes: 0 when its entries are all -inf (fully
    masked), NaN when any is NaN (a NaN query or key: as ggml's soft_max, it is not hidden)."""
    for k in range(lo, hi):
        if row[k] != row[k]:
            return np.float32(np.nan)
    return np.float32(0.0)


@njit(inline="always", **JIT_EXACT)
def _lane_sum(row, lo, hi, lanes):
    """Σ row[lo:hi]: each lane's entries (k % 16, k counted from the row's start) in order, then
    the lanes in a fixed tree. A sum over a range wider by +0 entries has the same bits (no
    partial sum of non-negative entries is -0), which is what the masked path's exp(-inf) = 0
    entries are; lanes: float32 [16] scratch."""
    lanes[:] = 0.0
    k = lo
    while k < hi and k % _LANES_SUM:
        lanes[k % _LANES_SUM] += row[k]
        k += 1
    while k + _LANES_SUM <= hi:
        for u in range(_LANES_SUM):
            lanes[u] += row[k + u]
        k += _LANES_SUM
    while k < hi:
        lanes[k % _LANES_SUM] += row[k]
        k += 1
    w = _LANES_SUM // 2
    while w:
        for u in range(w):
            lanes[u] += lanes[u + w]
        w //= 2
    return lanes[0]


@njit(inline="always", **JIT_EXACT)
def _softmax_rows(x, out, i, lanes, sinks):
    n = x.shape[2]
    sink = sinks[i] if sinks.shape[0] else np.float32(-np.inf)
    for j in range(x.shape[1]):
        row, o = x[i, j], out[i, j]
        m = max(_lane_max(row, 0, n, lanes), sink)
        if m == -np.inf:
            o[:] = _no_max_fill(row, 0, n)
            continue
        for k in range(n):
            o[k] = exp_f32(row[k] - m)
        total = _lane_sum(o, 0, n, lanes)
        if sinks.shape[0]:                    # the sink joins the denominator only
            total += exp_f32(sink - m)
        inv = np.float32(1.0) / total
        for k in range(n):
            o[k] *= inv


@njit(**JIT_EXACT)
def softmax_serial(x, sinks):
    out = np.empty_like(x)
    lanes = np.empty(_LANES_SUM, dtype=np.float32)
    for i in range(x.shape[0]):
        _softmax_rows(x, out, i, lanes, sinks)
    return out


@njit(**JIT_EXACT_PARALLEL)
def softmax_parallel(x, sinks):
    out = np.empty_like(x)
    for i in prange(x.shape[0]):
        _softmax_rows(x, out, i, np.empty(_LANES_SUM, dtype=np.float32), sinks)
    return out


_NO_SINKS = np.zeros(0, dtype=np.float32)


def _sinks(sinks: np.ndarray | None, n_heads: int) -> np.ndarray:
    """float32 ``[n_heads]`` C-contiguous, or an empty array for none; ``ValueError`` on a wrong length."""
    if sinks is None:
        return _NO_SINKS
    sinks = np.ascontiguousarray(sinks, dtype=np.float32).reshape(-1)
    if sinks.shape[0] != n_heads:
        raise ValueError(f"attention sinks: {sinks.shape[0]} values for {n_heads} heads")
    return sinks


_PARALLEL_ELEMENTS = 1 << 14
"""Softmax and SiLU run in parallel above this many elements (an exponential each)."""


def softmax(x: np.ndarray, sinks: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis of float32 ``[n_heads, seq_len, kv_len]``.

    Computed in fp32 with the row max subtracted, the row's sum in 16 lanes (:func:`_lane_sum`);
    a row that is entirely ``-inf`` (fully masked) gives zeros instead of NaN; a NaN in a row
    makes the row NaN, as in ggml. Heads run in parallel when there is enough work.

    ``sinks``: optional float32 ``[n_heads]``, one learned logit per head that joins each row's
    denominator but gets no column (gpt-oss's attention sinks; ggml-cpu's ``soft_max`` with
    ``ggml_soft_max_add_sinks``: ``max = max(max_row, sink)``, ``sum += exp(sink - max)``), so a
    row's probabilities sum to less than 1. Raises ``ValueError`` for a wrong length.
    """
    fn = softmax_parallel if x.size > _PARALLEL_ELEMENTS else softmax_serial
    return fn(np.ascontiguousarray(x), _sinks(sinks, x.shape[0]))


def softmax_ref(x: np.ndarray, sinks: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`softmax` (fully masked rows give zeros, a NaN makes its row NaN;
    ``sinks`` as there)."""
    sink = (np.full(x.shape[0], -np.inf, np.float32) if sinks is None
            else np.asarray(sinks, np.float32).reshape(-1))[:, None, None]
    masked = np.all(x == -np.inf, axis=-1, keepdims=True) & (sink == -np.inf)
    with np.errstate(invalid="ignore"):
        m = np.maximum(np.max(x, axis=-1, keepdims=True), sink)
        e = np.exp(x - np.where(masked, 0.0, m)).astype(np.float32)
        s = np.sum(e, axis=-1, keepdims=True) + np.exp(sink - np.where(masked, 0.0, m))
        return np.where(masked, 0.0, e / np.where(masked, 1.0, s)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# SiLU — Shazeer 2020, "GLU Variants Improve Transformer": FFN(x) = w2(silu(w1 x) * w3 x)
# ---------------------------------------------------------------------------------------------

@njit(error_model="numpy", inline="always", **JIT_EXACT)   # numpy's x/0: no branch, so it vectorises
def _silu_row(x, out, i):
    for j in range(x.shape[1]):
        v = x[i, j]
        out[i, j] = v / (np.float32(1.0) + exp_f32(-v))


@njit(error_model="numpy", **JIT_EXACT)
def silu_serial(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        _silu_row(x, out, i)
    return out


@njit(error_model="numpy", **JIT_EXACT_PARALLEL)
def silu_parallel(x):
    out = np.empty_like(x)
    for i in prange(x.shape[0]):
        _silu_row(x, out, i)
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` elementwise on float32 ``[seq_len, hidden_dim]`` (rows in parallel
    when there is enough work)."""
    fn = silu_parallel if x.shape[0] > 1 and x.size > _PARALLEL_ELEMENTS else silu_serial
    return fn(np.ascontiguousarray(x))


def silu_ref(x: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`silu`."""
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


@njit(error_model="numpy", inline="always", **JIT_EXACT)
def _swiglu_row(y, out, i):
    half = out.shape[1]
    for j in range(half):
        v = y[i, j]
        out[i, j] = (v / (np.float32(1.0) + exp_f32(-v))) * y[i, half + j]


@njit(error_model="numpy", **JIT_EXACT)
def swiglu_serial(y):
    out = np.empty((y.shape[0], y.shape[1] // 2), dtype=np.float32)
    for i in range(y.shape[0]):
        _swiglu_row(y, out, i)
    return out


@njit(error_model="numpy", **JIT_EXACT_PARALLEL)
def swiglu_parallel(y):
    out = np.empty((y.shape[0], y.shape[1] // 2), dtype=np.float32)
    for i in prange(y.shape[0]):
        _swiglu_row(y, out, i)
    return out


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` from the product of the stacked gate|up matrix (``w13``), without
    splitting it: the same float32 numbers as :func:`silu` of the gate half times the up half, in
    one pass over the product (no copy of either half, no SiLU array).

    Args:
        gate_up: float32 ``[seq_len, 2*hidden_dim]``, the gate's outputs then the up's in each row.

    Returns:
        float32 ``[seq_len, hidden_dim]`` (the ``ffn_swiglu`` stage).
    """
    fn = swiglu_parallel if gate_up.shape[0] > 1 and gate_up.size > _PARALLEL_ELEMENTS else swiglu_serial
    return fn(np.ascontiguousarray(gate_up))


def swiglu_ref(gate_up: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`swiglu`."""
    gate, up = np.split(gate_up, 2, axis=1)
    return (silu_ref(gate) * up).astype(np.float32)


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
"""gpt-oss's clamped SwiGLU constants (llama.cpp's ``build_moe_ffn``, ``LLM_FFN_SWIGLU_OAI_MOE``)."""


@njit(error_model="numpy", **JIT_EXACT_PARALLEL)
def _swiglu_oai(gate, up, alpha, limit, out):
    for i in prange(gate.shape[0]):
        for j in range(gate.shape[1]):
            g = min(gate[i, j], limit)
            u = min(max(up[i, j], -limit), limit)
            out[i, j] = (g / (np.float32(1.0) + exp_f32(alpha * -g))) * (u + np.float32(1.0))


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = SWIGLU_OAI_ALPHA,
               limit: float = SWIGLU_OAI_LIMIT) -> np.ndarray:
    """gpt-oss's clamped SwiGLU, as ggml-cpu's ``ggml_compute_forward_swiglu_oai_f32``: with
    ``g = min(gate, limit)`` and ``u = clamp(up, -limit, limit)``,
    ``g · sigmoid(alpha · g) · (u + 1)`` in float32 (note the ``+ 1`` on the up half).

    Args:
        gate, up: float32 ``[n, hidden]`` each.
        alpha, limit: the sigmoid's slope and the clamp (gpt-oss: 1.702 and 7).

    Returns:
        float32 ``[n, hidden]`` (the ``ffn_moe_swiglu_oai`` stage).
    """
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    up = np.ascontiguousarray(up, dtype=np.float32)
    if gate.shape != up.shape or gate.ndim != 2:
        raise ValueError(f"swiglu_oai: gate {gate.shape} and up {up.shape} must be the same [n, hidden]")
    out = np.empty_like(gate)
    _swiglu_oai(gate, up, np.float32(alpha), np.float32(limit), out)
    return out


def swiglu_oai_ref(gate: np.ndarray, up: np.ndarray, alpha: float = SWIGLU_OAI_ALPHA,
                   limit: float = SWIGLU_OAI_LIMIT) -> np.ndarray:
    """NumPy twin of :func:`swiglu_oai`."""
    g = np.minimum(gate, np.float32(limit)).astype(np.float32)
    u = np.clip(up, np.float32(-limit), np.float32(limit)).astype(np.float32)
    return (g / (np.float32(1.0) + np.exp(np.float32(alpha) * -g)) * (u + np.float32(1.0))).astype(np.float32)


_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation, elementwise on float32 (HF ``gelu_pytorch_tanh``, ggml's
    ``ggml_gelu_f32``): ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``, in float32."""
    x = np.asarray(x, dtype=np.float32)
    inner = _SQRT_2_OVER_PI * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
    # tanh in float64, rounded once: NumPy's float32 tanh is 1 ulp off near ±1 (libm's tanhf is not)
    th = np.tanh(inner.astype(np.float64)).astype(np.float32)
    return (np.float32(0.5) * x * (np.float32(1.0) + th)).astype(np.float32)


def gelu_f16_table(x: np.ndarray) -> np.ndarray:
    """GELU as llama.cpp's CPU backend computes it (``ggml_vec_gelu_f32`` / ``ggml_vec_geglu_f32``
    with ``GGML_GELU_FP16``, on by default in ``ggml-cpu/vec.h``): the input rounded to fp16, looked
    up in a table of fp16 results of :func:`gelu`; ``x <= -10`` gives 0 and ``x >= 10`` gives ``x``.
    About 1e-3 relative per element from the exact formula; used by the ``q8`` mode (llama.cpp's
    arithmetic), float32 in and out."""
    x = np.asarray(x, dtype=np.float32)
    looked_up = gelu(x.astype(np.float16).astype(np.float32)).astype(np.float16).astype(np.float32)
    return np.where(x <= -10.0, np.float32(0.0), np.where(x >= 10.0, x, looked_up)).astype(np.float32)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """Soft-capping ``cap·tanh(x/cap)`` elementwise on float32 (Gemma 2's attention and final logits):
    about ``x`` for ``|x| << cap``, never beyond ``±cap``. A new array."""
    c = np.float32(cap)
    return (np.tanh(np.asarray(x, dtype=np.float32) * (np.float32(1.0) / c)) * c).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Attention products. Our own kernels instead of np.matmul: BLAS threads spinning beside Numba's
# thread pool slowed everything ~10x on 2 cores. Keys/values may hold fewer (KV) heads than the
# queries: query head h reads KV head h // n_rep, which is what repeat_kv's copy would hold
# (Ainslie et al. 2023, "GQA"), without making the copy.
# Flags: jit.JIT_ATTN ('reassoc' for the head_dim-long sums; NaN still propagates).
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# A prefill's products (seq_len > 1), register-blocked as the weight matmuls' prefill microkernels
# (tiles.VectorTile): _gemm_block runs _GEMM_ROWS rows of A against _GEMM_COLS registers of columns
# of B, the sums in registers, each a chain of FMAs over a run of _CHAIN terms. An entry's bits
# are those of its runs whatever block it falls in, so every variant (serial, parallel, the scores
# of every key or of the keys a row sees) agrees bit for bit. q·k: 6 rows (a KV head's query
# heads at one or two positions) x 64 keys, the keys transposed into a scratch; P·V: 6 rows x 64
# of head_dim, over each row block's keys. 8B shapes (32 heads, 8 KV heads, head_dim 128, 512
# rows), one layer, 2 threads, process CPU time on a shared machine (benchmarks/bench_attention.py,
# load ~2): q·k and softmax of the seen keys 73-78 -> 27-30 ms, P·V 98-106 -> 22 ms, every key's
# q·k 99 -> 52-53 ms. The loop runs 24 FMAs to 10 loads: ~45-50 G multiply-adds/s a core in
# place (the kernel alone, its data in cache: 62).
# ---------------------------------------------------------------------------------------------
_LANES = prefill_lanes()
_GEMM_ROWS, _GEMM_COLS = (6, 4) if _LANES == 16 else (3, 3)     # 24 (zmm) / 9 (ymm) accumulators
_BLOCK = _GEMM_COLS * _LANES
"""Columns per :func:`_gemm_block` call: keys of the scores, head_dim entries of the values."""


def _gemm_ir(k, checked: bool, rows: int, cols: int, a, a_offs, a_at, b, b_at, ldb, n, c, c_offs, n_cols,
             add) -> None:
    bld, i32 = k.b, ir.IntType(32)
    mask_t = ir.VectorType(ir.IntType(1), k.lanes)
    vptr = k.vf.as_pointer()
    suffix = f"v{k.lanes}f32.p0v{k.lanes}f32"
    load_fn = bld.module.declare_intrinsic(f"llvm.masked.load.{suffix}", (),
                                           ir.FunctionType(k.vf, [vptr, i32, mask_t, k.vf]))
    store_fn = bld.module.declare_intrinsic(f"llvm.masked.store.{suffix}", (),
                                            ir.FunctionType(ir.VoidType(), [k.vf, vptr, i32, mask_t]))
    lane = ir.Constant(ir.VectorType(_I64, k.lanes), list(range(k.lanes)))
    valid = k.splat(k.i64(n_cols), ir.VectorType(_I64, k.lanes))
    masks = [bld.icmp_signed("<", bld.add(lane, k.splat(k.c64(v * k.lanes), lane.type)), valid)
             for v in range(cols)]
    zero = ir.Constant(k.vf, [0.0] * k.lanes)
    a_at = [bld.add(bld.load(bld.gep(a_offs, [k.c64(r)])), k.i64(a_at)) for r in range(rows)]
    c_at = [bld.load(bld.gep(c_offs, [k.c64(r)])) for r in range(rows)]
    b_at, ldb = k.i64(b_at), k.i64(ldb)

    def body(i, accs):
        row = bld.add(b_at, bld.mul(i, ldb))
        bv = [bld.call(load_fn, [k.ptr(b, bld.add(row, k.c64(v * k.lanes)), k.vf), ir.Constant(i32, 4),
                                 masks[v], zero]) for v in range(cols)]
        new = []
        for r in range(rows):
            ai = bld.load(bld.gep(a, [bld.add(a_at[r], i)]))
            av = k.splat(ai, k.vf)
            sums = [k.fma(av, bv[v], accs[r * cols + v]) for v in range(cols)]
            if checked:                       # a = 0 adds nothing, whatever b holds (NaN != 0 does)
                weighs = bld.fcmp_unordered("!=", ai, ir.Constant(k.f32, 0.0))
                sums = [bld.select(weighs, x, accs[r * cols + v]) for v, x in enumerate(sums)]
            new += sums
        return new

    sums = k.block_loop(k.i64(n), rows * cols, body)
    add = bld.icmp_signed("!=", k.i64(add), k.c64(0))
    ptrs = [k.ptr(c, bld.add(c_at[r], k.c64(v * k.lanes)), k.vf) for r in range(rows) for v in range(cols)]
    olds = [bld.call(load_fn, [ptr, ir.Constant(i32, 4), masks[i % cols], zero]) for i, ptr in enumerate(ptrs)]
    for i, ptr in enumerate(ptrs):        # every load before the stores: a row given twice adds once
        total = bld.select(add, bld.fadd(olds[i], sums[i]), sums[i])
        bld.call(store_fn, [total, ptr, ir.Constant(i32, 4), masks[i % cols]])


def _gemm_intrinsic(checked: bool, doc: str, rows: int = _GEMM_ROWS, cols: int = _GEMM_COLS, lanes: int = _LANES):
    def typer(typingctx, a, a_offs, a_at, b, b_at, ldb, n, c, c_offs, n_cols, add):
        arrays = (a, a_offs, b, c, c_offs)
        if not all(isinstance(x, types.Array) for x in arrays) or a_offs.dtype != types.int64 \
                or c_offs.dtype != types.int64 or not all(x.dtype == types.float32 for x in (a, b, c)):
            return None
        sig = types.void(a, a_offs, a_at, b, b_at, ldb, n, c, c_offs, n_cols, add)

        def codegen(context, builder, signature, args):
            flat = list(args)
            for i in (0, 1, 3, 7, 8):
                flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
            _gemm_ir(VectorTile(builder, lanes), checked, rows, cols, *flat)
            return context.get_dummy_value()

        return sig, codegen

    typer.__doc__ = doc
    return intrinsic(typer)


_gemm_block = _gemm_intrinsic(False, """``_gemm_block(a, a_offs, a_at, b, b_at, ldb, n, c, c_offs, n_cols, add)``:
``c[c_offs[r] + j] = (c[c_offs[r] + j] +)? Σ_{i<n} a[a_offs[r] + a_at + i] · b[b_at + i·ldb + j]``
(the old value added when ``add`` is nonzero) for the :data:`_GEMM_ROWS` rows r and columns
``j < n_cols`` (``n_cols <= _BLOCK``); a, b, c float32 C-contiguous arrays indexed flat,
a_offs and c_offs int64 ``[_GEMM_ROWS]``. The sum is one FMA chain in i order from 0 (``n``
0: zero) in registers; columns past ``n_cols`` are neither read nor written (masked loads and
stores). NumPy twins: the attention products' ``_ref``.""")
_gemm_block_checked = _gemm_intrinsic(True, """As :func:`_gemm_block`, the terms whose ``a`` is ±0 left out
(the same bits where ``b`` is finite; a NaN or inf in ``b`` reaches no row that weighs it 0).""")


_CHAIN = 32
"""Terms per FMA chain of :func:`_gemm_chained`: longer chains lose accuracy (one chain over
head_dim 128 missed the NumPy twin by 1.6e-5 relative in a softmax of scores ~10)."""


@njit(inline="always", **JIT_ATTN)
def _gemm_chained(a, a_offs, b, b_at, ldb, i0, i1, c, c_offs, n_cols, plain0, plain1):
    """:func:`_gemm_block`'s sums over i0 <= i < i1, written to c: a chain per run of
    :data:`_CHAIN` terms aligned to multiples of _CHAIN, the runs' sums added in i order. Where
    the sum starts and ends changes nothing but zero terms, so a sum over a range wider by exact
    zeros (a ± 0 is a: no sum here is -0) has the same bits. Runs not inside
    [plain0, plain1) leave out the terms whose a is 0 (:func:`_gemm_block_checked`)."""
    i = i0
    while True:
        end = min(i1, (i // _CHAIN + 1) * _CHAIN)
        if plain0 <= i and end <= plain1:
            _gemm_block(a, a_offs, i, b, b_at + i * ldb, ldb, max(0, end - i), c, c_offs, n_cols, i > i0)
        else:
            _gemm_block_checked(a, a_offs, i, b, b_at + i * ldb, ldb, max(0, end - i), c, c_offs, n_cols, i > i0)
        i = end
        if i >= i1:
            break


# ---------------------------------------------------------------------------------------------
# One query row's q·k (a decode step): the prefill's sums, register-blocked the other way round:
# keys as the rows, a register of one KV head's query heads as the columns, so the keys need no
# transposed copy (one row has too few query heads for the prefill's blocks to pay for it).
# ---------------------------------------------------------------------------------------------
_KEY_ROWS = 12
"""Keys per register block of a decode step's q·k (:func:`_scores_keys`): 12 accumulators."""


def _keys_ir(k, a, a_at, lda, n_keys, b, n, c, c_at, ldc, n_cols) -> None:
    """``c[c_at + t + j·ldc] = Σ_{i<n} a[a_at + t·lda + i] · b[i, j]`` for the keys t < n_keys and
    lanes j < n_cols (b float32 [n, lanes]): :func:`_gemm_chained`'s sums (runs of
    :data:`_CHAIN` terms, each a chain of FMAs from 0, the runs added in order), in registers for
    :data:`_KEY_ROWS` keys at a time, each key's lanes scattered to their rows of c."""
    bld, i32 = k.b, ir.IntType(32)
    mask_t = ir.VectorType(ir.IntType(1), k.lanes)
    vptr = k.vf.as_pointer()
    load_fn = bld.module.declare_intrinsic(f"llvm.masked.load.v{k.lanes}f32.p0v{k.lanes}f32", (),
                                           ir.FunctionType(k.vf, [vptr, i32, mask_t, k.vf]))
    ptrs_t = ir.VectorType(k.f32.as_pointer(), k.lanes)
    scatter_fn = bld.module.declare_intrinsic(f"llvm.masked.scatter.v{k.lanes}f32.v{k.lanes}p0f32", (),
                                              ir.FunctionType(ir.VoidType(), [k.vf, ptrs_t, i32, mask_t]))
    i64v = ir.VectorType(_I64, k.lanes)
    lane = ir.Constant(i64v, list(range(k.lanes)))
    mask = bld.icmp_signed("<", lane, k.splat(k.i64(n_cols), i64v))
    zero = ir.Constant(k.vf, [0.0] * k.lanes)
    n, chain, n_keys, lda = k.i64(n), k.c64(_CHAIN), k.i64(n_keys), k.i64(lda)
    c0 = bld.ptrtoint(bld.gep(c, [k.i64(c_at)]), _I64)
    lane_at = bld.mul(lane, k.splat(bld.mul(k.i64(ldc), k.c64(4)), i64v))    # bytes from a key's row 0 entry

    def keys(kb, _):
        t0 = bld.mul(kb, k.c64(_KEY_ROWS))
        last = bld.sub(n_keys, k.c64(1))
        ts = [bld.add(t0, k.c64(r)) for r in range(_KEY_ROWS)]
        rows = [bld.add(k.i64(a_at), bld.mul(bld.select(bld.icmp_signed("<", t, last), t, last), lda)) for t in ts]

        def run(j, totals):
            i0 = bld.mul(j, chain)
            rest = bld.sub(n, i0)

            def body(i, accs):
                d = bld.add(i0, i)
                bv = bld.call(load_fn, [k.ptr(b, bld.mul(d, k.c64(k.lanes)), k.vf), ir.Constant(i32, 4), mask, zero])
                return [k.fma(k.splat(bld.load(bld.gep(a, [bld.add(rows[r], d)])), k.vf), bv, accs[r])
                        for r in range(_KEY_ROWS)]

            sums = k.block_loop(bld.select(bld.icmp_signed("<", rest, chain), rest, chain), _KEY_ROWS, body)
            first = bld.icmp_signed("==", j, k.c64(0))
            return [bld.select(first, x, bld.fadd(tot, x)) for tot, x in zip(totals, sums)]

        totals = k.block_loop(bld.sdiv(bld.add(n, k.c64(_CHAIN - 1)), chain), _KEY_ROWS, run)
        for t, tot in zip(ts, totals):
            at = bld.add(k.splat(bld.add(c0, bld.mul(t, k.c64(4))), i64v), lane_at)
            keep = bld.and_(mask, k.splat(bld.icmp_signed("<", t, n_keys), mask_t))
            bld.call(scatter_fn, [tot, bld.inttoptr(at, ptrs_t), ir.Constant(i32, 4), keep])
        return []

    k.block_loop(bld.sdiv(bld.add(n_keys, k.c64(_KEY_ROWS - 1)), k.c64(_KEY_ROWS)), 0, keys)


def _keys_intrinsic(lanes: int):
    def typer(typingctx, a, a_at, lda, n_keys, b, n, c, c_at, ldc, n_cols):
        if not all(isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C" for x in (a, b, c)):
            return None

        def codegen(context, builder, signature, args):
            flat = list(args)
            for i in (0, 4, 6):
                flat[i] = context.make_array(signature.args[i])(context, builder, args[i]).data
            _keys_ir(VectorTile(builder, lanes), *flat)
            return context.get_dummy_value()

        return types.void(a, a_at, lda, n_keys, b, n, c, c_at, ldc, n_cols), codegen

    typer.__doc__ = f"""``_keys_block{lanes}(a, a_at, lda, n_keys, b, n, c, c_at, ldc, n_cols)``: :func:`_keys_ir`,
    {lanes} lanes; a, b, c float32 C-contiguous arrays indexed flat."""
    return intrinsic(typer)


_keys_block8, _keys_block16 = _keys_intrinsic(8), _keys_intrinsic(16)


@njit(**JIT_ATTN)
def _scores_dots(xq, keys, out, t0, t1, first_pos, window, h0, h1):
    """:func:`_scores_keys` for n_rep < 5: a dot product per (key, head), vectorised over d. Keys
    go in memory order, each row [n_kv_heads, head_dim] read once for all heads: one stream
    through the cache. (Head by head, the stride left decode waiting on DRAM: 35 -> 24 us at kv
    200 in SmolLM2.)"""
    seq_len, n_heads, head_dim = xq.shape
    n_rep = n_heads // keys.shape[1]
    for s in range(seq_len):
        pos = first_pos + s
        lo = max(t0, pos - window + 1) if window else t0
        for t in range(lo, min(t1, pos + 1)):
            for h in range(h0, h1):
                k = keys[t, h // n_rep]
                q = xq[s, h]
                acc = np.float32(0.0)
                for d in range(head_dim):
                    acc += q[d] * k[d]
                out[h, s, t] = acc


@njit(**JIT_ATTN)
def _scores_keys(xq, keys, out, t0, t1, first_pos, window, h0, h1):
    """out[h, s, t] for keys t0 <= t < t1, query heads h0 <= h < h1 (whole groups of a KV head's
    n_rep query heads), the keys query row s sees: row s sits at position first_pos + s and sees
    keys t <= first_pos + s, and with a window (> 0) only t > first_pos + s - window. Entries of
    keys it does not see are not written; first_pos >= t1 and window 0: every key.

    n_rep >= 5: each entry is the prefill's sum (runs of 32 terms of d, each a chain of FMAs:
    :func:`_scores_block`), so a decode step's scores are a prefill row's bit for bit. Register-
    blocked with the query heads in the lanes (:func:`_keys_ir`): :data:`_KEY_ROWS` keys times
    a register of 8 or 16 of one KV head's query heads (transposed once into qt), each key's
    element broadcast; chunks of :data:`_KEY_CHUNK` key rows for every KV head in turn, in memory
    order. Qwen3-30B-A3B's shape (32 heads of 128, 4 KV heads), kv 200, one core, hot: 39-56 ->
    23-32 µs (15-20 G multiply-adds/s -> 26-35; a plain dot per (key, head) ends in a 128-long
    horizontal sum). n_rep < 5 (4 lanes: no faster than the dot, ~20 G/s): :func:`_scores_dots`,
    whose order differs from the prefill's in the last bits."""
    seq_len, n_heads, head_dim = xq.shape
    kv_len, n_kv = out.shape[2], keys.shape[1]
    n_rep = n_heads // n_kv
    if n_rep < 5:
        _scores_dots(xq, keys, out, t0, t1, first_pos, window, h0, h1)
        return
    w = 8 if n_rep <= 8 else 16
    per_kv = (n_rep + w - 1) // w                  # register blocks of one KV head's query heads
    g0, n_groups = h0 // n_rep, (h1 - h0) // n_rep * per_kv
    qt = np.empty((n_groups, head_dim, w), dtype=np.float32)     # lanes past n_rep: never read
    for s in range(seq_len):
        pos = first_pos + s
        lo = max(t0, pos - window + 1) if window else t0
        hi = min(t1, pos + 1)
        for b in range(n_groups):
            h, n_cols = (g0 + b // per_kv) * n_rep + b % per_kv * w, min(w, n_rep - b % per_kv * w)
            for j in range(n_cols):
                for d in range(head_dim):
                    qt[b, d, j] = xq[s, h + j, d]
        for t in range(lo, hi, _KEY_CHUNK):        # a chunk of key rows, every KV head: one stream
            n_keys = min(_KEY_CHUNK, hi - t)
            for b in range(n_groups):
                g, j0 = g0 + b // per_kv, b % per_kv * w
                args = (keys, (t * n_kv + g) * head_dim, n_kv * head_dim, n_keys, qt[b], head_dim, out,
                        ((g * n_rep + j0) * seq_len + s) * kv_len + t, seq_len * kv_len, min(w, n_rep - j0))
                if w == 8:
                    _keys_block8(*args)
                else:
                    _keys_block16(*args)


@njit(**JIT_ATTN)
def _scores_block(xq, keys, out, g, t0, first_pos, window, kt, a_offs, c_offs):
    """Prefill scores of KV head g's query heads for keys t0 .. t0 + _BLOCK (fewer at the end),
    the rows that see one of them (_scores_keys' rule); a block's rows are written whole, keys a
    row does not see included. kt: scratch float32 [head_dim, _BLOCK] for the keys transposed."""
    seq_len, n_heads, head_dim = xq.shape
    kv_len = out.shape[2]
    n_rep = n_heads // keys.shape[1]
    n_cols = min(_BLOCK, kv_len - t0)
    for t in range(n_cols):
        for d in range(head_dim):
            kt[d, t] = keys[t0 + t, g, d]
    s0 = max(0, t0 - first_pos)
    s1 = min(seq_len, t0 + n_cols - 1 + window - first_pos) if window else seq_len
    m1 = s1 * n_rep                           # rows m = s * n_rep + j: query row s, head g*n_rep + j
    for m in range(s0 * n_rep, m1, _GEMM_ROWS):
        for r in range(_GEMM_ROWS):
            s, j = divmod(min(m + r, m1 - 1), n_rep)     # past the end: the last row again
            h = g * n_rep + j
            a_offs[r] = (s * n_heads + h) * head_dim
            c_offs[r] = (h * seq_len + s) * kv_len + t0
        _gemm_chained(xq, a_offs, kt, 0, _BLOCK, 0, head_dim, out, c_offs, n_cols, 0, head_dim)


@njit(**JIT_ATTN)
def _scores_blocks(xq, keys, out, first_pos, window, i0, i1):
    """Work items i0 .. i1 of the prefill scores: item i is KV head i // n_pairs with key blocks
    p and n_blocks-1-p (p = i % n_pairs), so that a causal triangle's items (many rows for the
    first keys, few for the last) are all alike and threads splitting the items split the work."""
    head_dim = xq.shape[2]
    n_blocks = (out.shape[2] + _BLOCK - 1) // _BLOCK
    n_pairs = (n_blocks + 1) // 2
    kt = np.empty((head_dim, _BLOCK), dtype=np.float32)
    a_offs, c_offs = np.empty(_GEMM_ROWS, dtype=np.int64), np.empty(_GEMM_ROWS, dtype=np.int64)
    for i in range(i0, i1):
        g, p = divmod(i, n_pairs)
        _scores_block(xq, keys, out, g, p * _BLOCK, first_pos, window, kt, a_offs, c_offs)
        if n_blocks - 1 - p != p:
            _scores_block(xq, keys, out, g, (n_blocks - 1 - p) * _BLOCK, first_pos, window, kt, a_offs, c_offs)


@njit(**JIT_ATTN)
def _score_items(keys, kv_len):
    """Work items of the prefill scores (:func:`_scores_blocks`)."""
    return keys.shape[1] * (((kv_len + _BLOCK - 1) // _BLOCK + 1) // 2)


@njit(**JIT_ATTN)
def _prefill_scores_serial(xq, keys, out, first_pos, window):
    _scores_blocks(xq, keys, out, first_pos, window, 0, _score_items(keys, out.shape[2]))


@njit(parallel=True, **JIT_ATTN)
def _prefill_scores_parallel(xq, keys, out, first_pos, window):
    for i in prange(_score_items(keys, out.shape[2])):
        _scores_blocks(xq, keys, out, first_pos, window, i, i + 1)


@njit(**JIT_ATTN)
def attention_scores_serial(xq, keys):
    kv_len = keys.shape[0]
    out = np.empty((xq.shape[1], xq.shape[0], kv_len), dtype=np.float32)
    if xq.shape[0] > 1:
        _prefill_scores_serial(xq, keys, out, kv_len, 0)
    else:
        _scores_keys(xq, keys, out, 0, kv_len, kv_len, 0, 0, xq.shape[1])
    return out


@njit(**JIT_ATTN)
def attention_scores_parallel(xq, keys):
    kv_len = keys.shape[0]
    out = np.empty((xq.shape[1], xq.shape[0], kv_len), dtype=np.float32)
    if xq.shape[0] > 1:
        _prefill_scores_parallel(xq, keys, out, kv_len, 0)
    else:
        _decode_scores_parallel(xq, keys, out, kv_len, 0)
    return out


@njit(parallel=True, **JIT_ATTN)
def _decode_scores_parallel(xq, keys, out, first_pos, window):
    """_scores_keys, threads splitting the keys in chunks of _KEY_CHUNK (the same bits)."""
    kv_len = keys.shape[0]
    for c in prange((kv_len + _KEY_CHUNK - 1) // _KEY_CHUNK):
        _scores_keys(xq, keys, out, c * _KEY_CHUNK, min(kv_len, (c + 1) * _KEY_CHUNK), first_pos, window, 0,
                     xq.shape[1])


_KEY_CHUNK = 3 * _KEY_ROWS
"""Keys per parallel work item of the scores (and per pass of :func:`_scores_keys` over the KV
heads): they stay in L1/L2 while every query row uses them."""


def _check_groups(n_heads: int, kv_heads: int) -> None:
    if kv_heads == 0 or n_heads % kv_heads:
        raise ValueError(f"{n_heads} query heads cannot share {kv_heads} KV heads")


def attention_scores(xq: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``kq[h, s, t] = Σ_d xq[s, h, d] · keys[t, h // n_rep, d]`` — the chapter's ``xq @ keysᵀ``.

    Args:
        xq: float32 ``[seq_len, n_heads, head_dim]`` (rotated queries).
        keys: float32 ``[kv_len, n_kv_heads, head_dim]``; ``n_kv_heads`` divides ``n_heads``
            (``n_rep = n_heads // n_kv_heads``; 1 when the KV heads are already repeated).

    Returns:
        float32 ``[n_heads, seq_len, kv_len]``, fp32 accumulation: each entry sums d in runs
        of 32, each a chain of FMAs, the runs in order (register-blocked: a prefill's keys
        transposed, ~2x the per-entry dot at 8B shapes; one row's with the query heads in the
        lanes, ``_scores_keys``), so a decode step's row is a prefill's bit for bit; except one
        row with n_rep < 5 (``n_heads // n_kv_heads``): a dot product vectorised over d, whose
        order differs in the last bits.

    Raises:
        ValueError: ``n_kv_heads`` does not divide ``n_heads``.
    """
    _check_groups(xq.shape[1], keys.shape[1])
    work = xq.shape[0] * keys.shape[0] * xq.shape[1] * xq.shape[2]
    fn = attention_scores_parallel if _threaded(xq.shape[0], work) else attention_scores_serial
    return fn(np.ascontiguousarray(xq), np.ascontiguousarray(keys))


def repeat_kv(x: np.ndarray, n_rep: int) -> np.ndarray:
    """Meta's ``repeat_kv``: ``[kv_len, n_kv_heads, head_dim]`` → ``[kv_len, n_kv_heads*n_rep, head_dim]``,
    each KV head repeated ``n_rep`` times in a row (query head h gets KV head h // n_rep)."""
    return np.repeat(x, n_rep, axis=1)


def attention_scores_ref(xq: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`attention_scores` (repeats the KV heads explicitly)."""
    keys = repeat_kv(keys, xq.shape[1] // keys.shape[1])
    return np.einsum("shd,thd->hst", xq, keys).astype(np.float32)


# The probabilities of a masked prefill without its masked scores: a causal (or sliding-window)
# mask hides half of the keys of a long chunk, whose q·k, scaling, mask add and softmax the
# unmasked path computes only to give them probability 0. attention_probs computes q·k for the
# keys each query row sees and the softmax over them, the same numbers bit for bit: the same
# sum per entry (_gemm_chained's in a prefill, _scores_keys' in a decode step); the same float32
# product by the scale; the row's max, exps and lane sums over the keys it sees (the masked
# path's exp(-inf) = 0 terms add nothing: _lane_sum); and
# the masked entries are 0 · (1 / sum), which is 0 — or NaN where the row's sum is, as there.
@njit(inline="always", **JIT_EXACT)
def _softmax_visible_rows(x, i, scale, first_pos, window, lanes, sinks):
    """In place, head i: each row's scores of the keys it sees (_scores_keys' rule) times
    ``scale``, then their softmax (with head i's sink in the denominator, if ``sinks`` has
    any); every other entry 0 · (1 / sum)."""
    n = x.shape[2]
    sink = sinks[i] if sinks.shape[0] else np.float32(-np.inf)
    for j in range(x.shape[1]):
        pos = first_pos + j
        lo = max(0, pos - window + 1) if window else 0
        hi = min(n, pos + 1)
        row = x[i, j]
        seen = row[lo:hi]                     # a view indexed from 0: its loops vectorise
        for k in range(seen.shape[0]):
            seen[k] *= scale
        m = max(_lane_max(row, lo, hi, lanes), sink)
        if m == -np.inf:                      # every key it sees is -inf: zeros (softmax's rule), or NaN
            row[:] = _no_max_fill(row, lo, hi)
            continue
        for k in range(seen.shape[0]):
            seen[k] = exp_f32(seen[k] - m)
        total = _lane_sum(row, lo, hi, lanes)
        if sinks.shape[0]:
            total += exp_f32(sink - m)
        inv = np.float32(1.0) / total
        for k in range(seen.shape[0]):
            seen[k] *= inv
        hidden = np.float32(0.0) * inv
        row[:lo] = hidden
        row[hi:] = hidden


@njit(**JIT_EXACT)
def _softmax_visible_serial(x, scale, first_pos, window, sinks):
    lanes = np.empty(_LANES_SUM, dtype=np.float32)
    for i in range(x.shape[0]):
        _softmax_visible_rows(x, i, scale, first_pos, window, lanes, sinks)


@njit(**JIT_EXACT_PARALLEL)
def _softmax_visible_parallel(x, scale, first_pos, window, sinks):
    for i in prange(x.shape[0]):
        _softmax_visible_rows(x, i, scale, first_pos, window, np.empty(_LANES_SUM, dtype=np.float32), sinks)


def attention_probs(xq: np.ndarray, keys: np.ndarray, scale: float, start_pos: int, window: int = 0,
                    parallel: bool | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """Masked attention probabilities without the masked scores:
    ``softmax(attention_scores(xq, keys) * scale + mask)``, bit for bit, with ``mask``
    :func:`causal_mask` ``(seq_len, start_pos)`` (``window`` 0) or :func:`window_mask`
    ``(seq_len, start_pos, window)``; q·k, the scaling and the exps are computed only for the
    keys each query row sees (half of them in a causal prefill from position 0).

    Args:
        xq: float32 ``[seq_len, n_heads, head_dim]`` (rotated queries at positions
            ``start_pos …``).
        keys: float32 ``[start_pos + seq_len, n_kv_heads, head_dim]``; ``n_kv_heads`` divides ``n_heads``.
        scale: the scores' factor (``1/√head_dim`` or the model's ``kq_scale``), rounded to float32.
        start_pos: position of query row 0.
        window: keys a query sees with a sliding window, itself included (0: no window).
        parallel: run the threaded variants (``None``: when there is enough work); the same
            numbers either way.
        sinks: optional float32 ``[n_heads]``, each head's sink logit in the softmax's
            denominator (:func:`softmax`).

    Returns:
        float32 ``[n_heads, seq_len, kv_len]``; entries of keys a row does not see are 0 (NaN
        in a row whose probabilities are NaN, as the masked path gives them). One difference
        from the masked path: a NaN or inf in a key reaches only the rows that see it (there, the
        hidden entries' ``nan + -inf`` made every row NaN).

    Raises:
        ValueError: ``n_kv_heads`` does not divide ``n_heads``, or ``keys`` does not hold
            ``start_pos + seq_len`` positions.
    """
    seq_len, n_heads, head_dim = xq.shape
    _check_groups(n_heads, keys.shape[1])
    kv_len = keys.shape[0]
    if kv_len != start_pos + seq_len:
        raise ValueError(f"attention_probs: {kv_len} keys for {seq_len} queries at start_pos {start_pos}")
    xq, keys = np.ascontiguousarray(xq), np.ascontiguousarray(keys)
    first_pos, window, scale = int(start_pos), int(window), np.float32(scale)
    out = np.empty((n_heads, seq_len, kv_len), dtype=np.float32)
    threads = parallel if parallel is not None else _threaded(seq_len, seq_len * kv_len * n_heads * head_dim)
    if seq_len > 1:
        (_prefill_scores_parallel if threads else _prefill_scores_serial)(xq, keys, out, first_pos, window)
    elif threads:
        _decode_scores_parallel(xq, keys, out, first_pos, window)
    else:
        _scores_keys(xq, keys, out, 0, kv_len, first_pos, window, 0, n_heads)
    sinks = _sinks(sinks, n_heads)
    if parallel if parallel is not None else out.size > _PARALLEL_ELEMENTS:
        _softmax_visible_parallel(out, scale, first_pos, window, sinks)
    else:
        _softmax_visible_serial(out, scale, first_pos, window, sinks)
    return out


def attention_probs_ref(xq: np.ndarray, keys: np.ndarray, scale: float, start_pos: int,
                        window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`attention_probs`: every score, the mask added, :func:`softmax_ref`."""
    seq_len = xq.shape[0]
    mask = window_mask(seq_len, start_pos, window) if window else causal_mask(seq_len, start_pos)
    return softmax_ref(attention_scores_ref(xq, keys) * np.float32(scale) + mask, sinks)


@njit(**JIT_ATTN)
def _nonzero_span(bits):
    """(first, last + 1) of the entries of ``bits`` (float32 bits, uint32) that are not ±0 (NaN
    is not), (n, n) if none; runs of 32 are read whole (an OR of their bits), as a causal
    prefill's rows end in long runs of zeros."""
    n = bits.shape[0]
    t = 0
    while t < n:
        if t + 32 <= n:
            any_bits = np.uint32(0)
            for u in range(32):
                any_bits |= bits[t + u]
            if not (any_bits & np.uint32(0x7FFFFFFF)):
                t += 32
                continue
        if bits[t] & np.uint32(0x7FFFFFFF):
            break
        t += 1
    e = n
    while e > t:
        if e - 32 >= t:
            any_bits = np.uint32(0)
            for u in range(32):
                any_bits |= bits[e - 32 + u]
            if not (any_bits & np.uint32(0x7FFFFFFF)):
                e -= 32
                continue
        if bits[e - 1] & np.uint32(0x7FFFFFFF):
            break
        e -= 1
    return t, e


@njit(inline="always", **JIT_ATTN)
def _rows_spans(scores, g, n_rep, m, m1):
    """(lo, hi, plain0, plain1) of the rows m .. m + _GEMM_ROWS of KV head g (past m1: the last row
    again): the union and the intersection of their spans of nonzero probabilities."""
    n_heads, seq_len, kv_len = scores.shape
    lo, hi, plain0, plain1 = kv_len, 0, 0, kv_len
    for r in range(_GEMM_ROWS):
        s, j = divmod(min(m + r, m1 - 1), n_rep)
        first, end = _nonzero_span(scores[g * n_rep + j, s].view(np.uint32))
        plain0, plain1 = max(plain0, first), min(plain1, end)
        if first < end:
            lo, hi = min(lo, first), max(hi, end)
    return lo, hi, plain0, plain1


@njit(**JIT_ATTN)
def _values_block(scores, vals, g_at, t_at, n_rep, out, g, m0, m1, a_offs, c_offs):
    """out rows m0 .. m1 of KV head g's query heads (row m = s * n_rep + j: query row s, head
    g*n_rep + j), _GEMM_ROWS at a time: each row's sum over t of scores · values in t order, over
    the keys from the block's first nonzero probability to its last (a causal prefill's masked
    keys are exact zeros, which change no bit: :func:`_gemm_chained`). Runs of keys outside some
    row's own span leave out its zero terms, so a NaN or inf value reaches only the rows that
    weigh it (as the twin's 0 · NaN would not). Value t of KV head g is
    vals.flat[g * g_at + t * t_at:][:head_dim]."""
    n_heads, seq_len, kv_len = scores.shape
    head_dim = out.shape[2]
    for m in range(m0, m1, _GEMM_ROWS):
        lo, hi, plain0, plain1 = _rows_spans(scores, g, n_rep, m, m1)
        for c0 in range(0, head_dim, _BLOCK):
            for r in range(_GEMM_ROWS):
                s, j = divmod(min(m + r, m1 - 1), n_rep)
                h = g * n_rep + j
                a_offs[r] = (h * seq_len + s) * kv_len
                c_offs[r] = (h * seq_len + s) * head_dim + c0
            _gemm_chained(scores, a_offs, vals, g * g_at + c0, t_at, lo, max(lo, hi), out, c_offs,
                          min(_BLOCK, head_dim - c0), plain0, plain1)


_HEAD_ROWS = 4
"""Query heads per register block of a decode step's P·V (:func:`_values_decode`), times
``_BLOCK`` entries of head_dim: 16 accumulators (24, as the prefill's, spilled in this loop)."""
_heads_block = _gemm_intrinsic(False, """:func:`_gemm_block` for :data:`_HEAD_ROWS` rows.""", _HEAD_ROWS)
_heads_block_checked = _gemm_intrinsic(True, """:func:`_gemm_block_checked` for :data:`_HEAD_ROWS` rows.""",
                                       _HEAD_ROWS)


@njit(**JIT_ATTN)
def _values_decode(scores, vals, out, g0, g1):
    """One query row's P·V (scores [n_heads, 1, kv_len], vals [kv_len, n_kv_heads, head_dim]), KV
    heads g0 .. g1-1, the bits of :func:`_values_blocks`: where the rows of a KV head's
    _GEMM_ROWS blocks share their spans (a decode step's rows see the same keys; they differ only
    where a probability underflowed to 0 at a span's end), the same runs of keys, plain or
    checked alike, in one pass over the keys: each run of :data:`_CHAIN` values read for every
    block of :data:`_HEAD_ROWS` heads x ``_BLOCK`` of head_dim while it is in L1. Else, and for
    n_rep < 3, :func:`_values_block`. Qwen3-30B-A3B's shape at kv 200, one core, hot: 39-41 ->
    23-24 µs (the 6-row blocks: 8 query heads took 6 + 6, and 24 accumulators spilled)."""
    n_heads, _, kv_len = scores.shape
    n_kv, head_dim = vals.shape[1], vals.shape[2]
    g_at, t_at = head_dim, n_kv * head_dim
    n_rep = n_heads // n_kv
    a_offs, c_offs = np.empty(_GEMM_ROWS, dtype=np.int64), np.empty(_GEMM_ROWS, dtype=np.int64)
    for g in range(g0, g1):
        lo, hi, plain0, plain1 = _rows_spans(scores, g, n_rep, 0, n_rep)
        alike = n_rep >= 3
        for m in range(_GEMM_ROWS, n_rep, _GEMM_ROWS):
            alike = alike and _rows_spans(scores, g, n_rep, m, n_rep) == (lo, hi, plain0, plain1)
        if not alike:
            _values_block(scores, vals, g_at, t_at, n_rep, out, g, 0, n_rep, a_offs, c_offs)
            continue
        i, i1 = lo, max(lo, hi)
        while True:                           # _gemm_chained's runs, every block of rows and columns
            end = min(i1, (i // _CHAIN + 1) * _CHAIN)
            for m in range(0, n_rep, _HEAD_ROWS):
                for c0 in range(0, head_dim, _BLOCK):
                    for r in range(_HEAD_ROWS):
                        h = g * n_rep + min(m + r, n_rep - 1)
                        a_offs[r] = h * kv_len
                        c_offs[r] = h * head_dim + c0
                    args = (scores, a_offs, i, vals, g * g_at + c0 + i * t_at, t_at, max(0, end - i), out,
                            c_offs, min(_BLOCK, head_dim - c0), i > lo)
                    if plain0 <= i and end <= plain1:
                        _heads_block(*args)
                    else:
                        _heads_block_checked(*args)
            i = end
            if i >= i1:
                break


@njit(**JIT_ATTN)
def _values_items(scores, n_kv):
    """(row blocks per KV head, work items per KV head): item p takes row blocks p and
    n_blocks-1-p, alike in a causal triangle (as :func:`_scores_blocks`'s items)."""
    n_blocks = (scores.shape[1] * (scores.shape[0] // n_kv) + _GEMM_ROWS - 1) // _GEMM_ROWS
    return n_blocks, (n_blocks + 1) // 2


@njit(**JIT_ATTN)
def _values_blocks(scores, vals, g_at, t_at, n_kv, out, i0, i1):
    n_rep = scores.shape[0] // n_kv
    n_rows = scores.shape[1] * n_rep
    n_blocks, n_pairs = _values_items(scores, n_kv)
    a_offs, c_offs = np.empty(_GEMM_ROWS, dtype=np.int64), np.empty(_GEMM_ROWS, dtype=np.int64)
    for i in range(i0, i1):
        g, p = divmod(i, n_pairs)
        for b in (p, n_blocks - 1 - p) if n_blocks - 1 - p != p else (p, -1):
            if b >= 0:
                _values_block(scores, vals, g_at, t_at, n_rep, out, g, b * _GEMM_ROWS,
                              min(n_rows, (b + 1) * _GEMM_ROWS), a_offs, c_offs)


@njit(**JIT_ATTN)
def _values_by_head(values, per_head, g):
    """per_head[g] = values[:, g]: a prefill reads each value many times, best from one block
    [kv_len, head_dim] (strided by n_kv_heads rows, a run of 32 values fell in one L1 set)."""
    for t in range(values.shape[0]):
        per_head[g, t] = values[t, g]


@njit(**JIT_ATTN)
def attention_values_serial(scores, values):
    kv_len, n_kv, head_dim = values.shape
    out = np.empty((scores.shape[0], scores.shape[1], head_dim), dtype=np.float32)
    n_items = n_kv * _values_items(scores, n_kv)[1]
    if scores.shape[1] == 1:                 # decode: each value read once, in place
        _values_decode(scores, values, out, 0, n_kv)
        return out
    per_head = np.empty((n_kv, kv_len, head_dim), dtype=np.float32)
    for g in range(n_kv):
        _values_by_head(values, per_head, g)
    _values_blocks(scores, per_head, kv_len * head_dim, head_dim, n_kv, out, 0, n_items)
    return out


@njit(parallel=True, **JIT_ATTN)
def attention_values_parallel(scores, values):
    kv_len, n_kv, head_dim = values.shape
    out = np.empty((scores.shape[0], scores.shape[1], head_dim), dtype=np.float32)
    n_items = n_kv * _values_items(scores, n_kv)[1]
    if scores.shape[1] == 1 and n_kv > 1:
        for g in prange(n_kv):
            _values_decode(scores, values, out, g, g + 1)
        return out
    if scores.shape[1] == 1:                 # one KV head: threads split its rows
        for i in prange(n_items):
            _values_blocks(scores, values, head_dim, n_kv * head_dim, n_kv, out, i, i + 1)
        return out
    per_head = np.empty((n_kv, kv_len, head_dim), dtype=np.float32)
    for g in prange(n_kv):
        _values_by_head(values, per_head, g)
    for i in prange(n_items):
        _values_blocks(scores, per_head, kv_len * head_dim, head_dim, n_kv, out, i, i + 1)
    return out


def attention_values(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``kqv[h, s, d] = Σ_t scores[h, s, t] · values[t, h // n_rep, d]`` — the chapter's ``scores @ values``.

    Args:
        scores: float32 ``[n_heads, seq_len, kv_len]`` (softmax output).
        values: float32 ``[kv_len, n_kv_heads, head_dim]``; ``n_kv_heads`` divides ``n_heads``.

    Returns:
        float32 ``[n_heads, seq_len, head_dim]``: each entry sums t in runs of 32 keys (aligned
        to multiples of 32), each a chain of FMAs, the runs in order; keys before a row's first
        nonzero score and after its last add nothing and are skipped (a causal prefill's masked
        half), and a value whose score is 0 is never read (a NaN or inf there stays out of the
        row). Prefill and decode share the register-blocked kernel's sums (6 rows x 64 of
        head_dim a call; one row: 4 query heads x 64, every block over each run of 32 values in
        turn, ``_values_decode``), so a prefill's row has the bits of the same row alone. 8B
        shapes, causal 512 rows, one layer: 98-106 -> 22 ms (process CPU time, shared machine); a
        decode step at kv 512, 0.19 -> 0.10 ms; Qwen3-30B-A3B's shape at kv 200, one core, hot:
        39-41 -> 23-24 µs (~20 -> ~35-45 G multiply-adds/s).

    Raises:
        ValueError: ``n_kv_heads`` does not divide ``n_heads``.
    """
    _check_groups(scores.shape[0], values.shape[1])
    work = scores.shape[0] * scores.shape[1] * scores.shape[2] * values.shape[2]
    fn = attention_values_parallel if _threaded(scores.shape[1], work) else attention_values_serial
    return fn(np.ascontiguousarray(scores), np.ascontiguousarray(values))


def attention_values_ref(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`attention_values` (repeats the KV heads explicitly)."""
    values = repeat_kv(values, scores.shape[0] // values.shape[1])
    return np.einsum("hst,thd->hsd", scores, values).astype(np.float32)


# A decode step's attention in one call: q·k, the softmax and P·V of one query row, KV head by KV
# head (its query heads' scores, their softmax, their values), so that one parallel region, not
# two, serves a layer and each KV head's keys and values are read by one thread. Each part is the
# separate kernels' own (_scores_keys, _softmax_visible_rows, _values_decode), so probabilities and
# outputs are theirs bit for bit. Flags: JIT_EXACT (the softmax's), the products
# keep JIT_ATTN's, compiled apart.
@njit(**JIT_EXACT)
def _decode_kv_heads(xq, keys, values, probs, out, g0, g1, scale, first_pos, window, sinks):
    """KV heads g0 .. g1-1: their query heads' scores, softmax and values."""
    n_kv = keys.shape[1]
    n_rep = xq.shape[1] // n_kv
    _scores_keys(xq, keys, probs, 0, keys.shape[0], first_pos, window, g0 * n_rep, g1 * n_rep)
    lanes = np.empty(_LANES_SUM, dtype=np.float32)
    for i in range(g0 * n_rep, g1 * n_rep):
        _softmax_visible_rows(probs, i, scale, first_pos, window, lanes, sinks)
    _values_decode(probs, values, out, g0, g1)


@njit(**JIT_EXACT)
def _decode_attention_serial(xq, keys, values, probs, out, scale, first_pos, window, sinks):
    """Every KV head at once: each key row read once for all heads (~8 % faster than head by head)."""
    _decode_kv_heads(xq, keys, values, probs, out, 0, keys.shape[1], scale, first_pos, window, sinks)


@njit(**JIT_EXACT_PARALLEL)
def _decode_attention_parallel(xq, keys, values, probs, out, scale, first_pos, window, sinks):
    for g in prange(keys.shape[1]):
        _decode_kv_heads(xq, keys, values, probs, out, g, g + 1, scale, first_pos, window, sinks)


def attention_decode(xq: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, start_pos: int,
                     window: int = 0, sinks: np.ndarray | None = None,
                     parallel: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One query row's attention: ``probs = attention_probs(xq, keys, scale, start_pos, window,
    sinks=sinks)`` and ``attention_values(probs, values)``, bit for bit, in one call (one parallel
    region over the KV heads, or none).

    Args:
        xq: float32 ``[1, n_heads, head_dim]`` (the rotated query at ``start_pos``).
        keys, values: float32 ``[start_pos + 1, n_kv_heads, head_dim]`` (the cache's rows
            ``[0, start_pos]``); ``n_kv_heads`` divides ``n_heads``.
        scale, window, sinks: as :func:`attention_probs`.
        parallel: run the KV heads on threads (``None``: with enough work); with one KV head,
            threads split the keys (:func:`attention_probs`) and the values' rows.

    Returns:
        ``probs`` float32 ``[n_heads, 1, kv_len]`` (``kq_soft_max``) and ``kqv`` float32
        ``[n_heads, 1, head_dim]``.

    Raises:
        ValueError: not one query row, ``n_kv_heads`` does not divide ``n_heads``, or ``keys`` /
            ``values`` do not hold ``start_pos + 1`` positions.
    """
    n_heads, head_dim = xq.shape[1], xq.shape[2]
    kv_len, n_kv = keys.shape[0], keys.shape[1]
    if xq.shape[0] != 1 or kv_len != start_pos + 1 or values.shape != keys.shape:
        raise ValueError(f"attention_decode: query {list(xq.shape)}, keys {list(keys.shape)} and values "
                         f"{list(values.shape)} are not one row at start_pos {start_pos}")
    _check_groups(n_heads, n_kv)
    xq, keys, values = np.ascontiguousarray(xq), np.ascontiguousarray(keys), np.ascontiguousarray(values)
    if parallel is None:
        parallel = _threaded(1, kv_len * n_heads * head_dim)
    if parallel and n_kv == 1:           # one KV head: threads split the keys instead (the two calls)
        probs = attention_probs(xq, keys, scale, start_pos, window, parallel=True, sinks=sinks)
        return probs, attention_values_parallel(probs, values)
    probs = np.empty((n_heads, 1, kv_len), dtype=np.float32)
    out = np.empty((n_heads, 1, head_dim), dtype=np.float32)
    run = _decode_attention_parallel if parallel else _decode_attention_serial
    run(xq, keys, values, probs, out, np.float32(scale), int(start_pos), int(window), _sinks(sinks, n_heads))
    return probs, out


# Below this many multiply-adds a parallel region's thread wake-up costs more than it saves.
_PARALLEL_WORK = 1 << 18
_CROWDED_DECODE_WORK = 1 << 20
"""The same for one query row (a decode step) on a crowded machine (:func:`~llamatrace.machine.threads.crowded`):
its q·k and P·V are short (40-150 µs a layer at kv 100-300, 32 heads of 128), and a region waits
for a thread another process holds for a time slice (ms). Qwen3-30B-A3B's shape (8 layers), 2
threads, whole decode steps alternating in one process: load ~2.5, kv 69-189, 76 -> 67 ms a
step (median; mean 104 -> 72) with this threshold; quiet, kv 128-232, it cost ~1 ms a step
(the threads split memory-bound sums), hence only when crowded."""


def _threaded(seq_len: int, work: int) -> bool:
    """Whether the attention products of ``seq_len`` query rows and ``work`` multiply-adds run
    their parallel variants (the same bits either way)."""
    return work > (_CROWDED_DECODE_WORK if seq_len == 1 and crowded() else _PARALLEL_WORK)
