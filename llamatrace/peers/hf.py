"""HF transformers (fp32, eager attention) on the same GGUF, its module outputs read by hooks.

transformers loads a GGUF by dequantizing it and un-permuting ``wq``/``wk`` to HF's split-half
RoPE layout; :func:`hf_stage_arrays` puts the query/key features back in GGUF's interleaved
order, so they pair with ours. Stages inside HF's attention function (RoPE, ``kq``, ``kqv``)
have no module of their own: only ``kq_soft_max`` is read (``output_attentions``).
torch and transformers are imported only when :class:`HFModel` is made.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# our stage → (module path under model.model.layers[L], "out" output / "in" first input)
_LAYER_HOOKS = {
    "attn_norm": ("input_layernorm", "out"), "Qcur": ("self_attn.q_proj", "out"),
    "Kcur": ("self_attn.k_proj", "out"), "Vcur": ("self_attn.v_proj", "out"),
    "kqv_out": ("self_attn.o_proj", "in"), "attn_out": ("self_attn.o_proj", "out"),
    "ffn_inp": ("post_attention_layernorm", "in"), "ffn_norm": ("post_attention_layernorm", "out"),
    "ffn_gate": ("mlp.gate_proj", "out"), "ffn_up": ("mlp.up_proj", "out"),
    "ffn_swiglu": ("mlp.down_proj", "in"), "ffn_out": ("mlp.down_proj", "out"), "l_out": ("", "out"),
}


class HFModel:
    """A GGUF loaded by HF transformers in fp32, run on token ids with a KV cache.

    Raises:
        ImportError: torch or transformers is not installed.
    """

    def __init__(self, path: str, threads: int | None = None) -> None:
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
        cfg = self.model.config
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.settings = {"engine": f"transformers {transformers.__version__} (torch {torch.__version__})",
                         "dtype": "float32", "attention": "eager"}
        self.captured: dict[tuple[int | None, str], np.ndarray] = {}
        self._past = None
        self._hooks()

    def _hooks(self) -> None:
        inner = self.model.model

        def keep(layer, stage, where):
            def hook(module, args, output):
                x = args[0] if where == "in" else (output[0] if isinstance(output, tuple) else output)
                self.captured[(layer, stage)] = x.detach().float().numpy()[0].copy()
            return hook

        inner.embed_tokens.register_forward_hook(keep(None, "inp_embd", "out"))
        inner.norm.register_forward_hook(keep(None, "result_norm", "out"))
        self.model.lm_head.register_forward_hook(keep(None, "result_output", "out"))
        for i, block in enumerate(inner.layers):
            for stage, (path, where) in _LAYER_HOOKS.items():
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


def hf_stage_arrays(captured: dict, step: int, head_dim: int) -> dict[str, np.ndarray]:
    """HF module outputs of one forward call → our keys and layouts: query/key features back
    from HF's split-half order to GGUF's interleaved pairs, ``*_heads`` split by ``head_dim``."""
    from llamatrace.tracing.recorder import stage_key
    out = {}
    for (layer, stage), a in captured.items():
        if stage in ("Qcur", "Kcur"):
            h = a.reshape(a.shape[0], -1, head_dim)
            inter = np.empty_like(h)
            inter[..., 0::2], inter[..., 1::2] = h[..., :head_dim // 2], h[..., head_dim // 2:]
            out[stage_key(step, layer, stage)] = inter.reshape(a.shape)
            out[stage_key(step, layer, stage + "_heads")] = inter
        elif stage == "Vcur":
            out[stage_key(step, layer, stage)] = a
            out[stage_key(step, layer, "Vcur_heads")] = a.reshape(a.shape[0], -1, head_dim)
        else:
            out[stage_key(step, layer, stage)] = a
    return out
