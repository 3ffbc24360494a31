"""Views of trace events: the chapters' log lines, rich tables, JSON lines, ``.npz``, timings.

Every view reads :class:`~llamatrace.tracing.recorder.TraceEvent` objects and the stage catalogue
(:mod:`llamatrace.tracing.stages`); the wording of the log lines lives only in ``Stage.lines``. The
views are :class:`~llamatrace.tracing.recorder.Recorder` sinks, so they render live as the forward pass
runs — ``llamatrace trace`` is a thin wrapper around them::

    from llamatrace import Llama
    from llamatrace.views.render import LineFormatter, LogView
    from rich.console import Console

    model = Llama.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = model.tokenizer.encode("The capital of France is")
    view = LogView(Console(), LineFormatter.for_model(model, max_seq=len(ids) + 2))
    with model.trace(layers=[0], stages=["kq*"], sinks=[view]) as rec:
        list(model.generate(ids, max_tokens=2))              # generate is lazy: consume it here

Shapes print the chapter's way, ``[5 576]``; weights print ``[out_features in_features]``.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llamatrace.outputs import OutputStream, write_atomic
from llamatrace.model.sampling import softmax64
from llamatrace.text.tokenizer import quoted
from llamatrace.tracing.stages import GROUPS, STAGE_BY_ID, STAGES, eval_shape, stage_applies, stage_for
from llamatrace.tracing.recorder import TraceEvent, finite_or_none

SCHEMA = "llamatrace.trace/1"
STAT_KEYS = ("sum", "mean", "rms", "min", "max", "abs_max")

_FIELD = re.compile(r"\{(\[[^\]]*\]|\w+)\}")
_SHAPE_RE = r"\[[\d ]*\]"
_STAGE_INDEX = {s.id: i for i, s in enumerate(STAGES)}


def fmt_shape(shape: Iterable[int]) -> str:
    """``(5, 576)`` → ``[5 576]``, the Go-slice notation of the book's debug.log."""
    return "[" + " ".join(str(int(n)) for n in shape) + "]"


# ---- the chapters' log lines ------------------------------------------------------------------
class LineFormatter:
    """Fills ``Stage.lines`` templates from one event: ``Calling RMSNorm for tensor x shape([5 576]) ...``.

    Args:
        shape_vars: ``(start_pos, seq_len) → {shape variable: int}`` (``Llama.shape_vars`` bound to
            the cache size), so ``{[formula]}`` fields evaluate for each event's chunk.
        n_layers: for the ``layer: 1 / 30`` wording (the chapter counts layers from 1).
        selected: stage ids being traced; a ruled-out stage prints its ``skip_lines`` only when
            it was asked for.
        features, local_layers: the model's architecture features and sliding-window layers
            (:class:`~llamatrace.model.config.ModelConfig`), which decide what a chunk runs.
    """

    def __init__(self, shape_vars: Callable[[int, int], Mapping[str, int]], n_layers: int,
                 selected: Iterable[str] | None = None, features: frozenset[str] = frozenset(),
                 local_layers: Iterable[int] = ()) -> None:
        self.shape_vars = shape_vars
        self.n_layers = n_layers
        self.selected = frozenset(STAGE_BY_ID if selected is None else selected)
        self.features = features
        self.local_layers = frozenset(local_layers)

    @classmethod
    def for_model(cls, model, max_seq: int, selected: Iterable[str] | None = None) -> "LineFormatter":
        c = model.config
        return cls(lambda start_pos, seq_len: model.shape_vars(start_pos, seq_len, max_seq),
                   c.n_layers, selected, c.features, c.local_layers if c.sliding_window else ())

    def lines(self, event: TraceEvent) -> list[str]:
        """The event's log lines, preceded by those of stages ruled out just before it."""
        dims = self.shape_vars(event.start_pos, event.seq_len)
        out = [self._fill(t, event, dims) for t in self._skipped_before(event, dims)]
        out += [self._fill(t, event, dims) for t in stage_for(event.stage, self.features).lines]
        return out

    def _skipped_before(self, event: TraceEvent, dims: Mapping[str, int]) -> list[str]:
        # walk back over the catalogue stages this chunk does not run (kq_masked when seq_len is 1)
        templates: list[str] = []
        i = _STAGE_INDEX[event.stage] - 1
        local = event.layer in self.local_layers
        while i >= 0 and not stage_applies(STAGES[i], dims["seq_len"], dims["n_rep"], self.features, local):
            if STAGES[i].id in self.selected:
                templates[:0] = STAGES[i].skip_lines
            i -= 1
        return templates

    def _fill(self, template: str, event: TraceEvent, dims: Mapping[str, int]) -> str:
        end_pos = event.start_pos + event.seq_len
        scalars = {"layer": event.layer, "layer1": None if event.layer is None else event.layer + 1,
                   "n_layers": self.n_layers, "start_pos": event.start_pos, "end_pos": end_pos,
                   "seq_len": event.seq_len, "n_rep": dims["n_rep"], "max_seq": dims.get("max_seq"),
                   "longrope_ctx": dims.get("longrope_ctx")}

        def field(m: re.Match) -> str:
            name = m.group(1)
            if name.startswith("["):
                return fmt_shape(eval_shape(name, dims))
            if name == "out":
                return fmt_shape(event.shape)
            if name in event.inputs:
                return fmt_shape(event.inputs[name])
            if name.startswith("w_"):
                shape = event.inputs.get(f"{name[2:]} weights")
                return "[?]" if shape is None else fmt_shape(shape)
            if name == "mask":   # the mask a block receives: none for one query row, but a window's always
                masked = event.seq_len > 1 or event.layer in self.local_layers
                return fmt_shape((event.seq_len, end_pos) if masked else ())
            if name in scalars:
                return str(scalars[name])
            raise KeyError(f"stage {event.stage!r}: unknown field {{{name}}} in log-line template {template!r}")

        return _FIELD.sub(field, template)


def fmt_stats(stats: Mapping[str, Any]) -> str:
    """``sum … mean … rms … min … max … abs_max … nan 0 inf 0`` (``—`` = no finite value); ids
    (:func:`~llamatrace.tracing.recorder.tensor_stats` of an integer array): ``ids 2…124  distinct 37
    most 85 ×4``."""
    if "distinct" in stats:
        return (f"ids {stats['min']}…{stats['max']}  distinct {stats['distinct']}  "
                f"most {stats['most']} ×{stats['most_count']}")
    parts = [f"{k} {'—' if stats.get(k) is None else format(stats[k], '.6g')}" for k in STAT_KEYS]
    parts += [f"{k} {stats.get(k, 0)}" for k in ("nan", "inf")]
    for k in ("head_norm", "head_top_singular"):           # a recurrent state's, per head
        if k in stats:
            parts.append(f"{k} [{' '.join(format(v, '.4g') for v in stats[k])}]")
    return "  ".join(parts)


def fmt_values(values: Mapping[str, list]) -> str:
    def one(v):
        return "—" if v is None else (f"{v[0]:.4g}{v[1]:+.4g}j" if isinstance(v, list) else f"{v:.4g}")
    if not values["tail"]:                      # a small tensor: every value (head_tail)
        return f"values [{', '.join(map(one, values['head']))}]"
    return f"head [{', '.join(map(one, values['head']))}] … tail [{', '.join(map(one, values['tail']))}]"


def fmt_us(us: float) -> str:
    """A duration in microseconds as text: ``"480 µs"`` below 10 ms, else ``"12.5 ms"``."""
    return f"{us:.0f} µs" if us < 10_000 else f"{us / 1000:.1f} ms"


class LogView:
    """Sink printing each event as the chapter's log lines, live.

    ``plain=True`` is ``--dump-shapes``: exactly the template lines (shapes only, no step rules,
    stats, times or colours) — deterministic, so it serves as a golden file.
    """

    def __init__(self, console: Console, formatter: LineFormatter, *, plain: bool = False) -> None:
        self.console = console
        self.formatter = formatter
        self.plain = plain
        self._step = None
        self._route: tuple[tuple, list] | None = None     # ((step, layer), ids) of the last ffn_moe_topk

    def __call__(self, event: TraceEvent) -> None:
        lines = self.formatter.lines(event)
        # one console.print per event: rich's per-call cost, not the text, dominates a long trace
        if self.plain:              # exact text, nothing for rich to style or wrap
            self.console.file.write("".join(line + "\n" for line in lines))
            return
        if event.step != self._step:
            self._step = event.step
            n = event.seq_len
            self.console.rule(f"[bold]step {event.step}[/] · {event.phase} · start_pos {event.start_pos} · "
                              f"{n} token{'s' if n != 1 else ''}", style="dim")
        text = Text("\n".join(lines + self._route_lines(event)))
        text.highlight_regex(_SHAPE_RE, "cyan")
        where = "" if event.layer is None else f"L{event.layer} "
        text.append(f"\n    ↳ {where}{event.stage} {event.dtype} · {fmt_us(event.elapsed_us)}", style="dim")
        if event.stats is not None:
            text.append("\n      " + fmt_stats(event.stats), style="dim green")
        if event.values is not None:
            text.append("\n      " + fmt_values(event.values), style="dim green")
        self.console.print(text)


    def _route_lines(self, event: TraceEvent) -> list[str]:
        """Each token's chosen experts (``ffn_moe_topk``), then with their weights (the weight stages)."""
        if event.rows is None:
            return []
        where = (event.step, event.layer)
        if event.stage == "ffn_moe_topk":
            self._route = (where, event.rows)
            return [f"  token at position {event.start_pos + i}: experts {', '.join(map(str, ids))}"
                    for i, ids in enumerate(event.rows)]
        ids = self._route[1] if self._route is not None and self._route[0] == where else None
        out = []
        for i, weights in enumerate(event.rows):
            chosen = (f"expert {e} × {w:.4f}" for e, w in zip(ids[i], weights)) if ids else (f"{w:.4f}" for w in weights)
            out.append(f"  token at position {event.start_pos + i}: {', '.join(chosen)}")
        return out


TABLE_STATS = ("rms", "mean", "min", "max")


def _stat_cell(stats: Mapping[str, Any] | None, key: str) -> str:
    if stats is None:
        return ""
    value = stats.get(key)
    cell = "—" if value is None else format(value, ".4g")
    if key == "max" and (stats.get("nan") or stats.get("inf")):
        cell += f" ({stats.get('nan', 0)} nan, {stats.get('inf', 0)} inf)"
    return cell


class TableView:
    """Sink collecting events into one rich table per step (layer, stage, op, shape, dtype, stats, time)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._events: list[TraceEvent] = []

    def __call__(self, event: TraceEvent) -> None:
        if self._events and event.step != self._events[-1].step:
            self.flush()
        self._events.append(event)

    def flush(self) -> None:
        if not self._events:
            return
        first = self._events[0]
        table = Table(title=f"step {first.step} · {first.phase} · start_pos {first.start_pos} · "
                            f"seq_len {first.seq_len}", title_justify="left")
        columns = [("layer", "right"), ("stage", "left"), ("op", "left"), ("shape", "left"), ("dtype", "left")]
        with_stats = any(e.stats is not None for e in self._events)
        with_values = any(e.values is not None for e in self._events)
        if with_stats:      # one narrow column per statistic, so the table stays readable at 80 columns
            columns += [(k, "right") for k in TABLE_STATS]
        if with_values:
            columns.append(("values", "left"))
        columns.append(("time", "right"))
        for name, justify in columns:
            table.add_column(name, justify=justify, no_wrap=name != "values")
        for e in self._events:
            row = ["—" if e.layer is None else str(e.layer), e.stage, e.op, fmt_shape(e.shape), e.dtype]
            if with_stats:
                row += [_stat_cell(e.stats, k) for k in TABLE_STATS]
            if with_values:
                row.append("" if e.values is None else fmt_values(e.values))
            row.append(fmt_us(e.elapsed_us))
            table.add_row(*row)
        # piped to a file, a table is data: don't squeeze it into the 80 columns rich assumes
        console = self.console
        if not console.is_terminal:
            console = Console(file=console.file, width=200, highlight=False, color_system=None)
        console.print(table)
        self._events = []


class DebugLog:
    """Sink writing the book's ``debug.log``: ``[DEBUG] <time> <line>``, flushed per event."""

    def __init__(self, stream: OutputStream, formatter: LineFormatter) -> None:
        self.stream = stream
        self.formatter = formatter

    def __call__(self, event: TraceEvent) -> None:
        stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        for line in self.formatter.lines(event):
            self.stream.write_line(f"[DEBUG] {stamp} {line}")


# ---- JSON lines and .npz -------------------------------------------------------------------
def _dumps(obj: Any) -> str:
    # allow_nan=False: a NaN that slipped past finite_or_none is a bug, not invalid JSON in a file
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


class JsonlWriter:
    """Sink streaming the ``llamatrace.trace/1`` schema: a header, one line per event, a footer.

    Each line is written whole and flushed, so after an error or Ctrl-C every line in the file is
    valid JSON (only the footer may be missing).
    """

    def __init__(self, stream: OutputStream) -> None:
        self.stream = stream

    def _line(self, obj: Mapping[str, Any]) -> None:
        self.stream.write_line(_dumps(obj))

    def header(self, *, model: str, prompt: str, prompt_ids: Sequence[int], pieces: Sequence[str],
               config: Mapping[str, Any], activations: str = "f32") -> None:
        self._line({"type": "header", "schema": SCHEMA, "model": model, "prompt": prompt,
                    "prompt_ids": list(prompt_ids), "pieces": list(pieces), "config": dict(config),
                    "activations": activations})

    def __call__(self, event: TraceEvent) -> None:
        self._line(event.to_json())

    def footer(self, *, ids: Sequence[int], top_k: Sequence[tuple[int, str, float]],
               timings: Mapping[str, Any]) -> None:
        self._line({"type": "footer", "ids": list(ids),
                    "top_k": [[int(i), p, finite_or_none(float(q))] for i, p, q in top_k],
                    "timings": dict(timings)})


def write_npz_atomic(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` (keys ``step0.layer0.attn_norm``) to ``path``, all or nothing.

    Raises:
        OutputError: the file cannot be written (disk full, permissions).
    """
    # a file object: numpy appends no ".npz" to the name
    write_atomic(Path(path), lambda f: np.savez(f, **arrays), "--npz")


def tokens_table(tokenizer, ids: Sequence[int], title: str = "Prompt tokens") -> Table:
    """The prompt's tokenization, position · id · piece (the book's chapter 12)."""
    table = Table(title=f"{title} ({len(ids)})", title_justify="left")
    table.add_column("pos", justify="right")
    table.add_column("id", justify="right")
    table.add_column("piece")
    for pos, i in enumerate(ids):
        table.add_row(str(pos), str(i), Text(quoted(tokenizer.piece(i)), style="yellow"))
    return table


def top_k_probs(logits: np.ndarray, tokenizer, k: int) -> list[tuple[int, str, float]]:
    """The ``k`` most likely next tokens from float32 ``[vocab_size]`` logits: (id, piece, probability)."""
    p = softmax64(logits)
    k = min(k, p.size)
    top = np.argpartition(-p, k - 1)[:k]
    top = top[np.argsort(-p[top], kind="stable")]
    return [(int(i), tokenizer.piece(int(i)), float(p[i])) for i in top]


def top_k_table(top: Sequence[tuple[int, str, float]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name, justify in (("#", "right"), ("id", "right"), ("piece", "left"), ("prob", "right"), ("", "left")):
        table.add_column(name, justify=justify)
    for rank, (i, piece, prob) in enumerate(top, 1):
        table.add_row(str(rank), str(i), Text(quoted(piece), style="yellow"), f"{prob:.4f}",
                      Text("█" * round(prob * 30), style="green"))
    return table


def timing_rollup(stage_times: Mapping[tuple[str, str], Sequence[float]]) -> dict[str, dict[str, float]]:
    """``{phase: {group: µs}}`` from ``Recorder.stage_times`` (groups from ``Stage.group``)."""
    out: dict[str, dict[str, float]] = {}
    for (phase, stage_id), (us, _calls) in stage_times.items():
        groups = out.setdefault(phase, dict.fromkeys(GROUPS, 0.0))
        groups[STAGE_BY_ID[stage_id].group] += us
    return {phase: {g: round(us, 1) for g, us in groups.items()} for phase, groups in out.items()}


def timings_view(stage_times: Mapping[tuple[str, str], Sequence[float]], decode_steps: int, top: int = 10) -> Group:
    """Two tables: time per stage group, prefill vs decode; and the slowest stages.

    A stage's time is the wall time since the previous stage ended, so a fused kernel is billed
    to the first stage it produces (the q|k|v matmul to ``Qcur``, gate|up to ``ffn_gate``).
    """
    rollup = timing_rollup(stage_times)
    phases = [p for p in ("prefill", "decode") if p in rollup]
    gate = "ffn_moe_gate" if any(stage_id == "ffn_moe_gate" for _, stage_id in stage_times) else "ffn_gate"
    groups = Table(title="Time by stage group", title_justify="left",
                   caption=f"fused kernels count under their first stage: q/k/v under Qcur, gate/up under {gate}",
                   caption_justify="left")
    groups.add_column("group")
    for p in phases:
        groups.add_column(f"{p} ms", justify="right")
        groups.add_column("%", justify="right")
    if "decode" in rollup and decode_steps:
        groups.add_column("ms / decode step", justify="right")
    totals = {p: sum(rollup[p].values()) or 1.0 for p in phases}
    for g in (*GROUPS, "total"):
        row = [g if g != "total" else "[bold]total[/]"]
        for p in phases:
            us = totals[p] if g == "total" else rollup[p][g]
            row += [f"{us / 1000:.2f}", f"{100 * us / totals[p]:.0f}"]
        if "decode" in rollup and decode_steps:
            us = totals["decode"] if g == "total" else rollup["decode"][g]
            row.append(f"{us / 1000 / decode_steps:.2f}")
        groups.add_row(*row)
    slow = Table(title=f"Slowest stages (top {top})", title_justify="left")
    for name, justify in (("phase", "left"), ("stage", "left"), ("group", "left"), ("calls", "right"),
                          ("ms", "right"), ("% of phase", "right")):
        slow.add_column(name, justify=justify)
    ranked = sorted(stage_times.items(), key=lambda kv: -kv[1][0])[:top]
    for (phase, stage_id), (us, calls) in ranked:
        slow.add_row(phase, stage_id, STAGE_BY_ID[stage_id].group, str(int(calls)), f"{us / 1000:.2f}",
                     f"{100 * us / totals[phase]:.0f}")
    return Group(groups, slow)
