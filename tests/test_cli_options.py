"""Options and messages that must agree across commands (issue 8), the default-model loading
of the Python API, and ``python -m llamatrace`` outside an installed environment."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from llamatrace.gguf import fetch
from cli_helpers import one_error_line, run

from llamatrace.cli import main
from llamatrace.errors import ModelNotFoundError, PromptError

REPO = Path(__file__).resolve().parents[1]


# ---- Llama.load() without a path -----------------------------------------------------------------
def test_load_without_path_and_fetch_off_says_how_to_fix(monkeypatch, tmp_path):
    from llamatrace.model.llama import Llama
    monkeypatch.delenv(fetch.ENV_MODEL, raising=False)
    monkeypatch.setenv(fetch.ENV_CACHE, str(tmp_path))
    monkeypatch.setattr(fetch, "installed_default_model", lambda: None)
    with pytest.raises(ModelNotFoundError) as info:
        Llama.load(fetch=False)
    message = str(info.value)
    assert "llamatrace pull" in message and "fetch=True" in message and str(tmp_path / "models") in message
    assert list(tmp_path.iterdir()) == []                       # nothing fetched, nothing created


def test_load_without_path_uses_llamatrace_model(monkeypatch, tiny_model_path):
    from llamatrace.model.llama import Llama
    monkeypatch.setenv(fetch.ENV_MODEL, str(tiny_model_path))
    assert Llama.load(fetch=False).path == tiny_model_path


def test_load_without_path_warns_before_fetching(monkeypatch, tmp_path, tiny_model_path, caplog):
    from llamatrace.model.llama import Llama
    monkeypatch.delenv(fetch.ENV_MODEL, raising=False)
    monkeypatch.setattr(fetch, "installed_default_model", lambda: None)
    monkeypatch.setattr(fetch, "cached_model", lambda model=None: None)

    def fake_pull(model=None, *, force=False, log, quiet=False):
        log("Fetching the default model …")
        return tiny_model_path
    monkeypatch.setattr(fetch, "pull", fake_pull)
    with caplog.at_level("WARNING", logger="llamatrace"):
        assert Llama.load().path == tiny_model_path
    assert "Fetching the default model" in caplog.text


def test_env_model_error_says_unset_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(fetch.ENV_MODEL, str(tmp_path / "gone.gguf"))
    code, out, err = run(capsys, "generate", "hi")
    assert code == 2 and "unset LLAMATRACE_MODEL" in one_error_line(err)


def test_cache_dir_has_the_same_layout_with_and_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(fetch.ENV_CACHE, raising=False)
    assert fetch.cache_dir().name == "models" and fetch.cache_dir().parent == fetch.cache_root()
    monkeypatch.setenv(fetch.ENV_CACHE, str(tmp_path))
    assert fetch.cache_dir() == tmp_path / "models"


# ---- prompts ------------------------------------------------------------------------------------
def test_trailing_newlines_of_a_prompt_file_or_stdin_are_dropped(capsys, monkeypatch, tiny_model_path, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_bytes(b"the cat\r\n\n")
    code, out, _ = run(capsys, "generate", "--json", "--raw", "-n", "1", "-m", str(tiny_model_path), "-f", str(prompt))
    assert code == 0 and json.loads(out)["prompt"] == "the cat"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"  the cat\n")))
    code, out, _ = run(capsys, "generate", "--json", "--raw", "-n", "1", "-m", str(tiny_model_path), "-f", "-")
    assert code == 0 and json.loads(out)["prompt"] == "  the cat"       # only line breaks go


def test_prompt_starting_with_a_dash_gets_the_double_dash_hint(capsys):
    code, out, err = run(capsys, "generate", "-5 °C?")
    assert code == 2 and "after '--'" in one_error_line(err)


def test_prompt_too_long_for_the_model_does_not_suggest_raising_ctx_size(tiny_model):
    from llamatrace.model.generate import check_prompt_fits
    n_max = tiny_model.config.max_seq_len
    with pytest.raises(PromptError) as info:
        check_prompt_fits(tiny_model, n_max + 1, n_max)
    assert "--ctx-size" not in str(info.value) and f"context length is {n_max}" in str(info.value)
    with pytest.raises(PromptError, match="raise --ctx-size"):
        check_prompt_fits(tiny_model, 10, 8)


def test_trace_takes_ctx_size(capsys, tiny_model_path):
    code, out, err = run(capsys, "trace", "-m", str(tiny_model_path), "--raw", "--ctx-size", "2",
                         "--stage", "attn_norm", "the cat")
    assert code == 2 and "--ctx-size" in one_error_line(err)
    code, out, err = run(capsys, "trace", "-m", str(tiny_model_path), "--raw", "--ctx-size", "8", "--tokens", "2",
                         "--stage", "cache_k", "--layer", "0", "the cat")
    assert code == 0, err
    assert "CacheK shape([8 " in out                          # the cache holds --ctx-size positions


# ---- sampling options at temperature 0 --------------------------------------------------------------
def test_sampling_options_at_temperature_zero_get_one_note(capsys, tiny_model_path):
    code, out, err = run(capsys, "generate", "--raw", "-n", "2", "--top-k", "5", "--seed", "1",
                         "-m", str(tiny_model_path), "the cat")
    assert code == 0
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "--top-k, --seed ignored" in notes[0]
    code, out, err = run(capsys, "generate", "--raw", "-n", "2", "-m", str(tiny_model_path), "the cat")
    assert "note:" not in err


# ---- trace options ----------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, words", [
    (["--stats"], ["--stats"]),
    (["--values", "2"], ["--values"]),
    (["--stats", "--values", "2"], ["--stats and --values"]),
])
def test_dump_shapes_refuses_stats_and_values(capsys, tiny_model_path, extra, words):
    code, out, err = run(capsys, "trace", "-m", str(tiny_model_path), "--dump-shapes", *extra)
    line = one_error_line(err)
    assert code == 2 and all(w in line for w in words)


def test_trace_top_sets_how_many_probabilities_show(capsys, tiny_model_path):
    code, out, err = run(capsys, "trace", "-m", str(tiny_model_path), "--raw", "--stage", "attn_norm",
                         "--top", "3", "the cat")
    assert code == 0 and "(top 3)" in out
    code, out, err = run(capsys, "trace", "-m", str(tiny_model_path), "--top-k", "3")
    assert code == 2 and "--top-k" in one_error_line(err)


def test_layer_numbering_is_explained_once_in_log_and_help(capsys, tiny_model_path):
    code, out, err = run(capsys, "trace", "-m", str(tiny_model_path), "--raw", "--layer", "1",
                         "--stage", "attn_norm", "the cat")
    assert code == 0
    assert out.count("numbered from 0") == 1 and "layer: 2 / 2" in out
    main(["trace", "--help"])
    assert "numbered from 0" in " ".join(capsys.readouterr().out.split())


def test_choice_errors_have_no_pydantic_prefix(capsys):
    code, out, err = run(capsys, "trace", "--format", "csv")
    line = one_error_line(err)
    assert code == 2 and "Value error" not in line and "'csv'" in line


# ---- help, --debug, wrapping -------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "trace", "diagram", "info", "pull"])
def test_help_shows_flags_without_a_value_type(capsys, command):
    assert main([command, "--help"]) == 0
    # typer >= 0.2x labels its own --help flag <bool> too; ours must not be
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "--help" not in ln]
    assert not [ln for ln in lines if "<bool>" in ln]


def test_debug_works_after_the_subcommand(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 4)
    code, out, err = run(capsys, "generate", "--debug", "-m", str(bad), "hi")
    assert code == 2 and "Traceback" in err and "error:" in err
    code, out, err = run(capsys, "generate", "-m", str(bad), "hi")
    assert code == 2 and "Traceback" not in err                 # not left on by the previous run
    code, out, err = run(capsys, "generate", "-m", str(bad), "--", "--debug")   # after --, it is the prompt
    assert code == 2 and "Traceback" not in err


def test_summary_line_is_one_line_on_a_narrow_non_terminal(tiny_model_path, tmp_path):
    result = subprocess.run([sys.executable, "-m", "llamatrace", "generate", "--raw", "-n", "3", "-m",
                             str(tiny_model_path), "the cat"], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    summary = [ln for ln in result.stderr.splitlines() if "prompt tokens" in ln]
    assert len(summary) == 1 and len(summary[0]) > 80 and summary[0].rstrip().endswith("--max-tokens 3")


# ---- status lines, --quiet ----------------------------------------------------------------------------
# Whether a status line appears depends on timing (a warm-up slower than SLOW_WARMUP_S says so), so
# these tests never wait for a duration: the warm-up is held until the status line has been given.
HANG_GUARD_S = 300        # not a speed check: only turns a lost status line into a failure, not a hang
WARM_LINE, COLD_LINE = "Loading kernels …", "Compiling kernels (first run only"


@pytest.fixture
def slow_warmup(monkeypatch):
    """Status lines on (the suite runs with LLAMATRACE_QUIET=1), the kernel cache warm, and a
    warm-up that ends only after the slow-warm-up status was given (printed or, when quiet,
    not): "slow" by an event, whatever the machine's load."""
    from llamatrace.cli import options
    from llamatrace.model.llama import Llama
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)
    monkeypatch.setattr(options, "numba_cache_is_cold", lambda: False)
    monkeypatch.setattr(options, "SLOW_WARMUP_S", 0.0)
    given, real_status, real_warmup = threading.Event(), options.status, Llama.warmup

    def status(message):
        real_status(message)
        given.set()

    def warmup(self):
        assert given.wait(HANG_GUARD_S), "the slow-warm-up status was never given"
        return real_warmup(self)
    monkeypatch.setattr(options, "status", status)
    monkeypatch.setattr(Llama, "warmup", warmup)
    return monkeypatch


def test_a_slow_warmup_is_a_status_line_and_quiet_turns_it_off(capsys, slow_warmup, tiny_model_path):
    generate = ["generate", "--raw", "-n", "1", "-m", tiny_model_path, "hi"]
    code, out, err = run(capsys, *generate)
    assert code == 0 and err.splitlines()[0] == WARM_LINE and COLD_LINE not in err
    for quiet in (["-q"], ["--quiet"]):
        for args in ([*quiet, *generate], [*generate[:-1], *quiet, "hi"]):    # before or after the command
            code, out, err = run(capsys, *args)
            assert code == 0 and "kernels" not in err and len(err.splitlines()) == 1, err    # the summary alone
    for value, shown in (("1", False), ("yes", False), ("0", True), ("", True)):
        slow_warmup.setenv("LLAMATRACE_QUIET", value)
        code, out, err = run(capsys, *generate)
        assert code == 0 and (WARM_LINE in err) == shown, (value, err)


def test_a_slow_warmup_before_an_error_leaves_one_error_line_when_quiet(capsys, slow_warmup, tiny_model_path):
    # issue 37: the status line of a slow warm-up came before the error line the tests compare
    bad = ["generate", "--raw", "-m", tiny_model_path, "--ctx-size", "2", "hello there"]   # checked after the load
    code, out, err = run(capsys, *bad)
    assert code == 2 and err.splitlines()[0] == WARM_LINE and err.splitlines()[-1].startswith("error:")
    slow_warmup.setenv("LLAMATRACE_QUIET", "1")
    code, out, err = run(capsys, *bad)
    assert code == 2 and "the context holds 2 (--ctx-size)" in one_error_line(err)


def test_a_first_run_says_it_compiles_unless_quiet(capsys, monkeypatch, tiny_model_path):
    # a first run compiles for ~30 s: a CI log or a pipe must not look hung
    from llamatrace.cli import options
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)
    monkeypatch.setattr(options, "numba_cache_is_cold", lambda: True)
    monkeypatch.setattr(options, "SLOW_WARMUP_S", 1e9)    # only the cold cache may cause the line
    code, out, err = run(capsys, "generate", "--raw", "-n", "1", "-m", tiny_model_path, "hi")
    assert code == 0 and err.startswith(COLD_LINE) and WARM_LINE not in err
    code, out, err = run(capsys, "generate", "-q", "--raw", "-n", "1", "-m", tiny_model_path, "hi")
    assert code == 0 and "kernels" not in err and len(err.splitlines()) == 1
    # after `--`, -q is the prompt and status lines stay on
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "1", "-m", tiny_model_path, "--", "-q")
    assert code == 0 and json.loads(out)["prompt"] == "-q" and err.startswith(COLD_LINE)


def test_a_fast_warmup_prints_no_status_line(capsys, monkeypatch, tiny_model_path):
    from llamatrace.cli import options
    monkeypatch.delenv("LLAMATRACE_QUIET", raising=False)
    monkeypatch.setattr(options, "numba_cache_is_cold", lambda: False)
    monkeypatch.setattr(options, "SLOW_WARMUP_S", 1e9)    # "fast" by construction, not by the clock
    code, out, err = run(capsys, "generate", "--raw", "-n", "1", "-m", tiny_model_path, "hi")
    assert code == 0 and "kernels" not in err and len(err.splitlines()) == 1


def test_quiet_draws_no_spinner_or_bar_on_a_terminal(capsys, monkeypatch, tiny_model_path):
    from llamatrace.cli.app import err
    monkeypatch.setattr(err, "_force_terminal", True)
    code, out, err = run(capsys, "generate", "-q", "--raw", "-n", "1", "-m", tiny_model_path, "hi")
    assert code == 0 and len(err.splitlines()) == 1 and "prompt token" in err, repr(err)
    assert "\x1b" not in err                                    # no cursor or colour codes either


def test_root_help_documents_quiet(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--quiet" in text and "-q" in text and "LLAMATRACE_QUIET" in text


# ---- Ctrl-C, python -m ------------------------------------------------------------------------------
def test_ctrl_c_while_loading_says_interrupted(capsys, monkeypatch, tiny_model_path):
    from llamatrace.cli import options

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(options, "load_model", interrupted)
    code, out, err = run(capsys, "generate", "-m", str(tiny_model_path), "hi")
    assert code == 130 and err.strip() == "interrupted"


def test_an_error_a_ctrl_c_left_behind_is_reported_as_the_interrupt(capsys, monkeypatch, tiny_model_path):
    # a SIGINT during the first run's compile: Numba lost the KeyboardInterrupt and raised
    # "RuntimeError: no compiled object yet" instead, which was printed as an internal error
    from llamatrace.cli import options
    from llamatrace.machine import runtime

    def compile_cut_short(*args, **kwargs):
        monkeypatch.setattr(runtime, "_interrupted", True)     # what catch_interrupts' handler records
        raise RuntimeError("no compiled object yet for <Library '_prefill_scores_parallel'>")
    monkeypatch.setattr(options, "load_model", compile_cut_short)
    code, out, err = run(capsys, "generate", "-m", str(tiny_model_path), "hi")
    assert code == 130 and err.strip() == "interrupted", err


def test_ctrl_c_signal_during_loading_exits_130_saying_interrupted(tiny_model_path, tmp_path):
    # a real SIGINT while the command is loading (held there by a stand-in load_model)
    code = textwrap.dedent(f"""
        import signal, sys
        from llamatrace.cli import main, options
        def slow_load(*args):
            print("loading", file=sys.stderr, flush=True)
            signal.pause()                      # until the test's SIGINT, however late it comes
        options.load_model = slow_load
        sys.exit(main(["generate", "-m", {str(tiny_model_path)!r}, "hi"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stderr.readline().strip() == "loading"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)      # a hang guard, not a speed check
    assert proc.returncode == 130 and err.strip() == "interrupted", err


def test_python_m_in_a_folder_holding_a_checkout_gives_one_line(tmp_path):
    # Python resolves `llamatrace` to ./llamatrace (a namespace package: a clone's root has no
    # __init__.py) while llamatrace.__main__ comes from the installed package
    (tmp_path / "llamatrace").mkdir()
    code = textwrap.dedent(f"""
        import importlib.util, sys, types
        sys.path.insert(0, {str(tmp_path)!r})
        import llamatrace
        assert getattr(llamatrace, "__file__", None) is None
        spec = importlib.util.spec_from_file_location("__main__", {str(REPO / "llamatrace" / "__main__.py")!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error:") and "checkout" in result.stderr


# ---- info --all ---------------------------------------------------------------------------------------
def test_info_all_shows_each_key_once_and_the_whole_chat_template(capsys, tiny_model_path):
    from llamatrace.gguf.reader import open_gguf
    template = str(open_gguf(tiny_model_path).metadata["tokenizer.chat_template"])
    code, out, err = run(capsys, "info", "--all", "-m", str(tiny_model_path))
    assert code == 0
    keys = [ln.split()[0] for ln in out.splitlines() if ln.startswith(" general.")]
    assert keys and len(keys) == len(set(keys))
    assert template in out
    # every key gguf-py's reader lists, the vocabulary's arrays too (they were left out)
    import gguf
    shown = {ln.split()[0] for ln in out.splitlines() if ln.startswith(" ") and ln.split()}
    for field in gguf.GGUFReader(tiny_model_path).fields:
        if not field.startswith("GGUF."):
            assert field in shown, field


def test_info_names_the_file_type(capsys, smollm2_path):
    code, out, err = run(capsys, "info", "-m", str(smollm2_path))
    assert code == 0, err
    assert next(ln for ln in out.splitlines() if ln.startswith(" general.file_type")).split()[1:3] == ["3", "(Q4_1)"]


def test_negative_layers_are_documented_as_they_work(capsys, tiny_model_path, tmp_path):
    # --layer -2 is the one before the last: help says so, and the trace records that layer
    code, out, err = run(capsys, "trace", "--help")
    assert code == 0 and "-2 the one before" in " ".join(out.replace("│", " ").split())
    lines = tmp_path / "t.jsonl"
    code, out, err = run(capsys, "trace", "-m", tiny_model_path, "--raw", "--layer", "-2", "--stage", "l_out",
                         "--jsonl", lines, "hi")
    events = [json.loads(ln) for ln in lines.read_text(encoding="utf-8").splitlines()]
    assert code == 0 and {e["layer"] for e in events if e["type"] == "event"} == {0}   # of 2 layers


@pytest.mark.parametrize("args, needles", [
    (["generate", "-n", "abc", "hi"], ["--max-tokens", "valid integer", "(got 'abc')"]),
    (["trace", "--tokens", "1.5", "hi"], ["--tokens", "(got '1.5')"]),
])
def test_a_value_of_the_wrong_type_is_named(capsys, args, needles):
    """typer's pydantic check said "Input should be a valid integer" without the value it refused."""
    from cli_helpers import assert_one_line_error
    assert_one_line_error(*run(capsys, *args), *needles)


@pytest.mark.parametrize("args, option", [
    (["generate", "-m", "", "hi"], "-m"),
    (["generate", "--model=", "hi"], "--model"),
    (["trace", "--npz", "", "hi"], "--npz"),
    (["perplexity", "-f", ""], "-f"),
])
def test_an_empty_path_is_named_not_read_as_the_current_directory(capsys, args, option):
    """``-m "$MODEL"`` with the variable unset: typer reads "" as ".", and the error used to say
    "'.' is a directory"."""
    from cli_helpers import assert_one_line_error
    assert_one_line_error(*run(capsys, *args), f"{option} was given an empty path")


def test_an_empty_string_that_is_not_a_path_is_left_alone(capsys, tiny_model_path):
    # a prompt of "" after "--", an empty --system: not paths
    code, out, err = run(capsys, "generate", "-m", tiny_model_path, "--system", "", "-n", "1", "--", "hi")
    assert code == 0 and "empty path" not in err, err
