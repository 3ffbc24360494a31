"""HF transformers (fp32, eager attention) on the same GGUF, its module outputs read by hooks.

transformers loads a GGUF by dequantizing it and un-permuting ``wq``/``wk`` to HF's split-half
RoPE layout; :func:`hf_stage_arrays` puts the query/key features back in GGUF's interleaved
order, so they pair with ours. Stages inside HF's attention function (RoPE, ``kq``, ``kqv``)
have no module of their own: only ``kq_soft_max`` is read (``output_attentions``).
torch and transformers are imported only when :class:`HFModel` is made.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

def layer_hooks(config) -> dict[str, tuple[str, str]]:
    """Our stage → (module path under ``model.model.layers[L]``, ``"out"`` its output / ``"in"``
    its first input) for the HF modules of ``config``'s architecture (a
    :class:`~llamatrace.model.config.ModelConfig`). ``qkv`` and ``gate_up`` are the fused
    projections (phi3), split by :func:`hf_stage_arrays`. HF's projections include the bias
    (qwen2: ``Qcur_b``); Gemma's ``post_attention_layernorm`` is the post-norm, its FFN pre-norm is
    ``pre_feedforward_layernorm``."""
    c = config
    hooks = {"attn_norm": ("input_layernorm", "out")}
    if c.fused_qkv:                    # the file's layout is the family's: compare.run_hf checks
        hooks["qkv"] = ("self_attn.qkv_proj", "out")
    else:
        b = "_b" if c.qkv_bias else ""
        hooks.update({f"Qcur{b}": ("self_attn.q_proj", "out"), f"Kcur{b}": ("self_attn.k_proj", "out"),
                      f"Vcur{b}": ("self_attn.v_proj", "out")})
    if c.qk_norm:
        hooks.update(Qcur_normed=("self_attn.q_norm", "out"), Kcur_normed=("self_attn.k_norm", "out"))
    hooks.update(kqv_out=("self_attn.o_proj", "in"), attn_out=("self_attn.o_proj", "out"))
    ffn_pre_norm = "post_attention_layernorm"
    if c.post_norms:
        ffn_pre_norm = "pre_feedforward_layernorm"
        hooks.update(attn_post_norm=("post_attention_layernorm", "out"),
                     ffn_post_norm=("post_feedforward_layernorm", "out"))
    hooks.update(ffn_inp=(ffn_pre_norm, "in"), ffn_norm=(ffn_pre_norm, "out"))
    if c.fused_gate_up:
        hooks["gate_up"] = ("mlp.gate_up_proj", "out")
    else:
        hooks.update(ffn_gate=("mlp.gate_proj", "out"), ffn_up=("mlp.up_proj", "out"))
    hooks["ffn_geglu" if c.ffn_act == "gelu" else "ffn_swiglu"] = ("mlp.down_proj", "in")
    hooks.update(ffn_out=("mlp.down_proj", "out"), l_out=("", "out"))
    return hooks


def reading_differences(hf_config, config) -> str:
    """Where HF's config of the file differs from ours (``""`` if nowhere): the query scale and
    the soft-caps, which transformers 5.24's GGUF loader does not read from a Gemma file (it keeps
    ``query_pre_attn_scalar`` 256 and Gemma 2's caps 50 / 30). ``compare`` then shows a divergence
    from layer 0's ``kq_soft_max`` on: HF's model, not ours, departs from the file there."""
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    scalar = getattr(hf_config, "query_pre_attn_scalar", None) or hd
    pairs = (("query scale", scalar ** -0.5, config.kq_scale),
             ("attention soft-cap", getattr(hf_config, "attn_logit_softcapping", None) or 0.0, config.attn_softcap),
             ("final soft-cap", getattr(hf_config, "final_logit_softcapping", None) or 0.0, config.final_softcap))
    return ", ".join(f"{name} {theirs:.4g} (the file: {ours:.4g})" for name, theirs, ours in pairs
                     if not math.isclose(theirs, ours, rel_tol=1e-6))


class HFModel:
    """A GGUF loaded by HF transformers in fp32, run on token ids with a KV cache; ``config`` (our
    :class:`~llamatrace.model.config.ModelConfig` of the file) says which modules hold which stage.

    Raises:
        ImportError: torch or transformers is not installed.
    """

    def __init__(self, path: str, config, threads: int | None = None) -> None:
        import torch
        import transformers
        if threads:
            torch.set_num_threads(threads)
        transformers.logging.set_verbosity_error()        # its progress bars and notices would garble ours
        transformers.logging.disable_progress_bar()
        p = Path(path)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, torch_dtype=torch.float32, attn_implementation="eager").eval()
        self.config = config
        self.settings = {"engine": f"transformers {transformers.__version__} (torch {torch.__version__})",
                         "dtype": "float32", "attention": "eager"}
        differs = reading_differences(self.model.config, config)
        if differs:
            self.settings["reads the file otherwise"] = differs
        self.captured: dict[tuple[int | None, str], np.ndarray] = {}
        self._past = None
        self._heads_first = False
        self._hooks()

    def _hooks(self) -> None:
        inner = self.model.model

        def keep(layer, stage, where):
            def hook(module, args, output):
                x = args[0] if where == "in" else (output[0] if isinstance(output, tuple) else output)
                # per-head norms: Qwen 3 normalizes [batch, pos, head, head_dim], Gemma 3 the view
                # transposed to [batch, head, pos, head_dim], told by the queries' head axis having
                # the smaller stride (one KV head gives equal strides: the keys follow the queries)
                if stage == "Qcur_normed":
                    self._heads_first = args[0].stride(1) < args[0].stride(2)
                if stage in ("Qcur_normed", "Kcur_normed") and self._heads_first:
                    x = x.transpose(1, 2)
                self.captured[(layer, stage)] = x.detach().float().numpy()[0].copy()
            return hook

        # Gemma 3's embedding module multiplies by √dim itself (Gemma 2's model does it afterwards)
        scaled = hasattr(inner.embed_tokens, "embed_scale")
        inner.embed_tokens.register_forward_hook(keep(None, "inp_scaled" if scaled else "inp_embd", "out"))
        inner.norm.register_forward_hook(keep(None, "result_norm", "out"))
        self.model.lm_head.register_forward_hook(keep(None, "result_output", "out"))
        for i, block in enumerate(inner.layers):
            for stage, (path, where) in layer_hooks(self.config).items():
                module = block.get_submodule(path) if path else block
                module.register_forward_hook(keep(i, stage, where))

    def eval(self, ids: list[int]) -> np.ndarray:
        """Run ``ids`` at the next positions; returns the logits float32 ``[len(ids), vocab_size]``;
        :attr:`captured` holds this call's tensors, keyed ``(layer, stage)``."""
        torch = self.torch
        self.captured = {}
        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), past_key_values=self._past, use_cache=True,
                             output_attentions=True)
        self._past = out.past_key_values
        for i, att in enumerate(out.attentions):
            self.captured[(i, "kq_soft_max")] = att.float().numpy()[0].copy()
        return out.logits[0].float().numpy()


def hf_stage_arrays(captured: dict, step: int, config) -> dict[str, np.ndarray]:
    """HF module outputs of one forward call → our keys and layouts: fused projections split,
    query/key features of a Llama file back from HF's split-half order to GGUF's interleaved pairs
    (HF's loader un-permutes them; NeoX-rotary files are stored split-half already), ``*_heads``
    split by ``config.head_dim``."""
    from llamatrace.tracing.recorder import stage_key
    hd = config.head_dim
    split = {"qkv": (("Qcur", "Kcur", "Vcur"), (config.q_dim, config.kv_dim, config.kv_dim)),
             "gate_up": (("ffn_gate", "ffn_up"), (config.hidden_dim, config.hidden_dim))}
    flat = {}
    for (layer, stage), a in captured.items():
        if stage in split:
            names, widths = split[stage]
            for name, part in zip(names, np.split(a, np.cumsum(widths)[:-1], axis=-1)):
                flat[layer, name] = part
        else:
            flat[layer, stage] = a
    out = {}
    for (layer, stage), a in flat.items():
        if stage in ("Qcur", "Kcur", "Qcur_b", "Kcur_b") and not config.rope_neox:
            h = a.reshape(a.shape[0], -1, hd)
            a = np.empty_like(h)
            a[..., 0::2], a[..., 1::2] = h[..., :hd // 2], h[..., hd // 2:]
            a = a.reshape(h.shape[0], -1)
        if stage in ("Qcur_normed", "Kcur_normed"):        # per-head norms: HF's [pos, head, head_dim]
            a = a.reshape(a.shape[0], -1, hd)
        out[stage_key(step, layer, stage)] = a
        if stage.startswith(("Qcur", "Kcur", "Vcur")) and stage[4:] in ("", "_b"):   # the heads: after any bias
            out[stage_key(step, layer, stage[:4] + "_heads")] = a.reshape(a.shape[0], -1, hd)
    return out
