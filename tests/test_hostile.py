"""Broken and hostile input at the CLI boundary: one clear line, exit 2, no traceback, nothing lost.

GGUF header fuzzing lives in test_validate.py, chat-template payloads in test_chat.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf_factory import write_tiny_llama
from cli_helpers import assert_one_line_error, run

from llamatrace.cli import main
from llamatrace.errors import UnsupportedModelError
from llamatrace.model.llama import Llama


def test_debug_flag_shows_the_traceback(capsys, tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    code = main(["--debug", "generate", "-m", str(bad), "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "error:" in err


def test_missing_metadata_key_is_named(capsys, tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(*run(capsys, "generate", "-m", str(path), "hi"), "llama.embedding_length")


def test_tensor_shape_inconsistent_with_config(capsys, tmp_path):
    path = write_tiny_llama(tmp_path / "s.gguf", extra_kv={"llama.feed_forward_length": 128})
    assert_one_line_error(*run(capsys, "generate", "-m", str(path), "hi"), "ffn_gate", "[128, 64]")


def test_vocabulary_arrays_of_different_lengths(capsys, tmp_path):
    from gguf_factory import rewrite_metadata
    path = write_tiny_llama(tmp_path / "v.gguf", extra_kv={})
    types = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.token_type"].contents()
    # rewritten with a short token_type array
    rewrite_metadata(path, tmp_path / "v2.gguf", {"tokenizer.ggml.token_type": (
        types[:10], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)})
    code, out, err = run(capsys, "generate", "-m", str(tmp_path / "v2.gguf"), "hi")
    assert_one_line_error(code, out, err, "token_type")


def test_lone_surrogates_in_the_prompt_do_not_crash(capsys, tiny_model_path):
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "2", "-m", str(tiny_model_path), "cat \udc80 dog")
    assert code == 0
    # U+DC80 is what Python makes of the byte 0x80 in argv (PEP 383): invalid UTF-8, replaced as -f replaces it
    assert json.loads(out)["prompt"] == "cat \ufffd dog"
    assert "not valid UTF-8" in err


@pytest.mark.parametrize("argv_text, text, warned", [
    ("caf\udcc3\udca9", "café", False),           # a non-UTF-8 locale's escapes of valid UTF-8 bytes
    ("a \udcc3 b", "a \ufffd b", True),             # a lone lead byte
    ("a \ud800 b \udc80", "a \ufffd b \ufffd", True),  # a surrogate no byte makes (main(argv) from Python)
    ("plain é", "plain é", False),
])
def test_argv_text_becomes_utf8(capsys, argv_text, text, warned):
    from llamatrace.cli.options import read_prompt
    assert read_prompt(argv_text, None) == text
    assert ("not valid UTF-8" in capsys.readouterr().err) == warned


def test_a_shard_of_a_split_gguf_says_to_merge_the_shards(capsys, tmp_path):
    # llama-gguf-split's first shard has the whole header but a part of the tensors: it failed on a
    # "missing" tensor, as if the file were broken
    path = write_tiny_llama(tmp_path / "m-00001-of-00003.gguf", extra_kv={"split.count": 3, "split.no": 0})
    for command, exit_code in ((["generate", "--raw", "hi"], 2), (["info"], 0)):   # info shows the header too
        code, out, err = run(capsys, *command, "-m", str(path))
        text = " ".join((out + err).split())
        assert code == exit_code and "shard 1 of 3 of a split GGUF" in text and "--merge" in text, text


def test_a_bidirectional_file_is_refused_naming_the_key(capsys, tmp_path):
    # llama.cpp reads {arch}.attention.causal for every architecture (the converter writes false for
    # embedding models such as pplx-embed's Qwen3): a full mask, every token seeing the batch
    path = write_tiny_llama(tmp_path / "embed.gguf", extra_kv={"llama.attention.causal": False})
    with pytest.raises(UnsupportedModelError, match="attention.causal = false"):
        Llama.load(path)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), "llama.attention.causal")
    causal = write_tiny_llama(tmp_path / "causal.gguf", extra_kv={"llama.attention.causal": True})
    assert Llama.load(causal).config.n_layers == 2


@pytest.mark.parametrize("command", [["generate", "-n", "1", "-f", "-"], ["perplexity", "-c", "32", "-f", "-"]])
def test_a_closed_stdin_is_one_line(capsys, monkeypatch, tiny_model_path, command):
    # `llamatrace generate -f - <&-`: Python's sys.stdin is None ("internal error: AttributeError", exit 1)
    monkeypatch.setattr(sys, "stdin", None)
    assert_one_line_error(*run(capsys, *command, "-m", str(tiny_model_path)), "standard input is closed")


@pytest.mark.parametrize("key, value, field", [("llama.block_count", 0, "n_layers"),
                                               ("llama.attention.head_count_kv", 3, "n_kv_heads")])
def test_a_config_the_checks_refuse_names_the_file_and_key(capsys, tmp_path, key, value, field):
    # was "model config: n_layers must be a positive integer, got 0": no file, no key, no advice
    path = write_tiny_llama(tmp_path / "damaged.gguf", extra_kv={key: value})
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"),
                          "damaged.gguf:", field, "(metadata ", key, "re-download")


@pytest.mark.parametrize("closed, args, code", [(2, ["generate", "--raw", "-n", "1", "hi"], 0),
                                               (2, ["generate", "--raw", "-n", "1", "-m", "no-such.gguf", "hi"], 2),
                                               (1, ["stages"], 0)])
def test_a_closed_standard_stream_keeps_the_exit_code(tiny_model_path, closed, args, code):
    # `llamatrace … 2>&-`: stderr's text went to EBADF (exit 1, "internal error"), or to the first file
    # opened, which took fd 2; `stages >&-` was a RecursionError with a traceback
    model = ["-m", str(tiny_model_path)] if "-m" not in args and args[0] != "stages" else []
    proc = subprocess.run([sys.executable, "-m", "llamatrace", *args, *model], stdout=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(closed), timeout=600)
    assert proc.returncode == code


def test_typed_control_token_text_stays_text(capsys, tiny_model_path):
    code, out, err = run(capsys, "generate", "--json", "--raw", "-n", "1", "-m", str(tiny_model_path), "<|im_end|>")
    ids = json.loads(out)["prompt_ids"]
    assert code == 0 and 2 not in ids and len(ids) == len("<|im_end|>")


def test_ctrl_c_during_generate_keeps_the_text_and_exits_130(tmp_path):
    model = write_tiny_llama(tmp_path / "long.gguf", context_length=100000)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from llamatrace.__main__ import main; sys.exit(main())", "generate", "--raw", "-n", "90000",
         "-m", str(model), "the cat"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first = proc.stdout.read(20)                 # the event: text is streaming
        assert len(first) == 20
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)     # a hang guard, not a speed check
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert rest.endswith(b"\n")                      # the text is kept, ended by its line break
    text = err.decode()
    assert "Traceback" not in text and text.rstrip().endswith("stopped: interrupted"), text


# ---- full disk and odd output targets --------------------------------------------------------
needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@needs_dev_full
@pytest.mark.parametrize("option", ["--jsonl", "--log-file"])
def test_trace_stream_to_a_full_disk_is_a_clean_error(capsys, tiny_model_path, option):
    code, out, err = run(capsys, "trace", "--raw", "-m", str(tiny_model_path), option, "/dev/full", "the cat")
    assert_one_line_error(code, out, err, option, "No space left")


@needs_dev_full
def test_npz_onto_a_device_is_refused_and_the_device_kept(capsys, tiny_model_path):
    code, out, err = run(capsys, "trace", "--raw", "-m", str(tiny_model_path), "--npz", "/dev/full", "the cat")
    assert_one_line_error(code, out, err, "--npz", "not a regular file")
    import stat
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@needs_dev_full
def test_stdout_on_a_full_disk_is_a_clean_error(tiny_model_path):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "llamatrace", "generate", "--raw", "-n", "3",
                               "-m", str(tiny_model_path), "the cat"], stdout=full, stderr=subprocess.PIPE, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "No space left" in err and "Traceback" not in err


def test_atomic_write_on_a_full_disk_leaves_nothing(tmp_path):
    import errno

    from llamatrace.errors import OutputError
    from llamatrace.outputs import write_atomic

    target = tmp_path / "flow.svg"
    target.write_text("old")

    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match="No space left"):
        write_atomic(target, full, "-o")
    assert [p.name for p in tmp_path.iterdir()] == ["flow.svg"] and target.read_text() == "old"
