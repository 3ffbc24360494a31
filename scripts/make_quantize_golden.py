"""Record what llama.cpp's quantizer writes for every file type: ``tests/golden/quantize.json``.

Run in the golden venv (llama-cpp-python 0.3.36, whose ``llama_model_quantize`` is
``llama-quantize``'s own function; a tool for making test data, never a llamatrace dependency)::

    PYTHONPATH=. /work/venv-golden/bin/python scripts/make_quantize_golden.py

It makes the F16 base from the cached default model (``tests/quantize_files.py``:
``make_f16_base``; the same bytes the tests rebuild), quantizes it with ``llama_model_quantize``
(2 threads) to each file type of :data:`VARIANTS` — plain, with ``--tensor-type`` overrides, with
an importance matrix (``synthetic_imatrix``, passed as llama-quantize passes a loaded one:
per-column values), and with llama-quantize's other options (``--pure``, ``--output-tensor-type``,
``--token-embedding-type``, ``--leave-output-tensor``: the fields of ``llama_model_quantize_params``
they set) — and records, small enough to commit: per tensor its name, type and the
sha256 of its data; the metadata keys in order and the values that differ from the base; the
sha256 of the whole file. No model file is committed.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import gguf
import llama_cpp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from quantize_files import GOLDEN, make_awkward_base, make_f16_base, synthetic_imatrix  # noqa: E402

from llamatrace.gguf.fetch import sha256_file  # noqa: E402

SOURCE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
              "Q5_K_S", "Q5_K_M", "Q6_K")
WITH_IMATRIX = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q2_K_S", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")
OVERRIDES = ("attn_v=q8_0", r"blk\.[0-3]\.ffn_down=q6_k", "ffn_up=q4_k", "attn_q=f16")


def variant(ftype: str, overrides=(), imatrix: bool = False, **options) -> tuple:
    """(llama-quantize's file type, --tensor-type overrides, with the synthetic imatrix, other options:
    ``output_tensor_type`` / ``token_embedding_type`` (ggml type names), ``leave_output_tensor``, ``pure``)."""
    return ftype, tuple(overrides), imatrix, options


VARIANTS = {
    **{name: variant(name) for name in FILE_TYPES},
    "Q4_K_M+overrides": variant("Q4_K_M", OVERRIDES),
    **{f"{n}+imatrix": variant(n, imatrix=True) for n in WITH_IMATRIX},
    # SmolLM2's token embedding is tied (no output.weight): --output-tensor-type reaches it through the
    # mix (then the 576-wide rows' fallback), --token-embedding-type before any pattern, --pure skips the mix
    "Q4_K_M+pure": variant("Q4_K_M", pure=True),
    "Q3_K_S+output_q4_k": variant("Q3_K_S", output_tensor_type="q4_k"),
    "Q4_K_M+embd_q4_0+overrides": variant("Q4_K_M", ("token_embd=q8_0", *OVERRIDES), token_embedding_type="q4_0"),
    "Q5_K_M+pure+output_q8_0": variant("Q5_K_M", pure=True, output_tensor_type="q8_0"),
    "F16+embd_q8_0": variant("F16", token_embedding_type="q8_0"),
}
AWKWARD = {
    **{name: variant(name) for name in FILE_TYPES},
    **{f"{n}+imatrix": variant(n, imatrix=True) for n in WITH_IMATRIX},
    # an untied output.weight: the options decide it before any pattern, --leave-output-tensor before them
    "Q4_K_M+leave_output+output_q8_0": variant("Q4_K_M", leave_output_tensor=True, output_tensor_type="q8_0"),
    "Q3_K_M+output_q4_k+embd_q5_k+overrides": variant("Q3_K_M", ("output=q8_0", "token_embd=q8_0", "attn_v=q5_0"),
                                                      output_tensor_type="q4_k", token_embedding_type="q5_k"),
    "Q6_K+pure+output_q8_0": variant("Q6_K", pure=True, output_tensor_type="q8_0"),
}
"""The file types and options on ``make_awkward_base``'s file (all-zero blocks, a huge value, denormals,
constant rows, rows of 256 and 288): each whole file's sha256 is recorded."""
IMATRIX_FILE = "synthetic.imatrix"
"""What ``quantize.imatrix.file`` records for the imatrix variants (both sides pass this string)."""


def ftype_of(name: str) -> int:
    return getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")


def quantize(base: Path, dest: Path, ftype: str, overrides, imatrix: dict | None, options: dict) -> None:
    """``llama-quantize [--tensor-type …] [--imatrix …] [--pure] [--leave-output-tensor]
    [--output-tensor-type T] [--token-embedding-type T] base dest ftype 2``, through its library."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_of(ftype)
    params.nthread = 2
    params.pure = bool(options.get("pure"))
    params.quantize_output_tensor = not options.get("leave_output_tensor")
    for key in ("output_tensor_type", "token_embedding_type"):
        if key in options:
            setattr(params, key, int(gguf.GGMLQuantizationType[options[key].upper()]))
    keep = []
    if overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for i, text in enumerate(overrides):
            pattern, type_name = text.split("=")
            name = pattern.lower().encode()
            keep.append(name)
            arr[i].pattern = name
            arr[i].type = int(gguf.GGMLQuantizationType[type_name.upper()])
        arr[len(overrides)].pattern = None
        params.tt_overrides = arr
    if imatrix is not None:
        arr = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            buf = (ctypes.c_float * len(values))(*values.tolist())
            keep += [name.encode(), buf]
            arr[i].name, arr[i].data, arr[i].size = keep[-2], ctypes.cast(buf, ctypes.POINTER(ctypes.c_float)), len(values)
        arr[len(imatrix)].name = None
        params.imatrix = arr
        kvs = (llama_cpp.llama_model_kv_override * 3)()      # what llama-quantize adds (no dataset, no chunk count)
        kvs[0].key = b"quantize.imatrix.file"
        kvs[0].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
        kvs[0].value.val_str = IMATRIX_FILE.encode()
        kvs[1].key = b"quantize.imatrix.entries_count"
        kvs[1].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
        kvs[1].value.val_i64 = len(imatrix)
        kvs[2].key = b""
        params.kv_overrides = kvs
        keep.append(kvs)
    rc = llama_cpp.llama_model_quantize(str(base).encode(), str(dest).encode(), params)
    if rc != 0:
        sys.exit(f"error: llama_model_quantize({ftype}) returned {rc}")


def describe(path: Path) -> dict:
    """The file's sha256, its tensors' names and types and the sha256 of each one's data, its metadata."""
    r = gguf.GGUFReader(str(path))
    return {
        "file_sha256": sha256_file(path),
        "tensors": [(t.name, t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()) for t in r.tensors],
        "kv": {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")},
    }


def compact(base: dict, files: dict[str, tuple[tuple, dict]]) -> dict:
    """The committed form: tensor names once (llama.cpp's order, the same in every file); per file its
    types (space-separated, in that order), the metadata keys after the base's own and the values that
    differ from the base's; the first 16 hex digits of each tensor's data sha256 once per (type,
    with or without imatrix) — F32 tensors are the base's, copied."""
    names = [n for n, _, _ in next(iter(files.values()))[1]["tensors"]]
    base_keys = list(base["kv"])
    hashes: dict[str, dict[str, str]] = {}
    out_files = {}
    for name_, ((ftype, overrides, with_imatrix, options), d) in files.items():
        assert [n for n, _, _ in d["tensors"]] == names, name_
        keys = list(d["kv"])
        common = next((i for i, (a, b) in enumerate(zip(keys, base_keys)) if a != b), min(len(keys), len(base_keys)))
        for name, type_name, sha in d["tensors"]:
            if type_name != "F32":
                table = hashes.setdefault(type_name + ("+imatrix" if with_imatrix else ""), {})
                assert table.setdefault(name, sha[:16]) == sha[:16], (name_, name)
        out_files[name_] = {
            "type": ftype, "overrides": list(overrides), "imatrix": with_imatrix, "options": options,
            "file_sha256": d["file_sha256"],
            "types": " ".join(t for _, t, _ in d["tensors"]),
            "keys_from": common, "keys_after": keys[common:],
            "changed": {k: v for k, v in d["kv"].items() if k not in base["kv"] or base["kv"][k] != v},
        }
    return {"tensors": names, "base_keys": base_keys, "files": out_files, "hashes": hashes}


def main() -> None:
    root = os.environ.get("LLAMATRACE_CACHE_DIR")           # llamatrace's cache (platformdirs is not here)
    src = (Path(root) if root else Path.home() / ".cache" / "llamatrace") / "models" / SOURCE
    if not src.exists():
        sys.exit(f"error: {src} not found: run `llamatrace pull` first")
    with tempfile.TemporaryDirectory() as tmp:
        base = make_f16_base(src, Path(tmp) / "base-f16.gguf")
        imatrix = synthetic_imatrix(base)
        out = {"llama_cpp_python": llama_cpp.__version__, "source": SOURCE, "source_sha256": sha256_file(src),
               "base_sha256": sha256_file(base), "imatrix_file": IMATRIX_FILE}
        # llama.cpp's own F16 conversion of the Q4_1 file, for the record: equal to our base?
        theirs = Path(tmp) / "llama-f16.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.allow_requantize = llama_cpp.LLAMA_FTYPE_MOSTLY_F16, 2, True
        assert llama_cpp.llama_model_quantize(str(src).encode(), str(theirs).encode(), params) == 0
        out["llama_f16_from_q4_1_sha256"] = sha256_file(theirs)
        files = {}
        for name, (ftype, overrides, with_imatrix, options) in VARIANTS.items():
            dest = Path(tmp) / f"{name}.gguf"
            quantize(base, dest, ftype, overrides, imatrix if with_imatrix else None, options)
            files[name] = ((ftype, overrides, with_imatrix, options), describe(dest))
            dest.unlink()
            print(name, files[name][1]["file_sha256"], flush=True)
        out.update(compact(describe(base), files))
        awkward = make_awkward_base(Path(tmp) / "awkward-f32.gguf")
        awkward_imatrix = synthetic_imatrix(awkward)
        out["awkward"] = {"base_sha256": sha256_file(awkward), "files": {}, "variants": {}}
        for name, (ftype, overrides, with_imatrix, options) in AWKWARD.items():
            dest = Path(tmp) / f"awkward-{name}.gguf"
            quantize(awkward, dest, ftype, overrides, awkward_imatrix if with_imatrix else None, options)
            out["awkward"]["files"][name] = sha256_file(dest)
            out["awkward"]["variants"][name] = {"type": ftype, "overrides": list(overrides), "imatrix": with_imatrix,
                                                "options": options}
            dest.unlink()
    GOLDEN.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
