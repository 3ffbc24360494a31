"""What a diagram draws of a run: :class:`RunInfo` (facts the events do not carry), the wiring
of the drawn stages (each input to the stage that produced it), and :func:`trace_step`, which
runs the model to get the events of one step.

An input of a stage is wired to the latest earlier stage whose chapter name it uses, or to the
producer the catalogue names in ``Stage.sources`` where the chapter's name is a function-local
one. An input shaped ``[max_seq, …]`` is the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from llamatrace.errors import OptionError
from llamatrace.model.config import ModelConfig
from llamatrace.tracing.recorder import TraceEvent
from llamatrace.tracing.stages import Stage
from llamatrace.views.diagram.highlight import BLOCK_IN, KV_CACHE, TOKENS


@dataclass(frozen=True)
class RunInfo:
    """What the picture says about the run beyond its events.

    ``weights`` maps GGUF tensor names to ``(quant type, shape [out_features, in_features])``.
    ``input_ids`` are the ids fed at this step (the prompt at step 0, one sampled id later);
    ``sampled`` is ``(id, text)`` of the token chosen from this step's logits.
    """

    model_name: str
    config: ModelConfig
    weights: Mapping[str, tuple[str, tuple[int, ...]]]
    prompt: str
    chat: bool
    step: int
    layer: int
    max_seq: int
    input_ids: tuple[int, ...]
    n_prompt: int = 0
    input_text: str = ""
    sampled: tuple[int, str] | None = None
    stop_ids: frozenset[int] = frozenset()


def shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


@dataclass
class Flow:
    """Resolved wiring of the drawn stages: edges (producer, consumer, tensor name, note)."""

    drawn: list[Stage]
    events: dict[str, TraceEvent]
    edges: list[tuple[str, str, str, str]] = field(default_factory=list)


def wire(drawn: list[Stage], events: dict[str, TraceEvent], view: str, local: bool = False) -> Flow:
    """Connect each drawn stage's inputs to their producers (see the module docstring).

    A ``sources`` entry may name alternatives, ``"attn_post_norm|attn_out"``: the first that ran.
    ``local``: the drawn layer attends through the sliding window, so its mask is ``kq_mask_swa``.
    """
    flow = Flow(drawn, events)
    seen: list[Stage] = []
    for stage in drawn:
        ev = events[stage.id]
        for name, formula in stage.inputs:
            note = ""
            if formula.startswith("[max_seq"):                # the KV cache, written or read
                span = f"[{ev.start_pos}:{ev.start_pos + ev.seq_len}]" if stage.op == "SetSlice" \
                    else f"[0:{ev.start_pos + ev.seq_len}]"
                if stage.op == "SetSlice":
                    flow.edges.append((stage.id, KV_CACHE, f"{name}{span}", "cache"))
                else:
                    flow.edges.append((KV_CACHE, stage.id, f"{name}{span}", "cache"))
                continue
            producer = dict(stage.sources).get(name)
            if producer is not None:
                producer = next((p for p in producer.split("|") if p in events), None)
            if name == "mask" and local and "kq_mask_swa" in events:
                producer = "kq_mask_swa"
            if producer is None:
                producer = next((p.id for p in reversed(seen) if p.chapter == name), None)
            if producer is None:
                if stage.level == "layer":
                    producer = BLOCK_IN                       # the block's input x
                elif stage.id == "inp_embd":
                    producer = TOKENS if view == "model" else None
                else:
                    producer = "l_out" if "l_out" in events else None   # after the last block
            if producer is None:
                continue
            produced = events[producer].shape if producer in events else None
            wanted = ev.inputs.get(name)
            if produced is not None and wanted is not None and list(wanted) != list(produced) \
                    and sorted(wanted) == sorted(produced):
                note = "transposed"
            kind = "resid" if stage.residual and producer in (BLOCK_IN, "ffn_inp") else note
            label = name if note != "transposed" else f"{name} transposed\\n{shape_text(wanted)}"
            flow.edges.append((producer, stage.id, label, kind))
        seen.append(stage)
    return flow



def cache_for_steps(model, n_prompt: int, steps: int, ctx_size: int | None, option: str) -> int:
    """The KV cache capacity for a prompt of ``n_prompt`` tokens and ``steps`` decode steps:
    ``ctx_size``, or by default room for 256 steps (at most the model's context).

    Raises:
        PromptError: the prompt is longer than the context.
        OptionError: ``ctx_size`` cannot hold the steps (the message names ``option``).
    """
    from llamatrace.model.generate import check_prompt_fits, default_ctx_size

    ctx = ctx_size or default_ctx_size(model, n_prompt, max(256, steps + 1))
    check_prompt_fits(model, n_prompt, ctx)
    if n_prompt + steps > ctx:
        raise OptionError(f"{option} {steps} needs {n_prompt + steps} cache positions ({n_prompt} prompt tokens "
                          f"+ {steps} decode steps) but "
                          + (f"the model's context length is {model.config.max_seq_len}: give a smaller {option}"
                             if n_prompt + steps > model.config.max_seq_len else
                             f"the KV cache holds {ctx}; raise --ctx-size (at most the model's "
                             f"{model.config.max_seq_len})"))
    return ctx


def trace_step(model, prompt: str, prompt_ids: Sequence[int], *, chat: bool, layer: int = 0, step: int = 0,
               stats: bool = False, ctx_size: int | None = None) -> tuple[list[TraceEvent], RunInfo]:
    """Run the prompt (step 0) and ``step`` greedy decode steps, tracing ``layer``.

    Returns the events of ``step`` and the :class:`RunInfo` a diagram needs. End-of-turn tokens
    do not stop the run early, so any ``step`` that fits in the cache can be drawn.

    Raises:
        OptionError: ``layer``/``step`` out of range or a cache too small for ``step``.
        PromptError: an empty prompt or one longer than the context.
    """
    from llamatrace.model.generate import generate

    c = model.config
    if not 0 <= layer < c.n_layers:
        raise OptionError(f"--layer {layer}: the model has layers 0-{c.n_layers - 1}")
    if step < 0:
        raise OptionError(f"--step must be 0 (prefill) or a decode step number, got {step}")
    ctx = cache_for_steps(model, len(prompt_ids), step, ctx_size, "--step")
    with model.trace(layers=[layer], stats=stats) as rec:
        tokens = list(generate(model, list(prompt_ids), max_tokens=step + 1, ctx_size=ctx,
                               stop_ids=frozenset()))
    events = [e for e in rec.events if e.step == step]
    return events, run_info(model, prompt, prompt_ids, tokens, chat=chat, layer=layer, step=step, ctx=ctx)


def run_info(model, prompt: str, prompt_ids: Sequence[int], tokens: Sequence[int], *, chat: bool, layer: int,
             step: int, ctx: int) -> RunInfo:
    """The :class:`RunInfo` of ``step`` of a greedy run that generated ``tokens`` (ids, one per step)."""
    from llamatrace.gguf.reader import tensor_type_name

    tok = model.tokenizer
    n_prompt = len(prompt_ids)
    fed = tuple(prompt_ids) if step == 0 else (tokens[step - 1],)
    weights = {name: (tensor_type_name(t), tuple(model.weight_shapes[name]))
               for name, t in model.file.tensors.items()}
    sampled = (tokens[step], tok.decode([tokens[step]])) if len(tokens) > step else None
    return RunInfo(model_name=Path(model.path).name, config=model.config, weights=weights, prompt=prompt,
                   chat=chat, step=step, layer=layer, max_seq=ctx, input_ids=fed, n_prompt=n_prompt,
                   input_text=tok.decode(list(fed)) if step else "", sampled=sampled,
                   stop_ids=frozenset(tok.stop_ids))
