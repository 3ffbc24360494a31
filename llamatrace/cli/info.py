"""``llamatrace info``: a model's config, metadata and tensor table."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from llamatrace.errors import LlamatraceError
from llamatrace.cli.app import app, err, out, plural
from llamatrace.cli.options import ModelOpt, model_file


@app.command()
def info(
    model: ModelOpt = None,
    all_metadata: Annotated[bool, typer.Option("--all", metavar="", help="Also list every metadata key.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the tables: the "
                                           "file, its metadata (the vocabulary's arrays by name only), the "
                                           "config as llamatrace reads it (or why it cannot run it) and "
                                           "every tensor.")] = False,
) -> None:
    """Show a model's config, metadata and tensors (name, type, shape, bytes).

    Examples:

      llamatrace info

      llamatrace info --model Llama-3.2-1B-Instruct-Q8_0.gguf --all

      llamatrace info --json | jq '.tensors[] | select(.type == "Q6_K") | .name'
    """
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    import gguf

    from llamatrace.gguf.reader import open_gguf, tensor_type_name

    path = model_file(model)
    f = open_gguf(path)
    meta = f.metadata
    if json_out:
        _print_json(f, path)
        return
    out.print(f"[bold]{path}[/]  ({f.file_size / 1e6:.1f} MB, GGUF v{f.version})")
    rows: dict[str, str] = {}                    # key → shown value; each key once, in file order
    for key in ("general.name", "general.architecture", "general.file_type"):
        if key in meta:
            rows[key] = str(meta[key])
    if "general.file_type" in rows:             # llama.cpp's enum: 3 (Q4_1)
        with contextlib.suppress(ValueError, TypeError):
            name = gguf.LlamaFileType(meta["general.file_type"]).name
            rows["general.file_type"] += f" ({name.removeprefix('MOSTLY_')})"
    arch = meta.get("general.architecture", "")
    template = meta.get("tokenizer.chat_template")
    for key in f.keys():                        # with --all the vocabulary's arrays too, cut short
        if key.startswith(f"{arch}.") or (all_metadata and not key.startswith("GGUF.")):
            rows.setdefault(key, _short(meta[key] if key in meta else f.field(key)))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id"):
        if key in meta:
            rows.setdefault(key, str(meta[key]))
    if template is not None:
        rows["tokenizer.chat_template"] = (f"({len(str(template))} chars, shown in full below)" if all_metadata
                                           else f"({len(str(template))} chars; --all shows it)")
    rows["tokenizer"] = _tokenizer_kind(f, path.name)
    f.close()                     # the vocabulary was the last thing read from the map; the rest is header
    mix: dict[str, list[int]] = {}             # type → [tensor count, bytes], the file's tensor-type mix
    for t in f.tensors.values():
        entry = mix.setdefault(tensor_type_name(t), [0, 0])
        entry[0] += 1
        entry[1] += int(t.n_bytes)
    cfg = Table(title="Model", show_header=False, box=None)
    for key, text in rows.items():
        cfg.add_row(key, Text(text))
    out.print(cfg)
    if all_metadata and template is not None:
        out.print(Rule("tokenizer.chat_template", align="left"))
        out.print(str(template), markup=False, highlight=False)
        out.print(Rule())
    if "token_embd.weight" in f.tensors:
        from llamatrace.model.config import ModelConfig
        try:
            c = ModelConfig.from_gguf(f)
        except LlamatraceError as exc:
            err.print(f"[yellow]note:[/] llamatrace cannot run this model: {exc}")
        else:
            derived = Table(title="As llamatrace reads it (Meta's ModelArgs names)", show_header=False, box=None)
            shown = c.to_dict()
            if c.n_expert:                         # the gating even where it is the default (softmax)
                shown.setdefault("expert_gating", c.expert_gating)
            for key, value in shown.items():
                unused = (key == "hidden_dim" and c.n_expert > 0     # feed_forward_length, where no dense FFN runs
                          and value not in (c.expert_hidden_dim, c.shexp_hidden_dim))
                derived.add_row(key, f"{value} (no layer uses it: every FFN is the experts')" if unused else str(value))
            derived.add_row("n_rep", f"{plural(c.n_rep, 'query head')} per KV head" + (" (GQA)" if c.n_rep > 1 else ""))
            derived.add_row("output", "tied to token_embd.weight" if "output.weight" not in f.tensors
                            else "output.weight")
            if c.recurrent_layers:                 # memory: KV grows with the context, the states do not
                derived.add_row("memory per token", f"{c.kv_bytes_per_token:,} bytes (KV of the "
                                f"{plural(len(c.attn_layers), 'attention layer')}, float32)")
                derived.add_row("recurrent state", f"{c.state_bytes:,} bytes, fixed (conv + DeltaNet state of "
                                f"{plural(len(c.recurrent_layers), 'layer')}, float32)")
            out.print(derived)
    from llamatrace.kernels.types.registry import summary
    types = Table(title="Tensor types")
    types.add_column("type")
    types.add_column("tensors", justify="right")
    types.add_column("bytes", justify="right")
    types.add_column("matmul kernels (decode / prefill)")
    all_bytes = sum(b for _, b in mix.values()) or 1
    for name, (n, b) in sorted(mix.items(), key=lambda kv: -kv[1][1]):
        types.add_row(name, str(n), f"{b:,} ({100 * b / all_bytes:.0f}%)", summary(name))
    if mix:  # a vocabulary-only file has no tensors
        out.print(types)
    from llamatrace.model.moe import describe_experts
    if (experts := describe_experts(f.tensors.values())) is not None:
        out.print(experts, markup=False, highlight=False)
    table = Table(title=f"Tensors ({len(f.tensors)})")
    table.add_column("name")
    table.add_column("type")
    table.add_column("shape \\[out, in]", justify="right")      # escaped: not a rich markup tag
    table.add_column("bytes", justify="right")
    total = 0
    for name, t in f.tensors.items():
        total += int(t.n_bytes)
        table.add_row(name, tensor_type_name(t), str(list(f.matrix_shape(name))), f"{int(t.n_bytes):,}")
    table.add_row("[bold]total[/]", "", "", f"[bold]{total:,}[/]")
    out.print(table)
    import numba

    from llamatrace.machine.runtime import cpu_model
    from llamatrace.machine.threads import threading_layer
    out.print(f"Runtime: {cpu_model()}, {numba.config.NUMBA_NUM_THREADS} threads, Numba threading layer "
              f"{threading_layer()!r} (what a parallel region costs on each: docs/performance.md, Threads)",
              soft_wrap=True)
    out.print(f"q8 int8 products: {_int8_path(tuple(sorted(mix, key=lambda k: -mix[k][1])))}", soft_wrap=True)


def _print_json(f, path) -> None:
    """``info --json``: the header as one JSON object on stdout (keys: ``path``, ``file_size``,
    ``gguf_version``, ``metadata``, ``bulk_arrays``, ``tokenizer``, ``config`` or ``not_supported``,
    ``tensors`` with ``name``, ``type``, ``shape`` [out, in] and ``bytes``)."""
    import json

    from llamatrace.cli.app import stdout
    from llamatrace.gguf.reader import tensor_type_name
    from llamatrace.model.config import ModelConfig
    from llamatrace.tracing.recorder import finite_json

    def plain(value):                   # bytes and the rest, as text (finite_json took NumPy's values)
        if isinstance(value, bytes):
            return value.decode("utf-8", errors="replace")
        return str(value)

    meta = f.metadata
    doc = {"path": str(path), "file_size": f.file_size, "gguf_version": f.version,
           "metadata": {k: meta[k] for k in f.keys() if k in meta},
           "bulk_arrays": [k for k in f.keys() if k not in meta and not k.startswith("GGUF.")],
           "tokenizer": _tokenizer_kind(f, path.name)}
    f.close()
    if "token_embd.weight" in f.tensors:
        try:
            c = ModelConfig.from_gguf(f)
            doc["config"] = c.to_dict()
        except LlamatraceError as exc:
            doc["not_supported"] = str(exc)
    doc["tensors"] = [{"name": name, "type": tensor_type_name(t), "shape": list(f.matrix_shape(name)),
                       "bytes": int(t.n_bytes)} for name, t in f.tensors.items()]
    stdout.write(json.dumps(finite_json(doc), ensure_ascii=False, default=plain, allow_nan=False) + "\n")


def _int8_path(type_names: tuple[str, ...]) -> str:
    """Which instructions the ``q8`` kernels multiply with here: the vector dot product, and whether
    the prefill of the file's Q4_0 / Q8_0 / Q4_K / Q6_K matrices runs on AMX tiles, and why
    (:func:`llamatrace.kernels.int8.amx.describe`: nothing is measured here)."""
    from llamatrace.kernels.int8 import amx
    from llamatrace.machine.jit import has_vnni

    vector = "vpdpbusd (VNNI)" if has_vnni() else "vpmaddubsw + vpmaddwd (AVX2)"
    return f"{vector}; AMX prefill: {amx.describe(type_names)}"


def _tokenizer_kind(f, source: str) -> str:
    """'SentencePiece (llama.cpp SPM), 32000 tokens, …' or why llamatrace cannot read the vocabulary."""
    from llamatrace.text.tokenizer import Tokenizer
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Tokenizer.from_reader(f, source).describe()
    except LlamatraceError as exc:
        return f"not supported: {exc}"


def _short(value, limit: int = 120) -> str:
    """A metadata value on one table row: long lists and texts cut, saying how long they are."""
    text = str(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} items" if isinstance(value, (list, tuple)) else f"{len(text):,} chars"
    return f"{text[:limit - 1]}… ({size})"
