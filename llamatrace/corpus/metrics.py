"""Per-token arithmetic of ``llama-perplexity`` and the statistics of a run, in NumPy.

Source: llama.cpp ``tools/perplexity/perplexity.cpp`` (functions named below). For a chunk of
``n_ctx`` tokens only the second half is scored: the logits at positions ``first = n_ctx // 2`` …
``n_ctx - 2`` against the token that follows each (``n_ctx - 1 - first`` tokens a chunk).

Per token, with logits ``z`` (float32 ``[n_vocab]``) and the next token ``t``:

* ``nll = log Σ exp(z) - z[t]`` (``log_softmax``; max subtracted first, the sum in float64);
* the base model's log-probabilities, stored as llama.cpp does (``log_softmax`` with a
  ``uint16 * log_prob`` argument): the row ``log p = scale * q + min_log_prob`` with
  ``q`` uint16, ``min_logit = max(min z, max z - 16)``, ``scale = (max z - min_logit) / 65535``;
  logits at or below ``min_logit`` store 0. The two float32 ``scale``, ``min_log_prob`` fill
  the row's first four uint16 (:data:`HEADER`); a row is :func:`row_width` uint16 long.
* against such a base row ``b`` (log-probabilities): ``KLD = Σ_{b_i > -16} exp(b_i) (b_i - log q_i)``,
  ``Δp = exp(-nll) - exp(-nll_base)``, same top token ``argmax z == argmax b`` (first maximum).

Statistics (``perplexity`` and ``kl_divergence``): ``PPL = exp(mean nll)``, its error
``PPL * sqrt((mean nll² - mean nll²) / (n - 1))``; ``mean_and_uncertainty`` gives 0 error for
``n <= 10``; percentiles interpolate linearly in the sorted values (NumPy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

HEADER = 4                    # uint16 slots holding the float32 (scale, min_log_prob) of a base row
KLD_FLOOR = np.float32(-16)   # base log-probabilities at or below this are left out of the KLD sum


def row_width(n_vocab: int) -> int:
    """uint16 per stored base row: header + ``n_vocab``, padded to even (llama.cpp's ``nv``)."""
    return 2 * ((n_vocab + 1) // 2) + HEADER


def _log_sum_exp(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row max (float32 ``[n]``) and log Σ exp(z - max) (float64 ``[n]``) of float32 ``[n, n_vocab]``."""
    z_max = logits.max(axis=1)
    sum_exp = np.empty(len(logits), dtype=np.float64)
    row = np.empty(logits.shape[1], dtype=np.float32)
    for i, z in enumerate(logits):      # a row at a time, its exps in cache: 2x the whole array's speed at 8B
        np.subtract(z, z_max[i], out=row)
        np.exp(row, out=row)
        sum_exp[i] = row.sum(dtype=np.float64)
    return z_max, np.log(sum_exp)


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target: float64 ``[n]`` from float32 ``[n, n_vocab]`` logits
    and int ``[n]`` targets (``perplexity.cpp``: ``log_softmax`` / ``process_logits``)."""
    z_max, lse = _log_sum_exp(logits)
    picked = logits[np.arange(len(targets)), targets]
    return (z_max.astype(np.float64) + lse) - picked.astype(np.float64)


def compress_log_probs(logits: np.ndarray) -> np.ndarray:
    """The base rows llama.cpp stores: uint16 ``[n, row_width(n_vocab)]`` from float32 ``[n, n_vocab]``
    logits (``perplexity.cpp``: ``log_softmax(n_vocab, logits, uint16_t * log_prob, tok)``)."""
    n, n_vocab = logits.shape
    z_max = logits.max(axis=1)
    z_min = np.maximum(logits.min(axis=1), z_max - np.float32(16))
    _, lse = _log_sum_exp(logits)
    lse32 = lse.astype(np.float32)
    scale = ((z_max - z_min) / np.float32(65535)).astype(np.float32)
    min_log_prob = (z_min - z_max - lse32).astype(np.float32)
    rows = np.zeros((n, row_width(n_vocab)), dtype=np.uint16)
    rows[:, :HEADER] = np.stack([scale, min_log_prob], axis=1).view(np.uint16)
    safe = np.where(scale > 0, scale, np.float32(1))
    inv_scale = (np.float32(1) / safe).astype(np.float32)
    q = np.rint(inv_scale[:, None] * (logits - z_min[:, None]))    # nearest, ties to even as nearest_int
    q = np.where((logits > z_min[:, None]) & (scale[:, None] > 0), q, 0)
    rows[:, HEADER:HEADER + n_vocab] = q.astype(np.uint16)
    return rows


def base_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """float32 ``[n, n_vocab]`` log-probabilities back from uint16 base rows."""
    header = np.ascontiguousarray(rows[:, :HEADER]).view(np.float32)      # [n, 2]: scale, min_log_prob
    q = rows[:, HEADER:HEADER + n_vocab].astype(np.float32)
    return header[:, :1] * q + header[:, 1:2]


@dataclass
class TokenKLD:
    """Per-token comparison of a model's logits with a base model's stored rows (float64 ``[n]``
    each; ``same_top`` bool ``[n]``)."""

    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray


def token_kld(logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> TokenKLD:
    """``perplexity.cpp``'s ``log_softmax(..., base_log_prob, tok, kld)`` for each row: float32
    ``[n, n_vocab]`` logits, uint16 ``[n, row_width]`` base rows, int ``[n]`` targets."""
    n, n_vocab = logits.shape
    idx = np.arange(n)
    z_max, lse = _log_sum_exp(logits)
    log_z = (z_max.astype(np.float64) + lse).astype(np.float32)        # log Σ exp(z), float as in C
    nll = (log_z - logits[idx, targets]).astype(np.float64)
    base = base_log_probs(base_rows, n_vocab)
    nll_base = -base[idx, targets].astype(np.float64)
    kept = base > KLD_FLOOR
    terms = np.exp(base.astype(np.float64)) * (base - logits + log_z[:, None]).astype(np.float64)
    kld = np.where(kept, terms, 0.0).sum(axis=1)
    same_top = logits.argmax(axis=1) == base.argmax(axis=1)
    p_diff = np.exp(-nll.astype(np.float32)).astype(np.float64) - np.exp(-nll_base.astype(np.float32)).astype(np.float64)
    return TokenKLD(nll, nll_base, kld, p_diff, same_top)


def mean_and_uncertainty(total: float, total_sq: float, count: int) -> tuple[float, float]:
    """Mean and its standard error from a sum and a sum of squares (``kl_divergence``'s lambda)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total_sq / count - mean * mean
    return mean, (math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0)


def _percentile(sorted_values: np.ndarray, fraction: float) -> float:
    return float(np.percentile(sorted_values, 100.0 * fraction)) if sorted_values.size else 0.0


@dataclass
class PerplexityStats:
    """Running sums of per-token NLL, in chunk order; :meth:`add` one chunk at a time."""

    nll_sum: float = 0.0
    nll_sq_sum: float = 0.0
    count: int = 0
    running: list[float] = field(default_factory=list)    # PPL after each chunk (``[i]…`` values)

    def add(self, nll: np.ndarray) -> float:
        """Add a chunk's float64 ``[n_scored]`` NLL; returns the running PPL."""
        for v in nll.tolist():             # in token order, as llama.cpp's single-thread sum
            self.nll_sum += v
            self.nll_sq_sum += v * v
        self.count += len(nll)
        self.running.append(math.exp(self.nll_sum / self.count))
        return self.running[-1]

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.count)

    @property
    def ppl_error(self) -> float:
        """``Final estimate``'s ± (``perplexity()``): PPL times the standard error of mean NLL."""
        mean = self.nll_sum / self.count
        var = self.nll_sq_sum / self.count - mean * mean
        return self.ppl * math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0


@dataclass
class KLDStats:
    """The ``--kl-divergence`` statistics of a run, from every scored token's :class:`TokenKLD`."""

    ppl: float
    ppl_error: float
    ppl_base: float
    ppl_base_error: float
    ln_ppl_ratio: float
    ln_ppl_ratio_error: float
    mean_kld: float
    mean_kld_error: float
    median_kld: float
    p99_kld: float
    p999_kld: float
    max_kld: float
    rms_dp: float
    rms_dp_error: float
    same_top_p: float
    same_top_p_error: float
    count: int

    @classmethod
    def from_tokens(cls, parts: list[TokenKLD]) -> "KLDStats":
        """Statistics over the chunks' tokens, concatenated in chunk order (``kl_divergence()``)."""
        cat = {name: np.concatenate([getattr(p, name) for p in parts])
               for name in ("nll", "nll_base", "kld", "p_diff", "same_top")}
        n = int(cat["nll"].size)

        def sums(values: np.ndarray) -> tuple[float, float]:
            return float(values.sum()), float((values * values).sum())

        log_ppl = mean_and_uncertainty(*sums(cat["nll"]), n)
        log_ppl_base = mean_and_uncertainty(*sums(cat["nll_base"]), n)
        cov = 0.0
        if n >= 10:
            cov = (float((cat["nll"] * cat["nll_base"]).sum()) / n - log_ppl[0] * log_ppl_base[0]) / (n - 1)
        ratio_error = math.sqrt(max(log_ppl[1] ** 2 + log_ppl_base[1] ** 2 - 2.0 * cov, 0.0))
        kld = mean_and_uncertainty(*sums(cat["kld"]), n)
        dp2 = cat["p_diff"] ** 2
        mse = mean_and_uncertainty(*sums(dp2), n)
        rms = math.sqrt(mse[0])
        same = float(cat["same_top"].sum()) / n
        ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_ppl_base[0])
        ordered = np.sort(cat["kld"].astype(np.float32))        # llama.cpp keeps these as float
        return cls(
            ppl=ppl, ppl_error=ppl * log_ppl[1], ppl_base=ppl_base, ppl_base_error=ppl_base * log_ppl_base[1],
            ln_ppl_ratio=log_ppl[0] - log_ppl_base[0], ln_ppl_ratio_error=ratio_error,
            mean_kld=kld[0], mean_kld_error=kld[1], median_kld=float(np.median(ordered)),
            p99_kld=_percentile(ordered, 0.99), p999_kld=_percentile(ordered, 0.999),
            max_kld=float(ordered[-1]), rms_dp=rms, rms_dp_error=(0.5 / rms * mse[1] if rms > 0 else 0.0),
            same_top_p=same, same_top_p_error=math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
            count=n)
