"""``llamatrace quantize`` and its recipe search on bad input, Ctrl-C, a killed run and a first run
(issue 47): one ``error:`` line before any work, exit 130 and nothing at OUT, no leftovers.

Every model here is a tiny random llama (tests/gguf_factory.py: 2 layers, dim 64), so each
command takes a few seconds (start-up and the tiny search's 16 matrices).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run
from gguf_factory import T, write_tiny_llama

from llamatrace.gguf.fetch import sha256_file
from llamatrace.quantize import search as S

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).parent / "golden" / "corpus.txt"
SEARCH = ["-f", CORPUS, "--ctx-size", 32, "--chunks", 2, "--candidates", "Q4_0,Q8_0"]
N_GROUPS = 16                      # 2 layers × 7 matrices, the embedding, the output


@pytest.fixture(scope="module")
def f16_base(tmp_path_factory) -> Path:
    """A tiny F16 llama with an untied output."""
    return write_tiny_llama(tmp_path_factory.mktemp("faults") / "tiny-f16.gguf", qtype=T.F16, tied=False)


@pytest.fixture(scope="module")
def q4_1_base(tmp_path_factory) -> Path:
    """A tiny llama whose matrices are already quantized (Q4_1)."""
    return write_tiny_llama(tmp_path_factory.mktemp("faults-q") / "tiny-q4_1.gguf", qtype=T.Q4_1, tied=False)


def _copy(src: Path, dest: Path) -> Path:
    dest.write_bytes(src.read_bytes())
    return dest


def _no_measuring(monkeypatch) -> None:
    """Fail the test if the search starts measuring."""
    monkeypatch.setattr(S, "measure_groups", lambda *a, **k: pytest.fail("measured before refusing"))


def test_quantize_refuses_to_write_over_its_tensor_type_file(f16_base, tmp_path, capsys):
    """``quantize BASE types.txt --tensor-type-file types.txt`` replaced the file it read with a GGUF."""
    types = tmp_path / "types.txt"
    types.write_text("attn_v=q8_0\n")
    assert_one_line_error(*run(capsys, "quantize", f16_base, types, "--type", "Q4_0", "--tensor-type-file", types),
                          "OUT", "--tensor-type-file this run reads")
    assert types.read_text() == "attn_v=q8_0\n" and [p.name for p in tmp_path.iterdir()] == ["types.txt"]


@pytest.mark.parametrize("tied, args, words", [
    (False, ["--type", "F16", "--tensor-type", "attn_v=q8_0"], ["--tensor-type", "--type F16", "quantized file types"]),
    (True, ["--type", "BF16", "--output-tensor-type", "q8_0"], ["--output-tensor-type", "no output.weight",
                                                                "--token-embedding-type"]),
    (True, ["--type", "Q8_0", "--pure", "--output-tensor-type", "q4_0"], ["--output-tensor-type", "--pure"]),
    (True, ["--type", "Q8_0", "--leave-output-tensor"], ["--leave-output-tensor", "no output.weight"]),
    (True, ["--type", "Q8_0", "--output-tensor-type", "q4_0", "--token-embedding-type", "q5_0"],
     ["--output-tensor-type", "--token-embedding-type q5_0 sets", "drop one"]),
])
def test_an_option_that_changes_nothing_gets_a_warning(tmp_path, capsys, tied, args, words):
    """As llama-quantize 0.3.36, these options change no tensor here; they were dropped in silence."""
    base = write_tiny_llama(tmp_path / "base.gguf", qtype=T.F16, tied=tied)
    code, _, err = run(capsys, "quantize", base, tmp_path / "out.gguf", *args)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 1, err
    for word in words:
        assert word in warnings[0], warnings


def test_options_that_apply_get_no_warning(tmp_path, capsys):
    base = write_tiny_llama(tmp_path / "base.gguf", qtype=T.F16, tied=True)
    code, _, err = run(capsys, "quantize", base, tmp_path / "out.gguf", "--type", "Q8_0", "--output-tensor-type", "q4_0",
                       "--tensor-type", "attn_v=q4_0")
    assert code == 0 and "warning" not in err, err


# ---- the search overwriting its base; outputs checked before measuring -----------------------------------

@pytest.mark.parametrize("how", ["path", "symlink", "hardlink"])
def test_the_search_refuses_to_write_over_its_base(f16_base, tmp_path, capsys, monkeypatch, how):
    """``quantize self.gguf self.gguf -f …`` replaced its input and exited 0; now it refuses as plain
    quantize does, by path, symlink or hard link, before measuring. The base is untouched."""
    base = _copy(f16_base, tmp_path / "self.gguf")
    digest = sha256_file(base)
    out = {"path": base, "symlink": tmp_path / "link.gguf", "hardlink": tmp_path / "hard.gguf"}[how]
    if how == "symlink":
        out.symlink_to(base)
    elif how == "hardlink":
        os.link(base, out)
    _no_measuring(monkeypatch)
    assert_one_line_error(*run(capsys, "quantize", base, out, "--type", "Q4_0", *SEARCH), "OUT", "base model itself")
    assert_one_line_error(*run(capsys, "quantize", base, out, "--type", "Q4_0"), "OUT", "base model itself")
    assert sha256_file(base) == digest
    assert not base.with_name(out.name + ".measurements.json").exists()


def test_the_search_refuses_a_picture_or_measurements_file_that_is_its_base(f16_base, tmp_path, capsys, monkeypatch):
    base = _copy(f16_base, tmp_path / "base.gguf")
    (tmp_path / "picture.png").symlink_to(base)
    _no_measuring(monkeypatch)
    assert_one_line_error(*run(capsys, "quantize", base, tmp_path / "out.gguf", "--target-bpw", 6, *SEARCH,
                               "--measurements", base), "--measurements", "base model itself")
    assert_one_line_error(*run(capsys, "quantize", base, tmp_path / "out.gguf", "--target-bpw", 6, *SEARCH,
                               "-o", tmp_path / "picture.png"), "-o", "base model itself")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.gguf", "picture.png"]


def test_the_search_refuses_a_measurements_path_holding_another_file(f16_base, tmp_path, capsys, monkeypatch):
    """``--measurements`` on a file that is no measurements (another model, say) replaced it, exit 0."""
    victim = _copy(f16_base, tmp_path / "other.gguf")
    digest = sha256_file(victim)
    _no_measuring(monkeypatch)
    assert_one_line_error(*run(capsys, "quantize", f16_base, tmp_path / "out.gguf", "--target-bpw", 6, *SEARCH,
                               "--measurements", victim), "--measurements", "holds no measurements", "another path")
    assert sha256_file(victim) == digest and not (tmp_path / "out.gguf").exists()


def test_the_search_refuses_to_replace_measurements_made_with_other_settings(f16_base, tmp_path, capsys,
                                                                            monkeypatch):
    """Another --ctx-size (or text, base, --measure …) started anew and replaced minutes of measurements."""
    saved = tmp_path / "out.gguf.measurements.json"
    doc = {"key": {"version": 2, "base": f16_base.name, "n_ctx": 64}, "base_kld": 0.5, "delta": {"blk.0.attn_q": {}}}
    saved.write_text(json.dumps(doc))
    _no_measuring(monkeypatch)
    assert_one_line_error(*run(capsys, "quantize", f16_base, tmp_path / "out.gguf", "--target-bpw", 6, *SEARCH),
                          str(saved), "another", "--ctx-size", "delete the file")
    assert json.loads(saved.read_text()) == doc and not (tmp_path / "out.gguf").exists()


def test_a_picture_of_an_unknown_format_is_refused_before_measuring(f16_base, tmp_path, capsys, monkeypatch):
    """``-o recipe.xyz`` failed after measuring, and OUT was written though the exit code was 2."""
    out = tmp_path / "out.gguf"
    _no_measuring(monkeypatch)
    assert_one_line_error(*run(capsys, "quantize", f16_base, out, "--target-bpw", 6, *SEARCH,
                               "-o", tmp_path / "recipe.xyz"), "-o", ".png")
    assert list(tmp_path.iterdir()) == []


def test_a_quantized_base_is_refused_before_the_quantizers_compile(q4_1_base, tmp_path, capsys, monkeypatch):
    """Plain quantize said "Compiling the quantizers (first run only, about 1 min…)" and then refused
    the base: the check now comes first."""
    from llamatrace.cli import quantize as cli_quantize

    def compiled(*args, **kwargs):
        raise AssertionError("the quantizers were compiled before the base was checked")

    monkeypatch.setattr(cli_quantize, "compile_quantizers", compiled)
    assert_one_line_error(*run(capsys, "quantize", q4_1_base, tmp_path / "out.gguf", "--type", "Q4_0"),
                          "already quantized", "--allow-requantize")
    assert list(tmp_path.iterdir()) == []


def test_a_quantized_base_is_refused_before_measuring_and_taken_with_allow_requantize(q4_1_base, tmp_path, capsys,
                                                                                      monkeypatch):
    """The search refused a quantized base only after every matrix was measured, and refused it
    just the same with --allow-requantize: the flag was not passed on."""
    out = tmp_path / "out.gguf"
    with monkeypatch.context() as m:
        _no_measuring(m)
        assert_one_line_error(*run(capsys, "quantize", q4_1_base, out, "--target-bpw", 6, *SEARCH),
                              "already quantized", "--allow-requantize")
    assert list(tmp_path.iterdir()) == []
    code, stdout, err = run(capsys, "quantize", q4_1_base, out, "--target-bpw", 6, *SEARCH, "--allow-requantize",
                            "--json")
    assert code == 0, err
    recipe = json.loads(stdout)["recipe"]
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert {g["group"] + ".weight": g["type"] for g in recipe["groups"]}.items() <= written.items()
    assert {g["type"] for g in recipe["groups"]} <= {"Q4_0", "Q8_0"}


# ---- what the search says: progress in a log, the table, what was written -----------------------------------

def test_the_search_reports_progress_in_a_log_and_what_it_wrote(f16_base, tmp_path, capsys, monkeypatch):
    """In a log (stderr not a terminal: no bar), a status line at each tenth of the matrices with
    the count and the time left; a line naming OUT and the picture; without --type the table has
    no stock column (every row of it was empty)."""
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)        # the suite runs quiet
    out, picture = tmp_path / "out.gguf", tmp_path / "recipe.svg"
    code, stdout, err = run(capsys, "quantize", f16_base, out, "--target-bpw", 6, *SEARCH, "-o", picture)
    assert code == 0, err
    lines = re.findall(r"^measured (\d+) of 16 matrices \((\d+) %\) in \d+:\d\d, about \d+:\d\d left$", err, re.M)
    counts = [int(done) for done, _ in lines]
    # a line as each tenth is passed (2 of 16 is the first tenth …), more only if 30 s went by
    assert {2, 4, 5, 7, 8, 10, 12, 13, 15} <= set(counts) and counts == sorted(counts), err
    assert f"wrote {out} (" in err and f"BPW) and the picture {picture}" in err, err
    assert out.is_file() and picture.is_file()
    header = stdout.splitlines()[0].split()
    assert header == ["group", "type", "ΔKLD", "bytes"], stdout
    assert all(len(line.split()) == 4 for line in stdout.splitlines()[1:N_GROUPS + 1]), stdout


def test_the_search_with_type_marks_where_the_stock_mix_differs(f16_base, tmp_path, capsys):
    code, stdout, err = run(capsys, "quantize", f16_base, tmp_path / "out.gguf", "--type", "Q4_0", "--target-bpw", 6,
                            *SEARCH)
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0].split() == ["group", "type", "Q4_0", "ΔKLD", "bytes"]
    rows = [line.split() for line in lines[1:N_GROUPS + 1]]
    # a recipe at 6 bpw above the Q4_0 mix: some matrices at Q8_0, marked with the mix's Q4_0;
    # the rows where the mix agrees have the column blank
    assert any(r[1:3] == ["Q8_0", "Q4_0"] for r in rows) and any(len(r) == 4 for r in rows), stdout
    assert any(line.startswith("Q4_0: ") for line in lines), stdout


# ---- known model names, and an F16 base from one -------------------------------------------------------------

def test_quantize_takes_a_known_models_name(f16_base, tmp_path, capsys, monkeypatch):
    """``quantize smollm2-135m …`` said no such file; it resolves the name as ``--model`` does
    (here from a cache holding a stand-in under the known file name: nothing fetched)."""
    from llamatrace.gguf import fetch
    monkeypatch.setenv(fetch.ENV_CACHE, str(tmp_path / "cache"))
    fetch.cache_dir().mkdir(parents=True)
    _copy(f16_base, fetch.cache_dir() / fetch.KNOWN_MODELS["smollm2-135m"].filename)
    import dataclasses                      # a cached file of another size is a cut download: say it is whole
    monkeypatch.setitem(fetch.KNOWN_MODELS, "smollm2-135m",
                        dataclasses.replace(fetch.KNOWN_MODELS["smollm2-135m"], size=Path(f16_base).stat().st_size))
    monkeypatch.setattr(fetch, "pull", lambda *a, **k: pytest.fail("fetched although cached"))
    out = tmp_path / "out.gguf"
    code, stdout, err = run(capsys, "quantize", "smollm2-135m", out, "--type", "Q8_0", "--json")
    assert code == 0, err
    assert {t.tensor_type for t in gguf.GGUFReader(str(out)).tensors if len(t.shape) > 1} == {T.Q8_0}
    code, _, err = run(capsys, "quantize", "smollm2-135m", tmp_path / "search.gguf", "--target-bpw", 6, *SEARCH)
    assert code == 0, err


# ---- importance matrices -------------------------------------------------------------------------------------

def _imatrix(base: Path, path: Path, poison: float | None = None) -> Path:
    """An importance matrix of ``base``'s matrices (ones), with ``poison`` at one value of blk.1.ffn_up."""
    from llamatrace.quantize.imatrix.files import ImatrixMeta, write_imatrix
    entries = {}
    for t in gguf.GGUFReader(str(base)).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            sums = np.full(int(t.shape[0]), 4.0, np.float32)
            if poison is not None and t.name == "blk.1.ffn_up.weight":
                sums[3] = poison
            entries[t.name] = (sums, np.array([4]))
    write_imatrix(path, entries, ImatrixMeta(["calibration.txt"], 4, 32))
    return path


def test_an_imatrix_of_another_width_or_a_missing_one_is_refused_before_the_quantizers_compile(f16_base, tmp_path,
                                                                                                  capsys, monkeypatch):
    """Both were refused inside the writer, after a minute of compiling on a cold cache; the first
    message did not name the file."""
    from llamatrace.cli import quantize as Q
    from llamatrace.quantize.imatrix.files import ImatrixMeta, write_imatrix
    monkeypatch.setattr(Q, "compile_quantizers", lambda *a, **k: pytest.fail("compiled before refusing"))
    wide = tmp_path / "wide.imatrix.gguf"
    names = [t.name for t in gguf.GGUFReader(str(f16_base)).tensors if len(t.shape) == 2]
    write_imatrix(wide, {n: (np.full(1000, 4.0, np.float32), np.array([4])) for n in names if n != "token_embd.weight"},
                  ImatrixMeta(["calibration.txt"], 4, 32))
    out = tmp_path / "out.gguf"
    assert_one_line_error(*run(capsys, "quantize", f16_base, out, "--type", "Q4_0", "--imatrix", wide),
                          f"--imatrix {str(wide)!r}", "1000 values", "another model")
    _no_measuring(monkeypatch)            # the search: before it measures (a reshape's ValueError mid-way)
    assert_one_line_error(*run(capsys, "quantize", f16_base, out, "--target-bpw", 6, *SEARCH, "--imatrix", wide),
                          f"--imatrix {str(wide)!r}", "1000 values", "another model")
    wide_base = write_tiny_llama(tmp_path / "wide.gguf", qtype=T.F16, dim=256, hidden_dim=256, tied=False)
    assert_one_line_error(*run(capsys, "quantize", wide_base, out, "--type", "Q2_K_S"), "Q2_K_S", "none was given")
    assert not out.exists()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_an_imatrix_holding_non_finite_values_is_refused(f16_base, tmp_path, capsys, poison):
    """As llama-quantize ("imatrix contains non-finite value"): it wrote a file of NaN tensors."""
    bad = _imatrix(f16_base, tmp_path / "bad.imatrix.gguf", poison)
    out = tmp_path / "out.gguf"
    for args in (["--type", "Q4_0"], ["--target-bpw", 6, *SEARCH]):
        assert_one_line_error(*run(capsys, "quantize", f16_base, out, *args, "--imatrix", bad),
                              "--imatrix", "non-finite", "blk.1.ffn_up.weight")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.imatrix.gguf"]
    good = _imatrix(f16_base, tmp_path / "good.imatrix.gguf")
    assert run(capsys, "quantize", f16_base, out, "--type", "Q4_0", "--imatrix", good)[0] == 0


def test_a_missing_imatrix_is_one_error_line(f16_base, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    for args in (["--type", "Q4_0"], ["--target-bpw", 6, *SEARCH]):
        assert_one_line_error(*run(capsys, "quantize", f16_base, out, *args, "--imatrix", tmp_path / "nope.gguf"),
                              "--imatrix", "nope.gguf")
    assert list(tmp_path.iterdir()) == []


# ---- Ctrl-C and a killed run -----------------------------------------------------------------------------------

def _paused_quantize(base: Path, out: Path, where: str, nth: int) -> subprocess.Popen:
    """``llamatrace quantize BASE OUT --type Q8_0`` in a subprocess that stops at the ``nth`` call of
    ``where`` (``module:function``), says ``paused`` on stderr and waits there for a signal."""
    module, function = where.split(":")
    code = textwrap.dedent(f"""
        import importlib, signal, sys
        from llamatrace.cli import main
        target = importlib.import_module({module!r})
        real, calls = getattr(target, {function!r}), []
        def paused(*args, **kwargs):
            calls.append(1)
            if len(calls) == {nth}:
                print("paused", file=sys.stderr, flush=True)
                signal.pause()
            return real(*args, **kwargs)
        setattr(target, {function!r}, paused)
        sys.exit(main(["quantize", {str(base)!r}, {str(out)!r}, "--type", "Q8_0"]))
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait_paused(proc: subprocess.Popen) -> None:
    line = proc.stderr.readline()
    if line.strip() != "paused":
        proc.kill()
        pytest.fail(f"the command did not reach its pause: {line}{proc.stderr.read()}")


@pytest.mark.parametrize("where, nth", [
    ("llamatrace.quantize.rules:tensor_types", 1),           # reading the base, before any output
    ("llamatrace.cli.quantize:run_quantizers", 1),           # loading (or compiling) the quantizers
    ("llamatrace.quantize.writer:convert_tensor", 1),        # writing: the first tensor converted
    ("llamatrace.quantize.writer:convert_tensor", 4),        # … later: a norm's view of the base copied before
])
def test_ctrl_c_during_quantize_exits_130_and_leaves_nothing(f16_base, tmp_path, where, nth):
    """A real SIGINT at several moments: exit 130, no traceback and no internal error (it was
    ``BufferError: … cannot unmap it while an array from Tensor.data is still referenced``),
    nothing at OUT and no temporary file."""
    out = tmp_path / "out.gguf"
    proc = _paused_quantize(f16_base, out, where, nth)
    try:
        _wait_paused(proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)       # a hang guard, not a speed check
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "internal error" not in err and "interrupted" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_ctrl_c_lost_in_a_finalizer_while_writing_keeps_the_old_file(f16_base, tmp_path, capsys, monkeypatch):
    """A SIGINT whose KeyboardInterrupt was lost in a finalizer (a compile's) is only recorded by
    the handler: the writer's next tensor, or the rename, must raise it. It once renamed the new
    file over OUT, printed the summary, then said ``interrupted`` and exited 130."""
    from llamatrace.machine import runtime
    from llamatrace.quantize import writer
    monkeypatch.setattr(runtime, "_interrupted", False)
    real = writer.convert_tensor

    def lost_interrupt(*args, **kwargs):
        runtime._interrupted = True                  # what the handler records before its raise is lost
        return real(*args, **kwargs)
    monkeypatch.setattr(writer, "convert_tensor", lost_interrupt)
    out = _copy(f16_base, tmp_path / "keep.gguf")
    code, stdout, err = run(capsys, "quantize", f16_base, out, "--type", "Q8_0", "--allow-requantize")
    assert code == 130 and "interrupted" in err and "Traceback" not in err, err
    assert out.read_bytes() == f16_base.read_bytes()           # the old file, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.gguf"]


def test_replace_durably_raises_a_lost_interrupt_before_the_rename(tmp_path, monkeypatch):
    from llamatrace.machine import runtime
    from llamatrace.outputs import replace_durably
    monkeypatch.setattr(runtime, "_interrupted", False)
    out = tmp_path / "out.txt"
    out.write_text("old")

    def write(f):
        f.write(b"new")
        runtime._interrupted = True
    with pytest.raises(KeyboardInterrupt):
        replace_durably(out, write)
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    monkeypatch.setattr(runtime, "_interrupted", False)
    replace_durably(out, lambda f: f.write(b"new"))
    assert out.read_text() == "new"


def test_a_killed_quantize_leaves_a_temporary_file_the_next_run_removes(f16_base, tmp_path, capsys):
    """SIGKILL mid-write leaves ``.OUT.PID.XXXXXXXX.tmp`` (no ``finally`` runs); the next run in that
    folder removes it with one note, and leaves alone one whose process still runs."""
    out = tmp_path / "out.gguf"
    proc = _paused_quantize(f16_base, out, "llamatrace.quantize.writer:convert_tensor", 4)
    try:
        _wait_paused(proc)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and re.fullmatch(rf"\.out\.gguf\.{proc.pid}\.\w{{8}}\.tmp", left[0]), left
    alive = tmp_path / f".other.gguf.{os.getppid()}.abcd1234.tmp"       # pytest's parent: a live process
    alive.write_bytes(b"x")
    code, _, err = run(capsys, "quantize", f16_base, out, "--type", "Q8_0")
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "removed 1 temporary file of a killed run" in notes[0] and left[0] in notes[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, "out.gguf"]


# ---- the first run's compile ---------------------------------------------------------------------------------

def test_quantize_loads_its_quantizers_before_the_first_tensor(f16_base, tmp_path, capsys, monkeypatch):
    """The quantizers OUT needs (type and input dtype: an F16 base's rows go in as float16) are
    run once before the progress bar starts, so a first run's compile is not inside it."""
    from llamatrace.cli import quantize as Q
    from llamatrace.quantize import writer
    events = []
    monkeypatch.setattr(Q, "run_quantizers", lambda needed: events.append(("warm", set(needed))))
    convert = writer.convert_tensor
    monkeypatch.setattr(writer, "convert_tensor", lambda *a, **k: events.append("tensor") or convert(*a, **k))
    assert run(capsys, "quantize", f16_base, tmp_path / "out.gguf", "--type", "Q8_0")[0] == 0
    assert events[0] == ("warm", {(T.Q8_0, "float16")}) and set(events[1:]) == {"tensor"}
    events.clear()
    assert run(capsys, "quantize", f16_base, tmp_path / "out.gguf", "--type", "Q4_K_M")[0] == 0
    # dim 64, hidden 96: rows not a multiple of 256, so llama.cpp's fallbacks of Q4_K/Q6_K/Q5_K
    assert events[0][0] == "warm" and {d for _, d in events[0][1]} == {"float16"}
    written = {t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "out.gguf")).tensors if len(t.shape) > 1}
    assert {t for t, _ in events[0][1]} == written


def test_a_first_runs_compile_gets_a_status_line_in_a_log(f16_base, tmp_path, capsys, monkeypatch):
    """In a log or a pipe (no spinner), one line as soon as a quantizer starts compiling (it said
    nothing for ~70 s); none when every one comes from Numba's cache. The quantizers' stand-in:
    fresh jitted functions, compiled by the first run."""
    import numba

    from llamatrace.cli import quantize as Q
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)        # the suite runs quiet

    @numba.njit
    def fresh(x):
        return x + 1

    @numba.njit
    def other(x):
        return x - 1

    monkeypatch.setattr(Q, "run_quantizers", lambda needed: (fresh(1), other(1)))
    code, _, err = run(capsys, "quantize", f16_base, tmp_path / "out.gguf", "--type", "Q8_0")
    assert code == 0 and err.count(Q.COMPILING) == 1, err
    assert err.index(Q.COMPILING) < err.index("quantized in"), err
    code, _, err = run(capsys, "quantize", f16_base, tmp_path / "again.gguf", "--type", "Q8_0")
    assert code == 0 and Q.COMPILING not in err, err           # compiled by the run before: nothing said


def test_precompile_covers_the_quantizers_of_the_common_types(monkeypatch):
    """``python -m llamatrace.kernels.precompile`` (scripts/setup.sh) compiles each common type's
    quantizer for float32 and float16 rows: Numba holds both signatures afterwards."""
    from llamatrace.kernels import precompile
    from llamatrace.kernels.quantizers import rows
    assert {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"} <= set(precompile.QUANTIZED)
    precompile.compile_quantizers(["Q4_0", "F16"], log=lambda line: None)
    kernel = rows._KERNELS[T.Q4_0][0]
    assert {str(sig[0].dtype) for sig in kernel.signatures} >= {"float32", "uint16"}
    calls = []
    monkeypatch.setattr(precompile, "compile_kernels", lambda names, log: calls.append(("kernels", tuple(names))) or 0.0)
    monkeypatch.setattr(precompile, "compile_quantizers",
                        lambda names, log: calls.append(("quantizers", tuple(names))) or 0.0)
    assert precompile.main([]) == 0
    assert calls == [("kernels", precompile.COMMON), ("quantizers", precompile.QUANTIZED)]
