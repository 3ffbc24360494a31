"""The KV cache: keys and values of every position seen so far, per layer."""

from __future__ import annotations

import numpy as np


class KVCache:
    """Keys/values for ``max_seq`` positions (the chapter's CacheK / CacheV, one per layer).

    Attributes:
        k, v: float32 ``[n_layers, max_seq, n_kv_heads, head_dim]``; positions ``[0, pos)`` are valid.
        pos: the next position to write (``start_pos`` of the next forward call).
    """

    def __init__(self, n_layers: int, max_seq: int, n_kv_heads: int, head_dim: int) -> None:
        self.max_seq = max_seq
        self.k = np.zeros((n_layers, max_seq, n_kv_heads, head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def advance(self, n: int) -> None:
        self.pos += n

    def space_left(self) -> int:
        return self.max_seq - self.pos
