"""The corpus commands (`perplexity`, `perplexity --stages`, `collect`, `imatrix`) choose their
activations mode by generate's rule: q8 from 1 B parameters, f32 below, `--activations` wins.

The tiny model stands in for both sizes: the threshold is moved to its parameter count, counted
here with the `gguf` package's reader (not ours), and one above it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from cli_helpers import assert_one_line_error, run

from llamatrace.cli import options
from llamatrace.kernels.int8 import act8

CORPUS = Path(__file__).parent / "golden" / "corpus.txt"

pytestmark = pytest.mark.skipif(not act8.available(), reason="q8 needs AVX2")


def n_params(path: Path) -> int:
    return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


def corpus_commands(model: Path, tmp_path: Path) -> dict[str, list]:
    """Each corpus command on the tiny model, printing a JSON object that names its mode."""
    common = ["-f", CORPUS, "-m", model, "-c", "32", "--chunks", "2", "--json"]
    return {
        "perplexity": ["perplexity", *common],
        "stages": ["perplexity", *common, "--base", model, "--stages"],
        "imatrix": ["imatrix", *common, "-o", tmp_path / "imatrix.gguf"],
        # a fresh folder each run: a collection resumed in another mode is refused
        "collect": ["collect", "-f", CORPUS, "-m", model, "--ctx-size", "32", "--hook", "l_out@0", "--json", "-o"],
    }


@pytest.mark.parametrize("command", ["perplexity", "stages", "imatrix", "collect"])
def test_corpus_commands_default_to_q8_from_the_threshold_and_the_option_wins(
        command, capsys, tiny_model_path, tmp_path, monkeypatch):
    args = corpus_commands(tiny_model_path, tmp_path)[command]
    runs = iter(range(100))

    def mode(*extra) -> str:
        out_dir = [tmp_path / f"acts{next(runs)}"] if command == "collect" else []
        code, out, err = run(capsys, *args, *out_dir, *extra)
        assert code == 0, err
        ran = json.loads(out)["activations"]
        assert f"{ran})" in err.splitlines()[-1]                        # the speed line names it too
        return ran

    n = n_params(tiny_model_path)
    monkeypatch.setattr(options, "Q8_DEFAULT_PARAMS", n + 1)            # one parameter short: small
    assert mode() == "f32"
    assert mode("--activations", "q8") == "q8"
    monkeypatch.setattr(options, "Q8_DEFAULT_PARAMS", n)                # as if the tiny model were 1 B
    assert mode() == "q8"
    assert mode("--activations", "f32") == "f32"


def test_the_threshold_is_a_billion_parameters_counted_from_the_file(tiny_model_path):
    assert options.Q8_DEFAULT_PARAMS == 1_000_000_000
    assert n_params(tiny_model_path) < options.Q8_DEFAULT_PARAMS
    assert options.default_activations(tiny_model_path) == "f32"


def test_a_collection_resumed_in_the_other_mode_is_refused(capsys, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setattr(options, "Q8_DEFAULT_PARAMS", n_params(tiny_model_path))     # the default: q8
    args = corpus_commands(tiny_model_path, tmp_path)["collect"] + [tmp_path / "acts"]
    assert run(capsys, *args)[0] == 0
    assert_one_line_error(*run(capsys, *args, "--activations", "f32"), '(model.activations: "q8" there, "f32" now)')


@pytest.mark.parametrize("command", ["perplexity", "imatrix", "collect", "expert-load"])
def test_bad_threads_are_refused_before_any_worker_or_output(command, capsys, tiny_model_path, tmp_path, monkeypatch):
    """--threads 0 or more than the machine's threads: one error line naming --threads, no worker's
    traceback (a worker used to refuse it, racing its parent's Ctrl-C), and no collection folder
    begun, which blocked a corrected run ('holds a collection with other settings')."""
    from llamatrace.machine.runtime import numba_threads
    monkeypatch.chdir(tmp_path)
    own = {"perplexity": ["--chunks", "2"], "imatrix": ["--chunks", "2", "-o", "i.gguf"],
           "expert-load": ["--chunks", "2"], "collect": ["--hook", "l_out@0", "-o", "acts"]}[command]
    for threads in ("0", str(numba_threads() + 1)):
        code, out, err = run(capsys, command, "-f", CORPUS, "-m", tiny_model_path, "-c", "32",
                             "--workers", "2", "--threads", threads, *own)
        assert_one_line_error(code, out, err, f"--threads {threads}: give an integer from 1")
        assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_worker_that_dies_on_every_try_is_exit_1_and_ends_the_values_line(capsys, tiny_model_path, monkeypatch):
    """A crash or an out-of-memory kill is no bad input: exit 1, not 2. The running values
    ('[1]13.39,') printed before it end with a line break, so the error line starts a line of its own."""
    monkeypatch.setenv("LLAMATRACE_FAULT", "compute:1:kill")          # every try of chunk 2 (no _ONCE file)
    monkeypatch.delenv("LLAMATRACE_FAULT_ONCE", raising=False)
    code, out, err = run(capsys, "perplexity", "-f", CORPUS, "-m", tiny_model_path, "-c", "32", "--chunks", "2",
                         "--workers", "2")
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "died 3 times on chunk 2" in lines[0] and "Traceback" not in err
    assert out.startswith("[1]") and out.endswith(",\n")       # chunk 1's value, done while chunk 2's tries died


def test_a_corpus_from_standard_input(capsys, tiny_model_path, monkeypatch, tmp_path):
    """-f - reads standard input in perplexity (and imatrix, expert-load: the same read_corpus), as
    generate -f - does; collect, which hashes and rereads its file on resume, says it needs one."""
    import io
    import sys
    args = ["perplexity", "-m", tiny_model_path, "-c", "32", "--chunks", "2", "--json"]
    code, out, err = run(capsys, *args, "-f", CORPUS)
    assert code == 0, err
    from_file = json.loads(out)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(CORPUS.read_bytes())))
    code, out, err = run(capsys, *args, "-f", "-")
    assert code == 0, err
    assert json.loads(out)["ppl"] == from_file["ppl"]
    code, out, err = run(capsys, "collect", "-f", "-", "-m", tiny_model_path, "--hook", "l_out@0", "-o", tmp_path / "a")
    assert_one_line_error(code, out, err, "-f -: collect reads its corpus from a file, not standard input")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("command", ["perplexity", "imatrix", "collect", "expert-load"])
def test_an_empty_ray_address_is_refused(command, capsys):
    """--ray '' started a local cluster, and the summary named no Ray."""
    assert_one_line_error(*run(capsys, command, "-f", CORPUS, "--ray", ""), "--ray needs an address")
