"""An output path that cannot be written fails with one error line before any model is loaded, in
every command that writes files (issue 38): not after the run, 15-20 s later."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, run
from llamatrace.errors import OutputError
from llamatrace.outputs import check_output_path


def _cannot_create_in(directory: Path) -> bool:
    """What the OS says, asked directly: no file can be created in ``directory``."""
    try:
        fd, name = tempfile.mkstemp(dir=directory)
    except OSError:
        return True
    os.close(fd)
    os.unlink(name)
    return False


@pytest.fixture
def unwritable_dir(tmp_path) -> Path:
    """A directory no file can be created in: a read-only one, or for root (who writes there
    anyway) ``/sys``, where ``os.access`` still says root may write."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        return ro
    if not (Path("/sys").is_dir() and _cannot_create_in(Path("/sys"))):
        pytest.skip("running as root and /sys takes new files: no unwritable directory here")
    return Path("/sys")


@pytest.fixture
def loads(monkeypatch) -> list:
    """The models loaded in this test (none get loaded: each call is recorded, then refused)."""
    from llamatrace.model.llama import Llama
    calls = []

    def refuse(cls, path=None, *args, **kwargs):
        calls.append(path)
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(Llama, "load", classmethod(refuse))
    return calls


@pytest.mark.parametrize("command, option, name", [
    ("diagram", "-o", "flow.dot"),
    ("diagram", "-o", "run.html"),
    ("attention", "-o", "attention.png"),
    ("lens", "-o", "lens.png"),
    ("trace", "--jsonl", "t.jsonl"),
    ("trace", "--npz", "t.npz"),
    ("trace", "--log-file", "debug.log"),
])
def test_an_unwritable_output_fails_before_the_model_loads(capsys, tiny_model_path, unwritable_dir, loads,
                                                           command, option, name):
    target = unwritable_dir / name
    assert _cannot_create_in(unwritable_dir)
    assert_one_line_error(*run(capsys, command, "-m", tiny_model_path, "--raw", option, target, "hi"),
                          option, str(unwritable_dir), "not writable")
    assert loads == [] and not target.exists()


def test_check_output_path_leaves_nothing_behind(tmp_path):
    check_output_path(tmp_path / "new.svg", "-o")
    check_output_path(tmp_path / "new.jsonl", "--jsonl", whole_file=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputError, match="is a directory"):
        check_output_path(tmp_path, "-o")
