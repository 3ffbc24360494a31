"""The first load of a file (llamatrace.model.packcache.EntryArena, packing.FileRows): its weights
are packed straight into the packed-weights cache's entry, which a failed load or a full disk does
not leave behind, and an untied token embedding stays in the GGUF file, of which a run maps only
its tokens' rows. Memory is checked by where arrays lie (/proc/self/maps), never by timing."""

from __future__ import annotations

import errno
import os

import gguf
import numpy as np
import pytest

from gguf_factory import write_tiny_llama
from test_pack_cache import maps_file

from llamatrace.kernels import tiles
from llamatrace.kernels.types import packing
from llamatrace.model import packcache
from llamatrace.model.llama import Llama

T = gguf.GGMLQuantizationType
TOKENS = np.array([3, 17, 5, 40, 22, 9, 31])


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A tiny model whose F32 embedding (4 KiB a row, ~270 rows) is not tied to its output."""
    return write_tiny_llama(tmp_path_factory.mktemp("untied") / "untied.gguf", dim=1024, hidden_dim=256,
                            tied=False, extra_types={"token_embd.weight": T.F32})


def logits(model) -> np.ndarray:
    cache = model.new_cache(16)
    return model.forward(TOKENS, 0, cache, all_logits=True)


def files(folder) -> list[str]:
    """The packed entries and partial files in ``folder`` (the tokenizer's entries aside)."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((packcache.SUFFIX, packcache.PARTIAL))
                  and packcache.TOKENIZER_SUFFIX not in p.name) if folder.exists() else []


def test_an_untied_embedding_maps_only_the_rows_a_run_reads(untied):
    model = Llama.load(untied, cache=False)
    tok = model.weights.tok_embeddings
    assert isinstance(tok, packing.FileRows) and tok.nbytes == 0
    # a read-only map of the file: the page cache's pages, never anonymous memory of this process
    assert maps_file(tok.rows, untied) and not tok.rows.flags.writeable
    ids = np.array([7, 200])
    want = gguf.quants.dequantize(np.asarray(model.file.tensor("token_embd.weight").data)[ids], T.F32)
    np.testing.assert_array_equal(packing.get_rows(tok, ids), want)
    model.close()                                     # the GGUF's map goes; the table's own stays
    np.testing.assert_array_equal(packing.get_rows(tok, ids), want)


def test_the_first_load_packs_into_the_entry_and_computes_what_packing_in_memory_does(packed, untied):
    ref = logits(Llama.load(untied, cache=False))
    cold = Llama.load(untied)
    assert (cold.pack_cache.read, cold.pack_cache.written) == (False, True)
    assert files(packed) == [cold.pack_cache.path.name]
    assert maps_file(cold.weights.layers[1].wo.qs, cold.pack_cache.path)    # packed there, not copied there
    np.testing.assert_array_equal(logits(cold), ref)
    warm = Llama.load(untied)
    assert warm.pack_cache.read
    np.testing.assert_array_equal(logits(warm), ref)


def test_a_load_that_fails_while_packing_leaves_no_entry_and_no_partial_file(packed, untied, monkeypatch):
    real, calls = packing.pack_concat, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt                   # Ctrl-C halfway through
        return real(*args, **kw)

    monkeypatch.setattr(packing, "pack_concat", failing)
    with pytest.raises(KeyboardInterrupt):
        Llama.load(untied)
    assert files(packed) == []
    monkeypatch.setattr(packing, "pack_concat", real)
    assert Llama.load(untied).pack_cache.written


def test_a_disk_that_fills_while_packing_is_one_warning_and_the_model_loads(packed, untied, monkeypatch):
    ref = logits(Llama.load(untied, cache=False))
    real, calls = os.posix_fallocate, []

    def fallocate(fd, offset, length):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(packcache.EntryArena, "CHUNK_BYTES", 4096)       # a map (and fallocate) a page at a time
    with pytest.warns(UserWarning, match="cache is skipped: could not write .*No space left") as caught:
        model = Llama.load(untied)
    assert len(caught) == 1 and not model.pack_cache.written
    assert files(packed) == []
    np.testing.assert_array_equal(logits(model), ref)


def test_a_disk_that_fills_between_a_weights_arrays_is_one_warning_too(packed, untied, monkeypatch):
    # a weight's quants are in the file, its scales ([T, B, TR], float32 or fp16 bits) are refused:
    # it is kept whole in memory
    ref = logits(Llama.load(untied, cache=False))
    real = packcache.EntryArena._in_file

    def in_file(self, shape, dtype):
        if len(shape) == 3 and shape[1] > 1 and shape[2] == packing.TR and self.end > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, shape, dtype)

    monkeypatch.setattr(packcache.EntryArena, "_in_file", in_file)
    with pytest.warns(UserWarning, match="cache is skipped: could not write .*No space left") as caught:
        model = Llama.load(untied)
    assert len(caught) == 1 and not model.pack_cache.written and files(packed) == []
    np.testing.assert_array_equal(logits(model), ref)


def test_load_u32_reads_little_endian_words_at_any_alignment():
    from numba import njit

    @njit
    def words(a, n):
        out = np.empty(n, dtype=np.uint32)
        for i in range(n):
            out[i] = tiles.load_u32(a, i)
        return out

    a = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8)
    got = words(a, 60)
    assert [int(v) for v in got] == [tiles.load_u32_np(a, i) for i in range(60)]


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_a_matrix_packed_with_release_lets_its_file_bytes_go_as_it_goes(monkeypatch, mode):
    # an output matrix is packed a slice at a time, each slice's file bytes released once packed:
    # the same tiles as packed whole, every byte released once, in order, after its rows are packed
    n_out, n_in = 300, 256
    raw = gguf.quants.quantize(np.random.default_rng(1).normal(size=(n_out, n_in)).astype(np.float32), T.Q8_0)
    row_bytes = raw.nbytes // n_out
    monkeypatch.setattr(packing, "RELEASE_BYTES", 40 * row_bytes)
    want = packing.pack("output.weight", T.Q8_0, raw, n_out, n_in, activations=mode)
    events, real = [], packing.repack_tiles

    def repack(ggml_type, blocks, row0, *args):
        events.append(("packed", row0 * row_bytes, blocks.shape[0] * row_bytes))
        return real(ggml_type, blocks, row0, *args)

    monkeypatch.setattr(packing, "repack_tiles", repack)
    got = packing.pack("output.weight", T.Q8_0, raw, n_out, n_in, activations=mode,
                       release=lambda at, n: events.append(("released", at, n)))
    for a, b in zip((got.qs, got.d, got.m), (want.qs, want.d, want.m)):
        np.testing.assert_array_equal(a, b)
    packed = [e[1:] for e in events if e[0] == "packed"]
    assert len(packed) == 8 and [e for e in events if e[0] == "released"] == [("released", *p) for p in packed]
    assert events[::2] == [("packed", *p) for p in packed]          # each slice released right after it is packed
    assert sum(n for _, n in packed) == raw.nbytes
