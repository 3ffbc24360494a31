"""The tokenizer cache (llamatrace.text.tokcache): a tokenizer read from its entry tokenizes as
llama.cpp does (its test vectors, tests/test_vocab_llamacpp.py) without rebuilding the ranks; a
damaged entry is rebuilt with one warning, an outdated one silently; a crafted one runs no code
(the file holds data only); --no-cache reads and writes nothing."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import numpy as np
import pytest
import xxhash

from llamacpp_sdist import vocab_test_file
from llamatrace.gguf.reader import open_gguf
from llamatrace.text import tokcache
from llamatrace.text import tokenizer as tokenizer_module
from llamatrace.text.tokenizer import Tokenizer
from test_vocab_llamacpp import VOCABS, cases


@pytest.fixture
def cache_dir(temp_cache_root):
    """The cache on, in a temporary root (the llama.cpp vocabularies still the user's, fetched once)."""
    return temp_cache_root / "packed"


def build(path, cache=None) -> Tokenizer:
    with open_gguf(path) as f:
        return Tokenizer.from_reader(f, str(path), cache=cache)


@pytest.mark.parametrize("name", VOCABS)
def test_a_tokenizer_from_the_cache_tokenizes_as_llama_cpp(cache_dir, monkeypatch, tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    shutil.copyfile(vocab_test_file(name), path)
    built = build(path)
    assert len(list(cache_dir.glob("*.tokenizer"))) == 1
    monkeypatch.setattr(tokenizer_module, "bpe_ranks", lambda *a: pytest.fail("the ranks were rebuilt"))
    monkeypatch.setattr(tokenizer_module, "spm_ranks", lambda *a: pytest.fail("the ranks were rebuilt"))
    cached = build(path)
    for text, ids in cases(name):
        assert cached.encode(text, bos=False) == ids, text
        assert cached.decode(ids) == text
    assert cached.vocab_tables == built.vocab_tables
    assert (cached.stop_ids, cached.bos_id, cached.add_bos, cached.missing_bytes, cached.pre) == \
           (built.stop_ids, built.bos_id, built.add_bos, built.missing_bytes, built.pre)
    assert [cached.piece(i) for i in range(cached.n_vocab)] == [built.piece(i) for i in range(built.n_vocab)]


@pytest.mark.parametrize("name", ["llama-bpe", "llama-spm"])
def test_a_tokenizer_read_from_the_cache_shares_the_tokens_byte_strings(cache_dir, tmp_path, name):
    # as a build does: a rank whose bytes are a token's keeps that token's bytes object, not a copy
    path = tmp_path / f"{name}.gguf"
    shutil.copyfile(vocab_test_file(name), path)
    built = build(path)
    cached = build(path)
    id_bytes, ranks = cached.vocab_tables[:2]
    first: dict[bytes, bytes] = {}
    for raw in id_bytes:
        first.setdefault(raw, raw)
    shared = [raw for raw in ranks if raw in first]
    assert shared and all(raw is first[raw] for raw in shared)
    assert list(ranks.items()) == list(built.vocab_tables[1].items())       # the same ranks, in the same order


def _flip_a_byte(data: bytes) -> bytes:
    """One bit of the payload changed, in its middle (in the tables' bytes)."""
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]


def test_a_damaged_entry_is_rebuilt_with_one_warning(cache_dir, tmp_path):
    path = tmp_path / "bpe.gguf"
    shutil.copyfile(vocab_test_file("deepseek-coder"), path)
    want = build(path).encode("Hello world, 123")
    (entry,) = cache_dir.glob("*.tokenizer")
    whole = entry.read_bytes()
    for damage in (whole[:1000], _flip_a_byte(whole), whole[:len(tokcache.MAGIC) + 10]):
        entry.write_bytes(damage)
        with pytest.warns(UserWarning, match="tokenizer cache entry .* is damaged") as caught:
            assert build(path).encode("Hello world, 123") == want
        assert len(caught) == 1
        assert entry.read_bytes() == whole              # written whole again


def test_an_entry_of_another_format_is_rebuilt_silently(cache_dir, tmp_path, recwarn):
    path = tmp_path / "bpe.gguf"
    shutil.copyfile(vocab_test_file("deepseek-coder"), path)
    want = build(path).encode("Hello world, 123")
    (entry,) = cache_dir.glob("*.tokenizer")
    whole = entry.read_bytes()
    entry.write_bytes(pickle.dumps(("an older llamatrace's entry", [], None, ())))
    assert build(path).encode("Hello world, 123") == want
    assert entry.read_bytes() == whole and not recwarn.list


class _Payload:
    """A pickle that runs code when loaded: it writes ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_crafted_entry_runs_no_code(cache_dir, tmp_path):
    # anyone who can write the cache folder must not run code in the next llamatrace process
    path = tmp_path / "bpe.gguf"
    shutil.copyfile(vocab_test_file("deepseek-coder"), path)
    want = build(path, cache=False).encode("Hello world, 123")
    build(path)
    (entry,) = cache_dir.glob("*.tokenizer")
    marker = tmp_path / "marker"
    entry.write_bytes(pickle.dumps(_Payload(marker)))
    assert build(path).encode("Hello world, 123") == want
    assert not marker.exists()
    whole = entry.read_bytes()
    assert whole.startswith(tokcache.MAGIC)                    # data only, written anew
    # the same inside the format: an object array in the NPZ, under a right key and checksum
    buf = io.BytesIO()
    np.savez(buf, tokens_bytes=np.array([_Payload(marker)], dtype=object))
    head = json.loads(whole[len(tokcache.MAGIC):].split(b"\n", 1)[0])
    head.update(bytes=len(buf.getvalue()), xxh3=xxhash.xxh3_64_intdigest(buf.getvalue()))
    entry.write_bytes(tokcache.MAGIC + json.dumps(head).encode() + b"\n" + buf.getvalue())
    with pytest.warns(UserWarning, match="damaged .*allow_pickle"):
        assert build(path).encode("Hello world, 123") == want
    assert not marker.exists() and entry.read_bytes() == whole


def test_a_changed_file_is_not_read_from_its_old_entry(cache_dir, tmp_path, monkeypatch):
    path = tmp_path / "bpe.gguf"
    shutil.copyfile(vocab_test_file("deepseek-coder"), path)
    build(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    calls = []
    real = tokenizer_module.bpe_ranks
    monkeypatch.setattr(tokenizer_module, "bpe_ranks", lambda *a: calls.append(1) or real(*a))
    build(path)
    assert calls == [1]                                  # rebuilt: the key names the file's time
    build(path)
    assert calls == [1]                                  # and read from the new entry after that


def test_no_cache_reads_and_writes_nothing(cache_dir, tmp_path, monkeypatch):
    path = tmp_path / "bpe.gguf"
    shutil.copyfile(vocab_test_file("deepseek-coder"), path)
    monkeypatch.setenv("LLAMATRACE_NO_CACHE", "1")
    build(path)
    build(path, cache=False)
    assert not cache_dir.exists() or not list(cache_dir.iterdir())        # writes nothing
    monkeypatch.delenv("LLAMATRACE_NO_CACHE")
    build(path)                                                            # an entry to read …
    (entry,) = cache_dir.glob("*.tokenizer")
    monkeypatch.setattr(tokcache.Entry, "read", lambda self: pytest.fail("read the cache"))
    calls = []
    real = tokenizer_module.bpe_ranks
    monkeypatch.setattr(tokenizer_module, "bpe_ranks", lambda *a: calls.append(1) or real(*a))
    for cache, env in ((False, None), (None, "1")):                        # … that neither reads
        if env:
            monkeypatch.setenv("LLAMATRACE_NO_CACHE", env)
        build(path, cache=cache)
    assert calls == [1, 1] and list(cache_dir.glob("*.tokenizer")) == [entry]


def test_entries_count_in_the_cap_and_leave_with_it(cache_dir, tmp_path):
    from llamatrace.model.packcache import evict
    path = tmp_path / "bpe.gguf"
    shutil.copyfile(vocab_test_file("deepseek-coder"), path)
    build(path)
    (entry,) = cache_dir.glob("*.tokenizer")
    assert evict(entry.stat().st_size) == [] and entry.exists()
    assert evict(0) == [entry] and not entry.exists()


def test_a_dead_writers_partial_file_is_swept_and_a_live_writer_is_left_alone(cache_dir, tmp_path):
    import fcntl

    from llamatrace.model.packcache import PARTIAL, evict
    path = tmp_path / "bpe.gguf"
    shutil.copyfile(vocab_test_file("deepseek-coder"), path)
    build(path)
    (entry,) = cache_dir.glob("*.tokenizer")
    partial = entry.with_name(entry.name + PARTIAL)
    partial.write_bytes(b"half")                      # a writer that died
    evict(10**12)
    assert not partial.exists() and entry.exists()
    entry.unlink()
    partial.write_bytes(b"half")
    fd = os.open(partial, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)                # a writer at work: this load writes nothing
        assert build(path).encode("hello world") == build(path, cache=False).encode("hello world")
        evict(10**12)
        assert partial.read_bytes() == b"half" and not entry.exists()
    finally:
        os.close(fd)
    build(path)
    assert entry.exists() and not partial.exists()
