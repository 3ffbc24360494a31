"""ModelConfig: the blueprint of a model, read from GGUF ``{arch}.*`` metadata.

Names follow Meta's reference ``ModelArgs`` (dim, n_layers, n_heads, n_kv_heads, norm_eps...).
Every supported family is the Llama block plus declared features (:class:`Architecture`, one row
per ``general.architecture`` in :data:`ARCHITECTURES`); the forward pass reads the features from
the config and never the architecture's name. The values and defaults are llama.cpp's
(``src/models/<arch>.cpp``: ``load_arch_hparams``).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

import numpy as np

from llamatrace.errors import ModelFormatError, UnsupportedModelError, shown


@dataclass(frozen=True)
class Architecture:
    """What one GGUF architecture adds to the Llama block, as llama.cpp's graph for it does.

    Attributes:
        rope_neox: rotate the two halves of each head (GPT-NeoX / HF ``rotate_half``) instead of
            adjacent pairs (GGUF ``llama`` files, whose converter permuted Q/K for that).
        qkv_bias: ``attn_q.bias`` / ``attn_k.bias`` / ``attn_v.bias`` added after the projections.
            A file decides for itself (:meth:`ModelConfig.from_gguf`): llama.cpp's
            ``create_tensor_qkv`` makes them optional in every family, as it lets any file store
            q|k|v fused as one ``attn_qkv`` (``convert_hf_to_gguf.py --fuse-qkv``).
        qk_norm: per-head RMSNorm of q and k (``attn_q_norm`` / ``attn_k_norm``, ``[head_dim]``)
            before the rotary embedding.
        post_norms: RMSNorm of the attention and FFN outputs (``post_attention_norm``,
            ``post_ffw_norm``) before each residual add.
        gelu: GeGLU FFN (GELU, tanh approximation) instead of SwiGLU.
        embed_scale: embeddings multiplied by √dim.
        swa_pattern: sliding-window attention on layer ``il`` iff ``il % swa_pattern <
            swa_pattern - 1`` (llama.cpp ``set_swa_pattern``); 0 = none. The file's
            ``{arch}.attention.sliding_window_pattern`` overrides it.
        swa_default: the window when the file has no ``{arch}.attention.sliding_window``
            (0 = then no sliding window at all).
        rope_base_local: rotary base of the sliding-window layers when the file has no
            ``{arch}.rope.freq_base_swa``; ``None`` = the global base.
        rope_scale_local: rope ``freq_scale`` of the sliding-window layers (llama.cpp's
            ``rope_freq_scale_train_swa``); ``None`` = the global layers' (gemma2, and gpt-oss's
            YaRN, copy it), 1.0 = never scaled (gemma3: its linear ×8 is for global layers only).
        attn_softcap, final_softcap: the default soft-cap ``c·tanh(x/c)`` of attention scores /
            final logits (``{arch}.attn_logit_softcapping`` / ``final_logit_softcapping`` override
            it). Attention: 0 = never. Final: ``None`` = never, 0 = only if the file sets one.
        fused_qkv, fused_gate_up: q|k|v stored as one ``attn_qkv`` and gate|up as one ``ffn_up`` of
            ``2·hidden_dim`` rows (gate first), as the family's files and HF's modules hold them.
            ``fused_qkv``: a file decides for itself, as ``qkv_bias``.
        wide_query_scale_layers: the block count at which llama.cpp scales queries by
            ``1/√(dim/n_heads)`` instead of ``1/√head_dim`` (Gemma's 27B models); 0 = never.
        llamacpp_scales_q: llama.cpp's graph scales q before q·kᵀ (its ``kq`` is our
            ``kq_scaled``); read by ``compare`` only, the arithmetic is the same.
        qk_norm_flat: the q/k norm is one RMSNorm over the whole projection (``attn_q_norm``
            ``[q_dim]``, ``attn_k_norm`` ``[kv_dim]``: OLMoE) rather than per head.
        moe: the FFN is always a mixture of experts (:mod:`llamatrace.model.moe`); a ``llama``
            file is one (Mixtral) when it has ``{arch}.expert_count`` > 0, as in llama.cpp.
        expert_weights_norm: the chosen experts' weights are divided by their sum (the ``norm_w``
            llama.cpp's graph passes to ``build_moe_ffn``).
        expert_ff_key: the experts' hidden width is ``{arch}.expert_feed_forward_length``, else
            ``feed_forward_length / expert_used_count`` (qwen3moe); otherwise ``feed_forward_length``.
        expert_gating: the gating function the family's graph always uses, whatever
            ``{arch}.expert_gating_func`` says (gpt-oss: ``"softmax_weight"``); ``None`` = the key's.
        attn_sinks: one learned logit per head (``attn_sinks``) in the attention softmax's denominator.
        attn_out_bias: ``attn_output.bias`` added after the output projection.
        optional_out_bias: ``attn_output.bias`` is added when the file has it in every layer
            (llama.cpp's ``llama`` graph: ``wo_b``, not required).
        longrope_factors: when the graph reads LongRoPE's ``rope_factors_long/short.weight``
            (llama.cpp ``get_rope_factors``): ``"always"`` (``phi3``), ``"with_type"`` (``llama``:
            only with ``rope.scaling.type = longrope``, else it refuses a file holding them), or
            ``""``: never (such tensors are refused).
        moe_bias: biases on the router (``ffn_gate_inp.bias``) and the experts
            (``ffn_{gate,up,down}_exps.bias``), added after each product.
        expert_act: the experts' gated activation, ``"silu"`` (SwiGLU) or ``"swiglu_oai"`` (gpt-oss's
            clamped SwiGLU, :func:`llamatrace.kernels.ops.fp32.swiglu_oai`).
        ffn_norm_post_attention: the FFN's pre-norm is stored as ``post_attention_norm`` (gpt-oss,
            whose graph calls it ``attn_post_norm``, and Qwen3.5), not ``ffn_norm``.
        deltanet: some layers are gated DeltaNet linear attention (:mod:`llamatrace.model.deltanet`)
            instead of softmax attention: those of ``{arch}.attention.recurrent_layers``, else all
            but every ``{arch}.full_attention_interval``-th (default 4); sizes from ``{arch}.ssm.*``.
        shared_expert: beside the routed experts, a shared SwiGLU expert (``ffn_{gate,up,down}_shexp``,
            width ``{arch}.expert_shared_feed_forward_length``, else ``feed_forward_length``) scaled
            per token by sigmoid(``ffn_gate_inp_shexp``·x) and added to ``ffn_moe_out`` (qwen35moe).
        attn_output_gate: ``attn_q`` yields per head the query then a gate (``Qcur_full``, twice
            the rows); the attention output is multiplied by sigmoid(gate) before ``attn_output``.
    """

    rope_neox: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    gelu: bool = False
    embed_scale: bool = False
    swa_pattern: int = 0
    swa_default: int = 0
    rope_base_local: float | None = None
    rope_scale_local: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float | None = None
    fused_qkv: bool = False
    fused_gate_up: bool = False
    wide_query_scale_layers: int = 0
    llamacpp_scales_q: bool = False
    qk_norm_flat: bool = False
    moe: bool = False
    expert_weights_norm: bool = False
    expert_ff_key: bool = False
    expert_gating: str | None = None
    attn_sinks: bool = False
    attn_out_bias: bool = False
    optional_out_bias: bool = False
    longrope_factors: str = ""
    moe_bias: bool = False
    expert_act: str = "silu"
    deltanet: bool = False
    attn_output_gate: bool = False
    ffn_norm_post_attention: bool = False
    shared_expert: bool = False


# One row per family; llama.cpp's src/models/<arch>.cpp is the reference for each.
ARCHITECTURES: dict[str, Architecture] = {
    # Mixtral, when the file has experts; llama.cpp's graphs fix the gating of llama, qwen3moe, olmoe
    "llama": Architecture(expert_weights_norm=True, expert_gating="softmax", optional_out_bias=True,
                          longrope_factors="with_type"),
    "qwen2": Architecture(rope_neox=True, qkv_bias=True),
    "qwen3": Architecture(rope_neox=True, qk_norm=True),
    # llama.cpp ignores phi3's attention.sliding_window ("Phi SWA is currently disabled"), so do we
    "phi3": Architecture(rope_neox=True, fused_qkv=True, fused_gate_up=True, llamacpp_scales_q=True,
                         longrope_factors="always"),
    "gemma2": Architecture(rope_neox=True, post_norms=True, gelu=True, embed_scale=True, swa_pattern=2,
                           swa_default=4096, attn_softcap=50.0, final_softcap=30.0, wide_query_scale_layers=46,
                           llamacpp_scales_q=True),
    "gemma3": Architecture(rope_neox=True, qk_norm=True, post_norms=True, gelu=True, embed_scale=True,
                           swa_pattern=6, rope_base_local=10000.0, rope_scale_local=1.0, final_softcap=0.0, wide_query_scale_layers=62,
                           llamacpp_scales_q=True),
    "qwen3moe": Architecture(rope_neox=True, qk_norm=True, moe=True, expert_weights_norm=True, expert_ff_key=True,
                             expert_gating="softmax"),
    "olmoe": Architecture(rope_neox=True, qk_norm=True, qk_norm_flat=True, moe=True, expert_gating="softmax"),
    # llama.cpp's openai-moe.cpp (LLM_ARCH_OPENAI_MOE): sliding window on even layers, YaRN on all
    "gpt-oss": Architecture(rope_neox=True, qkv_bias=True, swa_pattern=2, moe=True, expert_ff_key=True,
                            expert_gating="softmax_weight", attn_sinks=True, attn_out_bias=True, moe_bias=True,
                            expert_act="swiglu_oai", ffn_norm_post_attention=True),
    # qwen35.cpp: 3 of 4 layers gated DeltaNet; full attention gated, interleaved M-RoPE by sections
    "qwen35": Architecture(rope_neox=True, qk_norm=True, deltanet=True, attn_output_gate=True,
                           ffn_norm_post_attention=True),
    # qwen35moe.cpp: qwen35's layers with build_moe_ffn (softmax, norm_w; expert_weights_scale is
    # never read, so never applied) plus a sigmoid-gated shared expert
    "qwen35moe": Architecture(rope_neox=True, qk_norm=True, deltanet=True, attn_output_gate=True,
                              ffn_norm_post_attention=True, moe=True, expert_weights_norm=True,
                              expert_ff_key=True, expert_gating="softmax", shared_expert=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

EXPERT_ACTS = ("silu", "swiglu_oai")
"""The experts' gated activations llamatrace runs (:attr:`Architecture.expert_act`)."""

EXPERT_GATING_FUNCS = {1: "softmax", 3: "softmax_weight"}
LLAMACPP_GATING_FUNCS = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}
"""llama.cpp 0.3.36's ``llama_expert_gating_func_type`` values (``{arch}.expert_gating_func``)."""
"""``{arch}.expert_gating_func`` values llamatrace runs (llama.cpp's ``llama_expert_gating_func_type``:
1 softmax over every expert, 3 softmax over the chosen experts' logits); without the key, softmax."""

ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
"""The ``{arch}.rope.scaling.type`` values llamatrace runs (llama.cpp's). ``longrope`` scales as
``linear`` does (llama.cpp's ``ext_factor`` is 0 for it); what makes a file LongRoPE is its
``rope_factors_long/short`` tensors (:attr:`RopeScaling.longrope_ctx`)."""


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling as llama.cpp applies it: the arguments of ``ggml_rope_ext`` besides the base and
    the rotated dims, resolved from the file as ``llama_model::load_hparams`` and the
    ``llama_context`` constructor resolve them (with no runtime overrides). The default is no scaling.

    Attributes:
        type: ``{arch}.rope.scaling.type``: ``"linear"``, ``"yarn"``, ``"longrope"`` (a file with
            LongRoPE factors, whatever its key says: Phi-3's converter writes none), or ``"none"`` (also for a
            ``linear`` file whose factor is 1 or absent: nothing is scaled).
        freq_scale: positions are multiplied by it on the global layers:
            ``1 / {arch}.rope.scaling.factor`` (or the older ``rope.scale_linear``; 0 or absent: 1).
        freq_scale_local: the same on the sliding-window layers (:attr:`Architecture.rope_scale_local`;
            1.0 when there are none).
        ext_factor: YaRN's weight of the extrapolated angles on its ramp: 1 for ``yarn``, else 0.
        attn_factor: the magnitude of cos and sin, before YaRN's own ``1 + 0.1·ln(1/freq_scale)``:
            ``{arch}.rope.scaling.attn_factor`` (any type), for ``yarn`` times llama.cpp's
            ``get_mscale(factor) / (1 + 0.1·ln factor)`` (≈ 1), float32 as there.
        beta_fast, beta_slow: the rotation counts over ``n_ctx_orig`` at which YaRN's ramp starts and
            ends (llama.cpp's 32 and 1: it reads ``rope.scaling.yarn_beta_*`` only for grok and
            mistral3, which llamatrace does not run).
        n_ctx_orig: the context before scaling, for YaRN's ramp:
            ``{arch}.rope.scaling.original_context_length``, else ``context_length``; 0 when
            ``ext_factor`` is 0 (unused).
        longrope_ctx: LongRoPE (Phi-3's 128k variants, Phi-3.5, Phi-4-mini): each rotated pair's
            angle is divided by a factor of ``rope_factors_long.weight`` when the context size (the
            KV cache's positions) is above this many, else of ``rope_factors_short.weight``
            (llama.cpp ``get_rope_factors``: ``n_ctx_seq > n_ctx_orig_yarn``, the file's
            ``rope.scaling.original_context_length``, else ``context_length``); 0: no such factors.
            They apply beside the other scalings, as in llama.cpp (``type`` stays ``"yarn"``).
    """

    type: str = "none"
    freq_scale: float = 1.0
    freq_scale_local: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    longrope_ctx: int = 0

    def __post_init__(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise ModelFormatError(f"model config: rope scaling type must be one of {ROPE_SCALING_TYPES}, "
                                   f"got {self.type!r}")
        numbers = (self.freq_scale, self.freq_scale_local, self.attn_factor, self.beta_fast, self.beta_slow)
        if not all(math.isfinite(v) and v > 0 for v in numbers) or not math.isfinite(self.ext_factor):
            raise ModelFormatError(f"model config: rope scaling {self} needs positive finite scales, factors "
                                   f"and betas")
        if self.ext_factor != 0.0 and self.n_ctx_orig <= 0:
            raise ModelFormatError(f"model config: YaRN needs n_ctx_orig > 0, got {self.n_ctx_orig}")
        if self.longrope_ctx < 0 or (self.type == "longrope" and self.longrope_ctx == 0):
            raise ModelFormatError(f"model config: type 'longrope' goes with longrope_ctx > 0, got {self}")

    def to_dict(self) -> dict[str, Any]:
        """``type`` and the fields that differ from no scaling."""
        out = asdict(self)
        return {"type": self.type} | {f.name: out[f.name] for f in fields(self)
                                      if f.name != "type" and out[f.name] != f.default}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a model: the Llama ones, then the features its architecture declares.

    Attributes:
        dim: embedding width (``llama.embedding_length``), e.g. 576 for SmolLM2-135M.
        n_layers: transformer blocks (``llama.block_count``).
        n_heads: query heads (``llama.attention.head_count``).
        n_kv_heads: key/value heads (``llama.attention.head_count_kv``); < n_heads means
            grouped-query attention with ``n_rep = n_heads // n_kv_heads``.
        head_dim: width of one head (``llama.attention.key_length`` or ``dim // n_heads``).
        hidden_dim: SwiGLU inner width (``llama.feed_forward_length``).
        vocab_size: rows of ``token_embd.weight``.
        norm_eps: RMSNorm epsilon (``llama.attention.layer_norm_rms_epsilon``).
        rope_theta: RoPE base frequency (``llama.rope.freq_base``, default 10000).
        rope_dim: rotated dimensions per head (``llama.rope.dimension_count``, default head_dim).
        max_seq_len: the model's context length (``llama.context_length``), in tokens.
        arch: ``general.architecture``; the features below come from its :class:`Architecture`
            row and the file's metadata, and default to plain Llama.
        rope_neox, qkv_bias, qk_norm, post_norms, fused_qkv, fused_gate_up: as in
            :class:`Architecture`.
        ffn_act: ``"silu"`` (SwiGLU) or ``"gelu"`` (GeGLU, tanh approximation).
        embed_scale: factor applied to the embedding rows (1.0, or float32 √dim for Gemma).
        attn_scale: factor of q·kᵀ (``0.0`` = ``1/√head_dim``; see :attr:`kq_scale`).
        sliding_window: keys visible to a query on a local layer (``i - p < sliding_window``,
            llama.cpp ``is_masked_swa``); 0 = no sliding window.
        local_layers: the sliding-window layers, ascending.
        rope_theta_local: rotary base of the local layers (0.0 = ``rope_theta``).
        rope_scaling: how positions are scaled before the rotation (:class:`RopeScaling`).
        attn_softcap, final_softcap: ``c`` of ``c·tanh(x/c)`` on scores / logits; 0.0 = none.
        qk_norm_flat: as in :class:`Architecture`.
        n_expert: experts per MoE layer (``{arch}.expert_count``); 0 = a dense FFN.
        n_expert_used: experts chosen per token (``{arch}.expert_used_count``), ``1 … n_expert``.
        expert_hidden_dim: an expert's SwiGLU inner width (rows of ``ffn_gate_exps`` per expert).
        expert_gating: ``"softmax"`` (over every expert) or ``"softmax_weight"`` (over the
            chosen experts' logits) — :data:`EXPERT_GATING_FUNCS`.
        expert_weights_norm: the chosen weights are divided by their sum.
        attn_sinks, attn_out_bias, moe_bias, expert_act, ffn_norm_post_attention: as in
            :class:`Architecture` (gpt-oss).
        attn_output_gate: as in :class:`Architecture` (Qwen3.5).
        shexp_hidden_dim: the shared expert's SwiGLU width; 0 = no shared expert (qwen35moe's
            :attr:`Architecture.shared_expert`).
        rope_sections: ``{arch}.rope.dimension_sections`` (interleaved M-RoPE, llama.cpp's IMROPE):
            for text every section carries the token's position but the fourth (extra) one,
            which carries 0, so its rotary pairs are not rotated (:func:`imrope_text_rotated`).
        recurrent_layers: the gated DeltaNet layers, ascending (the others are full attention).
        ssm_conv_kernel: taps of the causal conv1d (``{arch}.ssm.conv_kernel``).
        ssm_head_dim: width of a DeltaNet key / value head (``{arch}.ssm.state_size``).
        ssm_n_k_heads: query/key heads (``{arch}.ssm.group_count``).
        ssm_n_v_heads: value heads (``{arch}.ssm.time_step_rank``), a multiple of ssm_n_k_heads;
            the state is ``[ssm_n_v_heads, ssm_head_dim, ssm_head_dim]`` per recurrent layer.
        n_mtp_layers: multi-token-prediction blocks after the trunk (``{arch}.nextn_predict_layers``),
            counted in ``block_count`` but not in ``n_layers``; never run, as llama.cpp's main pass.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_dim: int
    max_seq_len: int
    arch: str = "llama"
    rope_neox: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    ffn_act: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float = 0.0
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()
    rope_theta_local: float = 0.0
    rope_scaling: RopeScaling = RopeScaling()
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    qk_norm_flat: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    expert_hidden_dim: int = 0
    expert_gating: str = "softmax"
    expert_weights_norm: bool = False
    attn_sinks: bool = False
    attn_out_bias: bool = False
    moe_bias: bool = False
    expert_act: str = "silu"
    shexp_hidden_dim: int = 0
    ffn_norm_post_attention: bool = False
    attn_output_gate: bool = False
    rope_sections: tuple[int, ...] = ()
    recurrent_layers: tuple[int, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_head_dim: int = 0
    ssm_n_k_heads: int = 0
    ssm_n_v_heads: int = 0
    n_mtp_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim",
                     "vocab_size", "rope_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelFormatError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(
                f"model config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 or self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ModelFormatError(
                f"model config: head_dim ({self.head_dim}) and rope_dim ({self.rope_dim}) must be even, "
                f"rope_dim <= head_dim")
        if not (self.norm_eps > 0 and 0 < self.rope_theta < math.inf and 0 <= self.rope_theta_local < math.inf):
            raise ModelFormatError(
                f"model config: norm_eps ({self.norm_eps}), rope_theta ({self.rope_theta}) and rope_theta_local "
                f"({self.rope_theta_local}) must be positive and finite")

        if self.ffn_act not in ("silu", "gelu"):
            raise ModelFormatError(f"model config: ffn_act must be 'silu' or 'gelu', got {self.ffn_act!r}")
        if self.n_expert and not (0 < self.n_expert_used <= self.n_expert and self.expert_hidden_dim > 0
                                  and self.expert_gating in EXPERT_GATING_FUNCS.values()):
            raise ModelFormatError(f"model config: a mixture of {self.n_expert} experts needs 1 <= n_expert_used "
                                   f"({self.n_expert_used}) <= n_expert, expert_hidden_dim "
                                   f"({self.expert_hidden_dim}) > 0 and a known expert_gating "
                                   f"({self.expert_gating!r})")
        if self.expert_act not in EXPERT_ACTS:
            raise UnsupportedModelError(f"model config: the experts' activation {self.expert_act!r} is not one "
                                        f"llamatrace runs ({', '.join(EXPERT_ACTS)})")
        if any(not 0 <= i < self.n_layers for i in self.local_layers) or self.sliding_window < 0:
            raise ModelFormatError(f"model config: local_layers {self.local_layers} must be layer indices "
                                   f"and sliding_window ({self.sliding_window}) >= 0")
        if self.recurrent_layers:
            if any(not 0 <= i < self.n_layers for i in self.recurrent_layers):
                raise ModelFormatError(f"model config: recurrent_layers {self.recurrent_layers} must be layer indices")
            sizes = (self.ssm_conv_kernel, self.ssm_head_dim, self.ssm_n_k_heads, self.ssm_n_v_heads)
            if min(sizes) <= 0 or self.ssm_n_v_heads % self.ssm_n_k_heads:
                raise ModelFormatError(f"model config: the DeltaNet sizes (conv kernel, head dim, k heads, v heads) "
                                       f"{sizes} must be positive, v heads a multiple of k heads")

    @property
    def kq_scale(self) -> float:
        """The factor of q·kᵀ before the softmax: ``attn_scale``, else ``1/√head_dim``."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window (and uses ``rope_theta_local``)."""
        return self.sliding_window > 0 and layer in self.local_layers

    @property
    def features(self) -> frozenset[str]:
        """The architecture features in use, by the names the stage catalogue's ``when`` column uses:
        ``qkv_bias``, ``qk_norm``, ``post_norms``, ``gelu``, ``embed_scale``, ``swa``,
        ``attn_softcap``, ``final_softcap``, ``moe`` (a mixture-of-experts FFN), ``moe_norm`` (its
        weights normalised), ``attn_sinks``, ``moe_bias`` (router and expert biases),
        ``moe_softmax_weight`` (softmax over the chosen logits), ``moe_oai`` (clamped SwiGLU),
        ``moe_shexp`` (a gated shared expert),
        ``deltanet``, ``attn_gate``, ``longrope`` (LongRoPE's factors). Empty for a Llama model."""
        flags = {"moe": self.n_expert > 0, "moe_norm": self.n_expert > 0 and self.expert_weights_norm,
                 "attn_sinks": self.attn_sinks, "moe_bias": self.n_expert > 0 and self.moe_bias,
                 "moe_softmax_weight": self.n_expert > 0 and self.expert_gating == "softmax_weight",
                 "moe_oai": self.n_expert > 0 and self.expert_act == "swiglu_oai",
                 "moe_shexp": self.n_expert > 0 and self.shexp_hidden_dim > 0,
                 "qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm, "post_norms": self.post_norms,
                 "gelu": self.ffn_act == "gelu", "embed_scale": self.embed_scale != 1.0,
                 "swa": bool(self.sliding_window and self.local_layers),
                 "attn_softcap": self.attn_softcap > 0, "final_softcap": self.final_softcap > 0,
                 "deltanet": bool(self.recurrent_layers), "attn_gate": self.attn_output_gate,
                 "longrope": self.rope_scaling.longrope_ctx > 0}
        return frozenset(name for name, on in flags.items() if on)

    def is_recurrent(self, layer: int) -> bool:
        """Whether ``layer`` is a gated DeltaNet layer (no KV cache; a conv state and a delta-rule state)."""
        return layer in self.recurrent_layers

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """The layers that keep a KV cache (softmax attention), ascending."""
        return tuple(i for i in range(self.n_layers) if i not in self.recurrent_layers)

    @property
    def ssm_k_dim(self) -> int:
        """Width of the DeltaNet queries (and keys): ``ssm_n_k_heads * ssm_head_dim``."""
        return self.ssm_n_k_heads * self.ssm_head_dim

    @property
    def ssm_v_dim(self) -> int:
        """Width of the DeltaNet values (and of ``z``): ``ssm_n_v_heads * ssm_head_dim``."""
        return self.ssm_n_v_heads * self.ssm_head_dim

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of the conv1d (q|k|v mixed): ``2 * ssm_k_dim + ssm_v_dim``."""
        return 2 * self.ssm_k_dim + self.ssm_v_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one more position of context costs: float32 keys and values of the attention layers."""
        return 2 * len(self.attn_layers) * self.kv_dim * 4

    @property
    def state_bytes(self) -> int:
        """Bytes of the recurrent layers' float32 conv and delta-rule states: fixed, whatever the context."""
        per_layer = self.ssm_conv_dim * (self.ssm_conv_kernel - 1) + self.ssm_n_v_heads * self.ssm_head_dim ** 2
        return len(self.recurrent_layers) * per_layer * 4

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head (1 = plain multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def region_weights(self) -> int:
        """Weights one parallel region of a forward call multiplies at most (the thread policy's
        measure of a region's length, :func:`llamatrace.machine.threads.threads_for`): a dense
        FFN matrix ``dim * hidden_dim``, the queries' ``q_dim * dim``, or a mixture's ``k`` chosen
        experts' gate (their gate|up runs in one region, :mod:`llamatrace.kernels.mul_mat_id`)."""
        experts = self.dim * self.expert_hidden_dim * self.n_expert_used
        return max(self.dim * self.hidden_dim, self.dim * self.q_dim, experts)

    @property
    def q_dim(self) -> int:
        """Width of the queries, ``n_heads * head_dim`` (rows of wq)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and values, ``n_kv_heads * head_dim`` (rows of wk and wv)."""
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """The fields, those after ``max_seq_len`` only where they differ from plain Llama's (so a
        Llama config reads as it always did)."""
        out = asdict(self)
        for f in fields(self):
            if f.name in _FEATURE_FIELDS and getattr(self, f.name) == f.default:
                del out[f.name]
        if "local_layers" in out:
            out["local_layers"] = list(out["local_layers"])
        if "rope_scaling" in out:
            out["rope_scaling"] = self.rope_scaling.to_dict()
        for name in ("rope_sections", "recurrent_layers"):
            if name in out:
                out[name] = list(out[name])
        return out

    @classmethod
    def from_gguf(cls, f) -> "ModelConfig":
        """The config of an open GGUF file (:class:`~llamatrace.gguf.reader.GGUFFile`): its metadata,
        the vocabulary size from the rows of ``token_embd.weight``, and how its attention layers
        store q/k/v and their biases (:func:`_attention_tensors`).

        Raises:
            ModelFormatError: no ``token_embd.weight``; q/k/v biases in some attention layers
                only; as :meth:`from_metadata`.
            UnsupportedModelError: LongRoPE factors (``rope_factors_long/short.weight``) in an
                architecture whose llama.cpp graph does not read them; as :meth:`from_metadata`.
        """
        from pathlib import Path

        from llamatrace.gguf.reader import gguf_name
        vocab_size = f.matrix_shape(gguf_name("tok_embeddings"))[0]   # raises if the tensor is missing
        config = cls.from_metadata(f.metadata, vocab_size=vocab_size, source=Path(f.path).name)
        config = replace(config, **_attention_tensors(f.tensors, config, Path(f.path).name))
        factors = [name for name in LONGROPE_TENSORS if name in f.tensors]
        if factors and "rope_freqs.weight" not in f.tensors:     # llama.cpp's rope_freqs wins over them
            scaling = _longrope(f.metadata, config, factors[0], Path(f.path).name)
            config = replace(config, rope_scaling=scaling) if scaling else config
        return config

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], vocab_size: int, source: str = "model") -> "ModelConfig":
        """Build the config from GGUF metadata ``{key: value}``.

        Args:
            meta: decoded GGUF key/value pairs.
            vocab_size: rows of ``token_embd.weight`` (the authoritative vocabulary size).
            source: file name used in error messages.

        Raises:
            UnsupportedModelError: a shard of a split GGUF (``split.count`` > 1); the architecture
                is not one of :data:`ARCHITECTURES`; ``{arch}.attention.causal`` is false.
            ModelFormatError: a required key is missing or a value is inconsistent; a rope base,
                scaling factor or attention factor that is not a positive finite number; an
                unknown rope scaling type.
        """
        if isinstance(count := meta.get("split.count"), int) and count > 1:   # llama-gguf-split's shards
            shard = meta.get("split.no")
            raise UnsupportedModelError(
                f"{source}: {f'shard {shard + 1} of {count}' if isinstance(shard, int) else f'one of {count} shards'}"
                f" of a split GGUF; llamatrace reads one file: merge the shards first "
                f"(llama.cpp's `llama-gguf-split --merge FIRST-SHARD.gguf merged.gguf`)")
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {shown(arch)} is not supported (llamatrace runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        spec = ARCHITECTURES[arch]
        if meta.get(f"{arch}.attention.causal", True) is False:   # llama.cpp: cparams.causal_attn, a full mask
            raise UnsupportedModelError(
                f"{source}: metadata {arch}.attention.causal = false: a bidirectional (embedding) model, every "
                f"token seeing the whole batch; llamatrace runs causal language models")

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ModelFormatError(f"{source}: required metadata key {full!r} is missing; "
                                       f"the GGUF file is incomplete — re-convert or re-download it")
            return meta[full]

        def as_int(key: str, value: Any) -> int:
            if isinstance(value, list):           # per layer (gguf.metadata.PER_LAYER_INTEGER): one for all
                if not value or any(v != value[0] for v in value):
                    raise UnsupportedModelError(f"{source}: metadata {arch}.{key} differs between layers "
                                                f"({shown(value)}); llamatrace runs one value for every layer")
                value = value[0]
            try:
                return int(value)
            except (TypeError, ValueError):
                raise ModelFormatError(f"{source}: metadata {arch}.{key} should be an integer, got {shown(value)}") from None

        def number(key: str, default: float, zero: bool = False) -> float:
            """The file's positive (or, with ``zero``, non-negative) finite {arch}.{key}, else ``default``."""
            full = f"{arch}.{key}"
            if full not in meta:
                return default
            value = meta[full]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
                raise ModelFormatError(
                    f"{source}: metadata {full} = {shown(value)} should be a {'non-negative' if zero else 'positive'} "
                    f"finite number; the file is damaged — re-convert or re-download it")
            return float(value)

        dim = as_int("embedding_length", need("embedding_length"))
        n_heads = as_int("attention.head_count", need("attention.head_count"))
        n_kv_heads = as_int("attention.head_count_kv", meta.get(f"{arch}.attention.head_count_kv", n_heads))
        head_dim = as_int("attention.key_length",
                          meta.get(f"{arch}.attention.key_length", dim // n_heads if n_heads else 0))
        n_blocks = as_int("block_count", need("block_count"))
        n_mtp = as_int("nextn_predict_layers", meta.get(f"{arch}.nextn_predict_layers", 0)) if spec.deltanet else 0
        n_layers = n_blocks - n_mtp
        rope_theta = number("rope.freq_base", 10000.0)
        # sliding window: the file's window (or the family's default) on the pattern's layers
        window = as_int("attention.sliding_window", meta.get(f"{arch}.attention.sliding_window", spec.swa_default))
        local: tuple[int, ...] = ()
        if spec.swa_pattern and window > 0:
            pattern = meta.get(f"{arch}.attention.sliding_window_pattern", spec.swa_pattern)
            if isinstance(pattern, (list, tuple)):            # one flag per layer
                local = tuple(i for i, on in enumerate(pattern[:n_layers]) if on)
            else:
                n = as_int("attention.sliding_window_pattern", pattern)
                local = tuple(i for i in range(n_layers) if n == 0 or i % n < n - 1)
        else:
            window = 0
        rope_local = number("rope.freq_base_swa",
                            spec.rope_base_local if spec.rope_base_local is not None else rope_theta)
        max_seq_len = as_int("context_length", need("context_length"))
        scaling = _rope_scaling(meta, arch, spec, number, max_seq_len, bool(local), source)
        hidden_dim = as_int("feed_forward_length", need("feed_forward_length"))
        moe = _experts(meta, arch, spec, as_int, hidden_dim, source)
        wide = spec.wide_query_scale_layers and n_layers == spec.wide_query_scale_layers
        deltanet = _deltanet_fields(meta, arch, n_blocks, n_layers, as_int, source) if spec.deltanet else {}
        try:
            return cls(
                dim=dim,
                n_layers=n_layers,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                hidden_dim=hidden_dim,
                vocab_size=int(vocab_size),
                norm_eps=float(need("attention.layer_norm_rms_epsilon")),
                rope_theta=rope_theta,
                rope_dim=as_int("rope.dimension_count", meta.get(f"{arch}.rope.dimension_count", head_dim)),
                max_seq_len=max_seq_len,
                arch=arch,
                rope_neox=spec.rope_neox,
                qkv_bias=spec.qkv_bias,
                qk_norm=spec.qk_norm,
                post_norms=spec.post_norms,
                fused_qkv=spec.fused_qkv,
                fused_gate_up=spec.fused_gate_up,
                ffn_act="gelu" if spec.gelu else "silu",
                # float32 √dim, as llama.cpp's ggml_scale(inpL, sqrtf(n_embd))
                embed_scale=float(np.float32(math.sqrt(dim))) if spec.embed_scale else 1.0,
                attn_scale=(1.0 / math.sqrt(dim / n_heads)) if wide else 0.0,
                sliding_window=window,
                local_layers=local,
                rope_theta_local=rope_local if local else 0.0,
                rope_scaling=scaling,
                attn_softcap=float(meta.get(f"{arch}.attn_logit_softcapping", spec.attn_softcap)) if spec.attn_softcap else 0.0,
                final_softcap=(0.0 if spec.final_softcap is None
                               else float(meta.get(f"{arch}.final_logit_softcapping", spec.final_softcap))),
                qk_norm_flat=spec.qk_norm_flat,
                attn_sinks=spec.attn_sinks,
                attn_out_bias=spec.attn_out_bias,
                ffn_norm_post_attention=spec.ffn_norm_post_attention,
                attn_output_gate=spec.attn_output_gate,
                n_mtp_layers=n_mtp,
                **moe,
                **deltanet,
            )
        except ModelFormatError as exc:              # the checks name fields: say which keys and file they came from
            text = str(exc).removeprefix("model config: ")
            keys = ", ".join(f"{arch}.{key}" for field, key in FIELD_KEYS.items() if re.search(rf"\b{field}\b", text))
            raise ModelFormatError(f"{source}: {text}{f' (metadata {keys})' if keys else ''}; the file is damaged "
                                   f"— re-convert or re-download it") from None


FIELD_KEYS = {"dim": "embedding_length", "n_layers": "block_count", "n_heads": "attention.head_count",
              "n_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
              "hidden_dim": "feed_forward_length", "max_seq_len": "context_length",
              "rope_dim": "rope.dimension_count", "norm_eps": "attention.layer_norm_rms_epsilon",
              "n_expert": "expert_count", "n_expert_used": "expert_used_count"}
"""A :class:`ModelConfig` field → the ``{arch}.`` metadata key it is read from (for errors)."""


def _attention_tensors(names, c: ModelConfig, source: str) -> dict[str, bool]:
    """``fused_qkv``, ``qkv_bias`` and ``attn_out_bias`` of the file whose tensor names are ``names``,
    as llama.cpp 0.3.36's ``create_tensor_qkv`` reads them in every family: q|k|v as one
    ``attn_qkv`` (``convert_hf_to_gguf.py --fuse-qkv``) or three (the loader decides per layer;
    ``fused_qkv`` says every attention layer is fused); biases, optional, as one ``attn_qkv.bias``
    or three, beside fused or separate weights, in every attention layer or none.
    ``attn_output.bias`` is required where the family has it, optional where
    :attr:`Architecture.optional_out_bias` says (``llama``).

    Raises:
        ModelFormatError: some attention layers have q/k/v biases and another lacks one.
    """
    spec = ARCHITECTURES[c.arch]
    layers = c.attn_layers

    def every(suffix: str) -> bool:
        return bool(layers) and all(f"blk.{i}.{suffix}" in names for i in layers)
    some = any(f"blk.{i}.attn_{x}.bias" in names for i in layers for x in ("q", "k", "v", "qkv"))
    lacking = [f"blk.{i}.attn_{x}.bias" for i in layers if f"blk.{i}.attn_qkv.bias" not in names
               for x in "qkv" if f"blk.{i}.attn_{x}.bias" not in names]
    if some and lacking:
        raise ModelFormatError(f"{source}: tensor {lacking[0]!r} is missing, while other attention layers have "
                               f"q/k/v biases; the file is incomplete — re-convert or re-download it")
    # with an output gate (Qwen3.5) llama.cpp adds q's bias to query|gate before the split, our
    # Qcur_b after it: such a file (none is known) keeps its biases unread and is refused
    return dict(fused_qkv=every("attn_qkv.weight"), qkv_bias=some and not spec.attn_output_gate,
                attn_out_bias=spec.attn_out_bias or (spec.optional_out_bias and every("attn_output.bias")))


def _experts(meta: Mapping[str, Any], arch: str, spec: Architecture, as_int, hidden_dim: int,
             source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelConfig` from the file's ``{arch}.expert_*`` keys, as
    llama.cpp's ``load_hparams`` and the arch's ``load_arch_hparams`` read them (empty: a dense FFN).

    Raises:
        ModelFormatError: an MoE architecture without ``expert_count`` / ``expert_used_count``, or
            ``expert_used_count`` outside ``1 … expert_count``.
        UnsupportedModelError: an ``expert_gating_func`` not in :data:`EXPERT_GATING_FUNCS`.
    """
    count_key, used_key = f"{arch}.expert_count", f"{arch}.expert_used_count"
    n_expert = as_int("expert_count", meta.get(count_key, 0))
    if not (spec.moe or n_expert):
        return {}
    for key in (count_key, used_key):
        if key not in meta:
            raise ModelFormatError(f"{source}: required metadata key {key!r} is missing; a {arch} mixture of "
                                   f"experts needs it — the GGUF file is incomplete, re-convert or re-download it")
    n_used = as_int("expert_used_count", meta[used_key])
    if not 0 < n_used <= n_expert:
        raise ModelFormatError(f"{source}: metadata {used_key} = {n_used} must be between 1 and {count_key} = "
                               f"{n_expert}; the file is damaged — re-convert or re-download it")
    gating_key = f"{arch}.expert_gating_func"
    gating = meta.get(gating_key, 1)
    if gating not in LLAMACPP_GATING_FUNCS:
        raise UnsupportedModelError(f"{source}: metadata {gating_key} = {shown(gating)} is not a gating function "
                                    f"llama.cpp knows ({', '.join(f'{k} ({v})' for k, v in LLAMACPP_GATING_FUNCS.items())}); "
                                    f"the file is damaged or from a newer converter")
    if spec.expert_gating is not None:                 # the family's graph ignores the key
        gating = next(k for k, v in EXPERT_GATING_FUNCS.items() if v == spec.expert_gating)
    if gating not in EXPERT_GATING_FUNCS:
        raise UnsupportedModelError(f"{source}: metadata {gating_key} = {shown(gating)} is a gating function "
                                    f"llamatrace does not run (it runs {', '.join(f'{k} ({v})' for k, v in EXPERT_GATING_FUNCS.items())})")
    ff_key = f"{arch}.expert_feed_forward_length"
    if spec.expert_ff_key:
        expert_hidden = as_int("expert_feed_forward_length", meta[ff_key]) if ff_key in meta else hidden_dim // n_used
    else:
        expert_hidden = hidden_dim
    shexp_key = f"{arch}.expert_shared_feed_forward_length"
    shexp_hidden = (as_int("expert_shared_feed_forward_length", meta[shexp_key]) if shexp_key in meta
                    else hidden_dim) if spec.shared_expert else 0
    return dict(n_expert=n_expert, n_expert_used=n_used, expert_hidden_dim=expert_hidden,
                expert_gating=EXPERT_GATING_FUNCS[gating], expert_weights_norm=spec.expert_weights_norm,
                moe_bias=spec.moe_bias, expert_act=spec.expert_act, shexp_hidden_dim=shexp_hidden)


def _deltanet_fields(meta: Mapping[str, Any], arch: str, n_blocks: int, n_layers: int, as_int,
                     source: str) -> dict[str, Any]:
    """The gated DeltaNet fields of a config, as llama.cpp's ``llama_model_qwen35::load_arch_hparams``
    reads them: the ``{arch}.ssm.*`` sizes (all required), the recurrent layers from
    ``{arch}.attention.recurrent_layers`` (one flag per block, MTP blocks included) or else
    ``{arch}.full_attention_interval`` (default 4: layer i is recurrent iff (i+1) % interval != 0),
    and ``{arch}.rope.dimension_sections``.

    Raises:
        ModelFormatError: a missing ``ssm`` key; ``ssm.inner_size`` ≠ ``state_size × time_step_rank``;
            a recurrent-layer list whose length is not ``block_count``; an interval < 1.
    """
    def need(key: str) -> int:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelFormatError(f"{source}: required metadata key {full!r} is missing; a {arch} model needs it "
                                   f"for its DeltaNet layers — re-convert the file with llama.cpp")
        return as_int(key, meta[full])

    conv_kernel, inner = need("ssm.conv_kernel"), need("ssm.inner_size")
    head_dim, n_v, n_k = need("ssm.state_size"), need("ssm.time_step_rank"), need("ssm.group_count")
    if inner != head_dim * n_v:
        raise ModelFormatError(f"{source}: metadata {arch}.ssm.inner_size = {inner} should be ssm.state_size × "
                               f"ssm.time_step_rank = {head_dim} × {n_v}; the file is inconsistent")
    key = f"{arch}.attention.recurrent_layers"
    if key in meta:
        flags = meta[key]
        if not isinstance(flags, (list, tuple)) or len(flags) != n_blocks:
            got = f"{len(flags)} entries" if isinstance(flags, (list, tuple)) else shown(flags)
            raise ModelFormatError(f"{source}: metadata {key} has {got}, expected one flag per block "
                                   f"({arch}.block_count = {n_blocks}); the file is inconsistent")
        recurrent = tuple(i for i in range(n_layers) if flags[i])
    else:
        interval = as_int("full_attention_interval", meta.get(f"{arch}.full_attention_interval", 4))
        if interval < 1:
            raise ModelFormatError(f"{source}: metadata {arch}.full_attention_interval = {interval} should be "
                                   f">= 1; the file is damaged")
        recurrent = tuple(i for i in range(n_layers) if (i + 1) % interval)
    sections = meta.get(f"{arch}.rope.dimension_sections", ())
    if not isinstance(sections, (list, tuple)) or len(sections) > 4 or any(
            not isinstance(s, int) or s < 0 for s in sections):
        raise ModelFormatError(f"{source}: metadata {arch}.rope.dimension_sections = {shown(sections)} should be "
                               f"up to 4 non-negative integers")
    sections = tuple(sections) + (0,) * (4 - len(sections)) if any(sections) else ()
    return dict(rope_sections=sections, recurrent_layers=recurrent, ssm_conv_kernel=conv_kernel,
                ssm_head_dim=head_dim, ssm_n_k_heads=n_k, ssm_n_v_heads=n_v)


def imrope_text_rotated(rope_dim: int, sections: tuple[int, ...]) -> np.ndarray:
    """Which of the ``rope_dim/2`` rotary pairs a text token rotates under interleaved M-RoPE
    (llama.cpp ``ggml_mrope_cache_init`` with ``is_imrope``, positions ``[p, p, p, 0]`` as
    ``llm_graph_input_pos`` sets them for text): pair ``i``, sector ``s = i % Σsections``, takes
    the extra (4th) position 0 — no rotation — unless ``s % 3`` is 0, 1 or 2 with
    ``s < 3·sections[0]``, ``3·sections[1]`` or ``3·sections[2]`` respectively. bool ``[rope_dim/2]``."""
    total = sum(sections)
    s = np.arange(rope_dim // 2) % total
    return (((s % 3 == 0) & (s < 3 * sections[0])) | ((s % 3 == 1) & (s < 3 * sections[1]))
            | ((s % 3 == 2) & (s < 3 * sections[2])))


def _rope_scaling(meta: Mapping[str, Any], arch: str, spec: Architecture, number, n_ctx_train: int,
                  has_local: bool, source: str) -> RopeScaling:
    """The file's rope scaling as llama.cpp resolves it: ``llama_model::load_hparams`` reads the
    type (default ``linear``), ``freq_scale = 1/factor`` (0 or absent: 1), the attention factor
    and ``original_context_length``; the ``llama_context`` constructor turns the type into
    ``ext_factor`` (``yarn``: 1), never scales for ``none``, and sets YaRN's attention factor.
    ``number(key, default, zero)`` reads a checked number. float32 where llama.cpp computes in it.

    Raises:
        ModelFormatError: a type llama.cpp does not know; a bad factor.
    """
    f32 = np.float32
    key = f"{arch}.rope.scaling.type"
    kind = meta.get(key, "linear")
    if kind == "longrope":      # llama.cpp: not YaRN, so linear; the factors come with the tensors (_longrope)
        kind = "linear"
    if kind not in ROPE_SCALING_TYPES:
        raise ModelFormatError(f"{source}: metadata {key} = {shown(kind)} is not a rope scaling llamatrace knows "
                               f"({', '.join(ROPE_SCALING_TYPES)}); re-convert the file with llama.cpp")
    factor = (number("rope.scaling.factor", 0.0, zero=True) if f"{arch}.rope.scaling.factor" in meta
              else number("rope.scale_linear", 0.0, zero=True))                   # the older key
    scale_train = 1.0 if factor == 0.0 else float(f32(1) / f32(factor))
    freq_scale = 1.0 if kind == "none" else scale_train
    freq_scale_local = spec.rope_scale_local if has_local and spec.rope_scale_local is not None else scale_train
    if not has_local:
        freq_scale_local = 1.0                                # unused
    attn_factor = f32(number("rope.scaling.attn_factor", 1.0))
    if kind != "yarn":
        if freq_scale == freq_scale_local == 1.0 and attn_factor == 1:
            return RopeScaling()
        return RopeScaling(kind, freq_scale, freq_scale_local, attn_factor=float(attn_factor))
    # llama_context: yarn_attn_factor = get_mscale(factor) / (1 + 0.1 ln factor) (≈ 1), times the file's
    big = f32(1) / f32(freq_scale)
    get_mscale = f32(1) if big <= 1 else f32(0.1) * np.log(big) + f32(1)
    attn_factor = get_mscale * (f32(1) / (f32(1) + f32(0.1) * np.log(big))) * attn_factor
    key = f"{arch}.rope.scaling.original_context_length"
    n_ctx_orig = meta.get(key, 0)
    if not isinstance(n_ctx_orig, int) or isinstance(n_ctx_orig, bool) or n_ctx_orig < 0:
        raise ModelFormatError(f"{source}: metadata {key} = {shown(n_ctx_orig)} should be a non-negative integer; "
                               f"the file is damaged — re-convert or re-download it")
    return RopeScaling(kind, freq_scale, freq_scale_local, ext_factor=1.0, attn_factor=float(attn_factor),
                       n_ctx_orig=n_ctx_orig or n_ctx_train)


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""LongRoPE's per-pair factors, float32 ``[rope_dim/2]`` each (Phi-3's converter writes both)."""


def _longrope(meta: Mapping[str, Any], c: ModelConfig, tensor: str, source: str) -> RopeScaling | None:
    """``c.rope_scaling`` with LongRoPE's factors: ``longrope_ctx`` is llama.cpp's
    ``n_ctx_orig_yarn`` (``{arch}.rope.scaling.original_context_length``, else ``context_length``).
    None for a file whose family reads them only with the type key (:attr:`Architecture.longrope_factors`
    ``"with_type"``: ``llama``) and whose scaling type is not ``longrope``: its graph does not read the
    factors then, and the loader refuses them as tensors it never reads (llama.cpp refuses the file).

    Raises:
        UnsupportedModelError: the architecture's llama.cpp graph does not read the factors.
        ModelFormatError: the original context length is not a positive integer.
    """
    reads = ARCHITECTURES[c.arch].longrope_factors
    if not reads:
        readers = [arch for arch, spec in ARCHITECTURES.items() if spec.longrope_factors]
        raise UnsupportedModelError(f"{source}: tensor {tensor!r} (LongRoPE factors) is read in llama.cpp's "
                                    f"{' and '.join(readers)} graphs only, not in {c.arch}'s; "
                                    f"re-convert the file without it")
    if reads == "with_type" and meta.get(f"{c.arch}.rope.scaling.type") != "longrope":
        return None
    key = f"{c.arch}.rope.scaling.original_context_length"
    n_ctx_orig = meta.get(key, c.max_seq_len)
    if not isinstance(n_ctx_orig, int) or isinstance(n_ctx_orig, bool) or n_ctx_orig <= 0:
        raise ModelFormatError(f"{source}: metadata {key} = {shown(n_ctx_orig)} should be a positive integer; "
                               f"the file is damaged — re-convert or re-download it")
    s = c.rope_scaling
    return replace(s, type=s.type if s.type == "yarn" else "longrope", longrope_ctx=n_ctx_orig)


# Fields that plain Llama leaves at their defaults (left out of ``to_dict`` when so).
_FEATURE_FIELDS = frozenset(f.name for f in fields(ModelConfig)
                            if f.name not in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim",
                                              "vocab_size", "norm_eps", "rope_theta", "rope_dim", "max_seq_len"))
