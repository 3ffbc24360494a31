"""``llamatrace collect``: shards that datasets / pyarrow / polars read as they are, the same bytes
with any number of workers, on Ray, after a kill; one error line for each bad input."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run
from llamatrace.corpus import collect as C
from llamatrace.corpus.sequences import Packing, pack

pytestmark = pytest.mark.model

HOOKS = ["--hook", "blocks.0.attn.hook_v", "--hook", "blocks.1.ln1.hook_scale"]
SETTINGS = [*HOOKS, "--dtype", "float16", "--shard-mb", "4", "--ctx-size", "128"]
WORDS = ("the of and to in is that it for was on are as with his they at be this from have or by one had not "
         "but what all were when we there can an your which their said if do will each about how up out them "
         "then she many some so these would other into has more her two like him see time could no make than "
         "first been its who now people my made over did down only way find use may water long little very").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~108k tokens of generated text, one document per line."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))) + "\n"
                            for _ in range(2500)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(corpus, smollm2_path, tmp_path_factory) -> Path:
    """One uninterrupted in-process run (one worker)."""
    from llamatrace.cli import main
    out = tmp_path_factory.mktemp("ref") / "acts"
    assert main(["collect", "-f", str(corpus), *SETTINGS, "-o", str(out)]) == 0
    return out


def _same_bytes(a: Path, b: Path) -> None:
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*"))
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*"))
    for name in names:
        if (a / name).is_dir():
            continue
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_shards_load_with_datasets_pyarrow_and_polars(reference, smollm2):
    import datasets
    import polars
    import pyarrow.dataset as ds

    manifest = json.loads((reference / C.MANIFEST).read_text())
    assert manifest["complete"] and manifest["n_tokens"] >= 100_000
    assert manifest["n_tokens"] == manifest["n_sequences"] * 128 == sum(s["rows"] for s in manifest["shards"])
    assert len(manifest["shards"]) == manifest["n_shards"] > 5
    assert manifest["model"]["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    table = ds.dataset(reference / "data", format="parquet").to_table()
    assert table.num_rows == manifest["n_tokens"]
    assert table.column_names == ["sequence", "position", "token", "blocks.0.attn.hook_v", "blocks.1.ln1.hook_scale"]
    hf = datasets.load_dataset("parquet", data_dir=str(reference / "data"), split="train")
    assert hf.num_rows == manifest["n_tokens"] and len(hf[5]["blocks.0.attn.hook_v"]) == 3 * 64
    frame = polars.scan_parquet(str(reference / "data" / "*.parquet")).select(polars.len()).collect()
    assert frame.item() == manifest["n_tokens"]
    # a row holds what run_with_cache gives for its sequence and position (float16)
    seq = 7
    rows = table.filter(ds.field("sequence") == seq)
    ids = rows.column("token").to_numpy()
    _, cache = smollm2.run_with_cache(ids, names_filter=["blocks.0.attn.hook_v", "blocks.1.ln1.hook_scale"])
    stored = np.stack(rows.column("blocks.0.attn.hook_v").to_numpy(zero_copy_only=False))
    assert np.array_equal(stored, cache["blocks.0.attn.hook_v"][0].reshape(128, -1).astype(np.float16))
    assert rows.column("position").to_pylist() == list(range(128))


def test_two_workers_give_the_same_bytes(reference, corpus, smollm2_path, tmp_path, capsys):
    code, out, err = run(capsys, "collect", "-f", corpus, *SETTINGS, "-o", tmp_path / "acts", "--workers", "2",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["n_tokens"] == json.loads((reference / C.MANIFEST).read_text())["n_tokens"]
    _same_bytes(reference, tmp_path / "acts")


def dying_write_shard(model, job):
    """write_shard, but the first worker to get shard 2 exits at once (a marker file says so)."""
    marker = Path(job.out).parent / "died"
    if job.index == 2 and not marker.exists():
        marker.write_text("died")
        os._exit(1)
    return C.write_shard(model, job)


def _collection(corpus, path, out: Path, workers: int, ray=None) -> tuple[C.Collection, np.ndarray]:
    from llamatrace.corpus.chunks import read_header
    from llamatrace.corpus.worker import ModelSpec
    from llamatrace.gguf.fetch import sha256_file
    tokenizer, config = read_header(path)
    hooks = C.resolve_hooks(["blocks.0.attn.hook_v", "blocks.1.ln1.hook_scale"], config)
    c = C.Collection(ModelSpec(str(path), "f32", 1), sha256_file(path), corpus, hooks,
                     Packing.for_tokenizer(tokenizer, 128), "float16", 4.0, out, workers, ray)
    return c, C.prepare(c)


def test_a_killed_worker_changes_nothing(reference, corpus, smollm2_path, tmp_path):
    out = tmp_path / "acts"
    c, tokens = _collection(corpus, smollm2_path, out, 2)
    C.execute(c, tokens, work=dying_write_shard)
    assert (tmp_path / "died").exists()
    _same_bytes(reference, out)


def test_ray_gives_the_same_bytes_and_survives_a_killed_actor(reference, corpus, smollm2_path, tmp_path):
    ray = pytest.importorskip("ray")
    import ray.cloudpickle
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        c, tokens = _collection(corpus, smollm2_path, tmp_path / "acts", 2, ray="local")
        C.execute(c, tokens, work=dying_write_shard)
        assert (tmp_path / "died").exists()
        _same_bytes(reference, tmp_path / "acts")
    finally:
        ray.shutdown()


def test_a_killed_run_resumes_to_the_same_bytes(reference, corpus, smollm2_path, tmp_path):
    out = tmp_path / "acts"
    args = ["collect", "-f", str(corpus), *SETTINGS, "-o", str(out), "-m", str(smollm2_path)]
    # the run is held once its manifest lists two shards (an event, not a moment), then killed
    held = textwrap.dedent(f"""
        import sys, threading
        from llamatrace.cli import main
        from llamatrace.corpus import collect
        real = collect.write_manifest
        def write_manifest(c):
            real(c)
            if len(c.shards) == 2:
                print("2 shards", file=sys.stderr, flush=True)
                threading.Event().wait()
        collect.write_manifest = write_manifest
        sys.exit(main({args!r}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", held], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    line = proc.stderr.readline()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert line == "2 shards\n", line + proc.stderr.read()
    manifest = json.loads((out / C.MANIFEST).read_text())
    assert not manifest["complete"] and len(manifest["shards"]) == 2 < manifest["n_shards"]
    cmd = [sys.executable, "-m", "llamatrace", *args]
    finished = subprocess.run(cmd, capture_output=True, text=True, timeout=600)     # timeouts: hang guards
    assert finished.returncode == 0, finished.stderr
    _same_bytes(reference, out)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)     # nothing left to do
    assert again.returncode == 0 and "already complete" in again.stderr
    _same_bytes(reference, out)


def test_packing_follows_saelens():
    """SAELens concat_and_batch_sequences with begin-batch and separator tokens (worked by hand
    from its source): BOS opens each sequence, separates documents, is not doubled, and the
    incomplete tail is dropped."""
    p = Packing(4, 1, 1)
    got = [s.tolist() for s in pack(iter([[5, 6], [7, 8, 9, 10, 11], [1, 12], [13]]), p)]
    assert got == [[1, 5, 6, 1], [1, 7, 8, 9], [1, 10, 11, 1], [1, 12, 1, 13]]
    no_bos = Packing(3, None, 0)
    assert [s.tolist() for s in pack(iter([[5, 6], [7, 8, 9, 10]]), no_bos)] == [[5, 6, 0], [7, 8, 9]]


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("hook, needles", [
    ("blocks.0.hook_resid_psot", ("did you mean", "blocks.0.hook_resid_post")),
    ("blocks.30.hook_resid_post", ("30 layers",)),
    ("blocks.0.attn.hook_pattern", ("not one vector per token",)),
    ("hook_pos_embed", ("no positional embedding",)),
])
def test_bad_hooks(corpus, tmp_path, capsys, hook, needles):
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, "--hook", hook, "-o", tmp_path / "a"), *needles)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("size", ["0", "-1", "nan", "inf"])
def test_a_shard_size_that_is_no_size(corpus, tmp_path, capsys, size):
    """--shard-mb inf or nan was an internal error (float NaN to integer) that left -o behind."""
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "--shard-mb", size, "-o", tmp_path / "a"),
                          "--shard-mb must be a positive number of MB")
    assert not (tmp_path / "a").exists()


def test_a_foreign_or_unwritable_output_directory(corpus, tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "-o", tmp_path / "photos"),
                          "not empty", "cat.jpg")
    assert [p.name for p in (tmp_path / "photos").iterdir()] == ["cat.jpg"]
    (tmp_path / "file").write_text("x")
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "-o", tmp_path / "file"), "is a file")
    if os.geteuid() != 0:          # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "-o", tmp_path / "ro"), "not writable")


def test_a_damaged_shard_or_other_settings_on_resume(reference, corpus, tmp_path, capsys):
    import shutil
    out = tmp_path / "acts"
    shutil.copytree(reference, out)
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "--dtype", "float32", "--shard-mb", "4",
                               "-o", out), "other settings", "dtype")
    # another version's collection: said as such, not "other settings … delete that one"
    manifest = json.loads((out / ".manifest.json").read_text())
    (out / ".manifest.json").write_text(json.dumps({**manifest, "llamatrace_version": "0.0.9"}))
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "-o", out),
                          "made by llamatrace 0.0.9", "finish it with that version, or give a new -o directory")
    (out / ".manifest.json").write_text(json.dumps(manifest))
    # a damaged or missing shard is made again with the ones after it (the kept shards are a prefix):
    # the run used to refuse, and deleting the shard as told got the same refusal again
    n = len(list((out / "data").glob("shard-*.parquet")))
    assert n >= 4
    shard = out / "data" / "shard-00002.parquet"
    shard.write_bytes(shard.read_bytes()[:1000])
    code, stdout, err = run(capsys, "collect", "-f", corpus, *SETTINGS, "-o", out)
    assert code == 0, err
    assert (f"warning: shard-00002.parquet is damaged (" in err
            and f"it and the {n - 3} listed after it are made again" in err)
    _same_bytes(reference, out)
    (out / "data" / "shard-00002.parquet").unlink()
    code, stdout, err = run(capsys, "collect", "-f", corpus, *SETTINGS, "-o", out)
    assert code == 0 and "warning: shard-00002.parquet is missing;" in err, err
    _same_bytes(reference, out)


def test_a_shard_that_cannot_be_read_now_is_an_error_and_nothing_is_deleted(reference, corpus, tmp_path, capsys,
                                                                         monkeypatch):
    """A permission or I/O error is no damage: the shard and those after it stay (a remake would
    have deleted them all), one error line says what to fix."""
    import errno
    import shutil

    import pyarrow.parquet as pq
    out = tmp_path / "acts"
    shutil.copytree(reference, out)
    real = pq.read_metadata

    def denied(path, *args, **kwargs):
        if str(path).endswith("shard-00001.parquet"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, *args, **kwargs)
    monkeypatch.setattr(pq, "read_metadata", denied)
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *SETTINGS, "-o", out),
                          "shard-00001.parquet: cannot read it (Permission denied)")
    _same_bytes(reference, out)


def test_an_unreachable_ray_cluster(corpus, tmp_path, capsys):
    pytest.importorskip("ray")
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "-o", tmp_path / "a", "--ray",
                               "127.0.0.1:9"), "--ray 127.0.0.1:9", "cannot reach")


def test_a_corpus_shorter_than_one_sequence(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("a few words\n")
    assert_one_line_error(*run(capsys, "collect", "-f", tmp_path / "short.txt", *HOOKS, "-o", tmp_path / "a" / "b"),
                          "fewer tokens than one sequence")
    assert not (tmp_path / "a").exists()          # the folders it made are gone: an empty a/b/data was left
    (tmp_path / "c").mkdir()
    assert_one_line_error(*run(capsys, "collect", "-f", tmp_path / "short.txt", *HOOKS, "-o", tmp_path / "c"),
                          "fewer tokens than one sequence")
    assert list((tmp_path / "c").iterdir()) == []  # a folder the user made stays, empty
    (tmp_path / "zeros.bin").write_bytes(bytes(5000))     # as the other corpus commands: no text, no collection
    assert_one_line_error(*run(capsys, "collect", "-f", tmp_path / "zeros.bin", *HOOKS, "-o", tmp_path / "z"),
                          "is a binary file (line 1 contains NUL bytes)")
    assert not (tmp_path / "z").exists()


def test_a_corpus_that_cannot_be_read(tmp_path, capsys):
    # a missing text (or a directory) was "internal error: FileNotFoundError", exit 1
    for missing in (tmp_path / "nope.txt", tmp_path):
        assert_one_line_error(*run(capsys, "collect", "-f", missing, *HOOKS, "-o", tmp_path / "a"),
                              "-f", "cannot read it")
        assert not (tmp_path / "a").exists()


def test_options_that_would_be_ignored_or_misread_are_refused(tmp_path, capsys):
    # -o - made a directory named "-"; --text-field without --jsonl was ignored (exit 0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS) + "\n")
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "-o", "-"), "-o -", "directory")
    assert_one_line_error(*run(capsys, "collect", "-f", corpus, *HOOKS, "--text-field", "body", "-o", tmp_path / "a"),
                          "--text-field 'body'", "--jsonl")
    assert not (tmp_path / "a").exists()


def test_jsonl_input(tmp_path, capsys, smollm2):
    lines = [json.dumps({"text": " ".join(WORDS[i:i + 60]), "id": i}) for i in range(0, 120, 3)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = run(capsys, "collect", "-f", tmp_path / "docs.jsonl", "--jsonl", "--hook", "l_out@0",
                         "--ctx-size", "32", "-o", tmp_path / "a", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["n_tokens"] > 0 and summary["hooks"] == ["l_out@0"]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    assert_one_line_error(*run(capsys, "collect", "-f", tmp_path / "bad.jsonl", "--jsonl", "--hook", "l_out@0",
                               "-o", tmp_path / "b"), "line 1", "--text-field")


def test_other_settings_are_named_with_both_values(tmp_path, capsys, tiny_model_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS) + "\n")
    out = tmp_path / "acts"
    common = ["collect", "-f", corpus, "-m", tiny_model_path, "--ctx-size", "16", "-o", out]
    assert run(capsys, *common, "--hook", "blocks.0.hook_resid_post")[0] == 0
    assert_one_line_error(*run(capsys, *common, "--hook", "blocks.1.hook_resid_post"), "other settings",
                          '(hooks[0].name: "blocks.0.hook_resid_post" there, "blocks.1.hook_resid_post" now)')
    assert_one_line_error(*run(capsys, *common, "--hook", "blocks.0.hook_resid_post", "--hook", "l_out@1"),
                          '(hooks: ["blocks.0.hook_resid_post"] there, ["blocks.0.hook_resid_post", "l_out@1"] now)')
    assert_one_line_error(*run(capsys, *common, "--hook", "blocks.0.hook_resid_post", "--dtype", "float16"),
                          '(dtype: "float32" there, "float16" now)')


def test_ctrl_c_after_the_last_shard_is_no_interruption(tmp_path, capsys, tiny_model_path, monkeypatch):
    """A Ctrl-C that reaches the run after the manifest lists every shard (seen as Ray shut down)
    said 'interrupted: 21 of 21 shards complete; run the same command again' and exit 130. Before
    the last manifest write, it is an interruption still."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS) + "\n")
    real = C.execute

    def then_ctrl_c(c, *args, **kwargs):
        real(c, *args, **kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(C, "execute", then_ctrl_c)
    args = ["collect", "-f", corpus, "-m", tiny_model_path, "--hook", "l_out@0", "--ctx-size", "16"]
    code, out, err = run(capsys, *args, "-o", tmp_path / "a")
    assert code == 0 and "interrupted" not in err, err

    def last_write_lost(c, *args, **kwargs):
        real(c, *args, **kwargs)
        done, c.shards = c.shards, c.shards[:-1]  # as if interrupted between the last append and its write
        C.write_manifest(c)
        c.shards = done
        raise KeyboardInterrupt
    monkeypatch.setattr(C, "execute", last_write_lost)
    code, out, err = run(capsys, *args, "-o", tmp_path / "b")
    assert code == 130 and "interrupted" in err, err
