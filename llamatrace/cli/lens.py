"""``llamatrace lens``: the logit lens — what the model would predict after each layer.

The data is :func:`llamatrace.analysis.look.logit_lens`; the picture :mod:`llamatrace.views.plots`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from llamatrace.errors import OptionError
from llamatrace.cli.app import app, err, stdout
from llamatrace.cli.options import RunOptions, check_run_options, print_wide, run_options


@app.command()
@run_options(ablate=True)
def lens(
    run: RunOptions,
    positions: Annotated[int, typer.Option("--positions", "-k", help="Show the last K positions of the prompt.")] = 6,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Also draw a heatmap to FILE: .png, .svg or .pdf.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
) -> None:
    """The logit lens: the residual stream after the embeddings and after every layer, read
    through the final RMSNorm and the output projection.

    Per layer (down) and position (across): the top-1 next token and its probability; the
    last column gives the probability and rank of the token the model finally predicts (rank
    0 = it is already the top-1). The last layer's row is the model's own output, bit for bit.
    The chat template is applied unless --raw.

    Examples:

      llamatrace lens --raw "The capital of France is"

      llamatrace lens --raw "The capital of France is" --positions 3 -o lens.png

      llamatrace lens --raw "The capital of France is" --json > lens.json

      llamatrace lens --raw "The capital of France is" --ablate ffn_out@-1
    """
    if positions < 1:
        raise OptionError(f"--positions must be >= 1, got {positions}")
    check_run_options(ablate=run.ablate)
    if output is not None:
        from llamatrace.outputs import check_output_path
        from llamatrace.views.plots import check_format

        check_format(output)
        check_output_path(output, "-o")
    r = run.prepare()
    m, ids, ablations = r.model, r.ids, r.ablations

    from llamatrace.analysis.look import logit_lens

    with r.ablated():
        result = logit_lens(m, ids, positions)
    tok = m.tokenizer
    pieces = [tok.piece(i) for i in ids]
    final = tok.piece(result.final_id)
    if output is not None:
        from llamatrace.views.plots import save_lens

        title = f"{m.path.name} · logit lens · final prediction {final!r}"
        if ablations:
            title += " · ablated " + ", ".join(a.text for a in ablations)
        save_lens(result, pieces, title, output)
        err.print(f"wrote {output}")
    if json_out:
        doc = {"model": str(m.path), "prompt_ids": ids, "final_id": result.final_id, "final_piece": final,
               "ablate": [a.text for a in ablations], "rows": [r.to_json() for r in result.rows]}
        stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
        return
    print_wide(_table(result, pieces, final))


def _show(piece: str, width: int = 8) -> str:
    """A piece for the table: a leading space as ␣, control characters escaped, no quotes, cut
    with … past ``width`` characters."""
    from llamatrace.text.tokenizer import quoted

    text = quoted(piece)[1:-1]
    text = "␣" + text[1:] if text.startswith(" ") else text
    return text if len(text) <= width else text[:width - 1] + "…"


def _prob(p: float) -> str:
    """0.42 → '.42', 1.00 stays '1.00' (narrow columns)."""
    text = f"{p:.2f}"
    return text[1:] if text.startswith("0") else text


def _table(result, pieces: list[str], final: str):
    from rich import box
    from rich.table import Table

    k = len(result.positions)
    table = Table(title=f"Logit lens: top-1 next token and its probability; final: {escape(_show(final))}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", justify="right", min_width=5, no_wrap=True)
    for p in result.positions:
        table.add_column(escape(f"{p}:{_show(pieces[p])}"), no_wrap=True)
    table.add_column(escape(f"p({_show(final)})"), justify="right", no_wrap=True)
    table.add_column("rank", justify="right", no_wrap=True)
    for i in range(0, len(result.rows), k):
        row = result.rows[i:i + k]
        cells = []
        for r in row:
            text = escape(f"{_show(r.top_piece)} {_prob(r.top_prob)}")
            cells.append(f"[bold green]{text}[/]" if r.top_id == result.final_id else text)
        last = row[-1]
        table.add_row(str(last.layer), *cells, f"{last.final_prob:.3f}", str(last.final_rank))
    return table
