"""GGUF string arrays read as one buffer (llamatrace.gguf.reader.StringArray), the offsets
validate_gguf's walk records for them, and the tokenizer's merges read from that buffer:
every string equal to gguf-py's GGUFReader's bytes, every error as before."""

from __future__ import annotations

import random
import re

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

from gguf_factory import vocabulary, write_tiny_llama
from llamatrace.errors import ModelFormatError
from llamatrace.gguf import validate
from llamatrace.gguf.reader import StringArray, open_gguf
from llamatrace.text.tokenizer import Tokenizer
from llamatrace.text.vocab import bpe_ranks, bpe_token_bytes, spm_ranks, spm_token_bytes

# Many strings (crossing validate's buffer refills), ASCII and not, empty ones, one invalid UTF-8.
_rng = random.Random(0)
_ALPHABET = "abcĠĊ é中😀<|>"
MANY = ["".join(_rng.choice(_ALPHABET) for _ in range(_rng.randrange(0, 12))) for _ in range(30_000)]
ARRAYS = {
    "t.small": ["a", "", "bc", "ünï", "<|im_end|>", "Ġthe"],
    "t.many": MANY,
    "t.one_empty": [""],
    "t.ascii": ["x" * n for n in range(40)],
    "t.bad_utf8": [b"ok", b"\xff\xfe", "é".encode(), b"\xc3"],    # not UTF-8: U+FFFD, as gguf-py's errors="replace"
}


@pytest.fixture(scope="module")
def strings_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("strings") / "s.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, values in ARRAYS.items():
        w.add_key_value(key, values, V.ARRAY, sub_type=V.STRING)
    w.add_tensor("t.f32", np.zeros((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_py_bytes(reader: gguf.GGUFReader, key: str) -> list[bytes]:
    field = reader.fields[key]
    return [bytes(field.parts[i]) for i in field.data]


@pytest.mark.parametrize("key", list(ARRAYS))
def test_a_string_array_is_one_buffer_of_gguf_readers_strings(strings_file, key):
    expected = _gguf_py_bytes(gguf.GGUFReader(str(strings_file)), key)
    with open_gguf(strings_file) as f:
        array = f.strings(key)
        listed = f.field(key)
    assert isinstance(array, StringArray) and len(array) == len(expected)
    assert array.ends.dtype == np.int64
    ends = array.ends.tolist()
    assert [array.data[a:b] for a, b in zip([0, *ends[:-1]], ends)] == expected
    assert listed == array.tolist() == [s.decode("utf-8", errors="replace") for s in expected]


def test_the_walk_records_each_strings_length(strings_file):
    summary = validate.validate_gguf(strings_file)
    for key, values in ARRAYS.items():
        vtype, pos = summary.kv_offsets[key]
        lengths = summary.string_lengths[pos]
        assert vtype == V.ARRAY and lengths.dtype == np.uint32
        assert lengths.tolist() == [len(v if isinstance(v, bytes) else v.encode()) for v in values]


def test_strings_is_none_for_a_missing_key_or_another_type(strings_file):
    with open_gguf(strings_file) as f:
        assert f.strings("no.such.key") is None
        assert f.strings("general.architecture") is None       # a string, not an array of them


def test_a_too_long_string_inside_an_array_is_named_with_its_index(tmp_path, monkeypatch):
    path = tmp_path / "long.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_key_value("t.arr", ["ok", "toolong", "x", "alsotoolong"], V.ARRAY, sub_type=V.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    monkeypatch.setattr(validate, "MAX_STRING_LEN", 5)    # "llama" is 5
    with pytest.raises(ModelFormatError, match=r"string #1 of array 't.arr' at byte \d+ is 7 bytes long \(limit 5\)"):
        validate.validate_gguf(path)


def test_merges_read_from_the_buffer_give_the_lists_tables(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    tokens, types, merges = vocabulary()
    with open_gguf(path) as f:
        assert f.field("tokenizer.ggml.merges") == merges
        buffered = f.strings("tokenizer.ggml.merges")
        from_file = Tokenizer.from_reader(f, cache=False)
    id_bytes, is_text = bpe_token_bytes(tokens, types)
    assert bpe_ranks(types, buffered, id_bytes, is_text, "") == bpe_ranks(types, merges, id_bytes, is_text, "")
    from_lists = Tokenizer(tokens, types, merges, "smollm")
    assert from_file.vocab_tables == from_lists.vocab_tables
    assert from_file.encode("the cat in the hat") == from_lists.encode("the cat in the hat")


@pytest.mark.parametrize("bad", ["Ġt he x", "Ġthe", "Ġ 中", " Ġ Ġ"])
def test_a_bad_merge_is_named_whether_read_as_a_list_or_a_buffer(bad):
    tokens, types, merges = vocabulary()
    merges = [*merges[:3], bad, *merges[3:]]
    data = "".join(merges).encode()
    buffered = StringArray(data, np.cumsum([len(m.encode()) for m in merges], dtype=np.int64))
    id_bytes, is_text = bpe_token_bytes(tokens, types)
    for given in (merges, buffered):
        with pytest.raises(ModelFormatError, match=r"tokenizer\.ggml\.merges\[3\] = .* is not 'left right'"):
            bpe_ranks(types, given, id_bytes, is_text, "")


# ---- the vocabulary's tables, against the one-token-at-a-time definitions they replaced ----

def _spm_ranks_by_token(tokens, types, scores, id_bytes):
    """spm_ranks, one token and one character at a time (its definition, as it stood before the
    tables were built from whole arrays)."""
    byte_ids = {}
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text) if ttype == 6 else None
        if m:
            byte_ids.setdefault(int(m.group(1), 16), i)
    unk = next((i for i, t in enumerate(types) if t == 2), None)
    normal = {}
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        if ttype == 1 and text:
            normal.setdefault(text.encode(), i)
    atoms = {bytes([b]): None for b in range(256)}
    for raw in normal:
        for ch in raw.decode():
            for k in range(2, len(ch.encode()) + 1):
                atoms.setdefault(ch.encode()[:k])
    ranks, rank_to_ids = {}, []
    for raw in atoms:
        ranks[raw] = len(rank_to_ids)
        fallback = [byte_ids[b] for b in raw] if all(b in byte_ids for b in raw) else [unk] if unk is not None else []
        rank_to_ids.append([normal[raw]] if raw in normal else fallback)
    for _, i, raw in sorted((-float(scores[i]), i, raw) for raw, i in normal.items() if raw not in ranks):
        ranks[raw] = len(rank_to_ids)
        rank_to_ids.append([i])
    return ranks, rank_to_ids


SPM_TOKENS = ["<unk>", "<s>", "<0x41>", "<0xE4>", "<0xB8>", "<0x41>", "▁", "▁the", "中文", "the", "",
              "▁the", "é", "😀x", "ab", "a", "b", "\u2581\u2581", "ü"]
SPM_TYPES = [2, 3, 6, 6, 6, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 5]


@pytest.mark.parametrize("scores", [
    [0.0, 0.0, 0, 0, 0, 0, -1, -2, -3, -2, 0, -5, -1, -4, -2.5, -9, -9, -1e9, -1],
    [0.0, 0.0, 0, 0, 0, 0, -1, float("nan"), -3, -2, 0, -5, float("nan"), -4, -2.5, -9, -9, -1e9, -1],
], ids=["scores", "nan"])
def test_spm_tables_equal_their_token_by_token_definition(scores):
    id_bytes = spm_token_bytes(SPM_TOKENS, SPM_TYPES)
    assert id_bytes[2] == id_bytes[5] == b"A" and id_bytes[7] == b" the" and id_bytes[18] == "ü".encode()
    assert spm_ranks(SPM_TOKENS, SPM_TYPES, scores, id_bytes) == _spm_ranks_by_token(
        SPM_TOKENS, SPM_TYPES, scores, id_bytes)


def test_bpe_token_bytes_map_byte_level_text_and_keep_literal_tokens():
    tokens = ["Ġthe", "<|im_end|>", "ĊĊ", "中", "", "Ġ"]
    id_bytes, is_text = bpe_token_bytes(tokens, [1, 3, 1, 1, 1, 5])
    assert id_bytes == [b" the", b"<|im_end|>", b"\n\n", "中".encode(), b"", b" "]
    assert is_text == [False, True, False, True, False, False]
