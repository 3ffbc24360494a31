"""``llamatrace generate``: stream generated text (or one JSON object) for a prompt."""

from __future__ import annotations

import itertools
import json
from typing import Annotated, Optional

import typer

from llamatrace.errors import OptionError
from llamatrace.cli.app import app, err, exit_interrupted, plural, status_spinner, stdout
from llamatrace.cli.options import (
    AblateOpt,
    check_run_options,
    CtxSizeOpt,
    ModelOpt,
    NoCacheOpt,
    prepare_run,
    PromptFileOpt,
    RawOpt,
    RunActivationsOpt,
    SystemOpt,
    ThreadsOpt,
)


@app.command()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt text (or use --prompt-file).",
                                                    show_default=False)] = None,
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "--tokens", "-n", help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; higher = more random.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens (0 = off); "
                                       "applied after --temperature, before --top-p.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling: keep the likeliest tokens whose "
                                         "mass reaches P, of those left by --top-k (1.0 = off).")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.", show_default=False)] = None,
    raw: RawOpt = False,
    system: SystemOpt = None,
    prompt_file: PromptFileOpt = None,
    ctx_size: CtxSizeOpt = None,
    threads: ThreadsOpt = None,
    no_cache: NoCacheOpt = False,
    activations: RunActivationsOpt = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object (text, ids, timings) instead "
                                                         "of streaming text.")] = False,
    ablate: AblateOpt = None,
) -> None:
    """Generate text from a prompt, streamed to the terminal.

    The model's chat template (if its file has one) is applied unless --raw. A summary line
    (tokens, prefill and decode speed, the activations mode) goes to stderr, so stdout carries
    only the text.
    Models of 1 B parameters or more run q8 activations by default (llama.cpp's arithmetic, on
    CPUs with AVX2), smaller ones f32 (HF's, the arithmetic of trace and compare).

    Examples:

      llamatrace generate "What is the capital of France?"

      llamatrace generate --raw "Once upon a time" -n 64 --temperature 0.8 --seed 1

      echo "Explain RoPE briefly" | llamatrace generate -f -

      llamatrace generate --json -- "-5 degrees is cold?"

      llamatrace generate --activations q8 "Name three rivers"

      llamatrace generate --raw "The capital of France is" -n 8 --ablate ffn_out@-1
    """
    from llamatrace.model.generate import GenerationStats
    from llamatrace.model.generate import generate as run_generate
    from llamatrace.model.sampling import SamplingParams
    from llamatrace.text.tokenizer import StreamDecoder

    if max_tokens <= 0:
        raise OptionError(f"--max-tokens must be a positive integer, got {max_tokens}")
    check_run_options(ctx_size, ablate)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if sampling.unused_options():
        err.print(f"[yellow]note:[/] {', '.join(sampling.unused_options())} ignored: --temperature 0 "
                  f"(the default) is greedy; give --temperature > 0 to sample")
    r = prepare_run(prompt, prompt_file, model, threads=threads, activations=activations, raw=raw, system=system,
                    ablate=ablate, ctx_size=ctx_size)
    m, text_in, ids, load_s = r.model, r.text, r.ids, r.load_s

    stats = GenerationStats()
    stream = StreamDecoder(m.tokenizer)
    pieces: list[str] = []
    # the prompt and context checks run inside generate, before any compute, at the first next()
    tokens = run_generate(m, ids, max_tokens=max_tokens, sampling=sampling, ctx_size=ctx_size, stats=stats)
    interrupted = False
    with r.ablated():
        try:
            with status_spinner(f"Prefill: {len(ids)} prompt tokens …"):
                first = next(tokens, None)
            if first is not None:
                for token in itertools.chain([first], tokens):
                    piece = stream.push(token)
                    pieces.append(piece)
                    if not json_out and piece:     # the bytes as generated: no console rewrites tabs or \r
                        stdout.write(piece)
                        stdout.flush()
        except KeyboardInterrupt:
            interrupted = True
    tail = stream.flush()
    pieces.append(tail)
    if json_out:
        result = {
            "model": str(m.path), "activations": m.activations, "prompt": text_in, "prompt_ids": ids, "ids": stats.generated,
            "text": "".join(pieces), "stop_reason": "interrupted" if interrupted else stats.stop_reason,
            "timings": {"load_s": round(load_s, 3),
                        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 2),
                        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2)},
        }
        stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
        stdout.flush()
    else:
        stdout.write(tail + "\n")
        stdout.flush()
    reason = "interrupted" if interrupted else {"eos": "end of text", "max_tokens": f"--max-tokens {max_tokens}",
                                                "context": f"context full ({stats.ctx_size} tokens)"}.get(stats.stop_reason or "", "")
    err.print(f"[dim]{plural(len(ids), 'prompt token')}, {len(stats.generated)} generated · prefill "
              f"{stats.prefill_tokens_per_s:.1f} tok/s · "
              + (f"decode {stats.decode_tokens_per_s:.1f} tok/s · " if stats.decode_steps else "no decode step · ")
              + f"load {load_s:.1f} s · {m.activations} activations · stopped: {reason}[/]")
    if stats.stop_reason == "context" and not interrupted:
        full = stats.ctx_size >= m.config.max_seq_len
        err.print(f"[yellow]note:[/] stopped at the context limit ({stats.ctx_size} tokens"
                  + ("; the model's own limit: a shorter prompt leaves more room)" if full else
                     f"); raise --ctx-size (at most the model's {m.config.max_seq_len}) to go further"))
    if interrupted:
        exit_interrupted()
