"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import OptionError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 means greedy (argmax). ``top_k`` 0 and ``top_p`` 1.0 disable those filters."""

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


def softmax64(logits: np.ndarray) -> np.ndarray:
    """Probabilities in float64 for a float32 ``[vocab_size]`` logit row."""
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
        if p.temperature == 0:
            return int(np.argmax(logits))
        probs = softmax64(logits / p.temperature)
        order = np.argsort(-probs, kind="stable")
        if p.top_k:
            order = order[:p.top_k]
        kept = probs[order]
        if p.top_p < 1.0:
            cum = np.cumsum(kept)
            cut = int(np.searchsorted(cum, p.top_p)) + 1      # smallest prefix with mass >= top_p
            order, kept = order[:cut], kept[:cut]
        kept = kept / kept.sum()
        return int(order[self.rng.choice(len(order), p=kept)])
