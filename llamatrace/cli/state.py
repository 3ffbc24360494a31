"""``llamatrace state``: what each token wrote into a gated DeltaNet layer's state, per head.

The data is :func:`llamatrace.analysis.look.state_writes`; the picture :mod:`llamatrace.views.plots`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, err, plural, stdout
from llamatrace.cli.options import RunOptions, check_run_options, parse_layers, run_options
from llamatrace.errors import OptionError


@app.command()
@run_options(ablate=False)
def state(
    run: RunOptions,
    layer: Annotated[str, typer.Option("--layer", "-l", help="The gated DeltaNet layer to show (0-based; negative from the end).")] = "0",
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Image file: .png, .svg or .pdf (default: state.png, or none with --json).",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the per-head rows as one JSON object.")] = False,
) -> None:
    """Draw what each prompt token wrote into a recurrent (gated DeltaNet) layer's state, per head.

    The linear-attention counterpart of the attention heatmap, for Qwen3.5's DeltaNet layers:
    per value head, over the prompt's tokens, the norm of the token's write ‖β·k·(v − Sᵀk)‖
    (the part of v the state did not yet predict from k, scaled by β), the fraction of the
    state kept at that token exp(gate), and the state's norm after it. The chat template is
    applied unless --raw.

    Examples:

      llamatrace state -m Qwen3.5-0.8B-Q8_0.gguf --raw "The capital of France is" --layer 0 -o state.png

      llamatrace state -m Qwen3.5-0.8B-Q8_0.gguf --raw "The capital of France is" --layer 4 --json > state.json
    """
    from llamatrace.outputs import check_output_path
    from llamatrace.views.plots import check_format

    parse_layers(layer)
    check_run_options()
    if output is None and not json_out:
        output = Path("state.png")
    if output is not None:
        check_format(output)
        check_output_path(output, "-o")
    def check(c) -> None:                      # against the model's header, before the load
        if not c.recurrent_layers:
            raise OptionError(f"this model ({c.arch}) has no gated DeltaNet layers, so no recurrent state: state "
                              "shows a hybrid's (qwen35); trace --stage 'kq*' or attention show this model's attention")
        deltanet = ", ".join(map(str, c.recurrent_layers))
        layers = parse_layers(layer, c.n_layers, one=True)
        if layers is None or len(layers) != 1:
            raise OptionError(f"--layer {layer!r}: state shows one layer; give one of its gated DeltaNet layers "
                              f"({deltanet})")
        if not c.is_recurrent(layers[0]):
            shown = repr(layer) if layer.strip() == str(layers[0]) else f"{layer!r} (layer {layers[0]})"
            raise OptionError(f"--layer {shown} is a softmax attention layer, with no recurrent state; its gated "
                              f"DeltaNet layers are {deltanet}")

    r = run.prepare(check)
    m, ids = r.model, r.ids
    layers = parse_layers(layer, m.config.n_layers, one=True)

    from llamatrace.analysis.look import state_writes
    from llamatrace.tracing.recorder import finite_or_none

    def finite(row) -> list:                       # JSON has no NaN: null
        return [finite_or_none(float(v)) for v in row]

    sw = state_writes(m, ids, layers[0])
    pieces = [m.tokenizer.piece(i) for i in sw.ids]
    if output is not None:
        from llamatrace.views.plots import save_state

        save_state(sw, pieces, f"{m.path.name} · layer {layers[0]} · gated DeltaNet state · prefill", output)
        err.print(f"wrote {output} ({plural(sw.write.shape[0], 'head')} × {plural(len(sw.ids), 'token')})")
    if json_out:
        result = {
            "model": str(m.path), "layer": layers[0], "ids": sw.ids, "pieces": pieces,
            "heads": [{"head": h, "key_head": h % sw.n_k_heads, "write": finite(sw.write[h]),
                       "decay": finite(sw.decay[h]), "state_norm": finite(sw.state_norm[h])}
                      for h in range(sw.write.shape[0])],
        }
        stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
