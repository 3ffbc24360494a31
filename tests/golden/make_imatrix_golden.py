#!/usr/bin/env python3
"""Golden importance matrices from llama.cpp's own ``llama-imatrix``.

Not part of llamatrace, never imported by the tests; needs the ``llama-imatrix`` binary built
from the llama-cpp-python sdist's ``vendor/llama.cpp`` and gguf-py (``pip install gguf``). Runs
llama-imatrix twice on the default model over ``tests/data/calibration.txt`` at ctx 128
(llama.cpp's defaults otherwise: ``-b 2048``, so the chunks run 16 to a batch; ``--no-ppl``)::

  llama-imatrix -m MODEL -f tests/data/calibration.txt -c 128 -o TMP.gguf --no-ppl -fa off -ctk f32 -ctv f32
  llama-imatrix -m MODEL -f tests/data/calibration.txt -c 128 -o TMP.gguf --no-ppl

The first, ``imatrix_llamacpp.npz``, is the reference: flash attention off and an F32 KV cache,
the settings of every llama.cpp reference of llamatrace (docs/comparing.md), whose attention is
float32. The second, ``imatrix_llamacpp_defaults.npz``, is llama.cpp's defaults (flash attention
with an F16 KV cache): how far llama.cpp's own numbers move with its attention's precision, the
yardstick the test holds llamatrace's difference against.

What llama-imatrix wrote is read with gguf-py's ``GGUFReader``. The weights that read one input
(``attn_q/k/v``; ``ffn_gate/up``) hold the same sums, checked here and stored once:
``<weight>.in_sum2`` float32 ``[n_in]`` for ``attn_q``, ``attn_output``, ``ffn_gate``,
``ffn_down`` of every block, ``same`` (``"blk.0.attn_k.weight=blk.0.attn_q.weight"`` …), ``counts``
(every weight's, checked equal), ``chunk_count``, ``chunk_size``, ``datasets``, the model
file's name and sha256, and the command.

Usage (from the repo root)::

  python3 tests/golden/make_imatrix_golden.py \
      --model ~/.cache/llamatrace/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader

HERE = Path(__file__).resolve().parent
TEXT = "tests/data/calibration.txt"
N_CTX = 128
BIN = "llama-imatrix"             # on PATH, or --bin build/bin/llama-imatrix
SETTINGS = {"imatrix_llamacpp.npz": ["-fa", "off", "-ctk", "f32", "-ctv", "f32"],
            "imatrix_llamacpp_defaults.npz": []}
SHARED = {"attn_k": "attn_q", "attn_v": "attn_q", "ffn_up": "ffn_gate"}      # the same input


def run_imatrix(binary: str, model: Path, settings: list[str], threads: int) -> tuple[dict, dict, str]:
    """(tensors, imatrix.* fields, the command) of one llama-imatrix run."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "imatrix.gguf"
        args = ["-f", TEXT, "-c", str(N_CTX), "--no-ppl", *settings]
        subprocess.run([binary, "-m", str(model), *args, "-o", str(target), "-t", str(threads)], check=True)
        r = GGUFReader(target)
        arrays = {t.name: np.array(t.data, dtype=np.float32).reshape(-1) for t in r.tensors}
        fields = {k: r.fields[k].contents() for k in ("imatrix.chunk_count", "imatrix.chunk_size", "imatrix.datasets")}
    return arrays, fields, " ".join(["llama-imatrix", "-m", model.name, *args])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--bin", default=BIN, help="the llama-imatrix binary")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sha = hashlib.sha256(args.model.read_bytes()).hexdigest()
    for name, settings in SETTINGS.items():
        arrays, fields, command = run_imatrix(args.bin, args.model, settings, args.threads)
        counts = {float(v[0]) for k, v in arrays.items() if k.endswith(".counts")}
        assert len(counts) == 1, counts
        kept, same = {}, []
        for key, value in arrays.items():
            if not key.endswith(".in_sum2"):
                continue
            weight = key[:-len(".in_sum2")]
            kind = weight.split(".")[2]
            if kind in SHARED:
                other = weight.replace(f".{kind}.", f".{SHARED[kind]}.")
                assert np.array_equal(value, arrays[other + ".in_sum2"]), weight
                same.append(f"{weight}={other}")
            else:
                kept[key] = value
        np.savez_compressed(HERE / name, **kept, same=np.array(same), counts=counts.pop(),
                            chunk_count=fields["imatrix.chunk_count"], chunk_size=fields["imatrix.chunk_size"],
                            datasets=np.array(fields["imatrix.datasets"]), model=args.model.name,
                            model_sha256=sha, command=command)
        print(f"{name}: {len(kept) + len(same)} weights ({len(kept)} stored), {fields['imatrix.chunk_count']} "
              f"chunks of {fields['imatrix.chunk_size']} tokens")


if __name__ == "__main__":
    main()
