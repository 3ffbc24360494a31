"""Prefill + decode loop. It knows token ids only: no text, no printing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from llamatrace.errors import NumericalError, OptionError, PromptError
from llamatrace.model.sampling import Sampler, SamplingParams
from llamatrace.tracing.recorder import Recorder


@dataclass
class GenerationStats:
    """Counts and timings of one generation (seconds; rates in tokens/s)."""

    prompt_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    stop_reason: str | None = None          # "eos", "max_tokens" or "context"
    ctx_size: int = 0                       # KV-cache capacity used, in tokens
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    last_logits: np.ndarray | None = None   # float32 [vocab_size] after the last forward call

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def default_ctx_size(model, n_prompt: int, max_tokens: int) -> int:
    """KV-cache capacity: ``min(context length, prompt + max_tokens)`` — never a full 128k by default."""
    return min(model.config.max_seq_len, n_prompt + max_tokens)


def check_prompt_fits(model, n_prompt: int, ctx_size: int) -> None:
    """Raise :class:`PromptError` (before any compute) when the prompt cannot fit."""
    if n_prompt == 0:
        raise PromptError("the prompt is empty: give some text (or --prompt-file FILE)")
    max_seq = model.config.max_seq_len
    if n_prompt > min(ctx_size, max_seq):
        if ctx_size >= max_seq:          # nothing to raise: the model's own limit
            raise PromptError(f"the prompt has {n_prompt} tokens but the model's context length is {max_seq}; "
                              f"shorten the prompt")
        raise PromptError(f"the prompt has {n_prompt} tokens but the context holds {ctx_size} (--ctx-size); "
                          f"raise --ctx-size (at most the model's {max_seq}) or shorten the prompt")


def generate(model, prompt_ids: list[int], *, max_tokens: int = 256, sampling: SamplingParams | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, ctx_size: int | None = None, recorder: Recorder | None = None,
             stats: GenerationStats | None = None, stop_ids: frozenset[int] | None = None) -> Iterator[int]:
    """Yield generated token ids one by one.

    The prompt is run as one ``[seq_len, dim]`` prefill at ``start_pos`` 0, then one token per
    decode step. Stops at an end-of-generation id (not yielded), after ``max_tokens``, or when the
    KV cache (``ctx_size`` positions) is full; ``stats.stop_reason`` says which.

    Sampling (see :class:`~llamatrace.model.sampling.SamplingParams`) is greedy by default; give either
    ``sampling`` or the keywords ``temperature``, ``top_k``, ``top_p``, ``seed``.

    Raises:
        OptionError: ``max_tokens`` <= 0, a bad ``ctx_size`` or sampling value, or both
            ``sampling`` and sampling keywords.
        PromptError: empty prompt or one longer than the context.
        NumericalError: logits holding NaN or Inf (raised before sampling from them).
    """
    if max_tokens <= 0:
        raise OptionError(f"--max-tokens must be a positive integer, got {max_tokens}")
    given = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                               ("seed", seed)) if v is not None}
    if sampling is not None and given:
        raise OptionError(f"give either sampling=SamplingParams(...) or {', '.join(given)}=..., not both")
    stats = stats if stats is not None else GenerationStats()
    sampler = Sampler(sampling or SamplingParams(**given))
    stop_ids = model.tokenizer.stop_ids if stop_ids is None else stop_ids
    n_prompt = len(prompt_ids)
    ctx_size = ctx_size or default_ctx_size(model, n_prompt, max_tokens)
    check_prompt_fits(model, n_prompt, ctx_size)
    cache = model.new_cache(ctx_size)
    stats.prompt_tokens, stats.ctx_size = n_prompt, ctx_size

    t0 = time.perf_counter()
    logits = model.forward(np.asarray(prompt_ids), 0, cache, recorder=recorder, phase="prefill")[-1]
    stats.prefill_s = time.perf_counter() - t0
    stats.last_logits = logits
    while True:
        # NaN sorts first (a silent end of text, or any token); max is NaN or +inf if any is: one pass
        if not np.isfinite(logits.max()):
            raise NumericalError(
                f"the logits after position {cache.pos - 1} hold NaN or Inf, so no token can be chosen: the "
                f"model's weights (or an --ablate) make them; `llamatrace trace --check-finite` names the first "
                f"stage that does")
        token = sampler(logits)
        if token in stop_ids:
            stats.stop_reason = "eos"
            return
        stats.generated.append(token)
        yield token
        if len(stats.generated) >= max_tokens:
            stats.stop_reason = "max_tokens"
            return
        if cache.space_left() == 0:
            stats.stop_reason = "context"
            return
        t0 = time.perf_counter()
        logits = model.forward(np.asarray([token]), cache.pos, cache, recorder=recorder, phase="decode")[-1]
        dt = time.perf_counter() - t0
        stats.decode_s += dt
        stats.decode_steps += 1
        stats.last_logits = logits
