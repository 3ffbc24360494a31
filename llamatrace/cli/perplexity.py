"""``llamatrace perplexity``: PPL (and KL divergence against a base model) over a text, as
``llama-perplexity`` computes them; the work is in :mod:`llamatrace.corpus`."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, err, exit_interrupted, out, plural, stdout
from llamatrace.cli.options import (ModelOpt, NoCacheOpt, RayOpt, RunActivationsOpt, WorkerThreadsOpt, WorkersOpt,
                                     check_activations, check_threads, default_activations, load_model, model_file, reads)
from llamatrace.cli.progress import CountBar
from llamatrace.errors import NumericalError, OptionError


@app.command()
def perplexity(
    text_file: Annotated[Path, typer.Option("--file", "-f", help="The text (UTF-8) to score; - = standard input.",
                                            show_default=False, callback=reads("the text this run scores (-f)"))],
    model: ModelOpt = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="Tokens per chunk; the second half "
                                          "of each chunk is scored.")] = 512,
    chunks: Annotated[Optional[int], typer.Option("--chunks", help="Score at most N chunks (default: all).",
                                                  show_default=False)] = None,
    activations: RunActivationsOpt = None,
    base: Annotated[Optional[Path], typer.Option("--base", help="KL divergence against a base model: a GGUF "
                    "with the same vocabulary, or a base file (--save-base, or llama.cpp's "
                    "--kl-divergence-base).", show_default=False,
                    callback=reads("the base this run compares against (--base)"))] = None,
    save_base: Annotated[Optional[Path], typer.Option("--save-base", help="Keep the base GGUF's log-probabilities "
                         "in FILE (llama.cpp's --kl-divergence-base format), for later --base FILE runs.",
                         show_default=False)] = None,
    stages: Annotated[bool, typer.Option("--stages", metavar="", help="With --base BASE.gguf: where the "
                      "error enters: every stage of every layer of both models compared on the scored tokens "
                      "(median and 95 % of the relative difference), worst first.")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="With --stages: a heat map (layers × "
                      "stages) and the residual difference by layer (.png, .svg or .pdf).",
                      show_default=False)] = None,
    workers: WorkersOpt = 1,
    ray: RayOpt = None,
    threads: WorkerThreadsOpt = None,
    no_cache: NoCacheOpt = False,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object instead of the "
                                           "llama-perplexity log.")] = False,
) -> None:
    """Perplexity of a model over a text, computed as llama.cpp's llama-perplexity does.

    The text is tokenized once and cut into chunks of --ctx-size tokens; each chunk runs from
    an empty cache and the logits of its second half are scored against the next token.
    Running values [1]…,[2]… and the final estimate go to stdout, a progress bar to stderr.
    Models of 1 B parameters or more run q8 activations by default, as llama-perplexity computes
    (and 2-4x faster there than f32); --activations f32 gives HF's arithmetic.

    Examples:

      llamatrace perplexity -f corpus.txt --ctx-size 256

      llamatrace perplexity -f corpus.txt -m Q4_K_M.gguf --base Q8_0.gguf --save-base q8.base

      llamatrace perplexity -f corpus.txt -m Q3_K_M.gguf --base q8.base --json --workers 2

      llamatrace perplexity -f corpus.txt -m Q4_K_M.gguf --base Q8_0.gguf --stages -o where.png

      llamatrace perplexity -f wiki.test.raw -m 8B-Q4_K_M.gguf --ray head-node:6379 --workers 8 --threads 4

      RAY_ADDRESS=head-node:6379 llamatrace perplexity -f wiki.test.raw --ray auto --workers 8
    """
    from llamatrace.corpus.chunks import read_corpus
    from llamatrace.corpus.perplexity_run import CorpusRun, execute
    from llamatrace.corpus.worker import ModelSpec, threads_per_worker
    from llamatrace.outputs import check_output_path

    if activations is not None:
        check_activations(activations)
    check_threads(threads, ray is not None)
    text = read_corpus(text_file)
    path = model_file(model)
    activations = activations or default_activations(path)
    in_process = workers == 1 and ray is None and not stages      # else workers or actors load it
    # on Ray, an actor's threads are what it reserves (--threads, else 1): the driver's cores say nothing of a node's
    spec = ModelSpec(str(path), activations,
                     threads if in_process or ray is not None else threads_per_worker(workers, threads))
    run = CorpusRun(spec, text, ctx_size, chunks, base, save_base, stages, workers, ray)
    run.check()
    if save_base is not None:
        check_output_path(save_base, "--save-base")
    if output is not None:
        if not stages:
            raise OptionError("-o draws the --stages attribution: add --stages")
        from llamatrace.views.plots import check_format
        check_format(output)
        check_output_path(output, "-o")
    m = load_model(path, threads, activations) if in_process else None

    values_shown = []             # the running values' line is open: an error or interrupt ends it first

    @contextmanager
    def progress(name: str, total: int, main: bool):
        # a bar on a terminal; in a log, a status line now and then (CountBar)
        with CountBar(name, "chunks", f"{name}: evaluated", parallel=workers, detail=True) as bar:
            bar.update(0, total, "PPL …")
            def on_chunk(i: int, ppl: float) -> None:
                if main and not json_out:       # llama.cpp's running values, as they come
                    out.print(f"[{i + 1}]{ppl:.4f},", end="", markup=False)
                    stdout.flush()
                    values_shown.append(i)
                bar.update(i + 1, total, f"PPL {ppl:.4f}")
            yield on_chunk

    started = time.time()
    try:
        result = execute(run, m, progress)
    except KeyboardInterrupt:
        if values_shown:
            out.print()
        saved = save_base is not None and save_base.is_file() and save_base.stat().st_mtime >= started - 1
        err.print("[yellow]interrupted[/]: " + (f"the base file {save_base} is complete (reuse it: --base "
                                                f"{save_base}); nothing else written" if saved else "nothing written"),
                  soft_wrap=True)
        exit_interrupted()
    except Exception:
        if values_shown:
            out.print()
        raise
    if json_out:
        stdout.write(json.dumps(result.as_json(run)) + "\n")
    else:
        out.print()
        if base is None:
            out.print(f"Final estimate: PPL = {result.scores.ppl:.4f} +/- {result.scores.ppl_error:.5f}", markup=False)
        else:
            _print_kld(result.scores)
        if result.attribution is not None:
            _print_stages(result.attribution)
    if result.attribution is not None and output is not None:
        from llamatrace.corpus.plot import plot_stage_errors
        plot_stage_errors(result.attribution, output, f"{path.name} against {Path(str(base)).name}")
        err.print(f"wrote {output}")
    stdout.flush()                  # a full disk behind stdout: its error line, not this summary
    c = result.chunks
    if base is None and not math.isfinite(result.scores.ppl):
        raise NumericalError(f"PPL is {result.scores.ppl}: {path.name} computes non-finite values (a damaged "
                             f"weight?); find the first stage with `llamatrace trace --check-finite`")
    ran = workers if ray else min(workers, c.n_chunk)             # the pool starts no more than one a chunk
    err.print(f"[dim]{plural(c.n_chunk, 'chunk')} of {plural(c.n_ctx, 'token')} in {result.seconds:.1f} s: "
              f"{result.tokens_per_s:.0f} tokens/s ({ran} worker{'s' if ran > 1 else ''}"
              f"{' on Ray' if ray else ''}, {activations})[/]")


def _print_kld(r) -> None:
    """The statistics blocks of ``llama-perplexity --kl-divergence``."""
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {r.ppl:10.6f} ± {r.ppl_error:10.6f}",
        f"Mean PPL(base)                : {r.ppl_base:10.6f} ± {r.ppl_base_error:10.6f}",
        f"Mean ln(PPL(Q)/PPL(base))     : {r.ln_ppl_ratio:10.6f} ± {r.ln_ppl_ratio_error:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {r.mean_kld:10.6f} ± {r.mean_kld_error:10.6f}",
        f"Maximum KLD: {r.max_kld:10.6f}",
        f"99.9%   KLD: {r.p999_kld:10.6f}",
        f"99.0%   KLD: {r.p99_kld:10.6f}",
        f"Median  KLD: {r.median_kld:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"RMS Δp    : {100 * r.rms_dp:6.3f} ± {100 * r.rms_dp_error:5.3f} %",
        f"Same top p: {100 * r.same_top_p:6.3f} ± {100 * r.same_top_p_error:5.3f} %",
    ]
    for line in lines:
        out.print(line, markup=False)


def _print_stages(a) -> None:
    """The attribution: the stages whose own weights add the most error, the worst accumulated
    differences, then the residual stream layer by layer."""
    width = max(12, *map(len, a.stages))             # Gemma's attn_post_norm is longer than Llama's names
    out.print()
    out.print(f"====== Where the error enters: each stage from the base's own inputs, ‖Q − base‖ / ‖base‖ "
              f"over {a.count} tokens, worst first ======", markup=False)
    out.print(f"{'layer':>5}  {'stage':<{width}} {'median':>9} {'95%':>9}", markup=False)
    for layer, stage, median, p95 in a.worst(local=True):
        out.print(f"{layer:>5}  {stage:<{width}} {median:9.5f} {p95:9.5f}", markup=False)
    for stage, why in a.local_notes.items():
        out.print(f"{'':>5}  {stage:<{width}} not recomputed: {why}", markup=False)
    out.print()
    out.print("====== Accumulated: ‖Q − base‖ / ‖base‖ with each model's own inputs, worst first ======",
              markup=False)
    out.print(f"{'layer':>5}  {'stage':<{width}} {'median':>9} {'95%':>9}", markup=False)
    for layer, stage, median, p95 in a.worst():
        out.print(f"{layer:>5}  {stage:<{width}} {median:9.5f} {p95:9.5f}", markup=False)
    out.print()
    out.print(f"{'layer':>5}  {'l_out':>9} {'added':>9}   (residual stream, medians)", markup=False)
    for layer, (resid, added) in enumerate(zip(a.l_out, a.added)):
        out.print(f"{layer:>5}  {resid:9.5f} {added:+9.5f}", markup=False)
    if a.experts is not None:
        _print_experts(a.experts)


def _num(v: float) -> str:
    """A median in 9 characters; – where it is not measured (NaN)."""
    return f"{'–':>9}" if v != v else f"{v:9.5f}"


def _print_experts(x) -> None:
    """The experts whose down projection adds the most error, and how often the quantized model
    kept the base's route, layer by layer."""
    stage = "ffn_moe_down" if "ffn_moe_down" in x.stages else x.stages[-1]
    out.print()
    out.print(f"====== Per expert: {stage} over the tokens the base routed to it, worst first ======", markup=False)
    out.print(f"{'layer':>5} {'expert':>6} {'local':>9} {'95%':>9} {'accum.':>9} {'tokens':>7} {'rerouted':>8}",
              markup=False)
    for layer, e, local, p95, acc, count, rerouted in x.worst(stage):
        out.print(f"{layer:>5} {e:>6} {_num(local)} {_num(p95)} {_num(acc)} {count:>7} {rerouted:>8}", markup=False)
    out.print("local: from the base's inputs on its route; accum.: against the quantized model's row of the "
              "same expert; rerouted: tokens it sent elsewhere (not measured)", markup=False)
    out.print()
    out.print(f"{'layer':>5}  {'route kept':>10}   (share of the base's (token, expert) choices the quantized model made too)",
              markup=False)
    for layer, (count, rerouted) in enumerate(zip(x.count.sum(1), x.rerouted.sum(1))):
        out.print(f"{layer:>5}  {1 - rerouted / max(count, 1):10.2%}", markup=False)
