"""``--help`` of every command: flags show no value type, fixed choices are listed, and an option
shared by several commands reads the same in each."""

from __future__ import annotations

import re

import pytest

from cli_helpers import run
from llamatrace.cli import app
from llamatrace.cli.compare import AGAINST
from llamatrace.views.diagram import VIEWS

COMMANDS = sorted(c.name or c.callback.__name__ for c in app.registered_commands)
# (option, command) whose help may differ from the shared one, and why
OWN_HELP = {
    ("--ctx-size", "perplexity"): "the chunk length, as llama-perplexity's -c",
    ("--ctx-size", "quantize"): "the calibration chunk length, as perplexity's",
    ("--ctx-size", "imatrix"): "the chunk length, as llama-imatrix's -c (every token summed)",
    ("--ctx-size", "collect"): "the sequence length, as SAELens's context_size",
    ("--ctx-size", "expert-load"): "the chunk length, as imatrix's",
    ("--activations", "expert-load"): "q8 by default from 1 B parameters, as perplexity's",
    ("--activations", "quantize"): "the recipe search's only (with -f): the arithmetic of its KL divergences",
    ("--ctx-size", "diagram"): "the same capacity, with the default the diagram draws (prompt + 256)",
    ("--model", "stages"): "a filter: without it every stage is listed, and no model is fetched",
    ("--activations", "bench"): "repeatable: each mode runs as an engine of its own",
    ("--activations", "generate"): "q8 by default from 1 B parameters; the tracing commands keep f32",
    ("--activations", "perplexity"): "q8 by default from 1 B parameters, as generate's",
    ("--activations", "imatrix"): "q8 by default from 1 B parameters, as generate's",
    ("--activations", "collect"): "q8 by default from 1 B parameters, as generate's",
}
# options whose help has a variant of its own, shared by the commands that run --workers processes
WORKER_VARIANT = {"--threads"}


def _help(capsys, *args) -> str:
    code, out, err = run(capsys, *args, "--help")
    assert code == 0, err
    return out


def _rows(text: str) -> dict[str, str]:
    """``--option`` -> its metavar and whole help text (wrapped lines joined, spaces collapsed)."""
    rows, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^│\s+(--[\w-]+)(?:,--[\w-]+)*(?:\s+-\w)?\s+(.*?)\s*│$", line)   # aliases: --a,--b
        if m:
            current = m.group(1)
            rows[current] = m.group(2)
        elif current and (c := re.match(r"^│\s+(.*?)\s*│$", line)):
            rows[current] += " " + c.group(1)
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in rows.items()}


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_no_flag_shows_a_value_type(capsys, command):
    text = _help(capsys, *([command] if command else []))
    assert "<bool>" not in text
    assert re.search(r"--help\s+-h\s+Show this message", text)


def test_fixed_choices_are_in_the_metavar(capsys):
    assert _rows(_help(capsys, "diagram"))["--view"].startswith("|".join(VIEWS) + " ")
    compare = _rows(_help(capsys, "compare"))
    assert compare["--against"].startswith("|".join(AGAINST) + " ")
    assert compare["--sort"].startswith("forward|worst ")
    assert _rows(_help(capsys, "bench"))["--against"].startswith("|".join(AGAINST) + " ")


@pytest.mark.parametrize("option", ["--model", "--threads", "--activations", "--prompt-file", "--raw",
                                    "--system", "--ctx-size", "--ablate"])
def test_a_shared_option_reads_the_same_everywhere(capsys, option):
    seen: dict[bool, dict[str, str]] = {}          # with --workers (the variant's) or not -> command -> help
    for command in COMMANDS:
        if (option, command) in OWN_HELP:
            continue
        rows = _rows(_help(capsys, command))
        if option in rows:
            seen.setdefault(option in WORKER_VARIANT and "--workers" in rows, {})[command] = rows[option]
    assert sum(map(len, seen.values())) >= 2, seen
    for group in seen.values():
        assert len(set(group.values())) == 1, seen


def test_threads_help_names_workers_only_where_the_command_has_them(capsys):
    has = {}
    for command in COMMANDS:
        rows = _rows(_help(capsys, command))
        if "--threads" in rows:
            has[command] = ("--workers" in rows, "--workers" in rows["--threads"])
    assert {c for c, (workers, _) in has.items() if workers} >= {"perplexity", "imatrix", "collect", "quantize"}
    assert {c for c, (workers, named) in has.items() if workers != named} == set(), has


def test_activations_help_names_the_types_with_q8_kernels():
    """--help names the q8 types without importing the kernels: the list must be the registry's."""
    import re

    from llamatrace.cli.options import _Q8_WEIGHTS
    from llamatrace.kernels.types import registry
    assert set(re.findall(r"Q\d_[0-9K]|MXFP4", _Q8_WEIGHTS)) == {t.name for t in registry.served_types("q8")}
