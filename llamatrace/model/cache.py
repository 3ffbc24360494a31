"""The KV cache: keys and values of every position seen so far, per layer; and, for a model with
recurrent (gated DeltaNet) layers, their fixed-size states instead."""

from __future__ import annotations

from typing import Iterable

import numpy as np


class RecurrentState:
    """What a gated DeltaNet layer keeps between calls: its size does not grow with the context.

    Attributes:
        conv: float32 ``[conv_dim, conv_kernel-1]``: the last inputs of the causal conv1d
            (llama.cpp's ``conv_states``, ne ``[conv_kernel-1, conv_dim]``).
        ssm: float32 ``[n_v_heads, head_dim, head_dim]``: the delta-rule state, stored as
            llama.cpp stores it (``ssm[h, j, i] = S[i][j]``, so ``ssm[h] @ k = Sᵀk``).
    """

    def __init__(self, conv_dim: int, conv_kernel: int, n_v_heads: int, head_dim: int) -> None:
        self.conv = np.zeros((conv_dim, conv_kernel - 1), dtype=np.float32)
        self.ssm = np.zeros((n_v_heads, head_dim, head_dim), dtype=np.float32)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


class KVCache:
    """Keys/values for ``max_seq`` positions (the chapter's CacheK / CacheV, one per attention layer).

    Attributes:
        k, v: float32 ``[n_attn_layers, max_seq, n_kv_heads, head_dim]``; positions ``[0, pos)`` are
            valid. Layer ``L`` is at index ``slot[L]`` (every layer, unless ``kv_layers`` is given).
        recurrent: ``{layer: RecurrentState}`` of the recurrent layers (empty for a Llama model).
        pos: the next position to write (``start_pos`` of the next forward call).
    """

    def __init__(self, n_layers: int, max_seq: int, n_kv_heads: int, head_dim: int,
                 kv_layers: Iterable[int] | None = None,
                 recurrent: dict[int, RecurrentState] | None = None) -> None:
        self.max_seq = max_seq
        layers = list(range(n_layers) if kv_layers is None else kv_layers)
        self.slot = {layer: i for i, layer in enumerate(layers)}
        self.k = np.zeros((len(layers), max_seq, n_kv_heads, head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.recurrent = recurrent or {}
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.state_nbytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one more position of context costs (the attention layers' keys and values)."""
        return 2 * self.k[:, 0].nbytes

    @property
    def state_nbytes(self) -> int:
        """Bytes of the recurrent layers' states: fixed, whatever the context length."""
        return sum(s.nbytes for s in self.recurrent.values())

    def advance(self, n: int) -> None:
        self.pos += n

    def space_left(self) -> int:
        return self.max_seq - self.pos
