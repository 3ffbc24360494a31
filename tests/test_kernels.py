"""Each Numba kernel in llamatrace.kernels against its plain NumPy twin (and textbook formulas)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from llamatrace.kernels.ops import fp32 as K

rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_rmsnorm_matches_twin_and_formula():
    x, w = randn(7, 96), randn(96)
    y = K.rmsnorm(x, w, 1e-5)
    np.testing.assert_allclose(y, K.rmsnorm_ref(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    x64 = x.astype(np.float64)
    expect = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("start_pos", [0, 5])
def test_rope_matches_complex_twin(start_pos):
    inv = K.rope_frequencies(32, 10000.0)
    fc = K.precompute_freqs_cis(inv, start_pos, 4)
    assert fc.shape == (4, 16) and fc.dtype == np.complex64
    x = randn(4, 3, 32)
    y = K.rope(x, np.ascontiguousarray(fc.real), np.ascontiguousarray(fc.imag))
    np.testing.assert_allclose(y, K.rope_ref(x, fc), rtol=1e-5, atol=1e-6)
    # a rotation keeps each pair's length
    np.testing.assert_allclose(np.linalg.norm(y.reshape(4, 3, 16, 2), axis=-1),
                               np.linalg.norm(x.reshape(4, 3, 16, 2), axis=-1), rtol=1e-5)


def test_rope_angles_are_precompute_freqs_cis_bit_for_bit():
    inv = K.rope_frequencies(64, 1e6)
    angles = K.RopeAngles(inv, 1.25)
    for start, n in [(0, 1), (5, 1), (255, 1), (256, 1), (300, 40), (250, 10), (2000, 1), (0, 128), (3, 1)]:
        freqs, cos, sin = angles(start, n)
        want = K.precompute_freqs_cis(inv, start, n, 1.25)
        assert freqs.tobytes() == want.tobytes()
        assert cos.tobytes() == want.real.tobytes() and sin.tobytes() == want.imag.tobytes()
        assert cos.flags.c_contiguous and sin.flags.c_contiguous
    assert len(angles._blocks) <= K.RopeAngles.KEEP


def test_rope_partial_rotation_leaves_tail_untouched():
    fc = K.precompute_freqs_cis(K.rope_frequencies(16, 10000.0), 3, 2)
    x = randn(2, 2, 32)
    y = K.rope(x, np.ascontiguousarray(fc.real), np.ascontiguousarray(fc.imag))
    np.testing.assert_array_equal(y[..., 16:], x[..., 16:])
    np.testing.assert_allclose(y, K.rope_ref(x, fc), rtol=1e-5, atol=1e-6)


def test_rope_position_zero_is_identity():
    fc = K.precompute_freqs_cis(K.rope_frequencies(8, 10000.0), 0, 1)
    x = randn(1, 2, 8)
    np.testing.assert_allclose(K.rope(x, np.ascontiguousarray(fc.real), np.ascontiguousarray(fc.imag)), x, atol=1e-7)


def test_rope_frequency_factors_divide_frequencies():
    base = K.rope_frequencies(8, 500000.0)
    scaled = K.rope_frequencies(8, 500000.0, np.array([1, 2, 4, 8], dtype=np.float32))
    np.testing.assert_allclose(scaled, base / [1, 2, 4, 8])


def test_causal_mask_with_cache_offset():
    m = K.causal_mask(3, 2)
    assert m.shape == (3, 5)
    assert (m[0, :3] == 0).all() and np.isneginf(m[0, 3:]).all()
    assert (m[2] == 0).all()


@pytest.mark.parametrize("n_heads, seq_len", [(4, 5), (9, 128)])   # serial, parallel
def test_softmax_matches_twin_and_rows_sum_to_one(n_heads, seq_len):
    x = randn(n_heads, seq_len, seq_len + 4) + K.causal_mask(seq_len, 4)[None]
    y = K.softmax(x)
    np.testing.assert_allclose(y, K.softmax_ref(x), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-6)


def test_softmax_fully_masked_row_gives_zeros_not_nan():
    x = np.full((1, 2, 4), -np.inf, dtype=np.float32)
    x[0, 1] = [0, 1, 2, 3]
    y = K.softmax(x)
    assert np.isfinite(y).all()
    assert (y[0, 0] == 0).all()
    np.testing.assert_allclose(y, K.softmax_ref(x), atol=1e-7)


@njit
def _exp_each(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = K.exp_f32(x[i])
    return out


def test_exp_f32_is_within_one_ulp_of_float64_exp():
    x = np.concatenate([np.linspace(-87.3, 88.7, 400_001, dtype=np.float32),
                        rng.uniform(-20, 0, 100_000).astype(np.float32),      # softmax's range
                        np.float32([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5])])
    y = _exp_each(x)
    ref = np.exp(x.astype(np.float64))
    normal = ref >= np.finfo(np.float32).tiny
    ulp = np.spacing(ref[normal].astype(np.float32)).astype(np.float64)
    assert (np.abs(y[normal] - ref[normal]) / ulp).max() <= 1.0
    assert _exp_each(np.float32([0.0]))[0] == 1.0


def test_exp_f32_limits_and_nan():
    x = np.float32([-np.inf, -1000.0, -87.4, 88.8, 1000.0, np.inf, np.nan])
    y = _exp_each(x)
    np.testing.assert_array_equal(y[:3], 0.0)                 # exp below float32's normals: 0
    np.testing.assert_array_equal(y[3:6], np.inf)
    assert np.isnan(y[6])


def test_softmax_propagates_nan():
    x = randn(1, 1, 4)
    x[0, 0, 1] = np.nan
    assert np.isnan(K.softmax(x)).any()


@pytest.mark.parametrize("shape", [(3, 50), (128, 1536)])          # serial, parallel
def test_silu_matches_twin(shape):
    x = randn(*shape) * 10
    np.testing.assert_allclose(K.silu(x), K.silu_ref(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seq_len,kv_len,n_heads,n_kv_heads,head_dim", [
    (1, 7, 4, 4, 64), (5, 5, 3, 1, 64), (40, 70, 9, 3, 64), (1, 600, 9, 3, 64), (67, 130, 8, 2, 128),
    (70, 70, 4, 4, 128), (1, 300, 8, 2, 128), (3, 9, 4, 2, 40)])
def test_attention_products_match_twins(seq_len, kv_len, n_heads, n_kv_heads, head_dim):
    """Decode (one row) and prefill (register-blocked: 6 rows x 64 keys or head_dim entries a
    call, edges masked) against the NumPy twins; GQA n_rep 1, 3, 4; head_dim 40: a partial vector."""
    xq = randn(seq_len, n_heads, head_dim)
    keys, values = randn(kv_len, n_kv_heads, head_dim), randn(kv_len, n_kv_heads, head_dim)
    kq = K.attention_scores(xq, keys)
    np.testing.assert_allclose(kq, K.attention_scores_ref(xq, keys), rtol=1e-5, atol=1e-4)
    p = K.softmax(kq)
    np.testing.assert_allclose(K.attention_values(p, values), K.attention_values_ref(p, values), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_len,kv_len", [(3, 6), (4, 70), (1, 100)])     # prefill, decode: several key chunks
def test_serial_and_parallel_attention_variants_agree(seq_len, kv_len):
    """The parallel kernels split the keys (scores, decode values) or the heads (prefill values)
    and add in the serial kernels' order, so they agree bit for bit."""
    xq, keys = randn(seq_len, 6, 16), randn(kv_len, 2, 16)
    np.testing.assert_array_equal(K.attention_scores_serial(xq, keys), K.attention_scores_parallel(xq, keys))
    p = K.softmax(K.attention_scores_serial(xq, keys))
    np.testing.assert_array_equal(K.attention_values_serial(p, keys), K.attention_values_parallel(p, keys))


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,kv_len", [
    (32, 4, 128, 149), (64, 8, 64, 13), (6, 1, 32, 40), (40, 2, 80, 37), (24, 1, 96, 25)])
def test_a_decode_steps_scores_are_a_prefill_rows_bit_for_bit(n_heads, n_kv_heads, head_dim, kv_len):
    """n_rep >= 5: one query row's q·k (keys x query heads in the lanes, n_rep 5..8 and 9..16 a
    register) sums each entry as the prefill's blocked kernel does, so a decode step's scores are
    the last row of a two-row prefill's, bit for bit, serial or threaded."""
    xq, keys = randn(1, n_heads, head_dim) * 2, randn(kv_len, n_kv_heads, head_dim)
    prefill = K.attention_scores_serial(np.concatenate([randn(1, n_heads, head_dim), xq]), keys)[:, 1:]
    np.testing.assert_array_equal(_bits(K.attention_scores_serial(xq, keys)), _bits(prefill))
    np.testing.assert_array_equal(_bits(K.attention_scores_parallel(xq, keys)), _bits(prefill))


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(32, 4, 128), (64, 8, 64), (9, 3, 64), (16, 1, 40)])
def test_a_decode_steps_values_in_one_pass_are_the_blocks_bit_for_bit(n_heads, n_kv_heads, head_dim):
    """One query row's P·V runs every block of query heads over each run of keys in one pass
    (_values_decode) with the sums of the 6-row blocks (_values_blocks), also where the rows'
    spans differ (probabilities 0 at the ends: then the blocks themselves run) and with NaN in a
    value no row weighs."""
    kv_len = 150
    values = randn(kv_len, n_kv_heads, head_dim)
    values[3] = np.nan
    for cut in (False, True):
        p = rng.random((n_heads, 1, kv_len)).astype(np.float32)
        p[:, :, :5] = 0
        if cut:
            p[0, 0, 140:] = 0
            p[n_heads - 1, 0, 5:40] = 0
        want = np.empty((n_heads, 1, head_dim), dtype=np.float32)
        K._values_blocks(p, values, head_dim, n_kv_heads * head_dim, n_kv_heads, want, 0,
                         n_kv_heads * K._values_items(p, n_kv_heads)[1])
        assert not np.isnan(want).any()
        np.testing.assert_array_equal(_bits(K.attention_values_serial(p, values)), _bits(want))
        np.testing.assert_array_equal(_bits(K.attention_values_parallel(p, values)), _bits(want))


@pytest.mark.parametrize("crowded,kv_len,threaded", [(True, 100, False), (True, 256, False), (True, 257, True),
                                                     (False, 100, True)])
def test_a_crowded_decode_steps_attention_runs_serial_below_a_megaflop(monkeypatch, crowded, kv_len, threaded):
    """One query row at Qwen3-30B-A3B's heads (32 of 128, 4 KV heads): on a crowded machine q·k
    and P·V run their serial variants up to 2^20 multiply-adds (kv 256; else above 2^18), and
    the parallel ones give the same bits."""
    from llamatrace.machine import threads
    xq, keys, values = randn(1, 32, 128), randn(kv_len, 4, 128), randn(kv_len, 4, 128)
    serial = K.attention_probs(xq, keys, 0.09, kv_len - 1, parallel=False)
    np.testing.assert_array_equal(_bits(serial), _bits(K.attention_probs(xq, keys, 0.09, kv_len - 1, parallel=True)))
    np.testing.assert_array_equal(_bits(K.attention_values_serial(serial, values)),
                                  _bits(K.attention_values_parallel(serial, values)))
    np.testing.assert_array_equal(_bits(K.attention_scores_serial(xq, keys)),
                                  _bits(K.attention_scores_parallel(xq, keys)))
    ran = []
    for name in ("_decode_scores_parallel", "attention_values_parallel", "attention_scores_parallel"):
        monkeypatch.setattr(K, name, lambda *a, name=name, real=getattr(K, name): ran.append(name) or real(*a))
    monkeypatch.setattr(threads, "_crowded", crowded)
    np.testing.assert_array_equal(_bits(K.attention_probs(xq, keys, 0.09, kv_len - 1)), _bits(serial))
    K.attention_values(serial, values)
    K.attention_scores(xq, keys)
    assert bool(ran) == threaded and (not ran or len(ran) == 3)


@pytest.mark.parametrize("seq_len,start_pos,n_heads,n_kv_heads,head_dim,window", [
    (70, 0, 6, 2, 16, 0), (37, 0, 8, 2, 128, 0), (45, 20, 4, 4, 128, 0), (61, 3, 9, 3, 64, 24)])
def test_masked_keys_add_nothing_to_the_values(seq_len, start_pos, n_heads, n_kv_heads, head_dim, window):
    """A masked prefill's probabilities are exact zeros for the keys a row does not see: each row
    of the register-blocked product (rows in blocks of 6 that share a key range) equals the same
    row computed alone over only the keys it sees (a decode step's product), bit for bit, and the
    NumPy twin; the serial and the parallel variant agree bit for bit."""
    kv_len = start_pos + seq_len
    xq, keys = randn(seq_len, n_heads, head_dim), randn(kv_len, n_kv_heads, head_dim)
    values = randn(kv_len, n_kv_heads, head_dim)
    p = K.attention_probs(xq, keys, 0.3, start_pos, window)
    assert (p[:, 0, start_pos + 1:] == 0).all()
    out = K.attention_values(p, values)
    np.testing.assert_allclose(out, K.attention_values_ref(p, values), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_bits(K.attention_values_serial(p, values)),
                                  _bits(K.attention_values_parallel(p, values)))
    for s in (0, 5, 31, 32, seq_len - 1):
        lo = max(0, start_pos + s - window + 1) if window else 0
        seen = K.attention_values_serial(np.ascontiguousarray(p[:, s:s + 1, lo:start_pos + s + 1]),
                                         np.ascontiguousarray(values[lo:start_pos + s + 1]))
        if lo % 32 == 0:                  # the same runs of 32 terms (_gemm_chained)
            np.testing.assert_array_equal(_bits(out[:, s:s + 1]), _bits(seen))
        np.testing.assert_allclose(out[:, s:s + 1], seen, rtol=1e-5, atol=1e-6)

def _bits(a):
    return a.view(np.uint32)


@pytest.mark.parametrize("n_heads,n_kv_heads,window", [(8, 2, 0), (3, 3, 0), (4, 1, 16)])
def test_a_nan_value_reaches_only_the_rows_that_weigh_it(n_heads, n_kv_heads, window):
    """The blocked P·V sums a block of rows over one key range; a row that gives a key
    probability 0 (masked) still never reads its value: NaN or inf there leaves the row's bits
    as with a clean value, and every row that sees the key is NaN."""
    seq_len = 70
    xq, keys, values = randn(seq_len, n_heads, 32), randn(seq_len, n_kv_heads, 32), randn(seq_len, n_kv_heads, 32)
    p = K.attention_probs(xq, keys, 0.3, 0, window)
    clean = K.attention_values(p, values)
    for bad in (np.nan, np.inf):
        poisoned = values.copy()
        poisoned[41] = bad
        got = K.attention_values(p, poisoned)
        sees = np.zeros(seq_len, dtype=bool)
        sees[41:41 + window if window else seq_len] = True
        np.testing.assert_array_equal(_bits(got[:, ~sees]), _bits(clean[:, ~sees]))
        assert (~np.isfinite(got[:, sees])).any(axis=-1).all()


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seq_len,start_pos,n_heads,n_kv_heads,head_dim,window", [
    (5, 0, 4, 2, 64, 0), (70, 0, 6, 2, 16, 0), (40, 30, 9, 3, 64, 0), (128, 0, 8, 2, 128, 0),
    (70, 0, 4, 4, 128, 0), (61, 3, 8, 2, 128, 40), (60, 0, 4, 1, 32, 16), (20, 50, 4, 2, 32, 16),
    (1, 40, 4, 2, 32, 8)])
def test_attention_probs_are_the_masked_softmax_bit_for_bit(parallel, seq_len, start_pos, n_heads,
                                                          n_kv_heads, head_dim, window):
    """q·k and the softmax over only the keys each row sees give the masked path's
    probabilities, masked zeros included, bit for bit (and the twin's, to rounding)."""
    xq, keys = randn(seq_len, n_heads, head_dim) * 3, randn(start_pos + seq_len, n_kv_heads, head_dim) * 3
    scale = np.float32(1 / np.sqrt(head_dim))
    mask = K.window_mask(seq_len, start_pos, window) if window else K.causal_mask(seq_len, start_pos)
    masked = K.softmax(K.attention_scores(xq, keys) * scale + mask)
    got = K.attention_probs(xq, keys, scale, start_pos, window, parallel=parallel)
    np.testing.assert_array_equal(_bits(got), _bits(masked))
    assert (got[:, np.isinf(mask)] == 0).all() and (got[:, mask == 0] > 0).all()
    np.testing.assert_allclose(got, K.attention_probs_ref(xq, keys, scale, start_pos, window), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("start_pos,n_heads,n_kv_heads,head_dim,window,sinks", [
    (149, 32, 4, 128, 0, False), (139, 64, 8, 64, 128, True), (139, 64, 8, 64, 0, True), (32, 9, 3, 64, 0, False),
    (69, 8, 1, 16, 24, False), (0, 6, 2, 16, 0, False), (40, 4, 4, 32, 8, True)])
def test_attention_decode_is_probs_then_values_bit_for_bit(parallel, start_pos, n_heads, n_kv_heads, head_dim,
                                                           window, sinks):
    """One query row's q·k, softmax and P·V in one call: attention_probs' probabilities and
    attention_values' outputs, bit for bit, threaded or not (and the twins', to rounding)."""
    xq = randn(1, n_heads, head_dim) * 3
    keys, values = randn(start_pos + 1, n_kv_heads, head_dim) * 3, randn(start_pos + 1, n_kv_heads, head_dim)
    sink = randn(n_heads) if sinks else None
    scale = np.float32(1 / np.sqrt(head_dim))
    probs, kqv = K.attention_decode(xq, keys, values, scale, start_pos, window, sink, parallel=parallel)
    want = K.attention_probs(xq, keys, scale, start_pos, window, sinks=sink)
    np.testing.assert_array_equal(_bits(probs), _bits(want))
    np.testing.assert_array_equal(_bits(kqv), _bits(K.attention_values(want, values)))
    ref = K.attention_probs_ref(xq, keys, scale, start_pos, window, sinks=sink)
    np.testing.assert_allclose(probs, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kqv, K.attention_values_ref(ref, values), rtol=1e-4, atol=1e-5)


def test_attention_decode_takes_one_row_at_its_position():
    with pytest.raises(ValueError, match="one row"):
        K.attention_decode(randn(2, 4, 8), randn(5, 2, 8), randn(5, 2, 8), 0.5, 3)
    with pytest.raises(ValueError, match="one row"):
        K.attention_decode(randn(1, 4, 8), randn(5, 2, 8), randn(5, 2, 8), 0.5, 3)


@pytest.mark.parametrize("window", [1, 2, 8, 40, 4096])
def test_a_decode_steps_window_mask_is_the_last_row_of_a_longer_one(window):
    """window_mask's one-row shortcut (a decode step's) gives the general rule's row."""
    for start_pos in (0, 1, 7, 8, 9, 39, 40, 41, 200):
        one = K.window_mask(1, start_pos, window)
        longer = K.window_mask(2, start_pos - 1, window)[1:] if start_pos else K.window_mask(1, 0, window)
        assert one.dtype == np.float32 and one.tobytes() == longer.tobytes()
        assert int(np.isinf(one).sum()) == max(0, start_pos - window + 1)


@pytest.mark.parametrize("parallel", [False, True])
def test_attention_probs_never_read_a_key_a_row_does_not_see(parallel):
    """NaN in the keys a row must not see (later positions; before the window) leaves the row
    exactly as with clean keys; every row that sees one differs. (The masked path's scores
    of hidden keys are computed, and NaN + -inf is NaN: there every row would be NaN.)"""
    seq_len, start_pos, window = 70, 10, 24
    xq, keys = randn(seq_len, 6, 32), randn(start_pos + seq_len, 2, 32)
    poisoned = keys.copy()
    poisoned[start_pos + 50:] = np.nan                 # seen by rows 50 …
    clean = K.attention_probs(xq, keys, 0.25, start_pos, parallel=parallel)
    got = K.attention_probs(xq, poisoned, 0.25, start_pos, parallel=parallel)
    np.testing.assert_array_equal(_bits(got[:, :50]), _bits(clean[:, :50]))
    assert (got[:, 50:] != clean[:, 50:]).any(axis=-1).all()
    poisoned = keys.copy()
    poisoned[:start_pos + 30] = np.nan                 # out of the window of rows 30 + window - 1 …
    clean = K.attention_probs(xq, keys, 0.25, start_pos, window, parallel=parallel)
    got = K.attention_probs(xq, poisoned, 0.25, start_pos, window, parallel=parallel)
    np.testing.assert_array_equal(_bits(got[:, 30 + window - 1:]), _bits(clean[:, 30 + window - 1:]))
    assert (got[:, :30 + window - 1] != clean[:, :30 + window - 1]).any(axis=-1).all()


def test_attention_probs_of_a_nan_row_are_nan_as_in_the_masked_path():
    xq, keys = randn(6, 2, 16), randn(6, 2, 16)
    xq[3, 1, 5] = np.inf                               # query row 3 of head 1: scores ±inf,
    keys[0, 1, 5] = 1.0                                # +inf among them, inf - inf = NaN
    with np.errstate(invalid="ignore"):                # the masked path's inf + -inf
        masked = K.softmax(K.attention_scores(xq, keys) * np.float32(0.25) + K.causal_mask(6, 0))
    got = K.attention_probs(xq, keys, 0.25, 0)
    assert np.isnan(got[1, 3]).all()
    np.testing.assert_array_equal(got, masked)         # NaN where NaN, the same bits elsewhere


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_nan_query_makes_its_rows_nan_not_zero(parallel, sinks):
    """A NaN query (every score of its rows NaN) gave probabilities of 0, so the head's output was
    0 and the NaN vanished from the residual stream; ggml's soft_max keeps it NaN, and so do we."""
    seq_len, n_heads, n_kv = 5, 4, 2
    xq, keys, values = randn(seq_len, n_heads, 16), randn(seq_len, n_kv, 16), randn(seq_len, n_kv, 16)
    xq[2, 1] = np.nan
    sink = randn(n_heads) if sinks else None
    got = K.attention_probs(xq, keys, 0.25, 0, parallel=parallel, sinks=sink)
    ref = K.attention_probs_ref(xq, keys, 0.25, 0, sinks=sink)
    assert np.isnan(got[1, 2]).all() and np.isnan(ref[1, 2]).all()
    assert np.isnan(got).sum() == seq_len                  # that row alone
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert np.isnan(K.attention_values(got, values)[1, 2]).all()
    with np.errstate(invalid="ignore"):
        masked = K.softmax(K.attention_scores(xq, keys) * np.float32(0.25) + K.causal_mask(seq_len, 0), sink)
    np.testing.assert_array_equal(_bits(masked), _bits(got))
    probs, kqv = K.attention_decode(xq[-1:] * np.nan, keys, values, 0.25, seq_len - 1, sinks=sink, parallel=parallel)
    assert np.isnan(probs).all() and np.isnan(kqv).all()


def test_softmax_nan_rows_are_nan_in_kernel_and_twin():
    x = np.full((1, 3, 4), -np.inf, dtype=np.float32)
    x[0, 1] = np.nan                                      # all NaN
    x[0, 2] = [0, np.nan, -np.inf, 1]                     # one NaN
    for y in (K.softmax(x), K.softmax_ref(x)):
        assert (y[0, 0] == 0).all() and np.isnan(y[0, 1:]).all()


def test_attention_probs_need_a_key_per_position():
    with pytest.raises(ValueError, match="keys for"):
        K.attention_probs(randn(4, 2, 8), randn(5, 2, 8), 0.5, 0)


@pytest.mark.parametrize("shape", [(3, 100), (128, 3072)])          # serial, parallel
def test_swiglu_is_silu_of_the_gate_half_times_the_up_half(shape):
    y = randn(*shape) * 6
    gate, up = np.ascontiguousarray(y[:, :shape[1] // 2]), y[:, shape[1] // 2:]
    got = K.swiglu(y)
    np.testing.assert_array_equal(_bits(got), _bits(K.silu(gate) * up))
    np.testing.assert_allclose(got, K.swiglu_ref(y), rtol=1e-6, atol=1e-6)


def test_grouped_kv_heads_equal_explicitly_repeated_heads():
    xq, keys, values = randn(6, 8, 32), randn(9, 2, 32), randn(9, 2, 32)
    kq = K.attention_scores(xq, keys)
    np.testing.assert_allclose(kq, K.attention_scores(xq, K.repeat_kv(keys, 4)), rtol=1e-6, atol=1e-6)
    p = K.softmax(kq)
    np.testing.assert_allclose(K.attention_values(p, values), K.attention_values(p, K.repeat_kv(values, 4)),
                               rtol=1e-6, atol=1e-6)
    # query head 5 uses KV head 5 // 4 = 1 (Meta's repeat_kv order)
    np.testing.assert_allclose(kq[5], xq[:, 5] @ keys[:, 1].T, rtol=1e-5, atol=1e-5)


def test_kv_heads_must_divide_query_heads():
    with pytest.raises(ValueError, match="cannot share"):
        K.attention_scores(randn(1, 9, 8), randn(3, 2, 8))


@pytest.mark.parametrize("n_heads, seq_len", [(4, 5), (9, 128)])   # serial, parallel
def test_sinks_join_the_softmax_denominator_only(n_heads, seq_len):
    # ggml_soft_max_add_sinks: each row as if a column holding the head's sink were appended,
    # then that column dropped (written out in float64 here)
    x = randn(n_heads, seq_len, seq_len + 4) * 3 + K.causal_mask(seq_len, 4)[None]
    sinks = randn(n_heads) * 4
    sinks[0] = 40.0                                    # a sink that outweighs every key
    y = K.softmax(x, sinks)
    wide = np.concatenate([x, np.broadcast_to(sinks[:, None, None], (n_heads, seq_len, 1))], axis=-1)
    e = np.exp(wide.astype(np.float64) - wide.max(axis=-1, keepdims=True))
    want = (e / e.sum(axis=-1, keepdims=True))[..., :-1]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(y, K.softmax_ref(x, sinks), rtol=1e-6, atol=1e-30)
    assert y[0].max() < 1e-10                          # the sink took the whole row
    np.testing.assert_array_equal(K.softmax(x, None), K.softmax(x))        # none: unchanged
    with pytest.raises(ValueError, match="3 values for"):
        K.softmax(x, sinks[:3])


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seq_len,start_pos,window", [(20, 0, 0), (9, 12, 6), (1, 30, 8)])
def test_attention_probs_with_sinks_are_the_masked_softmax_with_sinks(parallel, seq_len, start_pos, window):
    xq, keys = randn(seq_len, 4, 32) * 3, randn(start_pos + seq_len, 2, 32) * 3
    sinks = randn(4) * 3
    scale = np.float32(1 / np.sqrt(32))
    mask = K.window_mask(seq_len, start_pos, window) if window else K.causal_mask(seq_len, start_pos)
    masked = K.softmax(K.attention_scores(xq, keys) * scale + mask, sinks)
    got = K.attention_probs(xq, keys, scale, start_pos, window, parallel=parallel, sinks=sinks)
    np.testing.assert_array_equal(_bits(got), _bits(masked))
    np.testing.assert_allclose(got, K.attention_probs_ref(xq, keys, scale, start_pos, window, sinks),
                               rtol=1e-5, atol=1e-7)


def test_swiglu_oai_is_ggmls_clamped_formula():
    # ggml_compute_forward_swiglu_oai_f32: x = min(gate, 7), y = clamp(up, -7, 7),
    # x / (1 + exp(-1.702 x)) * (y + 1), written out in float64
    gate, up = randn(5, 300) * 6, randn(5, 300) * 6
    gate[0, :3], up[0, :3] = [9.0, -20.0, 7.0], [-9.0, 30.0, 0.5]      # both clamps reached
    got = K.swiglu_oai(gate, up)
    g = np.minimum(gate.astype(np.float64), 7.0)
    want = g / (1 + np.exp(-1.702 * g)) * (np.clip(up.astype(np.float64), -7, 7) + 1)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(got, K.swiglu_oai_ref(gate, up), rtol=1e-6, atol=1e-6)
    assert got[0, 0] == pytest.approx(7 / (1 + np.exp(-1.702 * 7)) * -6, rel=1e-6)
    with pytest.raises(ValueError, match="same"):
        K.swiglu_oai(gate, up[:, :3])
