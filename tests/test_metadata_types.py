"""Metadata of the wrong GGUF type, and what a file says echoed at a readable length.

Every key llamatrace reads has its type declared in ``llamatrace.gguf.metadata.KEY_TYPES`` and
checked when the file opens: one ``error:`` line naming the key, the type found and the type
expected (issue 47).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import pytest
from arch_files import write_arch_file
from cli_helpers import assert_one_line_error, one_error_line, run
from gguf_factory import rewrite_metadata, write_tiny_llama

import llamatrace

V = gguf.GGUFValueType


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def base_file(request, tmp_path_factory):
    """A tiny file of each family whose keys the cases below change."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return request.param, write_tiny_llama(root / "llama.gguf")
    return request.param, write_arch_file(root / "gemma3.gguf", "gemma3")


# key suffix, stored value and type, what the line must say of the type found and expected
WRONG = [
    ("attention.head_count", ("4", V.STRING), "string ('4')", "expected an integer"),
    ("rope.freq_base", ("10000", V.STRING), "string ('10000')", "expected a float"),
    ("attention.layer_norm_rms_epsilon", ("1e-6", V.STRING), "string ('1e-6')", "expected a float"),
    ("block_count", (2.0, V.FLOAT32), "float32 (2.0)", "expected an integer"),
    ("context_length", (True, V.BOOL), "bool (True)", "expected an integer"),
    ("rope.freq_base", ([1.0, 2.0], V.ARRAY, V.FLOAT32), "array of float32", "expected a float"),
]


@pytest.mark.parametrize("suffix, stored, found, expected", WRONG, ids=[f"{w[0]}-{w[2].split()[0]}" for w in WRONG])
def test_a_key_of_the_wrong_type_is_one_error_line(capsys, tmp_path, base_file, suffix, stored, found, expected):
    arch, base = base_file
    bad = rewrite_metadata(base, tmp_path / "bad.gguf", {f"{arch}.{suffix}": stored})
    for command in (["generate", "-m", bad, "hi"], ["info", "-m", bad]):
        assert_one_line_error(*run(capsys, *command), "bad.gguf", f"'{arch}.{suffix}'", f"has type {found}", expected)


def test_a_tokenizer_key_of_the_wrong_type_is_one_error_line(capsys, tmp_path):
    base = write_tiny_llama(tmp_path / "t.gguf")
    for key, stored, found in (("tokenizer.ggml.bos_token_id", ("0", V.STRING), "string ('0')"),
                               ("tokenizer.ggml.add_bos_token", (1, V.UINT8), "uint8 (1)"),
                               ("tokenizer.ggml.merges", ([1, 2], V.ARRAY, V.INT32), "array of int32")):
        bad = rewrite_metadata(base, tmp_path / "bad.gguf", {key: stored})
        assert_one_line_error(*run(capsys, "generate", "-m", bad, "hi"), f"'{key}'", f"has type {found}")


def test_any_integer_kind_and_both_float_kinds_are_taken(capsys, tmp_path):
    base = write_tiny_llama(tmp_path / "t.gguf")
    ok = rewrite_metadata(base, tmp_path / "ok.gguf", {"llama.attention.head_count": (4, V.UINT8),
                                                       "llama.block_count": (2, V.INT64),
                                                       "llama.rope.freq_base": (10000.0, V.FLOAT64)})
    code, out, err = run(capsys, "generate", "--raw", "-n", "1", "-m", ok, "hi", "--json")
    assert code == 0, err
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    with open_gguf(ok) as f:
        c = ModelConfig.from_gguf(f)
    assert (c.n_heads, c.n_layers, c.rope_theta) == (4, 2, 10000.0)
    with open_gguf(base) as f:                     # the same values in the writer's kinds: the same text
        assert ModelConfig.from_gguf(f) == c
    same = run(capsys, "generate", "--raw", "-n", "1", "-m", base, "hi", "--json")[1]
    assert json.loads(same)["ids"] == json.loads(out)["ids"]


def test_per_layer_head_counts_are_taken_when_every_layer_agrees(capsys, tmp_path):
    base = write_tiny_llama(tmp_path / "t.gguf")            # 2 layers, 2 kv heads
    same = rewrite_metadata(base, tmp_path / "same.gguf",
                            {"llama.attention.head_count_kv": ([2, 2], V.ARRAY, V.UINT32)})
    assert run(capsys, "generate", "--raw", "-n", "1", "-m", same, "hi")[0] == 0
    differ = rewrite_metadata(base, tmp_path / "differ.gguf",
                              {"llama.attention.head_count_kv": ([2, 1], V.ARRAY, V.UINT32)})
    assert_one_line_error(*run(capsys, "generate", "-m", differ, "hi"), "head_count_kv", "differs between layers")
    strings = rewrite_metadata(base, tmp_path / "strings.gguf",
                               {"llama.attention.head_count_kv": (["2", "2"], V.ARRAY, V.STRING)})
    assert_one_line_error(*run(capsys, "generate", "-m", strings, "hi"), "head_count_kv", "array of string",
                          "an integer or an array of integers")


def test_a_10_kb_architecture_name_is_cut_in_the_error_line(capsys, tmp_path):
    base = write_tiny_llama(tmp_path / "t.gguf")
    bad = rewrite_metadata(base, tmp_path / "long.gguf", {"general.architecture": ("x" * 10240,)})
    code, out, err = run(capsys, "generate", "-m", bad, "hi")
    assert_one_line_error(code, out, err, "architecture 'xxxx", "…' (10,240 characters)", "not supported")
    assert len(one_error_line(err)) < 300
    code, out, err = run(capsys, "info", "-m", bad)        # info shows what it can, and a note
    assert code == 0 and "(10,240 characters)" in err and max(map(len, err.splitlines())) < 300


def test_a_long_string_value_of_the_wrong_type_is_cut(capsys, tmp_path):
    base = write_tiny_llama(tmp_path / "t.gguf")
    bad = rewrite_metadata(base, tmp_path / "bad.gguf", {"llama.block_count": ("9" * 5000, V.STRING)})
    code, out, err = run(capsys, "generate", "-m", bad, "hi")
    assert_one_line_error(code, out, err, "(5,000 characters)", "expected an integer")
    assert len(one_error_line(err)) < 400


def test_shown_quotes_and_cuts_what_a_file_says():
    from llamatrace.errors import shown
    assert shown("llama") == "'llama'"
    assert shown("a\nb") == "'a\\nb'"                       # a line break cannot break the one line
    assert shown("y" * 81) == "'" + "y" * 80 + "…' (81 characters)"
    assert shown(list(range(100))).endswith("… (390 characters)")
    assert shown(7) == "7"


# Keys the package writes (quantize) or shows whatever their type (info), but never reads as a value.
NOT_READ = {"general.name", "general.file_type", "general.quantization_version", "general.alignment"}


def test_every_metadata_key_the_package_reads_has_a_declared_type():
    # a new key read anywhere (f"{arch}.rope.scaling.factor", need("…"), "tokenizer.…") needs a
    # row in KEY_TYPES, or it would be read unchecked
    from llamatrace.gguf.metadata import KEY_TYPES
    root = Path(llamatrace.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        found |= {f"{{arch}}.{k}" for k in re.findall(r'f"\{arch\}\.([a-z_.]+)"', text)}
        found |= {k for k in re.findall(r'"((?:general|tokenizer|imatrix)\.[a-z_]+(?:\.[a-z_]+)*)"', text)
                  if not k.endswith((".py", ".gguf"))}                     # file names, not keys
        if path.name in ("config.py", "rules.py"):   # {arch}.KEY read as need("KEY") / first("KEY", …) / number("KEY", …)
            found |= {f"{{arch}}.{k}" for k in re.findall(r'\b(?:need|as_int|first|number)\("([a-z_.]+)"', text)}
    assert "{arch}.rope.freq_base" in found and "{arch}.attention.head_count" in found   # the scan works
    assert sorted(found - NOT_READ - set(KEY_TYPES)) == []
