"""``llamatrace imatrix`` on Qwen3.5 (``qwen35``) as llama-imatrix collects it: the input of every
``mul_mat`` of a block (``tools/imatrix/imatrix.cpp``). On a gated DeltaNet layer ``attn_qkv``,
``attn_gate``, ``ssm_alpha`` and ``ssm_beta`` read the ``attn_norm`` rows and ``ssm_out`` the gated
RMSNorm's output; on a full-attention layer ``attn_q`` (query | gate), ``attn_k``, ``attn_v`` read
``attn_norm`` and ``attn_output`` the gated heads; the FFN as a dense model's. Checked against
sums of the stages a trace records, each first shown in NumPy to be that matmul's input (the
stage × the file's weight = the next recorded stage); and ``quantize --imatrix`` takes the file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from cli_helpers import run
from qwen35_files import N_LAYERS, write_qwen35_file

from llamatrace.quantize.imatrix.files import read_imatrix

CORPUS = Path(__file__).parent / "golden" / "corpus.txt"
DELTANET = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out")
FULL = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN = ("ffn_gate", "ffn_up", "ffn_down")


def test_imatrix_sums_the_input_of_every_qwen35_matmul(capsys, tmp_path):
    from llamatrace.corpus.chunks import make_chunks, read_corpus
    from llamatrace.model.llama import Llama
    from llamatrace.quantize.imatrix.compute import calibration_text
    path = write_qwen35_file(tmp_path / "qwen35.gguf")
    n_ctx, n_chunks = 16, 2
    out = tmp_path / "imatrix.gguf"
    code, _, err = run(capsys, "imatrix", "-f", CORPUS, "-c", str(n_ctx), "--chunks", str(n_chunks), "-o", out,
                       "--model", path)
    assert code == 0, err
    entries = read_imatrix(out)

    model = Llama.load(path)
    recurrent = model.config.recurrent_layers
    chunks = make_chunks(model.tokenizer, calibration_text(read_corpus(CORPUS)), n_ctx, n_chunks,
                         model.config.max_seq_len)
    w = {t.name: np.array(t.data, dtype=np.float64) for t in gguf.GGUFReader(str(path)).tensors}
    want: dict[str, np.ndarray] = {}
    stages = ["attn_norm", "linear_attn_qkv_mixed", "z", "final_output", "linear_attn_out", "attn_gated",
              "attn_out", "ffn_norm", "ffn_out"]
    for i in range(n_chunks):
        with model.trace(stages=stages, keep_arrays=True) as rec:
            model.forward(chunks.chunk(i), 0, model.new_cache(n_ctx))
        a = {k: v.astype(np.float64) for k, v in rec.arrays().items()}
        for layer in range(N_LAYERS):
            p, s = f"blk.{layer}.", f"step0.layer{layer}."

            def add(kinds, x):
                for kind in kinds:
                    want[p + kind + ".weight"] = want.get(p + kind + ".weight", 0) + (x * x).sum(axis=0)

            x = a[s + "attn_norm"]
            if layer in recurrent:
                # the recorded stages are the matmuls' inputs: stage · Wᵀ gives the next stage
                np.testing.assert_allclose(x @ w[p + "attn_qkv.weight"].T, a[s + "linear_attn_qkv_mixed"], atol=1e-4)
                np.testing.assert_allclose(x @ w[p + "attn_gate.weight"].T, a[s + "z"], atol=1e-4)
                y = a[s + "final_output"]
                np.testing.assert_allclose(y @ w[p + "ssm_out.weight"].T, a[s + "linear_attn_out"], atol=1e-4)
                add(DELTANET[:4], x)
                add(["ssm_out"], y)
            else:
                y = a[s + "attn_gated"]
                np.testing.assert_allclose(y @ w[p + "attn_output.weight"].T, a[s + "attn_out"], atol=1e-4)
                add(FULL[:3], x)
                add(["attn_output"], y)
            # the FFN's: ffn_norm rows, and SwiGLU of them from the file's weights for ffn_down
            h = a[s + "ffn_norm"]
            g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
            glu = g / (1 + np.exp(-g)) * u
            np.testing.assert_allclose(glu @ w[p + "ffn_down.weight"].T, a[s + "ffn_out"], atol=1e-4)
            add(FFN[:2], h)
            add(["ffn_down"], glu)
    model.close()

    assert set(want) == {n for n in entries}            # every block matmul, nothing else (no output.weight)
    for name, sums in want.items():
        got_sums, got_counts = entries[name]
        assert got_counts.tolist() == [n_chunks * n_ctx], name
        np.testing.assert_allclose(got_sums.reshape(sums.shape), sums, rtol=1e-5, err_msg=name)

    q = tmp_path / "q.gguf"
    code, _, err = run(capsys, "quantize", path, q, "--type", "Q4_0", "--imatrix", out)
    assert code == 0, err
    assert "no entry for 1 tensor (output.weight)" in err
