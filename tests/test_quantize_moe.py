"""``llamatrace quantize`` on mixture-of-experts (qwen3moe, Mixtral, OLMoE, gpt-oss) and Qwen3.5 files
against llama.cpp's ``llama_model_quantize`` (golden file made by ``scripts/make_moe_quantize_golden.py``):
the rules for ``_exps`` tensors (3-D, one matrix per expert), routers, biases, sinks and ``ssm_*``
tensors, ``--tensor-type`` patterns on the experts, a per-expert importance matrix, and ``MXFP4_MOE``;
the same types and the same bytes, file for file.

The bases are tiny random-weight files (``tests/moe_quantize_files.py``, 1-8 MB), checked by sha256.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import run
from moe_quantize_files import ARCHS, golden, make_base, synthetic_imatrix

from llamatrace.gguf.fetch import sha256_file
from llamatrace.gguf.reader import open_gguf
from llamatrace.quantize.rules import Override, file_type, tensor_types
from llamatrace.quantize.writer import ImatrixInfo, quantize_gguf

T = gguf.GGMLQuantizationType
GOLDEN = golden()
CASES = [(arch, name) for arch in ARCHS for name in GOLDEN["archs"][arch]["variants"]]
IMATRIX_FILE = "synthetic.imatrix"      # what make_quantize_golden.quantize records


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("moe")
    out = {}
    for arch in ARCHS:
        out[arch] = make_base(arch, folder / f"{arch}.gguf")
        assert sha256_file(out[arch]) == GOLDEN["archs"][arch]["base_sha256"], f"{arch}: not the golden base"
    return out


def _types(f, entry) -> dict:
    return tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()}, f.metadata,
                        entry["type"], [Override.parse(o) for o in entry["overrides"]], has_imatrix=entry["imatrix"])


@pytest.mark.parametrize("arch,variant", CASES)
def test_types_and_bytes_equal_llama_cpp(bases, arch, variant, tmp_path):
    """Every tensor's type (in llama.cpp's order) and data, and the whole file, are llama.cpp's."""
    entry = GOLDEN["archs"][arch]["variants"][variant]
    out = tmp_path / "out.gguf"
    with open_gguf(bases[arch]) as f:
        types = _types(f, entry)
        assert [[n, t.name] for n, t in types.items()] == [[n, t] for n, t, _ in entry["tensors"]]
        imatrix = synthetic_imatrix(arch) if entry["imatrix"] else None
        quantize_gguf(f, out, types, file_type(entry["type"]), imatrix=imatrix,
                      imatrix_info=imatrix and ImatrixInfo(IMATRIX_FILE, None, len(imatrix), 0))
    r = gguf.GGUFReader(str(out))
    import hashlib
    differing = [f"{t.name} {t.tensor_type.name}" for t, (_, _, sha) in zip(r.tensors, entry["tensors"])
                 if hashlib.sha256(t.data.tobytes()).hexdigest()[:16] != sha]
    assert not differing, f"{len(differing)} tensors differ from llama.cpp's: {differing}"
    assert sha256_file(out) == entry["file_sha256"]


@pytest.mark.parametrize("arch,variant", [("gpt-oss", "MXFP4_MOE"), ("qwen3moe", "Q4_K_M+overrides")])
def test_cli_writes_llama_cpp_file(bases, arch, variant, tmp_path, capsys):
    """Through the command line: ``--type MXFP4_MOE``, and ``--tensor-type`` patterns reaching ``_exps`` tensors."""
    entry = GOLDEN["archs"][arch]["variants"][variant]
    out = tmp_path / "out.gguf"
    args = [a for o in entry["overrides"] for a in ("--tensor-type", o)]
    code, stdout, err = run(capsys, "quantize", bases[arch], out, "--type", entry["type"], *args)
    assert code == 0, err
    assert "pattern matches no tensor" not in err
    assert sha256_file(out) == entry["file_sha256"]


def _rewrite(src: Path, dest: Path, edit) -> Path:
    """``src`` with its tensors passed through ``edit(name, array) -> {name: array}`` (arrays in numpy order)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dest), arch=r.fields["general.architecture"].contents())
    w.kv_data = [{}]
    for key, field in r.fields.items():
        if not key.startswith("GGUF."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        for name, x in edit(t.name, np.array(t.data)).items():
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def test_bad_input(bases, tmp_path, capsys):
    """What llama-quantize cannot do, or refuses, is one error line, exit 2, nothing written: a tensor of 4
    dimensions, an MXFP4 block whose exponent byte would be 255, a per-expert imatrix of another size."""
    from cli_helpers import assert_one_line_error

    def four_d(name, x):
        extra = {"blk.0.ffn_extra.weight": np.ones((2, 2, 3, 256), np.float16)} if name == "blk.0.ffn_norm.weight" else {}
        return {name: x, **extra}

    def tiny_block(name, x):
        if name == "blk.1.ffn_up_exps.weight":
            x = x.astype(np.float32)
            x[2, 5, 64:96] = np.float32(1.5 * 2.0 ** -126)           # floor(log2) - 2 + 127 = -1 -> 255
        return {name: x}

    out = tmp_path / "out.gguf"
    four = _rewrite(bases["qwen3moe"], tmp_path / "four.gguf", four_d)
    tiny = _rewrite(bases["gpt-oss"], tmp_path / "tiny.gguf", tiny_block)
    imatrix = tmp_path / "imatrix.gguf"
    from llamatrace.quantize.imatrix.files import ImatrixMeta, write_imatrix
    entries = {n: (v[: v.size // 2], np.ones(1, np.int64)) for n, v in synthetic_imatrix("olmoe").items()}
    write_imatrix(imatrix, entries, ImatrixMeta(["calibration.txt"], 1, 512))
    cases = [
        (["quantize", four, out, "--type", "Q4_K_M"], "blk.0.ffn_extra.weight"),
        (["quantize", tiny, out, "--type", "MXFP4_MOE"], "exponent 255"),
        (["quantize", bases["olmoe"], out, "--type", "Q4_K_M", "--imatrix", imatrix], "another model"),
    ]
    for args, needle in cases:
        assert_one_line_error(*run(capsys, *args), needle)
        assert not out.exists(), args


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_cli_per_expert_imatrix_file(bases, arch, tmp_path, capsys, monkeypatch):
    """A GGUF imatrix as llama-imatrix writes it for a MoE (``W.in_sum2`` ``{n_in, n_expert}`` and
    ``W.counts`` ``{1, n_expert}``: each expert's own token count, 0 for an expert never chosen) read by
    ``quantize --imatrix``: each expert quantized with its own ``in_sum2 / count`` (1 where the count is 0),
    as llama-quantize's ``load_imatrix`` — llama.cpp's file, sha256 for sha256."""
    from llamatrace.quantize.imatrix.files import ImatrixMeta, read_imatrix, write_imatrix
    entry = GOLDEN["archs"][arch]["variants"]["Q4_K_M+imatrix"]
    n_expert = GOLDEN_N_EXPERT[arch]
    entries = {}
    for name, values in synthetic_imatrix(arch).items():
        n_mat = n_expert if "_exps" in name else 1
        mean = values.reshape(n_mat, -1)
        counts = np.array([2 ** (e % 3) for e in range(n_mat)], np.int64)   # powers of two: sums / counts exact
        if n_mat > 1 and name.startswith("blk.1."):
            counts[-1] = 0
        entries[name] = ((mean * counts[:, None]).astype(np.float32), counts)
    monkeypatch.chdir(tmp_path)
    write_imatrix(Path("calibration.imatrix"), entries, ImatrixMeta(["calibration.txt"], 3, 512))
    sums, counts = read_imatrix(Path("calibration.imatrix"))["blk.0.ffn_down_exps.weight"]
    assert sums.shape == (n_expert, 288) and counts.tolist() == [2 ** (e % 3) for e in range(n_expert)]
    code, _, err = run(capsys, "quantize", bases[arch], "out.gguf", "--type", "Q4_K_M", "--imatrix",
                       "calibration.imatrix")
    assert code == 0, err
    r = gguf.GGUFReader("out.gguf")                     # the metadata names this file: compare the tensors
    assert r.fields["quantize.imatrix.dataset"].contents() == "calibration.txt"
    assert [[t.name, t.tensor_type.name, _sha16(t)] for t in r.tensors] == entry["tensors"]


def _sha16(t) -> str:
    import hashlib
    return hashlib.sha256(t.data.tobytes()).hexdigest()[:16]


GOLDEN_N_EXPERT = {"qwen3moe": 4, "mixtral": 8, "olmoe": 4, "gpt-oss": 4}


def test_gpt_oss_as_published_requantizes_as_llama_cpp(bases, tmp_path):
    """A gpt-oss file with MXFP4 experts (as published): refused without --allow-requantize, and with it
    requantized to Q4_K_M (the experts dequantized from MXFP4 as ggml's ``dequantize_row_mxfp4``) as
    llama.cpp does, sha256 for sha256."""
    from llamatrace.errors import OptionError
    published = tmp_path / "published.gguf"
    with open_gguf(bases["gpt-oss"]) as f:
        quantize_gguf(f, published, _types(f, GOLDEN["archs"]["gpt-oss"]["variants"]["MXFP4_MOE"]), file_type("MXFP4_MOE"))
    entry = GOLDEN["archs"]["gpt-oss"]["requantized_from_MXFP4_MOE"]
    out = tmp_path / "out.gguf"
    with open_gguf(published) as f:
        types = tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()}, f.metadata,
                             "Q4_K_M")
        assert [[n, t.name] for n, t in types.items()] == [[n, t] for n, t, _ in entry["tensors"]]
        with pytest.raises(OptionError, match="already quantized \\(MXFP4\\)"):
            quantize_gguf(f, out, types, file_type("Q4_K_M"))
        quantize_gguf(f, out, types, file_type("Q4_K_M"), allow_requantize=True)
    assert sha256_file(out) == entry["file_sha256"]
