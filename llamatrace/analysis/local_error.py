"""The error a stage adds: recompute it from a recording's own inputs and compare.

A comparison of two recordings measures accumulated error: after layer 10, every stage inherits
the drift of the ten layers before it, and a stage that is 5 % off hides under it. With the model
at hand, each stage can instead be recomputed by our kernels from the inputs *the recording
itself* holds (``attn_norm`` from the previous layer's ``l_out``, ``Qcur`` from ``attn_norm`` and
``wq``, ``kq_soft_max`` from ``kq``, ...) and compared with the output the recording holds: its
*local* error, what the stage added. Done on the reference's recording it asks "do our kernels
compute what the reference computed from the same inputs?" (how the ``q8`` kernels were checked
against llama.cpp's); done on ours, "did our forward pass apply its kernels as written?".

Stages recomputed (:data:`LOCAL_STAGES`): the norms (q/k and post-norms too), the q/k/v, output
and FFN projections and biases, RoPE (Llama's), scores → softmax, the heads merge, SiLU, GELU,
SwiGLU, GeGLU, both residual adds, ``result_norm`` and ``result_output``; a mixture of experts'
router (and its bias), its softmax, each chosen expert's gate, up, their biases, SwiGLU (or
gpt-oss's clamped one) and down with its bias (the recorded choice of experts, each through the
recomputing model's expert), the weighted outputs and their sum; Qwen3.5's joint query|gate
projection and gated output, and its gated DeltaNet: the projections, β, the decay, the conv1d
(its state rebuilt from the earlier steps' rows), the L2-normalised q/k, the delta rule from the
recorded state (chunked or recurrent, as the forward pass chose), the gated norm and ``ssm_out``.
Stages that need the whole KV cache (``kq``, ``kqv``) are not: a recording holds only this step's keys.
:func:`not_recomputed` says why a stage is not.
A stage is skipped where the recording lacks one of its inputs
(llama.cpp's graph has no ``ffn_silu``; a trace limited to some layers has no ``l_out`` before
them).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from llamatrace.analysis.difference import metrics, relative_error_rows
from llamatrace.kernels.ops import deltanet as dn
from llamatrace.kernels.ops import fp32
from llamatrace.kernels.ops.moe import combine, route
from llamatrace.kernels.types.registry import matmul
from llamatrace.model.deltanet import sigmoid
from llamatrace.model.moe import expert_rows
from llamatrace.tracing.recorder import stage_key
from llamatrace.tracing.stages import SOFTMAX_ATTENTION_IDS


class _Step:
    """One step of a recording, read as ``get(stage, layer)``; the product of a fused matrix
    (``wqkv``, ``w13``) is kept for the layer's other stages that split it (one matmul, not
    three or two: the same rows of the same product)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], step: int):
        self.arrays, self.step = arrays, step
        self.products: dict[tuple[str, int], np.ndarray] = {}

    def __call__(self, stage: str, layer: int | None) -> np.ndarray:
        return self.at(self.step, stage, layer)

    def at(self, step: int, stage: str, layer: int | None) -> np.ndarray:
        """``stage`` of another step of the recording (an earlier step's rows, for a state)."""
        return np.asarray(self.arrays[stage_key(step, layer, stage)])

    def product(self, source: str, layer: int, w) -> np.ndarray:
        """``source``'s rows of ``layer`` times ``w`` (float32 ``[seq_len, w.n_out]``), computed once."""
        key = (source, layer)
        if key not in self.products:
            self.products.clear()                # one layer's product at a time
            self.products[key] = matmul(np.ascontiguousarray(self(source, layer), dtype=np.float32), w)
        return self.products[key]


def _silu_any(x: np.ndarray) -> np.ndarray:
    """SiLU of rows of any rank (the experts' ``[seq_len, k, expert_hidden_dim]``)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return fp32.silu(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def _layer_input(model, get: _Step, layer: int) -> np.ndarray:
    if layer:
        return get("l_out", layer - 1)
    x = get("inp_embd", None)                       # Gemma's √dim scale, as the forward pass applies it
    return x * np.float32(model.config.embed_scale) if model.config.embed_scale != 1.0 else x


def _norm(source: str, weight: str):
    """RMSNorm of ``source`` with the layer's ``weight`` (per head when the weight is ``[head_dim]``)."""
    def run(model, get: _Step, layer: int, pos: int) -> np.ndarray:
        w = getattr(model.weights.layers[layer], weight)
        x = np.asarray(get(source, layer), dtype=np.float32)
        rows = np.ascontiguousarray(x.reshape(-1, len(w)))
        return fp32.rmsnorm(rows, w, model.config.norm_eps).reshape(x.shape)
    return run


def _qk(model, name: str) -> str:
    """The stage feeding the q/k norm (``name`` ``Qcur``/``Kcur``): after the bias when there is one."""
    return name + "_b" if model.config.qkv_bias else name


def _split(y: np.ndarray, fused, index: int) -> np.ndarray:
    """Output ``index`` of the matrices stacked in ``fused`` (``row_splits``)."""
    start = sum(fused.row_splits[:index])
    return y[:, start:start + fused.row_splits[index]]


def _projection(weight: str, fused: str, index: int, source: str):
    """``source`` times one of the layer's matrices (``wq`` … ``w3``), fused rows split off."""
    def run(model, get: _Step, layer: int, pos: int) -> np.ndarray:
        lw = model.weights.layers[layer]
        w = getattr(lw, weight)
        if w is not None:
            return matmul(np.ascontiguousarray(get(source, layer), dtype=np.float32), w)
        w = getattr(lw, fused)
        return _split(get.product(source, layer, w), w, index)
    return run


def _rope(source: str, n_heads: str):
    def run(model, get: _Step, layer: int, pos: int) -> np.ndarray:
        c = model.config
        x = get(source, layer)
        x = np.ascontiguousarray(x.reshape(x.shape[0], getattr(c, n_heads), c.head_dim), dtype=np.float32)
        freqs = fp32.precompute_freqs_cis(model.inv_freq, pos, x.shape[0], model.rope_mscale)
        return fp32.rope(x, np.ascontiguousarray(freqs.real), np.ascontiguousarray(freqs.imag))
    return run


def _soft_max(model, get: _Step, layer: int, pos: int) -> np.ndarray:
    kq = np.asarray(get("kq", layer), dtype=np.float32)           # [n_heads, seq_len, kv_len]
    scores = kq * np.float32(1.0 / math.sqrt(model.config.head_dim))
    if kq.shape[1] > 1:
        scores = scores + fp32.causal_mask(kq.shape[1], pos)
    return fp32.softmax(np.ascontiguousarray(scores))


def _merge_heads(kqv: np.ndarray) -> np.ndarray:
    """[n_heads, seq_len, head_dim] → [seq_len, n_heads * head_dim]."""
    return kqv.transpose(1, 0, 2).reshape(kqv.shape[1], -1)


def _query_half(m, get: _Step, L: int, half: int) -> np.ndarray:
    """The query (``half`` 0) or output gate (1) rows of ``Qcur_full`` (per head: query, then gate),
    float32 ``[seq_len, n_heads * head_dim]``."""
    full = get("Qcur_full", L)
    c = m.config
    return np.ascontiguousarray(full.reshape(len(full), c.n_heads, 2, c.head_dim)[:, :, half]).reshape(len(full), -1)


def _attn_out(m, get: _Step, L: int, pos: int) -> np.ndarray:
    """``wo`` times the merged heads (gated first where the model gates them), plus ``bo``."""
    lw = m.weights.layers[L]
    x = get("attn_gated" if m.config.attn_output_gate else "kqv_out", L)
    y = matmul(np.ascontiguousarray(x, dtype=np.float32), lw.wo)
    return y + lw.bo if lw.bo is not None else y


def _dn_product(m, get: _Step, L: int, weight: str) -> np.ndarray:
    """``attn_norm`` times one of the DeltaNet's input projections."""
    return matmul(np.ascontiguousarray(get("attn_norm", L), dtype=np.float32),
                  getattr(m.weights.layers[L].deltanet, weight))


def _conv_output(m, get: _Step, L: int, pos: int) -> np.ndarray:
    """SiLU of the causal conv1d of this step's ``linear_attn_qkv_mixed`` over the conv state, the
    last ``conv_kernel-1`` rows of the earlier steps' (zeros before position 0). Raises KeyError
    (not recomputed) when the recording does not reach back to position 0."""
    w = m.weights.layers[L].deltanet.conv1d
    earlier = [get.at(step, "linear_attn_qkv_mixed", L) for step in range(get.step)]
    if pos != sum(len(x) for x in earlier):
        raise KeyError("linear_attn_qkv_mixed before the recording")
    km1 = w.shape[1] - 1
    history = np.concatenate([np.zeros((km1, w.shape[0]), np.float32), *earlier])
    state = np.ascontiguousarray(history[len(history) - km1:].T, dtype=np.float32)
    x = np.ascontiguousarray(get("linear_attn_qkv_mixed", L), dtype=np.float32)
    return fp32.silu(dn.causal_conv1d(x, state, w))


def _conv_heads(m, get: _Step, L: int, part: int) -> np.ndarray:
    """q (``part`` 0) and k (1), L2-normalised, or v (2) of ``conv_output_silu``, per head."""
    c = m.config
    conv = np.ascontiguousarray(get("conv_output_silu", L), dtype=np.float32)
    kd = c.ssm_k_dim
    if part == 2:
        return np.ascontiguousarray(conv[:, 2 * kd:]).reshape(len(conv), c.ssm_n_v_heads, c.ssm_head_dim)
    x = conv[:, part * kd:(part + 1) * kd].reshape(len(conv), c.ssm_n_k_heads, c.ssm_head_dim)
    return dn.l2norm(x, c.norm_eps)


def _delta_rule(m, get: _Step, L: int) -> tuple[np.ndarray, np.ndarray]:
    """The delta rule over the recorded q/k/v, gate and β from the recorded ``state_predelta``, by
    the forward pass's own choice of form: (``attn_output``, ``new_state``)."""
    q, k, v, g, beta = (np.ascontiguousarray(get(s, L), dtype=np.float32) for s in (
        "q_conv_predelta", "k_conv_predelta", "v_conv_predelta", "gate", "beta_sigmoid"))
    state = np.array(get("state_predelta", L), dtype=np.float32)
    rule = dn.delta_rule_recurrent if len(q) == 1 else dn.delta_rule_chunked
    return rule(q, k, v, g, beta, state), state


def _gated_norm(m, get: _Step, L: int, pos: int) -> np.ndarray:
    """RMSNorm per head of ``attn_output`` with ``ssm_norm``, times SiLU(``z``), heads merged."""
    c, w = m.config, m.weights.layers[L].deltanet
    o = np.ascontiguousarray(get("attn_output", L), dtype=np.float32)
    seq_len = len(o)
    normed = fp32.rmsnorm(o.reshape(-1, c.ssm_head_dim), w.ssm_norm, c.norm_eps).reshape(seq_len, -1)
    return normed * fp32.silu(np.ascontiguousarray(get("z", L), dtype=np.float32))


def _rows_of(fn, *xs: np.ndarray) -> np.ndarray:
    """``fn`` of float32 rows, for arrays of any rank (the experts' ``[seq_len, k, width]``)."""
    rows = [np.ascontiguousarray(x, dtype=np.float32).reshape(-1, np.shape(x)[-1]) for x in xs]
    return fn(*rows).reshape(np.shape(xs[0]))


def _expert_bias(m, get: _Step, L: int, stage: str) -> np.ndarray:
    """``stage`` (``[seq_len, k, width]``) plus each slot's expert's bias (gpt-oss's ``ggml_add_id``)."""
    mw, ids = m.weights.layers[L].moe, np.asarray(get("ffn_moe_topk", L), dtype=np.int64)
    ff = mw.expert_hidden_dim
    bias = {"ffn_moe_gate": lambda: mw.b13[:, :ff], "ffn_moe_up": lambda: mw.b13[:, ff:],
            "ffn_moe_down": lambda: mw.b2}[stage]()
    return get(stage, L) + bias[ids]


def _expert_outputs(m, get: _Step, L: int) -> np.ndarray:
    """The chosen experts' outputs ``[seq_len, k, dim]``: ``ffn_moe_down``, biased where the experts have biases."""
    down = get("ffn_moe_down_biased" if m.weights.layers[L].moe.b2 is not None else "ffn_moe_down", L)
    return down.reshape(len(get("ffn_moe_topk", L)), m.config.n_expert_used, -1)


def _weights_stage(c) -> str:
    """The stage holding the weights the experts' outputs are summed with."""
    if c.expert_weights_norm:
        return "ffn_moe_weights_norm"
    return "ffn_moe_weights_softmax" if c.expert_gating == "softmax_weight" else "ffn_moe_weights"


def _ffn_output(m, get, L: int) -> np.ndarray:
    """What the FFN adds to the residual: its output after the post-norm (Gemma), the experts' sum
    plus, for Qwen3.5-MoE, the gated shared expert (summed first, as ``model.moe`` does), or the dense FFN's."""
    c = m.config
    if c.post_norms:
        return get("ffn_post_norm", L)
    if c.n_expert:
        return get("ffn_moe_out", L) + get("ffn_shexp_gated", L) if c.shexp_hidden_dim else get("ffn_moe_out", L)
    return get("ffn_out", L)


LOCAL_STAGES: dict[str, Callable] = {
    "attn_norm": lambda m, get, L, pos: fp32.rmsnorm(np.ascontiguousarray(_layer_input(m, get, L)),
                                                     m.weights.layers[L].attention_norm, m.config.norm_eps),
    "Qcur": lambda m, get, L, pos: (_query_half(m, get, L, 0) if m.config.attn_output_gate
                                    else _projection("wq", "wqkv", 0, "attn_norm")(m, get, L, pos)),
    "Kcur": _projection("wk", "wqkv", 1, "attn_norm"),
    "Vcur": _projection("wv", "wqkv", 2, "attn_norm"),
    "Qcur_b": lambda m, get, L, pos: get("Qcur", L) + m.weights.layers[L].bq,
    "Kcur_b": lambda m, get, L, pos: get("Kcur", L) + m.weights.layers[L].bk,
    "Vcur_b": lambda m, get, L, pos: get("Vcur", L) + m.weights.layers[L].bv,
    "Qcur_normed": lambda m, get, L, pos: _norm(_qk(m, "Qcur"), "q_norm")(m, get, L, pos),
    "Kcur_normed": lambda m, get, L, pos: _norm(_qk(m, "Kcur"), "k_norm")(m, get, L, pos),
    "Qcur_rope": _rope("Qcur", "n_heads"),
    "Kcur_rope": _rope("Kcur", "n_kv_heads"),
    "kq_soft_max": _soft_max,
    "kqv_out": lambda m, get, L, pos: _merge_heads(get("kqv", L)),
    "Qcur_full": _projection("wq", "wqkv", 0, "attn_norm"),
    "gate_sigmoid": lambda m, get, L, pos: sigmoid(_query_half(m, get, L, 1)),
    "attn_gated": lambda m, get, L, pos: get("kqv_out", L) * get("gate_sigmoid", L),
    "attn_out": _attn_out,
    "attn_post_norm": _norm("attn_out", "attention_post_norm"),
    # the gated DeltaNet (model/deltanet.py's steps, from the recorded inputs and state)
    "linear_attn_qkv_mixed": lambda m, get, L, pos: _dn_product(m, get, L, "in_proj_qkv"),
    "z": lambda m, get, L, pos: _dn_product(m, get, L, "in_proj_z"),
    "beta_sigmoid": lambda m, get, L, pos: sigmoid(_dn_product(m, get, L, "in_proj_b")),
    "a_softplus": lambda m, get, L, pos: dn.softplus(_dn_product(m, get, L, "in_proj_a")
                                                     + m.weights.layers[L].deltanet.dt_bias),
    "gate": lambda m, get, L, pos: get("a_softplus", L) * m.weights.layers[L].deltanet.A,
    "conv_output_silu": _conv_output,
    "q_conv_predelta": lambda m, get, L, pos: _conv_heads(m, get, L, 0),
    "k_conv_predelta": lambda m, get, L, pos: _conv_heads(m, get, L, 1),
    "v_conv_predelta": lambda m, get, L, pos: _conv_heads(m, get, L, 2),
    "attn_output": lambda m, get, L, pos: _delta_rule(m, get, L)[0],
    "new_state": lambda m, get, L, pos: _delta_rule(m, get, L)[1],
    "final_output": _gated_norm,
    "linear_attn_out": lambda m, get, L, pos: matmul(np.ascontiguousarray(get("final_output", L), dtype=np.float32),
                                                     m.weights.layers[L].deltanet.out_proj),
    "ffn_inp": lambda m, get, L, pos: _layer_input(m, get, L) + get(
        "linear_attn_out" if m.config.is_recurrent(L) else "attn_post_norm" if m.config.post_norms else "attn_out", L),
    "ffn_norm": lambda m, get, L, pos: fp32.rmsnorm(np.ascontiguousarray(get("ffn_inp", L)),
                                                    m.weights.layers[L].ffn_norm, m.config.norm_eps),
    "ffn_gate": _projection("w1", "w13", 0, "ffn_norm"),
    "ffn_up": _projection("w3", "w13", 1, "ffn_norm"),
    "ffn_silu": lambda m, get, L, pos: fp32.silu(np.ascontiguousarray(get("ffn_gate", L), dtype=np.float32)),
    "ffn_swiglu": lambda m, get, L, pos: get("ffn_silu", L) * get("ffn_up", L),
    "ffn_gelu": lambda m, get, L, pos: (fp32.gelu_f16_table if m.activations == "q8" else fp32.gelu)(
        get("ffn_gate", L)),                         # the forward pass's choice: llama.cpp's fp16 table in q8
    "ffn_geglu": lambda m, get, L, pos: get("ffn_gelu", L) * get("ffn_up", L),
    "ffn_out": lambda m, get, L, pos: matmul(np.ascontiguousarray(
        get("ffn_geglu" if m.config.ffn_act == "gelu" else "ffn_swiglu", L), dtype=np.float32), m.weights.layers[L].w2),
    "ffn_post_norm": _norm("ffn_out", "ffn_post_norm"),
    "l_out": lambda m, get, L, pos: get("ffn_inp", L) + _ffn_output(m, get, L),
    # the mixture of experts: each chosen expert's rows through the recomputing model's expert
    "ffn_moe_logits": lambda m, get, L, pos: matmul(np.ascontiguousarray(get("ffn_norm", L), dtype=np.float32),
                                                    m.weights.layers[L].moe.router),
    "ffn_moe_logits_biased": lambda m, get, L, pos: get("ffn_moe_logits", L) + m.weights.layers[L].moe.router_b,
    "ffn_moe_probs": lambda m, get, L, pos: route(get("ffn_moe_logits" if m.weights.layers[L].moe.router_b is None
                                                      else "ffn_moe_logits_biased", L),
                                                  m.config.n_expert_used, m.config.expert_gating)[0],
    "ffn_moe_gate": lambda m, get, L, pos: expert_rows(m.weights.layers[L].moe, get("ffn_norm", L),
                                                       get("ffn_moe_topk", L), "gate"),
    "ffn_moe_up": lambda m, get, L, pos: expert_rows(m.weights.layers[L].moe, get("ffn_norm", L),
                                                     get("ffn_moe_topk", L), "up"),
    "ffn_moe_gate_biased": lambda m, get, L, pos: _expert_bias(m, get, L, "ffn_moe_gate"),
    "ffn_moe_up_biased": lambda m, get, L, pos: _expert_bias(m, get, L, "ffn_moe_up"),
    "ffn_moe_swiglu": lambda m, get, L, pos: _silu_any(get("ffn_moe_gate", L)) * get("ffn_moe_up", L),
    "ffn_moe_swiglu_oai": lambda m, get, L, pos: _rows_of(fp32.swiglu_oai, get("ffn_moe_gate_biased", L),
                                                          get("ffn_moe_up_biased", L)),
    "ffn_moe_down": lambda m, get, L, pos: expert_rows(m.weights.layers[L].moe, get(
        "ffn_moe_swiglu_oai" if m.config.expert_act == "swiglu_oai" else "ffn_moe_swiglu", L),
        get("ffn_moe_topk", L), "down"),
    "ffn_moe_down_biased": lambda m, get, L, pos: _expert_bias(m, get, L, "ffn_moe_down"),
    "ffn_moe_weighted": lambda m, get, L, pos: _expert_outputs(m, get, L) * get(_weights_stage(m.config), L)[:, :, None],
    "ffn_moe_out": lambda m, get, L, pos: combine(_expert_outputs(m, get, L), get(_weights_stage(m.config), L)),
}
"""Layer stage id → ``fn(model, get, layer, start_pos)`` recomputing it from recorded inputs."""


def not_recomputed(stage: str, c) -> str | None:
    """Why :data:`LOCAL_STAGES` has no formula for ``stage`` that holds for config ``c``, in a few
    words for a note (None: it has one). The rotary of other architectures (NeoX pairs, rotating
    the biased or normed q/k, a window's own base) and their scores (soft-caps, windows, another
    scale) are not written yet."""
    if stage in ("Qcur_rope", "Kcur_rope") and (c.rope_neox or c.qkv_bias or c.qk_norm or c.sliding_window):
        return f"the {c.arch} rotary (NeoX pairs, biased or normed q/k, a window's base) has no formula here yet"
    if stage in ("Qcur_rope", "Kcur_rope") and c.rope_scaling.longrope_ctx:
        return "LongRoPE's factors depend on the context size, which a recording does not hold"
    if stage == "kq_soft_max" and (c.attn_softcap or c.sliding_window or c.attn_scale):
        return f"the {c.arch} scores (soft-cap, window or scale) have no formula here yet"
    if stage not in LOCAL_STAGES:
        return "no formula recomputes it"
    return None


def _steps(arrays: Mapping[str, np.ndarray], start_pos: int) -> list[tuple[int, int]]:
    """(step, start_pos) of every step, from the rows of each step's ``inp_embd`` (or of layer 0's
    ``attn_norm``, for a capture that lacks the embeddings)."""
    steps, pos, step = [], start_pos, 0
    while (rows := next((arrays[k] for k in (stage_key(step, None, "inp_embd"), stage_key(step, 0, "attn_norm"))
                         if k in arrays), None)) is not None:
        steps.append((step, pos))
        pos += int(np.shape(rows)[0])
        step += 1
    return steps


def local_errors(model, arrays: Mapping[str, np.ndarray], *, start_pos: int = 0,
                 per_row: bool = False, slots: dict | None = None) -> dict[str, float | np.ndarray]:
    """Stage key → ``‖recomputed − recorded‖ / ‖recorded‖``: the recorded output against
    :data:`LOCAL_STAGES`'s recomputation from the recorded inputs (float64; only stages whose
    inputs are recorded).

    Args:
        model: the :class:`~llamatrace.model.Llama` that recomputes (its weights and activation
            mode): the recording's own model, or another one (a quantized model recomputing its
            base's stages measures the error its weights add, :mod:`llamatrace.corpus.stage_errors`).
        arrays: a recording keyed by :func:`~llamatrace.tracing.recorder.stage_key`, in our layouts
            (``trace --npz``, :func:`llamatrace.analysis.compare.llamacpp_stage_arrays`).
        start_pos: the position of step 0's first row (rows of a longer prompt, say).
        per_row: give float64 ``[seq_len]`` errors, one per row (token), instead of one number.
        slots: when given, each stage recorded as ``[seq_len, n_expert_used, width]`` (the chosen
            experts' rows) also puts its float64 ``[seq_len, n_expert_used]`` errors, one per
            (token, slot), there under its key.
    """
    out: dict[str, float | np.ndarray] = {}
    for step, pos in _steps(arrays, start_pos):
        get = _Step(arrays, step)
        for layer in range(model.config.n_layers):
            recurrent = model.config.is_recurrent(layer)
            for stage, fn in LOCAL_STAGES.items():
                key = stage_key(step, layer, stage)
                if key not in arrays or not_recomputed(stage, model.config) or (
                        recurrent and stage in SOFTMAX_ATTENTION_IDS):   # a DeltaNet layer has none of them
                    continue
                try:
                    expected = fn(model, get, layer, pos)
                except KeyError:
                    continue                     # an input is not in the recording
                recorded = np.asarray(arrays[key])
                if np.shape(expected) != recorded.shape:
                    expected = np.reshape(expected, recorded.shape)
                out[key] = relative_error_rows(expected, recorded) if per_row else metrics(expected, recorded)[0]
                if slots is not None and recorded.ndim == 3:
                    n, k, width = recorded.shape
                    slots[key] = relative_error_rows(np.reshape(expected, (n * k, width)),
                                                     recorded.reshape(n * k, width)).reshape(n, k)
    return out
