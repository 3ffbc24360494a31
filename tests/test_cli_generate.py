"""`llamatrace generate`, `info`, `pull` through the CLI entry point (exit codes, stdout/stderr split)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run
from gguf_factory import T, write_tiny_llama

from llamatrace.cli import main
from llamatrace.cli.options import default_activations
from llamatrace.gguf.reader import open_gguf
from llamatrace.kernels.int8 import act8


@pytest.mark.model
def test_generate_answers_the_capital_of_france(capsys, smollm2_path):
    code, out, err = run(capsys, "generate", "--model", str(smollm2_path), "What is the capital of France?")
    assert code == 0
    assert "Paris" in out
    assert "prompt tokens" in err and "decode" in err and "tok/s" in err
    assert "f32 activations" in err            # the summary says which mode ran: f32 under 1 B parameters
    assert "prompt tokens" not in out          # the summary stays off stdout


@pytest.mark.model
def test_generate_json_is_one_object_with_the_documented_fields(capsys, smollm2_path):
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "8", "--model", str(smollm2_path),
                         "The capital of France is")
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"model", "activations", "prompt", "prompt_ids", "ids", "text", "stop_reason", "timings"}
    assert result["activations"] == "f32"
    assert result["prompt_ids"] == [504, 3575, 282, 4649, 314]           # HF's ids (tests/golden)
    assert result["ids"][:2] == [7042, 30]                               # " Paris."
    assert result["text"].startswith(" Paris.")
    assert result["stop_reason"] == "max_tokens" and len(result["ids"]) == 8
    assert set(result["timings"]) == {"load_s", "prefill_tokens_per_s", "decode_tokens_per_s"}


@pytest.mark.model
def test_the_streamed_text_is_the_generated_text_byte_for_byte(capsys, smollm2_path):
    """Tabs, carriage returns and control bytes reach stdout as generated (a console used to turn
    tabs into spaces and drop \\r): stdout is the --json text plus a newline."""
    prompt = "name\tage\tcity\nAlice\t30\tParis\nBob\t"
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "12", "-m", str(smollm2_path), prompt)
    assert code == 0, err
    text = json.loads(out)["text"]
    assert "\t" in text                        # the case this test is about: the model continues the table
    code, out, err = run(capsys, "generate", "--raw", "-n", "12", "-m", str(smollm2_path), prompt)
    assert code == 0, err
    assert out == text + "\n"


@pytest.mark.skipif(not act8.available(), reason="q8 needs AVX2")
def test_generate_defaults_to_q8_from_a_billion_parameters(capsys, tiny_model_path, monkeypatch):
    from llamatrace.cli import options
    assert default_activations(tiny_model_path) == "f32"
    n_params = sum(t.n_elements for t in open_gguf(tiny_model_path).tensors.values())
    monkeypatch.setattr(options, "Q8_DEFAULT_PARAMS", n_params)      # as if the tiny model were 1 B
    assert default_activations(tiny_model_path) == "q8"
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "2", "-m", str(tiny_model_path), "the cat")
    assert code == 0, err
    assert json.loads(out)["activations"] == "q8"
    code, out, err = run(capsys, "generate", "--raw", "-n", "2", "-m", str(tiny_model_path), "the cat")
    assert code == 0 and "q8 activations" in err
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "2", "--activations", "f32", "-m",
                         str(tiny_model_path), "the cat")
    assert code == 0 and json.loads(out)["activations"] == "f32"      # given, it wins


def test_generate_on_tiny_model_stops_at_max_tokens(capsys, tiny_model_path):
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "5", "-m", str(tiny_model_path), "the cat")
    assert code == 0
    result = json.loads(out)
    assert len(result["ids"]) == 5 and result["stop_reason"] == "max_tokens"


def test_sampling_is_reproducible_with_a_seed_and_every_flag_counts(capsys, tiny_model_path):
    def ids(*flags) -> list[int]:
        code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "12", *flags, "-m", str(tiny_model_path),
                             "the cat")
        assert code == 0, err
        return json.loads(out)["ids"]

    greedy = ids()
    sampled = ("--temperature", "50", "--top-k", "50", "--top-p", "0.95")      # the tiny model is peaked: flatten it
    a = ids(*sampled, "--seed", "7")
    assert a == ids(*sampled, "--seed", "7")                     # --seed: the same draws
    assert a != ids(*sampled, "--seed", "8")                     # ... and another seed, others
    assert a != greedy                                           # --temperature: sampled, not argmax
    # what each filter alone must give, whatever the seed: the likeliest token at every step
    assert ids("--temperature", "50", "--top-k", "1", "--seed", "7") == greedy
    assert ids("--temperature", "50", "--top-p", "0.001", "--seed", "7") == greedy
    assert ids("--temperature", "0.0001", "--seed", "7") == greedy


def test_context_limit_stops_cleanly(capsys, tiny_model_path):
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "50", "--ctx-size", "6",
                         "-m", str(tiny_model_path), "the cat")
    assert code == 0
    result = json.loads(out)
    assert result["stop_reason"] == "context"
    assert len(result["prompt_ids"]) + len(result["ids"]) == 6 + 1   # the last token needs no cache slot
    assert "context limit" in err and "raise --ctx-size (at most the model's" in err
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    with open_gguf(tiny_model_path) as f:
        n_ctx = ModelConfig.from_gguf(f).max_seq_len
    # at the model's own limit, raising --ctx-size is no advice
    code, out, err = run(capsys, "generate", "--raw", "-n", str(n_ctx + 10), "-m", str(tiny_model_path), "the cat")
    assert code == 0 and "the model's own limit" in err and "raise --ctx-size" not in err


def test_prompt_file_from_stdin_and_dash_prompts(capsys, monkeypatch, tiny_model_path):
    import io
    import sys
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the cat \xff\xfe")))
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "2", "-m", str(tiny_model_path), "-f", "-")
    assert code == 0 and json.loads(out)["prompt"].startswith("the cat")
    assert "not valid UTF-8" in err
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "2", "-m", str(tiny_model_path), "--", "-5 cats")
    assert code == 0 and json.loads(out)["prompt"] == "-5 cats"
    # invalid UTF-8 in argv (os.fsdecode's lone surrogates) became '?' in silence; now as with -f
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "2", "-m", str(tiny_model_path), "caf\udce9 x")
    assert code == 0 and json.loads(out)["prompt"] == "caf\ufffd x" and "not valid UTF-8" in err


def test_the_corpus_commands_long_names_are_taken_too(capsys, tmp_path, tiny_model_path):
    # -f is --file in perplexity, imatrix and collect; the steps are --tokens in trace and diagram
    (tmp_path / "p.txt").write_text("the cat sat\n")
    code, out, err = run(capsys, "generate", "--json", "--raw", "--tokens", "2", "-m", str(tiny_model_path),
                         "--file", str(tmp_path / "p.txt"))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["prompt"] == "the cat sat" and 1 <= len(doc["ids"]) <= 2


def test_chat_template_is_applied_unless_raw(capsys, tiny_model_path):
    chat = json.loads(run(capsys, "generate", "--json", "-n", "1", "-m", str(tiny_model_path), "hi")[1])
    raw = json.loads(run(capsys, "generate", "--json", "--raw", "-n", "1", "-m", str(tiny_model_path), "hi")[1])
    assert raw["prompt_ids"] == [107, 108]            # 'h', 'i' byte tokens (ids = byte + 3)
    assert chat["prompt_ids"][0] == 1                 # <|im_start|>
    assert len(chat["prompt_ids"]) > len(raw["prompt_ids"])


@pytest.mark.parametrize("args,needle", [
    (("generate", ""), "prompt is empty"),
    (("generate", "--max-tokens", "0", "hi"), "--max-tokens"),
    (("generate", "--temperature", "-1", "hi"), "--temperature"),
    (("generate", "--top-p", "0", "hi"), "--top-p"),
    (("generate", "--ctx-size", "0", "hi"), "--ctx-size"),
    (("generate", "--bogus", "hi"), "--bogus"),
    (("generate", "-m", "/nonexistent/model.gguf", "hi"), "does not exist"),
])
def test_bad_options_give_one_line_and_exit_2(capsys, args, needle):
    code, out, err = run(capsys, *args)
    assert_one_line_error(code, out, err, needle)


def test_not_a_gguf_file(capsys, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("<html>not a model</html>")
    assert_one_line_error(*run(capsys, "generate", "-m", str(bad), "hi"), "model.gguf")


def test_unsupported_tensor_type_is_named(capsys, tmp_path):
    path = tmp_path / "iq4.gguf"
    write_tiny_llama(path, qtype=T.IQ4_NL, embd_type=T.Q8_0)
    assert_one_line_error(*run(capsys, "generate", "-m", str(path), "hi"), "IQ4_NL", "blk.0")


def test_prompt_longer_than_context_is_refused_before_compute(capsys, tiny_model_path):
    code, out, err = run(capsys, "generate", "-m", str(tiny_model_path), "--raw", "x" * 200)
    assert_one_line_error(code, out, err, "200 tokens", "64")


def test_info_lists_tensors(capsys, tiny_model_path):
    code, out, err = run(capsys, "info", "-m", str(tiny_model_path))
    assert code == 0
    assert "blk.0.attn_q.weight" in out and "Q8_0" in out and "llama.embedding_length" in out
    assert "shape [out, in]" in out                  # rich took "[out, in]" for a markup tag and dropped it
    import numba
    assert f"threading layer {numba.threading_layer()!r}" in " ".join(out.split())
    from llamatrace.kernels.int8 import amx
    from llamatrace.machine.jit import has_vnni
    line = next(line for line in out.splitlines() if line.startswith("q8 int8 products:"))
    assert ("VNNI" in line) == has_vnni() and line.endswith(f"; AMX prefill: {amx.describe(('Q8_0', 'F32'))}")


def test_info_json_is_the_header_as_gguf_reads_it(capsys, smollm2_path):
    import gguf
    code, out, err = run(capsys, "info", "--json", "-m", str(smollm2_path))
    assert code == 0, err
    doc = json.loads(out)
    reader = gguf.GGUFReader(smollm2_path)                 # the reference: gguf-py's own reader
    assert [(t["name"], t["type"], t["bytes"]) for t in doc["tensors"]] == \
        [(t.name, t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors]
    assert all(t["shape"] == list(reversed([int(n) for n in r.shape])) for t, r in zip(doc["tensors"], reader.tensors))
    for key in ("general.architecture", "llama.embedding_length", "llama.rope.freq_base", "tokenizer.ggml.pre"):
        assert doc["metadata"][key] == pytest.approx(reader.fields[key].contents()), key
    assert "tokenizer.ggml.tokens" in doc["bulk_arrays"] and "tokenizer.ggml.tokens" not in doc["metadata"]
    assert doc["config"]["dim"] == 576 and doc["config"]["n_layers"] == 30 and "smollm" in doc["tokenizer"]


def test_info_json_stays_json_with_nan_and_inf_in_the_header(capsys, tmp_path):
    import gguf
    from gguf_factory import rewrite_metadata
    F32, ARRAY = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.ARRAY
    path = rewrite_metadata(write_tiny_llama(tmp_path / "a.gguf"), tmp_path / "nan.gguf",
                            {"general.x_nan": (float("nan"), F32), "general.x_list": ([1.5, float("inf")], ARRAY, F32)})
    code, out, err = run(capsys, "info", "--json", "-m", str(path))
    assert code == 0, err

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    doc = json.loads(out, parse_constant=refuse)
    assert doc["metadata"]["general.x_nan"] is None and doc["metadata"]["general.x_list"] == [1.5, None]


def test_info_shows_tokenizer_kind_and_tensor_type_mix(capsys, tiny_model_path):
    import gguf
    code, out, err = run(capsys, "info", "-m", str(tiny_model_path))
    assert code == 0
    assert "byte-level BPE (pre-tokenizer smollm)" in " ".join(out.split())
    mix: dict[str, list[int]] = {}  # from gguf-py's reader, not ours
    for t in gguf.GGUFReader(tiny_model_path).tensors:
        entry = mix.setdefault(t.tensor_type.name, [0, 0])
        entry[0] += 1
        entry[1] += int(t.n_bytes)
    section = out.split("Tensor types", 1)[1].split("Tensors (", 1)[0]
    for name, (n, nbytes) in mix.items():
        assert any(name in line and f" {n} " in line and f"{nbytes:,}" in line for line in section.splitlines())


def test_help_shows_examples(capsys):
    for cmd in ([], ["generate"], ["trace"], ["diagram"], ["info"], ["pull"], ["bench"]):
        code = main([*cmd, "--help"])
        out = capsys.readouterr().out
        assert code == 0 and "llamatrace" in out and "Example" in out


def _configure_in_isolation(monkeypatch, writable: bool) -> dict:
    """Run the CLI's Numba set-up against an empty environment; this process's Numba and heap are
    untouched."""
    import numba

    from llamatrace.machine import runtime
    env: dict[str, str] = {}
    monkeypatch.setattr(runtime.os, "environ", env)
    monkeypatch.setattr(runtime, "_reuse_freed_memory", lambda: None)
    monkeypatch.setattr(runtime.os, "access", lambda path, mode: writable)
    for name in ("CACHE_DIR", "THREADING_LAYER_PRIORITY"):
        monkeypatch.setattr(numba.config, name, getattr(numba.config, name))
    runtime.configure_process()
    return env


def test_numba_cache_moves_to_user_cache_when_package_dir_is_read_only(monkeypatch):
    from llamatrace.gguf.fetch import cache_root
    assert _configure_in_isolation(monkeypatch, writable=False)["NUMBA_CACHE_DIR"] == str(cache_root() / "numba")


def test_numba_cache_stays_put_when_package_dir_is_writable(monkeypatch):
    assert "NUMBA_CACHE_DIR" not in _configure_in_isolation(monkeypatch, writable=True)


_REALLOCATE = """
import resource, sys
import numpy as np
from llamatrace.machine import runtime
if sys.argv[1] == "configured":
    runtime.configure_process()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones(64 << 20, np.uint8)      # over glibc's default 32 MiB: a map of its own, then unmapped
del a
before = faults()
for _ in range(5):
    a = np.ones(64 << 20, np.uint8)
    del a
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt; other systems keep their own")
@pytest.mark.parametrize("user_env", [{}, {"MALLOC_MMAP_THRESHOLD_": "65536"}])
def test_the_cli_reuses_freed_arrays_unless_the_user_set_malloc(user_env):
    # a prefill layer's large arrays, freed and allocated again: faulted in and zeroed anew each
    # time by default (~5 % of an 8B chunk), reused from the heap once configure_process ran
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **user_env}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        if name not in user_env:
            env.pop(name, None)
    runs = {mode: int(subprocess.run([sys.executable, "-c", _REALLOCATE, mode], env=env, capture_output=True,
                                     text=True, check=True).stdout) for mode in ("default", "configured")}
    assert runs["default"] >= 5 * 32                     # at least the 2 MiB pages of 5 × 64 MiB
    if user_env:
        assert runs["configured"] >= 5 * 32              # the user's setting stands
    else:
        assert runs["configured"] < 32


@pytest.mark.parametrize("command", ["generate", "trace", "stages"])
def test_a_reader_that_stops_early_ends_the_command_quietly(smollm2_path, command):
    # `llamatrace … | head -c 20`: rich exits 1 on a broken pipe; Unix tools end quietly
    args = {"generate": ["generate", "--raw", "-n", "200", "-m", str(smollm2_path), "Once upon a time"],
            "trace": ["trace", "--raw", "-m", str(smollm2_path), "Hello"], "stages": ["stages"]}[command]
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-m", "llamatrace", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": repo})
    assert len(proc.stdout.read(20)) == 20
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err and "error" not in err


def test_a_stdout_that_is_not_utf8_gets_escapes_not_an_internal_error(tiny_model_path):
    # PYTHONIOENCODING=ascii (or an old C locale): "é" cannot be written as it is
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-m", "llamatrace", "generate", "-m", str(tiny_model_path), "--raw",
                           "--json", "-n", "2", "café \U0001f600"], capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": repo, "PYTHONIOENCODING": "ascii"})
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "error" not in err, err
    # the escapes are JSON's (\u00e9, a surrogate pair for the emoji): the output still parses
    assert '"prompt": "caf\\u00e9 \\ud83d\\ude00"' in proc.stdout.decode("ascii")
    assert json.loads(proc.stdout)["prompt"] == "café \U0001f600"


@pytest.mark.parametrize("args", [["perplexity", "--help"], ["--help"]])
def test_help_into_a_closed_pipe_ends_quietly(args):
    # `llamatrace perplexity --help | head -2`: typer prints the help to stdout itself; a reader
    # gone before the first write makes every write fail, whatever the timing
    read_end, write_end = os.pipe()
    os.close(read_end)
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-m", "llamatrace", *args], stdout=write_end, stderr=subprocess.PIPE,
                          env={**os.environ, "PYTHONPATH": repo}, timeout=120)
    os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "error" not in err


class _PipeClosingAt:
    """A stdout whose reader goes away at its ``fail_at``-th write: that write and every later one
    raise BrokenPipeError (``fileno`` is a scratch file, for the redirect to /dev/null)."""

    def __init__(self, fail_at: int, fd: int) -> None:
        self.fail_at, self.writes, self.fd = fail_at, 0, fd

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes >= self.fail_at:
            raise BrokenPipeError(32, "Broken pipe")
        return len(text)

    def flush(self) -> None:
        if self.writes >= self.fail_at:
            raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return False

    encoding = "utf-8"


@pytest.mark.parametrize("args", [["attention", "--help"], ["--help"]])
def test_help_into_a_pipe_closed_at_any_write_ends_quietly(args, capsys, monkeypatch, tmp_path):
    # `llamatrace attention --help | head -30`: head leaves after its lines, while the help is still
    # being written, by rich in format_help or by click's echo after it (that one was an internal error)
    count = _PipeClosingAt(10**9, 0)
    monkeypatch.setattr(sys, "stdout", count)
    assert main(list(args)) == 0
    assert count.writes >= 1
    for fail_at in range(1, count.writes + 1):
        with open(tmp_path / f"out{fail_at}", "w") as scratch:
            saved = os.dup(1)
            try:
                monkeypatch.setattr(sys, "stdout", _PipeClosingAt(fail_at, scratch.fileno()))
                code = main(list(args))
            finally:
                os.dup2(saved, 1)
                os.close(saved)
        err = capsys.readouterr().err
        assert code == 0, (fail_at, err)
        assert "error" not in err and "Traceback" not in err, (fail_at, err)


def test_prompt_bytes_without_a_token_are_one_warning_line_naming_them(capsys, smollm2_path, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"abc \x04\x06 def")           # SmolLM2 has no token for 0x04 or 0x06
    code, out, err = run(capsys, "generate", "--raw", "-n", "1", "-m", smollm2_path, "--prompt-file", prompt)
    assert code == 0
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert warnings == ["warning: the text contains bytes the vocabulary has no token for (0x04, 0x06); "
                        "they are dropped"]
    assert "UserWarning" not in err and ".py:" not in err


def test_system_without_a_chat_template_says_so_before_the_load(capsys, tmp_path, monkeypatch):
    # the file has no chat template and --raw was never given: say that, from the header, without
    # loading the model (gemma3-270m's case, issue 47)
    from llamatrace.model.llama import Llama
    bare = write_tiny_llama(tmp_path / "bare.gguf", chat_template=None)
    templated = write_tiny_llama(tmp_path / "templated.gguf")
    loads = []
    monkeypatch.setattr(Llama, "load", classmethod(lambda cls, *a, **k: loads.append(a)))
    for command in ("generate", "trace", "lens"):
        code, out, err = run(capsys, command, "-m", bare, "--system", "be brief", "hi")
        assert_one_line_error(code, out, err, "--system needs a chat template and bare.gguf has none")
        assert "--raw" not in err
        assert_one_line_error(*run(capsys, command, "-m", templated, "--raw", "--system", "be brief", "hi"),
                              "--system needs the chat template: drop --raw")
    # an --ablate out of the model's range is also refused from the header
    assert_one_line_error(*run(capsys, "generate", "-m", templated, "--ablate", "ffn_out@7", "hi"), "--ablate")
    assert loads == []


def test_chat_template_trouble_points_the_right_way(capsys, tmp_path):
    """A template that renders nothing is not 'an empty prompt'; a prompt the template makes too long
    says how many tokens it added; a template that fails with --system says to drop --system (--raw
    refuses it)."""
    empty = write_tiny_llama(tmp_path / "empty.gguf", chat_template="{{ '' }}")
    assert_one_line_error(*run(capsys, "generate", "-m", empty, "hi there", "-n", "1"),
                          "chat template rendered an empty prompt; use --raw")
    long = write_tiny_llama(tmp_path / "long.gguf", chat_template="{{ 'x y z ' * 40 }}{{ messages[0]['content'] }}")
    code, out, err = run(capsys, "trace", "-m", long, "hi", "--layer", "0")
    assert_one_line_error(code, out, err, "but the model's context length is 64")
    import re
    added, total = map(int, re.search(r"\((\d+) of the (\d+) tokens are the chat template's; --raw sends", err).groups())
    assert added >= 80 and 1 <= total - added <= 2                     # 'hi' alone is a token or two
    code, out, err = run(capsys, "trace", "-m", long, "hi " * 80, "--layer", "0")   # too long with --raw too
    assert_one_line_error(code, out, err, "but the model's context length is 64")
    assert "--raw" not in err and "chat template's" not in err
    nosys = write_tiny_llama(tmp_path / "nosys.gguf", chat_template=(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ messages[0]['content'] }}"))
    code, out, err = run(capsys, "generate", "-m", nosys, "--system", "be brief", "hi", "-n", "1")
    assert_one_line_error(code, out, err, "System role not supported")
    assert "drop --system" in err and "use --raw to send the prompt without it" not in err


def test_one_token_says_there_was_no_decode_step(capsys, tiny_model_path):
    """-n 1 is the prefill's token alone: the summary said 'decode 0.0 tok/s'."""
    code, out, err = run(capsys, "generate", "--raw", "-n", "1", "-m", str(tiny_model_path), "the cat")
    assert code == 0 and "no decode step" in err and "decode 0.0" not in err
    code, out, err = run(capsys, "generate", "--raw", "-n", "2", "-m", str(tiny_model_path), "the cat")
    assert code == 0 and "no decode step" not in err and " tok/s · load" in err
