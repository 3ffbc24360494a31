"""Every code block of README.md and of docs/*.md is run, or excluded here by name with the reason.

- ```` ```python ```` blocks run as written, in a fresh interpreter in an empty folder, with the
  default model resolved as the README says (``Llama.load()``).
- ```` ```console ```` blocks: each ``$ command`` runs in bash (``llamatrace`` is this checkout's
  ``python -m llamatrace``), stdout and stderr together, and its output must equal the lines
  shown under it once both are normalised (:func:`normalise`: timings, speeds, model paths and
  table padding). A line holding only ``…`` stands for any number of lines.
- Any other block must be listed in :data:`EXCLUDED` (its first line → why it is not run);
  a new block that is neither fails :func:`test_every_block_is_run_or_excluded`.

After a deliberate change of output, ``LLAMATRACE_UPDATE_README=1 python3 -m pytest
tests/test_readme.py`` rewrites the outputs shown under each command in README.md and docs/
(commands whose output holds a ``…`` elision are left to edit by hand) and fails once, so that
the new text is reviewed (``git diff README.md docs``).
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]

# first line of a block (stripped) → why the block is not run by this test
EXCLUDED: dict[str, str] = {
    "# 1. install and run the main job on the default model (SmolLM2-135M-Instruct, fetched once, ~98 MB)":
        "set-up: installs packages with pip and apt-get, then runs the whole test suite (CI runs it: .ci/run)",
    'bash scripts/setup.sh --test && python3 -m pytest        # what CI runs (.ci/run)':
        "the test command itself, and benchmarks (timed, minutes long; run by hand)",
    '$ llamatrace compare --raw "The capital of France is" --layer 0,29 --stage "Qcur_rope,kq_soft_max,l_out,result_output"':
        "needs llama-cpp-python (the optional extra llamatrace[llamacpp]), never a CI dependency; "
        "test_compare.py's live test runs the same comparison where it is installed",
}
EXCLUDED.update({
    "llamatrace perplexity -f corpus.txt [--model M] [--ctx-size 512] [--chunks N] [--activations f32|q8]":
        "the command's synopsis, not a command",
    "[1]26.6568,[2]28.1797,[3]27.9899,…": "an excerpt of perplexity's output; tests/test_perplexity.py checks it",
    "====== Perplexity statistics ======": "an excerpt of perplexity --base output; tests/test_perplexity.py checks it",
    'char[8]  "_logits_"': "a file layout, not a command",
    "acts/.manifest.json": "a directory layout, not a command",
    "llamatrace perplexity -f corpus.txt -m Q4_K_M.gguf --base Q4_1.gguf --stages -o where.png":
        "needs a Q4_K_M requantization; test_perplexity.py runs --stages on one",
    "# on the head node": "commands for a real multi-machine Ray cluster",
    'pip install -e ".[llamacpp]"': "installs llama-cpp-python (builds llama.cpp: minutes), never a CI dependency",
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\':
        "builds llama-cpp-python for CPUs with AMX (minutes), never a CI dependency",
    "llamatrace bench --activations f32 --activations q8 --against llama.cpp [--model M]    # SmolLM2: 128 + 64 tokens, 5 runs":
        "benchmarks: minutes long, need llama-cpp-python, run by hand (tests/test_bench.py runs bench itself)",
    "python benchmarks/bench_load.py -m 8b-q4_k_m.gguf --activations q8 --activations f32 --rounds 2 \\":
        "a benchmark on 8B-shaped files (~5 GB each, minutes), needs llama-cpp-python, run by hand",
    "llamatrace imatrix -f calibration.txt [--model BASE.gguf] [--ctx-size 512] [-o imatrix.gguf]":
        "the command's synopsis, not a command",
    "llamatrace quantize BASE.gguf OUT.gguf --target-bpw 5.5 -f calibration.txt [--candidates Q3_K,Q4_K,Q5_K,Q6_K,Q8_0]":
        "the command's synopsis, not a command",
    "llamatrace quantize BASE.gguf OUT.gguf --type Q4_K_M [--tensor-type PATTERN=TYPE ...] [--imatrix FILE] "
    "[--allow-requantize] [--pure] [--json]": "the command's synopsis, not a command",
    "llamatrace quantize smollm2-135m smollm2-f16.gguf --type F16 --allow-requantize":
        "a minute of quantizing, by a model's name (fetched into the user cache); tests/test_quantize.py runs "
        "quantize by name on a cached stand-in, and makes that F16 base (quantize_files.make_f16_base)",
    "llamatrace quantize base-f16.gguf out.gguf --type Q4_K_M --tensor-type attn_v=q8_0 --tensor-type "
    "'blk\\.[0-3]\\.ffn_down=q6_k'": "needs an F16 base; tests/test_quantize.py runs --tensor-type on one",
    "python benchmarks/make_8b.py --type Q4_0 --layers 4 -o /tmp/8b-l4.gguf":
        "a benchmark of the caches' load cost on a 1.1 GB 8B-shaped file, two checkouts; run by hand",
    '$ llamatrace experts --raw "The capital of France is" -m tiny-qwen3moe.gguf --layer 0 -o routes.png':
        "needs a mixture-of-experts file; tests/test_experts.py runs experts on the same random-weight qwen3moe file",
    "$ llamatrace expert-load -f corpus.txt -m tiny-qwen3moe.gguf --ctx-size 64 --chunks 4 -o load.png":
        "needs a mixture-of-experts file; tests/test_experts.py runs expert-load on the same random-weight qwen3moe file",
    '$ llamatrace state -m tiny-qwen35.gguf --raw "The capital of France is" --layer 0 -o state.png':
        "needs a Qwen3.5 file; tests/test_qwen35.py runs state on the same random-weight qwen35 file",
    "python benchmarks/make_moe.py -o /tmp/qwen3moe-8.gguf --layers 8         # 3.39 GB, ~1 min":
        "benchmarks on Qwen3-30B-A3B- and gpt-oss-20b-shaped files (GBs, minutes), need llama-cpp-python; by hand",
    "python3 benchmarks/make_qwen35.py --shape 9b -o /tmp/qwen35-9b.gguf                      # write (3.1 GB)":
        "decode-vs-context benchmarks on Qwen3.5-2B/9B-shaped files (GBs, many minutes), need llama-cpp-python; by hand",
    "llamatrace/": "docs/architecture.md's folder list: a picture of the package, not a command",
    "python benchmarks/make_8b.py --type F16 --layers 4 -o /tmp/qf/llama8b-L4-f16.gguf":
        "a benchmark: a 3.85 GB file, minutes per run, llama-quantize; run by hand",
    "python3 -m pytest tests/test_amx.py -q        # runs the hardware kernel and probe too: nothing skipped when AMX is on":
        "commands for a machine with AMX (this suite runs tests/test_amx.py itself); 8B files, minutes, by hand",
    "python benchmarks/profile_decode.py -m 8b-q4_0.gguf [--threads 2 1] [--rounds 5]   # a step, in place":
        "benchmarks on an 8B-shaped file (~5 GB) and 8B-shaped random matrices, minutes per run; by hand",
    "llamatrace perplexity -f tests/golden/corpus.txt -m FILE -c 512 --chunks 2 -t 2 --json [--activations f32]":
        "a benchmark on 8B-shaped files (~5 GB each, minutes per run) against llama-perplexity; run by hand",
    "llamatrace perplexity -f tests/golden/corpus.txt -m FILE -c 512 --chunks 2 -t 2 --json [--no-cache]":
        "the same benchmark, with and without the packed-weights cache; run by hand",
    "python benchmarks/bench_stages.py --base 8b-q4_0.gguf -m 8b-q4_k_m.gguf -c 256 --chunks 1 --rounds 3 "
    "--activations q8 [--profile]": "a benchmark on two 8B-shaped files (~11 GB of RAM, minutes); run by hand",
    "python benchmarks/bench_fused.py -m 8b-q4_0.gguf -c 512 --rounds 3 --threads 2":
        "a benchmark on an 8B-shaped file (~5 GB, a minute per chunk); run by hand",
    "python benchmarks/bench_tokenizer.py -m 8b-q4_k_m.gguf --tree before=MAIN_CHECKOUT --tree after=. --rounds 4":
        "a benchmark on an 8B-shaped file and two source trees (minutes); run by hand",
    "python benchmarks/bench_heap.py -m 8b-q4_k_m.gguf [-c 512] [--chunks 4] [--rounds 2]":
        "a benchmark on an 8B-shaped file (~5 GB, minutes); run by hand",
    "python benchmarks/bench_prefill.py --scaling 5 --types Q4_0,Q4_K,Q8_0,Q6_K [--rows 512] [--all-shapes]":
        "a benchmark of 8B-shaped matrices, 1 against 2 threads (timed, a minute); run by hand",
})
RUN_LANGS = ("python", "console", "sh")
TIMEOUT_S = 600


@dataclass
class Block:
    line: int                  # 1-based line of the opening fence
    lang: str
    text: str
    path: Path = README

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}:{self.lang or 'plain'}"


def readme_blocks(text: str, path: Path = README) -> list[Block]:
    """The fenced code blocks of a Markdown text, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append(Block(start + 1, m.group(3).lower(), "\n".join(body), path))
        i += 1
    return blocks


BLOCKS = [b for doc in DOCS for b in readme_blocks(doc.read_text(encoding="utf-8"), doc)]


def unclassified(blocks: list[Block]) -> list[Block]:
    """Blocks that are neither run (python, console) nor listed in :data:`EXCLUDED`."""
    return [b for b in blocks if b.lang not in RUN_LANGS and b.first_line not in EXCLUDED]


def test_a_new_block_that_is_neither_run_nor_excluded_is_caught():
    text = "# t\n\n```bash\npip install something\n```\n\n```console\n$ llamatrace info\n```\n"
    blocks = readme_blocks(text)
    assert [(b.line, b.lang, b.first_line) for b in blocks] == [(3, "bash", "pip install something"),
                                                                (7, "console", "$ llamatrace info")]
    assert unclassified(blocks) == blocks[:1]


def test_normalised_comparison_ignores_timings_paths_and_padding_but_not_numbers():
    shown = ["a │  12 µs │ 1.093", "…", "7 tok/s · load 1.3 s", '{"model": "/x/y/m.gguf", "load_s": 1.3}']
    actual = "a │ 1.2 ms │ 1.093\nextra\nmore\n80.5 tok/s · load 0.9 s\n{\"model\": \"/h/m.gguf\", \"load_s\": 2}\n"
    assert matches(normalise("\n".join(shown)), normalise(actual))
    assert not matches(normalise("\n".join(shown)), normalise(actual.replace("1.093", "1.094")))
    assert not matches(normalise("a\n…\nb"), normalise("a\nc"))


def test_every_block_is_run_or_excluded():
    orphans = unclassified(BLOCKS)
    assert not orphans, "\n".join(
        f"{b.name} (```{b.lang}, first line {b.first_line!r}) is neither run (```python or ```console) nor "
        f"excluded: make it one of those, or add its first line to EXCLUDED in tests/test_readme.py "
        f"with the reason" for b in orphans)
    stale = set(EXCLUDED) - {b.first_line for b in BLOCKS}
    assert not stale, f"EXCLUDED names blocks no longer in README.md or docs/: {sorted(stale)}"
    assert not [b for b in BLOCKS if b.lang in RUN_LANGS and b.first_line in EXCLUDED], \
        "a python/console block is listed in EXCLUDED: a block that can run must run"


# ---- normalising output ------------------------------------------------------------------------------
_RATE = re.compile(r"\b\d+(?:\.\d+)? ?tok/s")
_TIME = re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|µs|s)\b")
_JSON_TIMING = re.compile(r'("(?:load_s|prefill_s|decode_s|\w+_tokens_per_s)": )-?[\d.]+(?:e-?\d+)?')
_MODEL_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][^\s\"'\\/]+)+[\\/]([^\s\"'\\/]+\.gguf)")
_BOX_RUN = re.compile(r"([━─═┈])\1+")


def normalise(text: str) -> list[str]:
    """Lines with what varies between runs and machines replaced: speeds (``<rate>``), times
    (``<time>``, whatever the unit), JSON timings (``<t>``),
    model paths (``…/name.gguf``), runs of spaces and of table rule characters (column widths
    follow the widest timing)."""
    out = []
    for line in text.splitlines():
        line = _JSON_TIMING.sub(r"\1<t>", line)
        line = _RATE.sub("<rate>", line)
        line = _TIME.sub("<time>", line)
        line = _MODEL_PATH.sub(r"…/\1", line)
        line = _BOX_RUN.sub(r"\1", line)
        line = re.sub(r"\s+", " ", line).strip()
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def matches(expected: list[str], actual: list[str]) -> bool:
    """Line-by-line equality where an expected ``…`` line matches any run of lines (even none)."""
    if not expected:
        return not actual
    if expected[0] == "…":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


# ---- running -------------------------------------------------------------------------------------------
@dataclass
class Command:
    line: int                  # 1-based README line of the `$ ` prompt
    command: str
    expected: list[str]        # the lines shown under it, as written


def console_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    for offset, raw in enumerate(block.text.splitlines(), start=1):
        if raw.startswith("$ "):
            commands.append(Command(block.line + offset, raw[2:].strip(), []))
        elif commands:
            commands[-1].expected.append(raw)
        elif raw.strip():
            raise AssertionError(f"{block.name}: output before the first `$ ` command: {raw!r}")
    for c in commands:
        while c.expected and not c.expected[-1].strip():
            c.expected.pop()
    return commands


@pytest.fixture(scope="module")
def readme_env(smollm2_path):
    """The environment a README reader has: the default model (resolved, so never fetched twice)
    and this checkout's package; a wide terminal, as the README's tables were shown in; no status
    lines (``LLAMATRACE_QUIET``: whether one appears depends on timing); the suite's cache settings
    (``LLAMATRACE_NO_CACHE``: no packed weights written into the user cache)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LLAMATRACE_", "PYTEST_")) or k in ("LLAMATRACE_CACHE_DIR", "LLAMATRACE_NO_CACHE")}
    env.update({"PYTHONPATH": str(REPO), "LLAMATRACE_MODEL": str(smollm2_path), "COLUMNS": "160",
                "PYTHONIOENCODING": "utf-8", "NO_COLOR": "1", "TERM": "dumb",
                "LLAMATRACE_QUIET": "1"})
    return env


def run_shell(command: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    script = f'llamatrace() {{ "{sys.executable}" -m llamatrace "$@"; }}\n{command}\n'
    return subprocess.run(["bash", "-c", script], env=env, cwd=cwd, capture_output=False, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


CONSOLE = [b for b in BLOCKS if b.lang == "console"]
SH = [b for b in BLOCKS if b.lang == "sh"]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def documented_output(code: str) -> tuple[list[str], list[list[str]]]:
    """What a Python block says it prints: ``(lines, fragments)``.

    - ``lines``: a run of comment lines right after a code line (no blank between) and before a blank
      line or the block's end: whole lines of its output (``# (1, 5, 49152) …`` after a ``print``);
    - ``fragments``: per ``print(…)  # …`` line whose comment has no letter outside quotes (``# 0.77,
      0.21``), its words, which the output must hold in that order. A comment with words is prose.
    """
    rows = code.splitlines()
    lines, fragments = [], []
    i = 0
    while i < len(rows):
        row = rows[i].strip()
        if row.startswith("#") and i and rows[i - 1].strip() and not rows[i - 1].strip().startswith("#"):
            j = i
            while j < len(rows) and rows[j].strip().startswith("#"):
                j += 1
            if j == len(rows) or not rows[j].strip():
                lines += [r.strip()[1:].strip() for r in rows[i:j]]
            i = j
            continue
        if row.startswith("print(") and "  # " in row:
            comment = row.rsplit("  # ", 1)[1].strip()
            if not re.search(r"[A-Za-z]", re.sub(r"'[^']*'|\"[^\"]*\"", "", comment)):
                fragments.append(comment.split())
        i += 1
    return lines, fragments


def test_documented_output_reads_what_the_blocks_say_they_print():
    lines, fragments = documented_output(
        'x = 1\n# prose before code\ny = 2\nprint(x)   # 0.77, 0.21\nprint(y)  # the answer\n'
        'print(x, y)\n# 1 2\n# 3\n\n# heading\nz = 3\n')
    assert (lines, fragments) == (["1 2", "3"], [["0.77,", "0.21"]])
    assert all(documented_output(b.text) != ([], []) for b in PYTHON if "print(" in b.text and "# (" in b.text)


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_block_runs_as_written(block, readme_env, tmp_path):
    """It runs, and prints what its comments say it prints (:func:`documented_output`)."""
    result = subprocess.run([sys.executable, "-c", block.text], env=readme_env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout}\n{result.stderr}"
    printed = [" ".join(line.split()) for line in result.stdout.splitlines()]
    lines, fragments = documented_output(block.text)
    for line in lines:
        assert " ".join(line.split()) in printed, f"{block.name}: no output line {line!r} in:\n{result.stdout}"
    words = " ".join(printed)
    for fragment in fragments:
        pattern = r"(?<!\S)" + r"\s.*?".join(map(re.escape, fragment))
        assert re.search(pattern, words), f"{block.name}: {' '.join(fragment)!r} not printed, in order:\n{result.stdout}"


@pytest.mark.parametrize("block", CONSOLE, ids=[b.name for b in CONSOLE])
def test_console_block_output_is_what_the_readme_shows(block, readme_env, tmp_path):
    commands = console_commands(block)
    assert commands, f"{block.name} has no `$ ` command"
    failures, updates = [], {}
    for c in commands:
        result = run_shell(c.command, readme_env, tmp_path)
        expected, actual = normalise("\n".join(c.expected)), normalise(result.stdout)
        if matches(expected, actual):
            continue
        if os.environ.get("LLAMATRACE_UPDATE_README") and "…" not in expected:
            updates[c.line] = (len(c.expected), result.stdout.rstrip("\n").splitlines())
            continue
        diff = "\n".join(difflib.unified_diff(expected, actual, "README (normalised)", "actual (normalised)",
                                              lineterm=""))
        failures.append(f"{block.path.relative_to(REPO)}:{c.line}: `{c.command}` (exit {result.returncode}) printed other "
                        f"lines:\n{diff}")
    if updates:
        _rewrite_outputs(block.path, updates)
        pytest.fail(f"{block.path.relative_to(REPO)} outputs of lines {sorted(updates)} rewritten: review `git diff`, rerun")
    assert not failures, "\n\n".join(failures)


def _rewrite_outputs(path: Path, updates: dict[int, tuple[int, list[str]]]) -> None:
    lines = path.read_text(encoding="utf-8").split("\n")
    for line_no in sorted(updates, reverse=True):          # bottom-up: earlier line numbers stay valid
        n_old, new = updates[line_no]
        lines[line_no:line_no + n_old] = [ln.rstrip() for ln in new]
    path.write_text("\n".join(lines), encoding="utf-8")


@pytest.mark.parametrize("block", SH, ids=[b.name for b in SH])
def test_sh_block_commands_all_succeed(block, readme_env, tmp_path):
    """```sh blocks (examples without their output): every line exits 0, in an empty folder
    holding a copy of ``tests/golden/corpus.txt`` at that path (the README's examples run from the
    checkout), so that the files they write land in ``tmp_path``."""
    corpus = tmp_path / "tests" / "golden" / "corpus.txt"
    corpus.parent.mkdir(parents=True)
    corpus.write_text((REPO / "tests" / "golden" / "corpus.txt").read_text(encoding="utf-8"), encoding="utf-8")
    lines = [ln for ln in block.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines, f"{block.name} has no command"
    for line in lines:
        result = run_shell(line, readme_env, tmp_path)
        assert result.returncode == 0, f"{block.name}: `{line}` exited {result.returncode}:\n{result.stdout[-3000:]}"
