"""``llamatrace quantize``: a GGUF quantized as llama.cpp's ``llama-quantize`` does it, byte for
byte; the rules are in :mod:`llamatrace.quantize.rules`, the writing in :mod:`llamatrace.quantize.writer`.
With ``-f TEXT`` and a budget, the recipe search (:mod:`llamatrace.quantize.search`) chooses the types."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Iterable, Optional

import typer

from llamatrace.cli.app import (app, err, exit_interrupted, out, plural, quiet, status, status_bar, status_spinner,
                                stdout)
from llamatrace.cli.options import (NoCacheOpt, RayOpt, WorkerThreadsOpt, WorkersOpt, given_on_command_line, reads,
                                     remove_leftovers)
from llamatrace.cli.progress import CountBar
from llamatrace.errors import LlamatraceError, OptionError


def _in_order(ctx: typer.Context, param: typer.CallbackParam, value):
    """Click runs option callbacks in the order the options first appear on the command line: keep
    that order, since llama-quantize reads --tensor-type and --tensor-type-file patterns as given."""
    if value:
        ctx.meta.setdefault("quantize.given", []).append(param.name)
    return value


def _given_first(ctx: typer.Context, a: str, b: str) -> bool:
    """Whether option ``a`` was given before option ``b`` (both given; see :func:`_in_order`)."""
    given = ctx.meta.get("quantize.given", [])
    return a in given and b in given and given.index(a) < given.index(b)


BASE_READ = "the base model itself"
"""How an output that is BASE is refused (:func:`llamatrace.outputs.reading`)."""


@app.command()
def quantize(
    ctx: typer.Context,
    base: Annotated[Path, typer.Argument(metavar="BASE", help="The model to quantize: a GGUF file in F32, F16, BF16 or Q8_0 "
                                         "(another quantized file needs --allow-requantize), or a known model's "
                                         "name (smollm2-135m, gemma3-270m: quantized files, so with "
                                         "--allow-requantize; `--type F16` of one makes an F16 base).",
                                         show_default=False, callback=reads(BASE_READ))],
    output: Annotated[Path, typer.Argument(metavar="OUT", help="The GGUF file to write (replaced if it exists; "
                                           "written under a temporary name and renamed when complete).",
                                           show_default=False)],
    type_name: Annotated[Optional[str], typer.Option("--type", metavar="TYPE", help="llama.cpp's file type: Q4_0, "
                         "Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q2_K_S (needs --imatrix), Q3_K_S, Q3_K_M, Q3_K_L, Q4_K_S, "
                         "Q4_K_M, Q5_K_S, Q5_K_M, Q6_K (Q3_K, Q4_K, Q5_K = the _M mixes), MXFP4_MOE (experts MXFP4, the rest "
                         "Q8_0), or F16, BF16, F32; or "
                         "llama.cpp's number for it (15 = Q4_K_M). With -f: the stock mix the recipe "
                         "is compared with (and, without --target-bpw/--target-size, whose size it may not exceed).",
                         show_default=False)] = None,
    tensor_type: Annotated[Optional[list[str]], typer.Option("--tensor-type", metavar="PATTERN=TYPE",
                           help="Give the tensors whose name contains a match of the regular expression PATTERN "
                           "the ggml type TYPE (q4_k, q6_k, q8_0, f16 …), as llama-quantize's --tensor-type: "
                           "the first matching pattern wins over the file type's mix; repeatable.",
                           show_default=False, callback=_in_order)] = None,
    tensor_type_file: Annotated[Optional[list[Path]], typer.Option("--tensor-type-file", metavar="FILE",
                                help="PATTERN=TYPE entries as --tensor-type's, separated by spaces or newlines "
                                "(llama-quantize's --tensor-type-file); before or after the --tensor-type "
                                "patterns as given first on the command line.", show_default=False,
                                callback=_in_order)] = None,
    output_tensor_type: Annotated[Optional[str], typer.Option("--output-tensor-type", metavar="TYPE",
                                  help="The ggml type of output.weight (and of a token embedding tied to it, "
                                  "with a quantized --type, unless --token-embedding-type or --pure), before any "
                                  "--tensor-type.",
                                  show_default=False)] = None,
    token_embedding_type: Annotated[Optional[str], typer.Option("--token-embedding-type", metavar="TYPE",
                                    help="The ggml type of token_embd.weight, before any --tensor-type.",
                                    show_default=False)] = None,
    leave_output_tensor: Annotated[bool, typer.Option("--leave-output-tensor", metavar="", help="Keep "
                                   "output.weight in the base's type (larger, may be better when requantizing).")] = False,
    imatrix: Annotated[Optional[Path], typer.Option("--imatrix", metavar="FILE", help="An importance matrix "
                       "(llama-imatrix's GGUF, or `llamatrace imatrix`'s): each quantized tensor's error is "
                       "weighted by its columns' mean squared input.", show_default=False,
                       callback=reads("the importance matrix this run reads (--imatrix)"))] = None,
    allow_requantize: Annotated[bool, typer.Option("--allow-requantize", metavar="", help="Quantize a base "
                                "that is already quantized (other than Q8_0): its error adds to the new one "
                                "(also for the recipe search).")] = False,
    pure: Annotated[bool, typer.Option("--pure", metavar="", help="Every quantizable tensor the file type's "
                    "default type, without llama.cpp's mix (as llama-quantize --pure); --tensor-type still applies.")] = False,
    text_file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Calibration text: search a recipe "
                         "(a type per matrix) by measuring on it the KL divergence each requantized matrix adds.",
                         show_default=False, callback=reads("the calibration text this run reads (-f)"))] = None,
    target_bpw: Annotated[Optional[float], typer.Option("--target-bpw", help="With -f: bits per weight the file "
                          "may not exceed, as llama-quantize counts them (8 × bytes of tensor data ÷ weights, "
                          "every tensor).", show_default=False)] = None,
    target_size: Annotated[Optional[int], typer.Option("--target-size", help="With -f: bytes of tensor data the "
                           "file may not exceed.", show_default=False)] = None,
    candidates: Annotated[str, typer.Option("--candidates", help="With -f: the types a matrix may get (each "
                          "after llama.cpp's fallback for rows that are not a multiple of 256).")] = "Q3_K,Q4_K,Q5_K,Q6_K,Q8_0",
    measure: Annotated[str, typer.Option("--measure", metavar="probe|all", help="With -f: probe runs each matrix "
                       "at its cheapest candidate and scales the others by their local error; all runs every "
                       "candidate.")] = "probe",
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="Tokens per calibration chunk; the second "
                        "half of each chunk is scored.")] = 512,
    chunks: Annotated[Optional[int], typer.Option("--chunks", help="Use at most N calibration (and held-out) "
                                                  "chunks.", show_default=False)] = None,
    verify_file: Annotated[Optional[Path], typer.Option("--verify-file", help="With -f: held-out text on which "
                           "OUT (and the --type mix) are measured against BASE after writing: KLD, same top "
                           "token, PPL.", show_default=False,
                           callback=reads("the held-out text this run reads (--verify-file)"))] = None,
    measurements: Annotated[Optional[Path], typer.Option("--measurements", help="With -f: where the measured "
                            "matrices are kept and resumed from (default: OUT.measurements.json).",
                            show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option("--output", "-o", help="With -f: a picture of the recipe, bits "
                    "and sensitivity per layer and matrix (.png, .svg or .pdf; checked before measuring).",
                    show_default=False)] = None,
    activations: Annotated[Optional[str], typer.Option(
        "--activations", metavar="f32|q8", help="With -f: the arithmetic the KL divergences are measured in, "
        "f32 (float32, HF's) or q8 (8-bit activations, llama.cpp's). Default: as perplexity's, q8 for models "
        "of 1 B parameters or more on CPUs with AVX2, else f32.", show_default=False)] = None,
    workers: WorkersOpt = 1,
    ray: RayOpt = None,
    threads: WorkerThreadsOpt = None,
    no_cache: NoCacheOpt = False,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object (every tensor's "
                                           "type, the fallbacks, sizes, bits per weight) instead of the summary.")] = False,
) -> None:
    """Quantize a GGUF model as llama.cpp's llama-quantize does: the same tensor types, bytes and metadata.

    Each tensor gets the type llama.cpp's rules give it for the file type (more bits for attn_v and
    ffn_down in the layers that matter most, the output matrix Q6_K, a 32-block type where the rows
    do not fill 256-weight blocks), unless a --tensor-type pattern names it. A progress bar goes to
    stderr, the summary to stdout. The first run compiles the quantizers (about a minute; cached
    afterwards, and done ahead by `python -m llamatrace.kernels.precompile`). A temporary file a
    killed run left beside OUT is removed, with a note.

    With -f the recipe search measures each matrix's KL divergence at each candidate type (the
    slow part: --workers / --ray spread it, a progress bar shows the time left, or in a log a
    line every tenth of the matrices or 30 s); the measurements are kept in
    OUT.measurements.json as they are made, so after Ctrl-C or a crash the same command resumes.
    Its table marks, with --type, each matrix whose type differs from that stock mix.

    Examples:

      llamatrace quantize SmolLM2-135M-F16.gguf SmolLM2-Q4_K_M.gguf --type Q4_K_M

      llamatrace quantize model-f16.gguf model-q4.gguf --type Q4_K_M --tensor-type attn_v=q8_0 --tensor-type 'blk.[0-3].ffn_down=q6_k'

      llamatrace quantize model-f16.gguf model-q3.gguf --type Q3_K_M --imatrix imatrix.gguf --json

      llamatrace quantize model-f16.gguf model-q4.gguf --type Q4_K_M --output-tensor-type q8_0 --token-embedding-type q4_0

      llamatrace quantize model-f16.gguf model-q4.gguf --type Q4_K_S --leave-output-tensor --tensor-type-file types.txt

      llamatrace quantize model-f16.gguf model-q2.gguf --type Q2_K_S --imatrix imatrix.gguf

      llamatrace quantize model-f16.gguf recipe.gguf --target-bpw 5.5 -f calibration.txt --verify-file heldout.txt -o recipe.png

      llamatrace quantize model-f16.gguf recipe.gguf --type Q3_K_M -f calibration.txt --verify-file heldout.txt

      llamatrace quantize model-f16.gguf recipe.gguf --target-bpw 4.8 -f calibration.txt --workers 2

      llamatrace quantize 8B-F16.gguf recipe.gguf --type Q4_K_M -f calibration.txt --ray head-node:6379 --workers 16
    """
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.outputs import check_output_path, reading
    from llamatrace.quantize.rules import Override, file_type, ggml_type, read_tensor_type_file, tensor_types, unmatched
    from llamatrace.quantize.writer import check_requantize, usable_imatrix

    stock_only = {"--tensor-type": tensor_type, "--tensor-type-file": tensor_type_file, "--pure": pure,
                  "--output-tensor-type": output_tensor_type, "--token-embedding-type": token_embedding_type,
                  "--leave-output-tensor": leave_output_tensor}
    if text_file is not None and any(stock_only.values()):
        raise OptionError(f"{', '.join(k for k, v in stock_only.items() if v)} choose types of a stock mix: the "
                          f"recipe search (-f) chooses every type itself; leave them out or drop -f")
    if text_file is not None:
        _search(base, output, type_name, imatrix, text_file, target_bpw, target_size, candidates, measure, ctx_size,
                chunks, verify_file, measurements, plot, threads, json_out, workers, ray, allow_requantize, activations)
        return
    search_only = {"target_bpw": "--target-bpw", "target_size": "--target-size", "verify_file": "--verify-file",
                   "workers": "--workers", "ray": "--ray", "measurements": "--measurements", "plot": "-o",
                   "candidates": "--candidates", "measure": "--measure", "ctx_size": "--ctx-size", "chunks": "--chunks",
                   "activations": "--activations"}
    given = given_on_command_line(ctx, search_only)
    if given:                  # each was silently ignored without -f (-o's picture never drawn)
        one = len(given) == 1
        raise OptionError(f"{', '.join(given)} belong{'s' if one else ''} to the recipe search: add -f TEXT, or "
                          f"leave {'it' if one else 'them'} out")
    if type_name is None:
        raise OptionError("give --type TYPE (a llama.cpp file type such as Q4_K_M), or -f TEXT and a budget "
                          "for a recipe search")
    ftype = file_type(type_name)
    overrides = [Override.parse(text) for text in tensor_type or []]
    from_files = [o for path in tensor_type_file or []
                  for o in read_tensor_type_file(reading(path, "a --tensor-type-file this run reads"))]
    overrides = from_files + overrides if _given_first(ctx, "tensor_type_file", "tensor_type") else overrides + from_files
    output_type, embd_type = (None if name is None else ggml_type(name, f"{option} {name!r}") for option, name in
                              (("--output-tensor-type", output_tensor_type), ("--token-embedding-type", token_embedding_type)))
    base = _base_file(base)
    check_output_path(output, "OUT")
    remove_leftovers(output)
    if threads is not None:
        from llamatrace.machine import threads as kernel_threads
        try:
            kernel_threads.set_threads(threads)
        except (ValueError, LlamatraceError) as exc:
            raise OptionError(f"--threads {threads}: {exc}") from None
    with open_gguf(base) as f:
        weights, info = _read_imatrix(imatrix, f) if imatrix is not None else (None, None)
        fallbacks: list[tuple[str, object, object]] = []
        types = tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()},
                             f.metadata, ftype, overrides, pure=pure, has_imatrix=weights is not None,
                             output_type=output_type, token_embd_type=embd_type,
                             leave_output=leave_output_tensor, on_fallback=lambda *a: fallbacks.append(a))
        if ftype.name == "MXFP4_MOE" and not any("_exps." in n for n in f.tensors):
            _warn(f"{base.name} has no expert tensors: MXFP4_MOE makes its matrices Q8_0 (as llama-quantize does); "
                  f"--type Q8_0 gives the same tensors under their own name")
        for o in unmatched(overrides, f.tensors):
            _warn(f"--tensor-type {o.pattern}={o.ggml_type.name.lower()}: the pattern matches no tensor "
                          f"of {base.name}")
        _warn_unapplied(ftype, "output.weight" not in f.tensors, overrides, output_tensor_type, pure,
                        leave_output_tensor, base.name, token_embedding_type)
        check_requantize(f, types, allow_requantize)     # before a minute of compiling
        usable_imatrix(f, types, ftype, weights, f"--imatrix {str(imatrix)!r}")
        try:
            compile_quantizers(quantizers_for(f, types))
            summary = _write(f, output, types, ftype, weights, info, allow_requantize)
        except KeyboardInterrupt:
            err.print(f"[yellow]interrupted[/]: nothing written at {output}", soft_wrap=True)
            exit_interrupted()
    if weights is not None and summary.no_imatrix:
        _warn(f"the importance matrix has no entry for {plural(len(summary.no_imatrix), 'tensor')} "
                      f"({', '.join(summary.no_imatrix[:3])}{' …' if len(summary.no_imatrix) > 3 else ''}): "
                      f"quantized without it, as llama-quantize does")
    if json_out:
        stdout.write(json.dumps({
            "base": str(base), "output": str(output), "type": ftype.name, "file_type": ftype.ftype,
            "imatrix": None if imatrix is None else str(imatrix),
            "tensors": [{"name": n, "type": t.name} for n, t in summary.types.items()],
            "fallbacks": [{"name": n, "wanted": a.name, "written": b.name} for n, a, b in fallbacks],
            "bytes_in": summary.bytes_in, "bytes_out": summary.bytes_out, "bpw": summary.bpw,
            "seconds": summary.seconds}) + "\n")
    else:
        counts = Counter(t.name for t in summary.types.values())
        out.print(f"{output}: {ftype.name}, {plural(len(summary.types), 'tensor')} "
                  f"({', '.join(f'{k} {v}' for k, v in counts.most_common())}), "
                  f"{summary.bytes_in / 2**20:.2f} MiB → {summary.bytes_out / 2**20:.2f} MiB ({summary.bpw:.2f} BPW)",
                  markup=False)
    if fallbacks:
        err.print(f"[dim]{plural(len(fallbacks), 'tensor')} of {len(summary.types)} fell back to another type: "
                  f"their rows are not a multiple of the type's block (as llama-quantize)[/]")
    err.print(f"[dim]quantized in {summary.seconds:.1f} s[/]")


def _warn_unapplied(ftype, tied: bool, overrides: list, output_tensor_type: str | None, pure: bool,
                    leave_output_tensor: bool, base_name: str, token_embedding_type: str | None) -> None:
    """A warning for each option that changes nothing here, as in llama-quantize 0.3.36
    (``llama_tensor_get_type``): patterns and the tied output's type go to quantized file types only."""
    from gguf import GGMLQuantizationType as T
    quantized = ftype.default not in (T.F32, T.F16, T.BF16)
    if overrides and not quantized:
        _warn(f"--tensor-type / --tensor-type-file patterns are not applied with --type {ftype.name}: "
              f"llama-quantize gives them to quantized file types only; give a quantized --type, or leave them out")
    if output_tensor_type is not None and tied and (pure or not quantized):
        _warn(f"--output-tensor-type: {base_name} has no output.weight (its token embedding is the output) and "
              f"{'--pure' if pure else f'--type {ftype.name}'} keeps the embedding's type; choose it with "
              f"--token-embedding-type")
    elif output_tensor_type is not None and tied and token_embedding_type is not None:
        _warn(f"--output-tensor-type: {base_name} has no output.weight (its token embedding is the output), and "
              f"--token-embedding-type {token_embedding_type} sets that embedding's type (as in llama-quantize); "
              f"drop one of the two")
    if leave_output_tensor and tied:
        _warn(f"--leave-output-tensor: {base_name} has no output.weight (its token embedding is the output): "
              f"nothing is left as it was; keep the embedding's type with --token-embedding-type")


def _warn(message: str) -> None:
    from rich.markup import escape
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def _base_file(base: Path) -> Path:
    """BASE as given, or the file of a known model's name (``smollm2-135m``) as every command takes
    it (:func:`llamatrace.gguf.fetch.resolve_model`: from the cache, fetched once).

    Raises:
        ModelNotFoundError: a known model that cannot be fetched.
    """
    from llamatrace.gguf.fetch import KNOWN_MODELS, resolve_model
    from llamatrace.outputs import reading
    if not base.exists() and str(base) in KNOWN_MODELS:
        return reading(resolve_model(str(base), log=status, quiet=quiet()), BASE_READ)
    return base


def quantizers_for(f, types) -> set[tuple[object, str]]:
    """``(ggml type, input dtype name)`` of each quantizer that converting ``f``'s tensors to
    ``types`` (name → type) runs: an F16 tensor's rows go in as float16, the others as float32
    (:func:`llamatrace.quantize.writer.dequantize`)."""
    import gguf

    from llamatrace.kernels.quantizers.rows import QUANTIZABLE
    return {(dst, "float16" if t.tensor_type == gguf.GGMLQuantizationType.F16 else "float32")
            for name, t in f.tensors.items() if (dst := types[name]) != t.tensor_type and dst in QUANTIZABLE}


COMPILING = "Compiling the quantizers (first run only, about 1 min; cached afterwards)"


def run_quantizers(needed: Iterable[tuple[object, str]]) -> None:
    """Each quantizer of ``needed`` (:func:`quantizers_for`) once, on one row of 256 zeros (a
    multiple of every block): Numba compiles it, or loads it from its cache."""
    import numpy as np

    from llamatrace.kernels.quantizers.rows import quantize_rows
    for ggml_type, dtype in sorted(needed, key=lambda pair: (int(pair[0]), pair[1])):
        quantize_rows(ggml_type, np.zeros((1, 256), dtype))


def compile_quantizers(needed: Iterable[tuple[object, str]], also=None) -> None:
    """:func:`run_quantizers` (and ``also()``, other kernels to warm) before the progress bar
    starts, so that a first run's compile (about a minute for a Q4_K_M mix on 2 busy cores)
    happens under a status line, not inside the bar, whose time left it would throw off. On a
    terminal a spinner counts the kernels compiled; in a log or a pipe one line says that
    compiling has begun (nothing when every kernel comes from the cache)."""
    from llamatrace.cli.options import counting_compiles

    def run() -> None:
        run_quantizers(needed)
        if also is not None:
            also()

    if err.is_terminal:
        with status_spinner("Loading the quantizers …") as spinner, counting_compiles(
                lambda n: spinner.update(f"{COMPILING}: {n} compiled …"),
                lambda n: spinner.update(f"{COMPILING}: {n} compiled …")):
            run()
        return
    said: list[bool] = []

    def first(n: int) -> None:
        if not said:
            said.append(True)
            status(f"{COMPILING} …")

    with counting_compiles(lambda n: None, first):
        run()


def _write(f, output: Path, types, ftype, weights, info, allow_requantize: bool):
    """:func:`~llamatrace.quantize.writer.quantize_gguf` with a progress bar of tensors."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

    from llamatrace.quantize.writer import quantize_gguf
    with status_bar(TextColumn("Quantizing {task.fields[tensor]}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn()) as bar:
        task = bar.add_task("quantize", total=len(types), tensor="")

        def progress(i, n, name, src, dst) -> None:
            bar.update(task, completed=i, tensor=f"{name} {src.name} → {dst.name}")
        return quantize_gguf(f, output, types, ftype, imatrix=weights, imatrix_info=info,
                             allow_requantize=allow_requantize, progress=progress)


def _read_imatrix(path: Path, f):
    """The importance matrix of ``path`` as llama-quantize uses it (tensor name → mean squared input
    per column, :func:`~llamatrace.quantize.writer.column_importances`) and what the output records of it.

    Raises:
        OptionError: the file cannot be read, or it names none of the model's tensors (another
            model's); NaN and other widths are :func:`~llamatrace.quantize.writer.usable_imatrix`'s.
    """
    from llamatrace.quantize.imatrix.files import read_imatrix, read_imatrix_meta
    from llamatrace.quantize.writer import ImatrixInfo, column_importances
    entries = read_imatrix(path)           # a missing or foreign file: its one error line
    with open(path, "rb") as fh:
        legacy = fh.read(4) != b"GGUF"
    weights = column_importances(entries, legacy=legacy)
    meta = read_imatrix_meta(path)
    if not set(weights) & set(f.tensors):
        raise OptionError(f"--imatrix {str(path)!r}: none of its {plural(len(weights), 'entry', 'entries')} names a "
                          f"tensor of {f.path.name}: it was computed for another model")
    return weights, ImatrixInfo(str(path), meta.datasets[0] if meta.datasets else None, len(weights), meta.chunk_count)


def _search(base: Path, output: Path, type_name, imatrix, text_file: Path, target_bpw, target_size,
            candidates: str, measure: str, ctx_size: int, chunks, verify_file, measurements, plot, threads,
            json_out: bool, workers: int, ray: str | None, allow_requantize: bool, activations: str | None) -> None:
    """The recipe search: refuse what would fail later, measure, allocate, write OUT with llama.cpp's
    writer, verify, report."""
    from llamatrace.cli.options import check_activations, check_threads, default_activations, load_model
    from llamatrace.corpus.chunks import read_corpus
    from llamatrace.corpus.worker import threads_per_worker
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.kernels.quantizers.rows import quantize_rows
    from llamatrace.model.config import ModelConfig
    from llamatrace.outputs import check_output_path
    from llamatrace.quantize import report
    from llamatrace.quantize import search as S
    from llamatrace.quantize.rules import file_type, tensor_types
    from llamatrace.quantize.writer import check_requantize, usable_imatrix

    stock_type = file_type(type_name) if type_name is not None else None
    if target_bpw is None and target_size is None and stock_type is None:
        raise OptionError("the recipe search needs a budget: --target-bpw, --target-size, or --type (the size of "
                          "that stock mix)")
    types = S.parse_types(candidates)
    if measure not in ("probe", "all"):
        raise OptionError(f"--measure must be probe or all, got {measure!r}")
    if workers < 1:
        raise OptionError(f"--workers must be a positive integer, got {workers}")
    if activations is not None:
        check_activations(activations)
    check_threads(threads, ray is not None)
    if plot is not None:
        from llamatrace.views.plots import check_format
        check_format(plot, "-o")
    base = _base_file(base)
    where = measurements if measurements is not None else output.with_name(output.name + ".measurements.json")
    check_output_path(output, "OUT")
    if plot is not None:
        check_output_path(plot, "-o")
    check_output_path(where, "--measurements")
    S.Measurements.read(where)             # a file there that is no measurements: refused before the work
    remove_leftovers(output, plot)
    text = read_corpus(text_file)
    held_out = read_corpus(verify_file, "--verify-file") if verify_file is not None else None
    ftype = stock_type or file_type("Q4_K_M")
    with open_gguf(base) as f:         # what the writer would refuse after the measuring, refused now
        weights, info = _read_imatrix(imatrix, f) if imatrix is not None else (None, None)
        shapes = {n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()}
        stock = tensor_types(shapes, f.metadata, ftype, has_imatrix=weights is not None)
        groups = S.make_groups(f, ModelConfig.from_gguf(f).n_layers, types)
        planned = dict(stock)          # each group at a candidate other than its base type, if it has one
        for g in groups:
            src = f.tensors[g.tensor].tensor_type
            planned[g.tensor] = next((t for t in g.candidates if t != src), src)
        check_requantize(f, planned, allow_requantize)
        if weights is not None:       # NaN, or another model's width: refused before the measuring
            usable_imatrix(f, planned, ftype, weights, f"--imatrix {str(imatrix)!r}")
    model = load_model(base, threads, activations or default_activations(base))
    f = model.file
    if target_bpw is None and target_size is None:
        target_size = sum(S.tensor_bytes(stock[n], *f.matrix_shape(n)[-2:]) if len(f.matrix_shape(n)) > 1
                          else f.tensors[n].n_bytes for n in f.tensors)

    # on Ray, an actor's threads are what it reserves (--threads, else 1): the driver's cores say nothing of a node's
    worker_threads = threads if workers == 1 or ray is not None else threads_per_worker(workers, threads)
    if workers == 1 and ray is None:            # measured here: the candidates' kernels ready before the bar
        from llamatrace.kernels.precompile import compile_kernels
        compile_quantizers({(t, "float32") for g in groups for t in g.candidates},
                           lambda: compile_kernels([t.name for t in types], log=lambda line: None,
                                                   modes=(model.activations,)))
    bar = CountBar(f"Measuring {base.name}", "matrices", "measured", parallel=workers)
    t0 = time.perf_counter()
    try:
        with bar:
            recipe, store = S.search(model, text, target_bpw=target_bpw, target_size=target_size, candidates=types,
                                     quantize=quantize_rows, imatrix=weights, n_ctx=ctx_size, n_chunks=chunks,
                                     mode=measure, measurements=where, workers=workers, ray=ray,
                                     threads=worker_threads, progress=bar.update)
    except KeyboardInterrupt:
        from rich.markup import escape
        err.print(f"[yellow]interrupted[/]: {bar.done} of {bar.total} matrices measured, kept in {escape(str(where))} "
                  f"(the same command resumes); nothing written at {escape(str(output))}", soft_wrap=True)
        exit_interrupted()
    seconds = time.perf_counter() - t0
    if bar.ran:
        status(f"measured {plural(bar.ran, 'matrix', 'matrices')} in {seconds:.1f} s "
               f"({seconds / bar.ran:.2f} s each; {plural(workers, 'worker')}{' on Ray' if ray else ''})"
               + (f", {bar.done - bar.ran} resumed from {where}" if bar.done > bar.ran else ""))
    else:
        status(f"every matrix's measurements resumed from {where}")
    stock_recipe = S.stock_like(groups, stock, recipe.budget, store, recipe.base_kld) if stock_type else None
    written = {**stock, **recipe.types}
    try:
        compile_quantizers(quantizers_for(f, written))
        summary = _write(f, output, written, ftype, weights, info, allow_requantize)
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]: nothing written at {output}", soft_wrap=True)
        exit_interrupted()
    assert summary.bytes_out <= recipe.budget.limit, (summary.bytes_out, recipe.budget.limit)
    measured: dict = {}
    if held_out is not None:
        measured = _verify(model, output, stock if stock_type else None, ftype, weights, info, text, held_out,
                           ctx_size, chunks, allow_requantize)
    if plot is not None:
        report.plot(recipe, plot, f"{base.name} → {output.name}", stock_recipe)
    err.print(f"wrote {output} ({summary.bytes_out / 2**20:.2f} MiB of tensor data, {summary.bpw:.2f} BPW)"
              + (f" and the picture {plot}" if plot is not None else ""), markup=False, soft_wrap=True)
    if json_out:
        doc = report.document(recipe, stock_recipe, measured)
        doc["measurements"] = {"file": str(where), "measured": bar.ran, "resumed": bar.done - bar.ran,
                               "seconds": round(seconds, 3), "workers": workers, "threads": worker_threads, "ray": ray}
        stdout.write(json.dumps(doc) + "\n")
        return
    out.print(report.table(recipe, stock_recipe, stock_type.name if stock_type else None), markup=False)
    for name, m in measured.items():
        out.print(f"{name}: KLD {m['mean_kld']:.6f} ± {m['mean_kld_error']:.6f}, same top token "
                  f"{100 * m['same_top_p']:.2f} %, PPL {m['ppl']:.4f} (base {m['ppl_base']:.4f}), {m['count']} tokens",
                  markup=False)
    out.print("llama-quantize " + ("--allow-requantize " if allow_requantize else "")
              + " ".join(f"--tensor-type '{a}'" for a in recipe.tensor_type_args())
              + f" {base} {output} {ftype.name}", markup=False, soft_wrap=True)


def _verify(model, output: Path, stock, ftype, weights, info, text: str, held_out: str, ctx_size: int,
            chunks, allow_requantize: bool) -> dict:
    """KLD statistics against the base of OUT (and of the stock mix, written to a temporary file
    beside OUT), on the calibration and the held-out text."""
    import tempfile

    from llamatrace.corpus.chunks import make_chunks
    from llamatrace.model.llama import Llama
    from llamatrace.quantize.search import measured_kld
    cuts = {name: make_chunks(model.tokenizer, body, ctx_size, chunks, model.config.max_seq_len)
            for name, body in (("calibration", text), ("held-out", held_out))}
    files = [("recipe", output)]
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        if stock is not None:
            files.append((ftype.name, Path(tmp) / "stock.gguf"))
            compile_quantizers(quantizers_for(model.file, stock))
            _write(model.file, files[-1][1], stock, ftype, weights, info, allow_requantize)
        result = {}
        for label, path in files:
            # files read once: no packed copy; measured in the base's arithmetic
            with Llama.load(path, cache=False, activations=model.activations) as quantized:
                for name, cut in cuts.items():
                    if label != "recipe" and name == "calibration":
                        continue
                    s = measured_kld(model, quantized, cut)
                    result[f"{label} on {name}"] = {"mean_kld": s.mean_kld, "mean_kld_error": s.mean_kld_error,
                                                    "same_top_p": s.same_top_p, "ppl": s.ppl, "ppl_base": s.ppl_base,
                                                    "count": s.count}
    return result
