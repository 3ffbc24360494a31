"""``llamatrace quantize`` against llama.cpp's ``llama_model_quantize`` (golden file made by
``scripts/make_quantize_golden.py``): the same tensor types, the same bytes, the same metadata.

The F16 base is rebuilt from the cached default model (``tests/quantize_files.py``) and checked
by sha256, so both sides quantize the same bytes. Costs (2 shared cores, loaded): the base ~5 s;
the rules of every variant (all 272 tensors, no quantizing) < 1 s; the bytes of a sample of
tensors per variant (every tensor of blocks 0 and 29 and the embedding: 19 of 272) ~1-3 s each;
whole files through the CLI for Q4_K_M and Q4_0 with imatrix ~15 s each. Set
``LLAMATRACE_QUANTIZE_ALL=1`` to compare every tensor of every variant (~3-5 min).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run
from quantize_files import golden, make_f16_base, synthetic_imatrix

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
    return tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()}, f.metadata,
                        entry["type"], [Override.parse(o) for o in entry["overrides"]], has_imatrix=entry["imatrix"])


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
    cases = [
        (["quantize", smollm2_path, out, "--type", "Q4_K_M"], "--allow-requantize"),      # a Q4_1 base
        (["quantize", base, out, "--type", "Q7_K"], "--type"),
        (["quantize", base, out, "--type", "Q4_K_M", "--tensor-type", "attn_v"], "PATTERN=TYPE"),
        (["quantize", base, out, "--type", "Q4_K_M", "--tensor-type", "attn_v=q9_k"], "q9_k"),
        (["quantize", base, out, "--type", "Q4_K_M", "--tensor-type", "attn_(v=q8_0"], "regular expression"),
        (["quantize", base, tmp_path / "missing" / "out.gguf", "--type", "Q4_K_M"], "does not exist"),
        (["quantize", base, base, "--type", "Q4_K_M"], "base model itself"),
    ]
    for args, needle in cases:
        assert_one_line_error(*run(capsys, *args), needle)
        assert not out.exists() and list(tmp_path.iterdir()) == [], args


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
