"""Tests for llamatrace.gguf.validate: a valid file, a truncation sweep, one crafted header per rule,
and a property test that mutates a valid header and cross-checks gguf-py's GGUFReader."""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamatrace.errors import ModelFormatError, ModelNotFoundError
from gguf_factory import write_tiny_llama
from llamatrace.gguf.reader import open_gguf
from llamatrace.gguf.validate import GGUFSummary, validate_gguf

HANG_GUARD_S = 30.0  # not a speed check: only turns an endless loop into a failure


# ---------------------------------------------------------------------------------------------
# A real file written by gguf-py


def _write_valid(path: Path, alignment: int | None = None) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 2.25)
    w.add_array("t.arr_str", ["a", "", "bc", "ünï", "<|im_end|>"])
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, 1.5])
    w.add_key_value("t.arr_u16", [1, 2, 3], V.ARRAY, sub_type=V.UINT16)
    w.add_key_value("t.arr_bool", [True, False], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("t.arr_u64", [2**64 - 1], V.ARRAY, sub_type=V.UINT64)
    w.add_tensor("t.f32", rng.standard_normal((4, 8)).astype(np.float32))
    w.add_tensor("t.f16", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("t.q8_0", q8, raw_dtype=Q.Q8_0)
    q41 = gguf.quants.quantize(rng.standard_normal((3, 2, 32)).astype(np.float32), Q.Q4_1)
    w.add_tensor("blk.0.attn_q.weight", q41, raw_dtype=Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("valid") / "model.gguf"
    _write_valid(path)
    return path, path.read_bytes()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scratch") / "mutant.gguf"


def _reader_summary(path: Path) -> tuple[int, int, list[int], int]:
    r = gguf.GGUFReader(str(path))
    n_kv = len(r.fields) - 3  # GGUFReader adds GGUF.version / tensor_count / kv_count
    return len(r.tensors), n_kv, [t.data_offset for t in r.tensors], r.data_offset


def _last_data_end(path: Path) -> int:
    r = gguf.GGUFReader(str(path))
    return max(t.data_offset + t.n_bytes for t in r.tensors)


def test_valid_file_agrees_with_gguf_reader(valid):
    path, data = valid
    s = validate_gguf(path)
    assert isinstance(s, GGUFSummary)
    n_tensors, n_kv, offsets, data_offset = _reader_summary(path)
    assert (s.version, s.alignment, s.file_size) == (3, 32, len(data))
    assert (s.n_tensors, s.n_kv, s.data_offset) == (n_tensors, n_kv, data_offset) == (4, 19, data_offset)
    assert s.data_offset % s.alignment == 0
    assert offsets[0] == s.data_offset and all(o % 32 == 0 for o in offsets)
    assert validate_gguf(str(path)) == s  # str paths work too


def test_custom_alignment_and_version_2(tmp_path):
    path = tmp_path / "a.gguf"
    _write_valid(path, alignment=256)
    s = validate_gguf(path)
    assert s.alignment == 256 and s.data_offset % 256 == 0
    assert s.data_offset == gguf.GGUFReader(str(path)).data_offset
    raw = bytearray(path.read_bytes())
    raw[4:8] = struct.pack("<I", 2)  # v2 and v3 share the layout
    path.write_bytes(raw)
    assert validate_gguf(path).version == 2


@pytest.mark.model
def test_real_model_header_items(smollm2_path):
    s = validate_gguf(smollm2_path)
    assert (s.n_tensors, s.n_kv, s.version) == (272, 33, 3)
    reader = gguf.GGUFReader(str(smollm2_path))
    strings = sum(len(f.data) for f in reader.fields.values()
                  if f.types and f.types[0] == V.ARRAY and f.types[-1] == V.STRING)
    assert strings == 49152 + 48900 + 1  # tokens, merges, general.languages
    assert s.header_items == s.n_kv + s.n_tensors + strings


def test_header_items_are_bounded_but_admit_llama3_and_gpt_oss(tmp_path):
    """Bytes alone do not bound a reader's work: three million empty strings is a 24 MB header."""
    from llamatrace.gguf.validate import MAX_HEADER_ITEMS

    def strings_kv(name: str, n: int) -> bytes:
        return kv(name, V.ARRAY, struct.pack("<IQ", V.STRING, n) + struct.pack("<Q", 0) * n)

    msg = check(tmp_path, build(BASE_KVS + [strings_kv("tokenizer.ggml.tokens", 3_000_000)], BASE_TENSORS),
                f"over {MAX_HEADER_ITEMS} keys, tensors and strings", "tokenizer.ggml.tokens")
    assert "3000000" in msg
    # Llama 3's vocabulary: 128,256 tokens and 280,147 merges
    p = tmp_path / "llama3-sized.gguf"
    p.write_bytes(build(BASE_KVS + [strings_kv("tokenizer.ggml.tokens", 128_256),
                                    strings_kv("tokenizer.ggml.merges", 280_147)], BASE_TENSORS))
    s = validate_gguf(p)
    assert s.header_items == (4 + 2) + 128_256 + 280_147  # keys + tensors + strings
    # gpt-oss's o200k vocabulary as published: 201,088 tokens and 446,189 merges (refused until 2026-12-03)
    p = tmp_path / "gpt-oss-sized.gguf"
    p.write_bytes(build(BASE_KVS + [strings_kv("tokenizer.ggml.tokens", 201_088),
                                    strings_kv("tokenizer.ggml.merges", 446_189)], BASE_TENSORS))
    assert validate_gguf(p).header_items == (4 + 2) + 201_088 + 446_189


def test_missing_directory_unreadable(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        validate_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="directory"):
        validate_gguf(tmp_path)
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        p = tmp_path / "locked.gguf"
        p.write_bytes(b"GGUF")
        p.chmod(0)
        with pytest.raises(ModelNotFoundError):
            validate_gguf(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelFormatError, match=r"empty \(0 bytes\)"):
        validate_gguf(p)


# ---------------------------------------------------------------------------------------------
# Truncation sweep


def _expect_format_error(path: Path) -> ModelFormatError:
    try:
        with _time_limit(HANG_GUARD_S):
            validate_gguf(path)
    except ModelFormatError as exc:
        msg = str(exc)
        assert "\n" not in msg and str(path) in msg
        return exc
    raise AssertionError(f"{path} ({path.stat().st_size} bytes) was accepted")


def test_truncation_sweep(valid, scratch):
    path, data = valid
    end = _last_data_end(path)  # bytes after this are padding; cutting them leaves a valid file
    header_end = validate_gguf(path).data_offset
    cuts = list(range(header_end)) + list(range(header_end, end, 3)) + [end - 1]
    scratch.write_bytes(data)
    for cut in sorted(cuts, reverse=True):
        os.truncate(scratch, cut)  # much cheaper than rewriting the file on some file systems
        _expect_format_error(scratch)
    assert len(cuts) > 800


# ---------------------------------------------------------------------------------------------
# Hand-crafted headers: one test per rule


def s_(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s_(key) + struct.pack("<I", vtype) + payload


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, V.UINT32, struct.pack("<I", value))


def ti(name: str | bytes, dims, ttype: int = Q.F32, offset: int = 0) -> bytes:
    return s_(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def build(kvs=(), tensors=(), *, version=3, n_kv=None, n_tensors=None, data_len=None, align=32, magic=b"GGUF"):
    kvs, tensors = list(kvs), list(tensors)
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tensors)
    head += b"\0" * (-len(head) % align)
    return head + b"\0" * (1024 if data_len is None else data_len)


def _overwrite(path: Path, raw: bytes) -> None:
    """Replace the file's contents (opening with O_TRUNC is slow on some file systems)."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.write(raw)
        f.truncate()


def check(tmp_path: Path, raw: bytes, *patterns: str) -> str:
    p = tmp_path / "crafted.gguf"
    _overwrite(p, raw)
    msg = str(_expect_format_error(p))
    for pat in patterns:
        assert pat in msg, (pat, msg)
    return msg


BASE_KVS = [kv_u32("llama.block_count", 1), kv("general.name", V.STRING, s_("tiny"))]
BASE_TENSORS = [ti("a", [32, 2], Q.F32, 0), ti("b", [64], Q.Q8_0, 256)]


def test_builder_baseline_is_valid(tmp_path):
    p = tmp_path / "ok.gguf"
    p.write_bytes(build(BASE_KVS, BASE_TENSORS))
    s = validate_gguf(p)
    assert (s.n_kv, s.n_tensors) == (2, 2)
    r = gguf.GGUFReader(str(p))
    assert r.data_offset == s.data_offset and len(r.tensors) == 2


@pytest.mark.parametrize(
    "head, needle",
    [
        (struct.pack("<Q", 100) + b'{"__metadata__": {}}' + b" " * 80, "safetensors"),
        (b"<!DOCTYPE html><html><head><title>Hugging Face</title>", "HTML"),
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n", "Git LFS pointer"),
        (b"PK\x03\x04" + b"\0" * 60, "zip"),
        (b"tjgg" + b"\0" * 60, "pre-GGUF"),
        (b'{"architectures": ["LlamaForCausalLM"]}', "JSON"),
        (b"GGUX" + b"\0" * 60, "not a GGUF file"),
        (b"\x00\x01", "not a GGUF file"),
        (b"GG", "only 2 bytes"),
    ],
)
def test_bad_magic(tmp_path, head, needle):
    check(tmp_path, head, needle)


@pytest.mark.parametrize(
    "version, needle",
    [(1, "version 1"), (4, "version 4"), (0, "invalid GGUF version 0"), (0x03000000, "big-endian"),
     (0xFFFFFFFF, "invalid GGUF version")],
)
def test_bad_version(tmp_path, version, needle):
    check(tmp_path, build(BASE_KVS, BASE_TENSORS, version=version), needle)


def test_big_endian_file_from_gguf_writer(tmp_path):
    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(p), arch="llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("x", np.ones((4,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    check(tmp_path, p.read_bytes(), "big-endian", "gguf_convert_endian")


def test_huge_counts(tmp_path):
    check(tmp_path, build(BASE_KVS, BASE_TENSORS, n_kv=2**63), f"{2**63} key/value pairs")
    check(tmp_path, build(BASE_KVS, BASE_TENSORS, n_tensors=2**40), f"{2**40} tensors")
    # under the sanity cap but more than the file could hold
    msg = check(tmp_path, build(BASE_KVS, BASE_TENSORS, n_kv=5000), "5000 key/value pairs", "bytes follow")
    assert "truncated" in msg


def test_huge_key_length(tmp_path):
    bad = struct.pack("<Q", 2**64 - 1) + b"k" + struct.pack("<I", V.UINT8) + b"\0"
    check(tmp_path, build([bad] + BASE_KVS, BASE_TENSORS), f"claims {2**64 - 1} bytes")


def test_huge_string_value_length(tmp_path):
    bad = s_("k") + struct.pack("<IQ", V.STRING, 2**40)
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), "string value of key 'k'", f"claims {2**40} bytes")


def test_huge_array_lengths(tmp_path):
    bad = kv("arr", V.ARRAY, struct.pack("<IQ", V.UINT8, 2**62))
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), f"claims {2**62} uint8 elements")
    bad = kv("arr", V.ARRAY, struct.pack("<IQ", V.UINT64, 2**61))  # 2**61 * 8 wraps to 0 in uint64 math
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), f"claims {2**61} uint64 elements")
    bad = kv("arr", V.ARRAY, struct.pack("<IQ", V.STRING, 10**12))
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), f"claims {10**12} string elements")
    # a string inside an array with a huge length
    bad = kv("arr", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + s_("ok") + struct.pack("<Q", 2**50))
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), "string #1 of array 'arr'", f"claims {2**50} bytes")


def test_nested_array(tmp_path):
    bad = kv("nest", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) + struct.pack("<IQ", V.UINT8, 1) + b"\0")
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), "array of arrays")


def test_unknown_value_types(tmp_path):
    check(tmp_path, build(BASE_KVS + [kv("k", 13, b"\0" * 8)], BASE_TENSORS),
          "unknown value type 13 (valid types are 0..12)")
    check(tmp_path, build(BASE_KVS + [kv("k", 2**31, b"\0" * 8)], BASE_TENSORS), f"unknown value type {2**31}")
    bad = kv("k", V.ARRAY, struct.pack("<IQ", 99, 0))
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), "unknown element type 99")


@pytest.mark.parametrize("dims", [[], [32, 1, 1, 1, 1]])
def test_bad_n_dims(tmp_path, dims):
    check(tmp_path, build(BASE_KVS, [ti("x", dims)]), f"has {len(dims)} dimensions")


def test_bad_dims(tmp_path):
    check(tmp_path, build(BASE_KVS, [ti("x", [32, 2**64 - 1])]), "dimension 1 is 18446744073709551615", "-1 as int64")
    check(tmp_path, build(BASE_KVS, [ti("x", [32, 0])]), "dimension 1 is 0")
    check(tmp_path, build(BASE_KVS, [ti("x", [2**32, 2**31])]), "more than int64")
    check(tmp_path, build(BASE_KVS, [ti("x", [2**20, 2**20, 2**20, 2**20])]), "more than int64")


def test_unknown_tensor_type(tmp_path):
    check(tmp_path, build(BASE_KVS, [ti("x", [32], 4)]), "unknown ggml type 4")
    check(tmp_path, build(BASE_KVS, [ti("x", [32], 1000)]), "unknown ggml type 1000")
    check(tmp_path, build(BASE_KVS, [ti("x", [32], 32)]), "Q4_0_4_8 (32), an ARM repacking", "Q4_0 version")


def test_row_not_multiple_of_block(tmp_path):
    check(tmp_path, build(BASE_KVS, [ti("x", [33, 2], Q.Q8_0)]), "Q8_0 has 33 elements per row", "block size 32")
    check(tmp_path, build(BASE_KVS, [ti("x", [100], Q.Q4_K)]), "block size 256")


def test_misaligned_offset(tmp_path):
    check(tmp_path, build(BASE_KVS, [ti("a", [8], Q.F32, 0), ti("b", [8], Q.F32, 40)]),
          "offset 40 is not a multiple of the alignment 32")


def test_overlapping_and_out_of_order_tensors(tmp_path):
    check(tmp_path, build(BASE_KVS, [ti("a", [64], Q.F32, 0), ti("b", [8], Q.F32, 128)]),
          "'b' data [offset 128, 32 bytes] overlaps tensor 'a' [offset 0, 256 bytes]")
    check(tmp_path, build(BASE_KVS, [ti("a", [8], Q.F32, 0), ti("b", [8], Q.F32, 0)]), "overlaps")
    check(tmp_path, build(BASE_KVS, [ti("a", [8], Q.F32, 64), ti("b", [8], Q.F32, 0)]), "comes before")


def test_tensor_past_eof(tmp_path):
    raw = build(BASE_KVS, [ti("blk.0.attn_q.weight", [64, 64], Q.F32, 0)], data_len=100)
    data_offset = len(raw) - 100
    msg = check(tmp_path, raw, f"tensor 'blk.0.attn_q.weight' data [offset {data_offset}, 16384 bytes] "
                               f"runs past end of file ({len(raw)} bytes)", "re-download")
    assert msg.startswith(str(tmp_path / "crafted.gguf") + ": ")
    check(tmp_path, build(BASE_KVS, [ti("x", [8], Q.F32, 2**63)]), "runs past end of file")


@pytest.mark.parametrize("value", [0, 48, 3, 2**32 - 1])
def test_alignment_not_power_of_two(tmp_path, value):
    check(tmp_path, build(BASE_KVS + [kv_u32("general.alignment", value)], BASE_TENSORS),
          f"'general.alignment' is {value}, which is not a power of two")


def test_alignment_wrong_type(tmp_path):
    bad = kv("general.alignment", V.UINT64, struct.pack("<Q", 64))
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), "type uint64", "single uint32")
    bad = kv("general.alignment", V.ARRAY, struct.pack("<IQI", V.UINT32, 1, 64))
    check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), "type array")


def test_alignment_is_used(tmp_path):
    p = tmp_path / "a64.gguf"
    tensors = [ti("a", [16], Q.F32, 0), ti("b", [16], Q.F32, 64)]
    p.write_bytes(build(BASE_KVS + [kv_u32("general.alignment", 64)], tensors, align=64))
    s = validate_gguf(p)
    assert s.alignment == 64 and s.data_offset % 64 == 0
    assert gguf.GGUFReader(str(p)).data_offset == s.data_offset
    check(tmp_path, build(BASE_KVS + [kv_u32("general.alignment", 64)], [ti("a", [16]), ti("b", [16], Q.F32, 96)],
                          align=64), "not a multiple of the alignment 64")


def test_duplicate_key(tmp_path):
    check(tmp_path, build(BASE_KVS + [kv_u32("llama.block_count", 2)], BASE_TENSORS),
          "duplicate key 'llama.block_count' (key #2")


def test_duplicate_tensor_name(tmp_path):
    check(tmp_path, build(BASE_KVS, [ti("a", [8], Q.F32, 0), ti("a", [8], Q.F32, 32)]),
          "duplicate tensor name 'a' (tensor #1")


def test_tensor_name_too_long_and_bad_utf8(tmp_path):
    check(tmp_path, build(BASE_KVS, [ti("x" * 64, [8])]), "64 bytes long", "limit of 63")
    check(tmp_path, build(BASE_KVS, [ti(b"\xff\xfe", [8])]), "not valid UTF-8")
    check(tmp_path, build([kv_u32(b"\xc3(", 1)], BASE_TENSORS), "key #0", "not valid UTF-8")


def test_key_reserved_by_gguf_reader(tmp_path):
    check(tmp_path, build(BASE_KVS + [kv_u32("GGUF.version", 3)], BASE_TENSORS), "reserved")


def test_message_is_one_line_with_file_numbers_and_fix(tmp_path):
    bad = kv("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.INT32, 10**9))
    msg = check(tmp_path, build(BASE_KVS + [bad], BASE_TENSORS), str(tmp_path / "crafted.gguf"),
                "'tokenizer.ggml.tokens'", "1000000000 int32 elements", "4000000000 bytes", "re-download it")
    assert msg.count("\n") == 0


# ---------------------------------------------------------------------------------------------
# Property test: mutate a valid header, validate must return or raise ModelFormatError quickly;
# whenever it passes, gguf-py's GGUFReader must open the file too.


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _int_fields(path: Path) -> list[tuple[int, int]]:
    """(file offset, width) of every integer field gguf-py sees: lengths, counts, types, dims, offsets."""
    r = gguf.GGUFReader(str(path))
    base = r.data.ctypes.data
    fields = []
    parts = [p for f in r.fields.values() for p in f.parts]
    parts += [p for t in r.tensors for p in t.field.parts]
    for part in parts:
        if part.dtype.kind in "ui" and part.dtype.itemsize in (4, 8) and part.size == 1:
            fields.append((part.ctypes.data - base, part.dtype.itemsize))
    return sorted(set(fields))


_INTERESTING = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 63, 64, 255, 256, 2**16, 2**31 - 1, 2**31,
                2**32 - 1, 2**32, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def _mutations(draw, header_len: int, n_fields: int):
    kind = draw(st.sampled_from(["field", "field", "bytes", "splice", "truncate+field"]))
    if kind.endswith("field"):
        idx = draw(st.integers(0, n_fields - 1))
        value = draw(st.one_of(st.sampled_from(_INTERESTING), st.integers(0, 2**64 - 1),
                               st.integers(-64, 64)))
        return kind, idx, value
    if kind == "bytes":
        return kind, draw(st.lists(st.tuples(st.integers(0, header_len - 1), st.integers(0, 255)),
                                   min_size=1, max_size=4))
    pos = draw(st.integers(0, header_len))
    return kind, pos, draw(st.integers(0, 16)), draw(st.binary(max_size=16))


def _apply(data: bytes, fields: list[tuple[int, int]], mutation) -> bytes:
    raw = bytearray(data)
    kind = mutation[0]
    if kind.endswith("field"):
        _, idx, value = mutation
        off, width = fields[idx]
        if kind.startswith("truncate"):
            del raw[len(data) - len(data) // 3:]
        if value < 0:  # small relative change of the existing value
            value = int.from_bytes(raw[off:off + width], "little") + value
        raw[off:off + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    elif kind == "bytes":
        for pos, byte in mutation[1]:
            raw[pos] = byte
    else:  # splice: delete some bytes and insert others
        _, pos, n_del, ins = mutation
        raw[pos:pos + n_del] = ins
    return bytes(raw)


_stats = {"examples": 0, "passed": 0}


def assert_same_as_gguf_reader(f, reader: gguf.GGUFReader) -> None:
    """llamatrace.gguf.reader's file equals gguf-py's reading of it: every key, every tensor."""
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(f._kv_offsets) == set(fields)
    for key, field in fields.items():
        try:
            expected = field.contents()
        except UnicodeDecodeError:  # gguf-py gives up on invalid UTF-8; we show U+FFFD instead
            assert "\ufffd" in str(f.field(key)), key
            continue
        assert f.field(key) == expected, key
    assert list(f.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = f.tensors[t.name]
        assert ours.tensor_type == t.tensor_type and ours.shape.tolist() == t.shape.tolist()
        assert (ours.n_elements, ours.n_bytes) == (t.n_elements, t.n_bytes)
        assert ours.data.dtype == t.data.dtype and ours.data.shape == t.data.shape
        np.testing.assert_array_equal(ours.data, t.data)


def test_own_reader_matches_gguf_reader_on_the_default_model(smollm2_path):
    assert_same_as_gguf_reader(open_gguf(smollm2_path), gguf.GGUFReader(str(smollm2_path)))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_own_reader_matches_gguf_reader_on_every_type(tmp_path, qtype):
    path = write_tiny_llama(tmp_path / "t.gguf", qtype=qtype, rope_freqs=np.ones(8))
    assert_same_as_gguf_reader(open_gguf(path), gguf.GGUFReader(str(path)))


def test_mutated_headers(valid, scratch):
    path, data = valid
    fields = _int_fields(path)
    header_len = validate_gguf(path).data_offset
    assert len(fields) > 40

    @settings(max_examples=600, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(_mutations(header_len, len(fields)))
    def run(mutation):
        mutated = _apply(data, fields, mutation)
        _overwrite(scratch, mutated)
        _stats["examples"] += 1
        try:
            with _time_limit(HANG_GUARD_S):
                summary = validate_gguf(scratch)
        except ModelFormatError as exc:
            assert "\n" not in str(exc)
            return
        _stats["passed"] += 1
        # every item costs at least 8 header bytes: the reader's work is bounded by the header
        assert summary.header_items <= header_len // 8
        # Ours accepted it: gguf-py must be able to open it (no hang) and agree with us.
        with _time_limit(HANG_GUARD_S):
            reader = gguf.GGUFReader(str(scratch))
        assert len(reader.tensors) == summary.n_tensors
        assert reader.data_offset == summary.data_offset
        assert len(reader.fields) - 3 == summary.n_kv
        for t in reader.tensors:
            assert t.data_offset + t.n_bytes <= summary.file_size
        # and our own reader, built on the validator's offsets, reads what gguf-py reads
        assert_same_as_gguf_reader(open_gguf(scratch), reader)

    run()
    assert _stats["examples"] >= 600
    assert _stats["passed"] >= 20  # the GGUFReader cross-check really ran


def test_open_gguf_knows_the_format_version_and_info_prints_it(tiny_model_path, capsys):
    from llamatrace.cli import main
    from llamatrace.gguf.reader import open_gguf

    assert open_gguf(tiny_model_path).version == 3
    assert main(["info", "-m", str(tiny_model_path)]) == 0
    out = capsys.readouterr().out
    assert "GGUF v3)" in out and "vNone" not in out


def test_one_description_of_value_types_serves_validator_and_reader():
    import struct

    from gguf import GGUFValueType

    from llamatrace.gguf import header
    assert {header.FIXED[int(t)].name for t in GGUFValueType if int(t) in header.FIXED} == {
        t.name.lower() for t in GGUFValueType if t not in (GGUFValueType.STRING, GGUFValueType.ARRAY)}
    for vtype, vt in header.FIXED.items():
        assert vt.size == struct.calcsize(vt.fmt) == vt.dtype.itemsize
    assert header.type_name(int(GGUFValueType.STRING)) == "string"
    assert header.type_name(99) == "unknown (99)"


def _mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (Linux's /proc/self/maps names each mapped file)."""
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_a_closed_gguf_file_is_unmapped_and_keeps_its_header(tiny_model_path, tmp_path):
    path = tmp_path / "copy.gguf"
    path.write_bytes(tiny_model_path.read_bytes())
    with open_gguf(path) as f:
        assert _mapped(path) and not f.closed
        name = next(iter(f.tensors))
        stored = f.tensors[name].data.copy()
        held = f.tensors[name].data
        with pytest.raises(BufferError, match="still referenced"):
            f.close()                             # a view of the map is alive: refused, not a crash
        del held
    assert f.closed and not _mapped(path)
    assert f.tensors[name].n_bytes == stored.nbytes and f.metadata["general.architecture"] == "llama"
    with pytest.raises(ValueError, match="closed"):
        f.tensors[name].data
    with pytest.raises(ValueError, match="closed"):
        f.field("tokenizer.ggml.tokens")
    f.close()                                     # again: nothing


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_a_closed_model_releases_its_gguf_and_still_runs(tiny_model_path, tmp_path):
    from llamatrace.corpus.chunks import read_header
    from llamatrace.model.llama import Llama

    path = tmp_path / "copy.gguf"
    path.write_bytes(tiny_model_path.read_bytes())
    tokenizer, config = read_header(path)         # reads the header only: nothing stays mapped
    assert config.n_layers == 2 and not _mapped(path)
    with Llama.load(path) as model:
        assert _mapped(path)
        before = list(model.generate([1, 2, 3], max_tokens=4))
    assert not _mapped(path)
    assert list(model.generate([1, 2, 3], max_tokens=4)) == before     # the weights are packed copies
    path.unlink()                                 # nothing holds the file
