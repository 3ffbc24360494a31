#!/usr/bin/env python3
"""Golden importance matrix from llama.cpp's own ``llama-imatrix``.

Not part of llamatrace, never imported by the tests; needs the ``llama-imatrix`` binary built
from the llama-cpp-python sdist's ``vendor/llama.cpp`` and gguf-py (``pip install gguf``). Runs::

  llama-imatrix -m MODEL -f tests/data/calibration.txt -c 128 -o TMP.gguf --no-ppl

(llama.cpp's defaults otherwise: ``-b 2048``, so the chunks run 16 to a batch) and stores what
it wrote, read with gguf-py's ``GGUFReader``, in ``tests/golden/imatrix_llamacpp.npz``:
``<weight>.in_sum2`` float32 ``[n_in]``, ``<weight>.counts`` float32 ``[1]``, ``chunk_count``,
``chunk_size``, ``datasets``, the model file's name and sha256, and the command.

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
BIN = "/work/llamacpp/build/bin/llama-imatrix"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--bin", default=BIN, help="the llama-imatrix binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "imatrix_llamacpp.npz")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "imatrix.gguf"
        command = [args.bin, "-m", str(args.model), "-f", TEXT, "-c", str(N_CTX), "-o", str(target),
                   "--no-ppl", "-t", str(args.threads)]
        subprocess.run(command, check=True)
        r = GGUFReader(target)
        arrays = {t.name: np.array(t.data, dtype=np.float32).reshape(-1) for t in r.tensors}
        fields = {k: r.fields[k].contents() for k in ("imatrix.chunk_count", "imatrix.chunk_size", "imatrix.datasets")}
    sha = hashlib.sha256(args.model.read_bytes()).hexdigest()
    np.savez_compressed(args.out, **arrays, chunk_count=fields["imatrix.chunk_count"],
                        chunk_size=fields["imatrix.chunk_size"], datasets=np.array(fields["imatrix.datasets"]),
                        model=args.model.name, model_sha256=sha,
                        command=" ".join(["llama-imatrix", *command[1:4], "-f", TEXT, "-c", str(N_CTX), "--no-ppl"]))
    print(f"{args.out}: {len(arrays) // 2} weights, {fields['imatrix.chunk_count']} chunks of "
          f"{fields['imatrix.chunk_size']} tokens")


if __name__ == "__main__":
    main()
