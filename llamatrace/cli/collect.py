"""``llamatrace collect``: an activation dataset (Parquet shards + manifest) from a text corpus;
the work is in :mod:`llamatrace.corpus.collect`."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from llamatrace.cli.app import app, err, exit_interrupted, plural, stdout
from llamatrace.cli.options import (ModelOpt, NoCacheOpt, RayOpt, RunActivationsOpt, WorkerThreadsOpt, WorkersOpt,
                                     check_activations, check_threads, default_activations, load_model, model_file, reads)
from llamatrace.cli.progress import CountBar
from llamatrace.errors import OptionError


@app.command()
def collect(
    text_file: Annotated[Path, typer.Option("--file", "-f", help="The corpus (UTF-8): one document per line, "
                                            "or JSON lines with --jsonl.", show_default=False,
                                            callback=reads("the corpus this run reads (-f)"))],
    hook: Annotated[List[str], typer.Option("--hook", help="An activation to store, one vector per token: a "
                    "TransformerLens name (blocks.8.hook_resid_post) or a stage id (l_out@8). Repeat for more.",
                    show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the shards and .manifest.json; "
                      "rerunning the same command there continues after the last complete shard.",
                      show_default=False)],
    model: ModelOpt = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="Tokens per sequence (BOS first where "
                                          "the model adds one, as SAELens packs them).")] = 128,
    dtype: Annotated[str, typer.Option("--dtype", metavar="float32|float16",
                                       help="Type of the stored activations.")] = "float32",
    jsonl: Annotated[bool, typer.Option("--jsonl", metavar="", help="The corpus is JSON lines; the text "
                                        "is in --text-field.")] = False,
    text_field: Annotated[Optional[str], typer.Option("--text-field", help="The text's field with --jsonl "
                                                     "[default: text]", show_default=False)] = None,
    shard_mb: Annotated[float, typer.Option("--shard-mb", help="Approximate size of one shard, in MB.")] = 256.0,
    activations: RunActivationsOpt = None,
    workers: WorkersOpt = 1,
    ray: RayOpt = None,
    threads: WorkerThreadsOpt = None,
    no_cache: NoCacheOpt = False,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print a JSON summary on stdout at "
                                           "the end.")] = False,
) -> None:
    """Store activations of a corpus as a dataset: Parquet shards, one row per token.

    Each row holds sequence, position, token and one fixed-size float column per --hook;
    .manifest.json records the model (and its sha256), hooks, dtype, tokenization and every
    complete shard; the shards are in OUTPUT/data. The directory loads as it is with
    pyarrow.parquet.read_table("OUTPUT"), pandas.read_parquet("OUTPUT"),
    datasets.load_dataset("OUTPUT") or polars.scan_parquet("OUTPUT/**/*.parquet")
    (docs/collect.md, which also converts them to SAELens's cached activations).
    Models of 1 B parameters or more run q8 activations by default (llama.cpp's arithmetic, 2-4x
    faster there); --activations f32 gives HF's.

    Examples:

      llamatrace collect -f corpus.txt --hook blocks.8.hook_resid_post -o acts/

      llamatrace collect -f corpus.txt --hook blocks.8.hook_resid_post --hook blocks.16.hook_resid_post \\
          --ctx-size 128 --dtype float16 -o acts/ --workers 2

      llamatrace collect -f docs.jsonl --jsonl --hook l_out@3 -o acts/ --ray head-node:6379 --workers 8

      RAY_ADDRESS=head-node:6379 llamatrace collect -f docs.jsonl --jsonl --hook l_out@3 -o acts/ --ray auto
    """
    from llamatrace.corpus.chunks import read_header
    from llamatrace.corpus.collect import DTYPES, Collection, execute, manifest_lists_all, prepare, resolve_hooks
    from llamatrace.corpus.worker import ModelSpec, threads_per_worker
    from llamatrace.corpus.sequences import Packing
    from llamatrace.gguf.fetch import sha256_file

    if activations is not None:
        check_activations(activations)
    check_threads(threads, ray is not None)
    if str(text_file) == "-":
        raise OptionError("-f -: collect reads its corpus from a file, not standard input (a resumed run "
                          "checks it and reads it again); save the text to a file")
    if str(output) == "-":
        raise OptionError("-o -: collect writes a directory of Parquet shards, not standard output; give a "
                          "directory's path")
    if text_field is not None and not jsonl:
        raise OptionError(f"--text-field {text_field!r} names a field of JSON lines: add --jsonl")
    if dtype not in DTYPES:
        raise OptionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if ctx_size < 2:
        raise OptionError(f"--ctx-size must be at least 2, got {ctx_size}")
    if not 0 < shard_mb < math.inf:                    # nan and inf too: no shard size
        raise OptionError(f"--shard-mb must be a positive number of MB, got {shard_mb}")
    if workers < 1:
        raise OptionError(f"--workers must be a positive integer, got {workers}")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise OptionError("collect writes Parquet with pyarrow: pip install pyarrow") from None
    path = model_file(model)
    activations = activations or default_activations(path)
    tokenizer, config = read_header(path)
    if ctx_size > config.max_seq_len:
        raise OptionError(f"--ctx-size {ctx_size} is over the model's context length {config.max_seq_len}")
    hooks = resolve_hooks(hook, config)
    here = workers == 1 and ray is None
    # on Ray, an actor's threads are what it reserves (--threads, else 1): the driver's cores say nothing of a node's
    spec = ModelSpec(str(path), activations,
                     threads if here or ray is not None else threads_per_worker(workers, threads))
    c = Collection(spec, sha256_file(path), text_file, hooks, Packing.for_tokenizer(tokenizer, ctx_size, jsonl, text_field or "text"),
                   dtype, shard_mb, output, workers, ray)
    t0 = time.perf_counter()
    tokens = prepare(c)
    if c.remade:
        from rich.markup import escape
        err.print(f"[yellow]warning:[/] {escape(c.remade)}", highlight=False)
    total = c.n_sequences * ctx_size
    done_before = sum(s["rows"] for s in c.shards)
    m = load_model(path, threads, activations) if here and len(c.shards) < c.n_shards else None
    collected = [done_before]
    try:
        # a bar on a terminal; in a log, a status line now and then (CountBar)
        with CountBar(f"collect {path.name}", "tokens", "collected", parallel=workers, detail=True) as bar:
            bar.update(done_before, total)
            t_made = time.perf_counter()

            def advance(n: int) -> None:
                collected[0] += n
                rate = (collected[0] - done_before) / max(time.perf_counter() - t_made, 1e-9)
                bar.update(collected[0], total, f"{rate:.0f} tok/s")
            execute(c, tokens, m, advance)
    except KeyboardInterrupt:
        if len(c.shards) < c.n_shards or not manifest_lists_all(c):   # else Ctrl-C came as Ray shut down: done
            err.print(f"[yellow]interrupted[/]: {len(c.shards)} of {plural(c.n_shards, 'shard')} complete in "
                      f"{output}; run the same command again to continue")
            exit_interrupted()
    seconds = time.perf_counter() - t0
    made = total - done_before
    size = sum((output / "data" / s["file"]).stat().st_size for s in c.shards)
    summary = {"output": str(output), "n_tokens": total, "n_sequences": c.n_sequences, "n_shards": c.n_shards,
               "hooks": [h.name for h in hooks], "dtype": dtype, "bytes": size, "tokens_made": made,
               "seconds": round(seconds, 3), "tokens_per_s": round(made / seconds, 1) if made else None,
               "activations": activations, "workers": workers, "ray": ray}
    if json_out:
        stdout.write(json.dumps(summary) + "\n")
    rate = f": {made / seconds:.0f} tokens/s" if made else " (already complete)"
    err.print(f"[dim]{plural(total, 'token')} × {plural(len(hooks), 'hook')} in {plural(c.n_shards, 'shard')} "
              f"({size / 1e6:.1f} MB) in {output}, {seconds:.1f} s{rate} ({activations})[/]")
