"""``llamatrace quantize BASE OUT --target-bpw B -f TEXT``: the recipe search (issue 35 §3); the
work is in :mod:`llamatrace.quantize.search`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, err, out, status, stdout
from llamatrace.cli.options import ThreadsOpt, load_model
from llamatrace.errors import OptionError

DEFAULT_CANDIDATES = "Q3_K,Q4_K,Q5_K,Q6_K,Q8_0"


@app.command()
def quantize(
    base: Annotated[Path, typer.Argument(help="The base GGUF (F32, F16, BF16 or Q8_0).", show_default=False)],
    output_file: Annotated[Path, typer.Argument(metavar="OUT", help="The GGUF to write.", show_default=False)],
    target_bpw: Annotated[Optional[float], typer.Option("--target-bpw", help="Bits per weight the file may "
                          "not exceed, as llama-quantize counts them: 8 × bytes of tensor data ÷ weights "
                          "(every tensor, norms included).", show_default=False)] = None,
    target_size: Annotated[Optional[int], typer.Option("--target-size", help="Bytes of tensor data the file "
                           "may not exceed.", show_default=False)] = None,
    text_file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Calibration text: the KL "
                         "divergence of each requantized group is measured on it.", show_default=False)] = None,
    candidates: Annotated[str, typer.Option("--candidates", help="Types a group may get (each after "
                          "llama.cpp's fallback for rows that are not a multiple of 256).")] = DEFAULT_CANDIDATES,
    measure: Annotated[str, typer.Option("--measure", metavar="probe|all", help="probe: run each group at its "
                       "cheapest candidate and scale the others by their local error (one run a group); all: "
                       "run every candidate.")] = "probe",
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="Tokens per calibration chunk; the second "
                        "half of each chunk is scored.")] = 512,
    chunks: Annotated[Optional[int], typer.Option("--chunks", help="Use at most N calibration chunks.",
                                                  show_default=False)] = None,
    verify_file: Annotated[Optional[Path], typer.Option("--verify-file", help="Held-out text: after writing "
                           "OUT, measure its real KLD against BASE on it (and on the calibration chunks, "
                           "beside the prediction).", show_default=False)] = None,
    measurements: Annotated[Optional[Path], typer.Option("--measurements", help="Where the measured groups "
                            "are kept, and resumed from on a rerun (default: OUT.measurements.json).",
                            show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option("--output", "-o", help="A picture of the recipe: bits and "
                    "sensitivity per layer and matrix (.png, .svg or .pdf).", show_default=False)] = None,
    threads: ThreadsOpt = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object instead of the "
                                           "table.")] = False,
) -> None:
    """Choose a type for every matrix of BASE within a byte budget, for the least KL divergence, and write OUT.

    Each matrix (per layer: attn_q/k/v/output, ffn_gate/up/down; the embedding, the output) is
    requantized alone in memory, and the KL divergence of the logits against BASE's is measured
    on the calibration text, rerunning only the layers from that matrix's on. An exact knapsack
    then picks the mix of least predicted KLD within the budget. The table (or --json) gives each
    group's type, ΔKLD and bytes, and the recipe as llama-quantize --tensor-type arguments.

    Examples:

      llamatrace quantize base-f16.gguf out.gguf --target-bpw 5.5 -f calibration.txt

      llamatrace quantize base-f16.gguf out.gguf --target-size 91724544 -f calibration.txt --verify-file heldout.txt -o recipe.png --json
    """
    from llamatrace.corpus.chunks import make_chunks, read_corpus
    from llamatrace.kernels.quantizers import quantize_rows
    from llamatrace.quantize import report
    from llamatrace.quantize import search as S
    from llamatrace.quantize.mix import write_mix
    from llamatrace.outputs import check_output_path

    if text_file is None:
        raise OptionError("the recipe search needs a calibration text: -f TEXT")
    if target_bpw is None and target_size is None:
        raise OptionError("give --target-bpw or --target-size")
    types = S.parse_types(candidates)
    if measure not in ("probe", "all"):
        raise OptionError(f"--measure must be probe or all, got {measure!r}")
    check_output_path(output_file, "OUT")
    if plot is not None:
        check_output_path(plot, "-o")
    text = read_corpus(text_file)
    held_out = read_corpus(verify_file) if verify_file is not None else None
    model = load_model(base, threads, "f32")
    if any(t.tensor_type not in (S.T.F32, S.T.F16, S.T.BF16, S.T.Q8_0) for t in model.file.tensors.values()):
        raise OptionError(f"{base}: the base must be F32, F16, BF16 or Q8_0 (requantizing a quantized file "
                          f"loses accuracy twice)")
    where = measurements if measurements is not None else output_file.with_name(output_file.name + ".measurements.json")

    def progress(done: int, total: int, seconds: float) -> None:
        status(f"measured {done}/{total} groups, {seconds:.0f} s, about {seconds / done * (total - done):.0f} s left")

    recipe, _ = S.search(model, text, target_bpw=target_bpw, target_size=target_size, candidates=types,
                         quantize=quantize_rows, n_ctx=ctx_size, n_chunks=chunks, mode=measure,
                         measurements=where, progress=progress)
    write_mix(Path(model.path), output_file, recipe.types, quantize_rows)
    measured = {}
    if held_out is not None:
        from llamatrace.model.llama import Llama
        with Llama.load(output_file) as quantized:
            for name, corpus in (("calibration", text), ("held_out", held_out)):
                cut = make_chunks(model.tokenizer, corpus, ctx_size, chunks, model.config.max_seq_len)
                stats = S.measured_kld(model, quantized, cut)
                measured[name] = {"mean_kld": stats.mean_kld, "mean_kld_error": stats.mean_kld_error,
                                  "same_top_p": stats.same_top_p, "ppl": stats.ppl, "ppl_base": stats.ppl_base,
                                  "count": stats.count}
    if plot is not None:
        report.plot(recipe, plot, f"{Path(model.path).name} → {output_file.name}")
    if json_out:
        stdout.write(json.dumps(report.document(recipe, None, measured)) + "\n")
        return
    out.print(report.table(recipe), markup=False, highlight=False)
    for name, m in measured.items():
        out.print(f"measured on the {name.replace('_', '-')} text: KLD {m['mean_kld']:.6f} ± {m['mean_kld_error']:.6f}, "
                  f"same top {100 * m['same_top_p']:.2f} %, PPL {m['ppl']:.4f} (base {m['ppl_base']:.4f})",
                  markup=False, highlight=False)
    out.print("llama-quantize " + " ".join(f"--tensor-type '{a}'" for a in recipe.tensor_type_args())
              + f" {base} {output_file} Q4_K_M", markup=False, highlight=False, soft_wrap=True)
    err.print(f"wrote {output_file}", markup=False, highlight=False)
