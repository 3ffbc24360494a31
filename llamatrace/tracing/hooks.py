"""Interventions: replace a stage's output where the forward pass emits it (TransformerLens-style).

``with model.hooks({"attn_out": fn}, layers=[3]):`` calls ``fn(array, event)`` on every forward
call made inside the block, right where layer 3's ``attn_out`` is emitted; what ``fn`` returns
(an array of the same shape and dtype, or ``None`` to keep the array, possibly changed in place)
is what every later stage computes with — and what a recorder records. Only stages the
catalogue marks ``replaceable`` can be hooked: the views and lazy copies (``keys``,
``Qcur_heads``...) are not arrays the math goes on with.

Activation patching — record a stage on prompt A, patch it into prompt B (same length)::

    with model.trace(stages=["attn_out"], layers=[3], keep_arrays=True) as rec:
        model.forward(ids_a, 0, model.new_cache(len(ids_a)))
    saved = rec.arrays()["step0.layer3.attn_out"]
    with model.hooks({"attn_out": lambda a, e: saved}, layers=[3]):
        logits = model.forward(ids_b, 0, model.new_cache(len(ids_b)))

:func:`zero_ablation` builds the ``fn`` of the CLI's ``--ablate STAGE@LAYER[:HEAD]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

from llamatrace.errors import HookError, OptionError
from llamatrace.tracing.stages import STAGE_BY_ID, STAGES, Stage, unknown_hint
from llamatrace.tracing.recorder import Emit

REPLACEABLE_IDS: tuple[str, ...] = tuple(s.id for s in STAGES if s.replaceable)


@dataclass(frozen=True)
class HookEvent:
    """Where a hook is called: the stage, its layer (``None`` at model level), the forward call
    within the ``with`` block (``step`` 0 = the first, a prefill in ``generate``), and the
    call's ``start_pos`` / ``seq_len``."""

    stage: str
    layer: int | None
    step: int
    start_pos: int
    seq_len: int


HookFn = Callable[[np.ndarray, HookEvent], "np.ndarray | None"]


def check_replaceable(stage_id: str, what: str = "hook") -> Stage:
    """The catalogue row of a stage that may be replaced.

    Raises:
        OptionError: an unknown stage id, or one that is a view or lazy copy (the message
            names the replaceable stage to use instead).
    """
    stage = STAGE_BY_ID.get(stage_id)
    if stage is None:
        raise OptionError(f"{what}: unknown stage {stage_id!r}{unknown_hint(stage_id, REPLACEABLE_IDS)}")
    if not stage.replaceable:
        raise OptionError(f"{what}: stage {stage_id!r} is not an array of its own ({stage.description.rstrip('.')}) "
                          f"and cannot be replaced; replaceable stages: {', '.join(REPLACEABLE_IDS)}")
    return stage


class Hooks:
    """One ``with model.hooks(...)`` block (build it through :meth:`llamatrace.model.Llama.hooks`).

    Args:
        fns: stage id → ``fn(array, event)`` returning a replacement of the same shape and
            dtype, or ``None`` to go on with ``array`` (which ``fn`` may have changed in place).
        layers: layer indices whose layer stages are hooked (``None`` = all).
        n_layers: the model's layer count, to check ``layers``.

    Raises:
        OptionError: an unknown or non-replaceable stage, or a layer out of range.
    """

    def __init__(self, fns: Mapping[str, HookFn], layers: Iterable[int] | None, n_layers: int) -> None:
        for stage_id, fn in fns.items():
            check_replaceable(stage_id)
            if not callable(fn):
                raise OptionError(f"hook for {stage_id!r} is not callable: give fn(array, event)")
        self.fns = dict(fns)
        self.layers = None if layers is None else frozenset(int(x) for x in layers)
        bad = sorted(x for x in self.layers or () if not 0 <= x < n_layers)
        if bad:
            raise OptionError(f"hook layers {bad} out of range: this model has {n_layers} layers (0-{n_layers - 1})")
        self.step = -1

    def watches(self, layer: int | None, stage: str) -> bool:
        """Whether a hook of this block runs at the stage at ``layer`` (see
        :meth:`llamatrace.tracing.recorder.Recorder.watches`)."""
        return stage in self.fns and (layer is None or self.layers is None or layer in self.layers)

    def begin(self, emit: Emit, start_pos: int, seq_len: int) -> Emit:
        """Start one forward call: an ``emit`` that applies the hooks, then passes on to ``emit``."""
        self.step += 1
        step, fns, layers = self.step, self.fns, self.layers

        def hooked(stage_id: str, layer: int | None, array):
            fn = fns.get(stage_id)
            if fn is not None and (layer is None or layers is None or layer in layers):
                array = _apply(fn, array, HookEvent(stage_id, layer, step, start_pos, seq_len))
            return emit(stage_id, layer, array)

        return hooked


def _apply(fn: HookFn, array: np.ndarray, event: HookEvent) -> np.ndarray:
    out = fn(array, event)
    if out is None:
        return array
    out = np.asarray(out)
    if out.shape != array.shape or out.dtype != array.dtype:
        where = "" if event.layer is None else f" layer {event.layer}"
        raise HookError(f"the hook on {event.stage!r}{where} returned {out.dtype} {list(out.shape)}; it must "
                        f"return {array.dtype} {list(array.shape)} like its input, or None to keep it")
    return np.ascontiguousarray(out)


HEAD_WORDS = {"n_heads": "query", "n_kv_heads": "KV", "ssm_n_v_heads": "value", "ssm_n_k_heads": "key"}
"""The heads axes a head can be ablated on (their shape variable) and what their heads are: softmax
attention's query and KV heads, a gated DeltaNet's value and key heads."""


def head_axis(stage: Stage) -> tuple[int, str] | None:
    """``(axis, shape variable)`` of the stage's heads axis (one of :data:`HEAD_WORDS`), or ``None``
    if it has none."""
    terms = [t.strip() for t in stage.shape.strip()[1:-1].split(",")]
    for axis, term in enumerate(terms):
        if term in HEAD_WORDS:
            return axis, term
    return None


def zero_ablation(stage_id: str, head: int | None = None) -> HookFn:
    """A hook that zeroes the stage's output, or only one head of it (``head`` indexes the stage's
    heads axis: a query head for ``[.., n_heads, ..]`` stages, a KV head for ``[.., n_kv_heads, ..]``,
    a DeltaNet's value or key head for ``ssm_n_v_heads`` / ``ssm_n_k_heads``).

    Raises:
        OptionError: the stage is not replaceable, or ``head`` is given for a stage without a heads
            axis; when the hook runs, ``head`` out of range.
    """
    stage = check_replaceable(stage_id, "--ablate")
    if head is None:
        return lambda array, event: np.zeros_like(array)
    found = head_axis(stage)
    if found is None:
        with_heads = [s.id for s in STAGES if s.replaceable and head_axis(s)]
        raise OptionError(f"--ablate {stage_id}:{head}: {stage_id} {stage.shape} has no heads axis; "
                          f"a head can be ablated in {', '.join(with_heads)}")
    axis = found[0]

    def zero_head(array: np.ndarray, event: HookEvent) -> np.ndarray:
        if head >= array.shape[axis]:
            raise OptionError(f"--ablate {stage_id}:{head}: head out of range; {stage_id} has "
                              f"{array.shape[axis]} heads (0-{array.shape[axis] - 1})")
        out = array.copy()
        index = [slice(None)] * array.ndim
        index[axis] = head
        out[tuple(index)] = 0
        return out

    return zero_head

