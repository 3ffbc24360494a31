"""Drawing one step of a run as a ``graphviz.Digraph``: nodes, clusters, the residual spine,
weights, the legend (:func:`build_diagram`)."""

from __future__ import annotations

import html
import math
from typing import Iterable

import graphviz

from llamatrace.errors import OptionError
from llamatrace.gguf.reader import weight_tensor_name
from llamatrace.tracing.recorder import TraceEvent
from llamatrace.tracing.stages import STAGE_BY_ID, STAGE_IDS, STAGES, Stage
from llamatrace.views.diagram.flow import RunInfo, shape_text, wire
from llamatrace.views.diagram.highlight import (BLOCK_IN, BLOCK_INPUT_STAGES, KV_CACHE, LEGEND, SAMPLED, TOKENS,
                                                Highlight, layer_list, not_run_reason)
from llamatrace.views.render import fmt_us

VIEWS = ("model", "block")
RESIDUAL_ADDS = tuple(s.id for s in STAGES if s.residual)       # ffn_inp, l_out: on the spine
# Parallel stages drawn side by side on one rank (a layout hint only).
_ROWS = (("Qcur", "Kcur", "Vcur"), ("Qcur_heads", "Kcur_heads", "Vcur_heads"), ("Qcur_rope", "Kcur_rope"),
         ("cache_k", "cache_v"), ("keys", "values"), ("keys_rep", "values_rep"), ("ffn_gate", "ffn_up"))

# Colours: fill per sub-layer group, weights, cache, highlight, residual stream.
_FILL = {"input": "#eeeeee", "attention": "#dbe9f6", "ffn": "#dcefdc", "output": "#e8e0f0"}
_WEIGHT_FILL, _WEIGHT_EDGE = "#fff4c2", "#b8860b"
_CACHE_FILL = "#fde0c5"
_RESID_COLOR = "#2e7d32"
_HI_FILL, _HI_COLOR, _NEAR_COLOR = "#ffd2d2", "#d62728", "#ff7f0e"
_FONT = "Helvetica,Arial,sans-serif"


def _e(text: object) -> str:
    """``text`` for a Graphviz HTML label: escaped, and characters XML forbids or a font cannot
    show (control characters of byte tokens such as ``\\x17``) written as ``\\xNN`` / ``\\uNNNN``."""
    text = "".join(c if c.isprintable() else (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
                   for c in str(text))
    return html.escape(text, quote=True)


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _fmt_num(x: float | None) -> str:
    if x is None:
        return "–"
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.2e}"
    return f"{x:.4g}"


class _Builder:
    """Draws one step of a run (see :func:`build_diagram`)."""

    def __init__(self, events: Iterable[TraceEvent], run: RunInfo, view: str, highlight: Highlight | None,
                 stats: bool, timings: bool) -> None:
        self.run, self.view, self.hl = run, view, highlight
        self.stats, self.timings = stats, timings
        self.events: dict[str, TraceEvent] = {}
        for ev in events:
            if ev.step == run.step and ev.layer in (None, run.layer):
                self.events.setdefault(ev.stage, ev)
        if not any(STAGE_BY_ID[s].level == "layer" for s in self.events):
            raise OptionError(f"no traced events for layer {run.layer} at step {run.step}")
        self.drawn = [s for s in STAGES if s.id in self.events and self._in_view(s)]
        self.flow = wire(self.drawn, self.events, view, local=run.config.is_local(run.layer))
        self.lanes = self._lanes()
        self.hot = highlight.nodes() if highlight else frozenset()
        self.near = self._neighbours()
        times = [self.events[s.id].elapsed_us for s in self.drawn]
        self.t_max = max(times) if times else 0.0
        self.t_total = sum(times)

    def _lanes(self) -> dict[str, str]:
        """Vertical lanes (Graphviz ``group``): a stage continues its first input's lane when that
        producer feeds nothing else, so chains like xq → heads → RoPE → q·kᵀ draw straight."""
        consumers: dict[str, int] = {}
        first_input: dict[str, str] = {}
        for a, b, _, kind in self.flow.edges:
            if kind != "cache":
                consumers[a] = consumers.get(a, 0) + 1
            first_input.setdefault(b, a if kind != "cache" else "")
        lanes: dict[str, str] = {}
        for stage in self.drawn:
            producer = first_input.get(stage.id, "")
            lanes[stage.id] = lanes[producer] if producer in lanes and consumers.get(producer) == 1 else stage.id
        return lanes

    def _in_view(self, stage: Stage) -> bool:
        return self.view == "model" or stage.level == "layer" or stage.id in BLOCK_INPUT_STAGES

    def _neighbours(self) -> frozenset[str]:
        near = set()
        for a, b, _, kind in self.flow.edges:
            if a in self.hot or (self.hl and self.hl.transposes and kind == "transposed"):
                near.add(b)
            if b in self.hot or (self.hl and self.hl.transposes and kind == "transposed"):
                near.add(a)
        return frozenset(near - self.hot)

    # -- labels --------------------------------------------------------------------------------
    def _op_node(self, g: graphviz.Digraph, stage: Stage, **extra: str) -> None:
        ev = self.events[stage.id]
        lines = [f'<B>{_e(ev.op)}</B>  <FONT POINT-SIZE="9" COLOR="#555555">{_e(stage.id)}</FONT>',
                 f"<I>{_e(stage.chapter)}</I>",
                 f"{_e(shape_text(ev.shape))} {_e(ev.dtype)}"]
        if stage.op == "SetSlice":
            lines.append(f'<FONT POINT-SIZE="9">writes rows [{ev.start_pos}:{ev.start_pos + ev.seq_len}]</FONT>')
        elif stage.op == "Slice":
            lines.append(f'<FONT POINT-SIZE="9">reads rows [0:{ev.start_pos + ev.seq_len}]</FONT>')
        elif stage.op == "RepeatKV":
            c = self.run.config
            lines.append(f'<FONT POINT-SIZE="9">each of {c.n_kv_heads} KV heads ×{c.n_rep}</FONT>')
        elif stage.op == "Top-k":
            c = self.run.config
            lines.append(f'<FONT POINT-SIZE="9">top {c.n_expert_used} of {c.n_expert} experts per token</FONT>')
        if self.stats and ev.stats:
            s = ev.stats
            lines.append(f'<FONT POINT-SIZE="9">mean {_fmt_num(s["mean"])} · rms {_fmt_num(s["rms"])}</FONT>')
            lines.append(f'<FONT POINT-SIZE="9">[{_fmt_num(s["min"])}, {_fmt_num(s["max"])}]'
                         + (f' nan {s["nan"]} inf {s["inf"]}' if s["nan"] or s["inf"] else "") + "</FONT>")
        attrs = {"fillcolor": _FILL[stage.group]}
        if stage.residual:
            attrs.update(fillcolor="white", color=_RESID_COLOR, penwidth="2")
        elif stage.level == "layer":
            attrs["group"] = self.lanes[stage.id]
        if self.timings:
            share = ev.elapsed_us / self.t_total if self.t_total else 0.0
            lines.append(f'<FONT POINT-SIZE="9">{fmt_us(ev.elapsed_us)} ({share:.0%})</FONT>')
            attrs["fillcolor"] = self._heat(ev.elapsed_us)
        self._node(g, stage.id, lines, attrs, shape="box", style="rounded,filled", **extra)
        for name, suffix in stage.weights:
            node = self._weight_node(g, stage, name, suffix)
            if stage.level == "model":          # outside the block there is room beside the op
                with g.subgraph() as same:
                    same.attr(rank="same")
                    same.node(node)
                    same.node(stage.id)

    def _heat(self, us: float) -> str:
        """White → orange on a square-root scale of time spent (``/oranges9`` colour scheme)."""
        if self.t_max <= 0:
            return "/oranges9/1"
        return f"/oranges9/{1 + round(5 * math.sqrt(max(us, 0.0) / self.t_max))}"     # ≤ 6: text stays legible

    def _node(self, g: graphviz.Digraph, name: str, lines: list[str], attrs: dict[str, str], **kw: str) -> None:
        if name in self.hot:
            lines = [f'<FONT COLOR="{_HI_COLOR}"><B>▶ you are here</B></FONT>'] + lines
            attrs = {**attrs, "fillcolor": _HI_FILL, "color": _HI_COLOR, "penwidth": "3"}
        elif name in self.near:
            attrs = {**attrs, "color": _NEAR_COLOR, "penwidth": "2.5"}
        g.node(name, "<" + "<BR/>".join(lines) + ">", **kw, **attrs)

    def _weight_node(self, g: graphviz.Digraph, stage: Stage, name: str, suffix: str) -> str:
        layer = self.run.layer if stage.level == "layer" else None
        gguf_name, tied = weight_tensor_name(suffix, layer, self.run.weights)
        node = _weight_id(stage, name)
        note = " (tied)" if tied else ""
        qtype, shape = self.run.weights.get(gguf_name, ("?", ()))
        lines = [f"<B>{_e(gguf_name)}</B>{_e(note)}",
                 f'{_e(qtype)} {_e(shape_text(shape))}  <FONT POINT-SIZE="9" COLOR="#555555">{_e(name)}</FONT>']
        g.node(node, "<" + "<BR/>".join(lines) + ">", shape="note", style="filled", fillcolor=_WEIGHT_FILL,
               color=_WEIGHT_EDGE, fontsize="10")
        return node

    # -- the graph -----------------------------------------------------------------------------
    def build(self) -> graphviz.Digraph:
        g = graphviz.Digraph("llamatrace", graph_attr={
            "rankdir": "TB", "newrank": "true", "nodesep": "0.3", "ranksep": "0.32", "fontname": _FONT,
            "fontsize": "13", "labelloc": "t", "labeljust": "l", "label": self._title(), "pad": "0.3",
            "compound": "true"})
        g.attr("node", fontname=_FONT, fontsize="11", margin="0.12,0.05", penwidth="1.2")
        g.attr("edge", fontname=_FONT, fontsize="9", color="#444444", arrowsize="0.7")

        model_before = [s for s in self.drawn if s.level == "model" and s.group == "input"]
        model_after = [s for s in self.drawn if s.level == "model" and s.group == "output"]
        if self.view == "model":
            self._tokens_node(g)
        for s in model_before:
            self._op_node(g, s)
        with g.subgraph(name="cluster_block") as blk:
            hot = self.hl is not None and self.hl.cluster == "block"
            blk.attr(label=self._block_label(), style="rounded", color=_HI_COLOR if hot else "#777777",
                     penwidth="3" if hot else "1.5", fontsize="13", margin="14")
            self._block(blk)
        for s in model_after:
            self._op_node(g, s)
        if self.view == "model" and "result_output" in self.events:
            self._sampled_node(g)
        self._weight_edges(g)
        self._edges(g)
        self._legend(g)
        return g

    def _title(self) -> str:
        run, c = self.run, self.run.config
        where = "prefill" if run.step == 0 else f"decode step {run.step}"
        ev = next(iter(self.events.values()))
        prompt = _short(run.prompt, 60)
        lines = [f"<B>{_e(run.model_name)}</B> — {_e(where)}: start_pos {ev.start_pos}, seq_len {ev.seq_len} · "
                 f"prompt “{_e(prompt)}” ({run.n_prompt or len(run.input_ids)} tokens"
                 f"{', chat template' if run.chat else ', raw'})",
                 f"dim {c.dim} · {c.n_layers} layers · {c.n_heads} query heads, {c.n_kv_heads} KV heads "
                 f"(n_rep {c.n_rep}) · head_dim {c.head_dim} · "
                 + (f"{c.n_expert} experts of hidden_dim {c.expert_hidden_dim}, top {c.n_expert_used} · "
                    if c.n_expert else f"hidden_dim {c.hidden_dim} · ")
                 + f"vocab {c.vocab_size} · KV cache {run.max_seq} positions"]
        if self.hl is not None:
            lines.insert(0, f'<FONT COLOR="{_HI_COLOR}" POINT-SIZE="15"><B>{_e(self.hl.label)}</B></FONT>')
        return "<" + "<BR ALIGN=\"LEFT\"/>".join(lines) + "<BR ALIGN=\"LEFT\"/>>"

    def _ffn_title(self) -> str:
        c = self.run.config
        if c.n_expert:
            return f"Feed-forward sub-layer: mixture of {c.n_expert} SwiGLU experts, top {c.n_expert_used} per token"
        return "Feed-forward sub-layer (GeGLU)" if "ffn_geglu" in self.events else "Feed-forward sub-layer (SwiGLU)"

    def _block_label(self) -> str:
        c, layer = self.run.config, self.run.layer
        if c.recurrent_layers:                    # two kinds of block: say which layers are which
            kinds = (f"gated DeltaNet (linear attention) on layers {layer_list(c.recurrent_layers)}; "
                     f"softmax attention on layers {layer_list(c.attn_layers)}")
            drawn = "a DeltaNet" if c.is_recurrent(layer) else "an attention"
            return (f"<<B>Transformer block × {c.n_layers}</B>  (layer {layer} drawn: {drawn} layer)<BR/>"
                    f"<FONT POINT-SIZE=\"10\">{_e(kinds)}</FONT>>")
        if self.view == "model":
            return f"<<B>Transformer block × {c.n_layers}</B>  (layer {layer} drawn; every block has these shapes)>"
        return f"<<B>Transformer block, layer {layer}</B> of {c.n_layers}>"

    def _tokens_node(self, g: graphviz.Digraph) -> None:
        run = self.run
        ids = run.input_ids
        if run.step == 0:
            shown = ", ".join(str(i) for i in ids[:8]) + (", …" if len(ids) > 8 else "")
            lines = ["<B>tokens</B>  <FONT POINT-SIZE=\"9\" COLOR=\"#555555\">tokenizer</FONT>",
                     f"“{_e(_short(run.prompt, 40))}”",
                     f"{len(ids)} ids [{_e(shown)}]", f"{_e(shape_text([len(ids)]))} int64"]
        else:
            lines = ["<B>tokens</B>  <FONT POINT-SIZE=\"9\" COLOR=\"#555555\">sampled at step "
                     f"{run.step - 1}</FONT>", f"id {ids[0]} “{_e(_short(run.input_text, 20))}”",
                     "[1] int64"]
        self._node(g, TOKENS, lines, {"fillcolor": _FILL["input"]}, shape="box", style="filled")

    def _sampled_node(self, g: graphviz.Digraph) -> None:
        run = self.run
        if run.sampled is None:
            return
        tid, text = run.sampled
        stop = " (end of turn)" if tid in run.stop_ids else ""
        lines = ["<B>next token</B>  <FONT POINT-SIZE=\"9\" COLOR=\"#555555\">greedy argmax</FONT>",
                 f"id {tid} “{_e(_short(text, 24))}”{_e(stop)}",
                 f'<FONT POINT-SIZE="9">fed back as step {run.step + 1}\'s input</FONT>']
        self._node(g, SAMPLED, lines, {"fillcolor": _FILL["output"]}, shape="box", style="filled")

    def _block(self, blk: graphviz.Digraph) -> None:
        run = self.run
        first = next(s for s in self.drawn if s.level == "layer")
        x_shape = self.events[first.id].inputs.get("x", self.events[first.id].shape)
        src = "inputTensor (embedding)" if run.layer == 0 else f"output of layer {run.layer - 1}"
        layer_stages = [s for s in self.drawn if s.level == "layer"]
        # the residual stream: a column of its own, so its edges run straight past the sub-layers
        with blk.subgraph(name="cluster_residual") as spine:
            spine.attr(style="invis", label="", margin="4")
            self._node(spine, BLOCK_IN, [f"<B>x</B>  <FONT POINT-SIZE=\"9\" COLOR=\"#555555\">{_e(src)}</FONT>",
                                         f"{_e(shape_text(x_shape))} float32"],
                       {"fillcolor": "white", "color": _RESID_COLOR, "penwidth": "2"}, shape="box",
                       style="rounded,filled", group="resid", ordering="out")
            for s in layer_stages:
                if s.residual:
                    self._op_node(spine, s, group="resid", ordering="out")
        for group, title in (("attention", self._attention_title()), ("ffn", self._ffn_title())):
            members = [s for s in layer_stages if s.group == group and not s.residual]
            hot = self.hl is not None and self.hl.cluster == group
            with blk.subgraph(name=f"cluster_{group}") as sub:
                sub.attr(label=title, style="rounded,dashed" if not hot else "rounded", fontsize="12",
                         color=_HI_COLOR if hot else "#999999", penwidth="3" if hot else "1", margin="10")
                for s in members:
                    self._op_node(sub, s)
                if group == "attention" and any(s.op in ("SetSlice", "Slice") for s in members):
                    self._cache_node(sub)
                self._rows(sub, {s.id for s in members})
            self._beside_spine(blk, members)

    def _beside_spine(self, g: graphviz.Digraph, members: list[Stage]) -> None:
        """Put a sub-layer right of the residual stream: its first node shares a rank with, and
        sits right of, the spine node that feeds it."""
        if not members:
            return
        first = members[0]
        feed = next((a for a, b, _, _ in self.flow.edges if b == first.id), None)
        head = _weight_id(first, first.weights[0][0]) if first.weights else first.id
        if feed in (BLOCK_IN, *RESIDUAL_ADDS):
            with g.subgraph() as same:
                same.attr(rank="same")
                same.edge(feed, head, style="invis", minlen="3")

    def _rows(self, g: graphviz.Digraph, members: set[str]) -> None:
        """Parallel stages on one rank, in :data:`_ROWS` order."""
        for row in _ROWS:
            ids = [i for i in row if i in members]
            if len(ids) > 1:
                with g.subgraph() as same:
                    same.attr(rank="same")
                    for a, b in zip(ids, ids[1:]):
                        same.edge(a, b, style="invis")

    def _attention_title(self) -> str:
        c = self.run.config
        if c.is_recurrent(self.run.layer):
            text = (f"state [{c.ssm_n_v_heads} heads × {c.ssm_head_dim} × {c.ssm_head_dim}], fixed size: written "
                    f"by the delta rule, decayed by exp(gate); {c.ssm_n_k_heads} key heads serve "
                    f"{c.ssm_n_v_heads} value heads; no KV cache")
            return f"<<B>Gated DeltaNet sub-layer (linear attention)</B><BR/><FONT POINT-SIZE=\"10\">{_e(text)}</FONT>>"
        if c.n_rep > 1:
            gqa = (f"grouped-query attention: {c.n_heads} query heads share {c.n_kv_heads} KV heads, "
                   f"n_rep = {c.n_rep} query heads per KV head")
        else:
            gqa = f"multi-head attention: {c.n_heads} heads, each with its own K/V head (n_rep = 1)"
        return f"<<B>Attention sub-layer</B><BR/><FONT POINT-SIZE=\"10\">{_e(gqa)}</FONT>>"

    def _cache_node(self, g: graphviz.Digraph) -> None:
        c, run = self.run.config, self.run
        ev = self.events.get("cache_k") or self.events.get("keys")
        end = ev.start_pos + ev.seq_len
        lines = [f"<B>KV cache</B>  <FONT POINT-SIZE=\"9\" COLOR=\"#555555\">CacheK[{run.layer}], CacheV[{run.layer}]</FONT>",
                 "capacity [max_seq, n_kv_heads, head_dim]",
                 f"= {_e(shape_text([run.max_seq, c.n_kv_heads, c.head_dim]))} float32 each",
                 f"this step writes [{ev.start_pos}:{end}], reads [0:{end}]"]
        self._node(g, KV_CACHE, lines, {"fillcolor": _CACHE_FILL}, shape="cylinder", style="filled")

    def _weight_edges(self, g: graphviz.Digraph) -> None:
        for stage in self.drawn:
            for name, _ in stage.weights:
                hot = stage.id in self.hot
                g.edge(_weight_id(stage, name), stage.id, color=_HI_COLOR if hot else _WEIGHT_EDGE,
                       style="dashed", penwidth="2" if hot else "1.2")

    def _edges(self, g: graphviz.Digraph) -> None:
        # residual edges first: with ordering=out on the spine they stay left of the sub-layers
        edges = sorted(self.flow.edges, key=lambda e: e[3] != "resid")
        for a, b, label, kind in edges:
            attrs: dict[str, str] = {"label": label}
            if kind == "resid":
                attrs.update(color=_RESID_COLOR, penwidth="3.5", fontcolor=_RESID_COLOR,
                             label=f"{label} (residual)")
            elif kind == "cache":
                attrs.update(color="#c0601a", penwidth="1.8")
            hot = (a in self.hot or b in self.hot) or (self.hl is not None and self.hl.transposes
                                                       and kind == "transposed")
            if hot:
                attrs.update(color=_HI_COLOR, penwidth="3", fontcolor=_HI_COLOR)
            g.edge(a, b, **attrs)
        if self.view == "model":
            c = self.run.config
            if "inp_embd" in self.events:
                g.edge("inp_embd", BLOCK_IN, label="inputTensor", penwidth="2.5", color=_RESID_COLOR)
            if c.n_layers > 1 and "l_out" in self.events:
                g.edge("l_out", BLOCK_IN, label=f"x of the next layer (× {c.n_layers})", style="dashed",
                       color=_RESID_COLOR, fontcolor=_RESID_COLOR, constraint="false", tailport="e",
                       headport="e")
            if SAMPLED in self._pseudo_drawn():
                hot = SAMPLED in self.hot
                g.edge("result_output", SAMPLED, label="logits of the last row",
                       **({"color": _HI_COLOR, "penwidth": "3"} if hot else {}))

    def _pseudo_drawn(self) -> set[str]:
        drawn = {BLOCK_IN}
        if self.view == "model":
            drawn.add(TOKENS)
            if self.run.sampled is not None and "result_output" in self.events:
                drawn.add(SAMPLED)
        if "cache_k" in self.events or "keys" in self.events:
            drawn.add(KV_CACHE)
        return drawn

    def _legend(self, g: graphviz.Digraph) -> None:
        def row(swatch: str, text: str) -> str:
            return f'<TR><TD BGCOLOR="{swatch}" WIDTH="22"> </TD><TD ALIGN="LEFT">{text}</TD></TR>'

        def line(color: str, text: str, style: str = "━━━") -> str:
            return f'<TR><TD><FONT COLOR="{color}">{style}</FONT></TD><TD ALIGN="LEFT">{text}</TD></TR>'

        rows = ['<TR><TD COLSPAN="2"><B>Legend</B></TD></TR>',
                row(_FILL["attention"], "<B>op</B> stage id / <I>chapter tensor</I> / shape dtype (attention)"),
                row(_FILL["ffn"], "op in the feed-forward sub-layer"),
                row(_FILL["input"], "model-level input stages (computed once per step)"),
                row(_FILL["output"], "model-level output stages"),
                row(_WEIGHT_FILL, "<B>weight</B>: GGUF name, quant type, [out, in]"),
                row(_CACHE_FILL, "<B>KV cache</B>: capacity and the rows this step touches"),
                line(_RESID_COLOR, "residual stream (bypasses each sub-layer)"),
                line("#444444", "tensor, labelled with the chapter's name", "───"),
                line(_WEIGHT_EDGE, "weight into its op", "╌╌╌")]
        if self.hl is not None:
            rows.append(row(_HI_FILL, f'<FONT COLOR="{_HI_COLOR}">▶ you are here</FONT>; '
                                      f'<FONT COLOR="{_NEAR_COLOR}">orange</FONT>: its inputs/outputs'))
        if self.timings:
            rows.append(row("/oranges9/6", f"fill: time spent (√ scale, darkest {fmt_us(self.t_max)}); "
                                           "stages since the previous one"))
        if self.stats:
            rows.append(row("white", "stats: mean · rms, [min, max] of the whole tensor"))
        label = ('<<TABLE BORDER="1" COLOR="#999999" CELLBORDER="0" CELLSPACING="2" CELLPADDING="2">'
                 + "".join(rows) + "</TABLE>>")
        g.node(LEGEND, label, shape="plaintext", fontsize="10")
        anchor = TOKENS if self.view == "model" else BLOCK_IN
        g.edge(anchor, LEGEND, style="invis")


def _weight_id(stage: Stage, name: str) -> str:
    return f"w_{stage.id}_{name}"


def build_diagram(events: Iterable[TraceEvent], run: RunInfo, *, view: str = "model",
                  highlight: Highlight | None = None, stats: bool = False,
                  timings: bool = False) -> graphviz.Digraph:
    """Draw ``run.step`` / ``run.layer`` of a traced run as a Graphviz digraph.

    Args:
        events: trace events (others steps and layers are ignored), with stats for ``stats``.
        run: model, prompt and cache facts the events do not carry.
        view: ``"model"`` (embedding → block × n_layers → logits) or ``"block"`` (one block).
        highlight: a book STAGE view from :func:`resolve_highlight`.
        stats: print each tensor's mean/rms/min/max (the events must carry stats).
        timings: colour op nodes by time spent (makes the output run-dependent).

    Raises:
        OptionError: an unknown view, nothing traced for the layer/step, or a highlight that
            the view or step does not draw.
    """
    if view not in VIEWS:
        raise OptionError(f"--view {view!r}: choose one of {', '.join(VIEWS)}")
    builder = _Builder(events, run, view, highlight, stats, timings)
    if highlight is not None:
        _check_highlight_drawn(highlight, builder, view, run)
    return builder.build()


def _check_highlight_drawn(highlight: Highlight, builder: _Builder, view: str, run: RunInfo) -> None:
    if highlight.model_only and view != "model":
        raise OptionError(f"--highlight {highlight.label} is drawn in the model view; drop --view block")
    if highlight.transposes or highlight.pseudo:
        return
    drawn = {s.id for s in builder.drawn}
    if not highlight.stage_ids & drawn:
        reasons = [not_run_reason(STAGE_BY_ID[i], run.config, run.layer, len(run.input_ids))
                   for i in sorted(highlight.stage_ids, key=STAGE_IDS.index)]
        why = "; ".join(dict.fromkeys(r for r in reasons if r)) or "nothing of it was traced"
        raise OptionError(f"--highlight {highlight.label}: not drawn at layer {run.layer}, step {run.step}: {why}")
