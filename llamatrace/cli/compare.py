"""``llamatrace compare``: where two implementations of the forward pass first disagree.

Two forms: ``compare [PROMPT] --against llama.cpp`` runs our forward pass and llama.cpp's on the
same GGUF and token ids; ``compare OURS.npz REF.npz`` compares two recordings with ``trace --npz``
keys. Both print one table (or ``--json``) and exit 0 within thresholds, 3 at a divergence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamatrace.errors import OptionError
from llamatrace.cli.app import EXIT_DIVERGED, app, out, status_spinner
from llamatrace.cli.options import (
    ActivationsOpt,
    default_prompt,
    given_on_command_line,
    LAYER_HELP,
    load_model,
    model_file,
    ModelOpt,
    NoCacheOpt,
    parse_layers,
    parse_stages,
    prepare_run,
    print_wide,
    PromptFileOpt,
    RawOpt,
    SystemOpt,
    ThreadsOpt,
)

AGAINST = ("llama.cpp", "hf")


@app.command()
def compare(
    ctx: typer.Context,
    args: Annotated[Optional[list[str]], typer.Argument(
        help="The prompt text (default: the short sample), or two .npz recordings: OURS.npz REF.npz.",
        show_default=False, metavar="[PROMPT | OURS.npz REF.npz]")] = None,
    against: Annotated[str, typer.Option("--against", metavar="llama.cpp|hf", help="The reference engine: llama.cpp "
                                         "(llama-cpp-python: pip install -e \".[llamacpp]\") or hf (HF "
                                         "transformers in fp32: torch, transformers, accelerate).")] = "llama.cpp",
    model: ModelOpt = None,
    raw: RawOpt = False,
    system: SystemOpt = None,
    prompt_file: PromptFileOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Also compare N decode steps; both engines "
                                        "are fed our greedy tokens.")] = 0,
    layer: Annotated[str, typer.Option("--layer", "-l", help=LAYER_HELP)] = "all",
    stage: Annotated[Optional[list[str]], typer.Option(
        "--stage", "-s", help="Stage ids or globs (kq*), repeatable or comma-separated.", show_default=False)] = None,
    sort: Annotated[str, typer.Option("--sort", metavar="forward|worst", help="Row order: 'forward' (the forward pass) or 'worst' "
                                      "(largest relative error first).")] = "forward",
    threshold: Annotated[Optional[float], typer.Option(
        "--threshold", help="One relative RMS error threshold for every stage (default: per stage kind, "
        "see above).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
    threads: ThreadsOpt = None,
    no_cache: NoCacheOpt = False,
    activations: ActivationsOpt = "f32",
) -> None:
    """Compare every stage of our forward pass with a reference, and find the first divergence.

    Per (step, layer, stage): both shapes, the relative RMS error ‖ours − ref‖ / ‖ref‖, the max
    abs error and the cosine similarity. The first divergence is the earliest stage in forward
    order whose error exceeds its threshold. Exit 0 within thresholds, 3 at a divergence.

    llama.cpp runs with outputs for every token, flash attention off and an f32 KV cache, so
    every stage has all its rows. Its matmuls multiply 8-bit-quantized activations: a healthy
    model drifts by ~1e-2 relative per matmul. Default thresholds, calibrated on the default
    model: 1e-3 for exact stages (inp_embd, kq_mask, freqs_cis; measured 0); 0.15 for Qcur*,
    Kcur* and kq (largest healthy error seen 0.054-0.072); 0.25 elsewhere (largest seen 0.125). A
    split-half RoPE gives 0.42-0.82 at layer 0's Qcur_rope, an RMSNorm without 1/rms ~0.9.
    2-bit models drift more (Q2_K: 0.17 at a deep layer's kq): raise --threshold there.
    HF transformers (--against hf, fp32, eager attention) agrees with ours to ~5e-6 at every
    stage it exposes (no RoPE, kq or kqv modules there).
    Two .npz recordings of llamatrace (trace --npz writes what it is) are held to 1e-4 (f32) or
    1e-3 (q8): a stage 5 % off is found. With --model, each stage is also judged by the error it
    adds, recomputed from each recording's own inputs; the report names the thresholds used.

    With two .npz files (keys step{S}.layer{L}.{stage}, as `trace --npz` writes), compares
    the recordings instead: mismatched shapes are rows of their own; the keys of one recording
    only are listed after the table (rows in --json) and counted beside the verdict.

    Mixture-of-experts stages with a slot per chosen expert (ffn_moe_gate … ffn_moe_weighted) are
    paired by expert id (ffn_moe_topk; llama.cpp's: the top k of its ffn_moe_probs), not by rank, and a
    token that chose other experts is left out of them and counted. ffn_moe_topk is scored as ids:
    other experts at any token is a divergence ("routing differs"), another order is not.

    Examples:

      llamatrace compare --raw "The capital of France is" --against llama.cpp

      llamatrace compare --raw "The capital of France is" --tokens 2 --sort worst --json

      llamatrace compare --raw "The capital of France is" --against hf --threshold 1e-4

      llamatrace compare ours.npz theirs.npz --layer 0-3 --stage "Qcur*,Kcur*"
    """
    from llamatrace.analysis.compare import compare_arrays, compare_with

    args = list(args or [])
    if tokens < 0:
        raise OptionError(f"--tokens must be >= 0, got {tokens}")
    if sort not in ("forward", "worst"):
        raise OptionError(f"--sort {sort!r}: choose 'forward' or 'worst'")
    if threshold is not None and not (threshold > 0 and math.isfinite(threshold)):
        raise OptionError(f"--threshold must be a positive number, got {threshold}")
    parse_layers(layer)
    patterns = _stage_patterns(stage)
    if len(args) == 2 and all(a.lower().endswith(".npz") for a in args):
        from llamatrace.analysis.compare import profile_for, recording_meta
        prompt_only = {"against": "--against", "raw": "--raw", "system": "--system", "prompt_file": "-f",
                       "tokens": "--tokens"}
        given = given_on_command_line(ctx, prompt_only)
        if given:
            raise OptionError(f"{', '.join(given)}: for a run from a prompt; two recordings are compared as they "
                              f"were recorded: leave {'it' if len(given) == 1 else 'them'} out")
        ours, ref = (_load_npz(Path(a)) for a in args)
        meta_ours, meta_ref = recording_meta(ours), recording_meta(ref)
        layers = _npz_selection(layer, patterns, args, ours, ref)      # bad keys refused before the load
        # with --model, judge each stage by the error it adds too (recomputed from each side's inputs)
        _check_same_prompt_length(args, ours, ref)
        m = None
        if model is not None:
            from llamatrace.gguf.reader import open_gguf
            from llamatrace.model.config import ModelConfig
            path_m = model_file(model)
            with open_gguf(path_m) as f:                 # the header: refused before the load
                config = ModelConfig.from_gguf(f)
            for path, rec in zip(args, (ours, ref)):
                _check_fits(config, path_m.name, path, rec)
            mode = (meta_ours or {}).get("activations", activations)
            m = load_model(path_m, threads, mode if mode in ("f32", "q8") else activations)
        try:
            result = compare_arrays(ours, ref, threshold=threshold, layers=layers,
                                    stages=patterns, profile=profile_for(meta_ours, meta_ref), model=m)
        except (ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
            if m is None:
                raise
            # arrays of another model of the same size and stages (_check_fits passed): --debug shows where
            raise OptionError(f"--model {m.path.name}: the recordings' stages cannot be recomputed with it "
                              f"({type(exc).__name__}: {' '.join(str(exc).split())[:80]}); give the model the "
                              f"recordings were made with") from exc
        result.extra = {**result.extra, "reference": args[1], "ours": args[0]}
    else:
        if len(args) == 2 and any(a.lower().endswith(".npz") for a in args):
            other = next(a for a in args if not a.lower().endswith(".npz"))
            raise OptionError(f"compare {other}: not a .npz recording; give two (OURS.npz REF.npz, as `trace --npz` "
                              f"writes them)")
        if len(args) > 1:
            raise OptionError(f"compare takes one prompt or two .npz files, got {len(args)} arguments "
                              "(quote a prompt with spaces)")
        if args and args[0].lower().endswith(".npz") and " " not in args[0]:
            raise OptionError(f"compare {args[0]}: give two .npz files (OURS.npz REF.npz), or a prompt with "
                              f"--against")
        if against not in AGAINST:
            raise OptionError(f"--against {against!r}: unknown engine; choose from {', '.join(AGAINST)}")
        patterns = parse_stages(stage)     # our stage ids here; a user's .npz may have others
        from llamatrace.analysis.bench import check_engines
        check_engines([against])           # one error line, before the model loads
        r = prepare_run(args[0] if args else None, prompt_file, model, threads=threads, activations=activations,
                        raw=raw, system=system, default=default_prompt())
        m, ids = r.model, r.ids
        with status_spinner(f"running llamatrace and {against} …"):
            result = compare_with(m, ids, tokens, against=against, threshold=threshold,
                                  layers=parse_layers(layer, m.config.n_layers), stages=patterns, threads=threads)
    if as_json:
        if sort == "worst":                 # --json's rows in the order the table would give them
            result.rows = sorted(result.rows, key=_worst_first)
        out.print_json(json.dumps(result.to_json()))
    else:
        _print_table(result, sort)
    if result.first_divergence is not None:
        raise typer.Exit(EXIT_DIVERGED)


def _stage_patterns(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


_TOKEN_ROWS = ("inp_embd", "attn_norm", "ffn_inp", "ffn_norm", "l_out")
"""Stages whose array is ``[n_tokens, dim]``: the residual stream and its norms."""


def _check_same_prompt_length(paths: list[str], ours: dict, ref: dict) -> None:
    """OptionError when the two recordings' prefills ran prompts of different lengths: every
    stage would differ in shape, which is no divergence of the models."""
    from llamatrace.analysis.compare import META_KEY, parse_key
    for key in sorted(ours.keys() & ref.keys() - {META_KEY}):
        step, _, stage = parse_key(key)
        a, b = ours[key], ref[key]
        if step == 0 and stage in _TOKEN_ROWS and a.ndim == b.ndim == 2 and a.shape[0] != b.shape[0]:
            raise OptionError(f"{paths[0]} and {paths[1]} record prompts of different lengths ({a.shape[0]} and "
                              f"{b.shape[0]} tokens, {key}); compare two traces of the same prompt")


def _check_fits(c, model_name: str, path: str, recording: dict) -> None:
    """OptionError when ``--model`` (``c``: its ModelConfig) is not the recording's model: a
    residual-stream stage of another width, a layer it does not have, or a stage it does not
    compute there (another architecture of the same size: its stages would be recomputed from
    arrays of other shapes)."""
    from llamatrace.analysis.compare import META_KEY, parse_key
    from llamatrace.tracing.stages import model_stage_ids, stage_layers
    computed = model_stage_ids(c)
    advice = "give the model the recording was made with"
    for key, array in recording.items():
        if key == META_KEY:
            continue
        _, layer, stage = parse_key(key)
        if array.ndim == 0:
            raise OptionError(f"{path}: its {key} is a single number, not a stage's array; {advice}")
        wide = stage in _TOKEN_ROWS and array.shape[-1] != c.dim
        if wide or (layer is not None and layer >= c.n_layers):
            what = f"its {key} is {list(array.shape)}" if wide else f"it has layer {layer}"
            raise OptionError(f"--model {model_name} is not the model of {path}: {what}, the model's dim is "
                              f"{c.dim} in {c.n_layers} layers; {advice}")
        if stage not in computed or (layer is not None and layer not in stage_layers(stage, c)):
            where = "" if stage not in computed else f" at layer {layer}"
            raise OptionError(f"--model {model_name} is not the model of {path}: it holds {stage}{where}, a stage "
                              f"this model does not compute{where and ' there'}; {advice}")


def _load_npz(path: Path) -> dict:
    import zipfile

    import numpy as np
    make = f"make one with `llamatrace trace --npz {path.name}`"
    try:
        with open(path, "rb") as file:             # np.load would read another file as a pickle or an .npy
            if not zipfile.is_zipfile(file):
                raise OptionError(f"{path}: not an .npz (zip) archive of arrays; {make}")
            file.seek(0)                           # is_zipfile leaves it at the end: np.load would read nothing
            with np.load(file, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise OptionError(f"{path}: no such file ({make})") from None
    except IsADirectoryError:
        raise OptionError(f"{path} is a directory: give a recording of `llamatrace trace --npz`") from None
    except PermissionError as exc:
        raise OptionError(f"{path}: cannot read it ({exc.strerror})") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise OptionError(f"{path}: not a readable .npz file ({exc})") from None
    from llamatrace.analysis.compare import META_KEY
    if not set(arrays) - {META_KEY}:                # nothing to compare: "no divergence" would mean nothing
        raise OptionError(f"{path}: holds no stage's array; {make}")
    return arrays


def _npz_selection(spec: str, patterns: list[str] | None, paths: list[str], *recordings: dict) -> list[int] | None:
    """The layers ``--layer`` keeps of two recordings (None: they have none), or OptionError for a key
    that is no stage key or a ``--stage`` pattern that matches no stage of either recording."""
    import fnmatch

    from llamatrace.analysis.compare import META_KEY, parse_key
    from llamatrace.tracing.stages import layer_list
    layers, stages, keys = set(), set(), set()
    for rec in recordings:
        for key in rec:
            if key == META_KEY:
                continue
            try:
                _, layer, stage = parse_key(key)
            except ValueError as exc:
                raise OptionError(f"{exc}; every key must look like step0.layer0.Qcur") from None
            stages.add(stage)
            keys.add((layer, stage))
            if layer is not None:
                layers.add(layer)
    for p in patterns or ():
        if not any(fnmatch.fnmatchcase(s, p) for s in stages):
            held = sorted(stages)
            raise OptionError(f"--stage {p!r} matches no stage of {paths[0]} or {paths[1]}; they hold "
                              f"{', '.join(held[:12]) or 'none'}{' …' if len(held) > 12 else ''}")
    if not layers:
        return None
    recorded = f"the recordings hold layer{'s' if len(layers) > 1 else ''} {layer_list(sorted(layers))}"
    try:
        chosen = parse_layers(spec, max(layers) + 1)
    except OptionError:
        raise OptionError(f"--layer {spec!r}: {recorded}") from None
    if chosen is not None and not set(chosen) & layers:
        raise OptionError(f"--layer {spec!r} selects none of them: {recorded}")
    if patterns and chosen is not None and not any(
            (layer is None or layer in chosen) and any(fnmatch.fnmatchcase(stage, p) for p in patterns)
            for layer, stage in keys):
        raise OptionError(f"--stage {','.join(patterns)} is recorded at none of --layer {spec}'s layers "
                          f"({layer_list(chosen)})")
    return chosen


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _worst_first(r) -> float:
    """``--sort worst``'s key: the largest error first; no error figure: a divergence first, anything
    else (routing alike, a stage only one side has) last."""
    return -((math.inf if r.diverged else -1.0) if r.rel_rms_err is None else r.rel_rms_err)


def _print_table(result, sort: str) -> None:
    from rich.table import Table

    from llamatrace.tracing.recorder import stage_key

    def key_of(r):
        return stage_key(r.step, r.layer, r.stage)

    paired = [r for r in result.rows if r.status not in ("only ours", "only reference")]
    if sort == "worst":
        paired.sort(key=_worst_first)
    title = f"{result.extra.get('ours', 'llamatrace')} vs {result.extra.get('reference', 'reference')}"
    table = Table(title=title, title_justify="left")
    for col in ("step", "layer", "stage", "shape", "ref shape", "rel rms err", "max abs err", "cosine", "status"):
        table.add_column(col, justify="left" if col in ("stage", "shape", "ref shape", "status") else "right",
                         no_wrap=True)
    first = result.first_divergence
    for r in paired:
        style = "bold red" if r is first else "red" if r.diverged else None
        table.add_row(str(r.step), "–" if r.layer is None else str(r.layer), r.stage,
                      "×".join(map(str, r.shape or [])), "×".join(map(str, r.ref_shape or [])),
                      _fmt(r.rel_rms_err, ".2e"), _fmt(r.max_abs_err, ".2e"), _fmt(r.cosine, ".6f"),
                      _status(r) + (" ← first" if r is first else ""), style=style)
    print_wide(table)
    for status, side in (("only ours", "only in ours"), ("only reference", "only in the reference")):
        rows = [r for r in result.rows if r.status == status]
        whole = {st for st in {r.stage for r in rows}      # a kind of stage the other side never has
                 if all(r.status == status for r in result.rows if r.stage == st)}
        names = sorted(whole, key=_stage_rank) + [key_of(r) for r in rows if r.stage not in whole]
        if names:                  # a recording of other layers or steps: hundreds of keys, one line each kind
            shown = ", ".join(names[:12]) + (f" … ({len(names)} in all)" if len(names) > 12 else "")
            out.print(f"{side} (not compared): {shown}")
    _print_routing(result.rows)
    for a in result.extra.get("argmax", []):
        if a["reference"] is not None and a["ours"] != a["reference"]:
            out.print(f"step {a['step']}: {result.extra['reference']}'s argmax would be token {a['reference']}, "
                      f"ours is {a['ours']}")
    settings = result.extra.get("settings")
    if settings:
        out.print("reference settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    limits = ", ".join(f"{k} {v:g}" for k, v in result.thresholds.items())
    profile = result.extra.get("profile", "custom")
    local = "; each stage's added error checked too" if result.extra.get("local_errors") else ""
    unpaired = sum(r.status in ("only ours", "only reference") for r in result.rows)
    if first is None:
        out.print(f"no divergence: every paired stage ({len(paired)}) is within its threshold ({profile}: {limits}"
                  f"{local})" + (f"; {unpaired} of {len(result.rows)} arrays are in one recording only, not compared"
                                 if unpaired else ""))
    else:
        where = "model level" if first.layer is None else f"layer {first.layer}"
        if first.status == "shape mismatch":
            what = "shapes differ"
        elif first.status == "routing differs":
            what = (f"other experts chosen at {first.routing['experts_differ']} of {first.routing['tokens']} tokens: "
                    f"{_tokens(first.routing['experts_differ_at'])}")
        elif first.status == "added error":
            added = max(x for x in (first.local_err, first.ref_local_err) if x is not None)
            what = f"adds rel err {added:.3g} of its own, recomputed from the recorded inputs"
        else:
            what = f"rel rms err {first.rel_rms_err:.3g} > {first.threshold:g}, thresholds of {profile}"
            if first.routing and first.routing["experts_differ"]:
                n = first.routing["tokens"]
                what += f"; over the {n - first.routing['experts_differ']} of {n} tokens routed alike"
        out.print(f"[bold red]first divergence:[/] step {first.step}, {where}, {first.stage} ({what})")


def _status(r) -> str:
    """The status cell: the status, and for experts how the tokens were routed (``a/b`` of the layer's tokens)."""
    if r.routing is None:
        return r.status
    n, other, order = r.routing["tokens"], r.routing["experts_differ"], r.routing["order_differs"]
    if r.status in ("routing differs", "rerouted"):
        return f"{r.status} at {other}/{n}"
    if r.stage == "ffn_moe_topk":
        return r.status + (f", {order}/{n} reordered" if order else "")
    return r.status + (f", {other}/{n} rerouted" if other else "")


def _tokens(at: list[int], most: int = 8) -> str:
    """``4, 9, 12`` (``…`` after ``most``)."""
    return ", ".join(map(str, at[:most])) + (", …" if len(at) > most else "")


def _print_routing(rows) -> None:
    """One line on how the experts' slots were paired, when some were (the rows' ``routing``)."""
    layers = {}                            # (step, layer) → its routing summary, the same on each of its rows
    for r in rows:
        if r.routing is not None:
            layers.setdefault((r.step, r.layer), r.routing)
    if not layers:
        return
    n_tokens = sum(x["tokens"] for x in layers.values())
    n_order = sum(x["order_differs"] for x in layers.values())
    other = [(key, x) for key, x in layers.items() if x["experts_differ"]]
    text = (f"experts paired by id (ffn_moe_topk): {n_tokens} (token, layer) pairs, {n_order} with the same "
            f"experts in another order, {sum(x['experts_differ'] for _, x in other)} with other experts")
    if other:
        (step, layer), x = other[0]
        text += (f" (first: step {step}, layer {layer}, tokens {_tokens(x['experts_differ_at'])}),"
                 " left out of the per-expert stages")
    derived = sorted({side for x in layers.values() for side in x.get("derived", [])})
    if derived:
        whose = " and ".join("our" if side == "ours" else "the reference's" for side in derived)
        text += f"; {whose} ids: the top k of ffn_moe_probs"
    out.print(text)


def _stage_rank(stage: str) -> tuple:
    from llamatrace.tracing.stages import STAGE_IDS
    return (STAGE_IDS.index(stage) if stage in STAGE_IDS else len(STAGE_IDS), stage)

