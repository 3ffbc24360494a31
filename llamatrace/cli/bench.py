"""``llamatrace bench``: load time, prefill and decode speed, peak memory, against peers."""

from __future__ import annotations

import json
import statistics
from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, out, plural, status_spinner
from llamatrace.cli.options import (ModelOpt, NoCacheOpt, ThreadsOpt, check_activations, check_threads,
                                    default_activations, model_file)


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
    no_cache: NoCacheOpt = False,
    activations: Annotated[Optional[list[str]], typer.Option(
        "--activations", metavar="f32|q8", help="llamatrace's activations: f32 (float32, HF's arithmetic) or q8 "
        "(8-bit, llama.cpp's). Repeatable: each mode runs as an engine of its own. Default: generate's "
        "(q8 for models of 1 B parameters or more on CPUs with AVX2, else f32).", show_default=False)] = None,
    background_load: Annotated[int, typer.Option(
        "--background-load", metavar="N", help="Keep N cores busy (N busy-loop processes) for the whole bench: "
        "the speed on a shared machine, reproducibly.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
) -> None:
    """Time load, prefill and decode, and measure peak memory (each engine in its own process,
    runs interleaved so a noisy machine slows every engine alike).

    It also measures the machine's limits (read bandwidth; the int8 multiply-add peak of the
    instruction 8-bit kernels use; the float32 one, the f32 mode's) and shows how far each engine's
    prefill and decode get. The
    read is of memory on 2 MiB pages, then on small pages (those of weights packed with
    --no-cache), and again after each round of runs; beside each engine, how much of its memory
    is on 2 MiB pages. Decode is timed as each engine's greedy loop runs: forward pass and argmax.

    Examples:

      llamatrace bench

      llamatrace bench --against llama.cpp --prompt-tokens 22 --repeats 3

      llamatrace bench --activations f32 --activations q8 --against llama.cpp

      llamatrace bench --background-load 2 --threads 1

      llamatrace bench --model Llama-3.1-8B-Q4_0.gguf --against llama.cpp --decode-tokens 16 --json
    """
    from rich.table import Table

    from llamatrace.analysis.bench import engine_name, run_bench
    from llamatrace.kernels.int8.amx import CALIBRATION_ROUNDS

    for mode in activations or ():
        check_activations(mode)
    check_threads(threads)
    path = model_file(model)
    with status_spinner("") as status:
        report = run_bench(path, against=against or [], prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                           repeats=repeats, threads=threads, activations=activations or [default_activations(path)],
                           background_load=background_load, progress=lambda msg: status.update(msg))
    if as_json:
        out.print_json(json.dumps(report.to_dict(), allow_nan=False))
        return
    ours = report.results[0]
    peers = f"; peers: {plural(report.threads, 'thread')}" if any(not r.engine.startswith("llamatrace")
                                                                    for r in report.results) else ""
    out.print(f"{path.name} ({report.file_bytes / 1e9:.2f} GB) · {report.cpu} · llamatrace: {ours.threading}{peers}"
              f" · prefill {plural(report.prompt_tokens, 'token')}, "
              f"decode {plural(report.decode_tokens, 'step')} · "
              f"median of {report.repeats} (min–max)"
              + (f" · {plural(report.background_load, 'busy loop')} beside it" if report.background_load else ""),
              soft_wrap=True)
    m, cost = report.machine, report.cost
    peak = f"int8 multiply-adds {m.int8_gmac_s:.0f} G/s ({m.isa})" if m.int8_gmac_s else "no int8 peak (no AVX2)"
    peak += f", AMX int8 {m.amx_gmac_s:.0f} G/s (tdpbssd)" if m.amx_gmac_s else ""
    peak += f", float32 {m.f32_gmac_s:.0f} G/s ({m.f32_isa})" if m.f32_gmac_s else ""
    between = m.read_between_runs_gb_s
    out.print(f"limits on {plural(m.threads, 'thread')}: reads {m.read_gb_s:.1f} GB/s "
              f"({m.read_small_pages_gb_s:.1f} on small pages; {min(between):.1f}–{max(between):.1f} between the "
              f"runs), {peak} · a token: "
              f"{cost.weight_bytes / 1e9:.3g} GB of weights, {cost.macs / 1e9:.3g} G multiply-adds "
              f"({cost.prefill_macs / 1e9:.3g} G in a prefill: logits for its last token only)", soft_wrap=True)
    if report.n_recurrent_layers:            # memory: the KV cache grows with the context, the states do not
        out.print(f"memory per token {report.kv_bytes_per_token:,} bytes (KV of the "
                  f"{plural(report.n_attn_layers, 'attention layer')}, float32); recurrent state "
                  f"{report.state_bytes:,} bytes, fixed (conv + DeltaNet state of "
                  f"{plural(report.n_recurrent_layers, 'layer')}, float32)", soft_wrap=True)
    out.print(f"AMX prefill: {m.amx}", soft_wrap=True)
    for t in m.amx_matmuls:          # where AMX is available: both kernels on the same matmul, here and now
        out.print(f"  {t['type']} [{t['rows']}, {t['n_in']}] x [{t['n_out']}, {t['n_in']}]^T: AMX "
                  f"{t['amx_gmac_s']:.0f} G/s, VNNI {t['vnni_gmac_s']:.0f} G/s ({t['speedup']:.2f}x; "
                  f"{'same bits' if t['same_bits'] else 'not the same bits'}; best of {CALIBRATION_ROUNDS} alternated rounds)", soft_wrap=True)
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
    from llamatrace.kernels.types.registry import served_types
    q8_types = {t.name for t in served_types("q8")}
    int8_products = any(t in q8_types for t in report.matrix_types)     # else q8 runs float32 products too
    for r in report.results:
        roof = report.roofline(r)
        if r.engine == engine_name("f32") or (r.engine == engine_name("q8") and not int8_products):
            # float32 multiply-adds: the int8 peaks are not their limit
            peaks = [f"{roof['prefill_of_f32_peak']:.0%} of the float32 peak"] if m.f32_gmac_s else []
            if r.engine == engine_name("q8") and m.f32_gmac_s:
                peaks[0] += f": no {'/'.join(report.matrix_types)} matrix has an int8 product"
        else:
            peaks = [f"{roof['prefill_of_int8_peak']:.0%} of the int8 peak"] if m.int8_gmac_s else []
            peaks += [f"{roof['prefill_of_amx_peak']:.0%} of the AMX peak"] if m.amx_gmac_s else []
        of_peak = f" ({', '.join(peaks)})" if peaks else ""
        out.print(f"{r.engine}: prefill {roof['prefill_gmac_s']:.3g} G multiply-adds/s{of_peak}, decode "
                  f"{roof['decode_gb_s']:.3g} GB/s of weights ({roof['decode_of_read_bw']:.0%} of the read bandwidth; "
                  f"{r.huge_page_bytes / 1e9:.2f} GB of the process on 2 MiB pages)", soft_wrap=True)
        if r.compile_s:
            out.print(f"{r.engine}: load {r.load_s:.1f} s, after {r.compile_s:.1f} s of compiling its kernels (a first "
                      f"run's: Numba's cache keeps them; its peak RSS includes the compiler's)", soft_wrap=True)
        if r.before_load_rss_bytes:         # /proc could tell (Linux)
            out.print(f"{r.engine}: peak RSS {r.peak_rss_bytes / 1e9:.2f} GB; {r.before_load_rss_bytes / 1e9:.2f} GB "
                      f"before the model (interpreter, libraries); the file's own pages after the runs "
                      f"{r.file_rss_bytes / 1e9:.2f} GB ({r.file_rss_bytes / report.file_bytes:.0%} of the file)",
                      soft_wrap=True)
    if base is not None:
        out.print("÷ llama.cpp: prefill / decode tok/s as a ratio of llama.cpp's in the same run")
        for r in report.results:
            if r is not base:
                ratios = report.round_ratios(r, base)
                out.print(f"{r.engine} ÷ llama.cpp round by round (each run against llama.cpp's of the same round): "
                          + ", ".join(f"{k} {statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})"
                                      for k, v in ratios.items()), soft_wrap=True)
