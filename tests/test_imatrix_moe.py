"""``llamatrace imatrix`` on a mixture of experts: per-expert statistics as llama-imatrix collects
them from ``ggml_mul_mat_id`` (``tools/imatrix/imatrix.cpp``): for each ``_exps`` tensor one row of
``in_sum2`` per expert, summed over the rows routed to that expert, and ``counts`` per expert; the
router ``ffn_gate_inp`` as a dense weight. Checked against the squares of the stages a trace
records (the recorder, not the hooks), routed and passed through each expert's SwiGLU in NumPy from
the file's weights; and ``quantize --imatrix`` takes the file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from cli_helpers import run
from moe_files import SPECS, write_moe_file

from llamatrace.quantize.imatrix.files import read_imatrix

CORPUS = Path(__file__).parent / "golden" / "corpus.txt"


def test_per_expert_sums_and_counts_of_a_trace(capsys, tmp_path):
    from llamatrace.corpus.chunks import make_chunks, read_corpus
    from llamatrace.model.llama import Llama
    from llamatrace.quantize.imatrix.compute import calibration_text
    path = write_moe_file(tmp_path / "qwen3moe.gguf", "qwen3moe")
    spec = SPECS["qwen3moe"]
    n_expert, k, n_ctx, n_chunks = spec["n_expert"], spec["k"], 32, 2
    out = tmp_path / "imatrix.gguf"
    code, _, err = run(capsys, "imatrix", "-f", CORPUS, "-c", str(n_ctx), "--chunks", str(n_chunks), "-o", out,
                       "--model", path)
    assert code == 0, err
    entries = read_imatrix(out)

    model = Llama.load(path)
    chunks = make_chunks(model.tokenizer, calibration_text(read_corpus(CORPUS)), n_ctx, n_chunks,
                         model.config.max_seq_len)
    want: dict[str, list[np.ndarray]] = {}

    def add(name: str, sums: np.ndarray, counts: np.ndarray) -> None:
        if name in want:
            want[name][0] += sums
            want[name][1] += counts
        else:
            want[name] = [sums, counts]

    r = gguf.GGUFReader(str(path))
    w = {t.name: np.array(t.data, dtype=np.float64) for t in r.tensors}
    for i in range(n_chunks):
        with model.trace(stages=["ffn_norm"], keep_arrays=True) as rec:
            model.forward(chunks.chunk(i), 0, model.new_cache(n_ctx))
        arrays = rec.arrays()
        for layer in range(spec["n_layers"]):
            p = f"blk.{layer}."
            x = arrays[f"step0.layer{layer}.ffn_norm"].astype(np.float64)
            # NumPy reference of build_moe_ffn's route (softmax, top-k) and SwiGLU, from the file's weights
            logits = x @ w[p + "ffn_gate_inp.weight"].T
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
            gate_up = np.zeros((n_expert, x.shape[1]))
            down = np.zeros((n_expert, spec["expert_ff"]))
            counts = np.zeros(n_expert, np.int64)
            for t in range(n_ctx):
                for s in range(k):
                    e = ids[t, s]
                    g, u = w[p + "ffn_gate_exps.weight"][e] @ x[t], w[p + "ffn_up_exps.weight"][e] @ x[t]
                    glu = g / (1 + np.exp(-g)) * u
                    gate_up[e] += x[t] ** 2
                    down[e] += glu ** 2
                    counts[e] += 1
            for kind in ("ffn_gate_exps", "ffn_up_exps"):
                add(p + kind + ".weight", gate_up.copy(), counts.copy())
            add(p + "ffn_down_exps.weight", down, counts.copy())
            add(p + "ffn_gate_inp.weight", (x * x).sum(axis=0), np.array([n_ctx]))

    assert set(want) <= set(entries)
    for name, (sums, counts) in want.items():
        got_sums, got_counts = entries[name]
        assert got_counts.tolist() == counts.tolist(), name
        np.testing.assert_allclose(got_sums.reshape(sums.shape), sums, rtol=1e-5, err_msg=name)
    routed = entries["blk.0.ffn_down_exps.weight"][1]
    assert routed.sum() == n_chunks * n_ctx * k and (routed > 0).sum() > 1       # the routes differ by token

    # llama-quantize's reading of it: each expert its own in_sum2 / count
    q = tmp_path / "q.gguf"
    code, _, err = run(capsys, "quantize", path, q, "--type", "Q8_0", "--imatrix", out)
    assert code == 0, err
    assert "no entry for 1 tensor (output.weight)" in err          # llama-imatrix skips it without --process-output


def test_gptoss_down_experts_sum_the_clamped_swiglu_of_the_biased_products(capsys, tmp_path):
    # gpt-oss's experts read x·Wᵀ + b and swiglu_oai (the gate capped at 7, up clamped, (up + 1)):
    # the sums of ffn_down_exps must be of those rows, not of a plain SwiGLU without biases
    from gptoss_files import EXPERT_FF, K, N_EXPERT, N_LAYERS, write_gptoss_file
    from llamatrace.corpus.chunks import make_chunks, read_corpus
    from llamatrace.model.llama import Llama
    from llamatrace.quantize.imatrix.compute import calibration_text
    path = write_gptoss_file(tmp_path / "gpt-oss.gguf")
    n_ctx = 16
    out = tmp_path / "imatrix.gguf"
    code, _, err = run(capsys, "imatrix", "-f", CORPUS, "-c", str(n_ctx), "--chunks", "1", "-o", out, "--model", path)
    assert code == 0, err
    entries = read_imatrix(out)
    model = Llama.load(path)
    chunk = make_chunks(model.tokenizer, calibration_text(read_corpus(CORPUS)), n_ctx, 1,
                        model.config.max_seq_len).chunk(0)
    with model.trace(stages=["ffn_norm"], keep_arrays=True) as rec:
        model.forward(chunk, 0, model.new_cache(n_ctx))
    arrays = rec.arrays()
    w = {t.name: np.array(t.data, dtype=np.float64) for t in gguf.GGUFReader(str(path)).tensors}
    for layer in range(N_LAYERS):
        p = f"blk.{layer}."
        x = arrays[f"step0.layer{layer}.ffn_norm"].astype(np.float64)
        logits = x @ w[p + "ffn_gate_inp.weight"].T + w[p + "ffn_gate_inp.bias"]
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :K]
        down = np.zeros((N_EXPERT, EXPERT_FF))
        counts = np.zeros(N_EXPERT, np.int64)
        for t in range(n_ctx):
            for e in ids[t]:
                g = np.minimum(w[p + "ffn_gate_exps.weight"][e] @ x[t] + w[p + "ffn_gate_exps.bias"][e], 7.0)
                u = np.clip(w[p + "ffn_up_exps.weight"][e] @ x[t] + w[p + "ffn_up_exps.bias"][e], -7.0, 7.0)
                glu = g / (1 + np.exp(-1.702 * g)) * (u + 1)
                down[e] += glu ** 2
                counts[e] += 1
        got_sums, got_counts = entries[p + "ffn_down_exps.weight"]
        assert got_counts.tolist() == counts.tolist()
        np.testing.assert_allclose(got_sums.reshape(down.shape), down, rtol=2e-4)
    model.close()
