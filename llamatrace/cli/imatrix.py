"""``llamatrace imatrix``: the importance matrix ``llama-imatrix`` computes, in its GGUF format;
the work is in :mod:`llamatrace.quantize.imatrix.compute`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, err, exit_interrupted, out, plural, stdout
from llamatrace.cli.options import (ModelOpt, NoCacheOpt, RayOpt, RunActivationsOpt, WorkerThreadsOpt, WorkersOpt,
                                     check_activations, check_threads, default_activations, load_model, model_file, reads)
from llamatrace.cli.progress import CountBar


@app.command()
def imatrix(
    text_file: Annotated[Path, typer.Option("--file", "-f", help="The calibration text (UTF-8); - = standard input.",
                                            show_default=False,
                                            callback=reads("the calibration text this run reads (-f)"))],
    output: Annotated[Path, typer.Option("--output", "-o", help="The importance matrix to write (llama.cpp's "
                                         "GGUF imatrix format, as llama-imatrix writes it).")] = Path("imatrix.gguf"),
    model: ModelOpt = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="Tokens per chunk; every token of every chunk "
                                          "is summed (a shorter text: one chunk of its length).")] = 512,
    chunks: Annotated[Optional[int], typer.Option("--chunks", help="Evaluate at most N chunks (default: all).",
                                                  show_default=False)] = None,
    process_output: Annotated[bool, typer.Option("--process-output", metavar="", help="Collect output.weight "
                              "too (llama-imatrix's --process-output; a model whose output is tied to the "
                              "token embedding has none).")] = False,
    activations: RunActivationsOpt = None,
    workers: WorkersOpt = 1,
    ray: RayOpt = None,
    threads: WorkerThreadsOpt = None,
    no_cache: NoCacheOpt = False,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON summary object on stdout.")]
    = False,
) -> None:
    """The importance matrix of a model over a calibration text, as llama.cpp's llama-imatrix computes it.

    For every weight matrix of the blocks, the sum over the text's tokens of the square of each
    of its input columns (and the number of tokens), written as llama.cpp's GGUF imatrix: give it
    to `llama-quantize --imatrix` or `llamatrace quantize --imatrix`. The text is tokenized once
    and cut into chunks of --ctx-size tokens (BOS first), each run from an empty cache, as
    llama-imatrix does (which wants two chunks; one is enough here); q8 activations (the default
    from 1 B parameters) compute them with llama.cpp's arithmetic (its numbers within 1e-3), f32
    (the default below) with HF's. A summary goes to stdout, a progress bar to stderr (in a log or
    a pipe, a line at each tenth of the chunks and at least every 30 s).

    Examples:

      llamatrace imatrix -f calibration.txt -o imatrix.gguf --activations q8

      llamatrace imatrix -f calibration.txt -m base-F16.gguf --ctx-size 128 -o imatrix.gguf --workers 2

      llamatrace imatrix -f wiki.train.raw -m 8B-Q8_0.gguf -o 8b.imatrix.gguf --ray head-node:6379 --workers 8

      llama-quantize --imatrix imatrix.gguf base-F16.gguf Q4_K_M.gguf Q4_K_M
    """
    from llamatrace.corpus.chunks import read_corpus
    from llamatrace.corpus.worker import ModelSpec, threads_per_worker
    from llamatrace.outputs import check_output_path
    from llamatrace.quantize.imatrix.compute import ImatrixRun, calibration_text, compute, prepare
    from llamatrace.quantize.imatrix.files import write_imatrix

    if activations is not None:
        check_activations(activations)
    check_threads(threads, ray is not None)
    text = calibration_text(read_corpus(text_file))
    check_output_path(output, "-o")        # before a first run fetches the default model …
    path = model_file(model)
    check_output_path(output, "-o")        # … and once it is known: -o must not be it ($LLAMATRACE_MODEL)
    activations = activations or default_activations(path)
    in_process = workers == 1 and ray is None
    # on Ray, an actor's threads are what it reserves (--threads, else 1): the driver's cores say nothing of a node's
    spec = ModelSpec(str(path), activations,
                     threads if in_process or ray is not None else threads_per_worker(workers, threads))
    run = ImatrixRun(spec, text, str(text_file), ctx_size, chunks, process_output, workers, ray)
    prepared = prepare(run)                     # bad text or options: refused before the model loads
    plan = prepared[0]
    if plan.n_ctx < ctx_size:
        err.print(f"[yellow]note:[/] the text is {plural(plan.n_ctx, 'token')}, fewer than --ctx-size {ctx_size}: "
                  f"it is summed as one chunk of {plural(plan.n_ctx, 'token')}")
    m = load_model(path, threads, activations) if in_process else None
    t0 = time.perf_counter()
    try:
        with CountBar(f"imatrix {path.name}", "chunks", "evaluated", parallel=workers) as bar:
            bar.update(0, plan.n_chunk)
            result = compute(run, m, lambda i: bar.update(i + 1, plan.n_chunk), prepared)
        write_imatrix(output, result.entries, result.meta, "-o")
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: nothing written")
        exit_interrupted()
    seconds = time.perf_counter() - t0
    c = result.chunks
    n_tokens = c.n_chunk * c.n_ctx
    if json_out:
        stdout.write(json.dumps({"output": str(output), "model": str(path), "entries": len(result.entries),
                                 "ctx_size": c.n_ctx, "n_chunks": c.n_chunk, "n_tokens": n_tokens,
                                 "activations": activations, "workers": workers, "threads": spec.threads,
                                 "ray": ray, "seconds": round(seconds, 3),
                                 "tokens_per_s": round(n_tokens / seconds, 1)}) + "\n")
    else:
        out.print(f"{output}: {len(result.entries)} weights, {plural(c.n_chunk, 'chunk')} of "
                  f"{plural(c.n_ctx, 'token')} ({n_tokens} tokens)", markup=False)
    stdout.flush()
    err.print(f"[dim]{plural(c.n_chunk, 'chunk')} of {plural(c.n_ctx, 'token')} in {seconds:.1f} s: "
              f"{n_tokens / seconds:.0f} tokens/s ({plural(workers, 'worker')}{' on Ray' if ray else ''}, "
              f"{activations})[/]")
