#!/usr/bin/env python3
"""Golden perplexity and KL-divergence values from llama.cpp (llama-cpp-python, ``logits_all``).

Not part of llamatrace, never imported by the tests; needs ``llama_cpp`` (run it where
llama-cpp-python is installed). Writes ``tests/golden/perplexity_llamacpp.json``:

* per model file: corpus token ids (llama.cpp's tokenizer), ``[i]`` running values, PPL ± error
  over ``tests/golden/corpus.txt`` at ``n_ctx`` 256, and llama.cpp's own speed (tokens/s);
* ``kld``: ``llama-perplexity --kl-divergence`` statistics of the second model against the
  first (the base), from llama.cpp's logits of both files.

The arithmetic is a row-by-row transcription of llama.cpp ``tools/perplexity/perplexity.cpp``
(``perplexity()``, ``log_softmax`` with a uint16 base row, ``kl_divergence()``), written
independently of llamatrace's NumPy version. The chunks are evaluated one per ``eval`` call
from an empty cache, as ``llama-perplexity`` does with ``n_batch >= n_ctx``.

Usage (from the repo root)::

  python3 tests/golden/make_perplexity_llamacpp.py \
      --model ~/.cache/llamatrace/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --model ~/.cache/llamatrace/models/SmolLM2-135M-Instruct.Q4_K_M.gguf
  python3 tests/golden/make_perplexity_llamacpp.py \
      --model ~/.cache/llamatrace/models/gemma-3-270m-q4_k_m.gguf \
      --out tests/golden/perplexity_gemma3_llamacpp.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
N_CTX = 256


def chunk_logits(llm, ids: list[int]) -> np.ndarray:
    """float32 [n_ctx, n_vocab] logits of one chunk evaluated from an empty cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def nll_row(z: np.ndarray, tok: int) -> float:
    """log_softmax(): float max, double sum of expf."""
    m = np.float32(z.max())
    s = float(np.exp(z - m).astype(np.float64).sum())
    return -(float(z[tok] - m) - math.log(s))


def base_row(z: np.ndarray) -> tuple[float, float, np.ndarray]:
    """log_softmax(..., uint16_t * log_prob, ...): scale, min_log_prob, uint16 q."""
    mx = np.float32(z.max())
    mn = max(np.float32(z.min()), np.float32(mx - 16))
    lse = np.float32(math.log(float(np.exp(z - mx).astype(np.float64).sum())))
    scale = np.float32((mx - mn) / np.float32(65535))
    min_lp = np.float32(mn - mx - lse)
    q = np.zeros(z.shape, dtype=np.uint16)
    if scale:
        inv = np.float32(1) / scale
        keep = z > mn
        q[keep] = np.rint(inv * (z[keep] - mn)).astype(np.uint16)
    return float(scale), float(min_lp), q


def kld_row(z: np.ndarray, base: tuple[float, float, np.ndarray], tok: int) -> dict:
    scale, min_lp, q = base
    imax = int(np.argmax(z))
    mx = np.float32(z[imax])
    lse = np.float32(math.log(float(np.exp(z - mx).astype(np.float64).sum())))
    nll = float(np.float32(mx + lse - z[tok]))
    logp_base = np.float32(scale) * q.astype(np.float32) + np.float32(min_lp)
    nll_base = -float(logp_base[tok])
    keep = logp_base > np.float32(-16)
    kld = float((np.exp(logp_base[keep]).astype(np.float64)
                 * (logp_base[keep] - z[keep] + (mx + lse)).astype(np.float64)).sum())
    p_diff = float(np.float32(math.exp(-nll)) - np.float32(math.exp(-nll_base)))
    return {"nll": nll, "nll_base": nll_base, "kld": kld, "p_diff": p_diff,
            "same_top": imax == int(np.argmax(logp_base))}


def mean_unc(s: float, s2: float, n: int) -> tuple[float, float]:
    f = s / n
    df = s2 / n - f * f
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True,
                    help="GGUF files; with two, the KLD of the second against the first")
    ap.add_argument("--corpus", default=str(HERE / "corpus.txt"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "perplexity_llamacpp.json"))
    args = ap.parse_args()
    text = Path(args.corpus).read_text(encoding="utf-8")
    result = {"corpus_sha256": hashlib.sha256(text.encode()).hexdigest(), "n_ctx": N_CTX,
              "versions": {"llama_cpp_python": llama_cpp.__version__}, "threads": args.threads, "models": {}}
    first = N_CTX // 2
    base_rows: list = []
    for k, path in enumerate(Path(m).expanduser().resolve() for m in args.model):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX,
                              logits_all=True, n_threads=args.threads, n_threads_batch=args.threads,
                              verbose=False)
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        n_chunk = len(ids) // N_CTX
        bos = llm.token_bos() if llm._model.add_bos_token() else None
        nll_sum = nll2_sum = 0.0
        count = 0
        running, per_token = [], []
        seconds = 0.0
        for i in range(n_chunk):
            chunk = list(ids[i * N_CTX:(i + 1) * N_CTX])
            if bos is not None:
                chunk[0] = bos
            t0 = time.perf_counter()
            logits = chunk_logits(llm, chunk)
            seconds += time.perf_counter() - t0
            for j in range(first, N_CTX - 1):
                tok = ids[i * N_CTX + j + 1]
                v = nll_row(logits[j], tok)
                nll_sum += v
                nll2_sum += v * v
                count += 1
                if k == 0 and len(args.model) > 1:
                    base_rows.append(base_row(logits[j]))
                elif k == 1:
                    per_token.append(kld_row(logits[j], base_rows[len(per_token)], tok))
            running.append(math.exp(nll_sum / count))
        mean = nll_sum / count
        ppl = math.exp(mean)
        entry = {"file": path.name, "n_tokens": len(ids), "ids": list(ids), "n_chunks": n_chunk, "n_scored": count,
                 "running": running, "ppl": ppl,
                 "ppl_error": ppl * math.sqrt((nll2_sum / count - mean * mean) / (count - 1)),
                 "tokens_per_s": n_chunk * N_CTX / seconds}
        print(f"{path.name}: PPL = {ppl:.4f} +/- {entry['ppl_error']:.5f}, {entry['tokens_per_s']:.0f} tokens/s")
        result["models"][path.name] = entry
        if k == 1:
            result["kld"] = kld_stats(per_token, base=Path(args.model[0]).name, model=path.name)
            print(json.dumps(result["kld"], indent=1))
        del llm
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def kld_stats(rows: list[dict], base: str, model: str) -> dict:
    n = len(rows)
    col = {key: np.array([r[key] for r in rows], dtype=np.float64) for key in ("nll", "nll_base", "kld", "p_diff")}
    lp = mean_unc(col["nll"].sum(), (col["nll"] ** 2).sum(), n)
    lpb = mean_unc(col["nll_base"].sum(), (col["nll_base"] ** 2).sum(), n)
    kld = mean_unc(col["kld"].sum(), (col["kld"] ** 2).sum(), n)
    mse = mean_unc((col["p_diff"] ** 2).sum(), (col["p_diff"] ** 4).sum(), n)
    srt = np.sort(col["kld"].astype(np.float32))

    def pct(f: float) -> float:
        p = f * (n - 1)
        ip = int(p)
        p -= ip
        return float((1 - p) * srt[ip] + p * srt[min(ip + 1, n - 1)])

    same = sum(r["same_top"] for r in rows) / n
    median = float(0.5 * (srt[n // 2] + srt[n // 2 - 1])) if n % 2 == 0 else float(srt[n // 2])
    return {"base": base, "model": model, "count": n, "ppl": math.exp(lp[0]), "ppl_base": math.exp(lpb[0]),
            "ln_ppl_ratio": lp[0] - lpb[0], "mean_kld": kld[0], "mean_kld_error": kld[1],
            "median_kld": median, "p99_kld": pct(0.99), "p999_kld": pct(0.999), "max_kld": float(srt[-1]),
            "rms_dp": math.sqrt(mse[0]), "same_top_p": same}


if __name__ == "__main__":
    main()
