"""Where the quantization error enters: every stage of two models compared on the same tokens.

For each scored token (the positions :mod:`llamatrace.corpus.metrics` scores), each layer and
each per-token stage of the catalogue the model has (:func:`token_stages`: the replaceable layer
stages whose output is ``[seq_len, …]`` and that apply to its architecture), two relative
differences ``‖quant − base‖ / ‖base‖``:

* accumulated: the two models' outputs, each run on the same ids with its own inputs, so a stage
  inherits every difference before it;
* local (where the error *enters*): the base's output against the quantized model's kernels
  applied to the base's own recorded inputs (:mod:`llamatrace.analysis.local_error`), so a stage
  shows only what its own weights add — large at a projection whose matrix is coarsely
  quantized, zero at a norm or a residual add. NaN where the stage is not recomputed.

Over a run: their median and 95th percentile per (layer, stage), and what each layer adds to
the residual stream's accumulated difference — the median over tokens of ``l_out`` of layer
``L`` minus that of ``L − 1`` (layer 0: minus ``inp_embd``).

Mixtures of experts, per expert (:class:`ExpertErrors`): the stages with a row per chosen expert
(:func:`slot_stages`: ``ffn_moe_gate``, ``ffn_moe_up``, ``ffn_moe_swiglu``, ``ffn_moe_down``…) are
also measured per (token, slot) and grouped by the expert the *base* routed the token to. Local:
the quantized model's expert recomputes the base's rows on the base's route, so every (token,
expert) pair the base chose counts. Accumulated: the quantized model routes on its own inputs;
the base's expert ``e`` for token ``t`` is compared with the quantized model's row of the same
expert ``e`` for ``t`` whatever its slot (top-k ranks may swap); when the quantized model did not
choose ``e`` for ``t`` at all, the pair is *rerouted*: counted, not measured. The per-token
columns compare slot with slot, as the two models emit them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamatrace.analysis.difference import relative_error_rows
from llamatrace.corpus.metrics import TokenKLD, compress_log_probs, token_kld
from llamatrace.tracing.stages import STAGE_BY_ID, STAGES, stage_applies


def token_stages(features: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The per-token layer stages a model with architecture ``features`` (:attr:`ModelConfig.features`;
    empty: Llama) emits in a prefill, in the catalogue's order: the replaceable layer stages whose
    output is ``[seq_len, …]`` (the columns of the attribution). With gated DeltaNet layers, the
    stages of both kinds of layer (each layer fills its own kind's columns)."""
    return tuple(s.id for s in STAGES
                 if s.level == "layer" and s.replaceable and s.shape.startswith("[seq_len,")
                 and (stage_applies(s, 2, 2, features)
                      or ("deltanet" in features and stage_applies(s, 2, 2, features, recurrent=True))))


def slot_stages(features: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The columns of :func:`token_stages` with a row per chosen expert, ``[seq_len, n_expert_used,
    …]`` (none without ``moe``): the stages measured per expert (:class:`ExpertErrors`)."""
    columns = token_stages(features)
    return tuple(s for s in columns if s in _slot_ids(columns))


def _slot_ids(stages: tuple[str, ...]) -> set[str]:
    return {s for s in stages if STAGE_BY_ID[s].shape.startswith("[seq_len, n_expert_used, ")}


ROUTE = "ffn_moe_topk"
"""The stage of the chosen experts' ids, ``[seq_len, n_expert_used]``."""


TOKEN_STAGES: tuple[str, ...] = token_stages()
"""The Llama block's columns."""

LOCAL_INPUTS = ("kqv",)
"""Stages that are no column (their output is not ``[seq_len, …]``) but the input of one whose
local error is recomputed: ``kqv`` ``[n_heads, seq_len, head_dim]``, of ``kqv_out`` (the heads
merged). Captured as their scored rows, for the base only."""


def _config(path):
    """The :class:`ModelConfig` of the GGUF at ``path``, from its header."""
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    with open_gguf(path) as f:
        return ModelConfig.from_gguf(f)


def local_notes(config, stages: tuple[str, ...]) -> dict[str, str]:
    """Stage → why its local error is not recomputed for a model of ``config`` (its column of the
    local heat map stays empty), for the columns ``stages`` that have no local error."""
    from llamatrace.analysis.local_error import not_recomputed
    return {s: why for s in stages if (why := not_recomputed(s, config))}


def columns_of_file(path) -> tuple[tuple[str, ...], dict[str, str], int]:
    """:func:`token_stages` of the GGUF at ``path`` (its header only), their :func:`local_notes`
    and its number of experts (0: dense).

    Raises:
        ModelNotFoundError, ModelFormatError, UnsupportedModelError: the file cannot be used.
    """
    c = _config(path)
    stages = token_stages(c.features)
    return stages, local_notes(c, stages), c.n_expert


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
        OptionError: another architecture (or architecture features: other stages), number of
            layers, width, heads or FFN width.
        ModelNotFoundError, ModelFormatError, UnsupportedModelError: a file cannot be used.
    """
    from llamatrace.errors import OptionError

    def shape(path):
        c = _config(path)
        return {"architecture": c.arch, "features": "+".join(sorted(c.features)) or "none",
                **{k: getattr(c, k) for k in ("n_layers", "dim", "n_heads", "n_kv_heads", "hidden_dim")}}

    base, model = shape(base_path), shape(model_path)
    if base != model:
        diff = ", ".join(f"{k} {base[k]} vs {model[k]}" for k in base if base[k] != model[k])
        raise OptionError(f"--stages compares two models of one architecture; the base and the model differ ({diff})")


def _scored_rows(model, ids: np.ndarray, first: int, take, inputs: tuple[str, ...] = ()) -> np.ndarray:
    """One prefill of ``ids`` from position 0 calling ``take(layer, stage, rows)`` with the
    float32 ``[n_scored, width]`` rows ``first … n_ctx-2`` of every token stage (``layer`` None:
    ``inp_embd``; :func:`slot_stages`: ``[n_scored, n_expert_used, width]``) and the ``[n_heads, n_scored, head_dim]`` rows of the ``inputs`` stages
    (:data:`LOCAL_INPUTS`), a view of the forward pass's buffer valid during the call; returns
    the scored logits (:func:`scored_logits`)."""
    n = len(ids)
    columns = token_stages(model.config.features)
    slots = set(slot_stages(model.config.features))
    last = []

    def keep(a, event):
        rows = (a[:, first:n - 1] if event.stage in inputs else a[first:n - 1] if event.stage in slots
                else a.reshape(n, -1)[first:n - 1])
        take(event.layer, event.stage, np.asarray(rows, dtype=np.float32))
        if event.stage == "l_out" and event.layer == model.config.n_layers - 1:
            last.append(np.array(a[first:]))

    with model.hooks({sid: keep for sid in (*columns, *inputs, "inp_embd")}):
        model.forward(ids, 0, model.new_cache(n))
    # the scored rows' logits only, as chunk_logits (the others are not read)
    return scored_logits(model, last[0])


def capture(model, ids: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray, dict, np.ndarray]:
    """One prefill of ``ids``, keeping the scored rows ``first … n_ctx-2`` of every token stage
    and of the :data:`LOCAL_INPUTS`.

    Returns:
        acts: object ``[n_layers, n_stages]`` of float32 ``[n_scored, width]`` arrays, a column
            per stage of :func:`token_stages` of the model (:func:`slot_stages`:
            ``[n_scored, n_expert_used, width]``; ``ffn_moe_topk``: the ids as float32);
        embd: float32 ``[n_scored, dim]`` (``inp_embd``);
        inputs: ``(layer, stage)`` → float32 ``[n_heads, n_scored, head_dim]`` of the
            :data:`LOCAL_INPUTS`;
        logits: float32 ``[n_scored, n_vocab]``.
    """
    stages = token_stages(model.config.features)
    column = {sid: k for k, sid in enumerate(stages)}
    acts = np.empty((model.config.n_layers, len(stages)), dtype=object)
    embd, inputs = [], {}

    def take(layer, stage, rows):
        if layer is None:
            embd.append(rows.copy())
        elif stage in column:
            acts[layer, column[stage]] = rows.copy()
        else:
            inputs[layer, stage] = rows.copy()

    logits = _scored_rows(model, ids, first, take, LOCAL_INPUTS)
    return acts, embd[0], inputs, logits


def same_expert(ids_q: np.ndarray, ids_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each (token, slot) of the base's route ``ids_b`` ``[n, k]``: the slot of the same
    expert in ``ids_q`` ``[n, k]`` (int64 ``[n, k]``, 0 where absent) and whether it is there
    (bool ``[n, k]``; False: the token was rerouted away from that expert)."""
    eq = np.asarray(ids_q)[:, None, :] == np.asarray(ids_b)[:, :, None]      # [n, slot_b, slot_q]
    return eq.argmax(axis=2), eq.any(axis=2)


def _slot_errors(rows_q: np.ndarray, rows_b: np.ndarray, ids_q: np.ndarray, ids_b: np.ndarray) -> np.ndarray:
    """float32 ``[n, k]``: ``‖q − b‖ / ‖b‖`` of each base (token, slot) row ``[n, k, width]``
    against the quantized model's row of the same expert (:func:`same_expert`), NaN where rerouted."""
    n, k, width = rows_b.shape
    slot, kept = same_expert(ids_q, ids_b)
    aligned = rows_q[np.arange(n)[:, None], slot]
    err = relative_error_rows(aligned.reshape(n * k, width), rows_b.reshape(n * k, width)).reshape(n, k)
    return np.where(kept, err, np.nan).astype(np.float32)


def differences(model, ids: np.ndarray, first: int, acts_b: np.ndarray,
                embd_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """One prefill of ``ids`` by ``model``, each stage's scored rows compared with the base's
    (:func:`capture`'s ``acts_b`` and ``embd_b``) as the pass makes them, none kept.

    Returns:
        float32 ``[n_layers, n_stages, n_scored]`` and ``[n_scored]`` (``inp_embd``) relative
        differences (:func:`~llamatrace.analysis.difference.relative_error_rows`), float32
        ``[n_scored, n_vocab]`` logits, and with experts float32 ``[n_layers, n_slot_stages,
        n_scored, n_expert_used]`` per (token, base slot) differences of the same expert
        (:func:`_slot_errors`; NaN: rerouted), else None.
    """
    accumulated = np.zeros(acts_b.shape + (len(embd_b),), dtype=np.float32)
    embd = np.zeros(len(embd_b), dtype=np.float32)
    stages = token_stages(model.config.features)
    column = {sid: k for k, sid in enumerate(stages)}
    slot_column = {sid: k for k, sid in enumerate(slot_stages(model.config.features))}
    per_slot = (np.full((acts_b.shape[0], len(slot_column), len(embd_b), model.config.n_expert_used),
                        np.nan, dtype=np.float32) if slot_column else None)
    routes: dict[int, np.ndarray] = {}

    def take(layer, stage, rows):
        if layer is None:
            embd[:] = relative_error_rows(rows, embd_b)
            return
        base = acts_b[layer, column[stage]]
        accumulated[layer, column[stage]] = relative_error_rows(rows, base)
        if stage == ROUTE:
            routes[layer] = rows.copy()
        elif stage in slot_column:
            per_slot[layer, slot_column[stage]] = _slot_errors(rows, base, routes[layer],
                                                               acts_b[layer, column[ROUTE]])

    logits = _scored_rows(model, ids, first, take)
    return accumulated, embd, logits, per_slot


def scored_logits(model, rows: np.ndarray) -> np.ndarray:
    """float32 ``[n - 1, n_vocab]``: the logits of the last block's output rows ``[n, dim]`` but the
    last, bit for bit those of ``forward(all_logits=True)``: that projects the last row of a chunk
    alone (as generation does), so ``rows`` keeps it and its logits are dropped."""
    return model.logits(rows)[:-1]


def local_error_rows(model, acts_b: np.ndarray, embd_b: np.ndarray, inputs_b: dict, first: int
                     ) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 ``[n_layers, n_stages, n_scored]``: each stage of the base's captured rows
    (:func:`capture`'s ``acts``, ``embd``, ``inputs``) recomputed by ``model`` from the base's
    own inputs, against the base's output (NaN where the stage is not recomputed:
    :func:`local_notes`); with experts also float32 ``[n_layers, n_slot_stages, n_scored,
    n_expert_used]``, the same per (token, slot) of the base's route (else None)."""
    from llamatrace.analysis.local_error import local_errors
    from llamatrace.tracing.recorder import stage_key
    stages = token_stages(model.config.features)
    arrays = {stage_key(0, None, "inp_embd"): embd_b}
    arrays.update({stage_key(0, layer, stage): rows for (layer, stage), rows in inputs_b.items()})
    for i in range(acts_b.shape[0]):
        for k, sid in enumerate(stages):
            if acts_b[i, k] is not None:             # a stage the layer has (Qwen3.5: DeltaNet or attention)
                arrays[stage_key(0, i, sid)] = acts_b[i, k]
    slots: dict[str, np.ndarray] = {}
    found = local_errors(model, arrays, start_pos=first, per_row=True, slots=slots)
    out = np.full(acts_b.shape + (len(embd_b),), np.nan, dtype=np.float32)
    for i in range(acts_b.shape[0]):
        for k, sid in enumerate(stages):
            rows = found.get(stage_key(0, i, sid))
            if rows is not None:
                out[i, k] = rows
    columns = slot_stages(model.config.features)
    if not columns:
        return out, None
    per_slot = np.full((acts_b.shape[0], len(columns), len(embd_b), model.config.n_expert_used), np.nan,
                       dtype=np.float32)
    for i in range(acts_b.shape[0]):
        for k, sid in enumerate(columns):
            rows = slots.get(stage_key(0, i, sid))
            if rows is not None:
                per_slot[i, k] = rows
    return out, per_slot


@dataclass
class ExpertChunk:
    """One chunk's per-expert measurements (:func:`score_pair`): ``ids`` int32 ``[n_layers,
    n_scored, n_expert_used]`` the base's route; ``errors`` float32 ``[2, n_layers,
    n_slot_stages, n_scored, n_expert_used]`` per (token, base slot), accumulated (NaN:
    rerouted) then local."""

    ids: np.ndarray
    errors: np.ndarray


def score_pair(models, job) -> tuple[TokenKLD, np.ndarray, np.ndarray, ExpertChunk | None]:
    """The runner's work for one chunk with ``--stages``: the KLD parts (base rows compressed as
    a base file would hold them), float32 ``[2, n_layers, n_stages, n_scored]`` relative errors
    (accumulated, then local: see the module docstring), float32 ``[n_scored]`` of ``inp_embd``,
    and with experts their :class:`ExpertChunk` (else None)."""
    base, model = models
    acts_b, embd_b, inputs_b, logits_b = capture(base, job.ids, job.first)
    rows_b = compress_log_probs(logits_b)
    del logits_b
    accumulated, embd, logits_q, slots_acc = differences(model, job.ids, job.first, acts_b, embd_b)
    local, slots_local = local_error_rows(model, acts_b, embd_b, inputs_b, job.first)
    experts = None
    if slots_acc is not None:                    # every layer of a mixture routes (no dense layers yet)
        route = token_stages(base.config.features).index(ROUTE)
        ids = np.stack([acts_b[i, route] for i in range(acts_b.shape[0])]).astype(np.int32)
        experts = ExpertChunk(ids, np.stack([slots_acc, slots_local]))
    return token_kld(logits_q, rows_b, job.targets), np.stack([accumulated, local]), embd, experts


@dataclass
class ExpertErrors:
    """The per-expert attribution of a run (see the module docstring for who is compared with whom).

    Attributes:
        stages: the stage ids measured per expert (:func:`slot_stages`).
        count: int ``[n_layers, n_expert]``, (token, expert) pairs the base routed.
        rerouted: int ``[n_layers, n_expert]``, of those, the pairs the quantized model did not choose.
        local_median, local_p95: float ``[n_layers, n_stages, n_expert]`` over the expert's pairs,
            each from the base's inputs on the base's route (NaN: no token chose it).
        median: float ``[n_layers, n_stages, n_expert]``, accumulated, over the pairs both models
            chose (NaN: none).
    """

    stages: tuple[str, ...]
    count: np.ndarray
    rerouted: np.ndarray
    local_median: np.ndarray
    local_p95: np.ndarray
    median: np.ndarray

    @classmethod
    def from_chunks(cls, chunks: list[ExpertChunk], n_expert: int, stages: tuple[str, ...]) -> "ExpertErrors":
        """Gather the :class:`ExpertChunk` of every chunk, for ``n_expert`` experts and the
        ``stages`` (:func:`slot_stages`) measured."""
        ids = np.concatenate([c.ids for c in chunks], axis=1)                 # [n_layers, n_tokens, k]
        errors = np.concatenate([c.errors for c in chunks], axis=3)          # [2, n_layers, S, n_tokens, k]
        n_layers = ids.shape[0]
        count = np.zeros((n_layers, n_expert), dtype=np.int64)
        rerouted = np.zeros_like(count)
        shape = (n_layers, len(stages), n_expert)
        local_median, local_p95, median = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
        for i in range(n_layers):
            for e in range(n_expert):
                chosen = ids[i] == e                                          # [n_tokens, k]
                count[i, e] = chosen.sum()
                if not count[i, e]:
                    continue
                kept = ~np.isnan(errors[0, i, 0][chosen])
                rerouted[i, e] = (~kept).sum()
                for k in range(len(stages)):
                    local = errors[1, i, k][chosen]
                    local_median[i, k, e], local_p95[i, k, e] = np.median(local), np.percentile(local, 95)
                    if kept.any():
                        median[i, k, e] = np.median(errors[0, i, k][chosen][kept])
        return cls(stages, count, rerouted, local_median, local_p95, median)

    def worst(self, stage: str, n: int = 15) -> list[tuple[int, int, float, float, float, int, int]]:
        """The ``n`` (layer, expert, local median, local p95, accumulated median, count, rerouted)
        of ``stage`` with the largest local median, worst first (by the accumulated median where
        the stage's local error is not recomputed: NaN)."""
        k = self.stages.index(stage)
        local = self.local_median[:, k]
        values = local if not np.isnan(local).all() else self.median[:, k]
        order = np.argsort(-np.nan_to_num(values, nan=-1.0), axis=None)[:n]
        return [(int(i), int(e), float(local[i, e]), float(self.local_p95[i, k, e]),
                 float(self.median[i, k, e]), int(self.count[i, e]), int(self.rerouted[i, e]))
                for i, e in zip(*np.unravel_index(order, values.shape)) if not np.isnan(values[i, e])]

    def as_json(self) -> dict:
        def listed(a: np.ndarray):
            return [listed(x) for x in a] if a.ndim > 1 else [None if np.isnan(v) else round(float(v), 6) for v in a]
        return {"stages": list(self.stages), "count": self.count.tolist(), "rerouted": self.rerouted.tolist(),
                "local_median": listed(self.local_median), "local_p95": listed(self.local_p95),
                "median": listed(self.median)}


@dataclass
class StageErrors:
    """The attribution of a run.

    Attributes:
        stages: the stage ids of the columns (:func:`token_stages` of the models).
        median, p95: float ``[n_layers, n_stages]`` over every scored token (accumulated).
        local_median, local_p95: the same of the local error (NaN where not recomputed).
        local_notes: stage → why its local error is NaN (:func:`local_notes`).
        l_out: float ``[n_layers]``, median relative difference of the residual stream after each layer.
        added: float ``[n_layers]``, median over tokens of what each layer adds to it.
        count: scored tokens.
        experts: with a mixture of experts, the per-expert attribution (:class:`ExpertErrors`).
    """

    stages: tuple[str, ...]
    median: np.ndarray
    p95: np.ndarray
    local_median: np.ndarray
    local_p95: np.ndarray
    l_out: np.ndarray
    added: np.ndarray
    count: int
    local_notes: dict[str, str]
    experts: ExpertErrors | None = None

    @classmethod
    def from_chunks(cls, errors: list[np.ndarray], embd: list[np.ndarray], stages: tuple[str, ...],
                    notes: dict[str, str] | None = None, experts: list[ExpertChunk] | None = None,
                    n_expert: int = 0) -> "StageErrors":
        """Gather :func:`score_pair`'s chunks: ``errors`` float32 ``[2, n_layers, len(stages), n_scored]``
        and ``embd`` float32 ``[n_scored]`` each, ``stages`` the column ids, ``notes`` why a column's
        local error is missing (:func:`local_notes`; a column missing one without a note gets a
        generic one), ``experts`` the chunks' :class:`ExpertChunk` of a mixture of ``n_expert``."""
        both = np.concatenate(errors, axis=-1)            # [2, n_layers, n_stages, n_tokens]
        e, local = both[0], both[1]
        x0 = np.concatenate(embd)                          # [n_tokens]
        resid = e[:, stages.index("l_out"), :]
        before = np.vstack([x0[None, :], resid[:-1]])
        recomputed = ~np.isnan(local[..., :1])             # a stage is recomputed for every token or none
        local_median = np.where(recomputed[..., 0], np.median(np.nan_to_num(local), axis=2), np.nan)
        local_p95 = np.where(recomputed[..., 0], np.percentile(np.nan_to_num(local), 95, axis=2), np.nan)
        notes = {s: (notes or {}).get(s, "an input of it is not captured")
                 for k, s in enumerate(stages) if np.isnan(local_median[:, k]).any()}
        per_expert = (ExpertErrors.from_chunks(experts, n_expert, tuple(s for s in stages if s in _slot_ids(stages)))
                      if experts else None)
        return cls(stages, np.median(e, axis=2), np.percentile(e, 95, axis=2), local_median, local_p95,
                   np.median(resid, axis=1), np.median(resid - before, axis=1), int(e.shape[2]), notes, per_expert)

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
                "l_out_added": self.added.round(6).tolist(), "count": self.count,
                "local_notes": self.local_notes,
                **({"experts": self.experts.as_json()} if self.experts is not None else {})}
