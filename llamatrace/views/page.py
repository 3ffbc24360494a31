"""``diagram -o run.html``: one self-contained interactive page of a traced run.

The page holds Graphviz's SVG of the model and block views for every step (drawn by
:mod:`llamatrace.views.diagram` from the trace events), the run's data as inline JSON and plain JS/CSS
(``page_assets/``); no network. The data are the same :class:`~llamatrace.tracing.recorder.TraceEvent`
records ``trace`` prints and the stage catalogue; the JS only displays them.

Per event: statistics (formatted as ``trace --stats`` prints them) and a histogram for every
layer; the first :data:`MAX_VALUES` values as float16 only for the layers asked for. For a
mixture-of-experts model, every layer's route (chosen experts and their weights, per token and
step): clicking a token shows its route through the layers.
"""

from __future__ import annotations

import base64
import shlex
import sys
from importlib import resources
from typing import Any, Sequence

import numpy as np

from llamatrace import __version__
from llamatrace.errors import OptionError
from llamatrace.analysis.experts import ROUTE_STAGES
from llamatrace.views import diagram as dg
from llamatrace.gguf.reader import weight_tensor_name
from llamatrace.views.render import STAT_KEYS
from llamatrace.model.sampling import softmax64
from llamatrace.tracing.stages import STAGES
from llamatrace.tracing.recorder import Recorder, TraceEvent

MAX_VALUES = 65536        # float16 values kept per tensor (the page's size bound)
HIST_BINS = 40
TOP_K = 10


def histogram(array: np.ndarray) -> dict[str, Any] | None:
    """Counts of the finite values in :data:`HIST_BINS` equal bins over ``[lo, hi]``; ``None`` if none."""
    a = np.abs(array) if np.iscomplexobj(array) else array
    a = np.asarray(a, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    if a.size == 0:
        return None
    counts, edges = np.histogram(a, bins=HIST_BINS)
    return {"lo": float(edges[0]), "hi": float(edges[-1]), "counts": counts.tolist()}


def _fmt(x: float | None) -> str:
    return "—" if x is None else format(x, ".6g")       # as render.fmt_stats prints it


class _Collector:
    """Recorder sink: keeps each event's summary, values of the chosen layers, and the logits' top-k."""

    def __init__(self, value_layers: frozenset[int], tokenizer) -> None:
        self.value_layers, self.tok = value_layers, tokenizer
        self.events: list[dict[str, Any]] = []
        self.top: dict[int, list[dict[str, Any]]] = {}
        self.routes: dict[int, dict[str, dict[str, list]]] = {}

    def __call__(self, ev: TraceEvent) -> None:
        a = ev.array
        item: dict[str, Any] = {
            "step": ev.step, "layer": ev.layer, "stage": ev.stage, "shape": ev.shape, "dtype": ev.dtype,
            "start_pos": ev.start_pos, "seq_len": ev.seq_len,
            "stats": {k: _fmt(ev.stats.get(k)) for k in STAT_KEYS} | {"nan": ev.stats["nan"], "inf": ev.stats["inf"]},
            "hist": histogram(a),
        }
        if (ev.layer is None or ev.layer in self.value_layers) and not np.iscomplexobj(a):
            flat = np.asarray(a).ravel()[:MAX_VALUES].astype("<f2")
            item["n"] = int(flat.size)
            item["values"] = base64.b64encode(flat.tobytes()).decode("ascii")
        if ev.stage in ROUTE_STAGES:          # a MoE layer's route: the page shows it per token
            route = self.routes.setdefault(ev.step, {}).setdefault(str(ev.layer), {})
            arr = np.asarray(a)
            if ev.stage == "ffn_moe_topk":
                route["ids"] = arr.astype(int).tolist()
            else:                             # the weights applied: the last such stage a layer emits
                route["weights"] = np.round(arr.astype(np.float64), 5).tolist()
        if ev.stage == "result_output":
            p = softmax64(np.asarray(a)[-1])
            best = np.argsort(-p, kind="stable")[:TOP_K]
            self.top[ev.step] = [{"id": int(i), "piece": self.tok.decode([int(i)]), "p": float(p[i])} for i in best]
        ev.array = None                       # only the summary above stays in memory
        self.events.append(item)


def _stage_table() -> list[dict[str, Any]]:
    return [{"id": s.id, "level": s.level, "op": s.op, "chapter": s.chapter, "section": s.section,
             "book_stage": s.book_stage, "book_title": dg.BOOK_STAGES.get(s.book_stage, ""),
             "llama_cpp": s.llama_cpp, "llama_cpp_note": s.llama_cpp_note, "description": s.description}
            for s in STAGES]


def _weights(run: dg.RunInfo) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``{"m" | layer: {stage id: [weight]}}``: each stage's GGUF weights, per layer."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for layer in (None, *range(run.config.n_layers)):
        per = out.setdefault("m" if layer is None else str(layer), {})
        for s in STAGES:
            if not s.weights or (s.level == "layer") != (layer is not None):
                continue
            for name, suffix in s.weights:
                gguf, tied = weight_tensor_name(suffix, layer, run.weights)
                qtype, shape = run.weights.get(gguf, ("?", ()))
                per.setdefault(s.id, []).append({"name": name, "gguf": gguf, "type": qtype, "shape": list(shape),
                                                 "tied": tied})
    return out


def build_page(model, prompt: str, prompt_ids: Sequence[int], *, chat: bool, value_layers: Sequence[int],
               tokens: int = 1, highlight: dg.Highlight | None = None, ctx_size: int | None = None,
               command: Sequence[str] | None = None, view: str = "model", step: int = 0) -> bytes:
    """Run the prompt and ``tokens`` greedy decode steps, tracing every layer; return the HTML page.

    Args:
        value_layers: layers whose values (float16, ≤ :data:`MAX_VALUES` per tensor) go in the page.
        tokens: decode steps after the prefill (the page's step selector: 0 … ``tokens``).
        highlight: a book STAGE view the page opens on.
        command: the command line shown in the page (default ``sys.argv``).
        view, step: what the page opens on.

    Raises:
        OptionError: a layer out of range or a cache too small for the steps.
        PromptError: an empty prompt or one longer than the context.
        GraphvizMissingError / OutputError: ``dot`` missing or failing.
    """
    from llamatrace.model.generate import generate
    from llamatrace.views.diagram.flow import cache_for_steps

    c = model.config
    ctx = cache_for_steps(model, len(prompt_ids), tokens, ctx_size, "--tokens")
    first = sorted(value_layers)[0]
    # one drawing per kind of layer (a hybrid's DeltaNet and attention layers, sliding-window and
    # global ones): the first value layer of each kind, else its first layer
    kinds = [layer_kind_key(c, i) for i in range(c.n_layers)]
    drawn: dict[str, int] = {}
    for i in [*sorted(value_layers), *range(c.n_layers)]:
        drawn.setdefault(kinds[i], i)
    collect = _Collector(frozenset(value_layers), model.tokenizer)
    # every layer; the collector drops each array once summarised, the events stay for the views
    rec = Recorder(layers=None, stats=True, keep_arrays=True, sinks=[collect])
    out = list(generate(model, list(prompt_ids), max_tokens=tokens + 1, ctx_size=ctx, recorder=rec,
                        stop_ids=frozenset()))
    svgs: dict[str, str] = {}
    runs = []
    for s in range(tokens + 1):
        events = [e for e in rec.events if e.step == s]
        for kind, layer in drawn.items():
            run = dg.run_info(model, prompt, prompt_ids, out, chat=chat, layer=layer, step=s, ctx=ctx)
            if layer == first:
                runs.append(run)
            for v in dg.VIEWS:
                hl = highlight if highlight is not None and (v == "model" or not highlight.model_only) else None
                try:
                    graph = dg.build_diagram(events, run, view=v, highlight=hl)
                except OptionError:            # the highlighted stage does not run at this step (or layer)
                    graph = dg.build_diagram(events, run, view=v)
                svg = dg.render(graph, "svg").decode("utf-8")
                svgs[f"{v}:{s}:{kind}"] = svg[svg.index("<svg"):]
    tok = model.tokenizer
    data = {
        "version": __version__, "model": runs[0].model_name,
        "command": shlex.join(command if command is not None else ["llamatrace", *sys.argv[1:]]),
        "prompt": prompt, "chat": chat, "n_prompt": len(prompt_ids), "max_seq": ctx,
        "config": {"dim": c.dim, "n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
                   "head_dim": c.head_dim, "hidden_dim": c.hidden_dim, "vocab_size": c.vocab_size},
        "tokens": [{"id": int(i), "piece": tok.decode([int(i)])} for i in prompt_ids],
        "generated": [{"id": int(i), "piece": tok.decode([int(i)])} for i in out],
        "value_layers": sorted(value_layers), "drawn_layer": first, "layer_kinds": kinds, "drawn_layers": drawn,
        "steps": tokens + 1, "start_view": view,
        "start_step": min(step, tokens),
        "highlight": sorted(highlight.stage_ids) if highlight else [],
        "highlight_label": highlight.label if highlight else "",
        "stages": _stage_table(), "weights": _weights(runs[0]), "events": collect.events, "top": collect.top,
        "routes": collect.routes, "n_expert": getattr(c, "n_expert", 0),
        "max_values": MAX_VALUES,
    }
    return _html(data, svgs).encode("utf-8")


def layer_kind_key(config, layer: int) -> str:
    """A short key of what a drawing of ``layer`` depends on beyond its number: gated DeltaNet or
    attention, and a sliding window or not (``"attn"``, ``"attn-swa"``, ``"deltanet"``)."""
    if config.is_recurrent(layer):
        return "deltanet"
    return "attn-swa" if config.is_local(layer) else "attn"


def _asset(name: str) -> str:
    return resources.files("llamatrace.views").joinpath("page_assets", name).read_text(encoding="utf-8")


def _html(data: dict[str, Any], svgs: dict[str, str]) -> str:
    """The page: ``page_assets/page.html`` rendered by jinja2 with autoescape, so user text
    (prompt, token pieces, model name) is escaped and ``data`` is JSON safe inside a <script>."""
    import jinja2
    env = jinja2.Environment(loader=jinja2.PackageLoader("llamatrace.views", "page_assets"),
                             autoescape=True, keep_trailing_newline=True)
    # |tojson escapes < > & ' for a <script>; NaN would not be JSON (allow_nan=False raises)
    env.policies["json.dumps_kwargs"] = {"ensure_ascii": False, "separators": (",", ":"), "allow_nan": False}
    return env.get_template("page.html").render(data=data, svgs=svgs, css=_asset("page.css"), js=_asset("page.js"))
