"""``llamatrace quantize``: a GGUF quantized as llama.cpp's ``llama-quantize`` does it, byte for
byte; the rules are in :mod:`llamatrace.quantize.rules`, the writing in :mod:`llamatrace.quantize.writer`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, err, exit_interrupted, out, plural, status_bar, stdout
from llamatrace.cli.options import ThreadsOpt
from llamatrace.errors import LlamatraceError, OptionError


@app.command()
def quantize(
    base: Annotated[Path, typer.Argument(metavar="BASE", help="The model to quantize: a GGUF file in F32, F16, BF16 or Q8_0 "
                                         "(another quantized file needs --allow-requantize).", show_default=False)],
    output: Annotated[Path, typer.Argument(metavar="OUT", help="The GGUF file to write (replaced if it exists; "
                                           "written under a temporary name and renamed when complete).",
                                           show_default=False)],
    type_name: Annotated[str, typer.Option("--type", metavar="TYPE", help="llama.cpp's file type: Q4_0, Q4_1, "
                         "Q5_0, Q5_1, Q8_0, Q2_K, Q3_K_S, Q3_K_M, Q3_K_L, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K "
                         "(Q3_K, Q4_K, Q5_K = the _M mixes), or F16, BF16, F32.", show_default=False)],
    tensor_type: Annotated[Optional[list[str]], typer.Option("--tensor-type", metavar="PATTERN=TYPE",
                           help="Give the tensors whose name contains a match of the regular expression PATTERN "
                           "the ggml type TYPE (q4_k, q6_k, q8_0, f16 …), as llama-quantize's --tensor-type: "
                           "the first matching pattern wins over the file type's mix; repeatable.",
                           show_default=False)] = None,
    imatrix: Annotated[Optional[Path], typer.Option("--imatrix", metavar="FILE", help="An importance matrix "
                       "(llama-imatrix's GGUF, or `llamatrace imatrix`'s): each quantized tensor's error is "
                       "weighted by its columns' mean squared input.", show_default=False)] = None,
    allow_requantize: Annotated[bool, typer.Option("--allow-requantize", metavar="", help="Quantize a base "
                                "that is already quantized (other than Q8_0): its error adds to the new one.")] = False,
    pure: Annotated[bool, typer.Option("--pure", metavar="", help="Every quantizable tensor the file type's "
                    "default type, without llama.cpp's mix (as llama-quantize --pure); --tensor-type still applies.")] = False,
    threads: ThreadsOpt = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object (every tensor's "
                                           "type, the fallbacks, sizes, bits per weight) instead of the summary.")] = False,
) -> None:
    """Quantize a GGUF model as llama.cpp's llama-quantize does: the same tensor types, bytes and metadata.

    Each tensor gets the type llama.cpp's rules give it for the file type (more bits for attn_v and
    ffn_down in the layers that matter most, the output matrix Q6_K, a 32-block type where the rows
    do not fill 256-weight blocks), unless a --tensor-type pattern names it. A progress bar goes to
    stderr, the summary to stdout.

    Examples:

      llamatrace quantize SmolLM2-135M-F16.gguf SmolLM2-Q4_K_M.gguf --type Q4_K_M

      llamatrace quantize model-f16.gguf model-q4.gguf --type Q4_K_M --tensor-type attn_v=q8_0 --tensor-type 'blk.[0-3].ffn_down=q6_k'

      llamatrace quantize model-f16.gguf model-q3.gguf --type Q3_K_M --imatrix imatrix.gguf --json
    """
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.outputs import check_output_path
    from llamatrace.quantize.rules import Override, file_type, tensor_types, unmatched

    ftype = file_type(type_name)
    overrides = [Override.parse(text) for text in tensor_type or []]
    if output.exists() and base.exists() and output.resolve() == base.resolve():
        raise OptionError(f"OUT {str(output)!r} is the base model itself: give another output file")
    check_output_path(output, "OUT")
    if threads is not None:
        from llamatrace.kernels import threads as kernel_threads
        try:
            kernel_threads.set_threads(threads)
        except (ValueError, LlamatraceError) as exc:
            raise OptionError(f"--threads {threads}: {exc}") from None
    with open_gguf(base) as f:
        weights, info = _read_imatrix(imatrix, f) if imatrix is not None else (None, None)
        fallbacks: list[tuple[str, object, object]] = []
        types = tensor_types({n: (t.tensor_type, [int(d) for d in t.shape]) for n, t in f.tensors.items()},
                             f.metadata, ftype, overrides, pure=pure, has_imatrix=weights is not None,
                             on_fallback=lambda *a: fallbacks.append(a))
        for o in unmatched(overrides, f.tensors):
            _warn(f"--tensor-type {o.pattern}={o.ggml_type.name.lower()}: the pattern matches no tensor "
                          f"of {base.name}")
        try:
            summary = _write(f, output, types, ftype, weights, info, allow_requantize)
        except KeyboardInterrupt:
            err.print(f"[yellow]interrupted[/]: nothing written at {output}")
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


def _warn(message: str) -> None:
    from rich.markup import escape
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


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
        OptionError: the file cannot be read, or it names none of the model's tensors (another model's).
    """
    from llamatrace.quantize.imatrix_file import read_imatrix, read_imatrix_meta
    from llamatrace.quantize.writer import ImatrixInfo, column_importances
    with open(path, "rb") as fh:          # read_imatrix has checked it opens
        legacy = fh.read(4) != b"GGUF"
    weights = column_importances(read_imatrix(path), legacy=legacy)
    meta = read_imatrix_meta(path)
    if not set(weights) & set(f.tensors):
        raise OptionError(f"--imatrix {str(path)!r}: none of its {plural(len(weights), 'entry', 'entries')} names a "
                          f"tensor of {f.path.name}: it was computed for another model")
    return weights, ImatrixInfo(str(path), meta.datasets[0] if meta.datasets else None, len(weights), meta.chunk_count)
