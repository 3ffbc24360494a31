"""The importance-matrix file: llama.cpp's GGUF layout (checked with gguf-py's own reader, not
ours), the legacy .dat layout (bytes built here from llama.cpp's description), and the errors."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from llamatrace.errors import OptionError, OutputError
from llamatrace.quantize.imatrix.files import ImatrixMeta, read_imatrix, read_imatrix_meta, write_imatrix

ENTRIES = {
    "blk.1.ffn_down.weight": (np.arange(6, dtype=np.float64) * 0.5, 256),
    "blk.0.attn_q.weight": (np.linspace(0, 1, 4), np.array([256])),
    "blk.0.ffn_up_exps.weight": (np.arange(8, dtype=np.float32).reshape(2, 4), np.array([3, 0])),
}


def test_the_gguf_layout_is_llama_imatrix_s(tmp_path):
    path = tmp_path / "imatrix.gguf"
    write_imatrix(path, ENTRIES, ImatrixMeta(["calib.txt"], 2, 128))
    r = gguf.GGUFReader(path)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert keys == ["general.type", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"]
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.datasets"].contents() == ["calib.txt"]
    assert r.fields["imatrix.chunk_count"].types == [gguf.GGUFValueType.UINT32]
    assert (r.fields["imatrix.chunk_count"].contents(), r.fields["imatrix.chunk_size"].contents()) == (2, 128)
    # sorted by weight name, in_sum2 then counts; ggml shapes {n_in, n_mat} and {1, n_mat}
    got = [(t.name, t.shape.tolist(), t.tensor_type) for t in r.tensors]
    F32 = gguf.GGMLQuantizationType.F32
    assert got == [("blk.0.attn_q.weight.in_sum2", [4, 1], F32), ("blk.0.attn_q.weight.counts", [1, 1], F32),
                   ("blk.0.ffn_up_exps.weight.in_sum2", [4, 2], F32), ("blk.0.ffn_up_exps.weight.counts", [1, 2], F32),
                   ("blk.1.ffn_down.weight.in_sum2", [6, 1], F32), ("blk.1.ffn_down.weight.counts", [1, 1], F32)]
    np.testing.assert_array_equal(r.tensors[2].data, np.arange(8).reshape(2, 4))
    np.testing.assert_array_equal(r.tensors[3].data.reshape(-1), [3, 0])


def test_a_written_file_reads_back(tmp_path):
    path = tmp_path / "imatrix.gguf"
    write_imatrix(path, ENTRIES, ImatrixMeta(["a.txt", "b.txt"], 2, 128))
    got = read_imatrix(path)
    assert sorted(got) == sorted(ENTRIES)
    for name, (sums, counts) in ENTRIES.items():
        assert got[name][0].dtype == np.float32 and got[name][1].dtype == np.int64
        np.testing.assert_array_equal(got[name][0], np.asarray(sums, dtype=np.float32))
        np.testing.assert_array_equal(got[name][1], np.atleast_1d(counts))
    assert read_imatrix_meta(path) == ImatrixMeta(["a.txt", "b.txt"], 2, 128)


def _legacy_bytes(entries, trailer=True) -> bytes:
    """save_imatrix_legacy's layout: values are mean(x²)·ncall, the count is ncall."""
    out = struct.pack("<i", len(entries))
    for name, (values, ncall) in entries.items():
        raw = name.encode()
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, len(values))
        out += np.asarray(values, dtype=np.float32).tobytes()
    if trailer:
        out += struct.pack("<i", 7) + struct.pack("<i", 9) + b"calib.txt"
    return out


@pytest.mark.parametrize("trailer", [True, False])
def test_a_legacy_dat_file_reads_as_the_same_means(tmp_path, trailer):
    path = tmp_path / "imatrix.dat"
    path.write_bytes(_legacy_bytes({"blk.0.attn_k.weight": ([2.0, 4.0, 6.0], 7)}, trailer))
    sums, counts = read_imatrix(path)["blk.0.attn_k.weight"]
    np.testing.assert_allclose(sums / counts, np.array([2.0, 4.0, 6.0]) / 7, rtol=1e-7)
    assert read_imatrix_meta(path) == (ImatrixMeta(["calib.txt"], 7, 0) if trailer else ImatrixMeta())


def test_files_that_are_not_an_imatrix_are_refused(tmp_path, tiny_model_path):
    with pytest.raises(OptionError, match="not an importance matrix"):
        read_imatrix(tiny_model_path)
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"hello, this is not an imatrix at all\n")
    with pytest.raises(OptionError, match="neither a GGUF imatrix nor a legacy"):
        read_imatrix(junk)
    cut = tmp_path / "cut.dat"
    cut.write_bytes(_legacy_bytes({"blk.0.attn_k.weight": ([2.0, 4.0, 6.0], 7)})[:20])
    with pytest.raises(OptionError, match="neither a GGUF imatrix"):
        read_imatrix(cut)
    with pytest.raises(OptionError, match="cannot read it"):
        read_imatrix(tmp_path / "missing.gguf")
    truncated = tmp_path / "truncated.gguf"
    write_imatrix(truncated, ENTRIES, ImatrixMeta(["a"], 1, 1))
    truncated.write_bytes(truncated.read_bytes()[:-64])
    with pytest.raises(OptionError, match="not a readable GGUF imatrix"):
        read_imatrix(truncated)


def test_an_unwritable_path_leaves_nothing(tmp_path):
    with pytest.raises(OutputError):
        write_imatrix(tmp_path / "no" / "such" / "dir.gguf", ENTRIES, ImatrixMeta())
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        write_imatrix(tmp_path / "d", ENTRIES, ImatrixMeta())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
