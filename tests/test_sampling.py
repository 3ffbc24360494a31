"""Sampling: seeded, bounded statistical tests against the exact distribution written out here.

Every expected distribution is computed in this file from its definition (softmax of
``logits / T``, then HF's top-k, then top-p over the renormalised top-k), not with
``llamatrace.model.sampling``'s helpers. Draws use fixed seeds, so each test is deterministic; the
chi-square bounds are generous (df + 6·sqrt(2·df), far in the tail) so that they hold for any
seed, while a wrong distribution (argmax, a missing renormalisation, filters in another order)
lands far beyond them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from llamatrace.errors import OptionError
from llamatrace.model.sampling import Sampler, SamplingParams

N_DRAWS = 20_000


def exact(logits, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """The distribution the sampler must draw from, float64 ``[vocab]`` (zeros outside the support)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    if top_k:
        order = order[:top_k]
    mass = sum(p[i] for i in order)
    if top_p < 1.0:
        kept, total = [], 0.0
        for i in order:                      # smallest likeliest-first prefix whose share reaches top_p
            kept.append(i)
            total += p[i] / mass
            if total >= top_p:
                break
        order = kept
    q = np.zeros_like(p)
    q[order] = p[order]
    return q / q.sum()


def draw(params: SamplingParams, logits, n=N_DRAWS) -> np.ndarray:
    sampler = Sampler(params)
    x = np.asarray(logits, dtype=np.float32)
    return np.array([sampler(x) for _ in range(n)])


def chi_square(ids: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the support and its degrees of freedom."""
    observed = np.bincount(ids, minlength=expected.size).astype(np.float64)
    support = expected > 0
    e = expected[support] * ids.size
    return float(((observed[support] - e) ** 2 / e).sum()), int(support.sum()) - 1


def assert_follows(ids: np.ndarray, expected: np.ndarray) -> None:
    outside = set(np.unique(ids)) - set(np.flatnonzero(expected))
    assert not outside, f"drew ids {sorted(outside)} that have probability 0"
    stat, df = chi_square(ids, expected)
    bound = df + 6 * math.sqrt(2 * df)
    assert stat <= bound, f"chi-square {stat:.1f} over {df} df exceeds {bound:.1f}: not the expected distribution"


LOGITS = [2.0, 1.5, 1.0, 0.7, 0.2, -0.3, -1.0, -2.5]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_draws_follow_the_softmax_of_logits_over_temperature(temperature):
    ids = draw(SamplingParams(temperature=temperature, seed=1), LOGITS)
    assert_follows(ids, exact(LOGITS, temperature))


def test_top_k_draws_only_the_k_likeliest_in_softmax_proportions():
    logits = [0.5, 2.0, -1.0, 1.8, 1.9, 0.0]
    ids = draw(SamplingParams(temperature=1.0, top_k=3, seed=2), logits)
    assert set(np.unique(ids)) == {1, 3, 4}
    assert_follows(ids, exact(logits, top_k=3))


@pytest.mark.parametrize("top_p,support", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_prefix_that_reaches_p(top_p, support):
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    ids = draw(SamplingParams(temperature=1.0, top_p=top_p, seed=3), logits, n=5000)
    assert set(np.unique(ids)) == support
    assert_follows(ids, exact(logits, top_p=top_p))


def test_top_p_applies_to_the_top_k_renormalised_as_in_hf():
    # top-k 2 leaves 0.4, 0.3 → 4/7, 3/7; top-p 0.5 then keeps token 0 alone. Top-p on the
    # original mass (0.4 < 0.5) would keep tokens 0 and 1.
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    ids = draw(SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=4), logits, n=2000)
    assert set(np.unique(ids)) == {0}


def test_temperature_applies_before_top_p():
    # T = 0.5 squares the probabilities: 0.4, 0.3, ... → 0.53, 0.30, ...; top-p 0.5 keeps token 0
    # alone. Top-p before the temperature (0.4 < 0.5) would keep tokens 0 and 1.
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    ids = draw(SamplingParams(temperature=0.5, top_p=0.5, seed=5), logits, n=2000)
    assert set(np.unique(ids)) == {0}


def test_top_p_over_a_large_flat_vocabulary_keeps_the_whole_nucleus():
    # the nucleus of 0.9 holds thousands of tokens: the sampler must look past its first candidates
    logits = np.random.default_rng(0).normal(0.0, 0.5, 2000)
    expected = exact(logits, top_p=0.9)
    ids = draw(SamplingParams(temperature=1.0, top_p=0.9, seed=6), logits, n=4000)
    outside = set(np.unique(ids)) - set(np.flatnonzero(expected))
    assert not outside
    ranks = np.argsort(np.argsort(-np.asarray(logits, dtype=np.float32)))
    assert ranks[ids].max() > 0.8 * np.count_nonzero(expected)    # draws reach the nucleus's far end
    # frequencies in 10 equal-mass bands of the nucleus (likeliest first)
    order = np.argsort(-expected, kind="stable")[:np.count_nonzero(expected)]
    band = np.minimum((np.cumsum(expected[order]) * 10).astype(int), 9)
    band_of = np.full(expected.size, -1)
    band_of[order] = band
    band_mass = np.bincount(band, weights=expected[order], minlength=10)
    assert_follows(band_of[ids], band_mass)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    params = dict(temperature=1.0, top_k=5, top_p=0.9)
    a = draw(SamplingParams(**params, seed=11), LOGITS, n=200)
    b = draw(SamplingParams(**params, seed=11), LOGITS, n=200)
    c = draw(SamplingParams(**params, seed=12), LOGITS, n=200)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()


def test_temperature_towards_zero_is_greedy():
    rng = np.random.default_rng(7)
    for _ in range(20):
        logits = rng.normal(0.0, 3.0, 500).astype(np.float32)
        best = int(np.argmax(logits))
        assert Sampler(SamplingParams(temperature=0.0))(logits) == best
        assert set(draw(SamplingParams(temperature=1e-4, seed=1), logits, n=20)) == {best}
        # logits / T overflowed to inf (then inf - inf = NaN probabilities) before the max came off
        assert set(draw(SamplingParams(temperature=1e-320, seed=1), logits, n=5)) == {best}


def test_greedy_lists_the_sampling_options_it_ignores():
    assert SamplingParams(top_k=40, seed=1).unused_options() == ["--top-k", "--seed"]
    assert SamplingParams(temperature=0.8, top_k=40, seed=1).unused_options() == []
    assert SamplingParams().unused_options() == []


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_k=-1),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(seed=-1), dict(seed=1.5)])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(OptionError):
        SamplingParams(**bad)


def test_model_generate_takes_sampling_keywords(tiny_model):
    ids = tiny_model.tokenizer.encode("the cat")
    kwargs = dict(max_tokens=12, temperature=50.0, top_k=50, top_p=0.95, seed=7)
    a = list(tiny_model.generate(ids, **kwargs))
    assert a == list(tiny_model.generate(ids, **kwargs))
    assert a != list(tiny_model.generate(ids, max_tokens=12))                    # not greedy
    with pytest.raises(OptionError, match="not both"):
        list(tiny_model.generate(ids, sampling=SamplingParams(), temperature=0.5))
