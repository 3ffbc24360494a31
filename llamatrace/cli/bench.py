"""``llamatrace bench``: load time, prefill and decode speed, peak memory, against peers."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, err, out, plural
from llamatrace.cli.options import ModelOpt, ThreadsOpt, check_activations


@app.command()
def bench(
    model: ModelOpt = None,
    against: Annotated[Optional[list[str]], typer.Option(
        "--against", metavar="llama.cpp|hf", help="Also time a peer on the same file and ids: 'llama.cpp' (llama-cpp-python) "
        "or 'hf' (HF transformers, fp32). Repeatable.", show_default=False)] = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Tokens in the prefill.")] = 128,
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", help="Greedy decode steps after it.")] = 64,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed runs per engine (the median is shown).")] = 5,
    threads: ThreadsOpt = None,
    activations: Annotated[Optional[list[str]], typer.Option(
        "--activations", metavar="f32|q8", help="llamatrace's activations: f32 (the default, float32) or q8 (8-bit, as "
        "llama.cpp). Repeatable: each mode runs as an engine of its own.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
) -> None:
    """Time load, prefill and decode, and measure peak memory (each engine in its own process,
    runs interleaved so a noisy machine slows every engine alike).

    Examples:

      llamatrace bench

      llamatrace bench --against llama.cpp --prompt-tokens 22 --repeats 3

      llamatrace bench --activations f32 --activations q8 --against llama.cpp

      llamatrace bench --model Llama-3.1-8B-Q4_0.gguf --against llama.cpp --decode-tokens 16 --json
    """
    from rich.table import Table

    from llamatrace.analysis.bench import run_bench
    from llamatrace.gguf.fetch import resolve_model

    for mode in activations or ():
        check_activations(mode)
    path = resolve_model(model, log=lambda msg: err.print(msg))
    with err.status("") as status:
        report = run_bench(path, against=against or [], prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                           repeats=repeats, threads=threads, activations=activations or ["f32"],
                           progress=lambda msg: status.update(msg))
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    ours = report.results[0]
    out.print(f"{path.name} ({report.file_bytes / 1e9:.2f} GB) · {report.cpu} · llamatrace: {ours.threading}; "
              f"peers: {plural(report.threads, 'thread')} · prefill {plural(report.prompt_tokens, 'token')}, "
              f"decode {plural(report.decode_tokens, 'step')} · "
              f"median of {report.repeats} (min–max)", soft_wrap=True)
    base = next((r for r in report.results if r.engine == "llama.cpp"), None)
    table = Table()
    for col in ("engine", "load s", "prefill tok/s", "decode tok/s", "peak RSS GB"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    if base is not None:
        table.add_column("÷ llama.cpp", justify="right")

    def num(v: float, digits: int) -> str:      # significant digits, never an exponent
        return f"{v:.{digits}g}" if v < 10 ** digits else f"{v:.0f}"

    def rate(median: float, runs: list[float]) -> str:
        return f"{num(median, 4)} ({num(min(runs), 3)}–{num(max(runs), 3)})"

    for r in report.results:
        row = [r.engine, f"{r.load_s:.1f}", rate(r.prefill, r.prefill_tok_s), rate(r.decode, r.decode_tok_s),
               f"{r.peak_rss_bytes / 1e9:.2f}"]
        if base is not None:
            row.append(f"{r.prefill / base.prefill:.2f} / {r.decode / base.decode:.2f}")
        table.add_row(*row)
    out.print(table)
    if base is not None:
        out.print("÷ llama.cpp: prefill / decode tok/s as a ratio of llama.cpp's in the same run")
