"""``llamatrace diagram``: draw the forward pass of a real run as a flow diagram (SVG/PNG/PDF/DOT),
or write an interactive page of the run (``.html``).

The drawing itself is :mod:`llamatrace.views.diagram`; the page is :mod:`llamatrace.views.page`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.errors import OptionError
from llamatrace.outputs import check_output_path, write_atomic
from llamatrace.cli.app import app, err, status_spinner
from llamatrace.cli.options import RunOptions, check_run_options, check_steps_fit, parse_layers, run_options
from llamatrace.tracing.stages import STAGE_BY_ID, STAGE_IDS, layer_list, model_stage_ids


@app.command()
@run_options(ablate=False)
def diagram(
    run: RunOptions,
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Output file (default: ./flow.svg); the format comes from the extension: .svg, .png, .pdf "
        "(need Graphviz's `dot`), .dot (DOT source), or .html (an interactive page of the run, needs `dot`).",
        show_default=False)] = Path("flow.svg"),
    view: Annotated[str, typer.Option(
        "--view", metavar="model|block", help="model: embedding → block × n_layers → logits → token; block: one block in detail.")] = "model",
    highlight: Annotated[Optional[str], typer.Option(
        "--highlight", help="The book's STAGE view: a STAGE number 1-19 or a stage id (e.g. Qcur_rope), drawn "
        "as \"you are here\" with its inputs and outputs emphasised.", show_default=False)] = None,
    layer: Annotated[str, typer.Option(
        "--layer", "-l", help="Which layer's block to draw, 0-based (N; negative from the end: -1 the last). For .html: the layers whose "
        "values go in the page (N, N-M, N,M, -1, all; statistics cover every layer).")] = "0",
    step: Annotated[int, typer.Option(
        "--step", help="Which forward call: 0 = prefill of the prompt, n = decode step n (greedy); "
        "for .html the step the page opens on.")] = 0,
    stats: Annotated[bool, typer.Option("--stats", metavar="", help="Add each tensor's mean, rms, min and max.")] = False,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", help=".html only: greedy decode steps after the prefill, for the page's step selector "
        "(default 1).", show_default=False)] = None,
    timings: Annotated[bool, typer.Option(
        "--timings", metavar="", help="Colour op nodes by time spent (the output then differs run to run).")] = False,
    ctx_size: Annotated[Optional[int], typer.Option(
        "--ctx-size", "-c", help="KV cache capacity drawn on the cache node (default: prompt + 256 tokens, at "
        "most the model's context length).", show_default=False)] = None,
) -> None:
    """Draw a flow diagram of one forward pass of a real run, every shape from the trace (or, with
    -o run.html, an interactive page of the whole run).

    The model view draws tokens → embedding → one transformer block (× n_layers) → final RMSNorm →
    logits → the sampled token; the block view draws one block with its attention and FFN
    sub-layers, the KV cache and grouped-query attention. Weights appear with their GGUF names,
    quant types and shapes. Same model and prompt give the same DOT (unless --timings).

    Examples:

      llamatrace diagram -o flow.svg

      llamatrace diagram --view block -o block.png

      llamatrace diagram --highlight 10 -o stage10.svg

      llamatrace diagram "Why is the sky blue?" --view block --layer 5 --step 3 --stats -o step3.pdf

      llamatrace diagram -o run.html                       # interactive page: click a stage for its tensor

      llamatrace diagram --raw "The capital of France is" --layer 0,-1 --tokens 3 --highlight 13 -o run.html

    The .html page is one self-contained file (no network): the model and block views for every
    step, a side panel per stage (shape, statistics, histogram, values, weights, attention heatmap,
    top next tokens) and the prompt's tokens.
    """
    from llamatrace.views import diagram as dg

    # everything that can be checked without the model, before loading it
    fmt = dg.output_format(output)
    check_output_path(output, "-o")
    if view not in dg.VIEWS:
        raise OptionError(f"--view {view!r}: choose one of {', '.join(dg.VIEWS)}")
    mark = dg.resolve_highlight(highlight) if highlight is not None else None
    if mark is not None and mark.model_only and view != "model":
        raise OptionError(f"--highlight {highlight}: {mark.label} is drawn in the model view; drop --view block")
    parse_layers(layer)                       # syntax now; the range against the model's header
    if fmt != "html" and ("," in layer or layer.strip().lower() == "all" or "-" in layer.strip()[1:]):
        raise OptionError(f"--layer {layer!r}: an .{fmt} diagram draws one layer; give N or -1 "
                          f"(several layers are for -o run.html)")
    if fmt != "html" and tokens is not None:
        raise OptionError(f"--tokens is for the .html page; an .{fmt} diagram draws one step: use --step")
    if fmt == "html" and timings:
        raise OptionError("--timings colours an .svg/.png/.pdf/.dot diagram; the .html page does not show times")
    if fmt == "html" and stats:
        raise OptionError("--stats adds numbers to an .svg/.png/.pdf/.dot diagram; the .html page always has "
                          "them (click a stage): drop --stats")
    if tokens is not None and tokens < 0:
        raise OptionError(f"--tokens must be 0 or more, got {tokens}")
    tokens = max(1 if tokens is None else tokens, step)         # --step picks the step the page opens on
    if step < 0:
        raise OptionError(f"--step must be 0 (prefill) or a decode step number, got {step}")
    check_run_options(ctx_size)
    dg.check_graphviz(fmt)
    def check(c) -> None:                      # against the model's header, before the load
        from llamatrace.views.diagram.highlight import not_run_reason
        parse_layers(layer, c.n_layers, one=fmt != "html")
        if fmt == "html":
            check_steps_fit("--tokens" if tokens > step else "--step", tokens, c, ctx_size)
        else:
            check_steps_fit("--step", step, c, ctx_size)
        if mark is not None and mark.stage_ids and not mark.stage_ids & model_stage_ids(c):
            stage = STAGE_BY_ID[min(mark.stage_ids, key=STAGE_IDS.index)]
            why = not_run_reason(stage, c, (parse_layers(layer, c.n_layers) or [0])[0], 2)
            raise OptionError(f"--highlight {mark.label}: never drawn for this model: {why}")

    r = run.prepare(check, ctx_size)
    m, text, ids, chat = r.model, r.text, r.ids, r.chat
    layers = parse_layers(layer, m.config.n_layers, one=fmt != "html")
    layers = list(range(m.config.n_layers)) if layers is None else layers
    if fmt == "html":
        from llamatrace.views.page import build_page

        with status_spinner(f"Tracing the prefill and {tokens} decode step{'s' * (tokens != 1)} "
                            f"({len(ids)} prompt tokens, every layer) …"):
            page = build_page(m, text, ids, chat=chat, value_layers=layers, tokens=tokens, highlight=mark,
                              ctx_size=ctx_size, view=view, step=step)
        write_atomic(output, lambda f: f.write(page), "-o")
        err.print(f"[dim]wrote {output} ({len(page) / 1e6:.1f} MB, steps 0-{tokens}, values of "
                  f"layer{'s' * (len(layers) > 1)} {layer_list(layers)})[/]", soft_wrap=True)
        return
    layer_n = layers[0]
    with status_spinner(f"Tracing {'prefill' if step == 0 else f'decode step {step}'} "
                        f"({len(ids)} prompt tokens, layer {layer_n}) …"):
        events, run = dg.trace_step(m, text, ids, chat=chat, layer=layer_n, step=step, stats=stats,
                                    ctx_size=ctx_size)
    graph = dg.build_diagram(events, run, view=view, highlight=mark, stats=stats, timings=timings)
    data = dg.render(graph, fmt)
    write_atomic(output, lambda f: f.write(data), "-o")
    err.print(f"[dim]wrote {output} ({fmt}, {view} view, layer {layer_n}, step {step}"
              f"{', ' + mark.label if mark else ''})[/]", soft_wrap=True)
