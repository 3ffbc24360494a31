"""An independent float64 NumPy Llama forward pass, for checking ours on tiny models.

Written from Meta's reference ``model.py`` (complex-number RoPE over adjacent pairs,
``repeat_kv``, triu mask), reading weights with ``gguf.GGUFReader`` and
``gguf.quants.dequantize`` — it shares no code with llamatrace.
"""

from __future__ import annotations

import gguf
import numpy as np


def load_dequantized(path) -> tuple[dict, dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        weights[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
    return meta, weights


ABLATABLE = ("inp_embd", "kq_soft_max", "kqv", "attn_out", "ffn_swiglu", "ffn_out", "l_out")


def reference_logits(path, tokens: list[int], ablate=()) -> np.ndarray:
    """float64 ``[seq_len, vocab_size]`` logits of the whole sequence (no cache).

    ``ablate``: ``(stage, layer, head)`` triples zeroed where computed (layer ``None`` for
    ``inp_embd``; head ``None`` = the whole tensor, else that query head of ``kq_soft_max`` /
    ``kqv``); stages in :data:`ABLATABLE`, named as llamatrace's catalogue names them.
    """
    zero = {}
    for stage, layer, head in ablate:
        if stage not in ABLATABLE:
            raise KeyError(f"the reference cannot ablate {stage!r}")
        zero.setdefault((stage, layer), []).append(head)

    def ablated(stage, layer, a, head_axis=None):
        for head in zero.get((stage, layer), ()):
            a = a.copy()
            if head is None:
                a[...] = 0
            else:
                index = [slice(None)] * a.ndim
                index[head_axis] = head
                a[tuple(index)] = 0
        return a

    meta, W = load_dequantized(path)
    dim = int(meta["llama.embedding_length"])
    n_heads = int(meta["llama.attention.head_count"])
    n_kv = int(meta["llama.attention.head_count_kv"])
    eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    n_layers = int(meta["llama.block_count"])
    hd = dim // n_heads
    seq = len(tokens)

    def rmsnorm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    freqs = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    if "rope_freqs.weight" in W:                                        # Llama 3.1 scaling factors
        freqs = freqs / W["rope_freqs.weight"]
    freqs_cis = np.exp(1j * np.outer(np.arange(seq), freqs))          # [seq, hd/2]

    def rope(x):                                                       # [seq, heads, hd]
        xc = x.reshape(*x.shape[:-1], hd // 2, 2)
        xc = (xc[..., 0] + 1j * xc[..., 1]) * freqs_cis[:, None, :]
        return np.stack([xc.real, xc.imag], axis=-1).reshape(x.shape)

    mask = np.triu(np.full((seq, seq), -np.inf), k=1)
    x = ablated("inp_embd", None, W["token_embd.weight"][tokens])
    for i in range(n_layers):
        p = f"blk.{i}."
        xn = rmsnorm(x, W[p + "attn_norm.weight"])
        q = rope((xn @ W[p + "attn_q.weight"].T).reshape(seq, n_heads, hd))
        k = rope((xn @ W[p + "attn_k.weight"].T).reshape(seq, n_kv, hd))
        v = (xn @ W[p + "attn_v.weight"].T).reshape(seq, n_kv, hd)
        k = np.repeat(k, n_heads // n_kv, axis=1)
        v = np.repeat(v, n_heads // n_kv, axis=1)
        scores = np.einsum("shd,thd->hst", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        scores = ablated("kq_soft_max", i, scores, head_axis=0)
        out = ablated("kqv", i, np.einsum("hst,thd->shd", scores, v), head_axis=1).reshape(seq, dim)
        h = x + ablated("attn_out", i, out @ W[p + "attn_output.weight"].T)
        hn = rmsnorm(h, W[p + "ffn_norm.weight"])
        g = hn @ W[p + "ffn_gate.weight"].T
        swiglu = ablated("ffn_swiglu", i, g / (1 + np.exp(-g)) * (hn @ W[p + "ffn_up.weight"].T))
        x = ablated("l_out", i, h + ablated("ffn_out", i, swiglu @ W[p + "ffn_down.weight"].T))
    out_w = W.get("output.weight", W["token_embd.weight"])
    return rmsnorm(x, W["output_norm.weight"]) @ out_w.T
