"""The stage catalogue: the single source of truth for every traced stage.

The forward pass (:mod:`llamatrace.model`) emits one event per stage id below, in this order;
the tracer, the renderers, the diagrams and the docs all read this table.

Columns, per :class:`Stage`:

* ``id`` — llama.cpp's graph name (``llama-eval-callback`` prints the same), or our own where
  llama.cpp fuses/reuses a name (``Qcur_rope``, ``kq_scaled``... marked ★ in the docs).
* ``chapter`` — the tensor's variable name in *llama-nuts-and-bolts* ch. 15–16 (``normalizedX``).
* ``section`` / ``book_stage`` — the chapter section and the book's "STAGE N" diagram.
* ``llama_cpp`` / ``llama_cpp_note`` — the name ``llama-eval-callback`` prints for the same tensor in
  llama.cpp's llama graph (``src/models/llama.cpp``, ``src/llama-graph.cpp``), ``None`` where
  llama.cpp has no tensor of its own; the note says where its graph differs (a name given to
  several tensors, an op fused away, flash attention).
* ``tl_hook`` / ``tl_differs`` — the TransformerLens hook (under ``blocks.{L}.`` for layer stages)
  that sees the same tensor, and how ours differs from it (layout, the norm weight, ...).
* ``sources`` / ``residual`` — what the diagrams need to wire a stage: the producer of an input
  whose chapter name is a function-local one (inside ``LlamaAttention.Forward`` ``x`` *is*
  ``normalizedX``; in the FFN ``h`` names three tensors), by stage id; and whether the stage is a
  residual add on the residual stream.
* ``replaceable`` — a real array of its own that a hook (:mod:`llamatrace.tracing.hooks`) may replace;
  ``False`` for views and lazy copies (the KV cache slices, the ``*_heads`` reshapes, the
  repeated KV heads) and the model's inputs ``freqs_cis`` / ``kq_mask``.
* ``shape`` — how the output shape is formed, a formula over :data:`SHAPE_VARS`.
* ``inputs`` — (chapter name, shape formula) of what the stage consumes; weights are in ``weights``
  as (chapter name, GGUF tensor suffix) and print ``[out_features in_features]`` as the chapter does.
* ``when`` — ``always``; ``masked`` (only when a causal mask exists: more than one query row, or
  a sliding-window layer); ``gqa`` (only when ``n_kv_heads < n_heads``); an architecture feature
  (:attr:`ModelConfig.features`: ``qkv_bias``, ``qk_norm``, ``post_norms``, ``gelu``, ``swa``,
  ``moe`` ...) or its absence (``!gelu``), or several joined by ``&`` (``!gelu&!moe``): the stage
  exists only for the architectures that have it.
* ``lines`` — the log-line templates of the default renderer, in the chapter's wording
  (``[DEBUG]`` lines of the book). ``{name}`` is an input's shape, ``{out}`` the output's,
  ``{[formula]}`` any shape formula; also ``{layer1}``, ``{n_layers}``, ``{start_pos}``,
  ``{end_pos}``, ``{n_rep}``, ``{mask}`` and ``{w_<name>}`` for weight shapes.
* ``routing`` — the router's choice (expert ids, their weights): ``[seq_len, n_expert_used]``, small
  enough that the trace prints its values, token by token.
* ``skip_lines`` — printed instead when ``when`` rules the stage out (a decode step's
  "Skipping addition scores + mask"), in the same template language.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

# Shape variables a formula may use. kv_len = start_pos + seq_len (keys held in the cache).
SHAPE_VARS = ("seq_len", "kv_len", "dim", "n_heads", "n_kv_heads", "head_dim", "hidden_dim",
              "vocab_size", "rope_half", "q_dim", "kv_dim", "n_rep", "max_seq", "n_expert", "n_expert_used",
              "expert_hidden_dim",
              # gated DeltaNet layers (ModelConfig.ssm_*)
              "ssm_n_k_heads", "ssm_n_v_heads", "ssm_head_dim", "ssm_conv_dim", "ssm_v_dim")

GROUPS = ("input", "attention", "ffn", "output")


@dataclass(frozen=True)
class Stage:
    id: str
    level: str                 # "model" or "layer"
    op: str                    # the operation, as drawn on diagrams
    chapter: str               # the chapter's tensor name
    section: str               # chapter section (e.g. "15.3.5")
    book_stage: int            # the book's STAGE diagram number
    llama_cpp: str | None      # llama.cpp graph name (None: not a node there)
    tl_hook: str | None        # TransformerLens hook name
    group: str                 # timing roll-up: input / attention / ffn / output
    shape: str                 # output shape formula
    description: str
    inputs: tuple[tuple[str, str], ...] = ()
    weights: tuple[tuple[str, str], ...] = ()
    when: str = "always"
    lines: tuple[str, ...] = ()
    skip_lines: tuple[str, ...] = ()
    llama_cpp_note: str = ""   # where llama.cpp's graph differs ("" = the same tensor)
    tl_differs: str = ""       # where our tensor differs from the TransformerLens hook
    replaceable: bool = True   # a real array a hook may replace (not a view or lazy copy)
    sources: tuple[tuple[str, str], ...] = ()   # (input, producing stage id) the chapter's name can't tell
    residual: bool = False     # a residual add: the stream in, the stream out (drawn on the spine)
    routing: bool = False      # the router's choice (ids, weights): small, its values printed per token
    variants: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()   # (feature, fields it changes)


_RESID = "[seq_len, dim]"

STAGES: tuple[Stage, ...] = (
    # ---- model level, before the blocks ----------------------------------------------------
    Stage("freqs_cis", "model", "RoPE table", "freqsCis", "10", 5, None, None, "input",
          "[seq_len, rope_half]",
          "Rotary frequencies e^(i·pos·θ_j) for this chunk's positions (complex64); for a rope-scaled "
          "model, the global layers' scaled angles and magnitude (linear, YaRN).",
          lines=("Calling precomputeFreqsCis for positions [{start_pos}:{end_pos}] -> tensor freqsCis shape({out})",),
          llama_cpp_note="no tensor: ggml_rope_ext computes the angles from inp_pos inside the RoPE op",
          replaceable=False,
          variants=(("longrope", (
              ("description", "Rotary frequencies e^(i·pos·θ_j/f_j) for this chunk's positions (complex64), each "
                              "pair's angle divided by its LongRoPE factor f_j: the long factors when the context "
                              "(the KV cache's positions) is above the original context, else the short ones, "
                              "as llama.cpp chooses them; cos and sin times the attention factor."),
              ("lines", ("Calling precomputeFreqsCis for positions [{start_pos}:{end_pos}] with LongRoPE's factors "
                         "for a context of {max_seq} (the long ones above {longrope_ctx}, else the short ones) -> "
                         "tensor freqsCis shape({out})",)),
          )),)),
    Stage("kq_mask", "model", "Causal mask", "mask", "14.3", 5, "attn_inp_kq_mask", None, "input",
          "[seq_len, kv_len]",
          "Additive causal mask: -inf where a query would see a later position (prefill only).",
          when="masked",
          lines=("Creating causal mask for sequenceLength {seq_len} and startPos {start_pos} -> tensor mask shape({out})",),
          llama_cpp_note="an input tensor (older builds: KQ_mask); f16 and padded with flash attention",
          replaceable=False),
    Stage("kq_mask_swa", "model", "Window mask", "mask", "14.3", 5, "attn_inp_kq_mask", None, "input",
          "[seq_len, kv_len]",
          "Additive causal mask with the sliding window of the local layers: key p is visible to query i "
          "iff p <= i and i - p < sliding_window (every step, decode too).",
          when="swa",
          lines=("Creating sliding-window mask for sequenceLength {seq_len} and startPos {start_pos} -> tensor mask shape({out})",),
          llama_cpp_note="the iswa input's second mask (named attn_inp_kq_mask too), used by the local layers",
          replaceable=False),
    Stage("inp_embd", "model", "Embedding", "inputTensor", "14.2", 4, "inp_embd", "hook_embed", "input",
          _RESID, "Token embedding rows looked up from token_embd (dequantized).",
          inputs=(("tokens", "[seq_len]"),), weights=(("tok_embd", "token_embd.weight"),),
          lines=("Calling Embedding for tokens shape({tokens}) and LlamaTransformer.tok_embd weights shape({w_tok_embd}) -> tensor inputTensor shape({out})",)),
    # ---- one transformer block ---------------------------------------------------------------
    Stage("inp_scaled", "model", "Scale", "inputTensor", "14.2", 4, "inp_scaled", None, "input",
          _RESID, "Embedding rows multiplied by √dim (Gemma).",
          inputs=(("inputTensor", _RESID),), when="embed_scale",
          lines=("Scaling embeddings inputTensor shape({inputTensor}) by sqrt(dim) -> tensor inputTensor shape({out})",),
          tl_differs="TL's Gemma hook_embed is after this scale"),
    Stage("attn_norm", "layer", "RMSNorm", "normalizedX", "15.1", 6, "attn_norm", "ln1.hook_normalized", "attention",
          _RESID, "Pre-attention RMSNorm of the block input.",
          inputs=(("x", _RESID),), weights=(("attn_norm", "attn_norm.weight"),),
          lines=("Calling LlamaTransformerBlock.Forward for layer: {layer1} / {n_layers}, startPos: {start_pos} -> tensor currentTensor",
                 "LlamaTransformerBlock.Forward started for x: shape({x}), startPos: {start_pos}, freqsCis: shape({[seq_len, rope_half]}), mask: shape({mask})",
                 "Calling RMSNorm for tensor x shape({x}) and LlamaTransformerBlock.attn_norm weights shape({w_attn_norm}) -> tensor normalizedX",
                 "Calling LlamaAttention.Forward for tensor normalizedX shape({out}) and startPos: {start_pos}, freqsCis: shape({[seq_len, rope_half]}), mask: shape({mask}) -> tensor h"),
          tl_differs=("TL hooks x/rms before × attn_norm.weight (from_pretrained folds the weight into "
                      "W_Q/W_K/W_V); ours includes it")),
    Stage("Qcur_full", "layer", "MatMul", "xq", "15.3.3", 8, "Qcur_full", None, "attention",
          "[seq_len, 2*q_dim]", "Joint projection x·wqᵀ: per head the query, then its output gate (Qwen3.5).",
          inputs=(("x", _RESID),), weights=(("attn_wq", "attn_q.weight"),), when="attn_gate",
          lines=("Calling ml.LinearTransformation for x shape({x}) and attn_wq weights shape({w_attn_wq}) -> tensor xq|gate shape({out})",),
          sources=(("x", "attn_norm"),)),
    Stage("Qcur", "layer", "MatMul", "xq", "15.3.3", 8, "Qcur", None, "attention",
          "[seq_len, q_dim]", "Query projection x·wqᵀ.",
          inputs=(("x", _RESID),), weights=(("attn_wq", "attn_q.weight"),),
          lines=("Calling ml.LinearTransformation for x shape({x}) and LlamaAttention.attn_wq weights shape({w_attn_wq}) -> tensor xq",),
          llama_cpp_note="1st of three tensors named Qcur-N: the matmul (then the reshape, then RoPE)",
          tl_differs="TL has no flat hook: attn.hook_q is this split into heads (Qcur_heads)",
          sources=(("x", "Qcur_full|attn_norm"),)),
    Stage("Kcur", "layer", "MatMul", "xk", "15.3.3", 8, "Kcur", None, "attention",
          "[seq_len, kv_dim]", "Key projection x·wkᵀ.",
          inputs=(("x", _RESID),), weights=(("attn_wk", "attn_k.weight"),),
          lines=("Calling ml.LinearTransformation for x shape({x}) and LlamaAttention.attn_wk weights shape({w_attn_wk}) -> tensor xk",),
          llama_cpp_note="1st of three tensors named Kcur-N: the matmul (then the reshape, then RoPE)",
          tl_differs="TL has no flat hook: attn.hook_k is this split into heads (Kcur_heads)",
          sources=(("x", "attn_norm"),)),
    Stage("Vcur", "layer", "MatMul", "xv", "15.3.3", 8, "Vcur", None, "attention",
          "[seq_len, kv_dim]", "Value projection x·wvᵀ.",
          inputs=(("x", _RESID),), weights=(("attn_wv", "attn_v.weight"),),
          lines=("Calling ml.LinearTransformation for x shape({x}) and LlamaAttention.attn_wv weights shape({w_attn_wv}) -> tensor xv",
                 "Parallel results, xq: shape({[seq_len, q_dim]}), xk: shape({[seq_len, kv_dim]}), xv: shape({out})"),
          llama_cpp_note="1st of two tensors named Vcur-N: the matmul (then the reshape)",
          tl_differs="TL has no flat hook: attn.hook_v is this split into heads (Vcur_heads)",
          sources=(("x", "attn_norm"),)),
    Stage("Qcur_b", "layer", "Add bias", "xq", "15.3.3", 8, "Qcur", None, "attention",
          "[seq_len, q_dim]", "Query bias added (Qwen2).",
          inputs=(("xq", "[seq_len, q_dim]"),), weights=(("attn_bq", "attn_q.bias"),), when="qkv_bias",
          lines=("Adding bias attn_q.bias shape({w_attn_bq}) to xq shape({xq}) -> tensor xq",),
          llama_cpp_note="2nd of the Qcur-N tensors of a biased model (ggml_add after the matmul)"),
    Stage("Kcur_b", "layer", "Add bias", "xk", "15.3.3", 8, "Kcur", None, "attention",
          "[seq_len, kv_dim]", "Key bias added (Qwen2).",
          inputs=(("xk", "[seq_len, kv_dim]"),), weights=(("attn_bk", "attn_k.bias"),), when="qkv_bias",
          lines=("Adding bias attn_k.bias shape({w_attn_bk}) to xk shape({xk}) -> tensor xk",),
          llama_cpp_note="2nd of the Kcur-N tensors of a biased model"),
    Stage("Vcur_b", "layer", "Add bias", "xv", "15.3.3", 8, "Vcur", None, "attention",
          "[seq_len, kv_dim]", "Value bias added (Qwen2).",
          inputs=(("xv", "[seq_len, kv_dim]"),), weights=(("attn_bv", "attn_v.bias"),), when="qkv_bias",
          lines=("Adding bias attn_v.bias shape({w_attn_bv}) to xv shape({xv}) -> tensor xv",),
          llama_cpp_note="2nd of the Vcur-N tensors of a biased model"),
    Stage("Qcur_heads", "layer", "Reshape", "xq", "15.3.4", 9, "Qcur", "attn.hook_q", "attention",
          "[seq_len, n_heads, head_dim]", "Queries split into heads (a view).",
          inputs=(("xq", "[seq_len, q_dim]"),),
          lines=("Calling ml.Reshape for xq shape({xq}) -> tensor xq shape({out})",),
          llama_cpp_note="2nd Qcur-N: ggml_reshape_3d of the matmul",
          tl_differs=("same [pos, head, d_head] layout; head_dim order differs (GGUF keeps Meta's "
                      "interleaved RoPE pairs, TL HF's halves): permuted within each head"),
          replaceable=False),
    Stage("Kcur_heads", "layer", "Reshape", "xk", "15.3.4", 9, "Kcur", "attn.hook_k", "attention",
          "[seq_len, n_kv_heads, head_dim]", "Keys split into KV heads (a view).",
          inputs=(("xk", "[seq_len, kv_dim]"),),
          lines=("Calling ml.Reshape for xk shape({xk}) -> tensor xk shape({out})",),
          llama_cpp_note="2nd Kcur-N: ggml_reshape_3d of the matmul",
          tl_differs=("[pos, n_kv_heads, d_head] as TL's grouped-query attention; head_dim permuted within "
                      "each head (interleaved pairs vs HF halves)"),
          replaceable=False),
    Stage("Vcur_heads", "layer", "Reshape", "xv", "15.3.4", 9, "Vcur", "attn.hook_v", "attention",
          "[seq_len, n_kv_heads, head_dim]", "Values split into KV heads (a view).",
          inputs=(("xv", "[seq_len, kv_dim]"),),
          lines=("Calling ml.Reshape for xv shape({xv}) -> tensor xv shape({out})",
                 "Reshaping results, xq: shape({[seq_len, n_heads, head_dim]}), xk: shape({[seq_len, n_kv_heads, head_dim]}), xv: shape({out})"),
          llama_cpp_note="2nd Vcur-N: ggml_reshape_3d of the matmul",
          tl_differs="[pos, n_kv_heads, d_head] as TL's grouped-query attention",
          replaceable=False),
    Stage("Qcur_normed", "layer", "RMSNorm", "xq", "15.3.4", 9, "Qcur_normed", None, "attention",
          "[seq_len, n_heads, head_dim]", "Per-head RMSNorm of the queries (Qwen3, Gemma 3).",
          inputs=(("xq", "[seq_len, n_heads, head_dim]"),), weights=(("attn_q_norm", "attn_q_norm.weight"),),
          when="qk_norm",
          lines=("Calling RMSNorm per head for xq shape({xq}) and attn_q_norm weights shape({w_attn_q_norm}) -> tensor xq",)),
    Stage("Kcur_normed", "layer", "RMSNorm", "xk", "15.3.4", 9, "Kcur_normed", None, "attention",
          "[seq_len, n_kv_heads, head_dim]", "Per-head RMSNorm of the keys (Qwen3, Gemma 3).",
          inputs=(("xk", "[seq_len, n_kv_heads, head_dim]"),), weights=(("attn_k_norm", "attn_k_norm.weight"),),
          when="qk_norm",
          lines=("Calling RMSNorm per head for xk shape({xk}) and attn_k_norm weights shape({w_attn_k_norm}) -> tensor xk",)),
    Stage("Qcur_rope", "layer", "RoPE", "xq", "15.3.5", 10, "Qcur", "attn.hook_rot_q", "attention",
          "[seq_len, n_heads, head_dim]", "Rotary embedding of the queries (adjacent pairs).",
          inputs=(("xq", "[seq_len, n_heads, head_dim]"), ("freqsCis", "[seq_len, rope_half]")),
          lines=("Calling applyRotaryEmbeddings for xq shape({xq}) and freqsCis shape({freqsCis}) -> tensor xq",),
          llama_cpp_note="3rd Qcur-N: the output of ggml_rope_ext",
          tl_differs=("head_dim permuted within each head (interleaved pairs vs HF halves); q·k products "
                      "are equal")),
    Stage("Kcur_rope", "layer", "RoPE", "xk", "15.3.5", 10, "Kcur", "attn.hook_rot_k", "attention",
          "[seq_len, n_kv_heads, head_dim]", "Rotary embedding of the keys (adjacent pairs).",
          inputs=(("xk", "[seq_len, n_kv_heads, head_dim]"), ("freqsCis", "[seq_len, rope_half]")),
          lines=("Calling applyRotaryEmbeddings for xk shape({xk}) and freqsCis shape({freqsCis}) -> tensor xk",
                 "applyRotaryEmbeddings results, xq: shape({[seq_len, n_heads, head_dim]}), xk: shape({out})"),
          llama_cpp_note="3rd Kcur-N: the output of ggml_rope_ext",
          tl_differs=("head_dim permuted within each head (interleaved pairs vs HF halves); q·k products "
                      "are equal")),
    Stage("cache_k", "layer", "SetSlice", "CacheK", "15.3.6", 11, None, None, "attention",
          "[seq_len, n_kv_heads, head_dim]", "Keys written into the KV cache at [start_pos:start_pos+seq_len].",
          inputs=(("xk", "[seq_len, n_kv_heads, head_dim]"), ("CacheK", "[max_seq, n_kv_heads, head_dim]")),
          lines=("Calling CacheK[{layer}].SetSlice for [{start_pos}:{end_pos}] of CacheK shape({CacheK}) with xk shape({xk})",),
          llama_cpp_note="ggml_set_rows into the layer's cache_k_l{N} (no name of its own)",
          replaceable=False),
    Stage("cache_v", "layer", "SetSlice", "CacheV", "15.3.6", 11, None, None, "attention",
          "[seq_len, n_kv_heads, head_dim]", "Values written into the KV cache at [start_pos:start_pos+seq_len].",
          inputs=(("xv", "[seq_len, n_kv_heads, head_dim]"), ("CacheV", "[max_seq, n_kv_heads, head_dim]")),
          lines=("Calling CacheV[{layer}].SetSlice for [{start_pos}:{end_pos}] of CacheV shape({CacheV}) with xv shape({xv})",),
          llama_cpp_note="ggml_set_rows into the layer's cache_v_l{N} (no name of its own)",
          replaceable=False),
    Stage("keys", "layer", "Slice", "keys", "15.3.7", 11, None, None, "attention",
          "[kv_len, n_kv_heads, head_dim]", "All cached keys so far, [0:start_pos+seq_len].",
          inputs=(("CacheK", "[max_seq, n_kv_heads, head_dim]"),),
          lines=("Calling CacheK[{layer}].Slice for [0:{end_pos}] -> tensor keys shape({out})",),
          llama_cpp_note="a view of cache_k_l{N}",
          replaceable=False),
    Stage("values", "layer", "Slice", "values", "15.3.7", 11, None, None, "attention",
          "[kv_len, n_kv_heads, head_dim]", "All cached values so far, [0:start_pos+seq_len].",
          inputs=(("CacheV", "[max_seq, n_kv_heads, head_dim]"),),
          lines=("Calling CacheV[{layer}].Slice for [0:{end_pos}] -> tensor values shape({out})",),
          llama_cpp_note="a view of cache_v_l{N}",
          replaceable=False),
    Stage("keys_rep", "layer", "RepeatKV", "keys", "15.3.8", 11, None, None, "attention",
          "[kv_len, n_heads, head_dim]", "Each KV head repeated n_rep times for grouped-query attention.",
          inputs=(("keys", "[kv_len, n_kv_heads, head_dim]"),), when="gqa",
          lines=("Calling attentionRepeatKV for keys shape({keys}) and nRep {n_rep} -> tensor keys shape({out})",),
          llama_cpp_note="no tensor: ggml_mul_mat broadcasts the KV heads",
          replaceable=False),
    Stage("values_rep", "layer", "RepeatKV", "values", "15.3.8", 11, None, None, "attention",
          "[kv_len, n_heads, head_dim]", "Each KV head repeated n_rep times for grouped-query attention.",
          inputs=(("values", "[kv_len, n_kv_heads, head_dim]"),), when="gqa",
          lines=("Calling attentionRepeatKV for values shape({values}) and nRep {n_rep} -> tensor values shape({out})",),
          llama_cpp_note="no tensor: ggml_mul_mat broadcasts the KV heads",
          replaceable=False),
    Stage("kq", "layer", "MatMul", "xqMatMulKeys", "15.3.9", 13, "kq", None, "attention",
          "[n_heads, seq_len, kv_len]", "Attention scores q·kᵀ per head (after the chapter's transposes).",
          inputs=(("xq", "[n_heads, seq_len, head_dim]"), ("keys", "[n_heads, head_dim, kv_len]")),
          lines=("Multiple transposing results, xq: shape({xq}), keys: shape({keys}), values: shape({[n_heads, kv_len, head_dim]})",
                 "Calling ml.MatMul for xq shape({xq}) and keys shape({keys}) -> tensor xqMatMulKeys"),
          llama_cpp_note=("ggml order [kv_len, seq_len, n_heads] is NumPy's [n_heads, seq_len, kv_len]; "
                          "absent with flash attention")),
    Stage("kq_scaled", "layer", "Scale", "scores", "15.3.9", 13, None, None, "attention",
          "[n_heads, seq_len, kv_len]", "Scores divided by √head_dim.",
          inputs=(("xqMatMulKeys", "[n_heads, seq_len, kv_len]"),),
          lines=("Calling ml.DivToScalar for xqMatMulKeys shape({xqMatMulKeys}) and scalar -> tensor scores",),
          llama_cpp_note="fused: ggml_soft_max_ext scales inside kq_soft_max"),
    Stage("kq_softcap", "layer", "Soft-cap", "scores", "15.3.9", 13, "kq_scaled_2", None, "attention",
          "[n_heads, seq_len, kv_len]", "Scores soft-capped: c·tanh(scores/c) (Gemma 2).",
          inputs=(("scores", "[n_heads, seq_len, kv_len]"),), when="attn_softcap",
          lines=("Soft-capping scores shape({scores}) with tanh -> tensor scores",),
          llama_cpp_note="kq_scaled_1, kq_tanh, kq_scaled_2 without flash attention; fused into it with"),
    Stage("kq_masked", "layer", "Add", "scores", "15.3.9", 13, None, "attn.hook_attn_scores", "attention",
          "[n_heads, seq_len, kv_len]", "Scores plus the causal mask (prefill only).",
          inputs=(("scores", "[n_heads, seq_len, kv_len]"), ("mask", "[seq_len, kv_len]")), when="masked",
          sources=(("mask", "kq_mask"),),     # a sliding-window layer's is kq_mask_swa (diagram.flow.wire)
          lines=("Calling ml.Add to calculate scores shape({scores}) + mask shape({mask}) -> tensor scores",),
          skip_lines=("Skipping addition scores + mask",),
          llama_cpp_note="fused: ggml_soft_max_ext adds attn_inp_kq_mask inside kq_soft_max",
          tl_differs=("TL's hook is scaled and masked at every step; in a decode step (no mask) it equals "
                      "kq_scaled")),
    Stage("kq_soft_max", "layer", "Softmax", "scores", "15.3.9", 13, "kq_soft_max", "attn.hook_pattern", "attention",
          "[n_heads, seq_len, kv_len]", "Softmax over the keys axis, in fp32 (gpt-oss: each head's sink "
          "logit joins the denominator, so a row sums to less than 1).",
          inputs=(("scores", "[n_heads, seq_len, kv_len]"),),
          lines=("Calling ml.Softmax for scores shape({scores}) and dim 2 -> tensor scores",),
          llama_cpp_note=("scale + mask + softmax in one op (gpt-oss: with ggml_soft_max_add_sinks); absent "
                          "with flash attention (one fused node instead)")),
    Stage("kqv", "layer", "MatMul", "output", "15.3.10", 14, "kqv", "attn.hook_z", "attention",
          "[n_heads, seq_len, head_dim]", "Attention-weighted sum of the values, per head.",
          inputs=(("scores", "[n_heads, seq_len, kv_len]"), ("values", "[n_heads, kv_len, head_dim]")),
          lines=("Calling ml.MatMul for scores shape({scores}) and values shape({values}) -> tensor output",),
          llama_cpp_note="absent with flash attention",
          tl_differs=("TL's hook_z is [pos, head, d_head]; ours [n_heads, seq_len, head_dim] (transpose(1, "
                      "0, 2))")),
    Stage("kqv_out", "layer", "Merge heads", "output", "15.3.10", 14, "kqv_out", None, "attention",
          "[seq_len, q_dim]", "Heads transposed back and concatenated.",
          inputs=(("output", "[n_heads, seq_len, head_dim]"),),
          lines=("Calling ml.Transpose and ml.Reshape for output shape({output}) -> tensor output shape({out})",)),
    Stage("gate_sigmoid", "layer", "Sigmoid", "gate", "15.3.10", 14, "gate_sigmoid", None, "attention",
          "[seq_len, q_dim]", "Sigmoid of the output gate that Qcur_full carried beside the query (Qwen3.5).",
          inputs=(("gate", "[seq_len, q_dim]"),), when="attn_gate",
          lines=("Calling ml.Sigmoid for gate shape({gate}) -> tensor gate",),
          sources=(("gate", "Qcur_full"),)),
    Stage("attn_gated", "layer", "Mul", "output", "15.3.10", 14, "attn_gated", None, "attention",
          "[seq_len, q_dim]", "Merged heads × sigmoid(gate), before the output projection (Qwen3.5).",
          inputs=(("output", "[seq_len, q_dim]"), ("gate", "[seq_len, q_dim]")), when="attn_gate",
          lines=("Calling ml.Mul for output shape({output}) and gate shape({gate}) -> tensor output",),
          sources=(("output", "kqv_out"), ("gate", "gate_sigmoid"))),
    Stage("attn_out", "layer", "MatMul", "output", "15.3.10", 14, "attn_out", "hook_attn_out", "attention",
          _RESID, "Attention output projection output·woᵀ.",
          inputs=(("output", "[seq_len, q_dim]"),), weights=(("attn_wo", "attn_output.weight"),),
          lines=("Calling ml.LinearTransformation for output shape({output}) and LlamaAttention.attn_wo weights shape({w_attn_wo}) -> tensor output",
                 "Returning tensor output: shape({out})")),
    # ---- the gated DeltaNet block (recurrent layers, instead of Qcur … attn_out) -----------------
    Stage("linear_attn_qkv_mixed", "layer", "MatMul", "qkv", "DeltaNet", 8, "linear_attn_qkv_mixed", None, "attention",
          "[seq_len, ssm_conv_dim]", "Mixed projection x·attn_qkvᵀ: queries | keys | values of the DeltaNet.",
          inputs=(("x", _RESID),), weights=(("attn_qkv", "attn_qkv.weight"),), when="deltanet",
          lines=("Calling ml.LinearTransformation for x shape({x}) and attn_qkv weights shape({w_attn_qkv}) -> tensor qkv shape({out})",),
          sources=(("x", "attn_norm"),)),
    Stage("z", "layer", "MatMul", "z", "DeltaNet", 8, "z", None, "attention",
          "[seq_len, ssm_v_dim]", "Output gate z = x·attn_gateᵀ (SiLU-gates the normed output).",
          inputs=(("x", _RESID),), weights=(("attn_gate", "attn_gate.weight"),), when="deltanet",
          lines=("Calling ml.LinearTransformation for x shape({x}) and attn_gate weights shape({w_attn_gate}) -> tensor z shape({out})",),
          sources=(("x", "attn_norm"),)),
    Stage("beta_sigmoid", "layer", "Sigmoid", "beta", "DeltaNet", 8, "beta_sigmoid", None, "attention",
          "[seq_len, ssm_n_v_heads]", "Write strength β = sigmoid(x·ssm_betaᵀ) per value head, in (0, 1).",
          inputs=(("x", _RESID),), weights=(("ssm_beta", "ssm_beta.weight"),), when="deltanet",
          lines=("Calling ml.Sigmoid of x shape({x}) · ssm_beta weights shape({w_ssm_beta}) -> tensor beta shape({out})",),
          sources=(("x", "attn_norm"),)),
    Stage("a_softplus", "layer", "Softplus", "a", "DeltaNet", 8, "a_softplus", None, "attention",
          "[seq_len, ssm_n_v_heads]", "softplus(x·ssm_alphaᵀ + ssm_dt): the decay's rate per value head.",
          inputs=(("x", _RESID),), weights=(("ssm_alpha", "ssm_alpha.weight"), ("ssm_dt", "ssm_dt.bias")),
          when="deltanet",
          lines=("Calling ml.Softplus of x shape({x}) · ssm_alpha weights shape({w_ssm_alpha}) + ssm_dt -> tensor a shape({out})",),
          sources=(("x", "attn_norm"),)),
    Stage("gate", "layer", "Mul", "g", "DeltaNet", 8, "gate", None, "attention",
          "[seq_len, ssm_n_v_heads]", "Log-decay g = a·ssm_a (ssm_a = −exp(A_log) < 0): the state is multiplied "
          "by exp(g) ∈ (0, 1) at each token.",
          inputs=(("a", "[seq_len, ssm_n_v_heads]"),), weights=(("ssm_a", "ssm_a"),), when="deltanet",
          lines=("Calling ml.Mul for a shape({a}) and ssm_a weights shape({w_ssm_a}) -> tensor g shape({out})",)),
    Stage("conv_output_silu", "layer", "Conv1d+SiLU", "qkv", "DeltaNet", 9, "conv_output_silu", None, "attention",
          "[seq_len, ssm_conv_dim]", "Causal depthwise conv1d (ssm_conv1d) over the conv state and this chunk, "
          "then SiLU.",
          inputs=(("qkv", "[seq_len, ssm_conv_dim]"),), weights=(("ssm_conv1d", "ssm_conv1d.weight"),),
          when="deltanet",
          lines=("Calling ml.Conv1d with the conv state for qkv shape({qkv}) and ssm_conv1d weights shape({w_ssm_conv1d}), then ml.Silu -> tensor qkv shape({out})",),
          llama_cpp_note="conv_output_raw before the SiLU"),
    Stage("q_conv_predelta", "layer", "L2Norm", "q", "DeltaNet", 9, "q_conv_predelta", None, "attention",
          "[seq_len, ssm_n_k_heads, ssm_head_dim]", "L2-normalised queries x/√(Σx² + eps) per key head; value "
          "head h reads key head h % ssm_n_k_heads.",
          inputs=(("qkv", "[seq_len, ssm_conv_dim]"),), when="deltanet",
          lines=("Calling L2Norm per head of the queries of qkv shape({qkv}) -> tensor q shape({out})",),
          llama_cpp_note="tiled to the value heads (ggml_repeat_4d) unless the fused delta-rule op runs, "
                         "which indexes the key heads itself (the CPU default)"),
    Stage("k_conv_predelta", "layer", "L2Norm", "k", "DeltaNet", 9, "k_conv_predelta", None, "attention",
          "[seq_len, ssm_n_k_heads, ssm_head_dim]", "L2-normalised keys x/√(Σx² + eps) per key head; value "
          "head h reads key head h % ssm_n_k_heads.",
          inputs=(("qkv", "[seq_len, ssm_conv_dim]"),), when="deltanet",
          lines=("Calling L2Norm per head of the keys of qkv shape({qkv}) -> tensor k shape({out})",),
          llama_cpp_note="tiled to the value heads (ggml_repeat_4d) unless the fused delta-rule op runs, "
                         "which indexes the key heads itself (the CPU default)"),
    Stage("v_conv_predelta", "layer", "Reshape", "v", "DeltaNet", 9, "v_conv_predelta", None, "attention",
          "[seq_len, ssm_n_v_heads, ssm_head_dim]", "The values, split into heads.",
          inputs=(("qkv", "[seq_len, ssm_conv_dim]"),), when="deltanet",
          lines=("Splitting the values of qkv shape({qkv}) into heads -> tensor v shape({out})",)),
    Stage("state_predelta", "layer", "State", "S", "DeltaNet", 11, "state_predelta", None, "attention",
          "[ssm_n_v_heads, ssm_head_dim, ssm_head_dim]", "The delta-rule state before this chunk (zeros at the "
          "start), stored transposed as llama.cpp's: [h, j, i] = S[i][j], key index i, value index j.",
          when="deltanet",
          lines=("Reading the DeltaNet state S shape({out}) of layer {layer}",)),
    Stage("attn_output", "layer", "DeltaRule", "o", "DeltaNet", 12, "attn_output", None, "attention",
          "[seq_len, ssm_n_v_heads, ssm_head_dim]", "Gated delta rule per token: S ← exp(g)·S; "
          "S ← S + k·(β(v − Sᵀk))ᵀ; o = Sᵀq/√d (chunked for a prefill, recurrent to decode).",
          inputs=(("q", "[seq_len, ssm_n_v_heads, ssm_head_dim]"), ("k", "[seq_len, ssm_n_v_heads, ssm_head_dim]"),
                  ("v", "[seq_len, ssm_n_v_heads, ssm_head_dim]"), ("S", "[ssm_n_v_heads, ssm_head_dim, ssm_head_dim]")),
          when="deltanet",
          lines=("Calling DeltaRule for q shape({q}), k shape({k}) (their key heads repeated to the value heads), "
                 "v shape({v}), S shape({S}) -> tensor o shape({out})",),
          sources=(("q", "q_conv_predelta"), ("k", "k_conv_predelta"), ("v", "v_conv_predelta"), ("S", "state_predelta"))),
    Stage("new_state", "layer", "State", "S", "DeltaNet", 12, "new_state", None, "attention",
          "[ssm_n_v_heads, ssm_head_dim, ssm_head_dim]", "The delta-rule state after this chunk (kept for the next call).",
          inputs=(("S", "[ssm_n_v_heads, ssm_head_dim, ssm_head_dim]"),), when="deltanet",
          sources=(("S", "attn_output"),),
          lines=("Writing the DeltaNet state S shape({out}) of layer {layer}",),
          llama_cpp_note="a view of the fused GDN op's output (not captured)"),
    Stage("final_output", "layer", "GatedRMSNorm", "o", "DeltaNet", 13, "final_output", None, "attention",
          "[seq_len, ssm_v_dim]", "RMSNorm of each head (ssm_norm) × SiLU(z), heads merged.",
          inputs=(("o", "[seq_len, ssm_n_v_heads, ssm_head_dim]"), ("z", "[seq_len, ssm_v_dim]")),
          weights=(("ssm_norm", "ssm_norm.weight"),), when="deltanet",
          lines=("Calling RMSNorm per head for o shape({o}) and ssm_norm weights shape({w_ssm_norm}), times Silu(z) -> tensor o shape({out})",),
          sources=(("o", "attn_output"), ("z", "z"))),
    Stage("linear_attn_out", "layer", "MatMul", "output", "DeltaNet", 14, "linear_attn_out", None, "attention",
          _RESID, "DeltaNet output projection o·ssm_outᵀ.",
          inputs=(("o", "[seq_len, ssm_v_dim]"),), weights=(("ssm_out", "ssm_out.weight"),), when="deltanet",
          lines=("Calling ml.LinearTransformation for o shape({o}) and ssm_out weights shape({w_ssm_out}) -> tensor output",),
          sources=(("o", "final_output"),)),
    Stage("attn_post_norm", "layer", "RMSNorm", "output", "15.3.10", 14, "attn_post_norm", "ln1_post.hook_normalized",
          "attention", _RESID, "RMSNorm of the attention output before the residual add (Gemma).",
          inputs=(("output", _RESID),), weights=(("attn_post_norm", "post_attention_norm.weight"),),
          when="post_norms",
          lines=("Calling RMSNorm for attention output shape({output}) and post_attention_norm weights shape({w_attn_post_norm}) -> tensor output",),
          tl_differs="TL hooks x/rms before × the weight; ours includes it"),
    Stage("ffn_inp", "layer", "Add", "h", "15.4", 15, "ffn_inp", "hook_resid_mid", "attention",
          _RESID, "Residual: block input plus attention output.",
          inputs=(("x", _RESID), ("h", _RESID)),
          lines=("Calling ml.Add to calculate x shape({x}) + h shape({h}) -> tensor h",),
          sources=(("h", "attn_post_norm|attn_out|linear_attn_out"),), residual=True),
    Stage("ffn_norm", "layer", "RMSNorm", "normalizedH", "15.5", 16, "ffn_norm", "ln2.hook_normalized", "ffn",
          _RESID, "Pre-FFN RMSNorm.",
          inputs=(("h", _RESID),), weights=(("ffn_norm", "ffn_norm.weight"),),
          lines=("Calling RMSNorm for tensor h shape({h}) and LlamaTransformerBlock.ffn_norm weights shape({w_ffn_norm}) -> tensor normalizedH",
                 "Calling LlamaFeedForward.Forward for tensor normalizedH shape({out}) -> tensor ffnOutput"),
          tl_differs=("TL hooks x/rms before × ffn_norm.weight (folded into W_gate/W_in by "
                      "from_pretrained); ours includes it")),
    Stage("ffn_gate", "layer", "MatMul", "h", "15.6", 17, "ffn_gate", "mlp.hook_pre", "ffn",
          "[seq_len, hidden_dim]", "Gate projection x·w1ᵀ.",
          inputs=(("x", _RESID),), weights=(("ffn_gate", "ffn_gate.weight"),), when="!moe",
          lines=("Calling ml.LinearTransformation for x shape({x}) and LlamaFeedForward.ffn_gate weights shape({w_ffn_gate}) -> tensor h",),
          sources=(("x", "ffn_norm"),)),
    Stage("ffn_silu", "layer", "SiLU", "h", "15.6", 17, None, None, "ffn",
          "[seq_len, hidden_dim]", "SiLU (swish) of the gate: h·sigmoid(h).",
          inputs=(("h", "[seq_len, hidden_dim]"),), when="!gelu&!moe",
          lines=("Calling ml.Silu for h shape({h}) -> tensor h",),
          llama_cpp_note="fused: ggml_swiglu_split computes silu(gate)·up in one op (ffn_swiglu)"),
    Stage("ffn_gelu", "layer", "GELU", "h", "15.6", 17, None, None, "ffn",
          "[seq_len, hidden_dim]", "GELU (tanh approximation) of the gate (Gemma).",
          inputs=(("h", "[seq_len, hidden_dim]"),), when="gelu",
          lines=("Calling GELU (tanh) for h shape({h}) -> tensor h",),
          llama_cpp_note="fused: ggml_geglu_split computes gelu(gate)·up in one op (ffn_geglu)"),
    Stage("ffn_up", "layer", "MatMul", "ffnUpX", "15.6", 17, "ffn_up", "mlp.hook_pre_linear", "ffn",
          "[seq_len, hidden_dim]", "Up projection x·w3ᵀ.",
          inputs=(("x", _RESID),), weights=(("ffn_up", "ffn_up.weight"),), when="!moe",
          lines=("Calling ml.LinearTransformation for x shape({x}) and LlamaFeedForward.ffn_up weights shape({w_ffn_up}) -> tensor ffnUpX",),
          sources=(("x", "ffn_norm"),)),
    Stage("ffn_swiglu", "layer", "Multiply", "ffnUpX", "15.6", 17, "ffn_swiglu", "mlp.hook_post", "ffn",
          "[seq_len, hidden_dim]", "SwiGLU: silu(gate) ⊙ up.",
          inputs=(("h", "[seq_len, hidden_dim]"), ("ffnUpX", "[seq_len, hidden_dim]")), when="!gelu&!moe",
          lines=("Calling ml.MultiplyElementwise for h shape({h}) and ffnUpX weights shape({ffnUpX}) -> tensor ffnUpX",)),
    Stage("ffn_geglu", "layer", "Multiply", "ffnUpX", "15.6", 17, "ffn_geglu", "mlp.hook_post", "ffn",
          "[seq_len, hidden_dim]", "GeGLU: gelu(gate) ⊙ up (Gemma).",
          inputs=(("h", "[seq_len, hidden_dim]"), ("ffnUpX", "[seq_len, hidden_dim]")), when="gelu",
          lines=("Multiplying gelu(h) shape({h}) and ffnUpX shape({ffnUpX}) elementwise -> tensor ffnUpX",),
          llama_cpp_note="ggml_geglu_split; its CPU kernel reads GELU from an fp16 table (see docs/models.md)"),
    Stage("ffn_out", "layer", "MatMul", "ffnOutput", "15.6", 17, "ffn_out", "hook_mlp_out", "ffn",
          _RESID, "Down projection h·w2ᵀ.",
          inputs=(("h", "[seq_len, hidden_dim]"),), weights=(("ffn_down", "ffn_down.weight"),), when="!moe",
          lines=("Calling ml.LinearTransformation for h shape({h}) and LlamaFeedForward.ffn_down weights shape({w_ffn_down}) -> tensor output",
                 "Returning tensor output: shape({out})"),
          llama_cpp_note=("the down projection (ffn_down only exists with a bias); the residual sum is "
                          "named ffn_out too"),
          sources=(("h", "ffn_swiglu|ffn_geglu"),)),
    # ---- the mixture-of-experts FFN (moe): llama.cpp's build_moe_ffn ---------------------------
    Stage("ffn_moe_logits", "layer", "MatMul", "routerLogits", "15.6", 17, "ffn_moe_logits", None, "ffn",
          "[seq_len, n_expert]", "Router: one logit per expert, x·ffn_gate_inpᵀ.",
          inputs=(("x", _RESID),), weights=(("ffn_gate_inp", "ffn_gate_inp.weight"),), when="moe",
          lines=("Calling ml.LinearTransformation for x shape({x}) and router ffn_gate_inp weights shape({w_ffn_gate_inp}) -> tensor routerLogits shape({out})",),
          sources=(("x", "ffn_norm"),)),
    Stage("ffn_moe_logits_biased", "layer", "Add", "routerLogits", "15.6", 17, "ffn_moe_logits_biased", None, "ffn",
          "[seq_len, n_expert]", "Router logits plus the router's bias (gpt-oss).",
          inputs=(("routerLogits", "[seq_len, n_expert]"),), weights=(("ffn_gate_inp.bias", "ffn_gate_inp.bias"),),
          when="moe_bias",
          lines=("Calling ml.Add for routerLogits shape({routerLogits}) and ffn_gate_inp.bias -> tensor routerLogits",)),
    Stage("ffn_moe_probs", "layer", "Softmax", "routerProbs", "15.6", 17, "ffn_moe_probs", "mlp.hook_expert_weights", "ffn",
          "[seq_len, n_expert]", "Router probabilities: softmax over the experts (gpt-oss: the logits, unchanged).",
          inputs=(("routerLogits", "[seq_len, n_expert]"),), when="moe",
          tl_differs="TL's Mixtral hook_expert_weights: the same softmax over every expert, flattened to [batch·pos, n_expert]",
          lines=("Calling ml.Softmax for routerLogits shape({routerLogits}) over the experts -> tensor routerProbs shape({out})",),
          variants=(("moe_softmax_weight", (
              ("op", "Identity"),
              ("description", "The router logits, unchanged: gpt-oss's softmax comes after the choice, over the "
                              "chosen experts only (SOFTMAX_WEIGHT); llama.cpp names them ffn_moe_probs all the same."),
              ("tl_differs", "not TL's Mixtral softmax over every expert: the router logits (gpt-oss), flattened to "
                             "[batch·pos, n_expert]"),
              ("lines", ("Taking routerLogits shape({routerLogits}) as they are, no softmax over the experts "
                         "(gpt-oss) -> tensor routerProbs shape({out})",)))),)),
    Stage("ffn_moe_topk", "layer", "Top-k", "expertIds", "15.6", 17, "ffn_moe_topk", "mlp.hook_expert_indices", "ffn",
          "[seq_len, n_expert_used]", "The chosen experts per token, most probable first (int32; ties: the lower index).",
          inputs=(("routerProbs", "[seq_len, n_expert]"),), routing=True, when="moe",
          lines=("Choosing the top {[n_expert_used]} of {[n_expert]} experts per token from routerProbs shape({routerProbs}) -> tensor expertIds shape({out})",),
          llama_cpp_note="ggml_argsort_top_k: a view of ffn_moe_argsort; int32, not captured as f32",
          tl_differs="TL's Mixtral hook_expert_indices: the same ids (int64 there), flattened to [batch·pos, k]"),
    Stage("ffn_moe_weights", "layer", "Get rows", "expertWeights", "15.6", 17, "ffn_moe_weights", None, "ffn",
          "[seq_len, n_expert_used]", "The chosen experts' probabilities.",
          inputs=(("routerProbs", "[seq_len, n_expert]"), ("expertIds", "[seq_len, n_expert_used]")), routing=True,
          when="moe&!moe_softmax_weight",
          lines=("Gathering routerProbs shape({routerProbs}) at expertIds shape({expertIds}) -> tensor expertWeights shape({out})",),
          llama_cpp_note="[1, n_expert_used, n_tokens] in ggml order"),
    Stage("ffn_moe_weights_softmax", "layer", "Softmax", "expertWeights", "15.6", 17, "ffn_moe_weights_softmax", None,
          "ffn", "[seq_len, n_expert_used]", "Softmax over the chosen experts' logits (gpt-oss's SOFTMAX_WEIGHT gating).",
          inputs=(("routerProbs", "[seq_len, n_expert]"), ("expertIds", "[seq_len, n_expert_used]")), routing=True,
          when="moe_softmax_weight",
          lines=("Gathering routerProbs shape({routerProbs}) at expertIds shape({expertIds}), softmax over them -> tensor expertWeights shape({out})",),
          llama_cpp_note="ffn_moe_weights (the gathered logits) is not emitted: its softmax replaces it"),
    Stage("ffn_moe_weights_norm", "layer", "Normalise", "expertWeights", "15.6", 17, "ffn_moe_weights_norm", None, "ffn",
          "[seq_len, n_expert_used]", "The chosen weights divided by their sum (clamped to ≥ 6.1e-5): they add up to 1.",
          inputs=(("expertWeights", "[seq_len, n_expert_used]"),), routing=True, when="moe_norm",
          lines=("Normalising expertWeights shape({expertWeights}) to sum 1 per token -> tensor expertWeights shape({out})",)),
    Stage("ffn_moe_gate", "layer", "MatMul", "expertGate", "15.6", 17, "ffn_moe_gate", None, "ffn",
          "[seq_len, n_expert_used, expert_hidden_dim]", "Each chosen expert's gate projection x·w1[e]ᵀ (tokens grouped by expert, as mul_mat_id).",
          inputs=(("x", _RESID), ("expertIds", "[seq_len, n_expert_used]")), weights=(("ffn_gate_exps", "ffn_gate_exps.weight"),), when="moe",
          lines=("Calling ml.LinearTransformation per chosen expert for x shape({x}) and ffn_gate_exps weights shape({w_ffn_gate_exps}) -> tensor expertGate shape({out})",),
          sources=(("x", "ffn_norm"),)),
    Stage("ffn_moe_up", "layer", "MatMul", "expertUp", "15.6", 17, "ffn_moe_up", None, "ffn",
          "[seq_len, n_expert_used, expert_hidden_dim]", "Each chosen expert's up projection x·w3[e]ᵀ.",
          inputs=(("x", _RESID), ("expertIds", "[seq_len, n_expert_used]")), weights=(("ffn_up_exps", "ffn_up_exps.weight"),), when="moe",
          lines=("Calling ml.LinearTransformation per chosen expert for x shape({x}) and ffn_up_exps weights shape({w_ffn_up_exps}) -> tensor expertUp shape({out})",),
          sources=(("x", "ffn_norm"),)),
    Stage("ffn_moe_gate_biased", "layer", "Add", "expertGate", "15.6", 17, "ffn_moe_gate_biased", None, "ffn",
          "[seq_len, n_expert_used, expert_hidden_dim]", "Each chosen expert's gate plus its bias (gpt-oss).",
          inputs=(("expertGate", "[seq_len, n_expert_used, expert_hidden_dim]"),),
          weights=(("ffn_gate_exps.bias", "ffn_gate_exps.bias"),), when="moe_bias",
          lines=("Calling ml.Add for expertGate shape({expertGate}) and each chosen expert's ffn_gate_exps.bias -> tensor expertGate",)),
    Stage("ffn_moe_up_biased", "layer", "Add", "expertUp", "15.6", 17, "ffn_moe_up_biased", None, "ffn",
          "[seq_len, n_expert_used, expert_hidden_dim]", "Each chosen expert's up plus its bias (gpt-oss).",
          inputs=(("expertUp", "[seq_len, n_expert_used, expert_hidden_dim]"),),
          weights=(("ffn_up_exps.bias", "ffn_up_exps.bias"),), when="moe_bias",
          lines=("Calling ml.Add for expertUp shape({expertUp}) and each chosen expert's ffn_up_exps.bias -> tensor expertUp",)),
    Stage("ffn_moe_swiglu", "layer", "SwiGLU", "expertUp", "15.6", 17, "ffn_moe_swiglu", None, "ffn",
          "[seq_len, n_expert_used, expert_hidden_dim]", "Each chosen expert's silu(gate) ⊙ up.",
          inputs=(("expertGate", "[seq_len, n_expert_used, expert_hidden_dim]"), ("expertUp", "[seq_len, n_expert_used, expert_hidden_dim]")),
          when="moe&!moe_oai",
          lines=("Calling SwiGLU for expertGate shape({expertGate}) and expertUp shape({expertUp}) -> tensor expertUp",)),
    Stage("ffn_moe_swiglu_oai", "layer", "SwiGLU", "expertUp", "15.6", 17, "ffn_moe_swiglu_oai", None, "ffn",
          "[seq_len, n_expert_used, expert_hidden_dim]",
          "Each chosen expert's clamped SwiGLU (gpt-oss): g·sigmoid(1.702 g)·(u + 1), g = min(gate, 7), u = clamp(up, ±7).",
          inputs=(("expertGate", "[seq_len, n_expert_used, expert_hidden_dim]"), ("expertUp", "[seq_len, n_expert_used, expert_hidden_dim]")),
          when="moe_oai",
          lines=("Calling clamped SwiGLU for expertGate shape({expertGate}) and expertUp shape({expertUp}) -> tensor expertUp",)),
    Stage("ffn_moe_down", "layer", "MatMul", "expertOut", "15.6", 17, "ffn_moe_down", None, "ffn",
          "[seq_len, n_expert_used, dim]", "Each chosen expert's down projection h·w2[e]ᵀ.",
          inputs=(("expertUp", "[seq_len, n_expert_used, expert_hidden_dim]"), ("expertIds", "[seq_len, n_expert_used]")), weights=(("ffn_down_exps", "ffn_down_exps.weight"),), when="moe",
          lines=("Calling ml.LinearTransformation per chosen expert for expertUp shape({expertUp}) and ffn_down_exps weights shape({w_ffn_down_exps}) -> tensor expertOut shape({out})",)),
    Stage("ffn_moe_down_biased", "layer", "Add", "expertOut", "15.6", 17, "ffn_moe_down_biased", None, "ffn",
          "[seq_len, n_expert_used, dim]", "Each chosen expert's down projection plus its bias (gpt-oss).",
          inputs=(("expertOut", "[seq_len, n_expert_used, dim]"),),
          weights=(("ffn_down_exps.bias", "ffn_down_exps.bias"),), when="moe_bias",
          lines=("Calling ml.Add for expertOut shape({expertOut}) and each chosen expert's ffn_down_exps.bias -> tensor expertOut",)),
    Stage("ffn_moe_weighted", "layer", "Multiply", "expertOut", "15.6", 17, "ffn_moe_weighted", None, "ffn",
          "[seq_len, n_expert_used, dim]", "Each chosen expert's output times its weight.",
          inputs=(("expertOut", "[seq_len, n_expert_used, dim]"), ("expertWeights", "[seq_len, n_expert_used]")), when="moe",
          lines=("Multiplying expertOut shape({expertOut}) by expertWeights shape({expertWeights}) -> tensor expertOut",)),
    Stage("ffn_moe_out", "layer", "Sum", "ffnOutput", "15.6", 17, "ffn_moe_out", "hook_mlp_out", "ffn",
          _RESID, "The weighted experts' outputs summed over the chosen k: the FFN's output.",
          inputs=(("expertOut", "[seq_len, n_expert_used, dim]"),), when="moe",
          lines=("Summing expertOut shape({expertOut}) over the chosen experts -> tensor ffnOutput shape({out})",),
          llama_cpp_note="a chain of adds over views of ffn_moe_weighted, slot 0 first"),
    # ---- the shared expert (moe_shexp): qwen35moe.cpp's build_layer_ffn ------------------------
    Stage("ffn_shexp", "layer", "MatMul", "sharedOut", "15.6", 17, "ffn_shexp", None, "ffn",
          _RESID, "The shared expert, a SwiGLU FFN every token runs: w2s·(silu(w1s·x) ⊙ w3s·x).",
          inputs=(("x", _RESID),), weights=(("ffn_down_shexp", "ffn_down_shexp.weight"),), when="moe_shexp",
          lines=("Calling the shared expert's SwiGLU FFN for x shape({x}) -> tensor sharedOut shape({out})",),
          sources=(("x", "ffn_norm"),)),
    Stage("shared_expert_gate", "layer", "MatMul", "sharedGate", "15.6", 17, "shared_expert_gate", None, "ffn",
          "[seq_len, 1]", "The shared expert's gate logit, one per token: x·ffn_gate_inp_shexp.",
          inputs=(("x", _RESID),), weights=(("ffn_gate_inp_shexp", "ffn_gate_inp_shexp.weight"),), when="moe_shexp",
          lines=("Calling ml.LinearTransformation for x shape({x}) and ffn_gate_inp_shexp -> tensor sharedGate shape({out})",),
          sources=(("x", "ffn_norm"),)),
    Stage("shared_expert_gate_sigmoid", "layer", "Sigmoid", "sharedGate", "15.6", 17, "shared_expert_gate_sigmoid",
          None, "ffn", "[seq_len, 1]", "sigmoid of the shared expert's gate: how much of it each token takes.",
          inputs=(("sharedGate", "[seq_len, 1]"),), when="moe_shexp",
          lines=("Calling sigmoid for sharedGate shape({sharedGate}) -> tensor sharedGate",)),
    Stage("ffn_shexp_gated", "layer", "Multiply", "sharedOut", "15.6", 17, "ffn_shexp_gated", None, "ffn",
          _RESID, "The shared expert's output times its gate; added to ffn_moe_out, the sum is the FFN's output.",
          inputs=(("sharedOut", _RESID), ("sharedGate", "[seq_len, 1]")), when="moe_shexp",
          lines=("Multiplying sharedOut shape({sharedOut}) by sharedGate shape({sharedGate}) -> tensor sharedOut",),
          llama_cpp_note="the sum ffn_moe_out + ffn_shexp_gated is llama.cpp's ffn_out, not a stage of its own here"),
    Stage("ffn_post_norm", "layer", "RMSNorm", "ffnOutput", "15.6", 17, "ffn_post_norm", "ln2_post.hook_normalized",
          "ffn", _RESID, "RMSNorm of the FFN output before the residual add (Gemma).",
          inputs=(("ffnOutput", _RESID),), weights=(("ffn_post_norm", "post_ffw_norm.weight"),),
          when="post_norms",
          lines=("Calling RMSNorm for FFN output shape({ffnOutput}) and post_ffw_norm weights shape({w_ffn_post_norm}) -> tensor ffnOutput",),
          tl_differs="TL hooks x/rms before × the weight; ours includes it"),
    Stage("l_out", "layer", "Add", "output", "15.7", 18, "l_out", "hook_resid_post", "ffn",
          _RESID, "Residual: h plus FFN output — the block's output.",
          inputs=(("h", _RESID), ("ffnOutput", _RESID)),
          lines=("Calling ml.Add to calculate h shape({h}) + ffnOutput shape({ffnOutput}) -> tensor output",
                 "Returning tensor output: shape({out})"),
          llama_cpp_note=("named ffn_out first (the residual add), l_out after build_cvec (the same values "
                          "without a control vector)"),
          sources=(("h", "ffn_inp"),), residual=True),
    # ---- model level, after the blocks --------------------------------------------------------
    Stage("result_norm", "model", "RMSNorm", "currentTensor", "16.1", 19, "result_norm", "ln_final.hook_normalized", "output",
          _RESID, "Final RMSNorm of the last block's output.",
          inputs=(("currentTensor", _RESID),), weights=(("output_norm", "output_norm.weight"),),
          lines=("Calling RMSNorm for currentTensor shape({currentTensor}) (result of all transformer blocks) and LlamaTransformer.output_norm weights shape({w_output_norm}) -> tensor currentTensor",),
          tl_differs=("TL hooks x/rms before × output_norm.weight (folded into W_U by from_pretrained); "
                      "ours includes it")),
    Stage("result_output", "model", "MatMul", "output", "16.2", 19, "result_output", None, "output",
          "[seq_len, vocab_size]", "Output projection to vocabulary logits (all positions when traced).",
          inputs=(("currentTensor", _RESID),), weights=(("output", "output.weight"),),
          lines=("Calling ml.LinearTransformation for currentTensor (normalized result of all transformer blocks) shape({currentTensor}) and LlamaTransformer.output weights shape({w_output}) -> tensor output",
                 "Returning tensor output: shape({out})"),
          tl_differs="TL has no hook here: the logits are what the model returns"),
    Stage("result_softcap", "model", "Soft-cap", "output", "16.2", 19, "result_output", None, "output",
          "[seq_len, vocab_size]", "Final logits soft-capped: c·tanh(logits/c) (Gemma 2).",
          inputs=(("output", "[seq_len, vocab_size]"),), when="final_softcap",
          lines=("Soft-capping logits output shape({output}) with tanh -> tensor output",),
          llama_cpp_note="llama.cpp's result_output is these capped logits (ours: the projection before)",
          tl_differs="TL has no hook here: the logits are what the model returns"),
)

STAGE_BY_ID: dict[str, Stage] = {s.id: s for s in STAGES}
STAGE_IDS: tuple[str, ...] = tuple(s.id for s in STAGES)
LAYER_STAGE_IDS: tuple[str, ...] = tuple(s.id for s in STAGES if s.level == "layer")
SOFTMAX_ATTENTION_IDS: frozenset[str] = frozenset(
    STAGE_IDS[STAGE_IDS.index("Qcur_full"):STAGE_IDS.index("attn_out") + 1])
"""The softmax attention's stages, which a recurrent (DeltaNet) layer replaces by its block's."""


def stage_applies(stage: Stage, seq_len: int, n_rep: int, features: frozenset[str] = frozenset(),
                  local: bool = False, recurrent: bool = False) -> bool:
    """Whether ``stage`` is emitted for a chunk of ``seq_len`` queries with ``n_rep`` query heads per KV head,
    by a model with ``features`` (:attr:`ModelConfig.features`; empty: Llama) in a layer that is
    ``local`` (sliding window: its window mask is added at every step) or ``recurrent`` (a gated
    DeltaNet layer: its block's stages instead of softmax attention's)."""
    if stage.level == "layer" and (stage.id in SOFTMAX_ATTENTION_IDS if recurrent else stage.when == "deltanet"):
        return False
    if "&" in stage.when:
        return all(stage_applies(replace(stage, when=term), seq_len, n_rep, features, local, recurrent)
                   for term in stage.when.split("&"))
    if stage.when == "masked":
        return seq_len > 1 or local
    if stage.when == "gqa":
        return n_rep > 1
    if stage.when.startswith("!"):
        return stage.when[1:] not in features
    if stage.when != "always":
        return stage.when in features
    return True


FEATURE_WORDS = {
    "moe": "a mixture of experts", "moe_norm": "normalised expert weights", "moe_bias": "router and expert biases",
    "moe_softmax_weight": "a softmax over the chosen experts (gpt-oss)", "moe_oai": "the clamped SwiGLU (gpt-oss)",
    "moe_shexp": "a shared expert", "deltanet": "gated DeltaNet layers", "attn_gate": "gated attention output",
    "qkv_bias": "q/k/v biases", "qk_norm": "q/k norms", "post_norms": "post-norms (Gemma)", "gelu": "GELU (Gemma)",
    "embed_scale": "a scaled embedding (Gemma)", "swa": "sliding-window layers", "attn_softcap": "soft-capped scores",
    "final_softcap": "soft-capped logits", "gqa": "grouped-query attention (n_rep > 1)",
    "attn_sinks": "attention sinks",
}
"""How an error names each ``when`` term of the catalogue (:func:`absent_reason`)."""


@functools.lru_cache(maxsize=None)
def stage_for(stage_id: str, features: frozenset[str] = frozenset()) -> Stage:
    """The catalogue's stage ``stage_id`` as a model with ``features`` (:attr:`ModelConfig.features`)
    computes it: its :attr:`Stage.variants` for those features applied (gpt-oss's ``ffn_moe_probs``
    is the logits, no softmax), else the stage itself."""
    stage = STAGE_BY_ID[stage_id]
    for feature, fields in stage.variants:
        if feature in features:
            stage = replace(stage, **dict(fields))
    return stage


def model_stage_ids(config) -> frozenset[str]:
    """The ids of the stages a forward pass of ``config``'s model (a ModelConfig) emits somewhere: in
    a layer of each kind it has (sliding-window, gated DeltaNet), in a prefill or a decode step."""
    kinds = {(config.is_local(i), config.is_recurrent(i)) for i in range(config.n_layers)} or {(False, False)}
    return frozenset(s.id for s in STAGES for seq_len in (1, 2) for local, recurrent in kinds
                     if stage_applies(s, seq_len, config.n_rep, config.features, local, recurrent))


def stage_layers(stage_id: str, config, seq_len: int | None = None) -> tuple[int, ...]:
    """The layers where the layer stage ``stage_id`` is emitted (in a prefill or a decode step, or in
    a step of ``seq_len`` tokens) by ``config``'s model: all of them, or those of one kind (a hybrid's
    gated DeltaNet or attention layers)."""
    s = STAGE_BY_ID[stage_id]
    return tuple(i for i in range(config.n_layers) if any(
        stage_applies(s, n, config.n_rep, config.features, config.is_local(i), config.is_recurrent(i))
        for n in ((1, 2) if seq_len is None else (seq_len,))))


def layer_list(layers) -> str:
    """``0, 1, 3``; runs of three or more as ranges: ``0-29``, ``0, 2-5, 9``; a long list of
    scattered layers cut: ``0, 2, 4, 6, 8, 10 … 46``."""
    layers = sorted(set(layers))
    parts, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts += [f"{layers[i]}-{layers[j]}"] if j - i >= 2 else [str(n) for n in layers[i:j + 1]]
        i = j + 1
    return ", ".join(parts) if len(parts) <= 8 else f"{', '.join(parts[:6])} … {parts[-1]}"


def layer_kind(config, layer: int) -> str:
    """``layer``'s kind in words, for a message: gated DeltaNet, sliding-window or softmax attention."""
    if config.is_recurrent(layer):
        return "a gated DeltaNet layer"
    return "a sliding-window attention layer" if config.is_local(layer) else "a softmax-attention layer"


def absent_reason(stage_id: str, config) -> str:
    """Why the stage ``stage_id`` is not one of ``config``'s model (:func:`model_stage_ids`), in words,
    with the stages it has in its place: e.g. ``"ffn_out is not computed by a model with a mixture
    of experts: its FFN's output is ffn_moe_out"``."""
    features = config.features | ({"gqa"} if config.n_rep > 1 else set())
    terms = STAGE_BY_ID[stage_id].when.split("&")
    missing = [t for t in terms if not t.startswith("!") and t in FEATURE_WORDS and t not in features]
    present = [t[1:] for t in terms if t.startswith("!") and t[1:] in features]
    if present:
        why = f"{stage_id} is not computed by a model with {FEATURE_WORDS[present[0]]}"
    elif missing:
        why = f"{stage_id} is computed only by models with {FEATURE_WORDS[missing[0]]}, and this one has none"
    else:
        why = f"{stage_id} is not computed by this model"
    have = model_stage_ids(config)
    twin = stage_id.replace("ffn_", "ffn_moe_", 1) if "moe" in features else stage_id.replace("ffn_moe_", "ffn_", 1)
    close = [twin] if twin in have and twin != stage_id else \
        difflib.get_close_matches(twin, sorted(have), n=2, cutoff=0.75)
    if stage_id == "ffn_out" and "ffn_moe_out" in have:
        return f"{why}: its FFN's output is ffn_moe_out"
    return f"{why}; it has {' or '.join(close)}" if close else f"{why} (llamatrace stages -m MODEL lists those it has)"


_TERM = re.compile(r"^([a-z_]+|[0-9]+)(\*([a-z_]+|[0-9]+))*$")


def eval_shape(formula: str, dims: Mapping[str, int]) -> tuple[int, ...]:
    """Evaluate a shape formula such as ``"[seq_len, n_heads, head_dim]"`` or ``"[n_heads*head_dim]"``.

    Raises:
        KeyError: an unknown variable (a catalogue bug).
    """
    body = formula.strip()[1:-1].strip()
    if not body:
        return ()
    out = []
    for term in body.split(","):
        term = term.strip()
        if not _TERM.match(term):
            raise ValueError(f"bad shape term {term!r} in {formula!r}")
        value = 1
        for name in term.split("*"):
            value *= int(name) if name.isdigit() else int(dims[name])
        out.append(value)
    return tuple(out)


def unknown_hint(name: str, ids: Sequence[str]) -> str:
    """The end of an "unknown stage" message: the close ids, then where the list is (one line, not
    the catalogue's 80-odd ids)."""
    close = difflib.get_close_matches(name, ids, n=3, cutoff=0.6)
    return (f"; did you mean {' or '.join(close)}?" if close else "") + \
        " (`llamatrace stages -m MODEL` lists those of a model)"


def select_stages(patterns: Iterable[str] | None) -> frozenset[str]:
    """Stage ids matching any of ``patterns`` (ids or shell globs such as ``kq*``).

    Raises:
        ValueError: a pattern matches no stage (the message names the closest ids).
    """
    if patterns is None:
        return frozenset(STAGE_IDS)
    chosen: set[str] = set()
    for pattern in patterns:
        hits = [sid for sid in STAGE_IDS if fnmatch.fnmatchcase(sid, pattern)]
        if not hits:
            raise ValueError(f"unknown stage {pattern!r}{unknown_hint(pattern, STAGE_IDS)}")
        chosen.update(hits)
    return frozenset(chosen)
