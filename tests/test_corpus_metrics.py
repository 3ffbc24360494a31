"""llamatrace.corpus.metrics against plain formulas, and the base file's layout."""

from __future__ import annotations

import io
import math

import numpy as np

from llamatrace.corpus import basefile
from llamatrace.corpus.chunks import Chunks
from llamatrace.corpus.metrics import (
    KLDStats,
    PerplexityStats,
    base_log_probs,
    compress_log_probs,
    row_width,
    token_kld,
    token_nll,
)


def logits(n=6, vocab=101, seed=0, spread=4.0):
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * spread).astype(np.float32)


def log_softmax(z):
    z = z.astype(np.float64)
    return z - z.max(axis=1, keepdims=True) - np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))


def test_token_nll_is_minus_the_log_softmax_of_the_target():
    z = logits()
    t = np.arange(6) * 7
    np.testing.assert_allclose(token_nll(z, t), -log_softmax(z)[np.arange(6), t], rtol=1e-6)


def test_compressed_log_probs_round_trip_within_half_a_step():
    z = logits(spread=2.0)
    rows = compress_log_probs(z)
    assert rows.shape == (6, row_width(101)) == (6, 106) and rows.dtype == np.uint16
    back = base_log_probs(rows, 101)
    want = log_softmax(z)
    step = (z.max(axis=1) - z.min(axis=1)) / 65535            # spread 2: every logit within 16
    assert np.all(np.abs(back - want) <= step[:, None] * 0.51 + 1e-5)


def test_logits_more_than_16_below_the_top_are_clamped():
    z = np.array([[0.0, -20.0, -3.0, -16.5]], dtype=np.float32)
    back = base_log_probs(compress_log_probs(z), 4)
    assert back[0, 1] == back[0, 3] == back[0].min()           # both stored as 0: the floor
    np.testing.assert_allclose(back[0, [0, 2]], log_softmax(z)[0, [0, 2]], atol=16 / 65535)


def test_kld_of_a_model_against_itself_is_zero_and_against_another_is_the_plain_sum():
    z, other = logits(seed=1, spread=2.0), logits(seed=2, spread=2.0)
    t = np.arange(6)
    same = token_kld(z, compress_log_probs(z), t)
    assert np.all(np.abs(same.kld) < 5e-5) and same.same_top.all()     # the uint16 rounding only
    np.testing.assert_allclose(same.nll, same.nll_base, atol=1e-4)
    r = token_kld(other, compress_log_probs(z), t)
    p_log, q_log = log_softmax(z), log_softmax(other)
    plain = (np.exp(p_log) * (p_log - q_log)).sum(axis=1)      # KL(base || model)
    np.testing.assert_allclose(r.kld, plain, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(r.p_diff, np.exp(q_log[t, t]) - np.exp(p_log[t, t]), atol=1e-5)
    np.testing.assert_array_equal(r.same_top, z.argmax(1) == other.argmax(1))


def test_perplexity_error_is_llama_cpp_final_estimate():
    nll = np.random.default_rng(3).gamma(2.0, 1.5, 300)
    s = PerplexityStats()
    s.add(nll[:100])
    s.add(nll[100:])
    assert s.running[0] == math.exp(nll[:100].mean()) or abs(s.running[0] / math.exp(nll[:100].mean()) - 1) < 1e-12
    assert abs(s.ppl / math.exp(nll.mean()) - 1) < 1e-12
    assert abs(s.ppl_error / (s.ppl * nll.std() / math.sqrt(299)) - 1) < 1e-9


def test_kld_percentiles_interpolate_as_llama_cpp():
    z, other = logits(n=40, seed=4), logits(n=40, seed=5)
    part = token_kld(other, compress_log_probs(z), np.zeros(40, dtype=np.int64))
    stats = KLDStats.from_tokens([part])
    v = np.sort(part.kld.astype(np.float32))
    p = 0.99 * 39
    assert abs(stats.p99_kld - ((1 - (p - int(p))) * v[int(p)] + (p - int(p)) * v[int(p) + 1])) < 1e-6
    assert stats.max_kld == float(v[-1]) and stats.median_kld == float(0.5 * (v[19] + v[20]))
    assert stats.same_top_p == part.same_top.mean()


def test_base_file_has_llama_cpp_layout_and_reads_back(tmp_path):
    n_ctx, vocab = 8, 11
    chunks = Chunks(np.arange(20, dtype=np.int32), n_ctx, 2, None)
    rows = [compress_log_probs(logits(n=chunks.n_scored, vocab=vocab, seed=s)) for s in (6, 7)]
    buf = io.BytesIO()
    basefile.write_header(buf, chunks, vocab)
    for r in rows:
        basefile.write_rows(buf, r)
    raw = buf.getvalue()
    assert raw[:8] == b"_logits_"
    assert np.frombuffer(raw[8:20], "<i4").tolist() == [8, 11, 2]
    assert np.frombuffer(raw[20:20 + 64], "<i4").tolist() == list(range(16))
    assert len(raw) == 20 + 64 + 2 * 3 * 2 * 16            # 2 chunks x 3 rows x row_width 16
    path = tmp_path / "b.base"
    path.write_bytes(raw)
    assert basefile.is_base_file(path)
    f = basefile.BaseFile(path)
    assert (f.n_ctx, f.n_vocab, f.n_chunk) == (8, 11, 2)
    np.testing.assert_array_equal(f.rows(1), rows[1])


def test_chunks_put_bos_first_where_the_vocabulary_adds_one(tmp_path):
    from gguf_factory import write_tiny_llama

    from llamatrace.corpus.chunks import make_chunks
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.text.tokenizer import Tokenizer
    path = write_tiny_llama(tmp_path / "bos.gguf", add_bos=True)
    tok = Tokenizer.from_reader(open_gguf(path), path=str(path))
    text = "the cat sat on the mat and looked at the dog " * 20
    chunks = make_chunks(tok, text, 16, None, 64)
    plain = tok.encode(text, bos=False)
    assert chunks.tokens[0] == tok.bos_id and chunks.tokens[1:].tolist() == plain      # BOS once, first
    assert chunks.n_chunk == (len(plain) + 1) // 16
    for i in range(chunks.n_chunk):
        ids = chunks.chunk(i)
        assert ids[0] == tok.bos_id and ids[1:].tolist() == chunks.tokens[i * 16 + 1:(i + 1) * 16].tolist()
        assert chunks.targets(i).tolist() == chunks.tokens[i * 16 + 9:(i + 1) * 16].tolist()   # first = 8
