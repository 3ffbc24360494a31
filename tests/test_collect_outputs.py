"""``collect``'s output directory: read as it is by pyarrow, pandas, polars and ``datasets``;
resumable after a kill at any write (a manifest or shard left half-written, an older layout);
a failed write leaves no temporary file and one error line."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run
from llamatrace.cli import main
from llamatrace.corpus import collect as C

pytestmark = pytest.mark.model

# ~30 sequences of 32 tokens, 2 a shard: 15 shards of one small hook, made in a few seconds
SETTINGS = ["--hook", "blocks.0.hook_resid_post", "--ctx-size", "32", "--shard-mb", "0.15"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(f"Line {i}: the capital of France is Paris, and of Italy Rome.\n" for i in range(60)),
                    encoding="utf-8")
    return path


def _collect(corpus: Path, out: Path, smollm2_path: Path) -> int:
    return main(["collect", "-f", str(corpus), *SETTINGS, "-o", str(out), "-m", str(smollm2_path)])


@pytest.fixture(scope="module")
def reference(corpus, smollm2_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "acts"
    assert _collect(corpus, out, smollm2_path) == 0
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _temp_files(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_the_directory_reads_with_pyarrow_pandas_polars_and_datasets(reference, tmp_path):
    import datasets
    import pandas as pd
    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    manifest = json.loads((reference / ".manifest.json").read_text())
    assert manifest["complete"] and manifest["n_shards"] > 3
    # the reference: each shard the manifest lists, read one by one, in order
    expected = pa.concat_tables([pq.read_table(reference / "data" / s["file"]) for s in manifest["shards"]])
    assert expected.num_rows == manifest["n_tokens"]
    acts = str(reference)
    assert pq.read_table(acts).equals(expected)
    assert pq.read_table(acts + "/").equals(expected)
    frame = pd.read_parquet(acts)
    assert list(frame.columns) == expected.column_names
    for name in expected.column_names:        # the hook's column holds one NumPy array per row
        assert np.array_equal(np.stack(frame[name]) if frame[name].dtype == object else frame[name].to_numpy(),
                              np.stack(expected.column(name).to_numpy(zero_copy_only=False)))
    assert pl.read_parquet(acts + "/**/*.parquet").to_arrow().equals(pl.from_arrow(expected).to_arrow())
    assert pl.scan_parquet(acts + "/**/*.parquet").collect().equals(pl.from_arrow(expected))
    cache = str(tmp_path / "hf")
    for hf in (datasets.load_dataset(acts, split="train", cache_dir=cache),
               datasets.load_dataset("parquet", data_dir=acts, split="train", cache_dir=cache)):
        assert hf.data.table.equals(expected)


def test_a_manifest_left_half_written_is_removed_and_the_run_resumes(reference, corpus, smollm2_path, tmp_path):
    """A run killed while writing its manifest leaves the manifest's temporary file in OUT (and a
    shard's in OUT/data): the rerun deletes them and completes, the same bytes."""
    out = tmp_path / "acts"
    shutil.copytree(reference, out)
    manifest = json.loads((out / C.MANIFEST).read_text())
    last = manifest["shards"].pop()                    # the state before the last shard was listed
    manifest["complete"] = False
    (out / C.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "data" / last["file"]).unlink()
    leftovers = [out / f".{C.MANIFEST}.k2j4_x9a.tmp", out / "data" / f".{last['file']}.a1b2c3d4.tmp"]
    for p in leftovers:
        p.write_bytes(b'{"format": "llamatrace.activations/1", "shar')
    assert _collect(corpus, out, smollm2_path) == 0
    assert not _temp_files(out)
    assert _files(out) == _files(reference)


def test_a_run_killed_before_its_first_manifest_resumes(reference, corpus, smollm2_path, tmp_path):
    out = tmp_path / "acts"
    (out / "data").mkdir(parents=True)
    (out / f".{C.MANIFEST}.0g1h2j3k.tmp").write_bytes(b"{")
    assert _collect(corpus, out, smollm2_path) == 0
    assert _files(out) == _files(reference)


def test_a_failed_manifest_write_leaves_no_temporary_file(corpus, smollm2_path, tmp_path, capsys, monkeypatch):
    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "acts"
    monkeypatch.setattr(os, "fsync", disk_full)        # the first write is the manifest's
    code, _, err = run(capsys, "collect", "-f", corpus, *SETTINGS, "-o", out, "-m", smollm2_path)
    errors = [line for line in err.splitlines() if line.startswith("error:")]   # after the model-load line
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    for needle in (str(out), "manifest", "No space left on device", "rerun"):
        assert needle in errors[0]
    assert not _temp_files(out)


def test_an_older_collection_with_manifest_json_resumes_and_is_renamed(reference, corpus, smollm2_path, tmp_path):
    out = tmp_path / "acts"
    shutil.copytree(reference, out)
    manifest = json.loads((out / ".manifest.json").read_text())
    last = manifest["shards"].pop()
    manifest["complete"] = False
    (out / ".manifest.json").unlink()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")     # the layout before
    (out / "data" / last["file"]).unlink()
    assert _collect(corpus, out, smollm2_path) == 0
    assert _files(out) == _files(reference)               # manifest.json is gone, .manifest.json complete


def test_write_atomic_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    from llamatrace.outputs import write_atomic
    calls = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def logged_replace(src, dst):
        calls.append(("replace", str(dst)))
        replace(src, dst)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name a file descriptor")
    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    target = tmp_path / "out.bin"
    write_atomic(target, lambda f: f.write(b"payload"), "--npz")
    assert target.read_bytes() == b"payload"
    assert [c[0] for c in calls] == ["fsync", "replace", "fsync"]
    assert Path(calls[0][1]).parent == tmp_path and Path(calls[0][1]).name.startswith(".out.bin.")
    assert calls[1][1] == str(target) and calls[2][1] == str(tmp_path)
    assert os.listdir(tmp_path) == ["out.bin"]


def test_write_atomic_leaves_no_temporary_file_when_the_write_fails(tmp_path, capsys):
    from llamatrace.errors import OutputError
    from llamatrace.outputs import write_atomic

    def fails(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError, match="--npz .*No space left on device"):
        write_atomic(tmp_path / "out.npz", fails, "--npz")
    assert os.listdir(tmp_path) == []
