"""Choosing the next token from logits: greedy, or temperature → top-k → top-p (nucleus), seeded.

The filters apply in HF transformers' order (its ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``):

1. **temperature** ``T``: probabilities ``softmax(logits / T)``; ``T = 0`` is greedy (argmax, the
   other options are then unused);
2. **top-k**: keep the ``k`` most likely tokens (exactly ``k``: among equal logits the lower id
   wins; HF keeps every tie of the ``k``-th);
3. **top-p**: of those, renormalised, keep the smallest most-likely-first prefix whose mass
   reaches ``p`` (at least one token);

then one token is drawn from what is left, renormalised, with NumPy's ``default_rng(seed)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamatrace.errors import OptionError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 means greedy (argmax). ``top_k`` 0 and ``top_p`` 1.0 disable those filters.

    Raises:
        OptionError: a value out of range (negative temperature, top_k or seed; top_p outside (0, 1])).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise OptionError(f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise OptionError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise OptionError(f"--top-p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed is not None and not (isinstance(self.seed, (int, np.integer)) and self.seed >= 0):
            raise OptionError(f"--seed must be an integer >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def unused_options(self) -> list[str]:
        """The options set away from their default that greedy decoding ignores (CLI names)."""
        if not self.greedy:
            return []
        return [name for name, unused in (("--top-k", self.top_k != 0), ("--top-p", self.top_p != 1.0),
                                          ("--seed", self.seed is not None)) if unused]


def softmax64(logits: np.ndarray) -> np.ndarray:
    """Probabilities, float64 ``[n]``, of one logit row (any float dtype ``[n]``); the row max is
    subtracted first, so large logits do not overflow. Shared by sampling and the trace's top-N."""
    z = logits.astype(np.float64)
    z -= z.max()
    e = np.exp(z)
    return e / e.sum()


class Sampler:
    """Picks token ids from logit rows; deterministic for a given seed."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """``logits``: float32 ``[vocab_size]``. Returns the chosen id."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64)
        z -= z.max()                     # before dividing: a tiny T then gives -inf and 0, not inf - inf
        with np.errstate(over="ignore"):
            probs = softmax64(z / p.temperature)                                 # 1. temperature
        n = probs.size
        if 0 < p.top_k < n:                                                      # 2. top-k, renormalised
            order = _likeliest(probs, p.top_k)
            kept = probs[order] / probs[order].sum()
        elif p.top_p < 1.0:
            # the nucleus lies among the m likeliest once their mass reaches top_p: sort only those
            m = min(64, n)
            while m < n and probs[_likeliest(probs, m)].sum() < p.top_p:
                m = min(4 * m, n)
            order = _likeliest(probs, m)
            kept = probs[order]
        else:
            return int(self.rng.choice(n, p=probs))
        if p.top_p < 1.0:                                                        # 3. top-p
            cut = int(np.searchsorted(np.cumsum(kept), p.top_p)) + 1             # smallest prefix with mass >= top_p
            order, kept = order[:cut], kept[:cut]
        return int(order[self.rng.choice(len(order), p=kept / kept.sum())])


def _likeliest(probs: np.ndarray, m: int) -> np.ndarray:
    """Ids of the ``m`` largest ``probs``, likeliest first (equal probabilities: lower id first)."""
    ids = np.argpartition(-probs, m - 1)[:m] if m < probs.size else np.arange(probs.size)
    return ids[np.lexsort((ids, -probs[ids]))]
