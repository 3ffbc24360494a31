"""Trace events and the scoped recorder the forward pass reports to.

The forward pass calls ``x = emit(stage_id, layer, x)`` once per stage and goes on with what
``emit`` returns (a few stages that no recorder or hook :meth:`~Recorder.watches` are fused
away: a prefill's scores before the softmax, the FFN's gate and up; what follows them is the
same, bit for bit). Without a recorder or hooks, ``emit`` is :func:`null_emit` (returns
``array``): tracing costs one Python call per stage when off. A recorder returns the array it was given, so
the math never changes — recording runs the same kernels on the same arrays, bit for bit;
only hooks (:mod:`llamatrace.tracing.hooks`) replace arrays (TransformerLens' identity-hook idea).
A :class:`Recorder` is scoped — pass it to ``forward``/``generate`` or use
``with model.trace(...) as rec`` — never global state. Filters (layers, stages) are applied
before any copy or statistic is made. ``array`` may also be
a zero-argument function returning the tensor, for a tensor the math itself never needs (the
repeated KV heads): it is only called when the stage is recorded or checked.

Python use (``generate`` is lazy: consume it inside the ``with`` block)::

    from llamatrace import Llama
    model = Llama.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = model.tokenizer.encode("The capital of France is")
    with model.trace(layers=[0], stages=["kq*"], stats=True, keep_arrays=True) as rec:
        tokens = list(model.generate(ids, max_tokens=2))     # prefill (step 0) + one decode step
    for e in rec.events:                                     # TraceEvent, in emission order
        print(e.step, e.layer, e.stage, e.shape, e.stats["rms"])
    scores = rec.arrays()["step0.layer0.kq_soft_max"]        # float32 [n_heads, seq_len, kv_len]

:mod:`llamatrace.views.render` turns the same events into the chapters' log lines, tables, JSON
lines and ``.npz`` files (what ``llamatrace trace`` prints).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np

from llamatrace.errors import NumericalError
from llamatrace.gguf.reader import FUSED_TENSORS, weight_tensor_name
from llamatrace.tracing.stages import STAGE_BY_ID, eval_shape, select_stages, stage_for

Emit = Callable[[str, "int | None", "np.ndarray | Callable[[], np.ndarray]"], Any]


def stage_key(step: int, layer: int | None, stage: str) -> str:
    """``step{S}.layer{L}.{stage}``, or ``step{S}.{stage}`` at model level: the ``.npz`` key
    of ``trace --npz`` and the pairing key of ``llamatrace compare``."""
    if layer is None:
        return f"step{step}.{stage}"
    return f"step{step}.layer{layer}.{stage}"


def call_phase(start_pos: int, seq_len: int) -> str:
    """The phase of a forward call its caller did not name: ``"decode"`` for one token after the
    start (a generation step), ``"prefill"`` for the prompt, or any chunk of it at ``start_pos``
    > 0. (A prefill chunk of one token can only be told apart by its caller: ``forward(phase=)``.)"""
    return "decode" if seq_len == 1 and start_pos > 0 else "prefill"


def null_emit(stage: str, layer: int | None, array):
    """The emit function used when nothing is traced or hooked: returns ``array`` unchanged."""
    return array


@dataclass
class TraceEvent:
    """One stage of one forward call.

    ``shape`` is the array's real NumPy order; ``inputs`` maps the chapter's input tensor names
    (and ``<name> weights``) to their shapes; ``elapsed_us`` is wall time since the previous
    stage ended (the stage's compute; pure views take ~0). ``array`` is a private copy, kept
    only when the recorder was asked to keep arrays.
    """

    step: int
    start_pos: int
    seq_len: int
    layer: int | None
    stage: str
    op: str
    inputs: dict[str, list[int]]
    shape: list[int]
    dtype: str
    elapsed_us: float
    stats: dict[str, Any] | None = None
    values: dict[str, list] | None = None
    array: np.ndarray | None = field(default=None, repr=False)
    phase: str = "prefill"          # of the forward call: "prefill" or "decode" (:func:`call_phase`)
    rows: list | None = None        # the values of a routing stage (Stage.routing), as nested lists

    @property
    def key(self) -> str:
        """``step{S}.layer{L}.{stage}`` or ``step{S}.{stage}`` at model level (:func:`stage_key`)."""
        return stage_key(self.step, self.layer, self.stage)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "event", "step": self.step, "start_pos": self.start_pos, "layer": self.layer,
            "stage": self.stage, "op": self.op, "inputs": self.inputs, "shape": self.shape,
            "dtype": self.dtype, "elapsed_us": round(self.elapsed_us, 3),
        }
        if self.stats is not None:
            out["stats"] = self.stats
        if self.values is not None:
            out["values"] = self.values
        if self.rows is not None:                 # the router's choice: each token's experts or weights
            out["rows"] = self.rows
        return out


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN/Inf: non-finite numbers become ``None`` (the nan/inf counts say why)."""
    return value if math.isfinite(value) else None


def finite_json(value: Any) -> Any:
    """``value`` for JSON: through dicts, lists and tuples, every NaN or infinite float (Python or
    NumPy) becomes ``None`` and NumPy scalars and arrays become Python ones."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def tensor_stats(array: np.ndarray) -> dict[str, Any]:
    """sum, mean, rms, min, max, abs_max over finite values (float64), and nan/inf counts.

    Complex arrays (``freqs_cis``) are summarised by their magnitude. Integer arrays are ids (the
    chosen experts), whose sum and mean mean nothing: min and max, how many ``distinct`` ids, and
    the ``most`` frequent one with its ``most_count`` (sum, mean, rms and abs_max None).
    """
    if array.dtype.kind in "iu":
        ids, counts = np.unique(array, return_counts=True)
        top = int(np.argmax(counts)) if ids.size else 0
        return {**dict.fromkeys(("sum", "mean", "rms", "abs_max")),
                "min": int(ids[0]) if ids.size else None, "max": int(ids[-1]) if ids.size else None,
                "distinct": int(ids.size), "most": int(ids[top]) if ids.size else None,
                "most_count": int(counts[top]) if ids.size else 0, "nan": 0, "inf": 0}
    a = np.abs(array) if np.iscomplexobj(array) else array
    a = np.asarray(a, dtype=np.float64).ravel()
    finite = np.isfinite(a)
    n_nan = int(np.isnan(a).sum())
    n_inf = int((~finite).sum()) - n_nan
    v = a if n_nan + n_inf == 0 else a[finite]
    if v.size == 0:
        nums = dict.fromkeys(("sum", "mean", "rms", "min", "max", "abs_max"))
    else:
        nums = {
            "sum": float(v.sum()), "mean": float(v.mean()), "rms": float(np.sqrt(np.mean(v * v))),
            "min": float(v.min()), "max": float(v.max()), "abs_max": float(np.abs(v).max()),
        }
        nums = {k: finite_or_none(x) for k, x in nums.items()}
    return {**nums, "nan": n_nan, "inf": n_inf}


def _state_stats(stage, array: np.ndarray) -> dict[str, Any]:
    """A recurrent state's stages (op ``State``: ``state_predelta``, ``new_state``) also report
    each head's norm and top singular value (:func:`~llamatrace.kernels.ops.deltanet.state_summary`)."""
    if stage.op != "State":
        return {}
    from llamatrace.kernels.ops.deltanet import state_summary
    return state_summary(array)


def head_tail(array: np.ndarray, k: int) -> dict[str, list]:
    """The first and last ``k`` values of the flattened array (non-finite → None); an array of at
    most ``2k`` values has them all in ``head`` and an empty ``tail`` (no value twice)."""
    flat = np.asarray(array).ravel()
    if np.iscomplexobj(flat):
        conv = lambda z: [finite_or_none(float(z.real)), finite_or_none(float(z.imag))]  # noqa: E731
    else:
        conv = lambda z: finite_or_none(float(z))  # noqa: E731
    if flat.size <= 2 * k:
        return {"head": [conv(z) for z in flat], "tail": []}
    return {"head": [conv(z) for z in flat[:k]], "tail": [conv(z) for z in flat[-k:]] if k else []}


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)``, cached: NumPy builds the name anew on every call (~3 µs, per event)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _finite(stage_id: str, array: np.ndarray) -> bool:
    """No NaN/Inf; the masks and masked scores hold -inf by design, so only NaN/+inf count there."""
    if STAGE_BY_ID[stage_id].when == "masked" or stage_id == "kq_mask_swa":
        return not (np.isnan(array).any() or np.isposinf(array).any())
    return bool(np.isfinite(array).all())


class EventSink(Protocol):
    def __call__(self, event: TraceEvent) -> None: ...


class Recorder:
    """Collects trace events from forward calls, filtered by layer and stage.

    Args:
        layers: layer indices to trace (``None`` = all); model-level stages are always eligible.
        stages: stage ids or globs (``None`` = all).
        stats: compute :func:`tensor_stats` per event.
        values: keep the first/last ``values`` numbers of each tensor.
        keep_arrays: keep a copy of each traced tensor (for ``.npz`` output or Python users).
        keep_events: keep events in :attr:`events` (turn off when streaming huge traces).
        check_finite: raise :class:`NumericalError` at the first stage (traced or not) whose
            output holds NaN/Inf.
        sinks: callables receiving each event as it is recorded (JSONL writer, live log).
        time_all: accumulate every stage's time in :attr:`stage_times`, traced or filtered out
            (the ``--timings`` roll-up covers the whole forward pass, not only what is shown).

    Raises:
        ValueError: an unknown stage pattern.
    """

    def __init__(self, layers: Iterable[int] | None = None, stages: Iterable[str] | None = None, *,
                 stats: bool = False, values: int = 0, keep_arrays: bool = False,
                 keep_events: bool = True, check_finite: bool = False,
                 sinks: Iterable[EventSink] = (), time_all: bool = False) -> None:
        self.layers = None if layers is None else frozenset(int(x) for x in layers)
        self.stage_ids = select_stages(None if stages is None else list(stages))
        self.stats = stats
        self.values = int(values)
        self.keep_arrays = keep_arrays
        self.keep_events = keep_events
        self.check_finite = check_finite
        self.sinks = list(sinks)
        self.events: list[TraceEvent] = []
        self.time_all = time_all
        # (phase, stage id) → [total µs, calls]; phase "prefill" or "decode" (:func:`call_phase`)
        self.stage_times: dict[tuple[str, str], list[float]] = {}
        self.step = -1
        self._dims: dict[str, int] = {}
        self._features: frozenset[str] = frozenset()
        self._weight_shapes: Mapping[str, tuple[int, ...]] = {}
        self._input_cache: dict[str, list[tuple[str, tuple[int, ...]]]] = {}

    def wants(self, layer: int | None, stage: str) -> bool:
        if stage not in self.stage_ids:
            return False
        return layer is None or self.layers is None or layer in self.layers

    def watches(self, layer: int | None, stage: str) -> bool:
        """Whether this recorder reads the stage's output at ``layer``: records it, checks it for
        NaN/Inf or times it. The forward pass may skip a stage nothing watches (it computes the
        masked attention probabilities without the masked scores; the ``kq`` stage holds them)."""
        return self.check_finite or self.time_all or self.wants(layer, stage)

    def begin(self, start_pos: int, seq_len: int, dims: Mapping[str, int],
              weight_shapes: Mapping[str, tuple[int, ...]], phase: str | None = None,
              features: frozenset[str] = frozenset()) -> Emit:
        """Start one forward call (one ``step``) and return its ``emit`` function.

        ``dims`` holds the shape variables of :data:`llamatrace.tracing.stages.SHAPE_VARS`;
        ``weight_shapes`` maps GGUF tensor names to ``[out_features, in_features]`` / ``[n]``;
        ``phase`` is the call's, ``"prefill"`` or ``"decode"`` (``None``: :func:`call_phase`);
        ``features`` the model's (:attr:`ModelConfig.features`: an event's op is the stage's as that
        model computes it, :func:`~llamatrace.tracing.stages.stage_for`).

        Raises:
            ValueError: another ``phase``.
        """
        if phase not in (None, "prefill", "decode"):
            raise ValueError(f"phase={phase!r}: give 'prefill', 'decode' or None")
        self.step += 1
        step = self.step
        self._dims = dict(dims)
        self._weight_shapes = weight_shapes
        self._features = frozenset(features)
        self._input_cache = {}
        clock = time.perf_counter
        last = clock()
        times = self.stage_times if self.time_all else None
        phase = phase or call_phase(start_pos, seq_len)

        def emit(stage_id: str, layer: int | None, array: np.ndarray):
            nonlocal last
            now = clock()
            if times is not None:
                acc = times.setdefault((phase, stage_id), [0.0, 0])
                acc[0] += (now - last) * 1e6
                acc[1] += 1
            wanted = self.wants(layer, stage_id)
            if callable(array) and (wanted or self.check_finite):
                array = array()           # a tensor the math never needs (keys_rep): made for the trace only
            bad = self.check_finite and not _finite(stage_id, array)
            if wanted:                    # a stage that fails the check is recorded first: the evidence
                self._record(step, start_pos, seq_len, layer, stage_id, array, (now - last) * 1e6, phase)
                last = clock()            # recording's own cost is not billed to the next stage
            else:
                last = now
            if bad:
                where = "model level" if layer is None else f"layer {layer}"
                raise NumericalError(
                    f"non-finite values (NaN/Inf) in stage {stage_id!r} at {where}, step {step} "
                    f"(start_pos {start_pos}): inspect it with --stage {stage_id} --stats")
            return array

        return emit

    def input_shapes(self, stage_id: str, layer: int | None, out_rows: int | None = None) -> dict[str, list[int]]:
        """The event's ``inputs``: chapter input names → shapes, weights as ``"<name> weights"``.

        A weight read from a fused tensor (``attn_qkv``, its bias, Phi-3's ``ffn_up``) is given as
        the rows the stage uses, ``[out_rows, in_features]`` (a bias ``[out_rows]``): ``out_rows`` is
        the stage output's last dim."""
        stage = STAGE_BY_ID[stage_id]
        shapes = self._input_cache.get(stage_id)
        if shapes is None:        # formulas depend only on the step's dims: evaluate once per step
            shapes = self._input_cache[stage_id] = [(n, eval_shape(f, self._dims)) for n, f in stage.inputs]
        out = {name: list(shape) for name, shape in shapes}
        for name, suffix in stage.weights:
            tensor = weight_tensor_name(suffix, layer, self._weight_shapes)[0]
            shape = self._weight_shapes.get(tensor)
            if shape is not None:
                fused = out_rows is not None and tensor.endswith(FUSED_TENSORS)
                out[f"{name} weights"] = [out_rows, *shape[1:]] if fused else list(shape)
        return out

    def _record(self, step: int, start_pos: int, seq_len: int, layer: int | None, stage_id: str,
                array: np.ndarray, elapsed_us: float, phase: str) -> None:
        stage = stage_for(stage_id, self._features)
        event = TraceEvent(
            step=step, start_pos=start_pos, seq_len=seq_len, layer=layer, stage=stage_id, op=stage.op,
            inputs=self.input_shapes(stage_id, layer, array.shape[-1] if array.ndim else None), shape=list(array.shape), dtype=_dtype_name(array.dtype),
            elapsed_us=elapsed_us,
            stats=(tensor_stats(array) | _state_stats(stage, array)) if self.stats else None,
            values=head_tail(array, self.values) if self.values else None,
            array=np.array(array, copy=True) if self.keep_arrays else None, phase=phase,
            rows=np.asarray(array).tolist() if stage.routing else None,
        )
        if self.keep_events:
            self.events.append(event)
        for sink in self.sinks:
            sink(event)

    def arrays(self) -> dict[str, np.ndarray]:
        """Kept tensors keyed like the ``.npz`` file (``step0.layer0.attn_norm``)."""
        return {e.key: e.array for e in self.events if e.array is not None}
