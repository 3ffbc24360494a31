"""Where the quantization error enters: every stage of two models compared on the same tokens.

For each scored token (the positions :mod:`llamatrace.corpus.metrics` scores), each layer and
each per-token stage of the catalogue (:data:`TOKEN_STAGES`: the replaceable layer stages whose
output is ``[seq_len, …]``), two relative differences ``‖quant − base‖ / ‖base‖``:

* accumulated: the two models' outputs, each run on the same ids with its own inputs, so a stage
  inherits every difference before it;
* local (where the error *enters*): the base's output against the quantized model's kernels
  applied to the base's own recorded inputs (:mod:`llamatrace.analysis.local_error`), so a stage
  shows only what its own weights add — large at a projection whose matrix is coarsely
  quantized, zero at a norm or a residual add. NaN where the stage is not recomputed.

Over a run: their median and 95th percentile per (layer, stage), and what each layer adds to
the residual stream's accumulated difference — the median over tokens of ``l_out`` of layer
``L`` minus that of ``L − 1`` (layer 0: minus ``inp_embd``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamatrace.analysis.difference import relative_error_rows
from llamatrace.corpus.metrics import TokenKLD, compress_log_probs, token_kld
from llamatrace.tracing.stages import STAGES

# the Llama block's stages: other architectures' feature stages (when="qk_norm", ...) are not collected yet
TOKEN_STAGES: tuple[str, ...] = tuple(s.id for s in STAGES
                                      if s.level == "layer" and s.replaceable and s.shape.startswith("[seq_len,")
                                      and (s.when in ("always", "masked", "gqa") or s.when.startswith("!")))


@dataclass(frozen=True)
class PairSpec:
    """Two models a worker loads once: the base and the model compared with it (ModelSpec each)."""

    base: object
    model: object

    def load(self):
        return self.base.load(), self.model.load()


def check_same_shape(base_path, model_path) -> None:
    """Refuse to compare the stages of two models of different shapes (read from the headers).

    Raises:
        OptionError: another number of layers, width, heads or FFN width; an architecture
            without some of the Llama block's stages (Gemma's GeGLU).
        ModelNotFoundError, ModelFormatError, UnsupportedModelError: a file cannot be used.
    """
    from llamatrace.errors import OptionError
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig

    def shape(path):
        with open_gguf(path) as f:
            c = ModelConfig.from_gguf(f)
        return {k: getattr(c, k) for k in ("n_layers", "dim", "n_heads", "n_kv_heads", "hidden_dim")}

    from llamatrace.tracing.stages import STAGE_BY_ID, stage_applies
    c = ModelConfig.from_gguf(open_gguf(model_path))
    absent = [sid for sid in TOKEN_STAGES if not stage_applies(STAGE_BY_ID[sid], 2, c.n_rep, c.features)]
    if absent:       # the collected columns are the Llama block's (GeGLU models have no ffn_swiglu …)
        raise OptionError(f"--stages does not support {c.arch} models yet: they have no {', '.join(absent)} "
                          f"stage; run perplexity without --stages")
    base, model = shape(base_path), shape(model_path)
    if base != model:
        diff = ", ".join(f"{k} {base[k]} vs {model[k]}" for k in base if base[k] != model[k])
        raise OptionError(f"--stages compares two models of one architecture; the base and the model differ ({diff})")


def capture(model, ids: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One prefill of ``ids``, keeping the scored rows ``first … n_ctx-2`` of every token stage.

    Returns:
        acts: object ``[n_layers, len(TOKEN_STAGES)]`` of float32 ``[n_scored, width]`` arrays;
        embd: float32 ``[n_scored, dim]`` (``inp_embd``);
        logits: float32 ``[n_scored, n_vocab]``.
    """
    n = len(ids)
    acts = np.empty((model.config.n_layers, len(TOKEN_STAGES)), dtype=object)
    column = {sid: k for k, sid in enumerate(TOKEN_STAGES)}
    embd = []

    def keep(a, event):
        rows = np.array(a.reshape(n, -1)[first:n - 1], dtype=np.float32)
        if event.layer is None:
            embd.append(rows)
        else:
            acts[event.layer, column[event.stage]] = rows

    with model.hooks({sid: keep for sid in (*TOKEN_STAGES, "inp_embd")}):
        logits = model.forward(ids, 0, model.new_cache(n), all_logits=True)[first:n - 1]
    return acts, embd[0], logits


def local_error_rows(model, acts_b: np.ndarray, embd_b: np.ndarray, first: int) -> np.ndarray:
    """float32 ``[n_layers, n_stages, n_scored]``: each stage of the base's captured rows
    recomputed by ``model`` from the base's own inputs, against the base's output (NaN where the
    stage is not recomputed or an input is not captured)."""
    from llamatrace.analysis.local_error import local_errors
    from llamatrace.tracing.recorder import stage_key
    arrays = {stage_key(0, None, "inp_embd"): embd_b}
    for i in range(acts_b.shape[0]):
        for k, sid in enumerate(TOKEN_STAGES):
            arrays[stage_key(0, i, sid)] = acts_b[i, k]
    found = local_errors(model, arrays, start_pos=first, per_row=True)
    out = np.full(acts_b.shape + (len(embd_b),), np.nan, dtype=np.float32)
    for i in range(acts_b.shape[0]):
        for k, sid in enumerate(TOKEN_STAGES):
            rows = found.get(stage_key(0, i, sid))
            if rows is not None:
                out[i, k] = rows
    return out


def score_pair(models, job) -> tuple[TokenKLD, np.ndarray, np.ndarray]:
    """The runner's work for one chunk with ``--stages``: the KLD parts (base rows compressed as
    a base file would hold them), float32 ``[2, n_layers, n_stages, n_scored]`` relative errors
    (accumulated, then local: see the module docstring) and float32 ``[n_scored]`` of ``inp_embd``."""
    base, model = models
    acts_b, embd_b, logits_b = capture(base, job.ids, job.first)
    acts_q, embd_q, logits_q = capture(model, job.ids, job.first)
    accumulated = np.array([[relative_error_rows(acts_q[i, k], acts_b[i, k]) for k in range(len(TOKEN_STAGES))]
                            for i in range(acts_b.shape[0])], dtype=np.float32)
    errors = np.stack([accumulated, local_error_rows(model, acts_b, embd_b, job.first)])
    part = token_kld(logits_q, compress_log_probs(logits_b), job.targets)
    return part, errors, relative_error_rows(embd_q, embd_b).astype(np.float32)


@dataclass
class StageErrors:
    """The attribution of a run.

    Attributes:
        stages: the stage ids of the columns (:data:`TOKEN_STAGES`).
        median, p95: float ``[n_layers, n_stages]`` over every scored token (accumulated).
        local_median, local_p95: the same of the local error (NaN where not recomputed).
        l_out: float ``[n_layers]``, median relative difference of the residual stream after each layer.
        added: float ``[n_layers]``, median over tokens of what each layer adds to it.
        count: scored tokens.
    """

    stages: tuple[str, ...]
    median: np.ndarray
    p95: np.ndarray
    local_median: np.ndarray
    local_p95: np.ndarray
    l_out: np.ndarray
    added: np.ndarray
    count: int

    @classmethod
    def from_chunks(cls, errors: list[np.ndarray], embd: list[np.ndarray]) -> "StageErrors":
        both = np.concatenate(errors, axis=-1)            # [2, n_layers, n_stages, n_tokens]
        e, local = both[0], both[1]
        x0 = np.concatenate(embd)                          # [n_tokens]
        resid = e[:, TOKEN_STAGES.index("l_out"), :]
        before = np.vstack([x0[None, :], resid[:-1]])
        recomputed = ~np.isnan(local[..., :1])             # a stage is recomputed for every token or none
        local_median = np.where(recomputed[..., 0], np.median(np.nan_to_num(local), axis=2), np.nan)
        local_p95 = np.where(recomputed[..., 0], np.percentile(np.nan_to_num(local), 95, axis=2), np.nan)
        return cls(TOKEN_STAGES, np.median(e, axis=2), np.percentile(e, 95, axis=2), local_median, local_p95,
                   np.median(resid, axis=1), np.median(resid - before, axis=1), int(e.shape[2]))

    def worst(self, n: int = 15, local: bool = False) -> list[tuple[int, str, float, float]]:
        """The ``n`` (layer, stage, median, p95) with the largest median (of the local error with
        ``local``), worst first."""
        median, p95 = (self.local_median, self.local_p95) if local else (self.median, self.p95)
        order = np.argsort(-np.nan_to_num(median, nan=-1.0), axis=None)[:n]
        return [(int(i), self.stages[int(k)], float(median[i, k]), float(p95[i, k]))
                for i, k in zip(*np.unravel_index(order, median.shape)) if not np.isnan(median[i, k])]

    def as_json(self) -> dict:
        def listed(a: np.ndarray) -> list:
            return [[None if np.isnan(v) else round(float(v), 6) for v in row] for row in a]
        return {"stages": list(self.stages), "median": self.median.round(6).tolist(),
                "p95": self.p95.round(6).tolist(), "local_median": listed(self.local_median),
                "local_p95": listed(self.local_p95), "l_out_median": self.l_out.round(6).tolist(),
                "l_out_added": self.added.round(6).tolist(), "count": self.count}
