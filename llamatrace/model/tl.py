"""TransformerLens conventions on a llamatrace model: ``run_with_cache`` and ``run_with_hooks``.

TransformerLens (TL) names activations by hook points (``blocks.8.hook_resid_post``) and gives
them a batch axis first (``[batch, pos, d_model]``, ``[batch, head, query_pos, key_pos]``,
``[batch, pos, head, d_head]``). This module serves those names from the stages the forward pass
emits (:mod:`llamatrace.tracing.stages`), converted to TL's layout and — where TL's hook is a
different quantity than our stage — to TL's quantity:

* ``attn.hook_q`` / ``hook_k`` / ``hook_rot_q`` / ``hook_rot_k``: GGUF stores the Q and K rows of
  each head permuted for interleaved-pair RoPE (llama.cpp's ``convert_hf_to_gguf.py``); TL uses
  HF's split-halves layout. We hand out ``concat(x[..., 0::2], x[..., 1::2])`` per head, HF's
  order (q·k products are the same either way).
* ``ln*.hook_normalized`` is ``x / rms(x)`` *before* the norm weight (TL's ``RMSNorm``), and
  ``ln*.hook_scale`` is ``rms(x) = sqrt(mean(x²) + eps)`` ``[batch, pos, 1]``: computed from the
  residual stream, not our ``attn_norm`` (which is after the weight).
* ``blocks.{L}.hook_resid_pre`` is the residual entering block L: ``hook_embed`` for L = 0, else
  ``blocks.{L-1}.hook_resid_post`` (the same array, as in TL).
* Qwen3.5's gated DeltaNet layers have no TL counterpart: their hooks are named after HF's
  ``linear_attn`` module (``blocks.{L}.linear_attn.hook_in_proj_qkv`` …, :data:`LINEAR_ATTN_HOOKS`),
  served on the recurrent layers instead of ``attn.*``; ``hook_attn_out`` is the block's output
  (``linear_attn_out``). ``hook_state`` is the delta-rule state after the run ``[batch, head, d, d]``
  (llama.cpp's layout, ``[h, j, i] = S[i][j]``), not a per-token activation.
* Gemma 2 / 3 (TL's ``use_normalization_before_and_after``): ``hook_embed`` is the embedding
  scaled by √d_model (TL folds the scale into ``W_E``), ``hook_attn_out`` / ``hook_mlp_out`` are
  taken after the post-norms, and ``ln1_post`` / ``ln2_post`` are served like ``ln1`` / ``ln2``
  from the attention / MLP outputs.
* Mixture-of-experts models (TL's Mixtral ``MoE``): ``mlp.hook_expert_weights`` is the router's
  softmax over every expert (``ffn_moe_probs``, ``[batch, pos, n_expert]``; TL's own is flattened
  to ``[batch·pos, n_expert]``), ``mlp.hook_expert_indices`` the chosen experts (``ffn_moe_topk``,
  ``[batch, pos, k]``), ``hook_mlp_out`` the weighted sum (``ffn_moe_out``); TL's MoE has no
  ``mlp.hook_pre`` / ``hook_pre_linear`` / ``hook_post`` (each expert has its own: the
  ``ffn_moe_gate@L`` … stages, ``[batch, pos, k, d_expert]``).

TL names we could only fake are refused with the reason (:data:`REFUSED`). Our own stage ids
(``l_out@8``, ``inp_embd``) are served too, in our layout with a batch axis in front.

Checked against TransformerLens 4.3 itself (``tests/golden/make_tl_golden.py``, ``TransformerBridge``
in compatibility mode without weight processing): every served name agrees to ~1e-5 relative in
``f32`` mode (``tests/test_tl.py``).

Batches: ``tokens`` may be a string, a list of strings, a token list, a list of token lists of
different lengths, or an int array ``[batch, pos]``. Each sequence runs on its own (no padding
reaches the model: positions start at 0 for every sequence, as TL's left-padding offsets do);
results are padded to the longest on ``padding_side`` (``"right"``, TL's default, or
``"left"``) with 0 (``-inf`` in ``hook_attn_scores``), and ``cache.attention_mask`` marks the
real positions. Hooks are called once per sequence with a batch of one (``hook.batch_index``
says which); a hook that needs the whole batch at once cannot be served this way. As in TL, a
hook may return a replacement or change the activation in place and return ``None``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from llamatrace.errors import HookError, OptionError
from llamatrace.tracing.stages import STAGE_BY_ID

# ---- the names served ------------------------------------------------------------------------
# TL name under ``blocks.{L}.`` -> the stage that carries it and how it is converted.
LAYER_HOOKS: dict[str, tuple[str, str]] = {
    "hook_resid_pre": ("resid_pre", "same"),        # inp_embd or l_out@L-1 (see _RESID_PRE)
    "ln1.hook_scale": ("attn_norm", "scale"),
    "ln1.hook_normalized": ("attn_norm", "normalized"),
    "attn.hook_q": ("Qcur", "q_heads"),
    "attn.hook_k": ("Kcur", "kv_heads"),
    "attn.hook_v": ("Vcur", "v_heads"),
    "attn.hook_rot_q": ("Qcur_rope", "halves"),
    "attn.hook_rot_k": ("Kcur_rope", "halves"),
    "attn.hook_attn_scores": ("kq_masked", "same"),   # kq_scaled in a one-token run (no mask)
    "attn.hook_pattern": ("kq_soft_max", "same"),
    "attn.hook_z": ("kqv", "swap01"),
    "hook_attn_out": ("attn_out", "same"),
    "hook_resid_mid": ("ffn_inp", "same"),
    "ln2.hook_scale": ("ffn_norm", "scale"),
    "ln2.hook_normalized": ("ffn_norm", "normalized"),
    "mlp.hook_pre": ("ffn_gate", "same"),
    "mlp.hook_pre_linear": ("ffn_up", "same"),
    "mlp.hook_post": ("ffn_swiglu", "same"),
    "hook_mlp_out": ("ffn_out", "same"),
    "hook_resid_post": ("l_out", "same"),
}
# Gemma 2/3's norms after attention and after the MLP (TL's use_normalization_before_and_after);
# there TL's hook_attn_out / hook_mlp_out are what the residual adds: after these norms.
POST_NORM_HOOKS: dict[str, tuple[str, str]] = {
    "ln1_post.hook_scale": ("attn_post_norm", "scale"),
    "ln1_post.hook_normalized": ("attn_post_norm", "normalized"),
    "ln2_post.hook_scale": ("ffn_post_norm", "scale"),
    "ln2_post.hook_normalized": ("ffn_post_norm", "normalized"),
}
MODEL_HOOKS: dict[str, tuple[str, str]] = {
    "hook_embed": ("inp_embd", "same"),
    "ln_final.hook_scale": ("result_norm", "scale"),
    "ln_final.hook_normalized": ("result_norm", "normalized"),
}
# TL's Mixtral MoE: what replaces the dense MLP's hooks under blocks.{L}. in a mixture-of-experts model.
MOE_HOOKS: dict[str, tuple[str, str]] = {
    "mlp.hook_expert_weights": ("ffn_moe_probs", "same"),
    "mlp.hook_expert_indices": ("ffn_moe_topk", "same"),
}
_DENSE_MLP_HOOKS = ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")
# A gated DeltaNet layer's names under ``blocks.{L}.`` (HF Qwen3.5's ``linear_attn`` module), in
# forward order, instead of the ``attn.*`` ones; all in our layout with a batch axis in front.
LINEAR_ATTN_HOOKS: dict[str, tuple[str, str]] = {
    "linear_attn.hook_in_proj_qkv": ("linear_attn_qkv_mixed", "same"),   # [pos, conv_dim]
    "linear_attn.hook_in_proj_z": ("z", "same"),                       # [pos, v_dim]
    "linear_attn.hook_beta": ("beta_sigmoid", "same"),                 # [pos, v_head]
    "linear_attn.hook_g": ("gate", "same"),                            # [pos, v_head], the log-decay
    "linear_attn.hook_conv1d": ("conv_output_silu", "same"),           # [pos, conv_dim], after SiLU
    "linear_attn.hook_q": ("q_conv_predelta", "same"),                 # [pos, k_head, d], L2-normed
    "linear_attn.hook_k": ("k_conv_predelta", "same"),
    "linear_attn.hook_v": ("v_conv_predelta", "same"),                 # [pos, v_head, d]
    "linear_attn.hook_core_attn_out": ("attn_output", "same"),         # [pos, v_head, d]
    "linear_attn.hook_state": ("new_state", "same"),                   # [v_head, d, d]
    "linear_attn.hook_norm": ("final_output", "same"),                 # [pos, v_dim], gated RMSNorm
}
# TL names with no honest counterpart here, and why.
REFUSED: dict[str, str] = {
    "hook_pos_embed": "Llama has no positional embedding (RoPE rotates q and k: attn.hook_rot_q/hook_rot_k)",
    "attn.hook_result": "per-head outputs before the sum (TL's use_attn_result) are not computed; "
                        "use attn.hook_z and the GGUF's attn_output weight",
    "hook_attn_in": "TL's split-input hooks (use_attn_in) are not served; use hook_resid_pre",
    "hook_q_input": "TL's split-input hooks (use_split_qkv_input) are not served; use hook_resid_pre",
    "hook_k_input": "TL's split-input hooks (use_split_qkv_input) are not served; use hook_resid_pre",
    "hook_v_input": "TL's split-input hooks (use_split_qkv_input) are not served; use hook_resid_pre",
    "hook_mlp_in": "TL's use_hook_mlp_in is not served; use hook_resid_mid",
    "hook_unembed": "the logits are what run_with_cache returns",
}
# TL's short names (``cache["resid_post", 3]``, utils.get_act_name) -> full name under blocks.{L}.
SHORT_NAMES: dict[str, str] = {
    "resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
    "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out", "q": "attn.hook_q", "k": "attn.hook_k",
    "v": "attn.hook_v", "rot_q": "attn.hook_rot_q", "rot_k": "attn.hook_rot_k", "z": "attn.hook_z",
    "attn_scores": "attn.hook_attn_scores", "pattern": "attn.hook_pattern", "pre": "mlp.hook_pre",
    "pre_linear": "mlp.hook_pre_linear", "post": "mlp.hook_post",
}
_BLOCK = re.compile(r"^blocks\.(-?\d+)\.(.+)$")
_STAGE_AT = re.compile(r"^([A-Za-z_]+)@(-?\d+)$")


@dataclass(frozen=True)
class Served:
    """One name a run serves: ``name`` (a TL name or a stage id), the ``stage`` and ``layer``
    (``None``: model level) whose emitted array carries it, and the conversion ``kind``."""

    name: str
    stage: str
    layer: int | None
    kind: str

    @property
    def per_token(self) -> bool:
        """Whether the activation is one fixed-size vector per position (``[batch, pos, ...]``),
        what an activation dataset stores; attention scores and patterns are not."""
        if self.kind == "stage" or STAGE_BY_ID[self.stage].when == "deltanet":   # the state is not
            return STAGE_BY_ID[self.stage].shape.startswith("[seq_len")
        return self.stage not in ("kq_masked", "kq_soft_max")


def _block_hooks(post_norms: bool, moe: bool = False, recurrent: bool = False) -> dict[str, tuple[str, str]]:
    """TL's names under ``blocks.{L}.`` for a model with (Gemma 2/3) or without post-norms, with a
    mixture of experts (``moe``) or a dense MLP, and of a ``recurrent`` (gated DeltaNet) layer, in
    forward order."""
    if recurrent:
        out = {}
        for name, value in _block_hooks(post_norms, moe).items():
            if name == "hook_attn_out":
                out |= LINEAR_ATTN_HOOKS
                value = ("linear_attn_out", "same")
            if not name.startswith("attn."):
                out[name] = value
        return out
    if not (post_norms or moe):
        return LAYER_HOOKS
    out = {}
    for name, value in LAYER_HOOKS.items():
        if moe and name in _DENSE_MLP_HOOKS:
            continue
        if moe and name == "hook_mlp_out":     # what the residual adds: the experts' weighted sum
            out.update(MOE_HOOKS)
            value = ("ffn_moe_out", "same")
        if not post_norms:
            out[name] = value
            continue
        if name == "hook_attn_out":
            out.update({k: v for k, v in POST_NORM_HOOKS.items() if k.startswith("ln1_post")})
        if name == "hook_mlp_out":
            out.update({k: v for k, v in POST_NORM_HOOKS.items() if k.startswith("ln2_post")})
        out[name] = value
    return out


def served_names(n_layers: int, post_norms: bool = False, moe: bool = False,
                 recurrent: Iterable[int] = ()) -> list[str]:
    """Every TL name served for a model of ``n_layers`` blocks (``post_norms``: with Gemma's
    ``ln1_post`` / ``ln2_post``; ``moe``: with experts; ``recurrent``: the gated DeltaNet layers), in
    forward order."""
    names = ["hook_embed"]
    recurrent = frozenset(recurrent)
    for layer in range(n_layers):
        names += [f"blocks.{layer}.{h}" for h in _block_hooks(post_norms, moe, layer in recurrent)]
    return names + ["ln_final.hook_scale", "ln_final.hook_normalized"]


def resolve(name: str, n_layers: int, post_norms: bool = False, moe: bool = False,
            recurrent: Iterable[int] = ()) -> Served:
    """What carries ``name``: a TL hook name (``blocks.8.hook_resid_post``), a TL short name with a
    layer (``("resid_post", 8)``), or a stage id (``l_out@8``, ``inp_embd``).

    ``post_norms``: the model has Gemma's post-norms, so ``ln1_post`` / ``ln2_post`` are served.
    ``moe``: the model's MLPs are mixtures of experts (:data:`MOE_HOOKS` instead of the dense MLP's).
    ``recurrent``: the gated DeltaNet layers, which serve ``linear_attn.*`` instead of ``attn.*``.

    Raises:
        OptionError: an unknown name (with close matches), a TL name that is refused (with why),
            a stage that cannot be hooked, or a layer this model does not have.
    """
    if isinstance(name, tuple):
        short, layer = name
        if short not in SHORT_NAMES:
            raise OptionError(f"unknown short hook name {short!r}; known: {', '.join(SHORT_NAMES)}")
        name = f"blocks.{layer}.{SHORT_NAMES[short]}"
    if name in MODEL_HOOKS:
        stage, kind = MODEL_HOOKS[name]
        return Served(name, stage, None, kind)
    if name in REFUSED:
        raise OptionError(f"hook {name!r} is not served: {REFUSED[name]}")
    m = _BLOCK.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if rest in REFUSED:
            raise OptionError(f"hook {name!r} is not served: {REFUSED[rest]}")
        if rest in POST_NORM_HOOKS and not post_norms:
            raise OptionError(f"hook {name!r} is not served: this model has no norm after attention and "
                              f"MLP (TL's ln1_post / ln2_post are Gemma 2 and 3's)")
        if rest in MOE_HOOKS and not moe:
            raise OptionError(f"hook {name!r} is not served: this model's MLPs are dense, without experts")
        if rest in _DENSE_MLP_HOOKS and moe:
            raise OptionError(f"hook {name!r} is not served: a mixture of experts has no single MLP; each chosen "
                              f"expert's is a stage (ffn_moe_gate@{layer}, ffn_moe_up@{layer}, ffn_moe_swiglu@{layer})")
        recurrent = frozenset(recurrent)
        hooks = _block_hooks(post_norms, moe, layer in recurrent)
        other = _block_hooks(post_norms, moe, layer not in recurrent)    # the other kind of layer's
        if rest not in hooks and rest in other and 0 <= layer < n_layers:
            if not recurrent:
                raise OptionError(f"hook {name!r} is not served: this model has no gated DeltaNet layers "
                                  f"(linear_attn.* hooks are Qwen3.5's)")
            kind = "a gated DeltaNet layer (linear_attn.* hooks)" if layer in recurrent else \
                "a softmax attention layer (attn.* hooks)"
            raise OptionError(f"hook {name!r} is not served: layer {layer} is {kind}")
        if rest in hooks:
            _check_layer(name, layer, n_layers)
            stage, kind = hooks[rest]
            if stage == "resid_pre":   # the residual entering the block: the one before's output
                return Served(name, "inp_embd", None, kind) if layer == 0 else Served(name, "l_out", layer - 1, kind)
            return Served(name, stage, layer, kind)
    m = _STAGE_AT.match(name)
    stage_id, layer = (m.group(1), int(m.group(2))) if m else (name, None)
    stage = STAGE_BY_ID.get(stage_id)
    if stage is not None:
        if not stage.replaceable:
            raise OptionError(f"stage {stage_id!r} is a view or lazy copy, not an array of its own; "
                              f"pick a replaceable stage (llamatrace stages)")
        if stage.level == "layer" and layer is None:
            raise OptionError(f"stage {stage_id!r} is per layer: write {stage_id}@LAYER (e.g. {stage_id}@0)")
        if stage.level == "model" and layer is not None:
            raise OptionError(f"stage {stage_id!r} is model level: write it without @{layer}")
        if layer is not None:
            _check_layer(name, layer, n_layers)
        return Served(name, stage_id, layer, "stage")
    known = served_names(n_layers, post_norms, moe, recurrent) + [f"{s}@0" for s in STAGE_BY_ID]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else \
        "; TL names look like blocks.0.hook_resid_post, stage ids like l_out@0"
    raise OptionError(f"unknown hook {name!r}{hint}")


def _check_layer(name: str, layer: int, n_layers: int) -> None:
    if not 0 <= layer < n_layers:
        raise OptionError(f"hook {name!r}: this model has {n_layers} layers (0-{n_layers - 1})")


def ran_before(served: Served, stop_at_layer: int, n_layers: int) -> bool:
    """Whether ``served`` is computed by blocks ``0 … stop_at_layer-1`` (the embedding is; the final
    norm is not)."""
    layer = served.layer if served.layer is not None else \
        (-1 if served.stage in ("inp_embd", "inp_scaled") else n_layers)
    return layer < stop_at_layer


def select(names_filter, n_layers: int, post_norms: bool = False, moe: bool = False,
           recurrent: Iterable[int] = ()) -> list[Served]:
    """The served names a ``names_filter`` picks: ``None`` (all TL names), a name, a list of
    names, or a predicate ``fn(name) -> bool`` over the TL names (TL's convention);
    ``post_norms``, ``moe`` and ``recurrent`` as in :func:`resolve`.

    Raises:
        OptionError: as :func:`resolve`, or a filter that picks nothing.
    """
    if names_filter is None:
        names: Iterable = served_names(n_layers, post_norms, moe, recurrent)
    elif callable(names_filter):
        names = [n for n in served_names(n_layers, post_norms, moe, recurrent) if names_filter(n)]
    elif isinstance(names_filter, (str, tuple)):
        names = [names_filter]
    else:
        names = list(names_filter)
    out, seen = [], set()
    for name in names:
        served = resolve(name, n_layers, post_norms, moe, recurrent)
        if served.name not in seen:
            seen.add(served.name)
            out.append(served)
    if not out:
        raise OptionError("names_filter picks no hook")
    return out


# ---- layouts ----------------------------------------------------------------------------------
def _halves(x: np.ndarray) -> np.ndarray:
    """GGUF's interleaved RoPE pairs -> HF's halves, along the last axis (head_dim)."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _interleave(x: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_halves`."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x[..., :half], x[..., half:]
    return out


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    """TL's RMSNorm scale ``sqrt(mean(x²) + eps)``, float32 ``[seq_len, 1]``."""
    return np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps).astype(np.float32)


def _stage_for(s: Served, config) -> Served:
    """The stage that carries ``s`` in this model's architecture: TL's q/k/v include the bias
    (``Qcur_b`` …), ``mlp.hook_post`` is the GeGLU product of a GELU model, ``hook_attn_out`` /
    ``hook_mlp_out`` come after Gemma's post-norms, and ``hook_embed`` (the residual entering
    block 0) is Gemma's scaled embedding (TL folds √d_model into ``W_E``)."""
    stage = s.stage
    if config.qkv_bias and s.kind in ("q_heads", "kv_heads", "v_heads"):
        stage = f"{stage}_b"
    if config.ffn_act == "gelu" and stage == "ffn_swiglu":
        stage = "ffn_geglu"
    if config.post_norms and s.kind == "same":
        stage = {"attn_out": "attn_post_norm", "ffn_out": "ffn_post_norm"}.get(stage, stage)
    if config.embed_scale != 1.0 and stage == "inp_embd" and s.kind == "same":
        stage = "inp_scaled"
    return s if stage == s.stage else Served(s.name, stage, s.layer, s.kind)


class _Converter:
    """Our stage array <-> TL's array (batch axis added) for one model."""

    def __init__(self, model) -> None:
        c = model.config
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps
        # NeoX-rotary files (Qwen, Phi-3, Gemma) already hold q/k in HF's halves layout
        self.halves = (lambda x: x) if c.rope_neox else _halves
        self.interleave = (lambda x: x) if c.rope_neox else _interleave

    def to_tl(self, kind: str, a: np.ndarray, resid: np.ndarray | None) -> np.ndarray:
        seq = a.shape[0]
        if kind in ("same", "stage"):
            out = a
        elif kind == "q_heads":
            out = self.halves(a.reshape(seq, self.n_heads, self.head_dim))
        elif kind == "kv_heads":
            out = self.halves(a.reshape(seq, self.n_kv_heads, self.head_dim))
        elif kind == "v_heads":
            out = a.reshape(seq, self.n_kv_heads, self.head_dim)
        elif kind == "halves":
            out = self.halves(a)
        elif kind == "swap01":
            out = a.transpose(1, 0, 2)
        elif kind == "scale":
            out = _rms(resid, self.eps)
        elif kind == "normalized":
            out = resid / _rms(resid, self.eps)
        else:
            raise AssertionError(kind)
        # a copy: later stages must not change it; float32, or the ids' int32 (mlp.hook_expert_indices)
        return np.array(out, dtype=a.dtype if a.dtype.kind == "i" else np.float32)[None]

    def from_tl(self, kind: str, r: np.ndarray, a: np.ndarray, resid: np.ndarray | None,
                weight: np.ndarray | None) -> np.ndarray:
        """The stage array that TL's replacement ``r`` (batch of one) stands for."""
        r = r[0]
        if kind in ("same", "stage", "v_heads"):
            out = r.reshape(a.shape)
        elif kind in ("q_heads", "kv_heads", "halves"):
            out = self.interleave(r).reshape(a.shape)
        elif kind == "swap01":
            out = r.transpose(1, 0, 2)
        elif kind == "scale":          # the norm recomputed with the given scale
            out = resid / r * weight
        elif kind == "normalized":
            out = r * weight
        else:
            raise AssertionError(kind)
        return np.ascontiguousarray(out, dtype=a.dtype if a.dtype.kind == "i" else np.float32)


# ---- running ----------------------------------------------------------------------------------
@dataclass
class HookPoint:
    """What a ``run_with_hooks`` function is told about the hook it runs at (TL passes its
    ``HookPoint``): ``name``, ``layer()`` (``None`` at model level) and ``batch_index``, the
    sequence of the batch this call is for (each sequence is a batch of one here)."""

    name: str
    _layer: int | None
    batch_index: int

    def layer(self) -> int | None:
        return self._layer


class ActivationCache(dict):
    """``run_with_cache``'s cache: name -> float32 array (int32: the expert indices), TL's shape with
    the batch axis first.

    ``cache["blocks.3.hook_resid_post"]``, ``cache["resid_post", 3]`` (TL's short names) and
    ``cache["l_out@3"]`` all work. ``attention_mask`` int ``[batch, pos]`` (1 = a real token),
    ``tokens`` int ``[batch, pos]`` (padding 0) and ``padding_side`` describe the padding.
    """

    def __init__(self, data: Mapping[str, np.ndarray], tokens: np.ndarray, attention_mask: np.ndarray,
                 padding_side: str) -> None:
        super().__init__(data)
        self.tokens, self.attention_mask, self.padding_side = tokens, attention_mask, padding_side

    def __getitem__(self, key):
        if isinstance(key, tuple) and len(key) == 2 and key[0] in SHORT_NAMES:
            key = f"blocks.{key[1]}.{SHORT_NAMES[key[0]]}"
        return super().__getitem__(key)


class _Stop(Exception):
    """Raised inside the forward pass once the last block ``stop_at_layer`` needs has run."""

    def __init__(self, resid: np.ndarray) -> None:
        super().__init__()
        self.resid = resid


FwdHook = Callable[[np.ndarray, HookPoint], "np.ndarray | None"]


def to_batch(model, tokens) -> list[np.ndarray]:
    """Token sequences of a TL-style input: a string (tokenized, BOS first where the model adds
    one), a list of strings, a token list, a list of token lists, or an int array ``[batch, pos]``.

    Raises:
        OptionError: an empty input or sequence, or ids that are not integers.
    """
    if isinstance(tokens, str):
        tokens = [tokens]
    if isinstance(tokens, np.ndarray) and tokens.ndim == 1:
        tokens = [tokens]
    seqs = list(tokens) if not isinstance(tokens, np.ndarray) else list(tokens)
    if seqs and not isinstance(seqs[0], (str, list, tuple, np.ndarray)):
        seqs = [seqs]                                   # one flat list of ids
    out = []
    for s in seqs:
        ids = model.tokenizer.encode(s) if isinstance(s, str) else s
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0:
            raise OptionError(f"each sequence must be a non-empty list of token ids, got shape {list(arr.shape)}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise OptionError(f"token ids must be integers, got {arr.dtype}")
        out.append(arr.astype(np.int64))
    if not out:
        raise OptionError("no sequences given")
    return out


def run(model, tokens, served: Sequence[Served], *, fwd_hooks: Sequence[tuple[Served, FwdHook]] = (),
        keep: bool = True, stop_at_layer: int | None = None, padding_side: str = "right",
        return_logits: bool = True, on_sequence: Callable[[int, np.ndarray, dict], None] | None = None):
    """Run each sequence of ``tokens``; cache the ``served`` names and apply ``fwd_hooks``.

    Args:
        served: names to record (``keep``) or hand to ``on_sequence``.
        fwd_hooks: ``(served name, fn(activation, hook))`` in order; ``fn`` returns a replacement
            of the same shape (TL's layout, batch of one) or ``None``.
        stop_at_layer: run blocks ``0 … stop_at_layer-1`` only; the first result is then the
            residual stream there ``[batch, pos, d_model]`` instead of logits (TL's meaning).
        return_logits: ``False`` skips the all-position logits (``None`` is returned).
        on_sequence: ``fn(index, ids, {name: array [1, len, ...]})`` after each sequence — what
            ``collect`` streams — instead of (or besides) keeping them.

    Returns:
        ``(logits or residual or None, ActivationCache)``.

    Raises:
        OptionError: a bad input, padding side or ``stop_at_layer``; a sequence longer than the
            model's context.
        HookError: a hook returned an array of another shape.
    """
    if padding_side not in ("right", "left"):
        raise OptionError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    n_layers = model.config.n_layers
    if stop_at_layer is not None and not 0 < stop_at_layer <= n_layers:
        raise OptionError(f"stop_at_layer must be between 1 and {n_layers}, got {stop_at_layer}")
    seqs = to_batch(model, tokens)
    conv = _Converter(model)
    served = [_stage_for(s, model.config) for s in served]
    fwd_hooks = [(_stage_for(s, model.config), fn) for s, fn in fwd_hooks]
    wanted = list(served) + [s for s, _ in fwd_hooks]
    if stop_at_layer is not None:
        late = [s.name for s in wanted if not ran_before(s, stop_at_layer, n_layers)]
        if late:
            raise OptionError(f"{', '.join(late[:3])} come after stop_at_layer={stop_at_layer}")
    by_stage: dict[tuple[str, int | None], list] = {}
    for s in served:
        by_stage.setdefault((s.stage, s.layer), []).append(("keep", s, None))
    for s, fn in fwd_hooks:
        if not callable(fn):
            raise OptionError(f"the hook for {s.name!r} is not callable: give fn(activation, hook)")
        by_stage.setdefault((s.stage, s.layer), []).append(("hook", s, fn))
    norm_weight = {"attn_norm": lambda L: model.weights.layers[L].attention_norm,
                   "ffn_norm": lambda L: model.weights.layers[L].ffn_norm,
                   "attn_post_norm": lambda L: model.weights.layers[L].attention_post_norm,
                   "ffn_post_norm": lambda L: model.weights.layers[L].ffn_post_norm,
                   "result_norm": lambda L: model.weights.norm}
    all_logits = return_logits or any(s.stage in ("result_norm", "result_output") for s in wanted)
    # the inputs of the norms: the residual stream, and (post-norms) the attention and MLP outputs
    resid_stages = {"inp_embd", "l_out", "ffn_inp"}
    if model.config.embed_scale != 1.0:
        resid_stages.add("inp_scaled")
    if model.config.post_norms:
        resid_stages |= {"attn_out", "ffn_out"}
    stages = {stage for stage, _ in by_stage} | resid_stages
    if "kq_masked" in stages:
        stages.add("kq_scaled")           # a one-token sequence has no mask: its scores are kq_scaled
    results, firsts = [], []
    for b, ids in enumerate(seqs):
        per_seq: dict[str, np.ndarray] = {}
        state: dict[str, np.ndarray] = {}

        def at(stage_id: str):
            def fn(array, event):
                entries = list(by_stage.get((stage_id, event.layer), ()))
                if stage_id == "kq_scaled" and event.seq_len == 1:
                    entries += by_stage.get(("kq_masked", event.layer), ())
                resid = state.get("resid")
                for what, s, user_fn in entries:
                    act = conv.to_tl(s.kind, array, resid)
                    if what == "keep":
                        per_seq[s.name] = act
                        continue
                    before = act.copy()
                    new = user_fn(act, HookPoint(s.name, s.layer, b))
                    if new is None:                 # TL's hooks may change the activation in place
                        if np.array_equal(act, before):
                            continue
                        new = act
                    try:
                        new = np.asarray(new, dtype=act.dtype)
                    except (TypeError, ValueError) as exc:
                        raise HookError(f"the hook on {s.name!r} returned {type(new).__name__}, not an array of "
                                        f"numbers ({' '.join(str(exc).split())}); return an array like its input, "
                                        f"or None to keep it") from None
                    if new.shape != act.shape:
                        raise HookError(f"the hook on {s.name!r} returned shape {list(new.shape)}; it must "
                                        f"return {list(act.shape)} like its input, or None to keep it")
                    weight = norm_weight[stage_id](event.layer) if s.kind in ("scale", "normalized") else None
                    array = conv.from_tl(s.kind, new, array, resid, weight)
                if stage_id in resid_stages:
                    state["resid"] = array          # what the next norm normalizes (TL's ln input)
                if stop_at_layer is not None and stage_id == "l_out" and event.layer == stop_at_layer - 1:
                    raise _Stop(array)
                return array
            return fn

        if len(ids) > model.config.max_seq_len:       # new_cache would name --ctx-size, an option the caller never gave
            raise OptionError(f"{len(ids)} tokens do not fit the model's context length {model.config.max_seq_len}")
        cache = model.new_cache(len(ids))
        try:
            with model.hooks({st: at(st) for st in stages}):
                first = model.forward(ids, 0, cache, all_logits=all_logits)
        except _Stop as stop:
            first = stop.resid
        if on_sequence is not None:
            on_sequence(b, ids, per_seq)
        if keep:
            results.append(per_seq)
            firsts.append(first if (return_logits or stop_at_layer is not None) else None)
    if not keep:
        return None, None
    return _pad(seqs, results, firsts, {s.name: s for s in served}, padding_side)


def _pad(seqs, results, firsts, served: Mapping[str, Served], padding_side: str):
    """Stack per-sequence ``[1, len, ...]`` arrays into ``[batch, max_len, ...]``."""
    lengths = [len(s) for s in seqs]
    n, width = len(seqs), max(lengths)
    mask = np.zeros((n, width), dtype=np.int64)
    tokens = np.zeros((n, width), dtype=np.int64)
    for b, s in enumerate(seqs):
        sl = slice(width - len(s), width) if padding_side == "left" else slice(0, len(s))
        mask[b, sl], tokens[b, sl] = 1, s

    def stack(arrays: list[np.ndarray], pos_axes: tuple[int, ...], fill: float) -> np.ndarray:
        if len({a.shape for a in arrays}) == 1:
            return np.concatenate(arrays)
        shape = list(arrays[0].shape)
        for ax in pos_axes:
            shape[ax] = width
        out = np.full([n] + shape[1:], fill, dtype=arrays[0].dtype)
        for b, a in enumerate(arrays):
            idx: list[Any] = [b] + [slice(None)] * (a.ndim - 1)
            for ax in pos_axes:
                length = a.shape[ax]
                idx[ax] = slice(width - length, width) if padding_side == "left" else slice(0, length)
            out[tuple(idx)] = a[0]
        return out

    cache = {}
    for name, s in served.items():
        pos_axes, fill = _positions(s)
        cache[name] = stack([r[name] for r in results], pos_axes, fill)
    first = None
    if firsts[0] is not None:
        first = stack([np.asarray(f, dtype=np.float32)[None] for f in firsts], (1,), 0.0)
    return first, ActivationCache(cache, tokens, mask, padding_side)


def _positions(s: Served) -> tuple[tuple[int, ...], float]:
    """The position axes of a served array (batch axis included) and its padding value."""
    if s.kind == "stage":
        terms = [t.strip() for t in STAGE_BY_ID[s.stage].shape.strip()[1:-1].split(",")]
        axes = tuple(i + 1 for i, t in enumerate(terms) if t in ("seq_len", "kv_len"))
        return axes, (-np.inf if s.stage == "kq_masked" else 0.0)
    if s.stage in ("kq_masked", "kq_soft_max"):
        return (2, 3), (-np.inf if s.stage == "kq_masked" else 0.0)
    return (1,), 0.0
