"""``llamatrace trace``: run the prompt (and N decode steps) with a recorder and render every stage.

The command is thin: it checks options and output paths before loading anything, builds one
:class:`~llamatrace.tracing.recorder.Recorder` whose sinks are the views of :mod:`llamatrace.views.render`, runs
the ordinary :func:`~llamatrace.model.generate.generate` loop, and prints the top-N next tokens.
"""

from __future__ import annotations

import contextlib
import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.text import Text

from llamatrace import __version__
from llamatrace.analysis.compare import META_KEY
from llamatrace.errors import NumericalError, OptionError
from llamatrace.tracing.stages import (STAGE_BY_ID, STAGE_IDS, model_stage_ids, select_stages, stage_applies,
                                       stage_layers)
from llamatrace.cli.app import app, err, exit_interrupted, out, plural, stdout
from llamatrace.cli.options import (
    AblateOpt,
    ActivationsOpt,
    check_model_stages,
    check_run_options,
    CtxSizeOpt,
    default_prompt,
    LAYER_HELP,
    ModelOpt,
    NoCacheOpt,
    parse_layers,
    parse_stages,
    prepare_run,
    PromptFileOpt,
    RawOpt,
    remove_leftovers,
    SystemOpt,
    ThreadsOpt,
)


class Format(str, Enum):
    log = "log"
    table = "table"


@app.command()
def trace(
    prompt: Annotated[Optional[str], typer.Argument(
        help="The prompt text (default: the short sample in samples/prompt.txt).", show_default=False)] = None,
    model: ModelOpt = None,
    raw: RawOpt = False,
    system: SystemOpt = None,
    prompt_file: PromptFileOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Also trace N decode steps (greedy).")] = 0,
    layer: Annotated[str, typer.Option("--layer", "-l", help=LAYER_HELP)] = "all",
    stage: Annotated[Optional[list[str]], typer.Option(
        "--stage", "-s", help=f"Stage ids or globs (kq*), repeatable or comma-separated. Ids: {', '.join(STAGE_IDS)}.",
        show_default=False)] = None,
    fmt: Annotated[Format, typer.Option("--format", help="log: the chapters' log lines; table: a table per step.")]
        = Format.log,
    dump_shapes: Annotated[bool, typer.Option(
        "--dump-shapes", metavar="", help="Print only the log lines (shapes, no stats, values, times or colours) "
        "to stdout; the tokens and top-N go to stderr.")] = False,
    stats: Annotated[bool, typer.Option("--stats", metavar="", help="Statistics per stage (sum, mean, rms, min, max, "
                                                        "abs_max, nan, inf; float64).")] = False,
    values: Annotated[int, typer.Option("--values", help="Show the first and last K values of each tensor "
                                        "(all of them up to 2K).", metavar="K")] = 0,
    jsonl: Annotated[Optional[Path], typer.Option("--jsonl", help="Stream events as JSON lines to FILE ('-': "
                                                  "stdout, with no log lines; tokens and top-N go to stderr).",
                                                  metavar="FILE", show_default=False)] = None,
    npz: Annotated[Optional[Path], typer.Option("--npz", help="Save every traced tensor to FILE (.npz, keys "
                                                "step{S}.layer{L}.{stage}).", metavar="FILE", show_default=False)] = None,
    log_file: Annotated[Optional[Path], typer.Option("--log-file", help="Write the book's debug.log to FILE, "
                                                     "one '[DEBUG] TIME LINE' per log line.", metavar="FILE", show_default=False)] = None,
    timings: Annotated[bool, typer.Option("--timings", metavar="", help="Time per stage group (input, attention, ffn, output), "
                                                            "prefill vs decode, and the slowest stages.")] = False,
    check_finite: Annotated[bool, typer.Option("--check-finite", metavar="", help="Stop with an error at the first stage "
                                                                      "holding NaN or Inf.")] = False,
    top: Annotated[int, typer.Option("--top", help="How many next-token probabilities to show.", metavar="N")] = 5,
    ctx_size: CtxSizeOpt = None,
    ablate: AblateOpt = None,
    threads: ThreadsOpt = None,
    no_cache: NoCacheOpt = False,
    activations: ActivationsOpt = "f32",
) -> None:
    """Trace the forward pass stage by stage, in the words of the book's debug.log.

    Prints the prompt's tokens, then one or more log lines per stage as the forward pass runs
    (prefill, then --tokens decode steps), then the --top N next-token probabilities. The chat
    template is applied unless --raw, as in `generate`. Layers are numbered from 0, as in --layer.

    Examples:

      llamatrace trace --layer 0 --dump-shapes

      llamatrace trace --raw "The capital of France is" --layer -1 --stage "kq*" --stats

      llamatrace trace --tokens 3 --layer 0 --format table --timings

      llamatrace trace --jsonl trace.jsonl --npz trace.npz --log-file debug.log

      llamatrace trace --raw "The capital of France is" --ablate attn_out@3 --layer 3 --stage "attn_out,ffn_inp" --stats
    """
    from llamatrace.outputs import check_output_path, output_suffix

    # ---- everything that can be checked without the model, so bad input fails fast ----
    if tokens < 0:
        raise OptionError(f"--tokens must be >= 0, got {tokens}")
    if values < 0:
        raise OptionError(f"--values must be >= 0, got {values}")
    if top < 1:
        raise OptionError(f"--top must be >= 1, got {top}")
    check_run_options(ctx_size, ablate)
    if dump_shapes and fmt is Format.table:
        raise OptionError("--dump-shapes prints log lines: drop --format table")
    if dump_shapes and (stats or values):
        dropped = " and ".join(opt for opt, on in (("--stats", stats), ("--values", values)) if on)
        raise OptionError(f"--dump-shapes prints shapes only: drop {dropped}, or drop --dump-shapes to see them")
    parse_layers(layer)
    stage_patterns = parse_stages(stage)
    if _to_stdout(jsonl) and (dump_shapes or fmt is Format.table):
        shown = "--dump-shapes" if dump_shapes else "--format table"
        raise OptionError(f"--jsonl - writes the events to stdout: drop {shown}, or give --jsonl a file")
    outputs = {opt: p for opt, p in (("--jsonl", jsonl), ("--npz", npz), ("--log-file", log_file))
               if p is not None and not (opt == "--jsonl" and _to_stdout(p))}
    for opt, p in outputs.items():
        check_output_path(p, opt, whole_file=opt == "--npz")
    if npz is not None:
        output_suffix(npz, "--npz", ("npz",), "a recording", "trace.npz")  # what `compare` reads
    resolved = {}
    for opt, p in outputs.items():
        other = resolved.setdefault(p.resolve(), opt)
        if other != opt:
            raise OptionError(f"{other} and {opt} name the same file {str(p)!r}")
    remove_leftovers(*outputs.values())
    def check(_config) -> None:          # again once the model's file is known ($LLAMATRACE_MODEL, the default)
        for opt, p in outputs.items():
            check_output_path(p, opt, whole_file=opt == "--npz")

    r = prepare_run(prompt, prompt_file, model, threads=threads, activations=activations, raw=raw, system=system,
                    ablate=ablate, default=default_prompt(), ctx_size=ctx_size, check=check)
    layers = parse_layers(layer, r.model.config.n_layers)
    check_model_stages(stage_patterns, r.model.config, layers=layers)
    with r.ablated():
        _run(r.model, r.text, r.ids, r.load_s, tokens=tokens, layers=layers, stages=stage_patterns, fmt=fmt,
             dump_shapes=dump_shapes, stats=stats, values=values, jsonl=jsonl, npz=npz, log_file=log_file,
             timings=timings, check_finite=check_finite, top=top, ctx_size=ctx_size)


LONG_TRACE_STEPS, LONG_TRACE_EVENTS = 64, 2000
"""More decode steps than the first, printing more stage events than the second: the trace is
long, and a warning line says how long before it starts."""


def _to_stdout(path: Path | None) -> bool:
    return path is not None and str(path) == "-"


class _StdoutLines:
    """``--jsonl -``: :class:`~llamatrace.outputs.OutputStream`'s lines on stdout (a closed pipe is
    :class:`~llamatrace.cli.app.StdoutClosed`)."""

    def write_line(self, line: str) -> None:
        stdout.write(line + "\n")
        stdout.flush()


def _npz_meta(m) -> dict:
    """The recording's own key: what made it, for ``compare``."""
    return {META_KEY: np.array(json.dumps({"engine": "llamatrace", "version": __version__,
                                            "activations": m.activations, "model": str(m.path)}))}


def _run(m, text_in: str, ids: list[int], load_s: float, *, tokens: int, layers, stages, fmt: Format,
         dump_shapes: bool, stats: bool, values: int, jsonl: Path | None, npz: Path | None,
         log_file: Path | None, timings: bool, check_finite: bool, top: int, ctx_size: int | None) -> None:
    from llamatrace.model.generate import (
        GenerationStats,
        check_prompt_fits,
        default_ctx_size,
        generate,
    )
    from llamatrace.outputs import open_stream
    from llamatrace.views.render import (
        DebugLog,
        JsonlWriter,
        LineFormatter,
        LogView,
        TableView,
        timing_rollup,
        timings_view,
        tokens_table,
        top_k_probs,
        top_k_table,
        write_npz_atomic,
    )
    from llamatrace.text.tokenizer import quoted
    from llamatrace.tracing.recorder import Recorder

    max_tokens = tokens + 1            # the last token is chosen from the last traced step's logits
    ctx = ctx_size or default_ctx_size(m, len(ids), max_tokens)
    if tokens > LONG_TRACE_STEPS:
        # what a decode step emits: each chosen stage of this model, at the chosen layers that compute it
        c = m.config
        chosen = set(range(c.n_layers) if layers is None else layers)
        per_step = sum((stage_applies(STAGE_BY_ID[s], 1, c.n_rep, c.features) if STAGE_BY_ID[s].level == "model"
                        else len(chosen & set(stage_layers(s, c, seq_len=1))))
                       for s in select_stages(stages) & model_stage_ids(c))
        if tokens * per_step > LONG_TRACE_EVENTS:     # 70 steps of one stage is no long trace
            err.print(f"[yellow]warning:[/] tracing {tokens} decode steps prints about {tokens * per_step:,} "
                      f"stage events ({per_step} a step); narrow it with --layer / --stage, or fewer --tokens",
                      soft_wrap=True)
    check_prompt_fits(m, len(ids), ctx)
    # stdout carries the data; with --dump-shapes it carries only the lines, the rest goes to stderr
    side = err if dump_shapes or _to_stdout(jsonl) else out
    side.print(tokens_table(m.tokenizer, ids))
    if (fmt is Format.log and not _to_stdout(jsonl)) or dump_shapes:
        side.print(Text("Layers are numbered from 0 (--layer, CacheK[N], ↳ LN); the book's "
                        f"'layer: N / {m.config.n_layers}' wording counts from 1.", style="dim"))

    formatter = LineFormatter.for_model(m, ctx, select_stages(stages))
    run_stats = GenerationStats()
    generated: list[int] = []
    with contextlib.ExitStack() as stack:
        sinks = []
        if dump_shapes:
            sinks.append(LogView(out, formatter, plain=True))
        elif fmt is Format.table:
            table_view = TableView(out)
            sinks.append(table_view)
            stack.callback(table_view.flush)
        elif not _to_stdout(jsonl):
            sinks.append(LogView(out, formatter))
        writer = None
        files = []                       # --jsonl / --log-file: their names once the trace is done
        if jsonl is not None:
            lines = _StdoutLines() if _to_stdout(jsonl) else stack.enter_context(open_stream(jsonl, "--jsonl"))
            if not _to_stdout(jsonl):
                files.append(lines)
            writer = JsonlWriter(lines)
            writer.header(model=str(m.path), prompt=text_in, prompt_ids=ids,
                          pieces=[m.tokenizer.piece(i) for i in ids], config=m.config.to_dict(), activations=m.activations)
            sinks.append(writer)
        if log_file is not None:
            files.append(stack.enter_context(open_stream(log_file, "--log-file")))
            sinks.append(DebugLog(files[-1], formatter))
        recorder = Recorder(layers=layers, stages=stages, stats=stats, values=values, keep_arrays=npz is not None,
                            keep_events=npz is not None, check_finite=check_finite, sinks=sinks, time_all=True)
        try:
            for token in generate(m, ids, max_tokens=max_tokens, ctx_size=ctx, recorder=recorder, stats=run_stats):
                generated.append(token)
        except KeyboardInterrupt:                # nothing written: an old file stays as it was
            kept = "; ".join((["every line written to stdout so far is complete"] if _to_stdout(jsonl) else [])
                             + [f.kept() for f in files] + ([f"{npz} was not written"] if npz is not None else []))
            err.print("interrupted" + (f": {kept}" if kept else ""), markup=False)
            exit_interrupted()
        except NumericalError as exc:      # the trace up to the bad stage, that stage included, is the evidence
            for f in files:
                f.commit()
            if npz is not None:
                write_npz_atomic(npz, {**recorder.arrays(), **_npz_meta(m)})
            saved = [str(p) for p in (jsonl, log_file, npz) if p is not None and not _to_stdout(p)]
            saved += ["stdout"] if _to_stdout(jsonl) else []
            raise NumericalError(str(exc) + (f"; the trace so far is in {', '.join(saved)}" if saved else "")) from None

        top_tokens = top_k_probs(run_stats.last_logits, m.tokenizer, top)
        timing = {"load_s": round(load_s, 3), "prefill_s": round(run_stats.prefill_s, 4),
                  "decode_s": round(run_stats.decode_s, 4), "decode_steps": run_stats.decode_steps,
                  "prefill_tokens_per_s": round(run_stats.prefill_tokens_per_s, 2),
                  "decode_tokens_per_s": round(run_stats.decode_tokens_per_s, 2),
                  "stages_us": timing_rollup(recorder.stage_times)}
        if writer is not None:
            writer.footer(ids=generated, top_k=top_tokens, timings=timing)   # key kept: schema llamatrace.trace/1
        for f in files:
            f.commit()
    if npz is not None:
        write_npz_atomic(npz, {**recorder.arrays(), **_npz_meta(m)})

    steps = 1 + run_stats.decode_steps
    if run_stats.decode_steps < tokens:
        full = run_stats.ctx_size >= m.config.max_seq_len
        raise_it = "the model's own limit" if full else f"raise --ctx-size, at most the model's {m.config.max_seq_len}"
        why = ("end of text" if run_stats.stop_reason == "eos" else
               f"the context is full ({run_stats.ctx_size} tokens; {raise_it})")
        err.print(f"[yellow]note:[/] stopped after {plural(run_stats.decode_steps, 'decode step')}: {why}")
    if tokens:
        traced = generated[:run_stats.decode_steps]
        side.print(Text(f"decode steps fed: {' '.join(quoted(m.tokenizer.piece(i)) for i in traced)}"))
    side.print(top_k_table(top_tokens, f"Next-token probabilities after step {steps - 1} (top {len(top_tokens)})"))
    if timings:
        side.print(timings_view(recorder.stage_times, run_stats.decode_steps))
    err.print(f"[dim]{plural(len(ids), 'prompt token')}, {plural(run_stats.decode_steps, 'decode step')} · prefill "
              f"{run_stats.prefill_s * 1000:.0f} ms · decode {run_stats.decode_s * 1000:.0f} ms · "
              f"load {load_s:.1f} s[/]")
