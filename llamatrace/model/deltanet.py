"""The gated DeltaNet block: Qwen3.5's linear attention, beside softmax attention in the layer loop.

A recurrent layer (:meth:`ModelConfig.is_recurrent`) runs this block where another layer runs
softmax attention; the rest of the layer (residual, FFN) is the same. In llama.cpp's order
(``src/models/qwen35.cpp`` ``build_layer_attn_linear``, ``delta-net-base.cpp``)::

    qkv = attn_qkv · x                      linear_attn_qkv_mixed  [seq_len, conv_dim]
    z   = attn_gate · x                     z                      [seq_len, v_dim]
    β   = sigmoid(ssm_beta · x)             beta_sigmoid           [seq_len, n_v_heads]
    g   = softplus(ssm_alpha · x + ssm_dt) · ssm_a                  a_softplus, gate (≤ 0: a log-decay)
    c   = SiLU(conv1d(conv state | qkv))    conv_output_silu       (ssm_conv1d, depthwise, causal)
    q, k = L2norm(c[q]), L2norm(c[k]);  v = c[v]                    q/k/v_conv_predelta
    o, S = delta rule(q, k, v, g, β, S)     attn_output, new_state (state_predelta before)
    y   = ssm_out · (RMSNorm(o; ssm_norm) ⊙ SiLU(z))                final_output, linear_attn_out

A prefill runs the delta rule chunked, a decode step recurrent
(:mod:`llamatrace.kernels.ops.deltanet`); both give the same numbers to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamatrace.kernels.ops import deltanet as dn
from llamatrace.kernels.ops import fp32 as kernels
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import matmul
from llamatrace.model.cache import RecurrentState
from llamatrace.model.config import ModelConfig
from llamatrace.tracing.recorder import Emit, null_emit

# GGUF tensor (per block) → the name the loader uses (HF's Qwen3.5 ``linear_attn`` module names)
GGUF_NAMES = {
    "in_proj_qkv": "attn_qkv.weight",
    "in_proj_z": "attn_gate.weight",
    "in_proj_b": "ssm_beta.weight",
    "in_proj_a": "ssm_alpha.weight",
    "conv1d": "ssm_conv1d.weight",
    "dt_bias": "ssm_dt.bias",
    "A": "ssm_a",
    "ssm_norm": "ssm_norm.weight",
    "out_proj": "ssm_out.weight",
}


@dataclass
class DeltaNetWeights:
    """One gated DeltaNet block (``blk.N.attn_qkv`` / ``attn_gate`` / ``ssm_*``), matrices as
    ``[out_features, in_features]``."""

    in_proj_qkv: packing.Weight     # [conv_dim, dim]   q | k | v rows (attn_qkv)
    in_proj_z: packing.Weight       # [v_dim, dim]      the output gate z (attn_gate)
    in_proj_b: packing.Weight       # [n_v_heads, dim]  β before the sigmoid (ssm_beta)
    in_proj_a: packing.Weight       # [n_v_heads, dim]  the decay's input (ssm_alpha)
    conv1d: np.ndarray              # float32 [conv_dim, conv_kernel] (ssm_conv1d)
    dt_bias: np.ndarray             # float32 [n_v_heads] (ssm_dt.bias)
    A: np.ndarray                   # float32 [n_v_heads], −exp(A_log): negative (ssm_a)
    ssm_norm: np.ndarray            # float32 [head_dim], shared by the heads (HF: linear_attn.norm)
    out_proj: packing.Weight        # [dim, v_dim] (ssm_out)

    def matrices(self) -> tuple[packing.Weight, ...]:
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a, self.out_proj

    def vectors(self) -> tuple[np.ndarray, ...]:
        return self.conv1d, self.dt_bias, self.A, self.ssm_norm


def tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The expected shape of each DeltaNet tensor, by loader name (numpy order: ``[rows, cols]``)."""
    return {"in_proj_qkv": (c.ssm_conv_dim, c.dim), "in_proj_z": (c.ssm_v_dim, c.dim),
            "in_proj_b": (c.ssm_n_v_heads, c.dim), "in_proj_a": (c.ssm_n_v_heads, c.dim),
            "conv1d": (c.ssm_conv_dim, c.ssm_conv_kernel), "dt_bias": (c.ssm_n_v_heads,),
            "A": (c.ssm_n_v_heads,), "ssm_norm": (c.ssm_head_dim,), "out_proj": (c.dim, c.ssm_v_dim)}


def load(layer: int, matrix, vector) -> DeltaNetWeights:
    """Pack the block of ``layer``: ``matrix(name, layer)`` / ``vector(name, layer)`` are the
    loader's (:func:`llamatrace.model.llama._load_weights`), which check each tensor's presence and
    shape against :func:`tensor_shapes`."""
    return DeltaNetWeights(
        **{n: matrix(n, layer) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")},
        **{n: vector(n, layer) for n in ("conv1d", "dt_bias", "A", "ssm_norm")})


def forward(x: np.ndarray, w: DeltaNetWeights, c: ModelConfig, state: RecurrentState, layer: int,
            emit: Emit) -> np.ndarray:
    """The gated DeltaNet block on ``x`` (float32 ``[seq_len, dim]``, the ``attn_norm`` output):
    returns ``linear_attn_out`` ``[seq_len, dim]`` and advances ``state`` (conv and delta-rule
    states of ``layer``) by ``seq_len`` tokens. Stages are reported through ``emit``."""
    seq_len = x.shape[0]
    n_k, n_v, d = c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_head_dim
    # input projections: mixed q|k|v, the output gate z, β and α per value head
    qkv = emit("linear_attn_qkv_mixed", layer, matmul(x, w.in_proj_qkv))
    z = emit("z", layer, matmul(x, w.in_proj_z))
    beta = emit("beta_sigmoid", layer, sigmoid(matmul(x, w.in_proj_b)))
    # decay: g = softplus(α + dt_bias) · A, A < 0, so the state keeps exp(g) ∈ (0, 1) per token
    a = emit("a_softplus", layer, dn.softplus(matmul(x, w.in_proj_a) + w.dt_bias))
    g = emit("gate", layer, a * w.A)
    # causal depthwise conv1d over the last conv_kernel-1 inputs (the conv state) and this chunk, then SiLU
    conv = dn.causal_conv1d(np.ascontiguousarray(qkv), state.conv, w.conv1d)
    conv = emit("conv_output_silu", layer, kernels.silu(conv))
    kd = c.ssm_k_dim
    q = dn.l2norm(conv[:, :kd].reshape(seq_len, n_k, d), c.norm_eps)
    k = dn.l2norm(conv[:, kd:2 * kd].reshape(seq_len, n_k, d), c.norm_eps)
    v = np.ascontiguousarray(conv[:, 2 * kd:]).reshape(seq_len, n_v, d)
    # n_k key heads: value head h reads key head h % n_k (llama.cpp tiles them; its fused op indexes so)
    q = emit("q_conv_predelta", layer, q)
    k = emit("k_conv_predelta", layer, k)
    v = emit("v_conv_predelta", layer, v)
    # the delta rule: decay, write β·k·(v − Sᵀk), read Sᵀq/√d; chunked for a prefill, recurrent to decode
    rule = dn.delta_rule_recurrent if seq_len == 1 else dn.delta_rule_chunked
    q, k, v, g, beta = (np.ascontiguousarray(t) for t in (q, k, v, g, beta))
    if emit is null_emit:         # nothing traced or hooked: the state is updated where it lies
        o = rule(q, k, v, g, beta, state.ssm)
    else:                         # the state before and after are stages of their own (a hook may replace them)
        ssm = emit("state_predelta", layer, state.ssm.copy())
        o = rule(q, k, v, g, beta, ssm)
        o = emit("attn_output", layer, o)
        state.ssm[...] = emit("new_state", layer, ssm)
    # gated RMSNorm per head: RMSNorm(o; ssm_norm) ⊙ SiLU(z), heads merged
    normed = kernels.rmsnorm(o.reshape(seq_len * n_v, d), w.ssm_norm, c.norm_eps).reshape(seq_len, n_v * d)
    out = emit("final_output", layer, normed * kernels.silu(z))
    return emit("linear_attn_out", layer, matmul(np.ascontiguousarray(out), w.out_proj))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + e⁻ˣ)`` in float32, as ggml's ``ggml_sigmoid`` (e⁻ˣ overflowing to inf gives 0)."""
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)

