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


@pytest.mark.parametrize("command, option", [("trace", "--npz"), ("trace", "--log-file"), ("imatrix", "-o"),
                                             ("diagram", "-o")])
def test_a_dash_output_is_refused_not_written_as_a_file_named_dash(capsys, tiny_model_path, tmp_path, loads,
                                                                    monkeypatch, command, option):
    """'-' is stdin for -f and stdout for trace --jsonl; elsewhere it was a file named '-' in the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("some text\n")
    args = ["-f", tmp_path / "t.txt"] if command == "imatrix" else ["--raw", "hi"]
    code, out, err = run(capsys, command, "-m", tiny_model_path, *args, option, "-")
    assert code == 2 and not (tmp_path / "-").exists() and loads == []
    assert any(why in err for why in ("a file, not stdout", "not to standard output", "extension")), err


def test_check_output_path_leaves_nothing_behind(tmp_path):
    check_output_path(tmp_path / "new.svg", "-o")
    check_output_path(tmp_path / "new.jsonl", "--jsonl", whole_file=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputError, match="is a directory"):
        check_output_path(tmp_path, "-o")


def test_a_stream_into_an_existing_file_needs_its_directory(tmp_path, monkeypatch):
    # the new lines go to a temporary file beside it, renamed at the end: a writable file in a
    # read-only directory must fail here, not after the load (a device such as /dev/null is written in place)
    from llamatrace import outputs
    probed = []
    monkeypatch.setattr(outputs, "check_writable_dir", lambda d, shown: probed.append(Path(d)))
    (tmp_path / "old.jsonl").write_text("{}\n")
    check_output_path(tmp_path / "old.jsonl", "--jsonl", whole_file=False)
    check_output_path(Path(os.devnull), "--jsonl", whole_file=False)
    assert probed == [tmp_path]


@pytest.fixture
def inputs(tmp_path, tiny_model_path):
    """A copy of the tiny model and a short text, each with a link beside it: outputs pointed at
    them must leave both as they were."""
    import shutil
    model, text = tmp_path / "model.gguf", tmp_path / "text.txt"
    shutil.copyfile(tiny_model_path, model)
    text.write_text("The capital of France is Paris. " * 40)
    (tmp_path / "link.svg").symlink_to(model)
    (tmp_path / "link.png").symlink_to(model)
    os.link(model, tmp_path / "hard.npz")
    return model, text


@pytest.mark.parametrize("args, option, what", [
    (["trace", "-m", "{model}", "--raw", "--jsonl", "{model}", "hi"], "--jsonl", "the model this run reads (-m)"),
    (["trace", "-m", "{model}", "--raw", "--log-file", "{model}", "hi"], "--log-file", "the model"),
    (["trace", "-m", "{model}", "--raw", "--npz", "{dir}/hard.npz", "hi"], "--npz", "the model"),
    (["diagram", "-m", "{model}", "--raw", "-o", "{dir}/link.svg", "hi"], "-o", "the model"),
    (["lens", "-m", "{model}", "--raw", "-o", "{dir}/link.png", "hi"], "-o", "the model"),
    (["trace", "-m", "{model}", "-f", "{text}", "--jsonl", "{text}"], "--jsonl", "the prompt file this run reads (-f)"),
    (["perplexity", "-m", "{model}", "-f", "{text}", "--base", "{model}", "--save-base", "{model}"], "--save-base",
     "the model"),
    (["perplexity", "-m", "{model}", "-f", "{text}", "--base", "{model}", "--save-base", "{text}"], "--save-base",
     "the text this run scores (-f)"),
    (["imatrix", "-m", "{model}", "-f", "{text}", "-o", "{model}"], "-o", "the model this run reads (-m)"),
    (["imatrix", "-m", "{model}", "-f", "{text}", "-o", "{text}"], "-o", "the calibration text this run reads (-f)"),
])
def test_an_output_that_is_an_input_is_refused_before_anything_is_written(capsys, inputs, loads, args, option, what):
    """``trace --jsonl MODEL`` truncated the model it maps (the process died of SIGBUS, exit 135, the
    file left 903 bytes long); ``--npz``, ``imatrix -o`` and ``perplexity --save-base`` replaced it
    and exited 0. By its name, a symlink or a hard link, an output that is an input is one error line."""
    model, text = inputs
    before = {p: p.read_bytes() for p in (model, text)}
    argv = [a.format(model=model, text=text, dir=model.parent) for a in args]
    assert_one_line_error(*run(capsys, *argv), option, what, "give another output file")
    assert {p: p.read_bytes() for p in (model, text)} == before and loads == []


def test_outputs_beside_the_inputs_are_written(capsys, inputs, tmp_path):
    """The check compares files, not folders or names: an output next to the model is fine."""
    model, _ = inputs
    code, _, err = run(capsys, "trace", "-m", model, "--raw", "--layer", "0", "--stage", "attn_norm",
                       "--npz", tmp_path / "t.npz", "hi")
    assert code == 0, err
    assert (tmp_path / "t.npz").stat().st_size > 0
