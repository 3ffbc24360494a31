"""Stage-by-stage agreement between two recordings of a forward pass.

Both sides are dicts of arrays keyed like ``llamatrace trace --npz`` (:func:`~llamatrace.tracing.recorder.stage_key`:
``step0.layer0.Qcur``, ``step0.result_norm``), already in the same layout. :func:`compare_arrays`
pairs the keys, measures each pair and finds the first divergence in forward order;
:func:`llamacpp_stage_arrays` turns tensors read from llama.cpp's graph into that layout
(:mod:`llamatrace.peers.hf` does the same for HF transformers), and :func:`compare_with` runs
both engines on the same token ids.

Metrics per pair (float64): relative RMS error ``‖ours − ref‖ / ‖ref‖``, max abs error, cosine
similarity. Non-finite values (the mask's -inf) must sit at the same places and be equal there;
the metrics cover the finite ones.

Thresholds (on the relative RMS error) follow from what is compared (:data:`PROFILES`; the
report names the profile used), because a stage is judged by the error it may *add*:

* ``llama.cpp`` — our forward pass against llama.cpp's, whose matmuls multiply 8-bit-quantized
  activations (~1e-2 relative drift per matmul, compounding through the layers), calibrated on
  the default model: exact stages (``inp_embd``, ``kq_mask``, ``freqs_cis``) 1e-3 (measured: 0);
  query/key stages (``Qcur*``, ``Kcur*``, ``kq``) 0.15 (largest healthy error seen
  0.054-0.072); every other stage 0.25 (largest seen 0.125). Real bugs land well above: a
  split-half RoPE gives 0.42-0.82 at layer 0's ``Qcur_rope``, an RMSNorm without its 1/rms
  0.88-0.90 at layer 0's ``attn_norm``. A subtler bug (a stage off by 5 %) hides under them.
* ``hf`` — ours in f32 against HF transformers fp32: the same arithmetic up to summation order
  (~1e-5 relative), so 1e-3 everywhere.
* ``same-f32`` / ``same-q8`` — two recordings of llamatrace in one activation mode (``trace
  --npz`` twice, say before and after a change): the kernels are deterministic (each output row
  is summed by one thread in a fixed order), so a healthy pair agrees to the last bit on one
  machine and to float32 rounding across CPUs; 1e-4 (f32) and 1e-3 (q8, where a rounding
  difference can move an 8-bit quantization step) catch a stage that is 5 % off.
* ``q8-vs-f32`` — the two activation modes of llamatrace: llama.cpp's thresholds.

Mixtures of experts (:class:`Routing`): the stages with a slot per chosen expert
(:data:`SLOT_STAGES`, ``[seq_len, n_expert_used, …]``) hold each token's experts in rank order,
and two runs may rank two near-tied experts the other way round. Where both sides' ids are known
(``ffn_moe_topk``, or for llama.cpp, whose ids are int32 and not read, the top k of its
``ffn_moe_probs``), each token's slots are sorted by expert id on both sides before they are
measured, so an expert is compared with the same expert; a token that chose another *set* of
experts has nothing to compare there: it is left out of those stages and counted. ``ffn_moe_topk``
itself is scored as ids, not numbers: another set at any token is a routing divergence
(``routing differs``), another order alone is not.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

import numpy as np

from llamatrace.analysis.difference import metrics
from llamatrace.tracing.stages import STAGE_BY_ID, STAGE_IDS, STAGES
from llamatrace.tracing.recorder import stage_key

EXACT_STAGES = frozenset({"inp_embd", "kq_mask", "freqs_cis"})
QK_STAGES = frozenset({"Qcur", "Kcur", "Qcur_heads", "Kcur_heads", "Qcur_rope", "Kcur_rope", "kq"})
THRESHOLDS = {"exact": 1e-3, "qk": 0.15, "other": 0.25}
"""The ``llama.cpp`` profile's thresholds (the default when nothing says what is compared)."""

PROFILES: dict[str, dict[str, float]] = {
    "llama.cpp": THRESHOLDS,
    "hf": {"exact": 1e-3, "qk": 1e-3, "other": 1e-3},
    "same-f32": {"exact": 1e-4, "qk": 1e-4, "other": 1e-4},
    "same-q8": {"exact": 1e-3, "qk": 1e-3, "other": 1e-3},
    "q8-vs-f32": THRESHOLDS,
}
"""Per-kind thresholds by what is compared (see the module docstring)."""

LOCAL_THRESHOLDS = {"ours": 1e-3, "f32": 0.05, "q8": 0.01}
"""Limits on a stage's local error (:mod:`llamatrace.analysis.local_error`). ``ours``: our own
recording recomputed by the same kernels, which healthy gives 0 exactly (1e-3 leaves room for
another CPU). ``f32`` / ``q8``: the reference's recording recomputed by our kernels in that
activation mode; measured on the default model against llama.cpp (2 steps, layers 0 and 29):
at most 0.024 with f32 kernels (``Vcur``: llama.cpp's 8-bit activations), 0.0029 with q8."""

META_KEY = "__llamatrace__"
"""The key of a recording's description in a ``trace --npz`` file: a JSON string
``{"engine": "llamatrace", "version": ..., "activations": "f32"|"q8", "model": ...}``."""

ROUTE = "ffn_moe_topk"
"""The chosen experts, int ``[seq_len, n_expert_used]``, best first: scored as ids (:class:`Routing`)."""

SLOT_STAGES = frozenset(s.id for s in STAGES if s.id != ROUTE and s.shape.startswith("[seq_len, n_expert_used"))
"""Stages with a slot per chosen expert (``ffn_moe_weights``… ``[seq_len, n_expert_used]``, ``ffn_moe_gate``…
``[seq_len, n_expert_used, width]``): paired by expert id where both sides' ids are known."""

_KEY = re.compile(r"^step(\d+)\.(?:layer(\d+)\.)?([^.]+)$")
_FIRST_LAYER_STAGE = min(i for i, s in enumerate(STAGES) if s.level == "layer")
_ORDER = {sid: i for i, sid in enumerate(STAGE_IDS)}


def stage_kind(stage: str) -> str:
    """``exact``, ``qk`` or ``other``: which default threshold applies to ``stage``."""
    return "exact" if stage in EXACT_STAGES else "qk" if stage in QK_STAGES else "other"


def parse_key(key: str) -> tuple[int, int | None, str]:
    """``step0.layer3.Qcur`` → ``(0, 3, "Qcur")``; ``step1.result_norm`` → ``(1, None, "result_norm")``.

    Raises:
        ValueError: a key of another form.
    """
    m = _KEY.match(key)
    if not m:
        raise ValueError(f"{key!r} is not a stage key (step<S>.layer<L>.<stage> or step<S>.<stage>)")
    return int(m.group(1)), None if m.group(2) is None else int(m.group(2)), m.group(3)


def forward_order(key: str) -> tuple:
    """Sort key: step, then model inputs, layers in order, model outputs; unknown stages last."""
    step, layer, stage = parse_key(key)
    idx = _ORDER.get(stage, len(_ORDER))
    if layer is None:
        part = 0 if idx < _FIRST_LAYER_STAGE else 2
        return step, part, 0, idx, stage
    return step, 1, layer, idx, stage


@dataclass
class Row:
    """One (step, layer, stage): shapes, errors, the threshold and a status.

    ``status``: ``ok``, ``diverged`` (error above threshold), ``added error`` (the stage's own
    error, recomputed from one recording's inputs, above :data:`LOCAL_THRESHOLDS`: see
    :mod:`llamatrace.analysis.local_error`), ``shape mismatch`` (a divergence too), ``only ours``
    or ``only reference`` (no error figures); with experts (:class:`Routing`), ``routing differs``
    (``ffn_moe_topk``: a token chose other experts; a divergence, no error figures) and
    ``rerouted`` (a per-expert stage where no token chose the same experts in both: nothing
    compared, not a divergence by itself). ``local_err`` / ``ref_local_err``: that local error
    in our recording and in the reference's (``None`` where not recomputed). ``routing``: for
    ``ffn_moe_topk`` and the :data:`SLOT_STAGES` paired by expert id, :meth:`Routing.summary`
    (``None``, and absent from the JSON, elsewhere).
    """

    step: int
    layer: int | None
    stage: str
    shape: list[int] | None
    ref_shape: list[int] | None
    rel_rms_err: float | None
    max_abs_err: float | None
    cosine: float | None
    threshold: float | None
    status: str
    local_err: float | None = None
    ref_local_err: float | None = None
    routing: dict | None = None

    @property
    def diverged(self) -> bool:
        return self.status in ("diverged", "added error", "shape mismatch", "routing differs")

    def to_json(self) -> dict:
        d = asdict(self)
        if d["routing"] is None:
            del d["routing"]
        for k in ("rel_rms_err", "max_abs_err", "cosine", "local_err", "ref_local_err"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = None
        return d


@dataclass
class Comparison:
    """All rows in forward order and the first divergent one (``None``: within thresholds)."""

    rows: list[Row]
    first_divergence: Row | None
    thresholds: dict[str, float]
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**self.extra, "thresholds": self.thresholds, "rows": [r.to_json() for r in self.rows],
                "first_divergence": None if self.first_divergence is None else self.first_divergence.to_json()}


def thresholds_for(threshold: float | None, profile: str = "llama.cpp") -> dict[str, float]:
    """The per-kind thresholds of ``profile`` (:data:`PROFILES`), or ``threshold`` for every kind."""
    if threshold is not None:
        return dict.fromkeys(THRESHOLDS, float(threshold))
    return dict(PROFILES[profile])


def recording_meta(arrays: Mapping[str, np.ndarray]) -> dict | None:
    """The description a ``trace --npz`` file carries under :data:`META_KEY`, or ``None`` (an older
    or foreign recording)."""
    if META_KEY not in arrays:
        return None
    try:
        meta = json.loads(str(np.asarray(arrays[META_KEY])))
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def profile_for(ours: dict | None, ref: dict | None) -> str:
    """The :data:`PROFILES` key for two recordings described by :func:`recording_meta`: two of
    llamatrace in one activation mode are ``same-<mode>``, in two modes ``q8-vs-f32``; anything
    else (an undescribed recording, another engine) ``llama.cpp``, the loosest."""
    if not ours or not ref or ours.get("engine") != "llamatrace" or ref.get("engine") != "llamatrace":
        return "llama.cpp"
    modes = {ours.get("activations"), ref.get("activations")}
    if modes == {"f32"}:
        return "same-f32"
    if modes == {"q8"}:
        return "same-q8"
    return "q8-vs-f32"


@dataclass(frozen=True)
class Routing:
    """The experts two recordings chose at one (step, layer), and how their slots pair.

    ``ours``, ``ref``: int64 ``[seq_len, n_expert_used]``, each token's expert ids in slot order
    (best first). ``derived``: the sides (``"ours"``, ``"reference"``) whose ids were not recorded
    but taken from their ``ffn_moe_probs`` (:func:`route_ids`).
    """

    ours: np.ndarray
    ref: np.ndarray
    derived: tuple[str, ...] = ()

    @property
    def same_experts(self) -> np.ndarray:
        """bool ``[seq_len]``: the token chose the same set of experts in both."""
        return np.all(np.sort(self.ours, axis=1) == np.sort(self.ref, axis=1), axis=1)

    def by_expert(self, ours: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Both sides of a per-expert stage, ``[seq_len, n_expert_used, …]`` each, with every token's
        slots sorted by expert id and only the tokens that chose the same experts in both:
        ``[n_same, n_expert_used, …]`` each, slot ``j`` of one the same expert as slot ``j`` of the other."""
        keep = self.same_experts

        def sort(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
            order = np.argsort(ids, axis=1, kind="stable")                    # [seq_len, k]
            return np.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)[keep]

        return sort(np.asarray(ours), self.ours), sort(np.asarray(ref), self.ref)

    def summary(self) -> dict:
        """``tokens``: the layer's tokens; ``experts_differ``: how many chose another set of experts
        (left out of the per-expert stages), ``experts_differ_at`` which (row indices); ``order_differs``:
        how many chose the same set in another order (paired by id, so no difference); ``derived``
        where a side's ids were not recorded."""
        same = self.same_experts
        out = {"tokens": len(same), "experts_differ": int((~same).sum()),
               "experts_differ_at": np.flatnonzero(~same).tolist(),
               "order_differs": int((same & ~np.all(self.ours == self.ref, axis=1)).sum())}
        if self.derived:
            out["derived"] = list(self.derived)
        return out


def route_ids(arrays: Mapping[str, np.ndarray], step: int, layer: int) -> tuple[np.ndarray | None, bool]:
    """The experts a recording chose at (``step``, ``layer``): int64 ``[seq_len, n_expert_used]``
    best first, and whether they were derived rather than recorded; ``(None, False)`` when neither.

    Recorded: its ``ffn_moe_topk`` (whole numbers, any dtype). Derived: llama.cpp's graph keeps
    its ids as int32, which the capture does not read (f32 only), so they are taken as its graph
    takes them, the top k of ``ffn_moe_probs`` with ties to the lower index (``ggml_argsort_top_k``),
    and trusted only where gathering the probabilities at them gives back the recording's own
    ``ffn_moe_weights`` ``[seq_len, k]`` bit for bit (the graph's ``GET_ROWS``; it also gives k).
    """
    ids = arrays.get(stage_key(step, layer, ROUTE))
    if ids is not None:
        ids = np.asarray(ids)
        whole = ids.dtype.kind in "iu" or (ids.dtype.kind == "f" and np.all(np.isfinite(ids))
                                          and np.array_equal(ids, np.round(ids)))
        return (ids.astype(np.int64), False) if ids.ndim == 2 and whole else (None, False)
    probs = arrays.get(stage_key(step, layer, "ffn_moe_probs"))
    weights = arrays.get(stage_key(step, layer, "ffn_moe_weights"))
    if probs is None or weights is None:
        return None, False
    probs, weights = np.asarray(probs), np.asarray(weights)
    if (probs.ndim != 2 or weights.ndim != 2 or len(probs) != len(weights)
            or not 1 <= weights.shape[1] <= probs.shape[1]):
        return None, False
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :weights.shape[1]].astype(np.int64)   # [seq_len, k]
    return (ids, True) if np.array_equal(np.take_along_axis(probs, ids, axis=1), weights) else (None, False)


def pair_routes(ours: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], step: int,
                layer: int) -> Routing | None:
    """How both recordings routed (``step``, ``layer``) (:func:`route_ids`), or ``None``: a dense
    layer, a side whose ids are unknown, or ids of two shapes."""
    a, derived_a = route_ids(ours, step, layer)
    b, derived_b = route_ids(ref, step, layer)
    if a is None or b is None or a.shape != b.shape:
        return None
    return Routing(a, b, tuple(side for side, d in (("ours", derived_a), ("reference", derived_b)) if d))


def _route_row(step: int, layer: int, route: Routing) -> Row:
    """``ffn_moe_topk`` scored as ids: ``routing differs`` where any token chose another set."""
    summary = route.summary()
    status = "routing differs" if summary["experts_differ"] else "ok"
    return Row(step, layer, ROUTE, list(route.ours.shape), list(route.ref.shape), None, None, None, None, status,
               routing=summary)


def compare_arrays(ours: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], *,
                   threshold: float | None = None, layers: Iterable[int] | None = None,
                   stages: Iterable[str] | None = None, profile: str = "llama.cpp",
                   model=None) -> Comparison:
    """Pair ``ours`` and ``ref`` by key and measure every pair (a :data:`META_KEY` entry is not a stage).

    With experts, the :data:`SLOT_STAGES` of a (step, layer) whose ids both sides give
    (:func:`pair_routes`) are measured slot by slot *by expert id*, over the tokens that chose the
    same experts in both, and ``ffn_moe_topk`` is scored as ids (module docstring).

    Args:
        ours, ref: arrays keyed by :func:`~llamatrace.tracing.recorder.stage_key`.
        threshold: one relative RMS threshold for every stage (default: ``profile``'s per kind).
        profile: what is compared, a key of :data:`PROFILES`; ``extra["profile"]`` of the result.
        model: the :class:`~llamatrace.model.Llama` both recordings ran (``None``: no local errors).
            Given, every stage :mod:`~llamatrace.analysis.local_error` can recompute is also
            judged by the error it adds, in our recording and in the reference's
            (:data:`LOCAL_THRESHOLDS`), so a stage 5 % off is found under accumulated drift.
        layers: keep only these layers (model-level stages are always kept); ``None`` = all.
        stages: keep only stages matching these ids/globs; ``None`` = all.

    Raises:
        ValueError: a key that is not a stage key.
    """
    limits = thresholds_for(threshold, profile)
    local_ours, local_ref = {}, {}
    if model is not None:
        from llamatrace.analysis.local_error import local_errors
        local_ours, local_ref = local_errors(model, ours), local_errors(model, ref)
    ref_local_limit = LOCAL_THRESHOLDS[model.activations] if model is not None else math.inf
    keep_layers = None if layers is None else frozenset(layers)
    patterns = None if stages is None else list(stages)
    rows = []
    routes: dict[tuple[int, int], Routing | None] = {}
    for key in sorted((set(ours) | set(ref)) - {META_KEY}, key=forward_order):
        step, layer, stage = parse_key(key)
        if keep_layers is not None and layer is not None and layer not in keep_layers:
            continue
        if patterns is not None and not any(fnmatch.fnmatchcase(stage, p) for p in patterns):
            continue
        a, b = ours.get(key), ref.get(key)
        limit = limits[stage_kind(stage)]
        route = None
        if layer is not None and (stage == ROUTE or stage in SLOT_STAGES):
            if (step, layer) not in routes:
                routes[(step, layer)] = pair_routes(ours, ref, step, layer)
            route = routes[(step, layer)]
        if stage == ROUTE and route is not None:
            rows.append(_route_row(step, layer, route))
            continue
        shape = None if a is None else list(np.shape(a))
        ref_shape = None if b is None else list(np.shape(b))
        if a is None or b is None:
            rows.append(Row(step, layer, stage, shape, ref_shape, None, None, None, None,
                            "only ours" if b is None else "only reference"))
        elif shape != ref_shape:
            rows.append(Row(step, layer, stage, shape, ref_shape, None, None, None, limit, "shape mismatch"))
        else:
            summary = None
            if route is not None and tuple(shape[:2]) == route.ours.shape:     # slots paired by expert id
                a, b = route.by_expert(a, b)
                summary = route.summary()
            # no token routed alike: nothing to measure (metrics of empty arrays would say 0)
            rel, max_abs, cos = metrics(a, b) if summary is None or len(a) else (None, None, None)
            own, theirs = local_ours.get(key), local_ref.get(key)
            added = ((own is not None and not own <= LOCAL_THRESHOLDS["ours"])
                     or (theirs is not None and not theirs <= ref_local_limit))
            if rel is None:
                status = "added error" if added else "rerouted"
            else:
                status = "diverged" if not rel <= limit else "added error" if added else "ok"
            rows.append(Row(step, layer, stage, shape, ref_shape, rel, max_abs, cos, limit, status, own, theirs,
                            summary))
    first = next((r for r in rows if r.diverged), None)
    extra = {"profile": "custom" if threshold is not None else profile, "local_errors": model is not None}
    return Comparison(rows, first, limits, extra)


# ---------------------------------------------------------------------------------------------
# llama.cpp's graph tensors → our stages

# llama.cpp name (without "-<layer>") and op → our stage ids; ggml "Qcur-N" labels the matmul,
# the reshape (a view, never read) and the RoPE output
_LLAMACPP_STAGES = {
    ("Qcur", "MUL_MAT"): ("Qcur", "Qcur_heads"), ("Qcur", "ROPE"): ("Qcur_rope",),
    ("Kcur", "MUL_MAT"): ("Kcur", "Kcur_heads"), ("Kcur", "ROPE"): ("Kcur_rope",),
    ("Vcur", "MUL_MAT"): ("Vcur", "Vcur_heads"),
    ("ffn_out", "MUL_MAT"): ("ffn_out",),
}
_SAME_NAME = frozenset(s.llama_cpp for s in STAGES if s.llama_cpp) - {"Qcur", "Kcur", "Vcur", "ffn_out"}
_PER_HEAD_SCALAR = frozenset({"beta_sigmoid", "a_softplus", "gate"})
_PER_HEAD = _PER_HEAD_SCALAR | {"q_conv_predelta", "k_conv_predelta"}
"""The gated DeltaNet's tensors with a head axis (ggml ``[d, H, T]`` or ``[1, H, T]``)."""
_MODEL_NAMES = {"embd": "inp_embd", "inp_embd": "inp_embd", "attn_inp_kq_mask": "kq_mask",
                "result_norm": "result_norm", "result_output": "result_output"}
_LAYER_NAME = re.compile(r"^(.+)-(\d+)$")
_MASK_NAME = "attn_inp_kq_mask"          # what peers.llamacpp names the mask it reads


def llamacpp_stage_arrays(captured: Iterable, step: int, start_pos: int, seq_len: int,
                          config=None) -> dict[str, np.ndarray]:
    """Tensors read from one llama.cpp forward call → our keys and NumPy layouts.

    ``captured`` holds objects with ``name``, ``op`` and a 4-D ``array`` in ggml's dims reversed
    (:class:`llamatrace.peers.llamacpp.Captured`). Layout fixes: rows flattened to
    ``[seq_len, features]``; ``kq``/``kq_soft_max`` trimmed from the padded KV cells to
    ``kv_len = start_pos + seq_len``; the mask trimmed to ``[seq_len, kv_len]`` (prefill only,
    as ours); ``*_heads`` are the matmul split by the RoPE output's head_dim; a fused ``wqkv``
    (``wqkv_b`` with its bias) is split into ``Qcur``, ``Kcur``, ``Vcur`` (``_b``). A second tensor of
    the same name and op (``norm``-like duplicates) keeps the first.

    ``config`` (the file's :class:`~llamatrace.model.config.ModelConfig`; ``None``: Llama) says
    where other architectures' graphs name things differently: a bias add is the last ``Qcur``
    (our ``Qcur_b``, and the heads are of it); Gemma's and Phi-3's ``kq`` is of pre-scaled queries
    (our ``kq_scaled``); ``kq_scaled_2`` is the soft-capped scores, ``sa_out`` the attention
    residual, ``result_output`` the soft-capped logits, gpt-oss's ``attn_post_norm`` our
    ``ffn_norm``; the mask read is layer 0's (the window mask when layer 0 is local). Qwen3.5
    (``qwen35``): ``attn_residual`` is our ``ffn_inp``, its
    ``attn_post_norm`` our ``ffn_norm``, a full-attention layer's ``attn_output`` our ``attn_out``
    (a DeltaNet layer's is a view of the fused delta-rule op, never read); the DeltaNet's
    per-head and per-token tensors (``beta_sigmoid`` ``[1, T, H, 1]``…) become ``[seq_len, …]``.
    """
    from llamatrace.model.config import ARCHITECTURES
    scales_q = config is not None and ARCHITECTURES[config.arch].llamacpp_scales_q
    renamed = {"sa_out": "ffn_inp", "kq_scaled_2": "kq_softcap"}
    if scales_q:
        renamed["kq"] = "kq_scaled"
    if config is not None and config.ffn_norm_post_attention:
        renamed["attn_post_norm"] = "ffn_norm"          # gpt-oss: the FFN's pre-norm
    if config is not None and config.recurrent_layers:
        renamed |= {"attn_residual": "ffn_inp", "attn_post_norm": "ffn_norm", "attn_output": "attn_out",
                    "attn_pregate": "kqv_out"}
    model_names = dict(_MODEL_NAMES, inp_scaled="inp_scaled")
    if config is not None and config.final_softcap:
        model_names["result_output"] = "result_softcap"
    if config is not None and config.is_local(0):
        model_names[_MASK_NAME] = "kq_mask_swa"
    kv_len = start_pos + seq_len
    items = list(captured)
    head_dim: dict[int, int] = {}
    for c in items:
        m = _LAYER_NAME.match(c.name)
        if m and c.op == "ROPE":
            head_dim.setdefault(int(m.group(2)), c.array.shape[-1])
    out: dict[str, np.ndarray] = {}

    def put(layer: int | None, stage: str, array: np.ndarray) -> None:
        out.setdefault(stage_key(step, layer, stage), array)

    for c in items:
        a = c.array
        if c.name in model_names:
            stage = model_names[c.name]
            if stage == "kq_mask_swa":
                put(None, stage, a.reshape(-1, a.shape[-2], a.shape[-1])[0, :seq_len, :kv_len])
            elif stage == "kq_mask":
                if seq_len > 1:
                    put(None, stage, a.reshape(-1, a.shape[-2], a.shape[-1])[0, :seq_len, :kv_len])
            else:
                put(None, stage, a.reshape(-1, a.shape[-1]))
            continue
        m = _LAYER_NAME.match(c.name)
        if not m:
            continue
        base, layer = m.group(1), int(m.group(2))
        if base in ("wqkv", "wqkv_b") and config is not None and not config.attn_output_gate:
            # q|k|v fused (build_qkv's wqkv path): split as the loader splits attn_qkv; the bias
            # add's heads replace the matmul's, as below
            q, kv = config.q_dim, config.kv_dim
            for name, part in zip(("Qcur", "Kcur", "Vcur"), np.split(a.reshape(-1, a.shape[-1]), [q, q + kv], axis=1)):
                out[stage_key(step, layer, name + base[4:])] = part
                if layer in head_dim:
                    out[stage_key(step, layer, f"{name}_heads")] = part.reshape(seq_len, -1, head_dim[layer])
            continue
        if base in ("Qcur", "Kcur", "Vcur") and c.op == "ADD":          # the bias add (Qwen2)
            out[stage_key(step, layer, f"{base}_b")] = a.reshape(-1, a.shape[-1])
            if layer in head_dim:
                out[stage_key(step, layer, f"{base}_heads")] = a.reshape(seq_len, -1, head_dim[layer])
            continue
        if base in _PER_HEAD:                            # [seq_len, heads] or [seq_len, heads, head_dim]
            put(layer, base, a.reshape(seq_len, *((-1,) if base in _PER_HEAD_SCALAR else (-1, a.shape[-1]))))
            continue
        if base in ("Qcur_normed", "Kcur_normed"):
            put(layer, base, a.reshape(seq_len, -1, a.shape[-1]))
            continue
        base = renamed.get(base, base)
        if base == "ffn_up" and config is not None and config.fused_gate_up:
            continue                                     # Phi-3's is gate|up fused: not our ffn_up
        if (base, c.op) in _LLAMACPP_STAGES:
            for stage in _LLAMACPP_STAGES[(base, c.op)]:
                if stage.endswith("_heads"):
                    if layer in head_dim:
                        put(layer, stage, a.reshape(seq_len, -1, head_dim[layer]))
                elif stage.endswith("_rope"):
                    put(layer, stage, a.reshape(seq_len, -1, a.shape[-1]))
                else:
                    put(layer, stage, a.reshape(-1, a.shape[-1]))
        elif base in ("kq", "kq_scaled", "kq_softcap", "kq_soft_max"):
            put(layer, base, a.reshape(-1, a.shape[-2], a.shape[-1])[..., :kv_len])
        elif base == "kqv":
            put(layer, base, a.reshape(-1, a.shape[-2], a.shape[-1]))
        elif base.startswith("ffn_moe_") and base in STAGE_BY_ID:     # ggml [k, n_tokens] or [X, k, n_tokens]
            per_expert = STAGE_BY_ID[base].shape.count(",") == 2
            put(layer, base, a.reshape(seq_len, -1, a.shape[-1]) if per_expert else a.reshape(seq_len, -1))
        elif base in _SAME_NAME or base == "ffn_inp":
            put(layer, base, a.reshape(-1, a.shape[-1]))
    return out


# ---------------------------------------------------------------------------------------------
# running both engines


def run_ours(model, ids: list[int], tokens: int = 0, *, ctx_size: int | None = None
             ) -> tuple[dict[str, np.ndarray], list[int], list[np.ndarray]]:
    """Our prefill of ``ids`` and ``tokens`` greedy decode steps, every stage kept.

    Returns (arrays keyed by :func:`~llamatrace.tracing.recorder.stage_key`, the ``tokens`` ids fed to the
    decode steps, each step's last-row logits float32 ``[vocab_size]``).

    Raises:
        PromptError: the prompt does not fit the context.
    """
    from llamatrace.model.generate import generate
    from llamatrace.tracing.recorder import Recorder
    recorder = Recorder(keep_arrays=True)
    generated = list(generate(model, ids, max_tokens=tokens + 1, ctx_size=ctx_size, recorder=recorder,
                              stop_ids=frozenset()))
    arrays = recorder.arrays()
    n_steps = recorder.step + 1
    last = [arrays[stage_key(s, None, "result_output")][-1] for s in range(n_steps)]
    return arrays, generated[:n_steps - 1], last


def run_llamacpp(path, ids: list[int], fed: list[int], *, threads: int | None = None
                 ) -> tuple[list[list], dict[str, np.ndarray], dict]:
    """llama.cpp's prefill of ``ids`` then one decode step per id of ``fed``, every named tensor read.

    Returns (the captured tensors of each step, the same as our keys and layouts, the settings).

    Raises:
        PeerError: llama-cpp-python is missing or llama.cpp failed.
    """
    from llamatrace.analysis.bench import check_engines
    from llamatrace.errors import PeerError
    from llamatrace.machine.runtime import usable_cpus
    check_engines(["llama.cpp"])
    from llamatrace.peers.llamacpp import LlamaCpp, check_runs_here
    check_runs_here(str(path), threads or usable_cpus())
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    config = ModelConfig.from_gguf(open_gguf(path))
    try:
        engine = LlamaCpp(str(path), len(ids) + len(fed) + 8, threads or usable_cpus(), capture=True)
    except RuntimeError as exc:
        raise PeerError(f"llama.cpp: {exc}") from None
    steps, arrays = [], {}
    try:
        start = 0
        for step, chunk in enumerate([list(ids)] + [[t] for t in fed]):
            try:
                engine.eval(chunk)
            except RuntimeError as exc:
                raise PeerError(f"llama.cpp: {exc}") from None
            steps.append(engine.captured)
            arrays.update(llamacpp_stage_arrays(engine.captured, step, start, len(chunk), config))
            start += len(chunk)
        settings = {"engine": engine.version, **engine.settings}
    finally:
        engine.close()
    return steps, arrays, settings


def run_hf(path, config, ids: list[int], fed: list[int], *,
           threads: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """HF transformers' (fp32) prefill of ``ids`` then one decode step per id of ``fed``, on the
    file at ``path`` whose :class:`~llamatrace.model.config.ModelConfig` is ``config``.

    Returns (its module outputs as our keys and layouts, the settings).

    Raises:
        PeerError: the file's attention tensors are not laid out as the family's usual files
            (fused q|k|v, biases added or left out) or it has LongRoPE factors (transformers
            would not read them), or
            torch/transformers are missing, or the model cannot be loaded.
    """
    from llamatrace.analysis.bench import check_engines
    from llamatrace.errors import PeerError
    from llamatrace.model.config import ARCHITECTURES
    spec = ARCHITECTURES[config.arch]
    odd = [f"{'with' if ours else 'without'} {name}"
           for name, ours, usual in (("q|k|v fused as attn_qkv", config.fused_qkv, spec.fused_qkv),
                                     ("q/k/v biases", config.qkv_bias, spec.qkv_bias),
                                     ("attn_output biases", config.attn_out_bias, spec.attn_out_bias))
           if ours != usual]
    if config.rope_scaling.longrope_ctx:
        odd.append("with LongRoPE factors (rope_factors_long/short)")
    if odd:       # transformers' GGUF loader maps a family's usual tensors only: it would run without them
        raise PeerError(f"hf: this {config.arch} file is {', '.join(odd)}, unlike the family's usual files; "
                        f"transformers' GGUF loader does not read that layout — use --against llama.cpp")
    check_engines(["hf"])
    from llamatrace.peers.hf import HFModel, hf_stage_arrays
    try:
        engine = HFModel(str(path), config, threads)
    except (OSError, ValueError, RuntimeError) as exc:
        raise PeerError(f"hf: {type(exc).__name__}: {exc}") from None
    arrays = {}
    for step, chunk in enumerate([list(ids)] + [[t] for t in fed]):
        engine.eval(chunk)
        arrays.update(hf_stage_arrays(engine.captured, step, config))
    return arrays, engine.settings


def compare_with(model, ids: list[int], tokens: int = 0, *, against: str = "llama.cpp",
                 threshold: float | None = None, layers: Iterable[int] | None = None,
                 stages: Iterable[str] | None = None, threads: int | None = None) -> Comparison:
    """Run ``model`` and ``against`` (``llama.cpp`` or ``hf``) on the same GGUF and ids (decode
    steps fed our greedy tokens) and compare every stage. ``extra`` holds ``reference``,
    ``model``, ``prompt_ids``, ``settings`` and ``argmax`` (per step: our next token and the
    reference's).

    Raises:
        PeerError: the reference engine is missing or failed.
    """
    ours, fed, our_last = run_ours(model, ids, tokens)
    if against == "hf":
        ref, settings = run_hf(model.path, model.config, ids, fed, threads=threads)
    else:
        _, ref, settings = run_llamacpp(model.path, ids, fed, threads=threads)
    result = compare_arrays(ours, ref, threshold=threshold, layers=layers, stages=stages,
                            profile="hf" if against == "hf" else "llama.cpp", model=model)
    argmax = []
    for step, row in enumerate(our_last):
        key = stage_key(step, None, "result_output")
        ref_id = int(np.argmax(ref[key][-1])) if key in ref else None
        argmax.append({"step": step, "ours": int(np.argmax(row)), "reference": ref_id})
    result.extra = {**result.extra, "reference": against, "model": str(model.path), "prompt_ids": list(ids),
                    "settings": settings, "argmax": argmax}
    return result


def compare_with_llamacpp(model, ids: list[int], tokens: int = 0, **options) -> Comparison:
    """:func:`compare_with` against llama.cpp."""
    return compare_with(model, ids, tokens, against="llama.cpp", **options)
