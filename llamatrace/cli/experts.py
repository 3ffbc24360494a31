"""``llamatrace experts`` and ``llamatrace expert-load``: a mixture-of-experts model's routing, for
one prompt (tokens × experts per layer) and over a corpus (each layer's expert load, the experts
that fire together, the tokens each expert takes). The data is :mod:`llamatrace.analysis.experts`,
the pictures :mod:`llamatrace.views.plots`."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, err, exit_interrupted, out, plural, stdout
from llamatrace.cli.options import (LAYER_HELP, ModelOpt, NoCacheOpt, RayOpt, RunActivationsOpt, RunOptions,
                                     WorkerThreadsOpt, WorkersOpt, check_activations, check_threads, check_run_options,
                                     default_activations, load_model, model_file, parse_layers, reads, run_options)
from llamatrace.cli.progress import CountBar
from llamatrace.errors import OptionError


@app.command()
@run_options(ablate=True)
def experts(
    run: RunOptions,
    layer: Annotated[str, typer.Option("--layer", "-l", help=LAYER_HELP)] = "all",
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Image file: .png, .svg or .pdf (default: experts.png, or none with --json).",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print the routes as one JSON object.")] = False,
) -> None:
    """Show a mixture-of-experts model's routing of a prompt: which experts each token chose, with
    what weight, in every layer.

    Runs the prompt once (the prefill) and reads the router's stages (ffn_moe_topk and the
    weights the experts' outputs are summed with). Draws one heatmap per layer, tokens down and
    experts across, and prints each token's route. Over a whole text, see `llamatrace expert-load`.

    Examples:

      llamatrace experts --raw "The capital of France is" -m Qwen3-30B-A3B-Q4_K_M.gguf -o routes.png

      llamatrace experts "Why is the sky blue?" -m gpt-oss-20b-mxfp4.gguf --layer 0-3

      llamatrace experts --raw "def fib(n):" -m olmoe.gguf --layer -1 --json > routes.json
    """
    from llamatrace.analysis.experts import check_moe, routes
    from llamatrace.text.tokenizer import quoted
    from llamatrace.outputs import check_output_path
    from llamatrace.views.plots import check_format

    parse_layers(layer)
    check_run_options(ablate=run.ablate)
    if output is None and not json_out:
        output = Path("experts.png")
    if output is not None:
        check_format(output)
        check_output_path(output, "-o")
    def check(c) -> None:                      # against the model's header, before the load
        check_moe(c)
        parse_layers(layer, c.n_layers)

    r = run.prepare(check)
    m = r.model
    c = m.config
    layers = parse_layers(layer, c.n_layers)
    with r.ablated():
        found = routes(m, r.ids, layers)
    chosen = [found[i] for i in sorted(found)]
    pieces = [m.tokenizer.piece(i) for i in r.ids]
    if output is not None:
        from llamatrace.views.plots import save_routes
        save_routes(chosen, pieces, f"{m.path.name} · top-{c.n_expert_used} of {c.n_expert} experts", output)
        err.print(f"wrote {output} ({plural(len(chosen), 'layer')}, {plural(len(pieces), 'token')} × "
                  f"{plural(c.n_expert, 'expert')})")
    if json_out:
        from llamatrace.tracing.recorder import finite_or_none     # JSON has no NaN: a NaN weight is null
        stdout.write(json.dumps({
            "model": str(m.path), "ids": r.ids, "pieces": pieces, "n_expert": c.n_expert,
            "n_expert_used": c.n_expert_used, "ablate": [a.text for a in r.ablations],
            "layers": [{"layer": route.layer, "experts": route.ids.tolist(),
                        "weights": [[finite_or_none(round(float(w), 6)) for w in row] for row in route.weights]}
                       for route in chosen]}, ensure_ascii=False, allow_nan=False) + "\n")
        return
    shown = [quoted(p) if len(quoted(p)) <= 24 else quoted(p)[:22] + "…'" for p in pieces]
    width = max(map(len, shown), default=0)
    for route in chosen:
        out.print(f"layer {route.layer}: each token's {c.n_expert_used} experts as expert:weight, best first "
                  f"(the weights its FFN output sums them with)", markup=False)
        for pos, (piece, ids, weights) in enumerate(zip(shown, route.ids, route.weights)):
            picks = "  ".join(f"{int(e):>3}:{w:.3f}" for e, w in zip(ids, weights))
            out.print(f"  {pos:>4} {piece:<{width}}  {picks}", markup=False)


@app.command("expert-load")
def expert_load(
    text_file: Annotated[Path, typer.Option("--file", "-f", help="The text (UTF-8) to route; - = standard input.", show_default=False,
                                            callback=reads("the text this run routes (-f)"))],
    model: ModelOpt = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="Tokens per chunk, each run from an empty "
                                          "cache (a shorter text: one chunk of its length).")] = 512,
    chunks: Annotated[Optional[int], typer.Option("--chunks", help="Route at most N chunks (default: all).",
                                                  show_default=False)] = None,
    top: Annotated[int, typer.Option("--top", help="How many busiest experts, expert pairs and tokens of an "
                                     "expert are listed per layer (--json: the pairs and each expert's tokens; it "
                                     "holds every expert's count).")] = 5,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Image of the load: layers × experts and each layer's entropy (.png, .svg or .pdf).",
        show_default=False)] = None,
    activations: RunActivationsOpt = None,
    workers: WorkersOpt = 1,
    ray: RayOpt = None,
    threads: WorkerThreadsOpt = None,
    no_cache: NoCacheOpt = False,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object: per layer the counts, "
                                           "weight sums, entropy, pairs and top tokens.")] = False,
) -> None:
    """Expert load of a mixture-of-experts model over a text: per layer, how many tokens chose each
    expert, the entropy of that load (log2 of the expert count = perfectly even), the experts that
    fire together most (with their lift over chance) and the tokens each expert takes most.

    The text is tokenized once and cut into chunks of --ctx-size tokens, each run from an empty
    cache, on the corpus runner (--workers, --ray) as perplexity and imatrix are; one chunk is
    enough (nothing is scored), and a text shorter than --ctx-size is one chunk of its length.

    Examples:

      llamatrace expert-load -f corpus.txt -m Qwen3-30B-A3B-Q4_K_M.gguf -o load.png

      llamatrace expert-load -f corpus.txt -m olmoe.gguf --ctx-size 256 --chunks 20 --json > load.json

      llamatrace expert-load -f wiki.test.raw -m gpt-oss-20b.gguf --workers 2 --top 10
    """
    from llamatrace.analysis.experts import ExpertLoad, check_moe, corpus_chunk
    from llamatrace.corpus.chunks import make_chunks, read_corpus, read_header
    from llamatrace.corpus.runner import run_chunks
    from llamatrace.corpus.worker import ModelSpec, threads_per_worker
    from llamatrace.outputs import check_output_path

    if activations is not None:
        check_activations(activations)
    check_threads(threads, ray is not None)
    if top < 1:
        raise OptionError(f"--top must be a positive integer, got {top}")
    if output is not None:
        from llamatrace.views.plots import check_format
        check_format(output)
        check_output_path(output, "-o")
    text = read_corpus(text_file)
    path = model_file(model)
    tokenizer, config = read_header(path)
    check_moe(config)
    plan = make_chunks(tokenizer, text, ctx_size, chunks, config.max_seq_len, command="expert-load",
                       two_chunks=False)
    if plan.n_ctx < ctx_size:
        err.print(f"[yellow]note:[/] the text is {plural(plan.n_ctx, 'token')}, fewer than --ctx-size {ctx_size}: "
                  f"it is routed as one chunk of {plural(plan.n_ctx, 'token')}")
    activations = activations or default_activations(path)
    in_process = workers == 1 and ray is None
    spec = ModelSpec(str(path), activations,
                     threads if in_process or ray is not None else threads_per_worker(workers, threads))
    m = load_model(path, threads, activations) if in_process else None
    load = ExpertLoad(config.n_layers, config.n_expert)
    t0 = time.perf_counter()
    bar = CountBar(f"expert-load {path.name}", "chunks", "routed", parallel=workers)

    def on_result(i: int, chunk_load: ExpertLoad) -> None:
        load.add(chunk_load)
        bar.update(i + 1, plan.n_chunk)

    try:
        with bar:
            bar.update(0, plan.n_chunk)
            run_chunks(spec, plan.n_chunk, plan.chunk, corpus_chunk, on_result, workers, m, ray)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: nothing written")
        exit_interrupted()
    seconds = time.perf_counter() - t0
    if output is not None:
        from llamatrace.views.plots import save_load
        save_load(load, f"{path.name} · expert load over {load.n_tokens} tokens", output)
        err.print(f"wrote {output}")
    if json_out:
        result = {"model": str(path), "file": str(text_file), "ctx_size": plan.n_ctx, "n_chunks": plan.n_chunk,
                  "n_expert_used": config.n_expert_used, **load.to_json(tokenizer.piece, top)}
        stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
    else:
        _print_load(load, tokenizer.piece, top)
    stdout.flush()
    err.print(f"[dim]{plural(plan.n_chunk, 'chunk')} of {plural(plan.n_ctx, 'token')} in {seconds:.1f} s "
              f"({workers} worker{'s' if workers > 1 else ''}{' on Ray' if ray else ''}, {activations})[/]")


def _print_load(load, piece, top: int) -> None:
    """Per layer: entropy, the ``top`` busiest experts and how many no token chose, the pairs that
    fire together, and the busiest expert's top tokens."""
    from llamatrace.text.tokenizer import quoted

    entropy = load.entropy()
    out.print(f"{load.n_tokens} tokens, {load.n_expert} experts (even load = {math.log2(load.n_expert):.2f} bits)",
              markup=False)
    for layer in range(load.n_layers):
        counts = load.counts[layer]
        if not counts.any():
            continue
        order = sorted(range(load.n_expert), key=lambda e: (-counts[e], e))
        busiest = ", ".join(f"{e}:{counts[e]}" for e in order[:top] if counts[e])     # unused ones are counted apart
        idle = sum(1 for e in range(load.n_expert) if counts[e] == 0)
        pairs = ", ".join(f"{a}+{b} ×{lift:.1f}" for a, b, _, lift in load.top_pairs(layer, top))
        tokens = ", ".join(f"{quoted(piece(t))}:{n}" for t, n in load.top_tokens(layer, order[0], top))
        out.print(f"layer {layer:>3}: entropy {entropy[layer]:.2f} bits · busiest {busiest} · unused {idle} · "
                  f"together {pairs or '-'} · expert {order[0]} takes {tokens}", markup=False)
