"""``llamatrace attention``: heatmaps of one layer's attention probabilities (``kq_soft_max``).

The data is :func:`llamatrace.analysis.look.attention`; the picture :mod:`llamatrace.views.plots`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.errors import OptionError
from llamatrace.cli.app import app, err, plural, stdout
from llamatrace.cli.options import RunOptions, check_run_options, check_steps_fit, parse_layers, run_options


@app.command()
@run_options(ablate=True)
def attention(
    run: RunOptions,
    layer: Annotated[str, typer.Option("--layer", "-l", help="The layer to show (0-based; negative from the end: -1 the last, -2 the one before).")] = "0",
    head: Annotated[Optional[int], typer.Option(
        "--head", help="One query head (default: a grid of all heads, one row per KV head group).",
        show_default=False)] = None,
    step: Annotated[int, typer.Option(
        "--step", help="0 = the prompt's prefill (every query row); S >= 1 = decode step S (greedy), its one "
        "query row against the whole cache.")] = 0,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Image file: .png, .svg or .pdf (default: attention.png, or none with --json).",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the matrices as one JSON object (masked "
                                                          "cells are null).")] = False,
) -> None:
    """Draw one layer's attention: which keys each query token attends to, per head.

    Query tokens run down, key tokens across, each labelled with its piece; grey cells are
    masked (keys after the query), so they never pass for small probabilities. Query head h
    reads KV head h // n_rep (grouped-query attention): the grid has one row per KV head.
    The chat template is applied unless --raw.

    Examples:

      llamatrace attention --raw "The capital of France is" --layer 3 -o attention.png

      llamatrace attention --raw "The capital of France is" --layer -1 --head 4 --step 2 -o step2.svg

      llamatrace attention "Why is the sky blue?" --layer 0 --json > attention.json

      llamatrace attention --raw "The capital of France is" --layer 5 --ablate kqv@2:1 -o ablated.png
    """
    from llamatrace.outputs import check_output_path
    from llamatrace.views.plots import check_format

    # everything that can be checked without the model, before loading it
    if step < 0:
        raise OptionError(f"--step must be >= 0 (0 = the prefill), got {step}")
    if head is not None and head < 0:
        raise OptionError(f"--head must be >= 0, got {head}")
    if parse_layers(layer) is None or not layer.strip().lstrip("-").isdecimal():
        raise OptionError(f"--layer {layer!r}: attention shows one layer; give N (0-based) or -1 for the last")
    check_run_options(ablate=run.ablate)
    if output is None and not json_out:
        output = Path("attention.png")
    if output is not None:
        check_format(output)
        check_output_path(output, "-o")
    def check(c) -> None:                      # against the model's header, before the load
        layers = parse_layers(layer, c.n_layers, one=True)
        if layers is None or len(layers) != 1:
            raise OptionError(f"--layer {layer!r}: attention shows one layer; give N (0-{c.n_layers - 1}) or -1")
        if c.is_recurrent(layers[0]):              # Qwen3.5: no softmax pattern on a DeltaNet layer
            raise OptionError(f"--layer {layers[0]} is a gated DeltaNet layer: it keeps a state, not an attention "
                              f"pattern; its attention layers are {', '.join(map(str, c.attn_layers))}")
        check_steps_fit("--step", step, c)
        if head is not None and head >= c.n_heads:
            raise OptionError(f"--head {head} is out of range: this model has {c.n_heads} query heads "
                              f"(0-{c.n_heads - 1})")

    r = run.prepare(check)
    m, ids, ablations = r.model, r.ids, r.ablations
    c = m.config
    layers = parse_layers(layer, c.n_layers, one=True)

    from llamatrace.analysis.look import attention as run_attention

    with r.ablated():
        maps = run_attention(m, ids, layers[0], step)
    tok = m.tokenizer
    pieces = [tok.piece(i) for i in maps.ids]
    heads = list(range(c.n_heads)) if head is None else [head]
    if output is not None:
        from llamatrace.views.plots import save_attention

        what = "prefill" if step == 0 else f"decode step {step}"
        title = f"{m.path.name} · layer {layers[0]} · {what} · kq_soft_max"
        if ablations:
            title += " · ablated " + ", ".join(a.text for a in ablations)
        save_attention(maps, pieces, heads, title, output)
        err.print(f"wrote {output} ({plural(len(heads), 'head')}, {plural(len(maps.query_pos), 'query', 'queries')} × "
                  f"{plural(len(maps.ids), 'key')})")
    if json_out:
        result = {
            "model": str(m.path), "prompt_ids": maps.ids[:len(ids)], "ids": maps.ids, "pieces": pieces,
            "layer": layers[0], "step": step, "query_pos": maps.query_pos, "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads, "ablate": [a.text for a in ablations],
            "heads": [{"head": h, "kv_head": h // c.n_rep,
                       "probs": [[None if masked else float(p) for p, masked in zip(row, mask_row)]
                                 for row, mask_row in zip(maps.probs[h], maps.masked)]} for h in heads],
        }
        stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
