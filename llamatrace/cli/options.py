"""Options and helpers shared by every command: model, prompt, threads, layers, stages."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from llamatrace.errors import LlamatraceError, OptionError, PromptError
from llamatrace.tracing.stages import select_stages
from llamatrace.cli.app import err, plural, quiet, status, status_bar, status_spinner

def reads(what: str):
    """A typer ``callback`` noting a path option's file as one the command reads (no output may
    be written over it: :func:`llamatrace.outputs.reading`)."""
    from llamatrace.outputs import reading
    return lambda path: reading(path, what)


MODEL_READ = "the model this run reads"
ModelOpt = Annotated[Optional[Path], typer.Option(
    "--model", "-m", help="GGUF model file, or a known model's name (smollm2-135m, gemma3-270m: fetched "
    "once into the user cache). Default: $LLAMATRACE_MODEL, else smollm2-135m.", show_default=False,
    callback=reads(f"{MODEL_READ} (-m)"))]
RawOpt = Annotated[bool, typer.Option("--raw", metavar="", help="Send the prompt as-is, without the model's chat template.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", help="System message for the chat template.")]
PromptFileOpt = Annotated[Optional[Path], typer.Option(
    "--prompt-file", "--file", "-f", help="Read the prompt from FILE ('-' = stdin).", show_default=False,
    callback=reads("the prompt file this run reads (-f)"))]
AUTO_THREADS_HELP = ("the cores other processes' runnable tasks leave free, read before each forward call "
                     "(every core on a quiet machine); with none free, one for small models (SmolLM2-135M, "
                     "-360M) and every core for larger ones")
"""The kernels' default thread count (:class:`llamatrace.machine.threads.AutoThreads`), in words."""
ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", "-t", help=f"CPU threads for the kernels. Default: {AUTO_THREADS_HELP}.", show_default=False)]
WorkerThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", "-t", help=f"CPU threads for the kernels, of each worker. Default: {AUTO_THREADS_HELP}; with "
    "--workers, the cores this process may use split evenly among the workers.", show_default=False)]
"""``--threads`` of the commands with ``--workers``."""


def _no_cache(ctx: typer.Context, value: bool) -> bool:
    """``--no-cache``: set ``$LLAMATRACE_NO_CACHE`` for the command (and the worker processes it
    starts, which inherit it), restored when the command ends."""
    if value:
        from llamatrace.model.packcache import ENV_NO_CACHE
        previous = os.environ.get(ENV_NO_CACHE)

        def restore() -> None:
            if previous is None:
                os.environ.pop(ENV_NO_CACHE, None)
            else:
                os.environ[ENV_NO_CACHE] = previous
        os.environ[ENV_NO_CACHE] = "1"
        ctx.call_on_close(restore)
    return value


NoCacheOpt = Annotated[bool, typer.Option(
    "--no-cache", metavar="", callback=_no_cache, expose_value=False, help="Pack the weights in memory, without the "
    "packed-weights cache: by default the first load of a model file writes its packed weights to "
    "~/.cache/llamatrace/packed (about the file's size, per activations mode; the least recently used go "
    "beyond $LLAMATRACE_PACKED_CACHE_GB, default 20 GB) and later loads map them: an 8B model loads 2-5x "
    "faster, its first load takes 1.5-2x as long. Same as LLAMATRACE_NO_CACHE=1.")]
"""Declare it as ``no_cache: NoCacheOpt = False``; it acts through the environment (its value never
reaches the command), so every load the command makes, in this process or a worker, sees it."""
WorkersOpt = Annotated[int, typer.Option(
    "--workers", "-w", help="Local worker processes, each loading the model once; the results do not "
    "depend on it.")]


def _ray_address(value: str | None) -> str | None:
    """``--ray``: an empty address is refused (Ray took it for a new local cluster, unnamed)."""
    if value is not None and not value.strip():
        raise OptionError("--ray needs an address: host:port, ray://…, 'auto' or 'local'")
    return value


RayOpt = Annotated[Optional[str], typer.Option(
    "--ray", metavar="ADDRESS", help="Run the chunks as --workers Ray actors on the cluster at ADDRESS "
    "(host:port, ray://…), 'auto' to join RAY_ADDRESS or the one `ray start` runs here, or 'local' to start "
    "one for the run. Each actor reserves --threads CPUs (default 1) and uses as many; a file the run writes "
    "must be on a path every node writes to. Needs the extra llamatrace[ray].", show_default=False,
    callback=_ray_address)]
# the types with q8 kernels (kernels.types.registry.served_types("q8"); named here so --help needs no Numba)
_Q8_WEIGHTS = "Activations of the matmuls on Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K and MXFP4 weights"
ActivationsOpt = Annotated[str, typer.Option(
    "--activations", metavar="f32|q8", help=f"{_Q8_WEIGHTS}: f32 (float32, HF's arithmetic: the "
    "reference) or q8 (8 bits per block of 32, llama.cpp's arithmetic: faster, ~1e-2 off; needs AVX2).")]
RunActivationsOpt = Annotated[Optional[str], typer.Option(
    "--activations", metavar="f32|q8", help=f"{_Q8_WEIGHTS}: f32 (float32, HF's arithmetic) or q8 (8 "
    "bits per block of 32, llama.cpp's arithmetic, ~1e-2 off HF). Default here: q8 for models of 1 B "
    "parameters or more (where f32 is 1.5-2x slower than llama.cpp) on CPUs with AVX2, else f32.",
    show_default=False)]
CtxSizeOpt = Annotated[Optional[int], typer.Option(
    "--ctx-size", "-c", help="KV cache capacity in tokens (default: prompt + tokens to generate, "
    "at most the model's context length).", show_default=False)]
LAYER_HELP = ("Layers, numbered from 0 (the book's log lines say 'layer: 1 / 30' for layer 0): "
              "N, N-M, comma lists, all, or negative from the end (-1 the last, -2 the one before).")


def check_ctx_size(ctx_size: int | None) -> None:
    """Raises :class:`OptionError` for a ``--ctx-size`` below 1 (the model's maximum is checked later)."""
    if ctx_size is not None and ctx_size <= 0:
        raise OptionError(f"--ctx-size must be a positive integer, got {ctx_size}")


def check_threads(threads: int | None, ray: bool = False) -> None:
    """Raises :class:`OptionError` for a ``--threads`` below 1 or, off Ray, above the threads this
    machine's kernels may run: before any worker starts or any output is begun (on Ray, an actor's
    threads are the CPUs it reserves on a node, checked against the cluster later)."""
    if threads is None:
        return
    from llamatrace.machine.runtime import numba_threads
    limit = None if ray else numba_threads()
    if threads < 1 or (limit is not None and threads > limit):
        raise OptionError(f"--threads {threads}: give an integer from 1" + (f" to {limit} (this machine)" if limit else ""))


SAMPLE_PROMPT = Path(__file__).resolve().parents[2] / "samples" / "prompt.txt"
# used when the package is installed without the repository's samples/ folder
FALLBACK_PROMPT = "The capital of France is"


def default_prompt() -> str:
    """The sample prompt of ``trace`` and ``diagram``: ``samples/prompt.txt`` (trailing newline
    dropped: it would be a token)."""
    try:
        return SAMPLE_PROMPT.read_text(encoding="utf-8").strip() or FALLBACK_PROMPT
    except OSError:
        return FALLBACK_PROMPT


def _from_argv(text: str) -> tuple[str, bool]:
    """``text`` with lone surrogates as UTF-8, and whether it was valid. Invalid UTF-8 in argv arrives
    as lone surrogates U+DC80-U+DCFF, one a byte (PEP 383's ``surrogateescape``): back to the bytes,
    decoded again (a non-UTF-8 locale's bytes may be valid UTF-8), what stays invalid as U+FFFD;
    any other lone surrogate (``main(argv)`` from Python) is U+FFFD."""
    if any(0xD800 <= ord(ch) < 0xDC80 or 0xDCFF < ord(ch) <= 0xDFFF for ch in text):
        return re.sub("[\ud800-\udfff]", "\ufffd", text), False
    data = text.encode("utf-8", errors="surrogateescape")
    try:
        return data.decode("utf-8"), True
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), False


def read_prompt(prompt: str | None, prompt_file: Path | None, default: str | None = None) -> str:
    """The prompt text from the argument, ``--prompt-file`` (``-`` = stdin) or ``default``.

    Invalid UTF-8 in a file is replaced (U+FFFD) with a warning rather than failing. Trailing
    line breaks of a file or stdin are dropped (``echo`` adds one; it would be a token), as the
    shell's ``$(cat FILE)`` does.

    Raises:
        OptionError: both a prompt and --prompt-file, or the file cannot be read.
        PromptError: no prompt at all, or an empty one.
    """
    if prompt is not None and prompt_file is not None:
        raise OptionError("give either a PROMPT argument or --prompt-file, not both")
    if prompt_file is not None:
        if str(prompt_file) == "-" and sys.stdin is None:
            raise OptionError("--prompt-file -: standard input is closed; pipe the text in or give a file's path")
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
        prompt = prompt.rstrip("\r\n")
    if prompt is None:
        if default is None:
            raise PromptError("no prompt given: pass PROMPT, or --prompt-file FILE ('-' for stdin)")
        prompt = default
    # invalid UTF-8 in argv: U+FFFD as for -f
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        prompt, valid = _from_argv(prompt)
        if not valid:
            err.print("[yellow]warning:[/] the prompt is not valid UTF-8; invalid bytes were replaced by U+FFFD")
    if not prompt.strip():
        raise PromptError("the prompt is empty: give some text (or --prompt-file FILE)")
    return prompt


Q8_DEFAULT_PARAMS = 1_000_000_000
"""From this many parameters ``generate``, ``bench`` and the corpus commands (``perplexity``,
``collect``, ``imatrix``, ``expert-load``) default to ``q8``."""


def default_activations(path: Path) -> str:
    """The activations mode of ``generate``, ``bench`` and the corpus commands when none is given:
    ``"q8"`` (llama.cpp's arithmetic) for models of :data:`Q8_DEFAULT_PARAMS` parameters or more on
    CPUs with AVX2, else ``"f32"`` (HF's, the mode of every command that traces, compares or looks
    inside a single prompt).

    At 8B ``f32`` prefill runs at ~0.5-0.7x llama.cpp's and ``q8`` at 1.2-1.9x (docs/performance.md);
    below 1B ``f32`` is already at llama.cpp's pace, and 8-bit rounding flips near-tied greedy
    choices of a small model often enough to be seen (SmolLM2-135M answers the README's question
    about France with "L'Étoile, la ..." in ``q8``, as llama.cpp does, "Paris" in ``f32``; its
    perplexity differs by 0.07 %).

    Raises:
        the errors of :func:`llamatrace.gguf.reader.open_gguf` for a file that is no valid GGUF.
    """
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.kernels.int8 import act8
    if not act8.available():
        return "f32"
    with open_gguf(path) as f:
        n_params = sum(t.n_elements for t in f.tensors.values())
    return "q8" if n_params >= Q8_DEFAULT_PARAMS else "f32"


def check_activations(activations: str) -> None:
    """Raises :class:`OptionError` for an ``--activations`` value this machine cannot run."""
    from llamatrace.kernels.types import packing
    try:
        packing.check_activations(activations)
    except OptionError as exc:
        raise OptionError(f"--activations {activations}: {exc}") from None


def model_file(model: Path | None) -> Path:
    """The GGUF file a command runs: ``--model``, else ``$LLAMATRACE_MODEL``, else the default
    model (fetched once, with status lines unless quiet).

    Raises:
        ModelNotFoundError: as :func:`llamatrace.gguf.fetch.resolve_model`.
    """
    from llamatrace.gguf.fetch import resolve_model
    from llamatrace.outputs import reading
    return reading(resolve_model(model, log=status, quiet=quiet()), MODEL_READ)


SLOW_WARMUP_S = 1.0
"""A warm-up with cached kernels still running after this many seconds (a changed kernel
recompiles) gets a status line when stderr is no terminal."""


def load_model(model_path: Path | None, threads: int | None, activations: str | None = "f32"):
    """Resolve, load (with status lines) and return the model; ``activations`` None: the
    model's :func:`default_activations`."""
    if activations is not None:
        check_activations(activations)
    cold = numba_cache_is_cold()          # before the load: packing compiles kernels of its own
    if threads is not None:
        from llamatrace.machine import threads as kernel_threads
        try:
            kernel_threads.set_threads(threads)
        except (ValueError, LlamatraceError) as exc:
            raise OptionError(f"--threads {threads}: {exc}") from None
    path = model_file(model_path)
    activations = activations or default_activations(path)
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn

    from llamatrace.model.llama import Llama
    # cold, measured on 2 shared cores (load average 7-11): SmolLM2 f32 62 s, q8 116 s
    doing = "Compiling kernels (first run only, 1-3 min; cached afterwards)" if cold else "Loading kernels"
    message = f"{doing} …"
    if cold and not err.is_terminal:          # no spinner in a log or a pipe: a plain line, now
        status(message)                        # (the load compiles kernels too)
    columns = (TextColumn("Loading {task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with status_bar(*columns) as bar:
        task = bar.add_task(path.name, total=None)
        model = Llama.load(path, progress=lambda done, total: bar.update(task, completed=done, total=total),
                           activations=activations)
    # compile (first run) or load every kernel now, so stage timings and tok/s measure compute
    if err.is_terminal:
        with status_spinner(message) as spinner, counting_compiles(
                lambda n: spinner.update(f"{doing}: {n} compiled …")):
            model.warmup()
        return model
    if cold:
        model.warmup()
        return model
    # a warm cache that still takes long: say so (a status line, so its timing never matters)
    timer = threading.Timer(SLOW_WARMUP_S, status, (message,))
    timer.start()
    try:
        model.warmup()
    finally:
        timer.cancel()
    return model


@contextlib.contextmanager
def counting_compiles(on_compile: Callable[[int], None], on_start: Callable[[int], None] | None = None):
    """Call ``on_compile(n)`` each time Numba finishes compiling a kernel in the ``with`` block,
    ``n`` counting from 1, and ``on_start(n)`` (if given) as it starts one, ``n`` kernels done before.
    Kernels loaded from Numba's cache do not count, nor the functions a kernel's compilation
    pulls in (Numba's ``numba:compile`` events, nested inside the kernel's)."""
    from numba.core import event

    class Counter(event.Listener):
        depth = done = 0

        def on_start(self, ev) -> None:
            if self.depth == 0 and on_start is not None:
                on_start(self.done)
            self.depth += 1

        def on_end(self, ev) -> None:
            self.depth -= 1
            if self.depth == 0:
                self.done += 1
                on_compile(self.done)

    with event.install_listener("numba:compile", Counter()):
        yield


def check_system(system: str | None, raw: bool, has_template: bool, model_name: str) -> None:
    """Refuse ``--system`` where no chat template will be applied: with ``--raw``, or for a model
    (``model_name``, in the message) whose file has no ``tokenizer.chat_template``.

    Raises:
        OptionError: the conflict, and how to get round it.
    """
    if system is None:
        return
    if raw:
        raise OptionError("--system needs the chat template: drop --raw, or put the system text in the prompt")
    if not has_template:
        raise OptionError(f"--system needs a chat template and {model_name} has none (no tokenizer.chat_template); "
                          f"put the system text in the prompt instead")


def prompt_ids_for(model, prompt: str, raw: bool, system: str | None) -> list[int]:
    """Token ids fed to the model: the chat template applied unless ``raw`` (or the model has none).

    Raises:
        OptionError: as :func:`check_system`.
        PromptError: the template fails (with ``--system``: the advice is to drop it, since
            ``--raw`` refuses it) or renders nothing.
    """
    tok = model.tokenizer
    check_system(system, raw, bool(tok.chat_template), Path(model.path).name)
    if raw or not tok.chat_template:
        return tok.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": prompt})
    try:
        ids = tok.encode_chat(messages, add_generation_prompt=True)
    except PromptError as exc:
        if system is None:
            raise
        raise PromptError(f"{str(exc).split('; use --raw')[0]}; drop --system (the template may have no system "
                          f"role), or use --raw with the system text in the prompt") from None
    if not ids and prompt.strip():
        raise PromptError("the model's chat template rendered an empty prompt; use --raw to send the prompt as is")
    return ids


def numba_cache_is_cold() -> bool:
    """True when the forward pass's kernels (``kernels/ops/fp32.py``) are not cached yet: the first run
    compiles for 1-3 min (``python -m llamatrace.kernels.precompile`` caches only the matmuls)."""
    import importlib.util

    import numba
    fp32 = Path(importlib.util.find_spec("llamatrace.kernels.ops.fp32").origin)
    root = Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else fp32.parent / "__pycache__"
    return not any(root.rglob(f"{fp32.stem}.*.nbi")) if root.exists() else True


_LAYER_ITEM = re.compile(r"^(-?\d+)$|^(\d+)-(\d+)$")


def parse_layers(spec: str, n_layers: int | None = None, one: bool = False) -> list[int] | None:
    """``--layer`` → sorted layer indices, ``None`` for all.

    Accepts ``all``, ``N``, ``N-M`` (inclusive), ``-1`` (the last; ``-2`` the one before) and comma
    lists of these. With ``n_layers`` ``None`` only the syntax is checked. ``one``: the command
    shows one layer, so its messages offer no ``all`` (the caller refuses several).

    Raises:
        OptionError: bad syntax, or a layer outside ``0..n_layers-1`` (the message gives the range).
    """
    text = spec.strip().lower()
    if text == "all":
        return None
    chosen: set[int] = set()
    for item in (p.strip() for p in text.split(",")):
        m = _LAYER_ITEM.match(item)
        if not m:
            raise OptionError(f"--layer {spec!r}: expected N, N-M, -1, a comma list of these, or 'all'")
        if m.group(1) is not None:
            lo = hi = int(m.group(1))
        else:
            lo, hi = int(m.group(2)), int(m.group(3))
            if lo > hi:
                raise OptionError(f"--layer {spec!r}: range {item} is backwards (write {hi}-{lo})")
        if n_layers is None:
            continue
        if lo < 0:
            lo = hi = n_layers + lo
        if lo < 0 or hi >= n_layers:
            raise OptionError(f"--layer {spec!r} is out of range: this model has {n_layers} layers, "
                              f"valid are 0-{n_layers - 1} (or -1 for the last{'' if one else ', or all'})")
        chosen.update(range(lo, hi + 1))
    return sorted(chosen) if n_layers is not None else []


def parse_stages(patterns: list[str] | None) -> list[str] | None:
    """``--stage`` values (repeatable, comma lists, globs) → patterns, checked against the catalogue.

    Raises:
        OptionError: a pattern matching no stage (the message names the closest ids), or none given
            (``--stage ''``).
    """
    if not patterns:
        return None
    flat = [p.strip() for value in patterns for p in value.split(",") if p.strip()]
    if not flat:               # --stage '' selected no stage: a trace of nothing, exit 0
        raise OptionError(f"--stage {','.join(patterns)!r} names no stage: give stage ids or globs (kq*), or "
                          f"leave --stage out for all")
    try:
        select_stages(flat)
    except ValueError as exc:
        raise OptionError(f"--stage: {exc}") from None
    return flat


def given_on_command_line(ctx, options: dict[str, str]) -> list[str]:
    """The options of ``options`` (parameter name → option as written) given on the command line,
    not left at their defaults: say, to refuse those a mode of the command ignores."""
    # typer runs its own copy of click: its ParameterSource enum, compared by name
    return [opt for name, opt in options.items()
            if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]


def check_steps_fit(option: str, steps: int, config, ctx_size: int | None = None) -> None:
    """Refuse, from the model's header (before the load), ``steps`` decode steps that no prompt
    leaves room for: even one prompt token and ``steps`` steps exceed ``ctx_size`` (default: the
    model's context). The exact count, with the prompt's tokens, comes once it is tokenized.

    Raises:
        OptionError: naming ``option`` (``--step``, ``--tokens``) and the limit.
    """
    limit = ctx_size or config.max_seq_len
    if 1 + steps > limit:
        raise OptionError(f"{option} {steps} needs at least {steps + 1} cache positions (a prompt token + {steps} "
                          f"decode steps) but " + (f"the model's context length is {config.max_seq_len}: give a "
                                                   f"smaller {option}" if 1 + steps > config.max_seq_len else
                                                   f"--ctx-size is {limit}; raise it (at most the model's "
                                                   f"{config.max_seq_len})"))


def remove_leftovers(*outputs: Path | None) -> None:
    """Delete the temporary files a killed run (SIGKILL, power loss) left beside the outputs, and
    say so in one line (:func:`llamatrace.outputs.remove_stale_temp_files`)."""
    from rich.markup import escape

    from llamatrace.outputs import remove_stale_temp_files
    folders = {p.parent if str(p.parent) else Path(".") for p in outputs if p is not None}
    for folder in sorted(folders):
        removed = remove_stale_temp_files(folder)
        if removed:
            names = ", ".join(name for name, _ in removed[:3]) + (" …" if len(removed) > 3 else "")
            message = (f"removed {plural(len(removed), 'temporary file')} of a killed run from {folder} "
                       f"({sum(size for _, size in removed) / 2**20:.1f} MiB): {names}")
            err.print(f"[yellow]note:[/] {escape(message)}", soft_wrap=True)


def check_model_stages(patterns: list[str] | None, config, option: str = "--stage",
                       layers: list[int] | None = None) -> None:
    """Refuse a ``--stage`` id or pattern (:func:`parse_stages`) of which this model computes no
    stage, or (``layers``: the ``--layer`` chosen) none in those layers: the trace would show
    nothing for it, and say nothing.

    Raises:
        OptionError: naming the pattern, with why (:func:`llamatrace.tracing.stages.absent_reason`,
            or the layers of the kind that computes it).
    """
    import fnmatch

    from llamatrace.tracing.stages import (STAGE_BY_ID, STAGE_IDS, absent_reason, layer_list, model_stage_ids,
                                           stage_layers)
    have = model_stage_ids(config)
    for pattern in patterns or ():
        hits = [sid for sid in STAGE_IDS if fnmatch.fnmatchcase(sid, pattern)]
        if not any(sid in have for sid in hits):
            why = absent_reason(hits[0], config) if hits == [pattern] else \
                f"this model computes none of the stages it matches ({', '.join(hits)})"
            raise OptionError(f"{option} {pattern!r}: {why}")
        hits = [sid for sid in hits if sid in have]
        if layers is not None and all(STAGE_BY_ID[sid].level == "layer" for sid in hits) and \
                not any(set(stage_layers(sid, config)) & set(layers) for sid in hits):
            if len(layers) == 1:
                _check_stage_at(hits[0], config, layers[0], f"{option} {pattern!r}")
            at = sorted({i for sid in hits for i in stage_layers(sid, config)})
            raise OptionError(f"{option} {pattern!r}: computed only in layers {layer_list(at)}, none of "
                              f"--layer's; give --layer one of them")


def _check_stage_at(stage_id: str, config, layer: int, where: str) -> None:
    """OptionError when the layer stage ``stage_id`` is not computed at ``layer`` (a hybrid's layer of
    the other kind), naming the layers that compute it."""
    from llamatrace.tracing.stages import layer_kind, layer_list, stage_layers
    at = stage_layers(stage_id, config)
    if layer not in at:
        raise OptionError(f"{where}: {stage_id} is not computed at layer {layer}, {layer_kind(config, layer)}; "
                          f"give {'one of layers' if len(at) > 1 else 'layer'} {layer_list(at)}")


def print_wide(table) -> None:
    """Print a wide table to stdout: at the terminal's own width on a terminal; in a pipe or file
    at the table's natural width (at least 80), so that no column is cut or squeezed."""
    from rich.measure import Measurement

    from llamatrace.cli.app import StdoutConsole, out
    if out.is_terminal:
        out.print(table)
        return
    natural = Measurement.get(out, out.options.update_width(100_000), table).maximum
    StdoutConsole(highlight=False, width=max(out.width, natural)).print(table)


# ---- --ablate (zero-ablation through llamatrace.tracing.hooks) ----------------------------------------
AblateOpt = Annotated[Optional[list[str]], typer.Option(
    "--ablate", metavar="STAGE@LAYER[:HEAD]", show_default=False,
    help="Zero a stage's output where it is computed, so every later stage sees zeros (repeatable): "
    "STAGE@LAYER (0-based, -1 = last, all), STAGE@LAYER:HEAD for one head (a query head, or a KV head in "
    "[.., n_kv_heads, ..] stages), STAGE alone at model level (inp_embd). `llamatrace stages` lists "
    "the replaceable stages.")]

_ABLATE = re.compile(r"^([A-Za-z_]+)(?:@(-?\d+|all))?(?::(\d+))?$")


@dataclass(frozen=True)
class Ablation:
    """One ``--ablate`` value: the stage, its layers (``None`` = all or model level), an optional head."""

    text: str
    stage: str
    layers: list[int] | None
    head: int | None


def parse_ablations(values: list[str] | None, config=None) -> list[Ablation]:
    """``--ablate`` values → :class:`Ablation` list; with ``config`` (a ModelConfig) layers and
    heads are checked against the model and negative layers resolved, without it only the syntax
    and the stage.

    Raises:
        OptionError: bad syntax, an unknown or non-replaceable stage, a layer on a model-level
            stage or none on a layer stage, a head on a stage without heads, a layer or head
            out of range, a stage the model does not compute (with the one it has instead).
    """
    from llamatrace.tracing.hooks import HEAD_WORDS, check_replaceable, head_axis

    out = []
    for text in values or ():
        m = _ABLATE.match(text.strip())
        if not m:
            raise OptionError(f"--ablate {text!r}: expected STAGE@LAYER, STAGE@LAYER:HEAD or STAGE "
                              f"(e.g. attn_out@3, kqv@0:2, inp_embd)")
        stage_id, layer_text, head_text = m.group(1), m.group(2), m.group(3)
        stage = check_replaceable(stage_id, f"--ablate {text!r}")
        if stage.level == "model" and layer_text is not None:
            raise OptionError(f"--ablate {text!r}: {stage_id} is a model-level stage; write it without @LAYER")
        if stage.level == "layer" and layer_text is None:
            raise OptionError(f"--ablate {text!r}: {stage_id} is computed in every layer; say which: "
                              f"{stage_id}@LAYER (0-based, -1 = last, or all)")
        head = None if head_text is None else int(head_text)
        axis = head_axis(stage)
        if head is not None and axis is None:
            raise OptionError(f"--ablate {text!r}: {stage_id} {stage.shape} has no heads axis; drop :{head}")
        layers = None
        if layer_text not in (None, "all"):
            layers = [int(layer_text)]
        if config is not None:
            from llamatrace.tracing.stages import absent_reason, model_stage_ids
            if stage_id not in model_stage_ids(config):      # hooked, it would zero nothing
                raise OptionError(f"--ablate {text!r}: {absent_reason(stage_id, config)}")
            n = config.n_layers
            if layers is not None:
                layer = layers[0] + n if layers[0] < 0 else layers[0]
                if not 0 <= layer < n:
                    raise OptionError(f"--ablate {text!r}: layer {layers[0]} is out of range; this model has "
                                      f"{n} layers, valid are 0-{n - 1} (or -1 for the last, or all)")
                layers = [layer]
                _check_stage_at(stage_id, config, layer, f"--ablate {text!r}")
            if head is not None:
                count = getattr(config, axis[1])
                if head >= count:
                    raise OptionError(f"--ablate {text!r}: head {head} is out of range; {stage_id} has {count} "
                                      f"{HEAD_WORDS[axis[1]]} heads (0-{count - 1})")
        out.append(Ablation(text=text, stage=stage_id, layers=layers, head=head))
    return out


@contextlib.contextmanager
def ablated(model, ablations: list[Ablation]):
    """Run the ``with`` block with the zero-ablations hooked into ``model`` (nothing when empty)."""
    from llamatrace.tracing.hooks import zero_ablation

    with contextlib.ExitStack() as stack:
        for a in ablations:
            stack.enter_context(model.hooks({a.stage: zero_ablation(a.stage, a.head)}, layers=a.layers))
        if ablations:
            err.print(f"[yellow]ablating:[/] {', '.join(a.text for a in ablations)} (zeroed where computed)")
        yield


# ---- one run: options -> prompt, model, ids, ablations ------------------------------------------
@dataclass
class Run:
    """What every command that runs the model starts from (:func:`prepare_run`).

    Attributes:
        model: the loaded :class:`~llamatrace.model.llama.Llama`.
        text: the prompt text; ``ids`` its token ids (chat template applied unless ``--raw``).
        ablations: the ``--ablate`` values, checked against the model; ``ablated()`` hooks them in.
        load_s: seconds the load (and kernel warm-up) took.
    """

    model: object
    text: str
    ids: list[int]
    ablations: list[Ablation]
    load_s: float
    raw: bool

    @property
    def chat(self) -> bool:
        """Whether the chat template was applied."""
        return not self.raw and bool(self.model.tokenizer.chat_template)

    def ablated(self):
        """The ``with`` block in which the ablations are hooked in (nothing without ``--ablate``)."""
        return ablated(self.model, self.ablations)


def check_run_options(ctx_size: int | None = None, ablate: list[str] | None = None) -> None:
    """The checks of the shared run options that need no model: one error line before any load.

    Raises:
        OptionError: a ``--ctx-size`` below 1, an ``--ablate`` value that cannot be right.
    """
    check_ctx_size(ctx_size)
    parse_ablations(ablate)


def prepare_run(prompt: str | None, prompt_file: Path | None, model: Path | None, *, threads: int | None,
                activations: str | None, raw: bool, system: str | None, ablate: list[str] | None = None,
                default: str | None = None, ctx_size: int | None = None,
                check: Callable[[object], None] | None = None) -> Run:
    """Options to a ready run: read the prompt (``default`` when none is given), check the options
    against the model's header (``--system``, ``--ablate``, and ``check(config)``, a command's own
    check of its options against the :class:`~llamatrace.model.config.ModelConfig`: before the
    load, which takes seconds to minutes), load the model (with its status line) and tokenize the prompt.

    Raises:
        OptionError, PromptError: as :func:`read_prompt`, :func:`check_system`,
            :func:`parse_ablations`, ``check``; the model's errors (:func:`model_file`,
            :meth:`~llamatrace.model.llama.Llama.load`); a prompt that does not fit ``ctx_size``
            (default: the model's context), saying how many tokens the chat template added.
    """
    import time

    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    from llamatrace.model.generate import check_prompt_fits

    text = read_prompt(prompt, prompt_file, default=default)
    path = model_file(model)
    with open_gguf(path) as f:                       # the header only: milliseconds
        check_system(system, raw, bool(f.field("tokenizer.chat_template")), path.name)
        config = ModelConfig.from_gguf(f)
        ablations = parse_ablations(ablate, config)
        if check is not None:
            check(config)
    if ctx_size is not None and ctx_size > config.max_seq_len:     # before the load, and before any output
        raise OptionError(f"--ctx-size {ctx_size} is over the model's context length {config.max_seq_len}; "
                          f"give at most {config.max_seq_len}")
    t0 = time.perf_counter()
    m = load_model(path, threads, activations)
    load_s = time.perf_counter() - t0
    ids = prompt_ids_for(m, text, raw, system)
    try:
        check_prompt_fits(m, len(ids), ctx_size or m.config.max_seq_len)
    except PromptError as exc:
        added = len(ids) - len(m.tokenizer.encode(text)) if not raw and m.tokenizer.chat_template else 0
        if added <= 0 or len(ids) - added > (ctx_size or m.config.max_seq_len):    # --raw would not fit either
            raise
        raise PromptError(f"{exc} ({added} of the {len(ids)} tokens are the chat template's; "
                          f"--raw sends the text alone)") from None
    return Run(m, text, ids, ablations, load_s, raw)


PromptArg = Annotated[Optional[str], typer.Argument(
    help="The prompt text (default: the short sample in samples/prompt.txt).", show_default=False)]


@dataclass(frozen=True)
class RunOptions:
    """The prompt and the options of a run on the model, as :func:`run_options` hands them to a
    command; :meth:`prepare` makes the :class:`Run`."""

    prompt: str | None
    prompt_file: Path | None
    model: Path | None
    threads: int | None
    activations: str
    raw: bool
    system: str | None
    ablate: list[str] | None = None

    def prepare(self, check: Callable[[object], None] | None = None, ctx_size: int | None = None) -> Run:
        """:func:`prepare_run` with these options and the default prompt; ``check(config)``: the
        command's own check of its options against the model's header, before the load;
        ``ctx_size``: the command's ``--ctx-size``, checked against the header too."""
        return prepare_run(self.prompt, self.prompt_file, self.model, threads=self.threads,
                           activations=self.activations, raw=self.raw, system=self.system,
                           ablate=self.ablate, default=default_prompt(), ctx_size=ctx_size, check=check)


def run_options(*, ablate: bool) -> Callable[[Callable], Callable]:
    """Decorator of a command that runs the model on a prompt: declares the prompt argument (first)
    and ``--ablate`` (if ``ablate``), ``--model``, ``--raw``, ``--system``, ``--prompt-file``,
    ``--threads``, ``--no-cache``, ``--activations`` (after the command's own options), and calls
    the command with them bundled as its first parameter, ``run: RunOptions``."""
    import functools
    import inspect
    import typing

    def param(name, annotation, default, kind=inspect.Parameter.KEYWORD_ONLY):
        return inspect.Parameter(name, kind, default=default, annotation=annotation)

    shared = ([param("ablate", AblateOpt, None)] if ablate else []) + [
        param("model", ModelOpt, None), param("raw", RawOpt, False), param("system", SystemOpt, None),
        param("prompt_file", PromptFileOpt, None), param("threads", ThreadsOpt, None),
        param("no_cache", NoCacheOpt, False), param("activations", ActivationsOpt, "f32")]

    def wrap(command: Callable) -> Callable:
        hints = typing.get_type_hints(command, include_extras=True)
        own = [p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
               for p in list(inspect.signature(command).parameters.values())[1:]]
        params = [param("prompt", PromptArg, None), *own, *shared]
        names = {f.name for f in RunOptions.__dataclass_fields__.values()}

        @functools.wraps(command)
        def with_options(**kwargs):
            kwargs.pop("no_cache")                # it acted through its callback (the environment)
            run = RunOptions(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
            return command(run, **kwargs)

        with_options.__signature__ = inspect.Signature(params, return_annotation=None)
        with_options.__annotations__ = {p.name: p.annotation for p in params}
        return with_options

    return wrap
