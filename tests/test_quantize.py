"""``llamatrace quantize`` against llama.cpp's ``llama_model_quantize`` (golden file made by
``scripts/make_quantize_golden.py``): the same tensor types, the same bytes, the same metadata.

The F16 base is rebuilt from the cached default model (``tests/quantize_files.py``) and checked
by sha256, so both sides quantize the same bytes. Costs measured on 2 cores under a load of ~14
(stress-ng and other sessions; warm Numba cache): the base ~5-10 s; the rules of all 30 variants
(272 tensors each, no quantizing) ~1 s in all; the bytes of a sample per variant (every tensor of
blocks 0 and 29 and the embedding: 19 of 272) 1-10 s each (~1 min in all); three whole files 17-30 s
each; the imatrix file through the CLI ~20-30 s; loading the Q8_0 file ~10 s (3 min with a cold
Numba cache); the 27 awkward files (a 2-layer model) <1 s each, 3 of them again through the CLI
(~5 s each: start-up). ``LLAMATRACE_QUANTIZE_ALL=1`` compares every tensor of every variant (9 min there).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run
from quantize_files import golden, make_awkward_base, make_f16_base, synthetic_imatrix

from llamatrace.errors import OptionError
from llamatrace.gguf.fetch import sha256_file
from llamatrace.gguf.reader import open_gguf
from llamatrace.quantize.rules import Override, file_type, tensor_types
from llamatrace.quantize.writer import ImatrixInfo, convert_tensor, quantize_gguf

T = gguf.GGMLQuantizationType
GOLDEN = golden()
VARIANTS = list(GOLDEN["files"])
SAMPLE = ("token_embd.weight", "blk.0.", "blk.29.")
ALL = os.environ.get("LLAMATRACE_QUANTIZE_ALL", "") not in ("", "0")


@pytest.fixture(scope="module")
def base(smollm2_path, tmp_path_factory) -> Path:
    path = make_f16_base(smollm2_path, tmp_path_factory.mktemp("quantize") / "base-f16.gguf")
    assert sha256_file(path) == GOLDEN["base_sha256"], "the F16 base is not the one the golden files were made from"
    return path


def test_f16_from_q4_1_equals_llama_cpp(base):
    """The base is also what llama.cpp writes for ``llama-quantize --allow-requantize Q4_1.gguf OUT F16``:
    our Q4_1 dequantization and float16 rounding are ggml's, byte for byte."""
    assert sha256_file(base) == GOLDEN["llama_f16_from_q4_1_sha256"]


@pytest.fixture(scope="module")
def imatrix(base) -> dict[str, np.ndarray]:
    return synthetic_imatrix(base)


def _expected(entry) -> list[list[str]]:
    """[[name, type], …] of a golden file, in its order."""
    return [[n, t] for n, t in zip(GOLDEN["tensors"], entry["types"].split())]


def _sha16(entry, name: str, type_name: str) -> str | None:
    """llama.cpp's sha256 (16 hex digits) of tensor ``name``'s data in a golden file (None: F32, copied)."""
    return GOLDEN["hashes"].get(type_name + ("+imatrix" if entry["imatrix"] else ""), {}).get(name)


def _types(f, entry) -> dict:
    """Our rules for a golden variant: its file type, overrides, imatrix and llama-quantize's other options."""
    options = entry.get("options", {})
    return tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()}, f.metadata,
                        entry["type"], [Override.parse(o) for o in entry["overrides"]], has_imatrix=entry["imatrix"],
                        pure=options.get("pure", False), leave_output=options.get("leave_output_tensor", False),
                        output_type=options.get("output_tensor_type") and T[options["output_tensor_type"].upper()],
                        token_embd_type=options.get("token_embedding_type") and
                        T[options["token_embedding_type"].upper()])


def _cli_options(entry) -> list[str]:
    """The command-line options of a golden variant (its overrides as --tensor-type)."""
    options = entry.get("options", {})
    args = [a for o in entry["overrides"] for a in ("--tensor-type", o)]
    for key in ("output_tensor_type", "token_embedding_type"):
        if key in options:
            args += ["--" + key.replace("_", "-"), options[key]]
    return args + [f"--{key.replace('_', '-')}" for key in ("pure", "leave_output_tensor") if options.get(key)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_types_and_order_equal_llama_cpp(base, variant):
    """llama.cpp's rules (mix, use_more_bits, fallbacks, tied embedding, overrides) for all 272 tensors."""
    entry = GOLDEN["files"][variant]
    with open_gguf(base) as f:
        ours = [[n, t.name] for n, t in _types(f, entry).items()]
    assert ours == _expected(entry)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_bytes_equal_llama_cpp(base, imatrix, variant):
    """The data of a sample of tensors (every tensor with ALL) is llama.cpp's, byte for byte."""
    entry = GOLDEN["files"][variant]
    differing = []
    with open_gguf(base) as f:
        for name, type_name in _expected(entry):
            sha = _sha16(entry, name, type_name)
            if sha is None or (not ALL and not name.startswith(SAMPLE)):
                continue
            t = f.tensors[name]
            dst = T[type_name]
            data = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8) if dst == t.tensor_type else \
                convert_tensor(t, dst, imatrix.get(name) if entry["imatrix"] else None)
            if hashlib.sha256(data.tobytes()).hexdigest()[:16] != sha:
                differing.append(f"{name} {type_name}")
            del data
    assert not differing, f"{len(differing)} tensors differ from llama.cpp's: {differing}"


@pytest.mark.parametrize("variant", ["Q4_K_M", "Q4_0+imatrix"])
def test_whole_file_equals_llama_cpp(base, imatrix, variant, tmp_path, capsys):
    """The file the CLI (or, with an imatrix, the library) writes is llama.cpp's file, sha256 for sha256:
    header, metadata in order, tensor infos, padding and data."""
    entry = GOLDEN["files"][variant]
    out = tmp_path / "out.gguf"
    if entry["imatrix"]:
        with open_gguf(base) as f:
            quantize_gguf(f, out, _types(f, entry), file_type(entry["type"]), imatrix=imatrix,
                          imatrix_info=ImatrixInfo(GOLDEN["imatrix_file"], None, len(imatrix), 0))
    else:
        code, stdout, err = run(capsys, "quantize", base, out, "--type", entry["type"])
        assert code == 0, err
        assert f"{out}: Q4_K_M, 272 tensors" in stdout
    assert sha256_file(out) == entry["file_sha256"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"]          # no temporary file left


def test_quantized_file_loads_and_keeps_the_metadata(base, tmp_path, capsys):
    """A Q8_0 file: llamatrace loads it and answers as from the base; the metadata llama.cpp changes
    (file type, quantization version) is what it writes, the rest the base's, in order."""
    from llamatrace.model.llama import Llama
    entry = GOLDEN["files"]["Q8_0"]
    out = tmp_path / "q8.gguf"
    code, _, err = run(capsys, "quantize", base, out, "--type", "q8_0", "--json")
    assert code == 0, err
    with open_gguf(out) as f:
        assert f.keys() == GOLDEN["base_keys"][:entry["keys_from"]] + entry["keys_after"]
        assert {k: f.field(k) for k in entry["changed"]} == entry["changed"] == {"general.file_type": 7}
    ids = [504, 3458, 282, 4649, 314]           # "The capital of France is"
    q8, f16 = Llama.load(out), Llama.load(base)
    assert list(q8.generate(ids, max_tokens=4)) == list(f16.generate(ids, max_tokens=4))


def test_bad_input(base, smollm2_path, tmp_path, capsys):
    """Each bad input: one error line, exit 2, nothing at OUT."""
    out = tmp_path / "out.gguf"
    bad_listing = tmp_path / "bad-types.txt"
    bad_listing.write_text("attn_v=q8_0\n\nattn_q=q6_k ffn_up=q9_k\n", encoding="utf-8")
    cases = [
        (["quantize", smollm2_path, out, "--type", "Q4_K_M"], "--allow-requantize"),      # a Q4_1 base
        (["quantize", base, out, "--type", "Q7_K"], "--type"),
        (["quantize", base, out, "--type", "Q4_K_M", "--tensor-type", "attn_v"], "PATTERN=TYPE"),
        (["quantize", base, out, "--type", "Q4_K_M", "--tensor-type", "attn_v=q9_k"], "q9_k"),
        (["quantize", base, out, "--type", "Q4_K_M", "--tensor-type", "attn_(v=q8_0"], "regular expression"),
        (["quantize", base, tmp_path / "missing" / "out.gguf", "--type", "Q4_K_M"], "does not exist"),
        (["quantize", base, base, "--type", "Q4_K_M"], "base model itself"),
        (["quantize", base, out, "--type", "Q4_K_M", "--output-tensor-type", "q9_k"], "--output-tensor-type"),
        (["quantize", base, out, "--type", "Q4_K_M", "--token-embedding-type", "iq4_nl"], "--token-embedding-type"),
        (["quantize", base, out, "--type", "Q4_K_M", "--token-embedding-type", "q4_k"], "not a multiple of"),
        (["quantize", base, out, "--type", "Q4_K_M", "--tensor-type-file", tmp_path / "nothing.txt"],
         "--tensor-type-file"),
        (["quantize", base, out, "--type", "Q4_K_M", "--tensor-type-file", bad_listing], "line 3"),
        (["quantize", base, out, "--type", "Q2_K_S"], "--imatrix"),
        (["quantize", base, out, "--type", "Q4_K_M", "--pure", "-f", bad_listing], "-f"),
    ]
    for args, needle in cases:
        assert_one_line_error(*run(capsys, *args), needle)
        assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [bad_listing.name], args
    code, _, err = run(capsys, "quantize", base, out, "--type", "Q4_K_M", "--tensor-type-file", bad_listing)
    assert "line 3: 'ffn_up=q9_k'" in err


def test_unwritable_output_directory(base, tmp_path, capsys):
    """A folder no file can be made in (/proc, also for root; a read-only folder otherwise)."""
    folder = Path("/proc")
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
    try:
        assert_one_line_error(*run(capsys, "quantize", base, folder / "out.gguf", "--type", "Q8_0"), "not writable")
    finally:
        if folder != Path("/proc"):
            folder.chmod(0o755)
    assert not (folder / "out.gguf").exists()


def test_imatrix_of_another_model_is_refused(base, tmp_path):
    """An imatrix whose rows are another width (another model's): llama-quantize's error, nothing written."""
    from llamatrace.errors import OptionError
    out = tmp_path / "out.gguf"
    with open_gguf(base) as f:
        types = tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()},
                             f.metadata, "Q4_0", has_imatrix=True)
        with pytest.raises(OptionError, match="another model"):
            quantize_gguf(f, out, types, file_type("Q4_0"), imatrix={"blk.0.attn_q.weight": np.ones(2048, np.float32)})
    assert list(tmp_path.iterdir()) == []


def test_pattern_matching_nothing_is_a_warning(base, tmp_path, capsys):
    """A --tensor-type pattern that names no tensor: a warning line, the file written."""
    out = tmp_path / "out.gguf"
    code, _, err = run(capsys, "quantize", base, out, "--type", "Q8_0", "--tensor-type", "attn_zz=q4_0")
    assert code == 0, err
    assert [ln for ln in err.splitlines() if ln.startswith("warning:")] == [
        "warning: --tensor-type attn_zz=q4_0: the pattern matches no tensor of base-f16.gguf"]
    assert out.exists()


def test_mxfp4_moe_on_a_dense_model_says_it_is_q8_0(base, tmp_path, capsys):
    """MXFP4_MOE on a model without experts: llama-quantize's Q8_0 tensors under MXFP4_MOE's name, said."""
    mx, q8 = tmp_path / "mx.gguf", tmp_path / "q8.gguf"
    code, _, err = run(capsys, "quantize", base, mx, "--type", "MXFP4_MOE")
    assert code == 0, err
    assert "warning: base-f16.gguf has no expert tensors: MXFP4_MOE makes its matrices Q8_0" in err
    assert run(capsys, "quantize", base, q8, "--type", "Q8_0")[0] == 0
    import gguf
    a, b = gguf.GGUFReader(mx), gguf.GGUFReader(q8)
    assert [(t.name, t.tensor_type) for t in a.tensors] == [(t.name, t.tensor_type) for t in b.tensors]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a.tensors, b.tensors))


def test_imatrix_file_through_the_cli_equals_llama_cpp(base, imatrix, tmp_path, capsys):
    """The synthetic imatrix written as llama.cpp's GGUF imatrix (sums = 4 × value, counts 4: the
    division is exact) and read by ``--imatrix``: every tensor's data is llama.cpp's, and the
    metadata records the file, its dataset, entries and chunks as llama-quantize does."""
    from llamatrace.quantize.imatrix.files import ImatrixMeta, write_imatrix
    entry = GOLDEN["files"]["Q4_0+imatrix"]
    path = tmp_path / "synthetic.gguf"
    write_imatrix(path, {n: (v * np.float32(4), np.array([4])) for n, v in imatrix.items()},
                  ImatrixMeta(["calibration.txt"], 3, 256))
    out = tmp_path / "out.gguf"
    code, _, err = run(capsys, "quantize", base, out, "--type", "Q4_0", "--imatrix", path)
    assert code == 0, err
    with open_gguf(out) as f:
        ours = [[n, t.tensor_type.name] for n, t in f.tensors.items()]
        assert ours == _expected(entry)
        differing = [n for n, type_name in ours if _sha16(entry, n, type_name) not in (
            None, hashlib.sha256(np.ascontiguousarray(f.tensors[n].data).tobytes()).hexdigest()[:16])]
        assert not differing, differing
        assert {k: f.field(k) for k in f.keys() if k.startswith("quantize.")} == {
            "quantize.imatrix.file": str(path), "quantize.imatrix.dataset": "calibration.txt",
            "quantize.imatrix.entries_count": len(imatrix), "quantize.imatrix.chunks_count": 3}


@pytest.fixture(scope="module")
def awkward(tmp_path_factory) -> Path:
    path = make_awkward_base(tmp_path_factory.mktemp("awkward") / "awkward-f32.gguf")
    assert sha256_file(path) == GOLDEN["awkward"]["base_sha256"], "not the awkward file the golden was made from"
    return path


@pytest.mark.parametrize("variant", list(GOLDEN["awkward"]["files"]))
def test_awkward_rows_give_llama_cpps_file(awkward, variant, tmp_path):
    """A random F32 llama with an all-zero block, a huge value, denormals and a constant row in every
    matrix, rows of 256 and 288, an untied output: each file type (with an imatrix, with
    llama-quantize's options) is llama.cpp's file, sha256 for sha256."""
    entry = GOLDEN["awkward"]["variants"][variant]
    imatrix = synthetic_imatrix(awkward) if entry["imatrix"] else None
    out = tmp_path / "out.gguf"
    with open_gguf(awkward) as f:
        quantize_gguf(f, out, _types(f, entry), file_type(entry["type"]), imatrix=imatrix,
                      imatrix_info=None if imatrix is None else ImatrixInfo(GOLDEN["imatrix_file"], None, len(imatrix), 0))
    assert sha256_file(out) == GOLDEN["awkward"]["files"][variant]


@pytest.mark.parametrize("variant", [v for v, e in GOLDEN["awkward"]["variants"].items() if e["options"]])
def test_options_through_the_cli_give_llama_cpps_file(awkward, variant, tmp_path, capsys):
    """--output-tensor-type, --token-embedding-type, --leave-output-tensor and --pure as llama-quantize's
    (on an untied output.weight: each option before the --tensor-type patterns that also name it)."""
    entry = GOLDEN["awkward"]["variants"][variant]
    out = tmp_path / "out.gguf"
    code, _, err = run(capsys, "quantize", awkward, out, "--type", entry["type"], *_cli_options(entry))
    assert code == 0, err
    assert sha256_file(out) == GOLDEN["awkward"]["files"][variant]


def test_tensor_type_file_gives_llama_cpps_file(base, tmp_path, capsys):
    """--tensor-type-file: the patterns of a golden variant split over lines and spaces, with
    --token-embedding-type: llama.cpp's file, sha256 for sha256."""
    entry = GOLDEN["files"]["Q4_K_M+embd_q4_0+overrides"]
    patterns = entry["overrides"]
    listing = tmp_path / "types.txt"
    listing.write_text(f"{patterns[0]}  {patterns[1]}\n\n\t{' '.join(patterns[2:])}\n", encoding="utf-8")
    out = tmp_path / "out.gguf"
    code, _, err = run(capsys, "quantize", base, out, "--type", entry["type"], "--tensor-type-file", listing,
                       "--token-embedding-type", entry["options"]["token_embedding_type"])
    assert code == 0, err
    assert sha256_file(out) == entry["file_sha256"]


@pytest.mark.parametrize("file_first", [True, False])
def test_tensor_type_file_and_options_keep_the_command_line_order(awkward, tmp_path, capsys, file_first):
    """llama-quantize appends --tensor-type and --tensor-type-file patterns in the order given and the
    first match wins: the same pattern with two types takes the type given first."""
    listing = tmp_path / "types.txt"
    listing.write_text("attn_v=q8_0\n", encoding="utf-8")
    options = [["--tensor-type-file", listing], ["--tensor-type", "attn_v=q4_0"]]
    args = [a for pair in (options if file_first else options[::-1]) for a in pair]
    code, stdout, err = run(capsys, "quantize", awkward, tmp_path / "out.gguf", "--type", "Q4_K_M", "--json", *args)
    assert code == 0, err
    types = {t["name"]: t["type"] for t in json.loads(stdout)["tensors"]}
    assert {types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]} == {"Q8_0" if file_first else "Q4_0"}


def test_file_type_names_and_numbers_are_llama_cpps():
    """Each golden variant's ``general.file_type`` (llama.cpp's ``llama_ftype``) is our file type's
    number, and that number names the same file type (llama-quantize takes either)."""
    for entry in GOLDEN["files"].values():
        number = entry["changed"].get("general.file_type", 1)          # unchanged: the F16 base's own 1
        ftype = file_type(entry["type"])
        assert (ftype.ftype, file_type(str(number))) == (number, ftype), entry["type"]


@pytest.mark.parametrize("key", ["²", "Q9_K", "99", ""])
def test_a_file_type_we_do_not_write_is_an_option_error(key):
    with pytest.raises(OptionError, match="is not a file type"):          # '²' was int()'s ValueError
        file_type(key)
