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
